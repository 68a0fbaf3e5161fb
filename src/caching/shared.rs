//! What every handle of one caching allocator shares (the [`CachingAllocator`](super::CachingAllocator)
//! clones and each [`Allocation`](super::Allocation)): the pool under its lock, the lock-free
//! lists (frees and dropped records), and the count of deferred frees; how a deferred free
//! completes (markers on the queues that used the block, whose passage feeds the free list);
//! and the strong counts the records hold (`record.rs`), the unsafe code of which is here.

#![allow(unsafe_code)]

use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::block::{BlockId, FreeMsg};
use super::free_list::{FreeList, Node, Pending};
use super::pool::Pool;
use super::pool_lock::PoolLock;
use super::record::{Body, Record};
use crate::queue::{MarkerPayload, MarkerSink, QueueHandle};

pub(crate) struct AllocatorShared {
    pub(crate) pool: PoolLock<Pool>,
    /// [`CachingAllocator`](super::CachingAllocator) handles alive: while there are any, the
    /// pool keeps the records of dropped `Allocation`s, with their counts, for the next ones
    /// (`record.rs`).
    pub(crate) handles: AtomicUsize,
    pub(crate) frees: FreeList<FreeMsg>,
    /// Records of `Allocation`s dropped when their free could not be applied at once (no
    /// count: see `record.rs`), applied by the next holder of the lock ([`drain`]).
    pub(crate) dropped: FreeList<Body>,
    /// Deferred frees whose events have not all completed.
    pub(crate) pending: Pending,
    /// The process that made the allocator: a handle dropped in another (a forked child) does
    /// not wait for the pool's lock, which a thread the child does not have may hold.
    pub(crate) pid: rustix::process::Pid,
    /// How long the OOM ladder and `empty_cache` wait for them.
    pub(crate) pending_limit: std::time::Duration,
    /// Bumped when a request's claim goes (`pool/claims.rs`): the requests it kept out look
    /// again.
    pub(crate) claims_changed: AtomicUsize,
}

/// Whether [`CachingAllocator`](super::CachingAllocator) handles remain, read under the
/// pool's lock by whoever would keep a record as a spare (`Spares::put`). The last handle's
/// `fetch_sub` comes before it takes the lock to close the spares: a drop that reads the old
/// count under the lock kept its record before that close, which takes it out.
#[inline(always)]
pub(crate) fn handles_alive(inner: &AllocatorShared) -> bool {
    inner.handles.load(Ordering::Relaxed) != 0
}

/// Nothing is waiting on either lock-free list (a hint, as [`FreeList::is_empty`]).
#[inline(always)]
pub(crate) fn nothing_pushed(inner: &AllocatorShared) -> bool {
    inner.frees.is_empty() && inner.dropped.is_empty()
}

/// A new record (`fields`, whose `inner` is replaced) holding a new strong count of `inner`.
#[inline(never)]
pub(crate) fn new_record(inner: &Arc<AllocatorShared>, fields: Body) -> Record {
    let counted = Arc::into_raw(Arc::clone(inner));
    let inner = NonNull::new(counted.cast_mut()).expect("an Arc's pointer is not null").cast::<()>();
    Node::new(Body { inner, ..fields })
}

/// The shared state a record points at. Every record that exists points at a live one: an
/// `Allocation`'s and a spare hold a count of it, and one on the dropped list lies inside it
/// (its drop frees the list's records). The caller must not use the reference after letting
/// go of the count that keeps it alive.
#[inline(always)]
pub(crate) fn of(body: &Body) -> &AllocatorShared {
    // SAFETY: as above: the pointer came from `Arc::into_raw` and the state is alive while the
    // record exists.
    unsafe { body.inner.cast::<AllocatorShared>().as_ref() }
}

