//! `dmabuf_rt::share` against a careless or hostile peer: crafted packets (every size, too
//! many fds, fds that are no buffer, huge or unmappable buffers), ranges and ids that overflow,
//! returns of buffers never lent, a next stage that dies, both ends used from several threads,
//! channels made from fds that are not what they should be.
//!
//! Every test takes `serial()` and compares this process's open fds before and after (the
//! count is process-wide); every wait is bounded by a watchdog (`bounded`), so a hang fails
//! with what hung instead of stalling the run.

mod common;

use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use common::{Rng, fd_summary, open_fds, scaled, serial, time_scale};
use dmabuf_rt::share::{
    BufferId, Channel, Expect, Frame, Incoming, Ledger, Peer, PoolBorrower, PoolMessage, PoolOwner, Ranged, Received,
};
use dmabuf_rt::source::{MemorySource, ShmemSource};
use dmabuf_rt::{Access, Error, ErrorKind, FdKind, SegmentKind};
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

const PAGE: usize = 4096;

/// Runs `f` on a thread of its own and fails the test if it has not finished within 60 s
/// (times the machine's slowness): a hang fails, naming `what`, instead of stalling the run.
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(60 * u64::from(time_scale()))) {
        Ok(v) => {
            t.join().unwrap();
            v
        }
        // The sender is gone without a value: the body panicked; its panic is the failure.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            std::panic::resume_unwind(t.join().expect_err("no value and no panic"))
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("HANG: {what} did not finish within 60 s"),
    }
}

/// Checks that no fd opened by `f` outlives it (under `serial()`, so no other test of this
/// binary opens or closes fds meanwhile).
fn no_fd_leaked<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let before = (open_fds(), fd_summary());
    let r = f();
    let after = open_fds();
    assert_eq!(after, before.0, "{what}: fds leaked\nbefore: {}\nafter:  {}", before.1, fd_summary());
    r
}

fn protocol(r: &Result<impl std::fmt::Debug, Error>, channel: &str, needle: &str) {
    match r {
        Err(e @ Error::Protocol { channel: c, why }) => {
            assert_eq!(e.kind(), ErrorKind::Failed);
            assert_eq!(c, channel, "the error names the channel: {e}");
            assert!(why.contains(needle), "expected `{needle}` in: {e}");
            assert!(e.to_string().contains(channel), "{e}");
        }
        other => panic!("expected a protocol error on `{channel}` saying `{needle}`, got {other:?}"),
    }
}

/// A sealed memfd of `len` bytes (`F_SEAL_SHRINK`, the import's requirement, and `extra`).
fn memfd(len: u64, extra: SealFlags) -> OwnedFd {
    let fd = rustix::fs::memfd_create("hostile-share", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | extra).unwrap();
    fd
}

/// Sends one packet on `ch`'s socket directly, past the channel's own checks: any length (0
/// included), any number of fds.
fn raw_send(ch: &Channel, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(16))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    assert!(fds.is_empty() || control.push(SendAncillaryMessage::ScmRights(fds)));
    let n = rustix::net::sendmsg(ch.as_fd(), &[IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL).unwrap();
    assert_eq!(n, bytes.len());
}

fn frame(id: BufferId, seq: u64, len: u64) -> PoolMessage {
    PoolMessage::Frame(Frame { id, seq, len })
}

