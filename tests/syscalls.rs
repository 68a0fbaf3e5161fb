//! System calls counted: CPU work on queues (event records, inline and queued copies and
//! fills, waits, callbacks, synchronize, deferred frees passing their markers) makes no
//! `io_uring_enter` at all; the kernel engine's copies queued one after another reach the
//! ring as one chain, one `io_uring_enter` for many.
//!
//! The count is the kernel's: in a child process of its own, a seccomp filter hands every
//! `io_uring_enter` of the test's thread and the threads it starts (the queues' executors) to
//! a supervisor thread (`SECCOMP_RET_USER_NOTIF`), which counts it and lets it run
//! (`SECCOMP_USER_NOTIF_FLAG_CONTINUE`). Positive controls show the counter counts.
#![allow(unsafe_code)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::isolate::{is_child, isolated};
use common::{QueueGate, pattern};
use dmabuf_rt::caching::CachingAllocator;
use dmabuf_rt::queue::{CopyEngine, HostBuffer, Mem, Queue};
use dmabuf_rt::source::{MemorySource, ShmemSource};

/// Counts the `io_uring_enter` calls of this thread and of every thread it starts from now
/// on; returns the count.
#[cfg(target_arch = "x86_64")]
fn count_io_uring_enter() -> Arc<AtomicUsize> {
    use common::seccomp::{NR_IO_URING_ENTER, install_one_rule};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // No TSYNC: the filter applies to this thread and the threads it starts.
    let rc = install_one_rule(NR_IO_URING_ENTER, libc::SECCOMP_RET_USER_NOTIF, libc::SECCOMP_FILTER_FLAG_NEW_LISTENER);
    // SAFETY: the kernel returned a new fd, owned by nobody else.
    let listener = unsafe { OwnedFd::from_raw_fd(rc as i32) };
    let count = Arc::new(AtomicUsize::new(0));
    let c = Arc::clone(&count);
    std::thread::spawn(move || {
        loop {
            // SAFETY: all-zero bytes are a valid seccomp_notif (the kernel requires it zeroed).
            let mut req: libc::seccomp_notif = unsafe { std::mem::zeroed() };
            // SAFETY: `req` is a valid, writable seccomp_notif for the ioctl to fill.
            let r = unsafe { libc::ioctl(listener.as_raw_fd(), libc::SECCOMP_IOCTL_NOTIF_RECV, &mut req) };
            if r != 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return;
            }
            c.fetch_add(1, Ordering::SeqCst);
            let resp = libc::seccomp_notif_resp {
                id: req.id,
                val: 0,
                error: 0,
                flags: libc::SECCOMP_USER_NOTIF_FLAG_CONTINUE as u32,
            };
            // SAFETY: `resp` is a valid seccomp_notif_resp answering the request just read.
            unsafe { libc::ioctl(listener.as_raw_fd(), libc::SECCOMP_IOCTL_NOTIF_SEND, &resp) };
        }
    });
    count
}

/// Whether test `name`'s body runs in this process: only in its isolated child, and only on
/// x86-64 (the filter matches x86-64 system call numbers); otherwise it says why it skipped or
/// runs the child and checks it.
fn runs_here(name: &str) -> bool {
    if !cfg!(target_arch = "x86_64") {
        eprintln!("skipped: the seccomp filter here is written for x86_64 system call numbers");
        return false;
    }
    if !is_child(name) {
        isolated(name, &[], Duration::from_secs(120));
        return false;
    }
    true
}

const ROUNDS: usize = 2_000;

