//! Receiver — a D worker's pulls in flight (seed steps 5, 19, 20, 34: vLLM's receiver loop with
//! `_start_load_kv`, `handle_new_engine_id`, `receive_kv`, `process_pulling_result` and
//! `_complete_pull_task`).
//!
//! [`StartLoadKv`] (step 19) hands the step's pulls over, grouped by P engine. An engine whose
//! workers are not cached is looked up once (step 20, `GET /query` in a task the actor owns; later
//! pulls for that engine queue behind it), then every request of the step for that engine goes to
//! each paired P worker in ONE [`PullTask`] (step 21). Each [`PullOutcome`] settles requests (step
//! 34): a request is received when every pull it is part of succeeded, failed as soon as its last
//! pull has answered and one of them failed. [`GetFinishedRecving`] (step 35) drains the results.
//!
//! What it leaves to others: the side-channel exchange and its deadline ([`PullTask`]), D's data
//! server (the node), what the scheduler does with a failure (the SchedulerConnector).
//!
//! Safety rules kept here: a request aborted while its pull is in flight stays in flight until P
//! answers or the pull's deadline passes (no write-after-free); a PullTask that dies without
//! reporting fails its requests (it is linked; best-effort `AbortPull` to P).

#[cfg(test)]
mod bad_input_tests;
#[cfg(test)]
pub(crate) mod fake_peers;
mod lookup;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use kameo::prelude::*;
use pdflow_kv::memory::KvCache;
use pdflow_messages::bootstrap::WorkerAddrs;
use pdflow_messages::layout::KvLayout;
use pdflow_messages::lifecycle::TransferState;
use pdflow_messages::receiver::{
    CancelTransfers, GetFinishedRecving, PullOutcome, PullTransportFailed, StartLoadKv, TransferStates,
};
use pdflow_messages::scheduler_connector::{ConnectorOutput, LoadFailure, LoadFailureCause, PullMeta};
use pdflow_messages::sender_listener::{PullErrorCause, PullReq, PullRequest};
use pdflow_messages::{BlockId, EngineId, RequestId};
use pdflow_observability::{attrs, step_span, steps, Outcome};
use pdflow_transfer::fence::WriteFence;
use tokio::task::{JoinHandle, JoinSet};
use tracing::Instrument;

use crate::fault_seam::{register_actor, ActorKind, Faults, Role};
use crate::pull_task::{self, PullTask, PullTaskArgs};
use crate::ranks::{pair_share_digests, DigestError, PairEnd, WorkerRank};
use crate::side_channel_auth::PullAuth;
use crate::ActorError;

/// How long a best-effort `AbortPull` for a dead PullTask's transfers may take.
const ORPHAN_ABORT_BOUND: Duration = Duration::from_secs(2);

/// Longest a failed request's report waits for its fenced batches to stop (they are told to at
/// once; this bounds a data server that does not answer).
const FENCE_DRAIN_DEADLINE: Duration = Duration::from_secs(5);

/// Arguments of [`Receiver`].
#[derive(Debug, Clone)]
pub struct ReceiverArgs {
    pub engine_id: EngineId,
    /// This worker's tensor and pipeline position, and the model it shards.
    pub rank: WorkerRank,
    pub kv_cache: Arc<KvCache>,
    /// D's data server, `host:port` (the node starts it; P's transfer engine connects there).
    pub data_addr: String,
    /// Deadline of one side-channel exchange.
    pub pull_timeout: Duration,
    /// Deadline of one `/query` call.
    pub bootstrap_timeout: Duration,
    /// Notified (`notify_waiters` + `notify_one`) whenever results are ready to collect.
    pub events: Arc<tokio::sync::Notify>,
    /// Record `pd.kv_checksum` of D's blocks on step 34.
    pub verify_checksums: bool,
    /// D's data server's write fence (the node binds the server with it): each request's blocks
    /// get a token, open while its pull runs; a failed request is reported only once no byte of
    /// its pull can land any more (no write-after-free). `None`: unfenced (tests of the actor alone).
    pub fence: Option<WriteFence>,
    /// The node's fault seam ([`crate::fault_seam::no_faults`] in production).
    pub faults: Faults,
    /// Seals D's pulls and checks P's answers (with the cluster secret).
    pub auth: PullAuth,
}

/// One D request whose pull has been issued.
#[derive(Debug)]
struct Recv {
    meta: PullMeta,
    /// Pulls of this request that have not answered.
    pending: BTreeSet<u64>,
    /// The first failure seen; the request fails once `pending` is empty.
    failure: Option<LoadFailure>,
    aborted: bool,
    layout_retried: bool,
    /// This request's write-fence token (non-zero).
    fence: u64,
}

