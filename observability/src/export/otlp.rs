//! OTLP export: finished step spans become OTLP protobuf messages (`opentelemetry-proto`), sent
//! in batches over gRPC (`TraceService/Export`) or HTTP/protobuf (`POST /v1/traces`).
//!
//! The layer never waits on the network: spans go into a bounded queue (dropped and counted when
//! it is full) read by one exporter thread with its own small runtime. Every send has a deadline.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_client::TraceServiceClient;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{span::SpanKind, ResourceSpans, ScopeSpans, Span};
use prost::Message as _;

use super::layer::SpanSink;
use super::span::{AttrValue, FinishedSpan};
use super::{ExportError, OtlpConfig, Protocol};
use crate::steps;

/// Spans queued for export at most; beyond it new spans are dropped (and counted).
const QUEUE_CAPACITY: usize = 16_384;
/// Spans per export request at most.
const MAX_BATCH: usize = 512;

/// The instrumentation scope's name on every exported span.
pub const SCOPE_NAME: &str = "pdflow";

fn kv(key: &str, value: AttrValue) -> KeyValue {
    let value = match value {
        AttrValue::Int(i) => any_value::Value::IntValue(i),
        AttrValue::Float(f) => any_value::Value::DoubleValue(f),
        AttrValue::Bool(b) => any_value::Value::BoolValue(b),
        AttrValue::Str(s) => any_value::Value::StringValue(s),
    };
    KeyValue { key: key.to_owned(), value: Some(AnyValue { value: Some(value) }), ..Default::default() }
}

fn kind(step: u8) -> SpanKind {
    if step == steps::CLIENT_REQUEST.number {
        SpanKind::Server
    } else if [steps::DISPATCH_PREFILL.number, steps::DISPATCH_DECODE.number, steps::D_SEND_PULL_META.number]
        .contains(&step)
    {
        SpanKind::Client
    } else {
        SpanKind::Internal
    }
}

fn to_proto(span: &FinishedSpan) -> Span {
    Span {
        trace_id: span.trace_id.0.to_vec(),
        span_id: span.span_id.0.to_vec(),
        parent_span_id: span.parent.map(|p| p.0.to_vec()).unwrap_or_default(),
        flags: 1,
        name: span.name.clone(),
        kind: kind(span.step) as i32,
        start_time_unix_nano: span.start_unix_nanos,
        end_time_unix_nano: span.end_unix_nanos,
        attributes: span.attrs.iter().map(|(k, v)| kv(k, v.clone())).collect(),
        ..Default::default()
    }
}

