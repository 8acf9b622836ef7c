//! vLLM's HTTP API over the simulated engine: `POST /v1/completions`, `POST /v1/chat/completions`
//! (JSON or SSE), `GET /health`, `GET /v1/models`, and `GET /pdflow/blocks` (block usage, for the
//! no-leak checks). Errors are vLLM's JSON (`{"error": {"message", "type", "code"}}`): 400 for bad
//! input, 500 for a failed request (e.g. a KV load failed under policy `fail`), 503 when the
//! engine is gone — never a 200 with an error inside. A client that disconnects aborts its request
//! (the body stream owns the [`RequestStream`]). Seed step 42 (D's HTTP response) is emitted here.
//! Wherever a request is refused — its body here, or the engine at admission — a transfer its
//! `kv_transfer_params` name is reported to the connector, so that the peer engine frees what
//! it holds for it at once. P takes vLLM's toy-proxy form (a bare `do_remote_decode`): the
//! transfer is named after its request id and its response carries D's `kv_transfer_params`.
//!
//! One API server fronts one engine or a data-parallel group of them, as vLLM's does: a request
//! goes to the rank its `X-data-parallel-rank` header names (the proxy sets it for P, the rank
//! whose engine id it wrote into D's `kv_transfer_params`), else to the least busy rank.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pdflow_messages::kv_transfer_params::{KvTransferParams, TransferRole};
use pdflow_messages::scheduler_connector::FinishStatus;
use pdflow_observability::{attrs, steps};
use tracing::Span;

use super::core::{finish_outcome, finish_reason, EngineHandle};
use super::model::Tokenizer;
use super::openai::*;
use super::request::{EngineError, EngineRequest, RequestStream};
use super::scheduler::BlockStats;

/// The router of one engine's API server.
pub fn router(handle: EngineHandle) -> Router {
    data_parallel_router(vec![handle])
}

/// The router of a data-parallel group's API server: `ranks[r]` serves data-parallel rank `r`.
pub fn data_parallel_router(ranks: Vec<EngineHandle>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/pdflow/blocks", get(blocks))
        .route("/metrics", get(metrics))
        .with_state(Engines { ranks: ranks.into(), next: Arc::new(AtomicUsize::new(0)) })
}

/// The header naming the data-parallel rank a request is for (vLLM's name).
pub const DATA_PARALLEL_RANK_HEADER: &str = "x-data-parallel-rank";

/// The engines an API server fronts, by data-parallel rank.
#[derive(Clone)]
struct Engines {
    ranks: Arc<[EngineHandle]>,
    /// Where the search for the least busy rank starts, so that ties take turns.
    next: Arc<AtomicUsize>,
}

impl Engines {
    /// The rank `headers` name, else the one holding the fewest requests.
    fn pick(&self, headers: &HeaderMap) -> Result<EngineHandle, ApiError> {
        let n = self.ranks.len();
        if let Some(value) = headers.get(DATA_PARALLEL_RANK_HEADER) {
            let rank = value.to_str().ok().and_then(|v| v.trim().parse::<usize>().ok()).filter(|&r| r < n);
            return rank.map(|r| self.ranks[r].clone()).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "X-data-parallel-rank {:?}: this server runs data-parallel ranks 0..{n}",
                    String::from_utf8_lossy(value.as_bytes())
                ))
            });
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let best = (0..n).map(|i| (start + i) % n).min_by_key(|&r| self.ranks[r].block_stats().requests).unwrap_or(0);
        Ok(self.ranks[best].clone())
    }

    fn first(&self) -> &EngineHandle {
        &self.ranks[0]
    }
}

/// An API error, rendered as vLLM's error JSON.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn bad_request(message: impl Into<String>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, message: message.into() }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        error_response(self.status, self.message)
    }
}

/// What a completion or chat request asks for, common to both.
struct Sampling {
    prompt: Prompt,
    max_tokens: Option<usize>,
    stream: bool,
    n: Option<u32>,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    kv_transfer_params: Option<serde_json::Value>,
}

