//! The router bench's engines: x P and y D simulated engines in this process (real sockets), each
//! with vLLM's prefix caching, KV events on a PUB socket with its replay socket, and the forward
//! timing of a GPU (`--forward-timing`), so that their times are a GPU's and not this CPU's. Each
//! P launches its own bootstrap, as each vLLM P instance does. Every front is measured on a
//! fresh cluster: empty caches.

use std::time::Duration;

use anyhow::Context;
use pdflow_actors::scheduler_connector::KvRole;
use pdflow_kv::memory::KvShape;
use pdflow_node::config::Deadlines;
use pdflow_sim_engine::kv_events::KvEventsConfig;
use pdflow_sim_engine::{CacheStats, EngineConfig, ForwardTiming};
use pdflow_sim_node::engine_node::{BootstrapPlacement, Parallel};
use pdflow_sim_node::{EngineNode, EngineNodeConfig};
use pdflow_transfer::tcp::TcpConfig;

/// The engines' KV shape: small, so that the CPU's copies stay under the modelled GPU time. The
/// timing model and block size (16) are Qwen3-8B's; KV bytes are reported at Qwen3-8B's size
/// ([`QWEN3_8B_BYTES_PER_TOKEN`]).
pub const SHAPE: KvShape = KvShape { num_layers: 4, num_kv_heads: 2, head_dim: 16, dtype_bytes: 2, block_size: 16 };

/// Qwen3-8B's KV per token (bf16, 36 layers, 8 KV heads of 128, K and V).
pub const QWEN3_8B_BYTES_PER_TOKEN: u64 = 2 * 36 * 8 * 128 * 2;

/// How the cluster's engines are made.
#[derive(Debug, Clone, Copy)]
pub struct ClusterSpec {
    pub prefill: usize,
    pub decode: usize,
    pub num_blocks: usize,
    pub timing: ForwardTiming,
}

/// One engine and where its KV events are published.
pub struct BenchEngine {
    pub node: EngineNode,
    /// `tcp://127.0.0.1:PORT` of its PUB socket and of its replay socket.
    pub kv_events: String,
    pub kv_replay: String,
    /// P: the port of the bootstrap it launched.
    pub bootstrap_port: Option<u16>,
}

impl BenchEngine {
    pub fn url(&self) -> String {
        self.node.url()
    }
}

/// The running engines.
pub struct Cluster {
    pub prefill: Vec<BenchEngine>,
    pub decode: Vec<BenchEngine>,
}

/// `tcp://0.0.0.0:PORT` (a bound wildcard) → `tcp://127.0.0.1:PORT`.
fn loopback(endpoint: &str) -> String {
    let port = endpoint.rsplit(':').next().unwrap_or_default();
    format!("tcp://127.0.0.1:{port}")
}

async fn start_engine(spec: &ClusterSpec, role: KvRole, name: String) -> anyhow::Result<BenchEngine> {
    let engine = EngineConfig {
        engine_id: name.clone(),
        shape: SHAPE,
        num_blocks: spec.num_blocks,
        max_model_len: 16_384,
        enable_prefix_caching: true,
        kv_events: Some(KvEventsConfig::zmq("tcp://*:0", Some("tcp://*:0".into()))),
        forward_timing: Some(spec.timing),
        ..EngineConfig::default()
    };
    let cfg = EngineNodeConfig {
        role,
        host: "127.0.0.1".into(),
        port: 0,
        engine,
        bootstrap: if role.produces() { BootstrapPlacement::Launch { port: 0 } } else { BootstrapPlacement::None },
        deadlines: Deadlines::default(),
        tcp: TcpConfig::default(),
        verify_checksums: false,
        layerwise: false,
        kv_device: None,
        faults: pdflow_actors::fault_seam::no_faults(),
        parallel: Parallel::default(),
        dp_rank: 0,
        rank_processes: None,
    };
    let node = EngineNode::start(cfg).await.with_context(|| format!("starting engine {name}"))?;
    let endpoints = node
        .engine
        .kv_events_endpoints()
        .await
        .with_context(|| format!("{name}'s KV event sockets"))?
        .with_context(|| format!("{name} publishes no KV events"))?;
    let kv_replay = endpoints.replay_endpoint.as_deref().map(loopback).unwrap_or_default();
    let bootstrap_port = node.launched_bootstrap_addr().map(|a| a.port());
    Ok(BenchEngine { kv_events: loopback(&endpoints.endpoint), kv_replay, bootstrap_port, node })
}

impl Cluster {
    pub async fn start(spec: &ClusterSpec) -> anyhow::Result<Self> {
        let mut prefill = Vec::with_capacity(spec.prefill);
        for i in 0..spec.prefill {
            prefill.push(start_engine(spec, KvRole::Producer, format!("bench-p{i}-{}", uuid::Uuid::new_v4())).await?);
        }
        let mut decode = Vec::with_capacity(spec.decode);
        for j in 0..spec.decode {
            decode.push(start_engine(spec, KvRole::Consumer, format!("bench-d{j}-{}", uuid::Uuid::new_v4())).await?);
        }
        Ok(Self { prefill, decode })
    }

    /// The prefix-cache counters summed over P's engines and over D's.
    pub fn cache_stats(&self) -> (CacheStats, CacheStats) {
        let sum = |engines: &[BenchEngine]| {
            engines.iter().map(|e| e.node.engine.cache_stats()).fold(CacheStats::default(), |mut a, s| {
                a.prefix_cache_queries += s.prefix_cache_queries;
                a.prefix_cache_hits += s.prefix_cache_hits;
                a.prompt_tokens_local_compute += s.prompt_tokens_local_compute;
                a.prompt_tokens_local_cache_hit += s.prompt_tokens_local_cache_hit;
                a.prompt_tokens_external_kv_transfer += s.prompt_tokens_external_kv_transfer;
                a
            })
        };
        (sum(&self.prefill), sum(&self.decode))
    }

    /// Waits (at most `within`) until no engine holds a request; the engines that still do.
    pub async fn settle(&self, within: Duration) -> Vec<String> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let busy: Vec<String> = self
                .prefill
                .iter()
                .chain(&self.decode)
                .filter(|e| e.node.engine.block_stats().requests > 0)
                .map(|e| e.node.engine_id.clone())
                .collect();
            if busy.is_empty() || tokio::time::Instant::now() >= deadline {
                return busy;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn shutdown(self) {
        for e in self.prefill.into_iter().chain(self.decode) {
            e.node.shutdown().await;
        }
    }
}
