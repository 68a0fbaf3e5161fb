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

/// The calling thread's id (for [`task_state`]).
pub fn gettid() -> i32 {
    rustix::thread::gettid().as_raw_nonzero().get()
}

/// A thread's scheduler state letter and voluntary context switches (`/proc`).
pub fn task_state(tid: i32) -> (char, u64) {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap_or_default();
    let (mut state, mut vcs) = ('?', 0);
    for line in s.lines() {
        if let Some(v) = line.strip_prefix("State:") {
            state = v.trim().chars().next().unwrap_or('?');
        } else if let Some(v) = line.strip_prefix("voluntary_ctxt_switches:") {
            vcs = v.trim().parse().unwrap_or(0);
        }
    }
    (state, vcs)
}

/// Waits (up to `limit`) until thread `tid` sleeps, having slept more than `after` times
/// before: a thread that woke from one wait and went into the next. Returns its count of
/// sleeps then.
#[track_caller]
pub fn wait_asleep(tid: i32, after: u64, limit: Duration) -> u64 {
    let mut seen = 0;
    wait_until("the thread sleeps", limit, || {
        let (s, v) = task_state(tid);
        seen = v;
        s == 'S' && v > after
    });
    seen
}
