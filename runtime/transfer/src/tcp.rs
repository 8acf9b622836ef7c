//! The `tcp` transfer backend, the default everywhere: seed step 29 (P writes the KV
//! bytes into D's blocks) over plain TCP.
//!
//! - [`TcpDataServer`] (D) listens, authenticates each connection, checks every descriptor against
//!   D's [`RegionTable`](pdflow_kv::memory::RegionTable) and reads each payload straight into the
//!   registered destination.
//! - [`TcpTransferEngine`] (P) implements [`TransferEngine`](super::TransferEngine): it checks the
//!   source descriptors against P's regions, splits a plan by bytes across a pool of connections per
//!   peer, writes straight from P's memory and waits for every ack.
//! - [`wire`] is the binary protocol between them; [`TcpConfig`] how P connects and writes.
//!
//! Step spans (`step.29.p_transfer_write`) belong to the caller (the send worker), which knows the
//! request and transfer ids; this module only logs at debug level.

mod ack_wait;
mod blocking_io;
mod busy_poll;
mod config;
mod connection;
mod engine;
mod link;
mod server;
mod stream;
pub mod wire;

pub use config::{RdmaMode, TcpConfig, TlsSetupError};
#[cfg(feature = "cuda")]
pub(crate) use connection::constant_time_eq;
pub(crate) use engine::split_by_bytes;
#[cfg(any(feature = "cuda", test))]
pub(crate) use engine::still_open;
pub use engine::{FenceHold, TcpTransferEngine};
pub use server::{DataServerError, DataServerOptions, TcpDataServer, DEFAULT_MAX_CONNECTIONS};

/// Socket buffer size asked of the OS on both ends (it may grant less).
const SOCKET_BUFFER_BYTES: u32 = 4 << 20;

#[cfg(test)]
mod auth_tests;
#[cfg(test)]
mod fuzz_tests;
#[cfg(test)]
mod protected_tests;
#[cfg(test)]
pub(crate) mod test_side;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tls_tests;
