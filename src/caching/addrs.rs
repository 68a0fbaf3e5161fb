//! Where each block starts: an exact table for frees (a raw pointer must be a block's start)
//! and an ordered one for ranges (a copy's pointer may lie anywhere inside a block). Both
//! change only when blocks are made, split, merged or released: never on the hot path, which
//! hands out and takes back whole blocks.
//!
//! The exact table is an open-addressing hash table of its own (linear probing, at most half
//! full, Fibonacci hashing of the address's 512-byte unit): a raw free's lookup is a multiply,
//! a shift and one or two compares, flat in the number of blocks.

use std::collections::BTreeMap;

use super::block::BlockId;

/// No block: the id of an empty slot.
const NONE: BlockId = BlockId::MAX;
/// The key of an empty slot. No block starts there (a block's bytes would run past the end
/// of the address space).
const EMPTY: usize = usize::MAX;
/// Slots of a table's first allocation.
const FIRST: usize = 64;

/// Address to block id, exact.
struct Exact {
    /// `(address, id)`; `(EMPTY, NONE)` when empty. A power of two long (or empty).
    slots: Vec<(usize, BlockId)>,
    /// 64 minus log2 of the slot count: the hash's top bits index the slots.
    shift: u32,
    len: usize,
}

impl Default for Exact {
    fn default() -> Self {
        Self { slots: Vec::new(), shift: 64, len: 0 }
    }
}

impl Exact {
    /// The slot `addr` hashes to.
    #[inline(always)]
    fn home(&self, addr: usize) -> usize {
        // Block addresses are multiples of 512: hash the unit number. The multiply spreads
        // consecutive units over the whole table; the top bits are the best mixed. (Empty, the
        // shift is 64, which wraps to 0: an index past the end, found in no slot.)
        (addr as u64 >> 9).wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_shr(self.shift) as usize
    }

    #[inline(always)]
    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    /// The id filed at `addr`, or `NONE` (an empty slot's id: so `EMPTY` itself is never
    /// found either).
    #[inline(always)]
    fn find(&self, addr: usize) -> BlockId {
        let mask = self.mask();
        let mut i = self.home(addr);
        loop {
            let Some(&(k, id)) = self.slots.get(i) else { return NONE };
            if k == addr || k == EMPTY {
                return id;
            }
            i = (i + 1) & mask;
        }
    }

    fn insert(&mut self, addr: usize, id: BlockId) {
        debug_assert!(addr != EMPTY && id != NONE);
        if (self.len + 1) * 2 > self.slots.len() {
            self.grow();
        }
        let mask = self.mask();
        let mut i = self.home(addr);
        loop {
            let slot = &mut self.slots[i];
            if slot.0 == addr {
                slot.1 = id;
                return;
            }
            if slot.0 == EMPTY {
                *slot = (addr, id);
                self.len += 1;
                return;
            }
            i = (i + 1) & mask;
        }
    }

    fn grow(&mut self) {
        let cap = (self.slots.len() * 2).max(FIRST);
        let old = std::mem::replace(&mut self.slots, vec![(EMPTY, NONE); cap]);
        self.shift = 64 - cap.trailing_zeros();
        self.len = 0;
        for (addr, id) in old.into_iter().filter(|&(a, _)| a != EMPTY) {
            self.insert(addr, id);
        }
    }

    fn remove(&mut self, addr: usize) {
        if self.slots.is_empty() || addr == EMPTY {
            return;
        }
        let mask = self.mask();
        let mut i = self.home(addr);
        loop {
            let k = self.slots[i].0;
            if k == EMPTY {
                return;
            }
            if k == addr {
                break;
            }
            i = (i + 1) & mask;
        }
        // Backward-shift deletion: pull later entries of the run into the hole when their
        // home does not lie cyclically in (hole, their slot].
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let (k, id) = self.slots[j];
            if k == EMPTY {
                break;
            }
            let home = self.home(k);
            let stays = if hole <= j { hole < home && home <= j } else { hole < home || home <= j };
            if !stays {
                self.slots[hole] = (k, id);
                hole = j;
            }
        }
        self.slots[hole] = (EMPTY, NONE);
        self.len -= 1;
    }
}

#[derive(Default)]
pub(crate) struct BlockAddrs {
    exact: Exact,
    ordered: BTreeMap<usize, BlockId>,
}

impl BlockAddrs {
    pub(crate) fn insert(&mut self, addr: usize, id: BlockId) {
        self.exact.insert(addr, id);
        self.ordered.insert(addr, id);
    }

    pub(crate) fn remove(&mut self, addr: usize) {
        self.exact.remove(addr);
        self.ordered.remove(&addr);
    }

    /// The block that starts at `addr`.
    #[inline]
    pub(crate) fn get(&self, addr: usize) -> Option<BlockId> {
        let id = self.exact.find(addr);
        (id != NONE).then_some(id)
    }

    /// The block that starts at `addr`, or an id no block has (`BlockId::MAX`): for the fast
    /// path, whose bounds check on the block table then also says "none".
    #[inline(always)]
    pub(crate) fn get_or_invalid(&self, addr: usize) -> BlockId {
        self.exact.find(addr)
    }

    /// The block that starts last at or before `addr` (the one holding it, if any does), and
    /// its start.
    pub(crate) fn at_or_before(&self, addr: usize) -> Option<(usize, BlockId)> {
        self.ordered.range(..=addr).next_back().map(|(&a, &id)| (a, id))
    }

    pub(crate) fn len(&self) -> usize {
        debug_assert_eq!(self.exact.len, self.ordered.len());
        self.exact.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exact table agrees with a std map through inserts, overwrites and removes (runs
    /// that wrap around the table's end included).
    #[test]
    #[cfg_attr(miri, ignore = "safe code; thousands of probes take Miri minutes")]
    fn the_exact_table_matches_a_map() {
        let mut t = Exact::default();
        let mut m = std::collections::HashMap::new();
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        // Under Miri a tenth (it interprets every probe).
        for step in 0..if cfg!(miri) { 2_000u32 } else { 20_000 } {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Few distinct addresses, clustered, so runs collide and get long.
            let addr = ((x % 3000) as usize) << 9 | if x % 7 == 0 { 1 << 40 } else { 0 };
            if x % 3 == 0 {
                t.remove(addr);
                m.remove(&addr);
            } else {
                t.insert(addr, step);
                m.insert(addr, step);
            }
            assert_eq!(t.len, m.len());
        }
        for a in 0..3000usize {
            for addr in [a << 9, a << 9 | 1 << 40] {
                let got = t.find(addr);
                assert_eq!((got != NONE).then_some(got), m.get(&addr).copied(), "{addr:#x}");
            }
        }
        assert_eq!(t.find(EMPTY), NONE);
        assert_eq!(Exact::default().find(0), NONE);
        t.remove(EMPTY);
        assert_eq!(t.len, m.len());
    }
}
