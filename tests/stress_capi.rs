//! The C API under concurrency, checked against a shadow model (issue 9, build item 3).
//!
//! Many threads allocate, free, copy (host to device, device to host, device to device, peer)
//! and fill on many streams of two devices, synchronously and on streams, with events,
//! stream waits, device synchronizes, stream and event creation and destruction, and stream
//! callbacks that themselves call the C API. Every thread keeps a shadow of the bytes each of
//! its live blocks must hold; every read-back is compared byte for byte, every status with
//! what the contract in `include/dmabuf_rt.h` says. At the end everything is freed and the
//! allocators' statistics and the process's open fds are back to their baseline.
//!
//! Beside it, targeted races: two threads freeing one pointer (exactly one may succeed), stale
//! frees under contention (refused, and never landing on another thread's live block),
//! stream destruction racing device synchronization, a host-to-device copy on a stream of
//! another device followed by a synchronous read, foreign work seen by two concurrent
//! synchronizers, and callbacks calling synchronous functions.
//!
//! Each test runs in a child process of its own (`common::isolate`): the runtime is
//! process-wide and reads `DMABUF_RT_DEVICES` once, and the checks compare process-wide counts.
//! A watchdog in the child turns a hang into a failure naming the call in flight. Seeds are
//! fixed (`DMABUF_RT_STRESS_SEED` changes them, `DMABUF_RT_STRESS_SCALE` multiplies the
//! iteration counts; `DMABUF_RT_STRESS_DEVICES` replaces `shmem,shmem`, e.g. in the kernel
//! lane).

#![allow(unsafe_code)]

mod common;

use std::collections::HashSet;
use std::ffi::{CStr, c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex, RwLock};
use std::time::Duration;

use common::isolate::{Watch, is_child, isolated, watchdog};
use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;
use dmabuf_rt::ffi::capi::*;

/// How long a child may take before its watchdog reports a hang: each test takes a few
/// seconds in debug on two busy cores (the whole binary well under 20 s);
/// `DMABUF_RT_STRESS_TIME_SCALE` multiplies it (ThreadSanitizer runs 5-15 times slower).
fn child_limit() -> Duration {
    let k: u32 = std::env::var("DMABUF_RT_STRESS_TIME_SCALE").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    Duration::from_secs(15) * k.max(1)
}

/// Runs the test `name` in a child with the stress devices; the child runs `body` under the
/// watchdog with `threads` worker slots.
fn stress(name: &str, threads: usize, body: impl FnOnce(&Watch) + Send + 'static) {
    if is_child(name) {
        watchdog(name, threads, child_limit(), body);
        return;
    }
    let devices = std::env::var("DMABUF_RT_STRESS_DEVICES").unwrap_or_else(|_| "shmem,shmem".into());
    isolated(
        name,
        &[("DMABUF_RT_DEVICES", &devices), ("DMABUF_RT_CAPACITY", "256M")],
        child_limit() + Duration::from_secs(10),
    );
}

fn scale() -> usize {
    std::env::var("DMABUF_RT_STRESS_SCALE").ok().and_then(|s| s.parse().ok()).unwrap_or(1).max(1)
}

fn seed() -> u64 {
    std::env::var("DMABUF_RT_STRESS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_d0a0_0b0f)
}

/// splitmix64: small, deterministic, good enough to pick operations.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(n);
        v
    }
    /// A sub-range `(offset, len)` of `0..size`, len >= 1.
    fn range(&mut self, size: usize) -> (usize, usize) {
        let off = self.below(size);
        let len = 1 + self.below(size - off);
        (off, len)
    }
}

// ---- thin wrappers: statuses with the last error ----

fn last_error() -> String {
    let p = dmabuf_rt_last_error();
    if p.is_null() {
        return "(dmabuf_rt_last_error() is NULL)".into();
    }
    // SAFETY: a non-null last error is a NUL-terminated string valid until this thread's next
    // failing call.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn describe(s: dmabuf_rt_status) -> String {
    if s == DMABUF_RT_OK { "DMABUF_RT_OK".into() } else { format!("{s:?}: {}", last_error()) }
}

#[track_caller]
fn ok(s: dmabuf_rt_status, what: &dyn std::fmt::Display) {
    assert_eq!(s, DMABUF_RT_OK, "{what}: {}", describe(s));
}

fn stats(device: c_int) -> dmabuf_rt_stats {
    let mut s = dmabuf_rt_stats::default();
    // SAFETY: `s` is a valid out-pointer.
    ok(unsafe { dmabuf_rt_device_stats(device, &mut s) }, &"dmabuf_rt_device_stats");
    s
}

fn alloc(device: c_int, size: usize) -> (dmabuf_rt_status, *mut c_void) {
    let mut p = null_mut();
    // SAFETY: `p` is a valid out-pointer.
    let s = unsafe { dmabuf_rt_device_alloc(device, size, &mut p) };
    (s, p)
}

/// # Safety
/// Host sides must be valid as `dmabuf_rt_memcpy` requires (live for reads until it returns,
/// for writes until the stream has passed the copy).
unsafe fn memcpy(
    (dst_dev, dst): (c_int, *mut c_void),
    (src_dev, src): (c_int, *const c_void),
    size: usize,
    kind: dmabuf_rt_memcpy_kind,
    stream: dmabuf_rt_stream,
) -> dmabuf_rt_status {
    // SAFETY: the caller's contract.
    unsafe { dmabuf_rt_memcpy(dst_dev, dst, src_dev, src, size, kind, stream) }
}

/// A synchronous read of `len` bytes of device memory.
fn read_sync(dev: c_int, p: *const c_void, len: usize) -> (dmabuf_rt_status, Vec<u8>) {
    let mut out = vec![0u8; len];
    // SAFETY: `out` is a live buffer of `len` bytes; the copy is synchronous.
    let s = unsafe { memcpy((0, out.as_mut_ptr().cast()), (dev, p), len, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0) };
    (s, out)
}

fn write_sync(dev: c_int, p: *mut c_void, data: &[u8], stream: dmabuf_rt_stream) -> dmabuf_rt_status {
    // SAFETY: `data` is live for the call; a host-to-device copy reads it before returning,
    // even on a stream.
    unsafe { memcpy((dev, p), (0, data.as_ptr().cast()), data.len(), DMABUF_RT_MEMCPY_HOST_TO_DEVICE, stream) }
}

fn new_stream(device: c_int) -> dmabuf_rt_stream {
    let mut s = 0;
    // SAFETY: `s` is a valid out-pointer.
    ok(unsafe { dmabuf_rt_stream_create(device, &mut s) }, &format_args!("dmabuf_rt_stream_create({device})"));
    assert_ne!(s, 0);
    s
}

fn new_event() -> dmabuf_rt_event {
    let mut e = 0;
    // SAFETY: `e` is a valid out-pointer.
    ok(unsafe { dmabuf_rt_event_create(&mut e) }, &"dmabuf_rt_event_create");
    assert_ne!(e, 0);
    e
}

fn open_fds() -> usize {
    common::open_fds()
}

