//! Giving memory back: a block's segment to the source, the cached oversize blocks and every
//! cached block (the OOM ladder's rungs and `empty_cache`), seed 003's garbage collection, and
//! the segments of queues that are gone.

use super::super::block::{BlockId, PoolKind, QueueKey};
use super::super::snapshot::HistoryKind;
use super::super::stats;
use super::{Key, Pool};
use crate::queue::{Queue, QueueHandle};

impl Pool {
    /// Notes `queue` as one that blocks are bound to (called on the slow path: a queue's first
    /// allocation always takes it).
    /// Returns true the first time.
    pub(crate) fn register_queue(&mut self, queue: &Queue) -> bool {
        let mut new = false;
        self.queues.entry(QueueKey::of(Some(queue.id()))).or_insert_with(|| {
            new = true;
            queue.handle()
        });
        new
    }

    /// The queue `queue` is gone (dropped, its work finished): nothing can allocate on it
    /// again, so its segments go back to the source as soon as all their blocks are free (now,
    /// or when the last of them is freed), and its handle and quick-cache table are dropped.
    pub(super) fn queue_gone(&mut self, queue: QueueKey) {
        self.queues.remove(&queue);
        self.gone.insert(queue);
        self.release_gone(queue);
    }

    /// Releases every segment of the gone queue `queue` whose blocks are all free; forgets
    /// the queue once none is left.
    pub(super) fn release_gone(&mut self, queue: QueueKey) {
        self.flush_quick();
        self.quick.forget_queue(queue);
        let segs: Vec<u32> = (0..self.segments.len() as u32)
            .filter(|&i| self.segments[i as usize].as_ref().is_some_and(|e| e.queue == queue))
            .collect();
        let mut left = false;
        for si in segs {
            left |= !self.release_segment_if_free(si);
        }
        if !left {
            self.gone.remove(&queue);
            for p in &mut self.pools {
                p.forget_queue(queue);
            }
        }
    }

    /// Returns segment `si` to the source if none of its blocks is in use (after a flush of the
    /// quick cache, free blocks are merged, so that is one free block, or none for an
    /// expandable segment that never grew). Returns whether it went.
    pub(super) fn release_segment_if_free(&mut self, si: u32) -> bool {
        let Some(e) = self.segments[si as usize].as_ref() else { return true };
        if e.arena.is_some() {
            return self.release_arena_if_free(si);
        }
        let (base, size, expandable) = (e.base, e.size, e.exp.is_some());
        let first = self.raw.addrs.get(base).filter(|&id| self.blocks[id as usize].seg == si);
        if !expandable {
            return first.is_some_and(|id| {
                let b = &self.blocks[id as usize];
                b.is_pooled_free() && !b.is_split() && self.release_block(id)
            });
        }
        if size > 0 {
            let whole = first.filter(|&id| {
                let b = &self.blocks[id as usize];
                b.is_pooled_free() && b.next.is_none()
            });
            let Some(id) = whole else { return false };
            self.pool_remove(id);
            self.raw.addrs.remove(base);
            self.free_ids.push(id);
        }
        let e = self.segments[si as usize].take().expect("checked live above");
        let backed = e.exp.as_ref().expect("expandable").backed_bytes(e.size);
        self.stats.device.num_device_free += 1;
        stats::dec_array(&mut self.stats.device.segment, e.pool, 1);
        stats::dec_array(&mut self.stats.device.reserved_bytes, e.pool, backed as i64);
        self.expandable.remove(&(e.queue, e.pool));
        if backed > 0 {
            self.log(HistoryKind::SegmentUnmap, e.base, backed, e.queue);
        }
        self.free_segs.push(si);
        drop(e); // unmaps the reservation and closes the memfd once no queue operation holds it
        true
    }

    /// Whether the queue `queue` has work queued or running: its freed blocks may still be
    /// read or written by it, so their pages must not be punched yet.
    pub(super) fn queue_busy(&self, queue: QueueKey) -> bool {
        queue.is_some() && self.queues.get(&queue).is_some_and(|h| !h.is_idle())
    }

    /// Whether any queue blocks are bound to has work queued or running.
    pub(super) fn any_queue_busy(&self) -> bool {
        self.queues.values().any(|h| !h.is_idle())
    }

    /// The queues blocks are bound to (for `empty_cache`, which lets them finish first).
    pub(crate) fn queue_handles(&self) -> Vec<QueueHandle> {
        self.queues.values().cloned().collect()
    }

