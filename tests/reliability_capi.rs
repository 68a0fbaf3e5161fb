//! Issue 9 through the C API: the defects a hostile, multi-threaded C caller found (hangs,
//! stale reads, out-of-range writes, deadlocking callbacks, wrong statuses), each with a test
//! that fails without its fix. Every wait is bounded by a watchdog: a hang fails the test
//! naming what hung instead of hanging CI.

#![allow(unsafe_code)]

use std::ffi::{CStr, c_int, c_void};
use std::ptr::null_mut;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Mutex, MutexGuard, Once};
use std::time::Duration;

use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;

mod common;

/// Watchdog limits are multiplied by `DMABUF_RT_STRESS_TIME_SCALE` (the kernel lane, TSan).
use common::time_scale;
use dmabuf_rt::ffi::capi::*;

fn setup() -> MutexGuard<'static, ()> {
    static ENV: Once = Once::new();
    static SERIAL: Mutex<()> = Mutex::new(());
    ENV.call_once(|| {
        // SAFETY: every test calls `setup` first and `call_once` holds the others until this
        // returns, so nothing reads the environment while it is written.
        unsafe { std::env::set_var("DMABUF_RT_DEVICES", "shmem,shmem") };
        // SAFETY: as above.
        unsafe { std::env::set_var("DMABUF_RT_CAPACITY", "512M") };
    });
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn last_error() -> String {
    let p = dmabuf_rt_last_error();
    if p.is_null() {
        return "(no last error)".into();
    }
    // SAFETY: a non-null last error is a NUL-terminated string valid until this thread's next
    // failing call.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[track_caller]
fn ok(s: dmabuf_rt_status) {
    assert_eq!(s, DMABUF_RT_OK, "call failed: {}", if s == DMABUF_RT_OK { String::new() } else { last_error() });
}

fn device_alloc(device: c_int, size: usize) -> usize {
    let mut p = null_mut();
    // SAFETY: `p` is a valid out-pointer.
    ok(unsafe { dmabuf_rt_device_alloc(device, size, &mut p) });
    p as usize
}

fn new_stream(device: c_int) -> dmabuf_rt_stream {
    let mut s = 0;
    // SAFETY: `s` is a valid out-pointer.
    ok(unsafe { dmabuf_rt_stream_create(device, &mut s) });
    s
}

/// A copy whose host side (if any) is a live Rust buffer of at least `size` bytes that
/// outlives the stream's use of it.
fn memcpy(
    dst: (c_int, usize),
    src: (c_int, usize),
    size: usize,
    kind: dmabuf_rt_memcpy_kind,
    stream: u64,
) -> dmabuf_rt_status {
    // SAFETY: see above; the tests synchronize streams before dropping host buffers.
    unsafe { dmabuf_rt_memcpy(dst.0, dst.1 as *mut c_void, src.0, src.1 as *const c_void, size, kind, stream) }
}

fn read(device: c_int, p: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    ok(memcpy((0, out.as_mut_ptr() as usize), (device, p), len, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0));
    out
}

/// Runs `f` on a thread; fails the test naming `what` if it does not finish within `limit`.
fn watchdog<T: Send + 'static>(what: &str, limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let limit = limit * time_scale();
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(_) => panic!("HANG: {what} did not finish within {limit:?}"),
    }
}

/// A stream held at a point until the test opens the gate: a callback that blocks on a channel.
struct Gate(Sender<()>);

unsafe extern "C" fn wait_for_gate(_s: dmabuf_rt_stream, _status: dmabuf_rt_status, user: *mut c_void) {
    // SAFETY: `user` is the Box<Receiver> leaked by `gate`, handed to this callback alone.
    let rx = unsafe { Box::from_raw(user.cast::<Receiver<()>>()) };
    let _ = rx.recv();
}

fn gate(stream: dmabuf_rt_stream) -> Gate {
    let (tx, rx) = channel::<()>();
    let user = Box::into_raw(Box::new(rx)).cast::<c_void>();
    // SAFETY: the callback takes ownership of `user` and runs once.
    ok(unsafe { dmabuf_rt_stream_add_callback(stream, Some(wait_for_gate), user) });
    Gate(tx)
}

