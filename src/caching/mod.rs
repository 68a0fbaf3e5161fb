//! The caching allocator: PyTorch's CUDACachingAllocator (seed 003) over any
//! [`MemorySource`], with seed 002's stats, deferred frees fed by queue completions, and a
//! lock-free free path.
//!
//! Rules, as in seed 003:
//! - Sizes are rounded up to 512 bytes (or to a power-of-two division, see
//!   [`Config::roundup_power2_divisions`]).
//! - Requests of at most 1 MiB come from the small pool, packed into 2 MiB segments; larger
//!   ones from the large pool: 1–10 MiB requests carve 20 MiB segments, larger ones get a
//!   segment of their size rounded up to 2 MiB.
//! - Best fit by (queue, size); a block is split when the rest is worth keeping (at least
//!   512 bytes in the small pool, more than 1 MiB in the large pool) and freed neighbours
//!   merge back. Blocks of at least `max_split_size` are never split, and serve only
//!   requests within 20 MiB of their size.
//! - Expandable segments (the default where the source supports them): one reservation of
//!   address space per (queue, pool), grown in 2 MiB chunks mapped from a memfd; blocks split
//!   whenever 512 bytes remain; reserved bytes count backed pages. Free pages that cached
//!   blocks wholly cover are punched back to the kernel (per page) under pressure, and, on the
//!   slow path only (a growth, or a cached block handed out over punched pages), whenever the
//!   reserved bytes would otherwise pass [`Config::trim_ratio`] (1.045) times the allocated
//!   peak: the trim policy, which keeps peak reserved / peak allocated under 1.05 on real
//!   traces. Blocks of a queue with work in flight are never punched (that work was queued
//!   before the free and may still use them, and a punch is not ordered after it);
//!   `empty_cache` lets the queues finish first. Each growth and each punch counts as a call
//!   to the source (`num_device_alloc` / `num_device_free`).
//! - A block is bound to the queue it was allocated on. Used on other queues
//!   ([`Allocation::record_queue`]), its free records an event on each of them and the block
//!   returns to its pool only when they complete, reported through the events' completion
//!   hooks, never by polling.
//! - On a miss: garbage-collect old cached blocks above the threshold, ask the source; if it
//!   refuses, free cached oversize blocks and retry, then wait for pending frees (without the
//!   lock, trying again after each completion), free every unsplit cached block and retry;
//!   then, if queues have work in flight or deferred frees are outstanding, wait for the
//!   queues and then for those frees, the request's room claimed meanwhile (another thread's
//!   allocation that would take it waits: `pool/claims.rs`), and run the ladder once more;
//!   then fail with an [`Error::AllocatorOom`] that says what was requested, the capacity,
//!   what is allocated, what is cached and the largest free block, and how much of the cached
//!   memory deferred frees still hold.
//!
//! Files, each importing only those above it: `block` (blocks, sizes, pools, the segment
//! reference), `quick` (the exact-reuse cache), `addrs` and `raw` (the address and raw-pointer
//! table), `expandable` (expandable segments' state and arithmetic), `stats`, `snapshot`
//! (snapshot and history), `record` (what an `Allocation` points at, and the records the pool
//! keeps for reuse), `pool` (best fit, split, merge, the OOM ladder; its other steps in
//! `pool/`), `pool_lock` (the pool's lock, biased to the thread that keeps taking it),
//! `shared` (what the handles share), `allocation` (the RAII block), and this facade.
//!
//! The pool's lock (`pool_lock`) is a mutex that a thread taking it many times in a row
//! comes to own: that thread's quick-cache hits and frees (and arena home blocks) then take
//! no atomic read-modify-write at all (`CachingAllocator::fast`), and any other thread that
//! needs the lock takes it back with one `membarrier` call. Threads that take turns keep a
//! plain mutex.
//!
//! The free path never waits for the allocator's lock: dropping an [`Allocation`] (or a queue
//! completion finishing a deferred free) pushes onto a lock-free list ([`free_list`]) that the
//! next allocation, or any call that needs the pools, drains under the lock. A drop that finds
//! the lists empty and the lock free (the owner's fast hold, or `try_lock`) applies its own
//! free at once where it takes the short way (into the quick cache, or an arena's home block
//! let go), as the drain would have.
//!
//! An [`Allocation`] is one word: a pointer to its record (`record`), which holds the block's
//! fields and a strong count of the shared state. Records are kept for reuse under the lock
//! with their counts, so an alloc+free pair changes no `Arc` count and allocates nothing; a
//! drop that cannot apply its free pushes the record itself (the list of dropped records).
//!
//! # The allocate flow, top-down
//! [`CachingAllocator::allocate`] tries the owner thread's fast hold first (quick cache and
//! arena home blocks, nothing to drain); otherwise it takes the lock (draining the free list
//! first), tries the
//! quick cache (`Pool::try_quick`: an exact-size block freed on the same queue), and otherwise
//! goes to `allocate_slow` -> `Pool::allocate`, which builds an `AllocParams` and runs
//! `get_cached_block` (best fit in the pool of the size's `PoolKind`, split
//! when the rest is worth keeping) `|| ladder`: the OOM ladder in `pool.rs`, whose
//! `alloc_block` asks the [`MemorySource`] for a segment (or grows an expandable one,
//! `pool/growth.rs`) and splits it. The block leaves as an [`Allocation`] (`wrap`).
//!
//! # The deferred-free flow, top-down
//! Dropping an [`Allocation`] (`allocation.rs`) used only on its own queue pushes its record
//! onto the list of dropped records (or, the lock being free, applies the short way itself:
//! `Pool::free_dropped`). One used on other queues
//! ([`Allocation::record_queue`]) that still have work outstanding pushes
//! `FreeMsg::Requested(id, n)` and places a marker on each of those `n` queues
//! (`shared::mark_all`, [`crate::queue::QueueHandle::mark`]: a slot in the queue's marker
//! buffer, no event); as the queue passes it, the marker's node, made when the use was
//! recorded, is pushed as `FreeMsg::Passed`, and the last one frees the block. Queues that are
//! idle at the free have finished with it: no marker. The next call that takes the lock drains
//! both lists (`shared::drain`: the dropped records, then `Pool::drain` -> `apply` ->
//! `free_block`, `pool/free_path.rs`), which merges the block with its free neighbours and
//! returns it to its pool.

