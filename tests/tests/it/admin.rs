//! The proxy's admin API with `pdflow serve` and `pdflow proxy` processes, under a steady load of
//! concurrent clients: a second D and a second P join and receive requests; the first D is
//! drained (nothing new reaches it, its requests finish) and removed; no client request fails and
//! every answer equals one engine's alone. A killed P is out of rotation within a second. With a
//! cluster secret, unsigned and forged admin calls are refused with a 401 and change nothing. A
//! drained D gets no new request, and put back into service (`pdflow admin undrain`) gets them
//! again. A proxy restarted over its roster file (`--roster-file`) routes to the engines the
//! admin API left it with.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdflow_auth::http::{sign_call, Call, AUTH_HEADER};
use pdflow_auth::ClusterSecret;
use pdflow_tests::processes::Proc;
use pdflow_tests::{completion, http_client, post, prompt, reference, token_ids, SMALL};
use serde_json::{json, Value};

const SHAPE: &str = "4,2,16,16";
const CLIENTS: usize = 4;

/// The admin API of one proxy, its calls signed when a secret is given.
struct Admin {
    client: reqwest::Client,
    base: String,
    secret: Option<ClusterSecret>,
}

impl Admin {
    async fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        let bytes = body.map(|b| serde_json::to_vec(b).expect("JSON")).unwrap_or_default();
        let mut request = match method {
            "GET" => self.client.get(format!("{}{path}", self.base)),
            "DELETE" => self.client.delete(format!("{}{path}", self.base)),
            _ => self.client.post(format!("{}{path}", self.base)).header("content-type", "application/json"),
        };
        if let Some(secret) = &self.secret {
            request = request.header(AUTH_HEADER, sign_call(secret, Call::Admin, method, path, &bytes).0);
        }
        let resp = request.body(bytes).send().await.expect("the proxy answers");
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    async fn engines(&self) -> Vec<Value> {
        let (status, body) = self.call("GET", "/admin/engines", None).await;
        assert_eq!(status, 200, "{body}");
        body["engines"].as_array().cloned().unwrap_or_default()
    }

    async fn engine(&self, url: &str) -> Option<Value> {
        self.engines().await.into_iter().find(|e| e["url"] == url)
    }

