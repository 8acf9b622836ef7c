//! One client request through the proxy: fan-out to P and D, streaming D's answer back.
//!
//! Seed steps: 8 (`POST /v1/completions` or `/v1/chat/completions` arrives; request_id and
//! transfer_id made; P and D chosen by asking the Proxy actor for a `Route`), 9 (P's request:
//! `max_tokens` 1, not streamed, `do_remote_decode`), 10 (D's request, sent at the same time:
//! `do_remote_prefill`, P's bootstrap address and engine id), 25 (P's status checked, its body
//! discarded) and 43 (D's status, content type and bytes streamed back chunk by chunk; 42 is D's).
//!
//! This runs in the HTTP handler's task, never in the actor's mailbox. A body either engine would
//! refuse is refused at step 8, with a 400 naming the field, before P sees it: P's copy is
//! rewritten, so a value only D refuses (`max_tokens: -1`, `stream: "yes"`) would otherwise leave
//! P holding the prompt's blocks for a pull that never comes. A D that refuses anyway (a 4xx: a
//! limit of D's the proxy cannot see) or cannot be reached cancels P's request at once; a P that
//! finished first frees its blocks when D's connector reports the refusal (an empty pull). Unlike
//! vLLM's example proxy, a failed prefill (connection error, deadline, non-2xx) cancels D's request and answers
//! the client at once; a client that goes away cancels both upstream calls (P runs in a task
//! behind an abort-on-drop guard, D's response lives in the response body stream); every
//! upstream call has a deadline. Upstream errors are JSON `{"error": {"message", "type", "code"}}`
//! with a non-200 status.
//!
//! # Layout
//! - this file — the routes and the stages of one request's flow (steps 8, 9, 10, 43);
//! - [`ids`] — the request_id and the trace context (step 8);
//! - [`prompt_key`] — the prompt's chunk hashes the routing policies match (step 8);
//! - [`route_done`] — the routed work given back to the policies' load when the request ends;
//! - [`upstream`] — P's and D's bodies and headers, P's call, upstream errors (steps 9, 10, 25);
//! - [`relay`] — D's answer on its way to the client, P's task watched meanwhile (step 43);
//! - [`validate`] — the client's fields checked before P and D see them (step 8).

mod ids;
pub mod prompt_key;
mod relay;
mod route_done;
mod upstream;
mod validate;

pub use ids::flow_request_id;
pub use prompt_key::prompt_key;
pub use upstream::{decode_body, error_response, prefill_body, UpstreamError};
pub use validate::{validate, InvalidField};

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::stream::StreamExt;
use kameo::prelude::*;
use pdflow_messages::proxy::{Choice, NotReady, Pool, PromptKey, ProxyStatus, ReleasePrefill, Route, RouteDecision};
use pdflow_messages::{RequestId, TransferId};
use pdflow_observability::{attrs, step_span, steps};
use route_done::{PrefillDoneGuard, RouteDoneGuard};
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument;

use super::Proxy;
use ids::traceparent;
use pdflow_observability::Outcome;
use relay::Relay;
use upstream::{call_prefill, report_prefill_failure, upstream_headers, wait_prefill, PrefillHandle};

/// Largest client body the proxy accepts: the engines' own limit (axum's default, 2 MiB, which the
/// simulated engine's API keeps), so that a body the engines would refuse is refused here, with a
/// 413 that names the limit, instead of failing upstream as an unreachable engine.
pub const MAX_BODY_BYTES: usize = 2 * 1024 * 1024;
/// How long a handler waits for the Proxy actor's answer.
const ASK_DEADLINE: Duration = Duration::from_secs(5);
/// D's non-streamed answers up to this length are relayed whole (longer ones chunk by chunk).
const MAX_WHOLE_BODY: u64 = 1 << 20;
/// How many other P a request is retried on when its P fails before D answered.
const MAX_PREFILL_RETRIES: usize = 1;
/// How often a flow asks a restarted Proxy actor again for a route.
const RESTART_POLL: Duration = Duration::from_millis(10);

