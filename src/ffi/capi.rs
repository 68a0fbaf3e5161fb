//! The library's own C API, declared in `include/dmabuf_rt.h`. The header is generated from
//! this file by cbindgen (`DMABUF_RT_BLESS=1 cargo test --test header` rewrites it; the same
//! test fails when it is out of date), so the `///` docs here are the C documentation.
//!
//! Every function returns a [`dmabuf_rt_status`] (or, for the few that cannot fail, a plain
//! value), checks every pointer and handle it is given, and never unwinds: a failure is
//! logged on stderr and kept for the calling thread ([`dmabuf_rt_last_error`]).

#![allow(non_camel_case_types)]

use std::collections::BTreeSet;
use std::ffi::{CString, c_char, c_int, c_void};
use std::fmt::Write as _;
use std::sync::Mutex;

use super::runtime::{CopyKind, Runtime};
use super::{null, out, run, store};
use crate::error::{Error, ErrorKind, Result};
use crate::queue::Mem;
use crate::synced::Head;

/// What a call did. Every function that can fail returns one; on anything but
/// `DMABUF_RT_OK`, `dmabuf_rt_last_error()` says why (and the reason was logged on stderr as
/// `dmabuf-rt: <function>: <why>`). A call refused for bad input (a NULL, foreign or freed
/// pointer, a dead handle, a device out of range, size 0, too much memory, a call the
/// object's state does not allow) changes nothing and writes no out-pointer.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum dmabuf_rt_status {
    /// Success.
    DMABUF_RT_OK = 0,
    /// A bad value: size 0, an unknown device id or copy kind, a buffer too small, a host
    /// range that wraps the address space, an invalid setting in the environment; or a call
    /// the object's state does not allow (an asynchronous push of a SyncedMemory whose newest
    /// data is not on the host).
    DMABUF_RT_INVALID_ARGUMENT = 1,
    /// The device (or the machine) cannot provide that much memory, even after emptying the
    /// cache; the message gives the capacity, what is allocated and what is cached.
    DMABUF_RT_OUT_OF_MEMORY = 2,
    /// A NULL or misaligned pointer argument, or a pointer this library did not hand out (or
    /// already freed, or of another device), or a device range not wholly inside the bytes
    /// one live allocation asked for (a copy or memset running past its end into a
    /// neighbour, or into a freed block). Checked when the call is made.
    DMABUF_RT_INVALID_POINTER = 3,
    /// A stream, event or SyncedMemory handle that is not live (never created, or destroyed:
    /// handles are never reused).
    DMABUF_RT_INVALID_HANDLE = 4,
    /// This device cannot do it.
    DMABUF_RT_NOT_SUPPORTED = 5,
    /// Anything else: a failed system call, a stream whose earlier work failed.
    DMABUF_RT_FAILED = 6,
    /// A process or system limit ran out, not device memory: open files (`ulimit -n`),
    /// locked memory (`ulimit -l`, which io_uring needs on older kernels), address space
    /// (`ulimit -v`), threads. The message names the limit; raising it cures the failure.
    DMABUF_RT_RESOURCE_LIMIT = 7,
    /// Refused because the wait could never end: a stream callback that synchronizes its own
    /// stream, or waits for an event recorded on it after the callback.
    DMABUF_RT_WOULD_DEADLOCK = 8,
}

use dmabuf_rt_status as S;

/// A stream: an ordered queue of copies, event records, waits and callbacks, with its own
/// executor thread. 0 is never a valid stream; where a function takes an optional stream,
/// 0 means none.
pub type dmabuf_rt_stream = u64;

/// An event: a point in a stream that other streams and the host can wait for. 0 is never
/// a valid event.
pub type dmabuf_rt_event = u64;

/// The device argument that means the calling thread's current device
/// (`dmabuf_rt_set_device`).
pub const DMABUF_RT_CURRENT_DEVICE: c_int = -1;

/// What a copy goes between: one of the `DMABUF_RT_MEMCPY_*` values (any other value is
/// refused with `DMABUF_RT_INVALID_ARGUMENT`).
pub type dmabuf_rt_memcpy_kind = c_int;
/// Host memory to device memory.
pub const DMABUF_RT_MEMCPY_HOST_TO_DEVICE: dmabuf_rt_memcpy_kind = 0;
/// Device memory to host memory.
pub const DMABUF_RT_MEMCPY_DEVICE_TO_HOST: dmabuf_rt_memcpy_kind = 1;
/// Device memory to device memory (the two may be on different devices).
pub const DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE: dmabuf_rt_memcpy_kind = 2;
/// Device memory of one device to device memory of another.
pub const DMABUF_RT_MEMCPY_PEER_TO_PEER: dmabuf_rt_memcpy_kind = 3;

/// A SyncedMemory: one buffer seen from the host and from a device, kept coherent lazily
/// (Caffe's `SyncedMemory`; see `dmabuf_rt_synced_create`). 0 is never a valid one.
pub type dmabuf_rt_synced = u64;

/// Where the newest data of a SyncedMemory is (Caffe's `SyncedHead`): one of the
/// `DMABUF_RT_HEAD_*` values.
pub type dmabuf_rt_head = c_int;
/// Nothing allocated or written yet (Caffe's `UNINITIALIZED`).
pub const DMABUF_RT_HEAD_UNINITIALIZED: dmabuf_rt_head = 0;
/// The host view holds the newest data (`HEAD_AT_CPU`).
pub const DMABUF_RT_HEAD_AT_HOST: dmabuf_rt_head = 1;
/// The device view holds the newest data (`HEAD_AT_GPU`).
pub const DMABUF_RT_HEAD_AT_DEVICE: dmabuf_rt_head = 2;
/// Both views hold the same data (`SYNCED`).
pub const DMABUF_RT_HEAD_SYNCED: dmabuf_rt_head = 3;

/// A host function a stream calls once the work submitted before it has run, on the
/// stream's own thread, with the stream, `DMABUF_RT_OK` or the status of the stream's
/// earlier failure, and the `user_data` given to `dmabuf_rt_stream_add_callback`.
pub type dmabuf_rt_callback =
    Option<unsafe extern "C" fn(stream: dmabuf_rt_stream, status: dmabuf_rt_status, user_data: *mut c_void)>;

