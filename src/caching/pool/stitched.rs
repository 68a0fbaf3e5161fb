//! The pool's side of page-stitched arenas (`arena.rs`): which requests go there, finding a
//! cached view or making one within the allowed memory, and giving views and units back.
//! Blocks in an arena are never split or merged: a block is one view, and the memory they
//! share is the arena's units.

use std::collections::HashSet;
use std::sync::Arc;

use super::super::arena::{self, Arena, MAX_VIEW_RUNS, MIN_UNITS, Plan};
use super::super::block::{Block, BlockId, MIN_BLOCK, PoolKind, QueueKey};
use super::super::expandable::{self, Reservation};
use super::super::snapshot::{BlockSnapshot, BlockState, HistoryKind, SegmentSnapshot};
use super::super::stats;
use super::{AllocParams, Handed, Pool, SegEntry};

impl Pool {
    /// Whether a request of `rounded` bytes is served by its queue's arena: page stitching on,
    /// a source that makes expandable segments, and at least [`MIN_UNITS`] units.
    #[inline]
    pub(super) fn uses_arena(&self, rounded: usize) -> bool {
        self.config.page_stitching
            && self.uses_expandable()
            && !self.arena_unsupported
            && rounded >= MIN_UNITS * self.config.stitch_unit
            // Larger than the allowed memory: refused by the ladder, never an arena's (whose
            // unit counts are 32-bit: 2^32 units and more would wrap to a small run).
            && rounded as u64 <= self.allowed
            && rounded / self.config.stitch_unit <= u32::MAX as usize
    }

    /// Whether block `id` lies in an arena.
    #[inline]
    pub(super) fn is_arena(&self, id: BlockId) -> bool {
        self.blocks[id as usize].arena
    }

    fn arena_mut(&mut self, si: u32) -> (&Arc<crate::segment::Segment>, &mut Arena) {
        let e = self.segments[si as usize].as_mut().expect("live arena segment");
        (&e.seg, e.arena.as_mut().expect("an arena"))
    }

    /// The arena of `queue`, made on first use (`None` where it cannot be: the source makes no
    /// expandable segments, or no address space; classic pools serve the request then).
    fn arena_of(&mut self, queue: QueueKey, cause: &mut String) -> Option<u32> {
        if let Some(&si) = self.arenas.get(&queue) {
            return Some(si);
        }
        if cfg!(miri) {
            // Miri's stand-in mappings cannot alias one file range at two addresses.
            self.arena_unsupported = true;
            return None;
        }
        let unit = self.config.stitch_unit;
        // Address space as for at least `arena::MIN_RESERVED` of allowed memory (see there).
        // Under an address-space limit (`RLIMIT_AS`) a reservation takes at most a quarter of
        // the room left: as for the allowed memory only, and a smaller share for each arena
        // there is already (the k-th takes a 4k-th of the room left, so forty queues' arenas
        // leave two fifths of it, where a quarter each left nothing after eighteen).
        let want = match expandable::address_space_room() {
            Some(room) => self.allowed.min(room / (16 * (self.arenas.len() as u64 + 1))),
            None => self.allowed.max(arena::MIN_RESERVED),
        };
        let made = match expandable::reserve(&*self.source, want, unit) {
            Reservation::Made(seg, _) => Arena::new(&seg, unit).map(|a| (seg, a)),
            Reservation::Unsupported => {
                self.arena_unsupported = true;
                return None;
            }
            Reservation::Failed(e) => Err(e),
        };
        match made {
            Ok((seg, arena)) => {
                let base = seg.mapping().map_or(0, |m| m.as_ptr() as usize);
                let home = arena.home_bytes();
                let entry = SegEntry {
                    seg: Arc::new(seg),
                    base,
                    size: 0,
                    pool: PoolKind::Large,
                    queue,
                    exp: None,
                    arena: Some(arena),
                };
                let si = self.add_segment(entry);
                self.arenas.insert(queue, si);
                // Its home blocks are filed by unit, not in the ordered address map.
                self.raw.addrs.add_region(base, home, unit);
                Some(si)
            }
            Err(e) => {
                *cause = format!("; {} cannot reserve address space for a stitched arena: {e}", self.source.name());
                self.note_source_error(e);
                self.arena_unsupported = true;
                None
            }
        }
    }

