//! SenderListener — one per P worker: the side-channel socket (ZeroMQ ROUTER) and the registration
//! with bootstrap (seed steps 1, 3, 4, 21 receive side, 30 reply).
//!
//! On start it records the worker's KV regions (step 3), binds the ROUTER on a random port and
//! registers `tcp://host:port` with bootstrap (step 4, with back-off). It then routes, and only
//! routes: each transfer_id has one [`SendWorker`] (spawned on first sight, from P's scheduler
//! record or D's pull, whichever comes first), and the table `transfer_id → SendWorker` is its only
//! routing state. It never waits on a transfer itself.
//!
//! - `LayerSaved` (step 29, layer-wise): each finished layer → `LayerDone` to the request's worker.
//! - `RecordSendReqs` (steps 14, 27): `reqs_to_send` without blocks → `RecordSendPending`; with
//!   blocks → `RecordSendReady`; `reqs_not_processed` → `AbortSend{Producer}`.
//! - D's frames: a `PullRequest` is checked (layout cached per D engine and `layout_id`), tracked,
//!   and each request routed as `ServePull`; an `AbortPull` becomes `AbortSend{Consumer}` (one naming
//!   more than `MAX_ABORT_IDS` is refused unread and counted); a garbage frame is answered with an
//!   error response and the listener keeps serving.
//! - `SendOutcome`s come back from the workers: the listener answers D (`Continue` / `Finish`,
//!   step 30) and collects finished_sending (step 31), which P's worker fetches with
//!   `GetFinishedSending` (step 32 is the scheduler connector's).
//!
//! Its parts: [`pull`] (a pull checked, routed and answered), `side_channel` (the ROUTER socket),
//! [`limits`] (what a peer may make that socket hold), `register` (the bootstrap registration),
//! [`lineage`] (generations across restarts).

#[cfg(test)]
mod auth_tests;
pub mod limits;
#[cfg(test)]
mod limits_tests;
pub mod lineage;
#[cfg(test)]
mod protected_tests;
mod pull;
mod register;
mod side_channel;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kameo::prelude::*;
use pdflow_auth::Refusal;
use pdflow_kv::memory::KvCache;
use pdflow_messages::bootstrap::RegisterWorker;
use pdflow_messages::layout::KvLayout;
use pdflow_messages::send_worker::{
    AbortSend, AbortSource, LayerDone, RecordSendPending, RecordSendReady, SendOutcome,
};
use pdflow_messages::sender_listener::{
    GetFinishedSending, InFlightPulls, LayerSaved, PullErr, PullErrorCause, PullResponse, RecordSendReqs, RequestError,
    SideChannelAddr, SideChannelRequest,
};
use pdflow_messages::{EngineId, RequestId, TransferId};
use pdflow_observability::{attrs, step_span, steps, Outcome};
use pdflow_transfer::TransferEngine;
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::error::SideChannelError;
use crate::fault_seam::{register_actor, ActorKind, Faults, Role};
use crate::ranks::WorkerRank;
use crate::send_worker::{SendWorker, SendWorkerArgs};
use crate::side_channel_auth::{ListenerAuth, ReplyNonces};
use crate::ActorError;
use side_channel::{Outgoing, SideChannelFrame, SocketClosed};

