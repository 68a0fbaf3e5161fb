//! Process-wide IPC handles between processes that cannot reach each other's IPC socket (an
//! abstract Unix socket, which exists only in its own network namespace): the importer comes in
//! through the exporter's door with `pidfd_getfd`, gets the same blocks, fences and limbo as
//! through the socket, releases them when it dies; and where the kernel refuses `pidfd_getfd`
//! (another user namespace) the open fails with `Error::NotPermitted`, saying so, and holds
//! nothing.
//!
//! The other process is this test binary again (`door_child` alone, `IPC_DOOR_ROLE=<role>` in
//! its environment), put in new namespaces before it runs (`unshare` between fork and exec),
//! with a control channel as stdin. Creating a network namespace needs `CAP_SYS_ADMIN` (root),
//! or a user namespace of its own (unprivileged user namespaces): a test whose namespaces the
//! machine does not allow says so and skips; the kernel lane runs as root.

#![allow(unsafe_code)] // unshare(2) between fork and exec (`CommandExt::pre_exec`)

mod common;

use common::control::{Ctl, cmd_of, ctl};
use common::wait::wait_until;
use common::{fill_pattern, pattern};

use std::os::fd::AsFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use dmabuf_rt::ipc::{IpcHandle, get_handle, open_handle, unopened_handles};
use dmabuf_rt::queue::{HostBuffer, Queue};
use dmabuf_rt::share::Channel;
use dmabuf_rt::{Error, ErrorKind};
use rustix::thread::UnshareFlags;

static WAIT: std::sync::LazyLock<Duration> =
    std::sync::LazyLock::new(|| Duration::from_secs(30) * common::time_scale());
const ROLE_ENV: &str = "IPC_DOOR_ROLE";
/// The parent's network namespace (`/proc/self/ns/net`), for the child to check it is elsewhere.
const NETNS_ENV: &str = "IPC_DOOR_PARENT_NETNS";
const KB: usize = 1 << 10;
const MB: usize = 1 << 20;

// Commands of the control channel (answers: 0 ok; otherwise as each says).
/// Importer: open the handle; answers 0, 1 if refused as already opened, 2 if refused as not
/// permitted with a message that says why (printed), 3 for any other error (printed).
const OPEN: u64 = 1;
/// Importer: open the handle from 4 threads at once; answers how many were refused as not
/// permitted with a clear message (the others are printed).
const OPEN_4: u64 = 2;
/// Importer: how many opened blocks do not hold their pattern (each block's pattern is its
/// handle's export number).
const VERIFY: u64 = 3;
/// Exporter: allocate blocks of the sizes 4 KiB, 48 KiB, 5 MiB, fill them, free them at once
/// and send a handle of each (three answers, each carrying a handle).
const MAKE: u64 = 4;
/// Exporter: its allocator's limbo bytes.
const LIMBO: u64 = 5;
const EXIT: u64 = 6;
/// Importer: 1 if every opened block is ready (its fence, if any, signalled), else 0.
const READY: u64 = 7;
/// Importer: open forged variants of the handle from 4 threads at once (a door fd that does
/// not exist there, one that is no socket, the real door with another token); answers how
/// many were refused with the cause (the others are printed).
const FORGED: u64 = 8;

