//! `pdflow._native.WorkerConnector` — the worker role of `PdflowConnector`: the worker side
//! `pdflow serve` runs ([`pdflow_node::worker::Worker`]), over vLLM's own KV tensors.
//!
//! `register_kv_caches` (seed step 3) checks the tensors' geometry against the worker's place
//! among the engine's ranks ([`pdflow_node::registration`]), registers their memory as regions —
//! host memory, or with `device` a CUDA device's memory (a build with `--features cuda`) — and
//! starts the worker: on P the Bootstrap (step 2, on the worker the registration says launches
//! it, unless an external one is configured) and the SenderListener (side channel +
//! registration, steps 1, 4); on D the tcp data server and the Receiver (step 5); both for
//! kv_both.
//! The worker that launches P's bootstrap by vLLM's rule (one per engine, or per node's engines)
//! also advertises the engine for `pdflow proxy --discover` when `advertise_url` is set
//! ([`crate::advertise`]).
//! `start_load_kv` forwards the step's metadata (steps 14, 19), `get_transfer_results` collects
//! `finished_sending` (step 32) and `finished_recving` / failed loads (step 35).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kameo::prelude::*;
use pdflow_actors::scheduler_connector::KvRole;
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_messages::frame;
use pdflow_messages::scheduler_connector::{ConnectorMetadata, ConnectorOutput, LayerSave};
use pdflow_messages::{BlockId, RequestId};
use pdflow_node::ports::{WorkerConnectorPort, WorkerPort};
use pdflow_node::registration::{KvGeometry, KvRegistration, WorkerTopology};
use pdflow_node::supervisor::NodeSupervisor;
use pdflow_node::worker::{Worker, WorkerSpec};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::advertise::{Advertisement, KvEventsSettings};
use crate::config::{BridgeConfig, ConfigError};
use crate::error::{BridgeError, RegistrationError};
use crate::runtime::BridgeRuntime;
use crate::scheduler::parse_role;
use crate::topology::TopologyBridge;

/// Longest a worker call may wait for an actor.
const CALL_DEADLINE: Duration = Duration::from_secs(10);
/// Runtime threads of one worker: the side channel, the data path and the pulls.
const RUNTIME_THREADS: usize = 2;

