//! The 28th hostile review: the page-stitched arenas' *map credit* and the *hungry* arena
//! (commits 2a25a7f, ce9d5ed). An arena starts with 1,024 runs of credit, earns a 512th of a run
//! per block it hands out, gets a cached view's runs back when it is taken again and spends a
//! new view's runs; out of credit it is hungry until the credit is full again: a block that
//! fits no free run then grows the arena within 10% above the allocated bytes instead of being
//! stitched, and the trim policy does not count the hungry arena's free units.
//!
//! Attacked, through the public API only: random workloads that drive an arena hungry, then a
//! memory fraction lowered to the reserved bytes (an exact model: a request succeeds iff its
//! units fit in the allowed memory beside the live units, whatever the placement; a refusal is
//! an OOM error, never a panic or hang; reserved never above allowed), `empty_cache` while
//! hungry (the reserved bytes drop to exactly the live units), the same workload side by side
//! with `stitch_grow_slack:0` (the same refusals, every live block's bytes intact), the peak
//! reserved against the peak allocated after a random phase and for a periodic workload on a
//! fresh allocator, several queues and threads with cross-thread frees, and the trim policy
//! (`trim_ratio` 1.01, 1.045, 0) with small blocks interleaved.
//!
//! Found: a periodic workload on a fresh allocator whose first step stitches more than 1,024
//! runs of views (2,400 pairs of a 128 KiB and a 16 KiB block, the 16 KiB ones freed, then
//! 1,440 blocks of 32 KiB, each a view of two holes) runs the arena out of credit within that
//! step; hungry, the rest of the step's blocks grow the arena (within 10%) instead of taking
//! the scattered free units, which stay free, and the peak reserved ends 6.2% above the peak
//! allocated (384,303,104 / 361,758,720, 1,026 remaps), where the allocator promises 3% (the
//! `stitch_grow_slack` docs). Before 2a25a7f the same workload peaked at 1.019 (368,689,152,
//! 1,978 remaps); `stitch_grow_slack:0` keeps it at 1.000. The cause is `Pool::grow_slack`
//! (src/caching/pool/stitched.rs) widening the slack to `Arena::WIDE_SLACK` as soon as the
//! credit runs out, within the step that spent it, whatever the workload's periodicity (the
//! credit refills when views are taken again: a step too late for the peak, which stays).
//! Fixed: an arena turns hungry only once, besides its credit, a full credit's worth of runs
//! sits in views cached unused (`Arena::want_map`): credit spent on views still in use, as a
//! first step's, does not make it hungry. Everything else held: see the test list.

#![allow(unsafe_code)]

mod common;

use std::collections::VecDeque;
use std::sync::mpsc;
use std::time::Duration;

use common::tags::{Raw, check_stamp, settled, stamp};
use common::{Rng, scaled};
use dmabuf_rt::caching::stats::AGGREGATE;
use dmabuf_rt::caching::{Allocation, CachingAllocator};
use dmabuf_rt::error::ErrorKind;
use dmabuf_rt::queue::Queue;

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;
const UNIT: usize = 4 * KB;

/// An allocator over sparse shmem with page-stitched arenas and the settings `conf`.
fn arena_allocator(conf: &str, capacity: usize) -> CachingAllocator {
    common::allocator(&format!("expandable_segments:True,page_stitching:True,{conf}"), capacity as u64)
}

#[track_caller]
fn invariants(a: &CachingAllocator, what: &str) {
    a.check_invariants().unwrap_or_else(|e| panic!("{what}: invariants: {e}"));
}

/// The bytes the allocator counts for a request of `size` (512-byte rounding).
fn rounded(size: usize) -> usize {
    size.max(1).next_multiple_of(512)
}

/// The bytes of arena units a block of `size` bytes takes (4 KiB units).
fn units(size: usize) -> usize {
    rounded(size).next_multiple_of(UNIT)
}

