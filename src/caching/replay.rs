//! Replaying allocation traces through the caching allocator (`dmabuf-rt replay`).
//!
//! A trace is JSON lines, one operation each: `{"t": ns, "op": "alloc"|"free", "addr": int,
//! "size": int}`, where `addr` names a block from its alloc to its free, and optionally
//! `{"t": ns, "op": "step"}` between training steps or serving iterations. A replay can repeat
//! the trace (`--repeat N`, each repetition a step too) to show what a warm allocator does: the
//! source calls and remaps of the warm steps (the second half of them) are reported apart.
//!
//! A replay's figures are those of its trace alone (the same on every run) only while the
//! process's stitched views stay below their process-wide budget of kernel mappings (32,768
//! runs, shared by every allocator of the process): other allocators holding views near that
//! budget make the replayed arena grow where it would have mapped a view, so its reserved
//! bytes, source calls and remaps change. The allocated bytes are the trace's either way.

use std::collections::HashMap;
use std::fmt::Write;
use std::time::Instant;

use super::snapshot::Snapshot;
use super::stats::AGGREGATE;
use super::svg::TimelinePoint;
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
    /// A step boundary (a training step, a serving iteration).
    Step,
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
///
/// Every figure but `min_capacity_bytes` and `at_min_capacity` comes from the replay at the
/// capacity asked for (by default unlimited for practical purposes: 1 TiB).
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayReport {
    /// Operations replayed.
    pub ops: u64,
    /// Peak bytes allocated to callers (rounded block sizes).
    pub peak_allocated_bytes: u64,
    /// Peak bytes reserved from the source (for expandable segments: backed pages, so pages
    /// given back with a punch no longer count).
    pub peak_reserved_bytes: u64,
    /// `peak_reserved_bytes / peak_allocated_bytes`.
    pub ratio: f64,
    /// Calls that obtained memory from the source (`num_device_alloc`): classic segments;
    /// with expandable segments, each reservation and each growth of one.
    pub backend_allocs: u64,
    /// Calls that gave memory back to the source (`num_device_free`): classic segments
    /// released; with expandable segments, each punch of free pages.
    pub backend_frees: u64,
    /// Remaps of page stitching (`num_remaps`: `mmap(MAP_FIXED)` calls that move memory, none
    /// taken or given back).
    pub remaps: u64,
    /// Steps: the trace's step markers plus one, times the repetitions.
    pub steps: u64,
    /// Source calls (allocs and frees) in the warm steps: the second half of the steps (none
    /// with a single step).
    pub warm_source_calls: u64,
    /// Remaps in the warm steps.
    pub warm_remaps: u64,
    /// The warm steps.
    pub warm_steps: u64,
    /// Wall time per operation.
    pub ns_per_op: f64,
    /// With `--find-min-capacity`: the smallest capacity (to 2 MiB) that replays without an
    /// OOM.
    pub min_capacity_bytes: Option<u64>,
    /// Allocations that failed with out-of-memory.
    pub ooms: u64,
    /// With `--find-min-capacity`: the replay at `min_capacity_bytes` (its own peaks, backend
    /// calls and timing; its `min_capacity_bytes` and `at_min_capacity` are `None`).
    pub at_min_capacity: Option<Box<ReplayReport>>,
}

impl ReplayReport {
    /// As one JSON object with the keys named as the fields. `at_min_capacity` is there only
    /// with `--find-min-capacity`: a nested object with the same keys (its
    /// `min_capacity_bytes` null, no `at_min_capacity`), or `null` when the full replay failed.
    pub fn to_json(&self) -> String {
        format!(
            "{{\"ops\":{},\"peak_allocated_bytes\":{},\"peak_reserved_bytes\":{},\"ratio\":{:.4},\"backend_allocs\":{},\
             \"backend_frees\":{},\"remaps\":{},\"steps\":{},\"warm_steps\":{},\"warm_source_calls\":{},\
             \"warm_remaps\":{},\"ns_per_op\":{:.1},\"min_capacity_bytes\":{},\"ooms\":{}{}}}",
            self.ops,
            self.peak_allocated_bytes,
            self.peak_reserved_bytes,
            self.ratio,
            self.backend_allocs,
            self.backend_frees,
            self.remaps,
            self.steps,
            self.warm_steps,
            self.warm_source_calls,
            self.warm_remaps,
            self.ns_per_op,
            self.min_capacity_bytes.map_or("null".to_string(), |c| c.to_string()),
            self.ooms,
            match (&self.at_min_capacity, self.min_capacity_bytes) {
                (Some(r), _) => format!(",\"at_min_capacity\":{}", r.to_json()),
                (None, Some(_)) => ",\"at_min_capacity\":null".to_string(),
                (None, None) => String::new(),
            }
        )
    }

