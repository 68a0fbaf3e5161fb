//! The library's own C API, declared in `include/dmabuf_rt.h`. The header is generated from
//! this file by cbindgen (`DMABUF_RT_BLESS=1 cargo test --test header` rewrites it; the same
//! test fails when it is out of date), so the `///` docs here are the C documentation.
//!
//! Every function returns a [`dmabuf_rt_status`] (or, for the few that cannot fail, a plain
//! value), checks every pointer and handle it is given, and never unwinds: a failure is
//! logged (see [`crate::ffi`]) and kept for the calling thread ([`dmabuf_rt_last_error`]).

#![allow(non_camel_case_types)]

mod device;
mod ipc;
mod stats;
mod stream;
mod synced;

pub use device::*;
pub use ipc::*;
pub use stats::*;
pub use stream::*;
pub use synced::*;

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
/// `DMABUF_RT_OK`, `dmabuf_rt_last_error()` says why (and the reason was logged, on stderr as
/// `dmabuf-rt: <function>: <why>` unless `DMABUF_RT_LOG=off`). A call refused for bad input (a NULL, foreign or freed
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
    /// Bytes freed here that another process still holds (`dmabuf_rt_ipc_get_mem_handle`):
    /// not reused until it closes them (or exits).
    pub limbo_bytes: u64,
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
