//! [`IpcImporter`]: this process's side of blocks another process shares with it. Each of the
//! exporter's segments arrives once (its fd, mapped once, kept until the exporter says its
//! allocator let the segment go); a
//! block is then offsets into it ([`ImportedBlock`]), or for a page-stitched block of several
//! runs a view of its own mapping them in order. Dropping an [`ImportedBlock`] releases it to
//! the exporter.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};

use super::handle::IpcHandle;
use super::wire::{MAX_PACKET, Msg};
use crate::error::{Error, Result};
use crate::queue::{Event, Mem};
use crate::segment::{Access, Segment};
use crate::share::{Channel, Expect};
use crate::view::CpuView;

/// Opens blocks the process at the other end of a [`Channel`] exports with an
/// [`IpcExporter`](super::IpcExporter). `Send + Sync`.
pub struct IpcImporter {
    shared: Arc<Shared>,
}

struct Shared {
    channel: Channel,
    state: Mutex<State>,
    /// The channel's peer as the kernel recorded it (see [`Peer`]).
    peer: Peer,
}

/// The process at the other end of the channel, taken when the importer is made: its pid as
/// `SO_PEERCRED` gives it (in this process's pid namespace) and a pidfd of it, whose exit
/// fails the fences it has not signalled (a child it forked without exec keeps a fence's other
/// end open, so the fence's close alone does not tell).
enum Peer {
    /// A pidfd of the process with this pid.
    Alive(u32, std::os::fd::OwnedFd),
    /// The process with this pid had exited already (or its pid was not ours to watch).
    Exited(u32),
    /// Not known (not a socket with credentials, no pidfds here, Miri): fences alone decide.
    Unknown,
}

impl Peer {
    fn of(channel: &Channel) -> Peer {
        if cfg!(miri) {
            return Peer::Unknown;
        }
        let Ok(cred) = rustix::net::sockopt::socket_peercred(channel) else { return Peer::Unknown };
        let pid = cred.pid.as_raw_nonzero().get() as u32;
        if pid == std::process::id() {
            // This process (a pair it made itself): nothing to learn from its own exit.
            return Peer::Unknown;
        }
        match rustix::process::pidfd_open(cred.pid, rustix::process::PidfdFlags::empty()) {
            Ok(fd) => Peer::Alive(pid, fd),
            Err(rustix::io::Errno::SRCH) => Peer::Exited(pid),
            Err(_) => Peer::Unknown,
        }
    }
}

#[derive(Default)]
struct State {
    /// The exporter's segments by serial.
    segments: HashMap<u64, Arc<Segment>>,
    /// Shares received and not opened yet.
    shares: HashMap<u64, Share>,
    /// The exporter hung up: its holds are gone, so what it shared may be reused there.
    gone: Option<String>,
    /// Answers to this side's REQUESTs by request number: the export, or `None` (denied).
    grants: HashMap<u64, Option<u64>>,
    /// Requests whose caller still waits (a grant for any other is let go at once).
    waiting: std::collections::HashSet<u64>,
    next_request: u64,
}

struct Share {
    pid: u64,
    serial: u64,
    len: usize,
    ranges: Vec<(usize, usize)>,
    /// Completes when the exporter's queued work on the block is done (its fence).
    ready: Option<Event>,
}

impl std::fmt::Debug for IpcImporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.shared.lock();
        f.debug_struct("IpcImporter")
            .field("channel", &self.shared.channel.name())
            .field("segments", &st.segments.len())
            .field("unopened", &st.shares.len())
            .finish()
    }
}

impl IpcImporter {
    /// An importer on `channel` (the other end's process exports with an `IpcExporter`).
    pub fn new(channel: Channel) -> Self {
        let peer = Peer::of(&channel);
        Self::with(channel, peer)
    }

