//! Zero-copy frame pipelines between processes: a producer, a transform and a consumer, three
//! processes joined by Unix sockets that carry dma-buf (or sealed memfd) fds with `SCM_RIGHTS`.
//!
//! ```text
//!             frame(id, seq) [+ fd, first use]          frame(id, seq) [+ fd, first use]
//!  producer ---------------------------------> transform --------------------------------> consumer
//!  (pool of pool_size buffers)                                                                 |
//!     ^--------------------------------------- return(id, seq) --------------------------------+
//! ```
//!
//! - **The pool** lives in the producer: `pool_size` buffers from the chosen source
//!   ([`PipelineSource`]), allocated once. A buffer's fd crosses each socket once, with its first
//!   frame; later frames name the buffer by id. When the consumer is done with a frame it sends
//!   the id back and the producer reuses the buffer. Buffers are never allocated per frame.
//! - **Work in place.** The producer writes each frame's contents into the buffer, the transform
//!   rewrites every 8-byte word of it, the consumer checks every word (a wrong frame is an
//!   error, [`PipelineError::Corrupt`]). Shared memory is never a `&[u8]` (see
//!   [`crate::mapping`]), so each stage streams the frame through one 16 KiB stack chunk with the
//!   segment's bounds-checked `read`/`write` inside its CPU-access guard (`DMA_BUF_IOCTL_SYNC`
//!   for dma-bufs). That chunk stays in L1; no frame-sized copy is made and no frame byte
//!   crosses a process boundary, so [`Report::bytes_copied`] is 0. The only bytes that move
//!   are the 32-byte messages ([`Report::control_bytes`]) and, once per buffer and hop, an fd.
//! - **The baseline** ([`Mode::Pipes`]) is the same three processes, the same per-word work
//!   and the same `pool_size` frames in flight, but each stage owns a private frame buffer and
//!   frames travel through two pipes (sized to 1 MiB): every frame byte is copied into each
//!   pipe and out of it again. [`Report::bytes_copied`] counts the frame bytes written into
//!   pipes (2 × frames × frame size).
//! - **Stages are processes started by [`run`]**, which re-executes a program that calls
//!   [`stage_main`] (or [`stage_process`]) when it sees [`STAGE_FLAG`]: the example re-executes
//!   itself, a CLI gives it a subcommand (`dmabuf-rt pipeline-stage`), a test binary a test
//!   function (`tests/pipeline.rs`). Each stage gets a control socket as its stdin (std passes it; nothing is
//!   inherited by accident, every other fd is close-on-exec) and receives its two data fds on it.
//!   It reports its figures, or why it failed, on the same socket.
//! - **Failure.** A stage whose peer hangs up, or that receives a malformed message, exits
//!   with an error; so a crash anywhere unwinds the whole pipeline. [`run`] reaps every stage,
//!   kills any still running after a grace period (or at the timeout, or if `run` itself
//!   fails), and returns [`PipelineError::Stage`] naming the stage that failed first for a
//!   reason of its own, with every stage's outcome. The parent never holds a buffer, so once
//!   the stages are gone so are the buffers. [`Fault`] injects crashes, malformed messages and
//!   corrupt frames for tests.

use std::collections::VecDeque;
use std::fmt;
use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::str::FromStr;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};

use crate::segment::{Access, FdKind, Segment, SegmentKind};
use crate::source::{HeapSource, MemorySource, ShmemSource, Udmabuf};

/// The first of the role arguments [`run`] appends to the stage command line: a program sees
/// it (after its own prefix) and hands the arguments from here on to [`stage_main`].
pub const STAGE_FLAG: &str = "--stage";

/// Frame bytes are streamed through a stack chunk of this size (it stays in L1).
const CHUNK: usize = 16 << 10;
/// Size asked of each pipe of the baseline (`F_SETPIPE_SZ`; 1 MiB is the unprivileged limit).
const PIPE_SIZE: usize = 1 << 20;
/// How long the other stages get to exit on their own after one has failed.
const GRACE: Duration = Duration::from_secs(10);
/// The most fds a message may carry before it is refused (one is the only valid count).
const MAX_FDS: usize = 4;
/// Bytes of a stage's stderr kept for the error report.
const STDERR_TAIL: usize = 2048;

/// `Result` with [`PipelineError`] as the default error.
pub type Result<T, E = PipelineError> = std::result::Result<T, E>;

/// Everything that can go wrong in a pipeline, in the parent or in a stage.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineError {
    /// Options that cannot work (size 0, a pool of 0, a frame over udmabuf's limit, ...).
    #[error("bad pipeline options: {0}")]
    Options(String),
    /// A memory source or segment error (allocation, import, CPU access).
    #[error(transparent)]
    Memory(#[from] crate::Error),
    /// A system call failed.
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: String,
        /// The kernel's answer.
        #[source]
        source: io::Error,
    },
    /// The process at the other end of a channel closed it before the end of the stream
    /// (it exited or crashed).
    #[error("{channel}: the peer hung up before the end of the stream")]
    PeerGone {
        /// The channel, e.g. `producer->transform`.
        channel: &'static str,
    },
    /// A message that breaks the protocol.
    #[error("{channel}: malformed message: {why}")]
    Protocol {
        /// The channel it came on.
        channel: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// The consumer found a frame whose contents are not what the producer and transform made.
    #[error("frame {seq} is wrong at byte {offset}: expected {expected:#018x}, found {found:#018x}")]
    Corrupt {
        /// The frame's sequence number.
        seq: u64,
        /// Byte offset of the first wrong word.
        offset: usize,
        /// The word expected there.
        expected: u64,
        /// The word found.
        found: u64,
    },
    /// A stage process could not be started.
    #[error("cannot start the {stage} stage ({}): {source}", .exe.display())]
    Spawn {
        /// The stage.
        stage: Stage,
        /// The program.
        exe: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A stage failed; `stage` is the one that failed first for a reason of its own (the others
    /// typically exit because their peer hung up).
    #[error("pipeline stage `{stage}` failed: {}", stage_failure(.stage, .outcomes))]
    Stage {
        /// The stage that failed.
        stage: Stage,
        /// What became of every stage.
        outcomes: Vec<StageOutcome>,
    },
    /// No stage failed but the pipeline did not finish in time; every stage was killed.
    #[error("the pipeline did not finish within {waited:?}; stages killed: {}", list_outcomes(.outcomes))]
    Timeout {
        /// The time allowed ([`Options::timeout`]).
        waited: Duration,
        /// What became of every stage.
        outcomes: Vec<StageOutcome>,
    },
    /// [`stage_main`] was called in a process that [`run`] did not start, or with bad arguments.
    #[error("not a pipeline stage: {0}")]
    NotAStage(String),
}

fn stage_failure(stage: &Stage, outcomes: &[StageOutcome]) -> String {
    let first = outcomes.iter().find(|o| o.stage == *stage).map(ToString::to_string).unwrap_or_default();
    let others: Vec<String> = outcomes.iter().filter(|o| o.stage != *stage).map(ToString::to_string).collect();
    format!("{first}; then {}", others.join("; "))
}

fn list_outcomes(outcomes: &[StageOutcome]) -> String {
    outcomes.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}

fn io_err(op: impl Into<String>) -> impl FnOnce(io::Error) -> PipelineError {
    move |source| PipelineError::Io { op: op.into(), source }
}

fn errno(op: &'static str) -> impl FnOnce(Errno) -> PipelineError {
    move |e| PipelineError::Io { op: op.into(), source: e.into() }
}

// ---------------------------------------------------------------------------------------------
// Options and results
// ---------------------------------------------------------------------------------------------

/// One of the three processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Owns the pool; fills each frame.
    Producer,
    /// Rewrites each frame in place.
    Transform,
    /// Checks each frame and returns its buffer to the pool.
    Consumer,
}

impl Stage {
    /// The three stages in pipeline order.
    pub const ALL: [Stage; 3] = [Stage::Producer, Stage::Transform, Stage::Consumer];
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stage::Producer => "producer",
            Stage::Transform => "transform",
            Stage::Consumer => "consumer",
        })
    }
}

