//! Device-backed sources: DMA-BUF heaps, udmabuf, DRM GEM/PRIME, pinned host memory.
//!
//! On a machine without the device each test prints `SKIP <test>: <why>` and passes; the
//! kernel lane sets DMABUF_RT_REQUIRE_DEVICES=1, where a missing device fails the test.
//! Every test takes `common::serial()` because several count the process's open fds.
#![allow(unsafe_code)] // memmap2 peer mappings are read through raw pointers

mod common;

use std::os::fd::AsFd;
use std::path::Path;
use std::time::Duration;

use common::{or_skip, pattern};
use dmabuf_rt::discovery::{self, NodeAccess};
use dmabuf_rt::source::{GemSource, HeapSource, HostBacking, HostSource, MemorySource, ShmemSource, Udmabuf};
use dmabuf_rt::{Access, Error, FdKind, Origin, Segment, SegmentKind};

fn read_all(seg: &Segment) -> Vec<u8> {
    let mut v = vec![0; seg.len()];
    seg.cpu_access(Access::Read).unwrap().read(0, &mut v).unwrap();
    v
}

/// Reads `len` bytes of `fd` through a memmap2 mapping (code that is not ours).
fn read_via_memmap2(fd: std::os::fd::OwnedFd, len: usize) -> Vec<u8> {
    let file = std::fs::File::from(fd);
    let map = memmap2::MmapOptions::new().len(len).map_raw_read_only(&file).unwrap();
    let mut v = vec![0; len];
    // SAFETY: `len` bytes are mapped and stay mapped while `map` lives; `v` is ours.
    unsafe { std::ptr::copy_nonoverlapping(map.as_ptr(), v.as_mut_ptr(), len) };
    v
}

fn poll_ready(fd: &impl AsFd, timeout: Duration) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let mut fds = [PollFd::new(fd, PollFlags::IN)];
    let ts = Timespec { tv_sec: timeout.as_secs() as i64, tv_nsec: timeout.subsec_nanos() as i64 };
    poll(&mut fds, Some(&ts)).unwrap() == 1 && fds[0].revents().contains(PollFlags::IN)
}

#[test]
fn system_heap_segment_written_under_sync_and_read_through_a_second_mapping() {
    let _serial = common::serial();
    let Some(heap) = or_skip("system_heap", HeapSource::open("system")) else { return };
    let fds = common::open_fds();
    let seg = heap.create_segment(3 * 4096 + 100).unwrap();
    assert_eq!(seg.len(), 4 * 4096);
    assert!(seg.is_dma_buf());
    assert_eq!(seg.kind(), SegmentKind::Device);
    assert_eq!(*seg.origin(), Origin::DmaHeap { heap: "system".into() });
    assert_eq!(heap.name(), "dma-heap:system");

    let data = pattern(seg.len(), 3);
    let cpu = seg.cpu_access(Access::Write).unwrap();
    cpu.write(0, &data).unwrap();
    cpu.end().unwrap();

    // A second mapping of the same fd, made by us and by memmap2 on a dup.
    let second = seg.map().unwrap();
    let mut back = vec![0; seg.len()];
    {
        let _cpu = seg.cpu_access(Access::Read).unwrap();
        second.read(0, &mut back).unwrap();
    }
    assert_eq!(back, data);
    assert_eq!(read_via_memmap2(seg.try_clone_fd().unwrap(), seg.len()), data);

    // The fd imported as a peer would: size from the fd, same bytes.
    let peer = Segment::import(&seg, SegmentKind::Device).unwrap();
    assert_eq!(peer.fd_kind(), FdKind::DmaBuf);
    assert_eq!(peer.len(), seg.len());
    assert_eq!(read_all(&peer), data);

    // No fences on a fresh heap buffer: its sync_file is signalled already.
    let sf = seg.export_sync_file(Access::ReadWrite).unwrap();
    assert!(poll_ready(&sf, Duration::ZERO));

    // Bad lengths get clear errors and leave nothing open.
    assert!(matches!(heap.create_segment(0), Err(Error::ZeroLength)));
    assert!(matches!(heap.create_segment(usize::MAX), Err(Error::TooLarge { .. })));
    assert!(matches!(heap.create_segment(1 << 50), Err(Error::TooLarge { .. })));

    drop((second, peer, sf, seg));
    assert_eq!(common::open_fds(), fds, "heap segment fds leaked");
}

