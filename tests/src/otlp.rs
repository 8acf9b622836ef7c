//! A real OTLP receiver for tests — gRPC (`TraceService/Export` over tonic) or HTTP/protobuf
//! (`POST /v1/traces` over axum) on 127.0.0.1:0 — that keeps every span it is sent, and the
//! checks the tracing tests make on them (trace membership, parents, causal order).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use prost::Message as _;
use serde_json::Value;

/// One received span.
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    pub trace_id: String,
    pub span_id: String,
    pub parent: Option<String>,
    pub name: String,
    /// `pd.step`, 0 if absent.
    pub step: u8,
    pub service: String,
    pub start: u64,
    pub end: u64,
    pub attrs: BTreeMap<String, Value>,
}

impl ReceivedSpan {
    /// An attribute as text.
    pub fn text(&self, key: &str) -> Option<String> {
        self.attrs.get(key).map(|v| v.as_str().map(str::to_owned).unwrap_or_else(|| v.to_string()))
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[derive(Clone, Default)]
struct Collected(Arc<Mutex<Vec<ReceivedSpan>>>);

impl Collected {
    fn add(&self, req: ExportTraceServiceRequest) {
        let mut out = self.0.lock().unwrap_or_else(|p| p.into_inner());
        for rs in req.resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref()?.value.as_ref())
                .map(|v| match v {
                    Any::StringValue(s) => s.clone(),
                    other => format!("{other:?}"),
                })
                .unwrap_or_default();
            for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                let attrs: BTreeMap<String, Value> = span
                    .attributes
                    .iter()
                    .filter_map(|kv| {
                        let v = match kv.value.as_ref()?.value.as_ref()? {
                            Any::StringValue(s) => Value::from(s.as_str()),
                            Any::IntValue(i) => Value::from(*i),
                            Any::BoolValue(b) => Value::from(*b),
                            Any::DoubleValue(d) => Value::from(*d),
                            other => Value::from(format!("{other:?}")),
                        };
                        Some((kv.key.clone(), v))
                    })
                    .collect();
                out.push(ReceivedSpan {
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent: (!span.parent_span_id.is_empty()).then(|| hex(&span.parent_span_id)),
                    step: attrs.get("pd.step").and_then(Value::as_u64).and_then(|n| u8::try_from(n).ok()).unwrap_or(0),
                    name: span.name,
                    service: service.clone(),
                    start: span.start_time_unix_nano,
                    end: span.end_time_unix_nano,
                    attrs,
                });
            }
        }
    }
}

struct GrpcService(Collected);

#[tonic::async_trait]
impl TraceService for GrpcService {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.add(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

/// Which OTLP transport the receiver speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Grpc,
    Http,
}

impl Transport {
    /// The value of `OTEL_EXPORTER_OTLP_PROTOCOL`.
    pub fn protocol(self) -> &'static str {
        match self {
            Self::Grpc => "grpc",
            Self::Http => "http/protobuf",
        }
    }
}

/// A running receiver; stops when dropped.
pub struct OtlpReceiver {
    pub addr: SocketAddr,
    pub transport: Transport,
    collected: Collected,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl OtlpReceiver {
    /// Binds 127.0.0.1:0 and serves OTLP over `transport`.
    pub async fn start(transport: Transport) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.context("binding the OTLP receiver")?;
        let addr = listener.local_addr()?;
        let collected = Collected::default();
        let task = match transport {
            Transport::Grpc => {
                let svc = TraceServiceServer::new(GrpcService(collected.clone()));
                let incoming = tonic::transport::server::TcpIncoming::from(listener);
                tokio::spawn(async move {
                    let _ = tonic::transport::Server::builder().add_service(svc).serve_with_incoming(incoming).await;
                })
            }
            Transport::Http => {
                let c = collected.clone();
                let app = axum::Router::new().route(
                    "/v1/traces",
                    axum::routing::post(move |body: axum::body::Bytes| {
                        let c = c.clone();
                        async move {
                            match ExportTraceServiceRequest::decode(body) {
                                Ok(req) => {
                                    c.add(req);
                                    (
                                        axum::http::StatusCode::OK,
                                        ExportTraceServiceResponse { partial_success: None }.encode_to_vec(),
                                    )
                                }
                                Err(e) => (axum::http::StatusCode::BAD_REQUEST, e.to_string().into_bytes()),
                            }
                        }
                    }),
                );
                tokio::spawn(async move {
                    let _ = axum::serve(listener, app).await;
                })
            }
        };
        Ok(Self { addr, transport, collected, task })
    }

