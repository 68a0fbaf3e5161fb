//! The PaddlePaddle custom-runtime plugin: `InitPlugin` fills Paddle's `C_DeviceInterface`
//! (custom-device interface 0.1.1, `paddle/phi/backends/device_ext.h`) for device type
//! `dmabuf`, on the process-wide [`runtime`](super::runtime).
//!
//! Put the cdylib (`libdmabuf_rt.so`) in the directory `CUSTOM_DEVICE_ROOT` names; Paddle
//! loads every `*.so` there at import and calls `InitPlugin`. Devices are the runtime's.
//!
//! Paddle's rules this follows (measured with paddlepaddle 3.3.1; see the README):
//! - Any status but `C_SUCCESS` from a callback is a hard error (an `OSError`), except the
//!   query callbacks, where it means "not ready".
//! - Out of memory is `C_SUCCESS` with a NULL pointer: Paddle then frees its cached chunks,
//!   retries, and raises `MemoryError` if that does not help; every other failure is an
//!   error status with the reason logged.
//! - `finalize` runs at exit with memory still allocated; it must not free that memory.
//! - Device pointers Paddle passes to copies may point into the middle of blocks (its own
//!   allocators sub-allocate), so copies resolve them by range.

use std::ffi::{c_char, c_int, c_uchar, c_void};

use super::runtime::{CopyKind, Runtime};
use super::{null, out, run, store};
use crate::error::{Error, ErrorKind, Result};

/// `C_Status`.
pub type CStatus = c_int;
/// Success.
pub const C_SUCCESS: CStatus = 0;
/// Results may not meet expectation (Paddle treats it as an error).
pub const C_WARNING: CStatus = 1;
/// Resource exhausted, or (for queries) not ready.
pub const C_FAILED: CStatus = 2;
/// Invalid argument or wrong usage.
pub const C_ERROR: CStatus = 3;
/// Plugin error.
pub const C_INTERNAL_ERROR: CStatus = 4;

/// The interface version this plugin implements (0.1.1).
pub const VERSION: (usize, usize, usize) = (0, 1, 1);

/// `struct C_Device_st { int id; }`; `C_Device` points to one of Paddle's.
#[repr(C)]
#[derive(Debug)]
pub struct CDeviceSt {
    /// The device id.
    pub id: c_int,
}

/// `C_Device`.
pub type CDevice = *mut CDeviceSt;
/// `C_Stream`: our stream handle, as an opaque pointer.
pub type CStream = *mut c_void;
/// `C_Event`: our event handle, as an opaque pointer.
pub type CEvent = *mut c_void;
/// `C_Callback`.
pub type CCallback = Option<unsafe extern "C" fn(CDevice, CStream, *mut c_void, *mut CStatus)>;

type DevFn = unsafe extern "C" fn(CDevice) -> CStatus;
type AllocFn = unsafe extern "C" fn(CDevice, *mut *mut c_void, usize) -> CStatus;
type FreeFn = unsafe extern "C" fn(CDevice, *mut c_void, usize) -> CStatus;
type CopyFn = unsafe extern "C" fn(CDevice, *mut c_void, *const c_void, usize) -> CStatus;
type P2pFn = unsafe extern "C" fn(CDevice, CDevice, *mut c_void, *const c_void, usize) -> CStatus;
type AsyncCopyFn = unsafe extern "C" fn(CDevice, CStream, *mut c_void, *const c_void, usize) -> CStatus;
type AsyncP2pFn = unsafe extern "C" fn(CDevice, CDevice, CStream, *mut c_void, *const c_void, usize) -> CStatus;
type SizeFn = unsafe extern "C" fn(CDevice, *mut usize) -> CStatus;

