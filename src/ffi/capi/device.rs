//! Devices, their memory, and copies between host and devices.

use super::*;

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

/// `dmabuf_rt_device_alloc` on `stream` (a stream of `device`; 0: none, the same as
/// `dmabuf_rt_device_alloc`): the block belongs to the stream, as a block PyTorch's caching
/// allocator gives on the current stream. Freed with `dmabuf_rt_device_free` (from any thread),
/// it is taken again at once by allocations on that stream, whose work queued before the free
/// (which may still use it) runs first in stream order, and by no other stream's: memory freed
/// while a stream's copy still reads it is never handed to another stream meanwhile. A stream
/// of another device is refused (`DMABUF_RT_INVALID_ARGUMENT`), an unknown one is
/// `DMABUF_RT_INVALID_HANDLE`.
///
/// # Safety
/// `ptr` must be NULL (refused) or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_device_alloc_on_stream(
    device: c_int,
    size: usize,
    stream: dmabuf_rt_stream,
    ptr: *mut *mut c_void,
) -> dmabuf_rt_status {
    call("dmabuf_rt_device_alloc_on_stream", || {
        let ptr = out(ptr, "ptr")?;
        let size = nonzero(size)?;
        let rt = rt()?;
        let device = device_id(rt, device)?;
        let p = match handle(stream) {
            0 => rt.device_alloc(device, size)?,
            s => rt.device_alloc_on(device, size, s)?,
        };
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
/// allocations when it is made. So is a free of a block lent to a live SyncedMemory
/// (`dmabuf_rt_synced_set_device_data`, or `_set_host_data` of device memory): destroy the
/// SyncedMemory or lend it other memory first.
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

/// Frees pinned host memory from `dmabuf_rt_host_alloc`. Any other pointer, NULL, a second
/// free, or a block lent to a live SyncedMemory (`dmabuf_rt_synced_set_host_data`) is refused
/// with `DMABUF_RT_INVALID_POINTER`. Not while a stream may still copy to or
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
/// `dmabuf_rt_stream_synchronize` or an event). Into pinned host memory from
/// `dmabuf_rt_host_alloc`, the block is marked as used by the stream: freeing it before the
/// copy has run is safe (the block is reused, or unmapped, only after the stream passes).
///
/// A NULL `dst` or `src` (with `size` > 0) is refused with `DMABUF_RT_INVALID_POINTER`. A copy
/// of 0 bytes checks the devices, kind and stream, then does nothing.
///
/// # Safety
/// The host side must be valid for `size` bytes: for reading (host-to-device) until this
/// returns; for writing (device-to-host) until the copy has run, that is, until this returns
/// with stream 0, or until the stream has passed the copy. It must not be freed or unmapped
/// before then (pinned host memory from `dmabuf_rt_host_alloc` excepted, see above), and
/// nothing else may write it meanwhile.
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

// ---- what frameworks' allocators need ----

/// Marks the live allocation of `device` that holds `ptr` as used by `stream` (a stream of
/// any device), as PyTorch's `recordStream`: when it is freed, its block is reused only after
/// the stream has passed the point of the free. Without it, a block freed while another
/// stream still reads it could be handed out and overwritten. Refused for a pointer that is
/// not inside a live allocation of `device`, and for stream 0. `ptr` is only compared with
/// the allocator's live blocks, never dereferenced.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_record_stream(
    device: c_int,
    ptr: *mut c_void,
    stream: dmabuf_rt_stream,
) -> dmabuf_rt_status {
    call("dmabuf_rt_record_stream", || {
        let rt = rt()?;
        rt.record_stream(device_id(rt, device)?, ptr.cast(), handle(stream))
    })
}

/// Begins CPU access to `size` bytes of device memory at `ptr` (inside one live allocation
/// of `device`, as for copies), for reading or, with `write`, reading and writing: for a
/// dma-buf, the `DMA_BUF_IOCTL_SYNC` start that makes its pages coherent for the CPU. It
/// does not wait for streams: synchronize first (the device, or the stream that used the
/// range). End it with `dmabuf_rt_cpu_access_end` and the same arguments.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_cpu_access_begin(
    device: c_int,
    ptr: *const c_void,
    size: usize,
    write: bool,
) -> dmabuf_rt_status {
    cpu_access("dmabuf_rt_cpu_access_begin", (device, ptr, size, write), true)
}

/// Ends CPU access begun by `dmabuf_rt_cpu_access_begin` with the same arguments: for a
/// dma-buf, the `DMA_BUF_IOCTL_SYNC` end that hands its pages back to devices.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_cpu_access_end(
    device: c_int,
    ptr: *const c_void,
    size: usize,
    write: bool,
) -> dmabuf_rt_status {
    cpu_access("dmabuf_rt_cpu_access_end", (device, ptr, size, write), false)
}

/// The two ends of the CPU-access bracket, one check of their arguments.
fn cpu_access(
    func: &str,
    (device, ptr, size, write): (c_int, *const c_void, usize, bool),
    begin: bool,
) -> dmabuf_rt_status {
    call(func, || {
        let rt = rt()?;
        rt.cpu_access(device_id(rt, device)?, ptr.cast(), nonzero(size)?, write, begin)
    })
}

/// Stores in `*pinned` whether `ptr` lies inside live pinned host memory from
/// `dmabuf_rt_host_alloc`.
///
/// # Safety
/// `pinned` must be NULL (refused) or valid for writing a `bool`; `ptr` is only compared.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_host_is_pinned(ptr: *const c_void, pinned: *mut bool) -> dmabuf_rt_status {
    call("dmabuf_rt_host_is_pinned", || {
        let pinned = out(pinned, "pinned")?;
        let p = rt()?.host_holds(ptr.cast());
        // SAFETY: the caller's contract for `pinned`.
        unsafe { store(pinned, p) };
        Ok(())
    })
}

/// Stores in `*device` the device whose allocator holds `ptr` (in a live or a cached block:
/// frees and copies check liveness themselves). Refused
/// (`DMABUF_RT_INVALID_POINTER`) if no device's allocator holds it. `ptr` is only compared.
///
/// # Safety
/// `device` must be NULL (refused) or valid for writing an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_pointer_device(ptr: *const c_void, device: *mut c_int) -> dmabuf_rt_status {
    call("dmabuf_rt_pointer_device", || {
        let device = out(device, "device")?;
        let id = rt()?.pointer_device(ptr.cast())?;
        // SAFETY: the caller's contract for `device`.
        unsafe { store(device, id as c_int) };
        Ok(())
    })
}
