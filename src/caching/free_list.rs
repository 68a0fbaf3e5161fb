//! The lock-free free path: a multi-producer stack that the allocating side empties in one
//! swap.
//!
//! Any thread (a user dropping an allocation, a queue executor or the fence watcher running
//! a completion hook) pushes; only the holder of the allocator's lock takes, and it takes
//! everything at once with a single `swap`. Because there is no single-element pop, a pusher's
//! compare-and-swap only ever depends on the head's current value, so the ABA problem of
//! Treiber-stack pops cannot arise: a recycled node address at the head is exactly what the
//! new node's `next` must point to.

#![allow(unsafe_code)]

use std::ptr;

use crate::sync::{AtomicPtr, AtomicUsize, Condvar, Mutex, Ordering, UnsafeCell, fence};

/// A node carrying one freed item. Aligned to a cache line: the caching allocator's records are
/// nodes (64 bytes), and a free reads the record of an allocation made long ago (cold); one
/// line is one miss where a record that straddled two (the heap aligns to 16) was two.
#[derive(Debug)]
#[repr(align(64))]
pub struct Node<T> {
    next: UnsafeCell<*mut Node<T>>,
    /// The item.
    pub value: T,
}

// SAFETY: a node outside a list is owned whole by whoever holds its Box; `next` is only
// meaningful inside the list, where the list owns the node. Moving it moves the `T`.
unsafe impl<T: Send> Send for Node<T> {}

impl<T> Node<T> {
    /// A node for `value`, ready to push.
    pub fn new(value: T) -> Box<Self> {
        Box::new(Node { next: UnsafeCell::new(ptr::null_mut()), value })
    }
}

/// The stack.
#[derive(Debug)]
pub struct FreeList<T> {
    head: AtomicPtr<Node<T>>,
}

// SAFETY: nodes are handed between threads whole (ownership moves with the push and the take),
// so the list is as thread-safe as `T` is sendable.
unsafe impl<T: Send> Send for FreeList<T> {}
// SAFETY: as above; `&FreeList` only allows push (lock-free) and take (ownership of all nodes).
unsafe impl<T: Send> Sync for FreeList<T> {}

impl<T> Default for FreeList<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> FreeList<T> {
    /// An empty list.
    pub fn new() -> Self {
        Self { head: AtomicPtr::new(ptr::null_mut()) }
    }

    /// Pushes a node; never blocks, never waits for a lock.
    pub fn push(&self, node: Box<Node<T>>) {
        let node = Box::into_raw(node);
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            // SAFETY: `node` came from Box::into_raw above and is not shared until the CAS
            // below publishes it, so this is the only access.
            let cell = unsafe { &(*node).next };
            // SAFETY: as above; the pointer comes from the cell and nobody else can see it.
            cell.with_mut(|next| unsafe { *next = head });
            // Release: the node's contents (value, next) happen-before the taker's Acquire.
            match self.head.compare_exchange_weak(head, node, Ordering::Release, Ordering::Relaxed) {
                Ok(_) => return,
                Err(actual) => head = actual,
            }
        }
    }

    /// Takes every node pushed so far, most recent first.
    pub fn take_all(&self) -> Drain<T> {
        // Acquire: pairs with the pushers' Release, so every node's contents are visible.
        Drain { next: self.head.swap(ptr::null_mut(), Ordering::Acquire) }
    }

    /// Takes every node pushed so far and hands them to `f` oldest first: the order the frees
    /// were made in, which a deferred free relies on (its request before its completion).
    /// The chain is reversed in place ([`Drain::oldest_first`]): nothing is allocated.
    #[inline]
    pub fn drain_oldest_first(&self, f: impl FnMut(Box<Node<T>>)) {
        self.take_all().oldest_first().for_each(f);
    }

    /// True when nothing is waiting (a hint: a push may land right after).
    pub fn is_empty(&self) -> bool {
        self.head.load(Ordering::Relaxed).is_null()
    }
}

