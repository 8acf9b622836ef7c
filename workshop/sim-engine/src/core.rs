//! The engine loop and its handle (docs/simulated-engine.md). One `step()` is vLLM's: schedule →
//! `build_connector_meta` → worker `start_load_kv(meta)` → forward → worker `get_finished()` →
//! `update_from_output` → `update_connector_output`. When nothing can run but requests wait for KV
//! or for a delayed free, the loop still steps without a forward (vLLM's `kv_connector_no_forward`,
//! so P hands its `reqs_to_send` with block ids to the worker, seed step 26), then sleeps until the
//! worker's `kv_events`, a new command or a 20 ms tick. With no requests it blocks on commands.
//! The model runs on tokio's blocking pool, never on the runtime's workers, layer by layer (as a
//! transformer's forward does); with layer-wise P (the metadata names `reqs_to_save`) each
//! finished layer is reported to the worker (vLLM's `save_kv_layer`), which streams it to D while
//! later layers compute. The model may be sharded over ranks ([`Engine::start_ranked`]): one
//! scheduler and block pool for all of them, one connector, each layer reported once by its global
//! index. After each step the prefix cache's KV events go to the engine's publisher
//! ([`crate::kv_events`]); with a timing model ([`crate::timing`]) the loop sleeps until the
//! step's modelled end before applying its tokens.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdflow_messages::kv_transfer_params::TransferRole;
use pdflow_messages::scheduler_connector::{
    BuildConnectorMeta, ConnectorMetadata, ConnectorOutput, FinishStatus, SchedRequest,
};
use pdflow_observability::Outcome;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::cache_stats::CacheStats;
use super::config::EngineConfig;
use super::kv_events::publisher::PublisherEndpoints;
use super::kv_events::{KvEventBatch, KvEventPublisher, KvEventsError};
use super::model::{ForwardItem, Model};
use super::ranks::{Rank, RanksError, ShardedModel};
use super::request::{EngineError, EngineRequest, Request, RequestStream};
use super::scheduler::{BlockStats, ForwardResult, Scheduler};
use super::timing::ForwardTiming;
use pdflow_connector::Connector;
use pdflow_kv::memory::KvCache;

/// How long an idle engine with pending KV work waits before stepping again, at most.
const IDLE_TICK: Duration = Duration::from_millis(20);
/// How long `add_request` waits for the loop to accept a request.
const ADD_DEADLINE: Duration = Duration::from_secs(30);

/// What the handle sends to the loop.
#[derive(Debug)]
pub(crate) enum Command {
    Add {
        request: Box<Request>,
        ack: oneshot::Sender<Result<(), EngineError>>,
    },
    Abort(String),
    /// A request refused before it ran that names a transfer (see `EngineHandle::report_refused`).
    Rejected(SchedRequest),
}

/// Starts engines.
pub struct Engine;

impl Engine {
    /// Spawns the engine loop on the current tokio runtime, the model on one cache holding all of
    /// it. The cache's shape and block count win over `config`'s if they differ.
    pub fn start(mut config: EngineConfig, kv_cache: Arc<KvCache>, connector: Option<Connector>) -> EngineHandle {
        if config.shape != kv_cache.shape() || config.num_blocks != kv_cache.num_blocks() {
            tracing::warn!(engine_id = %config.engine_id, "EngineConfig shape/num_blocks differ from the KV cache's; using the cache's");
            config.shape = kv_cache.shape();
            config.num_blocks = kv_cache.num_blocks();
        }
        let mut model = ShardedModel::single(config.vocab_size, kv_cache);
        if let Some(layout) = config.hybrid.clone() {
            match model.clone().with_hybrid(layout) {
                Ok(hybrid) => model = hybrid,
                Err(e) => {
                    // `start_ranked` refuses it; here the engine runs the dense model it can.
                    tracing::error!(engine_id = %config.engine_id, error = %e, "the hybrid layout does not fit the KV cache: serving it as a dense model");
                    config.hybrid = None;
                }
            }
        }
        Self::spawn(config, model, connector)
    }

