//! The process-wide runtime behind the C ABI and the Paddle plugin: a list of
//! [`Device`]s configured from the environment, the current device of each
//! thread, and the live streams (a C "stream" is a [`Queue`]), events, host and unified blocks,
//! so that every handle and pointer a C caller passes is checked before it is used. Rust users
//! build their [`Device`]s themselves and need none of this.
//!
//! Devices: device 0 is the embedded default (shmem: sealed memfds, which udmabuf can export
//! as dma-bufs); each DMA-BUF heap and each DRM card node this process may
//! open is another device. `DMABUF_RT_DEVICES` replaces that list with a comma-separated one of
//! `shmem`, `heap:NAME` and `gem[:PATH]` (for example `shmem,shmem` gives two memory domains on
//! a machine without devices). `DMABUF_RT_CAPACITY` caps each device (bytes, or with a `K`,
//! `M` or `G` suffix; default: this machine's RAM). The allocators read `DMABUF_RT_ALLOC_CONF`.
//!
//! Handles given to C callers (streams, events, SyncedMemory objects) are numbers, not
//! addresses: a destroyed handle is never reissued, so using one after destroying it is an
//! error, not a use after free.

#![allow(unsafe_code)]

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::lent::LentRegistry;
use crate::caching::{Config, HostAllocation, HostCachingAllocator};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::ipc::{ImportedBlock, IpcHandle};
use crate::queue::{Event, HostBuffer, Mem, Queue, copy_now, fill_now};
use crate::segment::Segment;
use crate::source::{MemorySource, ShmemSource};
use crate::synced::{Head, SyncedMemory};

/// Replaces the discovered device list.
pub const DEVICES_ENV: &str = "DMABUF_RT_DEVICES";
/// Caps each device's memory.
pub const CAPACITY_ENV: &str = "DMABUF_RT_CAPACITY";

struct StreamEntry {
    device: usize,
    queue: Arc<Queue>,
}

/// A SyncedMemory handed to C: its device, the object, locked by each call on it (so the
/// registry's lock is not held while a transition copies), and what the queries report, as of
/// the last call that finished (so a query never waits for a call in progress, which may be
/// waiting for a stream whose callback is the one asking).
struct SyncedEntry {
    device: usize,
    mem: Arc<Mutex<SyncedMemory>>,
    facts: Arc<Mutex<SyncedFacts>>,
}

/// What the queries on a SyncedMemory report (`dmabuf_rt_synced_head` and the like).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncedFacts {
    /// Where the newest data is.
    pub head: Head,
    /// Bytes.
    pub size: usize,
    /// Host/device copies made.
    pub copies: u64,
    /// Whether the views are one buffer.
    pub aliased: bool,
    /// Whether the host and the device view are its own memory.
    pub owns: (bool, bool),
}

impl SyncedFacts {
    fn of(m: &SyncedMemory) -> Self {
        Self {
            head: m.head(),
            size: m.size(),
            copies: m.copies(),
            aliased: m.is_aliased(),
            owns: (m.owns_host_data(), m.owns_device_data()),
        }
    }
}

/// What a copy goes between.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyKind {
    /// Host memory to device memory.
    HostToDevice,
    /// Device memory to host memory.
    DeviceToHost,
    /// Within one device.
    DeviceToDevice,
    /// Between two devices.
    PeerToPeer,
}

/// The runtime: see the module documentation.
pub struct Runtime {
    devices: Vec<Device>,
    host: HostCachingAllocator,
    host_live: Mutex<BTreeMap<usize, HostAllocation>>,
    /// Blocks other processes shared that this process opened (`ipc_open`), by address, with
    /// the device they count as. Two handles of one block open at one address (the segment
    /// is mapped once per process): each open is one entry, each close takes one.
    imported: Mutex<BTreeMap<usize, (usize, Vec<ImportedBlock>)>>,
    unified: Mutex<HashMap<usize, Arc<Segment>>>,
    streams: Mutex<HashMap<usize, StreamEntry>>,
    events: Mutex<HashMap<usize, Event>>,
    synced: Mutex<HashMap<usize, SyncedEntry>>,
    /// Memory lent to SyncedMemories (`_set_host_data`, `_set_device_data`): frees of the
    /// blocks holding it are refused meanwhile.
    lent: LentRegistry,
    next_handle: AtomicUsize,
}

/// The refusal of a free of memory lent to a SyncedMemory.
fn lent_refusal(ptr: *mut u8) -> Error {
    Error::InvalidFree {
        ptr: ptr as usize,
        why: "it is lent to a SyncedMemory (dmabuf_rt_synced_set_host_data / _set_device_data) that may still use \
              it (a live one, or a destroyed one's push in flight): destroy that SyncedMemory or lend it other \
              memory first",
    }
}

/// The refusal of a SyncedMemory letting go of memory it owns (`how`: destroyed, replaced)
/// while that memory is lent to another.
fn lent_elsewhere(how: &str) -> Error {
    Error::InvalidArgument {
        what: format!(
            "the SyncedMemory's own memory is lent to another SyncedMemory (its pointer was passed to \
             dmabuf_rt_synced_set_host_data / _set_device_data), which would use it after it is freed: it cannot \
             be {how} until that one is destroyed or lent other memory"
        ),
    }
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").field("devices", &self.devices).finish()
    }
}