    /// Returns a free, unsplit, pooled block's segment to the source.
    ///
    /// [`Allocation`](super::Allocation)'s reference-count-free segment pointer is sound only
    /// because a segment never goes back while one of its blocks is handed out: so this is
    /// checked here in every build, and a block that does not qualify is left alone (a bug
    /// elsewhere then leaks a segment instead of freeing memory in use).
    pub(super) fn release_block(&mut self, id: BlockId) -> bool {
        let b = &self.blocks[id as usize];
        if b.allocated || b.in_quick || b.is_split() || self.is_expandable(id) || self.is_arena(id) {
            return false;
        }
        self.pool_remove(id);
        let addr = self.addr(id);
        self.raw.addrs.remove(addr);
        let b = self.blocks[id as usize].clone();
        if let Some(entry) = self.segments[b.seg as usize].take() {
            self.stats.device.num_device_free += 1;
            stats::dec_array(&mut self.stats.device.segment, entry.pool, 1);
            stats::dec_array(&mut self.stats.device.reserved_bytes, entry.pool, entry.size as i64);
            if entry.size >= self.config.max_split_size {
                self.stats.device.oversize_segments.update(-1);
            }
            self.log(HistoryKind::SegmentFree, entry.base, entry.size, entry.queue);
            self.free_segs.push(b.seg);
            drop(entry); // unmaps and closes once no queue operation holds the segment
        }
        self.free_ids.push(id);
        true
    }

    /// Seed 003's `release_available_cached_blocks`: free cached oversize blocks, the
    /// smallest that covers the request or else the largest ones until enough is freed.
    pub(super) fn release_available_cached(&mut self, size: usize, queue: QueueKey) -> bool {
        if self.config.max_split_size == usize::MAX {
            return false;
        }
        let max_split = self.config.max_split_size;
        let want = size.max(max_split);
        let candidates: Vec<Key> = self.pools[PoolKind::Large.slot()]
            .range_of(queue, max_split)
            .into_iter()
            .filter(|k| !self.blocks[k.3 as usize].is_split() && !self.is_expandable(k.3))
            .collect();
        if let Some(k) = candidates.iter().find(|k| k.1 >= want) {
            return self.release_block(k.3);
        }
        let mut freed = 0;
        for k in candidates.iter().rev() {
            if freed >= size {
                break;
            }
            if self.release_block(k.3) {
                freed += k.1;
            }
        }
        freed >= size
    }

    /// Frees every cached unsplit block (of `queue`, or all): seed 003's
    /// `release_cached_blocks` and `empty_cache`.
    pub(crate) fn release_cached(&mut self, queue: Option<QueueKey>) {
        self.flush_quick();
        // A wholly free expandable segment goes back whole: its memfd and its reservation of
        // address space (made again, at the size the limits then allow, when next needed).
        // Queue operations still using it hold the segment until they finish.
        let idle: Vec<u32> = (0..self.segments.len() as u32)
            .filter(|&i| {
                self.segments[i as usize]
                    .as_ref()
                    .is_some_and(|e| e.exp.is_some() && queue.is_none_or(|s| e.queue == s))
            })
            .collect();
        for si in idle {
            let _ = self.release_segment_if_free(si);
        }
        self.arena_release_cached(queue, true);
        for pool in PoolKind::BOTH {
            let ids: Vec<BlockId> =
                self.pools[pool.slot()].iter().filter(|k| queue.is_none_or(|s| k.0 == s)).map(|k| k.3).collect();
            for id in ids {
                if self.is_expandable(id) {
                    // Expandable segments in use give the pages of their free parts back.
                    self.punch_free(id);
                } else if !self.blocks[id as usize].is_split() {
                    let _ = self.release_block(id);
                }
            }
        }
    }

    /// Seed 003's garbage collection: above `threshold` of the allowed memory, free cached
    /// unsplit blocks at least as old as the average, oldest first, until below it.
    pub(super) fn garbage_collect(&mut self) {
        let target = (self.config.garbage_collection_threshold * self.allowed as f64) as i64;
        if self.stats.device.reserved_bytes[stats::AGGREGATE].current <= target {
            return;
        }
        self.flush_quick();
        // Arenas hold no old blocks, only free units: their pages go back first (the cached
        // views stay).
        self.arena_release_cached(None, false);
        // As seed 003: free blocks at least as old as the average age, oldest first, and
        // repeat with the average of what is left until under the target or nothing is left.
        loop {
            let mut aged: Vec<(u64, BlockId)> = self
                .pools
                .iter()
                .flat_map(|p| p.iter())
                .map(|k| k.3)
                .filter(|&id| !self.blocks[id as usize].is_split() || self.is_expandable(id))
                .map(|id| (self.blocks[id as usize].age(self.misses), id))
                .collect();
            if aged.is_empty() {
                return;
            }
            let avg = aged.iter().map(|a| a.0).sum::<u64>() / aged.len() as u64;
            aged.sort_unstable_by_key(|a| std::cmp::Reverse(a.0)); // oldest first
            let before = self.stats.device.reserved_bytes[stats::AGGREGATE].current;
            for (age, id) in aged {
                if self.stats.device.reserved_bytes[stats::AGGREGATE].current <= target {
                    return;
                }
                if age < avg {
                    break;
                }
                if self.is_expandable(id) {
                    self.punch_free(id);
                } else {
                    let _ = self.release_block(id);
                }
            }
            if self.stats.device.reserved_bytes[stats::AGGREGATE].current >= before {
                return; // nothing more to give back
            }
        }
    }
}
