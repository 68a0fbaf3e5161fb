//! Unit tests of the pool. Every step is followed by `check_invariants` ([`step!`]).

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use crate::segment::SegmentKind;
use crate::source::SparseSource;

/// Runs one call on the pool, then checks every invariant, naming the call if one broke.
macro_rules! step {
    ($p:ident . $($call:tt)*) => {{
        let r = $p.$($call)*;
        if let Err(why) = $p.check_invariants() {
            panic!("after {}: {why}", stringify!($($call)*));
        }
        r
    }};
}

fn pool(conf: &str) -> Pool {
    Pool::new(Box::new(SparseSource), Config::parse(conf).unwrap(), 1 << 30)
}

fn got(o: Result<Outcome>) -> Handed {
    match o.unwrap() {
        Outcome::Got(h) => h,
        Outcome::WaitForPending => panic!("nothing is pending"),
        Outcome::LastWait => panic!("the last wait was done"),
        Outcome::WaitKeepingOthersOut => panic!("no claim can be made exclusive here"),
    }
}

const MB: usize = 1 << 20;

/// A source that refuses its next `refusals` requests (as out of memory, or with `error`),
/// then serves them from sparse memory, counting the calls.
#[derive(Debug)]
struct Refusing {
    refusals: Arc<AtomicUsize>,
    calls: Arc<AtomicUsize>,
    permission: bool,
}

impl MemorySource for Refusing {
    fn name(&self) -> String {
        "refusing".into()
    }
    fn kind(&self) -> SegmentKind {
        SegmentKind::Device
    }
    fn create_segment(&self, len: usize) -> Result<Segment> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let refuse = self.refusals.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok();
        if !refuse {
            return SparseSource.create_segment(len);
        }
        let kind = if self.permission { std::io::ErrorKind::PermissionDenied } else { std::io::ErrorKind::OutOfMemory };
        let source = std::io::Error::from(kind);
        Err(if self.permission {
            Error::Open { path: "/dev/refusing".into(), source, why: "a test".into() }
        } else {
            Error::OutOfMemory { requested: len as u64, source_name: self.name(), source }
        })
    }
}

/// A pool over a [`Refusing`] source, with its refusal and call counters.
fn refusing_pool(conf: &str, permission: bool) -> (Pool, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    refusing_pool_with(Config::parse(conf).unwrap(), permission)
}

fn refusing_pool_with(config: Config, permission: bool) -> (Pool, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let (refusals, calls) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let source = Refusing { refusals: Arc::clone(&refusals), calls: Arc::clone(&calls), permission };
    (Pool::new(Box::new(source), config, 1 << 30), refusals, calls)
}

fn segment_events(p: &Pool) -> Vec<(HistoryKind, usize)> {
    p.history()
        .into_iter()
        .filter(|e| matches!(e.kind, HistoryKind::SegmentAlloc | HistoryKind::SegmentFree))
        .map(|e| (e.kind, e.size))
        .collect()
}

/// Issue 9, defect 9: `Allocation`'s segment pointer is sound only if a segment never goes
/// back to its source while one of its blocks is handed out. `release_block` checks that
/// in every build (it was a `debug_assert!`), so a bug elsewhere leaks instead of freeing
/// memory in use.
#[test]
fn release_block_refuses_blocks_in_use_split_or_cached() {
    let mut p = pool("expandable_segments:False");
    let whole = got(step!(p.allocate(4 * MB, QueueKey::test(0), Tried::FINAL))).id;
    assert!(p.blocks[whole as usize].allocated);
    assert!(!step!(p.release_block(whole)), "released an allocated block's segment");
    let part = got(step!(p.allocate(4096, QueueKey::test(0), Tried::FINAL))).id;
    assert!(p.blocks[part as usize].is_split());
    let rest = p.blocks[part as usize].next.unwrap();
    assert!(!step!(p.release_block(rest)), "released the segment under an allocated neighbour");
    step!(p.apply(FreeMsg::Free(part)));
    assert!(p.blocks[part as usize].in_quick);
    assert!(!step!(p.release_block(part)), "released a quick-cached block");
    assert_eq!(p.stats.device.segment[stats::AGGREGATE].current, 2);
    step!(p.apply(FreeMsg::Free(whole)));
    step!(p.release_cached(None));
    assert_eq!(p.stats.device.segment[stats::AGGREGATE].current, 0);
}

