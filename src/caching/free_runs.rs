//! The free runs of an arena's units: the maximal runs of free units, merged with their free
//! neighbours as units come free (boundary tags: a run's length at its first unit and its
//! first unit at its last, so a merge looks at two tags), and filed by size class (two-level
//! segregated fit, as TLSF: exact classes below 16 units, then 16 classes per power of two)
//! in intrusive lists, so that finding a run that holds `n` units, taking units out of a run
//! and giving them back cost a few dozen instructions whatever the number of runs.

use super::bitmap::{bit, fill};

const NIL: u32 = u32::MAX;
/// Runs shorter than this have a class each.
const EXACT: u32 = 16;
/// Classes: the exact ones, then 16 per power of two from 16 to 2^32.
const CLASSES: usize = EXACT as usize + 28 * 16;
/// The most units [`FreeRuns::with_capacity`] makes room for at once: 64 MiB of tags (16 GiB
/// of 4 KiB units). Under Miri, which fills every allocation it makes, 4096 (the tables grow
/// past them, which Miri checks too).
const UP_FRONT: usize = if cfg!(miri) { 1 << 12 } else { 1 << 22 };
/// How many runs of a class a search looks at for the smallest that holds the request.
const LOOK: usize = 16;

/// The class of a run of `k` units (`k > 0`).
#[inline]
fn class(k: u32) -> usize {
    // Without a branch (runs of every length come by: it would mispredict): below `EXACT`,
    // `k` itself is selected.
    let fl = (31 - k.leading_zeros()).max(4);
    let sl = (k >> (fl - 4)) & 15;
    let above = (EXACT + (fl - 4) * 16 + sl) as usize;
    if k < EXACT { k as usize } else { above }
}

/// The tags of one unit, meaningful only at a free run's ends (written there, and read only
/// there): together, so that a run's first unit has its length and links in one cache line.
/// Indexed by [`HEAD_LEN`], [`NEXT`], [`PREV`], [`TAIL_START`]. (An array, not a struct: a
/// table of them is allocated zeroed, pages the kernel supplies on first write, where a
/// struct's would be written element by element.)
type Tags = [u32; 4];
/// At a run's first unit: its length.
const HEAD_LEN: usize = 0;
/// At a run's first unit: the next and previous runs of its class.
const NEXT: usize = 1;
const PREV: usize = 2;
/// At a run's last unit: its first unit.
const TAIL_START: usize = 3;

/// The free runs of units `[0, len)` (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct FreeRuns {
    /// One bit per unit, set while it is free.
    free: Vec<u64>,
    len: usize,
    /// The runs' tags, one entry per unit (see [`Tags`]).
    tags: Vec<Tags>,
    /// The first run of each class.
    heads: Vec<u32>,
    /// One bit per class, set while it has runs.
    nonempty: [u64; CLASSES.div_ceil(64)],
    runs: usize,
    /// Free units.
    free_units: usize,
}

impl FreeRuns {
    /// No units, with room for `units` (the most the arena can have): the per-unit tables are
    /// allocated zeroed at once, so that growing never copies them, and a large table's pages
    /// (zero pages from the kernel until written) cost memory only where a run's tags are
    /// written, not per unit: an arena of large blocks touches a small share of them. (Tags are
    /// only ever read where they were written: at a free run's ends.) The table's aligned 2 MiB
    /// (all of it past its first 2 MiB at most) ask for transparent huge pages
    /// (`sys::huge_pages`): an arena of gigabytes writes
    /// tags all over megabytes of it, where 4 KiB pages cost a fault each and miss the TLB
    /// (the random workload of `benches/allocator.rs`: 3,100 faults, 480 with them, and 10%
    /// less time).
    ///
    /// At most [`UP_FRONT`] units' room is allocated at once (address space, not memory, but
    /// a system that does not overcommit counts it): an arena that grows past them grows its
    /// tables then.
    pub(crate) fn with_capacity(units: usize) -> Self {
        let units = units.min(UP_FRONT);
        let runs = Self {
            free: vec![0; units.div_ceil(64)],
            tags: vec![[0; 4]; units],
            heads: vec![NIL; CLASSES],
            ..Self::default()
        };
        crate::sys::huge_pages::advise(&runs.tags);
        runs
    }

    /// Units covered (`[0, units)`).
    pub(crate) fn units(&self) -> usize {
        self.len
    }

    /// How many units are free.
    pub(crate) fn free_units(&self) -> usize {
        self.free_units
    }

