//! The scheduler-side connector: its hooks, the metadata it sends to the workers, and the output
//! the workers send back (the Rust form of vLLM's `KVConnectorBase_V1` scheduler role).
//!
//! Hooks, as the engine calls them (seed steps 11, 12, 16, 17, 23, 33, 37): [`OnNewRequest`],
//! [`GetNumNewMatchedTokens`], [`UpdateStateAfterAlloc`], [`BuildConnectorMeta`],
//! [`RequestFinished`], [`UpdateConnectorOutput`]. The metadata is [`ConnectorMetadata`]
//! (`reqs_to_send`, `reqs_to_recv` grouped by remote engine, `reqs_not_processed`; steps 13, 18, 26);
//! the output is [`ConnectorOutput`] (`finished_sending`, `finished_recving`, failures; steps 32, 35).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::kv_groups::GroupBlocks;
use crate::kv_transfer_params::KvTransferParams;
use crate::sender_listener::PullErrorCause;
use crate::{BlockId, EngineId, RequestId, TransferId};

/// What the hooks see of a request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SchedRequest {
    pub request_id: RequestId,
    pub prompt_len: usize,
    pub kv_transfer_params: Option<KvTransferParams>,
    /// W3C traceparent of the request, for the connector's spans.
    pub traceparent: Option<String>,
}

/// How a request ended (vLLM's `RequestStatus.FINISHED_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishStatus {
    /// Reached `max_tokens` (P's normal end: max_tokens = 1).
    LengthCapped,
    /// Sampled EOS or a stop token (checked before the length).
    Stopped,
    /// Aborted by the client or the proxy.
    Aborted,
    /// Failed inside the engine (e.g. a KV load failed with policy `fail`).
    Error,
}

/// Hook: a request arrived (vLLM's `on_new_request`, before it is scheduled). Reply: why its
/// `kv_transfer_params` cannot be served on this engine (it then runs without a transfer), or
/// `None` when they can or when it carries none.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OnNewRequest {
    pub request: SchedRequest,
}

/// Hook: how many prompt tokens can come from outside, and whether they load asynchronously.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GetNumNewMatchedTokens {
    pub request: SchedRequest,
    pub num_computed_tokens: usize,
    /// The prompt's full blocks as the engine's prefix cache keys them; empty when not known (D
    /// then never waits for a load of the same blocks already in flight).
    #[serde(default)]
    pub block_hashes: PromptBlockHashes,
}

/// A prompt's full blocks, as the engine's prefix cache keys them: one 64-bit form of each block's
/// hash (stable within the engine), in prompt order, and the tokens a block holds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptBlockHashes {
    pub block_size: usize,
    pub hashes: Vec<u64>,
}

/// Reply of [`GetNumNewMatchedTokens`]: vLLM's `(count, load_kv_async)`, or its `None` (`not_yet`:
/// not schedulable this step, ask again on a later one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MatchedTokens {
    pub count: usize,
    pub load_async: bool,
    /// D: the blocks this request would load are being loaded for another request on this engine;
    /// once they land they are in the prefix cache, and this request loads only the rest.
    #[serde(default)]
    pub not_yet: bool,
}

impl MatchedTokens {
    /// `count` tokens from outside, loaded asynchronously when there are any.
    pub fn tokens(count: usize) -> Self {
        Self { count, load_async: count > 0, not_yet: false }
    }

    /// Nothing from outside: the engine computes the prompt itself.
    pub fn none() -> Self {
        Self { count: 0, load_async: false, not_yet: false }
    }

    /// Not schedulable this step (vLLM's `None`).
    pub fn not_yet() -> Self {
        Self { count: 0, load_async: false, not_yet: true }
    }
}

/// Hook: blocks were allocated for a request (steps 12 and 17).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpdateStateAfterAlloc {
    pub request: SchedRequest,
    /// The request's blocks to load, per KV-cache group, in prompt order (the blocks D's prefix
    /// cache did not fill).
    pub block_ids: GroupBlocks,
    /// Tokens to load from outside (0 on the second call after a remote load).
    pub num_external_tokens: usize,
}

/// Hook: build the metadata for this step's workers (every `schedule()`), given what the step's
/// forward computes (vLLM passes its `SchedulerOutput`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BuildConnectorMeta {
    /// The requests this step computes, each with its blocks (layer-wise saves need them).
    pub scheduled: Vec<ScheduledChunk>,
}

/// One request's share of a step: its blocks so far, and how many of its tokens have KV once the
/// step's forward is done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduledChunk {
    pub request_id: RequestId,
    pub block_ids: Vec<BlockId>,
    pub computed_upto: usize,
}

/// P, layer-wise: a request this step's forward prefills and whose KV leaves for D layer by layer
/// (the worker's `save_kv_layer`). `computed_upto` tokens of the prompt's `prompt_len` hold KV in
/// each layer once that layer of this step's forward is done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerSave {
    pub transfer_id: TransferId,
    pub block_ids: Vec<BlockId>,
    pub computed_upto: usize,
    pub prompt_len: usize,
}

/// Hook: a request finished (steps 23 and 41).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestFinished {
    pub request: SchedRequest,
    pub status: FinishStatus,
    /// The request's blocks per KV-cache group, each from the prompt's first block.
    pub block_ids: GroupBlocks,
}

