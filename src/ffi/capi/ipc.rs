//! IPC handles: device memory shared with other processes, as `cudaIpcGetMemHandle`,
//! `cudaIpcOpenMemHandle` and `cudaIpcCloseMemHandle` (see `dmabuf_rt::ipc`).

use super::*;
use crate::ipc::{HANDLE_BYTES, IpcHandle};

/// A handle of device memory another process of the same user can open (64 bytes, to send by
/// any means: a pipe, a file, a pickle). It carries no fd: opening it connects to the process
/// that made it, which must still run.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct dmabuf_rt_ipc_mem_handle {
    /// The handle's bytes.
    pub bytes: [u8; 64],
}

const _: () = assert!(HANDLE_BYTES == 64);

/// Makes a handle for the device allocation that starts at `ptr` (from `dmabuf_rt_device_alloc`
/// on `device`), after the work queued on the device's streams so far. The allocation is held
/// from now on: if it is freed here, its memory is not reused until the process that opens
/// the handle closes it (or exits). A handle opens once. A pointer that is not the start of a
/// live allocation of `device` is refused with `DMABUF_RT_INVALID_POINTER`.
///
/// # Safety
/// `handle` must be NULL (refused) or valid for writing a `dmabuf_rt_ipc_mem_handle`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_ipc_get_mem_handle(
    device: c_int,
    ptr: *mut c_void,
    handle: *mut dmabuf_rt_ipc_mem_handle,
) -> dmabuf_rt_status {
    // SAFETY: the caller's contract, passed on.
    unsafe { get_mem_handle("dmabuf_rt_ipc_get_mem_handle", device, ptr, 0, handle) }
}

/// `dmabuf_rt_ipc_get_mem_handle` without waiting for the device: the work queued on `stream`
/// (a stream of `device`) so far travels with the handle as a fence, and the process that opens
/// it waits for that work (as a CUDA event recorded on the stream), not this one. Work on the
/// device's other streams is not waited for: order it before `stream` (an event) if it writes
/// the memory. Stream 0 is `dmabuf_rt_ipc_get_mem_handle` (the device is synchronized first).
/// Refused, saying why: what `dmabuf_rt_ipc_get_mem_handle` refuses, a stream that is not live
/// (`DMABUF_RT_INVALID_HANDLE`) or of another device (`DMABUF_RT_INVALID_ARGUMENT`), and a
/// stream whose earlier work failed (`DMABUF_RT_FAILED`).
///
/// # Safety
/// `handle` must be NULL (refused) or valid for writing a `dmabuf_rt_ipc_mem_handle`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_ipc_get_mem_handle_on_stream(
    device: c_int,
    ptr: *mut c_void,
    stream: dmabuf_rt_stream,
    handle: *mut dmabuf_rt_ipc_mem_handle,
) -> dmabuf_rt_status {
    // SAFETY: the caller's contract, passed on.
    unsafe { get_mem_handle("dmabuf_rt_ipc_get_mem_handle_on_stream", device, ptr, stream, handle) }
}

/// The body of both: a handle after the device's work (stream 0) or with `stream`'s as a fence.
///
/// # Safety
/// `handle` must be NULL (refused) or valid for writing a `dmabuf_rt_ipc_mem_handle`.
unsafe fn get_mem_handle(
    name: &'static str,
    device: c_int,
    ptr: *mut c_void,
    stream: dmabuf_rt_stream,
    handle: *mut dmabuf_rt_ipc_mem_handle,
) -> dmabuf_rt_status {
    call(name, || {
        let out_handle = out(handle, "handle")?;
        if ptr.is_null() {
            return Err(null("ptr"));
        }
        let rt = rt()?;
        let stream = (stream != 0).then(|| super::handle(stream));
        let h = rt.ipc_get_handle(device_id(rt, device)?, ptr.cast(), stream)?;
        // SAFETY: the caller's contract for `handle`.
        unsafe { store(out_handle, dmabuf_rt_ipc_mem_handle { bytes: h.to_bytes() }) };
        Ok(())
    })
}

/// Opens a handle from `dmabuf_rt_ipc_get_mem_handle` made in another process and stores a
/// pointer to the memory in `*ptr` (once the producer's work it carries as a fence, from
/// `dmabuf_rt_ipc_get_mem_handle_on_stream`, is done): device memory of `device` in this process (copies,
/// memsets and `dmabuf_rt_pointer_device` take it) until `dmabuf_rt_ipc_close_mem_handle`.
/// Writes on either side are seen on the other after synchronization. Refused, saying why: a
/// malformed or forged handle, one already opened (`DMABUF_RT_INVALID_ARGUMENT`), a process
/// that is gone or does not answer within 30 s (`DMABUF_RT_FAILED`). A process in another
/// network namespace is reached through `pidfd_getfd` where the kernel permits it; where it
/// does not, `DMABUF_RT_FAILED`, and the message says what would permit it.
///
/// # Safety
/// `handle` must be NULL (refused) or point to a handle; `ptr` must be NULL (refused) or valid
/// for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_ipc_open_mem_handle(
    device: c_int,
    handle: *const dmabuf_rt_ipc_mem_handle,
    ptr: *mut *mut c_void,
) -> dmabuf_rt_status {
    call("dmabuf_rt_ipc_open_mem_handle", || {
        let ptr = out(ptr, "ptr")?;
        if handle.is_null() {
            return Err(null("handle"));
        }
        // SAFETY: non-null, and the caller's contract says it points to a handle.
        let bytes = unsafe { (*handle).bytes };
        let h = IpcHandle::from_bytes(&bytes)?;
        let rt = rt()?;
        let p = rt.ipc_open(device_id(rt, device)?, &h)?;
        // SAFETY: the caller's contract for `ptr`.
        unsafe { store(ptr, p.cast::<c_void>()) };
        Ok(())
    })
}

/// Closes memory `dmabuf_rt_ipc_open_mem_handle` opened on `device`, after the device's queued
/// work: the process that made the handle may reuse it once every process closed it. Any other
/// pointer, or a second close, is refused with `DMABUF_RT_INVALID_POINTER`. So is the close of
/// memory lent to a SyncedMemory that may still use it (`dmabuf_rt_synced_set_device_data` or
/// `_set_host_data` of memory in the block): destroy the SyncedMemory or lend it other memory
/// first.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_ipc_close_mem_handle(device: c_int, ptr: *mut c_void) -> dmabuf_rt_status {
    call("dmabuf_rt_ipc_close_mem_handle", || {
        let rt = rt()?;
        rt.ipc_close(device_id(rt, device)?, ptr.cast())
    })
}
