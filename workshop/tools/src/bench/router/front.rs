//! What the router bench puts in front of the engines: pdflow's proxy with a routing policy (in
//! this process), or vLLM's router (`vllm-router` 0.1.17, its Mooncake P/D mode, a process of
//! its own), found in `$PDFLOW_VLLM_ROUTER`, `.venv/bin`, on `PATH`, or installed by the bench
//! into a virtual environment of its own under `target/` where pip can reach PyPI.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::str::FromStr;
use std::time::Duration;

use anyhow::{bail, Context};
use pdflow_actors::proxy::kv_events::KvEventSource;
use pdflow_actors::proxy::routing::{LocalPrefill, Policy};
use pdflow_actors::proxy::{PrefillTarget, ProxyArgs};
use pdflow_node::ProxyNode;
use tokio::process::{Child, Command};

use super::cluster::Cluster;

/// The version of vLLM's router the bench runs.
pub const VLLM_ROUTER: &str = "vllm-router==0.1.17";

/// The share of a prompt D holds from which `+d-alone` serves it on D alone.
pub const DEFAULT_D_ALONE_PERMILLE: u32 = pdflow_actors::proxy::routing::LocalPrefill::D_HOLDS_PERMILLE_DEFAULT;

/// One front, as `--fronts` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrontSpec {
    /// `pdflow:POLICY` (both pools), with `+d-alone[=SHARE]` (D serves alone a prompt it holds
    /// SHARE of, 0.93 by default: `--local-prefill-when-d-holds`), and `+d-below=N` (D serves
    /// alone a prompt of which it would compute fewer than N tokens: `--local-prefill-below`).
    Pdflow { policy: Policy, local: LocalPrefill },
    /// `vllm-router:POLICY` (its `--policy`, both pools).
    VllmRouter { policy: String },
}

impl FrontSpec {
    pub fn name(&self) -> String {
        match self {
            FrontSpec::Pdflow { policy, local } => {
                let mut name = format!("pdflow {}", policy.name());
                if let Some(permille) = local.d_holds_permille {
                    name.push_str(&format!(" + D alone ≥{:.0}%", permille as f64 / 10.0));
                }
                if local.below_tokens > 0 {
                    name.push_str(&format!(" + D alone <{} new", local.below_tokens));
                }
                name
            }
            FrontSpec::VllmRouter { policy } => format!("vllm-router {policy}"),
        }
    }

    /// Every front the bench knows, in the order it runs them.
    pub fn all() -> Vec<FrontSpec> {
        let pdflow = |policy, d_holds_permille: Option<u32>| FrontSpec::Pdflow {
            policy,
            local: LocalPrefill { below_tokens: 0, d_holds_permille },
        };
        let mut all = vec![
            pdflow(Policy::RoundRobin, None),
            pdflow(Policy::LeastLoaded, None),
            pdflow(Policy::CacheAware, None),
            pdflow(Policy::CacheAware, Some(DEFAULT_D_ALONE_PERMILLE)),
            pdflow(Policy::KvAware, None),
            pdflow(Policy::KvAware, Some(DEFAULT_D_ALONE_PERMILLE)),
        ];
        all.extend(
            ["round_robin", "cache_aware", "kv_aware"]
                .into_iter()
                .map(|p| FrontSpec::VllmRouter { policy: p.to_string() }),
        );
        all
    }
}

