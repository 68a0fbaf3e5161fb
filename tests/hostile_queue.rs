//! From the hostile review of issue 9: queues under a careless safe-Rust caller.

use std::sync::Arc;
use std::time::Duration;

use dmabuf_rt::queue::{HostBuffer, Queue};

/// The tests run one at a time: one counts the process's fds.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// A callback that captures an `Arc<Queue>` of its own queue (to submit follow-up work, a
/// common pattern) may end up holding the last reference: the queue is then dropped on its
/// own executor thread. `Queue::drop` used to join that thread (a self-join, which panicked
/// inside the callback, failed the queue and skipped the work submitted after it). Now it
/// lets the executor drain and exit on its own: the copy submitted before the drop runs.
#[test]
fn the_last_arc_of_a_queue_dropped_in_its_own_callback_loses_no_work() {
    let _serial = serial();
    let q = Arc::new(Queue::new().unwrap());
    let q2 = Arc::clone(&q);
    let (open, gate) = std::sync::mpsc::channel::<()>();
    q.callback(move |_| {
        let _ = gate.recv(); // held until the test has dropped its own Arc
        let _keep = &q2; // the closure owns the last Arc; dropped when the call ends
    })
    .unwrap();
    let src = HostBuffer::from_slice(&[7u8; 4096]).unwrap();
    let dst = HostBuffer::new(4096).unwrap();
    q.copy(&dst, &src).unwrap(); // submitted after the callback
    drop(q);
    open.send(()).unwrap();
    // The executor finishes on its own: wait (bounded) for the copy's bytes.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while dst.to_vec()[4095] != 7 && std::time::Instant::now() < deadline {
        std::thread::yield_now();
    }
    let v = dst.to_vec();
    assert!(v.iter().all(|&b| b == 7), "the copy submitted before the queue was dropped never ran (dst[0] = {})", v[0]);
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// A dropped queue's segments go when it exits (its exit hook applies the free when the
/// allocator's lock is free), not only at the allocator's next call.
#[test]
fn a_dropped_queues_memory_goes_without_another_allocator_call() {
    let _serial = serial();
    use dmabuf_rt::caching::stats::AGGREGATE;
    use dmabuf_rt::caching::{CachingAllocator, Config};
    use dmabuf_rt::source::ShmemSource;
    let a = CachingAllocator::builder(ShmemSource::new().reserve(false))
        .config(Config::parse("").unwrap())
        .capacity(1 << 30)
        .build()
        .unwrap();
    drop(Queue::new().unwrap());
    let before = open_fds();
    let qs: Vec<Queue> = (0..20).map(|_| Queue::new().unwrap()).collect();
    for q in &qs {
        drop(a.allocate(4096, Some(q)).unwrap());
    }
    drop(qs); // each drop joins its executor, which ran the exit hooks
    let lazy = open_fds();
    let segs = a.stats().segment[AGGREGATE].current; // takes the lock: drains
    let after = open_fds();
    eprintln!(
        "fds: before {before}, after dropping the queues {lazy}, after one stats() call {after}; segments {segs}"
    );
    assert!(
        lazy <= before + 1,
        "dropped queues' memfds still open until the next allocator call: {before} -> {lazy} (-> {after} after stats())"
    );
}

/// Events made from pollable fds and dropped before the fd becomes readable used to stay
/// watched forever by the process-wide fence watcher, keeping two fds each. The watcher now
/// stops watching an event nobody holds whenever it wakes (each new watch wakes it).
#[test]
fn dropped_fd_events_stop_being_watched() {
    let _serial = serial();
    use dmabuf_rt::queue::Event;
    use rustix::event::{EventfdFlags, eventfd};
    // Start the watcher (its own ring and wake-up fd stay).
    drop(Event::from_readable_fd(eventfd(0, EventfdFlags::CLOEXEC).unwrap()).unwrap());
    let before = open_fds();
    for _ in 0..100 {
        drop(Event::from_readable_fd(eventfd(0, EventfdFlags::CLOEXEC).unwrap()).unwrap());
    }
    // One held event: it must stay watched and still complete.
    let fd = eventfd(0, EventfdFlags::CLOEXEC).unwrap();
    let signal = fd.try_clone().unwrap();
    let held = Event::from_readable_fd(fd).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while open_fds() > before + 4 && std::time::Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert!(open_fds() <= before + 4, "100 dropped events: open fds {before} -> {}", open_fds());
    rustix::io::write(&signal, &1u64.to_ne_bytes()).unwrap();
    held.synchronize(Some(Duration::from_secs(20))).unwrap();
}
