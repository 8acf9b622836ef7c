//! GPU-resident KV with P and D as separate processes: `pdflow serve --kv-device N`
//! for both, `pdflow proxy` in front. P's KV reaches D's GPU through CUDA IPC (step 29 by
//! `cuda-ipc`, counted in P's `/metrics`) — or, with `--gpu-path staged`, by tcp through pinned
//! host buffers to D's staged receiver (`cuda-staged`, the cross-host path; with a transfer
//! token, and under the cluster secret with TLS) — the output equals that of an engine on host
//! memory, and both engines' blocks return to baseline. Needs a pdflow built with `--features cuda`
//! (`PDFLOW_BIN`) on a machine with a GPU (`PDFLOW_TEST_GPUS=P,D`, default `0,0`); skips, saying
//! why, anywhere else.

use std::process::Stdio;
use std::time::Duration;

use pdflow_tests::processes::{pdflow_bin, Proc};
use pdflow_tests::{completion, http_client, post, prompt, reference_tokens, token_ids, wait_healthy, SMALL};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};

const SHAPE: &str = "4,2,16,16";

/// Why a GPU engine could not start on this machine, if that is why it exited.
fn no_gpu_here(stderr: &str) -> bool {
    ["without GPU support", "no CUDA driver", "sees no GPU", "NVRTC", "does not exist: the driver sees"]
        .iter()
        .any(|m| stderr.contains(m))
}

