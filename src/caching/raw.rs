//! The raw-pointer table: what C callers and seed 002's raw deleter name blocks by. Every
//! block of every live segment is filed by its address ([`BlockAddrs`], below this file), and
//! the queues that used a raw block are kept here until it is freed. A raw pointer carries no
//! identity beyond its address, so every raw call is checked against the table under the
//! allocator's lock, and refused with the reason when it names no live raw allocation.

use std::collections::HashMap;

use super::addrs::BlockAddrs;
use super::block::{Block, BlockId, QueueKey};
use super::quick::FxBuild;
use crate::queue::{Queue, QueueHandle};

/// Why a free of a block already freed is refused.
pub(crate) const DOUBLE_FREE: &str = "already freed (double free)";

/// Why a free of an address inside a block (not its start) is refused.
pub(crate) const INTERIOR_FREE: &str = "not the start of a block (a pointer into an allocation)";

/// Why a free of an address in no block is refused.
pub(crate) const FOREIGN_FREE: &str = "not a pointer this allocator handed out";

/// A raw free that must wait for other queues: the block and those queues.
pub(crate) type RawDeferred = (BlockId, Vec<QueueHandle>);

#[derive(Default)]
pub(crate) struct RawTable {
    /// Every block of every live segment, by its start.
    pub(crate) addrs: BlockAddrs,
    /// The other queues that used a raw block (`Block::raw_used`).
    uses: HashMap<BlockId, Vec<QueueHandle>, FxBuild>,
}

