//! Proxy messages: the per-request flow's routing ask, and the readiness reports of the proxy's
//! health poller (seed steps 6–10).
//!
//! The Proxy actor owns the P/D pools, their health, P's engine ids and the round-robin counters;
//! the flow of one request runs outside the actor and only asks it for a [`Route`].

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::{EngineId, TransferId};

/// Which pool a target belongs to (`"prefill"`, `"decode"` in JSON).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pool {
    Prefill,
    Decode,
}

impl Pool {
    /// `prefill` or `decode`.
    pub fn name(self) -> &'static str {
        match self {
            Pool::Prefill => "prefill",
            Pool::Decode => "decode",
        }
    }
}

/// Ask the Proxy where a request goes: (P, P's dp rank, D), each chosen by its pool's policy
/// (step 8). `Route::default()` knows nothing of the prompt (the cache-aware policy then falls
/// back to load).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Route {
    pub prompt: PromptKey,
    /// P (indices in the prefill list) not to choose: they failed this request already.
    pub exclude_prefill: Vec<usize>,
}

/// What the routing policies know of a request's prompt: the chained hashes of its full chunks
/// (two prompts that share a prefix share their leading hashes, as vLLM's block hashes do), its
/// length in (estimated) tokens, and its token ids when the request gave them (`prompt` as a list
/// of ids: what `kv_aware` matches against the engines' KV events; text is not tokenized).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PromptKey {
    pub chunks: Vec<u64>,
    pub tokens: usize,
    pub token_ids: Option<Arc<[u32]>>,
}

/// Why a pool's policy chose its engine (the proxy's step-8 span and `/metrics` say it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Choice {
    /// The next in turn.
    #[default]
    RoundRobin,
    /// The engine with the least work in flight.
    LeastLoaded,
    /// The engine that most likely holds the longest prefix of the prompt: its first `chunks`
    /// chunks were routed to it before (`cache_aware`, and `kv_aware` for a prompt given as text:
    /// an approximation).
    CacheHit { chunks: usize },
    /// The engine whose prefix cache holds the longest prefix of the prompt, as its KV events
    /// said (`kv_aware`, a prompt of token ids): its first `blocks` blocks, `tokens` tokens.
    KvHit { blocks: usize, tokens: usize },
    /// No P: D computes the prompt itself (it is short, or D already holds most of it).
    Skipped,
}

impl Choice {
    /// The `choice` label in `/metrics`.
    pub fn label(self) -> &'static str {
        match self {
            Choice::RoundRobin => "round_robin",
            Choice::LeastLoaded => "least_loaded",
            Choice::CacheHit { .. } => "cache_hit",
            Choice::KvHit { .. } => "kv_hit",
            Choice::Skipped => "skipped",
        }
    }
}

/// Flow → Proxy: a routed request's P call ended (P answered, failed, or the call was given
/// up): its prefill leaves the load the P pool's policy counts. P's part of the request (its
/// blocks until D pulled them) still counts in the pool's requests in flight until [`RouteDone`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillDone {
    pub prefill_index: usize,
    pub prefill_dp_rank: u32,
    /// The tokens charged to P when it was routed.
    pub prefill_tokens: usize,
}

/// Flow → Proxy: a routed request ended (answered, failed or given up): its work leaves D's load
/// and both engines' requests in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteDone {
    pub prefill_index: usize,
    pub decode_index: usize,
    /// The tokens charged to D.
    pub decode_tokens: usize,
    /// Whether a P was charged at all.
    pub disaggregated: bool,
}

/// Where one request goes (steps 9–10).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteDecision {
    /// Index of P in the proxy's prefill list.
    pub prefill_index: usize,
    /// P's HTTP base URL, e.g. `http://127.0.0.1:8010`.
    pub prefill_url: String,
    /// P's bootstrap address, `http://{host}:{bootstrap_port}` (D's `remote_bootstrap_addr`).
    pub prefill_bootstrap_addr: String,
    /// The dp rank of P chosen for this request.
    pub prefill_dp_rank: u32,
    /// P's engine id for that dp rank (D's `remote_engine_id`).
    pub prefill_engine_id: EngineId,
    /// Index of D in the proxy's decode list.
    pub decode_index: usize,
    /// D's HTTP base URL.
    pub decode_url: String,
    /// Why P and D were chosen.
    pub prefill_choice: Choice,
    pub decode_choice: Choice,
    /// The tokens charged to P and to D (given back by [`RouteDone`]).
    pub prefill_tokens: usize,
    pub decode_tokens: usize,
    /// Whether P prefills and D loads the KV; `false`: D alone serves the request, and the
    /// prefill fields name no engine ([`Choice::Skipped`]).
    pub disaggregate: bool,
}

impl RouteDecision {
    /// The [`PrefillDone`] that gives P's prefill back (a route through P).
    pub fn prefill_done(&self) -> Option<PrefillDone> {
        self.disaggregate.then_some(PrefillDone {
            prefill_index: self.prefill_index,
            prefill_dp_rank: self.prefill_dp_rank,
            prefill_tokens: self.prefill_tokens,
        })
    }

    /// The [`RouteDone`] that gives this route's work back.
    pub fn done(&self) -> RouteDone {
        RouteDone {
            prefill_index: self.prefill_index,
            decode_index: self.decode_index,
            decode_tokens: self.decode_tokens,
            disaggregated: self.disaggregate,
        }
    }
}

