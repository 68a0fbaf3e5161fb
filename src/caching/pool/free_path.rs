//! The free path's application, under the pool's lock: the frees pushed onto the lock-free
//! list are drained oldest first, each block goes into the quick cache (unmerged, for exact
//! reuse) or into its pool merged with its free neighbours, and the stats follow.

use super::super::block::{Block, BlockId, FreeMsg, MIN_BLOCK, QueueKey};
use super::super::free_list::{Drain, FreeList, Node};
use super::super::quick::UNKNOWN;
use super::super::snapshot::HistoryKind;
use super::{Pool, QUICK_MAX};

impl Pool {
    /// Applies every free pushed since the last drain, oldest first (the caller checks the
    /// list is not empty first, on its fast path).
    #[inline]
    pub(crate) fn drain(&mut self, frees: &FreeList<FreeMsg>) {
        let mut drained = frees.take_all();
        let Some(first) = drained.next() else { return };
        if drained.is_done() {
            // One node (the common case): nothing to reorder. A plain free of a block the
            // quick cache takes, or of an arena's home block, is done here; anything else out
            // of line.
            let m = first.value;
            self.recycle(first);
            if let FreeMsg::Free(id) = m
                && self.quick_free(id)
            {
                return;
            }
            self.apply_out_of_line(m);
            return;
        }
        self.drain_many(first, drained);
    }

    /// The free of a dropped [`Allocation`](crate::caching::Allocation) used on no other
    /// queue, applied by the drop itself under the lock it took without waiting
    /// (`Allocation::drop`), where it takes the short way ([`Pool::quick_free`]). False,
    /// changing nothing, otherwise: the drop then pushes the free, and the next drain takes
    /// the long way (which may ask queues whether they are idle, and the dropping thread may
    /// hold a queue's lock).
    #[inline(always)]
    pub(crate) fn free_dropped(&mut self, id: BlockId) -> bool {
        self.quick_free(id)
    }

    /// The plain free of a dropped `Allocation` whose record was pushed (`shared::drain`):
    /// the short way where it can, else [`Pool::apply`].
    #[inline]
    pub(crate) fn free_pushed(&mut self, id: BlockId) {
        if !self.quick_free(id) {
            self.apply_out_of_line(FreeMsg::Free(id));
        }
    }

    #[inline(never)]
    fn apply_out_of_line(&mut self, m: FreeMsg) {
        self.apply(m);
    }

    /// [`Pool::apply`] of a plain free of block `id` where it takes the short way (no block
    /// held for another process, no gone queue: into the quick cache, see
    /// [`Pool::quick_free_now`], or an arena's home block gone, see [`Pool::home_free_now`]).
    /// False, changing nothing, otherwise.
    #[inline(always)]
    fn quick_free(&mut self, id: BlockId) -> bool {
        (self.held.len() | self.gone.len()) == 0 && (self.quick_free_now(id) || self.home_free_now(id))
    }

    /// `drain` for more than one node: `newest` and the `older` ones, applied oldest first (a
    /// deferred free's request before its completion; the chain is reversed in place).
    #[cold]
    #[inline(never)]
    fn drain_many(&mut self, newest: Box<Node<FreeMsg>>, older: Drain<FreeMsg>) {
        for n in older.oldest_first().chain(std::iter::once(newest)) {
            let m = n.value;
            self.recycle(n);
            self.apply(m);
        }
    }

    pub(super) fn recycle(&mut self, node: Box<Node<FreeMsg>>) {
        if self.nodes.len() < 4096 {
            self.nodes.push(node);
        }
    }

