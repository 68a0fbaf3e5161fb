//! The 21st hostile review: the arena's fast path (`Pool::try_arena_home`, both APIs), home
//! blocks filed only in their region (`caching/addrs.rs`), the slow path under the fast path's
//! lock, `dmabuf_rt_ipc_get_mem_handle_on_stream`, and the pipeline on IPC handles.
//!
//! The fast path's equivalence is checked differentially: `roundup_power2_divisions:0` rounds
//! exactly as the default (no division is used) but turns every fast path off (the quick
//! cache's look and `try_arena_home` both refuse any rounding option), so two allocators fed
//! the same operations must agree on every stat, every placement, every error and the history.
//!
//! It found a fence whose reader was gone killing a C host with SIGPIPE when the queue's
//! callback wrote its byte into the pipe (`ipc/exporter.rs`, `fence_after`); fixed: the fence
//! is a Unix stream socket pair and the byte goes with MSG_NOSIGNAL. Two tests check it.

#![allow(unsafe_code)]

mod common;

use common::wait::wait_until;

use std::time::Duration;

use common::isolate::{self, in_child};
use common::{Rng, serial};
use dmabuf_rt::Error;
use dmabuf_rt::caching::stats::AGGREGATE;
use dmabuf_rt::caching::{Allocation, CachingAllocator, HistoryKind};
use dmabuf_rt::queue::Queue;

/// How long the bounded waits of this file wait.
static WAIT: std::sync::LazyLock<Duration> =
    std::sync::LazyLock::new(|| Duration::from_secs(30) * common::time_scale());

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;

/// The configuration that turns the fast paths off and rounds as the default does.
const SLOW: &str = "roundup_power2_divisions:0";

fn alloc(conf: &str, capacity: u64) -> CachingAllocator {
    common::allocator(conf, capacity)
}

/// One side of the differential run: an allocator, its live blocks and the arena's base.
struct Side {
    a: CachingAllocator,
    q: Queue,
    /// (block or raw pointer, size, queued?) in allocation order.
    live: Vec<(Live, usize)>,
    /// The arena's home base per queue key (0 none, 1 the queue): set by the first arena block
    /// after the arena was (re)made (it lies at unit 0).
    base: [Option<usize>; 2],
}

enum Live {
    Block(Allocation),
    Raw(*mut u8, bool),
}

impl Live {
    fn addr(&self) -> usize {
        match self {
            Live::Block(b) => b.as_ptr() as usize,
            Live::Raw(p, _) => *p as usize,
        }
    }
}

/// The outcome of one operation, comparable across the two sides.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    Addr(Option<usize>),
    Err(String),
    Unit,
}

fn err_kind(e: &Error) -> String {
    // The variant and the parts of the message without addresses.
    match e {
        Error::AllocatorOom { requested, allocated, reserved_free, largest_free, allowed, .. } => {
            format!(
                "oom req {requested} alloc {allocated} free {reserved_free} largest {largest_free} allowed {allowed}"
            )
        }
        Error::InvalidFree { why, .. } => format!("invalid free: {why}"),
        other => format!("{:?}", std::mem::discriminant(other)),
    }
}

impl Side {
    fn new(conf: &str, capacity: u64) -> Self {
        Side { a: alloc(conf, capacity), q: Queue::new().unwrap(), live: Vec::new(), base: [None, None] }
    }

    fn arena_sized(&self, size: usize) -> bool {
        size.next_multiple_of(512) >= 4 * 4 * KB
    }

    /// The arena-relative place of a new block (`None` for a pool block, whose address is
    /// its segment's, not compared).
    fn place(&mut self, addr: usize, size: usize, queued: bool) -> Option<usize> {
        if !self.arena_sized(size) {
            return None;
        }
        let k = usize::from(queued);
        let base = *self.base[k].get_or_insert(addr);
        Some(addr.wrapping_sub(base))
    }

    /// A key with no live arena block forgets its base: its arena may be released (by
    /// `empty_cache` or the OOM ladder) and made again elsewhere; the next block on it is the
    /// new reference (both sides place it alike if they agree).
    fn forget_bases(&mut self) {
        for k in 0..2 {
            let any = self.live.iter().any(|(l, s)| {
                let queued = match l {
                    Live::Block(b) => b.queue().is_some(),
                    Live::Raw(_, q) => *q,
                };
                usize::from(queued) == k && self.arena_sized(*s)
            });
            if !any {
                self.base[k] = None;
            }
        }
    }

    fn step(&mut self, op: u64, size: usize, pick: usize) -> Seen {
        let queued = op % 2 == 1;
        let seen = match op % 12 {
            0..=3 => {
                let q = queued.then_some(&self.q);
                match self.a.allocate(size, q) {
                    Ok(b) => {
                        let addr = b.as_ptr() as usize;
                        let place = self.place(addr, size, queued);
                        self.live.push((Live::Block(b), size));
                        Seen::Addr(place)
                    }
                    Err(e) => Seen::Err(err_kind(&e)),
                }
            }
            4..=6 => {
                let q = queued.then_some(&self.q);
                match self.a.allocate_raw(size, q) {
                    Ok(p) => {
                        let place = self.place(p as usize, size, queued);
                        self.live.push((Live::Raw(p, queued), size));
                        Seen::Addr(place)
                    }
                    Err(e) => Seen::Err(err_kind(&e)),
                }
            }
            7..=9 if !self.live.is_empty() => {
                let (l, _) = self.live.remove(pick % self.live.len());
                match l {
                    Live::Block(b) => {
                        drop(b);
                        Seen::Unit
                    }
                    Live::Raw(p, _) => match self.a.free_raw(p) {
                        Ok(()) => Seen::Unit,
                        Err(e) => Seen::Err(err_kind(&e)),
                    },
                }
            }
            10 => {
                if pick % 7 == 0 {
                    self.a.empty_cache();
                } else if pick % 7 == 1 {
                    self.a.set_memory_fraction(if pick % 2 == 0 { 0.5 } else { 1.0 }).unwrap();
                } else if pick % 7 == 2 {
                    self.a.record_history(pick % 4 < 2);
                }
                Seen::Unit
            }
            _ => {
                // A free of a live block's interior, and a double free through a freed
                // block's address: refused alike on both sides.
                match self.live.iter().find(|(l, _)| matches!(l, Live::Raw(..))) {
                    Some((l, s)) if *s > 1 => {
                        let p = (l.addr() + 1 + pick % (*s - 1)) as *mut u8;
                        match self.a.free_raw(p) {
                            Ok(()) => Seen::Err("an interior free was accepted".into()),
                            Err(e) => Seen::Err(err_kind(&e)),
                        }
                    }
                    _ => Seen::Unit,
                }
            }
        };
        self.forget_bases();
        seen
    }
}