impl FromStr for Stage {
    type Err = PipelineError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "producer" => Ok(Stage::Producer),
            "transform" => Ok(Stage::Transform),
            "consumer" => Ok(Stage::Consumer),
            _ => Err(PipelineError::Options(format!("unknown stage `{s}` (producer, transform, consumer)"))),
        }
    }
}

/// How frames travel between the stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Shared buffers: fds over Unix sockets, each stage works in place.
    ZeroCopy,
    /// The baseline: frame bytes copied through pipes into each stage's private buffer.
    Pipes,
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::ZeroCopy => "zero-copy",
            Mode::Pipes => "pipes",
        })
    }
}

impl FromStr for Mode {
    type Err = PipelineError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "zero-copy" => Ok(Mode::ZeroCopy),
            "pipes" => Ok(Mode::Pipes),
            _ => Err(PipelineError::Options(format!("unknown mode `{s}` (zero-copy, pipes)"))),
        }
    }
}

/// Where the producer's pool comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PipelineSource {
    /// Sealed shmem memfds ([`ShmemSource::new`]); works on every Linux.
    Memfd,
    /// Shmem memfds exported as dma-bufs through `/dev/udmabuf` ([`ShmemSource::with_udmabuf`]).
    Udmabuf,
    /// A DMA-BUF heap by name, e.g. `system` ([`HeapSource`]).
    Heap(String),
}

impl PipelineSource {
    /// The system heap if this process may use it, else udmabuf, else memfds.
    pub fn best_available() -> Self {
        let heap = PipelineSource::Heap("system".into());
        if heap.probe().is_ok() {
            heap
        } else if PipelineSource::Udmabuf.probe().is_ok() {
            PipelineSource::Udmabuf
        } else {
            PipelineSource::Memfd
        }
    }

    /// Checks that this process can use the source (opens its device node), without allocating.
    pub fn probe(&self) -> crate::Result<()> {
        match self {
            PipelineSource::Memfd => Ok(()),
            PipelineSource::Udmabuf => Udmabuf::open().map(drop),
            PipelineSource::Heap(name) => HeapSource::open(name).map(drop),
        }
    }

    /// Opens the source.
    pub fn open(&self) -> crate::Result<Box<dyn MemorySource>> {
        Ok(match self {
            PipelineSource::Memfd => Box::new(ShmemSource::new()),
            PipelineSource::Udmabuf => Box::new(ShmemSource::with_udmabuf()?),
            PipelineSource::Heap(name) => Box::new(HeapSource::open(name)?),
        })
    }

    /// The kind of fd its buffers are.
    fn fd_kind(&self) -> FdKind {
        match self {
            PipelineSource::Memfd => FdKind::Memfd,
            PipelineSource::Udmabuf | PipelineSource::Heap(_) => FdKind::DmaBuf,
        }
    }

    fn segment_kind(&self) -> SegmentKind {
        match self {
            PipelineSource::Heap(_) => SegmentKind::Device,
            _ => SegmentKind::Unified,
        }
    }
}

impl fmt::Display for PipelineSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PipelineSource::Memfd => f.write_str("memfd"),
            PipelineSource::Udmabuf => f.write_str("udmabuf"),
            PipelineSource::Heap(name) => write!(f, "heap:{name}"),
        }
    }
}

impl FromStr for PipelineSource {
    type Err = PipelineError;
    /// `memfd`, `udmabuf`, `heap:NAME` (`heap` alone is `heap:system`).
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "memfd" => Ok(PipelineSource::Memfd),
            "udmabuf" => Ok(PipelineSource::Udmabuf),
            "heap" => Ok(PipelineSource::Heap("system".into())),
            _ => match s.strip_prefix("heap:") {
                Some(name) if !name.is_empty() && !name.contains(char::is_whitespace) => {
                    Ok(PipelineSource::Heap(name.into()))
                }
                _ => Err(PipelineError::Options(format!(
                    "unknown source `{s}` (memfd, udmabuf, heap:NAME such as heap:system)"
                ))),
            },
        }
    }
}

/// A fault to inject, for tests of the failure paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// The stage aborts (SIGABRT, no core dump) when it reaches frame `after` (0-based),
    /// having handled `after` frames.
    Crash {
        /// Which stage.
        stage: Stage,
        /// Frames handled before the crash.
        after: u64,
    },
    /// At frame `after` the stage sends a malformed message on its outgoing channel (the
    /// consumer on its return channel) instead of a frame; the receiver must refuse it.
    Malformed {
        /// Which stage.
        stage: Stage,
        /// Frames handled before the bad message.
        after: u64,
    },
    /// The transform leaves frame `seq` as it is; the consumer must notice.
    SkipTransform {
        /// The frame.
        seq: u64,
    },
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::Crash { stage, after } => write!(f, "crash:{stage}:{after}"),
            Fault::Malformed { stage, after } => write!(f, "malformed:{stage}:{after}"),
            Fault::SkipTransform { seq } => write!(f, "skip-transform:{seq}"),
        }
    }
}

impl FromStr for Fault {
    type Err = PipelineError;
    fn from_str(s: &str) -> Result<Self> {
        let bad =
            || PipelineError::Options(format!("bad fault `{s}` (crash:STAGE:N, malformed:STAGE:N, skip-transform:N)"));
        let parts: Vec<&str> = s.split(':').collect();
        match parts.as_slice() {
            ["crash", stage, n] => Ok(Fault::Crash { stage: stage.parse()?, after: n.parse().map_err(|_| bad())? }),
            ["malformed", stage, n] => {
                Ok(Fault::Malformed { stage: stage.parse()?, after: n.parse().map_err(|_| bad())? })
            }
            ["skip-transform", n] => Ok(Fault::SkipTransform { seq: n.parse().map_err(|_| bad())? }),
            _ => Err(bad()),
        }
    }
}

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Frames to push through.
    pub frames: u64,
    /// Bytes per frame (a multiple of 8).
    pub frame_size: usize,
    /// Buffers in the producer's pool, which is also the most frames in flight.
    pub pool_size: usize,
    /// Where the pool comes from (ignored by [`Mode::Pipes`], whose stages own private buffers).
    pub source: PipelineSource,
    /// Zero-copy or the pipes baseline.
    pub mode: Mode,
    /// A fault to inject (tests).
    pub fault: Option<Fault>,
    /// How long [`run`] waits for the stages before killing them.
    pub timeout: Duration,
}

impl Default for Options {
    /// 300 frames of 4 MiB, a pool of 4, memfds, zero-copy, no fault, 120 s.
    fn default() -> Self {
        Self {
            frames: 300,
            frame_size: 4 << 20,
            pool_size: 4,
            source: PipelineSource::Memfd,
            mode: Mode::ZeroCopy,
            fault: None,
            timeout: Duration::from_secs(120),
        }
    }
}

