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

/// Joins the workers, then stops and joins the thread disturbing them; a worker's panic is
/// raised again here once the disturber has stopped (so that it cannot hang the test).
fn join_then_stop(
    workers: Vec<std::thread::JoinHandle<()>>,
    stop: &AtomicBool,
    disturber: std::thread::JoinHandle<()>,
) {
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
        join_then_stop(workers, &stop, disturber);
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

// ---------------------------------------------------------------------------------------------
// Home blocks (the home region: a block that fits in one run of free units lies at its units'
// own address and leaves no trace when freed).
// ---------------------------------------------------------------------------------------------

/// A raw free of `p` from `threads` threads at once: exactly one wins, the others are told it
/// is a double free (nothing is allocated in between).
fn racing_frees(a: &Arc<CachingAllocator>, p: usize, threads: usize) -> Vec<std::result::Result<(), &'static str>> {
    let start = Arc::new(Barrier::new(threads));
    let hs: Vec<_> = (0..threads)
        .map(|_| {
            let (a, start) = (a.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                match a.free_raw(p as *mut u8) {
                    Ok(()) => Ok(()),
                    Err(Error::InvalidFree { why, .. }) => Err(why),
                    Err(e) => panic!("free_raw: {e}"),
                }
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Home blocks freed raw from several threads at once: exactly one free wins and every other is
/// a double free; then the same pointer freed again after its units were taken by other blocks
/// (a home block over a wider run, a stitched view over them, both freed again), after
/// `empty_cache` punched them, and from a thread while its old units are live in another
/// block: never freeing anything, and every live block keeps its bytes.
#[test]
fn home_block_double_frees_from_many_threads_and_after_reuse() {
    let _g = serial();
    let a = Arc::new(alloc("", 64 * MB as u64));
    let unit = a.config().stitch_unit;
    let q = Queue::new().unwrap();
    // A live block first, so that the arena stays while everything else is freed.
    let anchor = a.allocate_raw(4 * unit, Some(&q)).unwrap();
    raw_fill(anchor, 4 * unit, 1);
    for round in 0..rounds(200) {
        // At least four units (smaller requests go to the pools).
        let n = (5 + round % 5) * unit - round % 100;
        let p = a.allocate_raw(n, Some(&q)).unwrap();
        raw_fill(p, n, 2);
        let r = racing_frees(&a, p as usize, 4);
        assert_eq!(r.iter().filter(|r| r.is_ok()).count(), 1, "round {round}: {r:?}");
        for why in r.iter().filter_map(|r| r.err()) {
            assert_eq!(why, DOUBLE, "round {round}: a racing free of a freed home block");
        }
        raw_check(anchor, 4 * unit, 1, "the anchor");
    }
    a.check_invariants().unwrap();
    // Its units reused by another block (the best fit: at the same address, where a free of
    // `p` is that block's, as for any allocator; elsewhere it must touch nothing).
    let p = a.allocate_raw(4 * unit, Some(&q)).unwrap();
    let after = a.allocate_raw(4 * unit, Some(&q)).unwrap();
    raw_fill(after, 4 * unit, 3);
    a.free_raw(p).unwrap();
    assert_eq!(refusal(a.free_raw(p), p), DOUBLE);
    let big = a.allocate_raw(4 * unit, Some(&q)).unwrap();
    raw_fill(big, 4 * unit, 4);
    // Whatever `big` is (the same address again or not), a free of `p` must not touch `after`.
    if big != p {
        let why = refusal(a.free_raw(p), p);
        assert!([DOUBLE, FOREIGN, INTERIOR].contains(&why), "{why}");
        raw_check(big, 4 * unit, 4, "a block over the freed home block's units");
    }
    raw_check(after, 4 * unit, 3, "the block after it");
    a.free_raw(big).unwrap();
    a.check_invariants().unwrap();
    // Scattered free units: a block no run holds is stitched over `p`'s units; a free of `p`
    // while the view is live must be refused and free nothing.
    let xs: Vec<*mut u8> = (0..8).map(|_| a.allocate_raw(4 * unit, Some(&q)).unwrap()).collect();
    for (i, &x) in xs.iter().enumerate() {
        raw_fill(x, 4 * unit, 10 + i as u32);
    }
    for &x in xs.iter().step_by(2) {
        a.free_raw(x).unwrap();
    }
    let freed_home = xs[0];
    let view = a.allocate_raw(16 * unit, Some(&q)).unwrap();
    raw_fill(view, 16 * unit, 20);
    for _ in 0..3 {
        let why = refusal(a.free_raw(freed_home), freed_home);
        assert!([DOUBLE, FOREIGN, INTERIOR].contains(&why), "{why}");
    }
    raw_check(view, 16 * unit, 20, "a stitched view over a freed home block's units");
    for (i, &x) in xs.iter().enumerate().skip(1).step_by(2) {
        raw_check(x, 4 * unit, 10 + i as u32, "a home block between the view's runs");
    }
    a.check_invariants().unwrap();
    a.free_raw(view).unwrap();
    assert_eq!(refusal(a.free_raw(view), view), DOUBLE, "the stitched view is cached");
    // empty_cache: the view goes, the free units are punched; the anchor keeps the arena.
    a.empty_cache();
    a.check_invariants().unwrap();
    for gone in [view, freed_home, p] {
        let why = refusal(a.free_raw(gone), gone);
        assert!([DOUBLE, FOREIGN, INTERIOR].contains(&why), "{gone:p}: {why}");
    }
    for (i, &x) in xs.iter().enumerate().skip(1).step_by(2) {
        raw_check(x, 4 * unit, 10 + i as u32, "after empty_cache");
        a.free_raw(x).unwrap();
    }
    raw_check(after, 4 * unit, 3, "after empty_cache");
    a.free_raw(after).unwrap();
    raw_check(anchor, 4 * unit, 1, "the anchor at the end");
    a.free_raw(anchor).unwrap();
    // The queue and its arena gone: every old pointer is refused.
    q.synchronize().unwrap();
    drop(q);
    a.empty_cache();
    for gone in [anchor, after, freed_home, view] {
        let why = refusal(a.free_raw(gone), gone);
        assert!([DOUBLE, FOREIGN, INTERIOR].contains(&why), "{gone:p}: {why}");
    }
    a.check_invariants().unwrap();
    assert_eq!(a.stats().allocated_bytes[AGGREGATE].current, 0);
    assert_eq!(a.stats().reserved_bytes[AGGREGATE].current, 0);
}

/// `free_raw_sized` with a wrong size, `raw_size`, interior frees and `mem_at` on home blocks:
/// a refused sized free frees nothing; `mem_at` into a freed home block (alone, or with its
/// units live in a stitched view elsewhere) is refused, never a range of live memory.
#[test]
fn home_blocks_sized_frees_and_ranges_into_freed_ones() {
    let _g = serial();
    let a = alloc("", 64 * MB as u64);
    let unit = a.config().stitch_unit;
    let q = Queue::new().unwrap();
    let n = 6 * unit - 77;
    let p = a.allocate_raw(n, Some(&q)).unwrap();
    raw_fill(p, n, 5);
    assert_eq!(a.raw_size(p).unwrap(), n);
    for wrong in [n - 1, n + 1, 6 * unit, 0, usize::MAX] {
        assert!(matches!(a.free_raw_sized(p, wrong), Err(Error::SizeMismatch { .. })), "{wrong}");
    }
    for bad in [p.wrapping_add(1), p.wrapping_add(unit), p.wrapping_add(n - 1)] {
        assert_eq!(refusal(a.free_raw(bad), bad), INTERIOR, "{bad:p}");
        assert!(matches!(a.free_raw_sized(bad, n), Err(Error::InvalidFree { .. })), "{bad:p}");
    }
    raw_check(p, n, 5, "after refused frees");
    assert!(a.mem_at(p, n).is_ok());
    assert!(a.mem_at(p, n + 1).is_err(), "a range past the request");
    a.check_invariants().unwrap();
    a.free_raw_sized(p, n).unwrap();
    assert!(a.free_raw_sized(p, n).is_err(), "a sized double free");
    assert!(a.raw_size(p).is_err());
    assert!(a.mem_at(p, 1).is_err(), "mem_at into a freed home block");
    assert!(a.mem_at(p.wrapping_add(unit), 16).is_err(), "mem_at into a freed home block's middle");
    // Its units under a live stitched view (the runs around a live block): the home address of
    // those units is no live allocation's.
    let xs: Vec<*mut u8> = (0..6).map(|_| a.allocate_raw(4 * unit, Some(&q)).unwrap()).collect();
    for &x in xs.iter().step_by(2) {
        a.free_raw(x).unwrap();
    }
    let v = a.allocate_raw(12 * unit, Some(&q)).unwrap();
    raw_fill(v, 12 * unit, 6);
    assert!(a.mem_at(v, 12 * unit).is_ok());
    for &x in xs.iter().step_by(2) {
        assert!(a.mem_at(x, 1).is_err(), "mem_at {x:p}: a freed home block whose units a live view shows");
        assert!(a.raw_size(x).is_err());
    }
    raw_check(v, 12 * unit, 6, "the view");
    a.free_raw(v).unwrap();
    for &x in xs.iter().skip(1).step_by(2) {
        a.free_raw(x).unwrap();
    }
    a.check_invariants().unwrap();
}

/// `holds` is documented as "whether `ptr` lies in memory this allocator holds (live, cached or
/// freed blocks alike)", and the C runtime relies on it: a pointer it holds must lie in one
/// live allocation for a copy (`runtime_mem_at` then refuses a freed one), while a pointer it
/// does not hold is taken as plain host memory. A freed home block is memory the arena still
/// holds (mapped, its units free or live in another block), so `holds` must stay true for it
/// (a freed stitched view, cached, is).
#[test]
fn holds_a_freed_home_block() {
    let _g = serial();
    let a = alloc("", 64 * MB as u64);
    let unit = a.config().stitch_unit;
    let q = Queue::new().unwrap();
    let keep = a.allocate_raw(4 * unit, Some(&q)).unwrap();
    let p = a.allocate_raw(8 * unit, Some(&q)).unwrap();
    assert!(a.holds(p) && a.holds(p.wrapping_add(unit)));
    a.free_raw(p).unwrap();
    assert!(a.holds(keep));
    assert!(a.holds(p), "a freed home block's address is not held any more: the C runtime takes it for host memory");
    a.free_raw(keep).unwrap();
}

/// Free units split by live blocks, some of them punched by `empty_cache` (given back, so
/// taking them again counts against the allowed memory), while the queue has work in flight
/// (so nothing more can be punched): a request that the backed free units hold together must
/// be stitched from them, with no memory added, not refused because the best-fitting free run
/// is a punched one. (Before the home region, free backed runs were taken first.)
#[test]
fn punched_best_fit_run_does_not_hide_backed_free_units() {
    let _g = serial();
    // 2 MiB allowed: 128 units of 16 KiB.
    let a = alloc_with("", 2 * MB as u64, Duration::from_millis(50));
    let unit = a.config().stitch_unit;
    let q = Queue::new().unwrap();
    // Units: P [0, 8), sep [8, 12), S1 [12, 16), M1 [16, 20), S2 [20, 24), M2 [24, 28).
    let sizes = [8, 4, 4, 4, 4, 4];
    let mut xs: Vec<Option<Live>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &k)| {
            let x = a.allocate(k * unit, Some(&q)).unwrap();
            fill_alloc(&x, 30 + i as u32);
            Some(Live { x, tag: 30 + i as u32 })
        })
        .collect();
    drop(xs[0].take()); // P
    a.empty_cache(); // P's units are given back (punched); the arena stays (live blocks)
    assert_eq!(a.stats().reserved_bytes[AGGREGATE].current as usize, 20 * unit);
    // Another user takes all but 4 units of the allowed memory.
    let host = a.allocate(104 * unit, None).unwrap();
    fill_alloc(&host, 40);
    assert_eq!(a.stats().reserved_bytes[AGGREGATE].current as usize, 124 * unit);
    let gate = QueueGate::close(&q);
    drop(xs[2].take()); // S1, in stream order: free for later work of `q`
    drop(xs[4].take()); // S2
    // 8 units: the free backed units of S1 and S2 hold it with no memory added.
    let r = a.allocate(8 * unit, Some(&q));
    let got = match r {
        Ok(x) => x,
        Err(e) => panic!(
            "8 units refused while 8 free backed units lie in the arena (only the punched run [0, 8) was \
             tried): {e}"
        ),
    };
    fill_alloc(&got, 50);
    for l in xs.iter().flatten() {
        check_alloc(&l.x, l.tag, "live around it");
    }
    check_alloc(&host, 40, "the host block");
    assert!(a.stats().reserved_bytes[AGGREGATE].current as usize <= 2 * MB);
    gate.open();
    q.synchronize().unwrap();
    a.check_invariants().unwrap();
}

/// The same without a busy queue: the request succeeds either way, but it must not take
/// memory back from the kernel (punched units) while free backed units hold it: the reserved
/// bytes must not grow.
#[test]
fn punched_best_fit_run_is_not_rebacked_while_backed_units_suffice() {
    let _g = serial();
    let a = alloc("", 64 * MB as u64);
    let unit = a.config().stitch_unit;
    let q = Queue::new().unwrap();
    let sizes = [8, 4, 4, 4, 4, 4];
    let mut xs: Vec<Option<Allocation>> =
        sizes.iter().map(|&k| Some(a.allocate(k * unit, Some(&q)).unwrap())).collect();
    drop(xs[0].take());
    a.empty_cache();
    drop(xs[2].take());
    drop(xs[4].take());
    let before = a.stats().reserved_bytes[AGGREGATE].current;
    let x = a.allocate(8 * unit, Some(&q)).unwrap();
    let after = a.stats().reserved_bytes[AGGREGATE].current;
    assert_eq!(
        after,
        before,
        "8 units took {} bytes back from the kernel while 8 free backed units lay in the arena",
        after - before
    );
    drop(x);
    a.check_invariants().unwrap();
}

/// The snapshot's segments of an arena never overlap: live home blocks, live stitched views
/// and the free backed units (shown as one free segment at the end of the reservation).
#[track_caller]
fn check_snapshot_disjoint(a: &CachingAllocator, what: &str) {
    let snap = a.snapshot();
    let mut segs: Vec<(usize, usize)> = snap.segments.iter().map(|s| (s.address, s.size)).collect();
    segs.sort_unstable();
    for w in segs.windows(2) {
        assert!(
            w[0].0 + w[0].1 <= w[1].0,
            "{what}: snapshot segments overlap: {:#x}+{:#x} and {:#x}+{:#x}",
            w[0].0,
            w[0].1,
            w[1].0,
            w[1].1
        );
    }
}

/// Address space of the stitched views filled (views of many sizes made over scattered free
/// units, the oldest let go), one of them live: the snapshot must show it apart from the free
/// units' segment, and every live block inside exactly one segment, in an allocated block.
#[test]
fn snapshot_segments_of_home_blocks_and_views_never_overlap() {
    let _g = serial();
    // 2 MiB allowed: 128 units, a reservation of 512 units, views in its upper 256.
    let a = alloc("", 2 * MB as u64);
    let unit = a.config().stitch_unit;
    let q = Queue::new().unwrap();
    let xs: Vec<Allocation> = (0..32).map(|_| a.allocate(4 * unit, Some(&q)).unwrap()).collect();
    let (keep, go): (Vec<_>, Vec<_>) = xs.into_iter().enumerate().partition(|(i, _)| i % 2 == 0);
    drop(go);
    let keep: Vec<Live> = keep
        .into_iter()
        .map(|(i, x)| {
            fill_alloc(&x, 60 + i as u32);
            Live { x, tag: 60 + i as u32 }
        })
        .collect();
    for round in 0..rounds(3) {
        for n in 5..=64usize {
            let x = a.allocate(n * unit - round, Some(&q)).unwrap();
            fill_alloc(&x, 200 + n as u32);
            check_snapshot_disjoint(&a, &format!("round {round}, a live view of {n} units"));
            let snap = a.snapshot();
            let p = x.as_ptr() as usize;
            let inside: Vec<_> = snap.segments.iter().filter(|s| p >= s.address && p < s.address + s.size).collect();
            assert_eq!(
                inside.len(),
                1,
                "round {round}, {n} units: the block at {p:#x} lies in {} segments",
                inside.len()
            );
            let s = inside[0];
            assert!(
                s.blocks.iter().any(|b| s.address + b.offset == p && b.requested == x.len()),
                "round {round}, {n} units: the block at {p:#x} is not an allocated block of its segment: {s:?}"
            );
            check_alloc_sparse(&x, 200 + n as u32, unit, "the view");
            drop(x);
        }
        a.check_invariants().unwrap();
    }
    for l in &keep {
        check_alloc(&l.x, l.tag, "the home blocks at the end");
    }
}

/// Near the allowed memory: every unit in use by home blocks, then every other block freed: a
/// request that all the free units hold together (half the memory) must be stitched from them,
/// not refused; then the same in a loop of random sizes, each request at most the free units.
#[test]
fn stitches_rather_than_fails_near_the_allowed_memory() {
    let _g = serial();
    for unit_kb in [4usize, 16, 64] {
        let cap = 4 * MB;
        let a = alloc_with(&arena_conf(unit_kb), cap as u64, Duration::from_millis(50));
        let unit = unit_kb * KB;
        let units = cap / unit;
        let q = Queue::new().unwrap();
        let xs: Vec<Allocation> = (0..units / 4).map(|_| a.allocate(4 * unit, Some(&q)).unwrap()).collect();
        assert!(a.allocate(4 * unit, Some(&q)).is_err(), "{unit_kb} KiB: the allowed memory is full");
        let (keep, go): (Vec<_>, Vec<_>) = xs.into_iter().enumerate().partition(|(i, _)| i % 2 == 0);
        drop(go);
        let mut live: Vec<Live> = keep
            .into_iter()
            .map(|(i, x)| {
                fill_alloc(&x, i as u32 + 1);
                Live { x, tag: i as u32 + 1 }
            })
            .collect();
        let half = a
            .allocate(units / 2 * unit, Some(&q))
            .unwrap_or_else(|e| panic!("{unit_kb} KiB: half the memory refused while half the units are free: {e}"));
        fill_alloc(&half, 9999);
        for l in &live {
            check_alloc_sparse(&l.x, l.tag, unit, "around the half");
        }
        drop(half);
        a.check_invariants().unwrap();
        let mut rng = Rng(unit_kb as u64 + 3);
        let mut tag = 10_000;
        let mut used: usize = live.iter().map(|l| l.x.len().div_ceil(unit)).sum();
        for step in 0..rounds(400) {
            let free = units - used;
            if free >= 4 && (rng.below(2) == 0 || live.is_empty()) {
                let n = 4 + rng.below((free - 3) as u64) as usize;
                // (Four units exactly: less goes to the pools.)
                let size = if n == 4 { 4 * unit } else { n * unit - rng.below(unit as u64) as usize };
                let x = a.allocate(size, Some(&q)).unwrap_or_else(|e| {
                    panic!("{unit_kb} KiB, step {step}: {n} units refused with {free} units free: {e}")
                });
                tag += 1;
                fill_alloc(&x, tag);
                used += n;
                live.push(Live { x, tag });
            } else if !live.is_empty() {
                let l = live.swap_remove(rng.below(live.len() as u64) as usize);
                check_alloc(&l.x, l.tag, "before its free");
                used -= l.x.len().div_ceil(unit);
            }
            for l in &live {
                check_alloc_sparse(&l.x, l.tag, unit, &format!("{unit_kb} KiB, step {step}"));
            }
            if step % 32 == 0 {
                a.check_invariants().unwrap_or_else(|e| panic!("step {step}: {e}"));
            }
        }
        drop(live);
        a.check_invariants().unwrap();
    }
}

/// Home blocks shared as fds: each shows its block's bytes at `offset()` of the arena's memfd,
/// and two live blocks' ranges of one fd never overlap.
#[test]
fn home_blocks_fd_ranges_are_disjoint_and_exact() {
    let _g = serial();
    use std::os::unix::fs::FileExt;
    let a = alloc("", 64 * MB as u64);
    let unit = a.config().stitch_unit;
    let q = Queue::new().unwrap();
    let mut rng = Rng(4242);
    let mut live: Vec<Live> = Vec::new();
    for step in 0..rounds(300) as u32 {
        if rng.below(100) < 55 || live.is_empty() {
            let n = (5 + rng.below(12) as usize) * unit - rng.below(unit as u64) as usize;
            let x = a.allocate(n, Some(&q)).unwrap();
            fill_alloc(&x, step + 1);
            live.push(Live { x, tag: step + 1 });
        } else {
            let l = live.swap_remove(rng.below(live.len() as u64) as usize);
            check_alloc(&l.x, l.tag, "before free");
        }
        // The fd ranges of the shareable live blocks: pairwise disjoint, and each shows its block.
        let mut ranges: Vec<(u64, usize, usize, u32)> = Vec::new();
        for l in &live {
            if let Ok(fd) = l.x.try_clone_fd() {
                let f = std::fs::File::from(fd);
                let mut b = [0u8; 64];
                f.read_exact_at(&mut b, l.x.offset() as u64).unwrap();
                assert!(b.iter().enumerate().all(|(i, &v)| v == pat(l.tag, i)), "step {step}: fd range start");
                let last = l.x.len() - 1;
                f.read_exact_at(&mut b[..1], (l.x.offset() + last) as u64).unwrap();
                assert_eq!(b[0], pat(l.tag, last), "step {step}: fd range end");
                use std::os::unix::fs::MetadataExt;
                ranges.push((f.metadata().unwrap().ino(), l.x.offset(), l.x.len(), l.tag));
            }
        }
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            assert!(
                w[0].0 != w[1].0 || w[0].1 + w[0].2 <= w[1].1,
                "step {step}: fd ranges of two live blocks overlap: {w:?}"
            );
        }
        for l in &live {
            check_alloc_sparse(&l.x, l.tag, unit, &format!("step {step}"));
        }
    }
    drop(live);
    a.check_invariants().unwrap();
}

/// A raw home block used on another queue (`record_queue_raw`) and freed: its free waits for
/// that queue, so its units stay out of reach of the blocks made meanwhile on its own queue (a
/// copy queued on the other queue before the free still reads its bytes); a second free says it
/// is waiting; once the other queue has passed, a free of it is a double free.
#[test]
fn a_home_blocks_deferred_free_keeps_its_units() {
    let _g = serial();
    let a = alloc("", 64 * MB as u64);
    let unit = a.config().stitch_unit;
    let q = Queue::new().unwrap();
    let q2 = Queue::new().unwrap();
    for round in 0..rounds(40) {
        let keep = a.allocate_raw(4 * unit, Some(&q)).unwrap();
        let n = (5 + round % 7) * unit;
        let w = a.allocate_raw(n, Some(&q)).unwrap();
        raw_fill(w, n, 70);
        let dst = HostBuffer::new(n).unwrap();
        let gate = QueueGate::close(&q2);
        q2.copy(&dst, a.mem_at(w, n).unwrap()).unwrap();
        a.record_queue_raw(w, &q2).unwrap();
        a.free_raw(w).unwrap();
        assert_eq!(refusal(a.free_raw(w), w), WAITING);
        // Blocks on `q` of every size up to the freed one's: none may show its units.
        let others: Vec<(*mut u8, usize)> = (4..=(n / unit))
            .map(|k| {
                let p = a.allocate_raw(k * unit, Some(&q)).unwrap();
                raw_fill(p, k * unit, 71 + k as u32);
                (p, k * unit)
            })
            .collect();
        a.check_invariants().unwrap();
        gate.open();
        q2.synchronize().unwrap();
        let got = dst.to_vec();
        let want = pattern_of(70, n);
        if let Some(i) = (0..n).find(|&i| got[i] != want[i]) {
            panic!("round {round}: the copy queued before the deferred free read byte {i} as {:#x}", got[i]);
        }
        for &(p, len) in &others {
            raw_check(p, len, 71 + (len / unit) as u32, "a block made while the free waited");
        }
        // The deferred free is applied by the next call that takes the lock.
        let _ = a.stats();
        let why = refusal(a.free_raw(w), w);
        assert!([DOUBLE, WAITING].contains(&why), "round {round}: {why}");
        for (p, _) in others {
            a.free_raw(p).unwrap();
        }
        a.free_raw(keep).unwrap();
        a.check_invariants().unwrap();
    }
    q.synchronize().unwrap();
    assert_eq!(a.stats().allocated_bytes[AGGREGATE].current, 0);
}

/// Many threads on one queue (one arena), raw home blocks and stitched views mixed, each
/// thread freeing its own and other threads' blocks, with `empty_cache`, `snapshot` and
/// `check_invariants` racing: every live block keeps its bytes, every free succeeds once,
/// refused frees (interior, sized with a wrong size) free nothing.
#[test]
fn one_arena_shared_by_threads_home_blocks_and_views() {
    let _g = serial();
    let a = Arc::new(alloc("", 24 * MB as u64));
    let unit = a.config().stitch_unit;
    let q = Arc::new(Queue::new().unwrap());
    let threads = 4;
    let bin: Arc<Mutex<Vec<(usize, usize, u32)>>> = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(threads + 1));
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let (a, q, bin, start) = (a.clone(), q.clone(), bin.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                let mut rng = Rng(t as u64 * 104_729 + 1);
                let mut mine: Vec<(usize, usize, u32)> = Vec::new();
                for i in 0..rounds(1200) {
                    let r = rng.below(10);
                    if r < 5 || mine.is_empty() {
                        let k = if rng.below(4) == 0 { 16 + rng.below(48) } else { 4 + rng.below(8) } as usize;
                        let n = if k == 4 { 4 * unit } else { k * unit - rng.below(unit as u64) as usize };
                        match a.allocate_raw(n, Some(&q)) {
                            Ok(p) => {
                                let tag = (t * 1_000_000 + i) as u32;
                                raw_fill(p, n, tag);
                                mine.push((p as usize, n, tag));
                            }
                            Err(Error::AllocatorOom { .. }) => {
                                if let Some((p, n, tag)) = mine.pop() {
                                    raw_check(p as *mut u8, n, tag, "freed under pressure");
                                    a.free_raw(p as *mut u8).unwrap();
                                }
                            }
                            Err(e) => panic!("{e}"),
                        }
                    } else if r < 7 {
                        let (p, n, tag) = mine.swap_remove(rng.below(mine.len() as u64) as usize);
                        raw_check(p as *mut u8, n, tag, "mine");
                        let ip = (p + unit) as *mut u8;
                        assert_eq!(refusal(a.free_raw(ip), ip), INTERIOR);
                        assert!(matches!(a.free_raw_sized(p as *mut u8, n + 1), Err(Error::SizeMismatch { .. })));
                        a.free_raw_sized(p as *mut u8, n).unwrap();
                    } else {
                        let l = mine.swap_remove(rng.below(mine.len() as u64) as usize);
                        let mut b = bin.lock().unwrap();
                        b.push(l);
                        let at = rng.below(b.len() as u64) as usize;
                        let (p, n, tag) = b.swap_remove(at);
                        drop(b);
                        raw_check(p as *mut u8, n, tag, "from the bin");
                        a.free_raw(p as *mut u8).unwrap();
                    }
                    for &(p, n, tag) in &mine {
                        raw_check(p as *mut u8, n.min(64), tag, "mine, each step");
                        let last = n - 64.min(n);
                        // SAFETY: as in `raw_fill`; the last bytes of a live block of this thread.
                        let s = unsafe { std::slice::from_raw_parts((p + last) as *const u8, n - last) };
                        assert!(
                            s.iter().enumerate().all(|(i, &v)| v == pat(tag, last + i)),
                            "thread {t} step {i}: the end of the live block at {p:#x} changed"
                        );
                    }
                }
                for (p, n, tag) in mine {
                    raw_check(p as *mut u8, n, tag, "mine at the end");
                    a.free_raw(p as *mut u8).unwrap();
                }
            })
        })
        .collect();
    let disturber = {
        let (a, stop, start) = (a.clone(), stop.clone(), start.clone());
        std::thread::spawn(move || {
            start.wait();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if n % 4 == 0 {
                    a.empty_cache();
                }
                a.check_invariants().unwrap_or_else(|e| panic!("invariants: {e}"));
                let _ = a.snapshot();
                n += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    join_then_stop(hs, &stop, disturber);
    for (p, n, tag) in bin.lock().unwrap().drain(..) {
        raw_check(p as *mut u8, n, tag, "the bin at the end");
        a.free_raw(p as *mut u8).unwrap();
    }
    a.check_invariants().unwrap();
    assert_eq!(a.stats().allocated_bytes[AGGREGATE].current, 0);
    q.synchronize().unwrap();
    a.empty_cache();
    assert_eq!(a.stats().reserved_bytes[AGGREGATE].current, 0);
}
