//! `dmabuf-rt svg SNAPSHOT.json -o OUT.svg`: the picture of an allocator snapshot
//! ([`dmabuf_rt::caching::svg`]).
//!
//! The snapshot is the JSON of `Snapshot::to_json` (`{"segments":[...]}`), of the C ABI's
//! `dmabuf_rt_snapshot_json` (the same segments, with the allocator's history as `"trace"`),
//! or of PyTorch's `torch.cuda.memory._snapshot()` dumped as JSON (`"device_traces"`, one
//! list of trace entries per device). Segments are `{"address","total_size","pool" or
//! "segment_type","stream","is_expandable","blocks":[...]}`; a block has a `"size"`, a
//! `"state"` (`active_allocated` and `active_pending_free` are drawn as allocated, `inactive`
//! as cached) and its place as an `"offset"` in the segment (this library), an absolute
//! `"address"` (PyTorch), or neither (right after the previous block).
//!
//! An expandable segment comes as one segment per backed run: the runs of one reservation
//! (consecutive expandable segments of the same stream and pool) are drawn as one segment,
//! the gaps between them as punched pages.
//!
//! With trace entries, the timeline's x axis is the entry's index and its lines the running
//! sums of `alloc` minus `free_completed` (allocated; requested is not in the trace, so it is
//! drawn as allocated) and of `segment_alloc` and `segment_map` minus `segment_free` and
//! `segment_unmap` (reserved). A history is bounded (it keeps the most recent events), so the
//! sums are anchored at the end to the snapshot's own totals (the snapshot is taken with the
//! history): they start where the history starts, not at zero. The marker is at the
//! reserved peak.

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};

use dmabuf_rt::caching::svg::{self, SvgBlock, SvgSegment, SvgState, TimelinePoint};

use crate::files;

/// Runs `dmabuf-rt svg SNAPSHOT.json -o OUT.svg [--title TEXT] [--device N]` (`-` as the
/// snapshot: standard input; `-o -`: to standard output).
pub(crate) fn run(args: &[OsString]) -> Result<(), String> {
    let (mut input, mut output, mut title, mut device): (Option<PathBuf>, Option<PathBuf>, _, _) =
        (None, None, None, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.to_str() {
            Some("-o" | "--output") => {
                output = Some(it.next().ok_or("-o takes the SVG file to write (- for stdout)")?.into())
            }
            Some("--title") => title = Some(files::text_value(it.next(), "--title", "a text")?.to_string()),
            Some("--device") => {
                const WANT: &str = "a device index (0, 1, ...)";
                device = Some(
                    files::text_value(it.next(), "--device", WANT)?
                        .parse::<u64>()
                        .map_err(|_| format!("--device takes {WANT}"))?,
                )
            }
            Some(f) if f.starts_with('-') && f != "-" => return Err(format!("unexpected argument `{f}`")),
            _ if input.is_none() => input = Some(a.into()),
            _ => return Err(format!("unexpected argument `{}`", a.to_string_lossy())),
        }
    }
    let input = input.ok_or("missing the snapshot file (SNAPSHOT.json)")?;
    let output = output.ok_or("missing -o OUT.svg")?;
    files::refuse_same_file(&input, &output)?;
    let text = files::read_input(&input)?;
    let name = if input == Path::new("-") { "standard input".to_string() } else { input.display().to_string() };
    let doc = parse_json(&text).map_err(|e| format!("{name}: {e}"))?;
    drop(text);
    let pic = picture(&doc, device).map_err(|e| format!("{name}: {e}"))?;
    for note in &pic.notes {
        eprintln!("dmabuf-rt svg: {note}");
    }
    let mut title = title.unwrap_or_else(|| format!("{}: memory snapshot", input.display()));
    if !pic.allocs_in_trace && !pic.timeline.is_empty() {
        title.push_str(" (no alloc/free in the trace: allocated not drawn)");
    }
    let out = svg::render(&title, &pic.segments, &pic.timeline, pic.peak_op);
    if output == Path::new("-") {
        files::write_stdout(out.as_bytes())?;
    } else {
        files::write_file(&output, out.as_bytes())?;
        eprintln!(
            "dmabuf-rt svg: wrote {} ({} bytes): {} segments, {} timeline points",
            output.display(),
            out.len(),
            pic.segments.len(),
            pic.timeline.len()
        );
    }
    Ok(())
}

/// A JSON value.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Json {
    /// `null`.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// A number.
    Num(Num),
    /// A string, its escapes decoded.
    Str(String),
    /// An array.
    Arr(Vec<Json>),
    /// An object's members in their order (a repeated key: the first counts).
    Obj(Vec<(String, Json)>),
}

/// A JSON number: an integer when it is one that fits, else a float.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Num {
    /// A non-negative integer.
    U(u64),
    /// A negative integer.
    I(i64),
    /// Anything else (a fraction, an exponent, or an integer too large).
    F(f64),
}

