//! Page-stitched arenas: GMLake's idea (ASPLOS'24) on a memfd, which on Linux needs no
//! driver. Physical memory is a set of fixed-size *units* of one sparse memfd per queue
//! (`Config::stitch_unit`, 4 KiB, the page, by default), and the arena's reservation has
//! two halves:
//!
//! - The *home region* shows the memfd in order (one `mmap` when the arena is made). A block
//!   that fits in one run of free units is a *home block* there, at its units' own address,
//!   with no call at all: the smallest free run that holds it (best fit over an index of the
//!   free runs, which merge again when blocks go). A home block leaves no trace when freed.
//! - Only when no free run holds a block, its units are stitched: a *view* is a range of the
//!   second half onto which free runs anywhere in the memfd are mapped (`mmap(MAP_FIXED)`,
//!   one call per run, as few runs as can be: the largest first). So a block never needs
//!   contiguous physical memory, free memory is never stranded behind a live neighbour, and
//!   the memfd grows only when the free units, wherever they lie, are fewer than the block
//!   needs.
//!
//! A view outlives its block. When the block is freed its units go back to the free set but
//! the view stays mapped and cached (by unit count); a later request of that many units that
//! finds no free run takes the oldest cached view whose units are all free again, with no
//! call. Oldest first (by when the view was made), not most recently freed, and freed blocks
//! come straight back here (not through the pool's quick cache): then what a request gets
//! depends only on which units are free at that moment, so a step that repeats the last one
//! repeats its choices, and a view made in one step is found again at the same point of the
//! next. On the traces of `examples/torch-traces` no warm step makes a view or calls anything.
//! A unit may so show in several places at once (aliases: its home address and views); only
//! one of them is ever handed out at a time, because a block is handed out only while all its
//! units are free, and taking it makes them busy.
//!
//! Cached views cost address space and kernel mappings (VMAs; Linux allows 65,530 a process by
//! default), not memory: the oldest are let go when they hold more than [`MAX_CACHED_RUNS`]
//! runs or the address space runs out. A view let go becomes unbacked anonymous memory (not
//! `PROT_NONE`: work a careless caller left queued on a block it freed must not kill the
//! process), and its address range is used for later views. None is let go, and no free unit
//! given back, while the arena's queue has work in flight: a free in stream order leaves the
//! work queued before it using the block (the pool checks).
//!
//! Views are paid for from a *map credit* ([`MAP_CREDIT_RUNS`]): each block the arena hands
//! out earns a share of a run ([`EARN_EVERY`] blocks earn one), a cached view taken again gives
//! back what its runs cost (it paid for itself), and a new view spends its runs. A periodic
//! workload keeps its credit full: its views are made in its first steps and taken again in
//! every later one. A workload that keeps needing new ones (sizes and lifetimes that never
//! repeat) runs out, with a credit's worth of runs in views let go and not taken again, and
//! then a block that no free run holds is given new units (one run, no
//! call) within a wider share above the allocated bytes ([`Arena::WIDE_SLACK`]) before a
//! view is made for it, until its credit is full again ([`Arena::hungry`]; the trim policy
//! leaves the free units of a hungry arena be meanwhile): memory is bought for speed only
//! where the views would not be used again. Never past the allocator's bound, though: the
//! wider share stops at `stitch_grow_slack` above the *peak* allocated bytes, since a first
//! step may look just like such a workload (a KV cache grown token by token makes a view for
//! every block, each a size no earlier one had, and lets it go unused until the next step:
//! `tests/generated_traces.rs`). A workload that keeps reaching new peaks with its free
//! units scattered pays in `mmap`s.
//!
//! This file holds the arena's state and arithmetic ([`Arena`]); the pool decides when to use
//! it (`pool/stitched.rs`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::bitmap::{bit, count, set, words};
use super::block::BlockId;
use super::free_runs::FreeRuns;
use super::quick::FxBuild;
use crate::error::{Error, Result};
use crate::segment::Segment;

/// How many runs (kernel mappings) the cached views of one arena may hold before the oldest
/// are let go.
pub(crate) const MAX_CACHED_RUNS: usize = 8192;

/// Kernel mappings the stitched views of all the process's arenas may hold together: half of
/// Linux's default `vm.max_map_count` (65,530), the rest left to everything else (threads,
/// heaps, libraries). A view that would take the count past it is not made.
pub(crate) const MAX_MAPPED_RUNS: usize = 32_768;

/// Runs mapped by the stitched views (live and cached) of every arena of the process.
static MAPPED_RUNS: AtomicUsize = AtomicUsize::new(0);

/// An arena's reservation is made as for at least this much allowed memory (4 GiB: 16 GiB of
/// address space, half of it the home region, half the views'; a thousand queues' arenas
/// take 16 TiB of the 128 TiB a process has), whatever the allowed memory:
/// the memory stays bounded by the allowed memory, but the views of a periodic workload,
/// cached between its steps, need address space beyond it (a KV cache grown token by token
/// caches a view of every size its blocks passed through), and a reservation of four times
/// a small allowed memory let them go and mapped them again every step (152 `mmap`s in 9
/// warm steps at a capacity of its own peak: `tests/hostile_review34.rs`). Address space
/// costs page tables only where a view is mapped.
pub(crate) const MIN_RESERVED: u64 = 4 << 30;

