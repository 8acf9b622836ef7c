//! SchedulerConnector — the scheduler-side half of pdflow's KV connector, one per engine, in the
//! producer (P) or consumer (D) role. The engine calls its hooks (by `ask`) with vLLM v1's
//! semantics; the actor keeps what the next `build_connector_meta` must tell the workers.
//!
//! Steps: 12 and 17 (`update_state_after_alloc` records the pending send / the pull), 13, 18, 26
//! (`build_connector_meta`; layer-wise, it also names the step's prefills in `reqs_to_save`), 23 and 41 (`request_finished`: delayed free on P), 32, 35, 36
//! (`update_connector_output`). The engine owns the scheduling itself (allocation, the
//! WAITING_FOR_REMOTE_KVS state, computed = prompt − 1 at step 37) and emits those spans.
//!
//! Differences from vLLM's MooncakeConnector, on purpose: a P request that ends `Stopped` (its
//! first token is EOS or a stop token) still sends its KV — the prompt's KV is valid either way
//! (seed note after step 23) — so D never waits for a deadline; and a D request aborted while its
//! pull is in flight is named in `reqs_to_abort`, so the worker cancels the pull at once.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use kameo::prelude::*;
pub use pdflow_messages::kv_groups::prefill_backoff;
use pdflow_messages::kv_groups::{BlockSpan, GroupBlocks, KvGroupKind, KvGroupSpec};
use pdflow_messages::kv_transfer_params::{KvTransferParams, TransferRole};
use pdflow_messages::scheduler_connector::{
    BuildConnectorMeta, ConnectorMetadata, ConnectorOutput, FinishStatus, GetNumNewMatchedTokens, LayerSave,
    MatchedTokens, OnNewRequest, PullMeta, RequestFinished, RequestFinishedReply, SchedRequest, ScheduledChunk,
    UpdateConnectorOutput, UpdateStateAfterAlloc,
};
use pdflow_messages::{BlockId, EngineId, RequestId, TransferId};
use pdflow_observability::{attrs, step_span, steps, Outcome};

use crate::ActorError;

mod in_flight;
use in_flight::InFlightPrefixes;

/// Which side of the disaggregation an engine is (vLLM's `kv_role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum KvRole {
    /// `kv_producer`: prefills and sends KV (P).
    Producer,
    /// `kv_consumer`: loads KV and decodes (D).
    Consumer,
    /// `kv_both`: either, per request.
    Both,
}

impl KvRole {
    /// Prefills for a peer and sends its KV (kv_producer, kv_both).
    pub fn produces(self) -> bool {
        matches!(self, KvRole::Producer | KvRole::Both)
    }
    /// Loads KV from a peer (kv_consumer, kv_both).
    pub fn consumes(self) -> bool {
        matches!(self, KvRole::Consumer | KvRole::Both)
    }
}

/// Arguments of [`SchedulerConnector`].
#[derive(Debug, Clone)]
pub struct SchedulerConnectorArgs {
    pub engine_id: EngineId,
    pub role: KvRole,
    /// P: the bootstrap its workers register with (`http://host:port`). With it, a finished P
    /// request answers the `kv_transfer_params` D needs (vLLM's toy proxy forwards P's answer to
    /// D instead of naming P itself).
    pub bootstrap_addr: Option<String>,
    /// P: stream each prefill's KV to D layer by layer while it computes (`reqs_to_save`).
    pub layerwise: bool,
    /// The model's KV-cache groups, in the engine's order; empty: one group of full attention.
    pub groups: Vec<KvGroupSpec>,
    /// The block id the engine puts where a sliding window freed a block (vLLM's null block, 0);
    /// `None`: the engine frees none.
    pub null_block: Option<BlockId>,
}

/// The scheduler-side connector actor.
#[derive(Debug)]
pub struct SchedulerConnector {
    engine_id: EngineId,
    role: KvRole,
    bootstrap_addr: Option<String>,
    layerwise: bool,
    groups: Vec<KvGroupSpec>,
    null_block: Option<BlockId>,
    /// D: the tokens each waiting request's prefix cache holds (from `get_num_new_matched_tokens`),
    /// where its load starts in block lists that start at the prompt's first block.
    local_hits: BTreeMap<RequestId, usize>,
    /// P, layer-wise: the prefills whose layers stream, with their transfer and prompt length.
    streaming: BTreeMap<RequestId, (TransferId, usize)>,
    /// P: request id → (transfer_id, block ids) for the next metadata (steps 13, 26).
    reqs_need_send: BTreeMap<RequestId, (TransferId, GroupBlocks)>,
    /// D: pulls for the next metadata (step 18).
    reqs_need_recv: BTreeMap<RequestId, PullMeta>,
    /// P: transfers whose request ended without KV.
    reqs_not_processed: BTreeSet<TransferId>,
    /// D: requests aborted while their pull is in flight.
    reqs_to_abort: BTreeSet<RequestId>,
    /// D: requests whose pull was issued and has not settled.
    recv_in_flight: BTreeSet<RequestId>,
    /// D: the prompt blocks being loaded, so that a request sharing them waits for them.
    in_flight: InFlightPrefixes,
    traceparents: BTreeMap<RequestId, String>,
}