impl Json {
    /// The member `key` of an object.
    pub(crate) fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Obj(m) => m.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// A non-negative integer (a float only when it is a whole number that fits).
    pub(crate) fn as_u64(&self) -> Option<u64> {
        match *self {
            Json::Num(Num::U(v)) => Some(v),
            Json::Num(Num::I(v)) => u64::try_from(v).ok(),
            Json::Num(Num::F(f)) if f >= 0.0 && f.fract() == 0.0 && f < 18_446_744_073_709_551_616.0 => Some(f as u64),
            _ => None,
        }
    }

    /// A string.
    pub(crate) fn as_str(&self) -> Option<&str> {
        match self {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }

    /// A boolean.
    pub(crate) fn as_bool(&self) -> Option<bool> {
        match *self {
            Json::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// An array's items.
    pub(crate) fn as_array(&self) -> Option<&[Json]> {
        match self {
            Json::Arr(v) => Some(v),
            _ => None,
        }
    }
}

/// Why a text is not JSON, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct JsonError {
    /// Byte offset in the text.
    pub(crate) offset: usize,
    /// What is wrong there.
    pub(crate) msg: String,
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "not valid JSON at byte {}: {}", self.offset, self.msg)
    }
}

/// Arrays and objects nest at most this deep.
const MAX_DEPTH: usize = 512;

/// Parses `text` (RFC 8259; a leading byte order mark is skipped) into one value.
pub(crate) fn parse_json(text: &str) -> Result<Json, JsonError> {
    let mut p = Parser { src: text, s: text.as_bytes(), i: 0, depth: 0 };
    if text.starts_with('\u{feff}') {
        p.i = 3;
    }
    let v = p.value()?;
    p.ws();
    if p.i < p.s.len() {
        return Err(p.err_here("unexpected text after the value"));
    }
    Ok(v)
}

struct Parser<'a> {
    src: &'a str,
    s: &'a [u8],
    i: usize,
    depth: usize,
}

