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
use pdflow_actors::scheduler_connector::{prefill_backoff, KvRole, SchedulerConnector, SchedulerConnectorArgs};
use pdflow_messages::frame;
use pdflow_messages::kv_groups::{BlockSpan, GroupBlocks, KvGroupKind, KvGroupSpec};
use pdflow_messages::scheduler_connector::{
    BuildConnectorMeta, ConnectorOutput, FinishStatus, GetNumNewMatchedTokens, LoadFailure, LoadFailureCause,
    OnNewRequest, PromptBlockHashes, RequestFinished, ScheduledChunk, UpdateConnectorOutput, UpdateStateAfterAlloc,
};
use pdflow_messages::BlockId;
use pdflow_node::supervisor::{NodeSupervisor, MAX_RESTARTS, RESTART_WINDOW};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::config::{BridgeConfig, ConfigError};
use crate::convert::{json_to_py, sched_request};
use crate::error::{BridgeError, MetadataError};
use crate::runtime::BridgeRuntime;

/// vLLM's null block: the block pool's first, which a sliding window's freed positions point at.
const VLLM_NULL_BLOCK: BlockId = 0;

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

/// Block ids as the Python side gives them: a flat list (one group of full attention, ending
/// where the prompt ends) or one `(first block index or None, ids)` span per KV-cache group.
#[derive(FromPyObject)]
pub enum BlockIdsArg {
    Flat(Vec<BlockId>),
    Spans(Vec<(Option<u32>, Vec<BlockId>)>),
}

impl From<BlockIdsArg> for GroupBlocks {
    fn from(arg: BlockIdsArg) -> Self {
        match arg {
            BlockIdsArg::Flat(ids) => GroupBlocks::from(ids),
            BlockIdsArg::Spans(spans) => {
                GroupBlocks(spans.into_iter().map(|(first, ids)| BlockSpan { first, ids }).collect())
            }
        }
    }
}

/// vLLM's KV-cache groups as `(kind, block_size, sliding_window)`, kind one of `full`,
/// `sliding_window`, `state`.
fn group_specs(groups: Vec<(String, u32, u32)>) -> Result<Vec<KvGroupSpec>, ConfigError> {
    groups
        .into_iter()
        .map(|(kind, block_size, window)| {
            let kind = match kind.as_str() {
                "full" => KvGroupKind::FullAttention,
                "sliding_window" if window > 0 => KvGroupKind::SlidingWindow { window },
                "state" => KvGroupKind::State,
                _ => return Err(ConfigError::KvGroup { kind, window }),
            };
            Ok(KvGroupSpec { kind, block_size })
        })
        .collect()
}

/// The scheduler role.
#[pyclass(module = "pdflow._native", name = "SchedulerConnector", frozen)]
pub struct SchedulerBridge {
    rt: BridgeRuntime,
    actor: ActorRef<SchedulerConnector>,
    supervisor: ActorRef<NodeSupervisor>,
    #[pyo3(get)]
    engine_id: String,
    /// Trailing prompt tokens a P request of this model leaves to D.
    backoff: usize,
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
    /// `kv_groups`: the model's KV-cache groups (see [`group_specs`]); None: one group of full
    /// attention. With groups, vLLM's null block (0) marks a block a sliding window freed.
    #[pyo3(signature = (engine_id, kv_role, extra_config_json = "", kv_groups = None))]
    fn new(
        py: Python<'_>,
        engine_id: String,
        kv_role: &str,
        extra_config_json: &str,
        kv_groups: Option<Vec<(String, u32, u32)>>,
    ) -> PyResult<Self> {
        let role = parse_role(kv_role)?;
        let null_block = kv_groups.is_some().then_some(VLLM_NULL_BLOCK);
        let groups = group_specs(kv_groups.unwrap_or_default())?;
        let backoff = prefill_backoff(&groups);
        let config = BridgeConfig::from_json(extra_config_json, &|k| std::env::var(k).ok())?;
        config.check_role(role)?;
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
                        groups,
                        null_block,
                    },
                )
                .restart_policy(RestartPolicy::Transient)
                .restart_limit(MAX_RESTARTS, RESTART_WINDOW)
                .spawn()
                .await;
                actor.wait_for_startup().await;
                (supervisor, actor)
            })?;
            Ok::<_, BridgeError>(Self { rt, actor, supervisor, engine_id, backoff })
        })
        .map_err(PyErr::from)
    }

    /// Step 17: `(count, load_async)` — a D request loads `prompt − computed` tokens from P;
    /// `(None, False)` while the first block it would load is being loaded for another request
    /// (`block_hashes`: the prompt's full blocks as the prefix cache keys them, one 64-bit form of
    /// each, `block_size` tokens a block; empty: never wait).
    #[pyo3(signature = (request_id, num_prompt_tokens, num_computed_tokens, kv_transfer_params, block_hashes=Vec::new(), block_size=0))]
    #[allow(clippy::too_many_arguments)]
    fn get_num_new_matched_tokens(
        &self,
        py: Python<'_>,
        request_id: String,
        num_prompt_tokens: usize,
        num_computed_tokens: usize,
        kv_transfer_params: Option<Bound<'_, PyDict>>,
        block_hashes: Vec<i64>,
        block_size: usize,
    ) -> PyResult<(Option<usize>, bool)> {
        let request = sched_request(request_id, num_prompt_tokens, kv_transfer_params.as_ref())?;
        // Python's hash of a block hash, as its 64 bits.
        let hashes = block_hashes.into_iter().map(|h| h as u64).collect();
        let block_hashes = PromptBlockHashes { block_size, hashes };
        let m = py.detach(|| {
            self.ask(
                "get_num_new_matched_tokens",
                GetNumNewMatchedTokens { request, num_computed_tokens, block_hashes },
            )
        })?;
        Ok(if m.not_yet { (None, false) } else { (Some(m.count), m.load_async) })
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

    /// Step 11: how many trailing prompt tokens P leaves to D for this request (0 but for a P
    /// request of a hybrid model): the caller drops them from the prompt before it is scheduled.
    #[pyo3(signature = (kv_transfer_params))]
    fn prefill_backoff(&self, kv_transfer_params: Option<Bound<'_, PyDict>>) -> PyResult<usize> {
        let Some(dict) = kv_transfer_params else { return Ok(0) };
        let params = crate::convert::params_from_dict(&dict)?;
        Ok(if params.do_remote_decode && !params.do_remote_prefill { self.backoff } else { 0 })
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
        block_ids: BlockIdsArg,
        num_external_tokens: usize,
    ) -> PyResult<bool> {
        let request = sched_request(request_id, num_prompt_tokens, kv_transfer_params.as_ref())?;
        let block_ids = GroupBlocks::from(block_ids);
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
        block_ids: BlockIdsArg,
    ) -> PyResult<(bool, Option<Bound<'py, PyAny>>)> {
        let request = sched_request(request_id, num_prompt_tokens, kv_transfer_params.as_ref())?;
        let block_ids = GroupBlocks::from(block_ids);
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
