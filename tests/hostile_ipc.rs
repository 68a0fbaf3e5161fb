//! Hostile review of `dmabuf_rt::ipc` and the allocator's limbo: a careless multi-threaded
//! user and a hostile peer. Covers the exporter stalling releases while a send blocks (a
//! deadlock with an importer that releases), the same block exported twice, a peer releasing
//! twice or releasing what it never had, deferred frees (`record_queue`, `record_queue_raw`)
//! of held blocks, `free_raw_sized` of a block in limbo, `empty_cache` with blocks in limbo,
//! the allocator dropped while exports are outstanding, imports racing the exporter's drop,
//! and export/free/release/empty_cache from many threads at once (stale reads, limbo
//! accounting and `check_invariants`).

mod common;

use common::wait::{wait_until, within};
use common::{fill_pattern, pattern};

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use dmabuf_rt::Error;
use dmabuf_rt::caching::stats::AGGREGATE;
use dmabuf_rt::caching::{CachingAllocator, Config};
use dmabuf_rt::ipc::{IpcExporter, IpcImporter};
use dmabuf_rt::queue::Queue;
use dmabuf_rt::share::Channel;
use dmabuf_rt::source::ShmemSource;

/// How long the bounded waits of this file wait: 10 s, times the stress time scale (the kernel
/// lane's emulated machine is several times slower).
fn wait() -> Duration {
    Duration::from_secs(10) * common::time_scale()
}

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;

fn limbo(a: &CachingAllocator) -> i64 {
    a.stats().limbo_bytes.current
}

fn pair() -> (IpcExporter, IpcImporter) {
    let (a, b) = Channel::pair("hostile ipc").unwrap();
    (IpcExporter::new(a).unwrap(), IpcImporter::new(b))
}

/// A RELEASE packet as the wire carries it (tag 3, 0, export).
fn release_packet(export: u64) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&export.to_le_bytes());
    b
}

/// A queue whose executor is blocked until the returned sender is dropped or sent to.
fn blocked_queue() -> (Queue, mpsc::Sender<()>) {
    let q = Queue::new().unwrap();
    let (tx, rx) = mpsc::channel::<()>();
    q.callback(move |_| {
        let _ = rx.recv();
    })
    .unwrap();
    (q, tx)
}

// ---------------------------------------------------------------------------------------------

/// The exporter sends SHARE packets with its state lock held, and `send` blocks when the peer's
/// receive buffer is full; the release reader needs that same lock for every RELEASE. An
/// importer that drops many blocks (RELEASE sends, which block once the exporter's receive
/// buffer is full) before it opens the next ones (which drain the exporter's SHAREs) then
/// deadlocks with a producer that keeps exporting: the producer waits for the importer to read,
/// the importer for the reader thread, the reader thread for the producer's lock. (`held()`
/// and `peer_gone()` block too.)
#[test]
fn releases_are_not_stalled_by_an_export_blocked_on_a_full_channel() {
    within("an importer releasing while the producer exports", wait() * 3, || {
        let a = Arc::new(common::allocator("", 256 * MB as u64));
        let (exp, imp) = pair();
        let (exp, imp) = (Arc::new(exp), Arc::new(imp));
        // Batch 1: exported and opened (the importer holds them).
        let first: Vec<_> = (0..3000).map(|_| a.allocate(512, None).unwrap()).collect();
        let opened: Vec<_> = first.iter().map(|x| imp.open(&exp.export(x, None).unwrap()).unwrap()).collect();
        // Batch 2: exported on another thread, handles passed to the importer. (What was sent
        // is counted from before the thread starts: it may fill the socket before this thread
        // looks, and then send nothing more until the importer reads.)
        let start = exp.channel().bytes_sent();
        let (htx, hrx) = mpsc::channel();
        let producer = {
            let (a, exp) = (Arc::clone(&a), Arc::clone(&exp));
            std::thread::spawn(move || {
                let mut keep = Vec::new();
                for _ in 0..3000 {
                    let x = a.allocate(512, None).unwrap();
                    htx.send(exp.export(&x, None).unwrap()).unwrap();
                    keep.push(x);
                }
                keep
            })
        };
        // Once the producer is under way, the importer lets go of batch 1, then opens batch 2.
        // 20 shares (56 bytes each), far fewer than a socket buffer holds.
        while exp.channel().bytes_sent() < start + 20 * 56 {
            std::thread::yield_now();
        }
        drop(opened);
        let mut second = Vec::new();
        for h in hrx {
            second.push(imp.open(&h).unwrap());
        }
        let keep = producer.join().unwrap();
        assert_eq!(second.len(), 3000);
        drop((first, keep, second));
        let deadline = Instant::now() + wait();
        while exp.held() != 0 {
            assert!(Instant::now() < deadline, "releases never applied");
            std::thread::yield_now();
        }
        a.check_invariants().unwrap();
    });
}

