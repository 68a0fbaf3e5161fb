//! Allocator statistics: PyTorch's `DeviceStats` schema, and seed 002's simpler view.

use std::fmt::Write;

use super::block::PoolKind;

/// One counter: its current value, its peak, and the totals added and removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stat {
    /// Current value.
    pub current: i64,
    /// Highest value since the last peak reset.
    pub peak: i64,
    /// Total added since the last accumulated reset.
    pub allocated: i64,
    /// Total removed since the last accumulated reset.
    pub freed: i64,
}

impl Stat {
    pub(crate) fn update(&mut self, amount: i64) {
        if amount >= 0 { self.inc(amount) } else { self.dec(-amount) }
    }

    #[inline(always)]
    pub(crate) fn inc(&mut self, amount: i64) {
        self.current += amount;
        self.peak = self.peak.max(self.current);
        self.allocated += amount;
    }

    #[inline(always)]
    pub(crate) fn dec(&mut self, amount: i64) {
        self.current -= amount;
        debug_assert!(self.current >= 0, "stat went negative");
        self.freed += amount;
    }

    pub(crate) fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }

    pub(crate) fn reset_peak(&mut self) {
        self.peak = self.current;
    }
}

/// Which pools a stat covers: index 0 all, 1 the small pool, 2 the large pool.
pub type StatArray = [Stat; 3];

/// Index of the aggregate entry in a [`StatArray`].
pub const AGGREGATE: usize = 0;
/// Index of the small-pool entry.
pub const SMALL_POOL: usize = 1;
/// Index of the large-pool entry.
pub const LARGE_POOL: usize = 2;

/// The aggregate entry and `pool`'s entry, without bounds checks.
#[inline(always)]
fn pair(a: &mut StatArray, pool: PoolKind) -> (&mut Stat, &mut Stat) {
    let [all, small, large] = a;
    (
        all,
        match pool {
            PoolKind::Small => small,
            PoolKind::Large => large,
        },
    )
}

/// Adds `amount` (>= 0) to the aggregate and the pool's entry.
#[inline(always)]
pub(crate) fn inc_array(a: &mut StatArray, pool: PoolKind, amount: i64) {
    let (all, p) = pair(a, pool);
    all.inc(amount);
    p.inc(amount);
}

/// Subtracts `amount` (>= 0) from the aggregate and the pool's entry.
#[inline(always)]
pub(crate) fn dec_array(a: &mut StatArray, pool: PoolKind, amount: i64) {
    let (all, p) = pair(a, pool);
    all.dec(amount);
    p.dec(amount);
}

/// The stats the allocation fast path moves, for one pool (allocation, allocated bytes,
/// requested bytes, inactive split, inactive split bytes: indexed by [`ALLOCATION`] and the
/// others, in an order that keeps each update scalar), kept so that a
/// change costs the fewest instructions. The current value is kept as its distance below the
/// peak (`slack`): an increase subtracts from it and raises the peak only if it went
/// negative, a decrease adds to it. The added total is not kept: it is the current value plus
/// the removed total minus the current value at the last accumulated reset (`base`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Hot {
    /// Peak minus current value.
    slack: [i64; 5],
    peak: [i64; 5],
    freed: [i64; 5],
    /// The current values at the last accumulated reset.
    base: [i64; 5],
}

impl Hot {
    fn current(&self, f: usize) -> i64 {
        self.peak[f] - self.slack[f]
    }

    /// Field `f` as a [`Stat`].
    fn stat(&self, f: usize) -> Stat {
        let current = self.current(f);
        Stat { current, peak: self.peak[f], allocated: current - self.base[f] + self.freed[f], freed: self.freed[f] }
    }
}

/// A pool's field `f` passed its peak (its slack went negative): the current value is the
/// new peak. Out of line: on the fast path peaks are rarely passed.
#[cold]
#[inline(never)]
fn raise(h: &mut Hot, f: usize) {
    h.peak[f] -= h.slack[f];
    h.slack[f] = 0;
}

