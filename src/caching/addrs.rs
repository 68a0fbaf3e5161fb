//! Where each block starts: an exact table for frees (a raw pointer must be a block's start)
//! and an ordered one for ranges (a copy's pointer may lie anywhere inside a block). Both
//! change only when blocks are made, split, merged or released: never on the pools' hot path,
//! which hands out and takes back whole blocks. A page-stitched arena's home blocks are made
//! and freed on every request, so its home region is a dense region here: two bits a unit (a
//! block starts here; one started here and was freed) and a table of ids by unit, not entries
//! of the ordered map.
//!
//! A region's blocks are in neither table: its marks and table by unit answer both lookups,
//! and its freed marks tell a double free of a home block from a foreign pointer.
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

/// Levels of [`Summary`]: 64^5 words at most.
const LEVELS: usize = 5;

/// Numbers (of [`Marks`]' words), where the last one at or below any number is found in a few
/// word reads, however far back it lies: a bitmap, a summary of it (a bit per word that has any
/// bit set), a summary of that, and so on.
#[derive(Default)]
struct Summary {
    levels: [Vec<u64>; LEVELS],
}

impl Summary {
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

    /// The last number filed at or below `u`.
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

/// The bits of [`Marks`] that say a block starts at a unit (the even bits).
const START_BITS: u64 = 0x5555_5555_5555_5555;

/// Two bits per unit of a dense region, 32 units a word: *start* (bit `2i`), a block starts
/// at unit `i`, and *freed* (bit `2i + 1`), a block started there and was freed, and none has
/// started there since (a free of it is a double free). Both change together, so a block made
/// or freed writes one word (where the arena's own double-free mark and a separate bitmap of
/// starts would write two lines). The words that have a start are filed in a [`Summary`] (when
/// a word gains its first start or loses its last), which finds the last start at or below a
/// unit in a few word reads however far back it lies.
#[derive(Default)]
struct Marks {
    words: Vec<u64>,
    /// The words of `words` that have a start bit.
    summary: Summary,
    /// Units with a start bit.
    starts: usize,
}

impl Marks {
    /// Room for `units` units (zeroed: pages the kernel supplies on first write).
    fn with_capacity(units: usize) -> Self {
        let words = units.div_ceil(32);
        Self { words: vec![0; words], summary: Summary::default(), starts: 0 }
    }

    /// Makes room for unit `u` (past the capacity made up front).
    #[cold]
    fn reach(&mut self, u: usize) {
        let words = (u / 32 + 1).next_power_of_two();
        self.words.resize(words, 0);
    }

    /// A block starts at unit `u` (its freed mark goes).
    #[inline]
    fn start(&mut self, u: usize) {
        let (w, sh) = (u / 32, 2 * (u % 32));
        if w >= self.words.len() {
            self.reach(u);
        }
        let old = self.words[w];
        self.words[w] = (old | 1 << sh) & !(2 << sh);
        self.starts += usize::from(old & 1 << sh == 0);
        if old & START_BITS == 0 {
            self.summary.insert(w);
        }
    }

    /// The block that started at unit `u` is freed: its start goes, its freed mark is set.
    /// Nothing where no block starts.
    #[inline]
    fn free(&mut self, u: usize) {
        let (w, sh) = (u / 32, 2 * (u % 32));
        let Some(&old) = self.words.get(w) else { return };
        if old & 1 << sh == 0 {
            return;
        }
        let new = (old & !(1 << sh)) | 2 << sh;
        self.words[w] = new;
        self.starts -= 1;
        if new & START_BITS == 0 {
            self.summary.remove(w);
        }
    }

    #[inline(always)]
    fn mark(&self, u: usize, bit: u64) -> bool {
        self.words.get(u / 32).is_some_and(|&w| w & bit << (2 * (u % 32)) != 0)
    }

    /// Whether a block starts at unit `u`.
    #[inline(always)]
    fn starts_at(&self, u: usize) -> bool {
        self.mark(u, 1)
    }

    /// Whether a block started at unit `u` and was freed, none since.
    fn freed_at(&self, u: usize) -> bool {
        self.mark(u, 2)
    }

