#![allow(unsafe_code)]
//! IPC handles through the C API (`dmabuf_rt_ipc_get_mem_handle`, `_open_mem_handle`,
//! `_close_mem_handle`), as a C caller uses CUDA's: the handle's 64 bytes cross to another
//! process by any means (here an environment variable), which opens them as device memory of
//! its own (copies, memsets and `dmabuf_rt_pointer_device` take it); the producer's freed block
//! waits in limbo (`limbo_bytes`) until the consumer closes it or dies; bad pointers and
//! handles are refused from several threads at once.
//!
//! The runtime is process-wide and reads its environment once, so every case runs in a child
//! process of its own (this test binary, the one test, `DMABUF_RT_ISOLATED_TEST=<name>`, `tests/common/isolate.rs`).

mod common;

use common::wait::wait_until;

use common::isolate::{self, in_child};
use std::ffi::{CStr, c_int, c_void};
use std::ptr::null_mut;
use std::time::Duration;

use dmabuf_rt::ffi::capi::dmabuf_rt_status::*;
use dmabuf_rt::ffi::capi::*;

/// How long the bounded waits of this file wait.
static WAIT: std::sync::LazyLock<Duration> =
    std::sync::LazyLock::new(|| Duration::from_secs(30) * common::time_scale());

const HANDLES: &str = "IPC_CAPI_HANDLES";
const KB: usize = 1 << 10;
const MB: usize = 1 << 20;
const ENV: &[(&str, &str)] = &[("DMABUF_RT_DEVICES", "shmem,shmem"), ("DMABUF_RT_CAPACITY", "256M")];

fn last_error() -> String {
    let p = dmabuf_rt_last_error();
    // SAFETY: a non-null last error is a NUL-terminated string valid until the next failure.
    if p.is_null() { "<none>".into() } else { unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned() }
}

#[track_caller]
fn ok(s: dmabuf_rt_status) {
    assert_eq!(s, DMABUF_RT_OK, "call failed: {}", if s == DMABUF_RT_OK { String::new() } else { last_error() });
}

#[track_caller]
fn refused(got: dmabuf_rt_status, want: dmabuf_rt_status, has: &str) {
    let why = if got == DMABUF_RT_OK { "<none>".to_string() } else { last_error() };
    assert_eq!(got, want, "wrong status ({why})");
    assert!(why.contains(has), "last error `{why}` does not say `{has}`");
}

fn alloc(device: c_int, n: usize) -> *mut c_void {
    let mut p = null_mut();
    // SAFETY: a valid out-pointer.
    ok(unsafe { dmabuf_rt_device_alloc(device, n, &mut p) });
    p
}

fn pat(tag: u8, n: usize) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(13) ^ tag ^ ((i >> 12) as u8)).collect()
}

