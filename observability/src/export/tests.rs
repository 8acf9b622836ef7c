//! Tests of the export layer's trace membership and parent links, and of the settings.

use std::sync::Arc;

use tracing_subscriber::layer::SubscriberExt;

use super::*;
use crate::trace_context::TraceParent;
use crate::{attrs, step_span};

fn run_with_layer(naming: ServiceNaming, f: impl FnOnce()) -> Vec<FinishedSpan> {
    let memory = Arc::new(MemorySink::default());
    let layer = ExportLayer::new(naming, vec![Arc::new(Shared(memory.clone())) as Arc<dyn SpanSink>]);
    tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), f);
    memory.spans()
}

fn by_step(spans: &[FinishedSpan], step: u8) -> &FinishedSpan {
    spans.iter().find(|s| s.step == step).unwrap_or_else(|| panic!("step {step} not exported"))
}

#[test]
fn request_spans_join_the_proxy_trace_and_every_parent_resolves() {
    let tp = TraceParent::random();
    let tps = tp.to_string();
    let spans = run_with_layer(ServiceNaming::ByStep, || {
        let s8 = step_span!(steps::CLIENT_REQUEST, request_id = "r1", transfer_id = "xfer-r1");
        s8.record(attrs::TRACEPARENT, tps.as_str());
        drop(s8);
        // No traceparent: found through the request id.
        drop(step_span!(steps::DISPATCH_PREFILL, request_id = "r1", transfer_id = "xfer-r1"));
        // P's request: its own id, the traceparent from kv_transfer_params.
        let s11 = step_span!(steps::P_ADD_REQUEST, request_id = "p-r1", transfer_id = "xfer-r1");
        s11.record(attrs::TRACEPARENT, tps.as_str());
        drop(s11);
        // Only the transfer id: found through it.
        let s22 = step_span!(steps::P_PULL_WAIT_READY, request_id = "other", transfer_id = "xfer-r1");
        let s29 = s22.in_scope(|| step_span!(steps::P_TRANSFER_WRITE, request_id = "other", transfer_id = "xfer-r1"));
        s29.record(attrs::BYTES, 148_635_648u64);
        s22.record(attrs::TRACEPARENT, tps.as_str());
        drop(s29);
        drop(s22);
    });
    assert_eq!(spans.len(), 5);
    for s in &spans {
        assert_eq!(s.trace_id, tp.trace_id, "{} left the request's trace", s.name);
    }
    let root = by_step(&spans, 8);
    assert_eq!(root.span_id, tp.span_id, "step 8 carries the span id the traceparent names");
    assert_eq!(root.parent, None);
    assert_eq!(root.service, SERVICE_PROXY);
    assert_eq!(by_step(&spans, 9).parent, Some(tp.span_id));
    assert_eq!(by_step(&spans, 11).parent, Some(tp.span_id));
    assert_eq!(by_step(&spans, 11).service, SERVICE_PREFILL);
    assert_eq!(by_step(&spans, 22).parent, Some(tp.span_id));
    // 29 has no traceparent of its own: the transfer id joins it to the trace, and the
    // enclosing step 22 (same trace by then) is its parent.
    assert_eq!(by_step(&spans, 29).parent, Some(by_step(&spans, 22).span_id));
    assert_eq!(by_step(&spans, 29).attr(attrs::BYTES), Some(&AttrValue::Int(148_635_648)));
    assert!(by_step(&spans, 29).attr(attrs::TRACEPARENT).is_none(), "the traceparent is not repeated as an attribute");
    let ids: Vec<_> = spans.iter().map(|s| s.span_id).collect();
    for s in &spans {
        if let Some(p) = s.parent {
            assert!(ids.contains(&p), "{}'s parent {p} is not exported", s.name);
        }
    }
}

#[test]
fn start_up_steps_form_one_trace_per_node() {
    let spans = run_with_layer(ServiceNaming::ByStep, || {
        let init = step_span!(steps::ENGINE_INIT);
        init.in_scope(|| drop(step_span!(steps::REGISTER_KV_CACHES)));
        drop(step_span!(steps::BOOTSTRAP_REGISTER));
        drop(init);
        drop(step_span!(steps::BOOTSTRAP_START));
        drop(step_span!(steps::CONSUMER_INIT));
        drop(step_span!(steps::PROXY_HEALTH));
        drop(step_span!(steps::PROXY_QUERY));
    });
    let (s1, s3, s4) = (by_step(&spans, 1), by_step(&spans, 3), by_step(&spans, 4));
    assert_eq!(s1.trace_id, s3.trace_id);
    assert_eq!(s1.trace_id, s4.trace_id);
    assert_eq!(s3.parent, Some(s1.span_id), "an enclosing start-up step is the parent");
    assert_eq!(s1.parent, None);
    assert_eq!(by_step(&spans, 2).service, SERVICE_BOOTSTRAP);
    assert_eq!(by_step(&spans, 6).trace_id, by_step(&spans, 7).trace_id);
    let traces: std::collections::BTreeSet<_> = spans.iter().map(|s| s.trace_id).collect();
    assert_eq!(traces.len(), 4, "prefill, bootstrap, decode, proxy");
}