/// What a SenderListener is started with.
#[derive(Clone)]
pub struct SenderListenerArgs {
    pub engine_id: EngineId,
    pub dp_rank: u32,
    /// This worker's tensor and pipeline position, and the model it shards.
    pub rank: WorkerRank,
    /// The host the ROUTER binds (`tcp://{bind_host}:0`) and that D connects to, e.g. `127.0.0.1`.
    pub bind_host: String,
    /// The ROUTER's port, shared by every incarnation of this listener: 0 binds any port and
    /// records it here, so a listener restarted by its supervisor binds the same address and its
    /// re-registration with bootstrap is identical (not a conflict).
    pub side_channel_port: Arc<AtomicU16>,
    /// Bootstrap's base URL, e.g. `http://127.0.0.1:8998`; `None` = do not register.
    pub bootstrap_url: Option<String>,
    pub kv_cache: Arc<KvCache>,
    pub transfer: Arc<dyn TransferEngine>,
    /// How long a pull may wait for P's prefill (vLLM: VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT).
    pub ready_timeout: Duration,
    /// After ready, how long P keeps blocks that D never pulls (step 27's expire_time).
    pub send_expiry: Duration,
    /// `POST /register` attempts, and the first back-off (doubling after each failure).
    pub register_attempts: u32,
    pub register_backoff: Duration,
    /// Notified whenever finished_sending gains entries.
    pub events: Arc<Notify>,
    /// Record `pd.kv_checksum` of the sent blocks on step 29.
    pub verify_checksums: bool,
    /// Shared by every incarnation of this listener (restarts clone the args): the generations
    /// registered and which one recorded each transfer ready (see [`lineage`]).
    pub lineage: Arc<lineage::ListenerLineage>,
    /// The node's fault seam ([`crate::fault_seam::no_faults`] in production).
    pub faults: Faults,
    /// The cluster secret's checks of D's requests (none without a secret).
    pub auth: ListenerAuth,
}

/// One SendWorker in the routing table.
struct WorkerEntry {
    actor: ActorRef<SendWorker>,
    generation: u64,
    /// P's request once ready was recorded (to free its blocks if the worker dies).
    ready_p_req: Option<RequestId>,
    /// The P request this transfer belongs to, from its first record: another P request naming
    /// the same transfer_id is refused, never routed to this worker.
    owner: Option<RequestId>,
    counted: bool,
}

/// A pull still owed responses.
struct InFlightPull {
    identity: Bytes,
    /// D's pull id (echoed in every response).
    pull_id: u64,
    layout_id: u64,
    /// d_req_id → transfer_id, for the requests not settled yet.
    remaining: BTreeMap<RequestId, TransferId>,
}

/// P's side-channel endpoint and router of transfers.
pub struct SenderListener {
    args: SenderListenerArgs,
    addr: String,
    /// The side-channel socket this incarnation reads.
    socket_id: u64,
    replies: mpsc::UnboundedSender<Outgoing>,
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    workers: HashMap<TransferId, WorkerEntry>,
    next_generation: u64,
    /// D's layouts, by (D engine id, layout_id) (seed step 22: cached per layout_id).
    layouts: HashMap<(String, u64), KvLayout>,
    /// Pulls by the listener's own key (D's pull ids are only unique per D worker).
    pulls: HashMap<u64, InFlightPull>,
    next_pull_key: u64,
    finished_sending: BTreeSet<RequestId>,
    /// The nonces this listener's answers are sealed to, by D pull task.
    reply_nonces: ReplyNonces,
    /// Transfers whose KV P has released (sent, or expired), with when: a later pull for one is
    /// refused at once (`Expired`) instead of waiting `ready_timeout` for a ready that never comes.
    retired: HashMap<TransferId, std::time::Instant>,
    /// This incarnation's generation (registered with bootstrap, sent in every answer): a pull
    /// addressed to another generation for a transfer this one does not know is refused at once.
    p_generation: u64,
}

/// How long before D's pull deadline P stops writing D's blocks (at most half the deadline): a
/// system call of the same-host path in progress then (at most 32 MiB) ends long before D gives
/// the blocks up.
const WRITE_MARGIN: Duration = Duration::from_secs(1);

/// A new worker generation: the wall clock in nanoseconds, and strictly larger than any this
/// process handed out before (a listener restarted by its supervisor within the same nanosecond,
/// or after the clock stepped back, still counts up; across processes the clock orders them).
fn new_generation() -> u64 {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64).max(1);
    let prev = LAST.fetch_update(Ordering::AcqRel, Ordering::Acquire, |last| Some(now.max(last + 1))).unwrap_or(0);
    now.max(prev + 1)
}

impl Actor for SenderListener {
    type Args = SenderListenerArgs;
    type Error = ActorError;

