//! Hostile review of issue 13 (markers, inline CPU work, lent operands, kernel chains, deferred
//! frees by markers): each test hammers one scenario from several threads. A hang fails the
//! test through a watchdog (the body runs on its own thread) instead of stalling the run.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex, mpsc};
use std::time::Duration;

use common::{QueueGate, Rng, allocator, pattern, scaled};
use dmabuf_rt::caching::CachingAllocator;
use dmabuf_rt::caching::stats::AGGREGATE;
use dmabuf_rt::queue::{CopyEngine, HostBuffer, Mem, Queue, after_queues};

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;

/// Runs `f` on its own thread; fails if it does not finish within `secs` (a hang).
fn watchdog(what: &str, secs: u64, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(secs * common::time_scale() as u64)) {
        Ok(()) => h.join().unwrap(),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(e) = h.join() {
                std::panic::resume_unwind(e)
            }
        }
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{what}: hung (no progress in {secs} s)"),
    }
}

/// Every deferred free completed: nothing active, the pool consistent.
fn drained(a: &CachingAllocator, what: &str) {
    let s = a.stats();
    assert_eq!(s.active_bytes[AGGREGATE].current, 0, "{what}: a deferred free never completed (lost free)");
    a.check_invariants().unwrap_or_else(|e| panic!("{what}: {e}"));
}