    /// `n` per warm step (0 without warm steps).
    pub fn per_warm_step(&self, n: u64) -> f64 {
        if self.warm_steps == 0 { 0.0 } else { n as f64 / self.warm_steps as f64 }
    }

    /// As aligned `name value` lines: the replay at the capacity asked for, then, with
    /// `--find-min-capacity`, the replay at the minimum capacity under its own heading.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let figures = |r: &ReplayReport, s: &mut String| {
            let _ = writeln!(s, "ops                   {}", r.ops);
            let _ = writeln!(s, "peak_allocated_bytes  {}", r.peak_allocated_bytes);
            let _ = writeln!(s, "peak_reserved_bytes   {}", r.peak_reserved_bytes);
            let _ = writeln!(s, "ratio                 {:.4}", r.ratio);
            let _ = writeln!(s, "backend_allocs        {}", r.backend_allocs);
            let _ = writeln!(s, "backend_frees         {}", r.backend_frees);
            let _ = writeln!(s, "remaps                {}", r.remaps);
            let _ = writeln!(s, "steps                 {} ({} warm)", r.steps, r.warm_steps);
            let _ = writeln!(
                s,
                "warm_source_calls     {} ({:.2} per warm step)",
                r.warm_source_calls,
                r.per_warm_step(r.warm_source_calls)
            );
            let _ = writeln!(
                s,
                "warm_remaps           {} ({:.2} per warm step)",
                r.warm_remaps,
                r.per_warm_step(r.warm_remaps)
            );
            let _ = writeln!(s, "ns_per_op             {:.1}", r.ns_per_op);
            let _ = writeln!(s, "ooms                  {}", r.ooms);
        };
        figures(self, &mut s);
        match self.min_capacity_bytes {
            Some(c) => {
                let _ = writeln!(s, "min_capacity_bytes    {c}");
                if let Some(r) = &self.at_min_capacity {
                    s.push_str("at min_capacity_bytes:\n");
                    figures(r, &mut s);
                }
            }
            None => s.push_str("min_capacity_bytes    -\n"),
        }
        s
    }
}

/// Parses a JSON-lines trace; errors name the line. Each line is a flat JSON object (string,
/// number, `true`, `false` and `null` values; strings may hold any character); `addr` and
/// `size` are whole numbers, written as integers or as JSON numbers whose value is whole
/// (`4096.0`, `4.096e3`).
pub fn parse_trace(text: &str) -> Result<Vec<TraceOp>> {
    let mut ops = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let bad = |why: &str| Error::Config { what: format!("trace line {}: {why}: {line}", i + 1) };
        let fields = flat_object(line).map_err(|why| bad(&format!("not a flat JSON object ({why})")))?;
        let num = |k: &str| -> Result<u64> {
            let v = fields.get(k).ok_or_else(|| bad(&format!("missing \"{k}\"")))?;
            whole_number(v).ok_or_else(|| bad(&format!("\"{k}\" is not a whole number")))
        };
        let op = fields.get("op").ok_or_else(|| bad("missing \"op\""))?;
        ops.push(match op.as_str() {
            "alloc" => TraceOp::Alloc {
                addr: num("addr")?,
                size: usize::try_from(num("size")?).map_err(|_| bad("size too large"))?,
            },
            "free" => TraceOp::Free { addr: num("addr")? },
            "step" => TraceOp::Step,
            other => return Err(bad(&format!("unknown op \"{other}\""))),
        });
    }
    Ok(ops)
}

/// A non-negative whole number written as a JSON number: an integer, or a fraction or
/// exponent whose value is whole and below 2^64.
fn whole_number(v: &str) -> Option<u64> {
    if let Ok(n) = v.parse::<u64>() {
        return Some(n);
    }
    // JSON's grammar: digits, then an optional fraction and exponent (no `inf`, `nan`, `+`).
    let json_number = v.starts_with(|c: char| c.is_ascii_digit())
        && v.bytes().all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-'));
    let f: f64 = v.parse().ok().filter(|_| json_number)?;
    (f.fract() == 0.0 && f < 18_446_744_073_709_551_616.0).then_some(f as u64)
}

