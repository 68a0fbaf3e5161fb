//! Blocks: the unit the allocator hands out and caches, their ids, the size rules of seed 003
//! (rounding unit, pool thresholds, segment sizes), which pool a block lives in
//! ([`PoolKind`]), and the reference-count-free pointer at a block's segment ([`SegRef`]).
//!
//! The rest of the allocator builds on this file; it imports none of them.
//!
//! The one piece of unsafe code here is [`SegRef`]: an allocated block's segment cannot go
//! away (the pool returns a segment to its source only when it is one free, unsplit block, and
//! a block stops being allocated only when its owner lets go), so an
//! [`Allocation`](super::Allocation), which also keeps the allocator (and so the pool) alive,
//! can point at its segment without touching the segment's `Arc` count: two atomic operations
//! fewer per allocation and free, a fifth of the hot path's time.

#![allow(unsafe_code)]

use std::ptr::NonNull;
use std::sync::Arc;

use crate::queue::QueueId;
use crate::segment::Segment;

/// A block's index in the pool's block arena.
pub(crate) type BlockId = u32;

/// Smallest block, and the rounding unit.
pub(crate) const MIN_BLOCK: usize = 512;
/// Largest request served by the small pool.
pub(crate) const SMALL_SIZE: usize = 1 << 20;
/// Small-pool segment size.
pub(crate) const SMALL_BUFFER: usize = 2 << 20;
/// Large-pool segment size for 1–10 MiB requests.
pub(crate) const LARGE_BUFFER: usize = 20 << 20;
/// Requests from this size get their own segment.
pub(crate) const MIN_LARGE_ALLOC: usize = 10 << 20;
/// Large segments are rounded to this.
pub(crate) const ROUND_LARGE: usize = 2 << 20;

/// Which of seed 003's two pools a block (and its segment) belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum PoolKind {
    /// Requests of at most [`SMALL_SIZE`], packed into [`SMALL_BUFFER`] segments.
    Small,
    /// Everything larger.
    Large,
}

impl PoolKind {
    /// Both pools, small first.
    pub(crate) const BOTH: [PoolKind; 2] = [PoolKind::Small, PoolKind::Large];

    /// The pool that serves a request of `rounded` bytes.
    #[inline]
    pub(crate) fn for_size(rounded: usize) -> Self {
        if rounded <= SMALL_SIZE { PoolKind::Small } else { PoolKind::Large }
    }

    /// Its entry in a [`StatArray`](super::stats::StatArray): `stats::SMALL_POOL` or
    /// `stats::LARGE_POOL` (entry 0 is the aggregate).
    #[inline(always)]
    pub(crate) fn index(self) -> usize {
        match self {
            PoolKind::Small => 1,
            PoolKind::Large => 2,
        }
    }

    /// Its place in a per-pool pair (`[small, large]`).
    #[inline(always)]
    pub(crate) fn slot(self) -> usize {
        self.index() - 1
    }

    /// "small" or "large", as snapshots name it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            PoolKind::Small => "small",
            PoolKind::Large => "large",
        }
    }
}

/// The pool's key for the queue a block is bound to: the queue's id as a plain integer, 0 for
/// none, so the pool's ordered sets sort unbound blocks first and its hash tables hash one
/// word (`Option<QueueId>` would hash a discriminant too, on the allocation fast path).
/// Made only from a [`QueueId`] (or none), so it cannot name a queue that never existed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct QueueKey(u64);

impl QueueKey {
    /// The key of `queue` (none: [`QueueKey::NONE`]).
    #[inline(always)]
    pub(crate) fn of(queue: Option<QueueId>) -> QueueKey {
        QueueKey(queue.map_or(0, QueueId::get))
    }

    /// Any integer as a key, for tests of the pool's structures.
    #[cfg(test)]
    pub(crate) fn for_tests(n: u64) -> QueueKey {
        QueueKey(n)
    }

    /// The integer the snapshot and history show (0: none).
    pub(crate) fn get(self) -> u64 {
        self.0
    }

    /// Whether it names a queue.
    pub(crate) fn is_some(self) -> bool {
        self.0 != 0
    }

    /// A key for a made-up queue number (unit tests drive the pool without queues).
    #[cfg(test)]
    pub(crate) const fn test(n: u64) -> QueueKey {
        QueueKey(n)
    }
}

impl std::fmt::Display for QueueKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_some() { write!(f, "queue {}", self.0) } else { f.write_str("no queue") }
    }
}

