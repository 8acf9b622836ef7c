//! A streaming request through the proxy: D's server-sent events come back as they are produced,
//! with D's content type, and carry exactly the single-engine tokens — in one process and as
//! separate processes.

use futures::StreamExt;
use pdflow_tests::processes::ProcCluster;
use pdflow_tests::{completion, prompt, reference_tokens, Cluster, ClusterSpec, Endpoints, SMALL};

async fn scenario(e: &Endpoints) {
    let mut body = completion(&prompt(180, 3), 20);
    body["stream"] = serde_json::json!(true);
    let resp = e.client.post(format!("{}/v1/completions", e.proxy)).json(&body).send().await.expect("request");
    assert_eq!(resp.status(), 200);
    let content_type = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    assert!(content_type.starts_with("text/event-stream"), "content-type {content_type}");
    let mut text = String::new();
    let mut stream = resp.bytes_stream();
    let mut chunks = 0;
    while let Some(chunk) = stream.next().await {
        text.push_str(&String::from_utf8_lossy(&chunk.expect("chunk")));
        chunks += 1;
    }
    let mut tokens = Vec::new();
    let mut done = false;
    for line in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line.trim() == "[DONE]" {
            done = true;
            continue;
        }
        let event: serde_json::Value = serde_json::from_str(line).expect("each event is JSON");
        if let Some(ids) = event["choices"][0]["token_ids"].as_array() {
            tokens.extend(ids.iter().filter_map(|t| t.as_u64()));
        }
    }
    assert!(done, "the stream ends with [DONE]");
    assert!(chunks > 1, "the response came as a stream of chunks, not one body");
    body["stream"] = serde_json::json!(false);
    assert_eq!(tokens, reference_tokens(SMALL, &body).await);
    e.assert_blocks_at_baseline().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streaming_completion_in_one_process() {
    let cluster = Cluster::start(ClusterSpec::one_p_one_d()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_completion_as_processes() {
    let cluster = ProcCluster::start(ClusterSpec::one_p_one_d()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}
