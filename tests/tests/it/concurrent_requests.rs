//! Eight concurrent requests through one P and one D — in one process and as separate processes:
//! each gets its own single-engine output, and nothing leaks.

use futures::future::join_all;
use pdflow_tests::processes::ProcCluster;
use pdflow_tests::{completion, prompt, reference_tokens, token_ids, Cluster, ClusterSpec, Endpoints, SMALL};

async fn scenario(e: &Endpoints) {
    let bodies: Vec<_> = (0..8u64).map(|i| completion(&prompt(200 + 37 * i as usize, i), 24)).collect();
    let results = join_all(bodies.iter().map(|b| e.post("/v1/completions", b))).await;
    for (i, (body, result)) in bodies.iter().zip(results).enumerate() {
        let (status, response) = result.expect("request");
        assert_eq!(status, 200, "request {i}: {response}");
        assert_eq!(token_ids(&response), reference_tokens(SMALL, body).await, "request {i} differs from its reference");
    }
    e.assert_blocks_at_baseline().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_concurrent_requests_in_one_process() {
    let cluster = Cluster::start(ClusterSpec::one_p_one_d()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_concurrent_requests_as_processes() {
    let cluster = ProcCluster::start(ClusterSpec::one_p_one_d()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}
