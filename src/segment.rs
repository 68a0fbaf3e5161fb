//! [`Segment`]: one buffer of shareable memory, its fd, its mapping, and where it came from.

use std::any::Any;
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

use rustix::fs::{OFlags, SeekFrom};

use crate::error::{Error, Result};
use crate::mapping::Mapping;
use crate::sys;
use crate::sys::memfd::SealFlags;

/// What a segment's memory is for, from the runtime's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SegmentKind {
    /// Device memory: a dma-buf a device can import.
    Device,
    /// Pinned host memory: resident, never swapped, usable as a DMA staging buffer.
    PinnedHost,
    /// Unified memory: a shared mapping both the host and (through udmabuf) devices can use.
    Unified,
}

/// What kind of file a segment's fd is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FdKind {
    /// A dma-buf (`statfs` magic `DMA_BUF_MAGIC`).
    DmaBuf,
    /// A memfd with `F_SEAL_SHRINK`.
    Memfd,
}

/// Where a segment came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A memfd made by the shmem source.
    Memfd,
    /// A memfd made by the shmem source, exported as a dma-buf through `/dev/udmabuf`.
    Udmabuf,
    /// A memfd locked in RAM with `mlock` (the pinned-host fallback).
    MlockedMemfd,
    /// A DMA-BUF heap, by name (`system`, `linux,cma`, ...).
    DmaHeap {
        /// Heap name.
        heap: String,
    },
    /// A DRM GEM object exported by PRIME.
    Gem {
        /// The DRM node that created it.
        node: PathBuf,
        /// That node's driver.
        driver: String,
    },
    /// An fd received from elsewhere.
    Imported(FdKind),
}

/// Whatever else must stay alive as long as the segment's fd, dropped after the mapping.
#[derive(Debug)]
pub(crate) enum Backing {
    None,
    /// The memfd behind a udmabuf over it from its start, so that the segment's offsets are
    /// the memfd's (kept for pread/pwrite-style access: [`Segment::memfd`]).
    Memfd(OwnedFd),
    /// The memfds behind a udmabuf made of several ranges (or of one range not from the
    /// start): kept alive only, since offsets in the segment are not offsets in them.
    Memfds(Vec<OwnedFd>),
    /// An object of the source that made the segment (the GEM handle behind a PRIME export,
    /// closed when the last user drops it), opaque to the segment.
    KeepAlive(Arc<dyn KeepAlive>),
}

/// An object a source keeps alive as long as a segment it made: the segment holds it, reports
/// its handle number, and hands it back to the source that made it ([`Segment::keep_alive`]),
/// which alone knows its type.
pub(crate) trait KeepAlive: Any + Send + Sync + fmt::Debug {
    /// The object's number on the source's own fd (a GEM handle), if it has one.
    fn handle(&self) -> Option<u32>;

    /// Itself, for the source that made it to downcast.
    fn as_any(&self) -> &dyn Any;
}

/// A buffer of shareable memory: an fd (dma-buf or memfd), its length, a shared mapping, its
/// kind and its origin. CPU access to its bytes is a [`CpuView`](crate::view::CpuView)
/// ([`Segment::cpu_access`], defined with the view so that the segment does not depend on it). Dropping it unmaps, releases what its source keeps alive with it (a GEM
/// handle) and closes the fd, in that order.
pub struct Segment {
    // Field order is drop order: mapping, then backing objects, then the fd.
    mapping: Option<Mapping>,
    backing: Backing,
    fd: OwnedFd,
    len: usize,
    fd_kind: FdKind,
    kind: SegmentKind,
    origin: Origin,
    /// Whether the fd went out or the pages were stitched: [`FD_PLAIN`], [`FD_HANDED_OUT`] or
    /// [`FD_STITCHED`]; the two last exclude each other (an fd handed out names pages by their
    /// offsets, which stitching would move).
    fd_state: std::sync::atomic::AtomicU8,
    /// Unique among the segments this process ever made ([`Segment::serial`]).
    serial: u64,
    /// The files whose pages it shows ([`Segment::files`]), found on first use.
    files: std::sync::OnceLock<Vec<FileId>>,
}