impl<T> Drop for FreeList<T> {
    fn drop(&mut self) {
        drop(self.take_all());
    }
}

/// The count of deferred frees' outstanding waits: counted when a free is requested (before
/// its request is pushed), uncounted as each of its completions is pushed (one per queue it
/// waits for). Whoever sees it at zero and then takes from the list gets every completion
/// pushed before it dropped to zero. A thread that must wait for the frees outstanding (the
/// OOM ladder, `empty_cache`) sleeps until an `end` wakes it: no polling.
#[derive(Debug)]
pub struct Pending {
    count: AtomicUsize,
    /// Completions uncounted so far (calls of `end`, wrapping), for the waits that start
    /// from a [`PendingMark`].
    ended: AtomicUsize,
    /// Threads in [`Pending::wait_zero`] or [`Pending::wait_outstanding`]: `end` takes the
    /// lock and notifies only when some sleep, so the usual deferred free pays a fence and an
    /// atomic load for it.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    zero: Condvar,
}

/// What [`Pending::mark`] saw: the completions counted so far and the waits outstanding.
#[derive(Debug, Clone, Copy)]
pub struct PendingMark {
    ended: usize,
    outstanding: usize,
}

impl Default for Pending {
    fn default() -> Self {
        Self::new()
    }
}

impl Pending {
    /// None pending.
    pub fn new() -> Self {
        Self {
            count: AtomicUsize::new(0),
            ended: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            zero: Condvar::new(),
        }
    }

    /// Counts a deferred free that waits for one completion; call before pushing its
    /// request, so no one sees the request without the count.
    pub fn begin(&self) {
        self.begin_n(1);
    }

    /// Counts a deferred free that waits for `n` completions.
    pub fn begin_n(&self, n: usize) {
        self.count.fetch_add(n, Ordering::AcqRel);
    }

    /// Uncounts one completion; call after pushing it. Release: the push happens-before
    /// whatever sees the count drop (or the completions counted up). Each one wakes the
    /// threads asleep in [`Pending::wait_zero`] and [`Pending::wait_outstanding`] to look
    /// again (not only the last one: a wait for the frees outstanding when it began must not
    /// sleep on while newer frees keep the count above zero).
    pub fn end(&self) {
        self.ended.fetch_add(1, Ordering::Release);
        self.count.fetch_sub(1, Ordering::AcqRel);
        // A Dekker pair with the sleepers, each side a write, a SeqCst fence, a read: either
        // the sleeper, which counts itself before it reads the counts, sees this decrement, or
        // this sees the sleeper and wakes it (under the lock the sleeper holds from its read
        // of the counts until it sleeps).
        fence(Ordering::SeqCst); // the decrement's side
        if self.sleepers.load(Ordering::Relaxed) > 0 {
            let _held = self.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.zero.notify_all();
        }
    }

    /// True when no deferred free is outstanding. Acquire: pairs with `end`, so a take that
    /// follows sees every completion pushed before the count dropped.
    pub fn is_zero(&self) -> bool {
        self.count.load(Ordering::Acquire) == 0
    }

    /// Sleeps until no deferred free is outstanding, or `limit` passes; returns whether the
    /// count reached zero.
    pub fn wait_zero(&self, limit: std::time::Duration) -> bool {
        self.sleep_until(limit, || self.is_zero())
    }

    /// Sleeps until the waits outstanding now have completed, as far as counts can tell: until
    /// none is outstanding, or as many completions as were outstanding have been counted since
    /// (a queue's completions come in order; frees requested meanwhile on another queue may
    /// complete first and count instead), or `limit` passes. Returns whether it did before the
    /// limit. Unlike [`Pending::wait_zero`], a thread that keeps requesting deferred frees
    /// cannot keep it asleep until the limit: it is the wait of the OOM ladder and
    /// `empty_cache`, which want the frees requested before they looked (as PyTorch's
    /// `synchronize_and_free_events` waits for the events outstanding then).
    pub fn wait_outstanding(&self, limit: std::time::Duration) -> bool {
        self.wait_past(self.mark(), limit)
    }

