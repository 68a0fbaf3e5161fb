//! The fence watcher: one thread and one io_uring for the whole process, completing events
//! made from sync_files (and other pollable fds) when they become readable.
//!
//! If the watcher ever fails (its ring errors, or a completion hook panics on its thread), it
//! fails every event it was watching and every one handed to it later, so nothing waits on a
//! dead watcher.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::panic::AssertUnwindSafe;
use std::sync::{Mutex, OnceLock};

use rustix::event::{EventfdFlags, PollFlags, eventfd};

use super::event::Event;
use super::ring::{PollRing, WAKE};
use crate::error::{Error, Result};
use crate::sys;

/// What the watched fd is, which decides what "readable" means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WatchedFdKind {
    /// A sync_file: readable when its fences signalled; then its status says whether they
    /// signalled with an error.
    SyncFile,
    /// Any pollable fd: complete when readable.
    Readable,
    /// One end of a pipe or stream socket a peer signals by sending one byte: complete when
    /// the byte is there; failed if the peer closed it without one (end of file).
    Signal,
}

/// Events made from kernel fences and pollable fds: the fence watcher completes them.
impl Event {
    /// An event that completes when the kernel signals the fence in `sync_file` (a sync_file
    /// fd, e.g. from [`crate::Segment::export_sync_file`] or a driver). io_uring watches it
    /// (`IORING_OP_POLL_ADD`), so waiting on it costs no thread; a fence that signals with an
    /// error fails the event. An fd that is not a sync_file is refused.
    pub fn from_sync_file(sync_file: OwnedFd) -> Result<Self> {
        crate::sys::sync_file::status(std::os::fd::AsFd::as_fd(&sync_file))
            .map_err(|e| Error::BadImport { reason: format!("not a sync_file (SYNC_IOC_FILE_INFO: {e})") })?;
        Self::watching(sync_file, WatchedFdKind::SyncFile)
    }

    /// An event that completes when `fd` becomes readable (an eventfd another runtime signals,
    /// a pipe); it fails if the fd reports an error or hang-up without becoming readable.
    pub fn from_readable_fd(fd: OwnedFd) -> Result<Self> {
        Self::watching(fd, WatchedFdKind::Readable)
    }

    /// An event that completes when a byte arrives on `fd` (the read end of a pipe, or one end
    /// of a stream socket pair), and fails if the other end is closed without one, or, with
    /// `exit` (a pidfd of the process that is to send the byte), if that process exits first:
    /// a child it forked without exec keeps a copy of the other end open, so the close alone
    /// would not come while the child lives.
    pub(crate) fn from_signal_fd(fd: OwnedFd, exit: Option<OwnedFd>) -> Result<Self> {
        let ev = Self::new();
        let generation = ev.begin_record();
        watch_with_exit(fd, ev.clone(), generation, WatchedFdKind::Signal, exit)?;
        Ok(ev)
    }

    fn watching(fd: OwnedFd, kind: WatchedFdKind) -> Result<Self> {
        let ev = Self::new();
        let generation = ev.begin_record();
        watch(fd, ev.clone(), generation, kind)?;
        Ok(ev)
    }

    /// An event for a dma-buf's implicit fences: it completes when the work a CPU access of
    /// this direction would wait for is done (`DMA_BUF_IOCTL_EXPORT_SYNC_FILE`).
    pub fn from_dma_buf(seg: &crate::Segment, access: crate::Access) -> Result<Self> {
        Self::from_sync_file(seg.export_sync_file(access)?)
    }
}

struct Pending {
    fd: OwnedFd,
    event: Event,
    generation: u64,
    kind: WatchedFdKind,
    /// A pidfd whose process's exit fails the event (see [`Event::from_signal_fd`]).
    exit: Option<OwnedFd>,
    /// The poll of `exit` on the ring, once watched.
    exit_id: Option<u64>,
}

#[derive(Default)]
struct WatcherInbox {
    incoming: Vec<Pending>,
    /// Why the watcher stopped, once it has.
    dead: Option<String>,
}

struct Watcher {
    wake: OwnedFd,
    shared: Mutex<WatcherInbox>,
}

static W: OnceLock<std::result::Result<Watcher, String>> = OnceLock::new();

