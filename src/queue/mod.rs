//! Queues (streams) on io_uring: copies, fills, events, waits and host callbacks, executed in
//! submission order per queue, independently across queues.
//!
//! Each [`Queue`] owns one io_uring and one executor thread. Operations run one at a time in
//! the order submitted, each with a ticket (its place in that order). Work done on the CPU
//! (CPU copies, fills, waits, callbacks) is complete when it returns: no completion goes
//! through the kernel, so CPU work makes no system call. The kernel engine's copies are
//! READ/WRITE SQEs on the queue's ring, all chunks of a copy submitted and awaited with one
//! `io_uring_enter`. Events recorded on the queue complete when the queue reaches them,
//! running their completion hooks; markers ([`QueueHandle::mark`]) pass there too, without an
//! event. When the queue is idle, small operations run inline on the submitting thread, so a
//! 4 KiB copy does not pay a thread wake-up (copies and fills under one hold of the queue's
//! lock). Nothing polls: a wait operation blocked on an event sleeps until the event
//! completes or the queue is dropped, which wakes it.
//!
//! The copy engine was chosen by measurement (`cargo bench --bench queue`): CPU copies with
//! the crate's byte-wise-atomic copy kernel (`crate::copy`) run at memcpy speed, while
//! io_uring READ/WRITE against a memfd reaches about half of it, so [`CopyEngine::Cpu`] is the
//! default and [`CopyEngine::Kernel`] is available where one side is a memfd.
//!
//! Errors: an operation that fails puts its queue in an error state. Everything submitted
//! after it is skipped (copies and fills do not run on bad data), events recorded after it
//! fail with the first error, waits on those events fail in turn on other queues, callbacks
//! are told. [`Queue::synchronize`] reports the error; [`Queue::clear_error`] resumes.
//!
//! Lifetimes: operations hold their memory ([`Mem`] keeps an `Arc<Segment>` or a
//! [`HostBuffer`]) until they complete. Dropping a queue finishes the work already submitted
//! (data is not lost), except that a wait for an event that has not completed is abandoned,
//! which fails that wait and skips what follows it; no operation outlives its memory either way.
//!
//! # The copy flow, top-down
//! [`Queue::copy`] checks the two ranges and calls `submit`, which runs the operation inline
//! on the caller's thread when the queue is idle and the copy small, or queues it for the
//! executor thread (`executor`). `execute` runs it through the engine (`engine.rs`: the CPU
//! copy kernel inside the dma-buf sync bracket, or READ/WRITE SQEs on the queue's ring,
//! `ring.rs`), and `finish` completes the event a record reached ([`Event`], `event.rs`),
//! which wakes its waiters (host threads in [`Event::synchronize`], other queues' waits) and
//! runs its completion hooks, and passes the markers waiting for that ticket (`marker.rs`).
//! Markers are where the caching allocator's deferred frees leave this module (see
//! [`crate::caching`]). Kernel fences enter through `fence.rs`'s watcher instead of a queue.

mod engine;
mod event;
mod fence;
pub(crate) use fence::readable_now as fence_readable_now;
pub(crate) use fence::sweep as sweep_fences;
mod id;
mod marker;
mod mem;
mod ring;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

pub use event::{Completion, Event};
pub use id::QueueId;
pub use marker::{MarkerPayload, MarkerSink};
pub use mem::{HostBuffer, Mem, MemArg};
use ring::Ring;

use crate::error::{Error, Result};
use engine::{CheckedCopy, chainable, cpu_copy, cpu_fill, kernel_copies};
use marker::Markers;

/// How copies move bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyEngine {
    /// The executor copies with the CPU (the default: memcpy speed).
    Cpu,
    /// Where one side is a memfd, the kernel copies (io_uring READ/WRITE); otherwise the CPU.
    Kernel,
}

/// Settings for a [`Queue`].
#[derive(Debug, Clone)]
pub struct QueueBuilder {
    engine: CopyEngine,
    inline_max: usize,
    name: String,
}

impl Default for QueueBuilder {
    fn default() -> Self {
        Self { engine: CopyEngine::Cpu, inline_max: 64 << 10, name: "dmabuf-rt-queue".into() }
    }
}

impl QueueBuilder {
    /// The copy engine (default [`CopyEngine::Cpu`]).
    pub fn engine(&mut self, engine: CopyEngine) -> &mut Self {
        self.engine = engine;
        self
    }

