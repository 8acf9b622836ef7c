//! The seed request (1000-token prompt, max_tokens 128, greedy, Qwen3-8B's KV shape) through
//! proxy, P and D over real sockets — in one process and as separate processes: D's output equals
//! a single engine's, and both engines return to their baseline block count.

use pdflow_kv::memory::KvShape;
use pdflow_tests::processes::ProcCluster;
use pdflow_tests::{completion, prompt, reference_tokens, token_ids, Cluster, ClusterSpec, Endpoints, EngineOpts};

fn spec() -> ClusterSpec {
    let mut spec = ClusterSpec::one_p_one_d();
    spec.shape = KvShape::QWEN3_8B;
    spec.prefill = vec![EngineOpts { num_blocks: 80, ..EngineOpts::default() }];
    spec.decode = vec![EngineOpts { num_blocks: 80, ..EngineOpts::default() }];
    spec
}

async fn scenario(e: &Endpoints) {
    let body = completion(&prompt(1000, 42), 128);
    let (status, response) = e.post("/v1/completions", &body).await.expect("request");
    assert_eq!(status, 200, "{response}");
    assert_eq!(response["usage"]["prompt_tokens"], 1000);
    assert_eq!(response["usage"]["completion_tokens"], 128);
    assert_eq!(response["choices"][0]["finish_reason"], "length");
    let expected = reference_tokens(KvShape::QWEN3_8B, &body).await;
    assert_eq!(token_ids(&response), expected, "P/D output differs from the single-engine reference");
    e.assert_blocks_at_baseline().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn seed_request_in_one_process() {
    let cluster = Cluster::start(spec()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}

/// The same request between processes under the cluster secret, its KV over TLS (tcp only: the
/// same-host path would not touch the socket): signed bootstrap calls, a sealed pull, a TLS data
/// channel authenticated by the secret — the same tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_request_as_processes_under_the_secret_with_tls() {
    let mut spec = spec();
    for o in spec.prefill.iter_mut().chain(spec.decode.iter_mut()) {
        o.secret = Some("seed-request-cluster-secret-01".to_string());
        o.tls = true;
        o.tcp_only = true;
    }
    let cluster = ProcCluster::start(spec).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_request_as_processes() {
    let cluster = ProcCluster::start(spec()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}
