//! Writes synthetic allocation traces shaped like four model workloads, for
//! `dmabuf-rt replay`: transformer training, CNN training, variable-length inference and
//! KV-cache decoding. They follow the allocation order of an eager framework (activations
//! kept for backward and freed in reverse, gradients, optimizer state, temporaries), with
//! sizes from the layer shapes. They are *synthetic*: real traces from a framework's
//! profiler are the better test, and these are a reproducible stand-in until then.
//!
//! Run: `cargo run --release --example model_traces -- DIR`, then
//! `dmabuf-rt replay DIR/transformer_train.jsonl --find-min-capacity`.

use std::fmt::Write as _;
use std::io::Write as _;

struct Trace {
    out: String,
    t: u64,
    next: u64,
}

impl Trace {
    fn new() -> Self {
        Self { out: String::new(), t: 0, next: 1 }
    }
    fn alloc(&mut self, size: usize) -> u64 {
        let a = self.next;
        self.next += 1;
        self.t += 1000;
        let _ = writeln!(self.out, "{{\"t\":{},\"op\":\"alloc\",\"addr\":{a},\"size\":{size}}}", self.t);
        a
    }
    fn free(&mut self, a: u64) {
        self.t += 1000;
        let _ = writeln!(self.out, "{{\"t\":{},\"op\":\"free\",\"addr\":{a}}}", self.t);
    }
}

/// xorshift, so the traces are the same on every run.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

const F32: usize = 4;
const BF16: usize = 2;

fn transformer_train() -> Trace {
    let mut t = Trace::new();
    let (layers, hidden, heads, vocab) = (12usize, 768usize, 12usize, 32000usize);
    // Parameters and Adam state live for the whole run.
    let mut params = Vec::new();
    for _ in 0..layers {
        for &(r, c) in &[(hidden, 3 * hidden), (hidden, hidden), (hidden, 4 * hidden), (4 * hidden, hidden)] {
            params.push((t.alloc(r * c * F32), r * c * F32));
        }
    }
    params.push((t.alloc(vocab * hidden * F32), vocab * hidden * F32));
    let state: Vec<u64> = params.iter().flat_map(|&(_, s)| [s, s]).map(|s| t.alloc(s)).collect();
    let (batch, seq) = (8usize, 512usize);
    let tok = batch * seq;
    for _step in 0..6 {
        let mut saved = Vec::new();
        for _ in 0..layers {
            saved.push(t.alloc(tok * hidden * BF16)); // layer input
            let qkv = t.alloc(tok * 3 * hidden * BF16);
            let scores = t.alloc(batch * heads * seq * seq * BF16);
            saved.push(t.alloc(batch * heads * seq * seq * BF16)); // softmax kept for backward
            t.free(scores);
            saved.push(qkv);
            saved.push(t.alloc(tok * hidden * BF16)); // attention out
            saved.push(t.alloc(tok * 4 * hidden * BF16)); // MLP up
            let gelu = t.alloc(tok * 4 * hidden * BF16);
            saved.push(gelu);
        }
        let logits = t.alloc(tok * vocab * BF16);
        let grad_logits = t.alloc(tok * vocab * BF16);
        t.free(logits);
        let grads: Vec<u64> = params.iter().map(|&(_, s)| t.alloc(s)).collect();
        t.free(grad_logits);
        for a in saved.into_iter().rev() {
            let tmp = t.alloc(tok * 4 * hidden * BF16);
            t.free(tmp);
            t.free(a);
        }
        for g in grads {
            t.free(g);
        }
    }
    for a in state {
        t.free(a);
    }
    for (a, _) in params {
        t.free(a);
    }
    t
}

