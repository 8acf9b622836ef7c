//! The cluster one chaos cell runs on: a bootstrap node, one producer (P), one consumer (D) and
//! the proxy, on loopback in this process, with short deadlines. It registers each node as a
//! `kill_node` target; a node the plan kills is stopped hard ([`EngineNode::kill`]) and started
//! again on the same addresses (P: same engine id and side-channel port, so its re-registration is
//! identical) — the runner plays the process supervisor.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdflow_actors::fault_seam::{Faults, Killable};
use pdflow_actors::proxy::{PrefillTarget, ProxyArgs};
use pdflow_actors::scheduler_connector::KvRole;
use pdflow_fault::{FaultDomain, NodeKind};
use pdflow_kv::memory::KvShape;
use pdflow_sim_engine::scheduler::BlockStats;
use pdflow_sim_engine::{EngineConfig, LoadFailurePolicy};
use pdflow_transfer::tcp::TcpConfig;
use tokio::sync::mpsc;

use super::{http_client, ChaosError};
use futures::TryFutureExt as _;
use pdflow_node::config::Deadlines;
use pdflow_node::{BootstrapNode, ProxyNode};
use pdflow_sim_engine::hybrid::HybridLayout;
use pdflow_sim_node::engine_node::{BootstrapPlacement, Parallel};
use pdflow_sim_node::{EngineNode, EngineNodeConfig};

/// How long a restarted node may wait for its old port to be free again.
const REBIND_DEADLINE: Duration = Duration::from_secs(5);

/// What every cell's cluster runs with.
#[derive(Debug, Clone, Copy)]
pub struct ChaosSpec {
    pub shape: KvShape,
    pub num_blocks: usize,
    pub deadlines: Deadlines,
    /// D's `kv_load_failure_policy`.
    pub policy: LoadFailurePolicy,
    /// The proxy's deadline for each upstream call.
    pub upstream_timeout: Duration,
    /// P streams the KV layer by layer while it prefills.
    pub layerwise: bool,
    /// P's prefill budget per step (small: the prompt takes several steps, so D's pull lands while
    /// P still prefills).
    pub p_max_batched_tokens: usize,
    /// P's and D's tensor/pipeline-parallel sizes.
    pub prefill_parallel: Parallel,
    pub decode_parallel: Parallel,
    /// A hybrid preset (`HybridLayout::preset`) instead of `shape`'s dense model.
    pub hybrid: Option<&'static str>,
    /// `transport: rdma` on P and D: the KV moves by one-sided writes (libfabric's software `tcp`
    /// provider where no NIC's opens; a build with the `rdma` feature).
    pub rdma: bool,
}

impl ChaosSpec {
    /// The engines' KV shape and, for a hybrid preset, its layout.
    pub fn model(&self) -> (KvShape, Option<HybridLayout>) {
        match self.hybrid.and_then(HybridLayout::preset) {
            Some((shape, layout)) => (shape, Some(layout)),
            None => (self.shape, None),
        }
    }
}

/// One cell's cluster.
pub struct ChaosCluster {
    spec: ChaosSpec,
    pub bootstrap: Option<BootstrapNode>,
    bootstrap_addr: SocketAddr,
    pub prefill: Option<EngineNode>,
    p_cfg: EngineNodeConfig,
    p_side_channel_port: u16,
    pub decode: Option<EngineNode>,
    d_cfg: EngineNodeConfig,
    pub proxy: ProxyNode,
    /// Nodes the fault plan killed, in order.
    pub kills: mpsc::UnboundedReceiver<NodeKind>,
    kill_tx: Arc<mpsc::UnboundedSender<NodeKind>>,
    /// Nodes killed and started again during the cell.
    pub restarted: Vec<NodeKind>,
    /// The seam every node of the cluster is given.
    faults: Faults,
}

