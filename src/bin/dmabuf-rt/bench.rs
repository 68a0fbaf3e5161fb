//! `dmabuf-rt bench`: the main job. On the embedded default device (shmem) it measures the
//! caching allocator, queue copies and the zero-copy pipeline, each next to a peer measured in
//! the same run, showing progress on stderr, and ends with one summary table.
//!
//! Peers: the system allocator (glibc malloc/free) for alloc+free pairs, memcpy between two
//! private page-aligned buffers for copies, and the same three-process pipeline with frames
//! copied through pipes for the pipeline. The memcpy buffers are page-aligned because two
//! `Vec`s from malloc usually sit a few bytes apart modulo 4096 (16 for glibc), and then each
//! load of the source hits a recent store to the destination in its low 12 address bits ("4K
//! aliasing", a false dependency that held memcpy to 1.4-2.9 GB/s): the peer gets its best case. (The TLSF and offset-allocator comparisons of `cargo bench --bench
//! allocator` need dev-dependencies; this command uses only what the library links.)

use std::hint::black_box;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dmabuf_rt::Segment;
use dmabuf_rt::caching::{CachingAllocator, Config};
use dmabuf_rt::queue::{HostBuffer, Mem, Queue};
use dmabuf_rt::source::{MemorySource, ShmemSource, SparseSource};
use dmabuf_rt::testing::PageBuf;

/// One row of the summary.
struct Row {
    what: String,
    ours: f64,
    peer: f64,
    unit: &'static str,
    /// Higher is better (throughput) rather than lower (time).
    higher_is_better: bool,
    peer_name: &'static str,
}

impl Row {
    /// How many times better we are than the peer (> 1: better).
    fn advantage(&self) -> f64 {
        if self.higher_is_better { self.ours / self.peer } else { self.peer / self.ours }
    }
}

struct Progress {
    step: usize,
    steps: usize,
}

impl Progress {
    fn say(&mut self, what: &str) {
        self.step += 1;
        let _ = writeln!(std::io::stderr(), "[{}/{}] {what} ...", self.step, self.steps);
    }
}

/// Options of `dmabuf-rt bench`.
pub struct Options {
    /// Fewer iterations (for tests and slow machines).
    pub quick: bool,
    /// Skip the pipeline (it spawns processes).
    pub no_pipeline: bool,
}

pub fn parse(args: &[String]) -> Result<Options, String> {
    let mut o = Options { quick: false, no_pipeline: false };
    for a in args {
        match a.as_str() {
            "--quick" => o.quick = true,
            "--no-pipeline" => o.no_pipeline = true,
            other => return Err(format!("unexpected argument `{other}` (bench takes --quick, --no-pipeline)")),
        }
    }
    Ok(o)
}

fn best<T: PartialOrd + Copy>(rounds: usize, mut f: impl FnMut() -> T, better: impl Fn(T, T) -> bool) -> T {
    let mut b = f();
    for _ in 1..rounds {
        let v = f();
        if better(v, b) {
            b = v;
        }
    }
    b
}

fn ns_per(t: Duration, n: usize) -> f64 {
    t.as_nanos() as f64 / n as f64
}

/// Warm alloc+free pairs of `size` through the raw API (what C callers and Paddle use).
fn pair_ours(size: usize, n: usize) -> Result<f64, String> {
    let a = CachingAllocator::builder(SparseSource)
        .config(Config::default())
        .capacity(1 << 40)
        .build()
        .map_err(|e| e.to_string())?;
    let warm = a.allocate_raw(size, None).map_err(|e| e.to_string())?;
    a.free_raw(warm).map_err(|e| e.to_string())?;
    let t = Instant::now();
    for _ in 0..n {
        let p = a.allocate_raw(black_box(size), None).map_err(|e| e.to_string())?;
        a.free_raw(black_box(p)).map_err(|e| e.to_string())?;
    }
    Ok(ns_per(t.elapsed(), n))
}

/// The same pairs through the system allocator (a `Vec`'s buffer: malloc and free).
fn pair_malloc(size: usize, n: usize) -> f64 {
    let t = Instant::now();
    for _ in 0..n {
        let v: Vec<u8> = Vec::with_capacity(black_box(size));
        drop(black_box(v));
    }
    ns_per(t.elapsed(), n)
}

fn seg(len: usize) -> Result<Arc<Segment>, String> {
    ShmemSource::new().create_segment(len).map(Arc::new).map_err(|e| e.to_string())
}

/// Host-to-device copies of `size` on one queue, back to back, GB/s.
fn copy_ours(q: &Queue, size: usize, n: usize) -> Result<f64, String> {
    let host = HostBuffer::new(size).map_err(|e| e.to_string())?;
    let dev = seg(size)?;
    let (d, s) = (Mem::from(&dev), Mem::from(&host));
    q.copy(&d, &s).map_err(|e| e.to_string())?;
    q.synchronize().map_err(|e| e.to_string())?;
    let t = Instant::now();
    for _ in 0..n {
        q.copy(&d, &s).map_err(|e| e.to_string())?;
    }
    q.synchronize().map_err(|e| e.to_string())?;
    Ok((size * n) as f64 / t.elapsed().as_secs_f64() / 1e9)
}