    /// Copies and fills up to this many bytes run inline on the submitting thread when the
    /// queue is idle (default 64 KiB; 0 disables inline execution).
    pub fn inline_max(&mut self, bytes: usize) -> &mut Self {
        self.inline_max = bytes;
        self
    }

    /// The executor thread's name.
    pub fn name(&mut self, name: &str) -> &mut Self {
        self.name = name.into();
        self
    }

    /// Creates the queue: its ring and its executor thread.
    pub fn build(&self) -> Result<Queue> {
        let ring = Ring::new(64).map_err(setup_error)?;
        let shared = Arc::new(QueueShared {
            id: QueueId::next(),
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            ring: Mutex::new(Some(ring)),
            exit_hooks: Mutex::new(Vec::new()),
            closing: AtomicBool::new(false),
            waiting_on: Mutex::new(None),
            markers_waiting: AtomicUsize::new(0),
            engine: self.engine,
            inline_max: self.inline_max,
        });
        let s = Arc::clone(&shared);
        let worker = std::thread::Builder::new()
            .name(self.name.clone())
            .spawn(move || executor(&s))
            .map_err(Error::io("spawn queue executor"))?;
        Ok(Queue { shared, worker: Some(worker) })
    }
}

/// A refused `io_uring_setup` as an [`Error`]: a limit the process ran into (open files, or
/// the locked memory a ring needs) is [`Error::ResourceLimit`]; anything else (io_uring
/// disabled, or refused by seccomp) is [`Error::Io`]. The message says which and what to do.
fn setup_error(e: std::io::Error) -> Error {
    use rustix::io::Errno;
    let errno = e.get_ref().and_then(|i| i.downcast_ref::<ring::SetupRefused>()).and_then(|r| r.errno.raw_os_error());
    let limit = match errno {
        // A ring's memory is locked memory: here ENOMEM means that limit.
        Some(c) if c == Errno::NOMEM.raw_os_error() => {
            Some(("the locked memory a ring needs (RLIMIT_MEMLOCK)", "raise `ulimit -l`"))
        }
        // Open-file limits, as for every other fd the library makes.
        Some(c) => crate::error::limit_of(&std::io::Error::from_raw_os_error(c)),
        None => None,
    };
    match limit {
        Some((resource, hint)) => Error::ResourceLimit { op: "io_uring_setup", resource, hint, source: e },
        None => Error::Io { op: "io_uring_setup", source: e },
    }
}

type Callback = Box<dyn FnOnce(Result<()>) + Send>;

enum Op {
    Copy { dst: Mem, src: Mem },
    Fill { dst: Mem, byte: u8 },
    Record { event: Event, generation: u64 },
    Wait { event: Event, generation: u64 },
    Callback(Callback),
}

/// An operation, the error epoch it was submitted in, and its ticket (its place in the
/// queue's submission order, counted from 1).
struct Queued {
    op: Op,
    epoch: u64,
    ticket: u64,
}

#[derive(Default)]
struct State {
    ops: VecDeque<Queued>,
    /// An operation is executing (on the executor or inline).
    running: bool,
    /// Bumped by `clear_error`: operations submitted before a failure are skipped even if the
    /// error is cleared before they run; those submitted after the clear run.
    epoch: u64,
    /// The latest failure and the epoch of the operation that failed.
    failure: Option<(u64, Arc<str>)>,
    /// Set (under this lock) when the queue is being dropped; the executor still drains
    /// what is queued, and event records from handles are still taken.
    closing: bool,
    /// Set by the executor when it has drained everything after `closing` and exited: the
    /// queue's work is all done, and nothing more can be submitted.
    exited: bool,
    /// Set if the executor thread died; submissions are refused after that.
    dead: bool,
    /// The newest operation's ticket (tickets count submissions from 1).
    submitted: u64,
    /// Every operation up to this ticket has finished (run, skipped or cancelled).
    passed: u64,
    /// Markers waiting for operations to finish.
    markers: Markers,
}

impl State {
    /// Whether everything submitted so far has finished (or never will run: the queue is gone
    /// or its executor died).
    fn has_passed(&self) -> bool {
        self.passed == self.submitted || self.exited || self.dead
    }

    /// The failure an operation submitted in `epoch` must honour, if any.
    fn failure_for(&self, epoch: u64) -> Option<Arc<str>> {
        self.failure.as_ref().filter(|(e, _)| *e >= epoch).map(|(_, why)| why.clone())
    }
}

