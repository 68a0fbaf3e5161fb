//! The process pipeline (the demo of `examples/zero_copy_pipeline/`, on `dmabuf_rt::share`) end to end: frames checked word by word in
//! zero-copy and pipes mode, exact byte, fd and buffer counts, every injected fault (a crash
//! of each stage, a malformed message on each channel, a corrupt frame) failing the pipeline
//! with the right stage named while the others exit on their own, the timeout, and no fd,
//! process or buffer left behind.
//!
//! The stage processes are this test binary: `run` re-executes it with libtest arguments
//! that select `stage_entry` alone, then `--` and the role arguments, which `stage_entry`
//! hands to `demo::stage_process`. That works wherever the test binary runs, the kernel
//! lane included. Tests that need `/dev/dma_heap/system` or `/dev/udmabuf` print
//! `SKIP <test>: <why>` without them (and fail under DMABUF_RT_REQUIRE_DEVICES=1).
//! Every test takes `common::serial()`: several count the process's fds.

mod common;
#[path = "../examples/zero_copy_pipeline/demo/mod.rs"]
mod demo;

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{open_fds, or_skip};
use demo::{Fault, Mode, Options, PipelineError, PipelineSource, Report, Stage, StageOutcome};

/// libtest arguments that run `stage_entry` alone; the role arguments follow `--`.
const STAGE_PREFIX: &[&str] = &["stage_entry", "--exact", "--nocapture", "--test-threads=1", "--"];

/// A stage when re-executed by `run`; otherwise it does nothing.
#[test]
fn stage_entry() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(pos) = args.iter().position(|a| a == "--") {
        if args.get(pos + 1).map(String::as_str) == Some(demo::STAGE_FLAG) {
            demo::stage_process(&args[pos + 1..]);
        }
    }
}

fn exe() -> PathBuf {
    std::env::current_exe().expect("current_exe")
}

fn run(o: &Options) -> Result<Report, PipelineError> {
    demo::run(o, &exe(), STAGE_PREFIX)
}

fn small(mode: Mode) -> Options {
    // Not a whole number of pages: the buffers are rounded up, frames are not.
    Options { frames: 40, frame_size: 100_000, pool_size: 3, mode, ..Options::default() }
}

/// Checks every figure of a successful run that the options determine.
fn check_report(r: &Report, o: &Options) {
    assert_eq!(r.mode, o.mode);
    assert_eq!(r.frames, o.frames);
    assert_eq!(r.frames_verified, o.frames, "the consumer checks every frame");
    assert_eq!(r.frame_size, o.frame_size);
    assert!(r.seconds > 0.0 && r.frames_per_sec > 0.0 && r.megabytes_per_sec > 0.0);
    match o.mode {
        Mode::ZeroCopy => {
            // The pipeline's own messages: a setup message on each of the producer's two
            // channels, a frame with two handles then one on its two hops, an end on each hop,
            // a return per frame (16-byte headers, 64-byte handles); the IPC packets besides.
            let own = 16 * 2 + (16 + 128 + 16 + 64) * o.frames + 16 * 2 + 16 * o.frames;
            assert!(r.control_bytes > own, "{} control bytes, the pipeline's own alone are {own}", r.control_bytes);
            assert_eq!(r.bytes_copied, 0, "zero-copy must copy no frame bytes");
            // Frames come from the producer's allocator: its segments, at most one per frame
            // in flight and released-but-unheard (and far fewer where blocks share segments).
            let bound = 2 * o.frames.min(o.pool_size as u64) + 2;
            assert!((1..=bound).contains(&r.buffers_allocated), "{} segments for {o:?}", r.buffers_allocated);
            // Two setup fds, then each segment's fd once to each of the two stages, however
            // many frames it carried.
            let segment_fds = r.fds_passed - 2;
            assert!(
                (2..=2 * r.buffers_allocated).contains(&segment_fds) && segment_fds % 2 == 0,
                "{} fds passed for {} segments",
                r.fds_passed,
                r.buffers_allocated
            );
        }
        Mode::Pipes => {
            // Frames and ends on two hops, returns on one: 32 bytes each.
            assert_eq!(r.control_bytes, 32 * (2 * (o.frames + 1) + o.frames));
            assert_eq!(r.bytes_copied, 2 * o.frames * o.frame_size as u64, "every frame through two pipes");
            assert_eq!(r.buffers_allocated, 0);
            assert_eq!(r.fds_passed, 0);
        }
    }
    let shown = r.to_string();
    assert!(shown.contains(&format!("{} frame bytes copied", r.bytes_copied)), "{shown}");
}

