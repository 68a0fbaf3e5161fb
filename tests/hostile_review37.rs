//! Hostile review 37: page-stitched mode (`page_stitching:True`) under several threads that mix
//! owned `Allocation`s (dropped on other threads, recorded on real queues) and raw blocks
//! (`free_raw`, `free_raw_sized`, `record_queue_raw`) while another thread flips
//! `set_memory_fraction`, resets the peaks, takes snapshots, empties the cache and checks the
//! invariants. Every live block is tagged at both ends; recorded blocks are read back by a
//! callback queued before their record (a free applied early lets another owner overwrite it).

#![allow(unsafe_code)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use common::tags::{Bad, Live, Raw, check_later, settled};
use common::{QueueGate, Rng, allocator, allocator_waiting, scaled};
use dmabuf_rt::Error;
use dmabuf_rt::caching::BlockState;
use dmabuf_rt::caching::CachingAllocator;
use dmabuf_rt::caching::stats::{AGGREGATE, DeviceStats};
use dmabuf_rt::queue::Queue;

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;
const CONF: &str = "page_stitching:True";

/// Sizes of both sides of the four-unit threshold, most of them the arena's.
fn size_of(rng: &mut Rng) -> usize {
    match rng.below(10) {
        0 => 16 + rng.below(16 * KB as u64 - 16) as usize,
        1 => 16 * KB - 1 - rng.below(512) as usize,
        2 => 16 * KB + rng.below(4) as usize,
        3..=6 => (4 + rng.below(20) as usize) * 4 * KB - rng.below(4 * KB as u64) as usize,
        7 | 8 => 64 * KB * (1 + rng.below(8) as usize),
        _ => 256 * KB + rng.below(2 * MB as u64) as usize,
    }
}

fn ok_oom<T>(r: Result<T, Error>, what: &str) -> Option<T> {
    match r {
        Ok(x) => Some(x),
        Err(Error::AllocatorOom { .. }) => None,
        Err(e) => panic!("{what}: refused with a wrong reason: {e}"),
    }
}

/// Every peak is at least its current value, no current value is negative.
#[track_caller]
fn peaks_hold(s: &DeviceStats, what: &str) {
    let arrays = [
        ("allocation", &s.allocation),
        ("segment", &s.segment),
        ("active", &s.active),
        ("allocated_bytes", &s.allocated_bytes),
        ("reserved_bytes", &s.reserved_bytes),
        ("active_bytes", &s.active_bytes),
        ("requested_bytes", &s.requested_bytes),
        ("inactive_split", &s.inactive_split),
        ("inactive_split_bytes", &s.inactive_split_bytes),
    ];
    for (name, arr) in arrays {
        for (i, st) in arr.iter().enumerate() {
            assert!(st.current >= 0, "{what}: {name}[{i}] current {} < 0", st.current);
            assert!(st.peak >= st.current, "{what}: {name}[{i}] peak {} < current {}", st.peak, st.current);
        }
    }
    assert!(
        s.active_bytes[AGGREGATE].current >= s.allocated_bytes[AGGREGATE].current,
        "{what}: active bytes {} below allocated bytes {}",
        s.active_bytes[AGGREGATE].current,
        s.allocated_bytes[AGGREGATE].current
    );
}

/// Snapshot segments never overlap and each one's blocks tile it.
#[track_caller]
fn snapshot_sane(a: &CachingAllocator, what: &str) -> usize {
    let snap = a.snapshot();
    let mut segs: Vec<(usize, usize)> = Vec::new();
    let mut total = 0;
    for s in &snap.segments {
        let sum: usize = s.blocks.iter().map(|b| b.size).sum();
        assert_eq!(sum, s.size, "{what}: blocks of segment {:#x} do not add up to its size", s.address);
        let mut at = 0;
        for b in &s.blocks {
            assert_eq!(b.offset, at, "{what}: blocks of segment {:#x} leave a gap or overlap", s.address);
            at += b.size;
            if b.state == BlockState::Allocated {
                assert!(b.requested > 0 && b.requested <= b.size, "{what}: allocated block requested {}", b.requested);
            }
        }
        segs.push((s.address, s.size));
        total += s.size;
    }
    segs.sort_unstable();
    for w in segs.windows(2) {
        assert!(
            w[0].0 + w[0].1 <= w[1].0,
            "{what}: snapshot segments overlap: {:#x}+{:#x} and {:#x}+{:#x}",
            w[0].0,
            w[0].1,
            w[1].0,
            w[1].1
        );
    }
    total
}

