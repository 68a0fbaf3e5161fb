//! Review of the OOM ladder's last wait under a thread that keeps freeing blocks used on a
//! queue of its own (deferred frees): the memory such frees give back went to that thread's
//! next allocation before a waiting request woke, every time, and the request failed with the
//! memory it had waited for in another thread's hands (`tests/hostile_review24.rs`'s large-fill
//! race: 3.6 GB in 4,161 deferred frees outstanding). The last rung now claims the request's
//! room while it waits for the frees outstanding (`pool/claims.rs`: an allocation that would
//! take it waits), where PyTorch waits for its events under its mutex; and an OOM error with
//! deferred frees outstanding says how many bytes they hold. What the wait must not do is
//! tested too: hold up a host callback that calls the allocator (the frees may be queued
//! behind it), keep others out while a callback waits for frees behind itself, or wait
//! again for frees that did not complete within the limit once. (A first version held the
//! lock for the wait: `tests/hostile_review30.rs` found what that held up.)

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::scaled;
use common::wait::within;
use dmabuf_rt::caching::CachingAllocator;
use dmabuf_rt::queue::Queue;
use dmabuf_rt::{Access, Error};

const MB: usize = 1 << 20;

/// A churning thread allocates 20 MiB blocks, fills each on a queue of its own and frees it
/// at once (a deferred free, completed by the fill's end), as fast as it can, so its frees
/// hold most of the 64 MiB at any time. Another thread asks for 40 MiB again and again: each
/// request must get it (the frees outstanding complete within the limit; the churner's own
/// requests may fail, it has no claim). Every config: classic segments, expandable ones and
/// page-stitched arenas. Classic ones with `max_split_size_mb`: without it the churner's
/// blocks split the request's cached 40 MiB segment, and one live there pins it (PyTorch's
/// fragmentation, which the OOM error names; `tests/caching.rs`).
#[test]
fn requests_get_the_memory_a_churning_deferred_freer_gives_back() {
    for conf in [
        "expandable_segments:False,max_split_size_mb:32",
        "expandable_segments:True,page_stitching:False",
        "expandable_segments:True,page_stitching:True",
    ] {
        within(conf, Duration::from_secs(120 * common::time_scale() as u64), move || churn(conf));
    }
}

