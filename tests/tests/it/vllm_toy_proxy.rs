//! vLLM's own P/D proxy (`toy_proxy_server.py`, from vLLM 0.33's sources; scripts/test.sh fetches
//! it) in front of two `pdflow serve` processes. It sends P a bare
//! `kv_transfer_params: {"do_remote_decode": true}` with no transfer_id, and forwards the
//! `kv_transfer_params` of P's answer to D: P names the transfer after its request id (as the
//! bridge does inside vLLM) and answers D's form. Its answers equal one engine's alone, streamed
//! or not, and D loads each one's KV from P. It checks no field, so D refuses what P accepted
//! (`max_tokens: -1`: P's copy asks 1), after P finished: P's blocks still come back within 1 s.
//! Skipped, saying why, without the script or a Python with its dependencies (fastapi, httpx,
//! uvicorn: vLLM's).

use std::path::{Path, PathBuf};
use std::time::Duration;

use pdflow_tests::vllm_front::{blocks_at_baseline_within, repo_root, venv, ServePair, Tool};
use pdflow_tests::{completion, http_client, post, prompt, reference, token_ids, SMALL};
use tokio::process::Command;

/// The toy proxy's script and a Python that runs it, or why there are none.
fn toy_proxy() -> Result<(PathBuf, PathBuf), String> {
    let script = std::env::var_os("PDFLOW_VLLM_TOY_PROXY")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target/vllm-sources/vllm-0.33.0/toy_proxy_server.py"));
    if !script.is_file() {
        return Err(format!(
            "{} is missing: fetch it with `python3 scripts/vllm_toy_proxy.py 0.33.0 target/vllm-sources` or set PDFLOW_VLLM_TOY_PROXY",
            script.display()
        ));
    }
    let python = venv().join("bin/python");
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

/// The toy proxy, on a port of its own choosing (uvicorn logs it); killed on drop.
struct ToyProxy {
    _tool: Tool,
    url: String,
}

impl ToyProxy {
    async fn start(python: &Path, script: &Path, prefill: &str, decode: &str) -> anyhow::Result<Self> {
        let port = |url: &str| url.rsplit(':').next().unwrap_or_default().to_owned();
        let mut command = Command::new(python);
        command
            .arg(script)
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(["--prefiller-host", "127.0.0.1", "--prefiller-port", &port(prefill)])
            .args(["--decoder-host", "127.0.0.1", "--decoder-port", &port(decode)]);
        let mut tool = Tool::spawn("vLLM's toy proxy", command)?;
        let running = tool.wait_for_line("Uvicorn running on ", Duration::from_secs(60)).await?;
        let url = running.split_whitespace().next().unwrap_or_default().to_owned();
        Ok(Self { _tool: tool, url })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_toy_proxy_in_front_of_pdflow_serve() {
    let (script, python) = match toy_proxy() {
        Ok(found) => found,
        Err(why) => return pdflow_testkit::skipped("vLLM's toy proxy in front of pdflow serve", &why),
    };
    let pair = ServePair::start().await.expect("the bootstrap, P and D start");
    let (producer, consumer) = (&pair.producer, &pair.consumer);
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
    assert_eq!(params["remote_bootstrap_addr"], pair.bootstrap_url.as_str(), "{answer}");
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

    // Through the toy proxy, as vLLM's guide runs it: one engine's answers, token for token.
    pair.assert_fronted_as_one_engine(&client, &url, "vLLM's toy proxy").await;

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
    blocks_at_baseline_within(&client, producer, Duration::from_secs(1), "after D refused max_tokens -1").await;

    drop(proxy);
    pair.stop().await;
}
