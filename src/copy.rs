//! The copy kernel for memory shared with devices, other processes and other threads.
//!
//! Plain `memcpy` on such memory would be a data race in Rust's model whenever another thread
//! of this process touches the same bytes (its result is then undefined, not merely garbled).
//! So copies here are *byte-wise atomic* in the sense of C++ proposal P1478: every byte is read
//! and written by an access that is atomic at byte granularity, and concurrent writers can
//! only interleave bytes. Two implementations:
//!
//! - x86-64: the 64-byte body is moved by an inline-assembly loop of unaligned SSE loads and
//!   stores (non-temporal stores from [`NT_THRESHOLD`] up, which skip the read-for-ownership
//!   of the destination and beat glibc's memcpy on large copies). The compiler cannot reason
//!   about the asm's accesses, and the hardware performs each of them byte-wise atomically.
//! - elsewhere, and for the unaligned edges: relaxed `AtomicU64`/`AtomicU8` loads and stores.
//!
//! Measured with `cargo bench --bench cpu_copy` (see the README for the figures).
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering::Relaxed};

/// Copies of at least this many bytes use non-temporal stores (they would evict the caches
/// anyway, and skipping the destination's read-for-ownership saves a third of the traffic).
pub const NT_THRESHOLD: usize = 4 << 20;

/// Copies `len` bytes from `src` to `dst`.
///
/// # Safety
///
/// `[src, src + len)` must be valid for reads and `[dst, dst + len)` valid for writes for the
/// duration of the call, and they must not overlap. Memory that other threads may access
/// concurrently must be accessed by them only atomically or through this module.
pub(crate) unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's contract, with a shared source.
    unsafe { copy_impl::<true>(src, dst, len) }
}

/// Copies `src`, memory private to the caller (a Rust slice: it may be behind a shared
/// reference or read-only, so it is read with plain loads, never through an atomic, which
/// would need it writable), to `dst`, written byte-wise atomically.
///
/// # Safety
///
/// `[dst, dst + src.len())` must be valid for writes for the duration of the call, must not
/// overlap `src`, and be accessed by other threads only atomically or through this module.
pub(crate) unsafe fn copy_from_private(src: &[u8], dst: *mut u8) {
    // SAFETY: the caller's contract; `src` is a live slice nobody writes while we hold it.
    unsafe { copy_impl::<false>(src.as_ptr(), dst, src.len()) }
}

/// `SHARED_SRC`: the source may be written concurrently, so it is loaded atomically (and must
/// be valid for writes, as `Atomic*::from_ptr` requires); otherwise with plain loads.
///
/// # Safety
/// As [`copy`] (with a shared source) or [`copy_from_private`].
unsafe fn copy_impl<const SHARED_SRC: bool>(src: *const u8, dst: *mut u8, len: usize) {
    // Align the destination to 16 bytes with byte copies (movntdq needs it; it helps the rest).
    let head = dst.align_offset(16).min(len);
    // SAFETY: in range (caller).
    unsafe { copy_bytes::<SHARED_SRC>(src, dst, head) };
    let body = (len - head) / 64 * 64;
    let (src_b, dst_b) = (src.wrapping_add(head), dst.wrapping_add(head));
    // SAFETY: [head, head + body) is in range (caller); dst_b is 16-aligned.
    unsafe { copy_body::<SHARED_SRC>(src_b, dst_b, body) };
    let done = head + body;
    // SAFETY: in range (caller).
    unsafe { copy_words_then_bytes::<SHARED_SRC>(src.wrapping_add(done), dst.wrapping_add(done), len - done) };
}

/// Sets `len` bytes at `dst` to `byte`.
///
/// # Safety
///
/// `[dst, dst + len)` must be valid for writes for the duration of the call, and accessed by
/// other threads only atomically or through this module.
pub(crate) unsafe fn fill(dst: *mut u8, len: usize, byte: u8) {
    let head = dst.align_offset(8).min(len);
    let words = (len - head) / 8;
    let word = u64::from_ne_bytes([byte; 8]);
    for i in (0..head).chain(head + words * 8..len) {
        // SAFETY: in range (caller); byte atomics need no alignment.
        unsafe { AtomicU8::from_ptr(dst.wrapping_add(i)) }.store(byte, Relaxed);
    }
    let body = dst.wrapping_add(head).cast::<u64>();
    for w in 0..words {
        // SAFETY: in range (caller); `dst + head` is 8-aligned.
        unsafe { AtomicU64::from_ptr(body.wrapping_add(w)) }.store(word, Relaxed);
    }
}

