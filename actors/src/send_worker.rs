//! SendWorker — one per transfer_id on a P worker: wait for `ready`, plan, write, report
//! (seed steps 14, 22, 27, 28, 29, 31).
//!
//! The [`crate::sender_listener::SenderListener`] spawns one SendWorker per transfer_id, either when
//! P's scheduler first names the request (step 14, [`RecordSendPending`]) or when D's pull arrives
//! first (step 22, a placeholder). The worker then:
//! - waits for [`RecordSendReady`] (step 27) with a deadline (`ready_timeout`) for each waiting pull,
//!   while the transfer engine makes the data channel to D ready (connections, handshakes);
//! - builds the transfer plan (step 28, coalesced descriptors) and writes it into D's memory through
//!   the [`TransferEngine`] in a task it owns (step 29); the mailbox never waits on the write;
//! - marks the request sent (step 31) and reports a [`SendOutcome`] to the listener, which answers
//!   D on the side channel (step 30) and adds the P request to finished_sending.
//!
//! Rules kept here: P's blocks are counted as sent (so P frees them) exactly once, and only once
//! nothing reads them any more (write ended, or no write will ever start); after ready, a transfer
//! that D never pulls expires after `send_expiry`; a request P aborted (reqs_not_processed) answers
//! every pull with `Aborted` at once and is never counted. The worker never stops itself: it reports
//! `finished` and the listener removes it from its routing table, then stops it.
//!
//! # Layout
//! - this file — the worker's state, its reports to the listener, P's records (steps 14, 27) and
//!   D's pulls (step 22);
//! - [`write`] — the plan, the write and its end (steps 28, 29, 31);
//! - [`stream`] — layer-wise: the layers P has finished, written to D while P still prefills;
//! - [`ranks`] — across tensor/pipeline ranks: which D ranks pull from this worker, each one's plan;
//! - [`ending`] — deadlines, expiry, linger and aborts: how a transfer ends without a write;
//! - [`error`] — why a pull could not be planned or written.

mod ending;
mod error;
mod ranks;
mod stream;
mod write;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use kameo::prelude::*;
use pdflow_kv::memory::KvCache;
use pdflow_messages::kv_groups::GroupBlocks;
use pdflow_messages::lifecycle::TransferState;
use pdflow_messages::send_worker::{PullReply, RecordSendPending, RecordSendReady, SendOutcome, ServePull};
use pdflow_messages::sender_listener::{PullErr, PullErrorCause};
use pdflow_messages::{RequestId, TransferId};
use pdflow_observability::{attrs, step_span, steps};
use pdflow_transfer::{TransferEngine, TransferStats};
use tokio::task::JoinHandle;
use tracing::Span;

use crate::fault_seam::Faults;
use crate::ranks::WorkerRank;
use crate::ActorError;
use pdflow_observability::Outcome;

pub use error::{PullPlanError, WriteError};

/// What a SendWorker is given by the listener.
#[derive(Clone)]
pub struct SendWorkerArgs {
    pub transfer_id: TransferId,
    /// The listener's number for this worker, echoed in every [`SendOutcome`].
    pub generation: u64,
    /// Where outcomes go (the listener); weak, so a worker never keeps its listener alive.
    pub listener: WeakRecipient<SendOutcome>,
    pub kv_cache: Arc<KvCache>,
    pub transfer: Arc<dyn TransferEngine>,
    /// How long a pull waits for P's prefill to finish (step 22's deadline).
    pub ready_timeout: Duration,
    /// After ready, how long P keeps the blocks if D never pulls (step 27's expire_time).
    pub send_expiry: Duration,
    /// Record `pd.kv_checksum` of the sent blocks on step 29.
    pub verify_checksums: bool,
    /// The node's fault seam: step 29 takes its engine there.
    pub faults: Faults,
    /// This P worker's tensor and pipeline position: which D ranks pull from it and what of its
    /// KV each gets.
    pub rank: WorkerRank,
}

/// Where the transfer stands (the P side of [`TransferState`], plus the end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// P's blocks are not final yet (or P's request is not known yet); a pull waits here for
    /// `ready_timeout`.
    Waiting,
    /// Ready (step 27): P's block ids are known and held, for `send_expiry` if D never pulls.
    Ready,
    /// The write task runs, under the transfer engine's write deadline.
    Writing,
    /// Reported `finished`; the listener is about to stop this worker.
    Finished,
}

