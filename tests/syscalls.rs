//! System calls counted: CPU work on queues (event records, inline and queued copies and
//! fills, waits, callbacks, synchronize, deferred frees passing their markers) makes no
//! `io_uring_enter` at all; only the kernel engine's copies reach the ring.
//!
//! The count is the kernel's: in a child process of its own, a seccomp filter traps every
//! `io_uring_enter` (on every thread: `SECCOMP_FILTER_FLAG_TSYNC`) and a SIGSYS handler counts
//! it (and fails the call with ENOSYS). A positive control, a kernel-engine copy, shows the
//! counter counts.
#![allow(unsafe_code)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::QueueGate;
use common::isolate::{is_child, isolated};
use dmabuf_rt::caching::CachingAllocator;
use dmabuf_rt::queue::{CopyEngine, HostBuffer, Mem, Queue};
use dmabuf_rt::source::{MemorySource, ShmemSource};

/// `io_uring_enter` calls trapped so far in this process.
static ENTERS: AtomicUsize = AtomicUsize::new(0);

#[cfg(target_arch = "x86_64")]
extern "C" fn on_sigsys(_sig: libc::c_int, _info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    ENTERS.fetch_add(1, Ordering::Relaxed);
    let uc = ctx.cast::<libc::ucontext_t>();
    // SAFETY: the kernel passes a valid ucontext_t to an SA_SIGINFO handler; the trapped
    // system call returns whatever its RAX holds when the handler returns.
    unsafe { (*uc).uc_mcontext.gregs[libc::REG_RAX as usize] = -(libc::ENOSYS as i64) };
}

/// Traps `io_uring_enter` on every thread of this (child) process into [`on_sigsys`].
#[cfg(target_arch = "x86_64")]
fn count_io_uring_enter() {
    const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
    const NR_IO_URING_ENTER: u32 = 426;
    // SAFETY: all-zero bytes are a valid sigaction (no handler, empty mask, no flags).
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    sa.sa_sigaction = on_sigsys as *const () as usize;
    sa.sa_flags = libc::SA_SIGINFO;
    // SAFETY: the handler is an `extern "C"` fn of the SA_SIGINFO signature that only touches
    // an atomic and the trapped call's saved registers.
    let rc = unsafe { libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut()) };
    assert_eq!(rc, 0, "sigaction(SIGSYS): {}", std::io::Error::last_os_error());
    let ld = |k| libc::sock_filter { code: (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16, jt: 0, jf: 0, k };
    let jeq = |k, jt, jf| libc::sock_filter { code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16, jt, jf, k };
    let ret = |k| libc::sock_filter { code: (libc::BPF_RET | libc::BPF_K) as u16, jt: 0, jf: 0, k };
    let prog = [
        ld(4), // seccomp_data.arch
        jeq(AUDIT_ARCH_X86_64, 0, 3),
        ld(0), // seccomp_data.nr
        jeq(NR_IO_URING_ENTER, 0, 1),
        ret(libc::SECCOMP_RET_TRAP),
        ret(libc::SECCOMP_RET_ALLOW),
    ];
    let fprog = libc::sock_fprog { len: prog.len() as u16, filter: prog.as_ptr().cast_mut() };
    rustix::thread::set_no_new_privs(true).expect("PR_SET_NO_NEW_PRIVS");
    // SAFETY: `fprog` points to a valid program for the duration of the call; TSYNC applies
    // it to every thread of this child process (the queues' executors included).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_TSYNC,
            &fprog as *const libc::sock_fprog,
        )
    };
    assert_eq!(rc, 0, "seccomp(SECCOMP_SET_MODE_FILTER): {}", std::io::Error::last_os_error());
}

const ROUNDS: usize = 2_000;

#[test]
fn cpu_work_on_queues_makes_no_io_uring_enter() {
    const NAME: &str = "cpu_work_on_queues_makes_no_io_uring_enter";
    if !cfg!(target_arch = "x86_64") {
        eprintln!("skipped: the seccomp filter here is written for x86_64 system call numbers");
        return;
    }
    if !is_child(NAME) {
        isolated(NAME, &[], Duration::from_secs(120));
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // Everything that needs io_uring_setup exists before the filter.
        let (q1, q2) = (Queue::new().unwrap(), Queue::new().unwrap());
        let kernel = Queue::builder().engine(CopyEngine::Kernel).build().unwrap();
        let a = CachingAllocator::builder(ShmemSource::new()).capacity(1 << 30).build().unwrap();
        let host = HostBuffer::new(1 << 20).unwrap();
        let seg = std::sync::Arc::new(ShmemSource::new().create_segment(1 << 20).unwrap());
        count_io_uring_enter();

        let small = |m: Mem| m.range(0, 4096).unwrap();
        let (dev, h): (Mem, Mem) = ((&seg).into(), (&host).into());
        for i in 0..ROUNDS {
            // Idle queue: inline copy, fill, record, wait, synchronize.
            q1.copy(small(dev.clone()), small(h.clone())).unwrap();
            q1.fill(small(dev.clone()), i as u8).unwrap();
            let e = q1.record().unwrap();
            assert!(e.is_complete(), "a record on an idle queue completes at once");
            q2.wait(&e).unwrap();
            // A 1 MiB copy goes to the executor thread (past the inline limit); a callback too.
            q1.copy(dev.clone(), h.clone()).unwrap();
            q1.callback(|r| r.unwrap()).unwrap();
            q1.synchronize().unwrap();
            // A deferred free whose marker waits behind a gate on q2, then passes.
            let mut b = a.allocate(64 << 10, Some(&q1)).unwrap();
            b.record_queue(&q2);
            let gate = QueueGate::close(&q2);
            drop(b);
            gate.open();
            q2.synchronize().unwrap();
            // And the raw API's.
            let p = a.allocate_raw(64 << 10, Some(&q1)).unwrap();
            a.record_queue_raw(p, &q2).unwrap();
            let gate = QueueGate::close(&q2);
            a.free_raw(p).unwrap();
            gate.open();
            q2.synchronize().unwrap();
        }
        let st = a.stats();
        assert_eq!(st.active[0].current, 0, "every deferred free completed");
        let cpu_enters = ENTERS.load(Ordering::Relaxed);
        // The positive control: the kernel engine's copy must enter the ring (and, trapped,
        // fails with ENOSYS).
        let _ = kernel.copy(dev.clone(), h.clone());
        let _ = kernel.synchronize();
        let control = ENTERS.load(Ordering::Relaxed) - cpu_enters;
        println!("io_uring_enter: {cpu_enters} for {ROUNDS} rounds of CPU work; {control} for one kernel-engine copy");
        assert_eq!(cpu_enters, 0, "CPU-only work entered io_uring");
        assert!(control >= 1, "the counter did not see the kernel engine's io_uring_enter: it counts nothing");
    }
}