mod addrs;
mod allocation;
mod arena;
mod bitmap;
mod block;
pub mod config;
mod expandable;
mod export;
pub(crate) use export::{ExportHold, Exported};
pub mod free_list;
mod free_runs;
mod host;
mod pool;
mod pool_lock;
#[cfg(loom)]
#[doc(hidden)]
pub use pool_lock::model as pool_lock_model;
#[cfg(all(test, not(miri)))]
mod last_wait_tests;
mod quick;
mod raw;
mod record;
pub mod replay;
mod shared;
mod snapshot;
pub mod stats;
pub mod svg;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

pub use allocation::Allocation;
use block::{FreeMsg, QueueKey};
pub use config::Config;
use free_list::{FreeList, Node, Pending};
pub use host::{HostAllocation, HostCachingAllocator, HostStats};
use pool::{Outcome, Pool, Tried};
use pool_lock::{PoolGuard, PoolLock};
use shared::AllocatorShared;
pub use snapshot::{BlockSnapshot, BlockState, HistoryEvent, HistoryKind, SegmentSnapshot, Snapshot};
pub use stats::{DeviceStats, SimpleStats, Stat};

use crate::error::{Error, Result};
use crate::queue::{Mem, Queue, QueueHandle, QueueId};
use crate::source::MemorySource;

/// Default limit on waiting for deferred frees.
const PENDING_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// A request's claim at the OOM ladder's last wait (`pool/claims.rs`): withdrawn by its final
/// attempt ([`Claimed::withdraw`]), or when dropped without it (a panic in the memory source
/// unwinding through the attempt), so that no claim outlives its request.
struct Claimed<'a> {
    inner: &'a shared::AllocatorShared,
    bytes: Option<u64>,
    /// Made exclusive ([`Pool::keep_others_out`]).
    exclusive: bool,
}

impl Claimed<'_> {
    /// Withdraws the claim under the lock `pool` (held): the requests kept out look again.
    fn withdraw(mut self, pool: &mut Pool) {
        if let Some(bytes) = self.bytes.take() {
            pool.unclaim(bytes, self.exclusive);
            self.announce();
        }
    }

    fn announce(&self) {
        self.inner.claims_changed.fetch_add(1, Ordering::AcqRel);
        self.inner.pending.wake_all();
    }
}

impl Drop for Claimed<'_> {
    fn drop(&mut self) {
        if let Some(bytes) = self.bytes.take() {
            // Unwinding: this thread's lock guard is gone by now (declared later).
            if let Some(mut pool) = self.inner.pool.lock_unless_held_here() {
                pool.unclaim(bytes, self.exclusive);
            }
            self.announce();
        }
    }
}

