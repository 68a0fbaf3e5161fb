//! `dmabuf_rt::ipc`: blocks of a caching allocator shared with other processes, held in limbo
//! while an importer holds them, released when it lets go, exits or is killed; and every bad
//! handle and malformed packet refused.
//!
//! Cross-process cases re-execute this test binary (`child_entry` alone, `IPC_TEST_CHILD=<role>`
//! in its environment) with its end of the IPC channel as stdin; a second channel for control
//! (handles one way, answers the other) crosses as the first packet of the first.

#![allow(unsafe_code)] // fork(2) in the fork case's producer, and its child's alarm and pause

mod common;

use common::wait::wait_until;

use common::control::{Ctl, cmd_of, ctl};
use common::{fill_pattern, open_fds, pattern, serial};

use std::os::fd::AsFd;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dmabuf_rt::caching::stats::AGGREGATE;
use dmabuf_rt::caching::{Allocation, CachingAllocator};
use dmabuf_rt::ipc::{IpcExporter, IpcHandle, IpcImporter};
use dmabuf_rt::queue::{HostBuffer, Queue};
use dmabuf_rt::segment::Access;
use dmabuf_rt::share::Channel;
use dmabuf_rt::source::ShmemSource;
use dmabuf_rt::{Error, Segment};

/// How long the bounded waits of this file wait.
static WAIT: std::sync::LazyLock<Duration> =
    std::sync::LazyLock::new(|| Duration::from_secs(30) * common::time_scale());

const ROLE_ENV: &str = "IPC_TEST_CHILD";
const KB: usize = 1 << 10;
const MB: usize = 1 << 20;

fn limbo(a: &CachingAllocator) -> i64 {
    a.stats().limbo_bytes.current
}

// ---------------------------------------------------------------------------------------------
// The child side.

const HANDLE: u64 = 1;
const VERIFY: u64 = 2;
const RELEASE: u64 = 3;
const COUNT_FDS: u64 = 4;
const EXIT: u64 = 5;
/// Open a process-wide handle (`ipc::open_handle`); answers 0, or 1 if refused as opened.
const OPEN_GLOBAL: u64 = 6;

/// The child: opens the handles it is sent, verifies their bytes (each block's tag is the
/// `export` number of the handle it was sent), releases them, counts its fds, on command.
#[test]
fn child_entry() {
    let Ok(_role) = std::env::var(ROLE_ENV) else { return };
    let fd = std::io::stdin().as_fd().try_clone_to_owned().unwrap();
    let ipc = Channel::from_fd(fd, "child ipc").unwrap();
    let control = ipc.recv::<[u8; 1]>().unwrap().fd.expect("the control channel's fd");
    let control = Channel::from_fd(control, "child control").unwrap();
    let fds_at_start = open_fds();
    let importer = IpcImporter::new(ipc);
    let mut open = Vec::new();
    loop {
        let m = control.recv::<Ctl>().unwrap().msg;
        let (cmd, h) = cmd_of(&m);
        let answer = match cmd {
            HANDLE => {
                let h = h.unwrap();
                open.push((importer.open(&h).unwrap(), h.export as u8));
                0
            }
            VERIFY => {
                let mut bad = 0u64;
                for (b, tag) in &open {
                    let mut v = vec![0u8; b.len()];
                    b.read(0, &mut v).unwrap();
                    if v != pattern(b.len(), *tag) {
                        bad += 1;
                    }
                }
                bad
            }
            RELEASE => {
                open.clear();
                0
            }
            COUNT_FDS => (open_fds() - fds_at_start) as u64 * 1_000_000 + importer.segments() as u64,
            OPEN_GLOBAL => match dmabuf_rt::ipc::open_handle(&h.unwrap()) {
                Ok(b) => {
                    open.push((b, h.unwrap().export as u8));
                    0
                }
                Err(Error::InvalidArgument { what }) if what.contains("already opened") => 1,
                Err(e) => panic!("open_handle: {e}"),
            },
            _ => std::process::exit(0),
        };
        control.send(&ctl(answer, None)).unwrap();
    }
}

struct Consumer {
    child: Child,
    control: Channel,
}

impl Consumer {
    fn ask(&self, cmd: u64, h: Option<&IpcHandle>) -> u64 {
        self.control.send(&ctl(cmd, h)).unwrap();
        cmd_of(&self.control.recv::<Ctl>().unwrap().msg).0
    }

    fn exit(mut self) {
        self.control.send(&ctl(EXIT, None)).unwrap();
        assert!(self.child.wait().unwrap().success());
    }
}

/// An exporter to a new child process, and the child.
fn consumer() -> (IpcExporter, Consumer) {
    let (mine, theirs) = Channel::pair("producer<->consumer").unwrap();
    let (control, control_theirs) = Channel::pair("control").unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, "consumer")
        .stdin(Stdio::from(theirs.into_fd()))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // The control channel crosses first, over the IPC channel.
    mine.send_with_fd(&[0u8; 1], control_theirs.as_fd()).unwrap();
    drop(control_theirs);
    (IpcExporter::new(mine).unwrap(), Consumer { child, control })
}

