//! The caching allocator against two offset allocators measured in the same run: xalloc's
//! TLSF and offset-allocator (Sebastian Aaltonen's design). The peers manage offsets only (no
//! memory, no handles, no queues, no stats, single-threaded), so this is the cost of our
//! bookkeeping against the fastest pure bookkeeping there is. Our segments come from the
//! sparse source (address space only), and the cache is warm before timing.
//!
//! Run: `cargo bench --bench allocator`, or `cargo bench --bench allocator -- random` for the
//! rows whose label holds `random`. Ours takes its settings from `DMABUF_RT_ALLOC_CONF`
//! (defaults when unset, as for any caller), so a setting can be weighed in the same run.

use std::hint::black_box;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use dmabuf_rt::caching::{CachingAllocator, Config};
use dmabuf_rt::source::SparseSource;

const PAIRS: usize = 100_000;

fn config() -> Config {
    Config::from_env().expect("DMABUF_RT_ALLOC_CONF")
}

fn ours() -> CachingAllocator {
    CachingAllocator::builder(SparseSource).config(config()).capacity(1 << 40).build().unwrap()
}

fn ns(t: Instant, n: usize) -> f64 {
    t.elapsed().as_nanos() as f64 / n as f64
}

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

/// Warm alloc+free pairs: through `Allocation` (RAII) or the raw-pointer API C callers use.
fn pair_ours(size: usize, loaded: bool, raw: bool) -> f64 {
    let a = ours();
    let live: Vec<_> = if loaded {
        (0..2000).map(|i| a.allocate(512 + (i * 4096) % (2 << 20), None).unwrap()).collect()
    } else {
        Vec::new()
    };
    drop(a.allocate(size, None).unwrap());
    let t = Instant::now();
    if raw {
        for _ in 0..PAIRS {
            let x = a.allocate_raw(black_box(size), None).unwrap();
            a.free_raw(black_box(x)).unwrap();
        }
    } else {
        for _ in 0..PAIRS {
            let x = a.allocate(black_box(size), None).unwrap();
            drop(black_box(x));
        }
    }
    let r = ns(t, PAIRS);
    drop(live);
    r
}

fn pair_xalloc(size: usize, loaded: bool) -> f64 {
    let mut t = xalloc::SysTlsf::<u64>::new(1 << 40);
    let live: Vec<_> =
        if loaded { (0..2000).map(|i| t.alloc(512 + (i * 4096) % (2 << 20)).unwrap().0).collect() } else { Vec::new() };
    let start = Instant::now();
    for _ in 0..PAIRS {
        let (r, off) = t.alloc(black_box(size as u64)).unwrap();
        black_box(off);
        t.dealloc(r).unwrap();
    }
    let r = ns(start, PAIRS);
    for l in live {
        t.dealloc(l).unwrap();
    }
    r
}

fn pair_offset(size: usize, loaded: bool) -> f64 {
    let mut t = offset_allocator::Allocator::<u32>::with_max_allocs(u32::MAX, 8192);
    let live: Vec<_> = if loaded {
        (0..2000u32).map(|i| t.allocate(512 + (i * 4096) % (2 << 20)).unwrap()).collect()
    } else {
        Vec::new()
    };
    let start = Instant::now();
    for _ in 0..PAIRS {
        let a = t.allocate(black_box(size as u32)).unwrap();
        black_box(a.offset);
        t.free(a);
    }
    let r = ns(start, PAIRS);
    for l in live {
        t.free(l);
    }
    r
}

/// Random workload: 400k operations, about 1000 live blocks, log-uniform sizes.
fn random_ours() -> f64 {
    random_on(ours())
}

/// The same with the trim policy off: placement only, as the peers do (they manage offsets and
/// never give memory back; ours punches pages to keep reserved near the peak otherwise).
fn random_ours_untrimmed() -> f64 {
    let c = Config { trim_ratio: 0.0, ..config() };
    random_on(CachingAllocator::builder(SparseSource).config(c).capacity(1 << 40).build().unwrap())
}

fn random_on(a: CachingAllocator) -> f64 {
    let mut rng = Rng(0x9e3779b97f4a7c15);
    let mut live = Vec::new();
    let t = Instant::now();
    for _ in 0..400_000 {
        if live.len() < 1000 || rng.next() % 2 == 0 {
            live.push(a.allocate(rng.size(), None).unwrap());
        } else {
            let i = rng.next() as usize % live.len();
            drop(live.swap_remove(i));
        }
    }
    ns(t, 400_000)
}

fn random_xalloc() -> f64 {
    let mut a = xalloc::SysTlsf::<u64>::new(1 << 40);
    let mut rng = Rng(0x9e3779b97f4a7c15);
    let mut live = Vec::new();
    let t = Instant::now();
    for _ in 0..400_000 {
        if live.len() < 1000 || rng.next() % 2 == 0 {
            live.push(a.alloc(rng.size() as u64).unwrap().0);
        } else {
            let i = rng.next() as usize % live.len();
            a.dealloc(live.swap_remove(i)).unwrap();
        }
    }
    ns(t, 400_000)
}

