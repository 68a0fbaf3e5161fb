//! Markers: the lightest way to learn that a queue has passed a point. A marker is placed at
//! the queue's current end ([`QueueHandle::mark`](super::QueueHandle::mark)) and *passes* once
//! every operation submitted before it has finished (run, skipped after a failure, or
//! cancelled). Passing hands its payload to its sink on the thread that finished that
//! operation. No event, no record operation, no hook closure: a marker is a slot in a ring
//! buffer the queue reuses, an `Arc` clone of the sink and a payload the caller already owns
//! (the caching allocator passes a free-list node, so a deferred free allocates nothing).

use std::any::Any;
use std::collections::VecDeque;
use std::sync::Arc;

/// A marker's payload: anything the sink knows how to take back (it downcasts).
pub type MarkerPayload = Box<dyn Any + Send>;

/// Where markers go when their queue passes them.
///
/// `passed` runs on the thread that finished the operation the marker waited for (a queue's
/// executor, or a submitting thread that ran it inline), after that queue has released its
/// lock: it may call into queues, but it holds up the queue's next operation, so it must be
/// quick and must not block. The caching allocator's sink pushes onto its lock-free free list
/// and nothing else.
pub trait MarkerSink: Send + Sync {
    /// The queue passed the marker that carried `payload`.
    fn passed(&self, payload: MarkerPayload);
}

/// A marker waiting in a queue: it passes when the queue has finished operation `ticket`.
pub(super) struct Marker {
    ticket: u64,
    sink: Arc<dyn MarkerSink>,
    payload: MarkerPayload,
}

/// A queue's markers, in ticket order (tickets are handed out in submission order, and a
/// marker always takes the newest one).
#[derive(Default)]
pub(super) struct Markers {
    waiting: VecDeque<Marker>,
}

impl Markers {
    /// Places a marker that passes once operation `ticket` has finished.
    pub(super) fn push(&mut self, ticket: u64, sink: &Arc<dyn MarkerSink>, payload: MarkerPayload) {
        debug_assert!(self.waiting.back().is_none_or(|m| m.ticket <= ticket), "markers in ticket order");
        self.waiting.push_back(Marker { ticket, sink: Arc::clone(sink), payload });
    }

    /// The oldest marker waiting for an operation up to `ticket`, taken out to be passed
    /// (with [`pass`], once the queue's lock is released).
    #[inline]
    pub(super) fn pop_due(&mut self, ticket: u64) -> Option<Marker> {
        if self.waiting.front().is_some_and(|m| m.ticket <= ticket) { self.waiting.pop_front() } else { None }
    }

    /// Every marker, taken out to be passed (the queue's executor died: nothing it left will
    /// ever run).
    pub(super) fn take_all(&mut self) -> Vec<Marker> {
        self.waiting.drain(..).collect()
    }

    /// Whether any marker waits for an operation up to `ticket`.
    #[inline]
    pub(super) fn any_due(&self, ticket: u64) -> bool {
        self.waiting.front().is_some_and(|m| m.ticket <= ticket)
    }

    /// How many markers wait.
    pub(super) fn len(&self) -> usize {
        self.waiting.len()
    }
}

/// Hands a marker's payload to its sink, containing a panic (a sink is library code, but a
/// queue must not die of it).
pub(super) fn pass(m: Marker) {
    let Marker { sink, payload, .. } = m;
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sink.passed(payload))).is_err() {
        log::error!("a queue marker's sink panicked");
    }
}

/// A sink that runs a closure once every one of `left` markers has passed: how
/// [`after_queues`](super::after_queues) waits for several queues with one allocation.
pub(super) struct AfterAll {
    left: std::sync::atomic::AtomicUsize,
    f: std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl AfterAll {
    pub(super) fn new(left: usize, f: Box<dyn FnOnce() + Send>) -> Arc<Self> {
        Arc::new(Self { left: std::sync::atomic::AtomicUsize::new(left), f: std::sync::Mutex::new(Some(f)) })
    }

    /// One of the markers passed (or its queue had nothing left to pass).
    pub(super) fn one_passed(&self) {
        use std::sync::atomic::Ordering;
        // AcqRel: whichever passage runs the closure sees every other queue's passage.
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            let f = self.f.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(f) = f {
                f();
            }
        }
    }
}

impl MarkerSink for AfterAll {
    fn passed(&self, _payload: MarkerPayload) {
        self.one_passed();
    }
}