/// A file by `(device, inode)`: two segments that name one show the same pages (two imports of
/// one fd, a block's fd imported back, a udmabuf and the memfd behind it).
pub(crate) type FileId = (u64, u64);

/// The next [`Segment::serial`].
static NEXT_SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn next_serial() -> u64 {
    NEXT_SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl fmt::Debug for Segment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Segment")
            .field("fd", &self.fd)
            .field("len", &self.len)
            .field("fd_kind", &self.fd_kind)
            .field("kind", &self.kind)
            .field("origin", &self.origin)
            .field("mapped_len", &self.mapped_len())
            .finish()
    }
}

impl Segment {
    pub(crate) fn new(
        fd: OwnedFd,
        len: usize,
        fd_kind: FdKind,
        kind: SegmentKind,
        origin: Origin,
        backing: Backing,
        writable: bool,
    ) -> Result<Self> {
        let mapping = Mapping::map_shared(fd.as_fd(), 0, len, writable).map_err(Error::io("mmap segment"))?;
        Ok(Self {
            mapping: Some(mapping),
            backing,
            fd,
            len,
            fd_kind,
            kind,
            origin,
            fd_state: Default::default(),
            serial: next_serial(),
            files: std::sync::OnceLock::new(),
        })
    }

    /// An expandable segment: a memfd of `len` bytes (sparse) behind a reservation of the same
    /// size; nothing is mapped until [`Segment::grow_to`].
    pub(crate) fn expandable(fd: OwnedFd, len: usize, kind: SegmentKind, origin: Origin) -> Result<Self> {
        let mapping = Mapping::reserve(len).map_err(Error::io("reserve address space"))?;
        Ok(Self {
            mapping: Some(mapping),
            backing: Backing::None,
            fd,
            len,
            fd_kind: FdKind::Memfd,
            kind,
            origin,
            fd_state: Default::default(),
            serial: next_serial(),
            files: std::sync::OnceLock::new(),
        })
    }

    /// A number no other segment of this process has had or will have: names the segment to
    /// a peer it is shared with ([`crate::ipc`]) across its whole life.
    pub fn serial(&self) -> u64 {
        self.serial
    }

    /// Maps `[from, to)` of an expandable segment's memfd into its reservation; `from` must be
    /// where the mapped part ends ([`Segment::mapped_len`], which then becomes `to`).
    pub(crate) fn grow_to(&self, from: usize, to: usize) -> Result<()> {
        let m = self.mapping.as_ref().ok_or_else(|| Error::Unsupported { what: "no reservation".into() })?;
        m.map_fixed_shared(self.fd.as_fd(), from, to - from).map_err(Error::io("mmap(MAP_FIXED) into reservation"))
    }

    /// Makes a view of the memfd at bytes `[at, at + len)` of the reservation: file range
    /// `[file_off, file_off + len)` (a page-stitched arena's view; the file range may show at
    /// other places too). From then on the segment's offsets are not fd offsets.
    #[cfg(not(miri))]
    pub(crate) fn map_view(&self, at: usize, file_off: usize, len: usize) -> Result<()> {
        let m = self.mapping.as_ref().ok_or_else(|| Error::Unsupported { what: "no reservation".into() })?;
        self.enter_fd_state(FD_STITCHED)?;
        m.map_at(self.fd.as_fd(), at, file_off as u64, len).map_err(Error::io("mmap(MAP_FIXED) of a stitched view"))
    }

    /// Gives bytes `[at, at + len)` of the reservation back to address space (a view let go).
    #[cfg(not(miri))]
    pub(crate) fn unmap_view(&self, at: usize, len: usize) -> Result<()> {
        let m = self.mapping.as_ref().ok_or_else(|| Error::Unsupported { what: "no reservation".into() })?;
        m.unmap_at(at, len).map_err(Error::io("mmap(PROT_NONE) over a stitched view"))
    }

