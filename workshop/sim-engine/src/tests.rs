//! In-process tests of the engine without a connector, and of its HTTP API over a real socket.

use std::sync::Arc;
use std::time::Duration;

use pdflow_messages::scheduler_connector::FinishStatus;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;
use pdflow_kv::memory::{KvCache, KvShape};

pub(crate) const SMALL: KvShape =
    KvShape { num_layers: 2, num_kv_heads: 2, head_dim: 8, dtype_bytes: 2, block_size: 4 };
pub(crate) const DEADLINE: Duration = Duration::from_secs(20);

pub(crate) fn small_config(num_blocks: usize, budget: usize) -> EngineConfig {
    EngineConfig {
        shape: SMALL,
        num_blocks,
        max_num_batched_tokens: budget,
        max_model_len: 256,
        vocab_size: 1000,
        ..EngineConfig::default()
    }
}

pub(crate) fn start(config: EngineConfig, connector: Option<pdflow_connector::Connector>) -> EngineHandle {
    let cache = KvCache::new(config.shape, config.num_blocks);
    Engine::start(config, cache, connector)
}

pub(crate) fn request(id: &str, prompt: Vec<u32>, max_tokens: usize) -> EngineRequest {
    EngineRequest { request_id: id.into(), prompt_token_ids: prompt, max_tokens, ..Default::default() }
}

/// Runs a request to its end: (tokens, finish status, error).
pub(crate) async fn run(handle: &EngineHandle, req: EngineRequest) -> (Vec<u32>, FinishStatus, Option<String>) {
    let mut stream = handle.add_request(req).await.expect("accepted");
    let mut tokens = Vec::new();
    loop {
        let out =
            tokio::time::timeout(DEADLINE, stream.next_output()).await.expect("output in time").expect("not stopped");
        tokens.extend(out.new_token_ids);
        if let Some(status) = out.finish {
            return (tokens, status, out.error);
        }
    }
}

pub(crate) fn prompt(n: u32) -> Vec<u32> {
    (0..n).map(|i| (i * 37 + 11) % 1000).collect()
}

/// Waits (bounded) until the engine's block stats equal `want` (the `finished` counter aside).
pub(crate) async fn wait_stats(handle: &EngineHandle, want: BlockStats) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let blocks = |s: BlockStats| (s.total, s.free, s.requests);
    while blocks(handle.block_stats()) != blocks(want) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "block stats {:?} never reached {want:?}",
            handle.block_stats()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn baseline(handle: &EngineHandle) -> BlockStats {
    let c = handle.config();
    BlockStats {
        total: c.num_blocks,
        free: c.num_blocks,
        requests: 0,
        finished: handle.block_stats().finished,
        ..BlockStats::default()
    }
}

#[tokio::test]
async fn runs_to_max_tokens_and_frees_every_block() {
    let engine = start(small_config(32, 8192), None);
    let (tokens, status, _) = run(&engine, request("a", prompt(10), 7)).await;
    assert_eq!((tokens.len(), status), (7, FinishStatus::LengthCapped));
    assert_eq!(engine.block_stats(), baseline(&engine));
    // Deterministic: the same prompt gives the same tokens.
    assert_eq!(run(&engine, request("b", prompt(10), 7)).await.0, tokens);
    engine.shutdown().await;
}

#[tokio::test]
async fn stop_is_checked_before_length() {
    let engine = start(small_config(32, 8192), None);
    let (tokens, _, _) = run(&engine, request("ref", prompt(9), 4)).await;
    let mut stop = request("stop", prompt(9), 1);
    stop.stop_token_ids = vec![tokens[0]];
    assert_eq!(run(&engine, stop).await, (vec![tokens[0]], FinishStatus::Stopped, None));
    let mut eos = request("eos", prompt(9), 4);
    eos.stop_token_ids = vec![tokens[2]];
    assert_eq!(run(&engine, eos).await.1, FinishStatus::Stopped);
    // EOS: an engine whose eos is the third token stops there, unless ignore_eos.
    let mut config = small_config(32, 8192);
    config.eos_token_id = tokens[2];
    let eos_engine = start(config, None);
    assert_eq!(run(&eos_engine, request("e", prompt(9), 4)).await, (tokens[..3].to_vec(), FinishStatus::Stopped, None));
    let mut ignore = request("i", prompt(9), 4);
    ignore.ignore_eos = true;
    assert_eq!(run(&eos_engine, ignore).await, (tokens.clone(), FinishStatus::LengthCapped, None));
    assert_eq!(engine.block_stats(), baseline(&engine));
    assert_eq!(eos_engine.block_stats(), baseline(&eos_engine));
}