/// Brings the runtime up and touches everything that is created once per process (the
/// devices' own streams, the fence watcher), then empties the caches: the baseline the end of
/// a test is compared with.
fn warm_up() -> (usize, [dmabuf_rt_stats; 2]) {
    for dev in 0..2 {
        let (s, p) = alloc(dev, 4096);
        ok(s, &"warm-up alloc");
        ok(dmabuf_rt_memset(dev, p, 1, 4096), &"warm-up memset");
        let st = new_stream(dev);
        ok(write_sync(dev, p, &[2; 4096], st), &"warm-up h2d");
        let ev = new_event();
        ok(dmabuf_rt_event_record(ev, st), &"warm-up record");
        ok(dmabuf_rt_event_synchronize(ev), &"warm-up event sync");
        ok(dmabuf_rt_event_record(ev, 0), &"warm-up record on the device's own stream");
        ok(dmabuf_rt_event_destroy(ev), &"warm-up event destroy");
        ok(dmabuf_rt_stream_destroy(st), &"warm-up stream destroy");
        let (s, back) = read_sync(dev, p, 4096);
        ok(s, &"warm-up d2h");
        assert!(back.iter().all(|&b| b == 2));
        ok(dmabuf_rt_device_free(dev, p), &"warm-up free");
        ok(dmabuf_rt_device_synchronize(dev), &"warm-up synchronize");
        ok(dmabuf_rt_empty_cache(dev), &"warm-up empty_cache");
    }
    (open_fds(), [stats(0), stats(1)])
}

/// Everything freed: no live allocation, as many frees as allocations since the baseline,
/// nothing reserved once the caches are emptied, and the open fds back to the baseline.
#[track_caller]
fn back_to_baseline((fds, base): &(usize, [dmabuf_rt_stats; 2])) {
    for dev in 0..2 {
        ok(dmabuf_rt_device_synchronize(dev), &"final synchronize");
        ok(dmabuf_rt_empty_cache(dev), &"final empty_cache");
    }
    let mut problems = Vec::new();
    for dev in 0..2 {
        let (s, b) = (stats(dev), base[dev as usize]);
        if s.allocated_bytes != 0 || s.allocations != 0 {
            problems
                .push(format!("device {dev}: {} bytes in {} allocations still live", s.allocated_bytes, s.allocations));
        }
        let (allocs, frees) = (s.num_allocs - b.num_allocs, s.num_frees - b.num_frees);
        if allocs != frees {
            problems.push(format!("device {dev}: {allocs} allocations but {frees} frees since the baseline"));
        }
        if s.reserved_bytes != 0 {
            problems.push(format!(
                "device {dev}: {} bytes still reserved after empty_cache (issue 9, defect 12)",
                s.reserved_bytes
            ));
        }
    }
    let now = open_fds();
    if now != *fds {
        problems.push(format!("open fds: {now} now, {fds} at the baseline ({})", common::fd_summary()));
    }
    assert!(problems.is_empty(), "not back to the baseline:\n  {}", problems.join("\n  "));
}

// ---- the shadow-model stress ----

/// A live block and the bytes it must hold.
#[derive(Debug)]
struct Block {
    dev: c_int,
    ptr: *mut c_void,
    shadow: Vec<u8>,
    /// The stream of the last queued operation on it, if that may not have run yet.
    stream: Option<dmabuf_rt_stream>,
}

/// A device-to-host copy queued on a stream: `host` must equal `expect` once the stream has
/// passed it. A callback queued after it may check it too (`checked_by`).
#[derive(Debug)]
struct PendingRead {
    host: Vec<u8>,
    expect: Vec<u8>,
    what: String,
    checked_by: Option<Arc<CallbackSlot>>,
}

#[derive(Debug)]
struct Stream {
    h: dmabuf_rt_stream,
    dev: c_int,
    pending: Vec<PendingRead>,
    /// Callbacks queued and not yet known to have run.
    callbacks: Vec<Arc<CallbackSlot>>,
}

/// What a callback reports.
#[derive(Debug, Default)]
struct CallbackSlot {
    runs: AtomicUsize,
    errors: Mutex<Vec<String>>,
}

/// The callback's user data (owned by the callback once queued).
struct CallbackData {
    slot: Arc<CallbackSlot>,
    /// A pending read's host buffer and expected bytes (both owned by the `PendingRead`,
    /// which lives until its stream has been synchronized, after this callback ran).
    check: Option<(*const u8, *const u8, usize)>,
    /// A device for the C calls the callback makes.
    dev: c_int,
}

unsafe extern "C" fn stress_callback(stream: dmabuf_rt_stream, status: dmabuf_rt_status, user: *mut c_void) {
    // SAFETY: `user` is the `Box<CallbackData>` leaked when this callback was queued, passed
    // to exactly this one call.
    let data = unsafe { Box::from_raw(user.cast::<CallbackData>()) };
    let mut errors = Vec::new();
    if status != DMABUF_RT_OK {
        errors.push(format!("callback called with {status:?}"));
    }
    if let Some((host, expect, len)) = data.check {
        // SAFETY: both buffers are live and not written by anyone while the stream runs this
        // callback (see `CallbackData::check`); the copy before it has completed.
        let h = unsafe { std::slice::from_raw_parts(host, len) };
        // SAFETY: as above.
        let e = unsafe { std::slice::from_raw_parts(expect, len) };
        if h != e {
            let at = h.iter().zip(e).position(|(a, b)| a != b).unwrap_or(0);
            errors.push(format!("a callback after a d2h copy saw stale bytes (first difference at {at} of {len})"));
        }
    }
    // C API calls from the stream's own thread that do not wait for the stream.
    let mut st = dmabuf_rt_stats::default();
    // SAFETY: valid out-pointer.
    let s = unsafe { dmabuf_rt_device_stats(data.dev, &mut st) };
    if s != DMABUF_RT_OK {
        errors.push(format!("dmabuf_rt_device_stats in a callback: {}", describe(s)));
    }
    let (s, p) = alloc(data.dev, 3000);
    if s == DMABUF_RT_OK {
        let s = dmabuf_rt_device_free(data.dev, p);
        if s != DMABUF_RT_OK {
            errors.push(format!("dmabuf_rt_device_free in a callback: {}", describe(s)));
        }
    } else {
        errors.push(format!("dmabuf_rt_device_alloc in a callback: {}", describe(s)));
    }
    // Calls on its own stream: the handle is dead once `dmabuf_rt_stream_destroy` has begun
    // (which runs the callbacks still queued), so INVALID_HANDLE is right then.
    let own_ok = |s| s == DMABUF_RT_OK || s == DMABUF_RT_INVALID_HANDLE;
    let mut done = true;
    // SAFETY: valid out-pointer.
    let s = unsafe { dmabuf_rt_stream_query(stream, &mut done) };
    if !own_ok(s) {
        errors.push(format!("dmabuf_rt_stream_query(own stream) in a callback: {}", describe(s)));
    }
    let mut ev = 0;
    // SAFETY: valid out-pointer.
    let s = unsafe { dmabuf_rt_event_create(&mut ev) };
    if s == DMABUF_RT_OK {
        let s = dmabuf_rt_event_record(ev, stream);
        if !own_ok(s) {
            errors.push(format!("dmabuf_rt_event_record(own stream) in a callback: {}", describe(s)));
        }
        let s = dmabuf_rt_event_destroy(ev);
        if s != DMABUF_RT_OK {
            errors.push(format!("dmabuf_rt_event_destroy in a callback: {}", describe(s)));
        }
    } else {
        errors.push(format!("dmabuf_rt_event_create in a callback: {}", describe(s)));
    }
    data.slot.errors.lock().unwrap().extend(errors);
    data.slot.runs.fetch_add(1, Ordering::SeqCst);
}

