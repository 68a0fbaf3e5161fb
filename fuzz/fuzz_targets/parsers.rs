//! The parsers of text and bytes from outside the process: `DMABUF_RT_ALLOC_CONF`
//! (`Config::parse`), `DMABUF_RT_CAPACITY` (`parse_capacity`), `DMABUF_RT_DEVICES`
//! (`parse_device_list`), allocation traces (`parse_trace`) and the pipeline's messages
//! (`dmabuf_rt::share::PoolMessage`, and the stage reports of the pipeline demo in
//! `examples/zero_copy_pipeline/`).
//!
//! The first byte picks a parser and whether the rest is taken as raw text (no panic; what is
//! accepted is sane and survives formatting and parsing again) or as a structured value that
//! is formatted and must parse back to itself.
#![no_main]

use dmabuf_rt::ErrorKind;
use dmabuf_rt::caching::Config;
use dmabuf_rt::caching::replay::{TraceOp, parse_trace};
use dmabuf_rt::ffi::runtime::{parse_capacity, parse_device_list};
use fuzz_common::{Input, check};
use libfuzzer_sys::fuzz_target;

const MB: usize = 1 << 20;

/// The stage reports of the pipeline demo (std only, so it is included by path).
#[path = "../../examples/zero_copy_pipeline/demo/stats.rs"]
mod stats;

/// The pipeline's parsers, each parsing and formatting again (`None`: refused).
mod fuzzing {
    use dmabuf_rt::share::{PoolMessage, Wire};

    /// A pool message decoded and encoded again.
    pub fn message(b: &[u8]) -> Option<[u8; 32]> {
        PoolMessage::decode(b).ok().map(|m| m.to_bytes())
    }

    /// A stage's report parsed and formatted again.
    pub fn report(text: &str) -> Option<String> {
        super::stats::StageStats::parse(text).map(|s| s.to_message())
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let mode = input.u8();
    let rest = input.rest();
    let text = String::from_utf8_lossy(rest);
    let mut input = Input::new(rest);
    match mode % 10 {
        0 => config_text(&text),
        1 => config_value(&mut input),
        2 => capacity_text(&text),
        3 => capacity_value(&mut input),
        4 => trace_text(&text),
        5 => trace_value(&mut input),
        6 => message(rest),
        7 => report(&text, &mut input),
        8 => devices_text(&text),
        _ => devices_value(&mut input),
    }
});

// ---- DMABUF_RT_ALLOC_CONF ----

/// The config in `Config::parse`'s syntax (every setting it has, `no_caching` aside: that one
/// comes from its own variable).
fn format_config(c: &Config) -> String {
    let mut items = Vec::new();
    if c.max_split_size != usize::MAX {
        items.push(format!("max_split_size_mb:{}", c.max_split_size / MB));
    }
    match c.roundup_power2_divisions.as_slice() {
        [] => {}
        [(usize::MAX, n)] => items.push(format!("roundup_power2_divisions:{n}")),
        list => {
            let entries: Vec<String> = list
                .iter()
                .map(|&(below, n)| if below == usize::MAX { format!(">:{n}") } else { format!("{}:{n}", below / MB) })
                .collect();
            items.push(format!("roundup_power2_divisions:[{}]", entries.join(",")));
        }
    }
    if c.garbage_collection_threshold != 0.0 {
        items.push(format!("garbage_collection_threshold:{}", c.garbage_collection_threshold));
    }
    items.push(format!("expandable_segments:{}", if c.expandable_segments { "True" } else { "False" }));
    items.push(format!("per_process_memory_fraction:{}", c.per_process_memory_fraction));
    items.push(format!("trim_ratio:{}", c.trim_ratio));
    items.join(",")
}

/// What every accepted config satisfies.
fn check_config_sane(c: &Config, from: &str) {
    check!(
        "config-sane",
        c.max_split_size == usize::MAX || (c.max_split_size > 20 * MB && c.max_split_size % MB == 0),
        "{from:?}: max_split_size {}",
        c.max_split_size
    );
    let d = &c.roundup_power2_divisions;
    check!("config-sane", d.windows(2).all(|w| w[0].0 < w[1].0), "{from:?}: divisions not ascending: {d:?}");
    check!(
        "config-sane",
        d.iter()
            .all(|&(below, n)| n <= 64 && (n == 0 || n.is_power_of_two()) && below.is_power_of_two()
                || below == usize::MAX),
        "{from:?}: bad divisions {d:?}"
    );
    let gc = c.garbage_collection_threshold;
    check!("config-sane", gc == 0.0 || (gc > 0.0 && gc < 1.0), "{from:?}: gc threshold {gc}");
    let f = c.per_process_memory_fraction;
    check!("config-sane", f > 0.0 && f <= 1.0, "{from:?}: memory fraction {f}");
    let t = c.trim_ratio;
    check!("config-sane", t == 0.0 || (t > 1.0 && t.is_finite()), "{from:?}: trim ratio {t}");
    check!("config-sane", !c.no_caching, "{from:?}: no_caching comes only from its own variable");
}

