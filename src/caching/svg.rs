//! A picture of fragmentation: one self-contained SVG (no scripts, no fonts or styles fetched
//! from anywhere; tooltips are inline `<title>` elements) that a browser shows as it is.
//!
//! The top part draws segments (the caller chooses the moment, typically the peak), one
//! horizontal bar per segment on a shared scale of a power-of-two number of bytes per pixel,
//! wrapped over several rows for a big one, each byte range coloured by its [`SvgState`], with
//! a legend giving the total of each state. The bottom part draws the reserved, allocated and
//! requested bytes over the op index as three lines, with a marker at the peak.
//!
//! The output stays bounded whatever the input: the scale is chosen so that all the segments
//! drawn take at most about 36,000 pixels (plus one row per segment), adjacent pixels of one
//! state merge into one rectangle and a pixel holding several blocks takes the state holding
//! most of its bytes; at most 1,000 segments are drawn (the totals count them all); and each
//! line of the timeline keeps at most 2,000 points, the minimum and the maximum of each of
//! 1,000 buckets, so no peak is lost. A 200,000-block segment with a million-point timeline
//! comes out at a few megabytes at most.

use std::fmt::Write;

/// Pixels in one row of a segment's bar.
const ROW_PX: u64 = 1200;
/// Left edge of the bars (the labels are to its left).
const LEFT: u64 = 300;
/// Width of the picture.
const WIDTH: u64 = LEFT + ROW_PX + 20;
/// Height of one row of a bar, and the distance from one row to the next.
const ROW_H: u64 = 14;
const ROW_STEP: u64 = ROW_H + 2;
/// Space between two segments.
const SEG_GAP: u64 = 6;
/// The segments drawn take at most about this many pixels of bars.
const PIXEL_BUDGET: u64 = 36_000;
/// The largest segment takes at most about this many rows.
const MAX_ROWS_LARGEST: u64 = 8;
/// Segments drawn at most (the rest are counted in the totals only).
const MAX_SEGMENTS: usize = 1000;
/// Points per line of the timeline at most.
const MAX_POINTS: usize = 2000;
/// Height of the timeline's plot.
const PLOT_H: u64 = 240;
/// Characters of a segment's label shown (the whole label is in its tooltip).
const LABEL_CHARS: usize = 32;
const MIB: f64 = 1024.0 * 1024.0;

/// What a byte range of a segment holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SvgState {
    /// Handed out (or freed and waiting for other queues).
    Allocated,
    /// Free but backed: cached by the allocator.
    Cached,
    /// Free, its pages given back to the kernel (punched).
    Punched,
    /// Reserved address space with nothing mapped.
    Unmapped,
}

impl SvgState {
    const ALL: [SvgState; 4] = [SvgState::Allocated, SvgState::Cached, SvgState::Punched, SvgState::Unmapped];

    fn index(self) -> usize {
        self as usize
    }

    fn name(self) -> &'static str {
        match self {
            SvgState::Allocated => "allocated",
            SvgState::Cached => "cached",
            SvgState::Punched => "punched",
            SvgState::Unmapped => "unmapped",
        }
    }

    fn meaning(self) -> &'static str {
        match self {
            SvgState::Allocated => "handed out",
            SvgState::Cached => "free, backed (cached)",
            SvgState::Punched => "free, pages given back",
            SvgState::Unmapped => "reserved address space, nothing mapped",
        }
    }

    /// Fill colour (Paul Tol's colour-blind safe palette).
    fn colour(self) -> &'static str {
        match self {
            SvgState::Allocated => "#4477aa",
            SvgState::Cached => "#ee6677",
            SvgState::Punched => "#ccbb44",
            SvgState::Unmapped => "#dddddd",
        }
    }
}

/// A byte range of an [`SvgSegment`] in one state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SvgBlock {
    /// Offset in the segment.
    pub offset: usize,
    /// Size in bytes.
    pub size: usize,
    /// What it holds.
    pub state: SvgState,
}

/// One segment to draw as a bar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SvgSegment {
    /// Base address (for the tooltips).
    pub address: usize,
    /// Size in bytes.
    pub size: usize,
    /// Shown left of the bar (the first 32 characters; all of it in the tooltip).
    pub label: String,
    /// Byte ranges by offset, covering `[0, size)` or part of it: what no block covers is
    /// drawn as [`SvgState::Unmapped`]. Ranges past the end are cut, overlapping parts
    /// dropped, and unsorted blocks sorted.
    pub blocks: Vec<SvgBlock>,
}

/// The bytes at one point of the timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimelinePoint {
    /// Op index (the x axis); points come in increasing op order.
    pub op: u64,
    /// Reserved bytes.
    pub reserved: u64,
    /// Allocated bytes.
    pub allocated: u64,
    /// Requested bytes.
    pub requested: u64,
}

