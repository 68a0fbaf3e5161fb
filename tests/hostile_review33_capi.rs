#![allow(unsafe_code)]
#![allow(
    clippy::multiple_unsafe_ops_per_block,
    reason = "every call in a block goes through the C ABI under one contract, stated once"
)]
//! Hostile review 33, C side: the SyncedMemory C API (`dmabuf_rt_synced_*`) and the Paddle
//! plugin's `C_DeviceInterface`, driven as a careless or hostile multi-threaded C caller
//! would. Findings: see tests/hostile_review33.rs (the numbering is shared).
//!
//! The runtime is process-wide and reads its environment once, so every test runs in a child
//! process of its own ([`in_child`]).

mod common;

use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex, mpsc};
use std::time::Duration;

use common::capi::*;
use common::isolate::in_child;
use common::summary;
use common::wait::{gettid, wait_asleep};
use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;
use dmabuf_rt::ffi::capi::*;
use dmabuf_rt::ffi::paddle::{C_ERROR, C_SUCCESS, CDeviceInterface, CDeviceSt};

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;
const ENV: &[(&str, &str)] = &[("DMABUF_RT_DEVICES", "shmem,shmem"), ("DMABUF_RT_CAPACITY", "256M")];

fn limit() -> Duration {
    Duration::from_secs(20 * common::time_scale() as u64)
}

fn head(s: dmabuf_rt_synced) -> dmabuf_rt_head {
    let mut h = -1;
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_synced_head(s, &mut h) });
    h
}

// ---- Finding 1: a query from a stream callback deadlocks against a call waiting for the push ----

struct QueryCtx {
    gate: &'static Gate,
    synced: dmabuf_rt_synced,
    status: AtomicI32,
}

unsafe extern "C" fn query_cb(_s: dmabuf_rt_stream, _st: dmabuf_rt_status, user: *mut c_void) {
    // SAFETY: the test passes a leaked QueryCtx.
    let ctx = unsafe { &*user.cast::<QueryCtx>() };
    ctx.gate.wait();
    let mut h = -1;
    // SAFETY: valid out-pointer.
    let st = unsafe { dmabuf_rt_synced_head(ctx.synced, &mut h) };
    ctx.status.store(st as i32, Ordering::SeqCst);
}

/// Finding 1. A stream callback that asks a SyncedMemory for its head (a query: "moves
/// nothing") while another thread's call on that SyncedMemory waits for an asynchronous push
/// queued behind the callback: the waiting call holds the object's lock for its whole wait,
/// the query waits for the lock, the push waits for the callback. Nothing returns.
#[test]
fn a_head_query_from_a_stream_callback_while_a_call_waits_for_the_push_behind_it() {
    in_child("a_head_query_from_a_stream_callback_while_a_call_waits_for_the_push_behind_it", ENV, || {
        let size = 64 * KB;
        let h = synced(0, size, false);
        write_host(h, size, 0x11);
        let s = new_stream(0);
        let ctx: &'static QueryCtx =
            Box::leak(Box::new(QueryCtx { gate: Gate::new(), synced: h, status: AtomicI32::new(-1) }));
        // SAFETY: query_cb with a static context.
        ok(unsafe { dmabuf_rt_stream_add_callback(s, Some(query_cb), (ctx as *const QueryCtx).cast_mut().cast()) });
        ok(dmabuf_rt_synced_async_device_push(h, s));
        let (tid_tx, tid_rx) = mpsc::channel();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            tid_tx.send(gettid()).unwrap();
            let mut p: *const c_void = std::ptr::null();
            // SAFETY: valid out-pointer.
            let st = unsafe { dmabuf_rt_synced_host_data(h, &mut p) };
            let _ = tx.send(st);
        });
        let tid = tid_rx.recv().unwrap();
        // The reader sleeps in its wait for the push (its first and only blocking point; it may
        // be asleep already, so no count of earlier sleeps is compared).
        wait_asleep(tid, 0, limit());
        ctx.gate.open();
        match rx.recv_timeout(limit()) {
            Ok(st) => {
                assert_eq!(st, DMABUF_RT_OK, "{}", last_error());
                assert_eq!(ctx.status.load(Ordering::SeqCst), DMABUF_RT_OK as i32, "the query from the callback");
            }
            Err(_) => panic!(
                "hang: dmabuf_rt_synced_host_data (waiting for the push) and dmabuf_rt_synced_head (in a \
                 callback queued before the push on the same stream) wait for each other: the callback's query \
                 status is still {} after {:?}",
                ctx.status.load(Ordering::SeqCst),
                limit()
            ),
        }
    });
}

// ---- Finding 3: a push on another device's stream is not waited for by the device ----

