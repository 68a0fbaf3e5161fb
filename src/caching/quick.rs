//! The quick cache: freed blocks kept unmerged for exact reuse, by (queue, rounded size).
//!
//! This is the fast path of periodic workloads (a training step frees and re-allocates the
//! same sizes on the same queue). Small sizes index a per-queue table of list heads directly
//! (one slot per 512-byte class up to 1 MiB); larger sizes go through a hash map. The lists are
//! intrusive: one link per block id, so a push or a pop moves no memory.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::pool::{BlockId, MIN_BLOCK, SMALL_SIZE};

/// No block.
const NONE: BlockId = BlockId::MAX;
/// Small size classes: every multiple of 512 up to and including 1 MiB.
const CLASSES: usize = SMALL_SIZE / MIN_BLOCK + 1;

/// A fast multiplicative hasher for small integer keys.
#[derive(Default)]
pub(crate) struct FxHasher(u64);

impl Hasher for FxHasher {
    fn finish(&self) -> u64 {
        self.0
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

/// One queue's small classes.
struct Classes {
    stream: u64,
    heads: Box<[BlockId]>,
    /// Whether the class is listed in `Quick::dirty` (it may hold blocks).
    listed: Box<[bool]>,
}

#[derive(Default)]
pub(crate) struct Quick {
    streams: Vec<Classes>,
    /// The index in `streams` used last (queues are few and used in runs).
    last: usize,
    large: HashMap<(u64, usize), BlockId, FxBuild>,
    /// The link of each block id that is in a list.
    next: Vec<BlockId>,
    /// Small classes that may hold blocks, as (stream index, class): what a flush visits.
    dirty: Vec<(u32, u32)>,
    len: usize,
}

impl Quick {
    /// Blocks held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn find(&mut self, stream: u64) -> Option<usize> {
        if self.streams.get(self.last).is_some_and(|c| c.stream == stream) {
            return Some(self.last);
        }
        let i = self.streams.iter().position(|c| c.stream == stream)?;
        self.last = i;
        Some(i)
    }

    /// Adds a free block of `size` (a multiple of 512) bound to `stream`.
    pub(crate) fn push(&mut self, stream: u64, size: usize, id: BlockId) {
        if self.next.len() <= id as usize {
            self.next.resize(id as usize + 1, NONE);
        }
        self.len += 1;
        if size > SMALL_SIZE {
            let head = self.large.entry((stream, size)).or_insert(NONE);
            self.next[id as usize] = *head;
            *head = id;
            return;
        }
        let s = match self.find(stream) {
            Some(s) => s,
            None => {
                self.streams.push(Classes {
                    stream,
                    heads: vec![NONE; CLASSES].into_boxed_slice(),
                    listed: vec![false; CLASSES].into_boxed_slice(),
                });
                self.last = self.streams.len() - 1;
                self.last
            }
        };
        let c = size / MIN_BLOCK;
        let classes = &mut self.streams[s];
        self.next[id as usize] = classes.heads[c];
        classes.heads[c] = id;
        if !classes.listed[c] {
            classes.listed[c] = true;
            self.dirty.push((s as u32, c as u32));
        }
    }

    /// Takes a block of exactly `size` bound to `stream`, the one freed last.
    pub(crate) fn pop(&mut self, stream: u64, size: usize) -> Option<BlockId> {
        if self.len == 0 {
            return None;
        }
        let head = if size > SMALL_SIZE {
            let head = self.large.get_mut(&(stream, size))?;
            let id = *head;
            if id == NONE {
                return None;
            }
            *head = self.next[id as usize];
            id
        } else {
            let s = self.find(stream)?;
            let slot = &mut self.streams[s].heads[size / MIN_BLOCK];
            let id = *slot;
            if id == NONE {
                return None;
            }
            *slot = self.next[id as usize];
            id
        };
        self.len -= 1;
        Some(head)
    }

    /// Takes every block out.
    pub(crate) fn take_all(&mut self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.len);
        for (s, c) in self.dirty.drain(..) {
            let classes = &mut self.streams[s as usize];
            classes.listed[c as usize] = false;
            let mut id = std::mem::replace(&mut classes.heads[c as usize], NONE);
            while id != NONE {
                out.push(id);
                id = self.next[id as usize];
            }
        }
        for (_, mut id) in self.large.drain() {
            while id != NONE {
                out.push(id);
                id = self.next[id as usize];
            }
        }
        self.len = 0;
        out
    }

    /// Every block held, in no particular order.
    pub(crate) fn ids(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.len);
        let heads = self.dirty.iter().map(|&(s, c)| self.streams[s as usize].heads[c as usize]);
        for mut id in heads.chain(self.large.values().copied()) {
            while id != NONE {
                out.push(id);
                id = self.next[id as usize];
            }
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
        q.push(1, 4096, 7);
        q.push(1, 4096, 9);
        q.push(2, 4096, 3);
        q.push(1, 8 << 20, 5);
        q.push(1, 8 << 20, 6);
        assert_eq!(q.len(), 5);
        assert_eq!(q.pop(1, 4096), Some(9));
        assert_eq!(q.pop(1, 8192), None);
        assert_eq!(q.pop(3, 4096), None);
        assert_eq!(q.pop(2, 4096), Some(3));
        assert_eq!(q.pop(2, 4096), None);
        assert_eq!(q.pop(1, 8 << 20), Some(6));
        let mut rest = q.ids();
        rest.sort_unstable();
        assert_eq!(rest, [5, 7]);
        let mut all = q.take_all();
        all.sort_unstable();
        assert_eq!(all, [5, 7]);
        assert_eq!(q.len(), 0);
        assert_eq!(q.pop(1, 4096), None);
        // Reusable after a flush, and the flush forgot nothing.
        q.push(1, 4096, 7);
        q.push(1, SMALL_SIZE, 8);
        assert_eq!(q.take_all().len(), 2);
        assert!(q.ids().is_empty());
    }
}