    /// Spawns the engine loop on the current tokio runtime, the model sharded over `ranks`
    /// (tensor and pipeline parallel, see [`crate::ranks`]). `config.shape` is the whole model's
    /// and `config.num_blocks` every rank's; refused, before anything runs, unless each rank's
    /// cache is that shape restricted to its layers and heads with that many blocks, and the
    /// ranks hold every (layer, head).
    pub fn start_ranked(
        config: EngineConfig,
        ranks: Vec<Rank>,
        connector: Option<Connector>,
    ) -> Result<EngineHandle, RanksError> {
        let model = Model { shape: config.shape, vocab_size: config.vocab_size };
        let mut model = ShardedModel::new(model, config.num_blocks, ranks)?;
        if let Some(layout) = config.hybrid.clone() {
            model = model.with_hybrid(layout)?;
        }
        Ok(Self::spawn(config, model, connector))
    }

    fn spawn(mut config: EngineConfig, model: ShardedModel, connector: Option<Connector>) -> EngineHandle {
        if let Err(e) = config.check() {
            tracing::error!(engine_id = %config.engine_id, error = %e, "running without prefix caching and KV events");
            config.enable_prefix_caching = false;
            config.kv_events = None;
        }
        let stats = Arc::new(Mutex::new(BlockStats::default()));
        let cache_stats = Arc::new(Mutex::new(CacheStats::default()));
        let (commands, rx) = mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        let running = Arc::new(AtomicBool::new(false));
        let has_connector = connector.is_some();
        let scheduler = Scheduler::new(config.clone(), connector, stats.clone(), cache_stats.clone());
        let model = Arc::new(model);
        let publisher = config
            .published_kv_events()
            .map(|events| Arc::new(KvEventPublisher::spawn(events.clone(), config.data_parallel_rank)));
        let engine = StepContext {
            model: model.clone(),
            forward_cpu: config.forward_cpu,
            timing: config.forward_timing,
            publisher: publisher.clone(),
            data_parallel_rank: config.data_parallel_rank,
        };
        let task = tokio::spawn(run_loop(scheduler, rx, cancel.clone(), running.clone(), engine));
        EngineHandle {
            inner: Arc::new(Inner {
                config,
                model,
                commands,
                stats,
                cache_stats,
                publisher,
                running,
                cancel,
                has_connector,
                task: Mutex::new(Some(task)),
            }),
        }
    }
}

struct Inner {
    config: EngineConfig,
    model: Arc<ShardedModel>,
    commands: mpsc::UnboundedSender<Command>,
    stats: Arc<Mutex<BlockStats>>,
    cache_stats: Arc<Mutex<CacheStats>>,
    publisher: Option<Arc<KvEventPublisher>>,
    running: Arc<AtomicBool>,
    cancel: CancellationToken,
    has_connector: bool,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// A handle on a running engine; cloning is cheap. The last handle dropped stops the loop.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle").field("engine_id", &self.inner.config.engine_id).finish()
    }
}