/// One PullTask in flight.
#[derive(Debug)]
struct Pull {
    task: ActorRef<PullTask>,
    engine_id: EngineId,
    worker_addr: String,
    reqs: Vec<RequestId>,
    /// The P rank it reads, between sharded engines (its digests cover the pair's share).
    p_rank: Option<WorkerRank>,
}

/// One bootstrap look-up in flight, with the requests queued behind it.
#[derive(Debug)]
struct Lookup {
    bootstrap_addr: String,
    queued: BTreeMap<RequestId, PullMeta>,
    task: JoinHandle<()>,
}

/// Internal: a look-up task's answer.
struct LookupDone {
    engine_id: EngineId,
    result: Result<lookup::Answer, lookup::LookupError>,
}

/// A D worker's receiver.
#[derive(Debug)]
pub struct Receiver {
    args: ReceiverArgs,
    layout: KvLayout,
    http: reqwest::Client,
    /// engine id → its workers (vLLM's `_remote_agents`).
    remote_agents: HashMap<EngineId, WorkerAddrs>,
    lookups: HashMap<EngineId, Lookup>,
    /// P worker address → the layout id it acknowledged.
    layout_acks: HashMap<String, u64>,
    /// P worker address → its generation, from bootstrap or its last answer: every
    /// pull names it, so that a restarted worker refuses at once what its predecessor held.
    p_generations: HashMap<String, u64>,
    in_flight: HashMap<RequestId, Recv>,
    pulls: HashMap<u64, Pull>,
    /// Every linked PullTask's id → its pull (kept until its link death arrives).
    pull_of_task: HashMap<ActorId, u64>,
    next_pull_id: u64,
    finished_recving: BTreeSet<RequestId>,
    failed_recving: BTreeMap<RequestId, LoadFailure>,
    /// Failed requests whose fence is draining before they are reported (`draining_fence`).
    draining: BTreeSet<RequestId>,
    /// Best-effort aborts of orphaned pulls, and failures waiting for their fence to drain.
    helpers: JoinSet<()>,
    /// This actor, for the tasks it owns (a failure reported once its fence has drained).
    me: ActorRef<Self>,
    next_fence: u64,
}

impl Actor for Receiver {
    type Args = ReceiverArgs;
    type Error = ActorError;

    async fn on_start(args: Self::Args, actor_ref: ActorRef<Self>) -> Result<Self, Self::Error> {
        let span = step_span!(steps::CONSUMER_INIT);
        if let Some(fence) = &args.fence {
            // A restarted Receiver forgot the pulls its predecessor opened: none may land now.
            fence.close_all();
        }
        span.record(attrs::ENGINE_ID, args.engine_id.as_str());
        span.record(attrs::BLOCKS, args.kv_cache.num_blocks() as u64);
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(args.bootstrap_timeout)
            .build()
            .map_err(|source| ActorError::HttpClient { what: "the receiver's HTTP client", source })?;
        // Random high bits: pull ids stay unique across D workers, so P can tell them apart.
        let next_pull_id = uuid::Uuid::new_v4().as_u64_pair().0 & !0xffff_ffff;
        Ok(Self {
            layout: args.kv_cache.layout(),
            args,
            http,
            remote_agents: HashMap::new(),
            lookups: HashMap::new(),
            layout_acks: HashMap::new(),
            p_generations: HashMap::new(),
            in_flight: HashMap::new(),
            pulls: HashMap::new(),
            pull_of_task: HashMap::new(),
            next_pull_id,
            finished_recving: BTreeSet::new(),
            failed_recving: BTreeMap::new(),
            draining: BTreeSet::new(),
            helpers: JoinSet::new(),
            me: actor_ref,
            next_fence: next_pull_id | 1,
        })
    }

    async fn on_link_died(
        &mut self,
        _actor_ref: WeakActorRef<Self>,
        id: ActorId,
        reason: ActorStopReason,
    ) -> Result<ControlFlow<ActorStopReason>, Self::Error> {
        let Some(pull_id) = self.pull_of_task.remove(&id) else {
            // Not one of our PullTasks: kameo's default (stop unless it ended normally).
            return Ok(match reason {
                ActorStopReason::Normal | ActorStopReason::SupervisorRestart => ControlFlow::Continue(()),
                reason => ControlFlow::Break(ActorStopReason::LinkDied { id, reason: Box::new(reason) }),
            });
        };
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
        while self.helpers.try_join_next().is_some() {}
        Ok(ControlFlow::Continue(()))
    }