/// One engine node's config for a chaos cluster (loopback, port 0, the spec's shape, blocks, policy
/// and deadlines; its actors offered to `faults`).
pub fn node_cfg(
    spec: &ChaosSpec,
    role: KvRole,
    id: String,
    bootstrap: BootstrapPlacement,
    faults: &Faults,
) -> EngineNodeConfig {
    EngineNodeConfig {
        role,
        host: "127.0.0.1".into(),
        port: 0,
        engine: EngineConfig {
            engine_id: id,
            shape: spec.model().0,
            hybrid: spec.model().1,
            num_blocks: spec.num_blocks,
            kv_load_failure_policy: spec.policy,
            max_num_batched_tokens: if role.produces() { spec.p_max_batched_tokens } else { 8192 },
            ..EngineConfig::default()
        },
        bootstrap,
        deadlines: spec.deadlines,
        tcp: match spec.rdma {
            true => TcpConfig {
                rdma: pdflow_transfer::tcp::RdmaMode::Required,
                same_host: pdflow_transfer::same_host::SameHostMode::Off,
                ..TcpConfig::default()
            },
            false => TcpConfig::default(),
        },
        // Every block is checked: a flip_data cell must end recomputed (or failed), never decoded
        // from altered KV.
        verify_checksums: true,
        layerwise: spec.layerwise && role.produces(),
        kv_device: None,
        faults: faults.clone(),
        parallel: if role.produces() { spec.prefill_parallel } else { spec.decode_parallel },
        dp_rank: 0,
        rank_processes: None,
    }
}

/// Retries `start` while the old incarnation's port is still busy (bounded).
async fn retry_bind<T, F, Fut>(mut start: F) -> Result<T, ChaosError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ChaosError>>,
{
    let until = Instant::now() + REBIND_DEADLINE;
    loop {
        match start().await {
            Err(e) if e.is_bind() && Instant::now() < until => tokio::time::sleep(Duration::from_millis(20)).await,
            other => return other,
        }
    }
}

impl ChaosCluster {
    /// Starts the cluster, its nodes and their actors registered in `domain`.
    pub async fn start(spec: ChaosSpec, domain: &Arc<FaultDomain>) -> Result<Self, ChaosError> {
        let faults = domain.seam();
        let bootstrap = BootstrapNode::start_with(SocketAddr::from(([127, 0, 0, 1], 0)), None, false, &faults).await?;
        let bootstrap_addr = bootstrap.addr;
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let mut p_cfg = node_cfg(
            &spec,
            KvRole::Producer,
            format!("prefill-{}", &suffix[..8]),
            BootstrapPlacement::External { url: bootstrap.url() },
            &faults,
        );
        let prefill = EngineNode::start(p_cfg.clone()).await?;
        p_cfg.port = prefill.http_addr.port();
        let p_side_channel_port = prefill.side_channel_port();
        let mut d_cfg =
            node_cfg(&spec, KvRole::Consumer, format!("decode-{}", &suffix[..8]), BootstrapPlacement::None, &faults);
        let decode = EngineNode::start(d_cfg.clone()).await?;
        d_cfg.port = decode.http_addr.port();
        let proxy = ProxyNode::start_with(
            ProxyArgs {
                health_interval: Duration::from_millis(25),
                upstream_timeout: spec.upstream_timeout,
                ..ProxyArgs::new(
                    SocketAddr::from(([127, 0, 0, 1], 0)),
                    vec![PrefillTarget { url: prefill.url(), bootstrap_port: bootstrap_addr.port() }],
                    vec![decode.url()],
                )
            },
            &faults,
        )
        .await?;
        let client = http_client()?;
        crate::demo::wait_ready(&client, &proxy.url(), Duration::from_secs(10))
            .await
            .map_err(|source| ChaosError::NotReady { cluster: "chaos cluster", source })?;
        let (tx, kills) = mpsc::unbounded_channel();
        let kill_tx = Arc::new(tx);
        for node in [NodeKind::P, NodeKind::D, NodeKind::Bootstrap] {
            let (alive, kill) = (Arc::downgrade(&kill_tx), Arc::downgrade(&kill_tx));
            domain.register_node(
                node,
                Killable {
                    alive: Box::new(move || alive.upgrade().is_some_and(|tx| !tx.is_closed())),
                    kill: Arc::new(move || {
                        if let Some(tx) = kill.upgrade() {
                            let _ = tx.send(node);
                        }
                    }),
                },
            );
        }
        Ok(Self {
            spec,
            bootstrap: Some(bootstrap),
            bootstrap_addr,
            prefill: Some(prefill),
            p_cfg,
            p_side_channel_port,
            decode: Some(decode),
            d_cfg,
            proxy,
            kills,
            kill_tx,
            restarted: Vec::new(),
            faults,
        })
    }

