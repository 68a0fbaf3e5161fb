//! The caching allocator against a reference model.
//!
//! Each run builds a fresh `CachingAllocator` over shmem with a small capacity (so the OOM
//! ladder is reached) and runs a program decoded from the input: RAII and raw allocations on
//! no queue or one of three queues, writes and reads through the API (at once, and queued),
//! `record_queue` / `record_queue_raw`, frees in any order, double and foreign frees,
//! `empty_cache`, queues held back by a gate (a callback that waits) so that deferred frees
//! really are deferred, raw frees racing another thread for the allocator's lock, and
//! short-lived queues. The model knows every live allocation, its bytes and the blocks whose
//! frees wait for queues. After every step:
//! - the invariant checker (`check_invariants`, see below) and the snapshot: blocks tile each
//!   segment; each live allocation is one allocated block at its address with its size;
//! - live allocations (and blocks whose free is still deferred) never overlap;
//! - stats (allocated, requested, allocation counts) equal the model's, reserved >= allocated.
//!
//! Every live allocation's bytes are checked before it is freed. At the end everything is
//! freed, the cache emptied, and reserved bytes, segments and the process's fds must be back
//! where they started.
#![no_main]

use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::sync::{OnceLock, mpsc};

use dmabuf_rt::ErrorKind;
use dmabuf_rt::caching::stats::AGGREGATE;
use dmabuf_rt::caching::{Allocation, BlockState, CachingAllocator, Config, Snapshot};
use dmabuf_rt::queue::{HostBuffer, Mem, Queue, copy_now};
use dmabuf_rt::source::ShmemSource;
use fuzz_common::{Input, check, fd_count, fd_list, first_diff, pattern_vec};
use libfuzzer_sys::fuzz_target;

const QUEUES: usize = 3;
const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Queues shared by every run (a queue is a thread and an io_uring: too dear to make per run).
fn queues() -> &'static [Queue] {
    static Q: OnceLock<Vec<Queue>> = OnceLock::new();
    Q.get_or_init(|| (0..QUEUES).map(|i| Queue::builder().name(&format!("fuzz-q{i}")).build().unwrap()).collect())
}

enum Handle {
    Raii(Allocation),
    Raw(*mut u8),
}

struct Live {
    handle: Handle,
    addr: usize,
    size: usize,
    /// The block's size in the snapshot when it was handed out.
    block: usize,
    /// The queue it is bound to.
    bound: Option<usize>,
    /// Queues it was recorded on (and queued reads on).
    used: Vec<usize>,
    /// Its bytes as the model knows them.
    bytes: Vec<u8>,
    /// The queue that may still be writing or reading it (host access waits for it first).
    inflight: Option<usize>,
}

/// A queued read: the bytes it must find once its queue has run it.
struct Read {
    queue: usize,
    buf: HostBuffer,
    want: Vec<u8>,
    what: String,
}

/// A block whose free waits for queues: it must not be handed out again before they ran.
struct Deferred {
    addr: usize,
    len: usize,
    queues: Vec<usize>,
}

struct Model {
    alloc: CachingAllocator,
    capacity: usize,
    expandable: bool,
    live: Vec<Live>,
    freed_raw: Vec<usize>,
    deferred: Vec<Deferred>,
    reads: Vec<Read>,
    gates: [Option<mpsc::Sender<()>>; QUEUES],
    allocs: i64,
    frees: i64,
    seed: u64,
    empty_with_gate: bool,
    step: usize,
}

fn round(size: usize) -> usize {
    size.max(512).next_multiple_of(512)
}

fn mem_of(l: &Live, alloc: &CachingAllocator) -> Mem {
    match &l.handle {
        Handle::Raii(a) => a.mem(),
        Handle::Raw(p) => alloc.raw_mem(*p, l.size).expect("raw_mem of a live raw allocation"),
    }
}

