//! The Jaeger JSON trace file (`--trace-file PATH`): the format Jaeger UI's "JSON File" upload
//! reads (`{"data":[{traceID, spans, processes}]}`), one process entry per service per trace.
//! Also read back by `pdflow trace render`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::layer::SpanSink;
use super::span::{AttrValue, FinishedSpan};
use super::ExportError;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JaegerFile {
    pub data: Vec<JaegerTrace>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JaegerTrace {
    #[serde(rename = "traceID")]
    pub trace_id: String,
    pub spans: Vec<JaegerSpan>,
    /// `p1`, `p2`, … → the service.
    pub processes: BTreeMap<String, JaegerProcess>,
    #[serde(default)]
    pub warnings: Option<Vec<String>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JaegerSpan {
    #[serde(rename = "traceID")]
    pub trace_id: String,
    #[serde(rename = "spanID")]
    pub span_id: String,
    #[serde(default)]
    pub flags: u32,
    #[serde(rename = "operationName")]
    pub operation_name: String,
    #[serde(default)]
    pub references: Vec<JaegerReference>,
    /// Microseconds since the Unix epoch.
    #[serde(rename = "startTime")]
    pub start_time: u64,
    /// Microseconds.
    pub duration: u64,
    #[serde(default)]
    pub tags: Vec<JaegerTag>,
    #[serde(default)]
    pub logs: Vec<serde_json::Value>,
    #[serde(rename = "processID")]
    pub process_id: String,
    #[serde(default)]
    pub warnings: Option<Vec<String>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JaegerReference {
    #[serde(rename = "refType")]
    pub ref_type: String,
    #[serde(rename = "traceID")]
    pub trace_id: String,
    #[serde(rename = "spanID")]
    pub span_id: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JaegerTag {
    pub key: String,
    /// `string`, `int64`, `float64` or `bool`.
    #[serde(rename = "type")]
    pub kind: String,
    pub value: serde_json::Value,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JaegerProcess {
    #[serde(rename = "serviceName")]
    pub service_name: String,
    #[serde(default)]
    pub tags: Vec<JaegerTag>,
}

impl JaegerSpan {
    /// A tag's value as text.
    pub fn tag(&self, key: &str) -> Option<String> {
        self.tags.iter().find(|t| t.key == key).map(|t| match &t.value {
            serde_json::Value::String(s) => s.clone(),
            v => v.to_string(),
        })
    }

    /// The CHILD_OF parent, if any.
    pub fn parent(&self) -> Option<&str> {
        self.references.iter().find(|r| r.ref_type == "CHILD_OF").map(|r| r.span_id.as_str())
    }
}

fn tag(key: &str, value: &AttrValue) -> JaegerTag {
    let (kind, value) = match value {
        AttrValue::Int(i) => ("int64", serde_json::Value::from(*i)),
        AttrValue::Float(f) => ("float64", serde_json::Value::from(*f)),
        AttrValue::Bool(b) => ("bool", serde_json::Value::from(*b)),
        AttrValue::Str(s) => ("string", serde_json::Value::from(s.as_str())),
    };
    JaegerTag { key: key.to_owned(), kind: kind.to_owned(), value }
}

impl JaegerFile {
    /// Groups spans into traces (in order of each trace's first start), spans by start time.
    pub fn from_spans(spans: &[FinishedSpan]) -> Self {
        let mut traces: BTreeMap<String, Vec<&FinishedSpan>> = BTreeMap::new();
        for s in spans {
            traces.entry(s.trace_id.to_hex()).or_default().push(s);
        }
        let mut data: Vec<JaegerTrace> = traces
            .into_iter()
            .map(|(trace_id, mut spans)| {
                spans.sort_by_key(|s| (s.start_unix_nanos, s.step));
                let mut processes: BTreeMap<String, JaegerProcess> = BTreeMap::new();
                let mut process_of: BTreeMap<&str, String> = BTreeMap::new();
                for s in &spans {
                    if !process_of.contains_key(s.service.as_str()) {
                        let id = format!("p{}", process_of.len() + 1);
                        processes
                            .insert(id.clone(), JaegerProcess { service_name: s.service.clone(), tags: Vec::new() });
                        process_of.insert(s.service.as_str(), id);
                    }
                }
                let spans = spans
                    .iter()
                    .map(|s| JaegerSpan {
                        trace_id: trace_id.clone(),
                        span_id: s.span_id.to_hex(),
                        flags: 1,
                        operation_name: s.name.clone(),
                        references: s
                            .parent
                            .map(|p| {
                                vec![JaegerReference {
                                    ref_type: "CHILD_OF".into(),
                                    trace_id: trace_id.clone(),
                                    span_id: p.to_hex(),
                                }]
                            })
                            .unwrap_or_default(),
                        start_time: s.start_unix_nanos / 1_000,
                        duration: s.end_unix_nanos.saturating_sub(s.start_unix_nanos) / 1_000,
                        tags: s.attrs.iter().map(|(k, v)| tag(k, v)).collect(),
                        logs: Vec::new(),
                        process_id: process_of.get(s.service.as_str()).cloned().unwrap_or_default(),
                        warnings: None,
                    })
                    .collect();
                JaegerTrace { trace_id, spans, processes, warnings: None }
            })
            .collect();
        data.sort_by_key(|t| t.spans.first().map(|s| s.start_time).unwrap_or(0));
        Self { data }
    }

    /// Writes the file (pretty JSON).
    /// Writes the file whole: to a temporary file beside it, then renamed over it, so a reader
    /// (or a process killed mid-write) never sees half a file.
    pub fn write(&self, path: &Path) -> Result<(), ExportError> {
        let failed = |reason: String| ExportError::TraceFile { path: path.to_owned(), reason };
        let json = serde_json::to_vec_pretty(self).map_err(|e| failed(e.to_string()))?;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".{}.tmp", std::process::id()));
        let tmp = std::path::PathBuf::from(tmp);
        std::fs::write(&tmp, json).map_err(|e| failed(e.to_string()))?;
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            failed(e.to_string())
        })
    }

    /// Reads a file written by [`JaegerFile::write`] or downloaded from Jaeger UI.
    pub fn read(path: &Path) -> Result<Self, ExportError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ExportError::TraceFile { path: path.to_owned(), reason: e.to_string() })?;
        serde_json::from_str(&text).map_err(|e| ExportError::TraceFile {
            path: path.to_owned(),
            reason: format!("not a Jaeger JSON trace file: {e}"),
        })
    }
}

/// Most spans kept in memory for the trace file; later ones are dropped (and counted).
pub const MEMORY_CAPACITY: usize = 500_000;

/// Keeps finished spans in memory until the trace file is written.
#[derive(Default)]
pub struct MemorySink {
    spans: Mutex<Vec<FinishedSpan>>,
    dropped: std::sync::atomic::AtomicU64,
}

impl MemorySink {
    /// Every span kept so far.
    pub fn spans(&self) -> Vec<FinishedSpan> {
        self.spans.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How many spans are kept.
    pub fn len(&self) -> usize {
        self.spans.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether no span is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Spans not kept because [`MEMORY_CAPACITY`] was reached.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl SpanSink for MemorySink {
    fn export(&self, span: &FinishedSpan) {
        let mut spans = self.spans.lock().unwrap_or_else(|p| p.into_inner());
        if spans.len() < MEMORY_CAPACITY {
            spans.push(span.clone());
        } else {
            self.dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}
