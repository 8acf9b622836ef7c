//! P fails the request (here: the prompt is longer than P's max_model_len). The client gets an
//! error at once — not after D's deadline — D's request is cancelled, and D's blocks, held while
//! its pull was in flight, are freed once P confirms no write can land. In one process and as
//! separate processes.

use std::time::{Duration, Instant};

use pdflow_tests::processes::ProcCluster;
use pdflow_tests::{completion, prompt, Cluster, ClusterSpec, Endpoints, EngineOpts};

fn spec() -> ClusterSpec {
    let mut spec = ClusterSpec::one_p_one_d(); // ready timeout 20 s: the test must not need it
    spec.prefill = vec![EngineOpts { max_model_len: 256, ..EngineOpts::default() }];
    spec
}

async fn scenario(e: &Endpoints) {
    let started = Instant::now();
    let (status, response) =
        tokio::time::timeout(Duration::from_secs(10), e.post("/v1/completions", &completion(&prompt(400, 9), 8)))
            .await
            .expect("the client got an answer without waiting for any transfer deadline")
            .expect("request");
    assert!(status >= 400, "expected an error status, got {status}: {response}");
    assert!(response.to_string().to_lowercase().contains("error"), "{response}");
    // D aborted its request; its blocks come back well before P's 20 s ready timeout.
    e.assert_blocks_at_baseline().await;
    assert!(started.elapsed() < Duration::from_secs(18), "D's blocks were only freed by a deadline");
    // The system still serves.
    let (status, response) = e.post("/v1/completions", &completion(&prompt(100, 1), 4)).await.expect("request");
    assert_eq!(status, 200, "{response}");
    e.assert_blocks_at_baseline().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn p_failing_gives_a_quick_error_and_frees_d_in_one_process() {
    let cluster = Cluster::start(spec()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p_failing_gives_a_quick_error_and_frees_d_as_processes() {
    let cluster = ProcCluster::start(spec()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}
