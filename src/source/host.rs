//! Pinned host memory: a system-heap dma-buf where there is one (its pages are never swapped),
//! else a memfd locked with `mlock`. [`HostSource::backing`] says which it got and why.

use super::{HeapSource, MemorySource, ShmemSource, checked_len};
use crate::error::{Error, Result};
use crate::segment::{Origin, Segment, SegmentKind};

/// Which mechanism pins the memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostBacking {
    /// `/dev/dma_heap/system`.
    SystemHeap,
    /// memfd + `mlock`, because the system heap could not be used (the reason is kept).
    MlockedMemfd {
        /// Why the system heap was not used.
        reason: String,
    },
}

/// Pinned host memory.
#[derive(Debug)]
pub struct HostSource {
    heap: Option<HeapSource>,
    shmem: ShmemSource,
    backing: HostBacking,
}

impl Default for HostSource {
    fn default() -> Self {
        Self::new()
    }
}

impl HostSource {
    /// Uses the system heap if this process can open it, else memfd + mlock.
    pub fn new() -> Self {
        match HeapSource::open("system") {
            Ok(h) => Self::from_parts(Some(h.with_kind(SegmentKind::PinnedHost)), HostBacking::SystemHeap),
            Err(e) => {
                log::debug!("pinned host memory from mlocked memfds: the system heap is not usable: {e}");
                Self::from_parts(None, HostBacking::MlockedMemfd { reason: e.to_string() })
            }
        }
    }

    /// Always memfd + mlock (e.g. to keep buffers off the heap's accounting).
    pub fn mlocked() -> Self {
        Self::from_parts(None, HostBacking::MlockedMemfd { reason: "requested".into() })
    }

    fn from_parts(heap: Option<HeapSource>, backing: HostBacking) -> Self {
        Self { heap, shmem: ShmemSource::new().with_kind(SegmentKind::PinnedHost), backing }
    }

    /// What pins the memory, and why.
    pub fn backing(&self) -> &HostBacking {
        &self.backing
    }
}

impl MemorySource for HostSource {
    fn name(&self) -> String {
        match self.backing {
            HostBacking::SystemHeap => "host:dma-heap:system".into(),
            HostBacking::MlockedMemfd { .. } => "host:mlock".into(),
        }
    }

    fn kind(&self) -> SegmentKind {
        SegmentKind::PinnedHost
    }

    fn create_segment(&self, len: usize) -> Result<Segment> {
        if let Some(h) = &self.heap {
            return h.create_segment(len);
        }
        let len = checked_len(len, || self.name())?;
        let seg = self.shmem.memfd_segment(len, Origin::MlockedMemfd)?;
        let mapping = seg.mapping().expect("memfd segments are always mapped");
        mapping.lock().map_err(|source| {
            let limit = rustix::process::getrlimit(rustix::process::Resource::Memlock).current;
            match limit {
                // Under a locked-memory limit, the limit is what ran out (not memory).
                Some(l) if l < (64 << 40) => Error::ResourceLimit {
                    op: "mlock of pinned host memory",
                    resource: "this process's locked memory (RLIMIT_MEMLOCK)",
                    hint: "raise it with `ulimit -l` or limits.conf, or give the process the system DMA-BUF heap",
                    source,
                },
                _ => Error::OutOfMemory {
                    requested: len as u64,
                    source_name: format!("{} (mlock failed; RLIMIT_MEMLOCK is unlimited)", self.name()),
                    source,
                },
            }
        })?;
        Ok(seg)
    }
}
