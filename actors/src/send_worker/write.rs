//! The write of one transfer (seed steps 28, 29 and 31): the pull's wait ends, the transfer plan
//! is built from P's blocks and D's offered ones, the write runs in a task the worker owns, and
//! its end marks the request sent and answers every pull.

use std::sync::Arc;

use kameo::prelude::*;
use pdflow_kv::planner::{build_plan, TransferPlan};
use pdflow_messages::send_worker::{PullReply, ServePull};
use pdflow_messages::sender_listener::{PullErr, PullErrorCause};
use pdflow_messages::BlockId;
use pdflow_observability::{attrs, step_span, steps};
use pdflow_transfer::{TransferEngine, TransferStats};
use tracing::{Instrument, Span};

use super::{Phase, PullPlanError, SendWorker, WaitingPull, WriteAnswer, WriteDone, WriteError, Writing};
use pdflow_observability::Outcome;

impl SendWorker {
    /// Steps 28 and 29: plan the write and start it in a task this actor owns.
    pub(super) async fn serve(&mut self, mut waiting: WaitingPull, me: &ActorRef<Self>) {
        let mut pull = self.end_wait(waiting);
        // Across ranks, a D rank already served (a repeated pull) gets its answer at once.
        while self.ranked(&pull) && self.served.contains(&self.d_index(&pull)) {
            let err = Self::err(
                &pull.d_req_id,
                PullErrorCause::Aborted,
                "this D rank's share of the transfer was already written by an earlier pull",
            );
            self.reply_err(&pull, err, false, false).await;
            match self.pulls.pop_front() {
                Some(next) => {
                    waiting = next;
                    pull = self.end_wait(waiting);
                }
                None => {
                    self.phase = Phase::Ready;
                    self.arm_expiry(me);
                    return;
                }
            }
        }
        // Ready means P's scheduler named the request; its spans carry the transfer id regardless.
        let p_req_id = self.p_req_id.clone();
        let (plan, src_blocks) = match self.build_transfer(&pull, p_req_id.as_deref()) {
            Ok(planned) => planned,
            Err(err) => {
                // No write will ever start: P's blocks can be freed.
                self.reply_err(&pull, err, true, true).await;
                return;
            }
        };
        // Layer-wise: only what the stream has not written yet, under the stream's step-29 span.
        let (plan, write_span, streamed) = match (self.rest_plan(&pull), self.take_stream_span()) {
            (Some(rest), Some((span, streamed))) => {
                span.record(attrs::BLOCKS, src_blocks.len() as u64);
                self.record_checksum(&span, &src_blocks);
                (TransferPlan { descriptors: rest.descriptors, ..plan }, span, streamed)
            }
            _ => {
                let span = self.write_span(&pull, p_req_id.as_deref(), &plan, &src_blocks);
                (plan, span, (0, 0))
            }
        };
        // Across ranks each pair moves a share of each block: its digests cover that share.
        let digests =
            if self.ranked(&pull) { self.rank_digests(&pull, &src_blocks) } else { self.block_digests(&src_blocks) };
        // No byte after D's pull deadline (less a margin): D gives the blocks up then.
        let plan = TransferPlan { write_by: pull.write_by, ..plan };
        let transfer = self.args.faults.data_engine(
            p_req_id.as_deref().unwrap_or_default(),
            &self.args.kv_cache.region_table(),
            &self.args.transfer,
        );
        self.start_write(pull, plan, transfer, write_span, WriteAnswer { digests, streamed }, me);
    }

    /// With `verify_checksums`, P's digest of each block it is about to write (computed before
    /// the write: nothing writes P's blocks while they are held for sending); D checks its blocks
    /// against them. Empty otherwise, or when they cannot be read (D then checks nothing).
    fn block_digests(&self, src_blocks: &[BlockId]) -> Vec<u64> {
        if !self.args.verify_checksums {
            return Vec::new();
        }
        self.args.kv_cache.block_digests(src_blocks).unwrap_or_else(|e| {
            tracing::warn!(transfer_id = %self.args.transfer_id, error = %e, "cannot digest P's blocks: D will not check them");
            Vec::new()
        })
    }

    /// The pull's wait for ready (step 22) ends: its deadline and the ready blocks' expiry are
    /// cancelled.
    fn end_wait(&mut self, waiting: WaitingPull) -> ServePull {
        let WaitingPull { pull, span: wait_span, deadline } = waiting;
        if let Some(d) = deadline {
            d.abort();
        }
        Outcome::Ready.record(&wait_span);
        drop(wait_span);
        if let Some((_, h)) = self.expiry.take() {
            h.abort();
        }
        pull
    }