/// Reply of [`RequestFinished`]: vLLM's `(delay_free_blocks, kv_transfer_params)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestFinishedReply {
    pub delay_free_blocks: bool,
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// Hook: the workers' output of one step (steps 33, 36).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct UpdateConnectorOutput {
    pub output: ConnectorOutput,
}

/// One pull D's worker must make (seed step 18's `PullReqMeta`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullMeta {
    pub d_req_id: RequestId,
    pub transfer_id: TransferId,
    /// D's blocks to fill, per KV-cache group; empty when the pull only tells P to free
    /// (request aborted early).
    pub local_block_ids: GroupBlocks,
    pub remote_engine_id: EngineId,
    pub remote_bootstrap_addr: String,
    pub traceparent: Option<String>,
}

/// Scheduler → workers, once per `schedule()` (vLLM's `MooncakeConnectorMetadata`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ConnectorMetadata {
    /// P: request id → (transfer_id, block ids per group); no block ids = "started, not
    /// finished" (step 13).
    pub reqs_to_send: BTreeMap<RequestId, (TransferId, GroupBlocks)>,
    /// D: remote engine id → request id → pull (step 18).
    pub reqs_to_recv: BTreeMap<EngineId, BTreeMap<RequestId, PullMeta>>,
    /// P: transfers whose request ended without KV to send (aborted, failed).
    pub reqs_not_processed: BTreeSet<TransferId>,
    /// D: requests aborted while their pull is in flight; the worker cancels the pull.
    pub reqs_to_abort: BTreeSet<RequestId>,
    /// W3C traceparent per request id, so worker spans join the request's trace.
    pub traceparents: BTreeMap<RequestId, String>,
    /// P, layer-wise: the requests this step prefills, whose finished layers the worker streams.
    pub reqs_to_save: BTreeMap<RequestId, LayerSave>,
}

impl ConnectorMetadata {
    /// True when the workers have nothing to do.
    pub fn is_empty(&self) -> bool {
        self.reqs_to_send.is_empty()
            && self.reqs_to_recv.is_empty()
            && self.reqs_to_save.is_empty()
            && self.reqs_not_processed.is_empty()
            && self.reqs_to_abort.is_empty()
    }
}

/// Workers → scheduler (vLLM's `KVConnectorOutput`, steps 32 and 35).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ConnectorOutput {
    /// P request ids whose KV was sent (or whose transfer is certainly dead): free their blocks.
    pub finished_sending: BTreeSet<RequestId>,
    /// D request ids whose KV has arrived.
    pub finished_recving: BTreeSet<RequestId>,
    /// D request ids whose KV will not arrive, with why; no write can land any more.
    pub failed_recving: BTreeMap<RequestId, LoadFailure>,
}

/// Why a request's KV will not arrive on D (step 34's failure, reported at step 35).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadFailure {
    pub cause: LoadFailureCause,
    /// What happened, in words a user can act on.
    pub detail: String,
    /// D's blocks the pull was to write: their bytes are undefined (vLLM's
    /// `get_block_ids_with_load_errors`).
    pub block_ids: Vec<BlockId>,
}

impl LoadFailure {
    pub fn new(cause: LoadFailureCause, detail: impl Into<String>) -> Self {
        Self { cause, detail: detail.into(), block_ids: Vec::new() }
    }
}

impl std::fmt::Display for LoadFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.cause.label(), self.detail)
    }
}

/// The kind of a [`LoadFailure`]: a closed set, so that it can label metrics and spans.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LoadFailureCause {
    /// The pull ended with this error: P's answer, or the pull's own (the side channel failed,
    /// P's answer was not one, or none came before the pull's deadline).
    Pull(PullErrorCause),
    /// The bootstrap could not say where P's workers are (the look-up failed, P is not
    /// registered there, or no P worker pairs with this D worker).
    Bootstrap,
    /// D gave the request up before its pull was sent.
    AbortedByD,
    /// The engine held the request's blocks for the connector past its deadline.
    Deadline,
    /// A worker in another process reported the load failed (vLLM's scheduler hears request ids
    /// only; the cause is in that worker's log).
    ReportedByWorker,
    /// The KV landed, but a block differs from what P sent (`verify_checksums`): not decoded from.
    KvMismatch,
}

impl LoadFailureCause {
    /// A short fixed name (a metric label, a span outcome).
    pub fn label(&self) -> &'static str {
        match self {
            LoadFailureCause::Pull(cause) => cause.label(),
            LoadFailureCause::Bootstrap => "bootstrap",
            LoadFailureCause::AbortedByD => "aborted_by_d",
            LoadFailureCause::Deadline => "deadline",
            LoadFailureCause::ReportedByWorker => "reported_by_worker",
            LoadFailureCause::KvMismatch => "kv_mismatch",
        }
    }
}

impl ConnectorOutput {
    pub fn is_empty(&self) -> bool {
        self.finished_sending.is_empty() && self.finished_recving.is_empty() && self.failed_recving.is_empty()
    }

    /// Adds `other` into `self`.
    pub fn merge(&mut self, other: ConnectorOutput) {
        self.finished_sending.extend(other.finished_sending);
        self.finished_recving.extend(other.finished_recving);
        self.failed_recving.extend(other.failed_recving);
    }
}