fn write(device: c_int, p: *mut c_void, at: usize, bytes: &[u8]) -> dmabuf_rt_status {
    // SAFETY: the host side is a live buffer of `bytes.len()` bytes.
    unsafe {
        dmabuf_rt_memcpy(
            device,
            p.cast::<u8>().wrapping_add(at).cast(),
            0,
            bytes.as_ptr().cast(),
            bytes.len(),
            DMABUF_RT_MEMCPY_HOST_TO_DEVICE,
            0,
        )
    }
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

fn hex(h: &dmabuf_rt_ipc_mem_handle) -> String {
    h.bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> dmabuf_rt_ipc_mem_handle {
    let mut h = dmabuf_rt_ipc_mem_handle { bytes: [0; 64] };
    for (i, b) in h.bytes.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
    }
    h
}

/// In one process, device 1 opens what device 0 shared: the bytes, writes seen both ways, the
/// freed block in limbo until the close, and every bad call refused with its cause, from
/// several threads at once.
#[test]
fn a_handle_opens_as_device_memory_and_bad_calls_are_refused() {
    in_child("a_handle_opens_as_device_memory_and_bad_calls_are_refused", ENV, || {
        let n = 100 * KB + 3;
        let p = alloc(0, n);
        ok(write(0, p, 0, &pat(1, n)));
        let h = handle(0, p);
        let q = open(1, &h).unwrap_or_else(|s| panic!("open: {s:?} {}", last_error()));
        let mut dev = 0;
        // SAFETY: a valid out-pointer.
        ok(unsafe { dmabuf_rt_pointer_device(q.cast_const(), &mut dev) });
        assert_eq!(dev, 1, "an opened block counts as memory of the device it was opened on");
        assert_eq!(read(1, q, n), pat(1, n));
        ok(write(1, q, 10, b"from device 1"));
        assert_eq!(&read(0, p, 23)[10..], b"from device 1");
        ok(dmabuf_rt_memset(1, q.cast::<u8>().wrapping_add(100).cast(), 0x5a, 8));
        assert_eq!(read(0, p, 108)[100..], [0x5a; 8]);
        // Past the block's end, on the other device, a second open, a free of it.
        refused(write(1, q, n - 4, &[0; 8]), DMABUF_RT_INVALID_POINTER, "past its end");
        refused(open(1, &h).unwrap_err(), DMABUF_RT_INVALID_ARGUMENT, "already opened");
        refused(dmabuf_rt_device_free(1, q), DMABUF_RT_INVALID_POINTER, "dmabuf_rt_ipc_close_mem_handle");
        // Freed by its producer: in limbo, not reused.
        ok(dmabuf_rt_device_free(0, p));
        let limbo = stats(0).limbo_bytes;
        assert!(limbo >= n as u64, "limbo {limbo}");
        let again: Vec<_> = (0..8).map(|_| alloc(0, n)).collect();
        assert!(again.iter().all(|&x| x != p), "the block in limbo was handed out");
        for &x in &again {
            ok(write(0, x, 0, &pat(9, n)));
        }
        let mut want = pat(1, n);
        want[10..23].copy_from_slice(b"from device 1");
        want[100..108].fill(0x5a);
        assert_eq!(read(1, q, n), want, "an opened block changed after its producer freed it");
        // Bad input from four threads at once.
        std::thread::scope(|s| {
            for t in 0..4u8 {
                let (h, q) = (h, q as usize);
                s.spawn(move || {
                    let q = q as *mut c_void;
                    let mut bad = h;
                    bad.bytes[0] ^= 1;
                    refused(open(1, &bad).unwrap_err(), DMABUF_RT_INVALID_ARGUMENT, "magic");
                    let mut bad = h;
                    bad.bytes[16] ^= 0x40 | t; // the hold
                    assert!(open(1, &bad).is_err(), "a forged hold opened");
                    let mut p = null_mut();
                    // SAFETY: NULL handle (refused), valid out-pointer.
                    refused(
                        unsafe { dmabuf_rt_ipc_open_mem_handle(1, std::ptr::null(), &mut p) },
                        DMABUF_RT_INVALID_POINTER,
                        "handle",
                    );
                    refused(dmabuf_rt_ipc_close_mem_handle(0, q), DMABUF_RT_INVALID_POINTER, "opened on device 1");
                    refused(
                        dmabuf_rt_ipc_close_mem_handle(1, q.cast::<u8>().wrapping_add(8).cast()),
                        DMABUF_RT_INVALID_POINTER,
                        "",
                    );
                    let mut hh = dmabuf_rt_ipc_mem_handle { bytes: [0; 64] };
                    // SAFETY: valid out-pointer.
                    refused(unsafe { dmabuf_rt_ipc_get_mem_handle(0, q, &mut hh) }, DMABUF_RT_INVALID_POINTER, "");
                    let x = alloc(0, 64 * KB);
                    // SAFETY: valid out-pointer.
                    refused(
                        unsafe { dmabuf_rt_ipc_get_mem_handle(0, x.cast::<u8>().wrapping_add(4096).cast(), &mut hh) },
                        DMABUF_RT_INVALID_POINTER,
                        "",
                    );
                    ok(dmabuf_rt_device_free(0, x));
                });
            }
        });
        ok(dmabuf_rt_ipc_close_mem_handle(1, q));
        refused(dmabuf_rt_ipc_close_mem_handle(1, q), DMABUF_RT_INVALID_POINTER, "");
        wait_until("the release", *WAIT, || stats(0).limbo_bytes == 0);
        for x in again {
            ok(dmabuf_rt_device_free(0, x));
        }
        assert_eq!(stats(0).allocations, 0);
    });
}

/// A producer process shares blocks and frees them at once; a consumer process given only the
/// handles' bytes opens them, reads what the producer wrote, writes into a block the producer
/// kept, closes one and exits without closing the rest; the producer sees the write, and
/// limbo goes back to 0 once the consumer is gone.
#[test]
fn a_consumer_process_opens_handles_and_its_exit_releases_them() {
    if let Ok(handles) = std::env::var(HANDLES) {
        // The consumer.
        if std::env::var(isolate::CHILD_ENV).as_deref() != Ok("consumer") {
            return;
        }
        let hs: Vec<_> = handles.split(',').map(unhex).collect();
        let sizes = [8 * KB, 64 * KB + 1, 3 * MB];
        let mut opened = Vec::new();
        for (i, h) in hs.iter().enumerate() {
            let q = open(0, h).unwrap_or_else(|s| panic!("open {i}: {s:?} {}", last_error()));
            assert_eq!(read(0, q, sizes[i]), pat(i as u8 + 1, sizes[i]), "block {i}");
            opened.push(q);
        }
        ok(write(0, opened[0], 0, b"consumer was here"));
        ok(dmabuf_rt_device_synchronize(0));
        ok(dmabuf_rt_ipc_close_mem_handle(0, opened[1]));
        // Exits with blocks 0 and 2 still open.
        std::process::exit(0);
    }
    in_child("a_consumer_process_opens_handles_and_its_exit_releases_them", ENV, || {
        let sizes = [8 * KB, 64 * KB + 1, 3 * MB];
        let ps: Vec<_> = sizes.iter().map(|&n| alloc(0, n)).collect();
        for (i, (&p, &n)) in ps.iter().zip(&sizes).enumerate() {
            ok(write(0, p, 0, &pat(i as u8 + 1, n)));
        }
        let hs: Vec<_> = ps.iter().map(|&p| hex(&handle(0, p))).collect();
        // Blocks 1 and 2 freed at once; block 0 kept to see the consumer's write.
        ok(dmabuf_rt_device_free(0, ps[1]));
        ok(dmabuf_rt_device_free(0, ps[2]));
        assert!(stats(0).limbo_bytes >= (sizes[1] + sizes[2]) as u64);
        let name = "a_consumer_process_opens_handles_and_its_exit_releases_them";
        let mut consumer = isolate::command(name, ENV);
        let out = consumer
            .env(isolate::CHILD_ENV, "consumer")
            .env("DMABUF_RT_LOG", "off")
            .env(HANDLES, hs.join(","))
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "consumer: {text}");
        assert_eq!(&read(0, ps[0], 17), b"consumer was here");
        wait_until("the consumer's releases", *WAIT, || stats(0).limbo_bytes == 0);
        ok(dmabuf_rt_device_free(0, ps[0]));
        assert_eq!(stats(0).allocations, 0);
    });
}

