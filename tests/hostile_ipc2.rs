#![allow(unsafe_code)]
//! Second hostile review of process-wide IPC handles (`dmabuf_rt::ipc::get_handle` /
//! `open_handle`) and of the C API on top of them (`dmabuf_rt_ipc_*_mem_handle`): several
//! threads opening one handle at once, a squatting "producer" whose listen queue is full, a
//! consumer that dies mid-REQUEST, two handles of one pointer opened in one process, fd leaks
//! per open/close cycle, a close racing a copy still queued on a stream, and a forked child.
//!
//! Every case runs in a child process of its own (this test binary, the one test,
//! `DMABUF_RT_ISOLATED_TEST=<name>`, `tests/common/isolate.rs`): the runtime and the IPC socket are process-wide, and a hang in
//! one case must not stall the others.

mod common;

use common::wait::{wait_until, within};

use common::isolate::in_child;
use std::ffi::{CStr, c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, mpsc};
use std::time::{Duration, Instant};

use dmabuf_rt::caching::CachingAllocator;
use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;
use dmabuf_rt::ffi::capi::*;
use dmabuf_rt::ipc::{self, IpcHandle};

const KB: usize = 1 << 10;
const ENV: &[(&str, &str)] = &[("DMABUF_RT_DEVICES", "shmem,shmem"), ("DMABUF_RT_CAPACITY", "256M")];
/// Hang detection (generous: CI may run under emulation).
static WATCHDOG: std::sync::LazyLock<Duration> =
    std::sync::LazyLock::new(|| Duration::from_secs(20) * common::time_scale());

fn allocator() -> CachingAllocator {
    common::allocator("", 64 << 20)
}

fn pat(tag: u8, n: usize) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(13) ^ tag ^ ((i >> 12) as u8)).collect()
}

// ---- raw abstract seqpacket sockets (a hostile peer) ----

fn abstract_addr(name: &[u8]) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_un.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (i, &b) in name.iter().enumerate() {
        a.sun_path[i + 1] = b as libc::c_char;
    }
    let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len();
    (a, len as libc::socklen_t)
}

fn seqpacket() -> c_int {
    // SAFETY: plain syscall.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0);
    fd
}

fn socket_name(pid: u32, token: u64) -> Vec<u8> {
    format!("dmabuf-rt-ipc/{pid}/{token:016x}").into_bytes()
}

/// A raw connection to the IPC socket of process `pid` with `token`.
fn raw_connect(pid: u32, token: u64) -> c_int {
    let fd = seqpacket();
    let (a, len) = abstract_addr(&socket_name(pid, token));
    // SAFETY: a valid address of `len` bytes.
    let r = unsafe { libc::connect(fd, (&raw const a).cast(), len) };
    assert_eq!(r, 0, "connect: {}", std::io::Error::last_os_error());
    fd
}

fn raw_send(fd: c_int, bytes: &[u8]) {
    // SAFETY: a valid buffer.
    let n = unsafe { libc::send(fd, bytes.as_ptr().cast(), bytes.len(), libc::MSG_NOSIGNAL) };
    assert_eq!(n, bytes.len() as isize, "send: {}", std::io::Error::last_os_error());
}

/// A REQUEST packet as the wire carries it (tag 5, 0, hold).
/// A REQUEST packet (`src/ipc/wire.rs`): tag 5, 0, the hold, the request's number.
fn request_packet(hold: u64) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&5u32.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&hold.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    b
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

// ---- C API helpers ----

fn last_error() -> String {
    let p = dmabuf_rt_last_error();
    // SAFETY: a non-null last error is a NUL-terminated string valid until the next failure.
    if p.is_null() { "<none>".into() } else { unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned() }
}

#[track_caller]
fn ok(s: dmabuf_rt_status) {
    assert_eq!(s, DMABUF_RT_OK, "call failed: {}", if s == DMABUF_RT_OK { String::new() } else { last_error() });
}

fn alloc(device: c_int, n: usize) -> *mut c_void {
    let mut p = null_mut();
    // SAFETY: a valid out-pointer.
    ok(unsafe { dmabuf_rt_device_alloc(device, n, &mut p) });
    p
}