/// History without times and addresses (the two sides' memory lies elsewhere).
/// Unmaps of several arenas at once (`empty_cache`, the OOM ladder) come in the order of a hash
/// map keyed by queue id, which differs between the two allocators: sorted within each run.
fn history_shape(a: &CachingAllocator) -> Vec<(HistoryKind, usize, bool)> {
    let mut v: Vec<(HistoryKind, usize, bool)> = a.history().iter().map(|e| (e.kind, e.size, e.stream != 0)).collect();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j < v.len() && v[j].0 == HistoryKind::SegmentUnmap {
            j += 1;
        }
        v[i..j].sort_by_key(|e| (e.1, e.2));
        i = j.max(i + 1);
    }
    v
}

/// The fast path (`try_arena_home` and the quick cache's look, both APIs) agrees with the
/// general path on every step of a random workload of arena and pool sizes, on and off a
/// queue, with raw and object frees, interior frees, `empty_cache`, a memory fraction that
/// shrinks and grows (OOMs), and history recording switched on and off: the same placement
/// (offset in the arena), the same errors, the same stats and the same history.
#[test]
fn the_fast_path_agrees_with_the_general_path_step_by_step() {
    let _g = serial();
    let (mut arena_blocks, mut ooms, mut refused) = (0, 0, 0);
    for seed in 1..=6u64 {
        let cap = 64 * MB as u64;
        let mut fast = Side::new("", cap);
        let mut slow = Side::new(SLOW, cap);
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ seed.wrapping_mul(0x1234_5678_9abc_def1));
        for step in 0..1500 {
            let op = rng.below(12);
            let size = match rng.below(6) {
                0 => 1 + rng.below(12 * KB as u64) as usize,
                1 => 16 * KB + rng.below(16 * KB as u64) as usize,
                2 => 4 * KB * (4 + rng.below(8) as usize),
                3 => 64 * KB + rng.below(MB as u64) as usize,
                4 => MB + rng.below(3 * MB as u64) as usize,
                _ => 4 * KB * (4 + rng.below(4) as usize) - rng.below(512) as usize,
            };
            let pick = rng.next() as usize;
            let f = fast.step(op, size, pick);
            let s = slow.step(op, size, pick);
            match &f {
                Seen::Addr(Some(_)) => arena_blocks += 1,
                Seen::Err(e) if e.starts_with("oom") => ooms += 1,
                Seen::Err(e) if e.starts_with("invalid free") => refused += 1,
                _ => {}
            }
            assert_eq!(f, s, "seed {seed} step {step}: op {op} size {size}: fast path vs general path");
            let (fs, ss) = (fast.a.stats(), slow.a.stats());
            assert_eq!(fs, ss, "seed {seed} step {step}: op {op} size {size}: stats differ");
            if step % 50 == 0 {
                fast.a.check_invariants().unwrap();
                slow.a.check_invariants().unwrap();
                assert_eq!(history_shape(&fast.a), history_shape(&slow.a), "seed {seed} step {step}: history");
            }
        }
        assert_eq!(history_shape(&fast.a), history_shape(&slow.a), "seed {seed}: history");
        for side in [&mut fast, &mut slow] {
            for (l, _) in side.live.drain(..) {
                if let Live::Raw(p, _) = l {
                    side.a.free_raw(p).unwrap();
                }
            }
            side.a.check_invariants().unwrap();
        }
        assert_eq!(fast.a.stats(), slow.a.stats(), "seed {seed}: stats at the end");
    }
    // The run did what it is meant to: many arena blocks, OOMs and refused frees.
    assert!(
        arena_blocks > 1000 && ooms > 10 && refused > 50,
        "{arena_blocks} arena blocks, {ooms} OOMs, {refused} refused"
    );
}

// ---------------------------------------------------------------------------------------------
// Child processes (the C runtime is process-wide; signal dispositions are too).
// ---------------------------------------------------------------------------------------------

const HANDLE_ENV: &str = "HOSTILE_REVIEW21_HANDLE";
const ENV: &[(&str, &str)] = &[("DMABUF_RT_DEVICES", "shmem,shmem"), ("DMABUF_RT_CAPACITY", "512M")];

/// The signal disposition of a C or C++ program: SIGPIPE terminates the process (Rust's
/// runtime ignores it before `main`, so a Rust test binary never sees it by default).
fn sigpipe_as_in_c() {
    // SAFETY: setting a signal's disposition to its default has no preconditions.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

/// This process's open fds that are pipe ends or sockets (a fence is one end of a Unix stream
/// socket pair; it was a pipe), by number.
fn pipe_fds() -> std::collections::BTreeSet<i32> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path()).is_ok_and(|t| {
                let t = t.to_string_lossy();
                t.starts_with("pipe:") || t.starts_with("socket:")
            })
        })
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