/// A device's caching-allocator statistics. Bytes are block sizes (requests rounded up to
/// 512 bytes or more) unless said otherwise; peaks are since the start or the last
/// `dmabuf_rt_reset_peak_stats`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct dmabuf_rt_stats {
    /// Bytes allocated to callers now.
    pub allocated_bytes: u64,
    /// Peak of `allocated_bytes`.
    pub peak_allocated_bytes: u64,
    /// Bytes obtained from the device's memory source now (allocated plus cached).
    pub reserved_bytes: u64,
    /// Peak of `reserved_bytes`.
    pub peak_reserved_bytes: u64,
    /// Bytes callers asked for, unrounded, now.
    pub requested_bytes: u64,
    /// Live allocations now.
    pub allocations: u64,
    /// Allocations made.
    pub num_allocs: u64,
    /// Frees completed.
    pub num_frees: u64,
    /// Allocations that failed with out-of-memory.
    pub num_ooms: u64,
    /// Allocations that had to free cached memory and retry.
    pub num_alloc_retries: u64,
    /// Calls that obtained memory from the memory source (segments, or growths of
    /// expandable segments).
    pub num_backend_allocs: u64,
    /// Calls that gave memory back to the memory source.
    pub num_backend_frees: u64,
    /// The device's capacity in bytes (`DMABUF_RT_CAPACITY`, or this machine's RAM).
    pub capacity_bytes: u64,
}

// ---- helpers ----

/// The status for an error: chosen by its kind, never by its text.
fn status_of(e: &Error) -> dmabuf_rt_status {
    match e.kind() {
        ErrorKind::InvalidArgument | ErrorKind::NoSuchDevice => S::DMABUF_RT_INVALID_ARGUMENT,
        ErrorKind::OutOfMemory => S::DMABUF_RT_OUT_OF_MEMORY,
        ErrorKind::InvalidPointer => S::DMABUF_RT_INVALID_POINTER,
        ErrorKind::InvalidHandle => S::DMABUF_RT_INVALID_HANDLE,
        ErrorKind::NotSupported => S::DMABUF_RT_NOT_SUPPORTED,
        ErrorKind::ResourceLimit => S::DMABUF_RT_RESOURCE_LIMIT,
        ErrorKind::WouldDeadlock => S::DMABUF_RT_WOULD_DEADLOCK,
        ErrorKind::PermissionDenied | ErrorKind::Timeout | ErrorKind::Failed => S::DMABUF_RT_FAILED,
    }
}

/// Runs `f` as the C function `func` (panics caught, errors logged and recorded) and turns
/// the outcome into a status.
fn call(func: &str, f: impl FnOnce() -> Result<()>) -> dmabuf_rt_status {
    match run(func, f) {
        Ok(()) => S::DMABUF_RT_OK,
        Err(e) => status_of(&e),
    }
}

fn rt() -> Result<&'static Runtime> {
    Runtime::get()
}

fn invalid(what: String) -> Error {
    Error::InvalidArgument { what }
}

/// The device a C device argument names (`DMABUF_RT_CURRENT_DEVICE`: the thread's current one).
fn device_id(rt: &Runtime, device: c_int) -> Result<usize> {
    let id = match device {
        DMABUF_RT_CURRENT_DEVICE => rt.current(),
        d if d < 0 => return Err(Error::NoSuchDevice { id: i64::from(d), count: rt.devices().len() }),
        d => d as usize,
    };
    rt.device(id)?;
    Ok(id)
}

fn handle(h: dmabuf_rt_stream) -> usize {
    // Handles fit in usize on every target this library builds for; a value that does not
    // becomes one no stream has.
    usize::try_from(h).unwrap_or(usize::MAX)
}

fn copy_kind(kind: dmabuf_rt_memcpy_kind) -> Result<CopyKind> {
    Ok(match kind {
        DMABUF_RT_MEMCPY_HOST_TO_DEVICE => CopyKind::HostToDevice,
        DMABUF_RT_MEMCPY_DEVICE_TO_HOST => CopyKind::DeviceToHost,
        DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE => CopyKind::DeviceToDevice,
        DMABUF_RT_MEMCPY_PEER_TO_PEER => CopyKind::PeerToPeer,
        k => return Err(invalid(format!("copy kind {k} is not one of DMABUF_RT_MEMCPY_* (0 to 3)"))),
    })
}

fn nonzero(size: usize) -> Result<usize> {
    if size == 0 { Err(Error::ZeroLength) } else { Ok(size) }
}

/// Strings handed to C callers, so that `dmabuf_rt_string_free` refuses any other pointer.
static STRINGS: Mutex<BTreeSet<usize>> = Mutex::new(BTreeSet::new());

fn strings() -> std::sync::MutexGuard<'static, BTreeSet<usize>> {
    STRINGS.lock().unwrap_or_else(|p| p.into_inner())
}

/// `s` as a JSON string literal.
fn json_str(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// A C callback and its user data, carried to the stream's thread.
struct CCallback {
    f: unsafe extern "C" fn(dmabuf_rt_stream, dmabuf_rt_status, *mut c_void),
    stream: dmabuf_rt_stream,
    user_data: *mut c_void,
}

// SAFETY: `dmabuf_rt_stream_add_callback`'s documented C contract: the caller guarantees that
// `f` may be called, with `user_data`, on another thread (the stream's), at any time until
// the stream has run it. We only move the two pointers there and never dereference them.
unsafe impl Send for CCallback {}

impl CCallback {
    fn call(self, status: dmabuf_rt_status) {
        // SAFETY: the C contract above: `f` is a valid function and accepts `user_data`.
        unsafe { (self.f)(self.stream, status, self.user_data) }
    }
}

// ---- errors and versions ----

/// The calling thread's last error message (NULL if none): a NUL-terminated string owned by
/// the library, valid until the thread's next failing call. Do not free it.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_last_error() -> *const c_char {
    super::last_error()
}

/// The name of a status (`"DMABUF_RT_OK"`, ...; `"unknown status"` for any other value), a
/// static string.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_status_name(status: c_int) -> *const c_char {
    let s: &'static std::ffi::CStr = match status {
        0 => c"DMABUF_RT_OK",
        1 => c"DMABUF_RT_INVALID_ARGUMENT",
        2 => c"DMABUF_RT_OUT_OF_MEMORY",
        3 => c"DMABUF_RT_INVALID_POINTER",
        4 => c"DMABUF_RT_INVALID_HANDLE",
        5 => c"DMABUF_RT_NOT_SUPPORTED",
        6 => c"DMABUF_RT_FAILED",
        7 => c"DMABUF_RT_RESOURCE_LIMIT",
        8 => c"DMABUF_RT_WOULD_DEADLOCK",
        _ => c"unknown status",
    };
    s.as_ptr()
}

/// The library's version (`"0.1.0"`), a static string.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

// ---- devices ----

/// Stores the number of devices in `*count`. The first call builds the process-wide runtime
/// from the environment (`DMABUF_RT_DEVICES`, `DMABUF_RT_CAPACITY`, `DMABUF_RT_ALLOC_CONF`),
/// read once; any call may be the first.
///
/// # Safety
/// `count` must be NULL (refused) or valid for writing an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_device_count(count: *mut c_int) -> dmabuf_rt_status {
    call("dmabuf_rt_device_count", || {
        let count = out(count, "count")?;
        let n = c_int::try_from(rt()?.devices().len()).unwrap_or(c_int::MAX);
        // SAFETY: the caller's contract for `count`.
        unsafe { store(count, n) };
        Ok(())
    })
}