impl Actor for SchedulerConnector {
    type Args = SchedulerConnectorArgs;
    type Error = ActorError;

    async fn on_start(args: Self::Args, _actor_ref: ActorRef<Self>) -> Result<Self, Self::Error> {
        Ok(Self {
            engine_id: args.engine_id,
            role: args.role,
            bootstrap_addr: args.bootstrap_addr,
            layerwise: args.layerwise,
            groups: args.groups,
            null_block: args.null_block,
            local_hits: BTreeMap::new(),
            streaming: BTreeMap::new(),
            reqs_need_send: BTreeMap::new(),
            reqs_need_recv: BTreeMap::new(),
            reqs_not_processed: BTreeSet::new(),
            reqs_to_abort: BTreeSet::new(),
            recv_in_flight: BTreeSet::new(),
            in_flight: InFlightPrefixes::default(),
            traceparents: BTreeMap::new(),
        })
    }
}

/// A P request whose proxy named no transfer is named after P's request id: vLLM's toy proxy
/// sends P a bare `do_remote_decode` and forwards what P answers (see `RequestFinished`) to D.
/// Applied to every request as it arrives at a handler, so each hook sees the same name.
fn with_transfer_named(mut request: SchedRequest) -> SchedRequest {
    if let Some(p) = request.kv_transfer_params.as_mut() {
        if p.do_remote_decode && !p.do_remote_prefill && p.transfer_id.as_deref().is_none_or(str::is_empty) {
            p.transfer_id = Some(request.request_id.to_string());
        }
    }
    request
}

/// A request's role; invalid params were refused when the request was added, so here they count
/// as a local request.
fn role_of(request: &SchedRequest) -> TransferRole {
    request.kv_transfer_params.as_ref().map(|p| p.role().unwrap_or(TransferRole::Local)).unwrap_or(TransferRole::Local)
}

impl SchedulerConnector {
    fn remember_trace(&mut self, request: &SchedRequest) {
        if let Some(tp) = &request.traceparent {
            self.traceparents.insert(request.request_id.clone(), tp.clone());
        }
    }

    /// Puts a step span of this request under the request's trace (its traceparent), if known.
    fn join_trace(&self, span: &tracing::Span, req_id: &RequestId) {
        if let Some(tp) = self.traceparents.get(req_id) {
            span.record(attrs::TRACEPARENT, tp.as_str());
        }
    }
}

impl Message<OnNewRequest> for SchedulerConnector {
    type Reply = Result<Option<String>, ActorError>;

    /// Seed steps 11 and 16: a request arrived with `kv_transfer_params`; say now, once, why they
    /// cannot be served here (the request then runs locally, as vLLM's connector does).
    async fn handle(&mut self, msg: OnNewRequest, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let request = with_transfer_named(msg.request);
        let Some(params) = request.kv_transfer_params.as_ref() else { return Ok(None) };
        Ok(match params.role() {
            Err(e) => Some(e.to_string()),
            Ok(TransferRole::Decode { .. }) if !self.role.consumes() => {
                Some(format!("do_remote_prefill on engine {} (a kv_producer): it prefills locally", self.engine_id))
            }
            Ok(TransferRole::Prefill { .. }) if !self.role.produces() => {
                Some(format!("do_remote_decode on engine {} (a kv_consumer): no KV will be sent", self.engine_id))
            }
            Ok(_) => None,
        })
    }
}

impl Message<GetNumNewMatchedTokens> for SchedulerConnector {
    type Reply = Result<MatchedTokens, ActorError>;