/// Runs the stitched views of every arena of the process map now.
pub(crate) fn mapped_runs() -> usize {
    MAPPED_RUNS.load(Ordering::Relaxed)
}

/// The most runs (each one `mmap` and one kernel mapping) a stitched view is made of when
/// the memory could grow instead: free memory split finer than that is left for blocks that
/// fit its runs, and the block takes new units (see [`Arena::grow_plan`]). Under the allowed
/// memory's limit a view may take more, since it then serves a request that would fail.
pub(crate) const MAX_VIEW_RUNS: usize = 256;

/// Blocks of at least this many units go to the arena; smaller ones are packed into the
/// pools' segments. A block wastes less than a unit here, so at most a quarter of its size.
/// (One unit would bound the waste only by the unit: a workload of blocks just over a unit
/// wastes nearly half. Blocks below the threshold stay in the small pool, whose cached pages
/// the arena cannot use: a smaller unit, not a lower threshold, sends more of them here.)
pub(crate) const MIN_UNITS: usize = 4;

/// The map credit an arena starts with and can hold at most, in runs (`mmap`s): what the
/// first steps of a periodic workload need to make their views (the ten traces of
/// `examples/torch-traces` make at most about 500) without being held back, and at about 2.5 µs
/// a run (measured: `benches/allocator.rs`, the random workload) a few milliseconds of calls
/// for one that never repeats before it is.
pub(crate) const MAP_CREDIT_RUNS: u64 = 1024;

/// Blocks handed out by an arena that earn one run of map credit. A run costs 4-10 µs all
/// told (the `mmap`, the eviction's `munmap`, the pool's search for a view; measured on the
/// random workload of `benches/allocator.rs`: 18,773 runs cost about 100 ms more than 400,
/// and its first 1,411 runs about 7 µs each), about as much as 50-100 home blocks, so a
/// workload that spends all it earns spends at most about a sixth of its time on views.
pub(crate) const EARN_EVERY: u64 = 512;

/// A full map credit, in [`EARN_EVERY`]ths of a run.
const FULL: u64 = MAP_CREDIT_RUNS * EARN_EVERY;

/// One view: where it is in the reservation and which units it shows, in runs
/// `(first unit, count)` in address order.
#[derive(Debug, Clone)]
pub(crate) struct View {
    /// Byte offset of the view in the reservation.
    pub(crate) va: usize,
    /// Units it shows.
    pub(crate) n: usize,
    runs: Vec<(u32, u32)>,
    /// Handed out (its units are busy).
    live: bool,
    /// When it was last let go (the arena's clock), for evicting the oldest.
    freed_at: u64,
    /// When it was made (the arena's clock): cached views are taken oldest first.
    born: u64,
    /// The unit that was busy when the view was last found blocked: while it still is, the
    /// view is passed over with one bit test (most cached views stay blocked by the same live
    /// block for a while).
    watch: u32,
}

impl View {
    /// Handed out.
    pub(crate) fn is_live(&self) -> bool {
        self.live
    }

    /// The units it shows, as runs `(first unit, count)` in address order.
    pub(crate) fn runs(&self) -> &[(u32, u32)] {
        &self.runs
    }
}

/// The units a new block will show, and how many of them are given back or new.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    /// The first run `(first unit, count)`; the only one of a home block.
    first: (u32, u32),
    /// The other runs of a stitched view, in address order (none for a home block: no
    /// allocation on that path).
    more: Vec<(u32, u32)>,
    rebacked: usize,
    grown: usize,
}

impl Plan {
    fn runs(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        std::iter::once(self.first).chain(self.more.iter().copied())
    }

    /// How many runs (`mmap`s, for a stitched view) it takes.
    pub(crate) fn run_count(&self) -> usize {
        1 + self.more.len()
    }
}

/// A block just made: its byte offset in the reservation, its view if it is stitched (none
/// for a home block), and what it cost.
pub(crate) type NewBlock = (usize, Option<View>, Made);

/// What making a view cost: the calls and the memory it added.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Made {
    /// `mmap` calls (one per run).
    pub(crate) maps: usize,
    /// Units that were given back earlier and are taken again (reserved bytes grow).
    pub(crate) rebacked: usize,
    /// Units never used before (reserved bytes grow).
    pub(crate) grown: usize,
}