/// The allocator. Cheap to clone (all clones share one cache).
pub struct CachingAllocator {
    inner: Arc<AllocatorShared>,
}

impl Clone for CachingAllocator {
    fn clone(&self) -> Self {
        self.inner.handles.fetch_add(1, Ordering::Relaxed);
        Self { inner: Arc::clone(&self.inner) }
    }
}

impl Drop for CachingAllocator {
    /// The last handle lets go the records the pool keeps for reuse, with their strong counts
    /// (`record.rs`): no `Allocation` can be made after it, and the counts would otherwise keep
    /// the pool alive.
    fn drop(&mut self) {
        if self.inner.handles.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        // Where this thread holds the lock already (a memory source's callback dropped the
        // last handle), the next `Allocation` dropped under the lock lets them go. In a forked
        // child the lock is not waited for (a thread the child does not have may hold it for
        // ever): if it is held, the records stay (the child's copy of the pool is not freed).
        let pool = if rustix::process::getpid() == self.inner.pid {
            self.inner.pool.lock_unless_held_here()
        } else {
            self.inner.pool.try_lock_taking_back()
        };
        let Some(mut pool) = pool else { return };
        // Dropped records pushed before are applied (and not kept: no handle is left).
        shared::drain(&self.inner, &mut pool);
        let spares = pool.spares.close();
        drop(pool);
        shared::let_go(spares);
    }
}

impl std::fmt::Debug for CachingAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachingAllocator").field("stats", &self.stats().simple()).finish()
    }
}

/// Settings for a [`CachingAllocator`].
#[derive(Debug)]
pub struct AllocatorBuilder {
    source: Box<dyn MemorySource>,
    config: Option<Config>,
    capacity: Option<u64>,
    pending_limit: std::time::Duration,
}

impl AllocatorBuilder {
    /// Settings (default: from `DMABUF_RT_ALLOC_CONF`).
    pub fn config(mut self, config: Config) -> Self {
        self.config = Some(config);
        self
    }

    /// The device's capacity in bytes (default: this machine's RAM). The memory fraction
    /// and the garbage-collection threshold are fractions of it.
    pub fn capacity(mut self, bytes: u64) -> Self {
        self.capacity = Some(bytes);
        self
    }

    /// How long the OOM ladder and `empty_cache` wait for deferred frees (default 5 s) before
    /// going on without them. The ladder tries the allocation again after each deferred free
    /// that completes, until those outstanding when it first waited have, and gives up when
    /// none completes within the limit (a queue that never finishes); `empty_cache` waits up
    /// to the limit for the frees requested before it was called. Neither waits for frees
    /// requested later, nor for none to be pending. An allocation the ladder cannot serve
    /// while a queue has work in flight (under which no cached memory is given back) waits
    /// for each such queue, up to the limit, and tries once more.
    pub fn pending_wait_limit(mut self, limit: std::time::Duration) -> Self {
        self.pending_limit = limit;
        self
    }

    /// Builds the allocator.
    pub fn build(self) -> Result<CachingAllocator> {
        let config = match self.config {
            Some(c) => c,
            None => Config::from_env()?,
        };
        let capacity = self.capacity.unwrap_or_else(|| {
            let info = rustix::system::sysinfo();
            (info.totalram as u64).saturating_mul(u64::from(info.mem_unit.max(1)))
        });
        Ok(CachingAllocator {
            inner: Arc::new(AllocatorShared {
                pool: PoolLock::new(Pool::new(self.source, config, capacity)),
                handles: AtomicUsize::new(1),
                frees: FreeList::new(),
                dropped: FreeList::new(),
                pending: Pending::new(),
                pid: rustix::process::getpid(),
                pending_limit: self.pending_limit,
                claims_changed: AtomicUsize::new(0),
            }),
        })
    }
}

impl CachingAllocator {
    /// Settings for an allocator over `source`.
    pub fn builder(source: impl MemorySource + 'static) -> AllocatorBuilder {
        AllocatorBuilder { source: Box::new(source), config: None, capacity: None, pending_limit: PENDING_LIMIT }
    }

    /// Settings for an allocator over a boxed source.
    pub fn builder_boxed(source: Box<dyn MemorySource>) -> AllocatorBuilder {
        AllocatorBuilder { source, config: None, capacity: None, pending_limit: PENDING_LIMIT }
    }

    /// An allocator over `source` with settings from the environment.
    pub fn new(source: impl MemorySource + 'static) -> Result<Self> {
        Self::builder(source).build()
    }

