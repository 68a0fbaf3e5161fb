//! Kernel uapi: the only place in the crate that issues an ioctl.
//!
//! Three layers, as in drm-rs: `#[repr(C)]` uapi structs (private to each file), thin typed
//! functions over [`BorrowedFd`](std::os::fd::BorrowedFd) that return `io::Result` and turn every
//! kernel-returned fd into an [`OwnedFd`](std::os::fd::OwnedFd) at the syscall, and the safe API
//! above this module (`segment`, `source`). Nothing outside `sys` builds an opcode.
//!
//! Where a maintained crate already covers a call on the same rustix 1.x, it is used:
//! `dma-heap` for `DMA_HEAP_IOCTL_ALLOC`, `drm-ffi` for the core DRM ioctls. The rest
//! (dma-buf sync and sync_file, udmabuf, vgem fences) are written here over `rustix::ioctl`.
#![allow(unsafe_code)]

pub mod dma_buf;
pub mod dma_heap;
pub mod drm;
pub mod huge_pages;
pub mod limits;
pub mod memfd;
pub mod sync_file;
pub mod udmabuf;

use std::ffi::c_void;
use std::marker::PhantomData;
use std::os::fd::{FromRawFd, OwnedFd};

use rustix::ioctl::{Ioctl, IoctlOutput, Opcode};

/// An ioctl that reads a `T` from userspace and returns a new fd as its return value
/// (`UDMABUF_CREATE` and friends). rustix's `Setter` discards the return value, hence this.
pub(crate) struct FdReturning<'a, const OPCODE: Opcode, T> {
    arg: *mut T,
    _borrow: PhantomData<&'a mut T>,
}

impl<'a, const OPCODE: Opcode, T> FdReturning<'a, OPCODE, T> {
    /// # Safety
    ///
    /// `OPCODE` must be an ioctl whose argument is a `T` (or, for variable-length ioctls, a
    /// buffer that starts with a `T` and is as long as the kernel will read) and which, on
    /// success, returns a new file descriptor owned by the caller.
    pub(crate) unsafe fn new(arg: &'a mut T) -> Self {
        Self { arg, _borrow: PhantomData }
    }

    /// # Safety
    ///
    /// As [`FdReturning::new`]; additionally `arg` must stay valid for as many bytes as the
    /// kernel reads for `OPCODE`, for the lifetime `'a`.
    pub(crate) unsafe fn from_raw(arg: *mut T) -> Self {
        Self { arg, _borrow: PhantomData }
    }
}

// SAFETY: `opcode` and `as_ptr` describe the argument faithfully (the constructor's contract
// ties OPCODE to T), the kernel may write through the pointer (IS_MUTATING), and the output is a
// new fd by the same contract.
unsafe impl<const OPCODE: Opcode, T> Ioctl for FdReturning<'_, OPCODE, T> {
    type Output = OwnedFd;
    const IS_MUTATING: bool = true;

    fn opcode(&self) -> Opcode {
        OPCODE
    }

    fn as_ptr(&mut self) -> *mut c_void {
        self.arg.cast()
    }

    unsafe fn output_from_ptr(out: IoctlOutput, _: *mut c_void) -> rustix::io::Result<OwnedFd> {
        // SAFETY: the ioctl succeeded (rustix only calls this then) and by the constructor's
        // contract its return value is a new fd that nobody else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(out) })
    }
}

/// Turns a kernel-filled fd field into an `OwnedFd`.
///
/// # Safety
///
/// `raw` must be a file descriptor the kernel has just installed for this process and that
/// nothing else owns.
pub(crate) unsafe fn owned_fd(raw: i32) -> OwnedFd {
    // SAFETY: the caller's contract.
    unsafe { OwnedFd::from_raw_fd(raw) }
}
