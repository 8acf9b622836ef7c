//! `pdflow proxy --prefill-policy cache_aware` in front of two P and one D (`pdflow serve`
//! processes): the requests of a session, which share its long prefix, all go to the P its first
//! request went to, so that P's prefix cache would hold it; `/metrics` counts the hits and step 8's
//! span says why. Under round robin, the same sessions are split across both P. Every answer equals
//! one engine's alone.

use std::time::Duration;

use pdflow_tests::processes::Proc;
use pdflow_tests::{completion, http_client, post, prompt, reference, token_ids, SMALL};
use serde_json::Value;

const SHAPE: &str = "4,2,16,16";

async fn finished(client: &reqwest::Client, engine: &Proc) -> u64 {
    let stats: Value = client
        .get(format!("{}/pdflow/blocks", engine.url()))
        .send()
        .await
        .expect("block stats")
        .json()
        .await
        .expect("JSON");
    stats["finished"].as_u64().unwrap_or_default()
}

/// `pdflow_proxy_routes_total{pool="prefill",…,choice=CHOICE}` of the proxy.
async fn routes(client: &reqwest::Client, proxy: &Proc, choice: &str) -> f64 {
    let text =
        client.get(format!("{}/metrics", proxy.url())).send().await.expect("metrics").text().await.expect("text");
    text.lines()
        .filter(|l| l.starts_with("pdflow_proxy_routes_total{") && l.contains("pool=\"prefill\""))
        .filter(|l| l.contains(&format!("choice=\"{choice}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Two sessions of four requests each through a proxy with `policy` for P; returns how many
/// requests each P prefilled (per session pair, in order) and the proxy.
async fn run(policy: &str) -> (Vec<u64>, Proc, Vec<Proc>) {
    let client = http_client();
    let engine = |role: &'static str| vec!["serve", "--role", role, "--kv-shape", SHAPE, "--num-blocks", "256"];
    let mut ps = Vec::new();
    for _ in 0..2 {
        let mut args = engine("producer");
        args.extend(["--bootstrap-port", "0"]);
        ps.push(Proc::spawn("producer", &args, &[]).await.expect("P starts"));
    }
    let d = Proc::spawn("consumer", &engine("consumer"), &[]).await.expect("D starts");
    let mut args = vec!["proxy".to_owned(), "--port".into(), "0".into(), "--prefill-policy".into(), policy.into()];
    for p in &ps {
        let bootstrap = p.ready["bootstrap_addr"].as_str().expect("P's bootstrap").to_owned();
        let port = bootstrap.rsplit(':').next().unwrap_or_default().to_owned();
        args.extend(["--prefill".into(), p.url(), port]);
    }
    args.extend(["--decode".into(), d.url()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let proxy = Proc::spawn("proxy", &args, &[]).await.expect("the proxy starts");
    pdflow_tests::wait_healthy(&client, &proxy.url(), Duration::from_secs(10)).await.expect("the proxy is ready");

    let url = format!("{}/v1/completions", proxy.url());
    let mut per_p = Vec::new();
    for session in 0..2u64 {
        let before: Vec<u64> = futures::future::join_all(ps.iter().map(|p| finished(&client, p))).await;
        // A session: one long shared prefix, then a different question each turn.
        let prefix = prompt(200, 9000 + session);
        for turn in 0..4u64 {
            let body = completion(&format!("{prefix} {}", prompt(8, 100 * session + turn)), 4);
            let (status, answer) = post(&client, &url, &body).await.expect("the proxy answers");
            assert_eq!(status, 200, "{answer}");
            assert_eq!(token_ids(&answer), token_ids(&reference(SMALL, &body).await.expect("reference")));
        }
        for (p, before) in ps.iter().zip(before) {
            per_p.push(finished(&client, p).await - before);
        }
    }
    let mut engines = ps;
    engines.push(d);
    (per_p, proxy, engines)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_routing_keeps_a_session_on_one_p_and_round_robin_does_not() {
    let client = http_client();
    let (per_p, proxy, engines) = run("cache_aware").await;
    for (session, counts) in per_p.chunks(2).enumerate() {
        assert!(counts.contains(&4) && counts.contains(&0), "session {session} was split across P: {counts:?}");
    }
    assert_eq!(routes(&client, &proxy, "cache_hit").await, 6.0, "three hits per session");
    drop((proxy, engines));

    let (per_p, _proxy, _engines) = run("round_robin").await;
    for (session, counts) in per_p.chunks(2).enumerate() {
        assert_eq!(counts, [2, 2], "round robin splits session {session}");
    }
}

/// `--local-prefill-below 50` and `--local-prefill-when-d-holds 0.8` (D cache-aware): a short
/// prompt, and a session's later turns whose prefix D already holds, are served by D alone (P
/// prefills nothing, no KV moves); a long new prompt goes through P. Every answer is right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d_alone_serves_short_prompts_and_prompts_it_holds() {
    let client = http_client();
    let engine = |role: &'static str| vec!["serve", "--role", role, "--kv-shape", SHAPE, "--num-blocks", "256"];
    let mut p_args = engine("producer");
    p_args.extend(["--bootstrap-port", "0"]);
    let p = Proc::spawn("producer", &p_args, &[]).await.expect("P starts");
    let d = Proc::spawn("consumer", &engine("consumer"), &[]).await.expect("D starts");
    let bootstrap = p.ready["bootstrap_addr"].as_str().expect("P's bootstrap").to_owned();
    let port = bootstrap.rsplit(':').next().unwrap_or_default().to_owned();
    let args = [
        "proxy",
        "--port",
        "0",
        "--decode-policy",
        "cache_aware",
        "--local-prefill-below",
        "50",
        "--local-prefill-when-d-holds",
        "0.8",
        "--prefill",
        &p.url(),
        &port,
        "--decode",
        &d.url(),
    ];
    let proxy = Proc::spawn("proxy", &args, &[]).await.expect("the proxy starts");
    pdflow_tests::wait_healthy(&client, &proxy.url(), Duration::from_secs(10)).await.expect("the proxy is ready");
    let url = format!("{}/v1/completions", proxy.url());
    let ask = |text: String| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let body = completion(&text, 4);
            let (status, answer) = post(&client, &url, &body).await.expect("the proxy answers");
            assert_eq!(status, 200, "{answer}");
            assert_eq!(token_ids(&answer), token_ids(&reference(SMALL, &body).await.expect("reference")));
        }
    };

    // Short: D alone.
    let before = finished(&client, &p).await;
    ask(prompt(10, 1)).await;
    assert_eq!(finished(&client, &p).await, before, "P prefilled a 10-token prompt");
    // Long and new: through P.
    let prefix = prompt(300, 2);
    ask(format!("{prefix} {}", prompt(4, 3))).await;
    assert_eq!(finished(&client, &p).await, before + 1, "a new 300-token prompt went through P");
    // The same prefix again: D holds it, D alone.
    ask(format!("{prefix} {}", prompt(4, 4))).await;
    assert_eq!(finished(&client, &p).await, before + 1, "P prefilled a prompt D holds");
    assert_eq!(routes(&client, &proxy, "skipped").await, 2.0);
    for engine in [&p, &d] {
        engine.assert_blocks_at_baseline(&client, "after D served alone").await;
    }
}

/// A P that dies before it answered (its process killed at its prefill forward, step 15) costs
/// the client nothing: the proxy sends the request to the other P, and every answer, before and
/// after the health checks eject the dead P, equals one engine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_p_dies_before_answering_is_retried_on_another_p() {
    let client = http_client();
    let engine = |role: &'static str| vec!["serve", "--role", role, "--kv-shape", SHAPE, "--num-blocks", "256"];
    let mut p_args = engine("producer");
    p_args.extend(["--bootstrap-port", "0"]);
    let plan = r#"{"faults": [{"step": 15, "fault": "kill_node", "node": "p"}]}"#;
    let dying = Proc::spawn("producer", &p_args, &[("PDFLOW_FAULT_PLAN", plan)]).await.expect("P starts");
    let p = Proc::spawn("producer", &p_args, &[]).await.expect("P starts");
    let d = Proc::spawn("consumer", &engine("consumer"), &[]).await.expect("D starts");
    let port =
        |p: &Proc| p.ready["bootstrap_addr"].as_str().and_then(|a| a.rsplit(':').next()).unwrap_or_default().to_owned();
    let (dying_port, p_port) = (port(&dying), port(&p));
    let args = [
        "proxy",
        "--port",
        "0",
        "--prefill",
        &dying.url(),
        &dying_port,
        "--prefill",
        &p.url(),
        &p_port,
        "--decode",
        &d.url(),
    ];
    let proxy = Proc::spawn("proxy", &args, &[]).await.expect("the proxy starts");
    pdflow_tests::wait_healthy(&client, &proxy.url(), Duration::from_secs(10)).await.expect("the proxy is ready");
    let url = format!("{}/v1/completions", proxy.url());
    for seed in 0..6 {
        let body = completion(&prompt(60, 500 + seed), 4);
        let (status, answer) = post(&client, &url, &body).await.expect("the proxy answers");
        assert_eq!(status, 200, "request {seed}: {answer}");
        assert_eq!(token_ids(&answer), token_ids(&reference(SMALL, &body).await.expect("reference")));
    }
    let text =
        client.get(format!("{}/metrics", proxy.url())).send().await.expect("metrics").text().await.expect("text");
    let retries = text
        .lines()
        .find_map(|l| l.strip_prefix("pdflow_proxy_prefill_retries_total "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    assert!(retries.is_some_and(|n| n >= 1.0), "the request P died under was retried: {retries:?}");
    for engine in [&p, &d] {
        engine.assert_blocks_at_baseline(&client, "after the retry").await;
    }
}