impl Parser<'_> {
    fn err(&self, offset: usize, msg: impl Into<String>) -> JsonError {
        JsonError { offset, msg: msg.into() }
    }

    /// An error at the current byte, naming what is there.
    fn err_here(&self, what: &str) -> JsonError {
        let found = match self.src[self.i..].chars().next() {
            None => "the end of the text".to_string(),
            Some(c) if c.is_ascii_graphic() => format!("'{c}'"),
            Some(c) => format!("{c:?}"),
        };
        self.err(self.i, format!("{what}, found {found}"))
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    fn value(&mut self) -> Result<Json, JsonError> {
        self.ws();
        match self.peek() {
            Some(b'{') => self.object(),
            Some(b'[') => self.array(),
            Some(b'"') => Ok(Json::Str(self.string()?)),
            Some(b't') => self.literal("true", Json::Bool(true)),
            Some(b'f') => self.literal("false", Json::Bool(false)),
            Some(b'n') => self.literal("null", Json::Null),
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => Err(self.err_here("expected a value")),
        }
    }

    fn literal(&mut self, word: &str, v: Json) -> Result<Json, JsonError> {
        if self.s[self.i..].starts_with(word.as_bytes()) {
            self.i += word.len();
            Ok(v)
        } else {
            Err(self.err(self.i, format!("expected `{word}`")))
        }
    }

    fn enter(&mut self) -> Result<(), JsonError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(self.err(self.i, format!("arrays and objects nested deeper than {MAX_DEPTH}")));
        }
        self.i += 1;
        Ok(())
    }

    fn array(&mut self) -> Result<Json, JsonError> {
        self.enter()?;
        let mut items = Vec::new();
        self.ws();
        if self.peek() == Some(b']') {
            self.i += 1;
        } else {
            loop {
                items.push(self.value()?);
                self.ws();
                match self.peek() {
                    Some(b',') => self.i += 1,
                    Some(b']') => {
                        self.i += 1;
                        break;
                    }
                    _ => return Err(self.err_here("expected ',' or ']' in an array")),
                }
            }
        }
        self.depth -= 1;
        Ok(Json::Arr(items))
    }

    fn object(&mut self) -> Result<Json, JsonError> {
        self.enter()?;
        let mut members = Vec::new();
        self.ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
        } else {
            loop {
                self.ws();
                if self.peek() != Some(b'"') {
                    return Err(self.err_here("expected a member name in double quotes"));
                }
                let key = self.string()?;
                self.ws();
                if self.peek() != Some(b':') {
                    return Err(self.err_here("expected ':' after the member name"));
                }
                self.i += 1;
                members.push((key, self.value()?));
                self.ws();
                match self.peek() {
                    Some(b',') => self.i += 1,
                    Some(b'}') => {
                        self.i += 1;
                        break;
                    }
                    _ => return Err(self.err_here("expected ',' or '}' in an object")),
                }
            }
        }
        self.depth -= 1;
        Ok(Json::Obj(members))
    }

    /// A string, from its opening quote.
    fn string(&mut self) -> Result<String, JsonError> {
        let open = self.i;
        self.i += 1;
        let mut out = String::new();
        let mut from = self.i;
        loop {
            match self.peek() {
                None => return Err(self.err(open, "unterminated string")),
                Some(b'"') => {
                    out.push_str(&self.src[from..self.i]);
                    self.i += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    out.push_str(&self.src[from..self.i]);
                    out.push(self.escape()?);
                    from = self.i;
                }
                Some(c) if c < 0x20 => return Err(self.err_here("control character in a string (escape it)")),
                Some(_) => self.i += 1,
            }
        }
    }

    /// An escape, from its backslash.
    fn escape(&mut self) -> Result<char, JsonError> {
        let at = self.i;
        self.i += 1;
        let c = match self.peek() {
            Some(b'"') => '"',
            Some(b'\\') => '\\',
            Some(b'/') => '/',
            Some(b'b') => '\u{8}',
            Some(b'f') => '\u{c}',
            Some(b'n') => '\n',
            Some(b'r') => '\r',
            Some(b't') => '\t',
            Some(b'u') => {
                self.i += 1;
                let hi = self.hex4()?;
                return match hi {
                    0xd800..=0xdbff => {
                        if !self.s[self.i..].starts_with(b"\\u") {
                            return Err(self.err(at, "high surrogate without its low surrogate"));
                        }
                        self.i += 2;
                        let lo = self.hex4()?;
                        if !(0xdc00..=0xdfff).contains(&lo) {
                            return Err(self.err(at, "high surrogate without its low surrogate"));
                        }
                        let c = 0x10000 + ((u32::from(hi) - 0xd800) << 10) + (u32::from(lo) - 0xdc00);
                        Ok(char::from_u32(c).expect("a surrogate pair is a scalar value"))
                    }
                    0xdc00..=0xdfff => Err(self.err(at, "low surrogate without a high surrogate")),
                    _ => Ok(char::from_u32(u32::from(hi)).expect("not a surrogate")),
                };
            }
            _ => return Err(self.err_here("unknown escape")),
        };
        self.i += 1;
        Ok(c)
    }

    fn hex4(&mut self) -> Result<u16, JsonError> {
        let digits = self.s.get(self.i..self.i + 4).filter(|d| d.iter().all(u8::is_ascii_hexdigit));
        let Some(digits) = digits else {
            return Err(self.err(self.i, "expected four hexadecimal digits after \\u"));
        };
        let v = digits.iter().fold(0u16, |v, &d| v * 16 + (d as char).to_digit(16).unwrap_or(0) as u16);
        self.i += 4;
        Ok(v)
    }

    fn digits(&mut self) -> Result<(), JsonError> {
        if !matches!(self.peek(), Some(b'0'..=b'9')) {
            return Err(self.err_here("expected a digit"));
        }
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.i += 1;
        }
        Ok(())
    }

    fn number(&mut self) -> Result<Json, JsonError> {
        let start = self.i;
        let neg = self.peek() == Some(b'-');
        if neg {
            self.i += 1;
        }
        if self.peek() == Some(b'0') {
            self.i += 1;
            if matches!(self.peek(), Some(b'0'..=b'9')) {
                return Err(self.err(self.i, "leading zero in a number"));
            }
        } else {
            self.digits()?;
        }
        let mut integer = true;
        if self.peek() == Some(b'.') {
            self.i += 1;
            self.digits()?;
            integer = false;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i += 1;
            }
            self.digits()?;
            integer = false;
        }
        let text = &self.src[start..self.i];
        let int = match (integer, neg) {
            (true, false) => text.parse().ok().map(Num::U),
            (true, true) => text.parse().ok().map(Num::I),
            (false, _) => None,
        };
        // The grammar checked above is a subset of what `f64::from_str` takes.
        let num = int.unwrap_or_else(|| Num::F(text.parse().unwrap_or(f64::NAN)));
        Ok(Json::Num(num))
    }
}

/// What a snapshot gives the picture.
#[derive(Debug, Default)]
pub(crate) struct Picture {
    /// Segments by address, the runs of an expandable segment as one.
    pub(crate) segments: Vec<SvgSegment>,
    /// One point per trace entry (empty without a trace).
    pub(crate) timeline: Vec<TimelinePoint>,
    /// The op of the reserved peak.
    pub(crate) peak_op: Option<u64>,
    /// Whether the trace has allocations and frees (the history records them only when asked
    /// to: `record_history`).
    pub(crate) allocs_in_trace: bool,
    /// Things the user should know (the picture is drawn anyway).
    pub(crate) notes: Vec<String>,
}

/// One segment of the snapshot, read.
struct RawSegment {
    address: u64,
    size: u64,
    pool: String,
    stream: u64,
    expandable: bool,
    blocks: Vec<SvgBlock>,
}

fn usize_of(v: u64, what: &str) -> Result<usize, String> {
    usize::try_from(v).map_err(|_| format!("{what} {v} does not fit this machine's address space"))
}