/// fds of every kind that is not a buffer, each with what the refusal must say.
fn not_buffers() -> Vec<(&'static str, OwnedFd, &'static str)> {
    use rustix::event::EventfdFlags;
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
    drop(w);
    let (s, t) = rustix::net::socketpair(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC, None).unwrap();
    drop(t);
    let dir =
        rustix::fs::open("/", rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC, rustix::fs::Mode::empty())
            .unwrap();
    let opath = rustix::fs::open(
        "/proc/self/exe",
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .unwrap();
    let null = rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .unwrap();
    let unsealed =
        rustix::fs::memfd_create("hostile-unsealed", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&unsealed, PAGE as u64).unwrap();
    let frozen = rustix::fs::memfd_create("hostile-frozen", MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&frozen, PAGE as u64).unwrap();
    vec![
        ("a pipe", r, "neither a dma-buf nor a sealable memfd"),
        ("a socket", s, "neither a dma-buf nor a sealable memfd"),
        ("a directory", dir, "neither a dma-buf nor a sealable memfd"),
        ("an O_PATH fd", opath, "neither a dma-buf nor a sealable memfd"),
        ("/dev/null", null, "neither a dma-buf nor a sealable memfd"),
        ("an eventfd", rustix::event::eventfd(0, EventfdFlags::CLOEXEC).unwrap(), "neither a dma-buf"),
        ("an unsealed memfd", unsealed, "lacks F_SEAL_SHRINK"),
        ("a memfd without sealing", frozen, "seals are frozen without F_SEAL_SHRINK"),
        ("an empty memfd", memfd(0, SealFlags::empty()), "empty (size 0)"),
    ]
}

/// Every kind of fd that is no buffer, where a segment, a range or a pool buffer is due: each is
/// refused as the peer's protocol error naming what it is, and closed.
#[test]
fn fds_that_are_not_buffers_are_refused_with_the_reason_and_closed() {
    let _s = serial();
    no_fd_leaked("fds that are not buffers", || {
        let (a, b) = Channel::pair("hostile->me").unwrap();
        let any = Expect::new(SegmentKind::Unified);
        let mut borrower = PoolBorrower::new(2, any).unwrap();
        for (what, fd, why) in not_buffers() {
            a.send_with_fd(&[7u8; 8], fd.as_fd()).unwrap();
            protocol(&b.recv_segment::<[u8; 8]>(&any), "hostile->me", why);
            a.send_with_fd(&Ranged { offset: 0, len: 1, meta: [7u8; 8] }, fd.as_fd()).unwrap();
            protocol(&b.recv_range::<[u8; 8]>(&any), "hostile->me", why);
            a.send_with_fd(&frame(1, 0, 1), fd.as_fd()).unwrap();
            let r = borrower.recv(&b);
            protocol(&r, "hostile->me", why);
            assert!(format!("{r:?}").contains("buffer 1"), "{what}: the refusal names the buffer: {r:?}");
            assert!(borrower.segment(1).is_none() && !borrower.is_here(1), "{what} left a trace in the borrower");
        }
        // The borrower still takes a real buffer in that slot afterwards.
        let good = memfd(PAGE as u64, SealFlags::empty());
        a.send_with_fd(&frame(1, 9, PAGE as u64), good.as_fd()).unwrap();
        assert!(matches!(borrower.recv(&b).unwrap(), Incoming::Frame { first: true, .. }));
    });
}

/// A sealed memfd that no process could map (sparse, 4 EiB), and one sent through an fd opened
/// write-only (which cannot be mapped for reading): the import fails in `mmap`, and that is
/// the peer's doing, not a lack of memory here. The error must say so (a protocol error on the
/// channel, naming the buffer and its size), and close the fd.
#[test]
fn buffers_that_cannot_be_mapped_are_the_peers_fault() {
    let _s = serial();
    no_fd_leaked("unmappable buffers", || {
        let (a, b) = Channel::pair("hostile->me").unwrap();
        let any = Expect::new(SegmentKind::Unified);
        let huge = memfd(1 << 62, SealFlags::empty());
        a.send_with_fd(&[1u8; 4], huge.as_fd()).unwrap();
        protocol(&b.recv_segment::<[u8; 4]>(&any), "hostile->me", "4611686018427387904");
        let mut borrower = PoolBorrower::new(1, any).unwrap();
        a.send_with_fd(&frame(0, 0, 1), huge.as_fd()).unwrap();
        protocol(&borrower.recv(&b), "hostile->me", "buffer 0");
        let small = memfd(PAGE as u64, SealFlags::empty());
        let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&small));
        let write_only = rustix::fs::open(
            path.as_str(),
            rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        a.send_with_fd(&frame(0, 0, 1), write_only.as_fd()).unwrap();
        protocol(&borrower.recv(&b), "hostile->me", "buffer 0");
        assert!(borrower.segment(0).is_none());
        // A buffer sealed against writes arrives, read-only: a write says so.
        let sealed = memfd(PAGE as u64, SealFlags::WRITE);
        a.send_with_fd(&[2u8; 4], sealed.as_fd()).unwrap();
        let (_, seg) = b.recv_segment::<[u8; 4]>(&any).unwrap();
        assert!(matches!(seg.cpu_access(Access::Write), Err(Error::ReadOnly)));
    });
}