impl RawTable {
    /// The live raw block at `addr`, or why there is none.
    #[inline(always)]
    pub(crate) fn live_raw_at(&self, addr: usize, blocks: &[Block]) -> Result<BlockId, &'static str> {
        if let Some(id) = self.addrs.get(addr) {
            let b = &blocks[id as usize];
            if b.allocated && b.raw && b.requested > 0 {
                return Ok(id);
            }
        }
        Err(self.refusal(addr, blocks))
    }

    /// Why `addr` names no live raw block.
    #[cold]
    fn refusal(&self, addr: usize, blocks: &[Block]) -> &'static str {
        let Some(id) = self.addrs.get(addr) else { return self.classify_foreign(addr, blocks) };
        let b = &blocks[id as usize];
        match (b.allocated, b.requested > 0) {
            (false, _) => DOUBLE_FREE,
            (true, false) => "already freed (its free is waiting for other queues)",
            // Allocated with a request, so not raw (a live raw block is never refused).
            (true, true) => "owned by an Allocation object, not a raw allocation: drop the Allocation instead",
        }
    }

    /// Why a pointer that starts no block is not a live allocation.
    fn classify_foreign(&self, ptr: usize, blocks: &[Block]) -> &'static str {
        if self.holding(ptr, blocks).is_some() { INTERIOR_FREE } else { FOREIGN_FREE }
    }

    /// The block that holds `addr` (live, cached or freed alike), and its start.
    pub(crate) fn holding(&self, addr: usize, blocks: &[Block]) -> Option<(usize, BlockId)> {
        self.addrs.at_or_before(addr).filter(|&(start, id)| addr - start < blocks[id as usize].size)
    }

    /// The live allocation that holds `[addr, addr + len)` wholly (frameworks that sub-allocate
    /// pass pointers into the middle of blocks). Only the bytes the caller asked for count, so
    /// a range that runs past them (into a neighbour, or into the rounding), or one in a freed
    /// block, is refused with the reason.
    pub(crate) fn live_range(&self, addr: usize, len: usize, blocks: &[Block]) -> Result<BlockId, String> {
        let end = addr.checked_add(len).ok_or_else(|| format!("a {len}-byte range from {addr:#x} wraps around"))?;
        let Some((start, id)) = self.holding(addr, blocks) else {
            return Err("not inside memory of this allocator".into());
        };
        let b = &blocks[id as usize];
        if !b.allocated || b.requested == 0 {
            return Err(format!("inside a freed block (at {start:#x}, {} bytes)", b.size));
        }
        let owned = start + b.requested;
        if end > owned {
            return Err(format!(
                "the range {addr:#x}+{len} runs {} bytes past the end of its allocation ({} bytes at {start:#x})",
                end - owned,
                b.requested
            ));
        }
        Ok(id)
    }

    /// Records that `queue` uses live raw block `id` (nothing if it is the block's own queue).
    pub(crate) fn record_use(&mut self, id: BlockId, queue: &Queue, blocks: &mut [Block]) {
        let b = &mut blocks[id as usize];
        if QueueKey::of(Some(queue.id())) == b.queue {
            return;
        }
        b.raw_used = true;
        let uses = self.uses.entry(id).or_default();
        if !uses.iter().any(|h| h.id() == queue.id()) {
            uses.push(queue.handle());
        }
    }

    /// Live raw block `id` is being freed: it stops being raw. Returns whether other queues
    /// used it (its free then waits for them: see [`RawTable::take_uses`]).
    #[inline(always)]
    pub(crate) fn release(&mut self, id: BlockId, blocks: &mut [Block]) -> bool {
        let b = &mut blocks[id as usize];
        b.raw = false;
        if !b.raw_used {
            return false;
        }
        b.raw_used = false;
        true
    }

    /// The other queues that used a raw block just released.
    #[cold]
    pub(crate) fn take_uses(&mut self, id: BlockId) -> Vec<QueueHandle> {
        self.uses.remove(&id).unwrap_or_default()
    }

    /// Checks the table against the blocks (`dead`: the ids not in use): every live block is
    /// filed at its own start (the pool checks the addresses), and every uses entry belongs to
    /// a live raw block marked as used elsewhere, and the other way round.
    pub(crate) fn check(&self, blocks: &[Block], dead: &std::collections::HashSet<BlockId>) -> Result<(), String> {
        let live = blocks.len() - dead.len();
        if self.addrs.len() != live {
            return Err(format!("the address table has {} entries for {live} blocks", self.addrs.len()));
        }
        for (&id, uses) in &self.uses {
            let b = &blocks[id as usize];
            if dead.contains(&id) || !b.raw || !b.raw_used || !b.allocated || uses.is_empty() {
                return Err(format!("raw-uses entry for block {id} that is not a raw block used elsewhere"));
            }
        }
        for (id, b) in blocks.iter().enumerate().filter(|&(id, _)| !dead.contains(&(id as BlockId))) {
            if b.raw_used && !self.uses.contains_key(&(id as BlockId)) {
                return Err(format!("raw block {id} is marked used elsewhere but has no uses entry"));
            }
            if b.raw_used && !b.raw {
                return Err(format!("block {id} is marked used elsewhere but is not raw"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caching::block::PoolKind;

    fn block(size: usize, allocated: bool, requested: usize, raw: bool) -> Block {
        Block {
            seg: 0,
            offset: 0,
            size,
            requested,
            queue: QueueKey::test(0),
            allocated,
            prev: None,
            next: None,
            pool: PoolKind::Small,
            cached_at: 0,
            in_quick: false,
            raw,
            raw_used: false,
            arena: false,
        }
    }

    /// Blocks at 0x1000 (raw, live), 0x2000 (freed), 0x3000 (an `Allocation`'s), 0x4000 (raw,
    /// its free waiting for other queues), each 4 KiB.
    fn table() -> (RawTable, Vec<Block>) {
        let blocks = vec![
            block(4096, true, 100, true),
            block(4096, false, 0, false),
            block(4096, true, 100, false),
            block(4096, true, 0, true),
        ];
        let mut t = RawTable::default();
        for i in 0..4 {
            t.addrs.insert(0x1000 * (i + 1), i as BlockId);
        }
        (t, blocks)
    }

    #[test]
    fn raw_lookups_refuse_what_is_not_a_live_raw_allocation_and_say_why() {
        let (t, blocks) = table();
        assert_eq!(t.live_raw_at(0x1000, &blocks), Ok(0));
        assert_eq!(t.live_raw_at(0x2000, &blocks), Err("already freed (double free)"));
        assert!(t.live_raw_at(0x3000, &blocks).unwrap_err().starts_with("owned by an Allocation object"));
        assert_eq!(t.live_raw_at(0x4000, &blocks), Err("already freed (its free is waiting for other queues)"));
        assert_eq!(t.live_raw_at(0x1008, &blocks), Err("not the start of a block (a pointer into an allocation)"));
        assert_eq!(t.live_raw_at(0x9000, &blocks), Err("not a pointer this allocator handed out"));
        assert_eq!(t.live_raw_at(0x800, &blocks), Err("not a pointer this allocator handed out"));
        t.check(&blocks, &Default::default()).unwrap();
    }

    #[test]
    fn ranges_must_lie_in_the_bytes_a_live_allocation_asked_for() {
        let (t, blocks) = table();
        assert_eq!(t.live_range(0x1010, 10, &blocks), Ok(0));
        assert_eq!(t.live_range(0x1000, 100, &blocks), Ok(0));
        assert!(t.live_range(0x1000, 101, &blocks).unwrap_err().contains("runs 1 bytes past the end"));
        assert!(t.live_range(0x2010, 1, &blocks).unwrap_err().starts_with("inside a freed block"));
        assert!(t.live_range(0x4010, 1, &blocks).unwrap_err().starts_with("inside a freed block"));
        assert!(t.live_range(usize::MAX, 2, &blocks).unwrap_err().contains("wraps around"));
        assert_eq!(t.live_range(0x5000, 1, &blocks), Err("not inside memory of this allocator".into()));
        assert_eq!(t.holding(0x4fff, &blocks), Some((0x4000, 3)));
        assert_eq!(t.holding(0x5000, &blocks), None);
    }

    #[test]
    #[cfg_attr(miri, ignore = "queues need io_uring")]
    fn uses_are_kept_until_the_raw_block_is_released() {
        let (mut t, mut blocks) = table();
        let (q1, q2) = (Queue::new().unwrap(), Queue::new().unwrap());
        blocks[0].queue = QueueKey::of(Some(q1.id()));
        t.record_use(0, &q1, &mut blocks);
        assert!(!blocks[0].raw_used, "its own queue is no other use");
        t.record_use(0, &q2, &mut blocks);
        t.record_use(0, &q2, &mut blocks);
        assert!(blocks[0].raw_used);
        t.check(&blocks, &Default::default()).unwrap();
        assert!(t.release(0, &mut blocks), "used elsewhere");
        let uses = t.take_uses(0);
        assert_eq!(uses.iter().map(QueueHandle::id).collect::<Vec<_>>(), [q2.id()]);
        assert!(!blocks[0].raw && !blocks[0].raw_used);
        assert!(t.uses.is_empty());
        // A stale entry is caught.
        t.uses.insert(1, vec![q2.handle()]);
        assert!(t.check(&blocks, &Default::default()).is_err());
    }
}
