//! `pdflow proxy --discover BOOTSTRAP_URL` with `pdflow bootstrap` and `pdflow serve` processes: a
//! P (which advertises itself at the bootstrap its workers register with) and a D (`--advertise-to`)
//! are found by a proxy given no engine at all, and serve requests P → D whose answers equal one
//! engine's alone; a D that starts later joins and gets requests. The bootstrap's `/query` still
//! holds P's workers only, in vLLM's shape. With a cluster secret, unsigned discovery calls (to
//! list or to advertise) are refused and change nothing, and a proxy without the secret discovers
//! nothing.

use std::time::{Duration, Instant};

use pdflow_auth::http::{sign_call, Call, AUTH_HEADER};
use pdflow_auth::ClusterSecret;
use pdflow_tests::processes::Proc;
use pdflow_tests::{completion, http_client, post, prompt, reference, token_ids, SMALL};
use serde_json::{json, Value};

const SHAPE: &str = "4,2,16,16";
const WAIT: Duration = Duration::from_secs(20);

async fn bootstrap(envs: &[(&str, &str)]) -> Proc {
    Proc::spawn("bootstrap", &["bootstrap", "--port", "0"], envs).await.expect("the bootstrap starts")
}

/// `pdflow serve` of `role` advertising at `bootstrap`: P registers its workers there (and so
/// advertises there), D is told to.
async fn engine(role: &'static str, bootstrap: &str, envs: &[(&str, &str)]) -> Proc {
    let mut args = vec!["serve", "--role", role, "--kv-shape", SHAPE, "--num-blocks", "256"];
    match role {
        "producer" => args.extend(["--bootstrap-url", bootstrap]),
        _ => args.extend(["--advertise-to", bootstrap]),
    }
    Proc::spawn(role, &args, envs).await.expect("the engine starts")
}

async fn proxy(bootstrap: &str, envs: &[(&str, &str)]) -> Proc {
    let args = ["proxy", "--port", "0", "--health-interval-ms", "200", "--discover", bootstrap];
    Proc::spawn("proxy", &args, envs).await.expect("the proxy starts")
}

/// The proxy's engines, as its admin API lists them.
async fn engines(client: &reqwest::Client, proxy: &Proc) -> Vec<Value> {
    let listed: Value = client
        .get(format!("{}/admin/engines", proxy.url()))
        .send()
        .await
        .expect("the proxy answers")
        .json()
        .await
        .expect("JSON");
    listed["engines"].as_array().cloned().unwrap_or_default()
}

