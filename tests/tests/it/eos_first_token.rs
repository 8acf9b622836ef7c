//! P's first token is a stop token (seed note after step 23): P's request ends FINISHED_STOPPED,
//! not length-capped. vLLM's connector then never sends the KV and D waits for its deadline;
//! pdflow sends it — the prompt's KV is valid either way — so D answers at once, correctly.
//! Runs in one process and as separate processes.

use std::time::Duration;

use pdflow_tests::processes::ProcCluster;
use pdflow_tests::{completion, prompt, reference_tokens, token_ids, Cluster, ClusterSpec, Endpoints, SMALL};

// The cluster's D runs kv_load_failure_policy=fail: the answer below must come from P's KV, not
// from a local recompute. Transfer deadlines are 20 s and more.
async fn scenario(e: &Endpoints) {
    let text = prompt(250, 11);
    let first = reference_tokens(SMALL, &completion(&text, 4)).await[0];
    let mut body = completion(&text, 16);
    body["stop_token_ids"] = serde_json::json!([first]);
    // Far below every transfer deadline: a D that waited for one would fail this bound.
    let (status, response) = tokio::time::timeout(Duration::from_secs(10), e.post("/v1/completions", &body))
        .await
        .expect("D answered without waiting for a transfer deadline")
        .expect("request");
    assert_eq!(status, 200, "{response}");
    assert_eq!(response["choices"][0]["finish_reason"], "stop");
    assert_eq!(token_ids(&response), vec![first]);
    e.assert_blocks_at_baseline().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn first_token_stop_still_sends_kv_in_one_process() {
    let cluster = Cluster::start(ClusterSpec::one_p_one_d()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_token_stop_still_sends_kv_as_processes() {
    let cluster = ProcCluster::start(ClusterSpec::one_p_one_d()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}
