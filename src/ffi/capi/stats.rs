//! Allocator statistics, the caches and snapshots.

use super::*;

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