struct QueueShared {
    id: QueueId,
    state: Mutex<State>,
    work: Condvar,
    /// The queue's io_uring; closed when the executor exits, so that handles which outlive the
    /// queue (the allocator's, deferred frees') do not keep its fd open.
    ring: Mutex<Option<Ring>>,
    /// Run once when the executor has exited (see [`QueueHandle::on_exit`]).
    exit_hooks: Mutex<Vec<ExitHook>>,
    /// Mirrors `State::closing` for a wait operation, which checks it under its event's lock.
    closing: AtomicBool,
    /// The event a wait operation is blocked on: dropping the queue wakes it, so that the
    /// wait sees `closing` (no polling).
    waiting_on: Mutex<Option<Event>>,
    /// Mirrors `State::markers.len()` (a hint read without the lock: finishing an operation
    /// looks for due markers only when some wait).
    markers_waiting: AtomicUsize,
    engine: CopyEngine,
    inline_max: usize,
}

impl QueueShared {
    #[inline]
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// After the executor has exited (its work done or cancelled): closes the ring and runs
    /// the exit hooks.
    fn exited(&self) {
        drop(self.ring.lock().unwrap_or_else(|p| p.into_inner()).take());
        let hooks = std::mem::take(&mut *self.exit_hooks.lock().unwrap_or_else(|p| p.into_inner()));
        for h in hooks {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(h));
        }
    }
}

type ExitHook = Box<dyn FnOnce() + Send>;

/// A stream of operations executed in order; see the module documentation.
pub struct Queue {
    shared: Arc<QueueShared>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.shared.lock();
        f.debug_struct("Queue").field("pending", &s.ops.len()).field("failure", &s.failure).finish()
    }
}

impl Queue {
    /// A queue with default settings.
    pub fn new() -> Result<Self> {
        QueueBuilder::default().build()
    }

    /// Settings for a new queue.
    pub fn builder() -> QueueBuilder {
        QueueBuilder::default()
    }

    /// Copies `src` to `dst` (host or segment ranges, any direction, any two devices) after
    /// everything submitted before. The lengths must match and `dst` must be writable. Pass
    /// `&Mem`s to spare the clones when the copy runs at once ([`MemArg`]).
    pub fn copy<'d, 's>(&self, dst: impl Into<MemArg<'d>>, src: impl Into<MemArg<'s>>) -> Result<()> {
        let (dst, src) = (dst.into(), src.into());
        let checked = CheckedCopy::new(dst.get(), src.get())?;
        let s = self.shared.lock();
        let s = if kernel_copy_applies(&self.shared, dst.get(), src.get()) {
            s
        } else {
            let Err(s) = run_inline_locked(&self.shared, s, checked.len(), || checked.run()) else { return Ok(()) };
            s
        };
        submit_locked(&self.shared, s, Op::Copy { dst: dst.into_owned(), src: src.into_owned() })
    }