    /// The allocation fast path of arena sizes (both APIs, after the quick cache): a home
    /// block in the smallest free run that holds the request, where the queue's arena exists
    /// and has given no units back, which is what [`Pool::allocate`] would hand out then (no
    /// call, no cost, no ladder). `None` sends the caller there, changing nothing: any other
    /// rounding, other sizes, no arena yet, units given back, or no free run that holds it.
    #[inline]
    pub(crate) fn try_arena_home(&mut self, size: usize, queue: QueueKey) -> Option<Handed> {
        // Plain 512-byte rounding of a sane size, as the quick cache's fast path.
        let below = size.wrapping_sub(1);
        if below >= self.plain_below {
            return None;
        }
        let rounded = (below | (MIN_BLOCK - 1)) + 1;
        if !self.uses_arena(rounded) {
            return None;
        }
        let &si = self.arenas.get(&queue)?;
        let (_, a) = self.arena_mut(si);
        let n = a.units_for(rounded);
        let s = a.home_fit_backed(n)?;
        let va = a.make_home(s, n);
        let id = self.new_block(si, (va, rounded), queue, PoolKind::for_size(rounded), None, None);
        self.blocks[id as usize].arena = true;
        Some(self.hand_out(id, size, queue))
    }

    /// Free memory of the arena for the request, with no call: a home block in the smallest
    /// free run that holds it, else a cached stitched view whose units are all free (the
    /// oldest first). Units given back must fit in the allowed memory when taken again. On a
    /// miss the quick cache is merged into the pools first, as a pool miss does: arena blocks
    /// never enter it, but leaving it unmerged until it fills measured worse (cnn_train 787
    /// -> 905 instructions per op).
    pub(super) fn arena_cached(&mut self, p: &mut AllocParams) -> bool {
        let Some(&si) = self.arenas.get(&p.queue) else { return false };
        let reserved = self.stats.device.reserved_bytes[stats::AGGREGATE].current as u64;
        let room = self.allowed.saturating_sub(reserved) as usize;
        let rounded = p.rounded;
        let (_, a) = self.arena_mut(si);
        let n = a.units_for(rounded);
        if let Some((plan, cost)) = a.home_fit(n).filter(|&(_, cost)| cost <= room) {
            self.trim_for_arena(si, cost as u64, rounded as u64);
            return self.arena_make(si, p, plan);
        }
        let find = |pool: &mut Self| {
            let a = pool.segments[si as usize].as_mut().and_then(|e| e.arena.as_mut())?;
            let max_holes = room / a.unit();
            a.find_cached(n, max_holes).map(|(id, holes)| (id, holes * a.unit()))
        };
        let mut found = find(self);
        if found.is_none() && self.quick.len() > 0 {
            self.flush_quick();
            found = find(self);
        }
        if let Some((_, cost)) = found {
            self.trim_for_arena(si, cost as u64, rounded as u64);
        }
        p.block = found.map(|(id, _)| id);
        p.block.is_some()
    }

