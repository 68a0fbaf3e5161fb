//! RAII shared mappings and the rule for touching them.
//!
//! Memory behind a [`Mapping`] is shared with devices and other processes: its bytes can change
//! at any time without this process writing them. So the crate never hands out `&[u8]` or
//! `&mut [u8]` into it (the compiler would be entitled to assume nobody else changes them).
//!
//! The access rule: every access is a bounds-checked bulk copy between the mapping and memory
//! this process owns, and on the mapping's side every load and store is a relaxed atomic
//! (`AtomicU64` for the aligned body, `AtomicU8` for the edges). Several threads of this
//! process may therefore read and write one mapping through `&Mapping` at once without a data
//! race in Rust's sense; overlapping writers leave an unspecified mix of their bytes, exactly
//! as two processes writing a shared buffer would. Ordering against devices is the job of the
//! dma-buf sync guard ([`crate::segment::CpuAccess`]) and, later, of queue events. Code that
//! takes [`Mapping::as_ptr`] must follow the same rule.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::io;
use std::os::fd::BorrowedFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering::Relaxed};

use rustix::mm::{MapFlags, ProtFlags};

use crate::error::{Error, Result};

/// A `MAP_SHARED` mapping of (part of) a file, unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    writable: bool,
}

// SAFETY: a Mapping owns a range of address space, not thread-affine data; every access goes
// through raw-pointer copies whose concurrency rule is documented at module level, and unmap
// happens once, in Drop, when no borrow of the Mapping remains.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only permits bounds-checked raw copies.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` at `offset`, shared, readable and (if `writable`) writable.
    pub(crate) fn map_shared(fd: BorrowedFd<'_>, offset: u64, len: usize, writable: bool) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        let prot = if writable { ProtFlags::READ | ProtFlags::WRITE } else { ProtFlags::READ };
        // SAFETY: a fresh mapping at an address the kernel chooses (null hint) cannot alias any
        // memory Rust already uses; `fd` is borrowed for the call only, the mapping keeps its
        // own reference to the file.
        let ptr = unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, fd, offset) }?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::from(io::ErrorKind::Other))?;
        Ok(Self { ptr, len, writable })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: mappings are never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the mapping was made writable.
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// Base address, for handing to code that follows the module's access rule (queues, FFI).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds { offset, len, size: self.len }),
        }
    }

    fn check_writable(&self) -> Result<()> {
        if self.writable { Ok(()) } else { Err(Error::ReadOnly) }
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the mapping.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        let from = self.ptr.as_ptr().wrapping_add(offset);
        // SAFETY: [from, from + dst.len()) is inside the live mapping (checked above), which
        // is only ever accessed atomically.
        unsafe { shared::copy_out(from, dst) };
        Ok(())
    }

    /// Copies `src` into the mapping at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        self.check_writable()?;
        let to = self.ptr.as_ptr().wrapping_add(offset);
        // SAFETY: [to, to + src.len()) is inside the live, writable mapping (checked above),
        // which is only ever accessed atomically.
        unsafe { shared::copy_in(src, to) };
        Ok(())
    }

    /// Sets `len` bytes at `offset` to `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.check(offset, len)?;
        self.check_writable()?;
        let to = self.ptr.as_ptr().wrapping_add(offset);
        // SAFETY: [to, to + len) is inside the live, writable mapping (checked above), which
        // is only ever accessed atomically.
        unsafe { shared::fill(to, len, byte) };
        Ok(())
    }

    /// Faults every page in now (`MADV_POPULATE_WRITE`, or `_READ` for a read-only mapping), so
    /// that memory exhaustion is an error here rather than a SIGBUS on first touch. For shmem
    /// this also initialises pages that were only `fallocate`d, which matters before the pages
    /// are handed to udmabuf (see `Udmabuf::export`).
    pub(crate) fn populate(&self) -> io::Result<()> {
        use rustix::mm::Advice;
        let advice = if self.writable { Advice::LinuxPopulateWrite } else { Advice::LinuxPopulateRead };
        // SAFETY: populating only faults in pages of our own live mapping; it does not change
        // their contents as any reader sees them (holes read as zeroes before and after).
        unsafe { rustix::mm::madvise(self.ptr.as_ptr().cast::<c_void>(), self.len, advice) }?;
        Ok(())
    }

    /// Locks the mapped pages in RAM (`mlock`), faulting them in.
    pub(crate) fn lock(&self) -> io::Result<()> {
        // SAFETY: mlock only changes residency of our own live mapping; it does not touch its
        // contents as Rust sees them.
        unsafe { rustix::mm::mlock(self.ptr.as_ptr().cast::<c_void>(), self.len) }?;
        Ok(())
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len describe a mapping this value created and still owns; no borrow of
        // `self` outlives this call, so nothing can touch the range afterwards. An error here
        // (impossible for a range we mapped) is ignored: Drop must not panic.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast::<c_void>(), self.len) };
    }
}

