//! The buffers behind a [`SyncedMemory`](super::SyncedMemory)'s two views: its own blocks
//! from the device's and the pinned-host allocators, or ranges lent by the caller.

use super::host_view::HostAccess;
use crate::caching::{Allocation, HostAllocation};
use crate::error::{Error, Result};
use crate::queue::{Mem, Queue};
use crate::segment::Access;

/// One buffer a `SyncedMemory` uses: its own block from one of the allocators, or a range lent
/// by the caller.
#[derive(Debug)]
pub(super) enum Buf {
    /// A block of the caching allocator (owned, freed on drop).
    Device(Allocation),
    /// A pinned host block (owned, freed on drop).
    Host(HostAllocation),
    /// The caller's memory: only the counted reference is ours.
    Borrowed(Mem),
}

impl Buf {
    pub(super) fn mem(&self) -> Mem {
        match self {
            Buf::Device(a) => a.mem(),
            Buf::Host(h) => h.mem(),
            Buf::Borrowed(m) => m.clone(),
        }
    }

    pub(super) fn is_owned(&self) -> bool {
        !matches!(self, Buf::Borrowed(_))
    }

    /// Where it is, `(address, length)`, if the CPU can address it.
    pub(super) fn range(&self) -> Option<(usize, usize)> {
        let m = self.mem();
        Some((m.ptr().ok()? as usize, m.len()))
    }

    pub(super) fn record_queue(&mut self, queue: &Queue) {
        match self {
            Buf::Device(a) => a.record_queue(queue),
            Buf::Host(h) => h.record_queue(queue),
            // The lender decides when its memory is freed.
            Buf::Borrowed(_) => {}
        }
    }

    /// CPU access to the buffer (owned blocks are exactly `size` bytes, borrowed ranges are
    /// checked to be).
    pub(super) fn cpu(&self, access: Access) -> Result<HostAccess<'_>> {
        match self {
            Buf::Device(a) => Ok(HostAccess::Mapped(a.cpu_access(access)?)),
            Buf::Host(h) => Ok(HostAccess::Mapped(h.cpu_access(access)?)),
            Buf::Borrowed(m) => {
                if access != Access::Read && !m.writable() {
                    return Err(Error::ReadOnly);
                }
                Ok(HostAccess::Staged { mem: m.clone(), access })
            }
        }
    }
}

/// The buffers behind the two views.
#[derive(Debug)]
pub(super) enum Store {
    /// One buffer is both views (nothing yet: `None`).
    Aliased(Option<Buf>),
    /// A host buffer and a device buffer, kept coherent by copies; each allocated when first
    /// needed.
    Split { host: Option<Buf>, device: Option<Buf> },
}

impl Store {
    pub(super) fn host(&self) -> Option<&Buf> {
        match self {
            Store::Aliased(b) | Store::Split { host: b, .. } => b.as_ref(),
        }
    }

    pub(super) fn device(&self) -> Option<&Buf> {
        match self {
            Store::Aliased(b) | Store::Split { device: b, .. } => b.as_ref(),
        }
    }

    pub(super) fn host_buf(&self) -> Result<&Buf> {
        self.host().ok_or_else(|| missing("host"))
    }

    pub(super) fn device_buf(&self) -> Result<&Buf> {
        self.device().ok_or_else(|| missing("device"))
    }

    pub(super) fn bufs(&self) -> impl Iterator<Item = &Buf> {
        let (a, b) = match self {
            Store::Aliased(b) => (b.as_ref(), None),
            Store::Split { host, device } => (host.as_ref(), device.as_ref()),
        };
        a.into_iter().chain(b)
    }

    pub(super) fn bufs_mut(&mut self) -> impl Iterator<Item = &mut Buf> {
        let (a, b) = match self {
            Store::Aliased(b) => (b.as_mut(), None),
            Store::Split { host, device } => (host.as_mut(), device.as_mut()),
        };
        a.into_iter().chain(b)
    }
}

/// A broken internal invariant, reported rather than panicking.
pub(super) fn missing(side: &str) -> Error {
    Error::Unsupported { what: format!("SyncedMemory bug: the head says the {side} view holds data, but it has none") }
}
