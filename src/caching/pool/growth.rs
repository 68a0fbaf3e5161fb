//! The pool's side of expandable segments: when to grow the (queue, pool) segment, which free
//! pages to punch and when (the trim policy), and the accounting of punched pages that come
//! back into use. The page arithmetic and the calls to the segment are in `expandable.rs`.

use std::sync::Arc;

use super::super::block::{BlockId, PoolKind, QueueKey};
use super::super::expandable::{self, Budget, ExpState, Reservation};
use super::super::snapshot::HistoryKind;
use super::super::stats;
use super::{Key, Pool, SegEntry};

impl Pool {
    pub(super) fn uses_expandable(&self) -> bool {
        self.config.expandable_segments && !self.config.no_caching && !self.expandable_unsupported
    }

    pub(super) fn is_expandable(&self, id: BlockId) -> bool {
        self.segments[self.blocks[id as usize].seg as usize].as_ref().is_some_and(|e| e.exp.is_some())
    }

    /// Grows the (queue, pool) expandable segment so that its free tail holds `rounded`
    /// bytes; returns that tail block. The growth is address space (its pages count as
    /// punched): the block's memory is found when it is handed out ([`Pool::reback_fits`]).
    /// Making the reservation and each growth (one `mmap` of more of the memfd) are calls to
    /// the memory source, counted in `num_device_alloc`.
    pub(super) fn grow_expandable(
        &mut self,
        rounded: usize,
        pool: PoolKind,
        queue: QueueKey,
        cause: &mut String,
    ) -> Option<BlockId> {
        let idx = match self.expandable.get(&(queue, pool)) {
            Some(&i) => i,
            None => match expandable::reserve(&*self.source, self.allowed, rounded) {
                Reservation::Made(seg, exp) => {
                    let base = seg.mapping().map_or(0, |m| m.as_ptr() as usize);
                    let entry =
                        SegEntry { seg: Arc::new(seg), base, size: 0, pool, queue, exp: Some(exp), arena: None };
                    let i = self.add_segment(entry);
                    self.expandable.insert((queue, pool), i);
                    i
                }
                Reservation::Unsupported => {
                    // Heaps and GEM objects cannot grow in place: use classic segments.
                    self.expandable_unsupported = true;
                    return None;
                }
                Reservation::Failed(e) => {
                    // Not even the request fits: classic segments from here on.
                    *cause = format!("; {} cannot reserve address space: {e}", self.source.name());
                    self.note_source_error(e);
                    self.expandable_unsupported = true;
                    return None;
                }
            },
        };
        // Free blocks the quick cache holds unmerged can neither extend the tail nor be punched
        // (normally it is empty here: the miss that led here flushed it).
        self.flush_quick();
        let (mapped, reserved_len, tail) = {
            let e = self.segments[idx as usize].as_ref().expect("live expandable segment");
            let exp = e.exp.as_ref().expect("expandable");
            (e.size, exp.reserved_len(), exp.tail)
        };
        let tail_free = tail.filter(|&t| self.blocks[t as usize].is_pooled_free());
        let have = tail_free.map_or(0, |t| self.blocks[t as usize].size);
        let grow = ExpState::growth(rounded, have);
        if mapped + grow > reserved_len {
            *cause = format!("; the expandable segment's {reserved_len}-byte reservation is full");
            return None;
        }
        // Growing maps address space only (sparse memfd pages, counted as punched): the memory
        // is counted, stitched or made room for when a block over it is handed out
        // (`Pool::reback_fits`).
        let e = self.segments[idx as usize].as_mut().expect("live expandable segment");
        if let Err(err) = e.exp.as_mut().expect("expandable").grow(&e.seg, mapped, grow) {
            *cause = format!("; {err}");
            self.note_source_error(err);
            return None;
        }
        e.size = mapped + grow;
        self.stats.device.num_device_alloc += 1;
        match tail_free {
            Some(t) => {
                self.pool_remove(t);
                self.blocks[t as usize].size += grow;
                self.pool_insert(t);
                Some(t)
            }
            None => {
                let id = self.new_block(idx, (mapped, grow), queue, pool, tail, None);
                if let Some(t) = tail {
                    self.blocks[t as usize].next = Some(id);
                }
                self.fix_tail(id);
                self.pool_insert(id);
                Some(id)
            }
        }
    }