    /// The waits outstanding now, for [`Pending::wait_past`].
    pub fn mark(&self) -> PendingMark {
        let ended = self.ended.load(Ordering::Acquire);
        PendingMark { ended, outstanding: self.count.load(Ordering::Acquire) }
    }

    /// Whether a completion has been counted since `mark`.
    pub fn progressed_since(&self, mark: PendingMark) -> bool {
        self.ended.load(Ordering::Acquire) != mark.ended
    }

    /// [`Pending::wait_outstanding`] for the waits outstanding at `mark`.
    pub fn wait_past(&self, mark: PendingMark, limit: std::time::Duration) -> bool {
        self.sleep_until(limit, || self.passed(mark))
    }

    /// Whether the waits outstanding at `mark` have completed, as far as counts can tell (see
    /// [`Pending::wait_outstanding`]).
    pub fn passed(&self, mark: PendingMark) -> bool {
        self.is_zero() || self.ended.load(Ordering::Acquire).wrapping_sub(mark.ended) >= mark.outstanding
    }

    /// Sleeps until `done` holds, a completion is counted, or `limit` passes; returns `done`.
    /// For a condition that another thread makes true before it calls [`Pending::wake_all`]
    /// (an allocation waiting for a claim to go: `CachingAllocator::allocate_slow`).
    pub fn wait_for(&self, limit: std::time::Duration, done: impl Fn() -> bool) -> bool {
        let ended = self.ended.load(Ordering::Acquire);
        self.sleep_until(limit, || done() || self.ended.load(Ordering::Acquire) != ended);
        done()
    }

    /// Wakes every thread in a wait of this count, to test its condition again: call after
    /// making a [`Pending::wait_for`] condition true (a sleeper that tested it before sees the
    /// wake-up, as it tests under the lock this takes).
    pub fn wake_all(&self) {
        fence(Ordering::SeqCst);
        let _held = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.zero.notify_all();
    }

    /// Sleeps until a completion has been counted since `mark`, or none is outstanding, or
    /// `limit` passes; returns whether it did before the limit. The OOM ladder's wait: the
    /// allocation is tried again after each completion (the one it needs may be the first of
    /// many, or come while another queue's never does).
    pub fn wait_next(&self, mark: PendingMark, limit: std::time::Duration) -> bool {
        self.sleep_until(limit, || self.is_zero() || self.ended.load(Ordering::Acquire) != mark.ended)
    }

    /// Sleeps until `done` (read under the lock, after an `end` wakes it) or `limit` passes;
    /// returns `done`.
    fn sleep_until(&self, limit: std::time::Duration, done: impl Fn() -> bool) -> bool {
        if done() {
            return true;
        }
        // No deadline past what an `Instant` can hold: as good as none.
        let deadline = std::time::Instant::now().checked_add(limit);
        self.sleepers.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst); // the sleeper's side of the Dekker pair in `end`
        let mut held = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        while !done() {
            let Some(deadline) = deadline else {
                held = self.zero.wait(held).unwrap_or_else(|p| p.into_inner());
                continue;
            };
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            held = self.zero.wait_timeout(held, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        drop(held);
        self.sleepers.fetch_sub(1, Ordering::Relaxed);
        done()
    }
}

/// Nodes kept for reuse by one owner (the holder of the allocator's lock: not shared, not
/// atomic), linked through their own `next`, so that keeping and taking one is a few
/// instructions and never allocates (the caching allocator's spare records).
#[derive(Debug)]
pub(crate) struct NodeStack<T> {
    head: *mut Node<T>,
    len: usize,
}

// SAFETY: the stack owns its nodes alone (each came from a `Box` given to `push`); moving it
// moves them, which is as sendable as `T`.
unsafe impl<T: Send> Send for NodeStack<T> {}

impl<T> Default for NodeStack<T> {
    fn default() -> Self {
        Self { head: ptr::null_mut(), len: 0 }
    }
}

impl<T> NodeStack<T> {
    /// Nodes kept.
    #[inline(always)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Keeps `node`.
    #[inline(always)]
    pub(crate) fn push(&mut self, node: Box<Node<T>>) {
        let head = self.head;
        // SAFETY: the node is ours alone (a `Box`): nobody else can reach its `next`.
        node.next.with_mut(|next| unsafe { *next = head });
        self.head = Box::into_raw(node);
        self.len += 1;
    }

