//! No refused request pins P's blocks. Through `pdflow proxy`, a field only D would refuse (P's
//! copy is rewritten: `max_tokens: -1`, `stream: "yes"`) is a 400 naming it that neither engine
//! sees, even sent five a second; a request D refuses for a reason the proxy cannot see (a prompt
//! over D's max_model_len, P's being larger) leaves P at its baseline within 1 s. And without the
//! proxy's check — a D request whose body D's API refuses, after P finished and holds the blocks
//! for the transfer it names — D still tells P to free them, within 1 s, not at P's send expiry
//! (20 s here). In one process and as separate `pdflow` processes. And a D the proxy cannot reach
//! (it never answers, or its port is closed) leaves P at its baseline within 1 s too: the proxy
//! tells P's workers to free the transfer.

use std::time::{Duration, Instant};

use pdflow_tests::direct::{decode_body, prefill_body};
use pdflow_tests::processes::ProcCluster;
use pdflow_tests::{completion, post, prompt, Cluster, ClusterSpec, Endpoints, EngineEndpoint, EngineOpts};
use serde_json::Value;

/// How soon P's blocks must be back after a refusal (its send expiry is 20 s).
const FREED_WITHIN: Duration = Duration::from_secs(1);

fn spec() -> ClusterSpec {
    let mut spec = ClusterSpec::one_p_one_d(); // send expiry 20 s: the test must not need it
    spec.prefill = vec![EngineOpts { num_blocks: 128, ..EngineOpts::default() }];
    spec.decode = vec![EngineOpts { max_model_len: 256, ..EngineOpts::default() }];
    spec
}