/// One OTLP request for a batch: one `ResourceSpans` per `service.name`.
pub fn export_request(spans: &[FinishedSpan]) -> ExportTraceServiceRequest {
    let mut by_service: BTreeMap<&str, Vec<Span>> = BTreeMap::new();
    for s in spans {
        by_service.entry(s.service.as_str()).or_default().push(to_proto(s));
    }
    let resource_spans = by_service
        .into_iter()
        .map(|(service, spans)| ResourceSpans {
            resource: Some(Resource {
                attributes: vec![kv("service.name", AttrValue::Str(service.to_owned()))],
                ..Default::default()
            }),
            scope_spans: vec![ScopeSpans {
                scope: Some(InstrumentationScope {
                    name: SCOPE_NAME.into(),
                    version: env!("CARGO_PKG_VERSION").into(),
                    ..Default::default()
                }),
                spans,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        })
        .collect();
    ExportTraceServiceRequest { resource_spans }
}

enum Command {
    Span(Box<FinishedSpan>),
    Flush(mpsc::SyncSender<()>),
}

/// The OTLP sink: a bounded queue and the exporter thread behind it.
pub struct OtlpExporter {
    queue: SyncSender<Command>,
    dropped: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl SpanSink for OtlpExporter {
    fn export(&self, span: &FinishedSpan) {
        if let Err(TrySendError::Full(_)) = self.queue.try_send(Command::Span(Box::new(span.clone()))) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl OtlpExporter {
    /// Starts the exporter thread. Nothing is connected yet: gRPC connects lazily.
    pub fn start(config: OtlpConfig) -> Result<Self, ExportError> {
        let (queue, rx) = mpsc::sync_channel(QUEUE_CAPACITY);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| ExportError::Runtime(e.to_string()))?;
        let client = Client::new(&config, &runtime)?;
        let thread = std::thread::Builder::new()
            .name("pdflow-otlp".into())
            .spawn(move || run(rx, client, runtime, config))
            .map_err(|e| ExportError::Runtime(e.to_string()))?;
        Ok(Self { queue, dropped: Arc::new(AtomicU64::new(0)), thread: Some(thread) })
    }

    /// Sends everything queued so far; returns once sent or after `deadline`.
    pub fn flush(&self, deadline: Duration) -> bool {
        let (ack, done) = mpsc::sync_channel(1);
        if !send_within(&self.queue, Command::Flush(ack), deadline) {
            return false;
        }
        done.recv_timeout(deadline).is_ok()
    }

    /// Spans dropped because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

impl Drop for OtlpExporter {
    fn drop(&mut self) {
        // Closing the queue ends the thread after its last batch; it is not joined (its sends
        // have their own deadline and the process may be exiting).
        self.thread.take();
    }
}

/// `SyncSender::send` with a deadline (std has none): retries while the queue is full.
fn send_within(queue: &SyncSender<Command>, mut cmd: Command, deadline: Duration) -> bool {
    let until = Instant::now() + deadline;
    loop {
        match queue.try_send(cmd) {
            Ok(()) => return true,
            Err(TrySendError::Full(c)) if Instant::now() < until => {
                cmd = c;
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(_) => return false,
        }
    }
}

enum Client {
    Grpc(TraceServiceClient<tonic::transport::Channel>),
    Http { client: reqwest::Client, url: String },
}

impl Client {
    fn new(config: &OtlpConfig, runtime: &tokio::runtime::Runtime) -> Result<Self, ExportError> {
        match config.protocol {
            Protocol::Grpc => {
                let endpoint = tonic::transport::Endpoint::from_shared(config.endpoint.clone())
                    .map_err(|e| ExportError::Endpoint { endpoint: config.endpoint.clone(), reason: e.to_string() })?
                    .connect_timeout(config.timeout)
                    .timeout(config.timeout);
                let _guard = runtime.enter();
                Ok(Self::Grpc(TraceServiceClient::new(endpoint.connect_lazy())))
            }
            Protocol::HttpProtobuf => {
                let client =
                    reqwest::Client::builder().no_proxy().timeout(config.timeout).build().map_err(|e| {
                        ExportError::Endpoint { endpoint: config.endpoint.clone(), reason: e.to_string() }
                    })?;
                Ok(Self::Http { client, url: config.endpoint.clone() })
            }
        }
    }

    async fn send(&mut self, spans: &[FinishedSpan], deadline: Duration) -> Result<(), String> {
        let request = export_request(spans);
        let call = async {
            match self {
                Self::Grpc(client) => client
                    .export(request)
                    .await
                    .map(|_| ())
                    .map_err(|s| format!("gRPC status {:?}: {}", s.code(), s.message())),
                Self::Http { client, url } => {
                    let resp = client
                        .post(url.as_str())
                        .header("content-type", "application/x-protobuf")
                        .body(request.encode_to_vec())
                        .send()
                        .await
                        .map_err(|e| e.to_string())?;
                    if resp.status().is_success() {
                        Ok(())
                    } else {
                        Err(format!("HTTP {}", resp.status()))
                    }
                }
            }
        };
        tokio::time::timeout(deadline, call).await.map_err(|_| format!("no answer within {deadline:?}"))?
    }
}

fn run(rx: Receiver<Command>, mut client: Client, runtime: tokio::runtime::Runtime, config: OtlpConfig) {
    let mut batch: Vec<FinishedSpan> = Vec::new();
    let mut failures = 0u64;
    let mut next_send = Instant::now() + config.schedule_delay;
    loop {
        let wait = next_send.saturating_duration_since(Instant::now());
        let (flush_ack, closed) = match rx.recv_timeout(wait) {
            Ok(Command::Span(s)) => {
                batch.push(*s);
                (None, false)
            }
            Ok(Command::Flush(ack)) => (Some(ack), false),
            Err(RecvTimeoutError::Timeout) => (None, false),
            Err(RecvTimeoutError::Disconnected) => (None, true),
        };
        let due = Instant::now() >= next_send || batch.len() >= MAX_BATCH || flush_ack.is_some() || closed;
        if due {
            while !batch.is_empty() {
                let n = batch.len().min(MAX_BATCH);
                if let Err(reason) = runtime.block_on(client.send(&batch[..n], config.timeout)) {
                    failures += 1;
                    if failures == 1 || failures.is_multiple_of(100) {
                        tracing::warn!(endpoint = %config.endpoint, %reason, failures, spans = n, "OTLP export failed; spans dropped");
                    }
                }
                batch.drain(..n);
            }
            next_send = Instant::now() + config.schedule_delay;
        }
        if let Some(ack) = flush_ack {
            let _ = ack.try_send(());
        }
        if closed {
            return;
        }
    }
}
