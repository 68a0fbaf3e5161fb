//! Expandable segments: one reservation of address space per (queue, pool), grown in
//! [`CHUNK`]s mapped from a memfd. Free pages go back to the kernel per page (a punch) only
//! under pressure or past the trim policy's bound. Address space is mapped before memory is
//! needed: a chunk grown into the reservation shows a sparse part of the memfd, counted as
//! punched until a block over it is handed out. (Large blocks go to page-stitched arenas
//! instead where page stitching is on: `arena.rs`.)
//!
//! This file holds a segment's state ([`ExpState`]: the reservation, the map of punched pages
//! and their arithmetic), the reservation sizing, and the trim policy's arithmetic
//! ([`Budget`]); the pool decides when to grow, punch and trim, and calls in here.

use super::bitmap;
use super::block::{BlockId, SMALL_BUFFER};
use crate::error::{Error, Result};
use crate::segment::Segment;
use crate::source::MemorySource;

/// An expandable segment's growth state.
pub(crate) struct ExpState {
    /// Bytes of reservation; `size` never exceeds it.
    reserved_len: usize,
    /// The punch granularity: the system page size (a memfd's holes are punched per page).
    page: usize,
    /// One bit per page of the mapped part, set while the page is punched (not counted as
    /// reserved). Only pages that lie wholly inside a free block of a pool are punched, and a
    /// block leaves its pool only through the pool's slow path, which counts its pages again
    /// ([`ExpState::back`]).
    holes: Vec<u64>,
    /// How many mapped pages are punched (0: no block needs re-backing).
    punched: usize,
    /// The block that ends at the mapped end.
    pub(crate) tail: Option<BlockId>,
}

impl ExpState {
    /// Punched pages among pages `[from, to)`.
    pub(crate) fn holes_in(&self, from: usize, to: usize) -> usize {
        if self.punched == 0 {
            return 0;
        }
        bitmap::count(&self.holes, from, to)
    }

    /// The backed runs of the first `mapped` bytes, as byte ranges `[start, end)` in order
    /// (what PyTorch reports as an expandable segment's mapped ranges).
    pub(crate) fn backed_runs(&self, mapped: usize) -> Vec<(usize, usize)> {
        let pages = mapped / self.page;
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for p in (0..pages).filter(|&p| self.holes_in(p, p + 1) == 0) {
            match runs.last_mut() {
                Some(last) if last.1 == p * self.page => last.1 += self.page,
                _ => runs.push((p * self.page, (p + 1) * self.page)),
            }
        }
        runs
    }

    /// Marks pages `[from, to)` punched (`hole`) or backed; returns how many changed.
    fn mark(&mut self, from: usize, to: usize, hole: bool) -> usize {
        let changed = bitmap::set(&mut self.holes, from, to, hole);
        if hole {
            self.punched += changed;
        } else {
            self.punched -= changed;
        }
        changed
    }

    /// The start of the shortest range `[start, to)` (not before `from`) that holds `pages`
    /// backed pages, or `from` if `[from, to)` holds fewer.
    fn backed_suffix(&self, from: usize, to: usize, pages: usize) -> usize {
        let mut left = pages;
        let mut end = to;
        if left == 0 {
            return to;
        }
        while end > from {
            let w = (end - 1) / 64;
            let lo = (w * 64).max(from);
            let n = end - lo;
            let mask = if n == 64 { !0 } else { ((1u64 << n) - 1) << (lo % 64) };
            let backed = !self.holes[w] & mask;
            let count = backed.count_ones() as usize;
            if count < left {
                left -= count;
                end = lo;
                continue;
            }
            // The answer is in this word: drop its highest backed pages until `left` are taken.
            let mut bits = backed;
            for _ in 1..left {
                bits &= !(1u64 << (63 - bits.leading_zeros()));
            }
            return w * 64 + (63 - bits.leading_zeros() as usize);
        }
        from
    }

    /// The pages wholly inside bytes `[off, off + len)`: those a free block may give back.
    fn inner_pages(&self, off: usize, len: usize) -> (usize, usize) {
        (off.div_ceil(self.page), (off + len) / self.page)
    }

    /// The pages that bytes `[off, off + len)` touch: those a handed-out block needs.
    pub(crate) fn outer_pages(&self, off: usize, len: usize) -> (usize, usize) {
        (off / self.page, (off + len).div_ceil(self.page))
    }