impl FromStr for FrontSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("`{s}`: a front is pdflow:POLICY[+d-alone[=SHARE]][+d-below=N] or vllm-router:POLICY");
        let (who, rest) = s.split_once(':').ok_or_else(bad)?;
        match who {
            "pdflow" => {
                let mut parts = rest.split('+');
                let policy = parts.next().ok_or_else(bad)?.parse()?;
                let mut local = LocalPrefill::default();
                for part in parts {
                    let (name, value) = part.split_once('=').map_or((part, None), |(n, v)| (n, Some(v)));
                    match (name, value) {
                        ("d-alone", None) => local.d_holds_permille = Some(DEFAULT_D_ALONE_PERMILLE),
                        ("d-alone", Some(share)) => {
                            let share: f64 = share.parse().map_err(|_| bad())?;
                            if !(0.0..=1.0).contains(&share) {
                                return Err(format!("`{s}`: the share D holds is between 0 and 1"));
                            }
                            local.d_holds_permille = Some((share * 1000.0).round() as u32);
                        }
                        ("d-below", Some(tokens)) => local.below_tokens = tokens.parse().map_err(|_| bad())?,
                        _ => return Err(bad()),
                    }
                }
                Ok(FrontSpec::Pdflow { policy, local })
            }
            "vllm-router" if !rest.is_empty() => Ok(FrontSpec::VllmRouter { policy: rest.to_string() }),
            _ => Err(bad()),
        }
    }
}

/// A running front.
pub enum Front {
    Pdflow(ProxyNode),
    VllmRouter { child: Child, url: String, log: PathBuf },
}

impl Front {
    pub async fn start(spec: &FrontSpec, cluster: &Cluster, router_exe: Option<&Path>) -> anyhow::Result<Front> {
        match spec {
            FrontSpec::Pdflow { policy, local } => {
                let prefill = cluster
                    .prefill
                    .iter()
                    .map(|p| PrefillTarget {
                        url: p.url(),
                        bootstrap_port: p.bootstrap_port.unwrap_or(pdflow_actors::proxy::DEFAULT_BOOTSTRAP_PORT),
                    })
                    .collect();
                let decode = cluster.decode.iter().map(|d| d.url()).collect();
                // Every engine's KV events, for a kv_aware pool (the proxy subscribes to those of
                // its kv_aware pools only).
                let kv_events = cluster
                    .prefill
                    .iter()
                    .chain(&cluster.decode)
                    .map(|e| KvEventSource {
                        engine_url: e.url(),
                        endpoint: e.kv_events.clone(),
                        replay_endpoint: Some(e.kv_replay.clone()).filter(|r| !r.is_empty()),
                        topic: String::new(),
                    })
                    .collect();
                let args = ProxyArgs {
                    health_interval: Duration::from_millis(200),
                    upstream_timeout: Duration::from_secs(120),
                    prefill_policy: *policy,
                    decode_policy: *policy,
                    local_prefill: *local,
                    kv_events,
                    ..ProxyArgs::new(SocketAddr::from(([127, 0, 0, 1], 0)), prefill, decode)
                };
                let node = ProxyNode::start(args).await.context("starting pdflow's proxy")?;
                Ok(Front::Pdflow(node))
            }
            FrontSpec::VllmRouter { policy } => {
                let exe = router_exe.context("vllm-router is not installed")?;
                start_router(exe, policy, cluster).await
            }
        }
    }

    pub fn url(&self) -> String {
        match self {
            Front::Pdflow(node) => node.url(),
            Front::VllmRouter { url, .. } => url.clone(),
        }
    }

    pub async fn stop(self) {
        match self {
            Front::Pdflow(node) => node.shutdown().await,
            Front::VllmRouter { mut child, .. } => {
                let _ = child.kill().await;
            }
        }
    }
}

/// Two ports free on loopback now (the router takes no port 0).
fn free_ports() -> std::io::Result<(u16, u16)> {
    let a = std::net::TcpListener::bind("127.0.0.1:0")?;
    let b = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok((a.local_addr()?.port(), b.local_addr()?.port()))
}