impl Gate {
    fn open(self) {
        let _ = self.0.send(());
    }
}

/// Defect 1: destroying a stream while another thread synchronizes its device hung (the
/// synchronizer's inline record kept the executor asleep through Drop's wake-up), and the
/// synchronizer failed with "the queue has been dropped". Both must finish, both with OK.
#[test]
fn destroying_streams_while_another_thread_synchronizes_the_device_neither_hangs_nor_fails() {
    let _g = setup();
    watchdog("stream_destroy racing device_synchronize", Duration::from_secs(60), || {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let synced = std::sync::Arc::new(AtomicU64::new(0));
        let syncer = {
            let (stop, synced) = (stop.clone(), synced.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let s = dmabuf_rt_device_synchronize(0);
                    assert_eq!(s, DMABUF_RT_OK, "device_synchronize: {}", last_error());
                    synced.fetch_add(1, Ordering::Release);
                }
                synced.load(Ordering::Acquire)
            })
        };
        // The loop races a synchronizer that has already run (or stopped: the join re-raises).
        while synced.load(Ordering::Acquire) == 0 && !syncer.is_finished() {
            std::thread::yield_now();
        }
        let p = device_alloc(0, 4096);
        let src = [7u8; 4096];
        for _ in 0..400 {
            let s = new_stream(0);
            ok(memcpy((0, p), (0, src.as_ptr() as usize), 4096, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, s));
            ok(dmabuf_rt_stream_destroy(s));
        }
        stop.store(true, Ordering::Relaxed);
        assert!(syncer.join().unwrap() > 0);
        ok(dmabuf_rt_device_free(0, p as *mut c_void));
    });
}

/// Defect 2: a host-to-device copy queued on a stream of another device was not waited for
/// by the destination device, so a synchronous read right after it saw old bytes. Defect 3:
/// two threads reading at once, the second saw old bytes (the first took the list of such
/// copies). The stream is held by a gate, so without the fixes the readers return old bytes
/// before the gate opens; with them they wait and see the new ones.
#[test]
fn synchronous_reads_wait_for_copies_other_devices_streams_queued_into_their_memory() {
    let _g = setup();
    const N: usize = 1 << 20;
    for kind in [DMABUF_RT_MEMCPY_HOST_TO_DEVICE, DMABUF_RT_MEMCPY_PEER_TO_PEER] {
        let x = device_alloc(0, N);
        ok(dmabuf_rt_memset(0, x as *mut c_void, 0x11, N));
        let other = device_alloc(1, N);
        ok(dmabuf_rt_memset(1, other as *mut c_void, 0x22, N));
        let new = vec![0x22u8; N];
        let s1 = new_stream(1);
        let g = gate(s1);
        match kind {
            DMABUF_RT_MEMCPY_HOST_TO_DEVICE => {
                ok(memcpy((0, x), (0, new.as_ptr() as usize), N, kind, s1));
            }
            _ => ok(memcpy((0, x), (1, other), N, kind, s1)),
        }
        let (tx, rx) = channel();
        for _ in 0..2 {
            let tx = tx.clone();
            std::thread::spawn(move || tx.send(read(0, x, N)).unwrap());
        }
        // Readers that did not wait answer at once, before the gate opens.
        let early = rx.recv_timeout(Duration::from_millis(300)).ok();
        g.open();
        let mut seen: Vec<Vec<u8>> = early.into_iter().collect();
        while seen.len() < 2 {
            let limit = Duration::from_secs(30) * time_scale();
            seen.push(rx.recv_timeout(limit).expect("HANG: a synchronous read never returned"));
        }
        for (i, got) in seen.iter().enumerate() {
            assert!(got.iter().all(|&b| b == 0x22), "kind {kind}: reader {i} saw bytes from before the copy");
        }
        ok(dmabuf_rt_stream_destroy(s1));
        ok(dmabuf_rt_device_free(0, x as *mut c_void));
        ok(dmabuf_rt_device_free(1, other as *mut c_void));
        drop(new);
    }
}

