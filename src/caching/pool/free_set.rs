//! A pool's free blocks, ordered as `(queue, size, address, id)`: what best fit searches. The
//! order is exactly that of an ordered set of those keys (it used to be one), so best fit,
//! the trim policy's walk from the largest block down and every other walk see the blocks in
//! the same order; only the cost changes. Sizes that are multiples of 512 bytes below 2 MiB
//! (nearly every block of the small pool, and the small blocks of the large one) live in
//! exact size classes found through two levels of bitmaps, each class a short list ordered by
//! address: inserting, removing and best fit there cost a few bit scans and a binary search
//! instead of a walk down a tree of 32-byte keys. Other sizes stay in an ordered set.

use std::collections::{BTreeMap, BTreeSet};

use super::super::block::{BlockId, QueueKey};

/// A pool key: `(queue, size, address, id)`.
pub(crate) type Key = (QueueKey, usize, usize, BlockId);

/// The size step of the exact classes (the allocator's rounding granularity).
const STEP: usize = 512;
/// Words of the class bitmap: 64 x 64 classes of 512 bytes, sizes below 2 MiB.
const WORDS: usize = 64;
/// Sizes below this (and multiples of [`STEP`]) are in exact classes.
const EXACT: usize = WORDS * 64 * STEP;

/// The free blocks of one queue.
struct Classes {
    /// Per exact class (size / 512), its blocks as `(address, id)`, ascending.
    lists: Vec<Vec<(usize, BlockId)>>,
    /// Bit `c % 64` of word `c / 64`: class `c` has blocks.
    bits: [u64; WORDS],
    /// Bit `w`: word `w` of `bits` is not zero.
    top: u64,
    /// The blocks of every other size, as `(size, address, id)`.
    rest: BTreeSet<(usize, usize, BlockId)>,
    len: usize,
}

impl Default for Classes {
    fn default() -> Self {
        Self { lists: Vec::new(), bits: [0; WORDS], top: 0, rest: BTreeSet::new(), len: 0 }
    }
}

fn exact_class(size: usize) -> Option<usize> {
    (size < EXACT && size % STEP == 0).then_some(size / STEP)
}

impl Classes {
    fn set(&mut self, c: usize) {
        self.bits[c / 64] |= 1 << (c % 64);
        self.top |= 1 << (c / 64);
    }

    fn clear(&mut self, c: usize) {
        self.bits[c / 64] &= !(1 << (c % 64));
        if self.bits[c / 64] == 0 {
            self.top &= !(1 << (c / 64));
        }
    }

    /// The first non-empty class at or above `c`.
    fn class_at_or_above(&self, c: usize) -> Option<usize> {
        if c >= WORDS * 64 {
            return None;
        }
        let (w, b) = (c / 64, c % 64);
        let here = self.bits[w] & (!0u64 << b);
        if here != 0 {
            return Some(w * 64 + here.trailing_zeros() as usize);
        }
        let above = if w + 1 >= 64 { 0 } else { self.top & (!0u64 << (w + 1)) };
        (above != 0).then(|| {
            let w = above.trailing_zeros() as usize;
            w * 64 + self.bits[w].trailing_zeros() as usize
        })
    }

    /// The last non-empty class below `c` (all classes for `c` past the end).
    fn class_below(&self, c: usize) -> Option<usize> {
        let c = c.min(WORDS * 64);
        if c == 0 {
            return None;
        }
        let (w, b) = ((c - 1) / 64, (c - 1) % 64);
        let here = self.bits[w] & (!0u64 >> (63 - b));
        if here != 0 {
            return Some(w * 64 + 63 - here.leading_zeros() as usize);
        }
        let below = if w == 0 { 0 } else { self.top & ((1u64 << w) - 1) };
        (below != 0).then(|| {
            let w = 63 - below.leading_zeros() as usize;
            w * 64 + 63 - self.bits[w].leading_zeros() as usize
        })
    }

    fn insert(&mut self, size: usize, addr: usize, id: BlockId) -> bool {
        let new = match exact_class(size) {
            Some(c) => {
                if self.lists.len() <= c {
                    self.lists.resize_with(c + 1, Vec::new);
                }
                let list = &mut self.lists[c];
                match list.binary_search(&(addr, id)) {
                    Ok(_) => false,
                    Err(at) => {
                        list.insert(at, (addr, id));
                        self.set(c);
                        true
                    }
                }
            }
            None => self.rest.insert((size, addr, id)),
        };
        self.len += usize::from(new);
        new
    }

    fn remove(&mut self, size: usize, addr: usize, id: BlockId) -> bool {
        let gone = match exact_class(size) {
            Some(c) => match self.lists.get_mut(c).map(|l| (l.binary_search(&(addr, id)), l)) {
                Some((Ok(at), list)) => {
                    list.remove(at);
                    if list.is_empty() {
                        self.clear(c);
                    }
                    true
                }
                _ => false,
            },
            None => self.rest.remove(&(size, addr, id)),
        };
        self.len -= usize::from(gone);
        gone
    }

