//! The zero-copy frame pipeline demo: a producer, a transform and a consumer, three processes
//! joined by Unix sockets, sharing the producer's allocator blocks by IPC handle
//! ([`dmabuf_rt::ipc`]): each segment's dma-buf (or sealed memfd) fd crosses each socket once.
//!
//! ```text
//!             frame(seq, handle_t, handle_c)                frame(seq, handle_c)
//!  producer ---------------------------------> transform --------------------------------> consumer
//!  (CachingAllocator,  <== IPC: SEGMENT fd once, SHARE per frame; RELEASE ==> (IpcImporter)  |
//!   IpcExporter to each stage)   <====================== IPC ==========================> (IpcImporter)
//!     ^--------------------------------------- return(seq) ------------------------------------+
//! ```
//!
//! One copy of this code serves three programs: the example (`examples/zero_copy_pipeline/`),
//! `dmabuf-rt bench` (src/bin/dmabuf-rt, which includes this module by `#[path]`) and
//! `tests/pipeline.rs` (likewise). Each uses a different part of it, hence the `dead_code`
//! allowance below.
//!
//! - **The frames** come from a [`dmabuf_rt::caching::CachingAllocator`] in the producer, over
//!   the chosen source ([`PipelineSource`]). The producer sends each stage, in a setup message,
//!   one end of an IPC channel, and exports every frame to both stages
//!   ([`dmabuf_rt::ipc::IpcExporter`]): a segment's fd goes to a stage once, then only offsets.
//!   The frame message carries both 64-byte handles; the transform opens its own and passes
//!   the consumer's on (a handle opens in the process it was made for: nothing is shared
//!   onward, as CUDA IPC forbids). The producer frees the frame right after exporting it: the
//!   block waits in limbo and returns to the allocator once both stages released it (their
//!   drop sends RELEASE; a stage that dies releases by hanging up). The consumer's return
//!   message bounds the frames in flight to `pool_size`.
//! - **Work in place.** The producer writes each frame's contents into the block, the
//!   transform rewrites every 8-byte word of it, the consumer checks every word (a wrong frame
//!   is an error, [`PipelineError::Corrupt`]). Shared memory is never a `&[u8]`, so each stage
//!   streams the frame through one 16 KiB stack chunk with the block's bounds-checked
//!   `read`/`write` inside its CPU-access guard (`DMA_BUF_IOCTL_SYNC` for dma-bufs). No
//!   frame byte crosses a process boundary, so [`Report::bytes_copied`] is 0; the only bytes
//!   that move are the pipeline's messages and the IPC packets ([`Report::control_bytes`])
//!   and, once per segment and stage, an fd.
//! - **The baseline** ([`Mode::Pipes`]) is the same three processes, the same per-word work
//!   and the same `pool_size` frames in flight, but each stage owns a private frame buffer and
//!   frames travel through two pipes (sized to 1 MiB): every frame byte is copied into each
//!   pipe and out of it again. [`Report::bytes_copied`] counts the frame bytes written into
//!   pipes (2 × frames × frame size).
//! - **Stages are processes started by [`run`]**, which re-executes a program that calls
//!   [`stage_main`] (or [`stage_process`]) when it sees [`STAGE_FLAG`]: the example
//!   re-executes itself, the CLI gives it a subcommand (`dmabuf-rt pipeline-stage`), a test
//!   binary a test function (`tests/pipeline.rs`). Each stage gets a control socket as its
//!   stdin (std passes it; nothing is inherited by accident, every other fd is close-on-exec)
//!   and receives its two data fds on it. It reports its figures, or why it failed, on the
//!   same socket.
//! - **Failure.** A stage whose peer hangs up, or that receives a malformed message, exits
//!   with an error; so a crash anywhere unwinds the whole pipeline. [`run`] reaps every stage,
//!   kills any still running after a grace period (or at the timeout, or if `run` itself
//!   fails), and returns [`PipelineError::Stage`] naming the stage that failed first for a
//!   reason of its own, with every stage's outcome. The parent never holds a buffer, so once
//!   the stages are gone so are the buffers. [`Fault`] injects crashes, malformed messages and
//!   corrupt frames for tests.
#![allow(
    dead_code,
    unused_imports,
    reason = "the example, the bench and the test each use a different part of the demo"
)]

mod messages;
mod options;
mod pipes;
mod report;
mod stage;
mod stats;
mod supervisor;
mod work;

use std::io;
use std::path::PathBuf;
use std::time::Duration;

pub use options::{Fault, Mode, Options, PipelineSource, Stage};
pub use report::{Comparison, Report, StageOutcome};
pub use stage::{stage_main, stage_process};
pub use supervisor::{compare, run};

/// The first of the role arguments [`run`] appends to the stage command line: a program sees
/// it (after its own prefix) and hands the arguments from here on to [`stage_main`].
pub const STAGE_FLAG: &str = "--stage";

/// `Result` with [`PipelineError`] as the default error.
pub type Result<T, E = PipelineError> = std::result::Result<T, E>;

/// Everything that can go wrong in a pipeline, in the parent or in a stage.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineError {
    /// Options that cannot work (size 0, a pool of 0, a frame over udmabuf's limit, ...).
    #[error("bad pipeline options: {0}")]
    Options(String),
    /// A library error: memory (allocation, import, CPU access) or sharing (a peer that hung
    /// up, [`dmabuf_rt::Error::PeerGone`]; a malformed message, [`dmabuf_rt::Error::Protocol`]).
    #[error(transparent)]
    Share(#[from] dmabuf_rt::Error),
    /// A system call failed.
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: String,
        /// The kernel's answer.
        #[source]
        source: io::Error,
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
    #[error("pipeline stage `{stage}` failed: {}", report::stage_failure(.stage, .outcomes))]
    Stage {
        /// The stage that failed.
        stage: Stage,
        /// What became of every stage.
        outcomes: Vec<StageOutcome>,
    },
    /// No stage failed but the pipeline did not finish in time; every stage was killed.
    #[error("the pipeline did not finish within {waited:?}; stages killed: {}", report::list_outcomes(.outcomes))]
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

impl PipelineError {
    /// Whether this is a peer hanging up (a consequence of another stage's failure).
    pub fn peer_gone(&self) -> bool {
        matches!(self, PipelineError::Share(dmabuf_rt::Error::PeerGone { .. }))
    }
}

fn io_err(op: impl Into<String>) -> impl FnOnce(io::Error) -> PipelineError {
    move |source| PipelineError::Io { op: op.into(), source }
}
