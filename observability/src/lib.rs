//! pdflow-observability — the seed's 43 steps as data, and the one way actors emit step spans.
//!
//! Every step of the seed's timeline is one `tracing` span named `step.NN.short_name`
//! (docs/steps.md), with attributes `pd.step`, `pd.request_id`, `pd.transfer_id`, `pd.engine_id` and
//! the step's figures. Actors never write span names themselves: they call [`step_span!`] with a
//! constant from [`steps`].
//!
//! # Layout
//! - [`steps`] — the catalogue: number, short name, owning actor, side, span name.
//! - [`attrs`] — attribute keys; [`outcome`] — the closed set of `pd.outcome` values.
//! - [`capture`] — an in-process `tracing` layer that records step spans (the demo's timeline).
//! - [`trace_context`] — W3C `traceparent` parsing and OpenTelemetry ids.
//! - [`export`] — exporters chosen at run time: OTLP (gRPC, HTTP/protobuf), a Jaeger JSON file.
//! - [`metrics`] — `/metrics`: step spans as Prometheus histograms, counters and gauges.

pub mod attrs;
pub mod capture;
pub mod export;
pub mod metrics;
pub mod outcome;
pub mod steps;
pub mod trace_context;

pub use outcome::Outcome;
pub use steps::{Step, STEPS};

/// The `tracing` target of every step span.
pub const STEP_TARGET: &str = "pdflow::step";

/// Opens the span of one step: `step_span!(steps::P_TRANSFER_WRITE, request_id = %id)`.
///
/// Every figure attribute is declared (empty) so that it can be recorded later with
/// `span.record(attrs::BYTES, n)`. Extra `key = value` pairs are not accepted: record figures.
#[macro_export]
macro_rules! step_span {
    ($step:expr) => {
        $crate::step_span!(@span $step, [tracing::field::Empty], [tracing::field::Empty])
    };
    ($step:expr, request_id = %$rid:expr, transfer_id = %$tid:expr) => {
        $crate::step_span!(@span $step, [%$rid], [%$tid])
    };
    ($step:expr, request_id = %$rid:expr) => {
        $crate::step_span!(@span $step, [%$rid], [tracing::field::Empty])
    };
    ($step:expr, request_id = $rid:expr, transfer_id = $tid:expr) => {
        $crate::step_span!(@span $step, [$rid], [$tid])
    };
    ($step:expr, request_id = $rid:expr) => {
        $crate::step_span!(@span $step, [$rid], [tracing::field::Empty])
    };
    (@span $step:expr, [$($rid:tt)*], [$($tid:tt)*]) => {
        tracing::info_span!(
            target: "pdflow::step",
            $step.span_name,
            pd.step = $step.number,
            pd.request_id = $($rid)*,
            pd.transfer_id = $($tid)*,
            pd.engine_id = tracing::field::Empty,
            pd.blocks = tracing::field::Empty,
            pd.bytes = tracing::field::Empty,
            pd.descriptors = tracing::field::Empty,
            pd.tokens = tracing::field::Empty,
            pd.outcome = tracing::field::Empty,
            pd.traceparent = tracing::field::Empty,
            pd.kv_checksum = tracing::field::Empty,
            pd.backend = tracing::field::Empty,
            pd.provider = tracing::field::Empty,
            pd.client_parent = tracing::field::Empty,
            pd.tp_rank = tracing::field::Empty,
            pd.pp_rank = tracing::field::Empty,
            pd.remote_tp_rank = tracing::field::Empty,
            pd.remote_pp_rank = tracing::field::Empty,
            pd.group_blocks = tracing::field::Empty,
            pd.group_bytes = tracing::field::Empty,
            pd.route = tracing::field::Empty,
        )
    };
}
