//! CPU copies into and out of a shared mapping (the crate's byte-wise atomic copy kernel,
//! `src/copy.rs`) against the peer: plain `memcpy` between private buffers, same sizes, same
//! direction, same run.
//!
//! Every host-side buffer, ours and the peer's, starts on a page boundary, as the mapping does.
//! Two `Vec`s from malloc usually sit a few bytes apart modulo 4096 (16 for glibc), and then
//! each load of the source hits a recent store to the destination in its low 12 address bits
//! ("4K aliasing"): the load waits on a false dependency, and memcpy fell to 1.4-2.9 GB/s,
//! which made the kernel look better than it is. Page-aligned buffers give memcpy its best
//! case, and the write and read rows use the same host buffers as the peer.
//!
//! Run: `cargo bench --bench cpu_copy`

use std::hint::black_box;
use std::time::Instant;

use dmabuf_rt::source::{MemorySource, ShmemSource};
use dmabuf_rt::testing::PageBuf;

/// Rounds per size; each figure is the best round.
const ROUNDS: usize = 5;

fn gbps(bytes: usize, iters: usize, secs: f64) -> f64 {
    (bytes * iters) as f64 / secs / 1e9
}

fn main() {
    println!(
        "{:<10} {:>14} {:>14} {:>14} {:>10} {:>10}",
        "size", "memcpy GB/s", "write GB/s", "read GB/s", "write x", "read x"
    );
    for size in [4usize << 10, 64 << 10, 1 << 20, 64 << 20] {
        let iters = ((1usize << 30) / size).clamp(8, 200_000);
        let src = PageBuf::new(size, 0x5a);
        let mut dst = PageBuf::new(size, 0);
        let seg = ShmemSource::new().create_segment(size).unwrap();
        let map = seg.mapping().unwrap();
        // Warm up all three.
        dst.get_mut().copy_from_slice(src.get());
        map.write(0, src.get()).unwrap();
        map.read(0, dst.get_mut()).unwrap();

        // Best of ROUNDS, the three measured in turn in each round, so that load from other
        // processes on the machine falls on all three alike.
        let (mut memcpy, mut write, mut read) = (0.0f64, 0.0f64, 0.0f64);
        for _ in 0..ROUNDS {
            let t = Instant::now();
            for _ in 0..iters {
                dst.get_mut().copy_from_slice(black_box(src.get()));
                black_box(dst.get_mut());
            }
            memcpy = memcpy.max(gbps(size, iters, t.elapsed().as_secs_f64()));
            let t = Instant::now();
            for _ in 0..iters {
                map.write(0, black_box(src.get())).unwrap();
            }
            write = write.max(gbps(size, iters, t.elapsed().as_secs_f64()));
            let t = Instant::now();
            for _ in 0..iters {
                map.read(0, black_box(dst.get_mut())).unwrap();
            }
            read = read.max(gbps(size, iters, t.elapsed().as_secs_f64()));
        }
        println!(
            "{:<10} {:>14.1} {:>14.1} {:>14.1} {:>10.2} {:>10.2}",
            format!("{} KiB", size >> 10),
            memcpy,
            write,
            read,
            write / memcpy,
            read / memcpy
        );
    }
    println!("# best of {ROUNDS} rounds; x = throughput relative to memcpy at the same size, same run");
}
