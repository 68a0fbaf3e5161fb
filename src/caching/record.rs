//! What an [`Allocation`](super::Allocation) is: a pointer to its record, a free-list node
//! ([`Record`]) that holds the block's id, segment, offset and size, the queues it was used on,
//! and a strong count of the allocator's shared state (`Arc<AllocatorShared>`, `shared.rs`).
//! The `Allocation` is then one word: returned in a `Result` and moved out of it, a larger one
//! was written field by field and read back sixteen bytes at a time, which defeats store
//! forwarding (6.5 ns of a 28 ns alloc+free pair, measured).
//!
//! Records are kept for reuse under the pool's lock ([`Spares`]), each still holding its
//! strong count: a dropped `Allocation` whose free is applied under the lock leaves its record
//! there, and the next `Allocation` takes it, so an alloc+free pair makes no `Arc` count change
//! (two atomic read-modify-writes) and no heap allocation. A free that cannot be applied then
//! pushes the record itself onto the shared state's list of dropped records, where the next
//! holder of the lock applies it: no node is allocated for it.
//!
//! The counts the spares hold keep the shared state alive (a cycle). The last
//! [`CachingAllocator`](super::CachingAllocator) handle breaks it: no `Allocation` can be made
//! after it, so it takes every spare out ([`Spares::close`]) and lets their counts go; from then
//! on a record is not kept. Where that handle is dropped by the thread holding the pool's lock
//! (a memory source's callback), the next `Allocation` dropped under the lock closes them.
//! A record travelling the dropped list holds no count (its `Allocation` let it go after the
//! push): the list is the shared state's, and a holder of the lock that keeps the record as a
//! spare counts it again.
//!
//! This file holds the types and the spares' arithmetic; the counting (unsafe) is in
//! `shared.rs`.

#![allow(unsafe_code)]

use std::ptr::NonNull;

use super::block::{BlockId, FreeMsg, SegRef};
use super::free_list::{Node, NodeStack};
use crate::queue::{QueueHandle, QueueId};

/// A block's uses on other queues, for its deferred free: each queue, with the free-list node
/// that carries its passage back, and the node the free's request travels in. All made when
/// the uses are recorded, so that the free allocates nothing (it may run where the heap is
/// exhausted).
pub(crate) struct Uses {
    pub(crate) request: Box<Node<FreeMsg>>,
    pub(crate) queues: Vec<(QueueHandle, Box<Node<FreeMsg>>)>,
}

/// What an `Allocation` points at (see the module docs).
pub(crate) type Record = Box<Node<Body>>;

/// A record's contents (the record, with its list link, is one cache line: see [`Node`]).
pub(crate) struct Body {
    /// `Arc::<AllocatorShared>::into_raw`, as an untyped pointer (this file sits below the
    /// shared state's definition): a strong count while the record is an `Allocation`'s or a
    /// spare, none on the dropped list.
    pub(crate) inner: NonNull<()>,
    pub(crate) id: BlockId,
    /// Valid while the record is an `Allocation`'s: the block is allocated, so the pool holds
    /// the segment.
    pub(crate) seg: SegRef,
    pub(crate) offset: usize,
    pub(crate) size: usize,
    /// The queue the block is bound to.
    pub(crate) queue: Option<QueueId>,
    /// Other queues that used the block; boxed, so that a block used on its own queue only
    /// (the usual case) pays one word for it.
    pub(crate) uses: Option<Box<Uses>>,
}

// SAFETY: `inner` points at the allocator's shared state, which is `Send + Sync` (it is shared
// through an `Arc` by every handle); the other fields are `Send`. A record moves between
// threads whole (with its `Allocation`, or through the lock-free list).
unsafe impl Send for Body {}

// One cache line (loom's cells, in its models, are larger).
#[cfg(not(loom))]
const _: () = assert!(size_of::<Node<Body>>() == 64);

/// The most records kept for reuse (64 bytes each): a burst of more frees than this
/// lets the rest go.
pub(crate) const SPARES_MAX: usize = 16_384;

/// Records kept for reuse, each with its strong count (see the module docs).
#[derive(Default)]
pub(crate) struct Spares {
    /// Linked through the records' own list links: keeping and taking one never allocates.
    list: NodeStack<Body>,
}

impl std::fmt::Debug for Spares {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spares").field("len", &self.list.len()).finish()
    }
}

impl Spares {
    /// A record for a new `Allocation`, with its count; `None` if there is none (the caller
    /// makes one).
    #[inline(always)]
    pub(crate) fn take(&mut self) -> Option<Record> {
        self.list.pop()
    }

    /// Whether a record given back now is kept (room, and handles left to use it).
    #[inline(always)]
    pub(crate) fn has_room(&self, handles_alive: bool) -> bool {
        handles_alive && self.list.len() < SPARES_MAX
    }

    /// Keeps `rec` (with its count) if [`Spares::has_room`]; otherwise gives it back, with
    /// every spare if no handle is left: the caller lets their counts go once the lock is
    /// released.
    #[inline(always)]
    pub(crate) fn put(&mut self, rec: Record, handles_alive: bool) -> Result<(), (Record, NodeStack<Body>)> {
        if self.has_room(handles_alive) {
            self.list.push(rec);
            return Ok(());
        }
        Err((rec, if handles_alive { NodeStack::default() } else { self.close() }))
    }

    /// Takes every spare out: the caller lets their counts go once the lock is released.
    pub(crate) fn close(&mut self) -> NodeStack<Body> {
        self.list.take_all()
    }

    /// Records kept now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.list.len()
    }
}