/// `C_DeviceInterface`, mirrored field by field up to `device_realloc_size` (the last one we
/// fill); the rest (device properties, collectives, profiler, BLAS, graphs) stays opaque and
/// NULL. Size and offsets are asserted against the wheel's header (tests/paddle).
#[repr(C)]
#[allow(missing_docs)]
pub struct CDeviceInterface {
    pub size: usize,
    pub initialize: Option<unsafe extern "C" fn() -> CStatus>,
    pub finalize: Option<unsafe extern "C" fn() -> CStatus>,
    pub init_device: Option<DevFn>,
    pub set_device: Option<DevFn>,
    pub get_device: Option<DevFn>,
    pub deinit_device: Option<DevFn>,
    pub create_stream: Option<unsafe extern "C" fn(CDevice, *mut CStream) -> CStatus>,
    pub destroy_stream: Option<unsafe extern "C" fn(CDevice, CStream) -> CStatus>,
    pub query_stream: Option<unsafe extern "C" fn(CDevice, CStream) -> CStatus>,
    pub stream_add_callback: Option<unsafe extern "C" fn(CDevice, CStream, CCallback, *mut c_void) -> CStatus>,
    pub create_event: Option<unsafe extern "C" fn(CDevice, *mut CEvent) -> CStatus>,
    pub record_event: Option<unsafe extern "C" fn(CDevice, CStream, CEvent) -> CStatus>,
    pub destroy_event: Option<unsafe extern "C" fn(CDevice, CEvent) -> CStatus>,
    pub query_event: Option<unsafe extern "C" fn(CDevice, CEvent) -> CStatus>,
    pub synchronize_device: Option<DevFn>,
    pub synchronize_stream: Option<unsafe extern "C" fn(CDevice, CStream) -> CStatus>,
    pub synchronize_event: Option<unsafe extern "C" fn(CDevice, CEvent) -> CStatus>,
    pub stream_wait_event: Option<unsafe extern "C" fn(CDevice, CStream, CEvent) -> CStatus>,
    pub reserved_dev_api: [*mut c_void; 8],
    pub device_memory_allocate: Option<AllocFn>,
    pub device_memory_deallocate: Option<FreeFn>,
    pub device_memory_set: Option<unsafe extern "C" fn(CDevice, *mut c_void, c_uchar, usize) -> CStatus>,
    pub host_memory_allocate: Option<AllocFn>,
    pub host_memory_deallocate: Option<FreeFn>,
    pub unified_memory_allocate: Option<AllocFn>,
    pub unified_memory_deallocate: Option<FreeFn>,
    pub memory_copy_h2d: Option<CopyFn>,
    pub memory_copy_d2h: Option<CopyFn>,
    pub memory_copy_d2d: Option<CopyFn>,
    pub memory_copy_p2p: Option<P2pFn>,
    pub async_memory_copy_h2d: Option<AsyncCopyFn>,
    pub async_memory_copy_d2h: Option<AsyncCopyFn>,
    pub async_memory_copy_d2d: Option<AsyncCopyFn>,
    pub async_memory_copy_p2p: Option<AsyncP2pFn>,
    pub reserved_mem_api: [*mut c_void; 8],
    pub get_device_count: Option<unsafe extern "C" fn(*mut usize) -> CStatus>,
    pub get_device_list: Option<unsafe extern "C" fn(*mut usize) -> CStatus>,
    pub device_memory_stats: Option<unsafe extern "C" fn(CDevice, *mut usize, *mut usize) -> CStatus>,
    pub device_min_chunk_size: Option<SizeFn>,
    pub device_max_chunk_size: Option<SizeFn>,
    pub device_max_alloc_size: Option<SizeFn>,
    pub device_extra_padding_size: Option<SizeFn>,
    pub device_init_alloc_size: Option<SizeFn>,
    pub device_realloc_size: Option<SizeFn>,
    /// From `get_compute_capability` (offset 472) to the end: not filled.
    pub rest: [*mut c_void; 82],
}

impl std::fmt::Debug for CDeviceInterface {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CDeviceInterface").field("size", &self.size).finish_non_exhaustive()
    }
}

/// `CustomRuntimeVersion`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct CustomRuntimeVersion {
    pub major: usize,
    pub minor: usize,
    pub patch: usize,
}

/// `CustomRuntimeParams`.
#[repr(C)]
#[allow(missing_docs)]
pub struct CustomRuntimeParams {
    pub size: usize,
    pub interface: *mut CDeviceInterface,
    pub version: CustomRuntimeVersion,
    pub device_type: *const c_char,
    pub sub_device_type: *const c_char,
    pub pir_default_passes: *mut c_void,
    pub reserved: [c_char; 32],
}

impl std::fmt::Debug for CustomRuntimeParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CustomRuntimeParams").field("size", &self.size).field("version", &self.version).finish()
    }
}

