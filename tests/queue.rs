//! Queues and events: ordering, cross-queue waits, failures, drops, kernel fences.

mod common;

use common::QueueGate;

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{or_skip, pattern};
use dmabuf_rt::queue::{CopyEngine, Event, HostBuffer, Mem, Queue, copy_now};
use dmabuf_rt::source::{GemSource, HeapSource, HostSource, MemorySource, ShmemSource};
use dmabuf_rt::{Access, Error, Segment, SegmentKind};

fn seg(len: usize) -> Arc<Segment> {
    Arc::new(ShmemSource::new().create_segment(len).unwrap())
}

/// True if `ev` is still pending after waiting `d` for it. For checks that something has not
/// happened yet while a gate or fence guarantees it cannot have: a correct run always passes,
/// and a run that breaks the guarantee is caught unless the machine is too slow to break it
/// within `d`.
fn still_pending(ev: &Event, d: Duration) -> bool {
    matches!(ev.synchronize(Some(d)), Err(Error::Timeout { .. }))
}

fn queues() -> Vec<(&'static str, Queue)> {
    vec![
        ("default", Queue::new().unwrap()),
        ("executor-only", Queue::builder().inline_max(0).build().unwrap()),
        ("kernel-engine", Queue::builder().engine(CopyEngine::Kernel).build().unwrap()),
    ]
}

#[test]
fn a_chain_of_dependent_copies_and_fills_produces_exactly_the_expected_bytes() {
    for len in [4096, 1 << 20, 9 << 20] {
        for (name, q) in queues() {
            let data = pattern(len, 1);
            let host_in = HostBuffer::from_slice(&data).unwrap();
            let host_out = HostBuffer::new(len).unwrap();
            let (a, b) = (seg(len), seg(len));
            let half = len / 2;
            let quarter = len / 4;
            q.copy(&a, &host_in).unwrap(); // h2d
            q.fill(&b, 0x11).unwrap();
            q.copy(Mem::from(&b).range(quarter, half).unwrap(), Mem::from(&a).range(0, half).unwrap()).unwrap(); // d2d
            q.fill(Mem::from(&a).range(0, quarter).unwrap(), 0x22).unwrap();
            q.copy(Mem::from(&host_out).range(0, half).unwrap(), Mem::from(&a).range(0, half).unwrap()).unwrap(); // d2h
            q.copy(Mem::from(&host_out).range(half, half).unwrap(), Mem::from(&b).range(half, half).unwrap()).unwrap();
            q.synchronize().unwrap();

            let mut want_a = data.clone();
            want_a[..quarter].fill(0x22);
            let mut want_b = vec![0x11u8; len];
            want_b[quarter..quarter + half].copy_from_slice(&data[..half]);
            let mut want = want_a[..half].to_vec();
            want.extend_from_slice(&want_b[half..]);
            assert!(host_out.to_vec() == want, "{name} len {len}: wrong bytes");
            assert!(q.is_idle());
        }
    }
}

#[test]
fn copies_between_two_devices_and_within_one_segment() {
    for (name, q) in queues() {
        // Two different sources: shmem (unified) and pinned host memory.
        let a = seg(1 << 20);
        let pinned = Arc::new(HostSource::mlocked().create_segment(1 << 20).unwrap());
        let host = HostBuffer::from_slice(&pattern(1 << 20, 4)).unwrap();
        q.copy(&a, &host).unwrap();
        q.copy(&pinned, &a).unwrap();
        // Overlapping ranges of one segment behave like memmove, on every engine.
        q.copy(Mem::from(&pinned).range(100, 5000).unwrap(), Mem::from(&pinned).range(0, 5000).unwrap()).unwrap();
        q.copy(Mem::from(&a).range(0, 5000).unwrap(), Mem::from(&a).range(64, 5000).unwrap()).unwrap();
        q.synchronize().unwrap();
        let mut want_pinned = pattern(1 << 20, 4);
        want_pinned.copy_within(0..5000, 100);
        let mut want_a = pattern(1 << 20, 4);
        want_a.copy_within(64..5064, 0);
        let out = HostBuffer::new(1 << 20).unwrap();
        copy_now(&out, &pinned).unwrap();
        assert!(out.to_vec() == want_pinned, "{name}: pinned");
        copy_now(&out, &a).unwrap();
        assert!(out.to_vec() == want_a, "{name}: shmem");
    }
}