/// The picture of `segments` and `timeline` as an SVG document titled `title`, with a marker
/// at `peak_op` on the timeline. Any of them may be empty: with nothing at all, the document
/// says there is nothing to draw.
pub fn render(title: &str, segments: &[SvgSegment], timeline: &[TimelinePoint], peak_op: Option<u64>) -> String {
    let mut body = String::new();
    let _ = writeln!(body, "<text x=\"8\" y=\"24\" font-size=\"16\" font-weight=\"bold\">{}</text>", esc(title));
    let end = if segments.is_empty() && timeline.is_empty() {
        body.push_str("<text x=\"8\" y=\"52\">nothing to draw: no segments and no timeline</text>\n");
        60
    } else {
        let y = draw_segments(&mut body, segments, 44);
        if timeline.is_empty() {
            let _ = writeln!(body, "<text x=\"8\" y=\"{}\">no timeline</text>", y + 20);
            y + 28
        } else {
            draw_timeline(&mut body, timeline, peak_op, y + 24)
        }
    };
    let height = end + 16;
    let mut s = String::with_capacity(body.len() + 512);
    s.push_str("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" \
         viewBox=\"0 0 {WIDTH} {height}\" font-family=\"monospace\" font-size=\"11\">"
    );
    let _ = writeln!(s, "<title>{}</title>", esc(title));
    let _ = writeln!(s, "<rect width=\"{WIDTH}\" height=\"{height}\" fill=\"#ffffff\"/>");
    s.push_str(&body);
    s.push_str("</svg>\n");
    s
}

/// A part of a segment in one state: `[start, end)`, and whether it is one of the blocks
/// (not a gap between them).
#[derive(Debug, Clone, Copy)]
struct Piece {
    start: u128,
    end: u128,
    state: SvgState,
    block: bool,
}

/// The segment as pieces in offset order covering `[0, size)`: its blocks, cut to the
/// segment and to what the blocks before them left, and the gaps between them (unmapped).
fn pieces(seg: &SvgSegment, mut f: impl FnMut(Piece)) {
    let size = seg.size as u128;
    let sorted;
    let blocks: &[SvgBlock] = if seg.blocks.is_sorted_by_key(|b| b.offset) {
        &seg.blocks
    } else {
        let mut v = seg.blocks.clone();
        v.sort_by_key(|b| b.offset);
        sorted = v;
        &sorted
    };
    let mut cursor = 0u128;
    for b in blocks {
        let start = (b.offset as u128).max(cursor).min(size);
        let end = (b.offset as u128 + b.size as u128).min(size);
        if start > cursor {
            f(Piece { start: cursor, end: start, state: SvgState::Unmapped, block: false });
        }
        if end > start {
            f(Piece { start, end, state: b.state, block: true });
            cursor = end;
        }
        cursor = cursor.max(start);
    }
    if cursor < size {
        f(Piece { start: cursor, end: size, state: SvgState::Unmapped, block: false });
    }
}

/// Bytes of each state in the segment.
fn totals(seg: &SvgSegment) -> [u128; 4] {
    let mut t = [0u128; 4];
    pieces(seg, |p| t[p.state.index()] += p.end - p.start);
    t
}

/// Pixels `[px0, px1)` of a segment drawn in one state, with the bytes of each state under
/// them and the number of blocks starting in them.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Run {
    px0: u64,
    px1: u64,
    state: SvgState,
    bytes: [u128; 4],
    blocks: u64,
}

fn push_run(runs: &mut Vec<Run>, px0: u64, px1: u64, bytes: [u128; 4], blocks: u64) {
    // The state holding most bytes; a tie goes to the first in `SvgState::ALL`.
    let mut state = SvgState::Allocated;
    for s in SvgState::ALL {
        if bytes[s.index()] > bytes[state.index()] {
            state = s;
        }
    }
    match runs.last_mut() {
        Some(last) if last.state == state && last.px1 == px0 => {
            last.px1 = px1;
            for (a, b) in last.bytes.iter_mut().zip(bytes) {
                *a += b;
            }
            last.blocks += blocks;
        }
        _ => runs.push(Run { px0, px1, state, bytes, blocks }),
    }
}