/// The same block exported twice (two holds): the first release keeps it in limbo, the
/// second frees it; its bytes hold meanwhile.
#[test]
fn a_block_exported_twice_stays_in_limbo_until_both_are_released() {
    let a = common::allocator("", 64 * MB as u64);
    let (exp, imp) = pair();
    let x = a.allocate(40 * KB, None).unwrap();
    fill_pattern(&x, 11);
    let (h1, h2) = (exp.export(&x, None).unwrap(), exp.export(&x, None).unwrap());
    assert_ne!(h1.export, h2.export);
    let (g1, g2) = (imp.open(&h1).unwrap(), imp.open(&h2).unwrap());
    let size = 40 * KB as i64;
    drop(x);
    assert_eq!(limbo(&a), size);
    a.check_invariants().unwrap();
    drop(g1);
    wait_until("one release", wait(), || exp.held() == 1);
    assert_eq!(limbo(&a), size, "one of two holds released the block");
    let churn: Vec<_> = (0..16).map(|_| a.allocate(40 * KB, None).unwrap()).collect();
    for y in &churn {
        fill_pattern(y, 0x55);
    }
    let mut v = vec![0; 40 * KB];
    g2.read(0, &mut v).unwrap();
    assert!(v == pattern(40 * KB, 11), "a block still held once was reused");
    a.check_invariants().unwrap();
    drop(g2);
    wait_until("both releases", wait(), || exp.held() == 0 && limbo(&a) == 0);
    a.check_invariants().unwrap();
}

/// A hostile peer releases an export twice and releases exports it never had: only the real
/// hold goes, the other export of the same block keeps it in limbo, nothing panics.
#[test]
fn a_peer_releasing_twice_or_unknown_exports_frees_nothing_else() {
    let a = common::allocator("", 64 * MB as u64);
    let (mine, theirs) = Channel::pair("hostile peer").unwrap();
    let exp = IpcExporter::new(mine).unwrap();
    let x = a.allocate(8 * KB, None).unwrap();
    let y = a.allocate(8 * KB, None).unwrap();
    let (h1, h2, h3) = (exp.export(&x, None).unwrap(), exp.export(&x, None).unwrap(), exp.export(&y, None).unwrap());
    drop((x, y));
    assert_eq!(limbo(&a), 16 * KB as i64);
    for e in [h1.export, h1.export, 0, u64::MAX, 12345, h1.export] {
        theirs.send_bytes(&release_packet(e), &[]).unwrap();
    }
    // y's release comes last: once it is applied, everything before it was too.
    theirs.send_bytes(&release_packet(h3.export), &[]).unwrap();
    wait_until("y's release", wait(), || exp.held() == 1);
    assert!(exp.peer_gone().is_none(), "{:?}", exp.peer_gone());
    assert_eq!(limbo(&a), 8 * KB as i64, "x is held by export {} still", h2.export);
    a.check_invariants().unwrap();
    drop(theirs);
    wait_until("the hang-up", wait(), || exp.held() == 0 && limbo(&a) == 0);
    a.check_invariants().unwrap();
}

