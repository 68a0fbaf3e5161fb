//! [`SyncedMemory`]: one buffer seen from the host and from the device, kept coherent lazily
//! (seed 004, Caffe's `SyncedMemory`).
//!
//! A `SyncedMemory` of `size` bytes allocates nothing until it is first used. The first access
//! allocates and zero-fills the side it asks for; later accesses move the data to where it is
//! read, and the *head* ([`Head`]) records where the newest data is:
//!
//! | head | newest data | reading the host (`host_data`) | reading the device (`device_data`) |
//! |---|---|---|---|
//! | [`Head::Uninitialized`] | nowhere yet | allocate, zero, → `AtHost` | allocate, zero, → `AtDevice` |
//! | [`Head::AtHost`] | host | — | copy host → device, → `Synced` |
//! | [`Head::AtDevice`] | device | copy device → host, → `Synced` | — |
//! | [`Head::Synced`] | both agree | — | — |
//!
//! The `mutable_*` accessors do the same and then move the head to their side (`AtHost` or
//! `AtDevice`), because the caller is about to write there: the next access from the other
//! side copies again. [`SyncedMemory::set_host_data`] and [`SyncedMemory::set_device_data`]
//! lend memory that stays the caller's (see *Borrowed memory*), and
//! [`SyncedMemory::async_device_push`] queues the host → device copy on a [`Queue`].
//!
//! # Aliasing: no copies where the device memory is CPU-mappable
//!
//! Device memory here is a dma-buf or memfd segment, and every segment is mapped into this
//! process. So by default ([`SyncedBuilder::alias`] `true`) a `SyncedMemory` keeps **one**
//! buffer, a block of the [`CachingAllocator`], and both views are that buffer: the host view
//! is a CPU access to the device pages, bracketed by `DMA_BUF_IOCTL_SYNC` when the segment is
//! a dma-buf (the block's [`crate::view::CpuView`]), and the device view is a [`Mem`] range
//! of the same pages. The head still follows Caffe's rules (it says which side wrote last),
//! but no transition copies anything: [`SyncedMemory::copies`] stays 0.
//!
//! With `alias(false)`, or automatically when a device block turns out to have no CPU mapping,
//! the host side is a separate pinned buffer from the [`HostCachingAllocator`] and each
//! transition that Caffe answers with a `memcpy` makes exactly one copy: on the builder's
//! [`SyncedBuilder::queue`] (submitted, then waited for, so it is ordered after the work
//! already on that queue), or with [`crate::queue::copy_now`] when there is no queue.
//!
//! # Data access
//!
//! No `&[u8]` is ever handed out over memory a device shares (see [`crate::mapping`]). The host
//! view is a [`HostView`] (read) or [`HostViewMut`] (read, write, fill): bounds-checked copies
//! through a CPU access guard held for the view's life. A view borrows the `SyncedMemory`
//! mutably, so no transition can happen while one is alive, which is Caffe's rule that a
//! `cpu_data()` pointer is only good until the next call, enforced by the compiler. The device
//! view is a [`Mem`], the range queue operations take. It is a counted reference: it keeps the
//! pages mapped, not the block allocated, so work queued on it must be done before the
//! `SyncedMemory` is dropped, unless it was told about that queue
//! ([`SyncedMemory::record_queue`], [`SyncedMemory::device_data_on`]), exactly like a block of
//! the caching allocator.
//!
//! Work that device code queues on a device view is ordered before the next transition only if
//! it is on the `SyncedMemory`'s own queue (transitions are submitted there); on any other queue
//! the caller synchronizes first, as with CUDA streams in Caffe.
//!
//! # Borrowed memory
//!
//! `set_host_data` / `set_device_data` take a [`Mem`] of exactly `size` bytes (a
//! [`HostAllocation::mem`](crate::caching::HostAllocation::mem), an [`Allocation::mem`](crate::caching::Allocation::mem), another `SyncedMemory`'s device view, or
//! from C a [`Mem::from_raw`] range) and clear `owns_host_data` / `owns_device_data`. The
//! `SyncedMemory` keeps only the counted reference: it never frees the block behind it, which
//! stays allocated until its owner drops it, and it writes into it when a transition moves data
//! there (as Caffe's `to_cpu` writes into a `set_cpu_data` pointer). Memory the `SyncedMemory`
//! owned before is freed at once (Caffe's `if (own_cpu_data_) CaffeFreeHost(..)`).
//!
//! In aliasing mode there is a single buffer, so a borrowed range replaces it and serves as
//! both views: after `set_host_data(m)`, `device_data()` is `m` too (zero copies). Caffe would
//! instead keep its old device buffer and copy into it on the next `gpu_data()`; the bytes each
//! view shows at each step are the same.
//!
//! # The asynchronous push
//!
//! [`SyncedMemory::async_device_push`] (head `AtHost` only, as in Caffe) queues the host →
//! device copy on the given queue and moves the head to `Synced` at once. Work submitted to that
//! queue afterwards sees the pushed bytes (queue order). Every other accessor first waits for
//! the push to complete, and reports its failure (then the head falls back to `AtHost`, the
//! host still holding the data), except [`SyncedMemory::device_data_on`], which makes its queue
//! wait for the push instead of blocking. Both buffers are recorded as used on the push's queue,
//! so dropping the `SyncedMemory` with the push in flight is safe: the blocks return to their
//! pools only once the queue has passed the copy.
//!
//! # Caffe's names
//!
//! | Caffe (`syncedmem.hpp`) | dmabuf-rt |
//! |---|---|
//! | `SyncedMemory(size)` | [`SyncedMemory::new`]`(size, &device, &host)`, [`SyncedMemory::builder`] |
//! | `SyncedHead` | [`Head`] |
//! | `UNINITIALIZED` | [`Head::Uninitialized`] |
//! | `HEAD_AT_CPU` | [`Head::AtHost`] |
//! | `HEAD_AT_GPU` | [`Head::AtDevice`] |
//! | `SYNCED` | [`Head::Synced`] |
//! | `cpu_data()` | [`SyncedMemory::host_data`] → [`HostView`] ([`SyncedMemory::host_ptr`] for C) |
//! | `mutable_cpu_data()` | [`SyncedMemory::mutable_host_data`] → [`HostViewMut`] ([`SyncedMemory::mutable_host_ptr`]) |
//! | `gpu_data()` | [`SyncedMemory::device_data`] → [`Mem`] ([`SyncedMemory::device_data_on`], [`SyncedMemory::device_ptr`]) |
//! | `mutable_gpu_data()` | [`SyncedMemory::mutable_device_data`] ([`SyncedMemory::mutable_device_data_on`], [`SyncedMemory::mutable_device_ptr`]) |
//! | `set_cpu_data(void*)` | [`SyncedMemory::set_host_data`]`(Mem)` |
//! | `set_gpu_data(void*)` | [`SyncedMemory::set_device_data`]`(Mem)` |
//! | `async_gpu_push(stream)` | [`SyncedMemory::async_device_push`]`(&Queue)` |
//! | `head()`, `size()` | [`SyncedMemory::head`], [`SyncedMemory::size`] |
//! | `own_cpu_data_`, `own_gpu_data_` | [`SyncedMemory::owns_host_data`], [`SyncedMemory::owns_device_data`] |
//! | `to_cpu()`, `to_gpu()` | private `sync_host`, `sync_device` |
//! | `CaffeMallocHost` (`cudaMallocHost`), `CaffeFreeHost` | [`HostCachingAllocator::allocate`], dropping the [`HostAllocation`](crate::caching::HostAllocation) |
//! | `cudaMalloc`, `cudaFree` | [`CachingAllocator::allocate`], dropping the [`Allocation`](crate::caching::Allocation) |
//! | `caffe_memset`, `caffe_gpu_memset` (first access) | zero fill on first access (a queue fill for a separate device buffer when there is a queue) |
//! | `caffe_gpu_memcpy` (`cudaMemcpy`) | a copy on the builder's queue, waited for (or [`crate::queue::copy_now`]); counted by [`SyncedMemory::copies`] |
//! | `cudaMemcpyAsync(.., stream)` in `async_gpu_push` | [`Queue::copy`] then [`Queue::record`] |
//! | `check_device()`, `device_` | none: the allocators and queues given to the builder are the device |
//! | `cpu_malloc_use_cuda_` | none: host memory always comes from the pinned allocator (or is the device block, aliased) |
//! | `DISABLE_COPY_AND_ASSIGN` | `SyncedMemory` is not `Clone` |
//!
//! Where this differs from Caffe, on purpose: size 0 is refused ([`Error::ZeroLength`]); a
//! borrowed range must be exactly `size` bytes ([`Error::SizeMismatch`]); a push from
//! `Uninitialized` or `AtDevice`, which Caffe `CHECK`s (aborts), is an [`Error::Unsupported`],
//! and a push when already `Synced` copies nothing (its queue waits for a push in flight); accessors wait for a push in flight instead
//! of assuming the caller synchronized the stream.