/// Parses `{"k": v, ...}` whose values are strings (escapes decoded) or bare tokens (numbers,
/// `true`, `false`, `null`, kept as written): enough for traces. Errors say what is wrong.
fn flat_object(line: &str) -> std::result::Result<HashMap<String, String>, String> {
    let mut chars = line.char_indices().peekable();
    let skip_ws = |chars: &mut std::iter::Peekable<std::str::CharIndices<'_>>| {
        while chars.next_if(|&(_, c)| matches!(c, ' ' | '\t' | '\r' | '\n')).is_some() {}
    };
    let string = |chars: &mut std::iter::Peekable<std::str::CharIndices<'_>>| -> std::result::Result<String, String> {
        let mut out = String::new();
        loop {
            match chars.next() {
                None => return Err("unterminated string".into()),
                Some((_, '"')) => return Ok(out),
                Some((at, '\\')) => out.push(match chars.next().map(|(_, c)| c) {
                    Some('"') => '"',
                    Some('\\') => '\\',
                    Some('/') => '/',
                    Some('b') => '\u{8}',
                    Some('f') => '\u{c}',
                    Some('n') => '\n',
                    Some('r') => '\r',
                    Some('t') => '\t',
                    Some('u') => {
                        let hex: String = (0..4).filter_map(|_| chars.next().map(|(_, c)| c)).collect();
                        let code = u32::from_str_radix(&hex, 16).map_err(|_| format!("bad \\u escape at byte {at}"))?;
                        // A surrogate (half of a pair) stands for no character of its own.
                        char::from_u32(code).unwrap_or('\u{fffd}')
                    }
                    _ => return Err(format!("unknown escape at byte {at}")),
                }),
                Some((_, c)) => out.push(c),
            }
        }
    };
    if chars.next().map(|(_, c)| c) != Some('{') {
        return Err("it does not start with '{'".into());
    }
    let mut out = HashMap::new();
    skip_ws(&mut chars);
    if chars.next_if(|&(_, c)| c == '}').is_none() {
        loop {
            skip_ws(&mut chars);
            if chars.next().map(|(_, c)| c) != Some('"') {
                return Err("expected a member name in double quotes".into());
            }
            let key = string(&mut chars)?;
            skip_ws(&mut chars);
            if chars.next().map(|(_, c)| c) != Some(':') {
                return Err(format!("expected ':' after \"{key}\""));
            }
            skip_ws(&mut chars);
            let value = match chars.peek() {
                Some((_, '"')) => {
                    chars.next();
                    string(&mut chars)?
                }
                Some((_, '{' | '[')) => return Err(format!("\"{key}\" holds an object or array")),
                _ => {
                    let mut v = String::new();
                    while let Some((_, c)) = chars.next_if(|&(_, c)| !matches!(c, ',' | '}' | ' ' | '\t' | '\r' | '\n'))
                    {
                        v.push(c);
                    }
                    if v.is_empty() {
                        return Err(format!("\"{key}\" has no value"));
                    }
                    v
                }
            };
            out.insert(key, value);
            skip_ws(&mut chars);
            match chars.next().map(|(_, c)| c) {
                Some(',') => {}
                Some('}') => break,
                _ => return Err("expected ',' or '}' after a member".into()),
            }
        }
    }
    skip_ws(&mut chars);
    match chars.next() {
        None => Ok(out),
        Some((at, _)) => Err(format!("text after the object at byte {at}")),
    }
}

fn allocator(source: ReplaySource, capacity: u64, config: &Config) -> Result<CachingAllocator> {
    let src: Box<dyn MemorySource> = match source {
        ReplaySource::Virtual => Box::new(SparseSource),
        ReplaySource::Shmem => Box::new(ShmemSource::new().reserve(false)),
    };
    CachingAllocator::builder_boxed(src).config(config.clone()).capacity(capacity).build()
}

/// How to replay a trace besides its source, capacity and settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayOptions {
    /// Replays of the trace, one after the other on the same allocator (at least 1). Blocks
    /// still live at the end of one are freed before the next.
    pub repeat: usize,
    /// How the replay holds its blocks.
    pub api: ReplayApi,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self { repeat: 1, api: ReplayApi::Owned }
    }
}