fn write(device: c_int, p: *mut c_void, bytes: &[u8]) {
    // SAFETY: the host side is a live buffer of `bytes.len()` bytes.
    ok(unsafe {
        dmabuf_rt_memcpy(device, p, 0, bytes.as_ptr().cast(), bytes.len(), DMABUF_RT_MEMCPY_HOST_TO_DEVICE, 0)
    })
}

fn read(device: c_int, p: *mut c_void, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    // SAFETY: the host side is a live buffer of `n` bytes.
    ok(unsafe { dmabuf_rt_memcpy(0, v.as_mut_ptr().cast(), device, p.cast(), n, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0) });
    v
}

fn handle(device: c_int, p: *mut c_void) -> dmabuf_rt_ipc_mem_handle {
    let mut h = dmabuf_rt_ipc_mem_handle { bytes: [0; 64] };
    // SAFETY: a valid out-pointer.
    ok(unsafe { dmabuf_rt_ipc_get_mem_handle(device, p, &mut h) });
    h
}

fn open(device: c_int, h: &dmabuf_rt_ipc_mem_handle) -> Result<*mut c_void, dmabuf_rt_status> {
    let mut p = null_mut();
    // SAFETY: valid pointers.
    match unsafe { dmabuf_rt_ipc_open_mem_handle(device, h, &mut p) } {
        DMABUF_RT_OK => Ok(p),
        s => Err(s),
    }
}

fn stats(device: c_int) -> dmabuf_rt_stats {
    let mut s = dmabuf_rt_stats::default();
    // SAFETY: a valid out-pointer.
    ok(unsafe { dmabuf_rt_device_stats(device, &mut s) });
    s
}

// ---------------------------------------------------------------------------------------------

/// Eight threads open the same handle at once, twenty times over. Exactly one must get the
/// block and the others a prompt refusal. `IpcImporter::request` keeps answers in
/// `grants: HashMap<hold, Option<export>>`: the exporter answers the first REQUEST with
/// SHARE + GRANT{hold} and the second with DENY{hold}; when one pump takes in both, the DENY
/// overwrites the GRANT, so the winner is told "denied" and the other waits for an answer
/// that never comes (OPEN_TIMEOUT, 30 s), and the share stays unopened: its block held
/// (limbo) for as long as the connection lives.
#[test]
fn racing_opens_of_one_handle_one_wins_none_waits_for_the_timeout() {
    in_child("racing_opens_of_one_handle_one_wins_none_waits_for_the_timeout", &[], || {
        let a = Arc::new(allocator());
        for round in 0..20u8 {
            let x = a.allocate(64 * KB, None).unwrap();
            let h = ipc::get_handle(&x, None).unwrap();
            drop(x);
            let results = within(&format!("round {round}: 8 racing opens of one handle"), *WATCHDOG, move || {
                let go = Arc::new(Barrier::new(8));
                let ts: Vec<_> = (0..8)
                    .map(|_| {
                        let go = Arc::clone(&go);
                        std::thread::spawn(move || {
                            go.wait();
                            ipc::open_handle(&h)
                        })
                    })
                    .collect();
                ts.into_iter().map(|t| t.join().unwrap()).collect::<Vec<_>>()
            });
            let wins = results.iter().filter(|r| r.is_ok()).count();
            assert_eq!(wins, 1, "round {round}: {wins} opens of one handle succeeded: {results:?}");
            drop(results);
            wait_until("limbo back to 0", *WATCHDOG, || a.stats().limbo_bytes.current == 0);
            a.check_invariants().unwrap();
        }
        assert_eq!(ipc::unopened_handles(), 0);
    });
}

