//! DRM uapi: driver version, dumb buffers, PRIME, GEM close (through `drm-ffi`), and vgem's
//! fence ioctls (`drm/vgem_drm.h`, written here over `rustix::ioctl`).

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::ioctl::{Opcode, Setter, Updater, ioctl, opcode};

const DRM_IOCTL_BASE: u8 = b'd';
const DRM_COMMAND_BASE: u8 = 0x40;
/// `DRM_CLOEXEC | DRM_RDWR` for PRIME export (they equal `O_CLOEXEC | O_RDWR`).
const PRIME_FLAGS: u32 = 0o2_000_000 | 0o2;

/// The driver's name (`DRM_IOCTL_VERSION`), e.g. `vgem`, `i915`, `amdgpu`.
pub fn driver_name(dev: BorrowedFd<'_>) -> io::Result<String> {
    let mut name: Vec<i8> = Vec::new();
    drm_ffi::get_version(dev, Some(&mut name), None, None)?;
    Ok(name.iter().map(|&c| c as u8 as char).collect())
}

/// What `DRM_IOCTL_MODE_CREATE_DUMB` returned.
#[derive(Debug, Clone, Copy)]
pub struct DumbBuffer {
    /// GEM handle, local to the DRM fd that created it.
    pub handle: u32,
    /// Size of the object, as the driver rounded it.
    pub size: u64,
}

/// `DRM_IOCTL_MODE_CREATE_DUMB` (allowed on primary `card` nodes, not on render nodes).
pub fn dumb_create(dev: BorrowedFd<'_>, width: u32, height: u32, bpp: u32) -> io::Result<DumbBuffer> {
    let r = drm_ffi::mode::dumbbuffer::create(dev, width, height, bpp, 0)?;
    Ok(DumbBuffer { handle: r.handle, size: r.size })
}

/// `DRM_IOCTL_MODE_MAP_DUMB`: the fake offset to pass to `mmap` on the DRM fd.
pub fn dumb_map_offset(dev: BorrowedFd<'_>, handle: u32) -> io::Result<u64> {
    Ok(drm_ffi::mode::dumbbuffer::map(dev, handle, 0, 0)?.offset)
}

/// `DRM_IOCTL_GEM_CLOSE`. This is also how dumb buffers are destroyed: the kernel implements
/// `DRM_IOCTL_MODE_DESTROY_DUMB` as the same handle deletion, and one call serves handles from
/// creation and from PRIME import alike.
pub fn gem_close(dev: BorrowedFd<'_>, handle: u32) -> io::Result<()> {
    drm_ffi::gem::close(dev, handle)?;
    Ok(())
}

/// `DRM_IOCTL_PRIME_HANDLE_TO_FD`: export a GEM object as a read-write, close-on-exec dma-buf.
pub fn prime_handle_to_fd(dev: BorrowedFd<'_>, handle: u32) -> io::Result<OwnedFd> {
    let r = drm_ffi::gem::handle_to_fd(dev, handle, PRIME_FLAGS)?;
    // SAFETY: on success the kernel installed a new dma-buf fd in `r.fd` for this process.
    Ok(unsafe { super::owned_fd(r.fd) })
}

/// `DRM_IOCTL_PRIME_FD_TO_HANDLE`: import a dma-buf as a GEM handle on `dev`. Importing the
/// same buffer twice on one fd returns the same handle (GEM handles are not reference counted
/// per import), which callers must account for before closing it.
pub fn prime_fd_to_handle(dev: BorrowedFd<'_>, dmabuf: BorrowedFd<'_>) -> io::Result<u32> {
    Ok(drm_ffi::gem::fd_to_handle(dev, dmabuf)?.handle)
}

/// `VGEM_FENCE_WRITE`: the fence is exclusive (a writer's).
pub const VGEM_FENCE_WRITE: u32 = 0x1;

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct VgemFenceAttach {
    pub(crate) handle: u32,
    pub(crate) flags: u32,
    pub(crate) out_fence: u32,
    pub(crate) pad: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct VgemFenceSignal {
    pub(crate) fence: u32,
    pub(crate) flags: u32,
}

pub(crate) const IOCTL_VGEM_FENCE_ATTACH: Opcode =
    opcode::read_write::<VgemFenceAttach>(DRM_IOCTL_BASE, DRM_COMMAND_BASE + 0x1);
pub(crate) const IOCTL_VGEM_FENCE_SIGNAL: Opcode =
    opcode::write::<VgemFenceSignal>(DRM_IOCTL_BASE, DRM_COMMAND_BASE + 0x2);

/// `DRM_IOCTL_VGEM_FENCE_ATTACH`: attach an unsignalled fence to a vgem object's reservation
/// (exclusive with `VGEM_FENCE_WRITE`); returns the fence id for [`vgem_fence_signal`]. vgem
/// signals it itself after 10 s if nobody does.
pub fn vgem_fence_attach(dev: BorrowedFd<'_>, handle: u32, flags: u32) -> io::Result<u32> {
    let mut arg = VgemFenceAttach { handle, flags, ..Default::default() };
    // SAFETY: the opcode takes a `struct drm_vgem_fence_attach`, mirrored above.
    let ctl = unsafe { Updater::<IOCTL_VGEM_FENCE_ATTACH, VgemFenceAttach>::new(&mut arg) };
    // SAFETY: opcode and argument agree; the fd is borrowed for the call.
    unsafe { ioctl(dev, ctl) }?;
    Ok(arg.out_fence)
}

/// `DRM_IOCTL_VGEM_FENCE_SIGNAL`: signal a fence made by [`vgem_fence_attach`].
pub fn vgem_fence_signal(dev: BorrowedFd<'_>, fence: u32) -> io::Result<()> {
    let arg = VgemFenceSignal { fence, flags: 0 };
    // SAFETY: the opcode takes a `struct drm_vgem_fence_signal`, mirrored above.
    let ctl = unsafe { Setter::<IOCTL_VGEM_FENCE_SIGNAL, VgemFenceSignal>::new(arg) };
    // SAFETY: opcode and argument agree; the fd is borrowed for the call.
    unsafe { ioctl(dev, ctl) }.map_err(io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn layouts_match_the_uapi() {
        assert_eq!(size_of::<VgemFenceAttach>(), 16);
        assert_eq!(offset_of!(VgemFenceAttach, out_fence), 8);
        assert_eq!(size_of::<VgemFenceSignal>(), 8);
    }

    #[test]
    fn opcodes_match_the_uapi() {
        // From drm/vgem_drm.h (DRM_IOWR/DRM_IOW over 'd', DRM_COMMAND_BASE 0x40) through the C
        // preprocessor.
        assert_eq!(IOCTL_VGEM_FENCE_ATTACH, 0xc010_6441);
        assert_eq!(IOCTL_VGEM_FENCE_SIGNAL, 0x4008_6442);
    }
}
