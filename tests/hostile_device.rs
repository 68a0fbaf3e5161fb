//! `dmabuf_rt::Device` called in odd orders: synchronize racing release_default_queue from
//! several threads, queues dropped while synchronize waits for them, synchronize and
//! release_default_queue from a callback of the default queue, allocations on a queue of
//! another device, an exhausted device under contention, a device dropped while its
//! allocations and queues live on (or dropped by a callback of its own default queue).
//!
//! Ordering is by gates and observed state, never by sleeps; every wait is bounded by a
//! watchdog (`bounded`), and the tests that count fds hold `serial()`.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, mpsc};
use std::time::Duration;

use common::{QueueGate, Rng, fd_summary, open_fds, pattern, scaled, serial, time_scale};
use dmabuf_rt::caching::stats::AGGREGATE;
use dmabuf_rt::queue::Queue;
use dmabuf_rt::source::ShmemSource;
use dmabuf_rt::{Access, Device, Error, ErrorKind};

const MB: usize = 1 << 20;

fn device(capacity: u64) -> Device {
    Device::builder(ShmemSource::new().reserve(false)).capacity(capacity).name("hostile").build().unwrap()
}

fn limit() -> Duration {
    Duration::from_secs(60 * u64::from(time_scale()))
}

/// Runs `f` on a thread of its own and fails if it has not finished within 60 s.
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    let t = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit()) {
        Ok(v) => {
            t.join().unwrap();
            v
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            std::panic::resume_unwind(t.join().expect_err("no value and no panic"))
        }
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("HANG: {what} did not finish within 60 s"),
    }
}

/// Runs `f` and fails if the process holds more fds afterwards. Fewer is no leak: a thread an
/// earlier test let go may close its last fds (its io_uring) a moment after that test ended,
/// during `f` (a CI run saw 7 before and 6 after); and fds `f`'s own threads close as they
/// exit are waited for (bounded).
fn no_fd_leaked<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let before = (open_fds(), fd_summary());
    let r = f();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while open_fds() > before.0 && std::time::Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert!(open_fds() <= before.0, "{what}: fds leaked\nbefore: {}\nafter:  {}", before.1, fd_summary());
    r
}

/// Operations queued on `q` and not started (from its `Debug`: the one window a test has on
/// whether another thread's record has reached the queue).
fn pending(q: &Queue) -> usize {
    let d = format!("{q:?}");
    let n = d.split("pending: ").nth(1).and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next());
    n.and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("no pending count in {d}"))
}

/// Spins (yielding) until `cond` holds, failing after the watchdog limit.
fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit(), "HANG: waited 60 s for {what}");
        std::thread::yield_now();
    }
}

