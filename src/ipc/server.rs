//! Process-wide IPC handles ([`get_handle`], [`open_handle`]), as `cudaIpcGetMemHandle` /
//! `cudaIpcOpenMemHandle`: a handle made here can be opened by any process of the same user
//! that gets its 64 bytes, with no channel set up beforehand.
//!
//! The first handle starts this process's IPC socket: a `SOCK_SEQPACKET` Unix socket on an
//! abstract name (no file) made of the pid and a random token that the handle carries. A
//! block given a handle is held at once (freed here meanwhile, it waits in limbo). An importing
//! process connects once per exporting process and REQUESTs the hold; the connection's
//! [`IpcExporter`] sends the segment's fd (once per connection) and the block's SHARE, then
//! GRANTs it, and from then on the block is released as any export is: when the importer drops
//! it, exits or dies. A handle opens once (it is consumed); a handle never opened keeps its
//! block held until [`revoke_handle`] or the end of the process. Peers of another user are
//! refused (`SO_PEERCRED`).
//!
//! A process that cannot reach that socket (abstract names are per network namespace: a
//! container with a network of its own) comes in through the *door* instead, where the kernel
//! lets it take another process's fds (`pidfd_getfd`: the same user in the same user
//! namespace, or `CAP_SYS_PTRACE`, and no Yama rule against it). The door is one end of a socket
//! pair that the exporting process keeps open, at the fd number the handle carries; its other
//! end, which the exporter reads, is bound to an abstract name made of the pid and the token,
//! so that the door proves whose it is. The importer goes to the door only when the exporter is
//! in another network namespace than its own (in the same one, an IPC socket that does not
//! answer means the exporter is gone: a stale handle, whose pid may be another process now). It
//! takes a copy of the door with `pidfd_getfd`, checks the name of its peer, makes a socket
//! pair of its own, and sends one end through the door with the handle's token; the exporter
//! serves that end as it would an accepted connection, so shares, grants, fences and releases
//! (and the release of everything when the importer dies: the hang-up) are the same on both
//! paths. Where the kernel refuses `pidfd_getfd`, the open fails with [`Error::NotPermitted`],
//! saying what would permit it. A socket whose other end the exporter holds itself (the door,
//! or a connection to its own IPC socket) is refused at the door, and a door that a knocking
//! process shut down is replaced by a new one at the same fd number.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::exporter::{HeldBlocks, IpcExporter};
use super::handle::IpcHandle;
use super::importer::{ImportedBlock, IpcImporter};
use crate::caching::{Allocation, CachingAllocator, Exported};
use crate::error::{Error, Result};
use crate::queue::Queue;
use crate::share::{Channel, packet};

/// How long [`open_handle`] waits for the exporting process to answer.
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(30);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The abstract socket name of process `pid`'s IPC socket with `token`.
fn socket_name(pid: u32, token: u64) -> Vec<u8> {
    format!("dmabuf-rt-ipc/{pid}/{token:016x}").into_bytes()
}

/// The abstract name the inner end of process `pid`'s door is bound to (the peer's name an
/// importer sees on the door it took).
fn door_name(pid: u32, token: u64) -> Vec<u8> {
    format!("dmabuf-rt-ipc-door/{pid}/{token:016x}").into_bytes()
}

/// A door: the end importers take (`door`), moved to fd 3 or above (a handle's door 0 means
/// none; fd 0 is free only if stdin was closed), and the end read here (`inner`), bound to
/// [`door_name`].
fn new_door(pid: u32, token: u64) -> rustix::io::Result<(OwnedFd, OwnedFd)> {
    let (inner, door) = packet::seqpacket_pair()?;
    rustix::net::bind(&inner, &rustix::net::SocketAddrUnix::new_abstract_name(&door_name(pid, token))?)?;
    let door = rustix::io::fcntl_dupfd_cloexec(&door, 3)?;
    Ok((door, inner))
}

/// This process's exporting side: the blocks held for handles, and the connections.
struct Server {
    /// The process it runs in (a forked child's copy has no accept thread).
    pid: u32,
    token: u64,
    /// The door's end that importers take with `pidfd_getfd` (kept open, never used here); its
    /// fd number goes in every handle, and stays when the door is replaced.
    door: Mutex<OwnedFd>,
    held: Mutex<HashMap<u64, (Exported, Option<OwnedFd>)>>,
    /// One exporter per connected importer; those whose peer is gone are dropped as new ones
    /// come.
    exporters: Mutex<Vec<IpcExporter>>,
}