/// One worker's state.
struct Worker<'w> {
    t: usize,
    rng: Rng,
    watch: &'w Watch,
    blocks: Vec<Block>,
    streams: Vec<Stream>,
    /// Every callback queued, checked at the end to have run exactly once.
    all_callbacks: Vec<Arc<CallbackSlot>>,
    /// Sync operations rely on the documented implicit waits instead of settling streams.
    implicit: bool,
    step: usize,
}

impl Worker<'_> {
    fn at(&self, what: impl FnOnce() -> String) {
        let step = self.step;
        self.watch.at(self.t, || format!("step {step}: {}", what()));
    }

    fn stream_index(&self, h: dmabuf_rt_stream) -> usize {
        self.streams.iter().position(|s| s.h == h).expect("a block's stream is live")
    }

    /// A stream of this worker (created if there are few).
    fn pick_stream(&mut self) -> dmabuf_rt_stream {
        if self.streams.len() < 2 || (self.streams.len() < 4 && self.rng.chance(10)) {
            let dev = self.rng.below(2) as c_int;
            self.at(|| format!("dmabuf_rt_stream_create({dev})"));
            let h = new_stream(dev);
            self.streams.push(Stream { h, dev, pending: Vec::new(), callbacks: Vec::new() });
        }
        let i = self.rng.below(self.streams.len());
        self.streams[i].h
    }

    /// Everything queued on stream `i` has run: check its reads and callbacks.
    fn settled(&mut self, i: usize) {
        let h = self.streams[i].h;
        for r in std::mem::take(&mut self.streams[i].pending) {
            if r.host != r.expect {
                let at = r.host.iter().zip(&r.expect).position(|(a, b)| a != b).unwrap_or(0);
                panic!(
                    "thread {}: {} read stale or wrong bytes (first difference at byte {at} of {}: got {:#04x}, want \
                     {:#04x})",
                    self.t,
                    r.what,
                    r.expect.len(),
                    r.host[at],
                    r.expect[at]
                );
            }
            drop(r.checked_by);
        }
        for cb in std::mem::take(&mut self.streams[i].callbacks) {
            let runs = cb.runs.load(Ordering::SeqCst);
            assert_eq!(
                runs, 1,
                "thread {}: a callback on stream {h} ran {runs} times once the stream was idle",
                self.t
            );
            let errs = cb.errors.lock().unwrap();
            assert!(errs.is_empty(), "thread {}: callback on stream {h}: {}", self.t, errs.join("; "));
        }
        for b in &mut self.blocks {
            if b.stream == Some(h) {
                b.stream = None;
            }
        }
    }

    /// Waits for stream `h` by one of the ways the API offers.
    fn settle(&mut self, h: dmabuf_rt_stream) {
        let i = self.stream_index(h);
        let dev = self.streams[i].dev;
        match self.rng.below(4) {
            0 => {
                self.at(|| format!("dmabuf_rt_stream_synchronize({h})"));
                ok(dmabuf_rt_stream_synchronize(h), &format_args!("thread {}: stream_synchronize", self.t));
                self.settled(i);
            }
            1 => {
                let ev = new_event();
                self.at(|| format!("dmabuf_rt_event_record({ev}, {h}) + dmabuf_rt_event_synchronize"));
                ok(dmabuf_rt_event_record(ev, h), &"event_record");
                ok(dmabuf_rt_event_synchronize(ev), &"event_synchronize");
                let mut done = false;
                // SAFETY: valid out-pointer.
                ok(unsafe { dmabuf_rt_event_query(ev, &mut done) }, &"event_query");
                assert!(done, "thread {}: an event is not complete after event_synchronize", self.t);
                ok(dmabuf_rt_event_destroy(ev), &"event_destroy");
                self.settled(i);
            }
            2 => {
                self.at(|| format!("dmabuf_rt_device_synchronize({dev}) for stream {h}"));
                ok(dmabuf_rt_device_synchronize(dev), &format_args!("thread {}: device_synchronize({dev})", self.t));
                // Every stream of that device is done.
                for j in 0..self.streams.len() {
                    if self.streams[j].dev == dev {
                        self.settled(j);
                    }
                }
            }
            _ => {
                // Polls stream_query until done: bounded by the watchdog.
                self.at(|| format!("dmabuf_rt_stream_query({h}) until done"));
                loop {
                    let mut done = false;
                    // SAFETY: valid out-pointer.
                    ok(unsafe { dmabuf_rt_stream_query(h, &mut done) }, &"stream_query");
                    if done {
                        break;
                    }
                    std::thread::yield_now();
                }
                self.settled(i);
            }
        }
    }

    /// Block `b` is about to be used by a synchronous operation.
    fn before_sync(&mut self, b: usize) {
        if let Some(h) = self.blocks[b].stream {
            if self.implicit {
                // The synchronous call waits for the work on the memory it touches, whatever
                // stream queued it (the contract; issue 9 defects 2 and 3).
                self.blocks[b].stream = None;
            } else {
                self.settle(h);
            }
        }
    }

    /// Block `b` is about to be used on stream `to`: order it after its previous stream.
    fn before_async(&mut self, b: usize, to: dmabuf_rt_stream) {
        match self.blocks[b].stream {
            Some(from) if from != to => {
                if self.rng.chance(50) {
                    let ev = new_event();
                    self.at(|| format!("event {ev} recorded on {from}, waited for by {to}"));
                    ok(dmabuf_rt_event_record(ev, from), &"event_record");
                    ok(dmabuf_rt_stream_wait_event(to, ev), &"stream_wait_event");
                    // Streams already waiting still wait.
                    ok(dmabuf_rt_event_destroy(ev), &"event_destroy");
                } else {
                    self.settle(from);
                }
            }
            _ => {}
        }
        self.blocks[b].stream = Some(to);
    }

    fn alloc_block(&mut self) {
        let dev = self.rng.below(2) as c_int;
        let size = match self.rng.below(10) {
            0 => 256 << 10 | self.rng.below(4096),
            1..=4 => 1 + self.rng.below(4096),
            _ => 4097 + self.rng.below(60_000),
        };
        self.at(|| format!("dmabuf_rt_device_alloc({dev}, {size})"));
        let (s, p) = alloc(dev, size);
        ok(s, &format_args!("thread {}: alloc({dev}, {size})", self.t));
        assert!(!p.is_null());
        // Blocks come back from the cache dirty: give it known bytes.
        let shadow = if self.rng.chance(50) {
            let v = self.rng.below(256) as u8;
            self.at(|| format!("dmabuf_rt_memset({dev}, {p:?}, {v}, {size})"));
            ok(dmabuf_rt_memset(dev, p, c_int::from(v), size), &"memset of a new block");
            vec![v; size]
        } else {
            let data = self.rng.bytes(size);
            self.at(|| format!("h2d of a new block ({size} bytes, synchronous)"));
            ok(write_sync(dev, p, &data, 0), &"h2d of a new block");
            data
        };
        self.blocks.push(Block { dev, ptr: p, shadow, stream: None });
    }

    fn free_block(&mut self, b: usize) {
        if let Some(h) = self.blocks[b].stream {
            // Freeing needs the streams done with it whatever the mode (the contract).
            self.settle(h);
        }
        let blk = self.blocks.swap_remove(b);
        self.at(|| format!("dmabuf_rt_device_free({}, {:?})", blk.dev, blk.ptr));
        ok(dmabuf_rt_device_free(blk.dev, blk.ptr), &format_args!("thread {}: free of a live block", self.t));
    }

    /// One random operation.
    fn step(&mut self) {
        if self.blocks.is_empty() || (self.blocks.len() < 6 && self.rng.chance(12)) {
            return self.alloc_block();
        }
        let b = self.rng.below(self.blocks.len());
        match self.rng.below(100) {
            0..=7 => self.free_block(b),
            8..=22 => {
                // h2d of a sub-range, synchronous or on a stream.
                let (off, len) = self.rng.range(self.blocks[b].shadow.len());
                let mut data = self.rng.bytes(len);
                let (dev, p) = (self.blocks[b].dev, self.blocks[b].ptr.wrapping_byte_add(off));
                let stream = if self.rng.chance(50) { self.pick_stream() } else { 0 };
                if stream == 0 {
                    self.before_sync(b);
                } else {
                    self.before_async(b, stream);
                }
                self.at(|| format!("h2d {len} bytes at +{off} of a block of device {dev}, stream {stream}"));
                ok(write_sync(dev, p, &data, stream), &format_args!("thread {}: h2d on stream {stream}", self.t));
                self.blocks[b].shadow[off..off + len].copy_from_slice(&data);
                // The copy read the host bytes before returning: reusing them is allowed.
                data.fill(0xee);
            }
            23..=40 => {
                // d2h of a sub-range, compared with the shadow.
                let (off, len) = self.rng.range(self.blocks[b].shadow.len());
                let (dev, p) = (self.blocks[b].dev, self.blocks[b].ptr.wrapping_byte_add(off));
                let expect = self.blocks[b].shadow[off..off + len].to_vec();
                if self.rng.chance(50) {
                    self.before_sync(b);
                    self.at(|| format!("synchronous d2h {len} bytes at +{off} of a block of device {dev}"));
                    let (s, got) = read_sync(dev, p, len);
                    ok(s, &format_args!("thread {}: synchronous d2h", self.t));
                    if got != expect {
                        let at = got.iter().zip(&expect).position(|(a, c)| a != c).unwrap_or(0);
                        panic!(
                            "thread {}, step {}: synchronous d2h of {len} bytes at +{off} of a block of device {dev} \
                             read wrong bytes (first difference at {at}: got {:#04x}, want {:#04x})",
                            self.t, self.step, got[at], expect[at]
                        );
                    }
                } else {
                    let stream = self.pick_stream();
                    self.before_async(b, stream);
                    let mut host = vec![0u8; len];
                    self.at(|| format!("d2h {len} bytes on stream {stream} from device {dev}"));
                    // SAFETY: `host`'s heap buffer stays live and untouched in `pending` until
                    // the stream has been synchronized.
                    let s = unsafe {
                        memcpy((0, host.as_mut_ptr().cast()), (dev, p), len, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, stream)
                    };
                    ok(s, &format_args!("thread {}: d2h on stream {stream}", self.t));
                    let step = self.step;
                    let i = self.stream_index(stream);
                    let mut read = PendingRead {
                        host,
                        expect,
                        what: format!("step {step}: d2h of {len} bytes at +{off} on stream {stream}"),
                        checked_by: None,
                    };
                    if self.rng.chance(40) {
                        let slot = Arc::new(CallbackSlot::default());
                        let data = Box::new(CallbackData {
                            slot: Arc::clone(&slot),
                            check: Some((read.host.as_ptr(), read.expect.as_ptr(), len)),
                            dev: self.rng.below(2) as c_int,
                        });
                        self.at(|| format!("dmabuf_rt_stream_add_callback({stream})"));
                        let user = Box::into_raw(data).cast::<c_void>();
                        // SAFETY: the callback is callable from any thread; `user` is a leaked
                        // box it takes back; the buffers it reads outlive it (`CallbackData`).
                        let s = unsafe { dmabuf_rt_stream_add_callback(stream, Some(stress_callback), user) };
                        ok(s, &"stream_add_callback");
                        read.checked_by = Some(Arc::clone(&slot));
                        self.streams[i].callbacks.push(Arc::clone(&slot));
                        self.all_callbacks.push(slot);
                    }
                    self.streams[i].pending.push(read);
                }
            }
            41..=55 => {
                // Device to device (or peer) between two of this worker's blocks.
                if self.blocks.len() < 2 {
                    return self.alloc_block();
                }
                let mut c = self.rng.below(self.blocks.len() - 1);
                if c >= b {
                    c += 1;
                }
                let (dst, src) = (b, c);
                let max = self.blocks[dst].shadow.len().min(self.blocks[src].shadow.len());
                let len = 1 + self.rng.below(max);
                let doff = self.rng.below(self.blocks[dst].shadow.len() - len + 1);
                let soff = self.rng.below(self.blocks[src].shadow.len() - len + 1);
                let (dd, sd) = (self.blocks[dst].dev, self.blocks[src].dev);
                let kind = if dd != sd && self.rng.chance(70) {
                    DMABUF_RT_MEMCPY_PEER_TO_PEER
                } else {
                    DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE
                };
                let stream = if self.rng.chance(50) { self.pick_stream() } else { 0 };
                if stream == 0 {
                    self.before_sync(dst);
                    self.before_sync(src);
                } else {
                    self.before_async(dst, stream);
                    self.before_async(src, stream);
                }
                let (dp, sp) =
                    (self.blocks[dst].ptr.wrapping_byte_add(doff), self.blocks[src].ptr.wrapping_byte_add(soff));
                self.at(|| format!("copy kind {kind} {len} bytes device {sd} -> {dd}, stream {stream}"));
                // SAFETY: both sides are device memory.
                let s = unsafe { memcpy((dd, dp), (sd, sp), len, kind, stream) };
                ok(s, &format_args!("thread {}: copy kind {kind} device {sd} -> {dd} on stream {stream}", self.t));
                let moved = self.blocks[src].shadow[soff..soff + len].to_vec();
                self.blocks[dst].shadow[doff..doff + len].copy_from_slice(&moved);
            }
            56..=63 => {
                let (off, len) = self.rng.range(self.blocks[b].shadow.len());
                let v = self.rng.below(256) as u8;
                let (dev, p) = (self.blocks[b].dev, self.blocks[b].ptr.wrapping_byte_add(off));
                self.before_sync(b);
                self.at(|| format!("dmabuf_rt_memset({dev}, +{off}, {v}, {len})"));
                ok(dmabuf_rt_memset(dev, p, c_int::from(v), len), &format_args!("thread {}: memset", self.t));
                self.blocks[b].shadow[off..off + len].fill(v);
            }
            64..=69 => {
                let dev = self.rng.below(2) as c_int;
                self.at(|| format!("dmabuf_rt_device_synchronize({dev})"));
                ok(dmabuf_rt_device_synchronize(dev), &format_args!("thread {}: device_synchronize({dev})", self.t));
                for j in 0..self.streams.len() {
                    if self.streams[j].dev == dev {
                        self.settled(j);
                    }
                }
            }
            70..=75 => {
                // Destroy a stream: its work runs first (callbacks included).
                if self.streams.is_empty() {
                    return;
                }
                let i = self.rng.below(self.streams.len());
                let h = self.streams[i].h;
                self.at(|| format!("dmabuf_rt_stream_destroy({h})"));
                ok(dmabuf_rt_stream_destroy(h), &format_args!("thread {}: stream_destroy", self.t));
                self.settled(i);
                self.streams.swap_remove(i);
                let s = dmabuf_rt_stream_synchronize(h);
                assert_eq!(s, DMABUF_RT_INVALID_HANDLE, "a destroyed stream's handle: {}", describe(s));
            }
            76..=81 => {
                // An event recorded on the device's own stream completes at once.
                let dev = self.rng.below(2) as c_int;
                ok(dmabuf_rt_set_device(dev), &"set_device");
                let ev = new_event();
                self.at(|| format!("dmabuf_rt_event_record({ev}, 0) on device {dev}"));
                ok(dmabuf_rt_event_record(ev, 0), &"event_record(ev, 0)");
                let mut done = false;
                // SAFETY: valid out-pointer.
                ok(unsafe { dmabuf_rt_event_query(ev, &mut done) }, &"event_query");
                assert!(
                    done,
                    "thread {}: an event recorded with stream 0 is documented to complete at once, but \
                     event_query says not yet (issue 9, defect 12)",
                    self.t
                );
                ok(dmabuf_rt_event_destroy(ev), &"event_destroy");
            }
            82..=87 => {
                // A callback with nothing to check but its own C calls.
                let stream = self.pick_stream();
                let slot = Arc::new(CallbackSlot::default());
                let data =
                    Box::new(CallbackData { slot: Arc::clone(&slot), check: None, dev: self.rng.below(2) as c_int });
                self.at(|| format!("dmabuf_rt_stream_add_callback({stream})"));
                // SAFETY: as for the checking callback above.
                let s =
                    unsafe { dmabuf_rt_stream_add_callback(stream, Some(stress_callback), Box::into_raw(data).cast()) };
                ok(s, &"stream_add_callback");
                let i = self.stream_index(stream);
                self.streams[i].callbacks.push(Arc::clone(&slot));
                self.all_callbacks.push(slot);
            }
            88..=93 => {
                // Queries never wait and never fail on live handles.
                if let Some(st) = self.streams.first() {
                    let mut done = false;
                    // SAFETY: valid out-pointer.
                    ok(unsafe { dmabuf_rt_stream_query(st.h, &mut done) }, &"stream_query");
                }
                let dev = self.rng.below(2) as c_int;
                let (mut total, mut free) = (0, 0);
                // SAFETY: valid out-pointers.
                ok(unsafe { dmabuf_rt_device_memory(dev, &mut total, &mut free) }, &"device_memory");
                assert!(free <= total);
                let s = stats(dev);
                assert!(s.reserved_bytes >= s.allocated_bytes, "device {dev}: reserved < allocated: {s:?}");
            }
            _ => {
                // Settle a random stream.
                if !self.streams.is_empty() {
                    let h = self.streams[self.rng.below(self.streams.len())].h;
                    self.settle(h);
                }
            }
        }
    }

    fn finish(&mut self) {
        while !self.blocks.is_empty() {
            self.free_block(0);
        }
        for st in std::mem::take(&mut self.streams) {
            let h = st.h;
            self.at(|| format!("final dmabuf_rt_stream_destroy({h})"));
            self.streams.push(st);
            ok(dmabuf_rt_stream_destroy(h), &"final stream_destroy");
            self.settled(0);
            self.streams.clear();
        }
        for (i, cb) in self.all_callbacks.iter().enumerate() {
            assert_eq!(cb.runs.load(Ordering::SeqCst), 1, "thread {}: callback #{i} did not run exactly once", self.t);
        }
        self.watch.done(self.t);
    }
}

