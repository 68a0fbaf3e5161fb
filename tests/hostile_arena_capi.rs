#![allow(unsafe_code)]
//! Hostile review of the page-stitched arena (on by default, 4 KiB units: every request from
//! 16 KiB is an arena block) through the C API, as a careless or hostile multi-threaded C
//! caller drives it: double, interior, foreign and cross-thread frees of home blocks and
//! stitched views; copies and memsets that run past a block's requested size, into its home
//! neighbour or into freed arena memory; `dmabuf_rt_record_stream` then free; `empty_cache`
//! with live blocks; fd export of home blocks and stitched views (through the Rust API: the C
//! API has no export); and one pathological fragmentation measured in mmaps and VMAs.
//!
//! The runtime is process-wide and reads its environment once, so every test runs in a child
//! process of its own ([`in_child`]) with the environment it needs.

mod common;

use common::isolate::in_child;
use std::ffi::{CStr, c_int, c_void};
use std::ptr::null_mut;
use std::sync::{Arc, Barrier};

use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;
use dmabuf_rt::ffi::capi::*;

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;

const ENV: &[(&str, &str)] = &[("DMABUF_RT_DEVICES", "shmem,shmem"), ("DMABUF_RT_CAPACITY", "512M")];

fn last_error() -> String {
    let p = dmabuf_rt_last_error();
    assert!(!p.is_null(), "dmabuf_rt_last_error() is NULL after a failure");
    // SAFETY: a non-null last error is a NUL-terminated string valid until the next failure.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[track_caller]
fn ok(s: dmabuf_rt_status) {
    assert_eq!(s, DMABUF_RT_OK, "call failed: {}", if s == DMABUF_RT_OK { String::new() } else { last_error() });
}

/// Asserts a refusal with `want`, a message naming `func`, and that message containing `has`.
#[track_caller]
fn refused(got: dmabuf_rt_status, want: dmabuf_rt_status, func: &str, has: &str) -> String {
    let why = if got == DMABUF_RT_OK { "<none>".to_string() } else { last_error() };
    assert_eq!(got, want, "{func}: wrong status ({why})");
    assert!(why.starts_with(&format!("{func}: ")), "{func}: last error `{why}` does not name the function");
    assert!(why.contains(has), "{func}: last error `{why}` does not say `{has}`");
    why
}

fn stats(device: c_int) -> dmabuf_rt_stats {
    let mut s = dmabuf_rt_stats::default();
    // SAFETY: `s` is a valid out-pointer.
    ok(unsafe { dmabuf_rt_device_stats(device, &mut s) });
    s
}

fn snapshot(device: c_int) -> String {
    let mut p = null_mut();
    // SAFETY: `p` is a valid out-pointer.
    ok(unsafe { dmabuf_rt_snapshot_json(device, &mut p) });
    // SAFETY: a NUL-terminated string from the library.
    let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    ok(dmabuf_rt_string_free(p));
    s
}

fn num_remaps(device: c_int) -> u64 {
    let s = snapshot(device);
    let i = s.find("\"num_remaps\":").expect("num_remaps in the snapshot") + "\"num_remaps\":".len();
    s[i..].chars().take_while(char::is_ascii_digit).collect::<String>().parse().unwrap()
}

fn alloc(device: c_int, size: usize) -> *mut u8 {
    let mut p = null_mut();
    // SAFETY: `p` is a valid out-pointer.
    let s = unsafe { dmabuf_rt_device_alloc(device, size, &mut p) };
    ok(s);
    assert!(!p.is_null());
    p.cast()
}

fn free(device: c_int, p: *mut u8) -> dmabuf_rt_status {
    dmabuf_rt_device_free(device, p.cast())
}

fn pat(tag: u8, n: usize) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31) ^ tag ^ ((i >> 12) as u8)).collect()
}

fn write(device: c_int, p: *mut u8, bytes: &[u8]) -> dmabuf_rt_status {
    // SAFETY: the host side is a live buffer of `bytes.len()` bytes.
    unsafe {
        dmabuf_rt_memcpy(device, p.cast(), 0, bytes.as_ptr().cast(), bytes.len(), DMABUF_RT_MEMCPY_HOST_TO_DEVICE, 0)
    }
}

fn read(device: c_int, p: *const u8, n: usize) -> Result<Vec<u8>, dmabuf_rt_status> {
    let mut v = vec![0xEEu8; n];
    // SAFETY: the host side is a live buffer of `n` bytes.
    let s =
        unsafe { dmabuf_rt_memcpy(0, v.as_mut_ptr().cast(), device, p.cast(), n, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0) };
    if s == DMABUF_RT_OK { Ok(v) } else { Err(s) }
}

/// A live block: where, how big, what it should hold.
struct Live {
    p: *mut u8,
    n: usize,
    tag: u8,
}

