//! The connector contract's ports ([`pdflow_connector`]) implemented over pdflow's
//! actors: the scheduler role over [`SchedulerConnector`], the worker role over
//! [`SenderListener`] (P), [`Receiver`] (D) or both (kv_both). This is where an engine — vLLM through the Python
//! bridge, or the simulated engine — meets the actors; it converts and forwards, nothing more.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::FutureExt;
use kameo::prelude::*;
use pdflow_actors::receiver::Receiver;
use pdflow_actors::scheduler_connector::SchedulerConnector;
use pdflow_actors::sender_listener::SenderListener;
pub use pdflow_connector::{ConnectorError, SchedulerConnectorPort, WorkerConnectorPort};
use pdflow_messages::kv_transfer_params::KvTransferParams;
use pdflow_messages::receiver::{GetFinishedRecving, StartLoadKv};
use pdflow_messages::scheduler_connector::{
    BuildConnectorMeta, ConnectorMetadata, ConnectorOutput, GetNumNewMatchedTokens, LayerSave, MatchedTokens,
    RequestFinished, RequestFinishedReply, UpdateConnectorOutput, UpdateStateAfterAlloc,
};
use pdflow_messages::sender_listener::{GetFinishedSending, LayerSaved, RecordSendReqs};
use pdflow_messages::RequestId;
use tokio::sync::Notify;

use crate::held_sends::HeldSends;

fn unavailable(what: &str, e: impl std::fmt::Display) -> ConnectorError {
    ConnectorError::unavailable(what, "its actor", e)
}

/// The scheduler role, over the SchedulerConnector actor.
pub struct SchedulerPort(pub ActorRef<SchedulerConnector>);

impl SchedulerConnectorPort for SchedulerPort {
    fn get_num_new_matched_tokens(
        &self,
        msg: GetNumNewMatchedTokens,
    ) -> BoxFuture<'_, Result<MatchedTokens, ConnectorError>> {
        async move { self.0.ask(msg).await.map_err(|e| unavailable("get_num_new_matched_tokens", e)) }.boxed()
    }
    fn update_state_after_alloc(
        &self,
        msg: UpdateStateAfterAlloc,
    ) -> BoxFuture<'_, Result<Option<KvTransferParams>, ConnectorError>> {
        async move { self.0.ask(msg).await.map_err(|e| unavailable("update_state_after_alloc", e)) }.boxed()
    }
    fn build_connector_meta(
        &self,
        msg: BuildConnectorMeta,
    ) -> BoxFuture<'_, Result<ConnectorMetadata, ConnectorError>> {
        async move { self.0.ask(msg).await.map_err(|e| unavailable("build_connector_meta", e)) }.boxed()
    }
    fn request_finished(&self, msg: RequestFinished) -> BoxFuture<'_, Result<RequestFinishedReply, ConnectorError>> {
        async move { self.0.ask(msg).await.map_err(|e| unavailable("request_finished", e)) }.boxed()
    }
    fn update_connector_output(&self, output: ConnectorOutput) -> BoxFuture<'_, Result<(), ConnectorError>> {
        async move {
            self.0.ask(UpdateConnectorOutput { output }).await.map_err(|e| unavailable("update_connector_output", e))
        }
        .boxed()
    }
}

/// The worker role over the worker's actors: P's SenderListener (steps 14, 27, 32), D's Receiver
/// (steps 19, 35), both for `kv_both`.
pub struct WorkerPort {
    pub listener: Option<ActorRef<SenderListener>>,
    pub receiver: Option<ActorRef<Receiver>>,
    pub events: Arc<Notify>,
    /// P's backstop for blocks held for a send ([`HeldSends`]); `None` without one.
    pub held_sends: Option<Arc<HeldSends>>,
}

impl WorkerConnectorPort for WorkerPort {
    fn start_load_kv(&self, meta: ConnectorMetadata) -> BoxFuture<'_, Result<(), ConnectorError>> {
        async move {
            let ConnectorMetadata {
                reqs_to_recv, reqs_to_abort, reqs_to_send, reqs_not_processed, traceparents, ..
            } = meta;
            // `reqs_to_save` is the forward's: the engine hands it to `save_kv_layer`.
            // A half this worker does not run has nothing to free or cancel; asked to send or load,
            // the roles disagree.
            if let Some(listener) = &self.listener {
                if let Some(held) = &self.held_sends {
                    held.held(reqs_to_send.iter().filter(|(_, (_, blocks))| !blocks.is_empty()).map(|(r, _)| r));
                }
                if !reqs_to_send.is_empty() || !reqs_not_processed.is_empty() {
                    let msg = RecordSendReqs { reqs_to_send, reqs_not_processed, traceparents };
                    listener.tell(msg).await.map_err(|e| unavailable("record_send_reqs", e))?;
                }
            } else if !reqs_to_send.is_empty() {
                return Err(roles_disagree("send the KV of", reqs_to_send.len(), "kv_consumer"));
            }
            if let Some(receiver) = &self.receiver {
                if !reqs_to_recv.is_empty() || !reqs_to_abort.is_empty() {
                    let msg = StartLoadKv { reqs_to_recv, reqs_to_abort };
                    receiver.tell(msg).await.map_err(|e| unavailable("start_load_kv", e))?;
                }
            } else if !reqs_to_recv.is_empty() {
                let pulls = reqs_to_recv.values().map(|m| m.len()).sum();
                return Err(roles_disagree("load from remote engines", pulls, "kv_producer"));
            }
            Ok(())
        }
        .boxed()
    }

    fn get_finished(&self) -> BoxFuture<'_, Result<ConnectorOutput, ConnectorError>> {
        async move {
            let mut output = match &self.receiver {
                Some(r) => r.ask(GetFinishedRecving).await.map_err(|e| unavailable("get_finished", e))?,
                None => ConnectorOutput::default(),
            };
            if let Some(l) = &self.listener {
                output.finished_sending =
                    l.ask(GetFinishedSending).await.map_err(|e| unavailable("get_finished", e))?;
            }
            if let Some(held) = &self.held_sends {
                held.settle(&mut output.finished_sending);
            }
            Ok(output)
        }
        .boxed()
    }

    fn kv_events(&self) -> Arc<Notify> {
        self.events.clone()
    }

    fn save_kv_layer(&self, layer: usize, reqs: &BTreeMap<RequestId, LayerSave>) {
        let Some(listener) = &self.listener else { return };
        if reqs.is_empty() {
            return;
        }
        // Never waits (the forward calls this): with the mailbox full the event is dropped, which
        // only delays that layer's write to its next chunk, or to ready, which writes the rest.
        if let Err(e) = listener.tell(LayerSaved { layer, reqs: reqs.clone() }).try_send() {
            tracing::debug!(layer, error = %e, "layer-wise save not handed to the sender listener");
        }
    }
}

/// The scheduler asked a worker for what its role does not do.
fn roles_disagree(what: &str, count: usize, role: &str) -> ConnectorError {
    ConnectorError::RolesDisagree { role: role.to_owned(), asked: what.to_owned(), count }
}