#[test]
fn heap_that_does_not_exist_is_named_with_the_ones_that_do() {
    let _serial = common::serial();
    // Real heaps when the kernel has them...
    if Path::new("/dev/dma_heap").exists() {
        let e = HeapSource::open("no-such-heap").unwrap_err();
        assert!(matches!(e, Error::NoSuchHeap { .. }), "{e}");
        assert!(e.to_string().contains("`no-such-heap`"), "{e}");
        if Path::new("/dev/dma_heap/system").exists() {
            assert!(e.to_string().contains("system"), "{e}");
        }
    } else {
        let e = HeapSource::open("system").unwrap_err();
        assert!(matches!(e, Error::NoDevice { .. }), "{e}");
        assert!(e.to_string().contains("CONFIG_DMABUF_HEAPS"), "{e}");
    }
    // ...and a heap directory we control, anywhere.
    let dir = common::TempDir::new("heaps");
    std::fs::write(dir.0.join("system"), b"").unwrap();
    std::fs::write(dir.0.join("linux,cma"), b"").unwrap();
    for bad in ["nope", "", "../system", "."] {
        let e = HeapSource::open_in(&dir.0, bad).unwrap_err();
        assert!(matches!(&e, Error::NoSuchHeap { available, .. } if available == "linux,cma, system"), "{bad}: {e}");
    }
}

#[test]
fn a_node_this_process_may_not_open_gets_a_reason() {
    let _serial = common::serial();
    use std::os::unix::fs::PermissionsExt;
    let dir = common::TempDir::new("perm");
    let node = dir.0.join("locked");
    std::fs::write(&node, b"").unwrap();
    // Root-owned 0600 when root (checked by an unprivileged thread); mode 000 otherwise.
    let mode = if rustix::process::geteuid().is_root() { 0o600 } else { 0o000 };
    std::fs::set_permissions(&node, std::fs::Permissions::from_mode(mode)).unwrap();
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (e, access) =
        common::unprivileged(|| (HeapSource::open_in(&dir.0, "locked").unwrap_err(), discovery::check_access(&node)));
    match &e {
        Error::Open { path, source, why } => {
            assert_eq!(path, &node);
            assert_eq!(source.kind(), std::io::ErrorKind::PermissionDenied);
            assert!(why.contains(&format!("mode {mode:04o}")), "{why}");
            assert!(why.contains("render"), "{why}");
        }
        other => panic!("expected Open, got {other}"),
    }
    assert!(
        matches!(access, NodeAccess::Denied(ref why) if why.contains("neither its owner nor in its group") || mode == 0),
        "{access:?}"
    );

    // The real device nodes, where the kernel has them (the kernel lane runs as root, and the
    // nodes are root-only there as devtmpfs makes them).
    let real: Vec<_> = ["/dev/dma_heap/system", "/dev/udmabuf", "/dev/dri/card0"]
        .iter()
        .map(Path::new)
        .filter(|p| p.exists())
        .collect();
    if or_skip("real_node_permissions", if real.is_empty() { Err("no device nodes on this machine") } else { Ok(()) })
        .is_none()
    {
        return;
    }
    if !rustix::process::geteuid().is_root() {
        return;
    }
    let results = common::unprivileged(|| {
        real.iter()
            .map(|p| {
                let st = std::fs::metadata(p).unwrap();
                use std::os::unix::fs::MetadataExt;
                let world = st.mode() & 0o006 == 0o006;
                let e = match p.to_str().unwrap() {
                    "/dev/dma_heap/system" => HeapSource::open("system").map(drop),
                    "/dev/udmabuf" => Udmabuf::open().map(drop),
                    _ => GemSource::open(p).map(drop),
                };
                (p.to_path_buf(), world, e)
            })
            .collect::<Vec<_>>()
    });
    for (p, world, r) in results {
        if world {
            continue; // a world-accessible node (not the default) cannot be refused
        }
        let e = r.expect_err("an unprivileged thread opened a root-only node");
        assert!(matches!(&e, Error::Open { path, .. } if *path == p), "{}: {e}", p.display());
    }
}

