//! The share module between threads over socketpairs: segments and ranges that arrive intact,
//! pools whose buffers go round, and hostile peers (garbage, wrong sizes, missing and extra
//! fds, fds of the wrong kind or size, bogus ids and returns, hang-ups mid-stream, several
//! threads at once). Every refused fd is checked to be closed, per object (a pipe whose
//! write end was sent shows `POLLHUP` once no copy is left; a memfd by its name in
//! `/proc/self/fd`), so the checks hold while other tests open and close fds.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use crate::error::Error;
use crate::segment::{Access, FdKind, Segment, SegmentKind};
use crate::source::{MemorySource, ShmemSource};
use crate::sys::memfd;

fn pair() -> (Channel, Channel) {
    Channel::pair("test").unwrap()
}

fn is_protocol(r: &Result<impl std::fmt::Debug, Error>, needle: &str) -> bool {
    matches!(r, Err(Error::Protocol { why, .. }) if why.contains(needle))
}

/// A pipe whose write end is to be sent away: `closed()` tells whether every copy of the write
/// end is gone.
struct Watched {
    read: OwnedFd,
    write: Option<OwnedFd>,
}

impl Watched {
    fn new() -> Self {
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        Self { read, write: Some(write) }
    }

    /// The write end, for sending; our copy is dropped with `forget_own`.
    fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.write.as_ref().unwrap().as_fd()
    }

    fn forget_own(&mut self) {
        self.write = None;
    }

    fn closed(&self) -> bool {
        use rustix::event::{PollFd, PollFlags, Timespec};
        let mut p = [PollFd::new(&self.read, PollFlags::IN)];
        rustix::event::poll(&mut p, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })).unwrap();
        p[0].revents().contains(PollFlags::HUP)
    }
}

/// fds of this process that are the memfd called `name`.
fn memfds_named(name: &str) -> usize {
    let want = format!("/memfd:{name} (deleted)");
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy() == want))
        .count()
}

fn memfd_named(name: &str, len: u64) -> OwnedFd {
    memfd::create_sealed(name, len).unwrap()
}

fn frame(id: u32, seq: u64, len: u64) -> PoolMessage {
    PoolMessage::Frame(Frame { id, seq, len })
}

#[test]
fn segments_and_ranges_arrive_as_segments_that_share_the_memory() {
    let (a, b) = pair();
    let seg = ShmemSource::new().create_segment(8192).unwrap();
    let cpu = seg.cpu_access(Access::Write).unwrap();
    cpu.write(4096, b"range!").unwrap();
    cpu.end().unwrap();
    let expect = Expect::new(SegmentKind::Unified).fd_kind(FdKind::Memfd).min_len(8192);

    a.send_segment(&7u64.to_le_bytes(), &seg).unwrap();
    let (meta, got) = b.recv_segment::<[u8; 8]>(&expect).unwrap();
    assert_eq!((u64::from_le_bytes(meta), got.len(), got.kind()), (7, 8192, SegmentKind::Unified));

    a.send_range(*b"meta", &seg, 4096, 6).unwrap();
    let (meta, range) = b.recv_range::<[u8; 4]>(&expect).unwrap();
    assert_eq!((&meta, range.offset(), range.len()), (b"meta", 4096, 6));
    let view = range.cpu_access(Access::ReadWrite).unwrap();
    assert_eq!(view.to_vec().unwrap(), b"range!");
    assert!(view.write(6, b"x").is_err(), "the range's view ends with the range");
    view.write(0, b"RANGE").unwrap();
    view.end().unwrap();
    // The same pages: the sender sees the receiver's write.
    assert_eq!(seg.cpu_access(Access::Read).unwrap().sub(4096, 6).unwrap().to_vec().unwrap(), b"RANGE!");
    assert_eq!((a.bytes_sent(), a.fds_sent()), (8 + 16 + 4, 2));

    // A range outside the segment is refused before anything is sent.
    assert!(matches!(a.send_range(*b"meta", &seg, 8000, 200), Err(Error::OutOfBounds { .. })));
    assert!(matches!(a.send_range(*b"meta", &seg, usize::MAX, 2), Err(Error::OutOfBounds { .. })));
    // A hostile sender names a range outside the segment anyway.
    let bad = Ranged { offset: 8190, len: 4, meta: *b"meta" };
    a.send_with_fd(&bad, seg.as_fd()).unwrap();
    assert!(is_protocol(&b.recv_range::<[u8; 4]>(&expect), "range 8190+4 outside a 8192-byte segment"));
    let bad = Ranged { offset: u64::MAX, len: 2, meta: *b"meta" };
    a.send_with_fd(&bad, seg.as_fd()).unwrap();
    assert!(is_protocol(&b.recv_range::<[u8; 4]>(&expect), "outside"));
}