    /// Waits (at most `within`) until the engine at `url` satisfies `test`.
    async fn wait_for(&self, url: &str, within: Duration, what: &str, test: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let engine = self.engine(url).await;
            if let Some(e) = engine.as_ref().filter(|e| test(e)) {
                return e.clone();
            }
            assert!(Instant::now() < deadline, "{url}: not {what} within {within:?}: {engine:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn engine_args(role: &'static str) -> Vec<&'static str> {
    let mut args = vec!["serve", "--role", role, "--kv-shape", SHAPE, "--num-blocks", "256"];
    if role == "producer" {
        args.extend(["--bootstrap-port", "0"]);
    }
    args
}

async fn engine(role: &'static str, envs: &[(&str, &str)]) -> Proc {
    Proc::spawn(role, &engine_args(role), envs).await.expect("the engine starts")
}

fn bootstrap_port(p: &Proc) -> u16 {
    let addr = p.ready["bootstrap_addr"].as_str().expect("P's bootstrap");
    addr.rsplit(':').next().and_then(|port| port.parse().ok()).expect("a port")
}

async fn proxy(ps: &[&Proc], ds: &[&Proc], envs: &[(&str, &str)]) -> Proc {
    let mut args: Vec<String> = ["proxy", "--port", "0", "--health-interval-ms", "200"].map(String::from).to_vec();
    for p in ps {
        args.extend(["--prefill".into(), p.url(), bootstrap_port(p).to_string()]);
    }
    for d in ds {
        args.extend(["--decode".into(), d.url()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let proxy = Proc::spawn("proxy", &args, envs).await.expect("the proxy starts");
    pdflow_tests::wait_healthy(&http_client(), &proxy.url(), Duration::from_secs(15)).await.expect("proxy ready");
    proxy
}

/// Clients looping over a few prompts until stopped; each answer is checked against the reference.
struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    failures: Arc<Mutex<Vec<(Instant, String)>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    async fn start(proxy_url: &str) -> Self {
        let mut cases = Vec::new();
        for seed in 0..6u64 {
            let body = completion(&prompt(40 + 8 * seed as usize, 700 + seed), 4);
            let expected = token_ids(&reference(SMALL, &body).await.expect("reference"));
            cases.push((body, expected));
        }
        let cases = Arc::new(cases);
        let failures: Arc<Mutex<Vec<(Instant, String)>>> = Arc::default();
        let (stop, ok) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let url = format!("{proxy_url}/v1/completions");
        let tasks = (0..CLIENTS)
            .map(|c| {
                let (cases, stop, ok, failures, url) =
                    (cases.clone(), stop.clone(), ok.clone(), Arc::clone(&failures), url.clone());
                tokio::spawn(async move {
                    let client = http_client();
                    let mut i = c;
                    while !stop.load(Ordering::Relaxed) {
                        let (body, expected) = &cases[i % cases.len()];
                        i += 1;
                        let outcome = match post(&client, &url, body).await {
                            Ok((200, answer)) if token_ids(&answer) == *expected => None,
                            Ok((200, answer)) => Some(format!("wrong tokens: {answer}")),
                            Ok((status, answer)) => Some(format!("{status}: {answer}")),
                            Err(e) => Some(format!("no answer: {e}")),
                        };
                        match outcome {
                            None => {
                                ok.fetch_add(1, Ordering::Relaxed);
                            }
                            Some(f) => failures.lock().expect("lock").push((Instant::now(), f)),
                        }
                    }
                })
            })
            .collect();
        Self { stop, ok, failures, tasks }
    }

    async fn stop(self) -> (u64, Vec<(Instant, String)>) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.expect("client task");
        }
        let failures = self.failures.lock().expect("lock").clone();
        (self.ok.load(Ordering::Relaxed), failures)
    }
}

fn routed(e: &Value) -> u64 {
    e["routed"].as_u64().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn engines_join_drain_and_leave_under_load_without_a_failed_request() {
    let client = http_client();
    let (p1, d1) = (engine("producer", &[]).await, engine("consumer", &[]).await);
    let proxy = proxy(&[&p1], &[&d1], &[]).await;
    let admin = Admin { client: client.clone(), base: proxy.url(), secret: None };
    let load = Load::start(&proxy.url()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    // A second D and a second P join and get requests.
    let (p2, d2) = (engine("producer", &[]).await, engine("consumer", &[]).await);
    let add_d = json!({"pool": "decode", "url": d2.url()});
    let (status, added) = admin.call("POST", "/admin/engines", Some(&add_d)).await;
    assert_eq!((status, &added["state"]), (201, &json!("serving")), "{added}");
    let add_p = json!({"pool": "prefill", "url": p2.url(), "bootstrap_port": bootstrap_port(&p2)});
    let (status, added) = admin.call("POST", "/admin/engines", Some(&add_p)).await;
    assert_eq!(status, 201, "{added}");
    let (status, dup) = admin.call("POST", "/admin/engines", Some(&add_d)).await;
    assert_eq!(status, 409, "a second add of the same URL is refused: {dup}");
    admin.wait_for(&d2.url(), Duration::from_secs(10), "routed to", |e| routed(e) >= 3).await;
    let p2_info = admin.wait_for(&p2.url(), Duration::from_secs(10), "routed to", |e| routed(e) >= 3).await;
    assert!(!p2_info["engine_ids"].as_object().expect("engine ids").is_empty(), "{p2_info}");

    // The first D drains: nothing new reaches it, what it has finishes; then it leaves.
    let (status, drained) = admin.call("POST", "/admin/engines/drain", Some(&json!({"url": d1.url()}))).await;
    assert_eq!((status, &drained["state"]), (200, &json!("draining")), "{drained}");
    let at_drain = routed(&drained);
    let idle = admin.wait_for(&d1.url(), Duration::from_secs(10), "idle", |e| e["in_flight"] == 0).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let later = admin.engine(&d1.url()).await.expect("still listed while draining");
    assert_eq!((routed(&idle), routed(&later)), (at_drain, at_drain), "a draining D got new requests: {later}");
    let d2_before = routed(&admin.engine(&d2.url()).await.expect("d2"));
    let (status, removed) = admin.call("DELETE", &format!("/admin/engines?url={}", d1.url()), None).await;
    assert_eq!((status, &removed["state"]), (200, &json!("removed")), "{removed}");
    assert!(admin.engine(&d1.url()).await.is_none(), "a removed engine is not listed");
    let (status, gone) = admin.call("POST", "/admin/engines/remove", Some(&json!({"url": d1.url()}))).await;
    assert_eq!(status, 404, "{gone}");
    admin.wait_for(&d2.url(), Duration::from_secs(10), "serving alone", |e| routed(e) >= d2_before + 5).await;

    let (ok, failures) = load.stop().await;
    assert!(
        failures.is_empty(),
        "{} of {} requests failed: {:?}",
        failures.len(),
        ok as usize + failures.len(),
        failures
    );
    assert!(ok > 20, "the load ran: {ok} answers");
    let engines = admin.engines().await;
    let listed: Vec<(&str, &str)> =
        engines.iter().map(|e| (e["pool"].as_str().unwrap_or(""), e["url"].as_str().unwrap_or(""))).collect();
    assert_eq!(listed.len(), 3, "{engines:?}");
    drop((p1, p2, d1, d2, proxy));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_p_is_out_of_rotation_within_a_second() {
    let client = http_client();
    let (p1, p2, d) = (engine("producer", &[]).await, engine("producer", &[]).await, engine("consumer", &[]).await);
    let proxy = proxy(&[&p1, &p2], &[&d], &[]).await;
    let admin = Admin { client: client.clone(), base: proxy.url(), secret: None };
    let load = Load::start(&proxy.url()).await;
    let p2_url = p2.url();
    admin.wait_for(&p2_url, Duration::from_secs(10), "routed to", |e| routed(e) >= 5).await;

    let killed = Instant::now();
    p2.stop().await;
    let out = admin.wait_for(&p2_url, Duration::from_secs(2), "unhealthy", |e| e["healthy"] == false).await;
    let ejected = killed.elapsed();
    assert!(ejected < Duration::from_secs(1), "the killed P was in rotation for {ejected:?}: {out}");
    tokio::time::sleep(Duration::from_secs(1).saturating_sub(killed.elapsed())).await;
    let after_a_second = routed(&admin.engine(&p2_url).await.expect("still listed"));
    let ok_then = load.ok.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (ok, failures) = load.stop().await;
    let last = routed(&admin.engine(&p2_url).await.expect("still listed"));
    assert_eq!(last, after_a_second, "requests were routed to the killed P more than 1 s after the kill");
    assert!(ok > ok_then + 10, "the proxy kept serving on the other P: {ok_then} → {ok}");
    // A request in flight on the killed P is retried on the other or fails cleanly, at once.
    for (at, failure) in &failures {
        assert!(*at < killed + Duration::from_secs(1), "a request failed long after the kill: {failure}");
        assert!(failure.starts_with('5'), "not a clean failure (an error status): {failure}");
    }
    drop((p1, d, proxy));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_secret_only_signed_admin_calls_change_the_pools() {
    let client = http_client();
    let text = "the-admin-cluster-secret-0001";
    let envs = [("PDFLOW_CLUSTER_SECRET", text)];
    let (p, d) = (engine("producer", &envs).await, engine("consumer", &envs).await);
    let proxy = proxy(&[&p], &[&d], &envs).await;
    let signed = Admin {
        client: client.clone(),
        base: proxy.url(),
        secret: Some(ClusterSecret::from_text(text).expect("a valid secret")),
    };
    let unsigned = Admin { client: client.clone(), base: proxy.url(), secret: None };
    let forged = Admin {
        client: client.clone(),
        base: proxy.url(),
        secret: Some(ClusterSecret::from_text("not-the-cluster-secret-0002").expect("a valid secret")),
    };
    let before = signed.engines().await;
    assert_eq!(before.len(), 2, "{before:?}");
    let add = json!({"pool": "decode", "url": "http://127.0.0.1:9"});
    for (who, admin) in [("unsigned", &unsigned), ("forged", &forged)] {
        for (method, path, body) in [
            ("GET", "/admin/engines", None),
            ("POST", "/admin/engines", Some(&add)),
            ("POST", "/admin/engines/drain", Some(&json!({"url": d.url()}))),
            ("DELETE", &*format!("/admin/engines?url={}&force=true", d.url()), None),
        ] {
            let (status, answer) = admin.call(method, path, body).await;
            assert_eq!(status, 401, "{who} {method} {path}: {answer}");
        }
    }
    // A signed call whose body was changed after signing is refused too.
    let (header, _) = sign_call(
        signed.secret.as_ref().expect("secret"),
        Call::Admin,
        "POST",
        "/admin/engines",
        br#"{"pool":"decode","url":"http://127.0.0.1:10"}"#,
    );
    let resp = client
        .post(format!("{}/admin/engines", proxy.url()))
        .header(AUTH_HEADER, header)
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&add).expect("JSON"))
        .send()
        .await
        .expect("answer");
    assert_eq!(resp.status().as_u16(), 401);
    assert_eq!(signed.engines().await, before, "refused calls changed nothing");
    // Nothing changed: the proxy still serves.
    let body = completion(&prompt(30, 5), 4);
    let (status, answer) = post(&client, &format!("{}/v1/completions", proxy.url()), &body).await.expect("answer");
    assert_eq!(status, 200, "{answer}");
    assert_eq!(token_ids(&answer), token_ids(&reference(SMALL, &body).await.expect("reference")));

    let (status, added) = signed.call("POST", "/admin/engines", Some(&add)).await;
    assert_eq!((status, &added["url"]), (201, &json!("http://127.0.0.1:9")), "{added}");
    let (status, bad) =
        signed.call("POST", "/admin/engines", Some(&json!({"pool": "router", "url": "http://h:1"}))).await;
    assert_eq!(status, 400, "{bad}");
    let (status, removed) =
        signed.call("POST", "/admin/engines/remove", Some(&json!({"url": "http://127.0.0.1:9"}))).await;
    assert_eq!(status, 200, "{removed}");
    assert_eq!(signed.engines().await.len(), 2);

    // `pdflow admin`: signed with the secret it is given, refused with another.
    let cli = |secret: &'static str, args: &'static [&'static str]| {
        let proxy_url = proxy.url();
        async move {
            let out = tokio::process::Command::new(pdflow_tests::processes::pdflow_bin().expect("pdflow"))
                .args(["admin", "--proxy", &proxy_url])
                .args(args)
                .env("PDFLOW_CLUSTER_SECRET", secret)
                .output()
                .await
                .expect("pdflow admin runs");
            (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
        }
    };
    let (ok, listed) = cli(text, &["list"]).await;
    assert!(ok, "{listed}");
    let listed: Value = serde_json::from_str(&listed).expect("JSON");
    assert_eq!(listed["engines"].as_array().map(Vec::len), Some(2), "{listed}");
    let (ok, added) = cli("not-the-cluster-secret-0002", &["add", "decode", "http://127.0.0.1:9"]).await;
    assert!(!ok, "{added}");
    let (ok, added) = cli(text, &["add", "decode", "http://127.0.0.1:9"]).await;
    assert!(ok, "{added}");
    let (ok, removed) = cli(text, &["remove", "http://127.0.0.1:9"]).await;
    assert!(ok, "{removed}");
    let urls = |engines: &[Value]| engines.iter().map(|e| e["url"].clone()).collect::<Vec<_>>();
    assert_eq!(urls(&signed.engines().await), urls(&before));
    drop((p, d, proxy));
}

/// `pdflow admin --proxy URL ARGS…` (no secret): whether it succeeded, and its JSON answer.
async fn admin_cli(proxy: &Proc, args: &[&str]) -> (bool, Value) {
    let out = tokio::process::Command::new(pdflow_tests::processes::pdflow_bin().expect("pdflow"))
        .args(["admin", "--proxy", &proxy.url()])
        .args(args)
        .output()
        .await
        .expect("pdflow admin runs");
    (out.status.success(), serde_json::from_slice(&out.stdout).unwrap_or(Value::Null))
}

/// `n` requests one after the other, each answer checked against one engine's alone.
async fn ask(client: &reqwest::Client, proxy: &Proc, seeds: std::ops::Range<u64>) {
    for seed in seeds {
        let body = completion(&prompt(30 + seed as usize, 500 + seed), 4);
        let (status, answer) =
            post(client, &format!("{}/v1/completions", proxy.url()), &body).await.expect("the proxy answers");
        assert_eq!(status, 200, "{answer}");
        assert_eq!(token_ids(&answer), token_ids(&reference(SMALL, &body).await.expect("reference")));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_engine_gets_no_new_request_and_undrained_gets_them_again() {
    let client = http_client();
    let (p, d1, d2) = (engine("producer", &[]).await, engine("consumer", &[]).await, engine("consumer", &[]).await);
    let proxy = proxy(&[&p], &[&d1, &d2], &[]).await;
    let admin = Admin { client: client.clone(), base: proxy.url(), secret: None };
    ask(&client, &proxy, 0..4).await;
    let d1_url = d1.url();
    assert!(routed(&admin.engine(&d1_url).await.expect("d1")) >= 1, "round robin reached both D");

    let (ok, drained) = admin_cli(&proxy, &["drain", &d1_url]).await;
    assert!(ok && drained["state"] == "draining", "{drained}");
    let at_drain = routed(&drained);
    ask(&client, &proxy, 4..10).await;
    let idle = admin.engine(&d1_url).await.expect("still listed while draining");
    assert_eq!(routed(&idle), at_drain, "a draining D got new requests: {idle}");

    let (ok, back) = admin_cli(&proxy, &["undrain", &d1_url]).await;
    assert!(ok && back["state"] == "serving", "{back}");
    ask(&client, &proxy, 10..16).await;
    let serving = admin.engine(&d1_url).await.expect("listed");
    assert!(routed(&serving) >= at_drain + 2, "the D put back into service got requests again: {serving}");
    let (status, again) = admin.call("POST", "/admin/engines/undrain", Some(&json!({"url": d1_url}))).await;
    assert_eq!((status, &again["state"]), (200, &json!("serving")), "undrain is idempotent: {again}");

    let (ok, unknown) = admin_cli(&proxy, &["undrain", "http://127.0.0.1:9"]).await;
    assert!(!ok && unknown["error"]["code"] == 404, "{unknown}");
    drop((p, d1, d2, proxy));
}

/// `--roster-file`: the engines the admin API added, drained and removed survive the proxy
/// process. A proxy started again over the file, with no engine on its command line, lists them
/// as they were left and routes only to the serving ones; every answer equals one engine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_restarted_over_its_roster_file_routes_to_the_engines_it_was_left_with() {
    let client = http_client();
    let (p, d1, d2, d3) = (
        engine("producer", &[]).await,
        engine("consumer", &[]).await,
        engine("consumer", &[]).await,
        engine("consumer", &[]).await,
    );
    let dir = std::env::temp_dir().join(format!("pdflow-roster-it-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let roster = dir.join("roster.json");
    let _ = std::fs::remove_file(&roster);
    let roster_arg = roster.to_str().expect("a UTF-8 path").to_owned();
    let start = |extra: Vec<String>| {
        let mut args: Vec<String> =
            ["proxy", "--port", "0", "--health-interval-ms", "200", "--roster-file", &roster_arg]
                .map(String::from)
                .to_vec();
        args.extend(extra);
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let proxy = Proc::spawn("proxy", &args, &[]).await.expect("the proxy starts");
            pdflow_tests::wait_healthy(&http_client(), &proxy.url(), Duration::from_secs(15))
                .await
                .expect("proxy ready");
            proxy
        }
    };
    let first = start(vec![
        "--prefill".into(),
        p.url(),
        bootstrap_port(&p).to_string(),
        "--decode".into(),
        d1.url(),
        "--decode".into(),
        d2.url(),
    ])
    .await;
    let admin = Admin { client: client.clone(), base: first.url(), secret: None };
    let (status, added) = admin.call("POST", "/admin/engines", Some(&json!({"pool": "decode", "url": d3.url()}))).await;
    assert_eq!(status, 201, "{added}");
    let (ok, drained) = admin_cli(&first, &["drain", &d1.url()]).await;
    assert!(ok && drained["state"] == "draining", "{drained}");
    let (status, removed) = admin.call("DELETE", &format!("/admin/engines?url={}", d2.url()), None).await;
    assert_eq!(status, 200, "{removed}");
    admin.wait_for(&d3.url(), Duration::from_secs(10), "healthy", |e| e["healthy"] == true).await;
    ask(&client, &first, 0..2).await;
    drop(first);

    // Nothing on the command line: the roster file's engines.
    let again = start(Vec::new()).await;
    let admin = Admin { client: client.clone(), base: again.url(), secret: None };
    let listed: Vec<(String, String)> = (admin.engines().await.iter())
        .map(|e| (e["url"].as_str().unwrap_or("").to_owned(), e["state"].as_str().unwrap_or("").to_owned()))
        .collect();
    let expected: Vec<(String, String)> = [(p.url(), "serving"), (d1.url(), "draining"), (d3.url(), "serving")]
        .into_iter()
        .map(|(u, s)| (u, s.to_owned()))
        .collect();
    let mut sorted = listed.clone();
    sorted.sort();
    let mut expected_sorted = expected.clone();
    expected_sorted.sort();
    assert_eq!(sorted, expected_sorted, "the engines as the first proxy left them: {listed:?}");
    ask(&client, &again, 2..8).await;
    let d3_routed = routed(&admin.engine(&d3.url()).await.expect("d3"));
    let d1_routed = routed(&admin.engine(&d1.url()).await.expect("d1"));
    assert_eq!((d3_routed, d1_routed), (6, 0), "only the serving D gets requests");
    for engine in [&p, &d1, &d2, &d3] {
        engine.assert_blocks_at_baseline(&client, "after the restarted proxy's requests").await;
    }
    drop(again);

    // A torn roster file: the proxy refuses to start and names it.
    std::fs::write(&roster, b"{\"format\": 1, \"prefill\": [").expect("write");
    let out = tokio::process::Command::new(pdflow_tests::processes::pdflow_bin().expect("pdflow"))
        .args(["proxy", "--port", "0", "--roster-file", &roster_arg])
        .output()
        .await
        .expect("pdflow proxy runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("roster.json"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
    drop((p, d1, d2, d3));
}