fn churn(conf: &'static str) {
    let a = common::allocator_waiting(conf, 64 * MB, Duration::from_secs(60));
    let stop = Arc::new(AtomicBool::new(false));
    let frees = Arc::new(AtomicUsize::new(0));
    let bar = Arc::new(Barrier::new(2));
    let churner = {
        let (a, stop, frees, bar) = (a.clone(), Arc::clone(&stop), Arc::clone(&frees), Arc::clone(&bar));
        std::thread::spawn(move || {
            let q = Queue::builder().inline_max(0).build().unwrap();
            bar.wait();
            while !stop.load(Ordering::Relaxed) {
                let Ok(mut b) = a.allocate(20 * MB, None) else { continue };
                b.record_queue(&q);
                q.fill(b.mem(), 0x5a).unwrap();
                drop(b);
                frees.fetch_add(1, Ordering::Relaxed);
            }
            q.synchronize().unwrap();
        })
    };
    bar.wait();
    for round in 0..scaled(40) {
        // Let the churner's frees take the memory again.
        let seen = frees.load(Ordering::Relaxed);
        while frees.load(Ordering::Relaxed) < seen + 2 && !churner.is_finished() {
            std::thread::yield_now();
        }
        match a.allocate(40 * MB, None) {
            Ok(b) => {
                // Ours: nobody else writes it.
                b.cpu_access(Access::Write).unwrap().write(0, &[round as u8; 4096]).unwrap();
                let mut back = [0u8; 4096];
                b.cpu_access(Access::Read).unwrap().read(0, &mut back).unwrap();
                assert_eq!(back, [round as u8; 4096], "{conf}: round {round}: the block was written by another");
            }
            Err(e) => {
                stop.store(true, Ordering::Relaxed);
                panic!("{conf}: round {round}: 40 MiB of 64 MiB refused under a churning deferred freer: {e}");
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    churner.join().unwrap();
    a.check_invariants().unwrap();
}

/// A deferred free held by a closed gate past the (short) pending-wait limit: the request that
/// needs its memory fails, and the error says the memory is held by deferred frees, with their
/// bytes, not that it is fragmented. From several threads at once. Then the gate opens and the
/// memory comes back.
#[test]
fn an_oom_under_deferred_frees_names_them() {
    within("oom names deferred frees", Duration::from_secs(120 * common::time_scale() as u64), || {
        for conf in ["expandable_segments:False", "expandable_segments:True,page_stitching:True"] {
            let a = common::allocator_waiting(conf, 64 * MB, Duration::from_millis(50));
            let (q, gate, b) = common::gated_block(&a);
            q.fill(b.mem(), 1).unwrap();
            drop(b);
            let bar = Arc::new(Barrier::new(3));
            let hs: Vec<_> = (0..3)
                .map(|_| {
                    let (a, bar) = (a.clone(), Arc::clone(&bar));
                    std::thread::spawn(move || {
                        bar.wait();
                        a.allocate(40 * MB, None).map(drop)
                    })
                })
                .collect();
            for h in hs {
                let e = h.join().unwrap().expect_err("40 MiB held by a gated deferred free");
                let Error::AllocatorOom { cause, .. } = &e else { panic!("{conf}: not an OOM: {e}") };
                assert!(
                    cause.contains(&format!("{} bytes of the memory reserved but free are blocks freed", 40 * MB)),
                    "{conf}: {e}"
                );
                assert!(!cause.contains("fragmentation"), "{conf}: the memory is not fragmented: {e}");
            }
            common::open_and_serve_40_mib(&a, gate, &q);
        }
    });
}

/// The frees the last wait waits for may be queued behind a host callback that calls the
/// allocator itself: the callback, on the queue's executor, is never kept out by the waiter's
/// claim, and both finish (with an hour-long pending-wait limit, a waiter that held the
/// callback up would hang until the watchdog). Each round: a small deferred free on one
/// gated queue makes the request's first wait end early (its frees passed), a 40 MiB deferred
/// free queued behind the callback on another gated queue is what the request needs, and the
/// second gate opens after a varying number of yields, so that the request reaches its last
/// wait before or after the callback runs.
#[test]
fn a_callback_that_allocates_is_not_held_up_by_the_last_wait() {
    within("callback under the last wait", Duration::from_secs(60 * common::time_scale() as u64), || {
        for round in 0..scaled(30) {
            let a = common::allocator_waiting("", 64 * MB, Duration::from_secs(3600));
            let (_q1, q2, gate1, gate2, big) = common::two_gated_frees(&a);
            let (tx, rx) = std::sync::mpsc::channel();
            let a2 = a.clone();
            q2.callback(move |_| {
                let _ = tx.send(a2.allocate(4096, None).map(drop).map_err(|e| e.to_string()));
            })
            .unwrap();
            let waiter = common::waiting_40_mib_request(&a);
            drop(big);
            gate1.open();
            for _ in 0..(round * 37) % 200 {
                std::thread::yield_now();
            }
            gate2.open();
            rx.recv().unwrap().unwrap_or_else(|e| panic!("round {round}: the callback's allocation: {e}"));
            waiter.join().unwrap().unwrap_or_else(|e| panic!("round {round}: the request: {e}"));
            a.check_invariants().unwrap();
        }
    });
}

/// A host callback whose allocation needs the memory of a deferred free queued behind it
/// (on its own queue) cannot be served until its waits run out (the pending-wait limit, twice:
/// the ladder's wait, then the last one), and fails; meanwhile other threads must keep
/// allocating: the callback's last wait claims nothing. Each of the main thread's
/// calls must return well within the limit (a call held up by the callback's wait takes the
/// whole limit).
#[test]
fn a_callback_waiting_for_frees_behind_itself_does_not_hold_up_other_threads() {
    within("callback self-wait", Duration::from_secs(120 * common::time_scale() as u64), || {
        let limit = Duration::from_secs(3) * common::time_scale().min(4);
        let a = common::allocator_waiting("", 64 * MB, limit);
        let (q, gate, big) = common::gated_block(&a);
        let (tx, rx) = std::sync::mpsc::channel();
        let a2 = a.clone();
        q.callback(move |_| {
            let _ = tx.send(a2.allocate(40 * MB, None).map(drop).map_err(|e| e.to_string()));
        })
        .unwrap();
        drop(big); // its free waits for the callback
        gate.open();
        let e = allocate_until(&a, &rx, limit).expect_err("the memory is held behind the callback itself");
        assert!(e.contains("out of memory"), "{e}");
        q.synchronize().unwrap();
        drop(a.allocate(40 * MB, None).unwrap());
        a.check_invariants().unwrap();
    });
}

/// Allocates and frees 4 KiB blocks until `rx` brings another thread's result, and returns
/// it; each of these calls must return well within `limit` (one held up by another thread's
/// wait for deferred frees takes the whole limit).
fn allocate_until(
    a: &CachingAllocator,
    rx: &std::sync::mpsc::Receiver<Result<(), String>>,
    limit: Duration,
) -> Result<(), String> {
    let mut slowest = Duration::ZERO;
    let mut calls = 0u32;
    let result = loop {
        if let Ok(r) = rx.try_recv() {
            break r;
        }
        let t = std::time::Instant::now();
        drop(a.allocate(4096, None).unwrap());
        slowest = slowest.max(t.elapsed());
        calls += 1;
        std::thread::yield_now();
    };
    assert!(calls > 0);
    assert!(slowest < limit / 2, "a 4 KiB allocation took {slowest:?} while another waited (limit {limit:?})");
    result
}

/// A deferred free that never completes (its queue held by a gate): a request that needs its
/// memory waits once for the limit, without the lock, and fails; its last wait does not wait
/// for the stuck free again (with its room claimed), so other threads keep allocating.
#[test]
fn a_stuck_deferred_free_does_not_hold_up_other_threads() {
    within("stuck free", Duration::from_secs(120 * common::time_scale() as u64), || {
        let limit = Duration::from_secs(3) * common::time_scale().min(4);
        let a = common::allocator_waiting("", 64 * MB, limit);
        let (q, gate, big) = common::gated_block(&a);
        q.fill(big.mem(), 7).unwrap();
        drop(big);
        let (tx, rx) = std::sync::mpsc::channel();
        let a2 = a.clone();
        let waiter = std::thread::spawn(move || {
            let _ = tx.send(a2.allocate(40 * MB, None).map(drop).map_err(|e| e.to_string()));
        });
        let e = allocate_until(&a, &rx, limit).expect_err("the memory is held by a stuck free");
        assert!(e.contains(&format!("{} bytes of the memory reserved but free are blocks freed", 40 * MB)), "{e}");
        waiter.join().unwrap();
        common::open_and_serve_40_mib(&a, gate, &q);
    });
}