const THREADS: usize = 8;

fn shadow_model(watch: &Watch, implicit: bool) {
    let baseline = warm_up();
    let steps = 1000 * scale();
    let base_seed = seed() ^ if implicit { 0x1111 } else { 0 };
    std::thread::scope(|s| {
        for t in 0..THREADS {
            s.spawn(move || {
                let mut w = Worker {
                    t,
                    rng: Rng::new(base_seed.wrapping_add(t as u64 * 0x1000_0001)),
                    watch,
                    blocks: Vec::new(),
                    streams: Vec::new(),
                    all_callbacks: Vec::new(),
                    implicit,
                    step: 0,
                };
                for step in 0..steps {
                    w.step = step;
                    w.step();
                }
                w.finish();
            });
        }
    });
    back_to_baseline(&baseline);
}

/// Eight threads on both devices and many streams; before a synchronous use of memory that
/// a stream touched, the worker waits for that stream itself (stream or event synchronize,
/// device synchronize, query until done), and orders streams with events.
#[test]
fn shadow_model_explicit_waits() {
    stress("shadow_model_explicit_waits", THREADS, |w| shadow_model(w, false));
}

/// The same, relying on the documented implicit waits: a synchronous copy or memset waits for
/// the work queued on the memory it touches, including work queued on another device's
/// streams (issue 9, defects 2 and 3).
#[test]
fn shadow_model_implicit_waits() {
    stress("shadow_model_implicit_waits", THREADS, |w| shadow_model(w, true));
}