/// The gate the stream callback of the fence test waits behind.
static GATE: (std::sync::Mutex<bool>, std::sync::Condvar) = (std::sync::Mutex::new(false), std::sync::Condvar::new());

extern "C" fn wait_for_gate(_: dmabuf_rt_stream, _: dmabuf_rt_status, _: *mut c_void) {
    let mut open = GATE.0.lock().unwrap();
    while !*open {
        open = GATE.1.wait(open).unwrap();
    }
}

/// A handle made on a stream does not wait for the stream: its queued copy travels as a fence,
/// the open waits for it and then sees the copy's bytes; bad streams are refused, saying why,
/// from several threads at once.
#[test]
fn a_handle_made_on_a_stream_carries_its_work_as_a_fence() {
    in_child("a_handle_made_on_a_stream_carries_its_work_as_a_fence", ENV, || {
        let n = 256 * KB;
        let p = alloc(0, n);
        let mut s = 0;
        // SAFETY: a valid out-pointer.
        ok(unsafe { dmabuf_rt_stream_create(0, &mut s) });
        // SAFETY: the callback ignores its user data.
        ok(unsafe { dmabuf_rt_stream_add_callback(s, Some(wait_for_gate), null_mut()) });
        let bytes = pat(7, n);
        // SAFETY: `bytes` lives until the stream has run the copy (synchronized below).
        ok(unsafe { dmabuf_rt_memcpy(0, p, 0, bytes.as_ptr().cast(), n, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, s) });
        // The handle comes back while the stream is still held (a synchronizing call would
        // never return: the test would fail on the timeout, not hang).
        let (tx, rx) = std::sync::mpsc::channel();
        let pp = p as usize;
        std::thread::spawn(move || {
            let mut h = dmabuf_rt_ipc_mem_handle { bytes: [0; 64] };
            // SAFETY: a valid out-pointer.
            let st = unsafe { dmabuf_rt_ipc_get_mem_handle_on_stream(0, pp as *mut c_void, s, &mut h) };
            tx.send((st, h)).unwrap();
        });
        let (st, h) = rx.recv_timeout(Duration::from_secs(20)).expect("the handle waited for the stream");
        ok(st);
        // The open waits for the fence: not done while the gate is closed.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let q = open(1, &h).map(|q| q as usize);
            tx.send(q.map(|q| (q, read(1, q as *mut c_void, n)))).unwrap();
        });
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "the open did not wait for the producer's copy");
        *GATE.0.lock().unwrap() = true;
        GATE.1.notify_all();
        let (q, seen) = rx.recv_timeout(Duration::from_secs(30)).expect("the open never returned").expect("open");
        assert!(seen == bytes, "the opened block does not hold the copy's bytes");
        ok(dmabuf_rt_stream_synchronize(s));
        ok(dmabuf_rt_ipc_close_mem_handle(1, q as *mut c_void));

        // Bad streams, from 4 threads at once: a forged one, one of the other device, and 0
        // (the synchronous form, which works).
        let mut s1 = 0;
        // SAFETY: a valid out-pointer.
        ok(unsafe { dmabuf_rt_stream_create(1, &mut s1) });
        std::thread::scope(|sc| {
            for _ in 0..4 {
                sc.spawn(|| {
                    let p = pp as *mut c_void;
                    for _ in 0..20 {
                        let mut h = dmabuf_rt_ipc_mem_handle { bytes: [0; 64] };
                        let get = |p: *mut c_void, s: dmabuf_rt_stream, h: *mut dmabuf_rt_ipc_mem_handle| {
                            // SAFETY: `h` is null (refused) or a valid out-pointer.
                            unsafe { dmabuf_rt_ipc_get_mem_handle_on_stream(0, p, s, h) }
                        };
                        refused(get(p, 0xdead_beef, &mut h), DMABUF_RT_INVALID_HANDLE, "stream");
                        refused(get(p, s1, &mut h), DMABUF_RT_INVALID_ARGUMENT, "belongs to device 1");
                        refused(get(null_mut(), s, &mut h), DMABUF_RT_INVALID_POINTER, "ptr");
                        refused(get(p, s, null_mut()), DMABUF_RT_INVALID_POINTER, "handle");
                    }
                });
            }
        });
        let h = {
            let mut h = dmabuf_rt_ipc_mem_handle { bytes: [0; 64] };
            // SAFETY: a valid out-pointer.
            ok(unsafe { dmabuf_rt_ipc_get_mem_handle_on_stream(0, p, 0, &mut h) });
            h
        };
        let q = open(1, &h).expect("a handle of stream 0 opens");
        assert!(read(1, q, n) == bytes);
        ok(dmabuf_rt_ipc_close_mem_handle(1, q));
        ok(dmabuf_rt_stream_destroy(s));
        ok(dmabuf_rt_stream_destroy(s1));
        ok(dmabuf_rt_device_free(0, p));
        wait_until("limbo back to 0", *WAIT, || stats(0).limbo_bytes == 0);
    });
}

