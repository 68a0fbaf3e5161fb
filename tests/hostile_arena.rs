//! A hostile review of the page-stitched arenas (`caching/arena.rs`, `caching/pool/stitched.rs`):
//! blocks of at least four stitching units are views of a per-queue memfd arena; freed views
//! stay mapped and cached, units are shared by several cached views, views are evicted and
//! units punched. Every live block carries a byte pattern checked after every step (two live
//! blocks sharing a unit show up as a wrong byte); work queued on a block freed in stream order
//! must still see the block's bytes; frees and `empty_cache` race from several threads; raw
//! frees are refused for interior, foreign and double pointers; fds of arena blocks show exactly
//! the block; queues dropped with live blocks give their arena back; every configuration of
//! the unit, and page stitching off.

#![allow(unsafe_code)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use common::{QueueGate, Rng, fd_summary, open_fds, scaled, serial};
use dmabuf_rt::Error;
use dmabuf_rt::caching::stats::AGGREGATE;
use dmabuf_rt::caching::{Allocation, CachingAllocator, Config};
use dmabuf_rt::queue::{HostBuffer, Queue};
use dmabuf_rt::segment::Access;
use dmabuf_rt::source::ShmemSource;

/// `n` rounds of a race (as `scaled`), a fifth of them in a debug build (the CI's `cargo test`):
/// the release runs keep the full count.
fn rounds(n: usize) -> usize {
    if cfg!(debug_assertions) { (scaled(n) / 5).max(n.min(20)) } else { scaled(n) }
}

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;

fn alloc_with(conf: &str, capacity: u64, wait: Duration) -> CachingAllocator {
    CachingAllocator::builder(ShmemSource::new().reserve(false))
        .config(Config::parse(conf).unwrap())
        .capacity(capacity)
        .pending_wait_limit(wait)
        .build()
        .unwrap()
}

fn alloc(conf: &str, capacity: u64) -> CachingAllocator {
    alloc_with(conf, capacity, Duration::from_secs(10))
}

/// A byte pattern unique to `tag` at every offset (a unit shown at another place, or another
/// block's unit, reads differently).
fn pat(tag: u32, i: usize) -> u8 {
    ((i / 4096) as u32).wrapping_mul(0x9E37_79B1).wrapping_add(tag.wrapping_mul(0x85EB_CA6B)).to_le_bytes()
        [(i / 1024) % 4]
        ^ (i as u8)
}

fn pattern_of(tag: u32, len: usize) -> Vec<u8> {
    (0..len).map(|i| pat(tag, i)).collect()
}

fn fill_alloc(x: &Allocation, tag: u32) {
    x.cpu_access(Access::Write).unwrap().write(0, &pattern_of(tag, x.len())).unwrap();
}

#[track_caller]
fn check_alloc(x: &Allocation, tag: u32, what: &str) {
    let mut v = vec![0u8; x.len()];
    x.cpu_access(Access::Read).unwrap().read(0, &mut v).unwrap();
    if let Some(i) = (0..v.len()).find(|&i| v[i] != pat(tag, i)) {
        panic!(
            "{what}: live block {:p} ({} bytes, tag {tag}): byte {i} is {:#x}, not {:#x}",
            x.as_ptr(),
            x.len(),
            v[i],
            pat(tag, i)
        );
    }
}

/// Only the pages at the unit boundaries and the ends (cheap, and still catches a unit shown
/// by two live blocks: every unit's first and last bytes are checked).
#[track_caller]
fn check_alloc_sparse(x: &Allocation, tag: u32, unit: usize, what: &str) {
    let v = x.cpu_access(Access::Read).unwrap();
    let mut at = 0;
    let mut buf = [0u8; 64];
    while at < x.len() {
        for off in [at, (at + unit).min(x.len()).saturating_sub(64)] {
            let n = 64.min(x.len() - off);
            v.read(off, &mut buf[..n]).unwrap();
            if let Some(i) = (0..n).find(|&i| buf[i] != pat(tag, off + i)) {
                panic!(
                    "{what}: block {:p} ({} bytes, tag {tag}): byte {} is {:#x}, not {:#x}",
                    x.as_ptr(),
                    x.len(),
                    off + i,
                    buf[i],
                    pat(tag, off + i)
                );
            }
        }
        at += unit;
    }
}

