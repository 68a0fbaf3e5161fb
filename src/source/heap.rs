//! DMA-BUF heaps: `/dev/dma_heap/<name>` (`system`, `system-uncached`, `linux,cma`, vendor heaps).

use std::path::{Path, PathBuf};

use super::{MemorySource, alloc_error, checked_len};
use crate::error::{Error, Result};
use crate::node::{list_dir, node_error};
use crate::segment::{Backing, FdKind, Origin, Segment, SegmentKind};
use crate::sys;

/// The directory DMA-BUF heaps appear in.
pub const HEAP_DIR: &str = "/dev/dma_heap";

/// One DMA-BUF heap. Each allocation is a new dma-buf from `DMA_HEAP_IOCTL_ALLOC`.
#[derive(Debug)]
pub struct HeapSource {
    name: String,
    path: PathBuf,
    heap: sys::dma_heap::Heap,
    kind: SegmentKind,
}

impl HeapSource {
    /// Opens the heap called `name` in `/dev/dma_heap`.
    pub fn open(name: &str) -> Result<Self> {
        Self::open_in(Path::new(HEAP_DIR), name)
    }

    /// Opens the heap called `name` in another directory (containers with /dev elsewhere, tests).
    pub fn open_in(dir: &Path, name: &str) -> Result<Self> {
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(Error::NoSuchHeap { name: name.into(), available: available(dir) });
        }
        let path = dir.join(name);
        match std::fs::symlink_metadata(&path) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if std::fs::symlink_metadata(dir).is_err() {
                    return Err(Error::NoDevice {
                        path: dir.to_path_buf(),
                        hint: "this kernel has no DMA-BUF heaps (CONFIG_DMABUF_HEAPS, CONFIG_DMABUF_HEAPS_SYSTEM)",
                    });
                }
                return Err(Error::NoSuchHeap { name: name.into(), available: available(dir) });
            }
            // E.g. EACCES on the directory: a permission problem, not a missing heap.
            Err(e) => return Err(node_error(&path, "a DMA-BUF heap driver", e)),
        }
        let heap = sys::dma_heap::open(&path).map_err(|e| node_error(&path, "a DMA-BUF heap driver", e))?;
        Ok(Self { name: name.into(), path, heap, kind: SegmentKind::Device })
    }

    /// Makes segments of another kind (the system heap also serves as pinned host memory).
    pub fn with_kind(mut self, kind: SegmentKind) -> Self {
        self.kind = kind;
        self
    }

    /// The heap's name.
    pub fn heap_name(&self) -> &str {
        &self.name
    }

    /// The heap's node.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn available(dir: &Path) -> String {
    let names: Vec<String> = list_dir(dir);
    if names.is_empty() { "none".into() } else { names.join(", ") }
}

impl MemorySource for HeapSource {
    fn name(&self) -> String {
        format!("dma-heap:{}", self.name)
    }

    fn kind(&self) -> SegmentKind {
        self.kind
    }

    fn create_segment(&self, len: usize) -> Result<Segment> {
        let len = checked_len(len, || self.name())?;
        let fd =
            sys::dma_heap::alloc(&self.heap, len).map_err(alloc_error(len, self.name(), "DMA_HEAP_IOCTL_ALLOC"))?;
        let origin = Origin::DmaHeap { heap: self.name.clone() };
        Segment::new(fd, len, FdKind::DmaBuf, self.kind, origin, Backing::None, true)
    }
}