#[test]
fn shmem_exported_through_udmabuf_shows_the_same_bytes() {
    let _serial = common::serial();
    let fds = common::open_fds();
    let Some(udmabuf) = or_skip("udmabuf_export", Udmabuf::open()) else { return };
    let memfd_seg = ShmemSource::new().create_segment(1 << 20).unwrap();
    let data = pattern(memfd_seg.len(), 9);
    memfd_seg.cpu_access(Access::Write).unwrap().write(0, &data).unwrap();

    let dmabuf = udmabuf.export(&memfd_seg).unwrap();
    assert!(dmabuf.is_dma_buf());
    assert_eq!(*dmabuf.origin(), Origin::Udmabuf);
    assert_eq!(dmabuf.len(), memfd_seg.len());
    assert_eq!(read_all(&dmabuf), data, "dma-buf mapping differs from the memfd mapping");

    // Writes through the dma-buf land in the memfd's pages.
    dmabuf.cpu_access(Access::Write).unwrap().write(4096, b"through udmabuf").unwrap();
    let mut b = [0u8; 15];
    memfd_seg.cpu_access(Access::Read).unwrap().read(4096, &mut b).unwrap();
    assert_eq!(&b, b"through udmabuf");
    assert_eq!(read_via_memmap2(dmabuf.try_clone_fd().unwrap(), dmabuf.len())[4096..4096 + 15], *b"through udmabuf");

    // The dma-buf outlives the memfd segment it came from.
    drop(memfd_seg);
    let mut b2 = [0u8; 15];
    dmabuf.cpu_access(Access::Read).unwrap().read(4096, &mut b2).unwrap();
    assert_eq!(&b2, b"through udmabuf");

    // Pages a peer only fallocated: data written through the dma-buf must survive the memfd's
    // first fault (shmem zeroes never-faulted fallocated pages on first fault).
    let peer_fd = rustix::fs::memfd_create("peer", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&peer_fd, 8192).unwrap();
    rustix::fs::fallocate(&peer_fd, rustix::fs::FallocateFlags::empty(), 0, 8192).unwrap();
    rustix::fs::fcntl_add_seals(&peer_fd, rustix::fs::SealFlags::SHRINK).unwrap();
    let peer_memfd = Segment::import(&peer_fd, SegmentKind::Unified).unwrap();
    let peer_dmabuf = udmabuf.export(&peer_memfd).unwrap();
    peer_dmabuf.cpu_access(Access::Write).unwrap().write(0, b"device wrote").unwrap();
    let fresh_map = peer_memfd.map().unwrap();
    let mut seen = [0u8; 12];
    fresh_map.read(0, &mut seen).unwrap();
    assert_eq!(&seen, b"device wrote", "data written through udmabuf was lost on the memfd's fault");
    drop((fresh_map, peer_dmabuf, peer_memfd, peer_fd));

    // A source that exports every allocation.
    let src = ShmemSource::with_udmabuf().unwrap();
    let seg = src.create_segment(3 * 4096).unwrap();
    assert!(seg.is_dma_buf());
    assert!(seg.memfd().is_some());
    seg.cpu_access(Access::Write).unwrap().write(0, b"xyz").unwrap();
    let mut b3 = [0u8; 3];
    rustix::io::pread(seg.memfd().unwrap(), &mut b3, 0).unwrap();
    assert_eq!(&b3, b"xyz");

    drop((dmabuf, seg, src, udmabuf));
    assert_eq!(common::open_fds(), fds, "udmabuf fds leaked");
}