/// A zero-length packet is not a hang-up: the peer is still there, and what it sends next
/// arrives. (A `read` of 0 bytes is all `recvmsg` reports for both.)
#[test]
fn an_empty_packet_is_refused_not_taken_for_a_hang_up() {
    let _s = serial();
    no_fd_leaked("empty packets", || {
        let (a, b) = Channel::pair("hostile->me").unwrap();
        raw_send(&a, &[], &[]);
        protocol(&b.recv::<PoolMessage>(), "hostile->me", "empty packet");
        a.send(&frame(0, 1, 2)).unwrap();
        assert_eq!(b.recv::<PoolMessage>().unwrap().msg, frame(0, 1, 2), "the peer was still there");
        // Empty, with an fd: refused by size, the fd closed.
        let fd = memfd(PAGE as u64, SealFlags::empty());
        raw_send(&a, &[], &[fd.as_fd()]);
        protocol(&b.recv::<PoolMessage>(), "hostile->me", "0 bytes, expected 32");
        // An empty packet, then the hang-up: both end as they should, and the hang-up stays.
        raw_send(&a, &[], &[]);
        drop(a);
        let r = b.recv::<PoolMessage>();
        assert!(matches!(r, Err(Error::PeerGone { .. } | Error::Protocol { .. })), "{r:?}");
        for _ in 0..3 {
            assert!(matches!(b.recv::<PoolMessage>(), Err(Error::PeerGone { .. })));
        }
    });
}

/// Ranges whose end wraps u64 (and usize), or lies past the segment, are refused by the
/// receiver whatever the sender claims; the ranges that touch the end exactly are taken.
#[test]
fn ranges_that_overflow_or_pass_the_end_are_refused() {
    let _s = serial();
    no_fd_leaked("ranges", || {
        let (a, b) = Channel::pair("ranges").unwrap();
        let seg = ShmemSource::new().create_segment(2 * PAGE).unwrap();
        let size = seg.len() as u64;
        let expect = Expect::new(SegmentKind::Unified).fd_kind(FdKind::Memfd);
        let bad = [
            (u64::MAX, 1),
            (1, u64::MAX),
            (u64::MAX, u64::MAX),
            (size, u64::MAX - size + 1), // wraps to exactly 0
            (size + 1, 0),
            (0, size + 1),
            (size - 1, 2),
            (1 << 63, 1 << 63),
        ];
        for (offset, len) in bad {
            a.send_with_fd(&Ranged { offset, len, meta: [0u8; 1] }, seg.as_fd()).unwrap();
            protocol(&b.recv_range::<[u8; 1]>(&expect), "ranges", &format!("range {offset}+{len} outside"));
        }
        for (offset, len) in [(0, size), (size, 0), (size - 1, 1)] {
            a.send_with_fd(&Ranged { offset, len, meta: [0u8; 1] }, seg.as_fd()).unwrap();
            let (_, r) = b.recv_range::<[u8; 1]>(&expect).unwrap();
            assert_eq!((r.offset() as u64, r.len() as u64), (offset, len));
            assert_eq!(r.cpu_access(Access::Read).unwrap().len(), len as usize);
        }
        // The sender refuses them too, before anything is sent.
        for (offset, len) in [(usize::MAX, 1), (1, usize::MAX), (seg.len(), 1), (0, seg.len() + 1)] {
            let e = a.send_range([0u8; 1], &seg, offset, len).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
            assert!(matches!(e, Error::OutOfBounds { .. }), "{e:?}");
        }
        assert_eq!(a.fds_sent(), 11, "a refused range sent nothing");
    });
}