    /// Whether unit `u` is free.
    #[inline]
    pub(crate) fn is_free(&self, u: u32) -> bool {
        bit(&self.free, u as usize)
    }

    /// Word `w` of the free bitmap (bit `i` for unit `64 w + i`; none past the end).
    #[inline]
    pub(crate) fn free_word(&self, w: usize) -> u64 {
        self.free[w]
    }

    /// Units `[len, new_len)` are added, busy (the caller vacates those it does not use).
    /// Within the capacity this only counts them; past it, the tables grow (by half as much
    /// again at least, so that growing one unit at a time costs amortized constant time).
    pub(crate) fn grow(&mut self, new_len: usize) {
        debug_assert!(new_len >= self.len);
        if new_len > self.tags.len() {
            let cap = new_len.max(self.tags.len() * 3 / 2);
            self.free.resize(cap.div_ceil(64), 0);
            self.tags.resize(cap, [0; 4]);
            crate::sys::huge_pages::advise(&self.tags);
        }
        self.len = new_len;
    }

    #[inline]
    fn link(&mut self, s: u32, k: u32) {
        self.tags[s as usize][HEAD_LEN] = k;
        self.tags[(s + k - 1) as usize][TAIL_START] = s;
        let c = class(k);
        let h = self.heads[c];
        self.tags[s as usize][NEXT] = h;
        self.tags[s as usize][PREV] = NIL;
        if h != NIL {
            self.tags[h as usize][PREV] = s;
        }
        self.heads[c] = s;
        self.nonempty[c / 64] |= 1 << (c % 64);
        self.runs += 1;
    }

    /// Takes the run that starts at `s` out of its class; returns its length.
    #[inline]
    fn unlink(&mut self, s: u32) -> u32 {
        let k = self.tags[s as usize][HEAD_LEN];
        let (n, p) = (self.tags[s as usize][NEXT], self.tags[s as usize][PREV]);
        let c = class(k);
        if p == NIL {
            self.heads[c] = n;
            if n == NIL {
                self.nonempty[c / 64] &= !(1 << (c % 64));
            }
        } else {
            self.tags[p as usize][NEXT] = n;
        }
        if n != NIL {
            self.tags[n as usize][PREV] = p;
        }
        self.runs -= 1;
        k
    }

    /// Units `[s, s + k)`, busy, come free, merged with the free runs around them.
    #[inline]
    pub(crate) fn vacate(&mut self, mut s: u32, mut k: u32) {
        debug_assert!(k > 0 && (s + k) as usize <= self.len);
        fill(&mut self.free, s as usize, (s + k) as usize, true);
        self.free_units += k as usize;
        if s > 0 && bit(&self.free, s as usize - 1) {
            let ls = self.tags[s as usize - 1][TAIL_START];
            k += self.unlink(ls);
            s = ls;
        }
        let end = (s + k) as usize;
        if end < self.len && bit(&self.free, end) {
            k += self.unlink(end as u32);
        }
        self.link(s, k);
    }

    /// The first unit of the free run that holds free unit `u`.
    pub(crate) fn run_start(&self, u: u32) -> u32 {
        let u = u as usize;
        let (mut w, mut b) = (u / 64, u % 64);
        loop {
            // The busy units at or below bit `b` of word `w`.
            let below = if b == 63 { !0 } else { (1u64 << (b + 1)) - 1 };
            let busy = !self.free[w] & below;
            if busy != 0 {
                return (w * 64 + 64 - busy.leading_zeros() as usize) as u32;
            }
            if w == 0 {
                return 0;
            }
            (w, b) = (w - 1, 63);
        }
    }

    /// Units `[s, s + k)`, all free (so in one free run), become busy.
    #[inline]
    pub(crate) fn occupy(&mut self, s: u32, k: u32) {
        let rs = if s == 0 || !bit(&self.free, s as usize - 1) { s } else { self.run_start(s) };
        let rl = self.unlink(rs);
        debug_assert!(s + k <= rs + rl, "units [{s}, {}) are not all free (run {rs}+{rl})", s + k);
        fill(&mut self.free, s as usize, (s + k) as usize, false);
        self.free_units -= k as usize;
        if s > rs {
            self.link(rs, s - rs);
        }
        if s + k < rs + rl {
            self.link(s + k, rs + rl - s - k);
        }
    }