// ---------------------------------------------------------------------------------------------
// Two processes.

/// Blocks of every kind (a pool block, home blocks, a stitched view) shared, then freed by the
/// producer at once; the producer allocates and writes new blocks in a loop while the consumer
/// reads the old ones, which keep their bytes; limbo bytes go back to 0 once it releases them.
#[test]
fn shared_blocks_freed_at_once_keep_their_bytes_while_the_producer_churns() {
    let _serial = serial();
    let a = common::allocator("", 64 * MB as u64);
    let (exp, c) = consumer();
    let sizes = [4 * KB, 16 * KB, 100 * KB + 7, 3 * MB + 5];
    let mut shared = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let x = a.allocate(n, None).unwrap();
        shared.push((x, i));
    }
    let mut handles = Vec::new();
    for (x, _) in &shared {
        let h = exp.export(x, None).unwrap();
        fill_pattern(x, h.export as u8);
        handles.push(h);
    }
    for h in &handles {
        assert_eq!(c.ask(HANDLE, Some(h)), 0);
    }
    assert_eq!(c.ask(VERIFY, None), 0, "the consumer does not see the producer's bytes");
    let in_use: i64 = shared.iter().map(|(x, _)| x.len() as i64).sum();
    drop(shared);
    assert!(limbo(&a) >= in_use, "limbo {} < {in_use}", limbo(&a));
    a.check_invariants().unwrap();
    // The producer churns: same sizes, new bytes, while the consumer reads.
    let churn = |rounds: usize| {
        for r in 0..rounds {
            let xs: Vec<_> = sizes.iter().map(|&n| a.allocate(n, None).unwrap()).collect();
            for x in &xs {
                fill_pattern(x, 0xA0 ^ r as u8);
            }
        }
    };
    churn(50);
    assert_eq!(c.ask(VERIFY, None), 0, "a block in limbo was reused");
    std::thread::scope(|s| {
        let reader = s.spawn(|| (0..20).map(|_| c.ask(VERIFY, None)).sum::<u64>());
        churn(100);
        assert_eq!(reader.join().unwrap(), 0, "a block in limbo was reused while the consumer read it");
    });
    a.check_invariants().unwrap();
    assert_eq!(exp.held(), handles.len());
    assert_eq!(c.ask(RELEASE, None), 0);
    wait_until("the releases", *WAIT, || exp.held() == 0 && limbo(&a) == 0);
    a.check_invariants().unwrap();
    let s = a.stats();
    assert_eq!(s.allocated_bytes[AGGREGATE].current, 0);
    assert_eq!(s.active_bytes[AGGREGATE].current, 0, "a released block stayed active");
    // (The first fd sent is the control channel's.)
    assert_eq!(exp.channel().fds_sent() - 1, 2, "one arena memfd and one pool segment (and no fd per block)");
    c.exit();
}

/// A consumer killed with SIGKILL while it holds blocks the producer freed: the kernel closes
/// its end of the socket and the producer's exporter releases everything.
#[test]
fn a_consumer_killed_while_holding_blocks_releases_them() {
    let _serial = serial();
    let a = common::allocator("", 64 * MB as u64);
    let (exp, mut c) = consumer();
    let xs: Vec<_> = [8 * KB, 64 * KB, 2 * MB].iter().map(|&n| a.allocate(n, None).unwrap()).collect();
    for x in &xs {
        let h = exp.export(x, None).unwrap();
        fill_pattern(x, h.export as u8);
        assert_eq!(c.ask(HANDLE, Some(&h)), 0);
    }
    assert_eq!(c.ask(VERIFY, None), 0);
    drop(xs);
    assert!(limbo(&a) > 0);
    c.child.kill().unwrap();
    c.child.wait().unwrap();
    wait_until("the dead consumer's releases", *WAIT, || exp.held() == 0 && limbo(&a) == 0);
    assert!(exp.peer_gone().is_some());
    a.check_invariants().unwrap();
    // Its memory is reusable, and a further export says the peer is gone.
    let x = a.allocate(8 * KB, None).unwrap();
    assert!(matches!(exp.export(&x, None), Err(Error::PeerGone { .. })));
    a.empty_cache();
    assert_eq!(a.stats().active_bytes[AGGREGATE].current, x.len().next_multiple_of(512) as i64);
}