/// Waits until every pipe end or socket this process opened since `before` (the fence's end
/// the queue's callback holds, and in the C case the IPC server's sockets and its connection
/// from the consumer) has nobody at the other end: `poll` reports POLLERR (a pipe's write end
/// whose read ends are all closed) or POLLHUP (a socket whose peer is closed). (A reader's
/// close may take a moment to reach it: an io_uring poll on it holds the file until the ring
/// cancels it.) A listening socket never reports either: it is left out.
#[track_caller]
fn wait_no_fence_reader(before: &std::collections::BTreeSet<i32>) {
    let listening = |fd: i32| {
        let mut v: libc::c_int = 0;
        let mut n = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: reads an int option of one fd of this process into `v`.
        let r = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_ACCEPTCONN, (&raw mut v).cast(), &mut n) };
        r == 0 && v != 0
    };
    wait_until("the fence's readers all gone", *WAIT, || {
        let new: Vec<i32> = pipe_fds().difference(before).copied().filter(|&fd| !listening(fd)).collect();
        !new.is_empty()
            && new.iter().all(|&fd| {
                let mut p = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
                // SAFETY: polls one fd of this process (not taking or closing it).
                let n = unsafe { libc::poll(&mut p, 1, 0) };
                n == 1 && p.revents & (libc::POLLERR | libc::POLLHUP) != 0
            })
    });
}

/// BUG. An export made after a busy queue carries a fence: the read end of a pipe whose write
/// end the queue's callback writes a byte into (`ipc/exporter.rs`, `fence_after`). If the
/// importer lets the share go before the work is done (it discards it, drops the block, or its
/// process exits or is killed), no reader is left, and the callback's `write` raises SIGPIPE:
/// in a C or C++ host (SIGPIPE not ignored) the exporting process is killed. The share layer
/// itself never raises SIGPIPE (`share/packet.rs` sends with MSG_NOSIGNAL); the fence does.
#[test]
fn a_fence_let_go_by_the_importer_does_not_kill_the_exporter_with_sigpipe() {
    in_child("a_fence_let_go_by_the_importer_does_not_kill_the_exporter_with_sigpipe", &[], || {
        sigpipe_as_in_c();
        let a = alloc("", 64 * MB as u64);
        let q = Queue::new().unwrap();
        let block = a.allocate(64 * KB, Some(&q)).unwrap();
        let gate = common::QueueGate::close(&q);
        let (tx, rx) = dmabuf_rt::share::Channel::pair("review21").unwrap();
        let exporter = dmabuf_rt::ipc::IpcExporter::new(tx).unwrap();
        let importer = dmabuf_rt::ipc::IpcImporter::new(rx);
        let pipes = pipe_fds();
        let h = exporter.export(&block, Some(&q)).unwrap();
        // The importer does not want it: the share and its fence go (the fence watcher closes
        // the read end). The exporter closed its own copy after sending.
        importer.discard(h.export).unwrap();
        wait_until("the release", *WAIT, || exporter.held() == 0);
        // Only the fence's write end is left (the watcher closes the read end shortly).
        wait_no_fence_reader(&pipes);
        // The queue's work finishes: its callback writes into a pipe nobody reads.
        gate.open();
        q.synchronize().unwrap();
        println!("the exporting process survived its queue's fence callback");
        drop(block);
    });
}

/// BUG (the same cause, through the new C function). A C producer makes a handle on a busy
/// stream (`dmabuf_rt_ipc_get_mem_handle_on_stream`) and frees the block; a consumer process
/// opens the handle (its open waits for the fence) and is killed meanwhile, which the C API
/// promises is harmless ("a consumer that exits or is killed releases what it opened"). When
/// the stream's work finishes, its fence callback writes into a pipe whose only reader died:
/// SIGPIPE kills the producer.
#[test]
fn a_consumer_killed_while_its_open_waits_for_the_fence_does_not_kill_the_c_producer() {
    use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;
    use dmabuf_rt::ffi::capi::*;
    const NAME: &str = "a_consumer_killed_while_its_open_waits_for_the_fence_does_not_kill_the_c_producer";
    if let Ok(hexed) = std::env::var(HANDLE_ENV) {
        if std::env::var(isolate::CHILD_ENV).as_deref() != Ok("consumer") {
            return;
        }
        // The consumer: its open waits for the producer's stream, which never finishes
        // before this process is killed.
        let mut h = dmabuf_rt_ipc_mem_handle { bytes: [0; 64] };
        for (i, b) in h.bytes.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hexed[2 * i..2 * i + 2], 16).unwrap();
        }
        let mut p = std::ptr::null_mut();
        // SAFETY: valid pointers.
        let st = unsafe { dmabuf_rt_ipc_open_mem_handle(0, &h, &mut p) };
        println!("the consumer's open returned {st:?}");
        std::process::exit(3);
    }
    in_child(NAME, ENV, || {
        sigpipe_as_in_c();
        let ok = |s: dmabuf_rt_status| assert_eq!(s, DMABUF_RT_OK);
        let mut s = 0;
        // SAFETY: a valid out-pointer.
        ok(unsafe { dmabuf_rt_stream_create(0, &mut s) });
        // The stream is held by a callback until the gate opens.
        static GATE: (std::sync::Mutex<bool>, std::sync::Condvar) =
            (std::sync::Mutex::new(false), std::sync::Condvar::new());
        extern "C" fn wait_for_gate(_: dmabuf_rt_stream, _: dmabuf_rt_status, _: *mut std::ffi::c_void) {
            let mut open = GATE.0.lock().unwrap();
            while !*open {
                open = GATE.1.wait(open).unwrap();
            }
        }
        // SAFETY: the callback ignores its user data.
        ok(unsafe { dmabuf_rt_stream_add_callback(s, Some(wait_for_gate), std::ptr::null_mut()) });
        let mut p = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        ok(unsafe { dmabuf_rt_device_alloc(0, 64 * KB, &mut p) });
        let mut h = dmabuf_rt_ipc_mem_handle { bytes: [0; 64] };
        // The IPC server started first (its socket and its door, a socket pair both ends of
        // which stay here): not among the fds the fence's check looks at.
        let other = common::allocator("", 64 << 20);
        let warm = other.allocate(4 * KB, None).unwrap();
        dmabuf_rt::ipc::revoke_handle(&dmabuf_rt::ipc::get_handle(&warm, None).unwrap()).unwrap();
        let pipes = pipe_fds();
        // SAFETY: a valid out-pointer.
        ok(unsafe { dmabuf_rt_ipc_get_mem_handle_on_stream(0, p, s, &mut h) });
        ok(dmabuf_rt_device_free(0, p));
        let stats = || {
            let mut st = dmabuf_rt_stats::default();
            // SAFETY: a valid out-pointer.
            ok(unsafe { dmabuf_rt_device_stats(0, &mut st) });
            st
        };
        assert!(stats().limbo_bytes > 0, "the freed block waits in limbo");
        let hexed: String = h.bytes.iter().map(|b| format!("{b:02x}")).collect();
        let mut consumer = isolate::command(NAME, ENV)
            .env(isolate::CHILD_ENV, "consumer")
            .env("DMABUF_RT_LOG", "off")
            .env(HANDLE_ENV, hexed)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // The consumer asked for the block (the hold left the unopened list: the share and its
        // fence went to it); its open now waits for the fence.
        wait_until("the consumer's request", *WAIT, || dmabuf_rt::ipc::unopened_handles() == 0);
        consumer.kill().unwrap();
        consumer.wait().unwrap();
        // Its connection's end of file released the hold (after the share was sent and the
        // producer's copy of the fence closed).
        wait_until("the dead consumer's release", *WAIT, || stats().limbo_bytes == 0);
        // The fence's read end went with the consumer: only the stream's write end is left.
        wait_no_fence_reader(&pipes);
        *GATE.0.lock().unwrap() = true;
        GATE.1.notify_all();
        ok(dmabuf_rt_stream_synchronize(s));
        ok(dmabuf_rt_stream_destroy(s));
        println!("the producer survived its stream's fence callback");
    });
}

