//! Hostile review of the OOM ladder's last wait as first made (d957a77..c9bc81e), which waited
//! for the deferred frees outstanding *holding* the allocator's lock, letting go only for a
//! queue executor that asked. It found that this held up, until the pending-wait limit, calls
//! that take the lock some other way from a host callback (`fd_ranges`, a stitched block's
//! `offset`), and a thread that a queue's work waits for (a gate it opens after its next
//! allocation: the request then failed with a false OOM); that a callback calling the
//! allocator at all (`stats`) undid the wait's purpose; and that a queue found stuck by the
//! wait for the queues was waited for again. The wait now holds no lock: the request claims
//! its room, and only allocations that would take it wait (`pool/claims.rs`). Every test here
//! passes on that; each of the five findings failed on c9bc81e.

mod common;

use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::wait::within;
use common::{QueueGate, scaled};
use dmabuf_rt::Error;
use dmabuf_rt::caching::{Allocation, CachingAllocator};
use dmabuf_rt::queue::Queue;

const MB: usize = 1 << 20;

/// What a host callback does with the allocator and a live block of it while another thread
/// may be in the last wait. Returns a description of a failure, if any.
type Probe = fn(&CachingAllocator, &Allocation) -> Result<(), String>;

/// One round of hostile_review29's callback race, with `probe` as the callback's call: a small
/// deferred free on gated `q1` ends the request's first wait, a 40 MiB deferred free queued
/// behind the callback on gated `q2` is what the request needs, and `q2`'s gate opens after
/// `spins` yields so that the callback runs before, during or after the request's last wait.
/// Returns (the callback's result and how long its probe took, the request's result).
fn callback_round(
    conf: &str,
    limit: Duration,
    spins: usize,
    probe: Probe,
) -> (Result<(), String>, Duration, Result<(), String>) {
    let a = common::allocator_waiting(conf, 64 * MB, limit);
    let (q1, q2, gate1, gate2, big) = common::two_gated_frees(&a);
    let y = a.allocate(64 * 1024, None).unwrap();
    let (tx, rx) = mpsc::channel();
    let a2 = a.clone();
    q2.callback(move |_| {
        let t = Instant::now();
        let r = probe(&a2, &y);
        let took = t.elapsed();
        drop(y); // an Allocation dropped on the executor: pushed, never waits for the lock
        let _ = tx.send((r, took));
    })
    .unwrap();
    let waiter = common::waiting_40_mib_request(&a);
    drop(big);
    gate1.open();
    for _ in 0..spins {
        std::thread::yield_now();
    }
    gate2.open();
    let (r, took) = rx.recv().unwrap();
    let w = waiter.join().unwrap();
    q1.synchronize().unwrap();
    q2.synchronize().unwrap();
    a.check_invariants().unwrap();
    (r, took, w)
}

/// Runs `probe` in the callback race for `rounds` rounds: each round, the probe must return
/// well within the limit and the request must get its 40 MiB (the memory is freed as soon as
/// the callback returns).
fn callback_race(what: &'static str, conf: &'static str, rounds: usize, probe: Probe) {
    let limit = Duration::from_secs(2) * common::time_scale().min(4);
    within(what, Duration::from_secs(120 * common::time_scale() as u64), move || {
        for round in 0..rounds {
            let (r, took, w) = callback_round(conf, limit, (round * 37) % 300, probe);
            r.unwrap_or_else(|e| panic!("{what}: round {round}: the callback's call failed: {e}"));
            assert!(
                took < limit / 2,
                "{what}: round {round}: the callback's call took {took:?} (limit {limit:?}): held up by the last wait; \
                 the request: {w:?}"
            );
            w.unwrap_or_else(|e| panic!("{what}: round {round}: the request (callback took {took:?}): {e}"));
        }
    });
}

// ---- Finding 1: Allocation methods that lock the pool directly, from a host callback ----