/// The `Arc` a record counts, borrowed (no count is made or let go).
pub(crate) fn arc_of(body: &Body) -> ManuallyDrop<Arc<AllocatorShared>> {
    // SAFETY: as in `of`; wrapped in `ManuallyDrop`, so the count the record holds is not let
    // go by this view.
    ManuallyDrop::new(unsafe { Arc::from_raw(body.inner.cast::<AllocatorShared>().as_ptr()) })
}

/// Lets go the strong count `inner` (a record's, taken out of it) once: after the pool's lock
/// is released, since it may be the last.
pub(crate) fn let_go_count(inner: NonNull<()>) {
    // SAFETY: the caller held this count (made by `new_record` or `drain`'s recount) and
    // lets it go once.
    unsafe { drop(Arc::from_raw(inner.cast::<AllocatorShared>().as_ptr())) };
}

/// Lets go each record and the count it holds (spares given back: [`Spares::put`] or
/// [`Spares::close`]), after the pool's lock is released.
///
/// [`Spares::put`]: super::record::Spares::put
/// [`Spares::close`]: super::record::Spares::close
#[inline(never)]
pub(crate) fn let_go(records: impl IntoIterator<Item = Record>) {
    for rec in records {
        let inner = rec.value.inner;
        drop(rec);
        let_go_count(inner);
    }
}

/// Applies everything pushed onto the lock-free lists, under the pool's lock: the records of
/// dropped `Allocation`s (oldest first; each kept as a spare, counted again, where there is
/// room) and the free list.
#[inline]
pub(crate) fn drain(inner: &AllocatorShared, pool: &mut Pool) {
    if !inner.dropped.is_empty() {
        drain_dropped(inner, pool);
    }
    if !inner.frees.is_empty() {
        pool.drain(&inner.frees);
    }
}

#[inline(never)]
fn drain_dropped(inner: &AllocatorShared, pool: &mut Pool) {
    let alive = handles_alive(inner);
    inner.dropped.drain_oldest_first(|rec| {
        pool.free_pushed(rec.value.id);
        if pool.spares.has_room(alive) {
            // SAFETY: the caller reached the lock through a count of its own, so the state is
            // alive and its count above zero; the spare holds this new one.
            unsafe { Arc::increment_strong_count(rec.value.inner.cast::<AllocatorShared>().as_ptr()) };
            let kept = pool.spares.put(rec, alive);
            debug_assert!(kept.is_ok(), "there was room");
        }
    });
}

/// Places the markers of block `id`'s deferred free: one on each queue of `uses`, carrying
/// its node with `FreeMsg::Passed(id)`. The caller has counted the waits
/// ([`Pending::begin_n`], one per queue) and made `FreeMsg::Requested(id, n)` visible
/// (pushed, or applied under the pool's lock) first, and dropped the queues that had already
/// passed ([`QueueHandle::has_passed`]); one that passed since gets its `Passed` pushed at
/// once. Each marker's passage pushes its node onto the lock-free list
/// ([`AllocatorShared::passed`]): no event, no closure, no allocation.
pub(crate) fn mark_all(
    inner: &Arc<AllocatorShared>,
    id: BlockId,
    uses: impl IntoIterator<Item = (QueueHandle, Box<Node<FreeMsg>>)>,
) {
    let sink: Arc<dyn MarkerSink> = Arc::clone(inner) as Arc<dyn MarkerSink>;
    for (q, mut node) in uses {
        node.value = FreeMsg::Passed(id);
        if let Err(payload) = q.mark(&sink, node) {
            sink.passed(payload);
        }
    }
}

impl MarkerSink for AllocatorShared {
    /// A deferred free's marker passed: its node (carrying `FreeMsg::Passed`) goes onto the
    /// lock-free list, then the wait is uncounted.
    fn passed(&self, payload: MarkerPayload) {
        match payload.downcast::<Node<FreeMsg>>() {
            Ok(node) => {
                self.frees.push(node);
                self.pending.end();
            }
            // Only free-list nodes are ever placed by this allocator.
            Err(_) => log::error!("a caching allocator's marker carried something other than its free-list node"),
        }
    }
}
