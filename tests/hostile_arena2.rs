//! A second hostile review of the page-stitched arenas, aimed at the free-run index
//! (`caching/free_runs.rs`), the dense regions of the address table (`caching/addrs.rs`: an
//! arena's home region files block starts in a bitmap by unit, found backwards for ranges) and
//! the raw calls' answers for arena memory (`holds`, `mem_at`, `free_raw`, `free_raw_sized`):
//! arenas made and released over and over (queues dropped, `empty_cache`) while stale raw
//! pointers into their old regions are freed and queried; two arenas side by side; the last
//! unit of a block and of the home region; blocks just below and at the four-unit threshold;
//! huge sparse blocks queried in their middle (timed); units given back under memory pressure;
//! every unit size from 4 KiB to 2 MiB. Every live block keeps its bytes and the invariants
//! hold after every step.

#![allow(unsafe_code)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};

use common::Rng;
use common::arena::{GB, KB, MB, alloc, arena_conf, invariants, raw_mark, raw_verify, rounds};
use dmabuf_rt::Error;
use dmabuf_rt::caching::stats::AGGREGATE;
use dmabuf_rt::queue::Queue;

fn is_invalid_free(r: &Result<(), Error>) -> bool {
    matches!(r, Err(Error::InvalidFree { .. }))
}

// ---------------------------------------------------------------------------------------------
// Block sizes around the four-unit threshold, every unit size.
// ---------------------------------------------------------------------------------------------

/// For every unit from 4 KiB to 2 MiB: blocks of 3 units, just under 4, exactly 4, just over 4
/// (home blocks of an arena from 4 units on). Each block answers `holds`, `mem_at`, `raw_size`
/// and the refusals (interior, one past its request, wrong size) as a block of the pools does;
/// after its free, a second free is refused as a double free; bytes and invariants hold.
#[test]
fn blocks_around_the_threshold_answer_every_raw_call_for_every_unit() {
    for unit_kb in [4, 8, 16, 64, 256, 1024, 2048] {
        let unit = unit_kb * KB;
        let a = alloc(&arena_conf(unit_kb), 256 * MB as u64);
        let q = Queue::new().unwrap();
        let sizes = [3 * unit, 4 * unit - 1, 4 * unit - 512, 4 * unit, 4 * unit + 1, 5 * unit - 1, 7 * unit + 3];
        let mut live = Vec::new();
        for (t, &size) in sizes.iter().enumerate() {
            let p = a.allocate_raw(size, Some(&q)).unwrap();
            raw_mark(p, size, t as u32, unit);
            live.push((p, size, t as u32));
        }
        for &(p, size, tag) in &live {
            let what = format!("unit {unit_kb} KiB, block of {size} bytes");
            raw_verify(p, size, tag, unit, &what);
            assert!(a.holds(p), "{what}: holds its start");
            assert!(a.holds(p.wrapping_add(size - 1)), "{what}: holds its last byte");
            assert_eq!(a.raw_size(p).unwrap(), size, "{what}");
            a.mem_at(p, size).unwrap_or_else(|e| panic!("{what}: mem_at of the whole block: {e}"));
            a.mem_at(p.wrapping_add(size - 1), 1).unwrap_or_else(|e| panic!("{what}: mem_at of its last byte: {e}"));
            a.mem_at(p.wrapping_add(size / 2), size - size / 2)
                .unwrap_or_else(|e| panic!("{what}: mem_at from its middle: {e}"));
            assert!(a.mem_at(p.wrapping_add(size - 1), 2).is_err(), "{what}: a range over its end is refused");
            assert!(a.mem_at(p, size + 1).is_err(), "{what}: a range one byte too long is refused");
            for off in [1, 511, 512, unit, size - 1] {
                assert!(
                    is_invalid_free(&a.free_raw(p.wrapping_add(off))),
                    "{what}: an interior free at +{off} is refused"
                );
            }
            assert!(
                matches!(a.free_raw_sized(p, size + 1), Err(Error::SizeMismatch { .. })),
                "{what}: a wrong size is refused"
            );
            assert!(
                matches!(a.free_raw_sized(p, size - 1), Err(Error::SizeMismatch { .. })),
                "{what}: a wrong size is refused"
            );
            invariants(&a, &what);
        }
        // Free every other one, then the others check their bytes; double frees are refused.
        for (i, &(p, size, _)) in live.iter().enumerate() {
            if i % 2 == 0 {
                a.free_raw_sized(p, size).unwrap();
            }
        }
        for (i, &(p, size, tag)) in live.iter().enumerate() {
            let what = format!("unit {unit_kb} KiB, block of {size} bytes");
            if i % 2 == 0 {
                let r = a.free_raw(p);
                assert!(
                    matches!(r, Err(Error::InvalidFree { why, .. }) if why.contains("double free")),
                    "{what}: a second free is a double free: {r:?}"
                );
                assert!(a.mem_at(p, 1).is_err(), "{what}: mem_at into a freed block is refused");
                assert!(a.raw_size(p).is_err(), "{what}: raw_size of a freed block is refused");
            } else {
                raw_verify(p, size, tag, unit, &what);
            }
            invariants(&a, &what);
        }
        for (i, &(p, size, _)) in live.iter().enumerate() {
            if i % 2 == 1 {
                a.free_raw_sized(p, size).unwrap();
            }
        }
        invariants(&a, "all freed");
        drop(q);
        a.empty_cache();
        invariants(&a, "after empty_cache");
        assert_eq!(a.stats().reserved_bytes[AGGREGATE].current, 0, "unit {unit_kb} KiB: everything given back");
    }
}

