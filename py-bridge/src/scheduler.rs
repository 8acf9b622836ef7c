//! `pdflow._native.SchedulerConnector` — the scheduler role of `PdflowConnector`: each vLLM
//! scheduler hook becomes one `ask` to pdflow's SchedulerConnector actor (seed steps 12–13, 17–18,
//! 23, 26, 32–33, 35–37), with the GIL released while the actor works.
//!
//! The actor lives under its own node supervisor on a current-thread runtime that the calling
//! thread drives (see `runtime`). Metadata leaves as one postcard frame (`bytes`): vLLM pickles the
//! Python metadata object that carries it to the workers.

use std::time::Duration;

use kameo::prelude::*;
use kameo::supervision::RestartPolicy;
use pdflow_actors::scheduler_connector::{KvRole, SchedulerConnector, SchedulerConnectorArgs};
use pdflow_messages::frame;
use pdflow_messages::scheduler_connector::{
    BuildConnectorMeta, ConnectorOutput, FinishStatus, GetNumNewMatchedTokens, LoadFailure, LoadFailureCause,
    OnNewRequest, RequestFinished, ScheduledChunk, UpdateConnectorOutput, UpdateStateAfterAlloc,
};
use pdflow_messages::BlockId;
use pdflow_node::supervisor::{NodeSupervisor, MAX_RESTARTS, RESTART_WINDOW};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::config::{BridgeConfig, ConfigError};
use crate::convert::{json_to_py, sched_request};
use crate::error::{BridgeError, MetadataError};
use crate::runtime::BridgeRuntime;

/// Longest a hook may wait for the actor (it answers in microseconds; this only bounds a fault).
const HOOK_DEADLINE: Duration = Duration::from_secs(10);

/// vLLM's `kv_role` string.
pub fn parse_role(kv_role: &str) -> Result<KvRole, ConfigError> {
    match kv_role {
        "kv_producer" => Ok(KvRole::Producer),
        "kv_consumer" => Ok(KvRole::Consumer),
        "kv_both" => Ok(KvRole::Both),
        other => Err(ConfigError::Role { value: other.to_string() }),
    }
}

/// vLLM's `RequestStatus` name of a finished request.
fn finish_status(name: &str) -> FinishStatus {
    match name {
        "FINISHED_LENGTH_CAPPED" => FinishStatus::LengthCapped,
        "FINISHED_STOPPED" | "FINISHED_REPETITION" => FinishStatus::Stopped,
        "FINISHED_ABORTED" => FinishStatus::Aborted,
        // FINISHED_IGNORED, FINISHED_ERROR and anything newer: no KV worth sending.
        _ => FinishStatus::Error,
    }
}

/// The scheduler role.
#[pyclass(module = "pdflow._native", name = "SchedulerConnector", frozen)]
pub struct SchedulerBridge {
    rt: BridgeRuntime,
    actor: ActorRef<SchedulerConnector>,
    supervisor: ActorRef<NodeSupervisor>,
    #[pyo3(get)]
    engine_id: String,
}

