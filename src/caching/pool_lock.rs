//! The pool's lock: a mutex that is biased to the thread that keeps taking it, so that
//! thread's cheapest operations (an exact reuse from the quick cache, its free) run with no
//! atomic read-modify-write at all.
//!
//! An uncontended `std::sync::Mutex` costs two atomic read-modify-writes (the lock's
//! `cmpxchg`, the unlock's `xchg`), each a full barrier on x86: 9.5 ns a lock and unlock on
//! the machine this was measured on, two per alloc+free pair, against about 10 ns for the
//! pair's own bookkeeping. The biased lock removes them where one thread does most of the
//! work, as a framework's main thread does:
//!
//! - Every holder but one takes `mutex`. A thread that takes it [`BIAS_AFTER`] times in a row
//!   (no other thread in between) is made the **owner** (`owner` holds its token).
//! - The owner's [`PoolLock::fast`] takes no mutex: it marks its hold in its own thread's
//!   [`FastMark`] (the lock's address), and checks it is still the owner. Each thread writes
//!   only its own mark, with plain stores; the lock keeps its owner's mark (under `mutex`).
//! - Any other thread that needs the lock ([`PoolLock::lock`]) takes `mutex`, clears `owner`
//!   and calls `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`, which makes every running
//!   thread of the process pass a full memory barrier. After it, either the owner's mark is
//!   visible, and it waits until the owner clears it (with a release store: the owner's
//!   writes are then visible to it), or the owner's check comes after the barrier and sees
//!   that it is no longer the owner. This is Dekker's exclusion with the barrier paid by
//!   the rare side only (as in folly's asymmetric fences and liburcu's membarrier flavour).
//!   Each such revocation doubles the run of acquisitions the next bias needs, so threads that
//!   take turns end up with a plain mutex.
//! - [`PoolLock::try_lock`] never revokes: a free from another thread finds the lock biased
//!   and goes to the lock-free list instead, for the owner to drain.
//!
//! **Why the mark is the thread's, not the lock's.** The mark was one `busy` flag of the lock,
//! written by whichever thread was the owner. A thread that had been the owner could read
//! itself the owner in `fast`, be stopped before it set the flag, and lose the bias; another
//! thread was made the owner and entered its fast hold; the first went on, set the flag, saw
//! it was not the owner and cleared the flag, which was the new owner's mark too. The next
//! revoker found nothing to wait for and joined the new owner's hold (a block handed to two
//! owners). The debug check below (`inside`) caught it in `hostile_review24` and
//! `hostile_review25` (2 of 30 runs of review25's binary on a 2-vCPU VM, with a full fence as
//! often as with the compiler fence: Dekker's exclusion was not what failed);
//! `tests::a_former_owner_stopped_inside_fast_does_not_unmark_the_next_owners_hold` makes it
//! happen every time. A stale former owner now writes only its own mark, which no revoker of
//! the new owner reads.
//!
//! Where `membarrier`'s private expedited command is not available when a bias would be
//! granted (kernels before 4.14, a seccomp filter, Miri), no thread is ever made the owner:
//! the lock is the mutex. Where it is refused later (a seccomp filter installed after the
//! bias), a revocation falls back to a TLB shootdown (a page of ours made read-only and
//! writable again: the kernel interrupts every CPU running the process, which drains its
//! store buffer, as runtimes did before membarrier); only if that is refused too does the
//! process stop, since exclusion could no longer be guaranteed.
//!
//! The owner's fast path must not block and must not take another lock: its holder does not
//! hold `mutex`, and a revoker holding `mutex` waits for it. The callers use it only for the
//! quick cache and the arena's home blocks, which touch nothing but the pool's memory. A
//! thread never joins its own hold: `fast` refuses while the thread holds `mutex` (`holder`:
//! a memory source or logger called under the lock that drops an `Allocation` or calls the
//! allocator) or is in a fast hold already, and `lock` inside the thread's own fast hold (a
//! signal handler) panics where a plain mutex would deadlock. A thread holds at most one lock
//! fast at a time: inside one fast hold, `fast` on another lock refuses (its caller takes the
//! way it takes on any other thread).
//!
//! Under `--cfg loom` the lock is built from loom's atomics, mutex and thread-locals, with the
//! membarrier modelled as a `SeqCst` fence on each side of Dekker's pair, and
//! `loom-tests/tests/pool_lock.rs` model-checks it.

#![allow(unsafe_code)]

use std::cell::{Cell, UnsafeCell};
#[cfg(not(loom))]
use std::sync::OnceLock;
#[cfg(not(loom))]
use std::sync::atomic::compiler_fence;

// loom's primitives under `--cfg loom` (`loom-tests/tests/pool_lock.rs`), std's otherwise.
#[cfg(loom)]
use crate::sync::fence;
use crate::sync::{AtomicU64, AtomicUsize, Mutex, MutexGuard, Ordering, TryLockError};

/// Acquisitions in a row by one thread that make it the owner, at first.
#[cfg(not(loom))]
pub(crate) const BIAS_AFTER: u32 = 64;