fn raw_fill(p: *mut u8, n: usize, tag: u32) {
    let data = pattern_of(tag, n);
    // SAFETY: `p` is a live raw allocation of at least `n` bytes of this test, mapped for the
    // CPU (a shmem arena), that no other thread writes while it is live.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, n) };
}

#[track_caller]
fn raw_check(p: *mut u8, n: usize, tag: u32, what: &str) {
    // SAFETY: as in `raw_fill`.
    let s = unsafe { std::slice::from_raw_parts(p, n) };
    if let Some(i) = (0..n).find(|&i| s[i] != pat(tag, i)) {
        panic!("{what}: raw block {p:p} ({n} bytes, tag {tag}): byte {i} is {:#x}, not {:#x}", s[i], pat(tag, i));
    }
}

fn arena_conf(unit_kb: usize) -> String {
    format!("expandable_segments:True,page_stitching:True,stitch_unit_kb:{unit_kb}")
}

// ---------------------------------------------------------------------------------------------
// Work queued on a block freed in stream order.
// ---------------------------------------------------------------------------------------------

/// Stream-ordered semantics (PyTorch's): a block freed while work on its own queue still reads
/// it is fine, since the memory is reused only by later work of that queue. Here the copy out
/// of the freed block is held at a gate; then something gives cached memory back while the
/// queue is still busy; the copy must still read the block's bytes.
fn pending_copy_out_of_freed_block(conf: &str, release: impl FnOnce(&CachingAllocator, &Queue)) {
    let a = alloc_with(conf, 64 * MB as u64, Duration::from_millis(50));
    let q = Queue::new().unwrap();
    let src = a.allocate(MB, Some(&q)).unwrap();
    fill_alloc(&src, 7);
    let dst = HostBuffer::new(MB).unwrap();
    let gate = QueueGate::close(&q);
    q.copy(&dst, src.mem()).unwrap();
    drop(src); // stream-ordered free: later work of `q` only may reuse it
    release(&a, &q);
    gate.open();
    q.synchronize().unwrap();
    let got = dst.to_vec();
    let want = pattern_of(7, MB);
    if let Some(i) = (0..MB).find(|&i| got[i] != want[i]) {
        panic!("{conf}: the copy queued before the free read byte {i} as {:#x}, not {:#x}", got[i], want[i]);
    }
    a.check_invariants().unwrap();
}

/// Host allocations that miss the cache above the garbage-collection threshold, so that
/// garbage collection runs.
fn collect_garbage(a: &CachingAllocator, _: &Queue) {
    let pad = a.allocate(8 * MB, None).unwrap();
    let _more = a.allocate(3 * MB, None).unwrap();
    drop(pad);
}

/// Control: garbage collection while the copy is pending, without page stitching (expandable
/// segments keep pages of a busy queue's free blocks).
#[test]
fn gc_while_a_freed_block_is_still_read_by_its_queue_no_stitching() {
    let _g = serial();
    pending_copy_out_of_freed_block("page_stitching:False,garbage_collection_threshold:0.05", collect_garbage);
}

/// Garbage collection (an allocation's cache miss above the threshold) must neither let go of
/// the cached view of a block its queue still reads nor punch its units (it once did both).
#[test]
fn gc_while_a_freed_arena_block_is_still_read_by_its_queue() {
    let _g = serial();
    pending_copy_out_of_freed_block("garbage_collection_threshold:0.05", collect_garbage);
}

/// Control for `empty_cache`: without page stitching.
#[test]
fn empty_cache_while_a_freed_block_is_still_read_by_its_queue_no_stitching() {
    let _g = serial();
    pending_copy_out_of_freed_block("page_stitching:False", |a, _| a.empty_cache());
}

/// `empty_cache` while the queue is held (its wait for the queue is bounded): the arena's cached
/// views must stay under the pending copy (they were once let go).
#[test]
fn empty_cache_while_a_freed_arena_block_is_still_read_by_its_queue() {
    let _g = serial();
    pending_copy_out_of_freed_block("", |a, _| a.empty_cache());
}