    /// A new block for the request: units free or new, within the allowed memory (counting the
    /// units given back that it takes again and those it adds). On failure,
    /// `p.arena_over_allowed` tells a lack of allowed memory from an arena that cannot hold the
    /// request (no arena, its memfd or address space full, a failed mapping).
    pub(super) fn arena_new(&mut self, p: &mut AllocParams) -> bool {
        p.arena_over_allowed = false;
        let Some(si) = self.arena_of(p.queue, &mut p.cause) else { return false };
        self.flush_quick();
        let n = {
            let (_, a) = self.arena_mut(si);
            a.units_for(p.rounded)
        };
        let (mut plan, cost) = self.arena_mut(si).1.plan(n);
        let mut cost = cost as u64;
        let reserved = self.stats.device.reserved_bytes[stats::AGGREGATE].current as u64;
        let slack = self.grow_slack(si, plan.run_count());
        if plan.run_count() > 1 && slack > 0.0 {
            // New units in one run instead of a view of scattered free ones, while the reserved
            // bytes stay within the slack above the allocated bytes, this block counted (not
            // above an older peak: memory given back by `empty_cache` or trimming is not taken
            // again while free units hold the block). A hungry arena's wider slack stays within
            // `stitch_grow_slack` above the peak allocated bytes besides, so that the peak
            // reserved bytes keep the allocator's bound whatever the workload: a first step
            // that maps more views than the credit holds (a KV cache grown token by token,
            // each block a size no earlier one had, its views let go unused until the next
            // step) pays for them in `mmap`s, not in memory past the bound.
            let bytes = self.stats.hot.array(stats::ALLOCATED_BYTES)[stats::AGGREGATE];
            let allocated = (bytes.current + p.rounded as i64).max(0) as f64;
            let peak = (bytes.peak as f64).max(allocated);
            let limit = (allocated * (1.0 + slack)).min(peak * (1.0 + self.config.stitch_grow_slack));
            let arena = self.arena_mut(si).1;
            let (grow, grow_cost) = arena.grow_plan(n);
            let after = reserved + grow_cost as u64;
            if arena.has_room(&grow) && after as f64 <= limit && after <= self.allowed {
                (plan, cost) = (grow, grow_cost as u64);
            }
        }
        let runs = plan.run_count();
        if runs > 1 && arena::mapped_runs() + runs > arena::MAX_MAPPED_RUNS && !self.queue_busy(p.queue) {
            // Over the process's budget of mappings for views: the oldest cached views go
            // first (not while the queue has work in flight: it may use a block freed meanwhile).
            let seg = Arc::clone(&self.segments[si as usize].as_ref().expect("live arena").seg);
            while arena::mapped_runs() + runs > arena::MAX_MAPPED_RUNS {
                let Some(v) = self.arena_mut(si).1.oldest() else { break };
                self.arena_evict(si, &seg, v);
            }
        }
        if runs > MAX_VIEW_RUNS || (runs > 1 && arena::mapped_runs() + runs > arena::MAX_MAPPED_RUNS) {
            // Free memory split into that many runs would cost as many `mmap`s and kernel
            // mappings (a process has 65,530): grow instead, if the allowed memory holds it.
            let (grow, grow_cost) = self.arena_mut(si).1.grow_plan(n);
            if reserved + grow_cost as u64 <= self.allowed {
                (plan, cost) = (grow, grow_cost as u64);
            } else if arena::mapped_runs() + runs > arena::MAX_MAPPED_RUNS {
                p.cause = format!(
                    "; the free memory is split into {runs} runs of the stitched arena, and mapping them would take \
                     the process's stitched views past {} kernel mappings",
                    arena::MAX_MAPPED_RUNS
                );
                p.arena_over_allowed = true;
                return false;
            }
        }
        if reserved + cost > self.allowed {
            p.cause = format!(
                "; the stitched arena needs {cost} more bytes, and the allowed memory ({} bytes) would be exceeded",
                self.allowed
            );
            p.arena_over_allowed = true;
            return false;
        }
        self.trim_for_arena(si, cost, p.rounded as u64);
        self.arena_make(si, p, plan)
    }

    /// The share above the allocated bytes arena `si` may grow within rather than map a view of
    /// `runs` runs: `stitch_grow_slack`, or [`Arena::WIDE_SLACK`] if wider while the arena is
    /// hungry (out of map credit: a workload whose views are not used again; `arena_new`
    /// keeps it within `stitch_grow_slack` above the peak allocated bytes). The trim policy
    /// does not count a hungry arena's free units (`Pool::budget`), so it does not punch the
    /// pools' pages for them. With `stitch_grow_slack:0` the arena never grows for speed.
    fn grow_slack(&mut self, si: u32, runs: usize) -> f64 {
        let slack = self.config.stitch_grow_slack;
        if runs <= 1 || slack == 0.0 {
            return slack;
        }
        let a = self.arena_mut(si).1;
        a.want_map(runs);
        if a.hungry() { slack.max(Arena::WIDE_SLACK) } else { slack }
    }