impl Phase {
    /// The lifecycle state this phase is, and so its deadline (`Finished` is terminal: the
    /// `Writing` entry stands for it, never used).
    fn state(self) -> TransferState {
        match self {
            Phase::Waiting => TransferState::WaitingForPrefill,
            Phase::Ready => TransferState::HeldForPull,
            Phase::Writing | Phase::Finished => TransferState::Writing,
        }
    }
}

/// A scheduled self-message (a timer); aborted when no longer wanted.
type Timer<M> = JoinHandle<Result<(), SendError<M>>>;

/// A pull waiting for ready (step 22), with its span and deadline.
struct WaitingPull {
    pull: ServePull,
    span: Span,
    deadline: Option<Timer<ReadyDeadline>>,
}

/// The write in flight (step 29).
struct Writing {
    pull: ServePull,
    span: Span,
    task: JoinHandle<()>,
    answer: WriteAnswer,
}

/// What the write's end reports besides its own figures.
struct WriteAnswer {
    /// P's digest of each block written, in D's order (with `verify_checksums`; else empty).
    digests: Vec<u64>,
    /// Layer-wise: bytes and descriptors the layer writes moved before this one.
    streamed: (u64, usize),
}

/// One transfer on P.
pub struct SendWorker {
    args: SendWorkerArgs,
    p_req_id: Option<RequestId>,
    local_block_ids: GroupBlocks,
    phase: Phase,
    pulls: VecDeque<WaitingPull>,
    writing: Option<Writing>,
    /// P's request was aborted or failed (reqs_not_processed): its KV will never exist.
    producer_aborted: bool,
    /// D gave the transfer up (AbortPull, or its pull timed out): free P's blocks once ready.
    consumer_gone: bool,
    /// finished_sending was reported already.
    counted: bool,
    timer_epoch: u64,
    expiry: Option<(u64, Timer<ExpiryDue>)>,
    linger: Option<(u64, Timer<LingerDue>)>,
    /// The data channel to D made ready while P still prefills (see [`SendWorker::prepare`]).
    preparing: Option<JoinHandle<()>>,
    /// Layer-wise: the layers P has finished and what of them is in D's blocks.
    stream: Option<stream::Stream>,
    /// Across ranks: how many D ranks pull from this worker (known at the first pull), and the
    /// ones served so far (their index among D's ranks).
    pullers: Option<usize>,
    served: std::collections::BTreeSet<usize>,
}

/// Timer: a waiting pull's ready deadline passed.
struct ReadyDeadline {
    pull_id: u64,
    d_req_id: RequestId,
}

/// Timer: ready, but D did not pull within `send_expiry`.
struct ExpiryDue {
    epoch: u64,
}

/// Timer: a placeholder or aborted transfer has lingered long enough to answer late messages.
struct LingerDue {
    epoch: u64,
}

/// The write task's result.
struct WriteDone {
    result: Result<TransferStats, WriteError>,
}

impl Actor for SendWorker {
    type Args = SendWorkerArgs;
    type Error = ActorError;

    async fn on_start(args: Self::Args, _actor_ref: ActorRef<Self>) -> Result<Self, Self::Error> {
        Ok(Self {
            args,
            p_req_id: None,
            local_block_ids: GroupBlocks::default(),
            phase: Phase::Waiting,
            pulls: VecDeque::new(),
            writing: None,
            producer_aborted: false,
            consumer_gone: false,
            counted: false,
            timer_epoch: 0,
            expiry: None,
            linger: None,
            preparing: None,
            stream: None,
            pullers: None,
            served: Default::default(),
        })
    }

    async fn on_stop(&mut self, _: WeakActorRef<Self>, _reason: ActorStopReason) -> Result<(), Self::Error> {
        self.cancel_timers();
        for p in self.pulls.drain(..) {
            if let Some(d) = p.deadline {
                d.abort();
            }
        }
        if let Some(p) = self.preparing.take() {
            p.abort();
        }
        if let Some(task) = self.stream.as_mut().and_then(stream::Stream::take_in_flight) {
            task.abort();
        }
        if let Some(w) = self.writing.take() {
            tracing::warn!(transfer_id = %self.args.transfer_id, "send worker stopped while writing: the write is aborted");
            w.task.abort();
        }
        Ok(())
    }
}

