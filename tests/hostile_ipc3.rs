//! Third hostile review of `dmabuf_rt::ipc`, aimed at the share fences
//! (`IpcExporter::export(block, Some(&queue))`, `ipc::get_handle(block, Some(&queue))`): the
//! read end of a pipe that a callback on the producer's queue signals. Cases: a queue whose
//! earlier work failed (idle or still busy), a queue dropped with the fence's callback
//! pending, a thousand exports after a busy queue (fds on both sides, the fence watcher with
//! many pending fences at once), imported blocks dropped while their fence is pending (fds of
//! the watcher, limbo accounting), a fence that failed as seen by `is_ready`, a hostile peer
//! whose fence is a pipe's write end, and process-wide handles revoked before their fence
//! signals, and unopened fenced shares of an exporter that hung up.
//!
//! Every test counts or churns this process's fds: they run one at a time (`serial`).

mod common;

use common::wait::{wait_until, within};

use common::{open_fds, serial};

use std::os::fd::{AsFd, OwnedFd};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dmabuf_rt::caching::CachingAllocator;
use dmabuf_rt::ipc::{self, IpcExporter, IpcHandle, IpcImporter};
use dmabuf_rt::queue::{Event, HostBuffer, Queue};
use dmabuf_rt::share::Channel;
use dmabuf_rt::source::ShmemSource;
use dmabuf_rt::{Error, Segment};

const KB: usize = 1 << 10;
/// Hang detection (generous: CI may run under emulation).
static WATCHDOG: std::sync::LazyLock<Duration> =
    std::sync::LazyLock::new(|| Duration::from_secs(20) * common::time_scale());

fn pair() -> (IpcExporter, IpcImporter) {
    let (a, b) = Channel::pair("ipc3").unwrap();
    (IpcExporter::new(a).unwrap(), IpcImporter::new(b))
}

fn limbo(a: &CachingAllocator) -> i64 {
    a.stats().limbo_bytes.current
}

/// Blocks `q` until the returned sender sends (or is dropped).
fn gate(q: &Queue) -> mpsc::Sender<()> {
    let (tx, rx) = mpsc::channel::<()>();
    q.callback(move |_| {
        let _ = rx.recv();
    })
    .unwrap();
    tx
}

/// An event that completes only when the returned write end is written or closed.
fn never_event() -> (Event, OwnedFd) {
    let (r, w) = rustix::pipe::pipe().unwrap();
    (Event::from_readable_fd(r).unwrap(), w)
}

/// Hands the fence watcher a fence already signalled and waits for it: every fence handed to
/// the watcher before is armed (it takes its inbox whole, in order), and its orphan sweep ran.
fn sync_watcher() {
    let (r, w) = rustix::pipe::pipe().unwrap();
    rustix::io::write(&w, &[1]).unwrap();
    Event::from_readable_fd(r).unwrap().synchronize(Some(*WATCHDOG)).unwrap();
}

// ---- A hostile (or merely slow) exporter speaking the wire protocol by hand ----

