//! Trace export from inside vLLM's processes: the actors' step spans (seed steps 1–5, 12–14,
//! 17–23, 26–36 as they run in P's and D's engine and worker processes) go where OpenTelemetry's
//! variables say — `OTEL_EXPORTER_OTLP_ENDPOINT` / `_TRACES_ENDPOINT` / `_PROTOCOL`,
//! `OTEL_TRACES_EXPORTER`, `OTEL_SERVICE_NAME` — and, with `PDFLOW_TRACE_FILE`, to Jaeger JSON
//! files. Nothing is installed when none is set.
//!
//! One vLLM server is several processes (API server, engine core, one worker per rank), each with
//! its own spans: each writes its own file, `PDFLOW_TRACE_FILE` with the process id before the
//! extension (`trace.json` → `trace.<pid>.json`), rewritten whole every [`FILE_INTERVAL`] (or
//! longer, for a file that takes long to write) while new spans arrive and once more at the
//! connector's shutdown, so a server that is killed (vLLM's default `--shutdown-timeout 0` kills
//! its children) keeps all but its last interval's spans.
//!
//! One exporter per process, installed by the first connector created in it; the OTLP exporter
//! and the file writer run on threads of their own, so neither vLLM's threads nor the actors'
//! runtimes carry them. The same subscriber writes pdflow's log lines (warnings by default;
//! `PDFLOW_LOG` takes a filter such as `info` or `pdflow_actors=debug`) to the process's stderr,
//! which is vLLM's log: a refused peer or a missing cluster secret is said there.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use pdflow_observability::export::{keep_all, ExportConfig, ExportSettings, TraceExport};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer as _};

use crate::config::ConfigError;

struct ProcessExport {
    pid: u32,
    /// None: the environment asks for no trace export (the log lines are still written).
    export: Option<TraceExport>,
}

/// The variable that sets which of pdflow's log lines vLLM's log gets (default `warn`).
pub const ENV_LOG: &str = "PDFLOW_LOG";

static EXPORT: OnceLock<Mutex<Option<ProcessExport>>> = OnceLock::new();

/// How often a process's trace file is rewritten while new spans arrive, at most. A file that
/// takes long to write (a long-running server's) waits [`FILE_WRITE_SHARE`] times its last
/// write's duration instead, so rewriting costs at most 1/20 of one thread.
pub const FILE_INTERVAL: Duration = Duration::from_millis(500);
const FILE_WRITE_SHARE: u32 = 20;

/// This process's trace file: `dir/name.ext` → `dir/name.<pid>.ext`.
pub fn per_process_path(path: &Path, pid: u32) -> PathBuf {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let name = match path.extension() {
        Some(ext) => format!("{stem}.{pid}.{}", ext.to_string_lossy()),
        None => format!("{stem}.{pid}"),
    };
    path.with_file_name(name)
}

/// Rewrites this process's trace file while it has new spans; ends with the process's export.
fn write_trace_file_while_running(pid: u32) {
    let mut written = 0usize;
    let mut pause = FILE_INTERVAL;
    loop {
        std::thread::sleep(pause);
        let Some(cell) = EXPORT.get() else { return };
        let slot = cell.lock().unwrap_or_else(|p| p.into_inner());
        let Some(export) = slot.as_ref().filter(|e| e.pid == pid).and_then(|e| e.export.as_ref()) else { return };
        let kept = export.kept();
        if kept != written {
            let started = std::time::Instant::now();
            match export.write_trace_file() {
                Ok(()) => {
                    written = kept;
                    pause = FILE_INTERVAL.max(started.elapsed() * FILE_WRITE_SHARE);
                }
                Err(err) => {
                    tracing::warn!(error = %err, "pdflow trace export: the trace file could not be written; not trying again");
                    return;
                }
            }
        }
    }
}

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

/// Installs this process's log lines and, if the environment asks for one, its trace exporter
/// (idempotent per process).
pub fn install_from_env() -> Result<(), ConfigError> {
    let cell = EXPORT.get_or_init(|| Mutex::new(None));
    let mut slot = cell.lock().unwrap_or_else(|p| p.into_inner());
    if slot.as_ref().is_some_and(|e| e.pid == std::process::id()) {
        return Ok(());
    }
    let pid = std::process::id();
    let mut s = settings(&|k| std::env::var(k).ok());
    s.trace_file = s.trace_file.map(|p| per_process_path(&p, pid));
    // A service name set by the user names every span; otherwise spans are named by the step's
    // side (pdflow-prefill, pdflow-decode, pdflow-bootstrap).
    let service = s.service_name.clone().filter(|n| !n.trim().is_empty());
    let config = ExportConfig::from_settings(&s, service.as_deref()).map_err(ConfigError::TraceSettings)?;
    let export =
        if config.is_off() { None } else { Some(TraceExport::start(&config).map_err(ConfigError::TraceExport)?) };
    let filter = match std::env::var(ENV_LOG) {
        Ok(text) => {
            EnvFilter::try_new(&text).map_err(|source| ConfigError::LogFilter { var: ENV_LOG, text, source })?
        }
        Err(_) => EnvFilter::new("warn"),
    };
    let log = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(false).with_filter(filter);
    let exporting = export.as_ref().and_then(TraceExport::layer);
    if tracing_subscriber::registry().with(log).with(exporting).try_init().is_err() {
        tracing::warn!(
            "a tracing subscriber is already installed in this process: pdflow's log lines and step spans go to it"
        );
    }
    let writes_file = export.as_ref().is_some_and(|e| e.trace_file().is_some());
    *slot = Some(ProcessExport { pid, export });
    drop(slot);
    if writes_file {
        std::thread::Builder::new()
            .name("pdflow-trace-file".into())
            .spawn(move || write_trace_file_while_running(pid))
            .map_err(ConfigError::TraceFileWriter)?;
    }
    Ok(())
}

/// Sends what is left and writes the trace file (bounded); called by the connector's shutdown.
pub fn flush() {
    let Some(cell) = EXPORT.get() else { return };
    let slot = cell.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(export) = slot.as_ref().filter(|e| e.pid == std::process::id()).and_then(|e| e.export.as_ref()) {
        if let Err(err) = export.finish(Duration::from_secs(5), keep_all) {
            tracing::warn!(error = %err, "pdflow trace export: flush failed");
        }
    }
}
