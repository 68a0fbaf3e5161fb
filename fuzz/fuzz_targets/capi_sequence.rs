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
//! device at the same time and each could be waiting for the other's stream, or a stream it
//! waits for was given a wait on an event recorded behind it), and an event recorded on no
//! stream must be complete at once. Such a stream wait closes a real cycle too: if it is the
//! one refused, its stream fails (its later work is skipped; synchronizing it, or its device,
//! reports `DMABUF_RT_FAILED` from then on), which the model allows only where a wait could
//! close a cycle or waits for an event recorded after one (`Suspect`, `FailSource`). Bytes are
//! written with memcpy (host to device, device to device, on streams or not) and memset, and
//! read back with device-to-host copies. Pointers nobody owns any more are used only under the
//! registry lock (`LIVE`), which allocations and frees also take, so no other thread can be
//! handed the same address meanwhile.
//!
//! After the threads: every device synchronized and its cache emptied, and the pinned-host
//! cache emptied (`dmabuf_rt_host_empty_cache`), the stats must be back at the run's start
//! (nothing allocated, allocations == frees, nothing reserved) and so must the process's fd
//! count.
#![no_main]

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// When its device_synchronize ran (`clock` before and after), for `may_fail`.
    dev_sync_since: AtomicU64,
    dev_sync_until: AtomicU64,
    /// The devices (a bit each) of streams given a wait on an event recorded behind this
    /// callback while it could still be running (see `Thread::before_wait`).
    waited_by: AtomicU64,
}

/// The callbacks in a `dmabuf_rt_device_synchronize` now, of every thread: a token, the device
/// it synchronizes, and the devices (a bit each) other callbacks synchronized meanwhile.
static DEVICE_SYNCS: Mutex<Vec<(u64, usize, u64)>> = Mutex::new(Vec::new());

/// Which devices' blocked work can wait for which other device's streams, in this run: bit
/// `a * DEVICES + b` once something on device `a` may wait for a stream of device `b`: a copy
/// on a stream of `b` touching `a`'s memory (synchronizing `a` waits for it: foreign work), a
/// stream of `a` waiting for an event that may be held up behind a callback (recorded on a
/// stream of `b`), a callback on a stream of `a` synchronizing `b`. A cycle of waits that
/// crosses from one device to another crosses back, so it needs links both ways. Set before
/// the call that makes the link, so a check that sees a cycle sees its links.
static LINKS: AtomicU64 = AtomicU64::new(0);

fn link(a: usize, b: usize) {
    if a != b {
        LINKS.fetch_or(1 << (a * DEVICES + b), Ordering::SeqCst);
    }
}

/// Whether work blocked on device `a` can wait, through links, for a stream of device `b`.
fn reach(a: usize, b: usize) -> bool {
    let links = LINKS.load(Ordering::SeqCst);
    let mut seen = 1u64 << a;
    loop {
        let mut next = seen;
        for x in (0..DEVICES).filter(|x| seen >> x & 1 == 1) {
            for y in (0..DEVICES).filter(|y| links >> (x * DEVICES + y) & 1 == 1) {
                next |= 1 << y;
            }
        }
        if next == seen {
            return seen >> b & 1 == 1;
        }
        seen = next;
    }
}

/// When a stream wait can be refused as closing a real cycle, or fail because the event it
/// waits for failed: the wait fails its stream (as a failed operation does), and from then on
/// synchronizing the stream, and its device, reports `DMABUF_RT_FAILED`.
#[derive(Clone, Default, Debug)]
struct Cond {
    /// It fails whatever else happens (its event was recorded on a stream known to have failed).
    always: bool,
    /// (devices, waiter): the wait's event may be held up behind callbacks synchronizing
    /// `devices` (a bit each) and the waiting stream is on device `waiter`. The wait closes a
    /// cycle (callback, its device's streams, ..., the waiter, the event) only if one of those
    /// devices can reach the waiter's; links made later count (they may come before the
    /// refusal), so this is evaluated when a failure is seen, not when the wait is made.
    refuse: Vec<(u64, usize)>,
}

impl Cond {
    fn always() -> Self {
        Cond { always: true, refuse: Vec::new() }
    }

    fn is_empty(&self) -> bool {
        !self.always && self.refuse.is_empty()
    }

    fn extend(&mut self, other: &Cond) {
        self.always |= other.always;
        self.refuse.extend_from_slice(&other.refuse);
    }

    fn holds(&self) -> bool {
        self.always
            || self.refuse.iter().any(|&(mask, b)| (0..DEVICES).any(|a| mask >> a & 1 == 1 && (a == b || reach(a, b))))
    }
}

