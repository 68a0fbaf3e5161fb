//! dmabuf-rt: the device-memory layer for accelerator runtimes on Linux, built on DMA-BUF.
//!
//! Every buffer is an fd any DMA-BUF importer can take. The layers: memory [`source`]s and
//! [`Segment`]s, reached from the CPU only through bounded [`view`]s; [`queue`]s and events on
//! io_uring; the [`caching`] allocator; [`synced`] memory (Caffe's SyncedMemory); segments
//! and buffer pools [`share`]d between processes; and the C ABI ([`ffi`]: the C API and the PaddlePaddle
//! plugin) over the process-wide [`runtime`].
//!
//! ```no_run
//! use dmabuf_rt::source::{MemorySource, ShmemSource};
//! use dmabuf_rt::segment::Access;
//!
//! let src = ShmemSource::new();
//! let seg = src.allocate(1 << 20)?;
//! let cpu = seg.cpu_access(Access::Write)?;
//! cpu.write(0, b"hello")?;
//! cpu.end()?;
//! # Ok::<(), dmabuf_rt::Error>(())
//! ```
#![deny(unsafe_code)]

pub mod caching;
mod copy;
pub mod discovery;
pub mod error;
pub mod ffi;
pub mod mapping;
pub mod queue;
pub mod runtime;
pub mod segment;
pub mod share;
pub mod source;
mod sync;
pub mod synced;
mod sys;
#[doc(hidden)]
pub mod testing;
pub mod view;

pub use error::{Error, ErrorKind, Result};
pub use mapping::Mapping;
pub use segment::{Access, FdKind, Origin, Segment, SegmentKind};
pub use source::MemorySource;
pub use view::CpuView;

/// The README's examples are compiled and run as doctests, so they stay true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
