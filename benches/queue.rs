//! Queue copy bandwidth and latency, side by side with plain memcpy measured in the same run.
//!
//! Rows: h2d (host buffer -> shmem segment), d2h, d2d, with the CPU engine (default) and the
//! kernel engine (io_uring READ/WRITE on the memfd), at 4 KiB, 1 MiB and 64 MiB; two queues
//! copying 64 MiB at once; submit-to-complete latency of a 4 KiB copy and of an event record.
//!
//! The memcpy peer copies between page-aligned buffers (the segments are page-aligned too).
//! Two `Vec`s from malloc usually sit a few bytes apart modulo 4096 (16 for glibc), and then
//! each load of the source hits a recent store to the destination in its low 12 address bits
//! ("4K aliasing"): the load waits on a false dependency, and memcpy fell to 1.4-2.9 GB/s,
//! which made the queue look better than it is. Page alignment gives memcpy its best case.
//! (`HostBuffer`s are 64-byte aligned, so the h2d and d2h rows do not get that guarantee.)
//!
//! Run: `cargo bench --bench queue`

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dmabuf_rt::Segment;
use dmabuf_rt::queue::{CopyEngine, HostBuffer, Mem, Queue};
use dmabuf_rt::source::{MemorySource, ShmemSource};
use dmabuf_rt::testing::PageBuf;

const SIZES: [usize; 3] = [4 << 10, 1 << 20, 64 << 20];

fn iters(size: usize) -> usize {
    ((1usize << 30) / size).clamp(16, 100_000)
}

fn seg(len: usize) -> Arc<Segment> {
    Arc::new(ShmemSource::new().create_segment(len).unwrap())
}

/// Single-thread memcpy between two private page-aligned buffers, best of 3 runs, GB/s.
fn memcpy_gbps(size: usize) -> f64 {
    let src = PageBuf::new(size, 1);
    let mut dst = PageBuf::new(size, 0);
    dst.get_mut().copy_from_slice(src.get());
    (0..3)
        .map(|_| {
            let n = iters(size);
            let t = Instant::now();
            for _ in 0..n {
                dst.get_mut().copy_from_slice(black_box(src.get()));
                black_box(dst.get_mut());
            }
            (size * n) as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

/// Queue copies `dst <- src`, submitted back to back and synchronized once, best of 3, GB/s.
fn queue_gbps(q: &Queue, dst: &Mem, src: &Mem) -> f64 {
    let size = dst.len();
    q.copy(dst, src).unwrap();
    q.synchronize().unwrap();
    (0..3)
        .map(|_| {
            let n = iters(size);
            let t = Instant::now();
            for _ in 0..n {
                q.copy(dst, src).unwrap();
            }
            q.synchronize().unwrap();
            (size * n) as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

fn median_ns(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_nanos() as f64
}

fn main() {
    let peers: Vec<f64> = SIZES.iter().map(|&s| memcpy_gbps(s)).collect();
    println!("{:<24}{:>22}{:>22}{:>22}", "GB/s (x memcpy)", "4 KiB", "1 MiB", "64 MiB");
    print!("{:<24}", "memcpy (1 thread)");
    for p in &peers {
        print!("{:>22}", format!("{p:.1}"));
    }
    println!();
    for (engine, ename) in [(CopyEngine::Cpu, "cpu"), (CopyEngine::Kernel, "kernel")] {
        let q = Queue::builder().engine(engine).build().unwrap();
        for dir in ["h2d", "d2h", "d2d"] {
            print!("{:<24}", format!("{dir} ({ename} engine)"));
            for (k, &size) in SIZES.iter().enumerate() {
                let host = HostBuffer::new(size).unwrap();
                let (a, b) = (seg(size), seg(size));
                let (dst, src): (Mem, Mem) = match dir {
                    "h2d" => ((&a).into(), (&host).into()),
                    "d2h" => ((&host).into(), (&a).into()),
                    _ => ((&b).into(), (&a).into()),
                };
                // The peer is measured again right next to each cell (machine noise moves both
                // alike); the ratio is against the better of its two runs.
                let g = queue_gbps(&q, &dst, &src);
                let peer = peers[k].max(memcpy_gbps(size));
                print!("{:>22}", format!("{g:.1} (x{:.2})", g / peer));
            }
            println!();
        }
    }

    // Two queues, each copying 64 MiB d2d, at the same time.
    let size = 64 << 20;
    let total: f64 = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(move || {
                    let q = Queue::new().unwrap();
                    let (a, b) = (seg(size), seg(size));
                    queue_gbps(&q, &(&b).into(), &(&a).into())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    });
    println!(
        "{:<24}{:>66}",
        "2 queues d2d 64 MiB",
        format!("{total:.1} GB/s together (x{:.2} memcpy)", total / peers[2])
    );

    // Latency on an idle queue: from submit until the operation is complete.
    let q = Queue::new().unwrap();
    let host = HostBuffer::new(4096).unwrap();
    let a = seg(4096);
    let (dst, src): (Mem, Mem) = ((&a).into(), (&host).into());
    let mut copy_lat = Vec::new();
    let mut rec_lat = Vec::new();
    for _ in 0..20_000 {
        let t = Instant::now();
        q.copy(&dst, &src).unwrap();
        let idle = q.is_idle();
        copy_lat.push(t.elapsed());
        assert!(idle);
        let t = Instant::now();
        let e = q.record().unwrap();
        let done = e.is_complete();
        rec_lat.push(t.elapsed());
        assert!(done);
    }
    println!("4 KiB copy submit-to-complete: {:.0} ns (median of 20000)", median_ns(copy_lat));
    println!("event record submit-to-complete: {:.0} ns (median of 20000)", median_ns(rec_lat));
    let mut memcpy_4k = Vec::new();
    let (s4, mut d4) = (PageBuf::new(4096, 1), PageBuf::new(4096, 0));
    for _ in 0..20_000 {
        let t = Instant::now();
        d4.get_mut().copy_from_slice(black_box(s4.get()));
        black_box(d4.get_mut());
        memcpy_4k.push(t.elapsed());
    }
    println!("peer: 4 KiB memcpy: {:.0} ns (median of 20000)", median_ns(memcpy_4k));
}