    /// The smallest of the first `look` runs of class `c` that holds `n` units, passing over
    /// those that start at a unit of `skip`.
    fn best_in(&self, c: usize, n: u32, look: usize, skip: &[(u32, u32)]) -> Option<(u32, u32)> {
        let mut best: Option<(u32, u32)> = None;
        let mut r = self.heads[c];
        for _ in 0..look {
            if r == NIL {
                break;
            }
            let k = self.tags[r as usize][HEAD_LEN];
            if k >= n && best.is_none_or(|(bs, bk)| (k, r) < (bk, bs)) && !skip.iter().any(|t| t.0 == r) {
                best = Some((r, k));
                if k == n {
                    break;
                }
            }
            r = self.tags[r as usize][NEXT];
        }
        best
    }

    /// A free run that holds `n` units, as `(first unit, length)`: the smallest among those
    /// of `n`'s class (of the first few looked at), else of the next class that has runs (all
    /// of which hold `n`), else of all of `n`'s class. `None` only if no free run holds `n`.
    #[inline]
    pub(crate) fn fit(&self, n: u32) -> Option<(u32, u32)> {
        self.fit_skipping(n, &[])
    }

    /// [`FreeRuns::fit`], passing over the runs that start at a unit of `skip`.
    fn fit_skipping(&self, n: u32, skip: &[(u32, u32)]) -> Option<(u32, u32)> {
        let c = class(n.max(1));
        let has = |c: usize| self.nonempty[c / 64] & (1 << (c % 64)) != 0;
        if has(c) {
            if let Some(r) = self.best_in(c, n, LOOK + skip.len(), skip) {
                return Some(r);
            }
        }
        let mut next = c + 1;
        while let Some(k) = self.next_class(next) {
            // Past the runs skipped, as many as when none is.
            if let Some(r) = self.best_in(k, n, LOOK + skip.len(), skip) {
                return Some(r);
            }
            next = k + 1;
        }
        if has(c) { self.best_in(c, n, usize::MAX, skip) } else { None }
    }