#[test]
fn one_node_per_process_names_every_span_alike() {
    let spans = run_with_layer(ServiceNaming::Fixed("pdflow-prefill".into()), || {
        drop(step_span!(steps::ENGINE_INIT));
        drop(step_span!(steps::BOOTSTRAP_START));
    });
    assert!(spans.iter().all(|s| s.service == "pdflow-prefill"));
    assert_eq!(spans[0].trace_id, spans[1].trace_id);
}

#[test]
fn settings_pick_the_exporters() {
    let off = ExportConfig::from_settings(&ExportSettings::default(), Some(SERVICE_PROXY)).expect("valid");
    assert!(off.is_off());
    assert!(TraceExport::start(&off).expect("starts").layer().is_none(), "nothing by default");

    let grpc = ExportSettings {
        otlp_endpoint: Some("http://127.0.0.1:4317".into()),
        otlp_protocol: Some("grpc".into()),
        ..Default::default()
    };
    let c = ExportConfig::from_settings(&grpc, Some(SERVICE_PROXY)).expect("valid");
    let otlp = c.otlp.expect("otlp on");
    assert_eq!((otlp.endpoint.as_str(), otlp.protocol), ("http://127.0.0.1:4317", Protocol::Grpc));
    assert_eq!(c.naming, ServiceNaming::Fixed(SERVICE_PROXY.into()));

    let http = ExportSettings {
        otlp_endpoint: Some("http://127.0.0.1:4318/".into()),
        service_name: Some("edge".into()),
        ..Default::default()
    };
    let c = ExportConfig::from_settings(&http, Some(SERVICE_PROXY)).expect("valid");
    assert_eq!(c.otlp.expect("otlp on").endpoint, "http://127.0.0.1:4318/v1/traces");
    assert_eq!(c.naming, ServiceNaming::Fixed("edge".into()));

    let bad = ExportSettings {
        otlp_endpoint: Some("127.0.0.1:4317".into()),
        otlp_protocol: Some("http/json".into()),
        ..Default::default()
    };
    let errors = ExportConfig::from_settings(&bad, None).expect_err("invalid");
    assert_eq!(errors.len(), 2, "every problem at once: {errors:?}");
}

#[test]
fn jaeger_file_has_one_process_per_service_and_child_of_references() {
    let tp = TraceParent::random();
    let tps = tp.to_string();
    let spans = run_with_layer(ServiceNaming::ByStep, || {
        let s8 = step_span!(steps::CLIENT_REQUEST, request_id = "r1", transfer_id = "x1");
        s8.record(attrs::TRACEPARENT, tps.as_str());
        drop(s8);
        let s16 = step_span!(steps::D_ADD_REQUEST, request_id = "d1", transfer_id = "x1");
        s16.record(attrs::TRACEPARENT, tps.as_str());
        s16.record(attrs::TOKENS, 1000u64);
    });
    let file = JaegerFile::from_spans(&spans);
    let json = serde_json::to_value(&file).expect("serialises");
    let trace = &json["data"][0];
    assert_eq!(trace["traceID"], tp.trace_id.to_hex());
    assert_eq!(trace["processes"].as_object().map(|p| p.len()), Some(2));
    let d = trace["spans"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["operationName"] == "step.16.d_add_request"))
        .expect("step 16");
    assert_eq!(d["references"][0]["refType"], "CHILD_OF");
    assert_eq!(d["references"][0]["spanID"], tp.span_id.to_hex());
    assert!(d["tags"]
        .as_array()
        .is_some_and(|t| t.iter().any(|t| t["key"] == "pd.tokens" && t["type"] == "int64" && t["value"] == 1000)));
    let back: JaegerFile = serde_json::from_value(json).expect("reads back");
    assert_eq!(back.data[0].spans.len(), 2);
}

/// Cost of one step span (create, record a figure and the traceparent, close) with no layer and
/// with the export layer; a measurement, not a check: `cargo test --release -p
/// pdflow-observability --lib span_cost -- --ignored --nocapture`.
#[test]
#[ignore]
fn span_cost() {
    const N: u32 = 200_000;
    let tps = TraceParent::random().to_string();
    let work = || {
        let start = std::time::Instant::now();
        for i in 0..N {
            let span = step_span!(steps::P_TRANSFER_WRITE, request_id = "r1", transfer_id = "xfer-r1");
            span.record(attrs::BYTES, u64::from(i));
            span.record(attrs::TRACEPARENT, tps.as_str());
        }
        start.elapsed() / N
    };
    let bare = tracing::subscriber::with_default(tracing_subscriber::registry(), work);
    let memory = Arc::new(MemorySink::default());
    let layer = ExportLayer::new(ServiceNaming::ByStep, vec![Arc::new(Shared(memory.clone())) as Arc<dyn SpanSink>]);
    let exported = tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), work);
    let otlp = Arc::new(
        OtlpExporter::start(OtlpConfig {
            endpoint: "http://127.0.0.1:9/v1/traces".into(),
            protocol: Protocol::HttpProtobuf,
            timeout: std::time::Duration::from_millis(100),
            schedule_delay: std::time::Duration::from_millis(50),
        })
        .expect("starts"),
    );
    let layer = ExportLayer::new(ServiceNaming::ByStep, vec![Arc::new(Shared(otlp.clone())) as Arc<dyn SpanSink>]);
    let queued = tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), work);
    println!("per step span: registry only {bare:?}, + export layer to memory {exported:?}, + export layer to the OTLP queue {queued:?} ({} dropped: queue full)", otlp.dropped());
}
