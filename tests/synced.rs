//! SyncedMemory (seed 004): every head transition in aliased and split mode with its exact copy
//! count, lazy zero-filled allocation, borrowed memory never freed, the asynchronous push
//! ordered with later queue work, the C-style accessors, and bad input.

mod common;

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use dmabuf_rt::caching::stats::AGGREGATE;
use dmabuf_rt::caching::{CachingAllocator, Config, HostCachingAllocator};
use dmabuf_rt::queue::{HostBuffer, Mem, Queue, copy_now};
use dmabuf_rt::source::{HeapSource, HostBacking, HostSource, MemorySource, ShmemSource};
use dmabuf_rt::synced::{Head, SyncedMemory};
use dmabuf_rt::{Error, Result};

use common::{or_skip, pattern};

/// Neither a page multiple nor a power of two: views must stop at the size, not the block.
const SIZE: usize = 3 * 4096 + 100;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// One buffer behind both views (the default).
    Aliased,
    /// Separate host and device buffers, copies on the SyncedMemory's queue.
    Split,
    /// Separate buffers, copies on the calling thread (no queue).
    SplitNoQueue,
}

impl Mode {
    /// Copies a transition makes in this mode when Caffe would `memcpy` `n` times.
    fn copies(self, n: u64) -> u64 {
        if self == Mode::Aliased { 0 } else { n }
    }
}

struct Fixture {
    dev: CachingAllocator,
    host: HostCachingAllocator,
    queue: Arc<Queue>,
}

impl Fixture {
    /// Classic segments, so a freed block stays cached, dirty, for the next allocation.
    fn new() -> Self {
        Self::over(ShmemSource::new().reserve(false), ShmemSource::new().reserve(false))
    }

    fn over(dev: impl MemorySource + 'static, host: impl MemorySource + 'static) -> Self {
        let dev = CachingAllocator::builder(dev)
            .config(Config::parse("expandable_segments:False").unwrap())
            .capacity(1 << 30)
            .build()
            .unwrap();
        Self { dev, host: HostCachingAllocator::new(host), queue: Arc::new(Queue::new().unwrap()) }
    }

    fn make(&self, mode: Mode) -> SyncedMemory {
        let b = SyncedMemory::builder(SIZE, &self.dev, &self.host);
        let b = match mode {
            Mode::Aliased => b.queue(Arc::clone(&self.queue)),
            Mode::Split => b.alias(false).queue(Arc::clone(&self.queue)),
            Mode::SplitNoQueue => b.alias(false),
        };
        let s = b.build().unwrap();
        assert_eq!(s.is_aliased(), mode == Mode::Aliased);
        s
    }

    /// Blocks allocated to callers by either allocator (the SyncedMemory's or lent ones).
    fn live_blocks(&self) -> (i64, u64) {
        (self.dev.stats().allocation[AGGREGATE].current, self.host.stats().num_allocs - self.host.stats().num_frees)
    }
}

fn read_mem(m: &Mem) -> Vec<u8> {
    let out = HostBuffer::new(m.len()).unwrap();
    copy_now(&out, m.clone()).unwrap();
    out.to_vec()
}

fn write_mem(m: &Mem, data: &[u8]) {
    copy_now(m.clone(), &HostBuffer::from_slice(data).unwrap()).unwrap();
}

/// The data every test puts in first, and the data lent memory carries.
fn p() -> Vec<u8> {
    pattern(SIZE, 7)
}

fn q() -> Vec<u8> {
    pattern(SIZE, 99)
}

/// A SyncedMemory at `head`, holding `p()` unless uninitialized.
fn at(f: &Fixture, mode: Mode, head: Head) -> SyncedMemory {
    let mut s = f.make(mode);
    match head {
        Head::Uninitialized => {}
        Head::AtHost => s.mutable_host_data().unwrap().write(0, &p()).unwrap(),
        Head::AtDevice => write_mem(&s.mutable_device_data().unwrap(), &p()),
        Head::Synced => {
            s.mutable_host_data().unwrap().write(0, &p()).unwrap();
            s.device_data().unwrap();
        }
    }
    assert_eq!(s.head(), head);
    s
}

#[derive(Debug, Clone, Copy)]
enum Op {
    HostData,
    MutableHostData,
    DeviceData,
    MutableDeviceData,
    SetHostData,
    SetDeviceData,
    AsyncDevicePush,
}

