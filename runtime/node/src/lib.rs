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
//!   meets SchedulerConnector / SenderListener / Receiver).
//! - [`worker`] — the worker side of one engine (P's Bootstrap and SenderListener, D's data
//!   server and Receiver): the one place those actors are assembled, for vLLM's workers through
//!   the bridge and for the simulated engine's nodes.
//! - [`bootstrap_node`], [`proxy_node`] — the nodes; [`gpu_kv`] — GPU-resident KV.

pub mod bootstrap_node;
pub mod config;
pub mod gpu_kv;
pub mod ports;
pub mod proxy_node;
pub mod supervisor;
pub mod worker;

pub use bootstrap_node::BootstrapNode;
pub use proxy_node::ProxyNode;
pub use worker::{BootstrapPlacement, Worker, WorkerSpec};

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{actor} did not start: {reason}")]
    ActorStart { actor: &'static str, reason: String },
    #[error("cannot bind the {what} on {addr}: {source} (is the port free? use port 0 for any)")]
    Bind { what: &'static str, addr: String, source: std::io::Error },
    #[error("the transfer engine could not start: {0}")]
    Transfer(String),
    #[error("{0}")]
    Config(String),
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
