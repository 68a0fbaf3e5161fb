//! Fault injection (issue 9, build item 5): the library under a tiny RLIMIT_NOFILE, a zero
//! RLIMIT_MEMLOCK, a tight RLIMIT_AS, and with `io_uring_setup` refused by a seccomp filter
//! (EPERM, and ENOSYS as docker's profile answers). For each, the Rust API (a memory source,
//! the caching allocator, a queue) and the C API (alloc, stream create, memcpy, memset) are
//! called: every failure must be a specific error naming the real cause and what to do,
//! nothing may hang (a watchdog) or leak fds, and once the limit is lifted the library must
//! work again (allocate, copy, free).
//!
//! Each scenario runs in a child process (this binary re-executed with `--exact`; see
//! `common::isolate`), so its limits and its seccomp filter stay there. The child prints one
//! `ROW` line per call; the parent prints them as a table (run with `--nocapture` to see it).

#![allow(unsafe_code)]

mod common;

use std::ffi::{CStr, c_int, c_void};
use std::ptr::null_mut;
use std::time::Duration;

use common::isolate::{abridged, is_child, run_child, watchdog};
use dmabuf_rt::MemorySource;
use dmabuf_rt::caching::CachingAllocator;
use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;
use dmabuf_rt::ffi::capi::*;
use dmabuf_rt::queue::{HostBuffer, Queue};
use dmabuf_rt::source::{HostSource, ShmemSource};
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

const MB: usize = 1 << 20;
static LIMIT: std::sync::LazyLock<Duration> =
    std::sync::LazyLock::new(|| Duration::from_secs(20) * common::time_scale());

/// Runs scenario `name` in a child (or, in the child, its body) and fails with the child's
/// output if it failed; prints the child's table rows either way.
fn scenario(name: &str, env: &[(&str, &str)], body: impl FnOnce() + Send + 'static) {
    if is_child(name) {
        watchdog(name, 1, *LIMIT, move |_| body());
        return;
    }
    let mut all = vec![("DMABUF_RT_DEVICES", "shmem,shmem"), ("DMABUF_RT_CAPACITY", "256M")];
    all.extend_from_slice(env);
    let o = run_child(name, &all, *LIMIT + Duration::from_secs(10));
    let rows: Vec<&str> = o.stdout.lines().filter_map(|l| l.strip_prefix("ROW\t")).collect();
    let mut table = String::from("| scenario | API call | outcome |\n|---|---|---|\n");
    for r in &rows {
        let cells: Vec<&str> = r.splitn(3, '\t').collect();
        table += &format!("| {} |\n", cells.join(" | ").replace('\n', " "));
    }
    eprintln!("{table}");
    assert!(
        o.ok,
        "fault scenario {name} failed: {}\n--- stderr ---\n{}\n--- stdout ---\n{}",
        o.status,
        abridged(&o.stderr),
        abridged(&o.stdout)
    );
}

/// The calls a scenario makes and what it found wrong.
struct Report {
    scenario: &'static str,
    failures: Vec<String>,
}

impl Report {
    fn new(scenario: &'static str) -> Self {
        Self { scenario, failures: Vec::new() }
    }

    fn row(&self, api: &str, outcome: &str) {
        println!("ROW\t{}\t{api}\t{}", self.scenario, outcome.replace(['\t', '\n'], " "));
    }

    fn fail(&mut self, what: String) {
        eprintln!("FAIL: {what}");
        self.failures.push(what);
    }

    /// `text` must mention each of `words` (each `a|b` a choice), case-insensitively.
    fn names_cause(&mut self, api: &str, text: &str, words: &[&str]) {
        let lower = text.to_lowercase();
        for w in words {
            if !w.split('|').any(|alt| lower.contains(&alt.to_lowercase())) {
                self.fail(format!("{api}: the error does not name the cause (`{w}`): {text}"));
            }
        }
    }

    /// A Rust call that must fail with an error naming the cause.
    fn rust_err<T>(&mut self, api: &str, r: dmabuf_rt::Result<T>, words: &[&str]) -> Option<T> {
        match r {
            Ok(v) => {
                self.row(api, "Ok");
                self.fail(format!("{api}: succeeded; expected an error naming {words:?}"));
                Some(v)
            }
            Err(e) => {
                let text = e.to_string();
                self.row(api, &format!("Err: {text}"));
                self.names_cause(api, &text, words);
                None
            }
        }
    }

