//! The stash of references: strong counts of the allocator's shared state
//! (`Arc<AllocatorShared>`, see `shared.rs`) that the pool keeps, under its lock, for the next
//! [`Allocation`](super::Allocation). Every `Allocation` holds one strong count, which keeps
//! the pool alive while the block is out. Taking it with `Arc::clone` and giving it back with
//! `Arc::drop` are two atomic read-modify-writes per alloc+free pair, the largest part of an
//! RAII pair's time once the lock is biased (`pool_lock`); a dropped `Allocation` that frees
//! under the lock instead leaves its count here, and the next `Allocation` takes it: a plain
//! increment and decrement.
//!
//! The counts are strong counts of the `Arc` that owns the pool, so while any is stashed the
//! pool cannot be dropped (a cycle). The cycle is broken when the last
//! [`CachingAllocator`](super::CachingAllocator) handle goes (no new `Allocation` can be made
//! then): that handle takes every stashed count out ([`RefStash::close`]) and lets them go, and
//! from then on a dropped `Allocation` lets its own count go, as an `Arc` does. Where that last
//! handle is dropped by the thread holding the pool's lock (a memory source's callback), it
//! cannot take the lock: the next `Allocation` dropped under the lock closes the stash instead.
//!
//! This is only the arithmetic; the unsafe `Arc` counting is in `allocation.rs` and `mod.rs`.

/// Strong counts kept for reuse (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct RefStash {
    count: usize,
}

impl RefStash {
    /// Takes a stashed count for a new `Allocation`: false if there is none (the caller
    /// clones the `Arc`).
    #[inline(always)]
    pub(crate) fn take(&mut self) -> bool {
        if self.count == 0 {
            return false;
        }
        self.count -= 1;
        true
    }

    /// A dropped `Allocation` leaves its count, while handles remain (`handles_alive`, read
    /// under the lock). Otherwise nothing is kept: the stash is emptied and the counts the
    /// caller must let go (after the lock is released) are returned, its own included.
    #[inline(always)]
    pub(crate) fn put(&mut self, handles_alive: bool) -> Result<(), usize> {
        if handles_alive {
            self.count += 1;
            return Ok(());
        }
        Err(self.close() + 1)
    }

    /// Empties the stash: the counts the caller must let go, after the lock is released.
    pub(crate) fn close(&mut self) -> usize {
        std::mem::take(&mut self.count)
    }

    /// Counts stashed now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.count
    }
}

#[cfg(test)]
mod tests {
    use super::RefStash;

    #[test]
    fn counts_go_in_and_out_and_closing_returns_them_all() {
        let mut s = RefStash::default();
        assert!(!s.take(), "an empty stash has nothing to give");
        assert_eq!(s.put(true), Ok(()));
        assert_eq!(s.put(true), Ok(()));
        assert_eq!(s.len(), 2);
        assert!(s.take());
        assert_eq!(s.len(), 1);
        // No handle left: the caller's own count and the stashed one go.
        assert_eq!(s.put(false), Err(2));
        assert_eq!(s.len(), 0);
        assert_eq!(s.put(false), Err(1));
        assert_eq!(s.put(true), Ok(()));
        assert_eq!(s.close(), 1);
        assert_eq!(s.close(), 0);
    }
}
