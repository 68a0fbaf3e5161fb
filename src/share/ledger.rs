//! [`Ledger`]: which buffers of a pool its owner holds, which are free, and which are out
//! with which frame. The bookkeeping of [`PoolOwner`](super::PoolOwner), usable alone by a
//! protocol that lends ids without segments (a baseline that copies frames through pipes).

use super::channel::{Channel, Received};
use super::message::{BufferId, PoolMessage};
use crate::error::{Error, Result};

/// The most buffers a pool may have.
pub const MAX_BUFFERS: usize = 1 << 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Free,
    /// Taken by the owner, not sent yet.
    Held,
    /// Sent with frame `seq`; only a return of that frame brings it back.
    Out {
        seq: u64,
    },
}

/// The state of each buffer id of a pool: free, held by the owner, or out with a frame.
#[derive(Debug, Clone)]
pub struct Ledger {
    slots: Vec<Slot>,
    /// Free ids, the lowest last (taken first).
    free: Vec<BufferId>,
    out: usize,
}

impl Ledger {
    /// A ledger of `len` free buffers (1 to [`MAX_BUFFERS`]).
    pub fn new(len: usize) -> Result<Self> {
        check_len(len)?;
        Ok(Self { slots: vec![Slot::Free; len], free: (0..len as BufferId).rev().collect(), out: 0 })
    }

    /// How many buffers.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Always false: a pool has at least one buffer.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Buffers free to take.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Buffers out (sent, not returned).
    pub fn out_count(&self) -> usize {
        self.out
    }

    /// Whether `id` is out, and with which frame.
    pub fn out_with(&self, id: BufferId) -> Option<u64> {
        match self.slots.get(id as usize) {
            Some(Slot::Out { seq }) => Some(*seq),
            _ => None,
        }
    }

    /// Whether the owner holds `id` (taken, not sent).
    pub fn is_held(&self, id: BufferId) -> bool {
        self.slots.get(id as usize) == Some(&Slot::Held)
    }

    /// Takes a free buffer (the lowest id free), or `None` if every buffer is held or out.
    pub fn take(&mut self) -> Option<BufferId> {
        let id = self.free.pop()?;
        self.slots[id as usize] = Slot::Held;
        Some(id)
    }

    /// Puts back a buffer taken and not sent.
    pub fn put_back(&mut self, id: BufferId) -> Result<()> {
        match self.slots.get(id as usize) {
            Some(Slot::Held) => {
                self.slots[id as usize] = Slot::Free;
                self.free.push(id);
                Ok(())
            }
            _ => Err(Error::InvalidArgument { what: format!("buffer {id} is not held by the owner") }),
        }
    }

    /// Marks a held buffer as out with frame `seq` (it was sent).
    pub fn lend(&mut self, id: BufferId, seq: u64) -> Result<()> {
        match self.slots.get(id as usize) {
            Some(Slot::Held) => {
                self.slots[id as usize] = Slot::Out { seq };
                self.out += 1;
                Ok(())
            }
            _ => Err(Error::InvalidArgument {
                what: format!("buffer {id} is not held by the owner (take it before sending it)"),
            }),
        }
    }

    /// Takes back buffer `id`, out with frame `seq`. Refused (and nothing changes) for an
    /// id outside the pool, a buffer that is not out (never sent, or already returned), or a
    /// return naming another frame than the one the buffer carries.
    pub fn accept_return(&mut self, id: BufferId, seq: u64) -> Result<()> {
        self.check_return(id, seq).map_err(|what| Error::InvalidArgument { what })?;
        self.slots[id as usize] = Slot::Free;
        self.free.push(id);
        self.out -= 1;
        Ok(())
    }

    /// Takes back every buffer that is out, as if each had been returned; returns their ids.
    /// For when every process a buffer went to is gone (a crashed consumer, a pipeline torn
    /// down): without it the pool would stay short of those buffers for good. Only the caller
    /// knows that no process still uses them: a buffer reclaimed while a live peer holds it may
    /// be overwritten under that peer, and that peer's late return is refused (the buffer is
    /// no longer out).
    pub fn reclaim_out(&mut self) -> Vec<BufferId> {
        let mut ids = Vec::new();
        for (id, slot) in self.slots.iter_mut().enumerate() {
            if let Slot::Out { .. } = slot {
                *slot = Slot::Free;
                ids.push(id as BufferId);
            }
        }
        // Lowest id last, as `free` keeps them (taken first).
        self.free.extend(&ids);
        self.free.sort_unstable_by(|a, b| b.cmp(a));
        self.out = 0;
        ids
    }

    fn check_return(&self, id: BufferId, seq: u64) -> std::result::Result<(), String> {
        match self.slots.get(id as usize) {
            None => Err(format!("return of buffer {id}, outside the pool of {}", self.len())),
            Some(Slot::Out { seq: out }) if *out == seq => Ok(()),
            Some(Slot::Out { seq: out }) => {
                Err(format!("return of buffer {id} with frame {seq}, but it is out with frame {out}"))
            }
            Some(Slot::Free | Slot::Held) => {
                Err(format!("return of buffer {id} frame {seq}, which is not out (never sent, or already returned)"))
            }
        }
    }

    /// Receives one return on `from` and takes the buffer back ([`Ledger::accept_return`]);
    /// returns its id and frame. Anything but a valid return is refused as
    /// [`Error::Protocol`] on `from` (a frame or an end, an fd, an id not out).
    pub fn recv_return(&mut self, from: &Channel) -> Result<(BufferId, u64)> {
        let Received { msg, fd } = from.recv::<PoolMessage>()?;
        if fd.is_some() {
            return Err(from.protocol_error("a return carried an fd"));
        }
        let PoolMessage::Return { id, seq } = msg else {
            return Err(from.protocol_error(format!("expected a return, got {msg:?}")));
        };
        self.check_return(id, seq).map_err(|why| from.protocol_error(why))?;
        self.accept_return(id, seq)?;
        Ok((id, seq))
    }
}

/// Checks a pool length.
pub(crate) fn check_len(len: usize) -> Result<()> {
    if len == 0 || len > MAX_BUFFERS {
        return Err(Error::InvalidArgument { what: format!("a pool of {len} buffers (1 to {MAX_BUFFERS})") });
    }
    Ok(())
}
