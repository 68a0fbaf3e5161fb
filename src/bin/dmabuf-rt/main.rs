//! `dmabuf-rt`: command-line front end.

mod bench;
mod files;
mod svg_cmd;
// The zero-copy pipeline of `bench` is the example's demo, built on `dmabuf_rt::share`: one
// copy of the code for the example, this CLI (`pipeline-stage`) and tests/pipeline.rs.
#[path = "../../../examples/zero_copy_pipeline/demo/mod.rs"]
mod demo;

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
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
             segments at the reserved peak and the reserved/allocated/requested timeline (--svg -
             writes the SVG to stdout and the report to stderr); the trace is at most 1 GiB
  svg SNAPSHOT.json -o OUT.svg [--title TEXT] [--device N]
             draw an allocator snapshot (Snapshot::to_json, dmabuf_rt_snapshot_json, or PyTorch's
             memory snapshot as JSON) as a self-contained SVG: segments coloured by state, and the
             reserved/allocated timeline when it has a trace (- as SNAPSHOT.json reads stdin,
             -o - writes to stdout; the snapshot is at most 1 GiB)
  help       this text";

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let command = args.first().and_then(|a| a.to_str());
    if command == Some(PIPELINE_STAGE) {
        match files::utf8_args(&args[1..]) {
            Ok(stage) => demo::stage_process(&stage),
            Err(e) => {
                eprintln!("dmabuf-rt {PIPELINE_STAGE}: {e}");
                return ExitCode::from(1);
            }
        }
    }
    let (name, result) = match command {
        Some("devices") => ("devices", files::write_stdout(dmabuf_rt::discovery::discover().to_string().as_bytes())),
        Some("bench") => {
            ("bench", files::utf8_args(&args[1..]).and_then(|a| bench::parse(&a)).and_then(|o| bench::run(&o)))
        }
        Some("replay") => ("replay", run_replay(&args[1..])),
        Some("svg") => ("svg", svg_cmd::run(&args[1..])),
        Some("help" | "-h" | "--help") => ("help", files::write_stdout(format!("{USAGE}\n").as_bytes())),
        _ => {
            match args.first() {
                Some(other) => eprintln!("dmabuf-rt: unknown command `{}`\n\n{USAGE}", other.to_string_lossy()),
                None => eprintln!("{USAGE}"),
            }
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dmabuf-rt {name}: {e}");
            ExitCode::from(1)
        }
    }
}

fn run_replay(args: &[OsString]) -> Result<(), String> {
    let mut file: Option<PathBuf> = None;
    let mut source = ReplaySource::Virtual;
    let mut capacity: u64 = 1 << 40;
    let (mut find_min, mut json) = (false, false);
    let mut svg: Option<PathBuf> = None;
    let mut opts = ReplayOptions::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.to_str() {
            Some("--source") => {
                source = match files::text_value(it.next(), "--source", "virtual or shmem")? {
                    "virtual" => ReplaySource::Virtual,
                    "shmem" => ReplaySource::Shmem,
                    other => return Err(format!("--source takes virtual or shmem, not {other:?}")),
                }
            }
            Some("--capacity") => {
                const WANT: &str = "a positive number of bytes";
                capacity = Some(files::text_value(it.next(), "--capacity", WANT)?)
                    .and_then(|v| v.parse().ok())
                    .filter(|&c| c > 0)
                    .ok_or(format!("--capacity takes {WANT}"))?;
            }
            Some("--find-min-capacity") => find_min = true,
            Some("--repeat") => {
                const WANT: &str = "a number of replays from 1 to 10000";
                opts.repeat = Some(files::text_value(it.next(), "--repeat", WANT)?)
                    .and_then(|v| v.parse().ok())
                    .filter(|&n| n > 0 && n <= 10_000)
                    .ok_or(format!("--repeat takes {WANT}"))?;
            }
            Some("--api") => {
                opts.api = files::text_value(it.next(), "--api", "owned or raw")?
                    .parse()
                    .map_err(|e: dmabuf_rt::Error| e.to_string())?;
            }
            Some("--json") => json = true,
            Some("--svg") => svg = Some(it.next().ok_or("--svg takes the SVG file to write (- for stdout)")?.into()),
            Some(f) if f.starts_with("--") => return Err(format!("unexpected argument `{f}`")),
            _ if file.is_none() => file = Some(a.into()),
            _ => return Err(format!("unexpected argument `{}`", a.to_string_lossy())),
        }
    }
    let file = file.ok_or("missing the trace file")?;
    let to_stdout = svg.as_deref().is_some_and(|s| s == std::path::Path::new("-"));
    if let Some(out) = &svg {
        files::refuse_same_file(&file, out)?;
    }
    let text = files::read_input(&file)?;
    let trace = parse_trace(&text).map_err(|e| e.to_string())?;
    drop(text);
    let config = Config::from_env().map_err(|e| e.to_string())?;
    // With --find-min-capacity, the figures of the replay at the capacity asked for come first,
    // then those of the replay at the minimum capacity (`at_min_capacity`).
    let report = replay_report(&trace, source, capacity, &config, find_min, &opts).map_err(|e| e.to_string())?;
    let text = if json { format!("{}\n", report.to_json()) } else { report.to_text() };
    // With --svg -, standard output is the SVG's alone: the report goes to standard error.
    if to_stdout {
        std::io::stderr().write_all(text.as_bytes()).map_err(|e| format!("standard error: {e}"))?;
    } else {
        files::write_stdout(text.as_bytes())?;
    }
    if let Some(out) = svg {
        let pic = replay_picture(&trace, source, capacity, &config, &opts).map_err(|e| e.to_string())?;
        let segments = svg_cmd::segments_of(&pic.at_peak)?;
        let title = format!(
            "{}: at the reserved peak (op {} of {}), {:.1} MiB reserved",
            file.display(),
            pic.peak_op,
            pic.timeline.last().map_or(0, |p| p.op),
            report.peak_reserved_bytes as f64 / (1u64 << 20) as f64
        );
        let doc = dmabuf_rt::caching::svg::render(&title, &segments, &pic.timeline, Some(pic.peak_op));
        if to_stdout {
            files::write_stdout(doc.as_bytes())?;
        } else {
            files::write_file(&out, doc.as_bytes())?;
            eprintln!("dmabuf-rt replay: wrote {} ({} bytes, {} segments)", out.display(), doc.len(), segments.len());
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