#[tokio::test]
async fn chunked_prefill_gives_the_same_tokens() {
    let whole = start(small_config(32, 8192), None);
    let chunked = start(small_config(32, 5), None);
    let a = run(&whole, request("a", prompt(23), 6)).await;
    let (b, c) = tokio::join!(run(&chunked, request("b", prompt(23), 6)), run(&chunked, request("c", prompt(23), 6)));
    assert_eq!(a, b);
    assert_eq!(a, c);
    assert_eq!(chunked.block_stats(), baseline(&chunked));
}

#[tokio::test]
async fn abort_and_dropped_streams_free_their_blocks() {
    let engine = start(small_config(64, 8192), None);
    let mut stream = engine.add_request(request("long", prompt(10), 200)).await.expect("accepted");
    let first = tokio::time::timeout(DEADLINE, stream.next_output()).await.expect("in time").expect("output");
    assert!(first.finish.is_none());
    engine.abort("long");
    let mut last = first;
    while last.finish.is_none() {
        last = tokio::time::timeout(DEADLINE, stream.next_output()).await.expect("in time").expect("output");
    }
    assert_eq!(last.finish, Some(FinishStatus::Aborted));
    wait_stats(&engine, baseline(&engine)).await;
    let dropped = engine.add_request(request("dropped", prompt(10), 200)).await.expect("accepted");
    drop(dropped);
    wait_stats(&engine, baseline(&engine)).await;
}

#[tokio::test]
async fn bad_requests_get_typed_errors() {
    let engine = start(small_config(8, 8192), None);
    let err = |r| async { engine.add_request(r).await.expect_err("refused") };
    assert_eq!(err(request("e", vec![], 4)).await, EngineError::EmptyPrompt);
    assert!(matches!(err(request("l", prompt(250), 10)).await, EngineError::TooLong { .. }));
    assert!(matches!(err(request("b", prompt(40), 4)).await, EngineError::TooManyBlocks { .. }));
    let mut d = request("d", prompt(4), 4);
    d.kv_transfer_params =
        Some(pdflow_messages::kv_transfer_params::KvTransferParams::for_decode("x", "http://b", "e"));
    assert!(matches!(err(d).await, EngineError::NoConnector { .. }));
    let mut bad = request("bad", prompt(4), 4);
    bad.kv_transfer_params = Some(pdflow_messages::kv_transfer_params::KvTransferParams {
        do_remote_decode: true,
        do_remote_prefill: true,
        ..Default::default()
    });
    assert!(matches!(err(bad).await, EngineError::InvalidKvTransferParams(_)));
}

// ---- HTTP over a real socket ----

pub(crate) async fn serve(handle: EngineHandle) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, api::router(handle)).await;
    });
    addr.to_string()
}

