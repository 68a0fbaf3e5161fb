//! The shmem source and segment basics: these run for real on any Linux.
// The peer check reads a memmap2 mapping through a raw pointer.
#![allow(unsafe_code)]

mod common;

use std::os::fd::AsFd;

use common::pattern;
use dmabuf_rt::source::{MemorySource, ShmemSource, page_size};
use dmabuf_rt::{Access, Error, FdKind, Origin, SegmentKind};
use rustix::fs::SealFlags;

#[test]
fn shmem_segment_is_a_sealed_memfd_rounded_to_pages() {
    let _serial = common::serial();
    let src = ShmemSource::new();
    let seg = src.create_segment(page_size() * 3 + 1).unwrap();
    assert_eq!(seg.len(), page_size() * 4);
    assert_eq!(seg.fd_kind(), FdKind::Memfd);
    assert_eq!(seg.kind(), SegmentKind::Unified);
    assert_eq!(*seg.origin(), Origin::Memfd);
    assert!(!seg.is_dma_buf());
    let seals = rustix::fs::fcntl_get_seals(seg.as_fd()).unwrap();
    assert!(seals.contains(SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL), "{seals:?}");
    assert_eq!(rustix::fs::fstat(&seg).unwrap().st_size as usize, seg.len());
    // Pages are reserved at allocation: st_blocks covers the whole size before any touch.
    assert!(rustix::fs::fstat(&seg).unwrap().st_blocks as usize * 512 >= seg.len());
}

#[test]
fn shmem_write_is_seen_through_a_second_mapping_and_by_another_implementation() {
    let _serial = common::serial();
    let seg = ShmemSource::new().create_segment(1 << 20).unwrap();
    let data = pattern(seg.len(), 7);
    let cpu = seg.cpu_access(Access::Write).unwrap();
    cpu.write(0, &data).unwrap();
    cpu.end().unwrap();

    let second = seg.map().unwrap();
    let mut back = vec![0; seg.len()];
    second.read(0, &mut back).unwrap();
    assert_eq!(back, data);

    // memmap2 maps a dup of the fd: the same pages, seen by code that is not ours.
    let dup = std::fs::File::from(seg.try_clone_fd().unwrap());
    let peer = memmap2::MmapOptions::new().len(seg.len()).map_raw_read_only(&dup).unwrap();
    let mut via_peer = vec![0; seg.len()];
    // SAFETY: the range is inside the live peer mapping (its size is sealed); the buffer is ours.
    unsafe { std::ptr::copy_nonoverlapping(peer.as_ptr(), via_peer.as_mut_ptr(), seg.len()) };
    assert_eq!(via_peer, data);

    // And pread on the memfd agrees.
    let mut via_pread = vec![0; 4096];
    let n = rustix::io::pread(seg.memfd().unwrap(), &mut via_pread, 8192).unwrap();
    assert_eq!(n, 4096);
    assert_eq!(via_pread, data[8192..8192 + 4096]);
}

#[test]
fn shmem_fill_and_bounds() {
    let _serial = common::serial();
    let seg = ShmemSource::new().create_segment(8192).unwrap();
    let cpu = seg.cpu_access(Access::ReadWrite).unwrap();
    cpu.fill(100, 50, 0xab).unwrap();
    let mut b = [0u8; 52];
    cpu.read(99, &mut b).unwrap();
    assert_eq!(b[0], 0);
    assert!(b[1..51].iter().all(|&x| x == 0xab));
    assert_eq!(b[51], 0);
    assert!(matches!(cpu.write(8190, &[1, 2, 3]), Err(Error::OutOfBounds { offset: 8190, len: 3, size: 8192 })));
    assert!(matches!(cpu.read(usize::MAX, &mut [0u8; 2]), Err(Error::OutOfBounds { .. })));
    assert!(matches!(cpu.fill(0, 8193, 0), Err(Error::OutOfBounds { .. })));
    drop(cpu);
    let ro = seg.cpu_access(Access::Read).unwrap();
    assert!(matches!(ro.write(0, &[1]), Err(Error::Unsupported { .. })));
    let wo = seg.cpu_access(Access::Write).unwrap();
    assert!(matches!(wo.read(0, &mut [0u8; 1]), Err(Error::Unsupported { .. })));
}

#[test]
fn zero_length_is_refused() {
    let _serial = common::serial();
    let e = ShmemSource::new().create_segment(0).unwrap_err();
    assert!(matches!(e, Error::ZeroLength), "{e}");
}

#[test]
fn larger_than_the_machine_is_refused_before_the_kernel_is_asked() {
    let _serial = common::serial();
    let fds = common::open_fds();
    for len in [usize::MAX, usize::MAX - 4095, isize::MAX as usize, 1usize << 60] {
        let e = ShmemSource::new().create_segment(len).unwrap_err();
        match &e {
            Error::TooLarge { requested, limit, what, source_name } => {
                assert_eq!(*requested, len as u64);
                assert!(*limit > 0 && *limit < len as u64);
                assert_eq!(*what, "RAM + swap");
                assert_eq!(source_name, "shmem");
            }
            other => panic!("expected TooLarge, got {other}"),
        }
        assert!(e.to_string().contains("more than this machine has"), "{e}");
    }
    assert_eq!(common::open_fds(), fds, "a refused allocation must not leak fds");
}

#[test]
fn dropping_segments_closes_their_fds() {
    let _serial = common::serial();
    let before = common::open_fds();
    let segs: Vec<_> = (0..16).map(|_| ShmemSource::new().create_segment(4096).unwrap()).collect();
    assert_eq!(common::open_fds(), before + 16);
    drop(segs);
    assert_eq!(common::open_fds(), before);
}

#[test]
fn sync_file_calls_on_a_memfd_are_refused_clearly() {
    let _serial = common::serial();
    let seg = ShmemSource::new().create_segment(4096).unwrap();
    let e = seg.export_sync_file(Access::Read).unwrap_err();
    assert!(e.to_string().contains("not a dma-buf"), "{e}");
}
