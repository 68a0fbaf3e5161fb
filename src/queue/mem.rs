//! What queue operations read and write: ranges of segments and of host buffers. Holding a
//! [`Mem`] keeps its memory alive, which is how the API makes it impossible in safe Rust to
//! free a buffer while an operation on it is in flight.
#![allow(unsafe_code)]

use std::alloc::Layout;
use std::os::fd::BorrowedFd;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::copy;
use crate::error::{Error, Result};
use crate::segment::Segment;

/// Host memory shared with queues: a zeroed heap buffer behind an `Arc`, page-aligned from a
/// page up (64-byte aligned below).
/// Queues copy into and out of it while the caller may still hold it, so, like a segment's
/// mapping, it is accessed only through bounds-checked byte-wise-atomic copies.
#[derive(Clone)]
pub struct HostBuffer {
    inner: Arc<HostAlloc>,
}

struct HostAlloc {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the allocation is owned by this value and accessed only through `crate::copy`'s
// byte-wise atomic copies, so sharing and sending it between threads cannot race.
unsafe impl Send for HostAlloc {}
// SAFETY: as above.
unsafe impl Sync for HostAlloc {}

impl Drop for HostAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated in `HostBuffer::new` with this layout; dropped once, when the last
        // holder (caller or in-flight operation) lets go.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer").field("len", &self.len()).finish()
    }
}

impl HostBuffer {
    /// A zeroed buffer of `len` bytes.
    pub fn new(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::ZeroLength);
        }
        // Page-aligned from a page up (as segments are: copies between them and host buffers
        // then see the same alignment on both sides, and no 4K aliasing); 64 bytes below.
        let align = if len >= 4096 { 4096 } else { 64 };
        let layout = Layout::from_size_align(len, align).map_err(|_| Error::TooLarge {
            requested: len as u64,
            limit: isize::MAX as u64,
            what: "address space",
            source_name: "host buffer".into(),
        })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::OutOfMemory {
            requested: len as u64,
            source_name: "host buffer".into(),
            source: std::io::Error::from(std::io::ErrorKind::OutOfMemory),
        })?;
        Ok(Self { inner: Arc::new(HostAlloc { ptr, layout }) })
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice(data: &[u8]) -> Result<Self> {
        let b = Self::new(data.len())?;
        b.write(0, data)?;
        Ok(b)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.layout.size()
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        false
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(Error::OutOfBounds { offset, len, size: self.len() }),
        }
    }

    /// Copies bytes out.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        // SAFETY: in bounds (checked); the buffer is only accessed through `copy`.
        unsafe { copy::copy(self.as_ptr().wrapping_add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies bytes in.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        // SAFETY: in bounds (checked); the buffer is only accessed through `copy`.
        unsafe { copy::copy_from_private(src, self.as_ptr().wrapping_add(offset)) };
        Ok(())
    }

    /// The contents, copied into a `Vec`.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len()];
        let _ = self.read(0, &mut v);
        v
    }

    #[inline]
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.inner.ptr.as_ptr()
    }
}

#[derive(Clone)]
enum Target {
    Host(HostBuffer),
    Segment(Arc<Segment>),
    /// Memory the caller vouched for ([`Mem::from_raw`]): an address, and whether it may be
    /// written.
    Raw {
        base: usize,
        writable: bool,
    },
}

/// How a copy's two ranges share pages through two mappings ([`Mem::aliasing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Aliasing {
    /// They share none (or are ranges of one mapping, whose addresses tell).
    No,
    /// They are ranges of one file at known offsets that meet: the copy must move the bytes
    /// in the file's order (from the end first where the destination lies after the source).
    Ordered { dst_after_src: bool },
    /// They show pages of one file at offsets not known here (a page-stitched arena, a
    /// udmabuf of several ranges): the copy goes through a private copy of the source.
    Unknown,
}

/// A byte range of a segment or a host buffer, for queue operations.
#[derive(Clone)]
pub struct Mem {
    target: Target,
    offset: usize,
    len: usize,
}

impl std::fmt::Debug for Mem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match &self.target {
            Target::Host(_) => "host",
            Target::Segment(_) => "segment",
            Target::Raw { .. } => "raw",
        };
        write!(f, "Mem({what} {}+{})", self.offset, self.len)
    }
}

impl From<&HostBuffer> for Mem {
    fn from(b: &HostBuffer) -> Self {
        Mem { len: b.len(), target: Target::Host(b.clone()), offset: 0 }
    }
}

impl From<&Arc<Segment>> for Mem {
    /// The segment's mapped bytes (for an expandable segment, its mapped prefix: the rest of
    /// the reservation is no memory a queue could copy to).
    fn from(s: &Arc<Segment>) -> Self {
        Mem { len: s.mapped_len(), target: Target::Segment(Arc::clone(s)), offset: 0 }
    }
}

/// An operand of [`Queue::copy`](super::Queue::copy) or [`Queue::fill`](super::Queue::fill):
/// a range given by value, or a borrowed [`Mem`], which the queue clones only if the operation
/// has to wait in the queue (a small copy on an idle queue runs at once and clones nothing).
#[derive(Debug)]
pub enum MemArg<'a> {
    /// A range the queue may keep.
    Owned(Mem),
    /// A range the caller keeps.
    Borrowed(&'a Mem),
}

