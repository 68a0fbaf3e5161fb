//! dmabuf-rt: the device-memory layer for accelerator runtimes on Linux, built on DMA-BUF.
//!
//! Every buffer is an fd any DMA-BUF importer can take. Start at [`Device`]: one memory domain
//! with its caching allocator, pinned-host allocator and queues.
//!
//! # Layers (data flows down, results flow up)
//! - [`ffi`]: the C API, the PaddlePaddle plugin and their process-wide runtime (a list of
//!   [`Device`]s configured from `DMABUF_RT_*`).
//! - [`device`]: one memory domain for Rust users, built with a builder.
//! - [`caching`] (PyTorch's caching allocator, seed 003, with seed 002's stats), [`queue`]
//!   (io_uring queues, events, copies), [`synced`] (Caffe's SyncedMemory, seed 004),
//!   [`share`] (segments and buffer pools between processes over Unix sockets).
//! - [`source`]: where memory comes from (shmem memfds, DMA-BUF heaps, DRM GEM, pinned host).
//! - [`segment`], [`mapping`], [`view`]: an fd, its RAII mapping, and the one bounded CPU view.
//! - [`discovery`] (what the machine offers) over the device-node helpers and the kernel uapi.
//!
//! # The three flows, top-down
//! 1. **Allocate**: [`Device::allocate_on`] -> [`caching::CachingAllocator::allocate`] -> a
//!    cached block that fits (best fit, split) or, on a miss, the OOM ladder in the pool, which
//!    asks the [`MemorySource`] for a [`Segment`] (or grows an expandable one) and splits it ->
//!    an [`caching::Allocation`].
//! 2. **Copy**: [`queue::Queue::copy`] -> the queue's executor -> the engine (the CPU copy
//!    kernel, or an io_uring SQE) -> its completion -> the [`queue::Event`] recorded after it
//!    completes -> its waiters wake and its hooks run.
//! 3. **Deferred free**: dropping an [`caching::Allocation`] used on another queue
//!    ([`caching::Allocation::record_queue`]) records an event on that queue -> the queue
//!    passes it -> the event's hook pushes the block onto the lock-free free list
//!    ([`caching::free_list`]) -> the next allocation drains it into the pool.
//!
//! ```no_run
//! use dmabuf_rt::source::{MemorySource, ShmemSource};
//! use dmabuf_rt::segment::Access;
//!
//! let src = ShmemSource::new();
//! let seg = src.create_segment(1 << 20)?;
//! let cpu = seg.cpu_access(Access::Write)?;
//! cpu.write(0, b"hello")?;
//! cpu.end()?;
//! # Ok::<(), dmabuf_rt::Error>(())
//! ```
#![deny(unsafe_code)]

pub mod caching;
mod copy;
pub mod device;
pub mod discovery;
pub mod error;
pub mod ffi;
pub mod ipc;
pub mod mapping;
mod node;
pub mod queue;
pub mod segment;
pub mod share;
pub mod source;
mod sync;
pub mod synced;
mod sys;
#[doc(hidden)]
pub mod testing;
pub mod view;

pub use device::{Device, DeviceBuilder};
pub use error::{Error, ErrorKind, Result};
pub use mapping::Mapping;
pub use segment::{Access, FdKind, Origin, Segment, SegmentKind};
pub use source::MemorySource;
pub use view::CpuView;

/// The README's examples are compiled and run as doctests, so they stay true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
