//! A data-parallel group (`pdflow serve --data-parallel-size N`): N engines, each with its own
//! scheduler, KV cache and workers (vLLM's engine cores of one `vllm serve`), behind one HTTP API
//! that sends a request to the rank its `X-data-parallel-rank` header names, else to the least
//! busy rank. Each engine's id is `{engine_id}_dp{rank}`, as vLLM names them. P's workers
//! register under their engine's dp_rank at the one bootstrap rank 0 launches (or finds), so
//! that the bootstrap's `/query` answers per rank and a proxy picks one (seed step 8).

use std::net::SocketAddr;

use pdflow_sim_engine::api;
use tokio_util::sync::CancellationToken;

use crate::engine_node::{serve_http, stop_http, BootstrapPlacement, EngineNode, EngineNodeConfig};
use crate::error::SimNodeError;

/// A running data-parallel group.
pub struct DataParallelGroup {
    /// The group's API (the address clients and the proxy use).
    pub http_addr: SocketAddr,
    /// The engines, by data-parallel rank.
    pub engines: Vec<EngineNode>,
    http_stop: CancellationToken,
    http_task: tokio::task::JoinHandle<()>,
}

/// The engine id of data-parallel rank `rank` in a group named `engine_id` (vLLM's naming).
pub fn rank_engine_id(engine_id: &str, rank: u32) -> String {
    format!("{engine_id}_dp{rank}")
}

impl DataParallelGroup {
    /// Starts `size` engines from `cfg` (rank 0 launches or finds the bootstrap as `cfg` says;
    /// the others register with it), then the group's API on `cfg.port`.
    pub async fn start(cfg: EngineNodeConfig, size: u32) -> Result<Self, SimNodeError> {
        if size == 0 {
            return Err(SimNodeError::NoDataParallelRank);
        }
        let mut engines: Vec<EngineNode> = Vec::with_capacity(size as usize);
        for rank in 0..size {
            let mut rank_cfg = cfg.clone();
            rank_cfg.engine.engine_id = rank_engine_id(&cfg.engine.engine_id, rank);
            rank_cfg.dp_rank = rank;
            // Each engine's own API listens on a port of its own; clients use the group's.
            rank_cfg.port = 0;
            if let Some(first) = engines.first() {
                rank_cfg.bootstrap = match first.bootstrap_url() {
                    Some(url) => BootstrapPlacement::External { url },
                    None => BootstrapPlacement::None,
                };
            }
            match EngineNode::start(rank_cfg).await {
                Ok(node) => engines.push(node),
                Err(e) => {
                    stop_all(engines).await;
                    return Err(e);
                }
            }
        }
        let router = api::data_parallel_router(engines.iter().map(|e| e.engine.clone()).collect());
        match serve_http(&cfg.host, cfg.port, router, cfg.tcp.peers()).await {
            Ok((http_addr, http_stop, http_task)) => Ok(Self { http_addr, engines, http_stop, http_task }),
            Err(e) => {
                stop_all(engines).await;
                Err(e.into())
            }
        }
    }

    /// Stops the group's API, then the engines (rank 0, which may hold the bootstrap, last).
    pub async fn shutdown(self) {
        stop_http(self.http_stop, self.http_task).await;
        stop_all(self.engines).await;
    }
}

async fn stop_all(engines: Vec<EngineNode>) {
    for engine in engines.into_iter().rev() {
        engine.shutdown().await;
    }
}