impl SchedulerBridge {
    fn ask<M, R>(&self, what: &'static str, msg: M) -> Result<R, BridgeError>
    where
        SchedulerConnector: Message<M, Reply = Result<R, pdflow_actors::ActorError>>,
        M: Send + 'static,
        R: Send + 'static,
    {
        self.rt
            .block_on(async { tokio::time::timeout(HOOK_DEADLINE, self.actor.ask(msg)).await })?
            .map_err(|_| BridgeError::unavailable(what, format!("no answer within {HOOK_DEADLINE:?}")))?
            .map_err(|e| BridgeError::unavailable(what, e))
    }
}

#[pymethods]
impl SchedulerBridge {
    #[new]
    #[pyo3(signature = (engine_id, kv_role, extra_config_json = ""))]
    fn new(py: Python<'_>, engine_id: String, kv_role: &str, extra_config_json: &str) -> PyResult<Self> {
        let role = parse_role(kv_role)?;
        let config = BridgeConfig::from_json(extra_config_json, &|k| std::env::var(k).ok())?;
        let bootstrap_addr = matches!(role, KvRole::Producer | KvRole::Both).then(|| config.bootstrap_addr());
        py.detach(|| {
            let rt = BridgeRuntime::current_thread()?;
            let (supervisor, actor) = rt.block_on(async {
                let supervisor = NodeSupervisor::spawn(format!("vllm-scheduler-{engine_id}"));
                let actor = SchedulerConnector::supervise(
                    &supervisor,
                    SchedulerConnectorArgs {
                        engine_id: engine_id.clone().into(),
                        role,
                        bootstrap_addr,
                        layerwise: config.layerwise,
                    },
                )
                .restart_policy(RestartPolicy::Transient)
                .restart_limit(MAX_RESTARTS, RESTART_WINDOW)
                .spawn()
                .await;
                actor.wait_for_startup().await;
                (supervisor, actor)
            })?;
            Ok::<_, BridgeError>(Self { rt, actor, supervisor, engine_id })
        })
        .map_err(PyErr::from)
    }

    /// Step 17: `(count, load_async)` — a D request loads `prompt − computed` tokens from P.
    #[pyo3(signature = (request_id, num_prompt_tokens, num_computed_tokens, kv_transfer_params))]
    fn get_num_new_matched_tokens(
        &self,
        py: Python<'_>,
        request_id: String,
        num_prompt_tokens: usize,
        num_computed_tokens: usize,
        kv_transfer_params: Option<Bound<'_, PyDict>>,
    ) -> PyResult<(usize, bool)> {
        let request = sched_request(request_id, num_prompt_tokens, kv_transfer_params.as_ref())?;
        let m = py.detach(|| {
            self.ask("get_num_new_matched_tokens", GetNumNewMatchedTokens { request, num_computed_tokens })
        })?;
        Ok((m.count, m.load_async))
    }

    /// Steps 11 and 16: a request arrived; returns why its `kv_transfer_params` cannot be served
    /// here (it then runs locally), or None when they can (or it carries none).
    #[pyo3(signature = (request_id, num_prompt_tokens, kv_transfer_params))]
    fn on_new_request(
        &self,
        py: Python<'_>,
        request_id: String,
        num_prompt_tokens: usize,
        kv_transfer_params: Option<Bound<'_, PyDict>>,
    ) -> PyResult<Option<String>> {
        if kv_transfer_params.is_none() {
            return Ok(None);
        }
        let request = sched_request(request_id, num_prompt_tokens, kv_transfer_params.as_ref())?;
        Ok(py.detach(|| self.ask("on_new_request", OnNewRequest { request }))?)
    }

    /// Steps 12 and 17. Returns True when the caller must set `do_remote_prefill = False` in the
    /// request's dict (the pull is recorded once; the second call after the load finds it false).
    #[pyo3(signature = (request_id, num_prompt_tokens, kv_transfer_params, block_ids, num_external_tokens))]
    fn update_state_after_alloc(
        &self,
        py: Python<'_>,
        request_id: String,
        num_prompt_tokens: usize,
        kv_transfer_params: Option<Bound<'_, PyDict>>,
        block_ids: Vec<BlockId>,
        num_external_tokens: usize,
    ) -> PyResult<bool> {
        let request = sched_request(request_id, num_prompt_tokens, kv_transfer_params.as_ref())?;
        let was_set = request.kv_transfer_params.as_ref().is_some_and(|p| p.do_remote_prefill);
        let updated = py.detach(|| {
            self.ask("update_state_after_alloc", UpdateStateAfterAlloc { request, block_ids, num_external_tokens })
        })?;
        Ok(was_set && updated.is_some_and(|p| !p.do_remote_prefill))
    }

