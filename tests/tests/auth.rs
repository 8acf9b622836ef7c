//! The cluster secret end to end, through the proxy, P and D in one process over real sockets:
//! with the same secret on both engines every request is served with the reference's tokens; a
//! D holding another secret (or none) never gets P's KV — P refuses its pulls, so D fails the
//! load cleanly under `fail` (and computes it itself under `recompute`) once its pull deadline
//! passes (P's refusal is not sealed to D's key, so D cannot trust it), and P frees the blocks at
//! its send expiry: none is left held on either side.

use std::time::Duration;

use pdflow_auth::ClusterSecret;
use pdflow_node::config::Deadlines;
use pdflow_sim_engine::LoadFailurePolicy;
use pdflow_tests::{completion, prompt, reference_tokens, token_ids, Cluster, ClusterSpec, EngineOpts};

fn secret(text: &str) -> Option<ClusterSecret> {
    Some(ClusterSecret::from_text(text).expect("valid secret"))
}

fn spec(p: Option<ClusterSecret>, d: Option<ClusterSecret>, policy: LoadFailurePolicy) -> ClusterSpec {
    let mut spec = ClusterSpec::one_p_one_d();
    // Short deadlines: a refused D waits for its pull deadline, P for its send expiry.
    spec.deadlines = Deadlines::from_abort_timeout(Duration::from_secs(2));
    spec.prefill = vec![EngineOpts { secret: p, ..EngineOpts::default() }];
    spec.decode = vec![EngineOpts { secret: d, policy, ..EngineOpts::default() }];
    spec
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_one_secret_on_p_and_d_requests_are_served_with_the_reference_tokens() {
    let cluster = Cluster::start(spec(
        secret("the-cluster-secret-0001"),
        secret("the-cluster-secret-0001"),
        LoadFailurePolicy::Fail,
    ))
    .await
    .expect("cluster starts");
    for (len, seed) in [(40, 1), (300, 2)] {
        let body = completion(&prompt(len, seed), 6);
        let (status, answer) = cluster.post("/v1/completions", &body).await.expect("request");
        assert_eq!(status, 200, "{answer}");
        assert_eq!(token_ids(&answer), reference_tokens(cluster.spec.shape, &body).await);
    }
    cluster.assert_blocks_at_baseline().await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_d_without_the_secret_gets_no_kv_and_fails_or_recomputes_cleanly() {
    for (d_secret, policy) in [
        (secret("not-the-cluster-secret"), LoadFailurePolicy::Fail),
        (None, LoadFailurePolicy::Fail),
        (secret("not-the-cluster-secret"), LoadFailurePolicy::Recompute),
    ] {
        let cause = if d_secret.is_none() { "missing" } else { "unknown_key" };
        let before = side_channel_refusals(cause);
        let cluster = Cluster::start(spec(secret("the-cluster-secret-0001"), d_secret, policy)).await.expect("starts");
        let body = completion(&prompt(120, 3), 6);
        let (status, answer) = cluster.post("/v1/completions", &body).await.expect("request");
        match policy {
            LoadFailurePolicy::Fail => assert!(status >= 400, "D took KV without the secret: {status} {answer}"),
            LoadFailurePolicy::Recompute => {
                assert_eq!(status, 200, "{answer}");
                assert_eq!(token_ids(&answer), reference_tokens(cluster.spec.shape, &body).await, "computed by D");
            }
        }
        cluster.assert_blocks_at_baseline().await;
        assert!(side_channel_refusals(cause) > before, "P did not count this case's refused pull ({cause})");
        cluster.shutdown().await;
    }
}

/// `pdflow_auth_refusals_total{socket="side_channel",cause}` in this process's registry.
fn side_channel_refusals(cause: &str) -> f64 {
    let series = format!("pdflow_auth_refusals_total{{socket=\"side_channel\",cause=\"{cause}\"}} ");
    let text = pdflow_telemetry::metrics::global().render();
    text.lines().find_map(|l| l.strip_prefix(series.as_str())).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
}