impl HeldBlocks for Server {
    fn take(&self, hold: u64) -> Option<(Exported, Option<OwnedFd>)> {
        lock(&self.held).remove(&hold)
    }
}

static SERVER: OnceLock<std::result::Result<Arc<Server>, String>> = OnceLock::new();

fn server() -> Result<&'static Arc<Server>> {
    let s = SERVER.get_or_init(start).as_ref().map_err(|why| Error::Unsupported { what: why.clone() })?;
    if s.pid != std::process::id() {
        return Err(Error::Unsupported {
            what: format!(
                "IPC handles: the IPC socket belongs to process {}, which forked this one after making it; a forked \
                 process cannot make handles (start it with spawn, or fork before the first handle)",
                s.pid
            ),
        });
    }
    Ok(s)
}

/// A random number other than 0, from the kernel's generator (`getrandom`), or where that
/// fails from std's randomly seeded hasher.
fn random_nonzero() -> u64 {
    loop {
        let mut b = [0u8; 8];
        let t = match rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()) {
            Ok(8) => u64::from_ne_bytes(b),
            _ => std::collections::hash_map::RandomState::new().build_hasher().finish(),
        };
        if t != 0 {
            return t;
        }
    }
}

fn start() -> std::result::Result<Arc<Server>, String> {
    let token = random_nonzero();
    let name = socket_name(std::process::id(), token);
    let listener = packet::listen_abstract(&name).map_err(|e| format!("the IPC socket (listen): {e}"))?;
    let (door, door_in) = new_door(std::process::id(), token).map_err(|e| format!("the IPC door: {e}"))?;
    let server = Arc::new(Server {
        pid: std::process::id(),
        token,
        door: Mutex::new(door),
        held: Mutex::new(HashMap::new()),
        exporters: Mutex::default(),
    });
    let s = Arc::clone(&server);
    let reserve = spare_fd();
    std::thread::Builder::new()
        .name("dmabuf-rt-ipc-accept".into())
        .spawn(move || accept_loop(listener, door_in, s, reserve))
        .map_err(|e| format!("the IPC socket's thread: {e}"))?;
    Ok(server)
}

/// An fd kept in reserve by the accept loop (see there).
fn spare_fd() -> Option<std::os::fd::OwnedFd> {
    rustix::fs::open("/dev/null", rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC, 0.into()).ok()
}

