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
