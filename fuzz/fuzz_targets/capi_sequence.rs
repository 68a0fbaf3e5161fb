//! C API call sequences on three threads against a shadow model.
//!
//! The runtime is process-global: it is built once from `DMABUF_RT_DEVICES=shmem,shmem` and a
//! 16 MiB `DMABUF_RT_CAPACITY` (so out-of-memory is reachable), and every run must leave it as it
//! found it. The input is split into three programs, run at once on three threads. Each thread
//! models what it owns (device blocks with every byte, streams, events, callbacks, pinned
//! host blocks) and checks the status of every call against what the model expects, good
//! calls and bad ones: NULL, foreign, freed, interior and out-of-range pointers, double frees,
//! dead stream and event handles, copies and memsets running past the bytes their block asked
//! for (exactly `DMABUF_RT_INVALID_POINTER`), bad devices and kinds. Callbacks either record
//! that they ran or also call the API (their own stream's synchronize must be refused with
//! `DMABUF_RT_WOULD_DEADLOCK`; their device's must work, unless another callback synchronized a
//! device at the same time and each could be waiting for the other's stream), and an event
//! recorded on no stream must be complete at once. Bytes are written with memcpy (host to
//! device, device to device, on streams or not) and memset, and read back with device-to-host
//! copies. Pointers nobody
//! owns any more are used only under the registry lock (`LIVE`), which allocations and frees
//! also take, so no other thread can be handed the same address meanwhile.
//!
//! After the threads: every device synchronized and its cache emptied, and the pinned-host
//! cache emptied (`dmabuf_rt_host_empty_cache`), the stats must be back at the run's start
//! (nothing allocated, allocations == frees, nothing reserved) and so must the process's fd
//! count.
#![no_main]

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Once};

use dmabuf_rt::ffi::capi::dmabuf_rt_status as S;
use dmabuf_rt::ffi::capi::*;
use fuzz_common::{Input, check, fd_count, fd_list, first_diff, pattern_vec, skipped};
use libfuzzer_sys::fuzz_target;

const DEVICES: usize = 2;
const CAPACITY: usize = 16 << 20;
const THREADS: usize = 3;
const KIB: usize = 1 << 10;

/// Device blocks live anywhere in the process: per device, address -> size.
type Registry = Vec<BTreeMap<usize, usize>>;
static LIVE: Mutex<Registry> = Mutex::new(Vec::new());

fn live() -> MutexGuard<'static, Registry> {
    let mut g = LIVE.lock().unwrap_or_else(|p| p.into_inner());
    if g.is_empty() {
        *g = vec![BTreeMap::new(); DEVICES];
    }
    g
}

/// Whether `addr..addr + len` touches a live block of `blocks`.
fn overlaps_live(blocks: &BTreeMap<usize, usize>, addr: usize, len: usize) -> bool {
    blocks.range(..addr + len).next_back().is_some_and(|(&a, &size)| a + size > addr)
}

// ---- the calls, each behind a safe wrapper that owns its out-pointers ----

fn alloc(dev: c_int, size: usize) -> (S, usize) {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer.
    let s = unsafe { dmabuf_rt_device_alloc(dev, size, &mut p) };
    (s, p as usize)
}

fn free(dev: c_int, p: usize) -> S {
    dmabuf_rt_device_free(dev, p as *mut c_void)
}

fn memset(dev: c_int, p: usize, v: u8, len: usize) -> S {
    dmabuf_rt_memset(dev, p as *mut c_void, c_int::from(v), len)
}

/// # Safety
/// The host side must stay valid as `dmabuf_rt_memcpy` requires.
unsafe fn memcpy(dd: c_int, dst: usize, sd: c_int, src: usize, len: usize, kind: c_int, stream: u64) -> S {
    // SAFETY: the caller's contract.
    unsafe { dmabuf_rt_memcpy(dd, dst as *mut c_void, sd, src as *const c_void, len, kind, stream) }
}

fn h2d(dev: c_int, dst: usize, data: &[u8], stream: u64) -> S {
    // SAFETY: `data` is valid for reading until this returns, which is all a host-to-device
    // copy needs (queued ones stage the bytes first).
    unsafe { memcpy(dev, dst, 0, data.as_ptr() as usize, data.len(), DMABUF_RT_MEMCPY_HOST_TO_DEVICE, stream) }
}

fn d2h_sync(dev: c_int, src: usize, len: usize) -> (S, Vec<u8>) {
    let mut out = vec![0u8; len];
    // SAFETY: `out` is valid for writing `len` bytes until this synchronous copy returns.
    let s = unsafe { memcpy(0, out.as_mut_ptr() as usize, dev, src, len, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0) };
    (s, out)
}

fn stream_create(dev: c_int) -> (S, u64) {
    let mut h = 0;
    // SAFETY: valid out-pointer.
    let s = unsafe { dmabuf_rt_stream_create(dev, &mut h) };
    (s, h)
}

fn event_create() -> (S, u64) {
    let mut h = 0;
    // SAFETY: valid out-pointer.
    let s = unsafe { dmabuf_rt_event_create(&mut h) };
    (s, h)
}

fn stats(dev: c_int) -> (S, dmabuf_rt_stats) {
    let mut st = dmabuf_rt_stats::default();
    // SAFETY: valid out-pointer.
    let s = unsafe { dmabuf_rt_device_stats(dev, &mut st) };
    (s, st)
}

/// What a callback saw: calls, and the last stream and status; for a callback that calls the
/// API itself, what its synchronize of its own stream and of its stream's device returned.
#[derive(Default)]
struct CallbackRecord {
    /// The stream's device (for the reentrant callback).
    dev: c_int,
    calls: AtomicU64,
    stream: AtomicU64,
    status: AtomicU64,
    own_sync: AtomicU64,
    dev_sync: AtomicU64,
    /// The devices (a bit each) that other callbacks synchronized while its device_synchronize
    /// ran (see `callback_device_sync`).
    dev_sync_met: AtomicU64,
}

/// The callbacks in a `dmabuf_rt_device_synchronize` now, of every thread: a token, the device
/// it synchronizes, and the devices (a bit each) other callbacks synchronized meanwhile.
static DEVICE_SYNCS: Mutex<Vec<(u64, usize, u64)>> = Mutex::new(Vec::new());

/// Whether a stream has been given a copy touching another device's memory in this run: then
/// synchronizing that device waits for the stream too (the copy is tracked as foreign work), so
/// callbacks synchronizing different devices can wait for each other.
static CROSS_DEVICE: AtomicBool = AtomicBool::new(false);

