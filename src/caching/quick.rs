//! The quick cache: freed blocks kept unmerged for exact reuse, by (queue, rounded size).
//!
//! This is the fast path of periodic workloads (a training step frees and re-allocates the
//! same sizes on the same queue). Small sizes index a per-queue table of list heads directly
//! (one slot per 512-byte class up to 1 MiB), with a bitmap of the classes that may hold
//! blocks so a flush visits only those; larger sizes go through a hash map. The lists are
//! intrusive: one link per block id, so a push or a pop moves no memory.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::block::{BlockId, MIN_BLOCK, QueueKey, SMALL_SIZE};

/// No block.
const NONE: BlockId = BlockId::MAX;
/// Small size classes: every multiple of 512 up to and including 1 MiB.
const CLASSES: usize = SMALL_SIZE / MIN_BLOCK + 1;
/// Words of a per-queue bitmap of classes.
const WORDS: usize = CLASSES.div_ceil(64);

/// A fast multiplicative hasher for small integer keys.
#[derive(Default)]
pub(crate) struct FxHasher(u64);

impl Hasher for FxHasher {
    fn finish(&self) -> u64 {
        // The multiply leaves the entropy in the high bits, and hash tables index by the low
        // ones: a block address (512-aligned) would leave its low nine bits zero and crowd one
        // bucket in 512. Rotating brings the high bits down (as rustc-hash 2 does).
        self.0.rotate_left(26)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
}

pub(crate) type FxBuild = BuildHasherDefault<FxHasher>;

/// One queue's small classes: the head of each class's list, and a bitmap of the classes
/// that may hold blocks.
struct Table {
    heads: [BlockId; CLASSES],
    /// A set bit: the class has held a block since the last flush.
    used: [u64; WORDS],
}

#[derive(Default)]
pub(crate) struct Quick {
    /// The queues with small classes and their tables, the one used last first (queues are
    /// few and used in runs: a hit on another queue moves it to the front).
    tables: Vec<(QueueKey, Box<Table>)>,
    large: HashMap<(QueueKey, usize), BlockId, FxBuild>,
    /// The link of each block id.
    next: Vec<BlockId>,
    len: usize,
}

impl Quick {
    /// Blocks held.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Makes room for the link of block `id` (the pool calls it for every block it makes).
    pub(crate) fn track(&mut self, id: BlockId) {
        if self.next.len() <= id as usize {
            self.next.resize(id as usize + 1, NONE);
        }
    }

    /// The table of `queue` in `tables`, if it has one.
    #[inline(always)]
    fn table(tables: &mut [(QueueKey, Box<Table>)], queue: QueueKey) -> Option<&mut Table> {
        if tables.first().is_some_and(|&(q, _)| q == queue) {
            return Some(&mut tables[0].1);
        }
        Self::table_behind(tables, queue)
    }

    /// The table of a queue other than the first, moved to the front.
    #[cold]
    #[inline(never)]
    fn table_behind(tables: &mut [(QueueKey, Box<Table>)], queue: QueueKey) -> Option<&mut Table> {
        let i = tables.iter().position(|&(q, _)| q == queue)?;
        tables.swap(0, i);
        Some(&mut tables[0].1)
    }

    /// The table of `queue`, made if it has none.
    #[inline(always)]
    fn table_or_add(&mut self, queue: QueueKey) -> &mut Table {
        if self.tables.first().is_some_and(|&(q, _)| q == queue) {
            return &mut self.tables[0].1;
        }
        self.table_behind_or_add(queue)
    }

    #[cold]
    #[inline(never)]
    fn table_behind_or_add(&mut self, queue: QueueKey) -> &mut Table {
        match self.tables.iter().position(|&(q, _)| q == queue) {
            Some(i) => self.tables.swap(0, i),
            None => {
                let t = Box::new(Table { heads: [NONE; CLASSES], used: [0; WORDS] });
                self.tables.insert(0, (queue, t));
            }
        }
        &mut self.tables[0].1
    }

    /// Drops the table of `queue`, whose queue is gone. The cache must hold none of its
    /// blocks (the pool flushes it first).
    pub(crate) fn forget_queue(&mut self, queue: QueueKey) {
        self.large.retain(|k, _| k.0 != queue);
        let Some(i) = self.tables.iter().position(|&(q, _)| q == queue) else { return };
        debug_assert!(self.tables[i].1.heads.iter().all(|&h| h == NONE));
        self.tables.swap_remove(i);
    }

    /// Adds a free block of `size` (a multiple of 512) bound to `queue`.
    #[inline(always)]
    pub(crate) fn push(&mut self, queue: QueueKey, size: usize, id: BlockId) {
        let old = if size > SMALL_SIZE {
            self.push_large(queue, size, id)
        } else {
            let t = self.table_or_add(queue);
            let c = size / MIN_BLOCK;
            t.used[c / 64] |= 1 << (c % 64);
            std::mem::replace(&mut t.heads[c], id)
        };
        self.next[id as usize] = old;
        self.len += 1;
    }

    #[cold]
    #[inline(never)]
    fn push_large(&mut self, queue: QueueKey, size: usize, id: BlockId) -> BlockId {
        std::mem::replace(self.large.entry((queue, size)).or_insert(NONE), id)
    }