/// Issue 9, defect 7: a gone queue's segments go back as soon as their blocks are free.
#[test]
fn a_gone_queues_segments_go_when_their_last_block_is_freed() {
    for conf in ["expandable_segments:False", "expandable_segments:True"] {
        let mut p = pool(conf);
        let a = got(step!(p.allocate(4096, QueueKey::test(7), Tried::FINAL))).id;
        let b = got(step!(p.allocate(3 * MB, QueueKey::test(7), Tried::FINAL))).id;
        let other = got(step!(p.allocate(4096, QueueKey::test(8), Tried::FINAL))).id;
        step!(p.queue_gone(QueueKey::test(7)));
        assert_eq!(p.stats.device.segment[stats::AGGREGATE].current, 3, "{conf}: blocks are live");
        step!(p.apply(FreeMsg::Free(a)));
        assert_eq!(p.stats.device.segment[stats::AGGREGATE].current, 2, "{conf}");
        step!(p.apply(FreeMsg::Free(b)));
        assert_eq!(p.stats.device.segment[stats::AGGREGATE].current, 1, "{conf}");
        assert!(p.gone.is_empty() && p.expandable.keys().all(|k| k.0 != QueueKey::test(7)), "{conf}");
        step!(p.apply(FreeMsg::Free(other)));
    }
}

/// Best fit takes the smallest cached block that fits, splits it when the rest is worth
/// keeping, and the free merges it back.
#[test]
#[cfg_attr(miri, ignore = "a 20 MiB segment: slow under Miri, which keeps metadata per byte")]
fn best_fit_splits_and_the_free_merges_back() {
    let mut p = pool("expandable_segments:False");
    let a = got(step!(p.allocate(4 * MB, QueueKey::test(0), Tried::FINAL))).id;
    let b = got(step!(p.allocate(6 * MB, QueueKey::test(0), Tried::FINAL))).id;
    assert_eq!(p.blocks[a as usize].seg, p.blocks[b as usize].seg, "one 20 MiB segment, split");
    step!(p.apply(FreeMsg::Free(a)));
    step!(p.flush_quick());
    // 2 MiB fits the freed 4 MiB block best (not the 10 MiB rest after `b`): reused, and
    // split, as more than 1 MiB remains.
    let c = got(step!(p.allocate(2 * MB, QueueKey::test(0), Tried::FINAL))).id;
    assert_eq!((p.blocks[c as usize].offset, p.blocks[c as usize].size), (0, 2 * MB));
    // 1 MiB more of the 2 MiB left would leave 1 MiB: not worth a large-pool split.
    let d = got(step!(p.allocate(MB + 512, QueueKey::test(0), Tried::FINAL))).id;
    assert_eq!((p.blocks[d as usize].offset, p.blocks[d as usize].size), (2 * MB, 2 * MB));
    step!(p.apply(FreeMsg::Free(d)));
    step!(p.apply(FreeMsg::Free(b)));
    step!(p.apply(FreeMsg::Free(c)));
    step!(p.flush_quick());
    assert_eq!(p.pools[PoolKind::Large.slot()].len(), 1, "merged back into one block");
    assert_eq!(p.stats.device.segment[stats::AGGREGATE].current, 1);
}

/// The ladder's last rungs: a source that refuses once is asked again after every cached
/// block went back (rung 7), and the retry is counted once, with no OOM. (Small segments on two
/// queues, so that it runs under Miri too: queue 2's request cannot use queue 1's cache.)
#[test]
fn a_refusal_is_retried_after_the_cached_blocks_are_released() {
    let (mut p, refusals, calls) = refusing_pool("expandable_segments:False", false);
    let a = got(step!(p.allocate(4096, QueueKey::test(1), Tried::FINAL))).id;
    step!(p.apply(FreeMsg::Free(a)));
    refusals.store(1, Ordering::Relaxed);
    let b = got(step!(p.allocate(8192, QueueKey::test(2), Tried::FINAL)));
    assert_eq!(p.blocks[b.id as usize].queue, QueueKey::test(2));
    assert_eq!(calls.load(Ordering::Relaxed), 3, "the first segment, the refusal, the retry");
    let d = p.stats();
    assert_eq!((d.num_alloc_retries, d.num_ooms, d.num_device_alloc, d.num_device_free), (1, 0, 2, 1));
    let two = 2 * MB;
    assert_eq!(
        segment_events(&p),
        [(HistoryKind::SegmentAlloc, two), (HistoryKind::SegmentFree, two), (HistoryKind::SegmentAlloc, two)]
    );
}

