//! Bounded waits for the tests: for a condition another thread or process makes true (no
//! sleeps: the waiting thread yields), and for a call that must not hang.

use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Waits until `done` holds, failing (naming `what`) if `limit` passes first.
#[track_caller]
pub fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "never happened within {limit:?}: {what}");
        std::thread::yield_now();
    }
}

/// Runs `f` on a thread of its own and fails if it does not finish within `limit` (a hang is
/// reported instead of hanging the suite; the stuck thread is left behind). A panic in `f` is
/// the caller's panic, with its own message (not reported as a hang).
pub fn within<T: Send + 'static>(what: &str, limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(v)) => v,
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => panic!("hang: {what} did not finish within {limit:?}"),
    }
}
