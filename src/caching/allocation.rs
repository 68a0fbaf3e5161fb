//! [`Allocation`], the RAII block of the caching allocator: a pointer to its record
//! (`record.rs`), which it takes from the pool's spares or makes, and gives back or pushes
//! when dropped. It reaches its segment through a [`SegRef`] (see `block.rs`: no reference
//! count), which is why it has unsafe code.

#![allow(unsafe_code)]

use std::mem::ManuallyDrop;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use super::block::{BlockId, FreeMsg, SegRef};
use super::free_list::Node;
use super::pool::Pool;
use super::record::{Body, Record, Uses};
use super::shared::{self, AllocatorShared};
use crate::error::Result;
use crate::queue::{Mem, Queue, QueueId};
use crate::segment::{Access, Segment};
use crate::source::Udmabuf;
use crate::view::CpuView;

/// Memory from a [`CachingAllocator`](super::CachingAllocator). Dropping it frees it
/// (without waiting for the allocator's lock); if it was used on other queues, the memory
/// returns to the pool only after those queues finish with it.
///
/// One word: a pointer to the block's record (so `Option<Allocation>` is one word too).
pub struct Allocation {
    /// The record, with its strong count of the allocator's shared state; taken by `Drop`.
    rec: ManuallyDrop<Record>,
}

// SAFETY: `&Allocation` only reads the record, which nothing changes while the `Allocation`
// lives (only `&mut self` methods and `Drop` do; the record's list link is used only on the
// lock-free list, after `Drop` let go of it). The record is `Send`.
unsafe impl Sync for Allocation {}

// One word, `Option` included; sendable and shareable between threads.
const _: () = {
    assert!(size_of::<Allocation>() == size_of::<usize>());
    assert!(size_of::<Option<Allocation>>() == size_of::<usize>());
    const fn shareable<T: Send + Sync>() {}
    shareable::<Allocation>();
};

impl std::fmt::Debug for Allocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocation").field("size", &self.body().size).field("offset", &self.body().offset).finish()
    }
}

impl Allocation {
    /// The `Allocation` of block `id` (handed out, its fields from `Handed`), in a record of
    /// `pool`'s spares (the pool `inner` holds, under its lock) if there is one, else a new
    /// one with a new strong count of `inner`.
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
        let rec = match pool.spares.take() {
            Some(mut rec) => {
                let b = &mut rec.value;
                debug_assert!(b.uses.is_none(), "a spare record with uses");
                (b.id, b.seg, b.offset, b.size, b.queue) = (id, seg, offset, size, queue);
                rec
            }
            None => shared::new_record(
                inner,
                Body { inner: std::ptr::NonNull::dangling(), id, seg, offset, size, queue, uses: None },
            ),
        };
        Self { rec: ManuallyDrop::new(rec) }
    }

    #[inline(always)]
    fn body(&self) -> &Body {
        &self.rec.value
    }

    /// The allocator's shared state (the record's count keeps it alive).
    #[inline(always)]
    fn inner(&self) -> &AllocatorShared {
        shared::of(self.body())
    }

    /// The block's id in the pool.
    #[inline(always)]
    fn id(&self) -> BlockId {
        self.body().id
    }

    /// The size asked for.
    pub fn len(&self) -> usize {
        self.body().size
    }

    /// Always false (zero-sized requests are refused).
    pub fn is_empty(&self) -> bool {
        self.body().size == 0
    }

    fn seg(&self) -> &Segment {
        // SAFETY: `&self` proves the allocation is live, so its block is allocated (only `Drop`
        // frees it) and the pool, kept alive by the record's count, holds the segment's `Arc`.
        unsafe { self.body().seg.get() }
    }

    /// CPU access to the block: a [`CpuView`] of exactly the bytes asked for (its neighbours in
    /// the segment are out of reach), inside the dma-buf sync bracket if the segment is one.
    pub fn cpu_access(&self, access: Access) -> Result<CpuView<'_>> {
        let view = CpuView::new(self.seg(), self.body().offset, self.body().size, access)?;
        if self.seg().is_stitched() {
            // Its units' place in the memfd, if one run holds them (`CpuView::fd_offset`).
            let fd_offset = self.lock_pool().fd_offset(self.id()).ok();
            return Ok(view.with_fd_offset(fd_offset));
        }
        Ok(view)
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
        self.body().offset
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
        shared::drain(self.inner(), &mut pool);
        super::export::export_block(&shared::arc_of(self.body()), &mut pool, self.id(), self.as_ptr() as usize)
    }

    fn lock_pool(&self) -> super::pool_lock::PoolGuard<'_, super::pool::Pool> {
        self.inner().pool.lock()
    }

    /// Whether the block's fd is a dma-buf (otherwise a memfd).
    pub fn is_dma_buf(&self) -> bool {
        self.seg().is_dma_buf()
    }

    /// The block as a queue range (it keeps the segment alive for the operations using it).
    pub fn mem(&self) -> Mem {
        // SAFETY: as in `seg`: the block is allocated, so the pool holds the segment's `Arc`.
        let seg = unsafe { self.body().seg.to_arc() };
        Mem::from(&seg).range(self.body().offset, self.body().size).expect("blocks lie inside their segment")
    }

    /// The CPU address of the block (segments are always mapped), for code that follows the
    /// crate's shared-memory access rule.
    pub fn as_ptr(&self) -> *mut u8 {
        self.seg().mapping().map_or(std::ptr::null_mut(), |m| m.as_ptr().wrapping_add(self.body().offset))
    }

    /// The queue the block is bound to (`None`: allocated for host-side use, on no queue).
    pub fn queue(&self) -> Option<QueueId> {
        self.body().queue
    }

    /// Records that `queue` uses this memory: when it is freed, the block waits for the work
    /// submitted to `queue` until then before anyone can reuse it (PyTorch's `recordStream`).
    #[doc(alias = "record_stream")]
    pub fn record_queue(&mut self, queue: &Queue) {
        let b = &mut self.rec.value;
        let known = b.uses.as_ref().is_some_and(|u| u.queues.iter().any(|(h, _)| h.id() == queue.id()));
        if Some(queue.id()) != b.queue && !known {
            // The nodes are made now, so that the free allocates nothing.
            let node = Node::new(FreeMsg::Free(b.id));
            let id = b.id;
            let uses = b
                .uses
                .get_or_insert_with(|| Box::new(Uses { request: Node::new(FreeMsg::Free(id)), queues: Vec::new() }));
            uses.queues.push((queue.handle(), node));
        }
    }
}

