//! memfd creation and `F_ADD_SEALS`/`F_GET_SEALS` (no ioctl, but the same thin-wrapper layer).

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};

pub use rustix::fs::SealFlags;
use rustix::fs::{MemfdFlags, memfd_create};

/// A close-on-exec memfd that allows sealing.
pub fn create(name: &str) -> io::Result<OwnedFd> {
    Ok(memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?)
}

/// `F_ADD_SEALS`.
pub fn add_seals(fd: BorrowedFd<'_>, seals: SealFlags) -> io::Result<()> {
    Ok(rustix::fs::fcntl_add_seals(fd, seals)?)
}

/// `F_GET_SEALS`; fails with `EINVAL` on files that are not shmem/hugetlbfs.
pub fn seals(fd: BorrowedFd<'_>) -> io::Result<SealFlags> {
    Ok(rustix::fs::fcntl_get_seals(fd)?)
}