/// A block: a range of a segment, free or handed out, linked to its neighbours in address
/// order. One cache line, aligned to it: a free reads the block of an allocation made long
/// ago (cold), and one line is one miss where a 72-byte block straddled two.
#[derive(Debug, Clone)]
#[repr(align(64))]
pub(crate) struct Block {
    pub(crate) seg: u32,
    pub(crate) offset: usize,
    pub(crate) size: usize,
    pub(crate) requested: usize,
    /// The queue it is bound to.
    pub(crate) queue: QueueKey,
    /// Handed out (or its free is waiting for events).
    pub(crate) allocated: bool,
    pub(crate) prev: Option<BlockId>,
    pub(crate) next: Option<BlockId>,
    pub(crate) pool: PoolKind,
    /// The allocation-miss count when the block was last cached (for GC age), its low 32
    /// bits (ages are told apart modulo 2^32: [`Block::age`]).
    pub(crate) cached_at: u32,
    /// In the quick cache (free, unmerged, not in a pool).
    pub(crate) in_quick: bool,
    /// Handed out through the raw API.
    pub(crate) raw: bool,
    /// A raw block that other queues used: its handles are in the raw table.
    pub(crate) raw_used: bool,
    /// A view of a page-stitched arena (never split, never quick-cached).
    pub(crate) arena: bool,
}

const _: () = assert!(size_of::<Block>() == 64);

impl Block {
    /// Allocation misses since the block was last cached, `misses` being the pool's count
    /// now (modulo 2^32: a block cached for 4 billion misses looks young again, and is only
    /// collected later).
    #[inline]
    pub(crate) fn age(&self, misses: u64) -> u64 {
        u64::from(Self::stamp(misses).wrapping_sub(self.cached_at))
    }

    /// What `cached_at` keeps of the pool's miss count `misses` (its low 32 bits).
    #[inline(always)]
    pub(crate) fn stamp(misses: u64) -> u32 {
        misses as u32
    }

    /// Whether it shares its segment with other blocks.
    #[inline(always)]
    pub(crate) fn is_split(&self) -> bool {
        // Both tested without a branch between (the hot path's stats ask for every block).
        self.prev.is_some() | self.next.is_some()
    }

    /// Free and in its pool (neither handed out nor in the quick cache): what merging and
    /// punching may touch.
    #[inline]
    pub(crate) fn is_pooled_free(&self) -> bool {
        !self.allocated && !self.in_quick
    }
}

/// What the free list carries: the free path's messages about blocks (and queues).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FreeMsg {
    /// The caller let go and no other queue used the block: free it now.
    Free(BlockId),
    /// The caller let go; markers on this many other queues must pass first.
    Requested(BlockId, u32),
    /// One of those markers passed (the last one completes the free).
    Passed(BlockId),
    /// The queue with this id is gone: its memory goes back once its blocks are free.
    QueueGone(QueueId),
    /// A hold for sharing ([`ExportHold`](super::ExportHold)) went where its thread held the
    /// pool's lock already: release it.
    Unhold(BlockId),
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
    #[inline]
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{MemorySource, SparseSource};

    #[test]
    fn requests_up_to_one_mib_take_the_small_pool() {
        assert_eq!(PoolKind::for_size(MIN_BLOCK), PoolKind::Small);
        assert_eq!(PoolKind::for_size(SMALL_SIZE), PoolKind::Small);
        assert_eq!(PoolKind::for_size(SMALL_SIZE + MIN_BLOCK), PoolKind::Large);
        assert_eq!(PoolKind::for_size(usize::MAX), PoolKind::Large);
        assert_eq!(PoolKind::BOTH.map(PoolKind::slot), [0, 1]);
        assert_eq!(PoolKind::BOTH.map(PoolKind::name), ["small", "large"]);
    }

    #[test]
    fn a_seg_ref_reaches_the_segment_and_its_counts() {
        let seg = Arc::new(SparseSource.create_segment(4096).unwrap());
        let r = SegRef::new(&seg);
        // SAFETY: `seg` is alive for the whole test.
        assert_eq!(unsafe { r.get() }.len(), 4096);
        // SAFETY: as above.
        let again = unsafe { r.to_arc() };
        assert_eq!(Arc::strong_count(&seg), 2);
        drop(again);
        assert_eq!(Arc::strong_count(&seg), 1);
    }
}