    /// Makes the block `plan` names in arena `si` and hands it out for request `p` (letting
    /// the oldest cached views go if a stitched view finds no address space).
    fn arena_make(&mut self, si: u32, p: &mut AllocParams, plan: Plan) -> bool {
        let made = loop {
            let (seg, a) = self.arena_mut(si);
            match a.make(seg, &plan) {
                Ok(None) => {
                    // No address space left: the oldest cached view goes, and again; not while
                    // the queue has work in flight (it may still use a block freed meanwhile).
                    let seg = Arc::clone(seg);
                    let oldest = self.arena_mut(si).1.oldest();
                    let Some(v) = oldest.filter(|_| !self.queue_busy(p.queue)) else {
                        p.cause = "; the stitched arena's address space is full of views in use".into();
                        return false;
                    };
                    self.arena_evict(si, &seg, v);
                }
                other => break other,
            }
        };
        let (va, view, made) = match made {
            Ok(m) => m.expect("handled above"),
            Err(e) => {
                p.cause = format!("; mapping a stitched view failed: {e}");
                self.note_source_error(e);
                return false;
            }
        };
        let id = self.new_block(si, (va, p.rounded), p.queue, p.pool, None, None);
        self.blocks[id as usize].arena = true;
        if let Some(view) = view {
            self.arena_mut(si).1.adopt(id, view);
        }
        let base = self.segments[si as usize].as_ref().map_or(0, |e| e.base);
        self.stats.device.num_remaps += made.maps as i64;
        // New units are no call to the source: the memfd was made sparse at its full length,
        // and their pages are taken from the kernel when first touched. The calls a view makes
        // are its `mmap`s, counted above; the reserved bytes and the history show the growth.
        let added = (made.grown + made.rebacked) * self.config.stitch_unit;
        if added > 0 {
            stats::inc_array(&mut self.stats.device.reserved_bytes, PoolKind::Large, added as i64);
            self.log(HistoryKind::SegmentMap, base + va, added, p.queue);
        }
        // Its units are busy already: handed out as it is, not through `take_from_pool`.
        (p.block, p.exact) = (Some(id), true);
        true
    }

    /// Takes cached view `id` for a `rounded`-byte request: its units become busy, those given
    /// back count as reserved again.
    pub(super) fn arena_take(&mut self, id: BlockId, rounded: usize) {
        let b = &mut self.blocks[id as usize];
        b.size = rounded;
        b.pool = PoolKind::for_size(rounded);
        let si = b.seg;
        let (_, a) = self.arena_mut(si);
        let rebacked = a.take(id) * a.unit();
        if rebacked > 0 {
            stats::inc_array(&mut self.stats.device.reserved_bytes, PoolKind::Large, rebacked as i64);
            let addr = self.addr(id);
            let queue = self.blocks[id as usize].queue;
            self.log(HistoryKind::SegmentMap, addr, rebacked, queue);
        }
    }

    /// A plain free of block `id` applied the short way if it is a home block of an arena (its
    /// units free again, the block gone) and nothing asks for the long one (full history, a
    /// full quick cache, which the long way flushes first): what `free_now`, `free_block` and
    /// `arena_release` do for it, with no lookups between. False, changing nothing, otherwise.
    /// The caller checked that no block is held for another process and no queue is gone.
    #[inline]
    pub(super) fn home_free_now(&mut self, id: BlockId) -> bool {
        let b = &self.blocks[id as usize];
        if !b.arena || self.history.record_all || self.quick.len() >= super::QUICK_MAX {
            return false;
        }
        let (si, off, size) = (b.seg, b.offset, b.size);
        let Some(e) = self.segments[si as usize].as_mut() else { return false };
        let base = e.base;
        let Some(a) = e.arena.as_mut().filter(|a| a.is_home(off)) else { return false };
        let n = a.units_for(size);
        a.release_home(off, n);
        self.account_free_request(id);
        let misses = Block::stamp(self.misses);
        let b = &mut self.blocks[id as usize];
        b.allocated = false;
        b.cached_at = misses;
        self.forget_home(id, base + off);
        true
    }