/// The running worker side, once the KV caches are registered.
struct Running {
    supervisor: ActorRef<NodeSupervisor>,
    kv_cache: Arc<KvCache>,
    worker: Worker,
    port: Arc<WorkerPort>,
    info: Vec<(&'static str, String)>,
    /// Keeps the engine advertised at its bootstraps while it runs (dropped first on shutdown).
    advertiser: Option<pdflow_actors::advertise::Advertiser>,
}

/// The worker role.
#[pyclass(module = "pdflow._native", name = "WorkerConnector", frozen)]
pub struct WorkerBridge {
    #[pyo3(get)]
    engine_id: String,
    role: KvRole,
    config: BridgeConfig,
    rt: BridgeRuntime,
    running: Mutex<Option<Running>>,
    /// D: blocks of failed loads, until `get_block_ids_with_load_errors` drains them.
    load_errors: Mutex<BTreeSet<BlockId>>,
    /// Layer-wise P: the step's `reqs_to_save` (from its metadata), for `save_kv_layer`.
    reqs_to_save: Mutex<BTreeMap<RequestId, LayerSave>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data behind; keep serving it.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl WorkerBridge {
    fn port(&self) -> Result<Arc<WorkerPort>, BridgeError> {
        let running = lock(&self.running);
        let r = running
            .as_ref()
            .ok_or_else(|| BridgeError::unavailable("worker connector", "register_kv_caches has not been called"))?;
        Ok(r.port.clone())
    }

    async fn start(
        &self,
        kv_cache: Arc<KvCache>,
        registration: &KvRegistration,
        advertising: Option<(u32, Option<KvEventsSettings>)>,
    ) -> Result<Running, BridgeError> {
        let cfg = &self.config;
        let rank = registration.rank;
        let supervisor =
            NodeSupervisor::spawn(format!("vllm-worker-{}-tp{}-pp{}", self.engine_id, rank.tp_rank, rank.pp_rank));
        let spec = WorkerSpec {
            engine_id: self.engine_id.clone(),
            role: self.role,
            rank,
            dp_rank: registration.dp_rank,
            host: cfg.host.clone(),
            bootstrap: registration.bootstrap(cfg.bootstrap_url.as_deref(), &cfg.host, cfg.bootstrap_port),
            side_channel: Arc::new(AtomicU16::new(pinned(registration, "side_channel_port", cfg.side_channel_port)?)),
            data_port: pinned(registration, "data_port", cfg.data_port)?,
            deadlines: cfg.deadlines,
            tcp: cfg.tcp.clone(),
            verify_checksums: cfg.verify_checksums,
            faults: pdflow_actors::fault_seam::no_faults(),
        };
        let worker = Worker::start_under(&supervisor, &kv_cache, &spec).await?;
        let mut info = vec![("engine_id", self.engine_id.clone())];
        if let Some(url) = &worker.bootstrap_url {
            info.push(("bootstrap_url", url.clone()));
        }
        if let Some(addr) = worker.data_addr() {
            info.push(("data_addr", addr.to_string()));
        }
        if let Some(endpoint) = worker.rdma_endpoint() {
            info.push(("rdma", endpoint.to_string()));
        }
        if worker.sender_listener.is_some() {
            info.push(("side_channel_addr", format!("{}:{}", cfg.host, spec.side_channel.load(Ordering::Acquire))));
        }
        let mut advertiser = None;
        if let (Some(advertise), Some((first_rank, kv_events))) = (&cfg.advertise, advertising) {
            let own_bootstrap = worker.bootstrap_url.as_deref();
            match Advertisement::new(
                &self.engine_id,
                self.role,
                advertise,
                own_bootstrap,
                kv_events.as_ref(),
                first_rank,
            ) {
                Ok(ad) => {
                    advertiser = ad.start(cfg.tcp.secret.clone());
                    if advertiser.is_some() {
                        info.push(("advertised", serde_json::to_string(&ad.engine).unwrap_or_default()));
                        info.push(("advertised_at", ad.bootstraps.join(", ")));
                    }
                }
                Err(reason) => tracing::warn!(%reason, "the engine is not advertised; it serves all the same"),
            }
        }
        let port = Arc::new(worker.port());
        Ok(Running { supervisor, kv_cache, worker, port, info, advertiser })
    }
}

/// This worker's port for a pinned base port (0: any); past 65535 is the setting's error.
fn pinned(registration: &KvRegistration, key: &'static str, base: u16) -> Result<u16, BridgeError> {
    registration.port(key, base).map_err(|e| BridgeError::Config(ConfigError::PortRange(e)))
}

/// The cache over vLLM's tensors: host memory, or CUDA device `device`'s.
fn register_memory(
    shape: KvShape,
    num_blocks: usize,
    raw: &[(*mut u8, usize)],
    owner: Py<PyAny>,
    device: Option<usize>,
) -> Result<Arc<KvCache>, BridgeError> {
    let registration = |e| BridgeError::Registration(RegistrationError::Memory(e));
    match device {
        // SAFETY: the addresses come from the tensors in `owner` (host memory, checked contiguous
        // by the Python side), which the cache keeps alive; vLLM's block manager gives each block
        // one owner at a time, which is the cache's contract.
        None => unsafe { KvCache::from_external(shape, num_blocks, raw, Box::new(owner)) }.map_err(registration),
        #[cfg(feature = "cuda")]
        // SAFETY: as above, for the tensors' device memory (each region is checked to lie in an
        // allocation of `device`).
        Some(device) => unsafe { KvCache::from_external_cuda(shape, num_blocks, device, raw, Box::new(owner)) }
            .map_err(registration),
        #[cfg(not(feature = "cuda"))]
        Some(device) => {
            drop(owner);
            Err(RegistrationError::NoGpuSupport { device }.into())
        }
    }
}

#[pymethods]
impl WorkerBridge {
    /// `extra_config_json`: `kv_connector_extra_config` as JSON; the environment fills the rest.
    #[new]
    fn new(engine_id: String, kv_role: &str, extra_config_json: &str) -> PyResult<Self> {
        let role = parse_role(kv_role)?;
        let config = BridgeConfig::from_json(extra_config_json, &|k| std::env::var(k).ok())?;
        config.check_role(role)?;
        // The worker's sockets bind after this: they take the operator's limits.
        if !pdflow_auth::limits::install(config.limits) {
            let in_force = pdflow_auth::limits::process();
            tracing::warn!(?in_force, "limits were already set for this process; the config's are ignored");
        }
        let rt = BridgeRuntime::multi_thread(RUNTIME_THREADS, "pdflow-worker")?;
        Ok(Self {
            engine_id,
            role,
            config,
            rt,
            running: Mutex::new(None),
            load_errors: Mutex::new(BTreeSet::new()),
            reqs_to_save: Mutex::new(BTreeMap::new()),
        })
    }