    /// Under Miri there are no aliasing mappings: the pool makes no arena there.
    #[cfg(miri)]
    pub(crate) fn map_view(&self, _at: usize, _file_off: usize, _len: usize) -> Result<()> {
        Err(Error::Unsupported { what: "stitched views under Miri".into() })
    }

    /// As above.
    #[cfg(miri)]
    pub(crate) fn unmap_view(&self, _at: usize, _len: usize) -> Result<()> {
        Err(Error::Unsupported { what: "stitched views under Miri".into() })
    }

    /// Marks the segment stitched before anything is mapped (an arena's views never show the
    /// fd in order): its fd is never handed out.
    pub(crate) fn start_stitched(&self) -> Result<()> {
        self.enter_fd_state(FD_STITCHED)
    }

    /// Whether pages of this (expandable) segment were stitched: its mapping no longer shows
    /// its fd in order, so an offset in the mapping is not an offset in the fd, and the fd is
    /// not handed out ([`Segment::try_clone_fd`], [`Segment::memfd`] and [`Segment::map`]
    /// refuse or decline).
    pub fn is_stitched(&self) -> bool {
        self.fd_state.load(std::sync::atomic::Ordering::Acquire) == FD_STITCHED
    }

    /// The files whose pages the segment shows: its fd's and those of the memfds behind it
    /// (a udmabuf's), as `(device, inode)`; found with `fstat` on first use (a file that cannot
    /// be looked at is left out).
    pub(crate) fn files(&self) -> &[FileId] {
        self.files.get_or_init(|| {
            let id = |fd: BorrowedFd<'_>| rustix::fs::fstat(fd).ok().map(|st| (st.st_dev, st.st_ino));
            let mut files: Vec<FileId> = id(self.fd.as_fd()).into_iter().collect();
            match &self.backing {
                Backing::Memfd(m) => files.extend(id(m.as_fd())),
                Backing::Memfds(ms) => files.extend(ms.iter().filter_map(|m| id(m.as_fd()))),
                Backing::None | Backing::KeepAlive(_) => {}
            }
            files
        })
    }

    /// Whether an offset in the segment is the same offset in each of [`Segment::files`]: not
    /// for a page-stitched arena (its views show units out of order) nor a udmabuf made of
    /// ranges of memfds.
    pub(crate) fn files_in_order(&self) -> bool {
        !self.is_stitched() && !matches!(self.backing, Backing::Memfds(_))
    }

    /// Moves the fd state from [`FD_PLAIN`] to `to` (or finds it there already); refuses if it
    /// is in the other one: an fd handed out forbids stitching, and stitching forbids handing
    /// out the fd.
    fn enter_fd_state(&self, to: u8) -> Result<()> {
        use std::sync::atomic::Ordering;
        match self.fd_state.compare_exchange(FD_PLAIN, to, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => Ok(()),
            Err(now) if now == to => Ok(()),
            Err(_) if to == FD_STITCHED => Err(Error::Unsupported {
                what: "the segment's fd was handed out (its pages are named by their offsets): its pages are not \
                       stitched"
                    .into(),
            }),
            Err(_) => Err(Error::Unsupported {
                what: "the segment's pages were stitched (page-stitched expandable segment): its mapping no longer \
                       shows its fd in order, so offsets in it are not offsets in the fd; share the bytes through a \
                       segment that is not expandable (DMABUF_RT_ALLOC_CONF=expandable_segments:False)"
                    .into(),
            }),
        }
    }

    /// Returns the pages of `[offset, offset + len)` of an expandable segment to the kernel
    /// (`fallocate(PUNCH_HOLE)`): the range stays mapped and reads back as zeroes.
    #[cfg(not(miri))]
    pub(crate) fn punch(&self, offset: usize, len: usize) -> Result<()> {
        use rustix::fs::FallocateFlags;
        rustix::fs::fallocate(
            &self.fd,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            offset as u64,
            len as u64,
        )
        .map_err(Error::io_rustix("fallocate(PUNCH_HOLE)"))
    }

