//! The copy kernel for memory shared with devices, other processes and other threads.
//!
//! Plain `memcpy` on such memory would be a data race in Rust's model whenever another thread
//! of this process touches the same bytes (its result is then undefined, not merely garbled).
//! So copies here are *byte-wise atomic* in the sense of C++ proposal P1478: every byte is read
//! and written by an access that is atomic at byte granularity, and concurrent writers can
//! only interleave bytes. Two implementations:
//!
//! - x86-64: every access is an inline-assembly load or store (the compiler cannot reason about
//!   them, and the hardware performs each of them byte-wise atomically, unaligned or not).
//!   Copies of more than four vectors store a first unaligned vector, then move aligned blocks
//!   of four vectors (AVX2: 4 x 32 bytes, `vmovdqu` loads and `vmovdqa` stores; SSE2 where
//!   the CPU has no AVX2: 4 x 16 bytes), and end with the last four vectors of the range,
//!   unaligned. From `x86::REP_THRESHOLD` (16 KiB) on CPUs with ERMS, the first 64 bytes are
//!   vectors and `rep movsb` moves the rest, as glibc's memcpy does at these sizes. From
//!   [`NT_THRESHOLD`] up the blocks are stored non-temporally (`vmovntdq` / `movntdq`, then
//!   `sfence`): that skips the read-for-ownership of the destination and beats glibc's memcpy
//!   on large copies. Shorter copies use two overlapping accesses from each end (two to four
//!   vectors, or two 8-, 4-, 2-byte moves, or one byte). The CPU's features are detected once
//!   (`x86::kernel`); a call then costs one relaxed load and predictable branches. `fill` has
//!   the same shape (`rep stosb`, a vector of the byte).
//! - elsewhere, and under Miri (which cannot run inline assembly): relaxed `AtomicU64` loads
//!   and stores where both sides are 8-aligned, `AtomicU8` otherwise.
//!
//! The overlapping edges write some destination bytes twice. Each write stores a value read
//! from that byte's source by a byte-wise atomic load during the call, so the result is the
//! same as writing once: each byte ends up holding a value its source byte had during the copy
//! (the same value twice when nobody writes the source concurrently; the source and the
//! destination never overlap). A concurrent reader of the destination may see such a byte
//! change twice, as it may see any byte change while a copy runs.
//!
//! Measured with `cargo bench --bench cpu_copy`; instruction counts with
//! `examples/copy_instructions.rs` under callgrind.
#![allow(unsafe_code)]

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

/// `SHARED_SRC`: the source may be written concurrently. The assembly loads are the same
/// either way (they need no writable memory); the portable path loads a shared source
/// atomically (which needs it writable, as `Atomic*::from_ptr` requires), a private one with
/// plain loads.
///
/// # Safety
/// As [`copy`] (with a shared source) or [`copy_from_private`].
#[inline]
unsafe fn copy_impl<const SHARED_SRC: bool>(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: the caller's contract.
    unsafe {
        x86::copy(x86::kernel(), src, dst, len)
    };
    #[cfg(any(not(target_arch = "x86_64"), miri))]
    // SAFETY: the caller's contract.
    unsafe {
        portable::copy::<SHARED_SRC>(src, dst, len)
    };
}

/// Sets `len` bytes at `dst` to `byte`.
///
/// # Safety
///
/// `[dst, dst + len)` must be valid for writes for the duration of the call, and accessed by
/// other threads only atomically or through this module.
pub(crate) unsafe fn fill(dst: *mut u8, len: usize, byte: u8) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: the caller's contract.
    unsafe {
        x86::fill(x86::kernel(), dst, len, byte)
    };
    #[cfg(any(not(target_arch = "x86_64"), miri))]
    // SAFETY: the caller's contract.
    unsafe {
        portable::fill(dst, len, byte)
    };
}

/// The x86-64 kernel: inline assembly only, so every access is one the hardware performs
/// byte-wise atomically and the compiler knows nothing about.
///
/// The assembly blocks that use `ymm` registers end with `vzeroupper` (the code around them is
/// SSE code, which would otherwise pay for the dirty upper halves) and declare
/// `clobber_abi("C")`: that covers the vector registers they name and the upper halves
/// `vzeroupper` clears.
#[cfg(all(target_arch = "x86_64", not(miri)))]
mod x86 {
    use std::arch::asm;
    use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

    use super::NT_THRESHOLD;

    /// Copies and fills from this many bytes up to [`NT_THRESHOLD`] use `rep movsb` /
    /// `rep stosb` where the CPU has ERMS: once the source and the destination no longer fit
    /// in L1 together, the fast-string microcode beats the vector loop (it writes whole lines
    /// without reading them first); glibc's memcpy uses it from below this size. On a Zen 5
    /// EPYC, 4 x 32-byte blocks vs `rep movsb`: 16 KiB 181 vs 161 GB/s, 32 KiB 104 vs 168,
    /// 64 KiB 98 vs 128, 1 MiB 58 vs 67 (page-aligned, cache-warm).
    pub(super) const REP_THRESHOLD: usize = 16 << 10;