fn error_response(status: StatusCode, message: impl Into<String>) -> Response {
    let kind = match status {
        StatusCode::BAD_REQUEST => "BadRequestError",
        StatusCode::NOT_FOUND => "NotFoundError",
        StatusCode::CONFLICT => "ConflictError",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
        _ => "InternalServerError",
    };
    let body = ErrorBody { error: ErrorInfo { message: message.into(), kind: kind.to_owned(), code: status.as_u16() } };
    (status, Json(body)).into_response()
}

pub(crate) fn engine_error_response(e: &EngineError) -> Response {
    let status = match e {
        EngineError::TransferIdInUse { .. } => StatusCode::CONFLICT,
        e if e.is_client_error() => StatusCode::BAD_REQUEST,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    };
    error_response(status, e.to_string())
}

async fn health(State(engines): State<Engines>) -> Response {
    match engines.ranks.iter().position(|h| !h.is_running()) {
        None => StatusCode::OK.into_response(),
        Some(_) if engines.ranks.len() == 1 => {
            error_response(StatusCode::SERVICE_UNAVAILABLE, "the engine loop is not running")
        }
        Some(r) => error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the engine loop of data-parallel rank {r} is not running"),
        ),
    }
}

async fn models(State(engines): State<Engines>) -> Response {
    let c = engines.first().config();
    Json(serde_json::json!({
        "object": "list",
        "data": [{"id": c.served_model_name, "object": "model", "created": now_secs(), "owned_by": "pdflow",
                  "root": c.served_model_name, "max_model_len": c.max_model_len}],
    }))
    .into_response()
}

/// Block usage, summed over the data-parallel ranks.
async fn blocks(State(engines): State<Engines>) -> Response {
    let sum = engines.ranks.iter().map(EngineHandle::block_stats).fold(BlockStats::default(), |a, b| BlockStats {
        total: a.total + b.total,
        free: a.free + b.free,
        requests: a.requests + b.requests,
        finished: a.finished + b.finished,
        cached: a.cached + b.cached,
    });
    Json(sum).into_response()
}

/// `/metrics`: the process's step metrics, plus each engine's blocks and requests (read now),
/// labelled by engine id, and vLLM's prefix-cache and prompt-token counters
/// ([`crate::cache_stats`]).
async fn metrics(State(engines): State<Engines>) -> Response {
    use pdflow_observability::metrics::{self as m, Gauge, GaugeSample};
    let stats: Vec<(String, BlockStats)> =
        engines.ranks.iter().map(|h| (h.config().engine_id.clone(), h.block_stats())).collect();
    let gauge = |name, help, value: fn(&BlockStats) -> f64| Gauge {
        name,
        help,
        samples: stats
            .iter()
            .map(|(id, s)| GaugeSample { labels: vec![("engine_id", id.clone())], value: value(s) })
            .collect(),
    };
    let extra = [
        gauge("pdflow_blocks_total", "KV blocks of the engine.", |s| s.total as f64),
        gauge("pdflow_blocks_held", "KV blocks allocated, including those held for a transfer (delayed free).", |s| {
            s.total.saturating_sub(s.free) as f64
        }),
        gauge(
            "pdflow_requests_held",
            "Requests the scheduler holds, including finished ones awaiting a delayed free.",
            |s| s.requests as f64,
        ),
        gauge("pdflow_requests_finished", "Requests the engine finished (any status) since it started.", |s| {
            s.finished as f64
        }),
    ];
    let counters: Vec<crate::cache_stats::EngineCounters<'_>> = engines
        .ranks
        .iter()
        .map(|h| crate::cache_stats::EngineCounters {
            model_name: &h.config().served_model_name,
            engine: h.config().data_parallel_rank,
            stats: h.cache_stats(),
        })
        .collect();
    let mut text = m::global().render_with(&extra);
    text.push_str(&crate::cache_stats::render(&counters));
    ([(header::CONTENT_TYPE, m::CONTENT_TYPE)], text).into_response()
}

