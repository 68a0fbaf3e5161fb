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
    }
}