// ---------------------------------------------------------------------------------------------
// Many threads on the fast paths at once.
// ---------------------------------------------------------------------------------------------

fn tag_byte(tag: u32, i: usize) -> u8 {
    (tag.wrapping_mul(0x9E37_79B1) >> (8 * (i % 4))) as u8 ^ (i / 4096) as u8
}

fn fill_raw(p: *mut u8, n: usize, tag: u32) {
    let v: Vec<u8> = (0..n).map(|i| tag_byte(tag, i)).collect();
    // SAFETY: `p` is a live block of at least `n` bytes this thread owns, mapped for the CPU.
    unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), p, n) };
}

/// Whether the first and last 64 bytes of each 4 KiB page of `[p, p + n)` hold `tag`'s
/// pattern (read through the mapping, which stays mapped while the arena lives).
fn holds_tag(p: usize, n: usize, tag: u32) -> bool {
    let mut at = 0;
    while at < n {
        for off in [at, (at + 4096).min(n).saturating_sub(64)] {
            for i in off..(off + 64).min(n) {
                // SAFETY: inside a block of this test's allocator, mapped while it lives.
                if unsafe { std::ptr::read_volatile((p + i) as *const u8) } != tag_byte(tag, i) {
                    return false;
                }
            }
        }
        at += 4096;
    }
    true
}

enum Owned {
    Block(Allocation, u32),
    Raw(usize, usize, u32),
}

/// Live address ranges: two blocks handed out over one address is a double hand-out.
#[derive(Default)]
struct Ranges(std::sync::Mutex<std::collections::BTreeMap<usize, (usize, u32)>>);

impl Ranges {
    #[track_caller]
    fn add(&self, p: usize, n: usize, tag: u32) {
        let mut m = self.0.lock().unwrap();
        if let Some((&s, &(l, t))) = m.range(..p + n).next_back() {
            assert!(s + l <= p, "block {p:#x}+{n} (tag {tag}) handed out over live block {s:#x}+{l} (tag {t})");
        }
        m.insert(p, (n, tag));
    }

    fn remove(&self, p: usize) {
        assert!(self.0.lock().unwrap().remove(&p).is_some(), "{p:#x} was not live");
    }
}