use Head::{AtDevice, AtHost, Synced, Uninitialized};

/// The head a call leaves and how many copies Caffe makes for it (`None`: refused).
type Outcome = Option<(Head, u64)>;

/// Seed 004's contract: from each head, each call, the head it leaves and how many copies
/// Caffe's `to_cpu` / `to_gpu` / `async_gpu_push` make.
const TRANSITIONS: &[(Head, Op, Outcome)] = &[
    (Uninitialized, Op::HostData, Some((AtHost, 0))),
    (Uninitialized, Op::MutableHostData, Some((AtHost, 0))),
    (Uninitialized, Op::DeviceData, Some((AtDevice, 0))),
    (Uninitialized, Op::MutableDeviceData, Some((AtDevice, 0))),
    (Uninitialized, Op::SetHostData, Some((AtHost, 0))),
    (Uninitialized, Op::SetDeviceData, Some((AtDevice, 0))),
    (Uninitialized, Op::AsyncDevicePush, None),
    (AtHost, Op::HostData, Some((AtHost, 0))),
    (AtHost, Op::MutableHostData, Some((AtHost, 0))),
    (AtHost, Op::DeviceData, Some((Synced, 1))),
    (AtHost, Op::MutableDeviceData, Some((AtDevice, 1))),
    (AtHost, Op::SetHostData, Some((AtHost, 0))),
    (AtHost, Op::SetDeviceData, Some((AtDevice, 0))),
    (AtHost, Op::AsyncDevicePush, Some((Synced, 1))),
    (AtDevice, Op::HostData, Some((Synced, 1))),
    (AtDevice, Op::MutableHostData, Some((AtHost, 1))),
    (AtDevice, Op::DeviceData, Some((AtDevice, 0))),
    (AtDevice, Op::MutableDeviceData, Some((AtDevice, 0))),
    (AtDevice, Op::SetHostData, Some((AtHost, 0))),
    (AtDevice, Op::SetDeviceData, Some((AtDevice, 0))),
    (AtDevice, Op::AsyncDevicePush, None),
    (Synced, Op::HostData, Some((Synced, 0))),
    (Synced, Op::MutableHostData, Some((AtHost, 0))),
    (Synced, Op::DeviceData, Some((Synced, 0))),
    (Synced, Op::MutableDeviceData, Some((AtDevice, 0))),
    (Synced, Op::SetHostData, Some((AtHost, 0))),
    (Synced, Op::SetDeviceData, Some((AtDevice, 0))),
    (Synced, Op::AsyncDevicePush, Some((Synced, 0))),
];