/// Where a `DMABUF_RT_FAILED` may come from, for every thread: a stream that may have failed
/// (from before its wait is made until it is known healthy or destroyed), or work it queued
/// into another device's memory after that wait (foreign work that may fail: until it is known
/// healthy, else to the end of the run, as a device keeps failed foreign work until a
/// synchronize reports it).
struct FailSource {
    id: u64,
    dev: usize,
    foreign: bool,
    cond: Cond,
    born: u64,
    died: Option<u64>,
}

static FAILS: Mutex<Vec<FailSource>> = Mutex::new(Vec::new());
static CLOCK: AtomicU64 = AtomicU64::new(1);

fn fails() -> MutexGuard<'static, Vec<FailSource>> {
    FAILS.lock().unwrap_or_else(|p| p.into_inner())
}

/// A point in the run's order of calls and failure sources.
fn clock() -> u64 {
    CLOCK.fetch_add(1, Ordering::SeqCst)
}

fn fail_source(dev: usize, foreign: bool, cond: Cond) -> u64 {
    let id = clock();
    fails().push(FailSource { id, dev, foreign, cond, born: id, died: None });
    id
}

fn fail_source_cond(id: u64, cond: &Cond) {
    if let Some(f) = fails().iter_mut().find(|f| f.id == id) {
        f.cond = cond.clone();
    }
}

fn fail_source_gone(id: u64) {
    let t = clock();
    if let Some(f) = fails().iter_mut().find(|f| f.id == id && f.died.is_none()) {
        f.died = Some(t);
    }
}

/// Whether a call on device `dev` made between `since` and `until` (`clock`) may report
/// `DMABUF_RT_FAILED`: a failure source of the device was there meanwhile, and its wait can
/// fail.
fn may_fail(dev: usize, since: u64, until: u64) -> bool {
    fails().iter().any(|f| f.dev == dev && f.born < until && f.died.is_none_or(|d| d > since) && f.cond.holds())
}

/// Whether device `dev` may still hold failed foreign work (the end of the run).
fn foreign_may_fail(dev: usize) -> bool {
    fails().iter().any(|f| f.dev == dev && f.foreign && f.cond.holds())
}

fn device_syncs() -> MutexGuard<'static, Vec<(u64, usize, u64)>> {
    DEVICE_SYNCS.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a callback's `dmabuf_rt_device_synchronize` returned, the device it synchronized, the
/// devices (a bit each) that other callbacks synchronized while it ran, and when it ran.
#[derive(Clone, Copy)]
struct DeviceSync {
    status: u64,
    dev: usize,
    met: u64,
    since: u64,
    until: u64,
}

impl DeviceSync {
    /// Whether its status is one the library may give. OK always; WOULD_DEADLOCK if it met
    /// another callback synchronizing a device it can wait for and that can wait for it
    /// (`meet`), or if a stream of a device it can wait for was given a wait on an event
    /// behind this callback (`waited_by`); FAILED if a stream it waited for may have failed.
    fn allowed(&self, waited_by: u64) -> bool {
        let d = self.dev;
        let crossed = (0..DEVICES).any(|m| self.met >> m & 1 == 1 && (m == d || (reach(d, m) && reach(m, d))));
        let waited = (0..DEVICES).any(|b| waited_by >> b & 1 == 1 && (b == d || reach(d, b)));
        match self.status {
            s if s == S::DMABUF_RT_OK as u64 => true,
            s if s == S::DMABUF_RT_WOULD_DEADLOCK as u64 => crossed || waited,
            s if s == S::DMABUF_RT_FAILED as u64 => may_fail(d, self.since, self.until),
            _ => false,
        }
    }
}