fn reserved(a: &CachingAllocator) -> usize {
    a.stats().reserved_bytes[AGGREGATE].current as usize
}

/// A random arena size from 16 KiB to 8 MiB, log-uniform (the random workload of
/// `benches/allocator.rs`).
fn random_size(rng: &mut Rng) -> usize {
    let (lo, hi) = ((16.0 * KB as f64).ln(), (8.0 * MB as f64).ln());
    let x = lo + (hi - lo) * (rng.below(1 << 20) as f64 / (1u64 << 20) as f64);
    (x.exp() as usize).clamp(16 * KB, 8 * MB)
}

/// Live blocks of one allocator, tagged at both ends, with the bytes the model expects.
struct Model {
    a: CachingAllocator,
    live: Vec<(Allocation, u64)>,
    live_units: usize,
    live_rounded: usize,
}

impl Model {
    fn new(a: CachingAllocator) -> Model {
        Model { a, live: Vec::new(), live_units: 0, live_rounded: 0 }
    }

    fn alloc(&mut self, size: usize, q: Option<&Queue>) -> dmabuf_rt::error::Result<()> {
        let x = self.a.allocate(size, q)?;
        assert_eq!(x.len(), size);
        let tag = stamp(x.as_ptr(), x.len());
        self.live_units += units(size);
        self.live_rounded += rounded(size);
        self.live.push((x, tag));
        Ok(())
    }

    fn free(&mut self, i: usize, what: &str) {
        let (x, tag) = self.live.swap_remove(i);
        check_stamp(x.as_ptr(), x.len(), tag, what);
        self.live_units -= units(x.len());
        self.live_rounded -= rounded(x.len());
        drop(x);
    }

    /// The statistics the model knows exactly, and the invariants.
    #[track_caller]
    fn check(&self, what: &str) {
        invariants(&self.a, what);
        let s = self.a.stats();
        assert_eq!(s.allocated_bytes[AGGREGATE].current as usize, self.live_rounded, "{what}: allocated bytes");
        assert_eq!(s.allocation[AGGREGATE].current as usize, self.live.len(), "{what}: allocations");
        assert!(s.reserved_bytes[AGGREGATE].current as usize >= self.live_units, "{what}: reserved below live units");
    }

    fn check_tags(&self, what: &str) {
        for (x, tag) in &self.live {
            check_stamp(x.as_ptr(), x.len(), *tag, what);
        }
    }

    fn free_all(&mut self, what: &str) {
        while !self.live.is_empty() {
            self.free(self.live.len() - 1, what);
        }
    }
}

/// A random workload of arena sizes (live set held near `target` blocks) until the arena is
/// seen hungry: `wide` blocks that grew it, with no mapping, though its free units held them
/// and the reserved bytes end above the default 2% slack (only a hungry arena's 10% allows
/// that); at most `cap` steps. Returns the steps it took and the wide growths seen.
fn drive_hungry(
    m: &mut Model,
    rng: &mut Rng,
    target: usize,
    wide: usize,
    cap: usize,
    q: Option<&Queue>,
) -> (usize, usize) {
    let mut step = 0;
    let mut seen = 0;
    while step < cap && seen < wide {
        let what = format!("driving, step {step}");
        if m.live.len() < target / 2 || (m.live.len() < target * 3 / 2 && rng.below(2) == 0) {
            let size = random_size(rng);
            let s0 = m.a.stats();
            let r0 = s0.reserved_bytes[AGGREGATE].current as usize;
            let free0 = r0 - m.live_units;
            m.alloc(size, q).unwrap_or_else(|e| panic!("{what}: {e}"));
            let s1 = m.a.stats();
            let r1 = s1.reserved_bytes[AGGREGATE].current as usize;
            if r1 > r0
                && s1.num_remaps == s0.num_remaps
                && free0 >= units(size)
                && r1 as f64 > 1.021 * m.live_rounded as f64
            {
                seen += 1;
            }
        } else {
            let i = rng.below(m.live.len() as u64) as usize;
            m.free(i, &what);
        }
        if step % 1024 == 0 {
            m.check(&what);
        }
        step += 1;
    }
    m.check("driven");
    assert!(seen >= wide, "never hungry in {step} steps ({} remaps)", m.a.stats().num_remaps);
    (step, seen)
}

