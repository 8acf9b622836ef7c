//! The actor setup `pdflow bench transfer` drives: P's SenderListener (side channel, SendWorkers,
//! the transfer engine under test) and D's Receiver (bootstrap look-up, PullTasks) with D's data
//! server and a bootstrap, all in this process over 127.0.0.1 — the seed's steps 20–35 for the
//! transfer, with the scheduler's part played by the bench (`RecordSendReqs` as after step 27,
//! `StartLoadKv` as step 19, `GetFinishedRecving` as step 35). With a fence that holds D's RDMA
//! target, D's Receiver grants each pull's blocks and revokes them when the pull ends, as a node
//! with `--transport rdma` does.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use kameo::prelude::*;
use pdflow_actors::receiver::{Receiver, ReceiverArgs};
use pdflow_actors::sender_listener::{SenderListener, SenderListenerArgs};
use pdflow_kv::memory::KvCache;
use pdflow_messages::receiver::{GetFinishedRecving, StartLoadKv};
use pdflow_messages::scheduler_connector::PullMeta;
use pdflow_messages::sender_listener::{GetFinishedSending, RecordSendReqs};
use pdflow_messages::{BlockId, RequestId};
use pdflow_transfer::fence::WriteFence;
use pdflow_transfer::TransferEngine;
use tokio::sync::Notify;

use crate::bench::report::{Sample, Stopwatch};

use pdflow_node::BootstrapNode;

/// How long one measured request may take before the bench gives up.
const REQUEST_DEADLINE: Duration = Duration::from_secs(30);

/// One P (listener + engine under test) and one D (receiver) sharing a bootstrap.
pub struct ActorPair {
    pub p_engine_id: String,
    listener: ActorRef<SenderListener>,
    receiver: ActorRef<Receiver>,
    d_events: Arc<Notify>,
    bootstrap_url: String,
    next_id: AtomicU64,
}

impl ActorPair {
    /// Starts P's listener with `transfer` over `p_cache`, and D's receiver over `d_cache` whose
    /// data server listens at `d_data_addr`, its pulls fenced by `fence` (which may hold D's RDMA
    /// target) when one is given; under `secret`, and with `tls` on the side channel.
    pub async fn start(
        tag: &str,
        bootstrap: &BootstrapNode,
        p_cache: &Arc<KvCache>,
        transfer: Arc<dyn TransferEngine>,
        d_cache: &Arc<KvCache>,
        (d_data_addr, fence): (String, Option<WriteFence>),
        (secret, tls): (Option<pdflow_auth::ClusterSecret>, Option<pdflow_auth::TlsIdentity>),
    ) -> anyhow::Result<Self> {
        let p_engine_id = format!("bench-p-{tag}");
        let listener = SenderListener::spawn(SenderListenerArgs {
            auth: pdflow_actors::side_channel_auth::ListenerAuth::new(secret.clone()).with_tls(tls.clone()),
            faults: pdflow_actors::fault_seam::no_faults(),
            engine_id: p_engine_id.clone().into(),
            dp_rank: 0,
            rank: pdflow_actors::ranks::WorkerRank::single(p_cache.shape()),
            bind_host: "127.0.0.1".into(),
            side_channel_port: Arc::new(AtomicU16::new(0)),
            bootstrap_url: Some(bootstrap.url()),
            kv_cache: p_cache.clone(),
            transfer,
            ready_timeout: REQUEST_DEADLINE,
            send_expiry: REQUEST_DEADLINE,
            register_attempts: 4,
            register_backoff: Duration::from_millis(50),
            events: Arc::new(Notify::new()),
            verify_checksums: false,
            lineage: Default::default(),
        });
        pdflow_node::started("SenderListener", &listener).await?;
        let d_events = Arc::new(Notify::new());
        let receiver = Receiver::spawn(ReceiverArgs {
            auth: pdflow_actors::side_channel_auth::PullAuth { secret, tls: tls.clone() },
            faults: pdflow_actors::fault_seam::no_faults(),
            engine_id: format!("bench-d-{tag}").into(),
            rank: pdflow_actors::ranks::WorkerRank::single(d_cache.shape()),
            kv_cache: d_cache.clone(),
            data_addr: d_data_addr,
            pull_timeout: REQUEST_DEADLINE,
            bootstrap_timeout: Duration::from_secs(5),
            events: d_events.clone(),
            verify_checksums: false,
            fence,
        });
        pdflow_node::started("Receiver", &receiver).await?;
        Ok(Self {
            p_engine_id,
            listener,
            receiver,
            d_events,
            bootstrap_url: bootstrap.url(),
            next_id: AtomicU64::new(0),
        })
    }

