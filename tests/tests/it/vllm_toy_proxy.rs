//! vLLM's own P/D proxy (`toy_proxy_server.py`, from vLLM 0.33's sources; scripts/test.sh fetches
//! it) in front of two `pdflow serve` processes. It sends P a bare
//! `kv_transfer_params: {"do_remote_decode": true}` with no transfer_id, and forwards the
//! `kv_transfer_params` of P's answer to D: P names the transfer after its request id (as the
//! bridge does inside vLLM) and answers D's form. Its answers equal one engine's alone, streamed
//! or not. It checks no field, so D refuses what P accepted (`max_tokens: -1`: P's copy asks 1),
//! after P finished: P's blocks still come back within 1 s. Skipped, saying why, without the
//! script or a Python with its dependencies (fastapi, httpx, uvicorn: vLLM's).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use pdflow_tests::processes::Proc;
use pdflow_tests::{completion, http_client, post, prompt, reference, token_ids, SMALL};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const SHAPE: &str = "4,2,16,16";

/// The repository's root (the tests crate's parent).
fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().map(PathBuf::from).unwrap_or_default()
}

/// The toy proxy's script and a Python that runs it, or why there are none.
fn toy_proxy() -> Result<(PathBuf, PathBuf), String> {
    let root = repo_root();
    let script = std::env::var_os("PDFLOW_VLLM_TOY_PROXY")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/vllm-sources/vllm-0.33.0/toy_proxy_server.py"));
    if !script.is_file() {
        return Err(format!(
            "{} is missing: fetch it with `python3 scripts/vllm_toy_proxy.py 0.33.0 target/vllm-sources` or set PDFLOW_VLLM_TOY_PROXY",
            script.display()
        ));
    }
    let venv = std::env::var_os("PDFLOW_VENV").map(PathBuf::from).unwrap_or_else(|| root.join(".venv"));
    let venv = if venv.is_absolute() { venv } else { root.join(venv) };
    let python = venv.join("bin/python");
    let imports = std::process::Command::new(&python)
        .args(["-c", "import fastapi, httpx, uvicorn"])
        .output()
        .map_err(|e| format!("cannot run {}: {e} (set up the venv as scripts/test.sh does)", python.display()))?;
    if !imports.status.success() {
        let why = String::from_utf8_lossy(&imports.stderr);
        let why = why.lines().last().unwrap_or_default();
        return Err(format!(
            "{} lacks the toy proxy's dependencies (fastapi, httpx, uvicorn): {why}",
            python.display()
        ));
    }
    Ok((script, python))
}

/// The toy proxy, running on a port of its own choosing (uvicorn logs it); killed on drop.
struct ToyProxy {
    _child: Child,
    url: String,
}

impl ToyProxy {
    async fn start(python: &PathBuf, script: &PathBuf, prefill: &str, decode: &str) -> anyhow::Result<Self> {
        let port = |url: &str| url.rsplit(':').next().unwrap_or_default().to_owned();
        let mut child = Command::new(python)
            .arg(script)
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(["--prefiller-host", "127.0.0.1", "--prefiller-port", &port(prefill)])
            .args(["--decoder-host", "127.0.0.1", "--decoder-port", &port(decode)])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting vLLM's toy proxy")?;
        let stderr = child.stderr.take().context("the toy proxy's stderr")?;
        let mut lines = BufReader::new(stderr).lines();
        let mut seen = Vec::new();
        let url = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(line) = lines.next_line().await? {
                if let Some(rest) = line.split("Uvicorn running on ").nth(1) {
                    return Ok(rest.split_whitespace().next().unwrap_or_default().to_owned());
                }
                seen.push(line);
            }
            anyhow::bail!("the toy proxy exited before it listened:\n{}", seen.join("\n"))
        })
        .await
        .context("the toy proxy did not listen within 60 s")??;
        // Keep draining its log so that it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Self { _child: child, url })
    }
}

/// The text of a streamed completion's `data:` events.
fn streamed_text(body: &str) -> String {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_owned))
        .collect()
}

