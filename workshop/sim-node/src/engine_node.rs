//! An engine node (`pdflow serve --role producer|consumer|both`): the simulated engine and its
//! HTTP API, with the connector's actors under the node's supervisor: the SchedulerConnector
//! (the scheduler role) and the worker side ([`pdflow_node::worker::Worker`]: P's Bootstrap and
//! SenderListener, D's data server and Receiver).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;

use kameo::prelude::*;
use kameo::supervision::RestartPolicy;
use pdflow_actors::fault_seam::{register_actor, ActorKind, Faults, Role};
use pdflow_actors::http_serve::{self, HttpLimits};
use pdflow_actors::scheduler_connector::{KvRole, SchedulerConnector, SchedulerConnectorArgs};
use pdflow_auth::PeerFilter;
use pdflow_connector::Connector;
use pdflow_kv::memory::KvCache;
use pdflow_sim_engine::{api, Engine, EngineConfig, EngineHandle};
use pdflow_transfer::tcp::TcpConfig;
use tokio_util::sync::CancellationToken;

use crate::error::SimNodeError;
use crate::rank_process::{shared_kv, RankLaunch, RankProcess, RankStart};
use crate::ranked_port::{RankPort, RankedPort};
use crate::ranks::RankTopology;
use pdflow_messages::rank_process::RankBootstrap;
use pdflow_node::config::Deadlines;
use pdflow_node::ports::{SchedulerPort, WorkerConnectorPort};
use pdflow_node::supervisor::{NodeSupervisor, MAX_RESTARTS, RESTART_WINDOW};
pub use pdflow_node::worker::BootstrapPlacement;
use pdflow_node::worker::{Worker, WorkerSpec};
use pdflow_node::{started, NodeError};

/// Everything an engine node needs.
#[derive(Debug, Clone)]
pub struct EngineNodeConfig {
    pub role: KvRole,
    /// Host to bind every socket on (HTTP, side channel, data server).
    pub host: String,
    /// HTTP port (0: any).
    pub port: u16,
    pub engine: EngineConfig,
    pub bootstrap: BootstrapPlacement,
    pub deadlines: Deadlines,
    pub tcp: TcpConfig,
    /// Record KV checksums on both sides of every transfer (steps 29 and 34).
    pub verify_checksums: bool,
    /// P: stream each prefill's KV to D layer by layer while later layers compute (`--layerwise`).
    pub layerwise: bool,
    /// Keep the KV cache on this CUDA device instead of host memory (feature `cuda`): P writes a
    /// D in this process by cuda-peer, on this host by cuda-ipc, elsewhere by cuda-staged
    /// (`tcp.gpu_path` chooses).
    pub kv_device: Option<usize>,
    /// The fault seam its actors are offered to ([`pdflow_actors::fault_seam::no_faults`]: none).
    pub faults: Faults,
    /// Tensor- and pipeline-parallel sizes: the engine's model is sharded over `tp × pp` workers
    /// as vLLM shards it (KV heads over tp, layers over pp), each with its own KV cache, side
    /// channel (P) or data server (D). 1 × 1: one worker holding everything.
    pub parallel: Parallel,
    /// The engine's data-parallel rank: P's workers register under it at bootstrap, where the
    /// proxy finds it (`/query`) and names it to P (`X-data-parallel-rank`). 0 without data
    /// parallelism; [`crate::dp_group::DataParallelGroup`] numbers its engines.
    pub dp_rank: u32,
    /// With tp or pp above 1: run each rank's worker in a process of its own, started this way
    /// ([`crate::rank_process`]); None: every rank's worker in this process.
    pub rank_processes: Option<RankLaunch>,
}

/// An engine's tensor- and pipeline-parallel sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parallel {
    pub tp: u32,
    pub pp: u32,
}

impl Default for Parallel {
    fn default() -> Self {
        Self { tp: 1, pp: 1 }
    }
}

