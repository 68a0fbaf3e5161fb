//! The caching allocator on periodic workloads it was not tuned on: generated from a seed, in
//! five shapes (training with parameters, activations freed in reverse and gradients; variable
//! lengths cycling through a few scales; KV caches grown token by token, each token's block
//! replacing the last one's; mixtures of experts with a few routings; a recorded random
//! sequence replayed every step), each with one of five size distributions (log-uniform over a
//! random span, a small set of sizes, powers of two, multiples of a head size, a mix of large
//! and small). Every step repeats the first exactly, so once warm nothing may call the memory
//! source, a run twice as long may map no more views (a few workloads still map one in their
//! fourth to sixth step, none later), and the peak reserved bytes must keep the allocator's
//! bound: within
//! 3% of the peak allocated bytes, or, for a workload of a few MiB, within one small segment
//! (2 MiB) of that, which the trim policy does not punch to hold (`caching/expandable.rs`).
//!
//! The KV shape found two faults (both fixed): a first step that maps more views than the
//! arena's map credit holds (15 caches of up to 10 MiB grown over 60 tokens: 1,497 runs) turned
//! the arena hungry, and it grew within 10% of the allocated bytes, past the bound (1.04-1.09
//! at 89-165 MiB); and a workload of 1-2 MiB punched and faulted in pages every step (125
//! source calls a warm step) to hold a share smaller than the small pool's segment.

mod common;

use common::trace::{SMALL_SEGMENT, Trace, bound};
use dmabuf_rt::caching::Config;
use dmabuf_rt::caching::replay::{ReplayOptions, ReplayReport, ReplaySource, TraceOp, replay_with};

/// A small xorshift generator: the workloads are the same on every machine.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        let mut r = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        for _ in 0..4 {
            r.next();
        }
        r
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Log-uniform in `[lo, hi)`.
    fn log_uniform(&mut self, lo: f64, hi: f64) -> usize {
        (lo.ln() + self.unit() * (hi.ln() - lo.ln())).exp() as usize
    }
}

/// One of five size distributions, drawn for a workload.
fn size_distribution(r: &mut Rng) -> Box<dyn Fn(&mut Rng) -> usize> {
    match r.below(5) {
        0 => {
            let lo = r.log_uniform(512.0, 65536.0) as f64;
            let hi = r.log_uniform(1e6, 256e6) as f64;
            Box::new(move |r| r.log_uniform(lo, hi))
        }
        1 => {
            let set: Vec<usize> = (0..1 + r.below(12)).map(|_| r.log_uniform(4096.0, 64e6)).collect();
            Box::new(move |r| set[r.below(set.len() as u64) as usize])
        }
        2 => Box::new(|r| 1usize << (10 + r.below(17))),
        3 => {
            let head = r.log_uniform(256.0, 8192.0);
            Box::new(move |r| head * (1 + r.below(4096) as usize) * 2)
        }
        _ => {
            let big = r.log_uniform(8e6, 200e6);
            Box::new(move |r| if r.below(4) == 0 { big } else { r.log_uniform(1024.0, 4e6) })
        }
    }
}

const STEPS: usize = 6;

/// The workload of `seed`: its shape's name and its trace (`STEPS` identical steps). Every
/// random choice is made before the first step.
fn workload(seed: u64) -> (&'static str, Vec<TraceOp>) {
    let mut r = Rng::new(seed);
    let shape = r.below(5);
    let size = size_distribution(&mut r);
    let mut t = Trace::default();
    let name = match shape {
        0 => {
            let params: Vec<usize> = (0..1 + r.below(40)).map(|_| size(&mut r)).collect();
            let layers = 2 + r.below(30) as usize;
            let acts: Vec<usize> = (0..layers).map(|_| size(&mut r)).collect();
            let temps: Vec<usize> = (0..layers).map(|_| size(&mut r)).collect();
            for &p in &params {
                t.alloc(p);
            }
            for _ in 0..STEPS {
                t.step();
                let mut live = Vec::new();
                for l in 0..layers {
                    let tmp = t.alloc(temps[l]);
                    live.push(t.alloc(acts[l]));
                    t.free(tmp);
                }
                let mut grads = Vec::new();
                for (l, a) in live.into_iter().enumerate().rev() {
                    let g = t.alloc(acts[l]);
                    t.free(a);
                    if l % 3 == 0 { t.free(g) } else { grads.push(g) }
                }
                grads.into_iter().for_each(|g| t.free(g));
            }
            "train"
        }
        1 => {
            let scales: Vec<usize> = (0..2 + r.below(5)).map(|_| 1 + r.below(16) as usize).collect();
            let layers = 2 + r.below(20) as usize;
            let base: Vec<usize> = (0..layers).map(|_| size(&mut r) / 8 + 512).collect();
            for _ in 0..STEPS {
                t.step();
                for &k in &scales {
                    let mut live = Vec::new();
                    for &b in &base {
                        live.push(t.alloc(b * k));
                        if live.len() > 3 {
                            let a = live.remove(0);
                            t.free(a);
                        }
                    }
                    live.into_iter().for_each(|a| t.free(a));
                }
            }
            "varlen"
        }
        2 => {
            let seqs = 1 + r.below(16) as usize;
            let per_token = r.log_uniform(1024.0, 262144.0);
            let tokens = 8 + r.below(64) as usize;
            let temps: Vec<usize> = (0..97).map(|_| size(&mut r) / 16 + 512).collect();
            for _ in 0..STEPS {
                t.step();
                let mut caches: Vec<u64> = (0..seqs).map(|_| t.alloc(per_token)).collect();
                for tok in 2..tokens {
                    for (i, c) in caches.iter_mut().enumerate() {
                        let grown = t.alloc(per_token * tok);
                        let tmp = t.alloc(temps[(tok * seqs + i) % temps.len()]);
                        t.free(*c);
                        t.free(tmp);
                        *c = grown;
                    }
                }
                caches.into_iter().for_each(|c| t.free(c));
            }
            "kv"
        }
        3 => {
            let experts = 2 + r.below(16) as usize;
            let token = r.log_uniform(512.0, 65536.0);
            let outs: Vec<usize> = (0..3).map(|_| size(&mut r)).collect();
            let routes: Vec<Vec<usize>> =
                (0..3).map(|_| (0..experts).map(|_| r.below(4096) as usize + 1).collect()).collect();
            for _ in 0..STEPS {
                t.step();
                for (route, &out) in routes.iter().zip(&outs) {
                    let mut hidden = Vec::new();
                    for &n in route {
                        let a = t.alloc(n * token);
                        hidden.push(t.alloc(n * token * 4));
                        t.free(a);
                    }
                    let o = t.alloc(out);
                    hidden.into_iter().for_each(|h| t.free(h));
                    t.free(o);
                }
            }
            "moe"
        }
        _ => {
            let n = 50 + r.below(800) as usize;
            let mut seq = Vec::new();
            let mut live = 0usize;
            for _ in 0..n {
                if live == 0 || r.below(2) == 0 {
                    seq.push((Some(size(&mut r)), 0));
                    live += 1;
                } else {
                    seq.push((None, r.next()));
                    live -= 1;
                }
            }
            for _ in 0..STEPS {
                t.step();
                let mut live: Vec<u64> = Vec::new();
                for &(op, pick) in &seq {
                    match op {
                        Some(s) => live.push(t.alloc(s)),
                        None => {
                            let a = live.swap_remove((pick % live.len() as u64) as usize);
                            t.free(a);
                        }
                    }
                }
                live.into_iter().for_each(|a| t.free(a));
            }
            "random sequence"
        }
    };
    (name, t.ops)
}

