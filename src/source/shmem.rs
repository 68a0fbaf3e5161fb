//! The shmem source: sealed memfds, optionally exported as dma-bufs through `/dev/udmabuf`.
//! It works on every Linux and is the embedded default.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use super::{MemorySource, alloc_error, checked_len};
use crate::error::{Error, Result};
use crate::node::{open_node, read_param};
use crate::segment::{Backing, FdKind, Origin, Segment, SegmentKind};
use crate::sys;

/// Default of udmabuf's `size_limit_mb` module parameter.
const UDMABUF_DEFAULT_LIMIT_MB: u64 = 64;
const UDMABUF_NODE: &str = "/dev/udmabuf";
const UDMABUF_LIMIT_PARAM: &str = "/sys/module/udmabuf/parameters/size_limit_mb";
const UDMABUF_LIST_PARAM: &str = "/sys/module/udmabuf/parameters/list_limit";
/// Default of udmabuf's `list_limit` module parameter.
const UDMABUF_DEFAULT_LIST_LIMIT: u64 = 1024;

/// Sealed memfds. Every segment's pages are reserved at allocation (faulted in), so an
/// exhausted machine fails the allocation with [`Error::OutOfMemory`] instead of a SIGBUS on
/// first touch; the size is sealed (`F_SEAL_SHRINK | F_SEAL_GROW`) so no holder can truncate
/// it under another's mapping.
#[derive(Debug)]
pub struct ShmemSource {
    udmabuf: Option<Udmabuf>,
    kind: SegmentKind,
    reserve: bool,
}

impl Default for ShmemSource {
    fn default() -> Self {
        Self::new()
    }
}

impl ShmemSource {
    /// Plain memfd segments (unified memory), not exported.
    pub fn new() -> Self {
        Self { udmabuf: None, kind: SegmentKind::Unified, reserve: true }
    }

    /// Memfd segments, each exported as a dma-buf through `/dev/udmabuf` (the segment's fd is
    /// the dma-buf; the memfd stays reachable through [`Segment::memfd`]).
    pub fn with_udmabuf() -> Result<Self> {
        Ok(Self { udmabuf: Some(Udmabuf::open()?), ..Self::new() })
    }

    /// Whether pages are reserved at allocation (default true). Without it a memfd is sparse
    /// until touched, which is cheaper but turns exhaustion into SIGBUS/OOM-kill later.
    pub fn reserve(mut self, reserve: bool) -> Self {
        self.reserve = reserve;
        self
    }

    pub(crate) fn with_kind(mut self, kind: SegmentKind) -> Self {
        self.kind = kind;
        self
    }

    /// A sealed memfd segment of `len` (already page-rounded) bytes.
    pub(crate) fn memfd_segment(&self, len: usize, origin: Origin) -> Result<Segment> {
        let name = || "shmem".to_string();
        let fd =
            sys::memfd::create_sealed("dmabuf-rt", len as u64).map_err(alloc_error(len, name(), "sealed memfd"))?;
        let seg = Segment::new(fd, len, FdKind::Memfd, self.kind, origin, Backing::None, true)?;
        if self.reserve {
            // Reserve by faulting the pages in, not by fallocate: fallocated shmem pages stay
            // "not uptodate" until first faulted, and a later fault zeroes them, which would
            // wipe data a device wrote through udmabuf in the meantime.
            populate(&seg).map_err(alloc_error(len, name(), "populate memfd"))?;
        }
        Ok(seg)
    }
}

impl MemorySource for ShmemSource {
    fn name(&self) -> String {
        if self.udmabuf.is_some() { "shmem+udmabuf".into() } else { "shmem".into() }
    }

    fn kind(&self) -> SegmentKind {
        self.kind
    }

    fn reserve_expandable(&self, len: usize) -> Result<Segment> {
        if self.udmabuf.is_some() {
            return Err(Error::Unsupported { what: "expandable segments are not exported through udmabuf".into() });
        }
        super::memfd_expandable(len, self.kind)
    }

    fn create_segment(&self, len: usize) -> Result<Segment> {
        let len = checked_len(len, || self.name())?;
        match &self.udmabuf {
            None => self.memfd_segment(len, Origin::Memfd),
            Some(u) => {
                // Check the limit before paying for the memfd.
                u.check_limit(len as u64)?;
                let memfd = self.memfd_segment(len, Origin::Memfd)?;
                u.export(&memfd)
            }
        }
    }
}

