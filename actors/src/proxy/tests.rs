//! Proxy tests: the real actor and HTTP server against stub P, bootstrap and D servers written
//! here with axum, all over real sockets on 127.0.0.1:0.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use super::*;
use pools::check_url;

mod refusals;

const WAIT: Duration = Duration::from_secs(5);

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind stub");
    let addr = listener.local_addr().expect("stub addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Sends `cancelled` when dropped before `finish()`: a handler future dropped mid-way.
struct CancelGuard {
    tx: mpsc::UnboundedSender<&'static str>,
    finished: bool,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.tx.send("cancelled");
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Completion,
    Fail(u16),
    /// Answers after 5 s, noting if it was cancelled first.
    Slow,
    /// SSE: one event, then the rest once the test releases it.
    Sse,
    /// Fails with this status after 300 ms.
    FailLate(u16),
    /// A completion whose headers (with its length) come at once and whose body comes after 3 s.
    SlowBody,
}

struct Stub {
    name: String,
    mode: Mode,
    healthy: std::sync::atomic::AtomicBool,
    bodies: Mutex<Vec<(HeaderMap, Value)>>,
    cancelled: mpsc::UnboundedSender<&'static str>,
    release: Mutex<Option<oneshot::Receiver<()>>>,
}

struct StubHandle {
    url: String,
    state: Arc<Stub>,
    cancelled: mpsc::UnboundedReceiver<&'static str>,
}

async fn stub(name: &str, mode: Mode) -> StubHandle {
    let (tx, rx) = mpsc::unbounded_channel();
    let state = Arc::new(Stub {
        name: name.to_owned(),
        mode,
        healthy: true.into(),
        bodies: Mutex::new(Vec::new()),
        cancelled: tx,
        release: Mutex::new(None),
    });
    let app = Router::new()
        .route("/health", get(stub_health))
        .route("/v1/completions", post(stub_completion))
        .route("/v1/chat/completions", post(stub_completion))
        .with_state(state.clone());
    let addr = serve(app).await;
    StubHandle { url: format!("http://{addr}"), state, cancelled: rx }
}

async fn stub_health(State(s): State<Arc<Stub>>) -> StatusCode {
    if s.healthy.load(std::sync::atomic::Ordering::SeqCst) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn stub_completion(State(s): State<Arc<Stub>>, headers: HeaderMap, Json(body): Json<Value>) -> Response {
    s.bodies.lock().expect("lock").push((headers, body));
    let completion = json!({"choices": [{"text": format!("from {}", s.name), "finish_reason": "length"}]});
    match s.mode {
        Mode::Completion => Json(completion).into_response(),
        Mode::Fail(code) => {
            let status = StatusCode::from_u16(code).expect("status");
            (status, Json(json!({"object": "error", "message": format!("{} refused", s.name), "code": code})))
                .into_response()
        }
        Mode::Slow => {
            let mut guard = CancelGuard { tx: s.cancelled.clone(), finished: false };
            tokio::time::sleep(Duration::from_secs(5)).await;
            guard.finished = true;
            Json(completion).into_response()
        }
        Mode::FailLate(code) => {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let status = StatusCode::from_u16(code).expect("status");
            (status, Json(json!({"object": "error", "message": format!("{} failed late", s.name), "code": code})))
                .into_response()
        }
        Mode::SlowBody => {
            let bytes = Bytes::from(completion.to_string());
            let len = bytes.len();
            // Notes "cancelled" if the body is dropped before it was sent (the proxy went away).
            let guard = CancelGuard { tx: s.cancelled.clone(), finished: false };
            let body = futures::stream::once(async move {
                // The whole guard moves into the body (not just its field), so it lives as long.
                let mut guard = guard;
                tokio::time::sleep(Duration::from_secs(3)).await;
                guard.finished = true;
                Ok::<_, std::io::Error>(bytes)
            });
            Response::builder()
                .header("content-type", "application/json")
                .header("content-length", len)
                .body(Body::from_stream(body))
                .expect("response")
        }
        Mode::Sse => {
            let release = s.release.lock().expect("lock").take();
            let first = futures::stream::once(async { Ok::<_, std::io::Error>(Bytes::from("data: {\"n\":1}\n\n")) });
            let rest = futures::stream::once(async move {
                if let Some(r) = release {
                    let _ = r.await;
                }
                Ok(Bytes::from("data: {\"n\":2}\n\ndata: [DONE]\n\n"))
            });
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(first.chain(rest)))
                .expect("response")
        }
    }
}

/// A stub bootstrap answering `/query` with one engine at dp rank 0.
async fn bootstrap_stub(engine_id: &str) -> u16 {
    let table = json!({"0": {"engine_id": engine_id, "worker_addr": {"0": {"0": "tcp://127.0.0.1:1"}}}});
    let app = Router::new().route("/query", get(move || async move { Json(table) }));
    serve(app).await.port()
}

/// The Proxy actor and its HTTP server, as a node runs them (dropped at the end of a test).
struct RunningProxy {
    _actor: ActorRef<Proxy>,
    _server: ProxyServer,
}

async fn start_proxy(prefill: Vec<PrefillTarget>, decode: Vec<String>) -> (RunningProxy, String) {
    start_proxy_with(ProxyArgs::new("127.0.0.1:0".parse().expect("addr"), prefill, decode)).await
}

async fn start_proxy_with(args: ProxyArgs) -> (RunningProxy, String) {
    let args =
        ProxyArgs { health_interval: Duration::from_millis(20), upstream_timeout: Duration::from_secs(10), ..args };
    let (bind, upstream_timeout) = (args.bind, args.upstream_timeout);
    let actor = Proxy::spawn(args);
    tokio::time::timeout(WAIT, actor.wait_for_startup()).await.expect("proxy started");
    let server = ProxyServer::start(bind, actor.clone(), upstream_timeout).await.expect("server binds");
    let url = format!("http://{}", server.addr);
    (RunningProxy { _actor: actor, _server: server }, url)
}

/// Polls the proxy's `/health` until 200, for at most [`WAIT`].
async fn wait_ready(client: &reqwest::Client, base: &str) {
    let start = Instant::now();
    loop {
        let r = client.get(format!("{base}/health")).send().await.expect("proxy health");
        if r.status() == 200 {
            return;
        }
        assert!(start.elapsed() < WAIT, "proxy not ready within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A 1P1D proxy, ready.
async fn one_p_one_d(p_mode: Mode, d_mode: Mode) -> (RunningProxy, String, StubHandle, StubHandle, u16) {
    let p = stub("P", p_mode).await;
    let d = stub("D", d_mode).await;
    let bport = bootstrap_stub("6c1f").await;
    let (proxy, base) =
        start_proxy(vec![PrefillTarget { url: p.url.clone(), bootstrap_port: bport }], vec![d.url.clone()]).await;
    wait_ready(&reqwest::Client::new(), &base).await;
    (proxy, base, p, d, bport)
}

fn seed_request() -> Value {
    json!({"model": "Qwen/Qwen3-8B", "prompt": "hello", "max_tokens": 128, "temperature": 0})
}

#[tokio::test]
async fn p_and_d_bodies_follow_the_seed_and_d_answer_comes_back() {
    let (_proxy, base, p, d, bport) = one_p_one_d(Mode::Completion, Mode::Completion).await;
    let client = reqwest::Client::new();
    let resp = client.post(format!("{base}/v1/completions")).json(&seed_request()).send().await.expect("request");
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"].to_str().expect("ct").starts_with("application/json"));
    let body: Value = resp.json().await.expect("json");
    assert_eq!(body["choices"][0]["text"], "from D");

    let (p_headers, p_body) = p.state.bodies.lock().expect("lock")[0].clone();
    assert_eq!(p_body["max_tokens"], 1);
    assert_eq!(p_body["stream"], false);
    assert_eq!(p_body["prompt"], "hello");
    let p_params = &p_body["kv_transfer_params"];
    assert_eq!(p_params["do_remote_decode"], true);
    assert_eq!(p_params["do_remote_prefill"], false);
    let request_id = p_headers["x-request-id"].to_str().expect("request id").to_owned();
    assert_eq!(p_params["transfer_id"], format!("xfer-{request_id}"));
    assert_eq!(p_headers["x-data-parallel-rank"], "0");
    assert!(p_headers.contains_key("traceparent"));

    // P's request may still be in flight when D answered: D's body is recorded before it answers.
    let (d_headers, d_body) = d.state.bodies.lock().expect("lock")[0].clone();
    assert_eq!(d_body["max_tokens"], 128);
    let d_params = &d_body["kv_transfer_params"];
    assert_eq!(d_params["do_remote_prefill"], true);
    assert_eq!(d_params["do_remote_decode"], false);
    assert_eq!(d_params["remote_engine_id"], "6c1f");
    assert_eq!(d_params["remote_bootstrap_addr"], format!("http://127.0.0.1:{bport}"));
    assert_eq!(d_params["transfer_id"], p_params["transfer_id"]);
    assert_eq!(d_headers["x-request-id"], request_id.as_str());
    assert_eq!(d_headers["traceparent"], p_headers["traceparent"]);
}

#[tokio::test]
async fn chat_prefill_caps_max_completion_tokens_and_drops_stream_options() {
    let (_proxy, base, p, _d, _) = one_p_one_d(Mode::Completion, Mode::Completion).await;
    let req = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50,
        "stream": true, "stream_options": {"include_usage": true}});
    let resp =
        reqwest::Client::new().post(format!("{base}/v1/chat/completions")).json(&req).send().await.expect("request");
    assert_eq!(resp.status(), 200);
    let p_body = p.state.bodies.lock().expect("lock")[0].1.clone();
    assert_eq!(p_body["max_completion_tokens"], 1);
    assert_eq!(p_body["max_tokens"], 1);
    assert_eq!(p_body["stream"], false);
    assert!(p_body.get("stream_options").is_none());
}

/// `least_loaded` P: a P's prefill leaves its load when P answers, not when the request ends.
/// A long prompt's request goes to P0 and stays open on D (streaming); a short one goes to P1 and
/// ends. The next one goes to P0 again: it answered, so it is as idle as P1, and its turn comes
/// first. Counted until the request ended, P0 would still carry the long prompt and lose to P1.
#[tokio::test]
async fn a_p_that_answered_takes_new_requests_while_its_request_still_decodes() {
    let (p0, p1) = (stub("P0", Mode::Completion).await, stub("P1", Mode::Completion).await);
    let d = stub("D", Mode::Sse).await;
    let (release, released) = oneshot::channel();
    *d.state.release.lock().expect("lock") = Some(released);
    let (b0, b1) = (bootstrap_stub("engine-0").await, bootstrap_stub("engine-1").await);
    let args = ProxyArgs {
        prefill_policy: crate::proxy::routing::Policy::LeastLoaded,
        ..ProxyArgs::new(
            "127.0.0.1:0".parse().expect("addr"),
            vec![
                PrefillTarget { url: p0.url.clone(), bootstrap_port: b0 },
                PrefillTarget { url: p1.url.clone(), bootstrap_port: b1 },
            ],
            vec![d.url.clone()],
        )
    };
    let (_proxy, base) = start_proxy_with(args).await;
    let client = reqwest::Client::new();
    wait_ready(&client, &base).await;
    let count = |s: &StubHandle| s.state.bodies.lock().expect("lock").len();

    let mut long = seed_request();
    long["prompt"] = "a long prompt ".repeat(400).into();
    long["stream"] = true.into();
    let resp = client.post(format!("{base}/v1/completions")).json(&long).send().await.expect("request");
    let mut stream = resp.bytes_stream();
    tokio::time::timeout(WAIT, stream.next()).await.expect("D's first chunk").expect("chunk").expect("ok");
    assert_eq!((count(&p0), count(&p1)), (1, 0), "the long prompt went to P0");
    // P0 answered at once; its answer's release reaches the actor right after.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for expected in [(1, 1), (2, 1)] {
        let resp = client.post(format!("{base}/v1/completions")).json(&seed_request()).send().await.expect("request");
        assert_eq!(resp.status(), 200);
        resp.bytes().await.expect("the whole answer");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!((count(&p0), count(&p1)), expected, "while the long prompt still decodes on D");
    }
    release.send(()).expect("D still streaming the long prompt");
    while let Some(chunk) = tokio::time::timeout(WAIT, stream.next()).await.expect("the rest in time") {
        chunk.expect("chunk");
    }
}

#[tokio::test]
async fn sse_is_streamed_chunk_by_chunk() {
    let p = stub("P", Mode::Completion).await;
    let d = stub("D", Mode::Sse).await;
    let (release, released) = oneshot::channel();
    *d.state.release.lock().expect("lock") = Some(released);
    let bport = bootstrap_stub("e1").await;
    let (_proxy, base) =
        start_proxy(vec![PrefillTarget { url: p.url.clone(), bootstrap_port: bport }], vec![d.url.clone()]).await;
    let client = reqwest::Client::new();
    wait_ready(&client, &base).await;

    let mut req = seed_request();
    req["stream"] = true.into();
    let resp = client.post(format!("{base}/v1/completions")).json(&req).send().await.expect("request");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut stream = resp.bytes_stream();
    let first = tokio::time::timeout(WAIT, stream.next())
        .await
        .expect("first chunk before D finished")
        .expect("chunk")
        .expect("ok");
    assert_eq!(&first[..], b"data: {\"n\":1}\n\n");
    release.send(()).expect("D still streaming");
    let mut rest = Vec::new();
    while let Some(chunk) = tokio::time::timeout(WAIT, stream.next()).await.expect("rest in time") {
        rest.extend_from_slice(&chunk.expect("chunk"));
    }
    assert_eq!(rest, b"data: {\"n\":2}\n\ndata: [DONE]\n\n");
    assert_eq!(d.state.bodies.lock().expect("lock")[0].1["stream"], true, "D keeps the client's stream flag");
}

#[tokio::test]
async fn answers_503_until_every_p_and_d_is_ready() {
    let p = stub("P", Mode::Completion).await;
    let d = stub("D", Mode::Completion).await;
    d.state.healthy.store(false, std::sync::atomic::Ordering::SeqCst);
    let bport = bootstrap_stub("e1").await;
    let (_proxy, base) =
        start_proxy(vec![PrefillTarget { url: p.url.clone(), bootstrap_port: bport }], vec![d.url.clone()]).await;
    let client = reqwest::Client::new();
    let health = client.get(format!("{base}/health")).send().await.expect("health");
    assert_eq!(health.status(), 503);
    let resp = client.post(format!("{base}/v1/completions")).json(&seed_request()).send().await.expect("request");
    assert_eq!(resp.status(), 503);
    let body: Value = resp.json().await.expect("json error");
    assert!(body["error"]["message"].as_str().expect("message").contains("not ready"), "{body}");
    assert!(p.state.bodies.lock().expect("lock").is_empty() && d.state.bodies.lock().expect("lock").is_empty());

    d.state.healthy.store(true, std::sync::atomic::Ordering::SeqCst);
    wait_ready(&client, &base).await;
    let resp = client.post(format!("{base}/v1/completions")).json(&seed_request()).send().await.expect("request");
    assert_eq!(resp.status(), 200);
}

#[tokio::test]
async fn round_robin_over_two_p_and_two_d() {
    let (p0, p1) = (stub("P0", Mode::Completion).await, stub("P1", Mode::Completion).await);
    let (d0, d1) = (stub("D0", Mode::Completion).await, stub("D1", Mode::Completion).await);
    let (b0, b1) = (bootstrap_stub("engine-0").await, bootstrap_stub("engine-1").await);
    let (_proxy, base) = start_proxy(
        vec![
            PrefillTarget { url: p0.url.clone(), bootstrap_port: b0 },
            PrefillTarget { url: p1.url.clone(), bootstrap_port: b1 },
        ],
        vec![d0.url.clone(), d1.url.clone()],
    )
    .await;
    let client = reqwest::Client::new();
    wait_ready(&client, &base).await;
    for _ in 0..4 {
        let resp = client.post(format!("{base}/v1/completions")).json(&seed_request()).send().await.expect("request");
        assert_eq!(resp.status(), 200);
    }
    for s in [&p0, &p1, &d0, &d1] {
        assert_eq!(s.state.bodies.lock().expect("lock").len(), 2, "{} gets every other request", s.state.name);
    }
    // Each D request names the engine id and bootstrap of the same P.
    for d in [&d0, &d1] {
        for (_, body) in d.state.bodies.lock().expect("lock").iter() {
            let params = &body["kv_transfer_params"];
            let expected = if params["remote_engine_id"] == "engine-0" { b0 } else { b1 };
            assert_eq!(params["remote_bootstrap_addr"], format!("http://127.0.0.1:{expected}"));
        }
    }
}

/// Sends the seed request through the proxy at `base` and checks the answer is a 502 upstream
/// error naming `reason`, well before D's slow answer would have come.
async fn assert_clean_502_at_once(base: &str, reason: &str) {
    let started = Instant::now();
    let resp = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&seed_request())
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status(), 502);
    let body: Value = resp.json().await.expect("a JSON error body");
    assert!(started.elapsed() < Duration::from_secs(2), "the client waited for D: {:?}", started.elapsed());
    assert_eq!(body["error"]["type"], "upstream_error");
    assert!(body["error"]["message"].as_str().expect("message").contains(reason), "{body}");
}

