//! P's first token is a stop token (seed note after step 23): P's request ends FINISHED_STOPPED,
//! not length-capped. vLLM's connector then never sends the KV and D waits for its deadline;
//! pdflow sends it — the prompt's KV is valid either way — so D answers at once, correctly.

use std::time::Duration;

use pdflow_runtime::engine::LoadFailurePolicy;
use pdflow_tests::{completion, prompt, reference_tokens, token_ids, Cluster, ClusterSpec, EngineOpts, SMALL};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn first_token_stop_still_sends_kv_and_d_does_not_wait() {
    let mut spec = ClusterSpec::one_p_one_d(); // deadlines of 20 s and more
    // D fails rather than recomputes when the KV does not come: the answer below must be P's KV.
    spec.decode = vec![EngineOpts { policy: LoadFailurePolicy::Fail, ..EngineOpts::default() }];
    let cluster = Cluster::start(spec).await.expect("cluster starts");
    let text = prompt(250, 11);
    let first = reference_tokens(SMALL, &completion(&text, 4)).await[0];
    let mut body = completion(&text, 16);
    body["stop_token_ids"] = serde_json::json!([first]);
    // Far below every transfer deadline: a D that waited for one would fail this bound.
    let (status, response) = tokio::time::timeout(Duration::from_secs(10), cluster.post("/v1/completions", &body))
        .await
        .expect("D answered without waiting for a transfer deadline")
        .expect("request");
    assert_eq!(status, 200, "{response}");
    assert_eq!(response["choices"][0]["finish_reason"], "stop");
    assert_eq!(token_ids(&response), vec![first]);
    cluster.assert_blocks_at_baseline().await;
    cluster.shutdown().await;
}