#[test]
fn udmabuf_list_concatenates_segments() {
    let _serial = common::serial();
    let Some(udmabuf) = or_skip("udmabuf_list", Udmabuf::open()) else { return };
    let shmem = ShmemSource::new();
    let a = shmem.create_segment(2 * 4096).unwrap();
    let b = shmem.create_segment(4096).unwrap();
    a.cpu_access(Access::Write).unwrap().fill(0, a.len(), 0xaa).unwrap();
    b.cpu_access(Access::Write).unwrap().fill(0, b.len(), 0xbb).unwrap();
    let joined = udmabuf.export_list(&[&a, &b]).unwrap();
    assert_eq!(joined.len(), 3 * 4096);
    let all = read_all(&joined);
    assert!(all[..8192].iter().all(|&x| x == 0xaa));
    assert!(all[8192..].iter().all(|&x| x == 0xbb));
    assert!(matches!(udmabuf.export_list(&[]), Err(Error::ZeroLength)));
}

#[test]
fn udmabuf_limit_is_named_in_the_error() {
    let _serial = common::serial();
    let Some(udmabuf) = or_skip("udmabuf_limit", Udmabuf::open()) else { return };
    let limit_mb = Udmabuf::size_limit_mb();
    let fds = common::open_fds();
    let big = ShmemSource::new().reserve(false).create_segment(((limit_mb + 1) << 20) as usize).unwrap();
    let e = udmabuf.export(&big).unwrap_err();
    match &e {
        Error::UdmabufLimit { requested, limit_mb: l } => {
            assert_eq!(*requested, big.len() as u64);
            assert_eq!(*l, limit_mb);
        }
        other => panic!("expected UdmabufLimit, got {other}"),
    }
    assert!(e.to_string().contains(&format!("{limit_mb} MiB")) && e.to_string().contains("size_limit_mb"), "{e}");
    // The source refuses before allocating anything.
    let src = ShmemSource::with_udmabuf().unwrap();
    assert!(matches!(src.create_segment(big.len()), Err(Error::UdmabufLimit { .. })));
    // Exactly at the limit still works.
    let at = src.create_segment((limit_mb << 20) as usize).unwrap();
    assert_eq!(at.len() as u64, limit_mb << 20);
    // The limit is read from the module parameter, not assumed: lower it where we may.
    let param = "/sys/module/udmabuf/parameters/size_limit_mb";
    if std::fs::write(param, b"2").is_ok() {
        let three = ShmemSource::new().create_segment(3 << 20).unwrap();
        let e = udmabuf.export(&three);
        std::fs::write(param, limit_mb.to_string()).unwrap();
        assert!(matches!(e, Err(Error::UdmabufLimit { limit_mb: 2, .. })), "{e:?}");
    }
    // What udmabuf cannot take is refused before the kernel is asked.
    let sealed = rustix::fs::memfd_create("sealed", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&sealed, 4096).unwrap();
    rustix::fs::fcntl_add_seals(&sealed, rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::WRITE).unwrap();
    let sealed = Segment::import(&{ sealed }, SegmentKind::Unified).unwrap();
    let e = udmabuf.export(&sealed);
    assert!(matches!(e, Err(Error::Unsupported { .. })), "{e:?}");
    let odd = rustix::fs::memfd_create("odd", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&odd, 5000).unwrap();
    rustix::fs::fcntl_add_seals(&odd, rustix::fs::SealFlags::SHRINK).unwrap();
    let odd = Segment::import(&{ odd }, SegmentKind::Unified).unwrap();
    let e = udmabuf.export(&odd).unwrap_err();
    assert!(e.to_string().contains("whole pages"), "{e}");
    let heap_seg = HeapSource::open("system").ok().map(|h| h.create_segment(4096).unwrap());
    if let Some(h) = &heap_seg {
        assert!(matches!(udmabuf.export(h), Err(Error::Unsupported { .. })));
    }
    drop((sealed, odd, heap_seg));
    drop((big, src, at));
    assert_eq!(common::open_fds(), fds, "fds leaked by refused or dropped udmabuf exports");
}

