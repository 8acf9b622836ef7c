//! Every step a span, one trace per request, across processes:
//! - `pdflow demo --trace-file` writes a Jaeger JSON upload: the seed request's trace (8–43,
//!   every parent resolving) and one start-up trace per node, services named per node;
//! - `pdflow trace render` draws it: 43 numbered bars in 9 lanes, the TTFT parts;
//! - bootstrap, P, D and proxy as separate processes export OTLP (gRPC, then HTTP/protobuf) to a
//!   receiver started here: every step 1–43 arrives, a request's steps share one trace, parents
//!   resolve, the seed's causal order holds, step 29 carries the seed's figures, and two
//!   concurrent requests give two traces that do not cross;
//! - a headless Chromium screenshot of the timeline, skipped (with a message) without chromium.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use pdflow_tests::otlp::{self, OtlpReceiver, ReceivedSpan, Transport};
use pdflow_tests::processes::{pdflow_bin, Proc};
use pdflow_tests::{completion, http_client, post, prompt, wait_healthy};
use serde_json::Value;

const SERVICES: [&str; 4] = ["pdflow-bootstrap", "pdflow-decode", "pdflow-prefill", "pdflow-proxy"];

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pdflow-{name}-{}", uuid_like()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn uuid_like() -> String {
    format!(
        "{}-{:?}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos()
    )
}

