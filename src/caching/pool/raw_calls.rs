//! The raw API's entry points (C callers and seed 002's raw deleter name blocks by address):
//! the checks are the raw table's (`raw.rs`), the frees go through the free path.

use std::sync::Arc;

use super::super::block::{BlockId, FreeMsg};
use super::super::raw::{DOUBLE_FREE, FOREIGN_FREE, INTERIOR_FREE, RawDeferred};
use super::super::snapshot::HistoryKind;
use super::{Handed, Pool};
use crate::queue::Queue;
use crate::segment::Segment;

impl Pool {
    /// Marks a block just handed out as a raw allocation; returns its address.
    pub(crate) fn hand_out_raw(&mut self, h: Handed) -> usize {
        self.blocks[h.id as usize].raw = true;
        self.addr(h.id)
    }

    /// Frees the raw allocation at `addr`: applied at once, or, if other queues used it, the
    /// block and those queues returned for the caller to decide (nothing applied yet: see
    /// [`Pool::apply_requested`] and [`Pool::apply_free`]). A pointer
    /// that is not a live raw allocation is refused (and logged), changing nothing else.
    #[inline]
    pub(crate) fn free_raw(&mut self, addr: usize) -> std::result::Result<Option<RawDeferred>, &'static str> {
        let id = match self.raw.live_raw_at(addr, &self.blocks) {
            Ok(id) => id,
            Err(why) => {
                self.history.log_always(HistoryKind::InvalidFree, addr, 0, 0);
                if self.raw.addrs.get(addr).is_some_and(|id| self.in_limbo(id)) {
                    return Err(super::limbo::LIMBO_FREE);
                }
                // A home block of an arena leaves no block behind when freed; the address
                // table remembers where one started until another starts there.
                if why == FOREIGN_FREE && self.raw.addrs.freed_at(addr) {
                    return Err(DOUBLE_FREE);
                }
                if why == FOREIGN_FREE && self.arena_holds(addr) {
                    // Inside an arena's memory, a freed block's (home blocks leave none behind):
                    // as a pointer into a cached block of the pools is.
                    return Err(INTERIOR_FREE);
                }
                return Err(why);
            }
        };
        if !self.raw.release(id, &mut self.blocks) {
            self.apply(FreeMsg::Free(id));
            return Ok(None);
        }
        Ok(Some((id, self.raw.take_uses(id))))
    }

    /// Logs the free of block `id` as requested (a raw free used on other queues, all of
    /// which have passed: it completes at once, [`Pool::apply_free`]).
    pub(crate) fn log_free_requested(&mut self, id: BlockId) {
        let b = &self.blocks[id as usize];
        let (size, queue) = (b.size, b.queue);
        let addr = self.addr(id);
        self.log(HistoryKind::FreeRequested, addr, size, queue);
    }

    /// Frees block `id` now (a raw free whose other queues had all passed).
    pub(crate) fn apply_free(&mut self, id: BlockId) {
        self.apply(FreeMsg::Free(id));
    }

    /// Applies the request of block `id`'s deferred free, which waits for `waits` markers.
    pub(crate) fn apply_requested(&mut self, id: BlockId, waits: u32) {
        self.apply(FreeMsg::Requested(id, waits));
    }

    /// Records that `queue` uses the raw allocation that holds `addr` (its start, or a byte of
    /// what it asked for).
    pub(crate) fn record_queue_raw(&mut self, addr: usize, queue: &Queue) -> std::result::Result<(), &'static str> {
        let id = match self.raw.live_raw_at(addr, &self.blocks) {
            Ok(id) => id,
            Err(why) => match self.raw.holding(addr, &self.blocks) {
                Some((start, id))
                    if {
                        let b = &self.blocks[id as usize];
                        b.allocated && b.raw && b.requested > 0 && addr - start < b.requested
                    } =>
                {
                    id
                }
                _ => return Err(why),
            },
        };
        self.raw.record_use(id, queue, &mut self.blocks);
        Ok(())
    }

    /// The segment, offset and requested size of the raw allocation at `addr`.
    pub(crate) fn raw_block(&self, addr: usize) -> std::result::Result<(Arc<Segment>, usize, usize), &'static str> {
        let b = &self.blocks[self.raw.live_raw_at(addr, &self.blocks)? as usize];
        let seg = Arc::clone(&self.segments[b.seg as usize].as_ref().expect("live segment").seg);
        Ok((seg, b.offset, b.requested))
    }

    /// The live allocation that holds `[addr, addr + len)` wholly: its segment and the offset
    /// of `addr` in the segment (see [`RawTable::live_range`]).
    pub(crate) fn live_range(&self, addr: usize, len: usize) -> std::result::Result<(Arc<Segment>, usize), String> {
        let id = self.raw.live_range(addr, len, &self.blocks).map_err(|why| {
            if self.arena_holds(addr) && self.raw.holding(addr, &self.blocks).is_none() {
                // Freed home blocks leave no block behind: say what the memory is.
                "inside free memory of a page-stitched arena (a freed block's, or not handed out yet)".to_string()
            } else {
                why
            }
        })?;
        let e = self.segments[self.blocks[id as usize].seg as usize].as_ref().expect("a live block's segment is live");
        Ok((Arc::clone(&e.seg), addr - e.base))
    }

    /// Whether `addr` lies in some block of a live segment, or in a page-stitched arena's
    /// memory (where freed home blocks leave no block behind).
    pub(crate) fn holds(&self, addr: usize) -> bool {
        self.raw.holding(addr, &self.blocks).is_some() || self.arena_holds(addr)
    }
}
