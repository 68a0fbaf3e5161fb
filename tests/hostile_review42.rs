//! Review of the OOM ladder's exclusive wait (58b96f3, 46f9692): a request whose claim's
//! memory went to allocations admitted during its wait, and from them into deferred frees of
//! their own, waits once more keeping every other allocation out (`pool/claims.rs`). What a
//! careless or hostile caller could do to it: several requests claiming at once (one may go
//! exclusive while another's claim is in force), threads that keep freeing on busy queues of
//! their own all the while, host callbacks that call the allocator from those queues (never
//! kept out), and a request the memory in use leaves no room for (a true out-of-memory: it
//! must fail without an exclusive wait that holds everyone up). Every wait is bounded: a
//! hang fails the watchdog. It found no fault in 46f9692: in these races the exclusive wait
//! itself is rare (none in three runs of the first test; `caching::last_wait_tests` has the
//! deterministic case), so this file is a net for hangs and false out-of-memory errors
//! around it. A first version let the callbacks allocate memory the frees queued behind
//! them held: such a callback holds its queue up for the pending-wait limit, twice
//! (`hostile_review29`'s documented case), and the requests waiting on that queue failed.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use common::scaled;
use common::wait::within;
use dmabuf_rt::caching::stats::AGGREGATE;
use dmabuf_rt::queue::Queue;
use dmabuf_rt::{Access, Error};

const MB: usize = 1 << 20;

fn watchdog() -> Duration {
    Duration::from_secs(180) * common::time_scale()
}

/// Two threads allocate 20 MiB blocks, fill each on a busy queue of their own and free it at
/// once (deferred frees, their backlog holding much of the memory), and every eighth fill
/// queues a host callback that allocates 512 bytes and reads the stats; two other threads ask
/// for 60 MiB again and again. 168 MiB hold both requests, both churners' live blocks and
/// the callbacks' small segment, so every request must be served once the frees outstanding complete, whoever claims, goes
/// exclusive or is kept out meanwhile. Classic segments (with `max_split_size_mb`, PyTorch's
/// remedy for their fragmentation) and page-stitched ones.
#[test]
fn concurrent_claims_churners_and_callbacks_every_request_is_served() {
    for conf in ["expandable_segments:False,max_split_size_mb:32", "expandable_segments:True,page_stitching:True"] {
        within(conf, watchdog(), move || churn(conf));
    }
}

