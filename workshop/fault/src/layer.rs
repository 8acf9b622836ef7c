//! The `tracing` layer that turns step-span edges into faults: on a step span's creation (the step
//! begins) and on its close (the step ends) it asks its domain's armed plan for the faults of that
//! edge. Installed by a tool only with a domain; without an armed plan it returns at once.

use std::sync::Arc;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::Subscriber;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use super::plan::When;
use super::FaultDomain;
use pdflow_observability::{attrs, STEP_TARGET};

/// The fault layer of one [`FaultDomain`] ([`FaultDomain::layer`]).
#[derive(Clone)]
pub struct FaultLayer {
    pub(crate) domain: Arc<FaultDomain>,
}

/// What the layer keeps on a step span to fire its end faults.
#[derive(Debug, Default)]
struct StepEdge {
    step: u8,
    request_id: String,
    transfer_id: String,
}

impl Visit for StepEdge {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            attrs::REQUEST_ID => self.request_id = format!("{value:?}"),
            attrs::TRANSFER_ID => self.transfer_id = format!("{value:?}"),
            _ => {}
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            attrs::REQUEST_ID => self.request_id = value.to_owned(),
            attrs::TRANSFER_ID => self.transfer_id = value.to_owned(),
            _ => {}
        }
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == attrs::STEP {
            self.step = u8::try_from(value).unwrap_or(0);
        }
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        if field.name() == attrs::STEP {
            self.step = u8::try_from(value).unwrap_or(0);
        }
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for FaultLayer {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if attrs.metadata().target() != STEP_TARGET {
            return;
        }
        let Some(injector) = self.domain.active() else { return };
        let mut edge = StepEdge::default();
        attrs.record(&mut edge);
        injector.on_step(&self.domain.registry, edge.step, When::Begin, &edge.request_id, &edge.transfer_id);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(edge);
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        let Some(edge) = span.extensions_mut().remove::<StepEdge>() else { return };
        drop(span);
        if let Some(injector) = self.domain.active() {
            injector.on_step(&self.domain.registry, edge.step, When::End, &edge.request_id, &edge.transfer_id);
        }
    }
}