// ---- hostile frees ----

/// Two threads free the same pointer at once, many times, while two others allocate and free
/// (so the allocator's lock is often busy): exactly one free succeeds, the other is refused
/// with DMABUF_RT_INVALID_POINTER, and no block is ever handed out twice (issue 9, defect 4).
#[test]
fn double_free_race_exactly_one_succeeds() {
    stress("double_free_race_exactly_one_succeeds", 4, |watch| {
        let baseline = warm_up();
        let cycles = 1500 * scale();
        let live = Mutex::new(HashSet::<usize>::new());
        let stop = AtomicBool::new(false);
        let target = AtomicPtr::new(null_mut::<c_void>());
        let go = Barrier::new(2);
        let results = Mutex::new(Vec::<(usize, dmabuf_rt_status, String)>::new());
        std::thread::scope(|s| {
            // Contention: allocate, fill, read back, free; every pointer handed out is unique.
            for t in 2..4 {
                let (live, stop) = (&live, &stop);
                s.spawn(move || {
                    let mut rng = Rng::new(seed() ^ t as u64);
                    let mut mine: Vec<(*mut c_void, usize, u8)> = Vec::new();
                    let mut n = 0usize;
                    while !stop.load(Ordering::Relaxed) || !mine.is_empty() {
                        n += 1;
                        if mine.len() < 4 && !stop.load(Ordering::Relaxed) {
                            // Large-pool sizes: the contention shares the allocator's lock with
                            // the racers but never their (small-pool) block. Were it handed the
                            // racers' address between their two frees, the second free would
                            // name a live allocation again: an ambiguity no allocator can see
                            // through from a bare pointer.
                            let size = (1 << 20) + 512 * (1 + rng.below(16));
                            watch.at(t, || format!("contention #{n}: alloc(0, {size})"));
                            let (st, p) = alloc(0, size);
                            ok(st, &"contention alloc");
                            let fresh = live.lock().unwrap().insert(p as usize);
                            assert!(fresh, "block {p:?} handed out twice (issue 9, defect 4)");
                            let v = rng.below(256) as u8;
                            ok(dmabuf_rt_memset(0, p, c_int::from(v), size), &"contention memset");
                            mine.push((p, size, v));
                        } else {
                            let (p, size, v) = mine.swap_remove(rng.below(mine.len()));
                            watch.at(t, || format!("contention #{n}: read back and free {p:?}"));
                            let (st, back) = read_sync(0, p, size);
                            ok(st, &"contention read-back");
                            assert!(
                                back.iter().all(|&b| b == v),
                                "a live block of a contention thread was overwritten: another thread was handed it \
                                 (issue 9, defect 4)"
                            );
                            live.lock().unwrap().remove(&(p as usize));
                            let st = dmabuf_rt_device_free(0, p);
                            ok(st, &format_args!("contention thread {t}: free of its own live block {p:?}"));
                        }
                    }
                    watch.done(t);
                });
            }
            for t in 0..2 {
                let (target, go, results) = (&target, &go, &results);
                let live = &live;
                s.spawn(move || {
                    for cycle in 0..cycles {
                        if t == 0 {
                            watch.at(t, || format!("cycle {cycle}: alloc"));
                            let (st, p) = alloc(0, 4096);
                            ok(st, &"racer alloc");
                            assert!(live.lock().unwrap().insert(p as usize), "block {p:?} handed out twice");
                            live.lock().unwrap().remove(&(p as usize));
                            target.store(p, Ordering::SeqCst);
                        }
                        watch.at(t, || format!("cycle {cycle}: barrier before the race"));
                        go.wait();
                        let p = target.load(Ordering::SeqCst);
                        watch.at(t, || format!("cycle {cycle}: dmabuf_rt_device_free(0, {p:?}) racing the other"));
                        let st = dmabuf_rt_device_free(0, p);
                        let why = if st == DMABUF_RT_OK { String::new() } else { last_error() };
                        results.lock().unwrap().push((cycle, st, why));
                        go.wait();
                    }
                    watch.done(t);
                });
            }
            // The racers end first; then the contention threads drain.
            s.spawn(|| {
                // Wait for the racers' results to be complete: bounded by the watchdog.
                while results.lock().unwrap().len() < 2 * cycles {
                    std::thread::yield_now();
                }
                stop.store(true, Ordering::Relaxed);
            });
        });
        let results = results.into_inner().unwrap();
        let mut bad = Vec::new();
        for c in 0..cycles {
            let r: Vec<_> = results.iter().filter(|r| r.0 == c).collect();
            let oks = r.iter().filter(|r| r.1 == DMABUF_RT_OK).count();
            let refused = r.iter().filter(|r| r.1 == DMABUF_RT_INVALID_POINTER).count();
            if oks != 1 || refused != 1 {
                bad.push(format!("cycle {c}: {:?}", r.iter().map(|r| (r.1, &r.2)).collect::<Vec<_>>()));
            }
        }
        assert!(
            bad.is_empty(),
            "{} of {cycles} double-free races did not end with exactly one success and one \
             DMABUF_RT_INVALID_POINTER (issue 9, defect 4); first: {:?}",
            bad.len(),
            &bad[..bad.len().min(3)]
        );
        back_to_baseline(&baseline);
    });
}

