//! `dmabuf-rt`: command-line front end.

mod bench;
mod svg_cmd;
// The zero-copy pipeline of `bench` is the example's demo, built on `dmabuf_rt::share`: one
// copy of the code for the example, this CLI (`pipeline-stage`) and tests/pipeline.rs.
#[path = "../../../examples/zero_copy_pipeline/demo/mod.rs"]
mod demo;

use std::process::ExitCode;

use dmabuf_rt::caching::Config;
use dmabuf_rt::caching::replay::{ReplayOptions, ReplaySource, parse_trace, replay_picture, replay_report};

const USAGE: &str = "usage: dmabuf-rt <command>

commands:
  bench [--quick] [--no-pipeline]
             the main job: the caching allocator, queue copies and the zero-copy pipeline on the
             embedded default device (shmem), each against a peer measured in the same run
  devices    list DMA-BUF heaps, udmabuf and DRM nodes, and whether this process may open them
  replay FILE.jsonl [--source virtual|shmem] [--capacity BYTES] [--find-min-capacity] [--repeat N] [--json]
             [--api owned|raw] [--svg OUT.svg]
             replay an allocation trace ({\"t\":ns,\"op\":\"alloc\"|\"free\",\"addr\":n,\"size\":n} per line,
             {\"op\":\"step\"} between steps) through the caching allocator (settings from
             DMABUF_RT_ALLOC_CONF); --repeat replays it N times on one allocator, and the source
             calls and remaps of the warm steps (the second half) are shown apart; --api raw holds
             raw pointers (allocate_raw / free_raw, as C and PyTorch callers do) instead of
             Allocations (owned, the default); --svg draws the
             segments at the reserved peak and the reserved/allocated/requested timeline
  svg SNAPSHOT.json -o OUT.svg [--title TEXT] [--device N]
             draw an allocator snapshot (Snapshot::to_json, dmabuf_rt_snapshot_json, or PyTorch's
             memory snapshot as JSON) as a self-contained SVG: segments coloured by state, and the
             reserved/allocated timeline when it has a trace (-o - writes to stdout)
  help       this text";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(PIPELINE_STAGE) {
        demo::stage_process(&args[1..]);
    }
    match args.first().map(String::as_str) {
        Some("devices") => {
            print!("{}", dmabuf_rt::discovery::discover());
            ExitCode::SUCCESS
        }
        Some("bench") => match bench::parse(&args[1..]).and_then(|o| bench::run(&o)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("dmabuf-rt bench: {e}");
                ExitCode::from(1)
            }
        },
        Some("replay") => match run_replay(&args[1..]) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("dmabuf-rt replay: {e}");
                ExitCode::from(1)
            }
        },
        Some("svg") => match svg_cmd::run(&args[1..]) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("dmabuf-rt svg: {e}");
                ExitCode::from(1)
            }
        },
        Some("help" | "-h" | "--help") => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        Some(other) => {
            eprintln!("dmabuf-rt: unknown command `{other}`\n\n{USAGE}");
            ExitCode::from(2)
        }
        None => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn run_replay(args: &[String]) -> Result<(), String> {
    let mut file = None;
    let mut source = ReplaySource::Virtual;
    let mut capacity: u64 = 1 << 40;
    let (mut find_min, mut json) = (false, false);
    let mut svg = None;
    let mut opts = ReplayOptions::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--source" => {
                source = match it.next().map(String::as_str) {
                    Some("virtual") => ReplaySource::Virtual,
                    Some("shmem") => ReplaySource::Shmem,
                    other => return Err(format!("--source takes virtual or shmem, not {other:?}")),
                }
            }
            "--capacity" => {
                capacity = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&c| c > 0)
                    .ok_or("--capacity takes a positive number of bytes")?;
            }
            "--find-min-capacity" => find_min = true,
            "--repeat" => {
                opts.repeat = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&n| n > 0 && n <= 10_000)
                    .ok_or("--repeat takes a number of replays from 1 to 10000")?;
            }
            "--api" => {
                opts.api = it
                    .next()
                    .ok_or("--api takes owned or raw")?
                    .parse()
                    .map_err(|e: dmabuf_rt::Error| e.to_string())?;
            }
            "--json" => json = true,
            "--svg" => svg = Some(it.next().ok_or("--svg takes the SVG file to write (- for stdout)")?.clone()),
            f if !f.starts_with("--") && file.is_none() => file = Some(f.to_string()),
            other => return Err(format!("unexpected argument `{other}`")),
        }
    }
    let file = file.ok_or("missing the trace file")?;
    let text = std::fs::read_to_string(&file).map_err(|e| format!("{file}: {e}"))?;
    let trace = parse_trace(&text).map_err(|e| e.to_string())?;
    let config = Config::from_env().map_err(|e| e.to_string())?;
    // With --find-min-capacity, the figures of the replay at the capacity asked for come first,
    // then those of the replay at the minimum capacity (`at_min_capacity`).
    let report = replay_report(&trace, source, capacity, &config, find_min, &opts).map_err(|e| e.to_string())?;
    if json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.to_text());
    }
    if let Some(out) = svg {
        let pic = replay_picture(&trace, source, capacity, &config, &opts).map_err(|e| e.to_string())?;
        let segments = svg_cmd::segments_of(&pic.at_peak)?;
        let title = format!(
            "{file}: at the reserved peak (op {} of {}), {:.1} MiB reserved",
            pic.peak_op,
            pic.timeline.last().map_or(0, |p| p.op),
            report.peak_reserved_bytes as f64 / (1u64 << 20) as f64
        );
        let doc = dmabuf_rt::caching::svg::render(&title, &segments, &pic.timeline, Some(pic.peak_op));
        if out == "-" {
            print!("{doc}");
        } else {
            std::fs::write(&out, &doc).map_err(|e| format!("{out}: {e}"))?;
            eprintln!("dmabuf-rt replay: wrote {out} ({} bytes, {} segments)", doc.len(), segments.len());
        }
    }
    Ok(())
}

/// The hidden subcommand the pipeline's stage processes run as (`bench` re-executes this
/// program with it).
const PIPELINE_STAGE: &str = "pipeline-stage";

/// The pipeline rows of `bench`: zero-copy frames/s, the pipes baseline's frames/s, and the
/// bytes the zero-copy run copied. The source is the best this machine offers (udmabuf-exported
/// shmem or the system heap where they exist, else sealed memfds).
fn pipeline_rows(quick: bool) -> Result<(f64, f64, u64), String> {
    use demo::{Options, PipelineSource};
    let opts = Options {
        frames: if quick { 100 } else { 600 },
        source: PipelineSource::best_available(),
        ..Options::default()
    };
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program to re-execute: {e}"))?;
    let cmp = demo::compare(&opts, &exe, &[PIPELINE_STAGE]).map_err(|e| e.to_string())?;
    eprintln!("{cmp}");
    Ok((cmp.zero_copy.frames_per_sec, cmp.pipes.frames_per_sec, cmp.zero_copy.bytes_copied))
}