fn config_text(text: &str) {
    let Ok(c) = Config::parse(text) else { return };
    check_config_sane(&c, text);
    let again = format_config(&c);
    match Config::parse(&again) {
        Ok(c2) => check!("config-roundtrip", c2 == c, "{text:?} -> {c:?}, formatted {again:?} -> {c2:?}"),
        Err(e) => check!("config-roundtrip", false, "{text:?} -> {c:?}, formatted {again:?} refused: {e}"),
    }
}

fn config_value(input: &mut Input<'_>) {
    let mut c = Config::default();
    if input.bool() {
        c.max_split_size = (21 + input.below(1 << 16)) * MB;
    }
    let entries = input.below(5);
    let mut exp = input.below(8);
    for i in 0..entries {
        let n = [0, 1, 2, 4, 8, 16, 32, 64][input.below(8)];
        let below = if i + 1 == entries && input.bool() { usize::MAX } else { (1usize << exp) * MB };
        c.roundup_power2_divisions.push((below, n));
        exp += 1 + input.below(3);
    }
    if input.bool() {
        c.garbage_collection_threshold = (f64::from(input.u16()) + 1.0) / 65538.0;
    }
    c.expandable_segments = input.bool();
    c.per_process_memory_fraction = (f64::from(input.u16()) + 1.0) / 65536.0;
    c.trim_ratio = if input.bool() { 0.0 } else { 1.0 + (f64::from(input.u32()) + 1.0) / 1e6 };
    let text = format_config(&c);
    match Config::parse(&text) {
        Ok(c2) => check!("config-value", c2 == c, "{c:?} formatted {text:?} parsed as {c2:?}"),
        Err(e) => check!("config-value", false, "{c:?} formatted {text:?} refused: {e}"),
    }
}

// ---- DMABUF_RT_CAPACITY ----

fn capacity_text(text: &str) {
    let Ok(v) = parse_capacity(text) else { return };
    check!("capacity-sane", v > 0, "{text:?} accepted as capacity 0");
    for (shift, suffix) in [(0, ""), (10, "K"), (20, "M"), (30, "G")] {
        if v % (1 << shift) == 0 {
            let again = format!("{}{suffix}", v >> shift);
            let got = parse_capacity(&again).ok();
            check!("capacity-roundtrip", got == Some(v), "{text:?} -> {v}, but {again:?} -> {got:?}");
        }
    }
}

fn capacity_value(input: &mut Input<'_>) {
    let n = match input.below(4) {
        0 => u64::from(input.u8()),
        1 => u64::from(input.u32()),
        _ => input.u64() >> input.below(64),
    };
    let (shift, suffix) = [(0, ""), (10, "K"), (10, "k"), (20, "M"), (20, "m"), (30, "G"), (30, "g")][input.below(7)];
    let pad = [" ", "", "\t", "  "];
    let text = format!("{}{n}{}{suffix}{}", pad[input.below(4)], pad[input.below(2)], pad[input.below(4)]);
    let want = n.checked_mul(1u64 << shift).filter(|&v| v > 0);
    let got = parse_capacity(&text).ok();
    check!("capacity-value", got == want, "{text:?}: got {got:?}, expected {want:?}");
}

// ---- DMABUF_RT_DEVICES ----

/// Whether one item (already trimmed) is a device in `DMABUF_RT_DEVICES`'s syntax: `shmem`,
/// `gem`, `heap:NAME` (a plain file name: not empty, no `/`, not `.` or `..`) or `gem:/PATH`.
fn device_item_ok(item: &str) -> bool {
    match item.split_once(':') {
        None => item == "shmem" || item == "gem",
        Some(("heap", name)) => !name.is_empty() && !name.contains('/') && name != "." && name != "..",
        Some(("gem", path)) => path.starts_with('/'),
        Some(_) => false,
    }
}

