//! The pool: the allocator's state, guarded by its lock (segments, blocks, the two pools, the
//! quick cache, stats, history), with seed 003's best fit, split and OOM ladder here. Its
//! other steps are in `pool/`: the free path and merging (`free_path.rs`), the pool's side of
//! expandable segments (`growth.rs`), releasing memory and GC (`release.rs`), the raw API's
//! entry points (`raw_calls.rs`) and `check_invariants` (`invariants.rs`). The blocks, the
//! expandable segments' state, the raw table, the stats and the snapshot types live beside it
//! in `caching/` and import nothing from it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::arena::Arena;
use super::block::{
    Block, BlockId, FreeMsg, LARGE_BUFFER, MIN_BLOCK, MIN_LARGE_ALLOC, PoolKind, QueueKey, ROUND_LARGE, SMALL_BUFFER,
    SMALL_SIZE, SegRef,
};
use super::config::Config;
use super::expandable::{CHUNK, ExpState};
use super::free_list::Node;
use super::quick::{FxBuild, Quick};
use super::raw::RawTable;
use super::record::Spares;
use super::snapshot::{BlockSnapshot, BlockState, History, HistoryEvent, HistoryKind, Snapshot};
use super::stats::{self, DeviceStats, PoolStats};
use crate::error::{Error, Result};
use crate::queue::QueueHandle;
use crate::segment::Segment;
use crate::source::MemorySource;

mod claims;
mod free_path;
mod free_set;
mod growth;
mod invariants;
mod limbo;
pub(crate) use limbo::NOT_LIVE;
mod raw_calls;
mod release;
mod stitched;
#[cfg(test)]
mod tests;

/// A segment the pool holds: the segment itself, where it is mapped, its pool and queue.
struct SegEntry {
    seg: Arc<Segment>,
    /// Its mapping's address (0 if it has none).
    base: usize,
    /// Bytes of the segment (for an expandable segment: bytes mapped so far).
    size: usize,
    pool: PoolKind,
    /// The queue it is bound to (`QueueId::get`; 0: none).
    queue: QueueKey,
    /// Set for expandable segments.
    exp: Option<ExpState>,
    /// Set for page-stitched arenas.
    arena: Option<Arena>,
}

/// A free block's key in its pool: best fit is the first key at or after
/// `(queue, size, 0, 0)`.
use free_set::{FreeSet, Key};

/// What an allocation attempt came to.
pub(crate) enum Outcome {
    /// A block.
    Got(Handed),
    /// Only deferred frees could help: wait for them without the lock, then try again.
    WaitForPending,
    /// Nothing could help but work in flight: on the queues blocks are bound to (under which
    /// no cached memory is given back), and the deferred frees outstanding. The caller waits
    /// for the queues (as `cudaFree` synchronizes the device before PyTorch's last rung), then
    /// claims room for the request ([`Pool::claim`]: other allocations are admitted only if
    /// they leave it) and waits for the deferred frees outstanding then, without the lock,
    /// then tries once more with [`Tried::last_wait`] and withdraws the claim.
    LastWait,
    /// The final attempt after [`Outcome::LastWait`] failed, and deferred frees requested
    /// since the claim was made (by allocations admitted meanwhile) are outstanding: the
    /// caller makes its claim exclusive ([`Pool::keep_others_out`]), waits for every deferred
    /// free outstanding, and makes its final attempt (`pool/claims.rs`). Once.
    WaitKeepingOthersOut,
}

/// What an allocation has been through before this attempt, for [`Pool::allocate`].
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Tried {
    /// Deferred frees are outstanding and the caller may still wait for them without the lock
    /// (the ladder then stops with [`Outcome::WaitForPending`] before its last rungs).
    pub(crate) pending: bool,
    /// Deferred frees are outstanding (whether or not the caller may still wait for them).
    pub(crate) outstanding: bool,
    /// The caller waited before (a later pass of the ladder: the miss and the retry are not
    /// counted again, nor garbage collected).
    pub(crate) waited: bool,
    /// The caller has been through [`Outcome::LastWait`]: the ladder's answer is final
    /// (unless [`Tried::may_keep_others_out`]).
    pub(crate) last_wait: bool,
    /// The caller holds a claim it has not made exclusive, and the queues did not get stuck:
    /// a final attempt that finds the claim's memory held back by deferred frees requested
    /// since stops with [`Outcome::WaitKeepingOthersOut`].
    pub(crate) may_keep_others_out: bool,
}

impl Tried {
    /// A first attempt with nothing to wait for: the ladder's answer is final.
    #[cfg(test)]
    pub(crate) const FINAL: Tried =
        Tried { pending: false, outstanding: false, waited: false, last_wait: true, may_keep_others_out: false };
}

/// A block handed to the allocator's caller.
pub(crate) struct Handed {
    pub(crate) id: BlockId,
    pub(crate) segment: SegRef,
    pub(crate) offset: usize,
}

