//! The caching allocator's core, run natively and under Miri (`tests/miri/run`): allocation,
//! frees (owned and raw), split and merge, the quick cache, frees made while the lock is held,
//! stats, expandable segments, and the bytes blocks hold. Under Miri the memory comes from the
//! `cfg(miri)` stand-ins (a heap allocation for each mapping, an eventfd for each memfd: see
//! `crate::mapping`), so Miri checks the pool, the lock-free free path and the unsafe segment
//! reference of [`Allocation`] for undefined behaviour, data races and leaks. No queues: they
//! need io_uring.

use std::sync::Arc;

use crate::caching::stats::AGGREGATE;
use crate::caching::{CachingAllocator, Config, HistoryKind};
use crate::error::Error;
use crate::segment::Access;
use crate::source::ShmemSource;

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;

fn alloc(cfg: &str, capacity: usize) -> CachingAllocator {
    CachingAllocator::builder(ShmemSource::new().reserve(false))
        .config(Config::parse(cfg).unwrap())
        .capacity(capacity as u64)
        .build()
        .unwrap()
}

/// Checks every invariant of the pool (after each step of these tests).
fn ok(a: &CachingAllocator) {
    if let Err(why) = a.check_invariants() {
        panic!("{why}");
    }
}

fn classic() -> CachingAllocator {
    alloc("expandable_segments:False", 64 * MB)
}

#[test]
fn a_freed_block_is_reused_and_the_stats_follow() {
    let a = classic();
    let x = a.allocate(1000, None).unwrap();
    ok(&a);
    assert_eq!(x.len(), 1000);
    let st = a.stats();
    assert_eq!(st.allocation[AGGREGATE].current, 1);
    assert_eq!(st.allocated_bytes[AGGREGATE].current, 1024, "rounded to 512");
    assert_eq!(st.reserved_bytes[AGGREGATE].current as usize, 2 * MB, "one small segment");
    assert_eq!(st.num_device_alloc, 1);
    let p = x.as_ptr();
    drop(x);
    ok(&a);
    let st = a.stats();
    assert_eq!((st.allocation[AGGREGATE].current, st.allocation[AGGREGATE].freed), (0, 1));
    let y = a.allocate(1000, None).unwrap();
    ok(&a);
    assert_eq!(y.as_ptr(), p, "the cached block was not reused");
    let z = a.allocate(600, None).unwrap();
    ok(&a);
    let st = a.stats();
    assert_eq!(st.num_device_alloc, 1, "both came from the cached segment");
    assert_eq!(st.allocated_bytes[AGGREGATE].peak, 2048);
    assert_eq!(st.simple().num_allocs, 3);
    drop((y, z));
    ok(&a);
    a.empty_cache();
    ok(&a);
    let st = a.stats();
    assert_eq!((st.reserved_bytes[AGGREGATE].current, st.segment[AGGREGATE].current), (0, 0));
    assert_eq!(st.simple().num_frees, 3);
}