/// `dmabuf_rt_device_synchronize(dev)` from a callback on a stream of `stream_dev`.
///
/// Two callbacks on two streams of a device that synchronize the device at the same time wait
/// for each other: each waits for the other stream to pass a point queued behind the other
/// callback, which is itself blocked. The cycle is real: one of the waits must be refused
/// (`DMABUF_RT_WOULD_DEADLOCK`), and timing decides which. The callbacks need not come from
/// one thread, nor be the crossed pair (`cross_callbacks`): a reentrant callback still running
/// when another callback of its device synchronizes it meets the same cycle. With links
/// between devices (`LINKS`), callbacks synchronizing two different devices can close it too.
/// Every callback on such a cycle is inside its call when one is refused, so a refusal met by
/// no concurrent call, and behind which no stream was given a wait, is a false cycle.
fn callback_device_sync(dev: c_int, stream_dev: usize) -> DeviceSync {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut real = dev;
    if dev == DMABUF_RT_CURRENT_DEVICE {
        // The executor thread's current device, which the call below resolves the same way.
        // SAFETY: valid out-pointer.
        let s = unsafe { dmabuf_rt_get_device(&mut real) };
        assert_eq!(s, S::DMABUF_RT_OK);
    }
    let real = real as usize;
    link(stream_dev, real);
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
    let since = clock();
    let status = dmabuf_rt_device_synchronize(dev);
    let until = clock();
    let mut syncs = device_syncs();
    let i = syncs.iter().position(|&(t, ..)| t == token).expect("registered above");
    DeviceSync { status: status as u64, dev: real, met: syncs.swap_remove(i).2, since, until }
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
    let seen = callback_device_sync(rec.dev, rec.dev as usize);
    rec.dev_sync.store(seen.status, Ordering::Relaxed);
    rec.dev_sync_met.store(seen.met, Ordering::Relaxed);
    rec.dev_sync_since.store(seen.since, Ordering::Relaxed);
    rec.dev_sync_until.store(seen.until, Ordering::Relaxed);
    // SAFETY: the record is still kept, as above.
    unsafe { on_callback(stream, status, user) };
}

/// Two callbacks on streams of `stream_dev` that wait for each other (up to 10 s), then
/// synchronize `dev`.
struct Meeting {
    dev: c_int,
    stream_dev: usize,
    arrived: AtomicU64,
    seen: Mutex<[Option<DeviceSync>; 2]>,
}

fn meet(i: usize, user: *mut c_void) {
    // SAFETY: `user` is an `Arc<Meeting>` leaked for this one call (see `cross_callbacks`).
    let m = unsafe { Arc::from_raw(user as *const Meeting) };
    m.arrived.fetch_add(1, Ordering::AcqRel);
    let start = std::time::Instant::now();
    while m.arrived.load(Ordering::Acquire) < 2 && start.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::yield_now();
    }
    let seen = callback_device_sync(m.dev, m.stream_dev);
    m.seen.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(seen);
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
    /// Per byte (empty: all 0): 0 if `bytes` holds it; else it was last written by work that
    /// may not have run, queued on a stream that may have failed (`Suspect::token`): the byte
    /// is known again once that stream is known healthy, or `UNKNOWN` for good.
    tags: Vec<u32>,
    /// The stream that may still have work on it.
    stream: Option<usize>,
}

/// A tag for bytes nobody can know (until written again).
const UNKNOWN: u32 = u32::MAX;

impl Block {
    /// The tags of `off..off + len`, or None if all are 0.
    fn tags(&self, off: usize, len: usize) -> Option<Vec<u32>> {
        let t = self.tags.get(off..off + len)?;
        t.iter().any(|&x| x != 0).then(|| t.to_vec())
    }

    fn set_tags(&mut self, off: usize, len: usize, tags: Option<&[u32]>) {
        match tags {
            None if self.tags.is_empty() => {}
            None => self.tags[off..off + len].fill(0),
            Some(t) => {
                if self.tags.is_empty() {
                    self.tags = vec![0; self.size];
                }
                self.tags[off..off + len].copy_from_slice(t);
            }
        }
    }

    fn fill_tags(&mut self, off: usize, len: usize, tag: u32) {
        if tag == 0 { self.set_tags(off, len, None) } else { self.set_tags(off, len, Some(&vec![tag; len])) }
    }
}

/// The first index where `got` and `want` differ among the bytes the model knows: tag 0, or
/// the token of a stream since known healthy.
fn known_diff(got: &[u8], want: &[u8], tags: Option<&[u32]>, healthy: &BTreeSet<u32>) -> Option<usize> {
    let Some(tags) = tags else { return first_diff(got, want) };
    if got.len() != want.len() {
        return first_diff(got, want);
    }
    (0..got.len()).find(|&k| got[k] != want[k] && (tags[k] == 0 || healthy.contains(&tags[k])))
}

/// A queued device-to-host copy: its host buffer and the bytes it must hold once it ran.
struct Read {
    buf: Box<[u8]>,
    want: Vec<u8>,
    /// The tags of the bytes read, when it was queued.
    tags: Option<Vec<u32>>,
    /// Queued after a wait that may have failed its stream.
    suspect: bool,
    what: String,
}