/// No stage process is left: each pid is gone or no longer our child.
fn assert_reaped(outcomes: &[StageOutcome]) {
    let me = std::process::id().to_string();
    for o in outcomes {
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{}/stat", o.pid)) {
            let ppid = stat.rsplit(')').next().and_then(|r| r.split_whitespace().nth(1)).unwrap_or("");
            assert_ne!(ppid, me, "stage {} (pid {}) is still our child: {stat}", o.stage, o.pid);
        }
    }
}

/// Runs with a fault and returns the failed stage and every outcome.
fn failing(o: &Options) -> (Stage, Vec<StageOutcome>) {
    match run(o) {
        Err(PipelineError::Stage { stage, outcomes }) => {
            assert_eq!(outcomes.len(), 3);
            assert_reaped(&outcomes);
            (stage, outcomes)
        }
        other => panic!("{:?}: expected a stage failure, got {other:?}", o.fault),
    }
}

/// The other stages exited with an error of their own accord: their peer hung up.
fn assert_others_exited_on_hangup(outcomes: &[StageOutcome], failed: Stage) {
    for o in outcomes.iter().filter(|o| o.stage != failed) {
        assert!(!o.killed_by_parent, "{o}: must exit by itself, not be killed");
        assert_eq!(o.code, Some(1), "{o}");
        assert!(o.peer_gone, "{o}: expected a hang-up");
        assert!(!o.succeeded());
    }
}

#[test]
fn zero_copy_frames_are_checked_and_nothing_is_copied() {
    let _serial = common::serial();
    let o = small(Mode::ZeroCopy);
    let r = run(&o).unwrap();
    check_report(&r, &o);
    assert_eq!(r.source_name, "shmem");
    // A pool larger than the run: only the buffers used are passed.
    let o = Options { frames: 2, pool_size: 5, ..o };
    check_report(&run(&o).unwrap(), &o);
    // One buffer: every frame waits for the previous one's return.
    let o = Options { frames: 7, pool_size: 1, frame_size: 8, ..o };
    check_report(&run(&o).unwrap(), &o);
}

#[test]
fn pipes_baseline_copies_every_frame_byte_and_checks_them_too() {
    let _serial = common::serial();
    let o = small(Mode::Pipes);
    let r = run(&o).unwrap();
    check_report(&r, &o);
    assert_eq!(r.source_name, "private buffers");
}

#[test]
fn compare_runs_both_modes_with_the_same_options() {
    let _serial = common::serial();
    let o = Options { frames: 10, frame_size: 64 << 10, ..Options::default() };
    let c = demo::compare(&o, &exe(), STAGE_PREFIX).unwrap();
    check_report(&c.zero_copy, &Options { mode: Mode::ZeroCopy, ..o.clone() });
    check_report(&c.pipes, &Options { mode: Mode::Pipes, ..o });
    assert!(c.speedup() > 0.0);
    let shown = c.to_string();
    assert!(shown.contains("zero-copy") && shown.contains("pipes") && shown.contains("x the frames/s"), "{shown}");
}

#[test]
fn a_crash_of_any_stage_fails_the_pipeline_naming_it_and_the_others_exit_with_errors() {
    let _serial = common::serial();
    let fds = open_fds();
    // Every stage mid-stream in both modes, and the producer before its first frame.
    let mut cases: Vec<(Mode, Stage, u64)> =
        [Mode::ZeroCopy, Mode::Pipes].into_iter().flat_map(|m| Stage::ALL.map(|s| (m, s, 3))).collect();
    cases.push((Mode::ZeroCopy, Stage::Producer, 0));
    for (mode, stage, after) in cases {
        let o = Options { frames: 50, fault: Some(Fault::Crash { stage, after }), ..small(mode) };
        let (failed, outcomes) = failing(&o);
        assert_eq!(failed, stage, "{mode} crash of {stage} after {after}: {outcomes:?}");
        let crashed = outcomes.iter().find(|o| o.stage == stage).unwrap();
        assert!(crashed.crashed(), "{crashed}");
        assert_eq!(crashed.signal, Some(6), "{crashed}: SIGABRT");
        assert_others_exited_on_hangup(&outcomes, stage);
        let msg = PipelineError::Stage { stage, outcomes: outcomes.clone() }.to_string();
        assert!(msg.contains(&format!("pipeline stage `{stage}` failed")), "{msg}");
        assert!(msg.contains("SIGABRT"), "{msg}");
    }
    assert_eq!(open_fds(), fds, "fds leaked by failed runs");
}

