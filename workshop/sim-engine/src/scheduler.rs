//! The scheduler (vLLM v1's `Scheduler`, faithful wherever the KV connector is involved).
//!
//! `schedule()` takes running requests first (one decode token each, or the next prefill chunk),
//! then the FIFO waiting queue, within `max_num_batched_tokens`. Steps owned here: 11/16 (add
//! request), 12 (P alloc + `update_state_after_alloc`), 17 (D → `WAITING_FOR_REMOTE_KVS`), 23 and
//! 41 (request finished; P's blocks held by delayed free), 24 (P's output), 33 (P's delayed blocks
//! freed), 37 (D resumes with `num_computed_tokens = prompt − 1`), 38 (D's first token scheduled).
//! The forward itself (15, 39, 40) is prepared here and run by `core.rs`; the sampled tokens come
//! back through [`Scheduler::update_from_output`].
//!
//! Admission: a waiting request is admitted only when the free blocks cover every admitted
//! request's worst case (`prompt + max_tokens`); vLLM preempts instead, which this engine never
//! needs to. With prefix caching a request starts past its longest cached prefix (on D, the
//! connector is then asked only for the rest), and every full block a step computes is cached.
//!
//! # Layout
//! - this file — requests added, `schedule()`'s running pass, the forward's inputs and results,
//!   finishes and aborts (steps 11/16, 23, 24, 41);
//! - [`admission`] — the waiting queue's admission (steps 12, 17, 37, 38);
//! - [`prefix`] — prefix-cache hits, caching computed blocks, the cache counters;
//! - [`kv_output`] — the connector's output of each step (steps 33, 35–36, failed loads).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use pdflow_messages::kv_groups::prefill_backoff;
use pdflow_messages::kv_transfer_params::TransferRole;
use pdflow_messages::scheduler_connector::{FinishStatus, RequestFinished, SchedRequest, ScheduledChunk};
use pdflow_observability::{attrs, steps};
use tracing::Span;

use super::block_pool::BlockPool;
use super::cache_stats::CacheStats;
use super::config::EngineConfig;
use super::kv_events::KvEvent;
use super::model::{ContextDigest, ForwardItem};
use super::request::{EngineError, Request, Status};
use pdflow_connector::Connector;

/// Block usage, for the no-leak checks (`GET /pdflow/blocks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct BlockStats {
    pub total: usize,
    /// Blocks no request holds: a free block of the prefix cache counts (it is only evicted when
    /// an allocation needs it), so `free == total` still means that no request holds a block.
    pub free: usize,
    /// Requests the scheduler still tracks (including finished ones awaiting a delayed free).
    pub requests: usize,
    /// Requests finished (any status) since the engine started.
    pub finished: u64,
    /// Blocks in the prefix cache, held or free (0 without prefix caching).
    #[serde(default)]
    pub cached: usize,
}

/// Opens a step span for a request, with the engine id and traceparent recorded.
macro_rules! req_span {
    ($step:expr, $req:expr, $engine_id:expr) => {{
        let span = pdflow_observability::step_span!($step, request_id = %$req.id, transfer_id = %$req.transfer_id());
        span.record(attrs::ENGINE_ID, $engine_id);
        if let Some(tp) = &$req.traceparent {
            span.record(attrs::TRACEPARENT, tp.as_str());
        }
        span
    }};
}

mod admission;
mod kv_output;
mod prefix;

use admission::WaitingOutcome;

/// One request's share of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledItem {
    pub request_id: String,
    pub num_new_tokens: usize,
}

/// The forward's result for one request.
#[derive(Debug)]
pub struct ForwardResult {
    pub request_id: String,
    pub num_new_tokens: usize,
    pub digest: ContextDigest,
    /// The sampled token, or why the forward failed.
    pub sampled: Result<Option<u32>, String>,
}

