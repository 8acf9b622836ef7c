//! The `tracing` layer that turns step spans into metrics: it keeps each step span's start and
//! figures in the span's extensions (no shared lock while the span is open) and hands them to the
//! registry when the span closes.

use std::sync::Arc;
use std::time::Instant;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::Subscriber;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use super::{global, Metrics, StepObservation};
use crate::{attrs, STEP_TARGET};

/// Observes every step span into a [`Metrics`] registry (by default the process's [`global`]).
#[derive(Clone)]
pub struct MetricsLayer {
    metrics: Arc<Metrics>,
}

impl MetricsLayer {
    /// A layer feeding the process's registry, the one `/metrics` renders.
    pub fn global() -> Self {
        Self { metrics: global().clone() }
    }

    /// A layer feeding `metrics` (tests).
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self { metrics }
    }
}

/// Per-span state, kept in the span's extensions.
struct Open(StepObservation);

struct Visitor<'a>(&'a mut StepObservation);

impl Visitor<'_> {
    fn number(&mut self, field: &Field, value: u64) {
        match field.name() {
            attrs::STEP => self.0.step = u8::try_from(value).unwrap_or(0),
            attrs::BYTES => self.0.bytes = Some(value),
            attrs::DESCRIPTORS => self.0.descriptors = Some(value),
            attrs::BLOCKS => self.0.blocks = Some(value),
            _ => {}
        }
    }
    fn text(&mut self, field: &Field, value: String) {
        match field.name() {
            attrs::TRANSFER_ID => self.0.transfer_id = Some(value),
            attrs::OUTCOME => self.0.outcome = Some(value),
            attrs::BACKEND => self.0.backend = Some(value),
            attrs::GROUP_BYTES => self.0.group_bytes = Some(value),
            _ => {}
        }
    }
}

impl Visit for Visitor<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if matches!(field.name(), attrs::TRANSFER_ID | attrs::OUTCOME | attrs::BACKEND | attrs::GROUP_BYTES) {
            self.text(field, format!("{value:?}"));
        } else if matches!(field.name(), attrs::STEP | attrs::BYTES | attrs::DESCRIPTORS | attrs::BLOCKS) {
            if let Ok(n) = format!("{value:?}").parse() {
                self.number(field, n);
            }
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.text(field, value.to_owned());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.number(field, value);
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        if let Ok(v) = u64::try_from(value) {
            self.number(field, v);
        }
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for MetricsLayer {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if attrs.metadata().target() != STEP_TARGET {
            return;
        }
        let now = Instant::now();
        let mut o = StepObservation { start: Some(now), ..StepObservation::default() };
        attrs.record(&mut Visitor(&mut o));
        self.metrics.on_step_start(o.step, o.transfer_id.as_deref(), now);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(Open(o));
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut ext = span.extensions_mut();
        if let Some(Open(o)) = ext.get_mut::<Open>() {
            values.record(&mut Visitor(o));
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        let Some(Open(mut o)) = span.extensions_mut().remove::<Open>() else { return };
        o.duration = o.start.map(|s| s.elapsed()).unwrap_or_default();
        self.metrics.observe(&o);
    }
}
