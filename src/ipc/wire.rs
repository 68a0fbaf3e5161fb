//! The IPC protocol's packets, one per message on a [`Channel`](crate::share::Channel)
//! (`SOCK_SEQPACKET`: each arrives whole), all little-endian:
//!
//! ```text
//! exporter -> importer   SEGMENT  tag=1 kind:u32 serial:u64            + the segment's fd
//!                        SHARE    tag=2 nruns:u32 export:u64 serial:u64 len:u64 pid:u64
//!                                 then nruns x (offset:u64, len:u64)    (fd ranges, in order)
//!                        GONE     tag=4 0:u32 serial:u64            (segment let go there)
//!                        GRANT    tag=6 0:u32 request:u64 export:u64 (after the SHARE it names)
//!                        DENY     tag=7 0:u32 request:u64 0:u64      (no such hold)
//! importer -> exporter   RELEASE  tag=3 0:u32 export:u64
//!                        REQUEST  tag=5 0:u32 hold:u64 request:u64   (a process-wide handle)
//! ```
//!
//! A segment's fd goes to a peer once (SEGMENT), before the first SHARE that names it; every
//! later block of it is a SHARE of offsets only. Once the exporter's allocator has let the
//! segment go, GONE tells the importer to close its copy (blocks it still has open keep theirs). Decoding refuses anything malformed, saying
//! what; it never panics.

use crate::segment::SegmentKind;

/// The most fd ranges one shared block may have (a stitched block of the arena; udmabuf's own
/// default limit is the same).
pub const MAX_RUNS: usize = 1024;

const SEGMENT: u32 = 1;
const SHARE: u32 = 2;
const RELEASE: u32 = 3;
const GONE: u32 = 4;
const REQUEST: u32 = 5;
const GRANT: u32 = 6;
const DENY: u32 = 7;

/// The largest packet: a SHARE with [`MAX_RUNS`] ranges.
pub(crate) const MAX_PACKET: usize = SHARE_HEADER + 16 * MAX_RUNS;

/// Bytes of a SHARE before its ranges.
const SHARE_HEADER: usize = 40;

/// A message of the protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Msg {
    /// The next fd is segment `serial` of the exporter, of `kind`.
    Segment { kind: SegmentKind, serial: u64 },
    /// Export `export` of process `pid`: `len` bytes at `ranges` of segment `serial`'s fd.
    Share { export: u64, serial: u64, len: u64, pid: u64, ranges: Vec<(u64, u64)> },
    /// The importer let go of export `export`.
    Release { export: u64 },
    /// The exporter's allocator let segment `serial` go: no share will name it again.
    Gone { serial: u64 },
    /// The importer asks for the block held as `hold` ([`crate::ipc::get_handle`]); its
    /// answer names `request` (the importer's own number for the ask).
    Request { hold: u64, request: u64 },
    /// Request `request` got export `export` (its SHARE came first).
    Grant { request: u64, export: u64 },
    /// Request `request` named no held block (forged, already opened, or revoked).
    Deny { request: u64 },
}

