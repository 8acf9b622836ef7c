//! The side channel between D's PullTask (DEALER) and P's SenderListener (ROUTER), steps 21 and 30.
//!
//! D sends a [`SideChannelRequest`]: a [`PullRequest`] naming, per D request, the transfer_id and
//! D's block ids, with D's memory layout (in full the first time, then only its `layout_id` once P
//! has it cached) and the address of D's data server; or an [`AbortPull`] when D gives a request
//! up. P answers each pull with one or more [`PullResponse`]s: `Continue` for a partial result,
//! `Finish` when every request of the pull is accounted for, `Error` when the pull itself is bad.

use serde::{Deserialize, Serialize};

use crate::frame::{self, FrameError};
use crate::kv_groups::GroupBlocks;
use crate::layout::KvLayout;
use crate::{RequestId, TransferId};

/// One D request inside a pull.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullReq {
    pub d_req_id: RequestId,
    pub transfer_id: TransferId,
    /// D's block ids per KV-cache group, in prompt order (where P must write).
    pub block_ids: GroupBlocks,
    /// W3C traceparent of this D request: several requests share one pull, each keeps its trace.
    pub traceparent: Option<String>,
    /// D's write-fence token for this request's blocks (0: none): P names it before the data, and
    /// D's data server writes only while it is open — a write D gave up on never lands.
    pub fence: u64,
    /// The regions of this request's blocks that P may write one-sided, with their keys (empty:
    /// none granted; P writes over the data server).
    pub remote: Vec<crate::rdma::RemoteRegion>,
}

/// D → P: "write these requests' KV into these blocks of mine" (seed step 21).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullRequest {
    /// Unique per D worker; every response echoes it.
    pub pull_id: u64,
    /// D's engine id (for logs and metrics).
    pub engine_id: String,
    /// D's data server, `host:port`, where P's transfer engine connects.
    pub data_addr: String,
    pub tp_size: u32,
    pub tp_rank: u32,
    pub pp_size: u32,
    pub layout_id: u64,
    /// D's full layout; `None` once P has acknowledged `layout_id`.
    pub layout: Option<KvLayout>,
    pub reqs: Vec<PullReq>,
    /// W3C traceparent of the D request that started the pull.
    pub traceparent: Option<String>,
    /// The generation of the P worker D believes it addresses (from bootstrap, or P's last
    /// answer); 0: unknown. A transfer P does not know, in a pull addressed to another
    /// generation, belonged to a previous incarnation of the worker: refused at once
    /// (`StaleGeneration`) instead of waited for.
    pub p_generation: u64,
    /// How long D waits for this pull's answer from when it sends it (its pull deadline), in
    /// milliseconds; 0: no limit. P writes none of D's blocks after that long (less a margin)
    /// from the pull's arrival: past it D gives the blocks up, so a later byte could land in
    /// blocks D reuses (the same-host path has no data-server fence to refuse it).
    pub deadline_ms: u64,
    /// D's pipeline stage (with `tp_rank`, `tp_size` and `pp_size`: where this D worker sits, so
    /// that P plans which of its heads and layers go to it).
    pub pp_rank: u32,
    /// P's engine as D sees it at bootstrap, (tp_size, pp_size): P refuses a pull whose view
    /// differs from its own (D looked P up before every P worker had registered), instead of
    /// writing a share D would take for the whole.
    pub p_world: (u32, u32),
    /// D's RDMA endpoint for this P worker (`None`: D writes are taken over the data server only).
    pub rdma: Option<Box<crate::rdma::RdmaOffer>>,
}

/// D → P: D has given these transfers up (abort, deadline); P must not write them any more.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbortPull {
    pub pull_id: u64,
    pub transfer_ids: Vec<TransferId>,
}