/// One request on its way through [`Pool::allocate`] (PyTorch's `AllocParams`): what it asks
/// for, what the ladder's steps found, and why they failed.
struct AllocParams {
    /// Bytes asked for.
    size: usize,
    /// The block size it needs.
    rounded: usize,
    /// The classic segment a miss asks the source for.
    alloc_size: usize,
    pool: PoolKind,
    queue: QueueKey,
    /// Deferred frees were outstanding when the caller took the lock, and it may still wait
    /// for them (its pending-wait limit has not passed).
    pending: bool,
    /// The caller waited for them before: a later pass of the ladder (the miss and the retry
    /// were counted by the first).
    waited: bool,
    /// The block found.
    block: Option<BlockId>,
    /// `block` is handed out as it is: an exact fit from the quick cache, or an arena view just
    /// made for the request.
    exact: bool,
    /// The ladder stopped for the caller to wait for the deferred frees.
    wait: bool,
    /// Served by the queue's page-stitched arena ([`Pool::uses_arena`]).
    arena: bool,
    /// The arena refused for lack of allowed memory (not because it cannot hold the request).
    arena_over_allowed: bool,
    /// No segment within the allowed memory can hold the request (rung 0): nothing can help.
    beyond_allowed: bool,
    /// Why the steps failed, for the out-of-memory message.
    cause: String,
}

impl AllocParams {
    fn new(size: usize, rounded: usize, alloc_size: usize, queue: QueueKey, pending: bool, waited: bool) -> Self {
        let pool = PoolKind::for_size(rounded);
        Self {
            size,
            rounded,
            alloc_size,
            pool,
            queue,
            pending,
            waited,
            block: None,
            exact: false,
            wait: false,
            arena: false,
            arena_over_allowed: false,
            beyond_allowed: false,
            cause: String::new(),
        }
    }
}

pub(crate) struct Pool {
    source: Box<dyn MemorySource>,
    config: Config,
    capacity: u64,
    allowed: u64,
    blocks: Vec<Block>,
    free_ids: Vec<BlockId>,
    segments: Vec<Option<SegEntry>>,
    free_segs: Vec<u32>,
    /// The free blocks of each pool (`PoolKind::slot`).
    pools: [FreeSet; 2],
    /// The stats, kept in the parts the hot path moves cheaply (see [`PoolStats`]).
    stats: PoolStats,
    /// Allocation misses so far (the GC clock).
    misses: u64,
    history: History,
    /// Free-list nodes kept for reuse, so the hot path does not allocate.
    #[allow(
        clippy::vec_box,
        reason = "the nodes travel through the lock-free list as boxes; keeping them boxed is the point"
    )]
    nodes: Vec<Box<Node<FreeMsg>>>,
    /// Records of dropped `Allocation`s kept for the next ones, each with its strong count of
    /// the allocator's shared state (`record.rs`).
    pub(crate) spares: Spares,
    /// The quick cache takes frees: caching is on and the history does not record every event
    /// (kept with `config.no_caching` and `history.record_all`, one test on the hot path).
    quick_on: bool,
    /// The fast paths' size test: `size - 1` below this is rounded plainly to 512 bytes (1 TiB
    /// without `roundup_power2_divisions`, 0 with them, which the slow path applies).
    plain_below: usize,
    /// Requests at the OOM ladder's last wait, and what other allocations must leave them
    /// (`pool/claims.rs`).
    claims: claims::Claims,
    /// Deferred frees waiting for more than one marker: the markers still to pass.
    deferred_waits: HashMap<BlockId, u32>,
    /// The queues blocks were allocated on, to tell whether one still has work in flight.
    queues: HashMap<QueueKey, QueueHandle, FxBuild>,
    /// Every block of every live segment by address, and the queues that used raw blocks:
    /// raw frees, `record_queue_raw` and ranges look their pointers up here.
    raw: RawTable,
    /// Freed blocks kept unmerged for exact reuse, by (queue, size): the fast path for
    /// periodic workloads. Flushed into the pools (with merging) on a miss.
    quick: Quick,
    /// Scratch for flushing the quick cache without allocating.
    quick_scratch: Vec<BlockId>,
    /// The expandable segment of each (queue, pool).
    expandable: HashMap<(QueueKey, PoolKind), u32>,
    /// The source cannot make expandable segments: classic segments are used instead.
    expandable_unsupported: bool,
    /// The page-stitched arena of each queue.
    arenas: HashMap<QueueKey, u32, FxBuild>,
    /// No arena can be made (the source or the address space refused): pools serve all.
    arena_unsupported: bool,
    /// Some request of an arena's sizes was served by the pools instead (its arena could not
    /// hold it): blocks of those sizes may then be in the quick cache too.
    arena_fell_back: bool,
    /// The latest failure of the source during the current request that was not a lack of
    /// memory (fd limit, permission, I/O): reported as itself, not as out-of-memory.
    source_error: Option<Error>,
    /// Queues that are gone but still have segments with blocks in use.
    gone: std::collections::HashSet<QueueKey>,
    /// Blocks shared with other processes ([`crate::ipc`]): their holds, and whether their
    /// free came meanwhile (limbo: see `limbo.rs`).
    held: HashMap<BlockId, limbo::Held>,
}

