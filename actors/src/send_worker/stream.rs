//! Layer-wise sending (seed step 29 while step 15 still runs): each layer of P's prefill that is
//! done ([`LayerDone`], from the worker's `save_kv_layer`) is written into D's blocks as soon as
//! D's pull is here, while later layers compute; layers done before the pull arrives are written
//! together when it does. At ready (step 27) what is left — at least the prompt's last partial
//! block, usually the last layer — is written by the usual write ([`SendWorker::serve`]'s path),
//! whose end answers D: D reports the request received only after every layer has landed, under
//! its write fence as for a whole write.
//!
//! Rules kept here: P's forward never waits (layer events are messages; one write at a time runs
//! in a task this actor owns, the next one takes every layer finished meanwhile); nothing answers
//! D while a layer write is in flight (a handler that must answer first waits for it, so D never
//! gives its blocks up under a write); a layer write that fails answers D's pull with the error at
//! once and stops the stream, and P's blocks are freed at ready as for any pull D gave up.

use kameo::prelude::*;
use pdflow_kv::planner::{build_plan, Descriptor, TransferPlan};
use pdflow_messages::send_worker::{LayerDone, ServePull};
use pdflow_messages::sender_listener::PullErrorCause;
use pdflow_messages::BlockId;
use pdflow_observability::{attrs, step_span, steps, Outcome};
use pdflow_transfer::TransferStats;
use tokio::task::JoinHandle;
use tracing::{Instrument, Span};

use super::{Phase, SendWorker, WriteError};

/// A layer write in flight: its task, which returns what it moved.
type LayerWrite = JoinHandle<Result<TransferStats, WriteError>>;

/// Where the layer-wise stream of one transfer stands.
pub(super) struct Stream {
    /// P's blocks so far, in prompt order, and the prompt's length (the latest [`LayerDone`]).
    block_ids: Vec<BlockId>,
    prompt_len: usize,
    /// Per layer: prompt tokens whose KV that layer holds on P.
    saved: Vec<usize>,
    /// Per layer: prompt tokens whose KV is in D's blocks.
    written: Vec<usize>,
    /// The layer write in flight, and the per-layer `saved` it covers.
    in_flight: Option<(LayerWrite, Vec<usize>)>,
    /// Step 29's span, opened by the first layer write; the final write at ready records under it.
    span: Option<Span>,
    /// A layer write failed: D was answered, nothing more is streamed.
    stopped: bool,
    /// What the layer writes moved so far: bytes and descriptors.
    streamed: (u64, usize),
}

/// A layer write ended (its result is the task's).
pub(super) struct LayerWriteDone;

impl Stream {
    fn new(num_layers: usize) -> Self {
        Self {
            block_ids: Vec::new(),
            prompt_len: 0,
            saved: vec![0; num_layers],
            written: vec![0; num_layers],
            in_flight: None,
            span: None,
            stopped: false,
            streamed: (0, 0),
        }
    }

    /// The layer write in flight, taken (to abort it when the worker stops).
    pub(super) fn take_in_flight(&mut self) -> Option<LayerWrite> {
        self.in_flight.take().map(|(task, _)| task)
    }

    /// Whether any byte was written to D (the final write then sends only the rest).
    pub(super) fn started(&self) -> bool {
        self.span.is_some()
    }
}

impl SendWorker {
    fn num_layers(&self) -> usize {
        self.args.kv_cache.shape().num_layers.max(1)
    }

