//! CPU views: a block's view reaches exactly its block (issue 9, defect 5), and a segment's
//! view never reaches past what is mapped.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

use dmabuf_rt::caching::{CachingAllocator, Config, HostCachingAllocator};
use dmabuf_rt::queue::{HostBuffer, Mem, copy_now};
use dmabuf_rt::source::{MemorySource, ShmemSource};
use dmabuf_rt::{Access, Error, Result, Segment, SegmentKind};

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;

/// Shmem segments, counting how the allocator asked for them.
#[derive(Debug, Default)]
struct Counting {
    inner: ShmemSource,
    expandable: AtomicUsize,
    classic: AtomicUsize,
}

impl MemorySource for Counting {
    fn name(&self) -> String {
        "counting shmem".into()
    }
    fn kind(&self) -> SegmentKind {
        SegmentKind::Device
    }
    fn create_segment(&self, len: usize) -> Result<Segment> {
        self.classic.fetch_add(1, Ordering::SeqCst);
        self.inner.create_segment(len)
    }
    fn reserve_expandable(&self, len: usize) -> Result<Segment> {
        self.expandable.fetch_add(1, Ordering::SeqCst);
        self.inner.reserve_expandable(len)
    }
}

fn allocator(expandable: bool) -> (CachingAllocator, Arc<Counting>) {
    #[derive(Debug)]
    struct Shared(Arc<Counting>);
    impl MemorySource for Shared {
        fn name(&self) -> String {
            self.0.name()
        }
        fn kind(&self) -> SegmentKind {
            self.0.kind()
        }
        fn create_segment(&self, len: usize) -> Result<Segment> {
            self.0.create_segment(len)
        }
        fn reserve_expandable(&self, len: usize) -> Result<Segment> {
            self.0.reserve_expandable(len)
        }
    }
    let src = Arc::new(Counting { inner: ShmemSource::new().reserve(false), ..Counting::default() });
    let cfg = if expandable { "expandable_segments:True" } else { "expandable_segments:False" };
    let a = CachingAllocator::builder(Shared(Arc::clone(&src)))
        .config(Config::parse(cfg).unwrap())
        .capacity(1 << 30)
        .build()
        .unwrap();
    (a, src)
}

fn out_of_bounds(r: Result<()>) -> (usize, usize, usize) {
    match r {
        Err(Error::OutOfBounds { offset, len, size }) => (offset, len, size),
        other => panic!("expected OutOfBounds, got {other:?}"),
    }
}

#[test]
fn a_write_far_past_a_small_expandable_block_is_refused_not_a_segfault() {
    let (a, src) = allocator(true);
    let block = a.allocate(4 * KB, None).unwrap();
    assert_eq!(src.expandable.load(Ordering::SeqCst), 1, "the block must live in an expandable segment");
    assert_eq!(src.classic.load(Ordering::SeqCst), 0);
    let cpu = block.cpu_access(Access::Write).unwrap();
    assert_eq!(cpu.len(), 4 * KB);
    // 64 MiB in: inside the segment's reservation, far outside what is mapped (PROT_NONE).
    assert_eq!(out_of_bounds(cpu.write(64 << 20, &[1; 16])), (64 << 20, 16, 4 * KB), "names the block's size");
    assert_eq!(out_of_bounds(cpu.fill(64 << 20, 16, 1)), (64 << 20, 16, 4 * KB));
    cpu.write(0, &[7; 4 * KB]).unwrap();
    cpu.end().unwrap();
    let r = block.cpu_access(Access::Read).unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(out_of_bounds(r.read(64 << 20, &mut buf)), (64 << 20, 16, 4 * KB));
    assert_eq!(r.to_vec().unwrap(), vec![7; 4 * KB]);
}

#[test]
fn an_expandable_segment_is_reachable_only_where_it_is_mapped() {
    let seg = ShmemSource::new().reserve_expandable(64 * MB).unwrap();
    assert_eq!(seg.mapped_len(), 0, "nothing is mapped into a fresh reservation");
    let cpu = seg.cpu_access(Access::Write).unwrap();
    assert!(cpu.is_empty());
    assert_eq!(out_of_bounds(cpu.write(MB, &[1])), (MB, 1, 0));
    drop(cpu);
    // The raw mapping is bounded the same way.
    let map = seg.mapping().unwrap();
    assert_eq!((map.len(), map.reserved_len()), (0, 64 * MB));
    assert_eq!(out_of_bounds(map.write(0, &[1])), (0, 1, 0));
    // So is a queue range over it.
    let seg = Arc::new(seg);
    let mem = Mem::from(&seg);
    assert_eq!(mem.len(), 0);
    assert!(matches!(mem.range(MB, 4096), Err(Error::OutOfBounds { .. })));
    let host = HostBuffer::new(4096).unwrap();
    assert!(copy_now(Mem::from(&seg), &host).is_err(), "a copy into the unmapped reservation was accepted");
}