/// Forged variants of `h` (the exporter is in another network namespace, so the door is
/// tried) and what their refusals must say. Each has a token of its own: opens of one token
/// share a connection while it lasts.
fn forged(h: &IpcHandle) -> [(IpcHandle, &'static str); 3] {
    [
        (IpcHandle { door: 1 << 20, token: h.token ^ 1, ..*h }, "has no fd"),
        // The exporter's stderr: a pipe or a file under the test harness.
        (IpcHandle { door: 2, token: h.token ^ 2, ..*h }, "not a SOCK_SEQPACKET"),
        (IpcHandle { token: h.token ^ 3, ..*h }, "not its IPC door with this handle's token"),
    ]
}

fn netns() -> String {
    std::fs::read_link("/proc/self/ns/net").map(|p| p.display().to_string()).unwrap_or_default()
}

/// Whether `e` is the refusal of `pidfd_getfd`, saying what would permit it.
fn clear_refusal(e: &Error) -> bool {
    let s = e.to_string();
    matches!(e, Error::NotPermitted { .. })
        && e.kind() == ErrorKind::PermissionDenied
        && s.contains("pidfd_getfd")
        && s.contains("network namespace")
        && s.contains("ptrace")
}

/// The child's side: an importer or an exporter in namespaces of its own, driven over the
/// control channel on its stdin.
#[test]
fn door_child() {
    let Ok(role) = std::env::var(ROLE_ENV) else { return };
    assert_ne!(netns(), std::env::var(NETNS_ENV).unwrap(), "the child shares its parent's network namespace");
    let fd = std::io::stdin().as_fd().try_clone_to_owned().unwrap();
    let control = Channel::from_fd(fd, "control").unwrap();
    let a = common::allocator("", 64 * MB as u64);
    let mut opened = Vec::new();
    let mut made = Vec::new();
    loop {
        let Ok(m) = control.recv::<Ctl>() else { return };
        let (cmd, h) = cmd_of(&m.msg);
        let answer = match cmd {
            OPEN => match open_handle(&h.unwrap()) {
                Ok(b) => {
                    opened.push((b, h.unwrap().export as u8));
                    0
                }
                Err(Error::InvalidArgument { what }) if what.contains("already opened") => 1,
                Err(e) if clear_refusal(&e) => {
                    eprintln!("refused, as it should be: {e}");
                    2
                }
                Err(e) => {
                    eprintln!("open_handle ({role}): {e}");
                    3
                }
            },
            OPEN_4 => {
                let h = h.unwrap();
                let refused: Vec<bool> = std::thread::scope(|s| {
                    let all: Vec<_> = (0..4)
                        .map(|_| {
                            s.spawn(move || match open_handle(&h) {
                                Err(e) if clear_refusal(&e) => true,
                                other => {
                                    eprintln!("open_handle from 4 threads: {:?}", other.map(|b| b.len()));
                                    false
                                }
                            })
                        })
                        .collect();
                    all.into_iter().map(|t| t.join().unwrap()).collect()
                });
                refused.iter().filter(|&&r| r).count() as u64
            }
            VERIFY => opened
                .iter()
                .filter(|(b, tag)| {
                    let mut v = vec![0u8; b.len()];
                    b.read(0, &mut v).unwrap();
                    v != pattern(b.len(), *tag)
                })
                .count() as u64,
            MAKE => {
                for n in [4 * KB, 48 * KB, 5 * MB] {
                    let x = a.allocate(n, None).unwrap();
                    let h = get_handle(&x, None).unwrap();
                    fill_pattern(&x, h.export as u8);
                    made.push(h);
                    drop(x);
                    control.send(&ctl(0, Some(&h))).unwrap();
                }
                continue;
            }
            LIMBO => a.stats().limbo_bytes.current as u64,
            READY => u64::from(opened.iter().all(|(b, _)| b.is_ready())),
            FORGED => {
                let all = forged(&h.unwrap());
                let all = &all;
                std::thread::scope(|s| {
                    let threads: Vec<_> = (0..4)
                        .map(|t| {
                            s.spawn(move || {
                                all.iter()
                                    .cycle()
                                    .skip(t)
                                    .take(3)
                                    .filter(|(f, want)| match open_handle(f) {
                                        Err(e @ Error::PeerGone { .. }) if e.to_string().contains(want) => true,
                                        other => {
                                            eprintln!("forged door {} token {:x}: {:?}", f.door, f.token, other.err());
                                            false
                                        }
                                    })
                                    .count() as u64
                            })
                        })
                        .collect();
                    threads.into_iter().map(|t| t.join().unwrap()).sum()
                })
            }
            _ => return,
        };
        control.send(&ctl(answer, None)).unwrap();
    }
}

struct Peer {
    child: Child,
    control: Channel,
}

impl Peer {
    fn ask(&self, cmd: u64, h: Option<&IpcHandle>) -> u64 {
        self.control.send(&ctl(cmd, h)).unwrap();
        cmd_of(&self.control.recv::<Ctl>().unwrap().msg).0
    }

    fn handles(&self) -> Vec<IpcHandle> {
        self.control.send(&ctl(MAKE, None)).unwrap();
        (0..3).map(|_| cmd_of(&self.control.recv::<Ctl>().unwrap().msg).1.unwrap()).collect()
    }

    fn exit(mut self) {
        self.control.send(&ctl(EXIT, None)).unwrap();
        assert!(self.child.wait().unwrap().success());
    }
}

/// A child in new namespaces (`flags`), as `role`; `None` (saying why) where the machine does
/// not allow them.
fn peer(role: &str, flags: UnshareFlags) -> Option<Peer> {
    let (mine, theirs) = Channel::pair("control").unwrap();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["door_child", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, role)
        .env(NETNS_ENV, netns())
        .stdin(Stdio::from(theirs.into_fd()))
        .stdout(Stdio::null());
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
    match cmd.spawn() {
        Ok(child) => Some(Peer { child, control: mine }),
        Err(e) => {
            println!("skipped: this machine does not let this process make new namespaces ({flags:?}): {e}");
            None
        }
    }
}

fn limbo(a: &dmabuf_rt::caching::CachingAllocator) -> i64 {
    a.stats().limbo_bytes.current
}

/// An importer in another network namespace (the same user namespace: `CAP_SYS_ADMIN` makes
/// it) opens handles made here through the door: it sees their bytes while the producer, which
/// freed them at once, churns; a second open is refused; a handle made behind queued work is
/// not ready there until that work is done (its fence crossed the door too); killed, it
/// releases them all.
#[test]
fn an_importer_in_another_network_namespace_opens_handles_through_the_door() {
    let _serial = common::serial();
    let Some(mut c) = peer("importer", UnshareFlags::NEWNET) else { return };
    let a = common::allocator("", 64 * MB as u64);
    let xs: Vec<_> = [4 * KB, 48 * KB, 5 * MB].iter().map(|&n| a.allocate(n, None).unwrap()).collect();
    let hs: Vec<_> = xs.iter().map(|x| get_handle(x, None).unwrap()).collect();
    for (x, h) in xs.iter().zip(&hs) {
        assert_ne!(h.door, 0, "a process-wide handle names its door");
        fill_pattern(x, h.export as u8);
    }
    drop(xs);
    let held = limbo(&a);
    assert!(held >= (5 * MB + 52 * KB) as i64);
    for h in &hs {
        assert_eq!(c.ask(OPEN, Some(h)), 0, "open through the door");
    }
    assert_eq!(c.ask(OPEN, Some(&hs[1])), 1, "a handle opened twice");
    assert_eq!(c.ask(FORGED, Some(&hs[0])), 12, "forged doors refused with the cause (the child printed the others)");
    for r in 0..20u8 {
        let ys: Vec<_> = [4 * KB, 48 * KB, 5 * MB].iter().map(|&n| a.allocate(n, None).unwrap()).collect();
        for y in &ys {
            fill_pattern(y, 0x80 | r);
        }
    }
    assert_eq!(c.ask(VERIFY, None), 0, "a block held through the door was reused");
    assert_eq!(limbo(&a), held);
    // Behind queued work, held by a gate: the handle carries it as a fence.
    let q = Queue::new().unwrap();
    let y = a.allocate(8 * MB, Some(&q)).unwrap();
    let src = HostBuffer::new(8 * MB).unwrap();
    let gate = common::QueueGate::close(&q);
    q.copy(y.mem(), &src).unwrap();
    let fenced = get_handle(&y, Some(&q)).unwrap();
    // The copy cannot have run (the gate holds the queue): its source is written now, with the
    // pattern of the handle's number.
    src.write(0, &pattern(8 * MB, fenced.export as u8)).unwrap();
    drop(y);
    assert_eq!(c.ask(OPEN, Some(&fenced)), 0);
    assert_eq!(c.ask(READY, None), 0, "ready through the door while the producer's copy is still queued");
    gate.open();
    assert_eq!(c.ask(VERIFY, None), 0, "the importer read before the queued copy finished");
    assert_eq!(c.ask(READY, None), 1);
    c.child.kill().unwrap();
    c.child.wait().unwrap();
    wait_until("the killed importer's releases", *WAIT, || limbo(&a) == 0);
    a.check_invariants().unwrap();
}

/// An exporter in a user and network namespace of its own (which any user may make where
/// unprivileged user namespaces are allowed): this process, its parent, may take its fds, and
/// opens its handles through the door; they hold their bytes; releasing them here empties the
/// exporter's limbo; the exporter's exit leaves the opened blocks readable.
#[test]
fn an_exporter_in_another_user_and_network_namespace_is_reached_through_its_door() {
    let _serial = common::serial();
    let Some(c) = peer("exporter", UnshareFlags::NEWUSER | UnshareFlags::NEWNET) else { return };
    let hs = c.handles();
    assert!(c.ask(LIMBO, None) >= (5 * MB + 52 * KB) as u64, "freed at once, the shared blocks wait in limbo");
    let got: Vec<_> =
        hs.iter().map(|h| open_handle(h).unwrap_or_else(|e| panic!("open through the door: {e}"))).collect();
    for (b, h) in got.iter().zip(&hs) {
        let mut v = vec![0u8; b.len()];
        b.read(0, &mut v).unwrap();
        assert!(v == pattern(b.len(), h.export as u8), "export {}: wrong bytes", h.export);
    }
    assert!(open_handle(&hs[0]).unwrap_err().to_string().contains("already opened"));
    drop(got);
    wait_until("the exporter's limbo empties once the blocks are released", *WAIT, || c.ask(LIMBO, None) == 0);
    // Opened again and kept past the exporter's exit: still readable, nothing crashes.
    let hs = c.handles();
    let kept = open_handle(&hs[2]).unwrap();
    c.exit();
    let mut v = vec![0u8; kept.len()];
    kept.read(0, &mut v).unwrap();
    assert!(v == pattern(kept.len(), hs[2].export as u8));
}

/// An importer in a user namespace of its own may not take this process's fds: its opens, one
/// and then four at once, fail with `Error::NotPermitted` saying what would permit them, and
/// take nothing: the handle stays unopened here and opens in a process that may.
#[test]
fn an_importer_not_permitted_to_take_the_door_gets_a_clear_error_and_takes_nothing() {
    let _serial = common::serial();
    let Some(c) = peer("importer", UnshareFlags::NEWUSER | UnshareFlags::NEWNET) else { return };
    let a = common::allocator("", 64 * MB as u64);
    let x = a.allocate(100 * KB, None).unwrap();
    let h = get_handle(&x, None).unwrap();
    fill_pattern(&x, h.export as u8);
    drop(x);
    let unopened = unopened_handles();
    assert_eq!(c.ask(OPEN, Some(&h)), 2, "refused with a clear NotPermitted (the child printed what it got)");
    assert_eq!(c.ask(OPEN_4, Some(&h)), 4, "refused from 4 threads at once (the child printed what it got)");
    assert_eq!(unopened_handles(), unopened, "a refused open took the handle");
    let got = open_handle(&h).unwrap();
    let mut v = vec![0u8; got.len()];
    got.read(0, &mut v).unwrap();
    assert!(v == pattern(got.len(), h.export as u8));
    drop(got);
    wait_until("the release", *WAIT, || limbo(&a) == 0);
    c.exit();
}

/// In one process (one network namespace), a handle whose IPC socket does not answer is never
/// taken through its door, whatever door it names: the exporter is gone, or the handle stale
/// or forged (`PeerGone`, saying so), from 4 threads at once; the real handle opens afterwards.
#[test]
fn in_one_network_namespace_the_door_is_never_tried() {
    let _serial = common::serial();
    let a = common::allocator("", 64 * MB as u64);
    let x = a.allocate(64 * KB, None).unwrap();
    let h = get_handle(&x, None).unwrap();
    fill_pattern(&x, h.export as u8);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(move || {
                for (f, _) in forged(&h) {
                    let e = open_handle(&IpcHandle { token: f.token ^ 0x100, ..f }).unwrap_err();
                    assert!(matches!(e, Error::PeerGone { .. }), "{e}");
                    assert!(e.to_string().contains("in this network namespace and does not answer"), "{e}");
                }
            });
        }
    });
    let got = open_handle(&h).unwrap();
    let mut v = vec![0u8; got.len()];
    got.read(0, &mut v).unwrap();
    assert!(v == pattern(got.len(), h.export as u8));
    drop((got, x));
    wait_until("the release", *WAIT, || limbo(&a) == 0);
}
