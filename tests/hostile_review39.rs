//! Hostile review 39: queue copies between two mappings of the same pages (a memfd imported
//! twice, an allocator block and its own fd imported back), the fd and offset a CPU view of a
//! page-stitched block names, stream-ordered frees racing other threads' allocations, trims and
//! `empty_cache` while the copy that still reads the freed block is gated, a kernel-engine copy
//! into a block exported through udmabuf, and zero-length operations at the very end of a
//! segment on every engine.

mod common;

use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use common::wait::within;
use common::{QueueGate, allocator_waiting, pattern, scaled, time_scale};
use dmabuf_rt::queue::{CopyEngine, HostBuffer, Mem, Queue, copy_now, fill_now};
use dmabuf_rt::source::ShmemSource;
use dmabuf_rt::{Access, Error, MemorySource, Segment, SegmentKind};

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;

fn shm(len: usize) -> Arc<Segment> {
    Arc::new(ShmemSource::new().reserve(false).create_segment(len).unwrap())
}

/// The ways a copy can be run: on the calling thread, inline on an idle queue, on a queue's
/// executor with the CPU engine, and with the kernel engine (io_uring READ/WRITE on a memfd).
const HOWS: [&str; 4] = ["copy_now", "queue inline", "queue executor", "kernel engine"];

/// Runs `dst <- src` the way `how` names; `Err` if it was refused (at submission or when it ran).
fn run_copy(how: &str, dst: &Mem, src: &Mem) -> Result<(), String> {
    let q = match how {
        "copy_now" => return copy_now(dst, src).map_err(|e| e.to_string()),
        "queue inline" => Queue::builder().inline_max(usize::MAX).build().unwrap(),
        "queue executor" => Queue::builder().inline_max(0).build().unwrap(),
        "kernel engine" => Queue::builder().engine(CopyEngine::Kernel).inline_max(0).build().unwrap(),
        _ => unreachable!(),
    };
    q.copy(dst, src).and_then(|()| q.synchronize()).map_err(|e| e.to_string())
}

/// The first byte where `got` and `want` differ, and what each holds there.
fn first_difference(got: &[u8], want: &[u8]) -> Option<String> {
    let i = got.iter().zip(want).position(|(g, w)| g != w)?;
    let wrong = got.iter().zip(want).filter(|(g, w)| g != w).count();
    Some(format!("{wrong} bytes wrong, the first at {i}: {:#04x}, not {:#04x}", got[i], want[i]))
}

/// A copy from one mapping of a memfd onto another mapping of the same memfd (a second import
/// of its fd), one byte further on: the two ranges share all but one of their pages' bytes,
/// through different addresses. Overlapping copies behave like memmove (as a copy within one
/// segment does: `tests/queue.rs`) or are refused; they must never smear the bytes they already
/// wrote over the ones still to be read.
#[test]
fn a_copy_between_two_imports_of_one_memfd_moves_like_memmove_or_is_refused() {
    let mut bad = Vec::new();
    for n in [200, 64 * KB, 768 * KB] {
        for how in HOWS {
            let a = shm(MB);
            let b = Arc::new(Segment::import(&*a, SegmentKind::Unified).unwrap());
            let pat = pattern(MB, 0x3C);
            a.cpu_access(Access::Write).unwrap().write(0, &pat).unwrap();
            let dst = Mem::from(&b).range(1, n).unwrap();
            let src = Mem::from(&a).range(0, n).unwrap();
            match run_copy(how, &dst, &src) {
                Err(why) => eprintln!("{how}, {n} bytes: refused ({why})"),
                Ok(()) => {
                    let mut want = pat.clone();
                    want.copy_within(0..n, 1);
                    let got = a.cpu_access(Access::Read).unwrap().to_vec().unwrap();
                    if let Some(d) = first_difference(&got, &want) {
                        bad.push(format!("{how}, {n} bytes: {d}"));
                    }
                }
            }
        }
    }
    assert!(bad.is_empty(), "copies between aliasing mappings corrupted their bytes: {bad:#?}");
}