/// Rung 4 comes before rung 7: cached oversize blocks go back first, and the cached small
/// segment survives.
#[test]
#[cfg_attr(miri, ignore = "80 MiB segments: the Miri stand-in maps at most 64 MiB")]
fn cached_oversize_blocks_go_back_before_the_rest() {
    let (mut p, refusals, _) = refusing_pool("expandable_segments:False,max_split_size_mb:40", false);
    let small = got(step!(p.allocate(4096, QueueKey::test(0), Tried::FINAL))).id;
    let big = got(step!(p.allocate(80 * MB, QueueKey::test(0), Tried::FINAL))).id;
    step!(p.apply(FreeMsg::Free(small)));
    step!(p.apply(FreeMsg::Free(big)));
    refusals.store(1, Ordering::Relaxed);
    // 50 MiB: the 80 MiB oversize block (40 MiB and up) is more than 20 MiB too large for it.
    got(step!(p.allocate(50 * MB, QueueKey::test(0), Tried::FINAL)));
    let d = p.stats();
    assert_eq!((d.num_alloc_retries, d.num_ooms, d.num_device_free), (1, 0, 1));
    assert_eq!(d.segment[stats::SMALL_POOL].current, 1, "rung 7 did not run");
    assert_eq!(segment_events(&p)[2..], [(HistoryKind::SegmentFree, 80 * MB), (HistoryKind::SegmentAlloc, 50 * MB)]);
}

/// With deferred frees outstanding the ladder stops for the caller to wait, and again after
/// a completion that did not free enough; once that wait is over it stops once more for the
/// last wait (the queues, then the frees outstanding, its room claimed), and after that runs to
/// the end: one retry and one OOM for the request, with the source's reason.
#[test]
fn the_ladder_stops_for_pending_frees_then_the_last_wait_then_fails_with_the_reason() {
    let (mut p, refusals, calls) = refusing_pool("expandable_segments:False", false);
    refusals.store(usize::MAX, Ordering::Relaxed);
    let first = Tried { pending: true, outstanding: true, waited: false, last_wait: false, may_keep_others_out: false };
    assert!(matches!(step!(p.allocate(4096, QueueKey::test(0), first)), Ok(Outcome::WaitForPending)));
    assert_eq!(calls.load(Ordering::Relaxed), 1, "rung 2 only: nothing cached to release");
    let again = Tried { waited: true, ..first };
    assert!(matches!(step!(p.allocate(4096, QueueKey::test(0), again)), Ok(Outcome::WaitForPending)));
    assert_eq!((p.stats().num_alloc_retries, p.stats().num_ooms), (1, 0), "a later pass counts nothing");
    let waited_out = Tried { pending: false, ..again };
    assert!(matches!(step!(p.allocate(4096, QueueKey::test(0), waited_out)), Ok(Outcome::LastWait)));
    assert_eq!((p.stats().num_alloc_retries, p.stats().num_ooms), (1, 0), "no OOM before the last wait");
    let err = match step!(p.allocate(4096, QueueKey::test(0), Tried { last_wait: true, ..waited_out })) {
        Err(e) => e,
        Ok(_) => panic!("the source refuses everything"),
    };
    let Error::AllocatorOom { requested, cause, .. } = &err else { panic!("not an OOM: {err}") };
    assert_eq!(*requested, 4096);
    assert!(cause.starts_with("; refusing refused: "), "{cause}");
    let d = p.stats();
    assert_eq!((d.num_alloc_retries, d.num_ooms), (1, 1), "counted once per request");
    assert_eq!(p.history().last().map(|e| e.kind), Some(HistoryKind::Oom));
    // Without pending frees or queues at work: no stop, one more retry and OOM.
    assert!(step!(p.allocate(4096, QueueKey::test(0), Tried::default())).is_err());
    assert_eq!((p.stats().num_alloc_retries, p.stats().num_ooms), (2, 2));
}

