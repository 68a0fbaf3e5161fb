//! Hostile review of the IPC door (process-wide handles reached with `pidfd_getfd` from another
//! network namespace): garbage knocks, floods, an exporter out of fds, knocks of another user,
//! knocks with sockets whose other end the exporter holds itself, a door shut down by a knocker,
//! stale handles whose pid is now another process, and how long an open may take.
//!
//! The exporter is this test binary again (`hostile_door_child` alone, `HOSTILE_DOOR_ROLE` in
//! its environment), in a network namespace of its own where the machine allows it (root: a
//! new network namespace; otherwise a new user and network namespace), driven over a control
//! channel on its stdin; or this process itself (its own door). Tests whose namespaces, or
//! whose credentials (root, to act as another user), the machine does not give say so and skip.
//!
//! Tests marked `BUG` fail on the code they were written against; each says why and how to fix.

#![allow(unsafe_code)] // unshare(2) between fork and exec (`CommandExt::pre_exec`)

mod common;

use common::control::{Ctl, cmd_of, ctl};
use common::wait::{wait_until, within};
use common::{fill_pattern, pattern};

use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dmabuf_rt::ipc::{IpcHandle, OPEN_TIMEOUT, get_handle, open_handle};
use dmabuf_rt::share::Channel;
use dmabuf_rt::{Error, ErrorKind};
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
    SocketAddrUnix, SocketFlags, SocketType,
};
use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags, Signal};
use rustix::thread::UnshareFlags;

static WAIT: std::sync::LazyLock<Duration> =
    std::sync::LazyLock::new(|| Duration::from_secs(30) * common::time_scale());
const ROLE_ENV: &str = "HOSTILE_DOOR_ROLE";
const KB: usize = 1 << 10;
const MB: u64 = 1 << 20;

// Commands of the control channel; the low byte is the command, the rest its argument.
/// Exporter: `cmd >> 8` blocks of 64 KiB, each filled with the pattern of its handle's export
/// number and freed at once; one answer per handle, carrying it.
const MAKE: u64 = 1;
/// Exporter: its allocator's limbo bytes.
const LIMBO: u64 = 2;
/// Exporter: lowers its soft RLIMIT_NOFILE to a little above what it has open and opens fds
/// until it has none left; answers how many it opened.
const EXHAUST: u64 = 3;
/// Exporter: closes them and restores the limit; answers 0.
const RELIEVE: u64 = 4;
const EXIT: u64 = 5;

fn open_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// The exporter's side, in the child.
#[test]
fn hostile_door_child() {
    let Ok(_role) = std::env::var(ROLE_ENV) else { return };
    let fd = std::io::stdin().as_fd().try_clone_to_owned().unwrap();
    let control = Channel::from_fd(fd, "control").unwrap();
    let a = common::allocator("", 64 * MB);
    let mut hogs: Vec<OwnedFd> = Vec::new();
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    loop {
        let Ok(m) = control.recv::<Ctl>() else { return };
        let (cmd, _) = cmd_of(&m.msg);
        let answer = match cmd & 0xff {
            MAKE => {
                for _ in 0..cmd >> 8 {
                    let x = a.allocate(64 * KB, None).unwrap();
                    let h = get_handle(&x, None).unwrap();
                    fill_pattern(&x, h.export as u8);
                    drop(x);
                    control.send(&ctl(0, Some(&h))).unwrap();
                }
                continue;
            }
            LIMBO => a.stats().limbo_bytes.current as u64,
            EXHAUST => {
                let low = rustix::process::Rlimit {
                    current: Some(open_count(std::process::id()) as u64 + 32),
                    maximum: limit.maximum,
                };
                rustix::process::setrlimit(rustix::process::Resource::Nofile, low).unwrap();
                while let Ok(fd) = rustix::fs::open("/dev/null", rustix::fs::OFlags::RDONLY, 0.into()) {
                    hogs.push(fd);
                }
                hogs.len() as u64
            }
            RELIEVE => {
                hogs.clear();
                rustix::process::setrlimit(rustix::process::Resource::Nofile, limit).unwrap();
                0
            }
            _ => return,
        };
        control.send(&ctl(answer, None)).unwrap();
    }
}

/// An exporting child; killed (and let run first, if stopped) when dropped.
struct Exporter {
    child: Child,
    control: Channel,
}

impl Exporter {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn ask(&self, cmd: u64) -> u64 {
        self.control.send(&ctl(cmd, None)).unwrap();
        cmd_of(&self.control.recv::<Ctl>().unwrap().msg).0
    }

