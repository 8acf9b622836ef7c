//! In-process capture of step spans: a `tracing` layer that keeps each step span's start, end and
//! attributes, so `pdflow demo` can print the timeline without an exporter.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::Subscriber;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use crate::STEP_TARGET;

/// One finished (or still open) step span.
#[derive(Debug, Clone)]
pub struct CapturedSpan {
    pub name: &'static str,
    pub step: u8,
    pub start: Instant,
    pub end: Option<Instant>,
    /// Attributes recorded on the span, as text.
    pub attrs: BTreeMap<&'static str, String>,
}

impl CapturedSpan {
    /// An attribute's value, if recorded.
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attrs.get(key).map(String::as_str)
    }
}

#[derive(Default)]
struct Store {
    open: BTreeMap<u64, CapturedSpan>,
    closed: Vec<CapturedSpan>,
}

/// The capture: clone it freely; the layer and every reader share one store.
#[derive(Clone, Default)]
pub struct SpanCapture {
    store: Arc<Mutex<Store>>,
}

impl SpanCapture {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every step span seen so far, closed ones first then open ones, each in start order.
    pub fn spans(&self) -> Vec<CapturedSpan> {
        let store = self.store.lock().unwrap_or_else(|p| p.into_inner());
        let mut all: Vec<CapturedSpan> = store.closed.iter().cloned().chain(store.open.values().cloned()).collect();
        all.sort_by_key(|s| s.start);
        all
    }

    /// Forgets everything captured.
    pub fn clear(&self) {
        let mut store = self.store.lock().unwrap_or_else(|p| p.into_inner());
        store.closed.clear();
    }

    fn with_store<R>(&self, f: impl FnOnce(&mut Store) -> R) -> R {
        let mut store = self.store.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut store)
    }
}

struct Visitor<'a>(&'a mut BTreeMap<&'static str, String>);

impl Visit for Visitor<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name(), value.to_owned());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name(), value.to_string());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name(), value.to_string());
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for SpanCapture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _ctx: Context<'_, S>) {
        let meta = attrs.metadata();
        if meta.target() != STEP_TARGET {
            return;
        }
        let mut fields = BTreeMap::new();
        attrs.record(&mut Visitor(&mut fields));
        let step = fields.get(crate::attrs::STEP).and_then(|s| s.parse().ok()).unwrap_or(0);
        let span = CapturedSpan { name: meta.name(), step, start: Instant::now(), end: None, attrs: fields };
        self.with_store(|s| s.open.insert(id.into_u64(), span));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _ctx: Context<'_, S>) {
        self.with_store(|s| {
            if let Some(span) = s.open.get_mut(&id.into_u64()) {
                values.record(&mut Visitor(&mut span.attrs));
            }
        });
    }

    fn on_close(&self, id: Id, _ctx: Context<'_, S>) {
        let now = Instant::now();
        self.with_store(|s| {
            if let Some(mut span) = s.open.remove(&id.into_u64()) {
                span.end = Some(now);
                s.closed.push(span);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::steps;
    use tracing_subscriber::layer::SubscriberExt;

    #[test]
    fn captures_step_spans_with_their_figures() {
        let capture = SpanCapture::new();
        let subscriber = tracing_subscriber::registry().with(capture.clone());
        tracing::subscriber::with_default(subscriber, || {
            let span = crate::step_span!(steps::P_TRANSFER_WRITE, request_id = "r1", transfer_id = "xfer-1");
            span.record(crate::attrs::BYTES, 148_635_648u64);
            drop(span);
            tracing::info_span!("not a step").in_scope(|| {});
        });
        let spans = capture.spans();
        assert_eq!(spans.len(), 1);
        assert_eq!(spans[0].name, "step.29.p_transfer_write");
        assert_eq!(spans[0].step, 29);
        assert_eq!(spans[0].attr(crate::attrs::BYTES), Some("148635648"));
        assert_eq!(spans[0].attr(crate::attrs::REQUEST_ID), Some("r1"));
        assert!(spans[0].end.is_some());
    }
}