/// The [`MOVED`] fields of a pool or of the aggregate passed their peaks ([`HotStats::inc3`]): each
/// negative slack is raised as [`raise`] and [`raise_all`] do.
#[cold]
#[inline(never)]
fn raise3(h: &mut Hot, all: &mut [i64; 5]) {
    for f in MOVED {
        if h.slack[f] < 0 {
            raise(h, f);
        }
        if all[f] < 0 {
            raise_all(&mut all[f]);
        }
    }
}

/// The aggregate passed its peak: the current value is the new peak.
#[cold]
#[inline(never)]
fn raise_all(slack: &mut i64) {
    *slack = 0;
}

/// The hot stats: kept per pool. The aggregate ("all") entry is the sum of the two pools
/// for current value and totals, so only its distance below its peak is kept (`all_slack`),
/// moved with every change of either pool.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct HotStats {
    /// Small pool, large pool.
    pools: [Hot; 2],
    /// The aggregate's peak minus its current value, in `Hot` field order.
    all_slack: [i64; 5],
}

impl HotStats {
    /// `pool`'s counters and the aggregate's slack.
    #[inline(always)]
    fn split(&mut self, pool: PoolKind) -> (&mut Hot, &mut [i64; 5]) {
        let [small, large] = &mut self.pools;
        let mine = match pool {
            PoolKind::Small => small,
            PoolKind::Large => large,
        };
        (mine, &mut self.all_slack)
    }

    /// Adds `amount` to field `f` of `h`, raising its peak and the aggregate's if passed.
    #[inline(always)]
    fn inc(h: &mut Hot, all: &mut [i64; 5], f: usize, amount: i64) {
        h.slack[f] -= amount;
        if h.slack[f] < 0 {
            raise(h, f);
        }
        all[f] -= amount;
        if all[f] < 0 {
            raise_all(&mut all[f]);
        }
    }

    /// Subtracts `amount` from field `f` of `h`.
    #[inline(always)]
    fn dec(h: &mut Hot, all: &mut [i64; 5], f: usize, amount: i64) {
        h.slack[f] += amount;
        all[f] += amount;
        h.freed[f] += amount;
        debug_assert!(h.current(f) >= 0, "stat went negative");
    }

    /// Adds one block of `size` bytes asked for as `requested` to the allocation, allocated
    /// bytes and requested bytes of `h` ([`MOVED`]), raising the peaks passed, with one check
    /// for the three.
    #[inline(always)]
    fn inc3(h: &mut Hot, all: &mut [i64; 5], size: i64, requested: i64) {
        let v = [1, size, requested];
        for (f, v) in MOVED.into_iter().zip(v) {
            h.slack[f] -= v;
            all[f] -= v;
        }
        let [a, b, c] = MOVED;
        if (h.slack[a] | h.slack[b] | h.slack[c] | all[a] | all[b] | all[c]) < 0 {
            raise3(h, all);
        }
    }

    /// The reverse of [`HotStats::inc3`].
    #[inline(always)]
    fn dec3(h: &mut Hot, all: &mut [i64; 5], size: i64, requested: i64) {
        let v = [1, size, requested];
        for (f, v) in MOVED.into_iter().zip(v) {
            h.slack[f] += v;
            all[f] += v;
            h.freed[f] += v;
        }
        debug_assert!(MOVED.iter().all(|&f| h.current(f) >= 0), "stat went negative");
    }

    /// A block of `size` bytes handed out for a request of `requested`.
    #[inline(always)]
    pub(crate) fn on_alloc(&mut self, pool: PoolKind, size: i64, requested: i64) {
        let (h, all) = self.split(pool);
        Self::inc3(h, all, size, requested);
    }

    /// The caller let go of a block of `size` bytes asked for as `requested`.
    #[inline(always)]
    pub(crate) fn on_free_request(&mut self, pool: PoolKind, size: i64, requested: i64) {
        let (h, all) = self.split(pool);
        Self::dec3(h, all, size, requested);
    }

