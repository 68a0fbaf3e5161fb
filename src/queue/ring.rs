//! io_uring plumbing for queues and fences. The only unsafe in the queue module's ring use
//! lives here: pushing an SQE promises the kernel that its buffers outlive the operation.
//! Every call below waits for its own CQEs before returning; where that cannot be known (the
//! ring itself failed), the error says so ([`RingError::Ring`]) and the caller must keep the
//! buffers alive for good.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use io_uring::{IoUring, opcode, squeue, types};

/// Why a ring operation did not succeed.
#[derive(Debug)]
pub(crate) enum RingError {
    /// The operation completed with this error: its buffers are no longer in use.
    Op(io::Error),
    /// The operation was never submitted: its buffers were never in use.
    NotSubmitted(String),
    /// The ring failed while the operation may still be in flight: its buffers must stay
    /// alive forever.
    Ring(io::Error),
}

impl std::fmt::Display for RingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RingError::Op(e) => write!(f, "{e}"),
            RingError::NotSubmitted(why) => write!(f, "io_uring unusable: {why}"),
            RingError::Ring(e) => write!(f, "io_uring failed with the operation in flight: {e}"),
        }
    }
}

/// A queue's ring, for the work the kernel does (the kernel engine's READ/WRITE). Work done on
/// the CPU never comes here: it is complete when it returns, and a receipt through the kernel
/// would carry no information.
///
/// A transfer pushes all its SQEs, then one `io_uring_enter` submits them and waits for all
/// their completions. Every SQE carries a unique id, so a completion can never be taken for
/// another's. The ring is used under its queue's lock by whichever thread runs the operation
/// (the executor, or a submitter running it inline), so `IORING_SETUP_SINGLE_ISSUER` (and
/// `DEFER_TASKRUN`, which needs it) do not apply; `COOP_TASKRUN` does: the submitter reaps.
pub(crate) struct Ring {
    ring: IoUring,
    /// SQEs pushed whose CQEs have not been reaped.
    in_flight: u32,
    next_id: u64,
    /// Set when the ring failed; no SQE is pushed after that.
    broken: Option<String>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("fd", &self.ring.as_raw_fd()).field("in_flight", &self.in_flight).finish()
    }
}

impl Ring {
    /// A ring of `entries` SQEs. A refusal of `io_uring_setup` says why and what to do
    /// ([`explain_setup_error`]).
    pub(crate) fn new(entries: u32) -> io::Result<Self> {
        let mut b = IoUring::builder();
        // Completions are reaped by the thread that submitted, right away: no IPIs needed.
        b.setup_coop_taskrun();
        // Kernels before 5.19 refuse COOP_TASKRUN with EINVAL: then without it.
        let ring = b.build(entries).or_else(|_| IoUring::new(entries)).map_err(explain_setup_error)?;
        Ok(Self { ring, in_flight: 0, next_id: 1, broken: None })
    }

