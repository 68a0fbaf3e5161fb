//! The 22nd hostile review: the exporter-pidfd fence watch, the accept loop and the free
//! list's in-place reversal. It found one bug, fixed: the pidfd was opened when the share was
//! read, so a producer that had exited (and been reaped) by then was not watched and the fence
//! waited as long as its forked child lived; the importer now takes the pidfd when it is made,
//! and a producer known gone fails the fences it did not signal. Its two cases of that (the
//! share read after the exit, signalled or not) are `When::ReadAfter` of
//! `tests/ipc.rs::a_fence_fails_when_its_producer_exits_even_if_a_forked_child_keeps_it_open`. Child-process cases re-execute this binary (`producer_entry`, with
//! `HR22_ROLE` set) with a control channel as stdin; the producer makes the IPC pair, so the
//! importer's `SO_PEERCRED` names it.

mod common;

use common::control::{Ctl, cmd_of, ctl};
use common::{open_fds, serial};

use std::os::fd::AsFd;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dmabuf_rt::Error;
use dmabuf_rt::ipc::{IpcExporter, IpcHandle, IpcImporter};
use dmabuf_rt::queue::Queue;
use dmabuf_rt::share::Channel;

const ROLE_ENV: &str = "HR22_ROLE";
const KB: usize = 1 << 10;
const MB: usize = 1 << 20;

/// Role `hold-N`: export N fenced blocks, then wait to be told to exit.
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
    let _gate = common::QueueGate::close(&q);
    let exp = IpcExporter::new(mine).unwrap();
    let n: usize = role.strip_prefix("hold-").expect("a hold-N role").parse().unwrap();
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
    // Its fds (producer, channels, fence, pidfd) must not be counted by the test above.
    let _serial = serial();
    let (mut producer, control, imp) = spawn("hold-1");
    let h = cmd_of(&control.recv::<Ctl>().unwrap().msg).1.unwrap();
    let b = imp.open(&h).unwrap();
    assert!(!b.is_ready());
    producer.kill().unwrap();
    producer.wait().unwrap();
    let e = b.wait_ready(Some(Duration::from_secs(3))).expect_err("killed before signalling");
    assert!(!matches!(e, Error::Timeout { .. }), "{e}");
}