    #[inline]
    fn lock(&self) -> PoolGuard<'_, Pool> {
        let mut pool = self.inner.pool.lock();
        self.drain(&mut pool);
        pool
    }

    /// The owner thread's hold of the pool ([`PoolLock::fast`]: no atomic read-modify-write)
    /// where nothing waits on the lock-free lists (draining may take queues' locks, which the fast
    /// hold must not). For the quick cache and the arena's home blocks only.
    #[inline(always)]
    fn fast(&self) -> Option<PoolGuard<'_, Pool>> {
        let pool = self.inner.pool.fast()?;
        shared::nothing_pushed(&self.inner).then_some(pool)
    }

    /// Applies the frees pushed so far.
    #[inline(always)]
    fn drain(&self, pool: &mut Pool) {
        if !shared::nothing_pushed(&self.inner) {
            self.drain_some(pool);
        }
    }

    #[inline(never)]
    fn drain_some(&self, pool: &mut Pool) {
        shared::drain(&self.inner, pool);
    }

    /// `size` bytes for use on `queue` (`None`: host-side use, no queue). The block is bound to
    /// that queue: after it is freed, only allocations on the same queue reuse it directly.
    ///
    /// The owner thread's quick-cache hit is inlined into the caller (the `Allocation` is then
    /// built where it is used, not copied out of a returned `Result`); the rest is out of line.
    #[inline(always)]
    pub fn allocate(&self, size: usize, queue: Option<&Queue>) -> Result<Allocation> {
        if queue.is_none()
            && let Some(mut pool) = self.fast()
            && let Some(h) = pool.try_quick(size, QueueKey::of(None))
        {
            return Ok(self.wrap(pool, h, size, None));
        }
        self.allocate_rest(size, queue)
    }

    /// [`CachingAllocator::allocate`] past the owner's inlined quick-cache hit.
    #[inline(never)]
    fn allocate_rest(&self, size: usize, queue: Option<&Queue>) -> Result<Allocation> {
        let queue_id = queue.map(Queue::id);
        let key = QueueKey::of(queue_id);
        if let Some(mut pool) = self.fast() {
            if let Some(h) = pool.try_quick(size, key).or_else(|| pool.try_arena_home(size, key)) {
                return Ok(self.wrap(pool, h, size, queue_id));
            }
        }
        let mut pool = self.lock();
        let got = match pool.try_quick(size, key).or_else(|| pool.try_arena_home(size, key)) {
            Some(h) => h,
            None => {
                return self.allocate_slow(size, queue, Some(pool), |pool, b| self.wrap(pool, b, size, queue_id));
            }
        };
        Ok(self.wrap(pool, got, size, queue_id))
    }

    #[inline(always)]
    fn wrap(&self, mut pool: PoolGuard<'_, Pool>, b: pool::Handed, size: usize, queue: Option<QueueId>) -> Allocation {
        Allocation::new(&self.inner, &mut pool, b.id, b.segment, b.offset, size, queue)
    }

    /// Seed 003's malloc with the waits it may need, for both APIs: `take` turns the block
    /// handed out (with the lock still held) into what the caller returns. `held` is the lock
    /// the fast path took and still holds: the first pass goes on under it rather than
    /// letting it go and taking it again.
    #[inline(never)]
    fn allocate_slow<'a, T>(
        &'a self,
        size: usize,
        queue: Option<&Queue>,
        mut held: Option<PoolGuard<'a, Pool>>,
        mut take: impl FnMut(PoolGuard<'a, Pool>, pool::Handed) -> T,
    ) -> Result<T> {
        let key = QueueKey::of(queue.map(Queue::id));
        let limit = self.inner.pending_limit;
        let mut waited = false;
        let (mut first_mark, mut out_of_time, mut last_wait) = (None, false, false);
        // No completion came within the limit, or a queue did not finish within it: the last
        // wait does not wait for the frees again (a queue that never finishes).
        let mut stuck = false;
        // The room this request claimed at its last wait (withdrawn after its final attempt),
        // and since when another's claim kept it out.
        let (mut claimed, mut kept_out): (Option<Claimed<'_>>, _) = (None, None);
        // A host callback's request is never kept out, nor claims: the frees the claims wait
        // for may be queued behind it.
        let on_executor = crate::queue::executing_queue().is_some();
        loop {
            let mut pool = held.take().unwrap_or_else(|| self.lock());
            // The free list's protocol (see `free_list`): read the pending count first, then
            // drain. Read after the drain, a completion pushed between the two would be seen
            // as no longer pending and yet not applied: a false out-of-memory error. (The
            // lock's own drain came before the read: this one comes after it.) The mark too:
            // a completion after it wakes the wait below, and is drained by the next pass.
            let pending = !self.inner.pending.is_zero();
            let mark = self.inner.pending.mark();
            self.drain(&mut pool);
            if let Some(q) = queue {
                if pool.register_queue(q) {
                    // When the queue goes, its segments (an expandable one per pool, and its
                    // cached classic ones) go back to the source once their blocks are free:
                    // no other queue can use them. Weak: the queue must not keep us alive.
                    let inner = Arc::downgrade(&self.inner);
                    let id = q.id();
                    q.handle().on_exit(move || {
                        if let Some(inner) = inner.upgrade() {
                            inner.frees.push(Node::new(FreeMsg::QueueGone(id)));
                            // Applied now if nobody holds the lock (the next holder applies it
                            // otherwise), so the memory goes without waiting for another call.
                            if let Some(mut pool) = inner.pool.try_lock() {
                                shared::drain(&inner, &mut pool);
                            }
                        }
                    });
                }
            }
            if claimed.is_none() && !on_executor && !pool.admits(size) {
                // Another request waits for deferred frees to give back what this one would
                // take: until its claim goes or a free completes, then look again; as long as
                // frees keep completing, each within the pending-wait limit (the claim's own
                // wait ends no later), not past it without one (a claim must not hold anyone
                // up for ever).
                let since: std::time::Instant = *kept_out.get_or_insert_with(std::time::Instant::now);
                let left = limit.saturating_sub(since.elapsed());
                if !left.is_zero() {
                    let seen = self.inner.claims_changed.load(Ordering::Acquire);
                    drop(pool);
                    self.inner.pending.wait_for(left, || self.inner.claims_changed.load(Ordering::Acquire) != seen);
                    if self.inner.pending.progressed_since(mark) {
                        kept_out = Some(std::time::Instant::now());
                    }
                    continue;
                }
            }
            let tried = Tried {
                pending: pending && !out_of_time && !last_wait,
                outstanding: pending && !stuck,
                waited,
                last_wait,
                may_keep_others_out: !stuck && claimed.as_ref().is_some_and(|c| !c.exclusive),
            };
            let outcome = pool.allocate(size, key, tried);
            if !matches!(outcome, Ok(Outcome::WaitKeepingOthersOut))
                && let Some(c) = claimed.take()
            {
                // The final attempt is made: the requests kept out look again.
                c.withdraw(&mut pool);
            }
            match outcome? {
                Outcome::Got(b) => return Ok(take(pool, b)),
                Outcome::WaitForPending => {
                    // Until the next completion, then the ladder again (which may wait again):
                    // as long as completions come, until the frees outstanding at the first
                    // wait have completed (PyTorch waits for the events outstanding then), but
                    // no longer than the pending-wait limit for any one completion (a queue
                    // that never finishes must not hang the allocator). Not until none is
                    // pending, which a thread that keeps freeing blocks used on other queues
                    // puts off, and not a limit on the whole wait, which a long backlog of
                    // work passes while it is still freeing what is needed
                    // (`tests/hostile_review13.rs`, `tests/hostile_review24.rs`). Then the
                    // rest of the ladder.
                    drop(pool);
                    let first = *first_mark.get_or_insert(mark);
                    stuck = !self.inner.pending.wait_next(mark, limit);
                    out_of_time = stuck || self.inner.pending.passed(first);
                    waited = true;
                }
                Outcome::LastWait => {
                    // Once. The queues' work, then the deferred frees outstanding, without the
                    // lock, this request's room claimed meanwhile (`pool/claims.rs`): otherwise a
                    // thread that keeps freeing blocks used on a queue takes what they free
                    // before this one wakes, every time, and it fails with the memory it waited
                    // for in another's hands (`tests/hostile_review29.rs`). Then the final
                    // attempt.
                    let queues = pool.queue_handles();
                    drop(pool);
                    stuck |= !self.wait_for_queues(queues);
                    if !stuck {
                        // The mark before the drain (the free list's protocol, as above).
                        let mark = self.inner.pending.mark();
                        let mut pool = self.lock();
                        if !on_executor {
                            let bytes = Some(pool.claim(size));
                            claimed = Some(Claimed { inner: &self.inner, bytes, exclusive: false });
                            #[cfg(all(test, not(miri)))]
                            last_wait_tests::after_claim();
                        }
                        // Frees that did not come back within the limit: no exclusive wait
                        // for them after all (a queue that never finishes).
                        stuck |= !self.wait_for_claimed_frees(pool, mark);
                    }
                    (last_wait, waited) = (true, true);
                }
                Outcome::WaitKeepingOthersOut => {
                    // Once: the claim's memory went to allocations admitted during its wait,
                    // and their deferred frees hold it. Now nobody else takes memory until the
                    // final attempt, and those frees are waited for too (`pool/claims.rs`).
                    let mark = self.inner.pending.mark();
                    self.drain(&mut pool);
                    pool.keep_others_out();
                    if let Some(c) = claimed.as_mut() {
                        c.exclusive = true;
                    }
                    stuck |= !self.wait_for_claimed_frees(pool, mark);
                }
            }
        }
    }

    /// The claims' wait (`pool/claims.rs`), from the lock `pool` and a pending `mark` taken
    /// before its last drain: as the ladder's wait, as long as frees keep completing, each
    /// within the limit (a long backlog of work is no reason to fail), until the frees the
    /// claims wait for have (by bytes, under the lock: counts cannot tell them from newer
    /// frees on other queues, which may complete first). Not while none is outstanding any
    /// more (what is left is held by another process), nor once those bytes have not come
    /// down within the limit (newer frees on other queues completing meanwhile do not count).
    /// Returns false in that last case.
    fn wait_for_claimed_frees<'a>(&'a self, mut pool: PoolGuard<'a, Pool>, mark: free_list::PendingMark) -> bool {
        let limit = self.inner.pending_limit;
        let (mut last, mut left, mut since) = (mark, pool.claimed_frees_outstanding(), std::time::Instant::now());
        while left > 0 && !self.inner.pending.is_zero() {
            drop(pool);
            let time = limit.saturating_sub(since.elapsed());
            if time.is_zero() || !self.inner.pending.wait_next(last, time) {
                return false;
            }
            last = self.inner.pending.mark();
            pool = self.lock();
            let now = pool.claimed_frees_outstanding();
            if now < left {
                (left, since) = (now, std::time::Instant::now());
            }
        }
        true
    }

    /// Waits, without the allocator's lock, until the deferred frees requested so far have
    /// completed or the pending-wait limit passes (a queue stuck on an event that never
    /// completes must not hang the allocator). Not until none is pending: a thread that keeps
    /// requesting deferred frees would hold `empty_cache` for the whole limit.
    fn wait_for_pending(&self) {
        self.inner.pending.wait_outstanding(self.inner.pending_limit);
    }

    /// Returns every cached, unsplit segment to the source, and the pages of free parts of
    /// expandable segments. It first waits (each wait bounded by the pending-wait limit) for
    /// pending frees and for the work already submitted to the queues blocks are bound to:
    /// that work may still use freed blocks, whose pages cannot be given back under it.
    pub fn empty_cache(&self) {
        self.wait_for_pending();
        let queues = self.lock().queue_handles();
        self.wait_for_queues(queues);
        self.lock().release_cached(None);
    }

    /// Waits, without the allocator's lock, for the work submitted so far to `queues`, each
    /// bounded by the pending-wait limit (a queue waiting on itself, from a callback, is
    /// refused at once).
    /// Returns whether all of them finished in time (a failed operation counts as finished;
    /// a queue that did not finish within the limit, or waited on itself, did not).
    fn wait_for_queues(&self, queues: Vec<QueueHandle>) -> bool {
        let mut all = true;
        for q in queues {
            if let Ok(done) = q.record() {
                let r = done.synchronize(Some(self.inner.pending_limit));
                all &= !matches!(r, Err(Error::Timeout { .. } | Error::WouldDeadlock { .. }));
            }
        }
        all
    }

    /// The statistics, with every free made so far accounted for.
    pub fn stats(&self) -> DeviceStats {
        self.lock().stats()
    }

    /// Zeroes the accumulated counters.
    pub fn reset_accumulated_stats(&self) {
        self.lock().reset_accumulated();
    }

    /// Sets every peak to its current value.
    pub fn reset_peak_stats(&self) {
        self.lock().reset_peak();
    }

    /// Segments with their blocks.
    pub fn snapshot(&self) -> Snapshot {
        self.lock().snapshot()
    }

    /// Records every allocation and free in the history too (off by default: it costs a
    /// clock read per operation). Segment events and OOMs are always recorded.
    pub fn record_history(&self, all: bool) {
        self.lock().set_record_all(all);
    }

    /// The recent allocator events (bounded), oldest first.
    pub fn history(&self) -> Vec<HistoryEvent> {
        self.lock().history()
    }

    /// The configured settings.
    pub fn config(&self) -> Config {
        self.lock().config().clone()
    }

    /// Changes the fraction of the capacity this process may reserve.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(Error::Config { what: format!("memory fraction {fraction} is not in (0, 1]") });
        }
        self.lock().set_fraction(fraction);
        Ok(())
    }

    /// `size` bytes as a raw pointer into the segment's mapping, for C callers and seed 002's
    /// raw deleter: free it with [`CachingAllocator::free_raw`]. The allocator keeps the block
    /// in its own table (no [`Allocation`] object, no reference counts): dropping the last
    /// handle of the allocator releases its memory, raw blocks included.
    #[inline(always)]
    pub fn allocate_raw(&self, size: usize, queue: Option<&Queue>) -> Result<*mut u8> {
        let key = QueueKey::of(queue.map(Queue::id));
        if let Some(mut pool) = self.fast() {
            if let Some(addr) = pool.quick_alloc_raw(size, key) {
                return Ok(addr as *mut u8);
            }
            if let Some(b) = pool.try_arena_home(size, key) {
                return Ok(pool.hand_out_raw(b) as *mut u8);
            }
        }
        let mut pool = self.lock();
        if let Some(addr) = pool.quick_alloc_raw(size, key) {
            return Ok(addr as *mut u8);
        }
        self.allocate_raw_slow(size, queue, pool)
    }

    /// [`CachingAllocator::allocate_raw`] past the quick cache, under the lock it took: the
    /// arena's fast path, then everything else.
    #[inline(never)]
    fn allocate_raw_slow<'a>(
        &'a self,
        size: usize,
        queue: Option<&Queue>,
        mut pool: PoolGuard<'a, Pool>,
    ) -> Result<*mut u8> {
        if let Some(b) = pool.try_arena_home(size, QueueKey::of(queue.map(Queue::id))) {
            return Ok(pool.hand_out_raw(b) as *mut u8);
        }
        self.allocate_raw_slower(size, queue, pool)
    }

    /// [`CachingAllocator::allocate_raw`] past its fast paths, under the lock it took.
    fn allocate_raw_slower<'a>(
        &'a self,
        size: usize,
        queue: Option<&Queue>,
        held: PoolGuard<'a, Pool>,
    ) -> Result<*mut u8> {
        self.allocate_slow(size, queue, Some(held), |mut pool, b| pool.hand_out_raw(b) as *mut u8)
    }

    /// Holds the raw allocation at `ptr` (its start) for sharing with another process
    /// ([`crate::ipc`]).
    pub(crate) fn export_raw(&self, ptr: *mut u8) -> Result<export::Exported> {
        let mut pool = self.lock();
        let refused = |why: &str| Error::UnknownPointer {
            what: "the block to share",
            ptr: ptr as usize,
            expected: "the start of a live allocation of this allocator",
            why: why.to_string(),
        };
        let id = pool.live_raw_id(ptr as usize).map_err(refused)?;
        export::export_block(&self.inner, &mut pool, id, ptr as usize)
    }

    /// Frees a pointer from [`CachingAllocator::allocate_raw`]. The free is checked against
    /// the live allocation the pointer names at the moment of the call, under the allocator's
    /// lock: a pointer this allocator never returned, one already freed, or one into the middle
    /// of a block is refused with [`Error::InvalidFree`] and changes nothing. (An earlier design
    /// queued raw frees that found the lock taken and checked them later; by then another
    /// thread could have been handed the same address, and the stale free released its live
    /// block. A raw pointer carries no identity beyond its address, so it is checked now.)
    #[inline(always)]
    pub fn free_raw(&self, ptr: *mut u8) -> Result<()> {
        if ptr.is_null() {
            return Err(Error::InvalidFree { ptr: 0, why: "null pointer" });
        }
        if let Some(mut pool) = self.fast() {
            if pool.quick_free_raw(ptr as usize) {
                return Ok(());
            }
        }
        let mut pool = self.lock();
        if pool.quick_free_raw(ptr as usize) {
            return Ok(());
        }
        self.free_raw_slow(pool, ptr)
    }

    /// [`CachingAllocator::free_raw`] of a block the caller says is `size` bytes (the size it
    /// asked for): the size is checked and the block freed under one hold of the lock, so no
    /// other thread's free and allocation can come between the check and the free. A size
    /// that is not the block's is refused ([`Error::SizeMismatch`]: the block's, then the one
    /// given) and frees nothing; any other refusal is [`CachingAllocator::free_raw`]'s.
    pub fn free_raw_sized(&self, ptr: *mut u8, size: usize) -> Result<()> {
        if ptr.is_null() {
            return Err(Error::InvalidFree { ptr: 0, why: "null pointer" });
        }
        let pool = self.lock();
        let Ok((_, _, held)) = pool.raw_block(ptr as usize) else {
            // Not a live raw block: refused as `free_raw` refuses it (it says why).
            return self.free_raw_slow(pool, ptr);
        };
        if held != size {
            return Err(Error::SizeMismatch { dst: held, src: size });
        }
        self.free_raw_slow(pool, ptr)
    }

    /// [`CachingAllocator::free_raw`] past its fast path: checked, refused with the reason, or
    /// deferred for other queues.
    #[inline(never)]
    fn free_raw_slow(&self, mut pool: PoolGuard<'_, Pool>, ptr: *mut u8) -> Result<()> {
        match pool.free_raw(ptr as usize) {
            Ok(None) => Ok(()),
            Ok(Some((id, mut uses))) => {
                // Queues idle now have finished every use made before this free: it completes at
                // once. The history still shows it requested first, as PyTorch's does for a
                // block used on other streams, whether or not their work is done by then.
                uses.retain(|q| !q.has_passed());
                if uses.is_empty() {
                    pool.log_free_requested(id);
                    pool.apply_free(id);
                    return Ok(());
                }
                // Counted before the request is applied (and the lock released).
                self.inner.pending.begin_n(uses.len());
                pool.apply_requested(id, uses.len() as u32);
                // The markers' nodes come from the pool's spares (no allocation once warm), so
                // they are placed under its lock (a queue's lock is never held while taking it).
                shared::mark_all(&self.inner, id, uses.into_iter().map(|q| (q, pool.take_node())));
                Ok(())
            }
            Err(why) => Err(Error::InvalidFree { ptr: ptr as usize, why }),
        }
    }

    /// Marks the raw allocation that holds `ptr` (its start, or a byte of what it asked for) as
    /// used on `queue` (see [`Allocation::record_queue`]).
    #[doc(alias = "record_stream_raw")]
    pub fn record_queue_raw(&self, ptr: *mut u8, queue: &Queue) -> Result<()> {
        self.lock().record_queue_raw(ptr as usize, queue).map_err(|why| Error::InvalidFree { ptr: ptr as usize, why })
    }

    /// `len` bytes at `ptr`, anywhere inside one live allocation of this allocator
    /// (frameworks that sub-allocate pass pointers into the middle of blocks), as a queue range
    /// that keeps the segment mapped while operations use it. A range that is not wholly inside
    /// the bytes one live allocation asked for (freed, foreign, or running past its end into
    /// a neighbour) is refused with [`Error::UnknownPointer`] saying which. Takes the lock.
    pub fn mem_at(&self, ptr: *const u8, len: usize) -> Result<Mem> {
        let addr = ptr as usize;
        let (seg, off) = self.lock().live_range(addr, len).map_err(|why| Error::UnknownPointer {
            what: "device pointer",
            ptr: addr,
            expected: "inside one live allocation of this device with the whole range",
            why,
        })?;
        Mem::from(&seg).range(off, len)
    }

    /// Whether `ptr` lies in memory this allocator holds (live, cached or freed blocks alike).
    pub fn holds(&self, ptr: *const u8) -> bool {
        self.lock().holds(ptr as usize)
    }

    /// The size asked for by the live raw allocation at `ptr`.
    pub fn raw_size(&self, ptr: *mut u8) -> Result<usize> {
        let (_, _, size) =
            self.lock().raw_block(ptr as usize).map_err(|why| Error::InvalidFree { ptr: ptr as usize, why })?;
        Ok(size)
    }

    /// Checks the pool's structural invariants and its stats against its blocks (after
    /// applying the frees pushed so far); the first broken one is the error. For tests,
    /// fuzzers and model checks: it walks every block.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.lock().check_invariants()
    }

    /// The capacity the allocator was built with.
    pub fn capacity(&self) -> u64 {
        self.lock().capacity()
    }

    /// The first `len` bytes of the live raw allocation at `ptr` as a queue range (for copies
    /// through the C ABI); more than the size asked for is refused.
    pub fn raw_mem(&self, ptr: *mut u8, len: usize) -> Result<Mem> {
        let (seg, offset, size) =
            self.lock().raw_block(ptr as usize).map_err(|why| Error::InvalidFree { ptr: ptr as usize, why })?;
        Mem::from(&seg).range(offset, size)?.range(0, len)
    }
}