/// Reads segment `i`.
fn read_segment(i: usize, s: &Json) -> Result<RawSegment, String> {
    let address = s
        .get("address")
        .and_then(Json::as_u64)
        .ok_or(format!("segment {i}: no \"address\" (a non-negative integer)"))?;
    let ctx = format!("segment {i} (address {address:#x})");
    let size = s
        .get("total_size")
        .or_else(|| s.get("size"))
        .and_then(Json::as_u64)
        .ok_or(format!("{ctx}: no \"total_size\" (a non-negative integer)"))?;
    if address.checked_add(size).is_none() {
        return Err(format!("{ctx}: {size} bytes from there reach past the top of the 64-bit address space"));
    }
    let pool = s.get("pool").or_else(|| s.get("segment_type")).and_then(Json::as_str).unwrap_or("?").to_string();
    let stream = s.get("stream").and_then(Json::as_u64).unwrap_or(0);
    let expandable = s.get("is_expandable").and_then(Json::as_bool).unwrap_or(false);
    let list = match s.get("blocks") {
        None => &[][..],
        Some(b) => b.as_array().ok_or(format!("{ctx}: \"blocks\" is not an array"))?,
    };
    let mut blocks = Vec::with_capacity(list.len());
    let mut cursor = 0u64;
    for (j, b) in list.iter().enumerate() {
        let bsize = b
            .get("size")
            .and_then(Json::as_u64)
            .ok_or(format!("{ctx}, block {j}: no \"size\" (a non-negative integer)"))?;
        let offset = if let Some(o) = b.get("offset") {
            o.as_u64().ok_or(format!("{ctx}, block {j}: \"offset\" is not a non-negative integer"))?
        } else if let Some(a) = b.get("address") {
            let a = a.as_u64().ok_or(format!("{ctx}, block {j}: \"address\" is not a non-negative integer"))?;
            a.checked_sub(address).ok_or(format!("{ctx}, block {j}: address {a:#x} is before the segment"))?
        } else {
            cursor
        };
        if offset < cursor {
            return Err(format!(
                "{ctx}, block {j}: at offset {offset}, inside the block before it (which ends at {cursor})"
            ));
        }
        let end = offset
            .checked_add(bsize)
            .filter(|&e| e <= size)
            .ok_or(format!("{ctx}, block {j}: {bsize} bytes at offset {offset} go past the segment's {size} bytes"))?;
        let state = match b.get("state").and_then(Json::as_str) {
            Some("active_allocated" | "active_pending_free") => SvgState::Allocated,
            Some("inactive") => SvgState::Cached,
            Some(other) => return Err(format!("{ctx}, block {j}: unknown state {other:?}")),
            None => return Err(format!("{ctx}, block {j}: no \"state\"")),
        };
        blocks.push(SvgBlock { offset: usize_of(offset, "offset")?, size: usize_of(bsize, "size")?, state });
        cursor = end;
    }
    Ok(RawSegment { address, size, pool, stream, expandable, blocks })
}

/// The picture of snapshot `doc`: the segments of `device` (all without one), and the
/// timeline of its trace.
pub(crate) fn picture(doc: &Json, device: Option<u64>) -> Result<Picture, String> {
    let mut pic = Picture::default();
    let of = doc.get("device").and_then(Json::as_u64);
    if device.is_some() && of.is_some() && device != of {
        return Err(format!("this is a snapshot of device {}, not of device {}", of.unwrap_or(0), device.unwrap_or(0)));
    }
    let list = doc
        .get("segments")
        .ok_or("no \"segments\": not an allocator snapshot")?
        .as_array()
        .ok_or("\"segments\" is not an array")?;
    let mut raw = Vec::with_capacity(list.len());
    for (i, s) in list.iter().enumerate() {
        let of = s.get("device").and_then(Json::as_u64);
        if device.is_some() && of.is_some() && of != device {
            continue;
        }
        raw.push(read_segment(i, s)?);
    }
    raw.sort_by_key(|s| s.address);
    let reserved: u64 = raw.iter().map(|s| s.size).fold(0, u64::saturating_add);
    let allocated: u64 = raw
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state == SvgState::Allocated)
        .map(|b| b.size as u64)
        .fold(0, u64::saturating_add);
    pic.segments = group_runs(raw)?;
    if let Some(trace) = trace_of(doc, device, &mut pic.notes)? {
        timeline(&mut pic, trace, reserved, allocated)?;
    }
    Ok(pic)
}

/// The segments of a snapshot of this library, to draw (what `replay --svg` shows).
pub(crate) fn segments_of(snap: &dmabuf_rt::caching::Snapshot) -> Result<Vec<SvgSegment>, String> {
    let doc = parse_json(&snap.to_json()).map_err(|e| format!("the snapshot's JSON: {e}"))?;
    Ok(picture(&doc, None)?.segments)
}

