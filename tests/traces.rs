//! The caching allocator on real PyTorch allocation traces (examples/torch-traces, recorded
//! with torch's profiler on CPU): every trace replays without a failure, the accounting is
//! exact, a warm training loop reserves no new memory, and a trace repeated with trimming off
//! settles (its warm steps call the memory source no more).

use std::collections::HashMap;

use dmabuf_rt::caching::replay::{ReplayOptions, ReplaySource, TraceOp, parse_trace, replay, replay_with};
use dmabuf_rt::caching::{CachingAllocator, Config};
use dmabuf_rt::source::SparseSource;

const TRACES: [&str; 10] = [
    "transformer_train",
    "cnn_train",
    "varlen_infer",
    "kv_decode",
    "llm_serving",
    "moe_train",
    "finetune_ckpt",
    "cnn_multires",
    "transformer_train_small",
    "varlen_infer_seed2",
];

/// The traces are compiled in, so the test binary also runs where the source tree is not
/// (the kernel lane's guest).
fn trace(name: &str) -> Vec<TraceOp> {
    let text = match name {
        "transformer_train" => include_str!("../examples/torch-traces/transformer_train.jsonl"),
        "cnn_train" => include_str!("../examples/torch-traces/cnn_train.jsonl"),
        "varlen_infer" => include_str!("../examples/torch-traces/varlen_infer.jsonl"),
        "kv_decode" => include_str!("../examples/torch-traces/kv_decode.jsonl"),
        "llm_serving" => include_str!("../examples/torch-traces/llm_serving.jsonl"),
        "moe_train" => include_str!("../examples/torch-traces/moe_train.jsonl"),
        "finetune_ckpt" => include_str!("../examples/torch-traces/finetune_ckpt.jsonl"),
        "cnn_multires" => include_str!("../examples/torch-traces/cnn_multires.jsonl"),
        "transformer_train_small" => include_str!("../examples/torch-traces/transformer_train_small.jsonl"),
        "varlen_infer_seed2" => include_str!("../examples/torch-traces/varlen_infer_seed2.jsonl"),
        other => panic!("no trace {other}"),
    };
    parse_trace(text).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The peak of live bytes, each request rounded to 512 bytes as the allocator rounds it.
fn peak_rounded(ops: &[TraceOp]) -> u64 {
    let (mut live, mut now, mut peak) = (HashMap::new(), 0u64, 0u64);
    for op in ops {
        match *op {
            TraceOp::Alloc { addr, size } => {
                let r = size.max(512).next_multiple_of(512) as u64;
                live.insert(addr, r);
                now += r;
                peak = peak.max(now);
            }
            TraceOp::Free { addr } => now -= live.remove(&addr).unwrap_or(0),
            TraceOp::Step => {}
        }
    }
    peak
}

fn config(expandable: bool) -> Config {
    Config::parse(if expandable { "expandable_segments:True" } else { "expandable_segments:False" }).unwrap()
}

#[test]
fn real_traces_replay_with_exact_accounting() {
    for name in TRACES {
        let ops = trace(name);
        let want_peak = peak_rounded(&ops);
        for expandable in [true, false] {
            let r = replay(&ops, ReplaySource::Virtual, 1 << 40, &config(expandable)).unwrap();
            let mode = if expandable { "expandable" } else { "classic" };
            println!(
                "{name:<18} {mode:<10} peak allocated {:>11} reserved {:>11} ratio {:.4} backend allocs {} frees {}",
                r.peak_allocated_bytes, r.peak_reserved_bytes, r.ratio, r.backend_allocs, r.backend_frees
            );
            assert_eq!(r.ooms, 0, "{name} {mode}");
            assert_eq!(r.ops as usize, ops.iter().filter(|op| **op != TraceOp::Step).count());
            if expandable {
                // Blocks are split to the request, so allocated is exactly the rounded live sum.
                assert_eq!(r.peak_allocated_bytes, want_peak, "{name} {mode}");
            } else {
                // Classic segments may hand out a whole block that was not worth splitting.
                assert!(r.peak_allocated_bytes >= want_peak, "{name} {mode}");
            }
            assert!(r.peak_reserved_bytes >= r.peak_allocated_bytes, "{name} {mode}");
        }
    }
}

/// Replays `ops[..to]` on one allocator with `cfg` and returns the calls to the memory source
/// (growths or new segments, punches or released segments) made from op `from` on.
fn backend_calls_after(ops: &[TraceOp], from: usize, to: usize, cfg: &str) -> (i64, i64) {
    let a =
        CachingAllocator::builder(SparseSource).config(Config::parse(cfg).unwrap()).capacity(1 << 40).build().unwrap();
    let mut live = HashMap::new();
    let mut at = (0, 0);
    for (i, op) in ops[..to].iter().enumerate() {
        if i == from {
            let st = a.stats();
            at = (st.num_device_alloc, st.num_device_free);
        }
        match *op {
            TraceOp::Alloc { addr, size } => {
                live.insert(addr, a.allocate(size, None).unwrap());
            }
            TraceOp::Free { addr } => drop(live.remove(&addr)),
            TraceOp::Step => {}
        }
    }
    let st = a.stats();
    (st.num_device_alloc - at.0, st.num_device_free - at.1)
}

#[test]
fn a_warm_training_loop_reserves_no_new_memory() {
    // Training steps 2-5 repeat step 2's sizes exactly; steps 3 and 4 (the middle of the
    // trace, before the teardown) must not grow anything. With the default trim ratio they
    // punch a few pages per step to keep peak reserved within 4.5% of peak allocated (the
    // layout best fit settles on touches more than that); with trimming off, the transformer
    // makes no call at all.
    for name in ["transformer_train", "cnn_train"] {
        let ops = trace(name);
        let (from, to) = (ops.len() * 45 / 100, ops.len() * 80 / 100);
        let (grown, punched) = backend_calls_after(&ops, from, to, "");
        println!("{name}: warm steps 3-4 made {grown} growths and {punched} punches");
        assert_eq!(grown, 0, "{name}: a warm step grew a segment");
        assert!(punched <= 30, "{name}: {punched} punches in two warm steps");
    }
    let ops = trace("transformer_train");
    let (from, to) = (ops.len() * 45 / 100, ops.len() * 80 / 100);
    assert_eq!(backend_calls_after(&ops, from, to, "trim_ratio:0"), (0, 0), "transformer_train, trimming off");
}

#[test]
fn a_repeated_trace_settles_with_trimming_off() {
    // The trace replayed 4 times on one allocator: with trimming off nothing is given back, so
    // once the first repetitions have grown the segments, the warm half of the steps (the
    // second half, counting the step markers of the newer traces) calls the source no more.
    // Not every trace settles: cnn_train, moe_train, cnn_multires and finetune_ckpt still grow
    // a segment now and then in their warm half at some repetition counts.
    let cfg = Config::parse("trim_ratio:0").unwrap();
    for (name, markers) in [
        ("transformer_train", 0),
        ("varlen_infer", 0),
        ("kv_decode", 0),
        ("llm_serving", 106),
        ("transformer_train_small", 7),
        ("varlen_infer_seed2", 25),
    ] {
        let ops = trace(name);
        assert_eq!(ops.iter().filter(|op| **op == TraceOp::Step).count(), markers, "{name}: step markers");
        let r = replay_with(
            &ops,
            ReplaySource::Virtual,
            1 << 40,
            &cfg,
            &ReplayOptions { repeat: 4, ..ReplayOptions::default() },
        )
        .unwrap();
        println!("{name}: {} steps, {} warm, {} warm source calls", r.steps, r.warm_steps, r.warm_source_calls);
        assert_eq!(r.ooms, 0, "{name}");
        assert_eq!(r.steps, 4 * (markers as u64 + 1), "{name}: steps");
        assert_eq!(r.warm_source_calls, 0, "{name}: a warm step called the source");
    }
}

#[test]
fn the_trim_policy_holds_its_bound_on_every_trace() {
    // Expandable segments only (page stitching off): with trimming on (the default), the
    // reserved bytes stay within `trim_ratio` times the peak allocated, give or take the pages
    // that blocks in use only partly cover (which cannot be punched): a cached block whose
    // front was punched gives back its own backed end past the request (the variable-length
    // trace once reached 1.0996 that way).
    let c = Config::parse("page_stitching:False").unwrap();
    for name in TRACES {
        let r = replay_with(
            &trace(name),
            ReplaySource::Virtual,
            1 << 40,
            &c,
            &ReplayOptions { repeat: 2, ..ReplayOptions::default() },
        )
        .unwrap();
        println!("{name}: reserved / allocated {:.4}", r.ratio);
        assert!(
            r.ratio <= c.trim_ratio + 0.005,
            "{name}: peak reserved {} is {:.4} x peak allocated {}",
            r.peak_reserved_bytes,
            r.ratio,
            r.peak_allocated_bytes
        );
    }
}

/// Issue 12: with page stitching (the default), blocks from four units are home blocks or
/// stitched views of a queue's arena, whose memory is the units of the live blocks: peak
/// reserved stays within 1.03 of peak allocated; once warm (the second half of six
/// repetitions) no step calls the source or maps a view, and the views made do not grow with
/// the length of the run (four repetitions make as many as six). (The arena grows instead of
/// stitching within `stitch_grow_slack` of the peak, which makes some traces settle in their
/// third repetition rather than their second; `stitch_grow_slack:0` is checked too.)
#[test]
fn the_stitched_arena_holds_its_bound_and_calls_nothing_once_warm() {
    for cfg in ["", "stitch_grow_slack:0", "stitch_unit_kb:16", "stitch_unit_kb:32"] {
        let c = Config::parse(cfg).unwrap();
        for name in TRACES {
            let run = |repeat| {
                let opts = ReplayOptions { repeat, ..ReplayOptions::default() };
                replay_with(&trace(name), ReplaySource::Virtual, 1 << 40, &c, &opts).unwrap()
            };
            let (r, half) = (run(6), run(4));
            println!(
                "{name} [{cfg}]: reserved / allocated {:.4}, warm source calls {}, warm remaps {}",
                r.ratio, r.warm_source_calls, r.warm_remaps
            );
            // With the default 4 KiB units every trace holds 1.03. With larger units
            // llm_serving's blocks under four units stay in the small pool, whose cached pages
            // the arena cannot use (and at 32 KiB units the trim policy punches them every
            // step): held to what it reaches now, so that it cannot get worse unseen.
            let (bound, per_step) = match (cfg, name) {
                ("" | "stitch_grow_slack:0", _) => (1.03, 0.0),
                (_, n) if n != "llm_serving" => (1.03, 0.0),
                ("stitch_unit_kb:16", _) => (1.045, 0.0),
                // 11.5 with `stitch_grow_slack:0`: the slack's growth early in the trace
                // leaves another layout for the trim policy to punch.
                _ => (1.055, 13.5),
            };
            let calls = r.warm_source_calls as f64 / r.warm_steps.max(1) as f64;
            assert!(r.ratio <= bound, "{name} [{cfg}]: peak reserved / peak allocated {:.4}", r.ratio);
            assert!(calls <= per_step, "{name} [{cfg}]: {calls:.2} source calls per warm step");
            // Oldest-first choice settles: a warm step finds every view it needs.
            assert_eq!(r.warm_remaps, 0, "{name} [{cfg}]: warm steps made views");
            assert_eq!(r.remaps, half.remaps, "{name} [{cfg}]: views made grow with the length of the run");
            // Every trace leaves some free memory split somewhere at some point of its first
            // step: a block is stitched (which exercises the views, not only home blocks).
            assert!(r.remaps > 0, "{name} [{cfg}]: no block was stitched");
        }
    }
}

/// `ReplayApi::Raw` (raw pointers, as C and PyTorch callers hold blocks) drives the allocator
/// to the same decisions as `Allocation`s: every figure but the time is equal, on every trace,
/// at full capacity and at a capacity that makes some requests fail.
#[test]
fn a_raw_replay_decides_as_an_owned_one() {
    use dmabuf_rt::caching::replay::ReplayApi;
    let c = Config::default();
    for name in TRACES {
        let ops = trace(name);
        let run = |api, capacity| {
            let opts = ReplayOptions { repeat: 2, api };
            let mut r = replay_with(&ops, ReplaySource::Virtual, capacity, &c, &opts).unwrap();
            r.ns_per_op = 0.0;
            format!("{r:?}")
        };
        let owned = run(ReplayApi::Owned, 1 << 40);
        assert_eq!(run(ReplayApi::Raw, 1 << 40), owned, "{name}");
        let peak = replay_with(&ops, ReplaySource::Virtual, 1 << 40, &c, &ReplayOptions::default())
            .unwrap()
            .peak_allocated_bytes;
        let tight = peak * 3 / 4;
        let (o, r) = (run(ReplayApi::Owned, tight), run(ReplayApi::Raw, tight));
        assert!(o.contains("ooms: ") && !o.contains("ooms: 0,"), "{name}: no request failed at 3/4 of the peak: {o}");
        assert_eq!(r, o, "{name} at 3/4 of its peak");
    }
}
