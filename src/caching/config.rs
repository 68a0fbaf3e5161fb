//! `DMABUF_RT_ALLOC_CONF`: the caching allocator's settings, in PyTorch's
//! `PYTORCH_CUDA_ALLOC_CONF` key syntax.
//!
//! ```text
//! max_split_size_mb:256,roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.8,
//! expandable_segments:False,per_process_memory_fraction:0.9
//! ```

use crate::error::{Error, Result};

/// The environment variable read by [`Config::from_env`].
pub const ENV: &str = "DMABUF_RT_ALLOC_CONF";
/// Setting it to `1` bypasses caching (every allocation goes to the memory source).
pub const NO_CACHING_ENV: &str = "DMABUF_RT_NO_CACHING";

const MB: usize = 1 << 20;

/// Allocator settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Blocks at least this large are never split (`usize::MAX`: no limit).
    pub max_split_size: usize,
    /// Round sizes up to one of N divisions between consecutive powers of two: `(upper
    /// bound, N)` pairs, ascending (see [`Config::divisions_for`]). Empty: plain 512-byte
    /// rounding.
    pub roundup_power2_divisions: Vec<(usize, usize)>,
    /// Fraction of allowed memory above which cached blocks are reclaimed, oldest first
    /// (0: off).
    pub garbage_collection_threshold: f64,
    /// Grow one segment per queue and pool by mapping pages into reserved address space
    /// (default: on, where the memory source supports it, because it measured better; see the
    /// README). `False` selects seed 003's classic fixed-size segments.
    pub expandable_segments: bool,
    /// Fraction of the device capacity this process may reserve (1.0: all of it).
    pub per_process_memory_fraction: f64,
    /// Expandable segments only (our key, not PyTorch's): before reserved memory grows past
    /// this multiple of the peak allocated, free pages are given back (punched) to stay under
    /// it. 1.045 by default, which keeps peak reserved within 5% of peak allocated on the
    /// traces in `examples/torch-traces`; the price is a few punches (and page re-faults) per
    /// step of a training loop whose layout touches more than that. 0 turns it off (reserved
    /// memory is then given back only under pressure, by `empty_cache` or by garbage
    /// collection). The free units of a page-stitched arena out of map credit are not
    /// counted against it: they are its wider slack's (see `stitch_grow_slack`). Nothing is
    /// punched within 2 MiB (a small segment) of the peak allocated bytes, whatever the ratio:
    /// a workload of a few MiB would punch and fault in pages every step to hold a share
    /// smaller than the pools' own granularity. Before a page-stitched arena grows, the free
    /// units of the other queues' arenas are punched too, after the pools' pages: each queue
    /// has its own arena, and memory moves between queues only that way.
    pub trim_ratio: f64,
    /// Our key (`page_stitching`, on by default where the source makes expandable segments):
    /// requests of at least four stitching units go to the queue's page-stitched arena
    /// (`caching/arena.rs`, GMLake's idea on a memfd): each block is a view mapped onto
    /// whichever free units of the arena's memfd there are, so free memory is never stranded
    /// behind live neighbours, and views are cached and reused whole, so a periodic workload
    /// maps nothing once warm. Smaller requests are packed into the pools' segments. Off:
    /// every request goes to the pools (expandable or classic segments). An arena's fd is never
    /// handed out (its views are not fd offsets); a block that must be shared as an fd is
    /// allocated with page stitching off.
    pub page_stitching: bool,
    /// Our key (`stitch_unit_kb`): the arena's unit, in bytes; a power of two from the page
    /// size to 2 MiB, 4 KiB (the page) by default. Requests of at least four units (16 KiB)
    /// go to the arena; a block wastes less than a unit there, so at most a quarter of its
    /// size. Smaller units send more blocks to the arena (whose free memory serves any size),
    /// leaving fewer in the small pool (whose cached pages the arena cannot use), and waste
    /// less; larger ones keep less bookkeeping: at most about 17 bytes of host memory per unit
    /// the arena has used (0.4% of it with 4 KiB units, 0.1% with 16 KiB; allocated zeroed, so
    /// only the pages where a free run's tags were written cost memory: 4 KiB pages in a
    /// table's first 2 MiB, transparent huge pages of 2 MiB past it where the system allows
    /// them, `sys/huge_pages.rs`), fewer bitmap words per
    /// block, fewer mappings (VMAs) per view when the free units are scattered. Measured on the
    /// ten traces of `examples/torch-traces` (README, "Page stitching"): with 4 KiB all ten
    /// stay within 1.009 of their peak allocated; with 16 KiB `llm_serving` needs 1.040 (a
    /// twentieth of its bytes are blocks of 16 to 64 KiB); none calls the source once warm.
    pub stitch_unit: usize,
    /// Our key (`stitch_grow_slack`): when no free run of the arena holds a block, it is given
    /// new units in one run (a home block: no `mmap`) instead of a stitched view of the free
    /// ones (one `mmap` per run) as long as the reserved bytes stay within this share above
    /// the allocated bytes (this block counted; not an older peak, so memory given back is not
    /// taken again for it): 0.02 (2%) by default, under the 3% the allocator promises. Memory
    /// bought for speed: a workload whose free units are scattered maps far fewer views
    /// (random sizes and lifetimes: about a third as many), and one that repeats settles a
    /// step or two later. An arena that has spent its map credit (a workload whose views are
    /// not used again, and a credit's worth of them cached unused; `caching/arena.rs`) grows
    /// within 10% instead, if wider, until its credit is full again, but never past this
    /// share above the peak allocated bytes: the bound holds for every workload. 0: the arena
    /// grows only when its free units cannot hold the block, credit or not.
    pub stitch_grow_slack: f64,
    /// Bypass caching.
    pub no_caching: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            max_split_size: usize::MAX,
            roundup_power2_divisions: Vec::new(),
            garbage_collection_threshold: 0.0,
            expandable_segments: true,
            per_process_memory_fraction: 1.0,
            trim_ratio: 1.045,
            page_stitching: true,
            stitch_unit: 4 << 10,
            stitch_grow_slack: 0.02,
            no_caching: false,
        }
    }
}