/// Four threads allocate arena blocks (both APIs, fast path and not, on the host key and on
/// queues of their own that they drop and replace with blocks still live), hand them to each
/// other to free, free raw blocks used on a side queue (deferred: the side queue checks the
/// bytes when it gets there), export raw blocks and free them at once (limbo: an importer
/// thread checks the bytes, then releases), while a fifth thread runs `empty_cache`, changes
/// the memory fraction and switches history recording. No address is ever live twice, no
/// block changes under its owner, deferred and limbo blocks keep their bytes until released,
/// and at the end every stat is back to zero and the pool's invariants hold.
#[test]
fn threads_on_the_fast_paths_with_deferred_frees_limbo_and_gone_queues() {
    use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex, mpsc};
    let _g = serial();
    let a = Arc::new(alloc("", 256 * MB as u64));
    let ranges = Arc::new(Ranges::default());
    let bin: Arc<Mutex<Vec<Owned>>> = Arc::default();
    let bad = Arc::new(AtomicUsize::new(0));
    let deferred_checked = Arc::new(AtomicUsize::new(0));
    let next_tag = Arc::new(AtomicU32::new(1));
    let (tx, rx) = dmabuf_rt::share::Channel::pair("review21-stress").unwrap();
    let exporter = Arc::new(dmabuf_rt::ipc::IpcExporter::new(tx).unwrap());
    let importer = dmabuf_rt::ipc::IpcImporter::new(rx);
    let (htx, hrx) = mpsc::channel::<(dmabuf_rt::ipc::IpcHandle, usize, usize, u32)>();
    let imported = Arc::new(AtomicUsize::new(0));
    let importer_thread = {
        let (ranges, bad, imported) = (ranges.clone(), bad.clone(), imported.clone());
        std::thread::spawn(move || {
            for (h, p, n, tag) in hrx {
                let b = importer.open(&h).unwrap();
                let mut v = vec![0u8; n];
                b.read(0, &mut v).unwrap();
                if (0..n).any(|i| v[i] != tag_byte(tag, i)) || !holds_tag(p, n, tag) {
                    bad.fetch_add(1, Ordering::Relaxed);
                }
                // Out of the live set while still held (so nobody else can have it yet).
                ranges.remove(p);
                drop(b);
                imported.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let stop = Arc::new(AtomicBool::new(false));
    let control = {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut i = 0u32;
            while !stop.load(Ordering::Relaxed) {
                match i % 4 {
                    0 => a.empty_cache(),
                    1 => a.set_memory_fraction(if i % 8 == 1 { 0.25 } else { 1.0 }).unwrap(),
                    2 => a.record_history(i % 8 == 2),
                    _ => a.check_invariants().unwrap(),
                }
                i += 1;
                std::thread::yield_now();
            }
            a.set_memory_fraction(1.0).unwrap();
            a.record_history(false);
        })
    };
    let iters = 2500;
    let workers: Vec<_> = (0..4u64)
        .map(|t| {
            let (a, ranges, bin, bad, checked, next_tag, exporter, htx) = (
                a.clone(),
                ranges.clone(),
                bin.clone(),
                bad.clone(),
                deferred_checked.clone(),
                next_tag.clone(),
                exporter.clone(),
                htx.clone(),
            );
            std::thread::spawn(move || {
                let mut rng = Rng(0xA5A5_0000 + t * 7919);
                let mut q = Queue::new().unwrap();
                let side = Queue::new().unwrap();
                let mut mine: Vec<Owned> = Vec::new();
                for _ in 0..iters {
                    let n = match rng.below(3) {
                        0 => 16 * KB + rng.below(48 * KB as u64) as usize,
                        1 => 4 * KB * (4 + rng.below(12) as usize),
                        _ => 64 * KB + rng.below(512 * KB as u64) as usize,
                    };
                    let on = if rng.below(2) == 0 { None } else { Some(&q) };
                    let tag = next_tag.fetch_add(1, Ordering::Relaxed);
                    match rng.below(9) {
                        0 | 1 => {
                            let Ok(b) = a.allocate(n, on) else { continue };
                            let p = b.as_ptr() as usize;
                            ranges.add(p, n, tag);
                            fill_raw(p as *mut u8, n, tag);
                            let o = Owned::Block(b, tag);
                            if rng.below(2) == 0 { mine.push(o) } else { bin.lock().unwrap().push(o) }
                        }
                        2 | 3 => {
                            let Ok(p) = a.allocate_raw(n, on) else { continue };
                            ranges.add(p as usize, n, tag);
                            fill_raw(p, n, tag);
                            let o = Owned::Raw(p as usize, n, tag);
                            if rng.below(2) == 0 { mine.push(o) } else { bin.lock().unwrap().push(o) }
                        }
                        4 | 5 => {
                            // Free someone's block (checked first), or one of mine.
                            let o = if rng.below(2) == 0 { bin.lock().unwrap().pop() } else { mine.pop() };
                            match o {
                                Some(Owned::Block(b, tag)) => {
                                    if !holds_tag(b.as_ptr() as usize, b.len(), tag) {
                                        bad.fetch_add(1, Ordering::Relaxed);
                                    }
                                    ranges.remove(b.as_ptr() as usize);
                                    drop(b);
                                }
                                Some(Owned::Raw(p, n, tag)) => {
                                    if !holds_tag(p, n, tag) {
                                        bad.fetch_add(1, Ordering::Relaxed);
                                    }
                                    let inside = (p + 512) as *mut u8;
                                    assert!(a.free_raw(inside).is_err(), "an interior free of a live block");
                                    ranges.remove(p);
                                    a.free_raw_sized(p as *mut u8, n).unwrap();
                                }
                                None => {}
                            }
                        }
                        6 => {
                            // Used on the side queue, freed at once: the side queue still finds
                            // the bytes when it gets there.
                            let Ok(p) = a.allocate_raw(n, on) else { continue };
                            ranges.add(p as usize, n, tag);
                            fill_raw(p, n, tag);
                            let (pp, bad2, checked2) = (p as usize, bad.clone(), checked.clone());
                            side.callback(move |_| {
                                if !holds_tag(pp, n, tag) {
                                    bad2.fetch_add(1, Ordering::Relaxed);
                                }
                                checked2.fetch_add(1, Ordering::Relaxed);
                            })
                            .unwrap();
                            a.record_queue_raw(p.wrapping_add(n / 2), &side).unwrap();
                            ranges.remove(p as usize);
                            a.free_raw(p).unwrap();
                        }
                        7 => {
                            // Exported and freed at once: limbo until the importer lets go.
                            let Ok(p) = a.allocate_raw(n, on) else { continue };
                            ranges.add(p as usize, n, tag);
                            fill_raw(p, n, tag);
                            let h = exporter.export_raw(&a, p, None).unwrap();
                            a.free_raw(p).unwrap();
                            assert!(a.free_raw(p).is_err(), "a second free of a block in limbo");
                            htx.send((h, p as usize, n, tag)).unwrap();
                        }
                        _ => {
                            // This thread's queue goes, with blocks of it still live (they are
                            // freed later, some by other threads); a new one replaces it.
                            if rng.below(4) == 0 {
                                q.synchronize().unwrap();
                                q = Queue::new().unwrap();
                            }
                        }
                    }
                }
                side.synchronize().unwrap();
                mine
            })
        })
        .collect();
    let mut left = Vec::new();
    for w in workers {
        left.extend(w.join().unwrap());
    }
    stop.store(true, Ordering::Relaxed);
    control.join().unwrap();
    left.extend(bin.lock().unwrap().drain(..));
    for o in left {
        match o {
            Owned::Block(b, tag) => {
                assert!(holds_tag(b.as_ptr() as usize, b.len(), tag), "a block changed under its owner");
                ranges.remove(b.as_ptr() as usize);
            }
            Owned::Raw(p, n, tag) => {
                assert!(holds_tag(p, n, tag), "a raw block changed under its owner");
                ranges.remove(p);
                a.free_raw(p as *mut u8).unwrap();
            }
        }
    }
    drop(htx);
    importer_thread.join().unwrap();
    wait_until("the importer's releases", *WAIT, || exporter.held() == 0);
    assert_eq!(bad.load(Ordering::Relaxed), 0, "blocks whose bytes changed while owned, deferred or in limbo");
    assert!(deferred_checked.load(Ordering::Relaxed) > 50 && imported.load(Ordering::Relaxed) > 50);
    a.check_invariants().unwrap();
    let s = a.stats();
    assert_eq!(s.allocation[AGGREGATE].current, 0, "{s:?}");
    assert_eq!(s.allocated_bytes[AGGREGATE].current, 0);
    assert_eq!(s.active_bytes[AGGREGATE].current, 0);
    assert_eq!(s.limbo_bytes.current, 0);
    a.empty_cache();
    assert_eq!(a.stats().reserved_bytes[AGGREGATE].current, 0, "everything given back");
    a.check_invariants().unwrap();
}

// ---------------------------------------------------------------------------------------------
// The C API: home blocks (filed only in their region), limbo, and handles made on streams.
// ---------------------------------------------------------------------------------------------

mod c {
    pub use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;
    pub use dmabuf_rt::ffi::capi::*;
    use std::ffi::{CStr, c_int, c_void};

    pub fn last_error() -> String {
        let p = dmabuf_rt_last_error();
        // SAFETY: a non-null last error is a NUL-terminated string valid until the next failure.
        if p.is_null() { "<none>".into() } else { unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned() }
    }

    #[track_caller]
    pub fn ok(s: dmabuf_rt_status) {
        assert_eq!(s, DMABUF_RT_OK, "call failed: {}", if s == DMABUF_RT_OK { String::new() } else { last_error() });
    }

    #[track_caller]
    pub fn refused(got: dmabuf_rt_status, want: dmabuf_rt_status, has: &str) {
        let why = if got == DMABUF_RT_OK { "<none>".to_string() } else { last_error() };
        assert_eq!(got, want, "wrong status ({why})");
        assert!(why.contains(has), "last error `{why}` does not say `{has}`");
    }

    pub fn alloc(device: c_int, n: usize) -> *mut c_void {
        let mut p = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        ok(unsafe { dmabuf_rt_device_alloc(device, n, &mut p) });
        p
    }

    pub fn write(device: c_int, p: *mut c_void, bytes: &[u8]) -> dmabuf_rt_status {
        // SAFETY: the host side is a live buffer of `bytes.len()` bytes.
        unsafe {
            dmabuf_rt_memcpy(device, p, 0, bytes.as_ptr().cast(), bytes.len(), DMABUF_RT_MEMCPY_HOST_TO_DEVICE, 0)
        }
    }

    pub fn read(device: c_int, p: *const c_void, n: usize) -> Result<Vec<u8>, dmabuf_rt_status> {
        let mut v = vec![0u8; n];
        // SAFETY: the host side is a live buffer of `n` bytes.
        let s = unsafe { dmabuf_rt_memcpy(0, v.as_mut_ptr().cast(), device, p, n, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0) };
        if s == DMABUF_RT_OK { Ok(v) } else { Err(s) }
    }

    pub fn stats(device: c_int) -> dmabuf_rt_stats {
        let mut s = dmabuf_rt_stats::default();
        // SAFETY: a valid out-pointer.
        ok(unsafe { dmabuf_rt_device_stats(device, &mut s) });
        s
    }

    pub fn handle_on(
        device: c_int,
        p: *mut c_void,
        s: dmabuf_rt_stream,
    ) -> Result<dmabuf_rt_ipc_mem_handle, dmabuf_rt_status> {
        let mut h = dmabuf_rt_ipc_mem_handle { bytes: [0; 64] };
        // SAFETY: a valid out-pointer.
        match unsafe { dmabuf_rt_ipc_get_mem_handle_on_stream(device, p, s, &mut h) } {
            DMABUF_RT_OK => Ok(h),
            st => Err(st),
        }
    }

    pub fn open(device: c_int, h: &dmabuf_rt_ipc_mem_handle) -> Result<*mut c_void, dmabuf_rt_status> {
        let mut p = std::ptr::null_mut();
        // SAFETY: valid pointers.
        match unsafe { dmabuf_rt_ipc_open_mem_handle(device, h, &mut p) } {
            DMABUF_RT_OK => Ok(p),
            s => Err(s),
        }
    }

    pub fn pointer_device(p: *const c_void) -> Result<c_int, dmabuf_rt_status> {
        let mut d = -1;
        // SAFETY: a valid out-pointer.
        match unsafe { dmabuf_rt_pointer_device(p, &mut d) } {
            DMABUF_RT_OK => Ok(d),
            s => Err(s),
        }
    }

    pub fn stream(device: c_int) -> dmabuf_rt_stream {
        let mut s = 0;
        // SAFETY: a valid out-pointer.
        ok(unsafe { dmabuf_rt_stream_create(device, &mut s) });
        s
    }
}

fn cpat(tag: u8, n: usize) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(29) ^ tag ^ (i >> 12) as u8).collect()
}

