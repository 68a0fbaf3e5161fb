//! [`CpuView`]: CPU access to a byte range of a segment, and never to more.
//!
//! The one way safe code reads or writes device memory from the CPU (in the spirit of
//! vm-memory's `VolatileSlice`). A view is a range `[offset, offset + len)` of one segment's
//! mapping, an access direction and, for a dma-buf, the `DMA_BUF_IOCTL_SYNC` bracket: start when
//! the view is made, end when it drops or on [`CpuView::end`]. Every offset a caller passes is
//! relative to the view and checked against its length, so a block's user cannot reach its
//! neighbours, and the view never reaches past what is actually mapped (an expandable segment's
//! reservation beyond its mapped prefix is `PROT_NONE`: touching it would kill the process).
//!
//! Bytes move only through the mapping's bounds-checked byte-wise atomic copies
//! ([`crate::mapping`]'s rule): no `&[u8]` into shared memory is ever handed out.
//!
//! Where views come from: [`Segment::cpu_access`] (the whole mapped segment),
//! [`Allocation::cpu_access`](crate::caching::Allocation::cpu_access) and
//! [`HostAllocation::cpu_access`](crate::caching::HostAllocation::cpu_access) (the block, as
//! long as was asked for), and [`CpuView::sub`] (a part of a view, inside its bracket).

use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use crate::error::{Error, Result};
use crate::mapping::Mapping;
use crate::segment::{Access, Segment};
use crate::sys;

/// CPU access to `len` bytes at `offset` of a segment, inside the dma-buf sync bracket.
///
/// Offsets given to its methods are relative to the view. Several views (of one segment or of
/// disjoint blocks) may be used from several threads at once: the copies are byte-wise atomic,
/// so overlapping writers only interleave bytes (see [`crate::mapping`]).
pub struct CpuView<'a> {
    segment: &'a Segment,
    mapping: &'a Mapping,
    /// Where the view starts in the segment's mapping.
    offset: usize,
    /// Where it starts in the segment's fd, if one range of the fd holds it ([`CpuView::fd_offset`]).
    fd_offset: Option<usize>,
    len: usize,
    access: Access,
    /// This view issued `DMA_BUF_IOCTL_SYNC` start and owes the end (a root view of a
    /// dma-buf); sub-views live inside their parent's bracket and owe nothing.
    ends: bool,
}

impl fmt::Debug for CpuView<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CpuView")
            .field("fd", &self.segment.as_fd())
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("access", &self.access)
            .field("ends_bracket", &self.ends)
            .finish()
    }
}

const _: () = {
    const fn shareable<T: Send + Sync>() {}
    shareable::<CpuView<'static>>();
};

impl<'a> CpuView<'a> {
    /// A view of `[offset, offset + len)` of `segment`, which must lie in its mapped part.
    /// Begins the access: for a dma-buf, `DMA_BUF_IOCTL_SYNC` start (caches flushed or
    /// invalidated and device fences waited as the exporter needs); for a memfd, nothing.
    pub(crate) fn new(segment: &'a Segment, offset: usize, len: usize, access: Access) -> Result<Self> {
        let mapping =
            segment.mapping().ok_or_else(|| Error::Unsupported { what: "this segment has no CPU mapping".into() })?;
        if access != Access::Read && !mapping.is_writable() {
            return Err(Error::ReadOnly);
        }
        let size = mapping.len();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::OutOfBounds { offset, len, size });
        }
        let ends = segment.is_dma_buf();
        if ends {
            sys::dma_buf::sync(segment.as_fd(), sys::dma_buf::SYNC_START | access.sync_flags())
                .map_err(Error::io("DMA_BUF_IOCTL_SYNC start"))?;
        }
        // The mapping shows the fd in order, except for a page-stitched arena (whose blocks'
        // views say where they lie: `with_fd_offset`).
        let fd_offset = (!segment.is_stitched()).then_some(offset);
        Ok(Self { segment, mapping, offset, fd_offset, len, access, ends })
    }

    /// The view with `fd_offset` as where it starts in its segment's fd (`None`: no one range
    /// of the fd holds it): for a block of a page-stitched arena, which the caller locates.
    pub(crate) fn with_fd_offset(mut self, fd_offset: Option<usize>) -> Self {
        self.fd_offset = fd_offset;
        self
    }

    /// Length of the view in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a view of no bytes (an expandable segment nothing is mapped into yet).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The direction the access was opened for.
    pub fn access(&self) -> Access {
        self.access
    }

    /// Where the view starts in its segment's mapping. For a segment whose mapping shows its
    /// fd in order (all but page-stitched arenas) this is also where it starts in the fd:
    /// [`CpuView::fd_offset`] says which.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Where the view starts in its fd ([`AsFd::as_fd`]): with [`CpuView::len`], the range to
    /// name when the buffer is shared. `None` where no one range of the fd holds the view: a
    /// block of a page-stitched arena whose units lie in several runs of its memfd (its
    /// [`Allocation::fd_ranges`](crate::caching::Allocation::fd_ranges) say where), or a view
    /// of such an arena's whole mapping.
    pub fn fd_offset(&self) -> Option<usize> {
        self.fd_offset
    }

    /// Whether the fd is a dma-buf (otherwise a memfd).
    pub fn is_dma_buf(&self) -> bool {
        self.segment.is_dma_buf()
    }

    /// A new fd for the buffer the view lies in (`dup`), to send to another process or driver
    /// together with [`CpuView::fd_offset`] and [`CpuView::len`] (refused for a page-stitched
    /// arena: its fd names its units, which its blocks show out of order).
    pub fn try_clone_fd(&self) -> Result<OwnedFd> {
        self.segment.try_clone_fd()
    }

    /// `[offset, offset + len)` of this view, inside the same bracket (it borrows this view,
    /// which ends the access). Never larger than this view.
    pub fn sub(&self, offset: usize, len: usize) -> Result<CpuView<'_>> {
        self.check(offset, len)?;
        Ok(CpuView {
            segment: self.segment,
            mapping: self.mapping,
            offset: self.offset + offset,
            fd_offset: self.fd_offset.map(|f| f + offset),
            len,
            access: self.access,
            ends: false,
        })
    }

    /// Copies `dst.len()` bytes at `offset` out of the view.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        if self.access == Access::Write {
            return Err(Error::Unsupported { what: "read through a write-only CPU view".into() });
        }
        self.check(offset, dst.len())?;
        self.mapping.read(self.offset + offset, dst)
    }

    /// Copies `src` into the view at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_write()?;
        self.check(offset, src.len())?;
        self.mapping.write(self.offset + offset, src)
    }

    /// Sets `len` bytes at `offset` to `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.check_write()?;
        self.check(offset, len)?;
        self.mapping.fill(self.offset + offset, len, byte)
    }

    /// The whole view, copied out.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0; self.len];
        self.read(0, &mut v)?;
        Ok(v)
    }

    /// Ends the access now and reports whether the end of the dma-buf bracket succeeded
    /// (dropping the view does the same but can only ignore a failure). Ending a sub-view does
    /// nothing: its parent holds the bracket.
    pub fn end(mut self) -> Result<()> {
        let r = self.end_sync();
        self.ends = false;
        r
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds { offset, len, size: self.len }),
        }
    }

    fn check_write(&self) -> Result<()> {
        if self.access == Access::Read {
            return Err(Error::Unsupported { what: "write through a read-only CPU view".into() });
        }
        Ok(())
    }

    fn end_sync(&self) -> Result<()> {
        if !self.ends {
            return Ok(());
        }
        sys::dma_buf::sync(self.segment.as_fd(), sys::dma_buf::SYNC_END | self.access.sync_flags())
            .map_err(Error::io("DMA_BUF_IOCTL_SYNC end"))
    }
}