/// Serves connections from the IPC socket (`listener`) and through the door (`door_in`).
///
/// `reserve`: an fd kept in reserve (opened before the thread starts, while fds are there).
/// When the process is out of fds, it is given up to accept the connection waiting at the head
/// of the queue and close it at once (that process's open fails: the exporter hung up), so that
/// `accept` does not fail again at once, forever; then taken again.
fn accept_loop(listener: OwnedFd, door_in: OwnedFd, server: Arc<Server>, mut reserve: Option<OwnedFd>) {
    use rustix::event::{PollFd, PollFlags};
    use rustix::io::Errno;
    let me = rustix::process::getuid().as_raw();
    let mut door_in = Some(door_in);
    loop {
        // A connection first: `accept` takes its fd before it waits, so out of fds it fails
        // at once, pending connection or not.
        let mut pending = vec![PollFd::new(&listener, PollFlags::IN)];
        pending.extend(door_in.as_ref().map(|d| PollFd::new(d, PollFlags::IN)));
        match rustix::event::poll(&mut pending, None) {
            Ok(_) | Err(Errno::INTR) => {}
            Err(e) => {
                log::error!("the IPC socket stopped accepting: poll: {e}");
                return;
            }
        }
        let at_socket = !pending[0].revents().is_empty();
        let at_door = pending.get(1).is_some_and(|p| !p.revents().is_empty());
        drop(pending);
        if at_door && door_in.as_ref().is_some_and(|d| answer_door(d.as_fd(), &server, me) == Door::Shut) {
            // A process that took the door shut it down (`shutdown(2)` acts on the socket, not
            // on the copy it holds): a new door is made below.
            log::warn!("the IPC door was shut down by a process that took it; a new one replaces it");
            door_in = None;
        }
        if door_in.is_none() {
            // A new door at the same fd number, so that handles already out keep working; the
            // old one's copies lead nowhere. Failing (out of fds), none until the next wakeup.
            match new_door(server.pid, server.token)
                .and_then(|(door, inner)| rustix::io::dup2(&door, &mut lock(&server.door)).map(|()| inner))
            {
                Ok(inner) => door_in = Some(inner),
                Err(e) => log::error!("the IPC door could not be replaced ({e}); it stays shut for now"),
            }
        }
        if !at_socket {
            continue;
        }
        let (fd, uid) = match packet::accept(listener.as_fd()) {
            Ok(got) => got,
            Err(Errno::INTR | Errno::CONNABORTED | Errno::AGAIN) => continue,
            Err(e @ (Errno::MFILE | Errno::NFILE)) => {
                if reserve.take().is_some() {
                    if rustix::net::accept_with(listener.as_fd(), rustix::net::SocketFlags::CLOEXEC).is_ok() {
                        log::warn!(
                            "the IPC socket refused a process: {e} (this process is out of file descriptors or memory)"
                        );
                    }
                    reserve = spare_fd();
                } else {
                    // No fd in reserve either: nothing to accept with until some other fd
                    // closes, which nothing announces; look again shortly (an error path only).
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    reserve = spare_fd();
                }
                continue;
            }
            Err(e @ (Errno::BADF | Errno::INVAL | Errno::NOTSOCK | Errno::OPNOTSUPP)) => {
                log::error!("the IPC socket stopped accepting: {e}");
                return;
            }
            // Anything else (no memory, a security module's refusal, the peer's credentials)
            // may last while the connection stays queued, and `poll` would say so at once
            // again: look again shortly (an error path only).
            Err(e) => {
                log::warn!("the IPC socket could not take a connection: {e}");
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
        };
        serve(&server, fd, uid, me, "socket");
    }
}

/// Serves a connected importer (from the socket or through the door) of user `uid`: an
/// exporter of its own, answering its REQUESTs from the held blocks. Another user's is refused.
fn serve(server: &Arc<Server>, fd: OwnedFd, uid: u32, me: u32, way: &str) {
    if uid != me {
        log::warn!("the IPC {way} refused a process of user {uid} (this process is user {me})");
        return;
    }
    let channel = Channel::from_connected(fd, "ipc handle peer");
    let requests: Arc<dyn HeldBlocks> = Arc::clone(server) as Arc<dyn HeldBlocks>;
    match IpcExporter::with_requests(channel, Some(requests)) {
        Ok(e) => {
            let mut all = lock(&server.exporters);
            all.retain(|e| e.peer_gone().is_none());
            all.push(e);
        }
        Err(e) => log::error!("the IPC {way} could not serve a peer: {e}"),
    }
}

/// The one packet an importer sends through the door: the handle's token and one fd, the
/// end of its socket pair that becomes the connection.
const KNOCK_BYTES: usize = 8;

/// What [`answer_door`] found.
#[derive(Debug, PartialEq, Eq)]
enum Door {
    /// A knock answered (served or refused), or none there any more.
    Open,
    /// The door was shut down: it reads end of file, now and forever.
    Shut,
}

/// A knock at the door: the token of this process's handles and one connected
/// `SOCK_SEQPACKET` socket of a process of this user, whose other end this process does not
/// hold, which is served as an accepted connection. Anything else is refused and its fds
/// closed (the knocking process sees its end hang up). Read without waiting: a process holding
/// the door may also read from it, and take the knock `poll` announced.
fn answer_door(door_in: BorrowedFd<'_>, server: &Arc<Server>, me: u32) -> Door {
    let mut buf = [0u8; KNOCK_BYTES + 1];
    let (len, mut fds) = match packet::recv_now(door_in, &mut buf) {
        Ok(packet::Packet::Data { len, fds, truncated: false }) => (len, fds),
        Ok(packet::Packet::Data { truncated: true, .. }) => {
            log::warn!(
                "the IPC door refused a knock: too long, or its fd did not fit (this process may be out of file \
                 descriptors)"
            );
            return Door::Open;
        }
        Ok(packet::Packet::Eof) => return Door::Shut,
        Ok(packet::Packet::Empty) => return Door::Open,
        Err(rustix::io::Errno::INTR | rustix::io::Errno::AGAIN) => return Door::Open,
        Err(e) => {
            // Whatever this is may last while the knock stays queued, and `poll` would say so
            // at once again: look again shortly (an error path only).
            log::warn!("the IPC door could not take a knock: {e}");
            std::thread::sleep(Duration::from_millis(10));
            return Door::Open;
        }
    };
    if len != KNOCK_BYTES || buf[..KNOCK_BYTES] != server.token.to_le_bytes() || fds.len() != 1 {
        log::warn!("the IPC door refused a knock: {len} bytes and {} fds, or not this process's token", fds.len());
        return Door::Open;
    }
    let fd = fds.pop().expect("one fd");
    if !packet::is_seqpacket(fd.as_fd()).unwrap_or(false) || packet::prepare_inherited(fd.as_fd()).is_err() {
        log::warn!("the IPC door refused a knock: its fd is not a connected SOCK_SEQPACKET socket");
        return Door::Open;
    }
    match rustix::net::sockopt::socket_peercred(&fd) {
        // Its other end made (or listened) here: the door itself, a connection to this
        // process's own IPC socket. Served, it would never hang up.
        Ok(cred) if cred.pid.as_raw_nonzero().get() as u32 == server.pid => {
            log::warn!("the IPC door refused a knock: the socket's other end is this process's own");
        }
        Ok(cred) => serve(server, fd, cred.uid.as_raw(), me, "door"),
        Err(e) => log::warn!("the IPC door refused a knock: the credentials of its socket: {e}"),
    }
    Door::Open
}

/// A handle any process of this user can open with [`open_handle`], for `block`. The block is
/// held from now on: freed here, it waits in limbo until the handle is opened and the importer
/// lets go (or [`revoke_handle`]). If `after` is given, the work queued on it so far is the
/// handle's fence: the opened block is ready only once that work is done (see
/// [`IpcExporter::export`]).
pub fn get_handle(block: &Allocation, after: Option<&Queue>) -> Result<IpcHandle> {
    hold(block.export()?, after)
}

/// [`get_handle`] for a raw allocation of `allocator` (the start of a live block).
pub fn get_handle_raw(allocator: &CachingAllocator, ptr: *mut u8, after: Option<&Queue>) -> Result<IpcHandle> {
    hold(allocator.export_raw(ptr)?, after)
}

fn hold(e: Exported, after: Option<&Queue>) -> Result<IpcHandle> {
    let fence = super::exporter::shareable(&e, after)?;
    let server = server()?;
    // Random, so that another process of the user cannot take a handle by guessing its hold
    // (the real opener would then be refused).
    let mut held = lock(&server.held);
    let hold = loop {
        let h = random_nonzero();
        if !held.contains_key(&h) {
            break h;
        }
    };
    let h = IpcHandle {
        pid: std::process::id(),
        door: lock(&server.door).as_raw_fd() as u32,
        export: hold,
        segment: e.segment.serial(),
        offset: e.ranges[0].0 as u64,
        len: e.len as u64,
        token: server.token,
    };
    held.insert(hold, (e, fence));
    Ok(h)
}

/// Lets go of a handle made here that was never opened: its block is no longer held (if it
/// was freed, its free completes). Refused if the handle is not one of this process's
/// unopened handles.
pub fn revoke_handle(handle: &IpcHandle) -> Result<()> {
    let server = server()?;
    if handle.pid != std::process::id() || handle.token != server.token {
        return Err(Error::InvalidArgument { what: "IPC handle: not made by this process".into() });
    }
    let e = lock(&server.held).remove(&handle.export).ok_or_else(|| Error::InvalidArgument {
        what: format!("IPC handle: hold {} is not an unopened handle of this process", handle.export),
    })?;
    drop(e);
    Ok(())
}

/// Handles of this process not opened yet.
pub fn unopened_handles() -> usize {
    SERVER.get().and_then(|s| s.as_ref().ok()).map_or(0, |s| lock(&s.held).len())
}

/// The importing side: one connection per exporting process, by this process's pid (a forked
/// child must not use its parent's connections), the exporter's pid and its token.
type Clients = Mutex<HashMap<(u32, u32, u64), Arc<IpcImporter>>>;

static CLIENTS: OnceLock<Clients> = OnceLock::new();

/// What is left until `deadline` (at least a millisecond: a zero timeout means none).
fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
}