/// Runs one transition and checks the head, the copies and the bytes each side shows.
fn check_transition(f: &Fixture, mode: Mode, from: Head, op: Op, want: Outcome) -> Result<(), String> {
    let mut s = at(f, mode, from);
    let before = s.copies();
    let held = if from == Uninitialized { vec![0; SIZE] } else { p() };
    // Memory lent by the caller, carrying q().
    let lent_host = f.host.allocate(SIZE).unwrap();
    write_mem(&lent_host.mem(), &q());
    let lent_dev = f.dev.allocate(SIZE, None).unwrap();
    write_mem(&lent_dev.mem(), &q());

    let shown: Result<Vec<u8>> = match op {
        Op::HostData => s.host_data().and_then(|v| v.to_vec()),
        Op::MutableHostData => s.mutable_host_data().and_then(|v| v.to_vec()),
        Op::DeviceData => s.device_data().map(|m| read_mem(&m)),
        Op::MutableDeviceData => s.mutable_device_data().map(|m| read_mem(&m)),
        Op::SetHostData => s.set_host_data(lent_host.mem()).map(|()| q()),
        Op::SetDeviceData => s.set_device_data(lent_dev.mem()).map(|()| q()),
        Op::AsyncDevicePush => s.async_device_push(&f.queue).map(|()| held.clone()),
    };
    let Some((to, copies)) = want else {
        return match shown {
            Err(Error::Unsupported { what }) if what.contains("async_device_push") && s.head() == from => Ok(()),
            other => {
                Err(format!("expected a refusal leaving the head at {from:?}, got {other:?}, head {:?}", s.head()))
            }
        };
    };
    let shown = shown.map_err(|e| format!("failed: {e}"))?;
    if s.head() != to {
        return Err(format!("head {:?}, expected {to:?} ({})", s.head(), to.caffe_name()));
    }
    let made = s.copies() - before;
    if made != mode.copies(copies) {
        return Err(format!("{made} copies, expected {}", mode.copies(copies)));
    }
    let expect = match op {
        Op::SetHostData | Op::SetDeviceData => q(),
        _ => held,
    };
    if shown != expect {
        return Err("the view shows the wrong bytes".into());
    }
    // The data reaches the other side, with the copies Caffe would make.
    let before = s.copies();
    let other = match op {
        Op::HostData | Op::MutableHostData | Op::SetHostData => s.device_data().map(|m| read_mem(&m)),
        Op::DeviceData | Op::MutableDeviceData | Op::SetDeviceData => s.host_data().and_then(|v| v.to_vec()),
        Op::AsyncDevicePush => {
            f.queue.synchronize().unwrap();
            s.device_data().map(|m| read_mem(&m))
        }
    };
    let other = other.map_err(|e| format!("the other side failed: {e}"))?;
    let copied = if to == Synced { 0 } else { 1 };
    if other != expect || s.head() != Synced || s.copies() - before != mode.copies(copied) {
        return Err(format!(
            "other side: right bytes {}, head {:?}, {} copies (expected {})",
            other == expect,
            s.head(),
            s.copies() - before,
            mode.copies(copied)
        ));
    }
    match op {
        Op::SetHostData if s.owns_host_data() => Err("owns the lent host memory".into()),
        Op::SetDeviceData if s.owns_device_data() => Err("owns the lent device memory".into()),
        _ => Ok(()),
    }
}

fn all_transitions(mode: Mode) {
    let f = Fixture::new();
    let failures: Vec<String> = TRANSITIONS
        .iter()
        .filter_map(|&(from, op, want)| {
            check_transition(&f, mode, from, op, want).err().map(|e| format!("{mode:?} {from:?} --{op:?}--> {e}"))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} transitions wrong:\n{}",
        failures.len(),
        TRANSITIONS.len(),
        failures.join("\n")
    );
    drop(f.queue);
    // Nothing leaks: every block the SyncedMemories owned, and every lent one, is back.
    assert_eq!(f.dev.stats().allocation[AGGREGATE].current, 0);
    assert_eq!(f.host.stats().allocated_bytes, 0);
}

#[test]
fn every_transition_aliased_copies_nothing() {
    all_transitions(Mode::Aliased);
}

#[test]
fn every_transition_split_copies_once_on_the_queue() {
    all_transitions(Mode::Split);
}

#[test]
fn every_transition_split_copies_once_without_a_queue() {
    all_transitions(Mode::SplitNoQueue);
}

#[test]
fn aliased_views_are_the_same_pages() {
    for mode in [Mode::Aliased, Mode::Split] {
        let f = Fixture::new();
        let mut s = f.make(mode);
        let dev = s.device_data().unwrap();
        s.mutable_host_data().unwrap().write(0, &p()).unwrap();
        // No transition since `dev` was handed out: only shared pages can show the write.
        let seen = read_mem(&dev);
        if mode == Mode::Aliased {
            assert_eq!(seen, p(), "aliased: the device view must be the host view's pages");
            assert!(s.owns_host_data() && s.owns_device_data());
            assert_eq!((f.dev.stats().allocation[AGGREGATE].current, f.host.stats().num_allocs), (1, 0), "one block");
        } else {
            assert_eq!(seen, vec![0; SIZE], "split: the device buffer is separate until a transition");
            assert_eq!(read_mem(&s.device_data().unwrap()), p());
            assert_eq!((f.dev.stats().allocation[AGGREGATE].current, f.host.stats().num_allocs), (1, 1));
        }
        // Split: device -> host for the mutable host view, host -> device for the last read.
        assert_eq!(s.copies(), mode.copies(2));
    }
}

/// Leaves a dirty block of SIZE in each allocator's cache, so that a fresh allocation that is
/// not zero-filled shows 0xAB.
fn dirty_caches(f: &Fixture, mode: Mode) {
    let queue = if mode == Mode::SplitNoQueue { None } else { Some(&*f.queue) };
    let d = f.dev.allocate(SIZE, queue).unwrap();
    write_mem(&d.mem(), &[0xAB; SIZE]);
    let h = f.host.allocate(SIZE).unwrap();
    write_mem(&h.mem(), &[0xAB; SIZE]);
}

