//! Memory sources: where segments come from.
//!
//! | source | fd | kind | needs |
//! |---|---|---|---|
//! | [`ShmemSource`] | memfd (sealed), or a dma-buf over it through `/dev/udmabuf` | unified | nothing / udmabuf |
//! | [`HeapSource`] | dma-buf from `/dev/dma_heap/<name>` | device | a DMA-BUF heap |
//! | [`GemSource`] | dma-buf exported by PRIME from a DRM GEM object | device | a DRM node with dumb buffers |
//! | [`HostSource`] | system-heap dma-buf, else an `mlock`ed memfd | pinned host | nothing |

pub mod gem;
pub mod heap;
pub mod host;
pub mod shmem;
pub mod sparse;

use std::fmt::Debug;
use std::io;

pub use gem::{GemImport, GemSource, VgemFence};
pub use heap::HeapSource;
pub use host::{HostBacking, HostSource};
pub use shmem::{ShmemSource, Udmabuf};
pub use sparse::SparseSource;

use crate::error::{Error, Result};
use crate::segment::{Segment, SegmentKind};
/// Where the caching allocator reads `RLIMIT_AS` (defined in `sys`, below `error`, which
/// also reads it).
pub(crate) use crate::sys::limits::address_space_limit;

/// A provider of [`Segment`]s. Implementations are cheap to share between threads; each
/// `create_segment` asks the kernel for a new buffer (caching is the allocator's job, not the source's).
pub trait MemorySource: Send + Sync + Debug {
    /// A human-readable name: `shmem`, `dma-heap:system`, `gem:/dev/dri/card0 (vgem)`, ...
    fn name(&self) -> String;

    /// The kind of segment this source makes.
    fn kind(&self) -> SegmentKind;

    /// A new segment of at least `len` bytes (rounded up to whole pages).
    fn create_segment(&self, len: usize) -> Result<Segment>;

    /// An expandable segment: `len` bytes of reserved address space over a sparse memfd,
    /// mapped and backed piece by piece as the caching allocator grows it. Sources whose memory
    /// is not a single growable memfd refuse.
    fn reserve_expandable(&self, len: usize) -> Result<Segment> {
        let _ = len;
        Err(Error::Unsupported { what: format!("{} cannot make expandable segments", self.name()) })
    }
}

/// A sparse, size-sealed memfd behind a reservation: what the memfd-backed sources hand out
/// as expandable segments.
pub(crate) fn memfd_expandable(len: usize, kind: SegmentKind) -> Result<Segment> {
    let len = len.checked_next_multiple_of(page_size()).filter(|&l| l <= 1 << 46).ok_or(Error::TooLarge {
        requested: len as u64,
        limit: 1 << 46,
        what: "sparse address space",
        source_name: "expandable segment".into(),
    })?;
    let fd = crate::sys::memfd::create_sealed("dmabuf-rt-expandable", len as u64).map_err(Error::io("sealed memfd"))?;
    Segment::expandable(fd, len, kind, crate::segment::Origin::Memfd)
}

/// The system page size.
pub fn page_size() -> usize {
    rustix::param::page_size()
}

/// Validates a request and rounds it up to whole pages: zero, an overflowing size, and a size
/// beyond the machine's RAM + swap are refused before the kernel is asked.
pub(crate) fn checked_len(len: usize, source_name: impl FnOnce() -> String) -> Result<usize> {
    if len == 0 {
        return Err(Error::ZeroLength);
    }
    let limit = ram_and_swap();
    let rounded = len.checked_next_multiple_of(page_size());
    match rounded {
        Some(r) if (r as u64) <= limit => Ok(r),
        _ => Err(Error::TooLarge { requested: len as u64, limit, what: "RAM + swap", source_name: source_name() }),
    }
}

/// This machine's RAM + swap in bytes.
#[cfg(not(miri))]
fn ram_and_swap() -> u64 {
    let info = rustix::system::sysinfo();
    let unit = u64::from(info.mem_unit.max(1));
    (info.totalram as u64).saturating_add(info.totalswap as u64).saturating_mul(unit)
}

/// Miri has no `sysinfo`: no limit before the source is asked.
#[cfg(miri)]
fn ram_and_swap() -> u64 {
    u64::MAX
}

/// Maps an allocation failure: memory exhaustion becomes [`Error::OutOfMemory`].
pub(crate) fn alloc_error(requested: usize, source_name: String, op: &'static str) -> impl FnOnce(io::Error) -> Error {
    move |e| match e.raw_os_error() {
        Some(code) if code == libc_enomem() || code == libc_enospc() => {
            Error::OutOfMemory { requested: requested as u64, source_name, source: e }
        }
        _ => Error::from_io(op, e),
    }
}

fn libc_enomem() -> i32 {
    rustix::io::Errno::NOMEM.raw_os_error()
}

fn libc_enospc() -> i32 {
    rustix::io::Errno::NOSPC.raw_os_error()
}