    async fn on_start(args: Self::Args, actor_ref: ActorRef<Self>) -> Result<Self, Self::Error> {
        // Step 1 spans the whole start-up; it is never entered across an await.
        let init = step_span!(steps::ENGINE_INIT);
        init.record(attrs::ENGINE_ID, args.engine_id.as_str());
        init.in_scope(|| {
            let span = step_span!(steps::REGISTER_KV_CACHES);
            span.record(attrs::ENGINE_ID, args.engine_id.as_str());
            span.record(attrs::BLOCKS, args.kv_cache.num_blocks() as u64);
            span.record(attrs::BYTES, args.kv_cache.regions().iter().map(|r| r.len).sum::<u64>());
        });
        let cancel = CancellationToken::new();
        let port = args.side_channel_port.load(Ordering::Acquire);
        let channel = side_channel::start(
            &args.bind_host,
            port,
            &args.auth,
            args.ready_timeout,
            actor_ref.clone(),
            cancel.clone(),
        )
        .await?;
        args.side_channel_port.store(channel.port, Ordering::Release);
        let listener = Self {
            socket_id: channel.socket_id,
            addr: channel.addr,
            replies: channel.replies,
            cancel,
            tasks: channel.tasks,
            workers: HashMap::new(),
            next_generation: 0,
            layouts: HashMap::new(),
            pulls: HashMap::new(),
            next_pull_key: 0,
            finished_sending: BTreeSet::new(),
            reply_nonces: ReplyNonces::default(),
            retired: HashMap::new(),
            p_generation: new_generation(),
            args,
        };
        listener.args.lineage.started(listener.p_generation);
        if let Some(url) = listener.args.bootstrap_url.clone() {
            let span = step_span!(steps::BOOTSTRAP_REGISTER);
            span.record(attrs::ENGINE_ID, listener.args.engine_id.as_str());
            let body = RegisterWorker {
                engine_id: listener.args.engine_id.clone(),
                dp_rank: listener.args.dp_rank,
                tp_rank: listener.args.rank.tp_rank,
                pp_rank: listener.args.rank.pp_rank,
                addr: listener.addr.clone(),
                generation: listener.p_generation,
            };
            let body_again = body.clone();
            let registered = register::register_with_bootstrap(
                &url,
                &body,
                listener.args.register_attempts,
                listener.args.register_backoff,
                listener.args.auth.secret(),
            )
            .instrument(span.clone())
            .await;
            if let Err(e) = registered {
                Outcome::FAILED.record(&span);
                listener.cancel.cancel();
                return Err(e);
            }
            Outcome::Ok.record(&span);
            let mut listener = listener;
            listener.tasks.push(tokio::spawn(register::keep_registered(
                url,
                body_again,
                listener.args.auth.secret().cloned(),
                listener.cancel.clone(),
            )));
            tracing::info!(engine_id = %listener.args.engine_id, addr = %listener.addr, "sender listener serving the side channel");
            drop(init);
            return Ok(listener);
        }
        tracing::info!(engine_id = %listener.args.engine_id, addr = %listener.addr, "sender listener serving the side channel");
        drop(init);
        Ok(listener)
    }

    async fn on_link_died(
        &mut self,
        _: WeakActorRef<Self>,
        id: ActorId,
        reason: ActorStopReason,
    ) -> Result<ControlFlow<ActorStopReason>, Self::Error> {
        if matches!(reason, ActorStopReason::Normal) {
            return Ok(ControlFlow::Continue(()));
        }
        let Some(transfer_id) = self.workers.iter().find(|(_, e)| e.actor.id() == id).map(|(t, _)| t.clone()) else {
            return Ok(ControlFlow::Continue(()));
        };
        tracing::error!(transfer_id = %transfer_id, reason = ?reason, "send worker died: failing its pulls");
        if let Some(entry) = self.workers.remove(&transfer_id) {
            if let (Some(p_req_id), false) = (entry.ready_p_req, entry.counted) {
                // Its write task was aborted with it: nothing reads P's blocks any more.
                self.mark_sent(p_req_id);
            }
        }
        let owed: Vec<(u64, RequestId)> = self
            .pulls
            .iter()
            .flat_map(|(key, p)| {
                p.remaining.iter().filter(|(_, t)| **t == transfer_id).map(move |(d, _)| (*key, d.clone()))
            })
            .collect();
        for (key, d_req_id) in owed {
            let err = PullErr {
                d_req_id: d_req_id.clone(),
                cause: PullErrorCause::TransferFailed,
                detail: format!("P's send worker died: {reason:?}"),
            };
            self.settle(key, &d_req_id, Err(err));
        }
        Ok(ControlFlow::Continue(()))
    }

