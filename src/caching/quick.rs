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

impl Table {
    fn new() -> Box<Self> {
        Box::new(Table { heads: [NONE; CLASSES], used: [0; WORDS] })
    }
}

/// The per-queue tables: the one used last in front (queues are few and used in runs: a hit
/// on another queue moves it to the front). There is always a front table; the first is
/// made for no queue.
struct Tables {
    front: QueueKey,
    table: Box<Table>,
    rest: Vec<(QueueKey, Box<Table>)>,
}

impl Default for Tables {
    fn default() -> Self {
        Self { front: QueueKey::default(), table: Table::new(), rest: Vec::new() }
    }
}

impl Tables {
    /// The table of `queue`, if it has one.
    #[inline(always)]
    fn get(&mut self, queue: QueueKey) -> Option<&mut Table> {
        if self.front == queue {
            return Some(&mut self.table);
        }
        self.get_behind(queue)
    }

    /// The table of a queue other than the front one, moved to the front.
    #[cold]
    #[inline(never)]
    fn get_behind(&mut self, queue: QueueKey) -> Option<&mut Table> {
        let i = self.rest.iter().position(|&(q, _)| q == queue)?;
        self.move_to_front(i);
        Some(&mut self.table)
    }

    fn move_to_front(&mut self, i: usize) {
        let (q, t) = &mut self.rest[i];
        std::mem::swap(&mut self.front, q);
        std::mem::swap(&mut self.table, t);
    }

    /// The table of `queue`, made if it has none.
    #[inline(always)]
    fn get_or_add(&mut self, queue: QueueKey) -> &mut Table {
        if self.front == queue {
            return &mut self.table;
        }
        self.get_behind_or_add(queue)
    }

    #[cold]
    #[inline(never)]
    fn get_behind_or_add(&mut self, queue: QueueKey) -> &mut Table {
        match self.rest.iter().position(|&(q, _)| q == queue) {
            Some(i) => self.move_to_front(i),
            None => {
                let old = std::mem::replace(&mut self.table, Table::new());
                self.rest.push((std::mem::replace(&mut self.front, queue), old));
            }
        }
        &mut self.table
    }

    /// Drops the table of `queue` (which must hold no blocks).
    fn forget(&mut self, queue: QueueKey) {
        if self.front == queue {
            match self.rest.pop() {
                Some((q, t)) => (self.front, self.table) = (q, t),
                None => {
                    debug_assert!(self.table.heads.iter().all(|&h| h == NONE));
                    (self.front, self.table.used) = (QueueKey::default(), [0; WORDS]);
                }
            }
        } else if let Some(i) = self.rest.iter().position(|&(q, _)| q == queue) {
            debug_assert!(self.rest[i].1.heads.iter().all(|&h| h == NONE));
            self.rest.swap_remove(i);
        }
    }