    /// Home block `id` at `addr`, its units released, leaves no trace but the address table's
    /// mark that a block was freed there: its address and id go.
    fn forget_home(&mut self, id: BlockId, addr: usize) {
        self.raw.addrs.remove(addr);
        self.free_ids.push(id);
    }

    /// Block `id` of an arena is free: its units go back to the free set and its view is
    /// cached; the oldest views are let go if the cached ones hold too many mappings.
    pub(super) fn arena_release(&mut self, id: BlockId) {
        let (si, queue) = (self.blocks[id as usize].seg, self.blocks[id as usize].queue);
        let base = self.segments[si as usize].as_ref().map_or(0, |e| e.base);
        let (off, size) = (self.blocks[id as usize].offset, self.blocks[id as usize].size);
        let (_, a) = self.arena_mut(si);
        if a.is_home(off) {
            // A home block: gone, its units free for any block.
            let n = a.units_for(size);
            a.release_home(off, n);
            self.forget_home(id, base + off);
            return;
        }
        a.release(id);
        // Not while the queue has work in flight: it may still use the view just freed (a
        // stream-ordered free), and a view let go shows no memory any more.
        if a.over_run_budget() && !self.queue_busy(queue) {
            let seg = Arc::clone(&self.segments[si as usize].as_ref().expect("live arena").seg);
            let a = self.arena_mut(si).1;
            let ids = a.oldest_cached(super::super::arena::MAX_CACHED_RUNS * 3 / 4);
            for v in ids {
                self.arena_evict(si, &seg, v);
            }
        }
    }

    /// Whether `addr` lies in the memory of an arena: its home region's units used so far.
    pub(super) fn arena_holds(&self, addr: usize) -> bool {
        self.arenas.values().any(|&si| {
            let e = self.segments[si as usize].as_ref().expect("live arena");
            let a = e.arena.as_ref().expect("an arena");
            addr.checked_sub(e.base).is_some_and(|off| a.is_home(off) && off / a.unit() < a.units())
        })
    }

    /// Lets go of cached view `v` of arena `si` (its block id goes too).
    fn arena_evict(&mut self, si: u32, seg: &crate::segment::Segment, v: BlockId) {
        let base = self.segments[si as usize].as_ref().map_or(0, |e| e.base);
        let (_, a) = self.arena_mut(si);
        let (va, _) = a.evict(seg, v);
        self.stats.device.num_remaps += 1;
        self.raw.addrs.remove(base + va);
        self.free_ids.push(v);
    }

    /// Gives back what the arena of `queue` (or every arena) holds unused, unless its queue has
    /// work in flight (work queued before a free may still use the freed block: its view must
    /// stay and its units keep their pages): the pages of its free units; with `views_too`
    /// (`empty_cache`, the OOM ladder) also its cached views, and an arena with no block in use
    /// goes back whole. Garbage
    /// collection keeps the views (they are address space, and a periodic workload needs them
    /// to take its blocks with no call). Returns the bytes released.
    pub(super) fn arena_release_cached(&mut self, queue: Option<QueueKey>, views_too: bool) -> usize {
        let arenas: Vec<(QueueKey, u32)> =
            self.arenas.iter().filter(|(q, _)| queue.is_none_or(|s| **q == s)).map(|(&q, &s)| (q, s)).collect();
        let mut freed = 0;
        for (q, si) in arenas {
            if self.queue_busy(q) {
                // Work queued before a free may still use the freed block's view and units.
                continue;
            }
            let seg = Arc::clone(&self.segments[si as usize].as_ref().expect("live arena").seg);
            if views_too {
                let ids = self.arena_mut(si).1.cached_ids();
                for v in ids {
                    self.arena_evict(si, &seg, v);
                }
                if self.release_arena_if_free(si) {
                    continue;
                }
            }
            freed += self.arena_punch(q, si, usize::MAX);
        }
        freed
    }

