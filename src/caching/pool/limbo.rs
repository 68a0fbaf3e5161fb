//! Limbo: blocks shared with other processes ([`crate::ipc`]). While another process holds a
//! block, a free of it here does not return it: it waits in limbo (counted as a pending free,
//! so `active` still counts it, and in `limbo_bytes`), and `empty_cache` cannot take it, until
//! the last hold goes (PyTorch's rule for CUDA IPC: the producer's allocator never reuses
//! memory a consumer may still read).

use super::super::block::BlockId;
use super::super::snapshot::HistoryKind;
use super::Pool;

/// The holds on one shared block.
#[derive(Debug, Default)]
pub(crate) struct Held {
    /// Holds not yet released.
    count: u32,
    /// Its free came while held: it waits for the last release.
    limbo: bool,
}

/// Why a second free of a block in limbo is refused.
pub(crate) const LIMBO_FREE: &str =
    "already freed (and shared with another process that still holds it: it waits in limbo until released)";

/// Why a block cannot be held.
pub(crate) const NOT_LIVE: &str = "not a live allocation (freed, or its free is waiting)";

impl Pool {
    /// Adds a hold on live block `id`; refused if the block is not live.
    pub(crate) fn hold(&mut self, id: BlockId) -> Result<(), &'static str> {
        let b = self.blocks.get(id as usize).ok_or(NOT_LIVE)?;
        if !(b.allocated && b.requested > 0) {
            return Err(NOT_LIVE);
        }
        let h = self.held.entry(id).or_default();
        h.count = h.count.checked_add(1).ok_or("held by more than 2^32 - 1 imports at once")?;
        Ok(())
    }

    /// Releases one hold on block `id` ([`Pool::hold`]). The last release of a block in limbo
    /// completes its free.
    pub(crate) fn unhold(&mut self, id: BlockId) {
        let Some(h) = self.held.get_mut(&id) else {
            debug_assert!(false, "unhold of block {id}, which has no hold");
            return;
        };
        h.count -= 1;
        if h.count > 0 {
            return;
        }
        let limbo = h.limbo;
        self.held.remove(&id);
        if limbo {
            let (pool, size) = (self.blocks[id as usize].pool, self.blocks[id as usize].size as i64);
            self.stats.pending_end(pool, size);
            self.stats.device.limbo_bytes.dec(size);
            self.free_block(id);
            self.after_free(id);
        }
    }

    /// Live block `id`'s segment and requested bytes (`None` if it is not live).
    pub(crate) fn live_block(&self, id: BlockId) -> Option<(std::sync::Arc<crate::segment::Segment>, usize)> {
        let b = self.blocks.get(id as usize)?;
        if !(b.allocated && b.requested > 0) {
            return None;
        }
        let e = self.segments[b.seg as usize].as_ref()?;
        Some((std::sync::Arc::clone(&e.seg), b.requested))
    }

    /// The live raw allocation at `addr` (its start).
    pub(crate) fn live_raw_id(&self, addr: usize) -> Result<BlockId, &'static str> {
        self.raw.live_raw_at(addr, &self.blocks)
    }

    /// Whether block `id` is held by another process.
    #[inline]
    pub(crate) fn is_held(&self, id: BlockId) -> bool {
        !self.held.is_empty() && self.held.contains_key(&id)
    }

    /// A free of block `id` came (its request not accounted yet): if the block is held, it goes
    /// into limbo instead (returns true).
    #[inline(always)]
    pub(super) fn free_into_limbo(&mut self, id: BlockId) -> bool {
        if !self.is_held(id) {
            return false;
        }
        self.account_free_request(id);
        let (pool, size) = (self.blocks[id as usize].pool, self.blocks[id as usize].size as i64);
        self.stats.pending_begin(pool, size);
        self.enter_limbo(id);
        true
    }

    /// A deferred free's last marker passed (its request accounted and counted pending): if
    /// the block is held, it stays pending, in limbo (returns true).
    #[inline(always)]
    pub(super) fn passed_into_limbo(&mut self, id: BlockId) -> bool {
        if !self.is_held(id) {
            return false;
        }
        self.enter_limbo(id);
        true
    }

    fn enter_limbo(&mut self, id: BlockId) {
        let h = self.held.get_mut(&id).expect("held");
        h.limbo = true;
        let (size, queue) = (self.blocks[id as usize].size, self.blocks[id as usize].queue);
        self.stats.device.limbo_bytes.inc(size as i64);
        let addr = self.addr(id);
        self.log(HistoryKind::FreeRequested, addr, size, queue);
    }

    /// Whether block `id` waits in limbo (freed here, still held elsewhere).
    pub(crate) fn in_limbo(&self, id: BlockId) -> bool {
        self.held.get(&id).is_some_and(|h| h.limbo)
    }

    /// The limbo's invariants: every held block is allocated, and `limbo_bytes` is the size of
    /// those freed meanwhile.
    pub(super) fn check_limbo(&self) -> Result<(), String> {
        let mut bytes = 0i64;
        for (&id, h) in &self.held {
            let b = &self.blocks[id as usize];
            if !b.allocated || h.count == 0 {
                return Err(format!("held block {id} is free or has no hold ({h:?})"));
            }
            if h.limbo && b.requested != 0 {
                return Err(format!("held block {id} is in limbo with {} bytes requested", b.requested));
            }
            if h.limbo {
                bytes += b.size as i64;
            }
        }
        let have = self.stats.device.limbo_bytes.current;
        if have != bytes {
            return Err(format!("limbo bytes: stats say {have}, the held blocks {bytes}"));
        }
        Ok(())
    }
}
