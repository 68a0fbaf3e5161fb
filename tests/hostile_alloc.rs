//! From the hostile review of issue 9: the caching allocator under a hostile multi-threaded
//! Rust caller.

mod common;

use common::{Rng, allocator};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use dmabuf_rt::Access;
use dmabuf_rt::caching::stats::AGGREGATE;
use dmabuf_rt::queue::{HostBuffer, Queue};

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;

fn size(rng: &mut Rng) -> usize {
    match rng.below(5) {
        0 => 1 + rng.below(2048) as usize,
        1 => 4 * KB * (1 + rng.below(64) as usize),
        2 => MB + rng.below(3 * MB as u64) as usize,
        3 => 1 + rng.below(MB as u64) as usize,
        _ => 512 * (1 + rng.below(64) as usize),
    }
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// Threads churn short-lived queues (allocate on them, record_queue onto a shared queue and
/// onto each other's queues, drop the queue before or after the blocks), while another calls
/// `empty_cache` and checks the invariants. Every live block carries its own byte pattern,
/// checked before it is freed: a block handed out twice, or released/punched while live,
/// shows up as a wrong byte (or a crash).
#[test]
fn concurrent_queue_churn_with_empty_cache_keeps_every_live_block_intact() {
    for conf in ["", "expandable_segments:False", "trim_ratio:1.0001,garbage_collection_threshold:0.3"] {
        let a = allocator(conf, 256 * MB as u64);
        let shared = Arc::new(Queue::new().unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let fds0 = open_fds();
        let threads = 3;
        let bar = Arc::new(Barrier::new(threads + 1));
        let mut hs = Vec::new();
        for t in 0..threads {
            let (a, shared, bar) = (a.clone(), Arc::clone(&shared), Arc::clone(&bar));
            hs.push(std::thread::spawn(move || {
                let mut rng = Rng(0x1234_5678 + t as u64 * 77);
                bar.wait();
                for it in 0..common::scaled(60) {
                    let q = Queue::new().unwrap();
                    let mut live = Vec::new();
                    let mut raws = Vec::new();
                    for k in 0..(1 + rng.below(6)) {
                        let n = size(&mut rng);
                        let tag = (t as u8).wrapping_mul(61).wrapping_add(it as u8).wrapping_add(k as u8) | 1;
                        match rng.below(3) {
                            0 => {
                                let p = a.allocate_raw(n, Some(&q)).unwrap();
                                let m = a.mem_at(p, n).unwrap();
                                q.fill(m, tag).unwrap();
                                raws.push((p, n, tag));
                            }
                            _ => {
                                let mut x = a.allocate(n, Some(&q)).unwrap();
                                q.fill(x.mem(), tag).unwrap();
                                if rng.below(2) == 0 {
                                    x.record_queue(&shared);
                                    shared.fill(x.mem().range(0, 1).unwrap(), tag).unwrap();
                                }
                                live.push((x, tag));
                            }
                        }
                    }
                    q.synchronize().unwrap();
                    shared.synchronize().unwrap();
                    let drop_queue_first = rng.below(2) == 0;
                    let mut q = Some(q);
                    if drop_queue_first {
                        drop(q.take());
                    }
                    for (x, tag) in &live {
                        let v = x.cpu_access(Access::Read).unwrap().to_vec().unwrap();
                        if let Some(i) = v.iter().position(|b| b != tag) {
                            panic!(
                                "conf `{conf}`: thread {t} it {it}: live block byte {i} is {:#x}, not {tag:#x}",
                                v[i]
                            );
                        }
                    }
                    for &(p, n, tag) in &raws {
                        let m = a.mem_at(p, n).unwrap();
                        let h = HostBuffer::new(n).unwrap();
                        dmabuf_rt::queue::copy_now(&h, m).unwrap();
                        let v = h.to_vec();
                        if let Some(i) = v.iter().position(|b| *b != tag) {
                            panic!(
                                "conf `{conf}`: thread {t} it {it}: live raw block byte {i} is {:#x}, not {tag:#x}",
                                v[i]
                            );
                        }
                    }
                    for (p, _, _) in raws {
                        a.free_raw(p).unwrap();
                    }
                    drop(live);
                    drop(q);
                }
            }));
        }
        let (a2, stop2) = (a.clone(), Arc::clone(&stop));
        let bar2 = Arc::clone(&bar);
        let cleaner = std::thread::spawn(move || {
            bar2.wait();
            let mut n = 0;
            while !stop2.load(Ordering::Acquire) {
                a2.empty_cache();
                if let Err(e) = a2.check_invariants() {
                    panic!("invariants after empty_cache {n}: {e}");
                }
                n += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        for h in hs {
            h.join().unwrap();
        }
        stop.store(true, Ordering::Release);
        cleaner.join().unwrap();
        shared.synchronize().unwrap();
        a.empty_cache();
        a.check_invariants().unwrap();
        let s = a.stats();
        assert_eq!(s.allocated_bytes[AGGREGATE].current, 0, "{conf}");
        assert_eq!(s.reserved_bytes[AGGREGATE].current, 0, "{conf}: reserved after empty_cache");
        assert_eq!(s.segment[AGGREGATE].current, 0, "{conf}: segments after empty_cache");
        drop(shared);
        let fds = open_fds();
        assert!(fds <= fds0, "{conf}: fds {fds0} -> {fds}");
    }
}
