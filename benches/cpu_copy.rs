//! CPU copies into and out of a shared mapping (relaxed-atomic word copies, the crate's access
//! rule) against the peer: plain `memcpy` between private buffers, same sizes, same run.
//!
//! Run: `cargo bench --bench cpu_copy`

use std::hint::black_box;
use std::time::Instant;

use dmabuf_rt::source::{MemorySource, ShmemSource};

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
        let src = vec![0x5au8; size];
        let mut dst = vec![0u8; size];
        let seg = ShmemSource::new().create_segment(size).unwrap();
        let map = seg.mapping().unwrap();
        // Warm up all three.
        dst.copy_from_slice(&src);
        map.write(0, &src).unwrap();
        map.read(0, &mut dst).unwrap();

        let t = Instant::now();
        for _ in 0..iters {
            dst.copy_from_slice(black_box(&src));
            black_box(&mut dst);
        }
        let memcpy = gbps(size, iters, t.elapsed().as_secs_f64());
        let t = Instant::now();
        for _ in 0..iters {
            map.write(0, black_box(&src)).unwrap();
        }
        let write = gbps(size, iters, t.elapsed().as_secs_f64());
        let t = Instant::now();
        for _ in 0..iters {
            map.read(0, black_box(&mut dst)).unwrap();
        }
        let read = gbps(size, iters, t.elapsed().as_secs_f64());
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
    println!("# x = throughput relative to memcpy at the same size, same run");
}
