//! Eight concurrent requests through one P and one D: each gets its own single-engine output, and
//! nothing leaks.

use futures::future::join_all;
use pdflow_tests::{completion, prompt, reference_tokens, token_ids, Cluster, ClusterSpec, SMALL};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_concurrent_requests_each_match_their_reference() {
    let cluster = Cluster::start(ClusterSpec::one_p_one_d()).await.expect("cluster starts");
    let bodies: Vec<_> = (0..8u64).map(|i| completion(&prompt(200 + 37 * i as usize, i), 24)).collect();
    let results = join_all(bodies.iter().map(|b| cluster.post("/v1/completions", b))).await;
    for (i, (body, result)) in bodies.iter().zip(results).enumerate() {
        let (status, response) = result.expect("request");
        assert_eq!(status, 200, "request {i}: {response}");
        assert_eq!(token_ids(&response), reference_tokens(SMALL, body).await, "request {i} differs from its reference");
    }
    cluster.assert_blocks_at_baseline().await;
    cluster.shutdown().await;
}
