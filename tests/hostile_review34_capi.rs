#![allow(unsafe_code)]
#![allow(
    clippy::multiple_unsafe_ops_per_block,
    reason = "every call in a block goes through the C ABI under one contract, stated once"
)]
//! Hostile review 34, C side: the registry of memory lent to SyncedMemories
//! (`Runtime::lend_to_synced`, the checks in `Runtime::device_free` / `host_free`) and
//! `destroy_synced`, driven as a careless or hostile multi-threaded C caller would. Findings
//! (each test failed on 70bb66d; details in tests/hostile_review34.rs, the numbering is shared):
//! 1 `another_synced_memorys_block_lent_then_freed_by_its_owner`, 2
//! `a_free_racing_a_lend_of_the_same_block_is_never_both_accepted`, 3
//! `destroy_with_a_push_in_flight_into_lent_device_memory`.
//!
//! Verified (passing): `the_lent_registry_follows_what_is_borrowed`,
//! `lends_and_destroys_from_many_threads_leave_nothing_registered`.
//!
//! The runtime is process-wide and reads its environment once, so every test runs in a child
//! process of its own ([`in_child`]).

mod common;

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};

use common::capi::*;
use common::isolate::in_child;
use common::summary;
use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;
use dmabuf_rt::ffi::capi::*;

const KB: usize = 1 << 10;
const ENV: &[(&str, &str)] = &[("DMABUF_RT_DEVICES", "shmem,shmem"), ("DMABUF_RT_CAPACITY", "256M")];

fn device_alloc(device: c_int, size: usize) -> *mut c_void {
    let mut p = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_device_alloc(device, size, &mut p) });
    p
}

fn host_alloc(size: usize) -> *mut c_void {
    let mut p = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_host_alloc(size, &mut p) });
    p
}

fn overlaps(a: *const c_void, b: *const c_void, len: usize) -> bool {
    let (a, b) = (a as usize, b as usize);
    a < b + len && b < a + len
}

// ---- Finding 1: another SyncedMemory's device block, lent, is freed by its owner ----

/// Finding 1. The header allows lending "another SyncedMemory's device pointer" to
/// `_set_device_data` (and device memory of any kind to `_set_host_data`). The registry of lent
/// memory only guards `dmabuf_rt_device_free` / `_host_free`; the owner SyncedMemory frees its
/// own block without asking it, when destroyed or when its memory is replaced. The block is
/// reissued to the next SyncedMemory of that size, and the borrower's transition writes into
/// the new owner's memory.
#[test]
fn another_synced_memorys_block_lent_then_freed_by_its_owner() {
    in_child("another_synced_memorys_block_lent_then_freed_by_its_owner", ENV, || {
        let size = 128 * KB;
        let mut failures = Vec::new();
        // (owner aliased, how the owner lets go: destroy or replace its own memory, lend as
        // device data or as host data)
        for (owner_alias, destroy, as_device) in
            [(false, true, true), (true, true, true), (false, false, true), (true, true, false), (true, false, false)]
        {
            let owner = synced(0, size, owner_alias);
            let lent = device_ptr(owner); // the owner's own device block
            let borrower = synced(0, size, false);
            if as_device {
                ok(dmabuf_rt_synced_set_device_data(borrower, lent));
            } else {
                // SAFETY: `lent` is device memory of this runtime (recognised as such).
                ok(unsafe { dmabuf_rt_synced_set_host_data(borrower, lent) });
            }
            let spare = device_alloc(0, size);
            let let_go =
                if destroy { dmabuf_rt_synced_destroy(owner) } else { dmabuf_rt_synced_set_device_data(owner, spare) };
            if let_go != DMABUF_RT_OK {
                // Refused while lent: also a fix.
                let _ = dmabuf_rt_synced_destroy(borrower);
                let _ = dmabuf_rt_synced_destroy(owner);
                ok(dmabuf_rt_device_free(0, spare));
                continue;
            }
            // A new SyncedMemory of that size, its device view holding 0x5a.
            let victim = synced(0, size, false);
            let vp = {
                let mut p = null_mut();
                // SAFETY: valid out-pointer.
                ok(unsafe { dmabuf_rt_synced_mutable_device_data(victim, &mut p) });
                p
            };
            ok(dmabuf_rt_memset(0, vp, 0x5a, size));
            // The borrower's transition writes its lent memory.
            if as_device {
                write_host(borrower, size, 0xc3);
                let _ = device_ptr(borrower);
            } else {
                let mut d = null_mut();
                // SAFETY: valid out-pointer.
                ok(unsafe { dmabuf_rt_synced_mutable_device_data(borrower, &mut d) });
                ok(dmabuf_rt_memset(0, d, 0xc3, size));
                let mut h: *const c_void = std::ptr::null();
                // SAFETY: valid out-pointer.
                ok(unsafe { dmabuf_rt_synced_host_data(borrower, &mut h) });
            }
            let got = read_device(0, vp, size);
            if !got.iter().all(|&b| b == 0x5a) {
                failures.push(format!(
                    "owner aliased {owner_alias}, owner {}, lent as {} data: the block was reissued (victim's block \
                     overlaps the lent range: {}) and the borrower's transition overwrote it: {}",
                    if destroy { "destroyed (status OK)" } else { "replaced its memory (status OK)" },
                    if as_device { "device" } else { "host" },
                    overlaps(vp, lent, size),
                    summary(&got)
                ));
            }
            ok(dmabuf_rt_synced_destroy(borrower));
            ok(dmabuf_rt_synced_destroy(victim));
            if !destroy {
                ok(dmabuf_rt_synced_destroy(owner));
            }
            ok(dmabuf_rt_device_free(0, spare));
        }
        assert!(failures.is_empty(), "{} of 5 cases:\n{}", failures.len(), failures.join("\n"));
    });
}