/// Why the proxy cannot route a request now (HTTP 503).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotReady {
    #[error("proxy is not ready yet, still waiting for: {}", waiting_for.join(", "))]
    Starting { waiting_for: Vec<String> },
    #[error("no {pool:?} instance is healthy right now (check the {pool:?} servers)")]
    NoHealthy { pool: Pool },
}

/// Ask the Proxy whether it serves, and what it still waits for (`GET /health`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyStatus;

/// The answer to [`ProxyStatus`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyReadiness {
    pub ready: bool,
    pub waiting_for: Vec<String>,
}

/// Poller → Proxy: one health probe's outcome (step 6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetHealth {
    pub pool: Pool,
    pub index: usize,
    pub healthy: bool,
}

/// Poller → Proxy: P's bootstrap `/query` answered; dp rank → engine id (step 7).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillDiscovered {
    pub prefill_index: usize,
    pub dp_engine_id: BTreeMap<u32, EngineId>,
}

/// Flow → Proxy: a request's connection to an engine was refused (not a probe): the engine is
/// taken out of rotation at once, until the health poller sees its `/health` answer again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineUnreachable {
    pub pool: Pool,
    pub index: usize,
    pub reason: String,
}

/// Flow → Proxy: a prefill request failed; the proxy re-queries that P's engine ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillFailed {
    pub prefill_index: usize,
    pub reason: String,
}

/// Poller → Proxy: the ready deadline passed before every P and D answered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadyDeadlinePassed;

/// Flow → Proxy: D could not be reached for this request (its connection was refused), so it will
/// never pull P's KV: P is told to free the blocks it holds for the transfer now, not at its send
/// expiry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleasePrefill {
    /// P's bootstrap, where its workers' side channels are looked up.
    pub bootstrap_addr: String,
    pub engine_id: EngineId,
    pub transfer_id: TransferId,
}

// ---- Admin: engines joining and leaving a running proxy -------------------------------------

/// Where an engine is in its life in the proxy: it takes new requests (`serving`), finishes
/// those it has and takes no new one (`draining`), or is gone (`removed`: its index is never
/// reused nor chosen again).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineState {
    Serving,
    Draining,
    Removed,
}

/// One engine as the admin API lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineInfo {
    pub pool: Pool,
    /// Its index in its pool (stable for the proxy's life, never reused).
    pub index: usize,
    pub url: String,
    /// P's bootstrap address (`http://{host}:{port}`); none for a D.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub bootstrap_addr: Option<String>,
    pub state: EngineState,
    /// In rotation as far as health goes (a P: healthy and its engine ids known).
    pub healthy: bool,
    /// P's engine ids by dp rank (empty for a D, or a P not yet queried).
    pub engine_ids: BTreeMap<u32, EngineId>,
    /// Requests routed to it that have not ended.
    pub in_flight: usize,
    /// Requests routed to it since it joined.
    pub routed: u64,
    /// Where it publishes KV events, as given when it joined (followed by a `kv_aware` pool).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kv_events: Vec<crate::discovery::KvEventsEndpoint>,
}

/// Admin → Proxy: every engine not removed, P first, by index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ListEngines;

/// Admin → Proxy: a new engine joins `pool` (a P with its bootstrap port); it serves once healthy
/// (a P: once its engine ids are known).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddEngine {
    pub pool: Pool,
    pub url: String,
    /// A P's bootstrap port (none: 8998); a D takes none.
    pub bootstrap_port: Option<u16>,
    /// Where it publishes KV events: subscribed to when its pool is `kv_aware`.
    pub kv_events: Vec<crate::discovery::KvEventsEndpoint>,
}

/// Admin → Proxy: the engine at `url` takes no new request; those in flight finish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrainEngine {
    pub url: String,
}

/// Admin → Proxy: the draining engine at `url` takes new requests again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UndrainEngine {
    pub url: String,
}

/// Admin → Proxy: the engine at `url` leaves; refused while requests are in flight on it unless
/// `force` (those requests then finish or fail on their own, and their accounting stays valid).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoveEngine {
    pub url: String,
    pub force: bool,
}

/// Why an admin change was refused (nothing changed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdminError {
    #[error("`{url}` is not an engine URL: {reason} (expected http://HOST:PORT)")]
    BadUrl { url: String, reason: String },
    #[error("{url} is already in the proxy (the {} pool, {}); remove it first", pool.name(), state_name(*state))]
    Duplicate { url: String, pool: Pool, state: EngineState },
    #[error("no engine {url} in the proxy (GET /admin/engines lists them)")]
    UnknownEngine { url: String },
    #[error("a decode engine has no bootstrap port (only a prefill engine's bootstrap is queried)")]
    BootstrapPortForDecode,
    #[error("{url} still has {in_flight} request(s) in flight: drain it and wait, or remove it with \"force\": true")]
    InFlight { url: String, in_flight: usize },
    #[error("KV events endpoint of {url}: {reason}")]
    BadKvEvents { url: String, reason: String },
}

fn state_name(state: EngineState) -> &'static str {
    match state {
        EngineState::Serving => "serving",
        EngineState::Draining => "draining",
        EngineState::Removed => "removed",
    }
}
