//! [`Allocation`], the RAII block of the caching allocator. It reaches its segment through a
//! [`SegRef`] (see `block.rs`: no reference count), and its strong count of the allocator's
//! shared state may come from, and go back to, the pool's stash (`ref_stash.rs`): the unsafe
//! code of both is here.

#![allow(unsafe_code)]

use std::mem::ManuallyDrop;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use super::block::{BlockId, FreeMsg, SegRef};
use super::free_list::Node;
use super::pool::Pool;
use super::shared::{self, AllocatorShared};
use crate::error::Result;
use crate::queue::{Mem, Queue, QueueId};
use crate::segment::{Access, Segment};
use crate::source::Udmabuf;
use crate::view::CpuView;

/// Memory from a [`CachingAllocator`](super::CachingAllocator). Dropping it frees it
/// (without waiting for the allocator's lock); if it was used on other queues, the memory
/// returns to the pool only after those queues finish with it.
pub struct Allocation {
    /// One strong count, made by `Arc::clone` or taken from the pool's stash
    /// ([`Allocation::new`]); `Drop` lets it go or leaves it in the stash.
    inner: ManuallyDrop<Arc<AllocatorShared>>,
    /// The block's id, held in a whole word: a `u32` field leaves four bytes of padding, and
    /// moving the `Allocation` out of its `Result` then reads eight bytes over a four-byte
    /// store, which defeats store forwarding (it stalled the RAII pair's loop: 80% of its
    /// samples). See [`Allocation::id`].
    id: u64,
    /// Valid until `Drop` frees the block: the block is allocated, so the pool holds the
    /// segment.
    pub(super) seg: SegRef,
    pub(super) offset: usize,
    pub(super) size: usize,
    /// The queue the block is bound to.
    pub(super) queue: Option<QueueId>,
    /// Other queues that used the block, each with the node its deferred free's marker will
    /// carry. Not dropped by the drop glue: `Drop` takes it when it is not empty, so the usual
    /// free pays nothing for it.
    pub(super) uses: ManuallyDrop<shared::Uses>,
}

impl std::fmt::Debug for Allocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocation").field("size", &self.size).field("offset", &self.offset).finish()
    }
}

/// Lets go `n` strong counts of `inner` that the pool's stash held (`RefStash::close` or
/// `RefStash::put`), after the pool's lock is released. The caller holds a count of its own
/// besides them (`inner`), so none of these is the last.
pub(super) fn let_go(inner: &Arc<AllocatorShared>, n: usize) {
    for _ in 0..n {
        // SAFETY: each is a strong count of this `Arc`, made by `Arc::clone` and kept in the
        // stash in place of an `Allocation`'s; the caller's own count keeps it above zero.
        unsafe { Arc::decrement_strong_count(Arc::as_ptr(inner)) };
    }
}