/// Host-to-device-sized memcpy between two private page-aligned buffers, GB/s.
fn copy_memcpy(size: usize, n: usize) -> f64 {
    let src = PageBuf::new(size, 1);
    let mut dst = PageBuf::new(size, 0);
    dst.get_mut().copy_from_slice(src.get());
    let t = Instant::now();
    for _ in 0..n {
        dst.get_mut().copy_from_slice(black_box(src.get()));
        black_box(dst.get_mut());
    }
    (size * n) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// Submit-to-complete time of one 4 KiB host-to-device copy on an idle queue (median), ns:
/// from the call until the queue is idle again (the copy is done; small copies run inline).
fn latency_ours(q: &Queue, n: usize) -> Result<f64, String> {
    let host = HostBuffer::new(4096).map_err(|e| e.to_string())?;
    let dev = seg(4096)?;
    let (d, s) = (Mem::from(&dev), Mem::from(&host));
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        q.copy(&d, &s).map_err(|e| e.to_string())?;
        while !q.is_idle() {
            std::hint::spin_loop();
        }
        v.push(t.elapsed());
    }
    v.sort();
    Ok(v[n / 2].as_nanos() as f64)
}

/// The peer of [`latency_ours`]: one 4 KiB memcpy between private page-aligned buffers
/// (median), ns.
fn latency_memcpy(n: usize) -> f64 {
    let src = PageBuf::new(4096, 1);
    let mut dst = PageBuf::new(4096, 0);
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        dst.get_mut().copy_from_slice(black_box(src.get()));
        black_box(dst.get_mut());
        v.push(t.elapsed());
    }
    v.sort();
    v[n / 2].as_nanos() as f64
}

/// Runs everything and prints the summary; returns an error message on failure.
pub fn run(o: &Options) -> Result<(), String> {
    let scale = if o.quick { 20 } else { 1 };
    let rounds = if o.quick { 2 } else { 5 };
    let steps = 5 + usize::from(!o.no_pipeline);
    let mut p = Progress { step: 0, steps };
    let mut rows = Vec::new();
    let lower = |a: f64, b: f64| a < b;
    let higher = |a: f64, b: f64| a > b;

    for (label, size) in [("alloc+free 4 KiB", 4096usize), ("alloc+free 1 MiB", 1 << 20)] {
        p.say(&format!("caching allocator: {label} pairs against malloc"));
        let n = 200_000 / scale;
        let mut ours = f64::INFINITY;
        for _ in 0..rounds {
            ours = ours.min(pair_ours(size, n)?);
        }
        let peer = best(rounds, || pair_malloc(size, n), lower);
        rows.push(Row { what: label.into(), ours, peer, unit: "ns", higher_is_better: false, peer_name: "malloc" });
    }

    let q = Queue::new().map_err(|e| e.to_string())?;
    for (label, size, n) in
        [("copy 1 MiB h2d", 1usize << 20, 2000 / scale), ("copy 64 MiB h2d", 64 << 20, 40 / scale.min(8))]
    {
        p.say(&format!("queue: {label} against memcpy"));
        let mut ours = 0.0f64;
        for _ in 0..rounds {
            ours = ours.max(copy_ours(&q, size, n)?);
        }
        let peer = best(rounds, || copy_memcpy(size, n), higher);
        rows.push(Row { what: label.into(), ours, peer, unit: "GB/s", higher_is_better: true, peer_name: "memcpy" });
    }

    p.say("queue: 4 KiB copy, submit to complete, against memcpy");
    let n = 20_000 / scale;
    let ours = latency_ours(&q, n)?;
    let peer = latency_memcpy(n);
    rows.push(Row {
        what: "copy 4 KiB latency".into(),
        ours,
        peer,
        unit: "ns",
        higher_is_better: false,
        peer_name: "memcpy",
    });
    drop(q);

    let mut pipeline_note = None;
    if !o.no_pipeline {
        p.say("zero-copy pipeline (3 processes, dma-buf fds over Unix sockets) against pipes");
        match crate::pipeline_rows(o.quick) {
            Ok((zero, pipes, copied)) => {
                rows.push(Row {
                    what: "pipeline frames/s".into(),
                    ours: zero,
                    peer: pipes,
                    unit: "frames/s",
                    higher_is_better: true,
                    peer_name: "pipes",
                });
                pipeline_note = Some(copied);
            }
            Err(e) => return Err(format!("pipeline: {e}")),
        }
    }

    println!();
    println!("dmabuf-rt bench on the embedded default device (shmem), peers measured in the same run");
    println!(
        "{:<24}{:>12} {:<9}{:>12} {:<9}{:<8}{:>10}",
        "figure", "dmabuf-rt", "", "peer", "", "peer is", "ours/peer"
    );
    for r in &rows {
        let prec = if r.unit == "GB/s" { 2 } else { 1 };
        println!(
            "{:<24}{:>12.*} {:<9}{:>12.*} {:<9}{:<8}{:>9.2}x",
            r.what,
            prec,
            r.ours,
            r.unit,
            prec,
            r.peer,
            r.unit,
            r.peer_name,
            r.ours / r.peer,
        );
    }
    println!();
    for r in &rows {
        let adv = r.advantage();
        let verdict = if adv >= 1.0 { format!("{adv:.2}x better") } else { format!("{:.2}x worse", 1.0 / adv) };
        println!(
            "  {:<24} {verdict} than {} ({})",
            r.what,
            r.peer_name,
            if r.higher_is_better { "higher is better" } else { "lower is better" }
        );
    }
    if let Some(copied) = pipeline_note {
        println!("  pipeline bytes copied: {copied} with dma-buf fds, every frame byte through pipes in the baseline");
    }
    Ok(())
}