    /// Under Miri (no fallocate; the mapping is a heap stand-in): the range reads back as
    /// zeroes, as after a real punch (see `Mapping::punch_stand_in`).
    #[cfg(miri)]
    pub(crate) fn punch(&self, offset: usize, len: usize) -> Result<()> {
        let m = self.mapping.as_ref().ok_or_else(|| Error::Unsupported { what: "no reservation".into() })?;
        m.punch_stand_in(offset, len)
    }

    /// Imports a dma-buf or memfd received from elsewhere (another process, a driver). The
    /// fd is only borrowed: the segment keeps its own duplicate, so a refused fd stays the
    /// caller's to seal, resend or close. The length comes from the fd itself, never from the
    /// sender. A memfd must carry `F_SEAL_SHRINK` (otherwise its owner could truncate it under
    /// our mapping and kill us with SIGBUS); one sealed against writes, or opened read-only, is
    /// mapped read-only.
    pub fn import(fd: &impl AsFd, kind: SegmentKind) -> Result<Self> {
        let fd = fd.as_fd();
        let access = rustix::fs::fcntl_getfl(fd).map_err(Error::io_rustix("fcntl(F_GETFL) on imported fd"))?;
        let mut writable = (access & OFlags::RWMODE) == OFlags::RDWR;
        let statfs = rustix::fs::fstatfs(fd).map_err(Error::io_rustix("fstatfs on imported fd"))?;
        let fd_kind = if statfs.f_type as u64 == sys::dma_buf::DMA_BUF_MAGIC {
            FdKind::DmaBuf
        } else {
            match sys::memfd::seals(fd) {
                Ok(seals) if seals.contains(SealFlags::SEAL) && !seals.contains(SealFlags::SHRINK) => {
                    // Plain tmpfs/shmem files (and memfds made without MFD_ALLOW_SEALING) report
                    // F_SEAL_SEAL: they can never gain F_SEAL_SHRINK, so they can never be safe.
                    return Err(Error::BadImport {
                        reason: "fd is neither a dma-buf nor a sealable memfd (a shmem file whose seals are frozen \
                                 without F_SEAL_SHRINK: its owner could truncate it under our mapping and SIGBUS us)"
                            .into(),
                    });
                }
                Ok(seals) => {
                    if !seals.contains(SealFlags::SHRINK) {
                        return Err(Error::BadImport {
                            reason: "memfd lacks F_SEAL_SHRINK: its owner could truncate it under our mapping and \
                                     SIGBUS this process (seal it with fcntl(F_ADD_SEALS, F_SEAL_SHRINK) before sending)"
                                .into(),
                        });
                    }
                    if seals.intersects(SealFlags::WRITE | SealFlags::FUTURE_WRITE) {
                        writable = false;
                    }
                    FdKind::Memfd
                }
                Err(_) => {
                    return Err(Error::BadImport {
                        reason: format!(
                            "fd is neither a dma-buf nor a sealable memfd (filesystem magic {:#x})",
                            statfs.f_type
                        ),
                    });
                }
            }
        };
        let size = match fd_kind {
            // A dma-buf's size is what SEEK_END reports. dma-bufs only support SEEK_END and
            // SEEK_SET to 0, so their offset is always 0 and resetting it changes nothing for
            // the caller sharing this file description.
            FdKind::DmaBuf => {
                let end =
                    rustix::fs::seek(fd, SeekFrom::End(0)).map_err(Error::io_rustix("lseek on imported dma-buf"))?;
                rustix::fs::seek(fd, SeekFrom::Start(0)).map_err(Error::io_rustix("lseek on imported dma-buf"))?;
                end
            }
            FdKind::Memfd => rustix::fs::fstat(fd).map_err(Error::io_rustix("fstat on imported memfd"))?.st_size as u64,
        };
        if size == 0 {
            return Err(Error::BadImport { reason: "the buffer is empty (size 0)".into() });
        }
        let len = usize::try_from(size)
            .map_err(|_| Error::BadImport { reason: format!("size {size} does not fit in memory") })?;
        let own = fd.try_clone_to_owned().map_err(Error::io("dup imported fd"))?;
        Self::new(own, len, fd_kind, kind, Origin::Imported(fd_kind), Backing::None, writable)
    }

