//! `pdflow trace render`: one request drawn as the seed draws it. This module builds the model —
//! which spans of a Jaeger JSON file make the timeline, the participant (lane) of each of the 43
//! steps, the TTFT decomposition — and [`html`] draws it as self-contained HTML/SVG.
//!
//! The start-up steps (1–7) and the request (8–43) usually lie far apart in time: they are drawn
//! in two panels, each at its own scale, each bar at its real time within its panel.

pub mod html;

use std::path::Path;

use pdflow_observability::export::jaeger::{JaegerFile, JaegerSpan};
use pdflow_observability::export::ExportError;
use pdflow_observability::steps::{self, Owner, Step};

/// The participants, top to bottom.
pub const LANES: [&str; 9] =
    ["client", "proxy", "P API", "P scheduler", "P worker", "bootstrap", "D API", "D scheduler", "D worker"];

/// The lane of a step, from the catalogue's "who" (the part before "→") and owner.
pub fn lane_of(step: &Step) -> usize {
    if step.owner == Owner::Bootstrap {
        return 5;
    }
    let who = step.who.split('→').next().unwrap_or("").trim();
    match who {
        "client" => 0,
        "proxy" => 1,
        "P" | "P API" => 2,
        "P scheduler" => 3,
        "D" | "D API" => 6,
        "D scheduler" => 7,
        w if w.starts_with("D") => 8,
        _ => 4,
    }
}

/// The TTFT decomposition of the seed: (label, first step, last step).
pub const TTFT_SEGMENTS: [(&str, u8, u8); 6] = [
    ("proxy", 8, 10),
    ("P prefill", 11, 15),
    ("P next step", 23, 27),
    ("transfer", 28, 30),
    ("D notice", 34, 37),
    ("D first forward", 38, 39),
];

/// Why a timeline could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error(transparent)]
    File(#[from] ExportError),
    #[error("no request trace in the file: no trace holds step 8 (step.08.client_request); was it written by `pdflow demo --trace-file` or a node with --trace-file?")]
    NoRequest,
    #[error("trace {0} is not in the file")]
    NoSuchTrace(String),
    #[error("cannot write {path}: {reason}")]
    Write { path: String, reason: String },
}

/// One bar: a span of one step.
#[derive(Debug, Clone)]
pub struct Bar {
    pub step: u8,
    pub name: String,
    pub lane: usize,
    pub service: String,
    /// Microseconds from its panel's origin.
    pub start_us: u64,
    pub duration_us: u64,
    /// `key=value` of the span's figures and ids.
    pub figures: Vec<(String, String)>,
}

/// One part of the TTFT.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    pub label: String,
    /// `11–15`, or empty for the time between named parts.
    pub steps: String,
    pub start_us: u64,
    pub end_us: u64,
}

/// The drawn request.
#[derive(Debug, Clone)]
pub struct Timeline {
    pub trace_id: String,
    pub startup: Vec<Bar>,
    pub request: Vec<Bar>,
    /// Microseconds between the last start-up step's end and the request's start.
    pub gap_us: u64,
    /// From step 8's start to step 39's end, if both were seen.
    pub ttft_us: Option<u64>,
    pub ttft: Vec<Segment>,
    /// Steps of 1–43 not found.
    pub missing: Vec<u8>,
}

fn step_of(span: &JaegerSpan) -> Option<u8> {
    span.tag(pdflow_observability::attrs::STEP)
        .and_then(|s| s.parse().ok())
        .or_else(|| steps::by_span_name(&span.operation_name).map(|s| s.number))
}

fn service_of(file_trace: &pdflow_observability::export::jaeger::JaegerTrace, span: &JaegerSpan) -> String {
    file_trace.processes.get(&span.process_id).map(|p| p.service_name.clone()).unwrap_or_default()
}

fn bar(trace: &pdflow_observability::export::jaeger::JaegerTrace, span: &JaegerSpan, step: &Step, origin: u64) -> Bar {
    Bar {
        step: step.number,
        name: span.operation_name.clone(),
        lane: lane_of(step),
        service: service_of(trace, span),
        start_us: span.start_time.saturating_sub(origin),
        duration_us: span.duration,
        figures: span
            .tags
            .iter()
            .filter(|t| t.key != pdflow_observability::attrs::STEP)
            .map(|t| {
                (
                    t.key.clone(),
                    match &t.value {
                        serde_json::Value::String(s) => s.clone(),
                        v => v.to_string(),
                    },
                )
            })
            .collect(),
    }
}

