//! Hostile review 38: the page-stitched arena's view eviction (address space full of cached
//! views while queues are gated and the trim policy punches other queues' arenas), the full
//! history toggled on and off under traffic, IPC holds of stitched views whose queue goes, and
//! queues dropped while stitched views recorded on them are live.

#![allow(unsafe_code)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use common::arena::{raw_mark, raw_verify};
use common::tags::{Bad, Live, Raw, check_later, settled};
use common::wait::wait_until;
use common::{QueueGate, Rng, allocator, allocator_waiting, scaled};
use dmabuf_rt::Error;
use dmabuf_rt::caching::HistoryKind;
use dmabuf_rt::caching::stats::AGGREGATE;
use dmabuf_rt::ipc::{IpcExporter, IpcImporter};
use dmabuf_rt::queue::Queue;
use dmabuf_rt::share::Channel;

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;
const CONF: &str = "page_stitching:True";

fn ok_oom<T>(r: Result<T, Error>, what: &str) -> Option<T> {
    match r {
        Ok(x) => Some(x),
        Err(Error::AllocatorOom { .. }) => None,
        Err(e) => panic!("{what}: refused with a wrong reason: {e}"),
    }
}

fn join_all(hs: Vec<std::thread::JoinHandle<()>>) {
    let mut first = None;
    for h in hs {
        if let Err(e) = h.join() {
            first.get_or_insert(e);
        }
    }
    if let Some(e) = first {
        std::panic::resume_unwind(e);
    }
}

// ---------------------------------------------------------------------------------------------