fn random_offset() -> f64 {
    let mut a = offset_allocator::Allocator::<u32>::with_max_allocs(u32::MAX, 1 << 16);
    let mut rng = Rng(0x9e3779b97f4a7c15);
    let mut live = Vec::new();
    let t = Instant::now();
    for _ in 0..400_000 {
        if live.len() < 1000 || rng.next() % 2 == 0 {
            live.push(a.allocate(rng.size() as u32).unwrap());
        } else {
            let i = rng.next() as usize % live.len();
            a.free(live.swap_remove(i));
        }
    }
    ns(t, 400_000)
}

/// One thread allocates 4 KiB blocks, another frees them (handed over in batches of 64).
fn cross_thread<A, F>(alloc: impl Fn() -> A + Send + 'static, free: F) -> f64
where
    A: Send + 'static,
    F: Fn(A) + Send + 'static,
{
    const N: usize = 200_000;
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<A>>(16);
    let t = Instant::now();
    let consumer = std::thread::spawn(move || {
        for batch in rx {
            for x in batch {
                free(x);
            }
        }
    });
    let mut batch = Vec::with_capacity(64);
    for _ in 0..N {
        batch.push(alloc());
        if batch.len() == 64 {
            tx.send(std::mem::replace(&mut batch, Vec::with_capacity(64))).unwrap();
        }
    }
    tx.send(batch).unwrap();
    drop(tx);
    consumer.join().unwrap();
    ns(t, N)
}

/// The best of `ROUNDS` runs: the figures are compared within one run, and the minimum is the
/// least disturbed by other work on the machine.
const ROUNDS: usize = 5;

fn best(f: impl Fn() -> f64) -> f64 {
    (0..ROUNDS).map(|_| f()).fold(f64::INFINITY, f64::min)
}

/// Whether the row labelled `label` runs: every row, or those whose label holds the first
/// argument that is not a flag (cargo passes `--bench`).
fn wanted(label: &str) -> bool {
    std::env::args().skip(1).find(|a| !a.starts_with('-')).is_none_or(|f| label.contains(&f))
}

fn main() {
    println!("# best of {ROUNDS} runs each, ns per operation");
    println!("{:<40}{:>12}{:>12}{:>18}{:>12}", "ns per operation", "ours", "xalloc", "offset-allocator", "ours/xalloc");
    for (label, size, loaded) in [
        ("alloc+free 4 KiB, empty", 4096, false),
        ("alloc+free 4 KiB, 2000 live", 4096, true),
        ("alloc+free 1 MiB, empty", 1 << 20, false),
        ("alloc+free 1 MiB, 2000 live", 1 << 20, true),
    ] {
        if !wanted(label) {
            continue;
        }
        let (x, f) = (best(|| pair_xalloc(size, loaded)), best(|| pair_offset(size, loaded)));
        for (api, raw) in [("raw", true), ("RAII", false)] {
            let o = best(|| pair_ours(size, loaded, raw));
            println!("{:<40}{o:>12.1}{x:>12.1}{f:>18.1}{:>12.2}", format!("{label} ({api})"), o / x);
        }
    }
    if wanted("random workload") {
        let (o, x, f) = (best(random_ours), best(random_xalloc), best(random_offset));
        println!("{:<40}{o:>12.1}{x:>12.1}{f:>18.1}{:>12.2}", "random workload (per op)", o / x);
        let u = best(random_ours_untrimmed);
        println!("{:<40}{u:>12.1}{x:>12.1}{f:>18.1}{:>12.2}", "random workload, trim_ratio:0", u / x);
    }
    if !wanted("cross-thread frees") {
        return;
    }

    let o = best(|| {
        let a = ours();
        let a2 = a.clone();
        cross_thread(move || a2.allocate(4096, None).unwrap(), drop)
    });
    let x = best(|| {
        let tlsf = Arc::new(Mutex::new(xalloc::SysTlsf::<u64>::new(1 << 40)));
        let (t1, t2) = (tlsf.clone(), tlsf.clone());
        cross_thread(move || t1.lock().unwrap().alloc(4096).unwrap().0, move |r| t2.lock().unwrap().dealloc(r).unwrap())
    });
    let f = best(|| {
        let off = Arc::new(Mutex::new(offset_allocator::Allocator::<u32>::with_max_allocs(u32::MAX, 1 << 16)));
        let (f1, f2) = (off.clone(), off.clone());
        cross_thread(move || f1.lock().unwrap().allocate(4096).unwrap(), move |r| f2.lock().unwrap().free(r))
    });
    println!("{:<40}{o:>12.1}{x:>12.1}{f:>18.1}{:>12.2}", "cross-thread frees, 2 threads", o / x);
    println!("# peers behind a Mutex for the cross-thread row; ours frees lock-free");
}