    /// Bytes of the punched pages that the first `len` bytes of an expandable block touch (0
    /// for any other block).
    pub(super) fn punched_bytes(&self, id: BlockId, len: usize) -> usize {
        let b = &self.blocks[id as usize];
        let Some(exp) = self.segments[b.seg as usize].as_ref().and_then(|e| e.exp.as_ref()) else { return 0 };
        exp.punched_bytes(b.offset, len.min(b.size))
    }

    /// Whether pooled block `id` can be handed out for a `rounded`-byte request: the punched
    /// pages that part of it touches count as reserved again once handed out (touching them
    /// brings them back, with no call to the source): the trim policy makes room for them,
    /// and then they must fit in the allowed memory. On the slow path of
    /// [`Pool::allocate`] only, and cheap unless the block's segment has punched pages.
    pub(super) fn reback_fits(&mut self, id: BlockId, rounded: usize) -> bool {
        let mut need = self.punched_bytes(id, rounded) as u64;
        if need == 0 || self.budget().trim_excess(need, rounded as u64) == 0 {
            // Nothing to back, or within the trim policy's bound: touching the pages backs
            // them, with no call.
            return true;
        }
        if self.quick.len() > 0 {
            // Memory in the quick cache cannot be punched either.
            self.merge_quick_around(id);
            need = self.punched_bytes(id, rounded) as u64;
        }
        self.trim(need, rounded as u64, Some(id));
        // The trim spares `id` itself, but the part of it this request leaves free may hold
        // backed pages (its front was punched and its end was not): past the bound (or the
        // allowed memory), those go too, rather than leaving the reserved bytes above it or
        // refusing a request that fits.
        let over = self.budget().trim_excess(need, rounded as u64);
        if over > 0 {
            self.punch_block_beyond(id, rounded, over);
        }
        if self.budget().over_allowed(need) > 0 {
            // The pools had not enough free pages to punch: the arenas' free units go too
            // (their views stay), rather than refuse a request the allowed memory holds.
            self.arena_release_cached(None, false);
        }
        self.stats.device.reserved_bytes[stats::AGGREGATE].current as u64 + need <= self.allowed
    }

    /// Merges the quick cache into the pools (memory there can be neither moved nor punched),
    /// with pooled block `id` out of its pool and marked allocated meanwhile so that no merge
    /// absorbs it; then `id` goes back through `pool_free`, which absorbs its free neighbours
    /// (leaving them unmerged would strand them: nothing merges two pooled blocks later). `id`
    /// keeps its id, so the caller's choice stands; it may start earlier now.
    fn merge_quick_around(&mut self, id: BlockId) {
        self.pool_remove(id);
        self.blocks[id as usize].allocated = true;
        self.flush_quick();
        self.blocks[id as usize].allocated = false;
        self.pool_free(id);
    }

    /// Counts the punched pages under an expandable block that is being handed out as
    /// reserved again ([`Pool::reback_fits`] made room for them). Called on the slow path of
    /// [`Pool::allocate`], the only way out of the pools (see `Pool::hand_out`).
    pub(super) fn back_chunks(&mut self, id: BlockId) {
        let b = &self.blocks[id as usize];
        let (seg, off, size, pool) = (b.seg, b.offset, b.size, b.pool);
        let Some(exp) = self.segments[seg as usize].as_mut().and_then(|e| e.exp.as_mut()) else { return };
        let added = exp.back(off, size);
        if added > 0 {
            let (addr, queue) =
                (self.segments[seg as usize].as_ref().map_or(0, |e| e.base) + off, self.blocks[id as usize].queue);
            stats::inc_array(&mut self.stats.device.reserved_bytes, pool, added as i64);
            // As PyTorch logs memory mapped into an expandable segment.
            self.log(HistoryKind::SegmentMap, addr, added, queue);
        }
    }

    /// Gives every backed page that a free expandable block wholly covers back to the kernel;
    /// returns the bytes released.
    pub(super) fn punch_free(&mut self, id: BlockId) -> usize {
        self.punch_block(id, u64::MAX)
    }

    /// Gives back at least `want` bytes (or all it has) of the backed pages that a free
    /// expandable block wholly covers, taken from its end (best fit splits blocks from the
    /// front, so the end is reused last), with one `fallocate(PUNCH_HOLE)`: a call to the
    /// source, counted in `num_device_free`. Returns the bytes released.
    pub(super) fn punch_block(&mut self, id: BlockId, want: u64) -> usize {
        self.punch_block_beyond(id, 0, want)
    }