/// `/dev/udmabuf`: turns memfd segments into dma-bufs.
#[derive(Debug)]
pub struct Udmabuf {
    dev: OwnedFd,
}

impl Udmabuf {
    /// Opens `/dev/udmabuf`.
    pub fn open() -> Result<Self> {
        Self::open_path(Path::new(UDMABUF_NODE))
    }

    /// Opens a udmabuf node at another path (containers, tests).
    pub fn open_path(path: &Path) -> Result<Self> {
        let f = open_node(path, "the udmabuf driver (CONFIG_UDMABUF) provides it")?;
        Ok(Self { dev: f.into() })
    }

    /// udmabuf's per-buffer cap in MiB, from its module parameter (64 when unreadable).
    pub fn size_limit_mb() -> u64 {
        read_param(UDMABUF_LIMIT_PARAM).unwrap_or(UDMABUF_DEFAULT_LIMIT_MB)
    }

    /// udmabuf's cap on the ranges of one `export_list`, from its module parameter (1024 when
    /// unreadable).
    pub fn list_limit() -> u64 {
        read_param(UDMABUF_LIST_PARAM).unwrap_or(UDMABUF_DEFAULT_LIST_LIMIT)
    }

    /// What udmabuf requires of a source segment, checked before the kernel is asked.
    fn check_source(seg: &Segment) -> Result<BorrowedFd<'_>> {
        let memfd = seg
            .memfd()
            .ok_or_else(|| Error::Unsupported { what: "udmabuf can only export memfd-backed segments".into() })?;
        if !seg.is_writable() {
            return Err(Error::Unsupported {
                what: "udmabuf cannot export a memfd sealed against writes or opened read-only".into(),
            });
        }
        if seg.len() % super::page_size() != 0 {
            return Err(Error::Unsupported {
                what: format!("udmabuf needs whole pages; this memfd is {} bytes", seg.len()),
            });
        }
        Ok(memfd)
    }

    fn check_limit(&self, len: u64) -> Result<()> {
        let limit_mb = Self::size_limit_mb();
        if len > limit_mb << 20 {
            return Err(Error::UdmabufLimit { requested: len, limit_mb });
        }
        Ok(())
    }

    /// Exports a memfd segment (from [`ShmemSource`] or imported) as a dma-buf over the same
    /// pages. The new segment keeps the memfd open and shares its kind.
    pub fn export(&self, seg: &Segment) -> Result<Segment> {
        let memfd = Self::check_source(seg)?;
        let len = seg.len() as u64;
        self.check_limit(len)?;
        // Pages must exist and be initialised before udmabuf pins them: shmem zeroes a page that
        // was fallocated but never faulted on its first fault, and udmabuf's own mapping does
        // not count as one, so device writes through the dma-buf could later be wiped.
        populate(seg).map_err(alloc_error(len as usize, "udmabuf".into(), "populate memfd"))?;
        let range = sys::udmabuf::Range { memfd, offset: 0, size: len };
        let dmabuf = sys::udmabuf::create(self.dev.as_fd(), range).map_err(alloc_error(
            len as usize,
            "udmabuf".into(),
            "UDMABUF_CREATE",
        ))?;
        let keep = memfd.try_clone_to_owned().map_err(Error::io("dup memfd"))?;
        Segment::new(dmabuf, seg.len(), FdKind::DmaBuf, seg.kind(), Origin::Udmabuf, Backing::Memfd(keep), true)
    }
}