    /// Sets every byte of `dst` to `byte` after everything submitted before.
    pub fn fill<'d>(&self, dst: impl Into<MemArg<'d>>, byte: u8) -> Result<()> {
        let dst = dst.into();
        check_fill(dst.get())?;
        let s = self.shared.lock();
        let Err(s) = run_inline_locked(&self.shared, s, dst.get().len(), || cpu_fill(dst.get(), byte)) else {
            return Ok(());
        };
        submit_locked(&self.shared, s, Op::Fill { dst: dst.into_owned(), byte })
    }

    /// A new event that completes when the queue reaches this point.
    pub fn record(&self) -> Result<Event> {
        let event = Event::new();
        self.record_event(&event)?;
        Ok(event)
    }

    /// Records `event` again at this point (a new generation; see [`Event`]).
    pub fn record_event(&self, event: &Event) -> Result<()> {
        let generation = event.begin_record_on(self.shared.id);
        let r = self.submit(Op::Record { event: event.clone(), generation });
        if let Err(e) = &r {
            // Never leave a generation nobody will complete.
            event.complete(generation, Err(e.to_string().into()));
        }
        r
    }

    /// Makes everything submitted after this wait for `event` (from any queue, or a kernel
    /// fence) as it is recorded now.
    pub fn wait(&self, event: &Event) -> Result<()> {
        let generation = event.current_generation();
        self.submit(Op::Wait { event: event.clone(), generation })
    }

    /// Runs `f` on the executor thread after everything submitted before, with the queue's
    /// error if an earlier operation failed. It must not block for long: the queue waits for
    /// it. A panic in `f` is caught and fails the queue like a failed operation.
    pub fn callback(&self, f: impl FnOnce(Result<()>) + Send + 'static) -> Result<()> {
        self.submit(Op::Callback(Box::new(f)))
    }

    /// Blocks until everything submitted so far has run, the completion hooks of events recorded
    /// on this queue included; reports the queue's error.
    pub fn synchronize(&self) -> Result<()> {
        self.record()?.synchronize(None)
    }

    /// As [`Queue::synchronize`], giving up after `timeout`.
    pub fn synchronize_timeout(&self, timeout: Duration) -> Result<()> {
        self.record()?.synchronize(Some(timeout))
    }

    /// True when nothing is queued or running.
    pub fn is_idle(&self) -> bool {
        let s = self.shared.lock();
        s.ops.is_empty() && !s.running
    }

    /// The queue's error, if an operation failed (and the error was not cleared since).
    pub fn error(&self) -> Option<Error> {
        let s = self.shared.lock();
        s.failure_for(s.epoch).map(|reason| Error::OperationFailed { reason })
    }

    /// Clears the error state so operations submitted from now on run again (those submitted
    /// before it are still skipped); returns the error it held.
    pub fn clear_error(&self) -> Option<Error> {
        let mut s = self.shared.lock();
        let e = s.failure_for(s.epoch)?;
        s.epoch += 1;
        Some(Error::OperationFailed { reason: e })
    }

    fn submit(&self, op: Op) -> Result<()> {
        submit(&self.shared, op)
    }

    /// This queue's identity.
    pub fn id(&self) -> QueueId {
        self.shared.id
    }

    /// A cloneable handle that can record events on this queue, for code that must mark a
    /// point in the queue later (the caching allocator's deferred frees). Once the queue is
    /// dropped, recording through the handle fails.
    pub fn handle(&self) -> QueueHandle {
        QueueHandle { shared: Arc::clone(&self.shared) }
    }
}

/// See [`Queue::handle`].
#[derive(Clone)]
pub struct QueueHandle {
    shared: Arc<QueueShared>,
}

impl std::fmt::Debug for QueueHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueHandle").field("id", &self.shared.id).finish()
    }
}

impl QueueHandle {
    /// The queue's identity.
    pub fn id(&self) -> QueueId {
        self.shared.id
    }

    /// True when nothing is queued or running (also once the queue has been dropped: its
    /// work is then done or cancelled).
    pub fn is_idle(&self) -> bool {
        let s = self.shared.lock();
        s.ops.is_empty() && !s.running
    }

    /// A new event recorded at the queue's current end.
    pub fn record(&self) -> Result<Event> {
        let event = Event::new();
        let generation = event.begin_record_on(self.shared.id);
        let r = submit(&self.shared, Op::Record { event: event.clone(), generation });
        if let Err(e) = &r {
            event.complete(generation, Err(e.to_string().into()));
        }
        r.map(|()| event)
    }