fn device_syncs() -> MutexGuard<'static, Vec<(u64, usize, u64)>> {
    DEVICE_SYNCS.lock().unwrap_or_else(|p| p.into_inner())
}

/// `dmabuf_rt_device_synchronize(dev)` from a callback, and the devices that other callbacks
/// synchronized while it ran (a bit each).
///
/// Two callbacks on two streams of a device that synchronize the device at the same time wait
/// for each other: each waits for the other stream to pass a point queued behind the other
/// callback, which is itself blocked. The cycle is real: one of the waits must be refused
/// (`DMABUF_RT_WOULD_DEADLOCK`), and timing decides which. The callbacks need not come from
/// one thread, nor be the crossed pair (`cross_callbacks`): a reentrant callback still running
/// when another callback of its device synchronizes it meets the same cycle. With copies
/// between devices on streams (`CROSS_DEVICE`), callbacks synchronizing two different devices
/// can close it too. Every callback on such a cycle is inside its call when one is refused, so
/// a refusal met by no concurrent call is a false cycle.
fn callback_device_sync(dev: c_int) -> (S, u64) {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut real = dev;
    if dev == DMABUF_RT_CURRENT_DEVICE {
        // The executor thread's current device, which the call below resolves the same way.
        // SAFETY: valid out-pointer.
        let s = unsafe { dmabuf_rt_get_device(&mut real) };
        assert_eq!(s, S::DMABUF_RT_OK);
    }
    let real = real as usize;
    let token = NEXT.fetch_add(1, Ordering::Relaxed);
    {
        let mut syncs = device_syncs();
        let mut met = 0;
        for (_, d, their) in syncs.iter_mut() {
            *their |= 1 << real;
            met |= 1 << *d;
        }
        syncs.push((token, real, met));
    }
    let s = dmabuf_rt_device_synchronize(dev);
    let mut syncs = device_syncs();
    let i = syncs.iter().position(|&(t, ..)| t == token).expect("registered above");
    (s, syncs.swap_remove(i).2)
}

unsafe extern "C" fn on_callback(stream: u64, status: S, user: *mut c_void) {
    // SAFETY: `user` is the `CallbackRecord` of an `Arc` the model keeps until it has checked
    // the callback ran (after its stream was synchronized or destroyed).
    let rec = unsafe { &*(user as *const CallbackRecord) };
    rec.stream.store(stream, Ordering::Relaxed);
    rec.status.store(status as u64, Ordering::Relaxed);
    rec.calls.fetch_add(1, Ordering::Release);
}

/// A callback that synchronizes its own stream (refused: it would wait for itself) and its
/// stream's device (which waits for every other stream and skips its own).
unsafe extern "C" fn on_callback_reentrant(stream: u64, status: S, user: *mut c_void) {
    // SAFETY: as in `on_callback`.
    let rec = unsafe { &*(user as *const CallbackRecord) };
    rec.own_sync.store(dmabuf_rt_stream_synchronize(stream) as u64, Ordering::Relaxed);
    let (s, met) = callback_device_sync(rec.dev);
    rec.dev_sync.store(s as u64, Ordering::Relaxed);
    rec.dev_sync_met.store(met, Ordering::Relaxed);
    // SAFETY: the record is still kept, as above.
    unsafe { on_callback(stream, status, user) };
}

/// Two callbacks that wait for each other (up to 10 s), then synchronize their device.
struct Meeting {
    dev: c_int,
    arrived: AtomicU64,
    status: [AtomicU64; 2],
}

fn meet(i: usize, user: *mut c_void) {
    // SAFETY: `user` is an `Arc<Meeting>` leaked for this one call (see `cross_callbacks`).
    let m = unsafe { Arc::from_raw(user as *const Meeting) };
    m.arrived.fetch_add(1, Ordering::AcqRel);
    let start = std::time::Instant::now();
    while m.arrived.load(Ordering::Acquire) < 2 && start.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::yield_now();
    }
    m.status[i].store(callback_device_sync(m.dev).0 as u64, Ordering::Release);
}

unsafe extern "C" fn on_meet_0(_stream: u64, _status: S, user: *mut c_void) {
    meet(0, user);
}

unsafe extern "C" fn on_meet_1(_stream: u64, _status: S, user: *mut c_void) {
    meet(1, user);
}

// ---- the model of one thread ----

struct Block {
    dev: usize,
    addr: usize,
    size: usize,
    bytes: Vec<u8>,
    /// The stream that may still have work on it.
    stream: Option<usize>,
}

/// A queued device-to-host copy: its host buffer and the bytes it must hold once it ran.
struct Read {
    buf: Box<[u8]>,
    want: Vec<u8>,
    what: String,
}

struct Stream {
    h: u64,
    dev: usize,
    live: bool,
    reads: Vec<Read>,
    /// Callbacks added, and whether each is the reentrant one.
    callbacks: Vec<(Arc<CallbackRecord>, bool)>,
}

struct Thread {
    id: usize,
    step: usize,
    current: usize,
    blocks: Vec<Block>,
    streams: Vec<Stream>,
    /// Events, and whether each is live.
    events: Vec<(u64, bool)>,
    hosts: Vec<usize>,
    freed_hosts: Vec<usize>,
    freed: Vec<(usize, usize)>,
    allocs: u64,
    frees: u64,
    seed: u64,
}

impl Thread {
    fn expect(&self, what: &str, got: S, want: S, call: &str) {
        check!(what, got == want, "thread {} step {}: {call}: {got:?}, expected {want:?}", self.id, self.step);
    }

    /// A device argument: mostly a real device, sometimes the current one (-1).
    fn device(&mut self, input: &mut Input<'_>) -> (c_int, usize) {
        match input.below(5) {
            0 => (DMABUF_RT_CURRENT_DEVICE, self.current),
            n => ((n % DEVICES) as c_int, n % DEVICES),
        }
    }

    /// Waits for a stream (through the API), then checks what it read and its callbacks.
    fn sync_stream(&mut self, i: usize) {
        let s = dmabuf_rt_stream_synchronize(self.streams[i].h);
        self.expect("stream-sync", s, S::DMABUF_RT_OK, "stream_synchronize");
        self.stream_done(i, false);
    }

