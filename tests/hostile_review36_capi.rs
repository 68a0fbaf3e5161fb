#![allow(unsafe_code)]
#![allow(
    clippy::multiple_unsafe_ops_per_block,
    reason = "every call in a block goes through the C ABI under one contract, stated once"
)]
//! Hostile review 36, C side: ownership of memory across the C ABI from several threads
//! (`Runtime::with_synced` / `destroy_synced` / `lend_to_synced`, the lent registry, IPC
//! open/close, streams), driven as a careless or hostile multi-threaded C caller would.
//!
//! The runtime is process-wide and reads its environment once, so every test runs in a child
//! process of its own ([`in_child`]).
//!
//! Finding (the test failed on ae156b5, in 3 of 3 runs, at round 4, 1 and 1 of 24; fixed): a
//! call that waited for the object while another thread destroyed it ran on the destroyed
//! object. A push queued that way wrote a lent block the destroy had let go of its record of,
//! so the block's owner freed it while the copy was queued, saw it reissued, and the copy
//! overwrote the new owner. Calls now see the destroy under the object's lock and are refused
//! with `DMABUF_RT_INVALID_HANDLE` (`Runtime::with_synced`).

mod common;

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::{Arc, Barrier};

use common::capi::*;
use common::isolate::in_child;
use common::summary;
use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;
use dmabuf_rt::ffi::capi::*;

const MB: usize = 1 << 20;
const ENV: &[(&str, &str)] = &[("DMABUF_RT_DEVICES", "shmem,shmem"), ("DMABUF_RT_CAPACITY", "256M")];

fn device_alloc(device: c_int, size: usize) -> *mut c_void {
    let mut p = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_device_alloc(device, size, &mut p) });
    p
}

/// Shifts one racing thread's start by `n` spins, so the rounds see different orders.
fn spin(n: usize) {
    for _ in 0..n {
        std::hint::spin_loop();
    }
}

/// Pointers are not Send; carry them as addresses.
#[derive(Clone, Copy)]
struct Addr(usize);

// ---- Finding: a push racing a destroy ran on the destroyed object ----