/// A shared block freed after `record_queue` on a busy queue: the free waits for the queue
/// and for the importer, in either order, and the block is not reused before both.
#[test]
fn a_deferred_free_of_a_shared_block_waits_for_the_queue_and_the_importer() {
    for release_first in [false, true] {
        let a = common::allocator("", 64 * MB as u64);
        let (exp, imp) = pair();
        let (q, go) = blocked_queue();
        let mut x = a.allocate(64 * KB, None).unwrap();
        fill_pattern(&x, 21);
        let addr = x.as_ptr();
        let got = imp.open(&exp.export(&x, None).unwrap()).unwrap();
        x.record_queue(&q);
        drop(x);
        a.check_invariants().unwrap();
        let again: Vec<_> = (0..4).map(|_| a.allocate(64 * KB, None).unwrap()).collect();
        assert!(again.iter().all(|y| y.as_ptr() != addr), "reused while the queue and importer hold it");
        if release_first {
            drop(got);
            wait_until("the release", wait(), || exp.held() == 0);
            a.check_invariants().unwrap();
            assert_eq!(limbo(&a), 0, "not freed yet here, so not in limbo");
            drop(go);
            q.synchronize().unwrap();
            wait_until("the deferred free", wait(), || {
                a.check_invariants().unwrap();
                a.stats().active_bytes[AGGREGATE].current == 4 * 64 * KB as i64
            });
        } else {
            drop(go);
            q.synchronize().unwrap();
            wait_until("limbo", wait(), || limbo(&a) == 64 * KB as i64);
            a.check_invariants().unwrap();
            let mut v = vec![0; 64 * KB];
            got.read(0, &mut v).unwrap();
            assert!(v == pattern(64 * KB, 21));
            drop(got);
            wait_until("the release", wait(), || exp.held() == 0 && limbo(&a) == 0);
        }
        a.check_invariants().unwrap();
        drop(again);
        a.empty_cache();
        assert_eq!(a.stats().active_bytes[AGGREGATE].current, 0);
        assert_eq!(a.stats().reserved_bytes[AGGREGATE].current, 0, "a segment stuck after the limbo");
    }
}

/// The raw API: a held raw block freed with a busy queue recorded (deferred), then freed again
/// (refused), then the queue passes (limbo), then the release.
#[test]
fn a_raw_deferred_free_of_a_shared_block_goes_through_limbo() {
    let a = common::allocator("", 64 * MB as u64);
    let (exp, imp) = pair();
    let (q, go) = blocked_queue();
    let p = a.allocate_raw(32 * KB, None).unwrap();
    let got = imp.open(&exp.export_raw(&a, p, None).unwrap()).unwrap();
    a.record_queue_raw(p, &q).unwrap();
    a.free_raw(p).unwrap();
    assert!(a.free_raw(p).is_err(), "a second free of a deferred held raw block");
    a.check_invariants().unwrap();
    drop(go);
    q.synchronize().unwrap();
    wait_until("limbo", wait(), || limbo(&a) == 32 * KB as i64);
    a.check_invariants().unwrap();
    assert!(a.free_raw(p).unwrap_err().to_string().contains("limbo"));
    drop(got);
    wait_until("the release", wait(), || exp.held() == 0 && limbo(&a) == 0);
    a.check_invariants().unwrap();
    assert_eq!(a.stats().active_bytes[AGGREGATE].current, 0);
}