#[test]
fn blocks_split_and_merge_back_and_whole_segments_are_released() {
    let a = classic();
    let blocks: Vec<_> = (0..4).map(|_| a.allocate(512 * KB, None).unwrap()).collect();
    assert_eq!(a.stats().segment[AGGREGATE].current, 1, "four 512 KiB blocks share one 2 MiB segment");
    let base = blocks[0].as_ptr() as usize - blocks[0].offset();
    let mut offsets: Vec<usize> = blocks.iter().map(|b| b.as_ptr() as usize - base).collect();
    offsets.sort_unstable();
    assert_eq!(offsets, [0, 512 * KB, MB, 3 * 512 * KB]);
    let mut it = blocks.into_iter();
    let (b0, b1, b2, b3) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
    drop(b1);
    ok(&a);
    drop(b2);
    ok(&a);
    // Freed blocks wait unmerged for an exact-size reuse (the quick cache)...
    let st = a.stats();
    assert_eq!(st.inactive_split[AGGREGATE].current, 2);
    let again = a.allocate(512 * KB, None).unwrap();
    ok(&a);
    assert_eq!(a.stats().inactive_split[AGGREGATE].current, 1, "an exact-size request reused a freed block");
    drop(again);
    ok(&a);
    // ...and a request no cached block fits merges them: 1 MiB, split for 700 KiB.
    let c = a.allocate(700 * KB, None).unwrap();
    ok(&a);
    let st = a.stats();
    assert_eq!(st.segment[AGGREGATE].current, 1, "the merged hole served the request");
    assert_eq!(st.inactive_split_bytes[AGGREGATE].current as usize, MB - 700 * KB);
    drop((b0, b3, c));
    ok(&a);
    a.empty_cache();
    ok(&a);
    let st = a.stats();
    assert_eq!(st.inactive_split[AGGREGATE].current, 0);
    assert_eq!(st.segment[AGGREGATE].current, 0, "the segment merged back whole and was released");
    assert_eq!(st.num_device_free, 1);
}

#[test]
fn raw_blocks_are_checked_reused_and_bounded() {
    let a = classic();
    let p = a.allocate_raw(4096, None).unwrap();
    ok(&a);
    assert_eq!(a.raw_size(p).unwrap(), 4096);
    assert_eq!(a.raw_mem(p, 4096).unwrap().len(), 4096);
    assert!(matches!(a.raw_mem(p, 4097), Err(Error::OutOfBounds { .. })));
    assert_eq!(a.mem_at(p.wrapping_add(100), 100).unwrap().len(), 100);
    assert!(a.free_raw(p.wrapping_add(512)).is_err(), "an interior pointer was freed");
    ok(&a);
    assert!(a.free_raw(std::ptr::null_mut()).is_err());
    ok(&a);
    let owned = a.allocate(4096, None).unwrap();
    ok(&a);
    assert!(a.free_raw(owned.as_ptr()).is_err(), "an Allocation's pointer was freed raw");
    ok(&a);
    a.free_raw(p).unwrap();
    ok(&a);
    assert!(a.free_raw(p).is_err(), "a double free was accepted");
    ok(&a);
    assert!(a.raw_size(p).is_err());
    let q = a.allocate_raw(4096, None).unwrap();
    ok(&a);
    assert_eq!(q, p, "the freed raw block was not reused");
    a.free_raw(q).unwrap();
    ok(&a);
    drop(owned);
    ok(&a);
    let st = a.stats();
    assert_eq!(st.allocation[AGGREGATE].current, 0);
    assert_eq!(st.simple().num_frees, 3);
}

#[test]
fn frees_made_while_the_lock_is_held_are_applied_by_the_next_holder() {
    let a = classic();
    a.record_history(true);
    let x = a.allocate(4096, None).unwrap();
    ok(&a);
    let y = a.allocate(8192, None).unwrap();
    ok(&a);
    let held = a.inner.pool.lock();
    // Neither free may wait for the lock (this thread holds it; the other joins under it).
    drop(x);
    std::thread::spawn(move || drop(y)).join().unwrap();
    assert!(!crate::caching::shared::nothing_pushed(&a.inner), "the frees were not queued");
    drop(held);
    ok(&a);
    let st = a.stats();
    assert_eq!(st.allocation[AGGREGATE].current, 0);
    assert_eq!(st.allocation[AGGREGATE].freed, 2);
    assert_eq!(st.allocated_bytes[AGGREGATE].current, 0);
    let frees = a.history().iter().filter(|h| h.kind == HistoryKind::FreeCompleted).count();
    assert_eq!(frees, 2);
}