/// The most steps a drive towards a hungry arena takes. Not scaled down on slow machines (the
/// kernel lane's TCG guest): turning hungry takes a fixed amount of work (a credit's worth of
/// runs spent, and as many cached unused), which no time scale shrinks, and a drive stops as
/// soon as it sees the arena hungry.
const HUNGRY_CAP: usize = 200_000;

/// Sets the fraction so that the allowed memory is at least `floor` bytes (and as close as
/// the float allows); returns the allowed bytes as the pool computes them.
fn limit_to(a: &CachingAllocator, floor: usize) -> usize {
    let cap = a.capacity() as f64;
    let mut f = (floor as f64 + 0.5) / cap;
    while ((cap * f) as u64 as usize) < floor {
        f += 1.0 / cap;
    }
    a.set_memory_fraction(f.min(1.0)).unwrap();
    (cap * f.min(1.0)) as u64 as usize
}

/// One request under a limit, checked against the exact model: it succeeds iff its units fit
/// in the allowed memory beside the live units (free units, stitched, hold any block; the
/// placement is the allocator's business), and a refusal is an OOM error.
fn limited_request(m: &mut Model, size: usize, allowed: usize, q: Option<&Queue>, what: &str) -> bool {
    let fits = m.live_units + units(size) <= allowed;
    let before = m.a.stats().num_ooms;
    match m.alloc(size, q) {
        Ok(()) => assert!(
            fits,
            "{what}: {size} bytes served with {} live unit bytes and {allowed} allowed",
            m.live_units - units(size)
        ),
        Err(e) => {
            assert!(
                !fits,
                "{what}: {size} bytes refused with {} live unit bytes, {allowed} allowed, {} reserved: {e}",
                m.live_units,
                reserved(&m.a)
            );
            assert_eq!(e.kind(), ErrorKind::OutOfMemory, "{what}: {e}");
            assert_eq!(m.a.stats().num_ooms, before + 1, "{what}: OOM not counted");
        }
    }
    let r = reserved(&m.a);
    assert!(r <= allowed, "{what}: reserved {r} > allowed {allowed}");
    fits
}