    /// What waiting for everything submitted so far takes: `Ok(None)` when the queue has
    /// nothing left to wait for (dropped after finishing all its work, or idle with no
    /// failure to report), else an event recorded at the queue's current end.
    pub fn record_unless_passed(&self) -> Result<Option<Event>> {
        let passed = || {
            let s = self.shared.lock();
            s.exited && !s.dead
        };
        {
            let s = self.shared.lock();
            // Idle: everything submitted has run (its effects are visible to whoever takes
            // this lock after the executor released it). A failure still goes through a
            // record, which reports it as a wait would.
            if (s.exited && !s.dead) || (s.ops.is_empty() && !s.running && s.failure.is_none()) {
                return Ok(None);
            }
        }
        match self.record() {
            Ok(ev) => Ok(Some(ev)),
            // It exited between the check and the record: its work is all done.
            Err(_) if passed() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Whether the queue has been dropped and its executor has exited, having finished or
    /// cancelled all its work: nothing can use its blocks any more.
    pub fn is_gone(&self) -> bool {
        let s = self.shared.lock();
        s.exited || s.dead
    }

    /// Whether everything submitted so far has finished (also once the queue is gone): no
    /// operation submitted before this call can touch memory any more.
    pub fn has_passed(&self) -> bool {
        self.shared.lock().has_passed()
    }

    /// Places a marker at the queue's current end: once everything submitted so far has
    /// finished, `sink` receives `payload` (see [`MarkerSink`] for where and when). If the
    /// queue has already passed this point (idle, gone, or its executor died), nothing is
    /// placed and the payload comes back as the error. Costs no allocation once the queue's
    /// marker buffer has grown to its working size.
    pub fn mark(&self, sink: &Arc<dyn MarkerSink>, payload: MarkerPayload) -> std::result::Result<(), MarkerPayload> {
        let mut s = self.shared.lock();
        if s.has_passed() {
            return Err(payload);
        }
        let ticket = s.submitted;
        s.markers.push(ticket, sink, payload);
        self.shared.markers_waiting.store(s.markers.len(), Ordering::Relaxed);
        Ok(())
    }

    /// Runs `f` once the queue is gone (see [`QueueHandle::is_gone`]): on the executor thread
    /// as it exits, or at once on this thread if it already has. `f` must be quick and must not
    /// block (the caching allocator uses it to free a dropped queue's memory).
    pub fn on_exit(&self, f: impl FnOnce() + Send + 'static) {
        {
            let s = self.shared.lock();
            if !(s.exited || s.dead) {
                // Registered under the state lock: the executor sets `exited` under it before
                // it takes the hooks, so a hook is either taken or sees the queue gone.
                self.shared.exit_hooks.lock().unwrap_or_else(|p| p.into_inner()).push(Box::new(f));
                return;
            }
        }
        f();
    }
}

thread_local! {
    /// The id of the queue whose executor this thread is (0: none).
    static EXECUTING: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The queue whose executor thread this is, if any: code running in a host callback.
pub fn executing_queue() -> Option<QueueId> {
    QueueId::from_raw(EXECUTING.with(std::cell::Cell::get))
}

/// Runs `f` once every queue in `queues` has passed its current end: a marker is placed on
/// each queue that has work outstanding, and `f` runs (after that queue's lock is released, on
/// the thread that finishes the last of them) when all have passed, whether the work before
/// them succeeded or not; at once, on this thread, if none has work outstanding. A queue that
/// has been dropped has finished or cancelled its work and counts as passed. This is how
/// memory used on several queues learns when none of them can touch it any more.
pub fn after_queues(queues: impl IntoIterator<Item = QueueHandle>, f: impl FnOnce() + Send + 'static) {
    let busy: Vec<QueueHandle> = queues.into_iter().filter(|q| !q.has_passed()).collect();
    if busy.is_empty() {
        f();
        return;
    }
    let all = marker::AfterAll::new(busy.len(), Box::new(f));
    let sink: Arc<dyn MarkerSink> = all.clone();
    for q in &busy {
        // A zero-sized payload: no allocation.
        if q.mark(&sink, Box::new(())).is_err() {
            all.one_passed();
        }
    }
}

/// Small CPU work (a copy or fill of `len` bytes) on an idle queue, run under the queue's
/// lock `s` (one lock for submission and completion). Nothing else can be waiting to complete
/// on an idle queue (it has no pending record, and markers are placed only on busy queues),
/// and the lock is held for no longer than the operation would keep the queue busy. Returns
/// the lock when the work does not qualify: the queue is busy, failed, closing or gone, or
/// the work is large.
#[inline]
fn run_inline_locked<'g>(
    shared: &QueueShared,
    mut s: MutexGuard<'g, State>,
    len: usize,
    work: impl FnOnce() -> std::result::Result<(), Arc<str>>,
) -> std::result::Result<(), MutexGuard<'g, State>> {
    let eligible = !s.running
        && s.ops.is_empty()
        && len <= shared.inline_max
        && !s.dead
        && !s.exited
        && s.failure.as_ref().is_none_or(|(e, _)| *e < s.epoch);
    if !eligible {
        return Err(s);
    }
    s.submitted += 1;
    if let Err(why) = work() {
        s.failure = Some((s.epoch, why));
    }
    s.passed = s.submitted;
    Ok(())
}

fn submit(shared: &QueueShared, op: Op) -> Result<()> {
    submit_locked(shared, shared.lock(), op)
}

fn submit_locked(shared: &QueueShared, mut s: MutexGuard<'_, State>, op: Op) -> Result<()> {
    if s.dead {
        return Err(Error::OperationFailed { reason: "the queue's executor thread died".into() });
    }
    if s.exited {
        return Err(Error::OperationFailed { reason: "the queue has been dropped and has finished its work".into() });
    }
    let epoch = s.epoch;
    s.submitted += 1;
    let ticket = s.submitted;
    if !s.running && s.ops.is_empty() && inline_ok(shared, &op) {
        s.running = true;
        let failed = s.failure_for(epoch);
        drop(s);
        let completes = execute(shared, Queued { op, epoch, ticket }, failed);
        finish(shared, completes, ticket);
        return Ok(());
    }
    s.ops.push_back(Queued { op, epoch, ticket });
    if !s.running {
        shared.work.notify_one();
    }
    Ok(())
}

impl Drop for Queue {
    fn drop(&mut self) {
        {
            // Set under the lock the executor checks before it sleeps: no lost wake-up.
            let mut s = self.shared.lock();
            s.closing = true;
            self.shared.closing.store(true, Ordering::Release);
        }
        self.shared.work.notify_all();
        // A wait operation blocked on an event that may never complete gives up now (it
        // checks `closing` under the event's lock, which this wake-up takes).
        if let Some(ev) = self.shared.waiting_on.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            ev.wake_waiters();
        }
        if let Some(w) = self.worker.take() {
            if executing_queue().is_some() || Finishing::active() {
                // Dropped on a queue's executor (in a host callback, or by a callback holding
                // the last reference to its own queue), or from a completion hook or marker
                // sink on a thread finishing an operation: joining could wait for this very
                // thread, or for a queue blocked waiting on it. The executor drains what was
                // submitted and exits on its own, as CUDA's stream destroy lets a stream
                // finish its work after the call returns.
                drop(w);
                return;
            }
            // The executor drains what was submitted, then exits. If it died, its guard has
            // already failed what was left.
            let _ = w.join();
        }
    }
}