/// 10,000 blocks shared: the consumer's fds grow by the segments it was sent, not the blocks.
#[test]
fn ten_thousand_shared_blocks_cost_an_fd_per_segment_not_per_block() {
    let _serial = serial();
    let a = common::allocator("", 256 * MB as u64);
    let (exp, c) = consumer();
    let xs: Vec<_> = (0..10_000).map(|i| a.allocate(1024 + (i % 7) * 512, None).unwrap()).collect();
    for x in &xs {
        let h = exp.export(x, None).unwrap();
        assert_eq!(c.ask(HANDLE, Some(&h)), 0);
    }
    let answer = c.ask(COUNT_FDS, None);
    let (fds, segments) = (answer / 1_000_000, answer % 1_000_000);
    // (The first fd sent is the control channel's.)
    let sent = exp.channel().fds_sent() - 1;
    println!("10,000 blocks: the consumer holds {fds} more fds, {segments} segments; the producer sent {sent}");
    // An fd per segment, and the importer's pidfd of the producer (whose exit fails fences).
    assert!(segments >= 1 && fds <= segments + 1, "{fds} fds for {segments} segments");
    assert_eq!(sent, segments);
    assert!(segments < 20, "{segments} segments for 10,000 small blocks");
    drop(xs);
    assert_eq!(c.ask(RELEASE, None), 0);
    wait_until("the releases", *WAIT, || exp.held() == 0 && limbo(&a) == 0);
    c.exit();
}

// ---------------------------------------------------------------------------------------------
// One process, two channel ends.

fn pair() -> (IpcExporter, IpcImporter) {
    let (a, b) = Channel::pair("ipc").unwrap();
    (IpcExporter::new(a).unwrap(), IpcImporter::new(b))
}

/// While held, a freed block's address is not handed out again; after the release it is.
#[test]
fn a_freed_shared_block_is_not_reused_until_released() {
    let _serial = serial();
    let a = common::allocator("", 64 * MB as u64);
    let (exp, imp) = pair();
    for n in [2 * KB, 40 * KB, 4 * MB] {
        let x = a.allocate(n, None).unwrap();
        fill_pattern(&x, 7);
        let h = exp.export(&x, None).unwrap();
        let got = imp.open(&h).unwrap();
        let addr = x.as_ptr();
        drop(x);
        assert_eq!(limbo(&a), n.next_multiple_of(if n >= 16 * KB { 4096 } else { 512 }) as i64);
        let again: Vec<_> = (0..8).map(|_| a.allocate(n, None).unwrap()).collect();
        assert!(again.iter().all(|y| y.as_ptr() != addr), "{n}: the block in limbo was handed out");
        for y in &again {
            fill_pattern(y, 9);
        }
        let mut v = vec![0; n];
        got.read(0, &mut v).unwrap();
        assert!(v == pattern(n, 7), "{n}: the imported block changed");
        // The import is bounded to the block.
        assert!(matches!(got.read(n - 1, &mut [0; 2]), Err(Error::OutOfBounds { .. })));
        assert!(matches!(got.write(n, &[1]), Err(Error::OutOfBounds { .. })));
        a.check_invariants().unwrap();
        drop(got);
        wait_until("the release", *WAIT, || limbo(&a) == 0 && exp.held() == 0);
        a.check_invariants().unwrap();
    }
}

/// Writes on either side are seen on the other; a stitched block reads in order.
#[test]
fn writes_are_seen_on_both_sides_and_a_stitched_block_reads_in_order() {
    let _serial = serial();
    let a = common::allocator("", (8 * 32 * KB) as u64);
    let pads: Vec<_> = (0..8).map(|_| a.allocate(32 * KB, None).unwrap()).collect();
    let kept: Vec<_> = pads.into_iter().skip(1).step_by(2).collect();
    let big = a.allocate(100 * KB, None).unwrap();
    assert!(big.fd_ranges().len() > 1, "not stitched: {:?}", big.fd_ranges());
    let (exp, imp) = pair();
    fill_pattern(&big, 3);
    let h = exp.export(&big, None).unwrap();
    let got = imp.open(&h).unwrap();
    let mut v = vec![0; big.len()];
    got.read(0, &mut v).unwrap();
    assert!(v == pattern(big.len(), 3), "the stitched import does not show the block in order");
    got.write(32 * KB - 4, b"from the importer").unwrap();
    let mut w = [0u8; 17];
    big.cpu_access(Access::Read).unwrap().read(32 * KB - 4, &mut w).unwrap();
    assert_eq!(&w, b"from the importer");
    // A kept neighbour's import is one range.
    let hk = exp.export(&kept[0], None).unwrap();
    assert_eq!(hk.offset as usize, kept[0].offset());
    drop((got, imp));
    wait_until("the importer hung up", *WAIT, || exp.held() == 0);
}