    /// A Rust call that must succeed.
    fn rust_ok<T>(&mut self, api: &str, r: dmabuf_rt::Result<T>) -> Option<T> {
        match r {
            Ok(v) => {
                self.row(api, "Ok");
                Some(v)
            }
            Err(e) => {
                self.row(api, &format!("Err: {e}"));
                self.fail(format!("{api}: failed: {e}"));
                None
            }
        }
    }

    /// A Rust call that may succeed, or fail naming the cause.
    fn rust_ok_or_clear<T>(&mut self, api: &str, r: dmabuf_rt::Result<T>, words: &[&str]) -> Option<T> {
        match r {
            Ok(v) => {
                self.row(api, "Ok");
                Some(v)
            }
            Err(e) => {
                let text = e.to_string();
                self.row(api, &format!("Err: {text}"));
                self.names_cause(api, &text, words);
                None
            }
        }
    }

    /// A C call that must fail with one of `statuses` and a last error naming the cause.
    fn c_err(&mut self, api: &str, st: dmabuf_rt_status, statuses: &[dmabuf_rt_status], words: &[&str]) {
        if st == DMABUF_RT_OK {
            self.row(api, "DMABUF_RT_OK");
            self.fail(format!("{api}: DMABUF_RT_OK; expected {statuses:?} naming {words:?}"));
            return;
        }
        let text = last_error();
        self.row(api, &format!("{st:?}: {text}"));
        if !statuses.contains(&st) {
            self.fail(format!("{api}: {st:?} ({text}); expected one of {statuses:?} (issue 9, defect 10)"));
        }
        self.names_cause(api, &text, words);
    }

    /// A C call that must succeed.
    fn c_ok(&mut self, api: &str, st: dmabuf_rt_status) -> bool {
        if st == DMABUF_RT_OK {
            self.row(api, "DMABUF_RT_OK");
            true
        } else {
            let text = last_error();
            self.row(api, &format!("{st:?}: {text}"));
            self.fail(format!("{api}: {st:?}: {text}"));
            false
        }
    }

    /// A C call that may succeed, or fail naming the cause.
    fn c_ok_or_clear(&mut self, api: &str, st: dmabuf_rt_status, words: &[&str]) -> bool {
        if st == DMABUF_RT_OK {
            self.row(api, "DMABUF_RT_OK");
            return true;
        }
        let text = last_error();
        self.row(api, &format!("{st:?}: {text}"));
        self.names_cause(api, &text, words);
        false
    }

    fn fds_unchanged(&mut self, when: &str, before: &Fds) {
        let now = Fds::now();
        self.row(&format!("open fds {when}"), &format!("{} (before: {})", now.n, before.n));
        // Fewer is fine (a cache the scenario emptied gave its fds back); more is a leak.
        if now.n > before.n {
            self.fail(format!(
                "{when}: {} fds open, {} before: leaked\n    now: {}\n    before: {}",
                now.n, before.n, now.summary, before.summary
            ));
        }
    }

    fn finish(self) {
        assert!(self.failures.is_empty(), "{}:\n  {}", self.scenario, self.failures.join("\n  "));
    }
}

/// The open fds: how many and what.
struct Fds {
    n: usize,
    summary: String,
}

impl Fds {
    fn now() -> Self {
        Self { n: common::open_fds(), summary: common::fd_summary() }
    }
}

fn last_error() -> String {
    let p = dmabuf_rt_last_error();
    if p.is_null() {
        return "(no last error)".into();
    }
    // SAFETY: a NUL-terminated string valid until this thread's next failing call.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn c_alloc(dev: c_int, size: usize) -> (dmabuf_rt_status, *mut c_void) {
    let mut p = null_mut();
    // SAFETY: valid out-pointer.
    let s = unsafe { dmabuf_rt_device_alloc(dev, size, &mut p) };
    (s, p)
}