/// Defect 5: device ranges were checked against the whole segment, so copies and memsets
/// past the end of an allocation, or into a freed one, were accepted and overwrote
/// neighbouring live blocks. Now only the bytes the caller asked for count.
#[test]
fn copies_and_memsets_outside_a_live_allocation_are_refused_and_change_nothing() {
    let _g = setup();
    for dev in 0..2 {
        let a = device_alloc(dev, 4096);
        let b = device_alloc(dev, 4096);
        ok(dmabuf_rt_memset(dev, b as *mut c_void, 0xbb, 4096));
        ok(dmabuf_rt_memset(dev, a as *mut c_void, 0xaa, 4096));
        let big = vec![0xeeu8; 8192];
        let refused = |s: dmabuf_rt_status, what: &str| {
            assert_eq!(s, DMABUF_RT_INVALID_POINTER, "{what}: {}", last_error());
        };
        refused(dmabuf_rt_memset(dev, a as *mut c_void, 0xee, 4097), "memset one byte past");
        refused(memcpy((dev, a), (0, big.as_ptr() as usize), 4097, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, 0), "h2d past");
        refused(memcpy((dev, a + 100), (dev, b), 4000, DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE, 0), "d2d past");
        let s = new_stream(dev);
        refused(memcpy((dev, a), (0, big.as_ptr() as usize), 8192, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, s), "async past");
        let why = last_error();
        assert!(why.contains("past the end of its allocation"), "{why}");
        ok(dmabuf_rt_stream_destroy(s));
        // A freed block is not memory the caller owns, even if the allocator keeps it.
        let c = device_alloc(dev, 4096);
        ok(dmabuf_rt_device_free(dev, c as *mut c_void));
        refused(dmabuf_rt_memset(dev, c as *mut c_void, 0xee, 16), "memset of a freed block");
        assert!(last_error().contains("freed"), "{}", last_error());
        // Nothing changed, and in-range interior ranges still work.
        assert!(read(dev, b, 4096).iter().all(|&x| x == 0xbb), "the neighbour was overwritten");
        assert!(read(dev, a, 4096).iter().all(|&x| x == 0xaa));
        ok(dmabuf_rt_memset(dev, (a + 1000) as *mut c_void, 0x33, 3096));
        assert_eq!(read(dev, a + 999, 2), [0xaa, 0x33]);
        ok(dmabuf_rt_device_free(dev, a as *mut c_void));
        ok(dmabuf_rt_device_free(dev, b as *mut c_void));
    }
}

struct CallbackCalls {
    dst: usize,
    results: Sender<[dmabuf_rt_status; 4]>,
}

unsafe extern "C" fn synchronous_work_in_a_callback(
    stream: dmabuf_rt_stream,
    _st: dmabuf_rt_status,
    user: *mut c_void,
) {
    // SAFETY: `user` is the leaked Box<CallbackCalls> given with this callback, used once.
    let c = unsafe { Box::from_raw(user.cast::<CallbackCalls>()) };
    let src = [0x5au8; 64];
    let copy = memcpy((0, c.dst), (0, src.as_ptr() as usize), 64, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, 0);
    let set = dmabuf_rt_memset(0, (c.dst + 64) as *mut c_void, 0x6b, 64);
    let sync = dmabuf_rt_device_synchronize(0);
    let own = dmabuf_rt_stream_synchronize(stream);
    let _ = c.results.send([copy, set, sync, own]);
}

