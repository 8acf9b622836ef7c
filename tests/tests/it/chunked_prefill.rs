//! Chunked prefill on P (max_num_batched_tokens below the prompt length): the pending send is
//! recorded once, the blocks are sent after the last chunk, and D's output is still exact — in one
//! process (where the step spans are checked too) and as separate processes.

use pdflow_tests::processes::ProcCluster;
use pdflow_tests::{
    capture, completion, prompt, reference_tokens, token_ids, Cluster, ClusterSpec, Endpoints, EngineOpts, SMALL,
};

fn spec() -> ClusterSpec {
    let mut spec = ClusterSpec::one_p_one_d();
    spec.prefill = vec![EngineOpts { max_num_batched_tokens: 64, ..EngineOpts::default() }];
    spec
}

async fn scenario(e: &Endpoints) {
    let body = completion(&prompt(300, 5), 12);
    let (status, response) = e.post("/v1/completions", &body).await.expect("request");
    assert_eq!(status, 200, "{response}");
    assert_eq!(token_ids(&response), reference_tokens(SMALL, &body).await);
    e.assert_blocks_at_baseline().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chunked_prefill_on_p_in_one_process() {
    let capture = capture();
    let cluster = Cluster::start(spec()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    let prefill_steps = capture.spans().iter().filter(|s| s.step == 15).count();
    assert!(prefill_steps >= 5, "300 tokens in chunks of 64 is 5 prefill forwards, saw {prefill_steps}");
    let pending_sends = capture.spans().iter().filter(|s| s.step == 13).count();
    assert_eq!(pending_sends, 1, "the pending send is recorded once, at the first allocation");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_prefill_on_p_as_processes() {
    let cluster = ProcCluster::start(spec()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}