/// Finding 3 (a). `dmabuf_rt_memcpy` without a stream "first waits for every stream of the
/// devices involved"; a copy queued on device 1's stream into device 0's memory counts (the
/// runtime tracks it as foreign work, see tests/paddle_abi.rs). A SyncedMemory's push on device
/// 1's stream into its device-0 buffer is not tracked: a synchronous read of the device pointer
/// (head SYNCED) returns the bytes from before the push.
#[test]
fn a_synchronous_read_waits_for_a_push_on_another_devices_stream() {
    in_child("a_synchronous_read_waits_for_a_push_on_another_devices_stream", ENV, || {
        let size = 256 * KB;
        let h = synced(0, size, false);
        write_host(h, size, 0x11);
        let p = device_ptr(h); // copy: the device holds 0x11, head SYNCED
        write_host(h, size, 0x22); // head AT_HOST
        let s1 = new_stream(1);
        let gate = close_stream(s1);
        ok(dmabuf_rt_synced_async_device_push(h, s1));
        assert_eq!(head(h), DMABUF_RT_HEAD_SYNCED);
        // The read on a thread of its own: if it returns while the push is still held (the gate
        // closed), it did not wait for it. (A bounded wait for something that must not happen:
        // it costs its limit only when the read does wait.)
        let (tx, rx) = mpsc::channel();
        let pa = p as usize;
        std::thread::spawn(move || tx.send(read_device(0, pa as *const c_void, size)).unwrap());
        let early = rx.recv_timeout(Duration::from_secs(2 * common::time_scale() as u64));
        gate.open();
        let got = match early {
            Ok(v) => v,
            Err(_) => rx.recv_timeout(limit()).expect("the read never returned after the push ran"),
        };
        ok(dmabuf_rt_stream_synchronize(s1));
        assert!(
            got.iter().all(|&b| b == 0x22),
            "a synchronous dmabuf_rt_memcpy of device 0 did not wait for the push queued on device 1's stream \
             into device 0's memory (head SYNCED): read {}",
            summary(&got)
        );
        ok(dmabuf_rt_synced_destroy(h));
        ok(dmabuf_rt_stream_destroy(s1));
    });
}

/// Finding 3 (b). The same push: `dmabuf_rt_device_synchronize(0)` returns while it is still
/// queued (its gate closed), so the device memory still holds the old bytes afterwards.
#[test]
fn device_synchronize_waits_for_a_push_on_another_devices_stream() {
    in_child("device_synchronize_waits_for_a_push_on_another_devices_stream", ENV, || {
        let size = 256 * KB;
        let h = synced(0, size, false);
        write_host(h, size, 0x11);
        let p = device_ptr(h);
        write_host(h, size, 0x22);
        let s1 = new_stream(1);
        let gate = close_stream(s1);
        ok(dmabuf_rt_synced_async_device_push(h, s1));
        // The synchronize on a thread of its own, which then reads the device bytes without any
        // call that could wait (CPU-mapped shmem, no dma-buf bracket needed). If it returns
        // while the push is still held (the gate closed), it did not wait for it.
        let (tx, rx) = mpsc::channel();
        let pa = p as usize;
        std::thread::spawn(move || {
            let st = dmabuf_rt_device_synchronize(0);
            let got: Vec<u8> = (0..size)
                // SAFETY: `pa` is the live device block of `size` bytes, mapped in this process.
                .map(|i| unsafe { std::ptr::read_volatile((pa as *const u8).add(i)) })
                .collect();
            tx.send((st, got)).unwrap();
        });
        let early = rx.recv_timeout(Duration::from_secs(2 * common::time_scale() as u64));
        gate.open();
        let (st, got) = match early {
            Ok(v) => v,
            Err(_) => rx.recv_timeout(limit()).expect("the synchronize never returned after the push ran"),
        };
        ok(st);
        ok(dmabuf_rt_stream_synchronize(s1));
        assert!(
            got.iter().all(|&b| b == 0x22),
            "dmabuf_rt_device_synchronize(0) returned before the push queued on device 1's stream into device \
             0's memory had run: device memory {}",
            summary(&got)
        );
        ok(dmabuf_rt_synced_destroy(h));
        ok(dmabuf_rt_stream_destroy(s1));
    });
}

// ---- Finding 4: memory lent to a SyncedMemory can be freed under it ----

/// Finding 4. `dmabuf_rt_device_free` of device memory lent with
/// `dmabuf_rt_synced_set_device_data` is accepted while the SyncedMemory still uses it; the
/// next allocation of that size gets the same block, and the SyncedMemory's next transition
/// writes into the new owner's memory. (The header says the caller "must not" free it first,
/// but both calls are safe C functions: nothing refuses the free or keeps the block.)
#[test]
fn device_memory_lent_to_a_synced_memory_is_not_freed_under_it() {
    in_child("device_memory_lent_to_a_synced_memory_is_not_freed_under_it", ENV, || {
        let size = 128 * KB;
        let mut lent = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_device_alloc(0, size, &mut lent) });
        let h = synced(0, size, false);
        ok(dmabuf_rt_synced_set_device_data(h, lent));
        let freed = dmabuf_rt_device_free(0, lent);
        if freed != DMABUF_RT_OK {
            // Refused: the block stays the SyncedMemory's. That is the fix; done.
            ok(dmabuf_rt_synced_destroy(h));
            ok(dmabuf_rt_device_free(0, lent));
            return;
        }
        let mut other = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_device_alloc(0, size, &mut other) });
        ok(dmabuf_rt_memset(0, other, 0x5a, size));
        // The SyncedMemory writes its device view: host data, then the copy to the device.
        write_host(h, size, 0xc3);
        let _ = device_ptr(h);
        let got = read_device(0, other, size);
        assert!(
            got.iter().all(|&b| b == 0x5a),
            "dmabuf_rt_device_free accepted memory lent to a live SyncedMemory (same block reissued: {}), and the \
             SyncedMemory's transition overwrote the new owner's allocation: {}",
            other == lent,
            summary(&got)
        );
    });
}

