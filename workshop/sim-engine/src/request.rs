//! A request as the engine sees it: what a caller submits ([`EngineRequest`]), what it gets back
//! ([`RequestOutput`] deltas on a [`RequestStream`]), why a submission is refused ([`EngineError`]),
//! and the scheduler's per-request state (vLLM's `Request`, with `WAITING_FOR_REMOTE_KVS`).
//! Dropping a [`RequestStream`] before it finished aborts the request (client disconnect).

use std::pin::Pin;
use std::task::{Context, Poll};

use pdflow_messages::kv_groups::{BlockSpan, GroupBlocks};
use pdflow_messages::kv_transfer_params::{KvTransferParams, KvTransferParamsError, TransferRole};
use pdflow_messages::scheduler_connector::{FinishStatus, SchedRequest};
use pdflow_messages::BlockId;
use tokio::sync::mpsc;

use super::block_hash::BlockHash;
use super::cache_stats::PromptSources;
use super::core::Command;
use super::model::ContextDigest;

/// What a caller submits.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineRequest {
    pub request_id: String,
    pub prompt_token_ids: Vec<u32>,
    pub max_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub kv_transfer_params: Option<KvTransferParams>,
    pub traceparent: Option<String>,
}

/// One delta of a request's output.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutput {
    pub request_id: String,
    pub new_token_ids: Vec<u32>,
    /// Set on the last output.
    pub finish: Option<FinishStatus>,
    /// Why the request failed, when `finish` is `Error`.
    pub error: Option<String>,
    /// What the connector returned at the finish (vLLM puts it in the response), if anything.
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// Why the engine refuses a request.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error("the prompt is empty: send at least one token")]
    EmptyPrompt,
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("this model's maximum context length is {max_model_len} tokens, but the request has {prompt_len} prompt tokens and max_tokens {max_tokens}: shorten the prompt or lower max_tokens")]
    TooLong { prompt_len: usize, max_tokens: usize, max_model_len: usize },
    #[error("the request needs up to {needed} KV blocks (prompt {prompt_len} + max_tokens {max_tokens}) but the engine has only {total}: raise --num-blocks or shorten the request")]
    TooManyBlocks { needed: usize, total: usize, prompt_len: usize, max_tokens: usize },
    #[error("invalid kv_transfer_params: {0}")]
    InvalidKvTransferParams(#[from] KvTransferParamsError),
    #[error("kv_transfer_params asks for a {role} request, but this engine runs without a KV connector: start it with --kv-transfer-config")]
    NoConnector { role: &'static str },
    #[error("a request with id `{0}` is already running: request ids must be unique")]
    DuplicateRequestId(String),
    #[error("kv_transfer_params names transfer_id `{transfer_id}`, which request `{owner}` on this engine already uses: every request needs its own transfer_id")]
    TransferIdInUse { transfer_id: String, owner: String },
    #[error("the engine loop has stopped; the server is shutting down or failed")]
    EngineStopped,
}

impl EngineError {
    /// True when the caller's input is at fault (HTTP 400); otherwise the engine is (HTTP 503).
    pub fn is_client_error(&self) -> bool {
        !matches!(self, EngineError::EngineStopped)
    }
}

/// The stream of a request's outputs. Dropping it before the last output aborts the request.
#[derive(Debug)]
pub struct RequestStream {
    pub(crate) request_id: String,
    pub(crate) rx: mpsc::UnboundedReceiver<RequestOutput>,
    pub(crate) commands: mpsc::UnboundedSender<Command>,
    pub(crate) done: bool,
}

impl RequestStream {
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The next output; `None` once finished or if the engine stopped.
    pub async fn next_output(&mut self) -> Option<RequestOutput> {
        futures::StreamExt::next(self).await
    }
}

impl futures::Stream for RequestStream {
    type Item = RequestOutput;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<RequestOutput>> {
        if self.done {
            return Poll::Ready(None);
        }
        let polled = self.rx.poll_recv(cx);
        match &polled {
            Poll::Ready(Some(out)) if out.finish.is_some() => self.done = true,
            Poll::Ready(None) => self.done = true,
            _ => {}
        }
        polled
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.commands.send(Command::Abort(self.request_id.clone()));
        }
    }
}

/// vLLM's `RequestStatus` (finished states are only those the scheduler still tracks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    Waiting,
    WaitingForRemoteKvs,
    Running,
    /// P: finished, blocks held until the worker reports `finished_sending` (step 23 → 33).
    FinishedDelayFree,
    /// D: aborted while its KV was in flight; blocks held until `finished_recving`/`failed_recving`.
    AbortedAwaitingRecv,
}