impl EngineHandle {
    /// Validates and submits a request; its outputs arrive on the returned stream. A P request
    /// whose `kv_transfer_params` name no transfer (vLLM's toy proxy) is named after its request
    /// id, as the bridge's connector names it, and answers D's form when it finishes.
    pub async fn add_request(&self, mut req: EngineRequest) -> Result<RequestStream, EngineError> {
        if let Some(params) = req.kv_transfer_params.as_mut() {
            params.name_transfer_after(&req.request_id);
        }
        let role = match validate(&self.inner.config, self.inner.has_connector, &req) {
            Ok(role) => role,
            Err(e) => {
                self.report_refused(&req);
                return Err(e);
            }
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let (ack, ack_rx) = oneshot::channel();
        let request_id = req.request_id.clone();
        let request = Box::new(Request::new(req, role, tx));
        self.inner.commands.send(Command::Add { request, ack }).map_err(|_| EngineError::EngineStopped)?;
        match tokio::time::timeout(ADD_DEADLINE, ack_rx).await {
            Ok(Ok(Ok(()))) => Ok(RequestStream { request_id, rx, commands: self.inner.commands.clone(), done: false }),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_)) | Err(_) => Err(EngineError::EngineStopped),
        }
    }

    /// A request refused before it ran — at admission here, or earlier by the API (a body it
    /// cannot parse, a bad rank header) — that names a transfer still concerns the peer engine:
    /// D's pull for a P request that never ran, or P's blocks held for a D request that never ran.
    /// The connector hears of it as a request finished with an error and no blocks, so that P
    /// answers D's pull at once (`reqs_not_processed`) and D releases P's blocks (an empty pull),
    /// instead of the peer waiting for its deadline. Not told when the request's id or transfer
    /// belongs to a request this engine holds (that one's transfer is not this refusal's).
    pub fn report_refused(&self, req: &EngineRequest) {
        if !self.inner.has_connector {
            return;
        }
        let Some(params) = &req.kv_transfer_params else { return };
        let mut params = params.clone();
        params.name_transfer_after(&req.request_id);
        if !matches!(params.role(), Ok(TransferRole::Prefill { .. } | TransferRole::Decode { .. })) {
            return;
        }
        let request = SchedRequest {
            request_id: req.request_id.clone().into(),
            prompt_len: req.prompt_token_ids.len(),
            kv_transfer_params: Some(params),
            traceparent: req.traceparent.clone(),
        };
        let _ = self.inner.commands.send(Command::Rejected(request));
    }

    /// Aborts a request (as a client disconnect does).
    pub fn abort(&self, request_id: &str) {
        let _ = self.inner.commands.send(Command::Abort(request_id.to_owned()));
    }

    /// Block usage right now.
    pub fn block_stats(&self) -> BlockStats {
        *self.inner.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The prefix-cache and prompt-token counters right now.
    pub fn cache_stats(&self) -> CacheStats {
        *self.inner.cache_stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where the KV event publisher's sockets are, once bound (`None`: no events published), or
    /// why they could not be set up.
    pub async fn kv_events_endpoints(&self) -> Result<Option<PublisherEndpoints>, KvEventsError> {
        match &self.inner.publisher {
            Some(publisher) => publisher.ready().await.map(Some),
            None => Ok(None),
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// Rank 0's KV cache (the whole model's, on a one-rank engine).
    pub fn kv_cache(&self) -> &Arc<KvCache> {
        self.inner.model.first_cache()
    }

    /// Every rank: the layers and KV heads it holds, and its KV cache (one rank holding the whole
    /// model on an engine from [`Engine::start`]).
    pub fn rank_caches(&self) -> &[Rank] {
        self.inner.model.ranks()
    }

    /// True once the loop runs (and until it stops).
    pub fn is_running(&self) -> bool {
        self.inner.running.load(Ordering::Acquire)
    }

    /// Stops the loop and waits for it (at most 10 s).
    pub async fn shutdown(&self) {
        self.inner.cancel.cancel();
        let task = self.inner.task.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(task) = task {
            if tokio::time::timeout(Duration::from_secs(10), task).await.is_err() {
                tracing::warn!(engine_id = %self.inner.config.engine_id, "engine loop did not stop within 10 s");
            }
        }
    }
}

/// Checks a request against the engine before it is queued.
fn validate(config: &EngineConfig, has_connector: bool, req: &EngineRequest) -> Result<TransferRole, EngineError> {
    let prompt_len = req.prompt_token_ids.len();
    if prompt_len == 0 {
        return Err(EngineError::EmptyPrompt);
    }
    if req.max_tokens == 0 {
        return Err(EngineError::ZeroMaxTokens);
    }
    if prompt_len + req.max_tokens > config.max_model_len {
        return Err(EngineError::TooLong {
            prompt_len,
            max_tokens: req.max_tokens,
            max_model_len: config.max_model_len,
        });
    }
    let needed = config.blocks_for(prompt_len + req.max_tokens);
    if needed > config.num_blocks {
        return Err(EngineError::TooManyBlocks {
            needed,
            total: config.num_blocks,
            prompt_len,
            max_tokens: req.max_tokens,
        });
    }
    let role = match &req.kv_transfer_params {
        Some(p) => p.role()?,
        None => TransferRole::Local,
    };
    match role {
        TransferRole::Local => {}
        TransferRole::Prefill { .. } if !has_connector => {
            return Err(EngineError::NoConnector { role: "prefill (do_remote_decode)" })
        }
        TransferRole::Decode { .. } if !has_connector => {
            return Err(EngineError::NoConnector { role: "decode (do_remote_prefill)" })
        }
        _ => {}
    }
    Ok(role)
}

async fn handle_command(scheduler: &mut Scheduler, cmd: Command) {
    match cmd {
        Command::Add { request, ack } => {
            let id = request.id.clone();
            let result = scheduler.add_request(*request);
            let accepted = result.is_ok();
            // The caller gave up waiting: nobody will read or abort the request, so abort it now.
            if ack.send(result).is_err() && accepted {
                scheduler.abort(&id).await;
            }
        }
        Command::Abort(id) => scheduler.abort(&id).await,
        Command::Rejected(request) => scheduler.reject(request).await,
    }
}

/// What each step needs besides the scheduler.
struct StepContext {
    model: Arc<ShardedModel>,
    forward_cpu: Option<usize>,
    timing: Option<ForwardTiming>,
    publisher: Option<Arc<KvEventPublisher>>,
    data_parallel_rank: u32,
}

async fn run_loop(
    mut scheduler: Scheduler,
    mut commands: mpsc::UnboundedReceiver<Command>,
    cancel: CancellationToken,
    running: Arc<AtomicBool>,
    engine: StepContext,
) {
    running.store(true, Ordering::Release);
    loop {
        while let Ok(cmd) = commands.try_recv() {
            handle_command(&mut scheduler, cmd).await;
        }
        if cancel.is_cancelled() {
            break;
        }
        if !scheduler.has_requests() {
            tokio::select! {
                _ = cancel.cancelled() => break,
                cmd = commands.recv() => match cmd {
                    Some(cmd) => handle_command(&mut scheduler, cmd).await,
                    None => break,
                },
            }
            continue;
        }
        let did_forward = step(&mut scheduler, &engine).await;
        publish_kv_events(&mut scheduler, &engine);
        if !did_forward {
            let events = scheduler.connector().map(|c| c.worker.kv_events());
            let kv_event = async {
                match &events {
                    Some(n) => n.notified().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = cancel.cancelled() => break,
                cmd = commands.recv() => match cmd {
                    Some(cmd) => handle_command(&mut scheduler, cmd).await,
                    None => break,
                },
                _ = kv_event => {}
                _ = tokio::time::sleep(IDLE_TICK) => {}
            }
        }
    }
    running.store(false, Ordering::Release);
}

/// The prefix cache's events of the step, as one batch (none when nothing changed).
fn publish_kv_events(scheduler: &mut Scheduler, engine: &StepContext) {
    let events = scheduler.take_kv_events();
    let Some(publisher) = &engine.publisher else { return };
    if events.is_empty() {
        return;
    }
    let ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    publisher.publish(KvEventBatch { ts, events, data_parallel_rank: Some(engine.data_parallel_rank) });
}

/// One engine step; returns whether a forward ran.
async fn step(scheduler: &mut Scheduler, engine: &StepContext) -> bool {
    let (model, forward_cpu) = (&engine.model, engine.forward_cpu);
    let scheduled = scheduler.schedule().await;
    let connector = scheduler.connector().cloned();
    // Layer-wise P: the step's prefills whose layers go to D as the forward finishes them.
    let mut reqs_to_save = BTreeMap::new();
    if let Some(conn) = &connector {
        let build = BuildConnectorMeta { scheduled: scheduler.scheduled_chunks(&scheduled) };
        let meta = conn.scheduler.build_connector_meta(build).await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "build_connector_meta failed; the workers get empty metadata");
            ConnectorMetadata::default()
        });
        reqs_to_save = meta.reqs_to_save.clone();
        if let Err(e) = conn.worker.start_load_kv(meta).await {
            tracing::warn!(error = %e, "start_load_kv failed");
        }
    }
    let did_forward = !scheduled.is_empty();
    if did_forward {
        let started = tokio::time::Instant::now();
        let modelled = engine.timing.map(|t| scheduler.modelled_step(&t, &scheduled));
        let (work, spans) = scheduler.prepare_forward(&scheduled);
        let ids: Vec<(String, usize)> = work.iter().map(|(id, n, _)| (id.clone(), *n)).collect();
        let model = model.clone();
        // Layer-wise P hands each finished layer to the worker; otherwise nobody listens.
        let saver = connector.as_ref().map(|c| c.worker.clone()).filter(|_| !reqs_to_save.is_empty());
        let joined = tokio::task::spawn_blocking(move || {
            // Pinned for this forward only: the blocking pool's thread serves other work after.
            let _pinned = forward_cpu.and_then(|cpu| {
                crate::affinity::pin_current_thread(cpu)
                    .inspect_err(
                        |e| tracing::warn!(cpu, error = %e, "cannot pin the forward to its CPU; it runs unpinned"),
                    )
                    .ok()
            });
            let (meta, mut items): (Vec<(String, usize)>, Vec<ForwardItem>) =
                work.into_iter().map(|(id, n, item)| ((id, n), item)).unzip();
            let mut layer_done = |layer: usize| {
                if let Some(worker) = &saver {
                    worker.save_kv_layer(layer, &reqs_to_save);
                }
            };
            let sampled = model.forward(&mut items, &mut layer_done);
            meta.into_iter()
                .zip(items)
                .zip(sampled)
                .map(|(((request_id, num_new_tokens), item), sampled)| ForwardResult {
                    request_id,
                    num_new_tokens,
                    digest: item.digest,
                    sampled: sampled.map_err(|e| e.to_string()),
                })
                .collect::<Vec<_>>()
        })
        .await;
        if let Some(modelled) = modelled {
            // A GPU would still be at it: wait (asleep) for the step's modelled end.
            tokio::time::sleep_until(started + modelled).await;
        }
        drop(spans);
        let results = match joined {
            Ok(results) => results,
            Err(e) => ids
                .into_iter()
                .map(|(request_id, num_new_tokens)| ForwardResult {
                    request_id,
                    num_new_tokens,
                    digest: Default::default(),
                    sampled: Err(format!("the model task failed: {e}")),
                })
                .collect(),
        };
        scheduler.update_from_output(results).await;
    }
    let finished = match &connector {
        Some(conn) => conn.worker.get_finished().await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "get_finished failed");
            ConnectorOutput::default()
        }),
        None => ConnectorOutput::default(),
    };
    scheduler.process_kv_output(finished).await;
    did_forward
}

/// Maps a finish status to vLLM's `finish_reason`.
/// The outcome a finished request's spans record.
pub fn finish_outcome(status: FinishStatus) -> Outcome {
    match status {
        FinishStatus::LengthCapped => Outcome::Length,
        FinishStatus::Stopped => Outcome::Stop,
        FinishStatus::Aborted => Outcome::ABORTED,
        FinishStatus::Error => Outcome::ERROR,
    }
}

pub fn finish_reason(status: FinishStatus) -> &'static str {
    match status {
        FinishStatus::LengthCapped => "length",
        FinishStatus::Stopped => "stop",
        FinishStatus::Aborted => "abort",
        FinishStatus::Error => "error",
    }
}
