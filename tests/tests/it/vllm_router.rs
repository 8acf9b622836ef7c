//! vLLM's router (`vllm-router` 0.1.17 from PyPI, a Rust binary in a wheel; scripts/test.sh
//! installs it in the venv) in front of two `pdflow serve` processes, in both of its P/D modes
//! (`--vllm-pd-disaggregation`):
//! - NIXL, its default (`--kv-connector nixl`), speaks vLLM's toy-proxy protocol: P gets a bare
//!   `kv_transfer_params: {"do_remote_decode": true}` and the `kv_transfer_params` of P's answer
//!   go to D.
//! - Mooncake (`--kv-connector mooncake`, P given as `--prefill URL BOOTSTRAP_PORT`): as it
//!   starts, the router reads P's engine id from the bootstrap's `GET /query` at P's host; it
//!   names a transfer to P, and sends D that transfer, the bootstrap's address and P's engine id.
//!
//! In each, its answers equal one engine's alone, streamed or not, D loads each one's KV from P,
//! and both engines are back at their baseline afterwards. Skipped, saying why, without the
//! router's executable (`$PDFLOW_VLLM_ROUTER`, else the venv's `bin/vllm-router`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use pdflow_tests::http_client;
use pdflow_tests::vllm_front::{venv, ServePair, Tool};
use tokio::process::Command;

/// The router's executable, or why there is none.
fn router_exe() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("PDFLOW_VLLM_ROUTER").map(PathBuf::from) {
        if path.is_file() {
            return Ok(path);
        }
        return Err(format!("PDFLOW_VLLM_ROUTER names {}, which is not a file", path.display()));
    }
    let venv = venv();
    let exe = venv.join("bin/vllm-router");
    if !exe.is_file() {
        return Err(format!(
            "{} is missing: install it with `{}/bin/pip install vllm-router==0.1.17` (scripts/test.sh does) or set PDFLOW_VLLM_ROUTER",
            exe.display(),
            venv.display()
        ));
    }
    Ok(exe)
}

/// The router's `--kv-connector`: how it hands D what P prefilled.
#[derive(Debug, Clone, Copy)]
enum KvConnector {
    Nixl,
    Mooncake,
}

impl KvConnector {
    /// Its `--kv-connector` value.
    fn flag(self) -> &'static str {
        match self {
            Self::Nixl => "nixl",
            Self::Mooncake => "mooncake",
        }
    }
}

/// The router, in front of one P and one D; killed on drop.
struct Router {
    _tool: Tool,
    url: String,
}

impl Router {
    async fn start(exe: &Path, pair: &ServePair, connector: KvConnector) -> anyhow::Result<Self> {
        let client = http_client();
        let mut taken = None;
        for _ in 0..3 {
            // It takes no port 0 (its metrics port neither, which is on by default): two free now.
            let (port, metrics_port) = free_ports().context("picking the router's ports")?;
            let mut command = Command::new(exe);
            command.args(["--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", &port.to_string()]);
            command.args(["--prometheus-port", &metrics_port.to_string(), "--worker-startup-check-interval", "1"]);
            command.args(["--kv-connector", connector.flag(), "--prefill", &pair.producer.url()]);
            if let KvConnector::Mooncake = connector {
                // The bootstrap's port, at P's host: the router reads P's engine id there.
                command.arg(pair.bootstrap_port());
            }
            command.args(["--decode", &pair.consumer.url()]);
            let mut tool = Tool::spawn("vllm-router", command)?;
            let url = format!("http://127.0.0.1:{port}");
            match tool.wait_healthy(&client, &url, Duration::from_secs(60)).await {
                Ok(()) => return Ok(Self { _tool: tool, url }),
                // Another process bound a port between the pick and the router's bind: pick again.
                Err(e) if format!("{e:#}").contains("Address already in use") => taken = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(taken.unwrap_or_else(|| anyhow::anyhow!("vllm-router did not start")))
    }
}

/// Two ports free on loopback now (both held while the second is picked, so they differ).
fn free_ports() -> std::io::Result<(u16, u16)> {
    let a = std::net::TcpListener::bind("127.0.0.1:0")?;
    let b = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok((a.local_addr()?.port(), b.local_addr()?.port()))
}

async fn router_in_front_of_pdflow_serve(connector: KvConnector) {
    let what = format!("vllm-router --kv-connector {} in front of pdflow serve", connector.flag());
    let exe = match router_exe() {
        Ok(exe) => exe,
        Err(why) => return pdflow_testkit::skipped(&what, &why),
    };
    let pair = ServePair::start().await.expect("the bootstrap, P and D start");
    let router = Router::start(&exe, &pair, connector).await.expect("vllm-router starts");
    let client = http_client();
    pair.assert_fronted_as_one_engine(&client, &format!("{}/v1/completions", router.url), &what).await;
    drop(router);
    pair.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_router_in_nixl_mode_in_front_of_pdflow_serve() {
    router_in_front_of_pdflow_serve(KvConnector::Nixl).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_router_in_mooncake_mode_in_front_of_pdflow_serve() {
    router_in_front_of_pdflow_serve(KvConnector::Mooncake).await;
}

/// `pdflow bench router` with vLLM's router among its fronts: the router's `cache_aware` and
/// pdflow's, in front of the same engines in one run, every request answered through both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_router_runs_vllm_router_beside_pdflows_proxy() {
    let what = "pdflow bench router with vllm-router among its fronts";
    let exe = match router_exe() {
        Ok(exe) => exe,
        Err(why) => return pdflow_testkit::skipped(what, &why),
    };
    let exe = exe.to_string_lossy().into_owned();
    let mut args = vec!["--fronts", "pdflow:cache_aware,vllm-router:cache_aware"];
    args.extend(super::bench_router::SMALL);
    let (rows, stdout) = super::bench_router::bench_router(&args, &[("PDFLOW_VLLM_ROUTER", &exe)]).await;
    for front in ["pdflow cache_aware", "vllm-router cache_aware"] {
        let r = super::bench_router::row(&rows, front, &stdout);
        assert_eq!(r["failed"], 0, "{what}: every request through {front} is answered: {r}");
        assert_eq!(r["requests"], rows[0]["requests"], "{what}: the same workload through each front:\n{stdout}");
    }
}