// ---------------------------------------------------------------------------------------------

/// Three workers (one on no queue, two on queues of their own) allocate owned and raw blocks of
/// arena and pool sizes, free them themselves or hand them to another worker (through bins),
/// free raw ones sized, and record some on a side queue whose callback, queued before the
/// record, reads the block's tags. A chaos thread meanwhile flips the memory fraction between
/// 20% and 100%, resets the peaks, checks the stats' peaks, snapshots, empties the cache and
/// checks the invariants. Every live block keeps its tags; OOMs are the only refusals; the
/// allocator settles to zero and gives everything back.
#[test]
fn stitched_churn_under_fraction_flips_peak_resets_and_snapshots() {
    const THREADS: usize = 3;
    let a = Arc::new(allocator(CONF, 64 * MB as u64));
    let bins: Arc<Mutex<Vec<Live>>> = Arc::new(Mutex::new(Vec::new()));
    let raw_bin: Arc<Mutex<Vec<Raw>>> = Arc::new(Mutex::new(Vec::new()));
    let bad: Bad = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(THREADS + 1));
    let iters = scaled(14000);
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (a, bins, raw_bin, bad, start) = (a.clone(), bins.clone(), raw_bin.clone(), bad.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                let q = if t == 0 { None } else { Some(Queue::new().unwrap()) };
                let side = Queue::new().unwrap();
                let mut rng = Rng((0x3737_0000 + t as u64 * 7919) | 1);
                let mut live: Vec<Live> = Vec::new();
                let mut raws: Vec<Raw> = Vec::new();
                for step in 0..iters {
                    let what = format!("thread {t} step {step}");
                    let r = rng.below(100);
                    if r < 25 || (live.is_empty() && r < 50) {
                        let size = size_of(&mut rng);
                        if let Some(x) = ok_oom(a.allocate(size, q.as_ref()), &what) {
                            live.push(Live::new(x));
                        }
                    } else if r < 50 || raws.is_empty() && r < 60 {
                        let size = size_of(&mut rng);
                        if let Some(p) = ok_oom(a.allocate_raw(size, q.as_ref()), &what) {
                            raws.push(Raw::new(p, size));
                        }
                    } else if r < 60 && !live.is_empty() {
                        let l = live.swap_remove(rng.below(live.len() as u64) as usize);
                        l.check(&what);
                        drop(l);
                    } else if r < 70 && !raws.is_empty() {
                        let x = raws.swap_remove(rng.below(raws.len() as u64) as usize);
                        x.check(&what);
                        if rng.below(2) == 0 {
                            a.free_raw_sized(x.p as *mut u8, x.n)
                                .unwrap_or_else(|e| panic!("{what}: free_raw_sized: {e}"));
                        } else {
                            a.free_raw(x.p as *mut u8).unwrap_or_else(|e| panic!("{what}: free_raw: {e}"));
                        }
                    } else if r < 80 {
                        // Trade with the other workers.
                        if let Some(l) = (!live.is_empty()).then(|| live.swap_remove(0)) {
                            let mut b = bins.lock().unwrap();
                            b.push(l);
                            if b.len() > 2 {
                                let i = rng.below(b.len() as u64) as usize;
                                let o = b.swap_remove(i);
                                drop(b);
                                o.check(&format!("{what}: traded"));
                                drop(o);
                            }
                        }
                        if let Some(x) = (!raws.is_empty()).then(|| raws.swap_remove(0)) {
                            let mut b = raw_bin.lock().unwrap();
                            b.push(x);
                            if b.len() > 2 {
                                let i = rng.below(b.len() as u64) as usize;
                                let o = b.swap_remove(i);
                                drop(b);
                                o.check(&format!("{what}: traded raw"));
                                a.free_raw(o.p as *mut u8).unwrap_or_else(|e| panic!("{what}: traded free_raw: {e}"));
                            }
                        }
                    } else if r < 90 && !live.is_empty() {
                        // Recorded on the side queue, read there after its drop.
                        let mut l = live.swap_remove(rng.below(live.len() as u64) as usize);
                        check_later(&side, l.a.as_ptr() as usize, l.a.len(), l.tag, &bad, "recorded allocation");
                        l.a.record_queue(&side);
                        drop(l);
                    } else if !raws.is_empty() {
                        let x = raws.swap_remove(rng.below(raws.len() as u64) as usize);
                        check_later(&side, x.p, x.n, x.tag, &bad, "recorded raw block");
                        a.record_queue_raw(x.p as *mut u8, &side).unwrap_or_else(|e| panic!("{what}: record: {e}"));
                        a.free_raw(x.p as *mut u8).unwrap_or_else(|e| panic!("{what}: recorded free_raw: {e}"));
                    }
                    if step % 8 == 0 {
                        for l in &live {
                            l.check(&what);
                        }
                        for x in &raws {
                            x.check(&what);
                        }
                    }
                }
                for l in &live {
                    l.check("at the end");
                }
                drop(live);
                for x in raws {
                    x.check("raw at the end");
                    a.free_raw(x.p as *mut u8).unwrap();
                }
                side.synchronize().unwrap();
                if let Some(q) = q {
                    q.synchronize().unwrap();
                }
            })
        })
        .collect();
    let chaos = {
        let (a, stop, start) = (a.clone(), stop.clone(), start.clone());
        std::thread::spawn(move || {
            start.wait();
            let mut rng = Rng(0xC4A05);
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                match rng.below(6) {
                    0 => a.set_memory_fraction([0.2, 0.5, 1.0][rng.below(3) as usize]).unwrap(),
                    1 => a.reset_peak_stats(),
                    2 => {
                        snapshot_sane(&a, &format!("chaos {n}"));
                    }
                    3 if n % 4 == 0 => a.empty_cache(),
                    _ => a.check_invariants().unwrap_or_else(|e| panic!("chaos {n}: invariants: {e}")),
                }
                peaks_hold(&a.stats(), &format!("chaos {n}"));
                n += 1;
                std::thread::yield_now();
            }
            n
        })
    };
    let mut panics = Vec::new();
    for w in workers {
        if let Err(e) = w.join() {
            panics.push(e);
        }
    }
    stop.store(true, Ordering::Relaxed);
    let chaos_res = chaos.join();
    if let Some(e) = panics.pop() {
        std::panic::resume_unwind(e);
    }
    let n = chaos_res.unwrap_or_else(|e| std::panic::resume_unwind(e));
    let s = a.stats();
    eprintln!("chaos rounds {n}, ooms {}, remaps {}", s.num_ooms, s.num_remaps);
    assert!(s.num_remaps > 0, "no stitched view was made");
    let bad = bad.lock().unwrap().clone();
    assert!(bad.is_empty(), "recorded blocks changed before their queue passed: {bad:?}");
    for l in bins.lock().unwrap().drain(..) {
        l.check("bin at the end");
    }
    for x in raw_bin.lock().unwrap().drain(..) {
        x.check("raw bin at the end");
        a.free_raw(x.p as *mut u8).unwrap();
    }
    a.set_memory_fraction(1.0).unwrap();
    settled(&a, "after the churn");
    peaks_hold(&a.stats(), "after the churn");
    a.empty_cache();
    settled(&a, "after empty_cache");
    let s = a.stats();
    assert_eq!(s.reserved_bytes[AGGREGATE].current, 0, "reserved after empty_cache: {:?}", s.simple());
    assert_eq!(s.segment[AGGREGATE].current, 0, "segments after empty_cache");
}

