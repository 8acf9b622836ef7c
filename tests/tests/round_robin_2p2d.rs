//! 2P2D: the proxy round-robins over both prefill and both decode engines (each P with its own
//! bootstrap, as vLLM's P TP0 launches one), and every request is still correct.

use pdflow_observability::attrs;
use pdflow_tests::{capture, completion, prompt, reference_tokens, token_ids, Cluster, ClusterSpec, EngineOpts, SMALL};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_p_two_d_round_robin() {
    let capture = capture();
    let mut spec = ClusterSpec::one_p_one_d();
    spec.prefill = vec![EngineOpts::default(), EngineOpts::default()];
    spec.decode = vec![EngineOpts::default(), EngineOpts::default()];
    let cluster = Cluster::start(spec).await.expect("cluster starts");
    for i in 0..4u64 {
        let body = completion(&prompt(150, 100 + i), 8);
        let (status, response) = cluster.post("/v1/completions", &body).await.expect("request");
        assert_eq!(status, 200, "{response}");
        assert_eq!(token_ids(&response), reference_tokens(SMALL, &body).await);
    }
    // Step 11 is P's add_request, step 16 D's; each records the engine that ran it.
    for (name, step, nodes) in [("P", 11u8, &cluster.prefill), ("D", 16u8, &cluster.decode)] {
        for (i, n) in nodes.iter().enumerate() {
            let served = capture.spans().iter().filter(|s| s.step == step && s.attr(attrs::ENGINE_ID) == Some(n.engine_id.as_str())).count();
            assert_eq!(served, 2, "{name}{i} served {served} of 4 requests; round robin gives each 2");
        }
    }
    cluster.assert_blocks_at_baseline().await;
    cluster.shutdown().await;
}
