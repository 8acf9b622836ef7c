//! Sharded engines (tensor and pipeline parallel, P and D sized independently) as `pdflow serve`
//! processes behind `pdflow proxy`: each rank its own KV cache and sockets — in a process of its
//! own (`--rank-processes`, as vLLM runs one worker process per rank) or in the engine's — every
//! D rank pulling its heads and layers from the P ranks that hold them. Outputs equal one
//! unsharded engine's, and every rank's blocks return to baseline. Plus `pdflow demo
//! --prefill-tp/--decode-tp --json`.

use std::time::Duration;

use pdflow_kv::memory::KvShape;
use pdflow_tests::processes::{rank_processes_of, run_demo, Proc};
use pdflow_tests::{completion, http_client, post, prompt, reference_tokens, token_ids, wait_healthy};

/// 4 layers, 8 KV heads (P and D split them 1, 2 or 4 ways), block 16.
const EIGHT_HEADS: (&str, KvShape) =
    ("4,8,16,16", KvShape { num_layers: 4, num_kv_heads: 8, head_dim: 16, dtype_bytes: 2, block_size: 16 });
/// 2 KV heads: at tp 4 each head lives on two ranks.
const TWO_HEADS: (&str, KvShape) =
    ("4,2,16,16", KvShape { num_layers: 4, num_kv_heads: 2, head_dim: 16, dtype_bytes: 2, block_size: 16 });

/// Where each rank's worker runs.
#[derive(Clone, Copy, PartialEq)]
enum Ranks {
    /// Each rank in a process of its own (`--rank-processes`).
    Apart,
    /// Every rank in the engine's process.
    InEngine,
}