/// How a replay allocates and holds its blocks: the same allocator and the same decisions
/// either way (the figures other than time are equal); the time differs by what the handles
/// cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ReplayApi {
    /// [`Allocation`](super::Allocation)s, freed by dropping them: what Rust callers hold.
    #[default]
    Owned,
    /// Raw pointers, [`CachingAllocator::allocate_raw`] and [`CachingAllocator::free_raw`]: what
    /// the C API and the PyTorch backend use, and what PyTorch's own allocator is driven
    /// through (`raw_allocate` / `raw_deallocate`) by `benches/torch-peer`.
    Raw,
}

impl std::str::FromStr for ReplayApi {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "owned" => Ok(Self::Owned),
            "raw" => Ok(Self::Raw),
            _ => Err(Error::Config { what: format!("replay API {s:?}: owned or raw") }),
        }
    }
}

/// The blocks a replay holds, by slot: allocated, freed, and all freed at the end of a
/// repetition. An out-of-memory refusal of `alloc` is counted in `ooms`, not an error.
trait Slots {
    fn alloc(&mut self, a: &CachingAllocator, slot: usize, size: usize, ooms: &mut u64) -> Result<()>;
    fn free(&mut self, a: &CachingAllocator, slot: usize) -> Result<()>;
    fn free_all(&mut self, a: &CachingAllocator) -> Result<()>;
}

impl Slots for Vec<Option<super::Allocation>> {
    #[inline(always)]
    fn alloc(&mut self, a: &CachingAllocator, slot: usize, size: usize, ooms: &mut u64) -> Result<()> {
        match a.allocate(size, None) {
            Ok(x) => self[slot] = Some(x),
            Err(Error::AllocatorOom { .. }) => *ooms += 1,
            Err(e) => return Err(e),
        }
        Ok(())
    }

    #[inline(always)]
    fn free(&mut self, _: &CachingAllocator, slot: usize) -> Result<()> {
        self[slot] = None;
        Ok(())
    }

    fn free_all(&mut self, _: &CachingAllocator) -> Result<()> {
        self.iter_mut().for_each(|l| *l = None);
        Ok(())
    }
}

impl Slots for Vec<*mut u8> {
    #[inline(always)]
    fn alloc(&mut self, a: &CachingAllocator, slot: usize, size: usize, ooms: &mut u64) -> Result<()> {
        match a.allocate_raw(size, None) {
            Ok(p) => self[slot] = p,
            Err(Error::AllocatorOom { .. }) => *ooms += 1,
            Err(e) => return Err(e),
        }
        Ok(())
    }

    #[inline(always)]
    fn free(&mut self, a: &CachingAllocator, slot: usize) -> Result<()> {
        let p = std::mem::replace(&mut self[slot], std::ptr::null_mut());
        if p.is_null() { Ok(()) } else { a.free_raw(p) }
    }

    fn free_all(&mut self, a: &CachingAllocator) -> Result<()> {
        (0..self.len()).try_for_each(|slot| self.free(a, slot))
    }
}

/// Replays `trace` once at `capacity`.
pub fn replay(trace: &[TraceOp], source: ReplaySource, capacity: u64, config: &Config) -> Result<ReplayReport> {
    replay_with(trace, source, capacity, config, &ReplayOptions::default())
}

/// A trace operation with its address replaced by a dense slot.
#[derive(Clone, Copy)]
enum Slotted {
    Alloc {
        slot: usize,
        size: usize,
    },
    Free {
        slot: usize,
    },
    /// A free of an address the trace never allocated (its alloc came before the trace began):
    /// nothing to free, but an operation all the same.
    Nothing,
    Step,
}

/// The trace with dense slots (a slot is reused once its block is freed), and how many slots
/// it needs; refuses an address allocated twice without a free between (the trace is wrong).
/// A free of an address never allocated frees nothing (the trace began after its alloc).
fn resolve(trace: &[TraceOp]) -> Result<(Vec<Slotted>, usize)> {
    let mut slot_of: HashMap<u64, usize> = HashMap::new();
    let (mut spare, mut slots) = (Vec::new(), 0usize);
    let mut out = Vec::with_capacity(trace.len());
    for (i, op) in trace.iter().enumerate() {
        out.push(match *op {
            TraceOp::Alloc { addr, size } => {
                let slot = spare.pop().unwrap_or_else(|| {
                    slots += 1;
                    slots - 1
                });
                if slot_of.insert(addr, slot).is_some() {
                    return Err(Error::Config { what: format!("trace op {}: addr {addr} allocated twice", i + 1) });
                }
                Slotted::Alloc { slot, size }
            }
            TraceOp::Free { addr } => match slot_of.remove(&addr) {
                Some(slot) => {
                    spare.push(slot);
                    Slotted::Free { slot }
                }
                None => Slotted::Nothing,
            },
            TraceOp::Step => Slotted::Step,
        });
    }
    Ok((out, slots))
}

