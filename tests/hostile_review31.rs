//! Hostile review of the OOM ladder's claims (82653d3: `pool/claims.rs`, `allocate_slow`'s
//! `Outcome::LastWait`): a request at the last wait claims its room, others are kept out if
//! they would take it, and the claimant waits, unlocked, for the bytes of the deferred frees
//! outstanding at its claim. Findings (each test failed on 82653d3; all are fixed):
//!
//! 1. A block freed while held for sharing (limbo) counts in the pending bytes the claimant
//!    waits for, but not in the pending count its wait sleeps on: once the counted frees are
//!    done, `wait_next` returns at once (`is_zero`) and the claimant spins, taking the lock in
//!    a loop, until the hold is released (for ever if the peer keeps it).
//! 2. A request larger than the allowed memory (rung 0: "fails at once") still stops for the
//!    last wait when frees are outstanding, and claims more than the allowed memory: every
//!    other allocation, 4 KiB or zero bytes, is kept out for the whole pending-wait limit.
//! 3. Under any claim, a request that `round_size` refuses (too large) is kept out for the
//!    limit before it fails with `TooLarge` (the admission test runs before the size checks).
//! 4. A panic in the claimant's final attempt (a memory source's panic, or the lock's own
//!    "this thread holds it already" panic) leaves the claim in force for ever: fast paths off
//!    and every allocation that would take the dead claim's room kept out for the limit.
//!
//! Verified (passing): `stats`/`snapshot`/`history` and room-leaving allocations go on under a
//! claim, with and without `roundup_power2_divisions`, and a 40 MiB request is served at once
//! after it; the memory fraction lowered under a claim leaves no negative statistic or trace.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use common::QueueGate;
use common::wait::{gettid, task_state, wait_asleep, within};
use dmabuf_rt::Error;
use dmabuf_rt::caching::{CachingAllocator, Config};
use dmabuf_rt::queue::Queue;
use dmabuf_rt::segment::{Segment, SegmentKind};
use dmabuf_rt::source::{MemorySource, ShmemSource};

const MB: usize = 1 << 20;

fn watchdog() -> Duration {
    Duration::from_secs(60 * common::time_scale() as u64)
}

/// Allocates `size` bytes (and drops them) until `rx` brings the other thread's result;
/// returns it and the slowest call, with the error of the last call if it failed.
fn probe_until<T>(a: &CachingAllocator, sizes: &[usize], rx: &mpsc::Receiver<T>) -> (T, Duration, Vec<String>) {
    let mut slowest = Duration::ZERO;
    let mut errors = Vec::new();
    loop {
        if let Ok(r) = rx.try_recv() {
            return (r, slowest, errors);
        }
        for &s in sizes {
            let t = Instant::now();
            let r = a.allocate(s, None).map(drop);
            let took = t.elapsed();
            if took > slowest {
                slowest = took;
                if let Err(e) = r {
                    errors.push(format!("{s} bytes: {e} after {took:?}"));
                }
            }
        }
        std::thread::yield_now();
    }
}

/// A request of 40 MiB of 64 that reaches its claim (as in hostile_review30's callback race):
/// a small deferred free on gated `q1` ends its first wait, and a 40 MiB deferred free on
/// gated `q2` (`gate2`) is what it claims and waits for. Returns once `gate1` is open: the
/// request claims then (or has), and keeps its claim until `gate2` opens or the limit passes.
struct Claimed {
    a: CachingAllocator,
    // The gate before its queue: dropped first, so an unwinding test never waits for it.
    gate2: Option<QueueGate>,
    q2: Queue,
    rx: mpsc::Receiver<(Result<(), String>, Duration)>,
    tid: i32,
    /// The request's voluntary context switches in its first wait.
    v0: u64,
    _q1: Queue,
}