/// The state of one arena (see the module docs).
pub(crate) struct Arena {
    unit: usize,
    /// log2 of `unit` (a power of two): the hot paths shift instead of dividing.
    shift: u32,
    /// Bytes of the reservation (address space for views) and of the memfd (units).
    reserved_len: usize,
    /// Units that exist: `[0, len)` (used at least once).
    len: usize,
    /// One bit per unit, set while it is given back (punched); only free units are.
    holes: Vec<u64>,
    n_holes: usize,
    /// Units the home region (and so the memfd) holds: `[0, home_units)`.
    home_units: usize,
    /// The free units (not busy) of `[0, len)` as maximal runs, by size class.
    free: FreeRuns,
    /// Home blocks handed out (they have no view: a block at home offset `o` of `n` units
    /// shows units `[o / unit, o / unit + n)`).
    home_live: usize,
    /// The stitched views, live and cached.
    views: HashMap<BlockId, View, FxBuild>,
    /// Views not handed out, by unit count, as `(born, id)` in order (oldest first).
    cached: HashMap<usize, Vec<(u64, BlockId)>, FxBuild>,
    /// The same views by `(freed_at, id)`: the order they are let go in (oldest first),
    /// without sorting them all at each eviction.
    by_age: BTreeSet<(u64, BlockId)>,
    /// Runs the cached views hold.
    cached_runs: usize,
    /// Runs all its stitched views (live and cached) map: its part of [`MAPPED_RUNS`].
    mapped_runs: usize,
    /// Free address ranges below `va_top`: offset -> length.
    va_free: BTreeMap<usize, usize>,
    /// The same ranges by `(length, offset)`, for best fit.
    va_by_len: BTreeSet<(usize, usize)>,
    /// Address space handed to views so far (the high-water mark).
    va_top: usize,
    clock: u64,
    /// Map credit, in [`EARN_EVERY`]ths of a run (see the module docs).
    credit: u64,
    /// Set when a view was wanted that the credit could not pay for; it holds until the
    /// credit is full again (see [`Arena::hungry`]).
    hungry: bool,
}

impl Arena {
    /// The state of an arena over `seg` (a reservation over a sparse memfd of the same
    /// length, nothing mapped), with units of `unit` bytes.
    pub(crate) fn new(seg: &Segment, unit: usize) -> Result<Self> {
        seg.start_stitched()?;
        let reserved_len = seg.mapping().map_or(0, crate::mapping::Mapping::reserved_len);
        // The home region: the first half of the reservation shows the memfd in order, with
        // one `mmap` now (a sparse file: no memory until a block's pages are touched).
        let home_units = (reserved_len / 2 / unit).min(u32::MAX as usize);
        if home_units > 0 {
            seg.map_view(0, 0, home_units * unit)?;
        }
        debug_assert!(unit.is_power_of_two());
        Ok(Self {
            unit,
            shift: unit.trailing_zeros(),
            reserved_len,
            len: 0,
            holes: Vec::new(),
            n_holes: 0,
            home_units,
            free: FreeRuns::with_capacity(home_units),
            home_live: 0,
            views: HashMap::default(),
            cached: HashMap::default(),
            by_age: BTreeSet::new(),
            cached_runs: 0,
            mapped_runs: 0,
            va_free: BTreeMap::new(),
            va_by_len: BTreeSet::new(),
            va_top: home_units * unit,
            clock: 0,
            credit: FULL,
            hungry: false,
        })
    }

    /// The share above the allocated bytes an arena out of map credit may grow within rather
    /// than map a view, below `stitch_grow_slack` above the peak allocated bytes (the pool
    /// checks): where a workload of random sizes and lifetimes has fallen below its peak, it
    /// maps nothing (the random workload of `benches/allocator.rs`, 400,000 operations: about
    /// 400 runs with this slack from the start and no bound at the peak; 1,821 with the credit
    /// first; 10,805 bound at the peak, as now; 18,000 with the default `stitch_grow_slack`
    /// alone).
    pub(crate) const WIDE_SLACK: f64 = 0.1;

    /// Whether the map credit pays for a view of `runs` runs.
    pub(crate) fn has_map_credit(&self, runs: usize) -> bool {
        self.credit >= runs as u64 * EARN_EVERY
    }

    /// Map credit in whole runs.
    #[cfg(test)]
    pub(crate) fn map_credit(&self) -> u64 {
        self.credit / EARN_EVERY
    }

    /// Spends all the map credit (as a workload that never repeats would have).
    #[cfg(test)]
    pub(crate) fn spend_map_credit(&mut self) {
        self.credit = 0;
    }

    /// Whether the arena is out of map credit: a view was wanted that the credit could not
    /// pay for, and the credit has not been full since (a workload whose views are not used
    /// again). It then grows within [`Arena::WIDE_SLACK`] rather than map, and the trim policy
    /// does not count its free units (`Pool::budget`: punching the pools' pages would not
    /// bring them back).
    pub(crate) fn hungry(&self) -> bool {
        self.hungry && self.credit < FULL
    }

    /// A view of `runs` runs was wanted: without the credit for it, and with at least a full
    /// credit's worth of runs in views cached unused (the credit went into views that were let
    /// go and not taken again: no repetition), the arena is hungry. Credit spent on views
    /// still in use is not enough: the first step of a periodic workload may map more than
    /// the credit holds for blocks that all live to its end (`tests/hostile_review28.rs`),
    /// and growing for them would take its peak reserved bytes past 3% of its allocated.
    pub(crate) fn want_map(&mut self, runs: usize) {
        if !self.has_map_credit(runs) && self.cached_runs as u64 >= MAP_CREDIT_RUNS {
            self.hungry = true;
        }
    }

    /// A block handed out: it earns its share of a run.
    #[inline]
    fn earn(&mut self) {
        if self.credit < FULL {
            self.credit += 1;
        } else {
            self.hungry = false;
        }
    }

    /// `runs` runs of map credit given back (a cached view taken again) or spent (a view made).
    fn credit_runs(&mut self, runs: usize, back: bool) {
        if self.credit >= FULL {
            self.hungry = false;
        }
        let c = runs as u64 * EARN_EVERY;
        self.credit = if back { (self.credit + c).min(FULL) } else { self.credit.saturating_sub(c) };
        if self.credit >= FULL {
            self.hungry = false;
        }
    }