    #[inline(always)]
    pub(super) fn apply(&mut self, m: FreeMsg) {
        match m {
            FreeMsg::Free(id) => {
                if self.free_into_limbo(id) {
                    return;
                }
                self.free_now(id);
                self.after_free(id);
            }
            FreeMsg::QueueGone(queue) => self.queue_gone(QueueKey::of(Some(queue))),
            FreeMsg::Unhold(id) => self.unhold(id),
            FreeMsg::Requested(id, waits) => {
                if waits > 1 {
                    self.deferred_waits.insert(id, waits);
                }
                self.account_free_request(id);
                let (pool, size) = (self.blocks[id as usize].pool, self.blocks[id as usize].size as i64);
                self.stats.pending_begin(pool, size);
                self.claims_note_request(id, size as u64);
                let (addr, size, queue) =
                    (self.addr(id), self.blocks[id as usize].size, self.blocks[id as usize].queue);
                self.log(HistoryKind::FreeRequested, addr, size, queue);
            }
            FreeMsg::Passed(id) => {
                if let Some(left) = self.deferred_waits.get_mut(&id) {
                    *left -= 1;
                    if *left > 0 {
                        return;
                    }
                    self.deferred_waits.remove(&id);
                }
                self.claims_note_passed(id);
                if self.passed_into_limbo(id) {
                    return;
                }
                let (pool, size) = (self.blocks[id as usize].pool, self.blocks[id as usize].size as i64);
                self.stats.pending_end(pool, size);
                self.free_block(id);
                self.after_free(id);
            }
        }
    }

    /// After a free: the last block of a gone queue's segment lets the segment go.
    #[inline(always)]
    pub(super) fn after_free(&mut self, id: BlockId) {
        if !self.gone.is_empty() {
            let queue = self.blocks[id as usize].queue;
            if self.gone.contains(&queue) {
                self.release_gone(queue);
            }
        }
    }

    /// Frees a block no other queue used. The usual case takes the short way: straight into
    /// the quick cache with the fewest stat updates. A block of a page-stitched arena skips the
    /// quick cache: its view goes back to the arena at once, whose oldest-first choice is what
    /// makes a periodic workload settle (the quick cache's last-freed-first order handed the
    /// views of one size out in a rotated order every step, so the units they showed clashed
    /// anew and new views were made in every step: 130 a step on cnn_train).
    #[inline(always)]
    pub(super) fn free_now(&mut self, id: BlockId) {
        if !self.quick_free_now(id) {
            self.account_free_request(id);
            self.free_block(id);
        }
    }

    /// [`Pool::free_now`]'s short way, if the block takes it: caching on, room in the quick
    /// cache, no full history, and a block the quick cache takes (below `max_split_size`, not
    /// an arena's). False, changing nothing, otherwise.
    #[inline(always)]
    fn quick_free_now(&mut self, id: BlockId) -> bool {
        let quick_ok = self.quick_on && self.quick.len() < QUICK_MAX;
        let (max_split, misses) = (self.config.max_split_size, Block::stamp(self.misses));
        let b = &mut self.blocks[id as usize];
        if !quick_ok || b.size >= max_split || b.arena {
            return false;
        }
        debug_assert!(b.allocated && b.requested > 0 && !b.in_quick, "block {id} freed while not live");
        let (pool, size, requested, queue, split) = (b.pool, b.size, b.requested, b.queue, b.is_split());
        b.allocated = false;
        b.requested = 0;
        b.cached_at = misses;
        b.in_quick = true;
        self.stats.hot.on_quick_free(pool, size as i64, requested as i64, split);
        self.quick.push(queue, size, id, UNKNOWN);
        true
    }