#[test]
fn a_malformed_message_is_refused_by_its_receiver() {
    let _serial = common::serial();
    for mode in [Mode::ZeroCopy, Mode::Pipes] {
        // Who sends garbage, and who must refuse it.
        for (sender, receiver, channel) in [
            (Stage::Producer, Stage::Transform, "producer->transform"),
            (Stage::Transform, Stage::Consumer, "transform->consumer"),
            (Stage::Consumer, Stage::Producer, "consumer->producer"),
        ] {
            let o = Options { fault: Some(Fault::Malformed { stage: sender, after: 2 }), ..small(mode) };
            let (failed, outcomes) = failing(&o);
            assert_eq!(failed, receiver, "{mode}, garbage from {sender}: {outcomes:?}");
            let r = outcomes.iter().find(|o| o.stage == receiver).unwrap();
            assert_eq!(r.code, Some(1), "{r}");
            assert!(!r.peer_gone && !r.killed_by_parent, "{r}");
            let err = r.error.as_deref().unwrap_or("");
            assert!(err.contains(channel) && err.contains("malformed message: bad magic"), "{r}");
            for other in outcomes.iter().filter(|o| o.stage != receiver) {
                assert!(!other.succeeded() && !other.killed_by_parent, "{other}");
            }
        }
    }
}

#[test]
fn the_consumer_catches_a_frame_the_transform_skipped() {
    let _serial = common::serial();
    for mode in [Mode::ZeroCopy, Mode::Pipes] {
        let o = Options { fault: Some(Fault::SkipTransform { seq: 4 }), ..small(mode) };
        let (failed, outcomes) = failing(&o);
        assert_eq!(failed, Stage::Consumer, "{outcomes:?}");
        let c = outcomes.iter().find(|o| o.stage == Stage::Consumer).unwrap();
        assert!(c.error.as_deref().unwrap_or("").contains("frame 4 is wrong at byte 0"), "{c}");
        assert_others_exited_on_hangup(&outcomes, Stage::Consumer);
    }
}

