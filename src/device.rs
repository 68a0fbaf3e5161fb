//! [`Device`]: one memory domain for Rust users — a memory source, the caching allocator over
//! it, a pinned-host allocator, and the queues that work on its memory. Built with
//! [`Device::builder`]; no globals, no environment (the C ABI's process-wide runtime in
//! [`crate::ffi::runtime`] is a list of these, configured from `DMABUF_RT_*`).
//!
//! Where the flows enter (see `DESIGN.md`):
//! - **Allocate**: [`Device::allocate`] / [`Device::allocate_on`] enter the caching allocator
//!   ([`CachingAllocator::allocate`]): a pool hit, or the source makes a segment that is split.
//! - **Copy**: [`Device::new_queue`] gives a queue this device knows about; copies enter there
//!   ([`Queue::copy`]) and leave as completed events. [`Device::synchronize`] waits for every
//!   such queue, and for the copies queues of other devices queued into this device's memory.
//! - **Deferred free**: an [`Allocation`] used on another queue ([`Allocation::record_queue`])
//!   and dropped returns to the pool once that queue passes the drop (see [`crate::caching`]).
//!
//! ```no_run
//! use dmabuf_rt::Device;
//! use dmabuf_rt::source::ShmemSource;
//!
//! let dev = Device::builder(ShmemSource::new()).capacity(1 << 30).name("shmem").build()?;
//! let q = dev.new_queue()?;
//! let a = dev.allocate_on(4 << 20, &q)?;
//! let staging = dev.allocate_host(4 << 20)?;
//! q.copy(a.mem(), staging.mem())?;
//! dev.synchronize()?;
//! # Ok::<(), dmabuf_rt::Error>(())
//! ```

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::caching::{Allocation, CachingAllocator, Config, HostAllocation, HostCachingAllocator};
use crate::error::{Error, Result};
use crate::queue::{Event, Queue, QueueHandle};
use crate::source::{GemSource, HeapSource, MemorySource, ShmemSource};
use crate::synced::{SyncedBuilder, SyncedMemory};

/// Builds a [`Device`]: see [`Device::builder`].
pub struct DeviceBuilder {
    source: Box<dyn MemorySource>,
    name: String,
    config: Config,
    capacity: Option<u64>,
    host: Option<HostCachingAllocator>,
}

impl std::fmt::Debug for DeviceBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuilder").field("name", &self.name).field("capacity", &self.capacity).finish()
    }
}

impl DeviceBuilder {
    /// A label for logs, queue thread names and `Debug` (default: the source's name).
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.to_string();
        self
    }

    /// The caching allocator's settings (default: [`Config::default`], not the environment;
    /// pass [`Config::from_env`] to honour `DMABUF_RT_ALLOC_CONF`).
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// Caps the memory the device's allocator takes from its source (default: this machine's
    /// RAM).
    pub fn capacity(mut self, bytes: u64) -> Self {
        self.capacity = Some(bytes);
        self
    }

    /// The pinned-host allocator to use (default: a new one over pinned host memory). Devices
    /// given clones of one allocator share its cache, as the C runtime's devices do.
    pub fn host_allocator(mut self, host: HostCachingAllocator) -> Self {
        self.host = Some(host);
        self
    }

    /// The device. Fails if the allocator's settings are invalid.
    pub fn build(self) -> Result<Device> {
        let mut b = CachingAllocator::builder_boxed(self.source).config(self.config);
        if let Some(c) = self.capacity {
            b = b.capacity(c);
        }
        Ok(Device {
            name: self.name,
            alloc: b.build()?,
            host: self.host.unwrap_or_default(),
            queues: Mutex::new(DeviceQueues::default()),
        })
    }
}

/// A device spec, checked: what [`Device::from_spec`] opens.
enum Spec<'a> {
    Shmem,
    Heap(&'a str),
    Gem(Option<&'a str>),
}

/// Checks the syntax of a device spec (whether the device can be opened is another matter):
/// `shmem`, `heap:NAME` with a plain file name, `gem`, or `gem:/PATH`.
fn parse_spec(spec: &str) -> Result<Spec<'_>> {
    let (kind, arg) = spec.split_once(':').map_or((spec, None), |(k, a)| (k, Some(a)));
    match (kind, arg) {
        ("shmem", None) => Ok(Spec::Shmem),
        ("heap", Some(name)) if !name.is_empty() && !name.contains('/') && name != "." && name != ".." => {
            Ok(Spec::Heap(name))
        }
        ("gem", None) => Ok(Spec::Gem(None)),
        ("gem", Some(path)) if path.starts_with('/') => Ok(Spec::Gem(Some(path))),
        _ => Err(Error::Config {
            what: format!("`{spec}` is not a device (shmem, heap:NAME with a plain name, gem, or gem:/PATH)"),
        }),
    }
}