/// Copies the device's description (`shmem`, `heap:system`, `gem:/dev/dri/card0`) into `buf`
/// as a NUL-terminated string. A buffer of `len` bytes too small for it is refused with
/// `DMABUF_RT_INVALID_ARGUMENT` and left untouched.
///
/// # Safety
/// `buf` must be NULL (refused) or valid for writing `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_device_name(device: c_int, buf: *mut c_char, len: usize) -> dmabuf_rt_status {
    call("dmabuf_rt_device_name", || {
        let buf = out(buf, "buf")?;
        let rt = rt()?;
        let name = rt.device(device_id(rt, device)?)?.name();
        if name.len() >= len {
            return Err(invalid(format!(
                "a buffer of {len} bytes cannot hold the name `{name}` ({} bytes with its NUL)",
                name.len() + 1
            )));
        }
        // SAFETY: `buf` is valid for `len` bytes (the caller's contract), and we write
        // `name.len() + 1 <= len` of them; a Rust string does not overlap the caller's buffer.
        unsafe { std::ptr::copy_nonoverlapping(name.as_ptr().cast::<c_char>(), buf, name.len()) };
        // SAFETY: as above: `name.len() < len`, so the NUL's place is inside the buffer.
        let end = unsafe { buf.add(name.len()) };
        // SAFETY: as above.
        unsafe { end.write(0) };
        Ok(())
    })
}

/// Makes `device` the calling thread's current device: the one `DMABUF_RT_CURRENT_DEVICE`
/// (-1) names, and where `dmabuf_rt_event_record` with no stream records. Every thread
/// starts on device 0.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_set_device(device: c_int) -> dmabuf_rt_status {
    call("dmabuf_rt_set_device", || {
        let rt = rt()?;
        rt.set_current(device_id(rt, device)?)
    })
}

/// Stores the calling thread's current device in `*device`.
///
/// # Safety
/// `device` must be NULL (refused) or valid for writing an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_get_device(device: *mut c_int) -> dmabuf_rt_status {
    call("dmabuf_rt_get_device", || {
        let device = out(device, "device")?;
        let id = c_int::try_from(rt()?.current()).unwrap_or(c_int::MAX);
        // SAFETY: the caller's contract for `device`.
        unsafe { store(device, id) };
        Ok(())
    })
}

/// Waits for the work submitted to every stream of `device`.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_device_synchronize(device: c_int) -> dmabuf_rt_status {
    call("dmabuf_rt_device_synchronize", || {
        let rt = rt()?;
        rt.device(device_id(rt, device)?)?.synchronize()
    })
}

/// Stores the device's capacity in `*total` and what its allocator does not hold (capacity
/// minus reserved bytes) in `*free`.
///
/// # Safety
/// `total` and `free` must each be NULL (refused) or valid for writing a `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_device_memory(device: c_int, total: *mut u64, free: *mut u64) -> dmabuf_rt_status {
    call("dmabuf_rt_device_memory", || {
        let (total, free) = (out(total, "total")?, out(free, "free")?);
        let rt = rt()?;
        let (t, f) = rt.memory_stats(device_id(rt, device)?)?;
        // SAFETY: the caller's contract for `total` and `free`.
        unsafe { store(total, t) };
        // SAFETY: as above.
        unsafe { store(free, f) };
        Ok(())
    })
}

// ---- memory ----

/// Allocates `size` bytes of device memory on `device` through its caching allocator and
/// stores the pointer in `*ptr`. The pointer is the CPU address of the block's mapping (device
/// memory here is DMA-BUF memory the CPU can map), but read and write it through
/// `dmabuf_rt_memcpy` and `dmabuf_rt_memset`, which order the access with the streams. Size 0
/// is refused (`DMABUF_RT_INVALID_ARGUMENT`); more than the device can give is
/// `DMABUF_RT_OUT_OF_MEMORY`, after the cache has been emptied.
///
/// # Safety
/// `ptr` must be NULL (refused) or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_device_alloc(device: c_int, size: usize, ptr: *mut *mut c_void) -> dmabuf_rt_status {
    call("dmabuf_rt_device_alloc", || {
        let ptr = out(ptr, "ptr")?;
        let size = nonzero(size)?;
        let rt = rt()?;
        let p = rt.device_alloc(device_id(rt, device)?, size)?;
        // SAFETY: the caller's contract for `ptr`.
        unsafe { store(ptr, p.cast::<c_void>()) };
        Ok(())
    })
}

/// Frees device memory from `dmabuf_rt_device_alloc` on the same device (no size needed).
/// The block returns to the device's cache, not to the system (see `dmabuf_rt_empty_cache`).
/// Free memory only after the streams that use it have finished with it (synchronize them or
/// an event recorded after the work). NULL, a pointer this device never handed out, a pointer
/// into the middle of a block and a second free of the same pointer are refused with
/// `DMABUF_RT_INVALID_POINTER` and change nothing: every free is checked against the live
/// allocations when it is made.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_device_free(device: c_int, ptr: *mut c_void) -> dmabuf_rt_status {
    call("dmabuf_rt_device_free", || {
        let rt = rt()?;
        rt.device_free(device_id(rt, device)?, ptr.cast(), None)
    })
}

/// Allocates `size` bytes of pinned (page-locked) host memory and stores the pointer in
/// `*ptr`: ordinary CPU memory, faster as the host side of copies. Size 0 is refused.
///
/// # Safety
/// `ptr` must be NULL (refused) or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_host_alloc(size: usize, ptr: *mut *mut c_void) -> dmabuf_rt_status {
    call("dmabuf_rt_host_alloc", || {
        let ptr = out(ptr, "ptr")?;
        let p = rt()?.host_alloc(nonzero(size)?)?;
        // SAFETY: the caller's contract for `ptr`.
        unsafe { store(ptr, p.cast::<c_void>()) };
        Ok(())
    })
}

/// Frees pinned host memory from `dmabuf_rt_host_alloc`. Any other pointer, NULL, or a second
/// free is refused with `DMABUF_RT_INVALID_POINTER`. Not while a stream may still copy to or
/// from it.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_host_free(ptr: *mut c_void) -> dmabuf_rt_status {
    call("dmabuf_rt_host_free", || rt()?.host_free(ptr.cast()))
}

/// Allocates `size` bytes of unified memory (a shared mapping of a sealed memfd, the same
/// bytes for the CPU and for any importer of its fd) and stores the pointer in `*ptr`. Size 0
/// is refused.
///
/// # Safety
/// `ptr` must be NULL (refused) or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_unified_alloc(size: usize, ptr: *mut *mut c_void) -> dmabuf_rt_status {
    call("dmabuf_rt_unified_alloc", || {
        let ptr = out(ptr, "ptr")?;
        let p = rt()?.unified_alloc(nonzero(size)?)?;
        // SAFETY: the caller's contract for `ptr`.
        unsafe { store(ptr, p.cast::<c_void>()) };
        Ok(())
    })
}