    /// Stream `i` has run everything submitted to it (`destroyed`: it ran them because it was
    /// destroyed, so its handle may have been dead when its callbacks ran).
    fn stream_done(&mut self, i: usize, destroyed: bool) {
        for b in &mut self.blocks {
            if b.stream == Some(i) {
                b.stream = None;
            }
        }
        let (id, step) = (self.id, self.step);
        let st = &mut self.streams[i];
        for r in st.reads.drain(..) {
            check!(
                "queued-read",
                *r.buf == *r.want,
                "thread {id} step {step}: {} read wrong bytes (first difference at {:?})",
                r.what,
                first_diff(&r.buf, &r.want)
            );
        }
        for (c, reentrant) in st.callbacks.drain(..) {
            let calls = c.calls.load(Ordering::Acquire);
            check!(
                "callback",
                calls == 1,
                "thread {id} step {step}: a callback ran {calls} times before its stream was done"
            );
            check!(
                "callback",
                c.stream.load(Ordering::Relaxed) == st.h && c.status.load(Ordering::Relaxed) == S::DMABUF_RT_OK as u64,
                "thread {id} step {step}: callback got stream {:#x} status {}, expected {:#x} OK",
                c.stream.load(Ordering::Relaxed),
                c.status.load(Ordering::Relaxed),
                st.h
            );
            if reentrant {
                let own = c.own_sync.load(Ordering::Relaxed);
                // Its own stream: refused as a deadlock; while the stream is being destroyed
                // its handle may already be dead.
                let dead = S::DMABUF_RT_INVALID_HANDLE as u64;
                check!(
                    "callback-own-sync",
                    own == S::DMABUF_RT_WOULD_DEADLOCK as u64 || (destroyed && own == dead),
                    "thread {id} step {step}: a callback's synchronize of its own stream returned {own}, expected \
                     WOULD_DEADLOCK ({})",
                    S::DMABUF_RT_WOULD_DEADLOCK as u64
                );
                // Its device: works, unless another callback synchronized the same device (or
                // the other one, once streams hold copies into each other's memory) meanwhile:
                // each may be waiting for the other's stream, and one is refused.
                let dev = c.dev_sync.load(Ordering::Relaxed);
                let met = c.dev_sync_met.load(Ordering::Relaxed);
                let crossed = met & (1 << c.dev) != 0 || (met != 0 && CROSS_DEVICE.load(Ordering::Relaxed));
                check!(
                    "callback-device-sync",
                    dev == S::DMABUF_RT_OK as u64 || (crossed && dev == S::DMABUF_RT_WOULD_DEADLOCK as u64),
                    "thread {id} step {step}: a callback's device_synchronize returned {dev}, expected OK (devices \
                     other callbacks synchronized meanwhile: {met:#b})"
                );
            }
        }
    }

    /// Makes block `i` safe for work on `stream` (None: the host or synchronous calls, which
    /// wait for the device's streams themselves): the model waits for another stream first.
    fn order(&mut self, i: usize, stream: Option<usize>) {
        if let Some(o) = self.blocks[i].stream {
            if Some(o) != stream && stream.is_some() {
                self.sync_stream(o);
            }
        }
    }

    /// Notes that work on `stream` touches block `i`: a stream of another device makes the
    /// block's device wait for that stream (see `CROSS_DEVICE`).
    fn touch(&self, i: usize, stream: Option<usize>) {
        if stream.is_some_and(|st| self.streams[st].dev != self.blocks[i].dev) {
            CROSS_DEVICE.store(true, Ordering::Relaxed);
        }
    }

    fn pick_stream(&mut self, input: &mut Input<'_>) -> Option<usize> {
        let live: Vec<usize> = (0..self.streams.len()).filter(|&i| self.streams[i].live).collect();
        if live.is_empty() || input.bool() { None } else { Some(live[input.below(live.len())]) }
    }

    fn alloc(&mut self, input: &mut Input<'_>) {
        let (d, dev) = self.device(input);
        let size = match input.below(8) {
            0 => 1 + input.below(512),
            1..=3 => 1 + input.below(64 * KIB),
            4 => 1 + input.below(1 << 20),
            5 => CAPACITY + 1 + input.below(CAPACITY),
            6 => 0,
            _ => 4 * KIB * (1 + input.below(8)),
        };
        match input.below(16) {
            0 => {
                // SAFETY: a NULL out-pointer is refused, never written.
                let s = unsafe { dmabuf_rt_device_alloc(d, 64, std::ptr::null_mut()) };
                return self.expect("alloc-null", s, S::DMABUF_RT_INVALID_POINTER, "device_alloc(ptr NULL)");
            }
            1 => {
                let bad = [2, 3, -2, c_int::MAX, c_int::MIN][input.below(5)];
                let (s, _) = alloc(bad, 64);
                return self.expect(
                    "alloc-bad-device",
                    s,
                    S::DMABUF_RT_INVALID_ARGUMENT,
                    &format!("device_alloc({bad})"),
                );
            }
            _ => {}
        }
        let mut reg = live();
        let (s, p) = alloc(d, size);
        let call = format!("device_alloc({d}, {size})");
        if size == 0 {
            return self.expect("alloc-zero", s, S::DMABUF_RT_INVALID_ARGUMENT, &call);
        }
        if size > CAPACITY {
            return self.expect("alloc-too-big", s, S::DMABUF_RT_OUT_OF_MEMORY, &call);
        }
        if s == S::DMABUF_RT_OUT_OF_MEMORY {
            return;
        }
        self.expect("alloc", s, S::DMABUF_RT_OK, &call);
        if s != S::DMABUF_RT_OK {
            return;
        }
        let fresh = reg[dev].insert(p, size).is_none();
        check!("alloc-twice", fresh, "thread {} step {}: {call} handed out {p:#x}, live elsewhere", self.id, self.step);
        drop(reg);
        self.allocs += 1;
        self.freed.retain(|&(fd, fp)| (fd, fp) != (dev, p));
        let v = input.u8();
        let s = memset(d, p, v, size);
        self.expect("memset", s, S::DMABUF_RT_OK, &format!("memset of a new block {p:#x}+{size}"));
        self.blocks.push(Block { dev, addr: p, size, bytes: vec![v; size], stream: None });
    }

