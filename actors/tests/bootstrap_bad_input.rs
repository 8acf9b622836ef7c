//! Fuzz target (bad input) for the Bootstrap actor's HTTP server (seed steps 4, 7, 20):
//! a real [`Bootstrap`] on 127.0.0.1:0, fed arbitrary and near-valid `/register` bodies over HTTP.
//!
//! - A malformed body gets a 4xx with a clear message (`{"error": …, "detail": …}` naming what was
//!   expected), never a 5xx, and the server keeps serving: `/query` and `/health` answer and a
//!   valid registration afterwards appears in `/query`.
//! - Nothing a refused body carries reaches the table.
//! - `/query` takes no engine id (vLLM's bootstrap answers the whole table); an unknown engine id is
//!   simply absent from it, and an unknown path is a 404. D's side of an unknown engine id is
//!   tested in the receiver (`crates/actors/src/receiver/bad_input_tests.rs`).

use std::time::Duration;

use kameo::prelude::*;
use pdflow_actors::bootstrap::{Bootstrap, BootstrapArgs};
use pdflow_messages::bootstrap::{BootstrapAddr, QueryResponse};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::Value;

const BOUND: Duration = Duration::from_secs(5);

fn cfg(cases: u32) -> Config {
    Config { cases, failure_persistence: None, ..Config::default() }
}

async fn start() -> (ActorRef<Bootstrap>, String) {
    let actor =
        Bootstrap::spawn(BootstrapArgs { bind: "127.0.0.1:0".parse().expect("addr"), secret: None, insecure: false });
    let addr = tokio::time::timeout(BOUND, actor.ask(BootstrapAddr))
        .await
        .expect("bootstrap answers in time")
        .expect("bootstrap started");
    (actor, format!("http://{addr}"))
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().timeout(BOUND).build().expect("http client")
}

/// POSTs `body` to `/register` with `content_type`; returns the status and the body as text.
async fn register(http: &reqwest::Client, base: &str, content_type: &str, body: Vec<u8>) -> (u16, String) {
    let resp = http
        .post(format!("{base}/register"))
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .expect("bootstrap answers /register");
    let status = resp.status().as_u16();
    (status, resp.text().await.expect("a body"))
}

async fn query(http: &reqwest::Client, base: &str) -> QueryResponse {
    let resp = http.get(format!("{base}/query")).send().await.expect("bootstrap answers /query");
    assert_eq!(resp.status().as_u16(), 200);
    resp.json().await.expect("a /query answer")
}

/// The engines and addresses of a `/query` answer, flattened.
fn table(q: &QueryResponse) -> Vec<(String, String, String, String, String)> {
    let mut out = Vec::new();
    for (dp, e) in q {
        for (tp, pps) in &e.worker_addr {
            for (pp, addr) in pps {
                out.push((dp.clone(), e.engine_id.to_string(), tp.clone(), pp.clone(), addr.clone()));
            }
        }
    }
    out
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        prop::collection::vec(any::<char>(), 0..10).prop_map(String::from_iter),
        Just("fuzz".to_string())
    ]
}

fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        text().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(text(), inner, 0..4).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// `/register` bodies with every field present, missing or of the wrong type, all under engine ids
/// prefixed `fuzz-` at dp ranks 100 and up (so they never collide with the test's own engine).
fn near_register() -> impl Strategy<Value = Value> {
    let field = |good: BoxedStrategy<Value>| prop::option::weighted(0.85, prop_oneof![5 => good, 1 => json()]);
    (
        field(text().prop_map(|t| Value::String(format!("fuzz-{t}"))).boxed()),
        field((100u32..104).prop_map(Value::from).boxed()),
        field((0u32..3).prop_map(Value::from).boxed()),
        field((0u32..2).prop_map(Value::from).boxed()),
        field(text().prop_map(|t| Value::String(format!("tcp://{t}"))).boxed()),
    )
        .prop_map(|(engine_id, dp, tp, pp, addr)| {
            let mut body = serde_json::Map::new();
            for (k, v) in [("engine_id", engine_id), ("dp_rank", dp), ("tp_rank", tp), ("pp_rank", pp), ("addr", addr)]
            {
                if let Some(v) = v {
                    body.insert(k.to_string(), v);
                }
            }
            Value::Object(body)
        })
}

/// One request's body and content type.
fn request() -> impl Strategy<Value = (String, Vec<u8>)> {
    prop_oneof![
        3 => near_register().prop_map(|v| ("application/json".to_string(), v.to_string().into_bytes())),
        1 => json().prop_map(|v| ("application/json".to_string(), v.to_string().into_bytes())),
        1 => prop::collection::vec(any::<u8>(), 0..64).prop_map(|b| ("application/json".to_string(), b)),
        // Truncated valid bodies.
        1 => (near_register(), any::<usize>()).prop_map(|(v, cut)| {
            let t = v.to_string().into_bytes();
            ("application/json".to_string(), t[..cut % t.len()].to_vec())
        }),
        1 => near_register().prop_map(|v| ("text/plain".to_string(), v.to_string().into_bytes())),
    ]
}