/// `Allocation::fd_ranges` (and `offset`/`try_clone_fd` of a stitched block, `export_dma_buf`,
/// the IPC export, `ExportHold`'s drop) take the pool's lock with `inner.pool.lock()`, not
/// through `CachingAllocator::lock`: on a queue's executor they never ask a thread in the last
/// wait to let the lock go. A callback calling one while another thread holds the lock waiting
/// for a free queued behind that very callback blocks until the pending-wait limit passes; the
/// waiting request then fails with an OOM for memory freed a moment later.
#[test]
fn a_callback_reading_fd_ranges_is_not_held_up_by_the_last_wait() {
    callback_race("fd_ranges in a callback", "expandable_segments:False", scaled(40), |_, y| {
        let r = y.fd_ranges();
        if r.is_empty() { Err("no ranges".into()) } else { Ok(()) }
    });
}

/// The same through `Allocation::offset` of a page-stitched arena's block (a common call: the
/// block's place in its fd, which locks the pool for stitched segments).
#[test]
fn a_callback_reading_a_stitched_offset_is_not_held_up_by_the_last_wait() {
    callback_race(
        "stitched offset in a callback",
        "expandable_segments:True,page_stitching:True",
        scaled(40),
        |_, y| {
            let _ = y.offset();
            Ok(())
        },
    );
}

// ---- Verified: the allocator's own entry points from a host callback ----

#[test]
fn a_callback_calling_stats_snapshot_and_raw_frees_is_not_held_up_by_the_last_wait() {
    callback_race("stats in a callback", "", scaled(15), |a, _| {
        let _ = a.stats();
        let _ = a.snapshot();
        Ok(())
    });
    callback_race("raw calls in a callback", "", scaled(15), |a, _| {
        let p = a.allocate_raw(4096, None).map_err(|e| e.to_string())?;
        a.free_raw(p).map_err(|e| e.to_string())
    });
    callback_race("memory fraction in a callback", "", scaled(15), |a, _| {
        a.set_memory_fraction(1.0).map_err(|e| e.to_string())
    });
}

/// A raw block used on another queue (`record_queue_raw`) and freed from a callback while the
/// last wait runs: the callback is not held up, the request gets its memory, and the raw
/// block's deferred free is applied once (invariants).
#[test]
fn a_callback_recording_and_freeing_raw_blocks_is_not_held_up_by_the_last_wait() {
    callback_race("record_queue_raw in a callback", "", scaled(15), |a, _| {
        let q = Queue::new().map_err(|e| e.to_string())?;
        let p = a.allocate_raw(4096, None).map_err(|e| e.to_string())?;
        a.record_queue_raw(p, &q).map_err(|e| e.to_string())?;
        a.free_raw(p).map_err(|e| e.to_string())
    });
}

// ---- Finding 2: a stuck queue found by the wait for the queues is waited for again ----

/// Allocates and frees 4 KiB blocks until `rx` brings another thread's result; returns it and
/// the slowest of these calls.
fn allocate_until<T>(a: &CachingAllocator, rx: &mpsc::Receiver<T>) -> (T, Duration) {
    let mut slowest = Duration::ZERO;
    loop {
        if let Ok(r) = rx.try_recv() {
            return (r, slowest);
        }
        let t = Instant::now();
        drop(a.allocate(4096, None).unwrap());
        slowest = slowest.max(t.elapsed());
        std::thread::yield_now();
    }
}

