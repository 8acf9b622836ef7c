//! Messages to D's Receiver (steps 19, 34, 35) and from its PullTasks.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::scheduler_connector::PullMeta;
use crate::sender_listener::PullErr;
use crate::{EngineId, RequestId};

/// Step 19: `start_load_kv` hands the step's pulls (and aborts) to the receiver.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StartLoadKv {
    pub reqs_to_recv: BTreeMap<EngineId, BTreeMap<RequestId, PullMeta>>,
    pub reqs_to_abort: BTreeSet<RequestId>,
}

/// Step 34: what one PullTask learned from one P worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullOutcome {
    pub pull_id: u64,
    pub remote_engine_id: EngineId,
    pub ok_reqs: Vec<RequestId>,
    /// P's block digests of `ok_reqs`, where P sent them.
    pub digests: Vec<crate::sender_listener::BlockDigests>,
    pub err_reqs: Vec<PullErr>,
    /// P acknowledged D's layout (later pulls may omit it).
    pub layout_acked: Option<u64>,
    /// The P worker's generation as its answers gave it (0: none came or none was given).
    pub p_generation: u64,
}

/// Step 35: the worker collects what finished since the last call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct GetFinishedRecving;

/// Ask a D worker's Receiver where each request it tracks stands (its lifecycle state:
/// `looking_up`, `pulling` or `draining_fence`); empty once every request has been reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TransferStates;

/// Receiver → PullTask: D gave these transfers up while their pull is in flight; the PullTask sends
/// an `AbortPull` on its side channel and keeps waiting for P's final answer (no write-after-free).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CancelTransfers {
    pub transfer_ids: Vec<crate::TransferId>,
}

/// PullTask → Receiver, before its [`PullOutcome`]: the side-channel socket itself failed (connect,
/// send or receive), so the bootstrap answer that named `worker_addr` may be stale.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullTransportFailed {
    pub pull_id: u64,
    pub remote_engine_id: EngineId,
    pub worker_addr: String,
    pub reason: String,
}
