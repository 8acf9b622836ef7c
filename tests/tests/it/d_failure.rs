//! D refuses the request at admission (here: prompt + max_tokens exceed D's max_model_len) while
//! P prefills it. The client gets D's error, and P's blocks — held for D's pull (delayed free) —
//! come back at once: D's connector still sends P an empty pull for the refused request, instead
//! of P waiting for its send expiry (20 s here). In one process and as separate processes.

use std::time::{Duration, Instant};

use pdflow_tests::processes::ProcCluster;
use pdflow_tests::{completion, prompt, Cluster, ClusterSpec, Endpoints, EngineOpts};

fn spec() -> ClusterSpec {
    let mut spec = ClusterSpec::one_p_one_d(); // send expiry 20 s: the test must not need it
    spec.decode = vec![EngineOpts { max_model_len: 256, ..EngineOpts::default() }];
    spec
}

async fn scenario(e: &Endpoints) {
    let started = Instant::now();
    let (status, response) =
        tokio::time::timeout(Duration::from_secs(10), e.post("/v1/completions", &completion(&prompt(240, 5), 64)))
            .await
            .expect("the client got an answer without waiting for any transfer deadline")
            .expect("request");
    assert!((400..500).contains(&status), "expected D's 4xx, got {status}: {response}");
    assert!(response.to_string().contains("maximum context length"), "{response}");
    // P's blocks (and D's: it never took any) are back long before P's 20 s send expiry.
    e.assert_blocks_at_baseline().await;
    assert!(started.elapsed() < Duration::from_secs(12), "P's blocks were only freed by its send expiry");
    // The system still serves.
    let (status, response) = e.post("/v1/completions", &completion(&prompt(100, 1), 4)).await.expect("request");
    assert_eq!(status, 200, "{response}");
    e.assert_blocks_at_baseline().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn d_refusing_frees_p_at_once_in_one_process() {
    let cluster = Cluster::start(spec()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d_refusing_frees_p_at_once_as_processes() {
    let cluster = ProcCluster::start(spec()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}