/// The most a run of acquisitions needs to be, after revocations have doubled it.
#[cfg(not(loom))]
const BIAS_AFTER_MAX: u32 = 1 << 20;

/// Under loom, every acquisition of the mutex while no thread owns the lock makes its taker the
/// owner, and revocations do not lengthen the run: a model's few steps then go through grants
/// and revocations, not through the counting (which the unit tests check).
#[cfg(loom)]
pub(crate) const BIAS_AFTER: u32 = 1;

/// See the loom `BIAS_AFTER`.
#[cfg(loom)]
const BIAS_AFTER_MAX: u32 = 1;

/// Where a thread marks its fast hold: the address of the lock it holds by
/// [`PoolLock::fast`] now, 0 for none. Written by its thread only, with plain stores; read by
/// a revoker of a lock the thread owns. Made when the thread is first made an owner, and never
/// freed (a lock keeps its owner's mark after the thread has ended): one per thread that was
/// ever an owner, 16 bytes.
#[derive(Debug)]
struct FastMark {
    lock: AtomicUsize,
    /// Its thread's token: `fast` reads the mark alone from the thread-local.
    token: u64,
}

/// What the calling thread is to the locks: its token, and its mark once it has one.
struct ThisThread {
    token: Cell<u64>,
    mark: Cell<Option<&'static FastMark>>,
}

#[cfg(not(loom))]
thread_local! {
    // No destructor: readable while the thread's other thread-locals are destroyed (an
    // `Allocation` kept in one is dropped then).
    static THIS_THREAD: ThisThread = const { ThisThread { token: Cell::new(0), mark: Cell::new(None) } };
}

// Each of loom's threads is a coroutine on one OS thread: its thread-locals are loom's.
#[cfg(loom)]
loom::thread_local! {
    static THIS_THREAD: ThisThread = ThisThread { token: Cell::new(0), mark: Cell::new(None) };
}

/// A number naming the calling thread, never reused in the process (0 is no thread).
#[inline(always)]
fn thread_token() -> u64 {
    THIS_THREAD.with(token_of)
}

#[inline(always)]
fn token_of(t: &ThisThread) -> u64 {
    // std's atomic under loom too: a token only has to differ from every other thread's.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let v = t.token.get();
    if v != 0 {
        return v;
    }
    let v = NEXT.fetch_add(1, Ordering::Relaxed);
    t.token.set(v);
    v
}

/// The calling thread's token and its mark (`None` if it was never made an owner).
#[inline(always)]
fn this_thread() -> (u64, Option<&'static FastMark>) {
    THIS_THREAD.with(|t| (token_of(t), t.mark.get()))
}

/// The calling thread's mark (`None` if it was never made an owner).
#[inline(always)]
fn this_threads_mark_if_any() -> Option<&'static FastMark> {
    THIS_THREAD.with(|t| t.mark.get())
}

/// The calling thread's mark, made if it has none yet.
fn this_threads_mark() -> &'static FastMark {
    THIS_THREAD.with(|t| {
        t.mark.get().unwrap_or_else(|| {
            let token = token_of(t);
            let m: &'static FastMark = Box::leak(Box::new(FastMark { lock: AtomicUsize::new(0), token }));
            t.mark.set(Some(m));
            m
        })
    })
}

/// Whether `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` works in this process (registered
/// once, at the first bias).
#[cfg(not(loom))]
fn barrier_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        if cfg!(miri) {
            return false;
        }
        use rustix::thread::{MembarrierCommand, membarrier};
        membarrier(MembarrierCommand::RegisterPrivateExpedited).is_ok()
            && membarrier(MembarrierCommand::PrivateExpedited).is_ok()
    })
}

/// Makes every thread of the process that is running pass a full memory barrier:
/// `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`, or, where that is refused since the bias
/// was granted (a seccomp filter installed later), a TLB shootdown, the way runtimes did it
/// before membarrier existed: a written page made read-only makes the kernel interrupt every
/// CPU that runs the process's memory map, and an interrupt drains the CPU's store buffer.
/// False if both are refused.
#[cfg(not(loom))]
fn process_barrier() -> bool {
    use rustix::thread::{MembarrierCommand, membarrier};
    membarrier(MembarrierCommand::PrivateExpedited).is_ok() || shootdown()
}

/// loom models no `membarrier`: what the lock needs of it is the pair of full barriers of
/// Dekker's exclusion, one on each side, and a `SeqCst` fence on each side is that in the C++
/// memory model. The owner's side is in [`PoolLock::fast`]: where the barrier would land in
/// the owner's thread, before its mark's store (its check then sees 0), between the store and
/// the check, or after the check (its mark is then seen), is what a `SeqCst` fence between the
/// two gives.
#[cfg(loom)]
fn barrier_available() -> bool {
    true
}

/// The revoker's side of the pair under loom (see the loom [`barrier_available`]).
#[cfg(loom)]
fn process_barrier() -> bool {
    fence(Ordering::SeqCst); // the revoker's side of the Dekker pair
    true
}