    fn iter(&self) -> impl Iterator<Item = (QueueKey, &Table)> {
        std::iter::once((self.front, &*self.table)).chain(self.rest.iter().map(|(q, t)| (*q, &**t)))
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = &mut Table> {
        std::iter::once(&mut *self.table).chain(self.rest.iter_mut().map(|(_, t)| &mut **t))
    }
}

/// A block's entry: the next block on its list, and its address if the free that put it
/// there knew it (a raw free does; [`UNKNOWN`] otherwise).
type Link = (BlockId, usize);

/// No address known.
pub(crate) const UNKNOWN: usize = usize::MAX;

#[derive(Default)]
pub(crate) struct Quick {
    tables: Tables,
    large: HashMap<(QueueKey, usize), BlockId, FxBuild>,
    /// The entry of each block id.
    next: Vec<Link>,
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
            self.next.resize(id as usize + 1, (NONE, UNKNOWN));
        }
    }

    /// Drops the table of `queue`, whose queue is gone. The cache must hold none of its
    /// blocks (the pool flushes it first).
    pub(crate) fn forget_queue(&mut self, queue: QueueKey) {
        self.large.retain(|k, _| k.0 != queue);
        self.tables.forget(queue);
    }

    /// Adds a free block of `size` (a multiple of 512) bound to `queue`, starting at `addr`
    /// (or [`UNKNOWN`]).
    #[inline(always)]
    pub(crate) fn push(&mut self, queue: QueueKey, size: usize, id: BlockId, addr: usize) {
        let old = if size > SMALL_SIZE {
            self.push_large(queue, size, id)
        } else {
            let t = self.tables.get_or_add(queue);
            let c = size / MIN_BLOCK;
            t.used[c / 64] |= 1 << (c % 64);
            std::mem::replace(&mut t.heads[c], id)
        };
        self.next[id as usize] = (old, addr);
        self.len += 1;
    }

    #[cold]
    #[inline(never)]
    fn push_large(&mut self, queue: QueueKey, size: usize, id: BlockId) -> BlockId {
        std::mem::replace(self.large.entry((queue, size)).or_insert(NONE), id)
    }

    /// Takes a block of exactly `size` bound to `queue`, the one freed last, and its address
    /// if its free knew it (else [`UNKNOWN`]).
    #[inline(always)]
    pub(crate) fn pop(&mut self, queue: QueueKey, size: usize) -> Option<(BlockId, usize)> {
        let slot = if size > SMALL_SIZE {
            self.large.get_mut(&(queue, size))?
        } else {
            &mut self.tables.get(queue)?.heads[size / MIN_BLOCK]
        };
        let id = *slot;
        if id == NONE {
            return None;
        }
        let (next, addr) = self.next[id as usize];
        *slot = next;
        self.len -= 1;
        Some((id, addr))
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
            id = self.next[id as usize].0;
        }
    }

    /// Takes every block out, into `out` (cleared first): the cost is the blocks moved and the
    /// classes used, not the table.
    pub(crate) fn take_all_into(&mut self, out: &mut Vec<BlockId>) {
        out.clear();
        out.reserve(self.len);
        for t in self.tables.iter_mut() {
            for w in 0..WORDS {
                let mut bits = std::mem::take(&mut t.used[w]);
                while bits != 0 {
                    let c = w * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    let mut id = std::mem::replace(&mut t.heads[c], NONE);
                    while id != NONE {
                        out.push(id);
                        id = self.next[id as usize].0;
                    }
                }
            }
        }
        for (_, head) in self.large.drain() {
            let mut id = head;
            while id != NONE {
                out.push(id);
                id = self.next[id as usize].0;
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
        for (queue, t) in self.tables.iter() {
            for (c, &head) in t.heads.iter().enumerate() {
                chain.clear();
                self.chain(head, &mut chain);
                out.extend(chain.iter().map(|&id| (queue, c * MIN_BLOCK, id)));
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
        q.push(QueueKey::test(1), 4096, 7, UNKNOWN);
        q.push(QueueKey::test(1), 4096, 9, UNKNOWN);
        q.push(QueueKey::test(2), 4096, 3, UNKNOWN);
        q.push(QueueKey::test(1), 8 << 20, 5, UNKNOWN);
        q.push(QueueKey::test(1), 8 << 20, 6, UNKNOWN);
        assert_eq!(q.len(), 5);
        assert_eq!(q.pop(QueueKey::test(1), 4096), Some((9, UNKNOWN)));
        assert_eq!(q.pop(QueueKey::test(1), 8192), None);
        assert_eq!(q.pop(QueueKey::test(3), 4096), None);
        assert_eq!(q.pop(QueueKey::test(2), 4096), Some((3, UNKNOWN)));
        assert_eq!(q.pop(QueueKey::test(2), 4096), None);
        assert_eq!(q.pop(QueueKey::test(1), 8 << 20), Some((6, UNKNOWN)));
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
        q.push(QueueKey::test(1), 4096, 7, UNKNOWN);
        q.push(QueueKey::test(1), SMALL_SIZE, 8, UNKNOWN);
        q.push(QueueKey::test(2), MIN_BLOCK, 1, UNKNOWN);
        assert_eq!(q.ids().len(), 3);
        assert_eq!(q.take_all().len(), 3);
        assert!(q.ids().is_empty());
        // A raw free's address comes back with its block; queues are forgotten.
        q.push(QueueKey::test(3), 4096, 2, 0x4000);
        assert_eq!(q.pop(QueueKey::test(3), 4096), Some((2, 0x4000)));
        q.forget_queue(QueueKey::test(3));
        q.forget_queue(QueueKey::test(1));
        assert_eq!(q.pop(QueueKey::test(2), 4096), None);
        q.push(QueueKey::test(1), 4096, 7, UNKNOWN);
        assert_eq!(q.entries(), [(QueueKey::test(1), 4096, 7)]);
    }
}
