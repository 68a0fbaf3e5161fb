//! One-rule seccomp filters for the tests that refuse or count a system call in a child
//! process of their own (a filter can never be removed).
#![allow(unsafe_code)]

/// `AUDIT_ARCH_X86_64`: the filters match system call numbers of x86-64 only (elsewhere they
/// allow everything).
pub const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
/// x86-64 system call numbers.
pub const NR_IO_URING_SETUP: u32 = 425;
pub const NR_IO_URING_ENTER: u32 = 426;

/// Installs the classic-BPF program "on x86-64, system call `nr` gets `action`; everything
/// else is allowed" with `seccomp(SECCOMP_SET_MODE_FILTER, flags)`, after
/// `PR_SET_NO_NEW_PRIVS`. Returns the call's result (a listener fd with
/// `SECCOMP_FILTER_FLAG_NEW_LISTENER`); panics if it fails.
pub fn install_one_rule(nr: u32, action: u32, flags: libc::c_ulong) -> i64 {
    let ld = |k| libc::sock_filter { code: (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16, jt: 0, jf: 0, k };
    let jeq = |k, jt, jf| libc::sock_filter { code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16, jt, jf, k };
    let ret = |k| libc::sock_filter { code: (libc::BPF_RET | libc::BPF_K) as u16, jt: 0, jf: 0, k };
    let prog = [
        ld(4), // seccomp_data.arch
        jeq(AUDIT_ARCH_X86_64, 0, 3),
        ld(0), // seccomp_data.nr
        jeq(nr, 0, 1),
        ret(action),
        ret(libc::SECCOMP_RET_ALLOW),
    ];
    let fprog = libc::sock_fprog { len: prog.len() as u16, filter: prog.as_ptr().cast_mut() };
    rustix::thread::set_no_new_privs(true).expect("PR_SET_NO_NEW_PRIVS");
    // SAFETY: `fprog` points to a valid program for the duration of the call; the filter
    // only ever makes this (child) process stricter.
    let rc = unsafe {
        libc::syscall(libc::SYS_seccomp, libc::SECCOMP_SET_MODE_FILTER, flags, &fprog as *const libc::sock_fprog)
    };
    assert!(rc >= 0, "seccomp(SECCOMP_SET_MODE_FILTER, {flags:#x}): {}", std::io::Error::last_os_error());
    rc
}
