//! Where each block starts: an exact table for frees (a raw pointer must be a block's start)
//! and an ordered one for ranges (a copy's pointer may lie anywhere inside a block). Both
//! change only when blocks are made, split, merged or released: never on the hot path, which
//! hands out and takes back whole blocks.

use std::collections::{BTreeMap, HashMap};

use super::block::BlockId;
use super::quick::FxBuild;

#[derive(Default)]
pub(crate) struct BlockAddrs {
    exact: HashMap<usize, BlockId, FxBuild>,
    ordered: BTreeMap<usize, BlockId>,
}

impl BlockAddrs {
    pub(crate) fn insert(&mut self, addr: usize, id: BlockId) {
        self.exact.insert(addr, id);
        self.ordered.insert(addr, id);
    }

    pub(crate) fn remove(&mut self, addr: usize) {
        self.exact.remove(&addr);
        self.ordered.remove(&addr);
    }

    /// The block that starts at `addr`.
    #[inline]
    pub(crate) fn get(&self, addr: usize) -> Option<BlockId> {
        self.exact.get(&addr).copied()
    }

    /// The block that starts last at or before `addr` (the one holding it, if any does), and
    /// its start.
    pub(crate) fn at_or_before(&self, addr: usize) -> Option<(usize, BlockId)> {
        self.ordered.range(..=addr).next_back().map(|(&a, &id)| (a, id))
    }

    pub(crate) fn len(&self) -> usize {
        debug_assert_eq!(self.exact.len(), self.ordered.len());
        self.exact.len()
    }
}