/// What one replay saw: the report's figures, and per step the source calls and remaps.
struct Run {
    ooms: u64,
    elapsed: std::time::Duration,
    /// Per step: (source calls, remaps) made during it.
    steps: Vec<(u64, u64)>,
}

/// Replays `trace` `opts.repeat` times on one allocator; `visit` sees the allocator after
/// every operation (with the operation's index over all repetitions) and may stop the replay.
fn run(
    a: &CachingAllocator,
    trace: &[TraceOp],
    opts: &ReplayOptions,
    visit: impl FnMut(u64, &CachingAllocator) -> bool,
) -> Result<Run> {
    // Addresses become dense slots before the clock starts, so that the timed loop costs what
    // the allocator does (no hashing per operation), as the PyTorch peer's loop does.
    let (ops, slots) = resolve(trace)?;
    match opts.api {
        ReplayApi::Owned => {
            let mut live: Vec<Option<super::Allocation>> = Vec::with_capacity(slots);
            live.resize_with(slots, || None);
            run_on(a, &ops, trace, opts, live, visit)
        }
        ReplayApi::Raw => run_on(a, &ops, trace, opts, vec![std::ptr::null_mut(); slots], visit),
    }
}

fn run_on(
    a: &CachingAllocator,
    ops: &[Slotted],
    trace: &[TraceOp],
    opts: &ReplayOptions,
    mut live: impl Slots,
    mut visit: impl FnMut(u64, &CachingAllocator) -> bool,
) -> Result<Run> {
    let (mut ooms, mut index) = (0, 0u64);
    let mut steps = Vec::new();
    let counts = |a: &CachingAllocator| {
        let st = a.stats();
        ((st.num_device_alloc + st.num_device_free) as u64, st.num_remaps as u64)
    };
    let mut at_step = counts(a);
    let mut end_step = |a: &CachingAllocator, steps: &mut Vec<(u64, u64)>| {
        let now = counts(a);
        steps.push((now.0 - at_step.0, now.1 - at_step.1));
        at_step = now;
    };
    let start = Instant::now();
    'all: for _ in 0..opts.repeat.max(1) {
        for (k, op) in ops.iter().enumerate() {
            match *op {
                // A refusal other than an out-of-memory says which operation (as `resolve`
                // does), so that a long trace's bad line can be found.
                Slotted::Alloc { slot, size } => live
                    .alloc(a, slot, size, &mut ooms)
                    .map_err(|e| Error::Config { what: format!("trace op {} (alloc of {size} bytes): {e}", k + 1) })?,
                // A free of a block whose alloc failed (OOM) is skipped with it.
                Slotted::Free { slot } => live.free(a, slot)?,
                Slotted::Nothing => {}
                Slotted::Step => end_step(a, &mut steps),
            }
            index += 1;
            if !visit(index, a) {
                break 'all;
            }
        }
        live.free_all(a)?;
        end_step(a, &mut steps);
    }
    let elapsed = start.elapsed();
    // A step marker that ends the trace leaves an empty step behind it: not a step.
    while steps.len() > 1 && steps.last() == Some(&(0, 0)) && trace.last() == Some(&TraceOp::Step) {
        steps.pop();
    }
    Ok(Run { ooms, elapsed, steps })
}

/// `ops` operations `opts.repeat` times over, refused when the count overflows.
fn repeated(ops: usize, opts: &ReplayOptions) -> Result<usize> {
    ops.checked_mul(opts.repeat.max(1)).ok_or_else(|| Error::Config {
        what: format!(
            "a trace of {ops} operations repeated {} times: more operations than a usize counts",
            opts.repeat
        ),
    })
}