    /// A free block of `size` bytes starts (`entering`) or stops counting as inactive split.
    #[inline(always)]
    pub(crate) fn inactive(&mut self, pool: PoolKind, size: i64, entering: bool) {
        let (h, all) = self.split(pool);
        if entering {
            Self::inc(h, all, INACTIVE_SPLIT, 1);
            Self::inc(h, all, INACTIVE_SPLIT_BYTES, size);
        } else {
            Self::dec(h, all, INACTIVE_SPLIT, 1);
            Self::dec(h, all, INACTIVE_SPLIT_BYTES, size);
        }
    }

    /// A quick-cached block of `size` bytes handed out for a request of `requested`: it
    /// leaves inactive split memory if it is `split` (`inactive` then `on_alloc`, choosing
    /// the pool once).
    #[inline(always)]
    pub(crate) fn on_quick_alloc(&mut self, pool: PoolKind, size: i64, requested: i64, split: bool) {
        let (h, all) = self.split(pool);
        if split {
            Self::dec(h, all, INACTIVE_SPLIT, 1);
            Self::dec(h, all, INACTIVE_SPLIT_BYTES, size);
        }
        Self::inc3(h, all, size, requested);
    }

    /// A block of `size` bytes asked for as `requested` freed into the quick cache: it enters
    /// inactive split memory if it is `split` (`on_free_request` then `inactive`, choosing
    /// the pool once).
    #[inline(always)]
    pub(crate) fn on_quick_free(&mut self, pool: PoolKind, size: i64, requested: i64, split: bool) {
        let (h, all) = self.split(pool);
        Self::dec3(h, all, size, requested);
        if split {
            Self::inc(h, all, INACTIVE_SPLIT, 1);
            Self::inc(h, all, INACTIVE_SPLIT_BYTES, size);
        }
    }

    /// One stat as a [`StatArray`] (all, small, large); `field` indexes `Hot`'s fields.
    pub(crate) fn array(&self, field: usize) -> StatArray {
        let (s, l) = (self.pools[0].stat(field), self.pools[1].stat(field));
        let all = Stat {
            current: s.current + l.current,
            peak: s.current + l.current + self.all_slack[field],
            allocated: s.allocated + l.allocated,
            freed: s.freed + l.freed,
        };
        [all, s, l]
    }

    /// The current value of one stat in the aggregate and `pool` (as `array` would give).
    pub(crate) fn current(&self, field: usize) -> [i64; 3] {
        let (s, l) = (self.pools[0].current(field), self.pools[1].current(field));
        [s + l, s, l]
    }

    pub(crate) fn reset_accumulated(&mut self) {
        for h in &mut self.pools {
            h.base = std::array::from_fn(|f| h.current(f));
            h.freed = [0; 5];
        }
    }

    pub(crate) fn reset_peak(&mut self) {
        for h in &mut self.pools {
            h.peak = std::array::from_fn(|f| h.current(f));
            h.slack = [0; 5];
        }
        self.all_slack = [0; 5];
    }
}

/// Indexes of [`HotStats::array`]. Interleaved, so that no two fields the hot path moves
/// together are neighbours: the compiler then updates each with a scalar instruction, the same
/// width in both directions. (Neighbours moved together became one vector operation on one
/// side and two scalar ones on the other, and a vector load of two scalar stores defeats store
/// forwarding: a third of the RAII pair's time.)
pub(crate) const ALLOCATION: usize = 0;
pub(crate) const INACTIVE_SPLIT: usize = 1;
pub(crate) const ALLOCATED_BYTES: usize = 2;
pub(crate) const INACTIVE_SPLIT_BYTES: usize = 3;
pub(crate) const REQUESTED_BYTES: usize = 4;

/// The fields an allocation and its free move together.
const MOVED: [usize; 3] = [ALLOCATION, ALLOCATED_BYTES, REQUESTED_BYTES];

/// The allocator's stats as the pool keeps them: the fast path moves only the hot stats and
/// (rarely) the pending ones, and [`PoolStats::derive`] assembles PyTorch's `DeviceStats`.
#[derive(Debug, Clone)]
pub(crate) struct PoolStats {
    /// Every stat but those in `hot` and `active`/`active_bytes`, which `derive` derives.
    pub(crate) device: DeviceStats,
    /// The stats the fast path moves: allocation, allocated, requested, inactive split.
    pub(crate) hot: HotStats,
    /// Blocks (and their bytes) whose free waits for other queues' events.
    pending: StatArray,
    pending_bytes: StatArray,
    /// Peaks of active blocks (and bytes) reached while frees were pending; otherwise active
    /// equals allocated and the allocation peaks are the active peaks.
    active_peak: [i64; 3],
    active_bytes_peak: [i64; 3],
}