impl Udmabuf {
    /// Exports several memfd segments as one dma-buf, their pages concatenated in order
    /// (`UDMABUF_CREATE_LIST`). The result keeps every memfd open; its kind is the first's.
    pub fn export_list(&self, segs: &[&Segment]) -> Result<Segment> {
        let first = segs.first().ok_or(Error::ZeroLength)?;
        let limit = Self::list_limit();
        if segs.len() as u64 > limit {
            return Err(Error::Unsupported {
                what: format!(
                    "udmabuf takes at most {limit} ranges per buffer (its list_limit parameter); {} given",
                    segs.len()
                ),
            });
        }
        let mut ranges = Vec::with_capacity(segs.len());
        for s in segs {
            let memfd = Self::check_source(s)?;
            ranges.push(sys::udmabuf::Range { memfd, offset: 0, size: s.len() as u64 });
        }
        let total: u64 = ranges.iter().map(|r| r.size).sum();
        self.check_limit(total)?;
        for s in segs {
            populate(s).map_err(alloc_error(s.len(), "udmabuf".into(), "populate memfd"))?;
        }
        let dmabuf = sys::udmabuf::create_list(self.dev.as_fd(), &ranges).map_err(alloc_error(
            total as usize,
            "udmabuf".into(),
            "UDMABUF_CREATE_LIST",
        ))?;
        let keep = ranges
            .iter()
            .map(|r| r.memfd.try_clone_to_owned())
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(Error::io("dup memfd"))?;
        Segment::new(dmabuf, total as usize, FdKind::DmaBuf, first.kind(), Origin::Udmabuf, Backing::Memfds(keep), true)
    }
}

impl Udmabuf {
    /// Exports byte ranges `(offset, len)` of a memfd segment's fd as one dma-buf over those
    /// pages, in order (`UDMABUF_CREATE_LIST`): a block of a caching allocator, including a
    /// page-stitched one whose units lie in several runs of its arena's memfd
    /// ([`Allocation::export_dma_buf`](crate::caching::Allocation::export_dma_buf)). The
    /// ranges are whole pages of the fd that the segment's mapping shows at the same offsets
    /// (an arena's home region does), which the caller has checked; their pages are faulted in
    /// first, as in [`Udmabuf::export`].
    pub(crate) fn export_fd_ranges(&self, seg: &Segment, ranges: &[(usize, usize)]) -> Result<Segment> {
        let memfd = seg
            .memfd_of_units()
            .ok_or_else(|| Error::Unsupported { what: "udmabuf can only export memfd-backed segments".into() })?;
        if !seg.is_writable() {
            return Err(Error::Unsupported {
                what: "udmabuf cannot export a memfd sealed against writes or opened read-only".into(),
            });
        }
        let page = super::page_size();
        if let Some(&(off, len)) = ranges.iter().find(|&&(off, len)| off % page != 0 || len % page != 0 || len == 0) {
            return Err(Error::Unsupported {
                what: format!(
                    "udmabuf maps whole pages: the range of {len} bytes at offset {off} of the memfd is not page-aligned \
                     (blocks of at least one page from a pool, and every block of a page-stitched arena, are)"
                ),
            });
        }
        let limit = Self::list_limit();
        if ranges.len() as u64 > limit {
            return Err(Error::Unsupported {
                what: format!(
                    "udmabuf takes at most {limit} ranges per buffer (its list_limit parameter); the block lies in {} \
                     runs of its memfd",
                    ranges.len()
                ),
            });
        }
        let total: usize = ranges.iter().map(|&(_, len)| len).sum();
        self.check_limit(total as u64)?;
        let m = seg.mapping().ok_or_else(|| Error::Unsupported { what: "the segment is not mapped".into() })?;
        for &(off, len) in ranges {
            m.populate_range(off, len)?;
        }
        let list: Vec<_> = ranges
            .iter()
            .map(|&(off, len)| sys::udmabuf::Range { memfd, offset: off as u64, size: len as u64 })
            .collect();
        let dmabuf = sys::udmabuf::create_list(self.dev.as_fd(), &list).map_err(alloc_error(
            total,
            "udmabuf".into(),
            "UDMABUF_CREATE_LIST",
        ))?;
        let keep = memfd.try_clone_to_owned().map_err(Error::io("dup memfd"))?;
        // The memfd is the segment's for pread/pwrite-style access (`Segment::memfd`, which
        // the kernel copy engine uses) only where the segment's offsets are the memfd's: one
        // range from its start. Otherwise an offset in the export names another place in the
        // memfd (another block's bytes): the memfd is only kept alive.
        let backing = if ranges == [(0, total)] { Backing::Memfd(keep) } else { Backing::Memfds(vec![keep]) };
        Segment::new(dmabuf, total, FdKind::DmaBuf, seg.kind(), Origin::Udmabuf, backing, true)
    }
}

/// Faults in every page of a memfd segment through its mapping.
fn populate(seg: &Segment) -> std::io::Result<()> {
    match seg.mapping() {
        Some(m) => m.populate(),
        None => Ok(()),
    }
}