/// A running engine node.
pub struct EngineNode {
    pub http_addr: SocketAddr,
    pub engine: EngineHandle,
    pub engine_id: String,
    pub kv_cache: Arc<KvCache>,
    pub role: KvRole,
    pub connector: ActorRef<SchedulerConnector>,
    /// The ranks' workers in this process, in vLLM's order (`pp_rank * tp + tp_rank`); empty
    /// when each rank runs in a process of its own (`rank_processes`).
    pub workers: Vec<Worker>,
    /// The ranks' processes, in the same order, when the ranks run apart.
    pub rank_processes: Vec<RankProcess>,
    /// Cancelled when a rank's process exits unasked: the engine cannot serve without it.
    rank_lost: CancellationToken,
    supervisor: ActorRef<NodeSupervisor>,
    http_stop: CancellationToken,
    http_task: tokio::task::JoinHandle<()>,
    side_channel: Arc<AtomicU16>,
}

impl EngineNode {
    pub async fn start(cfg: EngineNodeConfig) -> Result<Self, SimNodeError> {
        Self::start_on(cfg, 0).await
    }

    /// Starts the node with P's side channel on `side_channel_port` (0: any), so that a node
    /// started again after a crash binds and registers the same address (`pdflow chaos`).
    pub async fn start_on(cfg: EngineNodeConfig, side_channel_port: u16) -> Result<Self, SimNodeError> {
        let engine_id = cfg.engine.engine_id.clone();
        if let (Some(hybrid), true) = (&cfg.engine.hybrid, cfg.layerwise) {
            let groups = hybrid.groups.iter().map(|g| g.label()).collect::<Vec<_>>().join(", ");
            return Err(SimNodeError::HybridLayerwise { groups });
        }
        let side_channel = Arc::new(AtomicU16::new(side_channel_port));
        let sharded = cfg.parallel != Parallel::default();
        let apart = if sharded { cfg.rank_processes.clone() } else { None };
        let mut kv_files = Vec::new();
        let topology = match &apart {
            None => RankTopology::new(&cfg, || new_kv_cache(&cfg))?,
            Some(_) => RankTopology::with_caches(
                &cfg,
                || new_kv_cache(&cfg),
                |rank, shape| {
                    let (cache, file) =
                        shared_kv::create(shape, cfg.engine.num_blocks, &format!("{engine_id}-rank{rank}"))?;
                    kv_files.push(file);
                    Ok(cache)
                },
            )?,
        };
        let kv_cache = topology.ranks[0].1.clone();
        let supervisor = NodeSupervisor::spawn(format!("engine-{engine_id}"));
        let rank_lost = CancellationToken::new();
        let (workers, rank_processes, ports) = match apart {
            None => start_workers(&cfg, &topology, &supervisor, &side_channel).await?,
            Some(launch) => {
                let started = start_rank_processes(&cfg, &topology, &launch, kv_files, &side_channel, &rank_lost).await;
                match started {
                    Ok((processes, ports)) => (Vec::new(), processes, ports),
                    Err(e) => {
                        supervisor.kill();
                        return Err(e);
                    }
                }
            }
        };
        // P answers D's kv_transfer_params with its bootstrap (for a proxy that forwards them):
        // the one its workers registered with, so a bootstrap launched on port 0 is named by the
        // port it bound.
        let bootstrap_addr = match (workers.first(), rank_processes.first()) {
            (Some(worker), _) => worker.bootstrap_url.clone(),
            (None, Some(process)) => process.ready.bootstrap_url.clone(),
            (None, None) => cfg.bootstrap.url(&cfg.host),
        };
        let args = SchedulerConnectorArgs {
            engine_id: engine_id.clone().into(),
            role: cfg.role,
            bootstrap_addr,
            layerwise: cfg.layerwise,
            groups: cfg.engine.hybrid.as_ref().map(|h| h.groups.clone()).unwrap_or_default(),
            null_block: None,
        };
        let connector = SchedulerConnector::supervise(&supervisor, args)
            .restart_policy(RestartPolicy::Transient)
            .restart_limit(MAX_RESTARTS, RESTART_WINDOW)
            .spawn()
            .await;
        started("SchedulerConnector", &connector).await?;
        let role = if cfg.role == KvRole::Consumer { Role::D } else { Role::P };
        register_actor(&cfg.faults, ActorKind::SchedulerConnector, role, Vec::new(), &connector);
        let mut engine_cfg = cfg.engine.clone();
        engine_cfg.kv_state_timeout.get_or_insert(kv_state_timeout(&cfg.deadlines));
        engine_cfg.data_parallel_rank = cfg.dp_rank;
        let mut ports = ports;
        let worker_port: Arc<dyn WorkerConnectorPort> =
            if ports.len() == 1 { ports.remove(0).port } else { Arc::new(RankedPort::new(ports)) };
        let connector_ports = Connector { scheduler: Arc::new(SchedulerPort(connector.clone())), worker: worker_port };
        let engine = match (topology.ranks.len(), &engine_cfg.hybrid) {
            (1, None) => Engine::start(engine_cfg, kv_cache.clone(), Some(connector_ports)),
            _ => Engine::start_ranked(engine_cfg, topology.ranks.clone(), Some(connector_ports))?,
        };
        if let Err(e) = engine.kv_events_endpoints().await {
            engine.shutdown().await;
            supervisor.kill();
            return Err(e.into());
        }
        let (http_addr, http_stop, http_task) =
            serve_http(&cfg.host, cfg.port, api::router(engine.clone()), cfg.tcp.peers()).await?;
        Ok(Self {
            http_addr,
            engine,
            engine_id,
            kv_cache,
            role: cfg.role,
            connector,
            workers,
            rank_processes,
            rank_lost,
            supervisor,
            http_stop,
            http_task,
            side_channel,
        })
    }

