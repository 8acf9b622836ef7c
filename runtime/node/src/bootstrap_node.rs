//! A bootstrap node: the Bootstrap actor alone (`pdflow bootstrap`), or inside P's node when P's
//! TP0 launches it (seed step 2).

use std::net::SocketAddr;

use kameo::prelude::*;
use kameo::supervision::RestartPolicy;
use pdflow_actors::bootstrap::{Bootstrap, BootstrapArgs};
use pdflow_actors::fault_seam::{no_faults, register_actor, ActorKind, Faults, Role};
use pdflow_auth::ClusterSecret;
use pdflow_messages::bootstrap::BootstrapAddr;

use super::supervisor::{NodeSupervisor, MAX_RESTARTS, RESTART_WINDOW};
use super::{started, NodeError};

/// A running bootstrap server.
pub struct BootstrapNode {
    pub addr: SocketAddr,
    pub bootstrap: ActorRef<Bootstrap>,
    supervisor: Option<ActorRef<NodeSupervisor>>,
}

impl BootstrapNode {
    /// Starts a bootstrap server under its own supervisor, serving every caller from loopback
    /// (no secret: protected mode).
    pub async fn start(bind: SocketAddr) -> Result<Self, NodeError> {
        Self::start_with(bind, None, false, &no_faults()).await
    }

    /// [`BootstrapNode::start`], serving only callers that prove `secret` (when given; without
    /// it, only loopback callers unless `insecure`), its actor offered to `faults`.
    pub async fn start_with(
        bind: SocketAddr,
        secret: Option<ClusterSecret>,
        insecure: bool,
        faults: &Faults,
    ) -> Result<Self, NodeError> {
        let supervisor = NodeSupervisor::spawn("bootstrap".to_string());
        let mut node = Self::start_under(&supervisor, bind, secret, insecure, faults).await?;
        node.supervisor = Some(supervisor);
        Ok(node)
    }

    /// Starts a bootstrap server under an existing node's supervisor.
    pub async fn start_under(
        supervisor: &ActorRef<NodeSupervisor>,
        bind: SocketAddr,
        secret: Option<ClusterSecret>,
        insecure: bool,
        faults: &Faults,
    ) -> Result<Self, NodeError> {
        let bind = super::fixed_port(bind, "the bootstrap HTTP server")?;
        let bootstrap = Bootstrap::supervise(supervisor, BootstrapArgs { bind, secret, insecure })
            .restart_policy(RestartPolicy::Transient)
            .restart_limit(MAX_RESTARTS, RESTART_WINDOW)
            .spawn()
            .await;
        started("Bootstrap", &bootstrap).await?;
        register_actor(faults, ActorKind::Bootstrap, Role::P, Vec::new(), &bootstrap);
        let addr = bootstrap
            .ask(BootstrapAddr)
            .await
            .map_err(|e| NodeError::ActorStart { actor: "Bootstrap", reason: e.to_string() })?;
        Ok(Self { addr, bootstrap, supervisor: None })
    }

    /// `http://host:port`, as P registers and D queries it.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops the node at once, as a process kill would (its table is lost).
    pub async fn kill(self) {
        if let Some(s) = &self.supervisor {
            s.kill();
        }
        self.bootstrap.kill();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), self.bootstrap.wait_for_shutdown()).await;
        if let Some(s) = self.supervisor {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), s.wait_for_shutdown()).await;
        }
    }

    /// Stops the node.
    pub async fn shutdown(self) {
        let _ = self.bootstrap.stop_gracefully().await;
        self.bootstrap.wait_for_shutdown().await;
        if let Some(s) = self.supervisor {
            let _ = s.stop_gracefully().await;
            s.wait_for_shutdown().await;
        }
    }
}