impl PoolStats {
    pub(crate) fn new(max_split_size: u64) -> Self {
        Self {
            device: DeviceStats { max_split_size, ..Default::default() },
            hot: HotStats::default(),
            pending: StatArray::default(),
            pending_bytes: StatArray::default(),
            active_peak: [0; 3],
            active_bytes_peak: [0; 3],
        }
    }

    /// The stats. Active blocks are allocated blocks plus those whose free is pending, so the
    /// hot path keeps only the allocation stats and the (rare) pending ones, and `active` is
    /// derived here: current and totals add up, and its peak is the allocation peak unless a
    /// higher one was reached while frees were pending.
    pub(crate) fn derive(&self) -> DeviceStats {
        let mut d = self.device.clone();
        d.allocation = self.hot.array(ALLOCATION);
        d.allocated_bytes = self.hot.array(ALLOCATED_BYTES);
        d.requested_bytes = self.hot.array(REQUESTED_BYTES);
        d.inactive_split = self.hot.array(INACTIVE_SPLIT);
        d.inactive_split_bytes = self.hot.array(INACTIVE_SPLIT_BYTES);
        let derive = |alloc: &StatArray, pending: &StatArray, extra: &[i64; 3]| -> StatArray {
            std::array::from_fn(|i| Stat {
                current: alloc[i].current + pending[i].current,
                peak: alloc[i].peak.max(extra[i]),
                allocated: alloc[i].allocated,
                freed: alloc[i].freed - pending[i].allocated + pending[i].freed,
            })
        };
        d.active = derive(&d.allocation, &self.pending, &self.active_peak);
        d.active_bytes = derive(&d.allocated_bytes, &self.pending_bytes, &self.active_bytes_peak);
        d
    }

    /// Zeroes the accumulated counters.
    pub(crate) fn reset_accumulated(&mut self) {
        self.device.reset_accumulated();
        self.hot.reset_accumulated();
        for s in self.pending.iter_mut().chain(self.pending_bytes.iter_mut()) {
            s.reset_accumulated();
        }
    }

    /// Sets every peak to its current value.
    pub(crate) fn reset_peak(&mut self) {
        self.device.reset_peak();
        self.hot.reset_peak();
        let (allocation, bytes) = (self.hot.current(ALLOCATION), self.hot.current(ALLOCATED_BYTES));
        for i in 0..3 {
            self.active_peak[i] = allocation[i] + self.pending[i].current;
            self.active_bytes_peak[i] = bytes[i] + self.pending_bytes[i].current;
        }
    }

    /// A block of `size` bytes in `pool` starts waiting for other queues before its free.
    pub(crate) fn pending_begin(&mut self, pool: PoolKind, size: i64) {
        inc_array(&mut self.pending, pool, 1);
        inc_array(&mut self.pending_bytes, pool, size);
    }

    /// It stopped waiting: its free completes.
    pub(crate) fn pending_end(&mut self, pool: PoolKind, size: i64) {
        dec_array(&mut self.pending, pool, 1);
        dec_array(&mut self.pending_bytes, pool, size);
    }

    /// Whether some free is waiting for other queues (active then exceeds allocated).
    #[inline(always)]
    pub(crate) fn any_pending(&self) -> bool {
        self.pending[AGGREGATE].current > 0
    }

    /// The bytes of the blocks waiting (all pools).
    pub(crate) fn pending_bytes_now(&self) -> i64 {
        self.pending_bytes[AGGREGATE].current
    }

    /// The blocks waiting, as (all, small, large).
    pub(crate) fn pending_current(&self) -> [i64; 3] {
        self.pending.map(|s| s.current)
    }

