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

    /// The kernel refused to let this process take something of another process (its fds,
    /// through `pidfd_getfd`).
    #[error("{what}: {source}; {why}")]
    NotPermitted {
        /// What was to be taken, and from which process.
        what: String,
        /// The kernel's answer.
        #[source]
        source: io::Error,
        /// What the kernel checks, and what would permit it.
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

    /// A bad argument to a call (a C caller's copy kind, a buffer too small, a handle of the
    /// wrong kind of object).
    #[error("invalid argument: {what}")]
    InvalidArgument {
        /// The argument and what is wrong with it.
        what: String,
    },

    /// A device id that names no device.
    #[error("device {id} does not exist (this process has {count} devices: 0 to {last})", last = count.saturating_sub(1))]
    NoSuchDevice {
        /// The id given.
        id: i64,
        /// How many devices there are.
        count: usize,
    },

    /// A handle (stream, event, SyncedMemory) that is not live: never created or destroyed.
    #[error("{what} handle {handle:#x} is not live (never created, or destroyed; handles are never reused)")]
    UnknownHandle {
        /// What kind of handle.
        what: &'static str,
        /// The handle.
        handle: usize,
    },

    /// A per-process or system limit ran out (open files, locked memory, address space,
    /// threads): not a lack of device memory, and raising the limit cures it.
    #[error("{op}: {source}: {resource} is exhausted ({hint})")]
    ResourceLimit {
        /// What was being done.
        op: &'static str,
        /// The resource: e.g. "open files (RLIMIT_NOFILE)".
        resource: &'static str,
        /// What to do about it.
        hint: &'static str,
        /// The kernel's answer.
        #[source]
        source: io::Error,
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
    #[error("{what} {ptr:#x} is not {expected}{}{why}", if why.is_empty() { "" } else { ": " })]
    UnknownPointer {
        /// What the pointer was passed as.
        what: &'static str,
        /// The pointer.
        ptr: usize,
        /// What it should have been.
        expected: &'static str,
        /// What it is instead, when known (empty otherwise).
        why: String,
    },

    /// A wait that could never end: a host callback waiting for its own queue.
    #[error("refused to wait, it would deadlock: {what}")]
    WouldDeadlock {
        /// What was waited for.
        what: &'static str,
    },

    /// The process at the other end of a sharing channel closed it (it exited or crashed)
    /// while this side still expected a message, or before this side could send one.
    #[error("{channel}: the peer hung up before the end of the stream")]
    PeerGone {
        /// The channel, e.g. `producer->transform`.
        channel: String,
    },

    /// A message on a sharing channel that breaks its protocol: the wrong size, truncated,
    /// missing or extra fds, an unknown kind, a buffer id the receiver does not know or does not
    /// have out. Any fds it carried are closed.
    #[error("{channel}: malformed message: {why}")]
    Protocol {
        /// The channel it came on.
        channel: String,
        /// What is wrong with it.
        why: String,
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

/// What kind of failure an [`Error`] is: what a caller (and the C status) acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A bad value or setting; changes nothing.
    InvalidArgument,
    /// A pointer this library did not hand out, or already freed, or out of its range.
    InvalidPointer,
    /// A handle that is not live.
    InvalidHandle,
    /// A device id or device node that does not exist.
    NoSuchDevice,
    /// Not enough memory (device memory, or the machine's).
    OutOfMemory,
    /// A process or system limit (open files, locked memory, address space, threads).
    ResourceLimit,
    /// Access to a device node, or to another process's fds, denied.
    PermissionDenied,
    /// The source or device cannot do this.
    NotSupported,
    /// A wait ran out of time.
    Timeout,
    /// A wait refused because it could never end.
    WouldDeadlock,
    /// Anything else: a failed system call, a queue whose earlier work failed, a sharing
    /// peer that hung up or broke the protocol.
    Failed,
}

impl Error {
    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::ZeroLength
            | Error::Config { .. }
            | Error::InvalidArgument { .. }
            | Error::SizeMismatch { .. }
            | Error::OutOfBounds { .. }
            | Error::ReadOnly
            | Error::BadImport { .. }
            | Error::NoTiming { .. } => ErrorKind::InvalidArgument,
            Error::TooLarge { .. }
            | Error::OutOfMemory { .. }
            | Error::AllocatorOom { .. }
            | Error::UdmabufLimit { .. } => ErrorKind::OutOfMemory,
            Error::InvalidFree { .. } | Error::UnknownPointer { .. } => ErrorKind::InvalidPointer,
            Error::UnknownHandle { .. } => ErrorKind::InvalidHandle,
            Error::NoSuchDevice { .. } | Error::NoSuchHeap { .. } | Error::NoDevice { .. } => ErrorKind::NoSuchDevice,
            Error::ResourceLimit { .. } => ErrorKind::ResourceLimit,
            Error::Open { source, .. } if source.kind() == io::ErrorKind::PermissionDenied => {
                ErrorKind::PermissionDenied
            }
            Error::NotPermitted { .. } => ErrorKind::PermissionDenied,
            Error::Unsupported { .. } => ErrorKind::NotSupported,
            Error::Timeout { .. } => ErrorKind::Timeout,
            Error::WouldDeadlock { .. } => ErrorKind::WouldDeadlock,
            Error::Open { .. }
            | Error::OperationFailed { .. }
            | Error::PeerGone { .. }
            | Error::Protocol { .. }
            | Error::Io { .. } => ErrorKind::Failed,
        }
    }

    /// A failed system call: [`Error::ResourceLimit`] when the kernel's answer says a limit
    /// ran out, else [`Error::Io`].
    pub(crate) fn io(op: &'static str) -> impl FnOnce(io::Error) -> Error {
        move |source| Error::from_io(op, source)
    }

    pub(crate) fn io_rustix(op: &'static str) -> impl FnOnce(rustix::io::Errno) -> Error {
        move |e| Error::from_io(op, e.into())
    }

    pub(crate) fn from_io(op: &'static str, source: io::Error) -> Error {
        let mapping = op.starts_with("mmap") || op.starts_with("reserve");
        if mapping && source.raw_os_error() == Some(rustix::io::Errno::NOMEM.raw_os_error()) && address_space_limited()
        {
            return Error::ResourceLimit {
                op,
                resource: "this process's address space (RLIMIT_AS)",
                hint: "raise `ulimit -v`, or lower the device capacity",
                source,
            };
        }
        match limit_of(&source) {
            Some((resource, hint)) => Error::ResourceLimit { op, resource, hint, source },
            None => Error::Io { op, source },
        }
    }
}

/// Whether this process runs under an address-space limit (`RLIMIT_AS`), which makes mapping
/// failures a limit rather than a lack of memory.
fn address_space_limited() -> bool {
    crate::sys::limits::address_space_limit().is_some()
}

/// The limit an errno means, if it means one that is not a lack of memory.
pub(crate) fn limit_of(e: &io::Error) -> Option<(&'static str, &'static str)> {
    use rustix::io::Errno;
    let code = e.raw_os_error()?;
    if code == Errno::MFILE.raw_os_error() {
        Some(("this process's open files (RLIMIT_NOFILE)", "close fds, or raise `ulimit -n`"))
    } else if code == Errno::NFILE.raw_os_error() {
        Some(("the system's open files (fs.file-max)", "close fds, or raise the sysctl fs.file-max"))
    } else {
        None
    }
}