/// A queue that never finishes (gated) and that blocks are bound to: a request that cannot be
/// served waits for it once (the last wait's unlocked wait for the queues, one limit) and
/// fails. A deferred free on that same queue, made after the request's first pass, is then
/// waited for again *holding the lock* for a second limit: `stuck` is only set by the ladder's
/// wait for frees (`wait_next`), never by a wait for the queues that timed out. The request
/// takes two limits (one before d957a77) and every other thread is held up for the second
/// (none before), which c9bc81e set out to prevent for stuck queues.
#[test]
fn a_queue_stuck_past_the_wait_for_queues_is_not_waited_for_again() {
    within("stuck queue", Duration::from_secs(120 * common::time_scale() as u64), || {
        let limit = Duration::from_secs(2) * common::time_scale().min(4);
        let a = common::allocator_waiting("", 64 * MB, limit);
        let r = Queue::new().unwrap();
        let gate = QueueGate::close(&r);
        let bound = a.allocate(4096, Some(&r)).unwrap(); // `r` is a queue of the pool
        let big = a.allocate(40 * MB, None).unwrap();
        let mut x = a.allocate(4096, None).unwrap();
        let retries = a.stats().num_alloc_retries;
        let (tx, rx) = mpsc::channel();
        let a2 = a.clone();
        let waiter = std::thread::spawn(move || {
            let t = Instant::now();
            let r = a2.allocate(40 * MB, None).map(drop);
            let _ = tx.send((r.map_err(|e| e.to_string()), t.elapsed()));
        });
        // The request's first pass is over (its retry is counted under the lock): nothing was
        // pending then, and it waits for the gated queue.
        while a.stats().num_alloc_retries == retries {
            std::thread::yield_now();
        }
        x.record_queue(&r);
        drop(x); // a deferred free behind the stuck queue
        let ((r_wait, took), slowest) = allocate_until(&a, &rx);
        waiter.join().unwrap();
        let e = r_wait.expect_err("40 MiB of 64 with 40 live");
        assert!(e.contains("out of memory"), "{e}");
        assert!(
            slowest < limit / 2,
            "a 4 KiB allocation took {slowest:?} while another request waited for a stuck queue \
             (limit {limit:?}; the request took {took:?})"
        );
        assert!(took < limit * 3 / 2, "the request took {took:?}: the stuck queue was waited for twice");
        gate.open();
        r.synchronize().unwrap();
        drop((bound, big));
        drop(a.allocate(40 * MB, None).unwrap());
        a.check_invariants().unwrap();
    });
}

// ---- Verified: limits ----

/// A pending-wait limit of zero: a request under a gated deferred free fails at once (no wait
/// holding the lock), naming the bytes the free holds.
#[test]
fn a_zero_limit_fails_at_once_naming_the_deferred_bytes() {
    within("zero limit", Duration::from_secs(60 * common::time_scale() as u64), || {
        let a = common::allocator_waiting("", 64 * MB, Duration::ZERO);
        let (q, gate, big) = common::gated_block(&a);
        drop(big);
        let t = Instant::now();
        let e = a.allocate(40 * MB, None).map(drop).expect_err("held by a gated free");
        assert!(t.elapsed() < Duration::from_secs(1) * common::time_scale(), "{:?}", t.elapsed());
        let Error::AllocatorOom { cause, .. } = &e else { panic!("not an OOM: {e}") };
        assert!(cause.contains(&format!("{} bytes", 40 * MB)), "{e}");
        common::open_and_serve_40_mib(&a, gate, &q);
    });
}

/// `Duration::MAX` as the limit: the last wait does not overflow an `Instant`, and a request
/// whose free completes gets its memory.
#[test]
fn a_huge_limit_does_not_overflow() {
    within("huge limit", Duration::from_secs(60 * common::time_scale() as u64), || {
        let a = common::allocator_waiting("", 64 * MB, Duration::MAX);
        let (_q1, _q2, gate1, gate2, big) = common::two_gated_frees(&a);
        let waiter = common::waiting_40_mib_request(&a);
        drop(big);
        gate1.open();
        gate2.open();
        waiter.join().unwrap().unwrap();
        a.check_invariants().unwrap();
    });
}

// ---- Finding 3: a thread that a queue's work waits for, held up by the lock ----