/// A process listens on a handle's socket name but never accepts, and its listen queue is
/// full (a squatter, or a real producer whose accept thread is flooded). `server::client`
/// connects (a blocking `connect`, no timeout) with the process-wide `CLIENTS` lock held, so
/// one open against that process blocks every other open in this process, even of handles of
/// healthy producers (here, this process's own).
#[test]
fn an_open_stuck_connecting_to_a_full_listen_queue_does_not_block_other_opens() {
    in_child("an_open_stuck_connecting_to_a_full_listen_queue_does_not_block_other_opens", &[], || {
        // A healthy handle, made first (this process's own socket).
        let a = allocator();
        let x = a.allocate(16 * KB, None).unwrap();
        let good = ipc::get_handle(&x, None).unwrap();
        // The squatter: backlog 0, filled by one connection nobody accepts.
        let (pid, token) = (0x7fff_0000 + std::process::id() % 1000, 0x5eed_0000_0000_0001u64);
        let listener = seqpacket();
        let (addr, len) = abstract_addr(&socket_name(pid, token));
        // SAFETY: a valid address.
        assert_eq!(unsafe { libc::bind(listener, (&raw const addr).cast(), len) }, 0);
        // SAFETY: plain syscall.
        assert_eq!(unsafe { libc::listen(listener, 0) }, 0);
        let filler = raw_connect(pid, token);
        let forged = IpcHandle { pid, door: 0, export: 1, segment: 1, offset: 0, len: 4096, token };
        let (tid_tx, tid_rx) = mpsc::channel();
        let stuck = std::thread::spawn(move || {
            // SAFETY: plain syscall.
            tid_tx.send(unsafe { libc::gettid() }).unwrap();
            ipc::open_handle(&forged).map(|_| ())
        });
        let tid = tid_rx.recv().unwrap();
        // Until that thread sits in connect(2).
        wait_until("the forged open to block in connect", *WATCHDOG, || {
            std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall"))
                .ok()
                .and_then(|s| s.split_whitespace().next().and_then(|n| n.parse::<i64>().ok()))
                == Some(libc::SYS_connect)
        });
        let (done_tx, done_rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = done_tx.send(ipc::open_handle(&good).map(|b| b.len()));
        });
        let got = done_rx.recv_timeout(*WATCHDOG);
        // Let the stuck connect through, then hang up on it.
        for _ in 0..2 {
            // SAFETY: plain syscalls.
            let c = unsafe { libc::accept(listener, null_mut(), null_mut()) };
            if c >= 0 {
                // SAFETY: an fd this test owns, closed once.
                unsafe { libc::close(c) };
            }
        }
        // SAFETY: fds this test owns, closed once.
        unsafe { libc::close(filler) };
        // SAFETY: as above.
        unsafe { libc::close(listener) };
        let forged_result = within("the forged open after the hang-up", *WATCHDOG, move || stuck.join().unwrap());
        assert!(forged_result.is_err(), "a squatter's forged handle opened");
        match got {
            Ok(r) => assert_eq!(r.unwrap(), 16 * KB),
            Err(_) => panic!(
                "hang: opening a healthy handle waited for another thread's connect to a full listen queue \
                 (server::client connects under the CLIENTS lock)"
            ),
        }
    });
}

/// A hostile consumer connects to the producer's IPC socket, REQUESTs a held block and hangs
/// up without reading the answer (it dies mid-REQUEST). The hold is consumed by that request
/// and must be released with the connection: limbo back to 0, the allocator consistent, and
/// a later legitimate open of another handle still served.
#[test]
fn a_consumer_dying_mid_request_releases_the_block() {
    in_child("a_consumer_dying_mid_request_releases_the_block", &[], || {
        let a = allocator();
        let x = a.allocate(32 * KB, None).unwrap();
        let h = ipc::get_handle(&x, None).unwrap();
        drop(x);
        assert_eq!(a.stats().limbo_bytes.current, 32 * KB as i64);
        let fd = raw_connect(h.pid, h.token);
        raw_send(fd, &request_packet(h.export));
        // SAFETY: plain syscall.
        unsafe { libc::close(fd) };
        wait_until("the dead consumer's hold released", *WATCHDOG, || a.stats().limbo_bytes.current == 0);
        a.check_invariants().unwrap();
        // Garbage on the socket does not stop the producer either.
        let fd = raw_connect(h.pid, h.token);
        raw_send(fd, &[0xff; 7]);
        // The producer hangs up on the garbage (perhaps before this arrives): either way.
        let r = request_packet(u64::MAX);
        // SAFETY: a valid buffer.
        let n = unsafe { libc::send(fd, r.as_ptr().cast(), r.len(), libc::MSG_NOSIGNAL) };
        let e = std::io::Error::last_os_error();
        assert!(n == r.len() as isize || e.raw_os_error() == Some(libc::EPIPE), "send: {e}");
        // SAFETY: plain syscall.
        unsafe { libc::close(fd) };
        let y = a.allocate(8 * KB, None).unwrap();
        y.cpu_access(dmabuf_rt::segment::Access::Write).unwrap().write(0, &pat(3, 8 * KB)).unwrap();
        let h2 = ipc::get_handle(&y, None).unwrap();
        let b = within("an open after hostile peers", *WATCHDOG, move || ipc::open_handle(&h2).unwrap());
        let mut got = vec![0; 8 * KB];
        b.read(0, &mut got).unwrap();
        assert_eq!(got, pat(3, 8 * KB));
        drop(b);
        drop(y);
        a.check_invariants().unwrap();
    });
}

