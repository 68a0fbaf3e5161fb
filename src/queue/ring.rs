//! io_uring plumbing for queues and fences. The only unsafe in the queue module lives here:
//! pushing an SQE promises the kernel that its buffers outlive the operation, which holds
//! because every call below waits for its own CQE before returning.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use io_uring::{IoUring, opcode, squeue, types};

/// A queue's ring: every operation's completion arrives here as a CQE.
///
/// Work done on the CPU posts a NOP whose submission is deferred: it rides along with the
/// next operation that must reach the kernel anyway (an event record, a kernel copy, a full
/// SQ), so a run of small copies costs one `io_uring_enter`, not one each.
pub(crate) struct Ring {
    ring: IoUring,
    /// SQEs pushed whose CQEs have not been reaped.
    in_flight: u32,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("fd", &self.ring.as_raw_fd()).field("in_flight", &self.in_flight).finish()
    }
}

/// user_data of the one operation a caller is waiting for.
const AWAITED: u64 = 1;
/// user_data of deferred CPU-completion NOPs.
const DEFERRED: u64 = 2;

impl Ring {
    pub(crate) fn new(entries: u32) -> io::Result<Self> {
        let mut b = IoUring::builder();
        // Completions are reaped by the thread that submitted, right away: no IPIs needed.
        b.setup_coop_taskrun();
        let ring = b.build(entries).or_else(|_| IoUring::new(entries))?;
        Ok(Self { ring, in_flight: 0 })
    }

    /// Pushes an SQE, first flushing the ring if the SQ is full.
    ///
    /// # Safety
    ///
    /// Every buffer `entry` names must stay valid until its CQE is reaped.
    unsafe fn push(&mut self, entry: &squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: the caller's contract.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                self.in_flight += 1;
                return Ok(());
            }
            self.reap_until(None)?;
        }
    }

    /// Submits everything pushed and reaps completions until the awaited one arrives (or, with
    /// `None`, until nothing is in flight). Returns the awaited CQE's result.
    fn reap_until(&mut self, awaited: Option<u64>) -> io::Result<Option<i32>> {
        loop {
            if self.in_flight == 0 {
                return Ok(None);
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            let mut found = None;
            for cqe in self.ring.completion() {
                self.in_flight -= 1;
                if Some(cqe.user_data()) == awaited {
                    found = Some(cqe.result());
                }
            }
            if found.is_some() {
                return Ok(found);
            }
        }
    }

    /// Submits `entry` (with everything deferred before it) and waits for its CQE; returns
    /// the CQE's result (>= 0) or its errno.
    ///
    /// # Safety
    ///
    /// Every buffer `entry` names must stay valid until this returns (it returns only after
    /// the CQE, so stack or borrowed buffers of the caller qualify).
    unsafe fn run(&mut self, entry: squeue::Entry) -> io::Result<u32> {
        // SAFETY: the caller guarantees the buffers outlive the operation, and we wait for it.
        unsafe { self.push(&entry.user_data(AWAITED)) }?;
        let r = self.reap_until(Some(AWAITED))?.unwrap_or(0);
        if r < 0 { Err(io::Error::from_raw_os_error(-r)) } else { Ok(r as u32) }
    }

    /// Posts a completion for work done on the CPU and waits for it (with everything deferred
    /// before it): used where the completion must be observed now (event records).
    pub(crate) fn complete_cpu(&mut self) -> io::Result<()> {
        // SAFETY: a NOP names no buffer.
        unsafe { self.run(opcode::Nop::new().build()) }.map(drop)
    }

    /// Posts a completion for work done on the CPU without entering the kernel now.
    pub(crate) fn complete_cpu_deferred(&mut self) -> io::Result<()> {
        // SAFETY: a NOP names no buffer.
        unsafe { self.push(&opcode::Nop::new().build().user_data(DEFERRED)) }
    }

    /// `pread` through the ring: reads `len` bytes of `fd` at `offset` into `buf`, looping on
    /// short reads; a read that hits end-of-file is an error.
    ///
    /// # Safety
    ///
    /// `[buf, buf + len)` must be valid for writes for the duration of the call, and accessed
    /// by other threads only under the crate's shared-memory rule (`crate::copy`).
    pub(crate) unsafe fn read(&mut self, fd: BorrowedFd<'_>, buf: *mut u8, len: usize, offset: u64) -> io::Result<()> {
        let mut done = 0usize;
        while done < len {
            let chunk = (len - done).min(1 << 30) as u32;
            let e = opcode::Read::new(types::Fd(fd.as_raw_fd()), buf.wrapping_add(done), chunk)
                .offset(offset + done as u64)
                .build();
            // SAFETY: the destination range is valid (caller) and the call waits for the CQE.
            let n = unsafe { self.run(e) }?;
            if n == 0 {
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
            }
            done += n as usize;
        }
        Ok(())
    }

    /// `pwrite` through the ring, looping on short writes.
    ///
    /// # Safety
    ///
    /// `[buf, buf + len)` must be valid for reads for the duration of the call.
    pub(crate) unsafe fn write(
        &mut self,
        fd: BorrowedFd<'_>,
        buf: *const u8,
        len: usize,
        offset: u64,
    ) -> io::Result<()> {
        let mut done = 0usize;
        while done < len {
            let chunk = (len - done).min(1 << 30) as u32;
            let e = opcode::Write::new(types::Fd(fd.as_raw_fd()), buf.wrapping_add(done), chunk)
                .offset(offset + done as u64)
                .build();
            // SAFETY: the source range is valid (caller) and the call waits for the CQE.
            let n = unsafe { self.run(e) }?;
            if n == 0 {
                return Err(io::Error::from(io::ErrorKind::WriteZero));
            }
            done += n as usize;
        }
        Ok(())
    }
}

/// The fence watcher's ring: one-shot `POLL_ADD`s on fds it owns until their completion is
/// reaped, each tagged with an id. Used by one thread only.
pub(crate) struct PollRing {
    ring: IoUring,
    /// fds with a poll in flight, by id; closed only after their CQE is reaped.
    armed: std::collections::HashMap<u64, std::os::fd::OwnedFd>,
}

impl PollRing {
    pub(crate) fn new(entries: u32) -> io::Result<Self> {
        Ok(Self { ring: IoUring::new(entries)?, armed: std::collections::HashMap::new() })
    }

    /// Arms a one-shot poll for readability of `fd`, reported with `id`; the ring keeps the
    /// fd open until then.
    pub(crate) fn poll_in(&mut self, fd: std::os::fd::OwnedFd, id: u64) -> io::Result<()> {
        let e = opcode::PollAdd::new(types::Fd(fd.as_raw_fd()), rustix::event::PollFlags::IN.bits() as u32)
            .build()
            .user_data(id);
        loop {
            // SAFETY: a poll names no buffer, and its fd is kept in `armed` until the CQE.
            match unsafe { self.ring.submission().push(&e) } {
                Ok(()) => break,
                Err(_) => {
                    // SQ full: hand what is queued to the kernel, then retry.
                    self.ring.submit()?;
                }
            }
        }
        self.armed.insert(id, fd);
        Ok(())
    }

    /// Submits what is queued, waits for at least one completion, and returns every
    /// completion as `(id, result, fd)`.
    pub(crate) fn wait(&mut self) -> io::Result<Vec<(u64, i32, Option<std::os::fd::OwnedFd>)>> {
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