/// What both endpoints ask of the engine, once parsed.
struct Generation {
    chat: bool,
    request: EngineRequest,
    stream: bool,
    role: TransferRole,
}

fn parse_params(value: Option<serde_json::Value>) -> Result<Option<KvTransferParams>, ApiError> {
    match value {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => KvTransferParams::from_json(&v)
            .map(Some)
            .map_err(|e| ApiError::bad_request(format!("invalid kv_transfer_params: {e}"))),
    }
}

fn request_id(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string())
}

fn traceparent(headers: &HeaderMap) -> Option<String> {
    headers.get("traceparent").and_then(|v| v.to_str().ok()).map(str::to_owned)
}

fn parse_json<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("malformed request body: {e}")))
}

fn build_generation(
    handle: &EngineHandle,
    headers: &HeaderMap,
    chat: bool,
    s: Sampling,
) -> Result<Generation, ApiError> {
    let tokenizer = Tokenizer { vocab_size: handle.config().vocab_size };
    let Sampling { prompt, max_tokens, stream, n, stop_token_ids, ignore_eos, kv_transfer_params: params } = s;
    if let Some(n) = n.filter(|&n| n != 1) {
        return Err(ApiError::bad_request(format!(
            "n = {n}: this engine serves one choice per request (n = 1); send {n} requests instead"
        )));
    }
    let prompt_token_ids = match prompt {
        Prompt::Text(t) => tokenizer.encode(&t),
        Prompt::Ids(ids) => {
            if let Some(bad) = ids.iter().find(|&&t| t >= tokenizer.vocab_size) {
                return Err(ApiError::bad_request(format!(
                    "token id {bad} is outside the vocabulary (size {})",
                    tokenizer.vocab_size
                )));
            }
            ids
        }
    };
    let request_id = request_id(headers);
    let mut kv_transfer_params = parse_params(params)?;
    if let Some(p) = kv_transfer_params.as_mut() {
        // vLLM's toy proxy names no transfer for P: it is named after P's request id.
        p.name_transfer_after(&request_id);
    }
    let role = match &kv_transfer_params {
        Some(p) => p.role().map_err(|e| ApiError::bad_request(format!("invalid kv_transfer_params: {e}")))?,
        None => TransferRole::Local,
    };
    let request = EngineRequest {
        request_id,
        prompt_token_ids,
        max_tokens: max_tokens.unwrap_or(16),
        stop_token_ids,
        ignore_eos,
        kv_transfer_params,
        traceparent: traceparent(headers),
    };
    Ok(Generation { chat, request, stream, role })
}

async fn completions(State(engines): State<Engines>, headers: HeaderMap, body: Bytes) -> Response {
    serve(engines, headers, body, false).await
}

async fn chat_completions(State(engines): State<Engines>, headers: HeaderMap, body: Bytes) -> Response {
    serve(engines, headers, body, true).await
}

/// One completion or chat request: the rank it is for, its body, then the engine. A request
/// refused on the way ([`refuse`]) still tells the engine's connector about the transfer it names.
async fn serve(engines: Engines, headers: HeaderMap, body: Bytes, chat: bool) -> Response {
    let handle = match engines.pick(&headers) {
        Ok(h) => h,
        Err(e) => return refuse(engines.first(), &headers, &body, e),
    };
    let sampling = if chat { parse_json(&body).map(chat_sampling) } else { parse_json(&body).map(completion_sampling) };
    match sampling.and_then(|s| build_generation(&handle, &headers, chat, s)) {
        Ok(g) => generate(handle, g).await,
        Err(e) => refuse(&handle, &headers, &body, e),
    }
}

fn completion_sampling(req: CompletionRequest) -> Sampling {
    Sampling {
        prompt: req.prompt,
        max_tokens: req.max_tokens,
        stream: req.sampling.stream.unwrap_or(false),
        n: req.sampling.n,
        stop_token_ids: req.sampling.stop_token_ids.unwrap_or_default(),
        ignore_eos: req.sampling.ignore_eos,
        kv_transfer_params: req.sampling.kv_transfer_params,
    }
}