impl Options {
    /// Checks the options can work, before any process is started.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(PipelineError::Options(why));
        if self.frames == 0 {
            return bad("frames must be at least 1".into());
        }
        if self.frame_size == 0 || self.frame_size % 8 != 0 {
            return bad(format!("frame size {} must be a positive multiple of 8 bytes", self.frame_size));
        }
        if self.frame_size as u64 >= 1 << 40 {
            return bad(format!("frame size {} is too large", self.frame_size));
        }
        if self.pool_size == 0 || self.pool_size > 1024 {
            return bad(format!("pool size {} must be between 1 and 1024", self.pool_size));
        }
        if self.mode == Mode::ZeroCopy && self.source == PipelineSource::Udmabuf {
            let limit = Udmabuf::size_limit_mb() << 20;
            if self.frame_size as u64 > limit {
                return bad(format!(
                    "a {}-byte frame is over udmabuf's per-buffer limit of {} MiB (its size_limit_mb parameter)",
                    self.frame_size,
                    limit >> 20
                ));
            }
        }
        if let PipelineSource::Heap(name) = &self.source {
            if name.is_empty() || name.contains(char::is_whitespace) {
                return bad(format!("bad heap name `{name}`"));
            }
        }
        Ok(())
    }

    /// The role arguments of `stage` (what [`stage_main`] parses).
    fn stage_args(&self, stage: Stage) -> Vec<String> {
        let mut a: Vec<String> = vec![
            STAGE_FLAG.into(),
            stage.to_string(),
            "--mode".into(),
            self.mode.to_string(),
            "--source".into(),
            self.source.to_string(),
            "--frames".into(),
            self.frames.to_string(),
            "--size".into(),
            self.frame_size.to_string(),
            "--pool".into(),
            self.pool_size.to_string(),
        ];
        if let Some(f) = self.fault {
            a.push("--fault".into());
            a.push(f.to_string());
        }
        a
    }

    fn from_stage_args(args: &[String]) -> Result<(Stage, Options)> {
        let not_stage = |why: String| PipelineError::NotAStage(why);
        let mut it = args.iter();
        if it.next().map(String::as_str) != Some(STAGE_FLAG) {
            return Err(not_stage(format!("the arguments must start with {STAGE_FLAG} ROLE")));
        }
        let stage: Stage = it.next().ok_or_else(|| not_stage(format!("{STAGE_FLAG} needs a role")))?.parse()?;
        let mut o = Options::default();
        while let Some(key) = it.next() {
            let value = it.next().ok_or_else(|| not_stage(format!("{key} needs a value")))?;
            let num = |v: &str| v.parse::<u64>().map_err(|_| not_stage(format!("{key} takes a number, not `{v}`")));
            match key.as_str() {
                "--mode" => o.mode = value.parse()?,
                "--source" => o.source = value.parse()?,
                "--frames" => o.frames = num(value)?,
                "--size" => o.frame_size = num(value)? as usize,
                "--pool" => o.pool_size = num(value)? as usize,
                "--fault" => o.fault = Some(value.parse()?),
                other => return Err(not_stage(format!("unknown argument `{other}`"))),
            }
        }
        o.validate()?;
        Ok((stage, o))
    }
}

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
    /// Shared buffers the producer allocated (the pool; 0 for pipes).
    pub buffers_allocated: u64,
    /// Frames whose every word the consumer checked.
    pub frames_verified: u64,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<9} {:>10.1} frames/s {:>9.1} MB/s  {:>7.3} s  {} frames of {} through {}, pool {}: \
             {} frame bytes copied, {} control bytes, {} fds passed, {} buffers allocated, {} frames verified",
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
            "source {} ({}): {} frames of {}, pool of {} buffers; producer -> transform -> consumer",
            z.source,
            z.source_name,
            z.frames,
            human_bytes(z.frame_size as u64),
            z.pool_size
        )?;
        writeln!(
            f,
            "{:<10} {:>10} {:>10} {:>9} {:>14} {:>14} {:>6} {:>8} {:>9}",
            "mode", "frames/s", "MB/s", "seconds", "bytes copied", "control bytes", "fds", "buffers", "verified"
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
    /// Whether [`run`] killed it (after another stage failed, or at the timeout).
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

// ---------------------------------------------------------------------------------------------
// The parent: start, supervise, reap
// ---------------------------------------------------------------------------------------------

/// Runs one pipeline: starts the three stages by running `stage_exe` with
/// `stage_args_prefix` followed by the role arguments (which begin with [`STAGE_FLAG`]),
/// supervises them, reaps them all and returns the figures, or the error of the stage that
/// failed. Nothing outlives the call: every stage is reaped, killed first if need be. (The
/// stages also die with the thread that called `run`: they ask for `PR_SET_PDEATHSIG`.)
pub fn run(opts: &Options, stage_exe: &Path, stage_args_prefix: &[&str]) -> Result<Report> {
    opts.validate()?;
    if opts.mode == Mode::ZeroCopy {
        // A missing or forbidden device is the caller's error, not a stage's.
        opts.source.probe()?;
    }
    let links = links(opts.mode)?;
    let mut sup = Supervisor { stages: Vec::with_capacity(3) };
    for (stage, fds) in Stage::ALL.into_iter().zip(links) {
        sup.start(stage, opts, stage_exe, stage_args_prefix, fds)?;
        // `fds` (this process's copies of the stage's ends) are closed here, so that when a
        // stage dies its peers see the hang-up.
    }
    sup.supervise(opts)
}

/// Runs the zero-copy pipeline, then the pipes baseline, with the same options.
pub fn compare(opts: &Options, stage_exe: &Path, stage_args_prefix: &[&str]) -> Result<Comparison> {
    let zero_copy = run(&Options { mode: Mode::ZeroCopy, ..opts.clone() }, stage_exe, stage_args_prefix)?;
    let pipes = run(&Options { mode: Mode::Pipes, ..opts.clone() }, stage_exe, stage_args_prefix)?;
    Ok(Comparison { zero_copy, pipes })
}

/// The two data fds of each stage, in `Stage::ALL` order: producer (out, return), transform
/// (in, out), consumer (in, return).
fn links(mode: Mode) -> Result<[[OwnedFd; 2]; 3]> {
    let (c_ret, p_ret) = seqpacket_pair()?;
    let (p_out, t_in, t_out, c_in) = match mode {
        Mode::ZeroCopy => {
            let (p_out, t_in) = seqpacket_pair()?;
            let (t_out, c_in) = seqpacket_pair()?;
            (p_out, t_in, t_out, c_in)
        }
        Mode::Pipes => {
            let (t_in, p_out) = pipe()?;
            let (c_in, t_out) = pipe()?;
            (p_out, t_in, t_out, c_in)
        }
    };
    Ok([[p_out, p_ret], [t_in, t_out], [c_in, c_ret]])
}

fn seqpacket_pair() -> Result<(OwnedFd, OwnedFd)> {
    rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
        .map_err(errno("socketpair(AF_UNIX, SOCK_SEQPACKET)"))
}

/// A close-on-exec pipe (read end, write end), enlarged to [`PIPE_SIZE`] where allowed.
fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(errno("pipe2"))?;
    // Best effort: a bigger pipe only makes the baseline faster.
    let _ = rustix::pipe::fcntl_setpipe_size(&w, PIPE_SIZE);
    Ok((r, w))
}

/// One stage process as the parent sees it.
struct Running {
    stage: Stage,
    child: Child,
    /// The parent's end of the stage's control socket.
    ctl: OwnedFd,
    stderr: Option<JoinHandle<String>>,
    stderr_tail: String,
    stats: Option<StageStats>,
    error: Option<(bool, String)>,
    status: Option<ExitStatus>,
    killed: bool,
    /// When it was reaped, in order (0 first).
    order: usize,
}