fn c_stream(dev: c_int) -> (dmabuf_rt_status, dmabuf_rt_stream) {
    let mut h = 0;
    // SAFETY: valid out-pointer.
    let s = unsafe { dmabuf_rt_stream_create(dev, &mut h) };
    (s, h)
}

fn c_host_alloc(size: usize) -> (dmabuf_rt_status, *mut c_void) {
    let mut p = null_mut();
    // SAFETY: valid out-pointer.
    let s = unsafe { dmabuf_rt_host_alloc(size, &mut p) };
    (s, p)
}

/// h2d then d2h of `len` bytes through block `p` of device 0, on `stream` (0: synchronous).
fn c_round_trip(p: *mut c_void, len: usize, stream: dmabuf_rt_stream) -> Result<(), String> {
    let data: Vec<u8> = (0..len).map(|i| (i * 13 + 7) as u8).collect();
    let mut back = vec![0u8; len];
    // SAFETY: the host sides are live buffers of `len` bytes, alive until the stream (if any)
    // is synchronized below.
    let s = unsafe { dmabuf_rt_memcpy(0, p, 0, data.as_ptr().cast(), len, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, stream) };
    if s != DMABUF_RT_OK {
        return Err(format!("h2d: {s:?}: {}", last_error()));
    }
    // SAFETY: as above.
    let s =
        unsafe { dmabuf_rt_memcpy(0, back.as_mut_ptr().cast(), 0, p, len, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, stream) };
    if s != DMABUF_RT_OK {
        return Err(format!("d2h: {s:?}: {}", last_error()));
    }
    if stream != 0 {
        let s = dmabuf_rt_stream_synchronize(stream);
        if s != DMABUF_RT_OK {
            return Err(format!("stream_synchronize: {s:?}: {}", last_error()));
        }
    }
    if back != data {
        return Err("the bytes read back differ".into());
    }
    Ok(())
}

/// Brings the runtime up and creates what it creates once (each device's own stream), so the
/// scenario measures the calls it makes, not the first-call setup.
fn warm_runtime() {
    for dev in 0..2 {
        let (s, p) = c_alloc(dev, 4096);
        assert_eq!(s, DMABUF_RT_OK, "warm-up alloc: {}", last_error());
        assert_eq!(dmabuf_rt_memset(dev, p, 0, 4096), DMABUF_RT_OK, "warm-up memset: {}", last_error());
        let (s, h) = c_stream(dev);
        assert_eq!(s, DMABUF_RT_OK, "warm-up stream: {}", last_error());
        assert_eq!(dmabuf_rt_stream_destroy(h), DMABUF_RT_OK);
        assert_eq!(dmabuf_rt_device_free(dev, p), DMABUF_RT_OK);
        assert_eq!(dmabuf_rt_empty_cache(dev), DMABUF_RT_OK);
    }
}

/// Everything works: the Rust API (a shmem segment, the caching allocator, a queue copying
/// into its block and back) and the C API (alloc, synchronous and stream round trips, free).
fn works_again(r: &mut Report, when: &str, big: usize) {
    r.rust_ok(&format!("{when}: ShmemSource::allocate({big})"), ShmemSource::new().create_segment(big));
    let a = CachingAllocator::builder(ShmemSource::new()).capacity(4 << 30).build();
    if let Some(a) = r.rust_ok(&format!("{when}: CachingAllocator::build"), a) {
        let q = r.rust_ok(&format!("{when}: Queue::new"), Queue::new());
        if let (Some(block), Some(q)) =
            (r.rust_ok(&format!("{when}: CachingAllocator::allocate({big})"), a.allocate(big, None)), q)
        {
            let host = HostBuffer::from_slice(&vec![0x5a; MB]).expect("host buffer");
            let copy = block.mem().range(0, MB).and_then(|m| q.copy(m, &host)).and_then(|()| q.synchronize());
            r.rust_ok(&format!("{when}: Queue::copy + synchronize"), copy);
            drop(block);
        }
    }
    let (s, p) = c_alloc(0, big);
    if r.c_ok(&format!("{when}: dmabuf_rt_device_alloc(0, {big})"), s) {
        match c_round_trip(p, MB, 0) {
            Ok(()) => r.row(&format!("{when}: dmabuf_rt_memcpy h2d + d2h"), "DMABUF_RT_OK, bytes match"),
            Err(e) => {
                r.row(&format!("{when}: dmabuf_rt_memcpy h2d + d2h"), &e);
                r.fail(format!("{when}: synchronous round trip: {e}"));
            }
        }
        let (s, h) = c_stream(0);
        if r.c_ok(&format!("{when}: dmabuf_rt_stream_create"), s) {
            if let Err(e) = c_round_trip(p, MB, h) {
                r.fail(format!("{when}: round trip on a stream: {e}"));
            }
            r.c_ok(&format!("{when}: dmabuf_rt_stream_destroy"), dmabuf_rt_stream_destroy(h));
        }
        r.c_ok(&format!("{when}: dmabuf_rt_device_free"), dmabuf_rt_device_free(0, p));
    }
    r.c_ok(&format!("{when}: dmabuf_rt_empty_cache"), dmabuf_rt_empty_cache(0));
}