#[test]
fn a_drop_with_the_lock_free_applies_its_free_itself() {
    for conf in ["expandable_segments:False", "expandable_segments:True", "page_stitching:True"] {
        let a = alloc(conf, 64 * MB);
        // A quick-cache block (4 KiB) and, where the arena exists, an arena home block.
        for size in [4096, 256 * KB] {
            let x = a.allocate(size, None).unwrap();
            let addr = x.as_ptr();
            drop(x);
            assert!(
                crate::caching::shared::nothing_pushed(&a.inner),
                "{conf}: the free of {size} B was queued, not applied"
            );
            {
                // Looked at without draining: the drop itself accounted the free.
                let pool = a.inner.pool.lock();
                let st = pool.stats();
                assert_eq!(st.allocation[AGGREGATE].current, 0, "{conf}: {size} B");
                assert_eq!(st.allocated_bytes[AGGREGATE].current, 0, "{conf}: {size} B");
            }
            ok(&a);
            let y = a.allocate(size, None).unwrap();
            assert_eq!(y.as_ptr(), addr, "{conf}: the block freed by its drop was not reused");
        }
    }
}

#[test]
fn a_drop_that_cannot_take_the_short_way_is_queued() {
    let a = classic();
    // With every event recorded the quick cache is off: the free takes the long way, which
    // the drop leaves to the next drain (it may ask queues whether they are idle).
    a.record_history(true);
    let x = a.allocate(4096, None).unwrap();
    drop(x);
    assert!(!crate::caching::shared::nothing_pushed(&a.inner), "the long way was taken in the drop");
    ok(&a);
    assert_eq!(a.stats().allocation[AGGREGATE].current, 0);
    let frees = a.history().iter().filter(|h| h.kind == HistoryKind::FreeCompleted).count();
    assert_eq!(frees, 1);
}

#[test]
fn drops_race_allocations_and_raw_frees() {
    // Drops that take the lock themselves race raw allocations and frees, stats and snapshots
    // on other threads: every free is applied once, nothing is lost.
    //
    // Finding (failed once, in the kernel lane's emulated machine at 19663b0: "requested
    // bytes: stats say [4096, 4096, 0], the blocks [0, 0, 0]", every other count right, which
    // is what a block handed to two owners and freed by both leaves; not reproduced since, in
    // 2,514 runs of this test and 41 of its binary there, nor on the host). Debug builds now
    // name such a fault where it happens: two guards of the pool's lock at once
    // (`pool_lock.rs`), a block handed out that is not free, or freed that is not live
    // (`Pool::hand_out`, `Pool::quick_free_now`, `Pool::account_free_request`);
    // `tests/hostile_fastpath.rs` runs this race with every block tagged.
    const THREADS: usize = 3;
    const EACH: usize = if cfg!(miri) { 12 } else { 4000 };
    // Under Miri one configuration: the test is about the threads' memory accesses there.
    let confs: &[&str] =
        if cfg!(miri) { &["expandable_segments:False"] } else { &["expandable_segments:False", "page_stitching:True"] };
    for &conf in confs {
        let a = Arc::new(alloc(conf, 256 * MB));
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let a = Arc::clone(&a);
                s.spawn(move || {
                    let mut live = Vec::new();
                    let mut raw = Vec::new();
                    for i in 0..EACH {
                        let size = [4096, 512, 96 * KB, 4096, 1 << 20][(i + t) % 5];
                        if t == 0 && i % 2 == 0 {
                            raw.push(a.allocate_raw(size, None).unwrap());
                        } else {
                            live.push(a.allocate(size, None).unwrap());
                        }
                        if i % 3 != 0 {
                            drop(live.pop());
                        }
                        if live.len() > 16 {
                            drop(live.swap_remove(i % live.len()));
                        }
                        if raw.len() > 4 {
                            a.free_raw(raw.swap_remove(i % raw.len())).unwrap();
                        }
                        if i % 257 == 0 {
                            let _ = a.stats();
                        }
                    }
                    for p in raw {
                        a.free_raw(p).unwrap();
                    }
                    // The rest is dropped on another thread, as the lock may be taken.
                    std::thread::spawn(move || drop(live)).join().unwrap();
                });
            }
        });
        ok(&a);
        let st = a.stats();
        assert_eq!(st.allocation[AGGREGATE].current, 0, "{conf}");
        assert_eq!(st.allocated_bytes[AGGREGATE].current, 0, "{conf}");
        assert_eq!(st.simple().num_allocs, st.simple().num_frees, "{conf}");
        assert_eq!(st.simple().num_allocs, (THREADS * EACH) as i64, "{conf}");
    }
}