    /// Seed step 17: a D request loads the rest of its prompt from P, asynchronously; not yet
    /// while the first block it would load is being loaded for another request
    /// ([`InFlightPrefixes`]).
    async fn handle(&mut self, msg: GetNumNewMatchedTokens, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        Ok(match role_of(&msg.request) {
            TransferRole::Decode { .. } if self.role.consumes() => {
                // After a load vLLM recomputes the prompt's last token to sample the next one, so
                // its KV is never needed: when D's prefix cache holds every token before it, there
                // is nothing to load (the empty pull only tells P to free its blocks).
                //
                // A hybrid model loads one token less and computes the last prompt token itself:
                // a state group then advances past it exactly once (P prefilled the rest), and a
                // sliding window keeps the blocks that token attends to.
                let prompt = msg.request.prompt_len.saturating_sub(prefill_backoff(&self.groups));
                let missing = prompt.saturating_sub(msg.num_computed_tokens);
                let count = if missing <= 1 && !self.hybrid() { 0 } else { missing };
                // Only a request whose P still prefills waits (the wait overlaps P's work); a
                // hybrid model's groups key their blocks apart: no waiting there.
                let may_wait =
                    !self.hybrid() && msg.request.kv_transfer_params.as_ref().is_some_and(|p| p.prefill_in_flight);
                let hashes = if may_wait { msg.block_hashes } else { Default::default() };
                let id = &msg.request.request_id;
                if count > 0 && self.in_flight.waits(id, msg.num_computed_tokens, &hashes, Instant::now()) {
                    return Ok(MatchedTokens::not_yet());
                }
                self.local_hits.insert(id.clone(), msg.num_computed_tokens);
                MatchedTokens::tokens(count)
            }
            TransferRole::Decode { .. } => {
                tracing::warn!(request_id = %msg.request.request_id, engine_id = %self.engine_id,
                    "do_remote_prefill request on a kv_producer engine: prefilling locally");
                MatchedTokens::none()
            }
            _ => MatchedTokens::none(),
        })
    }
}

impl Message<UpdateStateAfterAlloc> for SchedulerConnector {
    type Reply = Result<Option<KvTransferParams>, ActorError>;

    /// Seed steps 12 (P: record the pending send, empty block list) and 17 (D: record the pull,
    /// then clear `do_remote_prefill` so that it happens once).
    async fn handle(&mut self, msg: UpdateStateAfterAlloc, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let request = with_transfer_named(msg.request);
        let Some(params) = request.kv_transfer_params.clone() else { return Ok(None) };
        Ok(match params.role() {
            Ok(TransferRole::Decode { transfer_id, remote_bootstrap_addr, remote_engine_id })
                if self.role.consumes() =>
            {
                self.remember_trace(&request);
                let hit = self.local_hits.remove(&request.request_id).unwrap_or(0);
                let local_block_ids =
                    if msg.num_external_tokens > 0 { self.to_load(msg.block_ids, hit) } else { GroupBlocks::default() };
                if !local_block_ids.is_empty() {
                    self.recv_in_flight.insert(request.request_id.clone());
                    self.in_flight.started(&request.request_id);
                }
                self.reqs_need_recv.insert(
                    request.request_id.clone(),
                    PullMeta {
                        d_req_id: request.request_id.clone(),
                        transfer_id: transfer_id.into(),
                        local_block_ids,
                        remote_engine_id: remote_engine_id.into(),
                        remote_bootstrap_addr,
                        traceparent: request.traceparent.clone(),
                    },
                );
                let mut updated = params;
                updated.do_remote_prefill = false;
                Some(updated)
            }
            Ok(TransferRole::Prefill { transfer_id }) if self.role.produces() => {
                self.remember_trace(&request);
                // An empty list tells the worker to create the send's wait object (step 13/14).
                let transfer_id: TransferId = transfer_id.into();
                if self.layerwise {
                    self.streaming.insert(request.request_id.clone(), (transfer_id.clone(), request.prompt_len));
                }
                self.reqs_need_send.entry(request.request_id.clone()).or_insert((transfer_id, GroupBlocks::default()));
                None
            }
            _ => None,
        })
    }
}

impl Message<BuildConnectorMeta> for SchedulerConnector {
    type Reply = Result<ConnectorMetadata, ActorError>;

