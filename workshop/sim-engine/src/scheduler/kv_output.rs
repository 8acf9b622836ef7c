//! The connector's output of each step, as the scheduler takes it (vLLM's
//! `_update_from_kv_xfer_finished`): finished_sending frees P's delayed blocks (seed step 33),
//! finished_recving lets a waiting D resume (35–36) or frees an aborted one's blocks, a failed
//! load is settled by `kv_load_failure_policy`; a request held past `kv_state_timeout` is settled
//! as if the connector had said so. Then the output goes on to the connector's scheduler side.

use pdflow_messages::lifecycle::TransferState;
use pdflow_messages::scheduler_connector::{ConnectorOutput, FinishStatus, LoadFailure, LoadFailureCause};
use pdflow_observability::{attrs, steps};

use super::Scheduler;
use crate::config::LoadFailurePolicy;
use crate::model::ContextDigest;
use crate::request::Status;

impl Scheduler {
    /// `kv_state_timeout`: a request held for the connector past its deadline is settled as if
    /// the connector had said so — D's load failed (then the policy), P's blocks were sent — so
    /// that a connector that lost track of it (an actor restarted) cannot strand its blocks.
    fn expire_held_states(&mut self, out: &mut ConnectorOutput) {
        let Some(timeout) = self.config.kv_state_timeout else { return };
        for (id, r) in &self.requests {
            if r.held_since.is_none_or(|t| t.elapsed() < timeout) {
                continue;
            }
            match r.status {
                Status::WaitingForRemoteKvs | Status::AbortedAwaitingRecv
                    if !out.finished_recving.contains(id.as_str()) =>
                {
                    let what = if r.status == Status::WaitingForRemoteKvs {
                        "no KV received"
                    } else {
                        "aborted, and no end of its receive reported"
                    };
                    let reason = TransferState::WaitingForRemoteKvs.passed(timeout, what).to_string();
                    tracing::warn!(request_id = %id, "{reason}");
                    let failure = LoadFailure {
                        cause: LoadFailureCause::Deadline,
                        detail: reason,
                        block_ids: r.block_ids.clone(),
                    };
                    out.failed_recving.entry(id.clone().into()).or_insert(failure);
                }
                Status::FinishedDelayFree if !out.finished_sending.contains(id.as_str()) => {
                    let freed = TransferState::DelayedFree
                        .passed(timeout, "P held the blocks for a send never reported: freed");
                    tracing::warn!(request_id = %id, "{freed}");
                    out.finished_sending.insert(id.clone().into());
                }
                _ => {}
            }
        }
    }

    fn release(&mut self, id: &str) -> usize {
        let Some(mut r) = self.requests.remove(id) else { return 0 };
        let n = r.block_ids.len();
        self.pool.free_request(std::mem::take(&mut r.block_ids));
        r.group_blocks.clear();
        n
    }

    /// The workers' output of one step (steps 33, 35–36; failed loads by policy).
    pub async fn process_kv_output(&mut self, mut out: ConnectorOutput) {
        self.expire_held_states(&mut out);
        let engine_id = self.config.engine_id.clone();
        for id in &out.finished_sending {
            let Some(r) = self.requests.get(id.as_str()) else { continue };
            if r.status == Status::FinishedDelayFree {
                let span = req_span!(steps::P_FREE_BLOCKS, r, engine_id.as_str());
                span.record(attrs::BLOCKS, self.release(id));
            }
        }
        for id in &out.finished_recving {
            match self.requests.get(id.as_str()).map(|r| r.status) {
                Some(Status::WaitingForRemoteKvs) => {
                    self.finished_recving_kv_req_ids.insert(id.to_string());
                }
                Some(Status::AbortedAwaitingRecv) => {
                    self.release(id);
                }
                _ => {}
            }
        }
        for (id, reason) in &out.failed_recving {
            let Some(r) = self.requests.get_mut(id.as_str()) else { continue };
            match r.status {
                Status::WaitingForRemoteKvs => {
                    tracing::warn!(request_id = %id, reason = %reason, policy = ?self.config.kv_load_failure_policy, "remote KV load failed");
                    r.status = Status::Waiting;
                    match self.config.kv_load_failure_policy {
                        LoadFailurePolicy::Recompute => {
                            // What the local prefix cache supplied is still valid; the rest
                            // is computed here after all.
                            r.num_computed_tokens = r.hit_blocks * self.config.shape.block_size;
                            r.digest = ContextDigest::default();
                            r.first_token_pending = false;
                            if let Some(sources) = r.prompt_sources.as_mut() {
                                sources.external_kv_transfer = 0;
                            }
                        }
                        LoadFailurePolicy::Fail => {
                            let msg = format!("loading the prompt's KV from the prefill engine failed ({reason}); kv_load_failure_policy is `fail`");
                            self.finish_request(id, FinishStatus::Error, Vec::new(), Some(msg)).await;
                        }
                    }
                }
                Status::AbortedAwaitingRecv => {
                    self.release(id);
                }
                _ => {}
            }
        }
        self.publish_stats();
        if let Some(conn) = &self.connector {
            if let Err(e) = conn.scheduler.update_connector_output(out).await {
                tracing::warn!(error = %e, "update_connector_output failed");
            }
        }
    }
}
