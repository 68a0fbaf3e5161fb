//! Blocks tagged at both ends, to catch two live blocks sharing bytes (a free applied twice, a
//! block handed out twice), and the check that an allocator has settled with nothing left.

#![allow(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};

use dmabuf_rt::caching::stats::AGGREGATE;
use dmabuf_rt::caching::{Allocation, CachingAllocator};

/// The next tag (unique in the process).
static TAGS: AtomicU64 = AtomicU64::new(1);

/// Writes a fresh tag at both ends of `n` bytes at `p`; returns it.
pub fn stamp(p: *mut u8, n: usize) -> u64 {
    let t = TAGS.fetch_add(1, Ordering::Relaxed);
    assert!(n >= 16);
    let end = p.wrapping_add(n - 8) as *mut u64;
    // SAFETY: `p` is a live, CPU-mapped block of at least `n` bytes owned by the caller.
    unsafe { (p as *mut u64).write_unaligned(t) };
    // SAFETY: as above (`n >= 16`: the end tag lies inside the block).
    unsafe { end.write_unaligned(!t) };
    t
}

#[track_caller]
pub fn check_stamp(p: *mut u8, n: usize, t: u64, what: &str) {
    let end = p.wrapping_add(n - 8) as *const u64;
    // SAFETY: as in `stamp`.
    let a = unsafe { (p as *const u64).read_unaligned() };
    // SAFETY: as in `stamp`.
    let b = unsafe { end.read_unaligned() };
    assert!(
        a == t && b == !t,
        "{what}: block {p:p} of {n} bytes lost its tag {t} ({a}, {b}): shared with another live block"
    );
}

/// A live RAII block and its tag.
pub struct Live {
    pub a: Allocation,
    pub tag: u64,
}

impl Live {
    pub fn new(a: Allocation) -> Live {
        let tag = stamp(a.as_ptr(), a.len());
        Live { a, tag }
    }
    #[track_caller]
    pub fn check(&self, what: &str) {
        check_stamp(self.a.as_ptr(), self.a.len(), self.tag, what);
    }
}

/// Everything freed: the invariants hold and every current count is 0 (in the aggregate and
/// each pool), allocations equal frees, nothing oversize or in limbo is left.
#[track_caller]
pub fn settled(a: &CachingAllocator, what: &str) {
    a.check_invariants().unwrap_or_else(|e| panic!("{what}: invariants: {e}"));
    let s = a.stats();
    let simple = s.simple();
    assert_eq!(s.allocation[AGGREGATE].current, 0, "{what}: allocations left: {simple:?}");
    assert_eq!(s.allocated_bytes[AGGREGATE].current, 0, "{what}: allocated bytes left: {simple:?}");
    assert_eq!(s.requested_bytes[AGGREGATE].current, 0, "{what}: requested bytes left");
    assert_eq!(s.active[AGGREGATE].current, 0, "{what}: active blocks left");
    assert_eq!(simple.num_allocs, simple.num_frees, "{what}: allocs != frees: {simple:?}");
    assert_eq!(simple.current_allocated, 0, "{what}");
    for pool in 0..3 {
        assert_eq!(s.allocation[pool].current, 0, "{what}: pool {pool}");
        assert_eq!(s.allocated_bytes[pool].current, 0, "{what}: pool {pool}");
        assert_eq!(s.allocation[pool].allocated, s.allocation[pool].freed, "{what}: pool {pool}");
        assert_eq!(s.active_bytes[pool].current, 0, "{what}: pool {pool}");
    }
    assert_eq!(s.oversize_allocations.current, 0, "{what}: oversize allocations left");
    assert_eq!(s.limbo_bytes.current, 0, "{what}: limbo");
}

/// A raw block and its tag (Send: the pointer is only an address into the allocator's memory).
#[derive(Clone, Copy)]
pub struct Raw {
    pub p: usize,
    pub n: usize,
    pub tag: u64,
}

impl Raw {
    pub fn new(p: *mut u8, n: usize) -> Raw {
        Raw { p: p as usize, n, tag: stamp(p, n) }
    }
    #[track_caller]
    pub fn check(&self, what: &str) {
        check_stamp(self.p as *mut u8, self.n, self.tag, what);
    }
}

/// Tags found wrong by queue callbacks ([`check_later`]; a panic there would not fail the test).
pub type Bad = std::sync::Arc<std::sync::Mutex<Vec<String>>>;

/// Queues on `q` a check of `n` bytes at `p` against `tag` (as [`check_stamp`]), recording a
/// mismatch in `bad` instead of panicking on the queue's thread.
pub fn check_later(q: &dmabuf_rt::queue::Queue, p: usize, n: usize, tag: u64, bad: &Bad, what: &'static str) {
    let bad = bad.clone();
    q.callback(move |_| {
        let r = std::panic::catch_unwind(|| check_stamp(p as *mut u8, n, tag, what));
        if let Err(e) = r {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            bad.lock().unwrap().push(msg);
        }
    })
    .unwrap();
}