/// Finding 4 (pinned host memory). The same with `dmabuf_rt_host_free` of memory lent with
/// `dmabuf_rt_synced_set_host_data`: the free is accepted, the next `dmabuf_rt_host_alloc` of
/// that size gets the same block, and a transition writes into it.
#[test]
fn host_memory_lent_to_a_synced_memory_is_not_freed_under_it() {
    in_child("host_memory_lent_to_a_synced_memory_is_not_freed_under_it", ENV, || {
        let size = 128 * KB;
        let mut lent = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_host_alloc(size, &mut lent) });
        let h = synced(0, size, false);
        // SAFETY: `lent` is valid for `size` bytes (until freed: which is the point).
        ok(unsafe { dmabuf_rt_synced_set_host_data(h, lent) });
        // The device view holds 0x77, newest (head AT_DEVICE).
        let mut d = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_synced_mutable_device_data(h, &mut d) });
        ok(dmabuf_rt_memset(0, d, 0x77, size));
        if dmabuf_rt_host_free(lent) != DMABUF_RT_OK {
            ok(dmabuf_rt_synced_destroy(h));
            ok(dmabuf_rt_host_free(lent));
            return;
        }
        let mut other = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_host_alloc(size, &mut other) });
        // SAFETY: `other` is live pinned memory of `size` bytes.
        unsafe { std::ptr::write_bytes(other.cast::<u8>(), 0x5a, size) };
        // The transition to the host writes the lent (freed, reissued) memory.
        let mut p: *const c_void = std::ptr::null();
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_synced_host_data(h, &mut p) });
        // SAFETY: `other` is live pinned memory of `size` bytes.
        let got: Vec<u8> = (0..size).map(|i| unsafe { std::ptr::read_volatile(other.cast::<u8>().add(i)) }).collect();
        assert!(
            got.iter().all(|&b| b == 0x5a),
            "dmabuf_rt_host_free accepted memory lent to a live SyncedMemory (same block reissued: {}), and the \
             transition to the host overwrote the new owner's memory: {}",
            other == lent,
            summary(&got)
        );
    });
}

// ---- SyncedMemory C API: bad input (verified) ----

/// Huge sizes: created (nothing is allocated yet), every access refused with a clear status,
/// the head left UNINITIALIZED, nothing allocated.
#[test]
fn synced_huge_sizes_are_refused_at_first_access() {
    in_child("synced_huge_sizes_are_refused_at_first_access", ENV, || {
        for size in [usize::MAX, isize::MAX as usize + 1, isize::MAX as usize, 256 * MB + 1, 1 << 40] {
            for alias in [true, false] {
                if !alias && size == 256 * MB + 1 {
                    // Split: the host side comes from the pinned host allocator, which the
                    // device capacity does not cap (it may succeed).
                    continue;
                }
                let h = synced(0, size, alias);
                let mut p: *const c_void = std::ptr::null();
                let mut m: *mut c_void = null_mut();
                // SAFETY: valid out-pointers.
                let sts = unsafe {
                    [
                        dmabuf_rt_synced_host_data(h, &mut p),
                        dmabuf_rt_synced_device_data(h, &mut p),
                        dmabuf_rt_synced_mutable_host_data(h, &mut m),
                        dmabuf_rt_synced_mutable_device_data(h, &mut m),
                    ]
                };
                for st in sts {
                    assert!(
                        matches!(st, DMABUF_RT_OUT_OF_MEMORY | DMABUF_RT_INVALID_ARGUMENT),
                        "size {size:#x} alias {alias}: {st:?} ({})",
                        last_error()
                    );
                }
                assert!(p.is_null() && m.is_null(), "an out-pointer was written on a refusal");
                assert_eq!(head(h), DMABUF_RT_HEAD_UNINITIALIZED);
                ok(dmabuf_rt_synced_destroy(h));
            }
        }
        assert_eq!(stats(0).allocated_bytes, 0);
        // Still working.
        let h = synced(0, 4 * KB, false);
        write_host(h, 4 * KB, 1);
        let _ = device_ptr(h);
        ok(dmabuf_rt_synced_destroy(h));
    });
}

