//! pdflow-node — the production assembly: a vLLM worker's connector actors, the bootstrap server
//! and the proxy, each built as a supervision tree under one [`supervisor::NodeSupervisor`].
//! Nothing is spawned outside a node; shutting a node down stops everything it started. The
//! Python bridge, `pdflow proxy`, `pdflow bootstrap` and the simulated engine's node
//! (`pdflow-sim-node`) all assemble their actors here.
//!
//! # Layout
//! - [`config`] — one typed config per process, from flags and vLLM's environment variables,
//!   validated before anything binds.
//! - [`ports`] — the engine's connector ports implemented over the actors (where an engine
//!   meets SchedulerConnector / SenderListener / Receiver); [`held_sends`] — P's backstop for
//!   blocks held for a send the actors forgot.
//! - [`worker`] — the worker side of one engine (P's Bootstrap and SenderListener, D's data
//!   server and Receiver): the one place those actors are assembled, for vLLM's workers through
//!   the bridge and for the simulated engine's nodes.
//! - [`registration`] — a vLLM worker's KV registration checked against its place among the
//!   engine's ranks (tensor shares, pipeline split, data-parallel rank, who launches the
//!   bootstrap), before anything is registered or started.
//! - [`bootstrap_node`], [`proxy_node`] — the nodes; [`gpu_kv`] — GPU-resident KV.

pub mod bootstrap_node;
pub mod config;
pub mod gpu_kv;
pub mod held_sends;
pub mod ports;
pub mod proxy_node;
pub mod rdma_offer;
pub mod registration;
pub mod supervisor;
pub mod worker;

pub use bootstrap_node::BootstrapNode;
pub use proxy_node::ProxyNode;
pub use registration::{KvGeometry, KvRegistration, RegistrationError, WorkerTopology};
pub use worker::{BootstrapPlacement, Worker, WorkerSpec};

/// Why a node could not start. Each variant says what failed and keeps its cause, so that a
/// caller can act on it (retry a busy port, name the setting to change, say how to build with GPU
/// support) instead of parsing a message.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{actor} did not start: {reason}")]
    ActorStart { actor: &'static str, reason: String },
    #[error("cannot bind {what} on {addr}: {source} (is the port free? use port 0 for any)")]
    Bind { what: &'static str, addr: String, source: std::io::Error },
    /// An address setting (`what`: which socket it places) whose value is not `ip:port`.
    #[error("the address of {what} {value:?} is not valid: {source} (expected an IP address and a port, such as 127.0.0.1:8998)")]
    InvalidAddress { what: &'static str, value: String, source: std::net::AddrParseError },
    /// A transfer engine (or D's serving of GPU KV) could not start over this node's KV cache.
    #[error("the {engine} could not start: {source}")]
    TransferStart { engine: TransferPart, source: Box<dyn std::error::Error + Send + Sync + 'static> },
    /// KV in GPU memory, in a build without the `cuda` feature.
    #[error("KV cache on GPU {device}: this pdflow was built without GPU support (build it with `--features cuda`)")]
    NoGpuSupport { device: usize },
    /// `transport: rdma` in a build without the `rdma` feature.
    #[error("transport rdma: this pdflow was built without RDMA support (build it with `--features rdma`, which needs libfabric-dev)")]
    NoRdmaSupport,
}

/// The part of the data plane a [`NodeError::TransferStart`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferPart {
    /// P's GPU transfer engine (cuda-peer, cuda-ipc or cuda-staged) over the KV on `device`.
    GpuEngine { device: usize },
    /// D's offer of its GPU KV (CUDA IPC handles) and its staged receiver.
    GpuServing { device: usize },
    /// D's GPU KV as a cuda-peer of this process's P engines.
    LocalPeer { device: usize },
    /// D's RDMA endpoint (`transport: rdma`).
    RdmaEndpoint,
}

impl std::fmt::Display for TransferPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TransferPart::GpuEngine { device } => write!(f, "GPU transfer engine on GPU {device}"),
            TransferPart::GpuServing { device } => write!(f, "serving of the GPU KV on GPU {device}"),
            TransferPart::LocalPeer { device } => write!(f, "cuda-peer registration of the GPU KV on GPU {device}"),
            TransferPart::RdmaEndpoint => write!(f, "RDMA endpoint"),
        }
    }
}

impl NodeError {
    /// Whether retrying later may help: a port still held (by a previous incarnation).
    pub fn is_bind(&self) -> bool {
        matches!(self, NodeError::Bind { .. })
    }
}

/// Waits for a freshly spawned actor's `on_start` and turns its failure into a [`NodeError`].
pub async fn started<A: kameo::Actor>(actor: &'static str, r: &kameo::actor::ActorRef<A>) -> Result<(), NodeError>
where
    A::Error: std::fmt::Display,
{
    r.wait_for_startup_with_result(|res| res.map_err(|e| NodeError::ActorStart { actor, reason: e.to_string() })).await
}

/// Resolves port 0 to a concrete free port, so that an actor its supervisor restarts binds the
/// same address as before (clients and registrations keep working). A port already given is
/// returned as is.
pub fn fixed_port(addr: std::net::SocketAddr, what: &'static str) -> Result<std::net::SocketAddr, NodeError> {
    if addr.port() != 0 {
        return Ok(addr);
    }
    let probe =
        std::net::TcpListener::bind(addr).map_err(|source| NodeError::Bind { what, addr: addr.to_string(), source })?;
    probe.local_addr().map_err(|source| NodeError::Bind { what, addr: addr.to_string(), source })
}