#[test]
fn received_fds_are_checked_and_refused_ones_are_closed() {
    let (a, b) = pair();
    let any = Expect::new(SegmentKind::Unified);
    // No fd where a segment is due.
    a.send(&[1u8; 8]).unwrap();
    assert!(is_protocol(&b.recv_segment::<[u8; 8]>(&any), "without its fd"));
    // A pipe is no buffer.
    let mut w = Watched::new();
    a.send_with_fd(&[1u8; 8], w.fd()).unwrap();
    w.forget_own();
    assert!(is_protocol(&b.recv_segment::<[u8; 8]>(&any), "neither a dma-buf nor a sealable memfd"));
    assert!(w.closed(), "the refused fd must be closed");
    // An unsealed memfd could be truncated under our mapping.
    let unsealed = memfd::create("share-test-unsealed").unwrap();
    rustix::fs::ftruncate(&unsealed, 4096).unwrap();
    a.send_with_fd(&[1u8; 8], unsealed.as_fd()).unwrap();
    drop(unsealed);
    assert!(is_protocol(&b.recv_segment::<[u8; 8]>(&any), "F_SEAL_SHRINK"));
    assert_eq!(memfds_named("share-test-unsealed"), 0);
    // The wrong fd kind, too small.
    let name = "share-test-small";
    let small = memfd_named(name, 4096);
    a.send_with_fd(&[1u8; 8], small.as_fd()).unwrap();
    assert!(is_protocol(&b.recv_segment::<[u8; 8]>(&any.fd_kind(FdKind::DmaBuf)), "is a Memfd, expected a DmaBuf"));
    a.send_with_fd(&[1u8; 8], small.as_fd()).unwrap();
    assert!(is_protocol(&b.recv_segment::<[u8; 8]>(&any.min_len(4097)), "holds 4096 bytes, fewer than 4097"));
    drop(small);
    assert_eq!(memfds_named(name), 0, "refused segments must not stay open");
}

#[test]
fn malformed_packets_are_refused_with_the_reason_and_their_fds_closed() {
    let (a, b) = pair();
    let mut watched = Vec::new();
    let mut hostile = |bytes: &[u8], nfds: usize| {
        let mut ws: Vec<Watched> = (0..nfds).map(|_| Watched::new()).collect();
        let fds: Vec<_> = ws.iter().map(Watched::fd).collect();
        // More fds than a channel sends go through the packet layer directly.
        super::packet::send(a.as_fd(), bytes, &fds[..nfds.min(4)]).unwrap();
        drop(fds);
        ws.iter_mut().for_each(Watched::forget_own);
        watched.extend(ws);
    };
    let good = frame(0, 0, 8).to_bytes();
    hostile(&good[..31], 0);
    hostile(&[good.as_slice(), &[0]].concat(), 1);
    hostile(&[0u8; 300], 1);
    hostile(&good, 2);
    hostile(&[0xa5; 32], 1);
    let mut bad_kind = good;
    bad_kind[4] = 7;
    hostile(&bad_kind, 0);
    for needle in
        ["31 bytes, expected 32", "33 bytes, expected 32", "truncated", "2 fds attached", "bad magic", "unknown kind 7"]
    {
        let r = b.recv::<PoolMessage>();
        assert!(is_protocol(&r, needle), "{needle}: {r:?}");
    }
    assert!(watched.iter().all(Watched::closed), "fds of refused packets must be closed");
    // More fds than fit in the control buffer: the kernel drops the excess (MSG_CTRUNC).
    let ws: Vec<Watched> = (0..16).map(|_| Watched::new()).collect();
    {
        let fds: Vec<_> = ws.iter().map(Watched::fd).collect();
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(16))];
        let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
        assert!(control.push(rustix::net::SendAncillaryMessage::ScmRights(&fds)));
        let iov = [std::io::IoSlice::new(&good)];
        rustix::net::sendmsg(a.as_fd(), &iov, &mut control, rustix::net::SendFlags::empty()).unwrap();
    }
    let mut ws = ws;
    ws.iter_mut().for_each(Watched::forget_own);
    let r = b.recv::<PoolMessage>();
    assert!(is_protocol(&r, "truncated"), "{r:?}");
    assert!(ws.iter().all(Watched::closed), "all 16 fds must be closed");
    // The channel still works, and refuses what it cannot send.
    a.send(&frame(1, 2, 3)).unwrap();
    assert_eq!(b.recv::<PoolMessage>().unwrap().msg, frame(1, 2, 3));
    assert!(matches!(a.send_bytes(&[], &[]), Err(Error::InvalidArgument { .. })));
    let w = Watched::new();
    assert!(matches!(a.send_bytes(b"x", &[w.fd(); 5]), Err(Error::InvalidArgument { .. })));
}

