//! A proxy node (`pdflow proxy`): the Proxy actor under its supervisor (seed steps 6, 7) and the
//! HTTP server whose flows ask it for routes (steps 8–10, 25, 43); the server outlives the
//! actor's restarts.

use std::net::SocketAddr;

use kameo::prelude::*;
use kameo::supervision::RestartPolicy;
use pdflow_actors::fault_seam::{no_faults, register_actor, ActorKind, Faults, Role};
use pdflow_actors::http_serve::HttpLimits;
use pdflow_actors::proxy::{Proxy, ProxyArgs, ProxyServer};
use pdflow_actors::ActorError;
use pdflow_auth::PeerFilter;

use super::supervisor::{NodeSupervisor, MAX_RESTARTS, RESTART_WINDOW};
use super::{started, NodeError};

/// A running proxy.
pub struct ProxyNode {
    pub addr: SocketAddr,
    pub proxy: ActorRef<Proxy>,
    server: ProxyServer,
    supervisor: ActorRef<NodeSupervisor>,
}

impl ProxyNode {
    pub async fn start(args: ProxyArgs) -> Result<Self, NodeError> {
        Self::start_with(args, &no_faults()).await
    }

    /// [`ProxyNode::start`], its actor offered to `faults`. Without a cluster secret its clients
    /// must be on loopback (protected mode, [`PeerFilter`]).
    pub async fn start_with(args: ProxyArgs, faults: &Faults) -> Result<Self, NodeError> {
        Self::start_with_insecure(args, false, faults).await
    }

    /// [`ProxyNode::start_with`]; with `insecure` and no secret, clients from any address are
    /// served (protected mode's opt-out).
    pub async fn start_with_insecure(args: ProxyArgs, insecure: bool, faults: &Faults) -> Result<Self, NodeError> {
        let bind = args.bind;
        let upstream_timeout = args.upstream_timeout;
        let limits = HttpLimits::serving(PeerFilter::new(args.secret.as_ref(), insecure));
        let admin_secret = args.secret.clone();
        let supervisor = NodeSupervisor::spawn("proxy".to_string());
        let proxy = Proxy::supervise(&supervisor, args)
            .restart_policy(RestartPolicy::Transient)
            .restart_limit(MAX_RESTARTS, RESTART_WINDOW)
            .spawn()
            .await;
        started("Proxy", &proxy).await?;
        register_actor(faults, ActorKind::Proxy, Role::Proxy, Vec::new(), &proxy);
        let server =
            match ProxyServer::start_with_admin(bind, proxy.clone(), upstream_timeout, limits, admin_secret).await {
                Ok(server) => server,
                Err(e) => {
                    let _ = proxy.stop_gracefully().await;
                    let _ = supervisor.stop_gracefully().await;
                    return Err(match e {
                        ActorError::Bind { what, addr, source } => NodeError::Bind { what, addr, source },
                        other => NodeError::ActorStart { actor: "Proxy's HTTP server", reason: other.to_string() },
                    });
                }
            };
        Ok(Self { addr: server.addr, proxy, server, supervisor })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub async fn shutdown(self) {
        self.server.shutdown().await;
        let _ = self.proxy.stop_gracefully().await;
        self.proxy.wait_for_shutdown().await;
        let _ = self.supervisor.stop_gracefully().await;
        self.supervisor.wait_for_shutdown().await;
    }
}