// ---------------------------------------------------------------------------------------------

/// A fraction lowered before any use: two workers on their own queues and one on none allocate
/// and free arena and pool sizes, a fourth resets the peaks (the arena's growth limit reads
/// the peak) and empties the cache. After every successful allocation the reserved bytes are
/// within the allowed memory, and a request larger than the allowed memory is refused as an
/// OOM at once.
#[test]
fn a_lowered_fraction_bounds_reserved_bytes_under_threads() {
    let cap = 64 * MB as u64;
    let a = Arc::new(allocator(CONF, cap));
    a.set_memory_fraction(0.3).unwrap();
    let allowed = (cap as f64 * 0.3) as i64;
    let stop = Arc::new(AtomicBool::new(false));
    let over = Arc::new(AtomicUsize::new(0));
    let iters = scaled(100000);
    let workers: Vec<_> = (0..3)
        .map(|t| {
            let (a, over) = (a.clone(), over.clone());
            std::thread::spawn(move || {
                let q = (t > 0).then(|| Queue::new().unwrap());
                let mut rng = Rng(0xF7AC + t as u64 * 31);
                let mut live: Vec<Live> = Vec::new();
                for step in 0..iters {
                    let what = format!("thread {t} step {step}");
                    if rng.below(100) < 55 {
                        let size = size_of(&mut rng);
                        if let Some(x) = ok_oom(a.allocate(size, q.as_ref()), &what) {
                            live.push(Live::new(x));
                            let r = a.stats().reserved_bytes[AGGREGATE].current;
                            if r > allowed {
                                over.fetch_add(1, Ordering::Relaxed);
                                panic!("{what}: reserved {r} above the allowed {allowed} after a {size}-byte request");
                            }
                        }
                    } else if !live.is_empty() {
                        let l = live.swap_remove(rng.below(live.len() as u64) as usize);
                        l.check(&what);
                    }
                    if step % 500 == 0 {
                        let r = a.allocate(allowed as usize + 1, q.as_ref());
                        assert!(
                            matches!(r, Err(Error::AllocatorOom { .. })),
                            "{what}: a request past the allowed memory: {:?}",
                            r.map(|x| x.len())
                        );
                    }
                }
                drop(live);
                if let Some(q) = q {
                    q.synchronize().unwrap();
                }
            })
        })
        .collect();
    let chaos = {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                a.reset_peak_stats();
                if n % 16 == 0 {
                    a.empty_cache();
                }
                n += 1;
                std::thread::yield_now();
            }
        })
    };
    let mut first = None;
    for w in workers {
        if let Err(e) = w.join() {
            first.get_or_insert(e);
        }
    }
    stop.store(true, Ordering::Relaxed);
    chaos.join().unwrap();
    if let Some(e) = first {
        std::panic::resume_unwind(e);
    }
    settled(&a, "after the workers");
}