/// Ids and lengths at the edges of their types, in frames and returns, and returns of
/// buffers never lent (free, or taken and not sent): each refused with the reason, the ledger
/// and the borrower unchanged, fds closed.
#[test]
fn ids_lengths_and_returns_out_of_range_are_refused_and_change_nothing() {
    let _s = serial();
    no_fd_leaked("ids and returns", || {
        let (a, b) = Channel::pair("edges").unwrap();
        let mut borrower = PoolBorrower::new(3, Expect::new(SegmentKind::Unified)).unwrap();
        let buf = memfd(PAGE as u64, SealFlags::empty());
        for (msg, why) in [
            (frame(u32::MAX, 0, 1), "buffer id 4294967295 outside the pool of 3"),
            (frame(3, 0, 1), "buffer id 3 outside the pool of 3"),
            (frame(0, u64::MAX, u64::MAX), "frame of 18446744073709551615 bytes in buffer 0 of 4096 bytes"),
            (frame(0, 0, PAGE as u64 + 1), "frame of 4097 bytes"),
        ] {
            a.send_with_fd(&msg, buf.as_fd()).unwrap();
            protocol(&borrower.recv(&b), "edges", why);
            assert!((0..3).all(|i| borrower.segment(i).is_none() && !borrower.is_here(i)));
        }
        // A frame of exactly the buffer's length, and one of 0 bytes, are fine.
        a.send_with_fd(&frame(0, 0, PAGE as u64), buf.as_fd()).unwrap();
        let Incoming::Frame { frame: f, .. } = borrower.recv(&b).unwrap() else { panic!() };
        let (back, owner_side) = Channel::pair("returns").unwrap();
        borrower.give_back(&back, f).unwrap();
        a.send(&frame(0, 1, 0)).unwrap();
        assert!(matches!(borrower.recv(&b).unwrap(), Incoming::Frame { first: false, .. }));
        // Forwarding or giving back what is not here: refused, nothing sent.
        let bogus = Frame { id: u32::MAX, seq: 0, len: 0 };
        assert_eq!(borrower.give_back(&back, bogus).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(
            borrower.give_back(&back, Frame { id: 2, seq: 0, len: 0 }).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert_eq!(back.bytes_sent(), 32, "only the good return went");
        assert_eq!(owner_side.recv::<PoolMessage>().unwrap().msg, PoolMessage::Return { id: 0, seq: 0 });

        // The owner: returns of ids at the edges, of a free buffer, of a held one.
        let mut owner = PoolOwner::allocate(&ShmemSource::new(), 3, PAGE).unwrap();
        let (to, _far) = Channel::pair("owner->far").unwrap();
        let mut peer = Peer::new(to);
        let held = owner.take().unwrap();
        let out = owner.take().unwrap();
        owner.send(&mut peer, Frame { id: out, seq: u64::MAX, len: 0 }).unwrap();
        let (hostile, from) = Channel::pair("far->owner").unwrap();
        for (msg, why) in [
            (PoolMessage::Return { id: u32::MAX, seq: u64::MAX }, "buffer 4294967295, outside the pool of 3"),
            (PoolMessage::Return { id: held, seq: 0 }, "which is not out"),
            (PoolMessage::Return { id: 2, seq: 0 }, "which is not out"),
            (PoolMessage::Return { id: out, seq: u64::MAX - 1 }, "but it is out with frame 18446744073709551615"),
        ] {
            hostile.send(&msg).unwrap();
            protocol(&owner.recv_return(&from), "far->owner", why);
            let l = owner.ledger();
            assert_eq!((l.free_count(), l.out_count(), l.is_held(held), l.out_with(out)), (1, 1, true, Some(u64::MAX)));
        }
        hostile.send(&PoolMessage::Return { id: out, seq: u64::MAX }).unwrap();
        assert_eq!(owner.recv_return(&from).unwrap(), (out, u64::MAX));
        // A careless owner: sending what it does not hold, putting back what is out or free.
        let e = owner.send(&mut peer, Frame { id: out, seq: 0, len: 0 }).unwrap_err();
        assert!(e.to_string().contains("not held"), "{e}");
        assert!(owner.put_back(out).is_err() && owner.put_back(u32::MAX).is_err());
        owner.put_back(held).unwrap();
        assert_eq!(owner.ledger().free_count(), 3);
    });
}

/// A pool borrower whose next stage has died: forwarding fails (`PeerGone`, naming the next
/// stage's channel), and the buffer is still here, so it can go back to its owner instead of
/// being lost to the pool.
#[test]
fn a_failed_forward_keeps_the_buffer_so_it_can_go_back_to_its_owner() {
    let _s = serial();
    no_fd_leaked("a failed forward", || {
        let (to_mid, mid_in) = Channel::pair("owner->mid").unwrap();
        let (mid_out, next_in) = Channel::pair("mid->next").unwrap();
        let (ret, owner_ret) = Channel::pair("mid->owner").unwrap();
        let mut owner = PoolOwner::allocate(&ShmemSource::new(), 2, PAGE).unwrap();
        let mut to = Peer::new(to_mid);
        let mut mid = PoolBorrower::new(2, Expect::new(SegmentKind::Unified)).unwrap();
        let mut next = Peer::new(mid_out);
        for seq in 0..2 {
            let id = owner.take().unwrap();
            owner.send(&mut to, Frame { id, seq, len: 8 }).unwrap();
        }
        let Incoming::Frame { frame: f0, .. } = mid.recv(&mid_in).unwrap() else { panic!() };
        let Incoming::Frame { frame: f1, .. } = mid.recv(&mid_in).unwrap() else { panic!() };
        assert!(mid.forward(&mut next, f0).unwrap(), "the first forward carries the fd");
        drop(next_in);
        let e = mid.forward(&mut next, f1).unwrap_err();
        assert!(matches!(&e, Error::PeerGone { channel } if channel == "mid->next"), "{e:?}");
        assert!(mid.is_here(f1.id), "a failed forward lost the buffer");
        assert!(!next.has_buffer(f1.id), "the fd never went");
        mid.give_back(&ret, f1).unwrap();
        assert_eq!(owner.recv_return(&owner_ret).unwrap(), (f1.id, f1.seq));
        assert_eq!(owner.ledger().out_with(f0.id), Some(0), "the forwarded one is still out");
        // Giving back to an owner that is gone: PeerGone, and the buffer stays here too.
        drop(owner_ret);
        a_frame_back(&mut owner, &mut to, &mut mid, &mid_in, f1.id);
        let f = Frame { id: f1.id, seq: 2, len: 8 };
        let e = mid.give_back(&ret, f).unwrap_err();
        assert!(matches!(&e, Error::PeerGone { channel } if channel == "mid->owner"), "{e:?}");
        assert!(mid.is_here(f.id));
    });
}

fn a_frame_back(owner: &mut PoolOwner, to: &mut Peer, mid: &mut PoolBorrower, from: &Channel, id: BufferId) {
    assert_eq!(owner.take(), Some(id));
    assert!(!owner.send(to, Frame { id, seq: 2, len: 8 }).unwrap(), "the mid stage has the fd");
    assert!(matches!(mid.recv(from).unwrap(), Incoming::Frame { frame, first: false } if frame.id == id));
}

/// Random packets, of every length from 0 to past the largest message, with 0 to 6 fds of
/// every kind, at every receiving call of the module: each is taken or refused as the peer's
/// protocol error; nothing panics; every fd that is not kept is closed.
#[test]
fn random_packets_at_every_receiver_never_panic_or_leak() {
    let _s = serial();
    no_fd_leaked("random packets", || {
        bounded("random packets", || {
            let (a, b) = Channel::pair("fuzz").unwrap();
            let mut rng = Rng(0x5eed_f00d);
            let expect = Expect::new(SegmentKind::Unified);
            let good = memfd(PAGE as u64, SealFlags::empty());
            let kinds = not_buffers();
            let mut borrower = PoolBorrower::new(4, expect).unwrap();
            let mut ledger = Ledger::new(4).unwrap();
            let mut taken = 0;
            for i in 0..scaled(2000) {
                let len = match rng.below(4) {
                    0 => 32,
                    1 => 40, // a Ranged<[u8; 24]>
                    _ => rng.below(300) as usize,
                };
                let mut bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
                if len >= 32 && rng.below(2) == 0 {
                    // Mostly well-formed pool messages, so the checks behind the framing run.
                    let id = rng.below(6) as u32;
                    let m = match rng.below(3) {
                        0 => frame(id, rng.below(4), rng.below(2 * PAGE as u64)),
                        1 => PoolMessage::Return { id, seq: rng.below(4) },
                        _ => PoolMessage::End { count: rng.next() },
                    };
                    bytes[..32].copy_from_slice(&m.to_bytes());
                    bytes.truncate(32);
                }
                let nfds = [0, 0, 1, 1, 1, 2, 5, 6][rng.below(8) as usize];
                let fds: Vec<BorrowedFd<'_>> = (0..nfds)
                    .map(|_| {
                        let k = rng.below(kinds.len() as u64 + 2) as usize;
                        kinds.get(k).map_or(good.as_fd(), |(_, fd, _)| fd.as_fd())
                    })
                    .collect();
                raw_send(&a, &bytes, &fds);
                let r: Result<String, Error> = match rng.below(5) {
                    0 => b.recv::<PoolMessage>().map(|m| format!("{m:?}")),
                    1 => b.recv_segment::<[u8; 32]>(&expect).map(|(_, s)| format!("{}", s.len())),
                    2 => b.recv_range::<[u8; 24]>(&expect).map(|(_, r)| format!("{}", r.len())),
                    3 => borrower.recv(&b).map(|m| {
                        if let Incoming::Frame { frame, .. } = m {
                            // Back to "not here", so that later frames of the id can land.
                            let (x, _y) = Channel::pair("sink").unwrap();
                            borrower.give_back(&x, frame).unwrap();
                        }
                        format!("{m:?}")
                    }),
                    _ => {
                        if taken < 4 {
                            let id = ledger.take().unwrap();
                            ledger.lend(id, rng.below(4)).unwrap();
                            taken += 1;
                        }
                        ledger.recv_return(&b).map(|(id, seq)| {
                            ledger.take().unwrap();
                            ledger.lend(id, seq).unwrap();
                            format!("{id} {seq}")
                        })
                    }
                };
                match r {
                    Ok(_) => {}
                    Err(Error::Protocol { ref channel, .. }) if channel == "fuzz" => {}
                    Err(e) => panic!("packet {i} ({len} bytes, {nfds} fds): {e:?}"),
                }
            }
            // The channel still carries good messages afterwards.
            a.send(&frame(1, 2, 3)).unwrap();
            assert_eq!(b.recv::<PoolMessage>().unwrap().msg, frame(1, 2, 3));
        });
    });
}

/// Several senders of segments and several receivers on one pair of channels, at once and many
/// times over: every segment arrives once, with its own bytes (a tag names the memfd's
/// contents), and no fd is left behind.
#[test]
fn segments_cross_one_channel_from_several_threads_at_once() {
    let _s = serial();
    no_fd_leaked("threads", || {
        bounded("several threads on one channel", || {
            const SENDERS: u64 = 3;
            const RECEIVERS: usize = 3;
            let each = scaled(300) as u64;
            let (a, b) = Channel::pair("many").unwrap();
            let (a, b) = (Arc::new(a), Arc::new(b));
            let src = ShmemSource::new();
            let segs: Vec<_> = (0..SENDERS)
                .map(|t| {
                    let s = src.create_segment(PAGE).unwrap();
                    s.cpu_access(Access::Write).unwrap().write(0, &t.to_le_bytes()).unwrap();
                    Arc::new(s)
                })
                .collect();
            let receivers: Vec<_> = (0..RECEIVERS)
                .map(|_| {
                    let b = Arc::clone(&b);
                    std::thread::spawn(move || {
                        let expect = Expect::new(SegmentKind::Unified).fd_kind(FdKind::Memfd).min_len(PAGE);
                        let mut got = Vec::new();
                        loop {
                            let (tag, seg) = b.recv_range::<[u8; 16]>(&expect).unwrap();
                            let (t, n) = (
                                u64::from_le_bytes(tag[..8].try_into().unwrap()),
                                u64::from_le_bytes(tag[8..].try_into().unwrap()),
                            );
                            if t == u64::MAX {
                                return got;
                            }
                            let mut w = [0u8; 8];
                            seg.segment().cpu_access(Access::Read).unwrap().read(0, &mut w).unwrap();
                            assert_eq!(u64::from_le_bytes(w), t, "message {n} of sender {t} came with another's fd");
                            assert_eq!((seg.offset() as u64, seg.len() as u64), (n % 8, 8));
                            got.push((t, n));
                        }
                    })
                })
                .collect();
            let senders: Vec<_> = (0..SENDERS)
                .map(|t| {
                    let (a, seg) = (Arc::clone(&a), Arc::clone(&segs[t as usize]));
                    std::thread::spawn(move || {
                        for n in 0..each {
                            let mut tag = [0u8; 16];
                            tag[..8].copy_from_slice(&t.to_le_bytes());
                            tag[8..].copy_from_slice(&n.to_le_bytes());
                            a.send_range(tag, &seg, (n % 8) as usize, 8).unwrap();
                        }
                    })
                })
                .collect();
            senders.into_iter().for_each(|t| t.join().unwrap());
            for _ in 0..RECEIVERS {
                a.send_range([0xff; 16], &segs[0], 0, 8).unwrap();
            }
            let mut got: Vec<_> = receivers.into_iter().flat_map(|t| t.join().unwrap()).collect();
            got.sort_unstable();
            let want: Vec<_> = (0..SENDERS).flat_map(|t| (0..each).map(move |n| (t, n))).collect();
            assert_eq!(got, want, "every segment exactly once");
        });
    });
}

/// Returns racing with sends: a borrower thread gives every buffer back the moment it arrives
/// and then replays the same return (a stale duplicate), while the owner keeps re-lending the
/// ids it gets back. Every stale return is refused, even when it names a buffer that is out
/// again with a newer frame, and no buffer is ever taken back twice.
#[test]
fn stale_returns_racing_with_new_sends_are_refused() {
    let _s = serial();
    no_fd_leaked("stale returns", || {
        bounded("stale returns", || {
            const LEN: usize = 2;
            let frames = scaled(600) as u64;
            let (to_b, b_in) = Channel::pair("owner->b").unwrap();
            let (ret, owner_ret) = Channel::pair("b->owner").unwrap();
            let borrower = std::thread::spawn(move || {
                let mut b = PoolBorrower::new(LEN, Expect::new(SegmentKind::Unified).min_len(PAGE)).unwrap();
                let mut n = 0u64;
                while let Incoming::Frame { frame, .. } = b.recv(&b_in).unwrap() {
                    b.give_back(&ret, frame).unwrap();
                    ret.send(&PoolMessage::Return { id: frame.id, seq: frame.seq }).unwrap();
                    n += 1;
                }
                n
            });
            let mut owner = PoolOwner::allocate(&ShmemSource::new(), LEN, PAGE).unwrap();
            let mut to = Peer::new(to_b);
            let (mut accepted, mut refused) = (0u64, 0u64);
            let mut next_seq = 0u64;
            while accepted < frames {
                while next_seq < frames {
                    let Some(id) = owner.take() else { break };
                    owner.send(&mut to, Frame { id, seq: next_seq, len: 1 }).unwrap();
                    next_seq += 1;
                }
                match owner.recv_return(&owner_ret) {
                    Ok((_, seq)) => {
                        assert!(seq < next_seq);
                        accepted += 1;
                    }
                    Err(Error::Protocol { why, .. }) => {
                        assert!(why.contains("which is not out") || why.contains("but it is out with frame"), "{why}");
                        refused += 1;
                    }
                    Err(e) => panic!("{e:?}"),
                }
            }
            to.send_end(frames).unwrap();
            assert_eq!(borrower.join().unwrap(), frames);
            // The duplicates not yet read: each refused too.
            while refused < frames {
                protocol(&owner.recv_return(&owner_ret), "b->owner", "");
                refused += 1;
            }
            assert!(matches!(owner.recv_return(&owner_ret), Err(Error::PeerGone { .. })));
            assert_eq!((owner.ledger().free_count(), owner.ledger().out_count()), (LEN, 0));
        });
    });
}

/// A borrower process that dies holding buffers, seen from the owner: its pending returns
/// still arrive, then `PeerGone`; the ledger shows exactly the buffers it took with it.
#[test]
fn a_borrower_that_dies_mid_stream_is_peer_gone_after_its_last_return() {
    let _s = serial();
    no_fd_leaked("a dying borrower", || {
        bounded("a dying borrower", || {
            for round in 0..scaled(200) {
                let (to_b, b_in) = Channel::pair("owner->b").unwrap();
                let (ret, owner_ret) = Channel::pair("b->owner").unwrap();
                let keep = round % 4;
                let borrower = std::thread::spawn(move || {
                    let mut b = PoolBorrower::new(4, Expect::new(SegmentKind::Unified)).unwrap();
                    for _ in 0..4 - keep {
                        let Incoming::Frame { frame, .. } = b.recv(&b_in).unwrap() else { panic!() };
                        b.give_back(&ret, frame).unwrap();
                    }
                    // Dies here, holding what it has not read (its channels close with it).
                });
                let mut owner = PoolOwner::allocate(&ShmemSource::new(), 4, PAGE).unwrap();
                let mut to = Peer::new(to_b);
                let mut sent = 0;
                for seq in 0..4 {
                    let id = owner.take().unwrap();
                    // The borrower may already be gone: a send then fails as PeerGone, and
                    // the buffer stays held.
                    match owner.send(&mut to, Frame { id, seq, len: 1 }) {
                        Ok(_) => sent += 1,
                        Err(Error::PeerGone { .. }) => owner.put_back(id).unwrap(),
                        Err(e) => panic!("{e:?}"),
                    }
                }
                let mut back = 0;
                let e = loop {
                    match owner.recv_return(&owner_ret) {
                        Ok(_) => back += 1,
                        Err(e) => break e,
                    }
                };
                assert!(matches!(&e, Error::PeerGone { channel } if channel == "b->owner"), "{e:?}");
                assert_eq!(back, 4 - keep);
                assert_eq!(owner.ledger().out_count() + owner.ledger().free_count(), 4);
                assert_eq!(owner.ledger().out_count(), sent - back, "out: sent and never returned");
                borrower.join().unwrap();
            }
        });
    });
}

/// Channels from fds that are not connected seqpacket sockets: refused (or, for a socket whose
/// peer is already gone, `PeerGone` at the first use), and the fd is closed either way.
#[test]
fn channels_from_the_wrong_fds_are_refused() {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let _s = serial();
    no_fd_leaked("channels from the wrong fds", || {
        let dgram =
            rustix::net::socketpair(AddressFamily::UNIX, SocketType::DGRAM, SocketFlags::CLOEXEC, None).unwrap().0;
        let stream =
            rustix::net::socketpair(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC, None).unwrap().0;
        let udp = rustix::net::socket(AddressFamily::INET, SocketType::DGRAM, None).unwrap();
        for (fd, why) in [
            (dgram, "not SOCK_SEQPACKET"),
            (stream, "not SOCK_SEQPACKET"),
            (udp, "not SOCK_SEQPACKET"),
            (memfd(PAGE as u64, SealFlags::empty()), "not a socket"),
            (rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap(), "not a socket"),
        ] {
            let e = Channel::from_fd(fd, "wrong").unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
            assert!(e.to_string().contains("wrong: the fd") && e.to_string().contains(why), "{e}");
        }
        // A seqpacket socket that is not connected: nothing can ever arrive on it.
        let lone = rustix::net::socket(AddressFamily::UNIX, SocketType::SEQPACKET, None).unwrap();
        let e = Channel::from_fd(lone, "lone").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("lone") && e.to_string().contains("not connected"), "{e}");
        // A socket whose peer is already gone becomes a channel; its first use says so.
        let (x, y) =
            rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).unwrap();
        drop(y);
        let ch = Channel::from_fd(x, "orphan").unwrap();
        assert!(matches!(ch.recv::<PoolMessage>(), Err(Error::PeerGone { channel }) if channel == "orphan"));
        assert!(matches!(ch.send(&frame(0, 0, 0)), Err(Error::PeerGone { .. })));
    });
}