    /// Bytes of the home region (the start of the stitched views' address space).
    pub(crate) fn home_bytes(&self) -> usize {
        self.home_units * self.unit
    }

    /// Whether a block at byte `off` of the reservation is a home block (its units are
    /// `[off / unit, off / unit + n)`, and `off` is their offset in the memfd).
    #[inline]
    pub(crate) fn is_home(&self, off: usize) -> bool {
        off < self.home_bytes()
    }

    /// Units used so far (`[0, units)`).
    pub(crate) fn units(&self) -> usize {
        self.len
    }

    /// Bytes per unit.
    pub(crate) fn unit(&self) -> usize {
        self.unit
    }

    /// The units a block of `size` bytes takes.
    #[inline]
    pub(crate) fn units_for(&self, size: usize) -> usize {
        (size >> self.shift) + usize::from(size & (self.unit - 1) != 0)
    }

    /// Bytes of memory the arena holds free: its free units, less those given back.
    pub(crate) fn free_backed_bytes(&self) -> usize {
        (self.free.free_units() - self.n_holes) * self.unit
    }

    /// Bytes of memory the arena holds: the units used so far, less those given back.
    pub(crate) fn backed_bytes(&self) -> usize {
        (self.len - self.n_holes) * self.unit
    }

    /// Whether any view is handed out.
    pub(crate) fn has_live(&self) -> bool {
        self.home_live > 0 || self.views.values().any(|v| v.live)
    }

    /// The view of block `id`.
    pub(crate) fn view(&self, id: BlockId) -> Option<&View> {
        self.views.get(&id)
    }

    /// Views (live and cached), for the snapshot.
    pub(crate) fn views(&self) -> impl Iterator<Item = (BlockId, &View)> {
        self.views.iter().map(|(&id, v)| (id, v))
    }

    /// The first busy unit the view shows, if any.
    fn first_busy(&self, v: &View) -> Option<u32> {
        for &(u, k) in &v.runs {
            let mut found = None;
            words(u as usize, (u + k) as usize, |w, m| {
                let b = !self.free.free_word(w) & m;
                if found.is_none() && b != 0 {
                    found = Some((w * 64) as u32 + b.trailing_zeros());
                }
            });
            if found.is_some() {
                return found;
            }
        }
        None
    }

    fn holes_under(&self, v: &View) -> usize {
        v.runs.iter().map(|&(u, k)| count(&self.holes, u as usize, (u + k) as usize)).sum()
    }

    /// A cached view of `n` units whose units are all free, the oldest first,
    /// whose units given back (taken again when it is handed out) are at most `max_holes`;
    /// with how many those are.
    pub(crate) fn find_cached(&mut self, n: usize, max_holes: usize) -> Option<(BlockId, usize)> {
        let list = self.cached.get(&n)?;
        for &(_, id) in list {
            let v = &self.views[&id];
            if !self.free.is_free(v.watch) {
                continue;
            }
            if let Some(unit) = self.first_busy(v) {
                self.views.get_mut(&id).expect("listed").watch = unit;
                continue;
            }
            let h = if self.n_holes == 0 { 0 } else { self.holes_under(v) };
            if h <= max_holes {
                return Some((id, h));
            }
        }
        None
    }

    /// Hands out cached view `id`: its units become busy, those given back are backed again
    /// (touching them brings them back, with no call). Returns how many were.
    pub(crate) fn take(&mut self, id: BlockId) -> usize {
        let v = self.views.get_mut(&id).expect("a cached view");
        debug_assert!(!v.live);
        v.live = true;
        let (n, key) = (v.n, (v.born, id));
        self.by_age.remove(&(v.freed_at, id));
        let list = self.cached.get_mut(&n).expect("its size's list");
        let at = list.binary_search(&key).expect("listed");
        list.remove(at);
        let v = &self.views[&id];
        self.cached_runs -= v.runs.len();
        let mut rebacked = 0;
        for &(u, k) in &v.runs {
            let (from, to) = (u as usize, (u + k) as usize);
            if self.n_holes > 0 {
                rebacked += set(&mut self.holes, from, to, false);
            }
        }
        for i in 0..self.views[&id].runs.len() {
            let (u, k) = self.views[&id].runs[i];
            self.free.occupy(u, k);
        }
        self.n_holes -= rebacked;
        let runs = self.views[&id].runs.len();
        self.earn();
        self.credit_runs(runs, true);
        rebacked
    }

    /// The home block at byte `off` of `n` units is freed: its units are free (merged into
    /// the free runs), and nothing is left of it here (the address table marks where it was,
    /// for double frees).
    #[inline]
    pub(crate) fn release_home(&mut self, off: usize, n: usize) {
        let (u, k) = ((off >> self.shift) as u32, n as u32);
        debug_assert!(self.is_home(off) && off % self.unit == 0);
        self.home_live -= 1;
        self.free.vacate(u, k);
    }