    /// The vector instruction set a copy uses.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(super) enum Isa {
        /// 16-byte vectors: every x86-64 CPU.
        Sse2,
        /// 32-byte vectors.
        Avx2,
    }

    /// How copies are done on this CPU: the [`kernel`] cache's bits (`READY`, `AVX2`, `REP`),
    /// so that a call tests them where it needs them, without decoding.
    #[derive(Clone, Copy, PartialEq, Eq)]
    pub(super) struct Kernel(u8);

    const READY: u8 = 1;
    const AVX2: u8 = 2;
    const REP: u8 = 4;

    impl Kernel {
        /// `rep`: `rep movsb` / `rep stosb` from [`REP_THRESHOLD`] to [`NT_THRESHOLD`] (for
        /// CPUs with ERMS, enhanced `rep movsb`/`stosb`).
        pub(super) const fn new(isa: Isa, rep: bool) -> Self {
            Self(READY | if matches!(isa, Isa::Avx2) { AVX2 } else { 0 } | if rep { REP } else { 0 })
        }

        pub(super) fn isa(self) -> Isa {
            if self.0 & AVX2 != 0 { Isa::Avx2 } else { Isa::Sse2 }
        }

        pub(super) fn rep(self) -> bool {
            self.0 & REP != 0
        }
    }

    impl std::fmt::Debug for Kernel {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Kernel").field("isa", &self.isa()).field("rep", &self.rep()).finish()
        }
    }

    /// [`kernel`]'s cache: 0 before the first call, then a [`Kernel`]'s bits.
    static KERNEL: AtomicU8 = AtomicU8::new(0);

    /// The kernel for this CPU, detected on the first call.
    #[inline]
    pub(super) fn kernel() -> Kernel {
        match KERNEL.load(Relaxed) {
            0 => detect(),
            k => Kernel(k),
        }
    }

    #[cold]
    fn detect() -> Kernel {
        // The macro also checks that the OS saves the ymm state (XCR0).
        let isa = if std::arch::is_x86_feature_detected!("avx2") { Isa::Avx2 } else { Isa::Sse2 };
        let k = Kernel::new(isa, std::arch::is_x86_feature_detected!("ermsb"));
        KERNEL.store(k.0, Relaxed);
        k
    }

    /// Copies `len` bytes with the kernel `k`.
    ///
    /// # Safety
    /// As [`super::copy`]; the CPU must have what `k` uses.
    #[inline]
    pub(super) unsafe fn copy(k: Kernel, src: *const u8, dst: *mut u8, len: usize) {
        if len <= 32 {
            // SAFETY: the caller's contract.
            unsafe { copy_upto_32(src, dst, len) }
        } else if (REP_THRESHOLD..NT_THRESHOLD).contains(&len) && k.rep() {
            // SAFETY: the caller's contract; the CPU has ERMS and `k.isa()` (caller).
            unsafe { copy_rep(k.isa(), src, dst, len) }
        } else if k.isa() == Isa::Avx2 {
            // SAFETY: the caller's contract; the CPU has AVX2 (caller).
            unsafe { copy_avx2(src, dst, len) }
        } else {
            // SAFETY: the caller's contract.
            unsafe { copy_sse2(src, dst, len) }
        }
    }

    /// The first 64 bytes with vectors, then `rep movsb` from the destination's first 64-byte
    /// boundary on (fast strings want an aligned destination: 35% slower without, on Zen 5).
    /// `rep movsb` moves each byte once with ordinary loads and stores, which the hardware
    /// performs byte-wise atomically like any other; they may be performed out of order among
    /// themselves, but not reordered with the stores that follow the instruction (Intel SDM
    /// vol. 3A, "Memory-Ordering Model for String Operations on Write-Back Memory"), so no
    /// fence is needed.
    ///
    /// # Safety
    /// As [`super::copy`], with `len >= 64`; the CPU has ERMS and `isa`.
    unsafe fn copy_rep(isa: Isa, src: *const u8, dst: *mut u8, len: usize) {
        // SAFETY: 64 <= len: the first 64 bytes are in range (caller).
        unsafe { copy(Kernel::new(isa, false), src, dst, 64) };
        let skip = (dst as usize).wrapping_neg() & 63;
        // SAFETY: [skip, len) of both ranges is in range (caller); rep movsb moves rcx bytes
        // from rsi to rdi forwards (the direction flag is clear, as the ABI guarantees).
        unsafe {
            asm!(
                "rep movsb",
                inout("rsi") src.wrapping_add(skip) => _,
                inout("rdi") dst.wrapping_add(skip) => _,
                inout("rcx") len - skip => _,
                options(nostack, preserves_flags),
            );
        }
    }

    /// Copies up to 32 bytes: two overlapping accesses from each end of the range.
    ///
    /// # Safety
    /// As [`super::copy`], with `len <= 32`.
    #[inline]
    unsafe fn copy_upto_32(src: *const u8, dst: *mut u8, len: usize) {
        if len >= 16 {
            // SAFETY: [src, src + len) readable and [dst, dst + len) writable (caller), and
            // 16 <= len: both 16-byte accesses at each end lie inside.
            unsafe {
                asm!(
                    "movdqu {a}, [{s}]",
                    "movdqu {b}, [{s} + {n} - 16]",
                    "movdqu [{d}], {a}",
                    "movdqu [{d} + {n} - 16], {b}",
                    s = in(reg) src, d = in(reg) dst, n = in(reg) len,
                    a = out(xmm_reg) _, b = out(xmm_reg) _,
                    options(nostack, preserves_flags),
                );
            }
        } else if len >= 8 {
            // SAFETY: as above, with 8-byte accesses and 8 <= len.
            unsafe {
                asm!(
                    "mov {a}, [{s}]",
                    "mov {b}, [{s} + {n} - 8]",
                    "mov [{d}], {a}",
                    "mov [{d} + {n} - 8], {b}",
                    s = in(reg) src, d = in(reg) dst, n = in(reg) len,
                    a = out(reg) _, b = out(reg) _,
                    options(nostack, preserves_flags),
                );
            }
        } else if len >= 4 {
            // SAFETY: as above, with 4-byte accesses and 4 <= len.
            unsafe {
                asm!(
                    "mov {a:e}, [{s}]",
                    "mov {b:e}, [{s} + {n} - 4]",
                    "mov [{d}], {a:e}",
                    "mov [{d} + {n} - 4], {b:e}",
                    s = in(reg) src, d = in(reg) dst, n = in(reg) len,
                    a = out(reg) _, b = out(reg) _,
                    options(nostack, preserves_flags),
                );
            }
        } else if len >= 2 {
            // SAFETY: as above, with 2-byte accesses and 2 <= len.
            unsafe {
                asm!(
                    "movzx {a:e}, word ptr [{s}]",
                    "movzx {b:e}, word ptr [{s} + {n} - 2]",
                    "mov word ptr [{d}], {a:x}",
                    "mov word ptr [{d} + {n} - 2], {b:x}",
                    s = in(reg) src, d = in(reg) dst, n = in(reg) len,
                    a = out(reg) _, b = out(reg) _,
                    options(nostack, preserves_flags),
                );
            }
        } else if len == 1 {
            // SAFETY: one byte, in range (caller).
            unsafe {
                asm!(
                    "movzx {a:e}, byte ptr [{s}]",
                    "mov byte ptr [{d}], {a:l}",
                    s = in(reg) src, d = in(reg) dst,
                    a = out(reg) _,
                    options(nostack, preserves_flags),
                );
            }
        }
    }

    /// The bulk of a copy of more than four vectors: the first vector unaligned, then aligned
    /// blocks of four vectors, `bulk` bytes (a multiple of the block) from the destination's
    /// first aligned address and the same offset in the source (`s`, `d` point past the
    /// blocks and `i` = -`bulk`, kept in rax), then, if `rem` (the bytes after the blocks) is
    /// not zero, the last four vectors of the range, unaligned. `$movu` is the unaligned load and
    /// store, `$store` the blocks' aligned store (temporal or streaming), `$end` what the
    /// block ends with.
    macro_rules! copy_bulk {
        ($movu:literal, $store:literal, $reg:literal, $o1:literal, $o2:literal, $o3:literal,
         $block:literal, $end:literal, $src:expr, $dst:expr, $s:expr, $d:expr, $i:expr, $rem:expr) => {
            asm!(
                concat!($movu, " ", $reg, "0, [{src}]"),
                concat!($movu, " [{dst}], ", $reg, "0"),
                "test rax, rax",
                "jz 3f",
                "2:",
                concat!($movu, " ", $reg, "0, [{s} + rax]"),
                concat!($movu, " ", $reg, "1, [{s} + rax + ", $o1, "]"),
                concat!($movu, " ", $reg, "2, [{s} + rax + ", $o2, "]"),
                concat!($movu, " ", $reg, "3, [{s} + rax + ", $o3, "]"),
                concat!($store, " [{d} + rax], ", $reg, "0"),
                concat!($store, " [{d} + rax + ", $o1, "], ", $reg, "1"),
                concat!($store, " [{d} + rax + ", $o2, "], ", $reg, "2"),
                concat!($store, " [{d} + rax + ", $o3, "], ", $reg, "3"),
                concat!("add rax, ", $block),
                "jnz 2b",
                "3:",
                "test {rem}, {rem}",
                "jz 4f",
                concat!($movu, " ", $reg, "0, [{s} + {rem} - ", $block, "]"),
                concat!($movu, " ", $reg, "1, [{s} + {rem} - ", $block, " + ", $o1, "]"),
                concat!($movu, " ", $reg, "2, [{s} + {rem} - ", $block, " + ", $o2, "]"),
                concat!($movu, " ", $reg, "3, [{s} + {rem} - ", $block, " + ", $o3, "]"),
                concat!($movu, " [{d} + {rem} - ", $block, "], ", $reg, "0"),
                concat!($movu, " [{d} + {rem} - ", $block, " + ", $o1, "], ", $reg, "1"),
                concat!($movu, " [{d} + {rem} - ", $block, " + ", $o2, "], ", $reg, "2"),
                concat!($movu, " [{d} + {rem} - ", $block, " + ", $o3, "], ", $reg, "3"),
                "4:",
                $end,
                src = in(reg) $src,
                dst = in(reg) $dst,
                s = in(reg) $s,
                d = in(reg) $d,
                inout("rax") $i => _,
                rem = in(reg) $rem,
                clobber_abi("C"),
                options(nostack),
            )
        };
    }

    /// The operands of [`copy_bulk`] for a copy of `len` > 4 vectors of `VEC` bytes:
    /// `(s, d, i, rem)`.
    #[inline(always)]
    fn bulk_operands<const VEC: usize>(src: *const u8, dst: *mut u8, len: usize) -> (usize, usize, usize, usize) {
        let skip = (dst as usize).wrapping_neg() & (VEC - 1);
        let n = len - skip;
        let bulk = n & !(4 * VEC - 1);
        let (s, d) = (src as usize + skip + bulk, dst as usize + skip + bulk);
        (s, d, bulk.wrapping_neg(), n - bulk)
    }

    /// # Safety
    /// As [`super::copy`], with `len > 32`; the CPU has AVX2.
    unsafe fn copy_avx2(src: *const u8, dst: *mut u8, len: usize) {
        if len <= 64 {
            // SAFETY: 32 < len <= 64: both 32-byte accesses at each end are in range (caller).
            unsafe {
                asm!(
                    "vmovdqu ymm0, [{s}]",
                    "vmovdqu ymm1, [{s} + {n} - 32]",
                    "vmovdqu [{d}], ymm0",
                    "vmovdqu [{d} + {n} - 32], ymm1",
                    "vzeroupper",
                    s = in(reg) src, d = in(reg) dst, n = in(reg) len,
                    clobber_abi("C"),
                    options(nostack, preserves_flags),
                );
            }
        } else if len <= 128 {
            // SAFETY: 64 < len <= 128: the two 32-byte accesses at each end are in range.
            unsafe {
                asm!(
                    "vmovdqu ymm0, [{s}]",
                    "vmovdqu ymm1, [{s} + 32]",
                    "vmovdqu ymm2, [{s} + {n} - 64]",
                    "vmovdqu ymm3, [{s} + {n} - 32]",
                    "vmovdqu [{d}], ymm0",
                    "vmovdqu [{d} + 32], ymm1",
                    "vmovdqu [{d} + {n} - 64], ymm2",
                    "vmovdqu [{d} + {n} - 32], ymm3",
                    "vzeroupper",
                    s = in(reg) src, d = in(reg) dst, n = in(reg) len,
                    clobber_abi("C"),
                    options(nostack, preserves_flags),
                );
            }
        } else {
            let (s, d, i, rem) = bulk_operands::<32>(src, dst, len);
            if len >= NT_THRESHOLD {
                // SAFETY: 128 < len: the first vector, the blocks [s - bulk, s) ->
                // [d - bulk, d) and the last 128 bytes all lie in the caller's ranges; d is
                // 32-aligned as vmovntdq requires; sfence orders the streaming stores before
                // anything this thread does next (e.g. completing the event that publishes
                // them).
                unsafe {
                    copy_bulk! {
                        "vmovdqu", "vmovntdq", "ymm", "32", "64", "96", "128", "sfence\nvzeroupper",
                        src, dst, s, d, i, rem
                    }
                };
            } else {
                // SAFETY: as above, with temporal stores; d is 32-aligned (vmovdqa).
                unsafe {
                    copy_bulk! {
                        "vmovdqu", "vmovdqa", "ymm", "32", "64", "96", "128", "vzeroupper",
                        src, dst, s, d, i, rem
                    }
                };
            }
        }
    }

    /// # Safety
    /// As [`super::copy`], with `len > 32`.
    unsafe fn copy_sse2(src: *const u8, dst: *mut u8, len: usize) {
        if len <= 64 {
            // SAFETY: 32 < len <= 64: the two 16-byte accesses at each end are in range.
            unsafe {
                asm!(
                    "movdqu {a}, [{s}]",
                    "movdqu {b}, [{s} + 16]",
                    "movdqu {c}, [{s} + {n} - 32]",
                    "movdqu {e}, [{s} + {n} - 16]",
                    "movdqu [{d}], {a}",
                    "movdqu [{d} + 16], {b}",
                    "movdqu [{d} + {n} - 32], {c}",
                    "movdqu [{d} + {n} - 16], {e}",
                    s = in(reg) src, d = in(reg) dst, n = in(reg) len,
                    a = out(xmm_reg) _, b = out(xmm_reg) _, c = out(xmm_reg) _, e = out(xmm_reg) _,
                    options(nostack, preserves_flags),
                );
            }
        } else {
            let (s, d, i, rem) = bulk_operands::<16>(src, dst, len);
            if len >= NT_THRESHOLD {
                // SAFETY: 64 < len: the first vector, the blocks [s - bulk, s) ->
                // [d - bulk, d) and the last 64 bytes all lie in the caller's ranges; d is
                // 16-aligned as movntdq requires; sfence as in `copy_avx2`.
                unsafe {
                    copy_bulk! {
                        "movdqu", "movntdq", "xmm", "16", "32", "48", "64", "sfence",
                        src, dst, s, d, i, rem
                    }
                };
            } else {
                // SAFETY: as above, with temporal stores; d is 16-aligned (movdqa).
                unsafe {
                    copy_bulk! {
                        "movdqu", "movdqa", "xmm", "16", "32", "48", "64", "",
                        src, dst, s, d, i, rem
                    }
                };
            }
        }
    }

    /// Sets `len` bytes at `dst` to `byte` with the kernel `k`.
    ///
    /// # Safety
    /// As [`super::fill`]; the CPU must have what `k` uses.
    #[inline]
    pub(super) unsafe fn fill(k: Kernel, dst: *mut u8, len: usize, byte: u8) {
        let w = u64::from_ne_bytes([byte; 8]);
        if len <= 32 {
            // SAFETY: the caller's contract.
            unsafe { fill_upto_32(dst, len, w) }
        } else if (REP_THRESHOLD..NT_THRESHOLD).contains(&len) && k.rep() {
            // SAFETY: the caller's contract; the CPU has ERMS and `k.isa()` (caller).
            unsafe { fill_rep(k.isa(), dst, len, byte) }
        } else if k.isa() == Isa::Avx2 {
            // SAFETY: the caller's contract; the CPU has AVX2 (caller).
            unsafe { fill_avx2(dst, len, w) }
        } else {
            // SAFETY: the caller's contract.
            unsafe { fill_sse2(dst, len, w) }
        }
    }

    /// As [`copy_rep`], with `rep stosb`.
    ///
    /// # Safety
    /// As [`super::fill`], with `len >= 64`; the CPU has ERMS and `isa`.
    unsafe fn fill_rep(isa: Isa, dst: *mut u8, len: usize, byte: u8) {
        // SAFETY: 64 <= len: the first 64 bytes are in range (caller).
        unsafe { fill(Kernel::new(isa, false), dst, 64, byte) };
        let skip = (dst as usize).wrapping_neg() & 63;
        // SAFETY: [skip, len) is in range (caller); rep stosb stores al to rcx bytes from rdi
        // forwards (the direction flag is clear, as the ABI guarantees).
        unsafe {
            asm!(
                "rep stosb",
                inout("rdi") dst.wrapping_add(skip) => _,
                inout("rcx") len - skip => _,
                in("al") byte,
                options(nostack, preserves_flags),
            );
        }
    }

    /// Fills up to 32 bytes with bytes of `w` (all equal): two overlapping stores, one at each
    /// end of the range.
    ///
    /// # Safety
    /// As [`super::fill`], with `len <= 32`.
    #[inline]
    unsafe fn fill_upto_32(dst: *mut u8, len: usize, w: u64) {
        if len >= 16 {
            // SAFETY: [dst, dst + len) writable (caller) and 16 <= len: both 16-byte stores at
            // each end lie inside.
            unsafe {
                asm!(
                    "movq {a}, {w}",
                    "punpcklqdq {a}, {a}",
                    "movdqu [{d}], {a}",
                    "movdqu [{d} + {n} - 16], {a}",
                    d = in(reg) dst, n = in(reg) len, w = in(reg) w,
                    a = out(xmm_reg) _,
                    options(nostack, preserves_flags),
                );
            }
        } else if len >= 8 {
            // SAFETY: as above, with 8-byte stores and 8 <= len.
            unsafe {
                asm!(
                    "mov [{d}], {w}",
                    "mov [{d} + {n} - 8], {w}",
                    d = in(reg) dst, n = in(reg) len, w = in(reg) w,
                    options(nostack, preserves_flags),
                );
            }
        } else if len >= 4 {
            // SAFETY: as above, with 4-byte stores and 4 <= len.
            unsafe {
                asm!(
                    "mov [{d}], {w:e}",
                    "mov [{d} + {n} - 4], {w:e}",
                    d = in(reg) dst, n = in(reg) len, w = in(reg) w,
                    options(nostack, preserves_flags),
                );
            }
        } else if len >= 2 {
            // SAFETY: as above, with 2-byte stores and 2 <= len.
            unsafe {
                asm!(
                    "mov word ptr [{d}], {w:x}",
                    "mov word ptr [{d} + {n} - 2], {w:x}",
                    d = in(reg) dst, n = in(reg) len, w = in(reg) w,
                    options(nostack, preserves_flags),
                );
            }
        } else if len == 1 {
            // SAFETY: one byte, in range (caller).
            unsafe {
                asm!(
                    "mov byte ptr [{d}], {w:l}",
                    d = in(reg) dst, w = in(reg) w,
                    options(nostack, preserves_flags),
                );
            }
        }
    }

    /// [`copy_bulk`] for a fill: `$splat` puts the byte pattern `{w}` in every lane of
    /// vector register 0, which every store then writes.
    macro_rules! fill_bulk {
        ($movu:literal, $store:literal, $reg:literal, $o1:literal, $o2:literal, $o3:literal,
         $block:literal, $splat:literal, $end:literal, $dst:expr, $d:expr, $i:expr, $rem:expr, $w:expr) => {
            asm!(
                $splat,
                concat!($movu, " [{dst}], ", $reg, "0"),
                "test rax, rax",
                "jz 3f",
                "2:",
                concat!($store, " [{d} + rax], ", $reg, "0"),
                concat!($store, " [{d} + rax + ", $o1, "], ", $reg, "0"),
                concat!($store, " [{d} + rax + ", $o2, "], ", $reg, "0"),
                concat!($store, " [{d} + rax + ", $o3, "], ", $reg, "0"),
                concat!("add rax, ", $block),
                "jnz 2b",
                "3:",
                "test {rem}, {rem}",
                "jz 4f",
                concat!($movu, " [{d} + {rem} - ", $block, "], ", $reg, "0"),
                concat!($movu, " [{d} + {rem} - ", $block, " + ", $o1, "], ", $reg, "0"),
                concat!($movu, " [{d} + {rem} - ", $block, " + ", $o2, "], ", $reg, "0"),
                concat!($movu, " [{d} + {rem} - ", $block, " + ", $o3, "], ", $reg, "0"),
                "4:",
                $end,
                dst = in(reg) $dst,
                d = in(reg) $d,
                inout("rax") $i => _,
                rem = in(reg) $rem,
                w = in(reg) $w,
                clobber_abi("C"),
                options(nostack),
            )
        };
    }

    /// # Safety
    /// As [`super::fill`], with `len > 32`; the CPU has AVX2.
    unsafe fn fill_avx2(dst: *mut u8, len: usize, w: u64) {
        if len <= 128 {
            // SAFETY: 32 < len <= 128: the 32-byte stores at [0, 32), [32, 64) (when
            // len > 64), [len - 64, len - 32) (idem) and [len - 32, len) are in range (caller).
            unsafe {
                asm!(
                    "vmovq xmm0, {w}",
                    "vpbroadcastq ymm0, xmm0",
                    "vmovdqu [{d}], ymm0",
                    "vmovdqu [{d} + {n} - 32], ymm0",
                    "cmp {n}, 64",
                    "jbe 2f",
                    "vmovdqu [{d} + 32], ymm0",
                    "vmovdqu [{d} + {n} - 64], ymm0",
                    "2:",
                    "vzeroupper",
                    d = in(reg) dst, n = in(reg) len, w = in(reg) w,
                    clobber_abi("C"),
                    options(nostack),
                );
            }
        } else {
            // `bulk_operands` reads nothing at its source; any address does.
            let (_, d, i, rem) = bulk_operands::<32>(dst, dst, len);
            if len >= NT_THRESHOLD {
                // SAFETY: 128 < len: the first vector, the blocks [d - bulk, d) and the last
                // 128 bytes lie in the caller's range; d is 32-aligned (vmovntdq); sfence as
                // in `copy_avx2`.
                unsafe {
                    fill_bulk! {
                        "vmovdqu", "vmovntdq", "ymm", "32", "64", "96", "128",
                        "vmovq xmm0, {w}\nvpbroadcastq ymm0, xmm0",
                        "sfence\nvzeroupper", dst, d, i, rem, w
                    }
                };
            } else {
                // SAFETY: as above, with temporal stores; d is 32-aligned (vmovdqa).
                unsafe {
                    fill_bulk! {
                        "vmovdqu", "vmovdqa", "ymm", "32", "64", "96", "128",
                        "vmovq xmm0, {w}\nvpbroadcastq ymm0, xmm0",
                        "vzeroupper", dst, d, i, rem, w
                    }
                };
            }
        }
    }

    /// # Safety
    /// As [`super::fill`], with `len > 32`.
    unsafe fn fill_sse2(dst: *mut u8, len: usize, w: u64) {
        if len <= 64 {
            // SAFETY: 32 < len <= 64: the two 16-byte stores at each end are in range.
            unsafe {
                asm!(
                    "movq {a}, {w}",
                    "punpcklqdq {a}, {a}",
                    "movdqu [{d}], {a}",
                    "movdqu [{d} + 16], {a}",
                    "movdqu [{d} + {n} - 32], {a}",
                    "movdqu [{d} + {n} - 16], {a}",
                    d = in(reg) dst, n = in(reg) len, w = in(reg) w,
                    a = out(xmm_reg) _,
                    options(nostack, preserves_flags),
                );
            }
        } else {
            let (_, d, i, rem) = bulk_operands::<16>(dst, dst, len);
            if len >= NT_THRESHOLD {
                // SAFETY: 64 < len: the first vector, the blocks [d - bulk, d) and the last
                // 64 bytes lie in the caller's range; d is 16-aligned (movntdq); sfence as in
                // `copy_avx2`.
                unsafe {
                    fill_bulk! {
                        "movdqu", "movntdq", "xmm", "16", "32", "48", "64",
                        "movq xmm0, {w}\npunpcklqdq xmm0, xmm0",
                        "sfence", dst, d, i, rem, w
                    }
                };
            } else {
                // SAFETY: as above, with temporal stores; d is 16-aligned (movdqa).
                unsafe {
                    fill_bulk! {
                        "movdqu", "movdqa", "xmm", "16", "32", "48", "64",
                        "movq xmm0, {w}\npunpcklqdq xmm0, xmm0",
                        "", dst, d, i, rem, w
                    }
                };
            }
        }
    }
}