    /// The allocation fast path of both APIs: a quick-cached block of exactly the rounded size
    /// freed on this queue, marked allocated for a request of `size` (raw if `raw`) and
    /// accounted. Returns its id, segment, offset and address if the quick cache knows it
    /// ([`UNKNOWN`] otherwise). `None` sends the caller to
    /// [`Pool::allocate`], which handles everything else (rounding options, bad sizes,
    /// misses) and tries the quick cache again itself.
    #[inline(always)]
    pub(crate) fn quick_alloc(
        &mut self,
        size: usize,
        queue: QueueKey,
        raw: bool,
    ) -> Option<(BlockId, u32, usize, usize)> {
        // Plain 512-byte rounding of a sane size (1 byte to 1 TiB).
        let below = size.wrapping_sub(1);
        if below >= self.plain_below {
            return None;
        }
        let rounded = (below | (MIN_BLOCK - 1)) + 1;
        let (id, addr) = self.quick.pop(queue, rounded)?;
        let b = &mut self.blocks[id as usize];
        debug_assert!(b.in_quick && !b.allocated && !b.raw && b.size == rounded);
        // Only blocks below `max_split_size` are quick-cached (`free_now`, `free_block`), so
        // there is no oversize allocation to count here.
        debug_assert!(b.size < self.config.max_split_size);
        b.in_quick = false;
        b.allocated = true;
        b.requested = size;
        b.raw = raw;
        let (pool, bsize, seg, offset, split) = (b.pool, b.size as i64, b.seg, b.offset, b.is_split());
        self.stats.hot.on_quick_alloc(pool, bsize, size as i64, split);
        // No punched pages to count here: only pooled free blocks are punched, they leave
        // their pool only through `allocate`'s slow path, which counts their pages again
        // (`back_chunks`), and the quick cache holds only blocks that were handed out.
        // (`quick_on` is off here only while the history records everything: with caching off
        // nothing is quick-cached.)
        if self.stats.any_pending() | !self.quick_on {
            self.hand_out_rare(id, queue);
        }
        Some((id, seg, offset, addr))
    }

    /// [`Pool::quick_alloc`] for a raw caller: the block's address.
    #[inline(always)]
    pub(crate) fn quick_alloc_raw(&mut self, size: usize, queue: QueueKey) -> Option<usize> {
        let (_, seg, offset, addr) = self.quick_alloc(size, queue, true)?;
        if addr != UNKNOWN {
            // Freed raw: its free knew the address (the block has not moved since).
            return Some(addr);
        }
        Some(self.segments[seg as usize].as_ref().map_or(0, |s| s.base) + offset)
    }

    /// The raw free's fast path: the live raw block at `addr`, used on no other queue, straight
    /// into the quick cache (as [`Pool::free_raw`] would put it). False, changing nothing,
    /// for anything else: the caller then takes [`Pool::free_raw`], which checks and says why.
    #[inline(always)]
    pub(crate) fn quick_free_raw(&mut self, addr: usize) -> bool {
        let id = self.raw.addrs.get_or_invalid(addr);
        let quick_ok = self.quick_on && self.quick.len() < QUICK_MAX && self.gone.is_empty() && self.held.is_empty();
        let (max_split, misses) = (self.config.max_split_size, Block::stamp(self.misses));
        // An address that starts no block gives an id past the table.
        let Some(b) = self.blocks.get_mut(id as usize) else { return false };
        // A raw block is live: `raw` is set when it is handed out and cleared when it is freed
        // (before its request is applied, so a free waiting for other queues is not raw).
        if !(quick_ok && b.raw && !b.raw_used && b.size < max_split && !b.arena) {
            return false;
        }
        debug_assert!(b.allocated && b.requested > 0, "a raw block is live");
        let (pool, size, requested, queue, split) = (b.pool, b.size, b.requested, b.queue, b.is_split());
        b.raw = false;
        b.allocated = false;
        b.requested = 0;
        b.cached_at = misses;
        b.in_quick = true;
        self.stats.hot.on_quick_free(pool, size as i64, requested as i64, split);
        self.quick.push(queue, size, id, addr);
        true
    }

    /// A free-list node for a new allocation (reused when possible).
    #[inline]
    pub(crate) fn take_node(&mut self) -> Box<Node<FreeMsg>> {
        self.nodes.pop().unwrap_or_else(|| Node::new(FreeMsg::Free(0)))
    }

    /// The caller let go: it no longer counts as allocated (it stays active until free).
    pub(super) fn account_free_request(&mut self, id: BlockId) {
        let b = &self.blocks[id as usize];
        debug_assert!(b.allocated && b.requested > 0, "block {id}: free requested while not live");
        let (pool, size, requested) = (b.pool, b.size as i64, b.requested as i64);
        self.stats.hot.on_free_request(pool, size, requested);
        if b.size >= self.config.max_split_size {
            self.stats.device.oversize_allocations.update(-1);
        }
        // A block still allocated with nothing requested is waiting for its events.
        self.blocks[id as usize].requested = 0;
    }