/// The segments, the backed runs of an expandable segment (consecutive expandable segments of
/// one stream and pool, in address order) merged into one with its gaps punched.
fn group_runs(raw: Vec<RawSegment>) -> Result<Vec<SvgSegment>, String> {
    /// A segment out, with what groups runs.
    struct Out {
        seg: SvgSegment,
        pool: String,
        stream: u64,
        expandable: bool,
        /// Backed runs merged into it.
        runs: usize,
    }
    let mut out: Vec<Out> = Vec::new();
    for s in raw {
        if let Some(last) = out.last_mut() {
            // `read_segment` refused a segment whose end passes 2^64, and runs merge only in
            // address order, so a merged segment ends where its last run does: no sum below
            // overflows, and the checked ones say which segment if one did.
            let past_top = || format!("the segment at {:#x} reaches past the top of the address space", s.address);
            let last_end = (last.seg.address as u64).checked_add(last.seg.size as u64).ok_or_else(past_top)?;
            let same = (true, s.stream, &s.pool) == (last.expandable, last.stream, &last.pool);
            if s.expandable && same && s.address >= last_end {
                if s.address > last_end {
                    last.seg.blocks.push(SvgBlock {
                        offset: last.seg.size,
                        size: usize_of(s.address - last_end, "gap")?,
                        state: SvgState::Punched,
                    });
                }
                let shift = usize_of(s.address - last.seg.address as u64, "offset")?;
                let mut blocks = Vec::with_capacity(s.blocks.len());
                for b in s.blocks {
                    let offset = b.offset.checked_add(shift).ok_or_else(past_top)?;
                    blocks.push(SvgBlock { offset, ..b });
                }
                last.seg.blocks.extend(blocks);
                last.seg.size = usize_of((shift as u64).checked_add(s.size).ok_or_else(past_top)?, "size")?;
                last.runs += 1;
                continue;
            }
        }
        let seg = SvgSegment {
            address: usize_of(s.address, "address")?,
            size: usize_of(s.size, "size")?,
            label: String::new(),
            blocks: s.blocks,
        };
        out.push(Out { seg, pool: s.pool, stream: s.stream, expandable: s.expandable, runs: 1 });
    }
    Ok(out
        .into_iter()
        .map(|Out { mut seg, pool, stream, expandable, runs }| {
            // "0x7f0040000000 large s1 exp, 2 runs": the stream when not the default one.
            let stream = if stream != 0 { format!(" s{stream}") } else { String::new() };
            let exp = match (expandable, runs) {
                (false, _) => String::new(),
                (true, 1) => " exp".to_string(),
                (true, n) => format!(" exp, {n} runs"),
            };
            seg.label = format!("{:#x} {pool}{stream}{exp}", seg.address);
            seg
        })
        .collect())
}

/// The trace entries: this library's `"trace"`, or PyTorch's `"device_traces"` of `device`
/// (or of the one device with entries).
fn trace_of<'a>(doc: &'a Json, device: Option<u64>, notes: &mut Vec<String>) -> Result<Option<&'a [Json]>, String> {
    if let Some(t) = doc.get("trace") {
        return t.as_array().map(Some).ok_or_else(|| "\"trace\" is not an array".to_string());
    }
    let Some(per_device) = doc.get("device_traces") else { return Ok(None) };
    let per_device = per_device.as_array().ok_or("\"device_traces\" is not an array")?;
    let lists: Vec<&[Json]> = per_device
        .iter()
        .map(|l| l.as_array().ok_or("\"device_traces\" is not an array of arrays"))
        .collect::<Result<_, _>>()?;
    Ok(match device {
        Some(d) => lists.get(d as usize).copied(),
        None => {
            let with: Vec<_> = lists.iter().filter(|l| !l.is_empty()).collect();
            match with[..] {
                [] => None,
                [one] => Some(*one),
                _ => {
                    notes.push(format!("{} devices have traces: no timeline without --device N", with.len()));
                    None
                }
            }
        }
    })
}