    /// Block `id`'s view is let go by its block (freed): its units are free, the view cached.
    pub(crate) fn release(&mut self, id: BlockId) {
        self.clock += 1;
        let clock = self.clock;
        let v = self.views.get_mut(&id).expect("a view");
        debug_assert!(v.live);
        v.live = false;
        v.freed_at = clock;
        let (n, runs, key) = (v.n, v.runs.len(), (v.born, id));
        for i in 0..runs {
            let (u, k) = self.views[&id].runs[i];
            self.free.vacate(u, k);
        }
        let list = self.cached.entry(n).or_default();
        let at = list.binary_search(&key).expect_err("not listed while live");
        list.insert(at, key);
        self.by_age.insert((clock, id));
        self.cached_runs += runs;
    }

    /// Calls `f(first, count)` for the maximal runs of units in `[0, len)` whose bit is set in
    /// `word(w)`, lowest first, until it says stop; a word at a time.
    fn scan_runs(&self, word: impl Fn(usize) -> u64, mut f: impl FnMut(usize, usize) -> ControlFlow<()>) {
        let mut open: Option<(usize, usize)> = None;
        for w in 0..self.len.div_ceil(64) {
            let valid = if (w + 1) * 64 <= self.len { !0 } else { (1u64 << (self.len % 64)) - 1 };
            let mut bits = word(w) & valid;
            if bits == 0 {
                if let Some(r) = open.take() {
                    if f(r.0, r.1).is_break() {
                        return;
                    }
                }
                continue;
            }
            while bits != 0 {
                let start = bits.trailing_zeros() as usize;
                let len = (!(bits >> start)).trailing_zeros() as usize;
                let at = w * 64 + start;
                match open {
                    Some(ref mut r) if r.0 + r.1 == at => r.1 += len,
                    _ => {
                        if let Some(r) = open.take() {
                            if f(r.0, r.1).is_break() {
                                return;
                            }
                        }
                        open = Some((at, len));
                    }
                }
                bits = if start + len >= 64 { 0 } else { bits & !(((1u64 << len) - 1) << start) };
            }
        }
        if let Some(r) = open {
            let _ = f(r.0, r.1);
        }
    }

    /// The units a new block of `n` units would show, in runs, and what they cost (units given
    /// back and taken again, new units): the smallest free run that holds `n` (a home block:
    /// no call at all); else free runs lowest first (a stitched view, one `mmap` a run); and
    /// only if the free units are fewer than `n`, new units past the end as well (so memory
    /// grows only when the free memory, wherever it lies, cannot hold the block).
    fn pick(&self, n: usize) -> Plan {
        if self.n_holes > 0 {
            return self.pick_around_holes(n);
        }
        if let Some((plan, _)) = self.home_fit(n) {
            return plan;
        }
        let mut runs = Vec::new();
        let left = self.free.take_fewest(n as u32, &mut runs);
        self.finish(runs, left)
    }

    /// [`Arena::pick`] while some free units are given back (after `empty_cache`, garbage
    /// collection or the OOM ladder): backed free units first, in one run if one holds the
    /// block, else as few runs as can be; then units given back, lowest first (taking them
    /// costs memory again); then new units. A walk over the bitmaps, not the run index, which
    /// does not tell given-back units apart.
    fn pick_around_holes(&self, n: usize) -> Plan {
        let mut backed = Vec::new();
        self.scan_runs(
            |w| self.free.free_word(w) & !self.holes[w],
            |u, k| {
                backed.push((k as u32, u as u32));
                ControlFlow::Continue(())
            },
        );
        backed.sort_unstable_by(|a, b| b.cmp(a));
        let mut runs = Vec::new();
        let mut left = take_fewest(&backed, n as u32, &mut runs);
        if left > 0 {
            self.scan_runs(
                |w| self.free.free_word(w) & self.holes[w],
                |u, k| {
                    let k = (k as u32).min(left);
                    runs.push((u as u32, k));
                    left -= k;
                    if left == 0 { ControlFlow::Break(()) } else { ControlFlow::Continue(()) }
                },
            );
        }
        self.finish(runs, left)
    }

    /// A plan of the free units `runs` and `left` new ones: in address order, touching runs
    /// merged (one run is a home block), with the units it takes back counted.
    fn finish(&self, mut runs: Vec<(u32, u32)>, left: u32) -> Plan {
        runs.sort_unstable();
        let mut merged: Vec<(u32, u32)> = Vec::with_capacity(runs.len() + 1);
        for (u, k) in runs {
            match merged.last_mut() {
                Some(r) if r.0 + r.1 == u => r.1 += k,
                _ => merged.push((u, k)),
            }
        }
        let rebacked = if self.n_holes == 0 {
            0
        } else {
            merged.iter().map(|&(u, k)| count(&self.holes, u as usize, (u + k) as usize)).sum()
        };
        let grown = left as usize;
        if grown > 0 {
            match merged.last_mut() {
                Some(r) if (r.0 + r.1) as usize == self.len => r.1 += left,
                _ => merged.push((self.len as u32, left)),
            }
        }
        let first = merged.remove(0);
        Plan { first, more: merged, rebacked, grown }
    }

    /// A home block of `n` units in the smallest free run that holds it (while units are
    /// given back: one of backed units first), if there is one: its plan and what it adds to
    /// the reserved bytes (its units given back).
    pub(crate) fn home_fit(&self, n: usize) -> Option<(Plan, usize)> {
        if self.n_holes > 0 {
            let plan = self.pick_around_holes(n);
            let cost = plan.rebacked * self.unit;
            return (plan.more.is_empty() && plan.grown == 0).then_some((plan, cost));
        }
        let n = u32::try_from(n).ok()?;
        let (s, _) = self.free.fit(n)?;
        Some((Plan { first: (s, n), more: Vec::new(), rebacked: 0, grown: 0 }, 0))
    }