    /// Seed step 3: registers one region per entry of `regions` (`(address, length)` of host
    /// memory — or, with `device`, of that CUDA device's memory — one per layer), each of
    /// `geometry` `(num_blocks, num_kv_heads, block_size, head_dim, dtype_bytes)`: `num_blocks`
    /// blocks of `num_kv_heads × block_size × 2·head_dim` elements of `dtype_bytes`. `owner` (the
    /// tensors) is kept alive for as long as the connector is. `topology` says where vLLM placed
    /// this worker (None: the one worker of an engine that is neither sharded nor data-parallel);
    /// the tensors must be its share of the model by vLLM's default split, which both ends of a
    /// pull plan with. Then starts the worker-side actors. Returns what peers need: engine id,
    /// bootstrap URL (P) or data server address (D); with `advertise_url`, on the worker that
    /// advertises the engine, what it advertises (`advertised`, JSON) and where (`advertised_at`).
    /// `kv_events`: vLLM's KV-event publisher as `(endpoint, replay_endpoint, topic, ranks)`,
    /// `ranks` the data-parallel engines on this node (None: it publishes none), for the
    /// advertisement.
    #[pyo3(signature = (regions, geometry, owner, device=None, topology=None, kv_events=None))]
    #[allow(clippy::too_many_arguments)]
    fn register_kv_caches<'py>(
        &self,
        py: Python<'py>,
        regions: Vec<(usize, usize)>,
        geometry: (usize, usize, usize, usize, usize),
        owner: Py<PyAny>,
        device: Option<usize>,
        topology: Option<PyRef<'py, TopologyBridge>>,
        kv_events: Option<(String, Option<String>, String, u32)>,
    ) -> PyResult<Bound<'py, PyDict>> {
        if lock(&self.running).is_some() {
            return Err(BridgeError::from(RegistrationError::AlreadyRegistered).into());
        }
        let (num_blocks, num_kv_heads, block_size, head_dim, dtype_bytes) = geometry;
        let geometry = KvGeometry { num_blocks, num_kv_heads, block_size, head_dim, dtype_bytes };
        let topology = topology.map_or_else(WorkerTopology::single, |t| t.0.clone());
        let registration = KvRegistration::new(regions.len(), geometry, &topology).map_err(BridgeError::from)?;
        let raw: Vec<(*mut u8, usize)> = regions.iter().map(|&(addr, len)| (addr as *mut u8, len)).collect();
        let kv_cache = register_memory(registration.shape, registration.num_blocks, &raw, owner, device)?;
        // One worker per bootstrap advertises: the one that launches P's bootstrap by vLLM's rule.
        let advertising = registration.launches_bootstrap.then(|| {
            let kv_events = kv_events.map(|(endpoint, replay_endpoint, topic, ranks)| KvEventsSettings {
                endpoint,
                replay_endpoint,
                topic,
                ranks,
            });
            (topology.data_parallel().rank, kv_events)
        });
        let running = py.detach(|| self.rt.block_on(self.start(kv_cache, &registration, advertising)))??;
        let info = PyDict::new(py);
        for (k, v) in &running.info {
            info.set_item(*k, v)?;
        }
        info.set_item("regions", running.kv_cache.regions().len())?;
        info.set_item("kv_memory", running.kv_cache.memory().to_string())?;
        *lock(&self.running) = Some(running);
        Ok(info)
    }

    /// Steps 14 and 19: hands this step's metadata frame to the actors (P: the sends to expect;
    /// D: the pulls to make and the pulls to cancel). Returns at once; the work is the actors'.
    fn start_load_kv(&self, py: Python<'_>, metadata: &[u8]) -> PyResult<()> {
        if metadata.is_empty() {
            return Ok(());
        }
        let meta: ConnectorMetadata = frame::decode(metadata, "connector metadata").map_err(BridgeError::from)?;
        let port = self.port()?;
        py.detach(|| -> Result<(), BridgeError> {
            self.rt
                .block_on(async { tokio::time::timeout(CALL_DEADLINE, port.start_load_kv(meta)).await })?
                .map_err(|_| {
                    BridgeError::unavailable("worker connector", "the actors did not take the step's work in time")
                })?
                .map_err(BridgeError::from)
        })?;
        Ok(())
    }