#[test]
fn vgem_gem_object_prime_export_map_write_reimport_and_close() {
    let _serial = common::serial();
    let fds = common::open_fds();
    let Some(gem) = or_skip("vgem_gem", GemSource::open_first(Some("vgem"))) else { return };
    assert_eq!(gem.driver(), "vgem");
    let seg = gem.create_segment(1 << 20).unwrap();
    assert!(seg.is_dma_buf());
    assert_eq!(seg.kind(), SegmentKind::Device);
    assert!(seg.len() >= 1 << 20);
    let handle = seg.gem_handle().unwrap();
    assert!(gem.handle_is_open(handle).unwrap());

    // Write through the PRIME dma-buf under the sync guard...
    let data = pattern(seg.len(), 5);
    let cpu = seg.cpu_access(Access::Write).unwrap();
    cpu.write(0, &data).unwrap();
    cpu.end().unwrap();
    // ...read it through the DRM node's own dumb mapping and through memmap2 on the dma-buf.
    let dumb = gem.map_dumb(&seg).unwrap();
    let mut back = vec![0; seg.len()];
    dumb.read(0, &mut back).unwrap();
    assert_eq!(back, data);
    assert_eq!(read_via_memmap2(seg.try_clone_fd().unwrap(), seg.len()), data);

    // Re-import on the same fd: the same handle, shared, not closed by the import's drop.
    let import = gem.import(&seg).unwrap();
    assert_eq!(import.handle(), handle);
    drop(import);
    assert!(gem.handle_is_open(handle).unwrap(), "dropping an import closed the exporter's handle");

    // Import on a second DRM fd: a handle of its own, same pages.
    let gem2 = GemSource::open(gem.node()).unwrap();
    let import2 = gem2.import(&seg).unwrap();
    assert!(gem2.handle_is_open(import2.handle()).unwrap());
    // The same fd received by "a peer" imports as a dma-buf of the same size.
    let peer = Segment::import(&seg, SegmentKind::Device).unwrap();
    assert_eq!(peer.len(), seg.len());
    assert_eq!(read_all(&peer)[..4096], data[..4096]);

    // Bad lengths: clear errors, no handle or fd left behind (checked by the count below).
    assert!(matches!(gem.create_segment(0), Err(Error::ZeroLength)));
    assert!(matches!(gem.create_segment(usize::MAX), Err(Error::TooLarge { .. })));
    // Not a GEM object of this source: refused, not mapped through some other handle.
    let shm = ShmemSource::new().create_segment(4096).unwrap();
    assert!(matches!(gem.map_dumb(&shm), Err(Error::Unsupported { .. })));
    assert!(matches!(gem2.map_dumb(&seg), Err(Error::Unsupported { .. })));
    drop(shm);

    // A render node imports but cannot create dumb buffers: it says so.
    let render = discovery::discover().drm.into_iter().find(|d| d.kind == discovery::DrmNodeKind::Render);
    if let Some(render) = or_skip("vgem_render_node", render.ok_or("no render node")) {
        let r = GemSource::open(&render.node.path).unwrap();
        assert!(r.is_render_node());
        let e = r.create_segment(4096).unwrap_err();
        assert!(matches!(e, Error::Unsupported { .. }) && e.to_string().contains("render nodes"), "{e}");
        let imported = r.import(&seg).unwrap();
        assert!(imported.handle() > 0);
    }

    let h2 = import2.handle();
    drop(import2);
    assert!(!gem2.handle_is_open(h2).unwrap());
    drop((dumb, peer, seg));
    assert!(!gem.handle_is_open(handle).unwrap(), "GEM handle still open after its last user dropped");
    drop((gem, gem2));
    assert_eq!(common::open_fds(), fds, "GEM source/segment fds leaked");
}