/// # Safety
/// As [`copy`], for `len` bytes.
unsafe fn copy_bytes<const SHARED_SRC: bool>(src: *const u8, dst: *mut u8, len: usize) {
    for i in 0..len {
        let b = if SHARED_SRC {
            // SAFETY: in range (caller); byte atomics need no alignment.
            unsafe { AtomicU8::from_ptr(src.wrapping_add(i).cast_mut()) }.load(Relaxed)
        } else {
            // SAFETY: in range of the caller's private slice.
            unsafe { src.wrapping_add(i).read() }
        };
        // SAFETY: as above.
        unsafe { AtomicU8::from_ptr(dst.wrapping_add(i)) }.store(b, Relaxed);
    }
}

/// Word copies where both sides are 8-aligned (after the 16-aligned body they are when the
/// source was), bytes otherwise.
///
/// # Safety
/// As [`copy`], for `len` bytes.
unsafe fn copy_words_then_bytes<const SHARED_SRC: bool>(src: *const u8, dst: *mut u8, len: usize) {
    let mut done = 0;
    if src.align_offset(8) == 0 && dst.align_offset(8) == 0 {
        let (s, d) = (src.cast::<u64>(), dst.cast::<u64>());
        for w in 0..len / 8 {
            let v = if SHARED_SRC {
                // SAFETY: in range (caller), both 8-aligned (checked).
                unsafe { AtomicU64::from_ptr(s.wrapping_add(w).cast_mut()) }.load(Relaxed)
            } else {
                // SAFETY: in range of the caller's private slice, 8-aligned (checked).
                unsafe { s.wrapping_add(w).read() }
            };
            // SAFETY: as above.
            unsafe { AtomicU64::from_ptr(d.wrapping_add(w)) }.store(v, Relaxed);
        }
        done = len / 8 * 8;
    }
    // SAFETY: in range (caller).
    unsafe { copy_bytes::<SHARED_SRC>(src.wrapping_add(done), dst.wrapping_add(done), len - done) };
}

/// Copies `len` (a multiple of 64) bytes; `dst` is 16-aligned.
///
/// # Safety
/// As [`copy`].
#[cfg(all(target_arch = "x86_64", not(miri)))]
unsafe fn copy_body<const SHARED_SRC: bool>(src: *const u8, dst: *mut u8, len: usize) {
    let blocks = len / 64;
    if blocks == 0 {
        return;
    }
    if len >= NT_THRESHOLD {
        // SAFETY: reads [src, src+len) and writes [dst, dst+len), valid and disjoint (caller);
        // dst is 16-aligned as movntdq requires; sfence orders the streaming stores before
        // anything this thread does next (e.g. completing the event that publishes them).
        unsafe {
            std::arch::asm!(
                "2:",
                "movdqu xmm0, [{s}]",
                "movdqu xmm1, [{s} + 16]",
                "movdqu xmm2, [{s} + 32]",
                "movdqu xmm3, [{s} + 48]",
                "movntdq [{d}], xmm0",
                "movntdq [{d} + 16], xmm1",
                "movntdq [{d} + 32], xmm2",
                "movntdq [{d} + 48], xmm3",
                "add {s}, 64",
                "add {d}, 64",
                "dec {n}",
                "jnz 2b",
                "sfence",
                s = inout(reg) src => _,
                d = inout(reg) dst => _,
                n = inout(reg) blocks => _,
                out("xmm0") _, out("xmm1") _, out("xmm2") _, out("xmm3") _,
                options(nostack),
            );
        }
    } else {
        // SAFETY: as above, with ordinary (temporal) stores.
        unsafe {
            std::arch::asm!(
                "2:",
                "movdqu xmm0, [{s}]",
                "movdqu xmm1, [{s} + 16]",
                "movdqu xmm2, [{s} + 32]",
                "movdqu xmm3, [{s} + 48]",
                "movdqa [{d}], xmm0",
                "movdqa [{d} + 16], xmm1",
                "movdqa [{d} + 32], xmm2",
                "movdqa [{d} + 48], xmm3",
                "add {s}, 64",
                "add {d}, 64",
                "dec {n}",
                "jnz 2b",
                s = inout(reg) src => _,
                d = inout(reg) dst => _,
                n = inout(reg) blocks => _,
                out("xmm0") _, out("xmm1") _, out("xmm2") _, out("xmm3") _,
                options(nostack),
            );
        }
    }
}