fn claimed(conf: &str, limit: Duration, before_gate1: impl FnOnce(&CachingAllocator, i32)) -> Claimed {
    let a = common::allocator_waiting(conf, 64 * MB, limit);
    let (q1, q2, gate1, gate2, big) = common::two_gated_frees(&a);
    let retries = a.stats().num_alloc_retries;
    let (tx, rx) = mpsc::channel();
    let (tid_tx, tid_rx) = mpsc::channel();
    {
        let a = a.clone();
        std::thread::spawn(move || {
            tid_tx.send(gettid()).unwrap();
            let t = Instant::now();
            let r = a.allocate(40 * MB, None).map(drop).map_err(|e| e.to_string());
            let _ = tx.send((r, t.elapsed()));
        });
    }
    let tid = tid_rx.recv().unwrap();
    while a.stats().num_alloc_retries == retries {
        std::thread::yield_now();
    }
    drop(big);
    before_gate1(&a, tid);
    let v0 = wait_asleep(tid, 0, watchdog()); // the request sleeps in its first wait (the small free)
    gate1.open();
    Claimed { a, gate2: Some(gate2), q2, rx, tid, v0, _q1: q1 }
}

// ---- Finding 1: limbo bytes make the claimant spin until the hold goes ----

/// An 8 MiB block shared (`ipc::get_handle`) and freed: it waits in limbo, counted in the
/// pending *bytes* (`pending_begin`) but never in `Pending`'s count. A request claims at its
/// last wait; its loop (`while pool.claimed_frees_outstanding() > 0`) waits with
/// `Pending::wait_next`, which returns at once when no counted free is outstanding
/// (`is_zero`). Once the 40 MiB free it waits for completes, the limbo bytes keep
/// `claimed_frees_outstanding` above zero and the thread spins (lock, drain, unlock) until
/// the handle is revoked: for ever if the peer keeps it. Each wait must end within the limit.
#[test]
fn a_claimant_does_not_spin_on_bytes_held_in_limbo() {
    within("limbo spin", watchdog(), || {
        let limit = Duration::from_secs(2) * common::time_scale().min(4);
        for round in 0..3 {
            let mut handle = None;
            let mut c = claimed("expandable_segments:False", limit, |a, _| {
                let x = a.allocate(8 * MB, None).unwrap();
                match dmabuf_rt::ipc::get_handle(&x, None) {
                    Ok(h) => handle = Some(h),
                    Err(e) => println!("SKIP: ipc::get_handle: {e}"),
                }
                drop(x); // into limbo
            });
            let Some(h) = handle else { return };
            assert!(c.a.stats().limbo_bytes.current >= 8 * MB as i64);
            // The request woke (gate1) and sleeps again: in its claim's wait for the 40 MiB.
            wait_asleep(c.tid, c.v0, watchdog());
            drop(c.gate2.take()); // the 40 MiB free completes: only the limbo bytes remain
            let r = c.rx.recv_timeout(limit * 3);
            let (state, _) = task_state(c.tid);
            dmabuf_rt::ipc::revoke_handle(&h).unwrap();
            let (w, took) = match r {
                Ok(r) => r,
                Err(_) => {
                    let (w, took) = c.rx.recv().unwrap();
                    panic!(
                        "round {round}: the request did not return within {:?} of its free's completion (thread state \
                         {state}: spinning on the limbo bytes); it returned once the hold was revoked, after {took:?}: {w:?}",
                        limit * 3
                    );
                }
            };
            w.unwrap_or_else(|e| panic!("round {round}: the request ({took:?}): {e}"));
            c.q2.synchronize().unwrap();
            c.a.check_invariants().unwrap();
        }
    });
}

// ---- Finding 2: a request larger than the allowed memory claims more than there is ----

/// 64 MiB allowed, a 4 KiB deferred free outstanding on a gated queue, and a request for
/// 128 MiB: rung 0 refuses it ("fails at once: nothing released could make room for it"),
/// but `Pool::allocate` still answers `LastWait` (frees outstanding), so the request claims
/// 128 MiB and waits for the 4 KiB free for the whole limit. Meanwhile every other
/// allocation (4 KiB, and even a zero-byte one that should fail with `ZeroLength` at once) is
/// kept out: 0 + 512 + 128 MiB > 64 MiB.
#[test]
fn a_request_larger_than_allowed_fails_at_once_and_keeps_no_one_out() {
    within("oversized claim", watchdog(), || {
        let limit = Duration::from_secs(2) * common::time_scale().min(4);
        let a = common::allocator_waiting("", 64 * MB, limit);
        let q = Queue::new().unwrap();
        let gate = QueueGate::close(&q);
        let mut small = a.allocate(4096, None).unwrap();
        small.record_queue(&q);
        drop(small);
        let (tx, rx) = mpsc::channel();
        {
            let a = a.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                let r = a.allocate(128 * MB, None).map(drop);
                let _ = tx.send((r, t.elapsed()));
            });
        }
        let ((r, took), slowest, errors) = probe_until(&a, &[4096, 0], &rx);
        let e = r.expect_err("128 MiB of 64");
        assert!(matches!(e, Error::AllocatorOom { .. }), "{e}");
        gate.open();
        q.synchronize().unwrap();
        a.check_invariants().unwrap();
        assert!(
            slowest < limit / 2,
            "a 4 KiB or zero-byte allocation took {slowest:?} while a 128 MiB request (of 64 allowed) waited \
             (limit {limit:?}); slow failures: {errors:?}"
        );
        assert!(took < limit / 2, "the 128 MiB request (of 64 allowed) took {took:?} to fail");
    });
}

