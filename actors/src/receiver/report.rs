//! The Receiver's reports (seed step 34, and the worker half of step 35): a settled request is
//! recorded finished or failed — a failure only once its write fence has drained, so that no byte
//! of its pull can land in blocks the engine frees — and [`GetFinishedRecving`] drains them.

use std::collections::BTreeSet;
use std::time::Duration;

use kameo::prelude::*;
use pdflow_messages::lifecycle::TransferState;
use pdflow_messages::receiver::GetFinishedRecving;
use pdflow_messages::scheduler_connector::{ConnectorOutput, LoadFailure, PullMeta};
use pdflow_observability::{attrs, step_span, steps, Outcome};

use super::Receiver;
use crate::ActorError;

/// Longest a failed request's report waits for its fenced batches to stop (they are told to at
/// once; this bounds a data server that does not answer).
const FENCE_DRAIN_DEADLINE: Duration = Duration::from_secs(5);

impl Receiver {
    pub(super) fn notify(&self) {
        self.args.events.notify_waiters();
        self.args.events.notify_one();
    }

    /// Step 34 for one request: it is settled; report it.
    pub(super) fn complete(&mut self, meta: &PullMeta, failure: Option<LoadFailure>) {
        let span = step_span!(steps::D_PULL_RESULT, request_id = %meta.d_req_id, transfer_id = %meta.transfer_id);
        span.record(attrs::ENGINE_ID, meta.remote_engine_id.as_str());
        span.record(attrs::BLOCKS, meta.local_block_ids.len() as u64);
        if let Some(groups) = meta.local_block_ids.counts_label() {
            span.record(attrs::GROUP_BLOCKS, groups.as_str());
        }
        if !self.args.rank.is_single() {
            span.record(attrs::TP_RANK, self.args.rank.tp_rank);
            span.record(attrs::PP_RANK, self.args.rank.pp_rank);
        }
        if let Some(tp) = &meta.traceparent {
            span.record(attrs::TRACEPARENT, tp.as_str());
        }
        if meta.local_block_ids.is_empty() {
            // D gave the request up before the pull: P was only told to free its blocks.
            Outcome::FreedOnly.record(&span);
            return;
        }
        match failure {
            Some(mut failure) => {
                Outcome::FAILED.record(&span);
                tracing::warn!(parent: &span, request_id = %meta.d_req_id, reason = %failure, "KV receive failed");
                failure.block_ids = meta.local_block_ids.flat();
                self.failed_recving.insert(meta.d_req_id.clone(), failure);
            }
            None => {
                Outcome::Ok.record(&span);
                if self.args.verify_checksums {
                    match self.args.kv_cache.blocks_checksum(&meta.local_block_ids.flat()) {
                        Ok(sum) => {
                            span.record(attrs::KV_CHECKSUM, sum);
                        }
                        Err(e) => tracing::warn!(parent: &span, error = %e, "KV checksum not computed"),
                    }
                }
                self.finished_recving.insert(meta.d_req_id.clone());
            }
        }
        self.notify();
    }

    /// [`Receiver::complete`] for a request whose pull ran under fence `token`: the token is
    /// closed first, and a failure is reported (the engine then frees or reuses the blocks) only
    /// once no batch of the pull is still landing — a stalled write that resumes is refused.
    pub(super) fn complete_fenced(&mut self, meta: &PullMeta, failure: Option<LoadFailure>, token: u64) {
        let Some(fence) = self.args.fence.clone() else { return self.complete(meta, failure) };
        // A pull that ended with every write reported done keeps P's one-sided connections.
        let landing = if failure.is_none() { fence.close_clean(token) } else { fence.close_now(token) };
        if landing == 0 || failure.is_none() {
            return self.complete(meta, failure);
        }
        tracing::info!(request_id = %meta.d_req_id, landing, "pull ended with its KV still landing: reporting once the fence drains");
        self.draining.insert(meta.d_req_id.clone());
        let Some(reason) = failure else { return self.complete(meta, None) };
        let (me, meta) = (self.me.clone(), meta.clone());
        self.helpers.spawn(async move {
            if let Err(e) = fence.close(token, FENCE_DRAIN_DEADLINE).await {
                let passed = TransferState::DrainingFence
                    .passed(FENCE_DRAIN_DEADLINE, format!("a fenced batch did not stop ({e})"));
                tracing::error!("{passed}; reporting the failure anyway");
            }
            let _ = me.tell(FenceDrained { meta, reason }).await;
        });
    }
}

/// Internal: a failed request's fence has drained; report it now.
struct FenceDrained {
    meta: PullMeta,
    reason: LoadFailure,
}

impl Message<FenceDrained> for Receiver {
    type Reply = ();

    async fn handle(&mut self, msg: FenceDrained, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.draining.remove(&msg.meta.d_req_id);
        self.complete(&msg.meta, Some(msg.reason));
    }
}

impl Message<GetFinishedRecving> for Receiver {
    type Reply = Result<ConnectorOutput, ActorError>;

    /// Step 35 (worker half): what finished or failed since the last call.
    async fn handle(&mut self, _msg: GetFinishedRecving, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        Ok(ConnectorOutput {
            finished_sending: BTreeSet::new(),
            finished_recving: std::mem::take(&mut self.finished_recving),
            failed_recving: std::mem::take(&mut self.failed_recving),
        })
    }
}