/// Frees unified memory from `dmabuf_rt_unified_alloc`. Any other pointer, NULL, or a second
/// free is refused with `DMABUF_RT_INVALID_POINTER`. Not while a stream may still copy to or
/// from it.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_unified_free(ptr: *mut c_void) -> dmabuf_rt_status {
    call("dmabuf_rt_unified_free", || rt()?.unified_free(ptr.cast()))
}

/// Sets `size` bytes of device memory at `ptr` (anywhere inside a live allocation of
/// `device`, the whole range within the bytes it asked for) to `(unsigned char)value`, as `memset` does, after the work
/// already submitted to the device's streams; returns when done. Size 0 does nothing.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_memset(device: c_int, ptr: *mut c_void, value: c_int, size: usize) -> dmabuf_rt_status {
    call("dmabuf_rt_memset", || {
        let rt = rt()?;
        let dev = device_id(rt, device)?;
        if size > 0 && ptr.is_null() {
            return Err(null("ptr"));
        }
        rt.memset(dev, ptr.cast(), value as u8, size)
    })
}

/// Copies `size` bytes from `src` to `dst`.
///
/// `kind` says which sides are device memory: `DMABUF_RT_MEMCPY_HOST_TO_DEVICE`,
/// `_DEVICE_TO_HOST`, `_DEVICE_TO_DEVICE` or `_PEER_TO_PEER`. A device side must lie inside
/// memory `dmabuf_rt_device_alloc` handed out on the device given with it (`dst_device`,
/// `src_device`; pointers into the middle of a block are fine, but the whole range must lie
/// within the bytes that one live allocation asked for), else `DMABUF_RT_INVALID_POINTER`. The device argument of a host side
/// is ignored. The host side may be any memory of the process (pinned host memory from
/// `dmabuf_rt_host_alloc` is not required); it cannot be checked beyond NULL.
///
/// With `stream` 0 the copy is synchronous: it first waits for the work submitted to every
/// stream of the devices involved, then copies, and returns when the bytes are there. With a
/// stream, the copy is queued on it and this returns at once: a host-to-device copy has read
/// the host bytes before returning (into a staging buffer), so the caller may reuse them; a
/// device-to-host copy writes the host bytes when the stream reaches it (wait with
/// `dmabuf_rt_stream_synchronize` or an event).
///
/// A NULL `dst` or `src` (with `size` > 0) is refused with `DMABUF_RT_INVALID_POINTER`. A copy
/// of 0 bytes checks the devices, kind and stream, then does nothing.
///
/// # Safety
/// The host side must be valid for `size` bytes: for reading (host-to-device) until this
/// returns; for writing (device-to-host) until the copy has run, that is, until this returns
/// with stream 0, or until the stream has passed the copy. It must not be freed or unmapped
/// before then, and nothing else may write it meanwhile.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_memcpy(
    dst_device: c_int,
    dst: *mut c_void,
    src_device: c_int,
    src: *const c_void,
    size: usize,
    kind: dmabuf_rt_memcpy_kind,
    stream: dmabuf_rt_stream,
) -> dmabuf_rt_status {
    call("dmabuf_rt_memcpy", || {
        let kind = copy_kind(kind)?;
        let rt = rt()?;
        let (dst_dev, src_dev) = match kind {
            // The host side takes the device side's id, so that a synchronous copy waits for
            // that device's streams only.
            CopyKind::HostToDevice => {
                let d = device_id(rt, dst_device)?;
                (d, d)
            }
            CopyKind::DeviceToHost => {
                let d = device_id(rt, src_device)?;
                (d, d)
            }
            CopyKind::DeviceToDevice | CopyKind::PeerToPeer => (device_id(rt, dst_device)?, device_id(rt, src_device)?),
        };
        let stream = match stream {
            0 => None,
            h => {
                rt.stream_device(handle(h))?;
                Some(handle(h))
            }
        };
        if size > 0 && (dst.is_null() || src.is_null()) {
            return Err(null(if dst.is_null() { "dst" } else { "src" }));
        }
        // SAFETY: the caller's contract covers the host side, as `Runtime::copy` requires;
        // device sides are checked against the allocators.
        unsafe { rt.copy(kind, (dst_dev, dst.cast()), (src_dev, src.cast()), size, stream) }
    })
}

// ---- streams ----

/// Creates a stream on `device` and stores its handle in `*stream`.
///
/// # Safety
/// `stream` must be NULL (refused) or valid for writing a `dmabuf_rt_stream`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_stream_create(device: c_int, stream: *mut dmabuf_rt_stream) -> dmabuf_rt_status {
    call("dmabuf_rt_stream_create", || {
        let stream = out(stream, "stream")?;
        let rt = rt()?;
        let h = rt.create_stream(device_id(rt, device)?)?;
        // SAFETY: the caller's contract for `stream`.
        unsafe { store(stream, h as dmabuf_rt_stream) };
        Ok(())
    })
}

/// Destroys a stream after the work submitted to it has run (returning that work's failure,
/// if any). Called from a stream callback (of this stream or another) it returns at once, as
/// `cudaStreamDestroy` does, and the stream finishes its work on its own. The handle is never
/// valid again: a second destroy, or any use, is `DMABUF_RT_INVALID_HANDLE`.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_stream_destroy(stream: dmabuf_rt_stream) -> dmabuf_rt_status {
    call("dmabuf_rt_stream_destroy", || rt()?.destroy_stream(handle(stream)))
}

/// Waits until everything submitted to the stream has run; returns `DMABUF_RT_FAILED` if any
/// of it failed (a failed operation fails the later ones on its stream too).
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_stream_synchronize(stream: dmabuf_rt_stream) -> dmabuf_rt_status {
    call("dmabuf_rt_stream_synchronize", || rt()?.synchronize_stream(handle(stream)))
}

/// Stores in `*done` whether the stream has run everything submitted to it, without waiting;
/// `DMABUF_RT_FAILED` if some of it failed.
///
/// # Safety
/// `done` must be NULL (refused) or valid for writing a `bool`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_stream_query(stream: dmabuf_rt_stream, done: *mut bool) -> dmabuf_rt_status {
    call("dmabuf_rt_stream_query", || {
        let done = out(done, "done")?;
        let d = rt()?.query_stream(handle(stream))?;
        // SAFETY: the caller's contract for `done`.
        unsafe { store(done, d) };
        Ok(())
    })
}

