//! [`PoolMessage`]: the one message of the cross-process pool protocol, 32 bytes.
//!
//! Layout, little-endian: magic `DRPF` (4 bytes), kind (1 frame, 2 end, 3 return), 3 zero
//! bytes, buffer id (u32), 4 zero bytes, sequence number (u64; for an end, the number of
//! frames sent), frame length (u64; 0 for an end or a return). Anything else is refused with
//! the reason: the wrong size, a bad magic, an unknown kind, nonzero padding.

use super::channel::Wire;

const MAGIC: [u8; 4] = *b"DRPF";

/// Identifies a buffer of a pool: its index, `0..pool length`.
pub type BufferId = u32;

/// A frame: which buffer, which frame, how many of its bytes (from offset 0) it fills.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Frame {
    /// The buffer.
    pub id: BufferId,
    /// The frame's sequence number, as the owner numbered it.
    pub seq: u64,
    /// Bytes of the buffer the frame fills.
    pub len: u64,
}

/// A message of the pool protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolMessage {
    /// A frame in a buffer (with the buffer's fd the first time the buffer crosses this
    /// channel).
    Frame(Frame),
    /// The end of the stream, after `count` frames.
    End {
        /// Frames sent before it.
        count: u64,
    },
    /// A buffer goes back to its owner: the frame `seq` it carried is done.
    Return {
        /// The buffer.
        id: BufferId,
        /// The frame it carried.
        seq: u64,
    },
}

impl Wire for PoolMessage {
    const LEN: usize = 32;

    fn encode(&self, b: &mut [u8]) {
        b.fill(0);
        b[..4].copy_from_slice(&MAGIC);
        let (kind, id, seq, len) = match *self {
            PoolMessage::Frame(Frame { id, seq, len }) => (1, id, seq, len),
            PoolMessage::End { count } => (2, 0, count, 0),
            PoolMessage::Return { id, seq } => (3, id, seq, 0),
        };
        b[4] = kind;
        b[8..12].copy_from_slice(&id.to_le_bytes());
        b[16..24].copy_from_slice(&seq.to_le_bytes());
        b[24..32].copy_from_slice(&len.to_le_bytes());
    }

    fn decode(b: &[u8]) -> Result<Self, String> {
        let b: &[u8; 32] = b.try_into().map_err(|_| format!("{} bytes, expected {}", b.len(), Self::LEN))?;
        if b[..4] != MAGIC {
            return Err(format!("bad magic {:02x?}", &b[..4]));
        }
        if b[5..8] != [0; 3] || b[12..16] != [0; 4] {
            return Err("nonzero padding".into());
        }
        let [i0, i1, i2, i3] = [b[8], b[9], b[10], b[11]];
        let id = u32::from_le_bytes([i0, i1, i2, i3]);
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(w)
        };
        let (seq, len) = (word(16), word(24));
        match b[4] {
            1 => Ok(PoolMessage::Frame(Frame { id, seq, len })),
            2 if id != 0 || len != 0 => Err("an end message with a buffer id or a length".into()),
            2 => Ok(PoolMessage::End { count: seq }),
            3 if len != 0 => Err("a return message with a length".into()),
            3 => Ok(PoolMessage::Return { id, seq }),
            k => Err(format!("unknown kind {k}")),
        }
    }
}

impl PoolMessage {
    /// The message as bytes.
    pub fn to_bytes(&self) -> [u8; 32] {
        let mut b = [0u8; 32];
        self.encode(&mut b);
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_bad_ones_are_refused_with_the_reason() {
        let frame = PoolMessage::Frame(Frame { id: 3, seq: 7, len: 4096 });
        for m in [frame, PoolMessage::End { count: 10 }, PoolMessage::Return { id: 1, seq: u64::MAX }] {
            assert_eq!(PoolMessage::decode(&m.to_bytes()), Ok(m));
        }
        let good = frame.to_bytes();
        assert!(PoolMessage::decode(&good[..31]).unwrap_err().contains("31 bytes"));
        assert!(PoolMessage::decode(&[0xa5; 32]).unwrap_err().contains("magic"));
        let bad = |at: usize, v: u8| {
            let mut b = good;
            b[at] = v;
            PoolMessage::decode(&b).unwrap_err()
        };
        assert!(bad(4, 9).contains("kind 9"));
        assert!(bad(4, 0).contains("kind 0"));
        assert!(bad(13, 1).contains("padding"));
        assert!(bad(6, 1).contains("padding"));
        // An end or return with fields that only a frame has.
        assert!(bad(4, 2).contains("an end message with a buffer id"));
        assert!(bad(4, 3).contains("a return message with a length"));
    }
}