#[test]
fn a_cross_queue_wait_orders_work_between_queues() {
    let (q1, q2) = (Queue::new().unwrap(), Queue::new().unwrap());
    for _ in 0..5 {
        let a = seg(1 << 20);
        let out = HostBuffer::new(1 << 20).unwrap();
        let gate = QueueGate::close(&q1);
        q1.fill(&a, 7).unwrap();
        let done = q1.record().unwrap();
        q2.wait(&done).unwrap();
        q2.copy(&out, &a).unwrap();
        let copied = q2.record().unwrap();
        // q1's fill is held back: q2 must not get past its wait.
        assert!(still_pending(&copied, Duration::from_millis(50)), "q2 ran past its wait before q1 reached the event");
        assert!(!done.is_complete());
        gate.open();
        q2.synchronize().unwrap();
        assert!(done.is_complete());
        assert!(out.to_vec().iter().all(|&b| b == 7), "q2 copied before q1's fill");
    }
}

#[test]
fn many_queues_at_once() {
    let results: Vec<bool> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8u8)
            .map(|i| {
                s.spawn(move || {
                    let q = Queue::new().unwrap();
                    let a = seg(256 << 10);
                    let out = HostBuffer::new(256 << 10).unwrap();
                    for round in 0..40u8 {
                        let byte = i.wrapping_mul(31).wrapping_add(round);
                        q.fill(&a, byte).unwrap();
                        q.copy(&out, &a).unwrap();
                        let e = q.record().unwrap();
                        e.synchronize(None).unwrap();
                        if !out.to_vec().iter().all(|&b| b == byte) {
                            return false;
                        }
                    }
                    true
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(results.iter().all(|&ok| ok), "{results:?}");
}

/// A memfd segment whose pwrite fails with EPERM at execution (F_SEAL_FUTURE_WRITE added after
/// our writable mapping exists): a real kernel failure, not a simulated one.
fn unwritable_by_the_kernel(len: usize) -> Arc<Segment> {
    let fd = rustix::fs::memfd_create("sealed-later", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, len as u64).unwrap();
    rustix::fs::fcntl_add_seals(&fd, rustix::fs::SealFlags::SHRINK).unwrap();
    let seg = Segment::import(&fd, SegmentKind::Unified).unwrap();
    rustix::fs::fcntl_add_seals(&fd, rustix::fs::SealFlags::FUTURE_WRITE).unwrap();
    Arc::new(seg)
}

#[test]
fn a_failing_copy_fails_its_event_and_the_work_after_it() {
    for inline_max in [64 << 10, 0] {
        let q = Queue::builder().engine(CopyEngine::Kernel).inline_max(inline_max).build().unwrap();
        let bad = unwritable_by_the_kernel(8192);
        let after = seg(8192);
        let host = HostBuffer::from_slice(&[0xab; 8192]).unwrap();
        let told = Arc::new(Mutex::new(None));
        let q2 = Queue::new().unwrap();
        // Hold the queue so that a second queue's wait is in place before the failure happens.
        let gate = QueueGate::close(&q);
        q.copy(&bad, &host).unwrap();
        let e = q.record().unwrap();
        q2.wait(&e).unwrap();
        q2.fill(&after, 5).unwrap();
        q.fill(&after, 9).unwrap();
        let t = told.clone();
        q.callback(move |r| *t.lock().unwrap() = Some(r.is_err())).unwrap();
        assert!(!e.is_complete(), "the failing copy ran before the gate opened");
        gate.open();
        let err = q.synchronize().unwrap_err();
        assert!(matches!(err, Error::OperationFailed { .. }), "{err}");
        assert!(err.to_string().contains("Operation not permitted"), "{err}");
        assert!(matches!(e.query(), Err(Error::OperationFailed { .. })));
        assert_eq!(*told.lock().unwrap(), Some(true), "the callback was not told of the failure");
        // The other queue, blocked in its wait when the failure happened, fails in turn.
        let err2 = q2.synchronize().unwrap_err();
        assert!(err2.to_string().contains("waited-on event failed"), "{err2}");
        let out = HostBuffer::new(8192).unwrap();
        copy_now(&out, &after).unwrap();
        assert!(out.to_vec().iter().all(|&b| b == 0), "work after the failure ran");

        // Work queued before clear_error is still skipped, even though it has not run yet when
        // the error is cleared (the gate holds it); work after it runs.
        let gate = QueueGate::close(&q);
        q.fill(&after, 1).unwrap();
        assert!(q.clear_error().is_some());
        q.fill(Mem::from(&after).range(0, 4096).unwrap(), 3).unwrap();
        gate.open();
        q.synchronize().unwrap();
        copy_now(&out, &after).unwrap();
        let v = out.to_vec();
        assert!(v[..4096].iter().all(|&b| b == 3) && v[4096..].iter().all(|&b| b == 0), "inline_max {inline_max}");
    }
}

#[test]
fn a_panicking_callback_fails_the_queue_instead_of_hanging_it() {
    let q = Queue::new().unwrap();
    let a = seg(4096);
    q.callback(|_| panic!("user code panicked")).unwrap();
    q.fill(&a, 1).unwrap();
    let e = q.synchronize_timeout(Duration::from_secs(10)).unwrap_err();
    assert!(e.to_string().contains("callback panicked"), "{e}");
    q.clear_error();
    q.fill(&a, 2).unwrap();
    q.synchronize().unwrap();
    let out = HostBuffer::new(4096).unwrap();
    copy_now(&out, &a).unwrap();
    assert!(out.to_vec().iter().all(|&b| b == 2));
    // A panicking completion hook is contained too. (The gate keeps the record pending until
    // the hook is registered, so the hook runs on the queue's thread, not at once on this one.)
    let ev = q.record().unwrap();
    ev.synchronize(None).unwrap();
    let gate = QueueGate::close(&q);
    q.record_event(&ev).unwrap();
    ev.on_complete(|_| panic!("hook panicked"));
    gate.open();
    q.synchronize().unwrap();
    q.fill(&a, 3).unwrap();
    q.synchronize().unwrap();
}

#[test]
fn an_event_re_recorded_on_a_faster_queue_does_not_release_earlier_waits() {
    let (slow, fast, waiter) = (Queue::new().unwrap(), Queue::new().unwrap(), Queue::new().unwrap());
    let ev = Event::new();
    let order = Arc::new(Mutex::new(Vec::new()));
    let o = order.clone();
    // `slow` is held until the test opens the gate (dropping `open` does).
    let (open, gate) = mpsc::channel::<()>();
    slow.callback(move |_| {
        let _ = gate.recv();
        o.lock().unwrap().push("slow reached the event");
    })
    .unwrap();
    slow.record_event(&ev).unwrap(); // generation 1
    waiter.wait(&ev).unwrap(); // waits for generation 1
    let o = order.clone();
    waiter.callback(move |_| o.lock().unwrap().push("waiter ran")).unwrap();
    fast.record_event(&ev).unwrap(); // generation 2 completes at once
    let waited = waiter.record().unwrap();
    assert!(still_pending(&waited, Duration::from_millis(100)), "generation 2 released the wait for generation 1");
    drop(open);
    waiter.synchronize().unwrap();
    slow.synchronize().unwrap();
    assert_eq!(*order.lock().unwrap(), ["slow reached the event", "waiter ran"]);
}

#[test]
fn queues_can_be_dropped_right_after_creation_or_synchronize() {
    for _ in 0..200 {
        let q = Queue::new().unwrap();
        drop(q);
        let q = Queue::new().unwrap();
        q.synchronize().unwrap();
        drop(q);
    }
}

#[test]
fn bad_submissions_get_clear_errors_and_leave_the_queue_working() {
    let q = Queue::new().unwrap();
    let a = seg(8192);
    let small = HostBuffer::new(100).unwrap();
    assert!(matches!(q.copy(&a, &small), Err(Error::SizeMismatch { dst: 8192, src: 100 })));
    assert!(matches!(Mem::from(&a).range(8000, 200), Err(Error::OutOfBounds { .. })));
    assert!(matches!(Mem::from(&a).range(usize::MAX, 2), Err(Error::OutOfBounds { .. })));
    let fd = rustix::fs::memfd_create("ro", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, 4096).unwrap();
    rustix::fs::fcntl_add_seals(&fd, rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::WRITE).unwrap();
    let ro = Arc::new(Segment::import(&fd, SegmentKind::Unified).unwrap());
    assert!(matches!(q.fill(&ro, 1), Err(Error::ReadOnly)));
    assert!(matches!(HostBuffer::new(0), Err(Error::ZeroLength)));
    assert!(matches!(HostBuffer::new(usize::MAX), Err(Error::TooLarge { .. })));
    q.fill(&a, 1).unwrap();
    q.synchronize().unwrap();
    assert!(q.error().is_none());
}

/// A "fence" that never signals: the read end of a pipe nobody writes.
fn never_signalled() -> (Event, OwnedFd) {
    let (r, w) = rustix::pipe::pipe().unwrap();
    (Event::from_readable_fd(r).unwrap(), w)
}

#[test]
fn fd_events_complete_through_io_uring_and_time_out_clearly() {
    let (ev, writer) = never_signalled();
    let t = Instant::now();
    let e = ev.synchronize(Some(Duration::from_millis(100))).unwrap_err();
    assert!(t.elapsed() >= Duration::from_millis(100));
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("did not complete within 100ms"), "{e}");
    assert!(!ev.is_complete());
    rustix::io::write(&writer, b"x").unwrap();
    ev.synchronize(Some(Duration::from_secs(5))).unwrap();
    assert!(ev.query().unwrap());

    // Hang-up without data is a failure, not a signal.
    let (ev, writer) = never_signalled();
    drop(writer);
    let e = ev.synchronize(Some(Duration::from_secs(5))).unwrap_err();
    assert!(e.to_string().contains("without becoming readable"), "{e}");
    // Only sync_files are fences.
    let (r, _w) = rustix::pipe::pipe().unwrap();
    let e = Event::from_sync_file(r).unwrap_err();
    assert!(matches!(e, Error::BadImport { .. }) && e.to_string().contains("not a sync_file"), "{e}");
}

#[test]
fn dropping_a_queue_with_work_in_flight_is_clean() {
    // Submitted copies still happen: no data is lost.
    let a = seg(8 << 20);
    let out = HostBuffer::new(8 << 20).unwrap();
    let q = Queue::builder().inline_max(0).build().unwrap();
    let gate = QueueGate::close(&q);
    q.fill(&a, 0x42).unwrap();
    q.copy(&out, &a).unwrap();
    let last = q.record().unwrap();
    assert!(!last.is_complete());
    // The drop starts while the 8 MiB fill and copy are still queued: the executor has to wake
    // from the gate first. (Were they done first, the test would pass without testing the drop;
    // it cannot fail for that. The drop cannot be made to start behind a closed gate: it would
    // wait for the gate.)
    gate.open();
    drop(q);
    assert!(last.query().unwrap());
    assert!(out.to_vec().iter().all(|&b| b == 0x42));

    // A wait that can never finish is abandoned: the drop returns, what follows is skipped.
    let (never, _writer) = never_signalled();
    let b = seg(4096);
    let q = Queue::new().unwrap();
    q.wait(&never).unwrap();
    q.fill(&b, 1).unwrap();
    let skipped = q.record().unwrap();
    let t = Instant::now();
    drop(q);
    assert!(t.elapsed() < Duration::from_secs(2) * common::time_scale(), "drop hung on a pending wait");
    assert!(matches!(skipped.query(), Err(Error::OperationFailed { .. })));
    let out = HostBuffer::new(4096).unwrap();
    copy_now(&out, &b).unwrap();
    assert!(out.to_vec().iter().all(|&b| b == 0));
}

#[test]
fn elapsed_time_between_events() {
    let q = Queue::new().unwrap();
    let start = Instant::now();
    let e1 = q.record().unwrap();
    e1.synchronize(None).unwrap();
    let gate = QueueGate::close(&q);
    let e2 = q.record().unwrap();
    // e2 completes only after the gate opens, at least 25 ms after e1 completed. (This sleep
    // is the interval measured, not an ordering.)
    std::thread::sleep(Duration::from_millis(25));
    gate.open();
    q.synchronize().unwrap();
    let bound = start.elapsed();
    let dt = e2.elapsed_since(&e1).unwrap();
    assert!(dt >= Duration::from_millis(25) && dt <= bound, "{dt:?}, both events within {bound:?}");
    assert!(matches!(Event::new().elapsed_since(&e1), Err(Error::NoTiming { .. })));
}

#[test]
fn completion_hooks_run_once_on_completion_without_polling() {
    let q = Queue::builder().inline_max(0).build().unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let gate = QueueGate::close(&q);
    let e = q.record().unwrap();
    let r = runs.clone();
    e.on_complete(move |res| {
        assert!(res.is_ok());
        r.fetch_add(1, Ordering::SeqCst);
    });
    assert_eq!(runs.load(Ordering::SeqCst), 0, "hook ran before the event completed");
    gate.open();
    q.synchronize().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // Registered after completion: runs at once.
    let r = runs.clone();
    e.on_complete(move |_| {
        r.fetch_add(1, Ordering::SeqCst);
    });
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    // Re-recording starts a new generation; hooks of the old one do not run again.
    let gate = QueueGate::close(&q);
    q.record_event(&e).unwrap();
    assert!(!e.query().unwrap(), "a new generation must be pending until the queue reaches it");
    let r = runs.clone();
    e.on_complete(move |_| {
        r.fetch_add(10, Ordering::SeqCst);
    });
    assert_eq!(runs.load(Ordering::SeqCst), 2, "a hook ran before its generation completed");
    gate.open();
    e.synchronize(None).unwrap();
    q.synchronize().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 12);
}

#[test]
fn records_complete_in_order_and_after_the_hooks_of_earlier_records() {
    // A hook on an earlier event, held while it runs: neither that event nor one recorded
    // later (the queue has nothing else queued; an inline record would complete on this thread
    // before `record` returns) may complete before the hook has run.
    let q = Queue::builder().inline_max(0).build().unwrap();
    for _ in 0..20 {
        let ran = Arc::new(AtomicUsize::new(0));
        let gate = QueueGate::close(&q);
        let e = q.record().unwrap();
        let r = ran.clone();
        let (started_tx, started) = mpsc::channel::<()>();
        let (open_hook, hook_gate) = mpsc::channel::<()>();
        e.on_complete(move |_| {
            let _ = started_tx.send(());
            let _ = hook_gate.recv();
            r.store(1, Ordering::SeqCst);
        });
        gate.open();
        started.recv_timeout(Duration::from_secs(60)).expect("the hook started");
        // The executor is inside e's hook.
        let later = q.record().unwrap();
        assert!(!later.is_complete(), "a later record completed while an earlier record's hook ran");
        assert!(!e.is_complete(), "an event completed before its hook ran");
        assert!(still_pending(&e, Duration::from_millis(20)), "e's synchronize returned before its hook ran");
        assert!(still_pending(&later, Duration::from_millis(20)), "a later record's synchronize returned first");
        drop(open_hook);
        later.synchronize(None).unwrap();
        assert_eq!(ran.load(Ordering::SeqCst), 1, "a later record completed before an earlier record's hook ran");
        assert!(e.is_complete());
        q.synchronize().unwrap();
    }
}

#[test]
fn kernel_lane_a_queue_waits_for_a_vgem_fence() {
    let Some(gem) = or_skip("queue_vgem_fence", GemSource::open_first(Some("vgem"))) else { return };
    let src = Arc::new(gem.create_segment(1 << 20).unwrap());
    let data = pattern(src.len(), 8);
    src.cpu_access(Access::Write).unwrap().write(0, &data).unwrap();
    let fence = gem.vgem_attach_fence(&src, true).unwrap();
    let ev = Event::from_dma_buf(&src, Access::Read).unwrap();
    let out = HostBuffer::new(src.len()).unwrap();
    let q = Queue::new().unwrap();
    q.wait(&ev).unwrap();
    q.copy(&out, &src).unwrap();
    let copied = q.record().unwrap();
    // The unsignalled fence is the gate.
    assert!(still_pending(&copied, Duration::from_millis(150)), "the copy ran before the fence signalled");
    assert!(out.to_vec().iter().all(|&b| b == 0));
    fence.signal().unwrap();
    copied.synchronize(Some(Duration::from_secs(5))).unwrap();
    assert!(out.to_vec() == data);

    // A fence never signalled: synchronize times out with a clear error.
    let pending = gem.vgem_attach_fence(&src, true).unwrap();
    let ev = Event::from_dma_buf(&src, Access::Read).unwrap();
    let e = ev.synchronize(Some(Duration::from_millis(200))).unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }) && e.to_string().contains("did not complete"), "{e}");
    drop(pending);
    ev.synchronize(Some(Duration::from_secs(5))).unwrap();

    // Device-to-device across two sources (p2p): GEM to the system heap.
    if let Some(heap) = or_skip("queue_p2p_heap", HeapSource::open("system")) {
        let dst = Arc::new(heap.create_segment(src.len()).unwrap());
        q.copy(&dst, &src).unwrap();
        q.synchronize().unwrap();
        let back = HostBuffer::new(src.len()).unwrap();
        copy_now(&back, &dst).unwrap();
        assert!(back.to_vec() == data);
    }
}