/// The byte size of `C_DeviceInterface` in interface 0.1.1.
pub const INTERFACE_SIZE: usize = 1128;
/// The byte size of `CustomRuntimeParams` in interface 0.1.1.
pub const PARAMS_SIZE: usize = 96;
const _: () = assert!(size_of::<CDeviceInterface>() == INTERFACE_SIZE);
const _: () = assert!(size_of::<CustomRuntimeParams>() == PARAMS_SIZE);
const _: () = assert!(size_of::<CustomRuntimeVersion>() == 24);

/// The device type Paddle shows (`paddle.set_device("dmabuf:0")`); static, as Paddle keeps the
/// pointer.
static DEVICE_TYPE: &[u8] = b"dmabuf\0";
static SUB_DEVICE_TYPE: &[u8] = b"v1\0";

/// Every tensor pointer is a multiple of this (see the README for why 512).
pub const MIN_CHUNK: usize = 512;
/// The pool size `naive_best_fit` refills by (and the init/realloc sizes).
pub const MAX_CHUNK: usize = 64 << 20;

/// The status for a result: errors are already logged by `run`.
fn status(r: Result<()>) -> CStatus {
    match r.map_err(|e| e.kind()) {
        Ok(()) => C_SUCCESS,
        Err(ErrorKind::OutOfMemory) => C_FAILED,
        Err(ErrorKind::Failed | ErrorKind::Timeout) => C_INTERNAL_ERROR,
        Err(_) => C_ERROR,
    }
}

/// The device id in a `C_Device`.
///
/// # Safety
/// `dev` is NULL or points to a `C_Device_st`.
unsafe fn dev_id(dev: CDevice) -> Result<usize> {
    if dev.is_null() {
        return Err(null("device"));
    }
    // SAFETY: non-null, and the caller's contract says it points to a C_Device_st.
    let id = unsafe { (*dev).id };
    let count = Runtime::get().map_or(0, |rt| rt.devices().len());
    usize::try_from(id).map_err(|_| Error::NoSuchDevice { id: i64::from(id), count })
}

fn rt() -> Result<&'static Runtime> {
    Runtime::get()
}

/// Checks that Paddle's `dev` names a device of the runtime, for the callbacks that do not
/// otherwise use it (streams and events are handles of their own, host and unified memory
/// belong to no device): a device that does not exist is refused, as everywhere else.
///
/// # Safety
/// As [`dev_id`].
unsafe fn check_dev(dev: CDevice) -> Result<()> {
    // SAFETY: the caller's contract.
    let id = unsafe { dev_id(dev)? };
    rt()?.device(id).map(drop)
}

fn handle(p: *mut c_void, what: &'static str) -> Result<usize> {
    if p.is_null() { Err(null(what)) } else { Ok(p as usize) }
}

/// Paddle's plugin entry point: fills `params` for device type `dmabuf`. Leaves `params`
/// untouched (and logs why) if it is NULL or smaller than interface 0.1.1's.
///
/// # Safety
/// `params` is NULL or points to Paddle's `CustomRuntimeParams`, whose `interface` points to a
/// `C_DeviceInterface` of at least `interface->size` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn InitPlugin(params: *mut CustomRuntimeParams) {
    let _ = run("InitPlugin", || {
        if params.is_null() {
            return Err(null("params"));
        }
        // SAFETY: non-null; Paddle's contract.
        let p = unsafe { &mut *params };
        if p.size < PARAMS_SIZE || p.interface.is_null() {
            return Err(Error::Config {
                what: format!("CustomRuntimeParams of {} bytes (need {PARAMS_SIZE}) or no interface", p.size),
            });
        }
        // SAFETY: non-null; Paddle's contract: it points to its C_DeviceInterface.
        let i = unsafe { &mut *p.interface };
        if i.size < INTERFACE_SIZE {
            return Err(Error::Config {
                what: format!("C_DeviceInterface of {} bytes (need {INTERFACE_SIZE}, interface 0.1.1)", i.size),
            });
        }
        p.version = CustomRuntimeVersion { major: VERSION.0, minor: VERSION.1, patch: VERSION.2 };
        p.device_type = DEVICE_TYPE.as_ptr().cast();
        p.sub_device_type = SUB_DEVICE_TYPE.as_ptr().cast();
        fill(i);
        Ok(())
    });
}

