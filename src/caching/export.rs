//! A block shared with another process, as the caching allocator sees it ([`crate::ipc`]): an
//! [`ExportHold`] keeps it out of reuse here until dropped (a free meanwhile puts it in limbo:
//! `pool/limbo.rs`), and [`Exported`] says where its bytes lie in which fd.

use std::sync::Arc;

use super::block::BlockId;
use super::pool::Pool;
use super::shared::AllocatorShared;
use crate::error::{Error, Result};
use crate::segment::Segment;

/// One hold on a shared block: while it lives the block is not reused here, even if freed.
/// Dropping it releases the hold (the last release of a block freed meanwhile completes its
/// free).
pub(crate) struct ExportHold {
    inner: Arc<AllocatorShared>,
    id: BlockId,
    /// The node its release travels in if it cannot take the lock (made with the hold: the
    /// release allocates nothing).
    node: Option<Box<super::free_list::Node<super::block::FreeMsg>>>,
}

impl std::fmt::Debug for ExportHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportHold").field("block", &self.id).finish()
    }
}

impl Drop for ExportHold {
    fn drop(&mut self) {
        // Not waited for where this thread holds the lock already (a memory source's callback
        // releasing a hold), nor in a forked child: the release is then pushed, after any free
        // pushed before it, for the next holder of the lock.
        let held = if rustix::process::getpid() == self.inner.pid {
            self.inner.pool.lock_unless_held_here()
        } else {
            self.inner.pool.try_lock_taking_back()
        };
        match held {
            Some(mut pool) => {
                // Frees pushed before this release are applied first (one of them may be this
                // block's).
                super::shared::drain(&self.inner, &mut pool);
                pool.unhold(self.id);
            }
            None => {
                let mut node = self.node.take().expect("an ExportHold is released once");
                node.value = super::block::FreeMsg::Unhold(self.id);
                self.inner.frees.push(node);
            }
        }
    }
}

/// A block held for sharing: the hold, its segment, the ranges `(offset, len)` of the fd that
/// [`Exported::fd`] returns which hold its bytes in order, and the bytes it was asked for.
#[derive(Debug)]
pub(crate) struct Exported {
    pub(crate) hold: ExportHold,
    pub(crate) segment: Arc<Segment>,
    pub(crate) ranges: Vec<(usize, usize)>,
    pub(crate) len: usize,
}

impl Exported {
    /// A new fd of the pages the ranges name: the segment's own fd (which from then on is never
    /// stitched), or for a page-stitched arena its memfd, whose offsets the ranges are.
    pub(crate) fn fd(&self) -> Result<std::os::fd::OwnedFd> {
        if self.segment.is_stitched() { self.segment.dup_fd() } else { self.segment.try_clone_fd() }
    }
}

/// Holds block `id` of the pool under `pool` (locked, frees drained) for sharing.
pub(crate) fn export_block(inner: &Arc<AllocatorShared>, pool: &mut Pool, id: BlockId, ptr: usize) -> Result<Exported> {
    let refused = |why: &str| Error::UnknownPointer {
        what: "the block to share",
        ptr,
        expected: "a live allocation of this allocator",
        why: why.to_string(),
    };
    let (segment, len) = pool.live_block(id).ok_or_else(|| refused(super::pool::NOT_LIVE))?;
    pool.hold(id).map_err(refused)?;
    let ranges = pool.fd_ranges(id);
    let node = Some(pool.take_node());
    Ok(Exported { hold: ExportHold { inner: Arc::clone(inner), id, node }, segment, ranges, len })
}