    async fn on_stop(&mut self, _actor_ref: WeakActorRef<Self>, _reason: ActorStopReason) -> Result<(), Self::Error> {
        for lookup in self.lookups.values() {
            lookup.task.abort();
        }
        self.helpers.abort_all();
        Ok(())
    }
}

impl Receiver {
    fn notify(&self) {
        self.args.events.notify_waiters();
        self.args.events.notify_one();
    }

    /// Step 34 for one request: it is settled; report it.
    fn complete(&mut self, meta: &PullMeta, failure: Option<LoadFailure>) {
        let span = step_span!(steps::D_PULL_RESULT, request_id = %meta.d_req_id, transfer_id = %meta.transfer_id);
        span.record(attrs::ENGINE_ID, meta.remote_engine_id.as_str());
        span.record(attrs::BLOCKS, meta.local_block_ids.len() as u64);
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
                failure.block_ids.clone_from(&meta.local_block_ids);
                self.failed_recving.insert(meta.d_req_id.clone(), failure);
            }
            None => {
                Outcome::Ok.record(&span);
                if self.args.verify_checksums {
                    match self.args.kv_cache.blocks_checksum(&meta.local_block_ids) {
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

    /// A fresh write-fence token (non-zero, unique per Receiver incarnation).
    fn new_fence(&mut self) -> u64 {
        let token = self.next_fence;
        self.next_fence = self.next_fence.wrapping_add(2) | 1;
        token
    }

    /// [`Receiver::complete`] for a request whose pull ran under fence `token`: the token is
    /// closed first, and a failure is reported (the engine then frees or reuses the blocks) only
    /// once no batch of the pull is still landing — a stalled write that resumes is refused.
    fn complete_fenced(&mut self, meta: &PullMeta, failure: Option<LoadFailure>, token: u64) {
        let Some(fence) = self.args.fence.clone() else { return self.complete(meta, failure) };
        let landing = fence.close_now(token);
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

    /// One pull of `req` has answered (with `failure` or not).
    /// With `verify_checksums`, D's blocks of `req` against P's digests of what it wrote: the
    /// failure of the load when a block differs (or D cannot read its blocks); `None` when they
    /// match or nothing is to be checked. The bytes landed before P answered (its write was acked).
    /// From a P rank of a sharded engine (`p_rank`), the digests cover the pair's share of each
    /// block ([`pdflow_kv::topology::share_digests`]).
    fn check_digests(&self, req: &RequestId, p_digests: &[u64], p_rank: Option<WorkerRank>) -> Option<LoadFailure> {
        if !self.args.verify_checksums {
            return None;
        }
        let recv = self.in_flight.get(req)?;
        let blocks = &recv.meta.local_block_ids;
        let mismatch = |detail: String| {
            tracing::warn!(request_id = %req, "{detail}");
            Some(LoadFailure::new(LoadFailureCause::KvMismatch, detail))
        };
        if p_digests.len() != blocks.len() {
            return mismatch(format!(
                "P sent digests of {} blocks for {} of D's: the KV is not used",
                p_digests.len(),
                blocks.len()
            ));
        }
        let d_digests = match self.d_digests(blocks, p_rank) {
            Ok(d) => d,
            Err(e) => return mismatch(format!("D cannot read its blocks to check them ({e}): the KV is not used")),
        };
        let differ: Vec<BlockId> =
            blocks.iter().zip(p_digests.iter().zip(&d_digests)).filter(|(_, (p, d))| p != d).map(|(b, _)| *b).collect();
        if differ.is_empty() {
            return None;
        }
        mismatch(format!(
            "{} of {} blocks differ from what P wrote (D's blocks {:?}): the KV is not used",
            differ.len(),
            blocks.len(),
            &differ[..differ.len().min(8)]
        ))
    }

    /// D's digests of `blocks`: whole blocks, or the share P rank `p_rank` wrote into them.
    fn d_digests(&self, blocks: &[BlockId], p_rank: Option<WorkerRank>) -> Result<Vec<u64>, DigestError> {
        let Some(p) = p_rank else { return Ok(self.args.kv_cache.block_digests(blocks)?) };
        pair_share_digests(&self.args.kv_cache, (&p, &self.args.rank), PairEnd::D, blocks)
    }

    fn settle(&mut self, req: &RequestId, pull_id: u64, failure: Option<LoadFailure>) {
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
    async fn spawn_pull(
        &mut self,
        engine_id: &str,
        (worker_addr, p_rank): (&str, Option<WorkerRank>),
        reqs: &[RequestId],
        me: &ActorRef<Self>,
    ) {
        let pull_id = self.next_pull_id;
        self.next_pull_id = self.next_pull_id.wrapping_add(1);
        let include_layout = self.layout_acks.get(worker_addr) != Some(&self.layout.layout_id);
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
                })
                .collect(),
            traceparent: metas.iter().find_map(|m| m.traceparent.clone()),
            p_generation: self.p_generations.get(worker_addr).copied().unwrap_or(0),
            deadline_ms: u64::try_from(self.args.pull_timeout.as_millis()).unwrap_or(u64::MAX),
            pp_rank: self.args.rank.pp_rank,
            p_world: self.remote_agents.get(engine_id).map_or((1, 1), lookup::world),
        };
        let args = PullTaskArgs {
            pull_id,
            remote_engine_id: engine_id.into(),
            worker_addr: worker_addr.to_string(),
            request,
            deadline: self.args.pull_timeout,
            outcomes: me.clone().recipient(),
            transport_failures: me.clone().recipient(),
            faults: self.args.faults.clone(),
            auth: self.args.auth.clone(),
        };
        if let Some(fence) = &self.args.fence {
            for r in reqs {
                if let Some(recv) = self.in_flight.get(r).filter(|r| !r.meta.local_block_ids.is_empty()) {
                    fence.open(recv.fence);
                }
            }
        }
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
            Pull {
                task,
                engine_id: engine_id.into(),
                worker_addr: worker_addr.to_string(),
                reqs: reqs.to_vec(),
                p_rank,
            },
        );
    }

    /// Step 21 for one engine whose workers are cached: one pull per paired P worker.
    async fn start_pulls(&mut self, engine_id: &str, metas: Vec<PullMeta>, me: &ActorRef<Self>) {
        let Some(workers) = self.remote_agents.get(engine_id) else {
            for meta in metas {
                let detail = format!("P engine {engine_id} has no cached workers");
                self.complete(&meta, Some(LoadFailure::new(LoadFailureCause::Bootstrap, detail)));
            }
            return;
        };
        let peers = match lookup::pair(engine_id, workers, &self.args.rank) {
            Ok(peers) => peers,
            Err(reason) => {
                for meta in metas {
                    self.complete(&meta, Some(LoadFailure::new(LoadFailureCause::Bootstrap, reason.to_string())));
                }
                return;
            }
        };
        let world = lookup::world(workers);
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
            self.spawn_pull(engine_id, (&peer.addr, p_rank), &reqs, me).await;
        }
    }