    /// The state of a reservation just made (nothing mapped yet).
    fn new(seg: &Segment) -> Self {
        // CHUNK is a multiple of every page size Linux uses.
        let page = crate::source::page_size().clamp(1, CHUNK);
        let reserved_len = seg.mapping().map_or(0, crate::mapping::Mapping::reserved_len);
        Self { reserved_len, page, holes: Vec::new(), punched: 0, tail: None }
    }

    /// Bytes of reservation.
    pub(crate) fn reserved_len(&self) -> usize {
        self.reserved_len
    }

    /// The bytes to map so that a free tail of `have` bytes grows to hold `rounded`: whole
    /// chunks.
    pub(crate) fn growth(rounded: usize, have: usize) -> usize {
        rounded.saturating_sub(have).next_multiple_of(CHUNK)
    }

    /// Maps bytes `[mapped, mapped + grow)` of the reservation (one `mmap` of more of the
    /// memfd, which is sparse there): address space only, so its pages count as punched until
    /// a block over them is handed out. The caller checked that they fit in the reservation.
    pub(crate) fn grow(&mut self, seg: &Segment, mapped: usize, grow: usize) -> Result<()> {
        seg.grow_to(mapped, mapped + grow)?;
        self.holes.resize(((mapped + grow) / self.page).div_ceil(64), 0);
        self.mark(mapped / self.page, (mapped + grow) / self.page, true);
        Ok(())
    }

    /// Bytes of the punched pages that bytes `[off, off + len)` touch: what handing them out
    /// adds to the reserved bytes.
    pub(crate) fn punched_bytes(&self, off: usize, len: usize) -> usize {
        let (from, to) = self.outer_pages(off, len);
        self.holes_in(from, to) * self.page
    }

    /// Counts the punched pages that bytes `[off, off + size)` touch as backed again (a block
    /// over them is being handed out; touching them brings them back, with no call to the
    /// source); returns their bytes.
    pub(crate) fn back(&mut self, off: usize, size: usize) -> usize {
        if self.punched == 0 {
            return 0;
        }
        let (from, to) = self.outer_pages(off, size);
        self.mark(from, to, false) * self.page
    }

    /// Gives back at least `want` bytes (or all it has) of the backed pages that a free block
    /// at bytes `[off, off + size)` wholly covers, taken from its end (best fit splits blocks
    /// from the front, so the end is reused last), with one `fallocate(PUNCH_HOLE)`. Returns
    /// where the punched range starts and the bytes released; `None` if there was nothing to
    /// punch or the punch failed.
    pub(crate) fn punch(&mut self, seg: &Segment, off: usize, size: usize, want: u64) -> Option<(usize, usize)> {
        let (from, to) = self.inner_pages(off, size);
        let start = self.punch_start(from, to, want)?;
        seg.punch(start * self.page, (to - start) * self.page).ok()?;
        Some((start * self.page, self.mark(start, to, true) * self.page))
    }

    /// The first page to punch so that at least `want` bytes of the backed pages among
    /// `[from, to)` are given back, the last ones first (`None`: none is backed).
    fn punch_start(&self, from: usize, to: usize, want: u64) -> Option<usize> {
        if to <= from {
            return None;
        }
        let holes = self.holes_in(from, to);
        if holes == to - from {
            return None;
        }
        let pages = want.div_ceil(self.page as u64).min((to - from) as u64) as usize;
        Some(if holes == 0 { to - pages } else { self.backed_suffix(from, to, pages) })
    }

    /// Of `mapped` bytes, those backed (not punched): what the segment counts as reserved.
    pub(crate) fn backed_bytes(&self, mapped: usize) -> usize {
        mapped - self.punched * self.page
    }

