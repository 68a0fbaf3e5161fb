//! The 22nd hostile review: the exporter-pidfd fence watch, the accept loop and the free
//! list's in-place reversal. It found one bug, fixed: the pidfd was opened when the share was
//! read, so a producer that had exited (and been reaped) by then was not watched and the fence
//! waited as long as its forked child lived; the importer now takes the pidfd when it is made,
//! and a producer known gone fails the fences it did not signal. Child-process cases re-execute this binary (`producer_entry`, with
//! `HR22_ROLE` set) with a control channel as stdin; the producer makes the IPC pair, so the
//! importer's `SO_PEERCRED` names it.

#![allow(unsafe_code)] // fork(2) in the producer, and its child's alarm and pause

mod common;

use common::{open_fds, serial};

use std::os::fd::AsFd;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dmabuf_rt::Error;
use dmabuf_rt::ipc::{HANDLE_BYTES, IpcExporter, IpcHandle, IpcImporter};
use dmabuf_rt::queue::Queue;
use dmabuf_rt::share::Channel;

const ROLE_ENV: &str = "HR22_ROLE";
const KB: usize = 1 << 10;
const MB: usize = 1 << 20;

type Ctl = [u8; HANDLE_BYTES + 8];

fn ctl(cmd: u64, h: Option<&IpcHandle>) -> Ctl {
    let mut m = [0u8; HANDLE_BYTES + 8];
    m[..8].copy_from_slice(&cmd.to_le_bytes());
    if let Some(h) = h {
        m[8..].copy_from_slice(&h.to_bytes());
    }
    m
}

fn cmd_of(m: &Ctl) -> (u64, Option<IpcHandle>) {
    (u64::from_le_bytes(m[..8].try_into().unwrap()), IpcHandle::from_bytes(&m[8..]).ok())
}

/// Roles: `fork-exit` (export one fenced block, fork a child that keeps every fd, exit at once
/// with the fence unsignalled, or, `fork-exit-signalled`, after signalling it) and `hold-N`
/// (export N fenced blocks, then wait to be told to exit).
#[test]
fn producer_entry() {
    let Ok(role) = std::env::var(ROLE_ENV) else { return };
    let fd = std::io::stdin().as_fd().try_clone_to_owned().unwrap();
    let control = Channel::from_fd(fd, "hr22 control").unwrap();
    let (mine, theirs) = Channel::pair("hr22 ipc").unwrap();
    control.send_with_fd(&[0u8; 1], theirs.as_fd()).unwrap();
    drop(theirs);
    let a = common::allocator("", 64 * MB as u64);
    let q = Queue::new().unwrap();
    let gate = common::QueueGate::close(&q);
    let exp = IpcExporter::new(mine).unwrap();
    if let Some(n) = role.strip_prefix("hold-") {
        let n: usize = n.parse().unwrap();
        let mut keep = Vec::new();
        for _ in 0..n {
            let x = a.allocate(64 * KB, Some(&q)).unwrap();
            let h = exp.export(&x, Some(&q)).unwrap();
            control.send(&ctl(0, Some(&h))).unwrap();
            keep.push(x);
        }
        // Until told (or the test's end of the control channel closes).
        let _ = control.recv::<[u8; 1]>();
        std::process::exit(0);
    }
    let x = a.allocate(64 * KB, Some(&q)).unwrap();
    let h = exp.export(&x, Some(&q)).unwrap();
    if role == "fork-exit-signalled" {
        drop(gate);
        q.synchronize().unwrap();
    } else {
        std::mem::forget(gate);
    }
    // SAFETY: the child calls only async-signal-safe functions (alarm, pause), never returns.
    let child = unsafe { libc::fork() };
    if child == 0 {
        // SAFETY: async-signal-safe calls in the forked child.
        unsafe { libc::alarm(20) };
        loop {
            // SAFETY: as above.
            unsafe { libc::pause() };
        }
    }
    assert!(child > 0, "fork failed");
    control.send(&ctl(child as u64, Some(&h))).unwrap();
    std::process::exit(0);
}

fn spawn(role: &str) -> (Child, Channel, IpcImporter) {
    let (control, theirs) = Channel::pair("hr22 control").unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["producer_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, role)
        .stdin(Stdio::from(theirs.into_fd()))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let ipc = control.recv::<[u8; 1]>().unwrap().fd.expect("the IPC channel's end");
    let imp = IpcImporter::new(Channel::from_fd(ipc, "hr22 consumer ipc").unwrap());
    (child, control, imp)
}

fn kill(pid: u64) {
    if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
    }
}