/// The OOM ladder's `release_cached_blocks` rung (another request under pressure, no GC, no
/// `empty_cache`): the same, the views must stay under the pending copy.
#[test]
fn memory_pressure_while_a_freed_arena_block_is_still_read_by_its_queue() {
    let _g = serial();
    pending_copy_out_of_freed_block("", |a, _| {
        // 64 MiB allowed, 1 MiB in the arena of `q` (free, cached): 63.5 MiB more on the host
        // queue needs it back.
        // (Refusing it, out of memory, would be right too: the arena's memory is still in
        // use by the queue.)
        let _big = a.allocate(63 * MB + 512 * KB, None);
    });
}

/// The arena's address space running out (views of many sizes cached, no other pressure):
/// `arena_new` must not let go of the oldest cached view while its queue still reads it (it once
/// did).
#[test]
fn address_space_exhaustion_while_a_freed_arena_block_is_still_read_by_its_queue() {
    let _g = serial();
    // 2 MiB allowed: the reservation is 8 MiB of address space, 16 KiB units.
    let a = alloc("", 2 * MB as u64);
    let unit = a.config().stitch_unit;
    let q = Queue::new().unwrap();
    // So that the block's address range does not show the units of the same number (a view
    // made later at its address would show the same bytes by chance): a 4-unit view cached,
    // a 5-unit one over its units held, and then the block.
    drop(a.allocate(4 * unit, Some(&q)).unwrap());
    let hold = a.allocate(5 * unit, Some(&q)).unwrap();
    let src = a.allocate(4 * unit, Some(&q)).unwrap();
    fill_alloc(&src, 9);
    let dst = HostBuffer::new(4 * unit).unwrap();
    let gate = QueueGate::close(&q);
    q.copy(&dst, src.mem()).unwrap();
    drop(src);
    drop(hold);
    // Blocks of 5 to 40 units, freed in stream order and never touched: each is a new view
    // (no cached view of its size) over the same free units, and they fill the address space.
    for n in 6..=40 {
        drop(a.allocate(n * unit, Some(&q)).unwrap());
    }
    a.check_invariants().unwrap();
    gate.open();
    q.synchronize().unwrap();
    let got = dst.to_vec();
    let want = pattern_of(9, 4 * unit);
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!("the copy queued before the free read byte {i} as {:#x}, not {:#x}", got[i], want[i]);
    }
}

// ---------------------------------------------------------------------------------------------
// Many threads, many queues, frees from other threads, empty_cache racing.
// ---------------------------------------------------------------------------------------------

/// A live block of the churn: its allocation and the pattern's tag.
struct Live {
    x: Allocation,
    tag: u32,
}

/// Sizes around the arena threshold and across many unit counts (half of them below it, so
/// the pools and the arena compete for the allowed memory).
fn churn_size(rng: &mut Rng, unit: usize) -> usize {
    match rng.below(8) {
        0 => 1 + rng.below(4 * unit as u64 - 1) as usize, // pools
        1 => 4 * unit - 1 - rng.below(512) as usize,      // just under
        2 => 4 * unit + rng.below(8) as usize,            // just over
        3 | 4 => unit * (4 + rng.below(12) as usize) - rng.below(unit as u64) as usize,
        5 => unit * (16 + rng.below(64) as usize),
        6 => MB + rng.below(3 * MB as u64) as usize,
        _ => 4 * unit * (1 + rng.below(4) as usize), // exact multiples
    }
    .max(1)
}

