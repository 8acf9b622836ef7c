//! `pdflow._native.WorkerConnector` — the worker role of `PdflowConnector`: the same worker-side
//! actors `pdflow serve` runs, over vLLM's own KV tensors.
//!
//! `register_kv_caches` (seed step 3) registers the tensors' memory as regions — host memory, or
//! with `device` a CUDA device's memory (a build with `--features cuda`) — and starts, on P,
//! the Bootstrap (step 2, TP0 only, unless an external one is configured) and the SenderListener
//! (side channel + registration, steps 1, 4); on D, the tcp data server and the Receiver (step 5).
//! `start_load_kv` forwards the step's metadata (steps 14, 19), `get_transfer_results` collects
//! `finished_sending` (step 32) and `finished_recving` / failed loads (step 35).

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::AtomicU16;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kameo::prelude::*;
use kameo::supervision::RestartPolicy;
use pdflow_actors::receiver::{Receiver, ReceiverArgs};
use pdflow_actors::scheduler_connector::KvRole;
use pdflow_actors::sender_listener::{SenderListener, SenderListenerArgs};
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_messages::frame;
use pdflow_messages::receiver::{GetFinishedRecving, StartLoadKv};
use pdflow_messages::scheduler_connector::ConnectorMetadata;
use pdflow_messages::sender_listener::{GetFinishedSending, RecordSendReqs};
use pdflow_messages::{BlockId, RequestId};
use pdflow_node::gpu_kv::{self, Held};
use pdflow_node::supervisor::{NodeSupervisor, MAX_RESTARTS, RESTART_WINDOW};
use pdflow_node::BootstrapNode;
use pdflow_transfer::tcp::TcpDataServer;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokio::sync::Notify;

use crate::config::BridgeConfig;
use crate::error::BridgeError;
use crate::runtime::BridgeRuntime;
use crate::scheduler::parse_role;

/// Longest a worker call may wait for an actor.
const CALL_DEADLINE: Duration = Duration::from_secs(10);
/// Runtime threads of one worker: the side channel, the data path and the pulls.
const RUNTIME_THREADS: usize = 2;