#[test]
fn a_peer_that_hangs_up_is_peer_gone_even_mid_stream() {
    // A receiver blocked in recv when the peer goes.
    let (a, b) = pair();
    std::thread::scope(|s| {
        let waiter = s.spawn(|| b.recv::<PoolMessage>());
        drop(a);
        assert!(matches!(waiter.join().unwrap(), Err(Error::PeerGone { channel }) if channel == "test"));
    });
    assert!(matches!(b.send(&frame(0, 0, 0)), Err(Error::PeerGone { .. })), "sending to a peer that is gone");
    // Half a message, then the hang-up: the half is refused, then the hang-up shows.
    let (a, b) = pair();
    a.send_bytes(&frame(0, 0, 0).to_bytes()[..16], &[]).unwrap();
    a.send(&frame(1, 1, 1)).unwrap();
    drop(a);
    assert!(is_protocol(&b.recv::<PoolMessage>(), "16 bytes"));
    assert_eq!(b.recv::<PoolMessage>().unwrap().msg, frame(1, 1, 1), "what was sent before the hang-up arrives");
    for _ in 0..2 {
        assert!(matches!(b.recv::<PoolMessage>(), Err(Error::PeerGone { .. })));
    }
}

#[test]
fn only_seqpacket_sockets_become_channels() {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let (s, _t) = rustix::net::socketpair(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC, None).unwrap();
    let e = Channel::from_fd(s, "stream").unwrap_err();
    assert!(e.to_string().contains("not SOCK_SEQPACKET"), "{e}");
    let (r, _w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
    let e = Channel::from_fd(r, "pipe").unwrap_err();
    assert!(e.to_string().contains("pipe: the fd is not a socket"), "{e}");
    let (x, _y) = super::packet::seqpacket_pair().unwrap();
    assert_eq!(Channel::from_fd(x, "ok").unwrap().name(), "ok");
}

#[test]
fn several_threads_send_and_receive_on_one_channel_and_every_message_arrives_whole() {
    let (a, b) = pair();
    const SENDERS: u32 = 4;
    const EACH: u64 = 300;
    const RECEIVERS: usize = 3;
    let garbage_seen = AtomicUsize::new(0);
    let mut got: Vec<(u32, u64, u64)> = std::thread::scope(|s| {
        let receivers: Vec<_> = (0..RECEIVERS)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        match b.recv::<PoolMessage>() {
                            Ok(Received { msg: PoolMessage::Frame(f), fd: None }) => mine.push((f.id, f.seq, f.len)),
                            Ok(Received { msg: PoolMessage::End { .. }, .. }) => return mine,
                            Err(Error::Protocol { .. }) => {
                                garbage_seen.fetch_add(1, Ordering::Relaxed);
                            }
                            other => panic!("{other:?}"),
                        }
                    }
                })
            })
            .collect();
        let senders: Vec<_> = (0..SENDERS)
            .map(|id| {
                let a = &a;
                s.spawn(move || {
                    for seq in 0..EACH {
                        a.send(&frame(id, seq, u64::from(id) << 32 | seq)).unwrap();
                        if seq % 50 == 0 {
                            a.send_bytes(&[0x5a; 32], &[]).unwrap();
                        }
                    }
                })
            })
            .collect();
        senders.into_iter().for_each(|t| t.join().unwrap());
        for _ in 0..RECEIVERS {
            a.send(&PoolMessage::End { count: 0 }).unwrap();
        }
        receivers.into_iter().flat_map(|t| t.join().unwrap()).collect()
    });
    got.sort_unstable();
    let want: Vec<_> =
        (0..SENDERS).flat_map(|id| (0..EACH).map(move |seq| (id, seq, u64::from(id) << 32 | seq))).collect();
    assert_eq!(got, want, "every message exactly once, intact");
    assert_eq!(garbage_seen.load(Ordering::Relaxed), SENDERS as usize * (EACH as usize).div_ceil(50));
}