impl Allocation {
    /// The `Allocation` of block `id` (handed out, its fields from `Handed`), with a strong
    /// count of `inner` taken from the stash of `pool` (the lock `inner`'s pool holds) if it
    /// has one, else made.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        inner: &Arc<AllocatorShared>,
        pool: &mut Pool,
        id: BlockId,
        seg: SegRef,
        offset: usize,
        size: usize,
        queue: Option<QueueId>,
    ) -> Self {
        let inner = if pool.refs.take() {
            // SAFETY: the stash holds strong counts of this very `Arc` (only `Drop` below puts
            // them there, each the count of an `Allocation` of this allocator, whose pool is
            // `pool`), and taking one under the lock makes it this one's.
            ManuallyDrop::new(unsafe { Arc::from_raw(Arc::as_ptr(inner)) })
        } else {
            ManuallyDrop::new(Arc::clone(inner))
        };
        Self { inner, id: u64::from(id), seg, offset, size, queue, uses: ManuallyDrop::new(Vec::new()) }
    }

    /// Lets this allocation's strong count go (at the end of `Drop`, never used again).
    fn release_inner(&mut self) {
        // SAFETY: called once, as the last use of `inner`, at the end of `Drop`.
        unsafe { ManuallyDrop::drop(&mut self.inner) };
    }

    /// The block's id in the pool.
    #[inline(always)]
    fn id(&self) -> BlockId {
        self.id as BlockId
    }

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

    /// Where the block starts in its fd ([`Allocation::try_clone_fd`]): with
    /// [`Allocation::len`], the range to name when the block is shared. A block of a
    /// page-stitched arena (`Config::page_stitching`) is shared as a range of the arena's memfd
    /// when its view shows one run of units (the usual case), else it has no such range:
    /// `try_clone_fd` refuses it and this is where it starts in its segment's mapping.
    pub fn offset(&self) -> usize {
        if self.seg().is_stitched() {
            if let Ok(off) = self.lock_pool().fd_offset(self.id()) {
                return off;
            }
        }
        self.offset
    }

    /// A new fd for the buffer the block lies in (`dup`): the whole segment (or arena memfd),
    /// of which the block is `[offset(), offset() + len())`. Refused, saying why, for a block
    /// of a page-stitched arena whose units are not one run of its memfd.
    pub fn try_clone_fd(&self) -> Result<OwnedFd> {
        if self.seg().is_stitched() {
            self.lock_pool().fd_offset(self.id())?;
            return self.seg().dup_fd();
        }
        self.seg().try_clone_fd()
    }

    /// The ranges `(offset, len)` of the block's fd that hold its bytes, in address order:
    /// one (`offset()`, the block's whole size) for a pooled block or a home block of a
    /// page-stitched arena, one per run of the arena's memfd for a stitched view. The sizes
    /// are the block's (rounded) size, at least [`Allocation::len`].
    pub fn fd_ranges(&self) -> Vec<(usize, usize)> {
        self.lock_pool().fd_ranges(self.id())
    }

    /// One dma-buf over exactly this block's pages, through udmabuf (`UDMABUF_CREATE_LIST`),
    /// for a device that takes one buffer: a stitched block of a page-stitched arena stays one
    /// dma-buf although its memfd pages lie in several runs. Its length is the block's size
    /// rounded to its units (the first [`Allocation::len`] bytes are the block's).
    ///
    /// The dma-buf pins the pages: it shows what the block holds while the block is live, and
    /// whatever the allocator puts there after the block is freed, so keep the `Allocation`
    /// for as long as a device uses it. Refused, saying why, for a block of a dma-buf segment
    /// (heap and GEM sources: share [`Allocation::try_clone_fd`] with `offset()` instead),
    /// for a block smaller than or not aligned to a page, past udmabuf's `list_limit` runs or
    /// its `size_limit_mb`, and where `/dev/udmabuf` is missing ([`Udmabuf::open`]).
    pub fn export_dma_buf(&self, udmabuf: &Udmabuf) -> Result<Segment> {
        if self.seg().is_dma_buf() {
            return Err(crate::error::Error::Unsupported {
                what: "the block already lies in a dma-buf (a heap or GEM segment): share try_clone_fd() with \
                       offset() and len()"
                    .into(),
            });
        }
        let ranges = self.fd_ranges();
        udmabuf.export_fd_ranges(self.seg(), &ranges)
    }

    /// Holds the block for sharing with another process ([`crate::ipc`]).
    pub(crate) fn export(&self) -> Result<super::export::Exported> {
        let mut pool = self.lock_pool();
        pool.drain(&self.inner.frees);
        super::export::export_block(&self.inner, &mut pool, self.id(), self.as_ptr() as usize)
    }

    fn lock_pool(&self) -> super::pool_lock::PoolGuard<'_, super::pool::Pool> {
        self.inner.pool.lock()
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
        if Some(queue.id()) != self.queue && !self.uses.iter().any(|(h, _)| h.id() == queue.id()) {
            // The node is made now, so that the free allocates nothing.
            let node = Node::new(FreeMsg::Free(self.id()));
            self.uses.push((queue.handle(), node));
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
    /// The owner thread's short free (into the quick cache or an arena's home block let go,
    /// under its fast hold) is inlined into the caller; the rest is out of line
    /// (`drop_rest`).
    #[inline(always)]
    fn drop(&mut self) {
        // From the free on, the block may be reused or its segment released: `self.seg` must
        // not be used after it.
        if self.uses.is_empty() && self.inner.frees.is_empty() {
            let (id, inner): (_, &AllocatorShared) = (self.id(), &self.inner);
            // `Some(short)`: the fast hold was had, and the free took the short way (`Some`,
            // with what the stash did) or must take the long way (`None`).
            let held = inner
                .pool
                .fast()
                .map(|mut pool| pool.free_dropped(id).then(|| pool.refs.put(shared::handles_alive(inner))));
            match held {
                Some(Some(put)) => return self.after_put(put),
                Some(None) => {
                    self.push_free();
                    self.release_inner();
                    return;
                }
                None => {}
            }
        }
        self.drop_rest();
    }
}

impl Allocation {
    /// `Drop` past the owner's fast hold: nothing waits to be applied before this free, and
    /// the pool's lock is free (`try_lock`, which never waits): the short way is taken at
    /// once, as the next drain would take it. Otherwise the free goes onto the lock-free list.
    #[inline(never)]
    fn drop_rest(&mut self) {
        if self.uses.is_empty() && self.inner.frees.is_empty() {
            let (id, inner): (_, &AllocatorShared) = (self.id(), &self.inner);
            let put = inner
                .pool
                .try_lock()
                .and_then(|mut pool| pool.free_dropped(id).then(|| pool.refs.put(shared::handles_alive(inner))));
            if let Some(put) = put {
                return self.after_put(put);
            }
        }
        self.push_free();
        self.release_inner();
    }

    /// After the short free, with the lock released: the count was left in the stash
    /// (`Ok`: nothing of `self.inner` is used after the release, the stash being emptied only
    /// under the lock), or no handle is left and the stash's counts go, and this one.
    #[inline(always)]
    fn after_put(&mut self, put: Result<(), usize>) {
        if let Err(n) = put {
            self.let_go_all(n);
        }
    }

    #[inline(never)]
    fn let_go_all(&mut self, n: usize) {
        let_go(&self.inner, n - 1);
        self.release_inner();
    }
}

impl Allocation {
    /// `Drop`'s long way: the free onto the lock-free list, in a node made now (a deferred
    /// free's markers use the nodes made when the uses were recorded).
    #[inline(never)]
    fn push_free(&mut self) {
        if self.uses.is_empty() {
            self.inner.frees.push(Node::new(FreeMsg::Free(self.id())));
            return;
        }
        // Taken out of the ManuallyDrop, so it is dropped here.
        let mut uses = std::mem::take(&mut *self.uses);
        // Queues idle now have finished every use made before this free.
        uses.retain(|(q, _)| !q.has_passed());
        if uses.is_empty() {
            self.inner.frees.push(Node::new(FreeMsg::Free(self.id())));
            return;
        }
        // Counted before it is published, so no one sees the request without the count.
        self.inner.pending.begin_n(uses.len());
        self.inner.frees.push(Node::new(FreeMsg::Requested(self.id(), uses.len() as u32)));
        shared::mark_all(&self.inner, self.id(), uses);
    }
}
