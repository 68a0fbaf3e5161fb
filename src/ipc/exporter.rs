//! [`IpcExporter`]: this process's side of sharing blocks of a caching allocator with one peer.
//!
//! Each block exported is held ([`ExportHold`](crate::caching)): a free of it here puts it in
//! limbo instead of reusing it, until the peer releases it (a RELEASE on the channel), hangs up
//! or dies (the kernel closes its end: the reader thread sees end of file), or this exporter is
//! dropped. A segment's fd goes to the peer once; later blocks of it are offsets only.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;

use super::handle::IpcHandle;
use super::wire::{MAX_PACKET, MAX_RUNS, Msg};
use crate::caching::{Allocation, CachingAllocator};
use crate::error::{Error, Result};
use crate::queue::Queue;
use crate::segment::Segment;
use crate::share::Channel;

/// How long an export waits for a peer that reads nothing (its socket buffer full) before it
/// fails with [`Error::Timeout`].
pub const SEND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Shares blocks of caching allocators with the process at the other end of a [`Channel`].
/// `Send + Sync`: several threads may export at once.
pub struct IpcExporter {
    shared: Arc<Shared>,
    reader: Option<JoinHandle<()>>,
}

struct Shared {
    channel: Channel,
    /// Held across the sends of one export (a segment's fd goes before the first share that
    /// names it); never by the reader thread, so a send blocked on a full socket does not
    /// stop releases.
    send_lock: Mutex<()>,
    /// Held briefly, never across a send.
    state: Mutex<State>,
    /// Blocks held for process-wide handles, which the peer may REQUEST ([`super::server`]).
    requests: Option<Arc<dyn HeldBlocks>>,
}

/// Where blocks held for process-wide handles wait until a peer asks for them.
pub(crate) trait HeldBlocks: Send + Sync {
    /// Takes the block held as `hold`, if there is one, with its fence ([`fence_after`]).
    fn take(&self, hold: u64) -> Option<(crate::caching::Exported, Option<OwnedFd>)>;
}

/// Whether held block `e` can be shared (a share carries at most [`MAX_RUNS`] ranges), and its
/// fence if `after` is given ([`fence_after`]): what every export and handle checks and makes
/// before anything is sent or kept.
pub(crate) fn shareable(e: &crate::caching::Exported, after: Option<&Queue>) -> Result<Option<OwnedFd>> {
    if e.ranges.len() > MAX_RUNS {
        return Err(Error::Unsupported {
            what: format!(
                "the block lies in {} runs of its arena's memfd, more than a share carries ({MAX_RUNS})",
                e.ranges.len()
            ),
        });
    }
    after.map(fence_after).transpose().map(Option::flatten)
}

/// A fence for the work `queue` has queued so far, which travels with a share: one end of a
/// Unix stream socket pair whose other end a callback on the queue sends one byte into, then
/// closes, once that work is done. The importer watches it (readable: done; closed without a
/// byte: the work failed, or this process died first). `None` if the queue has nothing
/// queued; the queue's error if its work has failed.
///
/// A socket, not a pipe: the byte goes with `MSG_NOSIGNAL`, so an importer that let go of the
/// fence first (dropped the block, exited, was killed) costs this process an `EPIPE`, not a
/// `SIGPIPE` on whatever thread ran the callback (which kills a C or C++ host).
fn fence_after(queue: &Queue) -> Result<Option<OwnedFd>> {
    // Work of the queue that failed never wrote what the importer would read: refused, as a
    // synchronize would be (an idle queue with an error would otherwise send no fence).
    if let Some(e) = queue.error() {
        return Err(e);
    }
    if queue.is_idle() {
        // Read again: work that failed between the two looks left the queue idle with its
        // error (errors stay until cleared), and must not go out with no fence.
        return queue.error().map_or(Ok(None), Err);
    }
    use rustix::net::{AddressFamily, SendFlags, SocketFlags, SocketType};
    let (r, w) = rustix::net::socketpair(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC, None)
        .map_err(Error::io_rustix("socketpair for a fence"))?;
    queue.callback(move |done| {
        if done.is_ok() {
            let _ = rustix::net::send(&w, &[1], SendFlags::NOSIGNAL);
        }
        drop(w);
    })?;
    Ok(Some(r))
}

