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

#[derive(Default)]
pub(crate) struct Quick {
    /// The queues with small classes, in the order they came; queue `i` owns
    /// `heads[i * CLASSES..][..CLASSES]` and `used[i * WORDS..][..WORDS]`.
    queues: Vec<QueueKey>,
    /// The queue index used last (queues are few and used in runs).
    last: usize,
    heads: Vec<BlockId>,
    /// A set bit: the class has held a block since the last flush.
    used: Vec<u64>,
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

    #[inline]
    fn find(&mut self, queue: QueueKey) -> Option<usize> {
        if self.queues.get(self.last) == Some(&queue) {
            return Some(self.last);
        }
        let i = self.queues.iter().position(|&s| s == queue)?;
        self.last = i;
        Some(i)
    }

    #[cold]
    fn add_queue(&mut self, queue: QueueKey) -> usize {
        self.queues.push(queue);
        self.heads.resize(self.queues.len() * CLASSES, NONE);
        self.used.resize(self.queues.len() * WORDS, 0);
        self.last = self.queues.len() - 1;
        self.last
    }

    /// Drops the table of `queue`, whose queue is gone. The cache must hold none of its
    /// blocks (the pool flushes it first).
    pub(crate) fn forget_queue(&mut self, queue: QueueKey) {
        self.large.retain(|k, _| k.0 != queue);
        let Some(i) = self.queues.iter().position(|&s| s == queue) else { return };
        debug_assert!(self.heads[i * CLASSES..][..CLASSES].iter().all(|&h| h == NONE));
        let last = self.queues.len() - 1;
        if i != last {
            self.heads.copy_within(last * CLASSES..(last + 1) * CLASSES, i * CLASSES);
            self.used.copy_within(last * WORDS..(last + 1) * WORDS, i * WORDS);
            self.queues[i] = self.queues[last];
        }
        self.queues.pop();
        self.heads.truncate(last * CLASSES);
        self.used.truncate(last * WORDS);
        self.last = 0;
    }

    /// Adds a free block of `size` (a multiple of 512) bound to `queue`.
    #[inline(always)]
    pub(crate) fn push(&mut self, queue: QueueKey, size: usize, id: BlockId) {
        self.len += 1;
        let slot = if size > SMALL_SIZE {
            self.large.entry((queue, size)).or_insert(NONE)
        } else {
            let s = match self.find(queue) {
                Some(s) => s,
                None => self.add_queue(queue),
            };
            let c = size / MIN_BLOCK;
            self.used[s * WORDS + c / 64] |= 1 << (c % 64);
            &mut self.heads[s * CLASSES + c]
        };
        self.next[id as usize] = std::mem::replace(slot, id);
    }

    /// Takes a block of exactly `size` bound to `queue`, the one freed last.
    #[inline(always)]
    pub(crate) fn pop(&mut self, queue: QueueKey, size: usize) -> Option<BlockId> {
        if self.len == 0 {
            return None;
        }
        let slot = if size > SMALL_SIZE {
            self.large.get_mut(&(queue, size))?
        } else {
            let s = self.find(queue)?;
            &mut self.heads[s * CLASSES + size / MIN_BLOCK]
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
    fn heads_in_use(&self) -> impl Iterator<Item = (usize, BlockId)> + '_ {
        // Set bits only, lowest first: a flush costs what it moves, not the size of the table.
        let small = self.used.iter().enumerate().flat_map(|(w, &bits)| {
            let s = w / WORDS;
            std::iter::successors((bits != 0).then_some(bits), |&b| {
                let rest = b & (b - 1);
                (rest != 0).then_some(rest)
            })
            .map(move |b| s * CLASSES + (w % WORDS) * 64 + b.trailing_zeros() as usize)
        });
        small.map(|i| (i, self.heads[i])).chain(self.large.values().map(|&h| (usize::MAX, h)))
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
        for w in 0..self.used.len() {
            let (s, mut bits) = (w / WORDS, std::mem::take(&mut self.used[w]));
            while bits != 0 {
                let slot = s * CLASSES + (w % WORDS) * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let head = std::mem::replace(&mut self.heads[slot], NONE);
                self.chain(head, out);
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
        for (_, head) in self.heads_in_use() {
            self.chain(head, &mut out);
        }
        out
    }

    /// Every block held with the (queue, size) list it is on, in no particular order (for
    /// the pool's invariant checks).
    pub(crate) fn entries(&self) -> Vec<(QueueKey, usize, BlockId)> {
        let mut out = Vec::with_capacity(self.len);
        let mut chain = Vec::new();
        for (i, &head) in self.heads.iter().enumerate() {
            chain.clear();
            self.chain(head, &mut chain);
            let (queue, size) = (self.queues[i / CLASSES], (i % CLASSES) * MIN_BLOCK);
            out.extend(chain.iter().map(|&id| (queue, size, id)));
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