/// Owner -> forwarder -> last borrower -> owner, each on its own thread; each stage checks
/// and rewrites the first word of every frame.
#[test]
fn pool_buffers_go_round_three_threads_and_return_to_their_owner() {
    const FRAMES: u64 = 60;
    const LEN: usize = 3;
    let (to_mid, mid_in) = Channel::pair("owner->mid").unwrap();
    let (mid_out, last_in) = Channel::pair("mid->last").unwrap();
    let (ret, owner_ret) = Channel::pair("last->owner").unwrap();
    let expect = Expect::new(SegmentKind::Unified).fd_kind(FdKind::Memfd).min_len(4096);
    let word = |seg: &Segment| {
        let mut w = [0u8; 8];
        seg.cpu_access(Access::Read).unwrap().read(0, &mut w).unwrap();
        u64::from_le_bytes(w)
    };
    let put = |seg: &Segment, v: u64| seg.cpu_access(Access::Write).unwrap().write(0, &v.to_le_bytes()).unwrap();
    std::thread::scope(|s| {
        s.spawn(move || {
            let mut b = PoolBorrower::new(LEN, expect).unwrap();
            let mut out = Peer::new(mid_out);
            let mut fds = 0;
            while let Incoming::Frame { frame, first } = b.recv(&mid_in).unwrap() {
                let seg = b.segment(frame.id).unwrap();
                assert_eq!(word(seg), frame.seq * 10);
                put(seg, frame.seq * 10 + 1);
                fds += u64::from(b.forward(&mut out, frame).unwrap());
                assert!(!first || fds > 0);
            }
            assert_eq!(fds, LEN as u64, "each buffer's fd crosses each hop once");
            out.send_end(FRAMES).unwrap();
        });
        s.spawn(move || {
            let mut b = PoolBorrower::new(LEN, expect).unwrap();
            let mut n = 0;
            while let Incoming::Frame { frame, .. } = b.recv(&last_in).unwrap() {
                assert_eq!(word(b.segment(frame.id).unwrap()), frame.seq * 10 + 1);
                b.give_back(&ret, frame).unwrap();
                n += 1;
            }
            assert_eq!(n, FRAMES);
        });
        let mut owner = PoolOwner::allocate(&ShmemSource::new(), LEN, 4096).unwrap();
        let mut to = Peer::new(to_mid);
        for seq in 0..FRAMES {
            let id = match owner.take() {
                Some(id) => id,
                None => {
                    owner.recv_return(&owner_ret).unwrap();
                    owner.take().unwrap()
                }
            };
            put(owner.buffer(id).unwrap(), seq * 10);
            owner.send(&mut to, Frame { id, seq, len: 4096 }).unwrap();
        }
        while owner.ledger().out_count() > 0 {
            owner.recv_return(&owner_ret).unwrap();
        }
        to.send_end(FRAMES).unwrap();
        assert_eq!(owner.ledger().free_count(), LEN);
        assert_eq!(to.channel().fds_sent(), LEN as u64);
        assert!((0..LEN as u32).all(|id| to.has_buffer(id)));
    });
}