#[test]
fn malformed_register_bodies_get_a_clear_4xx_and_bootstrap_keeps_serving() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let (actor, base) = rt.block_on(start());
    let http = client();
    let seed = serde_json::json!({"engine_id": "6c1f", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://10.0.0.1:41235"});
    rt.block_on(async {
        assert_eq!(register(&http, &base, "application/json", seed.to_string().into_bytes()).await.0, 200);
    });
    let mut runner = TestRunner::new(cfg(96));
    runner
        .run(&request(), |(content_type, body)| {
            rt.block_on(async {
                let before = table(&query(&http, &base).await);
                let (status, text) = register(&http, &base, &content_type, body.clone()).await;
                let shown = String::from_utf8_lossy(&body).into_owned();
                prop_assert!(status == 200 || (400..500).contains(&status), "{} for {:?}: {}", status, shown, text);
                let after = table(&query(&http, &base).await);
                if status == 200 {
                    // Only a well-formed registration is accepted, and it is what the table gains.
                    let w: pdflow_messages::bootstrap::RegisterWorker = serde_json::from_slice(&body)
                        .map_err(|e| TestCaseError::fail(format!("accepted {shown:?}: {e}")))?;
                    let row = (
                        w.dp_rank.to_string(),
                        w.engine_id.into_string(),
                        w.tp_rank.to_string(),
                        w.pp_rank.to_string(),
                        w.addr,
                    );
                    prop_assert!(after.contains(&row), "accepted but not in /query: {:?}", row);
                    prop_assert!(after.iter().all(|r| before.contains(r) || *r == row));
                } else {
                    prop_assert_eq!(&after, &before, "a refused body changed the table");
                    if status == 400 {
                        let reply: Value = serde_json::from_str(&text)
                            .map_err(|e| TestCaseError::fail(format!("400 body {text:?}: {e}")))?;
                        let error = reply["error"].as_str().unwrap_or_default();
                        prop_assert!(!error.is_empty() && reply["detail"] == reply["error"], "{}", text);
                        prop_assert!(
                            error.contains("invalid /register body") || error.contains("already"),
                            "the 400 says what is wrong: {}",
                            error
                        );
                    } else {
                        // 415 (no JSON content type), 422 and the like come from axum: still a reason.
                        prop_assert!(!text.is_empty(), "{} with an empty body", status);
                    }
                }
                Ok(())
            })
        })
        .expect("every malformed body is a clear 4xx");
    rt.block_on(async {
        // Still serving: health, a new valid registration, and the seed's entry intact.
        let health = http.get(format!("{base}/health")).send().await.expect("health");
        assert_eq!(health.status().as_u16(), 200);
        let next = serde_json::json!({"engine_id": "6c1f", "dp_rank": 0, "tp_rank": 1, "pp_rank": 0, "addr": "tcp://10.0.0.1:41236"});
        assert_eq!(register(&http, &base, "application/json", next.to_string().into_bytes()).await.0, 200);
        let q = query(&http, &base).await;
        let workers = q["0"].workers().expect("numeric ranks");
        assert_eq!(workers[&0][&0], "tcp://10.0.0.1:41235");
        assert_eq!(workers[&1][&0], "tcp://10.0.0.1:41236");
        actor.stop_gracefully().await.expect("stop");
        tokio::time::timeout(BOUND, actor.wait_for_shutdown()).await.expect("bootstrap stops in time");
    });
}

#[tokio::test]
async fn oversize_and_deeply_nested_bodies_are_refused_and_bootstrap_keeps_serving() {
    let (_actor, base) = start().await;
    let http = client();
    // 100k levels of nesting: serde_json's recursion limit, not a stack overflow.
    let deep = format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000));
    let (status, text) = register(&http, &base, "application/json", deep.into_bytes()).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("invalid /register body"), "{text}");
    // 3 MiB: over axum's default 2 MiB body limit.
    let huge = format!(
        "{{\"engine_id\": \"{}\", \"dp_rank\": 0, \"tp_rank\": 0, \"pp_rank\": 0, \"addr\": \"tcp://h:1\"}}",
        "e".repeat(3 << 20)
    );
    let (status, text) = register(&http, &base, "application/json", huge.into_bytes()).await;
    assert!((400..500).contains(&status), "{status}: {text}");
    assert!(query(&http, &base).await.is_empty(), "nothing was registered");
    let ok = serde_json::json!({"engine_id": "e", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://h:1"});
    assert_eq!(register(&http, &base, "application/json", ok.to_string().into_bytes()).await.0, 200);
    assert_eq!(query(&http, &base).await["0"].engine_id, "e");
}

#[tokio::test]
async fn unknown_engine_ids_are_absent_from_query_and_unknown_paths_are_404() {
    let (_actor, base) = start().await;
    let http = client();
    let ok = serde_json::json!({"engine_id": "6c1f", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://h:1"});
    assert_eq!(register(&http, &base, "application/json", ok.to_string().into_bytes()).await.0, 200);
    // vLLM's /query takes no engine id: a query string naming an unknown one still gets the table,
    // in which that engine is absent (D then fails the pull naming it).
    let resp = http.get(format!("{base}/query?engine_id=ghost")).send().await.expect("query");
    assert_eq!(resp.status().as_u16(), 200);
    let q: QueryResponse = resp.json().await.expect("json");
    assert!(q.values().all(|e| e.engine_id != "ghost") && q["0"].engine_id == "6c1f", "{q:?}");
    for path in ["/query/ghost", "/engines/ghost", "/nope"] {
        let resp = http.get(format!("{base}{path}")).send().await.expect("answers");
        assert_eq!(resp.status().as_u16(), 404, "{path}");
    }
    // A wrong method on a known path is a 405, not a crash.
    let resp = http.get(format!("{base}/register")).send().await.expect("answers");
    assert_eq!(resp.status().as_u16(), 405);
    assert_eq!(query(&http, &base).await["0"].engine_id, "6c1f");
}