/// Defect 6: a stream callback that made a synchronous memcpy, memset or device_synchronize
/// waited for its own stream, which waited for the callback: a deadlock. Those now skip the
/// callback's own stream (whose earlier work has run); synchronizing the very stream the
/// callback runs on is refused with DMABUF_RT_WOULD_DEADLOCK.
#[test]
fn synchronous_calls_from_a_stream_callback_finish_and_waiting_on_its_own_stream_is_refused() {
    let _g = setup();
    let dst = device_alloc(0, 4096);
    let s = new_stream(0);
    let other = new_stream(0);
    // Work on another stream of the device, which the callback's synchronous calls wait for.
    let pattern = vec![1u8; 4096];
    ok(memcpy((0, dst), (0, pattern.as_ptr() as usize), 4096, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, other));
    let (tx, rx) = channel();
    let user = Box::into_raw(Box::new(CallbackCalls { dst, results: tx })).cast::<c_void>();
    // SAFETY: the callback takes ownership of `user` and runs once.
    ok(unsafe { dmabuf_rt_stream_add_callback(s, Some(synchronous_work_in_a_callback), user) });
    let r = rx
        .recv_timeout(Duration::from_secs(30) * time_scale())
        .expect("HANG: a callback's synchronous calls deadlocked");
    assert_eq!(r[..3], [DMABUF_RT_OK; 3], "memcpy, memset, device_synchronize from a callback");
    assert_eq!(r[3], DMABUF_RT_WOULD_DEADLOCK, "stream_synchronize of the callback's own stream");
    watchdog("stream synchronize after the callback", Duration::from_secs(30), move || {
        ok(dmabuf_rt_stream_synchronize(s));
        ok(dmabuf_rt_stream_destroy(s));
        ok(dmabuf_rt_stream_destroy(other));
    });
    let back = read(0, dst, 4096);
    assert!(back[..64].iter().all(|&b| b == 0x5a) && back[64..128].iter().all(|&b| b == 0x6b));
    assert!(back[128..].iter().all(|&b| b == 1));
    ok(dmabuf_rt_device_free(0, dst as *mut c_void));
}

/// Defect 12: `dmabuf_rt_event_record(ev, 0)` is documented to complete at once; it was
/// queued on a stream the runtime's own synchronous work used, so under concurrency it did
/// not.
#[test]
fn an_event_recorded_on_stream_0_is_complete_at_once_while_other_threads_work() {
    let _g = setup();
    let p = device_alloc(0, 16 << 20);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let worker = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                ok(dmabuf_rt_memset(0, p as *mut c_void, 3, 16 << 20));
            }
        })
    };
    let mut ev = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_event_create(&mut ev) });
    for _ in 0..200 {
        ok(dmabuf_rt_event_record(ev, 0));
        let mut done = false;
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_event_query(ev, &mut done) });
        assert!(done, "an event recorded on stream 0 was not complete at once");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    worker.join().unwrap();
    ok(dmabuf_rt_event_destroy(ev));
    ok(dmabuf_rt_device_free(0, p as *mut c_void));
}

/// Defect 12: the pinned-host cache kept its memfds and no C call emptied it.
#[test]
fn the_pinned_host_cache_can_be_emptied_from_c() {
    let _g = setup();
    let memfds = || {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|l| {
                let l = l.to_string_lossy();
                l.contains("memfd:") || l.contains("dmabuf")
            })
            .count()
    };
    // The runtime exists before counting (its devices' caches are what they are).
    ok(dmabuf_rt_device_synchronize(0));
    let before = memfds();
    let mut p = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_host_alloc(1 << 20, &mut p) });
    ok(dmabuf_rt_host_free(p));
    ok(dmabuf_rt_host_empty_cache());
    assert_eq!(memfds(), before, "the pinned-host cache kept its memfds");
}

/// Defect 12: a SIZE_MAX copy got a message that made no sense; it is an invalid argument
/// that says what is wrong.
#[test]
fn a_copy_of_size_max_is_refused_with_a_plain_reason() {
    let _g = setup();
    let p = device_alloc(0, 4096);
    let host = [0u8; 16];
    for kind in [DMABUF_RT_MEMCPY_HOST_TO_DEVICE, DMABUF_RT_MEMCPY_DEVICE_TO_HOST] {
        let (dst, src) = if kind == DMABUF_RT_MEMCPY_HOST_TO_DEVICE {
            ((0, p), (0, host.as_ptr() as usize))
        } else {
            ((0, host.as_ptr() as usize), (0, p))
        };
        let s = memcpy(dst, src, usize::MAX, kind, 0);
        assert_ne!(s, DMABUF_RT_OK);
        let why = last_error();
        assert!(why.contains("address space") || why.contains("past the end"), "{why}");
        assert!(!why.contains("18446744073709551615-byte buffer"), "{why}");
    }
    ok(dmabuf_rt_device_free(0, p as *mut c_void));
}