    /// The last unit at or below `u` where a block starts.
    fn last_at_or_below(&self, u: usize) -> Option<usize> {
        let highest = |w: usize, bits: u64| w * 32 + (63 - bits.leading_zeros() as usize) / 2;
        let w = (u / 32).min(self.words.len().checked_sub(1)?);
        let upto = if w < u / 32 { !0 } else { !0u64 >> (63 - 2 * (u % 32)) };
        let bits = self.words[w] & START_BITS & upto;
        if bits != 0 {
            return Some(highest(w, bits));
        }
        // The last word before `w` that has a start.
        let w = self.summary.last_at_or_below(w.checked_sub(1)?)?;
        Some(highest(w, self.words[w] & START_BITS))
    }
}

/// The most units a region's tables are made for at once: 16 MiB of address space for its ids
/// (4 Mi units, 16 GiB of 4 KiB units), memory only where written. Under Miri, which fills
/// every allocation it makes, 4096.
const REGION_UP_FRONT: usize = if cfg!(miri) { 1 << 12 } else { 1 << 22 };

/// A dense region: a page-stitched arena's home region, where blocks start at multiples of
/// its unit and are made and freed on every request. Its starts are marks and a table by
/// unit instead of entries of the ordered map (which cost a tree insert and remove a block).
struct Region {
    base: usize,
    len: usize,
    shift: u32,
    /// Where blocks start, and where one was freed.
    marks: Marks,
    /// By unit: the block that starts there (where a start is marked).
    ids: Vec<BlockId>,
}

impl Region {
    #[inline]
    fn holds(&self, addr: usize) -> bool {
        addr.wrapping_sub(self.base) < self.len
    }

    /// The unit `addr` (in the region) starts, if it starts one.
    #[inline(always)]
    fn unit_at(&self, addr: usize) -> Option<usize> {
        let off = addr - self.base;
        (off & ((1 << self.shift) - 1) == 0).then_some(off >> self.shift)
    }

    /// Room in the table of ids for unit `u`, past the units made up front (a region beyond
    /// `REGION_UP_FRONT` units).
    #[cold]
    fn grow_ids(&mut self, u: usize) {
        self.ids.resize((u + 1).next_power_of_two(), 0);
        crate::sys::huge_pages::advise(&self.ids);
    }

    /// The block that starts at `addr` (in the region), or `NONE`.
    #[inline(always)]
    fn find(&self, addr: usize) -> BlockId {
        match self.unit_at(addr) {
            Some(u) if self.marks.starts_at(u) => self.ids[u],
            _ => NONE,
        }
    }