/// Replays `trace` at `capacity` as `opts` says. Its figures depend on the trace alone only
/// while the process's stitched views are below their budget of kernel mappings (see the
/// [module](self) documentation).
pub fn replay_with(
    trace: &[TraceOp],
    source: ReplaySource,
    capacity: u64,
    config: &Config,
    opts: &ReplayOptions,
) -> Result<ReplayReport> {
    let ops = repeated(trace.iter().filter(|op| **op != TraceOp::Step).count(), opts)?;
    let a = allocator(source, capacity, config)?;
    let r = run(&a, trace, opts, |_, _| true)?;
    let st = a.stats();
    let peak_allocated = st.allocated_bytes[AGGREGATE].peak as u64;
    let peak_reserved = st.reserved_bytes[AGGREGATE].peak as u64;
    let warm = &r.steps[r.steps.len().div_ceil(2).min(r.steps.len())..];
    let warm = if r.steps.len() > 1 { warm } else { &[] };
    Ok(ReplayReport {
        ops: ops as u64,
        peak_allocated_bytes: peak_allocated,
        peak_reserved_bytes: peak_reserved,
        ratio: if peak_allocated == 0 { 0.0 } else { peak_reserved as f64 / peak_allocated as f64 },
        backend_allocs: st.num_device_alloc as u64,
        backend_frees: st.num_device_free as u64,
        remaps: st.num_remaps as u64,
        steps: r.steps.len() as u64,
        warm_steps: warm.len() as u64,
        warm_source_calls: warm.iter().map(|s| s.0).sum(),
        warm_remaps: warm.iter().map(|s| s.1).sum(),
        ns_per_op: r.elapsed.as_nanos() as f64 / ops.max(1) as f64,
        min_capacity_bytes: None,
        ooms: r.ooms,
        at_min_capacity: None,
    })
}

/// What `dmabuf-rt replay --svg` draws: the allocator at the peak of its reserved bytes, and
/// the bytes over the whole replay.
#[derive(Debug, Clone)]
pub struct ReplayPicture {
    /// The allocator's segments at the peak (the first operation after which the reserved bytes
    /// were at their maximum, and of those the one with the most allocated).
    pub at_peak: Snapshot,
    /// That operation's index (1-based, over all repetitions).
    pub peak_op: u64,
    /// Reserved, allocated and requested bytes after every operation.
    pub timeline: Vec<TimelinePoint>,
}

/// Replays `trace` as [`replay_with`] does, twice: once to record the timeline and find the
/// operation at which the reserved bytes peaked, and again on a fresh allocator up to that
/// operation to take its snapshot there (the allocator's choices do not depend on addresses
/// or time, so the second replay reaches the same state while the process's stitched views
/// stay below their budget of kernel mappings, see the [module](self) documentation; this is
/// checked, and an error says so if it did not: other allocators of the process holding views
/// can make one of the replays grow its arena instead of mapping a view).
pub fn replay_picture(
    trace: &[TraceOp],
    source: ReplaySource,
    capacity: u64,
    config: &Config,
    opts: &ReplayOptions,
) -> Result<ReplayPicture> {
    // At most about a million points are kept (the picture draws 2,000), the peak always.
    let ops = repeated(trace.len(), opts)? as u64;
    let a = allocator(source, capacity, config)?;
    let stride = ops.div_ceil(1 << 20).max(1);
    let mut timeline = Vec::with_capacity((ops / stride) as usize + 1);
    let mut peak = (0u64, 0u64, 0u64);
    run(&a, trace, opts, |op, a| {
        let st = a.stats();
        let p = TimelinePoint {
            op,
            reserved: st.reserved_bytes[AGGREGATE].current as u64,
            allocated: st.allocated_bytes[AGGREGATE].current as u64,
            requested: st.requested_bytes[AGGREGATE].current as u64,
        };
        let new_peak = (p.reserved, p.allocated) > (peak.1, peak.2);
        if new_peak {
            peak = (op, p.reserved, p.allocated);
        }
        if new_peak || op % stride == 0 {
            timeline.push(p);
        }
        true
    })?;
    drop(a);
    let a = allocator(source, capacity, config)?;
    let mut at_peak = None;
    run(&a, trace, opts, |op, a| {
        if op < peak.0 {
            return true;
        }
        at_peak = Some((a.snapshot(), a.stats()));
        false
    })?;
    let (at_peak, st) = match at_peak {
        Some(s) => s,
        None => (a.snapshot(), a.stats()),
    };
    let again = (st.reserved_bytes[AGGREGATE].current as u64, st.allocated_bytes[AGGREGATE].current as u64);
    if peak.0 > 0 && again != (peak.1, peak.2) {
        return Err(Error::Config {
            what: format!(
                "the second replay reached {} reserved / {} allocated bytes at op {}, not the first's {} / {}: \
                 the allocator's choices depended on something besides the trace (the stitched views of the \
                 process's allocators map {} of the {} kernel mappings they may hold: near that budget, an arena \
                 grows instead of mapping a view)",
                again.0,
                again.1,
                peak.0,
                peak.1,
                peak.2,
                super::arena::mapped_runs(),
                super::arena::MAX_MAPPED_RUNS
            ),
        });
    }
    Ok(ReplayPicture { at_peak, peak_op: peak.0, timeline })
}

