//! The 25th hostile review: commit c45c2e6, the pool's biased lock (`caching/pool_lock.rs`).
//! A thread that takes the pool's mutex 64 times in a row becomes the owner; its quick-cache
//! hits and frees then run in a "fast hold" (a plain `busy` store, a compiler fence, an owner
//! re-check) with no atomic read-modify-write; any other thread's `lock()` revokes with
//! `membarrier(PRIVATE_EXPEDITED)` and waits for `busy` to clear.
//!
//! Results on c45c2e6: two tests fail.
//! - `owner_reenters_pool_from_source_while_holding_mutex`: a BUG (soundness): `PoolLock::fast`
//!   hands the owner thread a second guard while that same thread holds the pool by the mutex
//!   (`lock()`), reachable from safe code through a `MemorySource` (or any user code that runs
//!   under the pool's lock) that drops an `Allocation` or calls the allocator. Passes on the
//!   parent commit (there the nested call self-deadlocks, the nested drop goes to the free
//!   list), and with the scratch fix in `scratch-fix-pool_lock.diff` (the owner marks `busy`
//!   while it holds the mutex; `fast` refuses when `busy` is already set).
//! - `seccomp_refusing_membarrier_after_bias`: a documented-but-contradicted behaviour: the
//!   module doc says the lock is the mutex "where membarrier is missing (... seccomp)", but
//!   a filter installed after the first bias makes the next revocation abort the process.
//!
//! Every test builds a fresh allocator per round where it needs the bias: each revocation
//! doubles the run the next bias needs, so a long-lived allocator under contention stops
//! being biased after a dozen revocations and would test only the mutex.

#![allow(unsafe_code)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use common::tags::{Live, Raw, settled};
use common::wait::{wait_until, within};
use common::{Rng, become_owner, scaled};
use dmabuf_rt::caching::stats::AGGREGATE;
use dmabuf_rt::caching::{Allocation, CachingAllocator, Config};
use dmabuf_rt::error::Result as DResult;
use dmabuf_rt::queue::Queue;
use dmabuf_rt::segment::{Segment, SegmentKind};
use dmabuf_rt::source::{MemorySource, ShmemSource};

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;
/// The bound on each race's run (a hang detector): 30 s, times the stress time scale (the
/// kernel lane's emulated machine is several times slower and shares its two vCPUs).
fn limit() -> Duration {
    Duration::from_secs(30) * common::time_scale()
}

const CONFIGS: &[&str] = &[
    "expandable_segments:False",
    "expandable_segments:True",
    "expandable_segments:True,page_stitching:True",
    "expandable_segments:True,page_stitching:True,max_split_size_mb:32,garbage_collection_threshold:0.5",
];

fn alloc(conf: &str) -> CachingAllocator {
    common::allocator(conf, 4 << 30)
}