/// Home blocks through the C API now that they are filed only in their region: pointer
/// lookups, copy bounds, interior, double and foreign frees, handles made on a stream of
/// interior, freed and live pointers, the free of a shared block (limbo: a second free is
/// refused as such, its memory not reused), its release and the double free after it; and four
/// threads allocating and freeing each other's home blocks while one shares and frees.
#[test]
fn c_home_blocks_lookups_frees_limbo_and_handles_on_streams() {
    use c::*;
    use std::ffi::c_void;
    in_child("c_home_blocks_lookups_frees_limbo_and_handles_on_streams", ENV, || {
        let s = stream(0);
        let n = 64 * KB + 3;
        let p = alloc(0, n);
        let q = alloc(0, 20 * KB);
        ok(write(0, p, &cpat(1, n)));
        ok(write(0, q, &cpat(2, 20 * KB)));
        let at = |x: *mut c_void, off: usize| x.cast::<u8>().wrapping_add(off).cast::<c_void>();
        for off in [0, 1, 4096, n - 1] {
            assert_eq!(pointer_device(at(p, off)), Ok(0), "offset {off}");
        }
        refused(write(0, at(p, n - 8), &[0; 16]), DMABUF_RT_INVALID_POINTER, "past the end");
        refused(dmabuf_rt_device_free(0, at(p, 512)), DMABUF_RT_INVALID_POINTER, "not the start");
        refused(dmabuf_rt_device_free(1, p), DMABUF_RT_INVALID_POINTER, "");
        refused(handle_on(0, at(p, 4096), s).unwrap_err(), DMABUF_RT_INVALID_POINTER, "");
        // Shared on an idle stream, then freed: limbo.
        let h = handle_on(0, p, s).unwrap();
        ok(dmabuf_rt_device_free(0, p));
        assert!(stats(0).limbo_bytes >= n as u64);
        refused(dmabuf_rt_device_free(0, p), DMABUF_RT_INVALID_POINTER, "limbo");
        refused(handle_on(0, p, s).unwrap_err(), DMABUF_RT_INVALID_POINTER, "");
        let others: Vec<_> = (0..16).map(|_| alloc(0, n)).collect();
        assert!(others.iter().all(|&x| x != p), "a block in limbo was handed out again");
        for &x in &others {
            ok(write(0, x, &cpat(9, n)));
        }
        let r = open(1, &h).unwrap_or_else(|st| panic!("open: {st:?} {}", last_error()));
        assert!(read(1, r, n).unwrap() == cpat(1, n), "the shared block changed while in limbo");
        ok(dmabuf_rt_ipc_close_mem_handle(1, r));
        wait_until("the release", *WAIT, || stats(0).limbo_bytes == 0);
        refused(dmabuf_rt_device_free(0, p), DMABUF_RT_INVALID_POINTER, "");
        for x in others {
            ok(dmabuf_rt_device_free(0, x));
        }
        assert!(read(0, q, 20 * KB).unwrap() == cpat(2, 20 * KB));
        ok(dmabuf_rt_device_free(0, q));
        // Threads: allocate, hand over, free elsewhere; one thread shares and frees.
        let bin = std::sync::Mutex::new(Vec::<(usize, usize, u8)>::new());
        std::thread::scope(|sc| {
            for t in 0..4u8 {
                let bin = &bin;
                sc.spawn(move || {
                    let s = stream(0);
                    for i in 0..150usize {
                        let n = 16 * KB + (i * 4099 + t as usize * 777) % (200 * KB);
                        let tag = t.wrapping_mul(50).wrapping_add(i as u8);
                        let x = alloc(0, n);
                        ok(write(0, x, &cpat(tag, n)));
                        if t == 0 && i % 10 == 0 {
                            let h = handle_on(0, x, s).unwrap();
                            ok(dmabuf_rt_device_free(0, x));
                            let r = open(1, &h).unwrap();
                            assert!(read(1, r, n).unwrap() == cpat(tag, n));
                            ok(dmabuf_rt_ipc_close_mem_handle(1, r));
                            continue;
                        }
                        bin.lock().unwrap().push((x as usize, n, tag));
                        let got = {
                            let mut b = bin.lock().unwrap();
                            let k = b.len();
                            if k > 3 { Some(b.swap_remove((i * 7 + t as usize) % k)) } else { None }
                        };
                        if let Some((y, m, tag)) = got {
                            let y = y as *mut c_void;
                            assert!(read(0, y, m).unwrap() == cpat(tag, m), "a live block changed");
                            refused(dmabuf_rt_device_free(0, at(y, 512)), DMABUF_RT_INVALID_POINTER, "not the start");
                            ok(dmabuf_rt_device_free(0, y));
                        }
                    }
                    ok(dmabuf_rt_stream_synchronize(s));
                    ok(dmabuf_rt_stream_destroy(s));
                });
            }
        });
        for (y, m, tag) in bin.into_inner().unwrap() {
            assert!(read(0, y as *mut c_void, m).unwrap() == cpat(tag, m));
            ok(dmabuf_rt_device_free(0, y as *mut c_void));
        }
        wait_until("every release", *WAIT, || stats(0).limbo_bytes == 0);
        assert_eq!(stats(0).allocations, 0);
        ok(dmabuf_rt_stream_destroy(s));
    });
}