    /// After a hand-out in `pool` while frees are pending: raises the active peaks.
    pub(crate) fn note_active_peak(&mut self, pool: PoolKind) {
        let (allocation, bytes) = (self.hot.current(ALLOCATION), self.hot.current(ALLOCATED_BYTES));
        for i in [AGGREGATE, pool.index()] {
            self.active_peak[i] = self.active_peak[i].max(allocation[i] + self.pending[i].current);
            self.active_bytes_peak[i] = self.active_bytes_peak[i].max(bytes[i] + self.pending_bytes[i].current);
        }
    }
}

/// PyTorch's `DeviceStats`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Blocks handed to callers.
    pub allocation: StatArray,
    /// Segments obtained from the memory source.
    pub segment: StatArray,
    /// Blocks allocated or waiting for their deferred free.
    pub active: StatArray,
    /// Free blocks that are parts of split segments (fragmentation).
    pub inactive_split: StatArray,
    /// Bytes handed to callers (rounded sizes).
    pub allocated_bytes: StatArray,
    /// Bytes obtained from the memory source.
    pub reserved_bytes: StatArray,
    /// Bytes in active blocks.
    pub active_bytes: StatArray,
    /// Bytes in inactive split blocks.
    pub inactive_split_bytes: StatArray,
    /// Bytes callers asked for (unrounded).
    pub requested_bytes: StatArray,
    /// Allocations that had to free cached memory and retry.
    pub num_alloc_retries: i64,
    /// Allocations that failed with out-of-memory.
    pub num_ooms: i64,
    /// Requests whose claim at the OOM ladder's last wait did not get them their memory
    /// (allocations admitted meanwhile held it in deferred frees of their own) and which
    /// waited once more keeping every other allocation out, as PyTorch waits for its events
    /// under its mutex (`pool/claims.rs`).
    pub num_exclusive_waits: i64,
    /// Calls that obtained memory from the memory source: a classic segment each; with
    /// expandable segments, each reservation of address space and each growth (`mmap` of more
    /// of its memfd). Zero per iteration once a periodic workload is warm.
    pub num_device_alloc: i64,
    /// Calls that gave memory back to the memory source: a classic segment released each; with
    /// expandable segments, each punch of free pages (`fallocate(PUNCH_HOLE)`).
    pub num_device_free: i64,
    /// Remaps of page stitching (`mmap(MAP_FIXED)` calls): fully backed chunks of an
    /// expandable segment under a free block trade places with punched ones under a block
    /// being handed out, two remaps per run of chunks moved at once; no memory is taken from
    /// the source or given back.
    pub num_remaps: i64,
    /// Bytes of blocks freed here while another process still holds them (shared through
    /// [`crate::ipc`]): they wait in limbo, counted as active, until the last importer
    /// releases them; `empty_cache` cannot return them.
    pub limbo_bytes: Stat,
    /// Allocations at least `max_split_size`.
    pub oversize_allocations: Stat,
    /// Segments at least `max_split_size`.
    pub oversize_segments: Stat,
    /// The configured `max_split_size`.
    pub max_split_size: u64,
}

/// Seed 002's view, what a PyTorch out-of-tree backend's `getDeviceStats` reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimpleStats {
    /// Bytes currently allocated to callers.
    pub current_allocated: i64,
    /// Peak of `current_allocated`.
    pub peak_allocated: i64,
    /// Allocations made.
    pub num_allocs: i64,
    /// Frees completed.
    pub num_frees: i64,
    /// Out-of-memory failures.
    pub num_ooms: i64,
}

impl DeviceStats {
    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    /// Zeroes the accumulated totals (allocated/freed) and the event counters.
    pub fn reset_accumulated(&mut self) {
        for a in self.arrays_mut() {
            a.iter_mut().for_each(Stat::reset_accumulated);
        }
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_exclusive_waits = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
        self.num_remaps = 0;
    }