/// What every request's flow shares: the actor, one pooled HTTP client, the upstream deadline.
pub struct FlowContext {
    pub proxy: ActorRef<Proxy>,
    pub client: reqwest::Client,
    pub upstream_timeout: Duration,
    /// The proxy was ready before (it routed a request or said so on `/health`): a later "not
    /// ready yet" is a restarted actor re-discovering its pools (one health round), which a flow
    /// waits out rather than fails.
    pub was_ready: std::sync::atomic::AtomicBool,
}

/// The completion API's path.
const COMPLETIONS_API: &str = "/v1/completions";
/// The chat completion API's path.
const CHAT_API: &str = "/v1/chat/completions";

/// The proxy's routes: `/v1/completions`, `/v1/chat/completions`, `/health`, `/metrics`.
pub fn router(ctx: Arc<FlowContext>) -> Router {
    Router::new()
        .route(COMPLETIONS_API, post(completions))
        .route(CHAT_API, post(chat_completions))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(ctx)
}

/// `/metrics`: the process's step metrics (Prometheus text).
async fn metrics() -> Response {
    use pdflow_observability::metrics as m;
    ([(header::CONTENT_TYPE, m::CONTENT_TYPE)], m::global().render()).into_response()
}

async fn health(State(ctx): State<Arc<FlowContext>>) -> Response {
    let Some(proxy) = Some(ctx.proxy.clone()).filter(|p| p.is_alive()) else {
        return error_response(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", "proxy is stopping".into());
    };
    match tokio::time::timeout(ASK_DEADLINE, proxy.ask(ProxyStatus)).await {
        Ok(Ok(r)) if r.ready => {
            ctx.was_ready.store(true, std::sync::atomic::Ordering::Release);
            Json(serde_json::json!({"status": "ok"})).into_response()
        }
        Ok(Ok(r)) => error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            format!("proxy not ready, waiting for: {}", r.waiting_for.join(", ")),
        ),
        _ => error_response(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", "proxy did not answer".into()),
    }
}

async fn completions(
    State(ctx): State<Arc<FlowContext>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(ctx, COMPLETIONS_API, headers, body).await
}

async fn chat_completions(
    State(ctx): State<Arc<FlowContext>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(ctx, CHAT_API, headers, body).await
}

/// A client body that could not be read: over [`MAX_BODY_BYTES`] (a 413 naming the limit), or
/// cut off or malformed on the wire (axum's status and reason).
fn body_refused(rejected: BytesRejection) -> Response {
    let status = rejected.status();
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        let message = format!(
            "request body is larger than the proxy's limit of {MAX_BODY_BYTES} bytes (2 MiB, the engines' limit too); send a shorter prompt"
        );
        return error_response(status, "invalid_request_error", message);
    }
    error_response(status, "invalid_request_error", format!("request body could not be read: {}", rejected.body_text()))
}

/// Asks the Proxy actor for a route within [`ASK_DEADLINE`]. If it stopped while holding the ask,
/// or routed requests before and now answers "not ready yet", it is being restarted (a kill, a
/// panic) and re-discovering P's engine ids and the pools' health: asked again until it is ready
/// or the deadline passes, so that clients of the restart window are served instead of refused.
async fn route(
    ctx: &FlowContext,
    proxy: &ActorRef<Proxy>,
    prompt: &PromptKey,
    exclude_prefill: &[usize],
) -> Result<Result<RouteDecision, SendError<Route, NotReady>>, tokio::time::error::Elapsed> {
    use std::sync::atomic::Ordering;
    let deadline = tokio::time::Instant::now() + ASK_DEADLINE;
    loop {
        let answer = tokio::time::timeout_at(
            deadline,
            proxy.ask(Route { prompt: prompt.clone(), exclude_prefill: exclude_prefill.to_vec() }),
        )
        .await?;
        let restarting = match &answer {
            // Killed while this ask was in its mailbox or in hand, or drained by the restart: the
            // next incarnation reads the same mailbox.
            Err(SendError::ActorStopped | SendError::ActorRestarting(_)) => true,
            Err(SendError::HandlerError(NotReady::Starting { .. })) => ctx.was_ready.load(Ordering::Acquire),
            _ => false,
        };
        match answer {
            _ if restarting && tokio::time::Instant::now() < deadline => tokio::time::sleep(RESTART_POLL).await,
            Ok(route) => {
                ctx.was_ready.store(true, Ordering::Release);
                return Ok(Ok(route));
            }
            other => return Ok(other),
        }
    }
}

