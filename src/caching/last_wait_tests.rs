//! The OOM ladder's last wait end to end, with queues held by gates and a pause point where
//! the request has made its claim (`pool/claims.rs`): orders that threads and queues cannot
//! be made to take reliably from outside the crate.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::caching::{CachingAllocator, Config};
use crate::queue::Queue;
use crate::source::ShmemSource;

const MB: usize = 1 << 20;
/// How long a step may take before the test calls it a hang (the allocator's own wait limit
/// is an hour: no wait of it may run out here).
const HANG: Duration = Duration::from_secs(300);

thread_local! {
    /// Run once, on this thread, right after its request claims its room (then cleared).
    static AFTER_CLAIM: RefCell<Option<Box<dyn FnOnce()>>> = const { RefCell::new(None) };
}

/// Called by the last wait, with the lock held, once the request's claim is made.
pub(super) fn after_claim() {
    if let Some(f) = AFTER_CLAIM.with(|h| h.borrow_mut().take()) {
        f();
    }
}

/// Work on a queue held until the gate is dropped.
struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    fn close(q: &Queue) -> Gate {
        let open = Arc::new((Mutex::new(false), Condvar::new()));
        let shared = Arc::clone(&open);
        q.callback(move |_| {
            let (opened, cv) = &*shared;
            let mut g = opened.lock().unwrap_or_else(|e| e.into_inner());
            while !*g {
                g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        })
        .unwrap();
        Gate(open)
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        let (opened, cv) = &*self.0;
        *opened.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
    }
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !done() {
        assert!(t0.elapsed() < HANG, "waited 5 minutes for {what}");
        std::thread::yield_now();
    }
}

/// A request claims its room and waits for a 40 MiB deferred free; when it completes, a host
/// callback (never kept out) takes 30 MiB of it and frees that on a gated queue of its own,
/// which pins the classic segment the request needs. The request's final attempt after its
/// claim's wait fails, so it waits once more keeping everyone else out, for that free too, and
/// gets its 40 MiB when the gate opens. (Before the exclusive wait, it failed here with an
/// out-of-memory error naming 30 MiB of deferred frees outstanding: `tests/hostile_review24.rs`'s
/// large-fill race on a fresh CI machine.)
#[test]
fn a_claim_whose_memory_went_to_a_newer_deferred_free_waits_keeping_others_out() {
    let a = CachingAllocator::builder(ShmemSource::new().reserve(false))
        .config(Config::parse("expandable_segments:False").unwrap())
        .capacity(64 * MB as u64)
        .pending_wait_limit(Duration::from_secs(3600))
        .build()
        .unwrap();
    // A small deferred free behind gate 1: what the request's first wait waits for.
    let q1 = Queue::new().unwrap();
    let gate1 = Gate::close(&q1);
    let mut small = a.allocate(4096, None).unwrap();
    small.record_queue(&q1);
    drop(small);
    // 40 MiB in use on queue 2, behind gate 2.
    let q2 = Queue::new().unwrap();
    let gate2 = Gate::close(&q2);
    let mut big = a.allocate(40 * MB, None).unwrap();
    big.record_queue(&q2);

    let (claimed_tx, claimed_rx) = mpsc::channel();
    let retries = a.stats().num_alloc_retries;
    let waiter = {
        let a = a.clone();
        std::thread::spawn(move || {
            AFTER_CLAIM.with(|h| *h.borrow_mut() = Some(Box::new(move || claimed_tx.send(()).unwrap())));
            a.allocate(40 * MB, None).map(drop)
        })
    };
    // Its first wait has begun (the retry is counted just before it).
    wait_until("the request's first wait", || a.stats().num_alloc_retries > retries);
    // Now the frees the claim will wait for: the 40 MiB, then (behind the callback) 4 KiB.
    drop(big);
    let q3 = Arc::new(Queue::new().unwrap());
    let gate3 = Gate::close(&q3);
    let (taken_tx, taken_rx) = mpsc::channel();
    {
        let (a, q3) = (a.clone(), Arc::clone(&q3));
        q2.callback(move |_| {
            let r = a.allocate(30 * MB, None).map(|mut b| {
                b.record_queue(&q3);
            });
            taken_tx.send(r).unwrap();
        })
        .unwrap();
    }
    let mut last = a.allocate(4096, None).unwrap();
    last.record_queue(&q2);
    drop(last);
    // The first wait ends; the request goes to its last wait and claims.
    drop(gate1);
    claimed_rx.recv_timeout(HANG).expect("the request's claim");
    // The 40 MiB comes back, and the callback takes 30 MiB of it before the request's claim
    // has waited for everything.
    drop(gate2);
    taken_rx
        .recv_timeout(HANG)
        .expect("the callback's allocation")
        .expect("the callback's 30 MiB (a host callback is never kept out)");
    wait_until("the exclusive wait", || a.stats().num_exclusive_waits == 1 || waiter.is_finished());
    if waiter.is_finished() {
        panic!("the request ended before the callback's free came back: {:?}", waiter.join().unwrap());
    }
    // Kept out now, however small the request: it returns only after gate 3 opened. (The
    // request is made after the thread says so, and before or after the gate opens; made
    // before, a request let through would be seen.)
    let opened3 = Arc::new(AtomicBool::new(false));
    let (asking_tx, asking_rx) = mpsc::channel();
    let kept_out = {
        let (a, opened3) = (a.clone(), Arc::clone(&opened3));
        std::thread::spawn(move || {
            asking_tx.send(()).unwrap();
            let r = a.allocate(4096, None).map(drop);
            (r, opened3.load(Ordering::Acquire))
        })
    };
    asking_rx.recv_timeout(HANG).unwrap();
    for _ in 0..1000 {
        std::thread::yield_now();
    }
    opened3.store(true, Ordering::Release);
    drop(gate3);
    waiter.join().unwrap().expect("40 MiB of 64, with every deferred free completed");
    let (r, after) = kept_out.join().unwrap();
    r.expect("4 KiB once the exclusive wait is over");
    assert!(after, "an allocation went through during the exclusive wait");
    let st = a.stats();
    assert_eq!((st.num_exclusive_waits, st.num_ooms), (1, 0));
    q3.synchronize().unwrap();
    a.check_invariants().unwrap();
}
