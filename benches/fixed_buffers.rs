//! Should the kernel engine register its host buffers (`READ_FIXED` / `WRITE_FIXED`)? Measured
//! here against the engine's plain `READ` / `WRITE` and against the CPU engine's copy kernel,
//! same run, same page-aligned buffers, same shmem segment:
//!
//! - `cpu`: the crate's copy kernel into / out of the segment's mapping (`Mapping::write` /
//!   `Mapping::read`, what the CPU engine runs);
//! - `io_uring`: one `WRITE` (`READ`) of the whole range at the memfd, submit and wait, as the
//!   kernel engine does;
//! - `io_uring fixed`: the same with the host buffer registered once
//!   (`IORING_REGISTER_BUFFERS`) and `WRITE_FIXED` (`READ_FIXED`), which spares the kernel
//!   pinning the user pages on every operation.
//!
//! Run: `cargo bench --bench fixed_buffers`
#![allow(unsafe_code)]

use std::os::fd::AsRawFd;
use std::time::Instant;

use dmabuf_rt::source::{MemorySource, ShmemSource};
use dmabuf_rt::testing::PageBuf;
use io_uring::{IoUring, opcode, types};

/// Best of 3 runs of `n` calls of `f`, in GB/s for `size`-byte operations.
fn gbps(size: usize, n: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..3)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..n {
                f();
            }
            (size * n) as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

/// Submits `e` and waits for its completion; panics unless it moved `len` bytes.
fn run(ring: &mut IoUring, e: io_uring::squeue::Entry, len: usize) {
    // SAFETY: every buffer the entries name lives in `main` for the whole benchmark, and this
    // waits for the completion before returning.
    unsafe { ring.submission().push(&e).expect("SQ has room") };
    ring.submit_and_wait(1).expect("io_uring_enter");
    let cqe = ring.completion().next().expect("a completion");
    assert_eq!(cqe.result(), len as i32, "short or failed transfer");
}

fn main() {
    println!(
        "{:<10}{:>16}{:>16}{:>22}{:>16}{:>22}",
        "GB/s", "cpu write", "io_uring write", "io_uring write_fixed", "io_uring read", "io_uring read_fixed"
    );
    for size in [4usize << 10, 64 << 10, 1 << 20, 64 << 20] {
        let n = ((1usize << 30) / size).clamp(16, 50_000);
        let seg = ShmemSource::new().create_segment(size).unwrap();
        let map = seg.mapping().unwrap();
        let fd = types::Fd(seg.memfd().expect("a shmem segment is a memfd").as_raw_fd());
        let mut buf = PageBuf::new(size, 0x5a);
        let (ptr, len) = (buf.get_mut().as_mut_ptr(), size as u32);
        let mut ring = IoUring::new(8).expect("io_uring");
        let iov = libc_iovec(ptr, size);
        // SAFETY: the buffer outlives the registration (the ring is dropped first, below).
        unsafe { ring.submitter().register_buffers(&[iov]) }.expect("IORING_REGISTER_BUFFERS");

        let cpu = gbps(size, n, || map.write(0, host_ro(ptr, size)).unwrap());
        let w = gbps(size, n, || run(&mut ring, opcode::Write::new(fd, ptr, len).offset(0).build(), size));
        let wf = gbps(size, n, || run(&mut ring, opcode::WriteFixed::new(fd, ptr, len, 0).offset(0).build(), size));
        let r = gbps(size, n, || run(&mut ring, opcode::Read::new(fd, ptr, len).offset(0).build(), size));
        let rf = gbps(size, n, || run(&mut ring, opcode::ReadFixed::new(fd, ptr, len, 0).offset(0).build(), size));
        drop(ring);
        let x = |g: f64| format!("{g:.1} (x{:.2})", g / cpu);
        println!(
            "{:<10}{:>16}{:>16}{:>22}{:>16}{:>22}",
            format!("{} KiB", size >> 10),
            format!("{cpu:.1}"),
            x(w),
            x(wf),
            x(r),
            x(rf)
        );
    }
    println!("# x = throughput relative to the CPU engine's copy kernel at the same size, same run");
}

/// An `iovec` for `len` bytes at `ptr`.
fn libc_iovec(ptr: *mut u8, len: usize) -> libc::iovec {
    libc::iovec { iov_base: ptr.cast(), iov_len: len }
}

/// The host buffer as the source of a CPU write (nothing writes it meanwhile: the io_uring
/// runs are sequential, each awaited).
fn host_ro<'a>(ptr: *mut u8, len: usize) -> &'a [u8] {
    // SAFETY: `ptr..ptr + len` is the live page-aligned window of `buf` in `main`, not written
    // while this slice is used (every io_uring operation has completed before the next call).
    unsafe { std::slice::from_raw_parts(ptr, len) }
}
