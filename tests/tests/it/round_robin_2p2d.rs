//! 2P2D: the proxy round-robins over both prefill and both decode engines (each P with its own
//! bootstrap, as vLLM's P TP0 launches one), and every request is still correct — in one process
//! and as separate processes.

use pdflow_tests::processes::ProcCluster;
use pdflow_tests::{
    completion, prompt, reference_tokens, token_ids, Cluster, ClusterSpec, Endpoints, EngineOpts, SMALL,
};

fn spec() -> ClusterSpec {
    let mut spec = ClusterSpec::one_p_one_d();
    spec.prefill = vec![EngineOpts::default(), EngineOpts::default()];
    spec.decode = vec![EngineOpts::default(), EngineOpts::default()];
    spec
}

async fn scenario(e: &Endpoints) {
    for i in 0..4u64 {
        let body = completion(&prompt(150, 100 + i), 8);
        let (status, response) = e.post("/v1/completions", &body).await.expect("request");
        assert_eq!(status, 200, "{response}");
        assert_eq!(token_ids(&response), reference_tokens(SMALL, &body).await);
    }
    for (name, engines) in [("P", &e.prefill), ("D", &e.decode)] {
        for (i, engine) in engines.iter().enumerate() {
            let served = e.finished(engine).await;
            assert_eq!(served, 2, "{name}{i} served {served} of 4 requests; round robin gives each 2");
        }
    }
    e.assert_blocks_at_baseline().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_p_two_d_round_robin_in_one_process() {
    let cluster = Cluster::start(spec()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_p_two_d_round_robin_as_processes() {
    let cluster = ProcCluster::start(spec()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}
