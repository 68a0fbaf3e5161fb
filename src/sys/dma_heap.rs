//! `linux/dma-heap.h`: `DMA_HEAP_IOCTL_ALLOC`, through the `dma-heap` crate.

use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;

pub use dma_heap::Heap;

/// Opens the heap node at `path` (`/dev/dma_heap/<name>`).
pub fn open(path: &Path) -> io::Result<Heap> {
    Heap::new(dma_heap::HeapKind::Custom(path.to_path_buf()))
}

/// `DMA_HEAP_IOCTL_ALLOC`: a new read-write, close-on-exec dma-buf of `len` bytes.
pub fn alloc(heap: &Heap, len: usize) -> io::Result<OwnedFd> {
    heap.allocate(len)
}