mod host_view;
mod store;

use std::sync::Arc;

use crate::caching::{CachingAllocator, HostCachingAllocator};
use crate::error::{Error, Result};
use crate::queue::{Event, Mem, Queue, copy_now};
use crate::segment::Access;
use crate::sys::dma_buf;
pub use host_view::{HostView, HostViewMut};
use store::{Buf, Store};

/// Where the newest data of a [`SyncedMemory`] is (Caffe's `SyncedHead`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Head {
    /// Nothing allocated or written yet (`UNINITIALIZED`).
    Uninitialized,
    /// The host view holds the newest data (`HEAD_AT_CPU`).
    AtHost,
    /// The device view holds the newest data (`HEAD_AT_GPU`).
    AtDevice,
    /// Both views hold the same data (`SYNCED`).
    Synced,
}

impl Head {
    /// Caffe's name for this state (`UNINITIALIZED`, `HEAD_AT_CPU`, `HEAD_AT_GPU`, `SYNCED`).
    pub fn caffe_name(self) -> &'static str {
        match self {
            Head::Uninitialized => "UNINITIALIZED",
            Head::AtHost => "HEAD_AT_CPU",
            Head::AtDevice => "HEAD_AT_GPU",
            Head::Synced => "SYNCED",
        }
    }
}