/// A stream that may have failed: a wait queued on it may be refused as closing a cycle, or
/// wait for an event that may fail.
struct Suspect {
    cond: Cond,
    /// Tags the bytes its work wrote since.
    token: u32,
    /// Its failure source (see `FailSource`), and those of foreign work it was given since.
    source: u64,
    foreign: Vec<u64>,
    /// Known to have failed (a synchronize said so): its work since the wait was skipped.
    failed: bool,
}

struct Stream {
    h: u64,
    dev: usize,
    live: bool,
    reads: Vec<Read>,
    /// Callbacks added, whether each is the reentrant one, and whether it was added after a
    /// wait that may have failed the stream (Some(true): the stream was known to have failed).
    callbacks: Vec<(Arc<CallbackRecord>, bool, Option<bool>)>,
    /// Reentrant callbacks of other streams that its queued waits may be held up behind.
    behind: Vec<Arc<CallbackRecord>>,
    suspect: Option<Suspect>,
}

/// An event's latest record on a stream.
struct EventRecord {
    stream: usize,
    /// The reentrant callbacks it is queued behind (on its stream, or behind a wait there).
    behind: Vec<Arc<CallbackRecord>>,
    /// Whether it may fail: it was recorded after a wait that may have failed its stream.
    fail: Option<Cond>,
}

struct Event {
    h: u64,
    live: bool,
    record: Option<EventRecord>,
}

struct Thread {
    id: usize,
    step: usize,
    current: usize,
    blocks: Vec<Block>,
    streams: Vec<Stream>,
    events: Vec<Event>,
    hosts: Vec<usize>,
    freed_hosts: Vec<usize>,
    freed: Vec<(usize, usize)>,
    allocs: u64,
    frees: u64,
    seed: u64,
    /// The last `Suspect::token` handed out, and those of streams since known healthy.
    tokens: u32,
    healthy: BTreeSet<u32>,
}