struct Crossed {
    start: std::sync::Arc<std::sync::Barrier>,
    results: Sender<dmabuf_rt_status>,
}

unsafe extern "C" fn synchronize_the_device_once_both_run(
    _s: dmabuf_rt_stream,
    _st: dmabuf_rt_status,
    user: *mut c_void,
) {
    // SAFETY: `user` is the leaked Box<Crossed> given with this callback, used once.
    let c = unsafe { Box::from_raw(user.cast::<Crossed>()) };
    c.start.wait();
    let _ = c.results.send(dmabuf_rt_device_synchronize(0));
}

/// Defect 6, crossed (found by the fuzzer): callbacks on two streams of one device, both
/// running, both synchronize the device: each waits for the other's stream, which is blocked
/// in its callback. The wait that would close the cycle is refused with
/// DMABUF_RT_WOULD_DEADLOCK, and then the other finishes with OK. Never a hang.
#[test]
fn callbacks_on_two_streams_synchronizing_their_device_at_once_never_hang() {
    let _g = setup();
    for round in 0..50 {
        let (a, b) = (new_stream(0), new_stream(0));
        let start = std::sync::Arc::new(std::sync::Barrier::new(2));
        let (tx, rx) = channel();
        for s in [a, b] {
            let user = Box::into_raw(Box::new(Crossed { start: start.clone(), results: tx.clone() })).cast::<c_void>();
            // SAFETY: the callback takes ownership of `user` and runs once.
            ok(unsafe { dmabuf_rt_stream_add_callback(s, Some(synchronize_the_device_once_both_run), user) });
        }
        let limit = Duration::from_secs(30) * time_scale();
        let mut got = [
            rx.recv_timeout(limit).expect("HANG: crossed callbacks synchronizing their device"),
            rx.recv_timeout(limit).expect("HANG: crossed callbacks synchronizing their device"),
        ];
        got.sort_by_key(|s| *s as i32);
        assert_eq!(got, [DMABUF_RT_OK, DMABUF_RT_WOULD_DEADLOCK], "round {round}");
        ok(dmabuf_rt_stream_destroy(a));
        ok(dmabuf_rt_stream_destroy(b));
    }
}

/// The hostile review's reproducers (a reviewer who had not written the code attacked the
/// fixes as a hostile C caller); each was a hang, a lost copy or shared bytes, now fixed.
mod hostile_review {
    use super::{last_error, ok, setup};
    use std::ffi::{CStr, c_int, c_void};
    use std::ptr::null_mut;
    use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
    use std::time::{Duration, Instant};

    use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;
    use dmabuf_rt::ffi::capi::*;