#[test]
fn vgem_fence_blocks_the_sync_file_until_signalled() {
    let _serial = common::serial();
    let Some(gem) = or_skip("vgem_fence", GemSource::open_first(Some("vgem"))) else { return };
    let seg = gem.create_segment(4096).unwrap();
    let fence = gem.vgem_attach_fence(&seg, true).unwrap();
    let sf = seg.export_sync_file(Access::Read).unwrap();
    assert!(!poll_ready(&sf, Duration::from_millis(50)), "sync_file ready before the fence signalled");
    fence.signal().unwrap();
    assert!(poll_ready(&sf, Duration::from_secs(5)), "sync_file not ready after the fence signalled");

    // A fence imported into another buffer makes that buffer wait too.
    let fence2 = gem.vgem_attach_fence(&seg, true).unwrap();
    let pending = seg.export_sync_file(Access::Read).unwrap();
    if let Some(heap) = or_skip("vgem_fence_into_heap_buffer", HeapSource::open("system")) {
        let other = heap.create_segment(4096).unwrap();
        other.import_sync_file(Access::Write, &pending).unwrap();
        let waits = other.export_sync_file(Access::Read).unwrap();
        assert!(!poll_ready(&waits, Duration::from_millis(50)));
        drop(fence2); // dropping signals
        assert!(poll_ready(&waits, Duration::from_secs(5)));
    }
    // Only GEM objects of this source's fd take vgem fences.
    let shm = ShmemSource::new().create_segment(4096).unwrap();
    assert!(matches!(gem.vgem_attach_fence(&shm, false), Err(Error::Unsupported { .. })));
}

