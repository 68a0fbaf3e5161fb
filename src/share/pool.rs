//! [`PoolOwner`]: a pool of segments whose buffers go out to other processes and come back to
//! it. The owner allocates the buffers once, hands them out one frame at a time, sends each
//! buffer's fd once per [`Peer`], tracks which ids are out with which frame ([`Ledger`]) and
//! takes them back when a [`PoolBorrower`](super::PoolBorrower) returns them; a return of an
//! id that is not out, a second return, or a return naming another frame is refused.

use super::channel::Channel;
use super::ledger::Ledger;
use super::message::{BufferId, Frame};
use super::peer::Peer;
use crate::error::{Error, Result};
use crate::segment::Segment;
use crate::source::MemorySource;

/// The owner's side of a cross-process pool: its segments and its [`Ledger`].
#[derive(Debug)]
pub struct PoolOwner {
    buffers: Vec<Segment>,
    ledger: Ledger,
}

impl PoolOwner {
    /// A pool of these segments; buffer `i` is `buffers[i]`.
    pub fn new(buffers: Vec<Segment>) -> Result<Self> {
        let ledger = Ledger::new(buffers.len())?;
        Ok(Self { buffers, ledger })
    }

    /// A pool of `count` buffers of at least `size` bytes each from `source`, allocated now
    /// (and never again: frames reuse them).
    pub fn allocate(source: &(impl MemorySource + ?Sized), count: usize, size: usize) -> Result<Self> {
        super::ledger::check_len(count)?;
        let buffers = (0..count).map(|_| source.create_segment(size)).collect::<Result<Vec<_>>>()?;
        Self::new(buffers)
    }

    /// How many buffers.
    pub fn len(&self) -> usize {
        self.buffers.len()
    }

    /// Always false: a pool has at least one buffer.
    pub fn is_empty(&self) -> bool {
        self.buffers.is_empty()
    }

    /// Buffer `id`'s segment (whatever its state: the owner may look at any of its buffers,
    /// but should write only to one it holds).
    pub fn buffer(&self, id: BufferId) -> Option<&Segment> {
        self.buffers.get(id as usize)
    }

    /// Which buffers are free, held or out.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Takes a free buffer to fill, or `None` if all are out (receive a return first).
    pub fn take(&mut self) -> Option<BufferId> {
        self.ledger.take()
    }

    /// Puts back a buffer taken and not sent.
    pub fn put_back(&mut self, id: BufferId) -> Result<()> {
        self.ledger.put_back(id)
    }

    /// Sends a frame in a buffer this owner holds (taken, not yet sent) to `to`, with the
    /// buffer's fd if `to` does not have it yet; the buffer is out from then on. Returns
    /// whether the fd went. A frame longer than its buffer is refused before anything is sent.
    pub fn send(&mut self, to: &mut Peer, frame: Frame) -> Result<bool> {
        let seg = self.buffers.get(frame.id as usize).ok_or_else(|| Error::InvalidArgument {
            what: format!("buffer {} outside the pool of {}", frame.id, self.buffers.len()),
        })?;
        if frame.len > seg.len() as u64 {
            return Err(Error::InvalidArgument {
                what: format!("a frame of {} bytes in buffer {} of {} bytes", frame.len, frame.id, seg.len()),
            });
        }
        if !self.ledger.is_held(frame.id) {
            return Err(Error::InvalidArgument {
                what: format!("buffer {} is not held by the owner (take it before sending it)", frame.id),
            });
        }
        let sent_fd = to.send_frame(frame, seg)?;
        self.ledger.lend(frame.id, frame.seq)?;
        Ok(sent_fd)
    }

    /// Takes back every buffer that is out, once every process they went to is gone; returns
    /// their ids. See [`Ledger::reclaim_out`].
    pub fn reclaim_out(&mut self) -> Vec<BufferId> {
        self.ledger.reclaim_out()
    }

    /// Receives one return on `from` and takes the buffer back; returns its id and frame.
    /// See [`Ledger::recv_return`].
    pub fn recv_return(&mut self, from: &Channel) -> Result<(BufferId, u64)> {
        self.ledger.recv_return(from)
    }
}