// ---- Finding 3: a request the size checks refuse is kept out first ----

/// While a (sensible) claim is in force, `allocate(usize::MAX)` and `allocate(isize::MAX)`
/// are kept out for the limit (`admits`: `round_size` fails, taken as `usize::MAX` bytes, the
/// sum overflows: not admitted) before `Pool::allocate` refuses them with `TooLarge`. A 4 KiB
/// allocation meanwhile is admitted at once (the claim leaves room for it).
#[test]
fn a_too_large_request_fails_at_once_under_a_claim() {
    within("too large under a claim", watchdog(), || {
        let limit = Duration::from_secs(2) * common::time_scale().min(4);
        let c = claimed("expandable_segments:False", limit, |_, _| {});
        let ((w, _), slowest, errors) = probe_until(&c.a, &[4096, usize::MAX, isize::MAX as usize + 1], &c.rx);
        drop(w); // gate2 closed: the request fails after its wait
        drop(c.gate2);
        c.q2.synchronize().unwrap();
        c.a.check_invariants().unwrap();
        assert!(
            slowest < limit / 2,
            "a request refused by the size checks took {slowest:?} under another's claim (limit {limit:?}): {errors:?}"
        );
    });
}

// ---- Finding 4: a panic between claim and unclaim leaves the claim in force for ever ----

/// A memory source that panics in `create_segment` when armed (a hostile user's; the pool
/// lock's own reentrancy panic, a source calling back into the allocator, unwinds the same way).
#[derive(Debug)]
struct Panicky {
    inner: ShmemSource,
    armed: Arc<AtomicBool>,
}

impl MemorySource for Panicky {
    fn name(&self) -> String {
        "panicky".into()
    }
    fn kind(&self) -> SegmentKind {
        self.inner.kind()
    }
    fn create_segment(&self, len: usize) -> dmabuf_rt::error::Result<Segment> {
        if self.armed.swap(false, Ordering::SeqCst) {
            panic!("hostile source");
        }
        self.inner.create_segment(len)
    }
}

/// 64 MiB, classic segments: a 40 MiB block freed on gated `q2`, a request for 48 MiB that
/// claims at its last wait and waits for it. Its final attempt releases the 40 MiB cached and
/// calls the source for 48 MiB, which panics. The claim is never withdrawn (`claimed` is a
/// local, no guard): `plain_below` stays 0 (fast paths off for good) and a later 20 MiB
/// allocation, with nothing else allocated, is kept out for the whole limit (0 + 20 + 48 of
/// 64), every time.
#[test]
fn a_panic_in_the_final_attempt_withdraws_the_claim() {
    within("panic under a claim", watchdog(), || {
        let limit = Duration::from_secs(2) * common::time_scale().min(4);
        let armed = Arc::new(AtomicBool::new(false));
        let src = Panicky { inner: ShmemSource::new().reserve(false), armed: Arc::clone(&armed) };
        let a = CachingAllocator::builder(src)
            .config(Config::parse("expandable_segments:False").unwrap())
            .capacity(64 * MB as u64)
            .pending_wait_limit(limit)
            .build()
            .unwrap();
        let (_q1, q2, gate1, gate2, big) = common::two_gated_frees(&a);
        let retries = a.stats().num_alloc_retries;
        let (tid_tx, tid_rx) = mpsc::channel();
        let waiter = {
            let a = a.clone();
            std::thread::spawn(move || {
                tid_tx.send(gettid()).unwrap();
                a.allocate(48 * MB, None).map(drop)
            })
        };
        let tid = tid_rx.recv().unwrap();
        while a.stats().num_alloc_retries == retries {
            std::thread::yield_now();
        }
        let v = wait_asleep(tid, 0, watchdog()); // its first wait
        drop(big);
        gate1.open();
        wait_asleep(tid, v, watchdog()); // its claim's wait for the 40 MiB
        armed.store(true, Ordering::SeqCst);
        gate2.open();
        let r = waiter.join();
        assert!(r.is_err(), "the final attempt did not reach the source: {r:?}");
        armed.store(false, Ordering::SeqCst);
        q2.synchronize().unwrap();
        for i in 0..2 {
            let t = Instant::now();
            let x = a.allocate(20 * MB, None).unwrap();
            let took = t.elapsed();
            drop(x);
            assert!(
                took < limit / 2,
                "allocation {i} of 20 MiB (nothing else allocated) took {took:?} after the claimant panicked: its claim \
                 of 48 MiB is still in force (limit {limit:?})"
            );
        }
        a.check_invariants().unwrap();
    });
}