/// The lowest fd number not in use: with RLIMIT_NOFILE at this, no new fd can be opened (every
/// number below it is taken; the limit bounds the numbers, not the count).
fn lowest_free_fd() -> u64 {
    use std::os::fd::AsRawFd;
    let probe = std::fs::File::open("/dev/null").expect("open /dev/null");
    probe.as_raw_fd() as u64
}

const NOFILE_WORDS: &[&str] = &["too many open files", "RLIMIT_NOFILE|ulimit -n"];

/// RLIMIT_NOFILE at the lowest free fd number: every call that needs a new fd fails with "too
/// many open files" naming the limit (not out-of-memory: issue 9, defect 10); calls that need
/// none still work; nothing leaks; raising the limit again makes everything work.
#[test]
fn rlimit_nofile_tiny() {
    scenario("rlimit_nofile_tiny", &[], || {
        let mut r = Report::new("RLIMIT_NOFILE tiny");
        warm_runtime();
        // Made before the limit: a block to copy into (small enough for the small pool, so
        // that device 0 has no stitched arena yet: an 8 MiB block then needs a new memfd), an
        // allocator with nothing cached.
        const KEPT: usize = 8 << 10;
        let (s, kept) = c_alloc(0, KEPT);
        assert_eq!(s, DMABUF_RT_OK);
        let alloc = CachingAllocator::builder(ShmemSource::new()).capacity(1 << 30).build().expect("allocator");
        let saved = getrlimit(Resource::Nofile);
        let before = Fds::now();
        let cap = lowest_free_fd();
        setrlimit(Resource::Nofile, Rlimit { current: Some(cap), maximum: saved.maximum }).expect("setrlimit");
        r.row("limit", &format!("RLIMIT_NOFILE soft {cap} ({} fds open)", before.n));

        r.rust_err("ShmemSource::allocate(1 MiB)", ShmemSource::new().create_segment(MB), NOFILE_WORDS);
        r.rust_err("CachingAllocator::allocate(1 MiB)", alloc.allocate(MB, None), NOFILE_WORDS);
        r.rust_err("Queue::new", Queue::new(), NOFILE_WORDS);
        let (s, _) = c_alloc(0, 8 * MB);
        r.c_err("dmabuf_rt_device_alloc(0, 8 MiB)", s, &[DMABUF_RT_RESOURCE_LIMIT], NOFILE_WORDS);
        let (s, _) = c_stream(0);
        r.c_err("dmabuf_rt_stream_create", s, &[DMABUF_RT_RESOURCE_LIMIT], NOFILE_WORDS);
        let (s, _) = c_host_alloc(MB);
        r.c_err("dmabuf_rt_host_alloc(1 MiB)", s, &[DMABUF_RT_RESOURCE_LIMIT], NOFILE_WORDS);
        // No new fd needed: a copy into a block that exists.
        match c_round_trip(kept, KEPT, 0) {
            Ok(()) => r.row("dmabuf_rt_memcpy h2d + d2h (existing block)", "DMABUF_RT_OK, bytes match"),
            Err(e) => {
                r.row("dmabuf_rt_memcpy h2d + d2h (existing block)", &e);
                r.names_cause("dmabuf_rt_memcpy (existing block)", &e, NOFILE_WORDS);
            }
        }
        // /proc/self/fd cannot be opened under the limit: counted once it is lifted, before
        // anything else opens an fd.
        setrlimit(Resource::Nofile, saved).expect("restore RLIMIT_NOFILE");
        r.fds_unchanged("once the limit is lifted, after the failures", &before);
        works_again(&mut r, "limit lifted", 8 * MB);
        assert_eq!(dmabuf_rt_device_free(0, kept), DMABUF_RT_OK);
        assert_eq!(dmabuf_rt_empty_cache(0), DMABUF_RT_OK);
        drop(alloc);
        r.fds_unchanged("after lifting and freeing", &before);
        r.finish();
    });
}