// ---------------------------------------------------------------------------------------------
// 1. The same raw pointer freed by the owner (fast path) and by several other threads (which
//    revoke) at once: exactly one free succeeds, every other is refused; the block's bytes are
//    never handed out twice.
// ---------------------------------------------------------------------------------------------
#[test]
fn racing_frees_of_one_pointer_owner_fast_vs_revokers() {
    within("racing frees", limit(), || {
        for conf in CONFIGS {
            for round in 0..scaled(60) {
                let a = alloc(conf);
                become_owner(&a);
                let n = if round % 3 == 0 { 512 } else { 4 * KB };
                let m_size0 = if n == 512 { 1024 } else { 8 * KB };
                let mut mine: Vec<Raw> =
                    (0..8).map(|_| Raw::new(a.allocate_raw(m_size0, None).unwrap(), m_size0)).collect();
                let p = a.allocate_raw(n, None).unwrap();
                let r = Raw::new(p, n);
                let go = Arc::new(Barrier::new(4));
                let oks = Arc::new(AtomicUsize::new(0));
                let hs: Vec<_> = (0..3)
                    .map(|t| {
                        let (a, go, oks) = (a.clone(), go.clone(), oks.clone());
                        std::thread::spawn(move || {
                            go.wait();
                            let res =
                                if t == 0 { a.free_raw(r.p as *mut u8) } else { a.free_raw_sized(r.p as *mut u8, n) };
                            if res.is_ok() {
                                oks.fetch_add(1, Ordering::SeqCst);
                            }
                        })
                    })
                    .collect();
                go.wait();
                // The owner frees too (fast path while the others revoke), and keeps cycling
                // blocks of another size through the quick cache (LIFO per size: never `p`)
                // with fresh tags: a free applied twice would show as two live blocks sharing
                // bytes, or as a second success.
                if a.free_raw(p).is_ok() {
                    oks.fetch_add(1, Ordering::SeqCst);
                }
                let m_size = if n == 512 { 1024 } else { 8 * KB };
                for _ in 0..64 {
                    for m in mine.iter_mut() {
                        let m: &mut Raw = m;
                        m.check("owner's cycling block");
                        a.free_raw(m.p as *mut u8).unwrap();
                        let q = a.allocate_raw(m_size, None).unwrap();
                        *m = Raw::new(q, m_size);
                    }
                }
                for h in hs {
                    h.join().unwrap();
                }
                for m in &mine {
                    m.check("owner's block after racing frees");
                }
                assert_eq!(oks.load(Ordering::SeqCst), 1, "{conf} round {round}: frees of one pointer that succeeded");
                let uniq: std::collections::HashSet<usize> = mine.iter().map(|m| m.p).collect();
                assert_eq!(uniq.len(), mine.len(), "{conf}: one address handed out twice");
                for m in mine {
                    a.free_raw(m.p as *mut u8).unwrap();
                }
                settled(&a, conf);
            }
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 2. An owner with a long streak of quick-cache pairs (RAII and raw) against threads that hit
//    every other entry point, drop the owner's blocks, free foreign and already freed
//    pointers, and queue callbacks that drop blocks.
// ---------------------------------------------------------------------------------------------
#[test]
fn owner_streaks_race_every_entry_point() {
    within("owner streaks", limit() * 2, || {
        let foreign = alloc("expandable_segments:False");
        let fp = foreign.allocate_raw(4 * KB, None).unwrap() as usize;
        for (ci, conf) in CONFIGS.iter().enumerate() {
            for round in 0..scaled(6) {
                let a = alloc(conf);
                let qs: Arc<Vec<Queue>> = Arc::new((0..2).map(|_| Queue::new().unwrap()).collect());
                become_owner(&a);
                let stop = Arc::new(AtomicBool::new(false));
                // Blocks the owner hands to other threads to drop or free.
                let (tx, rx) = std::sync::mpsc::channel::<Live>();
                let (rtx, rrx) = std::sync::mpsc::channel::<Raw>();
                let rx = Arc::new(Mutex::new(rx));
                let rrx = Arc::new(Mutex::new(rrx));
                // Pointers already freed (by the owner): freeing them again must be refused
                // unless handed out again meanwhile, which only the owner does, so the test
                // only frees them again while the owner is parked at `park`.
                let freed: Arc<Mutex<Vec<usize>>> = Arc::new(Mutex::new(Vec::new()));
                let start = Arc::new(Barrier::new(5));
                let mut hs = Vec::new();
                for t in 0..4u64 {
                    let (a, qs, stop, rx, rrx, start) =
                        (a.clone(), qs.clone(), stop.clone(), rx.clone(), rrx.clone(), start.clone());
                    hs.push(std::thread::spawn(move || {
                        let mut rng = Rng(0xABCD ^ ((t + 1) * 0x9E37_79B9) ^ ((ci as u64) << 20) ^ round as u64);
                        start.wait();
                        let mut i = 0u64;
                        while !stop.load(Ordering::Relaxed) {
                            i += 1;
                            // Spread out: the owner must get runs in between.
                            for _ in 0..rng.below(2000) {
                                std::hint::spin_loop();
                            }
                            match rng.below(16) {
                                0 => {
                                    let x = rx.lock().unwrap().try_recv();
                                    if let Ok(x) = x {
                                        x.check("handed to another thread");
                                        drop(x);
                                    }
                                }
                                1 => {
                                    let r = rrx.lock().unwrap().try_recv();
                                    if let Ok(r) = r {
                                        r.check("raw handed over");
                                        if rng.below(2) == 0 {
                                            a.free_raw(r.p as *mut u8).unwrap();
                                        } else {
                                            a.free_raw_sized(r.p as *mut u8, r.n).unwrap();
                                        }
                                        // (No immediate second free here: the owner may be handed
                                        // the address again at once, legitimately.)
                                    }
                                }
                                2 => {
                                    let s = a.stats();
                                    assert!(s.allocation[AGGREGATE].current >= 0);
                                }
                                3 => {
                                    let _ = a.snapshot();
                                }
                                4 if i % 8 == 0 => a.empty_cache(),
                                5 => a.record_history(rng.below(2) == 0),
                                6 => a.set_memory_fraction(if rng.below(2) == 0 { 0.9 } else { 1.0 }).unwrap(),
                                7 => a.check_invariants().unwrap_or_else(|e| panic!("invariants: {e}")),
                                8 => {
                                    assert!(a.free_raw(fp as *mut u8).is_err(), "foreign pointer accepted");
                                    assert!(a.free_raw(0x1000 as *mut u8).is_err());
                                }
                                9 => {
                                    // A callback on a queue that drops a block of this
                                    // allocator (on the executor thread).
                                    let q = &qs[rng.below(2) as usize];
                                    let x = Live::new(a.allocate(4 * KB, Some(q)).unwrap());
                                    q.callback(move |_| {
                                        x.check("in callback");
                                        drop(x);
                                    })
                                    .unwrap();
                                }
                                10 => {
                                    // record_queue then drop: a deferred free.
                                    let mut x = Live::new(a.allocate(8 * KB, None).unwrap());
                                    x.a.record_queue(&qs[0]);
                                    x.check("recorded");
                                }
                                _ => {
                                    let n = [512, 4 * KB, 64 * KB, 2 * MB][rng.below(4) as usize];
                                    let p = a.allocate_raw(n, None).unwrap();
                                    let r = Raw::new(p, n);
                                    let x = Live::new(a.allocate(n, None).unwrap());
                                    r.check("other raw");
                                    x.check("other");
                                    a.free_raw(p).unwrap();
                                }
                            }
                        }
                    }));
                }
                start.wait();
                // The owner: long streaks of quick pairs, with stamps.
                let mut rng = Rng(0x5151 ^ round as u64);
                let mut keep: Vec<Live> = Vec::new();
                let mut rkeep: Vec<Raw> = Vec::new();
                for i in 0..scaled(40_000) {
                    let n = [512, 1024, 4 * KB][rng.below(3) as usize];
                    if i % 2 == 0 {
                        let x = Live::new(a.allocate(n, None).unwrap());
                        if rng.below(64) == 0 {
                            let _ = tx.send(x);
                        } else if rng.below(16) == 0 {
                            keep.push(x);
                        } else {
                            x.check("owner");
                        }
                    } else {
                        let p = a.allocate_raw(n, None).unwrap();
                        let r = Raw::new(p, n);
                        if rng.below(64) == 0 {
                            let _ = rtx.send(r);
                        } else if rng.below(16) == 0 {
                            rkeep.push(r);
                        } else {
                            r.check("owner raw");
                            a.free_raw(p).unwrap();
                            if rng.below(128) == 0 {
                                freed.lock().unwrap().push(p as usize);
                            }
                        }
                    }
                    if keep.len() > 32 {
                        for k in keep.drain(..) {
                            k.check("kept");
                        }
                    }
                    if rkeep.len() > 32 {
                        for r in rkeep.drain(..) {
                            r.check("raw kept");
                            a.free_raw(r.p as *mut u8).unwrap();
                        }
                    }
                }
                stop.store(true, Ordering::Relaxed);
                for h in hs {
                    h.join().unwrap();
                }
                for k in keep.drain(..) {
                    k.check("kept at end");
                }
                for r in rkeep.drain(..) {
                    r.check("raw kept at end");
                    a.free_raw(r.p as *mut u8).unwrap();
                }
                drop(tx);
                drop(rtx);
                while let Ok(x) = rx.lock().unwrap().try_recv() {
                    x.check("leftover");
                }
                while let Ok(r) = rrx.lock().unwrap().try_recv() {
                    r.check("leftover raw");
                    a.free_raw(r.p as *mut u8).unwrap();
                }
                // Every pointer the owner freed and nobody holds now: a second free from
                // several threads at once is refused (nothing is live: the owner is done).
                let freed = std::mem::take(&mut *freed.lock().unwrap());
                let freed = Arc::new(freed);
                let hs: Vec<_> = (0..3)
                    .map(|_| {
                        let (a, freed) = (a.clone(), freed.clone());
                        std::thread::spawn(move || {
                            for &p in freed.iter() {
                                assert!(a.free_raw(p as *mut u8).is_err(), "double free of {p:#x} accepted");
                            }
                        })
                    })
                    .collect();
                for h in hs {
                    h.join().unwrap();
                }
                for q in qs.iter() {
                    q.synchronize().unwrap();
                }
                a.record_history(false);
                wait_until("frees", limit(), || a.stats().allocation[AGGREGATE].current == 0);
                settled(&a, conf);
            }
        }
        foreign.free_raw(fp as *mut u8).unwrap();
    });
}

// ---------------------------------------------------------------------------------------------
// 3. Owner changes: threads take turns being the owner (each a fresh streak after the others
//    stop), other threads revoke it at random points of a streak, and the ones who lost the
//    bias keep using their fast path attempt (must fall back to the mutex).
// ---------------------------------------------------------------------------------------------
#[test]
fn owners_take_turns_and_revokers_strike_mid_streak() {
    within("turns", limit(), || {
        for conf in CONFIGS {
            for round in 0..scaled(20) {
                let a = alloc(conf);
                let turn = Arc::new(AtomicUsize::new(0));
                let live_bytes = Arc::new(Mutex::new(std::collections::BTreeMap::<usize, usize>::new()));
                let hs: Vec<_> = (0..3usize)
                    .map(|t| {
                        let (a, turn, live_bytes) = (a.clone(), turn.clone(), live_bytes.clone());
                        std::thread::spawn(move || {
                            for step in 0..6usize {
                                let me = step * 3 + t;
                                // Wait (bounded) for this thread's turn to run a streak; the
                                // others revoke meanwhile with raw traffic.
                                let t0 = std::time::Instant::now();
                                while turn.load(Ordering::SeqCst) < me {
                                    assert!(t0.elapsed() < limit(), "turn never came");
                                    if (round + step) % 2 == 0 {
                                        let p = a.allocate_raw(2 * KB, None).unwrap();
                                        let r = Raw::new(p, 2 * KB);
                                        {
                                            let mut l = live_bytes.lock().unwrap();
                                            // No live block may start inside another one.
                                            if let Some((&s, &n)) = l.range(..=r.p).next_back() {
                                                assert!(s + n <= r.p, "block {:#x} inside live {s:#x}+{n}", r.p);
                                            }
                                            l.insert(r.p, r.n);
                                        }
                                        r.check("revoker raw");
                                        live_bytes.lock().unwrap().remove(&r.p);
                                        a.free_raw(p).unwrap();
                                    } else {
                                        std::thread::yield_now();
                                    }
                                }
                                let mut v = Vec::new();
                                for i in 0..400 {
                                    let n = if i % 5 == 0 { 1536 } else { 2 * KB };
                                    let p = a.allocate_raw(n, None).unwrap();
                                    let r = Raw::new(p, n);
                                    {
                                        let mut l = live_bytes.lock().unwrap();
                                        if let Some((&s, &len)) = l.range(..=r.p).next_back() {
                                            assert!(s + len <= r.p, "block {:#x} inside live {s:#x}+{len}", r.p);
                                        }
                                        if let Some((&s, _)) = l.range(r.p..).next() {
                                            assert!(r.p + n <= s, "block {:#x}+{n} over live {s:#x}", r.p);
                                        }
                                        l.insert(r.p, n);
                                    }
                                    v.push(r);
                                    if v.len() > 4 {
                                        let r = v.remove(0);
                                        r.check("streak");
                                        live_bytes.lock().unwrap().remove(&r.p);
                                        a.free_raw(r.p as *mut u8).unwrap();
                                    }
                                }
                                for r in v {
                                    r.check("streak end");
                                    live_bytes.lock().unwrap().remove(&r.p);
                                    a.free_raw(r.p as *mut u8).unwrap();
                                }
                                turn.fetch_add(1, Ordering::SeqCst);
                            }
                        })
                    })
                    .collect();
                for h in hs {
                    h.join().unwrap();
                }
                settled(&a, conf);
            }
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 4. The owner thread exits (its token dies with it) while holding blocks; other threads drop
//    and free them, then another thread becomes the owner; blocks dropped in thread-local
//    destructors of the owner thread itself.
// ---------------------------------------------------------------------------------------------
thread_local! {
    static TLS_KEEP: std::cell::RefCell<Vec<Allocation>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[test]
fn owner_thread_exit_with_blocks_in_its_thread_locals() {
    within("owner exit", limit(), || {
        for conf in CONFIGS {
            for _ in 0..scaled(20) {
                let a = alloc(conf);
                let a2 = a.clone();
                let (handed, take) = std::sync::mpsc::channel();
                std::thread::spawn(move || {
                    become_owner(&a2);
                    let mut mine = Vec::new();
                    for _ in 0..20 {
                        mine.push(Live::new(a2.allocate(4 * KB, None).unwrap()));
                    }
                    // Dropped by the thread-local destructor, after the thread's body: the
                    // owner's token is still readable then (the token has no destructor).
                    TLS_KEEP.with(|k| {
                        for _ in 0..10 {
                            k.borrow_mut().push(a2.allocate(4 * KB, None).unwrap());
                        }
                    });
                    handed.send(mine).unwrap();
                })
                .join()
                .unwrap();
                let mine = take.recv().unwrap();
                for m in &mine {
                    m.check("from the gone owner");
                }
                drop(mine);
                // A new owner.
                become_owner(&a);
                let b = Live::new(a.allocate(4 * KB, None).unwrap());
                b.check("new owner");
                drop(b);
                settled(&a, conf);
            }
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 5. Many allocators, one thread owning all of them at once, other threads revoking each in
//    turn: a token per thread, a bias per allocator.
// ---------------------------------------------------------------------------------------------
#[test]
fn one_thread_owns_many_allocators_others_revoke_each() {
    within("many allocators", limit(), || {
        for _ in 0..scaled(5) {
            let allocs: Vec<CachingAllocator> = (0..8).map(|i| alloc(CONFIGS[i % CONFIGS.len()])).collect();
            for a in &allocs {
                become_owner(a);
            }
            let stop = Arc::new(AtomicBool::new(false));
            let hs: Vec<_> = (0..2)
                .map(|t| {
                    let (allocs, stop) = (allocs.clone(), stop.clone());
                    std::thread::spawn(move || {
                        let mut k = t;
                        while !stop.load(Ordering::Relaxed) {
                            let a = &allocs[k % allocs.len()];
                            let p = a.allocate_raw(4 * KB, None).unwrap();
                            let r = Raw::new(p, 4 * KB);
                            r.check("revoker");
                            a.free_raw(p).unwrap();
                            k += 1;
                        }
                    })
                })
                .collect();
            for i in 0..scaled(30_000) {
                let a = &allocs[i % allocs.len()];
                let p = a.allocate_raw(4 * KB, None).unwrap();
                let r = Raw::new(p, 4 * KB);
                let x = Live::new(a.allocate(4 * KB, None).unwrap());
                r.check("owner raw");
                x.check("owner");
                a.free_raw(p).unwrap();
            }
            stop.store(true, Ordering::Relaxed);
            for h in hs {
                h.join().unwrap();
            }
            for a in &allocs {
                settled(a, "many");
            }
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 6. Re-entrancy: the allocator called from inside its own memory source, on the owner
//    thread, while `allocate` holds the pool's mutex (this thread's `lock()`).
// ---------------------------------------------------------------------------------------------

/// A source that, when armed, drops allocations of its own allocator and (optionally) makes
/// a nested allocation inside `create_segment`, i.e. while the calling thread holds the pool.
#[derive(Debug)]
struct Reentrant {
    inner: ShmemSource,
    victims: Arc<Mutex<Vec<Allocation>>>,
    nested: Arc<Mutex<Option<CachingAllocator>>>,
    nested_got: Arc<Mutex<Option<Allocation>>>,
    drops_inside: Arc<AtomicUsize>,
    panic_next: Arc<AtomicBool>,
}

impl Reentrant {
    fn inside(&self) {
        if self.panic_next.swap(false, Ordering::SeqCst) {
            panic!("reentrant source panics (the pool's mutex held: poisoned)");
        }
        let victims = std::mem::take(&mut *self.victims.lock().unwrap());
        if !victims.is_empty() {
            self.drops_inside.fetch_add(1, Ordering::SeqCst);
        }
        drop(victims);
        let nested = self.nested.lock().unwrap().take();
        if let Some(a) = nested {
            // On a mutex-only lock this would self-deadlock (`allocate` takes the lock this
            // thread holds). If it returns, the pool was handed out a second time.
            let x = a.allocate(4 * KB, None).unwrap();
            *self.nested_got.lock().unwrap() = Some(x);
        }
    }
}

impl MemorySource for Reentrant {
    fn name(&self) -> String {
        "reentrant".into()
    }
    fn kind(&self) -> SegmentKind {
        self.inner.kind()
    }
    fn create_segment(&self, len: usize) -> DResult<Segment> {
        self.inside();
        self.inner.create_segment(len)
    }
    fn reserve_expandable(&self, len: usize) -> DResult<Segment> {
        self.inside();
        self.inner.reserve_expandable(len)
    }
}

struct ReentrantAlloc {
    a: CachingAllocator,
    victims: Arc<Mutex<Vec<Allocation>>>,
    nested: Arc<Mutex<Option<CachingAllocator>>>,
    nested_got: Arc<Mutex<Option<Allocation>>>,
    drops_inside: Arc<AtomicUsize>,
    panic_next: Arc<AtomicBool>,
}

fn reentrant(conf: &str) -> ReentrantAlloc {
    let victims = Arc::new(Mutex::new(Vec::new()));
    let nested = Arc::new(Mutex::new(None));
    let nested_got = Arc::new(Mutex::new(None));
    let drops_inside = Arc::new(AtomicUsize::new(0));
    let panic_next = Arc::new(AtomicBool::new(false));
    let src = Reentrant {
        panic_next: panic_next.clone(),
        inner: ShmemSource::new().reserve(false),
        victims: victims.clone(),
        nested: nested.clone(),
        nested_got: nested_got.clone(),
        drops_inside: drops_inside.clone(),
    };
    let a = CachingAllocator::builder(src).config(Config::parse(conf).unwrap()).capacity(4 << 30).build().unwrap();
    ReentrantAlloc { a, victims, nested, nested_got, drops_inside, panic_next }
}

/// BUG DEMONSTRATION (c45c2e6). `PoolLock::fast` (pool_lock.rs, `fast`) checks only that the
/// caller is the owner; it does not know whether the same thread already holds the pool by
/// `mutex` (`lock()`, `Hold::Mutex`). The owner's `lock()` does not revoke its own bias
/// (`owner != me` is false), so while the owner thread is inside `allocate`'s slow path
/// (holding the mutex guard, `&mut Pool` live) any call on the same thread that goes through
/// `fast()` gets a second `PoolGuard` — a second `&mut Pool` aliasing the first.
///
/// Here the nested call is an `allocate` from inside `MemorySource::create_segment` (the
/// memory source is a public trait; `create_segment` runs with the pool held): before the bias
/// it could only self-deadlock; on the owner thread it now returns a quick-cached block from a
/// pool that is in the middle of another allocation. The same second guard is what a plain
/// `Drop for Allocation` inside the source gets (`shared::try_lock_pool` tries `fast()` before
/// `try_lock()`), which hostile_review24's `drop_inside_source_call_with_lock_held` covers as
/// "must neither deadlock nor apply under the allocation in progress" — it still passes
/// because the aliasing has no visible effect there, but the drop is now applied under the
/// allocation in progress, through a second `&mut Pool` (undefined behaviour).
///
/// A timeout of the nested call (self-deadlock, the pre-bias behaviour) counts as a pass here:
/// the stuck thread is left behind with its allocator.
#[test]
fn owner_reenters_pool_from_source_while_holding_mutex() {
    if !common::membarrier_ok() {
        println!("SKIP: no membarrier(PRIVATE_EXPEDITED): the lock is never biased");
        return;
    }
    let r = reentrant("expandable_segments:False");
    let (a, nested, nested_got, victims) = (r.a.clone(), r.nested.clone(), r.nested_got.clone(), r.victims.clone());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        become_owner(&a);
        // Dropped inside the source (the pool's miss flushed the quick cache before it asked
        // the source): on the owner, `Drop` takes `fast()` and puts it in the quick cache,
        // where the nested allocate finds it, again through `fast()`.
        *victims.lock().unwrap() = vec![a.allocate(4 * KB, None).unwrap()];
        *nested.lock().unwrap() = Some(a.clone());
        // Needs a new segment: `create_segment` runs under this thread's `lock()`.
        let big = a.allocate(64 * MB, None).unwrap();
        let got = nested_got.lock().unwrap().take();
        let _ = tx.send(got.is_some());
        drop(got);
        drop(big);
    });
    match rx.recv_timeout(Duration::from_secs(2)) {
        Ok(second_guard) => assert!(
            !second_guard,
            "the owner thread got the pool from inside create_segment while its own allocate held the pool's \
             mutex: a second PoolGuard (two &mut Pool) — PoolLock::fast does not exclude the owner's own Hold::Mutex"
        ),
        Err(_) => println!("nested allocate blocked (self-deadlock, as with a plain mutex): no second guard"),
    }
}

/// Drops inside the source on the owner thread (the second guard of the test above, through
/// `Drop for Allocation`), many rounds: tags, invariants and exact stats afterwards. Expected
/// to pass (the aliasing is invisible here); kept as a regression net for a fix.
#[test]
fn owner_drops_inside_source_with_mutex_held() {
    within("owner drops inside source", limit(), || {
        for conf in CONFIGS {
            let r = reentrant(conf);
            let a = r.a.clone();
            let q = Queue::new().unwrap();
            become_owner(&a);
            let mut big = Vec::new();
            for round in 0..20usize {
                let v: Vec<Allocation> = (0..8).map(|_| a.allocate(4 * KB, None).unwrap()).collect();
                *r.victims.lock().unwrap() = v;
                big.push(Live::new(a.allocate(64 * MB + round * 2 * MB, Some(&q)).unwrap()));
                r.victims.lock().unwrap().clear();
                for b in &big {
                    b.check("big");
                }
                // Quick-size blocks after the inside drops: none may share bytes.
                let small: Vec<Live> = (0..16).map(|_| Live::new(a.allocate(4 * KB, None).unwrap())).collect();
                for s in &small {
                    s.check("small");
                }
                drop(small);
                a.check_invariants().unwrap_or_else(|e| panic!("{conf} round {round}: {e}"));
                if round % 4 == 3 {
                    big.clear();
                    a.empty_cache();
                }
            }
            big.clear();
            assert!(r.drops_inside.load(Ordering::SeqCst) > 0, "{conf}: never dropped inside the source");
            *r.nested.lock().unwrap() = None;
            drop(r.nested_got.lock().unwrap().take());
            q.synchronize().unwrap();
            wait_until("frees", limit(), || a.stats().allocation[AGGREGATE].current == 0);
            settled(&a, conf);
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 7. A panic inside the owner's work between fast holds (a tag check failing on purpose in a
//    callback of the owner thread) leaves the lock usable by others; a poisoned std mutex.
// ---------------------------------------------------------------------------------------------
#[test]
fn panicking_owner_thread_and_poisoned_mutex() {
    within("panicking owner", limit(), || {
        for conf in CONFIGS {
            let a = alloc(conf);
            let a2 = a.clone();
            let r = std::thread::spawn(move || {
                become_owner(&a2);
                let _x = a2.allocate(4 * KB, None).unwrap();
                let p = a2.allocate_raw(4 * KB, None).unwrap();
                a2.free_raw(p).unwrap();
                panic!("owner panics with a live block");
            })
            .join();
            assert!(r.is_err());
            // Others revoke the gone owner's bias.
            poisoned_by_owner(conf);
            let hs: Vec<_> = (0..3)
                .map(|_| {
                    let a = a.clone();
                    std::thread::spawn(move || {
                        for _ in 0..scaled(2000) {
                            let p = a.allocate_raw(4 * KB, None).unwrap();
                            let r = Raw::new(p, 4 * KB);
                            let x = Live::new(a.allocate(4 * KB, None).unwrap());
                            r.check("after panic");
                            x.check("after panic");
                            a.free_raw(p).unwrap();
                        }
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
            settled(&a, conf);
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 8. fork(): the parent's owner thread is alive and idle (not in a fast hold); the child (one
//    thread, a different token) takes the lock: it must revoke (membarrier in the child) and
//    work, not hang or abort.
// ---------------------------------------------------------------------------------------------
#[test]
fn fork_child_takes_the_lock_from_parents_owner_thread() {
    if !common::membarrier_ok() {
        println!("SKIP: no membarrier");
        return;
    }
    let a = alloc("expandable_segments:True");
    let a2 = a.clone();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let owner = std::thread::spawn(move || {
        become_owner(&a2);
        ready_tx.send(()).unwrap();
        let _ = done_rx.recv();
    });
    ready_rx.recv().unwrap();
    // SAFETY: the child calls only the allocator (no locks held by other threads at this
    // point: the owner is parked on a channel) and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: alarm is async-signal-safe; it bounds a hang in the child.
        unsafe { libc::alarm(10) };
        let ok = (|| -> bool {
            let p = match a.allocate_raw(4 * KB, None) {
                Ok(p) => p,
                Err(_) => return false,
            };
            let r = Raw::new(p, 4 * KB);
            r.check("child");
            a.free_raw(p).is_ok() && a.check_invariants().is_ok()
        })();
        // SAFETY: ends the child without running the parent's atexit handlers or destructors.
        unsafe { libc::_exit(if ok { 0 } else { 3 }) };
    }
    let mut status = 0;
    let t0 = std::time::Instant::now();
    loop {
        // SAFETY: waiting for our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            break;
        }
        if t0.elapsed() > limit() / 2 {
            // SAFETY: our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("forked child hung");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    done_tx.send(()).unwrap();
    owner.join().unwrap();
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "forked child failed: status {status:#x} (signal {})",
        if libc::WIFSIGNALED(status) { libc::WTERMSIG(status) } else { 0 }
    );
    settled(&a, "parent after fork");
}

// ---------------------------------------------------------------------------------------------
// 9. A seccomp filter that refuses membarrier, installed after the bias was granted (a
//    sandbox set up after initialization): the module doc says "where membarrier is missing
//    (... seccomp) the lock is the mutex"; `revoke` aborts the process instead.
// ---------------------------------------------------------------------------------------------
#[test]
fn seccomp_refusing_membarrier_after_bias() {
    const NAME: &str = "seccomp_refusing_membarrier_after_bias";
    if !common::isolate::is_child(NAME) {
        if !common::membarrier_ok() {
            println!("SKIP: no membarrier");
            return;
        }
        let o = common::isolate::run_child(NAME, &[("DMABUF_RT_LOG", "off")], limit());
        assert!(
            o.ok,
            "a lock() from another thread, after a seccomp filter refusing membarrier(2) was installed, killed the \
             process instead of falling back to the mutex: {}\n--- stderr ---\n{}",
            o.status,
            common::isolate::abridged(&o.stderr)
        );
        return;
    }
    let a = alloc("expandable_segments:False");
    let a2 = a.clone();
    std::thread::spawn(move || become_owner(&a2)).join().unwrap();
    // membarrier(2) is 324 on x86-64; refuse it with EPERM on this thread (and its children).
    const NR_MEMBARRIER: u32 = 324;
    common::seccomp::install_one_rule(NR_MEMBARRIER, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32, 0);
    // Another thread's lock: revokes the (gone) owner's bias.
    let s = a.stats();
    assert_eq!(s.allocation[AGGREGATE].current, 0);
    println!("lock() after seccomp: ok");
}

// ---------------------------------------------------------------------------------------------
// 10. The C ABI: a thread with a long streak of dmabuf_rt_device_alloc/free (the runtime's
//     allocator becomes biased to it) against threads double-freeing, freeing foreign
//     pointers, reading stats, and stream callbacks that free blocks.
// ---------------------------------------------------------------------------------------------
mod capi {
    use std::ffi::c_void;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Once};

    use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;
    use dmabuf_rt::ffi::capi::*;

    use super::{KB, Raw};

    fn setup() {
        static ENV: Once = Once::new();
        ENV.call_once(|| {
            // SAFETY: before the first C call, under call_once (the only test that uses the
            // runtime in this binary).
            unsafe { std::env::set_var("DMABUF_RT_DEVICES", "shmem,shmem") };
            // SAFETY: as above.
            unsafe { std::env::set_var("DMABUF_RT_CAPACITY", "256M") };
        });
    }

    unsafe extern "C" fn free_cb(_s: dmabuf_rt_stream, _st: dmabuf_rt_status, user: *mut c_void) {
        let r = dmabuf_rt_device_free(0, user);
        assert_eq!(r, DMABUF_RT_OK, "free in a stream callback");
    }

    fn stats() -> dmabuf_rt_stats {
        // SAFETY: a zeroed POD struct for the out-parameter.
        let mut s: dmabuf_rt_stats = unsafe { std::mem::zeroed() };
        // SAFETY: `s` is a valid out-pointer.
        assert_eq!(unsafe { dmabuf_rt_device_stats(0, &mut s) }, DMABUF_RT_OK);
        s
    }

    #[test]
    fn capi_owner_streak_vs_double_and_foreign_frees() {
        setup();
        super::within("capi", super::limit(), || {
            let before = stats();
            let mut stream: dmabuf_rt_stream = 0;
            // SAFETY: valid out-pointer.
            assert_eq!(unsafe { dmabuf_rt_stream_create(0, &mut stream) }, DMABUF_RT_OK);
            let stream_addr = stream;
            let alloc = || {
                let mut p: *mut c_void = std::ptr::null_mut();
                // SAFETY: valid out-pointer.
                assert_eq!(unsafe { dmabuf_rt_device_alloc(0, 4 * KB, &mut p) }, DMABUF_RT_OK);
                p
            };
            // A foreign pointer (device 1's allocator) and a stack pointer.
            let mut foreign: *mut c_void = std::ptr::null_mut();
            // SAFETY: valid out-pointer.
            assert_eq!(unsafe { dmabuf_rt_device_alloc(1, 4 * KB, &mut foreign) }, DMABUF_RT_OK);
            let foreign_addr = foreign as usize;
            for _ in 0..300 {
                let p = alloc();
                assert_eq!(dmabuf_rt_device_free(0, p), DMABUF_RT_OK);
            }
            let stop = Arc::new(AtomicBool::new(false));
            // Thread 0 allocates as well, so the owner's double free below is only a double
            // free while nobody can allocate: thread 0 allocates under a read guard of `gate`,
            // the owner frees and frees again under its write guard. (Without the gate thread 0
            // may be handed the freed address in between, and the second free is then a good
            // free of its live block: no address-only API can tell, and CI once saw exactly
            // that.)
            let gate = Arc::new(std::sync::RwLock::new(()));
            let hs: Vec<_> = (0..3)
                .map(|t| {
                    let (stop, gate) = (stop.clone(), gate.clone());
                    std::thread::spawn(move || {
                        let local = 0u64;
                        let mut i = 0u64;
                        while !stop.load(Ordering::Relaxed) {
                            i += 1;
                            assert_ne!(dmabuf_rt_device_free(0, foreign_addr as *mut c_void), DMABUF_RT_OK);
                            assert_ne!(dmabuf_rt_device_free(0, &local as *const u64 as *mut c_void), DMABUF_RT_OK);
                            let s = super::capi::stats();
                            assert!(s.allocations < 1 << 20);
                            if t == 0 && i % 4 == 0 {
                                let mut p: *mut c_void = std::ptr::null_mut();
                                let held = gate.read().unwrap();
                                // SAFETY: valid out-pointer.
                                assert_eq!(unsafe { dmabuf_rt_device_alloc(0, 4 * KB, &mut p) }, DMABUF_RT_OK);
                                drop(held);
                                Raw::new(p.cast(), 4 * KB).check("capi other");
                                // SAFETY: a live stream and a callback that frees `p` once.
                                let r = unsafe {
                                    dmabuf_rt_stream_add_callback(stream_addr as dmabuf_rt_stream, Some(free_cb), p)
                                };
                                assert_eq!(r, DMABUF_RT_OK);
                            }
                        }
                    })
                })
                .collect();
            for i in 0..super::scaled(20_000) {
                let p = alloc();
                let r = Raw::new(p.cast(), 4 * KB);
                let q = alloc();
                let rq = Raw::new(q.cast(), 4 * KB);
                r.check("capi owner");
                rq.check("capi owner");
                assert_eq!(dmabuf_rt_device_free(0, p), DMABUF_RT_OK);
                if i % 512 == 0 {
                    // Double free of `q` by the owner (nobody can allocate in between: refused).
                    let _held = gate.write().unwrap();
                    assert_eq!(dmabuf_rt_device_free(0, q), DMABUF_RT_OK);
                    assert_ne!(dmabuf_rt_device_free(0, q), DMABUF_RT_OK, "double free accepted");
                } else {
                    assert_eq!(dmabuf_rt_device_free(0, q), DMABUF_RT_OK);
                }
            }
            stop.store(true, Ordering::Relaxed);
            for h in hs {
                h.join().unwrap();
            }
            assert_eq!(dmabuf_rt_stream_synchronize(stream), DMABUF_RT_OK);
            assert_eq!(dmabuf_rt_stream_destroy(stream), DMABUF_RT_OK);
            assert_eq!(dmabuf_rt_device_free(1, foreign), DMABUF_RT_OK);
            let t0 = std::time::Instant::now();
            loop {
                let after = stats();
                if after.allocations == before.allocations && after.allocated_bytes == before.allocated_bytes {
                    break;
                }
                assert!(
                    t0.elapsed() < super::limit(),
                    "C API stats never settled: {:?} vs {:?}",
                    after.allocations,
                    before.allocations
                );
                std::thread::yield_now();
            }
        });
    }
}

/// The owner thread poisons the pool's std mutex (its source panics under `allocate`'s
/// `lock()`), stays the owner and keeps using its fast path; other threads then take the
/// poisoned lock and revoke.
fn poisoned_by_owner(conf: &str) {
    let r = reentrant(conf);
    let a = r.a.clone();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (a2, panic_next) = (a.clone(), r.panic_next.clone());
    let owner = std::thread::spawn(move || {
        become_owner(&a2);
        panic_next.store(true, Ordering::SeqCst);
        let a3 = a2.clone();
        // The panic must happen on this (owner) thread: catch it here.
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a3.allocate(300 * MB, None)));
        assert!(res.is_err(), "{}: the source did not panic", "poison");
        ready_tx.send(()).unwrap();
        let _ = go_rx.recv();
        for _ in 0..scaled(20_000) {
            let p = a2.allocate_raw(4 * KB, None).unwrap();
            let x = Raw::new(p, 4 * KB);
            x.check("owner after poison");
            a2.free_raw(p).unwrap();
        }
    });
    ready_rx.recv().unwrap();
    go_tx.send(()).unwrap();
    let hs: Vec<_> = (0..2)
        .map(|_| {
            let a = a.clone();
            std::thread::spawn(move || {
                for _ in 0..scaled(2000) {
                    let x = Live::new(a.allocate(4 * KB, None).unwrap());
                    x.check("other after poison");
                }
            })
        })
        .collect();
    owner.join().unwrap();
    for h in hs {
        h.join().unwrap();
    }
    settled(&a, conf);
}