#[test]
fn allocation_is_lazy_and_zero_filled() {
    for mode in [Mode::Aliased, Mode::Split, Mode::SplitNoQueue] {
        for first in [Op::HostData, Op::DeviceData] {
            let f = Fixture::new();
            dirty_caches(&f, mode);
            let (dev_sources, host_sources) = (f.dev.stats().num_device_alloc, f.host.stats().num_source_allocs);
            let mut s = f.make(mode);
            assert_eq!(f.live_blocks(), (0, 0), "{mode:?}: nothing allocated before the first access");
            assert!(!s.owns_host_data() && !s.owns_device_data());
            assert_eq!(s.head(), Uninitialized);

            let bytes = match first {
                Op::HostData => s.host_data().unwrap().to_vec().unwrap(),
                _ => read_mem(&s.device_data().unwrap()),
            };
            assert_eq!(bytes, vec![0; SIZE], "{mode:?} {first:?}: first access must zero-fill a reused block");
            // The dirty cached blocks were reused (so the zeroes are the fill's, not fresh pages').
            assert_eq!(f.dev.stats().num_device_alloc, dev_sources, "{mode:?} {first:?}");
            assert_eq!(f.host.stats().num_source_allocs, host_sources, "{mode:?} {first:?}");
            let want = match (mode, first) {
                (Mode::Aliased, _) => (1, 0),
                (_, Op::HostData) => (0, 1),
                _ => (1, 0),
            };
            assert_eq!(f.live_blocks(), want, "{mode:?} {first:?}: only the side asked for is allocated");
            assert_eq!(s.copies(), 0, "zero-fills are not copies");
            drop(s);
            assert_eq!(f.live_blocks(), (0, 0), "{mode:?} {first:?}: owned memory is freed on drop");
        }
    }
}

#[test]
fn borrowed_host_data_is_never_freed() {
    for mode in [Mode::Aliased, Mode::Split, Mode::SplitNoQueue] {
        let f = Fixture::new();
        let lent = f.host.allocate(SIZE).unwrap();
        write_mem(&lent.mem(), &q());
        let mut s = f.make(mode);
        s.mutable_host_data().unwrap().write(0, &p()).unwrap();
        let owned = if mode == Mode::Aliased { (1, 1) } else { (0, 2) };
        assert_eq!(f.live_blocks(), owned, "{mode:?}: the lent block and the SyncedMemory's own");

        s.set_host_data(lent.mem()).unwrap();
        assert!(!s.owns_host_data(), "{mode:?}");
        assert_eq!(f.live_blocks(), (0, 1), "{mode:?}: the owned block is freed at once, the lent one is not");
        assert_eq!(s.host_data().unwrap().to_vec().unwrap(), q());
        assert_eq!(read_mem(&s.device_data().unwrap()), q(), "{mode:?}: the lent data reaches the device");
        // Writes through the host view land in the lent memory itself.
        s.mutable_host_data().unwrap().write(10, b"written by the SyncedMemory").unwrap();
        let mut expect = q();
        expect[10..37].copy_from_slice(b"written by the SyncedMemory");
        assert_eq!(read_mem(&lent.mem()), expect);
        // And so do device writes, once they move back to the host.
        write_mem(&s.mutable_device_data().unwrap().range(0, 4).unwrap(), b"dev!");
        s.host_data().unwrap();
        expect[..4].copy_from_slice(b"dev!");
        assert_eq!(read_mem(&lent.mem()), expect, "{mode:?}");

        let allocated = f.host.stats().allocated_bytes;
        drop(s);
        assert_eq!(
            f.host.stats().allocated_bytes,
            allocated,
            "{mode:?}: dropping the SyncedMemory frees no host memory"
        );
        assert_eq!(f.live_blocks(), (0, 1), "{mode:?}: only the lent block is left, still allocated");
        assert_eq!(read_mem(&lent.mem()), expect, "{mode:?}: the lent bytes are intact");
        drop(lent);
        assert_eq!(f.live_blocks(), (0, 0));
    }
}

