//! A zero-copy frame pipeline: three processes (producer, transform, consumer) joined by Unix
//! sockets that pass dma-buf fds (`SCM_RIGHTS`). Frames come from a pool in the producer and
//! return to it when the consumer is done; every stage maps the buffer and works in place.
//! In the same run the same pipeline is measured with the frames copied through pipes, and
//! both are printed: frames/s, MB/s, frame bytes copied, and the ratio.
//!
//! ```sh
//! cargo run --release --example zero_copy_pipeline -- \
//!     [--frames N] [--size BYTES] [--pool N] [--source memfd|udmabuf|heap:NAME]
//! ```
//!
//! `--size` takes bytes, or `K`/`M` suffixes (4M). The default source is the system heap, else
//! udmabuf, else sealed memfds, whichever this process may use. The stages are this program,
//! re-executed with `--stage ROLE ...`.
//!
//! The pipeline itself is the `demo` module next to this file (its docs tell the protocol),
//! built on `dmabuf_rt::share`; `dmabuf-rt bench` and `tests/pipeline.rs` include the same
//! module.

mod demo;

use std::process::ExitCode;

use demo::{Options, PipelineSource, STAGE_FLAG};

const USAGE: &str =
    "usage: zero_copy_pipeline [--frames N] [--size BYTES|NK|NM] [--pool N] [--source memfd|udmabuf|heap:NAME]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(STAGE_FLAG) {
        demo::stage_process(&args);
    }
    match parse(&args).and_then(|o| run(&o)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("zero_copy_pipeline: {e}");
            ExitCode::from(1)
        }
    }
}

fn parse(args: &[String]) -> Result<Options, String> {
    let mut o = Options { source: PipelineSource::best_available(), ..Options::default() };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or(format!("{a} needs a value\n{USAGE}"));
        match a.as_str() {
            "--frames" => o.frames = value()?.parse().map_err(|_| format!("--frames takes a number\n{USAGE}"))?,
            "--size" => {
                o.frame_size = parse_size(value()?).ok_or(format!("--size takes bytes (or 64K, 4M)\n{USAGE}"))?
            }
            "--pool" => o.pool_size = value()?.parse().map_err(|_| format!("--pool takes a number\n{USAGE}"))?,
            "--source" => o.source = value()?.parse().map_err(|e: demo::PipelineError| e.to_string())?,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unexpected argument `{other}`\n{USAGE}")),
        }
    }
    Ok(o)
}

fn parse_size(s: &str) -> Option<usize> {
    let (num, mult) = match s.trim_end_matches(['B', 'i']) {
        t if t.ends_with(['K', 'k']) => (&t[..t.len() - 1], 1 << 10),
        t if t.ends_with(['M', 'm']) => (&t[..t.len() - 1], 1 << 20),
        t => (t, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mult)
}

fn run(o: &Options) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program to re-execute: {e}"))?;
    let cmp = demo::compare(o, &exe, &[]).map_err(|e| e.to_string())?;
    println!(
        "zero-copy pipeline: 3 processes, dma-buf fds over Unix sockets (SCM_RIGHTS), against the same pipeline \
         through pipes"
    );
    println!("{cmp}");
    Ok(())
}