#[test]
fn a_pipeline_past_its_timeout_is_killed() {
    let _serial = common::serial();
    let fds = open_fds();
    let o = Options { frames: 1 << 40, frame_size: 8, timeout: Duration::from_millis(300), ..small(Mode::ZeroCopy) };
    let t = Instant::now();
    match run(&o) {
        Err(PipelineError::Timeout { outcomes, .. }) => {
            assert!(outcomes.iter().all(|o| o.killed_by_parent), "{outcomes:?}");
            assert_reaped(&outcomes);
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(30));
    assert_eq!(open_fds(), fds);
}

#[test]
fn bad_options_and_a_missing_program_start_nothing() {
    let _serial = common::serial();
    let fds = open_fds();
    let base = small(Mode::ZeroCopy);
    for o in [
        Options { frames: 0, ..base.clone() },
        Options { frame_size: 0, ..base.clone() },
        Options { frame_size: 12, ..base.clone() },
        Options { pool_size: 0, ..base.clone() },
        Options { pool_size: 5000, ..base.clone() },
        Options { source: PipelineSource::Udmabuf, frame_size: 1 << 30, ..base.clone() },
    ] {
        assert!(matches!(run(&o), Err(PipelineError::Options(_))), "{o:?}");
    }
    match demo::run(&base, std::path::Path::new("/nonexistent/stage"), &[]) {
        Err(PipelineError::Spawn { stage: Stage::Producer, .. }) => {}
        other => panic!("{other:?}"),
    }
    // Role arguments are checked before anything else (fd 0 is not touched).
    let args: Vec<String> = ["--stage", "sorter"].map(String::from).to_vec();
    assert!(demo::stage_main(&args).is_err());
    let args: Vec<String> = ["--stage", "consumer", "--size", "12"].map(String::from).to_vec();
    assert!(demo::stage_main(&args).is_err());
    assert_eq!(open_fds(), fds);
}

/// `Shmem:` of /proc/meminfo, in bytes.
fn shmem_bytes() -> u64 {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap();
    let line = info.lines().find(|l| l.starts_with("Shmem:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// Waits for the machine's shmem to come back to `before` (within `slack`): other processes
/// may allocate some meanwhile, but a leak would stay.
fn assert_shmem_settles(before: u64, slack: u64, what: &str) {
    let mut now = shmem_bytes();
    for _ in 0..50 {
        if now <= before + slack {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
        now = shmem_bytes();
    }
    panic!("{what}: shmem {before} -> {now} bytes: buffers leaked");
}

#[test]
fn crashed_runs_leave_no_fds_processes_or_buffers() {
    let _serial = common::serial();
    let fds = open_fds();
    let before = shmem_bytes();
    // A 24 MiB pool, held by all three stages when the consumer crashes.
    let o = Options { frames: 8, frame_size: 4 << 20, pool_size: 6, ..small(Mode::ZeroCopy) };
    for fault in [None, Some(Fault::Crash { stage: Stage::Consumer, after: 3 })] {
        let o = Options { fault, ..o.clone() };
        match fault {
            None => check_report(&run(&o).unwrap(), &o),
            Some(_) => drop(failing(&o)),
        }
        assert_eq!(open_fds(), fds, "{fault:?}");
        assert_shmem_settles(before, 12 << 20, &format!("{fault:?}"));
    }
}

/// Live dma-bufs, from debugfs (mounted in the kernel lane), if readable.
fn dma_buf_objects() -> Option<u64> {
    let info = std::fs::read_to_string("/sys/kernel/debug/dma_buf/bufinfo").ok()?;
    // "Total N objects, M bytes" (each buffer also has a "Total N devices attached" line).
    let line = info.lines().find(|l| l.starts_with("Total ") && l.contains(" objects"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn device_source(test: &str, source: PipelineSource) {
    let _serial = common::serial();
    let Some(()) = or_skip(test, source.probe()) else { return };
    let fds = open_fds();
    let bufs = dma_buf_objects();
    if let Some(b) = bufs {
        // The count sees a live buffer of this source: the leak check below means something.
        let seg = source.open().unwrap().create_segment(4096).unwrap();
        assert_eq!(dma_buf_objects(), Some(b + 1), "debugfs does not count a live {source} buffer");
        drop(seg);
        assert_eq!(dma_buf_objects(), Some(b));
    }
    let o = Options { frames: 12, frame_size: 256 << 10, pool_size: 3, source: source.clone(), ..Options::default() };
    let r = run(&o).unwrap();
    check_report(&r, &o);
    let name = match &source {
        PipelineSource::Heap(h) => format!("dma-heap:{h}"),
        _ => "shmem+udmabuf".into(),
    };
    assert_eq!(r.source_name, name);
    for stage in Stage::ALL {
        let o = Options { fault: Some(Fault::Crash { stage, after: 5 }), ..o.clone() };
        let (failed, outcomes) = failing(&o);
        assert_eq!(failed, stage);
        assert_others_exited_on_hangup(&outcomes, stage);
    }
    assert_eq!(open_fds(), fds);
    // Straight to stderr, past libtest's capture, so the lane's log shows the check ran.
    let mut err = std::io::stderr();
    match (bufs, dma_buf_objects()) {
        (Some(b), Some(a)) => {
            let _ = writeln!(err, "{test}: {b} dma-bufs before, {a} after");
            assert_eq!(a, b, "dma-bufs leaked");
        }
        _ if std::env::var(dmabuf_rt::testing::REQUIRE_ENV).as_deref() == Ok("1") => {
            panic!("{test}: /sys/kernel/debug/dma_buf/bufinfo unreadable (the kernel lane mounts debugfs)")
        }
        _ => {
            let _ = writeln!(err, "{test}: /sys/kernel/debug/dma_buf/bufinfo unreadable; dma-bufs not counted");
        }
    }
}

#[test]
fn system_heap_buffers_go_through_the_pipeline() {
    device_source("pipeline_system_heap", PipelineSource::Heap("system".into()));
}

#[test]
fn udmabuf_buffers_go_through_the_pipeline() {
    device_source("pipeline_udmabuf", PipelineSource::Udmabuf);
}
