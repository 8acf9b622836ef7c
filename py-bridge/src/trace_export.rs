//! Trace export from inside vLLM's processes: the actors' step spans (seed steps 1–5, 12–14,
//! 17–23, 26–36 as they run in P's and D's engine and worker processes) go where OpenTelemetry's
//! variables say — `OTEL_EXPORTER_OTLP_ENDPOINT` / `_TRACES_ENDPOINT` / `_PROTOCOL`,
//! `OTEL_TRACES_EXPORTER`, `OTEL_SERVICE_NAME` — and, with `PDFLOW_TRACE_FILE`, to a Jaeger JSON
//! file written when the connector shuts down. Nothing is installed when none is set.
//!
//! One exporter per process, installed by the first connector created in it; the OTLP exporter
//! runs on its own thread, so neither vLLM's threads nor the actors' runtimes carry it.

use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use pdflow_observability::export::{keep_all, ExportConfig, ExportSettings, TraceExport};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::error::BridgeError;

struct ProcessExport {
    pid: u32,
    export: TraceExport,
}

static EXPORT: OnceLock<Mutex<Option<ProcessExport>>> = OnceLock::new();

fn settings(env: &dyn Fn(&str) -> Option<String>) -> ExportSettings {
    ExportSettings {
        otlp_endpoint: env("OTEL_EXPORTER_OTLP_ENDPOINT"),
        otlp_traces_endpoint: env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        otlp_protocol: env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL").or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL")),
        traces_exporter: env("OTEL_TRACES_EXPORTER"),
        service_name: env("OTEL_SERVICE_NAME"),
        schedule_delay_ms: env("OTEL_BSP_SCHEDULE_DELAY").and_then(|v| v.trim().parse().ok()),
        timeout_ms: env("OTEL_EXPORTER_OTLP_TIMEOUT").and_then(|v| v.trim().parse().ok()),
        trace_file: env("PDFLOW_TRACE_FILE").filter(|p| !p.trim().is_empty()).map(PathBuf::from),
    }
}

/// Installs this process's exporter if the environment asks for one (idempotent per process).
pub fn install_from_env() -> Result<(), BridgeError> {
    let cell = EXPORT.get_or_init(|| Mutex::new(None));
    let mut slot = cell.lock().unwrap_or_else(|p| p.into_inner());
    if slot.as_ref().is_some_and(|e| e.pid == std::process::id()) {
        return Ok(());
    }
    let s = settings(&|k| std::env::var(k).ok());
    // A service name set by the user names every span; otherwise spans are named by the step's
    // side (pdflow-prefill, pdflow-decode, pdflow-bootstrap).
    let service = s.service_name.clone().filter(|n| !n.trim().is_empty());
    let config = ExportConfig::from_settings(&s, service.as_deref()).map_err(|errors| {
        BridgeError::Config(format!("trace export: {}", errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")))
    })?;
    if config.is_off() {
        return Ok(());
    }
    let export = TraceExport::start(&config).map_err(|e| BridgeError::Config(format!("trace export: {e}")))?;
    if let Some(layer) = export.layer() {
        if tracing_subscriber::registry().with(layer).try_init().is_err() {
            tracing::warn!("a tracing subscriber is already installed in this process: pdflow's step spans are not exported");
        }
    }
    *slot = Some(ProcessExport { pid: std::process::id(), export });
    Ok(())
}

/// Sends what is left and writes the trace file (bounded); called by the connector's shutdown.
pub fn flush() {
    let Some(cell) = EXPORT.get() else { return };
    let slot = cell.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(e) = slot.as_ref().filter(|e| e.pid == std::process::id()) {
        if let Err(err) = e.export.finish(Duration::from_secs(5), keep_all) {
            tracing::warn!(error = %err, "pdflow trace export: flush failed");
        }
    }
}
