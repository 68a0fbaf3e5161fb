//! The C ABI's log of refused calls (`src/ffi/logger.rs`): without a host logger a C caller
//! sees `dmabuf-rt: <function>: <why>` on stderr, `DMABUF_RT_LOG=off` silences it, and a
//! logger the host installed first receives the records instead (target `dmabuf_rt::ffi`).
//! `dmabuf_rt_last_error` holds the reason in every case.
//!
//! Loggers are process-wide and installed once, so each case runs in a child process (this
//! binary re-executed with `--exact`; see `common::isolate`).

#![allow(unsafe_code)]

mod common;

use std::ffi::{CStr, c_void};
use std::ptr::null_mut;
use std::sync::Mutex;
use std::time::Duration;

use common::isolate::{abridged, is_child, run_child};
use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;
use dmabuf_rt::ffi::capi::*;

static LIMIT: std::sync::LazyLock<Duration> =
    std::sync::LazyLock::new(|| Duration::from_secs(60) * common::time_scale());

/// A refused call (size 0), checked in the child: the status and the thread's last error.
/// Prints the last error on stdout (`LAST_ERROR\t<why>`) for the parent to compare.
fn refuse_one_call() {
    let mut p: *mut c_void = null_mut();
    // SAFETY: `p` is a valid out-pointer; size 0 is refused before anything is allocated.
    let status = unsafe { dmabuf_rt_device_alloc(0, 0, &mut p) };
    assert_eq!(status, DMABUF_RT_INVALID_ARGUMENT);
    // SAFETY: the library returns a NUL-terminated string owned by this thread, or NULL.
    let why = unsafe { CStr::from_ptr(dmabuf_rt_last_error()) }.to_string_lossy().into_owned();
    assert!(why.starts_with("dmabuf_rt_device_alloc: "), "{why}");
    println!("LAST_ERROR\t{why}");
}

/// Runs `name` in a child with `env`, and returns its stderr and the last error it printed.
fn child(name: &str, env: &[(&str, &str)]) -> (String, String) {
    let mut all = vec![("DMABUF_RT_DEVICES", "shmem")];
    all.extend_from_slice(env);
    let o = run_child(name, &all, *LIMIT);
    assert!(o.ok, "{name} failed: {}\n--- stderr ---\n{}\n--- stdout ---\n{}", o.status, abridged(&o.stderr), o.stdout);
    // libtest's own `test NAME ... ` may start the line.
    let why = o.stdout.lines().find_map(|l| l.split_once("LAST_ERROR\t")).expect("the child's last error").1.to_owned();
    (o.stderr, why)
}

#[test]
fn refused_calls_are_logged_on_stderr_without_a_host_logger() {
    let name = "refused_calls_are_logged_on_stderr_without_a_host_logger";
    if is_child(name) {
        refuse_one_call();
        return;
    }
    let (stderr, why) = child(name, &[]);
    let line = format!("dmabuf-rt: {why}");
    assert!(stderr.lines().any(|l| l == line), "expected `{line}` on stderr:\n{stderr}");
}

#[test]
fn dmabuf_rt_log_off_silences_the_log_not_the_last_error() {
    let name = "dmabuf_rt_log_off_silences_the_log_not_the_last_error";
    if is_child(name) {
        refuse_one_call();
        return;
    }
    let (stderr, _) = child(name, &[("DMABUF_RT_LOG", "off")]);
    assert!(!stderr.contains("dmabuf-rt:"), "DMABUF_RT_LOG=off, yet:\n{stderr}");
}

#[test]
fn dmabuf_rt_log_error_drops_warnings() {
    let name = "dmabuf_rt_log_error_drops_warnings";
    if is_child(name) {
        refuse_one_call();
        return;
    }
    let (stderr, _) = child(name, &[("DMABUF_RT_LOG", "error")]);
    assert!(!stderr.contains("dmabuf-rt:"), "a refused call is a warning, yet at level error:\n{stderr}");
}

/// A host logger that keeps what it is given.
struct HostLogger(Mutex<Vec<(log::Level, String, String)>>);

impl log::Log for HostLogger {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, r: &log::Record<'_>) {
        self.0.lock().unwrap().push((r.level(), r.target().to_owned(), r.args().to_string()));
    }

    fn flush(&self) {}
}

#[test]
fn a_host_logger_installed_first_gets_the_records() {
    let name = "a_host_logger_installed_first_gets_the_records";
    static HOST: HostLogger = HostLogger(Mutex::new(Vec::new()));
    if is_child(name) {
        log::set_logger(&HOST).unwrap();
        log::set_max_level(log::LevelFilter::Info);
        refuse_one_call();
        let records = HOST.0.lock().unwrap();
        let ffi: Vec<_> = records.iter().filter(|(_, target, _)| target == "dmabuf_rt::ffi").collect();
        assert_eq!(ffi.len(), 1, "{records:?}");
        assert_eq!(ffi[0].0, log::Level::Warn);
        assert!(ffi[0].2.starts_with("dmabuf_rt_device_alloc: "), "{records:?}");
        // The host's level stands: the library did not lower or raise it.
        assert_eq!(log::max_level(), log::LevelFilter::Info);
        return;
    }
    let (stderr, _) = child(name, &[]);
    assert!(!stderr.contains("dmabuf-rt:"), "the host's logger was installed, yet:\n{stderr}");
}
