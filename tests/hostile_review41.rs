//! The 41st hostile review: the caching allocator's biased lock re-enabled (commit 7413536,
//! `caching/pool_lock.rs`). The owner's fast hold is now marked in a mark of the owner's own
//! thread (the address of the lock it holds fast, 0 for none), kept by the lock for its owner,
//! instead of one `busy` flag of the lock. What is new, and attacked here:
//!
//! - one mark per thread serves every lock the thread owns: a revoker of allocator A may find
//!   the owner's mark naming allocator B (it then goes on without waiting), and the owner's
//!   fast hold of A must then see that it lost the bias (tests 1, 2);
//! - the revocation's barrier when `membarrier` is refused to the revoking thread (a per-thread
//!   seccomp filter): the TLB-shootdown fallback must exclude the owner's fast hold as well
//!   (test 3);
//! - fast holds of one allocator taken inside another allocator's memory-source callback (that
//!   thread holds the other allocator's mutex), frees of the other allocator pushed from
//!   there, re-entrant calls refused with a panic, a panicking source, and revokers of the
//!   first allocator that must not wait for the unrelated mutex hold (test 4);
//! - the owner of two allocators exiting, its thread-local destructors dropping and making
//!   blocks of both while other threads revoke (test 5);
//! - fork() while the owner thread streaks through fast holds: the child's frees and its last
//!   handle's drop (`try_lock_taking_back`) must never wait for the parent's owner, whether or
//!   not it was inside a fast hold at the fork (test 6); a forked child whose forking thread
//!   was the owner goes on with threads of its own that revoke it (test 7);
//! - a queue's executor thread as the owner, and the allocator's exit hook (`QueueGone`,
//!   `try_lock`) run on that owner thread as the queue goes (test 8);
//! - the hole 7413536 closed (a former owner stopped inside `fast()` unmarking the next
//!   owner's hold), raced at the allocator's level (test 9).
//!
//! Results on 7413536 (2-vCPU 6.18 VM, debug): every test passes, in 25 runs of the binary
//! with the default test threads and 25 with `--test-threads=1` (and tests 1-8 in 50 more;
//! strace: the bias is granted and revoked in every round, test 3's revocations go through
//! `shootdown` with membarrier refused, and in test 6 about one child in six revokes, the rest
//! finding the owner inside a fast hold). No way was found through the public API to make two
//! threads hold the pool, to hang it, or to lose a free. The file is a regression net, not a
//! reproducer: it also passed 30 of 30 runs on b4c8d53^ (the `busy`-flag lock, bias on), whose
//! hole needs a thread stopped between two instructions; `pool_lock::tests` stops it there.
//! Not reproducible here (Intel VM) but worth a note: `shootdown` relies on the kernel
//! interrupting every CPU that runs the process; Linux on AMD CPUs with INVLPGB (6.15 on)
//! flushes the TLB of a process active on several CPUs by broadcast, with no interrupt, and
//! arm64 always does: there the fallback is no barrier.
//!
//! Every test builds fresh allocators per round where it needs the bias (each revocation
//! doubles the run the next bias needs). Races are placed by the owner's progress counter,
//! never by sleeps; every bound is multiplied by `common::time_scale()`.

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
use dmabuf_rt::segment::{Segment, SegmentKind};
use dmabuf_rt::source::{MemorySource, ShmemSource};

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;

/// The bound on each test's run (a hang detector), times the stress time scale.
fn limit() -> Duration {
    Duration::from_secs(60) * common::time_scale()
}

const CONFIGS: &[&str] =
    &["expandable_segments:False", "expandable_segments:True", "expandable_segments:True,page_stitching:True"];

fn alloc(conf: &str) -> CachingAllocator {
    common::allocator(conf, 4 << 30)
}

/// The text of a caught panic.
fn panic_text(e: &(dyn std::any::Any + Send)) -> String {
    e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

/// Runs `f`, recording its panic (with `what`) in `bad` instead of unwinding: the thread goes
/// on to its next barrier, so one failure does not hang the others.
fn caught(bad: &Mutex<Vec<String>>, what: &str, f: impl FnOnce()) {
    if let Err(e) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        bad.lock().unwrap().push(format!("{what}: {}", panic_text(&*e)));
    }
}

#[track_caller]
fn assert_none_bad(bad: &Mutex<Vec<String>>, what: &str) {
    let bad = bad.lock().unwrap();
    assert!(bad.is_empty(), "{what}: {} failure(s), first: {}", bad.len(), bad[0]);
}

/// Waits (yielding, bounded) until `progress` reaches `at`, or `finished` is set.
fn wait_progress(progress: &AtomicUsize, finished: &AtomicBool, at: usize) {
    let t0 = std::time::Instant::now();
    while progress.load(Ordering::Relaxed) < at && !finished.load(Ordering::Relaxed) {
        assert!(t0.elapsed() < limit(), "the owner made no progress");
        std::thread::yield_now();
    }
}

/// One revoker's strike on `a`: the calls that take the lock from its owner (a stats read, a
/// raw pair, an RAII pair), each block tagged and checked.
fn strike(a: &CachingAllocator, n: usize, what: &str) {
    let s = a.stats();
    assert!(s.allocation[AGGREGATE].current >= 0);
    let p = a.allocate_raw(n, None).unwrap();
    let r = Raw::new(p, n);
    let x = Live::new(a.allocate(n, None).unwrap());
    r.check(what);
    x.check(what);
    a.free_raw(p).unwrap();
    drop(x);
}