/// Dead, zero and garbage handles; NULL out-pointers; lent pointers that are NULL, foreign,
/// of the other device, past a block's end, or the object's own memory; pushes with bad
/// streams or from the wrong head. Each gets its status and changes nothing.
#[test]
fn synced_bad_handles_pointers_and_streams_are_refused() {
    in_child("synced_bad_handles_pointers_and_streams_are_refused", ENV, || {
        let size = 64 * KB;
        let dead = synced(0, size, true);
        ok(dmabuf_rt_synced_destroy(dead));
        let mut hd = -1;
        for bad in [0, dead, u64::MAX, 0x1000, 12345] {
            // SAFETY: valid out-pointer.
            assert_eq!(unsafe { dmabuf_rt_synced_head(bad, &mut hd) }, DMABUF_RT_INVALID_HANDLE);
            assert_eq!(dmabuf_rt_synced_destroy(bad), DMABUF_RT_INVALID_HANDLE);
        }
        assert_eq!(hd, -1);
        let mut x = 0;
        // SAFETY: NULL out-pointer (refused) and valid ones.
        unsafe {
            assert_eq!(dmabuf_rt_synced_create(0, size, true, null_mut()), DMABUF_RT_INVALID_POINTER);
            assert_eq!(dmabuf_rt_synced_create(0, 0, true, &mut x), DMABUF_RT_INVALID_ARGUMENT);
            assert_eq!(dmabuf_rt_synced_create(2, size, true, &mut x), DMABUF_RT_INVALID_ARGUMENT);
            assert_eq!(dmabuf_rt_synced_create(-7, size, true, &mut x), DMABUF_RT_INVALID_ARGUMENT);
        }
        assert_eq!(x, 0);
        for alias in [true, false] {
            let h = synced(0, size, alias);
            // SAFETY: NULL out-pointers, refused.
            unsafe {
                assert_eq!(dmabuf_rt_synced_head(h, null_mut()), DMABUF_RT_INVALID_POINTER);
                assert_eq!(dmabuf_rt_synced_host_data(h, null_mut()), DMABUF_RT_INVALID_POINTER);
                assert_eq!(dmabuf_rt_synced_set_host_data(h, null_mut()), DMABUF_RT_INVALID_POINTER);
            }
            assert_eq!(dmabuf_rt_synced_set_device_data(h, null_mut()), DMABUF_RT_INVALID_POINTER);
            let mut local = vec![0u8; size];
            assert_eq!(dmabuf_rt_synced_set_device_data(h, local.as_mut_ptr().cast()), DMABUF_RT_INVALID_POINTER);
            // Device memory of the other device, and a range that runs past a block's end.
            let (mut other, mut short) = (null_mut(), null_mut());
            // SAFETY: valid out-pointers.
            unsafe {
                ok(dmabuf_rt_device_alloc(1, size, &mut other));
                ok(dmabuf_rt_device_alloc(0, size / 2, &mut short));
            }
            assert_eq!(dmabuf_rt_synced_set_device_data(h, other), DMABUF_RT_INVALID_POINTER, "device 1's memory");
            assert_eq!(dmabuf_rt_synced_set_device_data(h, short), DMABUF_RT_INVALID_POINTER, "a short block");
            // SAFETY: refused before use (the range starts in a block of this runtime).
            assert_eq!(unsafe { dmabuf_rt_synced_set_host_data(h, short) }, DMABUF_RT_INVALID_POINTER);
            // Its own memory.
            write_host(h, size, 0x31);
            let own_dev = device_ptr(h);
            assert_eq!(dmabuf_rt_synced_set_device_data(h, own_dev), DMABUF_RT_INVALID_POINTER, "its own device");
            let mut own_host: *const c_void = std::ptr::null();
            // SAFETY: valid out-pointer; then the object's own memory, refused.
            unsafe {
                ok(dmabuf_rt_synced_host_data(h, &mut own_host));
                assert_eq!(dmabuf_rt_synced_set_host_data(h, own_host.cast_mut()), DMABUF_RT_INVALID_POINTER);
                // An interior pointer of its own memory (a sub-range that overlaps it).
                assert_eq!(
                    dmabuf_rt_synced_set_host_data(h, own_host.cast::<u8>().add(1).cast_mut().cast()),
                    DMABUF_RT_INVALID_POINTER
                );
            }
            assert_eq!(head(h), DMABUF_RT_HEAD_SYNCED);
            // Pushes with stream 0, garbage, dead.
            let s = new_stream(0);
            ok(dmabuf_rt_stream_destroy(s));
            for bad in [0, s, 77, u64::MAX] {
                assert_eq!(dmabuf_rt_synced_async_device_push(h, bad), DMABUF_RT_INVALID_HANDLE, "stream {bad}");
            }
            // From AT_DEVICE: refused, head kept.
            let mut m = null_mut();
            // SAFETY: valid out-pointer.
            ok(unsafe { dmabuf_rt_synced_mutable_device_data(h, &mut m) });
            let s = new_stream(0);
            assert_eq!(dmabuf_rt_synced_async_device_push(h, s), DMABUF_RT_INVALID_ARGUMENT);
            assert_eq!(head(h), DMABUF_RT_HEAD_AT_DEVICE);
            let mut p: *const c_void = std::ptr::null();
            // SAFETY: valid out-pointer.
            ok(unsafe { dmabuf_rt_synced_host_data(h, &mut p) });
            // SAFETY: the host view of `size` bytes.
            assert_eq!(unsafe { *p.cast::<u8>().add(size - 1) }, 0x31, "data kept through the refusals");
            ok(dmabuf_rt_stream_destroy(s));
            ok(dmabuf_rt_synced_destroy(h));
            ok(dmabuf_rt_device_free(1, other));
            ok(dmabuf_rt_device_free(0, short));
            drop(local);
        }
        ok(dmabuf_rt_device_synchronize(0));
        assert_eq!(stats(0).allocated_bytes, 0);
    });
}

