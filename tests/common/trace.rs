//! What the tests that write their own allocation traces share (`generated_traces`,
//! `hostile_review34`): a trace being written, and the allocator's bound on peak reserved bytes.

use dmabuf_rt::caching::replay::TraceOp;

/// One small segment (2 MiB): the trim policy does not punch within it of the peak.
pub const SMALL_SEGMENT: f64 = (2 << 20) as f64;

/// The allocator's bound on peak reserved bytes: 3% above the peak allocated bytes, or one
/// small segment.
pub fn bound(peak_allocated: u64) -> f64 {
    let p = peak_allocated as f64;
    (p * 1.03).max(p + SMALL_SEGMENT)
}

/// A trace being written: blocks get fresh addresses.
#[derive(Default)]
pub struct Trace {
    pub ops: Vec<TraceOp>,
    next: u64,
}

impl Trace {
    /// An allocation of `size` bytes (at least 1); returns its address.
    pub fn alloc(&mut self, size: usize) -> u64 {
        self.next += 1;
        self.ops.push(TraceOp::Alloc { addr: self.next, size: size.max(1) });
        self.next
    }
    pub fn free(&mut self, addr: u64) {
        self.ops.push(TraceOp::Free { addr });
    }
    pub fn step(&mut self) {
        self.ops.push(TraceOp::Step);
    }
}