pub(crate) struct Scheduler {
    config: EngineConfig,
    pool: BlockPool,
    requests: HashMap<String, Request>,
    waiting: VecDeque<String>,
    running: Vec<String>,
    finished_recving_kv_req_ids: HashSet<String>,
    connector: Option<Connector>,
    stats: Arc<Mutex<BlockStats>>,
    /// The prefix-cache and prompt-token counters, and where they are published.
    cache_stats: CacheStats,
    shared_cache_stats: Arc<Mutex<CacheStats>>,
    /// A request finished since the last `schedule()`: run one more step so the connector's
    /// metadata about it (`reqs_not_processed`, `reqs_to_abort`) reaches the workers, as vLLM does
    /// for `finished_req_ids`.
    finished_since_schedule: bool,
    /// Requests finished since start (for `BlockStats::finished`).
    finished_requests: u64,
}

impl Scheduler {
    pub fn new(
        config: EngineConfig,
        connector: Option<Connector>,
        stats: Arc<Mutex<BlockStats>>,
        shared_cache_stats: Arc<Mutex<CacheStats>>,
    ) -> Self {
        let events = config.published_kv_events().is_some();
        let pool = BlockPool::with_caching(config.num_blocks, config.prefix_caching(), events);
        let s = Self {
            config,
            pool,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            finished_recving_kv_req_ids: HashSet::new(),
            connector,
            stats,
            cache_stats: CacheStats::default(),
            shared_cache_stats,
            finished_since_schedule: false,
            finished_requests: 0,
        };
        s.publish_stats();
        s
    }

    pub fn has_requests(&self) -> bool {
        !self.requests.is_empty() || self.finished_since_schedule
    }

    pub fn connector(&self) -> Option<&Connector> {
        self.connector.as_ref()
    }

    fn publish_stats(&self) {
        let stats = BlockStats {
            total: self.pool.total(),
            free: self.pool.num_free(),
            requests: self.requests.len(),
            finished: self.finished_requests,
            cached: self.pool.num_cached(),
        };
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = stats;
    }

    fn publish_cache_stats(&self) {
        *self.shared_cache_stats.lock().unwrap_or_else(|e| e.into_inner()) = self.cache_stats;
    }

