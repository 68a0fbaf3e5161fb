//! `Device`: one memory domain built from Rust, with no globals and no environment.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

use common::{QueueGate, Rng, pattern, scaled};
use dmabuf_rt::caching::stats::AGGREGATE;
use dmabuf_rt::caching::{Allocation, HostCachingAllocator};
use dmabuf_rt::source::ShmemSource;
use dmabuf_rt::{Access, Device, Error, ErrorKind};

const MB: usize = 1 << 20;

fn device(capacity: u64) -> Device {
    Device::builder(ShmemSource::new().reserve(false)).capacity(capacity).name("test").build().unwrap()
}

fn write(a: &Allocation, bytes: &[u8]) {
    let v = a.cpu_access(Access::Write).unwrap();
    v.write(0, bytes).unwrap();
    v.end().unwrap();
}

fn read(a: &Allocation, out: &mut [u8]) {
    let v = a.cpu_access(Access::Read).unwrap();
    v.read(0, out).unwrap();
    v.end().unwrap();
}

#[test]
fn a_device_allocates_copies_through_its_queue_and_reads_back() {
    let dev = device(256 * MB as u64);
    assert_eq!(dev.name(), "test");
    assert_eq!(dev.allocator().capacity(), 256 * MB as u64);
    let q = dev.new_queue().unwrap();
    let a = dev.allocate_on(3 * MB + 17, &q).unwrap();
    let b = dev.allocate(3 * MB + 17).unwrap();
    let host = dev.allocate_host(3 * MB + 17).unwrap();
    let want = pattern(3 * MB + 17, 7);
    {
        let v = host.cpu_access(Access::Write).unwrap();
        v.write(0, &want).unwrap();
        v.end().unwrap();
    }
    q.copy(a.mem(), host.mem().range(0, want.len()).unwrap()).unwrap();
    q.copy(b.mem(), a.mem()).unwrap();
    dev.synchronize().unwrap();
    let mut got = vec![0; want.len()];
    read(&b, &mut got);
    assert!(got == want, "the bytes copied through the device's queue differ");
    let st = dev.allocator().stats();
    assert_eq!(st.allocation[AGGREGATE].current, 2);
    drop((a, b));
    assert_eq!(dev.allocator().stats().allocation[AGGREGATE].current, 0);
}

/// `synchronize` waits for work on a queue from `new_queue`: a callback held at a gate has not
/// run when the gate opens, so a synchronize that returned before it would see its flag unset.
#[test]
fn synchronize_waits_for_every_queue_the_device_made() {
    for _ in 0..scaled(50) {
        let dev = Arc::new(device(64 * MB as u64));
        let q1 = dev.new_queue().unwrap();
        let q2 = dev.new_queue().unwrap();
        let default = dev.default_queue().unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let gates: Vec<QueueGate> = [&q1, &q2, &default].iter().map(|q| QueueGate::close(q)).collect();
        for q in [&q1, &q2, &default] {
            let ran = ran.clone();
            q.callback(move |_| {
                ran.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        }
        let syncer = {
            let (dev, ran) = (dev.clone(), ran.clone());
            std::thread::spawn(move || {
                dev.synchronize().unwrap();
                ran.load(Ordering::SeqCst)
            })
        };
        drop(gates);
        assert_eq!(syncer.join().unwrap(), 3, "synchronize returned before the queues' work ran");
    }
}

/// The device does not keep the queues it made alive, and a dropped one never holds up (or
/// fails) `synchronize`.
#[test]
fn dropped_queues_are_let_go_and_count_as_passed() {
    let dev = device(64 * MB as u64);
    for _ in 0..scaled(200) {
        let q = dev.new_queue().unwrap();
        let h = q.handle();
        q.fill(dev.allocate_on(4096, &q).unwrap().mem(), 1).unwrap();
        // Dropping the last holder joins the executor: had the device kept a reference, the
        // queue would still be running.
        drop(q);
        assert!(h.is_gone(), "the device kept a dropped queue alive");
        dev.synchronize().unwrap();
    }
    assert!(dev.synchronize().is_ok());
}

/// Synchronizing the device from a callback on one of its queues waits for the others but not
/// for the calling queue (which would wait for itself).
#[test]
fn synchronize_from_a_callback_on_the_devices_own_queue_returns() {
    let dev = Arc::new(device(64 * MB as u64));
    let q = dev.new_queue().unwrap();
    let other = dev.new_queue().unwrap();
    let other_ran = Arc::new(AtomicBool::new(false));
    let gate = QueueGate::close(&other);
    {
        let other_ran = other_ran.clone();
        other
            .callback(move |_| {
                other_ran.store(true, Ordering::SeqCst);
            })
            .unwrap();
    }
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let (dev, other_ran) = (dev.clone(), other_ran.clone());
        q.callback(move |_| {
            let r = dev.synchronize();
            let _ = tx.send((r, other_ran.load(Ordering::SeqCst)));
        })
        .unwrap();
    }
    drop(gate);
    let (r, saw) = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("HANG: synchronize from a callback");
    r.unwrap();
    assert!(saw, "synchronize from a callback did not wait for the device's other queue");
    q.synchronize().unwrap();
}

#[test]
fn device_specs_are_checked_and_unopenable_devices_say_why() {
    for bad in ["", "shmem:x", "heap:", "heap:a/b", "heap:..", "gem:relative", "cuda", "heap"] {
        let e = Device::from_spec(bad).err().unwrap_or_else(|| panic!("`{bad}` was accepted"));
        assert!(matches!(e, Error::Config { .. }), "`{bad}`: {e:?}");
        assert!(e.to_string().contains(bad), "`{bad}`: the error does not name it: {e}");
    }
    let dev = Device::from_spec("shmem").unwrap().capacity(8 * MB as u64).build().unwrap();
    assert_eq!(dev.name(), "shmem");
    drop(dev.allocate(MB).unwrap());
    // A heap that does not exist (on every machine): an error naming it (or, where the kernel
    // has no heaps at all, saying so), not a panic.
    let e = Device::from_spec("heap:no-such-heap-dmabuf-rt").unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("no-such-heap-dmabuf-rt") || msg.contains("/dev/dma_heap does not exist"), "{e}");
    assert_ne!(e.kind(), ErrorKind::InvalidArgument, "{e}");
}