/// The smallest capacity (to 2 MiB) at which `trace` replays without an out-of-memory, found
/// by bisection between the peak allocated bytes and the peak reserved at `capacity`.
pub fn find_min_capacity(
    trace: &[TraceOp],
    source: ReplaySource,
    capacity: u64,
    config: &Config,
) -> Result<Option<u64>> {
    let full = replay(trace, source, capacity, config)?;
    Ok(min_capacity_of(trace, source, &full, config, &ReplayOptions::default())?.map(|r| r.0))
}

/// Replays `trace` at `capacity` and, with `find_min`, finds the minimum capacity as
/// [`find_min_capacity`] does: the report of the first replay, with `min_capacity_bytes` and
/// the replay at that capacity in `at_min_capacity`.
pub fn replay_report(
    trace: &[TraceOp],
    source: ReplaySource,
    capacity: u64,
    config: &Config,
    find_min: bool,
    opts: &ReplayOptions,
) -> Result<ReplayReport> {
    let mut report = replay_with(trace, source, capacity, config, opts)?;
    if find_min {
        if let Some((min, at)) = min_capacity_of(trace, source, &report, config, opts)? {
            report.min_capacity_bytes = Some(min);
            report.at_min_capacity = Some(Box::new(at));
        }
    }
    Ok(report)
}