    pub fn proxy_url(&self) -> String {
        self.proxy.url()
    }

    /// Kills `node` hard and starts it again on the same addresses.
    pub async fn kill_and_restart(&mut self, node: NodeKind) -> Result<(), ChaosError> {
        tracing::warn!(node = node.name(), "chaos: killing the node and starting it again");
        match node {
            NodeKind::P => {
                if let Some(p) = self.prefill.take() {
                    p.kill().await;
                }
                let (cfg, port) = (self.p_cfg.clone(), self.p_side_channel_port);
                self.prefill =
                    Some(retry_bind(|| EngineNode::start_on(cfg.clone(), port).map_err(ChaosError::from)).await?);
            }
            NodeKind::D => {
                if let Some(d) = self.decode.take() {
                    d.kill().await;
                }
                let cfg = self.d_cfg.clone();
                self.decode = Some(retry_bind(|| EngineNode::start(cfg.clone()).map_err(ChaosError::from)).await?);
            }
            NodeKind::Bootstrap => {
                if let Some(b) = self.bootstrap.take() {
                    b.kill().await;
                }
                let addr = self.bootstrap_addr;
                let faults = self.faults.clone();
                self.bootstrap = Some(
                    retry_bind(|| BootstrapNode::start_with(addr, None, false, &faults).map_err(ChaosError::from))
                        .await?,
                );
            }
            NodeKind::Proxy => return Err(ChaosError::NotKillable { node: node.name() }),
        }
        self.restarted.push(node);
        Ok(())
    }

    /// P's and D's block stats now.
    pub fn block_stats(&self) -> (Option<BlockStats>, Option<BlockStats>) {
        (self.prefill.as_ref().map(|p| p.engine.block_stats()), self.decode.as_ref().map(|d| d.engine.block_stats()))
    }

    /// Waits (bounded by `within`) until P and D hold no blocks and no requests; returns the
    /// blocks each still holds at the end.
    pub async fn wait_baseline(&self, within: Duration) -> (usize, usize) {
        let until = Instant::now() + within;
        loop {
            let (p, d) = self.block_stats();
            let held = |s: Option<BlockStats>| s.map(|s| s.total - s.free).unwrap_or(0);
            let idle = |s: Option<BlockStats>| s.is_none_or(|s| s.free == s.total && s.requests == 0);
            if (idle(p) && idle(d)) || Instant::now() >= until {
                return (held(p), held(d));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// P and D hold no block and track no request.
    pub fn is_idle(&self) -> bool {
        let (p, d) = self.block_stats();
        let idle = |s: Option<BlockStats>| s.is_none_or(|s| s.free == s.total && s.requests == 0);
        idle(p) && idle(d)
    }

    pub fn spec(&self) -> &ChaosSpec {
        &self.spec
    }

    pub async fn shutdown(self) {
        drop(self.kill_tx);
        self.proxy.shutdown().await;
        for node in [self.prefill, self.decode].into_iter().flatten() {
            node.kill().await;
        }
        if let Some(b) = self.bootstrap {
            b.shutdown().await;
        }
    }
}