static RUNTIME: OnceLock<std::result::Result<Runtime, String>> = OnceLock::new();

/// The process the runtime started in ([`Runtime::get`]).
static STARTED_IN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

thread_local! {
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Parses `DMABUF_RT_CAPACITY`'s syntax: bytes, or a number with `K`, `M` or `G`.
pub fn parse_capacity(s: &str) -> Result<u64> {
    let s = s.trim();
    let bad = || Error::Config { what: format!("{CAPACITY_ENV}: `{s}` is not a size (bytes, or with K, M or G)") };
    let (num, shift) = match s.as_bytes().last() {
        Some(b'K' | b'k') => (&s[..s.len() - 1], 10),
        Some(b'M' | b'm') => (&s[..s.len() - 1], 20),
        Some(b'G' | b'g') => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    let n: u64 = num.trim().parse().map_err(|_| bad())?;
    let v = n.checked_mul(1u64 << shift).ok_or_else(bad)?;
    if v == 0 {
        return Err(bad());
    }
    Ok(v)
}

/// Parses `DMABUF_RT_DEVICES`'s syntax: a comma-separated list of `shmem`, `heap:NAME` and
/// `gem[:PATH]` (blanks around items are ignored). Checks the syntax only: whether each device
/// can be opened is found out when the runtime opens it.
pub fn parse_device_list(list: &str) -> Result<Vec<String>> {
    let specs: Vec<String> = list.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
    if specs.is_empty() {
        return Err(Error::Config { what: format!("{DEVICES_ENV} is set but names no device") });
    }
    for spec in &specs {
        crate::device::check_spec(spec).map_err(from_devices_env)?;
    }
    Ok(specs)
}

/// The base address of the live pinned host allocation holding `addr`, if any.
fn host_base(host: &BTreeMap<usize, HostAllocation>, addr: usize) -> Option<usize> {
    host.range(..=addr).next_back().filter(|&(&base, a)| addr - base < a.len()).map(|(&base, _)| base)
}

/// A spec error, said to come from `DMABUF_RT_DEVICES`.
fn from_devices_env(e: Error) -> Error {
    match e {
        Error::Config { what } => Error::Config { what: format!("{DEVICES_ENV}: {what}") },
        e => e,
    }
}

/// The device specs from `DMABUF_RT_DEVICES`, or shmem plus what discovery finds usable.
fn device_specs() -> Result<Vec<String>> {
    if let Ok(list) = std::env::var(DEVICES_ENV) {
        return parse_device_list(&list);
    }
    let inv = crate::discovery::discover();
    let mut specs = vec!["shmem".to_string()];
    for h in inv.heaps.iter().filter(|h| h.access.allowed()) {
        if let Some(name) = h.path.file_name() {
            specs.push(format!("heap:{}", name.to_string_lossy()));
        }
    }
    for d in &inv.drm {
        if d.kind == crate::discovery::DrmNodeKind::Card && d.node.access.allowed() {
            specs.push(format!("gem:{}", d.node.path.display()));
        }
    }
    Ok(specs)
}

impl Runtime {
    /// The runtime, built on first use from the environment. Its error, if the environment
    /// names devices that cannot be opened, is the same on every call.
    ///
    /// A process forked after the runtime started cannot use the copy it inherited (its
    /// threads did not cross the fork, and its memory is the parent's): every call there is
    /// refused, saying so, rather than waiting on threads that do not exist.
    pub fn get() -> Result<&'static Runtime> {
        let rt = RUNTIME
            .get_or_init(|| {
                STARTED_IN.store(std::process::id(), Ordering::Relaxed);
                Runtime::from_env().map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| Error::Config { what: format!("dmabuf-rt runtime: {e}") })?;
        let started_in = STARTED_IN.load(Ordering::Relaxed);
        if started_in != std::process::id() {
            return Err(Error::Unsupported {
                what: format!(
                    "the dmabuf-rt runtime started in process {started_in}, which forked this one ({}) \
                     afterwards: a forked process cannot use it (its threads stayed in the parent). Start worker \
                     processes with the spawn or forkserver method, or fork before the first use",
                    std::process::id()
                ),
            });
        }
        Ok(rt)
    }

    fn from_env() -> Result<Runtime> {
        let config = Config::from_env()?;
        let capacity = match std::env::var(CAPACITY_ENV) {
            Ok(s) => Some(parse_capacity(&s)?),
            Err(_) => None,
        };
        // One pinned-host allocator (one cache) serves every device.
        let host = HostCachingAllocator::default();
        let mut devices = Vec::new();
        for spec in device_specs()? {
            let mut b =
                Device::from_spec(&spec).map_err(from_devices_env)?.config(config.clone()).host_allocator(host.clone());
            if let Some(c) = capacity {
                b = b.capacity(c);
            }
            log::debug!(target: "dmabuf_rt::ffi", "device {}: {spec}", devices.len());
            devices.push(b.build()?);
        }
        Ok(Runtime {
            devices,
            host,
            host_live: Mutex::new(BTreeMap::new()),
            imported: Mutex::new(BTreeMap::new()),
            unified: Mutex::new(HashMap::new()),
            streams: Mutex::new(HashMap::new()),
            events: Mutex::new(HashMap::new()),
            synced: Mutex::new(HashMap::new()),
            lent: LentRegistry::default(),
            next_handle: AtomicUsize::new(1),
        })
    }

    /// The devices, by id.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// Device `id`, or an error naming the valid range.
    pub fn device(&self, id: usize) -> Result<&Device> {
        self.devices.get(id).ok_or(Error::NoSuchDevice { id: id as i64, count: self.devices.len() })
    }

    /// Makes `id` this thread's current device.
    pub fn set_current(&self, id: usize) -> Result<()> {
        self.device(id)?;
        CURRENT.with(|c| c.set(id));
        Ok(())
    }

    /// This thread's current device (0 until set).
    pub fn current(&self) -> usize {
        CURRENT.with(Cell::get)
    }

    fn new_handle(&self) -> usize {
        // Spaced and offset like pointers, so a handle never looks like a small integer.
        0x1000 + 0x10 * self.next_handle.fetch_add(1, Ordering::Relaxed)
    }

    // ---- memory ----

    /// `size` bytes of device memory on `device`.
    pub fn device_alloc(&self, device: usize, size: usize) -> Result<*mut u8> {
        self.device(device)?.allocator().allocate_raw(size, None)
    }

    /// `size` bytes of device memory that belong to `stream` (a stream of `device`), as
    /// PyTorch's caching allocator gives a block on the current stream: freed, it is taken
    /// again at once by allocations on that stream (its work queued before the free, which may
    /// still use the block, runs first in stream order) and by no other stream's.
    pub fn device_alloc_on(&self, device: usize, size: usize, stream: usize) -> Result<*mut u8> {
        let dev = self.device(device)?;
        let queue = self.stream_of(device, stream, "allocation")?;
        dev.allocator().allocate_raw(size, Some(&queue))
    }

    /// Frees device memory; `size`, when given, must be what was asked for.
    pub fn device_free(&self, device: usize, ptr: *mut u8, size: Option<usize>) -> Result<()> {
        let dev = self.device(device)?;
        // Held through the free, so that no lend of this block comes between the check and it.
        let lent = self.lent.read();
        let p = ptr as usize;
        if lent.any(|s, len| s >= p && dev.allocator().mem_at(ptr, s - p + len).is_ok()) {
            return Err(lent_refusal(ptr));
        }
        let r = match size {
            // Checked and freed under one hold of the allocator's lock.
            Some(size) => dev.allocator().free_raw_sized(ptr, size),
            None => dev.allocator().free_raw(ptr),
        };
        if r.is_err() && lock(&self.imported).contains_key(&(ptr as usize)) {
            return Err(Error::InvalidFree {
                ptr: ptr as usize,
                why: "memory opened from another process's IPC handle: close it with dmabuf_rt_ipc_close_mem_handle",
            });
        }
        r
    }

    /// `size` bytes of pinned host memory.
    pub fn host_alloc(&self, size: usize) -> Result<*mut u8> {
        let a = self.host.allocate(size)?;
        let ptr = a.as_ptr();
        if ptr.is_null() {
            return Err(Error::Unsupported { what: "pinned host memory without a CPU mapping".into() });
        }
        lock(&self.host_live).insert(ptr as usize, a);
        Ok(ptr)
    }

    /// Returns cached pinned host memory to the system.
    pub fn host_empty_cache(&self) {
        self.host.empty_cache();
    }

    /// Frees pinned host memory.
    pub fn host_free(&self, ptr: *mut u8) -> Result<()> {
        let lent = self.lent.read();
        let mut host = lock(&self.host_live);
        if let Some(a) = host.get(&(ptr as usize)) {
            if lent.any_starting_in(ptr as usize, a.mem().len()) {
                return Err(lent_refusal(ptr));
            }
        }
        match host.remove(&(ptr as usize)) {
            Some(a) => {
                drop(a);
                Ok(())
            }
            None => Err(Error::InvalidFree { ptr: ptr as usize, why: "not live pinned host memory from this runtime" }),
        }
    }

    /// A process-wide IPC handle for the device allocation that starts at `ptr`
    /// ([`crate::ipc::get_handle`]): the block is held until the process that opens the handle
    /// closes it (freed here meanwhile, it waits in limbo). With no `stream`, after the device's
    /// queued work; with one (a stream of `device`), without waiting: the work queued on it so
    /// far travels with the handle as a fence, which the opening process waits for
    /// ([`crate::ipc::get_handle_raw`] with a queue), and a stream that failed refuses.
    pub fn ipc_get_handle(&self, device: usize, ptr: *mut u8, stream: Option<usize>) -> Result<IpcHandle> {
        let dev = self.device(device)?;
        let Some(stream) = stream else {
            dev.synchronize()?;
            return crate::ipc::get_handle_raw(dev.allocator(), ptr, None);
        };
        let queue = self.stream_of(device, stream, "IPC handle")?;
        crate::ipc::get_handle_raw(dev.allocator(), ptr, Some(&queue))
    }

    /// Opens a handle another process made ([`crate::ipc::open_handle`]); the block counts as
    /// memory of `device` here (copies, memsets, `pointer_device`) until `ipc_close`.
    pub fn ipc_open(&self, device: usize, handle: &IpcHandle) -> Result<*mut u8> {
        self.device(device)?;
        let block = crate::ipc::open_handle(handle)?;
        // The producer's queued work on the block first (its fence; none from the C API's
        // own handles, which synchronize the device before they are made).
        block.wait_ready(None)?;
        let ptr = block.as_ptr();
        let mut imported = lock(&self.imported);
        let (d, blocks) = imported.entry(ptr as usize).or_insert_with(|| (device, Vec::new()));
        if *d != device {
            let d = *d;
            drop(imported);
            // Released again (dropped): the block is open here on the other device already.
            drop(block);
            return Err(Error::InvalidArgument {
                what: format!(
                    "IPC handle: the block is already open in this process at {:#x} as memory of device {d}; \
                     open it on device {d} (each open needs its own close)",
                    ptr as usize
                ),
            });
        }
        blocks.push(block);
        Ok(ptr)
    }

    /// Closes a block `ipc_open` opened on `device`: the exporting process may reuse it once
    /// every process closed it. Synchronizes the device first (its queues may use the block).
    /// Refused while memory in it is lent to a SyncedMemory that may still use it.
    pub fn ipc_close(&self, device: usize, ptr: *mut u8) -> Result<()> {
        let dev = self.device(device)?;
        let refused = |why: &str| Error::UnknownPointer {
            what: "IPC pointer",
            ptr: ptr as usize,
            expected: "a pointer ipc_open returned on this device and not closed",
            why: why.to_string(),
        };
        match lock(&self.imported).get(&(ptr as usize)) {
            Some(&(d, _)) if d == device => {}
            Some(&(d, _)) => return Err(refused(&format!("it was opened on device {d}"))),
            None => return Err(refused("")),
        }
        dev.synchronize()?;
        // Held until the block has left `imported`, so that no lend of it comes between the
        // check and the close (a lend looks the memory up with the registry held for writing).
        let lent = self.lent.read();
        let block = {
            let mut imported = lock(&self.imported);
            let Some((_, blocks)) = imported.get_mut(&(ptr as usize)) else { return Err(refused("closed meanwhile")) };
            // The last close ends the mapping and tells the exporter, which may then reuse the
            // memory: not while a SyncedMemory may still read or write it.
            if let [only] = blocks.as_slice()
                && lent.any_starting_in(ptr as usize, only.len())
            {
                return Err(lent_refusal(ptr));
            }
            let block = blocks.pop();
            if blocks.is_empty() {
                imported.remove(&(ptr as usize));
            }
            block
        };
        drop(lent);
        // Released outside the locks (it sends to the exporting process).
        drop(block);
        Ok(())
    }

    /// The opened IPC block holding `[ptr, ptr + len)` wholly, as a range, with its device.
    fn imported_mem(&self, ptr: *const u8, len: usize) -> Option<Result<(usize, Mem)>> {
        let imported = lock(&self.imported);
        let (&base, (device, blocks)) = imported.range(..=ptr as usize).next_back()?;
        let block = blocks.last()?;
        let off = ptr as usize - base;
        if off >= block.len() {
            return None;
        }
        Some(block.mem().range(off, len).map(|m| (*device, m)).map_err(|_| Error::UnknownPointer {
            what: "device pointer",
            ptr: ptr as usize,
            expected: "a range inside one block",
            why: format!("it starts in a {}-byte block opened from another process and runs past its end", block.len()),
        }))
    }

    /// The device whose allocator holds `ptr` (in a live or a cached block).
    pub fn pointer_device(&self, ptr: *const u8) -> Result<usize> {
        if let Some(Ok((device, _))) = self.imported_mem(ptr, 0) {
            return Ok(device);
        }
        self.devices.iter().position(|d| d.allocator().holds(ptr)).ok_or(Error::UnknownPointer {
            what: "device pointer",
            ptr: ptr as usize,
            expected: "inside a live allocation of some device",
            why: String::new(),
        })
    }

    /// Whether `ptr` lies in live pinned host memory from this runtime.
    pub fn host_holds(&self, ptr: *const u8) -> bool {
        host_base(&lock(&self.host_live), ptr as usize).is_some()
    }

    /// Records that `queue` uses the live pinned host allocation holding `ptr`, if any: when
    /// it is freed, its block waits for the queue's work submitted until then.
    fn host_record(&self, ptr: *const u8, queue: &Queue) {
        let mut host = lock(&self.host_live);
        if let Some(base) = host_base(&host, ptr as usize) {
            host.get_mut(&base).expect("found just now").record_queue(queue);
        }
    }

    /// Marks the device allocation holding `ptr` as used by `stream` (a stream of any device):
    /// when it is freed, its block is reused only after the stream has passed the point of
    /// the free.
    pub fn record_stream(&self, device: usize, ptr: *mut u8, stream: usize) -> Result<()> {
        let q = self.stream(stream)?;
        self.device(device)?.allocator().record_queue_raw(ptr, &q).map_err(|e| match e {
            // The allocator's refusal names a free; this call is no free.
            Error::InvalidFree { ptr, why } => Error::UnknownPointer {
                what: "the pointer to record a stream on",
                ptr,
                expected: "inside a live allocation of this device",
                why: why.to_string(),
            },
            e => e,
        })
    }

    /// Begins (`begin`) or ends CPU access to `len` bytes of device memory at `ptr`: for a
    /// dma-buf, `DMA_BUF_IOCTL_SYNC` start or end with the access's direction; for memory
    /// with no dma-buf, nothing but the range check. It does not wait for the device's
    /// streams: the caller orders the access after the work that touches the range.
    pub fn cpu_access(&self, device: usize, ptr: *const u8, len: usize, write: bool, begin: bool) -> Result<()> {
        let m = self.device_mem(device, ptr, len)?;
        if let Some(fd) = m.dmabuf() {
            let dir = if write { crate::sys::dma_buf::SYNC_RW } else { crate::sys::dma_buf::SYNC_READ };
            let (edge, what) = if begin {
                (crate::sys::dma_buf::SYNC_START, "DMA_BUF_IOCTL_SYNC start")
            } else {
                (crate::sys::dma_buf::SYNC_END, "DMA_BUF_IOCTL_SYNC end")
            };
            crate::sys::dma_buf::sync(fd, edge | dir).map_err(Error::io(what))?;
        }
        Ok(())
    }

    /// `size` bytes of unified memory: a shared mapping of a sealed memfd, the same bytes for
    /// the CPU and any importer of its fd.
    pub fn unified_alloc(&self, size: usize) -> Result<*mut u8> {
        let seg = Arc::new(ShmemSource::new().create_segment(size)?);
        let ptr = seg.mapping().map_or(std::ptr::null_mut(), |m| m.as_ptr());
        lock(&self.unified).insert(ptr as usize, seg);
        Ok(ptr)
    }

    /// `len` bytes at `ptr` as a counted range of the unified memory holding it (the segment
    /// stays mapped while the range lives, even if it is freed meanwhile), if `ptr` lies in
    /// some; an error if the range starts there but runs past its end.
    fn unified_mem(&self, ptr: *const u8, len: usize) -> Result<Option<Mem>> {
        let addr = ptr as usize;
        let unified = lock(&self.unified);
        let Some((&base, seg)) = unified.iter().find(|&(&base, seg)| addr >= base && addr - base < seg.len()) else {
            return Ok(None);
        };
        let m = Mem::from(seg).range(addr - base, len).map_err(|_| Error::UnknownPointer {
            what: "data",
            ptr: addr,
            expected: "a range inside one block (it starts in unified memory but runs past its end)",
            why: String::new(),
        })?;
        Ok(Some(m))
    }

    /// Frees unified memory. A stream's copy still queued into it keeps its pages mapped
    /// until the copy has run.
    pub fn unified_free(&self, ptr: *mut u8) -> Result<()> {
        match lock(&self.unified).remove(&(ptr as usize)) {
            Some(_) => Ok(()),
            None => Err(Error::InvalidFree { ptr: ptr as usize, why: "not live unified memory from this runtime" }),
        }
    }

    /// `len` bytes at `ptr` inside a device's memory (an allocation of its allocator, or a block
    /// opened on it from an IPC handle), as a range.
    pub(crate) fn device_mem(&self, device: usize, ptr: *const u8, len: usize) -> Result<Mem> {
        let found = self.device(device)?.allocator().mem_at(ptr, len);
        if found.is_err() {
            match self.imported_mem(ptr, len) {
                Some(Ok((d, m))) if d == device => return Ok(m),
                Some(Err(e)) => return Err(e),
                _ => {}
            }
        }
        found
    }

    /// Copies `len` bytes from `src` to `dst`. Device-side pointers may point anywhere inside
    /// one live allocation of their device's allocator (and the whole range must lie within the
    /// bytes it asked for).
    /// Without a stream the copy is synchronous: it first waits for every stream of the
    /// devices involved (as CUDA's legacy default stream does), then copies. With a stream it
    /// is queued there: host-to-device copies read the host side at once (into a staging
    /// buffer), so the caller may reuse it on return; device-to-host copies write the host
    /// side when the stream reaches them.
    ///
    /// # Safety
    /// The host side must be valid for `len` bytes: for reads until this returns, for writes
    /// until the stream (if any) has passed the copy.
    pub unsafe fn copy(
        &self,
        kind: CopyKind,
        (dst_dev, dst): (usize, *mut u8),
        (src_dev, src): (usize, *const u8),
        len: usize,
        stream: Option<usize>,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        if dst.is_null() || src.is_null() {
            return Err(Error::UnknownPointer {
                what: "copy pointer",
                ptr: 0,
                expected: "non-null",
                why: String::new(),
            });
        }
        let (queue, stream_dev) = match stream {
            Some(h) => (Some(self.stream(h)?), Some(self.stream_device(h)?)),
            None => (None, None),
        };
        let (d, s) = match kind {
            CopyKind::HostToDevice => {
                // SAFETY: the caller's contract covers the host side (read-only here).
                let host = unsafe { Mem::from_raw(src.cast_mut(), len, false)? };
                (self.device_mem(dst_dev, dst, len)?, host)
            }
            CopyKind::DeviceToHost => {
                // Unified memory is held by the copy (a counted range of its segment), so that
                // freeing it before the stream ran the copy does not unmap it under the stream.
                let host = match self.unified_mem(dst, len)? {
                    Some(m) => m,
                    // SAFETY: the caller's contract covers the host side.
                    None => unsafe { Mem::from_raw(dst, len, true)? },
                };
                (host, self.device_mem(src_dev, src, len)?)
            }
            CopyKind::DeviceToDevice | CopyKind::PeerToPeer => {
                (self.device_mem(dst_dev, dst, len)?, self.device_mem(src_dev, src, len)?)
            }
        };
        let Some(q) = queue else {
            self.device(dst_dev)?.synchronize()?;
            if src_dev != dst_dev {
                self.device(src_dev)?.synchronize()?;
            }
            return copy_now(d, s);
        };
        if kind == CopyKind::HostToDevice {
            // Read the host side now, so the caller may reuse it when this returns.
            let staged = HostBuffer::new(len)?;
            copy_now(&staged, s)?;
            q.copy(d, &staged)?;
        } else {
            q.copy(d, s)?;
            if kind == CopyKind::DeviceToHost {
                // Into pinned host memory: its block must not be reused (or unmapped) before the
                // stream has written it, even if the caller frees it at once.
                self.host_record(dst, &q);
            }
        }
        // A stream of another device touching this memory (a peer copy, or a copy queued on
        // a stream of another device): let the memory's devices wait for it too when they are
        // synchronized, as work on their own streams would be.
        let touched = match kind {
            CopyKind::DeviceToHost => [Some(src_dev), None],
            CopyKind::HostToDevice => [Some(dst_dev), None],
            // A device-to-device copy may also cross devices: both sides' devices wait for it.
            CopyKind::DeviceToDevice | CopyKind::PeerToPeer => [Some(dst_dev), (src_dev != dst_dev).then_some(src_dev)],
        };
        let mut marker: Option<Event> = None;
        for dev in touched.into_iter().flatten().filter(|&d| Some(d) != stream_dev) {
            // One record after the copy serves every device it touched.
            let ev = match &marker {
                Some(ev) => ev.clone(),
                None => marker.insert(q.record()?).clone(),
            };
            self.device(dev)?.track_foreign(ev);
        }
        Ok(())
    }

    /// Sets `len` bytes at device pointer `ptr` to `byte` (synchronously, after the device's
    /// streams).
    pub fn memset(&self, device: usize, ptr: *mut u8, byte: u8, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let m = self.device_mem(device, ptr, len)?;
        self.device(device)?.synchronize()?;
        fill_now(m, byte)
    }

    /// Total and free bytes of `device` (capacity, and capacity minus what its allocator
    /// holds).
    pub fn memory_stats(&self, device: usize) -> Result<(u64, u64)> {
        let a = self.device(device)?.allocator();
        let total = a.capacity();
        let reserved = a.stats().reserved_bytes[crate::caching::stats::AGGREGATE].current.max(0) as u64;
        Ok((total, total.saturating_sub(reserved)))
    }

    // ---- streams ----

    /// A new stream on `device`.
    pub fn create_stream(&self, device: usize) -> Result<usize> {
        let dev = self.device(device)?;
        let q = dev.new_queue()?;
        let h = self.new_handle();
        lock(&self.streams).insert(h, StreamEntry { device, queue: q });
        Ok(h)
    }

    fn stream(&self, h: usize) -> Result<Arc<Queue>> {
        lock(&self.streams)
            .get(&h)
            .map(|e| Arc::clone(&e.queue))
            .ok_or(Error::UnknownHandle { what: "stream", handle: h })
    }

    /// The queue behind stream `h`, which must be a stream of `device` (`what` names the call
    /// for the refusal).
    fn stream_of(&self, device: usize, h: usize, what: &str) -> Result<Arc<Queue>> {
        let streams = lock(&self.streams);
        let e = streams.get(&h).ok_or(Error::UnknownHandle { what: "stream", handle: h })?;
        if e.device != device {
            return Err(Error::InvalidArgument {
                what: format!(
                    "{what}: stream {h} belongs to device {}, not to device {device} of the memory",
                    e.device
                ),
            });
        }
        Ok(Arc::clone(&e.queue))
    }

    /// The stream's device.
    pub fn stream_device(&self, h: usize) -> Result<usize> {
        lock(&self.streams).get(&h).map(|e| e.device).ok_or(Error::UnknownHandle { what: "stream", handle: h })
    }

    /// Destroys a stream after its submitted work has run.
    pub fn destroy_stream(&self, h: usize) -> Result<()> {
        let e = lock(&self.streams).remove(&h).ok_or(Error::UnknownHandle { what: "stream", handle: h })?;
        // The device keeps the stream on its list until the queue is gone (its handle does
        // not keep it alive): a destroy from a callback returns before the stream drains, and
        // a device synchronize meanwhile must still wait for that work.
        if crate::queue::executing_queue().is_some() {
            // From a host callback: waiting for the stream could wait for this very callback
            // (or for a stream blocked on it). As CUDA's cudaStreamDestroy, return at once;
            // the stream finishes its work and goes on its own.
            drop(e);
            return Ok(());
        }
        let r = e.queue.synchronize();
        drop(e); // the queue's executor finishes and exits when the last holder lets go
        r
    }

    /// Whether the stream has finished everything submitted (an error if it failed).
    pub fn query_stream(&self, h: usize) -> Result<bool> {
        let q = self.stream(h)?;
        if let Some(e) = q.error() {
            return Err(e);
        }
        Ok(q.is_idle())
    }

    /// Waits for everything submitted to the stream.
    pub fn synchronize_stream(&self, h: usize) -> Result<()> {
        self.stream(h)?.synchronize()
    }

    /// Runs `f` on the stream's thread after the work submitted before it.
    pub fn stream_add_callback(&self, h: usize, f: impl FnOnce(Result<()>) + Send + 'static) -> Result<()> {
        self.stream(h)?.callback(f)
    }

    /// Makes the stream wait for the event's latest record.
    pub fn stream_wait_event(&self, stream: usize, event: usize) -> Result<()> {
        let ev = self.event(event)?;
        self.stream(stream)?.wait(&ev)
    }

    // ---- events ----

    /// A new event (complete until recorded).
    pub fn create_event(&self) -> usize {
        let h = self.new_handle();
        lock(&self.events).insert(h, Event::new());
        h
    }

    fn event(&self, h: usize) -> Result<Event> {
        lock(&self.events).get(&h).cloned().ok_or(Error::UnknownHandle { what: "event", handle: h })
    }

    /// Records the event at the stream's current end. Without a stream it is recorded on the
    /// device's synchronous stream, where every call has finished its work before returning,
    /// so the record completes at once.
    pub fn record_event(&self, device: usize, stream: Option<usize>, event: usize) -> Result<()> {
        let ev = self.event(event)?;
        match stream {
            Some(s) => self.stream(s)?.record_event(&ev),
            None => {
                self.device(device)?;
                ev.record_complete();
                Ok(())
            }
        }
    }

    /// Whether the event's latest record has completed (an error if it failed).
    pub fn query_event(&self, h: usize) -> Result<bool> {
        self.event(h)?.query()
    }

    /// Waits for the event's latest record.
    pub fn synchronize_event(&self, h: usize) -> Result<()> {
        self.event(h)?.synchronize(None)
    }

    /// Milliseconds from `start`'s completion to `end`'s (both recorded and complete).
    pub fn event_elapsed_ms(&self, start: usize, end: usize) -> Result<f32> {
        let (start, end) = (self.event(start)?, self.event(end)?);
        Ok(end.elapsed_since(&start)?.as_secs_f64() as f32 * 1000.0)
    }

    /// Destroys an event (a stream still waiting on it keeps its own reference).
    pub fn destroy_event(&self, h: usize) -> Result<()> {
        lock(&self.events).remove(&h).map(drop).ok_or(Error::UnknownHandle { what: "event", handle: h })
    }

    // ---- SyncedMemory ----

    /// The queue behind a live stream handle.
    pub(crate) fn stream_queue(&self, h: usize) -> Result<Arc<Queue>> {
        self.stream(h)
    }

    /// A new [`SyncedMemory`] of `size` bytes on `device`, nothing allocated yet: device blocks
    /// from the device's caching allocator, host blocks (when not aliased) from the pinned-host
    /// allocator, transitions copied and zero-filled on the device's default stream (and
    /// waited for). Returns its handle.
    pub fn create_synced(&self, device: usize, size: usize, alias: bool) -> Result<usize> {
        let dev = self.device(device)?;
        let mem = SyncedMemory::builder(size, dev.allocator(), &self.host)
            .alias(alias)
            .queue(dev.default_queue()?)
            .build()?;
        let h = self.new_handle();
        let facts = Arc::new(Mutex::new(SyncedFacts::of(&mem)));
        lock(&self.synced).insert(h, SyncedEntry { device, mem: Arc::new(Mutex::new(mem)), facts });
        Ok(h)
    }

    /// Runs `f` on the live SyncedMemory `h` (locked for the call), with its device. A push in
    /// flight is waited for first with the object unlocked, so that a stream callback ahead of
    /// the push may call on it meanwhile (and be refused, `WouldDeadlock`, if it asks for
    /// what waits for the push) rather than wait for the lock for ever. Refused
    /// (`UnknownHandle`) if `h` was destroyed while this call waited for the object: it would
    /// otherwise queue work no record of the destroy knows of.
    pub fn with_synced<T>(&self, h: usize, f: impl FnOnce(usize, &mut SyncedMemory) -> Result<T>) -> Result<T> {
        let gone = || Error::UnknownHandle { what: "SyncedMemory", handle: h };
        let (device, mem, facts) = lock(&self.synced)
            .get(&h)
            .map(|e| (e.device, Arc::clone(&e.mem), Arc::clone(&e.facts)))
            .ok_or_else(gone)?;
        let mut m = lock(&mem);
        while let Some(push) = m.push_event() {
            drop(m);
            let waited = push.synchronize(None);
            m = lock(&mem);
            if waited.is_err() {
                // Refused (`WouldDeadlock`: `f` is refused the same way, and changes nothing) or
                // failed (`f` reports it): no second wait.
                break;
            }
        }
        // `destroy_synced` takes the object out of the table with the object locked: seen here
        // with it locked, it stays in until `f` has run. Otherwise a push that waited behind a
        // destroy queued a copy into memory the destroy had just let go of its record of, whose
        // owner then freed it and saw it reissued and overwritten (hostile_review36_capi).
        if !lock(&self.synced).get(&h).is_some_and(|e| Arc::ptr_eq(&e.mem, &mem)) {
            return Err(gone());
        }
        let r = f(device, &mut m);
        *lock(&facts) = SyncedFacts::of(&m);
        r
    }

    /// What the queries on SyncedMemory `h` report, as of its last call that finished: never
    /// waits for a call in progress.
    pub fn synced_facts(&self, h: usize) -> Result<SyncedFacts> {
        let facts = lock(&self.synced)
            .get(&h)
            .map(|e| Arc::clone(&e.facts))
            .ok_or(Error::UnknownHandle { what: "SyncedMemory", handle: h })?;
        Ok(*lock(&facts))
    }

    /// Destroys a SyncedMemory: its own blocks return to their allocators (once the streams
    /// recorded on them have passed their work), lent memory is left alone (and may be freed
    /// once a push from it in flight has run). A call on it running in another thread finishes
    /// first. Refused while memory it owns is lent to another live SyncedMemory.
    pub fn destroy_synced(&self, h: usize) -> Result<()> {
        let mem = lock(&self.synced)
            .get(&h)
            .map(|e| Arc::clone(&e.mem))
            .ok_or(Error::UnknownHandle { what: "SyncedMemory", handle: h })?;
        // Waits for a call in progress (which waits for no stream with the object locked but
        // its own default queue's copies, where no callback of the C API runs).
        let m = lock(&mem);
        let mut lent = self.lent.write();
        if lent.lent_from(h, &m.owned_ranges()) {
            return Err(lent_elsewhere("destroyed"));
        }
        let entry = lock(&self.synced).remove(&h).ok_or(Error::UnknownHandle { what: "SyncedMemory", handle: h })?;
        lent.release(h, m.push_event());
        drop(lent);
        drop(m);
        drop(entry);
        Ok(())
    }

    /// Runs `f`, which lends memory to SyncedMemory `h` as its host (`host`) or device view
    /// (`_set_host_data`, `_set_device_data`), as [`Runtime::with_synced`], holding the
    /// registry of lent memory from before `f` looks the memory up until the registry says
    /// what `h` borrows after it, so that no free of that memory comes between. Refused if the
    /// memory of its own that the lend lets go of is lent to another live SyncedMemory.
    pub fn lend_to_synced<T>(
        &self,
        h: usize,
        host: bool,
        f: impl FnOnce(usize, &mut SyncedMemory) -> Result<T>,
    ) -> Result<T> {
        self.with_synced(h, |device, m| {
            let mut lent = self.lent.write();
            if lent.lent_from(h, &m.owned_ranges_replaced(host)) {
                return Err(lent_elsewhere("replaced"));
            }
            let r = f(device, m);
            // `with_synced` runs this only on a live object, which no destroy takes away meanwhile.
            lent.set(h, m.borrowed_ranges());
            r
        })
    }

    /// `len` bytes at `ptr` as a range of the memory this runtime handed out, if `ptr` lies in
    /// some: pinned host memory (`host_alloc`), unified memory (`unified_alloc`) or the memory
    /// of any device. `Ok(None)` if it lies in none of them; an error if it starts in one but
    /// the range runs past its end.
    pub(crate) fn runtime_mem_at(&self, ptr: *const u8, len: usize) -> Result<Option<Mem>> {
        let addr = ptr as usize;
        let past =
            |expected: &'static str| Error::UnknownPointer { what: "data", ptr: addr, expected, why: String::new() };
        {
            let host = lock(&self.host_live);
            if let Some((base, a)) = host_base(&host, addr).map(|base| (base, &host[&base])) {
                let m = a.mem().range(addr - base, len).map_err(|_| {
                    past("a range inside one block (it starts in pinned host memory but runs past its end)")
                })?;
                return Ok(Some(m));
            }
        }
        if let Some(m) = self.unified_mem(ptr, len)? {
            return Ok(Some(m));
        }
        if let Some(found) = self.imported_mem(ptr, len) {
            return found.map(|(_, m)| Some(m));
        }
        for d in &self.devices {
            if d.allocator().holds(ptr) {
                // Device memory: the range must lie in one live allocation (the error says
                // why not: freed, or running past its end).
                return d.allocator().mem_at(ptr, len).map(Some);
            }
        }
        Ok(None)
    }

    /// Ends the runtime's own threads (the devices' default streams) after their work, and
    /// returns cached host memory. Live memory stays valid: a framework that finalizes with
    /// tensors alive must not crash, and the process is about to exit or unload us.
    pub fn finalize(&self) {
        for d in &self.devices {
            let _ = d.release_default_queue();
        }
        let streams: Vec<StreamEntry> = lock(&self.streams).drain().map(|(_, e)| e).collect();
        for e in streams {
            let _ = e.queue.synchronize();
        }
        lock(&self.events).clear();
        self.host.empty_cache();
    }
}
