//! The parts as separate processes that find each other over loopback — `pdflow bootstrap`,
//! `pdflow serve --role producer|consumer`, `pdflow proxy` with vLLM's arguments — and
//! `pdflow demo --json` as a user runs it.

use pdflow_tests::processes::{run_demo, Proc};
use pdflow_tests::{completion, http_client, post, prompt, reference_tokens, token_ids, wait_healthy, SMALL};

const SHAPE: &str = "4,2,16,16";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bootstrap_serve_and_proxy_as_processes() {
    let bootstrap = Proc::spawn("bootstrap", &["bootstrap", "--port", "0"], &[]).await.expect("bootstrap starts");
    let bootstrap_addr = bootstrap.ready["addr"].as_str().expect("addr").to_string();
    let bootstrap_port = bootstrap_addr.rsplit(':').next().expect("port").to_string();
    let producer = Proc::spawn(
        "producer",
        &[
            "serve",
            "--role",
            "producer",
            "--kv-shape",
            SHAPE,
            "--num-blocks",
            "128",
            "--bootstrap-url",
            &format!("http://{bootstrap_addr}"),
        ],
        &[],
    )
    .await
    .expect("producer starts");
    let consumer = Proc::spawn(
        "consumer",
        &[
            "serve",
            "--role",
            "consumer",
            "--kv-shape",
            SHAPE,
            "--num-blocks",
            "128",
            "--kv-load-failure-policy",
            "fail",
        ],
        &[],
    )
    .await
    .expect("consumer starts");
    let proxy = Proc::proxy(&producer, &bootstrap_port, &consumer).await.expect("proxy starts");
    let client = http_client();
    wait_healthy(&client, &proxy.url(), std::time::Duration::from_secs(20)).await.expect("proxy ready");

    let body = completion(&prompt(400, 77), 24);
    let (status, response) = post(&client, &format!("{}/v1/completions", proxy.url()), &body).await.expect("request");
    assert_eq!(status, 200, "{response}");
    assert_eq!(token_ids(&response), reference_tokens(SMALL, &body).await);
    for engine in [&producer, &consumer] {
        engine.assert_blocks_at_baseline(&client, "after the request").await;
    }
    for p in [proxy, consumer, producer, bootstrap] {
        p.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_command_verifies_the_seed_request() {
    let (report, stdout) = run_demo(&[]).await;
    assert_eq!(report["verified"], true, "{report}");
    assert_eq!(report["output_matches_reference"], true);
    assert_eq!(report["kv_bytes"], 148_635_648u64);
    assert_eq!(report["blocks"], 63);
    assert_eq!(report["descriptors"], 36);
    assert_eq!(report["prompt_tokens"], 1000);
    assert_eq!(report["completion_tokens"], 128);
    let steps = report["steps"].as_array().expect("steps");
    assert_eq!(steps.len(), 43, "all 43 steps timed");
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s["step"], i as u64 + 1);
        assert!(s["duration_ms"].as_f64().is_some() && s["start_ms"].as_f64().is_some());
    }
    assert!(stdout.contains("step") && stdout.contains("p_transfer_write"), "the timeline is printed");
}