/// A 1 GiB (sparse) allocator: queue `q`'s arena holds four 64 MiB holes between live home
/// blocks, so every request of 256 MiB and a few units is a stitched view of 5+ runs (new
/// units each time: a cost, so the trim policy runs and punches the other arenas' free units).
/// Each request has a unit count no earlier one had, so its view is cached when freed and the
/// arena's view address space (8 GiB) fills after ~30: then the oldest cached views must go.
/// Meanwhile `q` is gated now and then (no view may go: a request either falls back and is an
/// OOM, or succeeds), some views are recorded on a gated side queue (read there by a callback
/// queued before), and a second thread churns queue `o`'s arena while `o` switches between
/// gated and idle, and a third flips the fraction and checks the invariants. Every live block
/// keeps its marks; once the gates open a view is made again; everything settles.
#[test]
fn views_evicted_for_address_space_while_queues_gate_and_arenas_are_punched() {
    let a = Arc::new(allocator_waiting(CONF, 1 << 30, Duration::from_millis(5)));
    let q = Queue::new().unwrap();
    let g = Queue::new().unwrap();
    let bad: Bad = Arc::new(Mutex::new(Vec::new()));
    let homes: Vec<Live> = (0..8).map(|_| Live::new(a.allocate(64 * MB, Some(&q)).unwrap())).collect();
    let mut keep = Vec::new();
    for (i, l) in homes.into_iter().enumerate() {
        if i % 2 == 0 { keep.push(l) } else { drop(l) }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(3));
    let other = {
        let (a, stop, start) = (a.clone(), stop.clone(), start.clone());
        std::thread::spawn(move || {
            let o = Queue::new().unwrap();
            let mut rng = Rng(0x0E0E);
            let mut live: Vec<Live> = Vec::new();
            start.wait();
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) || n < 50 {
                let gate = (n % 3 == 0).then(|| QueueGate::close(&o));
                for _ in 0..20 {
                    if (rng.below(2) == 0 || live.is_empty()) && live.len() < 12 {
                        let size = (4 + rng.below(2000) as usize) * 4 * KB;
                        if let Some(x) = ok_oom(a.allocate(size, Some(&o)), "other") {
                            live.push(Live::new(x));
                        }
                    } else {
                        let l = live.swap_remove(rng.below(live.len() as u64) as usize);
                        l.check("other");
                    }
                }
                for l in &live {
                    l.check("other, held");
                }
                drop(gate);
                o.synchronize().unwrap();
                n += 1;
            }
            for l in &live {
                l.check("other at the end");
            }
        })
    };
    let chaos = {
        let (a, stop, start) = (a.clone(), stop.clone(), start.clone());
        std::thread::spawn(move || {
            start.wait();
            let mut rng = Rng(0xC4A0);
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                match rng.below(4) {
                    0 => a.set_memory_fraction([0.9, 1.0][rng.below(2) as usize]).unwrap(),
                    1 => a.reset_peak_stats(),
                    2 if n % 8 == 0 => a.empty_cache(),
                    _ => a.check_invariants().unwrap_or_else(|e| panic!("chaos {n}: invariants: {e}")),
                }
                n += 1;
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    };
    start.wait();
    let mut rng = Rng(0x3838);
    let mut recorded: Vec<(Live, u32)> = Vec::new();
    let mut ooms = 0;
    let mut made_while_gated = 0;
    let iters = scaled(240);
    let mut k = 1usize;
    let mut gate_g = Some(QueueGate::close(&g));
    let mut deferred = false;
    for step in 0.. {
        // At least `iters` steps, and on until the views made fill the view space several
        // times over: under emulation (fewer steps, the other threads relatively faster) 30
        // steps made 72 remaps, too few to reach the eviction this test is about.
        if step >= iters && (a.stats().num_remaps > 400 || step >= 2000) {
            break;
        }
        let what = format!("step {step}");
        let gated = step % 7 >= 5;
        let gate = gated.then(|| QueueGate::close(&q));
        k = k % 900 + 1 + rng.below(3) as usize;
        let size = 256 * MB + k * 4 * KB;
        let remaps = a.stats().num_remaps;
        let res = a.allocate(size, Some(&q));
        let err = match &res {
            Err(e) => e.to_string(),
            Ok(_) => String::new(),
        };
        match ok_oom(res, &what) {
            Some(x) => {
                if gated {
                    made_while_gated += 1;
                }
                let tag = step as u32 + 1;
                raw_mark(x.as_ptr().wrapping_add(64), x.len() - 128, tag, MB);
                let l = Live::new(x);
                if step % 5 == 0 && recorded.is_empty() {
                    let mut l = l;
                    check_later(&g, l.a.as_ptr() as usize, l.a.len(), l.tag, &bad, "gated view");
                    l.a.record_queue(&g);
                    recorded.push((l, tag));
                } else {
                    raw_verify(l.a.as_ptr().wrapping_add(64), l.a.len() - 128, tag, MB, &what);
                    l.check(&what);
                }
            }
            None => {
                ooms += 1;
                assert!(
                    gated || deferred || !recorded.is_empty(),
                    "{what}: an OOM with nothing gated, remaps {remaps}: {err}"
                );
            }
        }
        for l in &keep {
            l.check(&what);
        }
        for (l, t) in &recorded {
            raw_verify(l.a.as_ptr().wrapping_add(64), l.a.len() - 128, *t, MB, &format!("{what}: recorded"));
        }
        if step % 23 == 22 {
            // Dropped while `g` is still gated: deferred frees.
            for (l, t) in recorded.drain(..) {
                raw_verify(
                    l.a.as_ptr().wrapping_add(64),
                    l.a.len() - 128,
                    t,
                    MB,
                    &format!("{what}: recorded, dropping"),
                );
                drop(l);
                deferred = true;
            }
            if step % 46 == 22 {
                // `g` passes (the deferred frees complete) and is gated again.
                drop(gate_g.take());
                g.synchronize().unwrap();
                deferred = false;
                gate_g = Some(QueueGate::close(&g));
            }
        }
        drop(gate);
        q.synchronize().unwrap();
    }
    for (l, t) in recorded.drain(..) {
        raw_verify(l.a.as_ptr().wrapping_add(64), l.a.len() - 128, t, MB, "recorded at the end");
    }
    drop(gate_g);
    g.synchronize().unwrap();
    // With every gate open the address space is free again for a view of a new size.
    let x = a.allocate(256 * MB + 997 * 4 * KB, Some(&q)).unwrap_or_else(|e| panic!("a view after the gates: {e}"));
    drop(x);
    stop.store(true, Ordering::Relaxed);
    join_all(vec![other, chaos]);
    let s = a.stats();
    eprintln!("ooms {ooms}, made while gated {made_while_gated}, remaps {}", s.num_remaps);
    assert!(s.num_remaps > 200, "too few views made: {}", s.num_remaps);
    let bad = bad.lock().unwrap().clone();
    assert!(bad.is_empty(), "recorded views changed before their queue passed: {bad:?}");
    for l in &keep {
        l.check("home at the end");
    }
    drop(keep);
    q.synchronize().unwrap();
    a.set_memory_fraction(1.0).unwrap();
    settled(&a, "end");
    a.empty_cache();
    settled(&a, "after empty_cache");
    assert_eq!(a.stats().reserved_bytes[AGGREGATE].current, 0, "reserved after empty_cache");
}

// ---------------------------------------------------------------------------------------------

fn size_of(rng: &mut Rng) -> usize {
    match rng.below(6) {
        0 => 16 + rng.below(8 * KB as u64) as usize,
        1 | 2 => (4 + rng.below(16) as usize) * 4 * KB - rng.below(4 * KB as u64) as usize,
        3 => 16 * KB,
        4 => 512 * KB + rng.below(512) as usize,
        _ => MB + rng.below(3 * MB as u64) as usize,
    }
}

/// The history is toggled by one thread (full history on: no fast free may skip it) while
/// three others allocate and free owned and raw blocks (owned ones also freed on another
/// thread). With the full history on, the toggler's own blocks (a home block, a small block, a
/// raw block, a pool block) each show an `Alloc` followed, at that address, by a
/// `FreeCompleted` (never by a second `Alloc` first); the history's clock never runs back;
/// everything settles. Page-stitched and classic modes.
fn history_toggled_under_traffic(conf: &str) {
    let a = Arc::new(allocator(conf, 256 * MB as u64));
    let stop = Arc::new(AtomicBool::new(false));
    let bin: Arc<Mutex<Vec<Live>>> = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..3)
        .map(|t| {
            let (a, stop, bin) = (a.clone(), stop.clone(), bin.clone());
            std::thread::spawn(move || {
                let q = (t > 0).then(|| Queue::new().unwrap());
                let mut rng = Rng(0x4157 + t as u64 * 77);
                let mut live: Vec<Live> = Vec::new();
                let mut raws: Vec<Raw> = Vec::new();
                let mut step = 0usize;
                while !stop.load(Ordering::Relaxed) || step < 2000 {
                    let what = format!("thread {t} step {step}");
                    match rng.below(6) {
                        0 | 1 => {
                            if let Some(x) = ok_oom(a.allocate(size_of(&mut rng), q.as_ref()), &what) {
                                live.push(Live::new(x));
                            }
                        }
                        2 => {
                            let n = size_of(&mut rng);
                            if let Some(p) = ok_oom(a.allocate_raw(n, q.as_ref()), &what) {
                                raws.push(Raw::new(p, n));
                            }
                        }
                        3 if !live.is_empty() => {
                            let l = live.swap_remove(rng.below(live.len() as u64) as usize);
                            l.check(&what);
                            if rng.below(3) == 0 {
                                let mut b = bin.lock().unwrap();
                                b.push(l);
                                if b.len() > 3 {
                                    let o = b.swap_remove(0);
                                    drop(b);
                                    o.check(&format!("{what}: traded"));
                                }
                            }
                        }
                        4 if !raws.is_empty() => {
                            let x = raws.swap_remove(rng.below(raws.len() as u64) as usize);
                            x.check(&what);
                            if rng.below(2) == 0 {
                                a.free_raw_sized(x.p as *mut u8, x.n).unwrap_or_else(|e| panic!("{what}: {e}"));
                            } else {
                                a.free_raw(x.p as *mut u8).unwrap_or_else(|e| panic!("{what}: {e}"));
                            }
                        }
                        _ => {
                            if live.len() > 40 {
                                live.drain(..20);
                            }
                        }
                    }
                    if step % 16 == 0 {
                        for l in &live {
                            l.check(&what);
                        }
                        for x in &raws {
                            x.check(&what);
                        }
                    }
                    step += 1;
                }
                for l in &live {
                    l.check("end");
                }
                drop(live);
                for x in raws {
                    x.check("raw end");
                    a.free_raw(x.p as *mut u8).unwrap();
                }
                if let Some(q) = q {
                    q.synchronize().unwrap();
                }
            })
        })
        .collect();
    let rounds = scaled(3000);
    let mut last_t = 0u64;
    let mut checked = 0;
    for round in 0..rounds {
        let on = round % 2 == 0;
        a.record_history(on);
        if on {
            // The toggler's own blocks, allocated and freed while the full history is on.
            let t0 = a.history().last().map_or(0, |e| e.t_ns);
            let sizes = [6 * 4 * KB, 20 * KB, 700 * KB];
            let mut mine: Vec<(usize, usize)> = Vec::new();
            for &s in &sizes {
                // Classic pools may be too fragmented for it (an OOM is the only refusal).
                let Some(x) = ok_oom(a.allocate(s, None), "toggler") else { continue };
                let l = Live::new(x);
                mine.push((l.a.as_ptr() as usize, s));
                l.check("toggler");
            }
            let n = 5 * 4 * KB + 100;
            if let Some(p) = ok_oom(a.allocate_raw(n, None), "toggler raw") {
                let r = Raw::new(p, n);
                r.check("toggler raw");
                a.free_raw(p).unwrap();
                mine.push((r.p, n));
            }
            let h = a.history();
            // The bounded history may have dropped events since `t0` (the other threads log
            // too): nothing to check then.
            let whole = h.first().is_some_and(|e| e.t_ns <= t0);
            for (addr, s) in mine.into_iter().filter(|_| whole) {
                // The Alloc/FreeCompleted events at this address since `t0`: past a leading
                // free (a block allocated before the history was on), they alternate, and
                // this block's pair is among them.
                let ev: Vec<_> = h
                    .iter()
                    .filter(|e| {
                        e.t_ns > t0
                            && e.addr == addr
                            && matches!(e.kind, HistoryKind::Alloc | HistoryKind::FreeCompleted)
                    })
                    .collect();
                let from = ev
                    .iter()
                    .position(|e| e.kind == HistoryKind::Alloc)
                    .unwrap_or_else(|| panic!("round {round}: no Alloc of the {s}-byte block at {addr:#x}: {ev:?}"));
                for (i, e) in ev[from..].iter().enumerate() {
                    let want = if i % 2 == 0 { HistoryKind::Alloc } else { HistoryKind::FreeCompleted };
                    assert_eq!(e.kind, want, "round {round}: events at {addr:#x} ({s} bytes) do not alternate: {ev:?}");
                }
                assert!(
                    ev[from..].len() >= 2,
                    "round {round}: the free of the {s}-byte block at {addr:#x} is missing from the full history: {ev:?}"
                );
                checked += 1;
            }
        }
        let h = a.history();
        for w in h.windows(2) {
            assert!(w[0].t_ns <= w[1].t_ns, "round {round}: history runs back: {:?} then {:?}", w[0], w[1]);
        }
        if let Some(e) = h.last() {
            assert!(e.t_ns >= last_t, "round {round}: history's last event older than before");
            last_t = e.t_ns;
        }
        if round % 50 == 0 {
            a.check_invariants().unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
    }
    a.record_history(false);
    stop.store(true, Ordering::Relaxed);
    join_all(workers);
    for l in bin.lock().unwrap().drain(..) {
        l.check("bin");
    }
    assert!(checked > 0);
    settled(&a, &format!("{conf}: end"));
    a.empty_cache();
    settled(&a, &format!("{conf}: after empty_cache"));
}

#[test]
fn full_history_toggled_under_traffic_stitched() {
    history_toggled_under_traffic(CONF);
}

#[test]
fn full_history_toggled_under_traffic_classic() {
    history_toggled_under_traffic("expandable_segments:False");
}

// ---------------------------------------------------------------------------------------------

/// A stitched view exported (in-process channel pair) and opened, then freed by its producer
/// while its queue is dropped, the cache emptied and the fraction lowered, and two threads
/// take blocks of the same sizes on new queues and write them whole. The imported block keeps
/// the producer's bytes until it is dropped; then limbo empties and everything settles.
#[test]
fn an_exported_stitched_view_survives_its_queue_empty_cache_and_a_lower_fraction() {
    let rounds = scaled(40);
    for round in 0..rounds {
        let a = Arc::new(allocator(CONF, 64 * MB as u64));
        let (ca, cb) = Channel::pair("r38").unwrap();
        let (exp, imp) = (IpcExporter::new(ca).unwrap(), IpcImporter::new(cb));
        let q = Queue::new().unwrap();
        let small: Vec<Live> = (0..16).map(|_| Live::new(a.allocate(MB, Some(&q)).unwrap())).collect();
        let mut keep = Vec::new();
        for (i, l) in small.into_iter().enumerate() {
            if i % 2 == 0 { keep.push(l) } else { drop(l) }
        }
        let remaps = a.stats().num_remaps;
        let size = 3 * MB + (round % 7 + 1) * 4 * KB;
        let x = a.allocate(size, Some(&q)).unwrap();
        assert!(a.stats().num_remaps > remaps, "round {round}: the block is not a stitched view");
        assert!(x.fd_ranges().len() > 1, "round {round}: one run");
        let seed = round as u8;
        common::fill_pattern(&x, seed);
        let h = exp.export(&x, if round % 2 == 0 { Some(&q) } else { None }).unwrap();
        let got = imp.open(&h).unwrap();
        got.wait_ready(Some(Duration::from_secs(10))).unwrap();
        let want = common::pattern(size, seed);
        let mut buf = vec![0u8; size];
        got.read(0, &mut buf).unwrap();
        assert!(buf == want, "round {round}: imported bytes differ at once: {}", common::summary(&buf));
        let start = Arc::new(Barrier::new(3));
        let takers: Vec<_> = (0..2)
            .map(|t| {
                let (a, start) = (a.clone(), start.clone());
                std::thread::spawn(move || {
                    let q2 = Queue::new().unwrap();
                    start.wait();
                    let mut mine = Vec::new();
                    let mut rng = Rng(0x1234 + t);
                    for _ in 0..30 {
                        let s = (1 + rng.below(4) as usize) * MB - rng.below(4096) as usize;
                        let qq = if rng.below(2) == 0 { Some(&q2) } else { None };
                        if let Some(y) = ok_oom(a.allocate(s, qq), "taker") {
                            y.cpu_access(dmabuf_rt::segment::Access::Write)
                                .unwrap()
                                .write(0, &vec![0x5A; y.len()])
                                .unwrap();
                            mine.push(Live::new(y));
                        }
                        if mine.len() > 4 {
                            mine.remove(0).check("taker");
                        }
                    }
                    for l in &mine {
                        l.check("taker end");
                    }
                    drop(mine);
                    q2.synchronize().unwrap();
                })
            })
            .collect();
        start.wait();
        drop(x);
        assert!(a.stats().limbo_bytes.current > 0, "round {round}: the exported block is not in limbo");
        drop(q);
        a.empty_cache();
        a.set_memory_fraction(0.4).unwrap();
        drop(keep.drain(..4).collect::<Vec<_>>());
        a.empty_cache();
        join_all(takers);
        got.read(0, &mut buf).unwrap();
        assert!(
            buf == want,
            "round {round}: imported bytes changed after the producer's free: {}",
            common::summary(&buf)
        );
        a.check_invariants().unwrap_or_else(|e| panic!("round {round}: {e}"));
        drop(got);
        drop(keep);
        wait_until("the release", Duration::from_secs(10), || {
            let _ = imp.poll();
            a.stats().limbo_bytes.current == 0 && exp.held() == 0
        });
        a.set_memory_fraction(1.0).unwrap();
        settled(&a, &format!("round {round}"));
        a.empty_cache();
        assert_eq!(a.stats().reserved_bytes[AGGREGATE].current, 0, "round {round}: reserved after empty_cache");
    }
}

// ---------------------------------------------------------------------------------------------

/// Stitched views and home blocks allocated on queues that are dropped while the blocks are
/// live (some recorded on a second queue that is dropped too, after work queued on it), then
/// freed on other threads while new queues' blocks take the same sizes (the dropped queue's
/// key may be reused by a new queue). Tags hold, invariants hold, everything settles and
/// `empty_cache` gives everything back.
#[test]
fn queues_dropped_under_live_stitched_views() {
    let a = Arc::new(allocator(CONF, 128 * MB as u64));
    let rounds = scaled(60);
    let free_count = Arc::new(AtomicUsize::new(0));
    for round in 0..rounds {
        let mut rng = Rng(0x9D + round as u64);
        let q = Queue::new().unwrap();
        let r = Queue::new().unwrap();
        let small: Vec<Live> = (0..24).map(|_| Live::new(a.allocate(64 * KB, Some(&q)).unwrap())).collect();
        let mut keep = Vec::new();
        for (i, l) in small.into_iter().enumerate() {
            if i % 2 == 0 { keep.push(l) } else { drop(l) }
        }
        let mut views = Vec::new();
        for _ in 0..4 {
            let s = (20 + rng.below(20) as usize) * 4 * KB;
            let mut l = Live::new(a.allocate(s, Some(&q)).unwrap());
            if rng.below(2) == 0 {
                l.a.record_queue(&r);
            }
            views.push(l);
        }
        let mut raws = Vec::new();
        for _ in 0..2 {
            let s = (20 + rng.below(20) as usize) * 4 * KB;
            let p = a.allocate_raw(s, Some(&q)).unwrap();
            a.record_queue_raw(p, &r).unwrap();
            raws.push(Raw::new(p, s));
        }
        // Work on both queues, then both dropped with the blocks live.
        let (sa, sb) = (a.clone(), a.clone());
        q.callback(move |_| {
            std::hint::black_box(sa.stats().num_remaps);
        })
        .unwrap();
        r.callback(move |_| {
            std::hint::black_box(sb.stats().num_remaps);
        })
        .unwrap();
        drop(r);
        drop(q);
        let start = Arc::new(Barrier::new(4));
        let freer = {
            let (a, start, fc) = (a.clone(), start.clone(), free_count.clone());
            std::thread::spawn(move || {
                start.wait();
                for l in views {
                    l.check("view before free");
                    drop(l);
                    fc.fetch_add(1, Ordering::Relaxed);
                }
                for x in raws {
                    x.check("raw before free");
                    a.free_raw(x.p as *mut u8).unwrap();
                }
                for l in keep {
                    l.check("home before free");
                }
            })
        };
        let takers: Vec<_> = (0..2)
            .map(|t| {
                let (a, start) = (a.clone(), start.clone());
                std::thread::spawn(move || {
                    let nq = Queue::new().unwrap();
                    start.wait();
                    let mut rng = Rng(0x55 + t);
                    let mut mine = Vec::new();
                    for _ in 0..30 {
                        let s = (4 + rng.below(36) as usize) * 4 * KB;
                        if let Some(y) = ok_oom(a.allocate(s, Some(&nq)), "taker") {
                            mine.push(Live::new(y));
                        }
                        if mine.len() > 5 {
                            mine.remove(0).check("taker");
                        }
                        if t == 1 && rng.below(10) == 0 {
                            a.empty_cache();
                        }
                    }
                    for l in &mine {
                        l.check("taker end");
                    }
                    drop(mine);
                    nq.synchronize().unwrap();
                })
            })
            .collect();
        start.wait();
        let mut hs = takers;
        hs.push(freer);
        join_all(hs);
        a.check_invariants().unwrap_or_else(|e| panic!("round {round}: {e}"));
        settled(&a, &format!("round {round}"));
        a.empty_cache();
        assert_eq!(
            a.stats().reserved_bytes[AGGREGATE].current,
            0,
            "round {round}: reserved after the queues went and empty_cache"
        );
    }
    assert!(a.stats().num_remaps > 0);
}