/// Starts `pdflow ARGS…`; `None` (after saying why) when the machine cannot run GPU KV.
async fn start_or_skip(name: &str, args: &[&str]) -> Option<Proc> {
    let mut cmd = tokio::process::Command::new(pdflow_bin().expect("pdflow binary"));
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).stdin(Stdio::null()).kill_on_drop(true);
    let mut child = cmd.spawn().expect("spawns pdflow");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut stderr = child.stderr.take().expect("stderr");
    let first = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .expect("a ready line or an exit within 60 s");
    match first {
        Ok(Some(line)) => {
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            tokio::spawn(async move {
                let mut sink = Vec::new();
                let _ = stderr.read_to_end(&mut sink).await;
            });
            let ready = serde_json::from_str(&line).expect("ready line is JSON");
            Some(Proc { child, ready, name: name.to_string() })
        }
        _ => {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text).await;
            assert!(no_gpu_here(&text), "{name} exited before it was ready:\n{text}");
            pdflow_testkit::skipped("GPU KV in separate processes", &text.lines().last().unwrap_or_default());
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gpu_kv_moves_between_processes_through_cuda_ipc() {
    two_requests_between_gpu_processes(&[], &[], "cuda-ipc").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gpu_kv_moves_between_processes_by_the_staged_tcp_path_with_an_auth_token() {
    // What a D on another host gets: tcp through pinned host buffers to D's staged receiver,
    // whose port D's data server offers; the token guards the receiver as it does the server.
    let token = ["--transfer-token", "gpu-secret"];
    let p_extra = ["--transfer-token", "gpu-secret", "--gpu-path", "staged"];
    two_requests_between_gpu_processes(&p_extra, &token, "cuda-staged").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gpu_kv_moves_between_processes_by_the_staged_path_under_the_cluster_secret_with_tls() {
    // Across hosts under the secret: the bootstrap, the side channel and D's data server check
    // their proofs as on host KV; every staged request is sealed, D's acceptance proves the
    // secret, and each staged connection is TLS with the secret's certificates.
    let file = std::env::temp_dir().join(format!("pdflow-gpu-secret-{}", std::process::id()));
    std::fs::write(&file, "gpu-cluster-secret-0001").expect("writes the secret file");
    let path = file.to_string_lossy().into_owned();
    let secret = ["--cluster-secret-file", path.as_str()];
    let d_extra = [secret[0], secret[1], "--tls", "on"];
    let p_extra = [secret[0], secret[1], "--tls", "on", "--gpu-path", "staged"];
    two_requests_between_gpu_processes_behind(&p_extra, &d_extra, &secret, "cuda-staged").await;
    let _ = std::fs::remove_file(&file);
}

/// P and D as `pdflow serve --kv-device` processes (P with `p_extra`, D with `d_extra`) behind a
/// proxy: two requests, outputs equal to host memory, both writes by `backend`, no blocks held.
async fn two_requests_between_gpu_processes(p_extra: &[&str], d_extra: &[&str], backend: &str) {
    two_requests_between_gpu_processes_behind(p_extra, d_extra, &[], backend).await;
}

/// As [`two_requests_between_gpu_processes`], the proxy started with `proxy_extra`.
async fn two_requests_between_gpu_processes_behind(
    p_extra: &[&str],
    d_extra: &[&str],
    proxy_extra: &[&str],
    backend: &str,
) {
    let gpus = std::env::var("PDFLOW_TEST_GPUS").unwrap_or_else(|_| "0,0".into());
    let (p_gpu, d_gpu) = gpus.split_once(',').expect("PDFLOW_TEST_GPUS is P,D");
    let engine = |role: &'static str, gpu: &str, extra: &[&str]| -> Vec<String> {
        let base = [
            "serve",
            "--role",
            role,
            "--kv-shape",
            SHAPE,
            "--num-blocks",
            "128",
            "--kv-device",
            gpu,
            "--verify-checksums",
        ];
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    let d_args = engine("consumer", d_gpu, d_extra);
    let Some(consumer) = start_or_skip("consumer", &d_args.iter().map(String::as_str).collect::<Vec<_>>()).await else {
        return;
    };
    let mut p_args = engine("producer", p_gpu, p_extra);
    p_args.extend(["--bootstrap-port".into(), "0".into()]);
    let producer = start_or_skip("producer", &p_args.iter().map(String::as_str).collect::<Vec<_>>())
        .await
        .expect("D started on a GPU, so P must too");
    let bootstrap_port = producer.ready["bootstrap_addr"]
        .as_str()
        .and_then(|a| a.rsplit(':').next())
        .expect("P launched its bootstrap")
        .to_string();
    let (p_url, d_url) = (producer.url(), consumer.url());
    let mut proxy_args = vec!["proxy", "--port", "0", "--prefill", &p_url, &bootstrap_port, "--decode", &d_url];
    proxy_args.extend_from_slice(proxy_extra);
    let proxy = Proc::spawn("proxy", &proxy_args, &[]).await.expect("proxy starts");
    let client = http_client();
    wait_healthy(&client, &proxy.url(), Duration::from_secs(30)).await.expect("proxy ready");

    for (i, n) in [(1u64, 300usize), (2, 37)] {
        let body = completion(&prompt(n, 40 + i), 16);
        let (status, response) =
            post(&client, &format!("{}/v1/completions", proxy.url()), &body).await.expect("request");
        assert_eq!(status, 200, "{response}");
        assert_eq!(
            token_ids(&response),
            reference_tokens(SMALL, &body).await,
            "request {i}: output differs from an engine on host memory"
        );
    }
    let metrics = client
        .get(format!("{}/metrics", producer.url()))
        .send()
        .await
        .expect("P's metrics")
        .text()
        .await
        .expect("text");
    assert!(
        metrics.contains(&format!(
            "pdflow_transfer_writes_total{{service=\"prefill\",backend=\"{backend}\",outcome=\"ok\"}} 2"
        )),
        "both writes went by {backend}:\n{}",
        metrics.lines().filter(|l| l.contains("writes_total")).collect::<Vec<_>>().join("\n")
    );
    for engine in [&producer, &consumer] {
        engine.assert_blocks_at_baseline(&client, "after the requests").await;
    }
    for p in [proxy, producer, consumer] {
        p.stop().await;
    }
}

#[tokio::test]
async fn a_host_kv_producer_and_a_gpu_kv_consumer_fail_clearly_not_silently() {
    // Without a GPU the consumer does not start (the skip); with one, P on host memory writes
    // by tcp into D's GPU KV, which D's data server refuses: the request still completes (D
    // recomputes), and nothing is corrupted.
    let d_args = ["serve", "--role", "consumer", "--kv-shape", SHAPE, "--num-blocks", "64", "--kv-device", "0"];
    let Some(consumer) = start_or_skip("consumer", &d_args).await else { return };
    let producer = Proc::spawn(
        "producer",
        &["serve", "--role", "producer", "--kv-shape", SHAPE, "--num-blocks", "64", "--bootstrap-port", "0"],
        &[],
    )
    .await
    .expect("producer starts");
    let bootstrap_port =
        producer.ready["bootstrap_addr"].as_str().and_then(|a| a.rsplit(':').next()).expect("bootstrap").to_string();
    let proxy = Proc::proxy(&producer, &bootstrap_port, &consumer).await.expect("proxy starts");
    let client = http_client();
    wait_healthy(&client, &proxy.url(), Duration::from_secs(30)).await.expect("proxy ready");
    let body = completion(&prompt(100, 9), 8);
    let (status, response) = post(&client, &format!("{}/v1/completions", proxy.url()), &body).await.expect("request");
    assert_eq!(status, 200, "{response}");
    assert_eq!(
        token_ids(&response),
        reference_tokens(SMALL, &body).await,
        "D recomputed the prompt: the output is still right"
    );
    let metrics = client
        .get(format!("{}/metrics", producer.url()))
        .send()
        .await
        .expect("P's metrics")
        .text()
        .await
        .expect("text");
    let writes: Vec<&str> = metrics.lines().filter(|l| l.starts_with("pdflow_transfer_writes_total{")).collect();
    assert!(writes.iter().any(|l| l.contains("backend=\"tcp\"")), "P tried its tcp path: {writes:?}");
    assert!(
        !writes.iter().any(|l| l.contains("outcome=\"ok\"")),
        "a tcp write into GPU memory must not succeed: {writes:?}"
    );
    for p in [proxy, producer, consumer] {
        p.stop().await;
    }
}