#[derive(Default)]
struct State {
    /// The segments whose fd the peer has, by serial (weak: the allocator decides when one
    /// goes; then the peer is told, at the next export).
    sent: HashMap<u64, Weak<Segment>>,
    /// Holds of the exports the peer has not released.
    held: HashMap<u64, crate::caching::ExportHold>,
    next_export: u64,
    /// The peer hung up (or broke the protocol): every hold was released.
    gone: Option<String>,
}

impl std::fmt::Debug for IpcExporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcExporter").field("channel", &self.shared.channel.name()).field("held", &self.held()).finish()
    }
}

impl IpcExporter {
    /// An exporter on `channel` (one end of a connected pair; the peer makes an
    /// [`IpcImporter`](super::IpcImporter) on the other). Starts the thread that reads the
    /// peer's releases.
    pub fn new(channel: Channel) -> Result<Self> {
        Self::with_requests(channel, None)
    }

    /// An exporter that also answers the peer's REQUESTs for blocks held in `requests`.
    pub(crate) fn with_requests(channel: Channel, requests: Option<Arc<dyn HeldBlocks>>) -> Result<Self> {
        // A peer that stops reading makes exports fail after a while instead of blocking
        // their callers for good.
        channel.set_send_timeout(SEND_TIMEOUT)?;
        let shared = Arc::new(Shared {
            channel,
            send_lock: Mutex::new(()),
            state: Mutex::new(State { next_export: 1, ..Default::default() }),
            requests,
        });
        let reader = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("dmabuf-rt-ipc".into())
                .spawn(move || shared.read_releases())
                .map_err(Error::io("spawn the IPC release reader"))?
        };
        Ok(Self { shared, reader: Some(reader) })
    }

    /// Shares `block` with the peer and returns its handle, without waiting. If `after` is
    /// given, the work queued on it so far is the share's fence: the peer's block is ready
    /// ([`ImportedBlock::wait_ready`](super::ImportedBlock::wait_ready); its reads and writes
    /// wait for it) only once that work is done, so the peer never reads what this process's
    /// queue is still writing. The block is held until the peer releases it: freed here meanwhile, it
    /// waits in limbo (`DeviceStats::limbo_bytes`) and is not reused.
    pub fn export(&self, block: &Allocation, after: Option<&Queue>) -> Result<IpcHandle> {
        let e = block.export()?;
        let fence = shareable(&e, after)?;
        self.shared.send(e, fence)
    }

    /// [`IpcExporter::export`] for a raw allocation of `allocator` (the start of a live block).
    pub fn export_raw(&self, allocator: &CachingAllocator, ptr: *mut u8, after: Option<&Queue>) -> Result<IpcHandle> {
        let e = allocator.export_raw(ptr)?;
        let fence = shareable(&e, after)?;
        self.shared.send(e, fence)
    }

    /// Exports the peer has not released yet.
    pub fn held(&self) -> usize {
        self.shared.lock().held.len()
    }

    /// Why the peer is gone (it hung up, died or broke the protocol), if it is.
    pub fn peer_gone(&self) -> Option<String> {
        self.shared.lock().gone.clone()
    }

    /// The channel (to count what was sent).
    pub fn channel(&self) -> &Channel {
        &self.shared.channel
    }
}