/// Threads free their own already-freed pointers (when no one holds that address now),
/// interior pointers of their live blocks and live blocks on the wrong device, while others
/// allocate, fill and read back: every such free is refused, and every live block keeps its
/// bytes (a free queued unchecked and applied later would land on another thread's live
/// block; issue 9, defect 4).
#[test]
fn stale_frees_are_refused_under_contention() {
    const T: usize = 4;
    stress("stale_frees_are_refused_under_contention", T, |watch| {
        let baseline = warm_up();
        let steps = 600 * scale();
        // Registry of live pointers (every thread's): a stale free is only tried on an
        // address no one holds, with allocations and frees held off meanwhile (`gate`), so a
        // success can only be the library accepting a bad free.
        let live = Mutex::new(HashSet::<usize>::new());
        let gate = RwLock::new(());
        std::thread::scope(|s| {
            for t in 0..T {
                let (live, gate) = (&live, &gate);
                s.spawn(move || {
                    let mut rng = Rng::new(seed() ^ (t as u64 + 77));
                    let mut mine: Vec<(c_int, *mut c_void, usize, u8)> = Vec::new();
                    let mut freed: Vec<(c_int, *mut c_void)> = Vec::new();
                    for step in 0..steps {
                        match rng.below(10) {
                            0..=2 if mine.len() < 5 => {
                                let dev = rng.below(2) as c_int;
                                let size = 512 * (1 + rng.below(8));
                                watch.at(t, || format!("step {step}: alloc({dev}, {size})"));
                                let p = {
                                    let _g = gate.read().unwrap();
                                    let (st, p) = alloc(dev, size);
                                    ok(st, &"alloc");
                                    assert!(live.lock().unwrap().insert(p as usize), "{p:?} handed out twice");
                                    p
                                };
                                let v = rng.below(256) as u8;
                                ok(dmabuf_rt_memset(dev, p, c_int::from(v), size), &"memset");
                                mine.push((dev, p, size, v));
                            }
                            0..=3 if !mine.is_empty() => {
                                let (dev, p, size, v) = mine.swap_remove(rng.below(mine.len()));
                                watch.at(t, || format!("step {step}: check and free own {p:?}"));
                                let (st, back) = read_sync(dev, p, size);
                                ok(st, &"read-back");
                                assert!(back.iter().all(|&b| b == v), "thread {t}: a live block lost its bytes");
                                let _g = gate.read().unwrap();
                                live.lock().unwrap().remove(&(p as usize));
                                ok(dmabuf_rt_device_free(dev, p), &format_args!("thread {t}: free own live {p:?}"));
                                freed.push((dev, p));
                            }
                            4 | 5 if !freed.is_empty() => {
                                let (dev, p) = freed[rng.below(freed.len())];
                                watch.at(t, || format!("step {step}: stale free of {p:?}"));
                                let _g = gate.write().unwrap();
                                if live.lock().unwrap().contains(&(p as usize)) {
                                    // Reissued to someone: a free now would be a legitimate one.
                                    continue;
                                }
                                let st = dmabuf_rt_device_free(dev, p);
                                assert_eq!(
                                    st,
                                    DMABUF_RT_INVALID_POINTER,
                                    "thread {t}: a second free of {p:?} (no one holds it) was not refused: {} \
                                     (issue 9, defect 4)",
                                    describe(st)
                                );
                            }
                            6 if !mine.is_empty() => {
                                let (dev, p, _, _) = mine[rng.below(mine.len())];
                                watch.at(t, || format!("step {step}: interior and wrong-device frees of {p:?}"));
                                let st = dmabuf_rt_device_free(dev, p.wrapping_byte_add(256));
                                // Strictly inside the block (blocks are 512 bytes or more).
                                assert_eq!(st, DMABUF_RT_INVALID_POINTER, "interior free: {}", describe(st));
                                let st = dmabuf_rt_device_free(1 - dev, p);
                                assert_eq!(st, DMABUF_RT_INVALID_POINTER, "wrong-device free: {}", describe(st));
                            }
                            _ if !mine.is_empty() => {
                                let i = rng.below(mine.len());
                                let (dev, p, size, v) = mine[i];
                                watch.at(t, || format!("step {step}: read back {p:?}"));
                                let (st, back) = read_sync(dev, p, size);
                                ok(st, &"read-back");
                                assert!(
                                    back.iter().all(|&b| b == v),
                                    "thread {t}: a live block was overwritten (it was handed to someone else)"
                                );
                            }
                            _ => {}
                        }
                    }
                    for (dev, p, _, _) in mine {
                        let _g = gate.read().unwrap();
                        live.lock().unwrap().remove(&(p as usize));
                        ok(dmabuf_rt_device_free(dev, p), &"final free");
                    }
                    watch.done(t);
                });
            }
        });
        back_to_baseline(&baseline);
    });
}

// ---- stream and device races ----