/// Synchronous copy on the calling thread (the Paddle `memory_copy_*` sync calls): no queue,
/// same checks and the same dma-buf bracketing as a queued copy.
pub fn copy_now<'d, 's>(dst: impl Into<MemArg<'d>>, src: impl Into<MemArg<'s>>) -> Result<()> {
    let (dst, src) = (dst.into(), src.into());
    CheckedCopy::new(dst.get(), src.get())?.run().map_err(|reason| Error::OperationFailed { reason })
}

/// Synchronous fill on the calling thread: no queue, same checks and the same dma-buf
/// bracketing as a queued fill.
pub fn fill_now<'d>(dst: impl Into<MemArg<'d>>, byte: u8) -> Result<()> {
    let dst = dst.into();
    check_fill(dst.get())?;
    cpu_fill(dst.get(), byte).map_err(|reason| Error::OperationFailed { reason })
}

/// Checks a fill of `dst`: it must have a CPU mapping and be writable.
fn check_fill(dst: &Mem) -> Result<()> {
    dst.ptr()?;
    if !dst.writable() {
        return Err(Error::ReadOnly);
    }
    Ok(())
}

/// Whether a copy goes to the kernel: the kernel engine, a memfd side, and no overlap (a
/// pwrite from a mapping of the very pages it writes would read bytes it already changed).
#[inline]
fn kernel_copy_applies(shared: &QueueShared, dst: &Mem, src: &Mem) -> bool {
    shared.engine == CopyEngine::Kernel
        && (dst.memfd().is_some() || src.memfd().is_some())
        && !dst.overlaps(src)
        // Two mappings of the same pages: the CPU path moves them in the file's order.
        && dst.aliasing(src) == mem::Aliasing::No
}

fn inline_ok(shared: &QueueShared, op: &Op) -> bool {
    match op {
        Op::Copy { dst, .. } | Op::Fill { dst, .. } => dst.len() <= shared.inline_max,
        Op::Record { .. } => true,
        Op::Wait { event, generation } => event.is_generation_complete(*generation),
        Op::Callback(_) => false,
    }
}

/// If the executor thread unwinds (a bug: user code is caught), fail everything it leaves.
struct ExecutorGuard<'a>(&'a QueueShared);

impl Drop for ExecutorGuard<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let (left, markers) = {
            let mut s = self.0.lock();
            s.dead = true;
            s.running = false;
            s.passed = s.submitted;
            (s.ops.drain(..).collect::<Vec<Queued>>(), s.markers.take_all())
        };
        self.0.markers_waiting.store(0, Ordering::Relaxed);
        let why: Arc<str> = "the queue's executor thread died".into();
        for q in left {
            cancel(q.op, &why);
        }
        // Nothing the executor left will run: the memory markers wait for is free of it.
        for m in markers {
            marker::pass(m);
        }
        self.0.exited();
    }
}

fn cancel(op: Op, why: &Arc<str>) {
    match op {
        Op::Record { event, generation } => event.complete(generation, Err(why.clone())),
        Op::Callback(f) => {
            let r = Err(Error::OperationFailed { reason: why.clone() });
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(r)));
        }
        _ => {}
    }
}