/// Views of a whole segment. Defined here, above the segment, so that `segment` knows nothing
/// of the view type built on it.
impl Segment {
    /// CPU access to the whole mapped segment: a [`CpuView`] of `[0, mapped_len())`, inside
    /// the `DMA_BUF_IOCTL_SYNC` bracket for a dma-buf (start now, end when the view drops).
    /// For a block of the caching allocator use the block's own view
    /// ([`Allocation::cpu_access`](crate::caching::Allocation::cpu_access)).
    pub fn cpu_access(&self, access: Access) -> Result<CpuView<'_>> {
        CpuView::new(self, 0, self.mapped_len(), access)
    }
}

impl AsFd for CpuView<'_> {
    /// The fd of the buffer the view lies in, at [`CpuView::fd_offset`] (where that is `None`,
    /// no one range of the fd holds the view).
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.segment.as_fd()
    }
}

impl Drop for CpuView<'_> {
    fn drop(&mut self) {
        // Drop cannot report; `end()` is the way to observe a failure.
        let _ = self.end_sync();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::segment::SegmentKind;

    #[test]
    fn a_growing_segment_is_reachable_up_to_its_mapped_prefix_and_no_further() {
        const CHUNK: usize = 2 << 20;
        let seg = crate::source::memfd_expandable(16 * CHUNK, SegmentKind::Device).unwrap();
        assert_eq!((seg.mapped_len(), seg.len()), (0, 0), "nothing mapped yet");
        assert!(seg.grow_to(CHUNK, 2 * CHUNK).is_err(), "growth must start where the mapped part ends");
        seg.grow_to(0, CHUNK).unwrap();
        assert_eq!(seg.mapped_len(), CHUNK);
        let cpu = seg.cpu_access(Access::ReadWrite).unwrap();
        assert_eq!(cpu.len(), CHUNK);
        cpu.write(CHUNK - 4, &[1, 2, 3, 4]).unwrap();
        assert!(matches!(cpu.write(CHUNK - 3, &[0; 4]), Err(Error::OutOfBounds { size: CHUNK, .. })));
        seg.grow_to(CHUNK, 3 * CHUNK).unwrap();
        // A view made before the growth keeps its length; a new one sees the new prefix.
        assert!(cpu.write(CHUNK, &[0]).is_err());
        drop(cpu);
        let cpu = seg.cpu_access(Access::ReadWrite).unwrap();
        assert_eq!(cpu.len(), 3 * CHUNK);
        cpu.write(3 * CHUNK - 1, &[9]).unwrap();
        let mut b = [0; 5];
        cpu.read(CHUNK - 4, &mut b).unwrap();
        assert_eq!(b, [1, 2, 3, 4, 0]);
        assert!(cpu.write(3 * CHUNK, &[9]).is_err());
        assert!(seg.mapping().unwrap().write(3 * CHUNK, &[9]).is_err());
    }
}