/// A hungry arena under a memory fraction lowered to its reserved bytes: requests that its
/// free units (stitched) hold succeed, larger ones fail with an OOM (the arena may not grow),
/// reserved never passes the allowed memory; `empty_cache` while hungry gives every free unit
/// back; the statistics are exact throughout; everything settles.
#[test]
fn a_hungry_arena_under_a_lowered_fraction() {
    for seed in [0x28_0001u64, 0x28_0002, 0x28_0003] {
        let mut m = Model::new(arena_allocator("", 8 << 30));
        let mut rng = Rng(seed);
        let (steps, _) = drive_hungry(&mut m, &mut rng, 600, 5, HUNGRY_CAP, None);
        eprintln!("seed {seed:#x}: hungry after {steps} steps, {} remaps", m.a.stats().num_remaps);
        let mut allowed = limit_to(&m.a, reserved(&m.a));
        let (mut ok, mut refused) = (0, 0);
        let steps = scaled(1500);
        for step in 0..steps {
            let what = format!("seed {seed:#x}, limited step {step}");
            let r = rng.below(100);
            if r < 50 {
                // Sizes near what is free, so both outcomes happen.
                let free = allowed - m.live_units;
                let size = match rng.below(3) {
                    0 => random_size(&mut rng),
                    1 => (free + rng.below(64 * KB as u64) as usize).saturating_sub(32 * KB).max(16 * KB),
                    _ => 16 * KB + rng.below((free / 2).max(1) as u64) as usize,
                };
                if limited_request(&mut m, size, allowed, None, &what) {
                    ok += 1;
                } else {
                    refused += 1;
                }
            } else if r < 92 && !m.live.is_empty() {
                let i = rng.below(m.live.len() as u64) as usize;
                m.free(i, &what);
            } else if r < 96 {
                // Empty the cache while hungry: the free units go back, exactly.
                m.a.empty_cache();
                assert_eq!(reserved(&m.a), m.live_units, "{what}: empty_cache kept free units");
            } else {
                // Another limit: somewhere between the live units and the reserved bytes now.
                let lo = m.live_units;
                let hi = reserved(&m.a).max(lo + UNIT);
                allowed = limit_to(&m.a, lo + rng.below((hi - lo) as u64) as usize);
                if reserved(&m.a) > allowed {
                    // The model holds where nothing above the limit is held: give it back.
                    m.a.empty_cache();
                }
            }
            m.check(&what);
        }
        // A thirtieth of the steps each way (50 of 1,500; the kernel lane runs an eighth).
        let least = steps / 30;
        assert!(
            ok > least && refused > least,
            "seed {seed:#x}: the model was not exercised: {ok} served, {refused} refused in {steps} steps"
        );
        m.check_tags("limited");
        // Back to the whole device: everything fits again.
        m.a.set_memory_fraction(1.0).unwrap();
        for _ in 0..50 {
            let size = random_size(&mut rng);
            m.alloc(size, None).unwrap();
        }
        m.free_all("the end");
        settled(&m.a, "the end");
        m.a.empty_cache();
        assert_eq!(reserved(&m.a), 0, "seed {seed:#x}: reserved bytes left after empty_cache");
    }
}

/// The default slack and `stitch_grow_slack:0` side by side, driven hungry by the same random
/// workload and then limited to the larger of their reserved bytes: the exact model (so the
/// same refusals), every live block's tags intact, the same allocated bytes; the slack-free
/// allocator never grows while free units hold the block.
#[test]
fn hungry_and_slack_free_side_by_side_under_a_limit() {
    for seed in [0x28_1001u64, 0x28_1002] {
        let mut ms =
            [Model::new(arena_allocator("", 8 << 30)), Model::new(arena_allocator("stitch_grow_slack:0", 8 << 30))];
        let mut rng = Rng(seed);
        // The same workload on both: sizes and which block to free, by index (both keep the
        // live set in the same order), until the default one is seen hungry (as `drive_hungry`).
        let mut seen = 0;
        let mut step = 0;
        while seen < 5 && step < HUNGRY_CAP {
            let what = format!("seed {seed:#x}, free step {step}");
            let n = ms[0].live.len();
            if n < 300 || (n < 900 && rng.below(2) == 0) {
                let size = random_size(&mut rng);
                let s0 = ms[0].a.stats();
                let (r0, free0) =
                    (s0.reserved_bytes[AGGREGATE].current as usize, reserved(&ms[0].a) - ms[0].live_units);
                let r0z = reserved(&ms[1].a);
                let free0z = r0z - ms[1].live_units;
                for m in &mut ms {
                    m.alloc(size, None).unwrap_or_else(|e| panic!("{what}: {e}"));
                }
                let s1 = ms[0].a.stats();
                let r1 = s1.reserved_bytes[AGGREGATE].current as usize;
                if r1 > r0
                    && s1.num_remaps == s0.num_remaps
                    && free0 >= units(size)
                    && r1 as f64 > 1.021 * ms[0].live_rounded as f64
                {
                    seen += 1;
                }
                // No slack: growth only for what the free units cannot hold.
                let grew = reserved(&ms[1].a) - r0z;
                assert!(
                    grew <= units(size).saturating_sub(free0z),
                    "{what}: stitch_grow_slack:0 grew {grew} for {size} bytes with {free0z} free"
                );
            } else {
                let i = rng.below(n as u64) as usize;
                for m in &mut ms {
                    m.free(i, &what);
                }
            }
            if step % 200 == 0 {
                for m in &ms {
                    m.check(&what);
                }
            }
            step += 1;
        }
        assert!(seen >= 5, "seed {seed:#x}: the default allocator was never seen hungry in {step} steps");
        assert!(ms[0].a.stats().num_remaps > 0 && ms[1].a.stats().num_remaps > 0);
        // Both limited to the same allowed memory, above either's reserved bytes.
        let floor = reserved(&ms[0].a).max(reserved(&ms[1].a));
        let allowed: Vec<usize> = ms.iter().map(|m| limit_to(&m.a, floor)).collect();
        assert_eq!(allowed[0], allowed[1]);
        let allowed = allowed[0];
        for step in 0..scaled(800) {
            let what = format!("seed {seed:#x}, limited step {step}");
            let n = ms[0].live.len();
            if rng.below(100) < 55 {
                let free = allowed - ms[0].live_units;
                let size = if rng.below(2) == 0 {
                    random_size(&mut rng)
                } else {
                    (free + rng.below(128 * KB as u64) as usize).saturating_sub(64 * KB).max(16 * KB)
                };
                let got: Vec<bool> = ms.iter_mut().map(|m| limited_request(m, size, allowed, None, &what)).collect();
                assert_eq!(got[0], got[1], "{what}: {size} bytes: refused by one config only");
            } else if n > 0 {
                let i = rng.below(n as u64) as usize;
                for m in &mut ms {
                    m.free(i, &what);
                }
            }
            for m in &ms {
                m.check(&what);
            }
            assert_eq!(ms[0].live_units, ms[1].live_units);
        }
        for m in &mut ms {
            m.check_tags("before the end");
            m.free_all("the end");
            settled(&m.a, "the end");
        }
    }
}

