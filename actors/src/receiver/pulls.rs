//! The Receiver's pulls in flight (seed steps 19 and 34): each request handed over gets a write
//! fence token and joins one PullTask (step 21) per paired P worker; each pull's answer, or its
//! task's death, settles the requests it carries. A request D gives up is cancelled at P, or
//! dropped from a pull not sent yet.

use std::collections::BTreeSet;
use std::time::Duration;

use kameo::prelude::*;
use pdflow_messages::rdma::RemoteRegion;
use pdflow_messages::receiver::{CancelTransfers, PullOutcome, PullTransportFailed};
use pdflow_messages::scheduler_connector::{LoadFailure, LoadFailureCause, PullMeta};
use pdflow_messages::sender_listener::{PullErrorCause, PullReq, PullRequest};
use pdflow_messages::RequestId;
use pdflow_transfer::fence::RemoteAccess;

use super::{pairing, EngineAt, Receiver};
use crate::fault_seam::{register_actor, ActorKind, Role};
use crate::pull_task::{self, PullTask, PullTaskArgs};
use crate::ranks::WorkerRank;

/// How long a best-effort `AbortPull` for a dead PullTask's transfers may take.
const ORPHAN_ABORT_BOUND: Duration = Duration::from_secs(2);

/// One D request whose pull has been issued.
#[derive(Debug)]
pub(super) struct Recv {
    pub(super) meta: PullMeta,
    /// Pulls of this request that have not answered.
    pub(super) pending: BTreeSet<u64>,
    /// The first failure seen; the request fails once `pending` is empty.
    pub(super) failure: Option<LoadFailure>,
    pub(super) aborted: bool,
    pub(super) layout_retried: bool,
    /// This request's write-fence token (non-zero).
    pub(super) fence: u64,
}

/// One PullTask in flight.
#[derive(Debug)]
pub(super) struct Pull {
    pub(super) task: ActorRef<PullTask>,
    pub(super) engine: EngineAt,
    pub(super) worker_addr: String,
    pub(super) reqs: Vec<RequestId>,
    /// The P rank it reads, between sharded engines (its digests cover the pair's share).
    pub(super) p_rank: Option<WorkerRank>,
}

impl Receiver {
    /// The PullTask of pull `pull_id` died (`reason`) before reporting: best-effort `AbortPull` to
    /// P, and the pull's requests fail.
    pub(super) fn pull_task_died(&mut self, pull_id: u64, reason: &ActorStopReason) {
        if let Some(pull) = self.pulls.remove(&pull_id) {
            let reason = format!(
                "pull task for pull {pull_id} to P worker {} died ({reason}) before P answered",
                pull.worker_addr
            );
            tracing::warn!(pull_id, worker_addr = %pull.worker_addr, "{reason}");
            let transfer_ids =
                pull.reqs.iter().filter_map(|r| self.in_flight.get(r)).map(|r| r.meta.transfer_id.clone()).collect();
            self.helpers.spawn(pull_task::abort_orphaned(
                pull.worker_addr.clone(),
                self.args.auth.clone(),
                pull_id,
                transfer_ids,
                ORPHAN_ABORT_BOUND,
            ));
            for req in &pull.reqs {
                self.settle(
                    req,
                    pull_id,
                    Some(LoadFailure::new(LoadFailureCause::Pull(PullErrorCause::TransferFailed), reason.clone())),
                );
            }
        }
    }

    /// A fresh write-fence token (non-zero, unique per Receiver incarnation).
    pub(super) fn new_fence(&mut self) -> u64 {
        let token = self.next_fence;
        self.next_fence = self.next_fence.wrapping_add(2) | 1;
        token
    }

