//! Trace export, chosen at run time: OTLP over gRPC or HTTP/protobuf, a Jaeger JSON file, or
//! nothing (the default — then no layer is installed and step spans cost what `tracing` costs).
//!
//! - [`layer`] — the `tracing` layer that gives each closed step span its OpenTelemetry ids
//!   (one trace per request, steps 8–43; one start-up trace per node, steps 1–7).
//! - [`otlp`] — batches to an OTLP receiver (gRPC `TraceService/Export` or `POST /v1/traces`).
//! - [`jaeger`] — the Jaeger UI "JSON File" format, written at shutdown and read by the renderer.
//!
//! Configuration follows OpenTelemetry's variables (`OTEL_EXPORTER_OTLP_ENDPOINT`,
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_PROTOCOL`, `OTEL_SERVICE_NAME`,
//! `OTEL_TRACES_EXPORTER`, `OTEL_BSP_SCHEDULE_DELAY`, `OTEL_EXPORTER_OTLP_TIMEOUT`); the CLI reads
//! them (and its flags) into [`ExportSettings`], validated here before anything starts.

pub mod jaeger;
pub mod layer;
pub mod otlp;
pub mod span;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use jaeger::{JaegerFile, MemorySink};
pub use layer::{ExportLayer, SpanSink};
pub use otlp::OtlpExporter;
pub use span::{AttrValue, FinishedSpan};

use crate::steps::{self, Owner, Side};

/// Service names of the nodes.
pub const SERVICE_PROXY: &str = "pdflow-proxy";
pub const SERVICE_PREFILL: &str = "pdflow-prefill";
pub const SERVICE_DECODE: &str = "pdflow-decode";
pub const SERVICE_BOOTSTRAP: &str = "pdflow-bootstrap";

/// How a span's `service.name` is chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServiceNaming {
    /// One node per process: every span has this service.
    Fixed(String),
    /// Several nodes in one process (`pdflow demo`): from the step's owner and side.
    ByStep,
}

impl ServiceNaming {
    /// The service of a span of step `step`.
    pub fn service_for(&self, step: u8) -> String {
        match self {
            Self::Fixed(name) => name.clone(),
            Self::ByStep => service_of_step(step).to_owned(),
        }
    }
}

/// The node a step runs on, from the catalogue: bootstrap steps on `pdflow-bootstrap`, then by side.
pub fn service_of_step(step: u8) -> &'static str {
    match steps::by_number(step) {
        Some(s) if s.owner == Owner::Bootstrap => SERVICE_BOOTSTRAP,
        Some(s) => match s.side {
            Side::Proxy => SERVICE_PROXY,
            Side::P => SERVICE_PREFILL,
            Side::D => SERVICE_DECODE,
        },
        None => "pdflow",
    }
}

/// OTLP transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// `grpc`: `opentelemetry.proto.collector.trace.v1.TraceService/Export` (default port 4317).
    Grpc,
    /// `http/protobuf`: `POST {endpoint}/v1/traces` (default port 4318).
    HttpProtobuf,
}

/// Where and how to send OTLP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpConfig {
    /// gRPC: the collector's URL; HTTP: the full URL of the traces resource.
    pub endpoint: String,
    pub protocol: Protocol,
    /// Deadline of each export call.
    pub timeout: Duration,
    /// Longest time a finished span waits in the batch.
    pub schedule_delay: Duration,
}

/// Raw settings, as the CLI read them from flags and `OTEL_*` variables.
#[derive(Debug, Clone, Default)]
pub struct ExportSettings {
    pub otlp_endpoint: Option<String>,
    pub otlp_traces_endpoint: Option<String>,
    pub otlp_protocol: Option<String>,
    /// `OTEL_TRACES_EXPORTER`: `otlp` or `none`.
    pub traces_exporter: Option<String>,
    pub service_name: Option<String>,
    pub schedule_delay_ms: Option<u64>,
    pub timeout_ms: Option<u64>,
    pub trace_file: Option<PathBuf>,
}

/// What to export, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportConfig {
    pub otlp: Option<OtlpConfig>,
    pub trace_file: Option<PathBuf>,
    pub naming: ServiceNaming,
}

/// Why export could not be configured or started.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("OTEL_EXPORTER_OTLP_PROTOCOL / --otlp-protocol {0:?} is not supported: use `grpc` or `http/protobuf`")]
    Protocol(String),
    #[error("OTEL_TRACES_EXPORTER {0:?} is not supported: use `otlp` or `none`")]
    Exporter(String),
    #[error("OTLP endpoint {endpoint:?} is not usable ({reason}); expected e.g. http://127.0.0.1:4317")]
    Endpoint { endpoint: String, reason: String },
    #[error("trace file {path}: {reason}")]
    TraceFile { path: PathBuf, reason: String },
    #[error("cannot start the OTLP exporter thread: {0}")]
    Runtime(String),
}

impl ExportConfig {
    /// Validates the settings; `default_service` names the node (`None` in the demo: by step).
    /// Every problem is reported at once.
    pub fn from_settings(settings: &ExportSettings, default_service: Option<&str>) -> Result<Self, Vec<ExportError>> {
        let mut errors = Vec::new();
        let naming = match (default_service, &settings.service_name) {
            (None, _) => ServiceNaming::ByStep,
            (Some(_), Some(name)) if !name.trim().is_empty() => ServiceNaming::Fixed(name.trim().to_owned()),
            (Some(default), _) => ServiceNaming::Fixed(default.to_owned()),
        };
        let protocol = match settings.otlp_protocol.as_deref().map(str::trim) {
            None | Some("") | Some("http/protobuf") => Protocol::HttpProtobuf,
            Some("grpc") => Protocol::Grpc,
            Some(other) => {
                errors.push(ExportError::Protocol(other.to_owned()));
                Protocol::HttpProtobuf
            }
        };
        let wanted = match settings.traces_exporter.as_deref().map(str::trim) {
            None | Some("") => None,
            Some("otlp") => Some(true),
            Some("none") => Some(false),
            Some(other) => {
                errors.push(ExportError::Exporter(other.to_owned()));
                Some(false)
            }
        };
        let non_empty = |s: &Option<String>| s.as_deref().map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned);
        let (base, traces) = (non_empty(&settings.otlp_endpoint), non_empty(&settings.otlp_traces_endpoint));
        let enabled = wanted.unwrap_or(base.is_some() || traces.is_some());
        let otlp = if enabled {
            let endpoint = match (traces, base, protocol) {
                (Some(t), _, _) => t,
                (None, Some(b), Protocol::Grpc) => b,
                (None, Some(b), Protocol::HttpProtobuf) => format!("{}/v1/traces", b.trim_end_matches('/')),
                (None, None, Protocol::Grpc) => "http://localhost:4317".to_owned(),
                (None, None, Protocol::HttpProtobuf) => "http://localhost:4318/v1/traces".to_owned(),
            };
            if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
                errors.push(ExportError::Endpoint { endpoint: endpoint.clone(), reason: "not an http:// URL".into() });
            } else if endpoint.starts_with("https://") {
                errors.push(ExportError::Endpoint {
                    endpoint: endpoint.clone(),
                    reason: "TLS is not built in; use a local collector over http://".into(),
                });
            }
            Some(OtlpConfig {
                endpoint,
                protocol,
                timeout: Duration::from_millis(settings.timeout_ms.unwrap_or(10_000).max(1)),
                schedule_delay: Duration::from_millis(settings.schedule_delay_ms.unwrap_or(1_000)),
            })
        } else {
            None
        };
        if errors.is_empty() {
            Ok(Self { otlp, trace_file: settings.trace_file.clone(), naming })
        } else {
            Err(errors)
        }
    }

    /// True when nothing is exported.
    pub fn is_off(&self) -> bool {
        self.otlp.is_none() && self.trace_file.is_none()
    }
}

/// The running export: its layer (to install) and the handles to flush at shutdown.
pub struct TraceExport {
    layer: Option<ExportLayer>,
    memory: Option<Arc<MemorySink>>,
    otlp: Option<Arc<OtlpExporter>>,
    trace_file: Option<PathBuf>,
}

/// Adapts an `Arc<T: SpanSink>` so the layer and this handle share one sink.
struct Shared<T>(Arc<T>);

impl<T: SpanSink> SpanSink for Shared<T> {
    fn export(&self, span: &FinishedSpan) {
        self.0.export(span);
    }
}

impl TraceExport {
    /// Starts the exporters the config asks for (none: no layer at all).
    pub fn start(config: &ExportConfig) -> Result<Self, ExportError> {
        let mut sinks: Vec<Arc<dyn SpanSink>> = Vec::new();
        let memory = config.trace_file.as_ref().map(|_| Arc::new(MemorySink::default()));
        if let Some(m) = &memory {
            sinks.push(Arc::new(Shared(m.clone())));
        }
        let otlp = match &config.otlp {
            Some(c) => Some(Arc::new(OtlpExporter::start(c.clone())?)),
            None => None,
        };
        if let Some(o) = &otlp {
            sinks.push(Arc::new(Shared(o.clone())));
        }
        let layer = (!sinks.is_empty()).then(|| ExportLayer::new(config.naming.clone(), sinks));
        Ok(Self { layer, memory, otlp, trace_file: config.trace_file.clone() })
    }

    /// The layer to install, if anything is exported.
    pub fn layer(&self) -> Option<ExportLayer> {
        self.layer.clone()
    }

    /// Spans kept for the trace file so far.
    pub fn spans(&self) -> Vec<FinishedSpan> {
        self.memory.as_ref().map(|m| m.spans()).unwrap_or_default()
    }

    /// The trace file, if one was asked for.
    pub fn trace_file(&self) -> Option<&Path> {
        self.trace_file.as_deref()
    }

    /// How many spans the trace file would hold now (0 without one).
    pub fn kept(&self) -> usize {
        self.memory.as_ref().map_or(0, |m| m.len())
    }

    /// Writes the trace file now with every span kept so far (a no-op without one); a process
    /// that may be killed rather than stopped calls it while it runs.
    pub fn write_trace_file(&self) -> Result<(), ExportError> {
        if let (Some(path), Some(memory)) = (&self.trace_file, &self.memory) {
            JaegerFile::from_spans(&memory.spans()).write(path)?;
        }
        Ok(())
    }

    /// Sends what is queued for OTLP (bounded by `deadline`) and writes the trace file with
    /// every span kept (`keep` filters them; the demo keeps its seed request and start-up traces).
    pub fn finish(
        &self,
        deadline: Duration,
        keep: impl Fn(&[FinishedSpan]) -> Vec<FinishedSpan>,
    ) -> Result<(), ExportError> {
        if let Some(o) = &self.otlp {
            if !o.flush(deadline) {
                tracing::warn!(?deadline, "OTLP export did not finish before its deadline; some spans may be lost");
            }
            if o.dropped() > 0 {
                tracing::warn!(dropped = o.dropped(), "OTLP export queue was full; spans were dropped");
            }
        }
        if let (Some(path), Some(memory)) = (&self.trace_file, &self.memory) {
            JaegerFile::from_spans(&keep(&memory.spans())).write(path)?;
        }
        Ok(())
    }
}

/// Keeps the traces that hold a start-up step (1–7) or a request's root (step 8): what the
/// demo's trace file shows (spans of its single-engine reference run have no request trace).
pub fn keep_request_and_startup_traces(spans: &[FinishedSpan]) -> Vec<FinishedSpan> {
    let kept: std::collections::HashSet<_> =
        spans.iter().filter(|s| (1..=steps::CLIENT_REQUEST.number).contains(&s.step)).map(|s| s.trace_id).collect();
    spans.iter().filter(|s| kept.contains(&s.trace_id)).cloned().collect()
}

/// Keeps every span (for [`TraceExport::finish`]).
pub fn keep_all(spans: &[FinishedSpan]) -> Vec<FinishedSpan> {
    spans.to_vec()
}

#[cfg(test)]
mod tests;