/// The segment at `n` bytes per pixel: runs of pixels in one state. A pixel holding several
/// pieces takes the state with most bytes in it; whole pixels of one piece go in one step, so
/// the cost is that of the blocks plus the pixels.
fn raster(seg: &SvgSegment, n: u64) -> Vec<Run> {
    let n = n as u128;
    let size = seg.size as u128;
    let mut runs = Vec::new();
    // The pixel being filled: its index, bytes by state and blocks starting in it.
    let (mut acc, mut acc_blocks) = ([0u128; 4], 0u64);
    pieces(seg, |p| {
        let mut a = p.start;
        let mut fresh = p.block;
        while a < p.end {
            let px = a / n;
            if a % n == 0 && acc == [0; 4] {
                // The whole pixels from `px` that the piece covers (the last pixel of the
                // segment may be short).
                let full = if p.end == size { p.end.div_ceil(n) } else { p.end / n };
                if full > px {
                    let end = (full * n).min(size);
                    let mut bytes = [0u128; 4];
                    bytes[p.state.index()] = end - a;
                    push_run(&mut runs, px as u64, full as u64, bytes, u64::from(fresh));
                    fresh = false;
                    a = end;
                    continue;
                }
            }
            let pend = ((px + 1) * n).min(size);
            let take = p.end.min(pend) - a;
            acc[p.state.index()] += take;
            acc_blocks += u64::from(fresh);
            fresh = false;
            a += take;
            if a == pend {
                push_run(&mut runs, px as u64, px as u64 + 1, acc, acc_blocks);
                (acc, acc_blocks) = ([0; 4], 0);
            }
        }
    });
    runs
}

/// Bytes per pixel: a power of two such that the segments take at most `PIXEL_BUDGET`
/// pixels and the largest at most `MAX_ROWS_LARGEST` rows.
fn scale(total: u128, largest: u128) -> u64 {
    let need = total.div_ceil(PIXEL_BUDGET as u128).max(largest.div_ceil((ROW_PX * MAX_ROWS_LARGEST) as u128)).max(1);
    let need = u64::try_from(need).unwrap_or(u64::MAX);
    need.checked_next_power_of_two().unwrap_or(1 << 63)
}

/// Draws the summary, the legend and the segments from `y`; returns the `y` below them.
fn draw_segments(out: &mut String, segments: &[SvgSegment], mut y: u64) -> u64 {
    if segments.is_empty() {
        let _ = writeln!(out, "<text x=\"8\" y=\"{y}\">no segments</text>");
        return y + 8;
    }
    let mut all = [0u128; 4];
    for seg in segments {
        for (a, b) in all.iter_mut().zip(totals(seg)) {
            *a += b;
        }
    }
    let drawn = &segments[..segments.len().min(MAX_SEGMENTS)];
    let total: u128 = drawn.iter().map(|s| s.size as u128).sum();
    let largest = drawn.iter().map(|s| s.size as u128).max().unwrap_or(0);
    let n = scale(total, largest);
    let all_size: u128 = segments.iter().map(|s| s.size as u128).sum();
    let (alloc, cached) = (all[SvgState::Allocated.index()], all[SvgState::Cached.index()]);
    let cached_share = if alloc + cached > 0 { cached as f64 * 100.0 / (alloc + cached) as f64 } else { 0.0 };
    let _ = writeln!(
        out,
        "<text x=\"8\" y=\"{y}\">{} segment{} spanning {}; cached {cached_share:.1}% of backed bytes; \
         1 px = {}, a row = {}</text>",
        segments.len(),
        if segments.len() == 1 { "" } else { "s" },
        human(all_size),
        human(n as u128),
        human(n as u128 * ROW_PX as u128)
    );
    // The legend: the states present, with their totals.
    y += 16;
    let mut x = 8;
    for s in SvgState::ALL {
        let bytes = all[s.index()];
        if bytes == 0 {
            continue;
        }
        let _ = writeln!(
            out,
            "<g><title>{}: {}</title><rect x=\"{x}\" y=\"{y}\" width=\"12\" height=\"12\" fill=\"{}\"/>\
             <text x=\"{}\" y=\"{}\">{}: {bytes} B ({:.2} MiB)</text></g>",
            s.name(),
            s.meaning(),
            s.colour(),
            x + 16,
            y + 10,
            s.name(),
            bytes as f64 / MIB
        );
        x += 360;
    }
    y += 28;
    for seg in drawn {
        y = draw_segment(out, seg, n, y);
    }
    if segments.len() > drawn.len() {
        let rest: u128 = segments[drawn.len()..].iter().map(|s| s.size as u128).sum();
        let _ = writeln!(
            out,
            "<text x=\"8\" y=\"{}\">{} more segments not drawn ({}; counted in the totals)</text>",
            y + 10,
            segments.len() - drawn.len(),
            human(rest)
        );
        y += 16;
    }
    y
}