    /// Seed steps 13, 18, 26: everything recorded since the last step, then cleared.
    async fn handle(&mut self, msg: BuildConnectorMeta, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.in_flight.step_built();
        let reqs_to_save = self.reqs_to_save(msg.scheduled);
        let reqs_to_send = std::mem::take(&mut self.reqs_need_send);
        let mut reqs_to_recv: BTreeMap<_, BTreeMap<_, _>> = BTreeMap::new();
        for (req_id, pull) in std::mem::take(&mut self.reqs_need_recv) {
            reqs_to_recv.entry(pull.remote_engine_id.clone()).or_default().insert(req_id, pull);
        }
        let involved: BTreeSet<&RequestId> =
            reqs_to_send.keys().chain(reqs_to_recv.values().flat_map(|m| m.keys())).collect();
        let traceparents = self
            .traceparents
            .iter()
            .filter(|(k, _)| involved.contains(k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (req_id, (transfer_id, blocks)) in &reqs_to_send {
            let span = if blocks.is_empty() {
                step_span!(steps::P_META_PENDING_SEND, request_id = %req_id, transfer_id = %transfer_id)
            } else {
                step_span!(steps::P_META_SEND_BLOCKS, request_id = %req_id, transfer_id = %transfer_id)
            };
            span.record(attrs::BLOCKS, blocks.len() as u64);
            span.record(attrs::ENGINE_ID, self.engine_id.as_str());
            self.join_trace(&span, req_id);
        }
        for (engine, pulls) in &reqs_to_recv {
            for (req_id, pull) in pulls {
                let span = step_span!(steps::D_META_RECV, request_id = %req_id, transfer_id = %pull.transfer_id);
                span.record(attrs::BLOCKS, pull.local_block_ids.len() as u64);
                span.record(attrs::ENGINE_ID, engine.as_str());
                self.join_trace(&span, req_id);
            }
        }
        Ok(ConnectorMetadata {
            reqs_to_send,
            reqs_to_recv,
            reqs_not_processed: std::mem::take(&mut self.reqs_not_processed),
            reqs_to_abort: std::mem::take(&mut self.reqs_to_abort),
            traceparents,
            reqs_to_save,
        })
    }
}

impl SchedulerConnector {
    /// Layer-wise: the step's chunks that compute a streaming prefill's prompt.
    fn reqs_to_save(&self, scheduled: Vec<ScheduledChunk>) -> BTreeMap<RequestId, LayerSave> {
        scheduled
            .into_iter()
            .filter_map(|chunk| {
                let (transfer_id, prompt_len) = self.streaming.get(&chunk.request_id)?;
                let save = LayerSave {
                    transfer_id: transfer_id.clone(),
                    block_ids: chunk.block_ids,
                    computed_upto: chunk.computed_upto.min(*prompt_len),
                    prompt_len: *prompt_len,
                };
                Some((chunk.request_id, save))
            })
            .collect()
    }
}

impl Message<RequestFinished> for SchedulerConnector {
    type Reply = Result<RequestFinishedReply, ActorError>;

    /// Seed steps 23 and 41: P keeps a finished request's blocks until they are sent (delayed
    /// free); D frees at once.
    async fn handle(&mut self, msg: RequestFinished, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        Ok(self.request_finished(msg))
    }
}

impl SchedulerConnector {
    fn request_finished(&mut self, msg: RequestFinished) -> RequestFinishedReply {
        let request = with_transfer_named(msg.request);
        self.streaming.remove(&request.request_id);
        self.local_hits.remove(&request.request_id);
        self.in_flight.finished(&request.request_id);
        let no_delay = RequestFinishedReply { delay_free_blocks: false, kv_transfer_params: None };
        let Some(params) = request.kv_transfer_params.as_ref() else { return no_delay };
        if params.do_remote_prefill && self.role.consumes() {
            // D request finished before its pull was issued (aborted while waiting to be
            // scheduled): still tell P, with no blocks, so that P frees its own.
            if let Ok(TransferRole::Decode { transfer_id, remote_bootstrap_addr, remote_engine_id }) = params.role() {
                self.reqs_need_recv.insert(
                    request.request_id.clone(),
                    PullMeta {
                        d_req_id: request.request_id.clone(),
                        transfer_id: transfer_id.into(),
                        local_block_ids: GroupBlocks::default(),
                        remote_engine_id: remote_engine_id.into(),
                        remote_bootstrap_addr,
                        traceparent: request.traceparent.clone(),
                    },
                );
            }
            return no_delay;
        }
        if self.recv_in_flight.contains(&request.request_id)
            && matches!(msg.status, FinishStatus::Aborted | FinishStatus::Error)
        {
            // Aborted while its KV is in flight: cancel the pull; the engine keeps the blocks until
            // the worker reports the request received or failed (no write-after-free).
            self.reqs_to_abort.insert(request.request_id.clone());
            return no_delay;
        }
        if !params.do_remote_decode || !self.role.produces() {
            self.traceparents.remove(&request.request_id);
            return no_delay;
        }
        let Ok(TransferRole::Prefill { transfer_id }) = params.role() else { return no_delay };
        match msg.status {
            FinishStatus::LengthCapped | FinishStatus::Stopped if !msg.block_ids.is_empty() => {
                // What D needs to pull these blocks, for a proxy that forwards P's answer to D.
                let for_d = self.bootstrap_addr.as_ref().map(|addr| KvTransferParams {
                    traceparent: request.traceparent.clone(),
                    ..KvTransferParams::for_decode(transfer_id.clone(), addr.clone(), self.engine_id.clone())
                });
                let held = self.held(msg.block_ids);
                self.reqs_need_send.insert(request.request_id.clone(), (transfer_id.into(), held));
                RequestFinishedReply { delay_free_blocks: true, kv_transfer_params: for_d }
            }
            _ => {
                // Aborted or failed: no KV to send; the worker answers D's pull with an error.
                self.reqs_need_send.remove(&request.request_id);
                self.reqs_not_processed.insert(transfer_id.into());
                self.traceparents.remove(&request.request_id);
                no_delay
            }
        }
    }
}

impl SchedulerConnector {
    /// Whether the model has more than one KV-cache group.
    fn hybrid(&self) -> bool {
        self.groups.len() > 1
    }

    /// The group of index `g` (a dense model: full attention).
    fn group(&self, g: usize) -> KvGroupSpec {
        self.groups.get(g).copied().unwrap_or(KvGroupSpec::full(1))
    }

    /// D: of the blocks allocated for the load, per group, the ones P writes: past the `hit`
    /// tokens D's prefix cache holds (in a span that starts at a known block), then each group's
    /// [`KvGroupSpec::to_move`]; a state group's page ends where the prompt ends.
    fn to_load(&self, blocks: GroupBlocks, hit: usize) -> GroupBlocks {
        let spans = blocks.0.into_iter().enumerate().map(|(g, span)| {
            let group = self.group(g);
            let span = match span.first {
                Some(first) if group.kind != KvGroupKind::State => {
                    let cached = (hit / group.block_size.max(1) as usize).saturating_sub(first as usize);
                    let cut = cached.min(span.ids.len());
                    BlockSpan { first: Some(first + cut as u32), ids: span.ids[cut..].to_vec() }
                }
                _ => span,
            };
            let moved = group.to_move(span, self.null_block);
            match group.kind {
                KvGroupKind::State => BlockSpan { first: None, ..moved },
                _ => moved,
            }
        });
        GroupBlocks(spans.collect())
    }

    /// P: of a finished prefill's blocks, per group, the ones it keeps for D: every block it
    /// still holds (a sliding window's freed ones skipped), a state group's last page.
    fn held(&self, blocks: GroupBlocks) -> GroupBlocks {
        let spans = blocks.0.into_iter().enumerate().map(|(g, span)| match self.group(g).kind {
            KvGroupKind::FullAttention => span,
            KvGroupKind::SlidingWindow { .. } => {
                let nulls = span.ids.iter().take_while(|&&b| Some(b) == self.null_block).count();
                let BlockSpan { first, mut ids } = span;
                ids.drain(..nulls);
                BlockSpan { first: first.map(|f| f + nulls as u32), ids }
            }
            KvGroupKind::State => {
                let last = span.ids.last().map(|&b| vec![b]).unwrap_or_default();
                BlockSpan { first: None, ids: last }
            }
        });
        GroupBlocks(spans.collect())
    }
}

impl Message<UpdateConnectorOutput> for SchedulerConnector {
    type Reply = Result<(), ActorError>;

    /// Seed steps 32/33 (P: sent → the engine frees) and 35/36 (D: received → the engine resumes).
    async fn handle(&mut self, msg: UpdateConnectorOutput, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let ConnectorOutput { finished_sending, finished_recving, failed_recving } = msg.output;
        for req_id in &finished_sending {
            let span = step_span!(steps::P_REPORT_SENT, request_id = %req_id);
            self.join_trace(&span, req_id);
            self.traceparents.remove(req_id);
        }
        for req_id in &finished_recving {
            let report = step_span!(steps::D_REPORT_RECV, request_id = %req_id);
            self.join_trace(&report, req_id);
            drop(report);
            let span = step_span!(steps::D_MARK_RECV, request_id = %req_id);
            self.join_trace(&span, req_id);
            Outcome::Received.record(&span);
            self.recv_in_flight.remove(req_id);
            self.in_flight.settled(req_id);
            self.reqs_to_abort.remove(req_id);
            self.traceparents.remove(req_id);
        }
        for (req_id, failure) in &failed_recving {
            let span = step_span!(steps::D_REPORT_RECV, request_id = %req_id);
            self.join_trace(&span, req_id);
            Outcome::Failed(failure.cause.label()).record(&span);
            self.recv_in_flight.remove(req_id);
            self.in_flight.settled(req_id);
            self.reqs_to_abort.remove(req_id);
            self.traceparents.remove(req_id);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