fn executor(shared: &QueueShared) {
    let _guard = ExecutorGuard(shared);
    EXECUTING.with(|e| e.set(shared.id.get()));
    let mut chain: Vec<Queued> = Vec::new();
    loop {
        let (queued, failed) = {
            let mut s = shared.lock();
            loop {
                if !s.running {
                    if let Some(q) = s.ops.pop_front() {
                        s.running = true;
                        let failed = s.failure_for(q.epoch);
                        if failed.is_none() && is_chain_link(shared, &q.op) {
                            // Kernel-engine copies queued one after another go to the ring
                            // as one linked chain: one io_uring_enter for all of them.
                            while chain.len() + 1 < MAX_CHAINED
                                && s.ops.front().is_some_and(|n| n.epoch == q.epoch && is_chain_link(shared, &n.op))
                            {
                                chain.push(s.ops.pop_front().expect("checked above"));
                            }
                        }
                        break (q, failed);
                    }
                    if s.closing {
                        s.exited = true;
                        drop(s);
                        shared.exited();
                        return;
                    }
                }
                s = shared.work.wait(s).unwrap_or_else(|p| p.into_inner());
            }
        };
        if !chain.is_empty() {
            chain.insert(0, queued);
            run_chain(shared, &mut chain);
            continue;
        }
        let ticket = queued.ticket;
        let completes = execute(shared, queued, failed);
        finish(shared, completes, ticket);
    }
}

/// The most kernel-engine copies chained into one submission.
const MAX_CHAINED: usize = 16;

/// Whether `op` is a kernel-engine copy that can be chained with the ones around it.
fn is_chain_link(shared: &QueueShared, op: &Op) -> bool {
    matches!(op, Op::Copy { dst, src } if kernel_copy_applies(shared, dst, src) && chainable(dst, src))
}

/// Runs a chain of kernel-engine copies (taken from the queue in order, all of one epoch, the
/// queue not failed in it) with one submission, then finishes them together: a failure fails
/// the queue, and the copies after the failed one did not run (skipped, as after any failure).
fn run_chain(shared: &QueueShared, chain: &mut Vec<Queued>) {
    let last = chain.last().expect("a chain is not empty").ticket;
    let epoch = chain[0].epoch;
    let copies: Vec<(&Mem, &Mem)> = chain
        .iter()
        .filter_map(|q| match &q.op {
            Op::Copy { dst, src } => Some((dst, src)),
            _ => None,
        })
        .collect();
    if let Err(why) = kernel_copies(shared, &copies) {
        let mut s = shared.lock();
        if s.failure.as_ref().is_none_or(|(e, _)| *e < epoch) {
            s.failure = Some((epoch, why));
        }
    }
    drop(copies);
    chain.clear();
    finish(shared, None, last);
}

/// Runs one operation (or skips it if the queue failed in its epoch, `failed` being that
/// failure). Work done on the CPU is complete when it returns: no completion goes through the
/// kernel. Returns the event a record reached, to be completed by [`finish`] once the queue no
/// longer counts the operation as running.
fn execute(shared: &QueueShared, queued: Queued, failed: Option<Arc<str>>) -> Option<(Event, u64, Completion)> {
    let Queued { op, epoch, .. } = queued;
    let mut completes = None;
    let result: std::result::Result<(), Arc<str>> = match (op, failed) {
        (Op::Record { event, generation }, failed) => {
            // Everything before it has finished: it completes now (in `finish`), carrying the
            // queue's error if an earlier operation failed.
            completes = Some((event, generation, failed.map_or(Ok(()), Err)));
            Ok(())
        }
        (Op::Callback(f), Some(why)) => {
            let r = Err(Error::OperationFailed { reason: why });
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(r)));
            Ok(())
        }
        (Op::Callback(f), None) => match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(Ok(())))) {
            Ok(()) => Ok(()),
            Err(_) => Err("a host callback panicked".into()),
        },
        (_, Some(_)) => Ok(()), // skipped: the queue has failed
        (Op::Copy { dst, src }, None) => {
            if kernel_copy_applies(shared, &dst, &src) {
                kernel_copies(shared, &[(&dst, &src)])
            } else {
                cpu_copy(&dst, &src)
            }
        }
        (Op::Fill { dst, byte }, None) => cpu_fill(&dst, byte),
        (Op::Wait { event, generation }, None) => wait_for(shared, &event, generation),
    };
    if let Err(why) = result {
        let mut s = shared.lock();
        if s.failure.as_ref().is_none_or(|(e, _)| *e < epoch) {
            s.failure = Some((epoch, why));
        }
    }
    completes
}