/// Queues a call of `callback(stream, status, user_data)` on the stream, after the work
/// submitted before it; `status` is `DMABUF_RT_OK`, or the failure of earlier work on the
/// stream. If this returns `DMABUF_RT_OK` the callback is called exactly once, on the
/// stream's own thread (destroying the stream runs it first); otherwise never. A NULL
/// callback is refused. The callback must not block for long (the stream waits for it) and
/// must not synchronize or destroy its own stream.
///
/// # Safety
/// `callback` must be safe to call from another thread with `user_data`, at any time until it
/// has run; the library only passes `user_data` back, never dereferences it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_stream_add_callback(
    stream: dmabuf_rt_stream,
    callback: dmabuf_rt_callback,
    user_data: *mut c_void,
) -> dmabuf_rt_status {
    call("dmabuf_rt_stream_add_callback", || {
        let f = callback.ok_or_else(|| null("callback"))?;
        let cb = CCallback { f, stream, user_data };
        rt()?.stream_add_callback(handle(stream), move |r| {
            let status = match &r {
                Ok(()) => S::DMABUF_RT_OK,
                Err(e) => status_of(e),
            };
            cb.call(status);
        })
    })
}

/// Makes the stream wait, before its later work, until the event's latest record (at the
/// time of this call) has completed. An event never recorded is complete.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_stream_wait_event(stream: dmabuf_rt_stream, event: dmabuf_rt_event) -> dmabuf_rt_status {
    call("dmabuf_rt_stream_wait_event", || rt()?.stream_wait_event(handle(stream), handle(event)))
}

// ---- events ----

/// Creates an event (complete until first recorded) and stores its handle in `*event`.
///
/// # Safety
/// `event` must be NULL (refused) or valid for writing a `dmabuf_rt_event`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_event_create(event: *mut dmabuf_rt_event) -> dmabuf_rt_status {
    call("dmabuf_rt_event_create", || {
        let event = out(event, "event")?;
        let h = rt()?.create_event();
        // SAFETY: the caller's contract for `event`.
        unsafe { store(event, h as dmabuf_rt_event) };
        Ok(())
    })
}

/// Records the event at the current end of `stream`: it completes when the stream has run
/// the work submitted before. With `stream` 0 it is recorded on the current device's own
/// stream, which only runs synchronous work, so it completes at once.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_event_record(event: dmabuf_rt_event, stream: dmabuf_rt_stream) -> dmabuf_rt_status {
    call("dmabuf_rt_event_record", || {
        let rt = rt()?;
        let stream = if stream == 0 { None } else { Some(handle(stream)) };
        rt.record_event(rt.current(), stream, handle(event))
    })
}

/// Stores in `*done` whether the event's latest record has completed, without waiting;
/// `DMABUF_RT_FAILED` if the work before it failed.
///
/// # Safety
/// `done` must be NULL (refused) or valid for writing a `bool`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_event_query(event: dmabuf_rt_event, done: *mut bool) -> dmabuf_rt_status {
    call("dmabuf_rt_event_query", || {
        let done = out(done, "done")?;
        let d = rt()?.query_event(handle(event))?;
        // SAFETY: the caller's contract for `done`.
        unsafe { store(done, d) };
        Ok(())
    })
}

/// Waits until the event's latest record has completed; `DMABUF_RT_FAILED` if the work
/// before it failed.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_event_synchronize(event: dmabuf_rt_event) -> dmabuf_rt_status {
    call("dmabuf_rt_event_synchronize", || rt()?.synchronize_event(handle(event)))
}

/// Destroys an event (streams already waiting on it still wait). The handle is never valid
/// again: a second destroy, or any use, is `DMABUF_RT_INVALID_HANDLE`.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_event_destroy(event: dmabuf_rt_event) -> dmabuf_rt_status {
    call("dmabuf_rt_event_destroy", || rt()?.destroy_event(handle(event)))
}

// ---- statistics and the cache ----

/// Stores the device's allocator statistics in `*stats`.
///
/// # Safety
/// `stats` must be NULL (refused) or valid for writing a `dmabuf_rt_stats`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_device_stats(device: c_int, stats: *mut dmabuf_rt_stats) -> dmabuf_rt_status {
    call("dmabuf_rt_device_stats", || {
        let stats = out(stats, "stats")?;
        let rt = rt()?;
        let a = rt.device(device_id(rt, device)?)?.allocator();
        let d = a.stats();
        let all = crate::caching::stats::AGGREGATE;
        let u = |v: i64| v.max(0) as u64;
        let s = dmabuf_rt_stats {
            allocated_bytes: u(d.allocated_bytes[all].current),
            peak_allocated_bytes: u(d.allocated_bytes[all].peak),
            reserved_bytes: u(d.reserved_bytes[all].current),
            peak_reserved_bytes: u(d.reserved_bytes[all].peak),
            requested_bytes: u(d.requested_bytes[all].current),
            allocations: u(d.allocation[all].current),
            num_allocs: u(d.allocation[all].allocated),
            num_frees: u(d.allocation[all].freed),
            num_ooms: u(d.num_ooms),
            num_alloc_retries: u(d.num_alloc_retries),
            num_backend_allocs: u(d.num_device_alloc),
            num_backend_frees: u(d.num_device_free),
            capacity_bytes: a.capacity(),
        };
        // SAFETY: the caller's contract for `stats`.
        unsafe { store(stats, s) };
        Ok(())
    })
}

/// Sets every peak of the device's statistics to its current value.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_reset_peak_stats(device: c_int) -> dmabuf_rt_status {
    call("dmabuf_rt_reset_peak_stats", || {
        let rt = rt()?;
        rt.device(device_id(rt, device)?)?.allocator().reset_peak_stats();
        Ok(())
    })
}

/// Returns the device's cached (freed but kept) memory to the system, after the work already
/// submitted to its streams. Live allocations are untouched.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_empty_cache(device: c_int) -> dmabuf_rt_status {
    call("dmabuf_rt_empty_cache", || {
        let rt = rt()?;
        rt.device(device_id(rt, device)?)?.allocator().empty_cache();
        Ok(())
    })
}

/// Returns the cached (freed but kept) pinned host memory to the system: its memfds are
/// closed and its pages unlocked. Live host allocations are untouched.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_host_empty_cache() -> dmabuf_rt_status {
    call("dmabuf_rt_host_empty_cache", || {
        rt()?.host_empty_cache();
        Ok(())
    })
}