    /// An importer on `channel`, whose exporting process is `pid`, watched through `pidfd`:
    /// for a connection this process made itself (a socket pair whose other end it handed to
    /// the exporter), whose credentials name this process, not the exporter.
    pub(crate) fn with_peer(channel: Channel, pid: u32, pidfd: std::os::fd::OwnedFd) -> Self {
        Self::with(channel, Peer::Alive(pid, pidfd))
    }

    fn with(channel: Channel, peer: Peer) -> Self {
        Self { shared: Arc::new(Shared { channel, state: Mutex::new(State::default()), peer }) }
    }

    /// Opens the block `handle` names. Its export must have arrived on this channel already
    /// (the exporter sends it before returning the handle), so this never waits for the peer.
    /// Refused, saying why: a handle this channel carried no export for (forged, from another
    /// exporter, or already opened), one whose segment, offset or length disagree with the
    /// export (forged), or after the exporter hung up (its holds are gone). Everything the
    /// exporter sent is checked first: an fd that is not a sealed memfd or a dma-buf, ranges
    /// outside the segment or not page-aligned, a length past the ranges.
    pub fn open(&self, handle: &IpcHandle) -> Result<ImportedBlock> {
        let mut st = self.shared.lock();
        self.shared.pump(&mut st)?;
        let Some(share) = st.shares.get(&handle.export) else {
            if let Some(why) = &st.gone {
                return Err(Error::PeerGone { channel: format!("{} ({why})", self.shared.channel.name()) });
            }
            return Err(Error::InvalidArgument {
                what: format!(
                    "IPC handle: no export {} arrived on channel {} (forged, meant for another importer, or \
                     already opened)",
                    handle.export,
                    self.shared.channel.name()
                ),
            });
        };
        if share.pid != u64::from(handle.pid)
            || share.serial != handle.segment
            || share.ranges[0].0 as u64 != handle.offset
            || share.len as u64 != handle.len
        {
            return Err(Error::InvalidArgument {
                what: format!(
                    "IPC handle of export {}: process {} segment {} offset {} length {} do not match the export \
                     (process {}, segment {}, offset {}, length {}): forged, corrupted, or another exporter's",
                    handle.export,
                    handle.pid,
                    handle.segment,
                    handle.offset,
                    handle.len,
                    share.pid,
                    share.serial,
                    share.ranges[0].0,
                    share.len
                ),
            });
        }
        if let Some(why) = &st.gone {
            return Err(Error::PeerGone { channel: format!("{} ({why})", self.shared.channel.name()) });
        }
        let share = st.shares.remove(&handle.export).expect("found above");
        let seg = Arc::clone(&st.segments[&share.serial]);
        drop(st);
        let (seg, offset) = match share.ranges[..] {
            [(offset, _)] => (seg, offset),
            _ => (Arc::new(stitch(&seg, &share.ranges)?), 0),
        };
        Ok(ImportedBlock {
            importer: Arc::clone(&self.shared),
            export: handle.export,
            len: share.len,
            seg,
            offset,
            ready: share.ready,
        })
    }

    /// Takes in what the exporter sent so far without opening anything (never waits): its
    /// segments and shares, and the segments it let go, whose fds and mappings are closed
    /// here (blocks still open keep theirs). [`IpcImporter::open`] does this first.
    pub fn poll(&self) -> Result<()> {
        let mut st = self.shared.lock();
        self.shared.pump(&mut st)
    }

    /// Asks the exporter for the block it holds as `hold` (a process-wide handle's), and
    /// waits at most `timeout` for the answer: the export it became, which [`IpcImporter::open`]
    /// then opens.
    pub(crate) fn request(&self, hold: u64, pid: u32, timeout: std::time::Duration) -> Result<u64> {
        // Each ask has a number of its own: several threads may ask for the same hold at once,
        // and each must get its own answer (one GRANT, the others DENY).
        let request = {
            let mut st = self.shared.lock();
            st.next_request += 1;
            let request = st.next_request;
            st.waiting.insert(request);
            request
        };
        let r = self.await_answer(hold, request, pid, timeout);
        let mut st = self.shared.lock();
        if !st.waiting.remove(&request) {
            return r;
        }
        // Gave up (or failed) before the answer: a grant that comes later is let go.
        if let Some(Some(export)) = st.grants.remove(&request) {
            drop(st);
            let _ = self.discard(export);
        }
        r
    }

