//! Replaying allocation traces through the caching allocator (`dmabuf-rt replay`).
//!
//! A trace is JSON lines, one operation each: `{"t": ns, "op": "alloc"|"free", "addr": int,
//! "size": int}`, where `addr` names a block from its alloc to its free.

use std::collections::HashMap;
use std::time::Instant;

use super::stats::AGGREGATE;
use super::{CachingAllocator, Config};
use crate::error::{Error, Result};
use crate::source::{MemorySource, ShmemSource, SparseSource};

/// One trace operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceOp {
    /// Allocate `size` bytes named `addr`.
    Alloc {
        /// The block's name.
        addr: u64,
        /// Bytes.
        size: usize,
    },
    /// Free the block named `addr`.
    Free {
        /// The block's name.
        addr: u64,
    },
}

/// Where replayed segments come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplaySource {
    /// Sparse address space, no memory (traces larger than RAM).
    Virtual,
    /// Real shmem segments.
    Shmem,
}

/// What a replay measured.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayReport {
    /// Operations replayed.
    pub ops: u64,
    /// Peak bytes allocated to callers (rounded block sizes).
    pub peak_allocated_bytes: u64,
    /// Peak bytes reserved from the source.
    pub peak_reserved_bytes: u64,
    /// `peak_reserved_bytes / peak_allocated_bytes`.
    pub ratio: f64,
    /// Segments obtained from the source.
    pub backend_allocs: u64,
    /// Segments returned to the source.
    pub backend_frees: u64,
    /// Wall time per operation.
    pub ns_per_op: f64,
    /// With `--find-min-capacity`: the smallest capacity that replays without an OOM.
    pub min_capacity_bytes: Option<u64>,
    /// Allocations that failed with out-of-memory.
    pub ooms: u64,
}

impl ReplayReport {
    /// As one JSON object with the keys named as the fields.
    pub fn to_json(&self) -> String {
        format!(
            "{{\"ops\":{},\"peak_allocated_bytes\":{},\"peak_reserved_bytes\":{},\"ratio\":{:.4},\"backend_allocs\":{},\
             \"backend_frees\":{},\"ns_per_op\":{:.1},\"min_capacity_bytes\":{},\"ooms\":{}}}",
            self.ops,
            self.peak_allocated_bytes,
            self.peak_reserved_bytes,
            self.ratio,
            self.backend_allocs,
            self.backend_frees,
            self.ns_per_op,
            self.min_capacity_bytes.map_or("null".to_string(), |c| c.to_string()),
            self.ooms
        )
    }
}

/// Parses a JSON-lines trace; errors name the line.
pub fn parse_trace(text: &str) -> Result<Vec<TraceOp>> {
    let mut ops = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let bad = |why: &str| Error::Config { what: format!("trace line {}: {why}: {line}", i + 1) };
        let fields = flat_object(line).ok_or_else(|| bad("not a flat JSON object"))?;
        let num = |k: &str| -> Result<u64> {
            fields
                .get(k)
                .ok_or_else(|| bad(&format!("missing \"{k}\"")))?
                .parse::<u64>()
                .map_err(|_| bad(&format!("\"{k}\" is not a whole number")))
        };
        let op = fields.get("op").ok_or_else(|| bad("missing \"op\""))?;
        ops.push(match op.as_str() {
            "alloc" => TraceOp::Alloc {
                addr: num("addr")?,
                size: usize::try_from(num("size")?).map_err(|_| bad("size too large"))?,
            },
            "free" => TraceOp::Free { addr: num("addr")? },
            other => return Err(bad(&format!("unknown op \"{other}\""))),
        });
    }
    Ok(ops)
}

/// Parses `{"k": v, ...}` with string or number values (enough for traces).
fn flat_object(line: &str) -> Option<HashMap<String, String>> {
    let body = line.strip_prefix('{')?.strip_suffix('}')?;
    let mut out = HashMap::new();
    for part in body.split(',') {
        let (k, v) = part.split_once(':')?;
        let k = k.trim().strip_prefix('"')?.strip_suffix('"')?;
        let v = v.trim();
        let v = v.strip_prefix('"').and_then(|v| v.strip_suffix('"')).unwrap_or(v);
        out.insert(k.to_string(), v.to_string());
    }
    Some(out)
}

fn allocator(source: ReplaySource, capacity: u64, config: &Config) -> Result<CachingAllocator> {
    let src: Box<dyn MemorySource> = match source {
        ReplaySource::Virtual => Box::new(SparseSource),
        ReplaySource::Shmem => Box::new(ShmemSource::new().reserve(false)),
    };
    CachingAllocator::builder_boxed(src).config(config.clone()).capacity(capacity).build()
}

