//! Events: points in a queue's work, or kernel fences, that complete once.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::QueueId;
use crate::error::{Error, Result};

/// What a completion hook is told: success, or why the event failed.
pub type Completion = std::result::Result<(), Arc<str>>;

type Hook = Box<dyn FnOnce(Completion) + Send>;

/// Runs completion hooks, containing panics.
fn run(hooks: Vec<Hook>, result: &Completion) {
    for hook in hooks {
        let r = result.clone();
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(r))).is_err() {
            log::error!("an event completion hook panicked");
        }
    }
}

/// Which queue each blocked executor waits for: host callbacks that wait (synchronize another
/// stream, an event, a device) are edges of a wait-for graph, and a wait that would close a
/// cycle could never end.
static WAITS: Mutex<Vec<Waiting>> = Mutex::new(Vec::new());

/// Queue `me`'s executor waits for `generation` of `event`, recorded on queue `on`.
struct Waiting {
    me: QueueId,
    on: QueueId,
    event: Event,
    generation: u64,
}

/// An entry of [`WAITS`] for as long as a wait lasts.
struct WaitEdge(QueueId);

impl WaitEdge {
    /// Enters "queue `me` waits for `generation` of `event`, recorded on queue `on`", unless
    /// that closes a cycle of executors blocked on each other. An edge counts only while its
    /// generation is pending: one whose generation has completed belongs to a thread about to
    /// wake, not to a blocked one. With every generation on a cycle pending, each is queued
    /// behind the wait that blocks its queue, so none can ever complete.
    ///
    /// Lock order: `WAITS`, then an event's state; callers hold no event lock.
    fn enter(me: QueueId, on: QueueId, event: &Event, generation: u64) -> Result<WaitEdge> {
        let mut waits = WAITS.lock().unwrap_or_else(|p| p.into_inner());
        let mut at = on;
        for _ in 0..=waits.len() {
            if at == me {
                return Err(Error::WouldDeadlock {
                    what: if on == me {
                        "a host callback waited for work queued on its own queue after it (an event recorded \
                         there, or a synchronize of that queue)"
                    } else {
                        "a host callback waited for another queue that is itself blocked, directly or through \
                         other queues, waiting for work queued on this callback's queue after it"
                    },
                });
            }
            let blocked = waits.iter().find(|w| w.me == at && !w.event.is_generation_complete(w.generation));
            match blocked {
                Some(w) => at = w.on,
                None => break,
            }
        }
        waits.push(Waiting { me, on, event: event.clone(), generation });
        Ok(WaitEdge(me))
    }
}

impl Drop for WaitEdge {
    fn drop(&mut self) {
        let mut waits = WAITS.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = waits.iter().position(|w| w.me == self.0) {
            waits.swap_remove(i);
        }
    }
}

/// A marker in a queue (like a CUDA event) or a kernel fence.
///
/// An event is *recorded* on a queue ([`crate::queue::Queue::record`]) and *completes* when the
/// queue reaches it, i.e. after everything submitted to that queue before it; or it wraps a
/// sync_file fd and completes when the kernel signals the fence. Recording it again starts a
/// new generation: queries and waits then refer to the latest record. A never-recorded event
/// counts as complete. Cloning shares the event.
#[derive(Clone)]
pub struct Event {
    inner: Arc<EventShared>,
}

struct EventShared {
    state: Mutex<State>,
    cv: Condvar,
}

#[derive(Default)]
struct State {
    /// Generations recorded so far (0: never recorded).
    recorded: u64,
    /// Every generation up to this one has completed.
    done_upto: u64,
    /// Generations above `done_upto` that completed out of order (an event re-recorded on a
    /// faster queue).
    done_above: BTreeSet<u64>,
    /// Generations that failed, and why.
    failures: BTreeMap<u64, Arc<str>>,
    /// The latest recorded generation's completion time, once it has completed.
    at: Option<(u64, Instant)>,
    /// Hooks waiting for a generation.
    hooks: Vec<(u64, Hook)>,
    /// Threads blocked in a wait (so completion wakes only when someone sleeps).
    sleepers: usize,
    /// The queue each pending generation was recorded on (kernel fences have none): a wait on
    /// such a generation from that queue's own executor thread (a callback) could never end.
    owners: BTreeMap<u64, QueueId>,
}

impl State {
    fn is_done(&self, generation: u64) -> bool {
        generation <= self.done_upto || self.done_above.contains(&generation)
    }

    fn result_for(&self, generation: u64) -> Option<Completion> {
        if !self.is_done(generation) {
            return None;
        }
        match self.failures.get(&generation) {
            Some(why) => Some(Err(why.clone())),
            None => Some(Ok(())),
        }
    }

