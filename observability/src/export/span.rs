//! A finished step span as the exporters see it: ids, parent, service, wall-clock times and typed
//! attributes. Built by the export layer ([`super::layer`]) at the close of each step span.

use crate::trace_context::{SpanId, TraceId};

/// A typed attribute value (`pd.bytes` stays an integer in OTLP and in Jaeger's tags).
#[derive(Debug, Clone, PartialEq)]
pub enum AttrValue {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
}

impl AttrValue {
    /// The value as text (integers in decimal).
    pub fn as_text(&self) -> String {
        match self {
            Self::Int(i) => i.to_string(),
            Self::Float(f) => f.to_string(),
            Self::Bool(b) => b.to_string(),
            Self::Str(s) => s.clone(),
        }
    }

    /// The value as an integer, if it is one (or a string holding one).
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Self::Int(i) => Some(*i),
            Self::Str(s) => s.parse().ok(),
            _ => None,
        }
    }
}

/// One exported span.
#[derive(Debug, Clone, PartialEq)]
pub struct FinishedSpan {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    /// The parent span, `None` for a trace's root (step 8, or a start-up step).
    pub parent: Option<SpanId>,
    /// `step.NN.short_name`.
    pub name: String,
    /// The seed step number (1–43).
    pub step: u8,
    /// `service.name` of the node that emitted it (`pdflow-proxy`, `pdflow-prefill`, …).
    pub service: String,
    pub start_unix_nanos: u64,
    pub end_unix_nanos: u64,
    /// `pd.*` attributes in the order they were recorded.
    pub attrs: Vec<(String, AttrValue)>,
}

impl FinishedSpan {
    /// An attribute's value.
    pub fn attr(&self, key: &str) -> Option<&AttrValue> {
        self.attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}
