//! P's worker-side steps 14 and 27 (the SendWorker records a pending, then a ready send) join the
//! request's trace through the traceparent the scheduler's metadata carries — whether or not D's
//! pull, which carries it too, came first.
//!
//! A test binary of its own: it installs the process's global subscriber.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU16;
use std::sync::Arc;
use std::time::Duration;

use kameo::prelude::*;
use pdflow_actors::sender_listener::{SenderListener, SenderListenerArgs};
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_messages::sender_listener::RecordSendReqs;
use pdflow_observability::capture::SpanCapture;
use pdflow_observability::{attrs, steps};
use pdflow_transfer::tcp::{TcpConfig, TcpTransferEngine};
use tokio::sync::Notify;
use tracing_subscriber::layer::SubscriberExt;

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

#[tokio::test]
async fn steps_14_and_27_join_the_requests_trace_before_any_pull() {
    let capture = SpanCapture::new();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(capture.clone()))
        .expect("the only subscriber of this test binary");
    let shape = KvShape { num_layers: 2, num_kv_heads: 2, head_dim: 8, dtype_bytes: 2, block_size: 4 };
    let cache = KvCache::new(shape, 8);
    let listener = SenderListener::spawn(SenderListenerArgs {
        engine_id: "p".into(),
        dp_rank: 0,
        rank: pdflow_actors::ranks::WorkerRank::single(cache.shape()),
        bind_host: "127.0.0.1".into(),
        side_channel_port: Arc::new(AtomicU16::new(0)),
        bootstrap_url: None,
        kv_cache: cache.clone(),
        transfer: Arc::new(TcpTransferEngine::new(cache.region_table(), TcpConfig::default())),
        ready_timeout: Duration::from_secs(30),
        send_expiry: Duration::from_secs(30),
        register_attempts: 1,
        register_backoff: Duration::from_millis(10),
        events: Arc::new(Notify::new()),
        verify_checksums: false,
        lineage: Default::default(),
        faults: pdflow_actors::fault_seam::no_faults(),
        auth: Default::default(),
    });
    listener.wait_for_startup().await;
    let traceparents = BTreeMap::from([("p1".into(), TRACEPARENT.to_string())]);
    for blocks in [Vec::<u32>::new(), vec![1, 2]] {
        let reqs_to_send = BTreeMap::from([("p1".into(), ("xfer-p1".into(), blocks.into()))]);
        let msg = RecordSendReqs { reqs_to_send, traceparents: traceparents.clone(), ..RecordSendReqs::default() };
        listener.ask(msg).await.expect("recorded");
    }
    let want = [steps::P_RECORD_SEND_PENDING.number, steps::P_RECORD_SEND_READY.number];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let seen: Vec<(u8, Option<String>)> =
            capture.spans().iter().map(|s| (s.step, s.attr(attrs::TRACEPARENT).map(str::to_owned))).collect();
        if want.iter().all(|step| seen.contains(&(*step, Some(TRACEPARENT.into())))) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "steps 14 and 27 not under the request's trace: {seen:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    listener.kill();
}