    /// Pushes an SQE, first flushing the ring if the SQ is full.
    ///
    /// # Safety
    ///
    /// Every buffer `entry` names must stay valid until its CQE is reaped (or forever, if this
    /// or a later call reports [`RingError::Ring`]).
    unsafe fn push(&mut self, entry: &squeue::Entry) -> Result<(), RingError> {
        loop {
            if let Some(why) = &self.broken {
                return Err(RingError::NotSubmitted(why.clone()));
            }
            // SAFETY: the caller's contract.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                self.in_flight += 1;
                return Ok(());
            }
            // SQ full: hand what is queued to the kernel (without waiting: the completions
            // are reaped with the rest). Nothing of `entry` is in the ring yet, so a failure
            // here leaves its buffers unused.
            match self.ring.submit() {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if matches!(e.raw_os_error(), Some(c) if c == EAGAIN || c == EBUSY) => std::thread::yield_now(),
                Err(e) => {
                    self.broken = Some(e.to_string());
                    return Err(RingError::NotSubmitted(e.to_string()));
                }
            }
        }
    }

    /// Submits everything pushed and reaps completions until nothing is in flight; returns
    /// the results of the completions with ids in `first..first + n` (by id), `None` for one
    /// that never came. One `io_uring_enter` when the kernel completes everything at once.
    fn reap_all(&mut self, first: u64, n: usize, results: &mut [Option<i32>]) -> io::Result<()> {
        while self.in_flight > 0 {
            match self.ring.submit_and_wait(self.in_flight as usize) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                // The kernel is short of resources or of CQ room right now: reap what has
                // completed (below) and try again.
                Err(e) if matches!(e.raw_os_error(), Some(c) if c == EAGAIN || c == EBUSY) => {
                    std::thread::yield_now();
                }
                Err(e) => {
                    self.broken = Some(e.to_string());
                    return Err(e);
                }
            }
            for cqe in self.ring.completion() {
                self.in_flight -= 1;
                let id = cqe.user_data();
                if id >= first && id < first + n as u64 {
                    results[(id - first) as usize] = Some(cqe.result());
                }
            }
        }
        Ok(())
    }

    /// Runs `transfers` in order (READ or WRITE each, at most 1 GiB per SQE), as one chain of
    /// linked SQEs (`IOSQE_IO_LINK`: each starts once the one before it has completed in
    /// full; a failed or short one cancels the rest), pushed together, then submitted and
    /// awaited with one `io_uring_enter`. A short transfer continues, with the ones after it,
    /// in a further round. Returns the index and error of the first transfer that failed (the
    /// ones after it never ran), or `Ok` once all have moved every byte.
    ///
    /// # Safety
    ///
    /// Every transfer's buffer must be valid (for writes, if it is a READ) until this
    /// returns, and forever if it returns [`RingError::Ring`]; other threads may access it only
    /// under the crate's shared-memory rule (`crate::copy`).
    pub(crate) unsafe fn transfer_chain(&mut self, transfers: &[Transfer]) -> Result<(), (usize, RingError)> {
        const CHUNK: usize = 1 << 30;
        // (transfer, bytes done, bytes in this piece)
        let mut todo: Vec<(usize, usize, u32)> = Vec::new();
        for (i, t) in transfers.iter().enumerate() {
            todo.extend((0..t.len).step_by(CHUNK).map(|at| (i, at, (t.len - at).min(CHUNK) as u32)));
        }
        let mut results = Vec::new();
        while !todo.is_empty() {
            // A chain fits the SQ (a chain split over two submissions would be two chains).
            let (now, later) = todo.split_at(todo.len().min(MAX_CHAIN));
            let first = self.next_id;
            self.next_id += now.len() as u64;
            let mut pushed = 0;
            let mut refused = None;
            for (k, &(i, at, n)) in now.iter().enumerate() {
                let t = &transfers[i];
                let mut e = if t.write {
                    opcode::Write::new(t.fd, t.buf.wrapping_add(at), n).offset(t.offset + at as u64).build()
                } else {
                    opcode::Read::new(t.fd, t.buf.wrapping_add(at), n).offset(t.offset + at as u64).build()
                };
                if k + 1 < now.len() {
                    e = e.flags(squeue::Flags::IO_LINK);
                }
                // SAFETY: the caller's contract.
                match unsafe { self.push(&e.user_data(first + k as u64)) } {
                    Ok(()) => pushed += 1,
                    Err(e) => {
                        refused = Some((i, e));
                        break;
                    }
                }
            }
            results.clear();
            results.resize(pushed, None);
            // Every pushed SQE is reaped before anything is reported: their buffers are then
            // free of the kernel, whatever happened to the others.
            if let Err(e) = self.reap_all(first, pushed, &mut results) {
                return Err((now[0].0, RingError::Ring(e)));
            }
            let mut again = Vec::new();
            let mut short = false;
            for (k, (&(i, at, n), r)) in now.iter().zip(&results).enumerate() {
                let stall = if transfers[i].write { io::ErrorKind::WriteZero } else { io::ErrorKind::UnexpectedEof };
                match *r {
                    None => return Err((i, RingError::Ring(io::Error::other("completion lost")))),
                    Some(r) if r < 0 => return Err((i, RingError::Op(io::Error::from_raw_os_error(-r)))),
                    Some(0) => return Err((i, RingError::Op(io::Error::from(stall)))),
                    Some(r) if (r as u32) < n => {
                        // Short: the chain stopped here (the rest were cancelled). The rest of
                        // this piece and everything after it go in the next round, in order.
                        again.push((i, at + r as usize, n - r as u32));
                        again.extend_from_slice(&now[k + 1..]);
                        short = true;
                        break;
                    }
                    Some(_) => {}
                }
            }
            if !short {
                if let Some((i, e)) = refused {
                    // Everything pushed has completed; the ring refused the rest (it is
                    // broken): transfer `i` and those after it never ran.
                    return Err((i, e));
                }
            }
            again.extend_from_slice(later);
            todo = again;
        }
        Ok(())
    }
}

/// The longest chain submitted at once: well within the SQ (64 entries), so that a chain is
/// never split over two submissions.
const MAX_CHAIN: usize = 32;

/// One READ (into `buf`, from `fd` at `offset`) or WRITE (from `buf`) of a chain.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Transfer {
    pub(crate) write: bool,
    pub(crate) fd: types::Fd,
    pub(crate) buf: *mut u8,
    pub(crate) len: usize,
    pub(crate) offset: u64,
}

