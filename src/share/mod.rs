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
//! ```
//! use dmabuf_rt::share::{Channel, Expect};
//! use dmabuf_rt::source::{MemorySource, ShmemSource};
//! use dmabuf_rt::{Access, SegmentKind};
//!
//! // One end stays here, the other goes to another process (`Channel::into_fd`).
//! let (here, there) = Channel::pair("example")?;
//! let seg = ShmemSource::new().create_segment(4096)?;
//! seg.cpu_access(Access::Write)?.write(0, b"hi")?;
//! here.send_segment(&7u32.to_le_bytes(), &seg)?;
//! // The other side: the segment comes back from the fd, its length from the fd itself.
//! let (tag, got) = there.recv_segment::<[u8; 4]>(&Expect::new(SegmentKind::Unified).min_len(4096))?;
//! let mut hi = [0u8; 2];
//! got.cpu_access(Access::Read)?.read(0, &mut hi)?;
//! assert_eq!((u32::from_le_bytes(tag), &hi), (7, b"hi"));
//! # Ok::<(), dmabuf_rt::Error>(())
//! ```
//!
//! - [`Channel`] (`channel.rs`): typed messages ([`Wire`]) and fds over a seqpacket socket.
//! - [`PoolMessage`] (`message.rs`): the pool protocol's 32-byte message.
//! - [`Ledger`] (`ledger.rs`): which ids are free, held by the owner, or out with a frame.
//! - [`PoolOwner`] (`pool.rs`), [`Peer`] (`peer.rs`), [`PoolBorrower`] (`borrower.rs`).
//!
//! Everything a peer sends that breaks the protocol is an [`Error::Protocol`](crate::Error::Protocol)
//! with the channel's name and the reason, and a peer that hangs up is
//! [`Error::PeerGone`](crate::Error::PeerGone); nothing a peer sends panics this side or
//! leaks an fd. (The zero-copy pipeline of `examples/zero_copy_pipeline/` is built on
//! [`crate::ipc`], whose packets travel over this module's [`Channel`]; its pipes baseline
//! uses this module's [`PoolMessage`] and [`Ledger`].)

mod borrower;
mod channel;
mod ledger;
mod message;
pub(crate) mod packet;
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