// ---------------------------------------------------------------------------------------------
// 1. One thread owns several allocators at once and goes from a fast hold of one to a fast hold
//    of the next, back to back (its one mark names each in turn); revokers strike each
//    allocator at points of the streak placed by the owner's progress, so that a revoker of A
//    often reads the mark naming B (or A's own hold) and the owner's next fast hold of A must
//    see the bias gone.
// ---------------------------------------------------------------------------------------------
#[test]
fn one_owner_of_several_allocators_revoked_one_by_one_mid_streak() {
    if !common::membarrier_ok() {
        println!("SKIP: no membarrier(PRIVATE_EXPEDITED): the lock is never biased");
        return;
    }
    within("several allocators", limit(), || {
        const K: usize = 3;
        const REVOKERS: usize = 2;
        let rounds = scaled(300);
        let ops = 1200;
        let slot: Arc<Mutex<Vec<CachingAllocator>>> = Arc::new(Mutex::new(Vec::new()));
        let progress = Arc::new(AtomicUsize::new(0));
        let finished = Arc::new(AtomicBool::new(false));
        let start = Arc::new(Barrier::new(REVOKERS + 1));
        let done = Arc::new(Barrier::new(REVOKERS + 1));
        let bad = Arc::new(Mutex::new(Vec::new()));
        let hs: Vec<_> = (0..REVOKERS)
            .map(|t| {
                let (slot, progress, finished, start, done, bad) =
                    (slot.clone(), progress.clone(), finished.clone(), start.clone(), done.clone(), bad.clone());
                std::thread::spawn(move || {
                    let mut rng = Rng(0x41_0001 + t as u64 * 0x9E37_79B9);
                    for round in 0..rounds {
                        start.wait();
                        let allocs = slot.lock().unwrap().clone();
                        caught(&bad, &format!("revoker {t} round {round}"), || {
                            // Each allocator once, in a rotated order, at increasing points.
                            let mut at = 0;
                            for j in 0..K {
                                at += 1 + rng.below((ops / (K + 1)) as u64) as usize;
                                wait_progress(&progress, &finished, at);
                                let a = &allocs[(j + t + round) % K];
                                strike(a, [512, 4 * KB, 16 * KB][j % 3], "revoker");
                                if (j + round) % 4 == t {
                                    // The owner's cached blocks released under it.
                                    a.empty_cache();
                                }
                            }
                        });
                        drop(allocs);
                        done.wait();
                    }
                })
            })
            .collect();
        for round in 0..rounds {
            let allocs: Vec<CachingAllocator> = (0..K).map(|i| alloc(CONFIGS[(round + i) % CONFIGS.len()])).collect();
            for a in &allocs {
                become_owner(a);
            }
            // Blocks kept across the streak, one per allocator, checked as it goes.
            let keep: Vec<Live> = allocs.iter().map(|a| Live::new(a.allocate(8 * KB, None).unwrap())).collect();
            *slot.lock().unwrap() = allocs.clone();
            progress.store(0, Ordering::Relaxed);
            finished.store(false, Ordering::Relaxed);
            start.wait();
            caught(&bad, &format!("owner round {round}"), || {
                let mut prev: Option<Live> = None;
                for i in 0..ops {
                    let a = &allocs[i % K];
                    // A block of this allocator made while the previous one (of the allocator
                    // before) is still live, then that one dropped: the fast hold of one lock
                    // right after the fast hold of another.
                    let x = Live::new(a.allocate(4 * KB, None).unwrap());
                    if let Some(p) = prev.take() {
                        p.check("owner, previous allocator");
                    }
                    let p = a.allocate_raw(4 * KB, None).unwrap();
                    let r = Raw::new(p, 4 * KB);
                    x.check("owner");
                    r.check("owner raw");
                    a.free_raw(p).unwrap();
                    prev = Some(x);
                    if i % 64 == 0 {
                        for k in &keep {
                            k.check("kept by the owner");
                        }
                    }
                    progress.store(i + 1, Ordering::Relaxed);
                }
            });
            finished.store(true, Ordering::Relaxed);
            done.wait();
            for k in &keep {
                k.check("kept at the end");
            }
            drop(keep);
            slot.lock().unwrap().clear();
            for (i, a) in allocs.iter().enumerate() {
                settled(a, &format!("round {round} allocator {i}"));
            }
        }
        for h in hs {
            h.join().unwrap();
        }
        assert_none_bad(&bad, "two holders of one pool (several allocators, one owner)");
    });
}

