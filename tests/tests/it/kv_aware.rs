//! `pdflow proxy --prefill-policy kv_aware --decode-policy kv_aware` in front of two P and two D
//! (`pdflow serve` processes with prefix caching and KV events, each with a replay socket): a
//! repeated prefix, given as token ids, goes to the P and the D whose prefix caches hold it, as
//! their KV events said; a proxy started again mid-run learns the engines' caches from their
//! replay sockets and routes the prefix to the same engines; with `--local-prefill-when-d-holds`,
//! D alone serves a prompt whose prefix it holds. Engines added at run time with their KV-event
//! endpoints (the admin API, `pdflow admin add --kv-events`) are routed by what their caches hold,
//! and a removed one's events are no longer followed. Every answer equals one engine's alone.

use std::time::Duration;

use pdflow_tests::processes::Proc;
use pdflow_tests::{http_client, post, reference, token_ids, SMALL};
use serde_json::{json, Value};

const SHAPE: &str = "4,2,16,16";
const KV_EVENTS: &str =
    r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0","replay_endpoint":"tcp://*:0"}"#;
const WAIT: Duration = Duration::from_secs(20);

/// `pdflow serve` of `role` with prefix caching and KV events (bound on any port).
async fn engine(role: &'static str) -> Proc {
    let mut args = vec!["serve", "--role", role, "--kv-shape", SHAPE, "--num-blocks", "256"];
    args.extend(["--enable-prefix-caching", "--kv-events-config", KV_EVENTS]);
    if role == "producer" {
        args.extend(["--bootstrap-port", "0"]);
    }
    Proc::spawn(role, &args, &[]).await.expect("the engine starts")
}

/// `tcp://0.0.0.0:PORT` → `tcp://127.0.0.1:PORT`.
fn local(endpoint: &Value) -> String {
    let port = endpoint.as_str().and_then(|e| e.rsplit(':').next()).expect("a bound endpoint");
    format!("tcp://127.0.0.1:{port}")
}

/// `--kv-events URL=ENDPOINT,replay=ENDPOINT` of an engine.
fn kv_events(engine: &Proc) -> String {
    let kv = &engine.ready["kv_events"];
    format!("{}={},replay={}", engine.url(), local(&kv["endpoint"]), local(&kv["replay_endpoint"]))
}