/// D's stub noted its request (or its answer's body) dropped before it was done.
async fn assert_d_cancelled(d: &mut StubHandle) {
    let seen = tokio::time::timeout(Duration::from_secs(3), d.cancelled.recv()).await;
    assert_eq!(seen.expect("D saw its request cancelled before it answered"), Some("cancelled"));
}

#[tokio::test]
async fn failed_prefill_cancels_decode_and_answers_at_once() {
    let (_proxy, base, _p, mut d, _) = one_p_one_d(Mode::Fail(500), Mode::Slow).await;
    assert_clean_502_at_once(&base, "P refused").await;
    assert_d_cancelled(&mut d).await;
}

/// A non-streamed answer of known length reaches the client whole, with its length (one read,
/// no chunked framing).
#[tokio::test]
async fn a_non_streamed_answer_is_relayed_whole_with_its_length() {
    let (_proxy, base, _p, _d, _) = one_p_one_d(Mode::Completion, Mode::Completion).await;
    let resp = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&seed_request())
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().get("transfer-encoding").is_none(), "chunked: {:?}", resp.headers());
    let len: usize = resp.headers()["content-length"].to_str().expect("length").parse().expect("a number");
    let body = resp.bytes().await.expect("body");
    assert_eq!(body.len(), len);
    assert_eq!(serde_json::from_slice::<Value>(&body).expect("json")["choices"][0]["text"], "from D");
}

