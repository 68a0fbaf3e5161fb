//! A caching allocator for pinned host memory, in the style of PyTorch's
//! `CachingHostAllocator`: sizes round up to powers of two, blocks are never split, a freed
//! block is reused for the same power of two once every queue that used it has passed the
//! point of its free, and frees are lock-free.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};

use super::free_list::{FreeList, Node};
use crate::error::{Error, Result};
use crate::queue::{Mem, Queue, QueueHandle};
use crate::segment::{Access, Segment};
use crate::source::{HostSource, MemorySource};
use crate::view::CpuView;

/// The smallest block.
const MIN_SIZE: usize = 4096;

/// Host allocator statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostStats {
    /// Bytes in blocks handed out (rounded).
    pub allocated_bytes: u64,
    /// Bytes obtained from the source.
    pub reserved_bytes: u64,
    /// Peak of `allocated_bytes`.
    pub peak_allocated_bytes: u64,
    /// Blocks handed out.
    pub num_allocs: u64,
    /// Blocks returned.
    pub num_frees: u64,
    /// Blocks obtained from the source.
    pub num_source_allocs: u64,
    /// Blocks returned to the source.
    pub num_source_frees: u64,
}

struct State {
    /// Free blocks by power-of-two size.
    free: HashMap<usize, Vec<Arc<Segment>>>,
    stats: HostStats,
}

struct HostAllocatorShared {
    source: Box<dyn MemorySource>,
    state: Mutex<State>,
    frees: FreeList<Arc<Segment>>,
}

/// The pinned-host caching allocator. Cheap to clone.
#[derive(Clone)]
pub struct HostCachingAllocator {
    inner: Arc<HostAllocatorShared>,
}

impl std::fmt::Debug for HostCachingAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostCachingAllocator").field("stats", &self.stats()).finish()
    }
}

impl Default for HostCachingAllocator {
    fn default() -> Self {
        Self::new(HostSource::new())
    }
}

impl HostCachingAllocator {
    /// An allocator over a pinned-host source (any [`MemorySource`] works).
    pub fn new(source: impl MemorySource + 'static) -> Self {
        Self {
            inner: Arc::new(HostAllocatorShared {
                source: Box::new(source),
                state: Mutex::new(State { free: HashMap::new(), stats: HostStats::default() }),
                frees: FreeList::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        let mut s = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
        for n in self.inner.frees.take_all() {
            let seg = n.value;
            s.stats.allocated_bytes -= seg.len() as u64;
            s.stats.num_frees += 1;
            s.free.entry(seg.len()).or_default().push(seg);
        }
        s
    }

    /// At least `size` bytes of pinned host memory (rounded up to a power of two).
    pub fn allocate(&self, size: usize) -> Result<HostAllocation> {
        if size == 0 {
            return Err(Error::ZeroLength);
        }
        let rounded = size.max(MIN_SIZE).checked_next_power_of_two().ok_or(Error::TooLarge {
            requested: size as u64,
            limit: 1 << (usize::BITS - 1),
            what: "address space",
            source_name: "host caching allocator".into(),
        })?;
        let mut s = self.lock();
        let seg = match s.free.get_mut(&rounded).and_then(Vec::pop) {
            Some(seg) => seg,
            None => {
                drop(s);
                let seg = Arc::new(self.inner.source.create_segment(rounded)?);
                s = self.lock();
                s.stats.reserved_bytes += seg.len() as u64;
                s.stats.num_source_allocs += 1;
                seg
            }
        };
        s.stats.allocated_bytes += seg.len() as u64;
        s.stats.peak_allocated_bytes = s.stats.peak_allocated_bytes.max(s.stats.allocated_bytes);
        s.stats.num_allocs += 1;
        drop(s);
        Ok(HostAllocation { inner: Arc::clone(&self.inner), seg: Some(seg), size, uses: Vec::new() })
    }

    /// Returns every cached block to the source.
    pub fn empty_cache(&self) {
        let mut s = self.lock();
        let freed: Vec<Arc<Segment>> = s.free.drain().flat_map(|(_, v)| v).collect();
        for seg in &freed {
            s.stats.reserved_bytes -= seg.len() as u64;
            s.stats.num_source_frees += 1;
        }
        drop(s);
        drop(freed);
    }

    /// Statistics, with every free so far accounted for.
    pub fn stats(&self) -> HostStats {
        self.lock().stats
    }
}

/// Pinned host memory from a [`HostCachingAllocator`]; freed (lock-free) on drop, reusable
/// once the queues it was used on have passed that point.
pub struct HostAllocation {
    inner: Arc<HostAllocatorShared>,
    seg: Option<Arc<Segment>>,
    size: usize,
    uses: Vec<QueueHandle>,
}

impl std::fmt::Debug for HostAllocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostAllocation").field("size", &self.size).finish()
    }
}

impl HostAllocation {
    /// The size asked for.
    pub fn len(&self) -> usize {
        self.size
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        false
    }

    fn seg(&self) -> &Arc<Segment> {
        self.seg.as_ref().expect("present until drop")
    }

    /// The memory as a queue range.
    pub fn mem(&self) -> Mem {
        Mem::from(self.seg()).range(0, self.size).expect("the block holds the request")
    }

    /// CPU access to the block: a [`CpuView`] of exactly the bytes asked for (not the
    /// power-of-two rounding), inside the dma-buf sync bracket if the memory is a dma-buf.
    pub fn cpu_access(&self, access: Access) -> Result<CpuView<'_>> {
        CpuView::new(self.seg(), 0, self.size, access)
    }

    /// The CPU address of the block, for code that follows the crate's shared-memory access
    /// rule ([`crate::mapping`]); null if the memory has no CPU mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.seg().mapping().map_or(std::ptr::null_mut(), crate::mapping::Mapping::as_ptr)
    }

    /// A new fd for the block's buffer (`dup`), to share it; the block starts at offset 0.
    pub fn try_clone_fd(&self) -> Result<OwnedFd> {
        self.seg().try_clone_fd()
    }

    /// The whole segment the block owns (a pinned dma-buf or an mlocked memfd), rounded up to
    /// a power of two: no other block shares it, but it is larger than the request. Prefer
    /// [`HostAllocation::cpu_access`], which is bounded to the request.
    pub fn segment(&self) -> &Arc<Segment> {
        self.seg()
    }

    /// Records that `queue` uses this memory (see [`super::Allocation::record_queue`]).
    #[doc(alias = "record_stream")]
    pub fn record_queue(&mut self, queue: &Queue) {
        if !self.uses.iter().any(|h| h.id() == queue.id()) {
            self.uses.push(queue.handle());
        }
    }
}

impl AsFd for HostAllocation {
    /// The fd of the block's buffer (the block starts at offset 0).
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.seg().as_fd()
    }
}

impl Drop for HostAllocation {
    fn drop(&mut self) {
        let Some(seg) = self.seg.take() else { return };
        if self.uses.is_empty() {
            self.inner.frees.push(Node::new(seg));
            return;
        }
        let inner = Arc::clone(&self.inner);
        crate::queue::after_queues(self.uses.drain(..), move || inner.frees.push(Node::new(seg)));
    }
}