    fn verify(&mut self, i: usize) {
        let b = &self.blocks[i];
        let (s, got) = d2h_sync(b.dev as c_int, b.addr, b.size);
        self.expect("verify", s, S::DMABUF_RT_OK, "memcpy device to host (whole block)");
        let b = &self.blocks[i];
        check!(
            "bytes",
            got == b.bytes,
            "thread {} step {}: block {:#x}+{} on device {} lost its bytes (first difference at {:?})",
            self.id,
            self.step,
            b.addr,
            b.size,
            b.dev,
            first_diff(&got, &b.bytes)
        );
    }

    fn free(&mut self, i: usize, again: bool) {
        if let Some(o) = self.blocks[i].stream {
            self.sync_stream(o);
        }
        self.verify(i);
        let b = self.blocks.swap_remove(i);
        let mut reg = live();
        reg[b.dev].remove(&b.addr);
        let s = free(b.dev as c_int, b.addr);
        self.expect("free", s, S::DMABUF_RT_OK, &format!("device_free({}, {:#x})", b.dev, b.addr));
        if again {
            // Still under the registry lock: nobody can have been handed the address since.
            let s = free(b.dev as c_int, b.addr);
            self.expect("double-free", s, S::DMABUF_RT_INVALID_POINTER, &format!("second device_free({:#x})", b.addr));
        }
        drop(reg);
        self.frees += 1;
        self.freed.push((b.dev, b.addr));
        if self.freed.len() > 16 {
            self.freed.remove(0);
        }
    }

    /// A pointer this thread freed, with the registry locked (keep the guard while using it):
    /// with `len` None, not the start of a live block (a free of it must be refused); with
    /// `len`, its `len` bytes touch no live block (a range there lies in no allocation: refused,
    /// and nobody's bytes may change). Freed blocks merge and are handed out again, so a freed
    /// address may lie inside another thread's live block.
    fn dead_pointer(&self, len: Option<usize>) -> Option<(MutexGuard<'static, Registry>, usize, usize)> {
        let reg = live();
        let &(dev, p) = self.freed.iter().rev().find(|&&(d, p)| match len {
            None => !reg[d].contains_key(&p),
            Some(len) => !overlaps_live(&reg[d], p, len),
        })?;
        Some((reg, dev, p))
    }

    fn bad_free(&mut self, input: &mut Input<'_>) {
        let local = 0u64;
        match input.below(7) {
            0 => {
                let s = free(0, 0);
                self.expect("free-null", s, S::DMABUF_RT_INVALID_POINTER, "device_free(NULL)");
            }
            1 => {
                let p = &local as *const u64 as usize;
                let s = free(0, p);
                self.expect("free-foreign", s, S::DMABUF_RT_INVALID_POINTER, "device_free(a stack pointer)");
            }
            2 => {
                if let Some((_reg, dev, p)) = self.dead_pointer(None) {
                    let s = free(dev as c_int, p);
                    self.expect("free-freed", s, S::DMABUF_RT_INVALID_POINTER, &format!("device_free of freed {p:#x}"));
                }
            }
            3 if !self.blocks.is_empty() => {
                let b = &self.blocks[input.below(self.blocks.len())];
                if b.size > 1 {
                    let p = b.addr + 1 + input.below(b.size - 1);
                    let s = free(b.dev as c_int, p);
                    self.expect(
                        "free-interior",
                        s,
                        S::DMABUF_RT_INVALID_POINTER,
                        &format!("device_free({p:#x}) inside a block"),
                    );
                }
            }
            4 if !self.blocks.is_empty() => {
                let b = &self.blocks[input.below(self.blocks.len())];
                let other = (b.dev + 1) % DEVICES;
                let s = free(other as c_int, b.addr);
                self.expect("free-wrong-device", s, S::DMABUF_RT_INVALID_POINTER, "device_free on the other device");
            }
            5 if !self.blocks.is_empty() => {
                let i = input.below(self.blocks.len());
                self.free(i, true);
            }
            _ => {
                let s = free(7, 0x1000);
                self.expect("free-bad-device", s, S::DMABUF_RT_INVALID_ARGUMENT, "device_free(device 7)");
            }
        }
    }

    /// A range inside block `i`: (offset, length > 0).
    fn range(&self, input: &mut Input<'_>, i: usize) -> (usize, usize) {
        let size = self.blocks[i].size;
        let off = input.below(size);
        (off, 1 + input.below(size - off))
    }

    fn memset(&mut self, input: &mut Input<'_>) {
        if self.blocks.is_empty() {
            return;
        }
        let i = input.below(self.blocks.len());
        let (off, len) = self.range(input, i);
        let v = input.u8();
        let b = &self.blocks[i];
        let s = memset(b.dev as c_int, b.addr + off, v, len);
        self.expect("memset", s, S::DMABUF_RT_OK, &format!("memset({:#x}+{off}, {len})", b.addr));
        self.blocks[i].bytes[off..off + len].fill(v);
    }

    fn write(&mut self, input: &mut Input<'_>) {
        if self.blocks.is_empty() {
            return;
        }
        let i = input.below(self.blocks.len());
        let (off, len) = self.range(input, i);
        let stream = self.pick_stream(input);
        self.order(i, stream);
        self.touch(i, stream);
        self.seed += 1;
        let data = pattern_vec(self.seed, off, len);
        let b = &self.blocks[i];
        let h = stream.map_or(0, |s| self.streams[s].h);
        let s = h2d(b.dev as c_int, b.addr + off, &data, h);
        self.expect("h2d", s, S::DMABUF_RT_OK, &format!("memcpy host to {:#x}+{off} ({len}) on stream {h:#x}", b.addr));
        let b = &mut self.blocks[i];
        b.bytes[off..off + len].copy_from_slice(&data);
        if stream.is_some() {
            b.stream = stream;
        }
    }