    fn await_answer(&self, hold: u64, request: u64, pid: u32, timeout: std::time::Duration) -> Result<u64> {
        if let Err(e) = self.shared.channel.send_bytes(&Msg::Request { hold, request }.encode(), &[]) {
            if matches!(e, Error::PeerGone { .. }) {
                // Hung up before it read this: later opens reconnect rather than reuse it.
                self.shared.lock().gone.get_or_insert_with(|| "the exporter hung up".into());
            }
            return Err(e);
        }
        let deadline = std::time::Instant::now() + timeout;
        loop {
            {
                let mut st = self.shared.lock();
                self.shared.pump(&mut st)?;
                if let Some(answer) = st.grants.remove(&request) {
                    st.waiting.remove(&request);
                    return answer.ok_or_else(|| Error::InvalidArgument {
                        what: format!(
                            "IPC handle: process {pid} holds no block as {hold} (forged, already opened, or revoked)"
                        ),
                    });
                }
                if let Some(why) = &st.gone {
                    return Err(Error::PeerGone { channel: format!("{} ({why})", self.shared.channel.name()) });
                }
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: "the exporting process to answer an IPC handle's request",
                    waited: timeout,
                });
            }
            // Another thread's pump may take the answer: look again at least every 20 ms.
            readable_within(&self.shared.channel, left.min(std::time::Duration::from_millis(20)))?;
        }
    }

    /// Lets go of export `export` without opening it (a share that arrived but is not wanted,
    /// e.g. whose handle was refused): the exporter is told, and releases it.
    pub fn discard(&self, export: u64) -> Result<()> {
        let mut st = self.shared.lock();
        self.shared.pump(&mut st)?;
        let Some(share) = st.shares.remove(&export) else {
            return Err(Error::InvalidArgument { what: format!("IPC: no unopened export {export} on this channel") });
        };
        drop(st);
        drop_shares([share]);
        self.shared.channel.send_bytes(&Msg::Release { export }.encode(), &[])
    }

    /// Whether the exporter hung up (as far as this side has read).
    pub fn is_gone(&self) -> bool {
        self.shared.lock().gone.is_some()
    }

    /// The channel (to count what was sent).
    pub fn channel(&self) -> &Channel {
        &self.shared.channel
    }

    /// Segments of the exporter this importer holds (one fd and one mapping each).
    pub fn segments(&self) -> usize {
        self.shared.lock().segments.len()
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes in every packet already waiting on the channel (never blocks). A failure (the
    /// exporter broke the protocol, or a segment could not be imported) ends the connection:
    /// later calls say so at once.
    fn pump(&self, st: &mut State) -> Result<()> {
        let r = self.pump_packets(st);
        if let Err(e) = &r {
            if st.gone.is_none() {
                st.gone = Some(format!("the connection failed: {e}"));
            }
        }
        if st.gone.is_some() && !st.shares.is_empty() {
            // Never to be opened (the exporter's holds are gone): their fences go too.
            drop_shares(std::mem::take(&mut st.shares).into_values());
        }
        r
    }

    fn pump_packets(&self, st: &mut State) -> Result<()> {
        let mut buf = vec![0u8; MAX_PACKET];
        while st.gone.is_none() && readable_within(&self.channel, std::time::Duration::ZERO)? {
            let (n, mut fds) = match self.channel.recv_bytes(&mut buf) {
                Ok(got) => got,
                Err(Error::PeerGone { .. }) => {
                    st.gone = Some("the exporter hung up".into());
                    break;
                }
                Err(e) => return Err(e),
            };
            let msg = Msg::decode(&buf[..n]).map_err(|why| self.channel.protocol_error(why))?;
            let fd = fds.pop();
            // A segment comes with its fd; a share may come with its fence; nothing else has one.
            let fd_ok = match msg {
                Msg::Segment { .. } => fd.is_some(),
                Msg::Share { .. } => true,
                _ => fd.is_none(),
            };
            if !fds.is_empty() || !fd_ok {
                return Err(self.channel.protocol_error(format!("{msg:?} came with {} fds", fds.len() + 1)));
            }
            match msg {
                Msg::Segment { kind, serial } => {
                    let fd = fd.expect("checked above");
                    if st.segments.contains_key(&serial) {
                        return Err(self.channel.protocol_error(format!("segment {serial} sent twice")));
                    }
                    let seg = Expect::new(kind).import(&fd, &format_args!("segment {serial}"), self.channel.name())?;
                    st.segments.insert(serial, Arc::new(seg));
                }
                Msg::Share { export, serial, len, pid, ranges } => {
                    let share = self.check_share(st, export, serial, len, ranges)?;
                    let ready = match fd {
                        Some(fd) => Some(self.fence(export, fd, pid)?),
                        None => None,
                    };
                    st.shares.insert(export, Share { pid, ready, ..share });
                }
                Msg::Gone { serial } => {
                    if st.segments.remove(&serial).is_none() {
                        return Err(self.channel.protocol_error(format!("segment {serial} let go, never sent")));
                    }
                    if st.shares.values().any(|s| s.serial == serial) {
                        return Err(self.channel.protocol_error(format!(
                            "segment {serial} let go while a share of it is unopened (and held)"
                        )));
                    }
                }
                Msg::Grant { request, export } => {
                    if !st.shares.contains_key(&export) {
                        return Err(self
                            .channel
                            .protocol_error(format!("request {request} granted as export {export}, never sent")));
                    }
                    if st.waiting.contains(&request) {
                        st.grants.insert(request, Some(export));
                    } else {
                        // Nobody waits for it (its caller gave up): let it go.
                        drop_shares(st.shares.remove(&export));
                        let _ = self.channel.send_bytes(&Msg::Release { export }.encode(), &[]);
                    }
                }
                Msg::Deny { request } => {
                    if st.waiting.contains(&request) {
                        st.grants.insert(request, None);
                    }
                }
                Msg::Release { .. } | Msg::Request { .. } => {
                    return Err(self.channel.protocol_error(format!("{msg:?} from the exporter")));
                }
            }
        }
        Ok(())
    }

    /// The event of export `export`'s fence: one end of a Unix stream socket pair (what
    /// `IpcExporter` sends) or the read end of a pipe (readable once the exporter's work is
    /// done; closed without a byte if it failed or the exporter died).
    fn fence(&self, export: u64, fd: std::os::fd::OwnedFd, pid: u64) -> Result<Event> {
        let st = rustix::fs::fstat(&fd).map_err(Error::io_rustix("fstat a share's fence"))?;
        let ok = match rustix::fs::FileType::from_raw_mode(st.st_mode) {
            rustix::fs::FileType::Fifo => true,
            rustix::fs::FileType::Socket => {
                rustix::net::sockopt::socket_type(&fd).is_ok_and(|t| t == rustix::net::SocketType::STREAM)
            }
            _ => false,
        };
        if !ok {
            return Err(self
                .channel
                .protocol_error(format!("export {export}: its fence is not a pipe or a stream socket")));
        }
        // Only where the share's pid is the channel's peer: a pid from another namespace, or
        // from a peer that did not make the channel, names some other process here.
        match &self.peer {
            Peer::Alive(p, pidfd) if u64::from(*p) == pid => Event::from_signal_fd(fd, pidfd.try_clone().ok()),
            Peer::Exited(p) if u64::from(*p) == pid && !crate::queue::fence_readable_now(&fd) => {
                // Gone before its share was read, without signalling: the work never finished.
                Ok(Event::failed("the process that was to signal the fence exited before it did"))
            }
            _ => Event::from_signal_fd(fd, None),
        }
    }

    fn check_share(&self, st: &State, export: u64, serial: u64, len: u64, ranges: Vec<(u64, u64)>) -> Result<Share> {
        let bad = |why: String| self.channel.protocol_error(format!("export {export}: {why}"));
        let seg = st.segments.get(&serial).ok_or_else(|| bad(format!("names segment {serial}, never sent")))?;
        if st.shares.contains_key(&export) {
            return Err(bad("sent twice".into()));
        }
        let size = seg.len() as u64;
        let page = crate::source::page_size() as u64;
        let mut total = 0u64;
        for &(off, l) in &ranges {
            if l == 0 || off.checked_add(l).is_none_or(|end| end > size) {
                return Err(bad(format!("range {off}+{l} outside the {size}-byte segment {serial}")));
            }
            if ranges.len() > 1 && (off % page != 0 || l % page != 0) {
                return Err(bad(format!("range {off}+{l} of a stitched block is not whole pages")));
            }
            total += l;
        }
        if len == 0 || len > total {
            return Err(bad(format!("{len} bytes in ranges of {total}")));
        }
        // Both fit in usize: they lie inside a mapped segment.
        Ok(Share {
            pid: 0,
            ready: None,
            serial,
            len: len as usize,
            ranges: ranges.into_iter().map(|(o, l)| (o as usize, l as usize)).collect(),
        })
    }
}

/// Drops a fence's event; if it was still pending, the fence watcher closes its fds now.
fn drop_fence(ready: Option<Event>) {
    if let Some(ev) = ready {
        let pending = !ev.is_complete();
        drop(ev);
        if pending {
            crate::queue::sweep_fences();
        }
    }
}

/// Drops shares that will never be opened, and their fences.
fn drop_shares(shares: impl IntoIterator<Item = Share>) {
    for s in shares {
        drop_fence(s.ready);
    }
}

/// Whether a packet (or a hang-up) waits on the channel within `timeout` (zero: a look that
/// does not wait; a signal ends the wait early, as "not yet").
fn readable_within(channel: &Channel, timeout: std::time::Duration) -> Result<bool> {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let fd = channel.as_fd();
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    let ts = Timespec { tv_sec: timeout.as_secs() as i64, tv_nsec: timeout.subsec_nanos() as i64 };
    match poll(&mut fds, Some(&ts)) {
        Ok(n) => Ok(n > 0),
        Err(rustix::io::Errno::INTR) => Ok(false),
        Err(e) => Err(Error::io_rustix("poll an IPC channel")(e)),
    }
}

/// A segment of its own showing `ranges` of `seg`'s fd in order (a reservation with each run
/// mapped at its place, as the exporter's arena shows the block).
#[cfg(not(miri))]
fn stitch(seg: &Segment, ranges: &[(usize, usize)]) -> Result<Segment> {
    let total = ranges.iter().map(|r| r.1).sum();
    let fd = seg.dup_fd()?;
    let view = Segment::expandable(fd, total, seg.kind(), crate::segment::Origin::Imported(seg.fd_kind()))?;
    let mut at = 0;
    for &(off, len) in ranges {
        view.map_view(at, off, len)?;
        at += len;
    }
    Ok(view)
}

#[cfg(miri)]
fn stitch(_: &Segment, _: &[(usize, usize)]) -> Result<Segment> {
    Err(Error::Unsupported { what: "stitched views under Miri".into() })
}

/// A block another process shared, open in this one. Dropping it releases it to the exporter.
pub struct ImportedBlock {
    importer: Arc<Shared>,
    export: u64,
    len: usize,
    /// The exporter's segment, or for a stitched block a view of its own over the runs.
    seg: Arc<Segment>,
    offset: usize,
    /// The exporter's fence: its queued work on the block (`None`: nothing was queued).
    ready: Option<Event>,
}

impl std::fmt::Debug for ImportedBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedBlock").field("export", &self.export).field("len", &self.len).finish()
    }
}