#[test]
fn borrowed_device_data_is_never_freed() {
    for mode in [Mode::Aliased, Mode::Split, Mode::SplitNoQueue] {
        let f = Fixture::new();
        let lent = f.dev.allocate(SIZE, None).unwrap();
        write_mem(&lent.mem(), &q());
        let other = f.dev.allocate(SIZE, None).unwrap();
        write_mem(&other.mem(), &p());
        let mut s = f.make(mode);
        s.mutable_device_data().unwrap();
        assert_eq!(f.live_blocks(), (3, 0), "{mode:?}");

        s.set_device_data(other.mem()).unwrap();
        assert_eq!(f.live_blocks(), (2, 0), "{mode:?}: the owned device block is freed at once");
        // Replacing lent memory with other lent memory frees neither.
        s.set_device_data(lent.mem()).unwrap();
        assert!(!s.owns_device_data());
        assert_eq!(f.live_blocks(), (2, 0), "{mode:?}: lent blocks are never freed by the SyncedMemory");
        assert_eq!(read_mem(&other.mem()), p());
        assert_eq!(s.host_data().unwrap().to_vec().unwrap(), q(), "{mode:?}: the lent data reaches the host");
        s.mutable_host_data().unwrap().write(0, b"host").unwrap();
        s.device_data().unwrap();
        let mut expect = q();
        expect[..4].copy_from_slice(b"host");
        assert_eq!(read_mem(&lent.mem()), expect, "{mode:?}: host writes reach the lent device memory");

        drop(s);
        assert_eq!(f.live_blocks(), (2, 0), "{mode:?}: both lent device blocks are still allocated, nothing else");
        assert_eq!(read_mem(&lent.mem()), expect, "{mode:?}: the lent bytes are intact");
        assert_eq!(read_mem(&other.mem()), p());
    }
}

/// Blocks `queue`'s executor until the returned sender sends or is dropped (a watchdog drops it
/// after 10 s, so a test that gets it wrong fails instead of hanging).
fn hold(queue: &Queue) -> mpsc::Sender<()> {
    let (tx, rx) = mpsc::channel::<()>();
    queue
        .callback(move |_| {
            let _ = rx.recv_timeout(Duration::from_secs(10));
        })
        .unwrap();
    tx
}

#[test]
fn async_push_is_ordered_before_later_work_on_its_queue() {
    for mode in [Mode::Aliased, Mode::Split, Mode::SplitNoQueue] {
        let f = Fixture::new();
        let push_queue = Queue::new().unwrap();
        let mut s = f.make(mode);
        let dev = s.mutable_device_data().unwrap();
        s.mutable_host_data().unwrap().write(0, &p()).unwrap();
        let before = s.copies();

        let release = hold(&push_queue);
        s.async_device_push(&push_queue).unwrap();
        assert_eq!(s.head(), Synced);
        assert_eq!(s.copies() - before, mode.copies(1), "{mode:?}");
        if mode != Mode::Aliased {
            // The copy waits behind the held queue: the call did not copy by itself.
            assert!(s.push_in_flight());
            assert_eq!(read_mem(&dev), vec![0; SIZE], "{mode:?}: the push must be asynchronous");
        }
        // Work queued after the push, while it has not run yet, sees the pushed bytes.
        let out = HostBuffer::new(SIZE).unwrap();
        push_queue.copy(&out, dev.clone()).unwrap();
        release.send(()).unwrap();
        push_queue.synchronize().unwrap();
        assert_eq!(out.to_vec(), p(), "{mode:?}");
        assert_eq!(read_mem(&s.device_data().unwrap()), p());
        assert_eq!(s.copies() - before, mode.copies(1), "{mode:?}: the push leaves the views synced");
    }
}

#[test]
fn device_data_on_another_queue_waits_for_the_push_there() {
    let f = Fixture::new();
    let (push_queue, other) = (Queue::new().unwrap(), Queue::new().unwrap());
    let mut s = f.make(Mode::Split);
    s.mutable_host_data().unwrap().write(0, &p()).unwrap();
    let release = hold(&push_queue);
    s.async_device_push(&push_queue).unwrap();

    let dev = s.device_data_on(&other).unwrap();
    assert!(s.push_in_flight(), "device_data_on must not wait for the push itself");
    let out = HostBuffer::new(SIZE).unwrap();
    // On an idle queue this small copy would run inline, inside `copy`: it must be held back.
    other.copy(&out, dev).unwrap();
    assert!(!other.is_idle());
    assert_eq!(out.to_vec(), vec![0; SIZE], "the other queue must wait for the push");
    release.send(()).unwrap();
    other.synchronize().unwrap();
    assert_eq!(out.to_vec(), p());
    assert_eq!(s.copies(), 1);
}