/// A request no segment within the allowed memory can hold fails before the ladder: no
/// miss, no retry, no call to the source.
#[test]
fn a_request_beyond_the_allowed_memory_fails_at_once() {
    let (mut p, _, calls) = refusing_pool("expandable_segments:False", false);
    let Err(Error::AllocatorOom { cause, .. }) = step!(p.allocate(2 << 30, QueueKey::test(0), Tried::FINAL)) else {
        panic!("2 GiB of a 1 GiB device")
    };
    assert!(cause.contains("more than the allowed memory"), "{cause}");
    assert_eq!(
        (calls.load(Ordering::Relaxed), p.misses, p.stats().num_alloc_retries, p.stats().num_ooms),
        (0, 0, 0, 1)
    );
}

/// A source failure that is not a lack of memory is reported as itself, not as an OOM.
#[test]
fn a_permission_failure_is_reported_as_itself() {
    let (mut p, refusals, _) = refusing_pool("expandable_segments:False", true);
    refusals.store(usize::MAX, Ordering::Relaxed);
    let Err(e) = step!(p.allocate(4096, QueueKey::test(0), Tried::FINAL)) else { panic!("refused") };
    assert!(matches!(e, Error::Open { .. }), "{e}");
    assert_eq!((p.stats().num_alloc_retries, p.stats().num_ooms), (1, 0));
}

/// Caching off: no retry rungs (nothing cached to release), the OOM comes at once.
#[test]
fn without_caching_a_refusal_is_an_oom_without_retry() {
    let mut config = Config::parse("expandable_segments:False").unwrap();
    config.no_caching = true;
    let (mut p, refusals, calls) = refusing_pool_with(config, false);
    refusals.store(1, Ordering::Relaxed);
    assert!(step!(p.allocate(4096, QueueKey::test(0), Tried::FINAL)).is_err());
    assert_eq!((calls.load(Ordering::Relaxed), p.stats().num_alloc_retries, p.stats().num_ooms), (1, 0, 1));
    // The next request is served, and freed straight back to the source.
    let h = got(step!(p.allocate(4096, QueueKey::test(0), Tried::FINAL)));
    step!(p.apply(FreeMsg::Free(h.id)));
    assert_eq!(p.stats().segment[stats::AGGREGATE].current, 0);
}

/// Expandable segments: a growth, a punch under `empty_cache`, and the punched pages counted
/// again when a block over them is handed out.
#[test]
fn expandable_growth_punch_and_reback() {
    let mut p = pool("expandable_segments:True");
    let a = got(step!(p.allocate(3 * MB, QueueKey::test(0), Tried::FINAL))).id;
    let b = got(step!(p.allocate(MB + 512, QueueKey::test(0), Tried::FINAL))).id;
    assert_eq!(p.stats.device.segment[stats::AGGREGATE].current, 1, "one reservation, grown");
    let reserved = |p: &Pool| p.stats.device.reserved_bytes[stats::AGGREGATE].current;
    let grown = reserved(&p);
    step!(p.apply(FreeMsg::Free(a)));
    step!(p.release_cached(None));
    let after_punch = reserved(&p);
    assert!(grown - after_punch >= 3 * MB as i64, "the free 3 MiB (and the free tail) gave their pages back");
    let c = got(step!(p.allocate(3 * MB, QueueKey::test(0), Tried::FINAL))).id;
    assert_eq!(p.blocks[c as usize].offset, 0, "the punched block is reused");
    assert_eq!(reserved(&p) - after_punch, 3 * MB as i64, "its pages count as reserved again");
    step!(p.apply(FreeMsg::Free(b)));
    step!(p.apply(FreeMsg::Free(c)));
    step!(p.release_cached(None));
    assert_eq!(p.stats.device.segment[stats::AGGREGATE].current, 0, "wholly free: the reservation goes");
}