/// The portable kernel: relaxed word atomics where both sides are 8-aligned, byte atomics
/// otherwise. Used off x86-64 and under Miri; on x86-64 the tests run it too.
#[cfg_attr(all(target_arch = "x86_64", not(miri), not(test)), allow(dead_code))]
mod portable {
    use std::sync::atomic::{AtomicU8, AtomicU64, Ordering::Relaxed};

    /// # Safety
    /// As [`super::copy`] (with `SHARED_SRC`) or [`super::copy_from_private`].
    pub(super) unsafe fn copy<const SHARED_SRC: bool>(src: *const u8, dst: *mut u8, len: usize) {
        // Align the destination to 8 bytes with byte copies; then words if the source is
        // aligned as well.
        let head = dst.align_offset(8).min(len);
        // SAFETY: in range (caller).
        unsafe { copy_bytes::<SHARED_SRC>(src, dst, head) };
        // SAFETY: in range (caller).
        unsafe { copy_words_then_bytes::<SHARED_SRC>(src.wrapping_add(head), dst.wrapping_add(head), len - head) };
    }

    /// # Safety
    /// As [`super::fill`].
    pub(super) unsafe fn fill(dst: *mut u8, len: usize, byte: u8) {
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

    /// Word copies where both sides are 8-aligned, bytes otherwise.
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An implementation under test: the entry points (which dispatch), and each x86 kernel
    /// called directly, so that the SSE2 body and the vector bodies at `rep movsb` sizes are
    /// covered on an AVX2 and ERMS machine too.
    #[derive(Clone, Copy, Debug)]
    enum Path {
        Entry,
        Portable,
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        X86(x86::Kernel),
    }

    fn paths() -> Vec<Path> {
        if cfg!(miri) {
            // The entry points run the portable body.
            return vec![Path::Entry];
        }
        #[allow(unused_mut)]
        let mut v = vec![Path::Entry, Path::Portable];
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        {
            use x86::{Isa, Kernel};
            let avx2 = std::arch::is_x86_feature_detected!("avx2");
            let erms = std::arch::is_x86_feature_detected!("ermsb");
            let best = Kernel::new(if avx2 { Isa::Avx2 } else { Isa::Sse2 }, erms);
            assert_eq!(x86::kernel(), best, "the entry points must use what the CPU has");
            for isa in [Isa::Sse2, Isa::Avx2] {
                for rep in [false, true] {
                    if (isa == Isa::Avx2 && !avx2) || (rep && !erms) {
                        eprintln!("skipping {isa:?} with rep {rep}: this CPU has no AVX2 or no ERMS");
                    } else {
                        v.push(Path::X86(Kernel::new(isa, rep)));
                    }
                }
            }
        }
        v
    }

    /// Copies through `path`, from a shared (`shared`) or a private source.
    ///
    /// # Safety
    /// As [`copy`]; with `!shared`, nobody may write the source during the call.
    unsafe fn copy_via(path: Path, shared: bool, src: *const u8, dst: *mut u8, len: usize) {
        match (path, shared) {
            // SAFETY: the caller's contract (for all arms).
            (Path::Entry, true) => unsafe { copy(src, dst, len) },
            (Path::Entry, false) => {
                // SAFETY: [src, src + len) is readable and nobody writes it during the call.
                let src = unsafe { std::slice::from_raw_parts(src, len) };
                // SAFETY: as above.
                unsafe { copy_from_private(src, dst) }
            }
            // SAFETY: as above.
            (Path::Portable, true) => unsafe { portable::copy::<true>(src, dst, len) },
            // SAFETY: as above.
            (Path::Portable, false) => unsafe { portable::copy::<false>(src, dst, len) },
            // SAFETY: as above; `paths` lists only kernels this CPU can run.
            #[cfg(all(target_arch = "x86_64", not(miri)))]
            (Path::X86(k), _) => unsafe { x86::copy(k, src, dst, len) },
        }
    }

    /// # Safety
    /// As [`fill`].
    unsafe fn fill_via(path: Path, dst: *mut u8, len: usize, byte: u8) {
        match path {
            // SAFETY: the caller's contract (for all arms).
            Path::Entry => unsafe { fill(dst, len, byte) },
            // SAFETY: as above.
            Path::Portable => unsafe { portable::fill(dst, len, byte) },
            // SAFETY: as above; `paths` lists only kernels this CPU can run.
            #[cfg(all(target_arch = "x86_64", not(miri)))]
            Path::X86(k) => unsafe { x86::fill(k, dst, len, byte) },
        }
    }

    /// `n` bytes with no short period (xorshift), so a misplaced byte shows.
    fn pattern(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    const GUARD: u8 = 0xcc;

    /// Copies `len` bytes from `a[soff..]` to `b[doff..]` through `path` (both sources), then
    /// fills them, checking the result and that nothing outside was written.
    fn check(path: Path, a: &mut [u8], b: &mut [u8], soff: usize, doff: usize, len: usize) {
        for shared in [true, false] {
            b.fill(GUARD);
            // SAFETY: both ranges lie inside their own vectors (the caller sizes them), which
            // only this test uses; the source pointer comes from `as_mut_ptr`, since a shared
            // source is loaded with atomics, which need write permission.
            unsafe { copy_via(path, shared, a[soff..].as_mut_ptr(), b[doff..].as_mut_ptr(), len) };
            let what = format!("{path:?} shared {shared} soff {soff} doff {doff} len {len}");
            assert!(b[doff..doff + len] == a[soff..soff + len], "{what}: wrong bytes");
            assert!(b[..doff].iter().all(|&x| x == GUARD), "{what}: wrote before the start");
            assert!(b[doff + len..].iter().all(|&x| x == GUARD), "{what}: wrote past the end");
        }
        // SAFETY: as above.
        unsafe { fill_via(path, b[doff..].as_mut_ptr(), len, 0x5a) };
        let what = format!("fill {path:?} doff {doff} len {len}");
        assert!(b[doff..doff + len].iter().all(|&x| x == 0x5a), "{what}: wrong bytes");
        assert!(b[..doff].iter().all(|&x| x == GUARD), "{what}: wrote before the start");
        assert!(b[doff + len..].iter().all(|&x| x == GUARD), "{what}: wrote past the end");
    }

    /// Every source and destination offset modulo 32 (the widest vector), every length up to
    /// 300 (the edge cases at 1, 2, 4, 8, 16, 32, 64 and 128 bytes, and blocks with every
    /// remainder), and longer lengths around block and page multiples and the `rep movsb`
    /// threshold at every destination offset modulo 64 (its alignment); on every path.
    #[test]
    fn copies_and_fills_are_exact_at_every_alignment_and_length() {
        // Under Miri (the portable body only, through the entry points): the word and byte
        // edges, at every source offset modulo 8 and two destination offsets.
        let (soffs, doffs, short) = if cfg!(miri) { (0..8, vec![0, 3], 17) } else { (0..32, (0..32).collect(), 300) };
        #[allow(unused_mut)]
        let mut long =
            if cfg!(miri) { vec![] } else { vec![511, 512, 513, 1000, 4095, 4096, 4097, 8191, 20_001, 65_600] };
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        long.extend([x86::REP_THRESHOLD - 1, x86::REP_THRESHOLD, x86::REP_THRESHOLD + 1]);
        let max = long.iter().copied().max().unwrap_or(short);
        let mut a = pattern(max + 64, 7);
        let mut b = vec![0u8; max + 64 + 48];
        for path in paths() {
            for soff in soffs.clone() {
                for &doff in &doffs {
                    for len in 0..=short {
                        check(path, &mut a, &mut b[..len + doff + 48], soff, doff, len);
                    }
                }
            }
            for soff in [0, 1, 13, 32] {
                for doff in 0..64 {
                    for &len in &long {
                        check(path, &mut a, &mut b[..len + doff + 48], soff, doff, len);
                    }
                }
            }
        }
    }

    /// From [`NT_THRESHOLD`] up the blocks are stored non-temporally; the edges are not.
    #[test]
    #[cfg_attr(miri, ignore = "4 MiB under Miri is minutes")]
    fn large_copies_take_the_streaming_path_exactly() {
        let mut a = pattern(NT_THRESHOLD + 4096 + 64, 11);
        let mut b = vec![0u8; NT_THRESHOLD + 4096 + 64];
        for path in paths() {
            for (soff, doff, len) in [
                (0, 0, NT_THRESHOLD),
                (5, 1, NT_THRESHOLD + 4096 + 3),
                (0, 17, NT_THRESHOLD + 100),
                (3, 32, NT_THRESHOLD + 31),
            ] {
                check(path, &mut a, &mut b[..len + doff + 16], soff, doff, len);
            }
        }
    }

    /// A source behind a shared reference (here a `static`, in read-only memory) is read with
    /// plain loads: an atomic on it is undefined behaviour (`Atomic*::from_ptr` needs
    /// writable memory), which Miri reported for `Mapping::write(&[1, 2, 3, 4])` before the
    /// private-source path existed (run under Miri by tests/miri/run). The assembly bodies
    /// read it with the same loads as any source (on x86-64 the page is mapped read-only, so
    /// a store or a locked access would fault).
    #[test]
    fn a_read_only_private_source_is_copied_with_plain_loads() {
        static SRC: [u8; 300] = {
            let mut s = [0u8; 300];
            let mut i = 0;
            while i < 300 {
                s[i] = (i * 7 + 1) as u8;
                i += 1;
            }
            s
        };
        let lens: Vec<usize> = if cfg!(miri) { vec![0, 1, 4, 7, 8, 9, 19] } else { (0..=300).collect() };
        let mut dst = [0u8; 300 + 8];
        for path in paths() {
            for &len in &lens {
                for off in [0, 1, 5] {
                    dst.fill(0);
                    let src: &'static [u8] = &SRC[300 - len..];
                    // SAFETY: `dst` has room for `len` bytes at `off` (300 + 8 bytes); it is
                    // this test's own; `src` is read-only and nobody writes it.
                    unsafe { copy_via(path, false, src.as_ptr(), dst[off..].as_mut_ptr(), len) };
                    assert_eq!(&dst[off..off + len], src, "{path:?} len {len} off {off}");
                }
            }
        }
    }
}