/// The TLB shootdown of [`process_barrier`].
#[cfg(not(loom))]
fn shootdown() -> bool {
    use rustix::mm::{MapFlags, MprotectFlags, ProtFlags, mmap_anonymous, mprotect};
    /// One page for every shootdown, and a lock: a write to it while another thread holds it
    /// read-only would fault.
    static PAGE: OnceLock<Option<usize>> = OnceLock::new();
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let page = *PAGE.get_or_init(|| {
        // SAFETY: a new private anonymous mapping at an address the kernel chooses: it
        // touches no memory of anyone else. It is never unmapped.
        unsafe { mmap_anonymous(std::ptr::null_mut(), 4096, ProtFlags::READ | ProtFlags::WRITE, MapFlags::PRIVATE) }
            .ok()
            .map(|p| p as usize)
    });
    let Some(addr) = page else { return false };
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let ptr = addr as *mut u8;
    // SAFETY: `ptr` is our own page, writable here: every change of its protection is made
    // under `ONE_AT_A_TIME` and restored before it is let go.
    unsafe { ptr.write_volatile(1) };
    // SAFETY: the page is ours (above); read-only then writable again changes no one else's
    // memory.
    let downgraded = unsafe { mprotect(ptr.cast(), 4096, MprotectFlags::READ) }.is_ok();
    // SAFETY: as above.
    let restored = unsafe { mprotect(ptr.cast(), 4096, MprotectFlags::READ | MprotectFlags::WRITE) }.is_ok();
    if !restored {
        // The page stays read-only: no later shootdown may write it.
        return false;
    }
    downgraded
}

/// Who took the mutex last, how many times in a row, and how many make a bias; and the
/// owner's mark, while there is an owner.
#[derive(Debug)]
struct Streak {
    last: u64,
    count: u32,
    needed: u32,
    owner_mark: Option<&'static FastMark>,
}

/// A mutex over `T` with a bias to one thread (see the module's doc).
pub(crate) struct PoolLock<T> {
    mutex: Mutex<Streak>,
    /// The owner's token, 0 for none. Written under `mutex` only.
    owner: AtomicU64,
    /// The token of the thread holding `mutex` (0 for none): a thread's own mutex hold is
    /// never joined by a fast hold (an `Allocation` dropped by a callback the pool makes, a
    /// memory source's, under the lock).
    holder: AtomicU64,
    /// Debug builds: the mark of the guard that lives ([`PoolGuard::mark`]; 0 for none), to
    /// catch two holders at once (a failure of the exclusion above) and name them. Plain loads
    /// and stores: the check adds no barrier that could hide the reordering it looks for.
    #[cfg(debug_assertions)]
    inside: AtomicU64,
    data: UnsafeCell<T>,
}

// SAFETY: `data` is reached only through a `PoolGuard`, and at most one exists at a time: a
// mutex guard, or the owner's fast hold, which revocation excludes (see the module's doc).
// `T: Send` because the holder may be any thread.
unsafe impl<T: Send> Sync for PoolLock<T> {}
// SAFETY: as above; the lock owns its `T`.
unsafe impl<T: Send> Send for PoolLock<T> {}

impl<T> std::fmt::Debug for PoolLock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolLock").field("owner", &self.owner.load(Ordering::Relaxed)).finish_non_exhaustive()
    }
}

/// What a [`PoolGuard`] holds.
enum Hold<'a> {
    Mutex(#[allow(dead_code)] MutexGuard<'a, Streak>),
    /// The owner's fast hold: its thread's mark, cleared when it goes.
    Fast(&'static FastMark),
}

/// Access to the locked value; released when dropped.
pub(crate) struct PoolGuard<'a, T> {
    lock: &'a PoolLock<T>,
    hold: Hold<'a>,
}

impl<T> PoolLock<T> {
    pub(crate) fn new(value: T) -> Self {
        Self {
            mutex: Mutex::new(Streak { last: 0, count: 0, needed: BIAS_AFTER, owner_mark: None }),
            owner: AtomicU64::new(0),
            holder: AtomicU64::new(0),
            #[cfg(debug_assertions)]
            inside: AtomicU64::new(0),
            data: UnsafeCell::new(value),
        }
    }

    /// What a thread's mark holds while it holds this lock fast.
    #[inline(always)]
    fn addr(&self) -> usize {
        std::ptr::from_ref(self).addr()
    }

    /// Whether the calling thread, `me`, holds this lock fast now.
    #[inline]
    fn held_fast_here(&self, me: u64, mark: Option<&FastMark>) -> bool {
        // Only the owner holds it fast (a former owner stopped inside `fast` clears its mark
        // before it returns).
        self.owner.load(Ordering::Relaxed) == me && mark.is_some_and(|m| m.lock.load(Ordering::Relaxed) == self.addr())
    }