    /// Takes a block of exactly `size` bound to `queue`, the one freed last.
    #[inline(always)]
    pub(crate) fn pop(&mut self, queue: QueueKey, size: usize) -> Option<BlockId> {
        let slot = if size > SMALL_SIZE {
            self.large.get_mut(&(queue, size))?
        } else {
            &mut Self::table(&mut self.tables, queue)?.heads[size / MIN_BLOCK]
        };
        let id = *slot;
        if id == NONE {
            return None;
        }
        *slot = self.next[id as usize];
        self.len -= 1;
        Some(id)
    }

    /// Visits the head of every list that may hold blocks.
    fn heads_in_use(&self) -> impl Iterator<Item = BlockId> + '_ {
        // Set bits only, lowest first: a flush costs what it moves, not the size of the table.
        let small = self.tables.iter().flat_map(|(_, t)| {
            t.used.iter().enumerate().flat_map(move |(w, &bits)| {
                std::iter::successors((bits != 0).then_some(bits), |&b| {
                    let rest = b & (b - 1);
                    (rest != 0).then_some(rest)
                })
                .map(move |b| t.heads[w * 64 + b.trailing_zeros() as usize])
            })
        });
        small.chain(self.large.values().copied())
    }

    fn chain(&self, mut id: BlockId, out: &mut Vec<BlockId>) {
        while id != NONE {
            out.push(id);
            id = self.next[id as usize];
        }
    }

    /// Takes every block out, into `out` (cleared first): the cost is the blocks moved and the
    /// classes used, not the table.
    pub(crate) fn take_all_into(&mut self, out: &mut Vec<BlockId>) {
        out.clear();
        out.reserve(self.len);
        for (_, t) in &mut self.tables {
            for w in 0..WORDS {
                let mut bits = std::mem::take(&mut t.used[w]);
                while bits != 0 {
                    let c = w * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    let mut id = std::mem::replace(&mut t.heads[c], NONE);
                    while id != NONE {
                        out.push(id);
                        id = self.next[id as usize];
                    }
                }
            }
        }
        for (_, head) in self.large.drain() {
            let mut id = head;
            while id != NONE {
                out.push(id);
                id = self.next[id as usize];
            }
        }
        self.len = 0;
    }

    /// Takes every block out.
    #[cfg(test)]
    pub(crate) fn take_all(&mut self) -> Vec<BlockId> {
        let mut out = Vec::new();
        self.take_all_into(&mut out);
        out
    }

    /// Every block held, in no particular order.
    pub(crate) fn ids(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.len);
        for head in self.heads_in_use() {
            self.chain(head, &mut out);
        }
        out
    }

    /// Every block held with the (queue, size) list it is on, in no particular order (for
    /// the pool's invariant checks).
    pub(crate) fn entries(&self) -> Vec<(QueueKey, usize, BlockId)> {
        let mut out = Vec::with_capacity(self.len);
        let mut chain = Vec::new();
        for (queue, t) in &self.tables {
            for (c, &head) in t.heads.iter().enumerate() {
                chain.clear();
                self.chain(head, &mut chain);
                out.extend(chain.iter().map(|&id| (*queue, c * MIN_BLOCK, id)));
            }
        }
        for (&(queue, size), &head) in &self.large {
            chain.clear();
            self.chain(head, &mut chain);
            out.extend(chain.iter().map(|&id| (queue, size, id)));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_reuse_last_in_first_out_per_stream_and_size() {
        let mut q = Quick::default();
        q.track(9);
        q.push(QueueKey::test(1), 4096, 7);
        q.push(QueueKey::test(1), 4096, 9);
        q.push(QueueKey::test(2), 4096, 3);
        q.push(QueueKey::test(1), 8 << 20, 5);
        q.push(QueueKey::test(1), 8 << 20, 6);
        assert_eq!(q.len(), 5);
        assert_eq!(q.pop(QueueKey::test(1), 4096), Some(9));
        assert_eq!(q.pop(QueueKey::test(1), 8192), None);
        assert_eq!(q.pop(QueueKey::test(3), 4096), None);
        assert_eq!(q.pop(QueueKey::test(2), 4096), Some(3));
        assert_eq!(q.pop(QueueKey::test(2), 4096), None);
        assert_eq!(q.pop(QueueKey::test(1), 8 << 20), Some(6));
        let mut entries = q.entries();
        entries.sort_unstable();
        assert_eq!(entries, [(QueueKey::test(1), 4096, 7), (QueueKey::test(1), 8 << 20, 5)]);
        let mut rest = q.ids();
        rest.sort_unstable();
        assert_eq!(rest, [5, 7]);
        let mut all = q.take_all();
        all.sort_unstable();
        assert_eq!(all, [5, 7]);
        assert_eq!(q.len(), 0);
        assert_eq!(q.pop(QueueKey::test(1), 4096), None);
        // Reusable after a flush, and the flush forgot nothing.
        q.push(QueueKey::test(1), 4096, 7);
        q.push(QueueKey::test(1), SMALL_SIZE, 8);
        q.push(QueueKey::test(2), MIN_BLOCK, 1);
        assert_eq!(q.ids().len(), 3);
        assert_eq!(q.take_all().len(), 3);
        assert!(q.ids().is_empty());
    }
}
