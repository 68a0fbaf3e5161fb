//! What the allocator holds and what it did, for people and tools: the [`Snapshot`] of its
//! segments and blocks, the bounded [`History`] of its events, and their JSON (the shapes of
//! PyTorch's `memory_snapshot()` and its trace entries).

use std::collections::VecDeque;
use std::fmt::Write;
use std::time::Instant;

use super::block::PoolKind;

/// Bounded history length.
const HISTORY: usize = 10_000;

/// A block's state in a [`Snapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    /// Handed out.
    Allocated,
    /// Freed by the caller, waiting for other queues' events.
    PendingFree,
    /// Cached, free.
    Free,
}

/// One block in a [`SegmentSnapshot`].
#[derive(Debug, Clone)]
pub struct BlockSnapshot {
    /// Offset in the segment.
    pub offset: usize,
    /// Rounded size.
    pub size: usize,
    /// Size asked for (0 when free).
    pub requested: usize,
    /// State.
    pub state: BlockState,
}

/// One segment with its blocks, in address order.
#[derive(Debug, Clone)]
pub struct SegmentSnapshot {
    /// Base address of its mapping.
    pub address: usize,
    /// Size.
    pub size: usize,
    /// "small" or "large".
    pub pool: &'static str,
    /// The queue it is bound to (0: none).
    pub stream: u64,
    /// An expandable segment: `size` is its mapped part, which grows and may have holes.
    pub is_expandable: bool,
    /// Blocks, by offset.
    pub blocks: Vec<BlockSnapshot>,
}

impl SegmentSnapshot {
    /// An expandable segment as PyTorch reports one: a segment per backed run (`runs`, byte
    /// ranges of the segment in order), each with the parts of the blocks that lie in it.
    /// Punched pages lie only under free blocks, so blocks in use are never cut.
    pub(crate) fn split_into_runs(self, runs: &[(usize, usize)]) -> Vec<SegmentSnapshot> {
        runs.iter()
            .map(|&(a, b)| {
                let blocks = self
                    .blocks
                    .iter()
                    .filter_map(|blk| {
                        let (from, to) = (blk.offset.max(a), (blk.offset + blk.size).min(b));
                        (from < to).then(|| BlockSnapshot {
                            offset: from - a,
                            size: to - from,
                            requested: if to - from == blk.size { blk.requested } else { 0 },
                            state: blk.state,
                        })
                    })
                    .collect();
                SegmentSnapshot { address: self.address + a, size: b - a, blocks, ..self.clone() }
            })
            .collect()
    }
}

/// Every segment the allocator holds.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Segments, by address.
    pub segments: Vec<SegmentSnapshot>,
}

impl Snapshot {
    /// As JSON.
    pub fn to_json(&self) -> String {
        let mut s = String::from("{\"segments\":[");
        for (i, seg) in self.segments.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            let _ = write!(
                s,
                "{{\"address\":{},\"total_size\":{},\"pool\":\"{}\",\"stream\":{},\"is_expandable\":{},\"blocks\":[",
                seg.address, seg.size, seg.pool, seg.stream, seg.is_expandable
            );
            for (j, b) in seg.blocks.iter().enumerate() {
                if j > 0 {
                    s.push(',');
                }
                let state = match b.state {
                    BlockState::Allocated => "active_allocated",
                    BlockState::PendingFree => "active_pending_free",
                    BlockState::Free => "inactive",
                };
                let _ = write!(
                    s,
                    "{{\"offset\":{},\"size\":{},\"requested_size\":{},\"state\":\"{state}\"}}",
                    b.offset, b.size, b.requested
                );
            }
            s.push_str("]}");
        }
        s.push_str("]}");
        s
    }
}

/// What happened, for the bounded history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HistoryKind {
    /// A block was handed out.
    Alloc,
    /// The caller freed a block used on other queues; it waits for their events.
    FreeRequested,
    /// A block returned to its pool.
    FreeCompleted,
    /// A segment was obtained from the source.
    SegmentAlloc,
    /// A segment was returned to the source.
    SegmentFree,
    /// More of an expandable segment was mapped (its reservation grew into backed memory).
    SegmentMap,
    /// Pages of an expandable segment were given back (punched, or the reservation released).
    SegmentUnmap,
    /// A request failed with out-of-memory.
    Oom,
    /// A raw free of a pointer that is not a live raw allocation was refused.
    InvalidFree,
}

/// One history entry.
#[derive(Debug, Clone, Copy)]
pub struct HistoryEvent {
    /// Nanoseconds since the allocator was created.
    pub t_ns: u64,
    /// What happened.
    pub kind: HistoryKind,
    /// Address of the block or segment; for an OOM, as in PyTorch's trace, the bytes the
    /// allowed memory still had free.
    pub addr: usize,
    /// Its size (the request's, for an OOM).
    pub size: usize,
    /// The queue (0: none).
    pub stream: u64,
}

impl HistoryEvent {
    /// As one JSON object.
    pub fn to_json(&self) -> String {
        let kind = match self.kind {
            HistoryKind::Alloc => "alloc",
            HistoryKind::FreeRequested => "free_requested",
            HistoryKind::FreeCompleted => "free_completed",
            HistoryKind::SegmentAlloc => "segment_alloc",
            HistoryKind::SegmentFree => "segment_free",
            HistoryKind::SegmentMap => "segment_map",
            HistoryKind::SegmentUnmap => "segment_unmap",
            HistoryKind::Oom => "oom",
            HistoryKind::InvalidFree => "invalid_free",
        };
        format!(
            "{{\"t\":{},\"action\":\"{kind}\",\"addr\":{},\"size\":{},\"stream\":{}}}",
            self.t_ns, self.addr, self.size, self.stream
        )
    }
}

