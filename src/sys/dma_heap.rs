//! `linux/dma-heap.h`: `DMA_HEAP_IOCTL_ALLOC`, through the `dma-heap` crate.

use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;

#[cfg(not(miri))]
pub use dma_heap::Heap;

/// Opens the heap node at `path` (`/dev/dma_heap/<name>`).
#[cfg(not(miri))]
pub fn open(path: &Path) -> io::Result<Heap> {
    Heap::new(dma_heap::HeapKind::Custom(path.to_path_buf()))
}

/// `DMA_HEAP_IOCTL_ALLOC`: a new read-write, close-on-exec dma-buf of `len` bytes.
#[cfg(not(miri))]
pub fn alloc(heap: &Heap, len: usize) -> io::Result<OwnedFd> {
    heap.allocate(len)
}

/// Under Miri there are no heaps (and no `dma-heap` crate, see Cargo.toml): opening one fails
/// as on a machine without `/dev/dma_heap`.
#[cfg(miri)]
#[derive(Debug)]
pub enum Heap {}

/// See [`Heap`] under Miri.
#[cfg(miri)]
pub fn open(_path: &Path) -> io::Result<Heap> {
    Err(io::Error::from(io::ErrorKind::NotFound))
}

/// See [`Heap`] under Miri: there is never a heap to allocate from.
#[cfg(miri)]
pub fn alloc(heap: &Heap, _len: usize) -> io::Result<OwnedFd> {
    match *heap {}
}