impl AsFd for Allocation {
    /// The fd of the segment the block lies in, at [`Allocation::offset`] (for a block of a
    /// page-stitched arena whose units lie in several runs of its memfd, no one range of this
    /// fd holds it: [`Allocation::fd_ranges`] say where they are).
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
        // From the free on, the block may be reused or its segment released, and the record
        // reused: `self.rec` must not be used after it.
        let body = self.body();
        if body.uses.is_none() {
            let (id, at) = (body.id, body.inner);
            // SAFETY: as `shared::of` (the record holds a count), with a lifetime not tied to
            // `self`: the record is given back below while this is still used. Once it is the
            // spares' (under the lock), the spares' count keeps the state alive until the
            // lock's release, the last use here (spares are taken out only under the lock).
            let inner: &AllocatorShared = unsafe { at.cast::<AllocatorShared>().as_ref() };
            if shared::nothing_pushed(inner)
                && let Some(mut pool) = inner.pool.fast()
            {
                if pool.free_dropped(id) {
                    // SAFETY: taken once; `self.rec` is not used after it.
                    let rec = unsafe { ManuallyDrop::take(&mut self.rec) };
                    let kept = pool.spares.put(rec, shared::handles_alive(inner));
                    drop(pool);
                    if let Err((rec, spares)) = kept {
                        shared::let_go(std::iter::once(rec).chain(spares));
                    }
                    return;
                }
                drop(pool);
                return self.push_free();
            }
        }
        self.drop_rest();
    }
}

impl Allocation {
    /// `Drop` past the owner's fast hold: nothing waits to be applied before this free, and
    /// the pool's lock is free (`try_lock`, which never waits): the short way is taken at
    /// once, as the next drain would take it. Otherwise the free is pushed.
    #[inline(never)]
    fn drop_rest(&mut self) {
        let body = self.body();
        if body.uses.is_none() {
            let (id, at) = (body.id, body.inner);
            // SAFETY: as in `drop`.
            let inner: &AllocatorShared = unsafe { at.cast::<AllocatorShared>().as_ref() };
            if shared::nothing_pushed(inner)
                && let Some(mut pool) = inner.pool.try_lock()
                && pool.free_dropped(id)
            {
                // SAFETY: taken once; `self.rec` is not used after it.
                let rec = unsafe { ManuallyDrop::take(&mut self.rec) };
                let kept = pool.spares.put(rec, shared::handles_alive(inner));
                drop(pool);
                if let Err((rec, spares)) = kept {
                    shared::let_go(std::iter::once(rec).chain(spares));
                }
                return;
            }
        }
        self.push_free();
    }

    /// `Drop`'s long way: the record itself onto the list of dropped records (a plain free),
    /// or, for a block used on other queues still at work, the request onto the free list
    /// and a marker on each of those queues; then the count goes (a record on the list holds
    /// none: `record.rs`).
    #[inline(never)]
    fn push_free(&mut self) {
        // SAFETY: taken once; `self.rec` is not used after it.
        let mut rec = unsafe { ManuallyDrop::take(&mut self.rec) };
        let (id, at) = (rec.value.id, rec.value.inner);
        let arc = shared::arc_of(&rec.value);
        match rec.value.uses.take().map(|u| *u) {
            Some(Uses { mut request, mut queues }) => {
                // Queues idle now have finished every use made before this free.
                queues.retain(|(q, _)| !q.has_passed());
                if queues.is_empty() {
                    arc.dropped.push(rec);
                } else {
                    // Counted before it is published, so no one sees the request without the
                    // count.
                    arc.pending.begin_n(queues.len());
                    request.value = FreeMsg::Requested(id, queues.len() as u32);
                    arc.frees.push(request);
                    shared::mark_all(&arc, id, queues);
                    drop(rec);
                }
            }
            None => arc.dropped.push(rec),
        }
        // `arc` is a view of this count, not a count of its own.
        shared::let_go_count(at);
    }
}