fn bad(key: &str, value: &str, why: &str) -> Error {
    Error::Config { what: format!("{ENV}: `{key}:{value}`: {why}") }
}

impl Config {
    /// Reads `DMABUF_RT_ALLOC_CONF` and `DMABUF_RT_NO_CACHING`; unset means defaults.
    pub fn from_env() -> Result<Self> {
        let mut c = match std::env::var(ENV) {
            Ok(s) => Self::parse(&s)?,
            Err(std::env::VarError::NotPresent) => Self::default(),
            Err(e) => return Err(Error::Config { what: format!("{ENV}: {e}") }),
        };
        c.no_caching = std::env::var(NO_CACHING_ENV).as_deref() == Ok("1");
        Ok(c)
    }

    /// Parses the `key:value,key:value` syntax.
    pub fn parse(s: &str) -> Result<Self> {
        let mut c = Self::default();
        for item in split_top_level(s) {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            let (key, value) = item
                .split_once(':')
                .ok_or_else(|| Error::Config { what: format!("{ENV}: `{item}` is not `key:value`") })?;
            let (key, value) = (key.trim(), value.trim());
            match key {
                "max_split_size_mb" => {
                    let mb: usize = value.parse().map_err(|_| bad(key, value, "expected a whole number of MiB"))?;
                    if mb <= 20 {
                        return Err(bad(key, value, "must be more than 20 (the large-segment size), as in PyTorch"));
                    }
                    c.max_split_size = mb.checked_mul(MB).ok_or_else(|| bad(key, value, "too large"))?;
                }
                "roundup_power2_divisions" => c.roundup_power2_divisions = parse_divisions(key, value)?,
                "garbage_collection_threshold" => {
                    let t: f64 = value.parse().map_err(|_| bad(key, value, "expected a number"))?;
                    if !(t > 0.0 && t < 1.0) {
                        return Err(bad(key, value, "must be strictly between 0 and 1"));
                    }
                    c.garbage_collection_threshold = t;
                }
                "expandable_segments" => {
                    c.expandable_segments = match value {
                        "True" | "true" | "1" => true,
                        "False" | "false" | "0" => false,
                        _ => return Err(bad(key, value, "expected True or False")),
                    }
                }
                "per_process_memory_fraction" => {
                    let f: f64 = value.parse().map_err(|_| bad(key, value, "expected a number"))?;
                    if !(f > 0.0 && f <= 1.0) {
                        return Err(bad(key, value, "must be in (0, 1]"));
                    }
                    c.per_process_memory_fraction = f;
                }
                "trim_ratio" => {
                    let r: f64 = value.parse().map_err(|_| bad(key, value, "expected a number"))?;
                    if !(r == 0.0 || (r > 1.0 && r.is_finite())) {
                        return Err(bad(key, value, "must be 0 (off) or more than 1"));
                    }
                    c.trim_ratio = r;
                }
                "page_stitching" => {
                    c.page_stitching = match value {
                        "True" | "true" | "1" => true,
                        "False" | "false" | "0" => false,
                        _ => return Err(bad(key, value, "expected True or False")),
                    }
                }
                "stitch_unit_kb" => {
                    let kb: usize = value.parse().map_err(|_| bad(key, value, "expected a number of KiB"))?;
                    let bytes = kb.checked_mul(1024).unwrap_or(0);
                    let page = crate::source::page_size();
                    if !bytes.is_power_of_two() || bytes < page || bytes > 2 << 20 {
                        return Err(bad(
                            key,
                            value,
                            &format!("must be a power of two from the page size ({} KiB) to 2048", page / 1024),
                        ));
                    }
                    c.stitch_unit = bytes;
                }
                "stitch_grow_slack" => {
                    let f: f64 = value.parse().map_err(|_| bad(key, value, "expected a number"))?;
                    if !(0.0..=1.0).contains(&f) {
                        return Err(bad(key, value, "must be from 0 to 1 (a share of the allocated bytes)"));
                    }
                    c.stitch_grow_slack = f;
                }
                other => {
                    return Err(Error::Config {
                        what: format!(
                            "{ENV}: unknown key `{other}` (known: max_split_size_mb, roundup_power2_divisions, \
                             garbage_collection_threshold, expandable_segments, per_process_memory_fraction, \
                             trim_ratio, page_stitching, stitch_unit_kb, stitch_grow_slack)"
                        ),
                    });
                }
            }
        }
        Ok(c)
    }