    /// Checks the state against the segment's `mapped` bytes and its blocks, `(offset, size,
    /// in use or quick-cached)` in address order: the punched count matches the marks, the map
    /// covers what is mapped, the tail is the last block, and no block in use touches a punched
    /// page.
    pub(crate) fn check(
        &self,
        mapped: usize,
        blocks: &[(BlockId, usize, usize, bool)],
    ) -> std::result::Result<(), String> {
        let pages = mapped / self.page;
        if mapped > self.reserved_len || mapped % CHUNK != 0 {
            return Err(format!("{mapped} bytes mapped of a {}-byte reservation, not whole chunks", self.reserved_len));
        }
        if self.holes.len() * 64 < pages {
            return Err(format!("the hole map covers {} pages of {pages} mapped", self.holes.len() * 64));
        }
        let holes = self.holes_in(0, pages);
        if holes != self.punched {
            return Err(format!("{} punched pages counted, {holes} marked", self.punched));
        }
        let marked: usize = self.holes.iter().map(|w| w.count_ones() as usize).sum();
        if marked != holes {
            return Err(format!("{} pages past the mapped end are marked punched", marked - holes));
        }
        let tail = blocks.last().map(|b| b.0);
        if self.tail != tail {
            return Err(format!("tail {:?}, the last block is {tail:?}", self.tail));
        }
        // Punched pages lie wholly inside free pooled blocks: no page a block in use or in the
        // quick cache touches is punched.
        for &(id, off, size, in_use) in blocks {
            let (f, t) = self.outer_pages(off, size);
            if in_use && self.holes_in(f, t) > 0 {
                return Err(format!("block {id} (in use or cached) touches punched pages"));
            }
        }
        Ok(())
    }
}

/// What reserving an expandable segment came to.
pub(crate) enum Reservation {
    /// A reservation with nothing mapped yet.
    Made(Segment, ExpState),
    /// The source cannot make expandable segments (heaps and GEM objects cannot grow in place).
    Unsupported,
    /// Not even the request's bytes of address space could be reserved.
    Failed(Error),
}

/// Reserves address space for an expandable segment whose first request is `rounded` bytes,
/// [`reservation_len`] of it, or less if the source refuses (`ulimit -v`, valgrind): halved
/// until it fits, never below the request.
pub(crate) fn reserve(source: &dyn MemorySource, allowed: u64, rounded: usize) -> Reservation {
    let floor = rounded.next_multiple_of(CHUNK);
    let mut len = reservation_len(allowed, floor);
    loop {
        match source.reserve_expandable(len) {
            Ok(seg) => {
                let exp = ExpState::new(&seg);
                return Reservation::Made(seg, exp);
            }
            Err(Error::Unsupported { .. }) => return Reservation::Unsupported,
            // Less address space than hoped: ask for less.
            Err(_) if len / 2 >= floor.max(CHUNK) => len = (len / 2).next_multiple_of(CHUNK),
            Err(e) => return Reservation::Failed(e),
        }
    }
}

/// Expandable segments grow in chunks of this size (and give pages back per page).
pub(crate) const CHUNK: usize = 2 << 20;

/// The address space to reserve for an expandable segment whose first request needs `floor`
/// bytes. Memory is counted by backed pages, so a reservation larger than the allowed memory
/// leaves room to grow past holes punched under pressure: four times the allowed memory, at
/// most 256 GiB (so that hundreds of queues, each with a segment per pool, fit in the 128 TiB
/// of a process's address space). Under an address-space limit (`RLIMIT_AS`, `ulimit -v`) it takes at most a quarter
/// of the room left below the limit, so that the rest of the process (and other queues'
/// segments) can still map memory; never less than `floor`.
fn reservation_len(allowed: u64, floor: usize) -> usize {
    reservation_len_within(allowed, floor, address_space_room())
}

/// [`reservation_len`] with `room` bytes of address space left below `RLIMIT_AS` (`None`: no
/// limit).
fn reservation_len_within(allowed: u64, floor: usize, room: Option<u64>) -> usize {
    let mut len = allowed.saturating_mul(4).min(1 << 38);
    if let Some(room) = room {
        len = len.min(room / 4);
    }
    (len as usize).max(floor).max(CHUNK).next_multiple_of(CHUNK)
}

/// Bytes of address space left below this process's `RLIMIT_AS`, if it has one.
pub(crate) fn address_space_room() -> Option<u64> {
    let limit = crate::source::address_space_limit()?;
    let pages: u64 = std::fs::read_to_string("/proc/self/statm").ok()?.split_whitespace().next()?.parse().ok()?;
    Some(limit.saturating_sub(pages.saturating_mul(crate::source::page_size() as u64)))
}