    /// Steps 13, 18, 26: this step's metadata as a frame, or None when the workers have nothing to do.
    /// `scheduled` (layer-wise P): `(request id, block ids, tokens computed after this step)` of
    /// every request the step computes.
    #[pyo3(signature = (scheduled=None))]
    fn build_connector_meta<'py>(
        &self,
        py: Python<'py>,
        scheduled: Option<Vec<(String, Vec<BlockId>, usize)>>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let scheduled = scheduled
            .unwrap_or_default()
            .into_iter()
            .map(|(id, block_ids, computed_upto)| ScheduledChunk { request_id: id.into(), block_ids, computed_upto })
            .collect();
        let meta = py.detach(|| self.ask("build_connector_meta", BuildConnectorMeta { scheduled }))?;
        if meta.is_empty() {
            return Ok(None);
        }
        let bytes = frame::encode(&meta).map_err(BridgeError::from)?;
        Ok(Some(PyBytes::new(py, &bytes)))
    }

    /// Steps 23 and 41: `(delay_free_blocks, kv_transfer_params)`. `status` is vLLM's
    /// `RequestStatus` name (`FINISHED_LENGTH_CAPPED`, `FINISHED_STOPPED`, `FINISHED_ABORTED`, …).
    #[pyo3(signature = (request_id, num_prompt_tokens, kv_transfer_params, status, block_ids))]
    fn request_finished<'py>(
        &self,
        py: Python<'py>,
        request_id: String,
        num_prompt_tokens: usize,
        kv_transfer_params: Option<Bound<'py, PyDict>>,
        status: &str,
        block_ids: Vec<BlockId>,
    ) -> PyResult<(bool, Option<Bound<'py, PyAny>>)> {
        let request = sched_request(request_id, num_prompt_tokens, kv_transfer_params.as_ref())?;
        let status = finish_status(status);
        let reply = py.detach(|| self.ask("request_finished", RequestFinished { request, status, block_ids }))?;
        let params = match reply.kv_transfer_params {
            Some(p) => {
                let v = serde_json::to_value(&p).map_err(|e| BridgeError::Metadata(MetadataError::Json(e)))?;
                Some(json_to_py(py, &v)?)
            }
            None => None,
        };
        Ok((reply.delay_free_blocks, params))
    }

    /// Steps 32–33 and 35–36: the workers' output of one step. A failed receive appears both in
    /// `finished_recving` (vLLM's rule) and in `failed_recving`; the actor hears it as failed only.
    #[pyo3(signature = (finished_sending=None, finished_recving=None, failed_recving=None))]
    fn update_connector_output(
        &self,
        py: Python<'_>,
        finished_sending: Option<Vec<String>>,
        finished_recving: Option<Vec<String>>,
        failed_recving: Option<Vec<String>>,
    ) -> PyResult<()> {
        let mut output = ConnectorOutput::default();
        let failed: std::collections::BTreeSet<String> = failed_recving.unwrap_or_default().into_iter().collect();
        output.finished_sending.extend(finished_sending.unwrap_or_default().into_iter().map(Into::into));
        output
            .finished_recving
            .extend(finished_recving.unwrap_or_default().into_iter().filter(|r| !failed.contains(r)).map(Into::into));
        output.failed_recving.extend(
            failed
                .into_iter()
                .map(|r| (r.into(), LoadFailure::new(LoadFailureCause::ReportedByWorker, "the KV load failed"))),
        );
        if output.is_empty() {
            return Ok(());
        }
        py.detach(|| self.ask("update_connector_output", UpdateConnectorOutput { output }))?;
        Ok(())
    }

    /// Stops the actor and its supervisor (bounded).
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        if !self.rt.is_local() {
            return Ok(());
        }
        py.detach(|| {
            self.rt.block_on(async {
                let _ = self.supervisor.stop_gracefully().await;
                let _ = tokio::time::timeout(Duration::from_secs(5), self.supervisor.wait_for_shutdown()).await;
            })
        })?;
        Ok(())
    }
}