impl Model {
    fn queue(&self, q: usize) -> &'static Queue {
        &queues()[q]
    }

    fn ungate(&mut self, q: usize) {
        // Dropping the sender ends the gate callback's wait.
        drop(self.gates[q].take());
        for d in &mut self.deferred {
            d.queues.retain(|&x| x != q);
        }
        self.deferred.retain(|d| !d.queues.is_empty());
    }

    /// A freed block's free waits for the queues it was used on; the model knows it cannot
    /// have completed while one of them is held back by its gate.
    fn defer(&mut self, l: &Live) {
        let held: Vec<usize> = l.used.iter().copied().filter(|&q| self.gates[q].is_some()).collect();
        if !held.is_empty() {
            self.deferred.push(Deferred { addr: l.addr, len: l.block.max(l.size), queues: held });
        }
    }

    fn sync(&mut self, q: usize) {
        self.ungate(q);
        let r = self.queue(q).synchronize();
        check!("queue-ok", r.is_ok(), "step {}: queue {q} failed: {r:?}", self.step);
        for l in &mut self.live {
            if l.inflight == Some(q) {
                l.inflight = None;
            }
        }
        let (done, rest): (Vec<Read>, Vec<Read>) =
            std::mem::take(&mut self.reads).into_iter().partition(|r| r.queue == q);
        self.reads = rest;
        for r in done {
            let got = r.buf.to_vec();
            check!(
                "queued-read",
                got == r.want,
                "step {}: {} read wrong bytes (first difference at {:?})",
                self.step,
                r.what,
                first_diff(&got, &r.want)
            );
        }
    }

    fn sync_all(&mut self) {
        for q in 0..QUEUES {
            self.sync(q);
        }
    }

    /// Makes host access to `live[i]` safe: its queue has run.
    fn settle(&mut self, i: usize) {
        if let Some(q) = self.live[i].inflight {
            self.sync(q);
        }
    }

    fn allocate(&mut self, input: &mut Input<'_>, raw: bool) {
        let size = match input.below(8) {
            0 => 1 + input.below(512),
            1 | 2 => 1 + input.below(64 * KIB),
            3 => 1 + input.below(MIB),
            4 => MIB + input.below(3 * MIB),
            5 => self.capacity / 2 + input.below(self.capacity),
            6 => 0,
            _ => 512 * (1 + input.below(16)),
        };
        let bound = match input.below(4) {
            0 => None,
            q => Some(q - 1),
        };
        let queue = bound.map(|q| self.queue(q));
        let nothing_held = self.live.is_empty() && self.deferred.is_empty();
        let got = if raw {
            self.alloc.allocate_raw(size, queue).map(|p| (p as usize, Handle::Raw(p)))
        } else {
            self.alloc.allocate(size, queue).map(|a| (a.as_ptr() as usize, Handle::Raii(a)))
        };
        let (addr, handle) = match got {
            Ok(x) => x,
            Err(e) => {
                if size == 0 {
                    check!(
                        "zero-size",
                        e.kind() == ErrorKind::InvalidArgument,
                        "step {}: size 0 refused with {e} ({:?})",
                        self.step,
                        e.kind()
                    );
                } else {
                    check!(
                        "oom-kind",
                        e.kind() == ErrorKind::OutOfMemory,
                        "step {}: allocating {size} failed with a non-OOM error: {e} ({:?})",
                        self.step,
                        e.kind()
                    );
                    // With nothing held, a quarter of the capacity must always be there.
                    // (Classic segments: requests over 1 MiB need a 20 MiB segment, as in PyTorch.)
                    let limit = if self.expandable { self.capacity / 4 } else { MIB.min(self.capacity / 4) };
                    check!(
                        "false-oom",
                        !(nothing_held && size <= limit),
                        "step {}: {size} bytes refused with nothing allocated (capacity {}): {e}",
                        self.step,
                        self.capacity
                    );
                }
                return;
            }
        };
        check!("zero-size", size != 0, "step {}: size 0 accepted", self.step);
        if let Handle::Raii(a) = &handle {
            check!("raii-len", a.len() == size, "step {}: len {} for {size}", self.step, a.len());
            check!(
                "raii-stream",
                a.queue() == queue.map(Queue::id),
                "step {}: bound to the wrong queue",
                self.step
            );
        }
        self.allocs += 1;
        self.freed_raw.retain(|&p| p != addr);
        // Fill it with its own pattern (through the API, from a host buffer).
        self.seed += 1;
        let bytes = pattern_vec(self.seed, 0, size);
        let mut l = Live { handle, addr, size, block: 0, bound, used: Vec::new(), bytes, inflight: None };
        let dst = mem_of(&l, &self.alloc);
        copy_now(dst, &HostBuffer::from_slice(&l.bytes).unwrap()).unwrap();
        l.block = self.block_size(addr);
        self.live.push(l);
    }

    fn block_size(&self, addr: usize) -> usize {
        let snap = self.alloc.snapshot();
        for s in &snap.segments {
            for b in &s.blocks {
                if s.address + b.offset == addr {
                    return b.size;
                }
            }
        }
        0
    }

    /// Checks a live allocation's bytes, from the host.
    fn verify(&mut self, i: usize) {
        self.settle(i);
        let l = &self.live[i];
        let buf = HostBuffer::new(l.size).unwrap();
        copy_now(&buf, mem_of(l, &self.alloc)).unwrap();
        let got = buf.to_vec();
        check!(
            "bytes",
            got == l.bytes,
            "step {}: allocation {:#x}+{} lost its bytes (first difference at {:?})",
            self.step,
            l.addr,
            l.size,
            first_diff(&got, &l.bytes)
        );
    }

    fn free(&mut self, i: usize) {
        self.verify(i);
        let l = self.live.swap_remove(i);
        self.defer(&l);
        match l.handle {
            Handle::Raii(a) => drop(a),
            Handle::Raw(p) => {
                let r = self.alloc.free_raw(p);
                check!("raw-free", r.is_ok(), "step {}: freeing live raw {p:?} failed: {r:?}", self.step);
                self.freed_raw.push(p as usize);
            }
        }
        self.frees += 1;
    }

    /// A free that must be refused, and change nothing.
    fn bad_free(&mut self, input: &mut Input<'_>) {
        let local = 0u64;
        let ptr: usize = match input.below(5) {
            0 => 0,
            1 => &local as *const u64 as usize,
            2 => match self.freed_raw.last() {
                Some(&p) if !self.live.iter().any(|l| l.addr == p) => p,
                _ => return,
            },
            3 if !self.live.is_empty() => {
                let l = &self.live[input.below(self.live.len())];
                if l.size < 2 {
                    return;
                }
                l.addr + 1 + input.below(l.size - 1)
            }
            4 if !self.live.is_empty() => {
                // A RAII allocation freed as raw.
                match self.live.iter().find(|l| matches!(l.handle, Handle::Raii(_))) {
                    Some(l) => l.addr,
                    None => return,
                }
            }
            _ => return,
        };
        let r = self.alloc.free_raw(ptr as *mut u8);
        check!(
            "bad-free",
            r.as_ref().is_err_and(|e| e.kind() == ErrorKind::InvalidPointer),
            "step {}: free_raw({ptr:#x}) (not a live raw allocation) returned {r:?}",
            self.step
        );
    }

    /// Raw frees while another thread holds the allocator's lock as often as it can: a second
    /// free of the same pointer must still be refused.
    fn contended_double_free(&mut self, input: &mut Input<'_>) {
        let Some(i) = self.live.iter().position(|l| matches!(l.handle, Handle::Raw(_))) else { return };
        self.verify(i);
        let rounds = 1 + input.below(64);
        let stop = AtomicBool::new(false);
        let step = self.step;
        let l = self.live.swap_remove(i);
        let Handle::Raw(p) = l.handle else { unreachable!() };
        self.defer(&l);
        let alloc = &self.alloc;
        std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::black_box(alloc.stats());
                }
            });
            let first = alloc.free_raw(p);
            let mut wrong = None;
            for _ in 0..rounds {
                let again = alloc.free_raw(p);
                if !again.as_ref().is_err_and(|e| e.kind() == ErrorKind::InvalidPointer) {
                    wrong = Some(again);
                    break;
                }
            }
            stop.store(true, Ordering::Relaxed);
            check!("raw-free", first.is_ok(), "step {step}: freeing live raw {p:?} failed: {first:?}");
            check!(
                "contended-double-free",
                wrong.is_none(),
                "step {step}: a second free_raw({p:?}) under lock contention returned {wrong:?}, expected an \
                 invalid pointer (issue 9, defect 4)"
            );
        });
        self.freed_raw.push(p as usize);
        self.frees += 1;
    }

    /// Writes new bytes into part of a live allocation: at once, or queued.
    fn write(&mut self, input: &mut Input<'_>) {
        if self.live.is_empty() {
            return;
        }
        let i = input.below(self.live.len());
        let size = self.live[i].size;
        let off = input.below(size);
        let len = 1 + input.below(size - off);
        self.seed += 1;
        let data = pattern_vec(self.seed, off, len);
        let buf = HostBuffer::from_slice(&data).unwrap();
        let dst = mem_of(&self.live[i], &self.alloc).range(off, len).unwrap();
        match input.below(QUEUES + 1) {
            0 => {
                self.settle(i);
                copy_now(dst, &buf).unwrap();
            }
            q => {
                let q = q - 1;
                if let Some(other) = self.live[i].inflight.filter(|&o| o != q) {
                    self.sync(other);
                }
                self.use_on(i, q);
                self.queue(q).copy(dst, &buf).unwrap();
                self.live[i].inflight = Some(q);
            }
        }
        self.live[i].bytes[off..off + len].copy_from_slice(&data);
    }

    /// Reads part of a live allocation on a queue; checked once the queue has run.
    fn queued_read(&mut self, input: &mut Input<'_>) {
        if self.live.is_empty() {
            return;
        }
        let i = input.below(self.live.len());
        let q = input.below(QUEUES);
        let size = self.live[i].size;
        let off = input.below(size);
        let len = 1 + input.below(size - off);
        if let Some(other) = self.live[i].inflight.filter(|&o| o != q) {
            self.sync(other);
        }
        self.use_on(i, q);
        let buf = HostBuffer::new(len).unwrap();
        let src = mem_of(&self.live[i], &self.alloc).range(off, len).unwrap();
        self.queue(q).copy(&buf, src).unwrap();
        self.live[i].inflight = Some(q);
        let what = format!("a read of {:#x}+{off}..+{len} on queue {q}", self.live[i].addr);
        self.reads.push(Read { queue: q, buf, want: self.live[i].bytes[off..off + len].to_vec(), what });
    }

    /// Records that queue `q` uses `live[i]` (as the contract asks before queueing work there).
    fn use_on(&mut self, i: usize, q: usize) {
        let queue = self.queue(q);
        let l = &mut self.live[i];
        if l.bound == Some(q) {
            return;
        }
        match &mut l.handle {
            Handle::Raii(a) => a.record_queue(queue),
            Handle::Raw(p) => {
                let r = self.alloc.record_queue_raw(*p, queue);
                check!("record-queue-raw", r.is_ok(), "step {}: record_queue_raw of a live block: {r:?}", self.step);
            }
        }
        if !l.used.contains(&q) {
            l.used.push(q);
        }
    }

    fn record_queue(&mut self, input: &mut Input<'_>) {
        let q = input.below(QUEUES);
        if input.below(4) == 0 {
            // Not a live raw allocation: refused.
            let p = match self.freed_raw.last() {
                Some(&p) if !self.live.iter().any(|l| l.addr == p) => p,
                _ => 8,
            };
            let r = self.alloc.record_queue_raw(p as *mut u8, self.queue(q));
            check!(
                "record-queue-raw-bad",
                r.as_ref().is_err_and(|e| e.kind() == ErrorKind::InvalidPointer),
                "step {}: record_queue_raw({p:#x}) (not a live raw allocation) returned {r:?}",
                self.step
            );
            return;
        }
        if !self.live.is_empty() {
            let i = input.below(self.live.len());
            self.use_on(i, q);
        }
    }

    /// Holds queue `q` back until it is synchronized (or `ungate`d): its work and the deferred
    /// frees waiting for it stay pending. The gate is a callback that waits on a channel (no fd,
    /// so the fd counts stay exact).
    fn gate(&mut self, q: usize) {
        if self.gates[q].is_some() {
            return;
        }
        let (tx, rx) = mpsc::channel::<()>();
        self.queue(q).callback(move |_| while rx.recv().is_ok() {}).unwrap();
        self.gates[q] = Some(tx);
    }

    fn empty_cache(&mut self, input: &mut Input<'_>) {
        if self.gates.iter().any(Option::is_some) {
            // With a queue held back, empty_cache waits for it up to its limit: once a run.
            if self.empty_with_gate || input.bool() {
                for q in 0..QUEUES {
                    self.ungate(q);
                }
            } else {
                self.empty_with_gate = true;
            }
        }
        self.alloc.empty_cache();
    }

    /// A queue made, used and dropped: once its blocks are free and the cache emptied, nothing
    /// of it may stay (issue 9, defect 7: the allocator kept its fds).
    fn short_lived_queue(&mut self, input: &mut Input<'_>) {
        for q in 0..QUEUES {
            self.ungate(q);
        }
        self.alloc.empty_cache();
        let before = fd_count();
        let list_before = fd_list();
        {
            let q = Queue::builder().name("fuzz-short").build().unwrap();
            let size = 1 + input.below(256 * KIB);
            let raw = self.alloc.allocate_raw(size, Some(&q));
            let a = self.alloc.allocate(size, Some(&q));
            let made = i64::from(raw.is_ok()) + i64::from(a.is_ok());
            self.allocs += made;
            self.frees += made;
            if let Ok(a) = &a {
                let data = pattern_vec(7, 0, size);
                q.copy(a.mem(), &HostBuffer::from_slice(&data).unwrap()).unwrap();
                q.synchronize().unwrap();
            }
            drop(a);
            if let Ok(p) = raw {
                check!("raw-free", self.alloc.free_raw(p).is_ok(), "step {}: freeing a short queue's block", self.step);
            }
        }
        self.alloc.empty_cache();
        let after = fd_count();
        check!(
            "short-queue-fds",
            after <= before,
            "step {}: a dropped queue left {} fds behind (issue 9, defect 7)\nbefore: {list_before:?}\nafter: {:?}",
            self.step,
            after - before,
            fd_list()
        );
    }

    /// Everything the model can check without changing anything.
    fn check(&self) {
        let step = self.step;
        if let Err(e) = self.alloc.check_invariants() {
            check!("invariants", false, "step {step}: {e}");
        }
        let snap = self.alloc.snapshot();
        check_tiling(&snap, step);
        // Live allocations, and blocks whose free still waits, never overlap.
        let mut ranges: Vec<(usize, usize, &str)> =
            self.live.iter().map(|l| (l.addr, l.addr + l.size, "live")).collect();
        ranges.extend(self.deferred.iter().map(|d| (d.addr, d.addr + d.len, "deferred")));
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            check!("overlap", w[0].1 <= w[1].0, "step {step}: {:#x?} overlaps {:#x?}", w[0], w[1]);
        }
        // Each live allocation is an allocated block at its address.
        let mut blocks = 0usize;
        for l in &self.live {
            let found = snap
                .segments
                .iter()
                .find_map(|s| s.blocks.iter().find(|b| s.address + b.offset == l.addr).map(|b| (s.address, s.size, b)));
            let Some((_, seg_size, b)) = found else {
                check!("snapshot-live", false, "step {step}: live {:#x}+{} is not a block", l.addr, l.size);
                continue;
            };
            blocks += b.size;
            check!(
                "snapshot-live",
                b.state == BlockState::Allocated && b.requested == l.size && b.size == l.block,
                "step {step}: live {:#x}+{} (block {}) shows as {b:?}",
                l.addr,
                l.size,
                l.block
            );
            let (lo, hi) = if self.expandable || b.size < MIB || seg_size <= 2 * MIB {
                (round(l.size), round(l.size))
            } else {
                (round(l.size), round(l.size) + MIB)
            };
            check!(
                "block-size",
                b.size >= lo && b.size <= hi,
                "step {step}: {} bytes got a {}-byte block (expected {lo}..={hi})",
                l.size,
                b.size
            );
        }
        let allocated_blocks =
            snap.segments.iter().flat_map(|s| &s.blocks).filter(|b| b.state == BlockState::Allocated);
        check!(
            "snapshot-count",
            allocated_blocks.count() == self.live.len(),
            "step {step}: the snapshot has a different number of allocated blocks than the {} live ones",
            self.live.len()
        );
        let st = self.alloc.stats();
        let requested: usize = self.live.iter().map(|l| l.size).sum();
        let (alloc_b, req_b, res_b) = (
            st.allocated_bytes[AGGREGATE].current,
            st.requested_bytes[AGGREGATE].current,
            st.reserved_bytes[AGGREGATE].current,
        );
        check!("stats-allocated", alloc_b == blocks as i64, "step {step}: allocated_bytes {alloc_b}, blocks {blocks}");
        check!("stats-requested", req_b == requested as i64, "step {step}: requested_bytes {req_b}, model {requested}");
        let a = &st.allocation[AGGREGATE];
        check!(
            "stats-count",
            a.current == self.live.len() as i64 && a.allocated == self.allocs && a.freed == self.frees,
            "step {step}: allocation stats {a:?}, model: {} live, {} allocs, {} frees",
            self.live.len(),
            self.allocs,
            self.frees
        );
        check!("stats-reserved", res_b >= alloc_b, "step {step}: reserved {res_b} < allocated {alloc_b}");
        check!(
            "stats-capacity",
            res_b as usize <= self.capacity,
            "step {step}: reserved {res_b} beyond the capacity {}",
            self.capacity
        );
    }
}