/// `with_synced` takes the object's `Arc` out of the table, then locks it; `destroy_synced`
/// locks it, releases its lent ranges (no push in flight yet) and removes it. A push that took
/// the `Arc` before the removal and the lock after the destroy ran on the destroyed object: it
/// returned OK and queued a copy into the lent device block, which the registry no longer
/// listed, so `dmabuf_rt_device_free` accepted it while the copy was still queued; the block
/// was reissued and the late push overwrote its new owner. Here a third thread holds the
/// object (a large transition copy) while the push and the destroy queue up behind it, so
/// about every other round the destroy wins the lock. Either the push ran first (OK, and the
/// destroyed object's lent block stays lent until it has run, or refused since the head was
/// not yet on the host) or it is refused as a call on a destroyed handle.
#[test]
fn a_push_racing_a_destroy_writes_into_a_freed_lent_block() {
    in_child("a_push_racing_a_destroy_writes_into_a_freed_lent_block", ENV, || {
        let size = 48 * MB;
        let rounds = 24;
        let mut both_ok = 0;
        for round in 0..rounds {
            let lent = device_alloc(0, size);
            let h = synced(0, size, false);
            ok(dmabuf_rt_synced_set_device_data(h, lent));
            write_host(h, size, 0xc3);
            // Head AT_DEVICE, so that the holder's call copies device to host (long) and
            // leaves the head AT_HOST, where a push copies.
            ok(mutable_device(h).0);
            let s = new_stream(0);
            let gate = close_stream(s);
            let barrier = Arc::new(Barrier::new(3));
            let (push, destroy) = std::thread::scope(|sc| {
                let b = Arc::clone(&barrier);
                let holder = sc.spawn(move || {
                    b.wait();
                    mutable_host(h).0
                });
                let b = Arc::clone(&barrier);
                let pusher = sc.spawn(move || {
                    b.wait();
                    spin((round % 4) * 2000);
                    dmabuf_rt_synced_async_device_push(h, s)
                });
                let b = Arc::clone(&barrier);
                let destroyer = sc.spawn(move || {
                    b.wait();
                    spin((round % 3) * 2000);
                    dmabuf_rt_synced_destroy(h)
                });
                let _ = holder.join().unwrap();
                (pusher.join().unwrap(), destroyer.join().unwrap())
            });
            assert_eq!(destroy, DMABUF_RT_OK, "destroy: {}", last_error());
            if push == DMABUF_RT_OK {
                both_ok += 1;
                // A push returned OK and is held at the gate: it writes `lent`, whatever the
                // order of the two calls, so the block must not be freeable yet.
                let freed = dmabuf_rt_device_free(0, lent);
                if freed == DMABUF_RT_OK {
                    let other = device_alloc(0, size);
                    // SAFETY: `other` is a live block of `size` bytes of CPU-mapped shmem.
                    unsafe { std::ptr::write_bytes(other.cast::<u8>(), 0x5a, size) };
                    gate.open();
                    ok(dmabuf_rt_stream_synchronize(s));
                    let got = read_device(0, other, size);
                    panic!(
                        "round {round}: dmabuf_rt_synced_async_device_push racing dmabuf_rt_synced_destroy both \
                         returned OK, and the lent block the push writes was then freed (accepted) while the push \
                         was still queued; reissued ({}), the new owner's 0x5a bytes read back as {}",
                        other == lent,
                        summary(&got)
                    );
                }
                assert_eq!(freed, DMABUF_RT_INVALID_POINTER, "round {round}: {}", last_error());
            } else {
                // After the destroy (a destroyed handle), or before the holder's call moved the
                // head to the host (nothing newer on the host to push).
                assert!(
                    matches!(push, DMABUF_RT_INVALID_HANDLE | DMABUF_RT_INVALID_ARGUMENT),
                    "round {round}: the push: {push:?}"
                );
            }
            gate.open();
            ok(dmabuf_rt_stream_synchronize(s));
            ok(dmabuf_rt_device_free(0, lent));
            ok(dmabuf_rt_stream_destroy(s));
        }
        eprintln!("{both_ok}/{rounds} rounds had the push first");
    });
}

// ---- Verified: a destroyed SyncedMemory's block lent meanwhile stays with the borrower ----

