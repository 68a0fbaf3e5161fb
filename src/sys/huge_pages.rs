//! Transparent huge pages for the allocator's large host tables (`madvise(MADV_HUGEPAGE)`).
//!
//! A page-stitched arena keeps tables by unit (a free run's tags, the block that starts at a
//! unit), allocated zeroed at once for millions of units and written where runs end: all over
//! the table. With 4 KiB pages every first write there is a page fault, and every scattered
//! read a TLB miss; with 2 MiB pages, a fault zeroes 512 times as much at once and one TLB
//! entry covers it. Where the system's THP mode is `madvise` (Debian's default) the advice is
//! what turns them on; under `always` it changes nothing, under `never` it is ignored.

/// The size of a transparent huge page on x86-64 and arm64 (4 KiB base pages).
const HUGE: usize = 2 << 20;

/// Asks for huge pages under the whole 2 MiB-aligned part of `table`'s memory (none if it
/// holds no aligned 2 MiB). Best effort: a kernel without THP refuses, and nothing changes.
#[cfg(not(miri))]
pub(crate) fn advise<T>(table: &[T]) {
    let start = table.as_ptr() as usize;
    let end = start + std::mem::size_of_val(table);
    let (from, to) = (start.next_multiple_of(HUGE), end & !(HUGE - 1));
    if to <= from {
        return;
    }
    // SAFETY: `[from, to)` lies inside `table`'s memory, which the borrow keeps allocated for
    // the call. MADV_HUGEPAGE changes how the kernel backs the pages, never what they hold or
    // whether they may be accessed: no byte of `table` (or of anything else) changes.
    let r = unsafe { rustix::mm::madvise(from as *mut std::ffi::c_void, to - from, rustix::mm::Advice::LinuxHugepage) };
    if let Err(e) = r {
        log::debug!("madvise(MADV_HUGEPAGE) of a {} MiB table: {e}", (to - from) >> 20);
    }
}

/// Miri cannot make the call; its tables are small.
#[cfg(miri)]
pub(crate) fn advise<T>(_table: &[T]) {}

#[cfg(all(test, not(miri)))]
mod tests {
    use super::*;

    /// The `VmFlags` of the mapping that holds `addr` in `/proc/self/smaps`.
    fn vm_flags(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((a, b)) = range.split_once('-') {
                    if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                        inside = (a..b).contains(&addr);
                        continue;
                    }
                }
            }
            if inside {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return flags.trim().to_string();
                }
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    /// The aligned 2 MiB inside a large table are advised (the kernel marks the mapping `hg`)
    /// and keep every value; a table with no aligned 2 MiB in it is left alone.
    #[test]
    fn the_aligned_part_of_a_large_table_is_advised_and_keeps_its_values() {
        let mut table = vec![0u32; 3 * HUGE];
        for (i, v) in table.iter_mut().enumerate().step_by(4099) {
            *v = i as u32;
        }
        advise(&table);
        assert!(table.iter().enumerate().all(|(i, &v)| v == if i % 4099 == 0 { i as u32 } else { 0 }));
        let inside = (table.as_ptr() as usize).next_multiple_of(HUGE) + 4096;
        let flags = vm_flags(inside);
        println!("VmFlags of the advised part: {flags}");
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
            println!("skipped the flag check: this kernel has no transparent huge pages");
            return;
        }
        assert!(flags.split(' ').any(|f| f == "hg"), "MADV_HUGEPAGE not recorded: {flags}");
        let small = vec![7u8; 4096];
        advise(&small);
        advise(&small[..0]);
        assert!(small.iter().all(|&b| b == 7));
    }
}
