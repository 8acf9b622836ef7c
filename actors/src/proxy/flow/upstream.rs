//! The proxy's upstream calls and what they send (seed steps 9, 10 and 25): P's and D's bodies and
//! headers, P's call under its deadline, and the errors an upstream call ends in, answered to the
//! client as JSON `{"error": {"message", "type", "code"}}` with a non-200 status.

use std::time::Duration;

use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::StreamExt;
use pdflow_messages::kv_transfer_params::KvTransferParams;
use pdflow_messages::proxy::{EngineUnreachable, Pool, PrefillFailed, RouteDecision};
use pdflow_messages::{RequestId, TransferId};
use pdflow_observability::{step_span, steps};
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument;

use super::FlowContext;
use pdflow_observability::Outcome;

/// How much of an upstream error body is read for its message.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// Why an upstream call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum UpstreamError {
    /// `refused`: no connection could be made at all (the engine is down), not a failure after.
    #[error("{role} {url} could not be reached: {reason}")]
    Connect { role: &'static str, url: String, reason: String, refused: bool },
    #[error("{role} {url} did not answer within {after:?} (raise the upstream timeout or check the server)")]
    Timeout { role: &'static str, url: String, after: Duration },
    #[error("{role} {url} answered {status}: {message}")]
    Status { role: &'static str, url: String, status: u16, message: String },
    #[error("{role} task ended unexpectedly: {reason}")]
    Internal { role: &'static str, reason: String },
}

impl UpstreamError {
    /// P failed for a reason another P may not have (unreachable, no answer in time, a 5xx, its
    /// task died); a 4xx is the request's own fault.
    pub(super) fn is_prefill_failure(&self) -> bool {
        match self {
            UpstreamError::Status { role, status, .. } => *role == "prefill" && *status >= 500,
            UpstreamError::Connect { role, .. }
            | UpstreamError::Timeout { role, .. }
            | UpstreamError::Internal { role, .. } => *role == "prefill",
        }
    }

    pub(super) fn into_response(self) -> Response {
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

/// P's body (step 9): one token, not streamed, `do_remote_decode`; no `stream_options` and no
/// `min_tokens` (vLLM refuses them with one token that does not stream: its toy proxy drops them
/// too, and D keeps them).
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
    body.remove("min_tokens");
    body.remove("min_completion_tokens");
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
    // P's request goes out at the same time: D waits for P's KV anyway.
    let params = KvTransferParams {
        traceparent: Some(traceparent.to_owned()),
        prefill_in_flight: true,
        ..KvTransferParams::for_decode(transfer_id, &route.prefill_bootstrap_addr, &*route.prefill_engine_id)
    };
    body.insert("kv_transfer_params".into(), serde_json::to_value(params).unwrap_or_default());
    serde_json::Value::Object(body)
}

/// Headers sent to P and D: request id, trace context, the client's authorization.
pub(super) fn upstream_headers(client: &HeaderMap, request_id: &str, traceparent: &str) -> reqwest::header::HeaderMap {
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

pub(super) type PrefillHandle = AbortOnDropHandle<Result<(), UpstreamError>>;

/// Waits for P's task; pends forever once it has been taken.
pub(super) async fn wait_prefill(p: &mut Option<PrefillHandle>) -> Result<(), UpstreamError> {
    match p {
        Some(handle) => match handle.await {
            Ok(r) => r,
            Err(e) => Err(UpstreamError::Internal { role: "prefill", reason: e.to_string() }),
        },
        None => std::future::pending().await,
    }
}

pub(super) fn report_prefill_failure(ctx: &FlowContext, prefill_index: usize, e: &UpstreamError) {
    tracing::warn!(error = %e, "prefill failed; decode request cancelled");
    if let UpstreamError::Connect { refused: true, .. } = e {
        report_unreachable(ctx, Pool::Prefill, prefill_index, e);
    }
    if let Some(proxy) = Some(ctx.proxy.clone()).filter(|p| p.is_alive()) {
        // try_send: never wait on the actor from the request path.
        let _ = proxy.tell(PrefillFailed { prefill_index, reason: e.to_string() }).try_send();
    }
}

/// An engine refused a request's connection: the Proxy actor takes it out of rotation at once
/// ([`EngineUnreachable`]) rather than after the poller's failed probes.
pub(super) fn report_unreachable(ctx: &FlowContext, pool: Pool, index: usize, e: &UpstreamError) {
    if let Some(proxy) = Some(ctx.proxy.clone()).filter(|p| p.is_alive()) {
        // try_send: never wait on the actor from the request path.
        let _ = proxy.tell(EngineUnreachable { pool, index, reason: e.to_string() }).try_send();
    }
}

/// Steps 9 and 25: P's request under one deadline; the body is read and discarded.
pub(super) async fn call_prefill(
    client: reqwest::Client,
    url: String,
    body: serde_json::Value,
    headers: reqwest::header::HeaderMap,
    deadline: Duration,
    request_id: RequestId,
    transfer_id: TransferId,
) -> Result<(), UpstreamError> {
    let step9 = step_span!(steps::DISPATCH_PREFILL, request_id = %request_id, transfer_id = %transfer_id);
    let call = async {
        let resp =
            client.post(&url).headers(headers).json(&body).send().instrument(step9.clone()).await.map_err(|e| {
                UpstreamError::Connect {
                    role: "prefill",
                    url: url.clone(),
                    reason: e.to_string(),
                    refused: e.is_connect(),
                }
            })?;
        Outcome::Http(resp.status().as_u16()).record(&step9);
        let step25 = step_span!(steps::P_HTTP_DONE, request_id = %request_id, transfer_id = %transfer_id);
        let status = resp.status();
        // Read to the end so the connection goes back to the pool; P's one token is not needed.
        let bytes = read_capped(resp).instrument(step25.clone()).await;
        if status.is_success() {
            Outcome::Ok.record(&step25);
            Ok(())
        } else {
            Outcome::Http(status.as_u16()).record(&step25);
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

#[cfg(test)]
mod tests {
    use pdflow_messages::proxy::Choice;

    use super::*;

    #[test]
    fn d_s_body_names_p_and_says_p_still_prefills() {
        let route = RouteDecision {
            prefill_index: 0,
            prefill_url: "http://127.0.0.1:8010".into(),
            prefill_bootstrap_addr: "http://127.0.0.1:8998".into(),
            prefill_dp_rank: 0,
            prefill_engine_id: "p-engine".into(),
            decode_index: 0,
            decode_url: "http://127.0.0.1:8020".into(),
            prefill_choice: Choice::RoundRobin,
            decode_choice: Choice::RoundRobin,
            prefill_tokens: 0,
            decode_tokens: 0,
            disaggregate: true,
        };
        let mut client = serde_json::Map::new();
        client.insert("prompt".into(), "hello".into());
        let body = decode_body(client, "xfer-1", &route, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
        let params = &body["kv_transfer_params"];
        assert_eq!(params["do_remote_prefill"], true);
        assert_eq!(params["transfer_id"], "xfer-1");
        assert_eq!(params["remote_bootstrap_addr"], "http://127.0.0.1:8998");
        assert_eq!(params["remote_engine_id"], "p-engine");
        assert_eq!(params["prefill_in_flight"], true, "P's request goes out at the same time");
        assert_eq!(body["prompt"], "hello");
    }
}