/// One handle hammered by eight threads: transitions, lends and pushes, and then one thread
/// destroys it while the others keep calling. Statuses are OK, INVALID_HANDLE (after the
/// destroy) or INVALID_ARGUMENT (a push from the wrong head); nothing crashes or hangs, and no
/// device memory is left allocated at the end.
#[test]
fn one_synced_handle_from_eight_threads_then_destroyed_under_them() {
    in_child("one_synced_handle_from_eight_threads_then_destroyed_under_them", ENV, || {
        let size = 16 * KB;
        let streams: Vec<dmabuf_rt_stream> = (0..2).map(new_stream).collect();
        let mut lent = Vec::new();
        for _ in 0..8 {
            let mut p = null_mut();
            // SAFETY: valid out-pointer.
            ok(unsafe { dmabuf_rt_device_alloc(0, size, &mut p) });
            lent.push(p as usize);
        }
        let bad = Arc::new(Mutex::new(Vec::<String>::new()));
        for round in 0..common::scaled(60) {
            let h = synced(0, size, round % 2 == 0);
            let barrier = Arc::new(Barrier::new(8));
            let hs: Vec<_> = (0..8usize)
                .map(|t| {
                    let (barrier, bad, streams, lent) = (barrier.clone(), bad.clone(), streams.clone(), lent.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        for i in 0..40usize {
                            let mut p: *const c_void = std::ptr::null();
                            let mut m: *mut c_void = null_mut();
                            let (name, st) = match (t + i) % 7 {
                                // SAFETY: valid out-pointers throughout.
                                0 => ("host_data", unsafe { dmabuf_rt_synced_host_data(h, &mut p) }),
                                // SAFETY: as above.
                                1 => ("mutable_host_data", unsafe { dmabuf_rt_synced_mutable_host_data(h, &mut m) }),
                                // SAFETY: as above.
                                2 => ("device_data", unsafe { dmabuf_rt_synced_device_data(h, &mut p) }),
                                3 => {
                                    // SAFETY: as above.
                                    ("mutable_device_data", unsafe { dmabuf_rt_synced_mutable_device_data(h, &mut m) })
                                }
                                4 => ("set_device_data", dmabuf_rt_synced_set_device_data(h, lent[t] as *mut c_void)),
                                5 => ("push", dmabuf_rt_synced_async_device_push(h, streams[t % 2])),
                                _ if t == 7 && i == 20 => ("destroy", dmabuf_rt_synced_destroy(h)),
                                _ => ("head", {
                                    let mut x = 0;
                                    // SAFETY: as above.
                                    unsafe { dmabuf_rt_synced_head(h, &mut x) }
                                }),
                            };
                            let fine = match st {
                                DMABUF_RT_OK | DMABUF_RT_INVALID_HANDLE => true,
                                DMABUF_RT_INVALID_ARGUMENT => name == "push",
                                _ => false,
                            };
                            if !fine {
                                bad.lock().unwrap().push(format!("{name}: {st:?} ({})", last_error()));
                            }
                        }
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
            let _ = dmabuf_rt_synced_destroy(h);
        }
        for s in streams {
            ok(dmabuf_rt_stream_destroy(s));
        }
        for p in lent {
            ok(dmabuf_rt_device_free(0, p as *mut c_void));
        }
        ok(dmabuf_rt_device_synchronize(0));
        let bad = bad.lock().unwrap();
        assert!(bad.is_empty(), "{} unexpected statuses, first: {:?}", bad.len(), &bad[..bad.len().min(5)]);
        assert_eq!(stats(0).allocated_bytes, 0, "device memory left allocated");
    });
}

/// Finding 2 (C side). A callback that calls a transition of a SyncedMemory whose push is
/// queued after it on the same stream is refused (DMABUF_RT_WOULD_DEADLOCK), not hung: that
/// holds. But the refusal moves the head from SYNCED to AT_HOST and forgets the push (the data
/// loss that follows is shown in tests/hostile_review33.rs).
#[test]
fn a_transition_from_a_callback_before_its_own_push_is_refused_not_hung() {
    in_child("a_transition_from_a_callback_before_its_own_push_is_refused_not_hung", ENV, || {
        struct Ctx {
            gate: &'static Gate,
            synced: dmabuf_rt_synced,
            status: AtomicI32,
            head: AtomicI32,
        }
        unsafe extern "C" fn cb(_s: dmabuf_rt_stream, _st: dmabuf_rt_status, user: *mut c_void) {
            // SAFETY: a leaked Ctx.
            let ctx = unsafe { &*user.cast::<Ctx>() };
            ctx.gate.wait();
            let mut p: *const c_void = std::ptr::null();
            // SAFETY: valid out-pointer.
            let st = unsafe { dmabuf_rt_synced_host_data(ctx.synced, &mut p) };
            ctx.status.store(st as i32, Ordering::SeqCst);
            let mut h = -1;
            // SAFETY: valid out-pointer.
            unsafe { dmabuf_rt_synced_head(ctx.synced, &mut h) };
            ctx.head.store(h, Ordering::SeqCst);
        }
        let size = 64 * KB;
        let h = synced(0, size, false);
        write_host(h, size, 0x11);
        let s = new_stream(0);
        let ctx: &'static Ctx = Box::leak(Box::new(Ctx {
            gate: Gate::new(),
            synced: h,
            status: AtomicI32::new(-1),
            head: AtomicI32::new(-1),
        }));
        // SAFETY: cb with a static context.
        ok(unsafe { dmabuf_rt_stream_add_callback(s, Some(cb), (ctx as *const Ctx).cast_mut().cast()) });
        ok(dmabuf_rt_synced_async_device_push(h, s));
        ctx.gate.open();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || tx.send(dmabuf_rt_stream_synchronize(s)).unwrap());
        let st = rx.recv_timeout(limit()).expect("hang: the callback's transition waits for its own stream");
        ok(st);
        assert_eq!(ctx.status.load(Ordering::SeqCst), DMABUF_RT_WOULD_DEADLOCK as i32);
        assert_eq!(
            ctx.head.load(Ordering::SeqCst),
            DMABUF_RT_HEAD_SYNCED,
            "the refused call changed the head (a refused call changes nothing)"
        );
        ok(dmabuf_rt_synced_destroy(h));
        ok(dmabuf_rt_stream_destroy(s));
    });
}