/// Stores in `*json` a snapshot of the device's allocator as a NUL-terminated JSON object:
/// `{"device":N,"spec":"...","stats":{...},"segments":[...]}`, where `stats` uses PyTorch's
/// `memory_stats()` key names and `segments` lists each segment with its blocks (PyTorch's
/// `memory_snapshot()` shape). The string belongs to the caller: free it with
/// `dmabuf_rt_string_free` (not `free`).
///
/// # Safety
/// `json` must be NULL (refused) or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_snapshot_json(device: c_int, json: *mut *mut c_char) -> dmabuf_rt_status {
    call("dmabuf_rt_snapshot_json", || {
        let json = out(json, "json")?;
        let rt = rt()?;
        let id = device_id(rt, device)?;
        let dev = rt.device(id)?;
        let (stats, snapshot) = (dev.allocator().stats().to_json(), dev.allocator().snapshot().to_json());
        // `snapshot` is `{"segments":[...]}`: splice its members after ours.
        let s = format!(
            "{{\"device\":{},\"spec\":{},\"stats\":{stats},{}",
            id,
            json_str(dev.name()),
            snapshot.strip_prefix('{').unwrap_or(&snapshot)
        );
        let p = CString::new(s).map_err(|_| invalid("snapshot JSON with a NUL byte".into()))?.into_raw();
        strings().insert(p as usize);
        // SAFETY: the caller's contract for `json`.
        unsafe { store(json, p) };
        Ok(())
    })
}

/// Frees a string from `dmabuf_rt_snapshot_json`. NULL does nothing (as with `free`); any
/// other pointer, or a second free, is refused with `DMABUF_RT_INVALID_POINTER`.
#[unsafe(no_mangle)]
// Safe for any pointer: only pointers found in `STRINGS` are turned back into strings.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub extern "C" fn dmabuf_rt_string_free(s: *mut c_char) -> dmabuf_rt_status {
    call("dmabuf_rt_string_free", || {
        if s.is_null() {
            return Ok(());
        }
        if !strings().remove(&(s as usize)) {
            return Err(Error::InvalidFree { ptr: s as usize, why: "not a live string from this library" });
        }
        // SAFETY: `s` came from `CString::into_raw` in this module (it was in `STRINGS`, and
        // is removed from it now, so this runs once per string).
        drop(unsafe { CString::from_raw(s) });
        Ok(())
    })
}

// ---- SyncedMemory ----

fn head_cstr(head: dmabuf_rt_head) -> &'static std::ffi::CStr {
    match head {
        DMABUF_RT_HEAD_UNINITIALIZED => c"DMABUF_RT_HEAD_UNINITIALIZED",
        DMABUF_RT_HEAD_AT_HOST => c"DMABUF_RT_HEAD_AT_HOST",
        DMABUF_RT_HEAD_AT_DEVICE => c"DMABUF_RT_HEAD_AT_DEVICE",
        DMABUF_RT_HEAD_SYNCED => c"DMABUF_RT_HEAD_SYNCED",
        _ => c"unknown head",
    }
}

fn head_value(h: Head) -> dmabuf_rt_head {
    match h {
        Head::Uninitialized => DMABUF_RT_HEAD_UNINITIALIZED,
        Head::AtHost => DMABUF_RT_HEAD_AT_HOST,
        Head::AtDevice => DMABUF_RT_HEAD_AT_DEVICE,
        Head::Synced => DMABUF_RT_HEAD_SYNCED,
    }
}

/// The name of a head (`"DMABUF_RT_HEAD_UNINITIALIZED"`, `"DMABUF_RT_HEAD_AT_HOST"`,
/// `"DMABUF_RT_HEAD_AT_DEVICE"`, `"DMABUF_RT_HEAD_SYNCED"`; `"unknown head"` for any other
/// value), a static string.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_head_name(head: dmabuf_rt_head) -> *const c_char {
    head_cstr(head).as_ptr()
}

/// Creates a SyncedMemory of `size` bytes on `device` and stores its handle in `*synced`.
/// Nothing is allocated yet: the first access allocates and zero-fills the side it asks for,
/// later accesses move the data to where it is read, and the head
/// (`dmabuf_rt_synced_head`) records where the newest data is, as in Caffe:
///
/// - `_host_data`: from `UNINITIALIZED`, allocate and zero, then `AT_HOST`; from
///   `AT_DEVICE`, copy device to host, then `SYNCED`; otherwise nothing moves.
/// - `_device_data`: from `UNINITIALIZED`, allocate and zero, then `AT_DEVICE`; from
///   `AT_HOST`, copy host to device, then `SYNCED`; otherwise nothing moves.
/// - `_mutable_host_data`, `_mutable_device_data`: the same, then the head moves to their side
///   (`AT_HOST`, `AT_DEVICE`), because the caller is about to write there.
///
/// Device memory comes from the device's caching allocator (the statistics of
/// `dmabuf_rt_device_stats` count it). With `alias` true, since device memory here is memory
/// the CPU can map, the SyncedMemory keeps one device block that is both views: the head
/// still says which side wrote last, but no transition copies anything (`_copies` stays 0).
/// With `alias` false (or when the device's memory turns out not to be CPU-mappable), the
/// host view is a separate block of pinned host memory and each transition that moves data
/// makes exactly one copy, on the device's own stream, and returns when it is done.
///
/// Pointers: a host pointer (`_host_data`, `_mutable_host_data`) is valid for `size` bytes until
/// the next call on this SyncedMemory other than the queries (`_head`, `_size`, `_copies`,
/// `_owns`, `_aliased`): the CPU-access window it opened closes then. A device pointer
/// (`_device_data`, `_mutable_device_data`) is an address in the device's memory, for
/// `dmabuf_rt_memcpy` and `dmabuf_rt_memset` on that device; it stays the same until the memory
/// is replaced (`_set_device_data`, or `_set_host_data` when aliased) or the SyncedMemory is
/// destroyed, but it holds the newest data only while the head is `AT_DEVICE` or `SYNCED`.
/// Work queued on a stream that uses it must have run (synchronize the stream or an event)
/// before the next call on the SyncedMemory and before destroying it; synchronous copies and
/// `dmabuf_rt_memset` are done when they return.
///
/// Size 0 is refused (`DMABUF_RT_INVALID_ARGUMENT`). The handle is a number, never reissued.
///
/// # Safety
/// `synced` must be NULL (refused) or valid for writing a `dmabuf_rt_synced`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_synced_create(
    device: c_int,
    size: usize,
    alias: bool,
    synced: *mut dmabuf_rt_synced,
) -> dmabuf_rt_status {
    call("dmabuf_rt_synced_create", || {
        let synced = out(synced, "synced")?;
        let size = nonzero(size)?;
        let rt = rt()?;
        let h = rt.create_synced(device_id(rt, device)?, size, alias)?;
        // SAFETY: the caller's contract for `synced`.
        unsafe { store(synced, h as dmabuf_rt_synced) };
        Ok(())
    })
}

/// Destroys a SyncedMemory. The memory it allocated returns to its allocator (after an
/// asynchronous push still in flight has run); memory lent with `_set_host_data` or
/// `_set_device_data` is never freed: it stays the caller's. Pointers from it are invalid
/// afterwards. The handle is never valid again: a second destroy, or any use, is
/// `DMABUF_RT_INVALID_HANDLE`.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_synced_destroy(synced: dmabuf_rt_synced) -> dmabuf_rt_status {
    call("dmabuf_rt_synced_destroy", || rt()?.destroy_synced(handle(synced)))
}

