//! The two ports through which the simulated engine calls a KV connector — the Rust form of
//! vLLM's `KVConnectorBase_V1` scheduler role and worker role. The engine knows only these
//! traits; pdflow's node assembly implements them over the SchedulerConnector actor and the
//! worker-side actors (SenderListener on P, Receiver on D).

use std::sync::Arc;

use futures::future::BoxFuture;
use pdflow_messages::kv_transfer_params::KvTransferParams;
use pdflow_messages::scheduler_connector::{
    BuildConnectorMeta, ConnectorMetadata, ConnectorOutput, GetNumNewMatchedTokens, LayerSave, MatchedTokens,
    RequestFinished, RequestFinishedReply, UpdateStateAfterAlloc,
};
use pdflow_messages::RequestId;
use tokio::sync::Notify;

/// Why a connector call failed (the connector's actor is gone, or it refused the call).
#[derive(Debug, Clone, thiserror::Error)]
pub enum ConnectorError {
    #[error("the KV connector is unavailable ({0}); the node's supervisor restarts it")]
    Unavailable(String),
    #[error("the KV connector refused the request: {0}")]
    Refused(String),
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