fn cnn_train() -> Trace {
    let mut t = Trace::new();
    let batch = 64usize;
    let stages = [(64usize, 112usize), (128, 56), (256, 28), (512, 14), (1024, 7)];
    let mut params = Vec::new();
    for &(c, _) in &stages {
        for _ in 0..3 {
            params.push(t.alloc(c * c * 9 * F32));
        }
    }
    for _step in 0..8 {
        let mut saved = Vec::new();
        for &(c, hw) in &stages {
            for _ in 0..3 {
                saved.push(t.alloc(batch * c * hw * hw * BF16)); // conv out
                saved.push(t.alloc(batch * c * hw * hw * BF16)); // bn out
                let ws = t.alloc(32 << 20); // cuDNN-style workspace
                t.free(ws);
            }
        }
        let grads: Vec<u64> = stages.iter().flat_map(|&(c, _)| [c; 3]).map(|c| t.alloc(c * c * 9 * F32)).collect();
        for a in saved.into_iter().rev() {
            t.free(a);
        }
        for g in grads {
            t.free(g);
        }
    }
    for p in params {
        t.free(p);
    }
    t
}

fn variable_inference() -> Trace {
    let mut t = Trace::new();
    let mut rng = Rng(42);
    let (layers, hidden, heads) = (24usize, 1024usize, 16usize);
    let weights: Vec<u64> = (0..layers * 4).map(|_| t.alloc(hidden * hidden * 4 * BF16)).collect();
    for _req in 0..200 {
        let (batch, seq) = (1 + rng.below(8) as usize, 16 + rng.below(2000) as usize);
        let tok = batch * seq;
        let mut x = t.alloc(tok * hidden * BF16);
        for _ in 0..layers {
            let qkv = t.alloc(tok * 3 * hidden * BF16);
            let scores = t.alloc(batch * heads * seq * seq * BF16);
            let attn = t.alloc(tok * hidden * BF16);
            t.free(scores);
            t.free(qkv);
            let up = t.alloc(tok * 4 * hidden * BF16);
            let y = t.alloc(tok * hidden * BF16);
            t.free(up);
            t.free(attn);
            t.free(x);
            x = y;
        }
        t.free(x);
    }
    for w in weights {
        t.free(w);
    }
    t
}

fn kv_cache_decode() -> Trace {
    let mut t = Trace::new();
    let mut rng = Rng(7);
    let (layers, hidden) = (32usize, 4096usize);
    let weights: Vec<u64> = (0..layers).map(|_| t.alloc(hidden * hidden * 12 * BF16)).collect();
    // Requests join and leave; each layer's KV cache grows by reallocation every 128 tokens.
    let mut live: Vec<(Vec<u64>, usize, usize)> = Vec::new(); // (per-layer caches, len, target)
    for step in 0..3000 {
        if live.len() < 16 && rng.below(4) == 0 {
            let target = 64 + rng.below(2048) as usize;
            let caches = (0..layers).map(|_| t.alloc(2 * 128 * hidden * BF16)).collect();
            live.push((caches, 0, target));
        }
        let mut i = 0;
        while i < live.len() {
            let (caches, len, target) = &mut live[i];
            *len += 1;
            if *len % 128 == 0 {
                let cap = (*len + 128) * 2 * hidden * BF16;
                for c in caches.iter_mut() {
                    let bigger = t.alloc(cap);
                    t.free(*c);
                    *c = bigger;
                }
            }
            if *len >= *target {
                let (caches, _, _) = live.swap_remove(i);
                for c in caches {
                    t.free(c);
                }
            } else {
                i += 1;
            }
        }
        let tmp = t.alloc((live.len().max(1)) * hidden * 4 * BF16 + step % 7 * 512);
        t.free(tmp);
    }
    for (caches, _, _) in live {
        for c in caches {
            t.free(c);
        }
    }
    for w in weights {
        t.free(w);
    }
    t
}

fn main() {
    let dir = std::env::args().nth(1).unwrap_or_else(|| "traces".into());
    std::fs::create_dir_all(&dir).expect("create the output directory");
    for (name, trace) in [
        ("transformer_train", transformer_train()),
        ("cnn_train", cnn_train()),
        ("variable_inference", variable_inference()),
        ("kv_cache_decode", kv_cache_decode()),
    ] {
        let path = format!("{dir}/{name}.jsonl");
        let mut f = std::fs::File::create(&path).expect("create trace file");
        f.write_all(trace.out.as_bytes()).expect("write trace");
        println!("{path}: {} ops", trace.next - 1 + trace.out.lines().filter(|l| l.contains("free")).count() as u64);
    }
}
