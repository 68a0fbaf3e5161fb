//! A hostile review of the rewritten fast path (raw frees and quick hits in one pass, per-queue
//! quick tables, the open-addressing address table, hot stats kept as slack below the peak):
//! double, foreign, interior, null and stale frees from several threads at once, through
//! `free_raw` and the C ABI; frees racing allocations of the same size; address reuse (ABA) on
//! the address table against an exact model; quick-cache isolation between queues; deferred
//! raw frees; `empty_cache` under raw churn; stats against a model through resets. Raw
//! pointers of a shmem-backed allocator are CPU mappings: every live block carries a byte
//! pattern that is checked before it is freed, so a block handed out twice, or released while
//! live, shows up as a wrong byte.

#![allow(unsafe_code)]

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use common::tags::{Live, Raw, settled};
use common::{QueueGate, Rng, allocator, scaled};
use dmabuf_rt::Error;
use dmabuf_rt::caching::CachingAllocator;
use dmabuf_rt::caching::stats::{AGGREGATE, DeviceStats, LARGE_POOL, SMALL_POOL, Stat, StatArray};
use dmabuf_rt::queue::Queue;

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;

const DOUBLE: &str = "already freed (double free)";
const INTERIOR: &str = "not the start of a block (a pointer into an allocation)";
const FOREIGN: &str = "not a pointer this allocator handed out";
const OWNED: &str = "owned by an Allocation object, not a raw allocation: drop the Allocation instead";
const WAITING: &str = "already freed (its free is waiting for other queues)";

/// Fills `n` bytes at `p` with `tag`.
fn fill(p: *mut u8, n: usize, tag: u8) {
    // SAFETY: `p` is a live raw allocation of at least `n` bytes of this test, mapped for the
    // CPU (a shmem segment), and no other thread writes it while it is live.
    unsafe { std::ptr::write_bytes(p, tag, n) };
}

/// The first byte of `n` at `p` that is not `tag`.
fn first_wrong(p: *const u8, n: usize, tag: u8) -> Option<(usize, u8)> {
    // SAFETY: as in `fill`: a live raw allocation of this test of at least `n` bytes.
    let s = unsafe { std::slice::from_raw_parts(p, n) };
    s.iter().position(|&b| b != tag).map(|i| (i, s[i]))
}

#[track_caller]
fn assert_intact(p: *mut u8, n: usize, tag: u8, what: &str) {
    if let Some((i, b)) = first_wrong(p, n, tag) {
        panic!("{what}: live block {p:p} ({n} bytes): byte {i} is {b:#x}, not {tag:#x}");
    }
}

/// The reason an invalid free gives.
#[track_caller]
fn refusal(r: dmabuf_rt::Result<()>, ptr: *const u8) -> &'static str {
    match r {
        Err(Error::InvalidFree { ptr: got, why }) => {
            assert_eq!(got, ptr as usize, "the refusal names another pointer");
            why
        }
        other => panic!("free of {ptr:p} was not refused as an invalid free: {other:?}"),
    }
}

#[track_caller]
fn assert_refused(r: dmabuf_rt::Result<()>, ptr: *const u8, want: &str) {
    let why = refusal(r, ptr);
    assert_eq!(why, want, "free of {ptr:p}: wrong reason");
}

fn sizes(rng: &mut Rng) -> usize {
    match rng.below(6) {
        0 => 1 + rng.below(512) as usize,
        1 => 512 * (1 + rng.below(8) as usize),
        2 => 4 * KB,
        3 => 1 + rng.below(64 * KB as u64) as usize,
        4 => MB + 1 + rng.below(MB as u64) as usize,
        _ => 1000,
    }
}

fn rounded(n: usize) -> usize {
    n.max(1).next_multiple_of(512)
}

/// Every hot stat and the active ones are consistent as a snapshot: the aggregate is the sum
/// of the pools, and no peak is below its current value.
#[track_caller]
fn assert_consistent(s: &DeviceStats, accumulated_exact: bool) {
    for (name, a) in [
        ("allocation", &s.allocation),
        ("allocated_bytes", &s.allocated_bytes),
        ("requested_bytes", &s.requested_bytes),
        ("active", &s.active),
        ("active_bytes", &s.active_bytes),
        ("inactive_split", &s.inactive_split),
        ("inactive_split_bytes", &s.inactive_split_bytes),
    ] {
        let (all, sm, lg) = (a[AGGREGATE], a[SMALL_POOL], a[LARGE_POOL]);
        assert_eq!(all.current, sm.current + lg.current, "{name}: aggregate current {a:?}");
        assert_eq!(all.allocated, sm.allocated + lg.allocated, "{name}: aggregate allocated {a:?}");
        assert_eq!(all.freed, sm.freed + lg.freed, "{name}: aggregate freed {a:?}");
        for st in a {
            assert!(st.current >= 0 && st.peak >= st.current, "{name}: {a:?}");
            assert!(st.allocated >= 0 && st.freed >= 0, "{name}: {a:?}");
            if accumulated_exact {
                assert_eq!(st.allocated - st.freed, st.current, "{name}: totals do not add up: {a:?}");
            }
        }
        assert!(all.peak >= sm.peak.max(lg.peak), "{name}: aggregate peak below a pool's: {a:?}");
        assert!(all.peak <= sm.peak + lg.peak, "{name}: aggregate peak above both pools' sum: {a:?}");
    }
}

/// Several threads free the same raw pointer at once: exactly one free succeeds, every other
/// one is refused as a double free, and nothing else changes.
#[test]
fn racing_double_frees_of_one_raw_pointer_exactly_one_wins() {
    for conf in CONFS {
        racing_double_frees(conf);
    }
}

/// Settings that change the fast path's decisions: classic segments, oversize blocks (never
/// quick-cached), power-of-two rounding (the quick path steps aside), garbage collection.
const CONFS: [&str; 5] = [
    "",
    "expandable_segments:False",
    "max_split_size_mb:21",
    "roundup_power2_divisions:4",
    "garbage_collection_threshold:0.2",
];