/// Sets every callback we implement.
pub fn fill(i: &mut CDeviceInterface) {
    i.initialize = Some(initialize);
    i.finalize = Some(finalize);
    i.init_device = Some(init_device);
    i.set_device = Some(set_device);
    i.get_device = Some(get_device);
    i.deinit_device = Some(deinit_device);
    i.create_stream = Some(create_stream);
    i.destroy_stream = Some(destroy_stream);
    i.query_stream = Some(query_stream);
    i.stream_add_callback = Some(stream_add_callback);
    i.create_event = Some(create_event);
    i.record_event = Some(record_event);
    i.destroy_event = Some(destroy_event);
    i.query_event = Some(query_event);
    i.synchronize_device = Some(synchronize_device);
    i.synchronize_stream = Some(synchronize_stream);
    i.synchronize_event = Some(synchronize_event);
    i.stream_wait_event = Some(stream_wait_event);
    i.device_memory_allocate = Some(device_memory_allocate);
    i.device_memory_deallocate = Some(device_memory_deallocate);
    i.device_memory_set = Some(device_memory_set);
    i.host_memory_allocate = Some(host_memory_allocate);
    i.host_memory_deallocate = Some(host_memory_deallocate);
    i.unified_memory_allocate = Some(unified_memory_allocate);
    i.unified_memory_deallocate = Some(unified_memory_deallocate);
    i.memory_copy_h2d = Some(memory_copy_h2d);
    i.memory_copy_d2h = Some(memory_copy_d2h);
    i.memory_copy_d2d = Some(memory_copy_d2d);
    i.memory_copy_p2p = Some(memory_copy_p2p);
    i.async_memory_copy_h2d = Some(async_memory_copy_h2d);
    i.async_memory_copy_d2h = Some(async_memory_copy_d2h);
    i.async_memory_copy_d2d = Some(async_memory_copy_d2d);
    i.async_memory_copy_p2p = Some(async_memory_copy_p2p);
    i.get_device_count = Some(get_device_count);
    i.get_device_list = Some(get_device_list);
    i.device_memory_stats = Some(device_memory_stats);
    i.device_min_chunk_size = Some(device_min_chunk_size);
    i.device_max_chunk_size = Some(device_max_chunk_size);
    i.device_max_alloc_size = Some(device_max_alloc_size);
    i.device_extra_padding_size = Some(device_extra_padding_size);
    i.device_init_alloc_size = Some(device_init_alloc_size);
    i.device_realloc_size = Some(device_realloc_size);
}

// ---- device ----

unsafe extern "C" fn initialize() -> CStatus {
    // A runtime that cannot start (a bad DMABUF_RT_DEVICES) is logged and shows no devices:
    // a failing `initialize` makes Paddle exit the process.
    let _ = run("initialize", || rt().map(drop));
    C_SUCCESS
}

unsafe extern "C" fn finalize() -> CStatus {
    let _ = run("finalize", || rt().map(Runtime::finalize));
    C_SUCCESS
}

unsafe extern "C" fn init_device(dev: CDevice) -> CStatus {
    // SAFETY: Paddle passes its C_Device.
    status(run("init_device", || rt()?.set_current(unsafe { dev_id(dev)? })))
}

unsafe extern "C" fn set_device(dev: CDevice) -> CStatus {
    // SAFETY: Paddle passes its C_Device.
    status(run("set_device", || rt()?.set_current(unsafe { dev_id(dev)? })))
}

unsafe extern "C" fn get_device(dev: CDevice) -> CStatus {
    status(run("get_device", || {
        if dev.is_null() {
            return Err(null("device"));
        }
        let id = c_int::try_from(rt()?.current()).map_err(|_| Error::Config { what: "device id overflow".into() })?;
        // SAFETY: non-null; Paddle's C_Device is writable (get_device writes its id).
        unsafe { (*dev).id = id };
        Ok(())
    }))
}

unsafe extern "C" fn deinit_device(dev: CDevice) -> CStatus {
    // SAFETY: Paddle passes its C_Device.
    status(run("deinit_device", || rt()?.device(unsafe { dev_id(dev)? })?.synchronize()))
}

unsafe extern "C" fn synchronize_device(dev: CDevice) -> CStatus {
    // SAFETY: Paddle passes its C_Device.
    status(run("synchronize_device", || rt()?.device(unsafe { dev_id(dev)? })?.synchronize()))
}