/// `threads` workers, each on its own queue (one on the host queue), allocate and free random
/// sizes under a capacity the arenas and pools compete for; a quarter of the frees are of
/// blocks another worker allocated (through a shared bin); one thread calls `empty_cache` and
/// `check_invariants` meanwhile. Every worker checks every block it holds after each step, and
/// all blocks are checked at the end; no fd leaks, stats come back to zero.
fn churn(conf: &str, capacity: u64, threads: usize, iters: usize, seed: u64) {
    let a = Arc::new(alloc(conf, capacity));
    let unit = a.config().stitch_unit;
    let fds = open_fds();
    {
        let bin: Arc<Mutex<Vec<Live>>> = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let next_tag = Arc::new(AtomicUsize::new(1));
        let start = Arc::new(Barrier::new(threads + 1));
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (a, bin, next_tag, start) = (a.clone(), bin.clone(), next_tag.clone(), start.clone());
                std::thread::spawn(move || {
                    // First, so that a panic below fails the test instead of leaving the others
                    // waiting here.
                    start.wait();
                    let q = if t == 0 { None } else { Some(Queue::new().unwrap()) };
                    let side = Queue::new().unwrap();
                    let mix = (t as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
                    let mut rng = Rng((seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ mix) | 1);
                    let mut live: Vec<Live> = Vec::new();
                    for step in 0..iters {
                        let r = rng.below(100);
                        if r < 50 || live.is_empty() {
                            let size = churn_size(&mut rng, unit);
                            match a.allocate(size, q.as_ref()) {
                                Ok(x) => {
                                    let tag = next_tag.fetch_add(1, Ordering::Relaxed) as u32;
                                    fill_alloc(&x, tag);
                                    live.push(Live { x, tag });
                                }
                                Err(Error::AllocatorOom { .. }) => {}
                                Err(e) => panic!("thread {t} step {step}: allocate {size}: {e}"),
                            }
                        } else if r < 75 {
                            let l = live.swap_remove(rng.below(live.len() as u64) as usize);
                            check_alloc(&l.x, l.tag, "before its free");
                            drop(l);
                        } else if r < 90 {
                            // Hand one to another thread, free one another thread handed over.
                            let l = live.swap_remove(rng.below(live.len() as u64) as usize);
                            let mut b = bin.lock().unwrap();
                            b.push(l);
                            if b.len() > 1 {
                                let i = rng.below(b.len() as u64) as usize;
                                let o = b.swap_remove(i);
                                drop(b);
                                check_alloc(&o.x, o.tag, "a block from another thread");
                                drop(o);
                            }
                        } else if let Some(l) = live.pop() {
                            // A block used on another queue (recorded), then freed: its free
                            // waits for that queue's work (the CPU writes the next block at
                            // once, so a stream-ordered free on its own queue would race them).
                            let mut x = l.x;
                            side.fill(x.mem(), 0xAA).unwrap();
                            x.record_queue(&side);
                            drop(x);
                        }
                        for l in &live {
                            check_alloc_sparse(&l.x, l.tag, unit, &format!("thread {t} step {step}"));
                        }
                    }
                    for l in &live {
                        check_alloc(&l.x, l.tag, "at the end");
                    }
                    drop(live);
                    if let Some(q) = q {
                        q.synchronize().unwrap();
                    }
                    side.synchronize().unwrap();
                })
            })
            .collect();
        let disturber = {
            let (a, stop, start) = (a.clone(), stop.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    if n % 3 == 0 {
                        a.empty_cache();
                    }
                    if let Err(why) = a.check_invariants() {
                        panic!("invariants: {why}");
                    }
                    let _ = a.snapshot();
                    let s = a.stats();
                    assert!(
                        s.reserved_bytes[AGGREGATE].current as u64 <= capacity,
                        "reserved {} above the capacity {capacity}",
                        s.reserved_bytes[AGGREGATE].current
                    );
                    n += 1;
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        };
        let mut failed = None;
        for w in workers {
            if let Err(e) = w.join() {
                failed.get_or_insert(e);
            }
        }
        stop.store(true, Ordering::Relaxed);
        disturber.join().unwrap();
        if let Some(e) = failed {
            std::panic::resume_unwind(e);
        }
        for l in bin.lock().unwrap().iter() {
            check_alloc(&l.x, l.tag, "in the bin at the end");
        }
        bin.lock().unwrap().clear();
    }
    a.check_invariants().unwrap();
    let s = a.stats();
    assert_eq!(s.allocated_bytes[AGGREGATE].current, 0, "{conf}: allocated bytes with nothing live: {s:?}");
    assert_eq!(s.requested_bytes[AGGREGATE].current, 0, "{conf}: requested bytes with nothing live");
    assert_eq!(s.allocation[AGGREGATE].current, 0, "{conf}: allocations with nothing live");
    a.empty_cache();
    a.check_invariants().unwrap();
    let s = a.stats();
    assert_eq!(s.reserved_bytes[AGGREGATE].current, 0, "{conf}: reserved bytes after empty_cache with nothing live");
    assert_eq!(s.segment[AGGREGATE].current, 0, "{conf}: segments after empty_cache with nothing live");
    drop(a);
    assert_eq!(open_fds(), fds, "{conf}: fds leaked: {}", fd_summary());
}