impl Shared {
    /// Sends block `e` (checked by [`shareable`]) with its fence.
    fn send(&self, e: crate::caching::Exported, fence: Option<OwnedFd>) -> Result<IpcHandle> {
        let serial = e.segment.serial();
        let gone = |why: &str| Error::PeerGone { channel: format!("{} ({why})", self.channel.name()) };
        let _sending = self.send_lock.lock().unwrap_or_else(|p| p.into_inner());
        let (need_segment, let_go) = {
            let mut st = self.lock();
            if let Some(why) = &st.gone {
                return Err(gone(why));
            }
            let let_go: Vec<u64> = st.sent.iter().filter(|(_, w)| w.strong_count() == 0).map(|(&s, _)| s).collect();
            for s in &let_go {
                st.sent.remove(s);
            }
            (!st.sent.contains_key(&serial), let_go)
        };
        // Segments the allocator let go since the last export: the peer closes its copies.
        for serial in let_go {
            self.channel.send_bytes(&Msg::Gone { serial }.encode(), &[])?;
        }
        if need_segment {
            let fd = e.fd()?;
            let msg = Msg::Segment { kind: e.segment.kind(), serial };
            self.channel.send_bytes(&msg.encode(), &[fd.as_fd()])?;
            self.lock().sent.insert(serial, Arc::downgrade(&e.segment));
        }
        let first = e.ranges[0].0 as u64;
        let ranges: Vec<(u64, u64)> = e.ranges.iter().map(|&(o, l)| (o as u64, l as u64)).collect();
        let pid = std::process::id();
        let (len, hold) = (e.len as u64, e.hold);
        // Held before the share goes (the peer may release it at once), taken back if it fails.
        let export = {
            let mut st = self.lock();
            if let Some(why) = st.gone.clone() {
                drop(st);
                drop(hold);
                return Err(gone(&why));
            }
            let export = st.next_export;
            st.next_export += 1;
            st.held.insert(export, hold);
            export
        };
        let msg = Msg::Share { export, serial, len, pid: u64::from(pid), ranges };
        let fences: Vec<_> = fence.iter().map(AsFd::as_fd).collect();
        if let Err(err) = self.channel.send_bytes(&msg.encode(), &fences) {
            let hold = self.lock().held.remove(&export);
            drop(hold);
            return Err(err);
        }
        Ok(IpcHandle { pid, door: 0, export, segment: serial, offset: first, len, token: 0 })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A REQUEST for the block held as `hold`: its SHARE (and the segment's fd, the first
    /// time) then GRANT; or DENY if nothing is held so (forged, already taken, or this
    /// exporter answers no requests).
    fn answer(&self, hold: u64, request: u64) -> Result<()> {
        let Some((e, fence)) = self.requests.as_ref().and_then(|r| r.take(hold)) else {
            return self.channel.send_bytes(&Msg::Deny { request }.encode(), &[]);
        };
        let h = self.send(e, fence)?;
        self.channel.send_bytes(&Msg::Grant { request, export: h.export }.encode(), &[])
    }

    /// The reader thread: applies the peer's releases until it hangs up, then releases the rest.
    fn read_releases(&self) {
        let mut buf = vec![0u8; MAX_PACKET];
        let why = loop {
            match self.channel.recv_bytes(&mut buf) {
                Ok((n, fds)) => {
                    drop(fds);
                    match Msg::decode(&buf[..n]) {
                        Ok(Msg::Release { export }) => {
                            let hold = self.lock().held.remove(&export);
                            if hold.is_none() {
                                log::warn!(
                                    "{}: the peer released export {export}, which it does not hold (ignored)",
                                    self.channel.name()
                                );
                            }
                            drop(hold);
                        }
                        Ok(Msg::Request { hold, request }) => {
                            if let Err(e) = self.answer(hold, request) {
                                break format!("answering the peer's request for hold {hold} failed: {e}");
                            }
                        }
                        Ok(other) => break format!("the peer sent {other:?}, which only an exporter sends"),
                        Err(why) => break format!("the peer broke the protocol: {why}"),
                    }
                }
                Err(Error::PeerGone { .. }) => break "the peer hung up".to_string(),
                Err(e) => break format!("reading the peer's releases failed: {e}"),
            }
        };
        log::debug!("{}: {why}; releasing what it held", self.channel.name());
        // Hung up on this side too, so that a peer waiting for an answer (its request could not
        // be answered) learns at once, not when its wait runs out.
        let _ = rustix::net::shutdown(self.channel.as_fd(), rustix::net::Shutdown::Both);
        let held = {
            let mut st = self.lock();
            st.gone = Some(why);
            std::mem::take(&mut st.held)
        };
        // Dropped outside the state lock (each release takes the allocator's lock).
        drop(held);
    }
}

impl Drop for IpcExporter {
    /// Hangs up (the peer sees end of file) and releases every hold: blocks this process freed
    /// meanwhile are reused from then on, so drop the exporter only once the peer is done.
    fn drop(&mut self) {
        let _ = rustix::net::shutdown(self.shared.channel.as_fd(), rustix::net::Shutdown::Both);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}