    /// The free run a home block of `n` units takes, as [`Arena::home_fit`] finds it where no
    /// unit is given back (nothing to take again, so no cost); `None` otherwise (units given
    /// back, or no free run holds `n`), for the general path to decide.
    #[inline]
    pub(crate) fn home_fit_backed(&self, n: usize) -> Option<u32> {
        if self.n_holes > 0 {
            return None;
        }
        self.free.fit(u32::try_from(n).ok()?).map(|(s, _)| s)
    }

    /// Makes the home block of `n` units at free, backed units `[s, s + n)` (from
    /// [`Arena::home_fit_backed`]), as [`Arena::make`] makes a one-run home plan; returns its
    /// offset in the reservation.
    #[inline]
    pub(crate) fn make_home(&mut self, s: u32, n: usize) -> usize {
        debug_assert!(self.n_holes == 0 && (s as usize) + n <= self.len);
        self.free.occupy(s, n as u32);
        self.home_live += 1;
        self.earn();
        (s as usize) << self.shift
    }

    /// A block of `n` units made by growing: the free run at the end (if any) and new units
    /// after it, one run (a home block), and what it adds to the reserved bytes.
    pub(crate) fn grow_plan(&self, n: usize) -> (Plan, usize) {
        let start = if self.len > 0 && self.free.is_free(self.len as u32 - 1) {
            self.free.run_start(self.len as u32 - 1)
        } else {
            self.len as u32
        };
        let have = (self.len - start as usize).min(n);
        // Only the units it takes: the free run at the end may be longer than the block.
        let rebacked = if self.n_holes == 0 { 0 } else { count(&self.holes, start as usize, start as usize + have) };
        let grown = n - have;
        let plan = Plan { first: (start, n as u32), more: Vec::new(), rebacked, grown };
        (plan, (rebacked + grown) * self.unit)
    }

    /// Whether the memfd has room for the new units `plan` takes.
    pub(crate) fn has_room(&self, plan: &Plan) -> bool {
        self.len + plan.grown <= self.home_units
    }

    /// The units a new view of `n` units would show, for [`Arena::make`], and what it would
    /// add to the reserved bytes (units given back and taken again, and new ones).
    pub(crate) fn plan(&self, n: usize) -> (Plan, usize) {
        let plan = self.pick(n);
        let cost = (plan.rebacked + plan.grown) * self.unit;
        (plan, cost)
    }

    /// Address space for a view of `len` bytes: the first free range that holds it, else past
    /// the high-water mark.
    fn va_alloc(&mut self, len: usize) -> Option<usize> {
        if let Some(&(l, at)) = self.va_by_len.range((len, 0)..).next() {
            self.va_take(at, l);
            if l > len {
                self.va_put(at + len, l - len);
            }
            return Some(at);
        }
        let at = self.va_top;
        if at + len > self.reserved_len {
            return None;
        }
        self.va_top += len;
        Some(at)
    }

    fn va_take(&mut self, at: usize, len: usize) {
        self.va_free.remove(&at);
        self.va_by_len.remove(&(len, at));
    }

    fn va_put(&mut self, at: usize, len: usize) {
        self.va_free.insert(at, len);
        self.va_by_len.insert((len, at));
    }

    fn va_release(&mut self, mut at: usize, mut len: usize) {
        if let Some((&p, &pl)) = self.va_free.range(..at).next_back() {
            if p + pl == at {
                self.va_take(p, pl);
                at = p;
                len += pl;
            }
        }
        if let Some(&nl) = self.va_free.get(&(at + len)) {
            self.va_take(at + len, nl);
            len += nl;
        }
        if at + len == self.va_top {
            self.va_top = at;
        } else {
            self.va_put(at, len);
        }
    }