/// `destroy_synced` returns while a call that took the object before it still runs on it
/// (holding its blocks), so a lend of its device block to another SyncedMemory in that window
/// finds it live and is accepted (about a third of the rounds). Checked: the borrower's counted
/// range keeps the block, which is never reissued while lent, and nothing stays allocated or
/// in limbo once all are destroyed.
#[test]
fn a_destroyed_synced_memorys_block_lent_meanwhile_stays_with_the_borrower() {
    in_child("a_destroyed_synced_memorys_block_lent_meanwhile_stays_with_the_borrower", ENV, || {
        let size = 32 * MB;
        let rounds = 24;
        let mut accepted = 0;
        for round in 0..rounds {
            let h = synced(0, size, false);
            let (st, d1) = mutable_device(h);
            ok(st);
            let d1 = Addr(d1 as usize);
            let borrower = synced(0, size, false);
            let barrier = Arc::new(Barrier::new(3));
            let (lend, destroyed) = std::thread::scope(|sc| {
                let b = Arc::clone(&barrier);
                // Holds the object with a long device-to-host copy.
                let holder = sc.spawn(move || {
                    b.wait();
                    mutable_host(h).0
                });
                let b = Arc::clone(&barrier);
                // Queues behind the holder; if the destroy goes first it runs a long
                // host-to-device copy on the destroyed object, holding its blocks.
                let zombie = sc.spawn(move || {
                    b.wait();
                    spin((round % 4) * 1000);
                    mutable_device(h).0
                });
                barrier.wait();
                spin((round % 3) * 1000);
                let destroyed = dmabuf_rt_synced_destroy(h);
                // At once: lend the destroyed object's device block to another SyncedMemory.
                let lend = dmabuf_rt_synced_set_device_data(borrower, d1.0 as *mut c_void);
                let _ = holder.join().unwrap();
                let _ = zombie.join().unwrap();
                (lend, destroyed)
            });
            ok(destroyed);
            if lend == DMABUF_RT_OK {
                accepted += 1;
                // The borrower uses `d1` until destroyed: nothing else may be handed it. Let
                // deferred frees complete, then take every block of this size the device has.
                ok(dmabuf_rt_device_synchronize(0));
                let mut taken = Vec::new();
                let mut hit = None;
                loop {
                    let mut q = null_mut();
                    // SAFETY: valid out-pointer.
                    if unsafe { dmabuf_rt_device_alloc(0, size, &mut q) } != DMABUF_RT_OK {
                        break;
                    }
                    if (q as usize) < d1.0 + size && d1.0 < q as usize + size {
                        hit = Some(q);
                        break;
                    }
                    taken.push(q);
                }
                for q in taken {
                    ok(dmabuf_rt_device_free(0, q));
                }
                if let Some(other) = hit {
                    // SAFETY: `other` is a live block of `size` bytes of CPU-mapped shmem.
                    unsafe { std::ptr::write_bytes(other.cast::<u8>(), 0x5a, size) };
                    let (st, p) = mutable_device(borrower);
                    ok(st);
                    ok(dmabuf_rt_memset(0, p, 0xee, size));
                    let got = read_device(0, other, size);
                    panic!(
                        "round {round}: dmabuf_rt_synced_set_device_data accepted the device block of a SyncedMemory \
                         whose dmabuf_rt_synced_destroy had returned OK (a call on it still running); the block was \
                         then freed and reissued by dmabuf_rt_device_alloc while lent: the borrower's memset turned \
                         the new owner's 0x5a bytes into {}",
                        summary(&got)
                    );
                }
            }
            ok(dmabuf_rt_synced_destroy(borrower));
        }
        eprintln!("{accepted}/{rounds} lends of the destroyed object's block accepted");
        // Everything destroyed: nothing may stay allocated or in limbo.
        ok(dmabuf_rt_device_synchronize(0));
        let st = stats(0);
        assert_eq!(
            (st.allocated_bytes, st.limbo_bytes),
            (0, 0),
            "left behind after every SyncedMemory was destroyed: {st:?}"
        );
    });
}

// ---- A block bound to a stream, after the stream is destroyed ----

/// `dmabuf_rt_device_alloc_on_stream` binds the block to the stream's pool; freed after the
/// stream is destroyed, it must become usable by the device again (not cached for a stream
/// that can never allocate), and nothing may stay counted.
#[test]
fn a_block_of_a_destroyed_stream_is_reusable() {
    in_child("a_block_of_a_destroyed_stream_is_reusable", ENV, || {
        let size = 160 * MB;
        let before = stats(0);
        let s = new_stream(0);
        let mut p = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_device_alloc_on_stream(0, size, s, &mut p) });
        ok(dmabuf_rt_memset(0, p, 0x11, size));
        ok(dmabuf_rt_stream_destroy(s));
        ok(dmabuf_rt_device_free(0, p));
        // Only room for one such block (capacity 256M): the freed one must serve.
        let mut q = null_mut();
        // SAFETY: valid out-pointer.
        let r = unsafe { dmabuf_rt_device_alloc(0, size, &mut q) };
        assert_eq!(r, DMABUF_RT_OK, "the block freed after its stream was destroyed is not reused: {}", last_error());
        ok(dmabuf_rt_device_free(0, q));
        // A second stream, destroyed with the block still allocated on it, freed afterwards
        // from another thread.
        let s2 = new_stream(0);
        let mut p2 = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_device_alloc_on_stream(0, size, s2, &mut p2) });
        ok(dmabuf_rt_stream_destroy(s2));
        let a = Addr(p2 as usize);
        std::thread::spawn(move || ok(dmabuf_rt_device_free(0, a.0 as *mut c_void))).join().unwrap();
        ok(dmabuf_rt_empty_cache(0));
        let after = stats(0);
        assert_eq!(after.allocated_bytes, before.allocated_bytes, "allocated bytes left: {after:?}");
        assert_eq!(after.limbo_bytes, 0, "limbo bytes left: {after:?}");
        assert_eq!(after.reserved_bytes, before.reserved_bytes, "reserved bytes left after empty_cache: {after:?}");
    });
}
