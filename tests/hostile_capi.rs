//! From the hostile review of issue 9 (a hostile C caller): each test is the reviewer's minimal
//! reproducer of a defect, now fixed. The tests share the process-wide runtime and run one at
//! a time (`setup`); a hang is caught by a bounded wait.

#![allow(unsafe_code)]

use std::ffi::{CStr, c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Mutex, MutexGuard, Once};
use std::time::{Duration, Instant};

use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;
use dmabuf_rt::ffi::capi::*;

fn setup() -> MutexGuard<'static, ()> {
    static ENV: Once = Once::new();
    static SERIAL: Mutex<()> = Mutex::new(());
    ENV.call_once(|| {
        // SAFETY: before any other thread reads the environment.
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
    // SAFETY: NUL-terminated, owned by this thread.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[track_caller]
fn ok(s: dmabuf_rt_status) {
    assert_eq!(s, DMABUF_RT_OK, "call failed: {}", if s == DMABUF_RT_OK { String::new() } else { last_error() });
}

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