/// The same through the allocator: a block's own fd (`Allocation::try_clone_fd`, the way it is
/// shared) imported back in this process, or the block shared through IPC to an importer in
/// this process (`IpcImporter::open`, one process with two channel ends, as `tests/ipc.rs`
/// does), and the block copied onto that import one page further on. Both ranges lie in the
/// same pages of the allocator's memfd.
#[test]
fn a_block_copied_onto_its_own_fd_imported_back_moves_like_memmove_or_is_refused() {
    use dmabuf_rt::ipc::{IpcExporter, IpcImporter};
    let a = common::allocator("expandable_segments:False", 256 * MB as u64);
    let (end_a, end_b) = dmabuf_rt::share::Channel::pair("review39").unwrap();
    let (exp, imp) = (IpcExporter::new(end_a).unwrap(), IpcImporter::new(end_b));
    let mut bad = Vec::new();
    for via in ["try_clone_fd + Segment::import", "IPC loopback"] {
        for how in HOWS {
            let x = a.allocate(2 * MB, None).unwrap();
            let pat = pattern(x.len(), 0x71);
            x.cpu_access(Access::Write).unwrap().write(0, &pat).unwrap();
            let n = MB;
            let (dst, _keep) = if via == "IPC loopback" {
                let got = imp.open(&exp.export(&x, None).unwrap()).unwrap();
                (got.mem().range(4 * KB, n).unwrap(), Some(got))
            } else {
                let peer = Arc::new(Segment::import(&x.try_clone_fd().unwrap(), SegmentKind::Unified).unwrap());
                (Mem::from(&peer).range(x.offset() + 4 * KB, n).unwrap(), None)
            };
            match run_copy(how, &dst, &x.mem().range(0, n).unwrap()) {
                Err(why) => eprintln!("{via}, {how}: refused ({why})"),
                Ok(()) => {
                    let mut want = pat.clone();
                    want.copy_within(0..n, 4 * KB);
                    let got = x.cpu_access(Access::Read).unwrap().to_vec().unwrap();
                    if let Some(d) = first_difference(&got, &want) {
                        bad.push(format!("{via}, {how}: {d}"));
                    }
                }
            }
        }
    }
    assert!(bad.is_empty(), "a block copied onto its own import lost its bytes: {bad:#?}");
}

/// A CPU view of a page-stitched block whose units lie in several runs of the arena's memfd:
/// no one range of that fd holds the block. (Found at 86d572c: `CpuView::offset`, documented
/// as where the view starts in its fd, was the offset in the arena's mapping, and the fd there
/// read zeros or another block's bytes.) Now the view says it names no fd range
/// (`fd_offset()` is `None`) and the fd is not handed out; a block of one run names the range
/// that holds its bytes. The block's own `fd_ranges` say where its bytes are.
#[test]
fn a_stitched_views_fd_and_offset_name_the_views_bytes() {
    // Room for the 24 blocks below and no more (as `tests/devices.rs` does): the memfd cannot
    // grow, so the later blocks must be stitched over the holes.
    let a = common::allocator("page_stitching:True", 24 * 16 * KB as u64);
    let q = Queue::new().unwrap();
    // Fragment the arena: 4-unit home blocks, every other one freed, then blocks no free run
    // holds, which are stitched over the holes.
    let small: Vec<_> = (0..24).map(|_| a.allocate(16 * KB, Some(&q)).unwrap()).collect();
    let mut keep = Vec::new();
    for (i, x) in small.into_iter().enumerate() {
        if i % 2 == 0 {
            keep.push(x);
        }
    }
    let mut views = Vec::new();
    for size in [48 * KB, 40 * KB, 64 * KB] {
        let x = a.allocate(size, Some(&q)).unwrap();
        if x.fd_ranges().len() > 1 {
            views.push(x);
        } else {
            keep.push(x);
        }
    }
    assert!(!views.is_empty(), "the setup made no view of several runs: {:?}", a.stats().num_remaps);
    let mut bad = Vec::new();
    for (k, x) in views.iter().enumerate() {
        let pat = pattern(x.len(), 0x11 + k as u8);
        let v = x.cpu_access(Access::ReadWrite).unwrap();
        v.write(0, &pat).unwrap();
        // Where the block's bytes really are in its memfd (the reference).
        let mut by_ranges = Vec::new();
        for (off, len) in x.fd_ranges() {
            let mut part = vec![0; len];
            let got = rustix::io::pread(v.as_fd(), &mut part, off as u64).unwrap();
            by_ranges.extend_from_slice(&part[..got]);
        }
        by_ranges.truncate(x.len());
        assert_eq!(by_ranges, pat, "view {k}: the block's fd_ranges do not hold its bytes");
        // What the view names: no range of its fd holds it, and it says so (its offset is
        // where it lies in the arena's mapping, not in the fd); the fd is not handed out.
        if let Some(off) = v.fd_offset() {
            bad.push(format!(
                "view {k} ({} bytes in runs {:?} of its fd) names fd offset {off:#x}: no one range holds it",
                x.len(),
                x.fd_ranges()
            ));
        }
        if x.try_clone_fd().is_ok() {
            bad.push(format!("view {k}: its arena's fd was handed out although no one range holds the block"));
        }
    }
    // Blocks of one run: the fd at the view's fd offset holds the block's bytes.
    for (k, x) in keep.iter().enumerate() {
        let pat = pattern(x.len(), 0x51 + k as u8);
        let v = x.cpu_access(Access::ReadWrite).unwrap();
        v.write(0, &pat).unwrap();
        let Some(off) = v.fd_offset() else {
            bad.push(format!("block {k} of one run ({:?}) names no fd offset", x.fd_ranges()));
            continue;
        };
        assert_eq!(Some(off), x.fd_ranges().first().map(|r| r.0), "block {k}: fd_offset is not its range's start");
        let mut named = vec![0; v.len()];
        let got = rustix::io::pread(v.as_fd(), &mut named, off as u64).unwrap_or(0);
        if got != v.len() || named != pat {
            bad.push(format!(
                "block {k} (runs {:?}): its fd at fd_offset {off:#x} does not hold its bytes: {}",
                x.fd_ranges(),
                first_difference(&named[..got], &pat[..got]).unwrap_or_else(|| "short read".into())
            ));
        }
    }
    assert!(bad.is_empty(), "a CPU view names bytes that are not its own: {bad:#?}");
    drop(views);
    drop(keep);
}