fn devices_text(text: &str) {
    // Blanks around items and empty items are ignored; the rest are the devices, in order.
    let items: Vec<&str> = text.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    let valid = !items.is_empty() && items.iter().all(|i| device_item_ok(i));
    let list = match parse_device_list(text) {
        Ok(list) => list,
        Err(e) => {
            check!("devices-refused", !valid, "{text:?} refused ({e}), but every item {items:?} is a device");
            check!(
                "devices-refused",
                e.kind() == ErrorKind::InvalidArgument,
                "{text:?} refused as {:?}: {e}",
                e.kind()
            );
            return;
        }
    };
    check!("devices-sane", valid, "{text:?} accepted as {list:?}, but its items {items:?} are not all devices");
    check!("devices-sane", !list.is_empty(), "{text:?} accepted as an empty list");
    check!("devices-sane", list == items, "{text:?} accepted as {list:?}, its items are {items:?}");
    for item in &list {
        check!(
            "devices-sane",
            !item.is_empty() && item.trim() == item && !item.contains(','),
            "{text:?}: item {item:?}"
        );
        if let Some(name) = item.strip_prefix("heap:") {
            check!("devices-sane", !name.contains('/'), "{text:?}: heap name {name:?} has a '/'");
        }
        if let Some(path) = item.strip_prefix("gem:") {
            check!("devices-sane", path.starts_with('/'), "{text:?}: gem path {path:?} is not absolute");
        }
    }
    let again = list.join(",");
    match parse_device_list(&again) {
        Ok(list2) => check!("devices-roundtrip", list2 == list, "{text:?} -> {list:?}, joined {again:?} -> {list2:?}"),
        Err(e) => check!("devices-roundtrip", false, "{text:?} -> {list:?}, joined {again:?} refused: {e}"),
    }
}

/// A list of well-formed devices, with blanks and empty items the input picks: parsed back
/// to exactly those devices.
fn devices_value(input: &mut Input<'_>) {
    /// A name of 1 to 12 characters from a set with `extra`, trimmed.
    fn word(input: &mut Input<'_>, extra: &[u8]) -> String {
        const NAME: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789-_.:+@ ";
        let n = 1 + input.below(12);
        let s: String = (0..n)
            .map(|_| {
                let i = input.below(NAME.len() + extra.len());
                char::from(if i < NAME.len() { NAME[i] } else { extra[i - NAME.len()] })
            })
            .collect();
        s.trim().to_string()
    }
    let mut want = Vec::new();
    let mut text = String::new();
    let n = 1 + input.below(6);
    for i in 0..n {
        let item = match input.below(4) {
            0 => "shmem".to_string(),
            1 => "gem".to_string(),
            2 => match word(input, b"") {
                w if w.is_empty() || w == "." || w == ".." => "heap:system".to_string(),
                w => format!("heap:{w}"),
            },
            _ => format!("gem:/{}", word(input, b"/")),
        };
        let blanks = [" ", "", "\t", "  ", "\n"];
        if i > 0 {
            text += ",";
        }
        if input.below(8) == 0 {
            text += &format!("{},", blanks[input.below(5)]);
        }
        text += &format!("{}{item}{}", blanks[input.below(5)], blanks[input.below(5)]);
        want.push(item);
    }
    if input.bool() {
        text += ",";
    }
    match parse_device_list(&text) {
        Ok(got) => check!("devices-value", got == want, "{text:?}: got {got:?}, expected {want:?}"),
        Err(e) => check!("devices-value", false, "{text:?} refused: {e}"),
    }
}

// ---- traces ----

fn format_trace(ops: &[TraceOp]) -> String {
    let mut s = String::new();
    for (t, op) in ops.iter().enumerate() {
        match *op {
            TraceOp::Alloc { addr, size } => {
                s += &format!("{{\"t\":{t},\"op\":\"alloc\",\"addr\":{addr},\"size\":{size}}}\n");
            }
            TraceOp::Free { addr } => s += &format!("{{\"t\":{t},\"op\":\"free\",\"addr\":{addr}}}\n"),
            TraceOp::Step => s += &format!("{{\"t\":{t},\"op\":\"step\"}}\n"),
        }
    }
    s
}

