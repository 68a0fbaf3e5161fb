//! Instruction counts of the caching allocator's hot paths, for `valgrind --tool=callgrind`:
//! run with N and 2N; the difference over N is the cost of one unit.
//!
//! - `alloc_pairs N raw|raii [LIVE]`: N warm 4 KiB alloc+free pairs, through `allocate_raw` +
//!   `free_raw` (what C callers use) or an `Allocation` dropped, with LIVE blocks (default 0)
//!   of mixed sizes held live meanwhile (the cost must not grow with them).
//! - `alloc_pairs N arena [LIVE]`: the same as `raii` with 64 KiB blocks, which the
//!   page-stitched arena serves (a home block made and freed per pair).
//! - `alloc_pairs N random`: N operations of the random workload of `benches/allocator.rs`
//!   (log-uniform sizes from 512 B to 4 MiB, about 1000 live blocks), after 200k warm-up ops.
//! - `alloc_pairs N tlsf [LIVE]` / `tlsf-random`: the same work on xalloc's TLSF (the peer).
//!
//! The allocator's settings come from `DMABUF_RT_ALLOC_CONF` (e.g. `trim_ratio:0`).
//!
//! Run: `cargo run --release --example alloc_pairs -- 10000 raw 20000`

use dmabuf_rt::caching::{CachingAllocator, Config};
use dmabuf_rt::source::SparseSource;

/// A small xorshift generator, so every allocator sees the same sequence.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Log-uniform between 512 B and 4 MiB.
    fn size(&mut self) -> usize {
        let bits = 9 + self.next() % 14;
        (1usize << bits) + (self.next() as usize % (1usize << bits))
    }
}

/// The sizes of the blocks held live: mixed, 512 B to about 2 MiB; past 20k blocks, to about
/// 128 KiB, so that 200k of them (about 13 GiB) fit in the address space valgrind gives its
/// client (2 MiB blocks would need 200 GiB, and the run stalls under callgrind).
fn live_size(i: usize, live_n: usize) -> usize {
    let span = if live_n > 20_000 { 128 << 10 } else { 2 << 20 };
    512 + (i * 4096) % span
}

fn main() {
    let arg = |i: usize| std::env::args().nth(i);
    let n: usize = arg(1).and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let mode = arg(2).unwrap_or_else(|| "raii".into());
    let live_n: usize = arg(3).and_then(|s| s.parse().ok()).unwrap_or(0);
    let a =
        CachingAllocator::builder(SparseSource).config(Config::from_env().unwrap()).capacity(1 << 40).build().unwrap();
    match mode.as_str() {
        "raw" | "raii" | "arena" => {
            let live: Vec<_> = (0..live_n).map(|i| a.allocate_raw(live_size(i, live_n), None).unwrap()).collect();
            drop(a.allocate(4096, None).unwrap());
            a.free_raw(a.allocate_raw(4096, None).unwrap()).unwrap();
            if mode == "raw" {
                for _ in 0..n {
                    let x = a.allocate_raw(std::hint::black_box(4096), None).unwrap();
                    a.free_raw(std::hint::black_box(x)).unwrap();
                }
            } else {
                // `arena`: 64 KiB blocks, which page-stitched arenas serve (home blocks).
                let size = if mode == "arena" { 64 << 10 } else { 4096 };
                for _ in 0..n {
                    let x = a.allocate(std::hint::black_box(size), None).unwrap();
                    drop(std::hint::black_box(x));
                }
            }
            for p in live {
                a.free_raw(p).unwrap();
            }
        }
        "random" => {
            let mut rng = Rng(0x9e3779b97f4a7c15);
            let mut live = Vec::new();
            for i in 0..200_000 + n {
                if i == 200_000 {
                    // Warm: the figures count from here.
                    std::hint::black_box(&live);
                }
                if live.len() < 1000 || rng.next() % 2 == 0 {
                    live.push(a.allocate(rng.size(), None).unwrap());
                } else {
                    let i = rng.next() as usize % live.len();
                    drop(live.swap_remove(i));
                }
            }
        }
        "tlsf" => {
            let mut t = xalloc::SysTlsf::<u64>::new(1 << 40);
            let live: Vec<_> = (0..live_n).map(|i| t.alloc(live_size(i, live_n) as u64).unwrap().0).collect();
            for _ in 0..n {
                let (r, off) = t.alloc(std::hint::black_box(4096)).unwrap();
                std::hint::black_box(off);
                t.dealloc(r).unwrap();
            }
            for l in live {
                t.dealloc(l).unwrap();
            }
        }
        "tlsf-random" => {
            let mut t = xalloc::SysTlsf::<u64>::new(1 << 40);
            let mut rng = Rng(0x9e3779b97f4a7c15);
            let mut live = Vec::new();
            for _ in 0..200_000 + n {
                if live.len() < 1000 || rng.next() % 2 == 0 {
                    live.push(t.alloc(rng.size() as u64).unwrap().0);
                } else {
                    let i = rng.next() as usize % live.len();
                    t.dealloc(live.swap_remove(i)).unwrap();
                }
            }
        }
        other => panic!("unknown mode {other:?}: raw, raii, random, tlsf or tlsf-random"),
    }
    let st = a.stats();
    println!(
        "{n} × {mode} ({live_n} live), {} allocations, {} remaps, peak reserved / peak allocated {:.3}",
        st.simple().num_allocs,
        st.num_remaps,
        st.reserved_bytes[0].peak as f64 / st.allocated_bytes[0].peak.max(1) as f64
    );
}
