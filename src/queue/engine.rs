//! Executing copies and fills: the raw-pointer side of the queue, kept apart so the rest of
//! the queue module stays free of `unsafe`.
#![allow(unsafe_code)]

use std::sync::Arc;

use super::mem::Aliasing;
use super::ring::{RingError, Transfer};
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
    alias: Aliasing,
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
        Ok(Self { dst, src, d, s, alias: dst.aliasing(src) })
    }

    /// Bytes to copy.
    pub(super) fn len(&self) -> usize {
        self.dst.len()
    }

    /// Runs the copy on this thread with the CPU copy kernel (inside the dma-buf sync bracket
    /// where a side is a dma-buf).
    #[inline]
    pub(super) fn run(&self) -> std::result::Result<(), Arc<str>> {
        copy_resolved(self.dst, self.src, self.d, self.s, self.alias)
    }
}

pub(super) fn cpu_copy(dst: &Mem, src: &Mem) -> std::result::Result<(), Arc<str>> {
    let (d, s) = match (dst.ptr(), src.ptr()) {
        (Ok(d), Ok(s)) => (d, s),
        _ => return Err("copy side has no CPU mapping".into()),
    };
    copy_resolved(dst, src, d, s, dst.aliasing(src))
}

/// Copies `src` (at CPU address `s`) to `dst` (at `d`), whose sharing of pages is `alias`
/// ([`Mem::aliasing`]), inside the dma-buf sync bracket where a side is a dma-buf.
#[inline]
fn copy_resolved(dst: &Mem, src: &Mem, d: *mut u8, s: *mut u8, alias: Aliasing) -> std::result::Result<(), Arc<str>> {
    // SAFETY: both ranges lie inside live memory held by `dst`/`src` for the call (Mem ranges
    // are bounds-checked at construction, and the Arcs they hold keep the memory mapped);
    // they are accessed only through `copy`. Ranges of one mapping that overlap, and two
    // mappings of the same pages, are moved as `memmove` would.
    let run = || unsafe { copy_pages(s, d, dst.len(), alias) };
    let (src_buf, dst_buf) = (src.dmabuf(), dst.dmabuf());
    if src_buf.is_none() && dst_buf.is_none() {
        // No dma-buf side: no sync bracket (the small-copy fast path pays nothing for it).
        return run();
    }
    with_sync([(src_buf, sys::dma_buf::SYNC_READ), (dst_buf, sys::dma_buf::SYNC_WRITE)], run)?
}

/// Copies `len` bytes from `src` to `dst` as `memmove` would: ranges that share no pages
/// (`alias` is [`Aliasing::No`]) compared by address, others by [`copy_aliased`].
///
/// # Safety
/// As `copy::copy`, except that the ranges may overlap or show the same pages.
#[inline]
unsafe fn copy_pages(src: *const u8, dst: *mut u8, len: usize, alias: Aliasing) -> std::result::Result<(), Arc<str>> {
    let alias = match alias {
        Aliasing::No => {
            let (s, d) = (src as usize, dst as usize);
            if s + len <= d || d + len <= s {
                // SAFETY: disjoint, valid (caller).
                unsafe { copy::copy(src, dst, len) };
                return Ok(());
            }
            // One mapping, overlapping ranges: their addresses give the order.
            Aliasing::Ordered { dst_after_src: d > s }
        }
        other => other,
    };
    // SAFETY: as the caller's.
    unsafe { copy_aliased(src, dst, len, alias) }
}

/// Bytes moved at a time by [`copy_aliased`] where the order is known.
const ALIASED_CHUNK: usize = 64 << 10;

/// Copies `len` bytes from `src` to `dst`, two ranges that may meet (`alias`, not
/// [`Aliasing::No`]: overlapping ranges of one mapping, or two mappings of the same pages), as
/// `memmove` would in the memory they share: where the order is known,
/// a chunk at a time through a private buffer, in the file's order (from the end first where
/// the destination lies after the source, so no chunk reads bytes already written); else
/// through a private copy of the whole source (refused, not aborted, if there is no memory
/// for it).
///
/// # Safety
/// As `copy::copy`, except that the ranges may overlap or show the same pages.
unsafe fn copy_aliased(src: *const u8, dst: *mut u8, len: usize, alias: Aliasing) -> std::result::Result<(), Arc<str>> {
    let mut tmp: Vec<u8> = Vec::new();
    let chunk = match alias {
        Aliasing::Ordered { .. } => len.min(ALIASED_CHUNK),
        _ => len,
    };
    tmp.try_reserve_exact(chunk).map_err(|_| {
        Arc::<str>::from(format!(
            "copy between ranges that share pages: no memory for a private copy of its {len} bytes"
        ))
    })?;
    tmp.resize(chunk, 0);
    let mut move_chunk = |at: usize, n: usize| {
        // `at + n <= len`: inside both ranges (the caller's, valid for `len` bytes).
        let (s, d) = (src.wrapping_add(at), dst.wrapping_add(at));
        // SAFETY: `[s, s + n)` is readable (above); `tmp` is private and holds `n` bytes.
        unsafe { copy::copy(s, tmp.as_mut_ptr(), n) };
        // SAFETY: `[d, d + n)` is writable (above).
        unsafe { copy::copy_from_private(&tmp[..n], d) };
    };
    if matches!(alias, Aliasing::Ordered { dst_after_src: true }) {
        let mut end = len;
        while end > 0 {
            let n = end.min(chunk);
            move_chunk(end - n, n);
            end -= n;
        }
    } else {
        let mut at = 0;
        while at < len {
            let n = (len - at).min(chunk);
            move_chunk(at, n);
            at += n;
        }
    }
    Ok(())
}