fn le(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

const SERIAL_NO: u64 = 7;

fn segment_msg() -> Vec<u8> {
    [le(&[1 | (2 << 32)]), le(&[SERIAL_NO])].concat()
}

fn share_msg(export: u64) -> Vec<u8> {
    [le(&[2 | (1 << 32), export, SERIAL_NO, 100, 1]), le(&[0, 4096])].concat()
}

fn handle(export: u64) -> IpcHandle {
    IpcHandle { pid: 1, door: 0, export, segment: SERIAL_NO, offset: 0, len: 100, token: 0 }
}

/// A raw exporter end and an importer, the segment already sent.
fn raw_peer() -> (Channel, IpcImporter, Segment) {
    let seg: Segment = dmabuf_rt::MemorySource::create_segment(&ShmemSource::new(), 64 * KB).unwrap();
    let (a, b) = Channel::pair("ipc3-raw").unwrap();
    let imp = IpcImporter::new(b);
    a.send_bytes(&segment_msg(), &[seg.as_fd()]).unwrap();
    (a, imp, seg)
}

// ---------------------------------------------------------------------------------------------

/// BUG. A queue whose earlier work failed: exported while it still has work queued, the
/// share's fence fails (the callback gets the queue's error and closes the pipe without a
/// byte), so the importer's reads fail. Exported once that queue is idle, `fence_after` sees
/// `is_idle()` and sends no fence at all: the importer reads the never-written bytes as ready.
/// Before fences, `export(block, Some(q))` waited for the queue and so reported its error.
#[test]
fn an_export_after_a_queue_whose_work_failed_is_never_ready() {
    let _serial = serial();
    let a = common::allocator("", 64 << 20);
    let q = Queue::new().unwrap();
    let (exp, imp) = pair();
    let x = a.allocate(64 * KB, None).unwrap();
    let src = HostBuffer::new(64 * KB).unwrap();
    src.write(0, &[0xAB; 64 * KB]).unwrap();
    // The producer's work fails before it writes the block.
    q.callback(|_| panic!("hostile_ipc3: the producer's queued work fails")).unwrap();
    q.copy(x.mem(), &src).unwrap();
    // Still busy: the share carries a fence, which fails.
    let g = gate(&q);
    let busy = imp.open(&exp.export(&x, Some(&q)).unwrap()).unwrap();
    g.send(()).unwrap();
    let e = busy.wait_ready(Some(*WATCHDOG)).unwrap_err();
    assert!(!matches!(e, Error::Timeout { .. }), "{e}");
    assert!(q.synchronize().is_err(), "the queue failed");
    assert!(q.is_idle());
    // The same queue, now idle and still failed: the share must not be ready either (or the
    // export must fail, as the wait it replaced did).
    match exp.export(&x, Some(&q)) {
        Err(_) => {}
        Ok(h) => {
            let idle = imp.open(&h).unwrap();
            let r = idle.wait_ready(Some(*WATCHDOG));
            assert!(
                r.is_err(),
                "export after a failed (idle) queue: the importer's block is ready ({}) and reads \
                 bytes the failed copy never wrote, while the same export a moment earlier (queue busy) \
                 failed its reads",
                idle.is_ready()
            );
        }
    }
}

/// BUG. Imported blocks dropped while their fence is pending: the fence watcher keeps
/// watching them (two fds each: its `Pending::fd` and the clone armed in the ring) until
/// something else wakes it: its orphan sweep runs only when a new fence is handed to it
/// (`serve`, src/queue/fence.rs). A consumer that drops the blocks of a stalled producer keeps
/// 2 fds per block for as long as no other fence arrives (perhaps for good).
#[test]
fn dropping_blocks_with_pending_fences_closes_their_fds() {
    let _serial = serial();
    const K: usize = 64;
    let (a, imp, _seg) = raw_peer();
    let mut writers = Vec::new();
    for export in 1..=K as u64 {
        let (r, w) = rustix::pipe::pipe().unwrap();
        a.send_bytes(&share_msg(export), &[r.as_fd()]).unwrap();
        writers.push(w);
    }
    let blocks: Vec<_> = (1..=K as u64).map(|e| imp.open(&handle(e)).unwrap()).collect();
    assert!(blocks.iter().all(|b| !b.is_ready()));
    // The watcher has taken these fences in: from here on nothing else wakes it.
    sync_watcher();
    let with_blocks = open_fds();
    drop(blocks);
    let start = Instant::now();
    while open_fds() + K > with_blocks {
        if start.elapsed() > Duration::from_secs(5) * common::time_scale() {
            let stuck = open_fds();
            // Diagnosis: one more fence handed to the watcher makes it sweep them.
            sync_watcher();
            panic!(
                "{K} imported blocks dropped with their fences pending: fds {with_blocks} -> {stuck} after 5 s \
                 (the watcher still holds their fences' fds; expected at least {K} fewer); {} once one more \
                 fence wakes the watcher",
                open_fds()
            );
        }
        std::thread::yield_now();
    }
    drop(writers);
}

/// BUG (API). A fence that failed (the producer's work failed, or it died): `wait_ready` and
/// `read` fail, but `is_ready` says true, so a consumer polling `is_ready` before using
/// `as_ptr`/`mem` reads bytes that were never written.
#[test]
fn a_failed_fence_is_not_ready() {
    let _serial = serial();
    let (a, imp, _seg) = raw_peer();
    let (r, w) = rustix::pipe::pipe().unwrap();
    a.send_bytes(&share_msg(1), &[r.as_fd()]).unwrap();
    drop(r);
    let got = imp.open(&handle(1)).unwrap();
    assert!(!got.is_ready());
    drop(w); // closed without its byte: the work failed
    let e = got.wait_ready(Some(*WATCHDOG)).unwrap_err();
    assert!(!matches!(e, Error::Timeout { .. }), "{e}");
    assert!(got.read(0, &mut [0; 10]).is_err());
    assert!(!got.is_ready(), "is_ready() is true for a fence that failed (wait_ready: {e})");
}

/// A queue dropped while the fence's callback is still pending (blocked waiting on an event
/// that never completes): the importer's wait ends with an error, not a hang.
#[test]
fn a_producer_queue_dropped_with_the_fence_pending_fails_the_fence() {
    let _serial = serial();
    let a = common::allocator("", 64 << 20);
    let q = Queue::new().unwrap();
    let (exp, imp) = pair();
    let x = a.allocate(64 * KB, None).unwrap();
    let (never, never_w) = never_event();
    q.wait(&never).unwrap();
    let got = imp.open(&exp.export(&x, Some(&q)).unwrap()).unwrap();
    assert!(!got.is_ready());
    within("dropping the producer's queue", *WATCHDOG, move || drop(q));
    let e = got.wait_ready(Some(*WATCHDOG)).unwrap_err();
    assert!(!matches!(e, Error::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("did not finish"), "{e}");
    drop(got);
    drop(x);
    wait_until("the release", *WATCHDOG, || exp.held() == 0 && limbo(&a) == 0);
    a.check_invariants().unwrap();
    drop(never_w);
}

/// A thousand exports after a busy queue: every fence a pipe, a thousand fences pending in
/// the watcher at once and completing at once. All become ready; once the blocks are dropped,
/// both sides' fds and the limbo are back where they were.
#[test]
fn a_thousand_fenced_exports_leak_no_fds_and_all_become_ready() {
    let _serial = serial();
    // A pending fence costs three fds here (both sides are this process: the write end in the
    // queue's callback, the read end and its watched clone): as many as the fd limit leaves
    // room for, up to a thousand (the kernel lane's guest allows 1024 fds in all).
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile).current.unwrap_or(u64::MAX);
    let room = (limit as usize).saturating_sub(open_fds() + 64) / 4;
    let n = room.min(1000);
    assert!(n >= 100, "room for {n} fences only (RLIMIT_NOFILE {limit})");
    let a = common::allocator("", 64 << 20);
    let q = Queue::new().unwrap();
    let (exp, imp) = pair();
    let x = a.allocate(64 * KB, None).unwrap();
    // Warm up: the segment's fd crosses, the watcher starts.
    let g = gate(&q);
    let w = imp.open(&exp.export(&x, Some(&q)).unwrap()).unwrap();
    g.send(()).unwrap();
    w.wait_ready(Some(*WATCHDOG)).unwrap();
    drop(w);
    q.synchronize().unwrap();
    wait_until("warm-up release", *WATCHDOG, || exp.held() == 0);
    let base = open_fds();
    let g = gate(&q);
    // Opened as they come: the channel carries only so many packets (and fds) in flight.
    let blocks: Vec<_> = (0..n).map(|_| imp.open(&exp.export(&x, Some(&q)).unwrap()).unwrap()).collect();
    assert!(blocks.iter().all(|b| !b.is_ready()));
    g.send(()).unwrap();
    for b in &blocks {
        b.wait_ready(Some(*WATCHDOG)).unwrap();
    }
    q.synchronize().unwrap();
    drop(blocks);
    drop(x);
    wait_until("every release", *WATCHDOG, || exp.held() == 0 && limbo(&a) == 0);
    wait_until(&format!("fds back to {base}"), *WATCHDOG, || open_fds() <= base);
    a.check_invariants().unwrap();
}

/// A fence that never completes (the producer's queue stalls) and a consumer that lets go
/// anyway: the producer's freed block leaves limbo at the release.
#[test]
fn limbo_empties_when_a_block_with_a_stalled_fence_is_released() {
    let _serial = serial();
    let a = common::allocator("", 64 << 20);
    let q = Queue::new().unwrap();
    let (exp, imp) = pair();
    let x = a.allocate(64 * KB, None).unwrap();
    let (never, never_w) = never_event();
    q.wait(&never).unwrap();
    let got = imp.open(&exp.export(&x, Some(&q)).unwrap()).unwrap();
    drop(x);
    assert!(limbo(&a) > 0);
    assert!(matches!(got.wait_ready(Some(Duration::from_millis(20))), Err(Error::Timeout { .. })));
    drop(got);
    wait_until("the release", *WATCHDOG, || limbo(&a) == 0 && exp.held() == 0);
    a.check_invariants().unwrap();
    rustix::io::write(&never_w, &[1]).unwrap();
    drop(never_w);
    q.synchronize().unwrap();
}

/// A hostile peer whose fence is a pipe's write end (it keeps the read end): never ready while
/// it keeps it; once it lets go (or dies), the fence fails instead of hanging.
#[test]
fn a_fence_that_is_a_pipes_write_end_never_reads_as_ready() {
    let _serial = serial();
    let (a, imp, _seg) = raw_peer();
    let (r, w) = rustix::pipe::pipe().unwrap();
    a.send_bytes(&share_msg(1), &[w.as_fd()]).unwrap();
    drop(w);
    let got = imp.open(&handle(1)).unwrap();
    assert!(matches!(got.wait_ready(Some(Duration::from_millis(20))), Err(Error::Timeout { .. })));
    drop(r);
    let e = got.wait_ready(Some(*WATCHDOG)).unwrap_err();
    assert!(!matches!(e, Error::Timeout { .. }), "{e}");
}

/// Process-wide handles with fences, revoked before their fence signals: the fences' fds are
/// closed (here, and by the queue once its work is done), the blocks leave limbo.
#[test]
fn revoked_fenced_handles_leak_no_fds() {
    let _serial = serial();
    let a = common::allocator("", 64 << 20);
    let q = Queue::new().unwrap();
    let x = a.allocate(64 * KB, None).unwrap();
    // Warm up: the process's IPC socket starts.
    ipc::revoke_handle(&ipc::get_handle(&x, None).unwrap()).unwrap();
    let base = open_fds();
    let g = gate(&q);
    let hs: Vec<_> = (0..100).map(|_| ipc::get_handle(&x, Some(&q)).unwrap()).collect();
    for h in &hs {
        ipc::revoke_handle(h).unwrap();
    }
    g.send(()).unwrap();
    q.synchronize().unwrap();
    drop(x);
    assert_eq!(limbo(&a), 0);
    wait_until(&format!("fds back to {base}"), *WATCHDOG, || open_fds() <= base);
    a.check_invariants().unwrap();
}

/// BUG (minor). The exporter hangs up (its `IpcExporter` dropped, its queue stalled) with
/// fenced shares the importer never opened: they can never be opened now (`open` says the
/// peer is gone), yet the importer keeps them in its state, and with them their fences, whose
/// fds the watcher keeps (2 per share) for as long as the producer's queue stalls.
#[test]
fn unopenable_shares_of_a_gone_exporter_keep_no_fence_fds() {
    let _serial = serial();
    const K: usize = 32;
    let (a, imp, _seg) = raw_peer();
    let mut writers = Vec::new();
    for export in 1..=K as u64 {
        let (r, w) = rustix::pipe::pipe().unwrap();
        a.send_bytes(&share_msg(export), &[r.as_fd()]).unwrap();
        writers.push(w);
    }
    imp.poll().unwrap();
    sync_watcher();
    let before = open_fds();
    drop(a); // hangs up; the producer (holding the write ends) stalls
    let _ = imp.poll();
    assert!(imp.is_gone());
    assert!(matches!(imp.open(&handle(1)), Err(Error::PeerGone { .. })));
    // Wake the watcher so that it sweeps what nobody observes.
    sync_watcher();
    let after = open_fds();
    assert!(
        after + K <= before,
        "{K} unopenable shares of a gone exporter: fds {before} -> {after} (their fences are still watched)"
    );
    drop(writers);
}