impl Running {
    fn kill_and_reap(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            self.killed = true;
            self.status = self.child.wait().ok().or(Some(ExitStatus::from_raw(9)));
        }
        self.join_stderr();
    }

    fn join_stderr(&mut self) {
        if let Some(h) = self.stderr.take() {
            self.stderr_tail = h.join().unwrap_or_default();
        }
    }

    fn failed(&self) -> bool {
        self.status.is_some() && !self.outcome().succeeded()
    }

    fn outcome(&self) -> StageOutcome {
        let status = self.status.unwrap_or(ExitStatus::from_raw(0));
        StageOutcome {
            stage: self.stage,
            pid: self.child.id(),
            code: status.code(),
            signal: status.signal(),
            killed_by_parent: self.killed,
            error: self.error.as_ref().map(|(_, e)| e.clone()),
            peer_gone: self.error.as_ref().is_some_and(|(gone, _)| *gone),
            reported: self.stats.is_some(),
            stderr: self.stderr_tail.clone(),
        }
    }

    /// Reads one control message, or on end-of-file reaps the stage.
    fn read_control(&mut self, reaped: &mut usize) {
        let mut buf = [0u8; 4096];
        match recv_packet(self.ctl.as_fd(), &mut buf) {
            Ok(Packet::Data { len, .. }) => {
                let text = String::from_utf8_lossy(&buf[..len]);
                if let Some(rest) = text.strip_prefix("failed ") {
                    let (gone, msg) = rest.split_once(' ').unwrap_or((rest, ""));
                    self.error = Some((gone == "peer_gone=1", msg.to_string()));
                } else if let Some(stats) = StageStats::parse(&text) {
                    self.stats = Some(stats);
                } else {
                    self.error = Some((false, format!("unintelligible report `{text}`")));
                }
            }
            // End of file (or a reset from a crashed stage): the stage has exited.
            Ok(Packet::Eof) | Err(_) => {
                self.status = Some(self.child.wait().unwrap_or(ExitStatus::from_raw(1 << 8)));
                self.order = *reaped;
                *reaped += 1;
                self.join_stderr();
            }
        }
    }
}

/// Owns the stage processes; dropping it kills and reaps any still running.
struct Supervisor {
    stages: Vec<Running>,
}

impl Supervisor {
    fn start(&mut self, stage: Stage, opts: &Options, exe: &Path, prefix: &[&str], fds: [OwnedFd; 2]) -> Result<()> {
        let (ctl, child_ctl) = seqpacket_pair()?;
        // The control socket becomes the stage's stdin: std installs it as fd 0 in the child
        // only, so no other process (another thread's child) can inherit it.
        let mut child = Command::new(exe)
            .args(prefix)
            .args(opts.stage_args(stage))
            .stdin(Stdio::from(child_ctl))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| PipelineError::Spawn { stage, exe: exe.to_path_buf(), source })?;
        let stderr = child.stderr.take().map(|mut e| std::thread::spawn(move || tail(&mut e)));
        self.stages.push(Running {
            stage,
            child,
            ctl,
            stderr,
            stderr_tail: String::new(),
            stats: None,
            error: None,
            status: None,
            killed: false,
            order: usize::MAX,
        });
        let setup = format!("setup parent={}", std::process::id());
        let ctl = &self.stages.last().expect("just pushed").ctl;
        send_packet(ctl.as_fd(), setup.as_bytes(), &[fds[0].as_fd(), fds[1].as_fd()])
            .map_err(io_err(format!("send the {stage} stage its channels")))
    }

    fn supervise(mut self, opts: &Options) -> Result<Report> {
        let deadline = Instant::now() + opts.timeout;
        let mut grace_end: Option<Instant> = None;
        let mut reaped = 0;
        let mut timed_out = false;
        loop {
            let live: Vec<usize> = (0..self.stages.len()).filter(|&i| self.stages[i].status.is_none()).collect();
            if live.is_empty() {
                break;
            }
            let now = Instant::now();
            let limit = grace_end.map_or(deadline, |g| g.min(deadline));
            if now >= limit {
                timed_out = grace_end.is_none();
                for &i in &live {
                    self.stages[i].kill_and_reap();
                }
                break;
            }
            let wait = limit - now;
            let ts = rustix::event::Timespec { tv_sec: wait.as_secs() as i64, tv_nsec: wait.subsec_nanos() as i64 };
            let ready: Vec<usize> = {
                use rustix::event::{PollFd, PollFlags};
                let mut pfds: Vec<PollFd<'_>> =
                    live.iter().map(|&i| PollFd::new(&self.stages[i].ctl, PollFlags::IN)).collect();
                match rustix::event::poll(&mut pfds, Some(&ts)) {
                    Ok(_) | Err(Errno::INTR) => {}
                    Err(e) => return Err(errno("poll the stages' control sockets")(e)),
                }
                live.iter().zip(&pfds).filter(|(_, p)| !p.revents().is_empty()).map(|(&i, _)| i).collect()
            };
            for i in ready {
                self.stages[i].read_control(&mut reaped);
            }
            if grace_end.is_none() && self.stages.iter().any(Running::failed) {
                grace_end = Some(Instant::now() + GRACE);
            }
        }
        let outcomes: Vec<StageOutcome> = self.stages.iter().map(Running::outcome).collect();
        if timed_out {
            return Err(PipelineError::Timeout { waited: opts.timeout, outcomes });
        }
        if outcomes.iter().all(StageOutcome::succeeded) {
            let stats: Vec<&StageStats> = self.stages.iter().filter_map(|s| s.stats.as_ref()).collect();
            return Ok(report(opts, &stats));
        }
        // The stage to blame: the first reaped that failed for a reason of its own (a crash, an
        // error other than a hang-up), else the first that failed at all.
        let mut failed: Vec<&Running> = self.stages.iter().filter(|s| !s.outcome().succeeded()).collect();
        failed.sort_by_key(|s| {
            let o = s.outcome();
            (o.killed_by_parent, o.peer_gone, s.order)
        });
        let stage = failed.first().map_or(Stage::Producer, |s| s.stage);
        Err(PipelineError::Stage { stage, outcomes })
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        for s in &mut self.stages {
            s.kill_and_reap();
        }
    }
}

fn report(opts: &Options, stats: &[&StageStats]) -> Report {
    let producer = stats[0];
    let consumer = stats[2];
    let seconds = (producer.elapsed_ns as f64 / 1e9).max(1e-9);
    let frames = consumer.frames;
    Report {
        mode: opts.mode,
        source: opts.source.clone(),
        source_name: producer.source_name.clone(),
        frames,
        frame_size: opts.frame_size,
        pool_size: opts.pool_size,
        seconds,
        frames_per_sec: frames as f64 / seconds,
        megabytes_per_sec: frames as f64 * opts.frame_size as f64 / seconds / 1e6,
        bytes_copied: stats.iter().map(|s| s.bytes_copied).sum(),
        control_bytes: stats.iter().map(|s| s.control_bytes).sum(),
        fds_passed: stats.iter().map(|s| s.fds_passed).sum(),
        buffers_allocated: producer.buffers,
        frames_verified: consumer.verified,
    }
}

