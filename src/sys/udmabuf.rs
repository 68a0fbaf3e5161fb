//! `linux/udmabuf.h`: turn pages of a sealed memfd into a dma-buf.
//!
//! The kernel requires the memfd to carry `F_SEAL_SHRINK` and not `F_SEAL_WRITE`, offsets and
//! sizes to be page-aligned, and caps one buffer at the `size_limit_mb` module parameter
//! (64 MiB by default) and a list at `list_limit` items (1024 by default).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use rustix::ioctl::{Opcode, ioctl, opcode};

use super::FdReturning;

/// `UDMABUF_FLAGS_CLOEXEC`.
const FLAGS_CLOEXEC: u32 = 0x01;

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct UdmabufCreate {
    pub(crate) memfd: u32,
    pub(crate) flags: u32,
    pub(crate) offset: u64,
    pub(crate) size: u64,
}

/// One range of one memfd in a `UDMABUF_CREATE_LIST` request.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct UdmabufCreateItem {
    pub(crate) memfd: u32,
    pub(crate) pad: u32,
    pub(crate) offset: u64,
    pub(crate) size: u64,
}

/// Header of `struct udmabuf_create_list`; `count` items follow it in memory.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct UdmabufCreateList {
    pub(crate) flags: u32,
    pub(crate) count: u32,
}

pub(crate) const IOCTL_CREATE: Opcode = opcode::write::<UdmabufCreate>(b'u', 0x42);
pub(crate) const IOCTL_CREATE_LIST: Opcode = opcode::write::<UdmabufCreateList>(b'u', 0x43);

/// A range of a memfd to include in a udmabuf.
#[derive(Debug, Clone, Copy)]
pub struct Range<'fd> {
    /// The sealed memfd.
    pub memfd: BorrowedFd<'fd>,
    /// Page-aligned offset into it.
    pub offset: u64,
    /// Page-aligned length.
    pub size: u64,
}

/// `UDMABUF_CREATE`: a close-on-exec dma-buf over `size` bytes of `memfd` at `offset`.
pub fn create(dev: BorrowedFd<'_>, range: Range<'_>) -> io::Result<OwnedFd> {
    let mut arg =
        UdmabufCreate { memfd: fd_u32(range.memfd), flags: FLAGS_CLOEXEC, offset: range.offset, size: range.size };
    // SAFETY: UDMABUF_CREATE reads a `struct udmabuf_create` (mirrored above) and returns a new
    // dma-buf fd.
    let ctl = unsafe { FdReturning::<IOCTL_CREATE, UdmabufCreate>::new(&mut arg) };
    // SAFETY: opcode and argument agree; both fds are borrowed for the call.
    unsafe { ioctl(dev, ctl) }.map_err(io::Error::from)
}

/// `UDMABUF_CREATE_LIST`: one close-on-exec dma-buf over several memfd ranges, in order.
pub fn create_list(dev: BorrowedFd<'_>, ranges: &[Range<'_>]) -> io::Result<OwnedFd> {
    let count = u32::try_from(ranges.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // The request is a header followed by `count` items; build it in u64 storage so both are
    // 8-byte aligned as the C layout requires.
    const HDR: usize = size_of::<UdmabufCreateList>();
    const ITEM: usize = size_of::<UdmabufCreateItem>();
    let words = (HDR + ITEM * ranges.len()).div_ceil(8);
    let mut buf = vec![0u64; words];
    let base = buf.as_mut_ptr().cast::<u8>();
    let header = UdmabufCreateList { flags: FLAGS_CLOEXEC, count };
    // SAFETY: `buf` holds at least HDR bytes and is 8-byte aligned, like UdmabufCreateList.
    unsafe { base.cast::<UdmabufCreateList>().write(header) };
    for (i, r) in ranges.iter().enumerate() {
        let item = UdmabufCreateItem { memfd: fd_u32(r.memfd), pad: 0, offset: r.offset, size: r.size };
        let slot = base.wrapping_add(HDR + i * ITEM).cast::<UdmabufCreateItem>();
        // SAFETY: item i lies at HDR + i*ITEM < words*8 bytes, and HDR and ITEM are multiples of
        // 8, so the write is in bounds and aligned.
        unsafe { slot.write(item) };
    }
    // SAFETY: UDMABUF_CREATE_LIST reads the header and then `count` items, all of which `buf`
    // holds for the duration of the call; it returns a new dma-buf fd.
    let ctl = unsafe { FdReturning::<IOCTL_CREATE_LIST, UdmabufCreateList>::from_raw(base.cast()) };
    // SAFETY: opcode and argument agree; the fds are borrowed for the call.
    let fd = unsafe { ioctl(dev, ctl) }.map_err(io::Error::from);
    drop(buf);
    fd
}

fn fd_u32(fd: BorrowedFd<'_>) -> u32 {
    // A valid fd is never negative.
    fd.as_raw_fd() as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn layouts_match_the_uapi() {
        assert_eq!(size_of::<UdmabufCreate>(), 24);
        assert_eq!(offset_of!(UdmabufCreate, offset), 8);
        assert_eq!(offset_of!(UdmabufCreate, size), 16);
        assert_eq!(size_of::<UdmabufCreateItem>(), 24);
        assert_eq!(offset_of!(UdmabufCreateItem, offset), 8);
        assert_eq!(size_of::<UdmabufCreateList>(), 8);
    }

    #[test]
    fn opcodes_match_the_uapi() {
        // From linux/udmabuf.h through the C preprocessor.
        assert_eq!(IOCTL_CREATE, 0x4018_7542);
        assert_eq!(IOCTL_CREATE_LIST, 0x4008_7543);
    }
}
