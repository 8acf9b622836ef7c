//! Transfer engines: P writes a [`TransferPlan`] from its registered memory into D's (seed step 29,
//! P-push). The trait has that one job; backends differ in how bytes move.
//!
//! - [`tcp`] — the default everywhere: D runs a [`tcp::TcpDataServer`] over its region table and
//!   writes each payload straight into registered memory, refusing any descriptor outside a region;
//!   P's [`tcp::TcpTransferEngine`] keeps a pool of connections per peer and splits a batch across them.
//! - [`same_host`] — when P and D share a host, P writes D's memory directly (`process_vm_writev`),
//!   with the same region checks.
//! - [`rdma`] (feature `rdma`) — one-sided RDMA WRITEs through libfabric into the blocks D
//!   granted in its pull (verbs and efa NICs; the software `tcp` provider anywhere).
//! - [`AutoTransferEngine`] (the node's engine) picks per peer: RDMA when D granted it and this
//!   host opens D's provider, same-host when D's data server offers it and the kernel allows it,
//!   tcp otherwise; [`TransferEngine::backend_for`] tells which.

mod auto;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod fence;
mod gpu_path;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod same_host;
pub mod tcp;
#[cfg(test)]
mod test_blocks;

pub use auto::AutoTransferEngine;
pub use gpu_path::GpuPath;

use std::time::Duration;

use futures::future::BoxFuture;

use pdflow_kv::memory::RegionError;
use pdflow_kv::planner::TransferPlan;

/// Whether the rdma backend runs here on `provider` (libfabric's name) on the interface holding
/// `host`: `Err` says why not (a build without the `rdma` feature, libfabric missing, the provider
/// unavailable).
pub fn rdma_runs_here(provider: &str, host: &str) -> Result<(), String> {
    #[cfg(feature = "rdma")]
    {
        rdma::fabric::Domain::open(provider, host).map(|_| ()).map_err(|e| e.to_string())
    }
    #[cfg(not(feature = "rdma"))]
    {
        let _ = (provider, host);
        Err("this pdflow was built without the rdma feature (build with --features rdma)".to_string())
    }
}

/// The NIC's provider (`verbs`, `efa`) `auto` would offer RDMA on, on the interface holding
/// `host`; `Err` says why there is none.
pub fn rdma_nic_provider(host: &str) -> Result<String, String> {
    #[cfg(feature = "rdma")]
    {
        rdma::hardware_provider(host).map_err(|e| e.to_string())
    }
    #[cfg(not(feature = "rdma"))]
    {
        let _ = host;
        Err("this pdflow was built without the rdma feature (build with --features rdma)".to_string())
    }
}

/// What one write moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TransferStats {
    pub bytes: u64,
    pub descriptors: usize,
    pub duration: Duration,
}

/// Why a write failed. After any error the destination bytes are undefined: D must not use them.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("cannot connect to the peer's data server at {peer}: {source} (is D's data server up and reachable?)")]
    Connect { peer: String, source: std::io::Error },
    #[error("data connection to {peer} failed mid-transfer: {source}")]
    Io { peer: String, source: std::io::Error },
    #[error("the peer at {peer} refused the write: {reason}")]
    Refused { peer: String, reason: String },
    #[error("a source descriptor is not in this worker's registered memory: {0}")]
    LocalRegion(#[from] RegionError),
    #[error("{}", pdflow_messages::lifecycle::TransferState::Writing.passed(*deadline, format!("the write to {peer} did not finish")))]
    Timeout { peer: String, deadline: Duration },
    #[error("the same-host path to {peer} is required but unavailable: {reason}")]
    SameHostUnavailable { peer: String, reason: String },
}

/// Writes plans into peers' registered memory.
pub trait TransferEngine: Send + Sync + 'static {
    /// The backend's name (`tcp`, `auto`, …), for logs and benchmarks.
    fn name(&self) -> &'static str;

    /// The backend that writes (or last wrote) to `peer`: `tcp` or `same-host` for the automatic
    /// engine, [`TransferEngine::name`] for single-backend engines. For step 29's span.
    fn backend_for(&self, peer: &str) -> &'static str {
        let _ = peer;
        self.name()
    }

    /// The RDMA provider that wrote (or last wrote) to `peer`, when the backend is `rdma`.
    fn provider_for(&self, peer: &str) -> Option<String> {
        let _ = peer;
        None
    }

    /// Gets ready to write to `peer` — connections made, handshakes done, the path chosen — so
    /// that a write that follows starts at once. Called while P still prefills (a pull that came
    /// early): the data channel's handshake overlaps the prefill instead of preceding the write.
    /// Best effort and bounded by the engine's connect deadline; a failure here costs nothing, as
    /// the write makes its own connections. The default does nothing.
    fn prepare<'a>(&'a self, peer: &'a str) -> BoxFuture<'a, Result<(), TransferError>> {
        let _ = peer;
        Box::pin(async { Ok(()) })
    }

    /// Writes every descriptor of `plan` (src: this worker's memory, dst: the peer's) to the peer
    /// whose data server listens at `peer` (`host:port`). Returns once every byte is in the
    /// peer's memory (the peer acknowledged), or with an error.
    fn write<'a>(
        &'a self,
        peer: &'a str,
        plan: &'a TransferPlan,
    ) -> BoxFuture<'a, Result<TransferStats, TransferError>>;
}