/// A handle made on a stream whose queued work then fails: the open fails (it never shows
/// bytes the failed work did not write), the producer's block is released (limbo back to 0
/// after its free), the failed stream refuses further handles with DMABUF_RT_FAILED, and the
/// producer (SIGPIPE ignored, as in Rust and Python hosts) carries on.
#[test]
fn c_a_handle_on_a_stream_whose_work_fails_never_opens() {
    use c::*;
    in_child("c_a_handle_on_a_stream_whose_work_fails_never_opens", ENV, || {
        let rt = dmabuf_rt::ffi::runtime::Runtime::get().unwrap();
        let s = stream(0);
        let (gate_tx, gate_rx) = std::sync::mpsc::channel::<()>();
        rt.stream_add_callback(s as usize, move |_| {
            let _ = gate_rx.recv();
        })
        .unwrap();
        rt.stream_add_callback(s as usize, |_| panic!("review21: the producer's stream work fails")).unwrap();
        let n = 48 * KB;
        let p = alloc(0, n);
        let h = handle_on(0, p, s).unwrap();
        ok(dmabuf_rt_device_free(0, p));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let r = open(1, &h).map(|r| r as usize);
            tx.send((r, last_error())).unwrap();
        });
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err(), "the open did not wait for the fence");
        drop(gate_tx);
        let (r, why) = rx.recv_timeout(Duration::from_secs(30)).expect("the open never returned");
        assert_eq!(r, Err(DMABUF_RT_FAILED), "an open of a handle whose stream failed: {why}");
        assert_ne!(dmabuf_rt_stream_synchronize(s), DMABUF_RT_OK, "the stream failed");
        let q = alloc(0, n);
        refused(handle_on(0, q, s).unwrap_err(), DMABUF_RT_FAILED, "");
        wait_until("the failed open's release", *WAIT, || stats(0).limbo_bytes == 0);
        ok(dmabuf_rt_device_free(0, q));
        assert_eq!(stats(0).allocations, 0);
        assert_eq!(dmabuf_rt::ipc::unopened_handles(), 0);
    });
}