/// The timeline of `trace`, anchored at its end to the snapshot's `reserved` and `allocated`
/// bytes.
fn timeline(pic: &mut Picture, trace: &[Json], reserved: u64, allocated: u64) -> Result<(), String> {
    let (mut res, mut alloc) = (0i128, 0i128);
    let mut sums = Vec::with_capacity(trace.len());
    for (k, e) in trace.iter().enumerate() {
        let action = e.get("action").and_then(Json::as_str).ok_or(format!("trace entry {k}: no \"action\""))?;
        let size = i128::from(e.get("size").and_then(Json::as_u64).unwrap_or(0));
        match action {
            "alloc" => (alloc, pic.allocs_in_trace) = (alloc + size, true),
            "free_completed" => (alloc, pic.allocs_in_trace) = (alloc - size, true),
            "segment_alloc" | "segment_map" => res += size,
            "segment_free" | "segment_unmap" => res -= size,
            _ => {}
        }
        sums.push((res, alloc));
    }
    let (res_base, alloc_base) = (i128::from(reserved) - res, i128::from(allocated) - alloc);
    let clamp = |v: i128| u64::try_from(v.max(0)).unwrap_or(u64::MAX);
    pic.timeline = sums
        .into_iter()
        .enumerate()
        .map(|(k, (r, a))| {
            let allocated = if pic.allocs_in_trace { clamp(alloc_base + a) } else { 0 };
            TimelinePoint { op: k as u64, reserved: clamp(res_base + r), allocated, requested: allocated }
        })
        .collect();
    // The first op at the highest reserved bytes.
    pic.peak_op = pic.timeline.iter().rev().max_by_key(|p| p.reserved).map(|p| p.op);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err_at(text: &str) -> usize {
        match parse_json(text) {
            Err(e) => e.offset,
            Ok(v) => panic!("{text:?} parsed as {v:?}"),
        }
    }

    #[test]
    fn parses_nested_values() {
        let v = parse_json(" {\"a\": [1, -2, 3.5, {\"b\": null}, []], \"c\": true, \"d\": \"x\", \"e\": {}} ").unwrap();
        let want = Json::Obj(vec![
            (
                "a".into(),
                Json::Arr(vec![
                    Json::Num(Num::U(1)),
                    Json::Num(Num::I(-2)),
                    Json::Num(Num::F(3.5)),
                    Json::Obj(vec![("b".into(), Json::Null)]),
                    Json::Arr(vec![]),
                ]),
            ),
            ("c".into(), Json::Bool(true)),
            ("d".into(), Json::Str("x".into())),
            ("e".into(), Json::Obj(vec![])),
        ]);
        assert_eq!(v, want);
        assert_eq!(v.get("a").and_then(Json::as_array).map(<[Json]>::len), Some(5));
        assert_eq!(v.get("c").and_then(Json::as_bool), Some(true));
        assert_eq!(v.get("zz"), None);
        assert_eq!(parse_json("false").unwrap(), Json::Bool(false));
        assert_eq!(parse_json("\u{feff}[]").unwrap(), Json::Arr(vec![]));
    }

    #[test]
    fn parses_numbers() {
        let n = |t: &str| match parse_json(t).unwrap() {
            Json::Num(n) => n,
            v => panic!("{v:?}"),
        };
        assert_eq!(n("18446744073709551615"), Num::U(u64::MAX));
        assert_eq!(n("-9223372036854775808"), Num::I(i64::MIN));
        assert_eq!(n("18446744073709551616"), Num::F(18446744073709551616.0));
        assert_eq!(n("-0"), Num::I(0));
        assert_eq!(n("0"), Num::U(0));
        assert_eq!(n("1e3"), Num::F(1000.0));
        assert_eq!(n("-2.5E-1"), Num::F(-0.25));
        assert_eq!(parse_json("4096.0").unwrap().as_u64(), Some(4096));
        assert_eq!(parse_json("-1").unwrap().as_u64(), None);
        assert_eq!(parse_json("0.5").unwrap().as_u64(), None);
    }

    #[test]
    fn decodes_escapes() {
        let v = parse_json(r#""a\"b\\c\/d\be\ff\ng\rh\ti\u00e9\u20AC\ud83d\ude00 é""#).unwrap();
        assert_eq!(v.as_str(), Some("a\"b\\c/d\u{8}e\u{c}f\ng\rh\ti\u{e9}\u{20ac}\u{1f600} é"));
        assert_eq!(parse_json(r#"{"k\u0041":"\u0000"}"#).unwrap().get("kA").and_then(Json::as_str), Some("\0"));
    }

    #[test]
    fn errors_name_the_byte() {
        assert_eq!(err_at(""), 0);
        assert_eq!(err_at("   "), 3);
        assert_eq!(err_at("{\"a\":1,}"), 7, "trailing comma");
        assert_eq!(err_at("[1 2]"), 3);
        assert_eq!(err_at("[1,]"), 3);
        assert_eq!(err_at("  \"abc"), 2, "unterminated string: where it opens");
        assert_eq!(err_at("{\"a\":tru}"), 5);
        assert_eq!(err_at("{\"a\" 1}"), 5);
        assert_eq!(err_at("{a:1}"), 1);
        assert_eq!(err_at("01"), 1, "leading zero");
        assert_eq!(err_at("-"), 1);
        assert_eq!(err_at("1."), 2);
        assert_eq!(err_at("1e+"), 3);
        assert_eq!(err_at("[1]x"), 3, "text after the value");
        assert_eq!(err_at("\"a\nb\""), 2, "raw control character");
        assert_eq!(err_at("[\"\\x\"]"), 3, "unknown escape");
        assert_eq!(err_at("\"\\u12G4\""), 3);
        assert_eq!(err_at("[\"\\ud800\"]"), 2, "lone high surrogate");
        assert_eq!(err_at("\"\\ud800\\u0041\""), 1, "high surrogate before a non-surrogate");
        assert_eq!(err_at("\"\\udc00\""), 1, "lone low surrogate");
        assert_eq!(err_at("[1, é]"), 4);
        let deep = "[".repeat(MAX_DEPTH + 1);
        assert_eq!(err_at(&deep), MAX_DEPTH);
        assert!(parse_json(&format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH))).is_ok());
        let e = parse_json("[1,\n x]").unwrap_err();
        assert_eq!(e.to_string(), "not valid JSON at byte 5: expected a value, found 'x'");
        assert_eq!(
            parse_json("[").unwrap_err().to_string(),
            "not valid JSON at byte 1: expected a value, found the end of the text"
        );
    }

    const MB: u64 = 1 << 20;

    /// A snapshot as `dmabuf_rt_snapshot_json` writes one: a classic segment, an expandable one
    /// as two backed runs with 2 MiB punched between them, and a trace that starts after the
    /// allocator did (the history keeps the most recent events).
    fn snapshot() -> String {
        let base = 0x7f00_0000_0000u64;
        format!(
            r#"{{"device":0,"spec":"shmem","stats":{{}},"trace":[
                {{"t":1,"action":"segment_map","addr":{e},"size":{two},"stream":1}},
                {{"t":2,"action":"alloc","addr":{e},"size":{one},"stream":1}},
                {{"t":3,"action":"segment_unmap","addr":{e2},"size":{two},"stream":1}},
                {{"t":4,"action":"free_requested","addr":{base},"size":{one},"stream":0}},
                {{"t":5,"action":"oom","addr":0,"size":{one},"stream":0}}
            ],"segments":[
                {{"address":{e},"total_size":{two},"pool":"large","stream":1,"is_expandable":true,"blocks":[
                    {{"offset":0,"size":{one},"requested_size":{one},"state":"active_allocated"}},
                    {{"offset":{one},"size":{one},"requested_size":0,"state":"inactive"}}]}},
                {{"address":{base},"total_size":{two},"pool":"small","stream":0,"is_expandable":false,"blocks":[
                    {{"offset":0,"size":{one},"requested_size":1000,"state":"active_pending_free"}},
                    {{"offset":{one},"size":{one},"requested_size":0,"state":"inactive"}}]}},
                {{"address":{e3},"total_size":{four},"pool":"large","stream":1,"is_expandable":true,"blocks":[
                    {{"offset":0,"size":{four},"requested_size":0,"state":"inactive"}}]}}
            ]}}"#,
            e = base + 1024 * MB,
            e2 = base + 1024 * MB + 2 * MB,
            e3 = base + 1024 * MB + 4 * MB,
            one = MB,
            two = 2 * MB,
            four = 4 * MB,
        )
    }

    #[test]
    fn converts_a_snapshot() {
        let pic = picture(&parse_json(&snapshot()).unwrap(), None).unwrap();
        let base = 0x7f00_0000_0000usize;
        let mb = MB as usize;
        assert_eq!(pic.segments.len(), 2, "the expandable runs are one segment");
        let classic = &pic.segments[0];
        assert_eq!((classic.address, classic.size, classic.label.as_str()), (base, 2 * mb, "0x7f0000000000 small"));
        assert_eq!(
            classic.blocks,
            [
                SvgBlock { offset: 0, size: mb, state: SvgState::Allocated },
                SvgBlock { offset: mb, size: mb, state: SvgState::Cached }
            ]
        );
        let exp = &pic.segments[1];
        assert_eq!((exp.address, exp.size), (base + 1024 * mb, 8 * mb));
        assert_eq!(exp.label, "0x7f0040000000 large s1 exp, 2 runs");
        assert_eq!(
            exp.blocks,
            [
                SvgBlock { offset: 0, size: mb, state: SvgState::Allocated },
                SvgBlock { offset: mb, size: mb, state: SvgState::Cached },
                SvgBlock { offset: 2 * mb, size: 2 * mb, state: SvgState::Punched },
                SvgBlock { offset: 4 * mb, size: 4 * mb, state: SvgState::Cached },
            ]
        );
        // Anchored at the end to the snapshot: reserved 2 + 2 + 4 MiB after the trace's map and
        // unmap of 2 MiB, allocated 2 MiB (the pending free counts) after its 1 MiB alloc.
        let tl: Vec<_> = pic.timeline.iter().map(|p| (p.op, p.reserved / MB, p.allocated / MB)).collect();
        assert_eq!(tl, [(0, 10, 1), (1, 10, 2), (2, 8, 2), (3, 8, 2), (4, 8, 2)]);
        assert!(pic.timeline.iter().all(|p| p.requested == p.allocated));
        assert_eq!(pic.peak_op, Some(0));
        assert!(pic.allocs_in_trace);

        let svg = svg::render("t", &pic.segments, &pic.timeline, pic.peak_op);
        assert!(svg.contains("punched: 2097152 B (2.00 MiB)"));
        assert!(svg.ends_with("</svg>\n"));
    }

    #[test]
    fn reads_pytorch_shapes() {
        // Block addresses instead of offsets, "segment_type", a block with neither (right after
        // the previous one), per-device traces, no allocs in the trace.
        let doc = r#"{"segments":[
            {"device":0,"address":4096,"total_size":3072,"stream":0,"segment_type":"small","blocks":[
                {"address":4096,"size":1024,"state":"inactive"},
                {"size":1024,"state":"active_allocated"},
                {"address":6144,"size":1024,"state":"inactive"}]},
            {"device":1,"address":65536,"total_size":1024,"stream":0,"segment_type":"small","blocks":[]}],
          "device_traces":[[{"action":"segment_alloc","addr":4096,"size":3072}],
                           [{"action":"segment_alloc","addr":65536,"size":1024}]]}"#;
        let doc = parse_json(doc).unwrap();
        let pic = picture(&doc, Some(0)).unwrap();
        assert_eq!(pic.segments.len(), 1);
        let offsets: Vec<_> = pic.segments[0].blocks.iter().map(|b| (b.offset, b.state)).collect();
        assert_eq!(offsets, [(0, SvgState::Cached), (1024, SvgState::Allocated), (2048, SvgState::Cached)]);
        assert_eq!(pic.timeline, [TimelinePoint { op: 0, reserved: 3072, allocated: 0, requested: 0 }]);
        assert!(!pic.allocs_in_trace);
        // Without --device: every segment, and no timeline (two devices have traces).
        let pic = picture(&doc, None).unwrap();
        assert_eq!((pic.segments.len(), pic.timeline.len(), pic.notes.len()), (2, 0, 1));
        // No trace at all: no timeline.
        let pic = picture(&parse_json(r#"{"segments":[]}"#).unwrap(), None).unwrap();
        assert!(pic.segments.is_empty() && pic.timeline.is_empty() && pic.peak_op.is_none());
    }

    #[test]
    fn refuses_broken_snapshots() {
        let bad = |doc: &str| picture(&parse_json(doc).unwrap(), None).unwrap_err();
        assert!(bad("[]").contains("no \"segments\""));
        assert!(bad(r#"{"segments":[{"total_size":1}]}"#).contains("segment 0: no \"address\""));
        let e = bad(r#"{"segments":[{"address":0,"total_size":1024,"blocks":[{"size":512,"state":"weird"}]}]}"#);
        assert!(e.contains("block 0: unknown state \"weird\""), "{e}");
        let e = bad(
            r#"{"segments":[{"address":0,"total_size":1024,"blocks":[{"offset":512,"size":1024,"state":"inactive"}]}]}"#,
        );
        assert!(e.contains("go past the segment's 1024 bytes"), "{e}");
        let e = bad(
            r#"{"segments":[{"address":4096,"total_size":1024,"blocks":[{"address":0,"size":1,"state":"inactive"}]}]}"#,
        );
        assert!(e.contains("before the segment"), "{e}");
        let e = bad(
            r#"{"segments":[{"address":0,"total_size":1024,"blocks":[{"size":512,"state":"inactive"},{"offset":256,"size":1,"state":"inactive"}]}]}"#,
        );
        assert!(e.contains("inside the block before it"), "{e}");
        assert!(bad(r#"{"segments":[],"trace":[{"size":1}]}"#).contains("trace entry 0: no \"action\""));
        let e = picture(&parse_json(r#"{"device":1,"segments":[]}"#).unwrap(), Some(0)).unwrap_err();
        assert!(e.contains("device 1, not of device 0"), "{e}");
    }

    #[test]
    fn runs_end_to_end() {
        let dir = std::env::temp_dir();
        let (input, output) = (
            dir.join(format!("dmabuf-rt-svg-{}.json", std::process::id())),
            dir.join(format!("dmabuf-rt-svg-{}.svg", std::process::id())),
        );
        std::fs::write(&input, snapshot()).unwrap();
        let args: Vec<OsString> =
            [input.as_os_str(), "-o".as_ref(), output.as_os_str(), "--title".as_ref(), "a <b>".as_ref()]
                .iter()
                .map(|s| s.into())
                .collect();
        run(&args).unwrap();
        let svg = std::fs::read_to_string(&output).unwrap();
        assert!(svg.starts_with("<?xml") && svg.contains("<title>a &lt;b&gt;</title>") && svg.contains("peak, op 0"));
        std::fs::write(&input, "{\"segments\": [1,]}").unwrap();
        let e = run(&args).unwrap_err();
        assert!(e.ends_with("not valid JSON at byte 16: expected a value, found ']'"), "{e}");
        let _ = std::fs::remove_file(&input);
        let _ = std::fs::remove_file(&output);
        let args = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
        assert!(run(&args(&["-o", "x.svg"])).unwrap_err().contains("missing the snapshot"));
        assert!(run(&args(&["a.json"])).unwrap_err().contains("missing -o"));
        assert!(run(&args(&["a.json", "--bogus"])).unwrap_err().contains("--bogus"));
    }

    /// `replay --svg`: the segments of a snapshot of this library come out drawn: without page
    /// stitching, an expandable segment's backed runs as one bar with its punched gaps; with it
    /// (the default), the arena's blocks and free units each as a segment of its own, with no
    /// gap drawn as punched (units in use through a stitched view lie far away).
    #[test]
    fn a_library_snapshot_is_drawn() {
        use dmabuf_rt::caching::{CachingAllocator, Config};
        use dmabuf_rt::source::SparseSource;
        for stitching in [false, true] {
            let c = Config { page_stitching: stitching, ..Config::default() };
            let a = CachingAllocator::builder(SparseSource).config(c).capacity(1 << 40).build().unwrap();
            let (x, y) = (a.allocate(3 << 20, None).unwrap(), a.allocate(1 << 20, None).unwrap());
            drop(x);
            let snap = a.snapshot();
            let segs = segments_of(&snap).unwrap();
            let drawn: usize =
                segs.iter().flat_map(|s| &s.blocks).filter(|b| b.state == SvgState::Allocated).map(|b| b.size).sum();
            assert_eq!(drawn, y.len().next_multiple_of(512), "the live block, and only it, is drawn as allocated");
            let labels: Vec<_> = segs.iter().map(|s| &s.label).collect();
            if stitching {
                assert!(segs.iter().flat_map(|s| &s.blocks).all(|b| b.state != SvgState::Punched), "{labels:?}");
                assert_eq!(segs.len(), 2, "the live block and the free units: {labels:?}");
            } else {
                assert!(segs.iter().all(|s| s.label.contains("exp")), "{labels:?}");
            }
        }
    }
}