    /// The last start at or before `addr` (in the region), and its block.
    fn at_or_before(&self, addr: usize) -> Option<(usize, BlockId)> {
        let s = self.marks.last_at_or_below((addr - self.base) >> self.shift)?;
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
    /// The dense region that holds `addr`, if one does.
    #[inline]
    fn region(&self, addr: usize) -> Option<&Region> {
        self.regions.iter().find(|r| r.holds(addr))
    }

    #[inline]
    fn region_of(&mut self, addr: usize) -> Option<&mut Region> {
        self.regions.iter_mut().find(|r| r.holds(addr))
    }

    /// Files block `id` as starting at `addr`. Inlined for a region's blocks (an arena's home
    /// blocks, made and freed on every request); the tables' path is out of line.
    #[inline]
    pub(crate) fn insert(&mut self, addr: usize, id: BlockId) {
        if let Some(r) = self.region_of(addr) {
            let u = (addr - r.base) >> r.shift;
            debug_assert_eq!((addr - r.base) & ((1 << r.shift) - 1), 0, "a region's blocks start at its units");
            if u >= r.ids.len() {
                r.grow_ids(u);
            }
            r.marks.start(u);
            r.ids[u] = id;
            return;
        }
        self.insert_in_tables(addr, id);
    }

    #[inline(never)]
    fn insert_in_tables(&mut self, addr: usize, id: BlockId) {
        self.exact.insert(addr, id);
        self.ordered.insert(addr, id);
    }

    /// Forgets the block that starts at `addr` (inlined as [`BlockAddrs::insert`]).
    #[inline]
    pub(crate) fn remove(&mut self, addr: usize) {
        if let Some(r) = self.region_of(addr) {
            r.marks.free((addr - r.base) >> r.shift);
            return;
        }
        self.remove_from_tables(addr);
    }

    #[inline(never)]
    fn remove_from_tables(&mut self, addr: usize) {
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
        // where the marks say a block starts are ever read.
        let units = (len >> shift).min(REGION_UP_FRONT);
        let ids = vec![0; units];
        // Written where blocks start, all over it (as a free run's tags are).
        crate::sys::huge_pages::advise(&ids);
        self.regions.push(Region { base, len, shift, marks: Marks::with_capacity(units), ids });
    }

    /// Whether `addr` lies in a dense region where a block started and was freed, and none
    /// has started there since (a free of it, when no live block holds it, is a double free).
    pub(crate) fn freed_at(&self, addr: usize) -> bool {
        let Some(r) = self.region(addr) else { return false };
        r.unit_at(addr).is_some_and(|u| r.marks.freed_at(u))
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
        match self.region(addr) {
            Some(r) => r.find(addr),
            None => NONE,
        }
    }

    /// The block that starts last at or before `addr` (the one holding it, if any does), and
    /// its start.
    pub(crate) fn at_or_before(&self, addr: usize) -> Option<(usize, BlockId)> {
        if let Some(r) = self.region(addr) {
            // No block of the ordered map lies in a region.
            return r.at_or_before(addr);
        }
        self.ordered.range(..=addr).next_back().map(|(&a, &id)| (a, id))
    }

    pub(crate) fn len(&self) -> usize {
        debug_assert_eq!(self.exact.len, self.ordered.len());
        self.exact.len + self.regions.iter().map(|r| r.marks.starts).sum::<usize>()
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
        // Where a block started and was freed, none since (double frees are told by them).
        let mut freed = std::collections::BTreeSet::new();
        let mut x = 0x9E37_79B9_7F4A_7C15_u64;
        for step in 0..if cfg!(miri) { 300u32 } else { 5_000 } {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let addr = base + (x as usize % 700) * unit;
            if x % 3 == 0 {
                a.remove(addr);
                if m.remove(&addr).is_some() {
                    freed.insert(addr);
                }
            } else {
                a.insert(addr, step);
                m.insert(addr, step);
                freed.remove(&addr);
            }
            assert_eq!(a.freed_at(addr), freed.contains(&addr), "step {step}: {addr:#x}");
            assert!(!a.freed_at(addr + 512), "only a unit's start is marked");
            assert_eq!(a.len(), m.len());
            let probe = base + (x >> 20) as usize % (800 * unit);
            let want = m.range(..=probe).next_back().map(|(&s, &id)| (s, id)).filter(|&(s, _)| s >= base);
            assert_eq!(a.at_or_before(probe), want, "step {step}: {probe:#x}");
            assert_eq!(a.get(addr), m.get(&addr).copied());
        }
        assert_eq!(a.at_or_before(base - 1), Some((base - 4096, 7)));
        assert!(!a.freed_at(base - 4096), "outside regions nothing is marked");
    }

    /// The next step of xorshift sequence `x`, and a number from it: below 100, below 10,000
    /// or below `far`, so that numbers lie close together and far apart.
    fn spread(x: &mut u64, far: usize) -> usize {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        let limit = [100, 10_000, far, far][(*x % 4) as usize];
        (*x >> 8) as usize % limit
    }

    /// A summary's `last_at_or_below` agrees with a sorted set, for numbers spread over several
    /// levels (far apart, so that the search climbs and comes down again).
    #[test]
    fn a_summary_finds_the_last_number_at_or_below() {
        let mut st = Summary::default();
        let mut m = std::collections::BTreeSet::new();
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        for step in 0..if cfg!(miri) { 300u32 } else { 20_000 } {
            let u = spread(&mut x, if cfg!(miri) { 300_000 } else { 30_000_000 });
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
    }

    /// `last_at_or_below` agrees with a sorted set, for units close together and far apart
    /// (across many words and summary words, so that the search walks the summary), through
    /// starts, frees and starts again; the freed marks agree with a model too.
    #[test]
    fn marks_find_the_last_start_at_or_below() {
        let cap = if cfg!(miri) { 300_000 } else { 30_000_000 };
        let mut mk = Marks::with_capacity(cap / 8);
        let mut m = std::collections::BTreeSet::new();
        let mut freed = std::collections::BTreeSet::new();
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        for step in 0..if cfg!(miri) { 300u32 } else { 20_000 } {
            // Past the capacity made up front too: the marks grow.
            let u = spread(&mut x, cap);
            if x % 5 < 2 {
                mk.free(u);
                if m.remove(&u) {
                    freed.insert(u);
                }
            } else {
                mk.start(u);
                m.insert(u);
                freed.remove(&u);
            }
            let probe = (x >> 20) as usize % (cap + cap / 3);
            assert_eq!(mk.last_at_or_below(probe), m.range(..=probe).next_back().copied(), "step {step}: {probe}");
            assert_eq!((mk.starts_at(u), mk.freed_at(u)), (m.contains(&u), freed.contains(&u)), "step {step}: {u}");
        }
        assert_eq!(mk.starts, m.len());
        assert_eq!(Marks::default().last_at_or_below(5), None);
    }
}