    /// Step 28: the transfer plan (coalesced descriptors, under D's fence) and P's blocks it
    /// reads; `Err` answers D when the layouts do not match.
    fn build_transfer(
        &self,
        pull: &ServePull,
        p_req_id: Option<&str>,
    ) -> Result<(TransferPlan, Vec<BlockId>), PullErr> {
        let plan_span =
            step_span!(steps::P_BUILD_TRANSFER, request_id = p_req_id, transfer_id = self.args.transfer_id.as_str());
        let regions = self.args.kv_cache.regions();
        // D's prefix cache may already hold the prompt's first blocks: it then asks only for the
        // rest, and P sends the blocks at the same positions, group by group (a D asking for a
        // block P does not hold is refused).
        let ranked = self.ranked(pull);
        if ranked {
            self.record_ranks(&plan_span, pull);
        }
        let paired = self
            .hybrid_shape_matches(pull)
            .and_then(|()| self.local_block_ids.pair_with(&pull.block_ids).map_err(PullPlanError::from));
        let src_blocks = paired.as_ref().map(|(src, _)| src.clone()).unwrap_or_default();
        let plan = plan_span.in_scope(|| {
            let (src, dst) = paired?;
            match ranked {
                true => self.rank_plan(pull, &src, &dst),
                false => build_plan(&regions, &src, &pull.layout.regions, &dst, true).map_err(PullPlanError::from),
            }
        });
        let plan = match plan {
            // D's fence for these blocks: its data server writes them only while D expects them.
            Ok(plan) => TransferPlan { fence: pull.fence, grant: pull.rdma.clone().map(std::sync::Arc::new), ..plan },
            Err(e) => {
                Outcome::Failed(PullErrorCause::LayoutMismatch.label()).record(&plan_span);
                drop(plan_span);
                tracing::warn!(transfer_id = %self.args.transfer_id, d_req_id = %pull.d_req_id, error = %e, "cannot plan the transfer: answering D with an error");
                return Err(Self::err(&pull.d_req_id, PullErrorCause::LayoutMismatch, e.to_string()));
            }
        };
        plan_span.record(attrs::BLOCKS, src_blocks.len() as u64);
        self.record_groups(&plan_span, pull, &plan);
        plan_span.record(attrs::DESCRIPTORS, plan.descriptors.len() as u64);
        plan_span.record(attrs::BYTES, plan.total_bytes());
        Ok((plan, src_blocks))
    }

    /// Step 29's span: the plan's size, D's trace context and, when asked, the checksum of P's
    /// blocks.
    fn write_span(
        &self,
        pull: &ServePull,
        p_req_id: Option<&str>,
        plan: &TransferPlan,
        src_blocks: &[BlockId],
    ) -> Span {
        let write_span =
            step_span!(steps::P_TRANSFER_WRITE, request_id = p_req_id, transfer_id = self.args.transfer_id.as_str());
        write_span.record(attrs::BLOCKS, src_blocks.len() as u64);
        self.record_groups(&write_span, pull, plan);
        write_span.record(attrs::DESCRIPTORS, plan.descriptors.len() as u64);
        write_span.record(attrs::BYTES, plan.total_bytes());
        if let Some(tp) = &pull.traceparent {
            write_span.record(attrs::TRACEPARENT, tp.as_str());
        }
        if self.ranked(pull) {
            self.record_ranks(&write_span, pull);
        } else {
            self.record_checksum(&write_span, src_blocks);
        }
        write_span
    }

    /// A hybrid model's KV registers as pages, each rank's its own: it moves only between engines
    /// of one shape, page to page (a D of another tensor or pipeline size is refused).
    fn hybrid_shape_matches(&self, pull: &ServePull) -> Result<(), PullPlanError> {
        let me = self.args.rank;
        let d = pull.d_rank;
        if self.local_block_ids.groups().len() <= 1 || (d.tp_size, d.pp_size) == (me.tp_size, me.pp_size) {
            return Ok(());
        }
        Err(PullPlanError::HybridShape { p: (me.tp_size, me.pp_size), d: (d.tp_size, d.pp_size) })
    }

    /// A hybrid model's blocks and bytes per KV-cache group on step 28's or 29's span (each block
    /// moves through every region, so a group's bytes are its share of the plan's).
    fn record_groups(&self, span: &Span, pull: &ServePull, plan: &TransferPlan) {
        let Some(groups) = pull.block_ids.counts_label() else { return };
        let per_block = plan.total_bytes().checked_div(pull.block_ids.len() as u64).unwrap_or(0);
        span.record(attrs::GROUP_BLOCKS, groups.as_str());
        let bytes = pull.block_ids.counts().iter().map(|&n| (n as u64 * per_block).to_string()).collect::<Vec<_>>();
        span.record(attrs::GROUP_BYTES, bytes.join(",").as_str());
    }

    /// Across ranks, who writes to whom on step 28's or 29's span.
    fn record_ranks(&self, span: &Span, pull: &ServePull) {
        span.record(attrs::TP_RANK, self.args.rank.tp_rank);
        span.record(attrs::PP_RANK, self.args.rank.pp_rank);
        span.record(attrs::REMOTE_TP_RANK, pull.d_rank.tp_rank);
        span.record(attrs::REMOTE_PP_RANK, pull.d_rank.pp_rank);
    }