/// Where reserved bytes grow (an expandable segment grows, or a cached block with punched
/// pages is handed out), the trim policy keeps them under `Config::trim_ratio` times the
/// allocated peak by punching free pages first ([`Budget::trim_excess`]); when it punches, it takes them
/// down to this share of that margin (1.025 for a ratio of 1.045), so that it does not run
/// again at the next growth.
const TRIM_LOW_SHARE: f64 = 25.0 / 45.0;

/// The trim policy leaves reserved bytes be within this many bytes above the allocated peak,
/// whatever its ratio: one segment of the small pool ([`SMALL_BUFFER`], 2 MiB, the least a
/// caching allocator reserves for small blocks). A workload of a few MiB whose layout leaves
/// a few free pages here and there would otherwise punch them and fault them in again every
/// step to hold a share of less than that (a KV cache of 1-2 MiB: 125 punches a step).
/// Workloads with an allocated peak above 2 MiB / (ratio - 1) (44 MiB at the default 1.045)
/// are held to the ratio as before.
const TRIM_FLOOR: usize = SMALL_BUFFER;

/// The numbers the trim policy weighs: reserved and allocated bytes, the limit, the ratio.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Budget {
    /// Bytes reserved now (backed pages of every segment).
    pub(crate) reserved: u64,
    /// Of those, the free units of page-stitched arenas out of map credit (`Arena::hungry`):
    /// their wider slack's, which punching the pools' pages would not bring back, so not
    /// counted against the trim policy's bound (they count against the allowed memory).
    pub(crate) arena_free: u64,
    /// Bytes allocated now.
    pub(crate) allocated: u64,
    /// The allocated bytes' peak.
    pub(crate) allocated_peak: u64,
    /// The allowed memory.
    pub(crate) allowed: u64,
    /// `Config::trim_ratio` (0: no trim policy).
    pub(crate) trim_ratio: f64,
}

impl Budget {
    /// How many bytes to punch before the reserved bytes grow by `need` for a request of
    /// `rounded` bytes (0: none): enough to stay within both the trim bound and the allowed
    /// memory.
    pub(crate) fn trim_excess(&self, need: u64, rounded: u64) -> u64 {
        self.over_bound(need, rounded).max(self.over_allowed(need))
    }

    /// How far past the trim policy's bound the reserved bytes would go: the bytes to punch to
    /// bring them down to its low mark (0 while within the bound).
    fn over_bound(&self, need: u64, rounded: u64) -> u64 {
        let after = self.reserved.saturating_sub(self.arena_free) + need;
        let ratio = self.trim_ratio;
        if ratio == 0.0 {
            return 0;
        }
        let allocated = self.allocated + rounded;
        let peak = self.allocated_peak.max(allocated) as f64;
        // Punch down to a low mark, so the next growth does not trim again at once. Never
        // within one small segment of the peak: below the pools' own granularity a share is
        // not worth a call per step (see `TRIM_FLOOR`).
        let floor = TRIM_FLOOR as f64;
        let high = (peak * ratio).max(peak + floor);
        let low = (peak * (1.0 + (ratio - 1.0) * TRIM_LOW_SHARE)).max(peak + floor * TRIM_LOW_SHARE);
        if after as f64 > high { after - low as u64 } else { 0 }
    }