#[test]
fn churn_default_conf_threads_and_queues() {
    let _g = serial();
    for seed in 0..rounds(3) as u64 {
        churn("", 96 * MB as u64, 4, rounds(400), seed);
    }
}

#[test]
fn churn_tiny_capacity_arena_and_pools_compete() {
    let _g = serial();
    for seed in 0..rounds(3) as u64 {
        churn("", 12 * MB as u64, 4, rounds(400), seed + 100);
    }
}

#[test]
fn churn_every_unit_size() {
    let _g = serial();
    for kb in [4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048] {
        churn(&arena_conf(kb), 64 * MB as u64, 3, rounds(150), kb as u64);
    }
}

#[test]
fn churn_other_confs() {
    let _g = serial();
    for conf in [
        "page_stitching:False",
        "page_stitching:True",
        "expandable_segments:False",
        "expandable_segments:False,page_stitching:True",
        "garbage_collection_threshold:0.3",
        "max_split_size_mb:21",
        "roundup_power2_divisions:4",
        "per_process_memory_fraction:0.5",
    ] {
        churn(conf, 48 * MB as u64, 3, rounds(250), 7);
    }
}

// ---------------------------------------------------------------------------------------------
// Raw API: interior, foreign, double and cross-thread frees of arena blocks.
// ---------------------------------------------------------------------------------------------

const DOUBLE: &str = "already freed (double free)";
const INTERIOR: &str = "not the start of a block (a pointer into an allocation)";
const FOREIGN: &str = "not a pointer this allocator handed out";
const WAITING: &str = "already freed (its free is waiting for other queues)";
const OWNED: &str = "owned by an Allocation object, not a raw allocation: drop the Allocation instead";

#[track_caller]
fn refusal(r: dmabuf_rt::Result<()>, ptr: *const u8) -> &'static str {
    match r {
        Err(Error::InvalidFree { ptr: got, why }) => {
            assert_eq!(got, ptr as usize);
            why
        }
        other => panic!("free of {ptr:p} was not refused: {other:?}"),
    }
}

/// Bad frees of arena blocks are refused with the right reason and change nothing: interior
/// pointers (one byte in, one unit in, the view's slack past the request), double frees
/// (the view still cached), frees of an `Allocation`'s address, frees of an evicted view's
/// address, and a free waiting for another queue.
#[test]
fn bad_raw_frees_of_arena_blocks_are_refused() {
    let _g = serial();
    let a = alloc("", 256 * MB as u64);
    let unit = a.config().stitch_unit;
    let q = Queue::new().unwrap();
    let n = 5 * unit - 100;
    let p = a.allocate_raw(n, Some(&q)).unwrap();
    raw_fill(p, n, 1);
    let other = a.allocate_raw(9 * unit, Some(&q)).unwrap();
    raw_fill(other, 9 * unit, 2);
    for bad in [p.wrapping_add(1), p.wrapping_add(unit), p.wrapping_add(n - 1)] {
        assert_eq!(refusal(a.free_raw(bad), bad), INTERIOR, "{bad:p}");
    }
    // The slack of the view past the request (and past the rounded size).
    let slack = p.wrapping_add(5 * unit - 1);
    let why = refusal(a.free_raw(slack), slack);
    assert!([INTERIOR, FOREIGN].contains(&why), "{why}");
    assert!(matches!(a.free_raw_sized(p, n + 1), Err(Error::SizeMismatch { .. })));
    raw_check(p, n, 1, "after refused frees");
    raw_check(other, 9 * unit, 2, "after refused frees");
    a.check_invariants().unwrap();
    a.free_raw_sized(p, n).unwrap();
    assert_eq!(refusal(a.free_raw(p), p), DOUBLE);
    // An Allocation's block.
    let x = a.allocate(6 * unit, Some(&q)).unwrap();
    assert_eq!(refusal(a.free_raw(x.as_ptr()), x.as_ptr()), OWNED);
    // A free waiting for another queue.
    let q2 = Queue::new().unwrap();
    let w = a.allocate_raw(7 * unit, Some(&q)).unwrap();
    let gate = QueueGate::close(&q2);
    a.record_queue_raw(w, &q2).unwrap();
    a.free_raw(w).unwrap();
    assert_eq!(refusal(a.free_raw(w), w), WAITING);
    assert!(a.record_queue_raw(w, &q2).is_err());
    raw_check(other, 9 * unit, 2, "while a free waits");
    gate.open();
    q2.synchronize().unwrap();
    drop(x);
    // Evicted views (empty_cache): their addresses are no block's now.
    a.empty_cache();
    a.check_invariants().unwrap();
    for gone in [p, w] {
        let why = refusal(a.free_raw(gone), gone);
        assert!([DOUBLE, FOREIGN, INTERIOR].contains(&why), "{gone:p}: {why}");
    }
    raw_check(other, 9 * unit, 2, "after empty_cache");
    a.free_raw(other).unwrap();
    a.check_invariants().unwrap();
    let s = a.stats();
    assert_eq!(s.allocated_bytes[AGGREGATE].current, 0);
}

