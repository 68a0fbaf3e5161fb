//! What to run: the stages, the mode, the source, the fault, and [`Options`] with their
//! round trip through a stage's command line.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use dmabuf_rt::segment::{FdKind, SegmentKind};
use dmabuf_rt::source::{HeapSource, MemorySource, ShmemSource, Udmabuf};

use super::{PipelineError, Result, STAGE_FLAG};

/// One of the three processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Allocates and fills each frame, and shares it with the other two.
    Producer,
    /// Rewrites each frame in place.
    Transform,
    /// Checks each frame and tells the producer it is done with it.
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

/// Where the producer's frames come from (its allocator's source).
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
    pub fn probe(&self) -> dmabuf_rt::Result<()> {
        match self {
            PipelineSource::Memfd => Ok(()),
            PipelineSource::Udmabuf => Udmabuf::open().map(drop),
            PipelineSource::Heap(name) => HeapSource::open(name).map(drop),
        }
    }

    /// Opens the source.
    pub fn open(&self) -> dmabuf_rt::Result<Box<dyn MemorySource>> {
        Ok(match self {
            PipelineSource::Memfd => Box::new(ShmemSource::new()),
            PipelineSource::Udmabuf => Box::new(ShmemSource::with_udmabuf()?),
            PipelineSource::Heap(name) => Box::new(HeapSource::open(name)?),
        })
    }

    /// The kind of fd its buffers are.
    pub(super) fn fd_kind(&self) -> FdKind {
        match self {
            PipelineSource::Memfd => FdKind::Memfd,
            PipelineSource::Udmabuf | PipelineSource::Heap(_) => FdKind::DmaBuf,
        }
    }

    /// The kind a received buffer is given.
    pub(super) fn segment_kind(&self) -> SegmentKind {
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
    /// The most frames in flight (the pipes baseline: buffer ids in its ledger).
    pub pool_size: usize,
    /// Where the frames come from (ignored by [`Mode::Pipes`], whose stages own private buffers).
    pub source: PipelineSource,
    /// Zero-copy or the pipes baseline.
    pub mode: Mode,
    /// A fault to inject (tests).
    pub fault: Option<Fault>,
    /// How long [`run`](super::run) waits for the stages before killing them.
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

    /// The role arguments of `stage` (what [`stage_main`](super::stage_main) parses).
    pub(super) fn stage_args(&self, stage: Stage) -> Vec<String> {
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

    /// Parses what [`Options::stage_args`] made (and checks it).
    pub(super) fn from_stage_args(args: &[String]) -> Result<(Stage, Options)> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}