impl Live {
    fn new(device: c_int, n: usize, tag: u8) -> Self {
        let p = alloc(device, n);
        ok(write(device, p, &pat(tag, n)));
        Live { p, n, tag }
    }

    #[track_caller]
    fn check(&self, device: c_int) {
        let got = read(device, self.p, self.n).unwrap_or_else(|s| panic!("read back refused: {s:?} {}", last_error()));
        let want = pat(self.tag, self.n);
        if let Some(i) = (0..self.n).find(|&i| got[i] != want[i]) {
            panic!("block {:p} ({} bytes, tag {}) lost its bytes at offset {i}", self.p, self.n, self.tag);
        }
    }
}

/// Statistics that a refusal must not change.
fn key(s: &dmabuf_rt_stats) -> [u64; 6] {
    [s.allocated_bytes, s.reserved_bytes, s.requested_bytes, s.allocations, s.num_allocs, s.num_frees]
}

/// Makes a stitched view on `device`: home blocks of 4 units with every other one freed,
/// then a block of `want_units` units that no free run holds. Returns the live home blocks,
/// the view and how many remaps it took.
fn stitched(device: c_int, pairs: usize, want_units: usize, tag: u8) -> (Vec<Live>, Live, u64) {
    let (kept, view, remaps, _) = stitched_with_holes(device, pairs, want_units, tag);
    (kept, view, remaps)
}

/// [`stitched`], also returning the home addresses of the blocks freed (whose units the view
/// may now show).
fn stitched_with_holes(
    device: c_int,
    pairs: usize,
    want_units: usize,
    tag: u8,
) -> (Vec<Live>, Live, u64, Vec<*mut u8>) {
    let mut all: Vec<Live> = (0..2 * pairs).map(|i| Live::new(device, 16 * KB, tag.wrapping_add(i as u8))).collect();
    let (mut kept, mut holes) = (Vec::new(), Vec::new());
    for (i, l) in all.drain(..).enumerate() {
        if i % 2 == 1 {
            ok(free(device, l.p));
            holes.push(l.p);
        } else {
            kept.push(l);
        }
    }
    let before = num_remaps(device);
    let view = Live::new(device, want_units * 4 * KB, tag ^ 0x80);
    (kept, view, num_remaps(device) - before, holes)
}

// ---------------------------------------------------------------------------------------