/// Why `io_uring_setup` failed, with the kernel's errno and what to do about it: the error
/// an [`io::Error`] from [`explain_setup_error`] carries (its kind and
/// [`SetupRefused::errno`] keep the kernel's answer for callers that classify errors).
#[derive(Debug)]
pub(crate) struct SetupRefused {
    /// The kernel's answer.
    pub(crate) errno: io::Error,
    /// What it means here, and what to do.
    pub(crate) hint: String,
}

impl std::fmt::Display for SetupRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.errno, self.hint)
    }
}

impl std::error::Error for SetupRefused {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.errno)
    }
}

/// Turns an `io_uring_setup` failure into one that names the likely cause on this machine and
/// what to do: the locked-memory limit (rings are locked memory, charged to RLIMIT_MEMLOCK on
/// kernels before 5.12 and for unprivileged users), the open-file limit (a ring is an fd),
/// `kernel.io_uring_disabled`, a seccomp filter, or a kernel without io_uring. The result
/// keeps the original error's kind.
pub(crate) fn explain_setup_error(e: io::Error) -> io::Error {
    use rustix::process::{Resource, getrlimit};
    let limit = |r: Resource, unit: &str| {
        let l = getrlimit(r);
        let show = |v: Option<u64>| v.map_or("unlimited".to_owned(), |v| format!("{v}{unit}"));
        format!("soft {}, hard {}", show(l.current), show(l.maximum))
    };
    let disabled = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled").ok();
    let sysctl = match disabled.as_deref().map(str::trim) {
        Some("0") | None => None,
        Some(v) => Some(format!(
            "kernel.io_uring_disabled is {v} here (1: only CAP_SYS_ADMIN or members of kernel.io_uring_group may use \
             io_uring; 2: no one may): set it to 0 (`sysctl kernel.io_uring_disabled=0`)"
        )),
    };
    let code = e.raw_os_error();
    let errno = |c: rustix::io::Errno| Some(c.raw_os_error());
    let hint = if code == errno(rustix::io::Errno::NOMEM) {
        // The ring's memory is locked kernel memory mapped into this process: either limit may
        // be the one hit.
        let address_space = match getrlimit(Resource::As).current {
            Some(_) => format!(
                "; this process's address space is limited too (RLIMIT_AS, `ulimit -v`; {}) and the ring's \
                 mappings may not fit: raise it",
                limit(Resource::As, " bytes")
            ),
            None => String::new(),
        };
        format!(
            "the ring's memory could not be allocated and locked: io_uring rings are locked memory, charged to \
             RLIMIT_MEMLOCK (`ulimit -l`; {}) on kernels before 5.12 and for unprivileged users, to the memory \
             cgroup after; raise the limit (`ulimit -l unlimited`, LimitMEMLOCK= for a systemd service, `memlock` \
             in /etc/security/limits.conf, `--ulimit memlock=-1` for docker) or free memory{address_space}",
            limit(Resource::Memlock, " bytes")
        )
    } else if code == errno(rustix::io::Errno::MFILE) {
        format!(
            "too many open files: a ring is an fd and this process is at its RLIMIT_NOFILE ({}); raise it \
             (`ulimit -n`) or close fds",
            limit(Resource::Nofile, "")
        )
    } else if code == errno(rustix::io::Errno::NFILE) {
        "too many open files in the system (fs.file-max): close fds or raise fs.file-max".to_owned()
    } else if code == errno(rustix::io::Errno::PERM) || code == errno(rustix::io::Errno::ACCESS) {
        sysctl.unwrap_or_else(|| {
            "io_uring is not permitted to this process: a seccomp filter refuses io_uring_setup (docker's and \
             podman's default profiles do, as can systemd's SystemCallFilter=), or an LSM policy denies it; allow \
             the io_uring_setup, io_uring_enter and io_uring_register system calls"
                .to_owned()
        })
    } else if code == errno(rustix::io::Errno::NOSYS) {
        "this kernel has no io_uring (built without CONFIG_IO_URING, or older than 5.1), or a seccomp filter \
         answers io_uring_setup with ENOSYS (docker's default profile does); allow the io_uring system calls or \
         use a kernel with io_uring"
            .to_owned()
    } else {
        match sysctl {
            Some(s) => s,
            None => "the kernel refused to create an io_uring instance".to_owned(),
        }
    };
    io::Error::new(e.kind(), SetupRefused { errno: e, hint })
}

const EAGAIN: i32 = rustix::io::Errno::AGAIN.raw_os_error();
const EBUSY: i32 = rustix::io::Errno::BUSY.raw_os_error();