#[test]
fn the_owner_refuses_bogus_and_double_returns() {
    let (to, _mid) = pair();
    let (hostile, from) = pair();
    let mut owner = PoolOwner::allocate(&ShmemSource::new(), 2, 4096).unwrap();
    let mut peer = Peer::new(to);
    let id = owner.take().unwrap();
    assert_eq!(id, 0);
    // Not taken, too long, outside the pool: refused before anything is sent.
    assert!(owner.send(&mut peer, Frame { id: 1, seq: 0, len: 8 }).is_err());
    assert!(owner.send(&mut peer, Frame { id, seq: 0, len: 4097 }).is_err());
    assert!(owner.send(&mut peer, Frame { id: 9, seq: 0, len: 8 }).is_err());
    assert!(owner.send(&mut peer, Frame { id, seq: 5, len: 4096 }).unwrap(), "the fd goes the first time");
    assert!(owner.send(&mut peer, Frame { id, seq: 6, len: 8 }).is_err(), "buffer 0 is out");
    let w = Watched::new();
    let bogus: [(PoolMessage, bool, &str); 6] = [
        (PoolMessage::Return { id: 7, seq: 5 }, false, "outside the pool of 2"),
        (PoolMessage::Return { id: 1, seq: 5 }, false, "buffer 1 frame 5, which is not out"),
        (PoolMessage::Return { id: 0, seq: 4 }, false, "with frame 4, but it is out with frame 5"),
        (frame(0, 5, 8), false, "expected a return"),
        (PoolMessage::End { count: 1 }, false, "expected a return"),
        (PoolMessage::Return { id: 0, seq: 5 }, true, "a return carried an fd"),
    ];
    for (msg, with_fd, why) in bogus {
        if with_fd {
            hostile.send_with_fd(&msg, w.fd()).unwrap();
        } else {
            hostile.send(&msg).unwrap();
        }
        let r = owner.recv_return(&from);
        assert!(is_protocol(&r, why), "{msg:?}: {r:?}");
        assert_eq!(
            (owner.ledger().out_with(0), owner.ledger().free_count()),
            (Some(5), 1),
            "{msg:?} changed the ledger"
        );
    }
    hostile.send(&PoolMessage::Return { id: 0, seq: 5 }).unwrap();
    assert_eq!(owner.recv_return(&from).unwrap(), (0, 5));
    hostile.send(&PoolMessage::Return { id: 0, seq: 5 }).unwrap();
    assert!(is_protocol(&owner.recv_return(&from), "which is not out"), "a double return");
    assert_eq!(owner.ledger().free_count(), 2);
    // A buffer goes out again without its fd: the peer has it.
    let id = owner.take().unwrap();
    assert!(!owner.send(&mut peer, Frame { id, seq: 7, len: 1 }).unwrap());
    drop(hostile);
    assert!(matches!(owner.recv_return(&from), Err(Error::PeerGone { .. })));
}

/// A borrower that dies with buffers out: once the owner knows every peer is gone it takes
/// them back, they go out again (to a new peer, with their fds), and a late return of a
/// reclaimed buffer is refused.
#[test]
fn buffers_out_with_a_dead_peer_are_reclaimed_and_go_out_again() {
    let mut owner = PoolOwner::allocate(&ShmemSource::new(), 3, 4096).unwrap();
    let (to, gone) = pair();
    let (late, from) = pair();
    let mut peer = Peer::new(to);
    for seq in 0..3 {
        let id = owner.take().unwrap();
        owner.send(&mut peer, Frame { id, seq, len: 8 }).unwrap();
    }
    assert_eq!(owner.take(), None);
    late.send(&PoolMessage::Return { id: 1, seq: 1 }).unwrap();
    assert_eq!(owner.recv_return(&from).unwrap(), (1, 1));
    drop(gone);
    let mut back = owner.reclaim_out();
    back.sort_unstable();
    assert_eq!(back, vec![0, 2]);
    assert_eq!((owner.ledger().free_count(), owner.ledger().out_count()), (3, 0));
    assert!(owner.reclaim_out().is_empty(), "nothing is out any more");
    late.send(&PoolMessage::Return { id: 2, seq: 2 }).unwrap();
    assert!(is_protocol(&owner.recv_return(&from), "which is not out"), "a late return of a reclaimed buffer");
    // Taken lowest id first, and each goes to the new peer with its fd.
    let (to, _rx) = pair();
    let mut fresh = Peer::new(to);
    for want in 0..3 {
        let id = owner.take().unwrap();
        assert_eq!(id, want);
        assert!(owner.send(&mut fresh, Frame { id, seq: 10 + u64::from(id), len: 8 }).unwrap(), "the fd goes again");
    }
}