/// Has the fence watcher look for events nobody holds any more (it does on every wake-up):
/// for a holder that dropped events whose fences are pending, so that their fds close now
/// rather than when the next fence is handed in. Nothing if the watcher never started.
pub(crate) fn sweep() {
    if let Some(Ok(w)) = W.get() {
        let _ = rustix::io::write(&w.wake, &1u64.to_ne_bytes());
    }
}

fn watcher() -> Result<&'static Watcher> {
    W.get_or_init(|| {
        let wake = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).map_err(|e| e.to_string())?;
        let ring = PollRing::new(256, wake.try_clone().map_err(|e| e.to_string())?)
            .map_err(|e| format!("io_uring for fences: {e}"))?;
        std::thread::Builder::new()
            .name("dmabuf-rt-fences".into())
            .spawn(move || run(ring))
            .map_err(|e| e.to_string())?;
        Ok(Watcher { wake, shared: Mutex::new(WatcherInbox::default()) })
    })
    .as_ref()
    .map_err(|e| Error::Io { op: "start the fence watcher", source: std::io::Error::other(e.clone()) })
}

fn lock(w: &Watcher) -> std::sync::MutexGuard<'_, WatcherInbox> {
    w.shared.lock().unwrap_or_else(|p| p.into_inner())
}

/// Completes `event`'s `generation` when `fd` becomes readable.
pub(crate) fn watch(fd: OwnedFd, event: Event, generation: u64, kind: WatchedFdKind) -> Result<()> {
    watch_with_exit(fd, event, generation, kind, None)
}

/// [`watch`], and fails the event if the process of pidfd `exit` exits first.
fn watch_with_exit(
    fd: OwnedFd,
    event: Event,
    generation: u64,
    kind: WatchedFdKind,
    exit: Option<OwnedFd>,
) -> Result<()> {
    let w = watcher()?;
    {
        let mut s = lock(w);
        if let Some(why) = &s.dead {
            return Err(Error::OperationFailed { reason: format!("fence watcher stopped: {why}").into() });
        }
        s.incoming.push(Pending { fd, event, generation, kind, exit, exit_id: None });
    }
    rustix::io::write(&w.wake, &1u64.to_ne_bytes()).map_err(Error::io_rustix("wake the fence watcher"))?;
    Ok(())
}

fn run(mut ring: PollRing) {
    let mut watched: HashMap<u64, Pending> = HashMap::new();
    let why = match std::panic::catch_unwind(AssertUnwindSafe(|| serve(&mut ring, &mut watched))) {
        Ok(e) => e,
        Err(_) => "a completion hook panicked on the fence watcher's thread".to_string(),
    };
    // Fail everything, now and later.
    let Ok(w) = watcher() else { return };
    let incoming = {
        let mut s = lock(w);
        s.dead = Some(why.clone());
        std::mem::take(&mut s.incoming)
    };
    let reason: std::sync::Arc<str> = format!("fence watcher stopped: {why}").into();
    for p in watched.into_values().chain(incoming) {
        let _ = std::panic::catch_unwind(AssertUnwindSafe(|| p.event.complete(p.generation, Err(reason.clone()))));
    }
}