/// The flow of one request (steps 8–10, 25, 43), or the refusal of a body that could not be read;
/// every answer carries the request's id in `x-request-id` (streamed ones too: headers go first).
async fn serve(
    ctx: Arc<FlowContext>,
    api: &'static str,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let request_id = flow_request_id(&headers);
    let mut response = match body {
        Ok(body) => flow(ctx, api, headers, body, request_id.clone().into()).await,
        Err(rejected) => body_refused(rejected),
    };
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert("x-request-id", v);
    }
    response
}

/// Steps 8, 9, 10 and 43 in turn; a stage that fails answers the client.
async fn flow(
    ctx: Arc<FlowContext>,
    api: &'static str,
    headers: HeaderMap,
    body: Bytes,
    request_id: RequestId,
) -> Response {
    let transfer_id = format!("xfer-{request_id}");
    let step8 = step_span!(steps::CLIENT_REQUEST, request_id = %request_id, transfer_id = %transfer_id);
    let request = match parse_request(&step8, &body, api == CHAT_API) {
        Ok(request) => request,
        Err(e) => return e.into_response(),
    };
    let prompt = prompt_key(&request, api == CHAT_API);
    let mut failed_prefill = Vec::new();
    let mut prefill_error: Option<UpstreamError> = None;
    loop {
        // A retry is a new request to P and D (a new transfer): the first D request was closed.
        let (upstream_id, transfer_id) = match failed_prefill.len() {
            0 => (request_id.clone(), transfer_id.clone()),
            n => (format!("{request_id}-retry{n}").into(), format!("{transfer_id}-retry{n}")),
        };
        let route = match (choose_route(&ctx, &step8, &prompt, &failed_prefill).await, prefill_error.take()) {
            (Ok(route), _) => route,
            // No other P to retry on: the client gets the failure of the one it had.
            (Err(_), Some(failed)) => return failed.into_response(),
            (Err(e), None) => {
                return error_response(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", e.to_string())
            }
        };
        if !failed_prefill.is_empty() {
            pdflow_observability::metrics::global().count_prefill_retry();
        }
        let traceparent = record_trace_context(&step8, &headers, &route);
        let upstream = Upstream {
            route_done: RouteDoneGuard::new(ctx.proxy.clone(), route.done()),
            headers: upstream_headers(&headers, &upstream_id, &traceparent),
            ctx: ctx.clone(),
            api,
            route,
            request_id: upstream_id,
            transfer_id: transfer_id.into(),
            traceparent,
        };
        // D alone (a short prompt, or one D holds most of): no P, no transfer.
        // P's prefill leaves P's load when P's call ends, however it ends.
        let prefill_done = upstream.route.prefill_done().map(|done| PrefillDoneGuard::new(ctx.proxy.clone(), done));
        let mut p_task = prefill_done.map(|done| upstream.dispatch_prefill(&request, done));
        match upstream.dispatch_decode(request.clone(), &mut p_task).await {
            Ok(d_resp) => {
                drop(step8);
                return upstream.relay_response(d_resp, p_task).await;
            }
            // P failed before D answered, so nothing reached the client: once more on another P.
            Err(e)
                if e.is_prefill_failure()
                    && failed_prefill.len() < MAX_PREFILL_RETRIES
                    && upstream.route.disaggregate =>
            {
                tracing::warn!(request_id = %request_id, prefill = %upstream.route.prefill_url, error = %e,
                    "prefill failed before any token reached the client: retrying on another P");
                failed_prefill.push(upstream.route.prefill_index);
                prefill_error = Some(e);
            }
            Err(e) => return e.into_response(),
        }
    }
}

/// Why a client's body was refused at step 8 (a 400), before P or D saw it.
#[derive(Debug, thiserror::Error)]
enum BadRequest {
    #[error("request body must be a JSON object")]
    NotAnObject,
    #[error("request body is not valid JSON: {0}")]
    NotJson(#[source] serde_json::Error),
    /// A field the engines would refuse (D alone, for those the proxy rewrites for P).
    #[error(transparent)]
    Field(#[from] InvalidField),
}

impl BadRequest {
    /// A 400 `invalid_request_error`; a bad field is named in `param` too (OpenAI's error shape).
    fn into_response(self) -> Response {
        let message = self.to_string();
        let param = match &self {
            BadRequest::Field(e) => serde_json::Value::from(e.field()),
            _ => serde_json::Value::Null,
        };
        let code = StatusCode::BAD_REQUEST;
        let body = serde_json::json!({"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code.as_u16()}});
        (code, Json(body)).into_response()
    }
}

/// Why step 8 found no route (a 503).
#[derive(Debug, thiserror::Error)]
enum NoRoute {
    /// The Proxy actor is stopping: the process is shutting down.
    #[error("proxy is stopping")]
    Stopping,
    /// The proxy is not ready (starting, or a pool has no healthy instance).
    #[error(transparent)]
    NotReady(NotReady),
    /// The Proxy actor did not answer within [`ASK_DEADLINE`].
    #[error("proxy did not answer")]
    Timeout(#[source] tokio::time::error::Elapsed),
    /// The Proxy actor could not be asked (stopped, or its mailbox refused the ask).
    #[error("proxy did not answer")]
    Unreachable(#[source] SendError<Route, NotReady>),
}

/// Step 8: the client's body, which must be a JSON object whose fields the engines serve
/// ([`validate`]); `Err` says why it is not (a 400).
fn parse_request(
    step8: &tracing::Span,
    body: &[u8],
    chat: bool,
) -> Result<serde_json::Map<String, serde_json::Value>, BadRequest> {
    let error = match step8.in_scope(|| serde_json::from_slice::<serde_json::Value>(body)) {
        Ok(serde_json::Value::Object(map)) => match validate(&map, chat) {
            Ok(()) => return Ok(map),
            Err(e) => BadRequest::Field(e),
        },
        Ok(_) => BadRequest::NotAnObject,
        Err(e) => BadRequest::NotJson(e),
    };
    Outcome::BAD_REQUEST.record(step8);
    Err(error)
}

/// Step 8: P and D chosen by the Proxy actor; `Err` says why not (a 503: the actor is stopping,
/// not ready, or did not answer).
async fn choose_route(
    ctx: &FlowContext,
    step8: &tracing::Span,
    prompt: &PromptKey,
    exclude_prefill: &[usize],
) -> Result<RouteDecision, NoRoute> {
    let Some(proxy) = Some(ctx.proxy.clone()).filter(|p| p.is_alive()) else {
        return Err(NoRoute::Stopping);
    };
    let error = match route(ctx, &proxy, prompt, exclude_prefill).instrument(step8.clone()).await {
        Ok(Ok(route)) => {
            step8.record(attrs::ROUTE, describe_route(&route).as_str());
            return Ok(route);
        }
        Ok(Err(SendError::HandlerError(not_ready))) => {
            Outcome::NOT_READY.record(step8);
            return Err(NoRoute::NotReady(not_ready));
        }
        Ok(Err(e)) => NoRoute::Unreachable(e),
        Err(elapsed) => NoRoute::Timeout(elapsed),
    };
    Outcome::PROXY_UNAVAILABLE.record(step8);
    Err(error)
}

/// The routing decision as step 8's span records it: `prefill=cache_hit:12 decode=least_loaded`
/// (chunks matched; `kv_hit:N`: blocks the engine's KV events say it holds).
fn describe_route(route: &RouteDecision) -> String {
    let one = |choice: Choice| match choice {
        Choice::CacheHit { chunks } => format!("{}:{chunks}", choice.label()),
        Choice::KvHit { blocks, .. } => format!("{}:{blocks}", choice.label()),
        other => other.label().to_owned(),
    };
    format!("prefill={} decode={}", one(route.prefill_choice), one(route.decode_choice))
}

/// Step 8's trace attributes: the request's trace context (returned), the client's parent span,
/// P's engine id.
fn record_trace_context(step8: &tracing::Span, headers: &HeaderMap, route: &RouteDecision) -> String {
    let (traceparent, client_parent) = traceparent(headers);
    step8.record(attrs::TRACEPARENT, traceparent.as_str());
    if let Some(parent) = &client_parent {
        step8.record(attrs::CLIENT_PARENT, parent.as_str());
    }
    step8.record(attrs::ENGINE_ID, route.prefill_engine_id.as_str());
    traceparent
}

/// One routed request on its way to P and D (steps 9, 10, 43).
struct Upstream {
    ctx: Arc<FlowContext>,
    api: &'static str,
    route: RouteDecision,
    request_id: RequestId,
    transfer_id: TransferId,
    traceparent: String,
    /// Sent to P and D ([`upstream_headers`]).
    headers: reqwest::header::HeaderMap,
    /// Gives the route's work back to the policies' load once the request ends (dropped with
    /// the flow, or with D's relayed answer).
    route_done: RouteDoneGuard,
}

impl Upstream {
    /// Step 9: P's request in a task of its own, aborted if this flow is dropped.
    fn dispatch_prefill(
        &self,
        request: &serde_json::Map<String, serde_json::Value>,
        prefill_done: PrefillDoneGuard,
    ) -> PrefillHandle {
        let p_body = prefill_body(request, &self.transfer_id, &self.traceparent);
        let mut p_headers = self.headers.clone();
        p_headers.insert("x-data-parallel-rank", HeaderValue::from(self.route.prefill_dp_rank));
        let p_call = call_prefill(
            self.ctx.client.clone(),
            format!("{}{}", self.route.prefill_url, self.api),
            p_body,
            p_headers,
            self.ctx.upstream_timeout,
            self.request_id.clone(),
            self.transfer_id.clone(),
        );
        AbortOnDropHandle::new(tokio::spawn(async move {
            let _prefill_done = prefill_done;
            p_call.await
        }))
    }

    fn decode_url(&self) -> String {
        format!("{}{}", self.route.decode_url, self.api)
    }

    /// Step 10: D's request, at the same time as P's; a prefill failure meanwhile cancels it.
    async fn dispatch_decode(
        &self,
        request: serde_json::Map<String, serde_json::Value>,
        p_task: &mut Option<PrefillHandle>,
    ) -> Result<reqwest::Response, UpstreamError> {
        let d_url = self.decode_url();
        let step10 = step_span!(steps::DISPATCH_DECODE, request_id = %self.request_id, transfer_id = %self.transfer_id);
        step10.record(attrs::ENGINE_ID, self.route.prefill_engine_id.as_str());
        let d_send = tokio::time::timeout(
            self.ctx.upstream_timeout,
            self.ctx
                .client
                .post(&d_url)
                .headers(self.headers.clone())
                .json(&match self.route.disaggregate {
                    true => decode_body(request, &self.transfer_id, &self.route, &self.traceparent),
                    false => serde_json::Value::Object(request),
                })
                .send(),
        )
        .instrument(step10.clone());
        tokio::pin!(d_send);

        let d_result = loop {
            tokio::select! {
                p = wait_prefill(p_task) => {
                    *p_task = None;
                    if let Err(e) = p {
                        // Dropping `d_send` on return closes D's connection: D aborts the request.
                        Outcome::PREFILL_FAILED.record(&step10);
                        report_prefill_failure(&self.ctx, self.route.prefill_index, &e);
                        return Err(e);
                    }
                }
                d = &mut d_send => break d,
            }
        };
        let d_resp = match d_result {
            Ok(Ok(resp)) => resp,
            Ok(Err(e)) => {
                Outcome::ERROR.record(&step10);
                if e.is_connect() {
                    // D never saw the request, so no D will pull its KV: P is told to free the
                    // blocks now (it may have finished already) rather than at its send expiry.
                    self.release_prefill();
                }
                let error = UpstreamError::Connect {
                    role: "decode",
                    url: d_url,
                    reason: e.to_string(),
                    refused: e.is_connect(),
                };
                if e.is_connect() {
                    upstream::report_unreachable(&self.ctx, Pool::Decode, self.route.decode_index, &error);
                }
                return Err(error);
            }
            Err(_) => {
                Outcome::TIMEOUT.record(&step10);
                // The proxy gives D's request up (dropping it closes D's connection: a D that got
                // it aborts it and tells P itself); one that never got it cannot: P is told.
                self.release_prefill();
                return Err(UpstreamError::Timeout { role: "decode", url: d_url, after: self.ctx.upstream_timeout });
            }
        };
        Outcome::Http(d_resp.status().as_u16()).record(&step10);
        Ok(d_resp)
    }

    /// Asks the Proxy actor to free P's blocks for this transfer ([`ReleasePrefill`]).
    fn release_prefill(&self) {
        if !self.route.disaggregate {
            return;
        }
        let release = ReleasePrefill {
            bootstrap_addr: self.route.prefill_bootstrap_addr.clone(),
            engine_id: self.route.prefill_engine_id.clone(),
            transfer_id: self.transfer_id.clone(),
        };
        let proxy = self.ctx.proxy.clone();
        tokio::spawn(async move {
            if let Err(e) = proxy.tell(release).await {
                tracing::debug!(error = %e, "the proxy could not take the release of P's blocks: P's send expiry frees them");
            }
        });
    }

    /// Step 43: D's status, content type and bytes, chunk by chunk. A non-2xx D cancels P.
    async fn relay_response(self, d_resp: reqwest::Response, mut p_task: Option<PrefillHandle>) -> Response {
        let status = d_resp.status();
        let content_type = d_resp.headers().get(header::CONTENT_TYPE).cloned();
        let sse =
            content_type.as_ref().and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("text/event-stream"));
        let whole = !sse && d_resp.content_length().is_some_and(|n| n <= MAX_WHOLE_BODY);
        if !status.is_success() {
            p_task = None;
        }
        let step43 = step_span!(steps::PROXY_RESPONSE, request_id = %self.request_id, transfer_id = %self.transfer_id);
        let relay = Relay {
            d_body: d_resp.bytes_stream().boxed(),
            p_task,
            chunk_timeout: self.ctx.upstream_timeout,
            sse,
            done: false,
            d_url: self.decode_url(),
            ctx: self.ctx,
            prefill_index: self.route.prefill_index,
            _route_done: self.route_done,
            span: step43,
        };
        let mut response = if whole {
            // A whole answer of known, small length (a non-streamed completion): relayed as one body
            // with its length, so the client reads it in one go; a prefill failure meanwhile is a
            // clean 502 instead of a cut body.
            match relay.collect().await {
                Ok(bytes) => Response::new(Body::from(bytes)),
                Err(e) => return error_response(StatusCode::BAD_GATEWAY, "upstream_error", e.to_string()),
            }
        } else {
            Response::new(Body::from_stream(relay.into_stream()))
        };
        *response.status_mut() = status;
        if let Some(ct) = content_type {
            response.headers_mut().insert(header::CONTENT_TYPE, ct);
        }
        response
    }
}