    /// Makes a new block of the units `plan` names ([`Arena::plan`] or [`Arena::home_fit`],
    /// made since nothing else changed), handed out (its units busy; [`Arena::adopt`] files
    /// it): one run is a home block, at its units' own address with no call; several are a
    /// stitched view, with address space from the free ranges and one `mmap` per run. `None`
    /// if that address space is full (the pool lets the oldest cached views go and tries
    /// again); on failure nothing changed.
    pub(crate) fn make(&mut self, seg: &Segment, plan: &Plan) -> Result<Option<NewBlock>> {
        let &Plan { first, rebacked, grown, .. } = plan;
        let n = plan.runs().map(|r| r.1 as usize).sum::<usize>();
        if self.len + grown > self.home_units {
            return Err(Error::Unsupported { what: "the arena's memfd is full".into() });
        }
        let bytes = n * self.unit;
        let home = plan.more.is_empty();
        let va = if home {
            first.0 as usize * self.unit
        } else {
            let Some(va) = self.va_alloc(bytes) else { return Ok(None) };
            let mut at = va;
            for (u, k) in plan.runs() {
                let len = k as usize * self.unit;
                if let Err(e) = seg.map_view(at, u as usize * self.unit, len) {
                    // Nothing is handed out over the part mapped so far: give it back. If even
                    // that fails, the range keeps showing units no block owns there, and its
                    // address space is not used again.
                    if at == va || seg.unmap_view(va, at - va).is_ok() {
                        self.va_release(va, bytes);
                    } else {
                        log::warn!("dmabuf-rt: unmapping a stitched view that failed half-way failed too");
                    }
                    return Err(e);
                }
                at += len;
            }
            va
        };
        if grown > 0 {
            let (old, new_len) = (self.len, self.len + grown);
            let words = new_len.div_ceil(64);
            self.holes.resize(words, 0);
            self.len = new_len;
            self.free.grow(new_len);
            self.free.vacate(old as u32, grown as u32);
        }
        for (u, k) in plan.runs() {
            let (from, to) = (u as usize, (u + k) as usize);
            if self.n_holes > 0 {
                self.n_holes -= set(&mut self.holes, from, to, false);
            }
            self.free.occupy(u, k);
        }
        if home {
            self.home_live += 1;
            self.earn();
            return Ok(Some((va, None, Made { maps: 0, rebacked, grown })));
        }
        let runs: Vec<(u32, u32)> = plan.runs().collect();
        let maps = runs.len();
        self.earn();
        self.credit_runs(maps, false);
        self.mapped_runs += maps;
        MAPPED_RUNS.fetch_add(maps, Ordering::Relaxed);
        self.clock += 1;
        let born = self.clock;
        let watch = first.0;
        let view = View { va, n, runs, live: true, freed_at: 0, born, watch };
        Ok(Some((va, Some(view), Made { maps, rebacked, grown })))
    }

    /// Files a view just made ([`Arena::make`]) as block `id`'s.
    pub(crate) fn adopt(&mut self, id: BlockId, view: View) {
        debug_assert!(view.live);
        self.views.insert(id, view);
    }

    /// Lets go of cached view `id`: its range shows no unit any more (one call) and its address
    /// space is free for later views.
    /// Returns its address range, for the pool's tables.
    pub(crate) fn evict(&mut self, seg: &Segment, id: BlockId) -> (usize, usize) {
        let v = self.views.remove(&id).expect("a view");
        debug_assert!(!v.live, "only cached views are let go");
        let list = self.cached.get_mut(&v.n).expect("its size's list");
        list.retain(|&(_, c)| c != id);
        if list.is_empty() {
            self.cached.remove(&v.n);
        }
        self.by_age.remove(&(v.freed_at, id));
        self.cached_runs -= v.runs.len();
        let bytes = v.n * self.unit;
        if seg.unmap_view(v.va, bytes).is_err() {
            // Still mapped: still counted.
            // The range keeps showing units it no longer owns, unreachable (no block lies
            // there); its address space is not reused.
            log::warn!("dmabuf-rt: letting go of a stitched view failed; its address space is not reused");
            return (v.va, bytes);
        }
        self.mapped_runs -= v.runs.len();
        MAPPED_RUNS.fetch_sub(v.runs.len(), Ordering::Relaxed);
        self.va_release(v.va, bytes);
        (v.va, bytes)
    }

    /// The cached views to let go, oldest first, so that at most `keep_runs` runs stay cached.
    pub(crate) fn oldest_cached(&self, keep_runs: usize) -> Vec<BlockId> {
        let mut runs = self.cached_runs;
        let mut out = Vec::new();
        for &(_, id) in &self.by_age {
            if runs <= keep_runs {
                break;
            }
            runs -= self.views[&id].runs.len();
            out.push(id);
        }
        out
    }

    /// The cached view let go longest ago.
    pub(crate) fn oldest(&self) -> Option<BlockId> {
        self.by_age.first().map(|&(_, id)| id)
    }

    /// Whether the cached views hold more runs than [`MAX_CACHED_RUNS`].
    pub(crate) fn over_run_budget(&self) -> bool {
        self.cached_runs > MAX_CACHED_RUNS
    }

    /// Every cached view (not handed out), for letting them all go.
    pub(crate) fn cached_ids(&self) -> Vec<BlockId> {
        self.by_age.iter().map(|&(_, id)| id).collect()
    }

    /// The runs `(first unit, count)` of free backed units, lowest first.
    pub(crate) fn free_backed_runs(&self) -> Vec<(usize, usize)> {
        let mut runs = Vec::new();
        self.scan_runs(
            |w| self.free.free_word(w) & !self.holes[w],
            |u, k| {
                runs.push((u, k));
                ControlFlow::Continue(())
            },
        );
        runs
    }

    /// Gives free backed units back to the kernel, the largest runs first (one
    /// `fallocate(PUNCH_HOLE)` per run), until at least `want` bytes went (`usize::MAX`: all of
    /// them); returns the bytes released and the calls made.
    pub(crate) fn punch_largest(&mut self, seg: &Segment, want: usize) -> (usize, usize) {
        let mut runs = self.free_backed_runs();
        runs.sort_unstable_by_key(|&(u, k)| (std::cmp::Reverse(k), u));
        let (mut bytes, mut calls) = (0, 0);
        for (u, k) in runs {
            if bytes >= want {
                break;
            }
            if seg.punch(u * self.unit, k * self.unit).is_err() {
                continue;
            }
            calls += 1;
            set(&mut self.holes, u, u + k, true);
            self.n_holes += k;
            bytes += k * self.unit;
        }
        (bytes, calls)
    }