/// `free_raw_sized` promises `free_raw`'s refusal for anything but a size mismatch: of a raw
/// block in limbo, it should name the limbo as `free_raw` does, and change nothing.
#[test]
fn free_raw_sized_of_a_block_in_limbo_is_refused_as_free_raw_refuses_it() {
    let a = common::allocator("", 64 * MB as u64);
    let (exp, imp) = pair();
    let p = a.allocate_raw(16 * KB, None).unwrap();
    let got = imp.open(&exp.export_raw(&a, p, None).unwrap()).unwrap();
    a.free_raw_sized(p, 16 * KB).unwrap();
    assert_eq!(limbo(&a), 16 * KB as i64);
    let plain = a.free_raw(p).unwrap_err().to_string();
    let sized = a.free_raw_sized(p, 16 * KB).unwrap_err().to_string();
    assert!(plain.contains("limbo"), "{plain}");
    assert!(sized.contains("limbo"), "free_raw_sized says {sized:?}, free_raw says {plain:?}");
    assert_eq!(limbo(&a), 16 * KB as i64);
    a.check_invariants().unwrap();
    drop(got);
    wait_until("the release", wait(), || limbo(&a) == 0);
    a.check_invariants().unwrap();
}

/// `empty_cache` with blocks in limbo: their segments stay (the importer's bytes hold), and
/// once released they go with the next `empty_cache`.
#[test]
fn empty_cache_leaves_blocks_in_limbo_alone() {
    let a = common::allocator("", 64 * MB as u64);
    let (exp, imp) = pair();
    let sizes = [4 * KB, 100 * KB + 3, 3 * MB];
    let xs: Vec<_> = sizes.iter().map(|&n| a.allocate(n, None).unwrap()).collect();
    let mut got = Vec::new();
    for (i, x) in xs.iter().enumerate() {
        fill_pattern(x, 40 + i as u8);
        got.push(imp.open(&exp.export(x, None).unwrap()).unwrap());
    }
    drop(xs);
    let held = limbo(&a);
    assert!(held > 0);
    for _ in 0..3 {
        a.empty_cache();
        let ys: Vec<_> = sizes.iter().map(|&n| a.allocate(n, None).unwrap()).collect();
        for y in &ys {
            fill_pattern(y, 0xEE);
        }
        a.check_invariants().unwrap();
    }
    a.empty_cache();
    assert_eq!(limbo(&a), held);
    for (i, g) in got.iter().enumerate() {
        let mut v = vec![0; g.len()];
        g.read(0, &mut v).unwrap();
        assert!(v == pattern(g.len(), 40 + i as u8), "block {i} changed under empty_cache");
    }
    drop(got);
    wait_until("the releases", wait(), || limbo(&a) == 0 && exp.held() == 0);
    a.empty_cache();
    a.check_invariants().unwrap();
    let s = a.stats();
    assert_eq!(s.active_bytes[AGGREGATE].current, 0);
    assert_eq!(s.reserved_bytes[AGGREGATE].current, 0, "a released limbo block kept its segment");
}

/// The allocator and its blocks dropped while exports are outstanding: the importer's bytes
/// hold, and the late releases (on the reader thread) neither panic nor hang.
#[test]
fn the_allocator_dropped_while_exports_are_outstanding() {
    let a = common::allocator("", 64 * MB as u64);
    let (exp, imp) = pair();
    let xs: Vec<_> = [2 * KB, 64 * KB, 5 * MB].iter().map(|&n| a.allocate(n, None).unwrap()).collect();
    let mut got = Vec::new();
    for (i, x) in xs.iter().enumerate() {
        fill_pattern(x, 60 + i as u8);
        got.push(imp.open(&exp.export(x, None).unwrap()).unwrap());
    }
    drop(xs);
    drop(a);
    for (i, g) in got.iter().enumerate() {
        let mut v = vec![0; g.len()];
        g.read(0, &mut v).unwrap();
        assert!(v == pattern(g.len(), 60 + i as u8), "block {i} lost after the allocator's drop");
    }
    drop(got);
    wait_until("the releases", wait(), || exp.held() == 0);
    assert!(exp.peer_gone().is_none());
    within("the exporter's drop", wait() * 2, move || drop((exp, imp)));
}