/// Settings for a [`SyncedMemory`]; see [`SyncedMemory::builder`].
#[derive(Debug)]
pub struct SyncedBuilder {
    size: usize,
    device: CachingAllocator,
    host: HostCachingAllocator,
    alias: bool,
    queue: Option<Arc<Queue>>,
}

impl SyncedBuilder {
    /// Whether host and device views may be one buffer where the device memory is
    /// CPU-mappable (default `true`: no copies at all). `false` keeps a separate pinned host
    /// buffer and copies on every transition, as Caffe does with a discrete GPU.
    pub fn alias(mut self, alias: bool) -> Self {
        self.alias = alias;
        self
    }

    /// The queue transitions copy and zero-fill on (Caffe's default stream): device blocks are
    /// bound to it, and each copy is submitted there and waited for, after the work already on
    /// it. Without one, copies run on the calling thread ([`crate::queue::copy_now`]).
    pub fn queue(mut self, queue: Arc<Queue>) -> Self {
        self.queue = Some(queue);
        self
    }

    /// The `SyncedMemory`; nothing is allocated yet. A size of 0 is refused.
    pub fn build(self) -> Result<SyncedMemory> {
        if self.size == 0 {
            return Err(Error::ZeroLength);
        }
        Ok(SyncedMemory {
            size: self.size,
            head: Head::Uninitialized,
            store: if self.alias { Store::Aliased(None) } else { Store::Split { host: None, device: None } },
            device_alloc: self.device,
            host_alloc: self.host,
            queue: self.queue,
            pending: None,
            window: None,
            copies: 0,
        })
    }
}

/// An open CPU access window of a C-style accessor: the `DMA_BUF_IOCTL_SYNC` start was issued on
/// `mem`'s dma-buf (if it is one) with `flags`, and the end is due.
#[derive(Debug)]
struct Window {
    mem: Mem,
    flags: u64,
}