#[test]
fn the_borrower_refuses_frames_that_break_the_protocol() {
    let (a, b) = pair();
    let mut borrower = PoolBorrower::new(2, Expect::new(SegmentKind::Unified).fd_kind(FdKind::Memfd)).unwrap();
    let name = "share-test-borrowed";
    let buf = memfd_named(name, 4096);
    let w = Watched::new();
    let cases: [(PoolMessage, Option<std::os::fd::BorrowedFd<'_>>, &str); 6] = [
        (frame(0, 0, 8), None, "frame 0 uses buffer 0 before its fd came"),
        (frame(2, 0, 8), Some(buf.as_fd()), "buffer id 2 outside the pool of 2"),
        (frame(0, 0, 8), Some(w.fd()), "buffer 0: fd is neither a dma-buf nor a sealable memfd"),
        (frame(0, 0, 4097), Some(buf.as_fd()), "frame of 4097 bytes in buffer 0 of 4096 bytes"),
        (PoolMessage::Return { id: 0, seq: 0 }, None, "a return message on a frame channel"),
        (PoolMessage::End { count: 0 }, Some(buf.as_fd()), "an end message with an fd"),
    ];
    for (msg, fd, why) in cases {
        match fd {
            Some(fd) => a.send_with_fd(&msg, fd).unwrap(),
            None => a.send(&msg).unwrap(),
        }
        let r = borrower.recv(&b);
        assert!(is_protocol(&r, why), "{msg:?}: {r:?}");
    }
    drop(w);
    // A good first frame, then the same buffer again while it is here, then its fd twice.
    a.send_with_fd(&frame(1, 0, 4096), buf.as_fd()).unwrap();
    let Incoming::Frame { frame: f, first: true } = borrower.recv(&b).unwrap() else { panic!() };
    a.send(&frame(1, 1, 8)).unwrap();
    assert!(is_protocol(&borrower.recv(&b), "frame 1 in buffer 1, which is still here"));
    let (back, owner_side) = pair();
    borrower.give_back(&back, f).unwrap();
    assert!(borrower.give_back(&back, f).is_err(), "a buffer given back is no longer here");
    assert_eq!(owner_side.recv::<PoolMessage>().unwrap().msg, PoolMessage::Return { id: 1, seq: 0 });
    a.send_with_fd(&frame(1, 1, 8), buf.as_fd()).unwrap();
    assert!(is_protocol(&borrower.recv(&b), "buffer 1's fd came twice"));
    a.send(&frame(1, 2, 8)).unwrap();
    assert!(matches!(borrower.recv(&b), Ok(Incoming::Frame { first: false, .. })));
    drop(buf);
    // Only the borrower's cached segment holds the memfd now; refused copies are closed.
    assert_eq!(memfds_named(name), 1);
    drop(borrower);
    assert_eq!(memfds_named(name), 0);
}

#[test]
fn the_ledger_tracks_every_id() {
    assert!(Ledger::new(0).is_err() && Ledger::new(MAX_BUFFERS + 1).is_err());
    let mut l = Ledger::new(3).unwrap();
    assert_eq!((l.take(), l.take()), (Some(0), Some(1)));
    l.put_back(0).unwrap();
    assert!(l.put_back(0).is_err(), "put back twice");
    assert!(l.lend(0, 1).is_err(), "lent without being taken");
    l.lend(1, 9).unwrap();
    assert_eq!((l.out_with(1), l.out_count(), l.free_count()), (Some(9), 1, 2));
    assert!(l.accept_return(1, 8).is_err() && l.accept_return(5, 9).is_err());
    l.accept_return(1, 9).unwrap();
    assert!(l.accept_return(1, 9).is_err());
    assert_eq!(l.free_count(), 3);
}
