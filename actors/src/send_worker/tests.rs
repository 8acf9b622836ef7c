//! SendWorker alone, its outcomes collected by a stand-in listener.

use std::sync::Arc;
use std::time::Duration;

use kameo::error::Infallible;
use kameo::prelude::*;
use pdflow_kv::memory::KvCache;
use pdflow_messages::send_worker::{
    AbortSend, AbortSource, DRank, LayerDone, RecordSendPending, RecordSendReady, SendOutcome, ServePull,
};
use pdflow_messages::sender_listener::PullErrorCause;
use pdflow_transfer::TransferEngine;
use tokio::sync::mpsc;

use super::test_support::{filled_cache, MemcpyTransfer, SHAPE};
use super::{SendWorker, SendWorkerArgs};
use crate::ranks::WorkerRank;

/// Stands in for the SenderListener: forwards every outcome to the test.
struct Collector(mpsc::UnboundedSender<SendOutcome>);

impl Actor for Collector {
    type Args = Self;
    type Error = Infallible;

    async fn on_start(args: Self::Args, _: ActorRef<Self>) -> Result<Self, Self::Error> {
        Ok(args)
    }
}

impl Message<SendOutcome> for Collector {
    type Reply = ();

    async fn handle(&mut self, msg: SendOutcome, _: &mut Context<Self, Self::Reply>) {
        let _ = self.0.send(msg);
    }
}

struct Rig {
    worker: ActorRef<SendWorker>,
    outcomes: mpsc::UnboundedReceiver<SendOutcome>,
    _collector: ActorRef<Collector>,
    d: Arc<KvCache>,
}

fn rig(transfer: impl FnOnce(&Arc<KvCache>, &Arc<KvCache>) -> Arc<dyn TransferEngine>, send_expiry: Duration) -> Rig {
    let p = filled_cache(8, 1);
    let d = KvCache::new(SHAPE, 16);
    let (tx, outcomes) = mpsc::unbounded_channel();
    let collector = Collector::spawn(Collector(tx));
    let args = worker_args(&p, transfer(&p, &d), send_expiry, &collector);
    Rig { worker: SendWorker::spawn_with_mailbox(args, mailbox::unbounded()), outcomes, _collector: collector, d }
}

/// A worker of transfer `xfer-1` over `p`, reporting to `collector`.
fn worker_args(
    p: &Arc<KvCache>,
    transfer: Arc<dyn TransferEngine>,
    send_expiry: Duration,
    collector: &ActorRef<Collector>,
) -> SendWorkerArgs {
    SendWorkerArgs {
        faults: crate::fault_seam::no_faults(),
        transfer_id: "xfer-1".into(),
        generation: 7,
        listener: collector.clone().recipient::<SendOutcome>().downgrade(),
        kv_cache: p.clone(),
        transfer,
        ready_timeout: Duration::from_secs(30),
        send_expiry,
        verify_checksums: true,
        rank: WorkerRank::single(SHAPE),
    }
}

fn memcpy(p: &Arc<KvCache>, d: &Arc<KvCache>) -> Arc<dyn TransferEngine> {
    MemcpyTransfer::new(p, d)
}

impl Rig {
    async fn next(&mut self) -> SendOutcome {
        tokio::time::timeout(Duration::from_secs(5), self.outcomes.recv())
            .await
            .expect("an outcome in time")
            .expect("collector alive")
    }

    async fn ready(&self, blocks: Vec<u32>) {
        self.worker
            .tell(RecordSendPending { p_req_id: "cmpl-p".into(), transfer_id: "xfer-1".into(), traceparent: None })
            .await
            .expect("worker alive");
        self.worker
            .tell(RecordSendReady {
                p_req_id: "cmpl-p".into(),
                transfer_id: "xfer-1".into(),
                block_ids: blocks.into(),
                traceparent: None,
            })
            .await
            .expect("worker alive");
    }

    async fn pull(&self, blocks: Vec<u32>) {
        let serve = ServePull {
            pull_id: 3,
            d_req_id: "cmpl-d".into(),
            transfer_id: "xfer-1".into(),
            block_ids: blocks.into(),
            data_addr: "127.0.0.1:1".into(),
            layout: self.d.layout(),
            traceparent: None,
            fence: 0,
            d_rank: DRank::default(),
            write_by: None,
            rdma: None,
        };
        self.worker.tell(serve).await.expect("worker alive");
    }
}