    fn mark_done(&mut self, generation: u64) {
        if !self.owners.is_empty() {
            self.owners.remove(&generation);
        }
        if generation <= self.done_upto {
            return;
        }
        self.done_above.insert(generation);
        while self.done_above.remove(&(self.done_upto + 1)) {
            self.done_upto += 1;
        }
    }
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("Event")
            .field("recorded", &s.recorded)
            .field("done_upto", &s.done_upto)
            .field("failures", &s.failures.len())
            .finish()
    }
}

impl Default for Event {
    fn default() -> Self {
        Self::new()
    }
}

impl Event {
    /// A new, never-recorded event (it counts as complete).
    pub fn new() -> Self {
        Self { inner: Arc::new(EventShared { state: Mutex::new(State::default()), cv: Condvar::new() }) }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a new generation; returns it.
    pub(crate) fn begin_record(&self) -> u64 {
        let mut s = self.lock();
        s.recorded += 1;
        s.recorded
    }

    /// Starts a new generation recorded on queue `queue`; returns it.
    pub(crate) fn begin_record_on(&self, queue: QueueId) -> u64 {
        let mut s = self.lock();
        s.recorded += 1;
        let generation = s.recorded;
        s.owners.insert(generation, queue);
        generation
    }

    /// Records a new generation that is complete at once (a record on a stream that has no
    /// work outstanding by construction, such as the runtime's synchronous stream).
    pub(crate) fn record_complete(&self) {
        let generation = self.begin_record();
        self.complete(generation, Ok(()));
    }

    /// Whether nobody but the caller holds this event, and no completion hook waits for it:
    /// its completion would reach no one (the fence watcher then stops watching its fd).
    pub(crate) fn is_unobserved(&self) -> bool {
        Arc::strong_count(&self.inner) == 1 && self.lock().hooks.is_empty()
    }

    /// Whether the latest record is pending on queue `queue` (its completion then waits for
    /// everything that queue runs before it).
    pub(crate) fn pending_on(&self, queue: QueueId) -> bool {
        let s = self.lock();
        s.owners.get(&s.recorded) == Some(&queue)
    }

    /// Completes `generation`, successfully or not, on this thread: runs the hooks waiting for
    /// it, then marks it done and wakes its waiters. A panicking hook is contained (and
    /// reported on stderr): it must not take the completing thread down with it.
    pub(crate) fn complete(&self, generation: u64, result: Completion) {
        self.run_hooks(generation, &result);
        self.mark_complete(generation, result)();
    }

    /// First half of [`Event::complete`]: runs the hooks registered for `generation` (and any
    /// registered while they run), outside the event's lock. The generation is not yet seen
    /// as complete, so anyone who sees it complete knows its hooks have run.
    pub(crate) fn run_hooks(&self, generation: u64, result: &Completion) {
        loop {
            let ready: Vec<Hook> = {
                let mut s = self.lock();
                if !s.hooks.iter().any(|(g, _)| *g == generation) {
                    return;
                }
                let (ready, waiting): (Vec<_>, Vec<_>) = s.hooks.drain(..).partition(|(g, _)| *g == generation);
                s.hooks = waiting;
                ready.into_iter().map(|(_, h)| h).collect()
            };
            run(ready, result);
        }
    }

    /// Second half of [`Event::complete`]: marks `generation` done and wakes its waiters.
    /// Returns what runs the hooks registered between the halves, after the fact; the caller
    /// runs it once it holds no lock.
    #[must_use = "the returned closure runs hooks registered late"]
    pub(crate) fn mark_complete(&self, generation: u64, result: Completion) -> impl FnOnce() + use<> {
        let late: Vec<Hook> = {
            let mut s = self.lock();
            if let Err(why) = &result {
                s.failures.insert(generation, why.clone());
            }
            s.mark_done(generation);
            if generation == s.recorded {
                s.at = Some((generation, Instant::now()));
            }
            let late: Vec<Hook> = if s.hooks.is_empty() {
                Vec::new()
            } else {
                let (ready, waiting): (Vec<_>, Vec<_>) = s.hooks.drain(..).partition(|(g, _)| *g == generation);
                s.hooks = waiting;
                ready.into_iter().map(|(_, h)| h).collect()
            };
            if s.sleepers > 0 {
                self.inner.cv.notify_all();
            }
            late
        };
        move || run(late, &result)
    }

    /// Whether `generation` has completed (successfully or not).
    pub(crate) fn is_generation_complete(&self, generation: u64) -> bool {
        self.lock().is_done(generation)
    }

    /// The generation a wait submitted now refers to.
    pub(crate) fn current_generation(&self) -> u64 {
        self.lock().recorded
    }

    /// `Ok(true)` when complete, `Ok(false)` while pending, the failure if it failed.
    pub fn query(&self) -> Result<bool> {
        let s = self.lock();
        match s.result_for(s.recorded) {
            None => Ok(false),
            Some(Ok(())) => Ok(true),
            Some(Err(reason)) => Err(Error::OperationFailed { reason }),
        }
    }

    /// True once the latest record has completed (successfully or not).
    pub fn is_complete(&self) -> bool {
        let s = self.lock();
        s.is_done(s.recorded)
    }

    /// Blocks until the latest record completes, or `timeout` passes (`None`: no limit).
    pub fn synchronize(&self, timeout: Option<Duration>) -> Result<()> {
        let generation = self.current_generation();
        self.wait_generation(generation, timeout, None)
    }

    /// Waits for `generation`; gives up on `timeout` or when `cancel` becomes true. `cancel`
    /// is checked under the event's lock: whoever sets it must then call
    /// [`Event::wake_waiters`] (no polling).
    pub(crate) fn wait_generation(
        &self,
        generation: u64,
        timeout: Option<Duration>,
        cancel: Option<&AtomicBool>,
    ) -> Result<()> {
        let start = Instant::now();
        // Declared before the state guard: dropped after it (WAITS is never taken while an
        // event's lock is held).
        let mut _edge: Option<WaitEdge> = None;
        let mut checked = false;
        let mut s = self.lock();
        loop {
            if let Some(r) = s.result_for(generation) {
                return r.map_err(|reason| Error::OperationFailed { reason });
            }
            if !checked {
                checked = true;
                if let (Some(&q), Some(me)) = (s.owners.get(&generation), super::executing_queue()) {
                    // A queue's executor (a host callback, or a wait operation) is about to wait
                    // for work on queue `q`: refused if that can never end. Unbounded waits
                    // enter the wait-for graph; a bounded one ends anyway, and only the plain
                    // self-wait is refused.
                    drop(s);
                    if timeout.is_none() {
                        _edge = Some(WaitEdge::enter(me, q, self, generation)?);
                    } else if q == me && !self.is_generation_complete(generation) {
                        return Err(Error::WouldDeadlock {
                            what: "a host callback waited for work queued on its own queue after it",
                        });
                    }
                    s = self.lock();
                    continue;
                }
            }
            if cancel.is_some_and(|c| c.load(Ordering::Acquire)) {
                return Err(Error::OperationFailed { reason: "queue dropped while waiting for an event".into() });
            }
            s.sleepers += 1;
            s = match timeout {
                Some(t) => {
                    let left = t.saturating_sub(start.elapsed());
                    if left.is_zero() {
                        s.sleepers -= 1;
                        return Err(Error::Timeout { what: "event", waited: t });
                    }
                    self.inner.cv.wait_timeout(s, left).unwrap_or_else(|p| p.into_inner()).0
                }
                None => self.inner.cv.wait(s).unwrap_or_else(|p| p.into_inner()),
            };
            s.sleepers -= 1;
        }
    }

    /// Wakes every thread blocked waiting on this event, so that it looks again at what it
    /// waits for (a cancel flag set since).
    pub(crate) fn wake_waiters(&self) {
        let s = self.lock();
        if s.sleepers > 0 {
            self.inner.cv.notify_all();
        }
    }

    /// Time from `earlier`'s completion to this event's (both must have completed).
    pub fn elapsed_since(&self, earlier: &Event) -> Result<Duration> {
        let end = self.completed_at()?;
        let start = earlier.completed_at()?;
        Ok(end.saturating_duration_since(start))
    }

    fn completed_at(&self) -> Result<Instant> {
        let s = self.lock();
        if s.recorded == 0 {
            return Err(Error::NoTiming { why: "never recorded" });
        }
        match s.at {
            Some((g, at)) if g == s.recorded => Ok(at),
            _ => Err(Error::NoTiming { why: "not complete yet" }),
        }
    }

    /// Runs `hook` once the latest record completes: at once (on this thread) if it already
    /// has, else on the thread that completes it (a queue's executor or the fence watcher).
    /// This is the completion hook other modules use: no polling, and the completing side
    /// takes no lock but the event's own. Hooks run before the completion is visible: whoever
    /// sees the event complete (a wait, a query, a later record on the same queue) knows its
    /// hooks have run. So hooks must be quick, must not block, and must not wait on this event.
    pub fn on_complete(&self, hook: impl FnOnce(Completion) + Send + 'static) {
        let mut s = self.lock();
        let generation = s.recorded;
        match s.result_for(generation) {
            Some(r) => {
                drop(s);
                hook(r);
            }
            None => s.hooks.push((generation, Box::new(hook))),
        }
    }
}