    async fn on_stop(&mut self, _: WeakActorRef<Self>, _reason: ActorStopReason) -> Result<(), Self::Error> {
        self.cancel.cancel();
        for task in self.tasks.drain(..) {
            task.abort();
        }
        for (_, entry) in self.workers.drain() {
            entry.actor.kill();
        }
        Ok(())
    }
}

impl SenderListener {
    /// Whether `transfer_id` belongs to a P request other than `p_req_id` (two requests named the
    /// same transfer: a client's mistake or an attack). The first is left alone. The second is
    /// never routed: once it is ready (`ready`: its prefill done, its blocks held for D) it is
    /// reported sent at once, so the engine frees its blocks instead of holding them for a pull
    /// that would reach the first. Otherwise `p_req_id` claims the transfer.
    async fn claimed_by_another(
        &mut self,
        transfer_id: &TransferId,
        p_req_id: &RequestId,
        ready: bool,
        me: &ActorRef<Self>,
    ) -> bool {
        let entry = match self.workers.get(transfer_id) {
            Some(_) => self.workers.get_mut(transfer_id),
            None => {
                self.worker(transfer_id, me).await;
                self.workers.get_mut(transfer_id)
            }
        };
        let Some(entry) = entry else { return false };
        match &entry.owner {
            None => {
                entry.owner = Some(p_req_id.clone());
                false
            }
            Some(owner) if owner == p_req_id => false,
            Some(owner) => {
                tracing::warn!(transfer_id = %transfer_id, request_id = %p_req_id, owner = %owner,
                    "a second P request names a transfer_id in use: it is not held for D (transfer ids must be unique per request)");
                if ready {
                    self.finished_sending.insert(p_req_id.clone());
                    self.args.events.notify_waiters();
                    self.args.events.notify_one();
                }
                true
            }
        }
    }

    /// The SendWorker of `transfer_id`, spawned (as a placeholder if need be) on first sight.
    async fn worker(&mut self, transfer_id: &TransferId, me: &ActorRef<Self>) -> ActorRef<SendWorker> {
        if let Some(entry) = self.workers.get(transfer_id) {
            return entry.actor.clone();
        }
        self.next_generation += 1;
        let args = SendWorkerArgs {
            transfer_id: transfer_id.clone(),
            generation: self.next_generation,
            listener: me.clone().recipient::<SendOutcome>().downgrade(),
            kv_cache: self.args.kv_cache.clone(),
            transfer: self.args.transfer.clone(),
            ready_timeout: self.args.ready_timeout,
            send_expiry: self.args.send_expiry,
            verify_checksums: self.args.verify_checksums,
            faults: self.args.faults.clone(),
            rank: self.args.rank,
        };
        // Unbounded: the listener never waits on a worker's mailbox (workers wait on the listener's).
        let actor = SendWorker::spawn_link_with_mailbox(me, args, mailbox::unbounded()).await;
        register_actor(&self.args.faults, ActorKind::SendWorker, Role::P, vec![transfer_id.clone()], &actor);
        self.workers.insert(
            transfer_id.clone(),
            WorkerEntry {
                actor: actor.clone(),
                generation: self.next_generation,
                ready_p_req: None,
                owner: None,
                counted: false,
            },
        );
        actor
    }