// ---------------------------------------------------------------------------------------------
// Arenas made and released over and over, stale pointers into their old regions.
// ---------------------------------------------------------------------------------------------

/// Round after round a queue gets an arena (home blocks, and stitched views from a fragmented
/// home region), frees some blocks, and goes (the queue dropped, or `empty_cache`), which
/// releases the arena once nothing in it is live; the next arena is often reserved at the same
/// base. Pointers of every earlier round are then freed, sized-freed and queried: none may free
/// or touch a live block of the current round unless it is exactly that block's start (which a
/// raw pointer cannot tell apart), and the current round's blocks keep their bytes.
#[test]
fn stale_pointers_into_released_arenas_never_reach_live_blocks() {
    let unit = 16 * KB;
    let a = alloc(&arena_conf(16), 64 * MB as u64);
    let mut rng = Rng(0x5EED_0001);
    let mut stale: Vec<(*mut u8, usize)> = Vec::new();
    let mut bases = std::collections::HashSet::new();
    let mut same_base = 0;
    for round in 0..rounds(60) {
        let q = Queue::new().unwrap();
        let mut live: Vec<(*mut u8, usize, u32)> = Vec::new();
        for i in 0..12 {
            let size = (4 + rng.below(12) as usize) * unit - rng.below(2) as usize * 100;
            let p = a.allocate_raw(size, Some(&q)).unwrap();
            if round > 0 && i == 0 && !bases.insert(p as usize) {
                same_base += 1;
            }
            if round == 0 && i == 0 {
                bases.insert(p as usize);
            }
            let tag = (round * 100 + i) as u32;
            raw_mark(p, size, tag, unit);
            live.push((p, size, tag));
        }
        // Holes in the home region, then requests that fit in none: stitched views.
        for i in (0..live.len()).step_by(2).collect::<Vec<_>>().into_iter().rev() {
            let (p, size, _) = live.remove(i);
            a.free_raw_sized(p, size).unwrap();
            stale.push((p, size));
        }
        for i in 0..3 {
            let size = 30 * unit + i * 512;
            let p = a.allocate_raw(size, Some(&q)).unwrap();
            let tag = (round * 100 + 50 + i) as u32;
            raw_mark(p, size, tag, unit);
            live.push((p, size, tag));
        }
        invariants(&a, &format!("round {round}: made"));
        // Stale pointers of every round so far: frees are refused unless the pointer is a live
        // block's start (then it is this round's block, taken out of `live`).
        for &(p, size) in stale.iter().rev().take(40) {
            let start_of = live.iter().position(|&(l, _, _)| l == p);
            let exact_live = start_of.is_some();
            // Queries must not crash; their answers are checked against the live set.
            let inside = live.iter().any(|&(l, ls, _)| (p as usize) >= l as usize && (p as usize) < l as usize + ls);
            let m = a.mem_at(p, 1);
            assert_eq!(m.is_ok(), inside, "round {round}: mem_at({p:p}) is {m:?}, inside a live block: {inside}");
            if inside {
                assert!(a.holds(p), "round {round}: holds({p:p}) inside a live block");
            }
            if !exact_live {
                let r = a.free_raw(p);
                assert!(is_invalid_free(&r), "round {round}: a stale free of {p:p} ({size} bytes) is refused");
                let r = a.free_raw_sized(p, size);
                assert!(r.is_err(), "round {round}: a stale sized free of {p:p} is refused: {r:?}");
                let r = a.free_raw(p.wrapping_add(1));
                assert!(is_invalid_free(&r), "round {round}: an interior stale free is refused");
            }
        }
        for &(p, size, tag) in &live {
            raw_verify(p, size, tag, unit, &format!("round {round}: after the stale calls"));
        }
        invariants(&a, &format!("round {round}: after the stale calls"));
        // The queue goes with blocks still live (the arena stays until they are freed), or
        // everything is freed and the cache emptied.
        let drop_queue_first = round % 2 == 0;
        let mut q = Some(q);
        if drop_queue_first {
            q = None;
        }
        for (p, size, tag) in live.drain(..) {
            raw_verify(p, size, tag, unit, &format!("round {round}: before the free"));
            a.free_raw(p).unwrap();
            stale.push((p, size));
        }
        if !drop_queue_first {
            drop(q.take());
            a.empty_cache();
        }
        invariants(&a, &format!("round {round}: released"));
        for &(p, _) in stale.iter().rev().take(30) {
            assert!(!a.holds(p), "round {round}: holds({p:p}) after its arena went");
            assert!(a.mem_at(p, 1).is_err());
            assert!(is_invalid_free(&a.free_raw(p)), "round {round}: free of {p:p} after its arena went");
        }
        assert_eq!(a.stats().reserved_bytes[AGGREGATE].current, 0, "round {round}: everything given back");
        if stale.len() > 400 {
            stale.drain(..200);
        }
    }
    eprintln!("arenas reserved at an earlier arena's base: {same_base}");
}

