//! A memory source that counts its own drops, for the tests that check the caching
//! allocator's shared state goes exactly once, with its last handle or allocation (the pool
//! owns the source, so it is dropped when the shared state is; `Weak` is not reachable from
//! outside the crate), and that runs a hook under the pool's lock.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use dmabuf_rt::caching::{CachingAllocator, Config};
use dmabuf_rt::error::Result as DResult;
use dmabuf_rt::segment::{Segment, SegmentKind};
use dmabuf_rt::source::{MemorySource, ShmemSource};

pub type Hook = Arc<dyn Fn() + Send + Sync>;

/// A shmem source that counts its own drops (the pool owns it: it goes with the allocator's
/// shared state), and calls a hook, if one is set, from `create_segment` and
/// `reserve_expandable`, which the pool calls under its lock.
pub struct Tracked {
    inner: ShmemSource,
    drops: Arc<AtomicUsize>,
    hook: Arc<Mutex<Option<Hook>>>,
    calls: Arc<AtomicUsize>,
}

impl std::fmt::Debug for Tracked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracked").finish_non_exhaustive()
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.drops.fetch_add(1, SeqCst);
    }
}

impl Tracked {
    fn call_hook(&self) {
        // Cloned out: the hook runs without this mutex (it may panic).
        let hook = self.hook.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(h) = hook {
            self.calls.fetch_add(1, SeqCst);
            h();
        }
    }
}

impl MemorySource for Tracked {
    fn name(&self) -> String {
        "tracked".into()
    }
    fn kind(&self) -> SegmentKind {
        self.inner.kind()
    }
    fn create_segment(&self, len: usize) -> DResult<Segment> {
        self.call_hook();
        self.inner.create_segment(len)
    }
    fn reserve_expandable(&self, len: usize) -> DResult<Segment> {
        self.call_hook();
        self.inner.reserve_expandable(len)
    }
}

/// What the test keeps of a tracked allocator's source.
#[derive(Clone)]
pub struct Probe {
    drops: Arc<AtomicUsize>,
    hook: Arc<Mutex<Option<Hook>>>,
    /// Hook calls made so far.
    pub calls: Arc<AtomicUsize>,
}

impl Probe {
    /// How many times the source was dropped.
    pub fn dropped(&self) -> usize {
        self.drops.load(SeqCst)
    }
    pub fn set_hook(&self, h: impl Fn() + Send + Sync + 'static) {
        *self.hook.lock().unwrap() = Some(Arc::new(h));
    }
    pub fn clear_hook(&self) {
        *self.hook.lock().unwrap() = None;
    }
}

/// An allocator (settings `conf`, 4 GiB of capacity) over a fresh tracked source, and its probe.
pub fn tracked(conf: &str) -> (CachingAllocator, Probe) {
    let probe = Probe {
        drops: Arc::new(AtomicUsize::new(0)),
        hook: Arc::new(Mutex::new(None)),
        calls: Arc::new(AtomicUsize::new(0)),
    };
    let src = Tracked {
        inner: ShmemSource::new().reserve(false),
        drops: probe.drops.clone(),
        hook: probe.hook.clone(),
        calls: probe.calls.clone(),
    };
    let a = CachingAllocator::builder(src).config(Config::parse(conf).unwrap()).capacity(4 << 30).build().unwrap();
    (a, probe)
}
