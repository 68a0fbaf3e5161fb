//! RAII shared mappings and the rule for touching them.
//!
//! Memory behind a [`Mapping`] is shared with devices and other processes: its bytes can change
//! at any time without this process writing them. So the crate never hands out `&[u8]` or
//! `&mut [u8]` into it (the compiler would be entitled to assume nobody else changes them).
//!
//! The access rule: every access is a bounds-checked bulk copy between the mapping and other
//! memory, done by `crate::copy`, whose loads and stores on shared memory are byte-wise
//! atomic (relaxed atomics, or on x86-64 SSE loads/stores issued from inline assembly, which
//! the hardware performs byte-wise atomically). Several threads of this process may therefore
//! read and write one mapping through `&Mapping` at once without a data race in Rust's sense;
//! overlapping writers leave an unspecified mix of their bytes, exactly as two processes
//! writing a shared buffer would. Ordering against devices is the job of the dma-buf sync
//! bracket of a CPU view ([`crate::view::CpuView`], the bounded way safe code reaches a
//! mapping) and of queue events. Code that takes [`Mapping::as_ptr`] must follow the same rule.
#![allow(unsafe_code)]

#[cfg(not(miri))]
use std::ffi::c_void;
use std::io;
use std::os::fd::BorrowedFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

#[cfg(not(miri))]
use rustix::mm::{MapFlags, ProtFlags};

use crate::copy;
use crate::error::{Error, Result};

