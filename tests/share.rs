//! `dmabuf_rt::share` between two processes: a pool whose buffers go to a child process and
//! come back with the child's writes in them, a hostile child (bogus and double returns,
//! garbage), and a child that crashes mid-stream. (Threads and socketpairs, and every
//! malformed packet, are in the unit tests, src/share/tests.rs.)
//!
//! The child is this test binary, re-executed with libtest arguments that select
//! `child_entry` alone and `SHARE_TEST_CHILD=<role>` in its environment; its end of the
//! channel is its stdin.

use std::os::fd::AsFd;
use std::process::{Child, Command, Stdio};

use dmabuf_rt::share::{Channel, Expect, Frame, Incoming, Peer, PoolBorrower, PoolMessage, PoolOwner};
use dmabuf_rt::source::ShmemSource;
use dmabuf_rt::{Access, Error, FdKind, Segment, SegmentKind};

const ROLE_ENV: &str = "SHARE_TEST_CHILD";
const POOL: usize = 3;
const SIZE: usize = 64 << 10;

fn word(seg: &Segment, at: usize) -> u64 {
    let mut w = [0u8; 8];
    seg.cpu_access(Access::Read).unwrap().read(at, &mut w).unwrap();
    u64::from_le_bytes(w)
}

fn put(seg: &Segment, at: usize, v: u64) {
    seg.cpu_access(Access::Write).unwrap().write(at, &v.to_le_bytes()).unwrap();
}

/// The child's side, when re-executed; otherwise nothing.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE_ENV) else { return };
    let fd = std::io::stdin().as_fd().try_clone_to_owned().unwrap();
    let ch = Channel::from_fd(fd, "child").unwrap();
    let expect = Expect::new(SegmentKind::Unified).fd_kind(FdKind::Memfd).min_len(SIZE);
    let mut b = PoolBorrower::new(POOL, expect).unwrap();
    let mut n = 0u64;
    while let Incoming::Frame { frame, .. } = b.recv(&ch).unwrap() {
        let seg = b.segment(frame.id).unwrap();
        assert_eq!(word(seg, SIZE - 8), frame.seq, "the owner's write, seen here");
        match role.as_str() {
            "crash" if n == 3 => std::process::abort(),
            "hostile" if n == 1 => {
                // A return of a buffer that is not out, then the same frame twice, then garbage.
                put(seg, 0, frame.seq + 1000);
                ch.send(&PoolMessage::Return { id: (frame.id + 1) % POOL as u32, seq: frame.seq }).unwrap();
                b.give_back(&ch, frame).unwrap();
                ch.send(&PoolMessage::Return { id: frame.id, seq: frame.seq }).unwrap();
                ch.send_bytes(b"garbage", &[]).unwrap();
                // Wait for the owner to hang up.
                assert!(matches!(b.recv(&ch), Err(Error::PeerGone { .. })));
                std::process::exit(0);
            }
            _ => {}
        }
        put(seg, 0, frame.seq + 1000);
        b.give_back(&ch, frame).unwrap();
        n += 1;
    }
    std::process::exit(0);
}

fn spawn(role: &str) -> (Child, Peer, PoolOwner) {
    let (mine, theirs) = Channel::pair("owner<->child").unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, role)
        .stdin(Stdio::from(theirs.into_fd()))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let pool = PoolOwner::allocate(&ShmemSource::new(), POOL, SIZE).unwrap();
    (child, Peer::new(mine), pool)
}

/// Fills and sends frame `seq`, first taking back a buffer if none is free.
fn send_next(pool: &mut PoolOwner, to: &mut Peer, seq: u64) -> Result<(), Error> {
    let id = match pool.take() {
        Some(id) => id,
        None => {
            returned(pool, to)?;
            pool.take().unwrap()
        }
    };
    put(pool.buffer(id).unwrap(), SIZE - 8, seq);
    pool.send(to, Frame { id, seq, len: SIZE as u64 })?;
    Ok(())
}

/// Takes one buffer back and checks the child's write in it.
fn returned(pool: &mut PoolOwner, from: &Peer) -> Result<(), Error> {
    let (id, seq) = pool.recv_return(from.channel())?;
    assert_eq!(word(pool.buffer(id).unwrap(), 0), seq + 1000, "the child's write, seen here");
    Ok(())
}

#[test]
fn buffers_cross_to_a_child_process_and_come_back_with_its_writes() {
    let (mut child, mut to, mut pool) = spawn("borrower");
    for seq in 0..40 {
        send_next(&mut pool, &mut to, seq).unwrap();
    }
    while pool.ledger().out_count() > 0 {
        returned(&mut pool, &to).unwrap();
    }
    to.send_end(40).unwrap();
    assert!(child.wait().unwrap().success());
    assert_eq!(to.channel().fds_sent(), POOL as u64, "each buffer's fd crossed once");
}

#[test]
fn a_hostile_child_is_refused_and_the_ledger_stays_right() {
    let (mut child, mut to, mut pool) = spawn("hostile");
    send_next(&mut pool, &mut to, 0).unwrap();
    send_next(&mut pool, &mut to, 1).unwrap();
    // Frame 0 comes back; then the child names buffer 2, which is free.
    returned(&mut pool, &to).unwrap();
    let r = pool.recv_return(to.channel());
    assert!(
        matches!(&r, Err(Error::Protocol { why, .. }) if why.contains("buffer 2 frame 1, which is not out")),
        "{r:?}"
    );
    returned(&mut pool, &to).unwrap();
    let r = pool.recv_return(to.channel());
    assert!(
        matches!(&r, Err(Error::Protocol { why, .. }) if why.contains("which is not out")),
        "a double return: {r:?}"
    );
    let r = pool.recv_return(to.channel());
    assert!(matches!(&r, Err(Error::Protocol { why, .. }) if why.contains("7 bytes, expected 32")), "{r:?}");
    assert_eq!((pool.ledger().free_count(), pool.ledger().out_count()), (POOL, 0));
    drop(to);
    assert!(child.wait().unwrap().success(), "the child saw the hang-up");
}

#[test]
fn a_child_that_crashes_mid_stream_is_peer_gone() {
    let (mut child, mut to, mut pool) = spawn("crash");
    let mut seq = 0;
    let err = loop {
        if let Err(e) = send_next(&mut pool, &mut to, seq) {
            break e;
        }
        seq += 1;
        assert!(seq < 1000, "the child should have crashed by now");
    };
    assert!(matches!(err, Error::PeerGone { .. }), "{err:?}");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(child.wait().unwrap().signal(), Some(6), "SIGABRT");
    // What the child had stays out (nobody returns it), or was taken for a send that failed.
    assert_eq!(pool.ledger().free_count(), 0);
}