const MEMLOCK_WORDS: &[&str] = &["RLIMIT_MEMLOCK", "ulimit -l"];

/// RLIMIT_MEMLOCK 0, on a thread without CAP_IPC_LOCK (root's capability would bypass it):
/// pinned host memory fails naming the limit and `ulimit -l`; io_uring either works (kernels
/// from 5.12 charge rings to the memory cgroup) or fails naming the limit; device memory
/// (not locked) works; raising the limit makes pinned memory work again.
#[test]
fn rlimit_memlock_zero() {
    scenario("rlimit_memlock_zero", &[], || {
        warm_runtime();
        // What the runtime's pinned-host allocator uses (it chose as root, as this does): the
        // system heap's pages are not charged to RLIMIT_MEMLOCK, mlocked memfds are.
        let heap = matches!(HostSource::new().backing(), dmabuf_rt::source::HostBacking::SystemHeap);
        let before = Fds::now();
        let saved = getrlimit(Resource::Memlock);
        setrlimit(Resource::Memlock, Rlimit { current: Some(0), maximum: saved.maximum }).expect("setrlimit");
        let mut r = common::unprivileged(move || {
            let mut r = Report::new("RLIMIT_MEMLOCK 0");
            r.row("limit", "RLIMIT_MEMLOCK soft 0, on a thread without CAP_IPC_LOCK");
            r.rust_err(
                "HostSource::mlocked().allocate(1 MiB)",
                HostSource::mlocked().create_segment(MB),
                MEMLOCK_WORDS,
            );
            let q = r.rust_ok_or_clear("Queue::new", Queue::new(), MEMLOCK_WORDS);
            drop(q);
            let a = CachingAllocator::builder(ShmemSource::new()).capacity(1 << 30).build().expect("allocator");
            r.rust_ok("CachingAllocator::allocate(1 MiB) (device memory is not locked)", a.allocate(MB, None));
            let (s, p) = c_host_alloc(MB);
            if heap {
                // Pinned host memory from the system heap: not locked memory, so it works.
                if r.c_ok("dmabuf_rt_host_alloc(1 MiB) (system heap: not charged to the limit)", s) {
                    assert_eq!(dmabuf_rt_host_free(p), DMABUF_RT_OK);
                }
            } else {
                r.c_err("dmabuf_rt_host_alloc(1 MiB)", s, &[DMABUF_RT_RESOURCE_LIMIT], MEMLOCK_WORDS);
            }
            let (s, h) = c_stream(0);
            if r.c_ok_or_clear("dmabuf_rt_stream_create", s, MEMLOCK_WORDS) {
                assert_eq!(dmabuf_rt_stream_destroy(h), DMABUF_RT_OK);
            }
            let (s, p) = c_alloc(0, MB);
            if r.c_ok("dmabuf_rt_device_alloc(0, 1 MiB)", s) {
                if let Err(e) = c_round_trip(p, MB, 0) {
                    r.fail(format!("synchronous round trip under RLIMIT_MEMLOCK 0: {e}"));
                }
                r.row("dmabuf_rt_memcpy h2d + d2h", "done");
                assert_eq!(dmabuf_rt_device_free(0, p), DMABUF_RT_OK);
            }
            assert_eq!(dmabuf_rt_empty_cache(0), DMABUF_RT_OK);
            assert_eq!(dmabuf_rt_host_empty_cache(), DMABUF_RT_OK);
            r
        });
        r.fds_unchanged("under the limit, after the failures", &before);
        setrlimit(Resource::Memlock, saved).expect("restore RLIMIT_MEMLOCK");
        let r2 = common::unprivileged(move || {
            let (s, p) = c_host_alloc(MB);
            r.c_ok("limit lifted: dmabuf_rt_host_alloc(1 MiB)", s);
            if s == DMABUF_RT_OK {
                r.c_ok("limit lifted: dmabuf_rt_host_free", dmabuf_rt_host_free(p));
            }
            r.rust_ok("limit lifted: HostSource::mlocked().allocate(1 MiB)", HostSource::mlocked().create_segment(MB));
            works_again(&mut r, "limit lifted", MB);
            r
        });
        r = r2;
        assert_eq!(dmabuf_rt_host_empty_cache(), DMABUF_RT_OK);
        assert_eq!(dmabuf_rt_empty_cache(0), DMABUF_RT_OK);
        r.fds_unchanged("after lifting, with the caches emptied", &before);
        r.finish();
    });
}

