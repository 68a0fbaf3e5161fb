//! The crate's error type.

use std::io;
use std::path::PathBuf;

/// `Result` with [`Error`] as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong, with the context a caller needs to act on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A zero-length buffer was requested.
    #[error("zero-length allocation requested")]
    ZeroLength,

    /// The request is larger than this machine could ever provide.
    #[error("requested {requested} bytes from {source_name}, more than this machine has ({limit} bytes of {what})")]
    TooLarge {
        /// Bytes requested.
        requested: u64,
        /// The bound it exceeds.
        limit: u64,
        /// What that bound is (e.g. "RAM + swap").
        what: &'static str,
        /// The memory source asked.
        source_name: String,
    },

    /// The kernel could not provide the memory right now.
    #[error("out of memory in {source_name}: {requested} bytes could not be allocated ({source})")]
    OutOfMemory {
        /// Bytes requested.
        requested: u64,
        /// The memory source asked.
        source_name: String,
        /// The kernel's answer.
        #[source]
        source: io::Error,
    },

    /// No DMA-BUF heap of that name.
    #[error("DMA-BUF heap `{name}` does not exist (heaps here: {available})")]
    NoSuchHeap {
        /// The name asked for.
        name: String,
        /// The heaps that do exist, comma-separated, or "none".
        available: String,
    },

    /// A device node that does not exist on this machine.
    #[error("{path} does not exist: {hint}")]
    NoDevice {
        /// The node.
        path: PathBuf,
        /// What provides it.
        hint: &'static str,
    },

    /// A device node this process may not open.
    #[error("cannot open {path}: {source}; {why}")]
    Open {
        /// The node.
        path: PathBuf,
        /// The kernel's answer.
        #[source]
        source: io::Error,
        /// Owner, mode and this process's credentials, and what to do about it.
        why: String,
    },

    /// udmabuf's per-buffer limit.
    #[error(
        "udmabuf refuses a {requested}-byte buffer: its size_limit_mb parameter caps one buffer at {limit_mb} MiB \
         (raise /sys/module/udmabuf/parameters/size_limit_mb, or boot with udmabuf.size_limit_mb=N)"
    )]
    UdmabufLimit {
        /// Bytes requested.
        requested: u64,
        /// The limit in MiB.
        limit_mb: u64,
    },

    /// An fd handed to `import` that is not safe or not possible to use.
    #[error("refusing to import fd: {reason}")]
    BadImport {
        /// Why.
        reason: String,
    },

    /// A byte range outside a segment or mapping.
    #[error("range {offset}+{len} is outside a {size}-byte buffer")]
    OutOfBounds {
        /// Start of the range.
        offset: usize,
        /// Its length.
        len: usize,
        /// The buffer's size.
        size: usize,
    },

    /// A write to memory mapped read-only (e.g. an imported memfd sealed against writes).
    #[error("buffer is read-only")]
    ReadOnly,

    /// The source cannot do this (e.g. a dumb buffer beyond 4 GiB).
    #[error("{what}")]
    Unsupported {
        /// What and why.
        what: String,
    },

    /// Two sides of a copy differ in length.
    #[error("size mismatch: destination is {dst} bytes, source is {src} bytes")]
    SizeMismatch {
        /// Destination length.
        dst: usize,
        /// Source length.
        src: usize,
    },

    /// A wait ran out of time.
    #[error("{what} did not complete within {waited:?}")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// How long.
        waited: std::time::Duration,
    },

    /// A queue operation failed, or was skipped because an earlier one on its queue (or an
    /// event it waited for) failed.
    #[error("queue operation failed: {reason}")]
    OperationFailed {
        /// The first failure, as the queue recorded it.
        reason: std::sync::Arc<str>,
    },

    /// An event was never recorded, or not recorded with timing, where a time was asked for.
    #[error("event has no completion time: {why}")]
    NoTiming {
        /// Why not.
        why: &'static str,
    },

    /// A bad allocator setting.
    #[error("{what}")]
    Config {
        /// The setting and what is wrong with it.
        what: String,
    },

    /// The caching allocator could not satisfy a request, even after freeing its cache.
    #[error(
        "out of memory: tried to allocate {requested} bytes; capacity {capacity} bytes, {allocated} bytes allocated, \
         {reserved_free} bytes reserved but free (largest free block {largest_free} bytes), {allowed} bytes allowed \
         for this process{cause}"
    )]
    AllocatorOom {
        /// Bytes requested.
        requested: u64,
        /// The device's capacity.
        capacity: u64,
        /// Bytes allocated to callers.
        allocated: u64,
        /// Bytes reserved from the source but not allocated.
        reserved_free: u64,
        /// The largest free block.
        largest_free: u64,
        /// The per-process limit (memory fraction).
        allowed: u64,
        /// The memory source's own error, if it refused.
        cause: String,
    },

    /// A pointer this allocator did not hand out, or one already freed.
    #[error("invalid free of {ptr:#x}: {why}")]
    InvalidFree {
        /// The pointer.
        ptr: usize,
        /// Never allocated here, already freed, or inside a block.
        why: &'static str,
    },

    /// A pointer that does not lie in memory this library handed out (a copy's device side,
    /// a stream or event handle that is not live).
    #[error("{what} {ptr:#x} is not {expected}")]
    UnknownPointer {
        /// What the pointer was passed as.
        what: &'static str,
        /// The pointer.
        ptr: usize,
        /// What it should have been.
        expected: &'static str,
    },

    /// A system call failed.
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The kernel's answer.
        #[source]
        source: io::Error,
    },
}

impl Error {
    pub(crate) fn io(op: &'static str) -> impl FnOnce(io::Error) -> Error {
        move |source| Error::Io { op, source }
    }

    pub(crate) fn io_rustix(op: &'static str) -> impl FnOnce(rustix::io::Errno) -> Error {
        move |e| Error::Io { op, source: e.into() }
    }
}