    /// Layer-wise P: the step's metadata as bound for its forward (vLLM calls `start_load_kv`
    /// after launching the forward, so the layers' saves cannot wait for it): its `reqs_to_save`
    /// are what `save_kv_layer` streams.
    fn bind_reqs_to_save(&self, metadata: &[u8]) -> PyResult<()> {
        let reqs = if metadata.is_empty() {
            BTreeMap::new()
        } else {
            let meta: ConnectorMetadata = frame::decode(metadata, "connector metadata").map_err(BridgeError::from)?;
            meta.reqs_to_save
        };
        *lock(&self.reqs_to_save) = reqs;
        Ok(())
    }

    /// Layer-wise P (vLLM's `save_kv_layer`): KV region `region` of this step's forward is
    /// written; the step's prefills stream it to D. Never waits on the network.
    fn save_kv_layer(&self, region: usize) -> PyResult<()> {
        let reqs = lock(&self.reqs_to_save);
        if reqs.is_empty() {
            return Ok(());
        }
        self.port()?.save_kv_layer(region, &reqs);
        Ok(())
    }

    /// Steps 32 and 35: `(finished_sending, finished_recving, failed_recving)` since the last call.
    /// A failed load is in `finished_recving` too (vLLM must release the request) and its blocks
    /// are reported by `get_block_ids_with_load_errors`.
    fn get_transfer_results(&self, py: Python<'_>) -> PyResult<(Vec<String>, Vec<String>, Vec<String>)> {
        let port = self.port()?;
        let output: ConnectorOutput = py.detach(|| -> Result<_, BridgeError> {
            self.rt
                .block_on(async { tokio::time::timeout(CALL_DEADLINE, port.get_finished()).await })?
                .map_err(|_| {
                    BridgeError::unavailable("worker connector", format!("no answer within {CALL_DEADLINE:?}"))
                })?
                .map_err(BridgeError::from)
        })?;
        let mut recving: Vec<String> = output.finished_recving.into_iter().map(String::from).collect();
        let mut failed = Vec::new();
        let mut load_errors = lock(&self.load_errors);
        for (req_id, failure) in output.failed_recving {
            tracing::warn!(request_id = %req_id, reason = %failure, "KV load failed; vLLM's kv_load_failure_policy decides (recompute or fail)");
            load_errors.extend(failure.block_ids);
            recving.push(req_id.to_string());
            failed.push(req_id.to_string());
        }
        Ok((output.finished_sending.into_iter().map(String::from).collect(), recving, failed))
    }

    /// Blocks whose load failed since the last call (drained).
    fn get_block_ids_with_load_errors(&self) -> Vec<BlockId> {
        std::mem::take(&mut *lock(&self.load_errors)).into_iter().collect()
    }

    /// What `register_kv_caches` returned, or None before it.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let running = lock(&self.running);
        let Some(r) = running.as_ref() else { return Ok(None) };
        let info = PyDict::new(py);
        for (k, v) in &r.info {
            info.set_item(*k, v)?;
        }
        Ok(Some(info))
    }

    /// Stops the actors, the bootstrap and the data server (bounded); idempotent.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let Some(r) = lock(&self.running).take() else { return Ok(()) };
        if !self.rt.is_local() {
            std::mem::forget(r);
            return Ok(());
        }
        py.detach(|| {
            self.rt.block_on(async move {
                // No longer advertised (the bootstrap drops the engine once it stops hearing it).
                drop(r.advertiser);
                let mut worker = r.worker;
                let stop = async {
                    worker.stop_bootstrap(false).await;
                    let _ = r.supervisor.stop_gracefully().await;
                    r.supervisor.wait_for_shutdown().await;
                    worker.stop_data_server().await;
                };
                if tokio::time::timeout(Duration::from_secs(10), stop).await.is_err() {
                    tracing::warn!("pdflow worker connector: shutdown still running after 10 s; abandoned");
                }
                drop(r.kv_cache);
            })
        })?;
        Ok(())
    }
}
