#![allow(unsafe_code)]
//! What the page-stitched arena reviews share (`hostile_arena2`, `hostile_review32`): an
//! allocator on a sparse shmem source with a given unit, and patterns written through raw
//! pointers and checked again (a unit shown by two live blocks reads wrong).

use std::time::Duration;

use dmabuf_rt::caching::{CachingAllocator, Config};
use dmabuf_rt::source::ShmemSource;

pub const KB: usize = 1 << 10;
pub const MB: usize = 1 << 20;
pub const GB: usize = 1 << 30;

/// `n` rounds of a race (as `scaled`), a fifth of them in a debug build.
pub fn rounds(n: usize) -> usize {
    if cfg!(debug_assertions) { (super::scaled(n) / 5).max(n.min(20)) } else { super::scaled(n) }
}

/// An allocator of `capacity` bytes on an unreserved shmem source with `conf`.
pub fn alloc(conf: &str, capacity: u64) -> CachingAllocator {
    CachingAllocator::builder(ShmemSource::new().reserve(false))
        .config(Config::parse(conf).unwrap())
        .capacity(capacity)
        .pending_wait_limit(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// Page stitching on, with units of `unit_kb` KiB.
pub fn arena_conf(unit_kb: usize) -> String {
    format!("expandable_segments:True,page_stitching:True,stitch_unit_kb:{unit_kb}")
}

/// A byte pattern unique to `tag` at every offset.
pub fn pat(tag: u32, i: usize) -> u8 {
    ((i / 4096) as u32).wrapping_mul(0x9E37_79B1).wrapping_add(tag.wrapping_mul(0x85EB_CA6B)).to_le_bytes()
        [(i / 1024) % 4]
        ^ (i as u8)
}

/// Writes the pattern at the first and last 64 bytes of every `step` bytes (and the block's
/// last 64): cheap, and a unit shown by two live blocks still reads wrong.
pub fn raw_mark(p: *mut u8, n: usize, tag: u32, step: usize) {
    let mut at = 0;
    while at < n {
        for off in [at, (at + step).min(n).saturating_sub(64), n.saturating_sub(64)] {
            for i in off..(off + 64).min(n) {
                // SAFETY: `p` is a live raw allocation of at least `n` bytes of the calling
                // test, mapped for the CPU (a shmem arena), written only by its owner.
                unsafe { p.wrapping_add(i).write(pat(tag, i)) };
            }
        }
        at += step;
    }
}

/// Checks what [`raw_mark`] wrote.
#[track_caller]
pub fn raw_verify(p: *mut u8, n: usize, tag: u32, step: usize, what: &str) {
    let mut at = 0;
    while at < n {
        for off in [at, (at + step).min(n).saturating_sub(64), n.saturating_sub(64)] {
            for i in off..(off + 64).min(n) {
                // SAFETY: as in `raw_mark`.
                let got = unsafe { p.wrapping_add(i).read() };
                assert_eq!(got, pat(tag, i), "{what}: raw block {p:p} ({n} bytes, tag {tag}): byte {i}");
            }
        }
        at += step;
    }
}

#[track_caller]
pub fn invariants(a: &CachingAllocator, what: &str) {
    a.check_invariants().unwrap_or_else(|e| panic!("{what}: {e}"));
}