/// Work queued on the producer's queue before the export is the share's fence: the export
/// does not wait for it, the importer's block is not ready until it is done, and its reads
/// wait for it; then they see its result. (The queue is held by a callback until the test
/// lets it go, so the work is certainly pending when the block is shared and opened.)
#[test]
fn an_export_after_queued_work_is_ready_only_once_that_work_is_done() {
    let _serial = serial();
    let a = common::allocator("", 64 * MB as u64);
    let q = Queue::new().unwrap();
    let (exp, imp) = pair();
    let x = a.allocate(8 * MB, Some(&q)).unwrap();
    let src = HostBuffer::new(8 * MB).unwrap();
    src.write(0, &pattern(8 * MB, 5)).unwrap();
    let (gate, held) = std::sync::mpsc::channel::<()>();
    q.callback(move |_| {
        let _ = held.recv();
    })
    .unwrap();
    q.copy(x.mem(), &src).unwrap();
    let h = exp.export(&x, Some(&q)).unwrap();
    let got = imp.open(&h).unwrap();
    assert!(!got.is_ready(), "ready while the producer's copy is still queued");
    assert!(matches!(got.wait_ready(Some(Duration::from_millis(50))), Err(Error::Timeout { .. })));
    std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let mut v = vec![0; 8 * MB];
            got.read(0, &mut v).unwrap();
            v
        });
        gate.send(()).unwrap();
        assert!(reader.join().unwrap() == pattern(8 * MB, 5), "the importer read before the queued copy finished");
    });
    assert!(got.is_ready());
    // An idle queue: no fence.
    q.synchronize().unwrap();
    let h2 = exp.export(&x, Some(&q)).unwrap();
    assert!(imp.open(&h2).unwrap().is_ready());
}