// ---- The Paddle plugin ----

fn plugin() -> Box<CDeviceInterface> {
    let (iface, _) = paddle_plugin();
    assert!(iface.create_stream.is_some());
    iface
}

static CALLS: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn count_cb(_d: *mut CDeviceSt, _s: *mut c_void, _u: *mut c_void, _st: *mut i32) {
    CALLS.fetch_add(1, Ordering::SeqCst);
}

/// Finding 5. Every size hint refuses a device that does not exist ("issue 9, defect 12: they
/// answered for any id"), but the stream, event and host/unified-memory callbacks ignore their
/// `C_Device`: with device 7, -1 or a NULL device they create, destroy, query and wait as if it
/// were a real one (Paddle only ever passes devices it enumerated, so any other is a caller's
/// bug the plugin does not report).
#[test]
fn paddle_callbacks_refuse_a_device_that_does_not_exist() {
    in_child("paddle_callbacks_refuse_a_device_that_does_not_exist", ENV, || {
        let i = plugin();
        let mut dev0 = CDeviceSt { id: 0 };
        let mut accepted = Vec::new();
        // SAFETY: (the whole block) the plugin's function pointers; every pointer passed is valid
        // for its use; the device arguments are the point.
        unsafe {
            let (mut s0, mut e0) = (null_mut(), null_mut());
            assert_eq!(i.create_stream.unwrap()(&mut dev0, &mut s0), C_SUCCESS);
            assert_eq!(i.create_event.unwrap()(&mut dev0, &mut e0), C_SUCCESS);
            for id in [7, -1, i32::MAX] {
                let mut bad = CDeviceSt { id };
                let d: *mut CDeviceSt = &mut bad;
                let mut check = |name: &str, st: i32| {
                    if st == C_SUCCESS {
                        accepted.push(format!("{name}(device {id})"));
                    }
                };
                let mut s = null_mut();
                check("create_stream", i.create_stream.unwrap()(d, &mut s));
                let mut e = null_mut();
                check("create_event", i.create_event.unwrap()(d, &mut e));
                check("record_event", i.record_event.unwrap()(d, s0, e0));
                check("query_event", i.query_event.unwrap()(d, e0));
                check("synchronize_event", i.synchronize_event.unwrap()(d, e0));
                check("query_stream", i.query_stream.unwrap()(d, s0));
                check("synchronize_stream", i.synchronize_stream.unwrap()(d, s0));
                check("stream_wait_event", i.stream_wait_event.unwrap()(d, s0, e0));
                check("stream_add_callback", i.stream_add_callback.unwrap()(d, s0, Some(count_cb), null_mut()));
                let mut h = null_mut();
                check("host_memory_allocate", i.host_memory_allocate.unwrap()(d, &mut h, 4096));
                if !h.is_null() {
                    assert_eq!(i.host_memory_deallocate.unwrap()(&mut dev0, h, 4096), C_SUCCESS);
                }
                let mut u = null_mut();
                check("unified_memory_allocate", i.unified_memory_allocate.unwrap()(d, &mut u, 4096));
                if !u.is_null() {
                    assert_eq!(i.unified_memory_deallocate.unwrap()(&mut dev0, u, 4096), C_SUCCESS);
                }
                // Destroys of live objects through a bad device: recreate what went.
                let mut s2 = null_mut();
                assert_eq!(i.create_stream.unwrap()(&mut dev0, &mut s2), C_SUCCESS);
                check("destroy_stream", i.destroy_stream.unwrap()(d, s2));
                let mut e2 = null_mut();
                assert_eq!(i.create_event.unwrap()(&mut dev0, &mut e2), C_SUCCESS);
                check("destroy_event", i.destroy_event.unwrap()(d, e2));
            }
            // A NULL device too.
            let mut h = null_mut();
            if i.host_memory_allocate.unwrap()(null_mut(), &mut h, 4096) == C_SUCCESS {
                accepted.push("host_memory_allocate(NULL device)".into());
                assert_eq!(i.host_memory_deallocate.unwrap()(&mut dev0, h, 4096), C_SUCCESS);
            }
            let mut e = null_mut();
            if i.create_event.unwrap()(null_mut(), &mut e) == C_SUCCESS {
                accepted.push("create_event(NULL device)".into());
            }
            assert_eq!(i.synchronize_stream.unwrap()(&mut dev0, s0), C_SUCCESS);
            assert_eq!(i.destroy_stream.unwrap()(&mut dev0, s0), C_SUCCESS);
        }
        assert!(
            accepted.is_empty(),
            "{} calls accepted a device that does not exist (2 devices): {}",
            accepted.len(),
            accepted.join(", ")
        );
    });
}

