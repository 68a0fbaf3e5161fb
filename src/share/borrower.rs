//! [`PoolBorrower`]: the receiving side of a cross-process pool. It caches the segment of
//! each buffer by id (imported from the fd that came with the buffer's first frame), checks
//! every frame against what it has, and sends buffers on ([`PoolBorrower::forward`]) or back
//! to their owner ([`PoolBorrower::give_back`]).

use super::channel::{Channel, Expect, Received};
use super::ledger::check_len;
use super::message::{BufferId, Frame, PoolMessage};
use super::peer::Peer;
use crate::error::{Error, Result};
use crate::segment::Segment;

/// What [`PoolBorrower::recv`] received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Incoming {
    /// A frame, in a buffer now here; `first`: its fd came with it (the buffer's first visit).
    Frame {
        /// The frame.
        frame: Frame,
        /// Whether this was the buffer's first visit.
        first: bool,
    },
    /// The end of the stream.
    End {
        /// Frames the sender says it sent.
        count: u64,
    },
}

/// The borrower's side of a pool of `len` buffers: the segments received so far and which
/// buffers are here now.
#[derive(Debug)]
pub struct PoolBorrower {
    segments: Vec<Option<Segment>>,
    here: Vec<bool>,
    expect: Expect,
}

impl PoolBorrower {
    /// A borrower of a pool of `len` buffers (as agreed with the owner), whose fds must be
    /// what `expect` says.
    pub fn new(len: usize, expect: Expect) -> Result<Self> {
        check_len(len)?;
        Ok(Self { segments: (0..len).map(|_| None).collect(), here: vec![false; len], expect })
    }

    /// Buffer `id`'s segment, once its fd has come.
    pub fn segment(&self, id: BufferId) -> Option<&Segment> {
        self.segments.get(id as usize)?.as_ref()
    }

    /// Whether buffer `id` is here (received, not yet forwarded or given back).
    pub fn is_here(&self, id: BufferId) -> bool {
        self.here.get(id as usize).copied().unwrap_or(false)
    }

    /// Receives the next frame, or the end of the stream. The frame's buffer is imported on
    /// its first visit. Refused ([`Error::Protocol`], the message's fds closed): a return on
    /// a frame channel; an id outside the pool; a buffer used before its fd came, whose fd
    /// comes twice, or that is still here; an fd that is not what [`Expect`] asks; a frame
    /// longer than its buffer; an end with an fd.
    pub fn recv(&mut self, from: &Channel) -> Result<Incoming> {
        let Received { msg, fd } = from.recv::<PoolMessage>()?;
        let frame = match msg {
            PoolMessage::End { count } if fd.is_none() => return Ok(Incoming::End { count }),
            PoolMessage::End { .. } => return Err(from.protocol_error("an end message with an fd")),
            PoolMessage::Return { .. } => return Err(from.protocol_error("a return message on a frame channel")),
            PoolMessage::Frame(frame) => frame,
        };
        let i = frame.id as usize;
        if i >= self.segments.len() {
            return Err(from.protocol_error(format!(
                "buffer id {} outside the pool of {}",
                frame.id,
                self.segments.len()
            )));
        }
        if self.here[i] {
            return Err(from.protocol_error(format!("frame {} in buffer {}, which is still here", frame.seq, frame.id)));
        }
        let (imported, first) = match (&self.segments[i], fd) {
            (None, Some(fd)) => {
                (Some(self.expect.import(&fd, &format_args!("buffer {}", frame.id), from.name())?), true)
            }
            (Some(_), None) => (None, false),
            (None, None) => {
                return Err(
                    from.protocol_error(format!("frame {} uses buffer {} before its fd came", frame.seq, frame.id))
                );
            }
            (Some(_), Some(_)) => return Err(from.protocol_error(format!("buffer {}'s fd came twice", frame.id))),
        };
        let size = imported.as_ref().or(self.segments[i].as_ref()).map_or(0, Segment::len);
        if frame.len > size as u64 {
            // A refused first visit leaves nothing cached: the fd is closed here.
            return Err(
                from.protocol_error(format!("frame of {} bytes in buffer {} of {size} bytes", frame.len, frame.id))
            );
        }
        if imported.is_some() {
            self.segments[i] = imported;
        }
        self.here[i] = true;
        Ok(Incoming::Frame { frame, first })
    }

    /// Sends a frame that is here on to `to` (the next stage), with the buffer's fd if `to`
    /// does not have it yet; the buffer is no longer here. Returns whether the fd went.
    /// If the send fails (the next stage hung up), the buffer is still here: give it back.
    pub fn forward(&mut self, to: &mut Peer, frame: Frame) -> Result<bool> {
        let sent_fd = to.send_frame(frame, self.here_segment(frame.id)?)?;
        self.leave(frame.id);
        Ok(sent_fd)
    }

    /// Returns a frame's buffer to its owner on `to`: the frame is done. If the send fails, the
    /// buffer is still here.
    pub fn give_back(&mut self, to: &Channel, frame: Frame) -> Result<()> {
        self.here_segment(frame.id)?;
        to.send(&PoolMessage::Return { id: frame.id, seq: frame.seq })?;
        self.leave(frame.id);
        Ok(())
    }

    fn here_segment(&self, id: BufferId) -> Result<&Segment> {
        let not_here = || Error::InvalidArgument { what: format!("buffer {id} is not here") };
        if !self.is_here(id) {
            return Err(not_here());
        }
        self.segments[id as usize].as_ref().ok_or_else(not_here)
    }

    /// The buffer has gone. Only after its message went: a buffer whose send failed (the next
    /// stage died) stays here, so it can still go back to its owner instead of being lost to
    /// the pool for good (the owner would wait for it forever).
    fn leave(&mut self, id: BufferId) {
        self.here[id as usize] = false;
    }
}