/// Two queues' arenas side by side, both alive: pointers of one are never taken for the
/// other's, `mem_at` into one is that block's memory, a free through one queue's stale address
/// refuses; then one arena goes (its queue dropped) while the other's blocks stay live and
/// queried, and a third arena comes (often at the first's base).
#[test]
fn two_arenas_side_by_side_and_one_released_under_the_other() {
    let unit = 16 * KB;
    let a = alloc(&arena_conf(16), 128 * MB as u64);
    let mut rng = Rng(0xA2A2);
    let q1 = Queue::new().unwrap();
    let q2 = Queue::new().unwrap();
    let mut on2: Vec<(*mut u8, usize, u32)> = Vec::new();
    for i in 0..20u32 {
        let size = (4 + rng.below(8) as usize) * unit + 1;
        let p = a.allocate_raw(size, Some(&q2)).unwrap();
        raw_mark(p, size, 2000 + i, unit);
        on2.push((p, size, 2000 + i));
    }
    for round in 0..rounds(40) {
        let q1b = Queue::new().unwrap();
        let q = if round % 3 == 0 { &q1 } else { &q1b };
        let mut on1 = Vec::new();
        for i in 0..10u32 {
            let size = (4 + rng.below(20) as usize) * unit;
            let p = a.allocate_raw(size, Some(q)).unwrap();
            raw_mark(p, size, round as u32 * 50 + i, unit);
            on1.push((p, size, round as u32 * 50 + i));
        }
        // Each block, and its last byte, is its own; the neighbours' pointers are refused.
        for &(p, size, _) in on1.iter().chain(&on2) {
            assert_eq!(a.raw_size(p).unwrap(), size);
            a.mem_at(p.wrapping_add(size - 1), 1).unwrap();
            assert!(a.mem_at(p.wrapping_add(size - 1), 2).is_err());
        }
        let mut stale = Vec::new();
        for (p, size, _) in on1.drain(..) {
            a.free_raw_sized(p, size).unwrap();
            stale.push((p, size));
        }
        if round % 3 != 0 {
            drop(q1b);
        } else {
            a.empty_cache();
        }
        for &(p, _) in &stale {
            assert!(is_invalid_free(&a.free_raw(p)), "round {round}: stale free of {p:p}");
            assert!(a.mem_at(p, 1).is_err(), "round {round}: stale mem_at of {p:p}");
        }
        for &(p, size, tag) in &on2 {
            raw_verify(p, size, tag, unit, &format!("round {round}: the other arena's block"));
            assert!(a.holds(p.wrapping_add(size - 1)));
        }
        invariants(&a, &format!("round {round}"));
    }
    for (p, size, tag) in on2 {
        raw_verify(p, size, tag, unit, "at the end");
        a.free_raw_sized(p, size).unwrap();
    }
    drop((q1, q2));
    a.empty_cache();
    invariants(&a, "the end");
    assert_eq!(a.stats().reserved_bytes[AGGREGATE].current, 0);
}