/// Two handles of one pointer (allowed: each holds the block), both opened in one process.
/// The importer maps the segment once, so both opens return the same address, and
/// `Runtime::ipc_open` does `imported.insert(ptr, block)`: the second open silently replaces
/// (drops, i.e. releases) the first. One close then lets the producer reuse the block while
/// the caller still has an open it has not closed, and the second close is refused.
#[test]
fn two_handles_of_one_pointer_opened_in_one_process_need_two_closes() {
    in_child("two_handles_of_one_pointer_opened_in_one_process_need_two_closes", ENV, || {
        let n = 64 * KB;
        let p = alloc(0, n);
        write(0, p, &pat(1, n));
        let (h1, h2) = (handle(0, p), handle(0, p));
        let q1 = open(1, &h1).unwrap_or_else(|s| panic!("open 1: {s:?} {}", last_error()));
        let q2 = open(1, &h2).unwrap_or_else(|s| panic!("open 2: {s:?} {}", last_error()));
        ok(dmabuf_rt_device_free(0, p));
        assert!(stats(0).limbo_bytes >= n as u64);
        ok(dmabuf_rt_ipc_close_mem_handle(1, q1));
        assert_eq!(q1, q2, "(a different address each: this test's premise does not hold)");
        let s = dmabuf_rt_ipc_close_mem_handle(1, q2);
        assert_eq!(
            s,
            DMABUF_RT_OK,
            "two opens, and the second close was refused (the second open replaced and released the first): {}",
            last_error()
        );
        wait_until("the release", *WATCHDOG, || stats(0).limbo_bytes == 0);
    });
}

/// Open/close cycles of handles of one producer (this process) do not leak fds: one
/// connection and the segments' fds, however many cycles.
#[test]
fn open_close_cycles_do_not_leak_fds() {
    in_child("open_close_cycles_do_not_leak_fds", ENV, || {
        let cycle = || {
            let p = alloc(0, 48 * KB);
            let q = open(1, &handle(0, p)).unwrap_or_else(|s| panic!("open: {s:?} {}", last_error()));
            ok(dmabuf_rt_ipc_close_mem_handle(1, q));
            ok(dmabuf_rt_device_free(0, p));
        };
        for _ in 0..5 {
            cycle();
        }
        wait_until("limbo 0", *WATCHDOG, || stats(0).limbo_bytes == 0);
        let before = open_fds();
        for _ in 0..200 {
            cycle();
        }
        wait_until("limbo 0", *WATCHDOG, || stats(0).limbo_bytes == 0);
        let after = open_fds();
        assert!(after <= before + 4, "fds: {before} before 200 open/close cycles, {after} after");
    });
}

static UNBLOCK: AtomicBool = AtomicBool::new(false);
static IN_CALLBACK: AtomicBool = AtomicBool::new(false);

extern "C" fn block_stream(_stream: dmabuf_rt_stream, _status: dmabuf_rt_status, _user: *mut c_void) {
    IN_CALLBACK.store(true, Ordering::SeqCst);
    let start = Instant::now();
    while !UNBLOCK.load(Ordering::SeqCst) && start.elapsed() < *WATCHDOG {
        std::thread::yield_now();
    }
}