/// Finding 6. An asynchronous d2h copy into unified memory, then `unified_memory_deallocate`
/// of that memory before the stream ran the copy. The same with pinned host memory is safe
/// (the runtime records the stream on the pinned block: "its block must not be reused (or
/// unmapped) before the stream has written it, even if the caller frees it at once"); unified
/// memory gets no such record: the free unmaps it at once and the stream writes into an
/// unmapped range (SIGSEGV of the child: the test fails with the signal).
#[test]
fn paddle_async_d2h_into_memory_freed_before_the_stream_ran_it() {
    in_child("paddle_async_d2h_into_memory_freed_before_the_stream_ran_it", ENV, || {
        let i = plugin();
        let mut dev0 = CDeviceSt { id: 0 };
        let len = 2 * MB;
        // SAFETY: (the whole block) the plugin's function pointers with valid arguments; the
        // early free is the point.
        unsafe {
            let mut src = null_mut();
            assert_eq!(i.device_memory_allocate.unwrap()(&mut dev0, &mut src, len), C_SUCCESS);
            assert_eq!(i.device_memory_set.unwrap()(&mut dev0, src, 0x6b, len), C_SUCCESS);
            for (name, alloc, free) in [
                ("pinned host", i.host_memory_allocate.unwrap(), i.host_memory_deallocate.unwrap()),
                ("unified", i.unified_memory_allocate.unwrap(), i.unified_memory_deallocate.unwrap()),
            ] {
                let mut s = null_mut();
                assert_eq!(i.create_stream.unwrap()(&mut dev0, &mut s), C_SUCCESS);
                let gate = Gate::new();
                unsafe extern "C" fn hold(_d: *mut CDeviceSt, _s: *mut c_void, u: *mut c_void, _st: *mut i32) {
                    // SAFETY: a leaked Gate.
                    unsafe { &*u.cast::<Gate>() }.wait();
                }
                assert_eq!(
                    i.stream_add_callback.unwrap()(&mut dev0, s, Some(hold), (gate as *const Gate).cast_mut().cast()),
                    C_SUCCESS
                );
                let mut dst = null_mut();
                assert_eq!(alloc(&mut dev0, &mut dst, len), C_SUCCESS);
                assert!(!dst.is_null());
                assert_eq!(i.async_memory_copy_d2h.unwrap()(&mut dev0, s, dst, src, len), C_SUCCESS, "{name}");
                let freed = free(&mut dev0, dst, len);
                eprintln!("{name}: free before the stream ran the copy: status {freed}");
                gate.open();
                assert_eq!(i.synchronize_stream.unwrap()(&mut dev0, s), C_SUCCESS, "{name}");
                assert_eq!(i.destroy_stream.unwrap()(&mut dev0, s), C_SUCCESS);
            }
            assert_eq!(i.device_memory_deallocate.unwrap()(&mut dev0, src, len), C_SUCCESS);
        }
    });
}

/// Overlapping d2d copies within one block, both directions, synchronous and on a stream
/// (kernel-engine eligible sizes): memmove semantics. Verified.
#[test]
fn paddle_overlapping_d2d_copies_move_like_memmove() {
    in_child("paddle_overlapping_d2d_copies_move_like_memmove", ENV, || {
        let i = plugin();
        let mut dev0 = CDeviceSt { id: 0 };
        let len = 4 * MB;
        let pat: Vec<u8> = (0..len).map(|k| (k * 131 % 251) as u8).collect();
        // SAFETY: (the whole block) the plugin's function pointers with valid arguments.
        unsafe {
            let mut a = null_mut();
            assert_eq!(i.device_memory_allocate.unwrap()(&mut dev0, &mut a, len), C_SUCCESS);
            let mut s = null_mut();
            assert_eq!(i.create_stream.unwrap()(&mut dev0, &mut s), C_SUCCESS);
            for stream in [null_mut(), s] {
                for shift in [1usize, 4096, MB + 3] {
                    for forward in [true, false] {
                        assert_eq!(i.memory_copy_h2d.unwrap()(&mut dev0, a, pat.as_ptr().cast(), len), C_SUCCESS);
                        let n = len - shift;
                        let base = a.cast::<u8>();
                        let (dst, src) = if forward { (base.add(shift), base) } else { (base, base.add(shift)) };
                        let st = if stream.is_null() {
                            i.memory_copy_d2d.unwrap()(&mut dev0, dst.cast(), src.cast(), n)
                        } else {
                            i.async_memory_copy_d2d.unwrap()(&mut dev0, stream, dst.cast(), src.cast(), n)
                        };
                        assert_eq!(st, C_SUCCESS);
                        assert_eq!(i.synchronize_device.unwrap()(&mut dev0), C_SUCCESS);
                        let mut out = vec![0u8; len];
                        assert_eq!(i.memory_copy_d2h.unwrap()(&mut dev0, out.as_mut_ptr().cast(), a, len), C_SUCCESS);
                        let mut want = pat.clone();
                        if forward {
                            want.copy_within(0..n, shift);
                        } else {
                            want.copy_within(shift..len, 0);
                        }
                        assert!(
                            out == want,
                            "stream {} shift {shift} forward {forward}: not memmove",
                            !stream.is_null()
                        );
                    }
                }
            }
            assert_eq!(i.destroy_stream.unwrap()(&mut dev0, s), C_SUCCESS);
            assert_eq!(i.device_memory_deallocate.unwrap()(&mut dev0, a, len), C_SUCCESS);
        }
    });
}

