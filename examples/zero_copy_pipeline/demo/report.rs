//! The figures of a run ([`Report`]), a zero-copy run beside the baseline ([`Comparison`]),
//! and how each stage process ended ([`StageOutcome`]), formatted for people.

use std::fmt;

use super::options::{Mode, PipelineSource, Stage};

/// The figures of one run.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// Zero-copy or pipes.
    pub mode: Mode,
    /// The source asked for.
    pub source: PipelineSource,
    /// What the producer's source calls itself (`shmem`, `shmem+udmabuf`, `dma-heap:system`),
    /// or `private buffers` for the pipes baseline.
    pub source_name: String,
    /// Frames that went through.
    pub frames: u64,
    /// Bytes per frame.
    pub frame_size: usize,
    /// Buffers in the pool (frames in flight).
    pub pool_size: usize,
    /// From the producer's first frame to the consumer's return of the last one.
    pub seconds: f64,
    /// `frames / seconds`.
    pub frames_per_sec: f64,
    /// Frame bytes per second, in MB (10^6 bytes).
    pub megabytes_per_sec: f64,
    /// Frame bytes copied between processes (written into pipes): 0 for zero-copy.
    pub bytes_copied: u64,
    /// Bytes of messages and frame headers sent between the stages.
    pub control_bytes: u64,
    /// fds sent between the stages (each buffer once per hop in zero-copy mode).
    pub fds_passed: u64,
    /// Segments the producer's allocator took from the source for the frames (0 for pipes).
    pub buffers_allocated: u64,
    /// Frames whose every word the consumer checked.
    pub frames_verified: u64,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<9} {:>10.1} frames/s {:>9.1} MB/s  {:>7.3} s  {} frames of {} through {}, pool {}: \
             {} frame bytes copied, {} control bytes, {} fds passed, {} segments allocated, {} frames verified",
            self.mode,
            self.frames_per_sec,
            self.megabytes_per_sec,
            self.seconds,
            self.frames,
            human_bytes(self.frame_size as u64),
            self.source_name,
            self.pool_size,
            self.bytes_copied,
            self.control_bytes,
            self.fds_passed,
            self.buffers_allocated,
            self.frames_verified
        )
    }
}

/// A zero-copy run and the pipes baseline with the same options, measured one after the other.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// The zero-copy run.
    pub zero_copy: Report,
    /// The pipes baseline.
    pub pipes: Report,
}

impl Comparison {
    /// Zero-copy frames/s over the baseline's.
    pub fn speedup(&self) -> f64 {
        self.zero_copy.frames_per_sec / self.pipes.frames_per_sec
    }
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let z = &self.zero_copy;
        writeln!(
            f,
            "source {} ({}): {} frames of {}, at most {} in flight; producer -> transform -> consumer",
            z.source,
            z.source_name,
            z.frames,
            human_bytes(z.frame_size as u64),
            z.pool_size
        )?;
        writeln!(
            f,
            "{:<10} {:>10} {:>10} {:>9} {:>14} {:>14} {:>6} {:>8} {:>9}",
            "mode", "frames/s", "MB/s", "seconds", "bytes copied", "control bytes", "fds", "segments", "verified"
        )?;
        for r in [&self.zero_copy, &self.pipes] {
            writeln!(
                f,
                "{:<10} {:>10.1} {:>10.1} {:>9.3} {:>14} {:>14} {:>6} {:>8} {:>9}",
                r.mode.to_string(),
                r.frames_per_sec,
                r.megabytes_per_sec,
                r.seconds,
                r.bytes_copied,
                r.control_bytes,
                r.fds_passed,
                r.buffers_allocated,
                r.frames_verified
            )?;
        }
        write!(
            f,
            "zero-copy: {:.2}x the frames/s of pipes; frame bytes copied {} (dma-buf fds) vs {} (every frame byte \
             into and out of each of 2 pipes)",
            self.speedup(),
            z.bytes_copied,
            self.pipes.bytes_copied
        )
    }
}

fn human_bytes(n: u64) -> String {
    if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n % (1 << 10) == 0 {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} B")
    }
}

/// How one stage process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageOutcome {
    /// The stage.
    pub stage: Stage,
    /// Its process id.
    pub pid: u32,
    /// Its exit code, if it exited.
    pub code: Option<i32>,
    /// The signal that ended it, if one did.
    pub signal: Option<i32>,
    /// Whether [`run`](super::run) killed it (after another stage failed, or at the timeout).
    pub killed_by_parent: bool,
    /// The error it reported, if it reported one.
    pub error: Option<String>,
    /// Whether that error was its peer hanging up (a consequence, not a cause).
    pub peer_gone: bool,
    /// Whether it reported its figures (it finished its part).
    pub reported: bool,
    /// The end of its stderr.
    pub stderr: String,
}

impl StageOutcome {
    /// It finished its part and exited 0.
    pub fn succeeded(&self) -> bool {
        self.code == Some(0) && self.reported && !self.killed_by_parent
    }

    /// It died of a signal nobody in the pipeline sent (a crash).
    pub fn crashed(&self) -> bool {
        self.signal.is_some() && !self.killed_by_parent
    }
}

impl fmt::Display for StageOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (pid {}) ", self.stage, self.pid)?;
        match (self.code, self.signal) {
            _ if self.killed_by_parent => f.write_str("was killed by the parent")?,
            (Some(c), _) => write!(f, "exited with status {c}")?,
            (None, Some(s)) => write!(f, "was killed by signal {s} ({})", signal_name(s))?,
            (None, None) => f.write_str("ended")?,
        }
        if let Some(e) = &self.error {
            write!(f, ": {e}")?;
        } else if !self.succeeded() {
            let tail = self.stderr.trim();
            if !tail.is_empty() {
                write!(f, "; stderr: {}", tail.lines().last().unwrap_or(tail))?;
            } else if self.code == Some(0) {
                f.write_str(" without reporting")?;
            }
        }
        Ok(())
    }
}

fn signal_name(s: i32) -> &'static str {
    match s {
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        15 => "SIGTERM",
        _ => "signal",
    }
}

pub(super) fn stage_failure(stage: &Stage, outcomes: &[StageOutcome]) -> String {
    let first = outcomes.iter().find(|o| o.stage == *stage).map(ToString::to_string).unwrap_or_default();
    let others: Vec<String> = outcomes.iter().filter(|o| o.stage != *stage).map(ToString::to_string).collect();
    format!("{first}; then {}", others.join("; "))
}

pub(super) fn list_outcomes(outcomes: &[StageOutcome]) -> String {
    outcomes.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}