/// A random phase that leaves the arena hungry, then a periodic one (the same blocks, step after
/// step): the peak reserved stays within the wide slack (10%, plus unit rounding) of the peak
/// allocated, and the periodic phase, once warm, neither grows nor maps.
#[test]
fn a_periodic_phase_after_a_random_one_stays_bounded() {
    for seed in [0x28_2001u64, 0x28_2002] {
        let mut m = Model::new(arena_allocator("", 8 << 30));
        let mut rng = Rng(seed);
        let (steps, _) = drive_hungry(&mut m, &mut rng, 600, 5, HUNGRY_CAP, None);
        eprintln!("seed {seed:#x}: hungry after {steps} steps, {} remaps", m.a.stats().num_remaps);
        let s = m.a.stats();
        let ratio = s.reserved_bytes[AGGREGATE].peak as f64 / s.allocated_bytes[AGGREGATE].peak as f64;
        assert!(ratio <= 1.11, "seed {seed:#x}: random phase: peak reserved {ratio:.4}x the peak allocated");
        m.free_all("random phase over");
        let pattern: Vec<usize> = (0..60).map(|_| random_size(&mut rng)).collect();
        let frees: Vec<usize> = (0..40).map(|i| (i * 7) % 60).collect();
        let mut warm = (0, 0);
        for step in 0..12 {
            let what = format!("seed {seed:#x}, periodic step {step}");
            let mut held: Vec<Option<Allocation>> = Vec::new();
            for (k, &size) in pattern.iter().enumerate() {
                held.push(Some(m.a.allocate(size, None).unwrap_or_else(|e| panic!("{what}: {e}"))));
                if k % 3 == 2 {
                    let f = frees[k % frees.len()];
                    if f < held.len() {
                        held[f] = None;
                    }
                }
            }
            drop(held);
            invariants(&m.a, &what);
            let s = m.a.stats();
            if step == 9 {
                warm = (s.reserved_bytes[AGGREGATE].current, s.num_remaps);
            }
            if step == 11 {
                assert_eq!(
                    (s.reserved_bytes[AGGREGATE].current, s.num_remaps),
                    warm,
                    "{what}: warm steps grew or mapped"
                );
            }
        }
        let s = m.a.stats();
        let ratio = s.reserved_bytes[AGGREGATE].peak as f64 / s.allocated_bytes[AGGREGATE].peak as f64;
        assert!(ratio <= 1.11, "seed {seed:#x}: peak reserved {ratio:.4}x the peak allocated");
        settled(&m.a, "periodic over");
    }
}