/// The running worker side, once the KV caches are registered.
struct Running {
    supervisor: ActorRef<NodeSupervisor>,
    kv_cache: Arc<KvCache>,
    sender_listener: Option<ActorRef<SenderListener>>,
    receiver: Option<ActorRef<Receiver>>,
    bootstrap: Option<BootstrapNode>,
    data_server: Option<TcpDataServer>,
    /// D's serving of GPU KV (staged receiver, local-peer registration), while it serves.
    _gpu_serving: Vec<Held>,
    info: Vec<(&'static str, String)>,
}

/// P's SenderListener or D's Receiver (whichever this worker runs).
type WorkerRefs = (Option<ActorRef<SenderListener>>, Option<ActorRef<Receiver>>);

#[derive(Default)]
struct Ledger {
    /// D: the local blocks of every pull not yet settled, by request id.
    recv_blocks: HashMap<RequestId, Vec<BlockId>>,
    /// D: blocks of failed loads, until `get_block_ids_with_load_errors` drains them.
    load_errors: BTreeSet<BlockId>,
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
    ledger: Mutex<Ledger>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data behind; keep serving it.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn started<A: kameo::Actor>(actor: &'static str, r: &ActorRef<A>) -> Result<(), BridgeError>
where
    A::Error: std::fmt::Display,
{
    r.wait_for_startup_with_result(|res| {
        res.map_err(|e| BridgeError::unavailable(actor, format!("did not start: {e}")))
    })
    .await
}

impl WorkerBridge {
    fn refs(&self) -> Result<WorkerRefs, BridgeError> {
        let running = lock(&self.running);
        let r = running
            .as_ref()
            .ok_or_else(|| BridgeError::unavailable("worker connector", "register_kv_caches has not been called"))?;
        Ok((r.sender_listener.clone(), r.receiver.clone()))
    }

    async fn start(&self, kv_cache: Arc<KvCache>, tp_rank: u32) -> Result<Running, BridgeError> {
        let cfg = &self.config;
        let supervisor = NodeSupervisor::spawn(format!("vllm-worker-{}-tp{tp_rank}", self.engine_id));
        let events = Arc::new(Notify::new());
        let mut info = vec![("engine_id", self.engine_id.clone())];
        let (mut sender_listener, mut receiver, mut bootstrap, mut data_server) = (None, None, None, None);
        let mut gpu_serving: Vec<Held> = Vec::new();
        // kv_both runs both halves: it may prefill for a peer and load from one.
        let (produces, consumes) = (
            matches!(self.role, KvRole::Producer | KvRole::Both),
            matches!(self.role, KvRole::Consumer | KvRole::Both),
        );
        if produces {
            let bootstrap_url = match &cfg.bootstrap_url {
                Some(url) => url.clone(),
                None if tp_rank == 0 => {
                    let bind: SocketAddr = format!("{}:{}", cfg.host, cfg.bootstrap_port).parse().map_err(|e| {
                        BridgeError::Config(format!("bootstrap address {}:{}: {e}", cfg.host, cfg.bootstrap_port))
                    })?;
                    let node = BootstrapNode::start_under(&supervisor, bind).await.map_err(|e| {
                        BridgeError::Config(format!(
                            "{e} (set VLLM_MOONCAKE_BOOTSTRAP_PORT or kv_connector_extra_config[\"bootstrap_port\"])"
                        ))
                    })?;
                    let url = node.url();
                    bootstrap = Some(node);
                    url
                }
                None => cfg.bootstrap_addr(),
            };
            info.push(("bootstrap_url", bootstrap_url.clone()));
            let transfer =
                gpu_kv::producer_engine(&kv_cache, &cfg.tcp).map_err(|e| BridgeError::Config(e.to_string()))?;
            let args = SenderListenerArgs {
                engine_id: self.engine_id.clone(),
                dp_rank: 0,
                tp_rank,
                pp_rank: 0,
                bind_host: cfg.host.clone(),
                side_channel_port: Arc::new(AtomicU16::new(0)),
                bootstrap_url: Some(bootstrap_url),
                kv_cache: kv_cache.clone(),
                transfer,
                ready_timeout: cfg.deadlines.ready_timeout,
                send_expiry: cfg.deadlines.send_expiry,
                register_attempts: 8,
                register_backoff: Duration::from_millis(100),
                events: events.clone(),
                verify_checksums: cfg.verify_checksums,
                lineage: Default::default(),
            };
            let listener = SenderListener::supervise(&supervisor, args)
                .restart_policy(RestartPolicy::Transient)
                .restart_limit(MAX_RESTARTS, RESTART_WINDOW)
                .spawn()
                .await;
            started("SenderListener", &listener).await?;
            sender_listener = Some(listener);
        }
        if consumes {
            let gpu_kv::KvDataServing { server, fence, held } =
                gpu_kv::serve_kv_data(&kv_cache, &cfg.host, &format!("{}:0", cfg.host), &cfg.tcp)
                    .await
                    .map_err(|e| BridgeError::unavailable("KV data server", e))?;
            gpu_serving.extend(held);
            info.push(("data_addr", server.local_addr().to_string()));
            let args = ReceiverArgs {
                engine_id: self.engine_id.clone(),
                tp_rank,
                tp_size: 1,
                pp_size: 1,
                kv_cache: kv_cache.clone(),
                data_addr: server.local_addr().to_string(),
                pull_timeout: cfg.deadlines.pull_timeout,
                bootstrap_timeout: cfg.deadlines.bootstrap_timeout,
                events: events.clone(),
                verify_checksums: cfg.verify_checksums,
                fence: Some(fence),
            };
            data_server = Some(server);
            let r = Receiver::supervise(&supervisor, args)
                .restart_policy(RestartPolicy::Transient)
                .restart_limit(MAX_RESTARTS, RESTART_WINDOW)
                .spawn()
                .await;
            started("Receiver", &r).await?;
            receiver = Some(r);
        }
        Ok(Running {
            supervisor,
            kv_cache,
            sender_listener,
            receiver,
            bootstrap,
            data_server,
            _gpu_serving: gpu_serving,
            info,
        })
    }
}

/// The cache over vLLM's tensors: host memory, or CUDA device `device`'s.
fn register_memory(
    shape: KvShape,
    num_blocks: usize,
    raw: &[(*mut u8, usize)],
    owner: Py<PyAny>,
    device: Option<usize>,
) -> Result<Arc<KvCache>, BridgeError> {
    let registration = |e: pdflow_kv::memory::ExternalRegionError| BridgeError::Registration(e.to_string());
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
            Err(BridgeError::Registration(format!(
                "KV cache on cuda:{device}: this pdflow wheel was built without GPU support (build it with `maturin build --features cuda`)"
            )))
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
        let rt = BridgeRuntime::multi_thread(RUNTIME_THREADS, "pdflow-worker")?;
        Ok(Self { engine_id, role, config, rt, running: Mutex::new(None), ledger: Mutex::new(Ledger::default()) })
    }

    /// Seed step 3: registers one region per entry of `regions` (`(address, length)` of host
    /// memory — or, with `device`, of that CUDA device's memory — one per layer, each `num_blocks` blocks of `num_kv_heads × block_size × 2·head_dim`
    /// elements of `dtype_bytes`), then starts the worker-side actors. `owner` (the tensors) is
    /// kept alive for as long as the connector is. Returns what peers need: engine id, bootstrap
    /// URL (P) or data server address (D).
    #[pyo3(signature = (regions, num_blocks, num_kv_heads, block_size, head_dim, dtype_bytes, owner, tp_rank=0, tp_size=1, device=None))]
    #[allow(clippy::too_many_arguments)]
    fn register_kv_caches<'py>(
        &self,
        py: Python<'py>,
        regions: Vec<(usize, usize)>,
        num_blocks: usize,
        num_kv_heads: usize,
        block_size: usize,
        head_dim: usize,
        dtype_bytes: usize,
        owner: Py<PyAny>,
        tp_rank: u32,
        tp_size: u32,
        device: Option<usize>,
    ) -> PyResult<Bound<'py, PyDict>> {
        if tp_size != 1 {
            return Err(BridgeError::Config(format!(
                "tensor_parallel_size {tp_size}: pdflow's vLLM connector supports TP=1 so far (run one engine per GPU)"
            ))
            .into());
        }
        if lock(&self.running).is_some() {
            return Err(
                BridgeError::Registration("register_kv_caches was already called for this connector".into()).into()
            );
        }
        if regions.is_empty()
            || num_blocks == 0
            || num_kv_heads == 0
            || block_size == 0
            || head_dim == 0
            || dtype_bytes == 0
        {
            return Err(BridgeError::Registration(format!(
                "empty KV cache: {} regions, {num_blocks} blocks, shape heads={num_kv_heads} block={block_size} head_dim={head_dim} dtype_bytes={dtype_bytes}",
                regions.len()
            ))
            .into());
        }
        let shape = KvShape { num_layers: regions.len(), num_kv_heads, head_dim, dtype_bytes, block_size };
        let raw: Vec<(*mut u8, usize)> = regions.iter().map(|&(addr, len)| (addr as *mut u8, len)).collect();
        let kv_cache = register_memory(shape, num_blocks, &raw, owner, device)?;
        let running = py.detach(|| self.rt.block_on(self.start(kv_cache, tp_rank)))??;
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
        let meta: ConnectorMetadata =
            frame::decode(metadata, "connector metadata").map_err(|e| BridgeError::Metadata(e.to_string()))?;
        let (listener, receiver) = self.refs()?;
        py.detach(|| -> Result<(), BridgeError> {
            if let Some(listener) = listener {
                if !meta.reqs_to_send.is_empty() || !meta.reqs_not_processed.is_empty() {
                    let msg = RecordSendReqs { reqs_to_send: meta.reqs_to_send.clone(), reqs_not_processed: meta.reqs_not_processed.clone(), traceparents: meta.traceparents.clone() };
                    self.rt
                        .block_on(async { tokio::time::timeout(CALL_DEADLINE, listener.tell(msg)).await })?
                        .map_err(|_| BridgeError::unavailable("SenderListener", "mailbox did not accept the sends in time"))?
                        .map_err(|e| BridgeError::unavailable("SenderListener", e))?;
                }
            }
            if receiver.is_none() && !meta.reqs_to_recv.is_empty() {
                return Err(BridgeError::Config(format!(
                    "this worker is a kv_producer but the scheduler asked it to load {} request(s) from remote engines: \
                     the scheduler and worker roles disagree (check kv_role)",
                    meta.reqs_to_recv.values().map(|m| m.len()).sum::<usize>()
                )));
            }
            if let Some(receiver) = receiver {
                if !meta.reqs_to_recv.is_empty() || !meta.reqs_to_abort.is_empty() {
                    {
                        let mut ledger = lock(&self.ledger);
                        for pull in meta.reqs_to_recv.values().flat_map(|m| m.values()) {
                            ledger.recv_blocks.insert(pull.d_req_id.clone(), pull.local_block_ids.clone());
                        }
                    }
                    let msg = StartLoadKv { reqs_to_recv: meta.reqs_to_recv, reqs_to_abort: meta.reqs_to_abort };
                    self.rt
                        .block_on(async { tokio::time::timeout(CALL_DEADLINE, receiver.tell(msg)).await })?
                        .map_err(|_| BridgeError::unavailable("Receiver", "mailbox did not accept the pulls in time"))?
                        .map_err(|e| BridgeError::unavailable("Receiver", e))?;
                }
            }
            Ok(())
        })?;
        Ok(())
    }