/// Bisects for the minimum capacity, given the full replay; returns it with the replay there.
fn min_capacity_of(
    trace: &[TraceOp],
    source: ReplaySource,
    full: &ReplayReport,
    config: &Config,
    opts: &ReplayOptions,
) -> Result<Option<(u64, ReplayReport)>> {
    const STEP: u64 = 2 << 20;
    if full.ooms > 0 {
        return Ok(None);
    }
    let (mut lo, mut hi) = (full.peak_allocated_bytes / STEP, full.peak_reserved_bytes.div_ceil(STEP));
    // Invariant: hi*STEP works; (lo*STEP) is not known to work.
    let mut at_hi = None;
    while lo < hi {
        let mid = (lo + hi) / 2;
        let r = if mid > 0 { Some(replay_with(trace, source, mid * STEP, config, opts)?) } else { None };
        match r {
            Some(r) if r.ooms == 0 => {
                hi = mid;
                at_hi = Some(r);
            }
            _ => lo = mid + 1,
        }
    }
    let at = match at_hi {
        Some(r) => r,
        None => replay_with(trace, source, hi * STEP, config, opts)?,
    };
    Ok(Some((hi * STEP, at)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "terabyte capacities: the Miri stand-in mappings are real heap memory")]
    fn the_picture_is_taken_at_the_reserved_peak() {
        // Classic segments: 8 MiB blocks, a 4 MiB one between two generations; the peak is
        // reached when the third 8 MiB block is handed out (three segments' worth), and the
        // second generation reuses the cache, so the reserved bytes never go higher.
        let mut t = vec![TraceOp::Alloc { addr: 100, size: 4 << 20 }];
        for i in 0..3u64 {
            t.push(TraceOp::Alloc { addr: i, size: 8 << 20 });
        }
        t.push(TraceOp::Step);
        for i in 0..3u64 {
            t.push(TraceOp::Free { addr: i });
        }
        t.push(TraceOp::Free { addr: 100 });
        let c = Config { expandable_segments: false, ..Config::default() };
        let opts = ReplayOptions { repeat: 3, ..ReplayOptions::default() };
        let pic = replay_picture(&t, ReplaySource::Virtual, 1 << 40, &c, &opts).unwrap();
        let r = replay_with(&t, ReplaySource::Virtual, 1 << 40, &c, &opts).unwrap();
        // Every operation (step markers included) has its point, in order.
        assert_eq!(pic.timeline.len(), t.len() * 3);
        assert!(pic.timeline.windows(2).all(|w| w[0].op + 1 == w[1].op));
        let top = pic.timeline.iter().map(|p| p.reserved).max().unwrap();
        assert_eq!(top, r.peak_reserved_bytes);
        assert_eq!(pic.peak_op, 4, "the third 8 MiB block is op 4");
        let at = &pic.timeline[pic.peak_op as usize - 1];
        assert_eq!((at.reserved, at.allocated), (top, 28 << 20));
        assert!(pic.timeline.iter().all(|p| p.requested <= p.allocated && p.allocated <= p.reserved));
        // The snapshot is of that moment: its segments add up to the peak, its allocated blocks
        // to the allocated bytes there.
        let segs = &pic.at_peak.segments;
        assert_eq!(segs.iter().map(|s| s.size as u64).sum::<u64>(), top);
        let allocated: usize = segs
            .iter()
            .flat_map(|s| &s.blocks)
            .filter(|b| b.state == super::super::BlockState::Allocated)
            .map(|b| b.size)
            .sum();
        assert_eq!(allocated as u64, at.allocated);
    }

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
        // Strings may hold commas, colons and escaped quotes; whole numbers may be floats.
        let t = parse_trace(r#"{"op":"alloc","name":"a, \"b\": c","addr":1,"size":4.096e3}"#).unwrap();
        assert_eq!(t, [TraceOp::Alloc { addr: 1, size: 4096 }]);
        let e = parse_trace(r#"{"op":"alloc","addr":1,"size":4096.5}"#).unwrap_err().to_string();
        assert!(e.contains("\"size\" is not a whole number"), "{e}");
        for bad in [r#"{"op":"alloc","addr":1,"size":4096"#, r#"{"op":"step"} x"#, r#"{"op":"step",}"#] {
            let e = parse_trace(bad).unwrap_err().to_string();
            assert!(e.contains("not a flat JSON object"), "{bad}: {e}");
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "terabyte capacities: the Miri stand-in mappings are real heap memory")]
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
        // Page stitching (the default): one arena (one call to make it), whose units grow to
        // exactly what the blocks need with no call (its memfd is sparse); each block is one
        // run of units, so a home block at the units' own address: nothing is remapped.
        let e = replay(&t, ReplaySource::Virtual, 1 << 40, &Config::default()).unwrap();
        assert_eq!((e.backend_allocs, e.backend_frees, e.peak_reserved_bytes, e.remaps), (1, 0, 32 << 20, 0));
        // Free memory split by a live block: a 16 MiB block then takes the two 8 MiB holes
        // around it as one stitched view (two `mmap`s), instead of growing.
        let mut h: Vec<TraceOp> = (0..3).map(|i| TraceOp::Alloc { addr: i, size: 8 << 20 }).collect();
        h.extend([0, 2].map(|i| TraceOp::Free { addr: i }));
        h.push(TraceOp::Alloc { addr: 9, size: 16 << 20 });
        let e = replay(&h, ReplaySource::Virtual, 1 << 40, &Config::default()).unwrap();
        assert_eq!((e.backend_allocs, e.peak_reserved_bytes, e.remaps), (1, 24 << 20, 2));
        // Expandable segments without stitching: one call to reserve, one per growth (four of
        // 8 MiB).
        let x = Config { page_stitching: false, ..Config::default() };
        let e = replay(&t, ReplaySource::Virtual, 1 << 40, &x).unwrap();
        assert_eq!((e.backend_allocs, e.backend_frees, e.peak_reserved_bytes), (5, 0, 32 << 20));
        assert_eq!(r.ooms, 0);
        let min = find_min_capacity(&t, ReplaySource::Virtual, 1 << 40, &c).unwrap().unwrap();
        assert!(min >= 32 << 20 && min <= r.peak_reserved_bytes, "{min}");
        // The report keeps the full replay's figures and adds the replay at the minimum.
        let both = replay_report(&t, ReplaySource::Virtual, 1 << 40, &c, true, &ReplayOptions::default()).unwrap();
        assert_eq!((both.peak_reserved_bytes, both.min_capacity_bytes), (r.peak_reserved_bytes, Some(min)));
        let at = both.at_min_capacity.as_deref().unwrap();
        assert_eq!(at.ooms, 0);
        assert!(at.peak_reserved_bytes <= min, "reserved {} past the capacity {min}", at.peak_reserved_bytes);
        let j = both.to_json();
        assert!(
            j.contains(&format!("\"min_capacity_bytes\":{min},\"ooms\":0,\"at_min_capacity\":{{\"ops\":16")),
            "{j}"
        );
        let text = both.to_text();
        assert!(
            text.contains("at min_capacity_bytes:") && text.contains(&format!("min_capacity_bytes    {min}")),
            "{text}"
        );
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