/// Two threads create streams on device 0, queue work (and a callback) on some, and destroy
/// them, many times, while two others synchronize the device and copy and fill
/// synchronously: nothing hangs and every call succeeds (issue 9, defect 1: the synchronizer
/// records on a queue being destroyed, whose drop then waits forever, or whose record fails
/// with "the queue has been dropped").
#[test]
fn stream_destroy_races_device_synchronize() {
    stress("stream_destroy_races_device_synchronize", 4, |watch| {
        let baseline = warm_up();
        let rounds = 3000 * scale();
        let destroyers_left = AtomicUsize::new(2);
        std::thread::scope(|s| {
            for t in 0..2 {
                let destroyers_left = &destroyers_left;
                s.spawn(move || {
                    let (st, p) = alloc(0, 16 << 10);
                    ok(st, &"alloc");
                    let data = vec![0x42u8; 16 << 10];
                    for r in 0..rounds {
                        watch.at(t, || format!("round {r}: dmabuf_rt_stream_create(0)"));
                        let h = new_stream(0);
                        let slot = Arc::new(CallbackSlot::default());
                        let with_work = r % 4 == 0;
                        if with_work {
                            watch.at(t, || format!("round {r}: h2d and a callback on stream {h}"));
                            ok(write_sync(0, p, &data, h), &"h2d on the stream");
                            let cb = Box::new(CallbackData { slot: Arc::clone(&slot), check: None, dev: 1 });
                            // SAFETY: as in the shadow model.
                            let st = unsafe {
                                dmabuf_rt_stream_add_callback(h, Some(stress_callback), Box::into_raw(cb).cast())
                            };
                            ok(st, &"add_callback");
                        }
                        watch.at(t, || {
                            format!("round {r}: dmabuf_rt_stream_destroy({h}) while device 0 is synchronized")
                        });
                        let st = dmabuf_rt_stream_destroy(h);
                        assert_eq!(st, DMABUF_RT_OK, "round {r}: stream_destroy: {}", describe(st));
                        if with_work {
                            assert_eq!(slot.runs.load(Ordering::SeqCst), 1, "destroy runs the callback first");
                            let errs = slot.errors.lock().unwrap();
                            assert!(errs.is_empty(), "callback: {}", errs.join("; "));
                        }
                    }
                    destroyers_left.fetch_sub(1, Ordering::SeqCst);
                    ok(dmabuf_rt_device_free(0, p), &"free");
                    watch.done(t);
                });
            }
            for t in 2..4 {
                let destroyers_left = &destroyers_left;
                s.spawn(move || {
                    let (st, q) = alloc(0, 4096);
                    ok(st, &"alloc");
                    let mut n = 0;
                    while destroyers_left.load(Ordering::SeqCst) > 0 {
                        n += 1;
                        watch.at(t, || format!("#{n}: dmabuf_rt_device_synchronize(0) racing stream destroys"));
                        let st = dmabuf_rt_device_synchronize(0);
                        assert_eq!(st, DMABUF_RT_OK, "device_synchronize racing a stream destroy: {}", describe(st));
                        if n % 8 == 0 {
                            watch.at(t, || format!("#{n}: dmabuf_rt_memset(0) racing stream destroys"));
                            let st = dmabuf_rt_memset(0, q, 7, 4096);
                            assert_eq!(st, DMABUF_RT_OK, "memset racing a stream destroy: {}", describe(st));
                            watch.at(t, || format!("#{n}: synchronous d2h racing stream destroys"));
                            let (st, back) = read_sync(0, q, 4096);
                            assert_eq!(st, DMABUF_RT_OK, "synchronous copy racing a stream destroy: {}", describe(st));
                            assert!(back.iter().all(|&b| b == 7));
                        }
                    }
                    ok(dmabuf_rt_device_free(0, q), &"free");
                    watch.done(t);
                });
            }
        });
        back_to_baseline(&baseline);
    });
}

/// A host-to-device copy queued on a stream of device 1 into memory of device 0, then a
/// synchronous read, memset or device synchronize of device 0: each sees (or waits for) the
/// copy (issue 9, defect 2).
#[test]
fn h2d_on_another_devices_stream_then_synchronous_read() {
    stress("h2d_on_another_devices_stream_then_synchronous_read", 1, |watch| {
        let baseline = warm_up();
        const N: usize = 1 << 20;
        let (st, p) = alloc(0, N);
        ok(st, &"alloc");
        let s1 = new_stream(1);
        let s0 = new_stream(0);
        let mut rng = Rng::new(seed());
        let mut failures = Vec::new();
        for r in 0..60 * scale() {
            ok(dmabuf_rt_memset(0, p, 0, N), &"memset to zero");
            let data = rng.bytes(N);
            watch.at(0, || format!("round {r}: h2d on a stream of device 1 into device 0"));
            ok(write_sync(0, p, &data, s1), &"h2d on stream of device 1");
            match r % 3 {
                0 => {
                    watch.at(0, || format!("round {r}: synchronous d2h of device 0"));
                    let (st, back) = read_sync(0, p, N);
                    ok(st, &"synchronous read");
                    if back != data {
                        failures.push(format!("round {r}: a synchronous read did not wait for the h2d"));
                    }
                }
                1 => {
                    watch.at(0, || format!("round {r}: synchronous memset of the first half"));
                    ok(dmabuf_rt_memset(0, p, 0x11, N / 2), &"memset");
                    let (st, back) = read_sync(0, p, N);
                    ok(st, &"synchronous read");
                    if back[..N / 2].iter().any(|&b| b != 0x11) || back[N / 2..] != data[N / 2..] {
                        failures
                            .push(format!("round {r}: memset then read: the h2d ran after the memset or not at all"));
                    }
                }
                _ => {
                    watch.at(0, || format!("round {r}: dmabuf_rt_device_synchronize(0)"));
                    ok(dmabuf_rt_device_synchronize(0), &"device_synchronize(0)");
                    // Read on a stream of device 0, which by itself waits for nothing on
                    // device 1's streams: it sees the h2d only if device_synchronize(0) did.
                    // (An event recorded on s1 after the copy is no proxy: it completes after
                    // the copy's own completion, which is all device_synchronize(0) waits for.)
                    let mut back = vec![0u8; N];
                    // SAFETY: `back` is live until the stream is synchronized below.
                    let st = unsafe {
                        memcpy((0, back.as_mut_ptr().cast()), (0, p), N, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, s0)
                    };
                    ok(st, &"d2h on a stream of device 0");
                    ok(dmabuf_rt_stream_synchronize(s0), &"stream_synchronize(s0)");
                    if back != data {
                        failures.push(format!(
                            "round {r}: device_synchronize(0) returned before an h2d into device 0 queued on a \
                             stream of device 1"
                        ));
                    }
                }
            }
            ok(dmabuf_rt_stream_synchronize(s1), &"stream_synchronize");
        }
        ok(dmabuf_rt_stream_destroy(s1), &"stream_destroy");
        ok(dmabuf_rt_stream_destroy(s0), &"stream_destroy");
        ok(dmabuf_rt_device_free(0, p), &"free");
        watch.done(0);
        assert!(failures.is_empty(), "stale reads (issue 9, defect 2):\n  {}", failures.join("\n  "));
        back_to_baseline(&baseline);
    });
}