    /// Whether `transfer_id`'s KV was released recently (tombstones older than `ready_timeout`
    /// are dropped: by then a pull would have failed its wait for ready anyway).
    fn is_retired(&mut self, transfer_id: &TransferId) -> bool {
        let keep = self.args.ready_timeout;
        self.retired.retain(|_, at| at.elapsed() < keep);
        self.retired.contains_key(transfer_id)
    }

    async fn tell_worker<M>(&mut self, transfer_id: &TransferId, msg: M, me: &ActorRef<Self>)
    where
        SendWorker: Message<M>,
        M: Send + 'static,
    {
        let worker = self.worker(transfer_id, me).await;
        if let Err(e) = worker.tell(msg).await {
            tracing::error!(transfer_id = %transfer_id, error = %e, "send worker did not take a message");
        }
    }
}

impl Message<SideChannelAddr> for SenderListener {
    type Reply = String;

    async fn handle(&mut self, _: SideChannelAddr, _: &mut Context<Self, Self::Reply>) -> String {
        self.addr.clone()
    }
}

impl Message<InFlightPulls> for SenderListener {
    type Reply = usize;

    async fn handle(&mut self, _: InFlightPulls, _: &mut Context<Self, Self::Reply>) -> usize {
        self.pulls.len()
    }
}

impl Message<GetFinishedSending> for SenderListener {
    type Reply = BTreeSet<RequestId>;

    async fn handle(&mut self, _: GetFinishedSending, _: &mut Context<Self, Self::Reply>) -> BTreeSet<RequestId> {
        std::mem::take(&mut self.finished_sending)
    }
}

impl Message<RecordSendReqs> for SenderListener {
    type Reply = ();

    /// Steps 14 and 27 (routing), and P's aborted requests.
    async fn handle(&mut self, msg: RecordSendReqs, ctx: &mut Context<Self, Self::Reply>) {
        let me = ctx.actor_ref().clone();
        for (p_req_id, (transfer_id, block_ids)) in msg.reqs_to_send {
            if self.claimed_by_another(&transfer_id, &p_req_id, !block_ids.is_empty(), &me).await {
                continue;
            }
            // The request's trace, whether or not D's pull (which carries it too) came first.
            let traceparent = msg.traceparents.get(&p_req_id).cloned();
            if block_ids.is_empty() {
                let pending = RecordSendPending { p_req_id, transfer_id: transfer_id.clone(), traceparent };
                self.tell_worker(&transfer_id, pending, &me).await;
            } else {
                self.worker(&transfer_id, &me).await;
                if let Some(entry) = self.workers.get_mut(&transfer_id) {
                    entry.ready_p_req = Some(p_req_id.clone());
                }
                let ttl = self.args.ready_timeout + self.args.send_expiry;
                self.args.lineage.ready(&transfer_id, self.p_generation, ttl);
                self.tell_worker(
                    &transfer_id,
                    RecordSendReady { p_req_id, transfer_id: transfer_id.clone(), block_ids, traceparent },
                    &me,
                )
                .await;
            }
        }
        for transfer_id in msg.reqs_not_processed {
            self.tell_worker(
                &transfer_id,
                AbortSend { transfer_id: transfer_id.clone(), source: AbortSource::Producer },
                &me,
            )
            .await;
        }
    }
}

impl Message<LayerSaved> for SenderListener {
    type Reply = ();

    /// Step 29, layer-wise: one finished layer of the step's prefills, to each one's SendWorker.
    async fn handle(&mut self, msg: LayerSaved, ctx: &mut Context<Self, Self::Reply>) {
        let me = ctx.actor_ref().clone();
        for (p_req_id, save) in msg.reqs {
            let done = LayerDone {
                p_req_id,
                layer: msg.layer,
                block_ids: save.block_ids,
                computed_upto: save.computed_upto,
                prompt_len: save.prompt_len,
            };
            self.tell_worker(&save.transfer_id, done, &me).await;
        }
    }
}

impl Message<SideChannelFrame> for SenderListener {
    type Reply = ();

