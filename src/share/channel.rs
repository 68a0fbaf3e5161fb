//! [`Channel`]: one end of a Unix `SOCK_SEQPACKET` socket that carries small typed messages
//! ([`Wire`]) and, with them, fds (`SCM_RIGHTS`): segments, ranges of segments, or any fd.
//!
//! Every message is one packet, so a message arrives whole or not at all; what arrives is
//! checked before anything else sees it. A packet of the wrong size, with more fds than the
//! message allows, or truncated is refused as [`Error::Protocol`] and its fds are closed (they
//! are [`OwnedFd`]s from the moment they are received); end of file, or a peer that reset the
//! socket, is [`Error::PeerGone`]. A received segment is rebuilt with [`Segment::import`]
//! (its length from the fd, never from the sender) and checked against an [`Expect`]: its fd
//! kind, its minimum length, the range named with it. Nothing a peer sends can make this side
//! panic.
//!
//! A `Channel` is `Send + Sync` and its methods take `&self`: several threads may send, or
//! receive, on one end at once (each packet goes to exactly one receiver, whole).

use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::io::Errno;

use super::packet::{self, MAX_FDS, Packet};
use crate::error::{Error, Result};
use crate::segment::{Access, FdKind, Segment, SegmentKind};
use crate::view::CpuView;

/// The longest message [`Wire::LEN`] may be, in bytes.
pub const MAX_MESSAGE: usize = 256;

/// A message of fixed size that a [`Channel`] carries: how it is laid out in bytes.
///
/// `decode` sees exactly `LEN` bytes (the channel refuses any other size first) and returns
/// why it refuses them; the channel turns that into [`Error::Protocol`]. It must not panic on
/// any input.
pub trait Wire: Sized {
    /// The encoded size, 1 to [`MAX_MESSAGE`] bytes.
    const LEN: usize;
    /// Writes the message into `out` (`LEN` bytes).
    fn encode(&self, out: &mut [u8]);
    /// Reads a message from `bytes` (`LEN` bytes), or says what is wrong with them.
    fn decode(bytes: &[u8]) -> std::result::Result<Self, String>;
}

/// Raw bytes as a message (no checks beyond the size).
impl<const N: usize> Wire for [u8; N] {
    const LEN: usize = N;
    fn encode(&self, out: &mut [u8]) {
        out.copy_from_slice(self);
    }
    fn decode(bytes: &[u8]) -> std::result::Result<Self, String> {
        bytes.try_into().map_err(|_| format!("{} bytes, expected {N}", bytes.len()))
    }
}

/// A message that names a byte range of the segment sent with it: `offset` and `len` (two
/// little-endian u64) before the message itself. What [`Channel::send_range`] sends and
/// [`Channel::recv_range`] checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ranged<M> {
    /// Where the range starts in the segment.
    pub offset: u64,
    /// Its length.
    pub len: u64,
    /// The message sent with it.
    pub meta: M,
}

impl<M: Wire> Wire for Ranged<M> {
    const LEN: usize = 16 + M::LEN;
    fn encode(&self, out: &mut [u8]) {
        out[..8].copy_from_slice(&self.offset.to_le_bytes());
        out[8..16].copy_from_slice(&self.len.to_le_bytes());
        self.meta.encode(&mut out[16..]);
    }
    fn decode(bytes: &[u8]) -> std::result::Result<Self, String> {
        let word = |at: usize| bytes.get(at..at + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
        match (word(0), word(8)) {
            (Some(offset), Some(len)) => Ok(Self { offset, len, meta: M::decode(&bytes[16..])? }),
            _ => Err(format!("{} bytes, too short for a range", bytes.len())),
        }
    }
}

/// What a received fd must be to become a [`Segment`]: the kind the segment gets (the fd does
/// not say what its memory is for), and optionally its fd kind and a minimum length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expect {
    /// The kind the imported segment is given.
    pub kind: SegmentKind,
    /// The fd kind it must have (`None`: either).
    pub fd_kind: Option<FdKind>,
    /// The fewest bytes it may hold.
    pub min_len: usize,
}

impl Expect {
    /// A segment of this kind, any fd kind, any length.
    pub fn new(kind: SegmentKind) -> Self {
        Self { kind, fd_kind: None, min_len: 0 }
    }

    /// Requires this fd kind.
    pub fn fd_kind(mut self, fd_kind: FdKind) -> Self {
        self.fd_kind = Some(fd_kind);
        self
    }

    /// Requires at least `min_len` bytes.
    pub fn min_len(mut self, min_len: usize) -> Self {
        self.min_len = min_len;
        self
    }

