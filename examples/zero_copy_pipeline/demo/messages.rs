//! The zero-copy pipeline's own messages: what only the pipeline knows (which frame is due,
//! where the run ends, which frame the consumer is done with), next to the library's IPC
//! protocol, which carries the buffers themselves ([`dmabuf_rt::ipc`]).
//!
//! A message is one packet: a 4-byte magic, a 4-byte kind, a 64-bit sequence number or count,
//! then the IPC handles it carries (64 bytes each): two in a frame from the producer (the
//! transform's and the consumer's), one in a frame from the transform (the consumer's).

use dmabuf_rt::Error;
use dmabuf_rt::ipc::{HANDLE_BYTES, IpcHandle};
use dmabuf_rt::share::Channel;

use super::{PipelineError, Result};

const MAGIC: [u8; 4] = *b"DMPF";
const HEADER: usize = 16;
/// The longest message: a header and two handles.
pub(super) const MAX_MESSAGE: usize = HEADER + 2 * HANDLE_BYTES;

/// One message of the pipeline (zero-copy mode).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Message {
    /// The producer's first message on a stage's channel, with one fd: the stage's end of
    /// the IPC channel the producer exports frames on.
    Setup,
    /// Frame `seq`, with the handles of its block (two from the producer, one from the
    /// transform).
    Frame { seq: u64, handles: Vec<IpcHandle> },
    /// The run ended after `count` frames.
    End { count: u64 },
    /// The consumer is done with frame `seq`.
    Return { seq: u64 },
}

impl Message {
    fn kind(&self) -> u32 {
        match self {
            Message::Setup => 1,
            Message::Frame { .. } => 2,
            Message::End { .. } => 3,
            Message::Return { .. } => 4,
        }
    }

    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(MAX_MESSAGE);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&self.kind().to_le_bytes());
        let n = match self {
            Message::Setup => 0,
            Message::Frame { seq, .. } | Message::Return { seq } => *seq,
            Message::End { count } => *count,
        };
        out.extend_from_slice(&n.to_le_bytes());
        if let Message::Frame { handles, .. } = self {
            for h in handles {
                out.extend_from_slice(&h.to_bytes());
            }
        }
        out
    }

    /// The message in `bytes` (as received on `channel`, for the errors).
    pub(super) fn decode(bytes: &[u8], channel: &str) -> Result<Message> {
        let bad = |why: String| PipelineError::Share(Error::Protocol { channel: channel.into(), why });
        if bytes.len() < HEADER || bytes[..4] != MAGIC {
            return Err(bad("malformed message: bad magic".into()));
        }
        let kind = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
        let n = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
        let rest = &bytes[HEADER..];
        let none = |m: Message| {
            if rest.is_empty() {
                Ok(m)
            } else {
                Err(bad(format!("malformed message: {} bytes after a header of kind {kind}", rest.len())))
            }
        };
        match kind {
            1 => none(Message::Setup),
            2 if !rest.is_empty() && rest.len() % HANDLE_BYTES == 0 && rest.len() <= 2 * HANDLE_BYTES => {
                let handles = rest
                    .chunks_exact(HANDLE_BYTES)
                    .map(IpcHandle::from_bytes)
                    .collect::<dmabuf_rt::Result<Vec<_>>>()
                    .map_err(|e| bad(format!("malformed message: a frame's handle: {e}")))?;
                Ok(Message::Frame { seq: n, handles })
            }
            2 => Err(bad(format!("malformed message: a frame with {} bytes of handles", rest.len()))),
            3 => none(Message::End { count: n }),
            4 => none(Message::Return { seq: n }),
            k => Err(bad(format!("malformed message: unknown kind {k}"))),
        }
    }
}

/// Sends `m` on `channel`.
pub(super) fn send(channel: &Channel, m: &Message) -> Result<()> {
    Ok(channel.send_bytes(&m.encode(), &[])?)
}

/// The next message on `channel`, with the fds it carried (a message that should carry none
/// and does is refused; the fds are closed).
pub(super) fn recv(channel: &Channel) -> Result<(Message, Vec<std::os::fd::OwnedFd>)> {
    let mut buf = [0u8; MAX_MESSAGE];
    let (len, fds) = channel.recv_bytes(&mut buf)?;
    let m = Message::decode(&buf[..len], channel.name())?;
    let want = usize::from(m == Message::Setup);
    if fds.len() != want {
        return Err(PipelineError::Share(channel.protocol_error(format!(
            "a message of kind {} carried {} fds, not {want}",
            m.kind(),
            fds.len()
        ))));
    }
    Ok((m, fds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_garbage_is_refused() {
        for m in [Message::Setup, Message::End { count: 9 }, Message::Return { seq: 3 }] {
            assert_eq!(Message::decode(&m.encode(), "c").unwrap(), m);
        }
        let err = Message::decode(&[0xa5; 32], "c").unwrap_err().to_string();
        assert!(err.contains("malformed message: bad magic"), "{err}");
        let mut long = Message::End { count: 1 }.encode();
        long.push(0);
        assert!(Message::decode(&long, "c").is_err());
        assert!(Message::decode(&Message::Frame { seq: 1, handles: vec![] }.encode(), "c").is_err());
    }
}