pub(super) fn cpu_fill(dst: &Mem, byte: u8) -> std::result::Result<(), Arc<str>> {
    let d = dst.ptr().map_err(|e| Arc::from(e.to_string()))?;
    with_sync([(dst.dmabuf(), sys::dma_buf::SYNC_WRITE), (None, 0)], || {
        // SAFETY: the range lies inside live memory held by `dst`, accessed only via `copy`.
        unsafe { copy::fill(d, dst.len(), byte) }
    })
}

/// The io_uring transfer that performs a copy: a WRITE to the destination's memfd from the
/// source's mapping, or a READ from the source's memfd into the destination's mapping.
fn transfer_of(dst: &Mem, src: &Mem) -> std::result::Result<Transfer, Arc<str>> {
    let (d, sp) = match (dst.ptr(), src.ptr()) {
        (Ok(d), Ok(s)) => (d, s),
        _ => return Err("copy side has no CPU mapping".into()),
    };
    let fd = |f: std::os::fd::BorrowedFd<'_>| io_uring::types::Fd(std::os::fd::AsRawFd::as_raw_fd(&f));
    if let Some((f, offset)) = dst.memfd() {
        Ok(Transfer { write: true, fd: fd(f), buf: sp, len: src.len(), offset })
    } else if let Some((f, offset)) = src.memfd() {
        Ok(Transfer { write: false, fd: fd(f), buf: d, len: dst.len(), offset })
    } else {
        Err("kernel copy: no memfd side".into())
    }
}

/// Runs `copies` (each with a memfd side and no overlap, see `kernel_copy_applies`) in order
/// as one linked chain on the queue's ring: one `io_uring_enter` for all of them. The first
/// failure is reported; the copies after it did not run. Sides that are dma-bufs are bracketed
/// with DMA_BUF_IOCTL_SYNC, which only a chain of one copy may have (the executor batches only
/// copies without one).
pub(super) fn kernel_copies(shared: &QueueShared, copies: &[(&Mem, &Mem)]) -> std::result::Result<(), Arc<str>> {
    let transfers = copies.iter().map(|(d, s)| transfer_of(d, s)).collect::<std::result::Result<Vec<_>, _>>()?;
    let run = || {
        let Ok(mut ring) = shared.ring.lock() else {
            return Err((0, RingError::NotSubmitted("the queue's ring lock is poisoned".into())));
        };
        let Some(ring) = ring.as_mut() else {
            return Err((0, RingError::NotSubmitted("the queue's io_uring is closed".into())));
        };
        // SAFETY: every buffer lies in live memory held by the copies' `Mem`s for the whole
        // call (destinations writable: checked at submission), and for good if the ring fails
        // mid-flight (parked below).
        unsafe { ring.transfer_chain(&transfers) }
    };
    let r = match copies {
        [(dst, src)] => {
            with_sync([(src.dmabuf(), sys::dma_buf::SYNC_READ), (dst.dmabuf(), sys::dma_buf::SYNC_WRITE)], run)?
        }
        _ => run(),
    };
    r.map_err(|(i, e)| {
        if matches!(e, RingError::Ring(_)) {
            for (d, s) in copies {
                park(d, s);
            }
        }
        let what = if transfers[i].write { "io_uring WRITE to memfd" } else { "io_uring READ from memfd" };
        Arc::from(format!("{what}: {e}"))
    })
}

/// Whether a kernel-engine copy can join a chain of several: no dma-buf side (whose sync
/// bracket would have to span the chain).
pub(super) fn chainable(dst: &Mem, src: &Mem) -> bool {
    dst.dmabuf().is_none() && src.dmabuf().is_none()
}

/// Keeps the memory of an operation the kernel may still be using alive for the rest of the
/// process: after a ring failure there is no way to learn when (or whether) it stops.
fn park(dst: &Mem, src: &Mem) {
    static PARKED: std::sync::Mutex<Vec<Mem>> = std::sync::Mutex::new(Vec::new());
    let mut p = PARKED.lock().unwrap_or_else(|p| p.into_inner());
    p.push(dst.clone());
    p.push(src.clone());
}