/// The most transfer ids one [`AbortPull`] may name. P refuses a larger abort before decoding it
/// (each id it names may cost P a placeholder SendWorker: one frame naming 20,000 took ~230 MiB),
/// and D sends what it gives up in aborts of at most this many ([`AbortPull::split`]). One pull
/// carries one D step's requests for one P worker, rarely more than vLLM's default `max_num_seqs`
/// (256), so a pull's abort rarely needs a second frame.
pub const MAX_ABORT_IDS: usize = 256;

impl AbortPull {
    /// Aborts of pull `pull_id` naming `transfer_ids`, at most [`MAX_ABORT_IDS`] each, in order
    /// (none for no ids).
    pub fn split(pull_id: u64, transfer_ids: Vec<TransferId>) -> Vec<AbortPull> {
        transfer_ids.chunks(MAX_ABORT_IDS).map(|ids| AbortPull { pull_id, transfer_ids: ids.to_vec() }).collect()
    }
}

/// Everything D may send on the side channel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SideChannelRequest {
    Pull(PullRequest),
    Abort(AbortPull),
}

/// Why a side-channel frame is not a request P serves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error(
        "an abort names {count} transfer ids, more than the {MAX_ABORT_IDS} one frame may: send them in several \
         aborts (pdflow's D does)"
    )]
    TooManyIds { count: u64 },
}

impl SideChannelRequest {
    /// Decodes a side-channel frame; an abort naming more than [`MAX_ABORT_IDS`] ids is refused
    /// from its header, before any id is decoded.
    pub fn decode(bytes: &[u8]) -> Result<Self, RequestError> {
        if let Some(count) = abort_len(bytes).filter(|&n| n > MAX_ABORT_IDS as u64) {
            return Err(RequestError::TooManyIds { count });
        }
        Ok(frame::decode(bytes, "side-channel request")?)
    }
}

/// How many transfer ids an encoded [`SideChannelRequest::Abort`] names, read from its first bytes
/// (postcard: the variant's index, the pull id, then the ids' count, each a varint); `None` for
/// anything else.
fn abort_len(bytes: &[u8]) -> Option<u64> {
    const ABORT_VARIANT: u64 = 1;
    let body = bytes.strip_prefix(&frame::MAGIC)?.strip_prefix(&[frame::VERSION])?;
    let (variant, rest) = varint(body)?;
    if variant != ABORT_VARIANT {
        return None;
    }
    let (_pull_id, rest) = varint(rest)?;
    varint(rest).map(|(count, _)| count)
}

/// A postcard varint (LEB128, at most 10 bytes) and what follows it.
fn varint(bytes: &[u8]) -> Option<(u64, &[u8])> {
    let mut value = 0u64;
    for (i, byte) in bytes.iter().take(10).enumerate() {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((value, &bytes[i + 1..]));
        }
    }
    None
}

/// The status of one response (vLLM's MooncakeXferResponse statuses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PullStatus {
    /// Some requests are settled; more responses follow for this pull.
    Continue,
    /// Every request of the pull is settled; this is the last response.
    Finish,
    /// The pull itself could not be served (bad frame, unknown layout…); see `error`.
    Error,
}

/// Why one request of a pull was not written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum PullErrorCause {
    /// P's prefill request was aborted or failed; its KV will never exist.
    Aborted,
    /// P waited for the request's prefill past its deadline.
    ReadyTimeout,
    /// P's and D's block counts or layouts do not match.
    LayoutMismatch,
    /// The write into D's memory failed.
    TransferFailed,
    /// P does not know D's `layout_id`: resend the pull with the full layout.
    UnknownLayout,
    /// D aborted the transfer itself.
    CancelledByPeer,
    /// P no longer holds this transfer's KV: it was sent already, or D's pull came after P's
    /// send expiry (negative acknowledgement, instead of a wait for ready).
    Expired,
    /// The pull addressed a previous generation of this P worker (it restarted) and the transfer
    /// is unknown to the current one: its KV went with the previous incarnation.
    StaleGeneration,
}

