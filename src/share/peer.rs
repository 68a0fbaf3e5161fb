//! [`Peer`]: a channel to a process that receives a pool's frames, and which of the pool's
//! buffers it already has. A buffer's fd crosses each channel once, with its first frame;
//! later frames name the buffer by id.

use super::channel::Channel;
use super::message::{Frame, PoolMessage};
use crate::error::Result;
use crate::segment::Segment;

/// A channel frames go out on, and the buffers whose fds the process at the other end has.
#[derive(Debug)]
pub struct Peer {
    channel: Channel,
    has: Vec<bool>,
}

impl Peer {
    /// A peer that has no buffer yet.
    pub fn new(channel: Channel) -> Self {
        Self { channel, has: Vec::new() }
    }

    /// The channel.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// The channel, without the record of what the peer has.
    pub fn into_channel(self) -> Channel {
        self.channel
    }

    /// Whether buffer `id`'s fd has been sent to this peer.
    pub fn has_buffer(&self, id: u32) -> bool {
        self.has.get(id as usize).copied().unwrap_or(false)
    }

    /// Sends `frame`, in `segment`, with the segment's fd if this peer does not have it yet.
    /// Returns whether the fd went.
    pub(crate) fn send_frame(&mut self, frame: Frame, segment: &Segment) -> Result<bool> {
        let msg = PoolMessage::Frame(frame);
        let i = frame.id as usize;
        if self.has_buffer(frame.id) {
            self.channel.send(&msg)?;
            return Ok(false);
        }
        self.channel.send_segment(&msg, segment)?;
        if self.has.len() <= i {
            self.has.resize(i + 1, false);
        }
        self.has[i] = true;
        Ok(true)
    }

    /// Sends the end of the stream, after `count` frames.
    pub fn send_end(&self, count: u64) -> Result<()> {
        self.channel.send(&PoolMessage::End { count })
    }
}