/// Memory opened from a handle and lent to a SyncedMemory (`_set_device_data`) is not closed
/// under it: the last close ends the mapping and lets the producer reuse the block, which the
/// SyncedMemory would then read and write in the other process's hands. The close is refused
/// from four threads at once, and goes once the SyncedMemory is destroyed; a close racing a
/// lend of the same block never lets both succeed.
///
/// It failed before the close looked at the registry of lent memory: the frees of lent memory
/// were refused, the close of an opened block was not.
#[test]
fn an_opened_block_lent_to_a_synced_memory_is_not_closed_under_it() {
    in_child("an_opened_block_lent_to_a_synced_memory_is_not_closed_under_it", ENV, || {
        let n = 64 * KB;
        let p = alloc(0, n);
        ok(write(0, p, 0, &pat(3, n)));
        let h = handle(0, p);
        let q = open(1, &h).unwrap_or_else(|s| panic!("open: {s:?} {}", last_error()));
        let s = common::capi::synced(1, n, false);
        ok(dmabuf_rt_synced_set_device_data(s, q));
        std::thread::scope(|sc| {
            for _ in 0..4 {
                let q = q as usize;
                sc.spawn(move || {
                    refused(
                        dmabuf_rt_ipc_close_mem_handle(1, q as *mut c_void),
                        DMABUF_RT_INVALID_POINTER,
                        "lent to a SyncedMemory",
                    );
                });
            }
        });
        assert_eq!(read(1, q, n), pat(3, n), "the refused close changed the block");
        assert_eq!(read(1, common::capi::device_ptr(s), n), pat(3, n));
        ok(dmabuf_rt_synced_destroy(s));
        ok(dmabuf_rt_ipc_close_mem_handle(1, q));

        // A close racing a lend of the same block: one of the two wins, never both.
        let (mut lends, mut closes) = (0, 0);
        for round in 0..40 {
            // A handle opens once: a new one each round.
            let h = handle(0, p);
            let q = open(1, &h).unwrap_or_else(|st| panic!("round {round}: open: {st:?} {}", last_error())) as usize;
            let s = common::capi::synced(1, n, false);
            let barrier = std::sync::Barrier::new(2);
            let (lent, closed) = std::thread::scope(|sc| {
                let lend = sc.spawn(|| {
                    barrier.wait();
                    dmabuf_rt_synced_set_device_data(s, q as *mut c_void)
                });
                let close = sc.spawn(|| {
                    barrier.wait();
                    dmabuf_rt_ipc_close_mem_handle(1, q as *mut c_void)
                });
                (lend.join().unwrap(), close.join().unwrap())
            });
            let (lent, closed) = (lent == DMABUF_RT_OK, closed == DMABUF_RT_OK);
            assert!(lent != closed, "round {round}: lent {lent}, closed {closed}: {}", last_error());
            if lent {
                lends += 1;
                assert_eq!(read(1, common::capi::device_ptr(s), n), pat(3, n), "round {round}");
                ok(dmabuf_rt_synced_destroy(s));
                ok(dmabuf_rt_ipc_close_mem_handle(1, q as *mut c_void));
            } else {
                closes += 1;
                ok(dmabuf_rt_synced_destroy(s));
            }
        }
        eprintln!("{lends} lends won, {closes} closes won");
        ok(dmabuf_rt_device_free(0, p));
        wait_until("the release", *WAIT, || stats(0).limbo_bytes == 0);
        assert_eq!(stats(0).allocations, 0);
    });
}