fn client(pid: u32, token: u64, door: u32, deadline: Instant) -> Result<Arc<IpcImporter>> {
    let clients = CLIENTS.get_or_init(Mutex::default);
    let key = (std::process::id(), pid, token);
    if let Some(i) = lock(clients).get(&key) {
        if !i.is_gone() {
            return Ok(Arc::clone(i));
        }
    }
    // Connected without the lock: a process whose listen queue is full must not hold up the
    // opens of other processes' handles.
    let name = format!("ipc handles of process {pid}");
    let i = match packet::connect_abstract(&socket_name(pid, token), left(deadline)) {
        Ok((fd, uid)) => {
            let me = rustix::process::getuid().as_raw();
            if uid != me {
                return Err(Error::InvalidArgument {
                    what: format!("IPC handle: process {pid} runs as user {uid}, not this process's {me}"),
                });
            }
            IpcImporter::new(Channel::from_connected(fd, &name))
        }
        Err(e) => {
            let gone = |why: &str| Error::PeerGone { channel: format!("the IPC socket of process {pid} ({e}: {why})") };
            if door == 0 {
                return Err(gone(
                    "the process is gone, does not accept, or the handle is forged or from another network namespace",
                ));
            }
            if let Some(why) = not_behind_a_door(pid) {
                return Err(gone(&why));
            }
            let (fd, pidfd) = through_door(pid, door, token, e, deadline)?;
            IpcImporter::with_peer(Channel::from_connected(fd, &format!("{name} (through its door)")), pid, pidfd)
        }
    };
    let mut all = lock(clients);
    // Another thread may have connected meanwhile: one connection per process is kept.
    if let Some(i) = all.get(&key).filter(|i| !i.is_gone()) {
        return Ok(Arc::clone(i));
    }
    let i = Arc::new(i);
    all.insert(key, Arc::clone(&i));
    Ok(i)
}

