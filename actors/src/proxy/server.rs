//! The proxy's HTTP server: the listening socket and the per-request flows (seed steps 8–10, 25,
//! 43 in [`super::flow`]). It is not part of the Proxy actor: it reaches the actor through an
//! `ActorRef`, which stays valid across the supervisor's restarts (same mailbox), so killing the
//! actor never closes the socket or a client's connection — flows that ask it meanwhile wait for
//! the restarted actor (bounded by the flow's ask deadline).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kameo::prelude::*;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use super::flow::{self, FlowContext};
use super::Proxy;
use crate::ActorError;

/// How long [`ProxyServer::shutdown`] waits for open connections to finish.
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(5);

/// A running proxy HTTP server.
pub struct ProxyServer {
    pub addr: SocketAddr,
    shutdown: CancellationToken,
    task: Option<AbortOnDropHandle<std::io::Result<()>>>,
}

impl ProxyServer {
    /// Binds `bind` and serves the proxy's routes, asking `proxy` for every request's route.
    /// `upstream_timeout` bounds each call to P and D.
    pub async fn start(
        bind: SocketAddr,
        proxy: ActorRef<Proxy>,
        upstream_timeout: Duration,
    ) -> Result<Self, ActorError> {
        let listener = crate::rebind::bind_http(bind, "the proxy HTTP server").await?;
        let addr = listener.local_addr().map_err(|source| ActorError::Bind {
            what: "the proxy HTTP server",
            addr: bind.to_string(),
            source,
        })?;
        let client = reqwest::Client::builder()
            .pool_idle_timeout(Duration::from_secs(90))
            .build()
            .map_err(|source| ActorError::HttpClient { what: "the proxy's HTTP client", source })?;
        let app =
            flow::router(Arc::new(FlowContext { proxy, client, upstream_timeout, was_ready: Default::default() }));
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone().cancelled_owned();
        let task = tokio::spawn(async move { axum::serve(listener, app).with_graceful_shutdown(stop).await });
        tracing::info!(%addr, "proxy listening");
        Ok(Self { addr, shutdown, task: Some(AbortOnDropHandle::new(task)) })
    }

    /// Stops accepting and waits (bounded) for open connections to finish.
    pub async fn shutdown(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            match tokio::time::timeout(SHUTDOWN_DEADLINE, task).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => tracing::warn!(error = %e, "proxy server ended with an error"),
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
