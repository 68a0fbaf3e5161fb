//! Runs N warm 4 KiB alloc+free pairs through the caching allocator, for instruction counts:
//! `valgrind --tool=callgrind` on N and 2N pairs; the difference over N is the cost of a pair.
//!
//! Run: `cargo run --release --example alloc_pairs -- 10000`

use dmabuf_rt::caching::{CachingAllocator, Config};
use dmabuf_rt::source::SparseSource;

fn main() {
    let n: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let a = CachingAllocator::builder(SparseSource).config(Config::default()).capacity(1 << 40).build().unwrap();
    drop(a.allocate(4096, None).unwrap());
    for _ in 0..n {
        let x = a.allocate(std::hint::black_box(4096), None).unwrap();
        drop(std::hint::black_box(x));
    }
    println!("{n} pairs, {} allocations", a.stats().simple().num_allocs);
}