    /// The lock, waiting for it (and taking it back from its owner if another thread owns
    /// it). A panic under the lock does not poison it: its holders keep the value consistent
    /// between calls.
    pub(crate) fn lock(&self) -> PoolGuard<'_, T> {
        let (me, mark) = this_thread();
        if self.holder.load(Ordering::Relaxed) == me {
            // This thread holds the mutex already (a memory source's callback, made under the
            // lock, that calls back into the allocator): a std mutex would deadlock. Say so
            // instead. (Only this thread's own hold can read as `me`.)
            panic!(
                "dmabuf-rt: the caching allocator was called again from inside one of its own calls on this thread (a memory source's callback?)"
            );
        }
        let mut m = self.mutex.lock().unwrap_or_else(|p| p.into_inner());
        let owner = self.owner.load(Ordering::Relaxed);
        if owner != 0 && owner != me {
            self.revoke(&mut m);
        }
        if owner == me && mark.is_some_and(|m| m.lock.load(Ordering::Relaxed) == self.addr()) {
            // This thread is inside its own fast hold (a signal handler that calls the
            // allocator): a second hold would alias the first. A plain mutex would deadlock
            // here; say so instead.
            drop(m);
            panic!(
                "dmabuf-rt: the caching allocator was called again from inside one of its own calls on this thread (a signal handler?)"
            );
        }
        self.count(&mut m, me);
        self.holder.store(me, Ordering::Relaxed);
        self.guard(Hold::Mutex(m))
    }

    /// The lock, as [`PoolLock::lock`] takes it, unless this thread holds it already (a
    /// callback made under it): `None` then, where `lock` would deadlock or panic.
    pub(crate) fn lock_unless_held_here(&self) -> Option<PoolGuard<'_, T>> {
        let (me, mark) = this_thread();
        // Only this thread's own hold can read as `me` (see `fast`).
        if self.holder.load(Ordering::Relaxed) == me || self.held_fast_here(me, mark) {
            return None;
        }
        Some(self.lock())
    }

    /// The lock if nobody holds the mutex, taking the bias back from another owner that is
    /// not inside a fast hold now (the revocation then waits at most for a hold it starts
    /// meanwhile), without waiting on the mutex: for a forked child, where a mutex or a fast
    /// hold held at the fork by a thread the child does not have is never released. `None`
    /// also inside this thread's own hold.
    pub(crate) fn try_lock_taking_back(&self) -> Option<PoolGuard<'_, T>> {
        let me = thread_token();
        let mut m = match self.mutex.try_lock() {
            Ok(m) => m,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        let owner = self.owner.load(Ordering::Relaxed);
        if owner != 0 && m.owner_mark.is_some_and(|mark| mark.lock.load(Ordering::Acquire) == self.addr()) {
            return None;
        }
        if owner != 0 && owner != me {
            self.revoke(&mut m);
        }
        self.holder.store(me, Ordering::Relaxed);
        Some(self.guard(Hold::Mutex(m)))
    }

    /// The lock if nobody holds it and no other thread owns it, without waiting.
    pub(crate) fn try_lock(&self) -> Option<PoolGuard<'_, T>> {
        let (me, mark) = this_thread();
        let m = match self.mutex.try_lock() {
            Ok(m) => m,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        let owner = self.owner.load(Ordering::Relaxed);
        // Another thread's bias is left alone (a revocation is a system call); the owner
        // itself within a fast hold does not get a second guard.
        if (owner != 0 && owner != me) || self.held_fast_here(me, mark) {
            return None;
        }
        self.holder.store(me, Ordering::Relaxed);
        Some(self.guard(Hold::Mutex(m)))
    }

    /// The owner's hold, with no atomic read-modify-write; `None` on any other thread, or once
    /// the bias was revoked. The holder must not block or take another lock (see the module's
    /// doc), and must not ask for the lock again while it holds this.
    #[inline(always)]
    pub(crate) fn fast(&self) -> Option<PoolGuard<'_, T>> {
        // A thread that was never made an owner has no mark. Not while this thread holds the
        // mutex itself (the holder is written by the thread holding it: only this thread's own
        // hold can read as `me`), nor inside a fast hold of its own (of this lock or another).
        let mark = this_threads_mark_if_any()?;
        let me = mark.token;
        if self.owner.load(Ordering::Relaxed) != me
            || self.holder.load(Ordering::Relaxed) == me
            || mark.lock.load(Ordering::Relaxed) != 0
        {
            return None;
        }
        #[cfg(all(test, not(loom)))]
        tests::pause_point();
        mark.lock.store(self.addr(), Ordering::Relaxed);
        // Dekker's order: the mark's store before the `owner` load. The revoker's membarrier
        // orders them on the CPU; this keeps the compiler from swapping them.
        #[cfg(not(loom))]
        compiler_fence(Ordering::SeqCst);
        // Under loom, the owner's half of what the membarrier gives (see the loom
        // `barrier_available`): a `SeqCst` fence, which the real path does not pay.
        #[cfg(loom)]
        fence(Ordering::SeqCst); // the owner's side of the Dekker pair
        // Acquire: the value's accesses stay after the check. A thread that read itself the
        // owner above and lost the bias since clears its own mark, no one else's.
        if self.owner.load(Ordering::Acquire) != me {
            mark.lock.store(0, Ordering::Release);
            return None;
        }
        Some(self.guard(Hold::Fast(mark)))
    }

    /// The guard of a hold just taken. Debug builds check that no other guard lives (see
    /// `inside`: the holder's mark, [`PoolGuard::mark`]); on a failure the panic names both
    /// holds, and the guard is let go as the panic unwinds (so this thread can take the lock
    /// again), leaving the other hold's mark.
    #[inline(always)]
    fn guard<'a>(&'a self, hold: Hold<'a>) -> PoolGuard<'a, T> {
        let g = PoolGuard { lock: self, hold };
        #[cfg(debug_assertions)]
        {
            let (me, other) = (g.mark(), self.inside.load(Ordering::Relaxed));
            if other != 0 {
                let kind = |m: u64| if m & 1 == 1 { "the owner's fast hold" } else { "a mutex hold" };
                let owner = self.owner.load(Ordering::Relaxed);
                panic!(
                    "dmabuf-rt: two holders of the caching allocator's lock at once: {} of thread {} joined {} of \
                     thread {} (owner {owner})",
                    kind(me),
                    me >> 1,
                    kind(other),
                    other >> 1
                );
            }
            self.inside.store(me, Ordering::Relaxed);
        }
        g
    }

    /// Takes the bias back from its owner, under `mutex`: once this returns, the owner has left
    /// its fast hold and will not enter another.
    #[cold]
    #[inline(never)]
    fn revoke(&self, streak: &mut Streak) {
        let mark = streak.owner_mark.take();
        self.owner.store(0, Ordering::SeqCst);
        // Every running thread of the process passes a full barrier: the owner's mark, stored
        // before its check (which saw it still the owner), is visible now, or its check comes
        // after and sees 0. The command was registered when the bias was granted.
        if !process_barrier() {
            // Neither way works (both refused since the bias was granted): without the barrier
            // the owner may be inside its hold unseen, and going on could hand out memory
            // twice. Stop instead.
            log::error!("dmabuf-rt: no process-wide memory barrier while taking the allocator's lock from its owner");
            eprintln!("dmabuf-rt: no process-wide memory barrier (membarrier and mprotect refused); aborting");
            std::process::abort();
        }
        // The owner's hold is a few hundred instructions, unless it was preempted; a hold that
        // never ends (the process forked while another thread was in it: the child has no such
        // thread) waits asleep, as a plain mutex would, not spinning.
        let mut spins = 0u32;
        // A mark naming another lock is a fast hold of that one: this lock's comes after it, and
        // its check sees 0.
        while mark.is_some_and(|m| m.lock.load(Ordering::Acquire) == self.addr()) {
            spins = spins.saturating_add(1);
            #[cfg(not(loom))]
            if spins < 64 {
                std::hint::spin_loop();
            } else if spins < 1024 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(u64::from(spins.min(100_000))));
            }
            // loom explores a wait only if it yields to the thread it waits for.
            #[cfg(loom)]
            loom::thread::yield_now();
        }
        streak.needed = streak.needed.saturating_mul(2).min(BIAS_AFTER_MAX);
        streak.count = 0;
    }

    /// One more acquisition of `mutex` by `me`: a long enough run makes it the owner.
    #[inline]
    fn count(&self, streak: &mut Streak, me: u64) {
        if streak.last == me {
            streak.count = streak.count.saturating_add(1);
        } else {
            streak.last = me;
            streak.count = 1;
        }
        if streak.count >= streak.needed && self.owner.load(Ordering::Relaxed) == 0 && barrier_available() {
            streak.owner_mark = Some(this_threads_mark());
            self.owner.store(me, Ordering::Relaxed);
        }
    }

    /// Whether some thread owns the lock now (for tests).
    #[cfg(any(test, loom))]
    pub(crate) fn is_biased(&self) -> bool {
        self.owner.load(Ordering::Relaxed) != 0
    }
}