/// Found by the kernel lane (`hostile_device::an_exhausted_device_under_contention`): a
/// cached expandable block that fits a request, but whose front pages were punched while
/// its tail, beyond what the request takes, stayed backed. Handing out the front counts its
/// pages again; the backed tail must be punched to make room, or a request that fits the
/// allowed memory on an empty device fails.
#[test]
fn a_cached_block_with_a_backed_tail_beyond_the_request_gives_the_tail_back() {
    let mut p = Pool::new(Box::new(SparseSource), Config::parse("expandable_segments:True").unwrap(), 16 * MB as u64);
    let q = QueueKey::test(0);
    let a = got(step!(p.allocate(6 * MB, q, Tried::FINAL))).id;
    let b = got(step!(p.allocate(6 * MB, q, Tried::FINAL))).id;
    let c = got(step!(p.allocate(4 * MB, q, Tried::FINAL))).id;
    step!(p.apply(FreeMsg::Free(c)));
    step!(p.apply(FreeMsg::Free(a)));
    let d = got(step!(p.allocate(2 * MB, q, Tried::FINAL))).id;
    step!(p.apply(FreeMsg::Free(b)));
    // Grows the reservation past 16 MiB, punching the free front to stay within the allowed
    // memory: the front is punched, the end backed.
    let e = got(step!(p.allocate(14 * MB, q, Tried::FINAL))).id;
    step!(p.apply(FreeMsg::Free(d)));
    step!(p.apply(FreeMsg::Free(e)));
    assert_eq!(p.stats.device.reserved_bytes[stats::AGGREGATE].current, 16 * MB as i64);
    let f = got(step!(p.allocate(16 * MB, q, Tried::FINAL))).id;
    assert!(p.stats.device.reserved_bytes[stats::AGGREGATE].current <= 16 * MB as i64);
    step!(p.apply(FreeMsg::Free(f)));
}

fn arena(p: &mut Pool, si: u32) -> &mut Arena {
    p.segments[si as usize].as_mut().unwrap().arena.as_mut().unwrap()
}

fn reserved(p: &Pool) -> usize {
    p.stats.device.reserved_bytes[stats::AGGREGATE].current as usize
}

/// Map credit: a block that fits no free run of the arena, with the free units 3% of it (above
/// the 2% `stitch_grow_slack`). With credit it is stitched from the free runs (two `mmap`s, no
/// new memory). With the credit spent but no views cached unused (views still in use, as in
/// the first step of a periodic workload: `tests/hostile_review28.rs`) the arena is not
/// hungry and stitches all the same. A cached view taken again gives back what its runs cost.
#[test]
#[cfg_attr(miri, ignore = "Miri makes no arenas")]
fn spent_map_credit_alone_does_not_make_an_arena_hungry() {
    for spent in [false, true] {
        let mut p = pool("expandable_segments:True");
        let q = QueueKey::test(0);
        let unit = p.config.stitch_unit;
        let ids: Vec<_> = (0..100).map(|_| got(step!(p.allocate(4 * unit, q, Tried::FINAL))).id).collect();
        for i in [10, 50, 90] {
            step!(p.apply(FreeMsg::Free(ids[i])));
        }
        let si = p.arenas[&q];
        if spent {
            arena(&mut p, si).spend_map_credit();
        }
        let (r0, m0) = (reserved(&p), p.stats.device.num_remaps);
        assert_eq!(r0, 400 * unit, "one unit more or less than the blocks: the setup is off");
        let big = got(step!(p.allocate(8 * unit, q, Tried::FINAL))).id;
        let (grew, maps) = (reserved(&p) - r0, p.stats.device.num_remaps - m0);
        assert_eq!((grew, maps), (0, 2), "spent {spent}: not a view of the two free runs");
        assert!(!arena(&mut p, si).hungry() && p.budget().arena_free == 0, "spent {spent}: hungry");
        // Its view cached and taken again, out of credit: the view's two runs come back.
        step!(p.apply(FreeMsg::Free(big)));
        arena(&mut p, si).spend_map_credit();
        let again = got(step!(p.allocate(8 * unit, q, Tried::FINAL))).id;
        assert_eq!(p.stats.device.num_remaps - m0, 2, "the cached view was not taken again");
        assert_eq!(arena(&mut p, si).map_credit(), 2, "taken again, the view gives its runs' credit back");
        step!(p.apply(FreeMsg::Free(again)));
    }
}

