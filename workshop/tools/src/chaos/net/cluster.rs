//! The cluster one network cell runs on: separate `pdflow` processes — P (and the bootstrap it
//! launches) in namespace `p`, D in `d`, the proxy in the root namespace — joined by three veth
//! links (proxy↔P, proxy↔D and a dedicated P↔D link, [`crate::netns`]). Each engine binds every
//! socket on its namespace's service address, so P's side channel and bootstrap, and D's data
//! server, are reached by the other engine over the P↔D link only; the proxy (and the runner)
//! reach both engines' HTTP APIs over their own links.
//!
//! It owns no seed step; what it reads back (block baselines, failure counters, link counters) is
//! what a cell's verdict is made of.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::netns::{Link, Ns, Place, Topology};
use pdflow_node::config::Deadlines;

/// `--abort-request-timeout` of both engines, in seconds: every other engine deadline derives
/// from it (pull = abort + 5 s; bootstrap look-up 5 s).
pub const ABORT_S: u64 = 3;
/// The proxy's `--upstream-timeout` where the proxy's deadline is under test, in seconds.
pub const UPSTREAM_S: u64 = 4;
/// The proxy's `--upstream-timeout` elsewhere: longer than D's own deadlines (bootstrap look-up
/// + pull + a local prefill), or the proxy would answer 504 before D could recompute.
pub const UPSTREAM_LONG_S: u64 = 30;
/// How long a process may take to print its ready line.
const READY_DEADLINE: Duration = Duration::from_secs(30);

/// The deadlines both engines run with.
pub fn deadlines() -> Deadlines {
    Deadlines::from_abort_timeout(Duration::from_secs(ABORT_S))
}

/// How long an engine may hold blocks for a request it lost track of (the engine's own bound).
pub fn kv_state_timeout() -> Duration {
    pdflow_sim_node::engine_node::kv_state_timeout(&deadlines())
}

/// P's KV write deadline (TcpConfig's default: `pdflow serve` has no flag for it).
pub fn write_timeout() -> Duration {
    pdflow_transfer::tcp::TcpConfig::default().write_timeout
}

/// What a cell's cluster runs: D's policy, P's prefill budget per step, the proxy's deadline.
#[derive(Debug, Clone, Copy)]
pub struct NetSpec {
    /// D's `--kv-load-failure-policy` (`recompute` or `fail`).
    pub policy: &'static str,
    /// P's `--max-num-batched-tokens` (small: P prefills in many steps).
    pub p_batch: usize,
    /// The proxy's `--upstream-timeout`, in seconds.
    pub upstream_s: u64,
    /// P's `--layerwise on`.
    pub layerwise: bool,
    /// P's `--forward-cpu`.
    pub p_forward_cpu: Option<usize>,
}

/// One engine's block counts, read over `GET /pdflow/blocks`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Blocks {
    pub total: u64,
    pub free: u64,
    pub requests: u64,
    pub finished: u64,
}

impl Blocks {
    fn from_json(v: &Value) -> Option<Self> {
        Some(Self {
            total: v["total"].as_u64()?,
            free: v["free"].as_u64()?,
            requests: v["requests"].as_u64()?,
            finished: v["finished"].as_u64().unwrap_or(0),
        })
    }

    /// No block held and no request tracked.
    pub fn at_baseline(&self) -> bool {
        self.free == self.total && self.requests == 0
    }

    pub fn held(&self) -> u64 {
        self.total.saturating_sub(self.free)
    }
}

/// An engine not back at its baseline when a wait for it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotIdle {
    /// It still held blocks or tracked requests: leaked.
    Held { blocks: u64, requests: u64 },
    /// Its `/pdflow/blocks` did not answer: nothing is known of its blocks.
    Unreachable,
}

impl NotIdle {
    /// The blocks known to be leaked (none known when unreachable).
    pub fn blocks(self) -> usize {
        match self {
            NotIdle::Held { blocks, .. } => usize::try_from(blocks).unwrap_or(usize::MAX),
            NotIdle::Unreachable => 0,
        }
    }
}

