//! [`Pool::check_invariants`]: every structural rule of the pool, its stats, the expandable
//! segments' state, the raw table and the quick cache, checked by walking everything. For
//! unit tests (after every step), the fuzzer's model and the stress tests.

use std::collections::HashSet;

use super::super::block::{BlockId, PoolKind};
use super::super::stats;
use super::Pool;

impl Pool {
    /// Checks every structural invariant of the pool and its stats; the first one broken is
    /// the error. For tests, fuzzers and model checks (it walks everything: O(blocks)).
    pub(crate) fn check_invariants(&self) -> std::result::Result<(), String> {
        let dead: HashSet<BlockId> = self.free_ids.iter().copied().collect();
        if dead.len() != self.free_ids.len() {
            return Err("a block id is on the free-id list twice".into());
        }
        let live_seg = |i: u32| self.segments.get(i as usize).is_some_and(Option::is_some);
        let mut per_seg: Vec<Vec<BlockId>> = vec![Vec::new(); self.segments.len()];
        for (id, b) in self.blocks.iter().enumerate() {
            let id = id as BlockId;
            if dead.contains(&id) {
                continue;
            }
            if !live_seg(b.seg) {
                return Err(format!("live block {id} is in released segment {}", b.seg));
            }
            if b.size == 0 {
                return Err(format!("block {id} is empty"));
            }
            per_seg[b.seg as usize].push(id);
        }
        // Blocks tile each segment (an expandable one up to its mapped end), in link order.
        let mut by_addr = 0usize;
        let mut reserved = [0i64; 3];
        let mut segments = [0i64; 3];
        for (si, entry) in self.segments.iter().enumerate() {
            let Some(e) = entry else {
                if !per_seg[si].is_empty() {
                    return Err(format!("released segment {si} still has blocks"));
                }
                continue;
            };
            let mut ids = std::mem::take(&mut per_seg[si]);
            if let Some(a) = &e.arena {
                // An arena's blocks are views: checked by the arena, not tiled.
                let mut blocks = Vec::with_capacity(ids.len());
                for &id in &ids {
                    let b = &self.blocks[id as usize];
                    if b.prev.is_some()
                        || b.next.is_some()
                        || b.pool != PoolKind::for_size(b.size)
                        || b.queue != e.queue
                        || !b.arena
                        || b.in_quick
                    {
                        return Err(format!(
                            "arena block {id} is linked, of another queue, in the wrong pool, not marked or quick-cached"
                        ));
                    }
                    if self.raw.addrs.get(e.base + b.offset) != Some(id) {
                        return Err(format!("arena block {id} is not in the address table"));
                    }
                    blocks.push((id, b.offset, b.size, b.allocated || b.in_quick));
                }
                by_addr += ids.len();
                a.check(&blocks).map_err(|why| format!("arena {si}: {why}"))?;
                if self.arenas.get(&e.queue) != Some(&(si as u32)) {
                    return Err(format!("arena {si} is not its queue's"));
                }
                let bytes = a.backed_bytes() as i64;
                reserved[0] += bytes;
                reserved[e.pool.index()] += bytes;
                segments[0] += 1;
                segments[e.pool.index()] += 1;
                continue;
            }
            ids.sort_by_key(|&id| self.blocks[id as usize].offset);
            let mut at = 0;
            for (k, &id) in ids.iter().enumerate() {
                let b = &self.blocks[id as usize];
                if b.offset != at {
                    return Err(format!("segment {si}: block {id} starts at {} where {at} was expected", b.offset));
                }
                at += b.size;
                let (want_prev, want_next) = (k.checked_sub(1).map(|p| ids[p]), ids.get(k + 1).copied());
                if b.prev != want_prev || b.next != want_next {
                    return Err(format!(
                        "segment {si}: block {id} links prev {:?} next {:?}, address order says {want_prev:?} {want_next:?}",
                        b.prev, b.next
                    ));
                }
                if b.pool != e.pool || b.queue != e.queue {
                    return Err(format!(
                        "block {id} has pool/queue {:?}/{}, its segment {:?}/{}",
                        b.pool, b.queue, e.pool, e.queue
                    ));
                }
                if self.raw.addrs.get(e.base + b.offset) != Some(id) {
                    return Err(format!("block {id} is not in the address table"));
                }
                if b.arena {
                    return Err(format!("block {id} of a segment is marked an arena's view"));
                }
                by_addr += 1;
            }
            if at != e.size {
                return Err(format!("segment {si}: blocks cover {at} of its {} bytes", e.size));
            }
            let mut bytes = e.size as i64;
            if let Some(exp) = &e.exp {
                let blocks: Vec<_> = ids
                    .iter()
                    .map(|&id| {
                        let b = &self.blocks[id as usize];
                        (id, b.offset, b.size, !b.is_pooled_free())
                    })
                    .collect();
                exp.check(e.size, &blocks).map_err(|why| format!("expandable segment {si}: {why}"))?;
                bytes = exp.backed_bytes(e.size) as i64;
                if self.expandable.get(&(e.queue, e.pool)) != Some(&(si as u32)) {
                    return Err(format!("expandable segment {si} is not its (queue, pool)'s"));
                }
            }
            reserved[0] += bytes;
            reserved[e.pool.index()] += bytes;
            segments[0] += 1;
            segments[e.pool.index()] += 1;
        }
        for (&(queue, pool), &si) in &self.expandable {
            let e = self.segments.get(si as usize).and_then(Option::as_ref);
            if !e.is_some_and(|e| e.exp.is_some() && e.queue == queue && e.pool == pool) {
                return Err(format!("the expandable segment of ({queue}, {pool:?}) is {si}, which is not it"));
            }
        }
        if by_addr != self.raw.addrs.len() {
            return Err(format!("the address table has {} entries for {by_addr} blocks", self.raw.addrs.len()));
        }
        for p in 0..3 {
            if self.stats.device.reserved_bytes[p].current != reserved[p] {
                return Err(format!(
                    "reserved bytes[{p}] {} but segments hold {}",
                    self.stats.device.reserved_bytes[p].current, reserved[p]
                ));
            }
            if self.stats.device.segment[p].current != segments[p] {
                return Err(format!(
                    "segment count[{p}] {} but {} are live",
                    self.stats.device.segment[p].current, segments[p]
                ));
            }
        }
        // Pool membership, quick cache, merging, and the hot stats.
        let quick: HashSet<BlockId> = self.quick.ids().into_iter().collect();
        if quick.len() != self.quick.len() {
            return Err(format!("the quick cache counts {} blocks, lists {}", self.quick.len(), quick.len()));
        }
        // Every list holds blocks of its own (queue, size), once, walking every slot (not only
        // those the flush would visit).
        let entries = self.quick.entries();
        if entries.len() != quick.len() {
            return Err(format!(
                "the quick cache's lists hold {} blocks, {} of them reachable",
                entries.len(),
                quick.len()
            ));
        }
        for &(queue, size, id) in &entries {
            let b = &self.blocks[id as usize];
            if dead.contains(&id) || b.queue != queue || b.size != size {
                return Err(format!(
                    "quick-cache list ({queue}, {size}) holds block {id} of ({}, {})",
                    b.queue, b.size
                ));
            }
        }
        let mut pooled = 0;
        for (p, set) in self.pools.iter().enumerate() {
            for k in set.iter() {
                let id = k.3;
                if dead.contains(&id) || self.key(id) != k || self.blocks[id as usize].pool.slot() != p {
                    return Err(format!("pool {p} holds a stale key {k:?}"));
                }
                pooled += 1;
            }
        }
        let (mut alloc, mut alloc_bytes, mut req_bytes, mut inactive, mut inactive_bytes, mut pend) =
            ([0i64; 3], [0i64; 3], [0i64; 3], [0i64; 3], [0i64; 3], [0i64; 3]);
        let mut free_pooled = 0;
        for (id, b) in self.blocks.iter().enumerate() {
            let id = id as BlockId;
            if dead.contains(&id) {
                continue;
            }
            let in_pool = self.pools[b.pool.slot()].contains(&self.key(id));
            if b.in_quick != quick.contains(&id) {
                return Err(format!("block {id}: in_quick {} but the quick cache says {}", b.in_quick, !b.in_quick));
            }
            let add = |a: &mut [i64; 3], v: i64| {
                a[0] += v;
                a[b.pool.index()] += v;
            };
            if b.allocated {
                if in_pool || b.in_quick {
                    return Err(format!("allocated block {id} is also cached"));
                }
                if b.requested > 0 {
                    add(&mut alloc, 1);
                    add(&mut alloc_bytes, b.size as i64);
                    add(&mut req_bytes, b.requested as i64);
                } else {
                    add(&mut pend, 1);
                }
                if b.raw && b.requested == 0 {
                    return Err(format!("raw block {id} has no request"));
                }
            } else {
                if b.raw || b.raw_used {
                    return Err(format!("free block {id} is still marked raw"));
                }
                if self.is_arena(id) {
                    // A cached view: in no pool (the arena lists it).
                    if in_pool {
                        return Err(format!("arena block {id} is in a pool"));
                    }
                    continue;
                }
                if in_pool == b.in_quick {
                    return Err(format!("free block {id}: in its pool {in_pool}, in the quick cache {}", b.in_quick));
                }
                if in_pool {
                    free_pooled += 1;
                    for n in [b.prev, b.next].into_iter().flatten() {
                        let nb = &self.blocks[n as usize];
                        if nb.is_pooled_free() {
                            return Err(format!("free pooled neighbours {id} and {n} were not merged"));
                        }
                    }
                }
                if b.is_split() {
                    add(&mut inactive, 1);
                    add(&mut inactive_bytes, b.size as i64);
                }
            }
        }
        if free_pooled != pooled {
            return Err(format!("the pools hold {pooled} keys for {free_pooled} free pooled blocks"));
        }
        let checks = [
            ("allocation", stats::ALLOCATION, alloc),
            ("allocated bytes", stats::ALLOCATED_BYTES, alloc_bytes),
            ("requested bytes", stats::REQUESTED_BYTES, req_bytes),
            ("inactive split", stats::INACTIVE_SPLIT, inactive),
            ("inactive split bytes", stats::INACTIVE_SPLIT_BYTES, inactive_bytes),
        ];
        for (name, field, want) in checks {
            let have = self.stats.hot.current(field);
            if have != want {
                return Err(format!("{name}: stats say {have:?}, the blocks {want:?}"));
            }
        }
        let have_pend = self.stats.pending_current();
        if have_pend != pend {
            return Err(format!("pending frees: stats say {have_pend:?}, the blocks {pend:?}"));
        }
        self.raw.check(&self.blocks, &dead)?;
        self.check_limbo()?;
        Ok(())
    }
}