fn pending(cbs: &[Arc<CallbackRecord>]) -> impl Iterator<Item = &Arc<CallbackRecord>> {
    cbs.iter().filter(|c| c.calls.load(Ordering::Acquire) == 0)
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
        let failed = self.stream_status("stream-sync", i, s, "stream_synchronize");
        self.stream_done(i, false, failed);
    }

    /// Checks what a synchronize (or destroy, or query) of stream `i` returned: OK, unless a
    /// wait queued on it may have failed it (then FAILED too), or it is known to have failed
    /// (then FAILED, as a failed stream stays failed). Returns whether it reported a failure.
    fn stream_status(&self, what: &str, i: usize, got: S, call: &str) -> bool {
        let (id, step) = (self.id, self.step);
        match &self.streams[i].suspect {
            Some(x) if x.failed => self.expect(what, got, S::DMABUF_RT_FAILED, &format!("{call} of a failed stream")),
            Some(x) => check!(
                what,
                got == S::DMABUF_RT_OK || (got == S::DMABUF_RT_FAILED && x.cond.holds()),
                "thread {id} step {step}: {call}: {got:?}, expected OK or, if a wait queued on it can have been \
                 refused or have failed ({:?}), FAILED",
                x.cond
            ),
            None => self.expect(what, got, S::DMABUF_RT_OK, call),
        }
        got == S::DMABUF_RT_FAILED
    }

    /// Checks what a call that synchronizes `devs` first (and does nothing more if that fails)
    /// returned, between `since` and `until` (`clock`): OK, or FAILED if a stream of one of
    /// them may have failed meanwhile (`may_fail`); FAILED if one of this thread's live
    /// streams there is known to have failed. Returns whether the call did its work.
    fn synced(&self, what: &str, got: S, devs: &[usize], (since, until): (u64, u64), call: &str) -> bool {
        let failed = |d: usize| {
            self.streams.iter().any(|st| st.live && st.dev == d && st.suspect.as_ref().is_some_and(|x| x.failed))
        };
        if devs.iter().any(|&d| failed(d)) {
            self.expect(what, got, S::DMABUF_RT_FAILED, &format!("{call} on the device of a failed stream"));
        } else if !(got == S::DMABUF_RT_FAILED && devs.iter().any(|&d| may_fail(d, since, until))) {
            self.expect(what, got, S::DMABUF_RT_OK, call);
        }
        got == S::DMABUF_RT_OK
    }

    /// Stream `i` has run everything submitted to it (`destroyed`: it ran them because it was
    /// destroyed, so its handle may have been dead when its callbacks ran; `failed`: it
    /// reported a failure, else it is healthy).
    fn stream_done(&mut self, i: usize, destroyed: bool, failed: bool) {
        for b in &mut self.blocks {
            if b.stream == Some(i) {
                b.stream = None;
            }
        }
        if failed {
            if let Some(x) = &mut self.streams[i].suspect {
                x.failed = true;
            }
        } else if let Some(x) = self.streams[i].suspect.take() {
            // Healthy after all: its work ran, and so will the foreign work it was given.
            self.healthy.insert(x.token);
            for b in &mut self.blocks {
                b.tags.iter_mut().filter(|t| **t == x.token).for_each(|t| *t = 0);
            }
            fail_source_gone(x.source);
            x.foreign.iter().for_each(|&f| fail_source_gone(f));
        }
        // Its events have completed: nothing waits behind them any more, and they failed
        // only if it did.
        for ev in &mut self.events {
            if let Some(r) = ev.record.as_mut().filter(|r| r.stream == i) {
                r.behind.clear();
                if !failed {
                    r.fail = None;
                }
            }
        }
        let (id, step) = (self.id, self.step);
        let st = &mut self.streams[i];
        st.behind.clear();
        for r in st.reads.drain(..) {
            if failed && r.suspect {
                continue; // skipped
            }
            let diff = known_diff(&r.buf, &r.want, r.tags.as_deref(), &self.healthy);
            check!(
                "queued-read",
                diff.is_none(),
                "thread {id} step {step}: {} read wrong bytes (first difference at {diff:?})",
                r.what
            );
        }
        for (c, reentrant, suspect) in st.callbacks.drain(..) {
            let calls = c.calls.load(Ordering::Acquire);
            check!(
                "callback",
                calls == 1,
                "thread {id} step {step}: a callback ran {calls} times before its stream was done"
            );
            // A callback queued after the wait that failed its stream is told so.
            let status = c.status.load(Ordering::Relaxed);
            let want = match suspect {
                Some(true) => status == S::DMABUF_RT_FAILED as u64,
                Some(false) if failed => status == S::DMABUF_RT_OK as u64 || status == S::DMABUF_RT_FAILED as u64,
                _ => status == S::DMABUF_RT_OK as u64,
            };
            check!(
                "callback",
                c.stream.load(Ordering::Relaxed) == st.h && want,
                "thread {id} step {step}: callback got stream {:#x} status {status}, expected {:#x} and OK (FAILED \
                 after a wait that failed the stream: {suspect:?}, failed {failed})",
                c.stream.load(Ordering::Relaxed),
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
                // Its device: works, unless it is on a real cycle (see `DeviceSync::allowed`):
                // refused, or told that a stream whose wait was refused instead has failed.
                let seen = DeviceSync {
                    status: c.dev_sync.load(Ordering::Relaxed),
                    dev: c.dev as usize,
                    met: c.dev_sync_met.load(Ordering::Relaxed),
                    since: c.dev_sync_since.load(Ordering::Relaxed),
                    until: c.dev_sync_until.load(Ordering::Relaxed),
                };
                let waited_by = c.waited_by.load(Ordering::SeqCst);
                check!(
                    "callback-device-sync",
                    seen.allowed(waited_by),
                    "thread {id} step {step}: a callback's device_synchronize returned {}, expected OK (devices \
                     other callbacks synchronized meanwhile: {:#b}; of streams waiting behind it: {waited_by:#b})",
                    seen.status,
                    seen.met
                );
            }
        }
    }

    /// Stream `i` was destroyed (`got`: what the destroy returned; it synchronizes first).
    fn destroyed(&mut self, i: usize, got: S, call: &str) {
        let failed = self.stream_status("stream-destroy", i, got, call);
        self.stream_done(i, true, failed);
        self.streams[i].live = false;
        // Gone (the destroy joined its thread): synchronizes of its device no longer see it.
        if let Some(x) = &self.streams[i].suspect {
            fail_source_gone(x.source);
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

    /// Notes that work on `stream` touches block `i`, before it is queued: a stream of another
    /// device makes the block's device wait for that stream (foreign work, `LINKS`), which
    /// fails if the stream has.
    fn touch(&mut self, i: usize, stream: Option<usize>) {
        let Some(st) = stream else { return };
        let (dev, sdev) = (self.blocks[i].dev, self.streams[st].dev);
        if dev == sdev {
            return;
        }
        link(dev, sdev);
        if let Some(x) = &mut self.streams[st].suspect {
            let cond = if x.failed { Cond::always() } else { x.cond.clone() };
            x.foreign.push(fail_source(dev, true, cond));
        }
    }

    /// How work queued now on `stream` (None: synchronous) writes bytes: the tag they get
    /// (0: it runs; a token: it runs unless its stream fails), or None if it is skipped (its
    /// stream is known to have failed).
    fn write_tag(&self, stream: Option<usize>) -> Option<u32> {
        match stream.and_then(|st| self.streams[st].suspect.as_ref()) {
            None => Some(0),
            Some(x) if x.failed => None,
            Some(x) => Some(x.token),
        }
    }

    /// Before stream `i` is given a wait on event `e`: if the event's record may be held up
    /// behind reentrant callbacks still running, or may fail, the wait may be refused or fail,
    /// failing the stream (it becomes a suspect), and those callbacks may be refused instead.
    fn before_wait(&mut self, e: usize, i: usize) {
        let Some(r) = &self.events[e].record else { return };
        if r.stream == i {
            // Recorded on the waiting stream: it completes before the wait runs.
            return;
        }
        let (da, db) = (self.streams[r.stream].dev, self.streams[i].dev);
        let behind: Vec<Arc<CallbackRecord>> = pending(&r.behind).cloned().collect();
        let mut cond = r.fail.clone().unwrap_or_default();
        if !behind.is_empty() {
            link(db, da);
            let mask = behind.iter().fold(0u64, |m, c| m | 1 << c.dev);
            for c in &behind {
                c.waited_by.fetch_or(1 << db, Ordering::SeqCst);
            }
            cond.refuse.push((mask, db));
        }
        if cond.is_empty() {
            return;
        }
        let st = &mut self.streams[i];
        st.behind.extend(behind);
        match &mut st.suspect {
            Some(x) => {
                x.cond.extend(&cond);
                fail_source_cond(x.source, &x.cond);
            }
            None => {
                self.tokens += 1;
                let source = fail_source(db, false, cond.clone());
                st.suspect = Some(Suspect { cond, token: self.tokens, source, foreign: Vec::new(), failed: false });
            }
        }
    }

    /// What an event recorded now on stream `i` waits behind, and whether it may fail.
    fn event_record(&self, i: usize) -> EventRecord {
        let st = &self.streams[i];
        let own = st.callbacks.iter().filter(|c| c.1).map(|c| &c.0);
        let behind = own.chain(&st.behind).filter(|c| c.calls.load(Ordering::Acquire) == 0).cloned().collect();
        let fail = st.suspect.as_ref().map(|x| if x.failed { Cond::always() } else { x.cond.clone() });
        EventRecord { stream: i, behind, fail }
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
        let since = clock();
        let s = memset(d, p, v, size);
        let call = format!("memset of a new block {p:#x}+{size}");
        let set = self.synced("memset", s, &[dev], (since, clock()), &call);
        // Not set: its bytes are whatever the memory held.
        let tags = if set { Vec::new() } else { vec![UNKNOWN; size] };
        self.blocks.push(Block { dev, addr: p, size, bytes: vec![v; size], tags, stream: None });
    }

    fn verify(&mut self, i: usize) {
        let b = &self.blocks[i];
        let since = clock();
        let (s, got) = d2h_sync(b.dev as c_int, b.addr, b.size);
        if !self.synced("verify", s, &[b.dev], (since, clock()), "memcpy device to host (whole block)") {
            return;
        }
        let b = &self.blocks[i];
        let diff = known_diff(&got, &b.bytes, b.tags(0, b.size).as_deref(), &self.healthy);
        check!(
            "bytes",
            diff.is_none(),
            "thread {} step {}: block {:#x}+{} on device {} lost its bytes (first difference at {diff:?})",
            self.id,
            self.step,
            b.addr,
            b.size,
            b.dev
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
        let since = clock();
        let s = memset(b.dev as c_int, b.addr + off, v, len);
        let call = format!("memset({:#x}+{off}, {len})", b.addr);
        if self.synced("memset", s, &[b.dev], (since, clock()), &call) {
            self.blocks[i].bytes[off..off + len].fill(v);
            self.blocks[i].fill_tags(off, len, 0);
        }
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
        let since = clock();
        let s = h2d(b.dev as c_int, b.addr + off, &data, h);
        let call = format!("memcpy host to {:#x}+{off} ({len}) on stream {h:#x}", b.addr);
        let tag = match stream {
            // Synchronous: it first synchronizes the device.
            None => self.synced("h2d", s, &[b.dev], (since, clock()), &call).then_some(0),
            Some(_) => {
                self.expect("h2d", s, S::DMABUF_RT_OK, &call);
                self.write_tag(stream)
            }
        };
        let b = &mut self.blocks[i];
        if let Some(tag) = tag {
            b.bytes[off..off + len].copy_from_slice(&data);
            b.fill_tags(off, len, tag);
        }
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
                let since = clock();
                let (s, got) = d2h_sync(b.dev as c_int, b.addr + off, len);
                if !self.synced("d2h", s, &[b.dev], (since, clock()), "memcpy device to host") {
                    return;
                }
                let b = &self.blocks[i];
                let diff = known_diff(&got, &b.bytes[off..off + len], b.tags(off, len).as_deref(), &self.healthy);
                check!(
                    "read",
                    diff.is_none(),
                    "thread {} step {}: reading {:#x}+{off} ({len}) on device {}: wrong bytes (first difference at {diff:?})",
                    self.id,
                    self.step,
                    b.addr,
                    b.dev
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
                let tags = b.tags(off, len);
                let suspect = self.streams[st].suspect.is_some();
                self.blocks[i].stream = Some(st);
                self.streams[st].reads.push(Read { buf, want, tags, suspect, what });
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
        let devs = [d.dev, s.dev];
        let since = clock();
        // SAFETY: both sides are device memory.
        let st = unsafe { memcpy(d.dev as c_int, d.addr + doff, s.dev as c_int, s.addr + soff, len, kind, h) };
        let call = format!("memcpy {:#x}+{doff} <- {:#x}+{soff} ({len}, kind {kind}) on stream {h:#x}", d.addr, s.addr);
        let tag = match stream {
            // Synchronous: it first synchronizes both devices.
            None => self.synced("d2d", st, &devs, (since, clock()), &call).then_some(0),
            Some(_) => {
                self.expect("d2d", st, S::DMABUF_RT_OK, &call);
                self.write_tag(stream)
            }
        };
        if let Some(tag) = tag {
            let data = self.blocks[j].bytes[soff..soff + len].to_vec();
            self.blocks[i].bytes[doff..doff + len].copy_from_slice(&data);
            // The bytes are known if the source's were and the copy runs; on a stream that may
            // fail, bytes that were not known are unknown for good.
            let tags = self.blocks[j].tags(soff, len);
            let tags = match (tags, tag) {
                (None, 0) => None,
                (None, t) => Some(vec![t; len]),
                (Some(src), 0) => Some(src),
                (Some(src), t) => Some(src.iter().map(|&x| if x == 0 { t } else { UNKNOWN }).collect()),
            };
            self.blocks[i].set_tags(doff, len, tags.as_deref());
        }
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
                    self.streams.push(Stream {
                        h,
                        dev,
                        live: true,
                        reads: Vec::new(),
                        callbacks: Vec::new(),
                        behind: Vec::new(),
                        suspect: None,
                    });
                }
            }
            2 => {
                let Some(i) = pick(self, input) else { return };
                let s = dmabuf_rt_stream_destroy(self.streams[i].h);
                if self.streams[i].live {
                    self.destroyed(i, s, "stream_destroy");
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
                if !self.streams[i].live {
                    self.expect("stream-query", s, S::DMABUF_RT_INVALID_HANDLE, "stream_query of a dead stream");
                } else if self.stream_status("stream-query", i, s, "stream_query") {
                    // It reports the stream's own failure: known now.
                    if let Some(x) = &mut self.streams[i].suspect {
                        x.failed = true;
                    }
                }
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
                    let suspect = self.streams[i].suspect.as_ref().map(|x| x.failed);
                    self.streams[i].callbacks.push((rec, reentrant, suspect));
                }
            }
            6 if !skipped("callback-cross-sync") => self.cross_callbacks(input),
            _ => {
                // Events: create, record, wait, synchronize, query, destroy.
                match input.below(5) {
                    0 => {
                        let (s, h) = event_create();
                        self.expect("event-create", s, S::DMABUF_RT_OK, "event_create");
                        self.events.push(Event { h, live: true, record: None });
                    }
                    _ if self.events.is_empty() => {}
                    1 => {
                        let e = input.below(self.events.len());
                        let Event { h, live, .. } = self.events[e];
                        let st = self.pick_stream(input);
                        let s = dmabuf_rt_event_record(h, st.map_or(0, |i| self.streams[i].h));
                        let want = if live { S::DMABUF_RT_OK } else { S::DMABUF_RT_INVALID_HANDLE };
                        self.expect("event-record", s, want, "event_record");
                        if s == S::DMABUF_RT_OK {
                            self.events[e].record = st.map(|i| self.event_record(i));
                        }
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
                        let e = input.below(self.events.len());
                        let Event { h, live, .. } = self.events[e];
                        let Some(i) = pick(self, input) else { return };
                        if live && self.streams[i].live {
                            self.before_wait(e, i);
                        }
                        let s = dmabuf_rt_stream_wait_event(self.streams[i].h, h);
                        let want =
                            if live && self.streams[i].live { S::DMABUF_RT_OK } else { S::DMABUF_RT_INVALID_HANDLE };
                        self.expect("stream-wait-event", s, want, "stream_wait_event");
                    }
                    3 => {
                        let e = input.below(self.events.len());
                        let Event { h, live, .. } = self.events[e];
                        let s = dmabuf_rt_event_synchronize(h);
                        let mut want = if live { S::DMABUF_RT_OK } else { S::DMABUF_RT_INVALID_HANDLE };
                        // Recorded after a wait that may have failed its stream: it fails if
                        // the stream did (always, if the stream is known to have failed).
                        let fail = self.events[e].record.as_ref().and_then(|r| r.fail.as_ref());
                        if live && fail.is_some_and(|c| c.always || (s == S::DMABUF_RT_FAILED && c.holds())) {
                            want = S::DMABUF_RT_FAILED;
                        }
                        self.expect("event-sync", s, want, "event_synchronize");
                        let mut done = false;
                        // SAFETY: valid out-pointer.
                        let s = unsafe { dmabuf_rt_event_query(h, &mut done) };
                        self.expect("event-query", s, want, "event_query");
                        check!(
                            "event-query",
                            want != S::DMABUF_RT_OK || done,
                            "thread {}: event not done after its synchronize",
                            self.id
                        );
                    }
                    _ => {
                        let i = input.below(self.events.len());
                        let Event { h, live, .. } = self.events[i];
                        let s = dmabuf_rt_event_destroy(h);
                        let want = if live { S::DMABUF_RT_OK } else { S::DMABUF_RT_INVALID_HANDLE };
                        self.expect("event-destroy", s, want, "event_destroy");
                        self.events[i].live = false;
                    }
                }
            }
        }
    }

    /// Two new streams of one device whose callbacks run at the same time (they meet before
    /// going on) and each synchronize the device: each waits for the other stream, which is
    /// running the other callback. Each may work or be refused as a deadlock; neither may hang.
    fn cross_callbacks(&mut self, input: &mut Input<'_>) {
        let (d, dev) = self.device(input);
        let (s1, h1) = stream_create(d);
        let (s2, h2) = stream_create(d);
        self.expect("stream-create", s1, S::DMABUF_RT_OK, "stream_create");
        self.expect("stream-create", s2, S::DMABUF_RT_OK, "stream_create");
        let meet =
            Arc::new(Meeting { dev: d, stream_dev: dev, arrived: AtomicU64::new(0), seen: Mutex::new([None; 2]) });
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
        let seen = *meet.seen.lock().unwrap_or_else(|p| p.into_inner());
        for (i, seen) in seen.iter().enumerate() {
            // Each may be refused (they wait for each other); FAILED if a stream it waited for
            // may have failed.
            let ok = seen.is_some_and(|x| x.status == S::DMABUF_RT_WOULD_DEADLOCK as u64 || x.allowed(0));
            check!(
                "callback-cross-sync",
                ok,
                "thread {} step {}: callback {i}'s device_synchronize while the other stream's callback ran \
                 returned {:?}, expected OK or WOULD_DEADLOCK (or FAILED, if a stream it waited for may have failed)",
                self.id,
                self.step,
                seen.map(|x| x.status)
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
                let since = clock();
                let s = dmabuf_rt_device_synchronize(d);
                // Every stream of the device has run what this thread gave it before, and
                // none failed.
                if self.synced("device-sync", s, &[dev], (since, clock()), "device_synchronize") {
                    for i in 0..self.streams.len() {
                        if self.streams[i].live && self.streams[i].dev == dev {
                            self.stream_done(i, false, false);
                        }
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
                self.destroyed(i, s, "stream_destroy at the end");
            }
        }
        for Event { h, live, .. } in std::mem::take(&mut self.events) {
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
    // Per run: the last run's streams are all gone, and its failed work reported.
    LINKS.store(0, Ordering::SeqCst);
    fails().clear();
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
                        tokens: 0,
                        healthy: BTreeSet::new(),
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
        // Failed foreign work stays on its device until a synchronize reports it, once.
        let s = dmabuf_rt_device_synchronize(d);
        if !(s == S::DMABUF_RT_FAILED && foreign_may_fail(d as usize)) {
            assert_eq!(s, S::DMABUF_RT_OK);
        }
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