    /// One pull of `req` has answered (with `failure` or not).
    pub(super) fn settle(&mut self, req: &RequestId, pull_id: u64, failure: Option<LoadFailure>) {
        let Some(recv) = self.in_flight.get_mut(req) else { return };
        if !recv.pending.remove(&pull_id) {
            return;
        }
        if let Some(f) = failure {
            recv.failure.get_or_insert(f);
        }
        if recv.pending.is_empty() {
            if let Some(recv) = self.in_flight.remove(req) {
                self.complete_fenced(&recv.meta, recv.failure, recv.fence);
            }
        }
    }

    /// Spawns one PullTask for `reqs` (already in `in_flight`) to one P worker.
    pub(super) async fn spawn_pull(
        &mut self,
        engine: &EngineAt,
        (worker_addr, p_rank): (&str, Option<WorkerRank>),
        reqs: &[RequestId],
        me: &ActorRef<Self>,
    ) {
        let pull_id = self.next_pull_id;
        self.next_pull_id = self.next_pull_id.wrapping_add(1);
        let include_layout = self.layout_acks.get(worker_addr) != Some(&self.layout.layout_id);
        if let Some(fence) = &self.args.fence {
            for r in reqs {
                if let Some(recv) = self.in_flight.get(r).filter(|r| !r.meta.local_block_ids.is_empty()) {
                    fence.open(recv.fence);
                }
            }
        }
        let remote = self.args.fence.as_ref().and_then(|f| f.remote()).cloned();
        let metas: Vec<&PullMeta> = reqs.iter().filter_map(|r| self.in_flight.get(r)).map(|r| &r.meta).collect();
        let request = PullRequest {
            pull_id,
            engine_id: self.args.engine_id.to_string(),
            data_addr: self.args.data_addr.clone(),
            tp_size: self.args.rank.tp_size,
            tp_rank: self.args.rank.tp_rank,
            pp_size: self.args.rank.pp_size,
            layout_id: self.layout.layout_id,
            layout: include_layout.then(|| self.layout.clone()),
            reqs: metas
                .iter()
                .map(|m| PullReq {
                    d_req_id: m.d_req_id.clone(),
                    transfer_id: m.transfer_id.clone(),
                    block_ids: m.local_block_ids.clone(),
                    traceparent: m.traceparent.clone(),
                    fence: self.in_flight.get(&m.d_req_id).map_or(0, |r| r.fence),
                    remote: remote.as_ref().map_or_else(Vec::new, |access| self.grant(access.as_ref(), m, worker_addr)),
                })
                .collect(),
            traceparent: metas.iter().find_map(|m| m.traceparent.clone()),
            p_generation: self.p_generations.get(worker_addr).copied().unwrap_or(0),
            deadline_ms: u64::try_from(self.args.pull_timeout.as_millis()).unwrap_or(u64::MAX),
            pp_rank: self.args.rank.pp_rank,
            p_world: self.remote_agents.get(engine).map_or((1, 1), pairing::world),
            rdma: remote.as_ref().map(|access| Box::new(access.offer(worker_addr))),
        };
        let args = PullTaskArgs {
            pull_id,
            remote_engine_id: engine.engine_id.clone(),
            worker_addr: worker_addr.to_string(),
            request,
            deadline: self.args.pull_timeout,
            outcomes: me.clone().recipient(),
            transport_failures: me.clone().recipient(),
            faults: self.args.faults.clone(),
            auth: self.args.auth.clone(),
        };
        let task = PullTask::spawn_link(me, args).await;
        let transfer_ids = metas.iter().map(|m| m.transfer_id.clone()).collect();
        register_actor(&self.args.faults, ActorKind::PullTask, Role::D, transfer_ids, &task);
        self.pull_of_task.insert(task.id(), pull_id);
        for r in reqs {
            if let Some(recv) = self.in_flight.get_mut(r) {
                recv.pending.insert(pull_id);
            }
        }
        self.pulls.insert(
            pull_id,
            Pull { task, engine: engine.clone(), worker_addr: worker_addr.to_string(), reqs: reqs.to_vec(), p_rank },
        );
    }