/// Portable body: relaxed word atomics where aligned, bytes otherwise (also under Miri, which
/// cannot run inline assembly).
///
/// # Safety
/// As [`copy`].
#[cfg(any(not(target_arch = "x86_64"), miri))]
unsafe fn copy_body<const SHARED_SRC: bool>(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's contract.
    unsafe { copy_words_then_bytes::<SHARED_SRC>(src, dst, len) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "hundreds of thousands of atomic accesses: minutes under Miri")]
    fn copies_are_exact_at_every_alignment_and_length() {
        let mut a = vec![0u8; 4096 + 64];
        let mut b = vec![0u8; 4096 + 64];
        for soff in [0, 1, 7, 8, 15, 16, 33] {
            for doff in [0, 1, 3, 8, 16, 31] {
                for len in [0, 1, 15, 16, 63, 64, 65, 127, 128, 200, 1000, 4000] {
                    for (i, x) in a.iter_mut().enumerate() {
                        *x = (i * 13 + soff + len) as u8;
                    }
                    b.fill(0xcc);
                    // SAFETY: both ranges lie inside their own vectors, which only this test uses.
                    unsafe { copy(a.as_mut_ptr().wrapping_add(soff), b[doff..].as_mut_ptr(), len) };
                    assert_eq!(&b[doff..doff + len], &a[soff..soff + len], "soff {soff} doff {doff} len {len}");
                    b[doff..doff + len].fill(0xcc);
                    // SAFETY: as above.
                    unsafe { copy_from_private(&a[soff..soff + len], b[doff..].as_mut_ptr()) };
                    assert_eq!(&b[doff..doff + len], &a[soff..soff + len], "private soff {soff} doff {doff} len {len}");
                    assert!(b[..doff].iter().all(|&x| x == 0xcc), "wrote before the start");
                    assert!(b[doff + len..].iter().all(|&x| x == 0xcc), "wrote past the end");
                    // SAFETY: as above.
                    unsafe { fill(b[doff..].as_mut_ptr(), len, 0x5a) };
                    assert!(b[doff..doff + len].iter().all(|&x| x == 0x5a));
                    assert!(b[doff + len..].iter().all(|&x| x == 0xcc));
                }
            }
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "4 MiB under Miri is minutes")]
    fn large_copies_take_the_streaming_path_exactly() {
        let len = NT_THRESHOLD + 4096 + 3;
        let a: Vec<u8> = (0..len + 8).map(|i| (i % 251) as u8).collect();
        let mut b = vec![0u8; len + 8];
        // SAFETY: in range of both vectors.
        let mut a = a;
        // SAFETY: in range of both vectors.
        unsafe { copy(a.as_mut_ptr().wrapping_add(5), b[1..].as_mut_ptr(), len) };
        assert_eq!(&b[1..1 + len], &a[5..5 + len]);
        assert_eq!(b[0], 0);
        assert_eq!(b[len + 1], 0);
    }

    /// A source behind a shared reference (here a promoted constant, in read-only memory) is
    /// read with plain loads: an atomic on it is undefined behaviour (`Atomic*::from_ptr` needs
    /// writable memory), which Miri reported for `Mapping::write(&[1, 2, 3, 4])` before the
    /// private-source path existed (run under Miri by tests/miri/run).
    #[test]
    fn a_read_only_private_source_is_copied_with_plain_loads() {
        let src: &'static [u8] = &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19];
        let mut dst = [0u8; 24];
        for off in [0, 1, 5] {
            dst.fill(0);
            // SAFETY: `dst` has room for the source at `off`; it is this test's own.
            unsafe { copy_from_private(src, dst[off..].as_mut_ptr()) };
            assert_eq!(&dst[off..off + src.len()], src);
        }
    }
}
