//! [`QueueId`]: a queue's identity, as the allocator, events and the runtime key things by it.

use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering};

/// A queue's identity: unique among the queues of this process, never reused. "No queue" is
/// `Option<QueueId>::None` (PyTorch's default stream; host-side use in the allocator).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct QueueId(NonZeroU64);

impl QueueId {
    /// A new identity, different from every one made before in this process.
    pub(crate) fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        Self(NonZeroU64::new(n).expect("2^64 queues cannot be made"))
    }

    /// The identity from its number (0 is no queue).
    pub(crate) fn from_raw(n: u64) -> Option<Self> {
        NonZeroU64::new(n).map(Self)
    }

    /// Its number (never 0): for tables and JSON that store queues as integers, where 0
    /// stands for no queue.
    pub fn get(self) -> u64 {
        self.0.get()
    }
}

impl std::fmt::Display for QueueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "queue {}", self.0)
    }
}

impl From<QueueId> for u64 {
    fn from(id: QueueId) -> u64 {
        id.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_distinct_nonzero_and_round_trip() {
        let (a, b) = (QueueId::next(), QueueId::next());
        assert_ne!(a, b);
        assert!(a.get() != 0 && b.get() != 0);
        assert_eq!(QueueId::from_raw(a.get()), Some(a));
        assert_eq!(QueueId::from_raw(0), None);
        assert_eq!(std::mem::size_of::<Option<QueueId>>(), 8);
        assert_eq!(a.to_string(), format!("queue {}", a.get()));
    }
}