    fn contains(&self, size: usize, addr: usize, id: BlockId) -> bool {
        match exact_class(size) {
            Some(c) => self.lists.get(c).is_some_and(|l| l.binary_search(&(addr, id)).is_ok()),
            None => self.rest.contains(&(size, addr, id)),
        }
    }

    /// The smallest `(size, address, id)` above `after` (the first of all for `None`).
    fn next_after(&self, after: Option<(usize, usize, BlockId)>) -> Option<(usize, usize, BlockId)> {
        use std::ops::Bound::{Excluded, Unbounded};
        let from_rest = match after {
            None => self.rest.iter().next().copied(),
            Some(a) => self.rest.range((Excluded(a), Unbounded)).next().copied(),
        };
        let from_exact = match after {
            None => self.class_at_or_above(0).map(|c| (c * STEP, self.lists[c][0])),
            Some((size, addr, id)) => {
                // In the class of `size` itself, entries past (addr, id); else the next class up.
                let same = exact_class(size).and_then(|c| {
                    let l = self.lists.get(c)?;
                    let at = match l.binary_search(&(addr, id)) {
                        Ok(i) => i + 1,
                        Err(i) => i,
                    };
                    l.get(at).map(|&e| (c * STEP, e))
                });
                same.or_else(|| {
                    let c = size / STEP + 1;
                    self.class_at_or_above(c).map(|c| (c * STEP, self.lists[c][0]))
                })
            }
        };
        let from_exact = from_exact.map(|(s, (a, i))| (s, a, i));
        from_rest.into_iter().chain(from_exact).min()
    }

    /// The largest `(size, address, id)` below `before` (the last of all for `None`).
    fn prev_before(&self, before: Option<(usize, usize, BlockId)>) -> Option<(usize, usize, BlockId)> {
        let from_rest = match before {
            None => self.rest.iter().next_back().copied(),
            Some(b) => self.rest.range(..b).next_back().copied(),
        };
        let from_exact = match before {
            None => self.class_below(usize::MAX).map(|c| (c * STEP, *self.lists[c].last().expect("non-empty"))),
            Some((size, addr, id)) => {
                let same = exact_class(size).and_then(|c| {
                    let l = self.lists.get(c)?;
                    let at = match l.binary_search(&(addr, id)) {
                        Ok(i) | Err(i) => i,
                    };
                    at.checked_sub(1).map(|i| (c * STEP, l[i]))
                });
                same.or_else(|| {
                    // Classes whose size is below `size`.
                    let c = size.div_ceil(STEP);
                    self.class_below(c).map(|c| (c * STEP, *self.lists[c].last().expect("non-empty")))
                })
            }
        };
        let from_exact = from_exact.map(|(s, (a, i))| (s, a, i));
        from_rest.into_iter().chain(from_exact).max()
    }

    /// The first block of at least `size` bytes: the smallest size, then the lowest address.
    fn first_at_least(&self, size: usize) -> Option<(usize, usize, BlockId)> {
        let from_rest = self.rest.range((size, 0, 0)..).next().copied();
        let from_exact = if size < EXACT {
            self.class_at_or_above(size.div_ceil(STEP)).map(|c| {
                let (a, i) = self.lists[c][0];
                (c * STEP, a, i)
            })
        } else {
            None
        };
        from_rest.into_iter().chain(from_exact).min()
    }
}

/// A pool's free blocks (see the module's documentation).
#[derive(Default)]
pub(crate) struct FreeSet {
    queues: BTreeMap<QueueKey, Classes>,
    len: usize,
}

impl FreeSet {
    /// Adds `key`; false if it was there.
    pub(crate) fn insert(&mut self, (q, size, addr, id): Key) -> bool {
        let new = self.queues.entry(q).or_default().insert(size, addr, id);
        self.len += usize::from(new);
        new
    }

    /// Removes `key`; false if it was not there.
    pub(crate) fn remove(&mut self, &(q, size, addr, id): &Key) -> bool {
        let Some(c) = self.queues.get_mut(&q) else { return false };
        // An emptied queue's classes stay (a pool often empties and refills; making them
        // again each time costs more than keeping them) until the queue is gone.
        let gone = c.remove(size, addr, id);
        self.len -= usize::from(gone);
        gone
    }

    /// Drops `queue`'s classes if it has no free block left (the queue is gone).
    pub(crate) fn forget_queue(&mut self, queue: QueueKey) {
        if self.queues.get(&queue).is_some_and(|c| c.len == 0) {
            self.queues.remove(&queue);
        }
    }