#[test]
fn frees_of_home_blocks_that_are_not_live_are_refused_and_change_nothing() {
    in_child("frees_of_home_blocks_that_are_not_live_are_refused_and_change_nothing", ENV, || {
        let sizes = [16 * KB, 16 * KB + 1, 64 * KB, 100 * KB + 7, MB, 3 * MB + 5, 64 * MB];
        let live: Vec<Live> = sizes.iter().enumerate().map(|(i, &n)| Live::new(0, n, i as u8)).collect();
        let victim = alloc(0, 32 * KB);
        ok(free(0, victim));
        let before = key(&stats(0));
        // Double free of a freed home block.
        refused(free(0, victim), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free", "double free");
        // Interior frees of live blocks (one byte in, one unit in, the last byte).
        for l in &live {
            for off in [1, 4096, l.n - 1] {
                refused(
                    free(0, l.p.wrapping_add(off)),
                    DMABUF_RT_INVALID_POINTER,
                    "dmabuf_rt_device_free",
                    "not the start of a block",
                );
            }
        }
        // An interior pointer of the freed home block.
        let why = refused(free(0, victim.wrapping_add(4096)), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free", "");
        println!("interior of a freed home block: {why}");
        // Foreign: the stack, the heap, NULL, just past the last live block's end, the device's other id.
        let on_stack = 0u64;
        for p in [(&on_stack as *const u64).cast_mut().cast::<u8>(), Box::into_raw(Box::new(7u64)).cast()] {
            refused(free(0, p), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free", "not a pointer");
        }
        refused(free(0, null_mut()), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free", "null");
        for l in &live {
            refused(free(1, l.p), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free", "");
        }
        assert_eq!(key(&stats(0)), before, "refused frees changed the statistics");
        for l in &live {
            l.check(0);
        }
        // The live blocks still free once, and only once.
        for l in &live {
            ok(free(0, l.p));
            refused(free(0, l.p), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free", "double free");
        }
        let s = stats(0);
        assert_eq!((s.allocations, s.num_allocs, s.num_frees), (0, 8, 8));
    });
}

#[test]
fn copies_and_memsets_past_the_requested_bytes_are_refused_and_neighbours_keep_their_bytes() {
    in_child("copies_and_memsets_past_the_requested_bytes_are_refused_and_neighbours_keep_their_bytes", ENV, || {
        // Home blocks side by side: a (17 KiB + 3: 5 units with a rounding tail), b, c, d.
        let a = Live::new(0, 17 * KB + 3, 1);
        let b = Live::new(0, 16 * KB, 2);
        let c = alloc(0, 16 * KB);
        let d = Live::new(0, 64 * KB, 4);
        println!("a {:p} b {:p} c {:p} d {:p}", a.p, b.p, c, d.p);
        ok(free(0, c));
        let before = key(&stats(0));
        let big = vec![0x5Au8; 256 * KB];
        let mut host = vec![0xA5u8; 256 * KB];
        // Exactly the requested bytes are fine (and leave the pattern as it was).
        ok(write(0, a.p, &pat(1, a.n)));
        ok(dmabuf_rt_memset(0, a.p.wrapping_add(a.n - 1).cast(), pat(1, a.n)[a.n - 1] as c_int, 1));
        // One byte past a's request (into its rounding), and into b.
        for (p, n) in [(a.p, a.n + 1), (a.p.wrapping_add(a.n - 1), 2), (a.p, 20 * KB), (a.p, 40 * KB)] {
            refused(dmabuf_rt_memset(0, p.cast(), 0, n), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_memset", "past the end");
            refused(write(0, p, &big[..n]), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_memcpy", "past the end");
            let s = read(0, p, n);
            assert_eq!(s, Err(DMABUF_RT_INVALID_POINTER));
            // Device to device, either side spanning.
            // SAFETY: device pointers only (checked).
            let s = unsafe { dmabuf_rt_memcpy(0, p.cast(), 0, d.p.cast(), n, DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE, 0) };
            refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_memcpy", "past the end");
            // SAFETY: as above.
            let s = unsafe { dmabuf_rt_memcpy(1, alloc_once(), 0, p.cast(), n, DMABUF_RT_MEMCPY_PEER_TO_PEER, 0) };
            refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_memcpy", "past the end");
        }
        // Into freed arena memory (c), starting in it or running into it from b.
        for (p, n) in
            [(c, 1), (c, 16 * KB), (c.wrapping_add(4095), 2), (b.p, 16 * KB + 1), (b.p.wrapping_add(16 * KB - 1), 2)]
        {
            let why = refused(dmabuf_rt_memset(0, p.cast(), 0, n), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_memset", "");
            assert!(why.contains("free") || why.contains("past the end"), "memset {p:p}+{n}: {why}");
            refused(write(0, p, &big[..n]), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_memcpy", "");
            // SAFETY: the host side is a live buffer.
            let s = unsafe {
                dmabuf_rt_memcpy(0, host.as_mut_ptr().cast(), 0, p.cast(), n, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0)
            };
            refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_memcpy", "");
            assert!(host.iter().all(|&x| x == 0xA5), "a refused copy wrote the host buffer");
            refused(
                dmabuf_rt_cpu_access_begin(0, p.cast(), n, true),
                DMABUF_RT_INVALID_POINTER,
                "dmabuf_rt_cpu_access_begin",
                "",
            );
        }
        // A range that wraps the address space, from inside a live block.
        refused(
            dmabuf_rt_memset(0, d.p.wrapping_add(8).cast(), 0, usize::MAX - 4),
            DMABUF_RT_INVALID_POINTER,
            "dmabuf_rt_memset",
            "",
        );
        assert_eq!(key(&stats(0)), before, "refusals changed the statistics");
        for l in [&a, &b, &d] {
            l.check(0);
        }
        // The last byte of the rounding tail of a: refused as well (not requested).
        refused(
            dmabuf_rt_memset(0, a.p.wrapping_add(a.n).cast(), 0, 1),
            DMABUF_RT_INVALID_POINTER,
            "dmabuf_rt_memset",
            "",
        );
    });
}

/// A 16 KiB block on device 1 for the peer copies above (leaked: the child exits).
fn alloc_once() -> *mut c_void {
    static P: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *P.get_or_init(|| alloc(1, 64 * KB) as usize) as *mut c_void
}

#[test]
fn stitched_views_take_copies_within_their_bytes_and_refuse_the_rest() {
    in_child("stitched_views_take_copies_within_their_bytes_and_refuse_the_rest", ENV, || {
        let (kept, view, remaps, holes) = stitched_with_holes(0, 64, 40, 0x10);
        println!("view {:p} of 40 units took {remaps} remaps", view.p);
        assert!(remaps >= 2, "the 40-unit block should be a stitched view (remaps {remaps})");
        view.check(0);
        // The freed home blocks' addresses (whose units the view may show now): every use refused.
        let before = key(&stats(0));
        for &h in &holes {
            refused(
                dmabuf_rt_memset(0, h.cast(), 0x99, 16 * KB),
                DMABUF_RT_INVALID_POINTER,
                "dmabuf_rt_memset",
                "free",
            );
            refused(write(0, h, &[0x99; 64]), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_memcpy", "");
            refused(free(0, h), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free", "double free");
            refused(free(0, h.wrapping_add(4096)), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free", "");
            refused(dmabuf_rt_record_stream(0, h.cast(), 0), DMABUF_RT_INVALID_HANDLE, "dmabuf_rt_record_stream", "");
        }
        assert_eq!(key(&stats(0)), before);
        view.check(0);
        // Copies crossing the view's run boundaries (every 16 KiB), inside its bytes.
        for off in [16 * KB - 3, 32 * KB - 1, 5 * 16 * KB + 100] {
            let bytes = pat(0x33, 7 * KB);
            ok(write(0, view.p.wrapping_add(off), &bytes));
            assert_eq!(read(0, view.p.wrapping_add(off), bytes.len()).unwrap(), bytes);
            ok(write(0, view.p.wrapping_add(off), &pat(view.tag, view.n)[off..off + bytes.len()]));
        }
        // Device to device between the view and a home block.
        // SAFETY: device pointers only (checked).
        let s = unsafe {
            dmabuf_rt_memcpy(
                0,
                kept[3].p.cast(),
                0,
                view.p.wrapping_add(8 * KB).cast(),
                16 * KB,
                DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE,
                0,
            )
        };
        ok(s);
        assert_eq!(read(0, kept[3].p, 16 * KB).unwrap(), pat(view.tag, view.n)[8 * KB..24 * KB]);
        ok(write(0, kept[3].p, &pat(kept[3].tag, 16 * KB)));
        let before = key(&stats(0));
        refused(
            dmabuf_rt_memset(0, view.p.wrapping_add(view.n - 1).cast(), 0, 2),
            DMABUF_RT_INVALID_POINTER,
            "dmabuf_rt_memset",
            "past the end",
        );
        refused(
            free(0, view.p.wrapping_add(4096)),
            DMABUF_RT_INVALID_POINTER,
            "dmabuf_rt_device_free",
            "not the start",
        );
        refused(free(1, view.p), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free", "");
        let mut dev = -1;
        // SAFETY: `dev` is a valid out-pointer.
        ok(unsafe { dmabuf_rt_pointer_device(view.p.wrapping_add(view.n - 1).cast(), &mut dev) });
        assert_eq!(dev, 0);
        assert_eq!(key(&stats(0)), before);
        view.check(0);
        for l in &kept {
            l.check(0);
        }
        // Free the view, then every kind of use of it is refused.
        ok(free(0, view.p));
        let before = key(&stats(0));
        let why = refused(free(0, view.p), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free", "");
        println!("double free of a stitched view: {why}");
        assert!(why.contains("double free") || why.contains("already freed"), "{why}");
        refused(dmabuf_rt_memset(0, view.p.cast(), 0, 1), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_memset", "");
        assert!(read(0, view.p, 1).is_err());
        assert_eq!(key(&stats(0)), before);
        for l in &kept {
            l.check(0);
        }
    });
}

#[test]
fn racing_frees_from_many_threads_free_each_block_exactly_once() {
    in_child("racing_frees_from_many_threads_free_each_block_exactly_once", ENV, || {
        const THREADS: usize = 4;
        const ROUNDS: usize = 150;
        let sizes = [16 * KB, 20 * KB, 64 * KB, 256 * KB + 1, MB];
        let barrier = Arc::new(Barrier::new(THREADS));
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let barrier = Arc::clone(&barrier);
                std::thread::spawn(move || {
                    let mut wins = 0usize;
                    for r in 0..ROUNDS {
                        // Thread 0 allocates a shared block each round; all threads race to free it.
                        static SHARED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
                        if t == 0 {
                            let l = Live::new(0, sizes[r % sizes.len()], r as u8);
                            SHARED.store(l.p as usize, std::sync::atomic::Ordering::SeqCst);
                        }
                        // Each thread also keeps a private block it checks.
                        let mine = Live::new(0, sizes[(r + t) % sizes.len()], (r * 7 + t) as u8);
                        barrier.wait();
                        let p = SHARED.load(std::sync::atomic::Ordering::SeqCst) as *mut u8;
                        match free(0, p) {
                            DMABUF_RT_OK => wins += 1,
                            s => {
                                assert_eq!(s, DMABUF_RT_INVALID_POINTER);
                                let why = last_error();
                                assert!(
                                    why.contains("double free") || why.contains("not a pointer"),
                                    "racing double free: {why}"
                                );
                            }
                        }
                        // Interior free and a free of the other device.
                        assert_eq!(free(0, mine.p.wrapping_add(4096)), DMABUF_RT_INVALID_POINTER);
                        assert_eq!(free(1, mine.p), DMABUF_RT_INVALID_POINTER);
                        mine.check(0);
                        ok(free(0, mine.p));
                        barrier.wait();
                    }
                    wins
                })
            })
            .collect();
        let wins: usize = hs.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(wins, ROUNDS, "each shared block freed exactly once");
        let s = stats(0);
        assert_eq!(s.allocations, 0);
        assert_eq!(s.num_allocs, s.num_frees);
    });
}

#[test]
fn blocks_freed_on_another_thread_than_their_allocation_keep_others_bytes() {
    in_child("blocks_freed_on_another_thread_than_their_allocation_keep_others_bytes", ENV, || {
        let (tx, rx) = std::sync::mpsc::sync_channel::<(usize, usize, u8)>(64);
        let producer = std::thread::spawn(move || {
            let mut x = 0x2545_F491_4F6C_DD1Du64;
            for i in 0..600u32 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let n = 16 * KB + (x as usize % (2 * MB));
                let l = Live::new(0, n, i as u8);
                tx.send((l.p as usize, l.n, l.tag)).unwrap();
            }
        });
        let consumer = std::thread::spawn(move || {
            let mut held: Vec<Live> = Vec::new();
            let mut k = 0usize;
            while let Ok((p, n, tag)) = rx.recv() {
                held.push(Live { p: p as *mut u8, n, tag });
                k += 1;
                if held.len() > 24 {
                    let l = held.swap_remove(k % held.len());
                    l.check(0);
                    ok(free(0, l.p));
                    // No second free here: the producer may already have been given the
                    // same address for its next block, and a free by address cannot tell
                    // that block from the freed one (no allocator can).
                }
            }
            // The producer is done, so nothing reuses an address between the two frees.
            for l in held {
                l.check(0);
                ok(free(0, l.p));
                assert_eq!(free(0, l.p), DMABUF_RT_INVALID_POINTER);
            }
        });
        producer.join().unwrap();
        consumer.join().unwrap();
        let s = stats(0);
        assert_eq!((s.allocations, s.num_allocs, s.num_frees), (0, 600, 600));
    });
}

#[test]
fn record_stream_then_free_logs_requested_then_completed_and_refuses_a_second_free() {
    in_child("record_stream_then_free_logs_requested_then_completed_and_refuses_a_second_free", ENV, || {
        ok(dmabuf_rt_record_history(0, true));
        let mut s1 = 0;
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_stream_create(1, &mut s1) });
        for (i, n) in [16 * KB, 48 * KB + 1, 4 * MB].into_iter().enumerate() {
            let l = Live::new(0, n, i as u8);
            let peer = alloc(1, n);
            // A peer copy queued on a stream of device 1 reads the block.
            // SAFETY: device pointers only.
            ok(unsafe { dmabuf_rt_memcpy(1, peer.cast(), 0, l.p.cast(), n, DMABUF_RT_MEMCPY_PEER_TO_PEER, s1) });
            ok(dmabuf_rt_record_stream(0, l.p.cast(), s1));
            // An interior pointer: the header says "the live allocation that holds ptr".
            let interior = dmabuf_rt_record_stream(0, l.p.wrapping_add(4096).cast(), s1);
            if interior != DMABUF_RT_OK {
                println!("record_stream of an interior pointer of a live block: {interior:?}: {}", last_error());
            }
            ok(free(0, l.p));
            let why = refused(free(0, l.p), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free", "");
            assert!(why.contains("already freed"), "second free: {why}");
            refused(
                dmabuf_rt_record_stream(0, l.p.cast(), s1),
                DMABUF_RT_INVALID_POINTER,
                "dmabuf_rt_record_stream",
                "",
            );
            ok(dmabuf_rt_stream_synchronize(s1));
            assert_eq!(read(1, peer, n).unwrap(), pat(i as u8, n), "the peer copy read the block's bytes");
            ok(dmabuf_rt_device_synchronize(0));
            ok(dmabuf_rt_device_synchronize(1));
            ok(free(1, peer));
            let snap = snapshot(0);
            let addr = format!("\"addr\":{}", l.p as usize);
            let events: Vec<&str> = snap
                .split('{')
                .filter(|e| e.contains(&addr))
                .filter_map(|e| e.split("\"action\":\"").nth(1).and_then(|r| r.split('"').next()))
                .collect();
            println!("block {i} ({n} bytes) history: {events:?}");
            let req = events.iter().rposition(|&e| e == "free_requested").expect("free_requested logged");
            assert!(events[req..].contains(&"free_completed"), "free_completed after free_requested: {events:?}");
            assert!(!events.contains(&"invalid_free") || events.iter().rposition(|&e| e == "invalid_free") > Some(req));
        }
        ok(dmabuf_rt_stream_destroy(s1));
        let s = stats(0);
        assert_eq!(s.allocations, 0);
        assert_eq!(s.num_allocs, s.num_frees);
    });
}

#[test]
fn record_stream_accepts_an_interior_pointer_as_the_header_says() {
    in_child("record_stream_accepts_an_interior_pointer_as_the_header_says", ENV, || {
        let mut s1 = 0;
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_stream_create(0, &mut s1) });
        let p = alloc(0, 64 * KB);
        // include/dmabuf_rt.h: "Marks the live allocation of `device` that holds `ptr` ... Refused
        // for a pointer that is not inside a live allocation of `device`".
        let s = dmabuf_rt_record_stream(0, p.wrapping_add(4096).cast(), s1);
        let why = if s == DMABUF_RT_OK { String::new() } else { last_error() };
        ok(free(0, p));
        ok(dmabuf_rt_stream_destroy(s1));
        assert_eq!(s, DMABUF_RT_OK, "record_stream of a pointer inside a live block refused: {why}");
    });
}

#[test]
fn empty_cache_with_live_home_blocks_and_views_keeps_their_bytes_and_the_refusals() {
    in_child("empty_cache_with_live_home_blocks_and_views_keeps_their_bytes_and_the_refusals", ENV, || {
        let (mut kept, view, remaps) = stitched(0, 48, 30, 0x40);
        assert!(remaps >= 2, "a stitched view");
        let freed = kept.remove(5);
        ok(free(0, freed.p));
        let big = Live::new(0, 32 * MB + 3, 0x77);
        let gone = alloc(0, 8 * MB);
        ok(free(0, gone));
        let r0 = stats(0).reserved_bytes;
        ok(dmabuf_rt_empty_cache(0));
        let r1 = stats(0).reserved_bytes;
        println!("empty_cache: reserved {r0} -> {r1}");
        for l in kept.iter().chain([&view, &big]) {
            l.check(0);
        }
        let before = key(&stats(0));
        for p in [freed.p, gone] {
            let why = refused(free(0, p), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free", "");
            println!("free after empty_cache of a freed block: {why}");
            refused(dmabuf_rt_memset(0, p.cast(), 0, 1), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_memset", "");
        }
        assert_eq!(key(&stats(0)), before);
        // New blocks after the empty do not land on live bytes.
        let fresh: Vec<Live> = (0..40).map(|i| Live::new(0, (16 * KB) << (i % 6), 0xA0 + i as u8)).collect();
        for l in kept.iter().chain([&view, &big]).chain(fresh.iter()) {
            l.check(0);
        }
        // Empty again while a stream has work queued on a live view.
        let mut s1 = 0;
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_stream_create(0, &mut s1) });
        let host = pat(0x55, view.n);
        ok(unsafe {
            // SAFETY: `host` outlives the synchronize below.
            dmabuf_rt_memcpy(0, view.p.cast(), 0, host.as_ptr().cast(), view.n, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, s1)
        });
        for l in fresh.iter().step_by(2) {
            ok(free(0, l.p));
        }
        ok(dmabuf_rt_empty_cache(0));
        ok(dmabuf_rt_stream_synchronize(s1));
        assert_eq!(read(0, view.p, view.n).unwrap(), host);
        for l in kept.iter().chain([&big]).chain(fresh.iter().skip(1).step_by(2)) {
            l.check(0);
        }
        ok(dmabuf_rt_stream_destroy(s1));
    });
}

#[test]
fn exporting_fds_home_blocks_share_their_range_and_views_are_refused_clearly() {
    use dmabuf_rt::caching::{CachingAllocator, Config};
    use dmabuf_rt::source::ShmemSource;
    let a = CachingAllocator::builder(ShmemSource::new().reserve(false))
        .config(Config::default())
        .capacity(256 << 20)
        .build()
        .unwrap();
    let mut blocks: Vec<_> = (0..32).map(|_| a.allocate(16 * KB, None).unwrap()).collect();
    let mut kept = Vec::new();
    for (i, b) in blocks.drain(..).enumerate() {
        if i % 2 == 0 {
            kept.push(b);
        }
    }
    for (i, b) in kept.iter().enumerate() {
        // SAFETY: the block is live and ours; nothing else touches it.
        unsafe { std::ptr::write_bytes(b.as_ptr(), i as u8 + 1, b.len()) };
    }
    let view = a.allocate(40 * KB, None).unwrap();
    // Home block: the fd at offset() shows exactly its bytes.
    let home = &kept[3];
    let fd = home.try_clone_fd().expect("a home block exports its arena memfd");
    let mut buf = vec![0u8; home.len()];
    let n = nix_pread(&fd, &mut buf, home.offset());
    assert_eq!(n, home.len());
    assert!(buf.iter().all(|&x| x == 4), "the fd range at offset() is not the home block's bytes");
    // The view: refused, saying why.
    match view.try_clone_fd() {
        Ok(_) => panic!("a stitched view of several runs exported an fd"),
        Err(e) => {
            let why = e.to_string();
            println!("export of a stitched view: {why}");
            assert!(why.contains("stitch") || why.contains("run"), "unclear refusal: {why}");
        }
    }
    drop(view);
    drop(kept);
    a.check_invariants().unwrap();
}

fn nix_pread(fd: &std::os::fd::OwnedFd, buf: &mut [u8], off: usize) -> usize {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::from(fd.try_clone().unwrap());
    f.read_at(buf, off as u64).unwrap()
}

fn vmas() -> usize {
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().count()
}

/// Fragments `span` bytes of arena into alternating 4-unit live and free blocks, then asks for
/// `want`: reports the remaps and the process's mappings.
fn fragment_and_request(span: usize, want: usize) -> (u64, usize, usize, usize) {
    let v0 = vmas();
    let n = span / (16 * KB);
    let ps: Vec<*mut u8> = (0..n).map(|_| alloc(0, 16 * KB)).collect();
    for p in ps.iter().skip(1).step_by(2) {
        ok(free(0, *p));
    }
    let v1 = vmas();
    let r0 = num_remaps(0);
    let t = std::time::Instant::now();
    let mut big = null_mut();
    // SAFETY: valid out-pointer.
    let s = unsafe { dmabuf_rt_device_alloc(0, want, &mut big) };
    let took = t.elapsed();
    let why = if s == DMABUF_RT_OK { String::new() } else { last_error() };
    let remaps = num_remaps(0) - r0;
    let v2 = vmas();
    println!(
        "fragment {} MiB in 16 KiB live/free pairs, then ask {} MiB: status {s:?} {why} in {took:?}; \
         remaps {remaps}; /proc/self/maps lines {v0} -> {v1} (fragmented) -> {v2} (after the request)",
        span / MB,
        want / MB
    );
    if s == DMABUF_RT_OK {
        // The view works end to end.
        let step = if want <= 64 * MB { 1 } else { 16 * MB };
        for off in (0..want).step_by(step.max(1)).take(if step == 1 { 1 } else { usize::MAX }) {
            let n = if step == 1 { want } else { 4096 };
            ok(dmabuf_rt_memset(0, big.cast::<u8>().wrapping_add(off).cast(), 0x3C, n));
            let back = read(0, big.cast::<u8>().wrapping_add(off), n).unwrap();
            assert!(back.iter().all(|&x| x == 0x3C));
        }
        ok(dmabuf_rt_device_free(0, big));
        println!("after freeing the large block: /proc/self/maps lines {}", vmas());
    }
    for p in ps.iter().step_by(2) {
        ok(free(0, *p));
    }
    (remaps, v0, v1, v2)
}

#[test]
fn fragmented_arena_64m_then_a_large_request_counts_remaps_and_vmas() {
    // Capacity 64 MiB + a little: the large request must stitch the free runs, not grow.
    in_child(
        "fragmented_arena_64m_then_a_large_request_counts_remaps_and_vmas",
        &[("DMABUF_RT_DEVICES", "shmem"), ("DMABUF_RT_CAPACITY", "80M")],
        || {
            let (remaps, _, _, v2) = fragment_and_request(64 * MB, 32 * MB);
            assert!(v2 < 65530 / 2, "the process nears the kernel's 65,530 mappings: {v2}");
            assert!(remaps >= 2048, "a 32 MiB block over 2,048 free 16 KiB runs: {remaps} remaps");
        },
    );
}

#[test]
fn fragmented_arena_2g_then_a_1g_request_does_not_exhaust_the_mappings() {
    // 2 GiB of sparse arena (never touched but by the 1 GiB request): 65,536 free runs of 4
    // units. Stitching the request over them needs 65,536 mappings, more than the kernel
    // allows a process (vm.max_map_count, 65,530 by default): the allocator must refuse it
    // cleanly (or grow instead), not take the process's last mappings.
    in_child(
        "fragmented_arena_2g_then_a_1g_request_does_not_exhaust_the_mappings",
        &[("DMABUF_RT_DEVICES", "shmem"), ("DMABUF_RT_CAPACITY", "2100M")],
        || {
            let (remaps, _, _, v2) = fragment_and_request(2048 * MB, 1024 * MB);
            let max = std::fs::read_to_string("/proc/sys/vm/max_map_count").unwrap_or_default();
            println!("vm.max_map_count {}", max.trim());
            // What the rest of the process can still do: one mmap (unified memory), a thread.
            let mut u = null_mut();
            // SAFETY: valid out-pointer.
            let us = unsafe { dmabuf_rt_unified_alloc(MB, &mut u) };
            let uwhy = if us == DMABUF_RT_OK { String::new() } else { last_error() };
            let thread = std::thread::Builder::new().spawn(|| 1).map(|h| h.join().unwrap());
            println!("after the request: unified_alloc(1 MiB) {us:?} {uwhy}; thread spawn {:?}", thread.as_ref().err());
            ok(dmabuf_rt_empty_cache(0));
            let v3 = vmas();
            println!("after freeing every block and empty_cache: /proc/self/maps lines {v3}");
            assert!(v2 < 60000, "the process is left with {v2} mappings after a refused request (remaps {remaps})");
            assert_eq!(us, DMABUF_RT_OK, "one mmap elsewhere in the process fails: {uwhy}");
        },
    );
}

#[test]
fn fragmented_arena_1g_then_a_512m_request_and_its_cached_view_is_let_go() {
    // 32,768 free runs of 4 units: the 512 MiB request stitches them (32,768 mmaps, half the
    // kernel's default limit). Freed, its view is cached; `arena.rs` promises the cached views
    // hold at most `MAX_CACHED_RUNS` (8,192) runs, so the mappings must fall back.
    in_child(
        "fragmented_arena_1g_then_a_512m_request_and_its_cached_view_is_let_go",
        &[("DMABUF_RT_DEVICES", "shmem"), ("DMABUF_RT_CAPACITY", "1100M")],
        || {
            let v0 = vmas();
            let (remaps, _, _, v2) = fragment_and_request(1024 * MB, 512 * MB);
            let v3 = vmas();
            println!("remaps {remaps}; mappings with the view live {v2}, once freed (cached) {v3}");
            assert_eq!(remaps, 32768);
            assert!(v3 < v0 + 8192 + 64, "a freed view keeps {} mappings cached (cap 8,192 runs)", v3 - v0);
        },
    );
}

unsafe extern "C" fn sleep_cb(_s: dmabuf_rt_stream, _st: dmabuf_rt_status, ms: *mut c_void) {
    std::thread::sleep(std::time::Duration::from_millis(ms as u64));
}

#[test]
fn a_recorded_block_freed_while_its_stream_still_writes_it_is_not_reused_before_the_stream_passes() {
    in_child(
        "a_recorded_block_freed_while_its_stream_still_writes_it_is_not_reused_before_the_stream_passes",
        ENV,
        || {
            let (mut s1, mut s2) = (0, 0);
            // SAFETY: valid out-pointers.
            ok(unsafe { dmabuf_rt_stream_create(0, &mut s1) });
            // SAFETY: as above.
            ok(unsafe { dmabuf_rt_stream_create(0, &mut s2) });
            // A home block and a stitched view, each about to be written by s1 after a stall.
            let (kept, view, remaps) = stitched(0, 32, 24, 0x20);
            assert!(remaps >= 2);
            let home = Live::new(0, 96 * KB, 0x21);
            // SAFETY: the callback only sleeps; user_data is a number of milliseconds.
            ok(unsafe { dmabuf_rt_stream_add_callback(s1, Some(sleep_cb), 300usize as *mut c_void) });
            let junk = vec![0xDDu8; view.n.max(home.n)];
            for l in [&view, &home] {
                // SAFETY: the host side is read into a staging buffer before this returns.
                ok(unsafe {
                    dmabuf_rt_memcpy(0, l.p.cast(), 0, junk.as_ptr().cast(), l.n, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, s1)
                });
                ok(dmabuf_rt_record_stream(0, l.p.cast(), s1));
                ok(free(0, l.p));
            }
            // Meanwhile other blocks of every size are made and written on s2 (not after s1).
            let mut fresh = Vec::new();
            for i in 0..48usize {
                let n = [16 * KB, 24 * 4 * KB, 96 * KB, 40 * KB][i % 4];
                let p = alloc(0, n);
                let bytes = pat(0x60 + i as u8, n);
                // SAFETY: staged before return.
                ok(unsafe {
                    dmabuf_rt_memcpy(0, p.cast(), 0, bytes.as_ptr().cast(), n, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, s2)
                });
                fresh.push(Live { p, n, tag: 0x60 + i as u8 });
            }
            ok(dmabuf_rt_stream_synchronize(s2));
            let reused = fresh.iter().filter(|l| l.p == view.p || l.p == home.p).count();
            ok(dmabuf_rt_stream_synchronize(s1));
            println!("{reused} fresh blocks at the freed blocks' addresses");
            for l in fresh.iter().chain(kept.iter()) {
                l.check(0);
            }
            ok(dmabuf_rt_stream_destroy(s1));
            ok(dmabuf_rt_stream_destroy(s2));
        },
    );
}

#[test]
fn a_free_inside_a_freed_home_block_does_not_say_the_memory_is_foreign() {
    in_child("a_free_inside_a_freed_home_block_does_not_say_the_memory_is_foreign", ENV, || {
        let keep = Live::new(0, 16 * KB, 1);
        let p = alloc(0, 64 * KB);
        let keep2 = Live::new(0, 16 * KB, 2);
        ok(free(0, p));
        let mut dev = -1;
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_pointer_device(p.wrapping_add(8 * KB).cast(), &mut dev) });
        assert_eq!(dev, 0, "pointer_device: the allocator holds the freed home block's memory");
        let why = refused(free(0, p.wrapping_add(8 * KB)), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free", "");
        keep.check(0);
        keep2.check(0);
        // The same call on a freed block of the classic pools says "not the start of a block";
        // memset on it says "inside free memory of a page-stitched arena".
        assert!(
            !why.contains("not a pointer this allocator handed out"),
            "an interior free of a freed home block is called foreign memory: {why}"
        );
    });
}