/// The same bad input from eight threads at once, many times: wrong-size frees, then the
/// right free raced (exactly one succeeds), destroys of one stream and one event raced, memsets
/// and copies running past the block. Verified.
#[test]
fn paddle_same_bad_input_from_eight_threads() {
    in_child("paddle_same_bad_input_from_eight_threads", ENV, || {
        let i = plugin();
        let (dealloc, memset, d2h, destroy_stream, destroy_event) = (
            i.device_memory_deallocate.unwrap(),
            i.device_memory_set.unwrap(),
            i.memory_copy_d2h.unwrap(),
            i.destroy_stream.unwrap(),
            i.destroy_event.unwrap(),
        );
        for round in 0..common::scaled(200) {
            let mut dev0 = CDeviceSt { id: 0 };
            let size = [512usize, 4096, 64 * KB, 3 * MB][round % 4];
            let (mut p, mut s, mut e) = (null_mut(), null_mut(), null_mut());
            // SAFETY: valid out-pointers.
            unsafe {
                assert_eq!(i.device_memory_allocate.unwrap()(&mut dev0, &mut p, size), C_SUCCESS);
                assert_eq!(i.create_stream.unwrap()(&mut dev0, &mut s), C_SUCCESS);
                assert_eq!(i.create_event.unwrap()(&mut dev0, &mut e), C_SUCCESS);
            }
            let (p, s, e) = (p as usize, s as usize, e as usize);
            let barrier = Arc::new(Barrier::new(8));
            let wins = Arc::new(AtomicUsize::new(0));
            let hs: Vec<_> = (0..8)
                .map(|_| {
                    let (barrier, wins) = (barrier.clone(), wins.clone());
                    std::thread::spawn(move || {
                        let mut dev0 = CDeviceSt { id: 0 };
                        let p = p as *mut c_void;
                        let mut local = vec![0u8; 64];
                        // SAFETY: (the whole block) the plugin's function pointers; the bad
                        // arguments are the point and are checked before use.
                        unsafe {
                            barrier.wait();
                            assert_eq!(dealloc(&mut dev0, p, size + 1), C_ERROR);
                            assert_eq!(memset(&mut dev0, p.cast::<u8>().add(1).cast(), 0, size), C_ERROR);
                            let tail = p.cast::<u8>().add(size - 8).cast();
                            assert_eq!(d2h(&mut dev0, local.as_mut_ptr().cast(), tail, 64), C_ERROR);
                            barrier.wait();
                            let mut won = 0;
                            if dealloc(&mut dev0, p, size) == C_SUCCESS {
                                won += 1;
                            }
                            if destroy_stream(&mut dev0, s as *mut c_void) == C_SUCCESS {
                                won += 10;
                            }
                            if destroy_event(&mut dev0, e as *mut c_void) == C_SUCCESS {
                                won += 100;
                            }
                            wins.fetch_add(won, Ordering::SeqCst);
                        }
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
            assert_eq!(wins.load(Ordering::SeqCst), 111, "round {round}: one free, one destroy of each");
        }
        let st = dmabuf_rt::ffi::runtime::Runtime::get().unwrap().device(0).unwrap().allocator().stats();
        assert_eq!(st.allocated_bytes[0].current, 0);
    });
}

/// `finalize` (Paddle calls it at exit, possibly with work and memory live), twice, and calls
/// after it: every call still works or is refused, none hangs. Verified.
#[test]
fn paddle_calls_after_finalize() {
    in_child("paddle_calls_after_finalize", ENV, || {
        let i = plugin();
        let mut dev0 = CDeviceSt { id: 0 };
        // SAFETY: (the whole block) the plugin's function pointers with valid arguments.
        unsafe {
            let (mut p, mut s, mut e) = (null_mut(), null_mut(), null_mut());
            assert_eq!(i.initialize.unwrap()(), C_SUCCESS);
            assert_eq!(i.device_memory_allocate.unwrap()(&mut dev0, &mut p, MB), C_SUCCESS);
            assert_eq!(i.create_stream.unwrap()(&mut dev0, &mut s), C_SUCCESS);
            assert_eq!(i.create_event.unwrap()(&mut dev0, &mut e), C_SUCCESS);
            let h = synced(0, 64 * KB, false);
            write_host(h, 64 * KB, 0x42);
            assert_eq!(i.finalize.unwrap()(), C_SUCCESS);
            assert_eq!(i.finalize.unwrap()(), C_SUCCESS);
            // Streams and events were dropped by finalize: refused, not crashed.
            assert_eq!(i.synchronize_stream.unwrap()(&mut dev0, s), C_ERROR);
            assert_eq!(i.query_event.unwrap()(&mut dev0, e), C_ERROR);
            // Memory and a SyncedMemory made before still work.
            assert_eq!(i.device_memory_set.unwrap()(&mut dev0, p, 7, MB), C_SUCCESS);
            let d = device_ptr(h);
            assert_eq!(read_device(0, d, 64 * KB), vec![0x42; 64 * KB]);
            let h2 = synced(0, 64 * KB, false);
            write_host(h2, 64 * KB, 0x43);
            assert_eq!(read_device(0, device_ptr(h2), 64 * KB), vec![0x43; 64 * KB]);
            let mut s2 = null_mut();
            assert_eq!(i.create_stream.unwrap()(&mut dev0, &mut s2), C_SUCCESS);
            CALLS.store(0, Ordering::SeqCst);
            assert_eq!(i.stream_add_callback.unwrap()(&mut dev0, s2, Some(count_cb), null_mut()), C_SUCCESS);
            assert_eq!(i.synchronize_device.unwrap()(&mut dev0), C_SUCCESS);
            assert_eq!(CALLS.load(Ordering::SeqCst), 1);
            assert_eq!(i.deinit_device.unwrap()(&mut dev0), C_SUCCESS);
            assert_eq!(i.device_memory_deallocate.unwrap()(&mut dev0, p, MB), C_SUCCESS);
            ok(dmabuf_rt_synced_destroy(h));
            ok(dmabuf_rt_synced_destroy(h2));
        }
    });
}