#[test]
fn a_write_one_byte_past_the_requested_length_is_refused() {
    let (a, _) = allocator(false);
    // 5000 bytes round up to 5120: the view is still 5000.
    let block = a.allocate(5000, None).unwrap();
    let cpu = block.cpu_access(Access::ReadWrite).unwrap();
    assert_eq!(cpu.len(), 5000);
    assert_eq!(out_of_bounds(cpu.write(5000, &[1])), (5000, 1, 5000));
    assert_eq!(out_of_bounds(cpu.write(4999, &[1, 2])), (4999, 2, 5000));
    assert_eq!(out_of_bounds(cpu.fill(0, 5001, 1)), (0, 5001, 5000));
    assert_eq!(out_of_bounds(cpu.read(usize::MAX, &mut [0])), (usize::MAX, 1, 5000), "overflow");
    cpu.write(4999, &[9]).unwrap();
    let mut b = [0];
    cpu.read(4999, &mut b).unwrap();
    assert_eq!(b, [9]);
    // The same on the pinned-host allocator (8192-byte segment for 5000 bytes).
    let h = HostCachingAllocator::new(dmabuf_rt::source::HostSource::mlocked());
    let hb = h.allocate(5000).unwrap();
    assert_eq!(hb.segment().len(), 8192);
    let cpu = hb.cpu_access(Access::Write).unwrap();
    assert_eq!(cpu.len(), 5000);
    assert_eq!(out_of_bounds(cpu.write(5000, &[1])), (5000, 1, 5000));
}

#[test]
fn a_block_cannot_touch_its_neighbours_bytes() {
    for expandable in [false, true] {
        let (a, _) = allocator(expandable);
        let left = a.allocate(4 * KB, None).unwrap();
        let right = a.allocate(4 * KB, None).unwrap();
        assert_eq!(right.as_ptr() as usize, left.as_ptr() as usize + 4 * KB, "neighbours in one segment");
        assert_eq!(right.offset(), left.offset() + 4 * KB);
        right.cpu_access(Access::Write).unwrap().fill(0, 4 * KB, 0xbb).unwrap();
        let cpu = left.cpu_access(Access::ReadWrite).unwrap();
        cpu.fill(0, 4 * KB, 0xaa).unwrap();
        assert!(cpu.write(4 * KB, &[0xaa; 64]).is_err(), "expandable {expandable}");
        assert!(cpu.fill(4 * KB - 1, 2, 0xaa).is_err());
        assert!(cpu.sub(4 * KB, 1).is_err());
        let mut peek = [0u8; 1];
        assert!(cpu.read(4 * KB, &mut peek).is_err(), "read a neighbour's byte");
        drop(cpu);
        assert_eq!(right.cpu_access(Access::Read).unwrap().to_vec().unwrap(), vec![0xbb; 4 * KB]);
        assert_eq!(left.cpu_access(Access::Read).unwrap().to_vec().unwrap(), vec![0xaa; 4 * KB]);
    }
}

#[test]
fn a_sub_range_never_grows() {
    let (a, _) = allocator(false);
    let block = a.allocate(4 * KB, None).unwrap();
    let cpu = block.cpu_access(Access::ReadWrite).unwrap();
    cpu.fill(0, 4 * KB, 0).unwrap();
    assert!(cpu.sub(0, 4 * KB + 1).is_err());
    assert!(cpu.sub(4 * KB, 1).is_err());
    assert!(cpu.sub(usize::MAX, 2).is_err());
    let sub = cpu.sub(100, 200).unwrap();
    assert_eq!((sub.len(), sub.offset()), (200, block.offset() + 100));
    assert!(sub.sub(0, 201).is_err());
    assert!(sub.sub(1, 200).is_err());
    assert_eq!(out_of_bounds(sub.write(200, &[1])), (200, 1, 200));
    assert_eq!(out_of_bounds(sub.fill(150, 51, 1)), (150, 51, 200));
    // Offsets compose: sub(100, 200).sub(50, 10) is bytes 150..160 of the block.
    let inner = sub.sub(50, 10).unwrap();
    inner.fill(0, 10, 0x11).unwrap();
    sub.write(0, &[0x22]).unwrap();
    drop(inner);
    sub.end().unwrap();
    let all = cpu.to_vec().unwrap();
    let mut want = vec![0u8; 4 * KB];
    want[100] = 0x22;
    want[150..160].fill(0x11);
    assert_eq!(all, want);
}