/// Waits (bounded) until the proxy lists `url` healthy; the engine as listed.
async fn listed_healthy(client: &reqwest::Client, proxy: &Proc, url: &str) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let engines = engines(client, proxy).await;
        if let Some(e) = engines.iter().find(|e| e["url"] == url && e["healthy"] == true) {
            return e.clone();
        }
        assert!(Instant::now() < deadline, "{url} was not discovered healthy within {WAIT:?}: {engines:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One request through the proxy, its answer checked against one engine's alone.
async fn ask(client: &reqwest::Client, proxy: &Proc, seed: u64) {
    let body = completion(&prompt(40 + seed as usize, 900 + seed), 4);
    let (status, answer) =
        post(client, &format!("{}/v1/completions", proxy.url()), &body).await.expect("the proxy answers");
    assert_eq!(status, 200, "{answer}");
    assert_eq!(token_ids(&answer), token_ids(&reference(SMALL, &body).await.expect("reference")));
}

fn routed(e: &Value) -> u64 {
    e["routed"].as_u64().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_given_only_a_bootstrap_finds_p_and_d_there_and_a_later_d_joins() {
    let client = http_client();
    let boot = bootstrap(&[]).await;
    let b = boot.url();
    let p = engine("producer", &b, &[]).await;
    let d1 = engine("consumer", &b, &[]).await;
    let proxy = proxy(&b, &[]).await;
    pdflow_tests::wait_healthy(&client, &proxy.url(), WAIT).await.expect("the proxy found P and D");

    let p_info = listed_healthy(&client, &proxy, &p.url()).await;
    assert_eq!((&p_info["pool"], &p_info["bootstrap_addr"]), (&json!("prefill"), &json!(b)), "{p_info}");
    let d1_info = listed_healthy(&client, &proxy, &d1.url()).await;
    assert_eq!(d1_info["pool"], "decode", "{d1_info}");
    for seed in 0..3 {
        ask(&client, &proxy, seed).await;
    }
    let listed = engines(&client, &proxy).await;
    let p_routed = listed.iter().find(|e| e["url"] == p.url()).map(routed);
    assert_eq!(p_routed, Some(3), "every request prefilled on the discovered P: {listed:?}");

    // The bootstrap lists both engines at /engines; its /query keeps vLLM's shape, P's workers only.
    let advertised: Value =
        client.get(format!("{b}/engines")).send().await.expect("engines").json().await.expect("JSON");
    let roles: Vec<(&str, &str)> = (advertised["engines"].as_array().expect("a list").iter())
        .map(|e| (e["role"].as_str().unwrap_or(""), e["url"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(roles.len(), 2, "{advertised}");
    assert!(roles.contains(&("prefill", p.url().as_str())) && roles.contains(&("decode", d1.url().as_str())));
    let query: Value = client.get(format!("{b}/query")).send().await.expect("query").json().await.expect("JSON");
    let ranks: Vec<&String> = query.as_object().expect("a table").keys().collect();
    assert_eq!(ranks, ["0"], "{query}");
    assert_eq!(query["0"]["engine_id"], p.ready["engine_id"], "{query}");
    assert!(!query.to_string().contains(&d1.url()), "no D where receivers look for P's workers: {query}");

    // A D that starts later is found and gets requests.
    let d2 = engine("consumer", &b, &[]).await;
    listed_healthy(&client, &proxy, &d2.url()).await;
    for seed in 3..9 {
        ask(&client, &proxy, seed).await;
    }
    let listed = engines(&client, &proxy).await;
    let d2_routed = listed.iter().find(|e| e["url"] == d2.url()).map(routed).unwrap_or_default();
    assert!(d2_routed >= 2, "the D that joined later got requests: {listed:?}");
    drop((p, d1, d2, proxy, boot));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_secret_only_signed_discovery_calls_are_served() {
    let client = http_client();
    let text = "the-discovery-cluster-secret-01";
    let secret = ClusterSecret::from_text(text).expect("a valid secret");
    let envs = [("PDFLOW_CLUSTER_SECRET", text)];
    let boot = bootstrap(&envs).await;
    let b = boot.url();
    let p = engine("producer", &b, &envs).await;
    let d = engine("consumer", &b, &envs).await;
    let proxy = proxy(&b, &envs).await;
    pdflow_tests::wait_healthy(&client, &proxy.url(), WAIT).await.expect("the proxy found P and D, signing its calls");
    ask(&client, &proxy, 0).await;

    // Unsigned: listing and advertising are refused, and a forged engine is not listed.
    let unsigned = client.get(format!("{b}/engines")).send().await.expect("an answer");
    assert_eq!(unsigned.status().as_u16(), 401);
    let forged = json!({"engine_id": "forged", "role": "decode", "url": "http://127.0.0.1:9"});
    let refused = client.post(format!("{b}/engines")).json(&forged).send().await.expect("an answer");
    assert_eq!(refused.status().as_u16(), 401);
    let wrong = ClusterSecret::from_text("not-the-discovery-secret-0002").expect("a valid secret");
    let (header, _) = sign_call(&wrong, Call::Register, "POST", "/engines", forged.to_string().as_bytes());
    let resp = client
        .post(format!("{b}/engines"))
        .header(AUTH_HEADER, header)
        .header("content-type", "application/json")
        .body(forged.to_string())
        .send()
        .await
        .expect("an answer");
    assert_eq!(resp.status().as_u16(), 401, "signed with another secret");
    let (header, _) = sign_call(&secret, Call::Query, "GET", "/engines", b"");
    let listed: Value = client
        .get(format!("{b}/engines"))
        .header(AUTH_HEADER, header)
        .send()
        .await
        .expect("an answer")
        .json()
        .await
        .expect("JSON");
    let urls: Vec<&str> =
        (listed["engines"].as_array().expect("a list").iter()).map(|e| e["url"].as_str().unwrap_or("")).collect();
    assert_eq!(urls.len(), 2, "{listed}");
    assert!(urls.contains(&p.url().as_str()) && urls.contains(&d.url().as_str()), "{listed}");

    // A proxy without the secret gets nothing from the bootstrap: it never has engines to serve.
    let outsider = Proc::spawn(
        "proxy",
        &["proxy", "--port", "0", "--health-interval-ms", "200", "--discover", &b],
        &[("PDFLOW_CLUSTER_SECRET", "not-the-discovery-secret-0002")],
    )
    .await
    .expect("the proxy starts");
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        let health = client.get(format!("{}/health", outsider.url())).send().await.expect("an answer");
        assert_eq!(health.status().as_u16(), 503);
        let why = health.text().await.unwrap_or_default();
        assert!(why.contains("none advertised yet"), "{why}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop((p, d, proxy, outsider, boot));
}