    /// Gives free units of arena `si` (queue `q`, which the caller checked has no work in
    /// flight) back to the kernel, the largest runs first, until at least `want` bytes went,
    /// and accounts for them (calls, reserved bytes, history). Returns the bytes released.
    fn arena_punch(&mut self, q: QueueKey, si: u32, want: usize) -> usize {
        let seg = Arc::clone(&self.segments[si as usize].as_ref().expect("live arena").seg);
        let (bytes, calls) = self.arena_mut(si).1.punch_largest(&seg, want);
        if bytes > 0 {
            self.stats.device.num_device_free += calls as i64;
            stats::dec_array(&mut self.stats.device.reserved_bytes, PoolKind::Large, bytes as i64);
            let base = self.segments[si as usize].as_ref().map_or(0, |e| e.base);
            self.log(HistoryKind::SegmentUnmap, base, bytes, q);
        }
        bytes
    }

    /// The trim policy before arena `si` adds `cost` reserved bytes (units new or given back
    /// earlier) for a `rounded`-byte request: past `Config::trim_ratio` times the allocated
    /// peak (or the allowed memory), the pools' free pages go first, then the free units of
    /// the *other* queues' arenas, the largest runs first (not while their queue has work in
    /// flight, which may still use a block freed there). An arena's own free units are left be:
    /// a view of them is what it makes instead of growing. So a pipeline whose stages allocate
    /// on queues of their own holds the ratio as the pools do, at a few punches a step, where
    /// each queue's arena kept its own peak (twice the allocated peak with four stages).
    pub(super) fn trim_for_arena(&mut self, si: u32, cost: u64, rounded: u64) {
        if cost == 0 {
            return;
        }
        let excess = self.budget().trim_excess(cost, rounded);
        if excess == 0 {
            return;
        }
        let mut left = self.punch_largest(excess, None);
        let others: Vec<(QueueKey, u32)> =
            self.arenas.iter().filter(|&(_, &s)| s != si).map(|(&q, &s)| (q, s)).collect();
        for (q, s) in others {
            if left == 0 {
                break;
            }
            if self.queue_busy(q) {
                continue;
            }
            left = left.saturating_sub(self.arena_punch(q, s, left as usize) as u64);
        }
    }

    /// Returns arena `si` to the source if no block of it is handed out and its queue has no
    /// work in flight (its cached views go with it). Returns whether it went.
    pub(super) fn release_arena_if_free(&mut self, si: u32) -> bool {
        let Some(e) = self.segments[si as usize].as_ref() else { return true };
        let a = e.arena.as_ref().expect("an arena");
        if a.has_live() || self.queue_busy(e.queue) {
            return false;
        }
        let seg = Arc::clone(&e.seg);
        for v in a.cached_ids() {
            self.arena_evict(si, &seg, v);
        }
        let e = self.segments[si as usize].take().expect("checked live above");
        let backed = e.arena.as_ref().expect("an arena").backed_bytes();
        self.stats.device.num_device_free += 1;
        stats::dec_array(&mut self.stats.device.segment, e.pool, 1);
        stats::dec_array(&mut self.stats.device.reserved_bytes, e.pool, backed as i64);
        self.arenas.remove(&e.queue);
        self.raw.addrs.remove_region(e.base);
        if backed > 0 {
            self.log(HistoryKind::SegmentUnmap, e.base, backed, e.queue);
        }
        self.free_segs.push(si);
        drop(e); // unmaps the reservation and closes the memfd once no queue operation holds it
        true
    }

