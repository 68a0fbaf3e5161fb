//! Where each block starts: an exact table for frees (a raw pointer must be a block's start)
//! and an ordered one for ranges (a copy's pointer may lie anywhere inside a block). Both
//! change only when blocks are made, split, merged or released: never on the pools' hot path,
//! which hands out and takes back whole blocks. A page-stitched arena's home blocks are made
//! and freed on every request, so its home region is a dense region here: starts by unit in a
//! bitmap, not entries of the ordered map.
//!
//! A region's blocks are in neither table: its bitmap and table by unit answer both lookups.
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

/// Levels of [`Starts`]: 64^5 units (over a billion) at most.
const LEVELS: usize = 5;

/// Unit numbers, where the last one at or below any unit is found in a few word reads, however
/// far back it lies: a bitmap, a summary of it (a bit per word that has any bit set), a summary
/// of that, and so on.
#[derive(Default)]
struct Starts {
    levels: [Vec<u64>; LEVELS],
}

impl Starts {
    fn insert(&mut self, u: usize) {
        let mut i = u;
        for v in &mut self.levels {
            let w = i / 64;
            if w >= v.len() {
                v.resize(w + 1, 0);
            }
            let had = v[w] != 0;
            v[w] |= 1 << (i % 64);
            if had {
                // The levels above know this word already.
                return;
            }
            i = w;
        }
    }

    fn remove(&mut self, u: usize) {
        let mut i = u;
        for v in &mut self.levels {
            let Some(word) = v.get_mut(i / 64) else { return };
            *word &= !(1 << (i % 64));
            if *word != 0 {
                return;
            }
            i /= 64;
        }
    }

    fn len(&self) -> usize {
        self.levels[0].iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Whether unit `u` is filed.
    #[inline(always)]
    fn contains(&self, u: usize) -> bool {
        self.levels[0].get(u / 64).is_some_and(|w| w & (1 << (u % 64)) != 0)
    }

    /// The last unit filed at or below `u`.
    fn last_at_or_below(&self, u: usize) -> Option<usize> {
        let mut i = u;
        for lvl in 0..LEVELS {
            let v = &self.levels[lvl];
            let (mut w, mut b) = (i / 64, i % 64);
            if w >= v.len() {
                // Past the end: everything filed at this level lies below.
                w = v.len().checked_sub(1)?;
                b = 63;
            }
            let below = if b == 63 { !0 } else { (1u64 << (b + 1)) - 1 };
            let bits = v[w] & below;
            if bits != 0 {
                // Down again, taking the highest bit of each word.
                let mut j = w * 64 + 63 - bits.leading_zeros() as usize;
                for l in (0..lvl).rev() {
                    let word = self.levels[l][j];
                    debug_assert!(word != 0, "a summary bit names a word with bits");
                    j = j * 64 + 63 - word.leading_zeros() as usize;
                }
                return Some(j);
            }
            // Nothing at or below `b` in word `w`: the words before it, one level up.
            i = w.checked_sub(1)?;
        }
        None
    }
}

/// The most units a region's table of ids is made for at once: 16 MiB of address space
/// (4 Mi units, 16 GiB of 4 KiB units), memory only where written. Under Miri, which fills
/// every allocation it makes, 4096.
const REGION_UP_FRONT: usize = if cfg!(miri) { 1 << 12 } else { 1 << 22 };

/// A dense region: a page-stitched arena's home region, where blocks start at multiples of
/// its unit and are made and freed on every request. Its starts are a bitmap and a table by
/// unit instead of entries of the ordered map (which cost a tree insert and remove a block).
struct Region {
    base: usize,
    len: usize,
    shift: u32,
    /// The units where a block starts.
    starts: Starts,
    /// By unit: the block that starts there (where the bit is set).
    ids: Vec<BlockId>,
}

impl Region {
    #[inline]
    fn holds(&self, addr: usize) -> bool {
        addr.wrapping_sub(self.base) < self.len
    }

    /// The block that starts at `addr` (in the region), or `NONE`.
    #[inline(always)]
    fn find(&self, addr: usize) -> BlockId {
        let off = addr - self.base;
        let u = off >> self.shift;
        if off & ((1 << self.shift) - 1) != 0 || !self.starts.contains(u) {
            return NONE;
        }
        self.ids[u]
    }

    /// The last start at or before `addr` (in the region), and its block.
    fn at_or_before(&self, addr: usize) -> Option<(usize, BlockId)> {
        let s = self.starts.last_at_or_below((addr - self.base) >> self.shift)?;
        Some((self.base + (s << self.shift), self.ids[s]))
    }
}

#[derive(Default)]
pub(crate) struct BlockAddrs {
    exact: Exact,
    ordered: BTreeMap<usize, BlockId>,
    regions: Vec<Region>,
}

impl BlockAddrs {
    #[inline]
    fn region_of(&mut self, addr: usize) -> Option<&mut Region> {
        self.regions.iter_mut().find(|r| r.holds(addr))
    }

    pub(crate) fn insert(&mut self, addr: usize, id: BlockId) {
        if let Some(r) = self.region_of(addr) {
            let u = (addr - r.base) >> r.shift;
            debug_assert_eq!((addr - r.base) & ((1 << r.shift) - 1), 0, "a region's blocks start at its units");
            if u >= r.ids.len() {
                // Past the table made up front (a region beyond `REGION_UP_FRONT` units).
                r.ids.resize((u + 1).next_power_of_two(), 0);
                crate::sys::huge_pages::advise(&r.ids);
            }
            r.starts.insert(u);
            r.ids[u] = id;
            return;
        }
        self.exact.insert(addr, id);
        self.ordered.insert(addr, id);
    }