fn churn(conf: &'static str) {
    let a = common::allocator_waiting(conf, 168 * MB, Duration::from_secs(10) * common::time_scale());
    // Keeps a small segment: the callbacks' 512-byte blocks come from it.
    let pin = a.allocate(512, None).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let bar = Arc::new(Barrier::new(4));
    let callbacks = Arc::new(AtomicUsize::new(0));
    let frees = Arc::new(AtomicUsize::new(0));
    let churners: Vec<_> = (0..2u8)
        .map(|c| {
            let (a, stop, bar, callbacks, frees) =
                (a.clone(), Arc::clone(&stop), Arc::clone(&bar), Arc::clone(&callbacks), Arc::clone(&frees));
            std::thread::spawn(move || {
                let q = Queue::builder().inline_max(0).build().unwrap();
                let mut ooms = 0usize;
                bar.wait();
                let mut i = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    match a.allocate(20 * MB, None) {
                        Ok(mut b) => {
                            b.record_queue(&q);
                            // Three passes: work that outlasts the allocations, so the backlog
                            // of frees holds most of the memory.
                            for _ in 0..3 {
                                q.fill(b.mem(), c).unwrap();
                            }
                            if i % 8 == 0 {
                                let (a, callbacks) = (a.clone(), Arc::clone(&callbacks));
                                q.callback(move |_| {
                                    // Never kept out, and served from the small segment the
                                    // pin keeps (an allocation that needed the memory of frees
                                    // queued behind its own callback would hold its queue up for
                                    // the pending-wait limit, twice: `hostile_review29`).
                                    a.allocate(512, None).map(drop).unwrap_or_else(|e| panic!("{conf}: callback: {e}"));
                                    let _ = a.stats();
                                    callbacks.fetch_add(1, Ordering::Relaxed);
                                })
                                .unwrap();
                            }
                            drop(b);
                            frees.fetch_add(1, Ordering::Relaxed);
                        }
                        // A churner has no claim: it may be refused while the backlog holds
                        // the memory.
                        Err(Error::AllocatorOom { .. }) => ooms += 1,
                        Err(e) => panic!("{conf}: churner {c}: {e}"),
                    }
                }
                q.synchronize().unwrap();
                ooms
            })
        })
        .collect();
    let failures = Arc::new(Mutex::new(Vec::new()));
    let requesters: Vec<_> = (0..2u8)
        .map(|r| {
            let (a, bar, failures, frees) = (a.clone(), Arc::clone(&bar), Arc::clone(&failures), Arc::clone(&frees));
            std::thread::spawn(move || {
                bar.wait();
                for round in 0..scaled(60) {
                    // Let the churners' frees take the memory again.
                    let seen = frees.load(Ordering::Relaxed);
                    while frees.load(Ordering::Relaxed) < seen + 2 {
                        std::thread::yield_now();
                    }
                    match a.allocate(60 * MB, None) {
                        Ok(b) => {
                            let tag = [0x40 + r + 2 * (round % 64) as u8; 4096];
                            b.cpu_access(Access::Write).unwrap().write(60 * MB - 4096, &tag).unwrap();
                            let mut back = [0u8; 4096];
                            b.cpu_access(Access::Read).unwrap().read(60 * MB - 4096, &mut back).unwrap();
                            assert_eq!(back, tag, "{conf}: requester {r} round {round}: written by another");
                        }
                        Err(e) => failures.lock().unwrap().push(format!("requester {r} round {round}: {e}")),
                    }
                }
            })
        })
        .collect();
    for h in requesters {
        h.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let ooms: usize = churners.into_iter().map(|h| h.join().unwrap()).sum();
    let st = a.stats();
    eprintln!(
        "{conf}: {} exclusive waits, {} churner OOMs, {} callbacks ran",
        st.num_exclusive_waits,
        ooms,
        callbacks.load(Ordering::Relaxed)
    );
    let failures = failures.lock().unwrap();
    assert!(
        failures.is_empty(),
        "{conf}: 60 MiB of 168 refused under churning deferred frees:\n{}",
        failures.join("\n")
    );
    drop(pin);
    common::wait::wait_until("deferred frees complete", watchdog(), || a.stats().allocation[AGGREGATE].current == 0);
    a.check_invariants().unwrap();
}

/// A request that the blocks in use leave no room for (40 MiB live of 64, 40 MiB asked),
/// while a thread keeps freeing 4 MiB blocks on a busy queue of its own (newer frees at every
/// final attempt): a true out-of-memory, which fails without an exclusive wait (none holds
/// the other threads up for nothing). From three threads at once.
#[test]
fn a_true_oom_under_newer_frees_fails_without_an_exclusive_wait() {
    within("true oom", watchdog(), || {
        for conf in ["expandable_segments:False", "expandable_segments:True,page_stitching:True"] {
            let a = common::allocator_waiting(conf, 64 * MB, Duration::from_secs(10) * common::time_scale());
            let live = a.allocate(40 * MB, None).unwrap();
            let stop = Arc::new(AtomicBool::new(false));
            let started = Arc::new(Barrier::new(2));
            let churner = {
                let (a, stop, started) = (a.clone(), Arc::clone(&stop), Arc::clone(&started));
                std::thread::spawn(move || {
                    let q = Queue::builder().inline_max(0).build().unwrap();
                    let mut first = true;
                    while !stop.load(Ordering::Relaxed) {
                        if let Ok(mut b) = a.allocate(4 * MB, None) {
                            b.record_queue(&q);
                            q.fill(b.mem(), 7).unwrap();
                        }
                        if std::mem::take(&mut first) {
                            started.wait();
                        }
                    }
                    q.synchronize().unwrap();
                })
            };
            started.wait();
            let hs: Vec<_> = (0..3)
                .map(|_| {
                    let a = a.clone();
                    std::thread::spawn(move || a.allocate(40 * MB, None).map(drop))
                })
                .collect();
            for h in hs {
                match h.join().unwrap() {
                    Err(Error::AllocatorOom { .. }) => {}
                    other => panic!("{conf}: 40 MiB with 40 of 64 in use: {other:?}"),
                }
            }
            stop.store(true, Ordering::Relaxed);
            churner.join().unwrap();
            assert_eq!(a.stats().num_exclusive_waits, 0, "{conf}: an exclusive wait for a true out-of-memory");
            drop(live);
            a.check_invariants().unwrap();
        }
    });
}
