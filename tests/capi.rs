//! The C API (`include/dmabuf_rt.h`) called the way a C program calls it: the `extern "C"`
//! functions directly, with raw pointers and handles. Bad input (NULL out-pointers, size 0,
//! foreign, interior and double frees, out-of-range devices, NULL copy pointers, destroyed
//! handles, more than the capacity) must return an error status with a reason in
//! `dmabuf_rt_last_error`, write nothing, and leave the allocator working with consistent
//! statistics. `examples/c/` runs the same cases from C.
//!
//! The runtime is process-wide and reads its environment once, so every test first calls
//! [`setup`]: it sets two shmem devices (peer copies need two) and a 256 MiB capacity before
//! the first call, and serializes the tests (they compare the shared allocators' statistics
//! before and after).

#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_void};
use std::ptr::{null, null_mut};
use std::sync::{Mutex, MutexGuard, Once};

use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;
use dmabuf_rt::ffi::capi::*;

const CAPACITY: u64 = 256 << 20;

fn setup() -> MutexGuard<'static, ()> {
    static ENV: Once = Once::new();
    static SERIAL: Mutex<()> = Mutex::new(());
    ENV.call_once(|| {
        // SAFETY: every test calls `setup` before anything else, and `call_once` holds the
        // others until this returns, so no thread of this process reads the environment
        // while it is written (the runtime reads it on the first C call, after this).
        unsafe {
            std::env::set_var("DMABUF_RT_DEVICES", "shmem,shmem");
        }
        // SAFETY: as above.
        unsafe {
            std::env::set_var("DMABUF_RT_CAPACITY", "256M");
        }
    });
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn last_error() -> String {
    let p = dmabuf_rt_last_error();
    assert!(!p.is_null(), "dmabuf_rt_last_error() is NULL after a failure");
    // SAFETY: a non-null last error is a NUL-terminated string valid until this thread's next
    // failing call.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Asserts that a call failed with `want` and left a reason naming the function.
#[track_caller]
fn refused(got: dmabuf_rt_status, want: dmabuf_rt_status, func: &str) -> String {
    assert_eq!(got, want, "{func}: wrong status");
    let why = last_error();
    assert!(why.starts_with(&format!("{func}: ")), "{func}: last error `{why}` does not name the function");
    why
}

#[track_caller]
fn ok(s: dmabuf_rt_status) {
    assert_eq!(s, DMABUF_RT_OK, "call failed: {}", if s == DMABUF_RT_OK { String::new() } else { last_error() });
}

fn stats(device: c_int) -> dmabuf_rt_stats {
    let mut s = dmabuf_rt_stats::default();
    // SAFETY: `s` is a valid out-pointer.
    ok(unsafe { dmabuf_rt_device_stats(device, &mut s) });
    s
}

fn alloc(device: c_int, size: usize) -> (dmabuf_rt_status, *mut c_void) {
    let mut p = null_mut();
    // SAFETY: `p` is a valid out-pointer.
    let s = unsafe { dmabuf_rt_device_alloc(device, size, &mut p) };
    (s, p)
}

fn device_alloc(device: c_int, size: usize) -> *mut c_void {
    let (s, p) = alloc(device, size);
    ok(s);
    assert!(!p.is_null());
    p
}

/// A copy whose host side is `host` (a Rust buffer alive for the call).
fn memcpy(
    (dst_dev, dst): (c_int, *mut c_void),
    (src_dev, src): (c_int, *const c_void),
    size: usize,
    kind: dmabuf_rt_memcpy_kind,
    stream: dmabuf_rt_stream,
) -> dmabuf_rt_status {
    // SAFETY: the tests pass host sides that are live Rust buffers of at least `size` bytes,
    // and synchronize any stream before reading or dropping them.
    unsafe { dmabuf_rt_memcpy(dst_dev, dst, src_dev, src, size, kind, stream) }
}

fn new_stream(device: c_int) -> dmabuf_rt_stream {
    let mut s = 0;
    // SAFETY: `s` is a valid out-pointer.
    ok(unsafe { dmabuf_rt_stream_create(device, &mut s) });
    assert_ne!(s, 0);
    s
}

fn new_event() -> dmabuf_rt_event {
    let mut e = 0;
    // SAFETY: `e` is a valid out-pointer.
    ok(unsafe { dmabuf_rt_event_create(&mut e) });
    assert_ne!(e, 0);
    e
}

/// The allocator still works: allocate, fill, read back, free; live allocations unchanged.
#[track_caller]
fn still_works(before: &[dmabuf_rt_stats; 2]) {
    for dev in 0..2 {
        let p = device_alloc(dev, 4096);
        ok(dmabuf_rt_memset(dev, p, 0x5a, 4096));
        let mut back = vec![0u8; 4096];
        ok(memcpy((0, back.as_mut_ptr().cast()), (dev, p), 4096, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0));
        assert!(back.iter().all(|&b| b == 0x5a));
        ok(dmabuf_rt_device_free(dev, p));
        let after = stats(dev);
        let b = before[dev as usize];
        assert_eq!(after.allocated_bytes, b.allocated_bytes, "device {dev}: allocated bytes changed");
        assert_eq!(after.allocations, b.allocations, "device {dev}: live allocations changed");
        assert_eq!(after.num_allocs - b.num_allocs, after.num_frees - b.num_frees, "device {dev}: allocs != frees");
    }
}

fn before() -> [dmabuf_rt_stats; 2] {
    [stats(0), stats(1)]
}

#[test]
fn devices_names_and_versions() {
    let _g = setup();
    let mut n = 0;
    // SAFETY: `n` is a valid out-pointer.
    ok(unsafe { dmabuf_rt_device_count(&mut n) });
    assert_eq!(n, 2);
    let mut buf = [0 as c_char; 64];
    // SAFETY: `buf` is valid for its length.
    ok(unsafe { dmabuf_rt_device_name(1, buf.as_mut_ptr(), buf.len()) });
    // SAFETY: the call wrote a NUL-terminated string into `buf`.
    assert_eq!(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap(), "shmem");
    // A buffer too small is refused and left untouched.
    let mut small = [7 as c_char; 5];
    // SAFETY: `small` is valid for its length.
    let s = unsafe { dmabuf_rt_device_name(0, small.as_mut_ptr(), small.len()) };
    refused(s, DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_device_name");
    assert!(small.iter().all(|&c| c == 7));
    // SAFETY: a static string.
    let v = unsafe { CStr::from_ptr(dmabuf_rt_version()) };
    assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    for (code, name) in [(0, "DMABUF_RT_OK"), (3, "DMABUF_RT_INVALID_POINTER"), (42, "unknown status")] {
        // SAFETY: a static string.
        assert_eq!(unsafe { CStr::from_ptr(dmabuf_rt_status_name(code)) }.to_str().unwrap(), name);
    }
    let (mut total, mut free) = (0, 0);
    // SAFETY: valid out-pointers.
    ok(unsafe { dmabuf_rt_device_memory(0, &mut total, &mut free) });
    assert_eq!(total, CAPACITY);
    assert!(free <= total);
    assert_eq!(stats(1).capacity_bytes, CAPACITY);
}

#[test]
fn current_device_is_per_thread() {
    let _g = setup();
    let mut d = 7;
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_get_device(&mut d) });
    assert_eq!(d, 0);
    ok(dmabuf_rt_set_device(1));
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_get_device(&mut d) });
    assert_eq!(d, 1);
    // DMABUF_RT_CURRENT_DEVICE names it.
    let p = device_alloc(DMABUF_RT_CURRENT_DEVICE, 1000);
    refused(dmabuf_rt_device_free(0, p), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free");
    ok(dmabuf_rt_device_free(1, p));
    std::thread::spawn(|| {
        let mut d = 7;
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_get_device(&mut d) });
        assert_eq!(d, 0, "a new thread starts on device 0");
    })
    .join()
    .unwrap();
    ok(dmabuf_rt_set_device(0));
}