    /// Checks the state against the arena's blocks, `(id, offset, size, live)`: home blocks are
    /// live, at their units, with no view; every other block has its view at its offset, big
    /// enough; live blocks show disjoint busy units and only they do; no busy unit is given
    /// back; the free-run index is the free units' runs; the cached lists hold exactly the
    /// cached views; the counts match the bitmaps.
    pub(crate) fn check(&self, blocks: &[(BlockId, usize, usize, bool)]) -> std::result::Result<(), String> {
        let mut shown = vec![false; self.len];
        let mut show = |id: BlockId, runs: &[(u32, u32)]| -> std::result::Result<(), String> {
            for &(u, k) in runs {
                let (from, to) = (u as usize, (u + k) as usize);
                let Some(units) = shown.get_mut(from..to) else {
                    return Err(format!("block {id} shows units past the end"));
                };
                if let Some(i) = units.iter_mut().position(|s| std::mem::replace(s, true)) {
                    return Err(format!("unit {} is shown by two live blocks", from + i));
                }
            }
            Ok(())
        };
        let (mut runs, mut homes, mut stitched) = (0, 0, 0);
        for &(id, off, size, live) in blocks {
            if self.is_home(off) {
                // A home block: live, at its units' own address, with no view.
                if !live || off % self.unit != 0 || self.views.contains_key(&id) {
                    return Err(format!("home block {id} ({off}, {size}) is cached, misplaced or has a view"));
                }
                show(id, &[((off / self.unit) as u32, self.units_for(size) as u32)])?;
                homes += 1;
                continue;
            }
            stitched += 1;
            let Some(v) = self.views.get(&id) else { return Err(format!("block {id} has no view")) };
            if v.va != off || v.n != self.units_for(size) || v.live != live {
                return Err(format!("block {id} ({off}, {size}, live {live}) does not match its view {v:?}"));
            }
            if v.runs.iter().map(|r| r.1 as usize).sum::<usize>() != v.n {
                return Err(format!("view of block {id} shows other than {} units", v.n));
            }
            if v.runs.len() < 2 {
                return Err(format!("stitched view of block {id} shows one run: {v:?}"));
            }
            if live {
                show(id, &v.runs)?;
            } else {
                runs += v.runs.len();
                if self.cached.get(&v.n).is_none_or(|l| l.binary_search(&(v.born, id)).is_err()) {
                    return Err(format!("cached view of block {id} is not listed"));
                }
            }
            if v.va + v.n * self.unit > self.va_top
                || self.va_free.range(..v.va + v.n * self.unit).any(|(&a, &l)| a + l > v.va)
            {
                return Err(format!("view of block {id} overlaps free address space"));
            }
        }
        if homes != self.home_live || stitched != self.views.len() {
            return Err(format!(
                "{homes} home blocks and {stitched} views for {} and {}",
                self.home_live,
                self.views.len()
            ));
        }
        for (i, &shown) in shown.iter().enumerate() {
            if self.free.is_free(i as u32) == shown {
                return Err(format!("unit {i}: free {} but shown by a live block {shown}", !shown));
            }
            if shown && bit(&self.holes, i) {
                return Err(format!("unit {i} is in use and given back"));
            }
        }
        if count(&self.holes, 0, self.len) != self.n_holes {
            return Err("the given-back count does not match the bitmap".into());
        }
        if self.free.units() != self.len {
            return Err(format!("the free-run index covers {} units of {}", self.free.units(), self.len));
        }
        self.free.check().map_err(|why| format!("the free-run index: {why}"))?;
        if self.va_by_len.len() != self.va_free.len()
            || self.va_free.iter().any(|(&a, &l)| !self.va_by_len.contains(&(l, a)))
        {
            return Err("the free address ranges' two indexes differ".into());
        }
        let cached = self.views.values().filter(|v| !v.live).count();
        if runs != self.cached_runs
            || self.cached.values().map(Vec::len).sum::<usize>() != cached
            || self.by_age.len() != cached
            || self.by_age.iter().any(|&(at, id)| self.views.get(&id).is_none_or(|v| v.live || v.freed_at != at))
        {
            return Err("the cached lists do not match the cached views".into());
        }
        Ok(())
    }
}

impl Drop for Arena {
    /// Its views go with its reservation (unmapped with it).
    fn drop(&mut self) {
        MAPPED_RUNS.fetch_sub(self.mapped_runs, Ordering::Relaxed);
    }
}

/// Takes units out of the free runs `longest_first` (as `(length, first unit)`, the longest
/// first) for a block of `n` units, with as few runs (`mmap`s) as can be: the longest runs,
/// until the smallest one (the lowest of those) that holds the rest. Pushes `(first, count)`
/// runs onto `out`; returns the units still missing.
fn take_fewest(longest_first: &[(u32, u32)], n: u32, out: &mut Vec<(u32, u32)>) -> u32 {
    let mut left = n;
    let mut i = 0;
    while left > 0 {
        let holding = longest_first[i..].partition_point(|&(k, _)| k >= left);
        if holding > 0 {
            out.push((longest_first[i + holding - 1].1, left));
            return 0;
        }
        let Some(&(k, s)) = longest_first.get(i) else { break };
        out.push((s, k));
        left -= k;
        i += 1;
    }
    left
}