// ---- Verified ----

/// While a claim is in force (the request sleeps in its wait for the 40 MiB free): `stats`,
/// `snapshot`, `history` and a 4 KiB allocation (which leaves the claim its room) return at
/// once; once the free completes the request gets its 40 MiB, and no statistic is negative.
/// Run with the default config and with `roundup_power2_divisions` (where `plain_below` is 0
/// without a claim: the claim must put back 0, and the fast paths stay as they were).
#[test]
fn calls_that_take_no_room_go_on_under_a_claim() {
    within("calls under a claim", watchdog(), || {
        let limit = Duration::from_secs(2) * common::time_scale().min(4);
        for conf in ["expandable_segments:False", "expandable_segments:False,roundup_power2_divisions:4", ""] {
            let mut c = claimed(conf, limit, |_, _| {});
            wait_asleep(c.tid, c.v0, watchdog()); // in its claim's wait
            let t = Instant::now();
            let s = c.a.stats();
            let _ = c.a.snapshot();
            let _ = c.a.history();
            for _ in 0..50 {
                drop(c.a.allocate(4096, None).unwrap());
            }
            let took = t.elapsed();
            assert!(took < limit / 2, "{conf}: calls under a claim took {took:?}");
            assert!(s.allocated_bytes[0].current >= 0 && s.active_bytes[0].current >= 0, "{conf}: {s:?}");
            drop(c.gate2.take());
            let (w, _) = c.rx.recv().unwrap();
            w.unwrap_or_else(|e| panic!("{conf}: the claimant: {e}"));
            c.q2.synchronize().unwrap();
            // The claim is gone: a request that would have been kept out is served at once.
            let t = Instant::now();
            drop(c.a.allocate(40 * MB, None).unwrap());
            assert!(t.elapsed() < limit / 2, "{conf}: 40 MiB after the claim took {:?}", t.elapsed());
            c.a.check_invariants().unwrap();
        }
    });
}

/// The memory fraction lowered to 8 MiB while a 40 MiB claim waits (allowed then below the
/// claim and the frees it waits for): no arithmetic underflow or negative statistic, the
/// claimant still gets the 40 MiB its free gives back (a cached block takes no new memory),
/// and with the fraction back, the claim is gone and 40 MiB is served at once.
#[test]
fn a_fraction_lowered_under_a_claim_leaves_no_trace() {
    within("fraction under a claim", watchdog(), || {
        let limit = Duration::from_secs(2) * common::time_scale().min(4);
        let mut c = claimed("expandable_segments:False", limit, |_, _| {});
        wait_asleep(c.tid, c.v0, watchdog());
        c.a.set_memory_fraction(0.125).unwrap();
        drop(c.gate2.take());
        let (w, _) = c.rx.recv().unwrap();
        // The 40 MiB freed is cached: reusing it takes no new memory, whatever the fraction.
        w.unwrap_or_else(|e| panic!("the claimant: {e}"));
        c.q2.synchronize().unwrap();
        let s = c.a.stats();
        assert!(s.allocated_bytes[0].current >= 0 && s.reserved_bytes[0].current >= 0, "{s:?}");
        c.a.set_memory_fraction(1.0).unwrap();
        let t = Instant::now();
        drop(c.a.allocate(40 * MB, None).unwrap());
        assert!(t.elapsed() < limit / 2, "40 MiB after the claim took {:?}", t.elapsed());
        c.a.check_invariants().unwrap();
    });
}