    /// The classes that have runs, from the highest down.
    fn classes_down(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.nonempty.len()).rev().flat_map(move |w| {
            let mut bits = self.nonempty[w];
            std::iter::from_fn(move || {
                if bits == 0 {
                    return None;
                }
                let i = 63 - bits.leading_zeros() as usize;
                bits &= !(1 << i);
                Some(w * 64 + i)
            })
        })
    }

    /// The runs of class `c` as `(length, first unit)`, the longest last (lowest first among
    /// equals taken last).
    fn class_runs(&self, c: usize, out: &mut Vec<(u32, std::cmp::Reverse<u32>)>) {
        let mut r = self.heads[c];
        while r != NIL {
            out.push((self.tags[r as usize][HEAD_LEN], std::cmp::Reverse(r)));
            r = self.tags[r as usize][NEXT];
        }
        out.sort_unstable();
    }

    /// Free units for a block of `n` units with as few runs (`mmap`s) as can be: the longest
    /// runs, until one that holds the rest (the smallest such). Pushes `(first unit, count)`
    /// runs onto `out`; returns the units still missing (all free units are taken then).
    pub(crate) fn take_fewest(&self, n: u32, out: &mut Vec<(u32, u32)>) -> u32 {
        let mut left = n;
        let mut classes = self.classes_down();
        let mut batch = Vec::new();
        while left > 0 {
            if let Some((s, _)) = self.fit_skipping(left, out) {
                out.push((s, left));
                return 0;
            }
            // The longest run not taken yet: the rest of the highest class, one class at a time.
            if batch.is_empty() {
                let Some(c) = classes.next() else { break };
                self.class_runs(c, &mut batch);
            }
            let Some((k, std::cmp::Reverse(s))) = batch.pop() else { break };
            out.push((s, k));
            left -= k;
        }
        left
    }

    /// The first class from `c` on that has runs.
    fn next_class(&self, c: usize) -> Option<usize> {
        let mut w = c / 64;
        if w >= self.nonempty.len() {
            return None;
        }
        let mut bits = self.nonempty[w] & (!0u64 << (c % 64));
        loop {
            if bits != 0 {
                return Some(w * 64 + bits.trailing_zeros() as usize);
            }
            w += 1;
            if w == self.nonempty.len() {
                return None;
            }
            bits = self.nonempty[w];
        }
    }

    /// Checks the index against its free bitmap: every maximal free run has its tags and is
    /// listed in its class, and nothing else is; no bit is set past the end.
    pub(crate) fn check(&self) -> Result<(), String> {
        if super::bitmap::count(&self.free, self.len, self.free.len() * 64) != 0 {
            return Err("free units past the end".into());
        }
        if super::bitmap::count(&self.free, 0, self.len) != self.free_units {
            return Err(format!(
                "{} free units counted, {} free",
                self.free_units,
                super::bitmap::count(&self.free, 0, self.len)
            ));
        }
        let mut found = 0;
        let mut u = 0;
        while u < self.len {
            if !bit(&self.free, u) {
                u += 1;
                continue;
            }
            let mut end = u;
            while end < self.len && bit(&self.free, end) {
                end += 1;
            }
            let k = (end - u) as u32;
            if self.tags[u][HEAD_LEN] != k || self.tags[end - 1][TAIL_START] != u as u32 {
                return Err(format!(
                    "free run [{u}, {end}) has tags {} / {}",
                    self.tags[u][HEAD_LEN],
                    self.tags[end - 1][TAIL_START]
                ));
            }
            let c = class(k);
            let mut r = self.heads[c];
            while r != NIL && r != u as u32 {
                r = self.tags[r as usize][NEXT];
            }
            if r == NIL {
                return Err(format!("free run [{u}, {end}) is not listed in class {c}"));
            }
            found += 1;
            u = end;
        }
        let listed: usize = (0..CLASSES)
            .map(|c| {
                let (mut r, mut n) = (self.heads[c], 0);
                while r != NIL {
                    n += 1;
                    r = self.tags[r as usize][NEXT];
                }
                n
            })
            .sum();
        if found != self.runs || listed != self.runs {
            return Err(format!("{found} free runs, {listed} listed, {} counted", self.runs));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random vacate/occupy against a plain model (a bool per unit); after each step the
    /// index is checked, and `fit` must find a run that holds the request whenever one exists
    /// (and only then).
    #[test]
    fn matches_a_model_of_free_units() {
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = |m: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % m
        };
        let steps = if cfg!(miri) { 200 } else { 20_000 };
        let mut f = FreeRuns::with_capacity(if next(2) == 0 { 0 } else { 1000 });
        let mut busy: Vec<bool> = Vec::new();
        for step in 0..steps {
            if next(50) == 0 && busy.len() < 4000 {
                let add = 1 + next(300) as usize;
                let old = busy.len();
                f.grow(old + add);
                busy.resize(old + add, true);
                f.vacate(old as u32, add as u32);
                busy[old..].fill(false);
            }
            let len = busy.len();
            if len == 0 {
                continue;
            }
            let s = next(len as u64) as usize;
            let k = 1 + next((len - s).min(64) as u64) as usize;
            let span = &mut busy[s..s + k];
            if span.iter().all(|b| !b) {
                f.occupy(s as u32, k as u32);
                span.fill(true);
            } else if span.iter().all(|&b| b) {
                f.vacate(s as u32, k as u32);
                span.fill(false);
            }
            if step % 16 == 0 {
                f.check().unwrap_or_else(|e| panic!("step {step}: {e}"));
                assert!((0..len).all(|u| f.is_free(u as u32) != busy[u]), "step {step}: the free bits");
            }
            let n = 1 + next(80) as u32;
            let mut taken = Vec::new();
            let left = f.take_fewest(n, &mut taken);
            let free: usize = busy.iter().filter(|b| !**b).count();
            assert_eq!(left as usize, (n as usize).saturating_sub(free), "step {step}");
            let mut seen = vec![false; len];
            for &(s, k) in &taken {
                for u in s as usize..(s + k) as usize {
                    assert!(!busy[u] && !std::mem::replace(&mut seen[u], true), "step {step}: unit {u} in {taken:?}");
                }
            }
            assert_eq!(taken.iter().map(|t| t.1).sum::<u32>() + left, n, "step {step}");
            let longest = busy.split(|&b| b).map(<[bool]>::len).max().unwrap_or(0) as u32;
            match f.fit(n) {
                Some((s, k)) => {
                    assert!(k >= n && busy[s as usize..(s + k) as usize].iter().all(|b| !b), "step {step}: {s}+{k}");
                }
                None => assert!(longest < n, "step {step}: no fit for {n} with a free run of {longest}"),
            }
        }
    }

    #[test]
    fn classes_are_ordered_and_bounded() {
        let mut last = 0;
        for k in 1..if cfg!(miri) { 3_000u32 } else { 100_000 } {
            let c = class(k);
            assert!(c >= last && c < CLASSES, "{k}: {c}");
            last = c;
        }
        assert!(class(u32::MAX) < CLASSES);
    }
}