/// Opens racing the exporter's drop: each open either works or says the peer is gone, and
/// after the drop every hold is released.
#[test]
fn opens_racing_the_exporters_drop_are_clean() {
    let a = common::allocator("", 64 * MB as u64);
    let (exp, imp) = pair();
    let xs: Vec<_> = (0..200).map(|_| a.allocate(4 * KB, None).unwrap()).collect();
    let hs: Vec<_> = xs.iter().map(|x| exp.export(x, None).unwrap()).collect();
    drop(xs);
    assert_eq!(limbo(&a), 200 * 4 * KB as i64);
    let started = Arc::new(AtomicBool::new(false));
    let dropper = {
        let started = Arc::clone(&started);
        std::thread::spawn(move || {
            while !started.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
            drop(exp);
        })
    };
    let mut opened = Vec::new();
    let mut gone = 0;
    for (i, h) in hs.iter().enumerate() {
        if i == 20 {
            started.store(true, Ordering::Release);
        }
        match imp.open(h) {
            Ok(b) => opened.push(b),
            Err(Error::PeerGone { .. }) => gone += 1,
            Err(e) => panic!("open {i}: {e}"),
        }
    }
    dropper.join().unwrap();
    assert!(opened.len() >= 20);
    assert_eq!(opened.len() + gone, 200);
    wait_until("the exporter's releases", wait(), || limbo(&a) == 0);
    a.check_invariants().unwrap();
    drop(opened);
    assert!(matches!(imp.open(&hs[0]), Err(Error::PeerGone { .. }) | Err(Error::InvalidArgument { .. })));
}