// ---------------------------------------------------------------------------------------------
// 2. The same, with the owner's frees of one allocator made inside its fast hold of none (the
//    drop path: `Allocation::drop` takes `fast()` directly) while every revoker strikes all
//    allocators at once, and an allocator of each round dropped by a revoker while the owner
//    still owns it (the last handle's drop revokes; a fresh allocator of the next round may be
//    made at the address the dropped one had, which the owner's mark held).
// ---------------------------------------------------------------------------------------------
#[test]
fn owner_drops_across_allocators_while_revokers_drop_the_last_handle() {
    if !common::membarrier_ok() {
        println!("SKIP: no membarrier(PRIVATE_EXPEDITED)");
        return;
    }
    within("drops across allocators", limit(), || {
        const K: usize = 2;
        let rounds = scaled(300);
        let ops = 1000;
        for round in 0..rounds {
            let allocs: Vec<CachingAllocator> = (0..K).map(|i| alloc(CONFIGS[(round + i) % CONFIGS.len()])).collect();
            for a in &allocs {
                become_owner(a);
            }
            let progress = Arc::new(AtomicUsize::new(0));
            let finished = Arc::new(AtomicBool::new(false));
            let bad = Arc::new(Mutex::new(Vec::new()));
            // A third allocator only the revoker holds a handle of at the end: its last handle is
            // dropped by the revoker mid-streak (the owner keeps blocks of it alive).
            let doomed = alloc(CONFIGS[round % CONFIGS.len()]);
            become_owner(&doomed);
            let doomed_blocks: Vec<Live> = (0..8).map(|_| Live::new(doomed.allocate(4 * KB, None).unwrap())).collect();
            let h = {
                let (allocs, progress, finished, bad) =
                    (allocs.clone(), progress.clone(), finished.clone(), bad.clone());
                std::thread::spawn(move || {
                    let mut rng = Rng(0x41_0002 ^ round as u64);
                    caught(&bad, "revoker", || {
                        wait_progress(&progress, &finished, 1 + rng.below(ops as u64 / 3) as usize);
                        for a in &allocs {
                            strike(a, 4 * KB, "revoker");
                        }
                        wait_progress(&progress, &finished, ops / 3 + rng.below(ops as u64 / 3) as usize);
                        // The last handle goes while the owner thread owns it and keeps blocks of
                        // it: its drop revokes, drains and closes the spares.
                        drop(doomed);
                        for a in allocs.iter().rev() {
                            strike(a, 512, "revoker, second strike");
                        }
                    });
                })
            };
            caught(&bad, "owner", || {
                let mut held: Vec<Live> = Vec::new();
                for i in 0..ops {
                    let a = &allocs[i % K];
                    let b = &allocs[(i + 1) % K];
                    held.push(Live::new(a.allocate(1024, None).unwrap()));
                    held.push(Live::new(b.allocate(1024, None).unwrap()));
                    if held.len() >= 6 {
                        // Dropped alternately: a fast hold of A, of B, of A...
                        for x in held.drain(..) {
                            x.check("owner");
                        }
                    }
                    if i % 100 == 0 {
                        for d in &doomed_blocks {
                            d.check("block of the allocator whose last handle went");
                        }
                    }
                    progress.store(i + 1, Ordering::Relaxed);
                }
                for x in held {
                    x.check("owner at the end");
                }
            });
            finished.store(true, Ordering::Relaxed);
            h.join().unwrap();
            for d in &doomed_blocks {
                d.check("doomed at the end");
            }
            // The last `Allocation`s of an allocator with no handle left.
            drop(doomed_blocks);
            assert_none_bad(&bad, &format!("round {round}"));
            for (i, a) in allocs.iter().enumerate() {
                settled(a, &format!("round {round} allocator {i}"));
            }
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 3. The revocation's fallback barrier. Revoker threads install a seccomp filter of their own
//    (per thread, no TSYNC) that refuses membarrier(2) with EPERM, after the bias was granted:
//    each of their revocations goes through the TLB shootdown (`pool_lock::shootdown`). The
//    owner streaks through fast holds of tagged blocks; the revokers strike at points placed by
//    its progress. A revoker that did not wait for the owner's fast hold joins it: the debug
//    check names two holders, or a block is handed to two owners (tags).
// ---------------------------------------------------------------------------------------------
#[test]
fn shootdown_fallback_revokers_never_join_the_owners_fast_hold() {
    if !common::membarrier_ok() {
        println!("SKIP: no membarrier(PRIVATE_EXPEDITED)");
        return;
    }
    if !cfg!(target_arch = "x86_64") {
        println!("SKIP: the filter matches x86-64 system call numbers only");
        return;
    }
    within("shootdown fallback", limit(), || {
        const REVOKERS: usize = 2;
        const NR_MEMBARRIER: u32 = 324;
        let rounds = scaled(600);
        let ops = 1500;
        let slot: Arc<Mutex<Option<CachingAllocator>>> = Arc::new(Mutex::new(None));
        let progress = Arc::new(AtomicUsize::new(0));
        let finished = Arc::new(AtomicBool::new(false));
        let start = Arc::new(Barrier::new(REVOKERS + 1));
        let done = Arc::new(Barrier::new(REVOKERS + 1));
        let bad = Arc::new(Mutex::new(Vec::new()));
        // The first bias of the process is granted on an unfiltered thread (it registers
        // membarrier once for the process: `barrier_available`).
        let first = alloc(CONFIGS[0]);
        become_owner(&first);
        let filtered = Arc::new(AtomicUsize::new(0));
        let hs: Vec<_> = (0..REVOKERS)
            .map(|t| {
                let (slot, progress, finished, start, done, bad, filtered) = (
                    slot.clone(),
                    progress.clone(),
                    finished.clone(),
                    start.clone(),
                    done.clone(),
                    bad.clone(),
                    filtered.clone(),
                );
                std::thread::spawn(move || {
                    common::seccomp::install_one_rule(NR_MEMBARRIER, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32, 0);
                    use rustix::thread::{MembarrierCommand, membarrier};
                    if membarrier(MembarrierCommand::PrivateExpedited).is_err() {
                        filtered.fetch_add(1, Ordering::SeqCst);
                    }
                    let mut rng = Rng(0x41_0003 + t as u64 * 0x1234_5678);
                    for round in 0..rounds {
                        start.wait();
                        let a = slot.lock().unwrap().clone();
                        if let Some(a) = a {
                            caught(&bad, &format!("revoker {t} round {round}"), || {
                                let at = 1 + rng.below(ops as u64 * 2 / 3) as usize;
                                wait_progress(&progress, &finished, at);
                                strike(&a, if t == 0 { 4 * KB } else { 512 }, "filtered revoker");
                                let _ = a.snapshot();
                            });
                        }
                        done.wait();
                    }
                })
            })
            .collect();
        drop(first);
        for round in 0..rounds {
            let a = alloc(CONFIGS[round % CONFIGS.len()]);
            become_owner(&a);
            let keep: Vec<Live> = (0..8).map(|_| Live::new(a.allocate(4 * KB, None).unwrap())).collect();
            *slot.lock().unwrap() = Some(a.clone());
            progress.store(0, Ordering::Relaxed);
            finished.store(false, Ordering::Relaxed);
            start.wait();
            caught(&bad, &format!("owner round {round}"), || {
                for i in 0..ops {
                    if i % 2 == 0 {
                        let x = Live::new(a.allocate(4 * KB, None).unwrap());
                        x.check("owner");
                    } else {
                        let p = a.allocate_raw(512, None).unwrap();
                        let r = Raw::new(p, 512);
                        r.check("owner raw");
                        a.free_raw(p).unwrap();
                    }
                    if i % 128 == 0 {
                        for k in &keep {
                            k.check("kept by the owner");
                        }
                    }
                    progress.store(i + 1, Ordering::Relaxed);
                }
            });
            finished.store(true, Ordering::Relaxed);
            done.wait();
            *slot.lock().unwrap() = None;
            for k in &keep {
                k.check("kept at the end");
            }
            drop(keep);
            settled(&a, &format!("round {round}"));
        }
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(
            filtered.load(Ordering::SeqCst),
            REVOKERS,
            "the seccomp filter did not refuse membarrier on the revokers: the fallback was not exercised"
        );
        assert_none_bad(&bad, "two holders of the pool with the TLB-shootdown barrier");
    });
}

// ---------------------------------------------------------------------------------------------
// 4. Allocator A's memory source runs a hook on the thread that owns allocator B, while that
//    thread holds A's mutex (`create_segment` runs under A's lock): the hook drops blocks of B
//    (fast holds of B taken inside A's mutex hold), drops blocks of A (pushed: A is held here),
//    allocates and frees blocks of B, reads B's stats, calls A again (refused with a panic,
//    not a deadlock or a second hold of A), lets a revoker of B take B while it waits (the
//    revoker must not wait for the unrelated hold of A), and sometimes panics itself. Another
//    thread hammers both allocators meanwhile. B is fresh each round (so that it is biased).
// ---------------------------------------------------------------------------------------------

type Hook = Box<dyn FnMut() + Send>;

thread_local! {
    /// Whether the hook runs on this thread (only the owner thread of the test's allocator B).
    static ARMED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

struct Hooked {
    inner: ShmemSource,
    hook: Arc<Mutex<Option<Hook>>>,
}

impl std::fmt::Debug for Hooked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hooked")
    }
}

/// Puts the hook back when its run ends, a panic included.
struct Back<'a> {
    slot: &'a Mutex<Option<Hook>>,
    hook: Option<Hook>,
}

impl Drop for Back<'_> {
    fn drop(&mut self) {
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = self.hook.take();
    }
}

impl Hooked {
    fn run(&self) {
        if !ARMED.with(|a| a.get()) {
            return;
        }
        // Taken out while it runs (a nested call finds none).
        let Some(h) = self.hook.lock().unwrap().take() else { return };
        let mut back = Back { slot: &self.hook, hook: Some(h) };
        (back.hook.as_mut().expect("just set"))();
    }
}

impl MemorySource for Hooked {
    fn name(&self) -> String {
        "hooked".into()
    }
    fn kind(&self) -> SegmentKind {
        self.inner.kind()
    }
    fn create_segment(&self, len: usize) -> DResult<Segment> {
        self.run();
        self.inner.create_segment(len)
    }
    fn reserve_expandable(&self, len: usize) -> DResult<Segment> {
        self.run();
        self.inner.reserve_expandable(len)
    }
}

#[derive(Default)]
struct HookState {
    /// This round's B.
    b: Option<CachingAllocator>,
    b_victims: Vec<Live>,
    a_victims: Vec<Live>,
    b_raw: Vec<Raw>,
    made: Vec<Live>,
    runs: usize,
    refused_reentry: usize,
    panic_now: bool,
    revoke_now: bool,
}

/// Keeps the panics this file causes on purpose (and the re-entrant calls the library refuses
/// with a panic) from printing a backtrace each (slow, with `RUST_BACKTRACE` set); any other
/// panic goes to the previous hook.
fn quiet_expected_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let text = info
                .payload()
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| info.payload().downcast_ref::<&str>().copied())
                .unwrap_or("");
            if text.contains("on purpose") || text.contains("called again from inside one of its own calls") {
                return;
            }
            previous(info);
        }));
    });
}

