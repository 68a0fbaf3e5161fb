//! The baseline's pipes: each frame is a 32-byte [`PoolMessage`] header followed by every
//! frame byte, copied into the pipe by one stage and out of it by the next.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;

use dmabuf_rt::Error;
use dmabuf_rt::share::{PoolMessage, Wire};

use super::{PipelineError, Result};

fn peer_gone(name: &str) -> PipelineError {
    PipelineError::Share(Error::PeerGone { channel: name.into() })
}

/// The read end of a baseline pipe.
pub(super) struct PipeIn {
    file: File,
    pub(super) name: &'static str,
}

impl PipeIn {
    pub(super) fn new(fd: OwnedFd, name: &'static str) -> Self {
        Self { file: File::from(fd), name }
    }

    pub(super) fn header(&mut self) -> Result<PoolMessage> {
        let mut b = [0u8; PoolMessage::LEN];
        self.read(&mut b)?;
        PoolMessage::decode(&b).map_err(|why| PipelineError::Share(Error::Protocol { channel: self.name.into(), why }))
    }

    pub(super) fn read(&mut self, buf: &mut [u8]) -> Result<()> {
        self.file.read_exact(buf).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => peer_gone(self.name),
            _ => PipelineError::Io { op: format!("read from {}", self.name), source: e },
        })
    }
}

/// The write end of a baseline pipe.
pub(super) struct PipeOut {
    file: File,
    name: &'static str,
    /// Header bytes written.
    pub(super) headers: u64,
    /// Frame bytes written: the bytes the baseline copies.
    pub(super) frame_bytes: u64,
}

impl PipeOut {
    pub(super) fn new(fd: OwnedFd, name: &'static str) -> Self {
        Self { file: File::from(fd), name, headers: 0, frame_bytes: 0 }
    }

    pub(super) fn header(&mut self, bytes: &[u8]) -> Result<()> {
        self.write(bytes)?;
        self.headers += bytes.len() as u64;
        Ok(())
    }

    /// Copies the frame into the pipe: these are the bytes the baseline copies.
    pub(super) fn frame(&mut self, bytes: &[u8]) -> Result<()> {
        self.write(bytes)?;
        self.frame_bytes += bytes.len() as u64;
        Ok(())
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        // A reader that is gone is EPIPE here: Rust programs ignore SIGPIPE.
        self.file.write_all(bytes).map_err(|e| match e.kind() {
            io::ErrorKind::BrokenPipe => peer_gone(self.name),
            _ => PipelineError::Io { op: format!("write to {}", self.name), source: e },
        })
    }
}