/// P fails after D's headers came but before its body did: the client gets a clean 502 with
/// P's reason at once (not a cut body after D's 3 s), and D's request is dropped.
#[tokio::test]
async fn a_prefill_failing_while_d_s_body_is_on_its_way_is_a_clean_502() {
    let (_proxy, base, _p, mut d, _) = one_p_one_d(Mode::FailLate(500), Mode::SlowBody).await;
    assert_clean_502_at_once(&base, "P failed late").await;
    assert_d_cancelled(&mut d).await;
}

#[tokio::test]
async fn prefill_4xx_is_passed_on_with_its_message() {
    let (_proxy, base, _p, _d, _) = one_p_one_d(Mode::Fail(400), Mode::Slow).await;
    let resp = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&seed_request())
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status(), 400);
    let body: Value = resp.json().await.expect("json error");
    assert!(body["error"]["message"].as_str().expect("message").contains("P refused"), "{body}");
}

#[tokio::test]
async fn client_going_away_cancels_both_upstream_calls() {
    let (_proxy, base, mut p, mut d, _) = one_p_one_d(Mode::Slow, Mode::Slow).await;
    let client = reqwest::Client::new();
    let gave_up = client
        .post(format!("{base}/v1/completions"))
        .json(&seed_request())
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(gave_up.is_err(), "the client gave up before any answer");
    for (who, s) in [("P", &mut p), ("D", &mut d)] {
        let seen = tokio::time::timeout(Duration::from_secs(3), s.cancelled.recv()).await;
        assert_eq!(seen.unwrap_or_else(|_| panic!("{who} never saw the cancellation")), Some("cancelled"));
    }
}

