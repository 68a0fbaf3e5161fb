//! The 27th hostile review: commits 1a6b7d1 and 2eeb3fa, the one-word `Allocation` (a pointer
//! to a heap record, `caching/record.rs`). Records are recycled under the pool's lock (the
//! pool's spares, at most 16,384, each keeping its strong count of the shared state); a drop
//! that cannot apply its free pushes the record itself onto the shared state's list of dropped
//! records (no count there) for the next lock holder (`shared::drain`), which applies it and
//! keeps the record, counting it again; a block used on other queues (`record_queue`) takes the
//! deferred path (its request node onto the free list, markers on the queues) and its record
//! is freed; the last `CachingAllocator` handle closes the spares.
//!
//! Results on 2eeb3fa: tests 1-7 and 9 pass (also run ten times over); no record was
//! seen reused under a live `Allocation`, no free applied twice or lost, no count let go twice
//! or kept. To show that they can fail, each was run against deliberately broken copies of the
//! library (not committed): a spare kept without its count (`drain_dropped` without
//! `increment_strong_count`: every test crashes or aborts), a reused record's queue not filled
//! in (tests 1, 2 and 6 fail: "a new allocation's queue is not the queue asked for"), records
//! whose queues had all passed kept with their uses (test 2 fails: a block from a reused record
//! waits for the queue of the record's previous block), and pushed records that do not fit in
//! the spares let go without their frees (test 3 fails: 3,616 allocations left), and the
//! owner's short free taken while a gone queue still has blocks (test 9 fails: the gone
//! queue's segment is not given back).
//! Test 8 fails on 2eeb3fa (a hang; older than this design: `ExportHold`'s drop, 398eff7):
//! - `an_ipc_hold_revoked_inside_a_source_callback_does_not_hang`: releasing an IPC hold
//!   (`ipc::revoke_handle`, here from a memory source's `create_segment`, which the pool calls
//!   under its lock) drops an `ExportHold`, whose `Drop` takes the pool's lock with
//!   `PoolLock::lock` (`export.rs`): the thread holds it already, and the std mutex waits for
//!   itself for good. Dropping an `Allocation` or a handle there is handled (the free is
//!   pushed; the last handle leaves the spares to the next drop); a hold is not.
//!
//! Fixed after the review: `ExportHold`'s drop takes the lock as the last handle does
//! (`lock_unless_held_here`, or `try_lock_taking_back` in a forked child) and otherwise pushes
//! `FreeMsg::Unhold` in a node made with the hold; and `PoolLock::lock` on a thread that holds
//! the mutex already panics, saying why, where the std mutex would wait for itself (the
//! reviewer's other finding: `Allocation::offset()` of a stitched block inside a callback).
//!
//! What can go wrong, and where each test looks:
//! - a record reused while an old `Allocation` still points at it: every block here is
//!   [`Seen`], which checks when it is made that its `Allocation` says what was asked (length,
//!   queue, `mem()` length), remembers what it said (pointer, length, offset, queue) and tags
//!   both ends of its bytes; before each drop the `Allocation` must still say the same and the
//!   tags must be there (tests 1-7, 9);
//! - a free applied twice or never: the stats are checked exactly once each race settles
//!   (`settled`: nothing allocated, allocations == frees, invariants), and, while blocks are
//!   live or pending, their counts (allocations, allocated and requested bytes, active blocks,
//!   the snapshot's allocated and pending blocks) against what the test holds (tests 1-7, 9);
//! - a count let go twice or kept: the memory source's own drop is counted ([`Tracked`](common::tracked::Tracked): the
//!   pool owns the source, so it goes exactly when the shared state does): never while an
//!   allocation lives, once after the last handle and allocation (every test);
//! - spares with stale uses: records that went through the deferred path (idle queues: the
//!   dropped list) and were reused must free at once while the queue they were used on is held
//!   (test 2);
//! - bursts past the spares' cap, freed by the owner (kept) and by another thread (pushed, then
//!   drained) (test 3);
//! - records of one allocator dropped inside another's memory-source callback while its last
//!   handle goes on a third thread (test 4);
//! - `Option<Allocation>` slots raced over by several threads, `Vec<Allocation>` batches sent
//!   between threads, `mem::forget` (tests 1, 5);
//! - a memory source that panics (and drops this allocator's blocks under its lock) while
//!   other threads push frees (test 6);
//! - IPC holds (`ipc::get_handle`): a held block freed on another thread goes to limbo and must
//!   not be reused until its hold is revoked, holds revoked while blocks are dropped (test 7);
//!   a hold released inside a memory source's callback (test 8);
//! - queues dropped while their blocks are freed on every path: their segments must all go
//!   back (test 9).

#![allow(unsafe_code)]

mod common;

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Barrier, Mutex, mpsc};
use std::time::Duration;

use common::tags::{check_stamp, settled, stamp};
use common::tracked::{Probe, tracked};
use common::wait::{wait_until, within};
use common::{QueueGate, Rng, become_owner, scaled};
use dmabuf_rt::caching::stats::AGGREGATE;
use dmabuf_rt::caching::{Allocation, BlockState, CachingAllocator};
use dmabuf_rt::queue::{Queue, QueueId};

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;
static LIMIT: std::sync::LazyLock<Duration> =
    std::sync::LazyLock::new(|| Duration::from_secs(90) * common::time_scale());

const CONFIGS: &[&str] = &[
    "expandable_segments:False",
    "expandable_segments:True",
    "expandable_segments:True,page_stitching:True",
    "expandable_segments:True,page_stitching:True,max_split_size_mb:32,garbage_collection_threshold:0.5",
];

/// Sizes the quick cache serves (and, where the arena exists, its home blocks), all multiples
/// of 512 (so a block's allocated bytes are its size).
const SIZES: &[usize] = &[512, 1024, 4 * KB, 8 * KB, 24 * KB, 64 * KB, 256 * KB];

// ---------------------------------------------------------------------------------------------
// A block and what its `Allocation` said when it was made.
// ---------------------------------------------------------------------------------------------

/// An allocation, what its accessors said when it was made, and the tag at both ends of its
/// bytes. A record reused under a live `Allocation` changes what the accessors say; a block
/// handed to two holders loses its tags.
struct Seen {
    a: Allocation,
    ptr: usize,
    len: usize,
    offset: usize,
    queue: Option<QueueId>,
    tag: u64,
}