    /// P's side-channel port (0 on D).
    pub fn side_channel_port(&self) -> u16 {
        self.side_channel.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Stops the node at once, as a process kill would: open HTTP responses are cut, the actors
    /// are killed (not stopped), the engine loop and the data server end, the ranks' processes
    /// are killed. Nothing is handed over.
    pub async fn kill(mut self) {
        self.http_stop.cancel();
        self.http_task.abort();
        self.supervisor.kill();
        self.connector.kill();
        for worker in &self.workers {
            worker.kill_actors();
        }
        for process in &mut self.rank_processes {
            process.kill_now().await;
        }
        for worker in &mut self.workers {
            worker.stop_bootstrap(true).await;
        }
        self.engine.shutdown().await;
        let _ = tokio::time::timeout(HTTP_STOP_DEADLINE, self.supervisor.wait_for_shutdown()).await;
        for worker in &mut self.workers {
            worker.stop_data_server().await;
        }
    }

    /// `http://host:port` of the engine's API.
    pub fn url(&self) -> String {
        format!("http://{}", self.http_addr)
    }

    /// Rank 0's worker, when the ranks run in this process.
    pub fn first_worker(&self) -> Option<&Worker> {
        self.workers.first()
    }

    /// D's data server address (rank 0's, where P writes KV), if this node has one.
    pub fn data_addr(&self) -> Option<SocketAddr> {
        match (self.workers.first(), self.rank_processes.first()) {
            (Some(worker), _) => worker.data_addr(),
            (None, Some(process)) => process.ready.data_addr.as_deref().and_then(|a| a.parse().ok()),
            (None, None) => None,
        }
    }

    /// P: the bootstrap rank 0 launched, `host:port`.
    pub fn launched_bootstrap_addr(&self) -> Option<SocketAddr> {
        match (self.workers.first(), self.rank_processes.first()) {
            (Some(worker), _) => worker.bootstrap.as_ref().map(|b| b.addr),
            (None, Some(process)) => process.ready.launched_bootstrap.as_deref().and_then(|a| a.parse().ok()),
            (None, None) => None,
        }
    }

    /// P: the bootstrap rank 0 launched, as a URL.
    pub fn launched_bootstrap_url(&self) -> Option<String> {
        self.launched_bootstrap_addr().map(|a| format!("http://{a}"))
    }

    /// P: the bootstrap its workers registered with.
    pub fn bootstrap_url(&self) -> Option<String> {
        match (self.workers.first(), self.rank_processes.first()) {
            (Some(worker), _) => worker.bootstrap_url.clone(),
            (None, Some(process)) => process.ready.bootstrap_url.clone(),
            (None, None) => None,
        }
    }

    /// Cancelled when one of the ranks' processes exits unasked (the engine cannot serve then).
    pub fn rank_lost(&self) -> CancellationToken {
        self.rank_lost.clone()
    }

    /// Stops the HTTP server, the engine, the actors, the data server and the ranks' processes.
    pub async fn shutdown(mut self) {
        stop_http(self.http_stop, self.http_task).await;
        self.engine.shutdown().await;
        // The other ranks register with rank 0's bootstrap: it stops last.
        for process in self.rank_processes.into_iter().rev() {
            process.stop().await;
        }
        for worker in self.workers.iter_mut().rev() {
            worker.stop_bootstrap(false).await;
        }
        let _ = self.supervisor.stop_gracefully().await;
        self.supervisor.wait_for_shutdown().await;
        for worker in &mut self.workers {
            worker.stop_data_server().await;
        }
    }
}

type Workers = (Vec<Worker>, Vec<RankProcess>, Vec<RankPort>);

/// Where a rank registers: rank 0 (`first_url` None: it does not run yet) where the engine's
/// configuration says (a data-parallel group points its later engines at the first's bootstrap),
/// the others where rank 0 did (`Some(its bootstrap URL)`).
fn rank_placement(cfg: &EngineNodeConfig, first_url: Option<Option<String>>) -> BootstrapPlacement {
    match (cfg.role.produces(), first_url) {
        (false, _) => BootstrapPlacement::None,
        (true, None) => cfg.bootstrap.clone(),
        (true, Some(Some(url))) => BootstrapPlacement::External { url },
        (true, Some(None)) => BootstrapPlacement::None,
    }
}

/// A rank's placement as its process is told it in the hello.
fn rank_bootstrap(placement: BootstrapPlacement) -> RankBootstrap {
    match placement {
        BootstrapPlacement::Launch { port } => RankBootstrap::Launch { port },
        BootstrapPlacement::External { url } => RankBootstrap::External { url },
        BootstrapPlacement::None => RankBootstrap::None,
    }
}

/// Every rank's worker in this process, under the node's supervisor.
async fn start_workers(
    cfg: &EngineNodeConfig,
    topology: &RankTopology,
    supervisor: &ActorRef<NodeSupervisor>,
    side_channel: &Arc<AtomicU16>,
) -> Result<Workers, NodeError> {
    let mut workers: Vec<Worker> = Vec::with_capacity(topology.ranks.len());
    let mut ports = Vec::with_capacity(topology.ranks.len());
    for (i, (layout, cache)) in topology.ranks.iter().enumerate() {
        let bootstrap = rank_placement(cfg, workers.first().map(|w| w.bootstrap_url.clone()));
        let spec = WorkerSpec {
            engine_id: cfg.engine.engine_id.clone(),
            role: cfg.role,
            rank: topology.worker_rank(i),
            dp_rank: cfg.dp_rank,
            host: cfg.host.clone(),
            bootstrap,
            side_channel: if i == 0 { side_channel.clone() } else { Arc::new(AtomicU16::new(0)) },
            data_port: 0,
            deadlines: cfg.deadlines,
            tcp: cfg.tcp.clone(),
            verify_checksums: cfg.verify_checksums,
            faults: cfg.faults.clone(),
        };
        let worker = Worker::start_under(supervisor, cache, &spec).await?;
        ports.push(RankPort { port: Arc::new(worker.port()), layers: layout.layers.clone() });
        workers.push(worker);
    }
    Ok((workers, Vec::new(), ports))
}

/// Every rank's worker in a process of its own, over the shared caches in `kv_files` (in rank
/// order); rank 0 first, since it launches or finds P's bootstrap. A rank's process exiting
/// unasked cancels `lost`. On failure, the processes already started are stopped.
async fn start_rank_processes(
    cfg: &EngineNodeConfig,
    topology: &RankTopology,
    launch: &RankLaunch,
    kv_files: Vec<shared_kv::TempFile>,
    side_channel: &Arc<AtomicU16>,
    lost: &CancellationToken,
) -> Result<(Vec<RankProcess>, Vec<RankPort>), SimNodeError> {
    let mut processes: Vec<RankProcess> = Vec::with_capacity(kv_files.len());
    let mut ports = Vec::with_capacity(kv_files.len());
    for (i, kv_file) in kv_files.into_iter().enumerate() {
        let start = RankStart {
            engine_id: cfg.engine.engine_id.clone(),
            dp_rank: cfg.dp_rank,
            rank: i as u32,
            kv_file,
            bootstrap: rank_bootstrap(rank_placement(cfg, processes.first().map(|p| p.ready.bootstrap_url.clone()))),
            side_channel_port: if i == 0 { side_channel.load(Ordering::Acquire) } else { 0 },
            lost: lost.clone(),
        };
        match RankProcess::start(launch, start).await {
            Ok(process) => {
                if i == 0 {
                    side_channel.store(process.ready.side_channel_port, Ordering::Release);
                }
                let port: Arc<dyn WorkerConnectorPort> = process.port.clone();
                ports.push(RankPort { port, layers: topology.ranks[i].0.layers.clone() });
                processes.push(process);
            }
            Err(e) => {
                for p in processes {
                    p.stop().await;
                }
                return Err(e.into());
            }
        }
    }
    Ok((processes, ports))
}

/// The engine's deadline for holding blocks on the connector's behalf: longer than
/// every deadline of the transfer path (a pull's bootstrap look-up and exchange on D; P's send
/// expiry or a pull's exchange), so that when it passes no write can still land.
pub fn kv_state_timeout(d: &Deadlines) -> std::time::Duration {
    d.held_backstop()
}

/// Serves `router` on `host:port` until the returned token is cancelled, to the clients `peers`
/// lets in (an engine's: [`TcpConfig::peers`], loopback only without a secret unless
/// `insecure`), held to [`HttpLimits::default`] (header and idle deadlines, connection caps;
/// `service="engine"` in `/metrics`).
pub async fn serve_http(
    host: &str,
    port: u16,
    router: axum::Router,
    peers: PeerFilter,
) -> Result<(SocketAddr, CancellationToken, tokio::task::JoinHandle<()>), NodeError> {
    let addr = format!("{host}:{port}");
    let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|source| NodeError::Bind {
        what: "the engine HTTP API",
        addr: addr.clone(),
        source,
    })?;
    let local =
        listener.local_addr().map_err(|source| NodeError::Bind { what: "the engine HTTP API", addr, source })?;
    let stop = CancellationToken::new();
    let token = stop.clone();
    let task = tokio::spawn(http_serve::serve(listener, router, "engine", HttpLimits::serving(peers), token));
    Ok((local, stop, task))
}