impl Timeline {
    /// Picks the request trace (`trace_id`, or the first holding step 8) and the start-up spans.
    pub fn from_file(file: &JaegerFile, trace_id: Option<&str>) -> Result<Self, RenderError> {
        let request = match trace_id {
            Some(id) => file
                .data
                .iter()
                .find(|t| t.trace_id.eq_ignore_ascii_case(id))
                .ok_or_else(|| RenderError::NoSuchTrace(id.to_owned()))?,
            None => file
                .data
                .iter()
                .find(|t| t.spans.iter().any(|s| step_of(s) == Some(steps::CLIENT_REQUEST.number)))
                .ok_or(RenderError::NoRequest)?,
        };
        let mut req_spans: Vec<(&JaegerSpan, &Step)> = request
            .spans
            .iter()
            .filter_map(|s| step_of(s).and_then(steps::by_number).filter(|st| st.number >= 8).map(|st| (s, st)))
            .collect();
        req_spans.sort_by_key(|(s, st)| (s.start_time, st.number));
        let origin = req_spans.iter().map(|(s, _)| s.start_time).min().unwrap_or(0);
        let request_bars: Vec<Bar> = req_spans.iter().map(|(s, st)| bar(request, s, st, origin)).collect();

        // Start-up: the first span of each step 1–7 that started before the request.
        let mut startup: Vec<(&pdflow_observability::export::jaeger::JaegerTrace, &JaegerSpan, &Step)> = Vec::new();
        for t in &file.data {
            for s in &t.spans {
                if let Some(st) = step_of(s).and_then(steps::by_number).filter(|st| st.number <= 7) {
                    if s.start_time <= origin || request_bars.is_empty() {
                        startup.push((t, s, st));
                    }
                }
            }
        }
        startup.sort_by_key(|(_, s, st)| (s.start_time, st.number));
        let mut seen = std::collections::BTreeSet::new();
        startup.retain(|(_, _, st)| seen.insert(st.number));
        let s_origin = startup.iter().map(|(_, s, _)| s.start_time).min().unwrap_or(origin);
        let s_end = startup.iter().map(|(_, s, _)| s.start_time + s.duration).max().unwrap_or(origin);
        let startup_bars: Vec<Bar> = startup.iter().map(|(t, s, st)| bar(t, s, st, s_origin)).collect();

        let present: std::collections::BTreeSet<u8> =
            startup_bars.iter().chain(&request_bars).map(|b| b.step).collect();
        let missing = steps::STEPS.iter().map(|s| s.number).filter(|n| !present.contains(n)).collect();
        let (ttft_us, ttft) = decompose(&request_bars);
        Ok(Self {
            trace_id: request.trace_id.clone(),
            startup: startup_bars,
            request: request_bars,
            gap_us: origin.saturating_sub(s_end),
            ttft_us,
            ttft,
            missing,
        })
    }
}

/// TTFT = step 8's start → step 39's end, cut into the seed's parts. A part runs from its first
/// step's start to its last step's end, cut at the next part's start (step 10's span lasts until
/// D answers, but the proxy's part ends when P has the request); time between parts (waits, work
/// off the critical path) is shown as "other".
pub fn decompose(bars: &[Bar]) -> (Option<u64>, Vec<Segment>) {
    let first = |n: u8| bars.iter().find(|b| b.step == n);
    let (Some(s8), Some(s39)) = (first(8), first(39)) else { return (None, Vec::new()) };
    let (t0, t1) = (s8.start_us, s39.start_us + s39.duration_us);
    let bounds: Vec<(&str, u8, u8, u64, u64)> = TTFT_SEGMENTS
        .iter()
        .filter_map(|&(label, a, b)| {
            let in_range: Vec<&Bar> = (a..=b).filter_map(first).collect();
            let start = in_range.iter().map(|b| b.start_us).min()?;
            let end = in_range.iter().map(|b| b.start_us + b.duration_us).max()?;
            Some((label, a, b, start, end))
        })
        .collect();
    let mut out = Vec::new();
    let mut cursor = t0;
    for (i, &(label, a, b, start, end)) in bounds.iter().enumerate() {
        let next_start = bounds.get(i + 1).map(|n| n.3).unwrap_or(t1);
        let (start, end) = (start.max(cursor), end.min(next_start).min(t1));
        if end <= start {
            continue;
        }
        if start > cursor {
            out.push(Segment { label: "other".into(), steps: String::new(), start_us: cursor, end_us: start });
        }
        out.push(Segment { label: label.into(), steps: format!("{a}–{b}"), start_us: start, end_us: end });
        cursor = end;
    }
    if t1 > cursor {
        out.push(Segment { label: "other".into(), steps: String::new(), start_us: cursor, end_us: t1 });
    }
    (Some(t1.saturating_sub(t0)), out)
}

/// Reads `trace`, draws the request, writes `out`; returns a one-line summary.
pub fn render_file(trace: &Path, out: &Path, trace_id: Option<&str>) -> Result<String, RenderError> {
    let file = JaegerFile::read(trace)?;
    let timeline = Timeline::from_file(&file, trace_id)?;
    let page = html::page(&timeline);
    std::fs::write(out, page)
        .map_err(|e| RenderError::Write { path: out.display().to_string(), reason: e.to_string() })?;
    let steps = timeline.startup.len() + timeline.request.len();
    let ttft = timeline.ttft_us.map(|t| format!("{:.3} ms", t as f64 / 1e3)).unwrap_or_else(|| "n/a".into());
    let missing =
        if timeline.missing.is_empty() { String::new() } else { format!("; missing steps {:?}", timeline.missing) };
    Ok(format!("trace {}: {steps} step spans, TTFT {ttft}{missing}", timeline.trace_id))
}

#[cfg(test)]
mod tests;