    fn read(&mut self, input: &mut Input<'_>) {
        if self.blocks.is_empty() {
            return;
        }
        let i = input.below(self.blocks.len());
        let (off, len) = self.range(input, i);
        match self.pick_stream(input) {
            None => {
                let b = &self.blocks[i];
                let (s, got) = d2h_sync(b.dev as c_int, b.addr + off, len);
                self.expect("d2h", s, S::DMABUF_RT_OK, "memcpy device to host");
                let b = &self.blocks[i];
                let want = &b.bytes[off..off + len];
                check!(
                    "read",
                    got == want,
                    "thread {} step {}: reading {:#x}+{off} ({len}) on device {}: wrong bytes (first difference at {:?})",
                    self.id,
                    self.step,
                    b.addr,
                    b.dev,
                    first_diff(&got, want)
                );
            }
            Some(st) => {
                self.order(i, Some(st));
                self.touch(i, Some(st));
                let mut buf = vec![0u8; len].into_boxed_slice();
                let b = &self.blocks[i];
                // SAFETY: `buf` is kept (in the stream's reads) until the stream is done.
                let s = unsafe {
                    memcpy(
                        0,
                        buf.as_mut_ptr() as usize,
                        b.dev as c_int,
                        b.addr + off,
                        len,
                        DMABUF_RT_MEMCPY_DEVICE_TO_HOST,
                        self.streams[st].h,
                    )
                };
                self.expect("d2h-async", s, S::DMABUF_RT_OK, "memcpy device to host on a stream");
                let what = format!("a read of {:#x}+{off} ({len}) on stream {:#x}", b.addr, self.streams[st].h);
                let want = b.bytes[off..off + len].to_vec();
                self.blocks[i].stream = Some(st);
                self.streams[st].reads.push(Read { buf, want, what });
            }
        }
    }

    fn copy(&mut self, input: &mut Input<'_>) {
        if self.blocks.is_empty() {
            return;
        }
        let (i, j) = (input.below(self.blocks.len()), input.below(self.blocks.len()));
        let len = 1 + input.below(self.blocks[i].size.min(self.blocks[j].size));
        let doff = input.below(self.blocks[i].size - len + 1);
        let soff = input.below(self.blocks[j].size - len + 1);
        if i == j && doff < soff + len && soff < doff + len {
            return;
        }
        let stream = self.pick_stream(input);
        self.order(i, stream);
        self.order(j, stream);
        self.touch(i, stream);
        self.touch(j, stream);
        let (d, s) = (&self.blocks[i], &self.blocks[j]);
        let kind = if d.dev != s.dev && input.bool() {
            DMABUF_RT_MEMCPY_PEER_TO_PEER
        } else {
            DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE
        };
        let h = stream.map_or(0, |x| self.streams[x].h);
        // SAFETY: both sides are device memory.
        let st = unsafe { memcpy(d.dev as c_int, d.addr + doff, s.dev as c_int, s.addr + soff, len, kind, h) };
        let call = format!("memcpy {:#x}+{doff} <- {:#x}+{soff} ({len}, kind {kind}) on stream {h:#x}", d.addr, s.addr);
        self.expect("d2d", st, S::DMABUF_RT_OK, &call);
        let data = self.blocks[j].bytes[soff..soff + len].to_vec();
        self.blocks[i].bytes[doff..doff + len].copy_from_slice(&data);
        if stream.is_some() {
            self.blocks[i].stream = stream;
            self.blocks[j].stream = stream;
        }
    }

    /// Copies and memsets that must be refused.
    fn bad_range(&mut self, input: &mut Input<'_>) {
        let data = [0xa5u8; 256];
        let mut sink = [0u8; 256];
        let dead_stream = self.streams.iter().find(|s| !s.live).map(|s| s.h);
        match input.below(8) {
            0 => {
                // SAFETY: refused before any host access (NULL destination).
                let s = unsafe { memcpy(0, 0, 0, data.as_ptr() as usize, 16, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, 0) };
                self.expect("memcpy-null", s, S::DMABUF_RT_INVALID_POINTER, "memcpy to NULL");
            }
            1 => {
                let s = memset(0, 0, 1, 16);
                self.expect("memset-null", s, S::DMABUF_RT_INVALID_POINTER, "memset(NULL, 16)");
            }
            2 if !self.blocks.is_empty() => {
                let kind = [4, -1, 99][input.below(3)];
                let b = &self.blocks[input.below(self.blocks.len())];
                // SAFETY: refused for its kind before any access.
                let s = unsafe { memcpy(b.dev as c_int, b.addr, b.dev as c_int, b.addr, 1, kind, 0) };
                self.expect("memcpy-kind", s, S::DMABUF_RT_INVALID_ARGUMENT, &format!("memcpy kind {kind}"));
            }
            3 => {
                let h = dead_stream.unwrap_or(0xdead_0000 + input.u8() as u64 * 16);
                let local = 0u8;
                let target = self.blocks.first().map_or(&local as *const u8 as usize, |b| b.addr);
                let s = h2d(0, target, &data[..1], h);
                self.expect("memcpy-dead-stream", s, S::DMABUF_RT_INVALID_HANDLE, &format!("memcpy on stream {h:#x}"));
            }
            // (A skipped check does not run its call either: an accepted overrun would corrupt
            // other blocks and fail later checks.)
            4 if !self.blocks.is_empty() && !skipped("overrun") => {
                // Past the end of a block, by 1 byte to 256.
                let i = input.below(self.blocks.len());
                let b = &self.blocks[i];
                let off = input.below(b.size);
                let len = b.size - off + 1 + input.below(256);
                let call = format!("a range {:#x}+{off} ({len}) past a {}-byte block", b.addr, b.size);
                let s = match input.below(3) {
                    0 => memset(b.dev as c_int, b.addr + off, 0x5a, len),
                    1 if len <= data.len() => h2d(b.dev as c_int, b.addr + off, &data[..len], 0),
                    _ if len <= sink.len() => {
                        // SAFETY: `sink` is valid for `len` bytes until the synchronous copy returns.
                        unsafe {
                            memcpy(
                                0,
                                sink.as_mut_ptr() as usize,
                                b.dev as c_int,
                                b.addr + off,
                                len,
                                DMABUF_RT_MEMCPY_DEVICE_TO_HOST,
                                0,
                            )
                        }
                    }
                    _ => memset(b.dev as c_int, b.addr + off, 0x5a, len),
                };
                // Not wholly inside the bytes one live allocation asked for.
                self.expect("overrun", s, S::DMABUF_RT_INVALID_POINTER, &call);
            }
            5 if !skipped("use-after-free") => {
                // Freed bytes nobody holds: refused (the registry lock keeps them unallocated).
                if let Some((_reg, dev, p)) = self.dead_pointer(Some(16)) {
                    let s = if input.bool() {
                        memset(dev as c_int, p, 1, 16)
                    } else {
                        h2d(dev as c_int, p, &data[..16], 0)
                    };
                    self.expect(
                        "use-after-free",
                        s,
                        S::DMABUF_RT_INVALID_POINTER,
                        &format!("memset/memcpy to freed {p:#x}"),
                    );
                }
            }
            6 if !self.blocks.is_empty() => {
                let b = &self.blocks[input.below(self.blocks.len())];
                let other = ((b.dev + 1) % DEVICES) as c_int;
                let s = h2d(other, b.addr, &data[..1], 0);
                self.expect(
                    "memcpy-wrong-device",
                    s,
                    S::DMABUF_RT_INVALID_POINTER,
                    "memcpy to a block of the other device",
                );
            }
            _ => {
                let s = memset(9, 0x1000 as usize, 0, 1);
                self.expect("memset-bad-device", s, S::DMABUF_RT_INVALID_ARGUMENT, "memset on device 9");
            }
        }
    }