/// Stores where the newest data is (a `DMABUF_RT_HEAD_*` value) in `*head`. Moves nothing.
///
/// # Safety
/// `head` must be NULL (refused) or valid for writing a `dmabuf_rt_head`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_synced_head(
    synced: dmabuf_rt_synced,
    head: *mut dmabuf_rt_head,
) -> dmabuf_rt_status {
    call("dmabuf_rt_synced_head", || {
        let head = out(head, "head")?;
        let h = rt()?.with_synced(handle(synced), |_, m| Ok(head_value(m.head())))?;
        // SAFETY: the caller's contract for `head`.
        unsafe { store(head, h) };
        Ok(())
    })
}

/// Stores the size in bytes in `*size`.
///
/// # Safety
/// `size` must be NULL (refused) or valid for writing a `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_synced_size(synced: dmabuf_rt_synced, size: *mut usize) -> dmabuf_rt_status {
    call("dmabuf_rt_synced_size", || {
        let size = out(size, "size")?;
        let n = rt()?.with_synced(handle(synced), |_, m| Ok(m.size()))?;
        // SAFETY: the caller's contract for `size`.
        unsafe { store(size, n) };
        Ok(())
    })
}

/// Stores in `*copies` how many host/device copies the SyncedMemory has made (transitions and
/// pushes; zero-fills are not copies): always 0 while it is aliased.
///
/// # Safety
/// `copies` must be NULL (refused) or valid for writing a `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_synced_copies(synced: dmabuf_rt_synced, copies: *mut u64) -> dmabuf_rt_status {
    call("dmabuf_rt_synced_copies", || {
        let copies = out(copies, "copies")?;
        let n = rt()?.with_synced(handle(synced), |_, m| Ok(m.copies()))?;
        // SAFETY: the caller's contract for `copies`.
        unsafe { store(copies, n) };
        Ok(())
    })
}

/// Stores in `*aliased` whether the two views are one buffer (so transitions copy nothing):
/// true when created with `alias` and the device's memory is CPU-mappable.
///
/// # Safety
/// `aliased` must be NULL (refused) or valid for writing a `bool`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_synced_aliased(synced: dmabuf_rt_synced, aliased: *mut bool) -> dmabuf_rt_status {
    call("dmabuf_rt_synced_aliased", || {
        let aliased = out(aliased, "aliased")?;
        let a = rt()?.with_synced(handle(synced), |_, m| Ok(m.is_aliased()))?;
        // SAFETY: the caller's contract for `aliased`.
        unsafe { store(aliased, a) };
        Ok(())
    })
}

/// Stores in `*host` and `*device` whether each view is memory the SyncedMemory allocated and
/// will free (Caffe's `own_cpu_data_`, `own_gpu_data_`): false before the view is first
/// allocated, and after memory was lent for it (`_set_host_data`, `_set_device_data`; when
/// aliased, lent memory is both views).
///
/// # Safety
/// `host` and `device` must each be NULL (refused) or valid for writing a `bool`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_synced_owns(
    synced: dmabuf_rt_synced,
    host: *mut bool,
    device: *mut bool,
) -> dmabuf_rt_status {
    call("dmabuf_rt_synced_owns", || {
        let (host, device) = (out(host, "host")?, out(device, "device")?);
        let (h, d) = rt()?.with_synced(handle(synced), |_, m| Ok((m.owns_host_data(), m.owns_device_data())))?;
        // SAFETY: the caller's contract for `host` and `device`.
        unsafe { store(host, h) };
        // SAFETY: as above.
        unsafe { store(device, d) };
        Ok(())
    })
}

/// Makes the host view current (Caffe's `cpu_data()`) and stores its address in `*data`, for
/// reading `size` bytes: allocates and zero-fills on first use (head `AT_HOST`), copies from
/// the device if the device holds the newest data (head `SYNCED`). Waits for an asynchronous
/// push in flight; if the push failed, that is the status (`DMABUF_RT_FAILED`) and the head is
/// `AT_HOST` again.
///
/// The pointer is valid until the next call on this SyncedMemory other than the queries
/// (`_head`, `_size`, `_copies`, `_owns`, `_aliased`), which closes the CPU-access window
/// this call opened (a `DMA_BUF_IOCTL_SYNC` read bracket when the memory is a dma-buf). Do not
/// write through it: use `_mutable_host_data` for that.
///
/// # Safety
/// `data` must be NULL (refused) or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_synced_host_data(
    synced: dmabuf_rt_synced,
    data: *mut *const c_void,
) -> dmabuf_rt_status {
    call("dmabuf_rt_synced_host_data", || {
        let data = out(data, "data")?;
        let p = rt()?.with_synced(handle(synced), |_, m| m.host_ptr())?;
        // SAFETY: the caller's contract for `data`.
        unsafe { store(data, p.cast::<c_void>()) };
        Ok(())
    })
}

/// As `dmabuf_rt_synced_host_data`, for reading and writing (Caffe's `mutable_cpu_data()`),
/// then head `AT_HOST`: the next device access copies (unless aliased). The pointer is valid
/// for reading and writing `size` bytes until the next call on this SyncedMemory other than
/// the queries, which closes the CPU-access window (a read-write bracket for a dma-buf).
///
/// # Safety
/// `data` must be NULL (refused) or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_synced_mutable_host_data(
    synced: dmabuf_rt_synced,
    data: *mut *mut c_void,
) -> dmabuf_rt_status {
    call("dmabuf_rt_synced_mutable_host_data", || {
        let data = out(data, "data")?;
        let p = rt()?.with_synced(handle(synced), |_, m| m.mutable_host_ptr())?;
        // SAFETY: the caller's contract for `data`.
        unsafe { store(data, p.cast::<c_void>()) };
        Ok(())
    })
}

/// Makes the device view current (Caffe's `gpu_data()`) and stores its address in `*data`:
/// allocates and zero-fills on first use (head `AT_DEVICE`), copies from the host if the host
/// holds the newest data (head `SYNCED`). Waits for an asynchronous push in flight (its failure
/// is then this call's, `DMABUF_RT_FAILED`, with the head back at `AT_HOST`).
///
/// The address is in the device's memory: use it, for `size` bytes, with `dmabuf_rt_memcpy`
/// (as a device side on this SyncedMemory's device) and `dmabuf_rt_memset`, not by
/// dereferencing it. It stays the same until the device memory is replaced (`_set_device_data`,
/// or `_set_host_data` when aliased) or the SyncedMemory is destroyed, and holds the newest
/// data while the head is `AT_DEVICE` or `SYNCED`. Do not write it: use
/// `_mutable_device_data` for that. Stream work using it must have run before the next call on
/// this SyncedMemory and before destroying it. (An aliased SyncedMemory given host memory
/// with `_set_host_data` has that memory as its device view too: then this address is the
/// lent host memory, and copies take it as a host side.)
///
/// # Safety
/// `data` must be NULL (refused) or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_synced_device_data(
    synced: dmabuf_rt_synced,
    data: *mut *const c_void,
) -> dmabuf_rt_status {
    call("dmabuf_rt_synced_device_data", || {
        let data = out(data, "data")?;
        let p = rt()?.with_synced(handle(synced), |_, m| m.device_ptr())?;
        // SAFETY: the caller's contract for `data`.
        unsafe { store(data, p.cast::<c_void>()) };
        Ok(())
    })
}

