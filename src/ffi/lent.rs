//! Memory lent to SyncedMemories through the C API (`dmabuf_rt_synced_set_host_data`,
//! `_set_device_data`): while a SyncedMemory may still write or read it, frees of it are
//! refused (`dmabuf_rt_device_free`, `dmabuf_rt_host_free`, and the SyncedMemory that owns it
//! letting it go). A lend holds the registry for writing from before it looks the memory up
//! until it is recorded, and a free holds it for reading from its check through the free, so
//! the two never interleave.

use std::collections::HashMap;
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::queue::Event;

/// What one SyncedMemory borrows.
#[derive(Debug)]
struct Entry {
    /// `(address, length)`.
    ranges: Vec<(usize, usize)>,
    /// Set when the SyncedMemory was destroyed with a push in flight: its ranges stay lent
    /// until the push has run (it reads the host range and writes the device range).
    until: Option<Event>,
}

impl Entry {
    fn in_force(&self) -> bool {
        self.until.as_ref().is_none_or(|e| !e.is_complete())
    }
}

/// The registry, by SyncedMemory handle.
#[derive(Debug, Default)]
pub(crate) struct LentRegistry {
    map: RwLock<HashMap<usize, Entry>>,
}

impl LentRegistry {
    /// For a free: held through the check and the free.
    pub(crate) fn read(&self) -> Reading<'_> {
        Reading(self.map.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// For a lend, or a SyncedMemory letting go of memory: held from the check or the lookup
    /// until the registry is updated.
    pub(crate) fn write(&self) -> Writing<'_> {
        Writing(self.map.write().unwrap_or_else(PoisonError::into_inner))
    }
}

/// Whether some entry other than `except` in force has a range for which `inside(start,
/// length)` holds.
fn any(map: &HashMap<usize, Entry>, except: Option<usize>, inside: impl Fn(usize, usize) -> bool) -> bool {
    map.iter()
        .filter(|&(&h, e)| Some(h) != except && e.in_force())
        .any(|(_, e)| e.ranges.iter().any(|&(s, len)| inside(s, len)))
}

/// Whether `start` lies in the block of `len` bytes at `base`.
fn starts_in(start: usize, base: usize, len: usize) -> bool {
    start >= base && start - base < len
}

/// The registry, read.
pub(crate) struct Reading<'a>(RwLockReadGuard<'a, HashMap<usize, Entry>>);

impl Reading<'_> {
    /// Whether a SyncedMemory may still use a lent range for which `inside(start, length)`
    /// holds. Nothing is lent most of the time: then this costs a length test.
    pub(crate) fn any(&self, inside: impl Fn(usize, usize) -> bool) -> bool {
        !self.0.is_empty() && any(&self.0, None, inside)
    }

    /// Whether a SyncedMemory may still use a lent range that starts inside the block of
    /// `len` bytes at `base`.
    pub(crate) fn any_starting_in(&self, base: usize, len: usize) -> bool {
        self.any(|s, _| starts_in(s, base, len))
    }
}

/// The registry, locked for writing.
pub(crate) struct Writing<'a>(RwLockWriteGuard<'a, HashMap<usize, Entry>>);

impl Writing<'_> {
    /// Whether a SyncedMemory other than `h` may still use a lent range that starts inside
    /// one of `blocks` (`(address, length)`).
    pub(crate) fn lent_from(&self, h: usize, blocks: &[(usize, usize)]) -> bool {
        !blocks.is_empty() && any(&self.0, Some(h), |s, _| blocks.iter().any(|&(b, len)| starts_in(s, b, len)))
    }

    /// SyncedMemory `h` borrows `ranges` now (none: it is forgotten).
    pub(crate) fn set(&mut self, h: usize, ranges: Vec<(usize, usize)>) {
        self.0.retain(|_, e| e.in_force());
        if ranges.is_empty() {
            self.0.remove(&h);
        } else {
            self.0.insert(h, Entry { ranges, until: None });
        }
    }

    /// SyncedMemory `h` is destroyed: what it borrowed stays lent until `push` (its push in
    /// flight, if any) has run.
    pub(crate) fn release(&mut self, h: usize, push: Option<Event>) {
        self.0.retain(|_, e| e.in_force());
        match (self.0.get_mut(&h), push) {
            (Some(e), Some(push)) => e.until = Some(push),
            _ => {
                self.0.remove(&h);
            }
        }
    }
}