    /// Arena `si` as snapshot segments: one per block handed out, home block or view (its
    /// block, and the rest of its last unit free), and its free backed units as free segments
    /// at their home addresses (so that the segments' sizes add up to the reserved bytes, and
    /// none overlaps another). `dead` are the block ids not in use.
    pub(super) fn arena_snapshot(
        &self,
        si: u32,
        free: &HashSet<BlockId>,
        dead: &HashSet<BlockId>,
    ) -> Vec<SegmentSnapshot> {
        let e = self.segments[si as usize].as_ref().expect("live arena");
        let (base, queue, a) = (e.base, e.queue, e.arena.as_ref().expect("an arena"));
        // Not expandable: readers (ours and PyTorch's) draw consecutive runs of an expandable
        // segment as one, with the gaps between them punched; in an arena the gaps are units
        // in use through a stitched view (far away, in the other half), not punched.
        let seg = |address: usize, size: usize, blocks: Vec<BlockSnapshot>| SegmentSnapshot {
            address,
            size,
            pool: PoolKind::Large.name(),
            stream: queue.get(),
            is_expandable: false,
            blocks,
        };
        let views = a.views().filter(|(_, v)| v.is_live()).map(|(id, v)| (id, v.va));
        let homes = self.blocks.iter().enumerate().filter_map(|(id, b)| {
            let id = id as BlockId;
            (b.seg == si && b.arena && a.is_home(b.offset) && !dead.contains(&id)).then_some((id, b.offset))
        });
        let mut out = Vec::new();
        for (id, va) in views.chain(homes) {
            let (b, state) = (&self.blocks[id as usize], self.block_state(id, free));
            let len = a.units_for(b.size) * a.unit();
            let mut blocks = vec![BlockSnapshot { offset: 0, size: b.size, requested: b.requested, state }];
            if len > b.size {
                blocks.push(BlockSnapshot {
                    offset: b.size,
                    size: len - b.size,
                    requested: 0,
                    state: BlockState::Free,
                });
            }
            out.push(seg(base + va, len, blocks));
        }
        for (u, k) in a.free_backed_runs() {
            let (at, size) = (u * a.unit(), k * a.unit());
            let free_block = BlockSnapshot { offset: 0, size, requested: 0, state: BlockState::Free };
            out.push(seg(base + at, size, vec![free_block]));
        }
        out
    }

    /// The ranges `(offset, len)` of block `id`'s segment fd that hold its bytes, in address
    /// order: one for a pooled or home block (its whole size), one per run of units for a
    /// stitched view.
    pub(crate) fn fd_ranges(&self, id: BlockId) -> Vec<(usize, usize)> {
        let b = &self.blocks[id as usize];
        let Some(a) = self.segments[b.seg as usize].as_ref().and_then(|e| e.arena.as_ref()) else {
            return vec![(b.offset, b.size)];
        };
        if a.is_home(b.offset) {
            return vec![(b.offset, b.size)];
        }
        let v = a.view(id).expect("an arena block has a view");
        v.runs().iter().map(|&(u, k)| (u as usize * a.unit(), k as usize * a.unit())).collect()
    }

    /// Where block `id` starts in its segment's fd: its offset, or for a block of an arena the
    /// memfd offset of its view's one run of units (an error if it shows several).
    pub(crate) fn fd_offset(&self, id: BlockId) -> crate::error::Result<usize> {
        let b = &self.blocks[id as usize];
        let Some(a) = self.segments[b.seg as usize].as_ref().and_then(|e| e.arena.as_ref()) else {
            return Ok(b.offset);
        };
        if a.is_home(b.offset) {
            // At its units' own offset.
            return Ok(b.offset);
        }
        let v = a.view(id).expect("an arena block has a view");
        match v.runs() {
            [(first, _)] => Ok(*first as usize * a.unit()),
            runs => Err(crate::error::Error::Unsupported {
                what: format!(
                    "the block lies in a page-stitched arena and shows {} separate runs of its memfd, so no one fd \
                     range names it; share blocks as fds with page stitching off (DMABUF_RT_ALLOC_CONF=\
                     page_stitching:False)",
                    runs.len()
                ),
            }),
        }
    }
}