/// `pdflow proxy` with kv_aware pools over `ps` and `ds`, plus `extra`.
async fn proxy(ps: &[Proc], ds: &[Proc], extra: &[&str]) -> Proc {
    let mut args: Vec<String> = ["proxy", "--port", "0", "--prefill-policy", "kv_aware", "--decode-policy", "kv_aware"]
        .map(String::from)
        .to_vec();
    // Every request through P unless the test says otherwise (D alone is on by default here).
    if !extra.contains(&"--local-prefill-when-d-holds") {
        args.extend(["--local-prefill-when-d-holds".into(), "off".into()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    for p in ps {
        let bootstrap = p.ready["bootstrap_addr"].as_str().expect("P's bootstrap");
        let port = bootstrap.rsplit(':').next().unwrap_or_default().to_owned();
        args.extend(["--prefill".into(), p.url(), port, "--kv-events".into(), kv_events(p)]);
    }
    for d in ds {
        args.extend(["--decode".into(), d.url(), "--kv-events".into(), kv_events(d)]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let proxy = Proc::spawn("proxy", &args, &[]).await.expect("the proxy starts");
    pdflow_tests::wait_healthy(&http_client(), &proxy.url(), Duration::from_secs(10))
        .await
        .expect("the proxy is ready");
    proxy
}

async fn finished(client: &reqwest::Client, engine: &Proc) -> u64 {
    let stats: Value =
        client.get(format!("{}/pdflow/blocks", engine.url())).send().await.expect("stats").json().await.expect("JSON");
    stats["finished"].as_u64().unwrap_or_default()
}

/// The sum of the proxy's `/metrics` samples of `family` whose labels include every one of `labels`.
async fn metric(client: &reqwest::Client, proxy: &Proc, family: &str, labels: &[(&str, &str)]) -> f64 {
    let text =
        client.get(format!("{}/metrics", proxy.url())).send().await.expect("metrics").text().await.expect("text");
    text.lines()
        .filter(|l| l.starts_with(&format!("{family}{{")))
        .filter(|l| labels.iter().all(|(k, v)| l.contains(&format!("{k}=\"{v}\""))))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn routes(client: &reqwest::Client, proxy: &Proc, pool: &str, choice: &str) -> f64 {
    metric(client, proxy, "pdflow_proxy_routes_total", &[("pool", pool), ("choice", choice)]).await
}

/// Waits until the proxy applied KV events of `engine`.
async fn learned(client: &reqwest::Client, proxy: &Proc, engine: &Proc) {
    let url = engine.url();
    let deadline = tokio::time::Instant::now() + WAIT;
    while metric(client, proxy, "pdflow_proxy_kv_events_total", &[("engine", &url), ("outcome", "applied")]).await < 1.0
    {
        assert!(tokio::time::Instant::now() < deadline, "the proxy never applied a KV event of {url}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A completion of the shared 200-token prefix and four tokens of its own, as token ids.
fn body(turn: u64) -> Value {
    let mut ids: Vec<u64> = (0..200u64).map(|i| (i * 7919 + 13) % 1000).collect();
    ids.extend((0..4).map(|i| 1000 + turn * 4 + i));
    json!({"model": "Qwen/Qwen3-8B", "prompt": ids, "max_tokens": 4, "temperature": 0})
}

async fn ask(client: &reqwest::Client, proxy: &Proc, turn: u64) {
    let body = body(turn);
    let (status, answer) =
        post(client, &format!("{}/v1/completions", proxy.url()), &body).await.expect("the proxy answers");
    assert_eq!(status, 200, "{answer}");
    assert_eq!(token_ids(&answer), token_ids(&reference(SMALL, &body).await.expect("reference")));
}

/// Requests each P finished since `before`.
async fn prefilled(client: &reqwest::Client, ps: &[Proc], before: &[u64]) -> Vec<u64> {
    let mut done = Vec::new();
    for (p, before) in ps.iter().zip(before) {
        done.push(finished(client, p).await - before);
    }
    done
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_aware_routes_a_prefix_to_the_engines_that_hold_it_and_a_restarted_proxy_replays_their_events() {
    let client = http_client();
    let ps = vec![engine("producer").await, engine("producer").await];
    let ds = vec![engine("consumer").await, engine("consumer").await];
    let first = proxy(&ps, &ds, &[]).await;

    // The first request: no engine holds anything, the least loaded P and D.
    let before: Vec<u64> = futures::future::join_all(ps.iter().map(|p| finished(&client, p))).await;
    let d_before: Vec<u64> = futures::future::join_all(ds.iter().map(|d| finished(&client, d))).await;
    ask(&client, &first, 0).await;
    let done = prefilled(&client, &ps, &before).await;
    let x = done.iter().position(|n| *n == 1).expect("one P prefilled the first request");
    let y = prefilled(&client, &ds, &d_before).await.iter().position(|n| *n == 1).expect("one D served it");
    learned(&client, &first, &ps[x]).await;
    learned(&client, &first, &ds[y]).await;

    // The same prefix three times more: to the P and the D that hold it (round robin or least
    // loaded would alternate between two idle engines).
    for turn in 1..4 {
        ask(&client, &first, turn).await;
    }
    let mut want = vec![0, 0];
    want[x] = 4;
    assert_eq!(prefilled(&client, &ps, &before).await, want, "every request of the prefix went to P{x}");
    want[x] = 0;
    want[y] = 4;
    assert_eq!(prefilled(&client, &ds, &d_before).await, want, "every request of the prefix went to D{y}");
    assert_eq!(routes(&client, &first, "prefill", "kv_hit").await, 3.0);
    assert_eq!(routes(&client, &first, "decode", "kv_hit").await, 3.0);
    first.stop().await;

    // A proxy started again knows nothing but what the engines' replay sockets keep.
    let again = proxy(&ps, &ds, &[]).await;
    learned(&client, &again, &ps[x]).await;
    learned(&client, &again, &ds[y]).await;
    let replays = metric(&client, &again, "pdflow_proxy_kv_stream_total", &[("event", "replay")]).await;
    assert!(replays >= 4.0, "each engine's kept batches were replayed: {replays}");
    let before: Vec<u64> = futures::future::join_all(ps.iter().map(|p| finished(&client, p))).await;
    for turn in 4..6 {
        ask(&client, &again, turn).await;
    }
    let mut want = vec![0, 0];
    want[x] = 2;
    assert_eq!(prefilled(&client, &ps, &before).await, want, "after the restart, the prefix still went to P{x}");
    assert_eq!(routes(&client, &again, "prefill", "kv_hit").await, 2.0);
    again.stop().await;

    // D alone serves a prompt whose prefix its KV events say it holds: no P, no transfer.
    let alone = proxy(&ps, &ds, &["--local-prefill-when-d-holds", "0.8"]).await;
    learned(&client, &alone, &ds[y]).await;
    let before: Vec<u64> = futures::future::join_all(ps.iter().map(|p| finished(&client, p))).await;
    let d_before = finished(&client, &ds[y]).await;
    ask(&client, &alone, 6).await;
    assert_eq!(prefilled(&client, &ps, &before).await, vec![0, 0], "a P prefilled a prompt D holds");
    assert_eq!(finished(&client, &ds[y]).await, d_before + 1, "D{y}, which holds the prefix, served it");
    assert_eq!(routes(&client, &alone, "prefill", "skipped").await, 1.0);
    assert_eq!(routes(&client, &alone, "decode", "kv_hit").await, 1.0);
    for engine in ps.iter().chain(&ds) {
        engine.assert_blocks_at_baseline(&client, "after kv_aware routing").await;
    }
}

/// `{"endpoint", "replay_endpoint"}` of an engine's KV events, reachable on loopback.
fn kv_endpoint(engine: &Proc) -> Value {
    let kv = &engine.ready["kv_events"];
    json!({"endpoint": local(&kv["endpoint"]), "replay_endpoint": local(&kv["replay_endpoint"])})
}

/// The first 100 tokens of [`body`]'s shared prefix and four of its own.
fn short_body() -> Value {
    let mut ids: Vec<u64> = (0..100u64).map(|i| (i * 7919 + 13) % 1000).collect();
    ids.extend(2000..2004);
    json!({"model": "Qwen/Qwen3-8B", "prompt": ids, "max_tokens": 4, "temperature": 0})
}

async fn applied(client: &reqwest::Client, proxy: &Proc, engine: &Proc) -> f64 {
    let url = engine.url();
    metric(client, proxy, "pdflow_proxy_kv_events_total", &[("engine", &url), ("outcome", "applied")]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_added_at_run_time_with_their_kv_events_are_routed_by_what_they_hold() {
    let client = http_client();
    let ps = vec![engine("producer").await, engine("producer").await];
    let ds = vec![engine("consumer").await, engine("consumer").await];
    // The proxy starts with the first P and D; the second of each joins later.
    let proxy = proxy(&ps[..1], &ds[..1], &[]).await;

    // The first P and D hold the first 100 tokens of the prefix.
    let short = short_body();
    let (status, answer) = post(&client, &format!("{}/v1/completions", proxy.url()), &short).await.expect("answer");
    assert_eq!(status, 200, "{answer}");
    learned(&client, &proxy, &ps[0]).await;
    learned(&client, &proxy, &ds[0]).await;

    // The second P and D hold all 200, computed on each alone before they join.
    for engine in [&ps[1], &ds[1]] {
        let (status, answer) =
            post(&client, &format!("{}/v1/completions", engine.url()), &body(100)).await.expect("answer");
        assert_eq!(status, 200, "{answer}");
    }

    // They join through the admin API with their KV-event endpoints: P by `pdflow admin`, D by JSON.
    let p2 = &ps[1];
    let port = p2.ready["bootstrap_addr"].as_str().and_then(|a| a.rsplit(':').next()).expect("P's bootstrap port");
    let kv = kv_endpoint(p2);
    let kv_flag = format!(
        "{},replay={}",
        kv["endpoint"].as_str().expect("endpoint"),
        kv["replay_endpoint"].as_str().expect("replay")
    );
    let out = tokio::process::Command::new(pdflow_tests::processes::pdflow_bin().expect("pdflow"))
        .args(["admin", "--proxy", &proxy.url(), "add", "prefill", &p2.url(), port, "--kv-events", &kv_flag])
        .output()
        .await
        .expect("pdflow admin runs");
    let added: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert!(out.status.success(), "{added}");
    assert_eq!(added["kv_events"], json!([kv]), "{added}");
    let add_d = json!({"pool": "decode", "url": ds[1].url(), "kv_events": [kv_endpoint(&ds[1])]});
    let resp = client.post(format!("{}/admin/engines", proxy.url())).json(&add_d).send().await.expect("answer");
    assert_eq!(resp.status().as_u16(), 201, "{:?}", resp.text().await);
    // Their caches are learned from their replay sockets, and P's engine id from its bootstrap.
    learned(&client, &proxy, &ps[1]).await;
    learned(&client, &proxy, &ds[1]).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let listed: Value = client
            .get(format!("{}/admin/engines", proxy.url()))
            .send()
            .await
            .expect("list")
            .json()
            .await
            .expect("JSON");
        let healthy = (listed["engines"].as_array().expect("engines").iter()).filter(|e| e["healthy"] == true).count();
        if healthy == 4 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "not every engine in rotation: {listed}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The prefix goes to the engines that hold most of it: the ones added at run time (without
    // their events, the first P and D, which hold a part, would win).
    let before: Vec<u64> = futures::future::join_all(ps.iter().map(|p| finished(&client, p))).await;
    let d_before: Vec<u64> = futures::future::join_all(ds.iter().map(|d| finished(&client, d))).await;
    for turn in 101..104 {
        ask(&client, &proxy, turn).await;
    }
    assert_eq!(prefilled(&client, &ps, &before).await, vec![0, 3], "the prefix went to the P added at run time");
    assert_eq!(prefilled(&client, &ds, &d_before).await, vec![0, 3], "and to the D added at run time");
    assert_eq!(routes(&client, &proxy, "prefill", "kv_hit").await, 3.0);

    // Removed, its events are no longer followed.
    let remove = json!({"url": ds[1].url(), "force": true});
    let resp = client.post(format!("{}/admin/engines/remove", proxy.url())).json(&remove).send().await.expect("answer");
    assert_eq!(resp.status().as_u16(), 200);
    let applied_then = applied(&client, &proxy, &ds[1]).await;
    let (status, _) = post(&client, &format!("{}/v1/completions", ds[1].url()), &body(200)).await.expect("answer");
    assert_eq!(status, 200);
    let other = json!({"model": "Qwen/Qwen3-8B", "prompt": (3000..3100).collect::<Vec<u64>>(), "max_tokens": 2});
    let (status, _) = post(&client, &format!("{}/v1/completions", ds[1].url()), &other).await.expect("answer");
    assert_eq!(status, 200);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(applied(&client, &proxy, &ds[1]).await, applied_then, "a removed engine's events were still applied");
    for engine in ps.iter().chain(&ds) {
        engine.assert_blocks_at_baseline(&client, "after engines joined with their KV events").await;
    }
}
