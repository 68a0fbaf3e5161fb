//! [`IpcHandle`]: what names a shared block to the process it was exported to, in 64 bytes (as
//! `cudaIpcMemHandle_t`), to send by any means (a pipe, a pickle, a queue). Honest about fds:
//! the handle carries no fd and is only good on the channel its export went through, where the
//! segment's fd and the block's ranges already travelled ([`crate::ipc::IpcImporter::open`]
//! checks it against them).

use crate::error::{Error, Result};

const MAGIC: [u8; 4] = *b"DMBH";
/// Version 2 added [`IpcHandle::door`] (bytes 12..16, reserved in version 1).
const VERSION: u16 = 2;

/// The size of [`IpcHandle::to_bytes`].
pub const HANDLE_BYTES: usize = 64;

/// A shared block's handle: which export of which exporter, and, to check against what arrived
/// on the channel, the segment, the offset of the block's first byte in the segment's fd, and
/// its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcHandle {
    /// The exporting process.
    pub pid: u32,
    /// 0 for a handle of a [`Channel`](crate::share::Channel) export; else the fd number, in
    /// the exporting process, of its IPC *door*: a socket through which a process that cannot
    /// reach the exporter's IPC socket (another network namespace) connects with
    /// `pidfd_getfd` (see [`crate::ipc::open_handle`]). Never 0 for a door (the door is moved
    /// to fd 3 or above).
    pub door: u32,
    /// The export's number on its channel (from 1).
    pub export: u64,
    /// The segment's [`serial`](crate::Segment::serial) in the exporting process.
    pub segment: u64,
    /// Where the block's first byte lies in the segment's fd.
    pub offset: u64,
    /// The block's length in bytes (what was asked for).
    pub len: u64,
    /// 0 for a handle of a [`Channel`](crate::share::Channel) export; else the handle is
    /// process-wide ([`crate::ipc::get_handle`]) and this names the exporting process's IPC
    /// socket, which [`crate::ipc::open_handle`] connects to.
    pub token: u64,
}

impl IpcHandle {
    /// The 64-byte form: `DMBH`, version (2), 2 zero bytes, pid, door, export, segment,
    /// offset, len, token, zero padding (all little-endian).
    pub fn to_bytes(&self) -> [u8; HANDLE_BYTES] {
        let mut b = [0u8; HANDLE_BYTES];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[12..16].copy_from_slice(&self.door.to_le_bytes());
        for (i, v) in [self.export, self.segment, self.offset, self.len, self.token].into_iter().enumerate() {
            b[16 + 8 * i..24 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// Reads the 64-byte form; anything else (wrong length, magic, version, nonzero padding, a
    /// zero export or length) is refused, saying what.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let bad = |why: String| Error::InvalidArgument { what: format!("IPC handle: {why}") };
        if b.len() != HANDLE_BYTES {
            return Err(bad(format!("{} bytes, expected {HANDLE_BYTES}", b.len())));
        }
        if b[0..4] != MAGIC {
            return Err(bad("not a dmabuf-rt handle (bad magic)".into()));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(bad(format!("version {version}, this library reads {VERSION}")));
        }
        if b[6..8].iter().chain(&b[56..]).any(|&x| x != 0) {
            return Err(bad("nonzero reserved bytes".into()));
        }
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let h = IpcHandle {
            pid: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
            door: u32::from_le_bytes(b[12..16].try_into().expect("4 bytes")),
            export: u64_at(16),
            segment: u64_at(24),
            offset: u64_at(32),
            len: u64_at(40),
            token: u64_at(48),
        };
        if h.export == 0 || h.len == 0 {
            return Err(bad("export 0 or length 0 (never handed out)".into()));
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_bad_bytes_are_refused() {
        let h = IpcHandle { pid: 42, door: 5, export: 3, segment: 9, offset: 4096, len: 5000, token: 77 };
        assert_eq!(IpcHandle::from_bytes(&h.to_bytes()).unwrap(), h);
        let b = h.to_bytes();
        assert!(IpcHandle::from_bytes(&b[..63]).unwrap_err().to_string().contains("63 bytes"));
        for (i, want) in [(0, "magic"), (4, "version"), (7, "reserved"), (60, "reserved")] {
            let mut c = b;
            c[i] ^= 1;
            assert!(IpcHandle::from_bytes(&c).unwrap_err().to_string().contains(want), "byte {i}");
        }
        let zero = IpcHandle { export: 0, ..h };
        assert!(IpcHandle::from_bytes(&zero.to_bytes()).is_err());
    }
}