fn trace_text(text: &str) {
    let Ok(ops) = parse_trace(text) else { return };
    let lines = text.lines().filter(|l| !l.trim().is_empty()).count();
    check!("trace-sane", ops.len() == lines, "{text:?}: {} ops from {lines} lines", ops.len());
    let again = format_trace(&ops);
    match parse_trace(&again) {
        Ok(ops2) => check!("trace-roundtrip", ops2 == ops, "{text:?} -> {ops:?}, formatted {again:?} -> {ops2:?}"),
        Err(e) => check!("trace-roundtrip", false, "{text:?} -> {ops:?}, formatted {again:?} refused: {e}"),
    }
}

fn trace_value(input: &mut Input<'_>) {
    let mut ops = Vec::new();
    let mut text = String::new();
    while !input.is_empty() && ops.len() < 64 {
        let addr = input.u64();
        let size = input.u64() as usize;
        let op = match input.below(5) {
            0 => TraceOp::Step,
            1 | 2 => TraceOp::Alloc { addr, size },
            _ => TraceOp::Free { addr },
        };
        let name = match op {
            TraceOp::Alloc { .. } => "alloc",
            TraceOp::Free { .. } => "free",
            TraceOp::Step => "step",
        };
        // The same object, its keys in an order and with spacing the input picks.
        let mut fields = vec![format!("\"t\":{}", input.u32()), format!("\"op\":\"{name}\"")];
        if op != TraceOp::Step {
            fields.push(format!("\"addr\":{addr}"));
        }
        if let TraceOp::Alloc { size, .. } = op {
            fields.push(format!("\"size\":{size}"));
        }
        let rot = input.below(fields.len());
        fields.rotate_left(rot);
        let sep = [",", ", ", " ,"][input.below(3)];
        text += &format!("{}{{{}}}\n", [" ", "", "\t"][input.below(3)], fields.join(sep));
        if input.bool() {
            text += "\n";
        }
        ops.push(op);
    }
    match parse_trace(&text) {
        Ok(got) => check!("trace-value", got == ops, "{text:?}: got {got:?}, expected {ops:?}"),
        Err(e) => check!("trace-value", false, "{text:?} refused: {e}"),
    }
}

// ---- the pipeline's messages ----

fn message(bytes: &[u8]) {
    if let Some(again) = fuzzing::message(bytes) {
        check!("message-roundtrip", again[..] == *bytes, "{bytes:02x?} decoded and encoded again as {again:02x?}");
    }
    // A well-formed message built from the same bytes is accepted and kept exactly.
    let mut m = [0u8; 32];
    m[..4].copy_from_slice(b"DRPF");
    m[4] = 1 + bytes.first().copied().unwrap_or(0) % 3;
    for (i, &b) in bytes.iter().skip(1).take(20).enumerate() {
        let at = [8, 9, 10, 11, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31][i];
        m[at] = b;
    }
    // An end has no buffer id and no length; a return no length.
    if m[4] == 2 {
        m[8..12].fill(0);
    }
    if m[4] != 1 {
        m[24..32].fill(0);
    }
    let again = fuzzing::message(&m);
    check!("message-value", again == Some(m), "{m:02x?} decoded and encoded again as {again:02x?}");
}

fn report(text: &str, input: &mut Input<'_>) {
    if let Some(again) = fuzzing::report(text) {
        check!("report-sane", again.starts_with("done "), "{text:?} -> {again:?}");
        let third = fuzzing::report(&again);
        check!("report-roundtrip", third.as_ref() == Some(&again), "{text:?} -> {again:?} -> {third:?}");
    }
    // A report with every field, in an order the input picks, and any source name.
    let keys = ["frames", "bytes_copied", "control_bytes", "fds_passed", "buffers", "verified", "elapsed_ns"];
    let mut values: Vec<(usize, u64)> = keys.iter().enumerate().map(|(i, _)| (i, input.u64())).collect();
    let rot = input.below(keys.len());
    values.rotate_left(rot);
    let source = String::from_utf8_lossy(input.bytes(24)).into_owned();
    let nums: Vec<String> = values.iter().map(|&(i, v)| format!("{}={v}", keys[i])).collect();
    let text = format!("done {} source={source}", nums.join(" "));
    values.sort_unstable();
    let canonical = format!(
        "done {} source={source}",
        values.iter().map(|&(i, v)| format!("{}={v}", keys[i])).collect::<Vec<_>>().join(" ")
    );
    let got = fuzzing::report(&text);
    check!("report-value", got.as_ref() == Some(&canonical), "{text:?} -> {got:?}, expected {canonical:?}");
}