/// Replays `trace` once at `capacity`.
pub fn replay(trace: &[TraceOp], source: ReplaySource, capacity: u64, config: &Config) -> Result<ReplayReport> {
    let a = allocator(source, capacity, config)?;
    let mut live = HashMap::new();
    let mut ooms = 0;
    let start = Instant::now();
    for (i, op) in trace.iter().enumerate() {
        match *op {
            TraceOp::Alloc { addr, size } => match a.allocate(size, None) {
                Ok(x) => {
                    if live.insert(addr, x).is_some() {
                        return Err(Error::Config { what: format!("trace op {}: addr {addr} allocated twice", i + 1) });
                    }
                }
                Err(Error::AllocatorOom { .. }) => {
                    ooms += 1;
                }
                Err(e) => return Err(e),
            },
            TraceOp::Free { addr } => {
                // A free of a block whose alloc failed (OOM) is skipped with it.
                live.remove(&addr);
            }
        }
    }
    let elapsed = start.elapsed();
    drop(live);
    let st = a.stats();
    let peak_allocated = st.allocated_bytes[AGGREGATE].peak as u64;
    let peak_reserved = st.reserved_bytes[AGGREGATE].peak as u64;
    Ok(ReplayReport {
        ops: trace.len() as u64,
        peak_allocated_bytes: peak_allocated,
        peak_reserved_bytes: peak_reserved,
        ratio: if peak_allocated == 0 { 0.0 } else { peak_reserved as f64 / peak_allocated as f64 },
        backend_allocs: st.num_device_alloc as u64,
        backend_frees: st.num_device_free as u64,
        ns_per_op: elapsed.as_nanos() as f64 / trace.len().max(1) as f64,
        min_capacity_bytes: None,
        ooms,
    })
}

/// The smallest capacity (to 2 MiB) at which `trace` replays without an out-of-memory, found
/// by bisection between the peak allocated bytes and the peak reserved at `capacity`.
pub fn find_min_capacity(
    trace: &[TraceOp],
    source: ReplaySource,
    capacity: u64,
    config: &Config,
) -> Result<Option<u64>> {
    const STEP: u64 = 2 << 20;
    let full = replay(trace, source, capacity, config)?;
    if full.ooms > 0 {
        return Ok(None);
    }
    let (mut lo, mut hi) = (full.peak_allocated_bytes / STEP, full.peak_reserved_bytes.div_ceil(STEP));
    // Invariant: hi*STEP works; (lo*STEP) is not known to work.
    while lo < hi {
        let mid = (lo + hi) / 2;
        if mid > 0 && replay(trace, source, mid * STEP, config)?.ooms == 0 {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Ok(Some(hi * STEP))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_traces_and_names_bad_lines() {
        let t = parse_trace("{\"t\": 1, \"op\": \"alloc\", \"addr\": 7, \"size\": 4096}\n\n{\"t\":2,\"op\":\"free\",\"addr\":7,\"size\":4096}\n")
            .unwrap();
        assert_eq!(t, [TraceOp::Alloc { addr: 7, size: 4096 }, TraceOp::Free { addr: 7 }]);
        let e = parse_trace("{\"op\":\"alloc\",\"addr\":1}\n").unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("missing \"size\""), "{e}");
        let e = parse_trace("{\"op\":\"munmap\",\"addr\":1}").unwrap_err().to_string();
        assert!(e.contains("unknown op"), "{e}");
        assert!(parse_trace("alloc 1 2").is_err());
    }

    #[test]
    fn replays_and_finds_the_minimum_capacity() {
        // Two generations of 8 MiB blocks: the second reuses the first's memory.
        let mut t = Vec::new();
        for g in 0..2u64 {
            for i in 0..4u64 {
                t.push(TraceOp::Alloc { addr: g * 10 + i, size: 8 << 20 });
            }
            for i in 0..4u64 {
                t.push(TraceOp::Free { addr: g * 10 + i });
            }
        }
        let c = Config { expandable_segments: false, ..Config::default() };
        let r = replay(&t, ReplaySource::Virtual, 1 << 40, &c).unwrap();
        assert_eq!(r.ops, 16);
        assert_eq!(r.peak_allocated_bytes, 32 << 20);
        // Two 8 MiB blocks fit in each 20 MiB segment; the second generation reuses them.
        assert_eq!(r.backend_allocs, 2, "the second generation reused the cache");
        // One expandable segment, grown to exactly what the blocks need.
        let e = replay(&t, ReplaySource::Virtual, 1 << 40, &Config::default()).unwrap();
        assert_eq!((e.backend_allocs, e.peak_reserved_bytes), (1, 32 << 20));
        assert_eq!(r.ooms, 0);
        let min = find_min_capacity(&t, ReplaySource::Virtual, 1 << 40, &c).unwrap().unwrap();
        assert!(min >= 32 << 20 && min <= r.peak_reserved_bytes, "{min}");
        assert_eq!(replay(&t, ReplaySource::Virtual, min, &c).unwrap().ooms, 0);
        assert!(replay(&t, ReplaySource::Virtual, min - (2 << 20), &c).unwrap().ooms > 0);
        let j = r.to_json();
        for k in [
            "ops",
            "peak_allocated_bytes",
            "peak_reserved_bytes",
            "ratio",
            "backend_allocs",
            "backend_frees",
            "ns_per_op",
            "min_capacity_bytes",
            "ooms",
        ] {
            assert!(j.contains(&format!("\"{k}\":")), "{k} missing in {j}");
        }
    }
}