    /// The node kept last, if any.
    #[inline(always)]
    pub(crate) fn pop(&mut self) -> Option<Box<Node<T>>> {
        if self.head.is_null() {
            return None;
        }
        // SAFETY: every node of the chain came from `Box::into_raw` in `push` and is owned by
        // the stack alone; this one leaves it now.
        let node = unsafe { Box::from_raw(self.head) };
        // SAFETY: as above: only the stack wrote its `next`.
        self.head = node.next.with(|next| unsafe { *next });
        self.len -= 1;
        Some(node)
    }

    /// Takes every node out.
    pub(crate) fn take_all(&mut self) -> NodeStack<T> {
        std::mem::take(self)
    }
}

impl<T> Iterator for NodeStack<T> {
    type Item = Box<Node<T>>;

    fn next(&mut self) -> Option<Box<Node<T>>> {
        self.pop()
    }
}

impl<T> Drop for NodeStack<T> {
    fn drop(&mut self) {
        while self.pop().is_some() {}
    }
}

/// The nodes taken by [`FreeList::take_all`]; yields them as boxes (to reuse or drop).
#[derive(Debug)]
pub struct Drain<T> {
    next: *mut Node<T>,
}

impl<T> Drain<T> {
    /// True when no node is left.
    pub fn is_done(&self) -> bool {
        self.next.is_null()
    }

    /// The same nodes in the opposite order: oldest first, for a drain from
    /// [`FreeList::take_all`] (newest first). The chain is reversed in place.
    pub fn oldest_first(mut self) -> Drain<T> {
        let mut prev: *mut Node<T> = ptr::null_mut();
        let mut cur = std::mem::replace(&mut self.next, ptr::null_mut());
        while !cur.is_null() {
            // SAFETY: the drain owns every node of its chain alone (see `next`), each visited
            // once here; the pusher's write of `next` happened-before the swap that took it.
            let cell = unsafe { &(*cur).next };
            // SAFETY: as above: no one else can reach this node's `next`.
            let next = cell.with_mut(|n| unsafe { std::mem::replace(&mut *n, prev) });
            prev = cur;
            cur = next;
        }
        Drain { next: prev }
    }
}

impl<T> Iterator for Drain<T> {
    type Item = Box<Node<T>>;

    fn next(&mut self) -> Option<Box<Node<T>>> {
        if self.next.is_null() {
            return None;
        }
        // SAFETY: every node in the chain came from Box::into_raw in `push`, was published by
        // a Release CAS that our Acquire swap synchronised with, and is owned by this drain
        // alone (the swap detached the whole chain).
        let node = unsafe { Box::from_raw(self.next) };
        // SAFETY: as above: the pusher's write of `next` happened-before our swap.
        self.next = node.next.with(|next| unsafe { *next });
        Some(node)
    }
}

impl<T> Drop for Drain<T> {
    fn drop(&mut self) {
        for _ in self.by_ref() {}
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Pushes per thread: enough to interleave for real natively, a few under Miri (which
    /// checks every access of every interleaving it runs for races and leaks).
    const PER_THREAD: u32 = if cfg!(miri) { 50 } else { 10_000 };

    #[test]
    fn everything_pushed_is_taken_once() {
        const THREADS: u32 = 4;
        let list = Arc::new(FreeList::new());
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                let l = list.clone();
                std::thread::spawn(move || {
                    for i in 0..PER_THREAD {
                        l.push(Node::new(t * PER_THREAD + i));
                    }
                })
            })
            .collect();
        let total = (THREADS * PER_THREAD) as usize;
        let mut seen = Vec::new();
        while seen.len() < total {
            seen.extend(list.take_all().map(|n| n.value));
            std::thread::yield_now();
        }
        for t in threads {
            t.join().unwrap();
        }
        seen.extend(list.take_all().map(|n| n.value));
        seen.sort_unstable();
        assert_eq!(seen, (0..total as u32).collect::<Vec<_>>());
    }

