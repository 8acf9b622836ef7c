//! One client request through the proxy: fan-out to P and D, streaming D's answer back.
//!
//! Seed steps: 8 (`POST /v1/completions` or `/v1/chat/completions` arrives; request_id and
//! transfer_id made; P and D chosen by asking the Proxy actor for a `Route`), 9 (P's request:
//! `max_tokens` 1, not streamed, `do_remote_decode`), 10 (D's request, sent at the same time:
//! `do_remote_prefill`, P's bootstrap address and engine id), 25 (P's status checked, its body
//! discarded) and 43 (D's status, content type and bytes streamed back chunk by chunk; 42 is D's).
//!
//! This runs in the HTTP handler's task, never in the actor's mailbox. Unlike vLLM's example
//! proxy, a failed prefill (connection error, deadline, non-2xx) cancels D's request and answers
//! the client at once; a client that goes away cancels both upstream calls (P runs in a task
//! behind an abort-on-drop guard, D's response lives in the response body stream); every
//! upstream call has a deadline. Upstream errors are JSON `{"error": {"message", "type", "code"}}`
//! with a non-200 status.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::stream::{BoxStream, StreamExt};
use kameo::prelude::*;
use pdflow_messages::kv_transfer_params::KvTransferParams;
use pdflow_messages::proxy::{NotReady, PrefillFailed, ProxyStatus, Route, RouteDecision};
use pdflow_telemetry::{attrs, step_span, steps};
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument;

use crate::proxy::Proxy;

/// Largest client body the proxy accepts (long prompts are large).
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;
/// How long a handler waits for the Proxy actor's answer.
const ASK_DEADLINE: Duration = Duration::from_secs(5);
/// How much of an upstream error body is read for its message.
const MAX_ERROR_BODY: usize = 64 * 1024;
/// D's non-streamed answers up to this length are relayed whole (longer ones chunk by chunk).
const MAX_WHOLE_BODY: u64 = 1 << 20;
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

