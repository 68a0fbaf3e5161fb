//! What every handle of one caching allocator shares (the [`CachingAllocator`](super::CachingAllocator)
//! clones and each [`Allocation`](super::Allocation)): the pool under its lock, the lock-free
//! free list, and the count of deferred frees; and how a deferred free completes (markers on
//! the queues that used the block, whose passage feeds the free list).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::block::{BlockId, FreeMsg};
use super::free_list::{FreeList, Node, Pending};
use super::pool::Pool;
use super::pool_lock::PoolLock;
use crate::queue::{MarkerPayload, MarkerSink, QueueHandle};

pub(crate) struct AllocatorShared {
    pub(crate) pool: PoolLock<Pool>,
    /// [`CachingAllocator`](super::CachingAllocator) handles alive: while there are any, the
    /// pool keeps the strong counts of dropped `Allocation`s for the next ones (`ref_stash`).
    pub(crate) handles: AtomicUsize,
    pub(crate) frees: FreeList<FreeMsg>,
    /// Deferred frees whose events have not all completed.
    pub(crate) pending: Pending,
    /// How long the OOM ladder and `empty_cache` wait for them.
    pub(crate) pending_limit: std::time::Duration,
}

/// Whether [`CachingAllocator`](super::CachingAllocator) handles remain, read under the
/// pool's lock by a drop that would stash its count (`RefStash::put`). The last handle's
/// `fetch_sub` comes before it takes the lock to close the stash: a drop that reads the old
/// count under the lock has stashed before that close and is emptied by it.
#[inline(always)]
pub(crate) fn handles_alive(inner: &AllocatorShared) -> bool {
    inner.handles.load(Ordering::Relaxed) != 0
}

/// A deferred free's queues: each other queue the block was used on, with the free-list node
/// that carries its passage back (made when the use was recorded, so the free allocates
/// nothing).
pub(crate) type Uses = Vec<(QueueHandle, Box<Node<FreeMsg>>)>;

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