/// How many freed blocks the quick cache holds before it is flushed into the pools.
const QUICK_MAX: usize = 1024;

impl Pool {
    pub(crate) fn new(source: Box<dyn MemorySource>, config: Config, capacity: u64) -> Self {
        let quick_on = !config.no_caching;
        let plain_below = if config.roundup_power2_divisions.is_empty() { 1 << 40 } else { 0 };
        let allowed = (capacity as f64 * config.per_process_memory_fraction) as u64;
        let stats = PoolStats::new(config.max_split_size as u64);
        Self {
            source,
            config,
            capacity,
            allowed,
            blocks: Vec::new(),
            free_ids: Vec::new(),
            segments: Vec::new(),
            free_segs: Vec::new(),
            pools: Default::default(),
            stats,
            misses: 0,
            history: History::new(),
            nodes: Vec::new(),
            spares: Spares::default(),
            quick_on,
            plain_below,
            claims: claims::Claims::default(),
            deferred_waits: HashMap::new(),
            held: HashMap::new(),
            queues: HashMap::default(),
            raw: RawTable::default(),
            quick: Quick::default(),
            quick_scratch: Vec::new(),
            expandable: HashMap::new(),
            expandable_unsupported: false,
            arenas: HashMap::default(),
            arena_unsupported: false,
            arena_fell_back: false,
            source_error: None,
            gone: Default::default(),
        }
    }

    /// The stats (see [`PoolStats::derive`]).
    pub(crate) fn stats(&self) -> DeviceStats {
        self.stats.derive()
    }

    /// Zeroes the accumulated counters.
    pub(crate) fn reset_accumulated(&mut self) {
        self.stats.reset_accumulated();
    }

    /// Sets every peak to its current value.
    pub(crate) fn reset_peak(&mut self) {
        self.stats.reset_peak();
    }

    pub(crate) fn capacity(&self) -> u64 {
        self.capacity
    }

    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    pub(crate) fn set_fraction(&mut self, fraction: f64) {
        self.config.per_process_memory_fraction = fraction;
        self.allowed = (self.capacity as f64 * fraction) as u64;
    }

    pub(crate) fn history(&self) -> Vec<HistoryEvent> {
        self.history.events()
    }

    pub(crate) fn set_record_all(&mut self, on: bool) {
        self.history.record_all = on;
        self.quick_on = !self.config.no_caching && !on;
    }

    fn log(&mut self, kind: HistoryKind, addr: usize, size: usize, queue: QueueKey) {
        self.history.log(kind, addr, size, queue.get());
    }

    fn addr(&self, id: BlockId) -> usize {
        let b = &self.blocks[id as usize];
        self.segments[b.seg as usize].as_ref().map_or(0, |s| s.base) + b.offset
    }

    fn key(&self, id: BlockId) -> Key {
        let b = &self.blocks[id as usize];
        (b.queue, b.size, self.addr(id), id)
    }

    // ---- rounding and pool choice (seed 003) ----

    /// Rounds a request: 512-byte minimum and granularity, or a power-of-two division.
    pub(crate) fn round_size(&self, size: usize) -> Option<usize> {
        if size < MIN_BLOCK {
            return Some(MIN_BLOCK);
        }
        let divisions = self.config.divisions_for(size);
        if divisions > 0 && MIN_BLOCK.checked_mul(divisions).is_some_and(|m| size > m) {
            // Round up to the next of `divisions` equal steps between two powers of two.
            let floor = 1usize << (usize::BITS - 1 - size.leading_zeros());
            if floor == size {
                return Some(size);
            }
            let step = (floor / divisions).max(MIN_BLOCK);
            return size.checked_next_multiple_of(step);
        }
        size.checked_next_multiple_of(MIN_BLOCK)
    }

    fn allocation_size(&self, size: usize) -> Option<usize> {
        if self.config.no_caching {
            return size.checked_next_multiple_of(crate::source::page_size());
        }
        if size <= SMALL_SIZE {
            Some(SMALL_BUFFER)
        } else if size < MIN_LARGE_ALLOC {
            Some(LARGE_BUFFER)
        } else {
            size.checked_next_multiple_of(ROUND_LARGE)
        }
    }

    // ---- pool membership, keeping inactive_split stats ----

    /// A free block starts (`entering`) or stops counting as inactive split memory.
    #[inline(always)]
    fn account_inactive(&mut self, id: BlockId, entering: bool) {
        let b = &self.blocks[id as usize];
        if !b.is_split() {
            return;
        }
        let (pool, size) = (b.pool, b.size as i64);
        self.stats.hot.inactive(pool, size, entering);
    }