#[test]
fn queues_and_events_are_shared_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Queue>();
    send_sync::<Event>();
    send_sync::<HostBuffer>();
    send_sync::<Mem>();
}

/// Operands lent to a queue (`q.copy(&dst, &src)`): run at once on an idle queue, and cloned
/// when the copy has to wait, so the caller may drop every handle of its memory right after
/// the call and the copy still reads and writes live memory (on each queue kind, from two
/// threads at once).
#[test]
fn lent_operands_outlive_the_callers_handles_when_the_copy_waits() {
    std::thread::scope(|s| {
        for t in 0..2u8 {
            s.spawn(move || {
                for (name, q) in queues() {
                    for len in [4096, 256 << 10] {
                        let want = pattern(len, 7 + t);
                        let dst_seg = seg(len);
                        // Idle queue: runs at once.
                        {
                            let (d, src): (Mem, Mem) =
                                ((&dst_seg).into(), (&HostBuffer::from_slice(&want).unwrap()).into());
                            q.copy(&d, &src).unwrap();
                        }
                        q.synchronize().unwrap();
                        let mut got = vec![0u8; len];
                        dst_seg.mapping().unwrap().read(0, &mut got).unwrap();
                        assert!(got == want, "{name}: an inline copy with lent operands");
                        // Busy queue: the copy waits behind a gate; every handle the caller had
                        // of the source is dropped before it runs.
                        q.fill(Mem::from(&dst_seg), 0).unwrap();
                        let gate = QueueGate::close(&q);
                        {
                            let host = HostBuffer::from_slice(&want).unwrap();
                            let (d, src): (Mem, Mem) = ((&dst_seg).into(), (&host).into());
                            q.copy(&d, &src).unwrap();
                        }
                        gate.open();
                        q.synchronize().unwrap();
                        dst_seg.mapping().unwrap().read(0, &mut got).unwrap();
                        assert!(got == want, "{name}: a queued copy with lent operands");
                    }
                }
            });
        }
    });
}

