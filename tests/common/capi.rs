#![allow(unsafe_code)]
//! What the C-ABI reviews share (`hostile_review33_capi`, `hostile_review34_capi`): the last
//! error, a status check, streams held at a gate by a callback, SyncedMemories written and read
//! through the C API.

use std::ffi::{CStr, c_int, c_void};
use std::ptr::null_mut;
use std::sync::{Condvar, Mutex};

use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;
use dmabuf_rt::ffi::capi::*;
use dmabuf_rt::ffi::paddle::{
    CDeviceInterface, CustomRuntimeParams, CustomRuntimeVersion, INTERFACE_SIZE, InitPlugin, PARAMS_SIZE,
};

/// The calling thread's last error, or a placeholder.
pub fn last_error() -> String {
    let p = dmabuf_rt_last_error();
    if p.is_null() {
        return "<no last error>".into();
    }
    // SAFETY: a non-null last error is a NUL-terminated string valid until the next failure.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Fails (with the last error) unless `s` is `DMABUF_RT_OK`.
#[track_caller]
pub fn ok(s: dmabuf_rt_status) {
    assert_eq!(s, DMABUF_RT_OK, "call failed: {}", if s == DMABUF_RT_OK { String::new() } else { last_error() });
}

/// A gate a stream callback waits at (futex, no allocation), opened from any thread.
pub struct Gate {
    open: Mutex<bool>,
    cv: Condvar,
}

impl Gate {
    pub fn new() -> &'static Gate {
        Box::leak(Box::new(Gate { open: Mutex::new(false), cv: Condvar::new() }))
    }
    pub fn open(&self) {
        *self.open.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.cv.notify_all();
    }
    pub fn wait(&self) {
        let mut g = self.open.lock().unwrap_or_else(|p| p.into_inner());
        while !*g {
            g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }
}

unsafe extern "C" fn gate_cb(_s: dmabuf_rt_stream, _st: dmabuf_rt_status, user: *mut c_void) {
    // SAFETY: `close_stream` passes a leaked (static) Gate.
    unsafe { &*user.cast::<Gate>() }.wait();
}

/// Holds `stream` at this point until the returned gate opens.
pub fn close_stream(stream: dmabuf_rt_stream) -> &'static Gate {
    let g = Gate::new();
    // SAFETY: gate_cb with a static Gate may run on any thread at any time.
    ok(unsafe { dmabuf_rt_stream_add_callback(stream, Some(gate_cb), (g as *const Gate).cast_mut().cast()) });
    g
}

pub fn new_stream(device: c_int) -> dmabuf_rt_stream {
    let mut s = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_stream_create(device, &mut s) });
    s
}

pub fn synced(device: c_int, size: usize, alias: bool) -> dmabuf_rt_synced {
    let mut s = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_synced_create(device, size, alias, &mut s) });
    s
}

/// `dmabuf_rt_synced_mutable_host_data` of `s`: its status and the host view.
pub fn mutable_host(s: dmabuf_rt_synced) -> (dmabuf_rt_status, *mut c_void) {
    let mut p = null_mut();
    // SAFETY: valid out-pointer.
    let st = unsafe { dmabuf_rt_synced_mutable_host_data(s, &mut p) };
    (st, p)
}

/// `dmabuf_rt_synced_mutable_device_data` of `s`: its status and the device view.
pub fn mutable_device(s: dmabuf_rt_synced) -> (dmabuf_rt_status, *mut c_void) {
    let mut p = null_mut();
    // SAFETY: valid out-pointer.
    let st = unsafe { dmabuf_rt_synced_mutable_device_data(s, &mut p) };
    (st, p)
}

/// The host view for writing, filled with `byte` (the pointer is valid until the next call).
pub fn write_host(s: dmabuf_rt_synced, size: usize, byte: u8) {
    let (st, p) = mutable_host(s);
    ok(st);
    // SAFETY: the host view is valid for `size` bytes until the next call on `s`.
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), byte, size) };
}

pub fn device_ptr(s: dmabuf_rt_synced) -> *mut c_void {
    let mut p: *const c_void = std::ptr::null();
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_synced_device_data(s, &mut p) });
    p.cast_mut()
}

/// `len` bytes of device memory at `p`, read with a synchronous copy.
pub fn read_device(device: c_int, p: *const c_void, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: `out` is valid for `len` bytes.
    ok(unsafe {
        dmabuf_rt_memcpy(device, out.as_mut_ptr().cast(), device, p, len, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0)
    });
    out
}

pub fn stats(device: c_int) -> dmabuf_rt_stats {
    let mut s = dmabuf_rt_stats::default();
    // SAFETY: valid out-pointer.
    ok(unsafe { dmabuf_rt_device_stats(device, &mut s) });
    s
}

/// Paddle's side of loading the plugin: a zeroed interface and params, filled by `InitPlugin`.
/// The params point into the interface (boxed: it stays where it is).
pub fn paddle_plugin() -> (Box<CDeviceInterface>, CustomRuntimeParams) {
    // SAFETY: an all-zero CDeviceInterface is valid (NULL function pointers and data).
    let mut iface: Box<CDeviceInterface> = Box::new(unsafe { std::mem::zeroed() });
    iface.size = INTERFACE_SIZE;
    let mut params = CustomRuntimeParams {
        size: PARAMS_SIZE,
        interface: &mut *iface,
        version: CustomRuntimeVersion { major: 0, minor: 0, patch: 0 },
        device_type: std::ptr::null(),
        sub_device_type: std::ptr::null(),
        pir_default_passes: null_mut(),
        reserved: [0; 32],
    };
    // SAFETY: params and interface are valid and sized as Paddle's.
    unsafe { InitPlugin(&mut params) };
    (iface, params)
}