    /// Steps 32 and 35: `(finished_sending, finished_recving, failed_recving)` since the last call.
    /// A failed load is in `finished_recving` too (vLLM must release the request) and its blocks
    /// are reported by `get_block_ids_with_load_errors`.
    fn get_transfer_results(&self, py: Python<'_>) -> PyResult<(Vec<String>, Vec<String>, Vec<String>)> {
        let (listener, receiver) = self.refs()?;
        let (sending, output) = py.detach(|| -> Result<_, BridgeError> {
            let sending = match listener {
                Some(l) => self
                    .rt
                    .block_on(async { tokio::time::timeout(CALL_DEADLINE, l.ask(GetFinishedSending)).await })?
                    .map_err(|_| {
                        BridgeError::unavailable("SenderListener", format!("no answer within {CALL_DEADLINE:?}"))
                    })?
                    .map_err(|e| BridgeError::unavailable("SenderListener", e))?,
                None => BTreeSet::new(),
            };
            let output = match receiver {
                Some(r) => Some(
                    self.rt
                        .block_on(async { tokio::time::timeout(CALL_DEADLINE, r.ask(GetFinishedRecving)).await })?
                        .map_err(|_| {
                            BridgeError::unavailable("Receiver", format!("no answer within {CALL_DEADLINE:?}"))
                        })?
                        .map_err(|e| BridgeError::unavailable("Receiver", e))?,
                ),
                None => None,
            };
            Ok((sending, output))
        })?;
        let (mut recving, mut failed) = (Vec::new(), Vec::new());
        if let Some(output) = output {
            let mut ledger = lock(&self.ledger);
            for req_id in output.finished_recving {
                ledger.recv_blocks.remove(&req_id);
                recving.push(req_id);
            }
            for (req_id, reason) in output.failed_recving {
                tracing::warn!(request_id = %req_id, %reason, "KV load failed; vLLM's kv_load_failure_policy decides (recompute or fail)");
                if let Some(blocks) = ledger.recv_blocks.remove(&req_id) {
                    ledger.load_errors.extend(blocks);
                }
                recving.push(req_id.clone());
                failed.push(req_id);
            }
        }
        Ok((sending.into_iter().collect(), recving, failed))
    }

    /// Blocks whose load failed since the last call (drained).
    fn get_block_ids_with_load_errors(&self) -> Vec<BlockId> {
        std::mem::take(&mut lock(&self.ledger).load_errors).into_iter().collect()
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
                let stop = async {
                    if let Some(b) = r.bootstrap {
                        b.shutdown().await;
                    }
                    let _ = r.supervisor.stop_gracefully().await;
                    r.supervisor.wait_for_shutdown().await;
                    if let Some(d) = r.data_server {
                        d.shutdown().await;
                    }
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