/// One step of a periodic workload whose layout is fragmenting: pairs of a 128 KiB block and a
/// 16 KiB one, the 16 KiB ones freed (2,400 scattered holes of four units), then 32 KiB blocks
/// (eight units: no hole holds one, so each is a view of two holes, until the holes run out)
/// up to a new peak, then everything freed. Returns the peak reserved over the peak allocated
/// after `steps` steps, and the remaps.
fn fragmenting_periodic(conf: &str, steps: usize) -> (f64, i64) {
    let a = arena_allocator(conf, 1 << 30);
    let pairs = 2400;
    for _ in 0..steps {
        let mut big = Vec::with_capacity(pairs);
        let mut holes = Vec::with_capacity(pairs);
        for _ in 0..pairs {
            big.push(a.allocate(128 * KB, None).unwrap());
            holes.push(a.allocate(16 * KB, None).unwrap());
        }
        drop(holes);
        // As many 32 KiB blocks as the holes hold, and a tenth more: the allocated bytes end
        // above the first peak, so the free units left behind show in the peak ratio.
        let fills: Vec<Allocation> = (0..pairs / 2 + pairs / 10).map(|_| a.allocate(32 * KB, None).unwrap()).collect();
        invariants(&a, conf);
        drop(fills);
        drop(big);
    }
    let s = a.stats();
    settled(&a, conf);
    eprintln!(
        "{conf:?}: peak reserved {} / peak allocated {}, {} remaps",
        s.reserved_bytes[AGGREGATE].peak, s.allocated_bytes[AGGREGATE].peak, s.num_remaps
    );
    (s.reserved_bytes[AGGREGATE].peak as f64 / s.allocated_bytes[AGGREGATE].peak as f64, s.num_remaps)
}

/// The same fragmenting periodic workload on a fresh allocator, with the default settings and
/// with `stitch_grow_slack:0`: the peak reserved must stay within the 3% the allocator promises
/// (`Config::stitch_grow_slack`'s docs). Its first step stitches more than 1,024 runs of views,
/// which runs the arena's map credit out.
#[test]
fn a_fragmenting_periodic_workload_keeps_within_three_percent_without_slack() {
    let (ratio, remaps) = fragmenting_periodic("stitch_grow_slack:0", 2);
    assert!(remaps > 1024, "the workload no longer maps past the credit ({remaps} remaps)");
    assert!(ratio <= 1.03, "stitch_grow_slack:0: peak reserved {ratio:.4}x the peak allocated");
}

/// The finding (fixed): with the default settings the arena went hungry within the first
/// step and grew instead of stitching the holes left, so the peak reserved ended about 6%
/// above the peak allocated.
#[test]
fn a_fragmenting_periodic_workload_keeps_within_three_percent() {
    let (ratio, _) = fragmenting_periodic("", 2);
    assert!(ratio <= 1.03, "default settings: peak reserved {ratio:.4}x the peak allocated");
}