/// A copy out of an opened block is queued on a stream of the other device (blocked behind a
/// callback), then the block is closed. `ipc_close` synchronizes only the device the block was
/// opened on, so it returns and releases the block to its producer while the copy is still
/// queued: the producer reuses the memory and the copy, when the stream runs, reads the
/// producer's new bytes. The close must wait for the queued copy (or refuse).
#[test]
fn close_waits_for_a_copy_queued_on_another_devices_stream() {
    in_child("close_waits_for_a_copy_queued_on_another_devices_stream", ENV, || {
        let n = 64 * KB;
        let p = alloc(0, n);
        write(0, p, &pat(1, n));
        let q = open(0, &handle(0, p)).unwrap_or_else(|s| panic!("open: {s:?} {}", last_error()));
        ok(dmabuf_rt_device_free(0, p));
        let r = alloc(1, n);
        let mut s: dmabuf_rt_stream = Default::default();
        // SAFETY: a valid out-pointer.
        ok(unsafe { dmabuf_rt_stream_create(1, &mut s) });
        // SAFETY: the callback is a plain function that ignores its user data.
        ok(unsafe { dmabuf_rt_stream_add_callback(s, Some(block_stream), null_mut()) });
        // SAFETY: both sides are device memory.
        ok(unsafe { dmabuf_rt_memcpy(1, r, 0, q.cast_const(), n, DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE, s) });
        wait_until("the stream to block", *WATCHDOG, || IN_CALLBACK.load(Ordering::SeqCst));
        let (tx, rx) = mpsc::channel();
        let qa = q as usize;
        std::thread::spawn(move || {
            let _ = tx.send(dmabuf_rt_ipc_close_mem_handle(0, qa as *mut c_void));
        });
        let early = rx.recv_timeout(Duration::from_millis(500)).ok();
        let mut reused = false;
        if early == Some(DMABUF_RT_OK) {
            // Released while the copy is queued: the producer reuses the block.
            let again: Vec<_> = (0..8).map(|_| alloc(0, n)).collect();
            reused = again.contains(&p);
            for &x in &again {
                write(0, x, &pat(9, n));
            }
        }
        UNBLOCK.store(true, Ordering::SeqCst);
        ok(dmabuf_rt_stream_synchronize(s));
        let status = early.or_else(|| rx.recv_timeout(*WATCHDOG).ok()).expect("hang: close");
        let copied = read(1, r, n);
        assert!(
            early.is_none(),
            "dmabuf_rt_ipc_close_mem_handle returned {early:?} while a copy from the block was still queued on a \
             stream (block reused by its producer: {reused}; the copy read the original bytes: {})",
            copied == pat(1, n)
        );
        ok(status);
        assert_eq!(copied, pat(1, n));
    });
}

/// A child forked after the runtime started: the IPC calls are refused with a clear error
/// (the runtime's threads stayed in the parent), promptly, not hanging.
#[test]
fn a_forked_child_is_refused_promptly() {
    in_child("a_forked_child_is_refused_promptly", ENV, || {
        let n = 16 * KB;
        let p = alloc(0, n);
        write(0, p, &pat(2, n));
        let h = handle(0, p);
        // SAFETY: the child only calls the library (which must refuse) and _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let mut code = 0;
            let mut hh = dmabuf_rt_ipc_mem_handle { bytes: [0; 64] };
            // SAFETY: valid out-pointer.
            let s1 = unsafe { dmabuf_rt_ipc_get_mem_handle(0, p, &mut hh) };
            if s1 == DMABUF_RT_OK || !last_error().contains("fork") {
                code |= 1;
            }
            if open(1, &h).is_ok() || !last_error().contains("fork") {
                code |= 2;
            }
            if dmabuf_rt_ipc_close_mem_handle(1, p) == DMABUF_RT_OK || !last_error().contains("fork") {
                code |= 4;
            }
            // SAFETY: exits the forked child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        let start = Instant::now();
        let status = loop {
            let mut st = 0;
            // SAFETY: our own child.
            let r = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
            if r == pid {
                break st;
            }
            if start.elapsed() > *WATCHDOG {
                // SAFETY: our own child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                panic!("hang: a forked child's IPC call did not return");
            }
            std::thread::yield_now();
        };
        assert!(libc::WIFEXITED(status), "forked child: {status:#x}");
        assert_eq!(libc::WEXITSTATUS(status), 0, "forked child: bitmask of calls not refused clearly");
        // The handle still opens in the parent.
        let q = open(1, &h).unwrap_or_else(|s| panic!("open: {s:?} {}", last_error()));
        assert_eq!(read(1, q, n), pat(2, n));
        ok(dmabuf_rt_ipc_close_mem_handle(1, q));
        ok(dmabuf_rt_device_free(0, p));
    });
}