/// A chain of kernel-engine copies (queued behind a gate, so the executor sends them to the
/// ring as one linked chain) with a failing copy in the middle: the copies before it land, the
/// failure fails the queue with the kernel's reason, and the copies after it in the chain do
/// not run (their destinations keep their bytes).
#[test]
fn a_failure_in_a_chain_of_kernel_copies_stops_the_copies_after_it() {
    let q = Queue::builder().engine(CopyEngine::Kernel).build().unwrap();
    let (before, after) = (seg(8192), seg(8192));
    let bad = unwritable_by_the_kernel(8192);
    let host = HostBuffer::from_slice(&[0xcd; 8192]).unwrap();
    let gate = QueueGate::close(&q);
    q.copy(&before, &host).unwrap();
    q.copy(&bad, &host).unwrap();
    q.copy(&after, &host).unwrap();
    gate.open();
    let err = q.synchronize().unwrap_err();
    assert!(err.to_string().contains("Operation not permitted"), "{err}");
    let out = HostBuffer::new(8192).unwrap();
    copy_now(&out, &before).unwrap();
    assert!(out.to_vec().iter().all(|&b| b == 0xcd), "the copy before the failure did not land");
    copy_now(&out, &after).unwrap();
    assert!(out.to_vec().iter().all(|&b| b == 0), "a copy after the failure ran");
}
