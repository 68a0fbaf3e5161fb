//! DRM GEM objects: dumb buffers created on a DRM node, exported by PRIME as dma-bufs.
//!
//! GEM handles are per DRM fd and not reference counted per import: importing, on the same
//! fd, a dma-buf that came from that fd returns the handle that already exists. So every handle
//! this source hands out is counted here, and `DRM_IOCTL_GEM_CLOSE` is issued when the last
//! user (segment or import) drops it.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use super::{MemorySource, alloc_error, checked_len};
use crate::discovery;
use crate::error::{Error, Result};
use crate::mapping::Mapping;
use crate::node::open_node;
use crate::segment::{Backing, FdKind, KeepAlive, Origin, Segment, SegmentKind};
use crate::sys;

/// Dumb buffers are `width * bpp/8` bytes a row; this makes one row exactly 4 KiB.
const ROW_WIDTH: u32 = 1024;
const ROW_BPP: u32 = 32;
const ROW_BYTES: u64 = (ROW_WIDTH * ROW_BPP / 8) as u64;

/// An open DRM node: its fd, and the GEM handles live on it (handles are numbers per fd).
#[derive(Debug)]
struct DrmDevice {
    fd: OwnedFd,
    /// Live handles, each shared by every holder of it.
    handles: Mutex<HashMap<u32, Weak<GemHandle>>>,
}

/// A GEM handle on a DRM fd; `DRM_IOCTL_GEM_CLOSE` runs when the last holder drops it.
#[derive(Debug)]
pub struct GemHandle {
    dev: Arc<DrmDevice>,
    handle: u32,
}

impl GemHandle {
    /// The handle's number on its DRM fd.
    pub fn handle(&self) -> u32 {
        self.handle
    }
}