/// Runs `pdflow ARGS…` to completion (bounded), returning stdout.
async fn pdflow(args: &[&str]) -> String {
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(pdflow_bin().expect("pdflow binary")).args(args).output(),
    )
    .await
    .expect("pdflow finished within 120 s")
    .expect("pdflow runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "pdflow {args:?} failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

fn tag(span: &Value, key: &str) -> Option<Value> {
    span["tags"].as_array()?.iter().find(|t| t["key"] == key).map(|t| t["value"].clone())
}

/// Checks the Jaeger upload schema and returns (request trace, start-up traces).
fn check_jaeger_file(path: &Path) -> (Value, Vec<Value>) {
    let file: Value =
        serde_json::from_slice(&std::fs::read(path).expect("trace file written")).expect("trace file is JSON");
    let traces = file["data"].as_array().expect("data is an array");
    let mut request = None;
    let mut startup = Vec::new();
    for t in traces {
        let trace_id = t["traceID"].as_str().expect("traceID");
        assert_eq!(trace_id.len(), 32);
        let processes = t["processes"].as_object().expect("processes");
        let spans = t["spans"].as_array().expect("spans");
        let ids: BTreeSet<&str> = spans.iter().map(|s| s["spanID"].as_str().expect("spanID")).collect();
        for s in spans {
            assert_eq!(s["traceID"], trace_id);
            assert!(s["operationName"].as_str().is_some_and(|n| n.starts_with("step.")));
            assert!(s["startTime"].is_u64() && s["duration"].is_u64(), "times in µs: {s}");
            assert!(s["tags"]
                .as_array()
                .is_some_and(|t| t.iter().all(|t| t["key"].is_string() && t["type"].is_string())));
            let pid = s["processID"].as_str().expect("processID");
            assert!(processes.contains_key(pid), "processID {pid} has a process entry");
            for r in s["references"].as_array().expect("references") {
                assert_eq!(r["refType"], "CHILD_OF");
                assert!(
                    ids.contains(r["spanID"].as_str().unwrap_or_default()),
                    "{} names a parent not in its trace",
                    s["operationName"]
                );
            }
        }
        for p in processes.values() {
            assert!(SERVICES.contains(&p["serviceName"].as_str().unwrap_or_default()), "service {p}");
        }
        if spans.iter().any(|s| tag(s, "pd.step") == Some(Value::from(8))) {
            assert!(request.is_none(), "one request trace");
            request = Some(t.clone());
        } else {
            startup.push(t.clone());
        }
    }
    (request.expect("the seed request's trace"), startup)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_trace_file_is_a_jaeger_upload_and_renders_as_a_timeline() {
    let dir = scratch_dir("trace-file");
    let trace = dir.join("t.json");
    let out = pdflow(&[
        "demo",
        "--kv-shape",
        "4,2,16,16",
        "--prompt-tokens",
        "100",
        "--max-tokens",
        "4",
        "--trace-file",
        trace.to_str().expect("utf-8"),
    ])
    .await;
    assert!(out.contains("verified: true"), "{out}");

    let (request, startup) = check_jaeger_file(&trace);
    let steps: BTreeSet<u64> =
        request["spans"].as_array().expect("spans").iter().filter_map(|s| tag(s, "pd.step")?.as_u64()).collect();
    assert_eq!(steps, (8..=43).collect(), "steps 8–43 in one trace");
    let services: BTreeSet<&str> = request["processes"]
        .as_object()
        .expect("processes")
        .values()
        .filter_map(|p| p["serviceName"].as_str())
        .collect();
    assert_eq!(services, BTreeSet::from(["pdflow-proxy", "pdflow-prefill", "pdflow-decode"]));
    let roots: Vec<&Value> = request["spans"]
        .as_array()
        .expect("spans")
        .iter()
        .filter(|s| s["references"].as_array().is_some_and(Vec::is_empty))
        .collect();
    assert_eq!(roots.len(), 1, "one root");
    assert_eq!(roots[0]["operationName"], "step.08.client_request");

    // One start-up trace per node, together steps 1–7.
    let mut startup_services = BTreeSet::new();
    let mut startup_steps = BTreeSet::new();
    for t in &startup {
        let names: Vec<&str> =
            t["processes"].as_object().expect("processes").values().filter_map(|p| p["serviceName"].as_str()).collect();
        assert_eq!(names.len(), 1, "a start-up trace belongs to one node: {names:?}");
        assert!(startup_services.insert(names[0]), "one start-up trace per node ({})", names[0]);
        startup_steps.extend(t["spans"].as_array().expect("spans").iter().filter_map(|s| tag(s, "pd.step")?.as_u64()));
    }
    assert_eq!(startup_steps, (1..=7).collect());
    assert_eq!(startup_services, SERVICES.into_iter().collect());

    // The timeline.
    let html_path = dir.join("timeline.html");
    let summary =
        pdflow(&["trace", "render", trace.to_str().expect("utf-8"), "--out", html_path.to_str().expect("utf-8")]).await;
    assert!(summary.contains("43 step spans"), "{summary}");
    let html = std::fs::read_to_string(&html_path).expect("timeline written");
    check_timeline_html(&html);
    let _ = std::fs::remove_dir_all(&dir);
}

/// 43 numbered bars in 9 lanes, figures on hover, the TTFT parts, nothing fetched.
fn check_timeline_html(html: &str) {
    let bar_steps: BTreeSet<u8> = html
        .match_indices("<g class=\"bar\" data-step=\"")
        .filter_map(|(i, m)| html[i + m.len()..].get(..2)?.parse().ok())
        .collect();
    assert_eq!(bar_steps, (1..=43).collect(), "43 numbered bars");
    for n in 1..=43 {
        assert!(html.contains(&format!("data-step=\"{n:02}\"><title>step {n} ·")), "bar {n} has its hover title");
        assert!(html.contains(&format!(">{n}</text></g>")), "bar {n} is numbered");
    }
    let lanes: Vec<&str> = html
        .match_indices("<g class=\"lane\" data-lane=\"")
        .filter_map(|(i, m)| html[i + m.len()..].split('"').next())
        .collect();
    assert_eq!(
        lanes,
        ["client", "proxy", "P API", "P scheduler", "P worker", "bootstrap", "D API", "D scheduler", "D worker"]
    );
    assert!(html.contains("pd.bytes = "), "figures on hover");
    for part in ["proxy", "P prefill", "P next step", "transfer", "D notice", "D first forward"] {
        assert!(html.contains(&format!("data-part=\"{part}\"")), "TTFT part {part}");
    }
    assert!(!html.contains("<script") && !html.contains("src=") && !html.contains("href="), "self-contained");
}

/// Starts bootstrap, P (Qwen3-8B shape), D and the proxy as processes exporting to `receiver`.
async fn cluster(receiver: &OtlpReceiver) -> Vec<Proc> {
    let env = receiver.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let bootstrap = Proc::spawn("bootstrap", &["bootstrap", "--port", "0"], &env).await.expect("bootstrap starts");
    let bootstrap_addr = bootstrap.ready["addr"].as_str().expect("addr").to_string();
    let bootstrap_port = bootstrap_addr.rsplit(':').next().expect("port").to_string();
    let bootstrap_url = format!("http://{bootstrap_addr}");
    let producer = Proc::spawn(
        "producer",
        &["serve", "--role", "producer", "--num-blocks", "160", "--bootstrap-url", &bootstrap_url],
        &env,
    )
    .await
    .expect("P starts");
    let consumer = Proc::spawn(
        "consumer",
        &["serve", "--role", "consumer", "--num-blocks", "160", "--kv-load-failure-policy", "fail"],
        &env,
    )
    .await
    .expect("D starts");
    let proxy = Proc::spawn(
        "proxy",
        &["proxy", "--port", "0", "--prefill", &producer.url(), &bootstrap_port, "--decode", &consumer.url()],
        &env,
    )
    .await
    .expect("proxy starts");
    vec![proxy, consumer, producer, bootstrap]
}

fn transfer_ids(trace: &[ReceivedSpan]) -> BTreeSet<String> {
    trace.iter().filter_map(|s| s.text("pd.transfer_id")).filter(|t| !t.is_empty()).collect()
}

async fn processes_export_every_step(transport: Transport) {
    let receiver = OtlpReceiver::start(transport).await.expect("receiver");
    let procs = cluster(&receiver).await;
    let client = http_client();
    let proxy_url = procs[0].url();
    wait_healthy(&client, &proxy_url, Duration::from_secs(20)).await.expect("proxy ready");

    // The seed request: 1000 tokens, Qwen3-8B shape.
    let (status, body) = post(&client, &format!("{proxy_url}/v1/completions"), &completion(&prompt(1000, 0x5EED), 4))
        .await
        .expect("seed request");
    assert_eq!(status, 200, "{body}");
    let spans = receiver
        .wait_until(Duration::from_secs(30), "every step 1–43 exported", |s| {
            otlp::request_traces(s).first().is_some_and(|t| otlp::has_steps(t, 8..=43)) && otlp::has_steps(s, 1..=7)
        })
        .await
        .expect("spans arrive");
    let services: BTreeSet<&str> = spans.iter().map(|s| s.service.as_str()).collect();
    assert_eq!(services, SERVICES.into_iter().collect());
    let seed = otlp::request_traces(&spans).remove(0);
    assert_eq!(transfer_ids(&seed).len(), 1, "one request in the trace");
    let roots: Vec<&ReceivedSpan> = seed.iter().filter(|s| s.parent.is_none()).collect();
    assert_eq!(roots.len(), 1, "step 8 is the only root");
    assert_eq!(roots[0].step, 8);
    let s29 = otlp::step(&seed, 29).expect("step 29");
    assert_eq!(s29.attrs.get("pd.bytes"), Some(&Value::from(148_635_648)), "{s29:?}");
    assert_eq!(s29.attrs.get("pd.descriptors"), Some(&Value::from(36)), "{s29:?}");
    assert_eq!(otlp::causal_order_violations(&seed).expect("steps present"), Vec::<String>::new());
    // Start-up: one trace per node.
    let startup: BTreeMap<String, BTreeSet<String>> =
        spans.iter().filter(|s| s.step <= 7).fold(BTreeMap::new(), |mut m, s| {
            m.entry(s.service.clone()).or_default().insert(s.trace_id.clone());
            m
        });
    assert!(startup.values().all(|t| t.len() == 1), "one start-up trace per node: {startup:?}");

    // Two concurrent requests: two more traces, no span crossing over.
    let url = format!("{proxy_url}/v1/completions");
    let (body_a, body_b) = (completion(&prompt(300, 1), 4), completion(&prompt(300, 2), 4));
    let (a, b) = tokio::join!(post(&client, &url, &body_a), post(&client, &url, &body_b));
    assert_eq!(a.expect("request a").0, 200);
    assert_eq!(b.expect("request b").0, 200);
    // Step 20 (bootstrap query) happens once per P engine: not in later requests.
    let later_steps = || (8..=43).filter(|n| *n != 20);
    let spans = receiver
        .wait_until(Duration::from_secs(30), "the two concurrent requests exported", |s| {
            let t = otlp::request_traces(s);
            t.len() == 3 && t.iter().all(|t| otlp::has_steps(t, later_steps()))
        })
        .await
        .expect("spans arrive");
    let traces = otlp::request_traces(&spans);
    let (ta, tb) = (&traces[1], &traces[2]);
    assert_ne!(ta[0].trace_id, tb[0].trace_id);
    let (xa, xb) = (transfer_ids(ta), transfer_ids(tb));
    assert_eq!(xa.len(), 1, "trace A holds one request: {xa:?}");
    assert_eq!(xb.len(), 1, "trace B holds one request: {xb:?}");
    assert!(xa.is_disjoint(&xb));
    for t in [ta, tb] {
        for n in later_steps().filter(|n| ![15, 40].contains(n)) {
            assert_eq!(t.iter().filter(|s| s.step == n).count(), 1, "step {n} once per request trace");
        }
        assert_eq!(otlp::causal_order_violations(t).expect("steps present"), Vec::<String>::new());
    }
    assert_eq!(otlp::unresolved_parents(&spans), Vec::<String>::new());
    for p in procs {
        p.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn processes_export_every_step_over_otlp_grpc() {
    processes_export_every_step(Transport::Grpc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn processes_export_every_step_over_otlp_http() {
    processes_export_every_step(Transport::Http).await;
}

/// Debian's `chromium` (or `$PDFLOW_CHROMIUM`), if installed.
fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("PDFLOW_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).flat_map(|d| ["chromium", "chromium-browser"].map(|n| d.join(n))).find(|p| p.is_file())
}

async fn run_chromium(bin: &Path, args: &[&str]) -> std::process::Output {
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run"])
        .args(args)
        .kill_on_drop(true);
    tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("chromium finished within 60 s")
        .expect("chromium runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeline_screenshot_in_headless_chromium() {
    let Some(bin) = chromium() else {
        pdflow_testkit::skipped(
            "timeline_screenshot_in_headless_chromium",
            &"no chromium on PATH (Debian: `apt-get install -y chromium`, or set PDFLOW_CHROMIUM)",
        );
        return;
    };
    let dir = scratch_dir("screenshot");
    let (trace, html, png) = (dir.join("t.json"), dir.join("timeline.html"), dir.join("timeline.png"));
    pdflow(&[
        "demo",
        "--kv-shape",
        "4,2,16,16",
        "--prompt-tokens",
        "100",
        "--max-tokens",
        "4",
        "--trace-file",
        trace.to_str().expect("utf-8"),
    ])
    .await;
    pdflow(&["trace", "render", trace.to_str().expect("utf-8"), "--out", html.to_str().expect("utf-8")]).await;
    let url = format!("file://{}", html.display());

    // The DOM as Chromium parsed and laid it out.
    let dom = run_chromium(&bin, &["--dump-dom", &url]).await;
    assert!(dom.status.success(), "chromium --dump-dom: {}", String::from_utf8_lossy(&dom.stderr));
    check_timeline_html(&String::from_utf8_lossy(&dom.stdout));

    let shot = run_chromium(&bin, &["--window-size=1540,900", &format!("--screenshot={}", png.display()), &url]).await;
    assert!(shot.status.success(), "chromium --screenshot: {}", String::from_utf8_lossy(&shot.stderr));
    let bytes = std::fs::read(&png).expect("screenshot written");
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG");
    assert!(bytes.len() > 20_000, "the screenshot shows the drawing ({} bytes)", bytes.len());
    eprintln!("timeline screenshot: {}", png.display());
}