unsafe extern "C" fn get_device_count(count: *mut usize) -> CStatus {
    status(run("get_device_count", || {
        let n = rt().map_or(0, |r| r.devices().len());
        // SAFETY: Paddle passes a writable size_t.
        unsafe { store(out(count, "count")?, n) };
        Ok(())
    }))
}

unsafe extern "C" fn get_device_list(list: *mut usize) -> CStatus {
    status(run("get_device_list", || {
        if list.is_null() {
            return Err(null("list"));
        }
        for i in 0..rt().map_or(0, |r| r.devices().len()) {
            // SAFETY: Paddle sizes the array by get_device_count, so entry `i` is in it.
            let slot = unsafe { list.add(i) };
            // SAFETY: as above; the array is Paddle's and writable.
            unsafe { slot.write(i) };
        }
        Ok(())
    }))
}

unsafe extern "C" fn device_memory_stats(dev: CDevice, total: *mut usize, free: *mut usize) -> CStatus {
    status(run("device_memory_stats", || {
        // SAFETY: Paddle passes its C_Device.
        let (t, f) = rt()?.memory_stats(unsafe { dev_id(dev)? })?;
        let (total, free) = (out(total, "total")?, out(free, "free")?);
        // SAFETY: Paddle passes writable size_ts (checked non-null and aligned).
        unsafe { store(total, t as usize) };
        // SAFETY: as above.
        unsafe { store(free, f as usize) };
        Ok(())
    }))
}

fn size_cb(
    name: &'static str,
    dev: CDevice,
    size_out: *mut usize,
    v: impl FnOnce(&Runtime, usize) -> Result<usize>,
) -> CStatus {
    status(run(name, || {
        // SAFETY: Paddle passes its C_Device.
        let id = unsafe { dev_id(dev)? };
        let rt = rt()?;
        // Every hint names a device: one out of range is refused, even where the hint is the
        // same for all devices.
        rt.device(id)?;
        let v = v(rt, id)?;
        // SAFETY: Paddle passes a writable size_t.
        unsafe { store(out(size_out, "size")?, v) };
        Ok(())
    }))
}

unsafe extern "C" fn device_min_chunk_size(dev: CDevice, out: *mut usize) -> CStatus {
    size_cb("device_min_chunk_size", dev, out, |_, _| Ok(MIN_CHUNK))
}

unsafe extern "C" fn device_max_chunk_size(dev: CDevice, out: *mut usize) -> CStatus {
    size_cb("device_max_chunk_size", dev, out, |_, _| Ok(MAX_CHUNK))
}

unsafe extern "C" fn device_max_alloc_size(dev: CDevice, out: *mut usize) -> CStatus {
    size_cb("device_max_alloc_size", dev, out, |r, id| Ok(r.memory_stats(id)?.0 as usize))
}

unsafe extern "C" fn device_extra_padding_size(dev: CDevice, out: *mut usize) -> CStatus {
    size_cb("device_extra_padding_size", dev, out, |_, _| Ok(0))
}

unsafe extern "C" fn device_init_alloc_size(dev: CDevice, out: *mut usize) -> CStatus {
    size_cb("device_init_alloc_size", dev, out, |_, _| Ok(MAX_CHUNK))
}

unsafe extern "C" fn device_realloc_size(dev: CDevice, out: *mut usize) -> CStatus {
    size_cb("device_realloc_size", dev, out, |_, _| Ok(MAX_CHUNK))
}

// ---- memory ----

/// Out of memory is reported Paddle's way: success with a NULL pointer (logged).
fn alloc_cb(name: &'static str, ptr: *mut *mut c_void, f: impl FnOnce(&Runtime) -> Result<*mut u8>) -> CStatus {
    status(run(name, || {
        if ptr.is_null() {
            return Err(null("ptr"));
        }
        let p = match rt().and_then(f) {
            Ok(p) => p,
            Err(e) if e.kind() == ErrorKind::OutOfMemory => {
                super::report(name, &e);
                std::ptr::null_mut()
            }
            Err(e) => return Err(e),
        };
        // SAFETY: non-null; Paddle passes a writable void*.
        unsafe { ptr.write(p.cast()) };
        Ok(())
    }))
}

unsafe extern "C" fn device_memory_allocate(dev: CDevice, ptr: *mut *mut c_void, size: usize) -> CStatus {
    // SAFETY: Paddle passes its C_Device.
    alloc_cb("device_memory_allocate", ptr, |r| r.device_alloc(unsafe { dev_id(dev)? }, size))
}

