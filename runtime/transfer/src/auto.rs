//! [`AutoTransferEngine`]: the engine a P node uses for seed step 29. Per peer it chooses the
//! same-host path ([`super::same_host`]) when D's data server offers it, names this host, and the
//! kernel lets P read D's canary back; tcp ([`super::tcp`]) otherwise, and whenever the kernel
//! later refuses. The choice is cached per peer and re-checked (canary read, ~µs) before every
//! same-host write, so a D restarted at the same address is probed again. A plan that carries D's
//! RDMA grant (the `rdma` feature; D offered its endpoint in the pull) is written one-sided
//! ([`super::rdma`]) when this host opens D's provider; with `transport: rdma` a plan without a
//! grant is refused instead of written another way.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::future::BoxFuture;
use pdflow_messages::layout::RegionDesc;

use super::same_host::{self, SameHostError, SameHostMode, SameHostPeer};
use super::tcp::{RdmaMode, TcpConfig, TcpTransferEngine};
use super::{TransferEngine, TransferError, TransferStats};
use pdflow_kv::memory::RegionTable;
use pdflow_kv::planner::{Descriptor, TransferPlan};

/// Backend names reported by [`TransferEngine::backend_for`].
pub const BACKEND_TCP: &str = "tcp";
pub const BACKEND_SAME_HOST: &str = "same-host";
/// One-sided writes through libfabric ([`super::rdma`]).
pub const BACKEND_RDMA: &str = "rdma";

#[derive(Debug, Clone)]
enum Route {
    Tcp,
    SameHost(Arc<SameHostPeer>),
    /// The last write went one-sided, on this provider.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    Rdma(String),
}

/// Same-host when possible, tcp otherwise (see the module docs).
#[derive(Debug)]
pub struct AutoTransferEngine {
    tcp: TcpTransferEngine,
    local: RegionTable,
    mode: SameHostMode,
    threads: usize,
    routes: Mutex<HashMap<String, Route>>,
    rdma_mode: RdmaMode,
    #[cfg(feature = "rdma")]
    rdma: Option<super::rdma::RdmaTransferEngine>,
}

impl AutoTransferEngine {
    /// An engine reading from `local` (P's memory); `config.same_host` says whether the same-host
    /// path may (`Auto`), may not (`Off`) or must (`Required`) be used.
    pub fn new(local: RegionTable, config: TcpConfig) -> Self {
        let threads = std::thread::available_parallelism().map_or(1, usize::from).min(4);
        let mode = config.same_host;
        let rdma_mode = config.rdma;
        #[cfg(feature = "rdma")]
        let rdma = (rdma_mode != RdmaMode::Off).then(|| {
            super::rdma::RdmaTransferEngine::new(
                local.clone(),
                super::rdma::engine::RdmaEngineConfig {
                    host: String::new(),
                    connect_timeout: config.connect_timeout,
                    write_timeout: config.write_timeout,
                    secret: config.secret.clone(),
                },
            )
        });
        Self {
            tcp: TcpTransferEngine::new(local.clone(), config),
            local,
            mode,
            threads,
            routes: Mutex::new(HashMap::new()),
            rdma_mode,
            #[cfg(feature = "rdma")]
            rdma,
        }
    }

    /// The tcp engine used as the fallback.
    pub fn tcp(&self) -> &TcpTransferEngine {
        &self.tcp
    }

    fn lock_routes(&self) -> std::sync::MutexGuard<'_, HashMap<String, Route>> {
        // A plain cache: a panicking holder cannot break it.
        self.routes.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set_route(&self, peer: &str, route: Route) {
        self.lock_routes().insert(peer.to_string(), route);
    }

    /// The cached route, or a fresh probe of the peer's data server.
    async fn route(&self, peer: &str) -> Result<Route, TransferError> {
        if self.mode == SameHostMode::Off {
            return Ok(Route::Tcp);
        }
        if let Some(route) = self.lock_routes().get(peer).cloned() {
            return Ok(route);
        }
        let route = match self.probe(peer).await {
            Ok(peer_info) => Route::SameHost(Arc::new(peer_info)),
            Err(reason) => {
                tracing::debug!(%peer, "same-host path not used: {reason}");
                if self.mode == SameHostMode::Required {
                    return Err(TransferError::SameHostUnavailable { peer: peer.to_string(), reason });
                }
                Route::Tcp
            }
        };
        self.set_route(peer, route.clone());
        Ok(route)
    }