    /// Returns a block: into the quick cache (unmerged, for exact reuse) when caching, else
    /// into its pool, merged with free neighbours (an arena's block: back to its arena).
    pub(super) fn free_block(&mut self, id: BlockId) {
        // Make room first, while this block still counts as allocated (so the flush's merges
        // leave it alone).
        if self.quick.len() >= QUICK_MAX {
            self.flush_quick();
        }
        let (size, queue) = {
            let b = &self.blocks[id as usize];
            (b.size, b.queue)
        };
        if self.history.record_all {
            let addr = self.addr(id);
            self.log(HistoryKind::FreeCompleted, addr, size, queue);
        }
        let misses = Block::stamp(self.misses);
        let b = &mut self.blocks[id as usize];
        b.allocated = false;
        b.requested = 0;
        b.cached_at = misses;
        if !self.config.no_caching && size < self.config.max_split_size && !self.is_arena(id) {
            self.quick_insert(id);
            return;
        }
        self.pool_free(id);
    }

    pub(super) fn quick_insert(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        b.in_quick = true;
        self.quick.push(b.queue, b.size, id, UNKNOWN);
        self.account_inactive(id, true);
    }

    /// Takes a block out of the quick cache's accounting (it was popped from its list).
    #[inline(always)]
    pub(super) fn quick_leave(&mut self, id: BlockId) {
        self.blocks[id as usize].in_quick = false;
        self.account_inactive(id, false);
    }

    #[inline(always)]
    pub(super) fn quick_take(&mut self, queue: QueueKey, size: usize) -> Option<BlockId> {
        let (id, _) = self.quick.pop(queue, size)?;
        self.quick_leave(id);
        Some(id)
    }

    /// Moves every quick-cached block into its pool, merging neighbours.
    pub(crate) fn flush_quick(&mut self) {
        if self.quick.len() == 0 {
            return;
        }
        let mut ids = std::mem::take(&mut self.quick_scratch);
        self.quick.take_all_into(&mut ids);
        // One at a time: a neighbour still marked quick is not merged until its own turn.
        for &id in &ids {
            self.quick_leave(id);
            self.pool_free(id);
        }
        self.quick_scratch = ids;
    }

    /// Puts a free block into its pool, merged with its free (pooled) neighbours.
    pub(super) fn pool_free(&mut self, id: BlockId) {
        if self.is_arena(id) {
            self.arena_release(id);
            return;
        }
        if let Some(p) = self.blocks[id as usize].prev.filter(|&p| self.blocks[p as usize].is_pooled_free()) {
            self.merge(id, p);
        }
        if let Some(n) = self.blocks[id as usize].next.filter(|&n| self.blocks[n as usize].is_pooled_free()) {
            self.merge(id, n);
        }
        self.pool_insert(id);
        if self.config.no_caching && !self.blocks[id as usize].is_split() && !self.is_expandable(id) {
            let _ = self.release_block(id);
        }
    }

    /// Absorbs free neighbour `other` into `id`.
    pub(super) fn merge(&mut self, id: BlockId, other: BlockId) {
        self.pool_remove(other);
        let (id_addr, other_addr) = (self.addr(id), self.addr(other));
        if other_addr < id_addr {
            // `id` now starts where `other` did.
            self.raw.addrs.remove(id_addr);
            self.raw.addrs.insert(other_addr, id);
        } else {
            self.raw.addrs.remove(other_addr);
        }
        let o = self.blocks[other as usize].clone();
        let b = &mut self.blocks[id as usize];
        if o.offset < b.offset {
            b.offset = o.offset;
            b.prev = o.prev;
            if let Some(pp) = o.prev {
                self.blocks[pp as usize].next = Some(id);
            }
        } else {
            b.next = o.next;
            if let Some(nn) = o.next {
                self.blocks[nn as usize].prev = Some(id);
            }
        }
        self.blocks[id as usize].size += o.size;
        self.free_ids.push(other);
        self.fix_tail(id);
    }
}