#[test]
#[cfg_attr(miri, ignore)] // no membarrier under Miri: the lock is never biased there
fn a_thread_that_keeps_allocating_owns_the_lock_until_another_needs_it() {
    let a = Arc::new(classic());
    for _ in 0..2 * crate::caching::pool_lock::BIAS_AFTER {
        a.free_raw(a.allocate_raw(4096, None).unwrap()).unwrap();
    }
    if !a.inner.pool.is_biased() {
        println!("SKIP: membarrier(PRIVATE_EXPEDITED) is not available here: the lock is never biased");
        return;
    }
    // The owner's pairs, raw and owned, take the fast hold and keep exact stats.
    let p = a.allocate_raw(4096, None).unwrap();
    let x = a.allocate(4096, None).unwrap();
    assert!(a.inner.pool.is_biased());
    let a2 = Arc::clone(&a);
    let (p2, seen) = std::thread::spawn(move || {
        // Another thread's stats take the lock back, and see the owner's two live blocks.
        let st = a2.stats();
        (a2.allocate_raw(4096, None).unwrap() as usize, st.allocation[AGGREGATE].current)
    })
    .join()
    .unwrap();
    assert_eq!(seen, 2);
    assert!(!a.inner.pool.is_biased(), "another thread's call left the bias in place");
    assert_ne!(p2, p as usize);
    a.free_raw(p).unwrap();
    a.free_raw(p2 as *mut u8).unwrap();
    drop(x);
    ok(&a);
    let st = a.stats();
    assert_eq!(st.allocation[AGGREGATE].current, 0);
    assert_eq!(st.simple().num_allocs, st.simple().num_frees);
    assert_eq!(st.simple().num_allocs, 2 * 2 * crate::caching::pool_lock::BIAS_AFTER as i64 / 2 + 3);
}

#[test]
fn an_owner_thread_races_threads_that_take_the_lock_back() {
    // One thread does long runs of pairs (it comes to own the lock); others now and then
    // allocate, free its raw blocks, read stats and empty the cache, each taking the lock
    // back. Live blocks never overlap, and the counts come out exact.
    const ROUNDS: usize = if cfg!(miri) { 1 } else { 60 };
    const RUN: usize = if cfg!(miri) { 8 } else { 400 };
    let a = Arc::new(alloc("expandable_segments:True,page_stitching:True", 256 * MB));
    let handed = Arc::new(std::sync::Mutex::new(Vec::<usize>::new()));
    std::thread::scope(|s| {
        let (a1, h1) = (Arc::clone(&a), Arc::clone(&handed));
        s.spawn(move || {
            for r in 0..ROUNDS {
                for i in 0..RUN {
                    let size = [4096, 512, 64 * KB, 4096][i % 4];
                    let p = a1.allocate_raw(size, None).unwrap();
                    let x = a1.allocate(size, None).unwrap();
                    // Two live blocks never share a byte.
                    let (xp, pp) = (x.as_ptr() as usize, p as usize);
                    assert!(xp + size <= pp || pp + size <= xp, "live blocks {xp:#x} and {pp:#x} overlap");
                    assert_eq!(a1.raw_size(p).unwrap(), size);
                    drop(x);
                    if i % 97 == 0 {
                        h1.lock().unwrap().push(p as usize);
                    } else {
                        a1.free_raw(p).unwrap();
                    }
                }
                if r % 8 == 0 {
                    ok(&a1);
                }
            }
        });
        for t in 0..2 {
            let (a2, h2) = (Arc::clone(&a), Arc::clone(&handed));
            s.spawn(move || {
                for i in 0..ROUNDS * 4 {
                    let ps: Vec<usize> = std::mem::take(&mut *h2.lock().unwrap());
                    for p in ps {
                        a2.free_raw(p as *mut u8).unwrap();
                    }
                    match (i + t) % 4 {
                        0 => drop(a2.stats()),
                        1 => a2.empty_cache(),
                        _ => drop(a2.allocate(8192, None).unwrap()),
                    }
                    std::thread::yield_now();
                }
            });
        }
    });
    for p in std::mem::take(&mut *handed.lock().unwrap()) {
        a.free_raw(p as *mut u8).unwrap();
    }
    ok(&a);
    let st = a.stats();
    assert_eq!(st.allocation[AGGREGATE].current, 0);
    assert_eq!(st.allocated_bytes[AGGREGATE].current, 0);
    assert_eq!(st.simple().num_allocs, st.simple().num_frees);
}