    /// Length in bytes: what the allocation was rounded to (whole pages), or for an import
    /// the size the fd reports. For an expandable segment, the part mapped so far (what CPU
    /// views and queue ranges can reach, as [`Segment::mapped_len`]), not its reservation.
    pub fn len(&self) -> usize {
        match &self.mapping {
            // An expandable segment: what is mapped so far, not the reservation.
            Some(m) if m.reserved_len() > m.len() => m.len(),
            _ => self.len,
        }
    }

    /// Bytes the CPU (and queue ranges) can reach: [`Segment::len`], except for an expandable
    /// segment, whose mapped prefix grows as the caching allocator needs it.
    pub fn mapped_len(&self) -> usize {
        self.mapping.as_ref().map_or(0, Mapping::len)
    }

    /// Always false: segments are never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What the memory is for.
    pub fn kind(&self) -> SegmentKind {
        self.kind
    }

    /// Where it came from.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// Whether CPU writes are possible (false for imports sealed against writes or opened
    /// read-only).
    #[inline]
    pub fn is_writable(&self) -> bool {
        self.mapping.as_ref().is_some_and(Mapping::is_writable)
    }

    /// Whether the fd is a dma-buf or a memfd.
    pub fn fd_kind(&self) -> FdKind {
        self.fd_kind
    }

    /// True when the fd is a dma-buf any DMA-BUF importer can take.
    #[inline]
    pub fn is_dma_buf(&self) -> bool {
        self.fd_kind == FdKind::DmaBuf
    }

