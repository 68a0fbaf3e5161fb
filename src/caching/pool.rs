//! The allocator's state, guarded by its lock: segments, blocks, the two pools, stats, and
//! the history. All of seed 003's rules live here.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use super::FreeMsg;
use super::block::{
    Block, BlockId, LARGE_BUFFER, MIN_BLOCK, MIN_LARGE_ALLOC, PoolKind, ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE, SegRef,
};
use super::config::Config;
use super::expandable::{self, Budget, CHUNK, ExpState, Reservation};
use super::free_list::{FreeList, Node};
use super::quick::{FxBuild, Quick};
use super::raw::{RawDeferred, RawTable};
use super::snapshot::{BlockSnapshot, BlockState, History, HistoryEvent, HistoryKind, Snapshot};
use super::stats::{self, DeviceStats, PoolStats};
use crate::error::{Error, Result};
use crate::queue::{Queue, QueueHandle};
use crate::segment::Segment;
use crate::source::MemorySource;

struct SegEntry {
    seg: Arc<Segment>,
    base: usize,
    /// Bytes of the segment (for an expandable segment: bytes mapped so far).
    size: usize,
    pool: PoolKind,
    stream: u64,
    /// Set for expandable segments.
    exp: Option<ExpState>,
}

/// A free block's key in its pool: best fit is the first key at or after
/// `(stream, size, 0, 0)`.
type Key = (u64, usize, usize, BlockId);

/// What an allocation attempt came to.
pub(crate) enum Outcome {
    /// A block.
    Got(Handed),
    /// Only deferred frees could help: wait for them without the lock, then try again.
    WaitForPending,
}

/// A block handed to the allocator's caller.
pub(crate) struct Handed {
    pub(crate) id: BlockId,
    pub(crate) segment: SegRef,
    pub(crate) offset: usize,
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
    pools: [BTreeSet<Key>; 2],
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
    /// Scratch for draining the free list in push order.
    #[allow(clippy::vec_box, reason = "the nodes are boxes in the list and are recycled as boxes")]
    scratch: Vec<Box<Node<FreeMsg>>>,
    /// The queues blocks were allocated on, to tell whether one still has work in flight.
    queues: HashMap<u64, QueueHandle, FxBuild>,
    /// Every block of every live segment by address, and the queues that used raw blocks:
    /// raw frees, `record_queue_raw` and ranges look their pointers up here.
    raw: RawTable,
    /// Freed blocks kept unmerged for exact reuse, by (stream, size): the fast path for
    /// periodic workloads. Flushed into the pools (with merging) on a miss.
    quick: Quick,
    /// The expandable segment of each (stream, pool).
    expandable: HashMap<(u64, PoolKind), u32>,
    /// The source cannot make expandable segments: classic segments are used instead.
    expandable_unsupported: bool,
    /// The latest failure of the source during the current request that was not a lack of
    /// memory (fd limit, permission, I/O): reported as itself, not as out-of-memory.
    source_error: Option<Error>,
    /// Queues that are gone but still have segments with blocks in use.
    gone: std::collections::HashSet<u64>,
}

/// How many freed blocks the quick cache holds before it is flushed into the pools.
const QUICK_MAX: usize = 1024;

impl Pool {
    pub(crate) fn new(source: Box<dyn MemorySource>, config: Config, capacity: u64) -> Self {
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
            scratch: Vec::new(),
            queues: HashMap::default(),
            raw: RawTable::default(),
            quick: Quick::default(),
            expandable: HashMap::new(),
            expandable_unsupported: false,
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
    }

    fn log(&mut self, kind: HistoryKind, addr: usize, size: usize, stream: u64) {
        self.history.log(kind, addr, size, stream);
    }

    fn addr(&self, id: BlockId) -> usize {
        let b = &self.blocks[id as usize];
        self.segments[b.seg as usize].as_ref().map_or(0, |s| s.base) + b.offset
    }