fn kind_code(kind: SegmentKind) -> u32 {
    match kind {
        SegmentKind::Device => 0,
        SegmentKind::PinnedHost => 1,
        SegmentKind::Unified => 2,
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl Msg {
    /// The packet's bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32);
        let put32 = |out: &mut Vec<u8>, v: u32| out.extend_from_slice(&v.to_le_bytes());
        match self {
            Msg::Segment { kind, serial } => {
                put32(&mut out, SEGMENT);
                put32(&mut out, kind_code(*kind));
                out.extend_from_slice(&serial.to_le_bytes());
            }
            Msg::Share { export, serial, len, pid, ranges } => {
                put32(&mut out, SHARE);
                put32(&mut out, ranges.len() as u32);
                for v in [*export, *serial, *len, *pid] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
                for &(off, l) in ranges {
                    out.extend_from_slice(&off.to_le_bytes());
                    out.extend_from_slice(&l.to_le_bytes());
                }
            }
            Msg::Release { export } => {
                put32(&mut out, RELEASE);
                put32(&mut out, 0);
                out.extend_from_slice(&export.to_le_bytes());
            }
            Msg::Gone { serial } => {
                put32(&mut out, GONE);
                put32(&mut out, 0);
                out.extend_from_slice(&serial.to_le_bytes());
            }
            Msg::Request { hold, request } => {
                put32(&mut out, REQUEST);
                put32(&mut out, 0);
                out.extend_from_slice(&hold.to_le_bytes());
                out.extend_from_slice(&request.to_le_bytes());
            }
            Msg::Grant { request, export } => {
                put32(&mut out, GRANT);
                put32(&mut out, 0);
                out.extend_from_slice(&request.to_le_bytes());
                out.extend_from_slice(&export.to_le_bytes());
            }
            Msg::Deny { request } => {
                put32(&mut out, DENY);
                put32(&mut out, 0);
                out.extend_from_slice(&request.to_le_bytes());
                out.extend_from_slice(&0u64.to_le_bytes());
            }
        }
        out
    }

    /// Reads one packet, or says what is wrong with it.
    pub(crate) fn decode(b: &[u8]) -> Result<Msg, String> {
        if b.len() < 8 {
            return Err(format!("a packet of {} bytes, shorter than any message", b.len()));
        }
        let (tag, word) = (u32_at(b, 0), u32_at(b, 4));
        match tag {
            SEGMENT | RELEASE | GONE if b.len() != 16 => {
                Err(format!("a {} message of {} bytes, not 16", name(tag), b.len()))
            }
            REQUEST | GRANT | DENY if b.len() != 24 => {
                Err(format!("a {} message of {} bytes, not 24", name(tag), b.len()))
            }
            SEGMENT => {
                let kind = match word {
                    0 => SegmentKind::Device,
                    1 => SegmentKind::PinnedHost,
                    2 => SegmentKind::Unified,
                    k => return Err(format!("a segment of unknown kind {k}")),
                };
                Ok(Msg::Segment { kind, serial: u64_at(b, 8) })
            }
            RELEASE => Ok(Msg::Release { export: u64_at(b, 8) }),
            GONE => Ok(Msg::Gone { serial: u64_at(b, 8) }),
            REQUEST => Ok(Msg::Request { hold: u64_at(b, 8), request: u64_at(b, 16) }),
            GRANT => Ok(Msg::Grant { request: u64_at(b, 8), export: u64_at(b, 16) }),
            DENY => Ok(Msg::Deny { request: u64_at(b, 8) }),
            SHARE => {
                let n = word as usize;
                if n == 0 || n > MAX_RUNS {
                    return Err(format!("a share of {n} ranges (1 to {MAX_RUNS})"));
                }
                let want = SHARE_HEADER + 16 * n;
                if b.len() != want {
                    return Err(format!("a share of {n} ranges in {} bytes, not {want}", b.len()));
                }
                let at = |i: usize| SHARE_HEADER + 16 * i;
                let ranges = (0..n).map(|i| (u64_at(b, at(i)), u64_at(b, at(i) + 8))).collect();
                let (export, serial, len, pid) = (u64_at(b, 8), u64_at(b, 16), u64_at(b, 24), u64_at(b, 32));
                Ok(Msg::Share { export, serial, len, pid, ranges })
            }
            t => Err(format!("unknown message tag {t}")),
        }
    }
}

fn name(tag: u32) -> &'static str {
    match tag {
        SEGMENT => "segment",
        RELEASE => "release",
        GONE => "gone",
        REQUEST => "request",
        GRANT => "grant",
        _ => "deny",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_bad_packets_are_refused() {
        let msgs = [
            Msg::Segment { kind: SegmentKind::Unified, serial: 7 },
            Msg::Share { export: 3, serial: 7, len: 5000, pid: 42, ranges: vec![(4096, 8192), (0, 4096)] },
            Msg::Release { export: u64::MAX },
            Msg::Gone { serial: 5 },
            Msg::Request { hold: 9, request: 2 },
            Msg::Grant { request: 2, export: 4 },
            Msg::Deny { request: 11 },
        ];
        for m in &msgs {
            assert_eq!(Msg::decode(&m.encode()).unwrap(), *m);
        }
        let share = msgs[1].encode();
        assert!(Msg::decode(&share[..share.len() - 1]).unwrap_err().contains("not 72"));
        assert!(Msg::decode(&share[..7]).unwrap_err().contains("shorter"));
        let mut none = share.clone();
        none[4..8].copy_from_slice(&0u32.to_le_bytes());
        assert!(Msg::decode(&none[..40]).unwrap_err().contains("0 ranges"));
        let mut bad = msgs[0].encode();
        bad[4] = 9;
        assert!(Msg::decode(&bad).unwrap_err().contains("unknown kind"));
        bad[0] = 42;
        assert!(Msg::decode(&bad).unwrap_err().contains("tag 42"));
        // Every prefix and every single-byte change of each message decodes or is refused.
        for m in &msgs {
            let b = m.encode();
            for cut in 0..b.len() {
                let _ = Msg::decode(&b[..cut]);
            }
            for i in 0..b.len() {
                let mut c = b.clone();
                c[i] ^= 0xff;
                let _ = Msg::decode(&c);
            }
        }
    }
}