#[tokio::test]
async fn malformed_client_json_is_400_and_the_proxy_keeps_serving() {
    let (_proxy, base, p, _d, _) = one_p_one_d(Mode::Completion, Mode::Completion).await;
    let client = reqwest::Client::new();
    for garbage in ["{not json", "[1, 2]"] {
        let resp = client
            .post(format!("{base}/v1/completions"))
            .header("content-type", "application/json")
            .body(garbage)
            .send()
            .await
            .expect("request");
        assert_eq!(resp.status(), 400);
        let body: Value = resp.json().await.expect("json error");
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }
    assert!(p.state.bodies.lock().expect("lock").is_empty());
    let resp = client.post(format!("{base}/v1/completions")).json(&seed_request()).send().await.expect("request");
    assert_eq!(resp.status(), 200);
}

/// A body over the proxy's limit (the engines' 2 MiB) is a 413 that names the limit, reaches
/// neither P nor D, and the proxy keeps serving.
#[tokio::test]
async fn a_body_over_the_limit_is_413_naming_it() {
    let (_proxy, base, p, d, _) = one_p_one_d(Mode::Completion, Mode::Completion).await;
    let client = reqwest::Client::new();
    let prompt = "x".repeat(3 * 1024 * 1024);
    let resp = client
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "m", "prompt": prompt, "max_tokens": 1}))
        .send()
        .await
        .expect("an answer, not a broken connection");
    assert_eq!(resp.status(), 413);
    assert!(resp.headers().contains_key("x-request-id"));
    let body: Value = resp.json().await.expect("json error");
    let message = body["error"]["message"].as_str().expect("message");
    assert!(message.contains(&flow::MAX_BODY_BYTES.to_string()) && message.contains("2 MiB"), "{message}");
    assert!(p.state.bodies.lock().expect("lock").is_empty() && d.state.bodies.lock().expect("lock").is_empty());
    let resp = client.post(format!("{base}/v1/completions")).json(&seed_request()).send().await.expect("request");
    assert_eq!(resp.status(), 200);
}