/// A socket that asks for credentials with every message (`SO_PASSCRED`, as systemd's
/// `PassCredentials=` sets on the sockets it passes): the credentials must not crowd out the
/// fds (a message with an fd would arrive "truncated").
#[test]
fn a_socket_with_so_passcred_still_carries_fds() {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let _s = serial();
    no_fd_leaked("SO_PASSCRED", || {
        let (x, y) =
            rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).unwrap();
        rustix::net::sockopt::set_socket_passcred(&y, true).unwrap();
        let (a, b) = (Channel::from_fd(x, "creds").unwrap(), Channel::from_fd(y, "creds").unwrap());
        let seg = ShmemSource::new().create_segment(PAGE).unwrap();
        let expect = Expect::new(SegmentKind::Unified);
        for n in 0u32..4 {
            a.send_segment(&n.to_le_bytes(), &seg).unwrap();
            let (got, s) = b.recv_segment::<[u8; 4]>(&expect).unwrap();
            assert_eq!((u32::from_le_bytes(got), s.len()), (n, PAGE));
        }
        let fds: Vec<_> = (0..4).map(|_| memfd(PAGE as u64, SealFlags::empty())).collect();
        let borrowed: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
        a.send_bytes(b"four", &borrowed).unwrap();
        let mut buf = [0u8; 8];
        let (n, got) = b.recv_bytes(&mut buf).unwrap();
        assert_eq!((n, got.len()), (4, 4), "four fds sent, four arrive");
        a.send(&[9u8; 3]).unwrap();
        let Received { msg, fd } = b.recv::<[u8; 3]>().unwrap();
        assert_eq!((msg, fd.is_none()), ([9; 3], true));
    });
}