    /// The one-sided write grant of `meta`'s blocks (every region of this worker's layout, the
    /// blocks' byte runs) for the P worker at `peer`; empty when there is nothing to write or the
    /// registration failed (P then writes over the data server).
    fn grant(&self, access: &dyn RemoteAccess, meta: &PullMeta, peer: &str) -> Vec<RemoteRegion> {
        let Some(token) = self.in_flight.get(&meta.d_req_id).map(|r| r.fence) else { return Vec::new() };
        let blocks = meta.local_block_ids.flat();
        if blocks.is_empty() {
            return Vec::new();
        }
        let runs = pdflow_kv::planner::contiguous_runs(&blocks, &blocks);
        let blocks = &blocks;
        let ranges: Vec<(u64, u64)> = self
            .layout
            .regions
            .iter()
            .flat_map(|r| runs.iter().map(move |&(start, len)| (r.block_addr(blocks[start]), len as u64 * r.block_len)))
            .collect();
        match access.grant(token, peer, &ranges) {
            Ok(regions) => regions,
            Err(e) => {
                tracing::warn!(request_id = %meta.d_req_id, error = %e, "could not register the blocks for one-sided writes: P writes them over the data server");
                Vec::new()
            }
        }
    }

    /// Step 21 for one engine whose workers are cached: one pull per paired P worker.
    pub(super) async fn start_pulls(&mut self, engine: &EngineAt, metas: Vec<PullMeta>, me: &ActorRef<Self>) {
        let Some(workers) = self.remote_agents.get(engine) else {
            for meta in metas {
                let detail = format!("{engine} has no cached workers");
                self.complete(&meta, Some(LoadFailure::new(LoadFailureCause::Bootstrap, detail)));
            }
            return;
        };
        let peers = match pairing::pair(&engine.engine_id, workers, &self.args.rank) {
            Ok(peers) => peers,
            Err(reason) => {
                for meta in metas {
                    self.complete(&meta, Some(LoadFailure::new(LoadFailureCause::Bootstrap, reason.to_string())));
                }
                return;
            }
        };
        let world = pairing::world(workers);
        let ranked = world != (1, 1) || !self.args.rank.is_single();
        let reqs: Vec<RequestId> = metas.iter().map(|m| m.d_req_id.clone()).collect();
        for meta in metas {
            let fence = self.new_fence();
            let recv =
                Recv { meta, pending: BTreeSet::new(), failure: None, aborted: false, layout_retried: false, fence };
            self.in_flight.insert(recv.meta.d_req_id.clone(), recv);
        }
        for peer in peers {
            let p_rank = ranked.then(|| self.args.rank.peer(peer.tp_rank, peer.pp_rank, world));
            self.spawn_pull(engine, (&peer.addr, p_rank), &reqs, me).await;
        }
    }

    /// D gave `req` up: cancel its transfers, or drop its blocks from a pull not sent yet.
    pub(super) async fn abort(&mut self, req: &RequestId) {
        if let Some(recv) = self.in_flight.get_mut(req) {
            if recv.aborted {
                return;
            }
            recv.aborted = true;
            let transfer_id = recv.meta.transfer_id.clone();
            let tasks: Vec<ActorRef<PullTask>> =
                recv.pending.iter().filter_map(|p| self.pulls.get(p)).map(|p| p.task.clone()).collect();
            for task in tasks {
                // A task that already ended has reported, or its link death will settle the request.
                let _ = task.tell(CancelTransfers { transfer_ids: vec![transfer_id.clone()] }).await;
            }
            return;
        }
        let queued = self.lookups.values_mut().find_map(|l| l.queued.get_mut(req));
        if let Some(meta) = queued {
            if !meta.local_block_ids.is_empty() {
                // Nothing was sent: the pull will go with no block ids, so P only frees its blocks.
                let reported = meta.clone();
                meta.local_block_ids.clear();
                let detail = "aborted by D before its pull was sent";
                self.complete(&reported, Some(LoadFailure::new(LoadFailureCause::AbortedByD, detail)));
            }
            return;
        }
        tracing::debug!(request_id = %req, "abort for a request with no pull in flight: nothing to cancel");
    }

