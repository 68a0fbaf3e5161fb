//! `linux/dma-buf.h`: CPU-access bracketing and implicit-fence export/import.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use rustix::ioctl::{Opcode, Setter, Updater, ioctl, opcode};

const DMA_BUF_BASE: u8 = b'b';

/// `DMA_BUF_SYNC_*` direction bits.
pub const SYNC_READ: u64 = 1 << 0;
/// Write direction.
pub const SYNC_WRITE: u64 = 1 << 1;
/// Read and write.
pub const SYNC_RW: u64 = SYNC_READ | SYNC_WRITE;
/// Begin CPU access.
pub const SYNC_START: u64 = 0 << 2;
/// End CPU access.
pub const SYNC_END: u64 = 1 << 2;

/// `DMA_BUF_FS_MAGIC` from `linux/magic.h`: `statfs(2).f_type` of every dma-buf.
pub const DMA_BUF_MAGIC: u64 = 0x444d_4142;

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct DmaBufSync {
    pub(crate) flags: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct DmaBufSyncFile {
    pub(crate) flags: u32,
    pub(crate) fd: i32,
}

pub(crate) const IOCTL_SYNC: Opcode = opcode::write::<DmaBufSync>(DMA_BUF_BASE, 0);
pub(crate) const IOCTL_EXPORT_SYNC_FILE: Opcode = opcode::read_write::<DmaBufSyncFile>(DMA_BUF_BASE, 2);
pub(crate) const IOCTL_IMPORT_SYNC_FILE: Opcode = opcode::write::<DmaBufSyncFile>(DMA_BUF_BASE, 3);

/// `DMA_BUF_IOCTL_SYNC`: begin (`SYNC_START | dir`) or end (`SYNC_END | dir`) CPU access.
pub fn sync(dmabuf: BorrowedFd<'_>, flags: u64) -> io::Result<()> {
    // The kernel may be interrupted while waiting on fences; the call is idempotent, retry it.
    loop {
        // SAFETY: IOCTL_SYNC takes a `struct dma_buf_sync` by pointer, which DmaBufSync mirrors.
        let arg = unsafe { Setter::<IOCTL_SYNC, DmaBufSync>::new(DmaBufSync { flags }) };
        // SAFETY: the opcode and argument agree (above); the fd is borrowed for the call.
        match unsafe { ioctl(dmabuf, arg) } {
            Err(rustix::io::Errno::INTR) | Err(rustix::io::Errno::AGAIN) => continue,
            other => return other.map_err(io::Error::from),
        }
    }
}

/// `DMA_BUF_IOCTL_EXPORT_SYNC_FILE`: a sync_file fd holding the buffer's current implicit
/// fences for `flags` (`SYNC_READ`: fences a reader must wait for; `SYNC_WRITE`: a writer).
pub fn export_sync_file(dmabuf: BorrowedFd<'_>, flags: u32) -> io::Result<OwnedFd> {
    let mut arg = DmaBufSyncFile { flags, fd: -1 };
    // SAFETY: the opcode takes a `struct dma_buf_export_sync_file`, mirrored by DmaBufSyncFile.
    let ctl = unsafe { Updater::<IOCTL_EXPORT_SYNC_FILE, DmaBufSyncFile>::new(&mut arg) };
    // SAFETY: opcode and argument agree; the fd is borrowed for the call.
    unsafe { ioctl(dmabuf, ctl) }?;
    // SAFETY: on success the kernel installed a new sync_file fd in `arg.fd` for us.
    Ok(unsafe { super::owned_fd(arg.fd) })
}

/// `DMA_BUF_IOCTL_IMPORT_SYNC_FILE`: add the fence in `sync_file` to the buffer's implicit
/// fences, as a writer (`SYNC_WRITE`) or a reader (`SYNC_READ`).
pub fn import_sync_file(dmabuf: BorrowedFd<'_>, flags: u32, sync_file: BorrowedFd<'_>) -> io::Result<()> {
    let arg = DmaBufSyncFile { flags, fd: sync_file.as_raw_fd() };
    // SAFETY: the opcode takes a `struct dma_buf_import_sync_file`, mirrored by DmaBufSyncFile.
    let ctl = unsafe { Setter::<IOCTL_IMPORT_SYNC_FILE, DmaBufSyncFile>::new(arg) };
    // SAFETY: opcode and argument agree; both fds are borrowed for the call.
    unsafe { ioctl(dmabuf, ctl) }.map_err(io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layouts_match_the_uapi() {
        assert_eq!(size_of::<DmaBufSync>(), 8);
        assert_eq!(size_of::<DmaBufSyncFile>(), 8);
        assert_eq!(offset_of!(DmaBufSyncFile, fd), 4);
    }

    #[test]
    fn opcodes_match_the_uapi() {
        // Values of the _IOW/_IOWR macros in linux/dma-buf.h, computed by the C preprocessor.
        assert_eq!(IOCTL_SYNC, 0x4008_6200);
        assert_eq!(IOCTL_EXPORT_SYNC_FILE, 0xc008_6202);
        assert_eq!(IOCTL_IMPORT_SYNC_FILE, 0x4008_6203);
    }
}