#[test]
fn cross_allocator_frees_and_allocations_inside_a_memory_source() {
    quiet_expected_panics();
    within("cross-allocator source", limit(), || {
        let hook: Arc<Mutex<Option<Hook>>> = Arc::new(Mutex::new(None));
        let a = CachingAllocator::builder(Hooked { inner: ShmemSource::new().reserve(false), hook: hook.clone() })
            .config(Config::parse("expandable_segments:False").unwrap())
            .capacity(4 << 30)
            .build()
            .unwrap();
        let st = Arc::new(Mutex::new(HookState::default()));
        // This round's B, for the other threads.
        let current_b: Arc<Mutex<Option<CachingAllocator>>> = Arc::new(Mutex::new(None));
        let bad = Arc::new(Mutex::new(Vec::new()));
        // The revoker of B that the hook lets in while it holds A (a request and a reply).
        let (req_tx, req_rx) = std::sync::mpsc::channel::<CachingAllocator>();
        let (rep_tx, rep_rx) = std::sync::mpsc::channel::<()>();
        let rep_rx = Mutex::new(rep_rx);
        {
            let (a2, st) = (a.clone(), st.clone());
            *hook.lock().unwrap() = Some(Box::new(move || {
                let mut s = st.lock().unwrap();
                let Some(b2) = s.b.clone() else { return };
                s.runs += 1;
                // B's blocks dropped here: fast holds of B (this thread owns B) inside A's
                // mutex hold.
                for x in s.b_victims.drain(..) {
                    x.check("B block dropped in A's source");
                }
                // A's blocks dropped here: A is held by this thread (pushed for later).
                for x in s.a_victims.drain(..) {
                    x.check("A block dropped in A's source");
                }
                for r in s.b_raw.drain(..) {
                    r.check("B raw freed in A's source");
                    b2.free_raw(r.p as *mut u8).unwrap();
                }
                for n in [512, 4 * KB, 4 * KB, 64 * KB] {
                    let x = Live::new(b2.allocate(n, None).unwrap());
                    s.made.push(x);
                }
                assert!(b2.stats().allocation[AGGREGATE].current > 0);
                // A again, from inside A's own call: refused (a panic), not a deadlock and not
                // a second hold.
                let again = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a2.stats()));
                match again {
                    Err(e) if panic_text(&*e).contains("called again from inside") => s.refused_reentry += 1,
                    Err(e) => panic!("A called again from its own source: unexpected panic {}", panic_text(&*e)),
                    Ok(_) => panic!("A called again from its own source returned: a second hold of A's pool"),
                }
                if std::mem::take(&mut s.revoke_now) {
                    // Another thread takes B (revoking this thread's bias) while this one holds
                    // A: it must not wait for this hold.
                    req_tx.send(b2.clone()).unwrap();
                    let r = rep_rx.lock().unwrap().recv_timeout(Duration::from_secs(20) * common::time_scale());
                    assert!(
                        r.is_ok(),
                        "hang: a revoker of B waited for B's owner while the owner held only A (inside A's memory \
                         source)"
                    );
                }
                if std::mem::take(&mut s.panic_now) {
                    drop(s);
                    panic!("the hooked source panics on purpose");
                }
            }));
        }
        let stop = Arc::new(AtomicBool::new(false));
        // The revoker of B the hook waits for.
        let revoker = {
            let (bad, stop) = (bad.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    // A bounded poll (the stop flag), not an ordering wait.
                    match req_rx.recv_timeout(Duration::from_millis(50)) {
                        Ok(b) => {
                            caught(&bad, "revoker of B", || strike(&b, 4 * KB, "revoker of B"));
                            drop(b);
                            rep_tx.send(()).unwrap();
                        }
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                        Err(_) => break,
                    }
                }
            })
        };
        // A thread hammering both allocators (one lock at a time), now and then.
        let hammer = {
            let (a, current_b, bad, stop) = (a.clone(), current_b.clone(), bad.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(0x41_0004);
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..rng.below(100_000) {
                        std::hint::spin_loop();
                    }
                    let b = current_b.lock().unwrap().clone();
                    caught(&bad, "hammer", || match (rng.below(2), b) {
                        (0, Some(b)) => strike(&b, 1024, "hammer B"),
                        _ => strike(&a, 1024, "hammer A"),
                    });
                }
            })
        };
        let owner = {
            let (a, st, bad, current_b) = (a.clone(), st.clone(), bad.clone(), current_b.clone());
            std::thread::spawn(move || {
                ARMED.with(|x| x.set(true));
                for round in 0..scaled(150) {
                    let conf_b = CONFIGS[round % CONFIGS.len()];
                    let b = alloc(conf_b);
                    become_owner(&b);
                    *current_b.lock().unwrap() = Some(b.clone());
                    {
                        // Made before the state is locked: A's allocation may run the hook,
                        // which locks it (and finds no B yet: it does nothing).
                        let b_victims = (0..6).map(|_| Live::new(b.allocate(4 * KB, None).unwrap())).collect();
                        let a_victims = (0..3).map(|_| Live::new(a.allocate(4 * KB, None).unwrap())).collect();
                        let b_raw = (0..3).map(|_| Raw::new(b.allocate_raw(4 * KB, None).unwrap(), 4 * KB)).collect();
                        let mut s = st.lock().unwrap();
                        (s.b_victims, s.a_victims, s.b_raw) = (b_victims, a_victims, b_raw);
                        s.b = Some(b.clone());
                        s.revoke_now = round % 3 == 1;
                        s.panic_now = round % 5 == 4;
                    }
                    // A new segment of A: its source's hook runs under A's lock.
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        Live::new(a.allocate(12 * MB + (round % 4) * 2 * MB, None).unwrap())
                    }));
                    match r {
                        Ok(big) => big.check("A's big block"),
                        Err(e) => {
                            let t = panic_text(&*e);
                            if !t.contains("on purpose") {
                                bad.lock().unwrap().push(format!("round {round} ({conf_b}): {t}"));
                            }
                        }
                    }
                    let mut s = st.lock().unwrap();
                    let made = std::mem::take(&mut s.made);
                    // Whatever the hook left (it panicked first, or did not run).
                    s.b_victims.clear();
                    s.a_victims.clear();
                    for r in s.b_raw.drain(..) {
                        b.free_raw(r.p as *mut u8).unwrap();
                    }
                    s.b = None;
                    drop(s);
                    for m in &made {
                        m.check("B block made in A's source");
                    }
                    drop(made);
                    *current_b.lock().unwrap() = None;
                    a.empty_cache();
                    a.check_invariants().unwrap_or_else(|e| panic!("A, round {round}: {e}"));
                    // The hammer may still hold a clone of B for a strike: its blocks are its own.
                    wait_until("B's blocks freed", limit(), || b.stats().allocation[AGGREGATE].current == 0);
                    settled(&b, &format!("B, round {round} ({conf_b})"));
                }
                ARMED.with(|x| x.set(false));
            })
        };
        let owner_result = owner.join();
        stop.store(true, Ordering::Relaxed);
        hammer.join().unwrap();
        revoker.join().unwrap();
        if let Err(e) = owner_result {
            panic!("the owner thread panicked: {}", panic_text(&*e));
        }
        *hook.lock().unwrap() = None;
        assert_none_bad(&bad, "cross-allocator source");
        let s = st.lock().unwrap();
        assert!(s.runs > 0, "A's source hook never ran");
        assert_eq!(s.refused_reentry, s.runs, "a re-entrant call of A was not refused");
        drop(s);
        settled(&a, "A");
    });
}

