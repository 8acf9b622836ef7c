//! The proxy's HTTP server: the listening socket and the per-request flows (seed steps 8–10, 25,
//! 43 in [`super::flow`]). It is not part of the Proxy actor: it reaches the actor through an
//! `ActorRef`, which stays valid across the supervisor's restarts (same mailbox), so killing the
//! actor never closes the socket or a client's connection — flows that ask it meanwhile wait for
//! the restarted actor (bounded by the flow's ask deadline). Connections are served by
//! [`crate::http_serve`]: a header and an idle deadline, connection caps. The admin API
//! ([`super::admin`]) is served on the same socket.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kameo::prelude::*;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use super::admin::{self, AdminAuth, AdminContext};
use super::flow::{self, FlowContext};
use super::Proxy;
use crate::http_serve::{self, HttpLimits};
use crate::ActorError;

/// How long [`ProxyServer::shutdown`] waits for open connections to finish.
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(5);

/// How long the proxy keeps an idle pooled connection to P or D: well under the engines' idle
/// timeout ([`http_serve::DEFAULT_IDLE_TIMEOUT`]), so that the proxy, not the engine, closes it and
/// no request is sent on a connection the engine is closing.
const UPSTREAM_POOL_IDLE: Duration = Duration::from_secs(30);

/// A running proxy HTTP server.
pub struct ProxyServer {
    pub addr: SocketAddr,
    shutdown: CancellationToken,
    task: Option<AbortOnDropHandle<()>>,
}

impl ProxyServer {
    /// Binds `bind` and serves the proxy's routes, asking `proxy` for every request's route.
    /// `upstream_timeout` bounds each call to P and D. Clients are held to [`HttpLimits::default`].
    pub async fn start(
        bind: SocketAddr,
        proxy: ActorRef<Proxy>,
        upstream_timeout: Duration,
    ) -> Result<Self, ActorError> {
        Self::start_with_limits(bind, proxy, upstream_timeout, HttpLimits::default()).await
    }

    /// [`ProxyServer::start`], its clients held to `limits`; admin calls are served to loopback
    /// callers only.
    pub async fn start_with_limits(
        bind: SocketAddr,
        proxy: ActorRef<Proxy>,
        upstream_timeout: Duration,
        limits: HttpLimits,
    ) -> Result<Self, ActorError> {
        Self::start_with_admin(bind, proxy, upstream_timeout, limits, None).await
    }

    /// [`ProxyServer::start_with_limits`]; with `secret`, admin calls must prove it (from any
    /// caller), without it they are served to loopback callers only.
    pub async fn start_with_admin(
        bind: SocketAddr,
        proxy: ActorRef<Proxy>,
        upstream_timeout: Duration,
        limits: HttpLimits,
        secret: Option<pdflow_auth::ClusterSecret>,
    ) -> Result<Self, ActorError> {
        let listener = crate::rebind::bind_http(bind, "the proxy HTTP server").await?;
        let addr = listener.local_addr().map_err(|source| ActorError::Bind {
            what: "the proxy HTTP server",
            addr: bind.to_string(),
            source,
        })?;
        let client = reqwest::Client::builder()
            .pool_idle_timeout(UPSTREAM_POOL_IDLE)
            .build()
            .map_err(|source| ActorError::HttpClient { what: "the proxy's HTTP client", source })?;
        let admin = admin::router(Arc::new(AdminContext { proxy: proxy.clone(), auth: secret.map(AdminAuth::new) }));
        let flows =
            flow::router(Arc::new(FlowContext { proxy, client, upstream_timeout, was_ready: Default::default() }));
        let app = flows.merge(admin);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(http_serve::serve(listener, app, "proxy", limits, shutdown.clone()));
        tracing::info!(%addr, "proxy listening");
        Ok(Self { addr, shutdown, task: Some(AbortOnDropHandle::new(task)) })
    }

    /// Stops accepting and waits (bounded) for open connections to finish.
    pub async fn shutdown(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            match tokio::time::timeout(SHUTDOWN_DEADLINE, task).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "proxy server task failed"),
                Err(_) => tracing::warn!("proxy server did not stop within {SHUTDOWN_DEADLINE:?}; aborted"),
            }
        }
    }
}

impl Drop for ProxyServer {
    fn drop(&mut self) {
        // The task is aborted by its handle; this only stops it accepting first.
        self.shutdown.cancel();
    }
}