impl std::fmt::Display for NotIdle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotIdle::Held { blocks, requests } => write!(f, "{blocks} blocks and {requests} requests held"),
            NotIdle::Unreachable => write!(f, "its /pdflow/blocks did not answer"),
        }
    }
}

/// The three nodes in their namespaces.
pub struct NetCluster {
    pub topo: Topology,
    pub proxy_p: Link,
    pub pd: Link,
    pub p: Ns,
    pub p_url: String,
    pub d_url: String,
    pub proxy_url: String,
    pub client: reqwest::Client,
}

/// Starts `bin ARGS…` in `place` and returns its ready line.
async fn spawn(topo: &Topology, bin: &Path, place: Place, label: &str, args: &[String]) -> Result<Value, String> {
    let mut cmd = topo.command(place, bin);
    cmd.args(args);
    if std::env::var_os("PDFLOW_CHAOS_LOG").is_none() {
        cmd.stderr(Stdio::null());
    }
    let (_, stdout) = topo.exec(label, cmd).map_err(|e| format!("{label}: {e}"))?;
    let mut lines = BufReader::new(stdout.ok_or_else(|| format!("{label}: no stdout"))?).lines();
    let line = tokio::time::timeout(READY_DEADLINE, lines.next_line())
        .await
        .map_err(|_| format!("{label}: no ready line within {READY_DEADLINE:?}"))?
        .map_err(|e| format!("{label}: reading its stdout: {e}"))?
        .ok_or_else(|| format!("{label}: exited before it was ready"))?;
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    serde_json::from_str(&line).map_err(|e| format!("{label}: ready line is not JSON ({e}): {line}"))
}

fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

fn field(v: &Value, k: &str) -> Result<String, String> {
    v[k].as_str().map(str::to_string).ok_or_else(|| format!("ready line has no {k}: {v}"))
}

impl NetCluster {
    /// P in `p`, D in `d`, the proxy in the root namespace, as `spec` says; `bin` is the `pdflow`
    /// binary. Returns once the proxy reports healthy.
    pub async fn start(bin: &Path, spec: NetSpec) -> Result<Self, String> {
        let mut topo = Topology::new().map_err(|e| e.to_string())?;
        let p = topo.add_namespace("p").map_err(|e| e.to_string())?;
        let d = topo.add_namespace("d").map_err(|e| e.to_string())?;
        let proxy_p = topo.add_link(Place::Root, p).map_err(|e| e.to_string())?;
        let _proxy_d = topo.add_link(Place::Root, d).map_err(|e| e.to_string())?;
        let pd = topo.add_link(p, d).map_err(|e| e.to_string())?;
        let abort = ABORT_S.to_string();
        let engine = |role: &str, host: String| {
            let mut a = strings(&[
                "serve",
                "--role",
                role,
                "--host",
                &host,
                "--port",
                "0",
                "--kv-shape",
                "qwen3-8b",
                "--num-blocks",
                "160",
            ]);
            a.extend(strings(&["--abort-request-timeout", &abort, "--max-model-len", "4096"]));
            // P and D reach each other (and the proxy reaches them) over veth links, not loopback:
            // without a cluster secret that takes protected mode's opt-out.
            a.push("--insecure".to_string());
            a
        };
        let mut p_args = engine("producer", topo.addr(p).to_string());
        p_args.extend(strings(&["--bootstrap-port", "0", "--max-num-batched-tokens", &spec.p_batch.to_string()]));
        if spec.layerwise {
            p_args.extend(strings(&["--layerwise", "on"]));
        }
        if let Some(cpu) = spec.p_forward_cpu {
            p_args.extend(["--forward-cpu".to_string(), cpu.to_string()]);
        }
        let p_ready = spawn(&topo, bin, p.into(), "producer", &p_args).await?;
        let mut d_args = engine("consumer", topo.addr(d).to_string());
        d_args.extend(strings(&["--kv-load-failure-policy", spec.policy]));
        let d_ready = spawn(&topo, bin, d.into(), "consumer", &d_args).await?;
        let p_url = format!("http://{}", field(&p_ready, "addr")?);
        let d_url = format!("http://{}", field(&d_ready, "addr")?);
        let bootstrap = field(&p_ready, "bootstrap_addr")?;
        let bport = bootstrap.rsplit(':').next().ok_or("bootstrap address without a port")?.to_string();
        let proxy_args = strings(&[
            "proxy",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--prefill",
            &p_url,
            &bport,
            "--decode",
            &d_url,
            "--upstream-timeout",
            &spec.upstream_s.to_string(),
            "--health-interval-ms",
            "100",
        ]);
        let proxy_ready = spawn(&topo, bin, Place::Root, "proxy", &proxy_args).await?;
        let proxy_url = format!("http://{}", field(&proxy_ready, "addr")?);
        let client = reqwest::Client::builder().no_proxy().build().map_err(|e| format!("HTTP client: {e}"))?;
        crate::demo::wait_ready(&client, &proxy_url, Duration::from_secs(20))
            .await
            .map_err(|e| format!("proxy: {e}"))?;
        Ok(Self { topo, proxy_p, pd, p, p_url, d_url, proxy_url, client })
    }