/// Why process `pid` is not an exporter this process could reach through a door: gone, another
/// user's (exporters refuse other users), or in this network namespace (where its IPC socket
/// not answering means it is gone or stopped accepting: a stale handle, whose pid may be
/// another process now, must not be knocked on). `None` where it may be one: in another
/// network namespace, or where this process may not look (another user namespace), and the
/// door will tell.
fn not_behind_a_door(pid: u32) -> Option<String> {
    use rustix::io::Errno;
    let proc = format!("/proc/{pid}");
    let st = match rustix::fs::stat(proc.as_str()) {
        Ok(st) => st,
        Err(Errno::NOENT | Errno::SRCH) => return Some("the process is gone".into()),
        Err(e) => return Some(format!("/proc/{pid}: {e}")),
    };
    let me = rustix::process::getuid().as_raw();
    if st.st_uid != me {
        return Some(format!(
            "the process is gone; pid {pid} is now a process of user {}, not this process's {me}: the handle is stale",
            st.st_uid
        ));
    }
    let ns = |p: &str| std::fs::read_link(format!("{p}/ns/net"));
    match (ns(&proc), ns("/proc/self")) {
        (Ok(theirs), Ok(mine)) if theirs == mine => Some(
            "the process is in this network namespace and does not answer: it is gone, stopped, or not the exporter \
             (the handle is stale or forged)"
                .into(),
        ),
        (Err(e), _) if e.kind() == std::io::ErrorKind::NotFound => Some("the process is gone".into()),
        _ => None,
    }
}