/// Draws one segment at `n` bytes per pixel from `y`; returns the `y` of the next one.
fn draw_segment(out: &mut String, seg: &SvgSegment, n: u64, y: u64) -> u64 {
    let px = (seg.size as u128).div_ceil(n as u128) as u64;
    let rows = px.div_ceil(ROW_PX).max(1);
    let label: String = if seg.label.chars().count() > LABEL_CHARS {
        seg.label.chars().take(LABEL_CHARS - 1).chain(['…']).collect()
    } else {
        seg.label.clone()
    };
    let _ = writeln!(
        out,
        "<g><title>{} at {:#x}: {} ({} B)</title><text x=\"8\" y=\"{}\">{}</text>\
         <text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text></g>",
        esc(&seg.label),
        seg.address,
        human(seg.size as u128),
        seg.size,
        y + 11,
        esc(&label),
        LEFT - 6,
        y + 11,
        human(seg.size as u128)
    );
    let runs = raster(seg, n);
    for s in SvgState::ALL {
        let mut opened = false;
        for r in runs.iter().filter(|r| r.state == s) {
            if !opened {
                let _ = writeln!(out, "<g fill=\"{}\">", s.colour());
                opened = true;
            }
            let title = run_title(seg, n, r);
            // The run, cut where the rows wrap.
            let mut p = r.px0;
            while p < r.px1 {
                let row_end = (p / ROW_PX + 1) * ROW_PX;
                let q = r.px1.min(row_end);
                let _ = writeln!(
                    out,
                    "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{ROW_H}\"><title>{title}</title></rect>",
                    LEFT + p % ROW_PX,
                    y + p / ROW_PX * ROW_STEP,
                    q - p
                );
                p = q;
            }
        }
        if opened {
            out.push_str("</g>\n");
        }
    }
    y + rows * ROW_STEP + SEG_GAP
}

/// A run's tooltip: where, how much, what, and what else lies under its pixels.
fn run_title(seg: &SvgSegment, n: u64, r: &Run) -> String {
    let start = r.px0 as u128 * n as u128;
    let end = (r.px1 as u128 * n as u128).min(seg.size as u128);
    let mut t = format!("{:#x} +{}: {}", seg.address as u128 + start, human(end - start), r.state.name());
    if r.blocks > 1 {
        let _ = write!(t, ", {} blocks", r.blocks);
    }
    if r.bytes.iter().filter(|&&b| b > 0).count() > 1 {
        t.push_str(" (mixed:");
        for s in SvgState::ALL {
            if r.bytes[s.index()] > 0 {
                let _ = write!(t, " {} {}", human(r.bytes[s.index()]), s.name());
            }
        }
        t.push(')');
    }
    t
}

/// The (op, value) points of one line: all of them, or for a long timeline the minimum and the
/// maximum of each of `MAX_POINTS / 2` buckets, in op order.
fn downsample(tl: &[TimelinePoint], get: impl Fn(&TimelinePoint) -> u64) -> Vec<(u64, u64)> {
    if tl.len() <= MAX_POINTS {
        return tl.iter().map(|p| (p.op, get(p))).collect();
    }
    let buckets = MAX_POINTS / 2;
    let mut out = Vec::with_capacity(MAX_POINTS);
    for b in 0..buckets {
        let (lo, hi) = (b * tl.len() / buckets, (b + 1) * tl.len() / buckets);
        if lo == hi {
            continue;
        }
        let (mut min, mut max) = (lo, lo);
        let (mut vmin, mut vmax) = (get(&tl[lo]), get(&tl[lo]));
        for (i, p) in tl.iter().enumerate().take(hi).skip(lo + 1) {
            let v = get(p);
            if v < vmin {
                (min, vmin) = (i, v);
            }
            if v > vmax {
                (max, vmax) = (i, v);
            }
        }
        let (first, second) = (min.min(max), min.max(max));
        out.push((tl[first].op, get(&tl[first])));
        if second != first {
            out.push((tl[second].op, get(&tl[second])));
        }
    }
    out
}

/// An axis from 0 over `max` in steps of 1, 2 or 5 times a power of ten: (step, steps,
/// decimals for the labels).
fn nice_axis(max: f64) -> (f64, u32, usize) {
    let max = if max > 0.0 && max.is_finite() { max } else { 1.0 };
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * mag).find(|&s| s >= raw).unwrap_or(10.0 * mag);
    let steps = (max / step).ceil().max(1.0) as u32;
    let decimals = (-step.log10().floor()).max(0.0) as usize;
    (step, steps, decimals)
}