/// A queue's work waits for a thread (a gate it opens after its next allocation, as a
/// producer that allocates, then releases the consumer's queue). While a request holds the
/// lock waiting for a deferred free queued behind that gate, the thread's allocation waits
/// for the lock: neither moves until the pending-wait limit, and then the request fails with
/// an OOM although the memory is freed a moment later. At b8c61f5 (no wait holding the lock)
/// the thread's 4 KiB allocation returned at once and the request got its 40 MiB. The README
/// says such a thread "is held up until the pending-wait limit", not that the request then
/// fails with memory that was about to be given back.
#[test]
fn a_thread_the_queue_waits_for_does_not_make_the_request_fail() {
    let limit = Duration::from_secs(2) * common::time_scale().min(4);
    within("producer gate", Duration::from_secs(120 * common::time_scale() as u64), move || {
        for round in 0..scaled(40) {
            let a = common::allocator_waiting("expandable_segments:False", 64 * MB, limit);
            let (_q1, q2, gate1, gate2, big) = common::two_gated_frees(&a);
            let waiter = common::waiting_40_mib_request(&a);
            drop(big);
            gate1.open();
            for _ in 0..(round * 37) % 300 {
                std::thread::yield_now();
            }
            // The producer: its next allocation, then the consumer's queue may go on.
            let t = Instant::now();
            let mine = a.allocate(4096, None).unwrap();
            let took = t.elapsed();
            gate2.open();
            let w = waiter.join().unwrap();
            drop(mine);
            assert!(
                took < limit / 2,
                "round {round}: the producer's 4 KiB allocation took {took:?}; the request: {w:?}"
            );
            w.unwrap_or_else(|e| panic!("round {round}: the request: {e}"));
            q2.synchronize().unwrap();
            a.check_invariants().unwrap();
        }
    });
}

// ---- Finding 4: any host callback that calls the allocator undoes the held wait ----

/// hostile_review29's churn (a thread freeing 20 MiB blocks used on its own queue as fast as
/// it can), where the churner's queue also runs a host callback after each fill. With a
/// callback that only counts, every request gets its 40 MiB (the held wait works). With one
/// that reads the allocator's stats (logging), the callback finds the lock held by the last
/// wait and asks it to let go (`lock_on_executor`), and the wait goes on *without* the lock
/// for the rest of its time (`allocate_slow`'s `yield_asked` branch), where the churner takes
/// what the frees give back first: the race d957a77 fixed is back, every time.
fn churn_with_callbacks(calls_allocator: bool) -> Vec<String> {
    let a =
        common::allocator_waiting("expandable_segments:True,page_stitching:False", 64 * MB, Duration::from_secs(60));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let frees = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let bar = Arc::new(Barrier::new(2));
    let churner = {
        let (a, stop, frees, bar) = (a.clone(), Arc::clone(&stop), Arc::clone(&frees), Arc::clone(&bar));
        std::thread::spawn(move || {
            let q = Queue::builder().inline_max(0).build().unwrap();
            let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            bar.wait();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let Ok(mut b) = a.allocate(20 * MB, None) else { continue };
                b.record_queue(&q);
                q.fill(b.mem(), 0x5a).unwrap();
                let (a3, calls) = (a.clone(), Arc::clone(&calls));
                q.callback(move |_| {
                    if calls_allocator {
                        let _ = a3.stats();
                    }
                    calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                })
                .unwrap();
                drop(b);
                frees.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            q.synchronize().unwrap();
        })
    };
    bar.wait();
    let mut failures = Vec::new();
    for round in 0..scaled(40) {
        let seen = frees.load(std::sync::atomic::Ordering::Relaxed);
        while frees.load(std::sync::atomic::Ordering::Relaxed) < seen + 2 && !churner.is_finished() {
            std::thread::yield_now();
        }
        if let Err(e) = a.allocate(40 * MB, None) {
            failures.push(format!("round {round}: {e}"));
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    churner.join().unwrap();
    a.check_invariants().unwrap();
    failures
}

#[test]
fn requests_get_the_memory_a_churner_with_plain_callbacks_gives_back() {
    let f = within("churn, plain callbacks", Duration::from_secs(120 * common::time_scale() as u64), || {
        churn_with_callbacks(false)
    });
    assert!(f.is_empty(), "{} requests failed: {}", f.len(), f[0]);
}

#[test]
fn requests_get_the_memory_a_churner_with_stats_callbacks_gives_back() {
    let f = within("churn, stats callbacks", Duration::from_secs(120 * common::time_scale() as u64), || {
        churn_with_callbacks(true)
    });
    assert!(f.is_empty(), "{} of {} requests failed: {}", f.len(), scaled(40), f[0]);
}