    /// With `verify_checksums`, `pd.kv_checksum` of P's blocks on step 29's span.
    fn record_checksum(&self, write_span: &Span, src_blocks: &[BlockId]) {
        if !self.args.verify_checksums {
            return;
        }
        // Computed before the (last) write: nothing writes P's blocks while they are held for sending.
        match self.args.kv_cache.blocks_checksum(src_blocks) {
            // A plain u64, as the receiver records D's side on step 34 (the demo compares them).
            Ok(sum) => {
                write_span.record(attrs::KV_CHECKSUM, sum);
            }
            Err(e) => tracing::warn!(transfer_id = %self.args.transfer_id, error = %e, "cannot checksum P's blocks"),
        }
    }

    /// Step 29: the write into D's memory, in a task this actor owns; its end comes back as
    /// [`WriteDone`].
    fn start_write(
        &mut self,
        pull: ServePull,
        plan: TransferPlan,
        transfer: Arc<dyn TransferEngine>,
        write_span: Span,
        answer: WriteAnswer,
        me: &ActorRef<Self>,
    ) {
        let peer = pull.data_addr.clone();
        let me = me.clone();
        let task = tokio::spawn(
            async move {
                // An empty pull (across ranks: a replica nobody reads) moves nothing.
                let result = match plan.descriptors.is_empty() {
                    true => Ok(TransferStats::default()),
                    false => transfer.write(&peer, &plan).await.map_err(WriteError::from),
                };
                // Which path moved the bytes (tcp, same-host…), for the trace.
                tracing::Span::current().record(attrs::BACKEND, transfer.backend_for(&peer));
                if let Some(provider) = transfer.provider_for(&peer) {
                    tracing::Span::current().record(attrs::PROVIDER, provider.as_str());
                }
                if me.tell(WriteDone { result }).await.is_err() {
                    tracing::warn!("send worker stopped before its write finished");
                }
            }
            .instrument(write_span.clone()),
        );
        self.phase = Phase::Writing;
        self.writing = Some(Writing { pull, span: write_span, task, answer });
    }
}

impl Message<WriteDone> for SendWorker {
    type Reply = ();

    /// Steps 29 (end) and 31: mark sent and report.
    async fn handle(&mut self, msg: WriteDone, ctx: &mut Context<Self, Self::Reply>) {
        let Some(writing) = self.writing.take() else { return };
        let Writing { pull, span, task: _, answer: WriteAnswer { digests, streamed } } = writing;
        if self.ranked(&pull) {
            self.served.insert(self.d_index(&pull));
        }
        let result = match msg.result {
            Ok(stats) => {
                // Layer-wise, the layers written while P prefilled count too.
                span.record(attrs::BYTES, stats.bytes + streamed.0);
                span.record(attrs::DESCRIPTORS, (stats.descriptors + streamed.1) as u64);
                Outcome::Ok.record(&span);
                drop(span);
                if self.producer_aborted {
                    Err(Self::err(
                        &pull.d_req_id,
                        PullErrorCause::Aborted,
                        "P's request was aborted during the write: do not use the KV",
                    ))
                } else {
                    drop(step_span!(
                        steps::P_MARK_SENT,
                        request_id = self.p_req_id.as_deref(),
                        transfer_id = self.args.transfer_id.as_str()
                    ));
                    Ok(digests)
                }
            }
            Err(e) => {
                Outcome::Failed(PullErrorCause::TransferFailed.label()).record(&span);
                drop(span);
                tracing::warn!(transfer_id = %self.args.transfer_id, d_req_id = %pull.d_req_id, error = %e, "write into D's memory failed");
                Err(Self::err(&pull.d_req_id, PullErrorCause::TransferFailed, e.to_string()))
            }
        };
        // Across ranks, D ranks still to serve keep P's blocks: this pull alone is answered.
        if self.pullers_left() {
            let reply = PullReply { pull_id: pull.pull_id, d_req_id: pull.d_req_id.clone(), result };
            self.report(Some(reply), false, false).await;
            self.phase = Phase::Ready;
            let me = ctx.actor_ref().clone();
            match self.pulls.pop_front() {
                Some(next) => self.serve(next, &me).await,
                None => self.arm_expiry(&me),
            }
            return;
        }
        // Any further pull for this transfer comes too late: P's blocks are released below.
        while let Some(extra) = self.pulls.pop_front() {
            if let Some(d) = extra.deadline {
                d.abort();
            }
            let err = Self::err(
                &extra.pull.d_req_id,
                PullErrorCause::Aborted,
                "this transfer was already served by an earlier pull",
            );
            self.reply_err(&extra.pull, err, false, false).await;
        }
        // The write task has ended: nothing reads P's blocks any more (unless P aborted, in which
        // case P's scheduler freed them already).
        let counts = !self.producer_aborted;
        let reply = PullReply { pull_id: pull.pull_id, d_req_id: pull.d_req_id.clone(), result };
        self.report(Some(reply), counts, true).await;
    }
}
