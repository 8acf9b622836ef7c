//! `/metrics` on the proxy and both engines after one request, in one process (every node feeding
//! the process's registry, told apart by the `service` label) and as separate `pdflow` processes:
//! step 29's histogram on P (with bytes and descriptors), a step-34 transfer observation on D,
//! the engine's blocks held, and the Prometheus text content type.

use pdflow_observability::metrics::{self, parse_histogram, MetricsLayer};
use pdflow_tests::processes::ProcCluster;
use pdflow_tests::{completion, prompt, Cluster, ClusterSpec, Endpoints, SMALL};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

const P: [(&str, &str); 2] = [("service", "prefill"), ("side", "p")];
const D: [(&str, &str); 2] = [("service", "decode"), ("side", "d")];

async fn scrape(e: &Endpoints, base: &str) -> String {
    let resp = e.client.get(format!("{base}/metrics")).send().await.expect("GET /metrics");
    assert_eq!(resp.status().as_u16(), 200, "GET {base}/metrics");
    let content_type = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    assert!(content_type.starts_with("text/plain; version=0.0.4"), "{base}/metrics content type {content_type:?}");
    resp.text().await.expect("metrics body")
}

async fn scenario(e: &Endpoints) {
    let (status, response) = e.post("/v1/completions", &completion(&prompt(100, 7), 8)).await.expect("request");
    assert_eq!(status, 200, "{response}");

    let p_text = scrape(e, &e.prefill[0].url).await;
    let step29 = parse_histogram(
        &p_text,
        "pdflow_step_duration_seconds",
        &[("service", "prefill"), ("step", "29"), ("name", "p_transfer_write")],
    )
    .unwrap_or_else(|| panic!("no step-29 histogram on P:\n{p_text}"));
    assert!(step29.count >= 1, "{p_text}");
    let bytes = parse_histogram(&p_text, "pdflow_transfer_bytes", &P)
        .unwrap_or_else(|| panic!("no P transfer bytes:\n{p_text}"));
    assert!(bytes.count >= 1 && bytes.sum > 0.0, "{p_text}");
    let descriptors = parse_histogram(&p_text, "pdflow_transfer_descriptors", &P)
        .unwrap_or_else(|| panic!("no P descriptors:\n{p_text}"));
    assert!(descriptors.count >= 1 && descriptors.sum >= 1.0, "{p_text}");
    let engine_id = &e.prefill[0].engine_id;
    assert!(
        p_text.contains(&format!("pdflow_blocks_total{{engine_id=\"{engine_id}\"}} ")),
        "P's blocks gauge:\n{p_text}"
    );
    assert!(p_text.contains("# TYPE pdflow_failures_total counter"), "{p_text}");

    let d_text = scrape(e, &e.decode[0].url).await;
    let step34 = parse_histogram(&d_text, "pdflow_step_duration_seconds", &[("service", "decode"), ("step", "34")])
        .unwrap_or_else(|| panic!("no step-34 histogram on D:\n{d_text}"));
    assert!(step34.count >= 1, "{d_text}");
    let d_duration = parse_histogram(&d_text, "pdflow_transfer_duration_seconds", &D)
        .unwrap_or_else(|| panic!("no D transfer duration:\n{d_text}"));
    assert!(d_duration.count >= 1 && d_duration.sum > 0.0, "{d_text}");
    let d_blocks = parse_histogram(&d_text, "pdflow_transfer_blocks", &D)
        .unwrap_or_else(|| panic!("no D transfer blocks:\n{d_text}"));
    assert!(d_blocks.count >= 1 && d_blocks.sum >= 1.0, "{d_text}");
    let d_bytes = parse_histogram(&d_text, "pdflow_transfer_bytes", &D)
        .unwrap_or_else(|| panic!("no D transfer bytes:\n{d_text}"));
    assert_eq!(d_bytes.sum, d_blocks.sum * SMALL.bytes_per_block() as f64, "{d_text}");
    assert!(
        d_text.contains("pdflow_pulls_in_flight{service=\"decode\",side=\"d\"} 0\n"),
        "D's pull is settled:\n{d_text}"
    );
    // No transfer step failed. (In one process every node's series shows on every endpoint; the
    // proxy's start-up health probe of a node still starting may count one "unhealthy" step 6.)
    let failures: Vec<&str> = d_text
        .lines()
        .filter(|l| l.starts_with("pdflow_failures_total{") && !l.contains("service=\"proxy\",step=\"6\""))
        .collect();
    assert!(failures.is_empty(), "no failures: {failures:?}\n{d_text}");

    let proxy_text = scrape(e, &e.proxy).await;
    let step8 = parse_histogram(&proxy_text, "pdflow_step_duration_seconds", &[("service", "proxy"), ("step", "8")])
        .unwrap_or_else(|| panic!("no step-8 histogram on the proxy:\n{proxy_text}"));
    assert!(step8.count >= 1, "{proxy_text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_in_one_process() {
    tracing_subscriber::registry()
        .with(MetricsLayer::global())
        .try_init()
        .expect("the only subscriber of this test binary");
    metrics::global().set_block_bytes(SMALL.bytes_per_block() as u64);
    let cluster = Cluster::start(ClusterSpec::one_p_one_d()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_as_processes() {
    let cluster = ProcCluster::start(ClusterSpec::one_p_one_d()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}