    fn device_alloc(device: c_int, size: usize) -> *mut c_void {
        let mut p = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_device_alloc(device, size, &mut p) });
        p
    }

    fn new_stream(device: c_int) -> dmabuf_rt_stream {
        let mut s = 0;
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_stream_create(device, &mut s) });
        s
    }

    fn new_event() -> dmabuf_rt_event {
        let mut e = 0;
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_event_create(&mut e) });
        e
    }

    fn memcpy(
        (dd, d): (c_int, *mut c_void),
        (sd, s): (c_int, *const c_void),
        n: usize,
        kind: c_int,
        stream: dmabuf_rt_stream,
    ) -> dmabuf_rt_status {
        // SAFETY: host sides are live buffers of `n` bytes, synchronized before use.
        unsafe { dmabuf_rt_memcpy(dd, d, sd, s, n, kind, stream) }
    }

    /// Waits up to `limit` for `flag`; false on timeout.
    fn wait_flag(flag: &AtomicBool, limit: Duration) -> bool {
        let t = Instant::now();
        while !flag.load(Ordering::Acquire) {
            if t.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    // ---------------------------------------------------------------------------------------------

    /// `dmabuf_rt_status_name` must name every status the library returns.
    #[test]
    fn status_name_knows_every_status() {
        for (s, name) in [(7, "DMABUF_RT_RESOURCE_LIMIT"), (8, "DMABUF_RT_WOULD_DEADLOCK")] {
            // SAFETY: a static string.
            let got = unsafe { CStr::from_ptr(dmabuf_rt_status_name(s)) }.to_str().unwrap().to_owned();
            assert_eq!(got, name, "status {s}");
        }
    }

    // ---------------------------------------------------------------------------------------------

    /// A device-to-device copy whose SOURCE is on another device than the stream's: a later
    /// synchronous memset of the source (on the source's device) must wait for the queued copy
    /// to read it. Otherwise the copy reads the memset's bytes (write-after-read hazard).
    #[test]
    fn cross_device_d2d_source_is_waited_for_by_its_device() {
        let _g = setup();
        const N: usize = 4096;
        let s0 = new_stream(0);
        let dst = device_alloc(0, N);
        let src = device_alloc(1, N);
        let pat: Vec<u8> = (0..N).map(|i| (i % 251) as u8).collect();
        ok(memcpy((1, src), (0, pat.as_ptr().cast()), N, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, 0));
        // Hold the stream back (a callback blocked on a channel) so the copy is still queued
        // when the memset comes.
        extern "C" fn hold(_: dmabuf_rt_stream, _: dmabuf_rt_status, u: *mut c_void) {
            // SAFETY: the leaked Receiver given with this callback, used once.
            let rx = unsafe { Box::from_raw(u.cast::<std::sync::mpsc::Receiver<()>>()) };
            let _ = rx.recv();
        }
        let (open, gate) = std::sync::mpsc::channel::<()>();
        let u = Box::into_raw(Box::new(gate)).cast::<c_void>();
        // SAFETY: the callback takes ownership of `u` and runs once.
        ok(unsafe { dmabuf_rt_stream_add_callback(s0, Some(hold), u) });
        // dst on device 0, src on device 1, stream on device 0 (the C docs allow D2D across devices).
        ok(memcpy((0, dst), (1, src), N, DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE, s0));
        // A synchronous memset of the source on device 1 must come after the queued read: it
        // waits for the stream, so it cannot finish before the gate opens. One that returns
        // early did not wait.
        let (tx, rx) = std::sync::mpsc::channel();
        let src_a = src as usize;
        std::thread::spawn(move || tx.send(dmabuf_rt_memset(1, src_a as *mut c_void, 0xEE, N)).unwrap());
        let early = rx.recv_timeout(Duration::from_millis(300)).ok();
        open.send(()).unwrap();
        let st = match early {
            Some(st) => st,
            None => rx.recv_timeout(Duration::from_secs(30)).expect("HANG: memset never returned"),
        };
        ok(st);
        ok(dmabuf_rt_stream_synchronize(s0));
        let mut back = vec![0u8; N];
        ok(memcpy((0, back.as_mut_ptr().cast()), (0, dst), N, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0));
        let bad = back.iter().zip(&pat).filter(|(a, b)| a != b).count();
        ok(dmabuf_rt_device_free(0, dst));
        ok(dmabuf_rt_device_free(1, src));
        ok(dmabuf_rt_stream_destroy(s0));
        assert_eq!(
            bad, 0,
            "the queued copy read {bad} bytes written by a LATER synchronous memset (first: {:#x})",
            back[0]
        );
    }

    // ---------------------------------------------------------------------------------------------

    struct Cross {
        a: dmabuf_rt_stream,
        b: dmabuf_rt_stream,
        ev: dmabuf_rt_event,
        b_waiting: AtomicBool,
        a_done: AtomicBool,
        a_status: AtomicI32,
        b_status: AtomicI32,
    }

    /// A stream callback destroys another stream whose callback is waiting for work on the
    /// first stream. Destroy used to join that stream's executor, and the two waited for each
    /// other forever; from a callback it now returns at once (as cudaStreamDestroy).
    #[test]
    fn destroying_a_stream_from_a_callback_while_its_callback_waits_on_the_caller_never_hangs() {
        let _g = setup();
        let a = new_stream(0);
        let b = new_stream(0);
        let ev = new_event();
        let x: &'static Cross = Box::leak(Box::new(Cross {
            a,
            b,
            ev,
            b_waiting: AtomicBool::new(false),
            a_done: AtomicBool::new(false),
            a_status: AtomicI32::new(-1),
            b_status: AtomicI32::new(-1),
        }));
        extern "C" fn on_a(_: dmabuf_rt_stream, _: dmabuf_rt_status, u: *mut c_void) {
            // SAFETY: a leaked Cross.
            let x = unsafe { &*(u as *const Cross) };
            wait_flag(&x.b_waiting, Duration::from_secs(5));
            std::thread::sleep(Duration::from_millis(100));
            let s = dmabuf_rt_stream_destroy(x.b);
            x.a_status.store(s as i32, Ordering::Release);
            x.a_done.store(true, Ordering::Release);
        }
        extern "C" fn on_b(_: dmabuf_rt_stream, _: dmabuf_rt_status, u: *mut c_void) {
            // SAFETY: a leaked Cross.
            let x = unsafe { &*(u as *const Cross) };
            x.b_waiting.store(true, Ordering::Release);
            let s = dmabuf_rt_event_synchronize(x.ev); // recorded on A after on_a
            x.b_status.store(s as i32, Ordering::Release);
        }
        let u = x as *const Cross as *mut c_void;
        // SAFETY: plain functions, leaked user data.
        ok(unsafe { dmabuf_rt_stream_add_callback(a, Some(on_a), u) });
        ok(dmabuf_rt_event_record(ev, a));
        // SAFETY: as above.
        ok(unsafe { dmabuf_rt_stream_add_callback(b, Some(on_b), u) });
        let done = wait_flag(&x.a_done, Duration::from_secs(10));
        assert!(
            done,
            "stream_destroy(B) called from A's callback never returned (B's callback waits for A; A joins B): hang; \
             b_waiting={} b_status={}",
            x.b_waiting.load(Ordering::Acquire),
            x.b_status.load(Ordering::Acquire)
        );
        assert_eq!(x.a_status.load(Ordering::Acquire), DMABUF_RT_OK as i32);
        ok(dmabuf_rt_stream_destroy(x.a));
        ok(dmabuf_rt_event_destroy(x.ev));
    }

    // ---------------------------------------------------------------------------------------------

    struct Own {
        s: dmabuf_rt_stream,
        done: AtomicBool,
        status: AtomicI32,
    }

    /// A stream callback that destroys its own stream: no hang, no internal panic; it returns
    /// at once and the stream finishes on its own.
    #[test]
    fn destroy_own_stream_from_its_callback() {
        let _g = setup();
        let s = new_stream(0);
        let o: &'static Own = Box::leak(Box::new(Own { s, done: AtomicBool::new(false), status: AtomicI32::new(-1) }));
        extern "C" fn cb(_: dmabuf_rt_stream, _: dmabuf_rt_status, u: *mut c_void) {
            // SAFETY: leaked Own.
            let o = unsafe { &*(u as *const Own) };
            let st = dmabuf_rt_stream_destroy(o.s);
            o.status.store(st as i32, Ordering::Release);
            eprintln!("in-callback destroy: {} ({})", st as i32, last_error());
            o.done.store(true, Ordering::Release);
        }
        // SAFETY: plain function, leaked data.
        ok(unsafe { dmabuf_rt_stream_add_callback(s, Some(cb), o as *const Own as *mut c_void) });
        assert!(wait_flag(&o.done, Duration::from_secs(10)), "destroy of its own stream from its callback hung");
        let st = o.status.load(Ordering::Acquire);
        // After it: the handle is gone, the device still synchronizes.
        let t = Instant::now();
        let sync = dmabuf_rt_device_synchronize(0);
        eprintln!("device_synchronize after: {} in {:?}", sync as i32, t.elapsed());
        // As cudaStreamDestroy: it returns at once and the stream finishes its work on its own.
        assert_eq!(st, DMABUF_RT_OK as i32, "status {st}");
        assert_eq!(sync, DMABUF_RT_OK);
        assert_eq!(dmabuf_rt_stream_synchronize(s), DMABUF_RT_INVALID_HANDLE, "the handle is gone");
    }

    // ---------------------------------------------------------------------------------------------

    fn synced_create(device: c_int, size: usize) -> dmabuf_rt_synced {
        let mut s = 0;
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_synced_create(device, size, false, &mut s) });
        s
    }

    fn synced_mut_dev(s: dmabuf_rt_synced) -> *mut c_void {
        let mut p = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_synced_mutable_device_data(s, &mut p) });
        p
    }

    /// `dmabuf_rt_synced_set_device_data` documents that `data` must be device memory from
    /// `dmabuf_rt_device_alloc` or ANOTHER SyncedMemory's device pointer, "else
    /// DMABUF_RT_INVALID_POINTER", and that the SyncedMemory's own device memory is freed now.
    /// Lending a SyncedMemory its own device pointer would free that block while the object
    /// keeps using it, and the next allocation would get the same bytes: refused.
    #[test]
    fn synced_set_device_data_with_its_own_pointer_is_refused() {
        let _g = setup();
        const N: usize = 8192;
        let a = synced_create(0, N);
        let pa = synced_mut_dev(a);
        let st = dmabuf_rt_synced_set_device_data(a, pa);
        assert_eq!(st, DMABUF_RT_INVALID_POINTER, "lent its own buffer: {}", last_error());
        assert!(last_error().contains("own buffer"), "{}", last_error());
        // Unchanged: it still owns its device data, at the same place.
        let mut again = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_synced_mutable_device_data(a, &mut again) });
        assert_eq!(again, pa);
        let b = synced_create(0, N);
        assert_ne!(synced_mut_dev(b), pa, "another object was handed A's live block");
        ok(dmabuf_rt_synced_destroy(b));
        ok(dmabuf_rt_synced_destroy(a));
    }
}