/// A block bound to queue `q1` is freed right after a copy out of it was queued on `q1`
/// (held by a gate): in stream order, only `q1`'s later work may reuse it. Meanwhile another
/// thread allocates on `q2` and for the host and writes every byte it gets, lowers the
/// memory fraction (the trim policy) and empties the cache (whose wait for `q1` times out, the
/// gate still closed). The queued copy must still read the block's bytes. Classic, expandable
/// and page-stitched modes.
#[test]
fn a_stream_ordered_free_keeps_its_bytes_for_the_queued_copy_while_others_allocate_and_trim() {
    for conf in ["expandable_segments:False", "page_stitching:False", "page_stitching:True"] {
        let a = allocator_waiting(conf, 128 * MB, Duration::from_millis(20));
        let q1 = Queue::new().unwrap();
        let q2 = Queue::new().unwrap();
        for round in 0..scaled(30) {
            let size = [24 * KB, 700 * KB, 3 * MB][round % 3] + 512 * (round % 5);
            let x = a.allocate(size, Some(&q1)).unwrap();
            let pat = pattern(size, round as u8);
            x.cpu_access(Access::Write).unwrap().write(0, &pat).unwrap();
            let out = HostBuffer::new(size).unwrap();
            let gate = QueueGate::close(&q1);
            q1.copy(&out, x.mem()).unwrap();
            drop(x);
            let (a2, q2r) = (a.clone(), &q2);
            std::thread::scope(|s| {
                s.spawn(move || {
                    let mut held = Vec::new();
                    for i in 0..12 {
                        let q = if i % 2 == 0 { Some(q2r) } else { None };
                        let sz = if i % 3 == 0 { size } else { size / 2 + 4 * KB };
                        if let Ok(y) = a2.allocate(sz, q) {
                            y.cpu_access(Access::Write).unwrap().fill(0, y.len(), 0xEE).unwrap();
                            held.push(y);
                        }
                        if i == 5 {
                            a2.set_memory_fraction(0.05).unwrap();
                            a2.empty_cache();
                            a2.set_memory_fraction(1.0).unwrap();
                        }
                        if held.len() > 3 {
                            held.remove(0);
                        }
                    }
                    drop(held);
                    a2.empty_cache();
                });
            });
            gate.open();
            q1.synchronize().unwrap();
            if let Some(d) = first_difference(&out.to_vec(), &pat) {
                panic!("{conf}, round {round} ({size} bytes): the copy queued before the free read {d}");
            }
        }
        a.check_invariants().unwrap();
    }
}

