//! memfd creation and `F_ADD_SEALS`/`F_GET_SEALS` (no ioctl, but the same thin-wrapper layer).

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};

pub use rustix::fs::SealFlags;
use rustix::fs::{MemfdFlags, memfd_create};

/// A close-on-exec memfd that allows sealing.
#[cfg_attr(miri, allow(dead_code, reason = "the Miri stand-in makes no memfds"))]
pub fn create(name: &str) -> io::Result<OwnedFd> {
    Ok(memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?)
}

/// `F_ADD_SEALS`.
#[cfg_attr(miri, allow(dead_code, reason = "the Miri stand-in makes no memfds"))]
pub fn add_seals(fd: BorrowedFd<'_>, seals: SealFlags) -> io::Result<()> {
    Ok(rustix::fs::fcntl_add_seals(fd, seals)?)
}

/// `F_GET_SEALS`; fails with `EINVAL` on files that are not shmem/hugetlbfs.
pub fn seals(fd: BorrowedFd<'_>) -> io::Result<SealFlags> {
    Ok(rustix::fs::fcntl_get_seals(fd)?)
}

/// A close-on-exec memfd of `len` bytes (sparse), its size sealed (`F_SEAL_SHRINK |
/// F_SEAL_GROW | F_SEAL_SEAL`) so no holder can truncate it under another's mapping.
#[cfg(not(miri))]
pub fn create_sealed(name: &str, len: u64) -> io::Result<OwnedFd> {
    let fd = create(name)?;
    rustix::fs::ftruncate(&fd, len)?;
    add_seals(std::os::fd::AsFd::as_fd(&fd), SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
    Ok(fd)
}

/// Miri has no memfds: under `cfg(miri)` a segment's fd is an eventfd, a file Miri can make,
/// and its bytes live in the mapping's stand-in (see `crate::mapping`).
#[cfg(miri)]
pub fn create_sealed(_name: &str, _len: u64) -> io::Result<OwnedFd> {
    Ok(rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)?)
}