async fn blocks_at_baseline_within(client: &reqwest::Client, engine: &Proc, within: Duration, what: &str) {
    let deadline = Instant::now() + within;
    loop {
        let s: Value = client
            .get(format!("{}/pdflow/blocks", engine.url()))
            .send()
            .await
            .expect("GET /pdflow/blocks")
            .json()
            .await
            .expect("block stats are JSON");
        if s["free"] == s["total"] && s["requests"] == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {} is not back at its baseline within {within:?}: {s}",
            engine.name
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_toy_proxy_in_front_of_pdflow_serve() {
    let (script, python) = match toy_proxy() {
        Ok(found) => found,
        Err(why) => return pdflow_testkit::skipped("vLLM's toy proxy in front of pdflow serve", &why),
    };
    // P names its bootstrap in its answers, so that the toy proxy can hand it to D.
    let bootstrap = Proc::spawn("bootstrap", &["bootstrap", "--port", "0"], &[]).await.expect("bootstrap starts");
    let bootstrap_url = format!("http://{}", bootstrap.ready["addr"].as_str().expect("addr"));
    let engine = |role: &'static str| {
        let mut args = vec!["serve", "--role", role, "--kv-shape", SHAPE, "--num-blocks", "128"];
        args.extend(["--kv-load-failure-policy", "fail"]);
        args
    };
    let mut p_args = engine("producer");
    p_args.extend(["--bootstrap-url", &bootstrap_url]);
    let producer = Proc::spawn("producer", &p_args, &[]).await.expect("producer starts");
    let consumer = Proc::spawn("consumer", &engine("consumer"), &[]).await.expect("consumer starts");
    let proxy =
        ToyProxy::start(&python, &script, &producer.url(), &consumer.url()).await.expect("the toy proxy starts");
    let client = http_client();
    let url = format!("{}/v1/completions", proxy.url);

    // P's answer to the toy proxy's request carries what D needs.
    let mut p_body = completion(&prompt(40, 2), 1);
    p_body["kv_transfer_params"] = serde_json::json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
    let (status, answer) =
        post(&client, &format!("{}/v1/completions", producer.url()), &p_body).await.expect("P answers");
    assert_eq!(status, 200, "P accepts a bare do_remote_decode: {answer}");
    let params = &answer["kv_transfer_params"];
    assert_eq!(params["do_remote_prefill"], true, "{answer}");
    assert_eq!(params["do_remote_decode"], false, "{answer}");
    assert_eq!(params["remote_bootstrap_addr"], bootstrap_url.as_str(), "{answer}");
    assert_eq!(params["remote_engine_id"], producer.ready["engine_id"], "{answer}");
    let transfer_id = params["transfer_id"].as_str().unwrap_or_default();
    assert!(!transfer_id.is_empty(), "{answer}");
    let plain = completion(&prompt(40, 2), 8);
    let mut d_body = plain.clone();
    d_body["kv_transfer_params"] = params.clone();
    let (status, answer) =
        post(&client, &format!("{}/v1/completions", consumer.url()), &d_body).await.expect("D answers");
    assert_eq!(status, 200, "D accepts P's params: {answer}");
    assert_eq!(token_ids(&answer), token_ids(&reference(SMALL, &plain).await.expect("reference")));

    // Through the toy proxy, as vLLM's guide runs it: one engine's answer, token for token.
    for (words, seed) in [(50, 8150), (16 * 3 + 5, 8153), (400, 8400)] {
        let body = completion(&prompt(words, seed), 24);
        let (status, answer) = post(&client, &url, &body).await.expect("the toy proxy answers");
        assert_eq!(status, 200, "{answer}");
        let want = reference(SMALL, &body).await.expect("reference");
        assert_eq!(token_ids(&answer), token_ids(&want), "a {words}-token prompt");
    }
    let mut body = completion(&prompt(120, 8120), 16);
    body["stream"] = true.into();
    let streamed = client.post(&url).json(&body).send().await.expect("streamed").text().await.expect("body");
    body["stream"] = false.into();
    let want = reference(SMALL, &body).await.expect("reference");
    assert_eq!(streamed_text(&streamed), want["choices"][0]["text"].as_str().unwrap_or("-"), "{streamed}");
    for engine in [&producer, &consumer] {
        blocks_at_baseline_within(&client, engine, Duration::from_secs(10), "after the requests").await;
    }

    // The toy proxy checks nothing: P prefills `max_tokens: -1` (its copy asks for 1) and holds
    // the blocks; D refuses it, and tells P at once.
    let mut bad = completion(&prompt(200, 9), 16);
    bad["max_tokens"] = (-1).into();
    let answer = client.post(&url).json(&bad).send().await;
    let refused = match answer {
        Ok(r) if r.status().is_success() => r.text().await.map(|t| !t.contains("\"choices\"")).unwrap_or(true),
        _ => true,
    };
    assert!(refused, "D served max_tokens -1");
    blocks_at_baseline_within(&client, &producer, Duration::from_secs(1), "after D refused max_tokens -1").await;

    drop(proxy);
    for p in [consumer, producer, bootstrap] {
        p.stop().await;
    }
}
