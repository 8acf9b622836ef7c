//! The rdma transport between processes: `pdflow serve --transport rdma` on P and D (libfabric's
//! software `tcp` provider here, in a verbs NIC's registration modes), the seed request through
//! the proxy: P writes D's blocks one-sided, D's output equals a single engine's with checksums
//! verified, every block back at baseline, and `/metrics` names the backend and provider. Skipped,
//! saying why, in a build without the `rdma` feature or on a host without libfabric.

use pdflow_kv::memory::KvShape;
use pdflow_tests::processes::{Proc, ProcCluster};
use pdflow_tests::{completion, prompt, reference_tokens, token_ids, ClusterSpec, EngineOpts};

const SECRET: &str = "rdma-test-cluster-secret-0001";

/// Why a consumer with `--transport rdma` cannot start here, if it cannot.
async fn rdma_unavailable() -> Option<String> {
    let args = ["serve", "--role", "consumer", "--port", "0", "--kv-shape", "4,2,16,16", "--transport", "rdma"];
    match Proc::why_not_ready(&args).await.expect("pdflow runs") {
        None => None,
        Some(why) if why.contains("without RDMA support") || why.contains("libfabric") => Some(why),
        Some(why) => panic!("pdflow serve --transport rdma did not start for another reason: {why}"),
    }
}

/// The software provider with connected endpoints, and with reliable datagram ones (`efa`'s path).
const TCP: &str = "tcp";
const TCP_RDM: &str = "tcp;ofi_rxm";

fn spec(secret: bool, provider: &str) -> ClusterSpec {
    let mut spec = ClusterSpec::one_p_one_d();
    spec.shape = KvShape::QWEN3_8B;
    let opts = EngineOpts {
        num_blocks: 80,
        secret: secret.then(|| SECRET.to_string()),
        extra_args: vec!["--transport".into(), "rdma".into(), "--rdma-provider".into(), provider.into()],
        ..EngineOpts::default()
    };
    spec.prefill = vec![opts.clone()];
    spec.decode = vec![opts];
    spec
}

async fn metrics(client: &reqwest::Client, url: &str) -> String {
    client.get(format!("{url}/metrics")).send().await.expect("metrics").text().await.expect("metrics text")
}

async fn seed_request_over_rdma(secret: bool, provider: &str) {
    if let Some(why) = rdma_unavailable().await {
        pdflow_testkit::skipped("the seed request over rdma", &why);
        return;
    }
    let cluster = ProcCluster::start(spec(secret, provider)).await.expect("cluster starts");
    let e = &cluster.endpoints;
    let body = completion(&prompt(1000, 42), 128);
    let (status, response) = e.post("/v1/completions", &body).await.expect("request");
    // D checks the blocks it received against P's digests (`--verify-checksums`): a mismatch
    // fails the request under `--kv-load-failure-policy fail`.
    assert_eq!(status, 200, "{response}");
    assert_eq!(response["usage"]["prompt_tokens"], 1000);
    assert_eq!(token_ids(&response), reference_tokens(KvShape::QWEN3_8B, &body).await, "P/D output differs");
    e.assert_blocks_at_baseline().await;
    // P's step-29 write went one-sided; D holds P's connection (or datagram endpoint) on the
    // software provider.
    let p_metrics = metrics(&e.client, &e.prefill[0].url).await;
    let rdma_writes = p_metrics.lines().find(|l| {
        l.starts_with("pdflow_transfer_writes_total") && l.contains("backend=\"rdma\"") && l.contains("outcome=\"ok\"")
    });
    assert!(rdma_writes.is_some(), "no rdma write on P's /metrics:\n{p_metrics}");
    let d_metrics = metrics(&e.client, &e.decode[0].url).await;
    let endpoint = d_metrics.lines().find(|l| {
        l.starts_with("pdflow_rdma_connections{")
            && l.contains("side=\"d\"")
            && l.contains(&format!("provider=\"{provider}\""))
    });
    let connections: f64 = endpoint
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("D's /metrics has no RDMA endpoint:\n{d_metrics}"));
    assert!(connections >= 1.0, "D holds P's connection: {endpoint:?}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_request_between_processes_over_rdma() {
    seed_request_over_rdma(false, TCP).await;
}

/// Under the cluster secret: the keys travel in sealed pulls and P's connection proves the secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_request_over_rdma_under_the_cluster_secret() {
    seed_request_over_rdma(true, TCP).await;
}

/// Reliable datagram endpoints (the path `efa` takes) on the software provider, under the
/// cluster secret: no connect step, the keys still travel only in sealed pulls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_request_over_rdma_datagram_endpoints() {
    seed_request_over_rdma(true, TCP_RDM).await;
}