    /// The descriptors that bring D's blocks from `written` up to `upto` in every layer, or `None`
    /// when D's pull cannot be planned layer by layer (the final write then plans it whole, and
    /// refuses it if the layouts differ).
    pub(super) fn layer_plan(&self, pull: &ServePull, upto: &[usize], written: &[usize]) -> Option<TransferPlan> {
        let stream = self.stream.as_ref()?;
        let src_regions = self.args.kv_cache.regions();
        let dst_regions = &pull.layout.regions;
        let layers = self.num_layers();
        if src_regions.len() != dst_regions.len() || !src_regions.len().is_multiple_of(layers) || upto.len() != layers {
            return None;
        }
        let per_layer = src_regions.len() / layers;
        let block_size = self.args.kv_cache.shape().block_size.max(1);
        // D asks for the tail of the prompt's blocks (its prefix cache may hold the start).
        let prompt_blocks = stream.prompt_len.div_ceil(block_size);
        // One group only: a hybrid model's pull is written whole at ready.
        let [d_span] = pull.block_ids.groups() else { return None };
        let d_blocks = &d_span.ids;
        let skip = prompt_blocks.checked_sub(d_blocks.len())?;
        let mut descriptors: Vec<Descriptor> = Vec::new();
        for layer in 0..layers {
            if upto[layer] <= written[layer] {
                continue;
            }
            // Whole blocks written before are not written again; the last, partial block is.
            let lo = (written[layer] / block_size).max(skip);
            let hi = upto[layer].div_ceil(block_size).min(prompt_blocks).min(stream.block_ids.len());
            if lo >= hi {
                continue;
            }
            let (src, dst) = (&stream.block_ids[lo..hi], &d_blocks[lo - skip..hi - skip]);
            let regions = layer * per_layer..(layer + 1) * per_layer;
            let plan = build_plan(&src_regions[regions.clone()], src, &dst_regions[regions], dst, true).ok()?;
            descriptors.extend(plan.descriptors);
        }
        Some(TransferPlan {
            descriptors,
            fence: pull.fence,
            write_by: pull.write_by,
            grant: pull.rdma.clone().map(std::sync::Arc::new),
        })
    }

    /// The plan of what is left at ready: everything not yet in D's blocks (all of it when
    /// nothing was streamed).
    pub(super) fn rest_plan(&self, pull: &ServePull) -> Option<TransferPlan> {
        let stream = self.stream.as_ref().filter(|s| s.started())?;
        let upto = vec![stream.prompt_len; stream.saved.len()];
        self.layer_plan(pull, &upto, &stream.written)
    }

    /// Takes step 29's span of the stream, if it wrote anything (the final write records under
    /// it), with what the stream moved.
    pub(super) fn take_stream_span(&mut self) -> Option<(Span, (u64, usize))> {
        self.stream.as_mut().and_then(|s| s.span.take().map(|span| (span, s.streamed)))
    }