/// Host and device views of `size` bytes, kept coherent lazily; see the [module
/// documentation](self).
#[derive(Debug)]
pub struct SyncedMemory {
    size: usize,
    head: Head,
    store: Store,
    device_alloc: CachingAllocator,
    host_alloc: HostCachingAllocator,
    queue: Option<Arc<Queue>>,
    /// The completion of an asynchronous push still in flight (the head is then `Synced`, or
    /// `AtDevice` after `mutable_device_data_on`).
    pending: Option<Event>,
    window: Option<Window>,
    copies: u64,
}

const _: () = {
    const fn sendable<T: Send>() {}
    sendable::<SyncedMemory>();
};

impl SyncedMemory {
    /// `size` bytes over `device` (device blocks) and `host` (pinned host blocks, used only when
    /// the views are not aliased), with default settings: aliased, no queue.
    pub fn new(size: usize, device: &CachingAllocator, host: &HostCachingAllocator) -> Result<Self> {
        Self::builder(size, device, host).build()
    }

    /// Settings for a `SyncedMemory` of `size` bytes over these allocators.
    pub fn builder(size: usize, device: &CachingAllocator, host: &HostCachingAllocator) -> SyncedBuilder {
        SyncedBuilder { size, device: device.clone(), host: host.clone(), alias: true, queue: None }
    }

    /// The size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Where the newest data is.
    pub fn head(&self) -> Head {
        self.head
    }

    /// Host ↔ device copies made so far (transitions and pushes; zero-fills are not copies).
    /// Always 0 while the views are aliased.
    pub fn copies(&self) -> u64 {
        self.copies
    }

    /// Whether the two views are one buffer (so transitions copy nothing).
    pub fn is_aliased(&self) -> bool {
        matches!(self.store, Store::Aliased(_))
    }

    /// Whether the host view is memory this `SyncedMemory` allocated and will free (Caffe's
    /// `own_cpu_data_`): false before the first allocation and after `set_host_data`.
    pub fn owns_host_data(&self) -> bool {
        self.store.host().is_some_and(Buf::is_owned)
    }

    /// Whether the device view is memory this `SyncedMemory` allocated and will free (Caffe's
    /// `own_gpu_data_`).
    pub fn owns_device_data(&self) -> bool {
        self.store.device().is_some_and(Buf::is_owned)
    }

    /// The memory lent to it (`set_host_data`, `set_device_data`) that it still uses, as
    /// `(address, length)` (ranges the CPU cannot address are left out).
    pub fn borrowed_ranges(&self) -> Vec<(usize, usize)> {
        self.store.bufs().filter(|b| !b.is_owned()).filter_map(Buf::range).collect()
    }

    /// The memory of its own (its blocks), as `(address, length)` (blocks the CPU cannot
    /// address are left out).
    pub fn owned_ranges(&self) -> Vec<(usize, usize)> {
        self.store.bufs().filter(|b| b.is_owned()).filter_map(Buf::range).collect()
    }

    /// The memory of its own that [`SyncedMemory::set_host_data`] (`host`) or
    /// [`SyncedMemory::set_device_data`] frees, as [`SyncedMemory::owned_ranges`]: the one
    /// buffer when aliased, else the view's (`set_device_data` of memory the CPU cannot reach
    /// frees the one buffer of aliased views too).
    pub fn owned_ranges_replaced(&self, host: bool) -> Vec<(usize, usize)> {
        let buf = match &self.store {
            Store::Aliased(b) => b.as_ref(),
            Store::Split { host: b, .. } if host => b.as_ref(),
            Store::Split { device: b, .. } => b.as_ref(),
        };
        buf.filter(|b| b.is_owned()).and_then(Buf::range).into_iter().collect()
    }

    /// Whether an asynchronous push is still in flight (its completion not yet observed).
    pub fn push_in_flight(&self) -> bool {
        self.pending.as_ref().is_some_and(|e| !e.is_complete())
    }

    /// The completion of the asynchronous push in flight, if one is: every call but the
    /// queries waits for it, which a caller that shares the `SyncedMemory` behind a lock may do
    /// first, unlocked.
    pub fn push_event(&self) -> Option<Event> {
        self.pending.as_ref().filter(|e| !e.is_complete()).cloned()
    }