// ---------------------------------------------------------------------------------------------

/// Stitched views and home blocks of one queue's arena, each read (by a callback) on a gated
/// queue before it is recorded there and dropped on another thread, while two threads take
/// the same sizes on the same queue, write their own tags, and one of them lowers the memory
/// fraction and empties the cache (whose wait for the gated queue is cut short). A deferred
/// free applied early hands the units to those threads: the callbacks then read their tags.
#[test]
fn gated_recorded_views_keep_their_bytes_under_pressure() {
    let rounds = scaled(300);
    for round in 0..rounds {
        let a = Arc::new(allocator_waiting(CONF, 32 * MB, Duration::from_millis(5)));
        let q = Arc::new(Queue::new().unwrap());
        let g = Queue::new().unwrap();
        let gate = QueueGate::close(&g);
        let bad: Bad = Arc::new(Mutex::new(Vec::new()));
        let mut rng = Rng(0xBEEF + round as u64);
        // Fragment the arena: 4-unit blocks, every other one freed, then larger blocks that
        // must be stitched views over the holes.
        let small: Vec<Live> = (0..24).map(|_| Live::new(a.allocate(16 * KB, Some(&q)).unwrap())).collect();
        let mut keep = Vec::new();
        for (i, l) in small.into_iter().enumerate() {
            if i % 2 == 0 { keep.push(l) } else { drop(l) }
        }
        let mut recorded = Vec::new();
        for _ in 0..6 {
            let size = (8 + rng.below(8) as usize) * 4 * KB;
            let raw = rng.below(2) == 0;
            if raw {
                let p = a.allocate_raw(size, Some(&q)).unwrap();
                let x = Raw::new(p, size);
                check_later(&g, x.p, x.n, x.tag, &bad, "gated raw");
                a.record_queue_raw(p, &g).unwrap();
                recorded.push(Err(x));
            } else {
                let mut l = Live::new(a.allocate(size, Some(&q)).unwrap());
                check_later(&g, l.a.as_ptr() as usize, l.a.len(), l.tag, &bad, "gated allocation");
                l.a.record_queue(&g);
                recorded.push(Ok(l));
            }
        }
        // Keep-alive blocks also recorded (home blocks).
        for l in keep.iter_mut() {
            check_later(&g, l.a.as_ptr() as usize, l.a.len(), l.tag, &bad, "gated home block");
            l.a.record_queue(&g);
        }
        let start = Arc::new(Barrier::new(3));
        let dropper = {
            let (a, start) = (a.clone(), start.clone());
            let keep = std::mem::take(&mut keep);
            std::thread::spawn(move || {
                start.wait();
                for r in recorded {
                    match r {
                        Ok(l) => drop(l),
                        Err(x) => a.free_raw(x.p as *mut u8).unwrap(),
                    }
                }
                drop(keep);
            })
        };
        let takers: Vec<_> = (0..2)
            .map(|t| {
                let (a, q, start) = (a.clone(), q.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    let mut mine = Vec::new();
                    let mut rng = Rng(0x7A4E + t);
                    for i in 0..40 {
                        let size = (4 + rng.below(12) as usize) * 4 * KB;
                        if let Some(x) = ok_oom(a.allocate(size, Some(&q)), "taker") {
                            // Written whole: an early free is seen at either end.
                            x.cpu_access(dmabuf_rt::segment::Access::Write)
                                .unwrap()
                                .write(0, &vec![0x5A; x.len()])
                                .unwrap();
                            mine.push(Live::new(x));
                        }
                        if t == 1 && i % 10 == 5 {
                            a.set_memory_fraction(0.25).unwrap();
                            a.empty_cache();
                            a.set_memory_fraction(1.0).unwrap();
                        }
                        if mine.len() > 6 {
                            let l: Live = mine.remove(0);
                            l.check("taker");
                        }
                    }
                    for l in &mine {
                        l.check("taker at the end");
                    }
                })
            })
            .collect();
        for h in takers {
            h.join().unwrap();
        }
        dropper.join().unwrap();
        gate.open();
        g.synchronize().unwrap();
        q.synchronize().unwrap();
        if round == 0 {
            assert!(a.stats().num_remaps > 0, "the setup made no stitched view");
        }
        let bad = bad.lock().unwrap().clone();
        assert!(bad.is_empty(), "round {round}: recorded blocks changed before their queue passed: {bad:?}");
        settled(&a, &format!("round {round}"));
    }
}

