//! One process per rank (`pdflow serve --rank-processes`), killed on purpose: a P rank's process
//! killed after it wrote its share of a request's KV into D's blocks but before it told D so
//! (its FINISH held back by the fault plan) ends the request within D's deadline — D recomputes
//! the prompt (policy `recompute`) and answers what one engine answers — with no block held on
//! D. P's engine stops with a failure, as vLLM's engine does when a worker dies, and leaves
//! neither rank processes nor shared memory behind. A rank set-up that cannot work is refused.

use std::time::{Duration, Instant};

use pdflow_kv::memory::KvShape;
use pdflow_tests::processes::{rank_processes_of, Proc};
use pdflow_tests::{completion, http_client, post, prompt, reference_tokens, token_ids, wait_healthy};

const SHAPE: (&str, KvShape) =
    ("4,8,16,16", KvShape { num_layers: 4, num_kv_heads: 8, head_dim: 16, dtype_bytes: 2, block_size: 16 });
/// How long each P rank holds its FINISH back after writing (step 30 begins): the window in which
/// the test kills one of them.
const HOLD_MS: u64 = 5000;
/// When the test kills P's rank 1, after sending the request (the write is done well before).
const KILL_AFTER: Duration = Duration::from_millis(1500);
/// D's pull deadline.
const PULL_TIMEOUT_S: &str = "20";

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default().contains(") Z ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_p_rank_killed_mid_transfer_ends_the_request_and_leaks_nothing() {
    let (shape_flag, shape) = SHAPE;
    let common = ["--kv-shape", shape_flag, "--num-blocks", "128", "--tensor-parallel-size", "2", "--rank-processes"];
    let plan = format!(r#"{{"faults": [{{"step": 30, "when": "begin", "fault": "delay", "ms": {HOLD_MS}}}]}}"#);
    let mut p_args = vec!["serve", "--role", "producer", "--bootstrap-port", "0"];
    p_args.extend(common);
    let mut producer = Proc::spawn("producer", &p_args, &[("PDFLOW_FAULT_PLAN", &plan)]).await.expect("P starts");
    let mut d_args = vec!["serve", "--role", "consumer", "--kv-load-failure-policy", "recompute"];
    d_args.extend(["--pull-timeout", PULL_TIMEOUT_S]);
    d_args.extend(common);
    let consumer = Proc::spawn("consumer", &d_args, &[]).await.expect("D starts");
    let bootstrap_addr = producer.ready["bootstrap_addr"].as_str().expect("P launched its bootstrap").to_string();
    let bootstrap_port = bootstrap_addr.rsplit(':').next().expect("port").to_string();
    let proxy = Proc::proxy(&producer, &bootstrap_port, &consumer).await.expect("proxy starts");
    let client = http_client();
    wait_healthy(&client, &proxy.url(), Duration::from_secs(20)).await.expect("proxy ready");
    let p_ranks = rank_processes_of(&producer);
    assert_eq!(p_ranks.len(), 2, "P runs one process per rank");
    let p_pid = producer.child.id().expect("P runs");

    let body = completion(&prompt(300, 4), 8);
    let expected = reference_tokens(shape, &body).await;
    let url = format!("{}/v1/completions", proxy.url());
    let request_client = client.clone();
    let request = tokio::spawn(async move { post(&request_client, &url, &body).await });
    tokio::time::sleep(KILL_AFTER).await;
    // Only the held FINISH keeps the request open this long (unheld, it ends in well under 1 s).
    assert!(!request.is_finished(), "the request is open when the rank dies: the fault plan held P's FINISH");
    let victim = p_ranks[1];
    // SAFETY: kill(2) with a pid this test read from /proc as P's child; no memory is touched.
    assert_eq!(unsafe { libc::kill(victim as i32, libc::SIGKILL) }, 0, "P's rank 1 is killed");

    let deadline = Duration::from_secs(PULL_TIMEOUT_S.parse::<u64>().expect("seconds") + 30);
    let (status, response) = tokio::time::timeout(deadline, request)
        .await
        .expect("the request ends within D's deadline")
        .expect("request task")
        .expect("the proxy answers");
    assert_eq!(status, 200, "D recomputes the prompt it could not load: {response}");
    assert_eq!(token_ids(&response), expected, "D's tokens are one engine's");
    consumer.assert_blocks_at_baseline(&client, "after P's rank died mid-transfer").await;

    // P's engine stops with a failure; its other rank goes with it; no shared memory is left.
    let status = tokio::time::timeout(Duration::from_secs(20), producer.child.wait())
        .await
        .expect("P's engine stops once a rank died")
        .expect("P's exit status");
    assert!(!status.success(), "P exits with a failure: {status}");
    let deadline = Instant::now() + Duration::from_secs(15);
    while p_ranks.iter().any(|pid| alive(*pid)) {
        assert!(Instant::now() < deadline, "P's rank processes outlived it: {p_ranks:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| d.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect())
        .unwrap_or_default();
    let prefix = format!("pdflow-{p_pid}-");
    assert!(!left.iter().any(|f| f.starts_with(&prefix)), "P's shared KV is gone: {left:?}");
    for proc in [proxy, consumer] {
        proc.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rank_processes_without_parallelism_are_refused_naming_the_flags() {
    let bin = pdflow_tests::processes::pdflow_bin().expect("pdflow built");
    let out = tokio::process::Command::new(bin)
        .args(["serve", "--role", "producer", "--rank-processes"])
        .output()
        .await
        .expect("runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--rank-processes") && err.contains("--tensor-parallel-size"), "{err}");
}
