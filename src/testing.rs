//! Test support shared by unit and integration tests (hidden from docs; not a stable API).

use std::io::Write;

/// Set to `1` in the kernel lane: a test that would skip for want of a device fails instead.
pub const REQUIRE_ENV: &str = "DMABUF_RT_REQUIRE_DEVICES";

/// Returns the value, or reports a skip (straight to stderr, past libtest's capture, so the
/// reader sees it) and returns `None`. Under `DMABUF_RT_REQUIRE_DEVICES=1` a skip panics.
pub fn or_skip<T, E: std::fmt::Display>(test: &str, r: Result<T, E>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e) => {
            if std::env::var(REQUIRE_ENV).as_deref() == Ok("1") {
                panic!("{test}: required device unavailable ({REQUIRE_ENV}=1): {e}");
            }
            let _ = writeln!(std::io::stderr(), "SKIP {test}: {e}");
            None
        }
    }
}

/// Number of open fds of this process.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// `len` bytes starting on a page boundary, private to the caller: the aligned window of an
/// over-allocated `Vec`. The memcpy peers of the benchmarks copy between these (two `Vec`s a
/// few bytes apart modulo 4096 slow memcpy down through 4K aliasing).
#[derive(Debug)]
pub struct PageBuf {
    v: Vec<u8>,
    off: usize,
    len: usize,
}

impl PageBuf {
    /// `len` bytes, each `byte`.
    pub fn new(len: usize, byte: u8) -> Self {
        let v = vec![byte; len + 4096];
        let off = v.as_ptr().align_offset(4096);
        assert!(off < 4096);
        Self { v, off, len }
    }

    /// The bytes.
    pub fn get(&self) -> &[u8] {
        &self.v[self.off..self.off + self.len]
    }

    /// The bytes, writable.
    pub fn get_mut(&mut self) -> &mut [u8] {
        &mut self.v[self.off..self.off + self.len]
    }
}