/// A block exported as its own dma-buf (`Allocation::export_dma_buf`, udmabuf over the block's
/// pages of the allocator's memfd) and written by a kernel-engine copy: the bytes must land in
/// the block (offset 0 of the dma-buf is the block's first byte), and its neighbour (the block
/// before it in the same memfd) must keep its own. Skipped where `/dev/udmabuf` is missing.
#[test]
fn a_kernel_engine_copy_into_an_exported_block_lands_in_that_block() {
    let Some(udmabuf) = common::or_skip("review39_udmabuf_kernel_copy", dmabuf_rt::source::Udmabuf::open()) else {
        return;
    };
    for conf in ["expandable_segments:False", "page_stitching:False", "page_stitching:True"] {
        let a = common::allocator(conf, 256 * MB as u64);
        let first = a.allocate(64 * KB, None).unwrap();
        let second = a.allocate(64 * KB, None).unwrap();
        first.cpu_access(Access::Write).unwrap().write(0, &pattern(64 * KB, 1)).unwrap();
        second.cpu_access(Access::Write).unwrap().write(0, &pattern(64 * KB, 2)).unwrap();
        let exported = Arc::new(second.export_dma_buf(&udmabuf).unwrap());
        let src = HostBuffer::from_slice(&pattern(64 * KB, 3)).unwrap();
        let q = Queue::builder().engine(CopyEngine::Kernel).inline_max(0).build().unwrap();
        q.copy(Mem::from(&exported).range(0, 64 * KB).unwrap(), &src).unwrap();
        q.synchronize().unwrap();
        let got = |x: &dmabuf_rt::caching::Allocation| x.cpu_access(Access::Read).unwrap().to_vec().unwrap();
        let (f, s) = (got(&first), got(&second));
        assert!(
            s == pattern(64 * KB, 3) && f == pattern(64 * KB, 1),
            "{conf}: block {:#x} (exported) holds {}, block {:#x} holds {}",
            second.offset(),
            first_difference(&s, &pattern(64 * KB, 3)).unwrap_or_else(|| "the copy".into()),
            first.offset(),
            first_difference(&f, &pattern(64 * KB, 1)).unwrap_or_else(|| "its own bytes".into()),
        );
    }
}

/// Zero-length copies and fills at the very end of a segment (offset = its length) and of a
/// host buffer, on every engine, and ranges whose end overflows: the empty ones succeed and
/// touch nothing, the overflowing ones are refused with `OutOfBounds`, and the queue keeps
/// working (no failure state, no hang).
#[test]
fn zero_length_work_at_the_end_of_a_segment_and_overflowing_ranges() {
    let limit = Duration::from_secs(20) * time_scale();
    within("zero-length work", limit, || {
        let seg = shm(64 * KB);
        let len = seg.len();
        let host = HostBuffer::from_slice(&pattern(4 * KB, 9)).unwrap();
        seg.cpu_access(Access::Write).unwrap().write(0, &pattern(len, 3)).unwrap();
        let end = Mem::from(&seg).range(len, 0).unwrap();
        let host_end = Mem::from(&host).range(4 * KB, 0).unwrap();
        for how in HOWS {
            run_copy(how, &end, &host_end).unwrap_or_else(|e| panic!("{how}: empty copy to the end: {e}"));
            run_copy(how, &host_end, &end).unwrap_or_else(|e| panic!("{how}: empty copy from the end: {e}"));
            run_copy(how, &end, &end).unwrap_or_else(|e| panic!("{how}: empty copy onto itself: {e}"));
        }
        fill_now(&end, 0xFF).unwrap();
        for q in [Queue::new().unwrap(), Queue::builder().inline_max(0).engine(CopyEngine::Kernel).build().unwrap()] {
            q.fill(&end, 0xFF).unwrap();
            q.copy(&end, &host_end).unwrap();
            q.synchronize().unwrap();
            assert!(q.error().is_none());
        }
        assert_eq!(seg.cpu_access(Access::Read).unwrap().to_vec().unwrap(), pattern(len, 3), "bytes changed");
        assert_eq!(host.to_vec(), pattern(4 * KB, 9));
        // Overflowing ends.
        let whole = Mem::from(&seg);
        for (off, n) in [(usize::MAX, 1), (1, usize::MAX), (len, 1), (usize::MAX, 0), (len + 1, 0)] {
            assert!(
                matches!(whole.range(off, n), Err(Error::OutOfBounds { .. })),
                "Mem::range({off:#x}, {n:#x}) of {len} bytes"
            );
        }
        let v = seg.cpu_access(Access::ReadWrite).unwrap();
        assert!(v.sub(len, 0).unwrap().is_empty());
        assert!(matches!(v.sub(usize::MAX, 2), Err(Error::OutOfBounds { .. })));
        assert!(matches!(v.fill(usize::MAX, 2, 0), Err(Error::OutOfBounds { .. })));
        assert!(matches!(host.read(usize::MAX, &mut [0; 2]), Err(Error::OutOfBounds { .. })));
        assert!(HostBuffer::new(usize::MAX).is_err());
        assert!(HostBuffer::new(isize::MAX as usize).is_err());
    });
}