unsafe extern "C" fn destroy_the_stream_in_user_data(
    _s: dmabuf_rt_stream,
    _status: dmabuf_rt_status,
    user: *mut c_void,
) {
    let _ = dmabuf_rt_stream_destroy(user as usize as dmabuf_rt_stream);
}

/// A stream destroyed from a callback returns at once and drains on its own: until it has, a
/// device synchronize must still wait for its work (the runtime used to stop tracking it
/// first, so the synchronize returned before that work ran).
#[test]
fn a_stream_destroyed_from_a_callback_is_still_waited_for_by_device_synchronize() {
    let _g = setup();
    const N: usize = 64 << 10;
    for round in 0..8 {
        let x = device_alloc(0, N);
        ok(dmabuf_rt_memset(0, x as *mut c_void, 0x11, N));
        let (s, killer) = (new_stream(0), new_stream(0));
        let g = gate(s);
        let new = vec![0x33u8; N];
        ok(memcpy((0, x), (0, new.as_ptr() as usize), N, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, s));
        // SAFETY: the callback only passes the handle back to the C API.
        ok(unsafe {
            dmabuf_rt_stream_add_callback(killer, Some(destroy_the_stream_in_user_data), s as usize as *mut c_void)
        });
        ok(dmabuf_rt_stream_synchronize(killer));
        assert_eq!(dmabuf_rt_stream_synchronize(s), DMABUF_RT_INVALID_HANDLE, "the stream was not destroyed");
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            let r = dmabuf_rt_device_synchronize(0);
            tx.send((r, read(0, x, N))).unwrap();
        });
        // A synchronize that did not wait answers at once, before the gate opens.
        let early = rx.recv_timeout(Duration::from_millis(300)).ok();
        g.open();
        let (r, got) = match early {
            Some(v) => v,
            None => rx.recv_timeout(Duration::from_secs(30) * time_scale()).expect("HANG: device synchronize"),
        };
        ok(r);
        assert!(
            got.iter().all(|&b| b == 0x33),
            "round {round}: device synchronize returned before the destroyed stream's copy"
        );
        ok(dmabuf_rt_stream_destroy(killer));
        ok(dmabuf_rt_device_free(0, x as *mut c_void));
        drop(new);
    }
}