#[test]
fn threads_allocate_and_free_at_once() {
    const THREADS: usize = 3;
    const EACH: usize = if cfg!(miri) { 24 } else { 1000 };
    let a = Arc::new(classic());
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let a = Arc::clone(&a);
            s.spawn(move || {
                let mut live = Vec::new();
                for i in 0..EACH {
                    live.push(a.allocate(512 + (i * 37 + t * 101) % (64 * KB), None).unwrap());
                    if i % 3 == 0 {
                        live.swap_remove((i * 7) % live.len());
                    }
                    // Every few steps (each check walks every block and every quick-cache list
                    // under the lock; three threads take 3000 steps). Not under Miri, where one
                    // check costs minutes: there the test is about the threads' memory
                    // accesses, and the invariants are checked at the end.
                    if !cfg!(miri) && i % 32 == 0 {
                        ok(&a);
                    }
                }
                // The rest is freed on another thread.
                std::thread::spawn(move || drop(live)).join().unwrap();
            });
        }
    });
    let st = a.stats();
    assert_eq!(st.allocation[AGGREGATE].current, 0);
    assert_eq!(st.active[AGGREGATE].current, 0);
    assert_eq!(st.simple().num_allocs, (THREADS * EACH) as i64);
    assert_eq!(st.simple().num_frees, (THREADS * EACH) as i64);
    a.empty_cache();
    ok(&a);
    assert_eq!(a.stats().reserved_bytes[AGGREGATE].current, 0, "{:?}", a.snapshot());
}

#[test]
fn blocks_hold_their_own_bytes() {
    let a = classic();
    let blocks: Vec<_> = (0..4).map(|i| a.allocate(1000 + i * 100, None).unwrap()).collect();
    for (i, b) in blocks.iter().enumerate() {
        let cpu = b.cpu_access(Access::Write).unwrap();
        cpu.fill(0, b.len(), i as u8 + 1).unwrap();
        assert!(cpu.write(b.len(), &[0xff]).is_err(), "wrote past block {i}");
    }
    for (i, b) in blocks.iter().enumerate() {
        let got = b.cpu_access(Access::Read).unwrap().to_vec().unwrap();
        assert_eq!(got, vec![i as u8 + 1; b.len()], "block {i}");
    }
}

