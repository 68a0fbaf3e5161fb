//! What every handle of one caching allocator shares (the [`CachingAllocator`](super::CachingAllocator)
//! clones and each [`Allocation`](super::Allocation)): the pool under its lock, the lock-free
//! free list, and the count of deferred frees; and how a deferred free completes.

use std::sync::{Arc, Mutex};

use super::block::{BlockId, FreeMsg};
use super::free_list::{FreeList, Node, Pending};
use super::pool::Pool;
use crate::queue::QueueHandle;

pub(crate) struct AllocatorShared {
    pub(crate) pool: Mutex<Pool>,
    pub(crate) frees: FreeList<FreeMsg>,
    /// Deferred frees whose events have not all completed.
    pub(crate) pending: Pending,
    /// How long the OOM ladder and `empty_cache` wait for them.
    pub(crate) pending_limit: std::time::Duration,
}

/// Once the work submitted so far to each of `uses` has completed, pushes the completion of
/// the deferred free of block `id` (its `Requested` message is already in the list or applied)
/// and uncounts it. The hook only pushes onto the lock-free list: it never takes the
/// allocator's lock, so this may be called with that lock held.
pub(crate) fn complete_after(inner: &Arc<AllocatorShared>, id: BlockId, uses: impl IntoIterator<Item = QueueHandle>) {
    let inner = Arc::clone(inner);
    crate::queue::after_queues(uses, move || {
        inner.frees.push(Node::new(FreeMsg::Completed(id)));
        inner.pending.end();
    });
}