/// A fence whose producer never signals it (its write end closed without a byte: the work
/// failed or the process died) fails the block's reads, saying why; a fence that is not a pipe
/// is the peer's protocol error.
#[test]
fn a_share_whose_fence_is_never_signalled_fails_its_reads() {
    let _serial = serial();
    let le = |v: &[u64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let segment_msg = [le(&[1 | (2 << 32)]), le(&[7])].concat();
    let share = [le(&[2 | (1 << 32), 1, 7, 100, 1]), le(&[0, 4096])].concat();
    let seg: Segment = dmabuf_rt::MemorySource::create_segment(&ShmemSource::new(), 64 * KB).unwrap();
    let h = IpcHandle { pid: 1, door: 0, export: 1, segment: 7, offset: 0, len: 100, token: 0 };
    let (a, b) = Channel::pair("fence").unwrap();
    let imp = IpcImporter::new(b);
    let (r, w) = rustix::pipe::pipe().unwrap();
    a.send_bytes(&segment_msg, &[seg.as_fd()]).unwrap();
    a.send_bytes(&share, &[r.as_fd()]).unwrap();
    drop(r);
    let got = imp.open(&h).unwrap();
    assert!(!got.is_ready());
    drop(w);
    let e = got.read(0, &mut [0; 10]).unwrap_err();
    assert!(e.to_string().contains("did not finish"), "{e}");
    // A fence that is a memfd, not a pipe.
    let (a, b) = Channel::pair("fence").unwrap();
    let imp = IpcImporter::new(b);
    a.send_bytes(&segment_msg, &[seg.as_fd()]).unwrap();
    a.send_bytes(&share, &[seg.as_fd()]).unwrap();
    let e = imp.open(&h).unwrap_err();
    assert!(matches!(e, Error::Protocol { .. }) && e.to_string().contains("not a pipe"), "{e}");
}

/// Raw allocations: exported by pointer; a second free of one in limbo names the limbo.
#[test]
fn raw_blocks_are_shared_and_a_second_free_in_limbo_is_refused() {
    let _serial = serial();
    let a = common::allocator("", 64 * MB as u64);
    let (exp, imp) = pair();
    let p = a.allocate_raw(64 * KB, None).unwrap();
    let h = exp.export_raw(&a, p, None).unwrap();
    let got = imp.open(&h).unwrap();
    a.free_raw(p).unwrap();
    let e = a.free_raw(p).unwrap_err();
    assert!(e.to_string().contains("limbo"), "{e}");
    assert!(matches!(exp.export_raw(&a, p, None), Err(Error::UnknownPointer { .. })));
    assert!(matches!(exp.export_raw(&a, p.wrapping_add(4096), None), Err(Error::UnknownPointer { .. })));
    drop(got);
    wait_until("the release", *WAIT, || limbo(&a) == 0);
    a.check_invariants().unwrap();
}

/// Forged handles (export, segment, offset, length), a handle opened twice, garbage bytes:
/// refused with the cause, from several threads at once, and the real handle still opens.
#[test]
fn forged_and_stale_handles_are_refused_from_many_threads() {
    let _serial = serial();
    let a = common::allocator("", 64 * MB as u64);
    let (exp, imp) = pair();
    let imp = Arc::new(imp);
    let xs: Vec<_> = (0..16).map(|i| a.allocate(20 * KB + i * 4096, None).unwrap()).collect();
    let hs: Vec<_> = xs.iter().map(|x| exp.export(x, None).unwrap()).collect();
    std::thread::scope(|s| {
        for t in 0..4 {
            let (imp, hs) = (Arc::clone(&imp), &hs);
            s.spawn(move || {
                for (i, h) in hs.iter().enumerate() {
                    for forged in [
                        IpcHandle { export: h.export + 1000, ..*h },
                        IpcHandle { offset: h.offset + 4096, ..*h },
                        IpcHandle { len: h.len + 1, ..*h },
                        IpcHandle { segment: h.segment + 1, ..*h },
                    ] {
                        let e = imp.open(&forged).unwrap_err();
                        assert!(matches!(e, Error::InvalidArgument { .. }), "thread {t}, handle {i}: {e}");
                    }
                    let mut b = h.to_bytes();
                    b[t] ^= 0x40;
                    assert!(IpcHandle::from_bytes(&b).is_err());
                }
            });
        }
    });
    // Each real handle opens exactly once, whichever thread gets there first.
    let opened: Vec<_> = std::thread::scope(|s| {
        let hs = &hs;
        let workers: Vec<_> = (0..4)
            .map(|_| {
                let imp = Arc::clone(&imp);
                s.spawn(move || hs.iter().filter_map(|h| imp.open(h).ok()).collect::<Vec<_>>())
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap()).collect()
    });
    assert_eq!(opened.len(), hs.len(), "each handle opened exactly once");
    let e = imp.open(&hs[0]).unwrap_err();
    assert!(e.to_string().contains("already opened"), "{e}");
    drop(opened);
    drop(xs);
    wait_until("the releases", *WAIT, || exp.held() == 0 && limbo(&a) == 0);
    a.check_invariants().unwrap();
}

/// What a hostile exporter sends: an fd that is not a sealed memfd or a dma-buf, a share of a
/// segment never sent, ranges outside the segment, a length past them, garbage. Each is the
/// peer's protocol error, saying what; nothing panics and no fd leaks.
#[test]
fn a_hostile_exporter_is_refused_with_the_cause() {
    let _serial = serial();
    let before = open_fds();
    let le = |v: &[u64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let segment_msg = |serial: u64| [le(&[1 | (2 << 32)]), le(&[serial])].concat();
    let share = |export: u64, serial: u64, len: u64, ranges: &[(u64, u64)]| {
        let mut m = le(&[2 | ((ranges.len() as u64) << 32), export, serial, len, 1]);
        for &(o, l) in ranges {
            m.extend(le(&[o, l]));
        }
        m
    };
    let h = |export, segment, offset, len| IpcHandle { pid: 1, door: 0, export, segment, offset, len, token: 0 };
    let memfd = ShmemSource::new();
    let seg: Segment = dmabuf_rt::MemorySource::create_segment(&memfd, 64 * KB).unwrap();
    let (pipe_r, _pipe_w) = rustix::pipe::pipe().unwrap();
    let cases: Vec<(Vec<u8>, Option<std::os::fd::BorrowedFd<'_>>, &str)> = vec![
        (segment_msg(1), Some(pipe_r.as_fd()), "segment 1"),
        (share(1, 99, 10, &[(0, 4096)]), None, "never sent"),
        (b"garbage!".to_vec(), None, "unknown message tag"),
        (segment_msg(1), None, "came with"),
    ];
    for (bytes, fd, want) in cases {
        let (a, b) = Channel::pair("hostile").unwrap();
        let imp = IpcImporter::new(b);
        a.send_bytes(&bytes, fd.as_slice()).unwrap();
        let e = imp.open(&h(1, 1, 0, 10)).unwrap_err();
        assert!(matches!(e, Error::Protocol { .. }) && e.to_string().contains(want), "{want}: {e}");
    }
    for (ranges, len, want) in [
        (vec![(60 * KB as u64, 8192)], 10, "outside"),
        (vec![(u64::MAX - 10, 20)], 10, "outside"),
        (vec![(0, 4096)], 5000, "5000 bytes in ranges of 4096"),
        (vec![(0, 4096), (100, 4096)], 10, "not whole pages"),
    ] {
        let (a, b) = Channel::pair("hostile").unwrap();
        let imp = IpcImporter::new(b);
        a.send_bytes(&segment_msg(7), &[seg.as_fd()]).unwrap();
        a.send_bytes(&share(1, 7, len, &ranges), &[]).unwrap();
        let e = imp.open(&h(1, 7, ranges[0].0, len)).unwrap_err();
        assert!(e.to_string().contains(want), "{want}: {e}");
    }
    drop(seg);
    // (Fewer is no leak: the fence watcher may close an earlier test's fence fds meanwhile.)
    wait_until("the refused packets' fds closed", *WAIT, || open_fds() <= before + 2);
    assert!(open_fds() <= before + 2, "fds leaked (the pipe's two ends are still open)");
}

/// The exporter dropped: the importer's unopened shares are refused (their holds are gone).
/// The importer dropped: the exporter releases everything it held.
#[test]
fn either_side_hanging_up_releases_the_holds() {
    let _serial = serial();
    let a = common::allocator("", 64 * MB as u64);
    let x = a.allocate(64 * KB, None).unwrap();
    let (exp, imp) = pair();
    let h = exp.export(&x, None).unwrap();
    drop(exp);
    let e = imp.open(&h).unwrap_err();
    assert!(matches!(e, Error::PeerGone { .. }), "{e}");
    let (exp, imp) = pair();
    let h2 = exp.export(&x, None).unwrap();
    let _got = imp.open(&h2).unwrap();
    drop(x);
    assert!(limbo(&a) > 0);
    drop(_got);
    drop(imp);
    wait_until("the releases", *WAIT, || exp.held() == 0 && limbo(&a) == 0);
    a.check_invariants().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Process-wide handles (`ipc::get_handle` / `ipc::open_handle`), as CUDA's.

/// A handle made here opened by a child that was given only its 64 bytes: the child connects,
/// sees the bytes, a second open is refused; the producer freed the blocks at once and churns;
/// the child is killed and everything comes back.
#[test]
fn process_wide_handles_open_in_another_process_and_come_back_when_it_dies() {
    let _serial = serial();
    let a = common::allocator("", 64 * MB as u64);
    let (_exp, mut c) = consumer();
    let xs: Vec<_> = [4 * KB, 48 * KB, 5 * MB].iter().map(|&n| a.allocate(n, None).unwrap()).collect();
    let mut hs = Vec::new();
    for x in &xs {
        let h = dmabuf_rt::ipc::get_handle(x, None).unwrap();
        assert_ne!(h.token, 0);
        fill_pattern(x, h.export as u8);
        hs.push(h);
    }
    drop(xs);
    let in_limbo = limbo(&a);
    assert!(in_limbo > 0);
    for h in &hs {
        assert_eq!(c.ask(OPEN_GLOBAL, Some(h)), 0);
    }
    assert_eq!(c.ask(OPEN_GLOBAL, Some(&hs[0])), 1, "a handle opened twice");
    for r in 0..50u8 {
        let ys: Vec<_> = [4 * KB, 48 * KB, 5 * MB].iter().map(|&n| a.allocate(n, None).unwrap()).collect();
        for y in &ys {
            fill_pattern(y, 0x80 | r);
        }
    }
    assert_eq!(c.ask(VERIFY, None), 0, "a block held by a handle was reused");
    assert_eq!(limbo(&a), in_limbo);
    c.child.kill().unwrap();
    c.child.wait().unwrap();
    wait_until("the dead consumer's releases", *WAIT, || limbo(&a) == 0);
    a.check_invariants().unwrap();
}

/// In one process: a handle opens (the process connects to itself), once; a forged hold, a
/// forged token, a channel handle and a revoked handle are refused with the cause; revoking
/// lets a freed block go.
#[test]
fn process_wide_handles_refuse_forged_opened_and_revoked_ones() {
    let _serial = serial();
    use dmabuf_rt::ipc::{get_handle, get_handle_raw, open_handle, revoke_handle, unopened_handles};
    let a = common::allocator("", 64 * MB as u64);
    let x = a.allocate(100 * KB, None).unwrap();
    fill_pattern(&x, 4);
    let h = get_handle(&x, None).unwrap();
    let e = open_handle(&IpcHandle { export: h.export + 1_000_000, ..h }).unwrap_err();
    assert!(e.to_string().contains("holds no block"), "{e}");
    let e = open_handle(&IpcHandle { token: h.token ^ 1, ..h }).unwrap_err();
    assert!(matches!(e, Error::PeerGone { .. }), "{e}");
    let e = open_handle(&IpcHandle { token: 0, ..h }).unwrap_err();
    assert!(e.to_string().contains("token 0"), "{e}");
    let e = open_handle(&IpcHandle { len: h.len + 1, ..h }).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "a forged length: {e}");
    // The forged length took the hold (it was granted, then refused here): a new handle.
    let h = get_handle(&x, None).unwrap();
    let got = open_handle(&h).unwrap();
    let mut v = vec![0; 100 * KB];
    got.read(0, &mut v).unwrap();
    assert!(v == pattern(100 * KB, 4));
    let e = open_handle(&h).unwrap_err();
    assert!(e.to_string().contains("already opened"), "{e}");
    // Revoked before it is opened: the block goes at its free.
    let p = a.allocate_raw(64 * KB, None).unwrap();
    let hr = get_handle_raw(&a, p, None).unwrap();
    let before = unopened_handles();
    a.free_raw(p).unwrap();
    assert!(limbo(&a) >= 64 * KB as i64);
    revoke_handle(&hr).unwrap();
    assert_eq!(unopened_handles(), before - 1);
    assert!(revoke_handle(&hr).unwrap_err().to_string().contains("not an unopened handle"));
    assert!(open_handle(&hr).unwrap_err().to_string().contains("holds no block"));
    drop((got, x));
    wait_until("the releases", *WAIT, || limbo(&a) == 0);
    a.check_invariants().unwrap();
}

/// A peer that reads nothing: once its socket buffer is full, an export fails after the send
/// timeout, saying so, and holds nothing for the failed export; the peer's hang-up then
/// releases the rest.
#[test]
fn an_export_to_a_peer_that_reads_nothing_times_out() {
    let _serial = serial();
    let a = common::allocator("", 64 * MB as u64);
    let (mine, theirs) = Channel::pair("silent").unwrap();
    let exp = IpcExporter::new(mine).unwrap();
    exp.channel().set_send_timeout(Duration::from_millis(100)).unwrap();
    let mut kept = Vec::new();
    let e = loop {
        let x = a.allocate(512, None).unwrap();
        match exp.export(&x, None) {
            Ok(_) => kept.push(x),
            Err(e) => break e,
        }
        assert!(kept.len() < 100_000, "the socket never filled");
    };
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("reads nothing"), "{e}");
    assert_eq!(exp.held(), kept.len(), "the failed export is still held");
    drop(kept);
    assert!(limbo(&a) > 0);
    drop(theirs);
    wait_until("the hang-up's releases", *WAIT, || exp.held() == 0 && limbo(&a) == 0);
    a.check_invariants().unwrap();
}

/// Process-wide handles name their holds by random numbers: another process of the user
/// cannot take a handle made for someone else by counting (the real opener would be refused).
#[test]
fn process_wide_hold_numbers_cannot_be_guessed() {
    use dmabuf_rt::ipc::{get_handle, revoke_handle};
    let a = common::allocator("", 64 * MB as u64);
    let blocks: Vec<Allocation> = (0..64).map(|_| a.allocate(4 * KB, None).unwrap()).collect();
    let handles: Vec<IpcHandle> = blocks.iter().map(|b| get_handle(b, None).unwrap()).collect();
    let mut holds: Vec<u64> = handles.iter().map(|h| h.export).collect();
    holds.sort_unstable();
    holds.dedup();
    assert_eq!(holds.len(), 64, "two handles share a hold");
    // 64 random 64-bit numbers lie this close together with a chance of about 1e-10.
    assert!(holds.windows(2).all(|w| w[1] - w[0] > 1 << 20), "hold numbers follow each other: {holds:x?}");
    for h in &handles {
        revoke_handle(h).unwrap();
    }
}

/// The producer of the fork case, in a child process of its own (see below).
#[test]
fn fork_producer_entry() {
    if std::env::var(FORK_ROLE_ENV).is_err() {
        return;
    }
    let fd = std::io::stdin().as_fd().try_clone_to_owned().unwrap();
    let control = Channel::from_fd(fd, "fork producer control").unwrap();
    // The producer makes the IPC pair, so that the consumer's end names it as its peer.
    let (mine, theirs) = Channel::pair("fork producer ipc").unwrap();
    control.send_with_fd(&[0u8; 1], theirs.as_fd()).unwrap();
    drop(theirs);
    let a = common::allocator("", 64 * MB as u64);
    let q = Queue::new().unwrap();
    let x = a.allocate(64 * KB, Some(&q)).unwrap();
    let gate = common::QueueGate::close(&q);
    let exp = IpcExporter::new(mine).unwrap();
    let h = exp.export(&x, Some(&q)).unwrap();
    // A child forked without exec keeps every fd of this process, the fence's end included,
    // and does nothing until it is killed (or its alarm ends it).
    // SAFETY: the child calls only async-signal-safe functions (alarm, pause) and never returns.
    let child = unsafe { libc::fork() };
    if child == 0 {
        // SAFETY: an async-signal-safe call in the forked child.
        unsafe { libc::alarm(120) };
        loop {
            // SAFETY: as above.
            unsafe { libc::pause() };
        }
    }
    assert!(child > 0, "fork failed");
    control.send(&ctl(child as u64, Some(&h))).unwrap();
    // Exits when told: with its queue's work still held (1: the fence is never signalled),
    // or right after the work is done (2: signalled just before the exit).
    if control.recv::<[u8; 1]>().unwrap().msg[0] == 2 {
        drop(gate);
        q.synchronize().unwrap();
    }
    std::process::exit(0);
}

const FORK_ROLE_ENV: &str = "IPC_TEST_FORK_PRODUCER";

/// A producer that exits with a fenced share pending, after forking a child that keeps the
/// fence's other end open: the consumer's block fails (the exporting process exited before
/// signalling) instead of waiting as long as the child lives.
#[test]
fn a_fence_fails_when_its_producer_exits_even_if_a_forked_child_keeps_it_open() {
    let _serial = serial();
    // The block opened before the exit; the importer made before it (watching a pidfd of the
    // producer) but the share read (at the open) after it; the importer made after it (the
    // producer is known gone).
    for when in [When::OpenedBefore, When::ReadAfter, When::MadeAfter] {
        // Signalled just before the exit: ready, whichever the watcher sees first.
        for _ in 0..10 {
            let r = fork_case(2, when);
            assert!(r.is_ok(), "a fence signalled before its producer exited ({when:?}): {r:?}");
        }
        let e = fork_case(1, when).expect_err("a fence whose producer exited without signalling must fail");
        assert!(!matches!(e, Error::Timeout { .. }), "still waiting while the forked child lives ({when:?}): {e}");
        assert!(e.to_string().contains("exited"), "{e}");
    }
}

/// When the fork case's importer sees the producer's share, against the producer's exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum When {
    /// The importer is made and the block opened before the exit.
    OpenedBefore,
    /// The importer is made before the exit, the block opened (its share read) after it.
    ReadAfter,
    /// The importer is made, and the block opened, after the exit.
    MadeAfter,
}

/// Runs the fork case's producer, tells it `how` to exit, and returns the block's readiness.
fn fork_case(how: u8, when: When) -> dmabuf_rt::Result<()> {
    let (control, theirs) = Channel::pair("fork control").unwrap();
    let mut producer = Command::new(std::env::current_exe().unwrap())
        .args(["fork_producer_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env(FORK_ROLE_ENV, "1")
        .stdin(Stdio::from(theirs.into_fd()))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let ipc = control.recv::<[u8; 1]>().unwrap().fd.expect("the IPC channel's end");
    let ipc = Channel::from_fd(ipc, "fork consumer ipc").unwrap();
    let (grandchild, h) = cmd_of(&control.recv::<Ctl>().unwrap().msg);
    let kill_grandchild = || {
        let pid = rustix::process::Pid::from_raw(grandchild as i32).unwrap();
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    };
    let mut exit = || {
        control.send(&[how]).unwrap();
        assert!(producer.wait().unwrap().success());
    };
    let wait = |b: dmabuf_rt::ipc::ImportedBlock| b.wait_ready(Some(Duration::from_secs(30)));
    let r = match when {
        When::OpenedBefore => {
            let imp = IpcImporter::new(ipc);
            let b = imp.open(&h.unwrap()).unwrap();
            assert!(!b.is_ready(), "the producer's queue is held: its fence cannot have signalled");
            exit();
            wait(b)
        }
        When::ReadAfter => {
            let imp = IpcImporter::new(ipc);
            exit();
            imp.open(&h.unwrap()).and_then(wait)
        }
        When::MadeAfter => {
            exit();
            IpcImporter::new(ipc).open(&h.unwrap()).and_then(wait)
        }
    };
    kill_grandchild();
    r
}

const FD_ROLE_ENV: &str = "IPC_TEST_OUT_OF_FDS";

/// The exporter of the out-of-fds case, in a child process of its own: makes two handles,
/// prints them, then on each line of stdin: `take` uses up every fd it may open, `free`
/// gives them back, `exit` exits.
#[test]
fn out_of_fds_exporter_entry() {
    use std::io::BufRead;
    if std::env::var(FD_ROLE_ENV).is_err() {
        return;
    }
    let lim = rustix::process::Rlimit { current: Some(256), maximum: Some(256) };
    rustix::process::setrlimit(rustix::process::Resource::Nofile, lim).unwrap();
    let a = common::allocator("", 64 * MB as u64);
    let blocks: Vec<Allocation> = (0..2).map(|_| a.allocate(64 * KB, None).unwrap()).collect();
    for b in &blocks {
        let h = dmabuf_rt::ipc::get_handle(b, None).unwrap();
        println!("handle {}", h.to_bytes().iter().map(|b| format!("{b:02x}")).collect::<String>());
    }
    let mut taken = Vec::new();
    for line in std::io::stdin().lock().lines() {
        match line.unwrap().as_str() {
            "take" => {
                while let Ok(fd) = rustix::fs::open("/dev/null", rustix::fs::OFlags::RDONLY, 0.into()) {
                    taken.push(fd);
                }
                println!("taken {}", taken.len());
            }
            "free" => {
                taken.clear();
                println!("freed");
            }
            _ => std::process::exit(0),
        }
    }
}

/// A process out of file descriptors refuses the IPC connections it cannot accept (the
/// importer is told at once that the exporter hung up, not left waiting) and serves again
/// once it has fds: before, `accept`'s EMFILE stopped the process's IPC socket for good.
#[test]
fn the_ipc_socket_survives_running_out_of_fds() {
    use std::io::{BufRead, BufReader, Write};
    let _serial = serial();
    let mut exporter = Command::new(std::env::current_exe().unwrap())
        .args(["out_of_fds_exporter_entry", "--exact", "--nocapture", "--test-threads=1", "-q"])
        .env(FD_ROLE_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut to = exporter.stdin.take().unwrap();
    let mut from = BufReader::new(exporter.stdout.take().unwrap()).lines();
    let mut next = |prefix: &str| loop {
        let l = from.next().expect("the exporter's output ended").unwrap();
        if let Some(rest) = l.strip_prefix(prefix) {
            return rest.to_string();
        }
    };
    let unhex = |s: &str| {
        let b: Vec<u8> = (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect();
        IpcHandle::from_bytes(&b).unwrap()
    };
    let (h1, h2) = (unhex(&next("handle ")), unhex(&next("handle ")));
    writeln!(to, "take").unwrap();
    next("taken ");
    let t = Instant::now();
    let e = dmabuf_rt::ipc::open_handle(&h1).expect_err("an exporter with no fd to accept with");
    assert!(matches!(e, Error::PeerGone { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(20), "the refusal took {:?}", t.elapsed());
    writeln!(to, "free").unwrap();
    next("freed");
    let got = dmabuf_rt::ipc::open_handle(&h2).expect("the exporter serves again once it has fds");
    assert_eq!(got.len(), 64 * KB);
    drop(got);
    writeln!(to, "exit").unwrap();
    assert!(exporter.wait().unwrap().success());
}