fn chat_sampling(req: ChatCompletionRequest) -> Sampling {
    let text = req.messages.iter().map(ChatMessage::text).collect::<Vec<_>>().join(" ");
    Sampling {
        prompt: Prompt::Text(text),
        max_tokens: req.max_completion_tokens.or(req.max_tokens),
        stream: req.sampling.stream.unwrap_or(false),
        n: req.sampling.n,
        stop_token_ids: req.sampling.stop_token_ids.unwrap_or_default(),
        ignore_eos: req.sampling.ignore_eos,
        kv_transfer_params: req.sampling.kv_transfer_params,
    }
}

/// A request the API refuses before the engine sees it (its body does not parse, a field is
/// out of range, its rank header names no rank). If its body still carries `kv_transfer_params`
/// naming a transfer, the engine's connector hears of the refusal as the engine's own refusals
/// are heard of ([`EngineHandle::report_refused`]): a D refusing, say, `"stream": "yes"` that the
/// proxy rewrote to `false` for P tells P at once to free the blocks it holds for the transfer,
/// instead of P holding them until its send expiry.
fn refuse(handle: &EngineHandle, headers: &HeaderMap, body: &Bytes, e: ApiError) -> Response {
    if let Some(params) = transfer_params_of(body) {
        let refused = EngineRequest {
            request_id: request_id(headers),
            kv_transfer_params: Some(params),
            traceparent: traceparent(headers),
            ..EngineRequest::default()
        };
        handle.report_refused(&refused);
    }
    e.into_response()
}

/// The `kv_transfer_params` of a body the API refused, if it is a JSON object holding them in a
/// form that parses.
fn transfer_params_of(body: &[u8]) -> Option<KvTransferParams> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    KvTransferParams::from_json(value.get("kv_transfer_params")?).ok()
}

/// The response's fixed parts.
#[derive(Clone)]
struct Meta {
    id: String,
    model: String,
    created: u64,
    chat: bool,
    tokenizer: Tokenizer,
}

impl Meta {
    fn chunk(
        &self,
        token_ids: Vec<u32>,
        finish: Option<&str>,
        usage: Option<Usage>,
        params: Option<KvTransferParams>,
        full: bool,
    ) -> serde_json::Value {
        let text = self.tokenizer.decode(&token_ids);
        let finish_reason = finish.map(str::to_owned);
        let value = if self.chat {
            let content = ChatContent { role: "assistant".to_owned(), content: text };
            let (message, delta) = if full { (Some(content), None) } else { (None, Some(content)) };
            let choice =
                ChatChoice { index: 0, message, delta, token_ids, logprobs: None, finish_reason, stop_reason: None };
            let object = if full { "chat.completion" } else { "chat.completion.chunk" };
            serde_json::to_value(ChatCompletionResponse {
                id: self.id.clone(),
                object: object.to_owned(),
                created: self.created,
                model: self.model.clone(),
                choices: vec![choice],
                usage,
                kv_transfer_params: params,
            })
        } else {
            let choice =
                CompletionChoice { index: 0, text, token_ids, logprobs: None, finish_reason, stop_reason: None };
            serde_json::to_value(CompletionResponse {
                id: self.id.clone(),
                object: "text_completion".to_owned(),
                created: self.created,
                model: self.model.clone(),
                choices: vec![choice],
                usage,
                kv_transfer_params: params,
            })
        };
        value.unwrap_or(serde_json::Value::Null)
    }
}

fn failure_message(status: FinishStatus, error: Option<String>) -> String {
    error.unwrap_or_else(|| format!("the request ended with status {status:?}"))
}