/// Several queues (one arena each) and threads: each thread allocates on its own queue and
/// hands some of its blocks to the next thread to free (cross-thread frees, raw and RAII),
/// while a random workload drives the arenas hungry. No block is handed out twice (tags), no
/// hang, and everything settles with the allocated bytes exact.
#[test]
fn hungry_arenas_on_several_queues_and_threads() {
    let a = arena_allocator("", 8 << 30);
    let threads = 3;
    let steps = scaled(15_000);
    // The arenas must have spent a credit's worth of views (checked below): a scaled-down run
    // (the kernel lane's) goes on past its steps until they have, up to the full count.
    let enough = |a: &CachingAllocator| a.stats().num_remaps >= 1024;
    let limit = Duration::from_secs(120) * common::time_scale();
    let out = common::wait::within("threads on hungry arenas", limit, move || {
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..threads).map(|_| mpsc::channel::<Raw>()).unzip();
        let handles: Vec<_> = rxs
            .into_iter()
            .enumerate()
            .map(|(t, rx)| {
                let a = a.clone();
                let tx = txs[(t + 1) % threads].clone();
                std::thread::spawn(move || {
                    let q = Queue::new().unwrap();
                    let mut rng = Rng(0x28_3000 + t as u64);
                    let mut mine: VecDeque<(Allocation, u64)> = VecDeque::new();
                    let mut raw: Vec<Raw> = Vec::new();
                    let mut peak_seen = 0usize;
                    for step in 0..15_000 {
                        if step >= steps && step % 250 == 0 && enough(&a) {
                            break;
                        }
                        let what = format!("thread {t} step {step}");
                        // Frees handed over by the thread before.
                        while let Ok(r) = rx.try_recv() {
                            r.check(&what);
                            a.free_raw(r.p as *mut u8).unwrap_or_else(|e| panic!("{what}: {e}"));
                        }
                        match rng.below(10) {
                            0..=4 if mine.len() < 400 => {
                                let size = random_size(&mut rng);
                                let x = a.allocate(size, Some(&q)).unwrap_or_else(|e| panic!("{what}: {e}"));
                                let tag = stamp(x.as_ptr(), x.len());
                                mine.push_back((x, tag));
                            }
                            5 => {
                                let size = random_size(&mut rng);
                                let p = a.allocate_raw(size, Some(&q)).unwrap_or_else(|e| panic!("{what}: {e}"));
                                let r = Raw::new(p, size);
                                if rng.below(2) == 0 { tx.send(r).unwrap() } else { raw.push(r) }
                            }
                            6 if !raw.is_empty() => {
                                let r = raw.swap_remove(rng.below(raw.len() as u64) as usize);
                                r.check(&what);
                                a.free_raw(r.p as *mut u8).unwrap();
                            }
                            _ if !mine.is_empty() => {
                                let i = rng.below(mine.len() as u64) as usize;
                                let (x, tag) = mine.swap_remove_back(i).unwrap();
                                check_stamp(x.as_ptr(), x.len(), tag, &what);
                                drop(x);
                            }
                            _ => {}
                        }
                        if step % 500 == 0 {
                            a.check_invariants().unwrap_or_else(|e| panic!("{what}: {e}"));
                            peak_seen = peak_seen.max(reserved(&a));
                        }
                        if step % 997 == 0 && t == 0 {
                            a.empty_cache();
                        }
                    }
                    for (x, tag) in mine.drain(..) {
                        check_stamp(x.as_ptr(), x.len(), tag, "thread end");
                    }
                    for r in raw {
                        r.check("thread end");
                        a.free_raw(r.p as *mut u8).unwrap();
                    }
                    (rx, peak_seen)
                })
            })
            .collect();
        drop(txs);
        let mut left = Vec::new();
        for h in handles {
            left.push(h.join().expect("a worker panicked"));
        }
        // What was sent to a thread after its last look.
        for (rx, _) in &left {
            while let Ok(r) = rx.try_recv() {
                r.check("after the threads");
                a.free_raw(r.p as *mut u8).unwrap();
            }
        }
        a
    });
    settled(&out, "threads done");
    let remaps = out.stats().num_remaps;
    assert!(remaps >= 1024, "{remaps} remaps: the arenas never spent a credit's worth of views");
    out.empty_cache();
    assert_eq!(reserved(&out), 0, "reserved bytes left after everything was freed and emptied");
}