/// Sharded engines over rdma: P's two tensor-parallel workers each write their heads into the one
/// D worker's blocks, each through its own connection and the keys D granted it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tp2_p_writes_a_tp1_d_over_rdma() {
    if let Some(why) = rdma_unavailable().await {
        pdflow_testkit::skipped("tp 2 to tp 1 over rdma", &why);
        return;
    }
    let mut spec = ClusterSpec::one_p_one_d();
    let rdma = vec!["--transport".to_string(), "rdma".to_string()];
    let tp2 = [rdma.clone(), vec!["--tensor-parallel-size".into(), "2".into()]].concat();
    spec.prefill = vec![EngineOpts { extra_args: tp2, ..EngineOpts::default() }];
    spec.decode = vec![EngineOpts { extra_args: rdma, ..EngineOpts::default() }];
    let cluster = ProcCluster::start(spec.clone()).await.expect("cluster starts");
    let e = &cluster.endpoints;
    for seed in [7, 8] {
        let body = completion(&prompt(300, seed), 16);
        let (status, response) = e.post("/v1/completions", &body).await.expect("request");
        assert_eq!(status, 200, "{response}");
        assert_eq!(token_ids(&response), reference_tokens(spec.shape, &body).await, "P/D output differs");
    }
    e.assert_blocks_at_baseline().await;
    let d_metrics = metrics(&e.client, &e.decode[0].url).await;
    let connections: f64 = d_metrics
        .lines()
        .find(|l| l.starts_with("pdflow_rdma_connections{") && l.contains("side=\"d\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("D's /metrics has no RDMA endpoint:\n{d_metrics}"));
    assert!(connections >= 2.0, "each P worker connected to D: {connections}");
    cluster.shutdown().await;
}

/// `--transport auto`: with no NIC's provider here D offers no RDMA and P writes over another
/// path; naming the software provider (`--rdma-provider tcp`) makes both ends usable, and `auto`
/// then writes one-sided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_writes_one_sided_only_when_both_ends_have_a_usable_provider() {
    if let Some(why) = rdma_unavailable().await {
        pdflow_testkit::skipped("auto over rdma", &why);
        return;
    }
    if pdflow_transfer::rdma_nic_provider("127.0.0.1").is_ok() {
        pdflow_testkit::skipped("auto without a NIC", &"this host has an RDMA NIC: auto takes it");
        return;
    }
    for (provider, want) in [(None, false), (Some("tcp"), true)] {
        let mut spec = ClusterSpec::one_p_one_d();
        let mut args = vec!["--transport".to_string(), "auto".to_string()];
        if let Some(p) = provider {
            args.extend(["--rdma-provider".to_string(), p.to_string()]);
        }
        let opts = EngineOpts { extra_args: args, ..EngineOpts::default() };
        spec.prefill = vec![opts.clone()];
        spec.decode = vec![opts];
        let cluster = ProcCluster::start(spec.clone()).await.expect("cluster starts");
        let e = &cluster.endpoints;
        let body = completion(&prompt(200, 3), 8);
        let (status, response) = e.post("/v1/completions", &body).await.expect("request");
        assert_eq!(status, 200, "{response}");
        assert_eq!(token_ids(&response), reference_tokens(spec.shape, &body).await);
        let p_metrics = metrics(&e.client, &e.prefill[0].url).await;
        let rdma =
            p_metrics.lines().any(|l| l.starts_with("pdflow_transfer_writes_total") && l.contains("backend=\"rdma\""));
        assert_eq!(rdma, want, "provider {provider:?}: rdma writes on P's /metrics:\n{p_metrics}");
        cluster.shutdown().await;
    }
}

/// Layer-wise P over rdma: each layer's KV goes one-sided while P still prefills (P prefills in
/// steps of 64 tokens, so D's pull is there before the prompt is done).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer_wise_p_writes_each_layer_one_sided() {
    if let Some(why) = rdma_unavailable().await {
        pdflow_testkit::skipped("layer-wise over rdma", &why);
        return;
    }
    let mut spec = ClusterSpec::one_p_one_d();
    let rdma = vec!["--transport".to_string(), "rdma".to_string()];
    spec.prefill = vec![EngineOpts {
        max_num_batched_tokens: 64,
        layerwise: true,
        extra_args: rdma.clone(),
        ..EngineOpts::default()
    }];
    spec.decode = vec![EngineOpts { extra_args: rdma, ..EngineOpts::default() }];
    let cluster = ProcCluster::start(spec.clone()).await.expect("cluster starts");
    let e = &cluster.endpoints;
    let body = completion(&prompt(600, 19), 12);
    let (status, response) = e.post("/v1/completions", &body).await.expect("request");
    assert_eq!(status, 200, "{response}");
    assert_eq!(token_ids(&response), reference_tokens(spec.shape, &body).await, "P/D output differs");
    e.assert_blocks_at_baseline().await;
    let p_metrics = metrics(&e.client, &e.prefill[0].url).await;
    assert!(
        p_metrics.lines().any(|l| l.starts_with("pdflow_transfer_writes_total") && l.contains("backend=\"rdma\"")),
        "no rdma write on P's /metrics:\n{p_metrics}"
    );
    cluster.shutdown().await;
}
