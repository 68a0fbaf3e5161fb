//! One packet of a `SOCK_SEQPACKET` Unix socket with its `SCM_RIGHTS` fds: the only place
//! that calls `sendmsg`/`recvmsg`. No unsafe here: rustix owns the control-message encoding,
//! and every received fd is an [`OwnedFd`] (close-on-exec) from the moment it exists.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::io::Errno;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};

/// The most fds one packet may carry. The receive buffer holds this many and its alignment
/// slack (a couple more): a packet with more than fit is received truncated (`MSG_CTRUNC`)
/// and the kernel closes the fds that did not fit, so a hostile peer cannot make this process
/// hold more than a handful of its fds per packet (and those that come are `OwnedFd`s).
pub(crate) const MAX_FDS: usize = 4;

/// A received packet.
#[derive(Debug)]
pub(crate) enum Packet {
    /// The peer closed its end (a zero-length read with no fds, the socket shut down).
    Eof,
    /// A zero-length packet with no fds from a peer that is still there.
    Empty,
    /// Bytes and fds.
    Data {
        /// Bytes received (at most the buffer's length).
        len: usize,
        /// The fds it carried, already owned.
        fds: Vec<OwnedFd>,
        /// The bytes or the fds did not fit (the kernel dropped and closed the excess).
        truncated: bool,
    },
}

/// A connected pair of close-on-exec `SOCK_SEQPACKET` Unix sockets.
pub(crate) fn seqpacket_pair() -> rustix::io::Result<(OwnedFd, OwnedFd)> {
    rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
}

/// A close-on-exec `SOCK_SEQPACKET` Unix socket listening on the abstract name `name` (no
/// file: it goes with the process).
pub(crate) fn listen_abstract(name: &[u8]) -> rustix::io::Result<OwnedFd> {
    let fd = rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
    rustix::net::bind(&fd, &rustix::net::SocketAddrUnix::new_abstract_name(name)?)?;
    rustix::net::listen(&fd, 64)?;
    Ok(fd)
}

/// The next connection on a listening socket (close-on-exec), and its peer's user id.
pub(crate) fn accept(listener: BorrowedFd<'_>) -> rustix::io::Result<(OwnedFd, u32)> {
    let fd = rustix::net::accept_with(listener, SocketFlags::CLOEXEC)?;
    let uid = rustix::net::sockopt::socket_peercred(&fd)?.uid.as_raw();
    Ok((fd, uid))
}

/// A close-on-exec `SOCK_SEQPACKET` socket connected to the abstract name `name`, and the
/// listening peer's user id. A listener whose queue stays full makes it fail with `EAGAIN`
/// after `timeout` (`SO_SNDTIMEO` bounds a Unix socket's connect).
pub(crate) fn connect_abstract(name: &[u8], timeout: std::time::Duration) -> rustix::io::Result<(OwnedFd, u32)> {
    let fd = rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
    rustix::net::sockopt::set_socket_timeout(&fd, rustix::net::sockopt::Timeout::Send, Some(timeout))?;
    rustix::net::connect(&fd, &rustix::net::SocketAddrUnix::new_abstract_name(name)?)?;
    let uid = rustix::net::sockopt::socket_peercred(&fd)?.uid.as_raw();
    Ok((fd, uid))
}

/// Whether `fd` is a `SOCK_SEQPACKET` socket (`ENOTSOCK` if it is no socket at all).
pub(crate) fn is_seqpacket(fd: BorrowedFd<'_>) -> rustix::io::Result<bool> {
    Ok(rustix::net::sockopt::socket_type(fd)? == SocketType::SEQPACKET)
}

/// Readies a seqpacket socket made elsewhere for [`recv`]: `ENOTCONN` if it is not connected;
/// otherwise turns off `SO_PASSCRED` (credentials in every packet would crowd the fds out of
/// the control buffer, which holds [`MAX_FDS`] fds and no more).
pub(crate) fn prepare_inherited(fd: BorrowedFd<'_>) -> rustix::io::Result<()> {
    rustix::net::getpeername(fd)?;
    if rustix::net::sockopt::socket_passcred(fd)? {
        rustix::net::sockopt::set_socket_passcred(fd, false)?;
    }
    Ok(())
}

/// Sends one packet with `fds` attached. Never raises `SIGPIPE` (a peer that is gone is
/// `EPIPE`). A short send cannot happen on a seqpacket socket; it is reported as `EMSGSIZE`.
pub(crate) fn send(sock: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>]) -> rustix::io::Result<()> {
    if fds.len() > MAX_FDS {
        return Err(Errno::TOOMANYREFS);
    }
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(Errno::TOOMANYREFS);
    }
    loop {
        match rustix::net::sendmsg(sock, &[IoSlice::new(data)], &mut control, SendFlags::NOSIGNAL) {
            Ok(n) if n == data.len() => return Ok(()),
            Ok(_) => return Err(Errno::MSGSIZE),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Receives one packet into `buf`. A packet longer than `buf` comes back `truncated` (make
/// `buf` one byte longer than the longest valid packet to see an oversized one).
pub(crate) fn recv(sock: BorrowedFd<'_>, buf: &mut [u8]) -> rustix::io::Result<Packet> {
    recv_with(sock, buf, RecvFlags::CMSG_CLOEXEC)
}

/// [`recv`] that does not wait: `EAGAIN` if no packet is there (for a socket whose other end
/// other processes may hold, where a packet `poll` announced may be gone by the time it is
/// read).
pub(crate) fn recv_now(sock: BorrowedFd<'_>, buf: &mut [u8]) -> rustix::io::Result<Packet> {
    recv_with(sock, buf, RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT)
}

fn recv_with(sock: BorrowedFd<'_>, buf: &mut [u8], flags: RecvFlags) -> rustix::io::Result<Packet> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = loop {
        match rustix::net::recvmsg(sock, &mut [IoSliceMut::new(&mut *buf)], &mut control, flags) {
            Err(Errno::INTR) => continue,
            r => break r?,
        }
    };
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = m {
            fds.extend(rights);
        }
    }
    let truncated = msg.flags.intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC);
    if msg.bytes == 0 && fds.is_empty() && !truncated {
        // `recvmsg` says 0 bytes both at end of file and for an empty packet, which any peer
        // may send: only a hang-up leaves the socket shut down for reading. (A peer that
        // sent an empty packet and then hung up is seen as gone: it is.)
        return Ok(if shut_down_for_reading(sock)? { Packet::Eof } else { Packet::Empty });
    }
    Ok(Packet::Data { len: msg.bytes.min(buf.len()), fds, truncated })
}

/// Whether the socket's reading side is shut down (the peer closed its end or shut down its
/// writing side, or this side shut down its reading side): `POLLRDHUP`, without waiting.
fn shut_down_for_reading(sock: BorrowedFd<'_>) -> rustix::io::Result<bool> {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut p = [PollFd::new(&sock, PollFlags::RDHUP)];
    rustix::event::poll(&mut p, Some(&Timespec { tv_sec: 0, tv_nsec: 0 }))?;
    Ok(p[0].revents().intersects(PollFlags::RDHUP | PollFlags::HUP))
}