unsafe extern "C" fn device_memory_deallocate(dev: CDevice, ptr: *mut c_void, size: usize) -> CStatus {
    status(run("device_memory_deallocate", || {
        // SAFETY: Paddle passes its C_Device.
        rt()?.device_free(unsafe { dev_id(dev)? }, ptr.cast(), Some(size))
    }))
}

unsafe extern "C" fn host_memory_allocate(dev: CDevice, ptr: *mut *mut c_void, size: usize) -> CStatus {
    alloc_cb("host_memory_allocate", ptr, |r| {
        // SAFETY: Paddle passes its C_Device.
        unsafe { check_dev(dev)? };
        r.host_alloc(size)
    })
}

unsafe extern "C" fn host_memory_deallocate(_dev: CDevice, ptr: *mut c_void, _size: usize) -> CStatus {
    status(run("host_memory_deallocate", || rt()?.host_free(ptr.cast())))
}

unsafe extern "C" fn unified_memory_allocate(dev: CDevice, ptr: *mut *mut c_void, size: usize) -> CStatus {
    alloc_cb("unified_memory_allocate", ptr, |r| {
        // SAFETY: Paddle passes its C_Device.
        unsafe { check_dev(dev)? };
        r.unified_alloc(size)
    })
}

unsafe extern "C" fn unified_memory_deallocate(_dev: CDevice, ptr: *mut c_void, _size: usize) -> CStatus {
    status(run("unified_memory_deallocate", || rt()?.unified_free(ptr.cast())))
}

unsafe extern "C" fn device_memory_set(dev: CDevice, ptr: *mut c_void, value: c_uchar, size: usize) -> CStatus {
    status(run("device_memory_set", || {
        // SAFETY: Paddle passes its C_Device.
        rt()?.memset(unsafe { dev_id(dev)? }, ptr.cast(), value, size)
    }))
}

/// A copy on `stream` (NULL: synchronous).
///
/// # Safety
/// The runtime's `copy` contract for the host side; `dst_dev`/`src_dev` are Paddle's devices.
unsafe fn copy_cb(
    name: &'static str,
    kind: CopyKind,
    (dst_dev, dst): (CDevice, *mut c_void),
    (src_dev, src): (CDevice, *const c_void),
    size: usize,
    stream: CStream,
) -> CStatus {
    status(run(name, || {
        // SAFETY: Paddle passes its C_Devices.
        let d = unsafe { dev_id(dst_dev)? };
        // SAFETY: as above.
        let s = unsafe { dev_id(src_dev)? };
        let stream = (!stream.is_null()).then_some(stream as usize);
        // SAFETY: the host side is Paddle's buffer, valid for the call (and, for an async
        // d2h, until the stream passes the copy, which Paddle synchronizes before reading).
        unsafe { rt()?.copy(kind, (d, dst.cast()), (s, src.cast()), size, stream) }
    }))
}

unsafe extern "C" fn memory_copy_h2d(dev: CDevice, dst: *mut c_void, src: *const c_void, size: usize) -> CStatus {
    // SAFETY: Paddle's copy contract.
    unsafe { copy_cb("memory_copy_h2d", CopyKind::HostToDevice, (dev, dst), (dev, src), size, std::ptr::null_mut()) }
}

unsafe extern "C" fn memory_copy_d2h(dev: CDevice, dst: *mut c_void, src: *const c_void, size: usize) -> CStatus {
    // SAFETY: Paddle's copy contract.
    unsafe { copy_cb("memory_copy_d2h", CopyKind::DeviceToHost, (dev, dst), (dev, src), size, std::ptr::null_mut()) }
}

unsafe extern "C" fn memory_copy_d2d(dev: CDevice, dst: *mut c_void, src: *const c_void, size: usize) -> CStatus {
    // SAFETY: Paddle's copy contract.
    unsafe { copy_cb("memory_copy_d2d", CopyKind::DeviceToDevice, (dev, dst), (dev, src), size, std::ptr::null_mut()) }
}

unsafe extern "C" fn memory_copy_p2p(
    dst_dev: CDevice,
    src_dev: CDevice,
    dst: *mut c_void,
    src: *const c_void,
    size: usize,
) -> CStatus {
    // SAFETY: Paddle's copy contract.
    unsafe {
        copy_cb("memory_copy_p2p", CopyKind::PeerToPeer, (dst_dev, dst), (src_dev, src), size, std::ptr::null_mut())
    }
}