/// A peer copy queued on a stream of device 0 into memory of device 1, then two threads read
/// that memory synchronously at once: both see the copied bytes (issue 9, defect 3: the first
/// synchronizer took the foreign events away from the second).
#[test]
fn concurrent_synchronous_readers_both_wait_for_foreign_work() {
    stress("concurrent_synchronous_readers_both_wait_for_foreign_work", 3, |watch| {
        let baseline = warm_up();
        const N: usize = 1 << 20;
        let (st, src) = alloc(0, N);
        ok(st, &"alloc");
        let (st, dst) = alloc(1, N);
        ok(st, &"alloc");
        let (src_a, dst_a) = (src as usize, dst as usize);
        let s0 = new_stream(0);
        let go = Barrier::new(3);
        let stale = AtomicUsize::new(0);
        let rounds = 80 * scale();
        std::thread::scope(|s| {
            for t in 1..3 {
                let (go, stale) = (&go, &stale);
                s.spawn(move || {
                    for r in 0..rounds {
                        go.wait();
                        watch.at(t, || format!("round {r}: synchronous read of device 1"));
                        let (st, back) = read_sync(1, dst_a as *const c_void, N);
                        ok(st, &"synchronous read");
                        if back.iter().any(|&b| b != (r % 251) as u8 + 1) {
                            stale.fetch_add(1, Ordering::SeqCst);
                        }
                        go.wait();
                    }
                    watch.done(t);
                });
            }
            for r in 0..rounds {
                let v = (r % 251) as u8 + 1;
                watch.at(0, || format!("round {r}: memset + peer copy on a stream of device 0"));
                ok(dmabuf_rt_memset(0, src_a as *mut c_void, c_int::from(v), N), &"memset");
                // SAFETY: both sides are device memory.
                let st = unsafe {
                    memcpy((1, dst_a as *mut c_void), (0, src_a as *const c_void), N, DMABUF_RT_MEMCPY_PEER_TO_PEER, s0)
                };
                ok(st, &"peer copy on a stream");
                go.wait();
                go.wait();
                ok(dmabuf_rt_stream_synchronize(s0), &"stream_synchronize");
            }
            watch.done(0);
        });
        ok(dmabuf_rt_stream_destroy(s0), &"stream_destroy");
        ok(dmabuf_rt_device_free(0, src), &"free");
        ok(dmabuf_rt_device_free(1, dst), &"free");
        let n = stale.load(Ordering::SeqCst);
        assert_eq!(n, 0, "{n} of {} concurrent synchronous reads saw stale bytes (issue 9, defect 3)", 2 * rounds);
        back_to_baseline(&baseline);
    });
}

/// What a callback calling a synchronous function got.
#[derive(Debug, Default)]
struct SyncCallbackLog {
    calls: Mutex<Vec<(String, dmabuf_rt_status, String)>>,
    runs: AtomicUsize,
}

struct SyncCallbackData {
    log: Arc<SyncCallbackLog>,
    block: *mut c_void,
    expect: u8,
    /// The test's watch: slot 1 says which call the callback is in.
    watch: *const Watch,
}

unsafe extern "C" fn sync_callback(stream: dmabuf_rt_stream, _status: dmabuf_rt_status, user: *mut c_void) {
    // SAFETY: the leaked box given with this callback, passed to this one call.
    let d = unsafe { Box::from_raw(user.cast::<SyncCallbackData>()) };
    // SAFETY: the watch outlives the test body, which waits for this callback.
    let watch = unsafe { &*d.watch };
    let at = |what: &'static str| watch.at(1, || format!("in the stream's callback: {what}"));
    let mut calls = Vec::new();
    at("synchronous dmabuf_rt_memcpy (device to host)");
    let (st, back) = read_sync(0, d.block, 4096);
    let bytes = if st == DMABUF_RT_OK && back.iter().any(|&b| b != d.expect) { "wrong bytes" } else { "" };
    calls.push((
        "synchronous dmabuf_rt_memcpy".to_owned(),
        st,
        if st == DMABUF_RT_OK { bytes.into() } else { last_error() },
    ));
    at("dmabuf_rt_memset");
    let st = dmabuf_rt_memset(0, d.block, c_int::from(d.expect), 4096);
    calls.push(("dmabuf_rt_memset".to_owned(), st, if st == DMABUF_RT_OK { String::new() } else { last_error() }));
    at("dmabuf_rt_device_synchronize");
    let st = dmabuf_rt_device_synchronize(0);
    calls.push((
        "dmabuf_rt_device_synchronize".to_owned(),
        st,
        if st == DMABUF_RT_OK { String::new() } else { last_error() },
    ));
    at("dmabuf_rt_stream_synchronize(own stream)");
    let st = dmabuf_rt_stream_synchronize(stream);
    watch.done(1);
    calls.push((
        "dmabuf_rt_stream_synchronize(own stream)".to_owned(),
        st,
        if st == DMABUF_RT_OK { String::new() } else { last_error() },
    ));
    d.log.calls.lock().unwrap().extend(calls);
    d.log.runs.fetch_add(1, Ordering::SeqCst);
}

/// A stream callback that calls a synchronous memcpy, memset or device synchronize (or
/// synchronizes its own stream) either works or is refused with a clear error; it never hangs
/// (issue 9, defect 6).
#[test]
fn callbacks_calling_synchronous_functions_never_hang() {
    stress("callbacks_calling_synchronous_functions_never_hang", 2, |watch| {
        let baseline = warm_up();
        let (st, p) = alloc(0, 4096);
        ok(st, &"alloc");
        let log = Arc::new(SyncCallbackLog::default());
        for (r, dev) in [0, 1, 0].into_iter().enumerate() {
            let h = new_stream(dev);
            ok(write_sync(0, p, &[r as u8 + 1; 4096], h), &"h2d on the stream");
            let d = Box::new(SyncCallbackData {
                log: Arc::clone(&log),
                block: p,
                expect: r as u8 + 1,
                watch: std::ptr::from_ref(watch),
            });
            // SAFETY: callable from any thread; `user` is the leaked box it takes back; the
            // block stays allocated until the stream is destroyed below.
            let st = unsafe { dmabuf_rt_stream_add_callback(h, Some(sync_callback), Box::into_raw(d).cast()) };
            ok(st, &"add_callback");
            watch.at(0, || {
                format!(
                    "dmabuf_rt_stream_synchronize of a stream of device {dev} whose callback calls synchronous \
                     memcpy / memset / device_synchronize / stream_synchronize(own)"
                )
            });
            let st = dmabuf_rt_stream_synchronize(h);
            watch.at(0, || format!("dmabuf_rt_stream_destroy of that stream (device {dev})"));
            let st2 = dmabuf_rt_stream_destroy(h);
            assert_eq!(st, DMABUF_RT_OK, "stream_synchronize after the callback: {}", describe(st));
            assert_eq!(st2, DMABUF_RT_OK, "stream_destroy after the callback: {}", describe(st2));
            assert_eq!(log.runs.load(Ordering::SeqCst), r + 1, "the callback ran once");
        }
        ok(dmabuf_rt_device_free(0, p), &"free");
        watch.done(0);
        let calls = log.calls.lock().unwrap();
        let unclear: Vec<_> = calls
            .iter()
            .filter(|(_, st, why)| {
                if *st == DMABUF_RT_OK {
                    !why.is_empty()
                } else {
                    !(why.contains("callback") || why.contains("own stream") || why.contains("its own"))
                }
            })
            .collect();
        assert!(unclear.is_empty(), "calls from a callback that neither worked nor were refused clearly: {unclear:?}");
        drop(calls);
        back_to_baseline(&baseline);
    });
}