/// The last [`STDERR_TAIL`] bytes of a stage's stderr.
fn tail(r: &mut impl Read) -> String {
    let mut keep: VecDeque<u8> = VecDeque::new();
    let mut buf = [0u8; 1024];
    loop {
        match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                keep.extend(&buf[..n]);
                while keep.len() > STDERR_TAIL {
                    keep.pop_front();
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    String::from_utf8_lossy(&Vec::from(keep)).into_owned()
}

// ---------------------------------------------------------------------------------------------
// The stage side
// ---------------------------------------------------------------------------------------------

/// What a stage reports when it is done.
#[derive(Debug, Clone, Default, PartialEq)]
struct StageStats {
    frames: u64,
    bytes_copied: u64,
    control_bytes: u64,
    fds_passed: u64,
    buffers: u64,
    verified: u64,
    elapsed_ns: u64,
    source_name: String,
}

impl StageStats {
    fn to_message(&self) -> String {
        format!(
            "done frames={} bytes_copied={} control_bytes={} fds_passed={} buffers={} verified={} elapsed_ns={} \
             source={}",
            self.frames,
            self.bytes_copied,
            self.control_bytes,
            self.fds_passed,
            self.buffers,
            self.verified,
            self.elapsed_ns,
            self.source_name
        )
    }

    fn parse(text: &str) -> Option<Self> {
        let rest = text.strip_prefix("done ")?;
        let (nums, source) = rest.split_once(" source=")?;
        let mut s = StageStats { source_name: source.to_string(), ..Default::default() };
        for kv in nums.split_whitespace() {
            let (k, v) = kv.split_once('=')?;
            let v: u64 = v.parse().ok()?;
            match k {
                "frames" => s.frames = v,
                "bytes_copied" => s.bytes_copied = v,
                "control_bytes" => s.control_bytes = v,
                "fds_passed" => s.fds_passed = v,
                "buffers" => s.buffers = v,
                "verified" => s.verified = v,
                "elapsed_ns" => s.elapsed_ns = v,
                _ => return None,
            }
        }
        Some(s)
    }
}

/// Acts as one stage, in a process [`run`] started: `args` are the role arguments, from
/// [`STAGE_FLAG`] on. Receives the stage's channels on the control socket (fd 0), does its
/// part, reports to the parent, and returns. An error here means the process should exit
/// non-zero ([`stage_process`] does that).
pub fn stage_main(args: &[String]) -> Result<()> {
    let (stage, opts) = Options::from_stage_args(args)?;
    let ctl = io::stdin().as_fd().try_clone_to_owned().map_err(io_err("dup the control socket (fd 0)"))?;
    let mut buf = [0u8; 256];
    let (len, fds) = match recv_packet(ctl.as_fd(), &mut buf) {
        Ok(Packet::Data { len, fds, truncated: false }) => (len, fds),
        Ok(Packet::Data { .. }) => return Err(PipelineError::NotAStage("the setup message was truncated".into())),
        Ok(Packet::Eof) => {
            return Err(PipelineError::NotAStage("the parent closed the control socket before the setup".into()));
        }
        Err(e) if e.raw_os_error() == Some(Errno::NOTSOCK.raw_os_error()) => {
            return Err(PipelineError::NotAStage(
                "fd 0 is not a socket: stages are started by dmabuf_rt::pipeline::run, which passes them their \
                 control socket as stdin"
                    .into(),
            ));
        }
        Err(e) => return Err(io_err("receive the setup on the control socket (fd 0)")(e)),
    };
    let text = String::from_utf8_lossy(&buf[..len]);
    let parent: i32 = text
        .strip_prefix("setup parent=")
        .and_then(|p| p.trim().parse().ok())
        .ok_or_else(|| PipelineError::NotAStage(format!("unexpected setup message `{text}`")))?;
    let [a, b]: [OwnedFd; 2] = fds
        .try_into()
        .map_err(|v: Vec<OwnedFd>| PipelineError::NotAStage(format!("setup carried {} fds, not 2", v.len())))?;
    // Die with the parent, so that no stage outlives a killed `run`. The check after it
    // covers a parent that died before the call.
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    if rustix::process::getppid().map(|p| p.as_raw_nonzero().get()) != Some(parent) {
        return Err(PipelineError::NotAStage("the parent exited before the stage started".into()));
    }
    let result = run_stage(stage, &opts, a, b);
    let message = match &result {
        Ok(stats) => stats.to_message(),
        Err(e) => {
            let mut m = format!("failed peer_gone={} {e}", u8::from(matches!(e, PipelineError::PeerGone { .. })));
            truncate_at_char(&mut m, 3000);
            m
        }
    };
    // If the parent is gone there is nobody to tell.
    let _ = send_packet(ctl.as_fd(), message.as_bytes(), &[]);
    result.map(drop)
}

/// [`stage_main`] as a whole process: exits 0 when the stage did its part, else prints the
/// error on stderr and exits 1. For `main` functions: `if args[0] == STAGE_FLAG {
/// stage_process(&args) }`.
pub fn stage_process(args: &[String]) -> ! {
    match stage_main(args) {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            let role = args.get(1).map_or("?", String::as_str);
            eprintln!("dmabuf-rt pipeline stage {role}: {e}");
            std::process::exit(1)
        }
    }
}

/// Cuts `s` to at most `max` bytes, at a character boundary.
fn truncate_at_char(s: &mut String, max: usize) {
    let mut i = max.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    s.truncate(i);
}

fn run_stage(stage: Stage, o: &Options, a: OwnedFd, b: OwnedFd) -> Result<StageStats> {
    match (o.mode, stage) {
        (Mode::ZeroCopy, Stage::Producer) => {
            producer(o, Out::Socket(Channel::new(a, "producer->transform")), Channel::new(b, "consumer->producer"))
        }
        (Mode::Pipes, Stage::Producer) => {
            producer(o, Out::Pipe(PipeOut::new(a, "producer->transform pipe")), Channel::new(b, "consumer->producer"))
        }
        (Mode::ZeroCopy, Stage::Transform) => transform(
            o,
            In::Socket(Channel::new(a, "producer->transform")),
            Out::Socket(Channel::new(b, "transform->consumer")),
        ),
        (Mode::Pipes, Stage::Transform) => transform(
            o,
            In::Pipe(PipeIn::new(a, "producer->transform pipe")),
            Out::Pipe(PipeOut::new(b, "transform->consumer pipe")),
        ),
        (Mode::ZeroCopy, Stage::Consumer) => {
            consumer(o, In::Socket(Channel::new(a, "transform->consumer")), Channel::new(b, "consumer->producer"))
        }
        (Mode::Pipes, Stage::Consumer) => {
            consumer(o, In::Pipe(PipeIn::new(a, "transform->consumer pipe")), Channel::new(b, "consumer->producer"))
        }
    }
}

/// Crashes here if the fault says so: no core dump, no destructors, like a real crash.
fn crash_point(o: &Options, stage: Stage, frames_done: u64) {
    if o.fault == Some(Fault::Crash { stage, after: frames_done }) {
        let _ = rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable);
        std::process::abort();
    }
}

fn malformed_now(o: &Options, stage: Stage, frames_done: u64) -> bool {
    o.fault == Some(Fault::Malformed { stage, after: frames_done })
}

/// Where a stage's frames go.
enum Out {
    /// Zero-copy: frame messages, the buffer's fd on its first use.
    Socket(Channel),
    /// Baseline: header and frame bytes into a pipe.
    Pipe(PipeOut),
}

/// Where a stage's frames come from.
enum In {
    Socket(Channel),
    Pipe(PipeIn),
}

/// A frame as a stage holds it: a shared buffer, or the stage's private buffer (baseline).
enum Frames {
    Shared { segs: Vec<Option<Segment>>, fd_sent: Vec<bool>, expect: FdKind, kind: SegmentKind },
    Private(Vec<u8>),
}

impl Frames {
    fn for_receiver(o: &Options) -> Self {
        match o.mode {
            Mode::ZeroCopy => Frames::Shared {
                segs: (0..o.pool_size).map(|_| None).collect(),
                fd_sent: vec![false; o.pool_size],
                expect: o.source.fd_kind(),
                kind: o.source.segment_kind(),
            },
            Mode::Pipes => Frames::Private(vec![0; o.frame_size]),
        }
    }
}