// ---------------------------------------------------------------------------------------------

/// One thread, random arena and pool work with empty_cache, fraction changes (which make the
/// trim policy punch) and queues dropped: the snapshot's segments add up to the reserved bytes
/// (as `arena_snapshot` promises), never overlap, and the invariants hold.
#[test]
fn snapshot_adds_up_to_reserved_bytes() {
    let a = allocator(CONF, 64 * MB as u64);
    let mut rng = Rng(0x5A95);
    let mut queues: Vec<Queue> = (0..3).map(|_| Queue::new().unwrap()).collect();
    let mut live: Vec<(Live, usize)> = Vec::new();
    let mut raws: Vec<Raw> = Vec::new();
    for step in 0..scaled(6000) {
        let what = format!("step {step}");
        match rng.below(20) {
            0..=7 => {
                let qi = rng.below(queues.len() as u64 + 1) as usize;
                let q = queues.get(qi);
                if let Some(x) = ok_oom(a.allocate(size_of(&mut rng), q), &what) {
                    live.push((Live::new(x), qi));
                }
            }
            8..=9 => {
                let size = size_of(&mut rng);
                if let Some(p) = ok_oom(a.allocate_raw(size, queues.first()), &what) {
                    raws.push(Raw::new(p, size));
                }
            }
            10..=14 if !live.is_empty() => {
                let (l, _) = live.swap_remove(rng.below(live.len() as u64) as usize);
                l.check(&what);
            }
            15 if !raws.is_empty() => {
                let x = raws.swap_remove(rng.below(raws.len() as u64) as usize);
                x.check(&what);
                a.free_raw_sized(x.p as *mut u8, x.n).unwrap();
            }
            16 => a.set_memory_fraction([0.3, 0.6, 1.0][rng.below(3) as usize]).unwrap(),
            17 if step % 5 == 0 => a.empty_cache(),
            18 if step % 50 == 0 && queues.len() > 1 => {
                // Drop the last queue (its blocks stay live, freed later).
                let qi = queues.len() - 1;
                for (_, i) in live.iter_mut() {
                    if *i == qi {
                        *i = usize::MAX;
                    }
                }
                queues.pop();
                queues.push(Queue::new().unwrap());
            }
            _ => a.reset_peak_stats(),
        }
        a.check_invariants().unwrap_or_else(|e| panic!("{what}: invariants: {e}"));
        let total = snapshot_sane(&a, &what);
        let s = a.stats();
        assert_eq!(
            total as i64, s.reserved_bytes[AGGREGATE].current,
            "{what}: snapshot segments add up to {total}, reserved bytes are {}",
            s.reserved_bytes[AGGREGATE].current
        );
        peaks_hold(&s, &what);
    }
    for (l, _) in &live {
        l.check("end");
    }
    live.clear();
    for x in raws.drain(..) {
        x.check("end");
        a.free_raw(x.p as *mut u8).unwrap();
    }
    a.set_memory_fraction(1.0).unwrap();
    settled(&a, "end");
    drop(queues);
    a.empty_cache();
    settled(&a, "after empty_cache");
    assert_eq!(a.stats().reserved_bytes[AGGREGATE].current, 0);
    assert_eq!(snapshot_sane(&a, "empty"), 0);
}

