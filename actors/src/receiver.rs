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
//! [`PullTask`]: crate::pull_task::PullTask
//! [`PullOutcome`]: pdflow_messages::receiver::PullOutcome
//! [`GetFinishedRecving`]: pdflow_messages::receiver::GetFinishedRecving
//!
//! What it leaves to others: the side-channel exchange and its deadline ([`PullTask`]), D's data
//! server (the node), what the scheduler does with a failure (the SchedulerConnector).
//!
//! Safety rules kept here: a request aborted while its pull is in flight stays in flight until P
//! answers or the pull's deadline passes (no write-after-free); a PullTask that dies without
//! reporting fails its requests (it is linked; best-effort `AbortPull` to P).
//!
//! This file is the actor: its state, start (step 5), [`StartLoadKv`] (step 19) and what it tracks.
//! Its jobs are in `receiver/`: `pulls` (the pulls in flight and their outcomes, steps 19 and 34),
//! `lookup` (bootstrap look-ups, cached and de-duplicated, step 20), `pairing` (which P workers
//! to pull from, step 21), `report` (finished and failed receives, steps 34 and 35) and `digests`
//! (the KV check of step 34).

#[cfg(test)]
mod bad_input_tests;
mod digests;
#[cfg(test)]
pub(crate) mod fake_peers;
pub(crate) mod lookup;
mod pairing;
mod pulls;
mod report;
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
use pdflow_messages::receiver::{StartLoadKv, TransferStates};
use pdflow_messages::scheduler_connector::LoadFailure;
use pdflow_messages::{EngineId, RequestId};
use pdflow_observability::{attrs, step_span, steps};
use pdflow_transfer::fence::WriteFence;
use tokio::task::JoinSet;

use crate::fault_seam::Faults;
use crate::ranks::WorkerRank;
use crate::side_channel_auth::PullAuth;
use crate::ActorError;

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

/// A P engine as a request names it: the bootstrap it is registered at and its engine id. Look-ups
/// and cached answers are keyed by both, so a request that names another bootstrap for an engine
/// id (a client's `kv_transfer_params` are not trusted) reaches no other request's pulls.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct EngineAt {
    pub bootstrap: String,
    pub engine_id: EngineId,
}

impl EngineAt {
    /// `engine_id` at the bootstrap `bootstrap` names, in one spelling (`http://host:port`, as the
    /// proxy writes it; vLLM's proxies may leave the scheme out), so that both name one entry.
    pub(crate) fn new(bootstrap: &str, engine_id: EngineId) -> Self {
        let base = bootstrap.trim().trim_end_matches('/');
        let bootstrap = if base.starts_with("http://") || base.starts_with("https://") {
            base.to_string()
        } else {
            format!("http://{base}")
        };
        Self { bootstrap, engine_id }
    }
}

impl std::fmt::Display for EngineAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "P engine {} (bootstrap {})", self.engine_id, self.bootstrap)
    }
}

/// A D worker's receiver.
#[derive(Debug)]
pub struct Receiver {
    args: ReceiverArgs,
    layout: KvLayout,
    http: reqwest::Client,
    /// P engine → its workers (vLLM's `_remote_agents`), only as its own bootstrap named them.
    remote_agents: HashMap<EngineAt, WorkerAddrs>,
    lookups: HashMap<EngineAt, lookup::Lookup>,
    /// P worker address → the layout id it acknowledged.
    layout_acks: HashMap<String, u64>,
    /// P worker address → its generation, from bootstrap or its last answer: every
    /// pull names it, so that a restarted worker refuses at once what its predecessor held.
    p_generations: HashMap<String, u64>,
    in_flight: HashMap<RequestId, pulls::Recv>,
    pulls: HashMap<u64, pulls::Pull>,
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
        self.pull_task_died(pull_id, &reason);
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
        let mut by_engine: HashMap<EngineAt, BTreeMap<RequestId, _>> = HashMap::new();
        for (engine_id, metas) in msg.reqs_to_recv {
            for (req, meta) in metas {
                if self.is_known(&req) {
                    tracing::warn!(request_id = %req, "pull already in flight for this request: duplicate ignored");
                } else {
                    let engine = EngineAt::new(&meta.remote_bootstrap_addr, engine_id.clone());
                    by_engine.entry(engine).or_default().insert(req, meta);
                }
            }
        }
        for (engine, fresh) in by_engine {
            if self.remote_agents.contains_key(&engine) {
                self.start_pulls(&engine, fresh.into_values().collect(), &me).await;
            } else if let Some(lookup) = self.lookups.get_mut(&engine) {
                lookup.queued.extend(fresh);
            } else {
                self.spawn_lookup(engine, fresh, &me);
            }
        }
        for req in &msg.reqs_to_abort {
            self.abort(req).await;
        }
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

/// Test-only: the PullTasks in flight (to kill one).
#[cfg(test)]
pub(crate) struct PullTaskRefs;

#[cfg(test)]
impl Message<PullTaskRefs> for Receiver {
    type Reply = Vec<ActorRef<crate::pull_task::PullTask>>;

    async fn handle(&mut self, _msg: PullTaskRefs, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.pulls.values().map(|p| p.task.clone()).collect()
    }
}
