//! The export layer: a `tracing` layer that turns each closed step span into a [`FinishedSpan`]
//! with OpenTelemetry ids and hands it to the exporters.
//!
//! Trace membership (seed steps 8–43 form one trace per request, 1–7 one start-up trace per node):
//! 1. a span that carries `pd.traceparent` joins that trace; its parent is the span the
//!    traceparent names — which is the proxy's step 8: step 8 takes the traceparent's span id as
//!    its own and is the trace's root, so every parent resolves;
//! 2. a step span without one borrows the context last seen (in this process) for its
//!    `pd.transfer_id`, else its `pd.request_id` (bounded memory);
//! 3. start-up steps (1–7) without a context share one start-up trace per service;
//! 4. a nearest enclosing step span of the same trace becomes the parent (deeper trees);
//! 5. anything else gets a trace of its own per request id.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::Subscriber;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use super::span::{AttrValue, FinishedSpan};
use super::ServiceNaming;
use crate::trace_context::{SpanId, TraceId, TraceParent};
use crate::{attrs, steps, STEP_TARGET};

/// Where finished spans go (the OTLP batcher, the Jaeger file's memory).
pub trait SpanSink: Send + Sync + 'static {
    fn export(&self, span: &FinishedSpan);
}

/// How many transfer/request ids the layer remembers a trace context for.
const REMEMBERED_IDS: usize = 4096;

/// A map that forgets its oldest entries beyond a bound.
struct BoundedMap<K, V> {
    map: HashMap<K, V>,
    order: VecDeque<K>,
}

impl<K: Hash + Eq + Clone, V> BoundedMap<K, V> {
    fn new() -> Self {
        Self { map: HashMap::new(), order: VecDeque::new() }
    }
    fn insert(&mut self, k: K, v: V) {
        if self.map.insert(k.clone(), v).is_none() {
            self.order.push_back(k);
            while self.order.len() > REMEMBERED_IDS {
                if let Some(old) = self.order.pop_front() {
                    self.map.remove(&old);
                }
            }
        }
    }
    fn get(&self, k: &K) -> Option<&V> {
        self.map.get(k)
    }
}

struct Resolver {
    startup: HashMap<String, TraceId>,
    by_transfer: BoundedMap<String, TraceParent>,
    by_request: BoundedMap<String, TraceParent>,
    orphans: BoundedMap<String, TraceId>,
}

impl Resolver {
    fn learn(&mut self, state: &StepState, tp: TraceParent) {
        if let Some(t) = state.text(attrs::TRANSFER_ID) {
            if self.by_transfer.get(&t).is_none() {
                self.by_transfer.insert(t, tp);
            }
        }
        if let Some(r) = state.text(attrs::REQUEST_ID) {
            if self.by_request.get(&r).is_none() {
                self.by_request.insert(r, tp);
            }
        }
    }
    fn lookup(&self, state: &StepState) -> Option<TraceParent> {
        let by_transfer = state.text(attrs::TRANSFER_ID).and_then(|t| self.by_transfer.get(&t).copied());
        by_transfer.or_else(|| state.text(attrs::REQUEST_ID).and_then(|r| self.by_request.get(&r).copied()))
    }
}

/// Per-span state, kept in the registry's extensions while the span is open.
struct StepState {
    step: u8,
    name: &'static str,
    start: SystemTime,
    span_id: SpanId,
    /// The trace this span belongs to, once known (from its own traceparent or start-up).
    trace: Option<TraceId>,
    own: Option<TraceParent>,
    fields: Vec<(&'static str, AttrValue)>,
}

impl StepState {
    fn text(&self, key: &str) -> Option<String> {
        self.fields.iter().find(|(k, _)| *k == key).map(|(_, v)| v.as_text()).filter(|s| !s.is_empty())
    }
    fn set(&mut self, key: &'static str, value: AttrValue) {
        match self.fields.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => self.fields.push((key, value)),
        }
    }
    /// Applies a recorded traceparent: step 8 (the request's root) takes its span id.
    fn adopt_traceparent(&mut self) -> Option<TraceParent> {
        let tp = self.text(attrs::TRACEPARENT).and_then(|s| TraceParent::parse(&s))?;
        if self.own.is_none() {
            self.own = Some(tp);
            self.trace = Some(tp.trace_id);
            if self.step == steps::CLIENT_REQUEST.number {
                self.span_id = tp.span_id;
            }
        }
        Some(tp)
    }
}

struct FieldVisitor<'a>(&'a mut StepState);

impl Visit for FieldVisitor<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.set(field.name(), AttrValue::Str(format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.set(field.name(), AttrValue::Str(value.to_owned()));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.set(field.name(), AttrValue::Int(i64::try_from(value).unwrap_or(i64::MAX)));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.set(field.name(), AttrValue::Int(value));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.set(field.name(), AttrValue::Bool(value));
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.set(field.name(), AttrValue::Float(value));
    }
}