    pub(super) fn is_known(&self, req: &RequestId) -> bool {
        self.in_flight.contains_key(req) || self.lookups.values().any(|l| l.queued.contains_key(req))
    }
}

impl Message<PullOutcome> for Receiver {
    type Reply = ();

    /// Step 34: settle the pull's requests; retry once with the full layout where P lacked it.
    async fn handle(&mut self, msg: PullOutcome, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let Some(pull) = self.pulls.remove(&msg.pull_id) else {
            tracing::debug!(pull_id = msg.pull_id, "outcome of a pull already settled: ignored");
            return;
        };
        let pull_id = msg.pull_id;
        if msg.p_generation != 0 {
            let known = self.p_generations.insert(pull.worker_addr.clone(), msg.p_generation);
            if known.is_some_and(|g| g != msg.p_generation) {
                // A new incarnation forgot every layout its predecessor had cached.
                tracing::info!(worker_addr = %pull.worker_addr, generation = msg.p_generation, "P worker restarted: later pulls address its new generation");
                self.layout_acks.remove(&pull.worker_addr);
            }
        }
        if let Some(acked) = msg.layout_acked.filter(|id| *id == self.layout.layout_id) {
            self.layout_acks.insert(pull.worker_addr.clone(), acked);
        }
        for req in &msg.ok_reqs {
            let failure = msg
                .digests
                .iter()
                .find(|d| &d.d_req_id == req)
                .and_then(|d| self.check_digests(req, &d.digests, pull.p_rank));
            self.settle(req, pull_id, failure);
        }
        let mut retry = Vec::new();
        for err in msg.err_reqs {
            if err.cause == PullErrorCause::UnknownLayout {
                if let Some(recv) = self.in_flight.get_mut(&err.d_req_id).filter(|r| r.pending.contains(&pull_id)) {
                    if !recv.layout_retried && !recv.aborted {
                        recv.layout_retried = true;
                        recv.pending.remove(&pull_id);
                        retry.push(err.d_req_id);
                        continue;
                    }
                }
            }
            if err.cause == PullErrorCause::LayoutMismatch {
                // P's engine may have more workers than the cached answer named: look it up again.
                self.remote_agents.remove(&pull.engine);
            }
            self.settle(&err.d_req_id, pull_id, Some(LoadFailure::new(LoadFailureCause::Pull(err.cause), err.detail)));
        }
        for req in &pull.reqs {
            let detail = format!("P's answer to pull {pull_id} did not mention this request");
            let failure = LoadFailure::new(LoadFailureCause::Pull(PullErrorCause::TransferFailed), detail);
            self.settle(req, pull_id, Some(failure));
        }
        if !retry.is_empty() {
            tracing::info!(pull_id, worker_addr = %pull.worker_addr, "P does not know D's layout: pulling again with the full layout");
            self.layout_acks.remove(&pull.worker_addr);
            let me = ctx.actor_ref().clone();
            self.spawn_pull(&pull.engine, (&pull.worker_addr, pull.p_rank), &retry, &me).await;
        }
    }
}

impl Message<PullTransportFailed> for Receiver {
    type Reply = ();

    /// The side channel to a cached address failed: the bootstrap answer may be stale.
    async fn handle(&mut self, msg: PullTransportFailed, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.layout_acks.remove(&msg.worker_addr);
        let before = self.remote_agents.len();
        self.remote_agents.retain(|engine, workers| {
            engine.engine_id != msg.remote_engine_id
                || !workers.values().flat_map(|pps| pps.values()).any(|a| *a == msg.worker_addr)
        });
        if self.remote_agents.len() < before {
            tracing::warn!(engine_id = %msg.remote_engine_id, worker_addr = %msg.worker_addr, reason = %msg.reason,
                "side channel to P failed: its cached bootstrap answer is dropped, the next pull looks it up again");
        }
    }
}