impl MemArg<'_> {
    pub(crate) fn get(&self) -> &Mem {
        match self {
            MemArg::Owned(m) => m,
            MemArg::Borrowed(m) => m,
        }
    }

    pub(crate) fn into_owned(self) -> Mem {
        match self {
            MemArg::Owned(m) => m,
            MemArg::Borrowed(m) => m.clone(),
        }
    }
}

impl From<Mem> for MemArg<'_> {
    fn from(m: Mem) -> Self {
        MemArg::Owned(m)
    }
}

impl<'a> From<&'a Mem> for MemArg<'a> {
    fn from(m: &'a Mem) -> Self {
        MemArg::Borrowed(m)
    }
}

impl From<&HostBuffer> for MemArg<'_> {
    fn from(b: &HostBuffer) -> Self {
        MemArg::Owned(b.into())
    }
}

impl From<&Arc<Segment>> for MemArg<'_> {
    fn from(s: &Arc<Segment>) -> Self {
        MemArg::Owned(s.into())
    }
}

impl Mem {
    /// `len` bytes at `ptr` that this crate does not own: host memory a C caller passes in.
    /// Copies go through the same byte-wise atomic copy as every other range.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be valid for reads (and, if `writable`, for writes) from now
    /// until every operation given this range (or a clone or sub-range of it) has completed,
    /// and must not be freed or unmapped before. Other accesses during that time must not be
    /// plain (non-atomic) writes the copy could race with. A null `ptr` is refused.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize, writable: bool) -> Result<Mem> {
        if ptr.is_null() {
            return Err(Error::Unsupported { what: "a null pointer".into() });
        }
        if (ptr as usize).checked_add(len).is_none_or(|end| end > isize::MAX as usize) {
            return Err(Error::InvalidArgument {
                what: format!("{len} bytes at {ptr:p} run past the end of the address space"),
            });
        }
        Ok(Mem { target: Target::Raw { base: ptr as usize, writable }, offset: 0, len })
    }

    /// The sub-range `[offset, offset + len)` of this range.
    pub fn range(&self, offset: usize, len: usize) -> Result<Mem> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(Mem { target: self.target.clone(), offset: self.offset + offset, len }),
            _ => Err(Error::OutOfBounds { offset, len, size: self.len }),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty range.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether two ranges share any byte.
    pub(crate) fn overlaps(&self, other: &Mem) -> bool {
        let (Ok(a), Ok(b)) = (self.ptr(), other.ptr()) else { return false };
        let (a, b) = (a as usize, b as usize);
        a < b + other.len && b < a + self.len
    }

    /// Whether a copy from `src` into this range moves bytes between two mappings of the same
    /// pages (two segments over one file: an fd imported twice, a block's fd imported back, a
    /// udmabuf and its memfd), where the addresses do not show that the ranges meet. Ranges of
    /// one segment are told apart by their addresses (`overlaps`), host memory by the caller.
    pub(crate) fn aliasing(&self, src: &Mem) -> Aliasing {
        let (Target::Segment(d), Target::Segment(s)) = (&self.target, &src.target) else { return Aliasing::No };
        if Arc::ptr_eq(d, s) || !d.files().iter().any(|f| s.files().contains(f)) {
            return Aliasing::No;
        }
        if !(d.files_in_order() && s.files_in_order()) {
            return Aliasing::Unknown;
        }
        // Offsets in both segments are offsets in the file they share.
        let (a, b) = (self.offset, src.offset);
        if a + self.len <= b || b + src.len <= a {
            return Aliasing::No;
        }
        Aliasing::Ordered { dst_after_src: a > b }
    }

    /// The CPU address of the range's first byte.
    #[inline]
    pub(crate) fn ptr(&self) -> Result<*mut u8> {
        match &self.target {
            Target::Host(b) => Ok(b.as_ptr().wrapping_add(self.offset)),
            Target::Segment(s) => s
                .mapping()
                .map(|m| m.as_ptr().wrapping_add(self.offset))
                .ok_or_else(|| Error::Unsupported { what: "segment has no CPU mapping".into() }),
            Target::Raw { base, .. } => Ok((*base as *mut u8).wrapping_add(self.offset)),
        }
    }

    #[inline]
    pub(crate) fn writable(&self) -> bool {
        match &self.target {
            Target::Host(_) => true,
            Target::Segment(s) => s.is_writable(),
            Target::Raw { writable, .. } => *writable,
        }
    }

    /// The dma-buf to bracket CPU access with, if the range is in one.
    #[inline]
    pub(crate) fn dmabuf(&self) -> Option<BorrowedFd<'_>> {
        match &self.target {
            Target::Segment(s) if s.is_dma_buf() => Some(std::os::fd::AsFd::as_fd(&**s)),
            _ => None,
        }
    }

    /// A memfd and offset that hold the range, for kernel (READ/WRITE) copies.
    pub(crate) fn memfd(&self) -> Option<(BorrowedFd<'_>, u64)> {
        match &self.target {
            Target::Segment(s) => s.memfd().map(|fd| (fd, self.offset as u64)),
            Target::Host(_) | Target::Raw { .. } => None,
        }
    }
}