    async fn handle(&mut self, msg: SideChannelFrame, ctx: &mut Context<Self, Self::Reply>) {
        let SideChannelFrame { socket_id, identity, frames } = msg;
        if socket_id != self.socket_id {
            return; // a late frame of a previous incarnation's socket
        }
        let (body, nonce) = match self.args.auth.open(&identity, &frames) {
            Ok(opened) => opened,
            Err(why) => {
                // Nothing of a refused request is read further: no pull, no write.
                tracing::debug!(addr = %self.addr, "side-channel request not served: {why}");
                self.send(identity, &PullResponse::error(0, why.to_string()));
                return;
            }
        };
        match SideChannelRequest::decode(body) {
            Err(e @ RequestError::TooManyIds { .. }) => {
                // Refused unread: each id could cost a SendWorker. D splits its aborts.
                self.args.auth.refuse(&identity, Refusal::TooManyIds);
                self.send(identity, &PullResponse::error(0, e.to_string()));
            }
            Err(e) => {
                tracing::warn!(addr = %self.addr, error = %e, "garbage side-channel frame answered with an error");
                self.send(identity, &PullResponse::error(0, e.to_string()));
            }
            Ok(SideChannelRequest::Pull(pull)) => {
                if let Some(nonce) = nonce {
                    self.reply_nonces.insert(identity.clone(), nonce);
                }
                let me = ctx.actor_ref().clone();
                self.on_pull(identity, pull, &me).await;
            }
            Ok(SideChannelRequest::Abort(abort)) => {
                let me = ctx.actor_ref().clone();
                tracing::info!(pull_id = abort.pull_id, transfers = abort.transfer_ids.len(), "D aborted transfers");
                for transfer_id in abort.transfer_ids {
                    self.tell_worker(
                        &transfer_id,
                        AbortSend { transfer_id: transfer_id.clone(), source: AbortSource::Consumer },
                        &me,
                    )
                    .await;
                }
            }
        }
    }
}

impl Message<SocketClosed> for SenderListener {
    type Reply = Result<(), ActorError>;

    /// The socket is gone: fail, so that the supervisor restarts the listener on its address.
    /// A previous incarnation's socket closing is expected and ignored.
    async fn handle(&mut self, msg: SocketClosed, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        if msg.socket_id != self.socket_id {
            return Ok(());
        }
        tracing::error!(addr = %self.addr, reason = %msg.error, "side-channel socket closed: the sender listener fails and is restarted");
        Err(ActorError::SideChannel { addr: self.addr.clone(), error: SideChannelError::Closed(msg.error) })
    }
}

impl Message<SendOutcome> for SenderListener {
    type Reply = ();

    /// Steps 30 and 31: answer D, collect finished_sending, retire finished workers.
    async fn handle(&mut self, msg: SendOutcome, _: &mut Context<Self, Self::Reply>) {
        let current = self.workers.get(&msg.transfer_id).is_some_and(|e| e.generation == msg.generation);
        if msg.counts_as_sent {
            if let Some(p_req_id) = msg.p_req_id.clone() {
                if current {
                    if let Some(entry) = self.workers.get_mut(&msg.transfer_id) {
                        entry.counted = true;
                    }
                }
                // Recorded before D's answer goes out: once D has its answer, P's report includes it.
                self.mark_sent(p_req_id);
            }
        }
        if let Some(reply) = msg.reply {
            self.settle(reply.pull_id, &reply.d_req_id, reply.result);
        }
        if msg.finished && current {
            if let Some(entry) = self.workers.remove(&msg.transfer_id) {
                if entry.counted || msg.counts_as_sent {
                    self.retired.insert(msg.transfer_id.clone(), std::time::Instant::now());
                    self.args.lineage.retired(&msg.transfer_id);
                }
                // Messages already queued to it are still handled (a finished worker answers them).
                if entry.actor.stop_gracefully().await.is_err() {
                    tracing::debug!(transfer_id = %msg.transfer_id, "send worker already stopped");
                }
            }
        }
    }
}