/// Blocks tile each segment: sorted, no gaps, no overlap, up to the segment's end.
fn check_tiling(snap: &Snapshot, step: usize) {
    for s in &snap.segments {
        let mut at = 0;
        for b in &s.blocks {
            check!("tiling", b.offset == at && b.size > 0, "step {step}: segment {:#x}: {:?}", s.address, s.blocks);
            at = b.offset + b.size;
        }
        check!("tiling", at == s.size, "step {step}: segment {:#x} ({} bytes): {:?}", s.address, s.size, s.blocks);
    }
    let mut segs: Vec<(usize, usize)> = snap.segments.iter().map(|s| (s.address, s.address + s.size)).collect();
    segs.sort_unstable();
    for w in segs.windows(2) {
        check!("segment-overlap", w[0].1 <= w[1].0, "step {step}: segments {:#x?} and {:#x?} overlap", w[0], w[1]);
    }
}

fn warm_up() {
    // The queues live for the whole process.
    for q in queues() {
        q.synchronize().unwrap();
    }
}

fuzz_target!(|data: &[u8]| {
    warm_up();
    let mut input = Input::new(data);
    let flags = input.u8();
    let expandable = flags & 1 == 1;
    let capacity = [4 * MIB, 8 * MIB, 24 * MIB, 64 * MIB][(flags as usize >> 1) & 3];
    let fds_before = fd_count();
    let list_before = fd_list();
    let config = Config { expandable_segments: expandable, ..Config::default() };
    let alloc = CachingAllocator::builder(ShmemSource::new())
        .config(config)
        .capacity(capacity as u64)
        .pending_wait_limit(std::time::Duration::from_millis(50))
        .build()
        .unwrap();
    let mut m = Model {
        alloc,
        capacity,
        expandable,
        live: Vec::new(),
        freed_raw: Vec::new(),
        deferred: Vec::new(),
        reads: Vec::new(),
        gates: [None, None, None],
        allocs: 0,
        frees: 0,
        seed: u64::from(flags),
        empty_with_gate: false,
        step: 0,
    };
    while !input.is_empty() && m.step < 200 {
        m.step += 1;
        match input.u8() % 16 {
            0..=2 => m.allocate(&mut input, false),
            3..=4 => m.allocate(&mut input, true),
            5..=6 if !m.live.is_empty() => {
                let i = input.below(m.live.len());
                m.free(i);
            }
            7 => m.write(&mut input),
            8 => m.queued_read(&mut input),
            9 => m.record_queue(&mut input),
            10 => m.bad_free(&mut input),
            11 => {
                let q = input.below(QUEUES);
                m.gate(q);
            }
            12 => {
                let q = input.below(QUEUES);
                m.sync(q);
            }
            13 => m.empty_cache(&mut input),
            14 => match input.below(4) {
                0 => m.short_lived_queue(&mut input),
                1 => m.contended_double_free(&mut input),
                _ if !m.live.is_empty() => {
                    let i = input.below(m.live.len());
                    m.verify(i);
                }
                _ => {}
            },
            _ => {}
        }
        m.check();
    }
    // Free everything in an order the input picks, then nothing may be left.
    m.sync_all();
    while !m.live.is_empty() {
        let i = input.below(m.live.len());
        m.free(i);
        m.check();
    }
    m.sync_all();
    m.alloc.empty_cache();
    m.check();
    let st = m.alloc.stats();
    let reserved = st.reserved_bytes[AGGREGATE].current;
    check!(
        "empty-reserved",
        reserved == 0,
        "everything freed and the cache emptied, yet {reserved} bytes stay reserved (issue 9, defect 12): {:?}",
        m.alloc.snapshot()
    );
    let Model { alloc, .. } = m;
    drop(alloc);
    let fds_after = fd_count();
    check!(
        "fds",
        fds_after == fds_before,
        "fds: {fds_before} before the run, {fds_after} after\nbefore: {list_before:?}\nafter: {:?}",
        fd_list()
    );
});
