//! SyncedMemory objects (Caffe's host/device mirror) for C.

use super::*;

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
/// `_set_device_data` is never freed: it stays the caller's (and its frees are refused until
/// a push from it still in flight has run). Pointers from it are invalid afterwards. The
/// handle is never valid again: a second destroy, or any use, is `DMABUF_RT_INVALID_HANDLE`.
/// A call on it that another thread is running finishes first; calls that were still waiting
/// for it are refused with `DMABUF_RT_INVALID_HANDLE` and change nothing.
/// Refused with `DMABUF_RT_INVALID_ARGUMENT`, changing nothing, while memory it owns is lent
/// to another live SyncedMemory (its pointer passed to that one's `_set_host_data` or
/// `_set_device_data`), as are the `_set_*_data` calls that would free such memory.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_synced_destroy(synced: dmabuf_rt_synced) -> dmabuf_rt_status {
    call("dmabuf_rt_synced_destroy", || rt()?.destroy_synced(handle(synced)))
}

/// Stores where the newest data is (a `DMABUF_RT_HEAD_*` value) in `*head`. Moves nothing and
/// never waits: like the other queries (`_size`, `_copies`, `_aliased`, `_owns`) it reports the
/// SyncedMemory as of its last call that finished, not waiting for one in progress on another
/// thread (which may itself wait for the stream a callback asking this runs on).
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
        let h = head_value(rt()?.synced_facts(handle(synced))?.head);
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
        let n = rt()?.synced_facts(handle(synced))?.size;
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
        let n = rt()?.synced_facts(handle(synced))?.copies;
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
        let a = rt()?.synced_facts(handle(synced))?.aliased;
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
        let (h, d) = rt()?.synced_facts(handle(synced))?.owns;
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
/// it has run: it must not be freed or unmapped before (`dmabuf_rt_host_free` and
/// `dmabuf_rt_device_free` refuse to free memory of this runtime lent here meanwhile; other
/// memory is the caller's to keep). Nothing may write it while a call on
/// this SyncedMemory runs or a push from it is in flight; between calls the caller may use it
/// as the pointer `_mutable_host_data` returns (call that first, so the head records a write).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_synced_set_host_data(
    synced: dmabuf_rt_synced,
    data: *mut c_void,
) -> dmabuf_rt_status {
    call("dmabuf_rt_synced_set_host_data", || {
        let rt = rt()?;
        rt.lend_to_synced(handle(synced), true, |_, m| {
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
/// memory of this SyncedMemory's device (from `dmabuf_rt_device_alloc`, another
/// SyncedMemory's device pointer, or a block opened on that device from an IPC handle; the
/// whole range within one live allocation or opened block), else `DMABUF_RT_INVALID_POINTER`.
/// Device memory the SyncedMemory owned is freed now (when aliased, that is its one buffer,
/// and `data` becomes both views); `data` is never freed by it: it stays allocated until the
/// caller frees it, which `dmabuf_rt_device_free` refuses (`DMABUF_RT_INVALID_POINTER`) before
/// the SyncedMemory is destroyed or the memory replaced, as `dmabuf_rt_ipc_close_mem_handle`
/// refuses to close an opened block lent here. Pointers from it before this call are invalid
/// after it.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_synced_set_device_data(synced: dmabuf_rt_synced, data: *mut c_void) -> dmabuf_rt_status {
    call("dmabuf_rt_synced_set_device_data", || {
        let rt = rt()?;
        rt.lend_to_synced(handle(synced), false, |device, m| {
            if data.is_null() {
                return Err(null("data"));
            }
            let mem = rt.device_mem(device, data.cast(), m.size())?;
            m.set_device_data(mem)
        })
    })
}

/// Queues the host-to-device copy on `stream` (Caffe's `async_gpu_push`) and moves the head to
/// `SYNCED` without waiting: work submitted to `stream` afterwards (a copy or a kernel reading
/// the device pointer) sees the pushed bytes. The head must be `AT_HOST`; when it is `SYNCED`
/// nothing is copied, but `stream` waits for a push still in flight on another stream (so
/// work submitted to it afterwards sees those bytes too). From `UNINITIALIZED` (there is nothing to push) or `AT_DEVICE` (the push
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
        let stream_device = rt.stream_device(handle(stream))?;
        rt.with_synced(handle(synced), |device, m| {
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
            m.async_device_push(&queue)?;
            if stream_device != device && m.push_in_flight() {
                // A stream of another device writes this device's memory: the memory's device
                // waits for it when synchronized (a synchronous copy or memset of the device
                // pointer, `dmabuf_rt_device_synchronize`), as for work on its own streams.
                rt.device(device)?.track_foreign(queue.record()?);
            }
            Ok(())
        })
    })
}
