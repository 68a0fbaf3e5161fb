//! Sharing segments between processes: fds over Unix sockets (`SCM_RIGHTS`), and pools whose
//! buffers go out to other processes and come back to their owner.
//!
//! ```text
//!            PoolOwner::send                 PoolBorrower::forward             PoolBorrower::recv
//!  owner ---- Frame(id, seq, len) [+ fd] ----> borrower ---- Frame [+ fd] ----> borrower
//!  (PoolOwner: segments + Ledger)              (caches segments by id)              |
//!     ^---------------- Return(id, seq): PoolOwner::recv_return <---- give_back ----+
//! ```
//!
//! Where the flow enters: a [`Channel`] pair ([`Channel::pair`], then one end handed to the
//! other process, or [`Channel::from_fd`] on an fd it inherited or received) and the segments
//! of a memory source ([`PoolOwner::allocate`], or a [`Segment`](crate::Segment) sent
//! alone with [`Channel::send_segment`] / [`Channel::send_range`]). Every message is one
//! packet of the socket; what arrives is checked in [`Channel::recv`] (size, fds, truncation,
//! hang-up) and then by the protocol above it ([`PoolBorrower::recv`], [`Ledger::recv_return`]).
//! Where it leaves: a receiver holds [`Segment`](crate::Segment)s rebuilt from the fds
//! ([`PoolBorrower::segment`], [`Channel::recv_segment`], [`SharedRange`]) and reaches their
//! bytes only through [`CpuView`](crate::CpuView)s; buffers go back to their owner as
//! returns, and a buffer's memory is freed when the last process holding its fd drops it.
//!
//! - [`Channel`] (`channel.rs`): typed messages ([`Wire`]) and fds over a seqpacket socket.
//! - [`PoolMessage`] (`message.rs`): the pool protocol's 32-byte message.
//! - [`Ledger`] (`ledger.rs`): which ids are free, held by the owner, or out with a frame.
//! - [`PoolOwner`] (`pool.rs`), [`Peer`] (`peer.rs`), [`PoolBorrower`] (`borrower.rs`).
//!
//! Everything a peer sends that breaks the protocol is an [`Error::Protocol`](crate::Error::Protocol)
//! with the channel's name and the reason, and a peer that hangs up is
//! [`Error::PeerGone`](crate::Error::PeerGone); nothing a peer sends panics this side or
//! leaks an fd. `examples/zero_copy_pipeline/` builds a three-process pipeline on this module.

mod borrower;
mod channel;
mod ledger;
mod message;
mod packet;
mod peer;
mod pool;
#[cfg(test)]
mod tests;

pub use borrower::{Incoming, PoolBorrower};
pub use channel::{Channel, Expect, MAX_MESSAGE, Ranged, Received, SharedRange, Wire};
pub use ledger::{Ledger, MAX_BUFFERS};
pub use message::{BufferId, Frame, PoolMessage};
pub use peer::Peer;
pub use pool::PoolOwner;
