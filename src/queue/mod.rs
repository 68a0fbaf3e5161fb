//! Queues (streams) on io_uring: copies, fills, events, waits and host callbacks, executed in
//! submission order per queue, independently across queues.
//!
//! Each [`Queue`] owns one io_uring and one executor thread. Operations run one at a time in
//! the order submitted; every operation's completion arrives as a CQE on the queue's ring
//! (kernel copies are READ/WRITE SQEs; work done on the CPU posts a NOP), and events recorded
//! on the queue complete from there, running their completion hooks. When the queue is idle,
//! small operations run inline on the submitting thread, so a 4 KiB copy does not pay a thread
//! wake-up.
//!
//! The copy engine was chosen by measurement (`cargo bench --bench queue`): CPU copies with
//! the crate's byte-wise-atomic copy kernel ([`crate::copy`]) run at memcpy speed, while
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

mod engine;
mod event;
mod fence;
mod mem;
mod ring;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

pub use event::{Completion, Event};
pub use mem::{HostBuffer, Mem};
use ring::Ring;

use crate::error::{Error, Result};
use engine::{cpu_copy, cpu_fill, kernel_copy};

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
        let ring = Ring::new(64).map_err(Error::io("io_uring_setup"))?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            ring: Mutex::new(ring),
            closing: AtomicBool::new(false),
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

type Callback = Box<dyn FnOnce(Result<()>) + Send>;

enum Op {
    Copy { dst: Mem, src: Mem },
    Fill { dst: Mem, byte: u8 },
    Record { event: Event, generation: u64 },
    Wait { event: Event, generation: u64 },
    Callback(Callback),
}

#[derive(Default)]
struct State {
    ops: VecDeque<Op>,
    /// An operation is executing (on the executor or inline).
    running: bool,
    /// The first failure since the last `clear_error`.
    error: Option<Arc<str>>,
}

struct Shared {
    state: Mutex<State>,
    work: Condvar,
    ring: Mutex<Ring>,
    closing: AtomicBool,
    engine: CopyEngine,
    inline_max: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A stream of operations executed in order; see the module documentation.
pub struct Queue {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.shared.lock();
        f.debug_struct("Queue").field("pending", &s.ops.len()).field("error", &s.error).finish()
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
    /// everything submitted before. The lengths must match and `dst` must be writable.
    pub fn copy(&self, dst: impl Into<Mem>, src: impl Into<Mem>) -> Result<()> {
        let (dst, src) = (dst.into(), src.into());
        check_copy(&dst, &src, self.shared.engine)?;
        self.submit(Op::Copy { dst, src })
    }

    /// Sets every byte of `dst` to `byte` after everything submitted before.
    pub fn fill(&self, dst: impl Into<Mem>, byte: u8) -> Result<()> {
        let dst = dst.into();
        dst.ptr()?;
        if !dst.writable() {
            return Err(Error::ReadOnly);
        }
        self.submit(Op::Fill { dst, byte })
    }

    /// A new event that completes when the queue reaches this point.
    pub fn record(&self) -> Result<Event> {
        let event = Event::new();
        self.record_event(&event)?;
        Ok(event)
    }

    /// Records `event` again at this point (a new generation; see [`Event`]).
    pub fn record_event(&self, event: &Event) -> Result<()> {
        let generation = event.begin_record();
        self.submit(Op::Record { event: event.clone(), generation })
    }

    /// Makes everything submitted after this wait for `event` (from any queue, or a kernel
    /// fence) as it is recorded now.
    pub fn wait(&self, event: &Event) -> Result<()> {
        let generation = event.current_generation();
        self.submit(Op::Wait { event: event.clone(), generation })
    }

    /// Runs `f` on the executor thread after everything submitted before, with the queue's
    /// error if an earlier operation failed. It must not block for long: the queue waits for it.
    pub fn callback(&self, f: impl FnOnce(Result<()>) + Send + 'static) -> Result<()> {
        self.submit(Op::Callback(Box::new(f)))
    }

    /// Blocks until everything submitted so far has run; reports the queue's error.
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

    /// The queue's error, if an operation failed.
    pub fn error(&self) -> Option<Error> {
        self.shared.lock().error.clone().map(|reason| Error::OperationFailed { reason })
    }

    /// Clears the error state so later operations run again; returns the error it held.
    pub fn clear_error(&self) -> Option<Error> {
        self.shared.lock().error.take().map(|reason| Error::OperationFailed { reason })
    }

    fn submit(&self, op: Op) -> Result<()> {
        let shared = &*self.shared;
        let mut s = shared.lock();
        if !s.running && s.ops.is_empty() && inline_ok(shared, &op) {
            s.running = true;
            let failed = s.error.clone();
            drop(s);
            let completes = execute(shared, op, failed);
            finish(shared, completes);
            return Ok(());
        }
        s.ops.push_back(op);
        if !s.running {
            shared.work.notify_one();
        }
        Ok(())
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::Release);
        self.shared.work.notify_all();
        if let Some(w) = self.worker.take() {
            // The executor drains what was submitted, then exits; a panic there has already
            // been reported by the thread itself.
            let _ = w.join();
        }
    }
}