impl SendWorker {
    fn cancel_timers(&mut self) {
        if let Some((_, h)) = self.expiry.take() {
            h.abort();
        }
        if let Some((_, h)) = self.linger.take() {
            h.abort();
        }
    }

    fn next_epoch(&mut self) -> u64 {
        self.timer_epoch += 1;
        self.timer_epoch
    }

    fn arm_expiry(&mut self, me: &ActorRef<Self>) {
        let epoch = self.next_epoch();
        let handle = me.tell(ExpiryDue { epoch }).send_after(self.args.send_expiry);
        if let Some((_, old)) = self.expiry.replace((epoch, handle)) {
            old.abort();
        }
    }

    fn arm_linger(&mut self, me: &ActorRef<Self>, after: Duration) {
        let epoch = self.next_epoch();
        let handle = me.tell(LingerDue { epoch }).send_after(after);
        if let Some((_, old)) = self.linger.replace((epoch, handle)) {
            old.abort();
        }
    }

    fn err(d_req_id: &RequestId, cause: PullErrorCause, detail: impl Into<String>) -> PullErr {
        PullErr { d_req_id: d_req_id.clone(), cause, detail: detail.into() }
    }

    /// Sends one outcome to the listener. `counts_as_sent` is honoured at most once, and only for a
    /// request P has named (steps 27, 31).
    async fn report(&mut self, reply: Option<PullReply>, counts_as_sent: bool, finished: bool) {
        let counts = counts_as_sent && !self.counted && self.p_req_id.is_some();
        if counts {
            self.counted = true;
        }
        if finished {
            self.phase = Phase::Finished;
            self.cancel_timers();
        }
        let outcome = SendOutcome {
            transfer_id: self.args.transfer_id.clone(),
            generation: self.args.generation,
            p_req_id: self.p_req_id.clone(),
            reply,
            counts_as_sent: counts,
            finished,
        };
        match self.args.listener.upgrade() {
            Some(listener) => {
                if let Err(e) = listener.tell(outcome).await {
                    tracing::warn!(transfer_id = %self.args.transfer_id, error = %e, "sender listener did not take a send outcome");
                }
            }
            None => {
                tracing::warn!(transfer_id = %self.args.transfer_id, "sender listener is gone: send outcome dropped")
            }
        }
    }

    async fn reply_err(&mut self, pull: &ServePull, err: PullErr, counts_as_sent: bool, finished: bool) {
        let reply = PullReply { pull_id: pull.pull_id, d_req_id: pull.d_req_id.clone(), result: Err(err) };
        self.report(Some(reply), counts_as_sent, finished).await;
    }

    /// A pull came before P's prefill finished (step 22): the transfer engine gets the data channel
    /// to D ready meanwhile (connections, handshakes, the path), in a task this actor owns and
    /// bounded by the engine's connect deadline, so that the write starts at once at ready.
    fn prepare(&mut self, peer: &str) {
        if self.preparing.as_ref().is_some_and(|p| !p.is_finished()) {
            return;
        }
        let (transfer, peer, transfer_id) =
            (self.args.transfer.clone(), peer.to_string(), self.args.transfer_id.clone());
        self.preparing = Some(tokio::spawn(async move {
            if let Err(e) = transfer.prepare(&peer).await {
                tracing::debug!(%transfer_id, %peer, error = %e, "could not prepare the data channel ahead of the write (the write connects itself)");
            }
        }));
    }
}

impl Message<RecordSendPending> for SendWorker {
    type Reply = ();

    /// Step 14: SendBlockMeta created, ready not set.
    async fn handle(&mut self, msg: RecordSendPending, _ctx: &mut Context<Self, Self::Reply>) {
        let span = step_span!(
            steps::P_RECORD_SEND_PENDING,
            request_id = msg.p_req_id.as_str(),
            transfer_id = self.args.transfer_id.as_str()
        );
        if let Some(tp) = &msg.traceparent {
            span.record(attrs::TRACEPARENT, tp.as_str());
        }
        let _span = span.entered();
        if self.p_req_id.is_none() {
            self.p_req_id = Some(msg.p_req_id);
        }
        // A placeholder became a real request: P will either set ready or abort it.
        if self.phase == Phase::Waiting && !self.producer_aborted {
            if let Some((_, h)) = self.linger.take() {
                h.abort();
            }
        }
    }
}