/// The layer; install it with `tracing_subscriber::registry().with(layer)`.
#[derive(Clone)]
pub struct ExportLayer {
    naming: ServiceNaming,
    sinks: Arc<[Arc<dyn SpanSink>]>,
    resolver: Arc<Mutex<Resolver>>,
}

impl ExportLayer {
    /// A layer that hands every finished step span to each sink.
    pub fn new(naming: ServiceNaming, sinks: Vec<Arc<dyn SpanSink>>) -> Self {
        let resolver = Resolver {
            startup: HashMap::new(),
            by_transfer: BoundedMap::new(),
            by_request: BoundedMap::new(),
            orphans: BoundedMap::new(),
        };
        Self { naming, sinks: sinks.into(), resolver: Arc::new(Mutex::new(resolver)) }
    }

    /// One trace per request id for request spans that carry no context at all.
    fn orphan_trace(&self, request_id: Option<String>) -> TraceId {
        let Some(key) = request_id else { return TraceId::random() };
        let mut resolver = self.resolver();
        if let Some(t) = resolver.orphans.get(&key) {
            return *t;
        }
        let t = TraceId::random();
        resolver.orphans.insert(key, t);
        t
    }

    fn resolver(&self) -> std::sync::MutexGuard<'_, Resolver> {
        self.resolver.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn is_startup(step: u8) -> bool {
    (1..=steps::PROXY_QUERY.number).contains(&step)
}

fn unix_nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)).unwrap_or(0)
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for ExportLayer {
    fn on_new_span(&self, attributes: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let meta = attributes.metadata();
        if meta.target() != STEP_TARGET {
            return;
        }
        let Some(span) = ctx.span(id) else { return };
        let mut state = StepState {
            step: 0,
            name: meta.name(),
            start: SystemTime::now(),
            span_id: SpanId::random(),
            trace: None,
            own: None,
            fields: Vec::new(),
        };
        attributes.record(&mut FieldVisitor(&mut state));
        state.step = state
            .fields
            .iter()
            .find(|(k, _)| *k == attrs::STEP)
            .and_then(|(_, v)| v.as_i64())
            .and_then(|n| u8::try_from(n).ok())
            .unwrap_or(0);
        let mut resolver = self.resolver();
        if let Some(tp) = state.adopt_traceparent() {
            resolver.learn(&state, tp);
        } else if is_startup(state.step) {
            let service = self.naming.service_for(state.step);
            state.trace = Some(*resolver.startup.entry(service).or_insert_with(TraceId::random));
        }
        drop(resolver);
        span.extensions_mut().insert(state);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let recorded_traceparent =
            span.metadata().fields().field(attrs::TRACEPARENT).is_some_and(|f| values.contains(&f));
        let mut ext = span.extensions_mut();
        let Some(state) = ext.get_mut::<StepState>() else { return };
        values.record(&mut FieldVisitor(state));
        if recorded_traceparent {
            if let Some(tp) = state.adopt_traceparent() {
                self.resolver().learn(state, tp);
            }
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let end = SystemTime::now();
        let Some(span) = ctx.span(&id) else { return };
        let Some(state) = span.extensions_mut().remove::<StepState>() else { return };
        let service = self.naming.service_for(state.step);
        // The nearest enclosing step span: (its trace if known, its span id).
        let ancestor =
            span.scope().skip(1).find_map(|a| a.extensions().get::<StepState>().map(|s| (s.trace, s.span_id)));
        let enclosing_in = |trace: TraceId| ancestor.and_then(|(t, sid)| (t == Some(trace)).then_some(sid));
        let context = match state.own {
            Some(tp) => Some(tp),
            None => self.resolver().lookup(&state),
        };
        let (trace_id, parent) = match (context, state.trace) {
            // Step 8 with its traceparent is the request's root: P's and D's spans name it.
            // Its parent is the client's span when the client sent a traceparent.
            (Some(tp), _) if state.step == steps::CLIENT_REQUEST.number && state.own.is_some() => {
                let client = state.text(attrs::CLIENT_PARENT).and_then(|s| SpanId::parse_hex(&s));
                (tp.trace_id, client)
            }
            (Some(tp), _) => (tp.trace_id, enclosing_in(tp.trace_id).or(Some(tp.span_id))),
            (None, Some(startup)) => (startup, enclosing_in(startup)),
            (None, None) => match ancestor {
                Some((Some(trace), sid)) => (trace, Some(sid)),
                _ => (self.orphan_trace(state.text(attrs::REQUEST_ID)), None),
            },
        };
        let finished = FinishedSpan {
            trace_id,
            span_id: state.span_id,
            parent,
            name: state.name.to_owned(),
            step: state.step,
            service,
            start_unix_nanos: unix_nanos(state.start),
            end_unix_nanos: unix_nanos(end),
            attrs: state
                .fields
                .into_iter()
                .filter(|(k, _)| *k != attrs::TRACEPARENT)
                .map(|(k, v)| (k.to_owned(), v))
                .collect(),
        };
        for sink in self.sinks.iter() {
            sink.export(&finished);
        }
    }
}