    /// Asks the peer for its details and checks them; `Err(reason)` means tcp.
    async fn probe(&self, peer: &str) -> Result<SameHostPeer, String> {
        let info =
            self.tcp.host_info(peer).await.map_err(|e| format!("the data server gave no same-host details: {e}"))?;
        if !info.offered {
            return Err("the data server does not offer it".into());
        }
        if info.host_id != same_host::host_identity() {
            return Err(format!("different host ({} here, {} there)", same_host::host_identity(), info.host_id));
        }
        let pid = i32::try_from(info.pid).map_err(|_| format!("pid {} out of range", info.pid))?;
        let regions =
            info.regions.iter().map(|&(base_addr, len, block_len)| RegionDesc { base_addr, len, block_len }).collect();
        let candidate = SameHostPeer { pid, canary_addr: info.canary_addr, canary: info.canary, regions };
        match same_host::verify_canary(&candidate) {
            Ok(true) => Ok(candidate),
            Ok(false) => Err(format!("pid {pid} does not hold the data server's canary")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// The one-sided write of a plan D granted, when this host can take it: `None` to write it
    /// another way.
    async fn write_rdma(&self, peer: &str, plan: &TransferPlan) -> Option<Result<TransferStats, TransferError>> {
        let required = self.rdma_mode == RdmaMode::Required;
        let Some(grant) = plan.grant.as_ref() else {
            return required.then(|| {
                Err(TransferError::Refused {
                    peer: peer.to_string(),
                    reason: "transport rdma: D offered no RDMA endpoint for this pull (set transport rdma on D \
                             too, and build it with the rdma feature)"
                        .into(),
                })
            });
        };
        #[cfg(feature = "rdma")]
        if let Some(rdma) = &self.rdma {
            return match rdma.can_open(&grant.offer) {
                Ok(()) => {
                    self.set_route(peer, Route::Rdma(grant.offer.provider.clone()));
                    Some(rdma.write(peer, plan).await)
                }
                Err(e) if required => Some(Err(TransferError::Refused {
                    peer: peer.to_string(),
                    reason: format!("transport rdma: this host cannot open D's provider {}: {e}", grant.offer.provider),
                })),
                Err(e) => {
                    tracing::warn!(%peer, provider = %grant.offer.provider, "RDMA not used: {e}; writing over tcp");
                    None
                }
            };
        }
        let _ = grant;
        required.then(|| {
            Err(TransferError::Refused {
                peer: peer.to_string(),
                reason: "transport rdma: this build of pdflow has no rdma backend (build it with the rdma feature)"
                    .into(),
            })
        })
    }

    async fn write_plan(&self, peer: &str, plan: &TransferPlan) -> Result<TransferStats, TransferError> {
        if let Some(written) = self.write_rdma(peer, plan).await {
            return written;
        }
        let started = Instant::now();
        let descriptors: Vec<Descriptor> = plan.descriptors.iter().copied().filter(|d| d.len > 0).collect();
        for d in &descriptors {
            self.local.check_host(d.src, d.len)?;
        }
        let mut route = self.route(peer).await?;
        if let Route::SameHost(p) = &route {
            // The cached pid must still be D (a restarted D gets a new canary).
            if !matches!(same_host::verify_canary(p), Ok(true)) {
                self.lock_routes().remove(peer);
                route = self.route(peer).await?;
            }
        }
        let Route::SameHost(p) = route else {
            return self.tcp.write(peer, plan).await;
        };
        // The write deadline, or D's pull deadline (less a margin) if sooner: the threads stop
        // (between system calls) before D gives the blocks up at its deadline.
        let now = tokio::time::Instant::now();
        let mut timeout = self.tcp.config().write_timeout;
        if let Some(write_by) = plan.write_by {
            timeout = timeout.min(write_by.saturating_duration_since(now.into_std()));
        }
        if timeout.is_zero() {
            return Err(TransferError::Timeout { peer: peer.to_string(), deadline: timeout });
        }
        // D's write fence, held by the writing threads themselves: D reports the pull failed (and
        // the engine reuses its blocks) only once the hold is released or its connection closed —
        // after the last thread stopped, even when P dies mid-write. A pull D already gave up on
        // is refused here, before a byte is written.
        let hold = match plan.fence {
            0 => None,
            token => Some(self.tcp.hold_fence(peer, token).await?),
        };
        let hold = Arc::new(hold);
        let written = same_host::write(&p, &self.local, &descriptors, self.threads, now + timeout, hold.clone()).await;
        if let Ok(Some(hold)) = Arc::try_unwrap(hold) {
            if let Err(e) = hold.release().await {
                tracing::debug!(%peer, error = %e, "the fence release did not leave: D releases when the connection closes");
            }
        }
        match written {
            Ok(bytes) => Ok(TransferStats { bytes, descriptors: plan.descriptors.len(), duration: started.elapsed() }),
            Err(SameHostError::OutOfRegion(e)) => Err(TransferError::Refused {
                peer: peer.to_string(),
                reason: format!("{e}; nothing of the plan was written"),
            }),
            Err(e @ SameHostError::Unavailable { .. }) if self.mode == SameHostMode::Auto => {
                tracing::warn!(%peer, "{e}");
                self.set_route(peer, Route::Tcp);
                self.tcp.write(peer, plan).await
            }
            Err(SameHostError::DeadlinePassed { .. }) => {
                Err(TransferError::Timeout { peer: peer.to_string(), deadline: timeout })
            }
            Err(e) => Err(TransferError::SameHostUnavailable { peer: peer.to_string(), reason: e.to_string() }),
        }
    }
}

impl TransferEngine for AutoTransferEngine {
    fn name(&self) -> &'static str {
        "auto"
    }

    fn backend_for(&self, peer: &str) -> &'static str {
        match self.lock_routes().get(peer) {
            Some(Route::SameHost(_)) => BACKEND_SAME_HOST,
            Some(Route::Rdma(_)) => BACKEND_RDMA,
            _ => BACKEND_TCP,
        }
    }

    fn provider_for(&self, peer: &str) -> Option<String> {
        match self.lock_routes().get(peer) {
            Some(Route::Rdma(provider)) => Some(provider.clone()),
            _ => None,
        }
    }

    /// Chooses the path now (the same-host probe) and, for tcp, opens the data connections.
    fn prepare<'a>(&'a self, peer: &'a str) -> BoxFuture<'a, Result<(), TransferError>> {
        Box::pin(async move {
            match self.route(peer).await? {
                Route::Tcp => self.tcp.prepare(peer).await,
                Route::SameHost(_) | Route::Rdma(_) => Ok(()),
            }
        })
    }

    fn write<'a>(
        &'a self,
        peer: &'a str,
        plan: &'a TransferPlan,
    ) -> BoxFuture<'a, Result<TransferStats, TransferError>> {
        Box::pin(self.write_plan(peer, plan))
    }
}

#[cfg(test)]
mod tests;