// ---------------------------------------------------------------------------------------------

/// Raw stitched views and home blocks on three threads: each records its own blocks on a side
/// queue through interior pointers (any byte of what it asked for) and reads them with
/// `mem_at` from the middle, refusing a byte past the request, while the others free and
/// take blocks of the same queue's arena. An interior pointer never names another block
/// (recording it there would be accepted for the wrong block: a refusal must name it).
#[test]
fn interior_raw_calls_on_stitched_views_name_their_own_block() {
    let a = Arc::new(allocator(CONF, 128 * MB as u64));
    let q = Arc::new(Queue::new().unwrap());
    let iters = scaled(150000);
    let workers: Vec<_> = (0..3)
        .map(|t| {
            let (a, q) = (a.clone(), q.clone());
            std::thread::spawn(move || {
                let side = Queue::new().unwrap();
                let mut rng = Rng(0x1A7E + t as u64 * 101);
                let mut raws: Vec<Raw> = Vec::new();
                for step in 0..iters {
                    let what = format!("thread {t} step {step}");
                    if raws.len() < 12 && rng.below(2) == 0 {
                        let size = (4 + rng.below(24) as usize) * 4 * KB - rng.below(3000) as usize;
                        let p = a.allocate_raw(size, Some(&q)).unwrap();
                        raws.push(Raw::new(p, size));
                    } else if !raws.is_empty() {
                        let i = rng.below(raws.len() as u64) as usize;
                        let x = raws[i];
                        x.check(&what);
                        let off = rng.below(x.n as u64) as usize;
                        let p = (x.p + off) as *mut u8;
                        a.record_queue_raw(p, &side)
                            .unwrap_or_else(|e| panic!("{what}: record at +{off} of {}: {e}", x.n));
                        let m =
                            a.mem_at(p, x.n - off).unwrap_or_else(|e| panic!("{what}: mem_at +{off} of {}: {e}", x.n));
                        assert_eq!(m.len(), x.n - off, "{what}: mem_at length");
                        assert!(a.mem_at(p, x.n - off + 1).is_err(), "{what}: mem_at past the request at +{off}");
                        assert_eq!(a.raw_size(x.p as *mut u8).unwrap(), x.n, "{what}: raw_size");
                        if rng.below(2) == 0 {
                            raws.swap_remove(i);
                            a.free_raw_sized(x.p as *mut u8, x.n).unwrap_or_else(|e| panic!("{what}: free: {e}"));
                        }
                    }
                }
                for x in raws {
                    x.check("end");
                    a.free_raw(x.p as *mut u8).unwrap();
                }
                side.synchronize().unwrap();
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    q.synchronize().unwrap();
    assert!(a.stats().num_remaps > 0, "no stitched view was made");
    settled(&a, "end");
}