/// `engine`'s blocks all free and no request held, within [`FREED_WITHIN`] of now; panics naming
/// `what` and the stats otherwise.
async fn at_baseline_within(e: &Endpoints, engine: &EngineEndpoint, what: &str) {
    let deadline = Instant::now() + FREED_WITHIN;
    loop {
        let s = e.block_stats(engine).await.expect("GET /pdflow/blocks");
        if s["free"] == s["total"] && s["requests"] == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: P's blocks are not back within {FREED_WITHIN:?}: {s}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn scenario(e: &Endpoints) {
    let p = &e.prefill[0];
    let finished_before = e.finished(p).await;

    // Fields the proxy rewrites for P, which only D would refuse: a 400 naming the field, five a
    // second for two seconds (the measured load), and P never sees one.
    let bad = |field: &str, value: Value| {
        let mut body = completion(&prompt(200, 3), 16);
        body[field] = value;
        body
    };
    for round in 0..10 {
        for (field, body) in [("max_tokens", bad("max_tokens", (-1).into())), ("stream", bad("stream", "yes".into()))] {
            let (status, answer) = e.post("/v1/completions", &body).await.expect("request");
            assert_eq!(status, 400, "round {round}, {field}: {answer}");
            assert_eq!(answer["error"]["param"], field, "{answer}");
            let message = answer["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains(&format!("`{field}`")), "the message names {field}: {message}");
        }
        at_baseline_within(e, p, "after a request the proxy refused").await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(e.finished(p).await, finished_before, "P ran none of the refused requests");

    // D refuses what the proxy cannot see: prompt + max_tokens over D's max_model_len (256), not
    // over P's (4096).
    let (status, answer) = e.post("/v1/completions", &completion(&prompt(240, 5), 64)).await.expect("request");
    assert!((400..500).contains(&status), "expected D's 4xx, got {status}: {answer}");
    assert!(answer.to_string().contains("maximum context length"), "{answer}");
    at_baseline_within(e, p, "after D refused a prompt over its max_model_len").await;

    // No proxy to check the body: P prefills and holds the blocks for the transfer, then D's API
    // refuses D's request for it (`stream: "yes"`, `max_tokens: -1`) before its engine sees it.
    let bootstrap = p.bootstrap_url.clone().expect("P launched its bootstrap");
    let d_url = format!("{}/v1/completions", e.decode[0].url);
    for (i, (field, value)) in [("stream", Value::from("yes")), ("max_tokens", Value::from(-1))].into_iter().enumerate()
    {
        let text = prompt(150, 40 + i as u64);
        let transfer_id = format!("xfer-refused-{i}-{}", pdflow_tests::uuid_like());
        let (status, answer) =
            post(&e.client, &format!("{}/v1/completions", p.url), &prefill_body(&text, &transfer_id)).await.expect("P");
        assert_eq!(status, 200, "{answer}");
        let held = e.block_stats(p).await.expect("P's stats");
        assert!(held["free"] != held["total"], "P holds the prompt's blocks for D's pull: {held}");
        let mut body = decode_body(&text, 16, &transfer_id, &bootstrap, &p.engine_id);
        body[field] = value;
        let (status, answer) = post(&e.client, &d_url, &body).await.expect("D");
        assert_eq!(status, 400, "D refuses {field}: {answer}");
        at_baseline_within(e, p, &format!("after D's API refused `{field}`")).await;
    }

    // The system still serves, and every engine is back at its baseline.
    let (status, answer) = e.post("/v1/completions", &completion(&prompt(100, 1), 4)).await.expect("request");
    assert_eq!(status, 200, "{answer}");
    e.assert_blocks_at_baseline().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refused_requests_leave_p_at_baseline_in_one_process() {
    let cluster = Cluster::start(spec()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_requests_leave_p_at_baseline_as_processes() {
    let cluster = ProcCluster::start(spec()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}

/// A stand-in D that answers `/health` (so the proxy routes to it) and, for a completion, either
/// never answers (`hang`) or is gone by then (its port closed: connection refused).
async fn fake_d(hang: bool) -> (String, tokio::task::JoinHandle<()>) {
    use axum::routing::{get, post as post_route};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let mut router = axum::Router::new().route("/health", get(|| async { "ok" }));
    if hang {
        router = router.route("/v1/completions", post_route(std::future::pending::<&'static str>));
    }
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    (url, task)
}

/// A proxy in front of the cluster's P and `decode_url`, checking health once a minute (so that
/// a D gone after the first check is still routed to) with a 2 s upstream deadline.
async fn proxy_to(e: &Endpoints, decode_url: &str) -> pdflow_actors::proxy::ProxyServer {
    use kameo::prelude::*;
    use pdflow_actors::proxy::{PrefillTarget, Proxy, ProxyArgs, ProxyServer};
    let p = &e.prefill[0];
    let bootstrap = p.bootstrap_url.as_deref().expect("P launched its bootstrap");
    let bootstrap_port = bootstrap.rsplit(':').next().and_then(|port| port.parse().ok()).expect("a port");
    let args = ProxyArgs {
        health_interval: Duration::from_secs(60),
        upstream_timeout: Duration::from_secs(2),
        ..ProxyArgs::new(
            "127.0.0.1:0".parse().expect("addr"),
            vec![PrefillTarget { url: p.url.clone(), bootstrap_port }],
            vec![decode_url.to_owned()],
        )
    };
    let (bind, upstream_timeout) = (args.bind, args.upstream_timeout);
    let actor = Proxy::spawn(args);
    let server = ProxyServer::start(bind, actor, upstream_timeout).await.expect("the proxy binds");
    pdflow_tests::wait_healthy(&e.client, &format!("http://{}", server.addr), Duration::from_secs(10))
        .await
        .expect("the proxy is ready");
    server
}

/// D unreachable once the proxy sent P its request: no D will ever pull the transfer, so the
/// proxy tells P to free the blocks — at once, not at P's send expiry (20 s). Both ways D can be
/// unreachable: a D that never answers (the proxy's deadline passes after P finished) and a D
/// whose port is closed (connection refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_d_leaves_p_at_baseline() {
    let cluster = Cluster::start(spec()).await.expect("cluster starts");
    let e = &cluster.endpoints;
    let p = &e.prefill[0];
    for hang in [true, false] {
        let (d_url, d_task) = fake_d(hang).await;
        let proxy = proxy_to(e, &d_url).await;
        if !hang {
            d_task.abort();
            while !d_task.is_finished() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        let url = format!("http://{}/v1/completions", proxy.addr);
        let finished_before = e.finished(p).await;
        let (status, answer) =
            post(&e.client, &url, &completion(&prompt(200, 77), 16)).await.expect("the proxy answers");
        assert!(status >= 500, "D unreachable (hang: {hang}): {status} {answer}");
        if hang {
            assert!(e.finished(p).await > finished_before, "P finished its prefill before D's deadline passed");
        }
        at_baseline_within(e, p, &format!("after D was unreachable (hang: {hang})")).await;
        proxy.shutdown().await;
        d_task.abort();
    }
    cluster.shutdown().await;
}