/// P (tp, pp) and D (tp, pp) as processes; three requests through the proxy.
async fn serve_pair(model: (&str, KvShape), p: (u32, u32), d: (u32, u32), ranks: Ranks) {
    let (shape_flag, shape) = model;
    let (ptp, ppp, dtp, dpp) = (p.0.to_string(), p.1.to_string(), d.0.to_string(), d.1.to_string());
    let bootstrap = Proc::spawn("bootstrap", &["bootstrap", "--port", "0"], &[]).await.expect("bootstrap starts");
    let bootstrap_addr = bootstrap.ready["addr"].as_str().expect("addr").to_string();
    let bootstrap_port = bootstrap_addr.rsplit(':').next().expect("port").to_string();
    let bootstrap_url = format!("http://{bootstrap_addr}");
    let common = ["--kv-shape", shape_flag, "--num-blocks", "128"];
    let mut p_args = vec!["serve", "--role", "producer", "--bootstrap-url", &bootstrap_url];
    p_args.extend(["--tensor-parallel-size", &ptp, "--pipeline-parallel-size", &ppp, "--verify-checksums"]);
    p_args.extend(common);
    let apart = ranks == Ranks::Apart;
    if apart && p.0 * p.1 > 1 {
        p_args.push("--rank-processes");
    }
    let producer = Proc::spawn("producer", &p_args, &[]).await.expect("producer starts");
    let mut d_args = vec!["serve", "--role", "consumer", "--kv-load-failure-policy", "fail"];
    d_args.extend(["--tensor-parallel-size", &dtp, "--pipeline-parallel-size", &dpp, "--verify-checksums"]);
    d_args.extend(common);
    if apart && d.0 * d.1 > 1 {
        d_args.push("--rank-processes");
    }
    let consumer = Proc::spawn("consumer", &d_args, &[]).await.expect("consumer starts");
    let proxy = Proc::proxy(&producer, &bootstrap_port, &consumer).await.expect("proxy starts");
    let client = http_client();
    wait_healthy(&client, &proxy.url(), Duration::from_secs(20)).await.expect("proxy ready");
    let case = format!("P tp {} pp {} → D tp {} pp {}, {} KV heads", p.0, p.1, d.0, d.1, shape.num_kv_heads);
    for (engine, (tp, pp)) in [(&producer, p), (&consumer, d)] {
        let expected = if apart && tp * pp > 1 { (tp * pp) as usize } else { 0 };
        assert_eq!(rank_processes_of(engine).len(), expected, "{case}: {}'s rank processes", engine.name);
    }
    for (i, tokens) in [400usize, 33, 250].into_iter().enumerate() {
        let body = completion(&prompt(tokens, 90 + i as u64), 16);
        let (status, response) =
            post(&client, &format!("{}/v1/completions", proxy.url()), &body).await.expect("request");
        assert_eq!(status, 200, "{case}: {response}");
        assert_eq!(token_ids(&response), reference_tokens(shape, &body).await, "{case}, prompt of {tokens} tokens");
    }
    for engine in [&producer, &consumer] {
        engine.assert_blocks_at_baseline(&client, &case).await;
    }
    // Every P rank registered at the bootstrap under its tp and pp ranks.
    let query: serde_json::Value =
        client.get(format!("{bootstrap_url}/query")).send().await.expect("query").json().await.expect("json");
    let workers = &query["0"]["worker_addr"];
    let registered: usize =
        workers.as_object().map_or(0, |tps| tps.values().filter_map(|pps| pps.as_object()).map(|pps| pps.len()).sum());
    assert_eq!(registered, (p.0 * p.1) as usize, "{case}: every P rank registers: {query}");
    for proc in [proxy, consumer, producer, bootstrap] {
        proc.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn p_tp2_to_d_tp1() {
    serve_pair(EIGHT_HEADS, (2, 1), (1, 1), Ranks::Apart).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn p_tp1_to_d_tp2() {
    serve_pair(EIGHT_HEADS, (1, 1), (2, 1), Ranks::Apart).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn p_tp4_to_d_tp2() {
    serve_pair(EIGHT_HEADS, (4, 1), (2, 1), Ranks::Apart).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn p_pp2_to_d_pp1() {
    serve_pair(EIGHT_HEADS, (1, 2), (1, 1), Ranks::Apart).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicated_heads_p_tp4_to_d_tp1_and_d_tp4() {
    serve_pair(TWO_HEADS, (4, 1), (1, 1), Ranks::InEngine).await;
    serve_pair(TWO_HEADS, (1, 1), (4, 2), Ranks::InEngine).await;
}

/// `pdflow demo` with heterogeneous TP verifies every D rank's KV against the model and the
/// output against one unsharded engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_verifies_heterogeneous_tp_per_rank() {
    let (report, _) = run_demo(&["--prefill-tp", "4", "--decode-tp", "2", "--max-tokens", "16"]).await;
    assert_eq!(report["verified"], true, "{report}");
    assert_eq!(report["output_matches_reference"], true);
    let checks = report["rank_checks"].as_array().expect("rank checks");
    assert_eq!(checks.len(), 2, "one check per D rank: {report}");
    assert!(checks.iter().all(|c| c["ok"] == true), "{report}");
    // P's 4 ranks each wrote its 2 heads to the D rank holding them: the whole prompt's KV, once.
    let writes = report["rank_writes"].as_array().expect("rank writes");
    assert_eq!(writes.len(), 4, "{report}");
    assert_eq!(report["kv_bytes"], 148_635_648u64);
}

/// The value of `name{engine_id="…"}` for each engine in a Prometheus text.
fn per_engine(metrics: &str, name: &str) -> std::collections::BTreeMap<String, f64> {
    metrics
        .lines()
        .filter_map(|line| line.strip_prefix(name)?.strip_prefix("{engine_id=\""))
        .filter_map(|rest| {
            let (id, value) = rest.split_once("\"} ")?;
            Some((id.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

/// P and D each a data-parallel group of 2 engines behind one API (`--data-parallel-size 2`), P
/// launching the bootstrap. The bootstrap answers per dp_rank (one engine id each, vLLM's
/// `{engine_id}_dp{rank}`); the proxy names a P rank per request (`X-data-parallel-rank`) and
/// D pulls from the engine it names. Both P ranks serve, outputs equal one engine's, no block is
/// held on any rank, and a rank the server does not run is refused with a clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn data_parallel_p_and_d_through_the_proxy() {
    data_parallel_through_the_proxy(&[], 1).await;
}

/// The same with each P engine at tensor-parallel size 2, each rank in a process of its own:
/// four rank processes under P, each engine's two ranks registered under its dp_rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn data_parallel_p_with_a_process_per_rank() {
    data_parallel_through_the_proxy(&["--tensor-parallel-size", "2", "--rank-processes"], 2).await;
}

/// P and D at DP 2 through the proxy, P with `p_extra` flags and `p_tp` tensor ranks per engine.
async fn data_parallel_through_the_proxy(p_extra: &[&str], p_tp: usize) {
    let (shape_flag, shape) = EIGHT_HEADS;
    let common = ["--kv-shape", shape_flag, "--num-blocks", "128", "--data-parallel-size", "2", "--verify-checksums"];
    let mut p_args = vec!["serve", "--role", "producer", "--bootstrap-port", "0"];
    p_args.extend(common);
    p_args.extend(p_extra);
    let producer = Proc::spawn("producer", &p_args, &[]).await.expect("producer starts");
    let mut d_args = vec!["serve", "--role", "consumer", "--kv-load-failure-policy", "fail"];
    d_args.extend(common);
    let consumer = Proc::spawn("consumer", &d_args, &[]).await.expect("consumer starts");
    let p_ids: Vec<String> =
        serde_json::from_value(producer.ready["engine_ids"].clone()).expect("P announces its engine ids");
    assert_eq!(p_ids.len(), 2, "{}", producer.ready);
    let bootstrap_addr = producer.ready["bootstrap_addr"].as_str().expect("P launched the bootstrap").to_string();
    let bootstrap_port = bootstrap_addr.rsplit(':').next().expect("port").to_string();
    let client = http_client();
    let query: serde_json::Value =
        client.get(format!("http://{bootstrap_addr}/query")).send().await.expect("query").json().await.expect("json");
    for (rank, id) in p_ids.iter().enumerate() {
        assert_eq!(query[rank.to_string()]["engine_id"], id.as_str(), "dp rank {rank} at the bootstrap: {query}");
        let tp_ranks = query[rank.to_string()]["worker_addr"].as_object().map_or(0, |tps| tps.len());
        assert_eq!(tp_ranks, p_tp, "dp rank {rank}'s tensor ranks at the bootstrap: {query}");
    }
    let apart = if p_extra.contains(&"--rank-processes") { 2 * p_tp } else { 0 };
    assert_eq!(rank_processes_of(&producer).len(), apart, "P's rank processes");
    let proxy = Proc::proxy(&producer, &bootstrap_port, &consumer).await.expect("proxy starts");
    wait_healthy(&client, &proxy.url(), Duration::from_secs(20)).await.expect("proxy ready");
    for (i, tokens) in [300usize, 40, 170, 90].into_iter().enumerate() {
        let body = completion(&prompt(tokens, 300 + i as u64), 12);
        let (status, response) =
            post(&client, &format!("{}/v1/completions", proxy.url()), &body).await.expect("request");
        assert_eq!(status, 200, "request {i}: {response}");
        assert_eq!(token_ids(&response), reference_tokens(shape, &body).await, "request {i}, {tokens} tokens");
    }
    let metrics = client.get(format!("{}/metrics", producer.url())).send().await.expect("metrics");
    let finished = per_engine(&metrics.text().await.expect("text"), "pdflow_requests_finished");
    for id in &p_ids {
        assert!(finished.get(id).copied().unwrap_or(0.0) >= 1.0, "P rank {id} served a prefill: {finished:?}");
    }
    for engine in [&producer, &consumer] {
        engine.assert_blocks_at_baseline(&client, "data parallel").await;
    }
    // A rank outside the group is refused, naming the ranks it runs.
    let mut bad = client.post(format!("{}/v1/completions", producer.url())).json(&completion(&prompt(20, 1), 2));
    bad = bad.header("X-data-parallel-rank", "2");
    let refused = bad.send().await.expect("request");
    assert_eq!(refused.status(), 400);
    let text = refused.text().await.expect("body");
    assert!(text.contains("data-parallel ranks 0..2"), "{text}");
    for proc in [proxy, consumer, producer] {
        proc.stop().await;
    }
}
