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

use crate::sync::{AtomicPtr, AtomicUsize, Ordering, UnsafeCell};

/// A node carrying one freed item.
#[derive(Debug)]
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
    /// `scratch` is reused storage for reversing a chain of more than one node.
    #[inline]
    pub fn drain_oldest_first(&self, scratch: &mut Vec<Box<Node<T>>>, mut f: impl FnMut(Box<Node<T>>)) {
        let mut drained = self.take_all();
        let Some(first) = drained.next() else { return };
        if drained.is_done() {
            // One node (the common case): nothing to reorder.
            f(first);
            return;
        }
        scratch.push(first);
        scratch.extend(drained);
        while let Some(n) = scratch.pop() {
            f(n);
        }
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

/// The count of deferred frees: requested (their request pushed) but not completed (their
/// completion not yet pushed). Whoever sees it at zero and then takes from the list gets every
/// completion pushed before it dropped to zero.
#[derive(Debug)]
pub struct Pending(AtomicUsize);

impl Default for Pending {
    fn default() -> Self {
        Self::new()
    }
}

impl Pending {
    /// None pending.
    pub fn new() -> Self {
        Self(AtomicUsize::new(0))
    }

    /// Counts a deferred free; call before pushing its request, so no one sees the request
    /// without the count.
    pub fn begin(&self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }

    /// Uncounts a deferred free; call after pushing its completion. Release: the push
    /// happens-before whatever sees the count drop.
    pub fn end(&self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }

    /// True when no deferred free is outstanding. Acquire: pairs with `end`, so a take that
    /// follows sees every completion pushed before the count dropped.
    pub fn is_zero(&self) -> bool {
        self.0.load(Ordering::Acquire) == 0
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

    #[test]
    fn everything_pushed_is_taken_once() {
        let list = Arc::new(FreeList::new());
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let l = list.clone();
                std::thread::spawn(move || {
                    for i in 0..10_000u32 {
                        l.push(Node::new(t * 10_000 + i));
                    }
                })
            })
            .collect();
        let mut seen = Vec::new();
        while seen.len() < 40_000 {
            seen.extend(list.take_all().map(|n| n.value));
        }
        for t in threads {
            t.join().unwrap();
        }
        seen.extend(list.take_all().map(|n| n.value));
        seen.sort_unstable();
        assert_eq!(seen, (0..40_000).collect::<Vec<_>>());
    }
}