    /// An engine's `/pdflow/blocks`; `None` while it cannot be reached (bounded).
    pub async fn blocks(&self, url: &str) -> Option<Blocks> {
        let r = self.client.get(format!("{url}/pdflow/blocks")).timeout(Duration::from_secs(1)).send().await.ok()?;
        Blocks::from_json(&r.json::<Value>().await.ok()?)
    }

    /// Waits (bounded) until P and D hold no block and no request. `Ok(how long)`, or what each
    /// engine still held at the bound (P, D; `None`: that one was idle).
    pub async fn wait_baseline(&self, bound: Duration) -> Result<Duration, (Option<NotIdle>, Option<NotIdle>)> {
        let start = Instant::now();
        let p = self.wait_engine_baseline(&self.p_url, bound).await;
        let d = self.wait_engine_baseline(&self.d_url, bound.saturating_sub(start.elapsed())).await;
        match (p, d) {
            (Ok(()), Ok(())) => Ok(start.elapsed()),
            (p, d) => Err((p.err(), d.err())),
        }
    }

    /// Waits (bounded) until one engine holds no block and no request; at the bound, what it
    /// still held (or that it could not be asked).
    pub async fn wait_engine_baseline(&self, url: &str, bound: Duration) -> Result<(), NotIdle> {
        let start = Instant::now();
        loop {
            let s = self.blocks(url).await;
            if s.is_some_and(|s| s.at_baseline()) {
                return Ok(());
            }
            if start.elapsed() >= bound {
                return Err(
                    s.map_or(NotIdle::Unreachable, |s| NotIdle::Held { blocks: s.held(), requests: s.requests })
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sum of an engine's `pdflow_failures_total` samples (failed step spans); `None` if the
    /// engine cannot be reached.
    pub async fn failures(&self, url: &str) -> Option<f64> {
        let r = self.client.get(format!("{url}/metrics")).timeout(Duration::from_secs(2)).send().await.ok()?;
        let text = r.text().await.ok()?;
        Some(
            text.lines()
                .filter(|l| l.starts_with("pdflow_failures_total"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum(),
        )
    }

    /// Bytes P's end of the P↔D link has sent.
    pub fn p_sent(&self) -> Result<u64, String> {
        self.topo.tx_bytes(self.pd, self.p.into()).map_err(|e| e.to_string())
    }

    /// POSTs a completion through the proxy within `deadline`: status and body.
    pub async fn request(&self, body: &Value, deadline: Duration) -> Result<(u16, Value), String> {
        super::super::cell::post(&self.client, &format!("{}/v1/completions", self.proxy_url), body, deadline).await
    }
}
