//! Bitmaps over pages or units, a 64-bit word at a time: what an expandable segment's map of
//! punched pages and an arena's maps of busy and given-back units share.

/// Calls `f(word, mask)` for the words that cover bits `[from, to)`, with the mask of those
/// bits in each.
#[inline]
pub(crate) fn words(from: usize, to: usize, mut f: impl FnMut(usize, u64)) {
    let mut p = from;
    while p < to {
        let bit = p % 64;
        let n = (to - p).min(64 - bit);
        let mask = if n == 64 { !0 } else { ((1u64 << n) - 1) << bit };
        f(p / 64, mask);
        p += n;
    }
}

/// Set bits among `[from, to)` (bits past the map's end count as clear).
#[inline]
pub(crate) fn count(map: &[u64], from: usize, to: usize) -> usize {
    let mut n = 0;
    words(from, to, |w, m| n += (map.get(w).copied().unwrap_or(0) & m).count_ones() as usize);
    n
}

/// Sets (`on`) or clears bits `[from, to)`; returns how many changed.
#[inline]
pub(crate) fn set(map: &mut [u64], from: usize, to: usize, on: bool) -> usize {
    let mut changed = 0;
    words(from, to, |w, m| {
        let flip = if on { !map[w] & m } else { map[w] & m };
        changed += flip.count_ones() as usize;
        map[w] ^= flip;
    });
    changed
}

/// Sets (`on`) or clears bits `[from, to)`, with no count: whole words in the middle are
/// filled at once (a long range is a `memset`).
#[inline]
pub(crate) fn fill(map: &mut [u64], from: usize, to: usize, on: bool) {
    if from >= to {
        return;
    }
    let (fw, lw) = (from / 64, (to - 1) / 64);
    let head = !0u64 << (from % 64);
    let tail = !0u64 >> (63 - (to - 1) % 64);
    let apply = |word: &mut u64, m: u64| if on { *word |= m } else { *word &= !m };
    if fw == lw {
        apply(&mut map[fw], head & tail);
        return;
    }
    apply(&mut map[fw], head);
    map[fw + 1..lw].fill(if on { !0 } else { 0 });
    apply(&mut map[lw], tail);
}

/// Whether bit `i` is set.
#[inline]
pub(crate) fn bit(map: &[u64], i: usize) -> bool {
    map[i / 64] & (1 << (i % 64)) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_across_words_are_counted_set_and_cleared() {
        let mut m = vec![0u64; 4];
        assert_eq!(set(&mut m, 60, 130, true), 70);
        assert_eq!(set(&mut m, 0, 64, true), 60, "bits 60..64 were set already");
        assert_eq!((count(&m, 0, 256), count(&m, 100, 140)), (130, 30));
        assert_eq!(count(&m, 250, 400), 0, "past the end counts as clear");
        assert!(bit(&m, 129) && !bit(&m, 130));
        assert_eq!(set(&mut m, 64, 256, false), 66);
        assert_eq!(count(&m, 0, 256), 64);
        assert_eq!(set(&mut m, 200, 201, true), 1);
        assert!(bit(&m, 200));
        set(&mut m, 201, 202, true);
        set(&mut m, 200, 201, false);
        assert!(!bit(&m, 200) && bit(&m, 201) && count(&m, 192, 256) == 1);
    }

    /// `fill` sets and clears exactly what `set` does, for ranges within a word, across two
    /// and across many.
    #[test]
    fn fill_matches_set() {
        for (from, to) in [(0, 0), (3, 4), (0, 64), (5, 63), (60, 70), (64, 128), (1, 255), (63, 193), (0, 256)] {
            for on in [true, false] {
                let start = if on { 0 } else { !0 };
                let (mut a, mut b) = (vec![start; 4], vec![start; 4]);
                set(&mut a, from, to, on);
                fill(&mut b, from, to, on);
                assert_eq!(a, b, "[{from}, {to}) {on}");
            }
        }
    }
}