/// A connection to process `pid` through its door (fd `door` there; see the module docs), made
/// because its IPC socket could not be reached (`socket_err`) from this network namespace: the
/// end of a socket pair made here whose other end went through the door with `token`, and a
/// pidfd of the process. The fd taken must be a door whose peer is bound to the name of `pid`'s
/// door with `token`; nothing is sent to anything else.
fn through_door(
    pid: u32,
    door: u32,
    token: u64,
    socket_err: rustix::io::Errno,
    deadline: Instant,
) -> Result<(OwnedFd, OwnedFd)> {
    use rustix::io::Errno;
    let unreachable = |why: String| Error::PeerGone {
        channel: format!("the IPC socket of process {pid} ({socket_err}), and its door ({why})"),
    };
    let Some(raw) = rustix::process::Pid::from_raw(pid as i32) else {
        return Err(unreachable(format!("pid {pid} cannot be a process: the handle is forged")));
    };
    let pidfd = match rustix::process::pidfd_open(raw, rustix::process::PidfdFlags::empty()) {
        Ok(fd) => fd,
        Err(Errno::SRCH) => return Err(unreachable("no such process: it exited".into())),
        Err(e) => return Err(unreachable(format!("pidfd_open: {e}"))),
    };
    let taken = rustix::process::pidfd_getfd(&pidfd, door as i32, rustix::process::PidfdGetfdFlags::empty());
    let door_fd = match taken {
        Ok(fd) => fd,
        Err(e @ (Errno::PERM | Errno::ACCESS)) => {
            return Err(Error::NotPermitted {
                what: format!(
                    "IPC handle: taking the door (fd {door}) of process {pid}, whose IPC socket this process cannot \
                     reach ({socket_err}: another network namespace?), with pidfd_getfd"
                ),
                source: e.into(),
                why: "the kernel allows it to a process of the same user in the same user namespace that may \
                      ptrace the exporter (Yama's kernel.yama.ptrace_scope 0, the exporter dumpable), or to one \
                      with CAP_SYS_PTRACE over it; or share the network namespace (or a Channel) instead"
                    .into(),
            });
        }
        Err(Errno::SRCH) => return Err(unreachable("pidfd_getfd: the process exited".into())),
        Err(Errno::BADF) => {
            return Err(unreachable(format!("the process has no fd {door}: the handle is forged or not its own")));
        }
        Err(Errno::NOSYS) => return Err(unreachable("pidfd_getfd: this kernel has none (Linux 5.6 or later)".into())),
        Err(e) => return Err(unreachable(format!("pidfd_getfd: {e}"))),
    };
    if !packet::is_seqpacket(door_fd.as_fd()).unwrap_or(false) {
        return Err(unreachable(format!("its fd {door} is not a SOCK_SEQPACKET socket: the handle is forged")));
    }
    let peer = rustix::net::getpeername(&door_fd).ok().flatten();
    let peer = peer.and_then(|a| rustix::net::SocketAddrUnix::try_from(a).ok());
    if peer.as_ref().and_then(|a| a.abstract_name()) != Some(door_name(pid, token).as_slice()) {
        return Err(unreachable(format!(
            "its fd {door} is not its IPC door with this handle's token: the handle is stale or forged"
        )));
    }
    // The door is shared by every process that knocks: a send that cannot go through (the
    // exporter no longer answers its door) gives up at the open's deadline.
    rustix::net::sockopt::set_socket_timeout(&door_fd, rustix::net::sockopt::Timeout::Send, Some(left(deadline)))
        .map_err(Error::io_rustix("setsockopt(SO_SNDTIMEO) on an IPC door"))?;
    let (mine, theirs) = packet::seqpacket_pair().map_err(Error::io_rustix("socketpair for an IPC door"))?;
    packet::send(door_fd.as_fd(), &token.to_le_bytes(), &[theirs.as_fd()])
        .map_err(|e| unreachable(format!("knocking: {e}")))?;
    Ok((mine, pidfd))
}

/// Opens a handle from [`get_handle`] made in another process (or this one): connects to the
/// exporting process once, asks for the block and maps it (each of its segments once per
/// process). A handle opens once. A process whose IPC socket this one cannot reach (another
/// network namespace) is reached through its door with `pidfd_getfd` (see the module docs).
/// Refused, saying why: a handle of a channel export (token 0), a process that is gone, a
/// handle forged or already opened, an answer slower than [`OPEN_TIMEOUT`], and
/// [`Error::NotPermitted`] where the kernel does not let this process take the door.
pub fn open_handle(handle: &IpcHandle) -> Result<ImportedBlock> {
    if handle.token == 0 {
        return Err(Error::InvalidArgument {
            what: "IPC handle: a channel export's handle (token 0); open it with IpcImporter::open on its channel"
                .into(),
        });
    }
    // One deadline for the connection, the knock and the answer.
    let deadline = Instant::now() + OPEN_TIMEOUT;
    let importer = client(handle.pid, handle.token, handle.door, deadline)?;
    let export = importer.request(handle.export, handle.pid, left(deadline))?;
    importer.open(&IpcHandle { export, token: 0, ..*handle }).inspect_err(|_| {
        // A handle that does not match the block it named (forged): the hold is let go.
        let _ = importer.discard(export);
    })
}