/// A hungry arena: stitched views made and let go unused (1,024 runs cached, their units
/// taken back by home blocks), and the credit spent. A block that fits no free run and no
/// cached view then gets new units (no call) while the reserved bytes stay within the wider
/// slack (`Arena::WIDE_SLACK` above the allocated bytes); the trim policy does not count the
/// arena's free units meanwhile (they count against the allowed memory).
#[test]
#[cfg_attr(miri, ignore = "Miri makes no arenas")]
fn a_hungry_arena_grows_within_its_bound_rather_than_maps() {
    let mut p = pool("expandable_segments:True");
    let q = QueueKey::test(0);
    let unit = p.config.stitch_unit;
    let ids: Vec<_> = (0..2400).map(|_| got(p.allocate(4 * unit, q, Tried::FINAL)).id).collect();
    for &id in ids.iter().step_by(2) {
        p.apply(FreeMsg::Free(id));
    }
    // Half the memory free, in 1,200 runs of four units: blocks of eight are stitched (some
    // grow, within the 2% slack), until 1,024 runs are mapped.
    let m0 = p.stats.device.num_remaps;
    let mut views = Vec::new();
    while p.stats.device.num_remaps - m0 < 1024 {
        views.push(got(p.allocate(8 * unit, q, Tried::FINAL)).id);
        assert!(views.len() <= 600, "the blocks of eight are not stitched");
    }
    for id in views {
        p.apply(FreeMsg::Free(id));
    }
    // The views stay cached (unused: no block of eight comes again) while blocks of four take
    // their units back, until the arena has to grow for one; three of them freed leave three
    // runs of four units free.
    let r = reserved(&p);
    let mut fill = Vec::new();
    while reserved(&p) == r {
        fill.push(got(p.allocate(4 * unit, q, Tried::FINAL)).id);
    }
    for i in [10, 500, 900] {
        p.apply(FreeMsg::Free(fill[i]));
    }
    p.check_invariants().unwrap();
    let si = p.arenas[&q];
    assert!(!arena(&mut p, si).hungry(), "hungry with credit");
    arena(&mut p, si).spend_map_credit();
    let (r0, m1) = (reserved(&p), p.stats.device.num_remaps);
    // Twelve units: no free run (four each) and no cached view (eight each) holds it.
    let x = got(step!(p.allocate(12 * unit, q, Tried::FINAL))).id;
    assert!(arena(&mut p, si).hungry(), "out of credit with 1,024 runs cached unused, not hungry");
    assert_eq!((reserved(&p) - r0, p.stats.device.num_remaps - m1), (12 * unit, 0), "not grown");
    let free = arena(&mut p, si).free_backed_bytes();
    assert_eq!(free, 12 * unit, "the three runs of four");
    assert_eq!(p.budget().arena_free as usize, free, "the free units counted against the trim bound");
    // Freed blocks of twelve leave free runs of twelve: more of them take those, no call.
    step!(p.apply(FreeMsg::Free(x)));
    let r1 = reserved(&p);
    let again: Vec<_> = (0..3).map(|_| got(step!(p.allocate(12 * unit, q, Tried::FINAL))).id).collect();
    assert_eq!(p.stats.device.num_remaps, m1, "hungry, a view was mapped");
    assert_eq!(reserved(&p) - r1, 24 * unit, "the freed run of twelve was not taken first");
    let allocated = p.stats.hot.array(stats::ALLOCATED_BYTES)[stats::AGGREGATE].current as f64;
    assert!(reserved(&p) as f64 <= allocated * (1.0 + Arena::WIDE_SLACK), "grew past the wider slack");
    for id in again {
        step!(p.apply(FreeMsg::Free(id)));
    }
}

