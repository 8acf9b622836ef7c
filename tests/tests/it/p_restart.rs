//! Peer generations: P restarts (a new incarnation on the same addresses) while it holds
//! the KV of a transfer D has not pulled yet. D still addresses the generation it learned from
//! bootstrap; the new incarnation does not know the transfer, so it refuses the pull at once
//! (`stale_generation`) instead of waiting for a ready that will never come (P's ready timeout is
//! 20 s here). D fails the request cleanly under policy `fail`, frees its blocks, addresses the new
//! generation from then on, and the next request through the proxy is served.

use std::time::{Duration, Instant};

use pdflow_fault::NodeKind;
use pdflow_messages::kv_transfer_params::KvTransferParams;
use pdflow_node::config::Deadlines;
use pdflow_sim_engine::LoadFailurePolicy;
use pdflow_tools::chaos::{ChaosCluster, ChaosSpec, CHAOS_SHAPE};
use serde_json::{json, Value};

const PROMPT: &str = "the quick brown fox jumps over the lazy dog and keeps running far away";

async fn post(client: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    let resp = client.post(url).json(body).timeout(Duration::from_secs(60)).send().await.expect("POST");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pull_addressed_to_a_restarted_p_is_refused_at_once_not_after_the_ready_timeout() {
    let deadlines = Deadlines {
        ready_timeout: Duration::from_secs(20),
        send_expiry: Duration::from_secs(20),
        pull_timeout: Duration::from_secs(30),
        bootstrap_timeout: Duration::from_secs(2),
    };
    let spec = ChaosSpec {
        shape: CHAOS_SHAPE,
        num_blocks: 256,
        deadlines,
        policy: LoadFailurePolicy::Fail,
        upstream_timeout: Duration::from_secs(60),
        layerwise: false,
        p_max_batched_tokens: 8192,
        prefill_parallel: Default::default(),
        decode_parallel: Default::default(),
        hybrid: None,
        rdma: false,
    };
    let _ = pdflow_tests::capture(); // logs with PDFLOW_TEST_LOG=<filter>
    let faults = pdflow_fault::FaultDomain::new(pdflow_transfer::tcp::TcpConfig::default());
    let mut cluster = ChaosCluster::start(spec, &faults).await.expect("cluster starts");
    let client = reqwest::Client::builder().no_proxy().build().expect("client");
    let completion =
        |max_tokens: usize| json!({"model": "m", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0});

    // D learns P's workers and generation from bootstrap.
    let (status, body) = post(&client, &format!("{}/v1/completions", cluster.proxy_url()), &completion(4)).await;
    assert_eq!(status, 200, "{body}");

    // P prefills transfer `xfer-restart` and keeps its KV for D...
    let (p_url, p_engine) = {
        let p = cluster.prefill.as_ref().expect("P runs");
        (p.url(), p.engine_id.clone())
    };
    let bootstrap_addr = cluster.bootstrap.as_ref().expect("bootstrap runs").addr.to_string();
    let mut p_body = completion(1);
    p_body["kv_transfer_params"] = serde_json::to_value(KvTransferParams::for_prefill("xfer-restart")).expect("json");
    let (status, body) = post(&client, &format!("{p_url}/v1/completions"), &p_body).await;
    assert_eq!(status, 200, "{body}");

    // ...and restarts before D pulls: the KV went with the old incarnation.
    cluster.kill_and_restart(NodeKind::P).await.expect("P restarts");

    let d_url = cluster.decode.as_ref().expect("D runs").url();
    let mut d_body = completion(4);
    d_body["kv_transfer_params"] =
        serde_json::to_value(KvTransferParams::for_decode("xfer-restart", bootstrap_addr, p_engine)).expect("json");
    let started = Instant::now();
    let (status, body) = post(&client, &format!("{d_url}/v1/completions"), &d_body).await;
    let took = started.elapsed();
    assert!(status >= 500, "policy fail: a clean error, got {status}: {body}");
    assert!(body.to_string().contains("stale_generation"), "the error names the cause: {body}");
    assert!(took < Duration::from_secs(8), "refused at once, not after P's 20 s ready timeout: took {took:?}");

    // Nothing leaked (P: the new incarnation holds nothing; D freed the blocks it had reserved).
    let (held_p, held_d) = cluster.wait_baseline(Duration::from_secs(10)).await;
    assert_eq!((held_p, held_d), (0, 0), "blocks leaked on P / D");

    // D addresses the new generation now: the next request through the proxy is served.
    let (status, body) = post(&client, &format!("{}/v1/completions", cluster.proxy_url()), &completion(4)).await;
    assert_eq!(status, 200, "{body}");
    cluster.shutdown().await;
}