fn check(seed: u64, conf: &str) -> (&'static str, ReplayReport) {
    let (name, ops) = workload(seed);
    let c = Config::parse(conf).unwrap();
    let run = |repeat| {
        replay_with(&ops, ReplaySource::Virtual, 1 << 40, &c, &ReplayOptions { repeat, ..ReplayOptions::default() })
            .unwrap_or_else(|e| panic!("seed {seed} ({name}) [{conf}]: {e}"))
    };
    let (r, twice) = (run(1), run(2));
    let what = format!(
        "seed {seed} ({name}) [{conf}]: peak allocated {} reserved {} ({:.4}), remaps {}, warm source calls {} \
         remaps {} in {} warm steps",
        r.peak_allocated_bytes,
        r.peak_reserved_bytes,
        r.ratio,
        r.remaps,
        r.warm_source_calls,
        r.warm_remaps,
        r.warm_steps
    );
    assert_eq!(r.ooms, 0, "{what}");
    assert!(r.peak_reserved_bytes as f64 <= bound(r.peak_allocated_bytes), "{what}: past the bound");
    assert_eq!(r.warm_source_calls, 0, "{what}: warm steps called the source");
    assert_eq!(twice.warm_source_calls, 0, "{what}: warm steps of two runs called the source");
    // The views settle: a longer run maps no more of them (some workloads still map one in
    // the fourth to sixth step, none after).
    assert_eq!(twice.remaps, r.remaps, "{what}: twice as long a run mapped more views");
    (name, r)
}

/// The seeds to run: `DMABUF_RT_GENERATED_SEEDS=FROM..TO` (e.g. `1000..6000`, in a release
/// build), 0..200 by default.
fn seeds() -> std::ops::Range<u64> {
    let Ok(v) = std::env::var("DMABUF_RT_GENERATED_SEEDS") else { return 0..200 };
    let (a, b) = v.split_once("..").expect("DMABUF_RT_GENERATED_SEEDS=FROM..TO");
    a.parse().expect("FROM")..b.parse().expect("TO")
}

/// 200 workloads with the default settings and with no growth slack (which changes where
/// blocks go): the bound holds, and warm steps call nothing.
#[test]
fn generated_periodic_workloads_hold_the_bound_and_call_nothing_once_warm() {
    let mut shapes = std::collections::BTreeMap::<&str, (usize, f64)>::new();
    for seed in seeds() {
        for conf in ["", "stitch_grow_slack:0"] {
            let (name, r) = check(seed, conf);
            let e = shapes.entry(name).or_default();
            e.0 += 1;
            if r.peak_allocated_bytes as f64 >= 64.0 * SMALL_SEGMENT {
                e.1 = e.1.max(r.ratio);
            }
        }
    }
    // Every shape was generated (the test covers what it says).
    assert_eq!(shapes.len(), 5, "{shapes:?}");
    println!("runs and worst ratio at 128 MiB and more, by shape: {shapes:?}");
}

/// The KV caches that found the first fault: more views in the first step than the map credit
/// holds, then none.
#[test]
fn kv_caches_grown_token_by_token_hold_the_bound_past_the_map_credit() {
    for seed in [101, 182, 202, 226] {
        let (name, r) = check(seed, "");
        assert_eq!(name, "kv");
        assert!(r.peak_allocated_bytes > 64 << 20, "seed {seed}: {} bytes", r.peak_allocated_bytes);
        assert!(r.ratio <= 1.03, "seed {seed}: {:.4}", r.ratio);
        // More runs than the credit's 1,024: the case the credit does not cover.
        assert!(r.remaps > 1024, "seed {seed}: {} remaps", r.remaps);
    }
}