    /// Step 20: look `engine_id` up at `bootstrap_addr` in a task; its answer comes back as a message.
    fn spawn_lookup(
        &mut self,
        engine_id: &str,
        bootstrap_addr: &str,
        queued: BTreeMap<RequestId, PullMeta>,
        me: &ActorRef<Self>,
    ) {
        let first = queued.keys().next().cloned().unwrap_or_default();
        let span = step_span!(steps::D_BOOTSTRAP_QUERY, request_id = %first);
        span.record(attrs::ENGINE_ID, engine_id);
        let (http, addr, timeout, me) =
            (self.http.clone(), bootstrap_addr.to_string(), self.args.bootstrap_timeout, me.clone());
        let engine = engine_id.to_string();
        let secret = self.args.auth.secret.clone();
        let task = tokio::spawn(async move {
            let result =
                lookup::query_until_registered(&http, secret.as_ref(), &addr, &engine, timeout).instrument(span).await;
            if let Err(e) = me.tell(LookupDone { engine_id: engine.into(), result }).await {
                tracing::debug!(error = %e, "receiver gone before its bootstrap look-up answered");
            }
        });
        self.lookups.insert(engine_id.into(), Lookup { bootstrap_addr: bootstrap_addr.to_string(), queued, task });
    }

    /// D gave `req` up: cancel its transfers, or drop its blocks from a pull not sent yet.
    async fn abort(&mut self, req: &RequestId) {
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

    fn is_known(&self, req: &RequestId) -> bool {
        self.in_flight.contains_key(req) || self.lookups.values().any(|l| l.queued.contains_key(req))
    }
}

impl Message<StartLoadKv> for Receiver {
    type Reply = ();

