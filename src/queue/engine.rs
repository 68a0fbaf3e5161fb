//! Executing copies and fills: the raw-pointer side of the queue, kept apart so the rest of
//! the queue module stays free of `unsafe`.
#![allow(unsafe_code)]

use std::sync::Arc;

use super::ring::RingError;
use super::{Mem, QueueShared};
use crate::copy;
use crate::sys;

/// Brackets CPU access to the dma-buf sides of an operation with DMA_BUF_IOCTL_SYNC.
fn with_sync<T>(
    sides: [(Option<std::os::fd::BorrowedFd<'_>>, u64); 2],
    f: impl FnOnce() -> T,
) -> std::result::Result<T, Arc<str>> {
    let mut started = 0;
    for (i, &(fd, dir)) in sides.iter().enumerate() {
        if let Some(fd) = fd {
            if let Err(e) = sys::dma_buf::sync(fd, sys::dma_buf::SYNC_START | dir) {
                let _ = end_sync(&sides[..i]); // the start error is the one to report
                return Err(format!("DMA_BUF_IOCTL_SYNC start: {e}").into());
            }
        }
        started = i + 1;
    }
    let out = f();
    end_sync(&sides[..started]).map(|()| out)
}

fn end_sync(sides: &[(Option<std::os::fd::BorrowedFd<'_>>, u64)]) -> std::result::Result<(), Arc<str>> {
    let mut err = Ok(());
    for &(fd, dir) in sides {
        if let Some(fd) = fd {
            if let Err(e) = sys::dma_buf::sync(fd, sys::dma_buf::SYNC_END | dir) {
                err = Err(format!("DMA_BUF_IOCTL_SYNC end: {e}").into());
            }
        }
    }
    err
}

/// A copy whose ranges were checked (same length, CPU-mapped, writable destination), with
/// both CPU addresses resolved once: what the small-copy fast path runs.
pub(super) struct CheckedCopy<'a> {
    dst: &'a Mem,
    src: &'a Mem,
    d: *mut u8,
    s: *mut u8,
}

impl<'a> CheckedCopy<'a> {
    /// Checks a copy of `src` to `dst`: the lengths must match, both sides must have a CPU
    /// mapping, and `dst` must be writable.
    #[inline]
    pub(super) fn new(dst: &'a Mem, src: &'a Mem) -> crate::error::Result<Self> {
        if dst.len() != src.len() {
            return Err(crate::error::Error::SizeMismatch { dst: dst.len(), src: src.len() });
        }
        let (d, s) = (dst.ptr()?, src.ptr()?);
        if !dst.writable() {
            return Err(crate::error::Error::ReadOnly);
        }
        Ok(Self { dst, src, d, s })
    }

    /// Bytes to copy.
    pub(super) fn len(&self) -> usize {
        self.dst.len()
    }

    /// Runs the copy on this thread with the CPU copy kernel (inside the dma-buf sync bracket
    /// where a side is a dma-buf).
    #[inline]
    pub(super) fn run(&self) -> std::result::Result<(), Arc<str>> {
        if self.src.dmabuf().is_none() && self.dst.dmabuf().is_none() {
            // SAFETY: both ranges lie inside live memory the two `Mem`s hold for the call
            // (checked at construction: same length, mapped), accessed only through `copy`.
            unsafe { copy_maybe_overlapping(self.s, self.d, self.len()) };
            return Ok(());
        }
        cpu_copy(self.dst, self.src)
    }
}

pub(super) fn cpu_copy(dst: &Mem, src: &Mem) -> std::result::Result<(), Arc<str>> {
    let (d, s) = match (dst.ptr(), src.ptr()) {
        (Ok(d), Ok(s)) => (d, s),
        _ => return Err("copy side has no CPU mapping".into()),
    };
    let (src_buf, dst_buf) = (src.dmabuf(), dst.dmabuf());
    if src_buf.is_none() && dst_buf.is_none() {
        // No dma-buf side: no sync bracket (the small-copy fast path pays nothing for it).
        // SAFETY: as below.
        unsafe { copy_maybe_overlapping(s, d, dst.len()) };
        return Ok(());
    }
    with_sync([(src_buf, sys::dma_buf::SYNC_READ), (dst_buf, sys::dma_buf::SYNC_WRITE)], || {
        // SAFETY: both ranges lie inside live memory held by `dst`/`src` (Mem ranges are
        // bounds-checked at construction, and the Arcs they hold keep the memory mapped);
        // they are accessed only through `copy`. Overlapping ranges of one buffer are
        // refused by the caller's contract of distinct buffers (see below).
        unsafe { copy_maybe_overlapping(s, d, dst.len()) }
    })
}

/// # Safety
/// As `copy::copy`, except that the ranges may overlap (a copy within one segment).
unsafe fn copy_maybe_overlapping(src: *const u8, dst: *mut u8, len: usize) {
    let (s, d) = (src as usize, dst as usize);
    if s + len <= d || d + len <= s {
        // SAFETY: disjoint, valid (caller).
        unsafe { copy::copy(src, dst, len) };
    } else {
        // Overlap: bounce through a private buffer, which cannot overlap either range.
        let mut tmp = vec![0u8; len];
        // SAFETY: valid (caller); `tmp` is private.
        unsafe { copy::copy(src, tmp.as_mut_ptr(), len) };
        // SAFETY: as above.
        unsafe { copy::copy_from_private(&tmp, dst) };
    }
}

pub(super) fn cpu_fill(dst: &Mem, byte: u8) -> std::result::Result<(), Arc<str>> {
    let d = dst.ptr().map_err(|e| Arc::from(e.to_string()))?;
    with_sync([(dst.dmabuf(), sys::dma_buf::SYNC_WRITE), (None, 0)], || {
        // SAFETY: the range lies inside live memory held by `dst`, accessed only via `copy`.
        unsafe { copy::fill(d, dst.len(), byte) }
    })
}

pub(super) fn kernel_copy(shared: &QueueShared, dst: &Mem, src: &Mem) -> std::result::Result<(), Arc<str>> {
    let (d, sp) = match (dst.ptr(), src.ptr()) {
        (Ok(d), Ok(s)) => (d, s),
        _ => return Err("copy side has no CPU mapping".into()),
    };
    let sides = [(src.dmabuf(), sys::dma_buf::SYNC_READ), (dst.dmabuf(), sys::dma_buf::SYNC_WRITE)];
    let r = with_sync(sides, || {
        let Ok(mut ring) = shared.ring.lock() else {
            return Err(("kernel copy", RingError::NotSubmitted("the queue's ring lock is poisoned".into())));
        };
        let Some(ring) = ring.as_mut() else {
            return Err(("kernel copy", RingError::NotSubmitted("the queue's io_uring is closed".into())));
        };
        if let Some((fd, off)) = dst.memfd() {
            // SAFETY: the source range lies in live memory held by `src` for the whole call,
            // and for good if the ring fails mid-flight (parked below).
            unsafe { ring.write(fd, sp, src.len(), off) }.map_err(|e| ("io_uring WRITE to memfd", e))
        } else if let Some((fd, off)) = src.memfd() {
            // SAFETY: the destination range lies in live, writable memory held by `dst`, and
            // for good if the ring fails mid-flight (parked below).
            unsafe { ring.read(fd, d, dst.len(), off) }.map_err(|e| ("io_uring READ from memfd", e))
        } else {
            Err(("kernel copy", RingError::NotSubmitted("no memfd side".into())))
        }
    })?;
    r.map_err(|(what, e)| {
        if matches!(e, RingError::Ring(_)) {
            park(dst, src);
        }
        Arc::from(format!("{what}: {e}"))
    })
}

/// Keeps the memory of an operation the kernel may still be using alive for the rest of the
/// process: after a ring failure there is no way to learn when (or whether) it stops.
fn park(dst: &Mem, src: &Mem) {
    static PARKED: std::sync::Mutex<Vec<Mem>> = std::sync::Mutex::new(Vec::new());
    let mut p = PARKED.lock().unwrap_or_else(|p| p.into_inner());
    p.push(dst.clone());
    p.push(src.clone());
}