    /// The KV events of the prefix cache since the last call.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.pool.take_events()
    }

    /// Seed steps 11 (P) and 16 (D): the request enters the waiting queue.
    pub fn add_request(&mut self, mut req: Request) -> Result<(), EngineError> {
        if self.requests.contains_key(&req.id) {
            return Err(EngineError::DuplicateRequestId(req.id));
        }
        // A transfer belongs to one request on each side: a second would take the first's KV
        // (D) or be held for a pull that reaches the first (P).
        let transfer_id = req.transfer_id();
        if !transfer_id.is_empty() {
            let same_side =
                |r: &&Request| r.is_prefill_role() == req.is_prefill_role() && r.transfer_id() == transfer_id;
            if let Some(owner) = self.requests.values().find(same_side) {
                return Err(EngineError::TransferIdInUse {
                    transfer_id: transfer_id.to_owned(),
                    owner: owner.id.clone(),
                });
            }
        }
        if let Some(layout) = &self.config.hybrid {
            // A hybrid model's P leaves the prompt's last token to D (as vLLM's connectors do).
            let backoff = prefill_backoff(&layout.groups);
            if req.is_prefill_role() && req.prompt_len > backoff {
                req.prompt_len -= backoff;
                req.all_token_ids.truncate(req.prompt_len);
                req.max_tokens = 1;
            }
        }
        let span = if req.is_prefill_role() {
            req_span!(steps::P_ADD_REQUEST, req, self.config.engine_id.as_str())
        } else if req.is_decode_role() {
            req_span!(steps::D_ADD_REQUEST, req, self.config.engine_id.as_str())
        } else {
            Span::none()
        };
        span.record(attrs::TOKENS, req.prompt_len);
        self.waiting.push_back(req.id.clone());
        self.requests.insert(req.id.clone(), req);
        self.publish_stats();
        Ok(())
    }

    /// Grows `id`'s block table to cover `tokens` tokens; false if the pool is short.
    fn allocate_for(&mut self, id: &str, tokens: usize) -> bool {
        if let Some(layout) = &self.config.hybrid {
            return Self::allocate_groups(&mut self.pool, &mut self.requests, id, layout.blocks_for(tokens));
        }
        let Some(r) = self.requests.get_mut(id) else { return false };
        let need = self.config.shape.blocks_for(tokens).saturating_sub(r.block_ids.len());
        if need == 0 {
            return true;
        }
        match self.pool.allocate(need) {
            Some(blocks) => {
                r.block_ids.extend(blocks);
                true
            }
            None => false,
        }
    }

    /// A hybrid model's allocation: each group grown to `per_group` blocks, from the one pool.
    fn allocate_groups(
        pool: &mut BlockPool,
        requests: &mut HashMap<String, Request>,
        id: &str,
        per_group: Vec<usize>,
    ) -> bool {
        let Some(r) = requests.get_mut(id) else { return false };
        r.group_blocks.resize(per_group.len(), Vec::new());
        let needs: Vec<usize> =
            per_group.iter().zip(&r.group_blocks).map(|(&n, have)| n.saturating_sub(have.len())).collect();
        let Some(mut fresh) = pool.allocate(needs.iter().sum()) else { return false };
        for (group, need) in r.group_blocks.iter_mut().zip(needs) {
            group.extend(fresh.drain(..need));
        }
        r.block_ids = r.group_blocks.concat();
        true
    }

    /// One `schedule()`: running requests first, then the waiting queue.
    pub async fn schedule(&mut self) -> Vec<ScheduledItem> {
        self.finished_since_schedule = false;
        let mut budget = self.config.max_num_batched_tokens;
        let mut items = Vec::new();
        for id in self.running.clone() {
            if budget == 0 {
                break;
            }
            let Some(r) = self.requests.get(&id) else { continue };
            let (computed, num_new) = (r.num_computed_tokens, (r.num_tokens() - r.num_computed_tokens).min(budget));
            if num_new == 0 || !self.allocate_for(&id, computed + num_new) {
                continue;
            }
            self.cache_blocks(&id, computed + num_new);
            budget -= num_new;
            items.push(ScheduledItem { request_id: id, num_new_tokens: num_new });
        }
        let queue: Vec<String> = self.waiting.drain(..).collect();
        let mut still_waiting = VecDeque::new();
        let mut blocked = false;
        for id in queue {
            if budget == 0 {
                still_waiting.push_back(id);
                continue;
            }
            match self.schedule_waiting(&id, budget, blocked).await {
                WaitingOutcome::Scheduled(n) => {
                    budget -= n;
                    items.push(ScheduledItem { request_id: id.clone(), num_new_tokens: n });
                    self.running.push(id);
                }
                WaitingOutcome::Skip => still_waiting.push_back(id),
                WaitingOutcome::Blocked => {
                    blocked = true;
                    still_waiting.push_back(id);
                }
                WaitingOutcome::Gone => {}
            }
        }
        // Requests added while this ran (none: the loop is sequential) would sit behind.
        still_waiting.extend(self.waiting.drain(..));
        self.waiting = still_waiting;
        self.publish_stats();
        items
    }

    /// What this step computes, as the connector's `build_connector_meta` sees it.
    pub fn scheduled_chunks(&self, items: &[ScheduledItem]) -> Vec<ScheduledChunk> {
        items
            .iter()
            .filter_map(|item| {
                let r = self.requests.get(&item.request_id)?;
                Some(ScheduledChunk {
                    request_id: item.request_id.clone().into(),
                    block_ids: r.block_ids.clone(),
                    computed_upto: r.num_computed_tokens + item.num_new_tokens,
                })
            })
            .collect()
    }

    /// The modelled duration of this step's forward: its prompt tokens (a prefill chunk, D's
    /// recomputed prompt token) and whether it decodes.
    pub fn modelled_step(&self, timing: &crate::timing::ForwardTiming, items: &[ScheduledItem]) -> std::time::Duration {
        let (mut prompt_tokens, mut decodes) = (0, 0);
        for item in items {
            let Some(r) = self.requests.get(&item.request_id) else { continue };
            let start = r.num_computed_tokens;
            let in_prompt = r.prompt_len.saturating_sub(start).min(item.num_new_tokens);
            prompt_tokens += in_prompt;
            if item.num_new_tokens > in_prompt {
                decodes += 1;
            }
        }
        timing.step(prompt_tokens, decodes)
    }

    /// The forward's inputs for this step, and the spans (15, 39) to hold around it.
    pub fn prepare_forward(&self, items: &[ScheduledItem]) -> (Vec<(String, usize, ForwardItem)>, Vec<Span>) {
        let engine_id = self.config.engine_id.as_str();
        let mut work = Vec::new();
        let mut spans = Vec::new();
        for item in items {
            let Some(r) = self.requests.get(&item.request_id) else { continue };
            let start = r.num_computed_tokens;
            let end = start + item.num_new_tokens;
            if r.is_prefill_role() && start < r.prompt_len {
                let span = req_span!(steps::P_PREFILL_FORWARD, r, engine_id);
                span.record(attrs::TOKENS, item.num_new_tokens);
                spans.push(span);
            } else if r.first_token_pending {
                let span = req_span!(steps::D_FIRST_TOKEN, r, engine_id);
                span.record(attrs::TOKENS, r.num_tokens());
                spans.push(span);
            }
            let fwd = ForwardItem {
                tokens: r.all_token_ids[start..end].to_vec(),
                start,
                block_ids: r.block_ids.clone(),
                group_blocks: r.group_blocks.clone(),
                digest: r.digest,
                sample: end == r.num_tokens(),
            };
            work.push((item.request_id.clone(), item.num_new_tokens, fwd));
        }
        (work, spans)
    }

    /// vLLM's stop check: stop (EOS, stop tokens) before length.
    fn check_stop(&self, r: &Request, token: u32) -> Option<FinishStatus> {
        if (!r.ignore_eos && token == self.config.eos_token_id) || r.stop_token_ids.contains(&token) {
            Some(FinishStatus::Stopped)
        } else if r.num_output_tokens() >= r.max_tokens || r.num_tokens() >= self.config.max_model_len {
            Some(FinishStatus::LengthCapped)
        } else {
            None
        }
    }

    /// Applies the forward's results: computed tokens, sampled tokens, finishes, outputs.
    pub async fn update_from_output(&mut self, results: Vec<ForwardResult>) {
        let engine_id = self.config.engine_id.clone();
        for res in results {
            let Some(r) = self.requests.get_mut(&res.request_id) else { continue };
            if r.status != Status::Running {
                continue;
            }
            let token = match res.sampled {
                Err(reason) => {
                    self.uncache_own_blocks(&res.request_id);
                    let msg = format!("the forward pass failed: {reason}");
                    self.finish_request(&res.request_id, FinishStatus::Error, Vec::new(), Some(msg)).await;
                    continue;
                }
                Ok(None) => {
                    r.num_computed_tokens += res.num_new_tokens;
                    r.digest = res.digest;
                    continue;
                }
                Ok(Some(t)) => t,
            };
            r.num_computed_tokens += res.num_new_tokens;
            r.digest = res.digest;
            r.all_token_ids.push(token);
            if r.num_output_tokens() == 1 {
                self.record_prefill_done(&res.request_id);
            }
            let Some(r) = self.requests.get(&res.request_id) else { continue };
            let finish = self.check_stop(r, token);
            let Some(r) = self.requests.get_mut(&res.request_id) else { continue };
            if r.first_token_pending {
                r.first_token_pending = false;
                if finish.is_none() {
                    r.decode_span = Some(req_span!(steps::D_DECODE, r, engine_id.as_str()));
                }
            }
            match finish {
                None => r.emit(vec![token], None, None, None),
                Some(status) => self.finish_request(&res.request_id, status, vec![token], None).await,
            }
        }
        self.publish_stats();
    }

    /// Finishes a request (steps 23 and 41): tells the connector, frees the blocks unless the
    /// connector delays the free (P) or a KV write may still land (D aborted while loading), then
    /// sends the last output.
    pub async fn finish_request(
        &mut self,
        id: &str,
        status: FinishStatus,
        new_token_ids: Vec<u32>,
        error: Option<String>,
    ) {
        let Some(mut r) = self.requests.remove(id) else { return };
        self.finished_since_schedule = true;
        self.finished_requests += 1;
        self.waiting.retain(|w| w != id);
        self.running.retain(|w| w != id);
        if let Some(span) = r.decode_span.take() {
            span.record(attrs::TOKENS, r.num_output_tokens());
        }
        let engine_id = self.config.engine_id.as_str();
        let span = if r.is_prefill_role() {
            req_span!(steps::P_REQUEST_FINISHED, r, engine_id)
        } else if r.is_decode_role() {
            req_span!(steps::D_REQUEST_FINISHED, r, engine_id)
        } else {
            Span::none()
        };
        crate::core::finish_outcome(status).record(&span);
        span.record(attrs::BLOCKS, r.block_ids.len());
        let (delay, params) = match &self.connector {
            Some(conn) => {
                let msg = RequestFinished {
                    request: r.sched_request(),
                    status,
                    block_ids: r.connector_blocks(self.config.hybrid.is_some()),
                };
                match conn.scheduler.request_finished(msg).await {
                    Ok(reply) => (reply.delay_free_blocks, reply.kv_transfer_params),
                    Err(e) => {
                        tracing::warn!(request_id = %id, error = %e, "request_finished failed; freeing the blocks now");
                        (false, None)
                    }
                }
            }
            None => (false, None),
        };
        drop(span);
        let keep = if r.status == Status::WaitingForRemoteKvs {
            r.status = Status::AbortedAwaitingRecv;
            r.held_since.get_or_insert_with(tokio::time::Instant::now);
            true
        } else if delay && !r.block_ids.is_empty() {
            r.status = Status::FinishedDelayFree;
            r.held_since = Some(tokio::time::Instant::now());
            true
        } else {
            self.pool.free_request(std::mem::take(&mut r.block_ids));
            r.group_blocks.clear();
            false
        };
        let output_span =
            if r.is_prefill_role() { req_span!(steps::P_ENGINE_OUTPUT, r, engine_id) } else { Span::none() };
        crate::core::finish_outcome(status).record(&output_span);
        output_span.record(attrs::TOKENS, new_token_ids.len());
        r.emit(new_token_ids, Some(status), error, params);
        drop(output_span);
        if keep {
            self.requests.insert(id.to_owned(), r);
        }
        self.publish_stats();
    }

    /// A request refused before it was queued (no blocks) that names a transfer: the connector is
    /// told it finished with an error and no blocks, and one more step runs so that its metadata
    /// (`reqs_not_processed` on P, an empty pull on D) reaches the workers. Not when the refused request's id, or its transfer on this side, is a held request's: the
    /// connector would take the refusal for that request's (a refused duplicate must not cancel
    /// the transfer of the request it duplicates).
    pub async fn reject(&mut self, request: SchedRequest) {
        let Some(conn) = &self.connector else { return };
        let id = request.request_id.clone();
        let role = request.kv_transfer_params.as_ref().and_then(|p| p.role().ok());
        let (transfer, prefill) = match &role {
            Some(TransferRole::Prefill { transfer_id }) => (transfer_id.as_str(), true),
            Some(TransferRole::Decode { transfer_id, .. }) => (transfer_id.as_str(), false),
            _ => return,
        };
        let held = |r: &Request| r.id == id.as_str() || (r.is_prefill_role() == prefill && r.transfer_id() == transfer);
        if let Some(owner) = self.requests.values().find(|r| held(r)) {
            tracing::debug!(request_id = %id, owner = %owner.id, transfer_id = transfer,
                "a refused request names a held request's id or transfer: its connector is not told");
            return;
        }
        let msg = RequestFinished { request, status: FinishStatus::Error, block_ids: Default::default() };
        if let Err(e) = conn.scheduler.request_finished(msg).await {
            tracing::warn!(request_id = %id, error = %e, "request_finished for a rejected request failed; the peer waits for its deadline");
        }
        self.finished_since_schedule = true;
    }

    /// Aborts a request (client gone, or `EngineHandle::abort`).
    pub async fn abort(&mut self, id: &str) {
        let Some(r) = self.requests.get_mut(id) else { return };
        match r.status {
            Status::Waiting | Status::Running => {}
            Status::WaitingForRemoteKvs => {
                // Reported received already: no write can land any more, free at once.
                if self.finished_recving_kv_req_ids.remove(id) {
                    r.status = Status::Waiting;
                }
            }
            Status::FinishedDelayFree | Status::AbortedAwaitingRecv => return,
        }
        self.finish_request(id, FinishStatus::Aborted, Vec::new(), None).await;
    }
}
