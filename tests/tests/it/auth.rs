//! The cluster secret end to end, through the proxy, P and D in one process over real sockets:
//! with the same secret on both engines every request is served with the reference's tokens; a
//! D holding another secret (or none) never gets P's KV — P's bootstrap refuses its look-up, so
//! D never learns P's side channel and fails the load cleanly under `fail` (and computes it
//! itself under `recompute`), and P frees the blocks at its send expiry: none is left held on
//! either side. An attacker's registrations at P's bootstrap — unsigned, signed with another
//! secret, a real one replayed or re-pointed — are refused and the table keeps the real P.

use std::time::Duration;

use pdflow_auth::http::{open_answer, sign_call, Call, AUTH_HEADER, REPLY_HEADER};
use pdflow_auth::ClusterSecret;
use pdflow_messages::bootstrap::QueryResponse;
use pdflow_node::config::Deadlines;
use pdflow_sim_engine::LoadFailurePolicy;
use pdflow_tests::{completion, prompt, reference_tokens, token_ids, Cluster, ClusterSpec, EngineOpts};

fn secret(text: &str) -> Option<String> {
    Some(text.to_string())
}

fn spec(p: Option<String>, d: Option<String>, policy: LoadFailurePolicy) -> ClusterSpec {
    let mut spec = ClusterSpec::one_p_one_d();
    // Short deadlines: a refused D waits for its pull deadline, P for its send expiry.
    spec.deadlines = Deadlines::from_abort_timeout(Duration::from_secs(2));
    spec.prefill = vec![EngineOpts { secret: p, ..EngineOpts::default() }];
    spec.decode = vec![EngineOpts { secret: d, policy, ..EngineOpts::default() }];
    spec
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_one_secret_on_p_and_d_requests_are_served_with_the_reference_tokens() {
    let cluster = Cluster::start(spec(
        secret("the-cluster-secret-0001"),
        secret("the-cluster-secret-0001"),
        LoadFailurePolicy::Fail,
    ))
    .await
    .expect("cluster starts");
    for (len, seed) in [(40, 1), (300, 2)] {
        let body = completion(&prompt(len, seed), 6);
        let (status, answer) = cluster.post("/v1/completions", &body).await.expect("request");
        assert_eq!(status, 200, "{answer}");
        assert_eq!(token_ids(&answer), reference_tokens(cluster.spec.shape, &body).await);
    }
    cluster.assert_blocks_at_baseline().await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_d_without_the_secret_gets_no_kv_and_fails_or_recomputes_cleanly() {
    for (d_secret, policy) in [
        (secret("not-the-cluster-secret"), LoadFailurePolicy::Fail),
        (None, LoadFailurePolicy::Fail),
        (secret("not-the-cluster-secret"), LoadFailurePolicy::Recompute),
    ] {
        let cause = if d_secret.is_none() { "missing" } else { "unknown_key" };
        let before = refusals("bootstrap", cause);
        let cluster = Cluster::start(spec(secret("the-cluster-secret-0001"), d_secret, policy)).await.expect("starts");
        let body = completion(&prompt(120, 3), 6);
        let (status, answer) = cluster.post("/v1/completions", &body).await.expect("request");
        match policy {
            LoadFailurePolicy::Fail => assert!(status >= 400, "D took KV without the secret: {status} {answer}"),
            LoadFailurePolicy::Recompute => {
                assert_eq!(status, 200, "{answer}");
                assert_eq!(token_ids(&answer), reference_tokens(cluster.spec.shape, &body).await, "computed by D");
            }
        }
        cluster.assert_blocks_at_baseline().await;
        assert!(
            refusals("bootstrap", cause) > before,
            "P's bootstrap did not count this case's refused look-up ({cause}): D must not learn P's side channel"
        );
        cluster.shutdown().await;
    }
}

/// `pdflow_auth_refusals_total{socket,cause}` in this process's registry.
fn refusals(socket: &str, cause: &str) -> f64 {
    let series = format!("pdflow_auth_refusals_total{{socket=\"{socket}\",cause=\"{cause}\"}} ");
    let text = pdflow_observability::metrics::global().render();
    text.lines().find_map(|l| l.strip_prefix(series.as_str())).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forged_and_replayed_registrations_are_refused_and_the_real_p_keeps_serving() {
    let the_secret = secret("the-cluster-secret-0001");
    let cluster =
        Cluster::start(spec(the_secret.clone(), the_secret.clone(), LoadFailurePolicy::Fail)).await.expect("starts");
    let s = ClusterSecret::from_text(&the_secret.expect("a secret")).expect("valid secret");
    let bootstrap = cluster.prefill[0].launched_bootstrap_url().expect("P launched its bootstrap");
    let http = pdflow_tests::http_client();

    // The attacker reads the table: refused without a proof.
    let resp = http.get(format!("{bootstrap}/query")).send().await.expect("bootstrap answers");
    assert_eq!(resp.status().as_u16(), 401);
    let (real_addr, real_generation) = signed_query(&http, &s, &bootstrap).await;

    let register = |header: Option<String>, body: String| {
        let mut req = http
            .post(format!("{bootstrap}/register"))
            .header("content-type", "application/json")
            .body(body)
            .timeout(Duration::from_secs(5));
        if let Some(h) = header {
            req = req.header(AUTH_HEADER, h);
        }
        async move {
            let resp = req.send().await.expect("bootstrap answers");
            (resp.status().as_u16(), resp.text().await.unwrap_or_default())
        }
    };
    let engine_id = cluster.prefill[0].engine_id.to_string();
    let worker = |addr: &str, generation: u64| {
        serde_json::json!({"engine_id": engine_id, "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": addr,
            "generation": generation})
        .to_string()
    };
    // A newer generation would replace the real P: the attacker's own side channel.
    let forged = worker("tcp://127.0.0.1:9", u64::MAX);
    let stranger = ClusterSecret::from_text("an attacker's own secret").expect("valid");
    let cases = [
        ("missing", None),
        ("unknown_key", Some(sign_call(&stranger, Call::Register, "POST", "/register", forged.as_bytes()).0)),
    ];
    for (cause, header) in cases {
        let before = refusals("bootstrap", cause);
        let (status, text) = register(header, forged.clone()).await;
        assert_eq!(status, 401, "{cause}: {text}");
        assert!(text.contains("cluster secret"), "the refusal says what to do: {text}");
        assert!(refusals("bootstrap", cause) > before, "{cause} counted");
    }
    // A real registration, seen on the wire and replayed: served once, refused after; its header
    // on another body (the attacker's address) does not pass either.
    let real = worker(&real_addr, real_generation);
    let (header, _) = sign_call(&s, Call::Register, "POST", "/register", real.as_bytes());
    assert_eq!(register(Some(header.clone()), real.clone()).await.0, 200, "the real P's registration");
    let before = refusals("bootstrap", "replayed");
    assert_eq!(register(Some(header.clone()), real).await.0, 401, "a replay");
    assert!(refusals("bootstrap", "replayed") > before);
    let before = refusals("bootstrap", "bad_proof");
    assert_eq!(register(Some(header), forged).await.0, 401, "a real header on a forged body");
    assert!(refusals("bootstrap", "bad_proof") > before);

    assert_eq!(signed_query(&http, &s, &bootstrap).await, (real_addr, real_generation), "the table keeps the real P");
    let body = completion(&prompt(120, 5), 6);
    let (status, answer) = cluster.post("/v1/completions", &body).await.expect("request");
    assert_eq!(status, 200, "{answer}");
    assert_eq!(token_ids(&answer), reference_tokens(cluster.spec.shape, &body).await);
    cluster.assert_blocks_at_baseline().await;
    cluster.shutdown().await;
}

/// A `/query` signed with `s`, its answer's proof checked: P's (tp 0, pp 0) address and generation.
async fn signed_query(http: &reqwest::Client, s: &ClusterSecret, bootstrap: &str) -> (String, u64) {
    let (header, nonce) = sign_call(s, Call::Query, "GET", "/query", b"");
    let resp = http.get(format!("{bootstrap}/query")).header(AUTH_HEADER, header).send().await.expect("answers");
    assert_eq!(resp.status().as_u16(), 200);
    let proof = resp.headers().get(REPLY_HEADER).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let body = resp.bytes().await.expect("body");
    open_answer(s, Call::Query, &body, proof.as_deref(), &nonce).expect("the answer is the bootstrap's, to this query");
    let table: QueryResponse = serde_json::from_slice(&body).expect("a /query answer");
    let entry = &table["0"];
    let addr = entry.workers().expect("ranks")[&0][&0].clone();
    let generation = entry.generation_of(&addr);
    (addr, generation)
}