    fn handles(&self, n: u64) -> Vec<IpcHandle> {
        self.control.send(&ctl(MAKE | n << 8, None)).unwrap();
        (0..n).map(|_| cmd_of(&self.control.recv::<Ctl>().unwrap().msg).1.unwrap()).collect()
    }

    fn signal(&self, sig: Signal) {
        rustix::process::kill_process(Pid::from_raw(self.pid() as i32).unwrap(), sig).unwrap();
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        let _ = self.control.send(&ctl(EXIT, None));
        let _ = rustix::process::kill_process(Pid::from_raw(self.pid() as i32).unwrap(), Signal::CONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An exporting child, in a network namespace of its own if `elsewhere` (so that this process
/// reaches it through its door); `None` (saying why) where the machine does not allow it.
fn exporter(elsewhere: bool) -> Option<Exporter> {
    let (mine, theirs) = Channel::pair("control").unwrap();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["hostile_door_child", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, "exporter")
        .stdin(Stdio::from(theirs.into_fd()))
        .stdout(Stdio::null());
    if elsewhere {
        let flags = if rustix::process::geteuid().is_root() {
            UnshareFlags::NEWNET
        } else {
            UnshareFlags::NEWUSER | UnshareFlags::NEWNET
        };
        let enter = move || {
            // SAFETY: only new user and network namespaces are asked for (no CLONE_FILES or
            // CLONE_FS unsharing, which could invalidate fds or paths other code holds).
            unsafe { rustix::thread::unshare_unsafe(flags) }.map_err(std::io::Error::from)
        };
        // SAFETY: between fork and exec the closure makes one system call, `unshare`, which is
        // async-signal-safe, and allocates nothing.
        unsafe {
            cmd.pre_exec(enter);
        }
    }
    match cmd.spawn() {
        Ok(child) => Some(Exporter { child, control: mine }),
        Err(e) => {
            println!("skipped: this machine does not let this process make a network namespace: {e}");
            None
        }
    }
}

/// A copy of fd `fd` of process `pid` (`pidfd_getfd`).
fn take_fd(pid: u32, fd: u32) -> OwnedFd {
    let p = rustix::process::pidfd_open(Pid::from_raw(pid as i32).unwrap(), PidfdFlags::empty()).unwrap();
    rustix::process::pidfd_getfd(&p, fd as i32, PidfdGetfdFlags::empty()).unwrap()
}

/// Sends one packet of `bytes` with `fds` through `door`.
fn knock(door: BorrowedFd<'_>, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> rustix::io::Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(8))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    }
    rustix::net::sendmsg(door, &[IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL).map(|_| ())
}

fn seqpacket_pair() -> (OwnedFd, OwnedFd) {
    rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).unwrap()
}

/// Whether `fd` becomes readable or hung up within `limit` (bounded polls, no sleeps).
fn readable_within(fd: BorrowedFd<'_>, limit: Duration) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let start = Instant::now();
    while start.elapsed() < limit {
        let mut p = [PollFd::new(&fd, PollFlags::IN)];
        let t = Timespec { tv_sec: 0, tv_nsec: 50_000_000 };
        if rustix::event::poll(&mut p, Some(&t)).unwrap_or(0) > 0 {
            return true;
        }
    }
    false
}

/// Whether the peer of seqpacket or stream socket `fd` hangs up within `limit`.
fn hung_up_within(fd: BorrowedFd<'_>, limit: Duration) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let start = Instant::now();
    while start.elapsed() < limit {
        let mut p = [PollFd::new(&fd, PollFlags::RDHUP)];
        let t = Timespec { tv_sec: 0, tv_nsec: 50_000_000 };
        if rustix::event::poll(&mut p, Some(&t)).unwrap_or(0) > 0
            && p[0].revents().intersects(PollFlags::HUP | PollFlags::RDHUP)
        {
            return true;
        }
    }
    false
}

/// What `/proc/<pid>/fd/<fd>` links to ("socket:[123]", "pipe:[45]", a path).
fn link(pid: u32, fd: i32) -> String {
    std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).map(|p| p.display().to_string()).unwrap_or_default()
}

/// What every fd of process `pid` links to.
fn links(pid: u32) -> Vec<String> {
    let mut all = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).into_iter().flatten().flatten() {
        all.push(std::fs::read_link(e.path()).map(|p| p.display().to_string()).unwrap_or_default());
    }
    all
}

fn me() -> u32 {
    std::process::id()
}

/// The CPU time process `pid`'s IPC accept thread has used (utime + stime). Looked for again
/// for a bounded time if the thread is not listed (CI once saw no such thread, once only, on a
/// loaded machine); the failure names the threads seen.
fn accept_thread_cpu(pid: u32) -> Duration {
    let start = Instant::now();
    loop {
        match accept_thread_cpu_now(pid) {
            Ok(cpu) => return cpu,
            Err(seen) if start.elapsed() > Duration::from_secs(10) => {
                panic!("process {pid} has no IPC accept thread (its threads: {seen:?})")
            }
            // A bounded poll for the thread to be listed, not an ordering sleep.
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// [`accept_thread_cpu`] once: the CPU time, or the names of the threads seen.
fn accept_thread_cpu_now(pid: u32) -> Result<Duration, Vec<String>> {
    let hz = rustix::param::clock_ticks_per_second().max(1);
    let mut seen = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        if comm.trim_end() == "dmabuf-rt-ipc-a" {
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
            let f: Vec<u64> = stat
                .rsplit(')')
                .next()
                .unwrap()
                .split_whitespace()
                .skip(11)
                .take(2)
                .map(|x| x.parse().unwrap())
                .collect();
            return Ok(Duration::from_millis((f[0] + f[1]) * 1000 / hz));
        }
        seen.push(comm.trim_end().to_string());
    }
    Err(seen)
}

/// How much CPU process `pid`'s accept thread burns during a `window` of wall time. (A bounded
/// observation window, not an ordering: an idle accept thread, blocked in `poll`, burns none.)
fn accept_thread_burns(pid: u32, window: Duration) -> Duration {
    let before = accept_thread_cpu(pid);
    let start = Instant::now();
    let (_tx, rx) = std::sync::mpsc::channel::<()>();
    while start.elapsed() < window {
        let _ = rx.recv_timeout(window.saturating_sub(start.elapsed()));
    }
    accept_thread_cpu(pid).saturating_sub(before)
}

/// Checks every opened block holds the pattern of its handle's export number.
fn check_bytes(b: &dmabuf_rt::ipc::ImportedBlock, h: &IpcHandle) {
    let mut v = vec![0u8; b.len()];
    b.read(0, &mut v).unwrap();
    assert!(v == pattern(b.len(), h.export as u8), "export {}: wrong bytes", h.export);
}

/// A token no IPC socket has (tokens are random and nonzero; this one differs from every
/// other this file makes).
fn unused_token() -> u64 {
    static N: AtomicUsize = AtomicUsize::new(1);
    0x6b6e_6f63_6b00_0000 | (me() as u64) << 8 | N.fetch_add(1, Ordering::Relaxed) as u64
}

// ---------------------------------------------------------------------------------------------
// What held up.

/// Garbage knocks through the door of an exporter in another network namespace: a short and a
/// long packet, no fd, two fds, five fds (more than a knock's control buffer holds), a pipe, a
/// memfd, a listening socket, a stream socket, a datagram socket, an unconnected seqpacket
/// socket, a socket whose peer is closed, an empty packet, the wrong token. Each is refused: every
/// socket end sent is closed (its peer here hangs up) and none of the fds stays in the exporter;
/// the door still serves a real open afterwards.
#[test]
fn garbage_knocks_are_refused_their_fds_closed_and_the_door_keeps_serving() {
    let _serial = common::serial();
    let Some(c) = exporter(true) else { return };
    let h = c.handles(1)[0];
    let door = take_fd(c.pid(), h.door);
    let token = h.token.to_le_bytes();
    let mut watched: Vec<(&str, OwnedFd)> = Vec::new();
    let mut sent: Vec<(&str, String)> = Vec::new();
    let mut keep: Vec<OwnedFd> = Vec::new();
    let d = door.as_fd();

    let (m, t) = seqpacket_pair();
    knock(d, &token[..7], &[t.as_fd()]).unwrap();
    sent.push(("7 bytes", link(me(), t.as_raw_fd())));
    watched.push(("7 bytes", m));
    drop(t);
    let (m, t) = seqpacket_pair();
    knock(d, &[&token[..], &[0]].concat(), &[t.as_fd()]).unwrap();
    sent.push(("9 bytes", link(me(), t.as_raw_fd())));
    watched.push(("9 bytes", m));
    drop(t);
    knock(d, &token, &[]).unwrap();
    let ((m1, t1), (m2, t2)) = (seqpacket_pair(), seqpacket_pair());
    knock(d, &token, &[t1.as_fd(), t2.as_fd()]).unwrap();
    sent.push(("2 fds", link(me(), t1.as_raw_fd())));
    watched.push(("2 fds (1st)", m1));
    watched.push(("2 fds (2nd)", m2));
    drop((t1, t2));
    let five: Vec<_> = (0..5).map(|_| seqpacket_pair()).collect();
    knock(d, &token, &five.iter().map(|(_, t)| t.as_fd()).collect::<Vec<_>>()).unwrap();
    for (m, t) in five {
        sent.push(("5 fds", link(me(), t.as_raw_fd())));
        watched.push(("5 fds", m));
    }
    let (r, w) = rustix::pipe::pipe().unwrap();
    knock(d, &token, &[r.as_fd()]).unwrap();
    sent.push(("a pipe", link(me(), r.as_raw_fd())));
    keep.push(w);
    let memfd = rustix::fs::memfd_create("hostile-door-knock", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    knock(d, &token, &[memfd.as_fd()]).unwrap();
    sent.push(("a memfd", "/memfd:hostile-door-knock".into()));
    let listener =
        rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).unwrap();
    let name = format!("hostile-door-listener/{}", me());
    rustix::net::bind(&listener, &SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap()).unwrap();
    rustix::net::listen(&listener, 4).unwrap();
    knock(d, &token, &[listener.as_fd()]).unwrap();
    sent.push(("a listening socket", link(me(), listener.as_raw_fd())));
    let (m, t) = rustix::net::socketpair(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC, None).unwrap();
    knock(d, &token, &[t.as_fd()]).unwrap();
    sent.push(("a stream socket", link(me(), t.as_raw_fd())));
    watched.push(("a stream socket", m));
    drop(t);
    let (m, t) = rustix::net::socketpair(AddressFamily::UNIX, SocketType::DGRAM, SocketFlags::CLOEXEC, None).unwrap();
    knock(d, &token, &[t.as_fd()]).unwrap();
    sent.push(("a datagram socket", link(me(), t.as_raw_fd())));
    keep.push(m);
    drop(t);
    let lone =
        rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).unwrap();
    knock(d, &token, &[lone.as_fd()]).unwrap();
    sent.push(("an unconnected socket", link(me(), lone.as_raw_fd())));
    let (m, t) = seqpacket_pair();
    drop(m);
    knock(d, &token, &[t.as_fd()]).unwrap(); // served, and let go once seen hung up
    drop(t);
    knock(d, &[], &[]).unwrap();
    let (m, t) = seqpacket_pair();
    knock(d, &(!h.token).to_le_bytes(), &[t.as_fd()]).unwrap();
    sent.push(("the wrong token", link(me(), t.as_raw_fd())));
    watched.push(("the wrong token", m));
    drop(t);
    drop((listener, lone, memfd, r));

    // Knocks are answered in order: an open through the door after them is served after them.
    let got = within("an open through the door after garbage knocks", *WAIT, move || open_handle(&h).map(|b| (b, h)));
    let (b, h) = got.unwrap_or_else(|e| panic!("the door stopped serving after garbage knocks: {e}"));
    check_bytes(&b, &h);
    for (what, m) in &watched {
        assert!(hung_up_within(m.as_fd(), *WAIT), "a knock with {what}: the exporter kept the socket sent");
    }
    let theirs = links(c.pid());
    for (what, l) in &sent {
        assert!(!theirs.iter().any(|t| t.starts_with(l.as_str())), "a knock with {what}: the exporter keeps {l}");
    }
    drop(b);
    wait_until("the exporter's limbo empties", *WAIT, || c.ask(LIMBO) == 0);
}

/// Many threads knock garbage at once while others open handles through the door, each handle
/// from two threads: every handle opens exactly once, with its bytes, and everything is released.
#[test]
fn a_flood_of_knocks_and_opens_from_many_threads_hands_each_block_out_once() {
    let _serial = common::serial();
    let Some(c) = exporter(true) else { return };
    let hs = c.handles(8);
    let pid = c.pid();
    let opened = within("a flood of knocks and opens", 3 * *WAIT, move || {
        std::thread::scope(|s| {
            for k in 0..6u64 {
                let door = take_fd(pid, hs[0].door);
                let token = hs[0].token;
                s.spawn(move || {
                    for i in 0..40u64 {
                        let (m, t) = seqpacket_pair();
                        let (m2, t2) = seqpacket_pair();
                        let r = match (i + k) % 4 {
                            0 => knock(door.as_fd(), &(token ^ 1).to_le_bytes(), &[t.as_fd()]),
                            1 => knock(door.as_fd(), &token.to_le_bytes(), &[]),
                            2 => knock(door.as_fd(), &token.to_le_bytes(), &[t.as_fd(), t2.as_fd()]),
                            _ => knock(door.as_fd(), &token.to_le_bytes()[..4], &[t.as_fd()]),
                        };
                        r.unwrap();
                        drop((m, m2));
                    }
                });
            }
            let all: Vec<_> = (0..16usize)
                .map(|i| {
                    let h = hs[i % 8];
                    s.spawn(move || open_handle(&h).map(|b| (b, h)))
                })
                .collect();
            all.into_iter().map(|t| t.join().unwrap()).collect::<Vec<_>>()
        })
    });
    let mut per_export = std::collections::HashMap::<u64, usize>::new();
    let mut blocks = Vec::new();
    for r in opened {
        match r {
            Ok((b, h)) => {
                check_bytes(&b, &h);
                *per_export.entry(h.export).or_default() += 1;
                blocks.push(b);
            }
            Err(e) => {
                assert!(e.to_string().contains("already opened") || e.to_string().contains("holds no block"), "{e}")
            }
        }
    }
    assert_eq!(per_export.len(), 8, "some handle never opened: {per_export:?}");
    assert!(per_export.values().all(|&n| n == 1), "a block handed out twice: {per_export:?}");
    drop(blocks);
    wait_until("the exporter's limbo empties", *WAIT, || c.ask(LIMBO) == 0);
}

/// Importers that die right after knocking (their end closed as the knock lands): the exporter
/// serves each, sees it gone, and does not pile them up.
#[test]
fn importers_dead_right_after_knocking_do_not_pile_up_in_the_exporter() {
    let _serial = common::serial();
    let Some(c) = exporter(true) else { return };
    let hs = c.handles(2);
    let door = take_fd(c.pid(), hs[0].door);
    let h0 = hs[0];
    let first = within("an open through the door", *WAIT, move || open_handle(&h0).map(|b| b.len()));
    first.unwrap();
    let before = open_count(c.pid());
    for _ in 0..200 {
        let (m, t) = seqpacket_pair();
        knock(door.as_fd(), &hs[0].token.to_le_bytes(), &[t.as_fd()]).unwrap();
        drop((m, t));
    }
    // One more, live, knock: served after the 200 (in order); then the dead ones are let go.
    let (m, t) = seqpacket_pair();
    knock(door.as_fd(), &hs[0].token.to_le_bytes(), &[t.as_fd()]).unwrap();
    drop(t);
    let (m2, t2) = seqpacket_pair();
    knock(door.as_fd(), &hs[0].token.to_le_bytes(), &[t2.as_fd()]).unwrap();
    drop(t2);
    // The two live ones, and perhaps the last few dead ones (let go at the next connection).
    wait_until("the dead knockers are let go", *WAIT, || open_count(c.pid()) <= before + 10);
    drop((m, m2));
}

/// The exporter out of fds while knocks arrive: an open through the door fails promptly (the
/// knock's fd cannot be received), the accept thread does not spin, and once fds are back the
/// same handle and another open.
#[test]
fn an_exporter_out_of_fds_refuses_knocks_promptly_without_spinning_and_recovers() {
    let _serial = common::serial();
    let Some(c) = exporter(true) else { return };
    let hs = c.handles(2);
    assert!(c.ask(EXHAUST) > 0);
    let h0 = hs[0];
    let r = within("an open through the door of an exporter out of fds", *WAIT + *WAIT / 2, move || {
        open_handle(&h0).map(|b| b.len())
    });
    let burnt = accept_thread_burns(c.pid(), Duration::from_secs(2));
    assert!(burnt < Duration::from_millis(500), "the accept thread spins out of fds: {burnt:?} of CPU in 2 s");
    // A second knock while still out of fds: the same.
    let mut door_knocks = Vec::new();
    let door = take_fd(c.pid(), h0.door);
    for _ in 0..20 {
        let (m, t) = seqpacket_pair();
        knock(door.as_fd(), &h0.token.to_le_bytes(), &[t.as_fd()]).unwrap();
        door_knocks.push(m);
    }
    for m in &door_knocks {
        assert!(hung_up_within(m.as_fd(), *WAIT), "a knock at an exporter out of fds was neither served nor refused");
    }
    assert_eq!(c.ask(RELIEVE), 0);
    // The handle whose open failed was not taken: it opens now, as the other does.
    let want: Vec<IpcHandle> = hs.iter().copied().filter(|h| r.is_err() || h.export != h0.export).collect();
    let got = within("opens after the exporter has fds again", *WAIT, move || {
        want.iter().map(|h| open_handle(h).map(|b| (b, *h))).collect::<Vec<_>>()
    });
    for g in got {
        let (b, h) = g.unwrap_or_else(|e| panic!("the door does not serve once the exporter has fds again: {e}"));
        check_bytes(&b, &h);
    }
}

/// A thread of another user (this process is root; the thread alone drops to nobody) that has
/// the door knocks with the right token and a socket pair of its own: refused (its socket is
/// closed), as the IPC socket refuses it.
#[test]
fn a_knock_of_another_user_is_refused() {
    let _serial = common::serial();
    if !rustix::process::geteuid().is_root() {
        println!("skipped: needs root to act as another user");
        return;
    }
    let a = common::allocator("", 64 * MB);
    let x = a.allocate(64 * KB, None).unwrap();
    let h = get_handle(&x, None).unwrap();
    let door = take_fd(me(), h.door);
    let served = common::unprivileged(move || {
        let (m, t) = seqpacket_pair();
        knock(door.as_fd(), &h.token.to_le_bytes(), &[t.as_fd()]).unwrap();
        drop(t);
        !hung_up_within(m.as_fd(), *WAIT)
    });
    assert!(!served, "the door served a socket of user nobody");
    drop(x);
}

// ---------------------------------------------------------------------------------------------
// Bugs.

/// BUG: every importer that knocks holds (for a moment, or as long as it likes) a copy of the
/// exporter's door, and `shutdown(2)` acts on the socket, not on one fd: one
/// `shutdown(door, SHUT_WR)` by any knocker leaves the exporter's `door_in` at end of file for
/// good. `poll` then reports it readable at once, forever; `answer_door` (src/ipc/server.rs:233-234,
/// "no end of file; an empty packet": `Ok(_) => return`) reads the end of file and returns, and
/// `accept_loop` (server.rs:146-158) polls again: the accept thread spins at 100% of a CPU for the
/// rest of the process's life, and every later knock fails with `EPIPE` ("knocking: Broken
/// pipe"): the door is closed to every importer until the exporter restarts.
///
/// Fix: on end of file at `door_in` (`Packet::Eof`), make a new pair and `dup3` its end onto the
/// door's fd number (handles already out stay valid), replace `door_in`, and go on; never
/// `continue` on an end of file without changing what is polled.
#[test]
fn a_knocker_shutting_the_door_down_neither_spins_the_accept_thread_nor_locks_everyone_out() {
    let _serial = common::serial();
    let Some(c) = exporter(true) else { return };
    let h = c.handles(1)[0];
    let door = take_fd(c.pid(), h.door);
    rustix::net::shutdown(&door, rustix::net::Shutdown::Write).unwrap();
    drop(door);
    let burnt = accept_thread_burns(c.pid(), Duration::from_secs(2));
    let r = within("an open through the door after a knocker shut it down", *WAIT + *WAIT / 2, move || {
        open_handle(&h).map(|b| b.len())
    });
    assert!(
        burnt < Duration::from_millis(500) && r.is_ok(),
        "after one knocker's shutdown(SHUT_WR) of the door: the accept thread burnt {burnt:?} of CPU in 2 s, and an \
         open through the door gave {r:?}"
    );
}

/// BUG: a knock is served if its socket is a connected seqpacket socket whose peer has this
/// process's uid (src/ipc/server.rs:249-256), which is also true of sockets whose other end the
/// exporter itself holds: the door itself (sent through the door), or a socket connected to the
/// exporter's own IPC socket. Each is served as a connection whose peer never hangs up (the
/// exporter holds both ends): an fd and a reader thread (`IpcExporter`) per knock, forever, which
/// any knocker can repeat to exhaust the exporter's fds and threads. Worse, the reader thread
/// serving the door reads what is sent on `door_in`, and on anything it does not understand
/// `shutdown(SHUT_RDWR)`s its channel, the door, with the consequences of the test above.
/// ("Anything else is refused and its fds closed", says `answer_door`'s doc.)
///
/// Fix: refuse a knocked socket whose peer's credentials name this process
/// (`socket_peercred(fd).pid == getpid()`: its other end is held here), and in particular one that
/// is the door (compare with `fstat`'s inode, or `kcmp`).
#[test]
fn sockets_whose_other_end_the_exporter_holds_are_not_served_through_its_door() {
    let _serial = common::serial();
    let a = common::allocator("", 64 * MB);
    let x = a.allocate(64 * KB, None).unwrap();
    let h = get_handle(&x, None).unwrap();
    let door = take_fd(me(), h.door);
    let door_link = link(me(), door.as_raw_fd());
    let client =
        rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).unwrap();
    let name = format!("dmabuf-rt-ipc/{}/{:016x}", me(), h.token);
    rustix::net::connect(&client, &SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap()).unwrap();
    let client_link = link(me(), client.as_raw_fd());
    knock(door.as_fd(), &h.token.to_le_bytes(), &[door.as_fd()]).unwrap();
    knock(door.as_fd(), &h.token.to_le_bytes(), &[client.as_fd()]).unwrap();
    // A refused knock after them: once it is refused (its socket closed), they were answered.
    let (m, t) = seqpacket_pair();
    knock(door.as_fd(), &(!h.token).to_le_bytes(), &[t.as_fd()]).unwrap();
    drop(t);
    assert!(hung_up_within(m.as_fd(), *WAIT), "a knock with the wrong token was not refused");
    drop((door, client));
    let count = |l: &str| links(me()).iter().filter(|x| *x == l).count();
    let (doors, clients) = (count(&door_link), count(&client_link));
    assert!(
        doors == 1 && clients == 0,
        "served as connections and kept: the door, sent through itself ({} copies of it in the exporter, 1 \
         expected), and a socket connected to the exporter's own IPC socket ({clients} kept, 0 expected)",
        doors
    );
    drop(x);
}

/// A process that is not an exporter (a stand-in for the process that got a dead exporter's pid)
/// with a seqpacket socket at fd 1, and this process's end of it.
fn victim() -> (Child, OwnedFd) {
    let (theirs, mine) = seqpacket_pair();
    let child = Command::new("cat")
        .stdin(Stdio::piped())
        .stdout(Stdio::from(theirs))
        .spawn()
        .unwrap_or_else(|e| panic!("cat: {e}"));
    (child, mine)
}

/// BUG: `client` (src/ipc/server.rs:353-356) goes through the door after *any* failure to
/// connect to the exporter's IPC socket, also in the exporter's own network namespace, where
/// `ECONNREFUSED` means the exporter is gone: a stale handle (its exporter exited, its pid now
/// another process of the same user) makes `through_door` (server.rs:371-417) take that process's
/// fd of the door's number and, if it is a seqpacket socket, send it the handle's token and a
/// socket: a packet injected into an unrelated process's connection (here a `cat` whose stdout is
/// a seqpacket socket), and an open that waits out `OPEN_TIMEOUT` instead of failing at once.
/// Nothing checks that the fd taken is a door, let alone this exporter's.
///
/// Fix: go through the door only when the exporter is in another network namespace (compare
/// `/proc/<pid>/ns/net` with this process's); otherwise `PeerGone`. And make the door prove it
/// is this exporter's before knocking: the exporter binds `door_in` to an abstract name made of
/// its pid and token (`dmabuf-rt-ipc-door/<pid>/<token>`; a socket pair's end may be bound), and
/// the importer knocks only if `getpeername` of the fd it took is that name.
#[test]
fn a_stale_handle_whose_pid_is_another_process_sends_that_process_nothing() {
    let _serial = common::serial();
    let (mut cat, mine) = victim();
    let stale =
        IpcHandle { pid: cat.id(), door: 1, export: 1, segment: 1, offset: 0, len: 4096, token: unused_token() };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(open_handle(&stale).map(|b| b.len())));
    let deadline = Instant::now() + *WAIT + *WAIT / 2;
    let mut knocked = None;
    let r = loop {
        if let Ok(r) = rx.try_recv() {
            break r;
        }
        assert!(Instant::now() < deadline, "hang: the open of a stale handle");
        if knocked.is_none() && readable_within(mine.as_fd(), Duration::from_millis(20)) {
            let mut buf = [0u8; 64];
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(8))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let msg = rustix::net::recvmsg(
                &mine,
                &mut [std::io::IoSliceMut::new(&mut buf)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            )
            .unwrap();
            let mut fds = 0;
            for m in control.drain() {
                if let rustix::net::RecvAncillaryMessage::ScmRights(got) = m {
                    fds += got.count();
                }
            }
            // Its socket closed here: the open sees the hang-up and ends.
            knocked = Some((msg.bytes, fds));
        }
    };
    let _ = cat.kill();
    let _ = cat.wait();
    assert!(
        knocked.is_none() && matches!(r, Err(Error::PeerGone { .. })),
        "the open of a stale handle naming process {} (a cat, not an exporter) sent it a packet of {:?} (bytes, fds) \
         at its fd 1, and gave {r:?}",
        stale.pid,
        knocked
    );
}

/// BUG (the same cause as above, src/ipc/server.rs:353-356 and 387-399): a stale handle whose pid
/// is now a process this one may not `pidfd_getfd` (another user's, here a root process opened
/// from a thread of user nobody) fails with `Error::NotPermitted` ("another network namespace?",
/// "CAP_SYS_PTRACE", `ErrorKind::PermissionDenied`) although both are in the same network namespace
/// and the exporter is simply gone: the caller is told to grant ptrace rights instead of that
/// the handle is dead (`PeerGone`, as before the door).
///
/// Fix: as above: in the same network namespace, a refused connection is `PeerGone`.
#[test]
fn a_stale_handle_in_the_same_network_namespace_is_peer_gone_not_not_permitted() {
    let _serial = common::serial();
    if !rustix::process::geteuid().is_root() {
        println!("skipped: needs root to act as another user");
        return;
    }
    let (mut cat, _mine) = victim();
    let stale =
        IpcHandle { pid: cat.id(), door: 1, export: 1, segment: 1, offset: 0, len: 4096, token: unused_token() };
    let r = common::unprivileged(move || {
        within("the open of a stale handle", *WAIT + *WAIT / 2, move || open_handle(&stale).map(|b| b.len()))
    });
    let _ = cat.kill();
    let _ = cat.wait();
    let e = r.unwrap_err();
    assert!(
        matches!(e, Error::PeerGone { .. }) && e.kind() != ErrorKind::PermissionDenied,
        "a stale handle in this network namespace: {e}"
    );
}

/// BUG (the same cause, src/ipc/server.rs:335 and 353-356): in the exporter's own network namespace,
/// when its IPC socket's listen queue is full (the exporter stopped, or slow to accept a burst of
/// connections), `connect_abstract` waits `OPEN_TIMEOUT` (30 s) and fails with `EAGAIN`; before
/// the door the open then failed, after 30 s. Now it goes on through the door (the exporter's
/// door still takes the knock), and the request waits `OPEN_TIMEOUT` again: the open takes 60 s
/// (90 s if the door's queue is full too), twice the bound `OPEN_TIMEOUT` documents.
///
/// Fix: as above (no door in the same network namespace), and give `through_door` and the
/// request only what is left of one `OPEN_TIMEOUT` deadline taken at the start of `open_handle`.
#[test]
fn an_open_never_takes_much_longer_than_open_timeout() {
    let _serial = common::serial();
    if common::time_scale() > 1 {
        // It waits out OPEN_TIMEOUT (30 s) whatever the machine's speed; the host runs it.
        println!("skipped on a slowed machine (DMABUF_RT_STRESS_TIME_SCALE > 1): it waits OPEN_TIMEOUT");
        return;
    }
    let Some(c) = exporter(false) else { return };
    let h = c.handles(1)[0];
    c.signal(Signal::STOP);
    // Fill the stopped exporter's listen queue.
    let name = format!("dmabuf-rt-ipc/{}/{:016x}", c.pid(), h.token);
    let addr = SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap();
    let mut queued = Vec::new();
    loop {
        let s = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )
        .unwrap();
        match rustix::net::connect(&s, &addr) {
            Ok(()) => queued.push(s),
            Err(rustix::io::Errno::AGAIN) => break,
            Err(e) => panic!("connect: {e}"),
        }
        assert!(queued.len() < 10_000, "the listen queue never filled");
    }
    let start = Instant::now();
    let limit = OPEN_TIMEOUT + Duration::from_secs(8);
    let r = within("an open of a handle of a stopped exporter", limit, move || open_handle(&h).map(|b| b.len()));
    assert!(r.is_err(), "opened a block of a stopped process");
    assert!(start.elapsed() < limit);
    drop(queued);
}