impl PullErrorCause {
    /// A short fixed name (a metric label, a span outcome).
    pub fn label(&self) -> &'static str {
        match self {
            PullErrorCause::Aborted => "aborted",
            PullErrorCause::ReadyTimeout => "ready_timeout",
            PullErrorCause::LayoutMismatch => "layout_mismatch",
            PullErrorCause::TransferFailed => "transfer_failed",
            PullErrorCause::UnknownLayout => "unknown_layout",
            PullErrorCause::CancelledByPeer => "cancelled_by_peer",
            PullErrorCause::Expired => "expired",
            PullErrorCause::StaleGeneration => "stale_generation",
        }
    }
}

/// One failed request of a pull.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullErr {
    pub d_req_id: RequestId,
    pub cause: PullErrorCause,
    pub detail: String,
}

/// P's digest of each block it wrote for one D request (with `verify_checksums`), in the order
/// of the pull's `block_ids`: D checks its blocks against them before it reports the load done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockDigests {
    pub d_req_id: RequestId,
    pub digests: Vec<u64>,
}

/// P → D (seed step 30).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullResponse {
    pub pull_id: u64,
    pub status: PullStatus,
    pub ok_reqs: Vec<RequestId>,
    /// P's block digests of `ok_reqs` (those P computed: with `verify_checksums`).
    pub digests: Vec<BlockDigests>,
    pub err_reqs: Vec<PullErr>,
    /// The layout P now has cached for D (so D may omit it next time).
    pub layout_id: Option<u64>,
    /// Set with `PullStatus::Error`.
    pub error: Option<String>,
    /// The answering P worker's generation (0: not known), so that D addresses it from now on.
    pub p_generation: u64,
}

