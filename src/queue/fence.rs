//! The fence watcher: one thread and one io_uring for the whole process, completing events
//! made from sync_file fds when the kernel signals their fences.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Mutex, OnceLock};

use rustix::event::{EventfdFlags, eventfd};

use super::event::Event;
use super::ring::PollRing;
use crate::error::{Error, Result};

const WAKE: u64 = 0;

struct Watcher {
    wake: OwnedFd,
    incoming: Mutex<Vec<(OwnedFd, Event, u64)>>,
}

fn watcher() -> Result<&'static Watcher> {
    static W: OnceLock<std::result::Result<Watcher, String>> = OnceLock::new();
    W.get_or_init(|| {
        let wake = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).map_err(|e| e.to_string())?;
        let ring = PollRing::new(256).map_err(|e| format!("io_uring for fences: {e}"))?;
        let thread_wake = wake.try_clone().map_err(|e| e.to_string())?;
        std::thread::Builder::new()
            .name("dmabuf-rt-fences".into())
            .spawn(move || run(ring, thread_wake))
            .map_err(|e| e.to_string())?;
        Ok(Watcher { wake, incoming: Mutex::new(Vec::new()) })
    })
    .as_ref()
    .map_err(|e| Error::Io { op: "start the fence watcher", source: std::io::Error::other(e.clone()) })
}

/// Completes `event`'s `generation` when `sync_file` signals.
pub(crate) fn watch(sync_file: OwnedFd, event: Event, generation: u64) -> Result<()> {
    let w = watcher()?;
    w.incoming.lock().unwrap_or_else(|p| p.into_inner()).push((sync_file, event, generation));
    rustix::io::write(&w.wake, &1u64.to_ne_bytes()).map_err(Error::io_rustix("wake the fence watcher"))?;
    Ok(())
}

fn run(mut ring: PollRing, wake: OwnedFd) {
    let mut watched: HashMap<u64, (Event, u64)> = HashMap::new();
    let mut next_id = 1u64;
    let arm_wake = |ring: &mut PollRing| wake.try_clone().and_then(|fd| ring.poll_in(fd, WAKE));
    if arm_wake(&mut ring).is_err() {
        return;
    }
    loop {
        let Ok(done) = ring.wait() else { return };
        for (id, res, _fd) in done {
            if id == WAKE {
                let mut buf = [0u8; 8];
                let _ = rustix::io::read(&wake, &mut buf);
                let Ok(w) = watcher() else { return };
                let new: Vec<_> = std::mem::take(&mut *w.incoming.lock().unwrap_or_else(|p| p.into_inner()));
                for (fd, ev, generation) in new {
                    let id = next_id;
                    next_id += 1;
                    match ring.poll_in(fd, id) {
                        Ok(()) => {
                            watched.insert(id, (ev, generation));
                        }
                        Err(e) => ev.complete(generation, Err(format!("cannot watch fence: {e}").into())),
                    }
                }
                if arm_wake(&mut ring).is_err() {
                    return;
                }
            } else if let Some((ev, generation)) = watched.remove(&id) {
                let result = if res >= 0 {
                    Ok(())
                } else {
                    Err(format!("fence poll failed: {}", std::io::Error::from_raw_os_error(-res)).into())
                };
                ev.complete(generation, result);
            }
        }
    }
}