fn producer(o: &Options, mut out: Out, mut ret: Channel) -> Result<StageStats> {
    let mut st = StageStats::default();
    let mut private = Vec::new();
    let pool: Vec<Segment> = match o.mode {
        Mode::ZeroCopy => {
            let source = o.source.open()?;
            st.source_name = source.name();
            let pool = (0..o.pool_size).map(|_| source.allocate(o.frame_size)).collect::<crate::Result<Vec<_>>>()?;
            st.buffers = pool.len() as u64;
            pool
        }
        Mode::Pipes => {
            st.source_name = "private buffers".into();
            private = vec![0u8; o.frame_size];
            Vec::new()
        }
    };
    let mut fd_sent = vec![false; o.pool_size];
    let mut free: Vec<u32> = (0..o.pool_size as u32).rev().collect();
    let mut in_flight: VecDeque<(u32, u64)> = VecDeque::new();
    let start = Instant::now();
    for seq in 0..o.frames {
        crash_point(o, Stage::Producer, seq);
        while free.is_empty() {
            free.push(take_return(&mut ret, &mut in_flight)?);
        }
        let id = free.pop().expect("a free buffer");
        let msg = Msg::frame(id, seq, o.frame_size as u64);
        let bad = malformed_now(o, Stage::Producer, seq);
        match &mut out {
            Out::Socket(ch) => {
                let seg = &pool[id as usize];
                produce_in_place(seg, seq, o.frame_size)?;
                let first = !fd_sent[id as usize];
                if bad {
                    ch.send_raw(&GARBAGE, None)?;
                } else {
                    ch.send(&msg, first.then(|| seg.as_fd()))?;
                }
                if first {
                    fd_sent[id as usize] = true;
                    st.fds_passed += 1;
                }
            }
            Out::Pipe(p) => {
                produce_bytes(seq, 0, &mut private);
                p.header(&if bad { GARBAGE } else { msg.encode() })?;
                p.frame(&private)?;
            }
        }
        in_flight.push_back((id, seq));
        st.frames += 1;
    }
    while !in_flight.is_empty() {
        take_return(&mut ret, &mut in_flight)?;
    }
    st.elapsed_ns = start.elapsed().as_nanos() as u64;
    match &mut out {
        Out::Socket(ch) => ch.send(&Msg::end(o.frames), None)?,
        Out::Pipe(p) => p.header(&Msg::end(o.frames).encode())?,
    }
    st.control_bytes = ret.sent + out.control_sent();
    st.bytes_copied = out.frame_bytes_sent();
    Ok(st)
}

/// Waits for the consumer to return the oldest frame in flight; returns its buffer id.
fn take_return(ret: &mut Channel, in_flight: &mut VecDeque<(u32, u64)>) -> Result<u32> {
    let (msg, fd) = ret.recv()?;
    if fd.is_some() {
        return Err(ret.protocol("a return carried an fd".into()));
    }
    if msg.kind != Kind::Return {
        return Err(ret.protocol(format!("expected a return, got {:?}", msg.kind)));
    }
    match in_flight.front() {
        Some(&(id, seq)) if id == msg.id && seq == msg.seq => {
            in_flight.pop_front();
            Ok(id)
        }
        front => Err(ret.protocol(format!(
            "return of buffer {} frame {}, but the oldest frame in flight is {front:?}",
            msg.id, msg.seq
        ))),
    }
}

fn transform(o: &Options, mut input: In, mut out: Out) -> Result<StageStats> {
    let mut st = StageStats { source_name: o.source.to_string(), ..Default::default() };
    let mut frames = Frames::for_receiver(o);
    let mut seq = 0;
    while let Some((msg, first_fd)) = receive_frame(o, &mut input, &mut frames, seq)? {
        crash_point(o, Stage::Transform, seq);
        let bad = malformed_now(o, Stage::Transform, seq);
        let skip = o.fault == Some(Fault::SkipTransform { seq });
        match (&mut frames, &mut out) {
            (Frames::Shared { segs, fd_sent, .. }, Out::Socket(ch)) => {
                let seg = segs[msg.id as usize].as_ref().expect("received");
                if !skip {
                    transform_in_place(seg, seq, o.frame_size)?;
                }
                let first = first_fd && !fd_sent[msg.id as usize];
                if bad {
                    ch.send_raw(&GARBAGE, None)?;
                } else {
                    ch.send(&msg, first.then(|| seg.as_fd()))?;
                }
                if first {
                    fd_sent[msg.id as usize] = true;
                    st.fds_passed += 1;
                }
            }
            (Frames::Private(buf), Out::Pipe(p)) => {
                if !skip {
                    transform_bytes(seq, buf);
                }
                p.header(&if bad { GARBAGE } else { msg.encode() })?;
                p.frame(buf)?;
            }
            _ => unreachable!("one mode throughout"),
        }
        st.frames += 1;
        seq += 1;
    }
    match &mut out {
        Out::Socket(ch) => ch.send(&Msg::end(seq), None)?,
        Out::Pipe(p) => p.header(&Msg::end(seq).encode())?,
    }
    st.control_bytes = out.control_sent();
    st.bytes_copied = out.frame_bytes_sent();
    Ok(st)
}

fn consumer(o: &Options, mut input: In, mut ret: Channel) -> Result<StageStats> {
    let mut st = StageStats { source_name: o.source.to_string(), ..Default::default() };
    let mut frames = Frames::for_receiver(o);
    let mut seq = 0;
    while let Some((msg, _)) = receive_frame(o, &mut input, &mut frames, seq)? {
        crash_point(o, Stage::Consumer, seq);
        match &frames {
            Frames::Shared { segs, .. } => {
                verify_in_place(segs[msg.id as usize].as_ref().expect("received"), seq, o.frame_size)?
            }
            Frames::Private(buf) => verify_bytes(seq, 0, buf)?,
        }
        st.verified += 1;
        if malformed_now(o, Stage::Consumer, seq) {
            ret.send_raw(&GARBAGE, None)?;
        } else {
            ret.send(&Msg::ret(msg.id, seq), None)?;
        }
        st.frames += 1;
        seq += 1;
    }
    st.control_bytes = ret.sent;
    Ok(st)
}

/// Receives frame `seq` (or the end of the stream: `None`) and checks it: its buffer id, its
/// length, its fd (exactly on the buffer's first use), its sequence number. Shared buffers are
/// imported on first use; private ones are filled from the pipe. Returns the message and
/// whether this was the buffer's first use here.
fn receive_frame(o: &Options, input: &mut In, frames: &mut Frames, seq: u64) -> Result<Option<(Msg, bool)>> {
    let (msg, fd, name) = match input {
        In::Socket(ch) => {
            let (m, fd) = ch.recv()?;
            (m, fd, ch.name)
        }
        In::Pipe(p) => (p.header()?, None, p.name),
    };
    let protocol = |why: String| PipelineError::Protocol { channel: name, why };
    match msg.kind {
        Kind::End if msg.seq == seq && seq == o.frames && fd.is_none() => return Ok(None),
        Kind::End => {
            return Err(protocol(format!("end of stream after {} frames, but {seq} of {} arrived", msg.seq, o.frames)));
        }
        Kind::Return => return Err(protocol("a return message on a frame channel".into())),
        Kind::Frame => {}
    }
    if msg.seq != seq || seq >= o.frames {
        return Err(protocol(format!("frame {} where frame {seq} of {} was due", msg.seq, o.frames)));
    }
    if msg.len != o.frame_size as u64 {
        return Err(protocol(format!("frame of {} bytes, expected {}", msg.len, o.frame_size)));
    }
    if msg.id as usize >= o.pool_size {
        return Err(protocol(format!("buffer id {} outside the pool of {}", msg.id, o.pool_size)));
    }
    let first = match frames {
        Frames::Shared { segs, expect, kind, .. } => match (&segs[msg.id as usize], fd) {
            (None, Some(fd)) => {
                let seg = Segment::import(&fd, *kind)?;
                if seg.fd_kind() != *expect {
                    return Err(protocol(format!(
                        "buffer {} is a {:?}, expected a {:?}",
                        msg.id,
                        seg.fd_kind(),
                        expect
                    )));
                }
                if seg.len() < o.frame_size {
                    return Err(protocol(format!("buffer {} holds {} bytes, less than a frame", msg.id, seg.len())));
                }
                segs[msg.id as usize] = Some(seg);
                true
            }
            (Some(_), None) => false,
            (None, None) => return Err(protocol(format!("frame {seq} uses buffer {} before its fd came", msg.id))),
            (Some(_), Some(_)) => return Err(protocol(format!("buffer {}'s fd came twice", msg.id))),
        },
        Frames::Private(buf) => match input {
            In::Pipe(p) => {
                p.read(buf)?;
                false
            }
            In::Socket(_) => unreachable!("one mode throughout"),
        },
    };
    Ok(Some((msg, first)))
}