#[test]
fn devices_given_one_host_allocator_share_its_cache() {
    let host = HostCachingAllocator::default();
    let a = Device::builder(ShmemSource::new()).host_allocator(host.clone()).build().unwrap();
    let b = Device::builder(ShmemSource::new()).host_allocator(host.clone()).build().unwrap();
    let x = a.allocate_host(MB).unwrap();
    let y = b.allocate_host(MB).unwrap();
    assert_eq!(host.stats().allocated_bytes, 2 * MB as u64);
    drop((x, y));
    assert_eq!(a.host_allocator().stats().allocated_bytes, 0);
    let reserved = host.stats().reserved_bytes;
    assert!(reserved >= 2 * MB as u64, "{reserved}");
    b.empty_cache();
    assert_eq!(host.stats().reserved_bytes, 0);
}

/// An exhausted device says so, with what it holds; the device keeps working afterwards.
#[test]
fn an_exhausted_device_fails_with_its_numbers_and_recovers() {
    let dev = device(16 * MB as u64);
    let held: Vec<_> = (0..3).map(|_| dev.allocate(4 * MB).unwrap()).collect();
    let e = dev.allocate(8 * MB).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfMemory, "{e}");
    drop(held);
    drop(dev.allocate(8 * MB).unwrap());
}

/// Several threads allocate, copy on their own queues, free, make and drop queues and
/// synchronize the one device at once, many times: every copy's bytes arrive, nothing hangs,
/// and the allocator's invariants hold at the end.
#[test]
fn threads_share_one_device() {
    let dev = Arc::new(device(512 * MB as u64));
    let threads = 4;
    let start = Arc::new(Barrier::new(threads));
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (dev, start) = (dev.clone(), start.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(0x9e37_79b9 + t as u64);
                start.wait();
                for i in 0..scaled(60) {
                    let q = dev.new_queue().unwrap();
                    let len = 1 + rng.below(3 * MB as u64) as usize;
                    let want = pattern(len, (t * 31 + i) as u8);
                    let src = dev.allocate(len).unwrap();
                    let dst = dev.allocate_on(len, &q).unwrap();
                    write(&src, &want);
                    q.copy(dst.mem(), src.mem()).unwrap();
                    if rng.below(3) == 0 {
                        dev.synchronize().unwrap();
                    } else {
                        q.synchronize().unwrap();
                    }
                    let mut got = vec![0; len];
                    read(&dst, &mut got);
                    assert!(got == want, "thread {t} round {i}: the copy's bytes differ");
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    dev.synchronize().unwrap();
    dev.allocator().check_invariants().unwrap();
    assert_eq!(dev.allocator().stats().allocation[AGGREGATE].current, 0);
}

/// SyncedMemory on a device: written on the host, read on the device after a transition on the
/// device's default queue, with a separate host buffer (so a copy really runs).
#[test]
fn synced_memory_on_a_device_round_trips() {
    let dev = device(64 * MB as u64);
    let mut m = dev.synced_memory(MB + 3).alias(false).queue(dev.default_queue().unwrap()).build().unwrap();
    let want = pattern(MB + 3, 9);
    m.mutable_host_data().unwrap().write(0, &want).unwrap();
    let d = m.device_data().unwrap();
    let mut got = vec![0; want.len()];
    let staging = dev.allocate_host(want.len()).unwrap();
    dmabuf_rt::queue::copy_now(staging.mem().range(0, want.len()).unwrap(), d).unwrap();
    let v = staging.cpu_access(Access::Read).unwrap();
    v.read(0, &mut got).unwrap();
    v.end().unwrap();
    assert!(got == want, "the device side of the SyncedMemory differs from what the host wrote");
    assert_eq!(m.copies(), 1);
    drop(m);
    dev.synchronize().unwrap();
}

/// Devices over the kernel's sources (the kernel lane has both; elsewhere each skips, saying
/// why): the system heap and the first DRM card node, each allocating, copying through a
/// queue and reading back, by spec as the C runtime opens them.
#[test]
fn devices_over_the_kernels_sources_allocate_and_copy() {
    use dmabuf_rt::testing::or_skip;
    for spec in ["heap:system", "gem"] {
        let Some(b) = or_skip(&format!("devices_over_the_kernels_sources ({spec})"), Device::from_spec(spec)) else {
            continue;
        };
        let dev = b.capacity(64 * MB as u64).build().unwrap();
        assert_eq!(dev.name(), spec);
        let q = dev.new_queue().unwrap();
        let want = pattern(MB + 5, 3);
        let src = dev.allocate(want.len()).unwrap();
        let dst = dev.allocate_on(want.len(), &q).unwrap();
        write(&src, &want);
        q.copy(dst.mem(), src.mem()).unwrap();
        dev.synchronize().unwrap();
        let mut got = vec![0; want.len()];
        read(&dst, &mut got);
        assert!(got == want, "{spec}: the copy's bytes differ");
    }
}