#[test]
fn an_expandable_segment_grows_in_place_and_punching_spares_live_blocks() {
    let a = alloc("expandable_segments:True", 8 * MB);
    let x = a.allocate(3 * MB, None).unwrap();
    ok(&a);
    let y = a.allocate(2 * MB, None).unwrap();
    ok(&a);
    let st = a.stats();
    assert_eq!(st.segment[AGGREGATE].current, 1, "one growing segment");
    assert_eq!(y.as_ptr() as usize, x.as_ptr() as usize + 3 * MB, "the second block follows the first");
    let xv = x.cpu_access(Access::ReadWrite).unwrap();
    xv.fill(x.len() - 64, 64, 0x5a).unwrap();
    y.cpu_access(Access::Write).unwrap().fill(0, 64, 0xa5).unwrap();
    assert!(xv.write(x.len(), &[1]).is_err());
    drop(y);
    ok(&a);
    let reserved = a.stats().reserved_bytes[AGGREGATE].current;
    a.empty_cache();
    ok(&a);
    let st = a.stats();
    assert!(st.reserved_bytes[AGGREGATE].current < reserved, "nothing was given back");
    assert!(st.reserved_bytes[AGGREGATE].current as usize >= 3 * MB, "the live block lost pages");
    let mut tail = [0u8; 64];
    xv.read(x.len() - 64, &mut tail).unwrap();
    assert_eq!(tail, [0x5a; 64], "punching touched a live block");
}

/// The strong counts of the allocator's shared state: the handles' and live allocations' own,
/// and those of the records the pool keeps for reuse (`record.rs`).
fn counts(a: &CachingAllocator) -> (usize, usize) {
    // Taken as the allocator takes it: what was pushed is applied first.
    let spares = a.lock().spares.len();
    (Arc::strong_count(&a.inner), spares)
}

#[test]
fn dropped_allocations_leave_their_records_to_the_next_ones_while_handles_live() {
    for conf in ["expandable_segments:False", "page_stitching:True"] {
        let a = alloc(conf, 64 * MB);
        let b = a.clone();
        // A quick-cache block and, where the arena exists, an arena home block.
        let xs: Vec<_> = [4096, 4096, 256 * KB].iter().map(|&s| a.allocate(s, None).unwrap()).collect();
        assert_eq!(counts(&a), (5, 0), "{conf}: two handles and three allocations");
        drop(xs);
        assert!(crate::caching::shared::nothing_pushed(&a.inner), "{conf}: the frees took the short way");
        assert_eq!(counts(&a), (5, 3), "{conf}: the three records, with their counts, were kept as spares");
        let y = b.allocate(4096, None).unwrap();
        assert_eq!(counts(&a), (5, 2), "{conf}: the new allocation took a spare record");
        drop(b);
        assert_eq!(counts(&a), (4, 2), "{conf}: a handle that is not the last leaves the spares alone");
        let weak = Arc::downgrade(&a.inner);
        drop(a);
        assert_eq!(
            weak.strong_count(),
            1,
            "{conf}: the last handle let the spares go: only the allocation's count is left"
        );
        assert_eq!(y.len(), 4096);
        drop(y);
        assert_eq!(weak.strong_count(), 0, "{conf}: the pool outlived its last allocation");
    }
}

#[test]
fn allocations_that_outlive_every_handle_free_the_pool_with_the_last_of_them() {
    let a = classic();
    let weak = Arc::downgrade(&a.inner);
    let xs: Vec<_> = (0..4).map(|_| a.allocate(4096, None).unwrap()).collect();
    drop(a);
    assert_eq!(weak.strong_count(), 4);
    for (i, x) in xs.into_iter().enumerate() {
        // Each drop applies its free under the lock and lets its own count go (no handle is
        // left to keep its record for).
        drop(x);
        assert_eq!(weak.strong_count(), 3 - i);
    }
}

#[test]
fn a_last_handle_dropped_under_the_lock_leaves_the_spares_to_the_next_drop() {
    let a = classic();
    let x = a.allocate(4096, None).unwrap();
    drop(a.allocate(4096, None).unwrap());
    let inner = Arc::clone(&a.inner);
    assert_eq!(inner.pool.lock().spares.len(), 1);
    // As a memory source's callback would: this thread holds the lock when the last handle
    // goes. It cannot take the lock again to let the spares go, and must not wait for it.
    let held = inner.pool.lock();
    drop(a);
    drop(held);
    assert_eq!(inner.pool.lock().spares.len(), 1, "the spares were taken out without the lock");
    assert_eq!(Arc::strong_count(&inner), 3, "this clone, the allocation's count, the spare's");
    // The next drop under the lock sees no handle: the spare goes with its own record.
    drop(x);
    assert_eq!(inner.pool.lock().spares.len(), 0);
    assert_eq!(Arc::strong_count(&inner), 1);
}

