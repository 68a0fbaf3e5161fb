//! Sharing blocks of a caching allocator between processes: IPC handles in the style of
//! `cudaIpcGetMemHandle` / `cudaIpcOpenMemHandle`, honest about fds.
//!
//! ```text
//!  producer                                          consumer
//!  IpcExporter::export(&block)  -- SEGMENT + fd (once per segment) -->  IpcImporter
//!    (holds the block)          -- SHARE export, ranges ------------->    (maps each segment once)
//!    returns IpcHandle (64 bytes) ... sent by any means ... ------------> IpcImporter::open(&handle)
//!  hold released <-------------------------- RELEASE export ---------  drop(ImportedBlock)
//!  hold released <-------------------------- end of file ------------  consumer exits or is killed
//! ```
//!
//! - A segment's fd goes to a peer once; every later block of it is offsets only, so a process
//!   sharing 10,000 tensors holds as many fds as segments, not tensors. Once the producer's
//!   allocator lets a segment go, the next export tells the peer (GONE), which closes its copy
//!   ([`IpcImporter::poll`] takes that in without opening anything).
//! - Limbo: a block shared with a peer is held until the peer releases it. Freed by its
//!   producer meanwhile, it is not reused: it waits in limbo (`DeviceStats::limbo_bytes`), and
//!   `empty_cache` cannot return it. A consumer that exits or is killed releases what it held
//!   (the kernel closes its end of the socket: the exporter's reader thread sees end of file).
//! - Pending work: `export(block, Some(queue))` waits for what the producer's queue has
//!   queued so far before the share is sent, so the consumer never reads bytes still being
//!   written.
//! - Bad input: a handle with no export on the channel, or whose segment, offset or length
//!   disagree with the export, is refused ([`Error::InvalidArgument`](crate::Error)); an fd
//!   that is not a sealed memfd or a dma-buf, ranges outside their segment, and any malformed
//!   packet are the peer's [`Error::Protocol`](crate::Error::Protocol).
//!
//! Two ways to connect:
//! - a [`Channel`](crate::share::Channel) pair, one end handed to the other process (inherited
//!   over `fork`/`exec`, or sent over another socket): [`IpcExporter`] and [`IpcImporter`];
//! - process-wide handles, as CUDA's ([`get_handle`], [`open_handle`]): any process of the
//!   same user that gets the handle's 64 bytes opens it; the first handle starts this
//!   process's IPC socket (an abstract Unix socket named by the pid and a random token the
//!   handle carries), and an importing process connects once per exporting process; one that
//!   cannot reach that socket (another network namespace) takes the exporter's *door* with
//!   `pidfd_getfd` where the kernel permits it, and connects through it.
//!
//! - [`IpcHandle`] (`handle.rs`), the protocol's packets (`wire.rs`), [`IpcExporter`]
//!   (`exporter.rs`), [`IpcImporter`] and [`ImportedBlock`] (`importer.rs`), process-wide
//!   handles (`server.rs`).

mod exporter;
mod handle;
mod importer;
mod server;
mod wire;

pub use exporter::{IpcExporter, SEND_TIMEOUT};
pub use handle::{HANDLE_BYTES, IpcHandle};
pub use importer::{ImportedBlock, IpcImporter};
pub use server::{OPEN_TIMEOUT, get_handle, get_handle_raw, open_handle, revoke_handle, unopened_handles};
pub use wire::MAX_RUNS;
