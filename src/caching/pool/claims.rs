//! Claims: requests at the OOM ladder's last wait, which wait (without the lock) for the
//! deferred frees outstanding to give memory back, as long as they keep completing, each
//! within the pending-wait limit, until their bytes are all back
//! ([`Pool::claimed_frees_outstanding`]). While one waits, another allocation is
//! admitted only if what it takes leaves room for the claims once those frees complete:
//! otherwise a thread that keeps freeing blocks used on a queue of its own takes what each
//! completion gives back before the waiting request wakes, every time, and the request fails
//! with the memory it waited for in another thread's hands (`tests/hostile_review24.rs`'s
//! large-fill race, `tests/hostile_review29.rs`). PyTorch gets the same by waiting for its
//! events under its mutex; a wait holding the lock here would also hold up threads that the
//! queues' work waits for (a host callback, a thread that opens a gate after its next
//! allocation: `tests/hostile_review30.rs`), and calls that take no memory at all.
//!
//! The test is in bytes: allocated, plus the deferred frees requested since a claim was made
//! (the claims do not wait for those), plus the request, plus the larger of the claims and the
//! frees outstanding from before (those give back what the claims wait for; until they have,
//! others take only memory free now), must stay within the allowed memory. Segments fragment,
//! so it is a bound on what an admitted allocation can take from the claims, not a promise
//! that they fit.
//!
//! When it was not enough (the final attempt failed, and allocations admitted meanwhile
//! turned the memory the claim waited for into deferred frees of their own, which pin
//! classic segments the claim needs whole), the claim waits once more, *keeping every other
//! allocation out* ([`Pool::keep_others_out`]), for every deferred free outstanding then:
//! PyTorch's wait under its mutex, entered only after the claim's own wait failed, so a
//! thread a queue's work waits for is held up only where the request would fail otherwise
//! (and never past the pending-wait limit without a completion). Only where it could help:
//! the claim's own wait ended in time, and the blocks in use leave room for the request once
//! every deferred free completes (a true out-of-memory fails at once, holding no one up).
//! `tests/hostile_review24.rs`'s large-fill race failed on a fresh CI machine with 3.4 GB of
//! such frees outstanding at the final attempt.
//!
//! "Every other allocation" has three exceptions, all bounded by the same limit: host
//! callbacks (the frees may be queued behind them), other requests with claims of their own
//! (their final attempts race this one's, as before), and a request already kept out for a
//! whole limit without a completion (a claim holds no one up for ever). A second exclusive
//! claim makes the first wait for the frees requested during its wait too.

use std::collections::HashMap;

use super::super::block::BlockId;
use super::super::stats;
use super::Pool;

/// The claims in force.
#[derive(Debug, Default)]
pub(super) struct Claims {
    /// Rounded bytes claimed, all claims together.
    bytes: u64,
    /// Requests with a claim.
    count: u32,
    /// Claims that keep every other allocation out ([`Pool::keep_others_out`]).
    exclusive: u32,
    /// [`Pool`]'s `plain_below` while no claim is in force (it is 0 while one is: the fast
    /// paths, which test it first, then leave every allocation to the admission test).
    plain_below: usize,
    /// Deferred frees requested while a claim is in force and not completed yet, with their
    /// bytes: the claims' waits do not wait for them.
    newer: HashMap<BlockId, u64>,
    /// Their bytes.
    newer_bytes: u64,
}

impl Pool {
    /// Claims room for a request of `size` bytes at its last wait; returns the bytes claimed,
    /// for [`Pool::unclaim`] (which the caller must call, after its final attempt).
    pub(crate) fn claim(&mut self, size: usize) -> u64 {
        let bytes = self.round_size(size).unwrap_or(size) as u64;
        if self.claims.count == 0 {
            self.claims.plain_below = std::mem::replace(&mut self.plain_below, 0);
        }
        self.claims.count += 1;
        self.claims.bytes += bytes;
        bytes
    }

