//! What a queue's bookkeeping costs, against peers measured in the same run:
//!
//! - a deferred free (PyTorch's `record_stream`) through to the block's reuse, against the
//!   same allocations freed plainly: N blocks are allocated on queue 1 and used on queue 2
//!   while a callback holds queue 2 (so each free must wait for it: a marker each), freed,
//!   queue 2 released and synchronized, and the N blocks allocated again. The plain run does
//!   the same without the uses. The difference per block is the overhead (issue 13's goal:
//!   at most 200 ns; PyTorch's CUDACachingAllocator on a stub runtime: about 400 ns).
//! - an event record on an idle queue, submit to complete, against one bare system call
//!   (`getppid`, which no vDSO answers).
//!
//! Run: `cargo bench --bench markers`

use std::hint::black_box;
use std::time::Instant;

use dmabuf_rt::caching::{Allocation, CachingAllocator};
use dmabuf_rt::queue::Queue;
use dmabuf_rt::source::ShmemSource;

const N: usize = 1000;
const ROUNDS: usize = 60;
const SIZE: usize = 64 << 10;

/// Holds `q` until dropped: a callback waiting on a channel.
fn hold(q: &Queue) -> std::sync::mpsc::Sender<()> {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    q.callback(move |_| {
        let _ = rx.recv();
    })
    .unwrap();
    tx
}

/// One round: ns per block from the first allocation to the last reuse.
fn round(a: &CachingAllocator, q1: &Queue, q2: &Queue, deferred: bool, blocks: &mut Vec<Allocation>) -> f64 {
    let t = Instant::now();
    let gate = hold(q2);
    for _ in 0..N {
        let mut b = a.allocate(SIZE, Some(q1)).unwrap();
        if deferred {
            b.record_queue(q2);
        }
        blocks.push(b);
    }
    blocks.clear();
    drop(gate);
    q2.synchronize().unwrap();
    for _ in 0..N {
        blocks.push(a.allocate(SIZE, Some(q1)).unwrap());
    }
    blocks.clear();
    t.elapsed().as_nanos() as f64 / N as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let (q1, q2) = (Queue::new().unwrap(), Queue::new().unwrap());
    let a = CachingAllocator::builder(ShmemSource::new()).capacity(4 << 30).build().unwrap();
    let mut blocks = Vec::with_capacity(N);
    // Warm: the segments exist, the pools hold N blocks.
    for d in [false, true, false, true] {
        round(&a, &q1, &q2, d, &mut blocks);
    }
    let (mut plain, mut deferred) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        plain.push(round(&a, &q1, &q2, false, &mut blocks));
        deferred.push(round(&a, &q1, &q2, true, &mut blocks));
    }
    let (p, d) = (median(plain), median(deferred));
    println!("record_stream -> free -> reuse, {N} blocks of {} KiB per round, median of {ROUNDS}:", SIZE >> 10);
    println!("  plain free -> reuse:     {p:>8.0} ns per block (the peer)");
    println!("  deferred free -> reuse:  {d:>8.0} ns per block");
    println!("  overhead:                {:>8.0} ns per block (goal: <= 200; PyTorch ~400)", d - p);

    let q = Queue::new().unwrap();
    let mut rec = Vec::with_capacity(20_000);
    for _ in 0..20_000 {
        let t = Instant::now();
        let e = q.record().unwrap();
        let done = e.is_complete();
        rec.push(t.elapsed().as_nanos() as f64);
        assert!(done);
    }
    let mut sys = Vec::with_capacity(20_000);
    for _ in 0..20_000 {
        let t = Instant::now();
        black_box(rustix::process::getppid());
        sys.push(t.elapsed().as_nanos() as f64);
    }
    let (r, s) = (median(rec), median(sys));
    println!("event record on an idle queue, submit to complete: {r:.0} ns (median of 20000)");
    println!("peer: one bare system call (getppid): {s:.0} ns; record = x{:.2} of it (goal: <= 300 ns)", r / s);
}