/// Draws the timeline from `y`; returns the `y` below it.
fn draw_timeline(out: &mut String, tl: &[TimelinePoint], peak_op: Option<u64>, y: u64) -> u64 {
    let _ = writeln!(
        out,
        "<text x=\"8\" y=\"{y}\" font-weight=\"bold\">reserved, allocated and requested bytes over op index</text>"
    );
    let top = y + 24;
    let bottom = top + PLOT_H;
    let (op_min, op_max) = tl.iter().fold((u64::MAX, 0), |(lo, hi), p| (lo.min(p.op), hi.max(p.op)));
    let span = op_max.saturating_sub(op_min).max(1) as f64;
    let vmax = tl.iter().map(|p| p.reserved.max(p.allocated).max(p.requested)).max().unwrap_or(0);
    let (step, steps, decimals) = nice_axis(vmax as f64 / MIB);
    let ymax = step * f64::from(steps);
    let xof = |op: u64| LEFT as f64 + (op.saturating_sub(op_min)) as f64 / span * ROW_PX as f64;
    let yof = |v: u64| bottom as f64 - (v as f64 / MIB) / ymax * PLOT_H as f64;
    // Grid and axes.
    for i in 0..=steps {
        let v = step * f64::from(i);
        let yy = bottom as f64 - v / ymax * PLOT_H as f64;
        let _ = writeln!(
            out,
            "<line x1=\"{LEFT}\" y1=\"{yy:.1}\" x2=\"{}\" y2=\"{yy:.1}\" stroke=\"#eeeeee\"/>\
             <text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{v:.decimals$}</text>",
            LEFT + ROW_PX,
            LEFT - 6,
            yy + 4.0
        );
    }
    let _ = writeln!(out, "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">MiB</text>", LEFT - 6, top - 10);
    let _ = writeln!(out, "<path d=\"M{LEFT} {top}V{bottom}H{}\" fill=\"none\" stroke=\"#000000\"/>", LEFT + ROW_PX);
    for i in 0..=5u64 {
        let op = op_min + ((op_max - op_min) as u128 * i as u128 / 5) as u64;
        let x = xof(op);
        let _ = writeln!(
            out,
            "<line x1=\"{x:.1}\" y1=\"{bottom}\" x2=\"{x:.1}\" y2=\"{}\" stroke=\"#000000\"/>\
             <text x=\"{x:.1}\" y=\"{}\" text-anchor=\"middle\">{op}</text>",
            bottom + 4,
            bottom + 16
        );
    }
    let _ = writeln!(out, "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">op</text>", LEFT + ROW_PX, bottom + 30);
    // The lines, requested drawn first: where it equals allocated, allocated shows.
    type Get = fn(&TimelinePoint) -> u64;
    let lines: [(&str, &str, &str, Get); 3] = [
        ("reserved", "#222222", "", |p| p.reserved),
        ("allocated", SvgState::Allocated.colour(), "", |p| p.allocated),
        ("requested", "#228833", " stroke-dasharray=\"6 3\"", |p| p.requested),
    ];
    for &(name, colour, dash, get) in lines.iter().rev() {
        let _ = write!(out, "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.5\"{dash} points=\"");
        for (i, (op, v)) in downsample(tl, get).into_iter().enumerate() {
            if i > 0 {
                out.push(' ');
            }
            let _ = write!(out, "{:.1},{:.1}", xof(op), yof(v));
        }
        let _ = writeln!(out, "\"><title>{name}</title></polyline>");
    }
    if let Some(p) = peak_op.filter(|p| (op_min..=op_max).contains(p)) {
        let x = xof(p);
        let _ = writeln!(
            out,
            "<line x1=\"{x:.1}\" y1=\"{top}\" x2=\"{x:.1}\" y2=\"{bottom}\" stroke=\"#cc3311\" stroke-dasharray=\"4 3\"/>\
             <text x=\"{:.1}\" y=\"{}\" fill=\"#cc3311\">peak, op {p}</text>",
            x + 4.0,
            top + 10
        );
    }
    // The legend.
    let ly = bottom + 44;
    for (i, (name, colour, dash, _)) in lines.iter().enumerate() {
        let x = LEFT + i as u64 * 200;
        let _ = writeln!(
            out,
            "<line x1=\"{x}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{colour}\" stroke-width=\"2\"{dash}/>\
             <text x=\"{}\" y=\"{ly}\">{name}</text>",
            ly - 4,
            x + 24,
            ly - 4,
            x + 30
        );
    }
    ly + 4
}

/// `bytes` for people: B, KiB, MiB or GiB.
fn human(bytes: u128) -> String {
    let b = bytes as f64;
    if bytes < 1024 {
        format!("{bytes} B")
    } else if b < MIB {
        format!("{:.1} KiB", b / 1024.0)
    } else if b < MIB * 1024.0 {
        format!("{:.2} MiB", b / MIB)
    } else {
        format!("{:.2} GiB", b / MIB / 1024.0)
    }
}

/// `s` as XML text or attribute value: markup characters escaped, characters XML cannot hold
/// replaced by U+FFFD.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(c),
            c if (c as u32) < 0x20 || c == '\u{fffe}' || c == '\u{ffff}' => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checks that `s` is well-formed XML as far as this module writes it (declaration,
    /// elements, attributes in double quotes, text, the five named entities and character
    /// references); returns the number of elements.
    fn check_xml(s: &str) -> Result<usize, String> {
        let b = s.as_bytes();
        let name_byte = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b':' | b'.');
        let mut stack: Vec<&str> = Vec::new();
        let (mut i, mut roots, mut elements) = (0, 0, 0);
        if !s.starts_with("<?xml ") {
            return Err("no XML declaration".into());
        }
        i += s.find("?>").ok_or("unterminated declaration")? + 2;
        while i < b.len() {
            if b[i] != b'<' {
                let end = s[i..].find('<').map_or(s.len(), |e| i + e);
                let text = &s[i..end];
                if stack.is_empty() && !text.trim().is_empty() {
                    return Err(format!("text outside the root at {i}"));
                }
                entities(text).map_err(|e| format!("{e} at {i}"))?;
                i = end;
                continue;
            }
            if s[i..].starts_with("</") {
                let end = i + s[i..].find('>').ok_or(format!("unterminated end tag at {i}"))?;
                let name = &s[i + 2..end];
                match stack.pop() {
                    Some(open) if open == name => {}
                    other => return Err(format!("</{name}> at {i} closes {other:?}")),
                }
                i = end + 1;
                continue;
            }
            let mut j = i + 1;
            while j < b.len() && name_byte(b[j]) {
                j += 1;
            }
            let name = &s[i + 1..j];
            if name.is_empty() {
                return Err(format!("bad tag at {i}"));
            }
            if stack.is_empty() {
                roots += 1;
            }
            elements += 1;
            let mut attrs: Vec<&str> = Vec::new();
            loop {
                let ws = j;
                while j < b.len() && b[j].is_ascii_whitespace() {
                    j += 1;
                }
                if s[j..].starts_with("/>") {
                    j += 2;
                    break;
                }
                if s[j..].starts_with('>') {
                    j += 1;
                    stack.push(name);
                    break;
                }
                if j == ws {
                    return Err(format!("no space before the attribute at {j}"));
                }
                let a0 = j;
                while j < b.len() && name_byte(b[j]) {
                    j += 1;
                }
                let attr = &s[a0..j];
                if attr.is_empty() || attrs.contains(&attr) || !s[j..].starts_with("=\"") {
                    return Err(format!("bad or repeated attribute at {a0}"));
                }
                attrs.push(attr);
                let v0 = j + 2;
                let v1 = v0 + s[v0..].find('"').ok_or(format!("unterminated attribute at {a0}"))?;
                if s[v0..v1].contains('<') {
                    return Err(format!("'<' in the attribute at {a0}"));
                }
                entities(&s[v0..v1]).map_err(|e| format!("{e} at {a0}"))?;
                j = v1 + 1;
            }
            i = j;
        }
        match (stack.last(), roots) {
            (None, 1) => Ok(elements),
            (Some(open), _) => Err(format!("<{open}> is not closed")),
            (None, n) => Err(format!("{n} root elements")),
        }
    }

    fn entities(t: &str) -> Result<(), String> {
        for (k, _) in t.match_indices('&') {
            let rest = &t[k + 1..];
            let semi = rest.find(';').ok_or("'&' without ';'")?;
            let e = &rest[..semi];
            let ok = matches!(e, "amp" | "lt" | "gt" | "quot" | "apos")
                || e.strip_prefix('#').is_some_and(|d| !d.is_empty() && d.bytes().all(|c| c.is_ascii_digit()));
            if !ok {
                return Err(format!("bad entity &{e};"));
            }
        }
        Ok(())
    }

    fn block(offset: usize, size: usize, state: SvgState) -> SvgBlock {
        SvgBlock { offset, size, state }
    }

    fn seg(address: usize, size: usize, blocks: Vec<SvgBlock>) -> SvgSegment {
        SvgSegment { address, size, label: format!("{address:#x}"), blocks }
    }

    /// The `<g fill="...">` groups of rectangles drawn in `colour`.
    fn drawn(svg: &str, s: SvgState) -> bool {
        svg.contains(&format!("<g fill=\"{}\">\n<rect", s.colour()))
    }

    #[test]
    fn checker_catches_broken_xml() {
        let ok = "<?xml version=\"1.0\"?>\n<svg a=\"1\"><g><rect b=\"&amp;\"/></g>t &lt; u</svg>\n";
        assert_eq!(check_xml(ok), Ok(3));
        for bad in [
            "<?xml version=\"1.0\"?><svg><g></svg></g>",
            "<?xml version=\"1.0\"?><svg a=\"1\" a=\"2\"/>",
            "<?xml version=\"1.0\"?><svg>a & b</svg>",
            "<?xml version=\"1.0\"?><svg a=\"<\"/>",
            "<?xml version=\"1.0\"?><svg/><svg/>",
            "<?xml version=\"1.0\"?><svg>",
            "<?xml version=\"1.0\"?><svg a=\"1\"b=\"2\"/>",
        ] {
            assert!(check_xml(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn each_state_gets_its_colour_and_its_total() {
        let mib = 1 << 20;
        let s = seg(
            0x7f00_0000_0000,
            8 * mib,
            vec![
                block(0, 2 * mib, SvgState::Allocated),
                block(2 * mib, mib, SvgState::Cached),
                block(3 * mib, 3 * mib, SvgState::Punched),
                // [6, 8) MiB is covered by no block: unmapped.
            ],
        );
        let svg = render("all states", &[s], &[], None);
        check_xml(&svg).unwrap();
        for (state, bytes) in [
            (SvgState::Allocated, 2 * mib),
            (SvgState::Cached, mib),
            (SvgState::Punched, 3 * mib),
            (SvgState::Unmapped, 2 * mib),
        ] {
            assert!(drawn(&svg, state), "{state:?} drawn");
            let legend = format!("{}: {bytes} B ({:.2} MiB)", state.name(), bytes as f64 / MIB);
            assert!(svg.contains(&legend), "legend {legend}");
        }
        assert!(svg.contains("cached 33.3% of backed bytes"));
        assert!(svg.contains("no timeline"));

        // Only what is present: no legend or rectangles for the other states.
        let svg = render("one", &[seg(0, 4096, vec![block(0, 4096, SvgState::Allocated)])], &[], None);
        check_xml(&svg).unwrap();
        assert!(drawn(&svg, SvgState::Allocated));
        for absent in [SvgState::Cached, SvgState::Punched, SvgState::Unmapped] {
            assert!(!svg.contains(absent.colour()), "{absent:?} absent");
        }
    }

    #[test]
    fn text_is_escaped() {
        let mut s = seg(0, 1024, vec![block(0, 1024, SvgState::Cached)]);
        s.label = "<pool & \"stream\" 'x'>\u{1}".into();
        let tl = [TimelinePoint { op: 0, reserved: 1024, allocated: 0, requested: 0 }];
        let svg = render("a<b & \"c\"", &[s], &tl, Some(0));
        check_xml(&svg).unwrap();
        assert!(svg.contains("<title>a&lt;b &amp; &quot;c&quot;</title>"));
        assert!(svg.contains("&lt;pool &amp; &quot;stream&quot; &apos;x&apos;&gt;\u{fffd}"));
        assert!(!svg.contains("a<b"));
    }

    #[test]
    fn nothing_to_draw() {
        let svg = render("", &[], &[], Some(3));
        assert_eq!(check_xml(&svg), Ok(5));
        assert!(svg.contains("nothing to draw"));
        // A timeline alone, and an empty segment.
        let tl = [TimelinePoint { op: 5, reserved: 0, allocated: 0, requested: 0 }];
        let svg = render("t", &[], &tl, Some(5));
        check_xml(&svg).unwrap();
        assert!(svg.contains("no segments") && svg.contains("peak, op 5"));
        let svg = render("t", &[seg(0, 0, vec![block(0, 10, SvgState::Allocated)])], &[], None);
        check_xml(&svg).unwrap();
    }

    #[test]
    fn subpixel_blocks_take_the_majority_and_runs_merge() {
        let s = seg(
            0x1000,
            4096 + 100,
            vec![
                block(0, 700, SvgState::Allocated),
                block(700, 324, SvgState::Cached),
                block(1024, 1024, SvgState::Cached),
                block(2048, 1000, SvgState::Cached),
                block(3048, 1048, SvgState::Allocated),
                // [4096, 4196) unmapped: a short last pixel.
            ],
        );
        let runs = raster(&s, 1024);
        let states: Vec<_> = runs.iter().map(|r| (r.px0, r.px1, r.state)).collect();
        assert_eq!(
            states,
            [
                (0, 1, SvgState::Allocated),
                (1, 3, SvgState::Cached),
                (3, 4, SvgState::Allocated),
                (4, 5, SvgState::Unmapped)
            ]
        );
        assert_eq!(runs[0].bytes, [700, 324, 0, 0]);
        assert_eq!(runs[1].bytes, [24, 2024, 0, 0]);
        assert_eq!((runs[0].blocks, runs[1].blocks), (2, 3));
        assert_eq!(
            run_title(&s, 1024, &runs[1]),
            "0x1400 +2.0 KiB: cached, 3 blocks (mixed: 24 B allocated 2.0 KiB cached)"
        );
        // Bytes add up whatever the scale.
        for n in [1, 7, 512, 4096, 1 << 20] {
            let sum: u128 = raster(&s, n).iter().flat_map(|r| r.bytes).sum();
            assert_eq!(sum, 4196, "at {n} bytes per pixel");
        }
    }

    #[test]
    fn unsorted_overlapping_and_oversized_blocks_are_cut() {
        let s = seg(
            0,
            4096,
            vec![
                block(2048, 4096, SvgState::Cached),
                block(0, 1024, SvgState::Allocated),
                block(512, 1024, SvgState::Punched),
            ],
        );
        assert_eq!(totals(&s), [1024, 2048, 512, 512]);
        let svg = render("cut", &[s], &[], None);
        check_xml(&svg).unwrap();
    }

    #[test]
    fn huge_inputs_stay_small() {
        // 200,000 blocks of varied sizes, alternating states, in one segment.
        let mut blocks = Vec::new();
        let mut off = 0;
        for i in 0..200_000usize {
            let size = 512 * (1 + (i * 7919) % 13);
            let state = [SvgState::Allocated, SvgState::Cached, SvgState::Punched][i % 3];
            blocks.push(block(off, size, state));
            off += size;
        }
        let big = seg(0x7f00_0000_0000, off + (1 << 20), blocks);
        // And many small segments.
        let mut segs = vec![big];
        for i in 0..1500 {
            segs.push(seg(0x1000_0000 + i * (2 << 20), 2 << 20, vec![block(0, 1 << 20, SvgState::Allocated)]));
        }
        let tl: Vec<_> = (0..1_000_000u64)
            .map(|op| {
                let v = if op == 777_777 { 5000 << 20 } else { (op % 1000) << 20 };
                TimelinePoint { op, reserved: v, allocated: v / 2, requested: v / 3 }
            })
            .collect();
        let svg = render("huge", &segs, &tl, Some(777_777));
        assert!(svg.len() < 4 << 20, "{} bytes", svg.len());
        check_xml(&svg).unwrap();
        assert!(svg.contains("501 more segments not drawn"));
        assert!(svg.contains("peak, op 777777"));
        for line in svg.lines().filter(|l| l.starts_with("<polyline")) {
            assert!(line.matches(',').count() <= MAX_POINTS, "{} points", line.matches(',').count());
        }
        // The spike survives downsampling.
        let pts = downsample(&tl, |p| p.reserved);
        assert!(pts.len() <= MAX_POINTS);
        assert!(pts.contains(&(777_777, 5000 << 20)));
        assert!(pts.windows(2).all(|w| w[0].0 < w[1].0), "op order");

        // The worst case: blocks of one pixel each, alternating, filling the pixel budget.
        let segs: Vec<_> = (0..4)
            .map(|s| {
                let blocks = (0..9000)
                    .map(|i| block(i << 16, 1 << 16, if i % 2 == 0 { SvgState::Allocated } else { SvgState::Cached }))
                    .collect();
                seg(0x7f00_0000_0000 + s * (1 << 32), 9000 << 16, blocks)
            })
            .collect();
        let svg = render("worst", &segs, &[], None);
        assert_eq!(svg.matches("<rect").count(), 36_000 + 1 + 2, "one per block, the background, the legend");
        assert!(svg.len() < 4 << 20, "{} bytes", svg.len());
        check_xml(&svg).unwrap();
    }

    #[test]
    fn scale_is_a_power_of_two_within_budget() {
        assert_eq!(scale(0, 0), 1);
        let mib = 1u128 << 20;
        let n = scale(20 * mib, 20 * mib);
        assert!(n.is_power_of_two());
        assert!((20 * mib).div_ceil(n as u128) <= (ROW_PX * MAX_ROWS_LARGEST) as u128);
        let n = scale(1 << 40, 2 * mib);
        assert!((1u128 << 40).div_ceil(n as u128) <= PIXEL_BUDGET as u128);
        assert_eq!(scale(u128::MAX, u128::MAX), 1 << 63);
    }

    #[test]
    fn axis_steps() {
        assert_eq!(nice_axis(0.0), (0.2, 5, 1));
        assert_eq!(nice_axis(900.0), (200.0, 5, 0));
        assert_eq!(nice_axis(3.0), (1.0, 3, 0));
        let (step, steps, _) = nice_axis(0.0123);
        assert!(step * f64::from(steps) >= 0.0123 && steps <= 5);
    }
}