    /// Withdraws a claim of `bytes` made by [`Pool::claim`] (and made exclusive by
    /// [`Pool::keep_others_out`] if `exclusive`).
    pub(crate) fn unclaim(&mut self, bytes: u64, exclusive: bool) {
        debug_assert!(self.claims.count > 0 && self.claims.bytes >= bytes);
        debug_assert!(!exclusive || self.claims.exclusive > 0);
        self.claims.count -= 1;
        self.claims.bytes -= bytes;
        self.claims.exclusive -= u32::from(exclusive);
        if self.claims.count == 0 {
            self.plain_below = self.claims.plain_below;
            self.claims.newer.clear();
            self.claims.newer_bytes = 0;
        }
    }

    /// Makes a claim in force exclusive, for its second wait: until it is withdrawn no other
    /// allocation is admitted, and the deferred frees requested since the claims were made
    /// are among those they wait for (the claims' waits wait for them too).
    pub(crate) fn keep_others_out(&mut self) {
        debug_assert!(self.claims.count > self.claims.exclusive);
        self.claims.exclusive += 1;
        self.stats.device.num_exclusive_waits += 1;
        self.claims.newer.clear();
        self.claims.newer_bytes = 0;
    }

    /// Bytes of the deferred frees requested while the claims were in force and not
    /// completed yet: what allocations admitted meanwhile hold back from the claims.
    #[cfg(test)]
    pub(crate) fn claims_newer_outstanding(&self) -> u64 {
        self.claims.newer_bytes
    }

    /// Bytes allocated now (what the claims' tests count as in use).
    fn allocated_now(&self) -> u64 {
        self.stats.hot.current(stats::ALLOCATED_BYTES)[stats::AGGREGATE].max(0) as u64
    }

    /// Whether waiting for those frees could serve a request of `rounded` bytes that failed:
    /// some are outstanding, and the memory in use leaves room for it once every deferred
    /// free has completed (a request that the blocks in use leave no room for fails at once,
    /// holding no one up).
    pub(crate) fn newer_frees_could_serve(&self, rounded: usize) -> bool {
        let allocated = self.allocated_now();
        self.claims.newer_bytes > 0 && allocated.checked_add(rounded as u64).is_some_and(|n| n <= self.allowed)
    }

    /// The deferred free of block `id` (`bytes`) was requested: while a claim is in force, it
    /// is one the claims do not wait for.
    #[inline]
    pub(super) fn claims_note_request(&mut self, id: BlockId, bytes: u64) {
        if self.claims.count > 0 && self.claims.newer.insert(id, bytes).is_none() {
            self.claims.newer_bytes += bytes;
        }
    }

    /// The deferred free of block `id` completed.
    #[inline]
    pub(super) fn claims_note_passed(&mut self, id: BlockId) {
        if !self.claims.newer.is_empty()
            && let Some(bytes) = self.claims.newer.remove(&id)
        {
            self.claims.newer_bytes -= bytes;
        }
    }

    /// Bytes of the deferred frees outstanding from before the claims (what they wait for).
    /// Blocks in limbo (shared with another process when freed) are not among them: they come
    /// back when that process lets go, not when a queue passes.
    pub(crate) fn claimed_frees_outstanding(&self) -> u64 {
        let limbo = self.stats.device.limbo_bytes.current.max(0) as u64;
        (self.stats.pending_bytes_now().max(0) as u64).saturating_sub(limbo).saturating_sub(self.claims.newer_bytes)
    }

    /// Whether a request of `size` bytes may take memory now: no claim is in force, or none
    /// keeps others out and what it takes leaves room for the claims once the deferred frees
    /// they wait for complete.
    pub(crate) fn admits(&self, size: usize) -> bool {
        if self.claims.count == 0 {
            return true;
        }
        // A request the allocation refuses anyway (zero, too large) is refused at once.
        let sane = |&r: &usize| size > 0 && r <= isize::MAX as usize;
        let Some(rounded) = self.round_size(size).filter(sane).map(|r| r as u64) else { return true };
        if self.claims.exclusive > 0 {
            return false;
        }
        let allocated = self.allocated_now();
        // The frees outstanding before the claims: they give back what the claims wait for,
        // and no more than that is free for others until they complete.
        let older = self.claimed_frees_outstanding();
        [self.claims.newer_bytes, rounded, older.max(self.claims.bytes)]
            .iter()
            .try_fold(allocated, |sum, &b| sum.checked_add(b))
            .is_some_and(|sum| sum <= self.allowed)
    }
}
