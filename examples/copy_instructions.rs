//! Instruction counts of the copy kernel (`src/copy.rs`) for `valgrind --tool=callgrind`: run
//! with N and 2N; the difference over N is the cost of one copy.
//!
//! `copy_instructions N write|read|queue [SIZE]`: N copies of SIZE bytes (default 4096) into
//! (`Mapping::write`) or out of (`Mapping::read`) a shmem segment's mapping, to or from a
//! page-aligned private buffer (the mapping is page-aligned too); or (`queue`) host-to-device
//! copies through an idle queue (`Queue::copy(&dst, &src)`, a page-aligned `HostBuffer` to the
//! segment), the whole operation: checks, locking, the kernel.
//!
//! Run: `cargo build --release --example copy_instructions`, then
//! `valgrind --tool=callgrind --callgrind-out-file=/dev/null target/release/examples/copy_instructions 10000 write`
//! (the total is on the `Collected` line of the summary).

use std::hint::black_box;

use dmabuf_rt::source::{MemorySource, ShmemSource};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: copy_instructions N write|read|queue [SIZE]";
    let n: usize = args.get(1).and_then(|a| a.parse().ok()).expect(usage);
    let mode = args.get(2).map(String::as_str);
    let write = match mode {
        Some("write" | "queue") => true,
        Some("read") => false,
        _ => panic!("{usage}"),
    };
    let size: usize = args.get(3).map_or(4096, |a| a.parse().expect(usage));
    if mode == Some("queue") {
        let q = dmabuf_rt::queue::Queue::new().unwrap();
        let seg = std::sync::Arc::new(ShmemSource::new().create_segment(size).unwrap());
        let host = dmabuf_rt::queue::HostBuffer::new(size).unwrap();
        let (dst, src): (dmabuf_rt::queue::Mem, dmabuf_rt::queue::Mem) = ((&seg).into(), (&host).into());
        for _ in 0..n {
            q.copy(&dst, black_box(&src)).unwrap();
        }
        return;
    }
    let seg = ShmemSource::new().create_segment(size).unwrap();
    let map = seg.mapping().unwrap();
    let mut buf = dmabuf_rt::testing::PageBuf::new(size, 0x5a);
    let host = buf.get_mut();
    for _ in 0..n {
        if write {
            map.write(0, black_box(&*host)).unwrap();
        } else {
            map.read(0, black_box(&mut *host)).unwrap();
        }
    }
}