/// As `dmabuf_rt_synced_device_data`, for reading and writing (Caffe's `mutable_gpu_data()`),
/// then head `AT_DEVICE`: the next host access copies (unless aliased). Write the memory with
/// `dmabuf_rt_memcpy` or `dmabuf_rt_memset`; stream work must have run before the next call on
/// this SyncedMemory.
///
/// # Safety
/// `data` must be NULL (refused) or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_synced_mutable_device_data(
    synced: dmabuf_rt_synced,
    data: *mut *mut c_void,
) -> dmabuf_rt_status {
    call("dmabuf_rt_synced_mutable_device_data", || {
        let data = out(data, "data")?;
        let p = rt()?.with_synced(handle(synced), |_, m| m.mutable_device_ptr())?;
        // SAFETY: the caller's contract for `data`.
        unsafe { store(data, p.cast::<c_void>()) };
        Ok(())
    })
}

/// Lends `size` bytes at `data` as the host memory (Caffe's `set_cpu_data`): head `AT_HOST`,
/// the host view no longer owned. Host memory the SyncedMemory owned is freed now; `data` is
/// never freed by it: it stays the caller's, and transitions write into it when they move data
/// to the host. When aliased, `data` becomes both views (no copies; `_device_data` returns
/// `data`).
///
/// `data` may be pinned host memory from `dmabuf_rt_host_alloc`, unified memory from
/// `dmabuf_rt_unified_alloc` or device memory of this runtime (the whole range inside one
/// block; recognised and reached through its own segment), or any other memory of the
/// process, under the contract below. NULL is refused with `DMABUF_RT_INVALID_POINTER`, as is
/// a range that starts in memory of this runtime and runs past its block. It must not be
/// memory of this SyncedMemory itself (which is freed now): pointers from it before this call
/// are invalid after it.
///
/// # Safety
/// `data` must be valid for reading and writing `size` bytes (`dmabuf_rt_synced_size`) from
/// this call until the SyncedMemory is destroyed or the memory is replaced (another
/// `_set_host_data`, or `_set_device_data` when aliased), and until an asynchronous push from
/// it has run: it must not be freed or unmapped before. Nothing may write it while a call on
/// this SyncedMemory runs or a push from it is in flight; between calls the caller may use it
/// as the pointer `_mutable_host_data` returns (call that first, so the head records a write).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_synced_set_host_data(
    synced: dmabuf_rt_synced,
    data: *mut c_void,
) -> dmabuf_rt_status {
    call("dmabuf_rt_synced_set_host_data", || {
        let rt = rt()?;
        rt.with_synced(handle(synced), |_, m| {
            if data.is_null() {
                return Err(null("data"));
            }
            let size = m.size();
            let mem = match rt.runtime_mem_at(data.cast(), size)? {
                Some(mem) => mem,
                // SAFETY: the caller's contract: `data` is valid for reading and writing `size`
                // bytes for as long as the SyncedMemory (or a push) may use it, which is as long
                // as this range (kept by the SyncedMemory only) is used.
                None => unsafe { Mem::from_raw(data.cast(), size, true)? },
            };
            m.set_host_data(mem)
        })
    })
}

/// Lends `size` bytes of device memory at `data` as the device memory (Caffe's
/// `set_gpu_data`): head `AT_DEVICE`, the device view no longer owned. `data` must lie in the
/// memory of this SyncedMemory's device (from `dmabuf_rt_device_alloc`, or another
/// SyncedMemory's device pointer; the whole range within one live allocation), else
/// `DMABUF_RT_INVALID_POINTER`. Device memory the SyncedMemory owned is freed now (when
/// aliased, that is its one buffer, and `data` becomes both views); `data` is never freed by
/// it: it stays allocated until the caller frees it, which it must not do before destroying
/// the SyncedMemory or replacing the memory. Pointers from it before this call are invalid
/// after it.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_synced_set_device_data(synced: dmabuf_rt_synced, data: *mut c_void) -> dmabuf_rt_status {
    call("dmabuf_rt_synced_set_device_data", || {
        let rt = rt()?;
        rt.with_synced(handle(synced), |device, m| {
            if data.is_null() {
                return Err(null("data"));
            }
            let mem = rt.device(device)?.allocator().mem_at(data.cast(), m.size())?;
            m.set_device_data(mem)
        })
    })
}

/// Queues the host-to-device copy on `stream` (Caffe's `async_gpu_push`) and moves the head to
/// `SYNCED` without waiting: work submitted to `stream` afterwards (a copy or a kernel reading
/// the device pointer) sees the pushed bytes. The head must be `AT_HOST`; when it is `SYNCED`
/// this does nothing. From `UNINITIALIZED` (there is nothing to push) or `AT_DEVICE` (the push
/// would overwrite newer device data) it is refused with `DMABUF_RT_INVALID_ARGUMENT`. An
/// aliased SyncedMemory copies nothing: the head just moves. Any stream may be used; 0 (no
/// stream) is `DMABUF_RT_INVALID_HANDLE`.
///
/// Until the copy has run, every other call on the SyncedMemory except the queries first
/// waits for it (and reports its failure); destroying the SyncedMemory is safe, its memory is
/// freed once the stream has passed the copy. Lent host memory must stay valid until then.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_synced_async_device_push(
    synced: dmabuf_rt_synced,
    stream: dmabuf_rt_stream,
) -> dmabuf_rt_status {
    call("dmabuf_rt_synced_async_device_push", || {
        let rt = rt()?;
        let queue = rt.stream_queue(handle(stream))?;
        rt.with_synced(handle(synced), |_, m| {
            match m.head() {
                Head::AtHost | Head::Synced => {}
                h @ (Head::Uninitialized | Head::AtDevice) => {
                    let why = if h == Head::Uninitialized {
                        "there is no data to push yet"
                    } else {
                        "the device holds newer data, which the push would overwrite"
                    };
                    return Err(invalid(format!(
                        "the head is {} ({why}); an asynchronous push needs the newest data on the host \
                         (DMABUF_RT_HEAD_AT_HOST)",
                        head_cstr(head_value(h)).to_str().unwrap_or("unknown head")
                    )));
                }
            }
            m.async_device_push(&queue)
        })
    })
}