    fn streams_op(&mut self, input: &mut Input<'_>) {
        let pick = |t: &Self, input: &mut Input<'_>| (!t.streams.is_empty()).then(|| input.below(t.streams.len()));
        match input.below(8) {
            0 | 1 => {
                if self.streams.iter().filter(|s| s.live).count() >= 4 {
                    return;
                }
                let (d, dev) = self.device(input);
                let (s, h) = stream_create(d);
                self.expect("stream-create", s, S::DMABUF_RT_OK, "stream_create");
                if s == S::DMABUF_RT_OK {
                    self.streams.push(Stream { h, dev, live: true, reads: Vec::new(), callbacks: Vec::new() });
                }
            }
            2 => {
                let Some(i) = pick(self, input) else { return };
                let s = dmabuf_rt_stream_destroy(self.streams[i].h);
                if self.streams[i].live {
                    self.expect("stream-destroy", s, S::DMABUF_RT_OK, "stream_destroy");
                    self.stream_done(i, true);
                    self.streams[i].live = false;
                } else {
                    self.expect("stream-destroy-dead", s, S::DMABUF_RT_INVALID_HANDLE, "second stream_destroy");
                }
            }
            3 => {
                let Some(i) = pick(self, input) else { return };
                if self.streams[i].live {
                    self.sync_stream(i);
                } else {
                    let s = dmabuf_rt_stream_synchronize(self.streams[i].h);
                    self.expect(
                        "stream-sync-dead",
                        s,
                        S::DMABUF_RT_INVALID_HANDLE,
                        "stream_synchronize of a dead stream",
                    );
                }
            }
            4 => {
                let Some(i) = pick(self, input) else { return };
                let mut done = false;
                // SAFETY: valid out-pointer.
                let s = unsafe { dmabuf_rt_stream_query(self.streams[i].h, &mut done) };
                let want = if self.streams[i].live { S::DMABUF_RT_OK } else { S::DMABUF_RT_INVALID_HANDLE };
                self.expect("stream-query", s, want, "stream_query");
            }
            5 => {
                let Some(i) = pick(self, input) else { return };
                let rec = Arc::new(CallbackRecord { dev: self.streams[i].dev as c_int, ..Default::default() });
                let (null, reentrant) = match input.below(8) {
                    0 | 1 => (true, false),
                    2 | 3 => (false, true),
                    _ => (false, false),
                };
                let cb: dmabuf_rt_callback = match (null, reentrant) {
                    (true, _) => None,
                    (false, true) => Some(on_callback_reentrant),
                    (false, false) => Some(on_callback),
                };
                // SAFETY: the callback only touches `rec`, which the model keeps until it ran.
                let s =
                    unsafe { dmabuf_rt_stream_add_callback(self.streams[i].h, cb, Arc::as_ptr(&rec) as *mut c_void) };
                let want = match (null, self.streams[i].live) {
                    (true, _) => S::DMABUF_RT_INVALID_POINTER,
                    (false, false) => S::DMABUF_RT_INVALID_HANDLE,
                    (false, true) => S::DMABUF_RT_OK,
                };
                self.expect("callback-add", s, want, "stream_add_callback");
                if s == S::DMABUF_RT_OK {
                    self.streams[i].callbacks.push((rec, reentrant));
                }
            }
            6 if !skipped("callback-cross-sync") => self.cross_callbacks(input),
            _ => {
                // Events: create, record, wait, synchronize, query, destroy.
                match input.below(5) {
                    0 => {
                        let (s, h) = event_create();
                        self.expect("event-create", s, S::DMABUF_RT_OK, "event_create");
                        self.events.push((h, true));
                    }
                    _ if self.events.is_empty() => {}
                    1 => {
                        let (h, live) = self.events[input.below(self.events.len())];
                        let st = self.pick_stream(input);
                        let s = dmabuf_rt_event_record(h, st.map_or(0, |i| self.streams[i].h));
                        let want = if live { S::DMABUF_RT_OK } else { S::DMABUF_RT_INVALID_HANDLE };
                        self.expect("event-record", s, want, "event_record");
                        if st.is_none() && s == S::DMABUF_RT_OK {
                            // Recorded on no stream: complete at once, whatever else runs.
                            let mut done = false;
                            // SAFETY: valid out-pointer.
                            let s = unsafe { dmabuf_rt_event_query(h, &mut done) };
                            self.expect("event-record-0", s, S::DMABUF_RT_OK, "event_query after event_record(ev, 0)");
                            check!(
                                "event-record-0",
                                done,
                                "thread {} step {}: event_record(ev, 0) did not complete at once",
                                self.id,
                                self.step
                            );
                        }
                    }
                    2 => {
                        let (h, live) = self.events[input.below(self.events.len())];
                        let Some(i) = pick(self, input) else { return };
                        let s = dmabuf_rt_stream_wait_event(self.streams[i].h, h);
                        let want =
                            if live && self.streams[i].live { S::DMABUF_RT_OK } else { S::DMABUF_RT_INVALID_HANDLE };
                        self.expect("stream-wait-event", s, want, "stream_wait_event");
                    }
                    3 => {
                        let (h, live) = self.events[input.below(self.events.len())];
                        let s = dmabuf_rt_event_synchronize(h);
                        let want = if live { S::DMABUF_RT_OK } else { S::DMABUF_RT_INVALID_HANDLE };
                        self.expect("event-sync", s, want, "event_synchronize");
                        let mut done = false;
                        // SAFETY: valid out-pointer.
                        let s = unsafe { dmabuf_rt_event_query(h, &mut done) };
                        self.expect("event-query", s, want, "event_query");
                        check!(
                            "event-query",
                            !live || done,
                            "thread {}: event not done after its synchronize",
                            self.id
                        );
                    }
                    _ => {
                        let i = input.below(self.events.len());
                        let (h, live) = self.events[i];
                        let s = dmabuf_rt_event_destroy(h);
                        let want = if live { S::DMABUF_RT_OK } else { S::DMABUF_RT_INVALID_HANDLE };
                        self.expect("event-destroy", s, want, "event_destroy");
                        self.events[i].1 = false;
                    }
                }
            }
        }
    }