// ---------------------------------------------------------------------------------------------
// Huge sparse blocks: ranges in their middle (timed), the end of the home region.
// ---------------------------------------------------------------------------------------------

/// A 24 GiB home block of 4 KiB units (six million units, never touched: a sparse memfd) with
/// a small block after it: `mem_at` and `holds` of pointers near its end and near its start
/// find it, and once it is freed `holds` still covers its memory while `mem_at` refuses it.
/// (The hostile review found these lookups scanning the region's start bitmap back 64 units a
/// word, 25-70 us a call here; the starts are now a bitmap with summaries, five levels at
/// most, so a lookup reads a few words wherever the block starts. No timing is asserted here:
/// speed is for benchmarks, not the test suite.)
#[test]
fn ranges_deep_in_a_huge_home_block_are_found() {
    let unit = 4 * KB;
    let a = alloc(&arena_conf(4), 32 * GB as u64);
    let q = Queue::new().unwrap();
    let big = 24 * GB;
    let p = a.allocate_raw(big, Some(&q)).unwrap();
    let small = a.allocate_raw(4 * unit, Some(&q)).unwrap();
    assert_eq!(small as usize, p as usize + big, "the small block follows the huge one at home");
    raw_mark(small, 4 * unit, 9, unit);
    invariants(&a, "made");
    let calls = rounds(2000);
    let deep = |i: usize| p.wrapping_add(big - 1 - (i % 64) * 4096);
    for i in 0..calls {
        a.mem_at(deep(i), 1).unwrap();
        assert!(a.holds(deep(i)));
        a.mem_at(p.wrapping_add(i % 64 * 4096), 1).unwrap();
    }
    a.free_raw(p).unwrap();
    for i in 0..calls {
        assert!(a.holds(deep(i)));
        assert!(a.mem_at(deep(i), 1).is_err());
    }
    raw_verify(small, 4 * unit, 9, unit, "after the huge block's free");
    a.free_raw(small).unwrap();
    invariants(&a, "freed");
}

/// A capacity past what the home region can show (the reservation is capped at 256 GiB, so
/// the home region at 128 GiB): a sparse block fills the home region to its last unit, then
/// the last unit's bytes and the byte one past the home region are asked about, and more
/// requests that the allowed memory holds must still be served (or refused as out of memory,
/// not with a failure of the arena) and keep their bytes.
#[test]
fn the_last_unit_of_a_full_home_region_and_past_it() {
    let unit = 2 * MB;
    let a = alloc(&arena_conf(2048), 200 * GB as u64);
    let q = Queue::new().unwrap();
    let first = a.allocate_raw(4 * unit, Some(&q)).unwrap();
    let base = first as usize;
    let home = 128 * GB;
    let fill = a.allocate_raw(home - 8 * unit, Some(&q)).unwrap();
    assert_eq!(fill as usize, base + 4 * unit);
    let last = a.allocate_raw(4 * unit - 100, Some(&q)).unwrap();
    assert_eq!(last as usize, base + home - 4 * unit, "the last home block ends the home region");
    raw_mark(last, 4 * unit - 100, 3, unit);
    invariants(&a, "the home region full");
    let end = last.wrapping_add(4 * unit - 100);
    assert!(a.mem_at(end.wrapping_sub(1), 1).is_ok());
    assert!(a.mem_at(end, 1).is_err(), "the rounding of the last block");
    assert!(a.mem_at((base + home - 1) as *const u8, 1).is_err(), "the last byte of the home region");
    assert!(a.mem_at((base + home) as *const u8, 1).is_err(), "one past the home region: no view yet");
    assert!(!a.holds((base + home) as *const u8), "one past the home region: no view yet");
    assert!(is_invalid_free(&a.free_raw((base + home) as *mut u8)));
    // More blocks: the arena's memfd is full, the allowed memory is not.
    let mut more = Vec::new();
    for i in 0..4u32 {
        match a.allocate_raw(8 * unit + 4096, Some(&q)) {
            Ok(p) => {
                raw_mark(p, 8 * unit + 4096, 10 + i, unit);
                more.push((p, 10 + i));
            }
            Err(e) => panic!("request {i} of {} bytes with {} GiB allowed left: {e}", 8 * unit + 4096, 200 - 128),
        }
        invariants(&a, &format!("more {i}"));
    }
    raw_verify(last, 4 * unit - 100, 3, unit, "the last home block");
    for (p, tag) in more {
        raw_verify(p, 8 * unit + 4096, tag, unit, "past the home region");
        a.free_raw(p).unwrap();
    }
    for p in [first, fill, last] {
        a.free_raw(p).unwrap();
    }
    drop(q);
    a.empty_cache();
    invariants(&a, "the end");
}