/// Checks a device spec's syntax without opening it ([`Device::from_spec`] opens it).
pub(crate) fn check_spec(spec: &str) -> Result<()> {
    parse_spec(spec).map(drop)
}

/// One memory domain: see the module documentation. Dropping it drops its allocators' caches;
/// live [`Allocation`]s keep their memory until they are dropped.
pub struct Device {
    name: String,
    alloc: CachingAllocator,
    host: HostCachingAllocator,
    queues: Mutex<DeviceQueues>,
}

/// The queues a device knows about.
#[derive(Default)]
struct DeviceQueues {
    /// Queues made with [`Device::new_queue`] (or registered by the C runtime), by handle so
    /// a dropped queue is not kept alive.
    live: Vec<QueueHandle>,
    /// The default queue, created on first use.
    default: Option<Arc<Queue>>,
    /// Events recorded after work that queues of other devices did on this device's memory
    /// (peer copies): synchronizing the device waits for them too.
    foreign: Vec<Event>,
}

impl DeviceQueues {
    /// Adds `queue` to the live ones, dropping those that are gone (their work is done).
    fn track(&mut self, queue: QueueHandle) {
        self.live.retain(|h| !h.is_gone());
        self.live.push(queue);
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("name", &self.name).field("capacity", &self.alloc.capacity()).finish()
    }
}

impl Device {
    /// A builder for a device over `source`.
    pub fn builder(source: impl MemorySource + 'static) -> DeviceBuilder {
        Self::builder_boxed(Box::new(source))
    }

    /// [`Device::builder`] for a boxed source.
    pub fn builder_boxed(source: Box<dyn MemorySource>) -> DeviceBuilder {
        let name = source.name();
        DeviceBuilder { source, name, config: Config::default(), capacity: None, host: None }
    }

    /// A builder for the device a spec names: `shmem` (sealed memfds, the embedded default),
    /// `heap:NAME` (`/dev/dma_heap/NAME`), `gem` (the first DRM card node this process may
    /// open) or `gem:/PATH` (that node). The spec becomes the device's name. Fails with
    /// [`Error::Config`] for a malformed spec, or with the source's error if it cannot be
    /// opened.
    pub fn from_spec(spec: &str) -> Result<DeviceBuilder> {
        let source: Box<dyn MemorySource> = match parse_spec(spec)? {
            // Plain sealed memfds: they grow in place (expandable segments), and any of them
            // can be exported as a dma-buf through udmabuf on demand.
            Spec::Shmem => Box::new(ShmemSource::new()),
            Spec::Heap(name) => Box::new(HeapSource::open(name)?),
            Spec::Gem(None) => Box::new(GemSource::open_first(None)?),
            Spec::Gem(Some(path)) => Box::new(GemSource::open(&PathBuf::from(path))?),
        };
        Ok(Self::builder_boxed(source).name(spec))
    }

    /// Its label.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its caching allocator.
    pub fn allocator(&self) -> &CachingAllocator {
        &self.alloc
    }

    /// Its pinned-host allocator (staging memory for copies to and from the device).
    pub fn host_allocator(&self) -> &HostCachingAllocator {
        &self.host
    }

    /// `size` bytes of device memory for host-side use or any queue (bound to no queue).
    pub fn allocate(&self, size: usize) -> Result<Allocation> {
        self.alloc.allocate(size, None)
    }

    /// `size` bytes of device memory bound to `queue`: after it is freed, only allocations
    /// on that queue reuse it before the queue has passed the free.
    pub fn allocate_on(&self, size: usize, queue: &Queue) -> Result<Allocation> {
        self.alloc.allocate(size, Some(queue))
    }

    /// At least `size` bytes of pinned host memory.
    pub fn allocate_host(&self, size: usize) -> Result<HostAllocation> {
        self.host.allocate(size)
    }