// ---------------------------------------------------------------------------------------------
// The work: a pattern per frame, a per-word transform, a check of every word
// ---------------------------------------------------------------------------------------------

fn pattern_word(seq: u64, word: u64) -> u64 {
    (seq.rotate_left(40) ^ word).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn transform_word(w: u64, seq: u64) -> u64 {
    w.rotate_left(17) ^ seq
}

fn produce_bytes(seq: u64, first_word: u64, out: &mut [u8]) {
    for (k, w) in out.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&pattern_word(seq, first_word + k as u64).to_le_bytes());
    }
}

fn transform_bytes(seq: u64, buf: &mut [u8]) {
    for w in buf.chunks_exact_mut(8) {
        let v = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        w.copy_from_slice(&transform_word(v, seq).to_le_bytes());
    }
}

fn verify_bytes(seq: u64, first_word: u64, buf: &[u8]) -> Result<()> {
    for (k, w) in buf.chunks_exact(8).enumerate() {
        let found = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        let word = first_word + k as u64;
        let expected = transform_word(pattern_word(seq, word), seq);
        if found != expected {
            return Err(PipelineError::Corrupt { seq, offset: word as usize * 8, expected, found });
        }
    }
    Ok(())
}

/// Writes frame `seq` into the buffer, chunk by chunk, inside a write access.
fn produce_in_place(seg: &Segment, seq: u64, len: usize) -> Result<()> {
    let cpu = seg.cpu_access(Access::Write)?;
    let mut chunk = [0u8; CHUNK];
    for off in (0..len).step_by(CHUNK) {
        let n = CHUNK.min(len - off);
        produce_bytes(seq, (off / 8) as u64, &mut chunk[..n]);
        cpu.write(off, &chunk[..n])?;
    }
    cpu.end()?;
    Ok(())
}

/// Rewrites every word of the frame where it lies: each chunk is read, transformed and
/// written back inside one read-write access.
fn transform_in_place(seg: &Segment, seq: u64, len: usize) -> Result<()> {
    let cpu = seg.cpu_access(Access::ReadWrite)?;
    let mut chunk = [0u8; CHUNK];
    for off in (0..len).step_by(CHUNK) {
        let n = CHUNK.min(len - off);
        cpu.read(off, &mut chunk[..n])?;
        transform_bytes(seq, &mut chunk[..n]);
        cpu.write(off, &chunk[..n])?;
    }
    cpu.end()?;
    Ok(())
}

/// Checks every word of the frame inside a read access.
fn verify_in_place(seg: &Segment, seq: u64, len: usize) -> Result<()> {
    let cpu = seg.cpu_access(Access::Read)?;
    let mut chunk = [0u8; CHUNK];
    for off in (0..len).step_by(CHUNK) {
        let n = CHUNK.min(len - off);
        cpu.read(off, &mut chunk[..n])?;
        verify_bytes(seq, (off / 8) as u64, &chunk[..n])?;
    }
    cpu.end()?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Messages and channels
// ---------------------------------------------------------------------------------------------

const MAGIC: [u8; 4] = *b"DRPF";
const MSG_LEN: usize = 32;
/// What [`Fault::Malformed`] sends.
const GARBAGE: [u8; MSG_LEN] = [0xa5; MSG_LEN];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Frame,
    End,
    Return,
}

/// The one message of the protocol, 32 bytes little-endian: magic `DRPF`, kind (1 frame, 2 end,
/// 3 return), 3 zero bytes, buffer id (u32), 4 zero bytes, sequence number (u64; for an end,
/// the number of frames), frame length (u64).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Msg {
    kind: Kind,
    id: u32,
    seq: u64,
    len: u64,
}

impl Msg {
    fn frame(id: u32, seq: u64, len: u64) -> Self {
        Self { kind: Kind::Frame, id, seq, len }
    }

    fn end(frames: u64) -> Self {
        Self { kind: Kind::End, id: 0, seq: frames, len: 0 }
    }

    fn ret(id: u32, seq: u64) -> Self {
        Self { kind: Kind::Return, id, seq, len: 0 }
    }

    fn encode(&self) -> [u8; MSG_LEN] {
        let mut b = [0u8; MSG_LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4] = match self.kind {
            Kind::Frame => 1,
            Kind::End => 2,
            Kind::Return => 3,
        };
        b[8..12].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Result<Self, String> {
        if b.len() != MSG_LEN {
            return Err(format!("{} bytes, expected {MSG_LEN}", b.len()));
        }
        if b[..4] != MAGIC {
            return Err(format!("bad magic {:02x?}", &b[..4]));
        }
        let kind = match b[4] {
            1 => Kind::Frame,
            2 => Kind::End,
            3 => Kind::Return,
            k => return Err(format!("unknown kind {k}")),
        };
        if b[5..8] != [0; 3] || b[12..16] != [0; 4] {
            return Err("nonzero padding".into());
        }
        let word = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().expect("8 bytes"));
        Ok(Self {
            kind,
            id: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
            seq: word(16..24),
            len: word(24..32),
        })
    }
}

/// One end of a `SOCK_SEQPACKET` socket between two stages.
struct Channel {
    fd: OwnedFd,
    name: &'static str,
    /// Bytes of messages sent.
    sent: u64,
}

impl Channel {
    fn new(fd: OwnedFd, name: &'static str) -> Self {
        Self { fd, name, sent: 0 }
    }

    fn send(&mut self, msg: &Msg, fd: Option<BorrowedFd<'_>>) -> Result<()> {
        self.send_raw(&msg.encode(), fd)
    }

    fn send_raw(&mut self, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> Result<()> {
        let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
        send_packet(self.fd.as_fd(), bytes, &fds).map_err(|e| self.io_error("send", e))?;
        self.sent += bytes.len() as u64;
        Ok(())
    }

    /// One message and the fd it carried, if any. End of file is [`PipelineError::PeerGone`];
    /// a message of the wrong size, with more than one fd, or truncated, is refused (any fds
    /// it carried are closed).
    fn recv(&mut self) -> Result<(Msg, Option<OwnedFd>)> {
        let mut buf = [0u8; MSG_LEN + 1];
        match recv_packet(self.fd.as_fd(), &mut buf).map_err(|e| self.io_error("receive", e))? {
            Packet::Eof => Err(PipelineError::PeerGone { channel: self.name }),
            Packet::Data { truncated: true, .. } => Err(self.protocol("message or its fds truncated".into())),
            Packet::Data { len, mut fds, .. } => {
                if fds.len() > 1 {
                    return Err(self.protocol(format!("{} fds attached to one message", fds.len())));
                }
                let msg = Msg::decode(&buf[..len]).map_err(|why| self.protocol(why))?;
                Ok((msg, fds.pop()))
            }
        }
    }

    fn protocol(&self, why: String) -> PipelineError {
        PipelineError::Protocol { channel: self.name, why }
    }

    fn io_error(&self, what: &str, e: io::Error) -> PipelineError {
        match e.kind() {
            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => {
                PipelineError::PeerGone { channel: self.name }
            }
            _ => PipelineError::Io { op: format!("{what} on {}", self.name), source: e },
        }
    }
}

/// The read end of a baseline pipe.
struct PipeIn {
    file: File,
    name: &'static str,
}

impl PipeIn {
    fn new(fd: OwnedFd, name: &'static str) -> Self {
        Self { file: File::from(fd), name }
    }

    fn header(&mut self) -> Result<Msg> {
        let mut b = [0u8; MSG_LEN];
        self.read(&mut b)?;
        Msg::decode(&b).map_err(|why| PipelineError::Protocol { channel: self.name, why })
    }

    fn read(&mut self, buf: &mut [u8]) -> Result<()> {
        self.file.read_exact(buf).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => PipelineError::PeerGone { channel: self.name },
            _ => PipelineError::Io { op: format!("read from {}", self.name), source: e },
        })
    }
}