    /// A memfd holding the same pages, if there is one (shmem segments, exported or not):
    /// usable with `pread`/`pwrite` and io_uring READ/WRITE.
    pub fn memfd(&self) -> Option<BorrowedFd<'_>> {
        if self.is_stitched() {
            // Offsets in the mapping are not offsets in the fd.
            return None;
        }
        match (&self.backing, self.fd_kind) {
            (Backing::Memfd(m), _) => Some(m.as_fd()),
            (_, FdKind::Memfd) => Some(self.fd.as_fd()),
            _ => None,
        }
    }

    /// The memfd holding the pages whatever the fd state: for a page-stitched arena, whose
    /// units keep their memfd offsets while its mapping does not show them in order (the
    /// caller names ranges of the memfd, as the arena knows them).
    pub(crate) fn memfd_of_units(&self) -> Option<BorrowedFd<'_>> {
        match (&self.backing, self.fd_kind) {
            (Backing::Memfd(m), _) => Some(m.as_fd()),
            (_, FdKind::Memfd) => Some(self.fd.as_fd()),
            _ => None,
        }
    }

    /// The GEM handle on the creating DRM fd, for GEM segments.
    pub fn gem_handle(&self) -> Option<u32> {
        match (&self.backing, &self.origin) {
            (Backing::KeepAlive(k), Origin::Gem { .. }) => k.handle(),
            _ => None,
        }
    }

    /// What the source that made the segment keeps alive with it, if anything.
    pub(crate) fn keep_alive(&self) -> Option<&dyn KeepAlive> {
        match &self.backing {
            Backing::KeepAlive(k) => Some(k.as_ref()),
            _ => None,
        }
    }

    /// Before the fd (or a mapping of it) goes out: refused for a stitched segment, and from
    /// then on the segment is never stitched.
    fn refuse_if_stitched(&self) -> Result<()> {
        self.enter_fd_state(FD_HANDED_OUT)
    }

    /// A new fd for the same buffer (`dup`), to send to another process or driver. Refused for
    /// a stitched segment ([`Segment::is_stitched`]).
    pub fn try_clone_fd(&self) -> Result<OwnedFd> {
        self.refuse_if_stitched()?;
        self.fd.try_clone().map_err(Error::io("dup segment fd"))
    }

    /// A new fd for the same buffer whatever its state: for a page-stitched arena, whose units
    /// keep their fd offsets (its views are not fd offsets, so [`Segment::try_clone_fd`]
    /// refuses); the caller names the range.
    pub(crate) fn dup_fd(&self) -> Result<OwnedFd> {
        self.fd.try_clone().map_err(Error::io("dup segment fd"))
    }

    /// A second, independent mapping of the same buffer. It follows the same access rules and
    /// unmaps itself on drop; CPU access to a dma-buf still belongs inside a
    /// [`CpuView`](crate::view::CpuView)'s bracket ([`Segment::cpu_access`]).
    pub fn map(&self) -> Result<Mapping> {
        self.refuse_if_stitched()?;
        Mapping::map_shared(self.fd.as_fd(), 0, self.len, self.is_writable()).map_err(Error::io("mmap segment"))
    }

    /// The segment's own mapping, for code that follows [`crate::mapping`]'s access rule.
    #[inline]
    pub fn mapping(&self) -> Option<&Mapping> {
        self.mapping.as_ref()
    }

    /// `DMA_BUF_IOCTL_EXPORT_SYNC_FILE`: a sync_file fd that signals when the fences a CPU
    /// access of this direction would wait for have signalled (for [`Access::Read`], pending
    /// writers; otherwise all pending users). Only dma-bufs carry fences.
    pub fn export_sync_file(&self, access: Access) -> Result<OwnedFd> {
        self.require_dma_buf("export a sync_file")?;
        sys::dma_buf::export_sync_file(self.fd.as_fd(), access.sync_flags() as u32)
            .map_err(Error::io("DMA_BUF_IOCTL_EXPORT_SYNC_FILE"))
    }

    /// `DMA_BUF_IOCTL_IMPORT_SYNC_FILE`: adds the fence in `sync_file` to this buffer's implicit
    /// fences, as a reader ([`Access::Read`]) or a writer (otherwise), so that other users of
    /// the buffer wait for it.
    pub fn import_sync_file(&self, access: Access, sync_file: &impl AsFd) -> Result<()> {
        self.require_dma_buf("import a sync_file")?;
        let flags = if access == Access::Read { sys::dma_buf::SYNC_READ } else { sys::dma_buf::SYNC_WRITE };
        sys::dma_buf::import_sync_file(self.fd.as_fd(), flags as u32, sync_file.as_fd())
            .map_err(Error::io("DMA_BUF_IOCTL_IMPORT_SYNC_FILE"))
    }

    fn require_dma_buf(&self, what: &str) -> Result<()> {
        if self.is_dma_buf() {
            Ok(())
        } else {
            Err(Error::Unsupported { what: format!("cannot {what}: the segment is a memfd, not a dma-buf") })
        }
    }
}

/// [`Segment`]'s fd state: nothing happened yet.
const FD_PLAIN: u8 = 0;
/// The fd (or a second mapping of it) went out: no stitching.
const FD_HANDED_OUT: u8 = 1;
/// Pages were stitched: the fd does not go out.
const FD_STITCHED: u8 = 2;

impl AsFd for Segment {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// The direction of a CPU access.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The CPU only reads.
    Read,
    /// The CPU only writes.
    Write,
    /// Both.
    ReadWrite,
}

impl Access {
    pub(crate) fn sync_flags(self) -> u64 {
        match self {
            Access::Read => sys::dma_buf::SYNC_READ,
            Access::Write => sys::dma_buf::SYNC_WRITE,
            Access::ReadWrite => sys::dma_buf::SYNC_RW,
        }
    }
}