    fn key(&self, id: BlockId) -> Key {
        let b = &self.blocks[id as usize];
        (b.stream, b.size, self.addr(id), id)
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
    /// bound to `stream`, between `prev` and `next`.
    fn new_block(
        &mut self,
        seg: u32,
        (offset, size): (usize, usize),
        stream: u64,
        pool: PoolKind,
        prev: Option<BlockId>,
        next: Option<BlockId>,
    ) -> BlockId {
        let b = Block {
            seg,
            offset,
            size,
            requested: 0,
            stream,
            allocated: false,
            prev,
            next,
            pool,
            cached_at: self.misses,
            in_quick: false,
            raw: false,
            raw_used: false,
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

    // ---- the free path, drained under the lock ----

    /// Applies every free pushed since the last drain, oldest first (the caller checks the
    /// list is not empty first, on its fast path).
    #[inline]
    pub(crate) fn drain(&mut self, frees: &FreeList<FreeMsg>) {
        let mut scratch = std::mem::take(&mut self.scratch);
        frees.drain_oldest_first(&mut scratch, |n| {
            let m = n.value;
            self.recycle(n);
            self.apply(m);
        });
        self.scratch = scratch;
    }

    fn recycle(&mut self, node: Box<Node<FreeMsg>>) {
        if self.nodes.len() < 4096 {
            self.nodes.push(node);
        }
    }

    #[inline(always)]
    fn apply(&mut self, m: FreeMsg) {
        match m {
            FreeMsg::Free(id) => {
                self.free_now(id);
                self.after_free(id);
            }
            FreeMsg::QueueGone(queue) => self.queue_gone(queue.get()),
            FreeMsg::Requested(id) => {
                self.account_free_request(id);
                let (pool, size) = (self.blocks[id as usize].pool, self.blocks[id as usize].size as i64);
                self.stats.pending_begin(pool, size);
                let (addr, size, stream) =
                    (self.addr(id), self.blocks[id as usize].size, self.blocks[id as usize].stream);
                self.log(HistoryKind::FreeRequested, addr, size, stream);
            }
            FreeMsg::Completed(id) => {
                let (pool, size) = (self.blocks[id as usize].pool, self.blocks[id as usize].size as i64);
                self.stats.pending_end(pool, size);
                self.free_block(id);
                self.after_free(id);
            }
        }
    }

    /// After a free: the last block of a gone queue's segment lets the segment go.
    #[inline(always)]
    fn after_free(&mut self, id: BlockId) {
        if !self.gone.is_empty() {
            let stream = self.blocks[id as usize].stream;
            if self.gone.contains(&stream) {
                self.release_gone(stream);
            }
        }
    }

    /// Frees a block no other queue used. The usual case takes the short way: straight into
    /// the quick cache with the fewest stat updates.
    #[inline(always)]
    fn free_now(&mut self, id: BlockId) {
        let quick_ok = !self.history.record_all && !self.config.no_caching && self.quick.len() < QUICK_MAX;
        let b = &mut self.blocks[id as usize];
        if !quick_ok || b.size >= self.config.max_split_size {
            self.account_free_request(id);
            self.free_block(id);
            return;
        }
        let (pool, size, requested, stream, split) = (b.pool, b.size, b.requested, b.stream, b.is_split());
        b.allocated = false;
        b.requested = 0;
        b.cached_at = self.misses;
        b.in_quick = true;
        self.stats.hot.on_free_request(pool, size as i64, requested as i64);
        if split {
            self.stats.hot.inactive(pool, size as i64, true);
        }
        self.quick.push(stream, size, id);
    }

    /// A free-list node for a new allocation (reused when possible).
    pub(crate) fn take_node(&mut self) -> Box<Node<FreeMsg>> {
        self.nodes.pop().unwrap_or_else(|| Node::new(FreeMsg::Free(0)))
    }

    /// The caller let go: it no longer counts as allocated (it stays active until free).
    fn account_free_request(&mut self, id: BlockId) {
        let b = &self.blocks[id as usize];
        let (pool, size, requested) = (b.pool, b.size as i64, b.requested as i64);
        self.stats.hot.on_free_request(pool, size, requested);
        if b.size >= self.config.max_split_size {
            self.stats.device.oversize_allocations.update(-1);
        }
        // A block still allocated with nothing requested is waiting for its events.
        self.blocks[id as usize].requested = 0;
    }

    /// Returns a block: into the quick cache (unmerged, for exact reuse) when caching, else
    /// into its pool, merged with free neighbours.
    fn free_block(&mut self, id: BlockId) {
        // Make room first, while this block still counts as allocated (so the flush's merges
        // leave it alone).
        if self.quick.len() >= QUICK_MAX {
            self.flush_quick();
        }
        let (size, stream) = {
            let b = &self.blocks[id as usize];
            (b.size, b.stream)
        };
        if self.history.record_all {
            let addr = self.addr(id);
            self.log(HistoryKind::FreeCompleted, addr, size, stream);
        }
        let misses = self.misses;
        let b = &mut self.blocks[id as usize];
        b.allocated = false;
        b.requested = 0;
        b.cached_at = misses;
        if !self.config.no_caching && size < self.config.max_split_size {
            self.quick_insert(id);
            return;
        }
        self.pool_free(id);
    }

    fn quick_insert(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        b.in_quick = true;
        self.quick.push(b.stream, b.size, id);
        self.account_inactive(id, true);
    }

    /// Takes a block out of the quick cache's accounting (it was popped from its list).
    #[inline(always)]
    fn quick_leave(&mut self, id: BlockId) {
        self.blocks[id as usize].in_quick = false;
        self.account_inactive(id, false);
    }

    #[inline(always)]
    fn quick_take(&mut self, stream: u64, size: usize) -> Option<BlockId> {
        let id = self.quick.pop(stream, size)?;
        self.quick_leave(id);
        Some(id)
    }

    /// Moves every quick-cached block into its pool, merging neighbours.
    pub(crate) fn flush_quick(&mut self) {
        if self.quick.len() == 0 {
            return;
        }
        let ids = self.quick.take_all();
        // One at a time: a neighbour still marked quick is not merged until its own turn.
        for id in ids {
            self.quick_leave(id);
            self.pool_free(id);
        }
    }

    /// Puts a free block into its pool, merged with its free (pooled) neighbours.
    fn pool_free(&mut self, id: BlockId) {
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
    fn merge(&mut self, id: BlockId, other: BlockId) {
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

    /// Records `id` as its expandable segment's tail if it now ends the mapped part.
    fn fix_tail(&mut self, id: BlockId) {
        let b = &self.blocks[id as usize];
        if b.next.is_none() {
            if let Some(exp) = self.segments[b.seg as usize].as_mut().and_then(|e| e.exp.as_mut()) {
                exp.tail = Some(id);
            }
        }
    }

    fn uses_expandable(&self) -> bool {
        self.config.expandable_segments && !self.config.no_caching && !self.expandable_unsupported
    }

    fn is_expandable(&self, id: BlockId) -> bool {
        self.segments[self.blocks[id as usize].seg as usize].as_ref().is_some_and(|e| e.exp.is_some())
    }

    /// New memory for a request: a new segment, or more of the stream's expandable segment.
    fn new_memory(
        &mut self,
        alloc_size: usize,
        rounded: usize,
        pool: PoolKind,
        stream: u64,
        cause: &mut String,
    ) -> Option<BlockId> {
        if self.uses_expandable() {
            let got = self.grow_expandable(rounded, pool, stream, cause);
            if got.is_some() {
                return got;
            }
            // The source cannot make expandable segments, or this one cannot grow (its
            // reservation is full, or mapping more failed): a classic segment of its own
            // serves the request, and its result is what counts.
            self.source_error = None;
        }
        self.alloc_segment(alloc_size, pool, stream, cause)
    }

    /// Grows the (stream, pool) expandable segment so that its free tail holds `rounded`
    /// bytes; returns that tail block. Before the reserved bytes grow, [`Pool::trim`] punches
    /// free pages elsewhere if they would go past its bound or the allowed memory. Making the
    /// reservation and each growth (one `mmap` of more of the memfd) are calls to the memory
    /// source, counted in `num_device_alloc`.
    fn grow_expandable(&mut self, rounded: usize, pool: PoolKind, stream: u64, cause: &mut String) -> Option<BlockId> {
        let idx = match self.expandable.get(&(stream, pool)) {
            Some(&i) => i,
            None => match expandable::reserve(&*self.source, self.allowed, rounded) {
                Reservation::Made(seg, exp) => {
                    let base = seg.mapping().map_or(0, |m| m.as_ptr() as usize);
                    let entry = SegEntry { seg: Arc::new(seg), base, size: 0, pool, stream, exp: Some(exp) };
                    let i = self.add_segment(entry);
                    self.expandable.insert((stream, pool), i);
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
        // The request takes all of the free tail: its punched pages count again too.
        let need = (grow + tail_free.map_or(0, |t| self.punched_bytes(t, usize::MAX))) as u64;
        self.trim(need, rounded as u64, tail_free);
        let reserved = self.stats.device.reserved_bytes[stats::AGGREGATE].current as u64;
        if reserved + need > self.allowed {
            *cause = format!(
                "; the allowed memory ({} bytes = fraction {} of capacity) would be exceeded",
                self.allowed, self.config.per_process_memory_fraction
            );
            return None;
        }
        let e = self.segments[idx as usize].as_mut().expect("live expandable segment");
        if let Err(err) = e.exp.as_mut().expect("expandable").grow(&e.seg, mapped, grow) {
            *cause = format!("; {err}");
            self.note_source_error(err);
            return None;
        }
        e.size = mapped + grow;
        self.stats.device.num_device_alloc += 1;
        stats::inc_array(&mut self.stats.device.reserved_bytes, pool, grow as i64);
        match tail_free {
            Some(t) => {
                self.pool_remove(t);
                self.blocks[t as usize].size += grow;
                self.pool_insert(t);
                Some(t)
            }
            None => {
                let id = self.new_block(idx, (mapped, grow), stream, pool, tail, None);
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
    fn punched_bytes(&self, id: BlockId, len: usize) -> usize {
        let b = &self.blocks[id as usize];
        let Some(exp) = self.segments[b.seg as usize].as_ref().and_then(|e| e.exp.as_ref()) else { return 0 };
        exp.punched_bytes(b.offset, len.min(b.size))
    }

    /// Whether pooled block `id` can be handed out for a `rounded`-byte request: the punched
    /// pages that part of it touches count as reserved again once handed out (touching them
    /// brings them back, with no call to the source), so first the trim policy makes room as
    /// for a growth, and then they must fit in the allowed memory. On the slow path of
    /// [`Pool::allocate`] only, and cheap unless the block's segment has punched pages.
    fn reback_fits(&mut self, id: BlockId, rounded: usize) -> bool {
        let mut need = self.punched_bytes(id, rounded) as u64;
        if need == 0 {
            return true;
        }
        if self.quick.len() > 0 && self.budget().trim_excess(need, rounded as u64) > 0 {
            // Memory in the quick cache cannot be punched: merge it first, with `id` out of
            // its pool and marked allocated meanwhile so that no merge absorbs it; then `id`
            // goes back through `pool_free`, which absorbs its free neighbours (leaving them
            // unmerged would strand them: nothing merges two pooled blocks later). `id` keeps
            // its id, so the caller's choice stands; it may start earlier now.
            self.pool_remove(id);
            self.blocks[id as usize].allocated = true;
            self.flush_quick();
            self.blocks[id as usize].allocated = false;
            self.pool_free(id);
            need = self.punched_bytes(id, rounded) as u64;
        }
        self.trim(need, rounded as u64, Some(id));
        self.stats.device.reserved_bytes[stats::AGGREGATE].current as u64 + need <= self.allowed
    }

    /// Counts the punched pages under an expandable block that is being handed out as
    /// reserved again ([`Pool::reback_fits`] made room for them). Called on the slow path of
    /// [`Pool::allocate`], the only way out of the pools (see `Pool::hand_out`).
    fn back_chunks(&mut self, id: BlockId) {
        let b = &self.blocks[id as usize];
        let (seg, off, size, pool) = (b.seg, b.offset, b.size, b.pool);
        let Some(exp) = self.segments[seg as usize].as_mut().and_then(|e| e.exp.as_mut()) else { return };
        let added = exp.back(off, size);
        if added > 0 {
            stats::inc_array(&mut self.stats.device.reserved_bytes, pool, added as i64);
        }
    }

    /// Gives every backed page that a free expandable block wholly covers back to the kernel;
    /// returns the bytes released.
    fn punch_free(&mut self, id: BlockId) -> usize {
        self.punch_block(id, u64::MAX)
    }

    /// Gives back at least `want` bytes (or all it has) of the backed pages that a free
    /// expandable block wholly covers, taken from its end (best fit splits blocks from the
    /// front, so the end is reused last), with one `fallocate(PUNCH_HOLE)`: a call to the
    /// source, counted in `num_device_free`. Returns the bytes released.
    fn punch_block(&mut self, id: BlockId, want: u64) -> usize {
        let b = &self.blocks[id as usize];
        let (seg, off, size, pool) = (b.seg, b.offset, b.size, b.pool);
        if self.queue_busy(b.stream) {
            // Work queued before the free may still use the block: a punch would not wait.
            return 0;
        }
        let Some(entry) = self.segments[seg as usize].as_mut() else { return 0 };
        let Some(exp) = entry.exp.as_mut() else { return 0 };
        let Some((from_b, freed)) = exp.punch(&entry.seg, off, size, want) else { return 0 };
        let (addr, stream) = (entry.base + from_b, entry.stream);
        self.stats.device.num_device_free += 1;
        stats::dec_array(&mut self.stats.device.reserved_bytes, pool, freed as i64);
        self.log(HistoryKind::SegmentFree, addr, freed, stream);
        freed
    }

    /// The numbers the trim policy weighs, now.
    fn budget(&self) -> Budget {
        let bytes = self.stats.hot.array(stats::ALLOCATED_BYTES)[stats::AGGREGATE];
        Budget {
            reserved: self.stats.device.reserved_bytes[stats::AGGREGATE].current as u64,
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
    fn trim(&mut self, need: u64, rounded: u64, keep: Option<BlockId>) {
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
    fn punch_largest(&mut self, mut excess: u64, keep: Option<BlockId>) -> u64 {
        let mut below: [Option<Key>; 2] = [None, None];
        let mut done = [false; 2];
        loop {
            let mut peek = [None, None];
            for i in 0..2 {
                if !done[i] {
                    let set = &self.pools[i];
                    peek[i] = match below[i] {
                        None => set.iter().next_back().copied(),
                        Some(k) => set.range(..k).next_back().copied(),
                    };
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

    // ---- allocation (seed 003's malloc) ----

    /// Keeps a source failure that is not a lack of memory, to report instead of an OOM.
    fn note_source_error(&mut self, e: Error) {
        use crate::error::ErrorKind;
        if matches!(e.kind(), ErrorKind::ResourceLimit | ErrorKind::PermissionDenied) {
            self.source_error = Some(e);
        }
    }

    /// Notes `queue` as one that blocks are bound to (called on the slow path: a queue's first
    /// allocation always takes it).
    /// Returns true the first time.
    pub(crate) fn register_queue(&mut self, queue: &Queue) -> bool {
        let mut new = false;
        self.queues.entry(queue.id().get()).or_insert_with(|| {
            new = true;
            queue.handle()
        });
        new
    }

    /// The queue `stream` is gone (dropped, its work finished): nothing can allocate on it
    /// again, so its segments go back to the source as soon as all their blocks are free (now,
    /// or when the last of them is freed), and its handle and quick-cache table are dropped.
    fn queue_gone(&mut self, stream: u64) {
        self.queues.remove(&stream);
        self.gone.insert(stream);
        self.release_gone(stream);
    }

    /// Releases every segment of the gone queue `stream` whose blocks are all free; forgets
    /// the queue once none is left.
    fn release_gone(&mut self, stream: u64) {
        self.flush_quick();
        self.quick.forget_stream(stream);
        let segs: Vec<u32> = (0..self.segments.len() as u32)
            .filter(|&i| self.segments[i as usize].as_ref().is_some_and(|e| e.stream == stream))
            .collect();
        let mut left = false;
        for si in segs {
            left |= !self.release_segment_if_free(si);
        }
        if !left {
            self.gone.remove(&stream);
        }
    }

    /// Returns segment `si` to the source if none of its blocks is in use (after a flush of the
    /// quick cache, free blocks are merged, so that is one free block, or none for an
    /// expandable segment that never grew). Returns whether it went.
    fn release_segment_if_free(&mut self, si: u32) -> bool {
        let Some(e) = self.segments[si as usize].as_ref() else { return true };
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
        self.expandable.remove(&(e.stream, e.pool));
        self.log(HistoryKind::SegmentFree, e.base, e.size, e.stream);
        self.free_segs.push(si);
        drop(e); // unmaps the reservation and closes the memfd once no queue operation holds it
        true
    }

    /// Whether the queue `stream` has work queued or running: its freed blocks may still be
    /// read or written by it, so their pages must not be punched yet.
    fn queue_busy(&self, stream: u64) -> bool {
        stream != 0 && self.queues.get(&stream).is_some_and(|h| !h.is_idle())
    }

    /// The queues blocks are bound to (for `empty_cache`, which lets them finish first).
    pub(crate) fn queue_handles(&self) -> Vec<QueueHandle> {
        self.queues.values().cloned().collect()
    }

    /// The allocation fast path: a quick-cached block of exactly the rounded size on this
    /// queue. `None` sends the caller to [`Pool::allocate`], which handles everything else
    /// (rounding options, bad sizes, misses) and tries the quick cache again itself.
    #[inline(always)]
    pub(crate) fn try_quick(&mut self, size: usize, stream: u64) -> Option<Handed> {
        // Plain 512-byte rounding of a sane size (1 byte to 1 TiB).
        if !self.config.roundup_power2_divisions.is_empty() || size.wrapping_sub(1) >= 1 << 40 {
            return None;
        }
        let rounded = size.max(MIN_BLOCK).next_multiple_of(MIN_BLOCK);
        let id = self.quick_take(stream, rounded)?;
        Some(self.hand_out(id, size, stream))
    }

    /// Seed 003's malloc. With deferred frees outstanding (`pending`), the last rung first
    /// returns [`Outcome::WaitForPending`] so the caller can wait for them without holding the
    /// lock, then call again with `waited`.
    pub(crate) fn allocate(&mut self, size: usize, stream: u64, pending: bool, waited: bool) -> Result<Outcome> {
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
        // The fast path: a block of exactly this size freed on this queue.
        if let Some(id) = self.quick_take(stream, rounded) {
            return Ok(Outcome::Got(self.hand_out(id, size, stream)));
        }
        let alloc_size = self.allocation_size(rounded).ok_or_else(too_large)?;
        let pool = PoolKind::for_size(rounded);
        let mut found = self.find_cached(rounded, stream, pool);
        let mut cause = String::new();
        let needs = if self.uses_expandable() { rounded.next_multiple_of(CHUNK) } else { alloc_size };
        if found.is_none() && needs as u64 > self.allowed {
            // Nothing cached can help a request no segment within the limit can hold.
            cause = format!("; the request needs {needs} bytes of segment, more than the allowed memory");
        } else if found.is_none() {
            if !waited {
                self.misses += 1;
                if self.config.garbage_collection_threshold > 0.0 {
                    self.garbage_collect();
                }
            }
            found = self.new_memory(alloc_size, rounded, pool, stream, &mut cause);
            if found.is_none() && !self.config.no_caching {
                if !waited {
                    self.stats.device.num_alloc_retries += 1;
                }
                // Rung 1: release cached oversize blocks.
                if self.release_available_cached(rounded, stream) {
                    found = self.new_memory(alloc_size, rounded, pool, stream, &mut cause);
                }
                if found.is_none() {
                    // Rung 2: finish pending frees (outside the lock), then release every
                    // unsplit cached block.
                    if pending && !waited {
                        return Ok(Outcome::WaitForPending);
                    }
                    if let Some(id) = self.quick_take(stream, rounded) {
                        return Ok(Outcome::Got(self.hand_out(id, size, stream)));
                    }
                    found = self.find_cached(rounded, stream, pool);
                    if found.is_none() {
                        self.release_cached(None);
                        found = self.get_free_block(rounded, stream, pool);
                    }
                    if found.is_none() {
                        found = self.new_memory(alloc_size, rounded, pool, stream, &mut cause);
                    }
                }
            }
        }
        if found.is_some_and(|id| !self.reback_fits(id, rounded)) {
            found = None;
            cause = "; the pages of the cached block that fits were given back, and taking them again would exceed \
                     the allowed memory"
                .into();
        }
        let Some(id) = found else {
            if let Some(e) = self.source_error.take() {
                // Not a lack of memory: the source failed for another reason (after the
                // ladder, which released cached segments and their fds too).
                return Err(e);
            }
            self.stats.device.num_ooms += 1;
            self.log(HistoryKind::Oom, 0, size, stream);
            let largest = self.pools.iter().flat_map(|p| p.iter()).map(|k| k.1).max().unwrap_or(0);
            let reserved = self.stats.device.reserved_bytes[stats::AGGREGATE].current as u64;
            let allocated = self.stats.hot.current(stats::ALLOCATED_BYTES)[stats::AGGREGATE] as u64;
            return Err(Error::AllocatorOom {
                requested: size as u64,
                capacity: self.capacity,
                allocated,
                reserved_free: reserved.saturating_sub(allocated),
                largest_free: largest as u64,
                allowed: self.allowed,
                cause,
            });
        };
        self.pool_remove(id);
        if self.should_split(id, rounded) {
            let b = self.blocks[id as usize].clone();
            let rest =
                self.new_block(b.seg, (b.offset + rounded, b.size - rounded), b.stream, b.pool, Some(id), b.next);
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
        Ok(Outcome::Got(self.hand_out(id, size, stream)))
    }

    /// A cached block for the request: best fit in the pool, after merging the quick cache if
    /// that is what it takes.
    fn find_cached(&mut self, rounded: usize, stream: u64, pool: PoolKind) -> Option<BlockId> {
        if self.config.no_caching {
            return None;
        }
        let found = self.get_free_block(rounded, stream, pool);
        if found.is_some() || self.quick.len() == 0 {
            return found;
        }
        // Unmerged frees may add up to a fit.
        self.flush_quick();
        self.get_free_block(rounded, stream, pool)
    }

    /// Marks a block allocated for a request of `size` and accounts for it.
    #[inline(always)]
    fn hand_out(&mut self, id: BlockId, size: usize, stream: u64) -> Handed {
        let b = &mut self.blocks[id as usize];
        b.allocated = true;
        b.requested = size;
        let (bsize, bpool, bseg, boff) = (b.size, b.pool, b.seg, b.offset);
        self.stats.hot.on_alloc(bpool, bsize as i64, size as i64);
        // No punched pages to count here: only pooled free blocks are punched, they leave
        // their pool only through `allocate`'s slow path, which counts their pages again
        // (`back_chunks`), and the quick cache holds only blocks that were handed out.
        if self.stats.any_pending() || bsize >= self.config.max_split_size || self.history.record_all {
            self.hand_out_rare(id, stream);
        }
        let segment = SegRef::new(&self.segments[bseg as usize].as_ref().expect("live segment").seg);
        Handed { id, segment, offset: boff }
    }

    /// What a hand-out may need besides: active peaks while frees are pending, oversize
    /// counts, history.
    #[cold]
    fn hand_out_rare(&mut self, id: BlockId, stream: u64) {
        let (bsize, bpool) = (self.blocks[id as usize].size, self.blocks[id as usize].pool);
        if self.stats.any_pending() {
            self.stats.note_active_peak(bpool);
        }
        if bsize >= self.config.max_split_size {
            self.stats.device.oversize_allocations.update(1);
        }
        if self.history.record_all {
            let addr = self.addr(id);
            self.log(HistoryKind::Alloc, addr, bsize, stream);
        }
    }

    /// Best fit in `pool` for `size` on `stream`, honouring the oversize rules.
    fn get_free_block(&mut self, size: usize, stream: u64, pool: PoolKind) -> Option<BlockId> {
        let key = *self.pools[pool.slot()].range((stream, size, 0, 0)..).next()?;
        if key.0 != stream {
            return None;
        }
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
    fn alloc_segment(&mut self, size: usize, pool: PoolKind, stream: u64, cause: &mut String) -> Option<BlockId> {
        let reserved = self.stats.device.reserved_bytes[stats::AGGREGATE].current as u64;
        if reserved.saturating_add(size as u64) > self.allowed {
            *cause = format!(
                "; the allowed memory ({} bytes = fraction {} of capacity) would be exceeded",
                self.allowed, self.config.per_process_memory_fraction
            );
            return None;
        }
        let seg = match self.source.allocate(size) {
            Ok(s) => s,
            Err(e) => {
                *cause = format!("; {} refused: {e}", self.source.name());
                self.note_source_error(e);
                return None;
            }
        };
        let base = seg.mapping().map_or(0, |m| m.as_ptr() as usize);
        let seg_size = seg.len();
        let seg_idx = self.add_segment(SegEntry { seg: Arc::new(seg), base, size: seg_size, pool, stream, exp: None });
        let id = self.new_block(seg_idx, (0, seg_size), stream, pool, None, None);
        self.pool_insert(id);
        Some(id)
    }

    /// Files a new segment (classic, or an expandable one with nothing mapped yet) and
    /// accounts for it.
    fn add_segment(&mut self, entry: SegEntry) -> u32 {
        let (base, size, pool, stream) = (entry.base, entry.size, entry.pool, entry.stream);
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
        self.log(HistoryKind::SegmentAlloc, base, size, stream);
        idx
    }

    /// Returns a free, unsplit, pooled block's segment to the source.
    ///
    /// [`Allocation`](super::Allocation)'s reference-count-free segment pointer is sound only
    /// because a segment never goes back while one of its blocks is handed out: so this is
    /// checked here in every build, and a block that does not qualify is left alone (a bug
    /// elsewhere then leaks a segment instead of freeing memory in use).
    fn release_block(&mut self, id: BlockId) -> bool {
        let b = &self.blocks[id as usize];
        if b.allocated || b.in_quick || b.is_split() || self.is_expandable(id) {
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
            self.log(HistoryKind::SegmentFree, entry.base, entry.size, entry.stream);
            self.free_segs.push(b.seg);
            drop(entry); // unmaps and closes once no queue operation holds the segment
        }
        self.free_ids.push(id);
        true
    }

    /// Seed 003's `release_available_cached_blocks`: free cached oversize blocks, the
    /// smallest that covers the request or else the largest ones until enough is freed.
    fn release_available_cached(&mut self, size: usize, stream: u64) -> bool {
        if self.config.max_split_size == usize::MAX {
            return false;
        }
        let max_split = self.config.max_split_size;
        let want = size.max(max_split);
        let candidates: Vec<Key> = self.pools[PoolKind::Large.slot()]
            .range((stream, max_split, 0, 0)..(stream, usize::MAX, usize::MAX, BlockId::MAX))
            .copied()
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

    /// Frees every cached unsplit block (of `stream`, or all): seed 003's
    /// `release_cached_blocks` and `empty_cache`.
    pub(crate) fn release_cached(&mut self, stream: Option<u64>) {
        self.flush_quick();
        // A wholly free expandable segment goes back whole: its memfd and its reservation of
        // address space (made again, at the size the limits then allow, when next needed).
        // Queue operations still using it hold the segment until they finish.
        let idle: Vec<u32> = (0..self.segments.len() as u32)
            .filter(|&i| {
                self.segments[i as usize]
                    .as_ref()
                    .is_some_and(|e| e.exp.is_some() && stream.is_none_or(|s| e.stream == s))
            })
            .collect();
        for si in idle {
            let _ = self.release_segment_if_free(si);
        }
        for pool in PoolKind::BOTH {
            let ids: Vec<BlockId> =
                self.pools[pool.slot()].iter().filter(|k| stream.is_none_or(|s| k.0 == s)).map(|k| k.3).collect();
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
    fn garbage_collect(&mut self) {
        let target = (self.config.garbage_collection_threshold * self.allowed as f64) as i64;
        if self.stats.device.reserved_bytes[stats::AGGREGATE].current <= target {
            return;
        }
        self.flush_quick();
        // As seed 003: free blocks at least as old as the average age, oldest first, and
        // repeat with the average of what is left until under the target or nothing is left.
        loop {
            let mut aged: Vec<(u64, BlockId)> = self
                .pools
                .iter()
                .flat_map(|p| p.iter())
                .map(|k| k.3)
                .filter(|&id| !self.blocks[id as usize].is_split() || self.is_expandable(id))
                .map(|id| (self.misses - self.blocks[id as usize].cached_at, id))
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

    // ---- raw allocations (C callers): the checks live in the raw table ----

    /// Marks a block just handed out as a raw allocation; returns its address.
    pub(crate) fn hand_out_raw(&mut self, h: Handed) -> usize {
        self.blocks[h.id as usize].raw = true;
        self.addr(h.id)
    }

    /// [`Pool::try_quick`] for a raw caller.
    #[inline]
    pub(crate) fn try_quick_raw(&mut self, size: usize, stream: u64) -> Option<usize> {
        let h = self.try_quick(size, stream)?;
        Some(self.hand_out_raw(h))
    }

    /// Frees the raw allocation at `addr`: applied at once, or, if other queues used it, its
    /// request applied and the block and queues returned for the caller to wait on. A pointer
    /// that is not a live raw allocation is refused (and logged), changing nothing else.
    #[inline]
    pub(crate) fn free_raw(&mut self, addr: usize) -> std::result::Result<Option<RawDeferred>, &'static str> {
        let id = match self.raw.live_raw_at(addr, &self.blocks) {
            Ok(id) => id,
            Err(why) => {
                self.history.log_always(HistoryKind::InvalidFree, addr, 0, 0);
                return Err(why);
            }
        };
        match self.raw.release(id, &mut self.blocks) {
            None => {
                self.apply(FreeMsg::Free(id));
                Ok(None)
            }
            Some(uses) => {
                self.apply(FreeMsg::Requested(id));
                Ok(Some((id, uses)))
            }
        }
    }

    /// Records that `queue` uses the raw allocation at `addr`.
    pub(crate) fn record_queue_raw(&mut self, addr: usize, queue: &Queue) -> std::result::Result<(), &'static str> {
        let id = self.raw.live_raw_at(addr, &self.blocks)?;
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
        let id = self.raw.live_range(addr, len, &self.blocks)?;
        let e = self.segments[self.blocks[id as usize].seg as usize].as_ref().expect("a live block's segment is live");
        Ok((Arc::clone(&e.seg), addr - e.base))
    }

    /// Whether `addr` lies in some block of a live segment.
    pub(crate) fn holds(&self, addr: usize) -> bool {
        self.raw.holding(addr, &self.blocks).is_some()
    }

    /// Segments with their blocks (see [`Snapshot`]).
    pub(crate) fn snapshot(&self) -> Snapshot {
        let free: HashSet<BlockId> =
            self.pools.iter().flat_map(|p| p.iter()).map(|k| k.3).chain(self.quick.ids()).collect();
        let dead: HashSet<BlockId> = self.free_ids.iter().copied().collect();
        let segments = self.segments.iter().map(|s| s.as_ref().map(|s| (s.base, s.size, s.pool, s.stream)));
        let blocks =
            self.blocks.iter().enumerate().filter(|&(id, _)| !dead.contains(&(id as BlockId))).map(|(id, b)| {
                let state = if free.contains(&(id as BlockId)) {
                    BlockState::Free
                } else if b.allocated && b.requested == 0 {
                    BlockState::PendingFree
                } else {
                    BlockState::Allocated
                };
                (b.seg, BlockSnapshot { offset: b.offset, size: b.size, requested: b.requested, state })
            });
        Snapshot::build(segments, blocks)
    }
}

impl Pool {
    /// Checks every structural invariant of the pool and its stats; the first one broken is
    /// the error. For tests, fuzzers and model checks (it walks everything: O(blocks)).
    pub(crate) fn check_invariants(&self) -> std::result::Result<(), String> {
        let dead: std::collections::HashSet<BlockId> = self.free_ids.iter().copied().collect();
        if dead.len() != self.free_ids.len() {
            return Err("a block id is on the free-id list twice".into());
        }
        let live_seg = |i: u32| self.segments.get(i as usize).is_some_and(Option::is_some);
        let mut per_seg: Vec<Vec<BlockId>> = vec![Vec::new(); self.segments.len()];
        for (id, b) in self.blocks.iter().enumerate() {
            let id = id as BlockId;
            if dead.contains(&id) {
                continue;
            }
            if !live_seg(b.seg) {
                return Err(format!("live block {id} is in released segment {}", b.seg));
            }
            if b.size == 0 {
                return Err(format!("block {id} is empty"));
            }
            per_seg[b.seg as usize].push(id);
        }
        // Blocks tile each segment (an expandable one up to its mapped end), in link order.
        let mut by_addr = 0usize;
        let mut reserved = [0i64; 3];
        let mut segments = [0i64; 3];
        for (si, entry) in self.segments.iter().enumerate() {
            let Some(e) = entry else {
                if !per_seg[si].is_empty() {
                    return Err(format!("released segment {si} still has blocks"));
                }
                continue;
            };
            let mut ids = std::mem::take(&mut per_seg[si]);
            ids.sort_by_key(|&id| self.blocks[id as usize].offset);
            let mut at = 0;
            for (k, &id) in ids.iter().enumerate() {
                let b = &self.blocks[id as usize];
                if b.offset != at {
                    return Err(format!("segment {si}: block {id} starts at {} where {at} was expected", b.offset));
                }
                at += b.size;
                let (want_prev, want_next) = (k.checked_sub(1).map(|p| ids[p]), ids.get(k + 1).copied());
                if b.prev != want_prev || b.next != want_next {
                    return Err(format!(
                        "segment {si}: block {id} links prev {:?} next {:?}, address order says {want_prev:?} {want_next:?}",
                        b.prev, b.next
                    ));
                }
                if b.pool != e.pool || b.stream != e.stream {
                    return Err(format!(
                        "block {id} has pool/queue {:?}/{}, its segment {:?}/{}",
                        b.pool, b.stream, e.pool, e.stream
                    ));
                }
                if self.raw.addrs.get(e.base + b.offset) != Some(id) {
                    return Err(format!("block {id} is not in the address table"));
                }
                by_addr += 1;
            }
            if at != e.size {
                return Err(format!("segment {si}: blocks cover {at} of its {} bytes", e.size));
            }
            let mut bytes = e.size as i64;
            if let Some(exp) = &e.exp {
                let blocks: Vec<_> = ids
                    .iter()
                    .map(|&id| {
                        let b = &self.blocks[id as usize];
                        (id, b.offset, b.size, !b.is_pooled_free())
                    })
                    .collect();
                exp.check(e.size, &blocks).map_err(|why| format!("expandable segment {si}: {why}"))?;
                bytes = exp.backed_bytes(e.size) as i64;
                if self.expandable.get(&(e.stream, e.pool)) != Some(&(si as u32)) {
                    return Err(format!("expandable segment {si} is not its (queue, pool)'s"));
                }
            }
            reserved[0] += bytes;
            reserved[e.pool.index()] += bytes;
            segments[0] += 1;
            segments[e.pool.index()] += 1;
        }
        if by_addr != self.raw.addrs.len() {
            return Err(format!("the address table has {} entries for {by_addr} blocks", self.raw.addrs.len()));
        }
        for p in 0..3 {
            if self.stats.device.reserved_bytes[p].current != reserved[p] {
                return Err(format!(
                    "reserved bytes[{p}] {} but segments hold {}",
                    self.stats.device.reserved_bytes[p].current, reserved[p]
                ));
            }
            if self.stats.device.segment[p].current != segments[p] {
                return Err(format!(
                    "segment count[{p}] {} but {} are live",
                    self.stats.device.segment[p].current, segments[p]
                ));
            }
        }
        // Pool membership, quick cache, merging, and the hot stats.
        let quick: std::collections::HashSet<BlockId> = self.quick.ids().into_iter().collect();
        if quick.len() != self.quick.len() {
            return Err(format!("the quick cache counts {} blocks, lists {}", self.quick.len(), quick.len()));
        }
        let mut pooled = 0;
        for (p, set) in self.pools.iter().enumerate() {
            for &k in set {
                let id = k.3;
                if dead.contains(&id) || self.key(id) != k || self.blocks[id as usize].pool.slot() != p {
                    return Err(format!("pool {p} holds a stale key {k:?}"));
                }
                pooled += 1;
            }
        }
        let (mut alloc, mut alloc_bytes, mut req_bytes, mut inactive, mut inactive_bytes, mut pend) =
            ([0i64; 3], [0i64; 3], [0i64; 3], [0i64; 3], [0i64; 3], [0i64; 3]);
        let mut free_pooled = 0;
        for (id, b) in self.blocks.iter().enumerate() {
            let id = id as BlockId;
            if dead.contains(&id) {
                continue;
            }
            let in_pool = self.pools[b.pool.slot()].contains(&self.key(id));
            if b.in_quick != quick.contains(&id) {
                return Err(format!("block {id}: in_quick {} but the quick cache says {}", b.in_quick, !b.in_quick));
            }
            let add = |a: &mut [i64; 3], v: i64| {
                a[0] += v;
                a[b.pool.index()] += v;
            };
            if b.allocated {
                if in_pool || b.in_quick {
                    return Err(format!("allocated block {id} is also cached"));
                }
                if b.requested > 0 {
                    add(&mut alloc, 1);
                    add(&mut alloc_bytes, b.size as i64);
                    add(&mut req_bytes, b.requested as i64);
                } else {
                    add(&mut pend, 1);
                }
                if b.raw && b.requested == 0 {
                    return Err(format!("raw block {id} has no request"));
                }
            } else {
                if b.raw || b.raw_used {
                    return Err(format!("free block {id} is still marked raw"));
                }
                if in_pool == b.in_quick {
                    return Err(format!("free block {id}: in its pool {in_pool}, in the quick cache {}", b.in_quick));
                }
                if in_pool {
                    free_pooled += 1;
                    for n in [b.prev, b.next].into_iter().flatten() {
                        let nb = &self.blocks[n as usize];
                        if nb.is_pooled_free() {
                            return Err(format!("free pooled neighbours {id} and {n} were not merged"));
                        }
                    }
                }
                if b.is_split() {
                    add(&mut inactive, 1);
                    add(&mut inactive_bytes, b.size as i64);
                }
            }
        }
        if free_pooled != pooled {
            return Err(format!("the pools hold {pooled} keys for {free_pooled} free pooled blocks"));
        }
        let checks = [
            ("allocation", stats::ALLOCATION, alloc),
            ("allocated bytes", stats::ALLOCATED_BYTES, alloc_bytes),
            ("requested bytes", stats::REQUESTED_BYTES, req_bytes),
            ("inactive split", stats::INACTIVE_SPLIT, inactive),
            ("inactive split bytes", stats::INACTIVE_SPLIT_BYTES, inactive_bytes),
        ];
        for (name, field, want) in checks {
            let have = self.stats.hot.current(field);
            if have != want {
                return Err(format!("{name}: stats say {have:?}, the blocks {want:?}"));
            }
        }
        let have_pend = self.stats.pending_current();
        if have_pend != pend {
            return Err(format!("pending frees: stats say {have_pend:?}, the blocks {pend:?}"));
        }
        self.raw.check(&self.blocks, &dead)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::SparseSource;

    fn pool(conf: &str) -> Pool {
        Pool::new(Box::new(SparseSource), Config::parse(conf).unwrap(), 1 << 30)
    }

    fn got(o: Result<Outcome>) -> Handed {
        match o.unwrap() {
            Outcome::Got(h) => h,
            Outcome::WaitForPending => panic!("nothing is pending"),
        }
    }

    /// Issue 9, defect 9: `Allocation`'s segment pointer is sound only if a segment never goes
    /// back to its source while one of its blocks is handed out. `release_block` checks that
    /// in every build (it was a `debug_assert!`), so a bug elsewhere leaks instead of freeing
    /// memory in use.
    #[test]
    fn release_block_refuses_blocks_in_use_split_or_cached() {
        let mut p = pool("expandable_segments:False");
        let whole = got(p.allocate(4 << 20, 0, false, false)).id;
        assert!(p.blocks[whole as usize].allocated);
        assert!(!p.release_block(whole), "released an allocated block's segment");
        let part = got(p.allocate(4096, 0, false, false)).id;
        assert!(p.blocks[part as usize].is_split());
        let rest = p.blocks[part as usize].next.unwrap();
        assert!(!p.release_block(rest), "released the segment under an allocated neighbour");
        p.apply(FreeMsg::Free(part));
        assert!(p.blocks[part as usize].in_quick);
        assert!(!p.release_block(part), "released a quick-cached block");
        assert_eq!(p.stats.device.segment[stats::AGGREGATE].current, 2);
        p.check_invariants().unwrap();
        p.apply(FreeMsg::Free(whole));
        p.release_cached(None);
        assert_eq!(p.stats.device.segment[stats::AGGREGATE].current, 0);
        p.check_invariants().unwrap();
    }

    /// Issue 9, defect 7: a gone queue's segments go back as soon as their blocks are free.
    #[test]
    fn a_gone_queues_segments_go_when_their_last_block_is_freed() {
        for conf in ["expandable_segments:False", "expandable_segments:True"] {
            let mut p = pool(conf);
            let a = got(p.allocate(4096, 7, false, false)).id;
            let b = got(p.allocate(3 << 20, 7, false, false)).id;
            let other = got(p.allocate(4096, 8, false, false)).id;
            p.queue_gone(7);
            p.check_invariants().unwrap();
            assert_eq!(p.stats.device.segment[stats::AGGREGATE].current, 3, "{conf}: blocks are live");
            p.apply(FreeMsg::Free(a));
            assert_eq!(p.stats.device.segment[stats::AGGREGATE].current, 2, "{conf}");
            p.apply(FreeMsg::Free(b));
            assert_eq!(p.stats.device.segment[stats::AGGREGATE].current, 1, "{conf}");
            assert!(p.gone.is_empty() && p.expandable.keys().all(|k| k.0 != 7), "{conf}");
            p.check_invariants().unwrap();
            p.apply(FreeMsg::Free(other));
            p.check_invariants().unwrap();
        }
    }
}