// ---------------------------------------------------------------------------------------------
// Threads: arenas released under stale and interior raw calls; punched units under pressure.
// ---------------------------------------------------------------------------------------------

/// Four threads, each with queues of its own made and dropped, allocate and free arena blocks
/// (home blocks of 4 to 20 units, and some just under the threshold) while a fifth empties the
/// cache and calls `free_raw`, `free_raw_sized` and `mem_at` with interior (odd) pointers of
/// the others' live blocks and with pointers already freed: interior frees are always refused,
/// and no thread's live block loses a byte.
#[test]
fn threads_release_arenas_under_interior_and_stale_raw_calls() {
    let unit = 8 * KB;
    let a = Arc::new(alloc(&arena_conf(8), 256 * MB as u64));
    let published: Arc<Mutex<Vec<(usize, usize)>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let refused = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(Barrier::new(5));
    let workers: Vec<_> = (0..4u32)
        .map(|t| {
            let (a, published, start) = (Arc::clone(&a), Arc::clone(&published), Arc::clone(&start));
            std::thread::spawn(move || {
                let mut rng = Rng(0x7777 + u64::from(t));
                start.wait();
                for round in 0..rounds(150) {
                    let q = Queue::new().unwrap();
                    let mut live = Vec::new();
                    for i in 0..6u32 {
                        let size = if rng.below(4) == 0 { 3 * unit + 1 } else { (4 + rng.below(16) as usize) * unit };
                        let p = a.allocate_raw(size, Some(&q)).unwrap();
                        let tag = t * 1_000_000 + round as u32 * 10 + i;
                        raw_mark(p, size, tag, unit);
                        published.lock().unwrap().push((p as usize, size));
                        live.push((p, size, tag));
                    }
                    for (p, size, tag) in live {
                        raw_verify(p, size, tag, unit, &format!("thread {t} round {round}"));
                        if rng.below(2) == 0 {
                            a.free_raw_sized(p, size).unwrap();
                        } else {
                            a.free_raw(p).unwrap();
                        }
                    }
                    drop(q);
                }
            })
        })
        .collect();
    let hostile = {
        let (a, published, stop, refused, start) =
            (Arc::clone(&a), Arc::clone(&published), Arc::clone(&stop), Arc::clone(&refused), Arc::clone(&start));
        std::thread::spawn(move || {
            let mut rng = Rng(0xBAD);
            start.wait();
            while !stop.load(Ordering::Relaxed) {
                let pick = {
                    let v = published.lock().unwrap();
                    if v.is_empty() { None } else { Some(v[rng.below(v.len() as u64) as usize]) }
                };
                let Some((p, size)) = pick else { continue };
                let odd = 1 + 2 * rng.below(size as u64 / 2 - 1) as usize;
                let r = a.free_raw((p + odd) as *mut u8);
                assert!(is_invalid_free(&r), "interior free of {p:#x}+{odd} was not refused: {r:?}");
                let r = a.free_raw_sized((p + odd) as *mut u8, size);
                assert!(r.is_err(), "interior sized free of {p:#x}+{odd}: {r:?}");
                refused.fetch_add(2, Ordering::Relaxed);
                let _ = a.mem_at((p + odd) as *const u8, 1);
                let _ = a.holds((p + size - 1) as *const u8);
                if rng.below(16) == 0 {
                    a.empty_cache();
                }
                if rng.below(32) == 0 {
                    a.check_invariants().unwrap();
                }
            }
        })
    };
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    hostile.join().unwrap();
    invariants(&a, "the end");
    a.empty_cache();
    assert_eq!(a.stats().reserved_bytes[AGGREGATE].current, 0);
    assert!(refused.load(Ordering::Relaxed) > 0);
}