#[test]
fn dropping_with_a_push_in_flight_keeps_the_blocks_until_it_is_done() {
    let f = Fixture::new();
    let push_queue = Queue::new().unwrap();
    let mut s = f.make(Mode::Split);
    let dev = s.mutable_device_data().unwrap();
    s.mutable_host_data().unwrap().write(0, &p()).unwrap();
    let release = hold(&push_queue);
    s.async_device_push(&push_queue).unwrap();
    drop(s);
    // Freed, but not reusable until the push queue passes the copy: a new block of the same
    // size must not be the one the copy is about to write.
    let again = f.dev.allocate(SIZE, Some(&f.queue)).unwrap();
    write_mem(&again.mem(), &[0xCD; SIZE]);
    release.send(()).unwrap();
    push_queue.synchronize().unwrap();
    assert_eq!(read_mem(&again.mem()), vec![0xCD; SIZE], "the push wrote into a reused block");
    assert_eq!(read_mem(&dev), p(), "the push completed into the old block");
    drop(again);
    assert_eq!(f.live_blocks(), (0, 0));
}

#[test]
fn a_failed_push_is_reported_and_the_host_keeps_the_data() {
    let f = Fixture::new();
    let push_queue = Queue::new().unwrap();
    let mut s = f.make(Mode::Split);
    s.mutable_host_data().unwrap().write(0, &p()).unwrap();
    push_queue.callback(|_| panic!("fail the queue (expected by the test)")).unwrap();
    s.async_device_push(&push_queue).unwrap();
    match s.device_data() {
        Err(Error::OperationFailed { reason }) => assert!(reason.contains("panicked"), "{reason}"),
        other => panic!("expected the push's failure, got {other:?}"),
    }
    assert_eq!(s.head(), AtHost, "the host still holds the newest data");
    // The next access copies again, on the SyncedMemory's own (healthy) queue.
    assert_eq!(read_mem(&s.device_data().unwrap()), p());
    assert_eq!((s.head(), s.copies()), (Synced, 2));
}

#[test]
fn c_style_pointers_alias_and_map_back() {
    for mode in [Mode::Aliased, Mode::Split] {
        let f = Fixture::new();
        let mut s = f.make(mode);
        let host = s.mutable_host_ptr().unwrap();
        assert_eq!(s.head(), AtHost);
        let dev = s.device_ptr().unwrap();
        assert_eq!(s.head(), Synced);
        assert_eq!(host.cast_const() == dev, mode == Mode::Aliased, "{mode:?}: one address when aliased");
        assert_eq!(s.copies(), mode.copies(1));
        // A device address is what the C ABI passes around: the allocator maps it back.
        let mem = f.dev.mem_at(dev, SIZE).unwrap();
        write_mem(&mem, &p());
        s.mutable_device_ptr().unwrap();
        assert_eq!(s.host_data().unwrap().to_vec().unwrap(), p(), "{mode:?}");
        let lent = HostBuffer::from_slice(&q()).unwrap();
        s.set_host_data(Mem::from(&lent)).unwrap();
        assert_eq!(s.host_ptr().unwrap(), s.host_ptr().unwrap(), "{mode:?}: a stable address for lent memory");
    }
}