impl<T> std::ops::Deref for PoolGuard<'_, T> {
    type Target = T;

    #[inline(always)]
    fn deref(&self) -> &T {
        // SAFETY: a guard is the only access to the value while it lives (see `PoolLock`'s
        // `Sync`).
        unsafe { &*self.lock.data.get() }
    }
}

impl<T> std::ops::DerefMut for PoolGuard<'_, T> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`, and `&mut self` makes this the only borrow through the guard.
        unsafe { &mut *self.lock.data.get() }
    }
}

impl<T> PoolGuard<'_, T> {
    /// What debug builds keep in `inside` while this hold lives: the holder's thread token,
    /// doubled, plus one for the owner's fast hold.
    #[cfg(debug_assertions)]
    fn mark(&self) -> u64 {
        thread_token() << 1 | u64::from(matches!(self.hold, Hold::Fast(_)))
    }
}

impl<T> Drop for PoolGuard<'_, T> {
    #[inline(always)]
    fn drop(&mut self) {
        // Before the hold is let go (below), so the next holder sees it cleared.
        #[cfg(debug_assertions)]
        if self.lock.inside.load(Ordering::Relaxed) == self.mark() {
            // Not another hold's mark (a guard let go as its `guard` check panics).
            self.lock.inside.store(0, Ordering::Relaxed);
        }
        match self.hold {
            // Release: a revoker that sees it cleared sees everything written in the hold.
            Hold::Fast(mark) => mark.lock.store(0, Ordering::Release),
            // Before the mutex is let go (the field's drop, after this).
            Hold::Mutex(_) => self.lock.holder.store(0, Ordering::Relaxed),
        }
    }
}