/// Several threads export, free, re-allocate over, verify and release at once, with
/// `empty_cache` and stats on another: no import ever sees another block's bytes, and the
/// limbo ends empty and consistent.
#[test]
fn export_free_release_from_many_threads_never_shows_stale_bytes() {
    let a = Arc::new(common::allocator("", 256 * MB as u64));
    let (exp, imp) = pair();
    let (exp, imp) = (Arc::new(exp), Arc::new(imp));
    let stop = Arc::new(AtomicBool::new(false));
    let bad = Arc::new(AtomicUsize::new(0));
    let churner = {
        let (a, stop) = (Arc::clone(&a), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                a.empty_cache();
                let _ = a.stats();
                a.check_invariants().unwrap();
                std::thread::yield_now();
            }
        })
    };
    let workers: Vec<_> = (0..4u8)
        .map(|t| {
            let (a, exp, imp, bad) = (Arc::clone(&a), Arc::clone(&exp), Arc::clone(&imp), Arc::clone(&bad));
            std::thread::spawn(move || {
                let sizes = [512, 3 * KB, 20 * KB, 100 * KB + 9, MB + 1];
                for r in 0..60usize {
                    let n = sizes[(r + t as usize) % sizes.len()];
                    let tag = t.wrapping_mul(50).wrapping_add(r as u8);
                    let x = a.allocate(n, None).unwrap();
                    fill_pattern(&x, tag);
                    let h = exp.export(&x, None).unwrap();
                    // Sometimes twice.
                    let h2 = (r % 7 == 0).then(|| exp.export(&x, None).unwrap());
                    let g = imp.open(&h).unwrap();
                    let g2 = h2.map(|h| imp.open(&h).unwrap());
                    drop(x);
                    let over: Vec<_> = (0..3).map(|_| a.allocate(n, None).unwrap()).collect();
                    for y in &over {
                        fill_pattern(y, !tag);
                    }
                    let mut v = vec![0; n];
                    g.read(0, &mut v).unwrap();
                    if v != pattern(n, tag) {
                        bad.fetch_add(1, Ordering::Relaxed);
                    }
                    drop(g);
                    if let Some(g2) = g2 {
                        g2.read(0, &mut v).unwrap();
                        if v != pattern(n, tag) {
                            bad.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Release);
    churner.join().unwrap();
    assert_eq!(bad.load(Ordering::Relaxed), 0, "an import read a block that was reused");
    wait_until("every release", wait(), || exp.held() == 0 && limbo(&a) == 0);
    a.check_invariants().unwrap();
    a.empty_cache();
    let s = a.stats();
    assert_eq!(s.active_bytes[AGGREGATE].current, 0);
    assert_eq!(s.reserved_bytes[AGGREGATE].current, 0);
}

/// A block in limbo whose queue is dropped meanwhile (its segment is to go once free): the
/// release frees the block and then lets the gone queue's segment go, consistently.
#[test]
fn a_block_in_limbo_of_a_dropped_queue() {
    let a = common::allocator("", 64 * MB as u64);
    let (exp, imp) = pair();
    let q = Queue::new().unwrap();
    let xs: Vec<_> = [4 * KB, 64 * KB, 3 * MB].iter().map(|&n| a.allocate(n, Some(&q)).unwrap()).collect();
    let mut got = Vec::new();
    for (i, x) in xs.iter().enumerate() {
        fill_pattern(x, 80 + i as u8);
        got.push(imp.open(&exp.export(x, Some(&q)).unwrap()).unwrap());
    }
    drop(xs);
    drop(q);
    let _ = a.stats();
    a.check_invariants().unwrap();
    let others: Vec<_> = (0..4).map(|_| a.allocate(64 * KB, None).unwrap()).collect();
    for y in &others {
        fill_pattern(y, 0x77);
    }
    for (i, g) in got.iter().enumerate() {
        let mut v = vec![0; g.len()];
        g.read(0, &mut v).unwrap();
        assert!(v == pattern(g.len(), 80 + i as u8), "block {i} of the dropped queue changed while held");
    }
    drop(got);
    wait_until("the releases", wait(), || exp.held() == 0 && limbo(&a) == 0);
    a.check_invariants().unwrap();
    drop(others);
    a.empty_cache();
    a.check_invariants().unwrap();
    let s = a.stats();
    assert_eq!(s.active_bytes[AGGREGATE].current, 0);
    assert_eq!(s.reserved_bytes[AGGREGATE].current, 0, "the dropped queue's segment stayed");
}

/// The limbo under other settings (classic segments, no page stitching, a max_split_size
/// of 21 MB so a 24 MB block is oversize): not reused while held, accounted, released.
#[test]
fn the_limbo_under_other_settings() {
    for conf in [
        "expandable_segments:False",
        "page_stitching:False",
        "max_split_size_mb:21",
        "garbage_collection_threshold:0.5",
    ] {
        let a = CachingAllocator::builder(ShmemSource::new().reserve(false))
            .config(Config::parse(conf).unwrap())
            .capacity(256 * MB as u64)
            .build()
            .unwrap();
        let (exp, imp) = pair();
        for n in [2 * KB, 40 * KB, 4 * MB + 1, 24 * MB + 1] {
            let x = a.allocate(n, None).unwrap();
            fill_pattern(&x, 7);
            let h = exp.export(&x, None).unwrap();
            let got = imp.open(&h).unwrap();
            let addr = x.as_ptr();
            drop(x);
            assert!(limbo(&a) >= n as i64, "{conf} {n}");
            a.check_invariants().unwrap_or_else(|e| panic!("{conf} {n}: {e}"));
            a.empty_cache();
            let again: Vec<_> = (0..6).map(|_| a.allocate(n, None).unwrap()).collect();
            assert!(again.iter().all(|y| y.as_ptr() != addr), "{conf} {n}: the block in limbo was handed out");
            for y in &again {
                fill_pattern(y, 9);
            }
            let mut v = vec![0; n];
            got.read(0, &mut v).unwrap();
            assert!(v == pattern(n, 7), "{conf} {n}: the imported block changed");
            drop(got);
            wait_until("the release", wait(), || limbo(&a) == 0 && exp.held() == 0);
            a.check_invariants().unwrap_or_else(|e| panic!("{conf} {n}: {e}"));
            drop(again);
            a.empty_cache();
            let s = a.stats();
            assert_eq!(s.active_bytes[AGGREGATE].current, 0, "{conf} {n}");
            assert_eq!(s.reserved_bytes[AGGREGATE].current, 0, "{conf} {n}");
            assert_eq!(s.oversize_allocations.current, 0, "{conf} {n}");
        }
    }
}

/// `export_raw` racing `free_raw` of the same pointer on another thread: either the export
/// is refused (freed first) or the block is held (the free puts it in limbo); never both a
/// handle and a reused block.
#[test]
fn export_raw_racing_free_raw() {
    let a = Arc::new(common::allocator("", 64 * MB as u64));
    let (exp, imp) = pair();
    let exp = Arc::new(exp);
    let mut exported = 0;
    for r in 0..300 {
        let n = [KB, 24 * KB, 300 * KB][r % 3];
        let p = a.allocate_raw(n, None).unwrap();
        let addr = p as usize;
        let freer = {
            let a = Arc::clone(&a);
            std::thread::spawn(move || a.free_raw(addr as *mut u8).unwrap())
        };
        let h = exp.export_raw(&a, p, None);
        freer.join().unwrap();
        let Ok(h) = h else { continue };
        exported += 1;
        let g = imp.open(&h).unwrap();
        assert!(limbo(&a) > 0, "round {r}: exported, freed, not in limbo");
        let q: Vec<_> = (0..3).map(|_| a.allocate_raw(n, None).unwrap()).collect();
        assert!(q.iter().all(|&x| x != p), "round {r}: a held block was handed out");
        g.write(0, &vec![0x3C; n]).unwrap();
        let mut v = vec![0; n];
        g.read(0, &mut v).unwrap();
        assert!(v.iter().all(|&b| b == 0x3C), "round {r}: the import changed");
        drop(g);
        wait_until("the release", wait(), || exp.held() == 0 && limbo(&a) == 0);
        for x in q {
            a.free_raw(x).unwrap();
        }
        a.check_invariants().unwrap();
    }
    assert!(exported > 0);
}

/// A peer that stops reading (stuck, or hostile): an export blocks in `send` once the
/// channel is full, and it holds the exporter's state lock meanwhile, so `held()` and
/// `peer_gone()` (and the release reader) block too, for as long as the peer does not read.
#[test]
fn held_does_not_block_while_an_export_waits_for_a_peer_that_does_not_read() {
    let a = Arc::new(common::allocator("", 64 * MB as u64));
    let (mine, theirs) = Channel::pair("silent peer").unwrap();
    let exp = Arc::new(IpcExporter::new(mine).unwrap());
    let producer = {
        let (a, exp) = (Arc::clone(&a), Arc::clone(&exp));
        std::thread::spawn(move || {
            let mut keep = Vec::new();
            for _ in 0..5000 {
                let x = a.allocate(512, None).unwrap();
                if exp.export(&x, None).is_err() {
                    break;
                }
                keep.push(x);
            }
            keep.len()
        })
    };
    while exp.channel().bytes_sent() < 20 * 56 {
        std::thread::yield_now();
    }
    let probe = Arc::clone(&exp);
    let polls = within("held() while an export is blocked", wait() * 2, move || {
        let start = Instant::now();
        let mut n = 0;
        while start.elapsed() < Duration::from_millis(300) {
            let _ = probe.held();
            let _ = probe.peer_gone();
            n += 1;
        }
        n
    });
    assert!(polls > 0);
    drop(theirs);
    let sent = producer.join().unwrap();
    assert!(sent < 5000, "a peer that never read took 5000 shares");
    wait_until("the hang-up", wait(), || exp.held() == 0 && limbo(&a) == 0);
}

/// A handle names its exporting process (`pid`), but `open` never checks it: two producers
/// that allocate alike (same export numbers, segment serials, offsets and lengths: serials
/// count from 1 in each process) hand out handles that differ only in `pid`, so a consumer
/// that opens producer B's handle on producer A's channel silently gets A's block instead of
/// the refusal `open` promises ("meant for another importer").
#[test]
fn a_handle_of_another_process_is_refused() {
    let a = common::allocator("", 64 * MB as u64);
    let (exp, imp) = pair();
    let x = a.allocate(8 * KB, None).unwrap();
    let h = exp.export(&x, None).unwrap();
    let mut other = h;
    other.pid = h.pid.wrapping_add(1);
    let r = imp.open(&other);
    assert!(r.is_err(), "a handle from process {} opened on a channel to process {}", other.pid, h.pid);
    imp.open(&h).unwrap();
}

/// With every event recorded and the stats reset while a block waits in limbo: the history
/// shows its free requested once and completed once (after the release), the limbo bytes end
/// at 0 and the invariants hold.
#[test]
fn history_and_stat_resets_with_a_block_in_limbo() {
    use dmabuf_rt::caching::HistoryKind;
    let a = common::allocator("", 64 * MB as u64);
    a.record_history(true);
    let (exp, imp) = pair();
    let x = a.allocate(24 * KB, None).unwrap();
    let addr = x.as_ptr() as usize;
    let g = imp.open(&exp.export(&x, None).unwrap()).unwrap();
    drop(x);
    assert_eq!(limbo(&a), 24 * KB as i64);
    a.reset_peak_stats();
    a.reset_accumulated_stats();
    assert_eq!(limbo(&a), 24 * KB as i64, "a reset dropped the limbo's current bytes");
    let _ = a.snapshot().to_json();
    a.check_invariants().unwrap();
    drop(g);
    wait_until("the release", wait(), || exp.held() == 0 && limbo(&a) == 0);
    a.check_invariants().unwrap();
    let ev: Vec<_> = a.history().into_iter().filter(|e| e.addr == addr).map(|e| e.kind).collect();
    let n = |k: HistoryKind| ev.iter().filter(|&&e| e == k).count();
    assert_eq!(n(HistoryKind::Alloc), 1, "{ev:?}");
    assert_eq!(n(HistoryKind::FreeRequested), 1, "{ev:?}");
    assert_eq!(n(HistoryKind::FreeCompleted), 1, "{ev:?}");
    let s = a.stats();
    assert_eq!(s.limbo_bytes.current, 0);
    assert_eq!(s.active_bytes[AGGREGATE].current, 0);
}

/// The producer churns segments (allocate, share, release, free, `empty_cache`): the
/// importer kept the fd and mapping of every segment it was ever sent, so its fds and
/// mappings grew without bound, and the pages of segments the producer released stayed in
/// memory (its `empty_cache` gave nothing back while the consumer lived). Now the exporter
/// says GONE for each segment its allocator let go, and the importer closes its copy.
#[test]
fn an_importer_does_not_keep_every_released_segment_forever() {
    let a = CachingAllocator::builder(ShmemSource::new().reserve(false))
        .config(Config::parse("expandable_segments:False,page_stitching:False").unwrap())
        .capacity(64 * MB as u64)
        .build()
        .unwrap();
    let (exp, imp) = pair();
    for r in 0..24u8 {
        let x = a.allocate(4 * MB, None).unwrap();
        fill_pattern(&x, r);
        let g = imp.open(&exp.export(&x, None).unwrap()).unwrap();
        drop(g);
        drop(x);
        wait_until("the release", wait(), || exp.held() == 0 && limbo(&a) == 0);
        a.empty_cache();
        assert_eq!(a.stats().reserved_bytes[AGGREGATE].current, 0, "round {r}");
    }
    imp.poll().unwrap();
    assert!(
        imp.segments() <= 2,
        "the importer holds {} segments (an fd and a 4 MB mapping each) the producer released",
        imp.segments()
    );
}