    /// Imports `fd` and checks it; a refusal is the peer's fault ([`Error::Protocol`] on
    /// `channel`, saying what `what` is: e.g. `buffer 3`). The fd stays the caller's (it is
    /// duplicated), so the caller's copy is closed when it drops, whatever happens here.
    pub(crate) fn import(&self, fd: &impl AsFd, what: &dyn fmt::Display, channel: &str) -> Result<Segment> {
        let protocol = |why: String| Error::Protocol { channel: channel.to_owned(), why };
        let seg = Segment::import(fd, self.kind).map_err(|e| match e {
            Error::BadImport { reason } => protocol(format!("{what}: {reason}")),
            // The import checked the fd and took the size from it, so a mapping that fails now
            // is the sender's doing (a sparse memfd of exabytes, an fd opened write-only), not a
            // lack of memory here: the peer's protocol error, with the size and the kernel's
            // answer. (Under RLIMIT_AS the failure is a ResourceLimit and stays one.)
            Error::Io { op, source } if op.starts_with("mmap") => {
                let size = rustix::fs::fstat(fd).map_or_else(|_| "?".into(), |st| st.st_size.to_string());
                protocol(format!("{what}: a buffer of {size} bytes that cannot be mapped ({source})"))
            }
            other => other,
        })?;
        if let Some(want) = self.fd_kind {
            if seg.fd_kind() != want {
                return Err(protocol(format!("{what} is a {:?}, expected a {want:?}", seg.fd_kind())));
            }
        }
        if seg.len() < self.min_len {
            return Err(protocol(format!("{what} holds {} bytes, fewer than {}", seg.len(), self.min_len)));
        }
        Ok(seg)
    }
}

/// A received message and the fd that came with it, if any.
#[derive(Debug)]
pub struct Received<M> {
    /// The message.
    pub msg: M,
    /// The fd it carried (at most one).
    pub fd: Option<OwnedFd>,
}

/// A byte range of a received segment, checked to lie inside it.
#[derive(Debug)]
pub struct SharedRange {
    segment: Segment,
    offset: usize,
    len: usize,
}

impl SharedRange {
    /// The whole segment.
    pub fn segment(&self) -> &Segment {
        &self.segment
    }

    /// Where the range starts.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// CPU access to the range, and only to it (a [`CpuView`] of `[offset, offset + len)`).
    pub fn cpu_access(&self, access: Access) -> Result<CpuView<'_>> {
        CpuView::new(&self.segment, self.offset, self.len, access)
    }

    /// The segment, without the range.
    pub fn into_segment(self) -> Segment {
        self.segment
    }
}

/// One end of a `SOCK_SEQPACKET` Unix socket that carries [`Wire`] messages and fds.
#[derive(Debug)]
pub struct Channel {
    fd: OwnedFd,
    name: String,
    bytes_sent: AtomicU64,
    fds_sent: AtomicU64,
    /// The send timeout set ([`Channel::set_send_timeout`]), in milliseconds (0: none).
    send_timeout_ms: AtomicU64,
}

const _: () = {
    const fn shareable<T: Send + Sync>() {}
    shareable::<Channel>();
};

impl Channel {
    /// A connected pair of channels (a close-on-exec `socketpair`), both called `name`.
    pub fn pair(name: &str) -> Result<(Channel, Channel)> {
        let (a, b) = packet::seqpacket_pair().map_err(Error::io_rustix("socketpair(AF_UNIX, SOCK_SEQPACKET)"))?;
        Ok((Self::wrap(a, name), Self::wrap(b, name)))
    }

    /// A channel over an fd received from elsewhere (inherited, passed by a parent). It must
    /// be a connected `SOCK_SEQPACKET` socket: a stream socket would split and merge messages,
    /// and nothing ever arrives on a socket that is not connected (a listening one, say).
    /// `name` appears in every error of the channel. The channel turns off `SO_PASSCRED` on
    /// the socket (as a service manager may set it): the credentials it adds to every packet
    /// would take the room of the fds, and every message with an fd would come truncated.
    pub fn from_fd(fd: OwnedFd, name: &str) -> Result<Channel> {
        let invalid = |why: &str| Error::InvalidArgument { what: format!("{name}: {why}") };
        match packet::is_seqpacket(fd.as_fd()) {
            Ok(true) => {}
            Ok(false) => return Err(invalid("the fd is a socket, but not SOCK_SEQPACKET")),
            Err(Errno::NOTSOCK) => return Err(invalid("the fd is not a socket")),
            Err(e) => return Err(Error::io_rustix("getsockopt(SO_TYPE)")(e)),
        }
        match packet::prepare_inherited(fd.as_fd()) {
            Ok(()) => Ok(Self::wrap(fd, name)),
            Err(Errno::NOTCONN) => Err(invalid("the socket is not connected (connect it, or accept on it, first)")),
            Err(e) => Err(Error::io_rustix("getpeername, setsockopt(SO_PASSCRED) on a share channel")(e)),
        }
    }