/// Copies between private memory and shared memory that is only accessed atomically.
mod shared {
    use super::*;

    /// Splits `[p, p + len)` into an unaligned head, a run of 8-byte words, and a tail.
    fn split(p: *const u8, len: usize) -> (usize, usize) {
        let head = p.align_offset(8).min(len);
        let words = (len - head) / 8;
        (head, words)
    }

    /// # Safety
    /// `[shared, shared + dst.len())` must be valid for reads and accessed only atomically.
    pub(super) unsafe fn copy_out(shared: *const u8, dst: &mut [u8]) {
        let (head, words) = split(shared, dst.len());
        for (i, d) in dst.iter_mut().enumerate().take(head) {
            // SAFETY: in range (caller), and byte atomics need no alignment.
            *d = unsafe { AtomicU8::from_ptr(shared.wrapping_add(i).cast_mut()) }.load(Relaxed);
        }
        let body = shared.wrapping_add(head).cast::<u64>().cast_mut();
        for (w, chunk) in dst[head..head + words * 8].chunks_exact_mut(8).enumerate() {
            // SAFETY: in range (caller); `shared + head` is 8-aligned by `split`.
            let v = unsafe { AtomicU64::from_ptr(body.wrapping_add(w)) }.load(Relaxed);
            chunk.copy_from_slice(&v.to_ne_bytes());
        }
        for (i, d) in dst.iter_mut().enumerate().skip(head + words * 8) {
            // SAFETY: in range (caller).
            *d = unsafe { AtomicU8::from_ptr(shared.wrapping_add(i).cast_mut()) }.load(Relaxed);
        }
    }

    /// # Safety
    /// `[shared, shared + src.len())` must be valid for writes and accessed only atomically.
    pub(super) unsafe fn copy_in(src: &[u8], shared: *mut u8) {
        let (head, words) = split(shared, src.len());
        for (i, &b) in src.iter().enumerate().take(head) {
            // SAFETY: in range (caller).
            unsafe { AtomicU8::from_ptr(shared.wrapping_add(i)) }.store(b, Relaxed);
        }
        let body = shared.wrapping_add(head).cast::<u64>();
        for (w, chunk) in src[head..head + words * 8].chunks_exact(8).enumerate() {
            let v =
                u64::from_ne_bytes([chunk[0], chunk[1], chunk[2], chunk[3], chunk[4], chunk[5], chunk[6], chunk[7]]);
            // SAFETY: in range (caller); 8-aligned by `split`.
            unsafe { AtomicU64::from_ptr(body.wrapping_add(w)) }.store(v, Relaxed);
        }
        for (i, &b) in src.iter().enumerate().skip(head + words * 8) {
            // SAFETY: in range (caller).
            unsafe { AtomicU8::from_ptr(shared.wrapping_add(i)) }.store(b, Relaxed);
        }
    }

    /// # Safety
    /// `[shared, shared + len)` must be valid for writes and accessed only atomically.
    pub(super) unsafe fn fill(shared: *mut u8, len: usize, byte: u8) {
        let (head, words) = split(shared, len);
        let word = u64::from_ne_bytes([byte; 8]);
        for i in (0..head).chain(head + words * 8..len) {
            // SAFETY: in range (caller).
            unsafe { AtomicU8::from_ptr(shared.wrapping_add(i)) }.store(byte, Relaxed);
        }
        for w in 0..words {
            // SAFETY: in range (caller); 8-aligned by `split`.
            unsafe { AtomicU64::from_ptr(shared.wrapping_add(head + w * 8).cast::<u64>()) }.store(word, Relaxed);
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn copies_are_exact_at_every_alignment_and_length() {
            let mut shared = vec![0u64; 40];
            let base = shared.as_mut_ptr().cast::<u8>();
            for off in 0..9 {
                for len in [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 200] {
                    let src: Vec<u8> = (0..len).map(|i| (i * 7 + off + 1) as u8).collect();
                    // SAFETY: off + len <= 209 < 320 bytes of `shared`, touched only here.
                    unsafe { copy_in(&src, base.wrapping_add(off)) };
                    let mut back = vec![0u8; len];
                    // SAFETY: as above.
                    unsafe { copy_out(base.wrapping_add(off), &mut back) };
                    assert_eq!(back, src, "off {off} len {len}");
                    // SAFETY: as above.
                    unsafe { fill(base.wrapping_add(off), len, 0xee) };
                    // SAFETY: as above.
                    unsafe { copy_out(base.wrapping_add(off), &mut back) };
                    assert!(back.iter().all(|&b| b == 0xee), "off {off} len {len}");
                    // Neighbours untouched.
                    // SAFETY: as above; `off + len < 320`.
                    let after = unsafe { AtomicU8::from_ptr(base.wrapping_add(off + len)) }.load(Relaxed);
                    assert_ne!(after, 0xee, "wrote past the end at off {off} len {len}");
                    // SAFETY: as above.
                    unsafe { fill(base, 320, 0) };
                }
            }
        }
    }
}