    /// The value of `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Environment for a `pdflow` process exporting here (short batch delay).
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", self.endpoint()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", self.transport.protocol().to_owned()),
            ("OTEL_BSP_SCHEDULE_DELAY", "50".to_owned()),
        ]
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.collected.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits (bounded) until `done` holds for the spans received.
    pub async fn wait_until(
        &self,
        deadline: Duration,
        what: &str,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> anyhow::Result<Vec<ReceivedSpan>> {
        let until = Instant::now() + deadline;
        loop {
            let spans = self.spans();
            if done(&spans) {
                return Ok(spans);
            }
            if Instant::now() > until {
                let steps: BTreeSet<u8> = spans.iter().map(|s| s.step).collect();
                let per_trace: Vec<String> = traces(&spans)
                    .into_iter()
                    .map(|(id, t)| {
                        let present: BTreeSet<u8> = t.iter().map(|s| s.step).collect();
                        let missing: Vec<u8> = (1..=43).filter(|n| !present.contains(n)).collect();
                        format!("{id}: {} spans, missing {missing:?}", t.len())
                    })
                    .collect();
                bail!(
                    "{what}: not within {deadline:?}; {} spans received, steps {steps:?}; per trace: {per_trace:#?}",
                    spans.len()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Spans grouped by trace id.
pub fn traces(spans: &[ReceivedSpan]) -> BTreeMap<String, Vec<ReceivedSpan>> {
    let mut out: BTreeMap<String, Vec<ReceivedSpan>> = BTreeMap::new();
    for s in spans {
        out.entry(s.trace_id.clone()).or_default().push(s.clone());
    }
    out
}

/// The request traces (those holding step 8), oldest first.
pub fn request_traces(spans: &[ReceivedSpan]) -> Vec<Vec<ReceivedSpan>> {
    let mut out: Vec<Vec<ReceivedSpan>> =
        traces(spans).into_values().filter(|t| t.iter().any(|s| s.step == 8)).collect();
    out.sort_by_key(|t| t.iter().filter(|s| s.step == 8).map(|s| s.start).min());
    out
}

/// Whether a trace holds every step of `steps`.
pub fn has_steps(trace: &[ReceivedSpan], steps: impl IntoIterator<Item = u8>) -> bool {
    let present: BTreeSet<u8> = trace.iter().map(|s| s.step).collect();
    steps.into_iter().all(|n| present.contains(&n))
}

/// Problems with parent links: a parent that is not a span of the same trace.
pub fn unresolved_parents(spans: &[ReceivedSpan]) -> Vec<String> {
    let ids: BTreeSet<(&str, &str)> = spans.iter().map(|s| (s.trace_id.as_str(), s.span_id.as_str())).collect();
    spans
        .iter()
        .filter_map(|s| {
            let p = s.parent.as_deref()?;
            (!ids.contains(&(s.trace_id.as_str(), p)))
                .then(|| format!("{} ({}) names parent {p}, not exported in trace {}", s.name, s.service, s.trace_id))
        })
        .collect()
}

/// The first span of a step in a trace.
pub fn step(trace: &[ReceivedSpan], n: u8) -> anyhow::Result<&ReceivedSpan> {
    trace
        .iter()
        .filter(|s| s.step == n)
        .min_by_key(|s| s.start)
        .with_context(|| format!("step {n} is not in the trace"))
}

/// The seed's causal order within one request trace; returns the violations.
pub fn causal_order_violations(trace: &[ReceivedSpan]) -> anyhow::Result<Vec<String>> {
    let mut v = Vec::new();
    let (s21, s22) = (step(trace, 21)?, step(trace, 22)?);
    if s21.start > s22.end {
        v.push("21 (D sends the pull) does not start before 22 (P waits for ready) ends".to_owned());
    }
    for (a, b) in [(8, 9), (8, 10), (11, 15), (27, 29), (28, 29), (29, 30), (30, 34), (34, 37), (37, 39), (39, 43)] {
        let (sa, sb) = (step(trace, a)?, step(trace, b)?);
        if sa.start > sb.start {
            v.push(format!("{a} starts after {b} ({} > {})", sa.start, sb.start));
        }
    }
    let (s29, s30) = (step(trace, 29)?, step(trace, 30)?);
    if s29.end > s30.end {
        v.push("29 (the write) ends after 30 (FINISH sent)".to_owned());
    }
    Ok(v)
}