#[test]
fn tour_copies_streams_events_stats() {
    let _g = setup();
    ok(dmabuf_rt_empty_cache(0));
    ok(dmabuf_rt_empty_cache(1));
    let base = before();
    const N: usize = 3 << 20;
    let src: Vec<u8> = (0..N).map(|i| (i * 7 + i / 4096) as u8).collect();
    let (a, b, c) = (device_alloc(0, N), device_alloc(0, N), device_alloc(1, N));
    ok(memcpy((0, a), (0, src.as_ptr().cast()), N, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, 0));
    ok(memcpy((0, b), (0, a), N, DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE, 0));
    ok(memcpy((1, c), (0, b), N, DMABUF_RT_MEMCPY_PEER_TO_PEER, 0));
    let mut out = vec![0u8; N];
    ok(memcpy((0, out.as_mut_ptr().cast()), (1, c), N, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0));
    assert!(out == src, "synchronous round trip");

    // The same on a stream, with an event and a callback; an interior pointer too.
    let s = new_stream(1);
    let ev = new_event();
    ok(memset_dev(0, b, 0, N));
    ok(memcpy((0, b), (0, src.as_ptr().cast()), N, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, s));
    ok(memcpy((1, c), (0, b), N, DMABUF_RT_MEMCPY_PEER_TO_PEER, s));
    let mut out2 = vec![0u8; N - 100];
    // SAFETY: `c + 100` is inside the block of N bytes.
    let interior = unsafe { c.byte_add(100) };
    ok(memcpy((0, out2.as_mut_ptr().cast()), (1, interior), N - 100, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, s));
    ok(dmabuf_rt_event_record(ev, s));
    static CALLED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    unsafe extern "C" fn cb(_s: dmabuf_rt_stream, status: dmabuf_rt_status, user: *mut c_void) {
        assert_eq!(status, DMABUF_RT_OK);
        CALLED.fetch_add(user as usize, std::sync::atomic::Ordering::SeqCst);
    }
    // SAFETY: `cb` may run on any thread; its user data is a plain number.
    ok(unsafe { dmabuf_rt_stream_add_callback(s, Some(cb), 5 as *mut c_void) });
    let s2 = new_stream(0);
    ok(dmabuf_rt_stream_wait_event(s2, ev));
    ok(dmabuf_rt_event_synchronize(ev));
    let mut done = false;
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_event_query(ev, &mut done) });
    assert!(done);
    assert!(out2[..] == src[100..], "stream round trip");
    ok(dmabuf_rt_stream_synchronize(s));
    ok(dmabuf_rt_stream_synchronize(s2));
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_stream_query(s, &mut done) });
    assert!(done);
    assert_eq!(CALLED.load(std::sync::atomic::Ordering::SeqCst), 5);

    let mid = stats(0);
    assert_eq!(mid.allocated_bytes - base[0].allocated_bytes, 2 * N as u64);
    assert_eq!(mid.allocations - base[0].allocations, 2);
    assert!(mid.peak_allocated_bytes >= mid.allocated_bytes);
    assert!(mid.reserved_bytes >= mid.allocated_bytes);
    let mut json: *mut c_char = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_snapshot_json(0, &mut json) });
    // SAFETY: a NUL-terminated string we own until dmabuf_rt_string_free.
    let text = unsafe { CStr::from_ptr(json) }.to_str().unwrap().to_owned();
    assert!(text.starts_with("{\"device\":0,\"spec\":\"shmem\",\"stats\":{"), "{text}");
    assert!(text.contains("\"segments\":[{") && text.contains("active_allocated"), "{text}");
    ok(dmabuf_rt_string_free(json));

    for (dev, p) in [(0, a), (0, b), (1, c)] {
        ok(dmabuf_rt_device_free(dev, p));
    }
    ok(dmabuf_rt_stream_destroy(s));
    ok(dmabuf_rt_stream_destroy(s2));
    ok(dmabuf_rt_event_destroy(ev));
    ok(dmabuf_rt_empty_cache(0));
    ok(dmabuf_rt_empty_cache(1));
    for dev in 0..2 {
        let st = stats(dev);
        assert_eq!(st.allocated_bytes, base[dev as usize].allocated_bytes);
        assert_eq!(st.reserved_bytes, 0, "device {dev}: empty_cache left {} bytes reserved", st.reserved_bytes);
        let b = base[dev as usize];
        // Relative to the start: another test resets the accumulated counts.
        assert_eq!((st.num_allocs - b.num_allocs) - (st.num_frees - b.num_frees), st.allocations - b.allocations);
    }

    // Pinned host and unified memory as the host side.
    for (alloc, free) in [
        (
            dmabuf_rt_host_alloc as unsafe extern "C" fn(usize, *mut *mut c_void) -> dmabuf_rt_status,
            dmabuf_rt_host_free as extern "C" fn(*mut c_void) -> dmabuf_rt_status,
        ),
        (dmabuf_rt_unified_alloc, dmabuf_rt_unified_free),
    ] {
        let mut h = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { alloc(4096, &mut h) });
        let d = device_alloc(0, 4096);
        ok(dmabuf_rt_memset(0, d, 0xab, 4096));
        ok(memcpy((0, h), (0, d), 4096, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0));
        // SAFETY: `h` is 4096 bytes of host memory the copy wrote.
        let got = unsafe { std::slice::from_raw_parts(h.cast::<u8>(), 4096) };
        assert!(got.iter().all(|&x| x == 0xab));
        ok(dmabuf_rt_device_free(0, d));
        ok(free(h));
    }
}

fn memset_dev(dev: c_int, p: *mut c_void, v: c_int, n: usize) -> dmabuf_rt_status {
    dmabuf_rt_memset(dev, p, v, n)
}

#[test]
fn null_and_misaligned_out_pointers_are_refused() {
    let _g = setup();
    let base = before();
    // SAFETY: NULL or misaligned out-pointers are refused before any write, which is what is
    // tested here and below; the other pointers are valid.
    let s = unsafe { dmabuf_rt_device_count(null_mut()) };
    refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_count");
    // SAFETY: as above.
    let s = unsafe { dmabuf_rt_device_name(0, null_mut(), 64) };
    refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_name");
    // SAFETY: as above.
    let s = unsafe { dmabuf_rt_get_device(null_mut()) };
    refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_get_device");
    let mut t = 0;
    // SAFETY: as above.
    let s = unsafe { dmabuf_rt_device_memory(0, &mut t, null_mut()) };
    refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_memory");
    // SAFETY: as above.
    let s = unsafe { dmabuf_rt_device_alloc(0, 4096, null_mut()) };
    let why = refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_alloc");
    assert!(why.contains("ptr"), "{why}");
    // SAFETY: as above.
    let s = unsafe { dmabuf_rt_host_alloc(4096, null_mut()) };
    refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_host_alloc");
    // SAFETY: as above.
    let s = unsafe { dmabuf_rt_unified_alloc(4096, null_mut()) };
    refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_unified_alloc");
    // SAFETY: as above.
    let s = unsafe { dmabuf_rt_stream_create(0, null_mut()) };
    refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_stream_create");
    // SAFETY: as above.
    let s = unsafe { dmabuf_rt_event_create(null_mut()) };
    refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_event_create");
    let (st, ev) = (new_stream(0), new_event());
    // SAFETY: as above.
    let s = unsafe { dmabuf_rt_stream_query(st, null_mut()) };
    refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_stream_query");
    // SAFETY: as above.
    let s = unsafe { dmabuf_rt_event_query(ev, null_mut()) };
    refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_event_query");
    // SAFETY: as above.
    let s = unsafe { dmabuf_rt_device_stats(0, null_mut()) };
    refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_stats");
    // SAFETY: as above.
    let s = unsafe { dmabuf_rt_snapshot_json(0, null_mut()) };
    refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_snapshot_json");
    // SAFETY: as above (a NULL callback is refused too).
    let s = unsafe { dmabuf_rt_stream_add_callback(st, None, null_mut()) };
    refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_stream_add_callback");
    // Misaligned: refused, and the bytes around it untouched.
    let mut raw = [0u64; 32];
    let odd = raw.as_mut_ptr().cast::<u8>().wrapping_add(1).cast::<dmabuf_rt_stats>();
    // SAFETY: as above.
    let s = unsafe { dmabuf_rt_device_stats(0, odd) };
    let why = refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_stats");
    assert!(why.contains("aligned"), "{why}");
    assert!(raw.iter().all(|&x| x == 0));
    let odd = raw.as_mut_ptr().cast::<u8>().wrapping_add(4).cast::<*mut c_void>();
    // SAFETY: as above.
    let s = unsafe { dmabuf_rt_device_alloc(0, 4096, odd) };
    refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_alloc");
    assert!(raw.iter().all(|&x| x == 0));
    ok(dmabuf_rt_stream_destroy(st));
    ok(dmabuf_rt_event_destroy(ev));
    // Nothing was allocated by the refused calls.
    assert_eq!(stats(0).num_allocs, base[0].num_allocs);
    still_works(&base);
}

