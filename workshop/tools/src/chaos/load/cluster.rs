//! The cluster of a load run (`pdflow chaos --load`): two producer engine nodes (P),
//! each launching its own bootstrap as vLLM's P TP0 does (one bootstrap serves one P instance's
//! dp ranks: two engines of dp rank 0 cannot share one), two consumer engine nodes (D) and the
//! proxy routing over both Ps and both Ds — xPyD as vLLM's example proxy runs it — on loopback in
//! this process, with the chaos deadlines. Nothing is restarted here: a load run has no node kills
//! ([`super::faults`]); killed actors come back through their node's supervisor.
//!
//! Owns no seed step (assembly only; steps 1–7 happen inside the nodes it starts).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use pdflow_actors::fault_seam::Faults;
use pdflow_actors::proxy::{PrefillTarget, ProxyArgs};
use pdflow_actors::scheduler_connector::KvRole;
use pdflow_messages::receiver::TransferStates;
use pdflow_messages::sender_listener::InFlightPulls;
use pdflow_sim_engine::scheduler::BlockStats;

use crate::chaos::cluster::{node_cfg, ChaosSpec};
use crate::chaos::{http_client, ChaosError};
use pdflow_node::ProxyNode;
use pdflow_sim_node::engine_node::BootstrapPlacement;
use pdflow_sim_node::EngineNode;

/// How long the cluster may take to answer `/health` through the proxy after start.
const READY_DEADLINE: Duration = Duration::from_secs(20);

/// A running xPyD cluster.
pub struct LoadCluster {
    pub prefill: Vec<EngineNode>,
    pub decode: Vec<EngineNode>,
    pub proxy: ProxyNode,
}

/// What one engine holds now: blocks in use and requests tracked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub blocks: usize,
    pub requests: usize,
}

impl LoadCluster {
    /// Starts `prefills` Ps and `decodes` Ds (at least one each) and waits until the proxy is ready.
    /// Their actors are offered to `faults`.
    pub async fn start(spec: &ChaosSpec, prefills: usize, decodes: usize, faults: &Faults) -> Result<Self, ChaosError> {
        if prefills == 0 || decodes == 0 {
            return Err(ChaosError::LoadShape { prefills, decodes });
        }
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let mut prefill = Vec::with_capacity(prefills);
        for i in 0..prefills {
            let cfg = node_cfg(
                spec,
                KvRole::Producer,
                format!("prefill{i}-{}", &suffix[..8]),
                BootstrapPlacement::Launch { port: 0 },
                faults,
            );
            prefill.push(EngineNode::start(cfg).await?);
        }
        let mut decode = Vec::with_capacity(decodes);
        for i in 0..decodes {
            let cfg = node_cfg(
                spec,
                KvRole::Consumer,
                format!("decode{i}-{}", &suffix[..8]),
                BootstrapPlacement::None,
                faults,
            );
            decode.push(EngineNode::start(cfg).await?);
        }
        let proxy = ProxyNode::start_with(
            ProxyArgs {
                health_interval: Duration::from_millis(25),
                upstream_timeout: spec.upstream_timeout,
                ..ProxyArgs::new(
                    SocketAddr::from(([127, 0, 0, 1], 0)),
                    prefill
                        .iter()
                        .map(|p| {
                            let bootstrap_port = p
                                .launched_bootstrap_addr()
                                .map(|a| a.port())
                                .ok_or_else(|| ChaosError::NoBootstrap { engine_id: p.engine_id.clone() })?;
                            Ok(PrefillTarget { url: p.url(), bootstrap_port })
                        })
                        .collect::<Result<_, ChaosError>>()?,
                    decode.iter().map(EngineNode::url).collect(),
                )
            },
            faults,
        )
        .await?;
        let cluster = Self { prefill, decode, proxy };
        let client = http_client()?;
        if let Err(source) = crate::demo::wait_ready(&client, &cluster.proxy.url(), READY_DEADLINE).await {
            cluster.shutdown().await;
            return Err(ChaosError::NotReady { cluster: "load cluster", source });
        }
        Ok(cluster)
    }

    pub fn proxy_url(&self) -> String {
        self.proxy.url()
    }

    /// Every engine with its label: `p0`, `p1`, …, `d0`, `d1`, ….
    pub fn engines(&self) -> Vec<(String, &EngineNode)> {
        let p = self.prefill.iter().enumerate().map(|(i, n)| (format!("p{i}"), n));
        let d = self.decode.iter().enumerate().map(|(i, n)| (format!("d{i}"), n));
        p.chain(d).collect()
    }

    /// Each engine's block stats now, by label.
    pub fn block_stats(&self) -> BTreeMap<String, BlockStats> {
        self.engines().into_iter().map(|(label, n)| (label, n.engine.block_stats())).collect()
    }

    /// Waits (bounded by `within`) until every engine holds no block and tracks no request;
    /// returns what each still holds at the end (all zero when they got there).
    pub async fn wait_baseline(&self, within: Duration) -> BTreeMap<String, Held> {
        let until = Instant::now() + within;
        loop {
            let held: BTreeMap<String, Held> = self
                .block_stats()
                .into_iter()
                .map(|(label, s)| (label, Held { blocks: s.total - s.free, requests: s.requests }))
                .collect();
            if held.values().all(|h| h.blocks == 0 && h.requests == 0) || Instant::now() >= until {
                return held;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Transfers the actors still track, by engine label: P's side-channel pulls in flight (the
    /// SenderListener), D's requests in a lifecycle state (the Receiver). `usize::MAX`: the actor
    /// did not answer within 2 s.
    pub async fn tracked_transfers(&self) -> BTreeMap<String, usize> {
        const ASK: Duration = Duration::from_secs(2);
        let mut out = BTreeMap::new();
        for (label, node) in self.engines() {
            let mut n = 0usize;
            if let Some(listener) = node.first_worker().and_then(|w| w.sender_listener.as_ref()) {
                n += tokio::time::timeout(ASK, listener.ask(InFlightPulls))
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .unwrap_or(usize::MAX);
            }
            if let Some(receiver) = node.first_worker().and_then(|w| w.receiver.as_ref()) {
                let tracked = tokio::time::timeout(ASK, receiver.ask(TransferStates)).await.ok().and_then(Result::ok);
                n = n.saturating_add(tracked.map_or(usize::MAX, |t| t.len()));
            }
            out.insert(label, n);
        }
        out
    }

    pub async fn shutdown(self) {
        self.proxy.shutdown().await;
        for node in self.prefill.into_iter().chain(self.decode) {
            node.kill().await;
        }
    }
}