/// Work submitted to the default queue before `synchronize` is called must have run when it
/// returns, even if another thread releases the default queue meanwhile: a released queue is
/// still the device's until its work is done. Deterministic: the work is held at a gate; the
/// release has taken the queue (its own wait is queued) before `synchronize` starts; the gate
/// opens only once `synchronize`'s wait has reached the queue too, so a `synchronize` that
/// skips the released queue returns with the gate still closed.
#[test]
fn synchronize_waits_for_a_default_queue_released_meanwhile() {
    let _s = serial();
    for _ in 0..scaled(100) {
        bounded("synchronize and a concurrent release", || {
            let dev = Arc::new(device(64 * MB as u64));
            let d1 = dev.default_queue().unwrap();
            let gate = QueueGate::close(&d1);
            let ran = Arc::new(AtomicUsize::new(0));
            let r = ran.clone();
            d1.callback(move |_| {
                r.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
            until("the gate to hold the queue", || pending(&d1) == 1);
            let release = {
                let dev = dev.clone();
                std::thread::spawn(move || dev.release_default_queue())
            };
            until("the release's wait to reach the queue", || pending(&d1) == 2);
            let (tx, rx) = mpsc::channel();
            let syncer = {
                let (dev, ran) = (dev.clone(), ran.clone());
                std::thread::spawn(move || {
                    let r = dev.synchronize();
                    let _ = tx.send(());
                    (r, ran.load(Ordering::SeqCst))
                })
            };
            let mut gate = Some(gate);
            until("synchronize to return", || {
                if gate.is_some() && pending(&d1) == 3 {
                    gate.take().unwrap().open();
                }
                rx.try_recv().is_ok()
            });
            let (r, seen) = syncer.join().unwrap();
            r.unwrap();
            assert_eq!(seen, 1, "synchronize returned before work queued on the released default queue ran");
            drop(gate);
            release.join().unwrap().unwrap();
        });
    }
}

/// Several threads synchronize, release the default queue, get it again and queue work on
/// it, at once, hundreds of times: every call succeeds, nothing hangs, every callback runs,
/// and the fds of every queue made are closed at the end.
#[test]
fn synchronize_release_and_default_queue_race_from_several_threads() {
    let _s = serial();
    no_fd_leaked("the race", || {
        bounded("synchronize / release_default_queue / default_queue", || {
            let dev = Arc::new(device(64 * MB as u64));
            let rounds = scaled(300);
            let start = Arc::new(Barrier::new(4));
            let submitted = Arc::new(AtomicUsize::new(0));
            let ran = Arc::new(AtomicUsize::new(0));
            let threads: Vec<_> = (0..4)
                .map(|t| {
                    let (dev, start, submitted, ran) = (dev.clone(), start.clone(), submitted.clone(), ran.clone());
                    std::thread::spawn(move || {
                        let mut rng = Rng(0xdead_beef + t);
                        let scratch = dev.allocate(4096).unwrap();
                        for _ in 0..rounds {
                            start.wait();
                            match (t, rng.below(4)) {
                                (0, _) | (1, 0) => dev.synchronize().unwrap(),
                                (1, _) => dev.release_default_queue().unwrap(),
                                _ => {
                                    let q = dev.default_queue().unwrap();
                                    q.fill(scratch.mem(), t as u8).unwrap();
                                    let ran = ran.clone();
                                    q.callback(move |r| {
                                        r.unwrap();
                                        ran.fetch_add(1, Ordering::SeqCst);
                                    })
                                    .unwrap();
                                    submitted.fetch_add(1, Ordering::SeqCst);
                                    if rng.below(8) == 0 {
                                        dev.synchronize().unwrap();
                                    }
                                }
                            }
                        }
                        dev.synchronize().unwrap();
                    })
                })
                .collect();
            threads.into_iter().for_each(|t| t.join().unwrap());
            dev.release_default_queue().unwrap();
            dev.synchronize().unwrap();
            assert_eq!(ran.load(Ordering::SeqCst), submitted.load(Ordering::SeqCst), "callbacks lost");
            assert_eq!(dev.allocator().stats().allocation[AGGREGATE].current, 0);
        });
    });
}

/// Queues dropped while `synchronize` waits for them: the drop lets the queue finish its
/// work, and `synchronize` returns Ok after that work, never before and never hanging.
#[test]
fn queues_dropped_while_synchronize_waits_count_as_passed() {
    let _s = serial();
    no_fd_leaked("dropped queues", || {
        bounded("queues dropped during synchronize", || {
            let dev = Arc::new(device(64 * MB as u64));
            let mut rng = Rng(42);
            for _ in 0..scaled(200) {
                let q = dev.new_queue().unwrap();
                let gate = QueueGate::close(&q);
                let ran = Arc::new(AtomicUsize::new(0));
                let r = ran.clone();
                q.callback(move |_| {
                    r.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
                until("the gate to hold the queue", || pending(&q) == 1);
                let syncer = {
                    let (dev, ran) = (dev.clone(), ran.clone());
                    std::thread::spawn(move || dev.synchronize().map(|()| ran.load(Ordering::SeqCst)))
                };
                until("synchronize's wait to reach the queue", || pending(&q) == 2);
                // Drop the queue (its drop waits for the gate) and open the gate, in either order.
                let dropper = if rng.below(2) == 0 {
                    let dropper = std::thread::spawn(move || drop(q));
                    gate.open();
                    dropper
                } else {
                    gate.open();
                    std::thread::spawn(move || drop(q))
                };
                dropper.join().unwrap();
                assert_eq!(syncer.join().unwrap().unwrap(), 1, "synchronize returned before the dropped queue's work");
            }
            dev.synchronize().unwrap();
        });
    });
}

/// From a callback of the default queue: `synchronize` waits for the other queues and
/// returns; `release_default_queue` lets the queue go without waiting for itself (its work
/// before the callback has run, its work after cannot run until the callback returns), and a
/// later `default_queue` is a new queue. Neither hangs nor fails.
#[test]
fn synchronize_and_release_from_a_callback_of_the_default_queue() {
    let _s = serial();
    for _ in 0..scaled(50) {
        bounded("calls from a callback of the default queue", || {
            let dev = Arc::new(device(64 * MB as u64));
            let d = dev.default_queue().unwrap();
            let other = dev.new_queue().unwrap();
            let other_ran = Arc::new(AtomicUsize::new(0));
            let gate = QueueGate::close(&other);
            let o = other_ran.clone();
            other
                .callback(move |_| {
                    o.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
            let (tx, rx) = mpsc::channel();
            let (dev2, o) = (dev.clone(), other_ran.clone());
            let old_id = d.id();
            d.callback(move |_| {
                let s = dev2.synchronize();
                let seen = o.load(Ordering::SeqCst);
                let r = dev2.release_default_queue();
                let new_id = dev2.default_queue().map(|q| q.id());
                let _ = tx.send((s, seen, r, new_id));
            })
            .unwrap();
            let after = Arc::new(AtomicUsize::new(0));
            let a = after.clone();
            d.callback(move |_| {
                a.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
            gate.open();
            let (s, seen, r, new_id) =
                rx.recv_timeout(limit()).expect("HANG: a call from the default queue's callback");
            s.unwrap();
            assert_eq!(seen, 1, "synchronize from the callback did not wait for the device's other queue");
            r.unwrap_or_else(|e| panic!("release_default_queue from its own callback: {e} ({:?})", e.kind()));
            assert_ne!(new_id.unwrap(), old_id, "the released default queue is still the default");
            drop(d);
            assert_eq!(
                after.load(Ordering::SeqCst),
                1,
                "work queued after the callback ran once the queue was dropped"
            );
            dev.synchronize().unwrap();
        });
    }
}

/// Memory of one device bound to a queue of another: allocated, used on that queue, freed
/// while the queue still has it in use (a deferred free), the queue dropped afterwards; the
/// allocator's counts go back to zero and its invariants hold.
#[test]
fn allocations_on_a_queue_of_another_device() {
    let _s = serial();
    no_fd_leaked("cross-device allocations", || {
        bounded("cross-device allocations", || {
            let a = device(64 * MB as u64);
            let b = device(64 * MB as u64);
            for i in 0..scaled(100) {
                let qb = b.new_queue().unwrap();
                let gate = QueueGate::close(&qb);
                let x = a.allocate_on(MB + i, &qb).unwrap();
                let src = b.allocate(MB + i).unwrap();
                {
                    let v = src.cpu_access(Access::Write).unwrap();
                    v.write(0, &pattern(MB + i, i as u8)).unwrap();
                    v.end().unwrap();
                }
                qb.copy(x.mem(), src.mem()).unwrap();
                // A's synchronize does not wait for B's queue (it is not A's), and does not hang.
                a.synchronize().unwrap();
                drop(x);
                // Freed while B's queue still has the copy into it queued (a deferred free).
                let y = a.allocate_on(MB + i, &qb).unwrap();
                gate.open();
                b.synchronize().unwrap();
                drop(y);
                if i % 2 == 0 {
                    drop(qb);
                    drop(src);
                } else {
                    drop(src);
                    drop(qb);
                }
            }
            a.synchronize().unwrap();
            assert_eq!(a.allocator().stats().allocation[AGGREGATE].current, 0);
            a.allocator().check_invariants().unwrap();
            a.empty_cache();
            assert_eq!(a.allocator().stats().reserved_bytes[AGGREGATE].current, 0, "cache not emptied");
        });
    });
}

/// A small device, four threads allocating and freeing more than it holds: each refusal is
/// OutOfMemory with the device's numbers, never another error, a panic or a hang; at the end
/// nothing is allocated and the invariants hold.
#[test]
fn an_exhausted_device_under_contention() {
    let _s = serial();
    bounded("an exhausted device under contention", || {
        let dev = Arc::new(device(16 * MB as u64));
        let ooms = Arc::new(AtomicUsize::new(0));
        let start = Arc::new(Barrier::new(4));
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let (dev, ooms, start) = (dev.clone(), ooms.clone(), start.clone());
                std::thread::spawn(move || {
                    let q = dev.new_queue().unwrap();
                    let mut rng = Rng(7 + t);
                    let mut held = Vec::new();
                    start.wait();
                    // A scaled-down run (the kernel lane's) goes on past its steps until the
                    // device was exhausted once (checked below), up to the full count.
                    for i in 0..300 {
                        if i >= scaled(300) && ooms.load(Ordering::Relaxed) > 0 {
                            break;
                        }
                        let size = 1 + rng.below(6 * MB as u64) as usize;
                        let r = if rng.below(2) == 0 { dev.allocate(size) } else { dev.allocate_on(size, &q) };
                        match r {
                            Ok(a) => {
                                if rng.below(4) == 0 {
                                    q.fill(a.mem(), 0x5a).unwrap();
                                }
                                held.push(a);
                            }
                            Err(e) => {
                                assert_eq!(e.kind(), ErrorKind::OutOfMemory, "{e}");
                                assert!(matches!(e, Error::AllocatorOom { .. }), "{e:?}");
                                assert!(e.to_string().contains("capacity 16777216"), "{e}");
                                ooms.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        while held.len() > 2 || (!held.is_empty() && rng.below(3) == 0) {
                            let i = rng.below(held.len() as u64) as usize;
                            held.swap_remove(i);
                        }
                    }
                    drop(held);
                    q.synchronize().unwrap();
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert!(ooms.load(Ordering::Relaxed) > 0, "the device was never exhausted: the test tested nothing");
        dev.synchronize().unwrap();
        assert_eq!(dev.allocator().stats().allocation[AGGREGATE].current, 0);
        dev.allocator().check_invariants().unwrap();
        drop(dev.allocate(16 * MB).unwrap());
    });
}

/// The device dropped first: its allocations, queues and host memory go on working, and give
/// everything back when they are dropped; no fd outlives them.
#[test]
fn a_device_dropped_while_its_allocations_and_queues_live() {
    let _s = serial();
    no_fd_leaked("a dropped device", || {
        bounded("a dropped device", || {
            let dev = device(64 * MB as u64);
            let q = dev.new_queue().unwrap();
            let d = dev.default_queue().unwrap();
            let a = dev.allocate_on(MB, &q).unwrap();
            let b = dev.allocate(MB).unwrap();
            let h = dev.allocate_host(MB).unwrap();
            let alloc = dev.allocator().clone();
            let gate = QueueGate::close(&d);
            drop(dev);
            {
                let v = h.cpu_access(Access::Write).unwrap();
                v.write(0, &pattern(MB, 3)).unwrap();
                v.end().unwrap();
            }
            q.copy(a.mem(), h.mem().range(0, MB).unwrap()).unwrap();
            q.synchronize().unwrap();
            d.copy(b.mem(), a.mem()).unwrap();
            gate.open();
            d.synchronize().unwrap();
            let mut got = vec![0; MB];
            let v = b.cpu_access(Access::Read).unwrap();
            v.read(0, &mut got).unwrap();
            v.end().unwrap();
            assert!(got == pattern(MB, 3), "copies after the device was dropped");
            assert_eq!(alloc.stats().allocation[AGGREGATE].current, 2);
            drop((a, b, h, q, d));
            assert_eq!(alloc.stats().allocation[AGGREGATE].current, 0);
            alloc.empty_cache();
            assert_eq!(alloc.stats().reserved_bytes[AGGREGATE].current, 0);
        });
    });
}

/// A device whose last holder is a callback on its own default queue: dropping it there
/// drops the default queue on its own executor, which must neither hang nor panic, and the
/// queue still runs what was queued after the callback.
#[test]
fn a_device_dropped_by_a_callback_of_its_own_default_queue() {
    let _s = serial();
    for _ in 0..scaled(100) {
        bounded("a device dropped by its own queue's callback", || {
            let dev = device(64 * MB as u64);
            let d = dev.default_queue().unwrap();
            let handle = d.handle();
            let a = dev.allocate(4096).unwrap();
            let gate = QueueGate::close(&d);
            d.callback(move |_| drop(dev)).unwrap();
            let (tx, rx) = mpsc::channel();
            let tx2 = tx.clone();
            d.fill(a.mem(), 1).unwrap();
            d.callback(move |r| {
                let _ = tx2.send(r.is_ok());
            })
            .unwrap();
            handle.on_exit(move || {
                let _ = tx.send(true);
            });
            drop(d);
            gate.open();
            assert!(
                rx.recv_timeout(limit()).expect("HANG: work after the drop"),
                "work after the device's drop failed"
            );
            assert!(rx.recv_timeout(limit()).expect("HANG: the default queue never exited"));
            assert!(handle.is_gone());
            drop(a);
        });
    }
}