/// Four threads: each makes a private queue per round, uses a block on it and on a random
/// subset of shared queues (some held by gates), frees the block, then opens its gate and
/// drops the private queue (sometimes before the free, sometimes after). The shared queues'
/// markers and the dropped queue's markers must all pass: nothing stays active.
#[test]
fn deferred_frees_with_private_queues_dropped_from_four_threads() {
    watchdog("private queues dropped", 120, || {
        let a = allocator("", 512 * MB as u64);
        let shared: Arc<Vec<Queue>> = Arc::new((0..3).map(|_| Queue::new().unwrap()).collect());
        let bar = Arc::new(Barrier::new(4));
        let hs: Vec<_> = (0..4u64)
            .map(|t| {
                let (a, shared, bar) = (a.clone(), Arc::clone(&shared), Arc::clone(&bar));
                std::thread::spawn(move || {
                    let mut rng = Rng(0x1300 + t);
                    let host = HostBuffer::new(64 * KB).unwrap();
                    bar.wait();
                    for _ in 0..scaled(150) {
                        let p = Queue::new().unwrap();
                        let size = [512, 4 * KB, 64 * KB, 2 * MB][rng.below(4) as usize];
                        let home = if rng.below(2) == 0 { None } else { Some(&shared[t as usize % 3]) };
                        let mut b = a.allocate(size, home).unwrap();
                        let gate = if rng.below(2) == 0 { Some(QueueGate::close(&p)) } else { None };
                        b.record_queue(&p);
                        let n = size.min(host.len());
                        p.copy(b.mem().range(0, n).unwrap(), Mem::from(&host).range(0, n).unwrap()).unwrap();
                        for q in shared.iter() {
                            if rng.below(2) == 0 {
                                b.record_queue(q);
                                q.fill(b.mem(), t as u8).unwrap();
                            }
                        }
                        if rng.below(2) == 0 {
                            drop(b);
                            drop(gate);
                            drop(p);
                        } else {
                            drop(gate);
                            drop(p);
                            drop(b);
                        }
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        for q in shared.iter() {
            q.synchronize().unwrap();
        }
        drained(&a, "private queues");
        drop(shared);
        drained(&a, "shared queues dropped");
    });
}

/// A queue blocked in a wait for an event recorded on a gated queue, with a deferred free's
/// marker behind the wait, is dropped (from another thread, racing the wait's start). Drop must
/// return (the wait is woken, no 5 ms poll to save it), and the marker must pass.
#[test]
fn a_queue_dropped_while_its_wait_blocks_passes_the_markers_behind_it() {
    watchdog("wait woken on drop", 120, || {
        let a = allocator("", 256 * MB as u64);
        let hs: Vec<_> = (0..4u64)
            .map(|t| {
                let a = a.clone();
                std::thread::spawn(move || {
                    let mut rng = Rng(0x2300 + t);
                    let q2 = Queue::new().unwrap();
                    for round in 0..scaled(200) {
                        let gate = QueueGate::close(&q2);
                        let e = q2.record().unwrap();
                        let q1 = Queue::builder().inline_max(if round % 2 == 0 { 0 } else { 64 * KB }).build().unwrap();
                        q1.wait(&e).unwrap();
                        let mut b = a.allocate(4 * KB, None).unwrap();
                        b.record_queue(&q1);
                        q1.fill(b.mem(), 7).unwrap();
                        drop(b);
                        if rng.below(2) == 0 {
                            // Dropped on another thread while this one holds the gate.
                            std::thread::spawn(move || drop(q1)).join().unwrap();
                        } else {
                            drop(q1);
                        }
                        assert!(e.query().is_ok_and(|done| !done), "the gate still holds q2");
                        gate.open();
                        e.synchronize(None).unwrap();
                    }
                    q2.synchronize().unwrap();
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        drained(&a, "wait abandoned on drop");
    });
}

/// A queue whose callbacks panic, whose error is cleared from another thread at random, while
/// three threads free blocks used on it (fills lent by reference, small copies run inline
/// once cleared). Every marker passes, whatever the epoch; nothing stays active; no panic.
#[test]
fn panicking_callbacks_and_clear_error_race_with_deferred_frees() {
    watchdog("panic + clear_error", 120, || {
        let a = allocator("", 256 * MB as u64);
        let q = Arc::new(Queue::new().unwrap());
        let home = Arc::new(Queue::new().unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let chaos = {
            let (q, stop) = (Arc::clone(&q), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut rng = Rng(0x3300);
                let mut panics = 0;
                while !stop.load(Ordering::Relaxed) {
                    match rng.below(3) {
                        // Bounded: a queue flooded with callbacks only grows.
                        0 if panics < 300 => {
                            panics += 1;
                            q.callback(|_| std::panic::resume_unwind(Box::new("hostile callback"))).unwrap();
                            let _ = q.record().map(|e| e.synchronize(None));
                        }
                        1 => {
                            q.clear_error();
                        }
                        _ => std::thread::yield_now(),
                    }
                }
            })
        };
        let hs: Vec<_> = (0..3u64)
            .map(|t| {
                let (a, q, home) = (a.clone(), Arc::clone(&q), Arc::clone(&home));
                std::thread::spawn(move || {
                    let host = HostBuffer::new(4 * KB).unwrap();
                    let mut rng = Rng(0x3310 + t);
                    for _ in 0..scaled(1500) {
                        let mut b = a.allocate(4 * KB, Some(&home)).unwrap();
                        b.record_queue(&q);
                        let m = b.mem();
                        q.fill(&m, t as u8).unwrap();
                        q.copy(&host, &m).unwrap();
                        if rng.below(8) == 0 {
                            let _ = q.synchronize();
                        }
                        drop(m);
                        drop(b);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        chaos.join().unwrap();
        let _ = q.synchronize();
        q.clear_error();
        q.synchronize().unwrap();
        home.synchronize().unwrap();
        drained(&a, "panic + clear_error");
    });
}

/// Kernel-engine copies from four threads on one queue (chained on the ring), each thread's
/// data moving host -> A -> B -> C -> host through blocks freed right after submission and
/// reused by the other threads (all bound to the queue, so reuse is ordered by it). Every
/// round must read its own pattern back: a chain that reorders or drops a link fails.
#[test]
fn kernel_chains_from_four_threads_keep_each_threads_bytes() {
    watchdog("kernel chains", 180, || {
        let a = allocator("", 256 * MB as u64);
        let q = Arc::new(Queue::builder().engine(CopyEngine::Kernel).inline_max(0).build().unwrap());
        let bad = Arc::new(AtomicUsize::new(0));
        let hs: Vec<_> = (0..4u8)
            .map(|t| {
                let (a, q, bad) = (a.clone(), Arc::clone(&q), Arc::clone(&bad));
                std::thread::spawn(move || {
                    let mut rng = Rng(0x4300 + t as u64);
                    for round in 0..scaled(300) {
                        let len = [512, 4 * KB, 20 * KB][rng.below(3) as usize];
                        let want = pattern(len, t.wrapping_mul(37).wrapping_add(round as u8));
                        let src = HostBuffer::from_slice(&want).unwrap();
                        let out = HostBuffer::new(len).unwrap();
                        let blocks: Vec<_> = (0..3).map(|_| a.allocate(len, Some(&q)).unwrap()).collect();
                        let mems: Vec<Mem> = blocks.iter().map(|b| b.mem()).collect();
                        q.copy(&mems[0], &src).unwrap();
                        q.copy(&mems[1], &mems[0]).unwrap();
                        q.copy(&mems[2], &mems[1]).unwrap();
                        q.copy(&out, &mems[2]).unwrap();
                        // Freed at once: reuse by another thread is ordered behind these copies.
                        drop(mems);
                        drop(blocks);
                        if round % 4 == 3 || rng.below(3) == 0 {
                            q.synchronize().unwrap();
                        } else {
                            let e = q.record().unwrap();
                            e.synchronize(None).unwrap();
                        }
                        if out.to_vec() != want {
                            bad.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(bad.load(Ordering::Relaxed), 0, "rounds that read back another thread's bytes or stale ones");
        drained(&a, "kernel chains");
    });
}

/// Raw frees (the pool lock held while placing markers, pool -> queue lock order) racing with
/// inline copies and fills on the same queues, and with those queues being replaced (dropped)
/// by another thread: no deadlock, every free completes.
#[test]
fn raw_frees_race_inline_work_and_queue_drops() {
    watchdog("raw frees", 120, || {
        let a = allocator("", 256 * MB as u64);
        let queues: Arc<Mutex<Vec<Arc<Queue>>>> =
            Arc::new(Mutex::new((0..3).map(|_| Arc::new(Queue::new().unwrap())).collect()));
        let stop = Arc::new(AtomicBool::new(false));
        let mut hs = Vec::new();
        // Inline work keeping the queues' state locks busy.
        for t in 0..2u64 {
            let (queues, stop) = (Arc::clone(&queues), Arc::clone(&stop));
            hs.push(std::thread::spawn(move || {
                let (x, y) = (HostBuffer::new(4 * KB).unwrap(), HostBuffer::new(4 * KB).unwrap());
                let mut rng = Rng(0x5300 + t);
                while !stop.load(Ordering::Relaxed) {
                    let q = Arc::clone(&queues.lock().unwrap()[rng.below(3) as usize]);
                    q.copy(&x, &y).unwrap();
                    q.fill(&x, 3).unwrap();
                }
            }));
        }
        // The replacer.
        {
            let (queues, stop) = (Arc::clone(&queues), Arc::clone(&stop));
            hs.push(std::thread::spawn(move || {
                let mut rng = Rng(0x5310);
                while !stop.load(Ordering::Relaxed) {
                    let fresh = Arc::new(Queue::new().unwrap());
                    let old = std::mem::replace(&mut queues.lock().unwrap()[rng.below(3) as usize], fresh);
                    drop(old);
                    std::thread::yield_now();
                }
            }));
        }
        let frees: Vec<_> = (0..2u64)
            .map(|t| {
                let (a, queues) = (a.clone(), Arc::clone(&queues));
                std::thread::spawn(move || {
                    let mut rng = Rng(0x5320 + t);
                    let host = HostBuffer::new(64 * KB).unwrap();
                    for _ in 0..scaled(2000) {
                        let qs: Vec<Arc<Queue>> = queues.lock().unwrap().clone();
                        let size = [512, 4 * KB, 64 * KB][rng.below(3) as usize];
                        let p = a.allocate_raw(size, None).unwrap();
                        for q in &qs {
                            if rng.below(2) == 0 {
                                a.record_queue_raw(p, q).unwrap();
                                let m = a.raw_mem(p, size).unwrap();
                                q.copy(&m, Mem::from(&host).range(0, size).unwrap()).unwrap();
                            }
                        }
                        a.free_raw(p).unwrap();
                    }
                })
            })
            .collect();
        for h in frees {
            h.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        for h in hs {
            h.join().unwrap();
        }
        let qs: Vec<Arc<Queue>> = std::mem::take(&mut *queues.lock().unwrap());
        for q in &qs {
            q.synchronize().unwrap();
        }
        drained(&a, "raw frees");
    });
}

/// `after_queues` whose closure drops the last owner of the very queue it waited on, while
/// another thread submits records to that queue through a handle (they run inline on that
/// thread, which then runs the closure). Dropping a queue from the closure must not deadlock.
#[test]
fn after_queues_closure_dropping_its_queue_while_records_run_inline() {
    watchdog("after_queues drop", 120, || {
        for _ in 0..scaled(2000) {
            let q = Queue::new().unwrap();
            let h = q.handle();
            let holder = Arc::new(Mutex::new(Some(q)));
            let stop = Arc::new(AtomicBool::new(false));
            let ran = Arc::new(AtomicUsize::new(0));
            let sub = {
                let (h, stop) = (h.clone(), Arc::clone(&stop));
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        if h.record().is_err() {
                            break;
                        }
                    }
                })
            };
            let mut placed = 0;
            for _ in 0..50 {
                let (holder2, ran2) = (Arc::clone(&holder), Arc::clone(&ran));
                after_queues([h.clone()], move || {
                    ran2.fetch_add(1, Ordering::Relaxed);
                    let q = holder2.lock().unwrap_or_else(|p| p.into_inner()).take();
                    drop(q);
                });
                placed += 1;
                if ran.load(Ordering::Relaxed) > 0 {
                    break;
                }
            }
            stop.store(true, Ordering::Relaxed);
            sub.join().unwrap();
            drop(holder.lock().unwrap().take());
            // Every closure placed runs once its queue has passed (or is gone).
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while ran.load(Ordering::Relaxed) < placed {
                assert!(std::time::Instant::now() < deadline, "an after_queues closure never ran");
                std::thread::yield_now();
            }
        }
    });
}

/// An allocator on shmem of `capacity` bytes (with `conf`, else the environment's settings)
/// whose waits for deferred frees and queues are limited to an hour: a wait that is not woken
/// is a hang the watchdog reports.
fn waiting_allocator(conf: Option<&str>, capacity: usize) -> CachingAllocator {
    let mut b = CachingAllocator::builder(dmabuf_rt::source::ShmemSource::new().reserve(false));
    if let Some(conf) = conf {
        b = b.config(dmabuf_rt::caching::Config::parse(conf).unwrap());
    }
    b.capacity(capacity as u64).pending_wait_limit(Duration::from_secs(3600)).build().unwrap()
}

/// Another thread allocates `size` bytes while this one opens `gate` (after a yield in even
/// rounds, so that either may come first); the allocation must succeed.
fn allocate_while_opening(a: &CachingAllocator, size: usize, gate: QueueGate, round: usize) {
    let bar = Arc::new(Barrier::new(2));
    let waiter = {
        let (a, bar) = (a.clone(), Arc::clone(&bar));
        std::thread::spawn(move || {
            bar.wait();
            a.allocate(size, None).map(drop).map_err(|e| e.to_string())
        })
    };
    bar.wait();
    if round % 2 == 0 {
        std::thread::yield_now();
    }
    gate.open();
    waiter.join().unwrap().unwrap_or_else(|e| panic!("round {round}: {e}"));
}

/// The OOM ladder's wait for deferred frees (`Pending::wait_zero`, a condvar now): the whole
/// capacity is one block used on a gated queue and freed; another thread then allocates it
/// (it must sleep until the free completes) while this one opens the gate. With an hour-long
/// wait limit, a lost wake-up is a hang, and an early give-up an out-of-memory error.
#[test]
fn allocations_waiting_for_a_deferred_free_are_woken_when_it_completes() {
    watchdog("pending wake-up", 120, || {
        let a = waiting_allocator(Some("expandable_segments:False"), 20 * MB);
        let q2 = Queue::new().unwrap();
        for round in 0..scaled(300) {
            let mut b = a.allocate(12 * MB, None).unwrap();
            let gate = QueueGate::close(&q2);
            b.record_queue(&q2);
            q2.fill(b.mem(), round as u8).unwrap();
            drop(b);
            allocate_while_opening(&a, 12 * MB, gate, round);
        }
        q2.synchronize().unwrap();
        drained(&a, "pending wake-up");
    });
}

/// The same wait while a newer deferred free stays pending throughout (a small block used on
/// a third queue, gated shut until the end): the waiting allocation must be woken by the
/// completion of the free it needs, not wait for the pending count to reach zero, which it
/// never does here. (That wait slept to its limit, then retried: with another thread
/// requesting deferred frees all the time, an allocation refused with gigabytes about to be
/// free, `hostile_review24::preexisting_oom_with_large_deferred_raw_fills`.) With an hour-long
/// wait limit, waiting for zero is a hang the watchdog reports.
#[test]
fn allocations_waiting_for_a_deferred_free_are_woken_while_newer_frees_stay_pending() {
    watchdog("pending wake-up, newer free pending", 120, || {
        let a = waiting_allocator(Some("expandable_segments:False"), 20 * MB);
        let (q2, q3) = (Queue::new().unwrap(), Queue::new().unwrap());
        let stuck = QueueGate::close(&q3);
        let mut small = a.allocate(4 * KB, None).unwrap();
        small.record_queue(&q3);
        q3.fill(small.mem(), 1).unwrap();
        drop(small);
        for round in 0..scaled(300) {
            let mut b = a.allocate(12 * MB, None).unwrap();
            let gate = QueueGate::close(&q2);
            b.record_queue(&q2);
            q2.fill(b.mem(), round as u8).unwrap();
            drop(b);
            allocate_while_opening(&a, 12 * MB, gate, round);
        }
        stuck.open();
        q3.synchronize().unwrap();
        q2.synchronize().unwrap();
        drained(&a, "pending wake-up, newer free pending");
    });
}

/// Cached memory under a queue's work in flight is not given back (that work may still use
/// the freed block), so an allocation that needs it waits for the queues, as PyTorch's last
/// rung does through `cudaFree`'s synchronization, then frees it: a 40 MiB block is used on
/// a gated queue and freed (no deferred free: it was not recorded on another queue), and
/// another thread asks for 40 MiB of a 64 MiB capacity while this one opens the gate. Without
/// the wait, the rounds where the gate is still shut fail with out-of-memory.
#[test]
fn allocations_needing_memory_under_queued_work_wait_for_the_queue() {
    watchdog("cached memory under queued work", 120, || {
        let a = waiting_allocator(None, 64 * MB);
        let q1 = Queue::new().unwrap();
        for round in 0..scaled(100) {
            let b = a.allocate(40 * MB, Some(&q1)).unwrap();
            let gate = QueueGate::close(&q1);
            q1.fill(b.mem(), round as u8).unwrap();
            drop(b);
            allocate_while_opening(&a, 40 * MB, gate, round);
        }
        q1.synchronize().unwrap();
        drained(&a, "cached memory under queued work");
    });
}

/// `Queue::synchronize` returns only after the markers placed before it have passed (the
/// promise in `finish`'s documentation): three threads, each with its own allocator, free a
/// block used on a queue another thread keeps busy with large fills (run by the executor),
/// synchronize the queue, and expect their free to have completed.
#[test]
fn synchronize_returns_after_the_markers_placed_before_it_have_passed() {
    watchdog("synchronize vs markers", 120, || {
        let q = Arc::new(Queue::new().unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let started = Arc::new(Barrier::new(4));
        let flood = {
            let (q, stop, started) = (Arc::clone(&q), Arc::clone(&stop), Arc::clone(&started));
            std::thread::spawn(move || {
                let big = HostBuffer::new(256 * KB).unwrap();
                let mut n = 0u64;
                started.wait();
                while !stop.load(Ordering::Relaxed) {
                    q.fill(&big, n as u8).unwrap();
                    n += 1;
                    if n % 8 == 0 {
                        q.synchronize().unwrap();
                    }
                }
            })
        };
        let hs: Vec<_> = (0..3)
            .map(|_| {
                let (q, started) = (Arc::clone(&q), Arc::clone(&started));
                std::thread::spawn(move || {
                    let a = allocator("", 64 * MB as u64);
                    let mut busy = 0;
                    started.wait();
                    for round in 0..scaled(30000) {
                        busy += usize::from(!q.is_idle());
                        let mut b = a.allocate(4 * KB, None).unwrap();
                        b.record_queue(&q);
                        drop(b);
                        q.synchronize().unwrap();
                        assert_eq!(
                            a.stats().active_bytes[AGGREGATE].current,
                            0,
                            "round {round}: synchronize returned before the free's marker passed"
                        );
                    }
                    assert!(busy > 0, "the queue was never busy: no marker was placed");
                })
            })
            .collect();
        let r: Vec<_> = hs.into_iter().map(|h| h.join()).collect();
        stop.store(true, Ordering::Relaxed);
        flood.join().unwrap();
        for x in r {
            if let Err(e) = x {
                std::panic::resume_unwind(e)
            }
        }
    });
}