unsafe extern "C" fn async_memory_copy_h2d(
    dev: CDevice,
    stream: CStream,
    dst: *mut c_void,
    src: *const c_void,
    size: usize,
) -> CStatus {
    // SAFETY: Paddle's copy contract.
    unsafe { copy_cb("async_memory_copy_h2d", CopyKind::HostToDevice, (dev, dst), (dev, src), size, stream) }
}

unsafe extern "C" fn async_memory_copy_d2h(
    dev: CDevice,
    stream: CStream,
    dst: *mut c_void,
    src: *const c_void,
    size: usize,
) -> CStatus {
    // SAFETY: Paddle's copy contract.
    unsafe { copy_cb("async_memory_copy_d2h", CopyKind::DeviceToHost, (dev, dst), (dev, src), size, stream) }
}

unsafe extern "C" fn async_memory_copy_d2d(
    dev: CDevice,
    stream: CStream,
    dst: *mut c_void,
    src: *const c_void,
    size: usize,
) -> CStatus {
    // SAFETY: Paddle's copy contract.
    unsafe { copy_cb("async_memory_copy_d2d", CopyKind::DeviceToDevice, (dev, dst), (dev, src), size, stream) }
}

unsafe extern "C" fn async_memory_copy_p2p(
    dst_dev: CDevice,
    src_dev: CDevice,
    stream: CStream,
    dst: *mut c_void,
    src: *const c_void,
    size: usize,
) -> CStatus {
    // SAFETY: Paddle's copy contract.
    unsafe { copy_cb("async_memory_copy_p2p", CopyKind::PeerToPeer, (dst_dev, dst), (src_dev, src), size, stream) }
}

// ---- streams and events ----

unsafe extern "C" fn create_stream(dev: CDevice, stream: *mut CStream) -> CStatus {
    status(run("create_stream", || {
        // SAFETY: Paddle passes its C_Device.
        let h = rt()?.create_stream(unsafe { dev_id(dev)? })?;
        // SAFETY: Paddle passes a writable C_Stream.
        unsafe { store(out(stream, "stream")?, h as CStream) };
        Ok(())
    }))
}

unsafe extern "C" fn destroy_stream(dev: CDevice, stream: CStream) -> CStatus {
    status(run("destroy_stream", || {
        // SAFETY: Paddle passes its C_Device.
        unsafe { check_dev(dev)? };
        rt()?.destroy_stream(handle(stream, "stream")?)
    }))
}

unsafe extern "C" fn query_stream(dev: CDevice, stream: CStream) -> CStatus {
    let r = run("query_stream", || {
        // SAFETY: Paddle passes its C_Device.
        unsafe { check_dev(dev)? };
        rt()?.query_stream(handle(stream, "stream")?)
    });
    match r {
        Ok(true) => C_SUCCESS,
        Ok(false) => C_FAILED, // not ready
        Err(e) => status(Err(e)),
    }
}

unsafe extern "C" fn synchronize_stream(dev: CDevice, stream: CStream) -> CStatus {
    status(run("synchronize_stream", || {
        if stream.is_null() {
            // SAFETY: Paddle passes its C_Device.
            return rt()?.device(unsafe { dev_id(dev)? })?.synchronize();
        }
        // SAFETY: Paddle passes its C_Device.
        unsafe { check_dev(dev)? };
        rt()?.synchronize_stream(stream as usize)
    }))
}

/// What a stream callback carries to the stream's thread.
struct CallbackArgs {
    callback: unsafe extern "C" fn(CDevice, CStream, *mut c_void, *mut CStatus),
    dev: CDevice,
    stream: CStream,
    user_data: *mut c_void,
}

// SAFETY: Paddle's contract for stream_add_callback: the callback may run on any thread, and
// the device and user data it is given stay valid until it has run (Paddle's device objects
// live for the process, and the user data is the callback's own).
unsafe impl Send for CallbackArgs {}