impl ImportedBlock {
    /// Bytes of the block (what the exporter's caller asked for).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (blocks are never empty).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The export's number on its channel.
    pub fn export(&self) -> u64 {
        self.export
    }

    /// Where the block starts in this process (for code that follows the crate's
    /// shared-memory access rule: another process writes these bytes too).
    pub fn as_ptr(&self) -> *mut u8 {
        self.seg.mapping().map_or(std::ptr::null_mut(), |m| m.as_ptr().wrapping_add(self.offset))
    }

    /// The block as a queue range (it keeps the mapping alive for the operations using it).
    pub fn mem(&self) -> Mem {
        Mem::from(&self.seg).range(self.offset, self.len).expect("an imported block lies inside its segment")
    }

    /// Whether the exporter's work queued on the block before it was shared is done (true if
    /// there was none; false if it failed, which [`ImportedBlock::wait_ready`] says).
    pub fn is_ready(&self) -> bool {
        self.ready.as_ref().is_none_or(|e| matches!(e.query(), Ok(true)))
    }

    /// Waits until the exporter's work queued on the block before it was shared is done
    /// (at most `timeout`; `None`: as long as it takes). Fails if that work failed, or the
    /// exporting process died before it finished.
    pub fn wait_ready(&self, timeout: Option<std::time::Duration>) -> Result<()> {
        match &self.ready {
            None => Ok(()),
            Some(ev) => ev.synchronize(timeout).map_err(|e| match e {
                Error::Timeout { .. } => e,
                e => Error::OperationFailed {
                    reason: format!(
                        "IPC export {}: the exporting process's queued work on the block did not finish (it failed, \
                         or the process died first): {e}",
                        self.export
                    )
                    .into(),
                },
            }),
        }
    }