#[tokio::test]
async fn ready_timeout_stops_the_proxy_with_the_reason() {
    let d = stub("D", Mode::Completion).await;
    let proxy = Proxy::spawn(ProxyArgs {
        health_interval: Duration::from_millis(20),
        upstream_timeout: Duration::from_secs(1),
        ready_timeout: Some(Duration::from_millis(100)),
        ..ProxyArgs::new(
            "127.0.0.1:0".parse().expect("addr"),
            // Nothing listens on port 1: P never answers.
            vec![PrefillTarget { url: "http://127.0.0.1:1".into(), bootstrap_port: 1 }],
            vec![d.url.clone()],
        )
    });
    tokio::time::timeout(WAIT, proxy.wait_for_shutdown()).await.expect("the proxy stops after its ready timeout");
}

#[tokio::test]
async fn a_client_request_id_is_adopted_with_a_suffix_and_echoed_and_a_bad_one_replaced() {
    let (_proxy, base, p, _d, _) = one_p_one_d(Mode::Completion, Mode::Completion).await;
    let client = reqwest::Client::new();
    let post = |id: Option<&str>| {
        let mut req = client.post(format!("{base}/v1/completions")).json(&seed_request());
        if let Some(id) = id {
            req = req.header("x-request-id", id);
        }
        req.send()
    };
    let echoed = |resp: &reqwest::Response| {
        resp.headers().get("x-request-id").expect("x-request-id echoed").to_str().expect("ascii").to_owned()
    };

    let resp = post(Some("load-00042")).await.expect("request");
    assert_eq!(resp.status(), 200);
    let id = echoed(&resp);
    let suffix = id.strip_prefix("load-00042-").unwrap_or_else(|| panic!("client id kept as prefix: {id}"));
    assert!(suffix.len() == 8 && suffix.bytes().all(|b| b.is_ascii_hexdigit()), "8 hex of a fresh uuid: {id}");
    let p_headers = p.state.bodies.lock().expect("lock")[0].0.clone();
    assert_eq!(p_headers["x-request-id"], id.as_str(), "P sees the flow's id");
    assert_eq!(p.state.bodies.lock().expect("lock")[0].1["kv_transfer_params"]["transfer_id"], format!("xfer-{id}"));

    let again = echoed(&post(Some("load-00042")).await.expect("request"));
    assert!(again.starts_with("load-00042-") && again != id, "a reused client id still gives a unique id: {again}");

    for bad in ["has space", "semi;colon", &"x".repeat(65)] {
        let id = echoed(&post(Some(bad)).await.expect("request"));
        assert!(uuid::Uuid::parse_str(&id).is_ok() && !id.contains(bad), "{bad:?} replaced by a uuid: {id}");
    }
    let id = echoed(&post(None).await.expect("request"));
    assert!(uuid::Uuid::parse_str(&id).is_ok(), "no header: a fresh uuid: {id}");
}

#[tokio::test]
async fn an_error_answer_carries_the_request_id_too() {
    let (_proxy, base, _p, _d, _) = one_p_one_d(Mode::Fail(500), Mode::Slow).await;
    let resp = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .header("x-request-id", "err.1")
        .json(&seed_request())
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status(), 502);
    let id = resp.headers().get("x-request-id").expect("echoed on errors").to_str().expect("ascii");
    assert!(id.starts_with("err.1-"), "{id}");
}

#[test]
fn pool_urls_that_are_not_http_host_port_are_refused_with_what_to_give() {
    let err = check_url("not a url", "decode").expect_err("refused");
    assert!(matches!(err, ActorError::InvalidUrl { pool: "decode", .. }), "{err:?}");
    assert!(err.to_string().contains("(expected http://host:port)"), "{err}");
    let err = check_url("https://p:8000", "prefill").expect_err("refused");
    assert!(matches!(err, ActorError::UnsupportedUrl { pool: "prefill", .. }), "{err:?}");
    let (url, host) = check_url("http://[::1]:8000/", "prefill").expect("accepted");
    assert_eq!((url.as_str(), host.as_str()), ("http://[::1]:8000", "[::1]"));
}