    /// Waits for the layer write in flight, if any, and records what it wrote; `Err` when it failed.
    async fn finish_in_flight(&mut self) -> Result<(), WriteError> {
        let Some(stream) = self.stream.as_mut() else { return Ok(()) };
        let Some((task, covered)) = stream.in_flight.take() else { return Ok(()) };
        let result = task.await.map_err(|source| WriteError::LayerTaskEnded { source }).and_then(|r| r);
        match result {
            Ok(stats) => {
                for (w, c) in stream.written.iter_mut().zip(covered) {
                    *w = (*w).max(c);
                }
                stream.streamed.0 += stats.bytes;
                stream.streamed.1 += stats.descriptors;
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Before answering D otherwise (a deadline, an abort): waits for the layer write in flight,
    /// so that nothing of this transfer lands in D's blocks after the answer, and streams no more.
    pub(super) async fn settle_stream(&mut self) {
        if let Err(e) = self.finish_in_flight().await {
            tracing::debug!(transfer_id = %self.args.transfer_id, error = %e, "layer write failed as the transfer ended");
        }
        if let Some(stream) = self.stream.as_mut() {
            stream.stopped = true;
        }
    }

    /// At ready: waits for the layer write in flight; if it failed, D's pull is answered now.
    pub(super) async fn settle_stream_for_ready(&mut self) {
        if let Err(e) = self.finish_in_flight().await {
            self.stop_stream(e).await;
        }
    }

    /// Starts the next layer write if D's pull is here, P is still prefilling and no write runs.
    fn pump(&mut self, me: &ActorRef<Self>) {
        if self.phase != Phase::Waiting || self.producer_aborted {
            return;
        }
        let Some(pull) = self.pulls.front().map(|w| w.pull.clone()) else { return };
        // Across ranks the whole write at ready serves each D rank its share.
        if self.ranked(&pull) {
            return;
        }
        let Some(stream) = self.stream.as_ref() else { return };
        if stream.stopped || stream.in_flight.is_some() {
            return;
        }
        let upto = stream.saved.clone();
        let Some(plan) = self.layer_plan(&pull, &upto, &stream.written) else { return };
        if plan.descriptors.is_empty() {
            return;
        }
        let first_write = !stream.started();
        let transfer = self.args.faults.data_engine(
            self.p_req_id.as_deref().unwrap_or_default(),
            &self.args.kv_cache.region_table(),
            &self.args.transfer,
        );
        let span = match first_write {
            true => {
                let span = step_span!(
                    steps::P_TRANSFER_WRITE,
                    request_id = self.p_req_id.as_deref(),
                    transfer_id = self.args.transfer_id.as_str()
                );
                if let Some(tp) = &pull.traceparent {
                    span.record(attrs::TRACEPARENT, tp.as_str());
                }
                span
            }
            false => self.stream.as_ref().and_then(|s| s.span.clone()).unwrap_or_else(Span::none),
        };
        let layers_span = tracing::info_span!(parent: &span, "layer_write", pd.layers = tracing::field::Empty, pd.bytes = plan.total_bytes());
        let ready_layers = upto.iter().zip(&stream.written).filter(|(u, w)| u > w).count();
        layers_span.record("pd.layers", ready_layers as u64);
        let (peer, me) = (pull.data_addr.clone(), me.clone());
        let task = tokio::spawn(
            async move {
                let result = transfer.write(&peer, &plan).await.map_err(WriteError::from);
                if me.tell(LayerWriteDone).await.is_err() {
                    tracing::debug!("send worker stopped before its layer write finished");
                }
                result
            }
            .instrument(layers_span),
        );
        if let Some(stream) = self.stream.as_mut() {
            if first_write {
                stream.span = Some(span);
            }
            stream.in_flight = Some((task, upto));
        }
    }

    /// A layer write failed while P prefills: D's pull is answered with the error now, and P's
    /// blocks are freed at ready (D gave the transfer up).
    async fn stop_stream(&mut self, error: WriteError) {
        if let Some(stream) = self.stream.as_mut() {
            stream.stopped = true;
            if let Some(span) = stream.span.take() {
                Outcome::Failed(PullErrorCause::TransferFailed.label()).record(&span);
            }
        }
        tracing::warn!(transfer_id = %self.args.transfer_id, error = %error, "layer-wise write into D's memory failed");
        let detail = error.to_string();
        while let Some(waiting) = self.pulls.pop_front() {
            if let Some(d) = waiting.deadline {
                d.abort();
            }
            Outcome::Failed(PullErrorCause::TransferFailed.label()).record(&waiting.span);
            let err = Self::err(&waiting.pull.d_req_id, PullErrorCause::TransferFailed, detail.clone());
            self.reply_err(&waiting.pull, err, false, false).await;
        }
        self.consumer_gone = true;
    }

    /// A pull arrived while P prefills: write the layers already done.
    pub(super) fn stream_on_pull(&mut self, me: &ActorRef<Self>) {
        self.pump(me);
    }
}

impl Message<LayerDone> for SendWorker {
    type Reply = ();

    /// A layer of P's prefill is done for `computed_upto` tokens: written to D now if D pulled.
    async fn handle(&mut self, msg: LayerDone, ctx: &mut Context<Self, Self::Reply>) {
        if self.phase != Phase::Waiting || self.producer_aborted {
            return;
        }
        let layers = self.num_layers();
        if msg.layer >= layers {
            tracing::warn!(transfer_id = %self.args.transfer_id, layer = msg.layer, layers, "layer beyond the model's: ignored");
            return;
        }
        if self.p_req_id.is_none() {
            self.p_req_id = Some(msg.p_req_id.clone());
        }
        let stream = self.stream.get_or_insert_with(|| Stream::new(layers));
        stream.saved[msg.layer] = stream.saved[msg.layer].max(msg.computed_upto.min(msg.prompt_len));
        stream.prompt_len = msg.prompt_len;
        if msg.block_ids.len() >= stream.block_ids.len() {
            stream.block_ids = msg.block_ids;
        }
        let me = ctx.actor_ref().clone();
        self.pump(&me);
    }
}

impl Message<LayerWriteDone> for SendWorker {
    type Reply = ();

    async fn handle(&mut self, _: LayerWriteDone, ctx: &mut Context<Self, Self::Reply>) {
        let running = self.stream.as_ref().is_some_and(|s| s.in_flight.is_some() && !s.stopped);
        if !running {
            return;
        }
        match self.finish_in_flight().await {
            Ok(()) => {
                let me = ctx.actor_ref().clone();
                self.pump(&me);
            }
            Err(e) => self.stop_stream(e).await,
        }
    }
}