/// How long a stopping HTTP server may take to finish its open responses.
pub const HTTP_STOP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// Stops a server started by [`serve_http`]: graceful first, aborted after [`HTTP_STOP_DEADLINE`]
/// (an open stream must not hold a node's shutdown forever).
pub async fn stop_http(stop: CancellationToken, mut task: tokio::task::JoinHandle<()>) {
    stop.cancel();
    if tokio::time::timeout(HTTP_STOP_DEADLINE, &mut task).await.is_err() {
        tracing::warn!("HTTP server still had open responses after {HTTP_STOP_DEADLINE:?}: aborted");
        task.abort();
    }
}

/// The node's KV cache: host memory, or GPU memory with `kv_device` (feature `cuda`).
fn new_kv_cache(cfg: &EngineNodeConfig) -> Result<Arc<KvCache>, SimNodeError> {
    let (shape, blocks) = (cfg.engine.shape, cfg.engine.num_blocks);
    match cfg.kv_device {
        None => Ok(KvCache::new(shape, blocks)),
        #[cfg(feature = "cuda")]
        Some(device) => {
            KvCache::new_cuda(shape, blocks, device).map_err(|e| SimNodeError::KvOnGpu { device, source: Box::new(e) })
        }
        #[cfg(not(feature = "cuda"))]
        Some(device) => Err(SimNodeError::NoGpuSupport { device }),
    }
}