impl Seen {
    fn new(a: Allocation) -> Seen {
        let (ptr, len, offset, queue) = (a.as_ptr() as usize, a.len(), a.offset(), a.queue());
        assert!(ptr != 0 && len >= 16);
        let tag = stamp(ptr as *mut u8, len);
        Seen { a, ptr, len, offset, queue, tag }
    }

    /// [`Seen::new`] of a block just handed out for `size` bytes on `queue`: what it says must
    /// be what was asked for (a record taken from the spares carries the old block's fields
    /// until it is filled in).
    #[track_caller]
    fn asked(a: Allocation, size: usize, queue: Option<QueueId>) -> Seen {
        assert_eq!(a.len(), size, "a new allocation's len is not the size asked for");
        assert_eq!(a.queue(), queue, "a new allocation's queue is not the queue asked for");
        assert_eq!(a.mem().len(), size, "a new allocation's mem() is not the size asked for");
        Seen::new(a)
    }

    /// Whether the allocation still says what it said and its bytes still hold the tags (for
    /// code where a panic would be caught elsewhere, or to count). Not `offset()`: for a block
    /// of a page-stitched arena it takes the pool's lock, and this runs inside the memory
    /// source's callbacks too (under that lock: it would wait for itself).
    fn intact(&self) -> bool {
        if self.a.as_ptr() as usize != self.ptr || self.a.len() != self.len || self.a.queue() != self.queue {
            return false;
        }
        let (p, n) = (self.ptr as *const u8, self.len);
        // SAFETY: the block is live (this `Seen` owns it) and CPU-mapped, `n >= 16`.
        let h = unsafe { (p as *const u64).read_unaligned() };
        // SAFETY: as above; the end tag lies inside the block.
        let t = unsafe { (p.wrapping_add(n - 8) as *const u64).read_unaligned() };
        h == self.tag && t == !self.tag
    }

    #[track_caller]
    fn check(&self, what: &str) {
        assert_eq!(self.a.as_ptr() as usize, self.ptr, "{what}: as_ptr changed under a live allocation");
        assert_eq!(self.a.len(), self.len, "{what}: len changed under a live allocation");
        assert_eq!(self.a.offset(), self.offset, "{what}: offset changed under a live allocation");
        assert_eq!(self.a.queue(), self.queue, "{what}: queue changed under a live allocation");
        check_stamp(self.ptr as *mut u8, self.len, self.tag, what);
    }

    /// `check`, and the accessors that reach the segment: `mem()` and a CPU view of the block.
    #[track_caller]
    fn check_deep(&self, what: &str) {
        self.check(what);
        assert_eq!(self.a.mem().len(), self.len, "{what}: mem() of another length");
        let v = self.a.cpu_access(dmabuf_rt::Access::Read).unwrap();
        let mut head = [0u8; 8];
        v.read(0, &mut head).unwrap();
        assert_eq!(u64::from_ne_bytes(head), self.tag, "{what}: the CPU view shows another block");
    }
}

/// A block of `size` bytes on `queue` from `a`, checked against what was asked (see
/// [`Seen::asked`]).
#[track_caller]
fn get(a: &CachingAllocator, size: usize, queue: Option<&Queue>) -> Seen {
    Seen::asked(a.allocate(size, queue).unwrap(), size, queue.map(Queue::id))
}

/// Blocks the snapshot shows handed out (allocated) and waiting for other queues (pending).
fn snapshot_counts(a: &CachingAllocator) -> (usize, usize) {
    let snap = a.snapshot();
    let blocks = snap.segments.iter().flat_map(|s| s.blocks.iter());
    let mut n = (0, 0);
    for b in blocks {
        match b.state {
            BlockState::Allocated => n.0 += 1,
            BlockState::PendingFree => n.1 += 1,
            BlockState::Free => {}
        }
    }
    n
}

/// The stats agree with `live` blocks of `bytes` bytes live and `pending` blocks waiting.
#[track_caller]
fn counts_are(a: &CachingAllocator, live: usize, bytes: usize, pending: usize, what: &str) {
    a.check_invariants().unwrap_or_else(|e| panic!("{what}: invariants: {e}"));
    let s = a.stats();
    assert_eq!(s.allocation[AGGREGATE].current, live as i64, "{what}: allocations counted: {:?}", s.simple());
    assert_eq!(s.allocated_bytes[AGGREGATE].current, bytes as i64, "{what}: allocated bytes counted");
    assert_eq!(s.requested_bytes[AGGREGATE].current, bytes as i64, "{what}: requested bytes counted");
    assert_eq!(s.active[AGGREGATE].current, (live + pending) as i64, "{what}: active blocks (live + pending)");
}

/// Drops every block but one (checking each), asserts the pool is still there, then the last,
/// and asserts the pool went with it, once.
#[track_caller]
fn drop_all_then_the_last(mut xs: Vec<Seen>, probe: &Probe, what: &str) {
    assert!(!xs.is_empty());
    let last = xs.remove(0);
    for x in xs {
        x.check(what);
        drop(x);
    }
    assert_eq!(probe.dropped(), 0, "{what}: the pool (its source) went while an allocation was live");
    last.check_deep(what);
    drop(last);
    assert_eq!(probe.dropped(), 1, "{what}: the last allocation went and the pool (its source) did not, or went twice");
}