    /// Sets every peak to its current value.
    pub fn reset_peak(&mut self) {
        for a in self.arrays_mut() {
            a.iter_mut().for_each(Stat::reset_peak);
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    /// Seed 002's view of these stats.
    pub fn simple(&self) -> SimpleStats {
        SimpleStats {
            current_allocated: self.allocated_bytes[AGGREGATE].current,
            peak_allocated: self.allocated_bytes[AGGREGATE].peak,
            num_allocs: self.allocation[AGGREGATE].allocated,
            num_frees: self.allocation[AGGREGATE].freed,
            num_ooms: self.num_ooms,
        }
    }

    /// As JSON, with PyTorch's `memory_stats()` key names (`allocated_bytes.all.current`, ...).
    pub fn to_json(&self) -> String {
        let mut out = String::from("{");
        let names = [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ];
        for (name, arr) in names {
            for (pool, p) in [(AGGREGATE, "all"), (SMALL_POOL, "small_pool"), (LARGE_POOL, "large_pool")] {
                let s = arr[pool];
                let _ = write!(
                    out,
                    "\"{name}.{p}.current\":{},\"{name}.{p}.peak\":{},\"{name}.{p}.allocated\":{},\"{name}.{p}.freed\":{},",
                    s.current, s.peak, s.allocated, s.freed
                );
            }
        }
        for (name, s) in
            [("oversize_allocations", self.oversize_allocations), ("oversize_segments", self.oversize_segments)]
        {
            let _ = write!(
                out,
                "\"{name}.current\":{},\"{name}.peak\":{},\"{name}.allocated\":{},\"{name}.freed\":{},",
                s.current, s.peak, s.allocated, s.freed
            );
        }
        let _ = write!(
            out,
            "\"num_alloc_retries\":{},\"num_ooms\":{},\"num_exclusive_waits\":{},\"num_device_alloc\":{},\"num_device_free\":{},\"num_remaps\":{},\
             \"max_split_size\":{}}}",
            self.num_alloc_retries,
            self.num_ooms,
            self.num_exclusive_waits,
            self.num_device_alloc,
            self.num_device_free,
            self.num_remaps,
            self.max_split_size
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_pool_kind_has_its_stat_entry() {
        assert_eq!((PoolKind::Small.index(), PoolKind::Large.index()), (SMALL_POOL, LARGE_POOL));
    }

    #[test]
    fn stat_tracks_current_peak_and_totals() {
        let mut s = Stat::default();
        s.update(10);
        s.update(5);
        s.update(-12);
        assert_eq!(s, Stat { current: 3, peak: 15, allocated: 15, freed: 12 });
        s.reset_peak();
        assert_eq!(s.peak, 3);
        s.reset_accumulated();
        assert_eq!((s.allocated, s.freed, s.current), (0, 0, 3));
    }

    #[test]
    fn active_is_allocated_plus_pending_with_its_own_peak() {
        let mut p = PoolStats::new(u64::MAX);
        p.hot.on_alloc(PoolKind::Small, 512, 100);
        p.hot.on_alloc(PoolKind::Large, 4 << 20, 4 << 20);
        // The large block's free waits for another queue: no longer allocated, still active.
        p.hot.on_free_request(PoolKind::Large, 4 << 20, 4 << 20);
        p.pending_begin(PoolKind::Large, 4 << 20);
        assert!(p.any_pending());
        p.hot.on_alloc(PoolKind::Small, 512, 100);
        p.note_active_peak(PoolKind::Small);
        let d = p.derive();
        assert_eq!((d.allocation[AGGREGATE].current, d.active[AGGREGATE].current), (2, 3));
        assert_eq!((d.allocation[AGGREGATE].peak, d.active[AGGREGATE].peak), (2, 3));
        assert_eq!(d.active_bytes[LARGE_POOL].current, 4 << 20);
        p.pending_end(PoolKind::Large, 4 << 20);
        let d = p.derive();
        assert_eq!((d.active[AGGREGATE].current, d.active[AGGREGATE].freed), (2, 1));
        assert_eq!(p.pending_current(), [0, 0, 0]);
        p.reset_peak();
        assert_eq!(p.derive().active[AGGREGATE].peak, 2);
    }

    /// The hot stats, however kept, read as plain [`Stat`]s moved one change at a time would:
    /// a random run of allocations, frees and inactive-split changes in both pools, with
    /// resets of the peaks and of the totals, checked against such a model after every step.
    #[test]
    #[cfg_attr(miri, ignore = "safe code; thousands of steps take Miri minutes")]
    fn hot_stats_read_as_plain_stats() {
        let mut hot = HotStats::default();
        let mut model = [StatArray::default(); 5];
        let bump = |a: &mut StatArray, pool: PoolKind, amount: i64| {
            if amount >= 0 { inc_array(a, pool, amount) } else { dec_array(a, pool, -amount) }
        };
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        let mut live: Vec<(PoolKind, i64, i64)> = Vec::new();
        let mut inactive: Vec<(PoolKind, i64)> = Vec::new();
        // Under Miri a tenth.
        for step in 0..if cfg!(miri) { 2_000 } else { 20_000 } {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let pool = if x % 3 == 0 { PoolKind::Large } else { PoolKind::Small };
            let size = 512 * (1 + (x >> 8) as i64 % 64);
            match x % 11 {
                0..=3 => {
                    let requested = size - (x >> 20) as i64 % 512;
                    hot.on_alloc(pool, size, requested);
                    bump(&mut model[ALLOCATION], pool, 1);
                    bump(&mut model[ALLOCATED_BYTES], pool, size);
                    bump(&mut model[REQUESTED_BYTES], pool, requested);
                    live.push((pool, size, requested));
                }
                4..=6 if !live.is_empty() => {
                    let (pool, size, requested) = live.swap_remove((x >> 30) as usize % live.len());
                    let split = x % 2 == 0;
                    hot.on_quick_free(pool, size, requested, split);
                    bump(&mut model[ALLOCATION], pool, -1);
                    bump(&mut model[ALLOCATED_BYTES], pool, -size);
                    bump(&mut model[REQUESTED_BYTES], pool, -requested);
                    if split {
                        bump(&mut model[INACTIVE_SPLIT], pool, 1);
                        bump(&mut model[INACTIVE_SPLIT_BYTES], pool, size);
                        inactive.push((pool, size));
                    }
                }
                7 if !inactive.is_empty() => {
                    let (pool, size) = inactive.swap_remove((x >> 30) as usize % inactive.len());
                    let requested = size - 100;
                    hot.on_quick_alloc(pool, size, requested, true);
                    bump(&mut model[INACTIVE_SPLIT], pool, -1);
                    bump(&mut model[INACTIVE_SPLIT_BYTES], pool, -size);
                    bump(&mut model[ALLOCATION], pool, 1);
                    bump(&mut model[ALLOCATED_BYTES], pool, size);
                    bump(&mut model[REQUESTED_BYTES], pool, requested);
                    live.push((pool, size, requested));
                }
                8 => {
                    hot.inactive(pool, size, true);
                    bump(&mut model[INACTIVE_SPLIT], pool, 1);
                    bump(&mut model[INACTIVE_SPLIT_BYTES], pool, size);
                    inactive.push((pool, size));
                }
                9 if step % 7 == 0 => {
                    hot.reset_peak();
                    model.iter_mut().flatten().for_each(Stat::reset_peak);
                }
                10 if step % 5 == 0 => {
                    hot.reset_accumulated();
                    model.iter_mut().flatten().for_each(Stat::reset_accumulated);
                }
                _ => {}
            }
            for (f, want) in model.iter().enumerate() {
                assert_eq!(hot.array(f), *want, "field {f} at step {step}");
                assert_eq!(hot.current(f), want.map(|s| s.current), "field {f} at step {step}");
            }
        }
    }

    #[test]
    fn json_has_pytorch_key_names() {
        let mut d = DeviceStats::default();
        inc_array(&mut d.allocated_bytes, PoolKind::Small, 512);
        let j = d.to_json();
        assert!(j.contains("\"allocated_bytes.all.current\":512"));
        assert!(j.contains("\"allocated_bytes.small_pool.peak\":512"));
        assert!(j.contains("\"allocated_bytes.large_pool.current\":0"));
        assert!(j.starts_with('{') && j.ends_with('}'));
        assert_eq!(d.simple().current_allocated, 512);
    }
}