unsafe extern "C" fn stream_add_callback(
    dev: CDevice,
    stream: CStream,
    callback: CCallback,
    user_data: *mut c_void,
) -> CStatus {
    status(run("stream_add_callback", || {
        // SAFETY: Paddle passes its C_Device.
        unsafe { check_dev(dev)? };
        let callback = callback.ok_or_else(|| null("callback"))?;
        let args = CallbackArgs { callback, dev, stream, user_data };
        rt()?.stream_add_callback(handle(stream, "stream")?, move |r| {
            let args = args;
            let mut st = if r.is_ok() { C_SUCCESS } else { C_ERROR };
            // SAFETY: Paddle's callback contract (see CallbackArgs).
            unsafe { (args.callback)(args.dev, args.stream, args.user_data, &mut st) };
        })
    }))
}

unsafe extern "C" fn create_event(dev: CDevice, event: *mut CEvent) -> CStatus {
    status(run("create_event", || {
        // SAFETY: Paddle passes its C_Device.
        unsafe { check_dev(dev)? };
        let h = rt()?.create_event();
        // SAFETY: Paddle passes a writable C_Event.
        unsafe { store(out(event, "event")?, h as CEvent) };
        Ok(())
    }))
}

unsafe extern "C" fn record_event(dev: CDevice, stream: CStream, event: CEvent) -> CStatus {
    status(run("record_event", || {
        // SAFETY: Paddle passes its C_Device.
        unsafe { check_dev(dev)? };
        // SAFETY: as above.
        let id = unsafe { dev_id(dev)? };
        let stream = (!stream.is_null()).then_some(stream as usize);
        rt()?.record_event(id, stream, handle(event, "event")?)
    }))
}

unsafe extern "C" fn destroy_event(dev: CDevice, event: CEvent) -> CStatus {
    status(run("destroy_event", || {
        // SAFETY: Paddle passes its C_Device.
        unsafe { check_dev(dev)? };
        rt()?.destroy_event(handle(event, "event")?)
    }))
}

unsafe extern "C" fn query_event(dev: CDevice, event: CEvent) -> CStatus {
    let r = run("query_event", || {
        // SAFETY: Paddle passes its C_Device.
        unsafe { check_dev(dev)? };
        rt()?.query_event(handle(event, "event")?)
    });
    match r {
        Ok(true) => C_SUCCESS,
        Ok(false) => C_FAILED, // not ready
        Err(e) => status(Err(e)),
    }
}

unsafe extern "C" fn synchronize_event(dev: CDevice, event: CEvent) -> CStatus {
    status(run("synchronize_event", || {
        // SAFETY: Paddle passes its C_Device.
        unsafe { check_dev(dev)? };
        rt()?.synchronize_event(handle(event, "event")?)
    }))
}

unsafe extern "C" fn stream_wait_event(dev: CDevice, stream: CStream, event: CEvent) -> CStatus {
    status(run("stream_wait_event", || {
        // SAFETY: Paddle passes its C_Device.
        unsafe { check_dev(dev)? };
        rt()?.stream_wait_event(handle(stream, "stream")?, handle(event, "event")?)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    /// The offsets interface 0.1.1's header gives (g++ against the paddlepaddle 3.3.1 wheel's
    /// device_ext.h; tests/paddle/run checks them against the wheel on every CI run).
    #[test]
    fn layout_matches_interface_0_1_1() {
        let want = [
            (offset_of!(CDeviceInterface, initialize), 8),
            (offset_of!(CDeviceInterface, stream_wait_event), 144),
            (offset_of!(CDeviceInterface, reserved_dev_api), 152),
            (offset_of!(CDeviceInterface, device_memory_allocate), 216),
            (offset_of!(CDeviceInterface, async_memory_copy_p2p), 328),
            (offset_of!(CDeviceInterface, reserved_mem_api), 336),
            (offset_of!(CDeviceInterface, get_device_count), 400),
            (offset_of!(CDeviceInterface, device_realloc_size), 464),
            (offset_of!(CDeviceInterface, rest), 472),
            (offset_of!(CustomRuntimeParams, interface), 8),
            (offset_of!(CustomRuntimeParams, version), 16),
            (offset_of!(CustomRuntimeParams, device_type), 40),
            (offset_of!(CustomRuntimeParams, sub_device_type), 48),
            (offset_of!(CustomRuntimeParams, pir_default_passes), 56),
            (offset_of!(CustomRuntimeParams, reserved), 64),
        ];
        for (i, (got, want)) in want.into_iter().enumerate() {
            assert_eq!(got, want, "entry {i}");
        }
    }
}