    /// The exporter's fence as an event, for a queue to wait on ([`crate::queue::Queue::wait`])
    /// before it uses [`ImportedBlock::mem`] (`None`: nothing to wait for).
    pub fn ready_event(&self) -> Option<&Event> {
        self.ready.as_ref()
    }

    /// A CPU view of the whole block (bounded to it), once the block is ready
    /// ([`ImportedBlock::wait_ready`]): for work on many parts of it inside one access (one
    /// `DMA_BUF_IOCTL_SYNC` pair for a dma-buf), where [`ImportedBlock::read`] and
    /// [`ImportedBlock::write`] bracket each call.
    pub fn cpu_access(&self, access: Access) -> Result<CpuView<'_>> {
        self.wait_ready(None)?;
        CpuView::new(&self.seg, self.offset, self.len, access)
    }

    /// Copies `dst.len()` bytes at `offset` of the block out (bounded to the block), once the
    /// block is ready ([`ImportedBlock::wait_ready`]).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        self.wait_ready(None)?;
        CpuView::new(&self.seg, self.offset + offset, dst.len(), Access::Read)?.read(0, dst)
    }

    /// Copies `src` in at `offset` of the block (bounded to the block), once the block is
    /// ready ([`ImportedBlock::wait_ready`]).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        self.wait_ready(None)?;
        CpuView::new(&self.seg, self.offset + offset, src.len(), Access::Write)?.write(0, src)
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds { offset, len, size: self.len }),
        }
    }
}

impl Drop for ImportedBlock {
    /// Releases the block to the exporter (if it is still there to hear it).
    fn drop(&mut self) {
        drop_fence(self.ready.take());
        let _ = self.importer.channel.send_bytes(&Msg::Release { export: self.export }.encode(), &[]);
    }
}