    /// The host view for reading (Caffe's `cpu_data()`): allocates and zero-fills on first use,
    /// copies from the device if it holds the newest data (head → `Synced`).
    pub fn host_data(&mut self) -> Result<HostView<'_>> {
        self.begin()?;
        self.sync_host()?;
        Ok(HostView { inner: self.store.host_buf()?.cpu(Access::Read)? })
    }

    /// The host view for reading and writing (Caffe's `mutable_cpu_data()`): as
    /// [`SyncedMemory::host_data`], then head → `AtHost`.
    pub fn mutable_host_data(&mut self) -> Result<HostViewMut<'_>> {
        self.begin()?;
        self.sync_host()?;
        let inner = self.store.host_buf()?.cpu(Access::ReadWrite)?;
        self.head = Head::AtHost;
        Ok(HostViewMut { view: HostView { inner } })
    }

    /// The device view for reading (Caffe's `gpu_data()`): allocates and zero-fills on first
    /// use, copies from the host if it holds the newest data (head → `Synced`). Waits for a
    /// push in flight.
    pub fn device_data(&mut self) -> Result<Mem> {
        self.device_access(None, false)
    }

    /// The device view for reading and writing (Caffe's `mutable_gpu_data()`): as
    /// [`SyncedMemory::device_data`], then head → `AtDevice`. A read-only borrowed range is
    /// refused ([`Error::ReadOnly`]).
    pub fn mutable_device_data(&mut self) -> Result<Mem> {
        self.device_access(None, true)
    }

    /// [`SyncedMemory::device_data`] for work on `queue`: a push in flight is not waited for
    /// here; `queue` is made to wait for it ([`Queue::wait`]) instead. The device buffer is
    /// recorded as used on `queue` (freeing it waits for the work submitted there).
    pub fn device_data_on(&mut self, queue: &Queue) -> Result<Mem> {
        self.device_access(Some(queue), false)
    }

    /// [`SyncedMemory::mutable_device_data`] for work on `queue`, as
    /// [`SyncedMemory::device_data_on`].
    pub fn mutable_device_data_on(&mut self, queue: &Queue) -> Result<Mem> {
        self.device_access(Some(queue), true)
    }

    /// Lends `data` as the host memory (Caffe's `set_cpu_data`): head → `AtHost`,
    /// `owns_host_data` false. `data` must be exactly [`SyncedMemory::size`] bytes and
    /// CPU-addressable. Owned host memory is freed now; `data` never is (see the [module
    /// documentation](self#borrowed-memory)). When aliased, `data` becomes both views.
    pub fn set_host_data(&mut self, data: Mem) -> Result<()> {
        self.check_borrowed(&data)?;
        data.ptr()?;
        self.begin_replacing()?;
        match &mut self.store {
            Store::Aliased(b) | Store::Split { host: b, .. } => *b = Some(Buf::Borrowed(data)),
        }
        self.head = Head::AtHost;
        Ok(())
    }

    /// Lends `data` as the device memory (Caffe's `set_gpu_data`): head → `AtDevice`,
    /// `owns_device_data` false. `data` must be exactly [`SyncedMemory::size`] bytes. Owned
    /// device memory is freed now; `data` never is. When aliased, `data` becomes both views if
    /// the CPU can reach it (otherwise the views stop being aliased).
    pub fn set_device_data(&mut self, data: Mem) -> Result<()> {
        self.check_borrowed(&data)?;
        self.begin_replacing()?;
        if self.is_aliased() && data.ptr().is_err() {
            // The CPU cannot reach it, so it cannot also be the host view.
            self.store = Store::Split { host: None, device: None };
        }
        match &mut self.store {
            Store::Aliased(b) | Store::Split { device: b, .. } => *b = Some(Buf::Borrowed(data)),
        }
        self.head = Head::AtDevice;
        Ok(())
    }

    /// Queues the host → device copy on `queue` (Caffe's `async_gpu_push`) and moves the head
    /// to `Synced` without waiting: work submitted to `queue` afterwards sees the data. The
    /// head must be `AtHost` (nothing else is newer on the host); when it is already `Synced`
    /// nothing is copied, but a push still in flight (on another queue) is waited for by
    /// `queue` ([`Queue::wait`]), so that work submitted there afterwards sees its bytes too.
    /// Aliased views need no copy: the head just moves.
    pub fn async_device_push(&mut self, queue: &Queue) -> Result<()> {
        self.end_window()?;
        match self.head {
            Head::Synced => {
                if let Some(done) = &self.pending {
                    queue.wait(done)?;
                }
                return Ok(());
            }
            Head::AtHost => {}
            Head::Uninitialized => {
                return Err(Error::Unsupported {
                    what: "async_device_push: the SyncedMemory is uninitialized, there is no host data to push \
                           (Caffe requires HEAD_AT_CPU)"
                        .into(),
                });
            }
            Head::AtDevice => {
                return Err(Error::Unsupported {
                    what: "async_device_push: the device holds the newest data (head AtDevice); pushing the host \
                           copy would overwrite it (Caffe requires HEAD_AT_CPU)"
                        .into(),
                });
            }
        }
        if self.is_aliased() {
            self.head = Head::Synced;
            return Ok(());
        }
        self.ensure_device()?;
        let (dst, src) = (self.store.device_buf()?.mem(), self.store.host_buf()?.mem());
        queue.copy(dst, src)?;
        // If the record fails the queue has exited or died, so the copy cannot run after it.
        let done = queue.record()?;
        for b in self.store.bufs_mut() {
            b.record_queue(queue);
        }
        self.pending = Some(done);
        self.copies += 1;
        self.head = Head::Synced;
        Ok(())
    }

    /// Records that device work on `queue` uses this memory, so that the owned blocks, when
    /// freed, wait for the work submitted there so far (the caching allocator's
    /// `record_queue`). Borrowed memory is the lender's to protect.
    #[doc(alias = "record_stream")]
    pub fn record_queue(&mut self, queue: &Queue) {
        for b in self.store.bufs_mut() {
            b.record_queue(queue);
        }
    }

    /// C-style accessor: the host data's address for reading (Caffe's `cpu_data()`), for the C
    /// ABI. It transitions as [`SyncedMemory::host_data`] and opens a CPU access (a
    /// `DMA_BUF_IOCTL_SYNC` read start if the memory is a dma-buf) that stays open until the
    /// next call on this `SyncedMemory` or its drop, which end it. The pointer is valid until
    /// then, for `size` bytes, and must be used by [`crate::mapping`]'s access rule (the memory
    /// is shared with devices: byte-wise copies, no Rust references). Prefer
    /// [`SyncedMemory::host_data`] in Rust.
    pub fn host_ptr(&mut self) -> Result<*const u8> {
        self.begin()?;
        self.sync_host()?;
        Ok(self.open_window(dma_buf::SYNC_READ)?.cast_const())
    }

    /// C-style accessor for reading and writing (Caffe's `mutable_cpu_data()`): as
    /// [`SyncedMemory::host_ptr`] with a read-write CPU access, then head → `AtHost`.
    pub fn mutable_host_ptr(&mut self) -> Result<*mut u8> {
        self.begin()?;
        self.sync_host()?;
        if !self.store.host_buf()?.mem().writable() {
            return Err(Error::ReadOnly);
        }
        let p = self.open_window(dma_buf::SYNC_RW)?;
        self.head = Head::AtHost;
        Ok(p)
    }

    /// C-style accessor: the device data's address (Caffe's `gpu_data()`), as the C ABI names
    /// device memory (an address in the segment's mapping, which
    /// [`CachingAllocator::mem_at`] turns back into a [`Mem`]). It transitions as
    /// [`SyncedMemory::device_data`]. Valid until the next call that moves data or replaces
    /// memory, or the drop; the same access rule applies.
    pub fn device_ptr(&mut self) -> Result<*const u8> {
        Ok(self.device_data()?.ptr()?.cast_const())
    }

    /// C-style accessor (Caffe's `mutable_gpu_data()`): as [`SyncedMemory::device_ptr`], then
    /// head → `AtDevice`.
    pub fn mutable_device_ptr(&mut self) -> Result<*mut u8> {
        self.mutable_device_data()?.ptr()
    }

    // --- transitions -------------------------------------------------------------------------

    /// Every public call starts here: the C-style CPU window closes, a push in flight completes.
    fn begin(&mut self) -> Result<()> {
        self.end_window()?;
        self.settle()
    }

    /// As `begin`, for calls that replace memory: the push's outcome does not matter any more
    /// (its data is being replaced, or the host copy stays the truth), but the push must be
    /// done before a later copy writes the same device buffer: a wait that is refused
    /// ([`Error::WouldDeadlock`]) refuses the call.
    fn begin_replacing(&mut self) -> Result<()> {
        self.end_window()?;
        match self.settle() {
            Err(e @ Error::WouldDeadlock { .. }) => Err(e),
            _ => Ok(()),
        }
    }

    /// Waits for a push in flight. If it failed, the device copy is not to be trusted: the head
    /// falls back to `AtHost` (the host still holds the data) and the failure is returned. A
    /// wait that is refused ([`Error::WouldDeadlock`]: asked on a queue's own thread, ahead of
    /// the push on that queue) changes nothing: the push is still queued and will run, so it
    /// stays pending and the head stays where it is.
    fn settle(&mut self) -> Result<()> {
        let Some(done) = &self.pending else { return Ok(()) };
        let r = done.synchronize(None);
        if !matches!(r, Err(Error::WouldDeadlock { .. })) {
            self.pending = None;
            if r.is_err() {
                self.head = Head::AtHost;
            }
        }
        r
    }

    fn device_access(&mut self, queue: Option<&Queue>, mutable: bool) -> Result<Mem> {
        self.end_window()?;
        match (queue, &self.pending) {
            // The head is `Synced` (or `AtDevice`): nothing moves; the queue orders itself.
            (Some(q), Some(done)) => q.wait(done)?,
            _ => self.settle()?,
        }
        self.sync_device()?;
        let mem = self.store.device_buf()?.mem();
        if mutable && !mem.writable() {
            return Err(Error::ReadOnly);
        }
        if let Some(q) = queue {
            self.record_queue(q);
        }
        if mutable {
            self.head = Head::AtDevice;
        }
        Ok(mem)
    }

    /// Caffe's `to_cpu()`.
    fn sync_host(&mut self) -> Result<()> {
        match self.head {
            Head::Uninitialized => {
                self.ensure_host()?;
                self.zero_host()?;
                self.head = Head::AtHost;
            }
            Head::AtDevice => {
                self.ensure_host()?;
                if !self.is_aliased() {
                    let (dst, src) = (self.store.host_buf()?.mem(), self.store.device_buf()?.mem());
                    self.transfer(dst, src)?;
                }
                self.head = Head::Synced;
            }
            Head::AtHost | Head::Synced => {}
        }
        Ok(())
    }

    /// Caffe's `to_gpu()`.
    fn sync_device(&mut self) -> Result<()> {
        match self.head {
            Head::Uninitialized => {
                self.ensure_device()?;
                self.zero_device()?;
                self.head = Head::AtDevice;
            }
            Head::AtHost => {
                self.ensure_device()?;
                if !self.is_aliased() {
                    let (dst, src) = (self.store.device_buf()?.mem(), self.store.host_buf()?.mem());
                    self.transfer(dst, src)?;
                }
                self.head = Head::Synced;
            }
            Head::AtDevice | Head::Synced => {}
        }
        Ok(())
    }

    /// The one buffer of aliased views: a device block, if the CPU can reach it; otherwise the
    /// views become separate.
    fn allocate_aliased(&mut self) -> Result<()> {
        let block = self.device_alloc.allocate(self.size, self.queue.as_deref())?;
        self.store = if !block.as_ptr().is_null() {
            Store::Aliased(Some(Buf::Device(block)))
        } else {
            Store::Split { host: None, device: Some(Buf::Device(block)) }
        };
        Ok(())
    }

    fn ensure_host(&mut self) -> Result<()> {
        if matches!(self.store, Store::Aliased(None)) {
            self.allocate_aliased()?;
        }
        if let Store::Split { host: host @ None, .. } = &mut self.store {
            *host = Some(Buf::Host(self.host_alloc.allocate(self.size)?));
        }
        Ok(())
    }

    fn ensure_device(&mut self) -> Result<()> {
        if matches!(self.store, Store::Aliased(None)) {
            self.allocate_aliased()?;
        }
        if let Store::Split { device: device @ None, .. } = &mut self.store {
            *device = Some(Buf::Device(self.device_alloc.allocate(self.size, self.queue.as_deref())?));
        }
        Ok(())
    }

    /// `caffe_memset` of a fresh host buffer (or of the aliased one): blocks are reused from
    /// the allocators' caches, so they hold whatever their last user left.
    fn zero_host(&self) -> Result<()> {
        let cpu = self.store.host_buf()?.cpu(Access::Write)?;
        cpu.fill(0, self.size, 0)?;
        cpu.end()
    }

    /// `caffe_gpu_memset`: a fill on the queue for a separate device buffer, a CPU fill (within
    /// the dma-buf bracket) otherwise.
    fn zero_device(&self) -> Result<()> {
        let buf = self.store.device_buf()?;
        match (&self.queue, self.is_aliased()) {
            (Some(q), false) => {
                q.fill(buf.mem(), 0)?;
                q.synchronize()
            }
            _ => {
                let cpu = buf.cpu(Access::Write)?;
                cpu.fill(0, self.size, 0)?;
                cpu.end()
            }
        }
    }

    /// One host ↔ device copy (`caffe_gpu_memcpy`): on the queue, waited for, or on this thread.
    fn transfer(&mut self, dst: Mem, src: Mem) -> Result<()> {
        match &self.queue {
            Some(q) => {
                q.copy(dst, src)?;
                q.synchronize()?;
            }
            None => copy_now(dst, src)?,
        }
        self.copies += 1;
        Ok(())
    }

    fn check_borrowed(&self, data: &Mem) -> Result<()> {
        if data.len() != self.size {
            return Err(Error::SizeMismatch { dst: self.size, src: data.len() });
        }
        // Lending this object its own memory would free that memory now and keep using it:
        // another allocation could then be handed the same bytes.
        let bufs = match &self.store {
            Store::Aliased(b) => [b.as_ref(), None],
            Store::Split { host, device } => [host.as_ref(), device.as_ref()],
        };
        let own = bufs.into_iter().flatten().filter(|b| !matches!(b, Buf::Borrowed(_)));
        if own.into_iter().any(|b| b.mem().overlaps(data)) {
            return Err(Error::UnknownPointer {
                what: "lent memory",
                ptr: data.ptr().map_or(0, |p| p as usize),
                expected: "memory this SyncedMemory does not own",
                why: "it lies in the SyncedMemory's own buffer, which lending would free".into(),
            });
        }
        Ok(())
    }

    // --- the C-style CPU window --------------------------------------------------------------

    fn open_window(&mut self, flags: u64) -> Result<*mut u8> {
        let mem = self.store.host_buf()?.mem();
        let ptr = mem.ptr()?;
        if let Some(fd) = mem.dmabuf() {
            dma_buf::sync(fd, dma_buf::SYNC_START | flags).map_err(Error::io("DMA_BUF_IOCTL_SYNC start"))?;
        }
        self.window = Some(Window { mem, flags });
        Ok(ptr)
    }

    fn end_window(&mut self) -> Result<()> {
        let Some(w) = self.window.take() else { return Ok(()) };
        match w.mem.dmabuf() {
            Some(fd) => dma_buf::sync(fd, dma_buf::SYNC_END | w.flags).map_err(Error::io("DMA_BUF_IOCTL_SYNC end")),
            None => Ok(()),
        }
    }
}

impl Drop for SyncedMemory {
    fn drop(&mut self) {
        // Drop cannot report a failed end of access; nothing else needs doing here: owned
        // blocks free themselves (after the queues recorded on them), borrowed ones are not ours.
        let _ = self.end_window();
    }
}