/// A `MAP_SHARED` mapping of (part of) a file, unmapped on drop.
///
/// The reservation behind an expandable segment is address space first: only the prefix grown
/// into it is memory, and every access is bounded by that prefix ([`Mapping::len`]), never by
/// the reservation ([`Mapping::reserved_len`]): a touch of the `PROT_NONE` rest would kill the
/// process.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    /// The address range this value owns (and unmaps).
    reserved: usize,
    /// The accessible prefix: `reserved` for an ordinary mapping; for a reservation, what has
    /// been mapped into it so far. Only grows (Release after the pages are mapped, Acquire by
    /// every bounds check), so a check never admits a page that is not mapped yet.
    mapped: AtomicUsize,
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
    #[cfg(not(miri))]
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
        Ok(Self { ptr, reserved: len, mapped: AtomicUsize::new(len), writable })
    }

    /// Reserves `len` bytes of address space with no access and no memory behind it
    /// (`PROT_NONE`, `MAP_NORESERVE`): the base of an expandable segment. Pages are mapped
    /// into it with [`Mapping::map_fixed_shared`].
    #[cfg(not(miri))]
    pub(crate) fn reserve(len: usize) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        let flags = MapFlags::PRIVATE | MapFlags::NORESERVE;
        // SAFETY: a fresh anonymous mapping at an address the kernel chooses aliases nothing.
        let ptr = unsafe { rustix::mm::mmap_anonymous(std::ptr::null_mut(), len, ProtFlags::empty(), flags) }?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::from(io::ErrorKind::Other))?;
        Ok(Self { ptr, reserved: len, mapped: AtomicUsize::new(0), writable: true })
    }

    /// Maps `len` bytes of `fd` at file offset `offset` over this mapping's own range at the
    /// same offset, shared and read-write (`MAP_FIXED`), and makes them accessible. Used to grow
    /// expandable segments into their reservation: the range must start where the accessible
    /// prefix ends (growth is a prefix; pages in use are never replaced). Callers serialise
    /// growth of one mapping (the pool's lock does).
    #[cfg(not(miri))]
    pub(crate) fn map_fixed_shared(&self, fd: BorrowedFd<'_>, offset: usize, len: usize) -> io::Result<()> {
        let in_range = offset.checked_add(len).is_some_and(|end| end <= self.reserved);
        if !in_range || len == 0 || offset != self.mapped.load(Ordering::Acquire) {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        let at = self.ptr.as_ptr().wrapping_add(offset).cast::<c_void>();
        let prot = ProtFlags::READ | ProtFlags::WRITE;
        // SAFETY: the range lies inside this mapping (checked), which owns it; MAP_FIXED only
        // replaces our own pages there (never memory Rust holds references to: mappings are
        // only reached through raw copies), and the caller maps ranges no block uses yet.
        unsafe { rustix::mm::mmap(at, len, prot, MapFlags::SHARED | MapFlags::FIXED, fd, offset as u64) }?;
        // Published only now that the pages are there: a bounds check that sees the new length
        // sees mapped pages.
        self.mapped.store(offset + len, Ordering::Release);
        Ok(())
    }

    /// Maps `len` bytes of `fd` at file offset `file_off` at bytes `[at, at + len)` of this
    /// reservation (`MAP_FIXED`, shared, read-write), anywhere in it, and widens the accessible
    /// prefix to cover them: how a page-stitched arena makes a view of memfd units. The same
    /// file range may be mapped at several places at once (aliases); callers map only ranges
    /// no block in use covers, under the pool's lock.
    #[cfg(not(miri))]
    pub(crate) fn map_at(&self, fd: BorrowedFd<'_>, at: usize, file_off: u64, len: usize) -> io::Result<()> {
        let in_range = at.checked_add(len).is_some_and(|end| end <= self.reserved);
        if !in_range || len == 0 {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        let ptr = self.ptr.as_ptr().wrapping_add(at).cast::<c_void>();
        let prot = ProtFlags::READ | ProtFlags::WRITE;
        // SAFETY: the range lies inside this mapping's reservation (checked), which it owns;
        // MAP_FIXED replaces our own pages there (reserved address space or an old view no
        // block uses: the caller's rule), never memory Rust holds references to.
        unsafe { rustix::mm::mmap(ptr, len, prot, MapFlags::SHARED | MapFlags::FIXED, fd, file_off) }?;
        // Published only now that the pages are there.
        self.mapped.fetch_max(at + len, Ordering::AcqRel);
        Ok(())
    }

    /// Lets go of the memory shown at bytes `[at, at + len)` of this reservation (an arena's
    /// view that is let go): it becomes private anonymous memory, read-write and unbacked
    /// (`MAP_NORESERVE`: no memory until written), not `PROT_NONE`, so that work a careless
    /// caller still has queued on a block it freed writes into nothing that matters instead of
    /// killing the process. The accessible prefix does not shrink.
    #[cfg(not(miri))]
    pub(crate) fn unmap_at(&self, at: usize, len: usize) -> io::Result<()> {
        let in_range = at.checked_add(len).is_some_and(|end| end <= self.reserved);
        if !in_range || len == 0 {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        let ptr = self.ptr.as_ptr().wrapping_add(at).cast::<c_void>();
        let flags = MapFlags::PRIVATE | MapFlags::NORESERVE | MapFlags::FIXED;
        let prot = ProtFlags::READ | ProtFlags::WRITE;
        // SAFETY: the range lies inside this mapping's reservation (checked); it replaces our
        // own pages with fresh anonymous ones, and no block uses the range (the caller's rule).
        unsafe { rustix::mm::mmap_anonymous(ptr, len, prot, flags) }?;
        Ok(())
    }

    /// Length in bytes that can be accessed: the whole mapping, or for a reservation the part
    /// mapped so far (0 before the first growth).
    pub fn len(&self) -> usize {
        self.mapped.load(Ordering::Acquire)
    }

    /// True for a reservation nothing has been mapped into yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The address space this mapping owns: [`Mapping::len`], or for a reservation all of it
    /// (accessible or not).
    pub fn reserved_len(&self) -> usize {
        self.reserved
    }

    /// Whether the mapping was made writable.
    #[inline]
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// Base address, for handing to code that follows the module's access rule (queues, FFI).
    #[inline]
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        let size = self.len();
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(Error::OutOfBounds { offset, len, size }),
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
        unsafe { copy::copy(from, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the mapping at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        self.check_writable()?;
        let to = self.ptr.as_ptr().wrapping_add(offset);
        // SAFETY: [to, to + src.len()) is inside the live, writable mapping (checked above),
        // which is only ever accessed atomically.
        unsafe { copy::copy_from_private(src, to) };
        Ok(())
    }

    /// Sets `len` bytes at `offset` to `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.check(offset, len)?;
        self.check_writable()?;
        let to = self.ptr.as_ptr().wrapping_add(offset);
        // SAFETY: [to, to + len) is inside the live, writable mapping (checked above), which
        // is only ever accessed atomically.
        unsafe { copy::fill(to, len, byte) };
        Ok(())
    }

    /// Faults every page in now (`MADV_POPULATE_WRITE`, or `_READ` for a read-only mapping), so
    /// that memory exhaustion is an error here rather than a SIGBUS on first touch. For shmem
    /// this also initialises pages that were only `fallocate`d, which matters before the pages
    /// are handed to udmabuf (see `Udmabuf::export`).
    #[cfg(not(miri))]
    pub(crate) fn populate(&self) -> io::Result<()> {
        use rustix::mm::Advice;
        let advice = if self.writable { Advice::LinuxPopulateWrite } else { Advice::LinuxPopulateRead };
        // SAFETY: populating only faults in pages of our own live mapping; it does not change
        // their contents as any reader sees them (holes read as zeroes before and after).
        unsafe { rustix::mm::madvise(self.ptr.as_ptr().cast::<c_void>(), self.len(), advice) }?;
        Ok(())
    }

    /// [`Mapping::populate`] for `len` bytes at `offset` (in bounds, else an error).
    #[cfg(not(miri))]
    pub(crate) fn populate_range(&self, offset: usize, len: usize) -> Result<()> {
        use rustix::mm::Advice;
        self.check(offset, len)?;
        let page = rustix::param::page_size();
        // madvise takes a page-aligned start; the pages around the range are ours too.
        let start = offset - offset % page;
        let advice = if self.writable { Advice::LinuxPopulateWrite } else { Advice::LinuxPopulateRead };
        let at = self.ptr.as_ptr().wrapping_add(start).cast::<c_void>();
        // SAFETY: as in `populate`, for pages of our own live mapping (checked in bounds).
        unsafe { rustix::mm::madvise(at, offset + len - start, advice) }.map_err(Error::io_rustix("madvise(POPULATE)"))
    }

    /// Locks the mapped pages in RAM (`mlock`), faulting them in.
    #[cfg(not(miri))]
    pub(crate) fn lock(&self) -> io::Result<()> {
        // SAFETY: mlock only changes residency of our own live mapping; it does not touch its
        // contents as Rust sees them.
        unsafe { rustix::mm::mlock(self.ptr.as_ptr().cast::<c_void>(), self.len()) }?;
        Ok(())
    }
}

#[cfg(not(miri))]
impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len describe a mapping this value created and still owns; no borrow of
        // `self` outlives this call, so nothing can touch the range afterwards. An error here
        // (impossible for a range we mapped) is ignored: Drop must not panic.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast::<c_void>(), self.reserved) };
    }
}