#[test]
fn dma_bufs_alias_inside_the_sync_bracket() {
    // Device memory that is a dma-buf: the views' CPU access is DMA_BUF_IOCTL_SYNC-bracketed.
    let dev: Box<dyn MemorySource> = match HeapSource::open("system") {
        Ok(heap) => Box::new(heap),
        Err(_) => {
            let Some(udmabuf) = or_skip("dma_bufs_alias_inside_the_sync_bracket", ShmemSource::with_udmabuf()) else {
                return;
            };
            Box::new(udmabuf)
        }
    };
    assert!(dev.create_segment(4096).unwrap().is_dma_buf());
    // Pinned host memory from the system heap is a dma-buf too; an mlocked memfd could hit
    // RLIMIT_MEMLOCK here, so plain shmem stands in for it.
    let pinned = HostSource::new();
    let host = if *pinned.backing() == HostBacking::SystemHeap {
        HostCachingAllocator::new(pinned)
    } else {
        HostCachingAllocator::new(ShmemSource::new().reserve(false))
    };
    let f = Fixture {
        dev: CachingAllocator::builder_boxed(dev)
            .config(Config::parse("expandable_segments:False").unwrap())
            .capacity(1 << 30)
            .build()
            .unwrap(),
        host,
        queue: Arc::new(Queue::new().unwrap()),
    };
    for mode in [Mode::Aliased, Mode::Split] {
        for &(from, op, want) in TRANSITIONS {
            if let Err(e) = check_transition(&f, mode, from, op, want) {
                panic!("{mode:?} {from:?} --{op:?}--> {e}");
            }
        }
        let mut s = f.make(mode);
        let host = s.mutable_host_ptr().unwrap();
        // The window opened by the C-style accessor closes at the next call.
        assert!(!host.is_null());
        s.device_data().unwrap();
    }
}

#[test]
fn bad_input_is_refused_clearly() {
    let f = Fixture::new();
    assert!(matches!(SyncedMemory::new(0, &f.dev, &f.host), Err(Error::ZeroLength)));

    let mut s = f.make(Mode::Split);
    let short = f.host.allocate(SIZE - 1).unwrap();
    match s.set_host_data(short.mem()) {
        Err(Error::SizeMismatch { dst, src }) => assert_eq!((dst, src), (SIZE, SIZE - 1)),
        other => panic!("expected SizeMismatch, got {other:?}"),
    }
    let long = HostBuffer::new(SIZE + 1).unwrap();
    assert!(
        matches!(s.set_device_data(Mem::from(&long)), Err(Error::SizeMismatch { dst: SIZE, src }) if src == SIZE + 1)
    );
    assert_eq!(s.head(), Uninitialized, "a refused call changes nothing");
    assert_eq!(f.live_blocks(), (0, 1), "only the caller's short block");

    let err = s.async_device_push(&f.queue).unwrap_err();
    assert!(err.to_string().contains("uninitialized"), "{err}");
    s.mutable_device_data().unwrap();
    let err = s.async_device_push(&f.queue).unwrap_err();
    assert!(err.to_string().contains("AtDevice"), "{err}");
    assert_eq!(s.head(), AtDevice);

    let v = s.mutable_host_data().unwrap();
    assert!(
        matches!(v.write(SIZE - 1, b"xy"), Err(Error::OutOfBounds { offset, len: 2, size: SIZE }) if offset == SIZE - 1)
    );
    assert!(matches!(v.read(usize::MAX, &mut [0; 2]), Err(Error::OutOfBounds { .. })));
    assert!(matches!(v.fill(1, SIZE, 0), Err(Error::OutOfBounds { .. })));
    drop(v);
    // The same bounds on a lent range (reached by staged copies).
    let lent = HostBuffer::new(SIZE).unwrap();
    s.set_host_data(Mem::from(&lent)).unwrap();
    let v = s.host_data().unwrap();
    assert!(matches!(v.read(SIZE, &mut [0; 1]), Err(Error::OutOfBounds { .. })));
    assert_eq!(v.len(), SIZE);
}

#[test]
fn heads_have_caffes_names() {
    let names: Vec<_> = [Uninitialized, AtHost, AtDevice, Synced].iter().map(|h| h.caffe_name()).collect();
    assert_eq!(names, ["UNINITIALIZED", "HEAD_AT_CPU", "HEAD_AT_GPU", "SYNCED"]);
}

#[test]
fn a_synced_memory_moves_between_threads() {
    let f = Fixture::new();
    let mut s = f.make(Mode::Split);
    s.mutable_host_data().unwrap().write(0, &p()).unwrap();
    let queue = Arc::clone(&f.queue);
    let s = std::thread::spawn(move || {
        let mut s = s;
        s.async_device_push(&queue).unwrap();
        s
    })
    .join()
    .unwrap();
    let mut s = s;
    assert_eq!(read_mem(&s.device_data().unwrap()), p());
}