/// Home blocks of many arenas at once (one region each): every pointer resolves to its own
/// block (`raw_size`, `mem_at`, `holds`, `record_queue_raw` on an interior byte), interior and
/// cross-block ranges are refused, and once one queue's arena is gone (queue dropped, blocks
/// freed), its pointers are refused while the other arenas' still resolve; an arena made again
/// (perhaps at the same address) starts clean.
#[test]
fn home_blocks_of_many_regions_resolve_to_their_own_blocks() {
    let _g = serial();
    let a = alloc("", 256 * MB as u64);
    let side = Queue::new().unwrap();
    let mut queues: Vec<Option<Queue>> = (0..8).map(|_| Some(Queue::new().unwrap())).collect();
    let mut blocks: Vec<(usize, *mut u8, usize)> = Vec::new();
    for (k, q) in queues.iter().enumerate() {
        for i in 0..12 {
            let n = 16 * KB + (k * 12 + i) * 1536;
            let p = a.allocate_raw(n, q.as_ref()).unwrap();
            blocks.push((k, p, n));
        }
    }
    let check_live = |blocks: &[(usize, *mut u8, usize)]| {
        for &(k, p, n) in blocks {
            assert_eq!(a.raw_size(p).unwrap(), n, "queue {k}: {p:p}");
            assert!(a.holds(p) && a.holds(p.wrapping_add(n - 1)));
            assert!(a.mem_at(p.wrapping_add(1), n - 1).is_ok());
            assert!(a.mem_at(p.wrapping_add(1), n).is_err(), "a range past the block's request");
            assert!(a.raw_size(p.wrapping_add(512)).is_err(), "an interior pointer's size");
            match a.free_raw(p.wrapping_add(4096)) {
                Err(Error::InvalidFree { why, .. }) => assert!(why.contains("not the start"), "{why}"),
                other => panic!("an interior free: {other:?}"),
            }
            a.record_queue_raw(p.wrapping_add(n / 2), &side).unwrap();
        }
    };
    check_live(&blocks);
    a.check_invariants().unwrap();
    // Queue 3's blocks go, then the queue: its arena is released.
    let (gone, kept): (Vec<_>, Vec<_>) = blocks.into_iter().partition(|b| b.0 == 3);
    for &(_, p, _) in &gone {
        a.free_raw(p).unwrap();
    }
    let q3 = queues[3].take().unwrap();
    q3.synchronize().unwrap();
    drop(q3);
    side.synchronize().unwrap();
    wait_until("queue 3's arena released", *WAIT, || {
        a.check_invariants().unwrap();
        a.stats().segment[AGGREGATE].current == 7
    });
    for &(_, p, _) in &gone {
        assert!(a.raw_size(p).is_err());
        assert!(a.free_raw(p).is_err(), "a free into a released arena");
        assert!(a.mem_at(p, 1).is_err());
    }
    check_live(&kept);
    // A new queue's arena (maybe where queue 3's was).
    let q = Queue::new().unwrap();
    let fresh: Vec<_> =
        (0..12).map(|i| (9, a.allocate_raw(20 * KB + i * 512, Some(&q)).unwrap(), 20 * KB + i * 512)).collect();
    check_live(&fresh);
    check_live(&kept);
    side.synchronize().unwrap();
    for &(_, p, _) in fresh.iter().chain(&kept) {
        a.free_raw(p).unwrap();
        assert!(a.free_raw(p).is_err());
    }
    a.check_invariants().unwrap();
    assert_eq!(a.stats().allocation[AGGREGATE].current, 0);
}

/// With history recording on, a home block of the fast path (both APIs) is logged as the
/// general path logs it: an allocation at its own address with its rounded size, the free
/// completed at the same address; the snapshot shows it allocated there with its request,
/// and free again after the free.
#[test]
fn fast_path_home_blocks_in_history_and_snapshot() {
    let _g = serial();
    let a = alloc("", 64 * MB as u64);
    // The arena exists (the general path made it), so the next ones take the fast path.
    let first = a.allocate_raw(64 * KB, None).unwrap();
    a.record_history(true);
    let n = 40 * KB + 5;
    let p = a.allocate_raw(n, None).unwrap() as usize;
    let b = a.allocate(n + 1000, None).unwrap();
    let rounded = n.next_multiple_of(512);
    let h = a.history();
    let allocs: Vec<_> = h.iter().filter(|e| e.kind == HistoryKind::Alloc).map(|e| (e.addr, e.size)).collect();
    assert_eq!(allocs, vec![(p, rounded), (b.as_ptr() as usize, (n + 1000).next_multiple_of(512))], "{h:?}");
    let find = |addr: usize| {
        a.snapshot()
            .segments
            .iter()
            .flat_map(|s| s.blocks.iter().map(move |bl| (s.address + bl.offset, bl.requested, bl.state)))
            .find(|&(at, _, _)| at == addr)
    };
    assert_eq!(find(p).map(|f| f.1), Some(n), "the snapshot's block at the home block's address");
    a.free_raw(p as *mut u8).unwrap();
    drop(b);
    let h = a.history();
    let frees: Vec<_> = h.iter().filter(|e| e.kind == HistoryKind::FreeCompleted).map(|e| e.addr).collect();
    assert!(frees.contains(&p), "{h:?}");
    assert!(find(p).is_none_or(|f| f.1 == 0), "freed, the snapshot still shows a request at {p:#x}");
    a.free_raw(first).unwrap();
    a.check_invariants().unwrap();
}
