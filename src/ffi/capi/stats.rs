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
            limbo_bytes: u(d.limbo_bytes.current),
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
/// `{"device":N,"spec":"...","stats":{...},"trace":[...],"segments":[...]}`, where `stats`
/// uses PyTorch's `memory_stats()` key names, `trace` is the allocator's recent history
/// (`{"t":ns,"action":"alloc"|"free_requested"|"free_completed"|"segment_alloc"|
/// "segment_free"|"segment_map"|"segment_unmap"|"oom"|"invalid_free","addr":A,"size":N,
/// "stream":S}`, oldest first, an OOM's `addr` being the bytes still free; see
/// `dmabuf_rt_record_history`) and `segments` lists each segment with its blocks (PyTorch's
/// `memory_snapshot()` shape, with `is_expandable`; an expandable segment appears as one
/// segment per backed run, so the sizes add up to the reserved bytes). The string belongs to
/// the caller: free it with `dmabuf_rt_string_free` (not `free`).
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
        let a = dev.allocator();
        let (stats, snapshot) = (a.stats().to_json(), a.snapshot().to_json());
        let trace: Vec<String> = a.history().iter().map(|e| e.to_json()).collect();
        // `snapshot` is `{"segments":[...]}`: splice its members after ours.
        let s = format!(
            "{{\"device\":{},\"spec\":{},\"stats\":{stats},\"trace\":[{}],{}",
            id,
            json_str(dev.name()),
            trace.join(","),
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

// ---- PyTorch's DeviceStats ----

/// One statistic, as PyTorch's `Stat`: its value now, its peak (since the start or the last
/// `dmabuf_rt_reset_peak_stats`), and what was added and taken away in total (since the
/// start or the last `dmabuf_rt_reset_accumulated_stats`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct dmabuf_rt_stat {
    /// Now.
    pub current: i64,
    /// Peak of `current`.
    pub peak: i64,
    /// Total added.
    pub allocated: i64,
    /// Total taken away.
    pub freed: i64,
}

/// A statistic for all blocks (`[0]`, PyTorch's `all`), the small pool (`[1]`) and the large
/// pool (`[2]`).
pub type dmabuf_rt_stat_array = [dmabuf_rt_stat; 3];

/// A device's caching-allocator statistics with every field of PyTorch's
/// `c10::CachingDeviceAllocator::DeviceStats` (the same names and meanings), for a framework
/// that reports them as its own.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct dmabuf_rt_memory_stats {
    /// Blocks handed to callers.
    pub allocation: dmabuf_rt_stat_array,
    /// Segments obtained from the memory source.
    pub segment: dmabuf_rt_stat_array,
    /// Blocks allocated or waiting for their deferred free.
    pub active: dmabuf_rt_stat_array,
    /// Free blocks that are parts of split segments.
    pub inactive_split: dmabuf_rt_stat_array,
    /// Bytes handed to callers (block sizes).
    pub allocated_bytes: dmabuf_rt_stat_array,
    /// Bytes obtained from the memory source.
    pub reserved_bytes: dmabuf_rt_stat_array,
    /// Bytes in active blocks.
    pub active_bytes: dmabuf_rt_stat_array,
    /// Bytes in inactive split blocks.
    pub inactive_split_bytes: dmabuf_rt_stat_array,
    /// Bytes callers asked for (unrounded).
    pub requested_bytes: dmabuf_rt_stat_array,
    /// Allocations that had to free cached memory and retry.
    pub num_alloc_retries: i64,
    /// Allocations that failed with out-of-memory.
    pub num_ooms: i64,
    /// Calls that obtained memory from the memory source.
    pub num_device_alloc: i64,
    /// Calls that gave memory back to the memory source.
    pub num_device_free: i64,
    /// Allocations of at least `max_split_size`.
    pub oversize_allocations: dmabuf_rt_stat,
    /// Segments of at least `max_split_size`.
    pub oversize_segments: dmabuf_rt_stat,
    /// The configured `max_split_size` in bytes (`usize::MAX` as the largest `i64`: no limit).
    pub max_split_size: i64,
}

fn c_stat(s: &crate::caching::stats::Stat) -> dmabuf_rt_stat {
    dmabuf_rt_stat { current: s.current, peak: s.peak, allocated: s.allocated, freed: s.freed }
}

fn c_stats(a: &crate::caching::stats::StatArray) -> dmabuf_rt_stat_array {
    [c_stat(&a[0]), c_stat(&a[1]), c_stat(&a[2])]
}

/// Stores every statistic of the device's caching allocator in `*stats` (PyTorch's
/// `DeviceStats`; `dmabuf_rt_device_stats` is the short form).
///
/// # Safety
/// `stats` must be NULL (refused) or valid for writing a `dmabuf_rt_memory_stats`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dmabuf_rt_device_memory_stats(
    device: c_int,
    stats: *mut dmabuf_rt_memory_stats,
) -> dmabuf_rt_status {
    call("dmabuf_rt_device_memory_stats", || {
        let stats = out(stats, "stats")?;
        let rt = rt()?;
        let d = rt.device(device_id(rt, device)?)?.allocator().stats();
        let s = dmabuf_rt_memory_stats {
            allocation: c_stats(&d.allocation),
            segment: c_stats(&d.segment),
            active: c_stats(&d.active),
            inactive_split: c_stats(&d.inactive_split),
            allocated_bytes: c_stats(&d.allocated_bytes),
            reserved_bytes: c_stats(&d.reserved_bytes),
            active_bytes: c_stats(&d.active_bytes),
            inactive_split_bytes: c_stats(&d.inactive_split_bytes),
            requested_bytes: c_stats(&d.requested_bytes),
            num_alloc_retries: d.num_alloc_retries,
            num_ooms: d.num_ooms,
            num_device_alloc: d.num_device_alloc,
            num_device_free: d.num_device_free,
            oversize_allocations: c_stat(&d.oversize_allocations),
            oversize_segments: c_stat(&d.oversize_segments),
            max_split_size: i64::try_from(d.max_split_size).unwrap_or(i64::MAX),
        };
        // SAFETY: the caller's contract for `stats`.
        unsafe { store(stats, s) };
        Ok(())
    })
}

/// Sets the accumulated counts of the device's statistics (`allocated` and `freed` of every
/// statistic, the retry, OOM and source-call counts) to zero. Current values and peaks stay.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_reset_accumulated_stats(device: c_int) -> dmabuf_rt_status {
    call("dmabuf_rt_reset_accumulated_stats", || {
        let rt = rt()?;
        rt.device(device_id(rt, device)?)?.allocator().reset_accumulated_stats();
        Ok(())
    })
}

/// Turns the recording of every allocation and free in the device's allocator history on
/// (`all` true) or off. Segment events and out-of-memory failures are always recorded. The
/// history (its most recent 10,000 events) is the `trace` of `dmabuf_rt_snapshot_json`.
#[unsafe(no_mangle)]
pub extern "C" fn dmabuf_rt_record_history(device: c_int, all: bool) -> dmabuf_rt_status {
    call("dmabuf_rt_record_history", || {
        let rt = rt()?;
        rt.device(device_id(rt, device)?)?.allocator().record_history(all);
        Ok(())
    })
}