/// A minimal HTTP/1.1 client: (status, headers, body).
pub(crate) async fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String, String) {
    let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nX-Request-Id: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        uuid::Uuid::new_v4(),
        body.len()
    );
    sock.write_all(req.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    tokio::time::timeout(DEADLINE, sock.read_to_end(&mut raw)).await.expect("response in time").expect("read");
    let raw = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = raw.split_once("\r\n\r\n").expect("http response");
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).expect("status");
    let body =
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(rest) } else { rest.to_owned() };
    (status, head.to_owned(), body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((len, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

#[tokio::test]
async fn http_completions_json_stream_and_chat() {
    let engine = start(small_config(64, 8192), None);
    let addr = serve(engine.clone()).await;
    assert_eq!(http(&addr, "GET", "/health", "").await.0, 200);
    let (s, _, models) = http(&addr, "GET", "/v1/models", "").await;
    assert!(s == 200 && models.contains("Qwen/Qwen3-8B"));
    let (s, _, body) =
        http(&addr, "POST", "/v1/completions", r#"{"model":"Qwen/Qwen3-8B","prompt":"w1 w2 hello w3","max_tokens":5}"#)
            .await;
    assert_eq!(s, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    assert!(v["kv_transfer_params"].is_null());
    let ids: Vec<u32> = serde_json::from_value(v["choices"][0]["token_ids"].clone()).expect("ids");
    let text = v["choices"][0]["text"].as_str().expect("text").to_owned();
    assert_eq!(model::Tokenizer { vocab_size: 1000 }.encode(&text), ids);

    let (s, head, sse) =
        http(&addr, "POST", "/v1/completions", r#"{"prompt":"w1 w2 hello w3","max_tokens":5,"stream":true}"#).await;
    assert_eq!(s, 200);
    assert!(head.to_ascii_lowercase().contains("text/event-stream"));
    let events: Vec<&str> = sse.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"));
    let mut streamed = Vec::new();
    let mut text_streamed = String::new();
    for e in &events[..events.len() - 1] {
        let c: serde_json::Value = serde_json::from_str(e.strip_prefix("data: ").expect("data")).expect("chunk");
        streamed.extend(serde_json::from_value::<Vec<u32>>(c["choices"][0]["token_ids"].clone()).expect("ids"));
        text_streamed.push_str(c["choices"][0]["text"].as_str().expect("text"));
    }
    assert_eq!((streamed, text_streamed), (ids.clone(), text));
    assert!(events[events.len() - 2].contains("\"finish_reason\":\"length\""));

    let (s, _, chat) = http(&addr, "POST", "/v1/chat/completions", r#"{"messages":[{"role":"user","content":"w1 w2"},{"role":"user","content":"hello w3"}],"max_completion_tokens":5}"#).await;
    assert_eq!(s, 200, "{chat}");
    let c: serde_json::Value = serde_json::from_str(&chat).expect("json");
    assert_eq!(c["object"], "chat.completion");
    assert_eq!(c["choices"][0]["message"]["role"], "assistant");
    assert_eq!(serde_json::from_value::<Vec<u32>>(c["choices"][0]["token_ids"].clone()).expect("ids"), ids);
    let (s, _, chunks) = http(
        &addr,
        "POST",
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"w1"}],"max_tokens":3,"stream":true}"#,
    )
    .await;
    assert!(
        s == 200
            && chunks.contains("chat.completion.chunk")
            && chunks.contains("\"delta\"")
            && chunks.ends_with("data: [DONE]\n\n")
    );

    let (s, _, blocks) = http(&addr, "GET", "/pdflow/blocks", "").await;
    assert_eq!(s, 200);
    assert_eq!(serde_json::from_str::<BlockStats>(&blocks).expect("stats"), baseline(&engine));
}

#[tokio::test]
async fn http_bad_input_is_400_with_vllm_error_json() {
    let engine = start(small_config(16, 8192), None);
    let addr = serve(engine.clone()).await;
    for body in [
        "{not json",
        r#"{"prompt":"w1","max_tokens":1000}"#,
        r#"{"prompt":"w1","kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":true}}"#,
        r#"{"prompt":"w1","kv_transfer_params":{"do_remote_prefill":true,"transfer_id":"x"}}"#,
        r#"{"prompt":""}"#,
        r#"{"prompt":[1,2,99999]}"#,
    ] {
        let (s, _, resp) = http(&addr, "POST", "/v1/completions", body).await;
        assert_eq!(s, 400, "{body} → {resp}");
        let v: serde_json::Value = serde_json::from_str(&resp).expect("error json");
        assert_eq!(v["error"]["type"], "BadRequestError");
        assert_eq!(v["error"]["code"], 400);
        assert!(!v["error"]["message"].as_str().unwrap_or("").is_empty());
    }
    assert_eq!(engine.block_stats(), baseline(&engine));
}

#[tokio::test]
async fn engine_handle_drop_stops_the_loop() {
    let engine = start(small_config(8, 8192), None);
    let running = Arc::new(engine.clone());
    assert!(tokio::time::timeout(DEADLINE, async {
        while !running.is_running() {
            tokio::task::yield_now().await;
        }
    })
    .await
    .is_ok());
    engine.shutdown().await;
    assert!(!engine.is_running());
    assert_eq!(engine.add_request(request("x", prompt(3), 2)).await.expect_err("stopped"), EngineError::EngineStopped);
}