/// A wait operation: blocks until `generation` of `event` completes, or until the queue is
/// dropped (which wakes it through `waiting_on`: no polling).
fn wait_for(shared: &QueueShared, event: &Event, generation: u64) -> std::result::Result<(), Arc<str>> {
    if event.is_generation_complete(generation) {
        return event
            .wait_generation(generation, None, None)
            .map_err(|e| Arc::from(format!("waited-on event failed: {e}")));
    }
    // Published before the wait checks `closing` under the event's lock; Drop sets `closing`
    // before it reads this: either the wait sees `closing`, or Drop wakes it.
    *shared.waiting_on.lock().unwrap_or_else(|p| p.into_inner()) = Some(event.clone());
    let r = event.wait_generation(generation, None, Some(&shared.closing));
    *shared.waiting_on.lock().unwrap_or_else(|p| p.into_inner()) = None;
    r.map_err(|e| Arc::from(format!("waited-on event failed: {e}")))
}

/// Finishes operation `ticket`: runs the hooks of the event a record reached and passes the
/// markers waiting for it, then marks the queue not running and the event complete under the
/// queue's lock. So a record submitted later (it may run inline the moment the queue is idle)
/// never completes before this one, whoever sees the event complete also sees the queue idle
/// if nothing else was queued, and `Queue::synchronize` never returns before the hooks of
/// earlier records have run and earlier markers have passed.
fn finish(shared: &QueueShared, completes: Option<(Event, u64, Completion)>, ticket: u64) {
    {
        // Hooks and sinks may drop this very queue: its Drop must not join the executor,
        // which waits for this operation to finish (see `Finishing`).
        let _finishing = Finishing::enter();
        if let Some((event, generation, result)) = &completes {
            event.run_hooks(*generation, result);
        }
        if shared.markers_waiting.load(Ordering::Relaxed) > 0 {
            pass_due(shared, ticket);
        }
    }
    let (wake, late) = loop {
        let mut s = shared.lock();
        if s.markers.any_due(ticket) {
            // A marker placed (for this very operation) after `pass_due` looked: passed before
            // the queue counts the operation finished, so that whoever sees the queue idle, or
            // a later record complete, knows every earlier marker has passed.
            drop(s);
            let _finishing = Finishing::enter();
            pass_due(shared, ticket);
            continue;
        }
        s.running = false;
        debug_assert!(s.passed < ticket, "operations finish in submission order");
        s.passed = ticket;
        // Lock order: queue, then event (as in `inline_ok`).
        let late = completes.map(|(event, generation, result)| event.mark_complete(generation, result));
        // Wake the executor when there is more to run, and also when the queue is closing: an
        // operation run inline on another thread kept it asleep through Drop's wake-up, and it
        // must now see the queue idle and exit, or Drop's join waits forever.
        break (!s.ops.is_empty() || s.closing, late);
    };
    if wake {
        shared.work.notify_one();
    }
    if let Some(late) = late {
        late();
    }
}

thread_local! {
    /// How many operations this thread is finishing (running their events' hooks and passing
    /// their markers) while their queue still counts them as running.
    static FINISHING: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Marks this thread as finishing an operation for as long as it lives: a queue dropped from a
/// completion hook or a marker's sink on a thread that ran the operation inline must not join
/// its executor (the executor waits for that very operation to finish), as on the executor's
/// own thread.
struct Finishing;

impl Finishing {
    fn enter() -> Finishing {
        FINISHING.with(|f| f.set(f.get() + 1));
        Finishing
    }

    fn active() -> bool {
        FINISHING.with(|f| f.get() > 0)
    }
}

impl Drop for Finishing {
    fn drop(&mut self) {
        FINISHING.with(|f| f.set(f.get() - 1));
    }
}

/// Passes the markers waiting for operations up to `ticket`, one at a time, each outside the
/// queue's lock (a sink may call into queues).
fn pass_due(shared: &QueueShared, ticket: u64) {
    loop {
        let m = {
            let mut s = shared.lock();
            let m = s.markers.pop_due(ticket);
            shared.markers_waiting.store(s.markers.len(), Ordering::Relaxed);
            m
        };
        match m {
            Some(m) => marker::pass(m),
            None => return,
        }
    }
}