// ---------------------------------------------------------------------------------------------
// 5. The owner of two allocators exits: its thread-local destructors drop blocks of both
//    (fast holds on an exiting thread) and a destructor makes and drops more, while other
//    threads revoke both allocators at points of the exit they do not control.
// ---------------------------------------------------------------------------------------------
thread_local! {
    static KEEP41: std::cell::RefCell<Vec<Live>> = const { std::cell::RefCell::new(Vec::new()) };
    static ON_EXIT41: std::cell::RefCell<Option<OnExit>> = const { std::cell::RefCell::new(None) };
}

/// Makes, checks and drops blocks of both allocators when its thread's locals are destroyed.
struct OnExit {
    allocs: Vec<CachingAllocator>,
    ran: Arc<AtomicUsize>,
}

impl Drop for OnExit {
    fn drop(&mut self) {
        for _ in 0..50 {
            for a in &self.allocs {
                let x = Live::new(a.allocate(4 * KB, None).unwrap());
                let p = a.allocate_raw(4 * KB, None).unwrap();
                let r = Raw::new(p, 4 * KB);
                x.check("made in a destructor");
                r.check("raw made in a destructor");
                a.free_raw(p).unwrap();
            }
        }
        self.ran.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn owner_of_two_allocators_exits_with_blocks_in_thread_locals_while_revoked() {
    if !common::membarrier_ok() {
        println!("SKIP: no membarrier(PRIVATE_EXPEDITED)");
        return;
    }
    within("owner exit", limit(), || {
        for round in 0..scaled(200) {
            let allocs: Vec<CachingAllocator> = (0..2).map(|i| alloc(CONFIGS[(round + i) % CONFIGS.len()])).collect();
            let ran = Arc::new(AtomicUsize::new(0));
            let exiting = Arc::new(AtomicBool::new(false));
            let stop = Arc::new(AtomicBool::new(false));
            let bad = Arc::new(Mutex::new(Vec::new()));
            let revokers: Vec<_> = (0..2)
                .map(|t| {
                    let (allocs, exiting, stop, bad) = (allocs.clone(), exiting.clone(), stop.clone(), bad.clone());
                    std::thread::spawn(move || {
                        let mut rng = Rng(0x41_0005 ^ (round as u64) << 8 ^ t as u64);
                        wait_until("the owner's exit", limit(), || exiting.load(Ordering::SeqCst));
                        let mut i = 0;
                        while !stop.load(Ordering::Relaxed) || i < 4 {
                            for _ in 0..rng.below(5000) {
                                std::hint::spin_loop();
                            }
                            caught(&bad, "revoker", || strike(&allocs[(i + t) % 2], 2 * KB, "revoker"));
                            i += 1;
                        }
                    })
                })
                .collect();
            let owner = {
                let (allocs, ran, exiting) = (allocs.clone(), ran.clone(), exiting.clone());
                std::thread::spawn(move || {
                    for a in &allocs {
                        become_owner(a);
                    }
                    KEEP41.with(|k| {
                        let mut k = k.borrow_mut();
                        for i in 0..40 {
                            k.push(Live::new(
                                allocs[i % 2].allocate(if i % 7 == 0 { 2 * MB } else { 4 * KB }, None).unwrap(),
                            ));
                        }
                    });
                    ON_EXIT41.with(|o| *o.borrow_mut() = Some(OnExit { allocs: allocs.clone(), ran }));
                    exiting.store(true, Ordering::SeqCst);
                    // The body ends here: the locals (and with them the blocks) go as the
                    // thread exits, the revokers already striking.
                })
            };
            owner.join().unwrap();
            stop.store(true, Ordering::Relaxed);
            for h in revokers {
                h.join().unwrap();
            }
            assert_eq!(ran.load(Ordering::SeqCst), 1, "round {round}: the destructor that allocates did not run");
            assert_none_bad(&bad, &format!("round {round}"));
            for (i, a) in allocs.iter().enumerate() {
                settled(a, &format!("round {round} allocator {i}"));
            }
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 6. fork() while the owner thread streaks through fast holds (the child inherits it inside a
//    fast hold, inside `fast()` before or after its mark, or between holds). The child drops a
//    block made before the fork, then the allocator's last handle (`try_lock_taking_back`):
//    neither may wait for the parent's owner, which the child does not have.
// ---------------------------------------------------------------------------------------------
#[test]
fn fork_while_the_owner_streaks_child_frees_and_drops_the_last_handle_without_waiting() {
    if !common::membarrier_ok() {
        println!("SKIP: no membarrier(PRIVATE_EXPEDITED)");
        return;
    }
    within("fork mid-streak", limit(), || {
        for (ci, conf) in CONFIGS.iter().enumerate() {
            // The only handle; the owner thread borrows it. The child takes it by value (its
            // copy of the parent's memory), to drop the last handle there.
            let a: &'static CachingAllocator = Box::leak(Box::new(alloc(conf)));
            let before: Vec<Allocation> = (0..8).map(|_| a.allocate(4 * KB, None).unwrap()).collect();
            let stop = Arc::new(AtomicBool::new(false));
            let streaks = Arc::new(AtomicUsize::new(0));
            let owner = {
                let (stop, streaks) = (stop.clone(), streaks.clone());
                std::thread::spawn(move || {
                    become_owner(a);
                    while !stop.load(Ordering::Relaxed) {
                        let x = a.allocate(4 * KB, None).unwrap();
                        drop(x);
                        let p = a.allocate_raw(512, None).unwrap();
                        a.free_raw(p).unwrap();
                        streaks.fetch_add(1, Ordering::Relaxed);
                    }
                })
            };
            wait_until("the owner's streak", limit(), || streaks.load(Ordering::Relaxed) > 100);
            let forks = scaled(60);
            let mut failed = Vec::new();
            for k in 0..forks {
                // The owner is mid-streak at a different point each time.
                let seen = streaks.load(Ordering::Relaxed);
                wait_until("the owner's streak", limit(), || streaks.load(Ordering::Relaxed) > seen + (k % 5));
                // SAFETY: the child calls only the allocator's free paths (no lock of another
                // thread is waited for there: that is what is tested) and leaves with `_exit`.
                let pid = unsafe { libc::fork() };
                assert!(pid >= 0, "fork failed");
                if pid == 0 {
                    // SAFETY: alarm is async-signal-safe; it bounds a hang in the child.
                    unsafe { libc::alarm(5 * common::time_scale()) };
                    // SAFETY: the child's copy of `before`, read once; the parent's is its own.
                    let blocks: Vec<Allocation> = unsafe { std::ptr::read(&before) };
                    drop(blocks);
                    // SAFETY: the child's copy of the only handle, read once and dropped: the
                    // owner thread that borrows it in the parent does not exist here.
                    let last: CachingAllocator = unsafe { std::ptr::read(a) };
                    drop(last);
                    // SAFETY: ends the child without the parent's destructors.
                    unsafe { libc::_exit(0) };
                }
                let mut status = 0;
                let t0 = std::time::Instant::now();
                loop {
                    // SAFETY: our own child.
                    let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
                    if r == pid {
                        break;
                    }
                    if t0.elapsed() > Duration::from_secs(15) * common::time_scale() {
                        // SAFETY: our own child.
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                        // SAFETY: reap it.
                        unsafe { libc::waitpid(pid, &mut status, 0) };
                        break;
                    }
                    // A bounded poll for the child's exit, not an ordering sleep.
                    std::thread::sleep(Duration::from_millis(2));
                }
                if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
                    let sig = if libc::WIFSIGNALED(status) { libc::WTERMSIG(status) } else { 0 };
                    failed.push(format!("fork {k}: status {status:#x} (signal {sig})"));
                    // One is enough (a hang costs the alarm's time each).
                    break;
                }
            }
            stop.store(true, Ordering::Relaxed);
            owner.join().unwrap();
            assert!(
                failed.is_empty(),
                "{conf} (config {ci}): {} of {forks} forked children did not finish their frees and last-handle drop \
                 (SIGALRM = 14: a hang waiting for the parent's owner): {failed:?}",
                failed.len()
            );
            drop(before);
            settled(a, conf);
            // SAFETY: leaked above; the owner thread is joined, nothing borrows it any more.
            drop(unsafe { Box::from_raw(a as *const CachingAllocator as *mut CachingAllocator) });
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 7. A forked child that goes on using the allocator with threads of its own: the forking
//    thread was the owner in the parent (idle at the fork), so it is the owner in the child;
//    the child's new threads revoke it (membarrier in the child: the registration is the
//    parent's) while it streaks through fast holds, every block tagged. The child's exit
//    status says what it saw (1: a failed check, its message on stderr; SIGALRM: a hang).
// ---------------------------------------------------------------------------------------------
#[test]
fn forked_child_owner_streaks_against_the_childs_own_revokers() {
    if !common::membarrier_ok() {
        println!("SKIP: no membarrier(PRIVATE_EXPEDITED)");
        return;
    }
    within("child owner", limit(), || {
        for (ci, conf) in CONFIGS.iter().enumerate() {
            for k in 0..scaled(8) {
                let a = alloc(conf);
                become_owner(&a);
                // SAFETY: the child uses only this allocator (no other thread of the parent
                // touches it) and threads of its own, and leaves with `_exit`.
                let pid = unsafe { libc::fork() };
                assert!(pid >= 0, "fork failed");
                if pid == 0 {
                    // SAFETY: alarm is async-signal-safe; it bounds a hang in the child.
                    unsafe { libc::alarm(10 * common::time_scale()) };
                    let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        let progress = Arc::new(AtomicUsize::new(0));
                        let finished = Arc::new(AtomicBool::new(false));
                        let ops = 2000;
                        let hs: Vec<_> = (0..2)
                            .map(|t| {
                                let (a, progress, finished) = (a.clone(), progress.clone(), finished.clone());
                                std::thread::spawn(move || {
                                    let mut rng = Rng(0x41_0007 ^ (k as u64) << 4 ^ t as u64);
                                    for s in 0..3 {
                                        let at = (s * ops / 3) + rng.below(ops as u64 / 3) as usize;
                                        wait_progress(&progress, &finished, at);
                                        strike(&a, 4 * KB, "child revoker");
                                    }
                                })
                            })
                            .collect();
                        let keep: Vec<Live> = (0..4).map(|_| Live::new(a.allocate(4 * KB, None).unwrap())).collect();
                        for i in 0..ops {
                            let x = Live::new(a.allocate(4 * KB, None).unwrap());
                            let p = a.allocate_raw(4 * KB, None).unwrap();
                            let r = Raw::new(p, 4 * KB);
                            x.check("child owner");
                            r.check("child owner raw");
                            a.free_raw(p).unwrap();
                            if i % 128 == 0 {
                                for k in &keep {
                                    k.check("kept by the child's owner");
                                }
                            }
                            progress.store(i + 1, Ordering::Relaxed);
                        }
                        finished.store(true, Ordering::Relaxed);
                        for h in hs {
                            h.join().unwrap();
                        }
                        drop(keep);
                        settled(&a, "child");
                    }));
                    // SAFETY: ends the child without the parent's destructors.
                    unsafe { libc::_exit(if ok.is_ok() { 0 } else { 1 }) };
                }
                let mut status = 0;
                let t0 = std::time::Instant::now();
                loop {
                    // SAFETY: our own child.
                    let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
                    if r == pid {
                        break;
                    }
                    if t0.elapsed() > Duration::from_secs(20) * common::time_scale() {
                        // SAFETY: our own child.
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                        // SAFETY: reap it.
                        unsafe { libc::waitpid(pid, &mut status, 0) };
                        break;
                    }
                    // A bounded poll for the child's exit, not an ordering sleep.
                    std::thread::sleep(Duration::from_millis(2));
                }
                let sig = if libc::WIFSIGNALED(status) { libc::WTERMSIG(status) } else { 0 };
                assert!(
                    libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                    "{conf} (config {ci}) fork {k}: the child, whose forking thread owned the pool, failed against its \
                     own revokers: status {status:#x} (signal {sig}; 14 = SIGALRM: a hang, exit 1: a failed check)"
                );
                settled(&a, "parent after the fork");
            }
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 8. A queue's executor thread becomes the owner (host callbacks allocating and freeing in a
//    streak), other threads strike mid-streak, and the queue is dropped while its executor may
//    still own the pool: the exit hook the allocator registered (`QueueGone`, applied with
//    `try_lock` on the executor as it exits) runs on the owner thread itself.
// ---------------------------------------------------------------------------------------------
#[test]
fn queue_executor_owner_and_its_exit_hook() {
    if !common::membarrier_ok() {
        println!("SKIP: no membarrier(PRIVATE_EXPEDITED)");
        return;
    }
    within("executor owner", limit(), || {
        for round in 0..scaled(60) {
            let conf = CONFIGS[round % CONFIGS.len()];
            let a = alloc(conf);
            let q = dmabuf_rt::queue::Queue::new().unwrap();
            // Blocks bound to the queue (their segments go when it does), some freed now.
            let bound: Vec<Live> = (0..6).map(|i| Live::new(a.allocate((i + 1) * 4 * KB, Some(&q)).unwrap())).collect();
            let progress = Arc::new(AtomicUsize::new(0));
            let finished = Arc::new(AtomicBool::new(false));
            let bad = Arc::new(Mutex::new(Vec::new()));
            const CALLBACKS: usize = 8;
            const PER: usize = 150;
            for c in 0..CALLBACKS {
                let (a, progress, bad) = (a.clone(), progress.clone(), bad.clone());
                q.callback(move |_| {
                    caught(&bad, "executor", || {
                        if c == 0 {
                            become_owner(&a);
                        }
                        for i in 0..PER {
                            let x = Live::new(a.allocate(2 * KB, None).unwrap());
                            let p = a.allocate_raw(2 * KB, None).unwrap();
                            let r = Raw::new(p, 2 * KB);
                            x.check("executor");
                            r.check("executor raw");
                            a.free_raw(p).unwrap();
                            progress.store(c * PER + i + 1, Ordering::Relaxed);
                        }
                    });
                })
                .unwrap();
            }
            let striker = {
                let (a, progress, finished, bad) = (a.clone(), progress.clone(), finished.clone(), bad.clone());
                std::thread::spawn(move || {
                    let mut rng = Rng(0x41_0008 ^ round as u64);
                    caught(&bad, "striker", || {
                        let at = 1 + rng.below((CALLBACKS * PER) as u64) as usize;
                        wait_progress(&progress, &finished, at);
                        strike(&a, 4 * KB, "striker");
                    });
                })
            };
            drop(bound);
            // Dropped with its callbacks queued or running: it finishes them, then exits and
            // runs the exit hooks on its executor.
            drop(q);
            finished.store(true, Ordering::Relaxed);
            striker.join().unwrap();
            assert_none_bad(&bad, &format!("round {round} ({conf})"));
            wait_until("the queue's frees", limit(), || a.stats().allocation[AGGREGATE].current == 0);
            settled(&a, &format!("round {round} ({conf})"));
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 9. The hole 7413536 closed, at the allocator's level, run many times on more threads than
//    CPUs: a former owner keeps calling `fast()` (dropping its many blocks: a drop that is
//    refused goes to `try_lock`, which does not break another thread's run), so it is often
//    preempted inside `fast()` after reading itself the owner; meanwhile a second thread
//    revokes it, is made the owner (its run of 128 acquisitions) and streaks through fast
//    holds, and a third thread revokes the second. With the former owner able to unmark the
//    new owner's hold, the third joins it (the debug check names two holders; tags).
// ---------------------------------------------------------------------------------------------
#[test]
fn former_owner_drops_while_the_next_owner_streaks_and_is_revoked() {
    if !common::membarrier_ok() {
        println!("SKIP: no membarrier(PRIVATE_EXPEDITED)");
        return;
    }
    within("former owner", limit(), || {
        for round in 0..scaled(120) {
            let conf = CONFIGS[round % CONFIGS.len()];
            let a = alloc(conf);
            let bad = Arc::new(Mutex::new(Vec::new()));
            let ready = Arc::new(AtomicBool::new(false));
            let next_progress = Arc::new(AtomicUsize::new(0));
            let next_done = Arc::new(AtomicBool::new(false));
            const NEXT_OPS: usize = 1500;
            let former = {
                let (a, bad, ready) = (a.clone(), bad.clone(), ready.clone());
                std::thread::spawn(move || {
                    caught(&bad, "former owner", || {
                        become_owner(&a);
                        let mut mine: Vec<Live> =
                            (0..600).map(|_| Live::new(a.allocate(1024, None).unwrap())).collect();
                        ready.store(true, Ordering::SeqCst);
                        // Dropped one at a time, newest first: each drop tries `fast()`.
                        while let Some(x) = mine.pop() {
                            x.check("former owner's block");
                            drop(x);
                            for _ in 0..50 {
                                std::hint::spin_loop();
                            }
                        }
                    });
                })
            };
            let next = {
                let (a, bad, ready, progress, done) =
                    (a.clone(), bad.clone(), ready.clone(), next_progress.clone(), next_done.clone());
                std::thread::spawn(move || {
                    wait_until("the former owner's blocks", limit(), || ready.load(Ordering::SeqCst));
                    caught(&bad, "next owner", || {
                        for i in 0..NEXT_OPS {
                            let x = Live::new(a.allocate(2 * KB, None).unwrap());
                            let p = a.allocate_raw(512, None).unwrap();
                            let r = Raw::new(p, 512);
                            x.check("next owner");
                            r.check("next owner raw");
                            a.free_raw(p).unwrap();
                            progress.store(i + 1, Ordering::Relaxed);
                        }
                    });
                    done.store(true, Ordering::Relaxed);
                })
            };
            let third = {
                let (a, bad, progress, done) = (a.clone(), bad.clone(), next_progress.clone(), next_done.clone());
                std::thread::spawn(move || {
                    let mut rng = Rng(0x41_0009 ^ round as u64);
                    caught(&bad, "third thread", || {
                        for s in 0..3 {
                            let at = 200 + s * 400 + rng.below(400) as usize;
                            wait_progress(&progress, &done, at);
                            strike(&a, 2 * KB, "third thread");
                        }
                    });
                })
            };
            for h in [former, next, third] {
                h.join().unwrap();
            }
            assert_none_bad(&bad, &format!("round {round} ({conf})"));
            settled(&a, &format!("round {round} ({conf})"));
        }
    });
}