#[tokio::test]
async fn ready_then_pull_writes_and_counts_as_sent() {
    let mut rig = rig(memcpy, Duration::from_secs(30));
    rig.ready(vec![2, 3, 5]).await;
    rig.pull(vec![10, 11, 12]).await;
    let out = rig.next().await;
    assert_eq!(out.generation, 7);
    assert_eq!(out.p_req_id.as_deref(), Some("cmpl-p"));
    assert!(out.counts_as_sent && out.finished);
    // With verify_checksums, the answer carries P's digest of each block written, in D's order.
    let p = filled_cache(8, 1);
    let digests = p.block_digests(&[2, 3, 5]).expect("in range");
    assert_eq!(out.reply.expect("answers the pull").result, Ok(digests));
}

/// A rig whose memcpy engine records what it is asked to do.
fn recording_rig() -> (Rig, Arc<MemcpyTransfer>) {
    let engine = std::sync::OnceLock::new();
    let rig = rig(
        |p, d| {
            let m = MemcpyTransfer::new(p, d);
            let _ = engine.set(m.clone());
            m
        },
        Duration::from_secs(30),
    );
    let engine = engine.get().expect("the rig made its engine").clone();
    (rig, engine)
}

/// A pull that comes while P still prefills has the engine prepare the data channel to D at
/// once (connections, handshakes), so the write at ready starts on it; a pull after ready writes
/// straight away, with nothing to prepare.
#[tokio::test]
async fn a_pull_before_ready_prepares_the_data_channel_while_p_prefills() {
    let (mut rig, engine) = recording_rig();
    rig.pull(vec![10, 11, 12]).await;
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while engine.calls().is_empty() {
        assert!(std::time::Instant::now() < until, "the pull before ready did not prepare the data channel");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(engine.calls(), vec!["prepare 127.0.0.1:1".to_string()], "prepared, nothing written before ready");
    rig.ready(vec![2, 3, 5]).await;
    assert!(rig.next().await.reply.expect("answers the pull").result.is_ok());
    assert_eq!(engine.calls(), vec!["prepare 127.0.0.1:1".to_string(), "write 127.0.0.1:1".to_string()]);

    let (mut later, engine) = recording_rig();
    later.ready(vec![2, 3, 5]).await;
    later.pull(vec![10, 11, 12]).await;
    assert!(later.next().await.reply.expect("answers the pull").result.is_ok());
    assert_eq!(engine.calls(), vec!["write 127.0.0.1:1".to_string()], "nothing to prepare after ready");
}

/// On the paused clock (the worker and its stand-ins are all in process): the ready blocks
/// expire at `send_expiry`, not before and not later.
#[tokio::test(start_paused = true)]
async fn ready_without_pull_expires_at_send_expiry_and_counts_as_sent() {
    let send_expiry = Duration::from_millis(50);
    let mut rig = rig(memcpy, send_expiry);
    let started = tokio::time::Instant::now();
    rig.ready(vec![1]).await;
    let out = rig.next().await;
    let waited = started.elapsed();
    assert!(waited >= send_expiry && waited <= send_expiry + Duration::from_millis(1), "expired after {waited:?}");
    assert!(out.reply.is_none());
    assert!(out.counts_as_sent && out.finished);
}

#[tokio::test]
async fn block_count_mismatch_is_a_layout_error_and_frees_p() {
    let mut rig = rig(memcpy, Duration::from_secs(30));
    rig.ready(vec![1, 2]).await;
    rig.pull(vec![4, 5, 6]).await;
    let out = rig.next().await;
    let err = out.reply.expect("answers the pull").result.expect_err("mismatch");
    assert_eq!(err.cause, PullErrorCause::LayoutMismatch);
    assert!(out.counts_as_sent && out.finished);
    assert!(rig.d.block_bytes(4).expect("in range").iter().all(|b| *b == 0), "nothing written");
}

#[tokio::test]
async fn d_with_a_cached_prefix_gets_the_tail_of_ps_blocks() {
    let mut rig = rig(memcpy, Duration::from_secs(30));
    rig.ready(vec![1, 2, 3]).await;
    // D's prefix cache held the first block: it asks for two.
    rig.pull(vec![10, 11]).await;
    let out = rig.next().await;
    let p = filled_cache(8, 1);
    // The digests are of the blocks sent: P's tail, one per block D asked for.
    let digests = p.block_digests(&[2, 3]).expect("in range");
    assert_eq!(out.reply.expect("answers the pull").result, Ok(digests));
    assert_eq!(rig.d.block_bytes(10).expect("in range"), p.block_bytes(2).expect("in range"));
    assert_eq!(rig.d.block_bytes(11).expect("in range"), p.block_bytes(3).expect("in range"));
}

#[tokio::test]
async fn failed_write_reports_transfer_failed_and_frees_p() {
    let mut rig = rig(|p, d| MemcpyTransfer::failing(p, d, "link down"), Duration::from_secs(30));
    rig.ready(vec![1]).await;
    rig.pull(vec![4]).await;
    let out = rig.next().await;
    let err = out.reply.expect("answers the pull").result.expect_err("write fails");
    assert_eq!(err.cause, PullErrorCause::TransferFailed);
    assert!(err.detail.contains("link down"), "{}", err.detail);
    assert!(out.counts_as_sent && out.finished);
}

#[tokio::test]
async fn consumer_abort_before_ready_frees_p_once_ready() {
    let mut rig = rig(memcpy, Duration::from_secs(30));
    rig.worker
        .tell(RecordSendPending { p_req_id: "cmpl-p".into(), transfer_id: "xfer-1".into(), traceparent: None })
        .await
        .expect("alive");
    rig.pull(vec![4]).await;
    rig.worker.tell(AbortSend { transfer_id: "xfer-1".into(), source: AbortSource::Consumer }).await.expect("alive");
    let out = rig.next().await;
    assert_eq!(
        out.reply.expect("answers the pull").result.expect_err("cancelled").cause,
        PullErrorCause::CancelledByPeer
    );
    assert!(!out.counts_as_sent && !out.finished);
    rig.worker
        .tell(RecordSendReady {
            p_req_id: "cmpl-p".into(),
            transfer_id: "xfer-1".into(),
            block_ids: vec![1].into(),
            traceparent: None,
        })
        .await
        .expect("alive");
    let out = rig.next().await;
    assert!(out.reply.is_none() && out.counts_as_sent && out.finished);
}

// Layer-wise: the prompt is 6 tokens (3 blocks of 2) in P's blocks [2, 3, 5].

impl Rig {
    async fn layer(&self, layer: usize, computed_upto: usize) {
        let done =
            LayerDone { p_req_id: "cmpl-p".into(), layer, block_ids: vec![2, 3, 5], computed_upto, prompt_len: 6 };
        self.worker.tell(done).await.expect("worker alive");
    }
}

/// Whether D's `d_block` of `layer` holds what P's `p_block` of that layer holds.
fn same_block(p: &KvCache, d: &KvCache, layer: usize, p_block: u32, d_block: u32) -> bool {
    let (mut a, mut b) = (vec![0u8; SHAPE.slot_len()], vec![0u8; SHAPE.slot_len()]);
    (0..SHAPE.num_kv_heads).all(|head| {
        (0..SHAPE.block_size).all(|slot| {
            p.read_slot(layer, p_block, head, slot, &mut a).is_ok()
                && d.read_slot(layer, d_block, head, slot, &mut b).is_ok()
                && a == b
        })
    })
}

async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(std::time::Instant::now() < until, "{what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test]
async fn layer_wise_each_finished_layer_lands_in_d_before_ready_and_ready_writes_the_rest() {
    let (mut rig, engine) = recording_rig();
    let p = filled_cache(8, 1);
    rig.pull(vec![10, 11, 12]).await;
    // The first chunk (4 tokens: blocks 2 and 3) of layer 0.
    rig.layer(0, 4).await;
    eventually("layer 0's first two blocks in D", || {
        same_block(&p, &rig.d, 0, 2, 10) && same_block(&p, &rig.d, 0, 3, 11)
    })
    .await;
    assert!(!same_block(&p, &rig.d, 1, 2, 10), "layer 1 is not done: nothing of it is written");
    rig.layer(1, 4).await;
    eventually("layer 1's first two blocks in D", || same_block(&p, &rig.d, 1, 3, 11)).await;
    assert!(!same_block(&p, &rig.d, 0, 5, 12), "the last block is not computed yet");
    assert!(rig.outcomes.try_recv().is_err(), "D is not answered before every layer of every chunk landed");
    // The last chunk is computed; ready writes what is left (the third block of both layers).
    rig.ready(vec![2, 3, 5]).await;
    let out = rig.next().await;
    assert!(out.counts_as_sent && out.finished);
    assert_eq!(out.reply.expect("answers the pull").result, Ok(p.block_digests(&[2, 3, 5]).expect("in range")));
    for layer in 0..SHAPE.num_layers {
        for (pb, db) in [(2, 10), (3, 11), (5, 12)] {
            assert!(same_block(&p, &rig.d, layer, pb, db), "layer {layer}, block {pb} → {db}");
        }
    }
    let writes = engine.calls().iter().filter(|c| c.starts_with("write")).count();
    assert_eq!(writes, 3, "one write per layer event, one at ready: {:?}", engine.calls());
}

#[tokio::test]
async fn layer_wise_layers_done_before_the_pull_are_written_when_it_arrives() {
    let (mut rig, engine) = recording_rig();
    let p = filled_cache(8, 1);
    rig.layer(0, 6).await;
    rig.layer(1, 6).await;
    // D's prefix cache holds the prompt's first block: it asks for the last two only.
    rig.pull(vec![11, 12]).await;
    eventually("both layers in D before ready", || {
        (0..SHAPE.num_layers).all(|l| same_block(&p, &rig.d, l, 3, 11) && same_block(&p, &rig.d, l, 5, 12))
    })
    .await;
    assert!(!same_block(&p, &rig.d, 0, 2, 10), "the block D holds already is not written");
    let before_ready = engine.calls().iter().filter(|c| c.starts_with("write")).count();
    assert!(before_ready >= 1, "the layers were written ahead of ready: {:?}", engine.calls());
    rig.ready(vec![2, 3, 5]).await;
    let out = rig.next().await;
    assert!(out.reply.expect("answers the pull").result.is_ok());
    assert!(out.counts_as_sent);
    let writes = engine.calls().iter().filter(|c| c.starts_with("write")).count();
    assert_eq!(writes, before_ready, "nothing was left for ready to write: {:?}", engine.calls());
}

#[tokio::test]
async fn layer_wise_a_failed_layer_write_answers_d_at_once_and_p_frees_at_ready() {
    let mut rig = rig(|p, d| MemcpyTransfer::failing(p, d, "link down"), Duration::from_secs(30));
    rig.pull(vec![10, 11, 12]).await;
    rig.layer(0, 4).await;
    let out = rig.next().await;
    let err = out.reply.expect("answers the pull").result.expect_err("the layer write failed");
    assert_eq!(err.cause, PullErrorCause::TransferFailed);
    assert!(!out.counts_as_sent && !out.finished, "P still prefills: its blocks are not free yet");
    rig.layer(1, 4).await;
    rig.ready(vec![2, 3, 5]).await;
    let out = rig.next().await;
    assert!(out.reply.is_none(), "D was answered already");
    assert!(out.counts_as_sent && out.finished, "P frees its blocks at ready");
}

/// P (one worker, 2 KV heads) serves a D of tensor-parallel size 2: each D rank's pull gets its
/// own head, the first answer does not free P's blocks, the second does.
#[tokio::test]
async fn each_d_rank_gets_its_heads_and_the_last_one_frees_the_blocks() {
    let d_shape = pdflow_kv::memory::KvShape { num_kv_heads: 1, ..SHAPE };
    let p = filled_cache(8, 1);
    let d = KvCache::new(d_shape, 16);
    let (tx, mut outcomes) = mpsc::unbounded_channel();
    let collector = Collector::spawn(Collector(tx));
    let args = worker_args(&p, MemcpyTransfer::new(&p, &d), Duration::from_secs(30), &collector);
    let worker = SendWorker::spawn_with_mailbox(args, mailbox::unbounded());
    let rig = Rig { worker, outcomes: mpsc::unbounded_channel().1, _collector: collector, d: d.clone() };
    rig.ready(vec![2, 3]).await;
    let (mut p_slot, mut d_slot) = (vec![0u8; SHAPE.slot_len()], vec![0u8; SHAPE.slot_len()]);
    for d_rank in 0..2u32 {
        let serve = ServePull {
            pull_id: u64::from(d_rank) + 1,
            d_req_id: "cmpl-d".into(),
            transfer_id: "xfer-1".into(),
            block_ids: vec![5, 9].into(),
            data_addr: "127.0.0.1:1".into(),
            layout: d.layout(),
            traceparent: None,
            fence: 0,
            d_rank: DRank { tp_size: 2, tp_rank: d_rank, pp_size: 1, pp_rank: 0 },
            write_by: None,
            rdma: None,
        };
        rig.worker.tell(serve).await.expect("worker alive");
        let outcome = tokio::time::timeout(Duration::from_secs(5), outcomes.recv())
            .await
            .expect("an outcome in time")
            .expect("collector alive");
        let reply = outcome.reply.expect("a reply");
        assert_eq!(reply.pull_id, u64::from(d_rank) + 1);
        assert!(reply.result.is_ok(), "{:?}", reply.result);
        // Only the last D rank's answer frees P's blocks.
        assert_eq!((outcome.counts_as_sent, outcome.finished), (d_rank == 1, d_rank == 1));
        // D's one head now holds P's head `d_rank`, in every layer, block and slot.
        for layer in 0..SHAPE.num_layers {
            for (src, dst) in [(2, 5), (3, 9)] {
                for slot in 0..SHAPE.block_size {
                    p.read_slot(layer, src, d_rank as usize, slot, &mut p_slot).expect("in range");
                    d.read_slot(layer, dst, 0, slot, &mut d_slot).expect("in range");
                    assert_eq!(p_slot, d_slot, "layer {layer} block {dst} slot {slot} from D rank {d_rank}");
                }
            }
        }
    }
}

/// A hybrid model (two KV-cache groups): a pull of the same shape writes each group's blocks at
/// their positions; a D of another tensor-parallel size is refused (its pages are another
/// shape's), naming both shapes, and P's blocks are freed.
#[tokio::test]
async fn a_hybrid_pull_pairs_each_group_and_a_d_of_another_shape_is_refused() {
    use pdflow_messages::kv_groups::{BlockSpan, GroupBlocks};
    let span = |first, ids: &[u32]| BlockSpan { first: Some(first), ids: ids.to_vec() };
    for (d_rank, refused) in [(DRank::default(), false), (DRank { tp_size: 2, ..DRank::default() }, true)] {
        let mut rig = rig(memcpy, Duration::from_secs(30));
        rig.worker
            .tell(RecordSendReady {
                p_req_id: "cmpl-p".into(),
                transfer_id: "xfer-1".into(),
                block_ids: GroupBlocks(vec![span(0, &[1, 2, 3]), span(1, &[6, 7])]),
                traceparent: None,
            })
            .await
            .expect("worker alive");
        let serve = ServePull {
            pull_id: 3,
            d_req_id: "cmpl-d".into(),
            transfer_id: "xfer-1".into(),
            block_ids: GroupBlocks(vec![span(1, &[10, 11]), span(2, &[12])]),
            data_addr: "127.0.0.1:1".into(),
            layout: rig.d.layout(),
            traceparent: None,
            fence: 0,
            d_rank,
            write_by: None,
            rdma: None,
        };
        rig.worker.tell(serve).await.expect("worker alive");
        let out = rig.next().await;
        let result = out.reply.expect("answers the pull").result;
        assert!(out.finished, "P's blocks are freed either way");
        if refused {
            let err = result.expect_err("another shape is refused");
            assert_eq!(err.cause, PullErrorCause::LayoutMismatch);
            assert!(err.detail.contains("P runs tp 1 × pp 1, D tp 2 × pp 1"), "{}", err.detail);
        } else {
            result.expect("written");
            // P's blocks 2, 3 (full attention, positions 1–2) and 7 (the window's position 2).
            let p = filled_cache(8, 1);
            for (src, dst) in [(2, 10), (3, 11), (7, 12)] {
                let (want, got) = (p.block_bytes(src).expect("in range"), rig.d.block_bytes(dst).expect("in range"));
                assert_eq!(want, got, "P {src} → D {dst}");
            }
        }
    }
}