fn vm_size() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmSize");
    kb * 1024
}

const AS_WORDS: &[&str] = &["RLIMIT_AS|address space|ulimit -v"];

/// RLIMIT_AS a few hundred MiB above what the process maps now: allocations that fit work
/// (the expandable segments' reservation must not take the rest of the address space:
/// issue 9, defect 11), so threads (streams) can still be created; one that does not fit
/// fails naming the address-space limit; nothing leaks; lifted, a large allocation works.
#[test]
fn rlimit_as_tight() {
    scenario("rlimit_as_tight", &[("DMABUF_RT_CAPACITY", "2G")], || {
        warm_runtime();
        let mut r = Report::new("RLIMIT_AS tight");
        let before = Fds::now();
        let saved = getrlimit(Resource::As);
        let cap = vm_size() + 384 * MB as u64;
        setrlimit(Resource::As, Rlimit { current: Some(cap), maximum: saved.maximum }).expect("setrlimit");
        r.row("limit", &format!("RLIMIT_AS soft {} MiB (VmSize + 384 MiB)", cap >> 20));

        let a = CachingAllocator::builder(ShmemSource::new()).capacity(2 << 30).build();
        let a = r.rust_ok_or_clear("CachingAllocator::build (expandable segments)", a, AS_WORDS);
        if let Some(a) = &a {
            let small = r.rust_ok("CachingAllocator::allocate(64 MiB)", a.allocate(64 * MB, None));
            r.rust_err("CachingAllocator::allocate(1 GiB)", a.allocate(1 << 30, None), AS_WORDS);
            r.rust_ok("Queue::new (a thread: needs address space left)", Queue::new());
            drop(small);
        }
        let (s, p) = c_alloc(0, 64 * MB);
        r.c_ok("dmabuf_rt_device_alloc(0, 64 MiB)", s);
        let (s2, _) = c_alloc(1, 1 << 30);
        r.c_err("dmabuf_rt_device_alloc(1, 1 GiB)", s2, &[DMABUF_RT_OUT_OF_MEMORY, DMABUF_RT_RESOURCE_LIMIT], AS_WORDS);
        let (s3, h) = c_stream(0);
        if r.c_ok("dmabuf_rt_stream_create (a thread: needs address space left)", s3) {
            if s == DMABUF_RT_OK {
                if let Err(e) = c_round_trip(p, MB, h) {
                    r.fail(format!("round trip on a stream under RLIMIT_AS: {e}"));
                }
            }
            assert_eq!(dmabuf_rt_stream_destroy(h), DMABUF_RT_OK);
        }
        if s == DMABUF_RT_OK {
            assert_eq!(dmabuf_rt_device_free(0, p), DMABUF_RT_OK);
        }
        for dev in 0..2 {
            assert_eq!(dmabuf_rt_empty_cache(dev), DMABUF_RT_OK);
        }
        drop(a);
        r.fds_unchanged("under the limit, after the failures", &before);
        setrlimit(Resource::As, saved).expect("restore RLIMIT_AS");
        works_again(&mut r, "limit lifted", 1 << 30);
        r.fds_unchanged("after lifting and freeing", &before);
        r.finish();
    });
}