/// Synchronous copy on the calling thread (the Paddle `memory_copy_*` sync calls): no queue,
/// same checks and the same dma-buf bracketing as a queued copy.
pub fn copy_now(dst: impl Into<Mem>, src: impl Into<Mem>) -> Result<()> {
    let (dst, src) = (dst.into(), src.into());
    check_copy(&dst, &src, CopyEngine::Cpu)?;
    cpu_copy(&dst, &src).map_err(|reason| Error::OperationFailed { reason })
}

fn check_copy(dst: &Mem, src: &Mem, engine: CopyEngine) -> Result<()> {
    if dst.len() != src.len() {
        return Err(Error::SizeMismatch { dst: dst.len(), src: src.len() });
    }
    let kernel_side = engine == CopyEngine::Kernel && (dst.memfd().is_some() || src.memfd().is_some());
    if !kernel_side {
        dst.ptr()?;
        src.ptr()?;
    }
    if !dst.writable() && !kernel_side {
        return Err(Error::ReadOnly);
    }
    Ok(())
}

fn inline_ok(shared: &Shared, op: &Op) -> bool {
    match op {
        Op::Copy { dst, .. } | Op::Fill { dst, .. } => dst.len() <= shared.inline_max,
        Op::Record { .. } => true,
        Op::Wait { event, generation } => event.is_complete() && *generation <= event.current_generation(),
        Op::Callback(_) => false,
    }
}

fn executor(shared: &Shared) {
    loop {
        let (op, failed) = {
            let mut s = shared.lock();
            loop {
                if !s.running {
                    if let Some(op) = s.ops.pop_front() {
                        s.running = true;
                        break (op, s.error.clone());
                    }
                    if shared.closing.load(Ordering::Acquire) {
                        return;
                    }
                }
                s = shared.work.wait(s).unwrap_or_else(|p| p.into_inner());
            }
        };
        let completes = execute(shared, op, failed);
        finish(shared, completes);
    }
}

/// Runs one operation (or skips it if the queue has failed, `failed` being its error when the
/// operation was dequeued) and posts its completion.
fn execute(shared: &Shared, op: Op, failed: Option<Arc<str>>) -> Option<(Event, u64, Completion)> {
    let mut completes = None;
    let result: std::result::Result<(), Arc<str>> = match (op, failed) {
        (Op::Record { event, generation }, failed) => {
            // The event completes from the ring's CQE (after a failure it carries the error),
            // once the queue no longer counts this operation as running.
            let posted = post_cpu_completion(shared);
            completes = Some((event, generation, failed.map_or_else(|| posted.clone(), Err)));
            posted
        }
        (Op::Callback(f), Some(why)) => {
            f(Err(Error::OperationFailed { reason: why }));
            Ok(())
        }
        (Op::Callback(f), None) => {
            f(Ok(()));
            post_cpu_completion(shared)
        }
        (_, Some(_)) => Ok(()), // skipped: the queue has failed
        (Op::Copy { dst, src }, None) => {
            if shared.engine == CopyEngine::Kernel && (dst.memfd().is_some() || src.memfd().is_some()) {
                kernel_copy(shared, &dst, &src)
            } else {
                cpu_copy(&dst, &src).and_then(|()| post_deferred_completion(shared))
            }
        }
        (Op::Fill { dst, byte }, None) => cpu_fill(&dst, byte).and_then(|()| post_deferred_completion(shared)),
        (Op::Wait { event, generation }, None) => event
            .wait_generation(generation, None, Some(&shared.closing))
            .map_err(|e| Arc::from(format!("waited-on event failed: {e}")))
            .and_then(|()| post_cpu_completion(shared)),
    };
    if let Err(why) = result {
        let mut s = shared.lock();
        if s.error.is_none() {
            s.error = Some(why);
        }
    }
    completes
}

/// Marks the queue not running, then completes the event a record operation reached.
fn finish(shared: &Shared, completes: Option<(Event, u64, Completion)>) {
    let more = {
        let mut s = shared.lock();
        s.running = false;
        !s.ops.is_empty()
    };
    if more {
        shared.work.notify_one();
    }
    if let Some((event, generation, result)) = completes {
        event.complete(generation, result);
    }
}

fn post_deferred_completion(shared: &Shared) -> std::result::Result<(), Arc<str>> {
    let mut ring = shared.ring.lock().unwrap_or_else(|p| p.into_inner());
    ring.complete_cpu_deferred().map_err(|e| Arc::from(format!("io_uring completion: {e}")))
}

fn post_cpu_completion(shared: &Shared) -> std::result::Result<(), Arc<str>> {
    let mut ring = shared.ring.lock().unwrap_or_else(|p| p.into_inner());
    ring.complete_cpu().map_err(|e| Arc::from(format!("io_uring completion: {e}")))
}