    pub(crate) fn remove(&mut self, addr: usize) {
        if let Some(r) = self.region_of(addr) {
            r.starts.remove((addr - r.base) >> r.shift);
            return;
        }
        self.exact.remove(addr);
        self.ordered.remove(&addr);
    }

    /// Files blocks in `[base, base + len)` as a dense region (see [`Region`]): they start at
    /// multiples of `unit` (a power of two). Nothing may be filed there yet.
    pub(crate) fn add_region(&mut self, base: usize, len: usize, unit: usize) {
        debug_assert!(unit.is_power_of_two() && self.ordered.range(base..base + len).next().is_none());
        let shift = unit.trailing_zeros();
        // Allocated zeroed at once (pages the kernel supplies on first write), so that an
        // arena growing unit by unit neither fills nor copies the table: only the entries
        // where the bitmap says a block starts are ever read.
        let ids = vec![0; (len >> shift).min(REGION_UP_FRONT)];
        // Written where blocks start, all over it (as a free run's tags are).
        crate::sys::huge_pages::advise(&ids);
        self.regions.push(Region { base, len, shift, starts: Starts::default(), ids });
    }

    /// Forgets the dense region at `base` (its blocks were removed).
    pub(crate) fn remove_region(&mut self, base: usize) {
        self.regions.retain(|r| r.base != base);
    }

    /// The block that starts at `addr`.
    #[inline]
    pub(crate) fn get(&self, addr: usize) -> Option<BlockId> {
        let id = self.get_or_invalid(addr);
        (id != NONE).then_some(id)
    }

    /// The block that starts at `addr`, or an id no block has (`BlockId::MAX`): for the fast
    /// path, whose bounds check on the block table then also says "none".
    #[inline(always)]
    pub(crate) fn get_or_invalid(&self, addr: usize) -> BlockId {
        // A region's blocks are filed there only (most processes have one region or none),
        // and no other block lies in a region: the exact table first, for the raw fast path.
        let id = self.exact.find(addr);
        if id != NONE {
            return id;
        }
        match self.regions.iter().find(|r| r.holds(addr)) {
            Some(r) => r.find(addr),
            None => NONE,
        }
    }

    /// The block that starts last at or before `addr` (the one holding it, if any does), and
    /// its start.
    pub(crate) fn at_or_before(&self, addr: usize) -> Option<(usize, BlockId)> {
        if let Some(r) = self.regions.iter().find(|r| r.holds(addr)) {
            // No block of the ordered map lies in a region.
            return r.at_or_before(addr);
        }
        self.ordered.range(..=addr).next_back().map(|(&a, &id)| (a, id))
    }

    pub(crate) fn len(&self) -> usize {
        debug_assert_eq!(self.exact.len, self.ordered.len());
        self.exact.len + self.regions.iter().map(|r| r.starts.len()).sum::<usize>()
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

    /// Blocks in a dense region are found by exact address and by `at_or_before` as the
    /// ordered map finds the others (a model: a std BTreeMap of every block), and never from
    /// outside the region.
    #[test]
    fn a_region_answers_as_the_ordered_map_would() {
        let (base, unit) = (1usize << 30, 1usize << 14);
        let mut a = BlockAddrs::default();
        a.insert(base - 4096, 7);
        a.add_region(base, 1 << 24, unit);
        let mut m = BTreeMap::new();
        m.insert(base - 4096, 7);
        let mut x = 0x9E37_79B9_7F4A_7C15_u64;
        for step in 0..if cfg!(miri) { 300u32 } else { 5_000 } {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let addr = base + (x as usize % 700) * unit;
            if x % 3 == 0 {
                a.remove(addr);
                m.remove(&addr);
            } else {
                a.insert(addr, step);
                m.insert(addr, step);
            }
            assert_eq!(a.len(), m.len());
            let probe = base + (x >> 20) as usize % (800 * unit);
            let want = m.range(..=probe).next_back().map(|(&s, &id)| (s, id)).filter(|&(s, _)| s >= base);
            assert_eq!(a.at_or_before(probe), want, "step {step}: {probe:#x}");
            assert_eq!(a.get(addr), m.get(&addr).copied());
        }
        assert_eq!(a.at_or_before(base - 1), Some((base - 4096, 7)));
    }

    /// `last_at_or_below` agrees with a sorted set, for units spread over several levels (far
    /// apart, so that the search climbs and comes down again).
    #[test]
    fn starts_find_the_last_unit_at_or_below() {
        let mut st = Starts::default();
        let mut m = std::collections::BTreeSet::new();
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        for step in 0..if cfg!(miri) { 300u32 } else { 20_000 } {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = match x % 4 {
                0 => (x >> 8) as usize % 100,
                1 => (x >> 8) as usize % 10_000,
                _ => (x >> 8) as usize % if cfg!(miri) { 300_000 } else { 30_000_000 },
            };
            if x % 5 < 2 {
                st.remove(u);
                m.remove(&u);
            } else {
                st.insert(u);
                m.insert(u);
            }
            let probe = (x >> 20) as usize % 40_000_000;
            assert_eq!(st.last_at_or_below(probe), m.range(..=probe).next_back().copied(), "step {step}: {probe}");
        }
        assert_eq!(st.len(), m.len());
    }
}
