//! No refused request pins P's blocks. Through `pdflow proxy`, a field only D would refuse (P's
//! copy is rewritten: `max_tokens: -1`, `stream: "yes"`) is a 400 naming it that neither engine
//! sees, even sent five a second; a request D refuses for a reason the proxy cannot see (a prompt
//! over D's max_model_len, P's being larger) leaves P at its baseline within 1 s. And without the
//! proxy's check — a D request whose body D's API refuses, after P finished and holds the blocks
//! for the transfer it names — D still tells P to free them, within 1 s, not at P's send expiry
//! (20 s here). In one process and as separate `pdflow` processes.

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
