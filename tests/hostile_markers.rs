//! Deferred frees by markers under a hostile multi-threaded caller: a block used on other
//! queues must not be handed out again before every one of those queues has run the work
//! submitted to it before the free, whatever the threads, the queues and the order of their
//! passage; and every deferred free must complete.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

use common::{QueueGate, Rng, allocator};
use dmabuf_rt::caching::stats::AGGREGATE;
use dmabuf_rt::queue::{self, HostBuffer, Mem, Queue, after_queues};

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;

/// A block used on three queues, each held by a gate, is freed; the gates open one at a time
/// in a random order. Until the last has passed, an allocation of the same size never gets
/// the block; once it has, the free completes (the block is reusable, nothing stays active).
#[test]
fn a_block_used_on_several_busy_queues_waits_for_the_last_of_them() {
    let mut rng = Rng(0x5eed_0013);
    for conf in ["", "expandable_segments:False"] {
        let a = allocator(conf, 256 * MB as u64);
        let q1 = Queue::new().unwrap();
        let others: Vec<Queue> = (0..3).map(|_| Queue::new().unwrap()).collect();
        for round in 0..common::scaled(200) {
            let size = [4 * KB, 64 * KB, 3 * MB][round % 3];
            let mut b = a.allocate(size, Some(&q1)).unwrap();
            let addr = b.as_ptr() as usize;
            let mut gates: Vec<Option<QueueGate>> = Vec::new();
            for q in &others {
                b.record_queue(q);
                gates.push(Some(QueueGate::close(q)));
            }
            drop(b);
            let mut order: Vec<usize> = (0..others.len()).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            for (k, &i) in order.iter().enumerate() {
                let last = k + 1 == order.len();
                gates[i].take().expect("each gate opens once").open();
                others[i].synchronize().unwrap();
                let c = a.allocate(size, Some(&q1)).unwrap();
                if !last {
                    assert_ne!(
                        c.as_ptr() as usize,
                        addr,
                        "{conf:?} round {round}: block reused with a queue still busy"
                    );
                }
            }
            assert_eq!(
                a.stats().active_bytes[AGGREGATE].current,
                0,
                "{conf:?} round {round}: a deferred free never completed"
            );
        }
    }
}