    /// A [`SyncedMemory`] of `size` bytes on this device (Caffe's host/device mirror): device
    /// blocks from its caching allocator, host blocks (when not aliased) from its pinned-host
    /// allocator. Give the builder [`Device::default_queue`] (or another queue) to copy on it.
    pub fn synced_memory(&self, size: usize) -> SyncedBuilder {
        SyncedMemory::builder(size, &self.alloc, &self.host)
    }

    fn queues(&self) -> MutexGuard<'_, DeviceQueues> {
        self.queues.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new queue (one io_uring and one executor thread, named after the device) that
    /// [`Device::synchronize`] waits for. The device does not keep it alive: drop it when done.
    pub fn new_queue(&self) -> Result<Arc<Queue>> {
        let q = Arc::new(Queue::builder().name(&self.name).build()?);
        self.track_queue(q.handle());
        Ok(q)
    }

    /// Makes [`Device::synchronize`] wait for `queue` too.
    pub(crate) fn track_queue(&self, queue: QueueHandle) {
        self.queues().track(queue);
    }

    /// Makes [`Device::synchronize`] wait for `event` too: work a queue of another device did
    /// on this device's memory.
    pub(crate) fn track_foreign(&self, event: Event) {
        let mut q = self.queues();
        q.foreign.retain(|e| !e.is_complete());
        q.foreign.push(event);
    }

    /// The device's default queue (created on first use and kept until
    /// [`Device::release_default_queue`]).
    pub fn default_queue(&self) -> Result<Arc<Queue>> {
        let mut q = self.queues();
        if let Some(d) = &q.default {
            return Ok(Arc::clone(d));
        }
        let d = Arc::new(Queue::builder().name(&self.name).build()?);
        q.default = Some(Arc::clone(&d));
        Ok(d)
    }

    /// Lets go of the default queue after its work (the executor thread exits when the last
    /// holder drops it). A later [`Device::default_queue`] makes a new one. The released queue
    /// stays one that [`Device::synchronize`] waits for, as a queue from
    /// [`Device::new_queue`] does, until it is gone. Called from a host callback of the
    /// default queue itself, it returns without waiting (the queue's work before the callback
    /// has run; its work after cannot run until the callback returns).
    pub fn release_default_queue(&self) -> Result<()> {
        let default = {
            let mut q = self.queues();
            let default = q.default.take();
            // Taken and waited for in two steps: a synchronize that snapshots the queues in
            // between (while work queued on the default queue before it was called has not
            // run) would otherwise see no default queue and return before that work.
            if let Some(d) = &default {
                q.track(d.handle());
            }
            default
        };
        match default {
            // Waiting for its own queue from its callback would wait for itself (WouldDeadlock),
            // after the queue was already released.
            Some(d) if crate::queue::executing_queue() != Some(d.id()) => d.synchronize(),
            _ => Ok(()),
        }
    }

    /// Waits for the work submitted to every queue of this device (its default queue and
    /// those from [`Device::new_queue`]), and for the copies that queues of other devices
    /// queued into its memory. Called from a host callback (on a queue's own thread), it
    /// waits for everything but that queue, whose work before the callback has run and whose
    /// work after it cannot run until the callback returns. Queues dropped meanwhile have
    /// finished their work and count as passed. Returns the first error met, after waiting
    /// for everything.
    pub fn synchronize(&self) -> Result<()> {
        let own = crate::queue::executing_queue();
        let (live, foreign): (Vec<QueueHandle>, Vec<Event>) = {
            let q = self.queues();
            let default = q.default.as_ref().map(|d| d.handle());
            (q.live.iter().cloned().chain(default).collect(), q.foreign.clone())
        };
        let mut first_err = None;
        for h in live.into_iter().filter(|h| Some(h.id()) != own) {
            match h.record_unless_passed() {
                Ok(Some(ev)) => {
                    if let Err(e) = ev.synchronize(None) {
                        first_err.get_or_insert(e);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        // Every synchronizer waits for every foreign event it saw (none takes them from
        // another); completed ones are dropped afterwards.
        for ev in foreign.iter().filter(|ev| own.is_none_or(|q| !ev.pending_on(q))) {
            if let Err(e) = ev.synchronize(None) {
                first_err.get_or_insert(e);
            }
        }
        if !foreign.is_empty() {
            self.queues().foreign.retain(|e| !e.is_complete());
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Returns the cached memory of both allocators to the system (after the queues that
    /// still use cached blocks have passed them).
    pub fn empty_cache(&self) {
        self.alloc.empty_cache();
        self.host.empty_cache();
    }
}