// ---------------------------------------------------------------------------------------------
// 1. Records recycled across threads. Four threads allocate and free on one allocator: one is
//    the owner (its frees are kept as spares in fast holds), two send their blocks to each
//    other, one at a time (`Option`) and in batches (`Vec`), one keeps a window of live
//    blocks; a fifth polls stats, snapshots, invariants and `empty_cache` all along, and
//    turns the full history on and off (with it on, no free takes the short way). Every
//    block is checked (accessors and tags) by whoever drops it. Then every count is exact,
//    and the pool goes with the last of some blocks kept past the last handle.
// ---------------------------------------------------------------------------------------------
#[test]
fn recycled_records_never_alias_a_live_allocation() {
    within("records across threads", *LIMIT, || {
        let rounds = scaled(24);
        for round in 0..rounds {
            let conf = CONFIGS[round % CONFIGS.len()];
            let what = format!("{conf} round {round}");
            let (a, probe) = tracked(conf);
            let stop = Arc::new(AtomicBool::new(false));
            // The owner, two senders, the receiver, the poller and this thread.
            let go = Arc::new(Barrier::new(6));
            let (one_tx, one_rx) = mpsc::channel::<Option<Seen>>();
            let (batch_tx, batch_rx) = mpsc::channel::<Vec<Seen>>();
            let per = 600u64;
            // A third of the blocks are bound to a queue: records move between queued blocks
            // and host ones.
            let q = Arc::new(Queue::new().unwrap());
            let owner = {
                let (h, go, q) = (a.clone(), go.clone(), q.clone());
                let one_tx = one_tx.clone();
                std::thread::spawn(move || {
                    become_owner(&h);
                    go.wait();
                    let mut rng = Rng(0x51 + round as u64);
                    let mut window: Vec<Seen> = Vec::new();
                    for i in 0..per {
                        let size = SIZES[rng.below(SIZES.len() as u64) as usize];
                        let x = get(&h, size, if i % 3 == 0 { Some(&*q) } else { None });
                        match rng.below(5) {
                            0 => {
                                let _ = one_tx.send(Some(x));
                            }
                            1 | 2 => window.push(x),
                            _ => {
                                x.check("the owner's own block");
                                drop(x);
                            }
                        }
                        if window.len() > 24 {
                            let y = window.swap_remove(rng.below(window.len() as u64) as usize);
                            y.check("the owner's window");
                            drop(y);
                        }
                        if i % 97 == 0 {
                            let _ = one_tx.send(None);
                        }
                    }
                    window
                })
            };
            let senders: Vec<_> = (0..2u64)
                .map(|t| {
                    let (h, go, batch_tx, q) = (a.clone(), go.clone(), batch_tx.clone(), q.clone());
                    std::thread::spawn(move || {
                        go.wait();
                        let mut rng = Rng(0x77 + t * 1000 + round as u64);
                        let mut batch = Vec::new();
                        let mut kept = Vec::new();
                        for i in 0..per {
                            let size = SIZES[rng.below(SIZES.len() as u64) as usize];
                            let x = get(&h, size, if i % 3 == t { Some(&*q) } else { None });
                            match rng.below(4) {
                                0 => kept.push(x),
                                1 => drop(x),
                                _ => batch.push(x),
                            }
                            if batch.len() > rng.below(12) as usize {
                                let _ = batch_tx.send(std::mem::take(&mut batch));
                            }
                            if kept.len() > 16 {
                                let y = kept.swap_remove(0);
                                y.check("a sender's kept block");
                                drop(y);
                            }
                        }
                        let _ = batch_tx.send(batch);
                        kept
                    })
                })
                .collect();
            drop(one_tx);
            drop(batch_tx);
            let receiver = {
                let go = go.clone();
                std::thread::spawn(move || {
                    go.wait();
                    let mut n = 0usize;
                    let mut ones = one_rx.into_iter();
                    for b in batch_rx {
                        for x in b {
                            x.check("a batch sent to another thread");
                            drop(x);
                            n += 1;
                        }
                        if let Some(Some(x)) = ones.next() {
                            x.check_deep("sent alone to another thread");
                            drop(x);
                            n += 1;
                        }
                    }
                    for x in ones.flatten() {
                        x.check("sent alone to another thread");
                        drop(x);
                        n += 1;
                    }
                    n
                })
            };
            let poller = {
                let (h, stop, go) = (a.clone(), stop.clone(), go.clone());
                std::thread::spawn(move || {
                    go.wait();
                    let mut polls = 0usize;
                    // At least once, however late this thread runs.
                    while polls == 0 || !stop.load(SeqCst) {
                        let s = h.stats();
                        assert!(s.allocation[AGGREGATE].current >= 0);
                        assert!(s.active[AGGREGATE].current >= s.allocation[AGGREGATE].current);
                        match polls % 8 {
                            0 => {
                                let (live, pending) = snapshot_counts(&h);
                                assert_eq!(pending, 0, "no deferred free in this test");
                                assert!(live <= 4 * 600, "snapshot shows {live} live blocks");
                            }
                            1 => h.check_invariants().unwrap_or_else(|e| panic!("invariants mid-race: {e}")),
                            // Every event recorded for a while: the quick cache takes no frees,
                            // so every drop goes the long way.
                            3 => h.record_history(true),
                            5 => h.empty_cache(),
                            6 => h.record_history(false),
                            _ => {}
                        }
                        polls += 1;
                        std::thread::yield_now();
                    }
                    polls
                })
            };
            go.wait();
            let mut kept = owner.join().expect("the owner panicked");
            for s in senders {
                kept.extend(s.join().expect("a sender panicked"));
            }
            let received = receiver.join().expect("the receiver panicked");
            stop.store(true, SeqCst);
            let polls = poller.join().expect("the poller panicked");
            assert!(polls > 0 && received > 0, "{what}: the race did not run ({polls} polls, {received} received)");
            for x in &kept {
                x.check_deep(&what);
            }
            let bytes: usize = kept.iter().map(|x| x.len).sum();
            counts_are(&a, kept.len(), bytes, 0, &what);
            assert_eq!(snapshot_counts(&a), (kept.len(), 0), "{what}: the snapshot's live blocks");
            // A few blocks outlive every handle; the rest go first.
            let outlive: Vec<Seen> = kept.drain(..kept.len().min(3)).collect();
            drop(kept);
            counts_are(&a, outlive.len(), outlive.iter().map(|x| x.len).sum(), 0, &what);
            let s = a.stats().simple();
            assert_eq!(s.num_allocs - s.num_frees, outlive.len() as i64, "{what}: allocs - frees: {s:?}");
            drop(a);
            assert_eq!(probe.dropped(), 0, "{what}: the pool went with blocks live");
            drop_all_then_the_last(outlive, &probe, &what);
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 2. Deferred frees (`record_queue`) dropped by the owner (in the middle of its fast-hold
//    frees), on another thread, and in a queue's callback, while the other queue is held by a
//    gate. Until it passes, none of those blocks may be handed out again (the owner keeps
//    allocating their sizes on their queue), and the counts say exactly how many are live
//    and how many wait. Blocks recorded only on idle queues free at once (their records go
//    through the dropped list and become spares): those spares, reused, must not carry the old
//    uses (a block allocated from one and dropped while the gate is still closed must free at
//    once).
// ---------------------------------------------------------------------------------------------
#[test]
fn deferred_frees_are_counted_once_whoever_drops_them_and_spares_forget_their_queues() {
    within("deferred frees", *LIMIT, || {
        for round in 0..scaled(1000) {
            let conf = CONFIGS[round % CONFIGS.len()];
            let what = format!("{conf} round {round}");
            let (a, probe) = tracked(conf);
            become_owner(&a);
            let q1 = Queue::new().unwrap();
            let q2 = Queue::new().unwrap();
            let idle = Queue::new().unwrap();
            let q3 = Queue::new().unwrap();
            let gate = QueueGate::close(&q2);
            // Blocks on q1 used on q2 (held) and, some, on the idle queue and q1 itself too.
            let mut deferred: Vec<Seen> = Vec::new();
            for k in 0..24 {
                let mut x = a.allocate(SIZES[k % 5], Some(&q1)).unwrap();
                x.record_queue(&q2);
                x.record_queue(&q2);
                x.record_queue(&q1);
                if k % 3 == 0 {
                    x.record_queue(&idle);
                }
                deferred.push(Seen::asked(x, SIZES[k % 5], Some(q1.id())));
            }
            // Blocks used only on the idle queue: their frees complete at once.
            let mut idle_used: Vec<Seen> = Vec::new();
            for k in 0..24 {
                let mut x = a.allocate(SIZES[k % 5], Some(&q1)).unwrap();
                x.record_queue(&idle);
                idle_used.push(Seen::asked(x, SIZES[k % 5], Some(q1.id())));
            }
            let addrs: std::collections::HashSet<usize> = deferred.iter().map(|x| x.ptr).collect();
            let bytes_of = |xs: &[Seen]| xs.iter().map(|x| x.len).sum::<usize>();
            let dbytes = bytes_of(&deferred);
            counts_are(&a, 48, dbytes + bytes_of(&idle_used), 0, &what);
            // Drops: 8 by the owner, interleaved with its fast-hold pairs; 8 on another thread;
            // 8 in a callback of a third queue. The idle-used ones by the owner and the other.
            let theirs: Vec<Seen> = deferred.drain(..8).collect();
            let in_callback: Vec<Seen> = deferred.drain(..8).collect();
            let idle_theirs: Vec<Seen> = idle_used.drain(..12).collect();
            let go = Arc::new(Barrier::new(2));
            let other = {
                let go = go.clone();
                std::thread::spawn(move || {
                    go.wait();
                    for (x, y) in theirs.into_iter().zip(idle_theirs) {
                        x.check("a deferred block dropped on another thread");
                        drop(x);
                        y.check("an idle-used block dropped on another thread");
                        drop(y);
                    }
                })
            };
            let bad = Arc::new(AtomicUsize::new(0));
            {
                let bad = bad.clone();
                q3.callback(move |_| {
                    for x in in_callback {
                        if !x.intact() {
                            bad.fetch_add(1, SeqCst);
                        }
                        drop(x);
                    }
                })
                .unwrap();
            }
            go.wait();
            let mut reused = 0usize;
            for (i, x) in deferred.drain(..).chain(idle_used.drain(..)).enumerate() {
                x.check("the owner's drop of a used block");
                drop(x);
                for k in 0..4 {
                    let y = a.allocate(SIZES[(i + k) % 5], Some(&q1)).unwrap();
                    if addrs.contains(&(y.as_ptr() as usize)) {
                        reused += 1;
                    }
                    drop(y);
                    drop(a.allocate(SIZES[k], None).unwrap());
                }
            }
            other.join().expect("the other thread panicked");
            q3.synchronize().unwrap();
            assert_eq!(bad.load(SeqCst), 0, "{what}: a block lost its tag or fields before its callback dropped it");
            assert_eq!(reused, 0, "{what}: a block whose free waits for a held queue was handed out again");
            // 24 wait for q2; nothing else is live.
            counts_are(&a, 0, 0, 24, &what);
            assert_eq!(snapshot_counts(&a), (0, 24), "{what}: the snapshot's live and pending blocks");
            // Spares reused (some went through the dropped list from the idle-used blocks):
            // freed while q2 is still held, and the queue that was idle is now held too, they
            // free at once (no use was recorded for them).
            let idle_gate = QueueGate::close(&idle);
            let fresh: Vec<Seen> = (0..48).map(|k| get(&a, SIZES[k % 5], Some(&q1))).collect();
            for x in &fresh {
                assert!(!addrs.contains(&x.ptr), "{what}: a pending block was handed out again");
            }
            let fb = bytes_of(&fresh);
            counts_are(&a, 48, fb, 24, &what);
            let (first, second): (Vec<Seen>, Vec<Seen>) = fresh.into_iter().partition(|x| x.ptr % 2 == 0);
            let h = a.clone();
            std::thread::spawn(move || {
                for x in first {
                    x.check("a fresh block on another thread");
                }
                drop(h);
            })
            .join()
            .unwrap();
            for x in second {
                x.check("a fresh block");
            }
            counts_are(&a, 0, 0, 24, &format!("{what}: blocks from reused records, freed with q2 still held"));
            idle_gate.open();
            gate.open();
            q2.synchronize().unwrap();
            wait_until("the markers' frees apply", Duration::from_secs(10), || {
                a.stats().active[AGGREGATE].current == 0
            });
            settled(&a, &what);
            drop(a);
            assert_eq!(probe.dropped(), 1, "{what}: the last handle went and the pool stayed");
            drop((q1, q2, q3, idle));
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 3. A burst past the spares' cap (16,384 records): 20,000 blocks freed half by the owner
//    (short frees in fast holds: kept up to the cap) and half by a thread that never holds the
//    lock (the owner's bias refuses its try_lock: every free pushed, then applied and kept by
//    one drain), then 20,000 again from the spares and new records, on both threads at once.
//    The counts are exact after each wave; the pool outlives the handle while one block
//    lives, and goes with it.
// ---------------------------------------------------------------------------------------------
#[test]
fn a_burst_past_the_spare_cap_is_counted_and_reused_exactly() {
    within("spares' cap", *LIMIT, || {
        const N: usize = 20_000;
        for (round, conf) in ["expandable_segments:False", "expandable_segments:True"].iter().enumerate() {
            let what = format!("{conf} round {round}");
            let (a, probe) = tracked(conf);
            become_owner(&a);
            for wave in 0..2 {
                let xs: Vec<Seen> = (0..N).map(|_| get(&a, 512, None)).collect();
                counts_are(&a, N, N * 512, 0, &format!("{what} wave {wave}: allocated"));
                let mut xs = xs;
                let theirs: Vec<Seen> = xs.split_off(N / 2);
                let t = std::thread::spawn(move || {
                    for x in theirs.iter().step_by(97) {
                        x.check("before a pushed drop");
                    }
                    drop(theirs);
                });
                for x in xs.iter().step_by(97) {
                    x.check("before the owner's drop");
                }
                drop(xs);
                t.join().unwrap();
                counts_are(&a, 0, 0, 0, &format!("{what} wave {wave}: freed"));
                // Again, on two threads at once: spares and new records.
                let h = a.clone();
                let t = std::thread::spawn(move || {
                    let ys: Vec<Seen> = (0..N / 4).map(|_| get(&h, 1024, None)).collect();
                    ys
                });
                let mine: Vec<Seen> = (0..N).map(|_| get(&a, 512, None)).collect();
                let theirs = t.join().unwrap();
                counts_are(&a, N + N / 4, N * 512 + N / 4 * 1024, 0, &format!("{what} wave {wave}: again"));
                for x in mine.iter().chain(&theirs) {
                    x.check("a block from the second wave");
                }
                drop(theirs);
                drop(mine);
                settled(&a, &format!("{what} wave {wave}"));
            }
            let x = get(&a, 512, None);
            drop(a);
            assert_eq!(probe.dropped(), 0, "{what}: the pool went with a block live");
            drop_all_then_the_last(vec![x], &probe, &what);
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 4. Records of allocator A dropped on every kind of path while A's last handle goes on
//    another thread, and some inside allocator B's memory-source callback (B's lock held) on
//    a thread that keeps B busy making segments; B's own blocks race on two threads. A's pool
//    must outlive every one of its blocks and go exactly once; B must settle exactly.
// ---------------------------------------------------------------------------------------------
#[test]
fn records_cross_allocators_while_a_last_handle_goes_and_another_allocator_is_busy() {
    within("two allocators", *LIMIT, || {
        for round in 0..scaled(600) {
            let what = format!("round {round}");
            let (a, pa) = tracked(CONFIGS[round % CONFIGS.len()]);
            let (b, pb) = tracked("expandable_segments:False");
            if round % 2 == 0 {
                become_owner(&a);
            }
            // A's blocks for B's callback to drop, for a thread to drop, and for A's owner.
            let for_hook: Arc<Mutex<Vec<Seen>>> = Arc::new(Mutex::new(Vec::new()));
            let hook_bad = Arc::new(AtomicUsize::new(0));
            let hook_dropped = Arc::new(AtomicUsize::new(0));
            {
                let (v, bad, n) = (for_hook.clone(), hook_bad.clone(), hook_dropped.clone());
                pb.set_hook(move || {
                    let taken: Vec<Seen> = {
                        let mut g = v.lock().unwrap();
                        let k = g.len().min(6);
                        g.drain(..k).collect()
                    };
                    for x in taken {
                        if !x.intact() {
                            bad.fetch_add(1, SeqCst);
                        }
                        drop(x);
                        n.fetch_add(1, SeqCst);
                    }
                });
            }
            let mut mine: Vec<Seen> = Vec::new();
            let mut to_thread: Vec<Seen> = Vec::new();
            for k in 0..60 {
                let x = get(&a, SIZES[k % SIZES.len()], None);
                match k % 3 {
                    0 => for_hook.lock().unwrap().push(x),
                    1 => to_thread.push(x),
                    _ => mine.push(x),
                }
            }
            for k in 0..16 {
                drop(a.allocate(SIZES[k % 5], None).unwrap());
            }
            let last_a = a.clone();
            drop(a);
            let go = Arc::new(Barrier::new(5));
            let stop_b = Arc::new(AtomicBool::new(false));
            let b_busy = {
                let (b, go, stop) = (b.clone(), go.clone(), stop_b.clone());
                std::thread::spawn(move || {
                    become_owner(&b);
                    go.wait();
                    let mut made = 0usize;
                    while !stop.load(SeqCst) || made < 4 {
                        // A size the cache has not got: a new segment (the hook runs), then
                        // given back so the next one needs the source again.
                        let x = get(&b, 3 * MB + 512 * (made % 7 + 1), None);
                        x.check("B's big block");
                        drop(x);
                        b.empty_cache();
                        made += 1;
                    }
                    made
                })
            };
            let b_other = {
                let (b, go) = (b.clone(), go.clone());
                std::thread::spawn(move || {
                    go.wait();
                    let mut rng = Rng(3 + round as u64);
                    let mut kept = Vec::new();
                    for _ in 0..400 {
                        let x = get(&b, SIZES[rng.below(5) as usize], None);
                        if rng.below(2) == 0 {
                            kept.push(x);
                        }
                        if kept.len() > 8 {
                            kept.swap_remove(0).check("B's kept block");
                        }
                    }
                    for x in &kept {
                        x.check("B's kept block at the end");
                    }
                })
            };
            let a_dropper = {
                let go = go.clone();
                std::thread::spawn(move || {
                    go.wait();
                    for x in to_thread {
                        x.check("A's block on another thread");
                        drop(x);
                    }
                })
            };
            let a_last = {
                let go = go.clone();
                std::thread::spawn(move || {
                    go.wait();
                    drop(last_a);
                })
            };
            go.wait();
            // A's remaining blocks go from here, while the others run.
            let keep = mine.pop().unwrap();
            for x in mine {
                x.check("A's block on the main thread");
                drop(x);
            }
            a_dropper.join().unwrap();
            a_last.join().unwrap();
            wait_until("B's callback drops A's blocks", Duration::from_secs(20), || {
                for_hook.lock().unwrap().is_empty()
            });
            stop_b.store(true, SeqCst);
            let made = b_busy.join().expect("B's busy thread panicked");
            b_other.join().expect("B's other thread panicked");
            pb.clear_hook();
            assert!(made >= 4, "{what}: B made {made} segments");
            assert_eq!(hook_dropped.load(SeqCst), 20, "{what}: every block given to B's callback was dropped there");
            assert_eq!(hook_bad.load(SeqCst), 0, "{what}: an A block changed before B's callback dropped it");
            drop_all_then_the_last(vec![keep], &pa, &what);
            settled(&b, &format!("{what}: B"));
            assert_eq!(pb.dropped(), 0, "{what}: B went with a handle live");
            drop(b);
            assert_eq!(pb.dropped(), 1, "{what}: B's last handle went and its pool stayed");
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 5. `Option<Allocation>` slots that several threads race over (each takes what is there,
//    checks and drops it, or puts a new one in), and `mem::forget` of some blocks. Every block
//    is dropped at most once (the tags), the forgotten ones stay counted as allocated with
//    their exact bytes, and they keep the pool (and their bytes) after every handle goes.
//    (`mem::forget` itself in the first rounds, whose pools then stay for good; later rounds
//    withhold the drops in `ManuallyDrop` instead, and make them at the end: the pool must go
//    with the last one, and the test keeps few fds.)
// ---------------------------------------------------------------------------------------------
#[test]
fn option_slots_raced_over_and_forgotten_records_stay_exact() {
    within("slots and forget", *LIMIT, || {
        for round in 0..scaled(300) {
            let conf = CONFIGS[round % CONFIGS.len()];
            let what = format!("{conf} round {round}");
            let (a, probe) = tracked(conf);
            let slots: Arc<Vec<Mutex<Option<Seen>>>> = Arc::new((0..48).map(|_| Mutex::new(None)).collect());
            let go = Arc::new(Barrier::new(4));
            let workers: Vec<_> = (0..4u64)
                .map(|t| {
                    let (h, slots, go) = (a.clone(), slots.clone(), go.clone());
                    std::thread::spawn(move || {
                        if t == 0 {
                            become_owner(&h);
                        }
                        go.wait();
                        let mut rng = Rng(0x1234 + t * 77 + round as u64);
                        let mut forgotten: Vec<(usize, usize, u64)> = Vec::new();
                        let mut withheld: Vec<std::mem::ManuallyDrop<Seen>> = Vec::new();
                        let (mut made, mut dropped) = (0usize, 0usize);
                        for _ in 0..1500 {
                            let i = rng.below(slots.len() as u64) as usize;
                            let old = slots[i].lock().unwrap().take();
                            match old {
                                Some(x) => {
                                    x.check("a block taken from a slot");
                                    if rng.below(50) == 0 {
                                        forgotten.push((x.ptr, x.len, x.tag));
                                        if round < 6 {
                                            std::mem::forget(x);
                                        } else {
                                            withheld.push(std::mem::ManuallyDrop::new(x));
                                        }
                                    } else {
                                        drop(x);
                                        dropped += 1;
                                    }
                                }
                                None => {
                                    let size = SIZES[rng.below(SIZES.len() as u64) as usize];
                                    let x = get(&h, size, None);
                                    made += 1;
                                    // Another thread may have filled the slot meanwhile: whatever
                                    // was there is dropped here.
                                    if let Some(y) = slots[i].lock().unwrap().replace(x) {
                                        y.check("a block replaced in a slot");
                                        drop(y);
                                        dropped += 1;
                                    }
                                }
                            }
                        }
                        (forgotten, withheld, made, dropped)
                    })
                })
                .collect();
            let mut forgotten = Vec::new();
            let mut withheld = Vec::new();
            let (mut made, mut dropped) = (0, 0);
            for w in workers {
                let (f, wh, m, d) = w.join().expect("a worker panicked");
                forgotten.extend(f);
                withheld.extend(wh);
                made += m;
                dropped += d;
            }
            let left: Vec<Seen> = slots.iter().filter_map(|s| s.lock().unwrap().take()).collect();
            assert_eq!(made, dropped + forgotten.len() + left.len(), "{what}: blocks made, dropped, forgotten, left");
            let fbytes: usize = forgotten.iter().map(|f| f.1).sum();
            let lbytes: usize = left.iter().map(|x| x.len).sum();
            counts_are(&a, forgotten.len() + left.len(), fbytes + lbytes, 0, &what);
            for x in left {
                x.check_deep("left in a slot");
            }
            counts_are(&a, forgotten.len(), fbytes, 0, &format!("{what}: only the forgotten left"));
            let s = a.stats().simple();
            assert_eq!(s.num_allocs - s.num_frees, forgotten.len() as i64, "{what}: allocs - frees");
            drop(a);
            if forgotten.is_empty() {
                assert_eq!(probe.dropped(), 1, "{what}: nothing forgotten, no handle: the pool stayed");
            } else {
                assert_eq!(probe.dropped(), 0, "{what}: the pool went with forgotten blocks' counts");
                for &(p, n, tag) in &forgotten {
                    check_stamp(p as *mut u8, n, tag, "a forgotten block after the last handle");
                }
                if !withheld.is_empty() {
                    let xs: Vec<Seen> = withheld.into_iter().map(std::mem::ManuallyDrop::into_inner).collect();
                    drop_all_then_the_last(xs, &probe, &format!("{what}: the withheld drops, made at last"));
                }
            }
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 6. A memory source whose callback (under the pool's lock, on whichever thread needs a
//    segment) drops this allocator's blocks, given to it by other threads, and panics every
//    other time, while two threads allocate and push frees. The pool stays consistent,
//    settles exactly, and goes with its last handle.
// ---------------------------------------------------------------------------------------------
#[test]
fn a_panicking_source_that_drops_blocks_under_the_lock_while_frees_are_pushed() {
    within("panicking source", *LIMIT, || {
        for round in 0..scaled(200) {
            let conf = CONFIGS[round % CONFIGS.len()];
            let what = format!("{conf} round {round}");
            let (a, probe) = tracked(conf);
            let victims: Arc<Mutex<Vec<Seen>>> = Arc::new(Mutex::new(Vec::new()));
            let calls = Arc::new(AtomicUsize::new(0));
            let inside = Arc::new(AtomicUsize::new(0));
            let bad = Arc::new(AtomicUsize::new(0));
            {
                let (v, calls, inside, bad) = (victims.clone(), calls.clone(), inside.clone(), bad.clone());
                probe.set_hook(move || {
                    let taken = std::mem::take(&mut *v.lock().unwrap());
                    for x in taken {
                        if !x.intact() {
                            bad.fetch_add(1, SeqCst);
                        }
                        drop(x);
                        inside.fetch_add(1, SeqCst);
                    }
                    if calls.fetch_add(1, SeqCst) % 2 == 1 {
                        panic!("hostile source: create_segment panicked (expected)");
                    }
                });
            }
            let go = Arc::new(Barrier::new(3));
            let stop = Arc::new(AtomicBool::new(false));
            let pushers: Vec<_> = (0..2u64)
                .map(|t| {
                    let (h, v, go, stop) = (a.clone(), victims.clone(), go.clone(), stop.clone());
                    std::thread::spawn(move || {
                        go.wait();
                        let mut rng = Rng(99 + t + round as u64);
                        let mut kept: Vec<Seen> = Vec::new();
                        let mut i = 0usize;
                        while !stop.load(SeqCst) || i < 200 {
                            // The source's callback may run (and panic) on this thread too.
                            let size = SIZES[rng.below(5) as usize];
                            let Ok(x) = std::panic::catch_unwind(AssertUnwindSafe(|| h.allocate(size, None))) else {
                                continue;
                            };
                            let x = Seen::asked(x.unwrap(), size, None);
                            match rng.below(4) {
                                0 => v.lock().unwrap().push(x),
                                1 => kept.push(x),
                                _ => drop(x),
                            }
                            if kept.len() > 12 {
                                kept.swap_remove(0).check("a pusher's kept block");
                            }
                            i += 1;
                        }
                        kept
                    })
                })
                .collect();
            go.wait();
            let mut panics = 0;
            for i in 0..10 {
                a.empty_cache();
                let q = Queue::new().unwrap();
                let big = (5 + i) * MB + 4 * KB;
                match std::panic::catch_unwind(AssertUnwindSafe(|| a.allocate(big, Some(&q)))) {
                    Ok(Ok(x)) => {
                        let x = Seen::asked(x, big, Some(q.id()));
                        x.check_deep(&what);
                        drop(x);
                    }
                    Ok(Err(e)) => panic!("{what}: allocate({big}) failed: {e}"),
                    Err(_) => panics += 1,
                }
                drop(q);
            }
            stop.store(true, SeqCst);
            let mut kept = Vec::new();
            for p in pushers {
                kept.extend(p.join().expect("a pusher panicked"));
            }
            probe.clear_hook();
            assert!(panics > 0, "{what}: the source never panicked");
            assert_eq!(bad.load(SeqCst), 0, "{what}: a block changed before the callback dropped it");
            let left = std::mem::take(&mut *victims.lock().unwrap());
            kept.extend(left);
            for x in &kept {
                x.check_deep(&what);
            }
            counts_are(&a, kept.len(), kept.iter().map(|x| x.len).sum(), 0, &what);
            drop(kept);
            settled(&a, &what);
            assert!(inside.load(SeqCst) > 0, "{what}: no block was dropped inside the callback");
            drop(a);
            assert_eq!(probe.dropped(), 1, "{what}: the last handle went and the pool stayed");
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 7. IPC holds (`ipc::get_handle`) on blocks dropped on other threads (limbo: their frees wait
//    for the holds), revoked on a third thread while the owner allocates the same sizes: a
//    block in limbo must not be handed out again, and once every hold is revoked the counts
//    are exact (no limbo left, nothing allocated).
// ---------------------------------------------------------------------------------------------
#[test]
fn ipc_holds_revoked_while_their_blocks_are_dropped_elsewhere() {
    within("ipc holds", *LIMIT, || {
        for round in 0..scaled(600) {
            let conf = CONFIGS[round % CONFIGS.len()];
            let what = format!("{conf} round {round}");
            let (a, probe) = tracked(conf);
            become_owner(&a);
            let xs: Vec<Seen> = (0..24).map(|k| get(&a, SIZES[k % 5], None)).collect();
            let mut handles = Vec::new();
            for x in &xs {
                match dmabuf_rt::ipc::get_handle(&x.a, None) {
                    Ok(h) => handles.push(h),
                    Err(e) => {
                        println!("SKIP: ipc::get_handle: {e}");
                        return;
                    }
                }
            }
            // The holds revoked first (on another thread), and those kept to the end.
            let kept_held: std::collections::HashSet<usize> = xs[12..].iter().map(|x| x.ptr).collect();
            let all_held: std::collections::HashSet<usize> = xs.iter().map(|x| x.ptr).collect();
            let bytes: usize = xs.iter().map(|x| x.len).sum();
            let kept_bytes: usize = xs[12..].iter().map(|x| x.len).sum();
            // All the blocks are dropped while held, on another thread: limbo.
            std::thread::spawn(move || {
                for x in xs {
                    x.check("a held block dropped on another thread");
                    drop(x);
                }
            })
            .join()
            .unwrap();
            counts_are(&a, 0, 0, 24, &format!("{what}: in limbo"));
            assert_eq!(a.stats().limbo_bytes.current, bytes as i64, "{what}: limbo bytes");
            // While limbo blocks wait, none is handed out again.
            let probe_reuse = |a: &CachingAllocator, set: &std::collections::HashSet<usize>, n: usize, what: &str| {
                let mut live: Vec<Seen> = Vec::new();
                for i in 0..n {
                    let x = get(a, SIZES[i % 5], None);
                    assert!(
                        !set.contains(&x.ptr),
                        "{what}: a block in limbo (held by an IPC handle) was handed out again"
                    );
                    live.push(x);
                    if live.len() > 6 {
                        live.swap_remove(0).check(what);
                    }
                }
            };
            probe_reuse(&a, &all_held, 200, &format!("{what}: every hold in place"));
            // Half the holds revoked on another thread while the owner allocates.
            let revoked: Vec<_> = handles.drain(..12).collect();
            let revoker = std::thread::spawn(move || {
                for h in revoked {
                    dmabuf_rt::ipc::revoke_handle(&h).unwrap();
                }
            });
            probe_reuse(&a, &kept_held, 400, &format!("{what}: half the holds going"));
            revoker.join().unwrap();
            probe_reuse(&a, &kept_held, 200, &format!("{what}: half the holds gone"));
            let s = a.stats();
            assert_eq!(s.active[AGGREGATE].current, 12, "{what}: 12 blocks still held in limbo");
            assert_eq!(s.limbo_bytes.current, kept_bytes as i64, "{what}: limbo bytes of the 12 still held");
            assert_eq!(s.allocation[AGGREGATE].current, 0, "{what}: nothing allocated");
            for h in handles {
                dmabuf_rt::ipc::revoke_handle(&h).unwrap();
            }
            settled(&a, &what);
            drop(a);
            assert_eq!(probe.dropped(), 1, "{what}: the last handle went and the pool stayed");
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 8. An IPC hold released inside a memory source's callback. Dropping an `Allocation` or a
//    handle there is supported (the drop pushes its free, or leaves the spares to the next
//    drop); releasing a hold (`ipc::revoke_handle`, or an exporter going) drops an
//    `ExportHold`, whose drop takes the pool's lock unconditionally (`export.rs`): the thread
//    already holds it. In a child process of its own: a hang leaves a thread stuck.
// ---------------------------------------------------------------------------------------------
#[test]
fn an_ipc_hold_revoked_inside_a_source_callback_does_not_hang() {
    const NAME: &str = "an_ipc_hold_revoked_inside_a_source_callback_does_not_hang";
    common::isolate::in_child(NAME, &[], || {
        let (a, probe) = tracked("expandable_segments:False");
        let x = a.allocate(64 * KB, None).unwrap();
        let h = match dmabuf_rt::ipc::get_handle(&x, None) {
            Ok(h) => h,
            Err(e) => {
                println!("SKIP: ipc::get_handle: {e}");
                return;
            }
        };
        drop(x);
        let slot = Arc::new(Mutex::new(Some(h)));
        {
            let slot = slot.clone();
            probe.set_hook(move || {
                if let Some(h) = slot.lock().unwrap().take() {
                    dmabuf_rt::ipc::revoke_handle(&h).unwrap();
                }
            });
        }
        let a2 = a.clone();
        within("revoke_handle inside create_segment", Duration::from_secs(10), move || {
            // A size the cache cannot serve: the source is called, under the lock.
            let y = a2.allocate(4 * MB, None).unwrap();
            drop(y);
        });
        probe.clear_hook();
        assert!(slot.lock().unwrap().is_none(), "the callback did not run");
        settled(&a, "after the hold went inside the callback");
        drop(a);
        assert_eq!(probe.dropped(), 1);
    });
}

// ---------------------------------------------------------------------------------------------
// 9. Blocks of queues that are dropped (their exit hooks push `QueueGone` and apply it if the
//    lock is free) while the blocks are dropped on every path: the owner's drops (no short way
//    while a gone queue has blocks: pushed), another thread's, a third queue's callback, some
//    of them held by IPC handles (limbo). Once every block and hold is gone, those queues'
//    segments must all be back with the source (the reserved bytes are what they were before
//    the queues existed), and the counts exact.
// ---------------------------------------------------------------------------------------------
#[test]
fn blocks_of_dropped_queues_freed_on_every_path_give_their_segments_back() {
    within("gone queues", *LIMIT, || {
        for round in 0..scaled(150) {
            let conf = CONFIGS[round % CONFIGS.len()];
            let what = format!("{conf} round {round}");
            let (a, probe) = tracked(conf);
            become_owner(&a);
            let base = a.stats();
            let reserved0 = base.reserved_bytes[AGGREGATE].current;
            let segments0 = base.segment[AGGREGATE].current;
            let qs: Vec<Queue> = (0..3).map(|_| Queue::new().unwrap()).collect();
            let mut xs: Vec<Seen> = Vec::new();
            for k in 0..36 {
                let q = &qs[k % 3];
                xs.push(get(&a, SIZES[k % SIZES.len()], Some(q)));
            }
            // A few held for sharing (their frees wait in limbo until the holds go).
            let mut holds = Vec::new();
            if round % 3 == 0 {
                for x in xs.iter().step_by(9) {
                    match dmabuf_rt::ipc::get_handle(&x.a, None) {
                        Ok(h) => holds.push(h),
                        Err(e) => {
                            println!("SKIP ipc hold: {e}");
                            break;
                        }
                    }
                }
            }
            let q_other = Queue::new().unwrap();
            let gate = QueueGate::close(&q_other);
            let in_callback: Vec<Seen> = xs.drain(..12).collect();
            let theirs: Vec<Seen> = xs.drain(..12).collect();
            let bad = Arc::new(AtomicUsize::new(0));
            {
                let bad = bad.clone();
                q_other
                    .callback(move |_| {
                        for x in in_callback {
                            if !x.intact() {
                                bad.fetch_add(1, SeqCst);
                            }
                            drop(x);
                        }
                    })
                    .unwrap();
            }
            let go = Arc::new(Barrier::new(3));
            // The queues go on one thread while another drops blocks and the callback runs.
            let dropper_q = {
                let go = go.clone();
                std::thread::spawn(move || {
                    go.wait();
                    drop(qs);
                })
            };
            let dropper = {
                let go = go.clone();
                std::thread::spawn(move || {
                    go.wait();
                    for x in theirs {
                        x.check("a gone queue's block on another thread");
                        drop(x);
                    }
                })
            };
            go.wait();
            gate.open();
            for x in xs.drain(..) {
                x.check("a gone queue's block on the owner");
                drop(x);
                drop(a.allocate(4 * KB, None).unwrap());
            }
            dropper.join().unwrap();
            dropper_q.join().unwrap();
            q_other.synchronize().unwrap();
            assert_eq!(bad.load(SeqCst), 0, "{what}: a block changed before its callback dropped it");
            for h in holds {
                dmabuf_rt::ipc::revoke_handle(&h).unwrap();
            }
            settled(&a, &what);
            let s = a.stats();
            assert_eq!(
                (s.reserved_bytes[AGGREGATE].current, s.segment[AGGREGATE].current),
                (reserved0, segments0),
                "{what}: the gone queues' segments were not all given back (reserved bytes, segments)"
            );
            drop(a);
            assert_eq!(probe.dropped(), 1, "{what}: the last handle went and the pool stayed");
            drop(q_other);
        }
    });
}
