//! Attribute keys of step spans (constants, never string literals in actors).

pub const STEP: &str = "pd.step";
pub const REQUEST_ID: &str = "pd.request_id";
pub const TRANSFER_ID: &str = "pd.transfer_id";
pub const ENGINE_ID: &str = "pd.engine_id";
pub const BLOCKS: &str = "pd.blocks";
pub const BYTES: &str = "pd.bytes";
pub const DESCRIPTORS: &str = "pd.descriptors";
pub const TOKENS: &str = "pd.tokens";
pub const OUTCOME: &str = "pd.outcome";
pub const TRACEPARENT: &str = "pd.traceparent";
pub const KV_CHECKSUM: &str = "pd.kv_checksum";
pub const BACKEND: &str = "pd.backend";
/// Step 29 with `backend=rdma`: the libfabric provider that carried the one-sided writes.
pub const PROVIDER: &str = "pd.provider";
/// Step 8 only: the span id of the client's own span, when the client sent a traceparent.
pub const CLIENT_PARENT: &str = "pd.client_parent";
/// Steps 28 and 29 across ranks: this P worker's tensor rank and pipeline stage, and the pulling D
/// worker's (who wrote what).
pub const TP_RANK: &str = "pd.tp_rank";
pub const PP_RANK: &str = "pd.pp_rank";
pub const REMOTE_TP_RANK: &str = "pd.remote_tp_rank";
pub const REMOTE_PP_RANK: &str = "pd.remote_pp_rank";
/// Steps 28, 29 and 34 of a hybrid model (more than one KV-cache group): the blocks, and bytes,
/// each group moved, in the groups' order (`"12,4,1"`).
pub const GROUP_BLOCKS: &str = "pd.group_blocks";
pub const GROUP_BYTES: &str = "pd.group_bytes";
/// Step 8: the proxy's routing decision, `prefill=<policy>:<choice>[:<chunks>] decode=…`.
pub const ROUTE: &str = "pd.route";