impl Message<RecordSendReady> for SendWorker {
    type Reply = ();

    /// Step 27: block ids recorded, ready set; a waiting pull is served at once.
    async fn handle(&mut self, msg: RecordSendReady, ctx: &mut Context<Self, Self::Reply>) {
        let span = step_span!(
            steps::P_RECORD_SEND_READY,
            request_id = msg.p_req_id.as_str(),
            transfer_id = self.args.transfer_id.as_str()
        );
        span.record(attrs::BLOCKS, msg.block_ids.len() as u64);
        if let Some(tp) = &msg.traceparent {
            span.record(attrs::TRACEPARENT, tp.as_str());
        }
        self.p_req_id = Some(msg.p_req_id);
        match self.phase {
            Phase::Finished => {
                // Late: this transfer is over (expired placeholder, or aborted). P holds the blocks
                // and nothing will read them: let P free them.
                Outcome::LATE.record(&span);
                drop(span);
                self.report(None, true, true).await;
            }
            Phase::Ready | Phase::Writing => {
                tracing::warn!(transfer_id = %self.args.transfer_id, "ready recorded twice: the second record is ignored");
            }
            Phase::Waiting => {
                drop(span);
                self.local_block_ids = msg.block_ids;
                self.phase = Phase::Ready;
                self.producer_aborted = false;
                if let Some((_, h)) = self.linger.take() {
                    h.abort();
                }
                let me = ctx.actor_ref().clone();
                // Layer-wise: the layer write in flight ends first (its failure answers D).
                self.settle_stream_for_ready().await;
                if let Some(next) = self.pulls.pop_front() {
                    self.serve(next, &me).await;
                } else if self.consumer_gone {
                    tracing::info!(transfer_id = %self.args.transfer_id, "D gave this transfer up: P's blocks are freed at once");
                    self.report(None, true, true).await;
                } else {
                    self.arm_expiry(&me);
                }
            }
        }
    }
}

impl Message<ServePull> for SendWorker {
    type Reply = ();

    /// Step 22: D's pull for this transfer; served now if ready, else waits with a deadline.
    async fn handle(&mut self, pull: ServePull, ctx: &mut Context<Self, Self::Reply>) {
        if self.phase == Phase::Finished || self.producer_aborted {
            let detail = if self.producer_aborted {
                "P's request was aborted or failed before its KV was final (reqs_not_processed)"
            } else {
                "this transfer is already over on P (sent, expired or given up)"
            };
            let err = Self::err(&pull.d_req_id, PullErrorCause::Aborted, detail);
            self.reply_err(&pull, err, false, false).await;
            return;
        }
        self.consumer_gone = false;
        self.learn_pullers(&pull);
        // Before P's scheduler named the request, the span carries the transfer id only.
        let span = step_span!(
            steps::P_PULL_WAIT_READY,
            request_id = self.p_req_id.as_deref(),
            transfer_id = self.args.transfer_id.as_str()
        );
        span.record(attrs::BLOCKS, pull.block_ids.len() as u64);
        if let Some(tp) = &pull.traceparent {
            span.record(attrs::TRACEPARENT, tp.as_str());
        }
        let me = ctx.actor_ref().clone();
        match self.phase {
            Phase::Ready => self.serve(WaitingPull { pull, span, deadline: None }, &me).await,
            Phase::Waiting => {
                if let Some((_, h)) = self.linger.take() {
                    h.abort();
                }
                let deadline = me
                    .tell(ReadyDeadline { pull_id: pull.pull_id, d_req_id: pull.d_req_id.clone() })
                    .send_after(self.args.ready_timeout);
                self.prepare(&pull.data_addr);
                self.pulls.push_back(WaitingPull { pull, span, deadline: Some(deadline) });
                // Layer-wise: the layers P has finished go now.
                self.stream_on_pull(&me);
            }
            // A second pull while the first writes: answered when the write ends.
            Phase::Writing | Phase::Finished => self.pulls.push_back(WaitingPull { pull, span, deadline: None }),
        }
    }
}

#[cfg(test)]
pub(crate) mod test_support;
#[cfg(test)]
mod tests;