/// The producer exported a fenced block, forked a child (which keeps the fence's other end and
/// the channel open) and exited without signalling; the importer opens the block only after the
/// producer was reaped (opens are lazy: the SHARE is read at the first `open`). The fence must
/// still fail soon, not wait as long as the forked child lives.
#[test]
fn fence_fails_when_producer_exited_before_the_share_was_read() {
    let (mut producer, control, imp) = spawn("fork-exit");
    let (grandchild, h) = cmd_of(&control.recv::<Ctl>().unwrap().msg);
    assert!(producer.wait().unwrap().success());
    let r = (|| {
        let b = imp.open(&h.unwrap())?;
        b.wait_ready(Some(Duration::from_secs(3)))
    })();
    kill(grandchild);
    let e = r.expect_err("a fence whose producer exited without signalling cannot be ready");
    assert!(
        !matches!(e, Error::Timeout { .. }),
        "still waiting on a fence whose producer exited (before the importer read the share) while its forked \
         child lives: {e}"
    );
}

/// Passing check: signalled, then the producer exits (and is reaped) before the importer reads
/// the share: ready.
#[test]
fn fence_signalled_before_exit_is_ready_when_read_late() {
    let (mut producer, control, imp) = spawn("fork-exit-signalled");
    let (grandchild, h) = cmd_of(&control.recv::<Ctl>().unwrap().msg);
    assert!(producer.wait().unwrap().success());
    let r = (|| {
        let b = imp.open(&h.unwrap())?;
        b.wait_ready(Some(Duration::from_secs(3)))
    })();
    kill(grandchild);
    r.expect("a fence signalled before its producer exited is ready");
}

/// Blocks opened with a pending fence (watched with a pidfd of the live producer) and dropped:
/// the watcher's orphan sweep closes the fence, the pidfd and the ring's copies of both.
#[test]
fn dropped_blocks_with_pending_fence_and_pidfd_close_their_fds() {
    let _serial = serial();
    const N: usize = 8;
    let (mut producer, control, imp) = spawn(&format!("hold-{}", N + 1));
    let hs: Vec<IpcHandle> = (0..=N).map(|_| cmd_of(&control.recv::<Ctl>().unwrap().msg).1.unwrap()).collect();
    let wait_for = |done: &dyn Fn(usize) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let n = open_fds();
            if done(n) || Instant::now() > deadline {
                return n;
            }
            std::thread::yield_now();
        }
    };
    let base = open_fds();
    let blocks: Vec<_> = hs.iter().map(|h| imp.open(h).unwrap()).collect();
    assert!(blocks.iter().all(|b| !b.is_ready()));
    // Each pending fence holds its fd and the ring's copy of it, and the ring holds a pidfd of
    // the producer for it (whether the pidfds are there is what the fork cases show).
    let during = wait_for(&|n| n >= base + 2 * (N + 1));
    drop(blocks);
    // The importer keeps the segment's fd and its pidfd of the producer; the fence watcher its
    // eventfd (and the ring's copy) and its io_uring if it started in this test. Nothing of the
    // blocks (three fds each while pending) is left.
    let keep = base + imp.segments() + 1 + 3;
    let after = wait_for(&|n| n <= keep);
    let _ = control.send(&[1u8]);
    let _ = producer.wait();
    assert!(during >= base + 2 * (N + 1), "the fences were not all held: {base} -> {during}");
    assert!(
        after <= keep,
        "fds left after dropping {} blocks with pending fences: {base} -> {after} ({})",
        N + 1,
        common::fd_summary()
    );
}

/// Passing check: a fence whose producer is killed while the block is open fails at once.
#[test]
fn fence_fails_when_live_producer_is_killed() {
    let (mut producer, control, imp) = spawn("hold-1");
    let h = cmd_of(&control.recv::<Ctl>().unwrap().msg).1.unwrap();
    let b = imp.open(&h).unwrap();
    assert!(!b.is_ready());
    producer.kill().unwrap();
    producer.wait().unwrap();
    let e = b.wait_ready(Some(Duration::from_secs(3))).expect_err("killed before signalling");
    assert!(!matches!(e, Error::Timeout { .. }), "{e}");
}