/// The write end of a baseline pipe.
struct PipeOut {
    file: File,
    name: &'static str,
    headers: u64,
    frame_bytes: u64,
}

impl PipeOut {
    fn new(fd: OwnedFd, name: &'static str) -> Self {
        Self { file: File::from(fd), name, headers: 0, frame_bytes: 0 }
    }

    fn header(&mut self, bytes: &[u8]) -> Result<()> {
        self.write(bytes)?;
        self.headers += bytes.len() as u64;
        Ok(())
    }

    /// Copies the frame into the pipe: these are the bytes the baseline copies.
    fn frame(&mut self, bytes: &[u8]) -> Result<()> {
        self.write(bytes)?;
        self.frame_bytes += bytes.len() as u64;
        Ok(())
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        // A reader that is gone is EPIPE here: Rust programs ignore SIGPIPE.
        self.file.write_all(bytes).map_err(|e| match e.kind() {
            io::ErrorKind::BrokenPipe => PipelineError::PeerGone { channel: self.name },
            _ => PipelineError::Io { op: format!("write to {}", self.name), source: e },
        })
    }
}

impl Out {
    fn control_sent(&self) -> u64 {
        match self {
            Out::Socket(ch) => ch.sent,
            Out::Pipe(p) => p.headers,
        }
    }

    /// Frame bytes copied out of this process: only the baseline copies any.
    fn frame_bytes_sent(&self) -> u64 {
        match self {
            Out::Socket(_) => 0,
            Out::Pipe(p) => p.frame_bytes,
        }
    }
}

/// A received packet.
enum Packet {
    /// The peer closed the socket.
    Eof,
    Data {
        len: usize,
        fds: Vec<OwnedFd>,
        /// The message or its control data did not fit (fds that did not fit were closed).
        truncated: bool,
    },
}

/// Sends one packet with `fds` attached (`SCM_RIGHTS`). Never raises SIGPIPE.
fn send_packet(sock: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other(format!("{} fds do not fit in one message", fds.len())));
    }
    loop {
        match rustix::net::sendmsg(sock, &[IoSlice::new(data)], &mut control, SendFlags::NOSIGNAL) {
            Ok(n) if n == data.len() => return Ok(()),
            Ok(n) => return Err(io::Error::other(format!("sent {n} of {} bytes", data.len()))),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Receives one packet; received fds are close-on-exec `OwnedFd`s.
fn recv_packet(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<Packet> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = loop {
        match rustix::net::recvmsg(sock, &mut [IoSliceMut::new(&mut *buf)], &mut control, RecvFlags::CMSG_CLOEXEC) {
            Err(Errno::INTR) => continue,
            r => break r?,
        }
    };
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = m {
            fds.extend(rights);
        }
    }
    let truncated = msg.flags.intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC);
    if msg.bytes == 0 && fds.is_empty() && !truncated {
        return Ok(Packet::Eof);
    }
    Ok(Packet::Data { len: msg.bytes.min(buf.len()), fds, truncated })
}

/// The private message parsers, for the fuzzer (`fuzz/fuzz_targets/parsers.rs`); not API.
#[doc(hidden)]
pub mod fuzzing {
    /// A data-channel message decoded and encoded again (`None`: refused).
    pub fn message(b: &[u8]) -> Option<[u8; super::MSG_LEN]> {
        super::Msg::decode(b).ok().map(|m| m.encode())
    }

    /// A stage's report parsed and formatted again (`None`: refused).
    pub fn report(text: &str) -> Option<String> {
        super::StageStats::parse(text).map(|s| s.to_message())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Channel, Channel) {
        let (a, b) = seqpacket_pair().unwrap();
        (Channel::new(a, "a"), Channel::new(b, "b"))
    }

    #[test]
    fn messages_round_trip_and_bad_ones_are_refused() {
        for m in [Msg::frame(3, 7, 4096), Msg::end(10), Msg::ret(1, u64::MAX)] {
            assert_eq!(Msg::decode(&m.encode()), Ok(m));
        }
        let good = Msg::frame(1, 2, 3).encode();
        assert!(Msg::decode(&good[..31]).unwrap_err().contains("31 bytes"));
        assert!(Msg::decode(&GARBAGE).unwrap_err().contains("magic"));
        let mut b = good;
        b[4] = 9;
        assert!(Msg::decode(&b).unwrap_err().contains("kind 9"));
        let mut b = good;
        b[13] = 1;
        assert!(Msg::decode(&b).unwrap_err().contains("padding"));
    }

    #[test]
    fn channels_pass_fds_and_refuse_malformed_messages() {
        let (mut a, mut b) = pair();
        let memfd = crate::sys::memfd::create_sealed("pipeline-test", 4096).unwrap();
        a.send(&Msg::frame(0, 0, 4096), Some(memfd.as_fd())).unwrap();
        let (m, fd) = b.recv().unwrap();
        assert_eq!(m, Msg::frame(0, 0, 4096));
        let seg = Segment::import(&fd.unwrap(), SegmentKind::Unified).unwrap();
        assert_eq!(seg.len(), 4096);

        // Two fds on one message: refused, and both closed.
        send_packet(a.fd.as_fd(), &Msg::frame(1, 1, 1).encode(), &[memfd.as_fd(), memfd.as_fd()]).unwrap();
        assert!(matches!(b.recv(), Err(PipelineError::Protocol { .. })));
        // Too long, too short, garbage.
        send_packet(a.fd.as_fd(), &[0u8; 40], &[]).unwrap();
        assert!(matches!(b.recv(), Err(PipelineError::Protocol { .. })));
        send_packet(a.fd.as_fd(), &[0u8; 8], &[memfd.as_fd()]).unwrap();
        assert!(matches!(b.recv(), Err(PipelineError::Protocol { .. })));
        a.send_raw(&GARBAGE, None).unwrap();
        assert!(matches!(b.recv(), Err(PipelineError::Protocol { .. })));

        // Hang-ups both ways.
        drop(a);
        assert!(matches!(b.recv(), Err(PipelineError::PeerGone { channel: "b" })));
        assert!(matches!(b.send(&Msg::end(0), None), Err(PipelineError::PeerGone { .. })));
    }

    #[test]
    fn work_functions_agree_and_catch_a_wrong_word() {
        let mut buf = vec![0u8; 4096];
        produce_bytes(5, 0, &mut buf);
        transform_bytes(5, &mut buf);
        verify_bytes(5, 0, &buf).unwrap();
        assert!(verify_bytes(6, 0, &buf).is_err(), "another frame's contents must not pass");
        buf[808] ^= 1;
        match verify_bytes(5, 0, &buf) {
            Err(PipelineError::Corrupt { seq: 5, offset: 808, .. }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn options_round_trip_through_stage_args() {
        let o = Options {
            frames: 9,
            frame_size: 4096,
            pool_size: 2,
            source: PipelineSource::Heap("system".into()),
            mode: Mode::Pipes,
            fault: Some(Fault::Crash { stage: Stage::Transform, after: 3 }),
            timeout: Options::default().timeout,
        };
        for stage in Stage::ALL {
            assert_eq!(Options::from_stage_args(&o.stage_args(stage)).unwrap(), (stage, o.clone()));
        }
        for f in [Fault::Malformed { stage: Stage::Consumer, after: 0 }, Fault::SkipTransform { seq: 4 }] {
            assert_eq!(f.to_string().parse::<Fault>().unwrap(), f);
        }
        for s in ["memfd", "udmabuf", "heap:system", "heap:linux,cma"] {
            assert_eq!(s.parse::<PipelineSource>().unwrap().to_string(), s);
        }
        assert!("heap:".parse::<PipelineSource>().is_err());
        let stats =
            StageStats { frames: 3, elapsed_ns: 9, source_name: "dma-heap:system".into(), ..Default::default() };
        assert_eq!(StageStats::parse(&stats.to_message()), Some(stats));
    }
}
