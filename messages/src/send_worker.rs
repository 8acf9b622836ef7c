//! Messages to P's per-transfer SendWorker (steps 14, 22, 27–29, 31).
//!
//! The SenderListener routes to one SendWorker per transfer_id: the scheduler's record of the
//! request ([`RecordSendPending`], step 14, then [`RecordSendReady`], step 27), and D's pull for it
//! ([`ServePull`], step 22). [`AbortSend`] ends a transfer that will never have KV.

use serde::{Deserialize, Serialize};

use crate::layout::KvLayout;
use crate::{BlockId, RequestId, TransferId};

/// Step 14: P's request started; its blocks are not final yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordSendPending {
    pub p_req_id: RequestId,
    pub transfer_id: TransferId,
}

/// Step 27: P's request finished; these blocks hold its prompt's KV: set `ready`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordSendReady {
    pub p_req_id: RequestId,
    pub transfer_id: TransferId,
    pub block_ids: Vec<BlockId>,
}

/// Step 22: D asks for this transfer to be written into its blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServePull {
    pub pull_id: u64,
    pub d_req_id: RequestId,
    pub transfer_id: TransferId,
    pub block_ids: Vec<BlockId>,
    pub data_addr: String,
    pub layout: KvLayout,
    pub traceparent: Option<String>,
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