    /// Wraps a connected socket from [`super::packet::accept`] or
    /// [`super::packet::connect_abstract`].
    pub(crate) fn from_connected(fd: OwnedFd, name: &str) -> Self {
        Self::wrap(fd, name)
    }

    fn wrap(fd: OwnedFd, name: &str) -> Self {
        Self {
            fd,
            name: name.to_owned(),
            bytes_sent: AtomicU64::new(0),
            fds_sent: AtomicU64::new(0),
            send_timeout_ms: AtomicU64::new(0),
        }
    }

    /// The socket, to hand to another process (as a child's stdin, or sent over another
    /// channel); the other process makes it a channel again with [`Channel::from_fd`].
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    /// The name given at creation, e.g. `producer->transform`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Renames the channel (its errors carry the new name).
    pub fn with_name(mut self, name: &str) -> Self {
        self.name = name.to_owned();
        self
    }

    /// Bytes of messages this end has sent.
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(Ordering::Relaxed)
    }

    /// fds this end has sent.
    pub fn fds_sent(&self) -> u64 {
        self.fds_sent.load(Ordering::Relaxed)
    }

    /// An [`Error::Protocol`] on this channel: for checks a protocol makes above the channel
    /// (an id out of range, a message out of turn).
    pub fn protocol_error(&self, why: impl Into<String>) -> Error {
        Error::Protocol { channel: self.name.clone(), why: why.into() }
    }

    /// Sends a message without fds.
    pub fn send<M: Wire>(&self, msg: &M) -> Result<()> {
        self.send_msg(msg, &[])
    }

    /// Sends a message with one fd (any fd: a segment's, a sync_file, a socket).
    pub fn send_with_fd<M: Wire>(&self, msg: &M, fd: BorrowedFd<'_>) -> Result<()> {
        self.send_msg(msg, &[fd])
    }

    /// Sends a message with a segment's fd; the receiver rebuilds the segment with
    /// [`Channel::recv_segment`].
    pub fn send_segment<M: Wire>(&self, msg: &M, segment: &Segment) -> Result<()> {
        self.send_msg(msg, &[segment.as_fd()])
    }

    /// Sends `[offset, offset + len)` of a segment: its fd, the range and the message (as a
    /// [`Ranged`]); the receiver gets a [`SharedRange`] with [`Channel::recv_range`]. A range
    /// outside the segment is refused here ([`Error::OutOfBounds`]) and nothing is sent.
    pub fn send_range<M: Wire>(&self, msg: M, segment: &Segment, offset: usize, len: usize) -> Result<()> {
        let size = segment.len();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::OutOfBounds { offset, len, size });
        }
        self.send_msg(&Ranged { offset: offset as u64, len: len as u64, meta: msg }, &[segment.as_fd()])
    }

    fn send_msg<M: Wire>(&self, msg: &M, fds: &[BorrowedFd<'_>]) -> Result<()> {
        const { assert!(M::LEN > 0 && M::LEN <= MAX_MESSAGE, "Wire::LEN must be 1 to MAX_MESSAGE") };
        let mut buf = [0u8; MAX_MESSAGE];
        msg.encode(&mut buf[..M::LEN]);
        self.send_bytes(&buf[..M::LEN], fds)
    }

    /// Sends `bytes` as one packet with `fds` (at most 4): for protocols of their own above a
    /// channel (text, a setup message with several fds). Empty packets are refused: the
    /// receiver could not tell one from a hang-up.
    pub fn send_bytes(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        if bytes.is_empty() || fds.len() > MAX_FDS {
            return Err(Error::InvalidArgument {
                what: format!(
                    "a packet of {} bytes with {} fds (1 byte or more, at most {MAX_FDS} fds)",
                    bytes.len(),
                    fds.len()
                ),
            });
        }
        packet::send(self.fd.as_fd(), bytes, fds).map_err(|e| self.io_error("sendmsg on a share channel", e))?;
        self.bytes_sent.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        self.fds_sent.fetch_add(fds.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Receives one message and its fd, if it carried one. A packet of the wrong size, with
    /// more than one fd, or truncated is refused and its fds closed.
    pub fn recv<M: Wire>(&self) -> Result<Received<M>> {
        const { assert!(M::LEN > 0 && M::LEN <= MAX_MESSAGE, "Wire::LEN must be 1 to MAX_MESSAGE") };
        let mut buf = [0u8; MAX_MESSAGE + 1];
        // One byte more than the message, so that an oversized packet shows.
        let (len, mut fds) = self.recv_bytes(&mut buf[..M::LEN + 1])?;
        if fds.len() > 1 {
            return Err(self.protocol_error(format!("{} fds attached to one message", fds.len())));
        }
        if len != M::LEN {
            return Err(self.protocol_error(format!("{len} bytes, expected {}", M::LEN)));
        }
        let msg = M::decode(&buf[..len]).map_err(|why| self.protocol_error(why))?;
        Ok(Received { msg, fd: fds.pop() })
    }

    /// Receives a message that must carry a segment's fd, and rebuilds the segment as
    /// `expect` says (a missing fd, or one that is not what `expect` asks, is refused).
    pub fn recv_segment<M: Wire>(&self, expect: &Expect) -> Result<(M, Segment)> {
        let Received { msg, fd } = self.recv::<M>()?;
        let fd = fd.ok_or_else(|| self.protocol_error("a segment message without its fd"))?;
        let seg = expect.import(&fd, &"the segment", &self.name)?;
        Ok((msg, seg))
    }

    /// Receives what [`Channel::send_range`] sent: the message and the range of the segment,
    /// checked to lie inside the segment (as the receiver sees its length).
    pub fn recv_range<M: Wire>(&self, expect: &Expect) -> Result<(M, SharedRange)> {
        let (Ranged { offset, len, meta }, segment) = self.recv_segment::<Ranged<M>>(expect)?;
        let size = segment.len() as u64;
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(self.protocol_error(format!("range {offset}+{len} outside a {size}-byte segment")));
        }
        // Both fit in usize: they lie inside a mapped segment.
        Ok((meta, SharedRange { segment, offset: offset as usize, len: len as usize }))
    }

    /// Receives one packet into `buf` and the fds it carried (a handful at most): for protocols of
    /// their own above a channel. End of file is [`Error::PeerGone`]; a packet longer than
    /// `buf`, or with more fds than fit, or empty, is refused ([`Error::Protocol`]) and its fds
    /// closed.
    pub fn recv_bytes(&self, buf: &mut [u8]) -> Result<(usize, Vec<OwnedFd>)> {
        match packet::recv(self.fd.as_fd(), buf).map_err(|e| self.io_error("recvmsg on a share channel", e))? {
            Packet::Eof => Err(Error::PeerGone { channel: self.name.clone() }),
            Packet::Empty => Err(self.protocol_error("an empty packet (0 bytes, no fds) from a peer still connected")),
            Packet::Data { truncated: true, .. } => Err(self.protocol_error(format!(
                "message or its fds truncated (more than {} bytes, or too many fds)",
                buf.len()
            ))),
            Packet::Data { len, fds, truncated: false } => Ok((len, fds)),
        }
    }

    /// Makes a send give up after `timeout` while the peer's receive buffer stays full
    /// (`SO_SNDTIMEO`): [`Error::Timeout`] instead of waiting for a peer that never reads.
    pub fn set_send_timeout(&self, timeout: std::time::Duration) -> Result<()> {
        rustix::net::sockopt::set_socket_timeout(&self.fd, rustix::net::sockopt::Timeout::Send, Some(timeout))
            .map_err(Error::io_rustix("setsockopt(SO_SNDTIMEO) on a share channel"))?;
        self.send_timeout_ms.store(timeout.as_millis().max(1) as u64, Ordering::Relaxed);
        Ok(())
    }

    fn io_error(&self, op: &'static str, e: Errno) -> Error {
        let timeout = self.send_timeout_ms.load(Ordering::Relaxed);
        match e {
            Errno::PIPE | Errno::CONNRESET => Error::PeerGone { channel: self.name.clone() },
            Errno::AGAIN if timeout > 0 => Error::Timeout {
                what: "the peer to take a packet (it reads nothing; its receive buffer stayed full)",
                waited: std::time::Duration::from_millis(timeout),
            },
            e => Error::io_rustix(op)(e),
        }
    }
}

impl AsFd for Channel {
    /// The socket (to poll it; sending or receiving on it directly bypasses the checks).
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