async fn generate(handle: EngineHandle, g: Generation) -> Response {
    let prompt_tokens = g.request.prompt_token_ids.len();
    let prefix = if g.chat { "chatcmpl" } else { "cmpl" };
    let meta = Meta {
        id: format!("{prefix}-{}", g.request.request_id),
        model: handle.config().served_model_name.clone(),
        created: now_secs(),
        chat: g.chat,
        tokenizer: Tokenizer { vocab_size: handle.config().vocab_size },
    };
    let (request_id, transfer_id) = match &g.role {
        TransferRole::Decode { transfer_id, .. } => (Some(g.request.request_id.clone()), transfer_id.clone()),
        _ => (None, String::new()),
    };
    let mut stream = match handle.add_request(g.request).await {
        Ok(s) => s,
        Err(e) => return engine_error_response(&e),
    };
    // Step 42: D's response, from the engine's outputs to the last byte handed to the server.
    let span = match request_id {
        Some(rid) => {
            pdflow_observability::step_span!(steps::D_HTTP_RESPONSE, request_id = %rid, transfer_id = %transfer_id)
        }
        None => Span::none(),
    };
    span.record(attrs::ENGINE_ID, handle.config().engine_id.as_str());
    if g.stream {
        return stream_response(stream, meta, span);
    }
    let mut tokens = Vec::new();
    loop {
        let Some(out) = stream.next_output().await else {
            return error_response(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped before the request finished");
        };
        tokens.extend(out.new_token_ids);
        let Some(status) = out.finish else { continue };
        finish_outcome(status).record(&span);
        span.record(attrs::TOKENS, tokens.len());
        return match status {
            FinishStatus::LengthCapped | FinishStatus::Stopped => {
                let usage = Usage {
                    prompt_tokens,
                    completion_tokens: tokens.len(),
                    total_tokens: prompt_tokens + tokens.len(),
                };
                Json(meta.chunk(tokens, Some(finish_reason(status)), Some(usage), out.kv_transfer_params, true))
                    .into_response()
            }
            FinishStatus::Aborted => error_response(StatusCode::SERVICE_UNAVAILABLE, "the request was aborted"),
            FinishStatus::Error => {
                error_response(StatusCode::INTERNAL_SERVER_ERROR, failure_message(status, out.error))
            }
        };
    }
}

fn sse(value: &serde_json::Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// SSE: one `data:` chunk per output, then `data: [DONE]`. The body owns the request stream, so a
/// client disconnect (the body dropped) aborts the request.
fn stream_response(stream: RequestStream, meta: Meta, span: Span) -> Response {
    struct State {
        stream: RequestStream,
        meta: Meta,
        span: Span,
        finished: bool,
        sent: usize,
    }
    let state = State { stream, meta, span, finished: false, sent: 0 };
    let body = futures::stream::unfold(Some(state), |state| async move {
        let mut st = state?;
        if st.finished {
            return Some((Ok::<_, std::convert::Infallible>(Bytes::from_static(b"data: [DONE]\n\n")), None));
        }
        let chunk = match st.stream.next_output().await {
            None => {
                st.finished = true;
                let err = ErrorBody {
                    error: ErrorInfo {
                        message: "the engine stopped before the request finished".into(),
                        kind: "ServiceUnavailableError".into(),
                        code: 503,
                    },
                };
                serde_json::to_value(err).unwrap_or_default()
            }
            Some(out) => {
                st.sent += out.new_token_ids.len();
                match out.finish {
                    Some(FinishStatus::Error) | Some(FinishStatus::Aborted) => {
                        st.finished = true;
                        let status = out.finish.unwrap_or(FinishStatus::Error);
                        let err = ErrorBody {
                            error: ErrorInfo {
                                message: failure_message(status, out.error),
                                kind: "InternalServerError".into(),
                                code: 500,
                            },
                        };
                        serde_json::to_value(err).unwrap_or_default()
                    }
                    Some(status) => {
                        st.finished = true;
                        finish_outcome(status).record(&st.span);
                        st.span.record(attrs::TOKENS, st.sent);
                        st.meta.chunk(
                            out.new_token_ids,
                            Some(finish_reason(status)),
                            None,
                            out.kv_transfer_params,
                            false,
                        )
                    }
                    None => st.meta.chunk(out.new_token_ids, None, None, None, false),
                }
            }
        };
        Some((Ok(sse(&chunk)), Some(st)))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| error_response(StatusCode::INTERNAL_SERVER_ERROR, "could not build the response"))
}