async fn start_router(exe: &Path, policy: &str, cluster: &Cluster) -> anyhow::Result<Front> {
    let (port, metrics_port) = free_ports().context("picking the router's ports")?;
    let log = std::env::temp_dir().join(format!("pdflow-bench-vllm-router-{port}.log"));
    let out = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let err = out.try_clone().context("the router's log")?;
    let mut command = Command::new(exe);
    command.args(["--vllm-pd-disaggregation", "--kv-connector", "mooncake", "--host", "127.0.0.1"]);
    command.args(["--port", &port.to_string(), "--prometheus-port", &metrics_port.to_string()]);
    command.args(["--worker-startup-check-interval", "1", "--policy", policy]);
    for p in &cluster.prefill {
        let bootstrap = p.bootstrap_port.map(|b| b.to_string()).unwrap_or_else(|| "none".into());
        command.args(["--prefill", &p.url(), &bootstrap]);
    }
    for d in &cluster.decode {
        command.args(["--decode", &d.url()]);
    }
    if policy == "kv_aware" {
        for p in &cluster.prefill {
            command.args(["--pd-kv-events", &format!("{}={}", p.url(), p.kv_events)]);
        }
        command.args(["--kv-event-model", "Qwen/Qwen3-8B"]);
    }
    command.stdin(Stdio::null()).stdout(out).stderr(err).kill_on_drop(true);
    let child = command.spawn().with_context(|| format!("starting {}", exe.display()))?;
    let url = format!("http://127.0.0.1:{port}");
    let mut front = Front::VllmRouter { child, url: url.clone(), log: log.clone() };
    let client = reqwest::Client::builder().no_proxy().build()?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Front::VllmRouter { child, .. } = &mut front {
            if let Some(status) = child.try_wait()? {
                let tail = std::fs::read_to_string(&log).unwrap_or_default();
                bail!("vllm-router exited ({status}) as it started: {}", last_lines(&tail, 15));
            }
        }
        let healthy = client.get(format!("{url}/health")).timeout(Duration::from_secs(2)).send().await;
        if healthy.is_ok_and(|r| r.status().is_success()) {
            return Ok(front);
        }
        if tokio::time::Instant::now() >= deadline {
            let tail = std::fs::read_to_string(&log).unwrap_or_default();
            front.stop().await;
            bail!("vllm-router was not healthy within 60 s: {}", last_lines(&tail, 15));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// How long installing vLLM's router may take (a venv and one wheel from PyPI).
const INSTALL_DEADLINE: Duration = Duration::from_secs(600);

/// vLLM's router: `$PDFLOW_VLLM_ROUTER`, `.venv/bin/vllm-router`, `vllm-router` on `PATH`, or one
/// the bench installs (`install`) into `target/bench-vllm-router`; or why there is none.
pub async fn find_router(install: bool) -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("PDFLOW_VLLM_ROUTER").map(PathBuf::from) {
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!("PDFLOW_VLLM_ROUTER names {}, which is not a file", path.display()))
        };
    }
    let own = PathBuf::from("target/bench-vllm-router");
    let candidates = [PathBuf::from(".venv/bin/vllm-router"), own.join("bin/vllm-router")];
    if let Some(found) = candidates.iter().find(|p| p.is_file()) {
        return Ok(found.clone());
    }
    if let Some(found) = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).map(|d| d.join("vllm-router")).collect::<Vec<_>>())
        .and_then(|c| c.into_iter().find(|p| p.is_file()))
    {
        return Ok(found);
    }
    if !install {
        return Err(format!("vllm-router is not installed (`pip install {VLLM_ROUTER}`, or set PDFLOW_VLLM_ROUTER)"));
    }
    println!("installing {VLLM_ROUTER} into {} …", own.display());
    let own_str = own.to_string_lossy().into_owned();
    let pip = own.join("bin/pip").to_string_lossy().into_owned();
    let install = async {
        run("python3", &["-m", "venv", &own_str]).await?;
        run(&pip, &["install", "-q", "--no-cache-dir", VLLM_ROUTER]).await
    };
    tokio::time::timeout(INSTALL_DEADLINE, install)
        .await
        .map_err(|_| format!("installing {VLLM_ROUTER} took more than {INSTALL_DEADLINE:?}"))??;
    let exe = own.join("bin/vllm-router");
    if exe.is_file() {
        Ok(exe)
    } else {
        Err(format!("{VLLM_ROUTER} installed, but {} is missing", exe.display()))
    }
}

/// Runs `program ARGS…` to its end (killed if the caller stops waiting); its stderr on failure.
async fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let out =
        Command::new(program).args(args).kill_on_drop(true).output().await.map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{program} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr)))
    }
}