    /// Two new streams of one device whose callbacks run at the same time (they meet before
    /// going on) and each synchronize the device: each waits for the other stream, which is
    /// running the other callback. Each may work or be refused as a deadlock; neither may hang.
    fn cross_callbacks(&mut self, input: &mut Input<'_>) {
        let (d, _) = self.device(input);
        let (s1, h1) = stream_create(d);
        let (s2, h2) = stream_create(d);
        self.expect("stream-create", s1, S::DMABUF_RT_OK, "stream_create");
        self.expect("stream-create", s2, S::DMABUF_RT_OK, "stream_create");
        let meet =
            Arc::new(Meeting { dev: d, arrived: AtomicU64::new(0), status: [AtomicU64::new(99), AtomicU64::new(99)] });
        for (i, h) in [h1, h2].into_iter().enumerate() {
            let user = Arc::into_raw(Arc::clone(&meet)) as *mut c_void;
            // SAFETY: the callback takes back the `Arc` leaked for it (it runs exactly once).
            let s = unsafe { dmabuf_rt_stream_add_callback(h, Some(if i == 0 { on_meet_0 } else { on_meet_1 }), user) };
            self.expect("callback-add", s, S::DMABUF_RT_OK, "stream_add_callback");
        }
        for h in [h1, h2] {
            let s = dmabuf_rt_stream_synchronize(h);
            self.expect("stream-sync", s, S::DMABUF_RT_OK, "stream_synchronize after crossed callbacks");
        }
        for (i, st) in meet.status.iter().enumerate() {
            let st = st.load(Ordering::Acquire);
            check!(
                "callback-cross-sync",
                st == S::DMABUF_RT_OK as u64 || st == S::DMABUF_RT_WOULD_DEADLOCK as u64,
                "thread {} step {}: callback {i}'s device_synchronize while the other stream's callback ran \
                 returned {st}, expected OK or WOULD_DEADLOCK",
                self.id,
                self.step
            );
        }
        for h in [h1, h2] {
            self.expect("stream-destroy", dmabuf_rt_stream_destroy(h), S::DMABUF_RT_OK, "stream_destroy");
        }
    }

    fn misc(&mut self, input: &mut Input<'_>) {
        let (d, dev) = self.device(input);
        match input.below(8) {
            0 => {
                let (s, st) = stats(d);
                self.expect("stats", s, S::DMABUF_RT_OK, "device_stats");
                check!("stats-sane", st.reserved_bytes >= st.allocated_bytes, "thread {}: {st:?}", self.id);
                check!("stats-sane", st.capacity_bytes == CAPACITY as u64, "thread {}: {st:?}", self.id);
                check!(
                    "stats-sane",
                    st.reserved_bytes <= CAPACITY as u64,
                    "thread {}: reserved beyond capacity: {st:?}",
                    self.id
                );
                // SAFETY: NULL is refused.
                let s = unsafe { dmabuf_rt_device_stats(d, std::ptr::null_mut()) };
                self.expect("stats-null", s, S::DMABUF_RT_INVALID_POINTER, "device_stats(NULL)");
            }
            1 => {
                let (mut total, mut free) = (0u64, 0u64);
                // SAFETY: valid out-pointers.
                let s = unsafe { dmabuf_rt_device_memory(d, &mut total, &mut free) };
                self.expect("memory", s, S::DMABUF_RT_OK, "device_memory");
                check!("memory", total == CAPACITY as u64 && free <= total, "thread {}: {total} {free}", self.id);
            }
            2 => {
                let s = dmabuf_rt_device_synchronize(d);
                self.expect("device-sync", s, S::DMABUF_RT_OK, "device_synchronize");
                // Every stream of the device has run what this thread gave it before.
                for i in 0..self.streams.len() {
                    if self.streams[i].live && self.streams[i].dev == dev {
                        self.stream_done(i, false);
                    }
                }
            }
            3 => {
                let s = dmabuf_rt_empty_cache(d);
                self.expect("empty-cache", s, S::DMABUF_RT_OK, "empty_cache");
            }
            4 => {
                let mut json: *mut c_char = std::ptr::null_mut();
                // SAFETY: valid out-pointer.
                let s = unsafe { dmabuf_rt_snapshot_json(d, &mut json) };
                self.expect("snapshot", s, S::DMABUF_RT_OK, "snapshot_json");
                if s == S::DMABUF_RT_OK {
                    self.expect("string-free", dmabuf_rt_string_free(json), S::DMABUF_RT_OK, "string_free");
                    let s = dmabuf_rt_string_free(json);
                    self.expect("string-free-twice", s, S::DMABUF_RT_INVALID_POINTER, "second string_free");
                }
            }
            5 => {
                let s = dmabuf_rt_set_device(dev as c_int);
                self.expect("set-device", s, S::DMABUF_RT_OK, "set_device");
                self.current = dev;
                let mut got = -5;
                // SAFETY: valid out-pointer.
                let s = unsafe { dmabuf_rt_get_device(&mut got) };
                self.expect("get-device", s, S::DMABUF_RT_OK, "get_device");
                check!("get-device", got == dev as c_int, "thread {}: current device {got}, set {dev}", self.id);
                let s = dmabuf_rt_set_device(DEVICES as c_int);
                self.expect("set-bad-device", s, S::DMABUF_RT_INVALID_ARGUMENT, "set_device(out of range)");
            }
            6 => {
                let mut p: *mut c_void = std::ptr::null_mut();
                let size = 1 + input.below(64 * KIB);
                // SAFETY: valid out-pointer.
                let s = unsafe { dmabuf_rt_host_alloc(size, &mut p) };
                self.expect("host-alloc", s, S::DMABUF_RT_OK, "host_alloc");
                if s == S::DMABUF_RT_OK {
                    self.hosts.push(p as usize);
                }
            }
            _ => {
                if let Some(p) = self.hosts.pop() {
                    self.expect("host-free", dmabuf_rt_host_free(p as *mut c_void), S::DMABUF_RT_OK, "host_free");
                    self.freed_hosts.push(p);
                } else if let Some(&p) = self.freed_hosts.last() {
                    // Pinned host blocks are cached per process, but this thread's freed one may
                    // be another thread's now: only NULL is certain to be refused.
                    let _ = p;
                    let s = dmabuf_rt_host_free(std::ptr::null_mut());
                    self.expect("host-free-null", s, S::DMABUF_RT_INVALID_POINTER, "host_free(NULL)");
                }
            }
        }
    }

