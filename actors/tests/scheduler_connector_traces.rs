//! The SchedulerConnector's step spans (seed steps 13, 18, 26, 32, 35, 36, in vLLM's engine-core
//! process) join the request's trace through its traceparent, as the worker actors' spans do.
//!
//! A test binary of its own: it installs the process's global subscriber, which a test sharing
//! a process with others could not do without racing their span callsites.

use kameo::prelude::*;
use pdflow_actors::scheduler_connector::{KvRole, SchedulerConnector, SchedulerConnectorArgs};
use pdflow_messages::kv_transfer_params::KvTransferParams;
use pdflow_messages::scheduler_connector::{
    BuildConnectorMeta, ConnectorOutput, SchedRequest, UpdateConnectorOutput, UpdateStateAfterAlloc,
};
use pdflow_observability::capture::SpanCapture;
use pdflow_observability::{attrs, steps};
use tracing_subscriber::layer::SubscriberExt;

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

#[tokio::test]
async fn the_scheduler_side_step_spans_join_the_requests_trace() {
    let capture = SpanCapture::new();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(capture.clone()))
        .expect("the only subscriber of this test binary");
    let d = SchedulerConnector::spawn(SchedulerConnectorArgs {
        engine_id: "d".into(),
        role: KvRole::Consumer,
        bootstrap_addr: None,
        layerwise: false,
        groups: Vec::new(),
        null_block: None,
    });
    d.wait_for_startup().await;
    let request = SchedRequest {
        request_id: "d1".into(),
        prompt_len: 1000,
        kv_transfer_params: Some(KvTransferParams::for_decode("xfer-d1", "http://127.0.0.1:8998", "p-engine")),
        traceparent: Some(TRACEPARENT.into()),
    };
    d.ask(UpdateStateAfterAlloc { request, block_ids: (0..63).collect(), num_external_tokens: 1000 })
        .await
        .expect("ask delivered");
    d.ask(BuildConnectorMeta::default()).await.expect("ask delivered");
    let output = ConnectorOutput { finished_recving: ["d1".into()].into(), ..ConnectorOutput::default() };
    d.ask(UpdateConnectorOutput { output }).await.expect("ask delivered");
    let seen: Vec<(u8, Option<String>)> =
        capture.spans().iter().map(|s| (s.step, s.attr(attrs::TRACEPARENT).map(str::to_owned))).collect();
    for step in [steps::D_META_RECV.number, steps::D_REPORT_RECV.number, steps::D_MARK_RECV.number] {
        assert!(
            seen.contains(&(step, Some(TRACEPARENT.into()))),
            "step {step} not under the request's trace: {seen:?}"
        );
    }
}