#[test]
fn size_zero_is_refused() {
    let _g = setup();
    let base = before();
    let sentinel = 0x1234 as *mut c_void;
    let mut p = sentinel;
    // SAFETY: valid out-pointer.
    let s = unsafe { dmabuf_rt_device_alloc(0, 0, &mut p) };
    refused(s, DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_device_alloc");
    assert_eq!(p, sentinel, "a failed call wrote its out-pointer");
    // SAFETY: valid out-pointer.
    let s = unsafe { dmabuf_rt_host_alloc(0, &mut p) };
    refused(s, DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_host_alloc");
    // SAFETY: valid out-pointer.
    let s = unsafe { dmabuf_rt_unified_alloc(0, &mut p) };
    refused(s, DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_unified_alloc");
    assert_eq!(p, sentinel);
    // Copies and fills of 0 bytes do nothing, whatever the pointers.
    ok(memcpy((0, null_mut()), (0, null()), 0, DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE, 0));
    ok(dmabuf_rt_memset(0, null_mut(), 0, 0));
    still_works(&base);
}

#[test]
fn foreign_interior_and_double_frees_are_refused() {
    let _g = setup();
    let base = before();
    let mut local = [0u64; 64];
    let foreign = local.as_mut_ptr().cast::<c_void>();
    refused(dmabuf_rt_device_free(0, foreign), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free");
    refused(dmabuf_rt_device_free(0, null_mut()), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free");
    let p = device_alloc(0, 10_000);
    let q = device_alloc(0, 10_000);
    // SAFETY: inside the block.
    let interior = unsafe { p.byte_add(512) };
    refused(dmabuf_rt_device_free(0, interior), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free");
    // Device 0's pointer freed on device 1.
    refused(dmabuf_rt_device_free(1, p), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free");
    ok(dmabuf_rt_device_free(0, p));
    let why = refused(dmabuf_rt_device_free(0, p), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free");
    assert!(why.contains("double free") || why.contains("already freed"), "{why}");
    // The neighbour is intact and the freed block is reused normally.
    ok(dmabuf_rt_memset(0, q, 1, 10_000));
    let r = device_alloc(0, 10_000);
    ok(dmabuf_rt_device_free(0, r));
    ok(dmabuf_rt_device_free(0, q));
    refused(dmabuf_rt_device_free(0, q), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free");

    // Pinned host, unified and strings.
    refused(dmabuf_rt_host_free(foreign), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_host_free");
    refused(dmabuf_rt_unified_free(foreign), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_unified_free");
    let (mut h, mut u) = (null_mut(), null_mut());
    // SAFETY: valid out-pointers.
    ok(unsafe { dmabuf_rt_host_alloc(100, &mut h) });
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_unified_alloc(100, &mut u) });
    refused(dmabuf_rt_device_free(0, h), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free");
    refused(dmabuf_rt_unified_free(h), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_unified_free");
    refused(dmabuf_rt_host_free(u), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_host_free");
    ok(dmabuf_rt_host_free(h));
    refused(dmabuf_rt_host_free(h), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_host_free");
    ok(dmabuf_rt_unified_free(u));
    refused(dmabuf_rt_unified_free(u), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_unified_free");
    let mut json = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_snapshot_json(1, &mut json) });
    refused(dmabuf_rt_string_free(foreign.cast()), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_string_free");
    ok(dmabuf_rt_string_free(json));
    refused(dmabuf_rt_string_free(json), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_string_free");
    ok(dmabuf_rt_string_free(null_mut()));
    still_works(&base);
}

#[test]
fn out_of_range_devices_are_refused() {
    let _g = setup();
    let base = before();
    for dev in [2, 99, -2, c_int::MIN, c_int::MAX] {
        let (s, p) = alloc(dev, 4096);
        let why = refused(s, DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_device_alloc");
        assert!(why.contains("does not exist"), "{why}");
        assert!(p.is_null());
        refused(dmabuf_rt_set_device(dev), DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_set_device");
        refused(dmabuf_rt_device_free(dev, 0x1000 as *mut c_void), DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_device_free");
        refused(dmabuf_rt_memset(dev, 0x1000 as *mut c_void, 0, 1), DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_memset");
        refused(dmabuf_rt_device_synchronize(dev), DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_device_synchronize");
        refused(dmabuf_rt_empty_cache(dev), DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_empty_cache");
        refused(dmabuf_rt_reset_peak_stats(dev), DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_reset_peak_stats");
        let mut st = dmabuf_rt_stats::default();
        // SAFETY: valid out-pointer.
        let s = unsafe { dmabuf_rt_device_stats(dev, &mut st) };
        refused(s, DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_device_stats");
        let mut h = 0;
        // SAFETY: valid out-pointer.
        let s = unsafe { dmabuf_rt_stream_create(dev, &mut h) };
        refused(s, DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_stream_create");
        let mut buf = [0 as c_char; 32];
        // SAFETY: valid for its length.
        let s = unsafe { dmabuf_rt_device_name(dev, buf.as_mut_ptr(), buf.len()) };
        refused(s, DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_device_name");
        let mut host = [0u8; 16];
        let s =
            memcpy((dev, host.as_mut_ptr().cast()), (0, host.as_ptr().cast()), 16, DMABUF_RT_MEMCPY_PEER_TO_PEER, 0);
        refused(s, DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_memcpy");
    }
    let mut d = 9;
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_get_device(&mut d) });
    assert_eq!(d, 0, "a refused set_device changed the current device");
    still_works(&base);
}

#[test]
fn bad_copies_are_refused() {
    let _g = setup();
    let base = before();
    let d0 = device_alloc(0, 8192);
    let d1 = device_alloc(1, 8192);
    let mut host = vec![0u8; 8192];
    let h = host.as_mut_ptr().cast::<c_void>();
    let st = new_stream(0);
    for stream in [0, st] {
        for (dst, src, kind) in [
            ((0, null_mut()), (0, h.cast_const()), DMABUF_RT_MEMCPY_HOST_TO_DEVICE),
            ((0, d0), (0, null()), DMABUF_RT_MEMCPY_HOST_TO_DEVICE),
            ((0, null_mut()), (0, d0.cast_const()), DMABUF_RT_MEMCPY_DEVICE_TO_HOST),
            ((0, h), (0, null()), DMABUF_RT_MEMCPY_DEVICE_TO_HOST),
            ((0, null_mut()), (0, d0.cast_const()), DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE),
            ((0, d0), (0, null()), DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE),
            ((1, null_mut()), (0, d0.cast_const()), DMABUF_RT_MEMCPY_PEER_TO_PEER),
            ((1, d1), (0, null()), DMABUF_RT_MEMCPY_PEER_TO_PEER),
            // Host memory passed as a device side, and a device pointer on the wrong device.
            ((0, h), (0, h.cast_const()), DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE),
            ((0, h), (1, d0.cast_const()), DMABUF_RT_MEMCPY_DEVICE_TO_HOST),
        ] {
            let s = memcpy(dst, src, 4096, kind, stream);
            refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_memcpy");
        }
        // A range running past the end of the device memory.
        let s = memcpy((0, h), (0, d0), 64 << 20, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, stream);
        refused(s, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_memcpy");
        // A kind that is not one.
        for kind in [4, -1, 1000] {
            let s = memcpy((0, d0), (0, h.cast_const()), 16, kind, stream);
            refused(s, DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_memcpy");
        }
    }
    refused(dmabuf_rt_memset(0, null_mut(), 0, 16), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_memset");
    refused(dmabuf_rt_memset(0, h, 0, 16), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_memset");
    refused(dmabuf_rt_memset(1, d0, 0, 16), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_memset");
    // The stream is not failed by refused calls.
    ok(dmabuf_rt_stream_synchronize(st));
    ok(memcpy((0, d0), (0, h.cast_const()), 8192, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, st));
    ok(dmabuf_rt_stream_destroy(st));
    ok(dmabuf_rt_device_free(0, d0));
    ok(dmabuf_rt_device_free(1, d1));
    drop(host);
    still_works(&base);
}

#[test]
fn destroyed_and_unknown_handles_are_refused() {
    let _g = setup();
    let base = before();
    let (st, ev) = (new_stream(0), new_event());
    ok(dmabuf_rt_event_record(ev, st));
    ok(dmabuf_rt_stream_destroy(st));
    ok(dmabuf_rt_event_destroy(ev));
    let d0 = device_alloc(0, 4096);
    let mut host = [0u8; 4096];
    unsafe extern "C" fn never(_: dmabuf_rt_stream, _: dmabuf_rt_status, _: *mut c_void) {
        panic!("a callback on a destroyed stream ran");
    }
    for bad_stream in [st, 0x1234_5678, u64::MAX] {
        let h = "dmabuf_rt_stream_destroy";
        refused(dmabuf_rt_stream_destroy(bad_stream), DMABUF_RT_INVALID_HANDLE, h);
        refused(dmabuf_rt_stream_synchronize(bad_stream), DMABUF_RT_INVALID_HANDLE, "dmabuf_rt_stream_synchronize");
        let mut done = false;
        // SAFETY: valid out-pointer.
        let s = unsafe { dmabuf_rt_stream_query(bad_stream, &mut done) };
        refused(s, DMABUF_RT_INVALID_HANDLE, "dmabuf_rt_stream_query");
        // SAFETY: `never` is callable from any thread (and must not be called).
        let s = unsafe { dmabuf_rt_stream_add_callback(bad_stream, Some(never), null_mut()) };
        refused(s, DMABUF_RT_INVALID_HANDLE, "dmabuf_rt_stream_add_callback");
        let s = memcpy((0, host.as_mut_ptr().cast()), (0, d0), 4096, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, bad_stream);
        refused(s, DMABUF_RT_INVALID_HANDLE, "dmabuf_rt_memcpy");
        // Even a copy of 0 bytes checks its stream.
        let s = memcpy((0, host.as_mut_ptr().cast()), (0, d0), 0, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, bad_stream);
        refused(s, DMABUF_RT_INVALID_HANDLE, "dmabuf_rt_memcpy");
        let e2 = new_event();
        refused(dmabuf_rt_stream_wait_event(bad_stream, e2), DMABUF_RT_INVALID_HANDLE, "dmabuf_rt_stream_wait_event");
        refused(dmabuf_rt_event_record(e2, bad_stream), DMABUF_RT_INVALID_HANDLE, "dmabuf_rt_event_record");
        ok(dmabuf_rt_event_destroy(e2));
    }
    let live = new_stream(0);
    for bad_event in [ev, 0, 0x1234_5678, u64::MAX] {
        refused(dmabuf_rt_event_destroy(bad_event), DMABUF_RT_INVALID_HANDLE, "dmabuf_rt_event_destroy");
        refused(dmabuf_rt_event_synchronize(bad_event), DMABUF_RT_INVALID_HANDLE, "dmabuf_rt_event_synchronize");
        refused(dmabuf_rt_event_record(bad_event, live), DMABUF_RT_INVALID_HANDLE, "dmabuf_rt_event_record");
        refused(dmabuf_rt_event_record(bad_event, 0), DMABUF_RT_INVALID_HANDLE, "dmabuf_rt_event_record");
        let mut done = false;
        // SAFETY: valid out-pointer.
        let s = unsafe { dmabuf_rt_event_query(bad_event, &mut done) };
        refused(s, DMABUF_RT_INVALID_HANDLE, "dmabuf_rt_event_query");
        refused(dmabuf_rt_stream_wait_event(live, bad_event), DMABUF_RT_INVALID_HANDLE, "dmabuf_rt_stream_wait_event");
    }
    // Stream handle 0 means "none" only where a stream is optional.
    refused(dmabuf_rt_stream_synchronize(0), DMABUF_RT_INVALID_HANDLE, "dmabuf_rt_stream_synchronize");
    ok(dmabuf_rt_stream_synchronize(live));
    ok(dmabuf_rt_stream_destroy(live));
    ok(dmabuf_rt_device_free(0, d0));
    still_works(&base);
}

#[test]
fn more_than_the_capacity_is_out_of_memory() {
    let _g = setup();
    let base = before();
    for size in [CAPACITY as usize + 1, 1 << 40, usize::MAX, usize::MAX / 2] {
        let (s, p) = alloc(0, size);
        refused(s, DMABUF_RT_OUT_OF_MEMORY, "dmabuf_rt_device_alloc");
        assert!(p.is_null());
    }
    let why = {
        let (s, _) = alloc(1, CAPACITY as usize * 2);
        refused(s, DMABUF_RT_OUT_OF_MEMORY, "dmabuf_rt_device_alloc")
    };
    assert!(why.contains("capacity"), "{why}");
    // Holding most of the capacity, the rest is refused, then freed memory serves again.
    let big = device_alloc(0, 200 << 20);
    let (s, _) = alloc(0, 100 << 20);
    refused(s, DMABUF_RT_OUT_OF_MEMORY, "dmabuf_rt_device_alloc");
    ok(dmabuf_rt_device_free(0, big));
    let again = device_alloc(0, 100 << 20);
    ok(dmabuf_rt_device_free(0, again));
    assert!(stats(0).num_ooms > base[0].num_ooms);
    ok(dmabuf_rt_empty_cache(0));
    still_works(&base);
}

// ---- SyncedMemory ----

const SN: usize = 256 << 10;

fn synced_create(device: c_int, size: usize, alias: bool) -> dmabuf_rt_synced {
    let mut s = 0;
    // SAFETY: `s` is a valid out-pointer.
    ok(unsafe { dmabuf_rt_synced_create(device, size, alias, &mut s) });
    assert_ne!(s, 0);
    s
}

fn synced_state(s: dmabuf_rt_synced) -> (dmabuf_rt_head, u64) {
    let (mut head, mut copies) = (-1, u64::MAX);
    // SAFETY: valid out-pointers.
    ok(unsafe { dmabuf_rt_synced_head(s, &mut head) });
    // SAFETY: as above.
    ok(unsafe { dmabuf_rt_synced_copies(s, &mut copies) });
    (head, copies)
}

fn synced_owns(s: dmabuf_rt_synced) -> (bool, bool) {
    let (mut h, mut d) = (false, false);
    // SAFETY: valid out-pointers.
    ok(unsafe { dmabuf_rt_synced_owns(s, &mut h, &mut d) });
    (h, d)
}

fn synced_aliased(s: dmabuf_rt_synced) -> bool {
    let mut a = false;
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_synced_aliased(s, &mut a) });
    a
}

fn host_data(s: dmabuf_rt_synced) -> *const u8 {
    let mut p = null();
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_synced_host_data(s, &mut p) });
    assert!(!p.is_null());
    p.cast()
}

fn mutable_host_data(s: dmabuf_rt_synced) -> *mut u8 {
    let mut p = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_synced_mutable_host_data(s, &mut p) });
    assert!(!p.is_null());
    p.cast()
}

fn device_data(s: dmabuf_rt_synced) -> *const c_void {
    let mut p = null();
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_synced_device_data(s, &mut p) });
    assert!(!p.is_null());
    p
}

fn mutable_device_data(s: dmabuf_rt_synced) -> *mut c_void {
    let mut p = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_synced_mutable_device_data(s, &mut p) });
    assert!(!p.is_null());
    p
}

/// The `SN` bytes at a host pointer from the SyncedMemory, copied out (byte-wise volatile
/// reads: the memory is shared with the device side).
fn read_host(p: *const u8) -> Vec<u8> {
    (0..SN)
        .map(|i| {
            // SAFETY: `p` is a host pointer of a SyncedMemory of `SN` bytes, valid until the next
            // call on it, and nothing else accesses the memory meanwhile; `i < SN`.
            let at = unsafe { p.add(i) };
            // SAFETY: as above.
            unsafe { at.read_volatile() }
        })
        .collect()
}

fn write_host(p: *mut u8, data: &[u8]) {
    for (i, &b) in data.iter().enumerate() {
        // SAFETY: as in `read_host`, for writing (a pointer from `_mutable_host_data`).
        let at = unsafe { p.add(i) };
        // SAFETY: as above.
        unsafe { at.write_volatile(b) };
    }
}

fn read_device(dev: c_int, p: *const c_void) -> Vec<u8> {
    let mut out = vec![0u8; SN];
    ok(memcpy((0, out.as_mut_ptr().cast()), (dev, p), SN, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0));
    out
}

fn pattern(seed: u8) -> Vec<u8> {
    (0..SN).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed).wrapping_add((i >> 9) as u8)).collect()
}

/// Waits (up to 20 s, polling) until the device's live allocations are back to `want`: frees
/// of blocks used on a stream complete once the stream has passed them.
#[track_caller]
fn settle_allocations(dev: c_int, want: u64) {
    for _ in 0..4000 {
        if stats(dev).allocations == want {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(stats(dev).allocations, want, "device {dev}: live allocations");
}

#[test]
fn synced_transitions_aliased_and_split() {
    let _g = setup();
    let base = before();
    for alias in [true, false] {
        let copies = |n: u64| if alias { 0 } else { n };
        // On device 1, through DMABUF_RT_CURRENT_DEVICE.
        ok(dmabuf_rt_set_device(1));
        let s = synced_create(DMABUF_RT_CURRENT_DEVICE, SN, alias);
        ok(dmabuf_rt_set_device(0));
        assert_eq!(synced_aliased(s), alias, "shmem memory is CPU-mappable");
        let mut size = 0;
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_synced_size(s, &mut size) });
        assert_eq!(size, SN);
        assert_eq!(synced_state(s), (DMABUF_RT_HEAD_UNINITIALIZED, 0));
        assert_eq!(synced_owns(s), (false, false));
        assert_eq!(stats(1).allocations, base[1].allocations, "nothing allocated before the first access");

        // First host access: allocated and zeroed (blocks come back from the cache dirty).
        let h = mutable_host_data(s);
        assert!(read_host(h).iter().all(|&b| b == 0), "alias {alias}: zero-filled");
        write_host(h, &pattern(1));
        assert_eq!(synced_state(s), (DMABUF_RT_HEAD_AT_HOST, 0));
        assert_eq!(synced_owns(s), (true, alias));
        assert_eq!(stats(1).allocations, base[1].allocations + u64::from(alias));

        let d = device_data(s);
        assert_eq!(synced_state(s), (DMABUF_RT_HEAD_SYNCED, copies(1)));
        assert_eq!(synced_owns(s), (true, true));
        assert_eq!(d == h.cast_const().cast(), alias, "one address when aliased");
        assert_eq!(stats(1).allocations, base[1].allocations + 1);
        assert!(read_device(1, d) == pattern(1), "alias {alias}: the device view has the host's bytes");
        // The device pointer belongs to device 1 only.
        let mut out = vec![0u8; SN];
        let st = memcpy((0, out.as_mut_ptr().cast()), (0, d), SN, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0);
        refused(st, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_memcpy");

        let dm = mutable_device_data(s);
        assert_eq!(dm.cast_const(), d, "the device address is stable");
        assert_eq!(synced_state(s), (DMABUF_RT_HEAD_AT_DEVICE, copies(1)));
        ok(dmabuf_rt_memset(1, dm, 0xa5, SN));
        let hr = host_data(s);
        assert_eq!(hr, h.cast_const(), "the host address is stable");
        assert_eq!(synced_state(s), (DMABUF_RT_HEAD_SYNCED, copies(2)));
        assert!(read_host(hr).iter().all(|&b| b == 0xa5), "alias {alias}: the host view has the memset");

        // Nothing moves when the head already allows it.
        host_data(s);
        device_data(s);
        assert_eq!(synced_state(s), (DMABUF_RT_HEAD_SYNCED, copies(2)));
        // A write through a host pointer copied to a device-to-host copy's source.
        let h = mutable_host_data(s);
        write_host(h, &pattern(2));
        assert_eq!(synced_state(s), (DMABUF_RT_HEAD_AT_HOST, copies(2)));
        let d = device_data(s);
        assert_eq!(synced_state(s), (DMABUF_RT_HEAD_SYNCED, copies(3)));
        assert!(read_device(1, d) == pattern(2));
        // Device first, from UNINITIALIZED: zero on the device, then a copy to the host.
        let s2 = synced_create(0, SN, alias);
        let d2 = device_data(s2);
        assert_eq!(synced_state(s2), (DMABUF_RT_HEAD_AT_DEVICE, 0));
        assert!(read_device(0, d2).iter().all(|&b| b == 0));
        assert!(read_host(host_data(s2)).iter().all(|&b| b == 0));
        assert_eq!(synced_state(s2), (DMABUF_RT_HEAD_SYNCED, copies(1)));

        ok(dmabuf_rt_synced_destroy(s));
        ok(dmabuf_rt_synced_destroy(s2));
        assert_eq!(stats(1).allocations, base[1].allocations, "destroy frees the SyncedMemory's own blocks");
        assert_eq!(stats(0).allocations, base[0].allocations);
    }
    still_works(&base);
}

#[test]
fn synced_lent_memory_is_never_freed() {
    let _g = setup();
    let base = before();
    for alias in [true, false] {
        // Pinned host memory, unified memory and plain process memory as the host view.
        let (mut pinned, mut unified) = (null_mut(), null_mut());
        // SAFETY: valid out-pointers.
        ok(unsafe { dmabuf_rt_host_alloc(SN, &mut pinned) });
        // SAFETY: as above.
        ok(unsafe { dmabuf_rt_unified_alloc(SN, &mut unified) });
        let mut plain = vec![0u8; SN];
        for (i, lent) in [pinned, unified, plain.as_mut_ptr().cast()].into_iter().enumerate() {
            write_host(lent.cast(), &pattern(10 + i as u8));
            let s = synced_create(0, SN, alias);
            // Owned memory first: replaced (and freed) by the lent memory.
            mutable_host_data(s);
            // SAFETY: `lent` is valid for `SN` bytes until after the destroy below.
            ok(unsafe { dmabuf_rt_synced_set_host_data(s, lent) });
            assert_eq!(synced_state(s), (DMABUF_RT_HEAD_AT_HOST, 0));
            assert_eq!(synced_owns(s), (false, false), "alias {alias}, lent #{i}");
            assert_eq!(host_data(s), lent.cast_const().cast(), "the host view is the lent memory");
            assert_eq!(stats(0).allocations, base[0].allocations, "alias {alias}: the owned block was freed");
            let d = device_data(s);
            if alias {
                // The lent memory is both views.
                assert_eq!(d, lent.cast_const());
                assert_eq!(synced_state(s), (DMABUF_RT_HEAD_SYNCED, 0));
            } else {
                assert!(read_device(0, d) == pattern(10 + i as u8));
                assert_eq!(synced_state(s), (DMABUF_RT_HEAD_SYNCED, 1));
                assert_eq!(synced_owns(s), (false, true));
                // A device write comes back into the lent memory itself.
                ok(dmabuf_rt_memset(0, mutable_device_data(s), 0x3c, SN));
                assert_eq!(host_data(s), lent.cast_const().cast());
                assert_eq!(synced_state(s), (DMABUF_RT_HEAD_SYNCED, 2));
            }
            ok(dmabuf_rt_synced_destroy(s));
            let want = if alias { pattern(10 + i as u8) } else { vec![0x3c; SN] };
            assert!(read_host(lent.cast()) == want, "alias {alias}, lent #{i}: intact after the destroy");
        }
        ok(dmabuf_rt_host_free(pinned));
        ok(dmabuf_rt_unified_free(unified));
        drop(plain);
        assert_eq!(stats(0).allocations, base[0].allocations);

        // Device memory lent as the device view: never freed by the SyncedMemory.
        let block = device_alloc(0, SN);
        ok(dmabuf_rt_memset(0, block, 0x77, SN));
        let s = synced_create(0, SN, alias);
        mutable_host_data(s);
        ok(dmabuf_rt_synced_set_device_data(s, block));
        assert_eq!(synced_state(s), (DMABUF_RT_HEAD_AT_DEVICE, 0));
        assert_eq!(synced_owns(s), (!alias, false));
        assert_eq!(device_data(s), block.cast_const());
        assert!(read_host(host_data(s)).iter().all(|&b| b == 0x77));
        assert_eq!(synced_state(s), (DMABUF_RT_HEAD_SYNCED, u64::from(!alias)));
        // Device memory lent as the host view is reached through its segment.
        let other = device_alloc(0, SN);
        // SAFETY: `other` stays allocated until after the destroy below.
        ok(unsafe { dmabuf_rt_synced_set_host_data(s, other) });
        assert_eq!(host_data(s), other.cast_const().cast());
        ok(dmabuf_rt_synced_destroy(s));
        let live = stats(0);
        assert_eq!(live.allocations, base[0].allocations + 2, "alias {alias}: both lent blocks still allocated");
        ok(dmabuf_rt_device_free(0, block));
        ok(dmabuf_rt_device_free(0, other));
        refused(dmabuf_rt_device_free(0, block), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_device_free");
    }
    still_works(&base);
}

#[test]
fn synced_async_push_is_ordered_on_its_stream() {
    let _g = setup();
    let base = before();
    for alias in [true, false] {
        let copies = |n: u64| if alias { 0 } else { n };
        // The stream may be of another device: it only orders the copy.
        for stream_dev in [0, 1] {
            let st = new_stream(stream_dev);
            let s = synced_create(0, SN, alias);
            let d = mutable_device_data(s);
            write_host(mutable_host_data(s), &pattern(4));
            assert_eq!(synced_state(s), (DMABUF_RT_HEAD_AT_HOST, copies(1)));
            ok(dmabuf_rt_synced_async_device_push(s, st));
            assert_eq!(synced_state(s), (DMABUF_RT_HEAD_SYNCED, copies(2)), "the head moves at once");
            let mut out = vec![0u8; SN];
            ok(memcpy((0, out.as_mut_ptr().cast()), (0, d), SN, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, st));
            ok(dmabuf_rt_stream_synchronize(st));
            assert!(out == pattern(4), "alias {alias}: a copy after the push on its stream sees the bytes");
            // Already SYNCED: a second push does nothing.
            ok(dmabuf_rt_synced_async_device_push(s, st));
            assert_eq!(synced_state(s), (DMABUF_RT_HEAD_SYNCED, copies(2)));
            // A push, then an accessor: it waits for the push.
            write_host(mutable_host_data(s), &pattern(5));
            ok(dmabuf_rt_synced_async_device_push(s, st));
            assert_eq!(device_data(s), d.cast_const());
            assert!(read_device(0, d) == pattern(5));
            // Destroyed with a push in flight: safe, the blocks are freed after it.
            write_host(mutable_host_data(s), &pattern(6));
            ok(dmabuf_rt_synced_async_device_push(s, st));
            ok(dmabuf_rt_synced_destroy(s));
            ok(dmabuf_rt_stream_destroy(st));
            settle_allocations(0, base[0].allocations);
        }
    }
    still_works(&base);
}

#[test]
fn synced_bad_input_is_refused() {
    let _g = setup();
    let base = before();

    // create: NULL and misaligned out-pointers, size 0, devices out of range.
    // SAFETY: NULL or misaligned out-pointers are refused before any write, which is what is
    // tested here and below; the other pointers are valid.
    let st = unsafe { dmabuf_rt_synced_create(0, SN, true, null_mut()) };
    refused(st, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_synced_create");
    let mut raw = [0u64; 4];
    let odd = raw.as_mut_ptr().cast::<u8>().wrapping_add(2).cast::<dmabuf_rt_synced>();
    // SAFETY: as above.
    let st = unsafe { dmabuf_rt_synced_create(0, SN, true, odd) };
    refused(st, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_synced_create");
    assert!(raw.iter().all(|&x| x == 0));
    let mut h: dmabuf_rt_synced = 77;
    // SAFETY: as above.
    let st = unsafe { dmabuf_rt_synced_create(0, 0, true, &mut h) };
    refused(st, DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_synced_create");
    for dev in [2, -2, c_int::MAX] {
        // SAFETY: as above.
        let st = unsafe { dmabuf_rt_synced_create(dev, SN, false, &mut h) };
        refused(st, DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_synced_create");
    }
    assert_eq!(h, 77, "a refused create wrote its out-pointer");

    // Every out-pointer of a live SyncedMemory.
    let s = synced_create(0, SN, false);
    let probe = |name: &str, st: dmabuf_rt_status| refused(st, DMABUF_RT_INVALID_POINTER, name);
    // SAFETY: as above.
    probe("dmabuf_rt_synced_head", unsafe { dmabuf_rt_synced_head(s, null_mut()) });
    // SAFETY: as above.
    probe("dmabuf_rt_synced_size", unsafe { dmabuf_rt_synced_size(s, null_mut()) });
    // SAFETY: as above.
    probe("dmabuf_rt_synced_copies", unsafe { dmabuf_rt_synced_copies(s, null_mut()) });
    // SAFETY: as above.
    probe("dmabuf_rt_synced_aliased", unsafe { dmabuf_rt_synced_aliased(s, null_mut()) });
    let mut b = true;
    // SAFETY: as above.
    probe("dmabuf_rt_synced_owns", unsafe { dmabuf_rt_synced_owns(s, null_mut(), &mut b) });
    // SAFETY: as above.
    probe("dmabuf_rt_synced_owns", unsafe { dmabuf_rt_synced_owns(s, &mut b, null_mut()) });
    assert!(b, "a refused owns wrote its other out-pointer");
    // SAFETY: as above.
    probe("dmabuf_rt_synced_host_data", unsafe { dmabuf_rt_synced_host_data(s, null_mut()) });
    // SAFETY: as above.
    probe("dmabuf_rt_synced_mutable_host_data", unsafe { dmabuf_rt_synced_mutable_host_data(s, null_mut()) });
    // SAFETY: as above.
    probe("dmabuf_rt_synced_device_data", unsafe { dmabuf_rt_synced_device_data(s, null_mut()) });
    // SAFETY: as above.
    probe("dmabuf_rt_synced_mutable_device_data", unsafe { dmabuf_rt_synced_mutable_device_data(s, null_mut()) });
    let odd = raw.as_mut_ptr().cast::<u8>().wrapping_add(4).cast::<*const c_void>();
    // SAFETY: as above.
    probe("dmabuf_rt_synced_host_data", unsafe { dmabuf_rt_synced_host_data(s, odd) });
    assert!(raw.iter().all(|&x| x == 0));
    // SAFETY: as above.
    probe("dmabuf_rt_synced_set_host_data", unsafe { dmabuf_rt_synced_set_host_data(s, null_mut()) });
    probe("dmabuf_rt_synced_set_device_data", dmabuf_rt_synced_set_device_data(s, null_mut()));
    assert_eq!(synced_state(s), (DMABUF_RT_HEAD_UNINITIALIZED, 0), "refused calls changed nothing");
    assert_eq!(stats(0).num_allocs, base[0].num_allocs, "refused calls allocated nothing");

    // Pushes from the wrong head, and with a stream that is not live.
    let stream = new_stream(0);
    let why = refused(
        dmabuf_rt_synced_async_device_push(s, stream),
        DMABUF_RT_INVALID_ARGUMENT,
        "dmabuf_rt_synced_async_device_push",
    );
    assert!(why.contains("DMABUF_RT_HEAD_UNINITIALIZED"), "{why}");
    assert_eq!(synced_state(s), (DMABUF_RT_HEAD_UNINITIALIZED, 0));
    let d = mutable_device_data(s);
    let why = refused(
        dmabuf_rt_synced_async_device_push(s, stream),
        DMABUF_RT_INVALID_ARGUMENT,
        "dmabuf_rt_synced_async_device_push",
    );
    assert!(why.contains("DMABUF_RT_HEAD_AT_DEVICE"), "{why}");
    assert_eq!(synced_state(s), (DMABUF_RT_HEAD_AT_DEVICE, 0), "a refused push moved the head");
    mutable_host_data(s);
    let dead_stream = new_stream(0);
    ok(dmabuf_rt_stream_destroy(dead_stream));
    for bad in [0, dead_stream, s, u64::MAX] {
        let st = dmabuf_rt_synced_async_device_push(s, bad);
        refused(st, DMABUF_RT_INVALID_HANDLE, "dmabuf_rt_synced_async_device_push");
    }
    assert_eq!(synced_state(s), (DMABUF_RT_HEAD_AT_HOST, 1));

    // set_device_data: memory that is not this device's.
    let other_dev = device_alloc(1, SN);
    let mut host = vec![0u8; SN];
    let mut pinned = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_host_alloc(SN, &mut pinned) });
    for bad in [other_dev, host.as_mut_ptr().cast(), pinned, 0x1000 as *mut c_void] {
        let st = dmabuf_rt_synced_set_device_data(s, bad);
        refused(st, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_synced_set_device_data");
    }
    // set_host_data: a range that starts in pinned host memory and runs past its block.
    let mut small = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_host_alloc(SN / 2, &mut small) });
    // SAFETY: refused before the SyncedMemory keeps the pointer.
    let st = unsafe { dmabuf_rt_synced_set_host_data(s, small) };
    let why = refused(st, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_synced_set_host_data");
    assert!(why.contains("runs past"), "{why}");
    // SAFETY: refused as above: `pinned + 1` starts inside the block and runs past it by a byte.
    let st = unsafe { dmabuf_rt_synced_set_host_data(s, pinned.wrapping_byte_add(1)) };
    refused(st, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_synced_set_host_data");
    assert_eq!(synced_state(s), (DMABUF_RT_HEAD_AT_HOST, 1), "refused calls changed nothing");
    assert_eq!(synced_owns(s), (true, true));
    assert_eq!(device_data(s), d.cast_const(), "the device view was not replaced");

    // Destroyed, unknown and foreign handles, for every function.
    ok(dmabuf_rt_synced_destroy(s));
    for bad in [s, 0, 0x1234_5678, u64::MAX, stream] {
        let h = |name: &str, st: dmabuf_rt_status| refused(st, DMABUF_RT_INVALID_HANDLE, name);
        h("dmabuf_rt_synced_destroy", dmabuf_rt_synced_destroy(bad));
        let (mut head, mut size, mut copies, mut flag, mut flag2) = (9, 9, 9, true, true);
        let (mut cp, mut mp) = (null(), null_mut());
        // SAFETY: valid out-pointers.
        h("dmabuf_rt_synced_head", unsafe { dmabuf_rt_synced_head(bad, &mut head) });
        // SAFETY: as above.
        h("dmabuf_rt_synced_size", unsafe { dmabuf_rt_synced_size(bad, &mut size) });
        // SAFETY: as above.
        h("dmabuf_rt_synced_copies", unsafe { dmabuf_rt_synced_copies(bad, &mut copies) });
        // SAFETY: as above.
        h("dmabuf_rt_synced_aliased", unsafe { dmabuf_rt_synced_aliased(bad, &mut flag) });
        // SAFETY: as above.
        h("dmabuf_rt_synced_owns", unsafe { dmabuf_rt_synced_owns(bad, &mut flag, &mut flag2) });
        // SAFETY: as above.
        h("dmabuf_rt_synced_host_data", unsafe { dmabuf_rt_synced_host_data(bad, &mut cp) });
        // SAFETY: as above.
        h("dmabuf_rt_synced_mutable_host_data", unsafe { dmabuf_rt_synced_mutable_host_data(bad, &mut mp) });
        // SAFETY: as above.
        h("dmabuf_rt_synced_device_data", unsafe { dmabuf_rt_synced_device_data(bad, &mut cp) });
        // SAFETY: as above.
        h("dmabuf_rt_synced_mutable_device_data", unsafe { dmabuf_rt_synced_mutable_device_data(bad, &mut mp) });
        // SAFETY: refused before the pointer is looked at.
        h("dmabuf_rt_synced_set_host_data", unsafe { dmabuf_rt_synced_set_host_data(bad, pinned) });
        h("dmabuf_rt_synced_set_device_data", dmabuf_rt_synced_set_device_data(bad, other_dev));
        h("dmabuf_rt_synced_async_device_push", dmabuf_rt_synced_async_device_push(bad, stream));
        assert_eq!((head, size, copies, flag, flag2), (9, 9, 9, true, true), "refused calls wrote out-pointers");
        assert!(cp.is_null() && mp.is_null());
    }
    // A SyncedMemory handle is not a stream handle either, and handles are never reissued.
    let s2 = synced_create(0, SN, true);
    refused(dmabuf_rt_stream_synchronize(s2), DMABUF_RT_INVALID_HANDLE, "dmabuf_rt_stream_synchronize");
    assert!(s2 != s && s2 != stream);
    ok(dmabuf_rt_synced_destroy(s2));

    let name = |h| {
        let p = dmabuf_rt_head_name(h);
        // SAFETY: a static NUL-terminated string.
        unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_owned()
    };
    assert_eq!(name(DMABUF_RT_HEAD_AT_DEVICE), "DMABUF_RT_HEAD_AT_DEVICE");
    assert_eq!(name(17), "unknown head");

    ok(dmabuf_rt_stream_destroy(stream));
    ok(dmabuf_rt_host_free(pinned));
    ok(dmabuf_rt_host_free(small));
    ok(dmabuf_rt_device_free(1, other_dev));
    drop(host);
    settle_allocations(0, base[0].allocations);
    still_works(&base);
}

#[test]
fn synced_calls_from_many_threads() {
    let _g = setup();
    let base = before();
    // One SyncedMemory per thread, and one shared: calls on it are serialized.
    let shared = synced_create(0, SN, false);
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            std::thread::spawn(move || {
                for round in 0..20u8 {
                    let s = synced_create(c_int::from(t % 2), SN, t % 2 == 0);
                    let seed = t.wrapping_mul(50).wrapping_add(round);
                    write_host(mutable_host_data(s), &pattern(seed));
                    let d = device_data(s);
                    assert!(read_device(c_int::from(t % 2), d) == pattern(seed));
                    ok(dmabuf_rt_synced_destroy(s));
                    let mut head = -1;
                    // SAFETY: valid out-pointer.
                    ok(unsafe { dmabuf_rt_synced_head(shared, &mut head) });
                    // A host pointer from the shared one is valid only until the next call on
                    // it, which another thread may make at any time: only device views here.
                    ok(dmabuf_rt_memset(0, mutable_device_data(shared), c_int::from(seed), SN));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let (head, copies) = synced_state(shared);
    assert_eq!((head, copies), (DMABUF_RT_HEAD_AT_DEVICE, 0));
    ok(dmabuf_rt_synced_destroy(shared));
    assert_eq!(stats(0).allocations, base[0].allocations);
    assert_eq!(stats(1).allocations, base[1].allocations);
    still_works(&base);
}

// ---- what frameworks' allocators need (the PyTorch backend's calls) ----

fn memory_stats(device: c_int) -> dmabuf_rt_memory_stats {
    let mut s = dmabuf_rt_memory_stats::default();
    // SAFETY: `s` is a valid out-pointer.
    ok(unsafe { dmabuf_rt_device_memory_stats(device, &mut s) });
    s
}

/// The whole DeviceStats agrees with the short form, counts per pool, and its accumulated
/// counts reset while current values and peaks stay.
#[test]
fn memory_stats_match_the_short_form_and_reset_their_accumulated_counts() {
    let _g = setup();
    let p = device_alloc(0, 1000);
    let (short, full) = (stats(0), memory_stats(0));
    assert_eq!(full.allocated_bytes[0].current as u64, short.allocated_bytes);
    assert_eq!(full.reserved_bytes[0].current as u64, short.reserved_bytes);
    assert_eq!(full.allocation[0].allocated as u64, short.num_allocs);
    assert_eq!(full.allocation[0].freed as u64, short.num_frees);
    assert_eq!(full.requested_bytes[0].current as u64, short.requested_bytes);
    // A 1000-byte request is a 1024-byte block of the small pool.
    assert_eq!(full.allocated_bytes[0].current, full.allocated_bytes[1].current + full.allocated_bytes[2].current);
    assert!(full.allocated_bytes[1].current >= 1024);
    ok(dmabuf_rt_reset_accumulated_stats(0));
    let reset = memory_stats(0);
    assert_eq!((reset.allocation[0].allocated, reset.allocation[0].freed), (0, 0));
    assert_eq!(reset.allocation[0].current, full.allocation[0].current, "current values stay");
    assert_eq!(reset.allocated_bytes[0].peak, full.allocated_bytes[0].peak, "peaks stay");
    ok(dmabuf_rt_device_free(0, p));
    let after = memory_stats(0);
    assert_eq!((after.allocation[0].allocated, after.allocation[0].freed), (0, 1));
    // SAFETY: NULL is refused before anything is written.
    refused(
        unsafe { dmabuf_rt_device_memory_stats(0, null_mut()) },
        DMABUF_RT_INVALID_POINTER,
        "dmabuf_rt_device_memory_stats",
    );
    refused(dmabuf_rt_reset_accumulated_stats(9), DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_reset_accumulated_stats");
}

fn pointer_device(p: *const c_void) -> (dmabuf_rt_status, c_int) {
    let mut dev = -1;
    // SAFETY: `dev` is a valid out-pointer; `p` is only compared.
    let s = unsafe { dmabuf_rt_pointer_device(p, &mut dev) };
    (s, dev)
}

fn is_pinned(p: *const c_void) -> bool {
    let mut pinned = false;
    // SAFETY: `pinned` is a valid out-pointer; `p` is only compared.
    ok(unsafe { dmabuf_rt_host_is_pinned(p, &mut pinned) });
    pinned
}

/// recordStream, the pointer's device, pinned pointers and CPU-access brackets: right answers
/// for live memory, clear refusals for foreign, freed and out-of-range pointers.
#[test]
fn record_stream_pointer_device_pinned_and_cpu_access() {
    let _g = setup();
    let b = before();
    let s1 = new_stream(1);
    let p = device_alloc(0, 8192);
    let q = device_alloc(1, 4096);
    assert_eq!(pointer_device(p), (DMABUF_RT_OK, 0));
    assert_eq!(pointer_device(q.cast::<u8>().wrapping_add(100).cast()), (DMABUF_RT_OK, 1));
    let local = 0u64;
    refused(pointer_device((&raw const local).cast()).0, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_pointer_device");
    // A stream of another device may use the block; freeing it then defers its reuse.
    ok(dmabuf_rt_record_stream(0, p, s1));
    refused(dmabuf_rt_record_stream(0, q, s1), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_record_stream");
    refused(dmabuf_rt_record_stream(0, p, 0), DMABUF_RT_INVALID_HANDLE, "dmabuf_rt_record_stream");
    // CPU access: inside the allocation only.
    ok(dmabuf_rt_cpu_access_begin(0, p, 8192, true));
    ok(dmabuf_rt_cpu_access_end(0, p, 8192, true));
    refused(dmabuf_rt_cpu_access_begin(0, p, 8193, false), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_cpu_access_begin");
    refused(dmabuf_rt_cpu_access_begin(1, p, 16, false), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_cpu_access_begin");
    refused(dmabuf_rt_cpu_access_end(0, p, 0, false), DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_cpu_access_end");
    // Pinned host memory.
    let mut h = null_mut();
    // SAFETY: `h` is a valid out-pointer.
    ok(unsafe { dmabuf_rt_host_alloc(4096, &mut h) });
    assert!(is_pinned(h.cast::<u8>().wrapping_add(4095).cast()));
    assert!(!is_pinned(p), "device memory is not pinned host memory");
    ok(dmabuf_rt_host_free(h));
    assert!(!is_pinned(h), "freed pinned memory is not pinned any more");
    // SAFETY: NULL is refused before anything is written.
    refused(unsafe { dmabuf_rt_host_is_pinned(h, null_mut()) }, DMABUF_RT_INVALID_POINTER, "dmabuf_rt_host_is_pinned");
    ok(dmabuf_rt_device_free(0, p));
    ok(dmabuf_rt_device_free(1, q));
    let why = refused(dmabuf_rt_record_stream(0, p, s1), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_record_stream");
    assert!(why.contains("already freed") && !why.contains("invalid free"), "a record_stream refusal: {why}");
    refused(dmabuf_rt_cpu_access_begin(0, p, 16, false), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_cpu_access_begin");
    ok(dmabuf_rt_stream_destroy(s1));
    ok(dmabuf_rt_device_synchronize(0));
    still_works(&b);
}

/// Elapsed time between two records, and refusals for events never recorded or destroyed.
#[test]
fn event_elapsed_time() {
    let _g = setup();
    let s = new_stream(0);
    let (a, b) = (new_event(), new_event());
    let mut ms = -1.0f32;
    // SAFETY: `ms` is a valid out-pointer.
    refused(
        unsafe { dmabuf_rt_event_elapsed_time(&mut ms, a, b) },
        DMABUF_RT_INVALID_ARGUMENT,
        "dmabuf_rt_event_elapsed_time",
    );
    assert!(last_error().contains("never recorded"), "{}", last_error());
    ok(dmabuf_rt_event_record(a, s));
    let p = device_alloc(0, 1 << 20);
    ok(dmabuf_rt_memset(0, p, 1, 1 << 20));
    ok(dmabuf_rt_event_record(b, s));
    ok(dmabuf_rt_event_synchronize(b));
    // SAFETY: `ms` is a valid out-pointer.
    ok(unsafe { dmabuf_rt_event_elapsed_time(&mut ms, a, b) });
    assert!(ms >= 0.0, "{ms}");
    // SAFETY: NULL is refused.
    refused(
        unsafe { dmabuf_rt_event_elapsed_time(null_mut(), a, b) },
        DMABUF_RT_INVALID_POINTER,
        "dmabuf_rt_event_elapsed_time",
    );
    ok(dmabuf_rt_event_destroy(b));
    // SAFETY: `ms` is a valid out-pointer.
    refused(
        unsafe { dmabuf_rt_event_elapsed_time(&mut ms, a, b) },
        DMABUF_RT_INVALID_HANDLE,
        "dmabuf_rt_event_elapsed_time",
    );
    ok(dmabuf_rt_event_destroy(a));
    ok(dmabuf_rt_device_free(0, p));
    ok(dmabuf_rt_stream_destroy(s));
}

/// The snapshot JSON carries the history: segment events always, allocations and frees
/// once recording is on.
#[test]
fn the_snapshot_json_carries_the_history() {
    let _g = setup();
    ok(dmabuf_rt_record_history(1, true));
    let p = device_alloc(1, 3 << 20);
    ok(dmabuf_rt_device_free(1, p));
    ok(dmabuf_rt_record_history(1, false));
    let mut json: *mut c_char = null_mut();
    // SAFETY: `json` is a valid out-pointer.
    ok(unsafe { dmabuf_rt_snapshot_json(1, &mut json) });
    // SAFETY: a NUL-terminated string from the library, freed just below.
    let s = unsafe { CStr::from_ptr(json) }.to_string_lossy().into_owned();
    ok(dmabuf_rt_string_free(json));
    let at = format!("\"addr\":{}", p as usize);
    assert!(s.contains("{\"t\":"), "{s}");
    assert!(s.contains("\"action\":\"alloc\"") && s.contains(&at), "no alloc of {p:?} in the trace: {s}");
    assert!(s.contains("\"action\":\"free_completed\""), "{s}");
    assert!(s.contains("\"is_expandable\":"), "{s}");
    refused(dmabuf_rt_record_history(-7, true), DMABUF_RT_INVALID_ARGUMENT, "dmabuf_rt_record_history");
}

/// Holds a stream until `*user` (an `AtomicBool`) is set.
unsafe extern "C" fn hold_until_released(_: dmabuf_rt_stream, _: dmabuf_rt_status, user: *mut c_void) {
    // SAFETY: the test passes a pointer to an AtomicBool that outlives the stream's work.
    let released = unsafe { &*user.cast::<std::sync::atomic::AtomicBool>() };
    while !released.load(std::sync::atomic::Ordering::Acquire) {
        std::thread::yield_now();
    }
}

/// A device-to-host copy queued into pinned memory that is freed at once: the block is not
/// handed out again (or unmapped by emptying the cache) before the stream has written it, so
/// a new pinned allocation never receives the late copy's bytes.
#[test]
fn pinned_memory_freed_while_a_queued_copy_targets_it_is_not_reused_early() {
    let _g = setup();
    const N: usize = 1 << 20;
    let s = new_stream(0);
    let dev = device_alloc(0, N);
    ok(dmabuf_rt_memset(0, dev, 7, N));
    let released = std::sync::atomic::AtomicBool::new(false);
    for round in 0..2 {
        released.store(false, std::sync::atomic::Ordering::Release);
        // SAFETY: `released` outlives the stream's work (the stream is synchronized below).
        ok(unsafe {
            dmabuf_rt_stream_add_callback(s, Some(hold_until_released), (&raw const released).cast_mut().cast())
        });
        let mut pinned = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_host_alloc(N, &mut pinned) });
        ok(memcpy((0, pinned), (0, dev), N, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, s));
        ok(dmabuf_rt_host_free(pinned));
        if round == 1 {
            // Emptying the cache must not unmap the block the stream will still write.
            ok(dmabuf_rt_host_empty_cache());
        }
        let mut fresh = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_host_alloc(N, &mut fresh) });
        // SAFETY: `fresh` is N bytes of live pinned memory that only this test uses.
        unsafe { std::ptr::write_bytes(fresh.cast::<u8>(), 0, N) };
        released.store(true, std::sync::atomic::Ordering::Release);
        ok(dmabuf_rt_stream_synchronize(s));
        // SAFETY: as above; the stream has finished.
        let bytes = unsafe { std::slice::from_raw_parts(fresh.cast::<u8>(), N) };
        assert!(bytes.iter().all(|&b| b == 0), "round {round}: the late copy wrote into a new pinned allocation");
        ok(dmabuf_rt_host_free(fresh));
    }
    ok(dmabuf_rt_device_free(0, dev));
    ok(dmabuf_rt_stream_destroy(s));
}