/// The lock under public names for loom's models (`loom-tests/tests/pool_lock.rs`): in
/// `--cfg loom` builds only, as `caching::pool_lock_model`.
#[cfg(loom)]
pub mod model {
    /// [`PoolLock`](super::PoolLock).
    #[derive(Debug)]
    pub struct Lock<T>(super::PoolLock<T>);

    /// [`PoolGuard`](super::PoolGuard).
    pub struct Guard<'a, T>(super::PoolGuard<'a, T>);

    impl<T> std::fmt::Debug for Guard<'_, T> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Guard").field("fast", &matches!(self.0.hold, super::Hold::Fast(_))).finish()
        }
    }

    impl<T> Lock<T> {
        /// `PoolLock::new`.
        pub fn new(value: T) -> Self {
            Self(super::PoolLock::new(value))
        }

        /// `PoolLock::lock`.
        pub fn lock(&self) -> Guard<'_, T> {
            Guard(self.0.lock())
        }

        /// `PoolLock::try_lock`.
        pub fn try_lock(&self) -> Option<Guard<'_, T>> {
            self.0.try_lock().map(Guard)
        }

        /// `PoolLock::try_lock_taking_back`.
        pub fn try_lock_taking_back(&self) -> Option<Guard<'_, T>> {
            self.0.try_lock_taking_back().map(Guard)
        }

        /// `PoolLock::fast`.
        pub fn fast(&self) -> Option<Guard<'_, T>> {
            self.0.fast().map(Guard)
        }

        /// `PoolLock::is_biased`.
        pub fn is_biased(&self) -> bool {
            self.0.is_biased()
        }
    }

    impl<T> std::ops::Deref for Guard<'_, T> {
        type Target = T;

        fn deref(&self) -> &T {
            &self.0
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Barrier};

    use super::*;

    thread_local! {
        /// What this thread's next [`PoolLock::fast`] runs after its first checks (it read
        /// itself the owner) and before it marks its hold: a test's way to stop it there.
        static PAUSE: std::cell::RefCell<Option<Box<dyn FnOnce()>>> = const { std::cell::RefCell::new(None) };
    }

    /// See `PAUSE`.
    pub(super) fn pause_point() {
        if let Some(f) = PAUSE.with(|p| p.borrow_mut().take()) {
            f();
        }
    }

    /// Takes the lock by the mutex until this thread owns it.
    fn become_owner(l: &PoolLock<u64>) {
        for _ in 0..BIAS_AFTER_MAX {
            drop(l.lock());
            if l.fast().is_some() {
                return;
            }
        }
        panic!("never made the owner");
    }

    /// A hold taken by `take`; a panic taking it (debug builds check there that no other guard
    /// lives) counts in `overlaps` instead of leaving the other threads at their barriers.
    fn taken<'a>(
        overlaps: &AtomicUsize,
        take: impl FnOnce() -> Option<PoolGuard<'a, u64>>,
    ) -> Option<PoolGuard<'a, u64>> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(take)).unwrap_or_else(|_| {
            overlaps.fetch_add(1, Ordering::Relaxed);
            None
        })
    }

    /// A critical section that counts in `overlaps` another one running at the same time (it
    /// spins a little inside, so that holds overlap if exclusion fails). Counted, not
    /// asserted: a panic here would leave the other threads waiting at their barriers.
    fn critical(g: &mut PoolGuard<'_, u64>, inside: &AtomicBool, overlaps: &AtomicUsize, spins: usize) {
        if inside.swap(true, Ordering::SeqCst) {
            overlaps.fetch_add(1, Ordering::Relaxed);
        }
        let v = **g;
        for _ in 0..spins {
            std::hint::spin_loop();
        }
        **g = v + 1;
        inside.store(false, Ordering::SeqCst);
    }

    #[test]
    #[cfg_attr(miri, ignore)] // no membarrier under Miri: never biased
    fn a_run_of_acquisitions_makes_an_owner_and_another_thread_takes_it_back() {
        if !barrier_available() {
            println!("SKIP: membarrier(PRIVATE_EXPEDITED) is not available here");
            return;
        }
        let l = Arc::new(PoolLock::new(0u64));
        for _ in 0..BIAS_AFTER - 1 {
            drop(l.lock());
        }
        assert!(!l.is_biased(), "biased before the run was long enough");
        drop(l.lock());
        assert!(l.is_biased());
        {
            let mut g = l.fast().expect("the owner's fast hold");
            *g += 1;
            // Not a second guard for the owner inside its fast hold.
            assert!(l.try_lock().is_none());
        }
        {
            // The owner's own mutex hold is never joined by a fast hold.
            let _g = l.lock();
            assert!(l.fast().is_none(), "a fast hold inside the owner's own mutex hold");
        }
        let l2 = Arc::clone(&l);
        std::thread::spawn(move || {
            assert!(l2.fast().is_none(), "a fast hold on a thread that is not the owner");
            assert!(l2.try_lock().is_none(), "try_lock took the lock from its owner");
            let mut g = l2.lock();
            assert_eq!(*g, 1, "the owner's write is not seen");
            *g += 1;
        })
        .join()
        .unwrap();
        assert!(!l.is_biased(), "lock() did not take the bias back");
        assert!(l.fast().is_none(), "the former owner still holds it fast");
        assert_eq!(*l.lock(), 2);
        // The next bias needs a run twice as long.
        for _ in 0..BIAS_AFTER {
            drop(l.lock());
        }
        assert!(!l.is_biased(), "re-biased after a run of the first length");
        for _ in 0..BIAS_AFTER {
            drop(l.lock());
        }
        assert!(l.is_biased());
    }

    /// The hole `hostile_review25` found: a thread that was the owner reads itself the owner in
    /// `fast`, stops (preempted) before it marks its hold, and its bias is taken back; another
    /// thread is made the owner and enters its fast hold; the first thread goes on, marks its
    /// hold, sees it is not the owner and clears the mark, which was the new owner's too. A
    /// revoker then found nothing to wait for and joined the new owner's hold. Made to happen
    /// in this order every time, by stopping the first thread at that point.
    #[test]
    #[cfg_attr(miri, ignore)]
    fn a_former_owner_stopped_inside_fast_does_not_unmark_the_next_owners_hold() {
        if !barrier_available() {
            println!("SKIP: membarrier(PRIVATE_EXPEDITED) is not available here");
            return;
        }
        use std::sync::mpsc::channel;
        let l = Arc::new(PoolLock::new(0u64));
        let (paused_tx, paused) = channel::<()>();
        let (resume, resume_rx) = channel::<()>();
        let former = {
            let l = Arc::clone(&l);
            std::thread::spawn(move || {
                become_owner(&l);
                PAUSE.with(|p| {
                    *p.borrow_mut() = Some(Box::new(move || {
                        paused_tx.send(()).unwrap();
                        resume_rx.recv().unwrap();
                    }))
                });
                l.fast().map(|mut g| *g += 1).is_some()
            })
        };
        paused.recv().unwrap();
        // The former owner read itself the owner and stopped: its bias is taken back here.
        *l.lock() += 1;
        assert!(!l.is_biased());
        // Another thread is made the owner and holds the lock fast until a revoker has begun
        // (the owner is cleared), then a while longer, watching whether the revoker got in.
        let revoker_in = Arc::new(AtomicBool::new(false));
        let (holding_tx, holding) = channel::<()>();
        let (go_on, go_on_rx) = channel::<()>();
        let next = {
            let (l, revoker_in) = (Arc::clone(&l), Arc::clone(&revoker_in));
            std::thread::spawn(move || {
                become_owner(&l);
                let mut g = l.fast().expect("the new owner's fast hold");
                holding_tx.send(()).unwrap();
                go_on_rx.recv().unwrap();
                while l.owner.load(Ordering::SeqCst) != 0 {
                    std::thread::yield_now();
                }
                let mut joined = false;
                for _ in 0..20_000 {
                    joined |= revoker_in.load(Ordering::SeqCst);
                    std::thread::yield_now();
                }
                *g += 1;
                joined
            })
        };
        holding.recv().unwrap();
        // The former owner goes on: it is no longer the owner, and must leave the new owner's
        // hold marked.
        resume.send(()).unwrap();
        assert!(!former.join().unwrap(), "a former owner got a fast hold");
        go_on.send(()).unwrap();
        let revoker = {
            let (l, revoker_in) = (Arc::clone(&l), Arc::clone(&revoker_in));
            std::thread::spawn(move || {
                let mut g = l.lock();
                revoker_in.store(true, Ordering::SeqCst);
                *g += 1;
            })
        };
        let joined = next.join().unwrap();
        let revoked = revoker.join();
        assert!(
            !joined && revoked.is_ok(),
            "a revoker joined the new owner's fast hold (it saw its hold while inside: {joined}; its own \
             check: {:?})",
            revoked
                .err()
                .map(|e| e.downcast_ref::<String>().cloned().or(e.downcast_ref::<&str>().map(|s| s.to_string())))
        );
        // Every hold's increment is there (the former owner's fast hold never happened).
        assert_eq!(*l.lock(), 3);
    }

    #[test]
    fn lock_inside_this_threads_own_mutex_hold_panics_instead_of_deadlocking() {
        let l = PoolLock::new(0u64);
        let g = l.lock();
        let again = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(l.lock())));
        let why = again.expect_err("a second lock() on the holding thread returned");
        let why = why.downcast_ref::<&str>().copied().or(why.downcast_ref::<String>().map(String::as_str));
        assert!(why.is_some_and(|w| w.contains("called again from inside")), "{why:?}");
        drop(g);
        // The first hold went normally: the lock is free and usable.
        *l.lock() += 1;
        assert_eq!(*l.try_lock().expect("free"), 1);
    }

    #[test]
    fn lock_unless_held_here_refuses_only_this_threads_own_hold() {
        let l = Arc::new(PoolLock::new(0u64));
        {
            let _g = l.lock();
            assert!(l.lock_unless_held_here().is_none(), "a second guard inside this thread's mutex hold");
            // Another thread is not refused: it waits, and gets it once this hold ends.
        }
        assert!(l.lock_unless_held_here().is_some());
        let other = {
            let _g = l.lock();
            let l2 = Arc::clone(&l);
            std::thread::spawn(move || l2.try_lock().is_none()).join().unwrap()
        };
        assert!(other, "the other thread got a guard while this one held the lock");
        if barrier_available() {
            become_owner(&l);
            let _g = l.fast().expect("the owner's fast hold");
            assert!(l.lock_unless_held_here().is_none(), "a mutex guard inside this thread's fast hold");
        }
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn the_owner_and_other_threads_never_hold_it_at_once() {
        if !barrier_available() {
            println!("SKIP: membarrier(PRIVATE_EXPEDITED) is not available here");
            return;
        }
        const ROUNDS: usize = 300;
        const OWNER_OPS: usize = 300;
        // The owner's holds are long enough that a revocation that did not wait for one would
        // be caught inside it most of the time (with 20 spins a revocation that did not wait
        // was caught in 1 run of 5; with 300, in 6 of 6).
        const OWNER_SPINS: usize = 300;
        const OTHERS: usize = 2;
        let inside = Arc::new(AtomicBool::new(false));
        let overlaps = Arc::new(AtomicUsize::new(0));
        let lock = Arc::new(std::sync::Mutex::new(Arc::new(PoolLock::new(0u64))));
        let start = Arc::new(Barrier::new(OTHERS + 1));
        let done = Arc::new(Barrier::new(OTHERS + 1));
        let others_ops = Arc::new(AtomicUsize::new(0));
        let others: Vec<_> = (0..OTHERS)
            .map(|t| {
                let (inside, overlaps, lock, start, done, ops) =
                    (inside.clone(), overlaps.clone(), lock.clone(), start.clone(), done.clone(), others_ops.clone());
                std::thread::spawn(move || {
                    for r in 0..ROUNDS {
                        start.wait();
                        let l = Arc::clone(&lock.lock().unwrap());
                        // Spread over the owner's run: some take it at once, some later.
                        for _ in 0..(r * 7 + t * 13) % 50 {
                            std::hint::spin_loop();
                        }
                        for k in 0..3 {
                            let mut g = taken(&overlaps, || if k == 1 { l.try_lock() } else { Some(l.lock()) });
                            if let Some(g) = g.as_mut() {
                                critical(g, &inside, &overlaps, 20);
                                ops.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        done.wait();
                    }
                })
            })
            .collect();
        let mut total = 0u64;
        for _ in 0..ROUNDS {
            let l = Arc::new(PoolLock::new(0u64));
            *lock.lock().unwrap() = Arc::clone(&l);
            become_owner(&l);
            let before = *l.lock();
            start.wait();
            let mut mine = 0u64;
            for _ in 0..OWNER_OPS {
                if let Some(mut g) = taken(&overlaps, || Some(l.fast().unwrap_or_else(|| l.lock()))) {
                    critical(&mut g, &inside, &overlaps, OWNER_SPINS);
                    mine += 1;
                }
            }
            done.wait();
            total += *l.lock() - before - mine;
        }
        for h in others {
            h.join().unwrap();
        }
        assert_eq!(overlaps.load(Ordering::Relaxed), 0, "two holders at once");
        assert_eq!(total, others_ops.load(Ordering::Relaxed) as u64, "an increment was lost");
    }

    #[test]
    #[cfg_attr(miri, ignore)] // mprotect
    fn the_tlb_shootdown_fallback_works_from_several_threads_at_once() {
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..200 {
                        assert!(shootdown(), "the shootdown barrier failed");
                    }
                });
            }
        });
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn a_panic_in_the_fast_hold_and_an_owner_gone_leave_it_usable() {
        if !barrier_available() {
            println!("SKIP: membarrier(PRIVATE_EXPEDITED) is not available here");
            return;
        }
        let l = Arc::new(PoolLock::new(0u64));
        let l2 = Arc::clone(&l);
        // The owner panics inside its fast hold, then its thread ends.
        let r = std::thread::spawn(move || {
            become_owner(&l2);
            let mut g = l2.fast().unwrap();
            *g += 1;
            panic!("inside the fast hold");
        })
        .join();
        assert!(r.is_err());
        assert!(l.is_biased(), "the gone thread's bias is still there");
        let (tx, rx) = std::sync::mpsc::channel();
        let l3 = Arc::clone(&l);
        std::thread::spawn(move || tx.send(*l3.lock()).unwrap());
        let got = rx.recv_timeout(std::time::Duration::from_secs(20)).expect("lock() hung on a gone owner");
        assert_eq!(got, 1);
        assert!(!l.is_biased());
    }
}
