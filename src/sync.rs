//! Synchronisation primitives used by the lock-free paths, swapped for loom's model-checked
//! versions under `--cfg loom` (see `loom-tests/`), so loom checks the real code.

#[cfg(loom)]
pub(crate) use loom::cell::UnsafeCell;
#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicPtr, AtomicUsize, Ordering, fence};
#[cfg(loom)]
pub(crate) use loom::sync::{Condvar, Mutex};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering, fence};
#[cfg(not(loom))]
pub(crate) use std::sync::{Condvar, Mutex};

// The caching allocator's biased lock (`caching/pool_lock.rs`). loom's `Mutex` returns std's
// `LockResult` and `TryLockError`, and never poisons.
#[cfg(loom)]
pub(crate) use loom::sync::MutexGuard;
#[cfg(loom)]
pub(crate) use loom::sync::atomic::AtomicU64;
#[cfg(not(loom))]
pub(crate) use std::sync::MutexGuard;
pub(crate) use std::sync::TryLockError;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::AtomicU64;

/// `std::cell::UnsafeCell` with loom's closure API, so the same code compiles both ways and
/// loom can see every access.
#[cfg(not(loom))]
#[derive(Debug)]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    pub(crate) fn new(v: T) -> Self {
        Self(std::cell::UnsafeCell::new(v))
    }

    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }

    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}