#[test]
fn handles_and_allocations_dropped_on_many_threads_free_the_pool_exactly_once() {
    // Allocations are made on one thread and dropped on another (the lock may be held, or owned
    // by a third: the free is then pushed, and the count let go as an `Arc`'s), while the
    // handles go in any order. Whatever the interleaving, the pool is freed once the last
    // handle and the last allocation are gone, and not before (Miri also checks that nothing
    // leaks and nothing is used after it is freed).
    let rounds = if cfg!(miri) { 2 } else { 40 };
    let per = if cfg!(miri) { 8 } else { 300 };
    for round in 0..rounds {
        let a = classic();
        let weak = Arc::downgrade(&a.inner);
        let (tx, rx) = std::sync::mpsc::channel::<crate::caching::Allocation>();
        let makers: Vec<_> = (0..2)
            .map(|t| {
                let (h, tx) = (a.clone(), tx.clone());
                std::thread::spawn(move || {
                    let mut kept = Vec::new();
                    for i in 0..per {
                        let x = h.allocate(512 * (1 + (i + t) % 8), None).unwrap();
                        match i % 3 {
                            0 => drop(x),
                            1 => tx.send(x).unwrap(),
                            _ => kept.push(x),
                        }
                    }
                    // This handle goes before the allocations it made.
                    drop(h);
                    kept
                })
            })
            .collect();
        drop(tx);
        let dropper = std::thread::spawn(move || rx.into_iter().count());
        // Every other round the first handle goes before the others' allocations.
        let mut a = Some(a).filter(|_| round % 2 == 1);
        let kept: Vec<_> = makers.into_iter().flat_map(|m| m.join().unwrap()).collect();
        assert_eq!(dropper.join().unwrap(), 2 * ((per + 1) / 3), "every allocation sent was dropped");
        assert!(weak.strong_count() > 0, "the pool went while allocations were live");
        drop(kept);
        if let Some(a) = a.take() {
            ok(&a);
            assert_eq!(a.stats().allocation[AGGREGATE].current, 0);
            drop(a);
        }
        assert_eq!(weak.strong_count(), 0, "round {round}: the pool outlived every handle and allocation");
    }
}

#[test]
fn records_pushed_by_drops_hold_no_count_and_are_kept_once_applied() {
    let a = classic();
    let (x, y) = (a.allocate(4096, None).unwrap(), a.allocate(8192, None).unwrap());
    assert_eq!(counts(&a), (3, 0));
    {
        // Neither drop can take the lock: both push their records, which hold no count.
        let held = a.inner.pool.lock();
        std::thread::spawn(move || drop(x)).join().unwrap();
        drop(y);
        assert!(!a.inner.dropped.is_empty(), "the records were not pushed");
        assert_eq!(Arc::strong_count(&a.inner), 1, "a pushed record kept its count");
        drop(held);
    }
    // The next holder applies the frees and keeps the records as spares, counted again.
    assert_eq!(counts(&a), (3, 2));
    assert!(crate::caching::shared::nothing_pushed(&a.inner));
    ok(&a);
    assert_eq!(a.stats().allocation[AGGREGATE].current, 0);
    // Pushed when no handle is left: applied by whoever holds the lock next, and let go.
    let z = a.allocate(4096, None).unwrap();
    let inner = Arc::clone(&a.inner);
    let held = inner.pool.lock();
    std::thread::spawn(move || drop(z)).join().unwrap();
    drop(held);
    drop(a);
    assert_eq!(Arc::strong_count(&inner), 1, "the last handle left a record or a count behind");
    assert!(crate::caching::shared::nothing_pushed(&inner));
    assert_eq!(inner.pool.lock().spares.len(), 0);
}