/// A claim (`pool/claims.rs`): while it is in force the fast paths are off (`plain_below` 0)
/// and an allocation is admitted only if allocated bytes, the deferred frees requested since,
/// the request and the claims fit in the allowed memory; the frees outstanding before the
/// claim do not count (they give back what it waits for). Withdrawn, everything is as before.
#[test]
#[cfg_attr(miri, ignore = "segments of hundreds of MiB: the Miri stand-in maps at most 64 MiB")]
fn a_claim_admits_only_what_leaves_it_room() {
    let mut p = pool("expandable_segments:False");
    let plain = p.plain_below;
    let a = got(step!(p.allocate(600 * MB, QueueKey::test(0), Tried::FINAL))).id;
    assert!(p.admits(900 * MB), "no claim: everything is admitted (the ladder decides)");
    let c = p.claim(300 * MB);
    assert_eq!((c, p.plain_below), (300 * MB as u64, 0));
    assert!(p.admits(100 * MB) && !p.admits(200 * MB), "600 allocated + 300 claimed of 1024");
    // A deferred free requested under the claim: the claim does not wait for it.
    p.apply(FreeMsg::Requested(a, 1));
    assert!(p.admits(100 * MB) && !p.admits(200 * MB), "600 freed, but not for the claim");
    p.apply(FreeMsg::Passed(a));
    assert!(p.admits(700 * MB) && !p.admits(800 * MB), "its free completed: 0 + 300 claimed");
    let c2 = p.claim(MB);
    p.unclaim(c, false);
    assert!(!p.admits(1024 * MB) && p.admits(1000 * MB), "the other claim stays");
    assert_eq!(p.plain_below, 0);
    p.unclaim(c2, false);
    assert_eq!(p.plain_below, plain, "the fast paths are back");
    assert!(p.admits(usize::MAX / 2));
    // A free outstanding from before a claim gives back what the claim waits for: until it
    // completes, others take only memory free now.
    let live = got(step!(p.allocate(700 * MB, QueueKey::test(0), Tried::FINAL))).id;
    let older = got(step!(p.allocate(200 * MB, QueueKey::test(0), Tried::FINAL))).id;
    p.apply(FreeMsg::Requested(older, 1));
    let c = p.claim(100 * MB);
    assert!(p.admits(124 * MB) && !p.admits(125 * MB), "700 allocated + 200 being freed for the claim");
    p.apply(FreeMsg::Passed(older));
    assert!(p.admits(224 * MB) && !p.admits(225 * MB), "700 allocated + 100 claimed");
    p.unclaim(c, false);
    p.apply(FreeMsg::Free(live));
    p.check_invariants().unwrap();
}

/// A claim made exclusive (`Pool::keep_others_out`, its second wait): nothing else is
/// admitted, however small, and the deferred frees requested since the claim was made are
/// among those it waits for. Withdrawn, the other claims admit as before.
#[test]
#[cfg_attr(miri, ignore = "segments of hundreds of MiB: the Miri stand-in maps at most 64 MiB")]
fn an_exclusive_claim_admits_nothing_and_waits_for_the_newer_frees() {
    let mut p = pool("expandable_segments:False");
    let a = got(step!(p.allocate(300 * MB, QueueKey::test(0), Tried::FINAL))).id;
    let b = got(step!(p.allocate(200 * MB, QueueKey::test(0), Tried::FINAL))).id;
    let c = p.claim(100 * MB);
    let other = p.claim(MB);
    // Requested under the claims: newer, so not among what they wait for.
    p.apply(FreeMsg::Requested(a, 1));
    assert_eq!((p.claims_newer_outstanding(), p.claimed_frees_outstanding()), (300 * MB as u64, 0));
    assert!(p.admits(MB));
    assert!(p.newer_frees_could_serve(800 * MB), "200 in use + 800 of 1024");
    assert!(!p.newer_frees_could_serve(900 * MB), "200 in use leave no room for 900: a true OOM");
    p.keep_others_out();
    assert_eq!((p.claims_newer_outstanding(), p.claimed_frees_outstanding()), (0, 300 * MB as u64));
    assert!(!p.admits(1) && !p.admits(4096) && !p.admits(MB), "an exclusive claim admits nothing");
    assert!(p.admits(0), "a request refused anyway is refused at once, not kept out");
    // A free requested during the exclusive wait is newer again: not waited for.
    p.apply(FreeMsg::Requested(b, 1));
    assert_eq!((p.claims_newer_outstanding(), p.claimed_frees_outstanding()), (200 * MB as u64, 300 * MB as u64));
    p.apply(FreeMsg::Passed(a));
    assert_eq!(p.claimed_frees_outstanding(), 0);
    p.unclaim(c, true);
    assert!(p.admits(MB), "the other claim, not exclusive, admits again");
    assert_eq!(p.plain_below, 0);
    p.unclaim(other, false);
    assert!(p.admits(usize::MAX / 2));
    p.apply(FreeMsg::Passed(b));
    p.check_invariants().unwrap();
}