/// Memory pressure with units given back: one block keeps the arena (so `empty_cache` punches
/// its free units instead of releasing it), the free units are fragmented around live blocks
/// and given back, and requests then fill the allowed memory exactly, home fits over punched
/// units and stitched views over the rest; every request the allowed memory holds is served,
/// the reserved bytes never pass it, and every live block keeps its bytes.
#[test]
fn punched_units_under_pressure_serve_every_request_that_fits() {
    for unit_kb in [4, 16, 64, 2048] {
        let unit = unit_kb * KB;
        let units = (4 * MB / unit).max(64);
        let cap = units * unit;
        let a = alloc(&arena_conf(unit_kb), cap as u64);
        let q = Queue::new().unwrap();
        let mut rng = Rng(0xFEED + unit_kb as u64);
        for round in 0..rounds(30) {
            // Blocks of 4..8 units up to the allowed memory.
            let mut live: Vec<(*mut u8, usize, u32)> = Vec::new();
            let mut used = 0;
            loop {
                let n = 4 + rng.below(5) as usize;
                if used + n > units {
                    break;
                }
                let size = n * unit - rng.below(2) as usize * 7;
                let p = a.allocate_raw(size, Some(&q)).unwrap_or_else(|e| {
                    panic!("unit {unit_kb} KiB round {round}: {n} units with {used} of {units} in use: {e}")
                });
                raw_mark(p, size, (round * 100 + live.len()) as u32, unit);
                live.push((p, size, (round * 100 + live.len()) as u32));
                used += n;
            }
            // Free all but one block in three, give the free units back.
            let mut keep = Vec::new();
            for (i, b) in live.into_iter().enumerate() {
                if i % 3 == 1 {
                    keep.push(b);
                } else {
                    a.free_raw_sized(b.0, b.1).unwrap();
                    used -= b.1.div_ceil(unit);
                }
            }
            a.empty_cache();
            invariants(&a, &format!("unit {unit_kb} KiB round {round}: punched"));
            // Fill the allowed memory again: big blocks (stitched over the holes) and small.
            let mut more = Vec::new();
            while units - used >= 4 {
                let n = if more.is_empty() { (units - used).min(4 + rng.below(20) as usize) } else { 4 };
                let p = a.allocate_raw(n * unit, Some(&q)).unwrap_or_else(|e| {
                    panic!(
                        "unit {unit_kb} KiB round {round}: {n} units with {used} of {units} in use after a punch: {e}"
                    )
                });
                let tag = (round * 100 + 90 + more.len()) as u32;
                raw_mark(p, n * unit, tag, unit);
                more.push((p, n * unit, tag));
                used += n;
                let r = a.stats().reserved_bytes[AGGREGATE].current as usize;
                assert!(r <= cap, "unit {unit_kb} KiB round {round}: reserved {r} past the allowed {cap}");
            }
            for &(p, size, tag) in keep.iter().chain(&more) {
                raw_verify(p, size, tag, unit, &format!("unit {unit_kb} KiB round {round}"));
            }
            invariants(&a, &format!("unit {unit_kb} KiB round {round}: refilled"));
            for (p, size, _) in keep.into_iter().chain(more) {
                a.free_raw_sized(p, size).unwrap();
            }
        }
        drop(q);
        a.empty_cache();
        invariants(&a, "the end");
    }
}

/// An allowed memory below one 2 MiB chunk of the pools' expandable segments: a request the
/// arena can hold (eight units of 4 KiB) is served by it, not refused by the check that a
/// pool segment could fit (found by the hostile review: "the request needs 2097152 bytes of
/// segment"), and one past the allowed memory is refused naming it.
#[test]
fn an_arena_serves_under_a_capacity_below_one_chunk() {
    let unit = 4 * KB;
    let a = alloc(&arena_conf(4), 256 * KB as u64);
    let q = Queue::new().unwrap();
    let x = a.allocate(8 * unit, Some(&q)).unwrap();
    let y = a.allocate(40 * unit, Some(&q)).unwrap();
    match a.allocate(40 * unit, Some(&q)) {
        Err(Error::AllocatorOom { .. }) => {}
        other => panic!("a request past the allowed memory: {other:?}"),
    }
    drop((x, y));
    invariants(&a, "after");
}