fn racing_double_frees(conf: &str) {
    let a = allocator(conf, 512 * MB as u64);
    let threads = 4;
    let iters = scaled(3000);
    let slot = Arc::new(AtomicUsize::new(0));
    let wins: Arc<Vec<AtomicU8>> = Arc::new((0..iters).map(|_| AtomicU8::new(0)).collect());
    let bar = Arc::new(Barrier::new(threads));
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let (a, slot, wins, bar) = (a.clone(), Arc::clone(&slot), Arc::clone(&wins), Arc::clone(&bar));
            std::thread::spawn(move || {
                let mut rng = Rng(0x51ed_2701 + t as u64);
                // A block of another thread's, live through the whole race, must not change.
                let keep = a.allocate_raw(4096, None).unwrap();
                fill(keep, 4096, t as u8 + 1);
                for it in 0..iters {
                    if t == 0 {
                        // Now and then an oversize block (with max_split_size_mb:21), which
                        // the quick cache never holds.
                        let n = if it % 97 == 0 { 22 * MB } else { sizes(&mut rng) };
                        let p = a.allocate_raw(n, None).unwrap();
                        fill(p, n.min(8192), 0xa5);
                        slot.store(p as usize, Ordering::Release);
                    }
                    bar.wait();
                    let p = slot.load(Ordering::Acquire) as *mut u8;
                    match a.free_raw(p) {
                        Ok(()) => {
                            wins[it].fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            let why = refusal(Err(e), p);
                            assert_eq!(why, DOUBLE, "iteration {it}: a losing free's reason");
                        }
                    }
                    bar.wait();
                }
                assert_intact(keep, 4096, t as u8 + 1, "a bystander");
                a.free_raw(keep).unwrap();
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    for (it, w) in wins.iter().enumerate() {
        assert_eq!(w.load(Ordering::Relaxed), 1, "iteration {it}: not exactly one free succeeded");
    }
    a.check_invariants().unwrap();
    let s = a.stats();
    assert_consistent(&s, true);
    assert_eq!(s.allocation[AGGREGATE].current, 0);
    assert_eq!(s.allocation[AGGREGATE].allocated, (iters + threads) as i64);
    assert_eq!(s.allocation[AGGREGATE].freed, (iters + threads) as i64);
    assert_eq!(s.requested_bytes[AGGREGATE].current, 0);
    assert_eq!(s.oversize_allocations.current, 0, "{conf}");
}

/// Threads allocate and free raw blocks of the same few sizes (so they share quick-cache
/// lists) while throwing hostile frees at the allocator: null, interior pointers of their own
/// live blocks, heap and stack pointers, an `Allocation`'s pointer, another allocator's live
/// pointer. Every hostile free is refused with its real reason and every live block keeps its
/// bytes.
#[test]
fn hostile_frees_from_many_threads_are_refused_and_touch_no_live_block() {
    for conf in CONFS {
        hostile_frees(conf);
    }
}

fn hostile_frees(conf: &str) {
    let a = allocator(conf, 512 * MB as u64);
    let other = allocator("", 64 * MB as u64);
    let foreign_live = other.allocate_raw(4096, None).unwrap() as usize;
    let threads = 4;
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let mut rng = Rng(0xfeed_0001 + 31 * t as u64);
                let mut live: Vec<(*mut u8, usize, u8)> = Vec::new();
                let owned = a.allocate(3000, None).unwrap();
                let heap = vec![0u8; 4096];
                let stack = [0u8; 64];
                for it in 0..scaled(20_000) {
                    let tag = ((t * 64 + it) % 251) as u8 | 1;
                    match rng.below(8) {
                        0..=2 if live.len() < 12 => {
                            let n = [512, 1000, 4096, 20_000, MB + 512][rng.below(5) as usize];
                            let p = a.allocate_raw(n, None).unwrap();
                            assert!(!p.is_null());
                            assert_eq!(a.raw_size(p).unwrap(), n, "a fresh raw block's size");
                            fill(p, n, tag);
                            live.push((p, n, tag));
                        }
                        0..=3 if !live.is_empty() => {
                            let (p, n, tag) = live.swap_remove(rng.below(live.len() as u64) as usize);
                            assert_intact(p, n, tag, "before its free");
                            a.free_raw(p).unwrap();
                        }
                        4 if !live.is_empty() => {
                            let (p, n, _) = live[rng.below(live.len() as u64) as usize];
                            let q = p.wrapping_add(1 + rng.below(rounded(n) as u64 - 1) as usize);
                            assert_refused(a.free_raw(q), q, INTERIOR);
                        }
                        5 => {
                            let r = a.free_raw(std::ptr::null_mut());
                            assert!(
                                matches!(r, Err(Error::InvalidFree { ptr: 0, why: "null pointer" })),
                                "null: {r:?}"
                            );
                        }
                        6 => {
                            for q in [heap.as_ptr().cast_mut(), stack.as_ptr().cast_mut(), foreign_live as *mut u8] {
                                assert_refused(a.free_raw(q), q, FOREIGN);
                            }
                        }
                        _ => assert_refused(a.free_raw(owned.as_ptr()), owned.as_ptr(), OWNED),
                    }
                    if it % 64 == 0 {
                        for &(p, n, tag) in &live {
                            assert_intact(p, n, tag, "during the churn");
                        }
                    }
                }
                for (p, n, tag) in live {
                    assert_intact(p, n, tag, "at the end");
                    a.free_raw(p).unwrap();
                }
                drop(owned);
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    a.check_invariants().unwrap();
    let s = a.stats();
    assert_consistent(&s, true);
    assert_eq!((s.allocation[AGGREGATE].current, s.allocated_bytes[AGGREGATE].current), (0, 0));
    other.free_raw(foreign_live as *mut u8).unwrap();
    other.check_invariants().unwrap();
}

/// Single thread, exact model of address reuse (ABA): raw blocks of many sizes (powers of two
/// up to 4 MiB among them, so starts fall on multiples of large powers of two) are allocated
/// and freed by the thousand, with `empty_cache` now and then (merges and releases remove
/// addresses from the table, and re-used addresses are filed again). A free of any pointer
/// ever handed out, or of one byte past it, succeeds exactly when the model says it names a
/// live block; the table's answer for live blocks (`raw_size`) is always the requested size.
#[test]
fn address_reuse_against_an_exact_model() {
    for conf in ["", "expandable_segments:False"] {
        let a = allocator(conf, MB as u64 * 1024);
        let mut rng = Rng(0x0aba_0aba);
        let mut live: HashMap<usize, (usize, u8)> = HashMap::new();
        let mut ever: Vec<usize> = Vec::new();
        let mut ever_set: HashSet<usize> = HashSet::new();
        let mut reused = 0usize;
        for step in 0..scaled(60_000) {
            match rng.below(10) {
                0..=4 => {
                    let n = match rng.below(4) {
                        0 => 1usize << (9 + rng.below(14)),
                        1 => 1 + rng.below(8 * KB as u64) as usize,
                        2 => 512,
                        _ => 512 * (1 + rng.below(64) as usize),
                    };
                    // The live set wanders; near the capacity a request may not fit (which
                    // pool has room depends on where the kernel put the segments): skip it.
                    let p = match a.allocate_raw(n, None) {
                        Ok(p) => p,
                        Err(dmabuf_rt::Error::AllocatorOom { .. }) => continue,
                        Err(e) => panic!("{conf}: {e}"),
                    };
                    let tag = (step % 253) as u8 | 1;
                    assert!(live.insert(p as usize, (n, tag)).is_none(), "{conf}: {p:p} handed out twice");
                    fill(p, n.min(1024), tag);
                    if !ever_set.insert(p as usize) {
                        reused += 1;
                    } else {
                        ever.push(p as usize);
                    }
                }
                5..=7 if !live.is_empty() => {
                    let p = *live.keys().nth(rng.below(live.len() as u64) as usize).unwrap();
                    let (n, tag) = live.remove(&p).unwrap();
                    assert_intact(p as *mut u8, n.min(1024), tag, conf);
                    a.free_raw(p as *mut u8).unwrap();
                }
                8 if !ever.is_empty() => {
                    // A stale, double or live free of some address ever handed out.
                    let p = ever[rng.below(ever.len() as u64) as usize];
                    let r = a.free_raw(p as *mut u8);
                    match live.remove(&p) {
                        Some((n, tag)) => {
                            assert!(r.is_ok(), "{conf}: free of live {p:#x} refused: {r:?}");
                            assert_intact(p as *mut u8, n.min(1024), tag, conf);
                        }
                        None => {
                            let why = refusal(r, p as *const u8);
                            assert!([DOUBLE, INTERIOR, FOREIGN].contains(&why), "{conf}: stale {p:#x}: {why}");
                        }
                    }
                    let q = (p + 1) as *mut u8;
                    let why = refusal(a.free_raw(q), q);
                    assert!([INTERIOR, FOREIGN].contains(&why), "{conf}: {q:p}: {why}");
                }
                9 if step % 50 == 9 => a.empty_cache(),
                _ => {
                    if let Some((&p, &(n, _))) = live.iter().next() {
                        assert_eq!(a.raw_size(p as *mut u8).unwrap(), n, "{conf}: raw_size of {p:#x}");
                    }
                }
            }
            if step % 5000 == 0 {
                a.check_invariants().unwrap_or_else(|e| panic!("{conf}: step {step}: {e}"));
            }
        }
        assert!(reused > 100, "{conf}: the model saw only {reused} address reuses");
        for (&p, &(n, _)) in &live {
            assert_eq!(a.raw_size(p as *mut u8).unwrap(), n);
        }
        a.check_invariants().unwrap();
        let s = a.stats();
        assert_consistent(&s, true);
        assert_eq!(s.allocation[AGGREGATE].current, live.len() as i64, "{conf}");
        for (p, _) in live {
            a.free_raw(p as *mut u8).unwrap();
        }
        a.empty_cache();
        a.check_invariants().unwrap();
        assert_eq!(a.stats().reserved_bytes[AGGREGATE].current, 0, "{conf}");
    }
}

/// Threads allocate raw blocks and RAII blocks on five long-lived queues, picking a queue per
/// operation (so the quick tables move to the front all the time): no address is ever handed
/// out on two queues (nothing is released, so a block's address names its queue for good),
/// and no address is handed out twice at once.
#[test]
fn the_quick_cache_never_hands_a_block_to_another_queue() {
    let a = allocator("", 1024 * MB as u64);
    let queues: Arc<Vec<Queue>> = Arc::new((0..5).map(|_| Queue::new().unwrap()).collect());
    let owner: Arc<Mutex<HashMap<usize, usize>>> = Arc::default();
    let live_set: Arc<Mutex<HashSet<usize>>> = Arc::default();
    let threads = 3;
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let (a, queues, owner, live_set) =
                (a.clone(), Arc::clone(&queues), Arc::clone(&owner), Arc::clone(&live_set));
            std::thread::spawn(move || {
                let mut rng = Rng(0x00c0_ffee + t as u64);
                let mut raws: Vec<(*mut u8, usize, u8)> = Vec::new();
                let mut objs = Vec::new();
                let note = |p: usize, q: usize| {
                    let prev = *owner.lock().unwrap().entry(p).or_insert(q);
                    assert_eq!(prev, q, "{p:#x} was handed out on queue {prev}, now on queue {q}");
                    assert!(live_set.lock().unwrap().insert(p), "{p:#x} handed out while live");
                };
                for it in 0..scaled(15_000) {
                    let q = rng.below(5) as usize;
                    let n = [512, 700, 4096, 64 * KB, 2 * MB][rng.below(5) as usize];
                    match rng.below(4) {
                        0 if raws.len() < 16 => {
                            let p = a.allocate_raw(n, Some(&queues[q])).unwrap();
                            note(p as usize, q);
                            let tag = (it % 249) as u8 | 1;
                            fill(p, n.min(2048), tag);
                            raws.push((p, n, tag));
                        }
                        1 if objs.len() < 16 => {
                            let x = a.allocate(n, Some(&queues[q])).unwrap();
                            note(x.as_ptr() as usize, q);
                            objs.push(x);
                        }
                        2 if !raws.is_empty() => {
                            let (p, n, tag) = raws.swap_remove(rng.below(raws.len() as u64) as usize);
                            assert_intact(p, n.min(2048), tag, "a raw block on its queue");
                            assert!(live_set.lock().unwrap().remove(&(p as usize)));
                            a.free_raw(p).unwrap();
                        }
                        _ if !objs.is_empty() => {
                            let x = objs.swap_remove(rng.below(objs.len() as u64) as usize);
                            assert!(live_set.lock().unwrap().remove(&(x.as_ptr() as usize)));
                            drop(x);
                        }
                        _ => {}
                    }
                }
                for (p, n, tag) in raws {
                    assert_intact(p, n.min(2048), tag, "at the end");
                    live_set.lock().unwrap().remove(&(p as usize));
                    a.free_raw(p).unwrap();
                }
                for x in objs {
                    live_set.lock().unwrap().remove(&(x.as_ptr() as usize));
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    a.check_invariants().unwrap();
    let s = a.stats();
    assert_consistent(&s, true);
    assert_eq!(s.allocation[AGGREGATE].current, 0);
    // Each queue's segments hold only its own addresses.
    let owner = owner.lock().unwrap();
    let snap = a.snapshot();
    for seg in &snap.segments {
        let qs: HashSet<usize> =
            owner.iter().filter(|&(&p, _)| p >= seg.address && p < seg.address + seg.size).map(|(_, &q)| q).collect();
        assert!(qs.len() <= 1, "segment at {:#x} held blocks of queues {qs:?}", seg.address);
    }
}

/// Short-lived queues: raw blocks on a queue that is dropped while they are live (its
/// segments go once they are freed, and its quick table is forgotten), interleaved with a
/// long-lived queue's quick hits. Invariants and bytes hold throughout; nothing is left.
#[test]
fn raw_blocks_outliving_their_queue_are_freed_cleanly() {
    let a = allocator("", 512 * MB as u64);
    let keep = Queue::new().unwrap();
    let mut rng = Rng(0x0900_0e00);
    let mut steady: Vec<(*mut u8, usize, u8)> = Vec::new();
    for it in 0..scaled(1500) {
        let q = Queue::new().unwrap();
        let mut mine = Vec::new();
        for k in 0..(1 + rng.below(5)) {
            let n = [512, 4096, 100_000, 3 * MB][rng.below(4) as usize];
            let p = a.allocate_raw(n, Some(&q)).unwrap();
            let tag = (it as u8).wrapping_add(k as u8) | 1;
            fill(p, n.min(4096), tag);
            mine.push((p, n, tag));
        }
        // Free some while the queue lives (into its quick table), drop it, free the rest.
        let first = mine.len() / 2;
        for (p, n, tag) in mine.drain(..first) {
            assert_intact(p, n.min(4096), tag, "before the queue goes");
            a.free_raw(p).unwrap();
        }
        let n = [512, 4096][rng.below(2) as usize];
        let s = a.allocate_raw(n, Some(&keep)).unwrap();
        fill(s, n, 0x77);
        steady.push((s, n, 0x77));
        drop(q);
        for (p, n, tag) in mine {
            assert_intact(p, n.min(4096), tag, "after its queue went");
            a.free_raw(p).unwrap();
            // A double free: refused whatever became of the block. A gone queue's frees flush
            // its quick table (so the block may have merged into a free neighbour), and the
            // last block of a segment lets the segment go (the address is foreign then).
            let why = refusal(a.free_raw(p), p);
            assert!([DOUBLE, INTERIOR, FOREIGN].contains(&why), "{p:p}: {why}");
        }
        if steady.len() > 8 {
            let (p, n, tag) = steady.remove(0);
            assert_intact(p, n, tag, "the long-lived queue's block");
            a.free_raw(p).unwrap();
        }
        if it % 100 == 0 {
            a.check_invariants().unwrap_or_else(|e| panic!("iteration {it}: {e}"));
        }
    }
    for (p, n, tag) in steady {
        assert_intact(p, n, tag, "at the end");
        a.free_raw(p).unwrap();
    }
    a.check_invariants().unwrap();
    let s = a.stats();
    assert_consistent(&s, true);
    assert_eq!(s.allocation[AGGREGATE].current, 0);
    a.empty_cache();
    assert_eq!(a.stats().reserved_bytes[AGGREGATE].current, 0);
}

/// Waits (bounded) until no free is pending: the completion hooks have been applied.
fn wait_no_pending(a: &CachingAllocator) -> DeviceStats {
    let start = Instant::now();
    loop {
        let s = a.stats();
        if s.active[AGGREGATE].current == s.allocation[AGGREGATE].current {
            return s;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "a deferred free never completed: {:?}", s.active);
        std::thread::yield_now();
    }
}

/// A raw block used on another queue (`record_queue_raw`) and freed waits for that queue: a
/// second free, a `record_queue_raw` and a `raw_size` are refused with that reason, and no
/// allocation of the same size on its queue (here or on racing threads) gets it until the other
/// queue passes the point of the free; then it is reused.
#[test]
fn a_deferred_raw_free_is_not_reused_before_the_other_queue_passes() {
    let a = allocator("", 512 * MB as u64);
    let qa = Arc::new(Queue::new().unwrap());
    let qb = Queue::new().unwrap();
    let pending_p = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Arc::new(AtomicUsize::new(0));
    let n = 4096;
    let helpers: Vec<_> = (0..2)
        .map(|t| {
            let (a, qa, pending_p, stop, started) =
                (a.clone(), Arc::clone(&qa), Arc::clone(&pending_p), Arc::clone(&stop), Arc::clone(&started));
            std::thread::spawn(move || {
                let mut got = 0u64;
                while !stop.load(Ordering::Acquire) {
                    let x = a.allocate_raw(n, Some(&qa)).unwrap();
                    let pp = pending_p.load(Ordering::Acquire);
                    assert_ne!(x as usize, pp, "helper {t} was handed a block whose free waits for another queue");
                    fill(x, n, 0x30 + t as u8);
                    assert_intact(x, n, 0x30 + t as u8, "a helper's block");
                    a.free_raw(x).unwrap();
                    got += 1;
                    if got == 1 {
                        started.fetch_add(1, Ordering::Release);
                    }
                }
                got
            })
        })
        .collect();
    // The helpers race the loop below from its first iteration: it starts once both have
    // been served once (or one of them stopped, whose panic the join below re-raises).
    while started.load(Ordering::Acquire) < 2 && !helpers.iter().any(|h| h.is_finished()) {
        std::thread::yield_now();
    }
    for it in 0..scaled(400) {
        let p = a.allocate_raw(n, Some(&qa)).unwrap();
        fill(p, n, 0xee);
        let gate = QueueGate::close(&qb);
        a.record_queue_raw(p, &qb).unwrap();
        pending_p.store(p as usize, Ordering::Release);
        a.free_raw(p).unwrap();
        assert_refused(a.free_raw(p), p, WAITING);
        let r = a.record_queue_raw(p, &qb);
        assert!(matches!(r, Err(Error::InvalidFree { why: WAITING, .. })), "{r:?}");
        assert!(a.raw_size(p).is_err());
        for _ in 0..4 {
            let x = a.allocate_raw(n, Some(&qa)).unwrap();
            assert_ne!(x, p, "iteration {it}: the pending block was handed out");
            a.free_raw(x).unwrap();
        }
        let s = a.stats();
        assert_consistent(&s, false);
        assert!(s.active[AGGREGATE].current > s.allocation[AGGREGATE].current, "iteration {it}: {s:?}");
        pending_p.store(0, Ordering::Release);
        gate.open();
        qb.synchronize().unwrap();
        wait_no_pending(&a);
        if it % 50 == 0 {
            a.check_invariants().unwrap_or_else(|e| panic!("iteration {it}: {e}"));
        }
    }
    stop.store(true, Ordering::Release);
    for h in helpers {
        assert!(h.join().unwrap() > 0);
    }
    a.check_invariants().unwrap();
    let s = wait_no_pending(&a);
    assert_consistent(&s, true);
    assert_eq!(s.allocation[AGGREGATE].current, 0);
    assert_eq!(s.active_bytes[AGGREGATE].current, 0);
}

/// `empty_cache` (and the invariant walk) in a loop, without pause, while threads churn raw
/// blocks and `Allocation`s of colliding sizes: no live block loses a byte, the invariants
/// hold at every check, and everything goes back at the end.
#[test]
fn empty_cache_during_concurrent_raw_frees() {
    for conf in CONFS {
        let a = allocator(conf, 512 * MB as u64);
        let stop = Arc::new(AtomicBool::new(false));
        let threads = 3;
        // The workers start once the cleaner has emptied the cache once (without it, fast
        // workers could finish before the cleaner ran at all, and the race was not tested).
        let started = Arc::new(Barrier::new(threads + 1));
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let (a, started) = (a.clone(), Arc::clone(&started));
                std::thread::spawn(move || {
                    started.wait();
                    let mut rng = Rng(0x0e3c_0000 + 7 * t as u64);
                    let mut raws: Vec<(*mut u8, usize, u8)> = Vec::new();
                    let mut objs = Vec::new();
                    for it in 0..scaled(8000) {
                        let n = sizes(&mut rng);
                        let tag = (t as u8 * 80).wrapping_add(it as u8) | 1;
                        match rng.below(4) {
                            0 if raws.len() < 10 => {
                                let p = a.allocate_raw(n, None).unwrap();
                                fill(p, n.min(4096), tag);
                                raws.push((p, n, tag));
                            }
                            1 if objs.len() < 10 => objs.push(a.allocate(n, None).unwrap()),
                            2 if !raws.is_empty() => {
                                let (p, n, tag) = raws.swap_remove(rng.below(raws.len() as u64) as usize);
                                assert_intact(p, n.min(4096), tag, conf);
                                a.free_raw(p).unwrap();
                                // One byte in: inside the block just freed (cached or merged),
                                // or in no segment if `empty_cache` released it at once.
                                let q = p.wrapping_add(1);
                                let why = refusal(a.free_raw(q), q);
                                assert!([INTERIOR, FOREIGN].contains(&why), "{conf}: {q:p}: {why}");
                            }
                            _ if !objs.is_empty() => drop(objs.swap_remove(0)),
                            _ => {}
                        }
                    }
                    for (p, n, tag) in raws {
                        assert_intact(p, n.min(4096), tag, conf);
                        a.free_raw(p).unwrap();
                    }
                })
            })
            .collect();
        let (a2, stop2) = (a.clone(), Arc::clone(&stop));
        let cleaner = std::thread::spawn(move || {
            let mut n = 0u64;
            loop {
                a2.empty_cache();
                a2.check_invariants().unwrap_or_else(|e| panic!("after empty_cache {n}: {e}"));
                assert_consistent(&a2.stats(), true);
                n += 1;
                if n == 1 {
                    started.wait();
                }
                if stop2.load(Ordering::Acquire) {
                    break;
                }
            }
            n
        });
        for h in hs {
            h.join().unwrap();
        }
        stop.store(true, Ordering::Release);
        // It emptied the cache at least once before the workers started (the barrier).
        cleaner.join().unwrap();
        a.check_invariants().unwrap();
        a.empty_cache();
        let s = a.stats();
        assert_consistent(&s, true);
        assert_eq!(s.allocation[AGGREGATE].current, 0, "{conf}");
        assert_eq!(s.reserved_bytes[AGGREGATE].current, 0, "{conf}");
    }
}

/// A plain-`Stat` model of the hot stats and the active ones: every change one at a time.
#[derive(Default)]
struct Model {
    allocation: StatArray,
    allocated_bytes: StatArray,
    requested_bytes: StatArray,
    active: StatArray,
    active_bytes: StatArray,
}

fn bump(a: &mut StatArray, pool: usize, amount: i64) {
    for i in [AGGREGATE, pool] {
        let s = &mut a[i];
        s.current += amount;
        if amount >= 0 {
            s.allocated += amount;
            s.peak = s.peak.max(s.current);
        } else {
            s.freed -= amount;
        }
    }
}

impl Model {
    fn arrays(&mut self) -> [&mut StatArray; 5] {
        [
            &mut self.allocation,
            &mut self.allocated_bytes,
            &mut self.requested_bytes,
            &mut self.active,
            &mut self.active_bytes,
        ]
    }
    fn alloc(&mut self, n: usize) {
        let pool = if rounded(n) <= MB { SMALL_POOL } else { LARGE_POOL };
        bump(&mut self.allocation, pool, 1);
        bump(&mut self.allocated_bytes, pool, rounded(n) as i64);
        bump(&mut self.requested_bytes, pool, n as i64);
        bump(&mut self.active, pool, 1);
        bump(&mut self.active_bytes, pool, rounded(n) as i64);
    }
    /// The caller lets go; `done`: the block is no longer active either.
    fn free_request(&mut self, n: usize) {
        let pool = if rounded(n) <= MB { SMALL_POOL } else { LARGE_POOL };
        bump(&mut self.allocation, pool, -1);
        bump(&mut self.allocated_bytes, pool, -(rounded(n) as i64));
        bump(&mut self.requested_bytes, pool, -(n as i64));
    }
    fn complete(&mut self, n: usize) {
        let pool = if rounded(n) <= MB { SMALL_POOL } else { LARGE_POOL };
        bump(&mut self.active, pool, -1);
        bump(&mut self.active_bytes, pool, -(rounded(n) as i64));
    }
    fn reset_peak(&mut self) {
        self.arrays().into_iter().flatten().for_each(|s| s.peak = s.current);
    }
    fn reset_accumulated(&mut self) {
        self.arrays().into_iter().flatten().for_each(|s| (s.allocated, s.freed) = (0, 0));
    }
    #[track_caller]
    fn check(&self, s: &DeviceStats, step: usize) {
        let pairs: [(&str, &StatArray, &StatArray); 5] = [
            ("allocation", &self.allocation, &s.allocation),
            ("allocated_bytes", &self.allocated_bytes, &s.allocated_bytes),
            ("requested_bytes", &self.requested_bytes, &s.requested_bytes),
            ("active", &self.active, &s.active),
            ("active_bytes", &self.active_bytes, &s.active_bytes),
        ];
        for (name, want, have) in pairs {
            let label = ["all", "small", "large"];
            for i in 0..3 {
                let (w, h): (Stat, Stat) = (want[i], have[i]);
                assert_eq!(h, w, "step {step}: {name}.{}: stats {h:?}, model {w:?}", label[i]);
            }
        }
    }
}

/// The stats against a plain model through raw and RAII allocations and frees (quick hits and
/// misses, small and large pools), deferred frees (active above allocated), and resets of the
/// peaks and of the totals at any point, deferred frees pending included.
#[test]
fn stats_match_a_model_through_resets_and_deferred_frees() {
    let a = allocator("", 1024 * MB as u64);
    let qa = Queue::new().unwrap();
    let qb = Queue::new().unwrap();
    let mut m = Model::default();
    let mut rng = Rng(0x57a7_5000);
    let mut raws: Vec<(*mut u8, usize)> = Vec::new();
    let mut objs = Vec::new();
    let mut gated: Option<(QueueGate, Vec<usize>)> = None;
    for step in 0..scaled(30_000) {
        let n = match rng.below(4) {
            0 => 1 + rng.below(3000) as usize,
            1 => [512, 4096, 8192][rng.below(3) as usize],
            2 => MB + 1 + rng.below(3 * MB as u64) as usize,
            _ => 4 * MB,
        };
        match rng.below(12) {
            0..=2 if raws.len() < 40 => {
                let p = a.allocate_raw(n, Some(&qa)).unwrap();
                m.alloc(n);
                raws.push((p, n));
            }
            3..=4 if objs.len() < 40 => {
                objs.push((a.allocate(n, Some(&qa)).unwrap(), n));
                m.alloc(n);
            }
            5..=6 if !raws.is_empty() => {
                let (p, n) = raws.swap_remove(rng.below(raws.len() as u64) as usize);
                a.free_raw(p).unwrap();
                m.free_request(n);
                m.complete(n);
            }
            7 if !objs.is_empty() => {
                let (x, n) = objs.swap_remove(rng.below(objs.len() as u64) as usize);
                drop(x);
                m.free_request(n);
                m.complete(n);
            }
            8 if !raws.is_empty() || !objs.is_empty() => {
                // A deferred free: used on qb, whose queue is held by a gate.
                let (_, done) = gated.get_or_insert_with(|| (QueueGate::close(&qb), Vec::new()));
                if !raws.is_empty() && rng.below(2) == 0 {
                    let (p, n) = raws.swap_remove(0);
                    a.record_queue_raw(p, &qb).unwrap();
                    a.free_raw(p).unwrap();
                    m.free_request(n);
                    done.push(n);
                } else if !objs.is_empty() {
                    let (mut x, n) = objs.swap_remove(0);
                    x.record_queue(&qb);
                    drop(x);
                    m.free_request(n);
                    done.push(n);
                }
            }
            9 if step % 3 == 0 => {
                a.reset_peak_stats();
                m.reset_peak();
            }
            10 if step % 3 == 0 => {
                a.reset_accumulated_stats();
                m.reset_accumulated();
            }
            11 if gated.is_some() && rng.below(4) == 0 => {
                let (gate, done) = gated.take().unwrap();
                gate.open();
                qb.synchronize().unwrap();
                wait_no_pending(&a);
                for n in done {
                    m.complete(n);
                }
            }
            _ => {}
        }
        m.check(&a.stats(), step);
        if step % 2000 == 0 {
            a.check_invariants().unwrap_or_else(|e| panic!("step {step}: {e}"));
        }
    }
    if let Some((gate, done)) = gated.take() {
        gate.open();
        qb.synchronize().unwrap();
        wait_no_pending(&a);
        for n in done {
            m.complete(n);
        }
    }
    for (p, n) in raws {
        a.free_raw(p).unwrap();
        m.free_request(n);
        m.complete(n);
    }
    for (x, n) in objs {
        drop(x);
        m.free_request(n);
        m.complete(n);
    }
    m.check(&a.stats(), usize::MAX);
    a.check_invariants().unwrap();
}

/// Stats read, and peaks and totals reset, from one thread while others churn: every reading
/// is consistent (aggregate = sum of pools, peaks at or above current values, the aggregate
/// peak between the pools' largest and their sum); without accumulated resets the totals add
/// up to the current values exactly.
#[test]
fn stats_stay_consistent_under_concurrent_resets() {
    let a = allocator("", 1024 * MB as u64);
    for phase in 0..2 {
        let stop = Arc::new(AtomicBool::new(false));
        let hs: Vec<_> = (0..3)
            .map(|t| {
                let a = a.clone();
                std::thread::spawn(move || {
                    let mut rng = Rng(0x7e57_0000 + t as u64 + 100 * phase);
                    let mut raws = Vec::new();
                    let mut objs = Vec::new();
                    for _ in 0..scaled(15_000) {
                        let n = sizes(&mut rng);
                        match rng.below(4) {
                            0 if raws.len() < 20 => raws.push(a.allocate_raw(n, None).unwrap()),
                            1 if objs.len() < 20 => objs.push(a.allocate(n, None).unwrap()),
                            2 if !raws.is_empty() => a.free_raw(raws.swap_remove(0)).unwrap(),
                            _ if !objs.is_empty() => drop(objs.swap_remove(0)),
                            _ => {}
                        }
                    }
                    for p in raws {
                        a.free_raw(p).unwrap();
                    }
                })
            })
            .collect();
        let (a2, stop2) = (a.clone(), Arc::clone(&stop));
        let reader = std::thread::spawn(move || {
            let mut k = 0u64;
            while !stop2.load(Ordering::Acquire) {
                if k % 3 == 0 {
                    a2.reset_peak_stats();
                }
                if phase == 1 && k % 5 == 0 {
                    a2.reset_accumulated_stats();
                }
                assert_consistent(&a2.stats(), phase == 0);
                k += 1;
            }
        });
        for h in hs {
            h.join().unwrap();
        }
        stop.store(true, Ordering::Release);
        reader.join().unwrap();
        a.check_invariants().unwrap();
        let s = a.stats();
        assert_consistent(&s, phase == 0);
        assert_eq!(s.allocation[AGGREGATE].current, 0);
        a.reset_accumulated_stats();
    }
}

/// The C ABI from several threads: allocations and frees of the same sizes, with NULL,
/// interior, foreign (heap) and double frees thrown in; each refused free returns
/// `DMABUF_RT_INVALID_POINTER` with a last error naming the function and the real reason;
/// live blocks keep their bytes; the device's stats end where they began.
#[test]
fn c_abi_hostile_frees_from_many_threads() {
    use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;
    use dmabuf_rt::ffi::capi::*;
    use std::ffi::{CStr, c_void};

    static ENV: std::sync::Once = std::sync::Once::new();
    ENV.call_once(|| {
        // SAFETY: only this test uses the C runtime in this binary, and the runtime reads its
        // environment on its first call, after this; the other tests read no environment.
        unsafe { std::env::set_var("DMABUF_RT_DEVICES", "shmem") };
        // SAFETY: as above.
        unsafe { std::env::set_var("DMABUF_RT_CAPACITY", "512M") };
    });
    fn last_error() -> String {
        let p = dmabuf_rt_last_error();
        assert!(!p.is_null(), "no last error after a failure");
        // SAFETY: a non-null last error is a NUL-terminated string valid until this thread's
        // next failing call.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
    #[track_caller]
    fn refused(p: *mut c_void, want: &str) {
        let s = dmabuf_rt_device_free(0, p);
        assert_eq!(s, DMABUF_RT_INVALID_POINTER, "free of {p:p}");
        let why = last_error();
        assert!(why.starts_with("dmabuf_rt_device_free: "), "`{why}` does not name the function");
        assert!(why.contains(want), "free of {p:p}: `{why}` does not say `{want}`");
    }
    fn stats() -> dmabuf_rt_stats {
        let mut s = dmabuf_rt_stats::default();
        // SAFETY: `s` is a valid out-pointer.
        assert_eq!(unsafe { dmabuf_rt_device_stats(0, &mut s) }, DMABUF_RT_OK);
        s
    }
    let before = stats();
    let hs: Vec<_> = (0..4)
        .map(|t| {
            std::thread::spawn(move || {
                let mut rng = Rng(0x0cab_1000 + t);
                let heap = vec![0u8; 256];
                let mut live: Vec<(*mut c_void, usize, u8)> = Vec::new();
                for it in 0..scaled(6000) {
                    let tag = (t as u8 * 60).wrapping_add(it as u8) | 1;
                    match rng.below(7) {
                        0..=2 if live.len() < 8 => {
                            let n = [512, 1000, 4096, 2 * MB][rng.below(4) as usize];
                            let mut p = std::ptr::null_mut();
                            // SAFETY: `p` is a valid out-pointer.
                            let s = unsafe { dmabuf_rt_device_alloc(0, n, &mut p) };
                            assert_eq!(s, DMABUF_RT_OK, "{}", last_error());
                            fill(p.cast(), n, tag);
                            live.push((p, n, tag));
                        }
                        0..=3 if !live.is_empty() => {
                            let (p, n, tag) = live.swap_remove(rng.below(live.len() as u64) as usize);
                            assert_intact(p.cast(), n, tag, "C block");
                            assert_eq!(dmabuf_rt_device_free(0, p), DMABUF_RT_OK, "{}", last_error());
                        }
                        4 if !live.is_empty() => {
                            let (p, n, _) = live[rng.below(live.len() as u64) as usize];
                            refused(p.cast::<u8>().wrapping_add(1 + rng.below(n as u64 - 1) as usize).cast(), INTERIOR);
                        }
                        5 => refused(std::ptr::null_mut(), "null"),
                        _ => refused(heap.as_ptr().cast_mut().cast(), FOREIGN),
                    }
                }
                for (p, n, tag) in live {
                    assert_intact(p.cast(), n, tag, "C block at the end");
                    assert_eq!(dmabuf_rt_device_free(0, p), DMABUF_RT_OK);
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    // Threads race to free one pointer: one free wins, the others are refused as double frees.
    let threads = 4;
    let iters = scaled(1500);
    let slot = Arc::new(AtomicUsize::new(0));
    let wins: Arc<Vec<AtomicU8>> = Arc::new((0..iters).map(|_| AtomicU8::new(0)).collect());
    let bar = Arc::new(Barrier::new(threads));
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let (slot, wins, bar) = (Arc::clone(&slot), Arc::clone(&wins), Arc::clone(&bar));
            std::thread::spawn(move || {
                for it in 0..iters {
                    if t == 0 {
                        let mut p = std::ptr::null_mut();
                        // SAFETY: `p` is a valid out-pointer.
                        let s = unsafe { dmabuf_rt_device_alloc(0, 512 * (1 + it % 5), &mut p) };
                        assert_eq!(s, DMABUF_RT_OK);
                        slot.store(p as usize, Ordering::Release);
                    }
                    bar.wait();
                    let p = slot.load(Ordering::Acquire) as *mut c_void;
                    match dmabuf_rt_device_free(0, p) {
                        DMABUF_RT_OK => {
                            wins[it].fetch_add(1, Ordering::Relaxed);
                        }
                        s => {
                            assert_eq!(s, DMABUF_RT_INVALID_POINTER);
                            let why = last_error();
                            assert!(why.starts_with("dmabuf_rt_device_free: ") && why.contains(DOUBLE), "{why}");
                        }
                    }
                    bar.wait();
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    for (it, w) in wins.iter().enumerate() {
        assert_eq!(w.load(Ordering::Relaxed), 1, "iteration {it}: not exactly one C free succeeded");
    }
    let after = stats();
    assert_eq!(after.allocations, before.allocations);
    assert_eq!(after.allocated_bytes, before.allocated_bytes);
    assert_eq!(after.requested_bytes, before.requested_bytes);
    assert_eq!(after.num_allocs - before.num_allocs, after.num_frees - before.num_frees);
}

/// A sized free (the Paddle plugin's path) checks the size and frees under one hold of the
/// lock: from several threads at once, wrong sizes of live blocks (their own, and the blocks
/// other threads are freeing and reallocating at the same addresses) are refused with the
/// block's size and the one given, free nothing, and every block's bytes stay its own; the
/// right size frees.
#[test]
fn sized_frees_check_and_free_at_once() {
    let a = Arc::new(allocator("", 256 * MB as u64));
    let threads = 4;
    let barrier = Arc::new(Barrier::new(threads));
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let (a, barrier) = (a.clone(), barrier.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(0x51ce + t as u64);
                barrier.wait();
                for i in 0..scaled(20_000) {
                    // Sizes shared across threads, so addresses are reused between them.
                    let n = 512 * (1 + rng.below(4) as usize);
                    let p = a.allocate_raw(n, None).unwrap();
                    let tag = ((i % 127) as u8) << 1 | 1;
                    fill(p, n, tag);
                    let wrong = n + 512 * (1 + rng.below(3) as usize);
                    match a.free_raw_sized(p, wrong) {
                        Err(Error::SizeMismatch { dst, src }) => assert_eq!((dst, src), (n, wrong)),
                        other => panic!("a wrong size freed or failed otherwise: {other:?}"),
                    }
                    assert_intact(p, n, tag, "after a refused sized free");
                    assert_eq!(a.raw_size(p).unwrap(), n, "the refused free left the block live");
                    a.free_raw_sized(p, n).unwrap();
                    // (A second free here could land on another thread's new block at the same
                    // address: no address-only API can tell; double frees are tested alone.)
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    a.check_invariants().unwrap();
    let s = a.stats();
    assert_eq!((s.allocation[AGGREGATE].current, s.allocated_bytes[AGGREGATE].current), (0, 0));
    assert!(matches!(a.free_raw_sized(std::ptr::null_mut(), 512), Err(Error::InvalidFree { ptr: 0, .. })));
    let p = a.allocate_raw(1000, None).unwrap();
    a.free_raw_sized(p, 1000).unwrap();
    assert_refused(a.free_raw_sized(p, 1000), p, "already freed (double free)");
}

/// The lib test `caching::tests::drops_race_allocations_and_raw_frees` with every block tagged
/// at both ends, over many fresh allocators: owned blocks dropped by their owner (the owner's
/// fast hold, `try_lock`, or the dropped list) race raw allocations and frees and stats on
/// three threads, and each thread's last blocks are dropped by another. A block handed to two
/// owners at once shows as a lost tag; a free accounted with the wrong request shows in the
/// settled stats. (The lib test failed once in the kernel lane's emulated machine with the
/// requested bytes 4096 above what the blocks held, every other count right: what a block
/// handed out twice and freed twice leaves. Not reproduced since: 2,514 runs of that test and
/// 41 of its whole binary in the emulated machine, 4,100 runs and 3,000 rounds of this one on
/// the host.)
#[test]
fn drops_and_raw_frees_racing_hand_no_block_to_two_owners() {
    const THREADS: usize = 3;
    let (rounds, each) = (scaled(20), 2000);
    for round in 0..rounds {
        for conf in ["expandable_segments:False", "page_stitching:True"] {
            let a = Arc::new(allocator(conf, 256 * MB as u64));
            std::thread::scope(|s| {
                for t in 0..THREADS {
                    let a = Arc::clone(&a);
                    s.spawn(move || {
                        let mut live: Vec<Live> = Vec::new();
                        let mut raw: Vec<Raw> = Vec::new();
                        for i in 0..each {
                            let size = [4096, 512, 96 * KB, 4096, MB][(i + t) % 5];
                            if t == 0 && i % 2 == 0 {
                                raw.push(Raw::new(a.allocate_raw(size, None).unwrap(), size));
                            } else {
                                live.push(Live::new(a.allocate(size, None).unwrap()));
                            }
                            if i % 3 != 0
                                && let Some(l) = live.pop()
                            {
                                l.check("an owned block freed at once");
                            }
                            if live.len() > 16 {
                                live.swap_remove(i % live.len()).check("an owned block freed later");
                            }
                            if raw.len() > 4 {
                                let r = raw.swap_remove(i % raw.len());
                                r.check("a raw block");
                                a.free_raw(r.p as *mut u8).unwrap();
                            }
                            if i % 257 == 0 {
                                let _ = a.stats();
                            }
                        }
                        for r in raw {
                            r.check("a raw block at the end");
                            a.free_raw(r.p as *mut u8).unwrap();
                        }
                        // The rest is dropped on another thread (no fast hold there).
                        std::thread::spawn(move || {
                            for l in &live {
                                l.check("an owned block dropped by another thread");
                            }
                            drop(live);
                        })
                        .join()
                        .unwrap();
                    });
                }
            });
            settled(&a, &format!("{conf}, round {round}"));
        }
    }
}