/// The fence watcher's ring: one-shot `POLL_ADD`s on fds it owns until their completion is
/// reaped, each tagged with an id, plus a wake-up eventfd it owns and re-arms. Used by one
/// thread only.
pub(crate) struct PollRing {
    ring: IoUring,
    /// fds with a poll in flight, by id; closed only after their CQE is reaped.
    armed: HashMap<u64, OwnedFd>,
    wake: OwnedFd,
}

/// The id completions of the wake-up eventfd carry.
pub(crate) const WAKE: u64 = 0;
/// The id completions of poll removals carry.
pub(crate) const CANCEL: u64 = u64::MAX;

impl PollRing {
    pub(crate) fn new(entries: u32, wake: OwnedFd) -> io::Result<Self> {
        let ring = IoUring::new(entries).map_err(explain_setup_error)?;
        let mut r = Self { ring, armed: HashMap::new(), wake };
        r.arm_wake()?;
        Ok(r)
    }

    /// # Safety
    ///
    /// `fd` must stay open until the poll's CQE is reaped (it is owned by `armed` or is `wake`).
    unsafe fn push(&mut self, fd: RawFd, id: u64) -> io::Result<()> {
        let e = opcode::PollAdd::new(types::Fd(fd), rustix::event::PollFlags::IN.bits() as u32).build().user_data(id);
        loop {
            // SAFETY: a poll names no buffer; the fd outlives it (caller).
            match unsafe { self.ring.submission().push(&e) } {
                Ok(()) => return Ok(()),
                Err(_) => {
                    // SQ full: hand what is queued to the kernel, then retry.
                    self.ring.submit()?;
                }
            }
        }
    }

    /// Re-arms the wake-up poll.
    pub(crate) fn arm_wake(&mut self) -> io::Result<()> {
        let raw = self.wake.as_raw_fd();
        // SAFETY: the eventfd is owned by `self` and so outlives every poll on it.
        unsafe { self.push(raw, WAKE) }
    }

    /// Drains the wake-up eventfd.
    pub(crate) fn drain_wake(&self) {
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&self.wake, &mut buf);
    }

    /// Arms a one-shot poll for readability of `fd`, reported with `id`; the ring keeps the
    /// fd open until then.
    pub(crate) fn poll_in(&mut self, fd: OwnedFd, id: u64) -> io::Result<()> {
        // SAFETY: `fd` moves into `armed` right below and stays there until its CQE is reaped
        // by `wait`; nothing reaps between here and the insert.
        unsafe { self.push(fd.as_raw_fd(), id) }?;
        self.armed.insert(id, fd);
        Ok(())
    }

    /// Cancels the poll reported with `id` (`POLL_REMOVE`): its own completion then comes with
    /// `-ECANCELED` (and its fd), the removal's with the id [`CANCEL`].
    pub(crate) fn cancel(&mut self, id: u64) -> io::Result<()> {
        let e = opcode::PollRemove::new(id).build().user_data(CANCEL);
        loop {
            // SAFETY: a poll removal names no buffer and no fd.
            match unsafe { self.ring.submission().push(&e) } {
                Ok(()) => return Ok(()),
                Err(_) => {
                    self.ring.submit()?;
                }
            }
        }
    }

    /// Submits what is queued, waits for at least one completion, and returns every
    /// completion as `(id, result, fd)`.
    pub(crate) fn wait(&mut self) -> io::Result<Vec<(u64, i32, Option<OwnedFd>)>> {
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        let done: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
        Ok(done.into_iter().map(|(id, r)| (id, r, self.armed.remove(&id))).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setup_errors_name_their_cause() {
        use rustix::io::Errno;
        for (errno, words) in [
            (Errno::NOMEM, &["RLIMIT_MEMLOCK", "ulimit -l"][..]),
            (Errno::MFILE, &["too many open files", "RLIMIT_NOFILE", "ulimit -n"]),
            (Errno::NOSYS, &["no io_uring", "seccomp"]),
        ] {
            let e = explain_setup_error(io::Error::from_raw_os_error(errno.raw_os_error()));
            let text = e.to_string();
            for w in words {
                assert!(text.contains(w), "{errno:?}: `{text}` does not mention `{w}`");
            }
            assert_eq!(e.kind(), io::Error::from_raw_os_error(errno.raw_os_error()).kind());
            let inner = e.get_ref().and_then(|i| i.downcast_ref::<SetupRefused>()).expect("a SetupRefused");
            assert_eq!(inner.errno.raw_os_error(), Some(errno.raw_os_error()));
        }
        // EPERM: the sysctl when it is set, else seccomp or an LSM.
        let text = explain_setup_error(io::Error::from_raw_os_error(Errno::PERM.raw_os_error())).to_string();
        assert!(text.contains("io_uring_disabled") || text.contains("seccomp"), "{text}");
    }
}
