//! [`Allocation`], the RAII block of the caching allocator, and the one piece of unsafe code
//! it needs: a segment reference without a reference count.
//!
//! An allocated block's segment cannot go away: the pool returns a segment to its source only
//! when it is one free, unsplit block, and a block stops being allocated only when its owner
//! lets go. So an [`Allocation`], which also keeps the allocator (and so the pool) alive, can
//! point at its segment without touching the segment's `Arc` count: two atomic operations
//! fewer per allocation and free, a fifth of the hot path's time.

#![allow(unsafe_code)]

use std::mem::ManuallyDrop;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use super::free_list::Node;
use super::pool::BlockId;
use super::{AllocatorShared, FreeMsg};
use crate::error::Result;
use crate::queue::{Mem, Queue, QueueHandle, QueueId};
use crate::segment::{Access, Segment};
use crate::view::CpuView;

/// Memory from a [`CachingAllocator`](super::CachingAllocator). Dropping it frees it
/// (lock-free); if it was used on other queues, the memory returns to the pool only after those
/// queues finish with it.
pub struct Allocation {
    pub(super) inner: Arc<AllocatorShared>,
    /// The free-list node the free travels in; taken by `Drop` (the block is freed then).
    pub(super) node: Option<Box<Node<FreeMsg>>>,
    pub(super) id: BlockId,
    /// Valid while `node` is present: the block is allocated, so the pool holds the segment.
    pub(super) seg: SegRef,
    pub(super) offset: usize,
    pub(super) size: usize,
    /// The queue the block is bound to.
    pub(super) queue: Option<QueueId>,
    /// Other queues that used the block. Not dropped by the drop glue: `Drop` takes it when
    /// it is not empty, so the usual free pays nothing for it.
    pub(super) uses: ManuallyDrop<Vec<QueueHandle>>,
}

impl std::fmt::Debug for Allocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocation").field("size", &self.size).field("offset", &self.offset).finish()
    }
}

impl Allocation {
    /// The size asked for.
    pub fn len(&self) -> usize {
        self.size
    }

    /// Always false (zero-sized requests are refused).
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    fn seg(&self) -> &Segment {
        // SAFETY: `&self` proves the allocation is live, so its block is allocated (only `Drop`
        // frees it) and the pool, kept alive by `self.inner`, holds the segment's `Arc`.
        unsafe { self.seg.get() }
    }

    /// CPU access to the block: a [`CpuView`] of exactly the bytes asked for (its neighbours in
    /// the segment are out of reach), inside the dma-buf sync bracket if the segment is one.
    pub fn cpu_access(&self, access: Access) -> Result<CpuView<'_>> {
        CpuView::new(self.seg(), self.offset, self.size, access)
    }

    /// Where the block starts in its fd ([`AsFd::as_fd`]): with [`Allocation::len`], the range
    /// to name when the block is shared.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// A new fd for the buffer the block lies in (`dup`): the whole segment, of which the block
    /// is `[offset(), offset() + len())`.
    pub fn try_clone_fd(&self) -> Result<OwnedFd> {
        self.seg().try_clone_fd()
    }

    /// Whether the block's fd is a dma-buf (otherwise a memfd).
    pub fn is_dma_buf(&self) -> bool {
        self.seg().is_dma_buf()
    }

    /// The block as a queue range (it keeps the segment alive for the operations using it).
    pub fn mem(&self) -> Mem {
        // SAFETY: as in `seg`: the block is allocated, so the pool holds the segment's `Arc`.
        let seg = unsafe { self.seg.to_arc() };
        Mem::from(&seg).range(self.offset, self.size).expect("blocks lie inside their segment")
    }

    /// The CPU address of the block (segments are always mapped), for code that follows the
    /// crate's shared-memory access rule.
    pub fn as_ptr(&self) -> *mut u8 {
        self.seg().mapping().map_or(std::ptr::null_mut(), |m| m.as_ptr().wrapping_add(self.offset))
    }

    /// The queue the block is bound to (`None`: allocated for host-side use, on no queue).
    pub fn queue(&self) -> Option<QueueId> {
        self.queue
    }

    /// Records that `queue` uses this memory: when it is freed, the block waits for the work
    /// submitted to `queue` until then before anyone can reuse it (PyTorch's `recordStream`).
    #[doc(alias = "record_stream")]
    pub fn record_queue(&mut self, queue: &Queue) {
        if Some(queue.id()) != self.queue && !self.uses.iter().any(|h| h.id() == queue.id()) {
            self.uses.push(queue.handle());
        }
    }
}

impl AsFd for Allocation {
    /// The fd of the segment the block lies in, at [`Allocation::offset`].
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.seg().as_fd()
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // From the push on, the block may be reused or its segment released: `self.seg` must
        // not be used after it.
        let Some(mut node) = self.node.take() else { return };
        if self.uses.is_empty() {
            node.value = FreeMsg::Free(self.id);
            self.inner.frees.push(node);
            return;
        }
        // Counted before it is published, so no one sees the request without the count.
        self.inner.pending.begin();
        node.value = FreeMsg::Requested(self.id);
        self.inner.frees.push(node);
        // Taken out of the ManuallyDrop, so it is dropped after the loop.
        super::complete_after(&self.inner, self.id, std::mem::take(&mut *self.uses));
    }
}

/// Points at a segment held in an `Arc` by the pool.
pub(crate) struct SegRef(NonNull<Segment>);

// SAFETY: a SegRef is a shared reference in disguise (it only ever gives out `&Segment` and new
// `Arc`s), and `Segment` is `Send + Sync`.
unsafe impl Send for SegRef {}
// SAFETY: as above.
unsafe impl Sync for SegRef {}

const _: () = {
    const fn shareable<T: Send + Sync>() {}
    shareable::<Segment>();
};

impl SegRef {
    /// Points at `seg`'s segment.
    pub(crate) fn new(seg: &Arc<Segment>) -> Self {
        // `Arc::as_ptr`, not `&**seg`: the pointer must carry the provenance of the whole `Arc`
        // allocation for `to_arc` to reach its counts.
        Self(NonNull::new(Arc::as_ptr(seg).cast_mut()).expect("an Arc's pointer is not null"))
    }

    /// The segment.
    ///
    /// # Safety
    /// The `Arc` this was made from (or a clone of it) must still be alive, and stay alive for
    /// the returned lifetime: for an allocation, the block must not have been freed.
    pub(crate) unsafe fn get(&self) -> &Segment {
        // SAFETY: the caller guarantees an `Arc` keeps the segment alive for the lifetime of
        // `&self`; the pointer came from that `Arc`'s contents.
        unsafe { self.0.as_ref() }
    }

    /// A new counted reference to the segment (for queue operations, which must keep it alive
    /// on their own).
    ///
    /// # Safety
    /// As for [`SegRef::get`].
    pub(crate) unsafe fn to_arc(&self) -> Arc<Segment> {
        let ptr = self.0.as_ptr().cast_const();
        // SAFETY: `ptr` is `Arc::as_ptr` of a live `Arc<Segment>` (caller's guarantee; a
        // pointer from `as_ptr` is what `into_raw` returns), so adding a strong count and then
        // adopting it with `from_raw` is sound.
        unsafe { Arc::increment_strong_count(ptr) };
        // SAFETY: as above: this adopts the count just added.
        unsafe { Arc::from_raw(ptr) }
    }
}