    /// [`Pool::punch_block`] for the pages past the block's first `skip` bytes only (the part
    /// a request is about to take is left as it is).
    fn punch_block_beyond(&mut self, id: BlockId, skip: usize, want: u64) -> usize {
        let b = &self.blocks[id as usize];
        let skip = skip.min(b.size);
        let (seg, off, size, pool) = (b.seg, b.offset + skip, b.size - skip, b.pool);
        if self.queue_busy(b.queue) {
            // Work queued before the free may still use the block: a punch would not wait.
            return 0;
        }
        let Some(entry) = self.segments[seg as usize].as_mut() else { return 0 };
        let Some(exp) = entry.exp.as_mut() else { return 0 };
        let Some((from_b, freed)) = exp.punch(&entry.seg, off, size, want) else { return 0 };
        let (addr, queue) = (entry.base + from_b, entry.queue);
        self.stats.device.num_device_free += 1;
        stats::dec_array(&mut self.stats.device.reserved_bytes, pool, freed as i64);
        self.log(HistoryKind::SegmentUnmap, addr, freed, queue);
        freed
    }

    /// The numbers the trim policy weighs, now.
    pub(super) fn budget(&self) -> Budget {
        let bytes = self.stats.hot.array(stats::ALLOCATED_BYTES)[stats::AGGREGATE];
        // A hungry arena's free units are its wider slack's (see `Arena::hungry`).
        let arena_free = self
            .arenas
            .values()
            .filter_map(|&si| self.segments[si as usize].as_ref()?.arena.as_ref())
            .filter(|a| a.hungry())
            .map(|a| a.free_backed_bytes() as u64)
            .sum();
        Budget {
            reserved: self.stats.device.reserved_bytes[stats::AGGREGATE].current as u64,
            arena_free,
            allocated: bytes.current as u64,
            allocated_peak: bytes.peak as u64,
            allowed: self.allowed,
            trim_ratio: self.config.trim_ratio,
        }
    }

    /// The trim policy, which keeps reserved memory close to the allocated peak. It runs only
    /// where the reserved bytes are about to grow by `need` for a request of `rounded` bytes,
    /// on the slow path: a miss that grows an expandable segment, or a cached block handed out
    /// over pages punched earlier. If they would end up above `Config::trim_ratio` times the
    /// allocated peak (counting this request), or past the allowed memory, it punches free
    /// pages of pooled blocks in every expandable segment (either pool), largest blocks first
    /// (fewest calls), each from its end, down to the low mark (`TRIM_LOW_SHARE`). A block
    /// bound to a queue with work in flight is left alone: that work was queued before the
    /// free and may still read or write it, and a punch is not ordered after it.
    /// `keep` (the block the request will take) is spared. A periodic workload whose pages all
    /// fit within the bound stops punching once warm; one that touches more pages per
    /// iteration than that punches some every iteration.
    pub(super) fn trim(&mut self, need: u64, rounded: u64, keep: Option<BlockId>) {
        let excess = self.budget().trim_excess(need, rounded);
        if excess > 0 {
            self.punch_largest(excess, keep);
        }
    }

    /// Punches at least `excess` bytes of free pages from pooled expandable blocks, largest
    /// first (both pools walked from their largest key down and merged by size: exact for one
    /// queue, per queue otherwise), sparing `keep` and the blocks of queues with work in
    /// flight; returns what is left of `excess`. Walks the pools in place: no collecting, no
    /// sorting.
    pub(super) fn punch_largest(&mut self, mut excess: u64, keep: Option<BlockId>) -> u64 {
        let mut below: [Option<Key>; 2] = [None, None];
        let mut done = [false; 2];
        loop {
            let mut peek = [None, None];
            for i in 0..2 {
                if !done[i] {
                    let set = &self.pools[i];
                    peek[i] = set.prev_before(below[i]);
                    done[i] = peek[i].is_none();
                }
            }
            let i = match (peek[0], peek[1]) {
                (None, None) => return excess,
                (Some(_), None) => 0,
                (None, Some(_)) => 1,
                (Some(a), Some(b)) => usize::from(b.1 >= a.1),
            };
            let k = peek[i].expect("picked a present key");
            below[i] = Some(k);
            if Some(k.3) == keep || !self.is_expandable(k.3) || self.queue_busy(k.0) {
                continue;
            }
            // Punching keeps the block in its pool under the same key.
            excess = excess.saturating_sub(self.punch_block(k.3, excess) as u64);
            if excess == 0 {
                return 0;
            }
        }
    }
}