    pub(crate) fn contains(&self, &(q, size, addr, id): &Key) -> bool {
        self.queues.get(&q).is_some_and(|c| c.contains(size, addr, id))
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Best fit: the first key of `queue` with at least `size` bytes.
    #[inline]
    pub(crate) fn first_at_least(&self, queue: QueueKey, size: usize) -> Option<Key> {
        let (s, a, i) = self.queues.get(&queue)?.first_at_least(size)?;
        Some((queue, s, a, i))
    }

    /// The smallest key above `after` (the first for `None`).
    pub(crate) fn next_after(&self, after: Option<Key>) -> Option<Key> {
        use std::ops::Bound::{Included, Unbounded};
        let start = after.map_or(Unbounded, |k| Included(k.0));
        for (&q, c) in self.queues.range((start, Unbounded)) {
            let within = match after {
                Some(k) if k.0 == q => c.next_after(Some((k.1, k.2, k.3))),
                _ => c.next_after(None),
            };
            if let Some((s, a, i)) = within {
                return Some((q, s, a, i));
            }
        }
        None
    }

    /// The largest key below `before` (the last for `None`).
    pub(crate) fn prev_before(&self, before: Option<Key>) -> Option<Key> {
        use std::ops::Bound::{Included, Unbounded};
        let end = before.map_or(Unbounded, |k| Included(k.0));
        for (&q, c) in self.queues.range((Unbounded, end)).rev() {
            let within = match before {
                Some(k) if k.0 == q => c.prev_before(Some((k.1, k.2, k.3))),
                _ => c.prev_before(None),
            };
            if let Some((s, a, i)) = within {
                return Some((q, s, a, i));
            }
        }
        None
    }

    /// Every key, ascending.
    pub(crate) fn iter(&self) -> impl DoubleEndedIterator<Item = Key> + '_ {
        let mut all = Vec::with_capacity(self.len);
        let mut at = None;
        while let Some(k) = self.next_after(at) {
            all.push(k);
            at = Some(k);
        }
        all.into_iter()
    }

    /// The keys of `queue` from `size` bytes up, ascending.
    pub(crate) fn range_of(&self, queue: QueueKey, size: usize) -> Vec<Key> {
        let mut out = Vec::new();
        let mut at = self.first_at_least(queue, size);
        while let Some(k) = at.filter(|k| k.0 == queue) {
            out.push(k);
            at = self.next_after(Some(k));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(n: u64) -> QueueKey {
        QueueKey::for_tests(n)
    }

    /// Against an ordered set of the same keys, with sizes in and out of the exact classes,
    /// equal sizes at many addresses, and several queues: every query answers the same.
    #[test]
    #[cfg_attr(miri, ignore = "safe code; thousands of tree operations take Miri minutes")]
    fn behaves_as_an_ordered_set() {
        let mut model: BTreeSet<Key> = BTreeSet::new();
        let mut set = FreeSet::default();
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let sizes = |r: u64| -> usize {
            match r % 6 {
                0 => 512 * (1 + (r as usize >> 8) % 8),
                1 => 512 * (1 + (r as usize >> 8) % 4096),
                2 => EXACT - 512,
                3 => EXACT + 512 * ((r as usize >> 8) % 64),
                4 => 100 + (r as usize >> 8) % 3000,
                _ => (r as usize >> 8) % (64 << 20) + 1,
            }
        };
        let mut keys: Vec<Key> = Vec::new();
        // Under Miri a few hundred steps (it interprets every tree operation).
        let steps = if cfg!(miri) { 300 } else { 30_000u32 };
        for step in 0..steps {
            let r = next();
            if r % 3 != 0 || keys.is_empty() {
                let k = (q(r % 3), sizes(next()), (next() % 4096) as usize * 512, step);
                assert_eq!(set.insert(k), model.insert(k));
                keys.push(k);
            } else {
                let k = keys.swap_remove((next() % keys.len() as u64) as usize);
                assert_eq!(set.remove(&k), model.remove(&k), "remove {k:?}");
                assert!(!set.remove(&k), "removed twice");
            }
            assert_eq!(set.len(), model.len());
            if step % 97 == 0 {
                assert!(set.iter().eq(model.iter().copied()));
            }
            let (qq, size) = (q(next() % 4), sizes(next()));
            let want = model.range((qq, size, 0, 0)..).next().copied().filter(|k| k.0 == qq);
            assert_eq!(set.first_at_least(qq, size), want, "best fit {size} on {qq:?}");
            let probe = (q(next() % 4), sizes(next()), (next() % 4096) as usize * 512, next() as u32 % 30_000);
            assert_eq!(set.next_after(Some(probe)), model.range(probe..).find(|&&k| k != probe).copied());
            assert_eq!(set.prev_before(Some(probe)), model.range(..probe).next_back().copied());
            assert_eq!(set.contains(&probe), model.contains(&probe));
            if step % 211 == 0 {
                let qq = q(next() % 3);
                let from = sizes(next());
                let want: Vec<Key> = model.range((qq, from, 0, 0)..).filter(|k| k.0 == qq).copied().collect();
                assert_eq!(set.range_of(qq, from), want);
            }
        }
        assert_eq!(set.next_after(None), model.iter().next().copied());
        assert_eq!(set.prev_before(None), model.iter().next_back().copied());
    }
}