/// A producer process that exits, its block still allocated, while this process's
/// SyncedMemory borrows the block it opened from the producer's handle: the memory stays (the
/// opened mapping holds the segment's memory), the SyncedMemory's reads and writes through its
/// host and device views go on, and the close after the destroy releases it (a second close is
/// refused).
#[test]
fn a_producer_exits_while_a_synced_memory_borrows_its_opened_block() {
    use std::io::{BufRead, Write};
    const NAME: &str = "a_producer_exits_while_a_synced_memory_borrows_its_opened_block";
    let n = 256 * KB;
    if std::env::var(isolate::CHILD_ENV).as_deref() == Ok("producer") {
        let p = alloc(0, n);
        ok(write(0, p, 0, &pat(7, n)));
        println!("HANDLE {}", hex(&handle(0, p)));
        std::io::stdout().flush().unwrap();
        // Exits, the block never freed, when the consumer says so (or is gone).
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        std::process::exit(0);
    }
    in_child(NAME, ENV, || {
        let mut producer = isolate::command(NAME, ENV)
            .env(isolate::CHILD_ENV, "producer")
            .env("DMABUF_RT_LOG", "off")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let said = std::io::BufReader::new(producer.stdout.take().unwrap());
        let h = said
            .lines()
            .map_while(Result::ok)
            // The line may follow libtest's "test NAME ... " on the same line.
            .find_map(|l| l.split_once("HANDLE ").map(|(_, h)| unhex(h.trim())))
            .expect("the producer printed no handle");
        let q = open(0, &h).unwrap_or_else(|s| panic!("open: {s:?} {}", last_error()));
        let s = common::capi::synced(0, n, false);
        ok(dmabuf_rt_synced_set_device_data(s, q));
        // The producer goes: its allocator, its segment and its fds with it.
        writeln!(producer.stdin.take().unwrap(), "exit").unwrap();
        assert!(producer.wait().unwrap().success());
        // The SyncedMemory reads the borrowed block through its host view...
        let mut host: *const c_void = std::ptr::null();
        // SAFETY: valid out-pointer.
        ok(unsafe { dmabuf_rt_synced_host_data(s, &mut host) });
        // SAFETY: the host view holds `n` bytes until the next call on `s`.
        let seen = unsafe { std::slice::from_raw_parts(host.cast::<u8>(), n) }.to_vec();
        assert!(seen == pat(7, n), "the borrowed block's bytes changed when its producer exited");
        // ...and writes it back through its device view.
        common::capi::write_host(s, n, 0x5a);
        let (st, d) = common::capi::mutable_device(s);
        ok(st);
        assert_eq!(d, q, "the device view is not the borrowed block");
        assert!(read(0, q, n) == vec![0x5a; n], "the write did not reach the borrowed block");
        ok(dmabuf_rt_synced_destroy(s));
        ok(dmabuf_rt_ipc_close_mem_handle(0, q));
        refused(dmabuf_rt_ipc_close_mem_handle(0, q), DMABUF_RT_INVALID_POINTER, "");
        assert_eq!(stats(0).allocations, 0);
    });
}
