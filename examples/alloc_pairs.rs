//! Runs N warm 4 KiB alloc+free pairs through the caching allocator, for instruction counts:
//! `valgrind --tool=callgrind` on N and 2N pairs; the difference over N is the cost of a pair.
//! The second argument picks the API: `raii` (an `Allocation` dropped) or `raw`
//! (`allocate_raw` + `free_raw`, what C callers use).
//!
//! Run: `cargo run --release --example alloc_pairs -- 10000 raw`

use dmabuf_rt::caching::{CachingAllocator, Config};
use dmabuf_rt::source::SparseSource;

fn main() {
    let n: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let raw = match std::env::args().nth(2).as_deref() {
        None | Some("raii") => false,
        Some("raw") => true,
        Some(other) => panic!("unknown API {other:?}: raii or raw"),
    };
    let a = CachingAllocator::builder(SparseSource).config(Config::default()).capacity(1 << 40).build().unwrap();
    drop(a.allocate(4096, None).unwrap());
    if raw {
        a.free_raw(a.allocate_raw(4096, None).unwrap()).unwrap();
        for _ in 0..n {
            let x = a.allocate_raw(std::hint::black_box(4096), None).unwrap();
            a.free_raw(std::hint::black_box(x)).unwrap();
        }
    } else {
        for _ in 0..n {
            let x = a.allocate(std::hint::black_box(4096), None).unwrap();
            drop(std::hint::black_box(x));
        }
    }
    println!("{n} pairs ({}), {} allocations", if raw { "raw" } else { "raii" }, a.stats().simple().num_allocs);
}