impl Snapshot {
    /// Builds a snapshot from the pool's segment table (`None`: a released slot) as
    /// `(base address, size, pool, queue, expandable)`, and its live blocks as `(segment index, block)`
    /// in any order: blocks are grouped by segment and sorted by offset, segments by address.
    pub(crate) fn build(
        segments: impl ExactSizeIterator<Item = Option<(usize, usize, PoolKind, u64, bool)>>,
        blocks: impl Iterator<Item = (u32, BlockSnapshot)>,
    ) -> Snapshot {
        let heads: Vec<_> = segments.collect();
        let mut by_seg: Vec<Vec<BlockSnapshot>> = vec![Vec::new(); heads.len()];
        for (seg, b) in blocks {
            // A block of a released segment (its slot empty) is not live.
            if heads.get(seg as usize).is_some_and(Option::is_some) {
                by_seg[seg as usize].push(b);
            }
        }
        let mut out: Vec<SegmentSnapshot> = Vec::new();
        for (i, head) in heads.into_iter().enumerate() {
            if let Some((address, size, pool, stream, is_expandable)) = head {
                let mut blocks = std::mem::take(&mut by_seg[i]);
                blocks.sort_by_key(|b| b.offset);
                out.push(SegmentSnapshot { address, size, pool: pool.name(), stream, is_expandable, blocks });
            }
        }
        out.sort_by_key(|s| s.address);
        Snapshot { segments: out }
    }
}

/// The bounded history of allocator events (the oldest drop out).
pub(crate) struct History {
    events: VecDeque<HistoryEvent>,
    /// Record alloc/free events too (segment events, OOMs and refused frees are always
    /// recorded). Read on the hot path.
    pub(crate) record_all: bool,
    started: Instant,
}

impl History {
    pub(crate) fn new() -> Self {
        Self { events: VecDeque::new(), record_all: false, started: Instant::now() }
    }

    /// Records an event if its kind is always recorded or `record_all` is on.
    pub(crate) fn log(&mut self, kind: HistoryKind, addr: usize, size: usize, stream: u64) {
        let always = matches!(
            kind,
            HistoryKind::SegmentAlloc
                | HistoryKind::SegmentFree
                | HistoryKind::SegmentMap
                | HistoryKind::SegmentUnmap
                | HistoryKind::Oom
        );
        if !always && !self.record_all {
            return;
        }
        self.log_always(kind, addr, size, stream);
    }

    /// Records an event whatever `record_all` says.
    pub(crate) fn log_always(&mut self, kind: HistoryKind, addr: usize, size: usize, stream: u64) {
        if self.events.len() == HISTORY {
            self.events.pop_front();
        }
        let t_ns = self.started.elapsed().as_nanos() as u64;
        self.events.push_back(HistoryEvent { t_ns, kind, addr, size, stream });
    }

    /// The events, oldest first.
    pub(crate) fn events(&self) -> Vec<HistoryEvent> {
        self.events.iter().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(offset: usize, size: usize, state: BlockState) -> BlockSnapshot {
        BlockSnapshot { offset, size, requested: if state == BlockState::Allocated { size } else { 0 }, state }
    }

    #[test]
    fn build_groups_blocks_by_segment_and_sorts_both() {
        let segments = vec![
            Some((0x20_0000, 4096, PoolKind::Large, 3, true)),
            None,
            Some((0x10_0000, 2048, PoolKind::Small, 0, false)),
        ];
        let blocks = vec![
            (2, block(1024, 1024, BlockState::Free)),
            (0, block(0, 4096, BlockState::PendingFree)),
            (2, block(0, 1024, BlockState::Allocated)),
            (1, block(0, 512, BlockState::Free)), // in a released slot: not live
        ];
        let s = Snapshot::build(segments.into_iter(), blocks.into_iter());
        assert_eq!(s.segments.len(), 2);
        assert_eq!((s.segments[0].address, s.segments[0].pool, s.segments[0].stream), (0x10_0000, "small", 0));
        assert_eq!(s.segments[0].blocks.iter().map(|b| b.offset).collect::<Vec<_>>(), [0, 1024]);
        assert_eq!(s.segments[1].pool, "large");
        let json = s.to_json();
        assert!(json.starts_with("{\"segments\":[{\"address\":1048576,\"total_size\":2048,\"pool\":\"small\""));
        assert!(json.contains("\"state\":\"active_pending_free\""));
        assert!(json.contains("\"requested_size\":1024,\"state\":\"active_allocated\""));
    }

    #[test]
    fn history_is_bounded_and_filters_unless_recording_all() {
        let mut h = History::new();
        h.log(HistoryKind::Alloc, 1, 512, 0);
        h.log(HistoryKind::Oom, 0, 512, 0);
        h.log_always(HistoryKind::InvalidFree, 7, 0, 0);
        let kinds: Vec<_> = h.events().iter().map(|e| e.kind).collect();
        assert_eq!(kinds, [HistoryKind::Oom, HistoryKind::InvalidFree]);
        h.record_all = true;
        for i in 0..HISTORY {
            h.log(HistoryKind::Alloc, i, 512, 0);
        }
        let events = h.events();
        assert_eq!(events.len(), HISTORY);
        assert_eq!(events[0].addr, 0, "the oldest dropped out");
        assert!(events[0].to_json().contains("\"action\":\"alloc\""));
    }
}