/// A segment exported from a GEM object holds its handle, so the handle stays open as long as
/// the dma-buf mapping and fd the segment owns.
impl KeepAlive for GemHandle {
    fn handle(&self) -> Option<u32> {
        Some(self.handle)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for GemHandle {
    fn drop(&mut self) {
        let mut handles = self.dev.handles.lock().unwrap_or_else(|p| p.into_inner());
        // A newer holder may have re-registered the number between our refcount reaching zero
        // and this lock; only close the handle if the entry is still ours (dead).
        if handles.get(&self.handle).is_some_and(|w| w.strong_count() == 0) {
            handles.remove(&self.handle);
            // Drop cannot report; a failure here means the fd is already gone.
            let _ = sys::drm::gem_close(self.dev.fd.as_fd(), self.handle);
        }
    }
}

impl DrmDevice {
    /// Returns the live holder of `handle`, or registers a new one.
    fn hold(self: &Arc<Self>, handle: u32) -> Arc<GemHandle> {
        let mut handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
        Self::hold_locked(self, &mut handles, handle)
    }

    /// Imports a dma-buf under the handle lock, so that a concurrent last drop cannot close the
    /// handle between the kernel returning it and this holder registering it.
    fn import(self: &Arc<Self>, dmabuf: BorrowedFd<'_>) -> std::io::Result<Arc<GemHandle>> {
        let mut handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
        let handle = sys::drm::prime_fd_to_handle(self.fd.as_fd(), dmabuf)?;
        Ok(Self::hold_locked(self, &mut handles, handle))
    }

    fn hold_locked(self: &Arc<Self>, handles: &mut HashMap<u32, Weak<GemHandle>>, handle: u32) -> Arc<GemHandle> {
        if let Some(h) = handles.get(&handle).and_then(Weak::upgrade) {
            return h;
        }
        let h = Arc::new(GemHandle { dev: Arc::clone(self), handle });
        handles.insert(handle, Arc::downgrade(&h));
        h
    }
}

/// A DRM node that creates GEM dumb buffers (primary `card` nodes; render nodes do not allow
/// dumb buffers) and exports them as dma-bufs.
#[derive(Debug)]
pub struct GemSource {
    dev: Arc<DrmDevice>,
    node: PathBuf,
    driver: String,
}

/// A dma-buf imported into a GEM source's DRM fd (`DRM_IOCTL_PRIME_FD_TO_HANDLE`).
#[derive(Debug, Clone)]
pub struct GemImport {
    handle: Arc<GemHandle>,
}

impl GemImport {
    /// The GEM handle on the importing fd.
    pub fn handle(&self) -> u32 {
        self.handle.handle
    }
}

impl GemSource {
    /// Opens a DRM node (e.g. `/dev/dri/card0`).
    pub fn open(node: &Path) -> Result<Self> {
        let file = open_node(node, "a DRM driver (e.g. vgem: modprobe vgem)")?;
        let fd: OwnedFd = file.into();
        let driver = sys::drm::driver_name(fd.as_fd()).map_err(|e| Error::Open {
            path: node.to_path_buf(),
            why: "not a DRM node (DRM_IOCTL_VERSION failed)".into(),
            source: e,
        })?;
        let dev = Arc::new(DrmDevice { fd, handles: Mutex::new(HashMap::new()) });
        Ok(Self { dev, node: node.to_path_buf(), driver })
    }

    /// Opens the first primary DRM node (`/dev/dri/card*`) this process can open, preferring
    /// `driver` when given.
    pub fn open_first(driver: Option<&str>) -> Result<Self> {
        let nodes = discovery::discover().drm;
        let mut last = None;
        for n in nodes.iter().filter(|n| n.kind == discovery::DrmNodeKind::Card) {
            if driver.is_some_and(|d| n.driver.as_deref() != Some(d)) {
                continue;
            }
            match Self::open(&n.node.path) {
                Ok(s) => return Ok(s),
                Err(e) => {
                    log::debug!("GEM source: skipping {}: {e}", n.node.path.display());
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or(Error::NoDevice {
            path: PathBuf::from(discovery::DRI_DIR).join("card*"),
            hint: "no DRM card node with that driver (load a DRM driver, e.g. modprobe vgem)",
        }))
    }

    /// The node's driver (`vgem`, `i915`, ...).
    pub fn driver(&self) -> &str {
        &self.driver
    }

    /// The node's path.
    pub fn node(&self) -> &Path {
        &self.node
    }

    /// Imports a dma-buf into this DRM fd. Importing a buffer this fd exported yields the
    /// exporting handle, shared, not a second one.
    pub fn import(&self, dmabuf: &impl AsFd) -> Result<GemImport> {
        let handle = self.dev.import(dmabuf.as_fd()).map_err(Error::io("DRM_IOCTL_PRIME_FD_TO_HANDLE"))?;
        Ok(GemImport { handle })
    }

    /// Maps a GEM segment of this source through the DRM node (`DRM_IOCTL_MODE_MAP_DUMB` and
    /// mmap of the DRM fd), a second path to the same pages as the dma-buf mapping.
    pub fn map_dumb(&self, seg: &Segment) -> Result<Mapping> {
        let handle = self.own_handle(seg)?;
        let offset =
            sys::drm::dumb_map_offset(self.dev.fd.as_fd(), handle).map_err(Error::io("DRM_IOCTL_MODE_MAP_DUMB"))?;
        Mapping::map_shared(self.dev.fd.as_fd(), offset, seg.len(), true).map_err(Error::io("mmap DRM node"))
    }

    /// vgem only: attaches an unsignalled fence to a GEM segment of this source, as its
    /// exclusive writer (`exclusive`) or as a reader. Until [`VgemFence::signal`] (or the
    /// fence's drop, or vgem's own 10 s timeout), CPU access and sync_file exports wait for it.
    /// This is how tests stand in for real device work.
    pub fn vgem_attach_fence(&self, seg: &Segment, exclusive: bool) -> Result<VgemFence> {
        if self.driver != "vgem" {
            return Err(Error::Unsupported {
                what: format!("fences can be attached on vgem only, not {}", self.driver),
            });
        }
        let handle = self.own_handle(seg)?;
        let flags = if exclusive { sys::drm::VGEM_FENCE_WRITE } else { 0 };
        let id = sys::drm::vgem_fence_attach(self.dev.fd.as_fd(), handle, flags)
            .map_err(Error::io("DRM_IOCTL_VGEM_FENCE_ATTACH"))?;
        Ok(VgemFence { dev: Arc::clone(&self.dev), id: Some(id) })
    }

    /// The segment's GEM handle if it belongs to this source's DRM fd. Handles are per fd,
    /// so a segment from another source, even on the same node, is refused.
    fn own_handle(&self, seg: &Segment) -> Result<u32> {
        seg.keep_alive()
            .and_then(|k| k.as_any().downcast_ref::<GemHandle>())
            .filter(|h| Arc::ptr_eq(&h.dev, &self.dev))
            .map(|h| h.handle)
            .ok_or_else(|| Error::Unsupported { what: "segment is not a GEM object of this source's DRM fd".into() })
    }

    /// Diagnostic: whether `handle` is currently open on this source's DRM fd, asked of the
    /// kernel with `DRM_IOCTL_MODE_MAP_DUMB` (ENOENT means no such handle). Other answers, such
    /// as EINVAL for objects imported from another driver, are returned as errors rather than
    /// guessed at.
    pub fn handle_is_open(&self, handle: u32) -> Result<bool> {
        match sys::drm::dumb_map_offset(self.dev.fd.as_fd(), handle) {
            Ok(_) => Ok(true),
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::NOENT.raw_os_error()) => Ok(false),
            Err(e) => Err(Error::Io { op: "DRM_IOCTL_MODE_MAP_DUMB", source: e }),
        }
    }

    /// True for a render node (`renderD*`), where dumb buffers cannot be created; such a
    /// source can still import dma-bufs.
    pub fn is_render_node(&self) -> bool {
        self.node.file_name().is_some_and(|n| n.to_string_lossy().starts_with("renderD"))
    }
}

impl MemorySource for GemSource {
    fn name(&self) -> String {
        format!("gem:{} ({})", self.node.display(), self.driver)
    }

    fn kind(&self) -> SegmentKind {
        SegmentKind::Device
    }

    fn create_segment(&self, len: usize) -> Result<Segment> {
        let len = checked_len(len, || self.name())?;
        if self.is_render_node() {
            return Err(Error::Unsupported {
                what: format!(
                    "{}: render nodes cannot create dumb buffers (the kernel allows them on card nodes only); \
                     allocate on the card node, or use this source to import dma-bufs",
                    self.node.display()
                ),
            });
        }
        let rows = u32::try_from((len as u64).div_ceil(ROW_BYTES))
            .ok()
            .filter(|r| u64::from(*r) * ROW_BYTES <= u64::from(u32::MAX))
            .ok_or_else(|| Error::Unsupported {
                what: format!("{len} bytes: DRM dumb buffers are limited to 4 GiB by the kernel's 32-bit size math"),
            })?;
        let dumb = sys::drm::dumb_create(self.dev.fd.as_fd(), ROW_WIDTH, rows, ROW_BPP).map_err(alloc_error(
            len,
            self.name(),
            "DRM_IOCTL_MODE_CREATE_DUMB",
        ))?;
        // From here the handle closes itself if anything below fails.
        let handle = self.dev.hold(dumb.handle);
        let fd = sys::drm::prime_handle_to_fd(self.dev.fd.as_fd(), dumb.handle)
            .map_err(Error::io("DRM_IOCTL_PRIME_HANDLE_TO_FD"))?;
        // The driver's rounded size; below 4 GiB (checked above), so it fits.
        let size = usize::try_from(dumb.size).map_err(|_| Error::Unsupported { what: "dumb buffer size".into() })?;
        let origin = Origin::Gem { node: self.node.clone(), driver: self.driver.clone() };
        Segment::new(fd, size, FdKind::DmaBuf, SegmentKind::Device, origin, Backing::KeepAlive(handle), true)
    }
}

/// A vgem fence attached to a GEM object; signalled by [`VgemFence::signal`] or on drop.
#[derive(Debug)]
pub struct VgemFence {
    dev: Arc<DrmDevice>,
    id: Option<u32>,
}

impl VgemFence {
    /// Signals the fence now.
    pub fn signal(mut self) -> Result<()> {
        self.signal_now()
    }

    fn signal_now(&mut self) -> Result<()> {
        match self.id.take() {
            Some(id) => {
                sys::drm::vgem_fence_signal(self.dev.fd.as_fd(), id).map_err(Error::io("DRM_IOCTL_VGEM_FENCE_SIGNAL"))
            }
            None => Ok(()),
        }
    }
}

impl Drop for VgemFence {
    fn drop(&mut self) {
        // Never leave a fence pending for vgem's 10 s timeout; Drop cannot report failure.
        let _ = self.signal_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GEM source over an fd that is not a DRM node (a memfd): enough to check which
    /// segments it recognises as its own, without a DRM driver. Closing a handle on it fails
    /// (ENOTTY), which `GemHandle`'s drop ignores.
    fn fake_source() -> GemSource {
        let fd = sys::memfd::create_sealed("not-drm", 0).unwrap();
        let dev = Arc::new(DrmDevice { fd, handles: Mutex::new(HashMap::new()) });
        GemSource { dev, node: PathBuf::from("/dev/dri/card-test"), driver: "test".into() }
    }

    fn segment_holding(handle: Arc<GemHandle>, origin: Origin) -> Segment {
        let len = crate::source::page_size();
        let fd = sys::memfd::create_sealed("gem-test", len as u64).unwrap();
        Segment::new(fd, len, FdKind::Memfd, SegmentKind::Device, origin, Backing::KeepAlive(handle), true).unwrap()
    }

    #[test]
    fn a_segment_is_recognised_by_the_source_holding_its_handle_only() {
        let (a, b) = (fake_source(), fake_source());
        let origin = Origin::Gem { node: a.node.clone(), driver: a.driver.clone() };
        let seg = segment_holding(a.dev.hold(7), origin);
        assert_eq!(seg.gem_handle(), Some(7));
        assert_eq!(a.own_handle(&seg).unwrap(), 7);
        // The same number on another DRM fd is another object.
        assert!(b.own_handle(&seg).is_err());
        // A segment of another source holds no GEM handle.
        let shmem = crate::source::ShmemSource::new().create_segment(1).unwrap();
        assert_eq!(shmem.gem_handle(), None);
        assert!(a.own_handle(&shmem).is_err());
    }

    #[test]
    fn a_handle_is_shared_while_held_and_forgotten_after() {
        let src = fake_source();
        let origin = Origin::Gem { node: src.node.clone(), driver: src.driver.clone() };
        let seg = segment_holding(src.dev.hold(3), origin);
        let import = GemImport { handle: src.dev.hold(3) };
        assert!(Arc::ptr_eq(&import.handle, &src.dev.hold(3)));
        drop(seg);
        assert_eq!(import.handle(), 3);
        drop(import);
        assert!(src.dev.handles.lock().unwrap().is_empty());
    }
}