    /// Moves one request per entry of `d_blocks` (each from `p_blocks`) P→D through the actors;
    /// returns the time from `StartLoadKv` until D's receiver reported every one finished, and the
    /// process's CPU time over the same span.
    pub async fn transfer(&self, p_blocks: &[BlockId], d_blocks: &[Vec<BlockId>]) -> anyhow::Result<Sample> {
        let mut reqs_to_send = BTreeMap::new();
        let mut pulls = BTreeMap::new();
        for d in d_blocks {
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let (p_req, d_req, xfer) = (format!("cmpl-p-{id}"), format!("cmpl-d-{id}"), format!("xfer-{id}"));
            reqs_to_send.insert(p_req.into(), (xfer.clone().into(), p_blocks.to_vec().into()));
            let meta = PullMeta {
                d_req_id: d_req.clone().into(),
                transfer_id: xfer.into(),
                local_block_ids: d.clone().into(),
                remote_engine_id: self.p_engine_id.clone().into(),
                remote_bootstrap_addr: self.bootstrap_url.clone(),
                traceparent: None,
            };
            pulls.insert(d_req.into(), meta);
        }
        let expected: BTreeSet<RequestId> = pulls.keys().cloned().collect();
        // Step 27 as P's scheduler reports it: the requests' blocks are final.
        let ready = RecordSendReqs { reqs_to_send, ..RecordSendReqs::default() };
        self.listener.ask(ready).await.map_err(|e| anyhow!("SenderListener refused RecordSendReqs: {e}"))?;

        let started = Stopwatch::start();
        let deadline = tokio::time::Instant::now() + REQUEST_DEADLINE;
        let start = StartLoadKv {
            reqs_to_recv: BTreeMap::from([(self.p_engine_id.clone().into(), pulls)]),
            reqs_to_abort: BTreeSet::new(),
        };
        self.receiver.tell(start).await.map_err(|e| anyhow!("Receiver refused StartLoadKv: {e}"))?;
        let mut finished = BTreeSet::new();
        loop {
            let out = self
                .receiver
                .ask(GetFinishedRecving)
                .await
                .map_err(|e| anyhow!("Receiver refused GetFinishedRecving: {e}"))?;
            if let Some((req, why)) = out.failed_recving.iter().next() {
                bail!("D's pull of {req} failed: {why}");
            }
            finished.extend(out.finished_recving);
            if expected.is_subset(&finished) {
                break;
            }
            // The receiver notifies (with a stored permit) whenever results are ready.
            tokio::time::timeout_at(deadline, self.d_events.notified())
                .await
                .with_context(|| format!("the transfer did not finish within {REQUEST_DEADLINE:?}"))?;
        }
        let took = started.stop();
        // P's side of step 32, so finished_sending does not grow across runs.
        let _ = self.listener.ask(GetFinishedSending).await;
        Ok(took)
    }

    pub async fn shutdown(self) {
        for stop in [self.listener.stop_gracefully().await.is_ok(), self.receiver.stop_gracefully().await.is_ok()] {
            let _ = stop;
        }
        self.listener.wait_for_shutdown().await;
        self.receiver.wait_for_shutdown().await;
    }
}
