//! A proxy node (`pdflow proxy`): the Proxy actor under its supervisor (seed steps 6–10, 25, 43).

use std::net::SocketAddr;

use kameo::prelude::*;
use kameo::supervision::RestartPolicy;
use pdflow_actors::fault_hooks::register_actor;
use pdflow_actors::proxy::{Proxy, ProxyArgs};
use pdflow_observability::fault::{ActorKind, Role};
use pdflow_messages::proxy::ProxyAddr;

use super::supervisor::{NodeSupervisor, MAX_RESTARTS, RESTART_WINDOW};
use super::{started, NodeError};

/// A running proxy.
pub struct ProxyNode {
    pub addr: SocketAddr,
    pub proxy: ActorRef<Proxy>,
    supervisor: ActorRef<NodeSupervisor>,
}

impl ProxyNode {
    pub async fn start(mut args: ProxyArgs) -> Result<Self, NodeError> {
        args.bind = super::fixed_port(args.bind, "proxy HTTP server")?;
        let supervisor = NodeSupervisor::spawn("proxy".to_string());
        let proxy = Proxy::supervise(&supervisor, args).restart_policy(RestartPolicy::Transient).restart_limit(MAX_RESTARTS, RESTART_WINDOW).spawn().await;
        started("Proxy", &proxy).await?;
        register_actor(ActorKind::Proxy, Role::Proxy, Vec::new(), &proxy);
        let addr = proxy.ask(ProxyAddr).await.map_err(|e| NodeError::ActorStart { actor: "Proxy", reason: e.to_string() })?;
        Ok(Self { addr, proxy, supervisor })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub async fn shutdown(self) {
        let _ = self.proxy.stop_gracefully().await;
        self.proxy.wait_for_shutdown().await;
        let _ = self.supervisor.stop_gracefully().await;
        self.supervisor.wait_for_shutdown().await;
    }
}
