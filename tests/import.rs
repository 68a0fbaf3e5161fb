//! Importing fds received from elsewhere: sizes come from the fd, unsafe fds are refused.

mod common;

use std::os::fd::OwnedFd;

use dmabuf_rt::source::{MemorySource, ShmemSource};
use dmabuf_rt::{Access, Error, FdKind, Origin, Segment, SegmentKind};
use rustix::fs::{MemfdFlags, SealFlags};

fn memfd(len: u64, seals: SealFlags) -> OwnedFd {
    let fd = rustix::fs::memfd_create("peer", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    if !seals.is_empty() {
        rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
    }
    fd
}

#[test]
fn sealed_memfd_is_imported_with_the_size_the_fd_reports() {
    let _serial = common::serial();
    let fd = memfd(3 * 4096, SealFlags::SHRINK);
    rustix::io::pwrite(&fd, b"from a peer", 4096).unwrap();
    let seg = Segment::import(&fd, SegmentKind::Unified).unwrap();
    assert_eq!(seg.len(), 3 * 4096);
    assert_eq!(seg.fd_kind(), FdKind::Memfd);
    assert_eq!(*seg.origin(), Origin::Imported(FdKind::Memfd));
    let cpu = seg.cpu_access(Access::ReadWrite).unwrap();
    let mut b = [0u8; 11];
    cpu.read(4096, &mut b).unwrap();
    assert_eq!(&b, b"from a peer");
    cpu.write(0, b"reply").unwrap();
    let mut r = [0u8; 5];
    rustix::io::pread(seg.memfd().unwrap(), &mut r, 0).unwrap();
    assert_eq!(&r, b"reply");
}

#[test]
fn our_own_segments_round_trip_through_import() {
    let _serial = common::serial();
    let seg = ShmemSource::new().create_segment(1 << 16).unwrap();
    seg.cpu_access(Access::Write).unwrap().write(10, b"abc").unwrap();
    let peer = Segment::import(&seg, SegmentKind::Unified).unwrap();
    assert_eq!(peer.len(), seg.len());
    let mut b = [0u8; 3];
    peer.cpu_access(Access::Read).unwrap().read(10, &mut b).unwrap();
    assert_eq!(&b, b"abc");
}

#[test]
fn memfd_without_shrink_seal_is_refused() {
    let _serial = common::serial();
    for seals in [SealFlags::empty(), SealFlags::GROW, SealFlags::WRITE] {
        let e = Segment::import(&memfd(4096, seals), SegmentKind::Unified).unwrap_err();
        assert!(matches!(e, Error::BadImport { .. }), "{e}");
        assert!(e.to_string().contains("F_SEAL_SHRINK"), "{e}");
        assert!(e.to_string().contains("SIGBUS"), "{e}");
    }
}

#[test]
fn write_sealed_memfd_is_imported_read_only() {
    let _serial = common::serial();
    let fd = memfd(4096, SealFlags::SHRINK | SealFlags::WRITE);
    let seg = Segment::import(&fd, SegmentKind::Unified).unwrap();
    assert!(matches!(seg.cpu_access(Access::Write), Err(Error::ReadOnly)));
    let mut b = [1u8; 4];
    seg.cpu_access(Access::Read).unwrap().read(0, &mut b).unwrap();
    assert_eq!(b, [0; 4]);
}

#[test]
fn empty_memfd_is_refused() {
    let _serial = common::serial();
    let e = Segment::import(&memfd(0, SealFlags::SHRINK), SegmentKind::Unified).unwrap_err();
    assert!(matches!(e, Error::BadImport { .. }) && e.to_string().contains("empty"), "{e}");
}

#[test]
fn fds_that_are_neither_dma_buf_nor_memfd_are_refused() {
    let _serial = common::serial();
    let dir = common::TempDir::new("import");
    let path = dir.0.join("plain");
    std::fs::write(&path, vec![0u8; 8192]).unwrap();
    let file: OwnedFd = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap().into();
    let (pipe_r, _pipe_w) = rustix::pipe::pipe().unwrap();
    let null: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
    let before = common::open_fds();
    for (what, fd) in [("regular file", &file), ("pipe", &pipe_r), ("/dev/null", &null)] {
        let e = Segment::import(&fd, SegmentKind::Unified).unwrap_err();
        assert!(matches!(e, Error::BadImport { .. }), "{what}: {e}");
        assert!(e.to_string().contains("neither a dma-buf nor a sealable memfd"), "{what}: {e}");
    }
    // A refused fd stays the caller's: nothing was closed, nothing was leaked.
    assert_eq!(common::open_fds(), before);
    for fd in [&file, &pipe_r, &null, &_pipe_w] {
        rustix::io::fcntl_getfd(fd).expect("the caller's fd is still open");
    }
}
