//! The control messages the IPC tests exchange with their child processes over a `Channel`: a
//! command (or a number) and an optional IPC handle, in one fixed-size packet.

use dmabuf_rt::ipc::{HANDLE_BYTES, IpcHandle};

/// A command's number, then a handle's 64 bytes (zeros for none).
pub type Ctl = [u8; HANDLE_BYTES + 8];

/// The packet for command `cmd`, carrying `h`.
pub fn ctl(cmd: u64, h: Option<&IpcHandle>) -> Ctl {
    let mut m = [0u8; HANDLE_BYTES + 8];
    m[..8].copy_from_slice(&cmd.to_le_bytes());
    if let Some(h) = h {
        m[8..].copy_from_slice(&h.to_bytes());
    }
    m
}

/// The command and the handle (if any) of packet `m`.
pub fn cmd_of(m: &Ctl) -> (u64, Option<IpcHandle>) {
    (u64::from_le_bytes(m[..8].try_into().unwrap()), IpcHandle::from_bytes(&m[8..]).ok())
}