    /// The number of divisions for a size (0: no power-of-two rounding).
    pub fn divisions_for(&self, size: usize) -> usize {
        self.roundup_power2_divisions.iter().find(|&&(below, _)| size < below).map_or(0, |&(_, d)| d)
    }
}

/// Splits on commas that are not inside `[...]`.
fn split_top_level(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, ch) in s.char_indices() {
        match ch {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn parse_division_count(key: &str, value: &str, v: &str) -> Result<usize> {
    let n: usize = v.trim().parse().map_err(|_| bad(key, value, "division counts must be whole numbers"))?;
    if n != 0 && !n.is_power_of_two() {
        return Err(bad(key, value, "division counts must be powers of two"));
    }
    if n > 64 {
        return Err(bad(key, value, "at most 64 divisions"));
    }
    Ok(n)
}

/// `4` (every size) or `[256:1,512:2,>:8]` (sizes under 256 MiB: 1 division, from 256 to
/// 512 MiB: 2, larger: 8), as in PyTorch. Stored as `(upper bound, divisions)`, ascending.
fn parse_divisions(key: &str, value: &str) -> Result<Vec<(usize, usize)>> {
    let Some(inner) = value.strip_prefix('[') else {
        return Ok(vec![(usize::MAX, parse_division_count(key, value, value)?)]);
    };
    let inner = inner.strip_suffix(']').ok_or_else(|| bad(key, value, "missing `]`"))?;
    let mut out: Vec<(usize, usize)> = Vec::new();
    for part in inner.split(',') {
        let (k, v) = part.split_once(':').ok_or_else(|| bad(key, value, "entries are `size_mb:divisions`"))?;
        let n = parse_division_count(key, value, v)?;
        let k = k.trim();
        let below = if k == ">" {
            usize::MAX
        } else {
            let mb: usize = k.parse().map_err(|_| bad(key, value, "interval sizes are MiB"))?;
            if !mb.is_power_of_two() {
                return Err(bad(key, value, "interval sizes must be powers of two"));
            }
            mb.checked_mul(MB).ok_or_else(|| bad(key, value, "interval too large"))?
        };
        if out.last().is_some_and(|&(prev, _)| below <= prev) {
            return Err(bad(key, value, "intervals must increase (and `>` must come last)"));
        }
        out.push((below, n));
    }
    if out.is_empty() {
        return Err(bad(key, value, "empty list"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_key() {
        let c = Config::parse(
            "max_split_size_mb:256, roundup_power2_divisions:4,garbage_collection_threshold:0.6,\
             expandable_segments:True,per_process_memory_fraction:0.5,trim_ratio:1.1",
        )
        .unwrap();
        assert_eq!(c.trim_ratio, 1.1);
        assert_eq!(Config::parse("trim_ratio:0").unwrap().trim_ratio, 0.0);
        assert_eq!(c.max_split_size, 256 << 20);
        assert_eq!(c.divisions_for(1000), 4);
        assert_eq!(c.garbage_collection_threshold, 0.6);
        assert!(c.expandable_segments);
        assert_eq!(c.per_process_memory_fraction, 0.5);
        assert!(!Config::parse("expandable_segments:False").unwrap().expandable_segments);
        assert_eq!(Config::parse("").unwrap(), Config::default());
        let c = Config::parse("page_stitching:True,stitch_unit_kb:256").unwrap();
        assert!(c.page_stitching);
        assert_eq!(c.stitch_unit, 256 << 10);
        assert_eq!(Config::default().stitch_unit, 4 << 10);
        assert_eq!(Config::parse("stitch_grow_slack:0").unwrap().stitch_grow_slack, 0.0);
        assert_eq!(Config::default().stitch_grow_slack, 0.02);
    }

    #[test]
    fn parses_the_bracketed_divisions_form() {
        let c = Config::parse("roundup_power2_divisions:[256:1,512:2,>:8]").unwrap();
        assert_eq!(c.divisions_for(1 << 20), 1);
        assert_eq!(c.divisions_for((256 << 20) - 1), 1);
        assert_eq!(c.divisions_for(300 << 20), 2);
        assert_eq!(c.divisions_for(600 << 20), 8);
        assert_eq!(c.divisions_for(usize::MAX - 1), 8);
        let c = Config::parse("roundup_power2_divisions:[256:1,512:2]").unwrap();
        assert_eq!(c.divisions_for(600 << 20), 0, "no `>`: larger sizes keep plain rounding");
    }

    #[test]
    fn bad_keys_and_values_are_named() {
        for (input, needle) in [
            ("max_split_size_mb:abc", "whole number"),
            ("max_split_size_mb:10", "more than 20"),
            ("garbage_collection_threshold:1.5", "between 0 and 1"),
            ("expandable_segments:maybe", "True or False"),
            ("per_process_memory_fraction:0", "(0, 1]"),
            ("roundup_power2_divisions:3", "powers of two"),
            ("roundup_power2_divisions:9223372036854775808", "at most 64"),
            ("roundup_power2_divisions:[256:1,128:2]", "increase"),
            ("roundup_power2_divisions:[256:1", "missing `]`"),
            ("trim_ratio:0.9", "0 (off) or more than 1"),
            ("trim_ratio:inf", "0 (off) or more than 1"),
            ("trim_ratio:x", "expected a number"),
            ("stitch_unit_kb:96", "power of two"),
            ("stitch_unit_kb:4096", "power of two"),
            ("stitch_unit_kb:0", "power of two"),
            ("stitch_unit_kb:18014398509481984", "power of two"),
            ("stitch_unit_kb:-1", "number of KiB"),
            ("stitch_grow_slack:-0.1", "from 0 to 1"),
            ("stitch_grow_slack:NaN", "from 0 to 1"),
            ("stitch_grow_slack:2", "from 0 to 1"),
            ("stitch_grow_slack:x", "expected a number"),
            ("colour:blue", "unknown key `colour`"),
            ("max_split_size_mb", "not `key:value`"),
        ] {
            let e = Config::parse(input).unwrap_err().to_string();
            assert!(e.contains(needle), "{input}: {e}");
            assert!(e.contains(ENV), "{input}: {e}");
        }
    }
}