#[test]
fn pinned_host_memory_says_what_pins_it() {
    let _serial = common::serial();
    let host = HostSource::new();
    let heap_usable = discovery::check_access(Path::new("/dev/dma_heap/system")).allowed();
    match host.backing() {
        HostBacking::SystemHeap => assert!(heap_usable),
        HostBacking::MlockedMemfd { reason } => {
            assert!(!heap_usable);
            assert!(!reason.is_empty());
        }
    }
    let vmlck = || -> u64 {
        let s = std::fs::read_to_string("/proc/self/status").unwrap();
        s.lines().find(|l| l.starts_with("VmLck:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    let locked_before = vmlck();
    let seg = match host.create_segment(1 << 20) {
        Ok(s) => s,
        Err(e) => {
            // An mlock refused by RLIMIT_MEMLOCK must say so.
            assert!(e.to_string().contains("RLIMIT_MEMLOCK"), "{e}");
            let _ = or_skip::<(), _>("pinned_host_mlock", Err(e));
            return;
        }
    };
    assert_eq!(seg.kind(), SegmentKind::PinnedHost);
    seg.cpu_access(Access::Write).unwrap().write(0, b"pinned").unwrap();
    match host.backing() {
        HostBacking::SystemHeap => {
            assert!(seg.is_dma_buf());
            assert_eq!(*seg.origin(), Origin::DmaHeap { heap: "system".into() });
        }
        HostBacking::MlockedMemfd { .. } => {
            assert_eq!(*seg.origin(), Origin::MlockedMemfd);
            assert!(vmlck() >= locked_before + 1024, "mlock did not lock 1 MiB");
        }
    }
    // The explicit mlock path works everywhere.
    let m = HostSource::mlocked();
    match m.create_segment(4096) {
        Ok(s) => assert_eq!(*s.origin(), Origin::MlockedMemfd),
        Err(e) => assert!(e.to_string().contains("RLIMIT_MEMLOCK"), "{e}"),
    }
}

/// A block of a page-stitched arena whose units lie in several runs of the memfd is still one
/// dma-buf for a device (`UDMABUF_CREATE_LIST` over its runs): the dma-buf shows the block's
/// bytes in order, a write through it lands in the block, and its neighbours are untouched. A
/// home block is one range; a block smaller than a page is refused, saying why.
#[test]
fn a_stitched_arena_block_exports_as_one_dma_buf_over_its_runs() {
    use dmabuf_rt::caching::{CachingAllocator, Config};
    let _serial = common::serial();
    let Some(udmabuf) = or_skip("stitched_block_udmabuf_export", Udmabuf::open()) else { return };
    let fds = common::open_fds();
    let allocator = |capacity: u64| {
        CachingAllocator::builder(ShmemSource::new().reserve(false))
            .config(Config::parse("").unwrap())
            .capacity(capacity)
            .build()
            .unwrap()
    };
    // Room for eight blocks of four units, and no more: the memfd cannot grow past them.
    let a = allocator(8 * 16 * 1024);
    let unit = a.config().stitch_unit;
    assert_eq!(unit, 4096, "the default unit changed: the capacity above assumes 4 KiB");
    let fill = |x: &dmabuf_rt::caching::Allocation, tag: u8| {
        x.cpu_access(Access::Write).unwrap().write(0, &pattern(x.len(), tag)).unwrap();
    };
    let bytes = |x: &dmabuf_rt::caching::Allocation| {
        let mut v = vec![0; x.len()];
        x.cpu_access(Access::Read).unwrap().read(0, &mut v).unwrap();
        v
    };
    // Eight home blocks, every other one freed: a block of 16 units fits in no free run.
    let blocks: Vec<_> = (0..8).map(|i| a.allocate(4 * unit, None).map(|x| (x, i as u8)).unwrap()).collect();
    for (x, tag) in &blocks {
        fill(x, *tag);
    }
    let kept: Vec<_> = blocks.into_iter().filter(|(_, tag)| tag % 2 == 1).collect();
    let big = a.allocate(16 * unit, None).unwrap();
    let ranges = big.fd_ranges();
    assert!(ranges.len() > 1, "the block was not stitched: {ranges:?}");
    fill(&big, 40);

    let dmabuf = big.export_dma_buf(&udmabuf).unwrap();
    assert!(dmabuf.is_dma_buf());
    assert_eq!(dmabuf.len(), 16 * unit);
    assert_eq!(read_all(&dmabuf), pattern(big.len(), 40), "the dma-buf does not show the block in order");
    assert_eq!(read_via_memmap2(dmabuf.try_clone_fd().unwrap(), dmabuf.len()), pattern(big.len(), 40));
    // A write through the dma-buf across the first run's end lands in the block.
    let at = ranges[0].1 - 8;
    dmabuf.cpu_access(Access::Write).unwrap().write(at, b"across two runs!").unwrap();
    let mut want = pattern(big.len(), 40);
    want[at..at + 16].copy_from_slice(b"across two runs!");
    assert_eq!(bytes(&big), want, "a write through the dma-buf did not land in the block");
    for (x, tag) in &kept {
        assert_eq!(bytes(x), pattern(x.len(), *tag), "a neighbour changed");
    }

    // A home block: one range, its bytes.
    let home = &kept[0].0;
    assert_eq!(home.fd_ranges(), vec![(home.offset(), 4 * unit)]);
    let d2 = home.export_dma_buf(&udmabuf).unwrap();
    assert_eq!(read_all(&d2), pattern(home.len(), kept[0].1));

    // A pool block smaller than a page.
    let pools = allocator(1 << 30);
    let small = pools.allocate(512, None).unwrap();
    let e = small.export_dma_buf(&udmabuf).unwrap_err();
    assert!(e.to_string().contains("whole pages"), "{e}");
    drop((small, d2, dmabuf, big, kept));
    a.empty_cache();
    drop((a, pools));
    assert_eq!(common::open_fds(), fds, "fds leaked");
}