    #[test]
    fn take_all_is_newest_first_and_drain_oldest_first_is_push_order() {
        let list = FreeList::new();
        assert!(list.is_empty());
        assert!(list.take_all().is_done());
        for i in 0..5 {
            list.push(Node::new(i));
        }
        assert!(!list.is_empty());
        assert_eq!(list.take_all().map(|n| n.value).collect::<Vec<_>>(), [4, 3, 2, 1, 0]);
        assert!(list.is_empty());
        let mut order = Vec::new();
        list.push(Node::new(7));
        list.drain_oldest_first(|n| order.push(n.value));
        assert_eq!(order, [7], "one node");
        for i in 0..5 {
            list.push(Node::new(i));
        }
        order.clear();
        list.drain_oldest_first(|n| order.push(n.value));
        assert_eq!(order, [0, 1, 2, 3, 4]);
        assert!(list.is_empty());
    }

    #[test]
    fn nodes_left_in_a_drain_or_the_list_are_freed_with_their_values() {
        // Miri reports any leak; natively the drop counter shows it.
        let drops = Arc::new(());
        let list = FreeList::new();
        for _ in 0..6 {
            list.push(Node::new(Arc::clone(&drops)));
        }
        let mut drain = list.take_all();
        let first = drain.next().expect("six nodes");
        drop(drain);
        assert_eq!(Arc::strong_count(&drops), 2, "the drain dropped the nodes it did not yield");
        list.push(first);
        list.push(Node::new(Arc::clone(&drops)));
        drop(list);
        assert_eq!(Arc::strong_count(&drops), 1, "the list dropped what it held");
    }

    #[test]
    fn wait_zero_sleeps_until_the_last_completion_or_the_limit() {
        let pending = Arc::new(Pending::new());
        assert!(pending.wait_zero(std::time::Duration::ZERO), "nothing pending: at once");
        pending.begin_n(3);
        assert!(!pending.wait_zero(std::time::Duration::from_millis(1)), "still pending at the limit");
        let p = Arc::clone(&pending);
        let ender = std::thread::spawn(move || {
            for _ in 0..3 {
                p.end();
            }
        });
        // No limit to speak of: only the last `end` can wake this (a lost wake-up hangs it).
        assert!(pending.wait_zero(std::time::Duration::from_secs(3600)));
        assert!(pending.is_zero());
        ender.join().unwrap();
    }

    #[test]
    fn a_taker_sees_every_completion_pushed_before_pending_reached_zero() {
        // The protocol of `Pending`: begin, push the request, ..., push the completion, end.
        // Whoever reads zero and then takes must find every completion.
        const FREES: u32 = if cfg!(miri) { 20 } else { 2_000 };
        let list = Arc::new(FreeList::new());
        let pending = Arc::new(Pending::new());
        assert!(pending.is_zero());
        for _ in 0..FREES {
            pending.begin();
        }
        let completer = {
            let (list, pending) = (Arc::clone(&list), Arc::clone(&pending));
            std::thread::spawn(move || {
                for i in 0..FREES {
                    list.push(Node::new(i));
                    pending.end();
                }
            })
        };
        let mut seen = Vec::new();
        loop {
            let zero = pending.is_zero();
            seen.extend(list.take_all().map(|n| n.value));
            if zero {
                break;
            }
            std::thread::yield_now();
        }
        assert_eq!(seen.len(), FREES as usize, "a completion pushed before the count hit zero was missed");
        completer.join().unwrap();
    }
}