#[test]
fn read_write_fill_round_trip_and_directions_are_enforced() {
    let (a, _) = allocator(true);
    let block = a.allocate(64 * KB + 3, None).unwrap();
    let data: Vec<u8> = (0..block.len()).map(|i| (i * 7 + 3) as u8).collect();
    let w = block.cpu_access(Access::Write).unwrap();
    assert!(matches!(w.read(0, &mut [0; 4]), Err(Error::Unsupported { .. })), "read through a write view");
    w.write(0, &data).unwrap();
    w.fill(1000, 24, 0xee).unwrap();
    w.end().unwrap();
    let r = block.cpu_access(Access::Read).unwrap();
    assert!(matches!(r.write(0, &[1]), Err(Error::Unsupported { .. })), "write through a read view");
    assert!(matches!(r.fill(0, 1, 1), Err(Error::Unsupported { .. })));
    let mut want = data.clone();
    want[1000..1024].fill(0xee);
    assert_eq!(r.to_vec().unwrap(), want);
    let mut mid = [0u8; 33];
    r.read(block.len() - 33, &mut mid).unwrap();
    assert_eq!(&mid[..], &want[block.len() - 33..]);
    // The queue sees the same bytes where the view put them.
    let out = HostBuffer::new(block.len()).unwrap();
    copy_now(&out, block.mem()).unwrap();
    assert_eq!(out.to_vec(), want);
    // The fd and offset name the block for sharing: a second mapping of the fd sees it there.
    let fd = block.try_clone_fd().unwrap();
    let peer = Segment::import(&fd, SegmentKind::Device).unwrap();
    let mut shared = vec![0u8; 16];
    peer.cpu_access(Access::Read).unwrap().read(block.offset() + 1000, &mut shared).unwrap();
    assert_eq!(shared, vec![0xee; 16]);
}

#[test]
fn threads_write_disjoint_views_of_one_segment_at_once() {
    const THREADS: usize = 8;
    const LEN: usize = 64 * KB;
    let (a, src) = allocator(false);
    let blocks: Vec<_> = (0..THREADS).map(|_| a.allocate(LEN, None).unwrap()).collect();
    assert_eq!(src.classic.load(Ordering::SeqCst), 1, "all blocks share one segment");
    let start = Barrier::new(THREADS);
    // An `Allocation` is not `Sync`, but its view is: each thread gets its block's view.
    let views: Vec<_> = blocks.iter().map(|b| b.cpu_access(Access::ReadWrite).unwrap()).collect();
    std::thread::scope(|s| {
        for (i, cpu) in views.into_iter().enumerate() {
            let start = &start;
            s.spawn(move || {
                let mine = vec![i as u8 + 1; LEN];
                start.wait();
                for round in 0..50 {
                    cpu.write(0, &mine).unwrap();
                    // A careless writer: past its end lies the next block, which must stay whole.
                    assert!(cpu.write(LEN, &mine).is_err());
                    assert!(cpu.fill(round + 1, LEN, 0xff).is_err());
                    assert_eq!(cpu.to_vec().unwrap(), mine, "thread {i}, round {round}: a neighbour wrote here");
                }
            });
        }
    });
    // And sub-views of one view, shared between threads.
    let whole = a.allocate(THREADS * LEN, None).unwrap();
    let cpu = whole.cpu_access(Access::Write).unwrap();
    std::thread::scope(|s| {
        for i in 0..THREADS {
            let part = cpu.sub(i * LEN, LEN).unwrap();
            s.spawn(move || {
                part.fill(0, LEN, 0x80 | i as u8).unwrap();
                assert!(part.fill(0, LEN + 1, 0).is_err());
            });
        }
    });
    cpu.end().unwrap();
    let got = whole.cpu_access(Access::Read).unwrap().to_vec().unwrap();
    for (i, chunk) in got.chunks(LEN).enumerate() {
        assert!(chunk.iter().all(|&b| b == 0x80 | i as u8), "part {i}");
    }
}
