//! Messages to P's per-transfer SendWorker (steps 14, 22, 27–29, 31).
//!
//! The SenderListener routes to one SendWorker per transfer_id: the scheduler's record of the
//! request ([`RecordSendPending`], step 14, then [`RecordSendReady`], step 27), and D's pull for it
//! ([`ServePull`], step 22). [`AbortSend`] ends a transfer that will never have KV.

use serde::{Deserialize, Serialize};

use crate::kv_groups::GroupBlocks;
use crate::layout::KvLayout;
use crate::{BlockId, RequestId, TransferId};

/// Step 14: P's request started; its blocks are not final yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordSendPending {
    pub p_req_id: RequestId,
    pub transfer_id: TransferId,
    /// The W3C traceparent of P's request (from the scheduler's metadata): step 14 joins its trace.
    pub traceparent: Option<String>,
}

/// Step 27: P's request finished; these blocks hold its prompt's KV: set `ready`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordSendReady {
    pub p_req_id: RequestId,
    pub transfer_id: TransferId,
    /// P's blocks per KV-cache group, each from the prompt's first block.
    pub block_ids: GroupBlocks,
    /// The W3C traceparent of P's request: step 27 joins its trace.
    pub traceparent: Option<String>,
}

/// Step 29, layer-wise: `layer` holds the KV of the prompt's first `computed_upto` tokens (of
/// `prompt_len`) in `block_ids`, P's blocks so far; the rest of the prompt is still computing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerDone {
    pub p_req_id: RequestId,
    pub layer: usize,
    pub block_ids: Vec<BlockId>,
    pub computed_upto: usize,
    pub prompt_len: usize,
}

/// Step 22: D asks for this transfer to be written into its blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServePull {
    pub pull_id: u64,
    pub d_req_id: RequestId,
    pub transfer_id: TransferId,
    /// D's blocks to write, per KV-cache group.
    pub block_ids: GroupBlocks,
    pub data_addr: String,
    pub layout: KvLayout,
    pub traceparent: Option<String>,
    /// D's write-fence token for these blocks (0: none), named before the data.
    pub fence: u64,
    /// Where the pulling D worker sits among D's ranks.
    pub d_rank: DRank,
    /// No byte of D's blocks may be written after this (D's pull deadline, less a margin, from
    /// the pull's arrival); `None`: no limit. Local to P, never sent.
    #[serde(skip)]
    pub write_by: Option<std::time::Instant>,
    /// What P needs to write these blocks one-sided (D's endpoint and keys); `None`: over D's
    /// data server.
    pub rdma: Option<crate::rdma::RemoteWriteGrant>,
}

/// The pulling D worker's tensor and pipeline position (from its pull).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DRank {
    pub tp_size: u32,
    pub tp_rank: u32,
    pub pp_size: u32,
    pub pp_rank: u32,
}

impl Default for DRank {
    /// One D worker holding the whole model.
    fn default() -> Self {
        Self { tp_size: 1, tp_rank: 0, pp_size: 1, pp_rank: 0 }
    }
}

/// Who gave the transfer up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AbortSource {
    /// P's request was aborted or failed (reqs_not_processed).
    Producer,
    /// D cancelled the pull.
    Consumer,
}

/// The transfer will never be written: reply with an error and release.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbortSend {
    pub transfer_id: TransferId,
    pub source: AbortSource,
}

/// The answer to one D request of a pull, as a SendWorker settles it (seed step 30's ok/err entry).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullReply {
    /// The listener's key of the pull ([`ServePull::pull_id`]).
    pub pull_id: u64,
    pub d_req_id: RequestId,
    /// `Ok` when the KV is in D's blocks, with P's digest of each block written (empty unless
    /// `verify_checksums`); `Err` says why not.
    pub result: Result<Vec<u64>, crate::sender_listener::PullErr>,
}

/// SendWorker → SenderListener: what happened to a transfer (steps 30–31).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendOutcome {
    pub transfer_id: TransferId,
    /// The listener's number for the SendWorker that reports (so a late report from a replaced
    /// worker is recognised).
    pub generation: u64,
    /// P's request, once the scheduler has named it (steps 14, 27).
    pub p_req_id: Option<RequestId>,
    /// A settled D request to answer on the side channel; `None` when no pull is answered
    /// (expiry, or ready after D cancelled).
    pub reply: Option<PullReply>,
    /// P's blocks are no longer read by anything: add `p_req_id` to finished_sending (step 31).
    pub counts_as_sent: bool,
    /// The SendWorker has nothing more to do: remove it from the routing table and stop it.
    pub finished: bool,
}