/// Miri cannot map files. Under `cfg(miri)` a mapping is a zeroed, page-aligned heap allocation
/// of the same size (as vm-memory's `src/mmap/unix.rs` does), so the allocator core, the views
/// and the copy kernel run under Miri unchanged. It is not shared with the fd: a second mapping
/// of the same file sees other bytes, which nothing run under Miri relies on. A reservation is
/// allocated whole and made accessible prefix by prefix, as the real one is.
#[cfg(miri)]
mod miri_stand_in {
    use std::alloc::Layout;

    use super::*;

    const ALIGN: usize = 4096;
    /// The stand-in is real memory (and Miri keeps metadata per byte): larger mappings fail as
    /// an exhausted address space would (the pool then reserves less).
    const MAX: usize = 64 << 20;

    impl Mapping {
        fn heap(len: usize, mapped: usize, writable: bool) -> io::Result<Self> {
            if len == 0 {
                return Err(io::Error::from(io::ErrorKind::InvalidInput));
            }
            if len > MAX {
                return Err(io::Error::from(io::ErrorKind::OutOfMemory));
            }
            let layout =
                Layout::from_size_align(len, ALIGN).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
            // SAFETY: the layout has a non-zero size.
            let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
            let ptr = NonNull::new(ptr).ok_or_else(|| io::Error::from(io::ErrorKind::OutOfMemory))?;
            Ok(Self { ptr, reserved: len, mapped: AtomicUsize::new(mapped), writable })
        }

        pub(crate) fn map_shared(_fd: BorrowedFd<'_>, _offset: u64, len: usize, writable: bool) -> io::Result<Self> {
            Self::heap(len, len, writable)
        }

        pub(crate) fn reserve(len: usize) -> io::Result<Self> {
            Self::heap(len, 0, true)
        }

        pub(crate) fn map_fixed_shared(&self, _fd: BorrowedFd<'_>, offset: usize, len: usize) -> io::Result<()> {
            let in_range = offset.checked_add(len).is_some_and(|end| end <= self.reserved);
            if !in_range || len == 0 || offset != self.mapped.load(Ordering::Acquire) {
                return Err(io::Error::from(io::ErrorKind::InvalidInput));
            }
            self.mapped.store(offset + len, Ordering::Release);
            Ok(())
        }

        pub(crate) fn populate(&self) -> io::Result<()> {
            Ok(())
        }

        pub(crate) fn populate_range(&self, offset: usize, len: usize) -> crate::error::Result<()> {
            self.check(offset, len)
        }

        /// A punched range reads back as zeroes. A plain (non-atomic) bulk write, on purpose:
        /// the pool punches only pages no block uses, so if any thread could still touch them,
        /// Miri reports the race.
        pub(crate) fn punch_stand_in(&self, offset: usize, len: usize) -> crate::error::Result<()> {
            self.check(offset, len)?;
            self.check_writable()?;
            // SAFETY: in bounds of the live allocation (checked); the caller guarantees no one
            // else uses the range (the point of a punch).
            unsafe { self.ptr.as_ptr().add(offset).write_bytes(0, len) };
            Ok(())
        }

        pub(crate) fn lock(&self) -> io::Result<()> {
            Ok(())
        }
    }

    impl Drop for Mapping {
        fn drop(&mut self) {
            let layout = Layout::from_size_align(self.reserved, ALIGN).expect("checked when allocated");
            // SAFETY: allocated in `heap` with this layout, freed once, here.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}