/// Why an upstream call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum UpstreamError {
    #[error("{role} {url} could not be reached: {reason}")]
    Connect { role: &'static str, url: String, reason: String },
    #[error("{role} {url} did not answer within {after:?} (raise the upstream timeout or check the server)")]
    Timeout { role: &'static str, url: String, after: Duration },
    #[error("{role} {url} answered {status}: {message}")]
    Status { role: &'static str, url: String, status: u16, message: String },
    #[error("{role} task ended unexpectedly: {reason}")]
    Internal { role: &'static str, reason: String },
}

impl UpstreamError {
    fn into_response(self) -> Response {
        let (status, kind) = match &self {
            UpstreamError::Status { status, .. } if (400..500).contains(status) => {
                (StatusCode::from_u16(*status).unwrap_or(StatusCode::BAD_GATEWAY), "upstream_client_error")
            }
            UpstreamError::Timeout { .. } => (StatusCode::GATEWAY_TIMEOUT, "upstream_timeout"),
            _ => (StatusCode::BAD_GATEWAY, "upstream_error"),
        };
        error_response(status, kind, self.to_string())
    }
}

/// `{"error": {"message", "type", "code"}}` with `status`.
pub fn error_response(status: StatusCode, kind: &str, message: String) -> Response {
    let body = serde_json::json!({"error": {"message": message, "type": kind, "code": status.as_u16()}});
    (status, Json(body)).into_response()
}

/// The proxy's routes: `/v1/completions`, `/v1/chat/completions`, `/health`, `/metrics`.
pub fn router(ctx: Arc<FlowContext>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(ctx)
}

/// `/metrics`: the process's step metrics (Prometheus text).
async fn metrics() -> Response {
    use pdflow_telemetry::metrics as m;
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

async fn completions(State(ctx): State<Arc<FlowContext>>, headers: HeaderMap, body: Bytes) -> Response {
    serve(ctx, "/v1/completions", headers, body).await
}

async fn chat_completions(State(ctx): State<Arc<FlowContext>>, headers: HeaderMap, body: Bytes) -> Response {
    serve(ctx, "/v1/chat/completions", headers, body).await
}

/// The request's W3C trace context, whose span id is the proxy's step-8 span: a child of the
/// client's context when it sent a valid one (same trace, new span id; returned with the client's
/// span id, step 8's parent), else a new trace.
fn traceparent(headers: &HeaderMap) -> (String, Option<String>) {
    let span = uuid::Uuid::new_v4().simple().to_string();
    if let Some(tp) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
        let parts: Vec<&str> = tp.split('-').collect();
        if let [version, trace, parent, flags] = parts[..] {
            let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
            if hex(version, 2) && hex(trace, 32) && hex(parent, 16) && hex(flags, 2) && trace.bytes().any(|b| b != b'0')
            {
                return (
                    format!("00-{}-{}-{flags}", trace.to_ascii_lowercase(), &span[..16]),
                    Some(parent.to_ascii_lowercase()),
                );
            }
        }
    }
    let trace = uuid::Uuid::new_v4().simple().to_string();
    (format!("00-{trace}-{}-01", &span[..16]), None)
}

/// P's body (step 9): one token, not streamed, `do_remote_decode`.
pub fn prefill_body(
    client: &serde_json::Map<String, serde_json::Value>,
    transfer_id: &str,
    traceparent: &str,
) -> serde_json::Value {
    let mut body = client.clone();
    let params =
        KvTransferParams { traceparent: Some(traceparent.to_owned()), ..KvTransferParams::for_prefill(transfer_id) };
    body.insert("kv_transfer_params".into(), serde_json::to_value(params).unwrap_or_default());
    body.insert("stream".into(), false.into());
    body.insert("max_tokens".into(), 1.into());
    if body.contains_key("max_completion_tokens") {
        body.insert("max_completion_tokens".into(), 1.into());
    }
    body.remove("stream_options");
    serde_json::Value::Object(body)
}

/// D's body (step 10): the client's request plus where to pull the KV from.
pub fn decode_body(
    client: serde_json::Map<String, serde_json::Value>,
    transfer_id: &str,
    route: &RouteDecision,
    traceparent: &str,
) -> serde_json::Value {
    let mut body = client;
    let params = KvTransferParams {
        traceparent: Some(traceparent.to_owned()),
        ..KvTransferParams::for_decode(transfer_id, &route.prefill_bootstrap_addr, &route.prefill_engine_id)
    };
    body.insert("kv_transfer_params".into(), serde_json::to_value(params).unwrap_or_default());
    serde_json::Value::Object(body)
}

/// Headers sent to P and D: request id, trace context, the client's authorization.
fn upstream_headers(client: &HeaderMap, request_id: &str, traceparent: &str) -> reqwest::header::HeaderMap {
    let mut h = reqwest::header::HeaderMap::new();
    if let Ok(v) = HeaderValue::from_str(request_id) {
        h.insert("x-request-id", v);
    }
    if let Ok(v) = HeaderValue::from_str(traceparent) {
        h.insert("traceparent", v);
    }
    if let Some(auth) = client.get(header::AUTHORIZATION) {
        h.insert(header::AUTHORIZATION, auth.clone());
    }
    h
}

/// Longest client `X-Request-Id` the proxy adopts.
const MAX_CLIENT_REQUEST_ID: usize = 64;

/// The request's id (step 8): `{client id}-{8 hex}` when the client sent a sane `X-Request-Id`
/// (1..=64 chars of `[A-Za-z0-9._-]`; the suffix keeps it unique when a client reuses ids, and a
/// fault plan's `request_id` filter — a substring — still matches), else a fresh uuid.
pub fn flow_request_id(headers: &HeaderMap) -> String {
    let fresh = uuid::Uuid::new_v4();
    let Some(value) = headers.get("x-request-id") else { return fresh.to_string() };
    let sane = |s: &str| {
        (1..=MAX_CLIENT_REQUEST_ID).contains(&s.len())
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    };
    match value.to_str().ok().filter(|s| sane(s)) {
        Some(client_id) => format!("{client_id}-{}", &fresh.simple().to_string()[..8]),
        None => {
            tracing::debug!(header = ?value, "client X-Request-Id ignored: expected 1-64 characters of [A-Za-z0-9._-]");
            fresh.to_string()
        }
    }
}

/// Asks the Proxy actor for a route within [`ASK_DEADLINE`]. If it stopped while holding the ask,
/// or routed requests before and now answers "not ready yet", it is being restarted (a kill, a
/// panic) and re-discovering P's engine ids and the pools' health: asked again until it is ready
/// or the deadline passes, so that clients of the restart window are served instead of refused.
async fn route(
    ctx: &FlowContext,
    proxy: &ActorRef<Proxy>,
) -> Result<Result<RouteDecision, SendError<Route, NotReady>>, tokio::time::error::Elapsed> {
    use std::sync::atomic::Ordering;
    let deadline = tokio::time::Instant::now() + ASK_DEADLINE;
    loop {
        let answer = tokio::time::timeout_at(deadline, proxy.ask(Route)).await?;
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

/// The flow of one request (steps 8–10, 25, 43); every answer carries the request's id in
/// `x-request-id` (streamed ones too: headers go first).
async fn serve(ctx: Arc<FlowContext>, api: &'static str, headers: HeaderMap, body: Bytes) -> Response {
    let request_id = flow_request_id(&headers);
    let mut response = flow(ctx, api, headers, body, request_id.clone()).await;
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert("x-request-id", v);
    }
    response
}

async fn flow(
    ctx: Arc<FlowContext>,
    api: &'static str,
    headers: HeaderMap,
    body: Bytes,
    request_id: String,
) -> Response {
    let transfer_id = format!("xfer-{request_id}");
    let step8 = step_span!(steps::CLIENT_REQUEST, request_id = %request_id, transfer_id = %transfer_id);

    let parsed = step8.in_scope(|| serde_json::from_slice::<serde_json::Value>(&body));
    let request = match parsed {
        Ok(serde_json::Value::Object(map)) => map,
        Ok(_) => {
            step8.record(attrs::OUTCOME, "bad_request");
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "request body must be a JSON object".into(),
            );
        }
        Err(e) => {
            step8.record(attrs::OUTCOME, "bad_request");
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("request body is not valid JSON: {e}"),
            );
        }
    };
    let Some(proxy) = Some(ctx.proxy.clone()).filter(|p| p.is_alive()) else {
        return error_response(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", "proxy is stopping".into());
    };
    let route = match route(&ctx, &proxy).instrument(step8.clone()).await {
        Ok(Ok(route)) => route,
        Ok(Err(SendError::HandlerError(not_ready))) => {
            step8.record(attrs::OUTCOME, "not_ready");
            return error_response(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", not_ready.to_string());
        }
        _ => {
            step8.record(attrs::OUTCOME, "proxy_unavailable");
            return error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "proxy did not answer".into(),
            );
        }
    };
    let (traceparent, client_parent) = traceparent(&headers);
    step8.record(attrs::TRACEPARENT, traceparent.as_str());
    if let Some(parent) = &client_parent {
        step8.record(attrs::CLIENT_PARENT, parent.as_str());
    }
    step8.record(attrs::ENGINE_ID, route.prefill_engine_id.as_str());
    drop(step8);
    let up_headers = upstream_headers(&headers, &request_id, &traceparent);

    // Step 9: P's request in a task of its own, aborted if this flow is dropped.
    let p_body = prefill_body(&request, &transfer_id, &traceparent);
    let mut p_headers = up_headers.clone();
    p_headers.insert("x-data-parallel-rank", HeaderValue::from(route.prefill_dp_rank));
    let p_call = call_prefill(
        ctx.client.clone(),
        format!("{}{api}", route.prefill_url),
        p_body,
        p_headers,
        ctx.upstream_timeout,
        request_id.clone(),
        transfer_id.clone(),
    );
    let mut p_task = Some(AbortOnDropHandle::new(tokio::spawn(p_call)));

    // Step 10: D's request, at the same time.
    let d_url = format!("{}{api}", route.decode_url);
    let step10 = step_span!(steps::DISPATCH_DECODE, request_id = %request_id, transfer_id = %transfer_id);
    step10.record(attrs::ENGINE_ID, route.prefill_engine_id.as_str());
    let d_send = tokio::time::timeout(
        ctx.upstream_timeout,
        ctx.client
            .post(&d_url)
            .headers(up_headers)
            .json(&decode_body(request, &transfer_id, &route, &traceparent))
            .send(),
    )
    .instrument(step10.clone());
    tokio::pin!(d_send);

    let d_result = loop {
        tokio::select! {
            p = wait_prefill(&mut p_task) => {
                p_task = None;
                if let Err(e) = p {
                    // Dropping `d_send` on return closes D's connection: D aborts the request.
                    step10.record(attrs::OUTCOME, "cancelled: prefill failed");
                    report_prefill_failure(&ctx, route.prefill_index, &e);
                    return e.into_response();
                }
            }
            d = &mut d_send => break d,
        }
    };
    let d_resp = match d_result {
        Ok(Ok(resp)) => resp,
        Ok(Err(e)) => {
            step10.record(attrs::OUTCOME, "error");
            return UpstreamError::Connect { role: "decode", url: d_url, reason: e.to_string() }.into_response();
        }
        Err(_) => {
            step10.record(attrs::OUTCOME, "timeout");
            return UpstreamError::Timeout { role: "decode", url: d_url, after: ctx.upstream_timeout }.into_response();
        }
    };
    step10.record(attrs::OUTCOME, d_resp.status().as_u16().to_string().as_str());
    drop(step10);

    // Step 43: D's status, content type and bytes, chunk by chunk. A non-2xx D cancels P.
    let status = d_resp.status();
    let content_type = d_resp.headers().get(header::CONTENT_TYPE).cloned();
    let sse = content_type.as_ref().and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("text/event-stream"));
    let whole = !sse && d_resp.content_length().is_some_and(|n| n <= MAX_WHOLE_BODY);
    if !status.is_success() {
        p_task = None;
    }
    let step43 = step_span!(steps::PROXY_RESPONSE, request_id = %request_id, transfer_id = %transfer_id);
    let relay = Relay {
        d_body: d_resp.bytes_stream().boxed(),
        p_task,
        chunk_timeout: ctx.upstream_timeout,
        sse,
        done: false,
        ctx: ctx.clone(),
        prefill_index: route.prefill_index,
        d_url,
        span: step43,
    };
    let mut response = if whole {
        // A whole answer of known, small length (a non-streamed completion): relayed as one body
        // with its length, so the client reads it in one go; a prefill failure meanwhile is a
        // clean 502 instead of a cut body.
        match relay.collect().await {
            Ok(bytes) => Response::new(Body::from(bytes)),
            Err(message) => return error_response(StatusCode::BAD_GATEWAY, "upstream_error", message),
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

type PrefillHandle = AbortOnDropHandle<Result<(), UpstreamError>>;

/// Waits for P's task; pends forever once it has been taken.
async fn wait_prefill(p: &mut Option<PrefillHandle>) -> Result<(), UpstreamError> {
    match p {
        Some(handle) => match handle.await {
            Ok(r) => r,
            Err(e) => Err(UpstreamError::Internal { role: "prefill", reason: e.to_string() }),
        },
        None => std::future::pending().await,
    }
}

fn report_prefill_failure(ctx: &FlowContext, prefill_index: usize, e: &UpstreamError) {
    tracing::warn!(error = %e, "prefill failed; decode request cancelled");
    if let Some(proxy) = Some(ctx.proxy.clone()).filter(|p| p.is_alive()) {
        // try_send: never wait on the actor from the request path.
        let _ = proxy.tell(PrefillFailed { prefill_index, reason: e.to_string() }).try_send();
    }
}

/// Steps 9 and 25: P's request under one deadline; the body is read and discarded.
async fn call_prefill(
    client: reqwest::Client,
    url: String,
    body: serde_json::Value,
    headers: reqwest::header::HeaderMap,
    deadline: Duration,
    request_id: String,
    transfer_id: String,
) -> Result<(), UpstreamError> {
    let step9 = step_span!(steps::DISPATCH_PREFILL, request_id = %request_id, transfer_id = %transfer_id);
    let call = async {
        let resp = client
            .post(&url)
            .headers(headers)
            .json(&body)
            .send()
            .instrument(step9.clone())
            .await
            .map_err(|e| UpstreamError::Connect { role: "prefill", url: url.clone(), reason: e.to_string() })?;
        step9.record(attrs::OUTCOME, resp.status().as_u16().to_string().as_str());
        let step25 = step_span!(steps::P_HTTP_DONE, request_id = %request_id, transfer_id = %transfer_id);
        let status = resp.status();
        // Read to the end so the connection goes back to the pool; P's one token is not needed.
        let bytes = read_capped(resp).instrument(step25.clone()).await;
        if status.is_success() {
            step25.record(attrs::OUTCOME, "ok");
            Ok(())
        } else {
            step25.record(attrs::OUTCOME, status.as_u16().to_string().as_str());
            Err(UpstreamError::Status {
                role: "prefill",
                url: url.clone(),
                status: status.as_u16(),
                message: error_message(&bytes),
            })
        }
    };
    match tokio::time::timeout(deadline, call).await {
        Ok(r) => r,
        Err(_) => Err(UpstreamError::Timeout { role: "prefill", url, after: deadline }),
    }
}

/// Reads a body, keeping at most [`MAX_ERROR_BODY`] bytes (the rest is drained and dropped).
async fn read_capped(resp: reqwest::Response) -> Vec<u8> {
    let mut kept = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(Ok(chunk)) = stream.next().await {
        let room = MAX_ERROR_BODY.saturating_sub(kept.len());
        kept.extend_from_slice(&chunk[..chunk.len().min(room)]);
    }
    kept
}

/// The message of an upstream error body: `error.message`, `message`, `detail`, or the text.
fn error_message(body: &[u8]) -> String {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) {
        for pointer in ["/error/message", "/message", "/detail", "/error"] {
            if let Some(s) = v.pointer(pointer).and_then(|m| m.as_str()) {
                return s.to_owned();
            }
        }
    }
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if text.is_empty() {
        "(empty body)".to_owned()
    } else {
        text.chars().take(1000).collect()
    }
}

/// D's body on its way to the client, watching P's task meanwhile (step 43).
struct Relay {
    d_body: BoxStream<'static, reqwest::Result<Bytes>>,
    p_task: Option<PrefillHandle>,
    chunk_timeout: Duration,
    sse: bool,
    done: bool,
    ctx: Arc<FlowContext>,
    prefill_index: usize,
    d_url: String,
    span: tracing::Span,
}

impl Relay {
    fn into_stream(self) -> BoxStream<'static, Result<Bytes, std::io::Error>> {
        futures::stream::unfold(self, |mut relay| async move {
            let item = relay.next_chunk().await?;
            Some((item, relay))
        })
        .boxed()
    }

    /// The whole body, while watching P's task as [`Relay::next_chunk`] does; `Err` says why it
    /// could not be read to its end.
    async fn collect(mut self) -> Result<Bytes, String> {
        let mut body = Vec::new();
        while let Some(chunk) = self.next_chunk().await {
            body.extend_from_slice(&chunk.map_err(|e| e.to_string())?);
        }
        Ok(Bytes::from(body))
    }

    /// The next chunk for the client; `None` ends the body.
    async fn next_chunk(&mut self) -> Option<Result<Bytes, std::io::Error>> {
        if self.done {
            return None;
        }
        loop {
            tokio::select! {
                p = wait_prefill(&mut self.p_task) => {
                    self.p_task = None;
                    if let Err(e) = p {
                        report_prefill_failure(&self.ctx, self.prefill_index, &e);
                        return Some(self.fail(e.to_string()));
                    }
                }
                chunk = tokio::time::timeout(self.chunk_timeout, self.d_body.next()) => {
                    return match chunk {
                        Ok(Some(Ok(bytes))) => Some(Ok(bytes)),
                        Ok(None) => {
                            self.done = true;
                            self.span.record(attrs::OUTCOME, "ok");
                            // D is done: P's request may finish on its own, under its deadline.
                            if let Some(p) = self.p_task.take() {
                                drop(p.detach());
                            }
                            None
                        }
                        Ok(Some(Err(e))) => Some(self.fail(format!("decode {} broke off: {e}", self.d_url))),
                        Err(_) => Some(self.fail(format!(
                            "decode {} sent nothing for {:?}", self.d_url, self.chunk_timeout
                        ))),
                    };
                }
            }
        }
    }

    /// Ends the body after an upstream failure: an SSE error event, or an aborted body.
    fn fail(&mut self, message: String) -> Result<Bytes, std::io::Error> {
        self.done = true;
        self.span.record(attrs::OUTCOME, "error");
        tracing::warn!(%message, "response to the client cut short");
        if self.sse {
            let event = serde_json::json!({"error": {"message": message, "type": "upstream_error", "code": 502}});
            Ok(Bytes::from(format!("data: {event}\n\n")))
        } else {
            Err(std::io::Error::other(message))
        }
    }
}

#[cfg(test)]
mod traceparent_tests {
    use super::*;

    #[test]
    fn a_client_traceparent_becomes_the_parent_of_a_new_span_in_the_same_trace() {
        let mut headers = HeaderMap::new();
        headers
            .insert("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".parse().expect("header"));
        let (tp, parent) = traceparent(&headers);
        assert!(tp.starts_with("00-0af7651916cd43dd8448eb211c80319c-"), "same trace: {tp}");
        assert!(!tp.contains("b7ad6b7169203331"), "a new span id, not the client's: {tp}");
        assert_eq!(parent.as_deref(), Some("b7ad6b7169203331"));
        headers
            .insert("traceparent", "00-00000000000000000000000000000000-b7ad6b7169203331-01".parse().expect("header"));
        let (tp, parent) = traceparent(&headers);
        assert!(
            parent.is_none() && !tp.contains("0000000000000000000000000000000"),
            "an invalid context starts a new trace: {tp}"
        );
        let (tp, parent) = traceparent(&HeaderMap::new());
        assert_eq!((tp.len(), parent), (55, None));
    }
}
