//! The engine's connector ports ([`pdflow_sim_engine::ports`]) implemented over pdflow's
//! actors: the scheduler role over [`SchedulerConnector`], the worker role over
//! [`SenderListener`] (P) or [`Receiver`] (D). This is where the simulated engine — and, later,
//! vLLM through the Python bridge — meets the actors; it converts and forwards, nothing more.

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::FutureExt;
use kameo::prelude::*;
use pdflow_actors::receiver::Receiver;
use pdflow_actors::scheduler_connector::SchedulerConnector;
use pdflow_actors::sender_listener::SenderListener;
use pdflow_messages::kv_transfer_params::KvTransferParams;
use pdflow_messages::receiver::{GetFinishedRecving, StartLoadKv};
use pdflow_messages::scheduler_connector::{
    BuildConnectorMeta, ConnectorMetadata, ConnectorOutput, GetNumNewMatchedTokens, MatchedTokens, RequestFinished,
    RequestFinishedReply, UpdateConnectorOutput, UpdateStateAfterAlloc,
};
use pdflow_messages::sender_listener::{GetFinishedSending, RecordSendReqs};
use pdflow_sim_engine::ports::{ConnectorError, SchedulerConnectorPort, WorkerConnectorPort};
use tokio::sync::Notify;

fn unavailable(what: &str, e: impl std::fmt::Display) -> ConnectorError {
    ConnectorError::Unavailable(format!("{what}: {e}"))
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
    fn build_connector_meta(&self) -> BoxFuture<'_, Result<ConnectorMetadata, ConnectorError>> {
        async move { self.0.ask(BuildConnectorMeta).await.map_err(|e| unavailable("build_connector_meta", e)) }.boxed()
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

/// P's worker role, over the SenderListener actor (steps 14, 27, 32).
pub struct ProducerWorkerPort {
    pub listener: ActorRef<SenderListener>,
    pub events: Arc<Notify>,
}

impl WorkerConnectorPort for ProducerWorkerPort {
    fn start_load_kv(&self, meta: ConnectorMetadata) -> BoxFuture<'_, Result<(), ConnectorError>> {
        async move {
            if meta.reqs_to_send.is_empty() && meta.reqs_not_processed.is_empty() {
                return Ok(());
            }
            let msg = RecordSendReqs {
                reqs_to_send: meta.reqs_to_send,
                reqs_not_processed: meta.reqs_not_processed,
                traceparents: meta.traceparents,
            };
            self.listener.tell(msg).await.map_err(|e| unavailable("record_send_reqs", e))
        }
        .boxed()
    }
    fn get_finished(&self) -> BoxFuture<'_, Result<ConnectorOutput, ConnectorError>> {
        async move {
            let finished_sending =
                self.listener.ask(GetFinishedSending).await.map_err(|e| unavailable("get_finished", e))?;
            Ok(ConnectorOutput { finished_sending, ..ConnectorOutput::default() })
        }
        .boxed()
    }
    fn kv_events(&self) -> Arc<Notify> {
        self.events.clone()
    }
}

/// D's worker role, over the Receiver actor (steps 19, 35).
pub struct ConsumerWorkerPort {
    pub receiver: ActorRef<Receiver>,
    pub events: Arc<Notify>,
}

impl WorkerConnectorPort for ConsumerWorkerPort {
    fn start_load_kv(&self, meta: ConnectorMetadata) -> BoxFuture<'_, Result<(), ConnectorError>> {
        async move {
            if meta.reqs_to_recv.is_empty() && meta.reqs_to_abort.is_empty() {
                return Ok(());
            }
            let msg = StartLoadKv { reqs_to_recv: meta.reqs_to_recv, reqs_to_abort: meta.reqs_to_abort };
            self.receiver.tell(msg).await.map_err(|e| unavailable("start_load_kv", e))
        }
        .boxed()
    }
    fn get_finished(&self) -> BoxFuture<'_, Result<ConnectorOutput, ConnectorError>> {
        async move { self.receiver.ask(GetFinishedRecving).await.map_err(|e| unavailable("get_finished", e)) }.boxed()
    }
    fn kv_events(&self) -> Arc<Notify> {
        self.events.clone()
    }
}