    fn run(&mut self, mut input: Input<'_>) {
        while !input.is_empty() && self.step < 120 {
            self.step += 1;
            match input.u8() % 16 {
                0..=2 => self.alloc(&mut input),
                3 if !self.blocks.is_empty() => {
                    let i = input.below(self.blocks.len());
                    self.free(i, false);
                }
                4 => self.bad_free(&mut input),
                5 => self.memset(&mut input),
                6 | 7 => self.write(&mut input),
                8 | 9 => self.read(&mut input),
                10 => self.copy(&mut input),
                11 => self.bad_range(&mut input),
                12 | 13 => self.streams_op(&mut input),
                _ => self.misc(&mut input),
            }
        }
        // Wind down: every stream done, every block checked and freed, every handle destroyed.
        for i in 0..self.streams.len() {
            if self.streams[i].live {
                self.sync_stream(i);
            }
        }
        while !self.blocks.is_empty() {
            let i = input.below(self.blocks.len());
            self.free(i, false);
        }
        for i in 0..self.streams.len() {
            if self.streams[i].live {
                let s = dmabuf_rt_stream_destroy(self.streams[i].h);
                self.expect("stream-destroy", s, S::DMABUF_RT_OK, "stream_destroy at the end");
                self.stream_done(i, true);
                self.streams[i].live = false;
            }
        }
        for (h, live) in std::mem::take(&mut self.events) {
            if live {
                self.expect("event-destroy", dmabuf_rt_event_destroy(h), S::DMABUF_RT_OK, "event_destroy at the end");
            }
        }
        for p in std::mem::take(&mut self.hosts) {
            self.expect("host-free", dmabuf_rt_host_free(p as *mut c_void), S::DMABUF_RT_OK, "host_free at the end");
        }
    }
}

fn setup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: set before any thread of this process reads the environment (the fuzz
        // target's first run, before the runtime exists).
        unsafe {
            std::env::set_var("DMABUF_RT_DEVICES", "shmem,shmem");
            std::env::set_var("DMABUF_RT_CAPACITY", format!("{CAPACITY}"));
            std::env::remove_var("DMABUF_RT_ALLOC_CONF");
            std::env::remove_var("DMABUF_RT_NO_CACHING");
        }
        let mut n = 0;
        // SAFETY: valid out-pointer.
        assert_eq!(unsafe { dmabuf_rt_device_count(&mut n) }, S::DMABUF_RT_OK);
        assert_eq!(n, DEVICES as c_int);
        // What lives as long as the runtime: each device's own stream (made by the first
        // memset). (The pinned-host cache is emptied at the end of each run.)
        for d in 0..DEVICES as c_int {
            let (s, p) = alloc(d, 4096);
            assert_eq!(s, S::DMABUF_RT_OK);
            assert_eq!(memset(d, p, 0, 4096), S::DMABUF_RT_OK);
            assert_eq!(free(d, p), S::DMABUF_RT_OK);
            assert_eq!(dmabuf_rt_empty_cache(d), S::DMABUF_RT_OK);
        }
    });
}

fuzz_target!(|data: &[u8]| {
    setup();
    // Per run: the last run's streams are all gone.
    CROSS_DEVICE.store(false, Ordering::Relaxed);
    let before: Vec<dmabuf_rt_stats> = (0..DEVICES as c_int).map(|d| stats(d).1).collect();
    let fds_before = fd_count();
    let list_before = fd_list();
    let mut input = Input::new(data);
    let programs = input.split(THREADS);
    let results: Vec<(u64, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = programs
            .into_iter()
            .enumerate()
            .map(|(id, program)| {
                s.spawn(move || {
                    let mut t = Thread {
                        id,
                        step: 0,
                        current: 0,
                        blocks: Vec::new(),
                        streams: Vec::new(),
                        events: Vec::new(),
                        hosts: Vec::new(),
                        freed_hosts: Vec::new(),
                        freed: Vec::new(),
                        allocs: 0,
                        frees: 0,
                        seed: id as u64 * 1_000_000,
                    };
                    t.run(program);
                    (t.allocs, t.frees)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    });
    let allocs: u64 = results.iter().map(|r| r.0).sum();
    let frees: u64 = results.iter().map(|r| r.1).sum();
    check!("model-balance", allocs == frees, "the threads made {allocs} allocations and {frees} frees");
    let (mut all_allocs, mut all_frees) = (0, 0);
    for d in 0..DEVICES as c_int {
        assert_eq!(dmabuf_rt_device_synchronize(d), S::DMABUF_RT_OK);
        assert_eq!(dmabuf_rt_empty_cache(d), S::DMABUF_RT_OK);
        let (s, st) = stats(d);
        assert_eq!(s, S::DMABUF_RT_OK);
        let b = &before[d as usize];
        check!(
            "stats-end",
            st.allocated_bytes == b.allocated_bytes
                && st.allocations == b.allocations
                && st.requested_bytes == b.requested_bytes,
            "device {d}: after the run {st:?}, before {b:?}"
        );
        check!(
            "stats-end",
            st.num_allocs - b.num_allocs == st.num_frees - b.num_frees,
            "device {d}: {} allocations but {} frees in the run",
            st.num_allocs - b.num_allocs,
            st.num_frees - b.num_frees
        );
        all_allocs += st.num_allocs - b.num_allocs;
        all_frees += st.num_frees - b.num_frees;
        check!(
            "empty-reserved",
            st.reserved_bytes == 0,
            "device {d}: everything freed and the cache emptied, yet {} bytes stay reserved (issue 9, defect 12)",
            st.reserved_bytes
        );
    }
    check!(
        "stats-end",
        all_allocs == allocs && all_frees == frees,
        "the devices counted {all_allocs} allocations and {all_frees} frees, the model {allocs} and {frees}"
    );
    // The pinned-host cache keeps freed host blocks (memfds) until it is emptied.
    assert_eq!(dmabuf_rt_host_empty_cache(), S::DMABUF_RT_OK);
    let fds_after = fd_count();
    check!(
        "fds",
        fds_after == fds_before,
        "fds: {fds_before} before the run, {fds_after} after\nbefore: {list_before:?}\nafter: {:?}",
        fd_list()
    );
});
