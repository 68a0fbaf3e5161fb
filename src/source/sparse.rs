//! Address space without memory: sparse memfd mappings that are never touched, for replaying
//! allocation traces larger than this machine's RAM (`dmabuf-rt replay --source virtual`).

use super::{MemorySource, page_size};
use crate::error::{Error, Result};
use crate::segment::{Backing, FdKind, Origin, Segment, SegmentKind};
use crate::sys;

/// The largest sparse segment (64 TiB): beyond any device, well inside the address space.
const MAX: usize = 1 << 46;

/// Sparse segments: an unpopulated memfd each. Touching their bytes would allocate pages;
/// the allocator never does, so only address space is used.
#[derive(Debug, Default, Clone, Copy)]
pub struct SparseSource;

impl MemorySource for SparseSource {
    fn name(&self) -> String {
        "virtual".into()
    }

    fn kind(&self) -> SegmentKind {
        SegmentKind::Device
    }

    fn reserve_expandable(&self, len: usize) -> Result<Segment> {
        super::memfd_expandable(len, SegmentKind::Device)
    }

    fn create_segment(&self, len: usize) -> Result<Segment> {
        if len == 0 {
            return Err(Error::ZeroLength);
        }
        let len = len.checked_next_multiple_of(page_size()).filter(|&l| l <= MAX).ok_or(Error::TooLarge {
            requested: len as u64,
            limit: MAX as u64,
            what: "sparse address space",
            source_name: self.name(),
        })?;
        let fd = sys::memfd::create_sealed("dmabuf-rt-virtual", len as u64).map_err(Error::io("sealed memfd"))?;
        Segment::new(fd, len, FdKind::Memfd, SegmentKind::Device, Origin::Memfd, Backing::None, true)
    }
}