/// The scheduler's state of one request.
#[derive(Debug)]
pub(crate) struct Request {
    pub id: String,
    pub prompt_len: usize,
    pub all_token_ids: Vec<u32>,
    pub max_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub kv_transfer_params: Option<KvTransferParams>,
    pub traceparent: Option<String>,
    pub role: TransferRole,
    pub status: Status,
    pub num_computed_tokens: usize,
    /// Every block the request holds (a hybrid model's, over all groups).
    pub block_ids: Vec<BlockId>,
    /// A hybrid model's blocks per KV-cache group, in prompt order; empty for a dense model.
    pub group_blocks: Vec<Vec<BlockId>>,
    pub digest: ContextDigest,
    /// Counted in the block reservation (admitted once; see `Scheduler::reserved_blocks`).
    pub admitted: bool,
    /// `get_num_new_matched_tokens` was asked already.
    pub connector_matched: bool,
    /// D: the first forward after the remote load is still to come (steps 38–39).
    pub first_token_pending: bool,
    /// D: the span of the decode loop (step 40), from after the first token to the finish.
    pub decode_span: Option<tracing::Span>,
    /// When the request entered the state in which it holds blocks for the connector
    /// (`WaitingForRemoteKvs`, `FinishedDelayFree`, `AbortedAwaitingRecv`): `kv_state_timeout`.
    pub held_since: Option<tokio::time::Instant>,
    /// Prefix caching: the chained hashes of the full blocks of `all_token_ids` so far.
    pub block_hashes: Vec<BlockHash>,
    /// Prefix caching: how many of the leading blocks are in the prefix cache (hit or cached).
    pub num_cached_blocks: usize,
    /// Prefix caching: the blocks the local prefix cache supplied at admission.
    pub hit_blocks: usize,
    /// Where the prompt's tokens came from, until the prefill is done and counted.
    pub prompt_sources: Option<PromptSources>,
    pub output_tx: mpsc::UnboundedSender<RequestOutput>,
}

impl Request {
    /// The request's blocks as the connector takes them: a dense model's list, or (`hybrid`) one
    /// list per KV-cache group from the prompt's first block.
    pub fn connector_blocks(&self, hybrid: bool) -> GroupBlocks {
        if !hybrid {
            return self.block_ids.clone().into();
        }
        GroupBlocks(self.group_blocks.iter().map(|ids| BlockSpan { first: Some(0), ids: ids.clone() }).collect())
    }

    pub fn new(req: EngineRequest, role: TransferRole, output_tx: mpsc::UnboundedSender<RequestOutput>) -> Self {
        Self {
            id: req.request_id,
            prompt_len: req.prompt_token_ids.len(),
            all_token_ids: req.prompt_token_ids,
            max_tokens: req.max_tokens,
            stop_token_ids: req.stop_token_ids,
            ignore_eos: req.ignore_eos,
            kv_transfer_params: req.kv_transfer_params,
            traceparent: req.traceparent,
            role,
            status: Status::Waiting,
            num_computed_tokens: 0,
            block_ids: Vec::new(),
            group_blocks: Vec::new(),
            digest: ContextDigest::default(),
            admitted: false,
            connector_matched: false,
            first_token_pending: false,
            decode_span: None,
            held_since: None,
            block_hashes: Vec::new(),
            num_cached_blocks: 0,
            hit_blocks: 0,
            prompt_sources: None,
            output_tx,
        }
    }

    pub fn num_tokens(&self) -> usize {
        self.all_token_ids.len()
    }

    /// Extends `block_hashes` over the full blocks of `all_token_ids`.
    pub fn update_block_hashes(&mut self, block_size: usize) {
        let new = BlockHash::extend_chain(&self.block_hashes, &self.all_token_ids, block_size);
        self.block_hashes.extend(new);
    }

    pub fn num_output_tokens(&self) -> usize {
        self.all_token_ids.len() - self.prompt_len
    }

    pub fn transfer_id(&self) -> &str {
        match &self.role {
            TransferRole::Prefill { transfer_id } | TransferRole::Decode { transfer_id, .. } => transfer_id,
            TransferRole::Local => "",
        }
    }

    pub fn is_prefill_role(&self) -> bool {
        matches!(self.role, TransferRole::Prefill { .. })
    }

    pub fn is_decode_role(&self) -> bool {
        matches!(self.role, TransferRole::Decode { .. })
    }

    /// What the connector hooks see.
    pub fn sched_request(&self) -> SchedRequest {
        SchedRequest {
            request_id: self.id.clone().into(),
            prompt_len: self.prompt_len,
            kv_transfer_params: self.kv_transfer_params.clone(),
            traceparent: self.traceparent.clone(),
        }
    }

    /// Sends an output delta; a closed stream is fine (the abort is on its way).
    pub fn emit(
        &self,
        new_token_ids: Vec<u32>,
        finish: Option<FinishStatus>,
        error: Option<String>,
        params: Option<KvTransferParams>,
    ) {
        let _ = self.output_tx.send(RequestOutput {
            request_id: self.id.clone(),
            new_token_ids,
            finish,
            error,
            kv_transfer_params: params,
        });
    }
}
