//! `pdflow serve`'s deadline flags (`--pull-timeout`, `--bootstrap-timeout`, `--ready-timeout`,
//! `--send-expiry`, seconds): a value that is not a positive number of seconds stops the process
//! before it binds anything, with an error naming the flag; valid values start a serving engine.
//! `--tls on` without the cluster secret is refused the same way, and so is a `--forward-cpu` the
//! process cannot run on; a forward pinned to a CPU it can serves.

use std::time::Duration;

use pdflow_tests::processes::{pdflow_bin, Proc};

/// Runs `pdflow ARGS…` to its end (bounded); returns (success, stderr).
async fn run_to_end(args: &[&str]) -> (bool, String) {
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(pdflow_bin().expect("pdflow binary")).args(args).kill_on_drop(true).output(),
    )
    .await
    .expect("pdflow exits within 30 s")
    .expect("pdflow runs");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_deadline_is_refused_naming_the_flag() {
    for (flag, value) in
        [("--pull-timeout", "0"), ("--bootstrap-timeout", "-2"), ("--ready-timeout", "inf"), ("--send-expiry", "0")]
    {
        let (ok, stderr) = run_to_end(&["serve", "--role", "consumer", "--port", "0", flag, value]).await;
        assert!(!ok, "{flag} {value} must be refused");
        assert!(
            stderr.contains(flag) && stderr.contains("above 0"),
            "{flag} {value}: the error names the flag and the rule: {stderr}"
        );
    }
    let (ok, stderr) = run_to_end(&["serve", "--role", "consumer", "--pull-timeout", "soon"]).await;
    assert!(!ok && stderr.contains("--pull-timeout"), "not a number: {stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valid_deadlines_start_a_serving_engine() {
    let args = [
        "serve",
        "--role",
        "consumer",
        "--kv-shape",
        "4,2,16,16",
        "--num-blocks",
        "64",
        "--pull-timeout",
        "2.5",
        "--bootstrap-timeout",
        "0.5",
        "--ready-timeout",
        "3",
        "--send-expiry",
        "3",
    ];
    let d = Proc::spawn("consumer", &args, &[]).await.expect("serve starts with valid deadline flags");
    let client = pdflow_tests::http_client();
    let health = client
        .get(format!("{}/health", d.url()))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .expect("the engine answers");
    assert_eq!(health.status(), 200);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_without_the_cluster_secret_is_refused_before_anything_binds() {
    let (ok, stderr) = run_to_end(&["serve", "--role", "consumer", "--port", "0", "--tls", "on"]).await;
    assert!(!ok, "--tls on without a secret must be refused");
    assert!(
        stderr.contains("--tls on") && stderr.contains("cluster secret"),
        "the error says what is missing: {stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forward_cpu_pins_the_forward_and_a_cpu_out_of_reach_is_refused() {
    let (ok, stderr) = run_to_end(&["serve", "--role", "consumer", "--port", "0", "--forward-cpu", "100000"]).await;
    assert!(!ok, "a CPU the process cannot run on must be refused");
    assert!(stderr.contains("--forward-cpu 100000"), "the error names the flag: {stderr}");

    let args = ["serve", "--role", "consumer", "--kv-shape", "4,2,16,16", "--num-blocks", "64", "--forward-cpu", "0"];
    let d = Proc::spawn("consumer", &args, &[]).await.expect("serve starts with its forward on CPU 0");
    let body =
        serde_json::json!({"model": "Qwen/Qwen3-8B", "prompt": "a prompt the forward computes", "max_tokens": 4});
    let answer = pdflow_tests::http_client()
        .post(format!("{}/v1/completions", d.url()))
        .json(&body)
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .expect("the engine answers");
    assert_eq!(answer.status(), 200);
    let v: serde_json::Value = answer.json().await.expect("a JSON completion");
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bootstrap_on_port_0_is_named_by_its_bound_port_in_p_s_answers() {
    let args =
        ["serve", "--role", "producer", "--kv-shape", "4,2,16,16", "--num-blocks", "64", "--bootstrap-port", "0"];
    let p = Proc::spawn("producer", &args, &[]).await.expect("serve starts with --bootstrap-port 0");
    let bound = p.ready["bootstrap_addr"].as_str().expect("the ready line names the bootstrap it launched").to_owned();
    assert!(!bound.ends_with(":0"), "the bootstrap bound a port: {bound}");
    let mut body = pdflow_tests::completion(&pdflow_tests::prompt(40, 2), 1);
    body["kv_transfer_params"] = serde_json::json!({"do_remote_decode": true});
    let client = pdflow_tests::http_client();
    let (status, answer) =
        pdflow_tests::post(&client, &format!("{}/v1/completions", p.url()), &body).await.expect("P answers");
    assert_eq!(status, 200, "{answer}");
    // What a proxy hands D names the bootstrap D can reach, with the port it bound.
    let params = &answer["kv_transfer_params"];
    assert_eq!(params["remote_bootstrap_addr"], format!("http://{bound}").as_str(), "{answer}");
    let query = client
        .get(format!("http://{bound}/query"))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .expect("the named bootstrap answers");
    assert_eq!(query.status(), 200);
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_limit_is_refused_naming_it_and_a_good_one_takes_effect() {
    for (command, limit, says) in [
        ("serve", "http.header_timeout=0", "positive number of seconds"),
        ("proxy", "side_channel.max_connections=many", "whole number"),
        ("bootstrap", "http.header_time=3", "unknown limit `http.header_time`"),
        ("bootstrap", "side_channel.max_unfinished_bytes", "KEY=VALUE"),
    ] {
        let mut args = vec![command, "--port", "0", "--limit", limit];
        match command {
            "serve" => args.extend(["--role", "consumer"]),
            "proxy" => args.extend(["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]),
            _ => {}
        }
        let (ok, stderr) = run_to_end(&args).await;
        assert!(!ok, "{command} --limit {limit} must be refused");
        assert!(stderr.contains("--limit") && stderr.contains(says), "{command} --limit {limit}: {stderr}");
    }

    // A header deadline of half a second instead of the default 10 s: half a header is closed
    // within a few seconds.
    let b = Proc::spawn("bootstrap", &["bootstrap", "--port", "0", "--limit", "http.header_timeout=0.5"], &[])
        .await
        .expect("the bootstrap starts with a limit");
    let addr = b.ready["addr"].as_str().expect("addr").to_owned();
    let mut stream = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream.write_all(b"GET /query HTTP/1.1\r\nHost: pdf").await.expect("half a header");
    let mut buf = [0u8; 64];
    let closed = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await;
    assert!(matches!(closed, Ok(Ok(0) | Err(_))), "half a header was held past the 0.5 s limit: {closed:?}");
    b.stop().await;
}