/// Threads allocate raw arena blocks and free each other's (through a shared bin), with
/// interior frees of live blocks refused meanwhile: every free succeeds once, no live block loses its bytes, and the stats come back to zero.
#[test]
fn raw_arena_blocks_freed_from_other_threads_and_raced() {
    let _g = serial();
    let fds = open_fds();
    for conf in ["", &arena_conf(4), &arena_conf(64)] {
        let a = Arc::new(alloc(conf, 128 * MB as u64));
        let unit = a.config().stitch_unit;
        let threads = 4;
        let iters = rounds(1500);
        // (address, size, tag) of live raw blocks anyone may free.
        let bin: Arc<Mutex<Vec<(usize, usize, u32)>>> = Arc::new(Mutex::new(Vec::new()));
        let wins = Arc::new(AtomicUsize::new(0));
        let made = Arc::new(AtomicUsize::new(0));
        let start = Arc::new(Barrier::new(threads));
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let (a, bin, wins, made, start) = (a.clone(), bin.clone(), wins.clone(), made.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    let q = Queue::new().unwrap();
                    let mut rng = Rng(t as u64 * 7919 + 17);
                    let mut mine: Vec<(usize, usize, u32)> = Vec::new();
                    for i in 0..iters {
                        match rng.below(4) {
                            0 | 1 => {
                                let n = unit * (4 + rng.below(6) as usize) - rng.below(unit as u64) as usize;
                                let qq = if rng.below(3) == 0 { None } else { Some(&q) };
                                let p = a.allocate_raw(n, qq).unwrap();
                                let tag = (t * 1_000_000 + i) as u32;
                                raw_fill(p, n, tag);
                                made.fetch_add(1, Ordering::Relaxed);
                                if rng.below(2) == 0 {
                                    mine.push((p as usize, n, tag));
                                } else {
                                    bin.lock().unwrap().push((p as usize, n, tag));
                                }
                            }
                            2 => {
                                // Take one from the bin, check it, refuse an interior free, free it.
                                let got = {
                                    let mut b = bin.lock().unwrap();
                                    let len = b.len() as u64;
                                    if len == 0 { None } else { Some(b.swap_remove(rng.below(len) as usize)) }
                                };
                                if let Some((p, n, tag)) = got {
                                    raw_check(p as *mut u8, n, tag, "from the bin");
                                    let ip = (p + 4096) as *mut u8;
                                    assert_eq!(refusal(a.free_raw(ip), ip), INTERIOR);
                                    // (A second free here could hit another thread's new
                                    // block at the same address: raw pointers carry no
                                    // identity, so double frees are checked single-threaded.)
                                    a.free_raw(p as *mut u8).unwrap();
                                    wins.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                            _ => {
                                if let Some((p, n, tag)) = mine.pop() {
                                    raw_check(p as *mut u8, n, tag, "mine");
                                    a.free_raw_sized(p as *mut u8, n).unwrap();
                                    wins.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                        for &(p, n, tag) in &mine {
                            raw_check(p as *mut u8, n.min(64), tag, "mine, each step");
                        }
                    }
                    for (p, n, tag) in mine {
                        raw_check(p as *mut u8, n, tag, "mine at the end");
                        a.free_raw(p as *mut u8).unwrap();
                        wins.fetch_add(1, Ordering::Relaxed);
                    }
                    q.synchronize().unwrap();
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        for (p, n, tag) in bin.lock().unwrap().drain(..) {
            raw_check(p as *mut u8, n, tag, "bin at the end");
            a.free_raw(p as *mut u8).unwrap();
            wins.fetch_add(1, Ordering::Relaxed);
        }
        assert_eq!(wins.load(Ordering::Relaxed), made.load(Ordering::Relaxed), "{conf}: frees that won");
        a.check_invariants().unwrap();
        let s = a.stats();
        assert_eq!(s.allocated_bytes[AGGREGATE].current, 0, "{conf}");
        assert_eq!(s.allocation[AGGREGATE].current, 0, "{conf}");
        a.empty_cache();
        assert_eq!(a.stats().reserved_bytes[AGGREGATE].current, 0, "{conf}");
    }
    assert_eq!(open_fds(), fds, "fds leaked: {}", fd_summary());
}

// ---------------------------------------------------------------------------------------------
// Aliases: units shown by several cached views.
// ---------------------------------------------------------------------------------------------

/// Builds many aliases on purpose (blocks of many unit counts freed and reallocated in
/// shuffled orders on one queue, so that cached views overlap in units), then holds as many
/// live blocks as fit and checks every one against every other after each step: two live
/// views sharing a unit would show the other's bytes.
#[test]
fn aliased_views_never_live_twice() {
    let _g = serial();
    for unit_kb in [4usize, 16] {
        let a = alloc(&arena_conf(unit_kb), 8 * MB as u64);
        let unit = unit_kb * KB;
        let q = Queue::new().unwrap();
        let mut rng = Rng(unit_kb as u64 * 31 + 5);
        let mut live: Vec<Live> = Vec::new();
        let mut tag = 0u32;
        for step in 0..rounds(3000) {
            if rng.below(100) < 55 || live.is_empty() {
                let n = 4 + rng.below(28) as usize;
                match a.allocate(n * unit - rng.below(unit as u64) as usize, Some(&q)) {
                    Ok(x) => {
                        tag += 1;
                        fill_alloc(&x, tag);
                        live.push(Live { x, tag });
                    }
                    Err(Error::AllocatorOom { .. }) => {
                        let l = live.swap_remove(rng.below(live.len() as u64) as usize);
                        check_alloc(&l.x, l.tag, "before its free");
                    }
                    Err(e) => panic!("{e}"),
                }
            } else {
                let l = live.swap_remove(rng.below(live.len() as u64) as usize);
                check_alloc(&l.x, l.tag, "before its free");
            }
            for l in &live {
                check_alloc_sparse(&l.x, l.tag, unit, &format!("unit {unit_kb} KiB, step {step}"));
            }
            if step % 16 == 0 {
                a.check_invariants().unwrap_or_else(|e| panic!("step {step}: {e}"));
            }
        }
        assert!(a.stats().num_remaps > 0);
        for l in &live {
            check_alloc(&l.x, l.tag, "at the end");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Sharing arena blocks as fds.
// ---------------------------------------------------------------------------------------------

/// Every arena block: either `try_clone_fd` works and the fd at `offset()` shows exactly its
/// bytes (and writing through the fd shows in the block), or it is refused saying why (a view
/// of several runs); `AsFd`/`offset()` agree with it. Checked across reuse of cached views.
#[test]
fn arena_blocks_shared_as_fds_show_exactly_their_bytes() {
    let _g = serial();
    use std::os::unix::fs::FileExt;
    let fds = open_fds();
    let a = alloc("", 64 * MB as u64);
    let unit = a.config().stitch_unit;
    let q = Queue::new().unwrap();
    let mut rng = Rng(99);
    let mut live: Vec<Live> = Vec::new();
    let (mut shared, mut refused) = (0, 0);
    for step in 0..rounds(600) as u32 {
        if rng.below(100) < 60 || live.is_empty() {
            let n = (4 + rng.below(20) as usize) * unit - rng.below(unit as u64) as usize;
            let x = a.allocate(n, Some(&q)).unwrap();
            fill_alloc(&x, step + 1);
            live.push(Live { x, tag: step + 1 });
        } else {
            let l = live.swap_remove(rng.below(live.len() as u64) as usize);
            check_alloc(&l.x, l.tag, "before free");
            drop(l);
        }
        let l = &live[rng.below(live.len() as u64) as usize];
        match l.x.try_clone_fd() {
            Ok(fd) => {
                shared += 1;
                let f = std::fs::File::from(fd);
                let mut back = vec![0u8; l.x.len()];
                f.read_exact_at(&mut back, l.x.offset() as u64).unwrap();
                assert!(
                    back == pattern_of(l.tag, l.x.len()),
                    "step {step}: the fd at offset() does not show the block"
                );
                // One byte through the fd, at the last byte: the block shows it.
                let last = l.x.len() - 1;
                f.write_all_at(&[!pat(l.tag, last)], (l.x.offset() + last) as u64).unwrap();
                let mut b = [0u8];
                l.x.cpu_access(Access::Read).unwrap().read(last, &mut b).unwrap();
                assert_eq!(b[0], !pat(l.tag, last), "step {step}: a write through the fd does not show in the block");
                l.x.cpu_access(Access::Write).unwrap().write(last, &[pat(l.tag, last)]).unwrap();
            }
            Err(e) => {
                refused += 1;
                let m = e.to_string();
                assert!(m.contains("page-stitched") && m.contains("page_stitching:False"), "{m}");
            }
        }
        for l in &live {
            check_alloc_sparse(&l.x, l.tag, unit, &format!("step {step}"));
        }
    }
    assert!(shared > 0 && refused > 0, "shared {shared}, refused {refused}: both cases must have happened");
    drop(live);
    q.synchronize().unwrap();
    drop(q);
    drop(a);
    assert_eq!(open_fds(), fds, "fds leaked: {}", fd_summary());
}

// ---------------------------------------------------------------------------------------------
// Queues dropped while their arena blocks live.
// ---------------------------------------------------------------------------------------------

/// A queue's arena outlives the queue while its blocks live (they keep their bytes, freed
/// from other threads), and goes back to the source once the last is freed, with no
/// `empty_cache`: no fd, no reserved byte left.
#[test]
fn a_dropped_queue_gives_its_arena_back_when_its_last_block_goes() {
    let _g = serial();
    let fds = open_fds();
    let a = Arc::new(alloc("", 256 * MB as u64));
    let unit = a.config().stitch_unit;
    for round in 0..rounds(20) {
        let q = Queue::new().unwrap();
        let xs: Vec<Live> = (0..8u32)
            .map(|i| {
                let x = a.allocate((4 + i as usize * 3) * unit + 1, Some(&q)).unwrap();
                fill_alloc(&x, i + 1);
                Live { x, tag: i + 1 }
            })
            .collect();
        // Free some first, so that cached views exist too.
        let (keep, go): (Vec<_>, Vec<_>) = xs.into_iter().partition(|l| l.tag % 2 == 0);
        drop(go);
        drop(q);
        a.check_invariants().unwrap();
        for l in &keep {
            check_alloc(&l.x, l.tag, "after its queue went");
        }
        // The host queue's allocations meanwhile are not affected.
        let h = a.allocate(6 * unit, None).unwrap();
        fill_alloc(&h, 99);
        let t = std::thread::spawn(move || drop(keep));
        t.join().unwrap();
        check_alloc(&h, 99, "host block");
        drop(h);
        a.check_invariants().unwrap();
        let s = a.stats();
        assert_eq!(s.allocated_bytes[AGGREGATE].current, 0, "round {round}");
        // The host arena may stay cached; the gone queue's may not.
        a.empty_cache();
        let s = a.stats();
        assert_eq!(s.reserved_bytes[AGGREGATE].current, 0, "round {round}");
    }
    drop(a);
    assert_eq!(open_fds(), fds, "fds leaked: {}", fd_summary());
}

/// Without `empty_cache`: the gone queue's arena must not linger once its blocks are freed.
#[test]
fn a_dropped_queues_arena_goes_without_empty_cache() {
    let _g = serial();
    let a = alloc("", 256 * MB as u64);
    let unit = a.config().stitch_unit;
    let before = a.stats().reserved_bytes[AGGREGATE].current;
    let q = Queue::new().unwrap();
    let xs: Vec<Allocation> = (0..4).map(|i| a.allocate((4 + i) * unit, Some(&q)).unwrap()).collect();
    drop(q);
    drop(xs);
    a.check_invariants().unwrap();
    let s = a.stats();
    assert_eq!(s.reserved_bytes[AGGREGATE].current, before, "the gone queue's arena is still reserved: {s:?}");
    assert_eq!(s.segment[AGGREGATE].current, 0);
}