    /// Step 19: start this step's pulls (looking engines up first where needed), then the aborts.
    async fn handle(&mut self, msg: StartLoadKv, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let me = ctx.actor_ref().clone();
        // Step 19 once per request handed over: each keeps its own trace.
        for meta in msg.reqs_to_recv.values().flat_map(|m| m.values()) {
            let span = step_span!(
                steps::D_START_LOAD,
                request_id = meta.d_req_id.as_str(),
                transfer_id = meta.transfer_id.as_str()
            );
            span.record(attrs::BLOCKS, meta.local_block_ids.len() as u64);
            span.record(attrs::ENGINE_ID, meta.remote_engine_id.as_str());
            if let Some(tp) = &meta.traceparent {
                span.record(attrs::TRACEPARENT, tp.as_str());
            }
        }
        for (engine_id, metas) in msg.reqs_to_recv {
            let mut fresh = BTreeMap::new();
            for (req, meta) in metas {
                if self.is_known(&req) {
                    tracing::warn!(request_id = %req, "pull already in flight for this request: duplicate ignored");
                } else {
                    fresh.insert(req, meta);
                }
            }
            if fresh.is_empty() {
                continue;
            }
            if self.remote_agents.contains_key(&engine_id) {
                self.start_pulls(&engine_id, fresh.into_values().collect(), &me).await;
            } else if let Some(lookup) = self.lookups.get_mut(&engine_id) {
                lookup.queued.extend(fresh);
            } else {
                let bootstrap_addr = fresh.values().next().map(|m| m.remote_bootstrap_addr.clone()).unwrap_or_default();
                self.spawn_lookup(&engine_id, &bootstrap_addr, fresh, &me);
            }
        }
        for req in &msg.reqs_to_abort {
            self.abort(req).await;
        }
    }
}

impl Message<LookupDone> for Receiver {
    type Reply = ();

    /// Step 20's answer: cache every engine it names, then send (or fail) the queued pulls.
    async fn handle(&mut self, msg: LookupDone, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let Some(lookup) = self.lookups.remove(&msg.engine_id) else { return };
        let engine_id = msg.engine_id;
        let failure = match msg.result {
            Ok(answer) => {
                let named: Vec<String> = answer.engines.keys().map(EngineId::to_string).collect();
                self.remote_agents.extend(answer.engines);
                self.p_generations.extend(answer.generations);
                if self.remote_agents.contains_key(&engine_id) {
                    let me = ctx.actor_ref().clone();
                    self.start_pulls(&engine_id, lookup.queued.into_values().collect(), &me).await;
                    return;
                }
                let what = format!(
                    "P engine {engine_id} is not registered at bootstrap {} (its /query names {named:?}; is that P up and registered?)",
                    lookup.bootstrap_addr
                );
                TransferState::LookingUp.passed(self.args.bootstrap_timeout, what).to_string()
            }
            Err(reason) => {
                format!("bootstrap look-up of P engine {engine_id} at {} failed: {reason}", lookup.bootstrap_addr)
            }
        };
        for meta in lookup.queued.into_values() {
            self.complete(&meta, Some(LoadFailure::new(LoadFailureCause::Bootstrap, failure.clone())));
        }
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
                self.remote_agents.remove(&pull.engine_id);
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
            self.spawn_pull(&pull.engine_id, (&pull.worker_addr, pull.p_rank), &retry, &me).await;
        }
    }
}

impl Message<PullTransportFailed> for Receiver {
    type Reply = ();

    /// The side channel to a cached address failed: the bootstrap answer may be stale.
    async fn handle(&mut self, msg: PullTransportFailed, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.layout_acks.remove(&msg.worker_addr);
        let stale = self
            .remote_agents
            .get(&msg.remote_engine_id)
            .is_some_and(|w| w.values().flat_map(|pps| pps.values()).any(|a| *a == msg.worker_addr));
        if stale {
            tracing::warn!(engine_id = %msg.remote_engine_id, worker_addr = %msg.worker_addr, reason = %msg.reason,
                "side channel to P failed: its cached bootstrap answer is dropped, the next pull looks it up again");
            self.remote_agents.remove(&msg.remote_engine_id);
        }
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

impl Message<TransferStates> for Receiver {
    type Reply = BTreeMap<RequestId, TransferState>;

    /// Every request this Receiver tracks, in its lifecycle state.
    async fn handle(&mut self, _msg: TransferStates, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let looking_up =
            self.lookups.values().flat_map(|l| l.queued.keys()).map(|r| (r.clone(), TransferState::LookingUp));
        let pulling = self.in_flight.keys().map(|r| (r.clone(), TransferState::Pulling));
        let draining = self.draining.iter().map(|r| (r.clone(), TransferState::DrainingFence));
        looking_up.chain(pulling).chain(draining).collect()
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

/// Test-only: the PullTasks in flight (to kill one).
#[cfg(test)]
pub(crate) struct PullTaskRefs;

#[cfg(test)]
impl Message<PullTaskRefs> for Receiver {
    type Reply = Vec<ActorRef<PullTask>>;

    async fn handle(&mut self, _msg: PullTaskRefs, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.pulls.values().map(|p| p.task.clone()).collect()
    }
}