/// The trim policy with a hungry arena and small-pool blocks (< 16 KiB, the pools' expandable
/// segments) interleaved, for trim ratios 1.01, 1.045 and 0, under a fraction lowered now and
/// then: the reserved bytes never pass the allowed memory, small requests that fit beside the
/// live bytes are served, the statistics stay exact, and everything settles and empties.
#[test]
fn the_trim_policy_with_a_hungry_arena_and_small_blocks() {
    for ratio in ["trim_ratio:1.01", "trim_ratio:1.045", "trim_ratio:0"] {
        let mut m = Model::new(arena_allocator(ratio, 8 << 30));
        let mut rng = Rng(0x28_4000);
        drive_hungry(&mut m, &mut rng, 500, 5, HUNGRY_CAP, None);
        let mut allowed = m.a.capacity() as usize;
        let mut small: Vec<(Allocation, u64)> = Vec::new();
        let mut small_rounded = 0;
        for step in 0..scaled(2500) {
            let what = format!("{ratio}, step {step}");
            let r = rng.below(100);
            if r < 30 {
                let size = 512 + rng.below(15 * KB as u64) as usize;
                match m.a.allocate(size, None) {
                    Ok(x) => {
                        small_rounded += rounded(size);
                        let tag = stamp(x.as_ptr(), x.len());
                        small.push((x, tag));
                    }
                    Err(e) => {
                        assert_eq!(e.kind(), ErrorKind::OutOfMemory, "{what}: {e}");
                        // Refused only where its pages could not fit beside the live bytes
                        // (each small block may touch a page more than its bytes).
                        let live = m.live_units + small_rounded + UNIT * (small.len() + 2);
                        assert!(
                            live + rounded(size) > allowed,
                            "{what}: {size} bytes refused, {live} live of {allowed}: {e}"
                        );
                    }
                }
            } else if r < 50 && !small.is_empty() {
                let (x, tag) = small.swap_remove(rng.below(small.len() as u64) as usize);
                check_stamp(x.as_ptr(), x.len(), tag, &what);
                small_rounded -= rounded(x.len());
            } else if r < 70 {
                let size = random_size(&mut rng);
                let fits = m.live_units + small_rounded + UNIT * (small.len() + 2) + units(size) <= allowed;
                match m.alloc(size, None) {
                    Ok(()) => {}
                    Err(e) => {
                        assert_eq!(e.kind(), ErrorKind::OutOfMemory, "{what}: {e}");
                        assert!(!fits, "{what}: {size} bytes refused though {allowed} allowed");
                    }
                }
            } else if r < 95 && !m.live.is_empty() {
                let i = rng.below(m.live.len() as u64) as usize;
                m.free(i, &what);
            } else if r < 98 {
                // A limit between what is live and what is reserved now.
                let lo = m.live_units + small_rounded + 4 * MB;
                let hi = reserved(&m.a).max(lo + UNIT);
                allowed = limit_to(&m.a, lo + rng.below((hi - lo) as u64) as usize);
                if reserved(&m.a) > allowed {
                    m.a.empty_cache();
                }
            } else {
                m.a.set_memory_fraction(1.0).unwrap();
                allowed = m.a.capacity() as usize;
            }
            invariants(&m.a, &what);
            let s = m.a.stats();
            assert_eq!(
                s.allocated_bytes[AGGREGATE].current as usize,
                m.live_rounded + small_rounded,
                "{what}: allocated bytes"
            );
            let res = reserved(&m.a);
            assert!(res <= allowed, "{what}: reserved {res} > allowed {allowed}");
        }
        for (x, tag) in small.drain(..) {
            check_stamp(x.as_ptr(), x.len(), tag, "small, the end");
        }
        m.check_tags("the end");
        m.free_all("the end");
        settled(&m.a, ratio);
        m.a.empty_cache();
        assert_eq!(reserved(&m.a), 0, "{ratio}: reserved bytes left after empty_cache");
    }
}
