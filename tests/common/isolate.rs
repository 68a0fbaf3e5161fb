//! Running one test in a child process of its own, with a watchdog.
//!
//! The runtime behind the C API is process-wide and reads its environment once, and the
//! stress and fault tests compare process-wide counts (open fds, allocator statistics) with a
//! baseline, or set resource limits: so each such test re-executes this test binary with
//! `--exact NAME` and an environment variable naming the test, and the child runs the body.
//! A child that hangs is killed, and the test fails with what the child said it was doing.
//!
//! Inside the child, [`Watch`] holds what each worker thread is doing right now; the body runs
//! on its own thread and the child's main thread waits for it with a deadline: on expiry it
//! prints every worker's operation in flight and exits, so a hang fails with a message naming
//! the call that hung instead of stalling CI.

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The environment variable that makes the re-executed binary run one test's body.
pub const CHILD_ENV: &str = "DMABUF_RT_ISOLATED_TEST";

/// Whether this process is the child running `name`.
pub fn is_child(name: &str) -> bool {
    std::env::var(CHILD_ENV).as_deref() == Ok(name)
}

/// What the child printed and how it ended.
#[derive(Debug)]
pub struct ChildOutput {
    pub ok: bool,
    pub status: String,
    pub stdout: String,
    pub stderr: String,
}

/// Re-executes this test binary to run test `name` alone, with `env` added, and waits for it
/// at most `limit` (then kills it). Returns its output; the caller asserts on it.
pub fn run_child(name: &str, env: &[(&str, &str)], limit: Duration) -> ChildOutput {
    let mut cmd = command(name, env);
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn the test binary");
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut s);
            }
            String::from_utf8_lossy(&s).into_owned()
        })
    };
    let out = drain(child.stdout.take().map(|r| Box::new(r) as Box<dyn Read + Send>));
    let err = drain(child.stderr.take().map(|r| Box::new(r) as Box<dyn Read + Send>));
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait().expect("wait for the child") {
            Some(st) => break format!("{st}"),
            None if Instant::now() >= deadline => {
                let _ = child.kill();
                let st = child.wait().expect("wait for the killed child");
                break format!("killed after {limit:?} (the child's own watchdog did not fire): {st}");
            }
            // A bounded poll for the child's exit, not an ordering sleep.
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    };
    let (stdout, stderr) = (out.join().unwrap(), err.join().unwrap());
    let ok = status == "exit status: 0" && stdout.contains("test result: ok. 1 passed");
    ChildOutput { ok, status, stdout, stderr }
}

/// The command that re-executes this test binary to run test `name` alone (as the child: see
/// [`is_child`]), with `env` added; for a test that starts the child itself (its own pipes, a
/// process it talks to while it runs).
pub fn command(name: &str, env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("current_exe"));
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"]).env(CHILD_ENV, name);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// How long [`in_child`] gives a body (generous: the kernel lane runs under emulation).
pub const IN_CHILD_LIMIT: Duration = Duration::from_secs(300);

/// Runs the body `f` of test `name` in a child process of its own, with `env` added and the
/// library's log off: in the child (re-executed by the parent) it runs `f`; in the parent it
/// waits for the child ([`isolated`], at most [`IN_CHILD_LIMIT`]) and fails with the child's
/// output (and the signal that killed it, if one did) unless it passed. For a runtime, a socket
/// or a signal disposition that is process-wide.
#[track_caller]
pub fn in_child(name: &str, env: &[(&str, &str)], f: impl FnOnce()) {
    if is_child(name) {
        f();
        return;
    }
    let env: Vec<(&str, &str)> = std::iter::once(("DMABUF_RT_LOG", "off")).chain(env.iter().copied()).collect();
    isolated(name, &env, IN_CHILD_LIMIT);
}

/// Runs test `name` in a child (see the module docs) and fails if the child failed, with its
/// output.
#[track_caller]
pub fn isolated(name: &str, env: &[(&str, &str)], limit: Duration) {
    let o = run_child(name, env, limit);
    assert!(
        o.ok,
        "{name} (in a child process) failed: {}\n--- stderr ---\n{}\n--- stdout ---\n{}",
        o.status,
        abridged(&o.stderr),
        abridged(&o.stdout)
    );
}

/// The first and last lines of a long output, and every line that reports a panic or a hang
/// (the library logs each refused call on stderr, which can run to thousands of lines).
pub fn abridged(text: &str) -> String {
    const KEEP: usize = 30;
    let lines: Vec<&str> = text.lines().collect();
    if lines.len() <= 3 * KEEP {
        return text.to_owned();
    }
    let mut out: Vec<String> = lines[..KEEP].iter().map(|l| l.to_string()).collect();
    let middle = &lines[KEEP..lines.len() - KEEP];
    let mut skipped = 0;
    for (i, l) in middle.iter().enumerate() {
        if l.contains("panicked at") || l.contains("HANG") {
            if skipped > 0 {
                out.push(format!("[... {skipped} lines ...]"));
                skipped = 0;
            }
            out.extend(middle[i..(i + 3).min(middle.len())].iter().map(|l| l.to_string()));
        } else {
            skipped += 1;
        }
    }
    out.push(format!("[... {skipped} lines ...]"));
    out.extend(lines[lines.len() - KEEP..].iter().map(|l| l.to_string()));
    out.join("\n")
}

/// What each worker thread of a test body is doing now, for the watchdog's report.
#[derive(Debug)]
pub struct Watch {
    slots: Vec<Mutex<(String, Instant)>>,
}

impl Watch {
    pub fn new(threads: usize) -> Self {
        Self { slots: (0..threads).map(|_| Mutex::new((String::new(), Instant::now()))).collect() }
    }

    /// Worker `t` is about to do `what`.
    pub fn at(&self, t: usize, what: impl FnOnce() -> String) {
        let mut s = self.slots[t].lock().unwrap_or_else(|p| p.into_inner());
        *s = (what(), Instant::now());
    }

    /// Worker `t` has finished.
    pub fn done(&self, t: usize) {
        self.at(t, String::new);
    }

    fn report(&self) -> String {
        let mut r = String::new();
        for (t, s) in self.slots.iter().enumerate() {
            let s = s.lock().unwrap_or_else(|p| p.into_inner());
            if !s.0.is_empty() {
                r += &format!("  thread {t}: in `{}` for {:?}\n", s.0, s.1.elapsed());
            }
        }
        r
    }
}

/// In the child: runs `body` with a [`Watch`] of `threads` slots; if it has not finished
/// within `limit`, prints what each worker is doing and exits the process with status 3. A
/// panic on any thread (a worker, or one of the library's) ends the process at once with the
/// panic's message, so that no other thread is left waiting on the one that failed.
pub fn watchdog(name: &str, threads: usize, limit: Duration, body: impl FnOnce(&Watch) + Send + 'static) {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        hook(info);
        eprintln!("(a panic fails the whole isolated test: exiting)");
        std::process::exit(101);
    }));
    let watch = std::sync::Arc::new(Watch::new(threads));
    let (tx, rx) = mpsc::channel();
    let w = std::sync::Arc::clone(&watch);
    std::thread::Builder::new()
        .name(format!("{name}-body"))
        .spawn(move || {
            body(&w);
            let _ = tx.send(());
        })
        .expect("spawn the test body");
    let start = Instant::now();
    if rx.recv_timeout(limit).is_err() {
        eprintln!(
            "HANG: {name} did not finish within {limit:?} (started {:?} ago); operations in flight:\n{}",
            start.elapsed(),
            watch.report()
        );
        std::process::exit(3);
    }
}
