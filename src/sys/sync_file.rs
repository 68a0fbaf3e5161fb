//! `linux/sync_file.h`: the status of a sync_file's fence.

use std::io;
use std::os::fd::BorrowedFd;

use rustix::ioctl::{Opcode, Updater, ioctl, opcode};

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct SyncFileInfo {
    pub(crate) name: [u8; 32],
    pub(crate) status: i32,
    pub(crate) flags: u32,
    pub(crate) num_fences: u32,
    pub(crate) pad: u32,
    pub(crate) sync_fence_info: u64,
}

pub(crate) const IOCTL_FILE_INFO: Opcode = opcode::read_write::<SyncFileInfo>(b'>', 4);

/// `SYNC_IOC_FILE_INFO` without the per-fence array: 1 when signalled, 0 while active, a
/// negative errno when a fence signalled with an error. Fails with ENOTTY on fds that are not
/// sync_files.
pub fn status(sync_file: BorrowedFd<'_>) -> io::Result<i32> {
    let mut info = SyncFileInfo { name: [0; 32], status: 0, flags: 0, num_fences: 0, pad: 0, sync_fence_info: 0 };
    // SAFETY: the opcode takes a `struct sync_file_info`, mirrored above; with num_fences 0
    // the kernel writes no fence array.
    let ctl = unsafe { Updater::<IOCTL_FILE_INFO, SyncFileInfo>::new(&mut info) };
    // SAFETY: opcode and argument agree; the fd is borrowed for the call.
    unsafe { ioctl(sync_file, ctl) }?;
    Ok(info.status)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn layout_and_opcode_match_the_uapi() {
        // From linux/sync_file.h through the C preprocessor.
        assert_eq!(size_of::<SyncFileInfo>(), 56);
        assert_eq!(offset_of!(SyncFileInfo, status), 32);
        assert_eq!(IOCTL_FILE_INFO, 0xc038_3e04);
    }
}