/// Four threads allocate blocks, fill them with their own pattern, record them on random
/// subsets of shared queues that other work keeps busy, queue a check of the pattern on one of
/// those queues and free the block at once. The check runs before the marker of that queue, so
/// it must always see the pattern: a block handed out before its queues passed is overwritten
/// by another thread's pattern and the check fails.
#[test]
fn frees_racing_on_busy_queues_never_hand_out_memory_still_in_use() {
    for conf in ["", "expandable_segments:False"] {
        let a = allocator(conf, 512 * MB as u64);
        let shared: Arc<Vec<Queue>> = Arc::new((0..3).map(|_| Queue::new().unwrap()).collect());
        let bad = Arc::new(AtomicUsize::new(0));
        let checked = Arc::new(AtomicUsize::new(0));
        let threads = 4;
        let bar = Arc::new(Barrier::new(threads));
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let (a, shared, bad, checked, bar) =
                    (a.clone(), Arc::clone(&shared), Arc::clone(&bad), Arc::clone(&checked), Arc::clone(&bar));
                std::thread::spawn(move || {
                    let mut rng = Rng(0xabcd_0000 + t as u64);
                    let own = Queue::new().unwrap();
                    bar.wait();
                    for i in 0..common::scaled(400) {
                        let size = [512, 8 * KB, 200 * KB, MB + 4096][rng.below(4) as usize];
                        let tag = (t as u8).wrapping_mul(67).wrapping_add(i as u8) | 1;
                        let mut b = a.allocate(size, Some(&own)).unwrap();
                        queue::fill_now(b.mem(), tag).unwrap();
                        let mask = 1 + rng.below(7) as usize;
                        let used: Vec<&Queue> = (0..3).filter(|k| mask & (1 << k) != 0).map(|k| &shared[k]).collect();
                        for q in &used {
                            b.record_queue(q);
                            // Keep the queue busy with a copy of its own, sometimes.
                            if rng.below(2) == 0 {
                                q.callback(|_| std::hint::black_box(())).unwrap();
                            }
                        }
                        let (m, bad, checked) = (b.mem(), Arc::clone(&bad), Arc::clone(&checked));
                        used[rng.below(used.len() as u64) as usize]
                            .callback(move |_| {
                                let host = HostBuffer::new(m.len()).unwrap();
                                let hm: Mem = (&host).into();
                                queue::copy_now(hm, m).unwrap();
                                let mut buf = vec![0u8; host.len()];
                                host.read(0, &mut buf).unwrap();
                                if buf.iter().any(|&x| x != tag) {
                                    bad.fetch_add(1, Ordering::Relaxed);
                                }
                                checked.fetch_add(1, Ordering::Relaxed);
                            })
                            .unwrap();
                        drop(b);
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
        assert_eq!(bad.load(Ordering::Relaxed), 0, "{conf:?}: a block was handed out while a queue still read it");
        assert_eq!(checked.load(Ordering::Relaxed), threads * common::scaled(400), "{conf:?}: checks lost");
        // Every deferred free completes (its marker passed) once the queues have drained.
        let active = a.stats().active_bytes[AGGREGATE].current;
        assert_eq!(active, 0, "{conf:?}: {active} bytes of deferred frees never completed");
    }
}

/// `after_queues` from many threads at once, on queues that threads keep submitting to and one
/// that is dropped midway: every closure runs exactly once, and only after the work submitted
/// to its queues before the call.
#[test]
fn after_queues_runs_once_after_the_work_before_it_from_many_threads() {
    let queues: Arc<Vec<Queue>> = Arc::new((0..3).map(|_| Queue::new().unwrap()).collect());
    let ran = Arc::new(AtomicUsize::new(0));
    let early = Arc::new(AtomicUsize::new(0));
    let threads = 4;
    let per = common::scaled(2000);
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let (queues, ran, early) = (Arc::clone(&queues), Arc::clone(&ran), Arc::clone(&early));
            std::thread::spawn(move || {
                let mut rng = Rng(0x77 + t as u64);
                let mine = Queue::new().unwrap();
                for i in 0..per {
                    let done = Arc::new(AtomicUsize::new(0));
                    let mut hs = Vec::new();
                    for (k, q) in queues.iter().enumerate() {
                        if rng.below(2) == 0 || k == 0 {
                            let d = Arc::clone(&done);
                            q.callback(move |_| {
                                d.fetch_add(1, Ordering::Relaxed);
                            })
                            .unwrap();
                            hs.push(q.handle());
                        }
                    }
                    let want = hs.len();
                    if i % 97 == 0 {
                        // A queue that is dropped while the marker waits on it.
                        let d = Arc::clone(&done);
                        mine.callback(move |_| {
                            d.fetch_add(1, Ordering::Relaxed);
                        })
                        .unwrap();
                        hs.push(mine.handle());
                    }
                    let want = want + usize::from(i % 97 == 0);
                    let (ran, early) = (Arc::clone(&ran), Arc::clone(&early));
                    after_queues(hs, move || {
                        if done.load(Ordering::Relaxed) != want {
                            early.fetch_add(1, Ordering::Relaxed);
                        }
                        ran.fetch_add(1, Ordering::Relaxed);
                    });
                }
                drop(mine);
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    for q in queues.iter() {
        q.synchronize().unwrap();
    }
    assert_eq!(early.load(Ordering::Relaxed), 0, "a closure ran before the work submitted before it");
    assert_eq!(ran.load(Ordering::Relaxed), threads * per, "a closure was lost or ran twice");
}