/// Serves until the ring fails; returns why.
fn serve(ring: &mut PollRing, watched: &mut HashMap<u64, Pending>) -> String {
    let mut next_id = WAKE + 1;
    // The polls of pidfds (`Pending::exit`), by ring id: the id of the fence they belong to.
    let mut exits: HashMap<u64, u64> = HashMap::new();
    loop {
        let done = match ring.wait() {
            Ok(d) => d,
            Err(e) => return format!("io_uring wait: {e}"),
        };
        for (id, res, fd) in done {
            if id == WAKE {
                ring.drain_wake();
                let Ok(w) = watcher() else { return "watcher missing".into() };
                let new = std::mem::take(&mut lock(w).incoming);
                for mut p in new {
                    let id = next_id;
                    next_id += 1;
                    let fd = p.fd.try_clone();
                    match fd.and_then(|fd| ring.poll_in(fd, id)) {
                        Ok(()) => {
                            // The process's exit too, if given (if it cannot be watched, the
                            // fence alone decides, as without one).
                            if let Some(pidfd) = p.exit.take() {
                                let exit_id = next_id;
                                next_id += 1;
                                if ring.poll_in(pidfd, exit_id).is_ok() {
                                    p.exit_id = Some(exit_id);
                                    exits.insert(exit_id, id);
                                }
                            }
                            watched.insert(id, p);
                        }
                        Err(e) => p.event.complete(p.generation, Err(format!("cannot watch fence: {e}").into())),
                    }
                }
                if let Err(e) = ring.arm_wake() {
                    return format!("re-arm wake-up: {e}");
                }
                // Events dropped by everyone while their fence was pending: stop watching them
                // (their polls are cancelled and their fds closed), or each would keep two fds
                // open until its fence signals, perhaps never.
                let orphans: Vec<u64> =
                    watched.iter().filter(|(_, p)| p.event.is_unobserved()).map(|(&id, _)| id).collect();
                for id in orphans {
                    if ring.cancel(id).is_ok() {
                        if let Some(exit_id) = watched.remove(&id).and_then(|p| p.exit_id) {
                            let _ = ring.cancel(exit_id);
                            exits.remove(&exit_id);
                        }
                    }
                }
            } else if let Some(fence_id) = exits.remove(&id) {
                // A pidfd: its process exited (or the poll was cancelled, with its fence done).
                drop(fd);
                if res >= 0 {
                    if let Some(p) = watched.remove(&fence_id) {
                        let _ = ring.cancel(fence_id);
                        // It may have signalled just before it exited (its poll's completion not
                        // seen yet): what the fence holds now decides.
                        let result = match signalled_now(&p.fd) {
                            Some(revents) => outcome(&p, i32::from(revents.bits() as i16)),
                            None => Err("the process that was to signal the fence exited before it did".into()),
                        };
                        p.event.complete(p.generation, result);
                    }
                }
            } else if let Some(p) = watched.remove(&id) {
                drop(fd);
                if let Some(exit_id) = p.exit_id {
                    let _ = ring.cancel(exit_id);
                    exits.remove(&exit_id);
                }
                let result = outcome(&p, res);
                p.event.complete(p.generation, result);
            }
        }
    }
}

/// Whether `fd` is readable (or hung up) now, without waiting: a fence whose byte (or end of
/// file) is there.
pub(crate) fn readable_now(fd: &OwnedFd) -> bool {
    signalled_now(fd).is_some()
}

/// An event already failed with `reason` (a fence whose sender is known to be gone).
impl Event {
    pub(crate) fn failed(reason: &str) -> Self {
        let ev = Self::new();
        let generation = ev.begin_record();
        ev.complete(generation, Err(reason.into()));
        ev
    }
}

/// The fence's poll flags if it is readable (or hung up) now, without waiting.
fn signalled_now(fd: &OwnedFd) -> Option<PollFlags> {
    let mut p = [rustix::event::PollFd::new(fd, PollFlags::IN)];
    match rustix::event::poll(&mut p, Some(&rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 })) {
        Ok(1) => Some(p[0].revents()),
        _ => None,
    }
}

/// Turns a poll completion into the event's result.
fn outcome(p: &Pending, res: i32) -> std::result::Result<(), std::sync::Arc<str>> {
    if res < 0 {
        return Err(format!("fence poll failed: {}", std::io::Error::from_raw_os_error(-res)).into());
    }
    // The poll result's low bits are `revents` (`c_short`: u16 or i16 by rustix backend).
    let revents = PollFlags::from_bits_truncate(res as _);
    if !revents.contains(PollFlags::IN) {
        return Err(format!("fence fd reported {revents:?} without becoming readable").into());
    }
    if p.kind == WatchedFdKind::Signal {
        // Readable: the byte, or the end of file of a peer that closed without it (a socket
        // reports both as readable). The watcher owns this fd and nothing else reads it.
        let mut b = [0u8; 1];
        return match rustix::io::read(&p.fd, &mut b) {
            Ok(1) => Ok(()),
            Ok(_) => Err("the fence's other end was closed without signalling it".into()),
            Err(e) => Err(format!("reading the fence: {e}").into()),
        };
    }
    if p.kind == WatchedFdKind::SyncFile {
        match sys::sync_file::status(p.fd.as_fd()) {
            Ok(s) if s < 0 => {
                return Err(format!("fence signalled with an error: {}", std::io::Error::from_raw_os_error(-s)).into());
            }
            Ok(_) => {}
            Err(e) => return Err(format!("SYNC_IOC_FILE_INFO: {e}").into()),
        }
    }
    Ok(())
}