    /// How far past the allowed memory the reserved bytes would go.
    pub(crate) fn over_allowed(&self, need: u64) -> u64 {
        (self.reserved + need).saturating_sub(self.allowed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::SparseSource;

    fn state(pages: usize) -> ExpState {
        ExpState { reserved_len: pages * 4096, page: 4096, holes: vec![0; pages.div_ceil(64)], punched: 0, tail: None }
    }

    /// Issue 9, defect 11: under `RLIMIT_AS` an expandable segment takes at most a quarter of
    /// the room left, never the rest of the address space; otherwise four times the allowed
    /// memory, capped so hundreds of queues fit.
    #[test]
    fn reservations_leave_room_under_an_address_space_limit() {
        const G: u64 = 1 << 30;
        assert_eq!(reservation_len_within(G, CHUNK, None), 4 << 30);
        assert_eq!(reservation_len_within(1 << 40, CHUNK, None), 1 << 38);
        assert_eq!(reservation_len_within(G, CHUNK, Some(2 * G)), (G / 2) as usize);
        // Never less than the request, whatever the room.
        assert_eq!(reservation_len_within(G, 64 << 20, Some(16 << 20)), 64 << 20);
        assert_eq!(reservation_len_within(0, 1, Some(0)), CHUNK);
    }

    #[test]
    fn backed_runs_skip_the_holes() {
        let mut e = state(200);
        assert_eq!(e.backed_runs(200 * 4096), [(0, 200 * 4096)]);
        e.mark(10, 20, true);
        e.mark(64, 130, true);
        e.punched = e.holes_in(0, 200);
        assert_eq!(e.backed_runs(200 * 4096), [(0, 10 * 4096), (20 * 4096, 64 * 4096), (130 * 4096, 200 * 4096)]);
        assert_eq!(e.backed_runs(15 * 4096), [(0, 10 * 4096)]);
    }

    #[test]
    fn marks_count_changes_across_words() {
        let mut e = state(200);
        assert_eq!(e.mark(60, 130, true), 70);
        assert_eq!(e.punched, 70);
        assert_eq!(e.mark(0, 64, true), 60, "pages 60..64 were punched already");
        assert_eq!(e.holes_in(0, 200), 130);
        assert_eq!(e.holes_in(100, 140), 30);
        assert_eq!(e.mark(64, 200, false), 66);
        assert_eq!((e.punched, e.holes_in(0, 200)), (64, 64));
    }

    #[test]
    fn pages_inside_and_touched_by_a_byte_range() {
        let e = state(16);
        // A block from byte 100 to 3 pages + 100: wholly covers pages 1 and 2, touches 0..4.
        assert_eq!(e.inner_pages(100, 3 * 4096), (1, 3));
        assert_eq!(e.outer_pages(100, 3 * 4096), (0, 4));
        assert_eq!(e.inner_pages(0, 4096), (0, 1));
        assert_eq!(e.inner_pages(1, 4096), (1, 1), "no whole page");
    }

    #[test]
    fn punches_take_the_last_backed_pages_first() {
        let mut e = state(128);
        // Nothing punched yet: the last pages.
        assert_eq!(e.punch_start(0, 100, 3 * 4096), Some(97));
        assert_eq!(e.punch_start(0, 100, 1), Some(99), "a byte takes a page");
        assert_eq!(e.punch_start(0, 100, u64::MAX), Some(0), "at most all of them");
        assert_eq!(e.punch_start(5, 5, 4096), None, "no whole page");
        // With holes at 90..100 and 60..70, the three backed pages before them: 87..90.
        e.mark(90, 100, true);
        e.mark(60, 70, true);
        assert_eq!(e.punch_start(0, 100, 3 * 4096), Some(87));
        // Twelve: 78..90; twenty-five: all of 70..90 and then 55..60 (across the hole).
        assert_eq!(e.punch_start(0, 100, 12 * 4096), Some(78));
        assert_eq!(e.punch_start(0, 100, 25 * 4096), Some(55));
        assert_eq!(e.backed_suffix(0, 100, 0), 100);
        // All punched: nothing to do.
        e.mark(0, 100, true);
        assert_eq!(e.punch_start(0, 100, 4096), None);
        assert_eq!(e.backed_bytes(100 * 4096), 0);
    }

    #[test]
    fn a_handed_out_block_backs_the_pages_it_touches() {
        let mut e = state(64);
        e.mark(10, 20, true);
        assert_eq!(e.punched_bytes(12 * 4096 + 8, 4096), 2 * 4096, "touches pages 12 and 13");
        assert_eq!(e.back(12 * 4096 + 8, 4096), 2 * 4096);
        assert_eq!(e.punched, 8);
        assert_eq!(e.back(0, 4096), 0);
    }

    #[test]
    fn growth_is_whole_chunks_of_what_the_tail_lacks() {
        assert_eq!(ExpState::growth(4096, 0), CHUNK);
        assert_eq!(ExpState::growth(CHUNK + 1, 0), 2 * CHUNK);
        assert_eq!(ExpState::growth(3 * CHUNK, CHUNK + 4096), 2 * CHUNK);
        assert_eq!(ExpState::growth(4096, CHUNK), 0);
    }

    #[test]
    fn grow_punch_and_check_on_a_reservation() {
        let Reservation::Made(seg, mut e) = reserve(&SparseSource, 1 << 30, 4096) else {
            panic!("the sparse source reserves address space")
        };
        assert!(e.reserved_len() >= 4 * CHUNK);
        e.grow(&seg, 0, 2 * CHUNK).unwrap();
        e.tail = Some(0);
        e.check(2 * CHUNK, &[(0, 0, 2 * CHUNK, false)]).unwrap();
        assert_eq!(e.backed_bytes(2 * CHUNK), 0, "growth maps address space only");
        assert_eq!(e.back(0, 2 * CHUNK), 2 * CHUNK);
        let page = e.page;
        // One free block over everything: punch three pages' worth from its end.
        let (from, freed) = e.punch(&seg, 0, 2 * CHUNK, 3 * page as u64 - 1).unwrap();
        assert_eq!((from, freed), (2 * CHUNK - 3 * page, 3 * page));
        assert_eq!(e.backed_bytes(2 * CHUNK), 2 * CHUNK - 3 * page);
        e.check(2 * CHUNK, &[(0, 0, 2 * CHUNK, false)]).unwrap();
        // The same block in use over punched pages is a broken invariant.
        assert!(e.check(2 * CHUNK, &[(0, 0, 2 * CHUNK, true)]).is_err());
        assert!(e.check(2 * CHUNK, &[(1, 0, 2 * CHUNK, false)]).is_err(), "wrong tail");
    }

    #[test]
    fn the_trim_policy_punches_down_to_its_low_mark() {
        // In 64 KiB units: a peak of 62.5 MiB, above what the floor covers.
        const K: u64 = 64 << 10;
        let b = Budget {
            reserved: 1000 * K,
            arena_free: 0,
            allocated: 900 * K,
            allocated_peak: 1000 * K,
            allowed: 1 << 40,
            trim_ratio: 1.045,
        };
        // Within the bound (1045): nothing.
        assert_eq!(b.trim_excess(40 * K, 0), 0);
        // 1100 > 1045: down to the low mark, 1025.
        assert_eq!(b.trim_excess(100 * K, 0), 1100 * K - 1025 * K);
        // The request raises the peak it is measured against.
        assert_eq!(b.trim_excess(100 * K, 200 * K), 0);
        // No policy: only the allowed memory counts.
        let off = Budget { trim_ratio: 0.0, allowed: 1050 * K, ..b };
        assert_eq!(off.trim_excess(100 * K, 0), 50 * K);
        assert_eq!(off.over_allowed(10 * K), 0);
        // The arenas' free units are not the trim's to punch: 1100 of which 100 are theirs is
        // within the bound, but they count against the allowed memory all the same.
        assert_eq!(Budget { arena_free: 100 * K, ..b }.trim_excess(100 * K, 0), 0);
        assert_eq!(Budget { arena_free: 100 * K, allowed: 1050 * K, ..b }.trim_excess(100 * K, 0), 50 * K);
    }

    /// Within one small segment (2 MiB) of the peak nothing is punched, whatever the ratio: a
    /// workload of a few MiB does not punch and fault in its pages every step.
    #[test]
    fn the_trim_policy_leaves_a_small_segment_be() {
        const M: u64 = 1 << 20;
        let b = Budget {
            reserved: 10 * M,
            arena_free: 0,
            allocated: 9 * M,
            allocated_peak: 10 * M,
            allowed: 1 << 40,
            trim_ratio: 1.045,
        };
        // 11.9 MiB: past 1.045 times the peak (10.45 MiB), within the floor (12 MiB).
        assert_eq!(b.trim_excess(M * 19 / 10, 0), 0);
        // 12.5 MiB: down to the floor's low mark, 10 MiB + 2 MiB x 25/45.
        let low = 10 * M + (2 * M) as f64 as u64 * 25 / 45;
        let got = b.trim_excess(M * 5 / 2, 0);
        assert!(got.abs_diff(12 * M + M / 2 - low) <= 1, "{got}");
        // Past 44 MiB of peak the ratio's margin is the larger: the floor changes nothing.
        let big = Budget { reserved: 50 * M, allocated_peak: 50 * M, allocated: 50 * M, ..b };
        assert!(big.trim_excess(3 * M, 0) > 0);
        assert_eq!(big.trim_excess(2 * M, 0), 0);
    }
}