// ---- Finding 2: a free racing a lend of the same block ----

/// Finding 2. `device_free` skips the registry of lent memory while its count is 0
/// (`lent_guard`), and `lend_to_synced` counts the lend only after it has looked the block up
/// and stored it in the SyncedMemory. A free whose load of the count comes between the two
/// frees the block the lend has just taken: both calls return OK, and the SyncedMemory keeps
/// using a freed block (the registry then also refuses frees of whatever reuses it).
#[test]
fn a_free_racing_a_lend_of_the_same_block_is_never_both_accepted() {
    in_child("a_free_racing_a_lend_of_the_same_block_is_never_both_accepted", ENV, || {
        let size = 64 * KB;
        let rounds = common::scaled(100_000);
        let go = Arc::new(Barrier::new(2));
        let done = Arc::new(Barrier::new(2));
        let target = Arc::new(AtomicUsize::new(0));
        let handle = Arc::new(AtomicUsize::new(0));
        let lend_status = Arc::new(AtomicI32::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let lender = {
            let (go, done, target, handle, lend_status, stop) =
                (go.clone(), done.clone(), target.clone(), handle.clone(), lend_status.clone(), stop.clone());
            std::thread::spawn(move || {
                loop {
                    go.wait();
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let st = dmabuf_rt_synced_set_device_data(
                        handle.load(Ordering::SeqCst) as dmabuf_rt_synced,
                        target.load(Ordering::SeqCst) as *mut c_void,
                    );
                    lend_status.store(st as i32, Ordering::SeqCst);
                    done.wait();
                }
            })
        };
        let mut rng = common::Rng(0x9e37_79b9_7f4a_7c15);
        let mut both = None;
        let (mut lends, mut frees) = (0usize, 0usize);
        for round in 0..rounds {
            let h = synced(0, size, false);
            let p = device_alloc(0, size);
            handle.store(h as usize, Ordering::SeqCst);
            target.store(p as usize, Ordering::SeqCst);
            let spin = rng.below(1000);
            go.wait();
            for _ in 0..spin {
                std::hint::spin_loop();
            }
            let freed = dmabuf_rt_device_free(0, p);
            done.wait();
            let lent = lend_status.load(Ordering::SeqCst) == DMABUF_RT_OK as i32;
            lends += lent as usize;
            frees += (freed == DMABUF_RT_OK) as usize;
            if lent && freed == DMABUF_RT_OK {
                both = Some((round, spin));
                ok(dmabuf_rt_synced_destroy(h));
                break;
            }
            ok(dmabuf_rt_synced_destroy(h));
            if freed != DMABUF_RT_OK {
                ok(dmabuf_rt_device_free(0, p));
            }
        }
        stop.store(true, Ordering::SeqCst);
        go.wait();
        lender.join().unwrap();
        assert!(
            both.is_none(),
            "round {:?} (of {rounds}; {lends} lends and {frees} frees accepted before): dmabuf_rt_synced_set_device_data \
             and dmabuf_rt_device_free of the same block, from two threads, both returned OK: the live SyncedMemory \
             borrows a freed block",
            both
        );
    });
}

// ---- Finding 3: destroy with a push in flight into lent device memory ----

/// Finding 3. Split SyncedMemory with lent device memory; a push queued on a held stream
/// (host → the lent device block); destroy returns and clears the registry at once ("lent
/// memory ... may be freed from then on"), so `dmabuf_rt_device_free` of the lent block is
/// accepted, the next allocation of that size is the same block, and the push, when the stream
/// runs it, writes into the new owner's memory. (The borrowed range records no use of the
/// stream: `Buf::record_queue` does nothing for `Borrowed`.)
#[test]
fn destroy_with_a_push_in_flight_into_lent_device_memory() {
    in_child("destroy_with_a_push_in_flight_into_lent_device_memory", ENV, || {
        let size = 128 * KB;
        let lent = device_alloc(0, size);
        let h = synced(0, size, false);
        ok(dmabuf_rt_synced_set_device_data(h, lent));
        write_host(h, size, 0xc3);
        let s = new_stream(0);
        let gate = close_stream(s);
        ok(dmabuf_rt_synced_async_device_push(h, s));
        ok(dmabuf_rt_synced_destroy(h));
        let freed = dmabuf_rt_device_free(0, lent);
        if freed != DMABUF_RT_OK {
            gate.open();
            ok(dmabuf_rt_stream_synchronize(s));
            ok(dmabuf_rt_device_free(0, lent));
            ok(dmabuf_rt_stream_destroy(s));
            return;
        }
        let other = device_alloc(0, size);
        // The new owner's bytes, written through the CPU mapping (a memset would wait for the
        // held stream: the device synchronizes first).
        // SAFETY: `other` is a live block of `size` bytes of CPU-mapped shmem.
        unsafe { std::ptr::write_bytes(other.cast::<u8>(), 0x5a, size) };
        gate.open();
        ok(dmabuf_rt_stream_synchronize(s));
        let got = read_device(0, other, size);
        ok(dmabuf_rt_device_free(0, other));
        ok(dmabuf_rt_stream_destroy(s));
        assert!(
            got.iter().all(|&b| b == 0x5a),
            "dmabuf_rt_device_free of memory lent to a SyncedMemory destroyed with a push into it still queued was \
             accepted (same block reissued: {}); the push then overwrote the new owner's allocation: {}",
            other == lent,
            summary(&got)
        );
    });
}

// ---- Verified: the registry follows what each SyncedMemory still borrows ----

/// Every way a SyncedMemory stops borrowing memory releases it, and only it; interior and
/// cross-device ranges are refused; a refused lend registers nothing.
#[test]
fn the_lent_registry_follows_what_is_borrowed() {
    in_child("the_lent_registry_follows_what_is_borrowed", ENV, || {
        let size = 64 * KB;
        // Split: host lent, replaced by another host range: the first is free-able.
        let (h1, h2) = (host_alloc(size), host_alloc(size));
        let s = synced(0, size, false);
        // SAFETY: pinned host memory of `size` bytes.
        ok(unsafe { dmabuf_rt_synced_set_host_data(s, h1) });
        assert_eq!(dmabuf_rt_host_free(h1), DMABUF_RT_INVALID_POINTER, "lent host memory freed");
        // SAFETY: as above.
        ok(unsafe { dmabuf_rt_synced_set_host_data(s, h2) });
        ok(dmabuf_rt_host_free(h1));
        assert_eq!(dmabuf_rt_host_free(h2), DMABUF_RT_INVALID_POINTER, "lent host memory freed");
        // Device side lent too; destroy releases both.
        let d1 = device_alloc(0, size);
        ok(dmabuf_rt_synced_set_device_data(s, d1));
        assert_eq!(dmabuf_rt_device_free(0, d1), DMABUF_RT_INVALID_POINTER, "lent device memory freed");
        assert_eq!(dmabuf_rt_host_free(h2), DMABUF_RT_INVALID_POINTER, "lent host memory freed");
        ok(dmabuf_rt_synced_destroy(s));
        ok(dmabuf_rt_device_free(0, d1));
        ok(dmabuf_rt_host_free(h2));

        // Aliased: device memory lent as host data, then other device memory: the first goes.
        let (d1, d2) = (device_alloc(0, size), device_alloc(0, size));
        let s = synced(0, size, true);
        // SAFETY: device memory of this runtime.
        ok(unsafe { dmabuf_rt_synced_set_host_data(s, d1) });
        assert_eq!(dmabuf_rt_device_free(0, d1), DMABUF_RT_INVALID_POINTER, "lent device memory freed");
        ok(dmabuf_rt_synced_set_device_data(s, d2));
        ok(dmabuf_rt_device_free(0, d1));
        assert_eq!(dmabuf_rt_device_free(0, d2), DMABUF_RT_INVALID_POINTER, "lent device memory freed");
        ok(dmabuf_rt_synced_destroy(s));
        ok(dmabuf_rt_device_free(0, d2));

        // Interior ranges: a bigger device block and a bigger host block, lent from an offset.
        let big = device_alloc(0, 4 * size);
        let hbig = host_alloc(4 * size);
        let s = synced(0, size, false);
        // SAFETY: inside a live block of this runtime.
        ok(unsafe { dmabuf_rt_synced_set_host_data(s, hbig.cast::<u8>().add(size + 8).cast()) });
        ok(dmabuf_rt_synced_set_device_data(s, big.cast::<u8>().wrapping_add(2 * size + 4096).cast()));
        assert_eq!(dmabuf_rt_device_free(0, big), DMABUF_RT_INVALID_POINTER, "block lent from an interior freed");
        assert_eq!(dmabuf_rt_host_free(hbig), DMABUF_RT_INVALID_POINTER, "host block lent from an interior freed");
        ok(dmabuf_rt_synced_destroy(s));
        ok(dmabuf_rt_device_free(0, big));
        ok(dmabuf_rt_host_free(hbig));

        // Device 1's memory lent as host data to device 0's SyncedMemory.
        let d1 = device_alloc(1, size);
        let s = synced(0, size, false);
        // SAFETY: device memory of this runtime.
        ok(unsafe { dmabuf_rt_synced_set_host_data(s, d1) });
        assert_eq!(dmabuf_rt_device_free(1, d1), DMABUF_RT_INVALID_POINTER, "device 1 memory lent freed");
        // Refused lends register nothing: wrong device, too short, past its block.
        let d0 = device_alloc(0, size / 2);
        assert_ne!(dmabuf_rt_synced_set_device_data(s, d1), DMABUF_RT_OK, "device 1 memory lent as device 0's");
        assert_ne!(dmabuf_rt_synced_set_device_data(s, d0), DMABUF_RT_OK, "half-size block lent");
        // SAFETY: refused (runs past its block).
        assert_ne!(unsafe { dmabuf_rt_synced_set_host_data(s, d0) }, DMABUF_RT_OK, "half-size block lent");
        ok(dmabuf_rt_device_free(0, d0));
        ok(dmabuf_rt_synced_destroy(s));
        ok(dmabuf_rt_device_free(1, d1));
        assert_eq!(stats(0).allocated_bytes, 0, "device 0 memory left allocated");
        assert_eq!(stats(1).allocated_bytes, 0, "device 1 memory left allocated");
    });
}

/// Destroy racing a lend from two threads, and lends, replacements and destroys of many
/// SyncedMemories from eight threads: afterwards every block frees (nothing leaks in the
/// registry), and no free was accepted while its block was borrowed.
#[test]
fn lends_and_destroys_from_many_threads_leave_nothing_registered() {
    in_child("lends_and_destroys_from_many_threads_leave_nothing_registered", ENV, || {
        let size = 16 * KB;
        let bad = Arc::new(Mutex::new(Vec::<String>::new()));
        let hs: Vec<_> = (0..8usize)
            .map(|t| {
                let bad = bad.clone();
                std::thread::spawn(move || {
                    let mut rng = common::Rng(0x1234 + t as u64);
                    let mine: Vec<usize> = (0..4).map(|_| device_alloc(0, size) as usize).collect();
                    let host: Vec<usize> = (0..2).map(|_| host_alloc(size) as usize).collect();
                    for _ in 0..common::scaled(300) {
                        let s = synced(0, size, rng.below(2) == 0);
                        let p = mine[rng.below(4) as usize];
                        // A destroy racing the lend, on another thread.
                        let killer = std::thread::spawn(move || dmabuf_rt_synced_destroy(s));
                        let st = dmabuf_rt_synced_set_device_data(s, p as *mut c_void);
                        let st2 = if rng.below(2) == 0 {
                            // SAFETY: pinned host memory of `size` bytes.
                            unsafe { dmabuf_rt_synced_set_host_data(s, host[rng.below(2) as usize] as *mut c_void) }
                        } else {
                            DMABUF_RT_INVALID_HANDLE
                        };
                        let k = killer.join().unwrap();
                        for (what, st) in [("set_device_data", st), ("set_host_data", st2), ("destroy", k)] {
                            if st != DMABUF_RT_OK && st != DMABUF_RT_INVALID_HANDLE {
                                bad.lock().unwrap().push(format!("{what}: {st:?} ({})", last_error()));
                            }
                        }
                    }
                    for p in mine {
                        let st = dmabuf_rt_device_free(0, p as *mut c_void);
                        if st != DMABUF_RT_OK {
                            bad.lock()
                                .unwrap()
                                .push(format!("device_free after all destroys: {st:?} ({})", last_error()));
                        }
                    }
                    for p in host {
                        let st = dmabuf_rt_host_free(p as *mut c_void);
                        if st != DMABUF_RT_OK {
                            bad.lock()
                                .unwrap()
                                .push(format!("host_free after all destroys: {st:?} ({})", last_error()));
                        }
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        let bad = bad.lock().unwrap();
        assert!(bad.is_empty(), "{} unexpected statuses, first: {:?}", bad.len(), &bad[..bad.len().min(5)]);
        ok(dmabuf_rt_device_synchronize(0));
        assert_eq!(stats(0).allocated_bytes, 0, "device memory left allocated");
    });
}