    fn pool_insert(&mut self, id: BlockId) {
        let key = self.key(id);
        self.pools[self.blocks[id as usize].pool.slot()].insert(key);
        self.account_inactive(id, true);
    }

    fn pool_remove(&mut self, id: BlockId) {
        let key = self.key(id);
        let removed = self.pools[self.blocks[id as usize].pool.slot()].remove(&key);
        debug_assert!(removed, "block {id} was not in its pool");
        self.account_inactive(id, false);
    }

    /// Files a new free block (not yet in a pool): `[offset, offset + size)` of segment `seg`,
    /// bound to `queue`, between `prev` and `next`.
    fn new_block(
        &mut self,
        seg: u32,
        (offset, size): (usize, usize),
        queue: QueueKey,
        pool: PoolKind,
        prev: Option<BlockId>,
        next: Option<BlockId>,
    ) -> BlockId {
        let b = Block {
            seg,
            offset,
            size,
            requested: 0,
            queue,
            allocated: false,
            prev,
            next,
            pool,
            cached_at: Block::stamp(self.misses),
            in_quick: false,
            raw: false,
            raw_used: false,
            arena: false,
        };
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.blocks[id as usize] = b;
                id
            }
            None => {
                self.blocks.push(b);
                (self.blocks.len() - 1) as BlockId
            }
        };
        let addr = self.addr(id);
        self.raw.addrs.insert(addr, id);
        self.quick.track(id);
        id
    }

    /// Records `id` as its expandable segment's tail if it now ends the mapped part.
    fn fix_tail(&mut self, id: BlockId) {
        let b = &self.blocks[id as usize];
        if b.next.is_none() {
            if let Some(exp) = self.segments[b.seg as usize].as_mut().and_then(|e| e.exp.as_mut()) {
                exp.tail = Some(id);
            }
        }
    }

    /// New memory for a request: a new segment, or more of the queue's expandable segment.
    fn new_memory(
        &mut self,
        alloc_size: usize,
        rounded: usize,
        pool: PoolKind,
        queue: QueueKey,
        cause: &mut String,
    ) -> Option<BlockId> {
        if self.uses_expandable() {
            let got = self.grow_expandable(rounded, pool, queue, cause);
            if got.is_some() {
                return got;
            }
            // The source cannot make expandable segments, or this one cannot grow (its
            // reservation is full, or mapping more failed): a classic segment of its own
            // serves the request, and its result is what counts.
            self.source_error = None;
        }
        self.alloc_segment(alloc_size, pool, queue, cause)
    }

    // ---- allocation (seed 003's malloc) ----

    /// Keeps a source failure that is not a lack of memory, to report instead of an OOM.
    fn note_source_error(&mut self, e: Error) {
        use crate::error::ErrorKind;
        if matches!(e.kind(), ErrorKind::ResourceLimit | ErrorKind::PermissionDenied) {
            self.source_error = Some(e);
        }
    }

    /// The allocation fast path: a quick-cached block of exactly the rounded size on this
    /// queue (see [`Pool::quick_alloc`]).
    #[inline(always)]
    pub(crate) fn try_quick(&mut self, size: usize, queue: QueueKey) -> Option<Handed> {
        let (id, seg, offset, _) = self.quick_alloc(size, queue, false)?;
        let segment = SegRef::new(&self.segments[seg as usize].as_ref().expect("live segment").seg);
        Some(Handed { id, segment, offset })
    }

    /// Seed 003's malloc, read as PyTorch's `malloc` reads: after the quick cache (an exact fit
    /// freed on this queue), best fit among the cached blocks, and on a miss the OOM ladder
    /// ([`Pool::ladder`]). With deferred frees outstanding ([`Tried::pending`]), the ladder
    /// stops with [`Outcome::WaitForPending`] so the caller can wait for one to complete
    /// without holding the lock, then call again with `waited` (and without `pending` once
    /// that wait is over, for the rest of the ladder).
    /// A request the ladder cannot serve while a queue has work in flight or deferred frees
    /// are outstanding stops with [`Outcome::LastWait`], unless the caller has been through it.
    pub(crate) fn allocate(&mut self, size: usize, queue: QueueKey, tried: Tried) -> Result<Outcome> {
        if size == 0 {
            return Err(Error::ZeroLength);
        }
        let too_large = || Error::TooLarge {
            requested: size as u64,
            limit: isize::MAX as u64,
            what: "address space",
            source_name: "caching allocator".into(),
        };
        let rounded = self.round_size(size).filter(|&r| r <= isize::MAX as usize).ok_or_else(too_large)?;
        self.source_error = None;
        // Arena blocks keep PyTorch's pool for their stats (small up to 1 MiB); the arena's
        // memory counts as the large pool's. They never enter the quick cache (blocks of their
        // sizes do only where the arena could not hold one).
        let arena = self.uses_arena(rounded);
        // The fast path: a block of exactly this size freed on this queue.
        if (!arena || self.arena_fell_back)
            && let Some(id) = self.quick_take(queue, rounded)
        {
            return Ok(Outcome::Got(self.hand_out(id, size, queue)));
        }
        let alloc_size = self.allocation_size(rounded).ok_or_else(too_large)?;
        let mut p = AllocParams::new(size, rounded, alloc_size, queue, tried.pending, tried.waited);
        p.arena = arena;
        // A cached block whose punched pages cannot be taken again goes through the ladder,
        // which may release enough elsewhere (or wait for frees) to take it after all; a
        // block the ladder finds is checked the same way (each block once).
        let cached = self.get_cached_block(&mut p) && self.fits_again(&mut p);
        if !cached && self.ladder(&mut p) && !p.wait && !p.exact {
            self.fits_again(&mut p);
        }
        if p.wait {
            return Ok(Outcome::WaitForPending);
        }
        if p.exact {
            let id = p.block.expect("an exact fit was found");
            return Ok(Outcome::Got(self.hand_out(id, size, queue)));
        }
        let Some(id) = p.block else {
            if !tried.last_wait
                && !p.beyond_allowed
                && (tried.outstanding || (!self.config.no_caching && self.any_queue_busy()))
            {
                return Ok(Outcome::LastWait);
            }
            if tried.last_wait
                && tried.may_keep_others_out
                && !p.beyond_allowed
                && self.newer_frees_could_serve(rounded)
            {
                return Ok(Outcome::WaitKeepingOthersOut);
            }
            return Err(self.out_of_memory(p));
        };
        self.take_from_pool(id, rounded);
        Ok(Outcome::Got(self.hand_out(id, size, queue)))
    }

    /// The OOM ladder: what a request that no cached block fits goes through, cheapest and
    /// least disruptive first, each rung tried only if the ones before it failed:
    ///
    /// 0. A request that no segment within the allowed memory can hold fails at once: nothing
    ///    released could make room for it.
    /// 1. The miss ticks the GC clock, and above `garbage_collection_threshold` of the allowed
    ///    memory seed 003's garbage collection frees old cached blocks first (both skipped on
    ///    the pass after a wait, which already did them).
    /// 2. `alloc_block`: new memory. An expandable segment grows (punching free pages elsewhere
    ///    first if the trim policy or the allowed memory asks for it), or, where the source
    ///    cannot make expandable segments or this one cannot grow, a classic segment.
    /// 3. Without caching there is nothing cached to release: the request fails. Otherwise it
    ///    counts as a retry (`num_alloc_retries`, once per request).
    /// 4. `release_available_cached_blocks`: cached oversize blocks (unsplit, at least
    ///    `max_split_size`) go back, and `alloc_block` again.
    /// 5. Deferred frees outstanding: stop, so the caller waits for them outside the lock and
    ///    runs the ladder again (they may free exactly what is needed, without giving anything
    ///    back to the source).
    /// 6. A block freed meanwhile (by those frees): an exact fit in the quick cache, or best fit.
    /// 7. `release_cached_blocks`: every unsplit cached block goes back and free pages of
    ///    expandable segments are punched, then best fit again (a punched block may fit).
    /// 8. `alloc_block` once more, into the room that made.
    ///
    /// Returns whether it ended: with a block (`p.block`) or a stop to wait (`p.wait`).
    fn ladder(&mut self, p: &mut AllocParams) -> bool {
        if !self.segment_fits_allowed(p) {
            return false;
        }
        if !p.waited {
            self.count_miss_and_collect_garbage();
        }
        self.alloc_block(p)
            || (self.count_retry(p)
                && ((self.release_available_cached_blocks(p) && self.alloc_block(p))
                    || self.wait_for_pending_frees(p)
                    || self.get_freed_meanwhile(p)
                    || (self.release_cached_blocks() && self.get_free_block(p))
                    || self.alloc_block(p)))
    }

    /// Best fit among the cached blocks, merging the quick cache first if that is what it
    /// takes.
    fn get_cached_block(&mut self, p: &mut AllocParams) -> bool {
        if p.arena {
            return self.arena_cached(p);
        }
        p.block = self.find_cached(p.rounded, p.queue, p.pool);
        p.block.is_some()
    }

    /// Whether the block found can be handed out: its punched pages, backed again, must fit
    /// in the allowed memory ([`Pool::reback_fits`]). If not, forgets it and says why.
    fn fits_again(&mut self, p: &mut AllocParams) -> bool {
        let Some(id) = p.block else { return false };
        // An arena's view was checked against the allowed memory when it was chosen.
        if self.is_arena(id) || self.reback_fits(id, p.rounded) {
            return true;
        }
        p.block = None;
        p.cause = "; the pages of the cached block that fits were given back, and taking them again would exceed \
                   the allowed memory"
            .into();
        false
    }

    /// Best fit in the pool as it is.
    fn get_free_block(&mut self, p: &mut AllocParams) -> bool {
        if p.arena {
            return self.arena_cached(p);
        }
        p.block = self.best_fit(p.rounded, p.queue, p.pool);
        p.block.is_some()
    }

    /// Rung 0: whether a segment for the request could fit in the allowed memory at all.
    fn segment_fits_allowed(&mut self, p: &mut AllocParams) -> bool {
        let needs = if p.arena {
            // An arena grows by units.
            p.rounded.next_multiple_of(self.config.stitch_unit)
        } else if self.uses_expandable() {
            p.rounded.next_multiple_of(CHUNK)
        } else {
            p.alloc_size
        };
        if needs as u64 > self.allowed {
            p.cause = format!("; the request needs {needs} bytes of segment, more than the allowed memory");
            // Nothing waited for could make room: no last wait, and no claim.
            p.beyond_allowed = true;
            return false;
        }
        true
    }

    /// Rung 1: the GC clock, and seed 003's garbage collection above its threshold.
    fn count_miss_and_collect_garbage(&mut self) {
        self.misses += 1;
        if self.config.garbage_collection_threshold > 0.0 {
            self.garbage_collect();
        }
    }

    /// Rungs 2, 4 and 8: new memory for the request (see [`Pool::new_memory`]).
    fn alloc_block(&mut self, p: &mut AllocParams) -> bool {
        if p.arena {
            if self.arena_new(p) {
                return true;
            }
            if p.arena_over_allowed {
                // Other segments would need the same memory: the ladder goes on.
                return false;
            }
            // No arena, or it cannot hold this request (its memfd or address space is full,
            // a mapping failed): the pools serve it.
            p.arena = false;
            self.arena_fell_back = true;
        }
        p.block = self.new_memory(p.alloc_size, p.rounded, p.pool, p.queue, &mut p.cause);
        p.block.is_some()
    }

    /// Rung 3: whether the request may retry after releasing cached memory (not without
    /// caching); counts the retry.
    fn count_retry(&mut self, p: &AllocParams) -> bool {
        if self.config.no_caching {
            return false;
        }
        if !p.waited {
            self.stats.device.num_alloc_retries += 1;
        }
        true
    }

    /// Rung 4: seed 003's `release_available_cached_blocks`.
    fn release_available_cached_blocks(&mut self, p: &AllocParams) -> bool {
        self.release_available_cached(p.rounded, p.queue)
    }

    /// Rung 5: stops the ladder so the caller can wait for deferred frees (for the next one
    /// to complete, then the ladder again, until its limit: `CachingAllocator::allocate_slow`).
    fn wait_for_pending_frees(&mut self, p: &mut AllocParams) -> bool {
        p.wait = p.pending;
        p.wait
    }

    /// Rung 6: a block freed since the first look: an exact fit in the quick cache (handed out
    /// as it is), or best fit after merging.
    fn get_freed_meanwhile(&mut self, p: &mut AllocParams) -> bool {
        if let Some(id) = self.quick_take(p.queue, p.rounded) {
            (p.block, p.exact) = (Some(id), true);
            return true;
        }
        self.get_cached_block(p)
    }

    /// Rung 7: seed 003's `release_cached_blocks` (every queue's).
    fn release_cached_blocks(&mut self) -> bool {
        self.release_cached(None);
        true
    }

    /// The error for a request the ladder could not serve: the source's own failure if it
    /// failed for another reason than a lack of memory (after the ladder, which released
    /// cached segments and their fds too), else an out-of-memory error that says why.
    fn out_of_memory(&mut self, p: AllocParams) -> Error {
        if let Some(e) = self.source_error.take() {
            return e;
        }
        self.stats.device.num_ooms += 1;
        let reserved = self.stats.device.reserved_bytes[stats::AGGREGATE].current as u64;
        // As PyTorch's trace, an OOM entry's address is the memory still free.
        self.log(HistoryKind::Oom, self.allowed.saturating_sub(reserved) as usize, p.size, p.queue);
        let largest = self.pools.iter().flat_map(|p| p.iter()).map(|k| k.1).max().unwrap_or(0);
        let allocated = self.stats.hot.current(stats::ALLOCATED_BYTES)[stats::AGGREGATE] as u64;
        let reserved_free = reserved.saturating_sub(allocated);
        let mut cause = p.cause;
        let pending = self.stats.pending_bytes_now();
        if pending > 0 {
            // Counted free (as PyTorch counts a block freed under `record_stream`), but still
            // used by work queued before its free: the waits for it were over.
            cause.push_str(&format!(
                "; {pending} bytes of the memory reserved but free are blocks freed while work queued on other queues \
                 still used them, and that work had not finished (deferred frees outstanding after the wait for them)"
            ));
        }
        if !self.uses_expandable() && reserved_free.saturating_sub(pending.max(0) as u64) >= p.size as u64 {
            // The ladder gave back every segment it could: what is left free shares its
            // segments with blocks in use (PyTorch's message gives the same advice).
            cause.push_str(
                "; the memory reserved but free lies in segments that also hold blocks in use (fragmentation): ",
            );
            cause.push_str(if self.config.expandable_segments {
                "`max_split_size_mb` avoids it (this memory source makes no expandable segments)"
            } else {
                "`expandable_segments:True` (the default) or `max_split_size_mb` avoids it"
            });
        }
        Error::AllocatorOom {
            requested: p.size as u64,
            capacity: self.capacity,
            allocated,
            reserved_free,
            largest_free: largest as u64,
            allowed: self.allowed,
            cause,
        }
    }

    /// Takes pooled block `id` out of its pool for a `rounded`-byte request: split if the rest
    /// is worth keeping, and its punched pages counted as reserved again.
    fn take_from_pool(&mut self, id: BlockId, rounded: usize) {
        if self.is_arena(id) {
            self.arena_take(id, rounded);
            return;
        }
        self.pool_remove(id);
        if self.should_split(id, rounded) {
            let b = self.blocks[id as usize].clone();
            let rest = self.new_block(b.seg, (b.offset + rounded, b.size - rounded), b.queue, b.pool, Some(id), b.next);
            if let Some(n) = b.next {
                self.blocks[n as usize].prev = Some(rest);
            }
            let bm = &mut self.blocks[id as usize];
            bm.next = Some(rest);
            bm.size = rounded;
            self.fix_tail(rest);
            self.pool_insert(rest);
        }
        // Pages punched while the block was cached count as reserved again.
        self.back_chunks(id);
    }

    /// A cached block for the request: best fit in the pool, after merging the quick cache if
    /// that is what it takes.
    fn find_cached(&mut self, rounded: usize, queue: QueueKey, pool: PoolKind) -> Option<BlockId> {
        if self.config.no_caching {
            return None;
        }
        let found = self.best_fit(rounded, queue, pool);
        if found.is_some() || self.quick.len() == 0 {
            return found;
        }
        // Unmerged frees may add up to a fit.
        self.flush_quick();
        self.best_fit(rounded, queue, pool)
    }

    /// Marks a block allocated for a request of `size` and accounts for it.
    #[inline(always)]
    pub(super) fn hand_out(&mut self, id: BlockId, size: usize, queue: QueueKey) -> Handed {
        let b = &mut self.blocks[id as usize];
        debug_assert!(!b.allocated && !b.in_quick, "block {id} handed out while allocated or quick-cached");
        b.allocated = true;
        b.requested = size;
        let (bsize, bpool, bseg, boff) = (b.size, b.pool, b.seg, b.offset);
        self.stats.hot.on_alloc(bpool, bsize as i64, size as i64);
        // No punched pages to count here: only pooled free blocks are punched, they leave
        // their pool only through `allocate`'s slow path, which counts their pages again
        // (`back_chunks`), and the quick cache holds only blocks that were handed out.
        if self.stats.any_pending() || bsize >= self.config.max_split_size || self.history.record_all {
            self.hand_out_rare(id, queue);
        }
        let segment = SegRef::new(&self.segments[bseg as usize].as_ref().expect("live segment").seg);
        Handed { id, segment, offset: boff }
    }

    /// What a hand-out may need besides: active peaks while frees are pending, oversize
    /// counts, history.
    #[cold]
    fn hand_out_rare(&mut self, id: BlockId, queue: QueueKey) {
        let (bsize, bpool) = (self.blocks[id as usize].size, self.blocks[id as usize].pool);
        if self.stats.any_pending() {
            self.stats.note_active_peak(bpool);
        }
        if bsize >= self.config.max_split_size {
            self.stats.device.oversize_allocations.update(1);
        }
        if self.history.record_all {
            let addr = self.addr(id);
            self.log(HistoryKind::Alloc, addr, bsize, queue);
        }
    }

    /// Best fit in `pool` for `size` on `queue`, honouring the oversize rules.
    fn best_fit(&mut self, size: usize, queue: QueueKey, pool: PoolKind) -> Option<BlockId> {
        let key = self.pools[pool.slot()].first_at_least(queue, size)?;
        let max_split = self.config.max_split_size;
        // Oversize blocks serve only oversize requests...
        if size < max_split && key.1 >= max_split {
            return None;
        }
        // ...and only those within a large buffer of their size.
        if size >= max_split && key.1 >= size.saturating_add(LARGE_BUFFER) {
            return None;
        }
        Some(key.3)
    }

    fn should_split(&self, id: BlockId, size: usize) -> bool {
        if self.config.no_caching {
            return false;
        }
        let b = &self.blocks[id as usize];
        let remaining = b.size - size;
        if b.pool == PoolKind::Small || self.is_expandable(id) {
            remaining >= MIN_BLOCK
        } else {
            size < self.config.max_split_size && remaining > SMALL_SIZE
        }
    }

    /// Gets a segment from the source, within the allowed memory; returns its single block.
    fn alloc_segment(&mut self, size: usize, pool: PoolKind, queue: QueueKey, cause: &mut String) -> Option<BlockId> {
        let reserved = self.stats.device.reserved_bytes[stats::AGGREGATE].current as u64;
        if reserved.saturating_add(size as u64) > self.allowed {
            *cause = format!(
                "; the allowed memory ({} bytes = fraction {} of capacity) would be exceeded",
                self.allowed, self.config.per_process_memory_fraction
            );
            return None;
        }
        let seg = match self.source.create_segment(size) {
            Ok(s) => s,
            Err(e) => {
                *cause = format!("; {} refused: {e}", self.source.name());
                self.note_source_error(e);
                return None;
            }
        };
        let base = seg.mapping().map_or(0, |m| m.as_ptr() as usize);
        let seg_size = seg.len();
        let seg_idx = self.add_segment(SegEntry {
            seg: Arc::new(seg),
            base,
            size: seg_size,
            pool,
            queue,
            exp: None,
            arena: None,
        });
        let id = self.new_block(seg_idx, (0, seg_size), queue, pool, None, None);
        self.pool_insert(id);
        Some(id)
    }

    /// Files a new segment (classic, or an expandable one with nothing mapped yet) and
    /// accounts for it.
    fn add_segment(&mut self, entry: SegEntry) -> u32 {
        let (base, size, pool, queue, expandable) =
            (entry.base, entry.size, entry.pool, entry.queue, entry.exp.is_some());
        let idx = match self.free_segs.pop() {
            Some(i) => {
                self.segments[i as usize] = Some(entry);
                i
            }
            None => {
                self.segments.push(Some(entry));
                (self.segments.len() - 1) as u32
            }
        };
        self.stats.device.num_device_alloc += 1;
        stats::inc_array(&mut self.stats.device.segment, pool, 1);
        stats::inc_array(&mut self.stats.device.reserved_bytes, pool, size as i64);
        if size >= self.config.max_split_size {
            self.stats.device.oversize_segments.update(1);
        }
        if !expandable {
            // An expandable segment's memory is logged as it is mapped (`SegmentMap`).
            self.log(HistoryKind::SegmentAlloc, base, size, queue);
        }
        idx
    }

    /// How a snapshot shows block `id`, given the free ones (pooled or quick-cached).
    fn block_state(&self, id: BlockId, free: &HashSet<BlockId>) -> BlockState {
        let b = &self.blocks[id as usize];
        if free.contains(&id) {
            BlockState::Free
        } else if b.allocated && b.requested == 0 {
            BlockState::PendingFree
        } else {
            BlockState::Allocated
        }
    }

    /// Segments with their blocks (see [`Snapshot`]).
    pub(crate) fn snapshot(&self) -> Snapshot {
        let free: HashSet<BlockId> =
            self.pools.iter().flat_map(|p| p.iter()).map(|k| k.3).chain(self.quick.ids()).collect();
        let dead: HashSet<BlockId> = self.free_ids.iter().copied().collect();
        // Arenas are added below, view by view.
        let segments = self.segments.iter().map(|s| {
            s.as_ref().filter(|s| s.arena.is_none()).map(|s| (s.base, s.size, s.pool, s.queue.get(), s.exp.is_some()))
        });
        let blocks =
            self.blocks.iter().enumerate().filter(|&(id, _)| !dead.contains(&(id as BlockId))).map(|(id, b)| {
                let state = self.block_state(id as BlockId, &free);
                (b.seg, BlockSnapshot { offset: b.offset, size: b.size, requested: b.requested, state })
            });
        let mut snap = Snapshot::build(segments, blocks);
        // Expandable segments as their backed runs, so that the sizes add up to the reserved
        // bytes as PyTorch's do.
        let runs: HashMap<usize, Vec<(usize, usize)>> = self
            .segments
            .iter()
            .flatten()
            .filter_map(|e| e.exp.as_ref().map(|x| (e.base, x.backed_runs(e.size))))
            .collect();
        snap.segments = std::mem::take(&mut snap.segments)
            .into_iter()
            .flat_map(|seg| match runs.get(&seg.address) {
                Some(r) => seg.split_into_runs(r),
                None => vec![seg],
            })
            .collect();
        for (si, e) in self.segments.iter().enumerate() {
            if e.as_ref().is_some_and(|e| e.arena.is_some()) {
                snap.segments.extend(self.arena_snapshot(si as u32, &free, &dead));
            }
        }
        snap.segments.sort_by_key(|s| s.address);
        snap
    }
}
