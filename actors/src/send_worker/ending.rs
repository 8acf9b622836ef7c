//! How a transfer ends without its write (seed steps 22 and 27's deadlines, and aborts): a
//! waiting pull's ready deadline, the ready blocks' expiry when D never pulls (`send_expiry`), the
//! linger of a placeholder or aborted transfer that answers late messages, and [`AbortSend`] from P
//! (reqs_not_processed) or D (its pull given up).

use kameo::prelude::*;
use pdflow_messages::send_worker::{AbortSend, AbortSource};
use pdflow_messages::sender_listener::PullErrorCause;

use super::{ExpiryDue, LingerDue, Phase, ReadyDeadline, SendWorker};
use pdflow_observability::Outcome;

impl Message<ReadyDeadline> for SendWorker {
    type Reply = ();

    async fn handle(&mut self, msg: ReadyDeadline, ctx: &mut Context<Self, Self::Reply>) {
        if self.phase != Phase::Waiting {
            return;
        }
        let Some(pos) =
            self.pulls.iter().position(|p| p.pull.pull_id == msg.pull_id && p.pull.d_req_id == msg.d_req_id)
        else {
            return;
        };
        // Layer-wise: the layer write in flight ends before D hears of the failure.
        self.settle_stream().await;
        let Some(waiting) = self.pulls.remove(pos) else { return };
        Outcome::Failed(PullErrorCause::ReadyTimeout.label()).record(&waiting.span);
        drop(waiting.span);
        tracing::warn!(transfer_id = %self.args.transfer_id, d_req_id = %msg.d_req_id, timeout = ?self.args.ready_timeout, "P's prefill was not ready in time for D's pull");
        let detail = Phase::Waiting
            .state()
            .passed(
                self.args.ready_timeout,
                format!("P's prefill for transfer {} did not finish", self.args.transfer_id),
            )
            .to_string();
        let err = Self::err(&msg.d_req_id, PullErrorCause::ReadyTimeout, detail);
        self.reply_err(&waiting.pull, err, false, false).await;
        if self.pulls.is_empty() {
            self.consumer_gone = true;
            if self.p_req_id.is_none() {
                let me = ctx.actor_ref().clone();
                self.arm_linger(&me, self.args.send_expiry);
            }
        }
    }
}

impl Message<ExpiryDue> for SendWorker {
    type Reply = ();

    async fn handle(&mut self, msg: ExpiryDue, _ctx: &mut Context<Self, Self::Reply>) {
        if self.expiry.as_ref().map(|(e, _)| *e) != Some(msg.epoch)
            || self.phase != Phase::Ready
            || !self.pulls.is_empty()
        {
            return;
        }
        self.expiry = None;
        let expired =
            Phase::Ready.state().passed(self.args.send_expiry, "D never pulled this transfer: P's blocks are freed");
        tracing::warn!(transfer_id = %self.args.transfer_id, p_req_id = ?self.p_req_id, "{expired}");
        self.report(None, true, true).await;
    }
}

impl Message<LingerDue> for SendWorker {
    type Reply = ();

    async fn handle(&mut self, msg: LingerDue, _ctx: &mut Context<Self, Self::Reply>) {
        if self.linger.as_ref().map(|(e, _)| *e) != Some(msg.epoch)
            || self.phase != Phase::Waiting
            || !self.pulls.is_empty()
        {
            return;
        }
        self.linger = None;
        tracing::debug!(transfer_id = %self.args.transfer_id, "send worker retired");
        self.report(None, false, true).await;
    }
}

impl Message<AbortSend> for SendWorker {
    type Reply = ();

    async fn handle(&mut self, msg: AbortSend, ctx: &mut Context<Self, Self::Reply>) {
        let me = ctx.actor_ref().clone();
        if self.phase == Phase::Waiting {
            // Layer-wise: the layer write in flight ends before D is answered.
            self.settle_stream().await;
        }
        match (msg.source, self.phase) {
            (_, Phase::Finished) => {}
            // Let the write finish: D waits for the answer, so it never frees blocks under a write.
            (AbortSource::Producer, Phase::Writing) => self.producer_aborted = true,
            (AbortSource::Consumer, Phase::Writing) => {
                tracing::info!(transfer_id = %self.args.transfer_id, "D cancelled during the write: answering once it ends");
            }
            (AbortSource::Producer, Phase::Waiting | Phase::Ready) => {
                self.producer_aborted = true;
                self.phase = Phase::Waiting;
                self.local_block_ids.clear();
                if let Some((_, h)) = self.expiry.take() {
                    h.abort();
                }
                while let Some(waiting) = self.pulls.pop_front() {
                    if let Some(d) = waiting.deadline {
                        d.abort();
                    }
                    Outcome::Failed(PullErrorCause::Aborted.label()).record(&waiting.span);
                    let err = Self::err(
                        &waiting.pull.d_req_id,
                        PullErrorCause::Aborted,
                        "P's request was aborted or failed: its KV will never exist",
                    );
                    self.reply_err(&waiting.pull, err, false, false).await;
                }
                // Stay a while so that a pull arriving late is answered `Aborted` at once too.
                self.arm_linger(&me, self.args.ready_timeout);
            }
            (AbortSource::Consumer, Phase::Ready) => {
                tracing::info!(transfer_id = %self.args.transfer_id, "D cancelled the transfer: P's blocks are freed");
                self.report(None, true, true).await;
            }
            (AbortSource::Consumer, Phase::Waiting) => {
                self.consumer_gone = true;
                while let Some(waiting) = self.pulls.pop_front() {
                    if let Some(d) = waiting.deadline {
                        d.abort();
                    }
                    Outcome::Failed(PullErrorCause::CancelledByPeer.label()).record(&waiting.span);
                    let err =
                        Self::err(&waiting.pull.d_req_id, PullErrorCause::CancelledByPeer, "D cancelled the pull");
                    self.reply_err(&waiting.pull, err, false, false).await;
                }
                if self.p_req_id.is_none() {
                    self.arm_linger(&me, self.args.send_expiry);
                }
            }
        }
    }
}