impl PullResponse {
    /// A response that fails the whole pull.
    pub fn error(pull_id: u64, error: impl Into<String>) -> Self {
        Self {
            pull_id,
            status: PullStatus::Error,
            ok_reqs: vec![],
            digests: vec![],
            err_reqs: vec![],
            layout_id: None,
            error: Some(error.into()),
            p_generation: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame;

    #[test]
    fn pull_round_trips_as_a_frame() {
        let pull = SideChannelRequest::Pull(PullRequest {
            pull_id: 1,
            engine_id: "d".into(),
            data_addr: "127.0.0.1:9".into(),
            tp_size: 1,
            tp_rank: 0,
            pp_size: 1,
            layout_id: 5,
            layout: None,
            reqs: vec![PullReq {
                d_req_id: "cmpl-d".into(),
                transfer_id: "xfer-1".into(),
                block_ids: (512..575).collect(),
                traceparent: None,
                fence: 9,
                remote: Vec::new(),
            }],
            traceparent: None,
            p_generation: 3,
            deadline_ms: 35_000,
            pp_rank: 0,
            p_world: (1, 1),
            rdma: None,
        });
        let bytes = frame::encode(&pull).expect("encodes");
        assert_eq!(frame::decode::<SideChannelRequest>(&bytes, "side-channel request"), Ok(pull));
        assert!(frame::decode::<SideChannelRequest>(b"PDFL\x02\xff\xff", "side-channel request").is_err());
    }

    fn abort(n: usize) -> Vec<TransferId> {
        (0..n).map(|i| TransferId::from(format!("xfer-{i}"))).collect()
    }

    #[test]
    fn an_abort_over_the_id_cap_is_refused_from_its_header_and_split_ones_pass() {
        let ids = abort(MAX_ABORT_IDS + 1);
        let big = frame::encode(&SideChannelRequest::Abort(AbortPull { pull_id: u64::MAX, transfer_ids: ids.clone() }))
            .expect("encodes");
        assert_eq!(SideChannelRequest::decode(&big), Err(RequestError::TooManyIds { count: MAX_ABORT_IDS as u64 + 1 }));
        let parts = AbortPull::split(7, ids.clone());
        assert_eq!(parts.iter().map(|a| a.transfer_ids.len()).collect::<Vec<_>>(), vec![MAX_ABORT_IDS, 1]);
        assert_eq!(parts.iter().flat_map(|a| a.transfer_ids.clone()).collect::<Vec<_>>(), ids);
        for part in parts {
            let bytes = frame::encode(&SideChannelRequest::Abort(part.clone())).expect("encodes");
            assert_eq!(SideChannelRequest::decode(&bytes), Ok(SideChannelRequest::Abort(part)));
        }
        assert!(AbortPull::split(7, vec![]).is_empty());
        // A header cut short is not an abort's count: the frame decoder reports it.
        assert!(matches!(SideChannelRequest::decode(&big[..7]), Err(RequestError::Frame(_))));
    }

    /// The largest pull D could send fits the frame cap with room to spare: 1,024 requests (four
    /// times vLLM's default `max_num_seqs`) sharing 262,144 distinct blocks (a 1B model's KV on
    /// one H200) in three KV-cache groups, each with a traceparent, and a full 512-region layout.
    #[test]
    fn the_largest_pull_is_a_small_fraction_of_the_frame_cap() {
        use crate::kv_groups::BlockSpan;
        use crate::layout::RegionDesc;
        let reqs = (0..1024u32)
            .map(|r| PullReq {
                d_req_id: format!("cmpl-{r:032x}-0").into(),
                transfer_id: format!("xfer-{r:032x}").into(),
                block_ids: GroupBlocks(
                    (0..3)
                        .map(|g| BlockSpan {
                            first: Some(0),
                            ids: (0..256).filter(|b| b % 3 == g).map(|b| r * 256 + b + 200_000).collect(),
                        })
                        .collect(),
                ),
                traceparent: Some(format!("00-{r:032x}-{r:016x}-01")),
                fence: u64::MAX,
                remote: Vec::new(),
            })
            .collect();
        let pull = SideChannelRequest::Pull(PullRequest {
            pull_id: u64::MAX,
            engine_id: "d".repeat(64),
            data_addr: "255.255.255.255:65535".into(),
            tp_size: 8,
            tp_rank: 7,
            pp_size: 8,
            layout_id: u64::MAX,
            layout: Some(KvLayout {
                layout_id: u64::MAX,
                regions: vec![RegionDesc { base_addr: u64::MAX, len: u64::MAX, block_len: u64::MAX }; 512],
            }),
            reqs,
            traceparent: Some("00-0123456789abcdef0123456789abcdef-0123456789abcdef-01".into()),
            p_generation: u64::MAX,
            deadline_ms: u64::MAX,
            pp_rank: 7,
            p_world: (8, 8),
            rdma: None,
        });
        let len = frame::encode(&pull).expect("encodes").len();
        eprintln!("largest pull: {len} bytes");
        assert!(len < frame::MAX_FRAME_LEN / 4, "{len} bytes");
    }
}

/// Steps 14 and 27: the worker-side connector hands over the step's `reqs_to_send` and
/// `reqs_not_processed` (from [`crate::scheduler_connector::ConnectorMetadata`]).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RecordSendReqs {
    pub reqs_to_send: std::collections::BTreeMap<RequestId, (TransferId, GroupBlocks)>,
    pub reqs_not_processed: std::collections::BTreeSet<TransferId>,
    pub traceparents: std::collections::BTreeMap<RequestId, String>,
}

/// Step 29, layer-wise: layer `layer` of this step's forward is done (vLLM's `save_kv_layer`) for
/// every request of the step's `reqs_to_save`; their SendWorkers write it to D if D has pulled.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LayerSaved {
    pub layer: usize,
    pub reqs: std::collections::BTreeMap<RequestId, crate::scheduler_connector::LayerSave>,
}

/// Step 32: the worker collects the P requests whose KV was sent since the last call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct GetFinishedSending;

/// Asks P's SenderListener for its side-channel address, `tcp://host:port` (what step 4 registers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SideChannelAddr;

/// Asks P's SenderListener how many side-channel pulls are still waiting for their last response
/// (for metrics, health and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct InFlightPulls;
