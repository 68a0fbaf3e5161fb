//! CPU access to the host view of a [`SyncedMemory`](super::SyncedMemory): the bounded view
//! of a block of ours, or queue-checked copies staged through a private buffer for a lent
//! range.

#[cfg(doc)]
use super::SyncedMemory;
use crate::error::{Error, Result};
use crate::queue::{HostBuffer, Mem, copy_now};
use crate::segment::Access;
use crate::view::CpuView;

/// CPU access to a buffer of a `SyncedMemory`.
#[derive(Debug)]
pub(super) enum HostAccess<'a> {
    /// A block of ours: its bounded view, which holds the dma-buf bracket.
    Mapped(CpuView<'a>),
    /// A borrowed range, reached only through queue-checked copies ([`copy_now`], which
    /// brackets dma-bufs per copy), staged through a private buffer: a [`Mem`] offers no
    /// direct CPU access outside the queue module.
    Staged { mem: Mem, access: Access },
}

impl HostAccess<'_> {
    pub(super) fn len(&self) -> usize {
        match self {
            HostAccess::Mapped(cpu) => cpu.len(),
            HostAccess::Staged { mem, .. } => mem.len(),
        }
    }

    pub(super) fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(Error::OutOfBounds { offset, len, size: self.len() }),
        }
    }

    pub(super) fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        match self {
            HostAccess::Mapped(cpu) => cpu.read(offset, dst),
            HostAccess::Staged { .. } if dst.is_empty() => Ok(()),
            HostAccess::Staged { mem, .. } => {
                let stage = HostBuffer::new(dst.len())?;
                copy_now(&stage, mem.range(offset, dst.len())?)?;
                stage.read(0, dst)
            }
        }
    }

    pub(super) fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        match self {
            HostAccess::Mapped(cpu) => cpu.write(offset, src),
            HostAccess::Staged { access: Access::Read, .. } => Err(Error::ReadOnly),
            HostAccess::Staged { .. } if src.is_empty() => Ok(()),
            HostAccess::Staged { mem, .. } => copy_now(mem.range(offset, src.len())?, &HostBuffer::from_slice(src)?),
        }
    }

    pub(super) fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.check(offset, len)?;
        match self {
            HostAccess::Mapped(cpu) => cpu.fill(offset, len, byte),
            HostAccess::Staged { access: Access::Read, .. } => Err(Error::ReadOnly),
            HostAccess::Staged { .. } if len == 0 => Ok(()),
            HostAccess::Staged { mem, .. } => {
                copy_now(mem.range(offset, len)?, &HostBuffer::from_slice(&vec![byte; len])?)
            }
        }
    }

    pub(super) fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0; self.len()];
        self.read(0, &mut v)?;
        Ok(v)
    }

    pub(super) fn end(self) -> Result<()> {
        match self {
            HostAccess::Mapped(cpu) => cpu.end(),
            HostAccess::Staged { .. } => Ok(()),
        }
    }
}

/// The host view of a [`SyncedMemory`] for reading ([`SyncedMemory::host_data`]). Reads are
/// bounds-checked copies; a dma-buf is inside a `DMA_BUF_IOCTL_SYNC` read bracket until the
/// view drops or [`HostView::end`].
#[derive(Debug)]
pub struct HostView<'a> {
    pub(super) inner: HostAccess<'a>,
}

impl HostView<'_> {
    /// The size in bytes.
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    /// Always false (sizes are never 0).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `dst.len()` bytes at `offset` out.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.inner.read(offset, dst)
    }

    /// The whole contents, copied out.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        self.inner.to_vec()
    }

    /// Ends the access now and reports whether the end of the dma-buf bracket succeeded.
    pub fn end(self) -> Result<()> {
        self.inner.end()
    }
}

/// The host view of a [`SyncedMemory`] for reading and writing
/// ([`SyncedMemory::mutable_host_data`]): a [`HostView`] (its reads through `Deref`) inside a
/// read-write bracket, plus writes.
#[derive(Debug)]
pub struct HostViewMut<'a> {
    pub(super) view: HostView<'a>,
}

impl<'a> std::ops::Deref for HostViewMut<'a> {
    type Target = HostView<'a>;

    fn deref(&self) -> &HostView<'a> {
        &self.view
    }
}

impl HostViewMut<'_> {
    /// Copies `src` in at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.view.inner.write(offset, src)
    }

    /// Sets `len` bytes at `offset` to `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.view.inner.fill(offset, len, byte)
    }

    /// Ends the access now and reports whether the end of the dma-buf bracket succeeded.
    pub fn end(self) -> Result<()> {
        self.view.end()
    }
}