#[test]
fn cpu_work_on_queues_makes_no_io_uring_enter() {
    if !runs_here("cpu_work_on_queues_makes_no_io_uring_enter") {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let enters = count_io_uring_enter();
        let (q1, q2) = (Queue::new().unwrap(), Queue::new().unwrap());
        let kernel = Queue::builder().engine(CopyEngine::Kernel).build().unwrap();
        let a = CachingAllocator::builder(ShmemSource::new()).capacity(1 << 30).build().unwrap();
        let host = HostBuffer::new(1 << 20).unwrap();
        let seg = std::sync::Arc::new(ShmemSource::new().create_segment(1 << 20).unwrap());

        let small = |m: Mem| m.range(0, 4096).unwrap();
        let (dev, h): (Mem, Mem) = ((&seg).into(), (&host).into());
        for i in 0..ROUNDS {
            // Idle queue: inline copy, fill, record, wait, synchronize.
            q1.copy(small(dev.clone()), small(h.clone())).unwrap();
            q1.fill(small(dev.clone()), i as u8).unwrap();
            let e = q1.record().unwrap();
            assert!(e.is_complete(), "a record on an idle queue completes at once");
            q2.wait(&e).unwrap();
            // A 1 MiB copy goes to the executor thread (past the inline limit); a callback too.
            q1.copy(dev.clone(), h.clone()).unwrap();
            q1.callback(|r| r.unwrap()).unwrap();
            q1.synchronize().unwrap();
            // A deferred free whose marker waits behind a gate on q2, then passes.
            let mut b = a.allocate(64 << 10, Some(&q1)).unwrap();
            b.record_queue(&q2);
            let gate = QueueGate::close(&q2);
            drop(b);
            gate.open();
            q2.synchronize().unwrap();
            // And the raw API's.
            let p = a.allocate_raw(64 << 10, Some(&q1)).unwrap();
            a.record_queue_raw(p, &q2).unwrap();
            let gate = QueueGate::close(&q2);
            a.free_raw(p).unwrap();
            gate.open();
            q2.synchronize().unwrap();
        }
        let st = a.stats();
        assert_eq!(st.active[0].current, 0, "every deferred free completed");
        let cpu_enters = enters.load(Ordering::SeqCst);
        // The positive control: the kernel engine's copy enters the ring.
        kernel.copy(&dev, &h).unwrap();
        kernel.synchronize().unwrap();
        let control = enters.load(Ordering::SeqCst) - cpu_enters;
        println!("io_uring_enter: {cpu_enters} for {ROUNDS} rounds of CPU work; {control} for one kernel-engine copy");
        assert_eq!(cpu_enters, 0, "CPU-only work entered io_uring");
        assert!(control >= 1, "the counter did not see the kernel engine's io_uring_enter: it counts nothing");
    }
}

/// Kernel-engine copies queued one after another behind a gate (each depending on the one
/// before: host -> a -> host2 -> b ...) reach the ring as chains of up to 16: one
/// `io_uring_enter` for many, and the bytes come out right (the chain keeps their order).
#[test]
fn queued_kernel_copies_share_one_io_uring_enter() {
    if !runs_here("queued_kernel_copies_share_one_io_uring_enter") {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        const LEN: usize = 64 << 10;
        const COPIES: usize = 32;
        let enters = count_io_uring_enter();
        let q = Queue::builder().engine(CopyEngine::Kernel).build().unwrap();
        let want = pattern(LEN, 3);
        let first: Mem = (&HostBuffer::from_slice(&want).unwrap()).into();
        let segs: Vec<Mem> =
            (0..COPIES / 2).map(|_| (&Arc::new(ShmemSource::new().create_segment(LEN).unwrap())).into()).collect();
        let hosts: Vec<Mem> = (0..COPIES / 2).map(|_| (&HostBuffer::new(LEN).unwrap()).into()).collect();
        let gate = QueueGate::close(&q);
        // host -> seg0 (WRITE), seg0 -> host0 (READ), host0 -> seg1 (WRITE), ...
        let mut from = first.clone();
        for k in 0..COPIES / 2 {
            q.copy(&segs[k], &from).unwrap();
            q.copy(&hosts[k], &segs[k]).unwrap();
            from = hosts[k].clone();
        }
        let before = enters.load(Ordering::SeqCst);
        gate.open();
        q.synchronize().unwrap();
        let used = enters.load(Ordering::SeqCst) - before;
        let mut got = vec![0u8; LEN];
        let out = HostBuffer::new(LEN).unwrap();
        dmabuf_rt::queue::copy_now(Mem::from(&out), &from).unwrap();
        out.read(0, &mut got).unwrap();
        println!("io_uring_enter: {used} for {COPIES} queued kernel-engine copies");
        assert!(got == want, "the chained copies changed the bytes (order lost?)");
        assert!(used >= 1, "the counter saw no io_uring_enter: it counts nothing");
        assert!(used <= COPIES / 8, "{used} io_uring_enter for {COPIES} queued copies: not chained");
    }
}
