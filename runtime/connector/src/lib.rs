//! pdflow-connector — the KV connector contract: the Rust form of vLLM's `KVConnectorBase_V1`
//! scheduler role and worker role, as two ports. An engine knows only these traits: vLLM calls
//! them through the Python bridge, the simulated engine calls them directly. pdflow's node
//! assembly (`pdflow-node`) implements them over the SchedulerConnector actor and the worker-side
//! actors (SenderListener on P, Receiver on D). Owns no seed step: each hook names the steps whose
//! actor it reaches.

use std::sync::Arc;

use futures::future::BoxFuture;
use pdflow_messages::kv_transfer_params::KvTransferParams;
use pdflow_messages::rank_process::RankCallError;
use pdflow_messages::scheduler_connector::{
    BuildConnectorMeta, ConnectorMetadata, ConnectorOutput, GetNumNewMatchedTokens, LayerSave, MatchedTokens,
    RequestFinished, RequestFinishedReply, UpdateStateAfterAlloc,
};
use pdflow_messages::RequestId;
use tokio::sync::Notify;

/// Why a connector call failed. The engine maps each to what vLLM does: an unavailable connector
/// is retried after its supervisor restarts it; a refused call is a configuration error.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ConnectorError {
    /// The actor (or rank process) behind `hook` is gone or did not answer.
    #[error("the KV connector is unavailable: {hook} could not reach {target} ({reason}); its supervisor restarts it")]
    Unavailable { hook: String, target: String, reason: String },
    /// The scheduler asked this worker for the half its `kv_role` does not run.
    #[error(
        "this worker is a {role} but the scheduler asked it to {asked} {count} request(s): \
         the scheduler and worker roles disagree (check kv_role)"
    )]
    RolesDisagree { role: String, asked: String, count: usize },
}

impl ConnectorError {
    /// `hook` could not reach `target`, because of `reason` (a mailbox or socket error).
    pub fn unavailable(hook: &str, target: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        Self::Unavailable { hook: hook.to_owned(), target: target.into(), reason: reason.to_string() }
    }
}

/// A rank process answers a call's failure over its socket as a [`RankCallError`].
impl From<ConnectorError> for RankCallError {
    fn from(e: ConnectorError) -> Self {
        match e {
            ConnectorError::Unavailable { hook, target, reason } => RankCallError::Unavailable { hook, target, reason },
            ConnectorError::RolesDisagree { role, asked, count } => RankCallError::RolesDisagree { role, asked, count },
        }
    }
}

impl From<RankCallError> for ConnectorError {
    fn from(e: RankCallError) -> Self {
        match e {
            RankCallError::Unavailable { hook, target, reason } => ConnectorError::Unavailable { hook, target, reason },
            RankCallError::RolesDisagree { role, asked, count } => ConnectorError::RolesDisagree { role, asked, count },
        }
    }
}

/// The scheduler-role hooks (seed steps 12, 13, 17, 18, 23, 26, 33, 36, 37).
pub trait SchedulerConnectorPort: Send + Sync + 'static {
    fn get_num_new_matched_tokens(
        &self,
        msg: GetNumNewMatchedTokens,
    ) -> BoxFuture<'_, Result<MatchedTokens, ConnectorError>>;
    /// Returns the request's updated `kv_transfer_params` (e.g. `do_remote_prefill` cleared), if changed.
    fn update_state_after_alloc(
        &self,
        msg: UpdateStateAfterAlloc,
    ) -> BoxFuture<'_, Result<Option<KvTransferParams>, ConnectorError>>;
    /// `msg` names what this step's forward computes.
    fn build_connector_meta(&self, msg: BuildConnectorMeta)
        -> BoxFuture<'_, Result<ConnectorMetadata, ConnectorError>>;
    fn request_finished(&self, msg: RequestFinished) -> BoxFuture<'_, Result<RequestFinishedReply, ConnectorError>>;
    fn update_connector_output(&self, output: ConnectorOutput) -> BoxFuture<'_, Result<(), ConnectorError>>;
}

/// The worker-role hooks (seed steps 14, 19, 27, 32, 35).
pub trait WorkerConnectorPort: Send + Sync + 'static {
    /// Hands the step's metadata to the worker side; returns without waiting for transfers.
    fn start_load_kv(&self, meta: ConnectorMetadata) -> BoxFuture<'_, Result<(), ConnectorError>>;
    /// What finished (sent, received, failed) since the last call.
    fn get_finished(&self) -> BoxFuture<'_, Result<ConnectorOutput, ConnectorError>>;
    /// Notified whenever `get_finished` has something new, so an idle engine need not spin.
    fn kv_events(&self) -> Arc<Notify>;
    /// Layer-wise (vLLM's `save_kv_layer`): `layer` of this step's forward is done for the step's
    /// `reqs_to_save`. Called from the forward's thread; never waits.
    fn save_kv_layer(&self, layer: usize, reqs: &std::collections::BTreeMap<RequestId, LayerSave>);
}

/// A connector: both roles, as one engine uses it.
#[derive(Clone)]
pub struct Connector {
    pub scheduler: Arc<dyn SchedulerConnectorPort>,
    pub worker: Arc<dyn WorkerConnectorPort>,
}