/// A seccomp filter (all threads) answering `io_uring_setup` with `errno`.
fn refuse_io_uring(errno: i32) {
    use common::seccomp::{NR_IO_URING_SETUP, install_one_rule};
    // TSYNC applies it to every thread of this (child) process.
    let action = libc::SECCOMP_RET_ERRNO | (errno as u32 & libc::SECCOMP_RET_DATA);
    assert_eq!(install_one_rule(NR_IO_URING_SETUP, action, libc::SECCOMP_FILTER_FLAG_TSYNC), 0);
}

fn io_uring_refused(name: &'static str, label: &'static str, errno: i32, words: &'static [&'static str]) {
    scenario(name, &[], move || {
        let mut r = Report::new(label);
        // Installed before the runtime exists: every thread it starts inherits the filter.
        refuse_io_uring(errno);
        r.row("filter", &format!("seccomp: io_uring_setup -> errno {errno}"));
        let mut n = 0;
        // SAFETY: valid out-pointer.
        r.c_ok("dmabuf_rt_device_count", unsafe { dmabuf_rt_device_count(&mut n) });
        // What the allocator creates once per device (and keeps after empty_cache), before
        // counting.
        let (s, p) = c_alloc(0, 4096);
        assert_eq!(s, DMABUF_RT_OK, "warm-up alloc: {}", last_error());
        assert_eq!(dmabuf_rt_device_free(0, p), DMABUF_RT_OK);
        assert_eq!(dmabuf_rt_empty_cache(0), DMABUF_RT_OK);
        let before = Fds::now();
        r.rust_err("Queue::new", Queue::new(), words);
        let a = CachingAllocator::builder(ShmemSource::new()).capacity(1 << 30).build().expect("allocator");
        r.rust_ok("CachingAllocator::allocate(1 MiB) (no ring needed)", a.allocate(MB, None));
        r.rust_ok("ShmemSource::allocate(1 MiB)", ShmemSource::new().create_segment(MB));
        let (s, p) = c_alloc(0, MB);
        if r.c_ok("dmabuf_rt_device_alloc(0, 1 MiB)", s) {
            match c_round_trip(p, MB, 0) {
                Ok(()) => r.row("dmabuf_rt_memcpy h2d + d2h (synchronous)", "DMABUF_RT_OK, bytes match"),
                Err(e) => {
                    r.row("dmabuf_rt_memcpy h2d + d2h (synchronous)", &e);
                    r.names_cause("dmabuf_rt_memcpy (synchronous)", &e, words);
                }
            }
            let st = dmabuf_rt_memset(0, p, 1, MB);
            r.c_ok_or_clear("dmabuf_rt_memset", st, words);
            r.c_ok("dmabuf_rt_device_free", dmabuf_rt_device_free(0, p));
        }
        let (s, _) = c_stream(0);
        r.c_err("dmabuf_rt_stream_create", s, &[DMABUF_RT_FAILED, DMABUF_RT_NOT_SUPPORTED], words);
        let (s, _) = c_stream(1);
        r.c_err("dmabuf_rt_stream_create (again)", s, &[DMABUF_RT_FAILED, DMABUF_RT_NOT_SUPPORTED], words);
        assert_eq!(dmabuf_rt_empty_cache(0), DMABUF_RT_OK);
        drop(a);
        r.fds_unchanged("after the failures", &before);
        r.finish();
    });
}

/// io_uring refused with EPERM (as `kernel.io_uring_disabled` or a seccomp filter does):
/// creating a queue or stream fails naming io_uring and seccomp (or the sysctl); memory and
/// synchronous copies still work; nothing leaks or hangs.
#[test]
fn io_uring_refused_eperm() {
    io_uring_refused("io_uring_refused_eperm", "io_uring refused (seccomp, EPERM)", 1, &["io_uring", "seccomp"]);
}

/// The same with ENOSYS (docker's default profile; a kernel without io_uring).
#[test]
fn io_uring_refused_enosys() {
    io_uring_refused("io_uring_refused_enosys", "io_uring refused (seccomp, ENOSYS)", 38, &["io_uring", "seccomp"]);
}
