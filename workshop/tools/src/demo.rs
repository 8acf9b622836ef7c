//! `pdflow demo`: the seed scenario in one command.
//!
//! Starts, on loopback, a producer engine whose TP0 launches the bootstrap (seed step 2), a
//! consumer engine and the proxy; sends the seed request (a 1000-token prompt, max_tokens 128,
//! greedy) through the proxy; rebuilds the 43-step timeline from the step spans; then checks that
//! D received exactly the bytes P sent (checksums of the request's blocks on both sides, steps 29
//! and 34) and that the output equals a single engine's run of the same prompt. With
//! `--device cuda` both engines keep their KV on GPUs (the model writes it with a kernel, step 29
//! moves it by the cuda-peer engine) and the output is still checked against the reference run on
//! host memory.

mod ranks;

/// Where the demo's (and `pdflow bench transfer`'s) KV lives: `--device cpu|cuda`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoDevice {
    Cpu,
    Cuda,
}

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use pdflow_actors::proxy::{PrefillTarget, ProxyArgs};
use pdflow_actors::scheduler_connector::KvRole;
use pdflow_auth::PeerFilter;
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_observability::attrs;
use pdflow_observability::capture::SpanCapture;
use pdflow_sim_engine::hybrid::HybridLayout;
use pdflow_sim_engine::scheduler::BlockStats;
use pdflow_sim_engine::{api, Engine, EngineConfig};
use pdflow_transfer::tcp::TcpConfig;
use pdflow_transfer::GpuPath;
use serde::Serialize;

use crate::timeline::{StepTiming, Timeline};
use pdflow_node::config::Deadlines;
use pdflow_node::{NodeError, ProxyNode};
use pdflow_sim_node::engine_node::{serve_http, BootstrapPlacement, Parallel};
use pdflow_sim_node::{EngineNode, EngineNodeConfig, SimNodeError};

/// What the demo runs.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    pub shape: KvShape,
    /// A hybrid model's layers and KV-cache groups (`shape` is then one region per layer of a
    /// group); None: a dense model.
    pub hybrid: Option<HybridLayout>,
    /// Blocks per engine.
    pub num_blocks: usize,
    pub deadlines: Deadlines,
    /// Where P's and D's KV caches live.
    pub device: KvPlacement,
    /// With GPU KV: the path of step 29.
    pub gpu_path: GpuPath,
    /// P streams each prefill's KV to D layer by layer while later layers compute.
    pub layerwise: bool,
    /// P's and D's tensor/pipeline-parallel sizes (each rank its own KV cache and sockets).
    pub prefill: Parallel,
    pub decode: Parallel,
}

impl Default for DemoOptions {
    fn default() -> Self {
        Self {
            prompt_tokens: 1000,
            max_tokens: 128,
            shape: KvShape::QWEN3_8B,
            hybrid: None,
            num_blocks: 96,
            deadlines: Deadlines::default(),
            device: KvPlacement::Host,
            gpu_path: GpuPath::Auto,
            layerwise: false,
            prefill: Parallel::default(),
            decode: Parallel::default(),
        }
    }
}

/// Where the demo's engines keep their KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvPlacement {
    /// Host memory: P writes D's memory by the same-host path (or tcp).
    Host,
    /// GPU memory: P on GPU `p`, D on GPU `d` (the same GPU when only one is visible); P writes
    /// D's memory by the cuda-peer engine, one kernel launch per plan (feature `cuda`).
    Cuda { p: usize, d: usize },
}

impl KvPlacement {
    /// The GPUs for `--device cuda`: P on GPU 0, D on GPU 1, or both on GPU 0 when it is the
    /// only one.
    pub fn cuda() -> Result<Self, DemoError> {
        #[cfg(feature = "cuda")]
        {
            let count = pdflow_transfer::cuda::device_count().map_err(|e| DemoError::Device(e.to_string()))?;
            Ok(KvPlacement::Cuda { p: 0, d: usize::from(count > 1) })
        }
        #[cfg(not(feature = "cuda"))]
        Err(DemoError::Device(
            "this pdflow was built without GPU support: build it with `cargo build --release --features cuda`".into(),
        ))
    }

    fn of(self, role: KvRole) -> Option<usize> {
        match (self, role) {
            (KvPlacement::Host, _) => None,
            (KvPlacement::Cuda { d, .. }, KvRole::Consumer) => Some(d),
            (KvPlacement::Cuda { p, .. }, _) => Some(p),
        }
    }
}

/// The report `--json` writes.
#[derive(Debug, Clone, Serialize)]
pub struct DemoReport {
    pub verified: bool,
    pub output_matches_reference: bool,
    pub kv_bytes: u64,
    pub blocks: u64,
    pub descriptors: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub ttft_ms: f64,
    pub transfer_ms: f64,
    pub kv_checksum_p: Option<String>,
    pub kv_checksum_d: Option<String>,
    /// The transfer backend step 29 reports (`same-host`, `tcp`, `cuda-peer`).
    pub backend: Option<String>,
    /// Where P's and D's KV lived (`host`, `cuda:N`).
    pub kv_memory_p: String,
    pub kv_memory_d: String,
    pub steps: Vec<StepTiming>,
    pub missing_steps: Vec<u8>,
    /// P's and D's ranks, `TPxPP`.
    pub prefill_ranks: String,
    pub decode_ranks: String,
    /// With ranks: each D rank's KV of the request against what the model computes for its heads
    /// and layers (empty without ranks: the checksums above compare P's and D's blocks).
    pub rank_checks: Vec<RankCheck>,
    /// With ranks: step 29's writes, one per (P rank, D rank) pull that moved bytes.
    pub rank_writes: Vec<RankWrite>,
    /// Why `verified` is false, if it is.
    pub problems: Vec<String>,
    #[serde(skip)]
    pub timeline_table: String,
}

/// One D rank's KV of the request, checked.
#[derive(Debug, Clone, Serialize)]
pub struct RankCheck {
    pub tp_rank: u32,
    pub pp_rank: u32,
    /// The checksum of the request's blocks D's rank reported at step 34.
    pub kv_checksum: Option<String>,
    /// The checksum of the same blocks as the model writes them (its layers and KV heads).
    pub expected: String,
    pub ok: bool,
}

/// One write of step 29 across ranks.
#[derive(Debug, Clone, Serialize)]
pub struct RankWrite {
    pub p_tp_rank: String,
    pub p_pp_rank: String,
    pub d_tp_rank: String,
    pub d_pp_rank: String,
    pub bytes: u64,
}

/// Why the demo could not run at all (as opposed to running and failing verification).
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error(transparent)]
    SimNode(#[from] SimNodeError),
    #[error("HTTP request to {url} failed: {reason}")]
    Http { url: String, reason: String },
    #[error("the proxy at {url} was not ready within {deadline:?}")]
    NotReady { url: String, deadline: Duration },
    #[error("--device cuda: {0}")]
    Device(String),
}

/// The demo's prompt: `n` deterministic words.
pub fn seed_prompt(n: usize) -> String {
    prompt_words(n, 0x5EED)
}

/// A deterministic prompt of `n` words, which the simulated tokenizer maps one-to-one to tokens
/// (`w123` is token 123); `seed` picks the words.
pub fn prompt_words(n: usize, seed: u64) -> String {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            format!("w{}", 3 + (x >> 33) % 31_000)
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn engine_config(opts: &DemoOptions, engine_id: &str) -> EngineConfig {
    EngineConfig {
        engine_id: engine_id.to_string(),
        shape: opts.shape,
        hybrid: opts.hybrid.clone(),
        num_blocks: opts.num_blocks,
        ..EngineConfig::default()
    }
}

async fn post_json(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> Result<serde_json::Value, DemoError> {
    let err = |reason: String| DemoError::Http { url: url.to_string(), reason };
    let resp = client.post(url).json(body).send().await.map_err(|e| err(e.to_string()))?;
    let status = resp.status();
    let text = resp.text().await.map_err(|e| err(e.to_string()))?;
    if !status.is_success() {
        return Err(err(format!("{status}: {text}")));
    }
    serde_json::from_str(&text).map_err(|e| err(format!("not JSON ({e}): {text}")))
}

pub async fn wait_ready(client: &reqwest::Client, url: &str, deadline: Duration) -> Result<(), DemoError> {
    let until = Instant::now() + deadline;
    while Instant::now() < until {
        if let Ok(r) = client.get(format!("{url}/health")).send().await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(DemoError::NotReady { url: url.to_string(), deadline })
}

fn token_ids(v: &serde_json::Value) -> Vec<u64> {
    v["choices"][0]["token_ids"].as_array().map(|a| a.iter().filter_map(|t| t.as_u64()).collect()).unwrap_or_default()
}

/// One producer (whose TP0 launches the bootstrap), one consumer and the proxy, on loopback, in
/// this process: the demo's setup, also used by `pdflow bench e2e`.
pub struct LocalCluster {
    pub prefill: EngineNode,
    pub decode: EngineNode,
    pub proxy: ProxyNode,
    pub client: reqwest::Client,
}

impl LocalCluster {
    /// Starts the three nodes and waits (bounded) until the proxy is ready.
    pub async fn start(opts: &DemoOptions, verify_checksums: bool) -> Result<Self, DemoError> {
        let node_cfg = |role: KvRole, bootstrap: BootstrapPlacement, id: &str| EngineNodeConfig {
            role,
            host: "127.0.0.1".into(),
            port: 0,
            engine: engine_config(opts, id),
            bootstrap,
            deadlines: opts.deadlines,
            tcp: TcpConfig { gpu_path: opts.gpu_path, ..TcpConfig::default() },
            verify_checksums,
            layerwise: opts.layerwise && role.produces(),
            kv_device: opts.device.of(role),
            faults: pdflow_actors::fault_seam::no_faults(),
            parallel: if role.produces() { opts.prefill } else { opts.decode },
            dp_rank: 0,
            rank_processes: None,
        };
        let prefill = EngineNode::start(node_cfg(
            KvRole::Producer,
            BootstrapPlacement::Launch { port: 0 },
            &format!("prefill-{}", uuid::Uuid::new_v4()),
        ))
        .await?;
        let decode = EngineNode::start(node_cfg(
            KvRole::Consumer,
            BootstrapPlacement::None,
            &format!("decode-{}", uuid::Uuid::new_v4()),
        ))
        .await?;
        let bootstrap_port =
            prefill.launched_bootstrap_addr().map(|a| a.port()).unwrap_or(pdflow_node::config::DEFAULT_BOOTSTRAP_PORT);
        let proxy = ProxyNode::start(ProxyArgs {
            health_interval: Duration::from_millis(50),
            upstream_timeout: Duration::from_secs(120),
            ..ProxyArgs::new(
                SocketAddr::from(([127, 0, 0, 1], 0)),
                vec![PrefillTarget { url: prefill.url(), bootstrap_port }],
                vec![decode.url()],
            )
        })
        .await?;
        let client = reqwest::Client::builder()
            .no_proxy()
            .build()
            .map_err(|e| DemoError::Http { url: String::new(), reason: e.to_string() })?;
        wait_ready(&client, &proxy.url(), Duration::from_secs(30)).await?;
        Ok(Self { prefill, decode, proxy, client })
    }

    /// Stops every node; returns P's and D's final block stats.
    pub async fn shutdown(self) -> (BlockStats, BlockStats) {
        self.proxy.shutdown().await;
        let stats = (self.prefill.engine.block_stats(), self.decode.engine.block_stats());
        self.prefill.shutdown().await;
        self.decode.shutdown().await;
        stats
    }
}

/// Runs the seed scenario. `capture` must be installed as a `tracing` layer.
pub async fn run(opts: DemoOptions, capture: SpanCapture) -> Result<DemoReport, DemoError> {
    capture.clear();
    let cluster = LocalCluster::start(&opts, true).await?;
    let result = drive(&opts, &cluster.client, &cluster.proxy, &capture).await.map(|mut report| {
        report.kv_memory_p = cluster.prefill.kv_cache.memory().to_string();
        report.kv_memory_d = cluster.decode.kv_cache.memory().to_string();
        report
    });
    let (p_free, d_free) = cluster.shutdown().await;
    let mut report = result?;
    if let Some(backend) = report.backend.as_deref() {
        let expected = match (opts.device, opts.gpu_path) {
            (KvPlacement::Host, _) => !backend.starts_with("cuda"),
            (KvPlacement::Cuda { .. }, GpuPath::Auto) => backend == "cuda-peer",
            (KvPlacement::Cuda { .. }, GpuPath::Staged) => backend == "cuda-staged",
        };
        if !expected {
            report
                .problems
                .push(format!("step 29 used the {backend} backend, not the one for {} KV", report.kv_memory_p));
            report.verified = false;
        }
    }
    for (side, stats) in [("P", p_free), ("D", d_free)] {
        if stats.free != stats.total {
            report.problems.push(format!(
                "{side} holds {} of {} blocks after the request (leak)",
                stats.total - stats.free,
                stats.total
            ));
            report.verified = false;
        }
    }
    Ok(report)
}

async fn drive(
    opts: &DemoOptions,
    client: &reqwest::Client,
    proxy: &ProxyNode,
    capture: &SpanCapture,
) -> Result<DemoReport, DemoError> {
    let body = serde_json::json!({
        "model": "Qwen/Qwen3-8B",
        "prompt": seed_prompt(opts.prompt_tokens),
        "max_tokens": opts.max_tokens,
        "temperature": 0,
    });
    let request_start = Instant::now();
    let response = post_json(client, &format!("{}/v1/completions", proxy.url()), &body).await?;
    // P's last spans may close just after the response: its engine frees the blocks (33) and then
    // reports the send to its SchedulerConnector actor (32). Give both a bounded moment.
    let settle_until = Instant::now() + Duration::from_secs(5);
    let closed =
        |step: u8| capture.spans().iter().any(|s| s.step == step && s.start >= request_start && s.end.is_some());
    while Instant::now() < settle_until && !(closed(32) && closed(33)) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let timeline = Timeline::build(&capture.spans(), request_start);
    let reference = reference_run(opts, client, &body).await?;

    let mut problems = Vec::new();
    let output = token_ids(&response);
    let output_matches_reference = !output.is_empty() && output == token_ids(&reference);
    if !output_matches_reference {
        problems.push(format!(
            "P/D output ({} tokens) differs from the single-engine reference ({} tokens)",
            output.len(),
            token_ids(&reference).len()
        ));
    }
    let ranked = opts.prefill != Parallel::default() || opts.decode != Parallel::default();
    let (sum_p, sum_d, rank_checks, rank_writes, kv_equal) = if ranked {
        let spans: Vec<_> = capture.spans().into_iter().filter(|s| s.start >= request_start).collect();
        let checks = ranks::check_decode_ranks(opts, &spans);
        let writes = ranks::rank_writes(&spans);
        let world = (opts.decode.tp * opts.decode.pp) as usize;
        let ok = checks.len() == world && checks.iter().all(|c| c.ok);
        if !ok {
            problems.push(format!(
                "D's ranks' KV: {} of {world} ranks hold what the model computes for their heads and layers",
                checks.iter().filter(|c| c.ok).count()
            ));
        }
        (None, None, checks, writes, ok)
    } else {
        let sum_p = timeline.step(29).and_then(|s| s.figures.get(attrs::KV_CHECKSUM).cloned());
        let sum_d = timeline.step(34).and_then(|s| s.figures.get(attrs::KV_CHECKSUM).cloned());
        let kv_equal = sum_p.is_some() && sum_p == sum_d;
        if !kv_equal {
            problems.push(format!("KV checksum of the request's blocks: P sent {sum_p:?}, D holds {sum_d:?}"));
        }
        (sum_p, sum_d, Vec::new(), Vec::new(), kv_equal)
    };
    if !timeline.missing.is_empty() {
        problems.push(format!("steps not observed: {:?}", timeline.missing));
    }
    let ttft_ms = match (timeline.step(8), timeline.step(39)) {
        (Some(a), Some(b)) => b.start_ms + b.duration_ms - a.start_ms,
        _ => 0.0,
    };
    let usage = &response["usage"];
    Ok(DemoReport {
        verified: kv_equal && output_matches_reference && timeline.missing.is_empty(),
        output_matches_reference,
        kv_bytes: match ranked {
            true => rank_writes.iter().map(|w| w.bytes).sum(),
            false => timeline.figure(29, attrs::BYTES).unwrap_or(0),
        },
        // The blocks step 29 moved (a hybrid model's window and state pages, not all it holds).
        blocks: timeline.figure(29, attrs::BLOCKS).or_else(|| timeline.figure(27, attrs::BLOCKS)).unwrap_or(0),
        descriptors: timeline
            .figure(29, attrs::DESCRIPTORS)
            .or_else(|| timeline.figure(28, attrs::DESCRIPTORS))
            .unwrap_or(0),
        prompt_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
        completion_tokens: usage["completion_tokens"].as_u64().unwrap_or(0),
        ttft_ms: (ttft_ms * 1e3).round() / 1e3,
        transfer_ms: timeline.step(29).map(|s| s.duration_ms).unwrap_or(0.0),
        kv_checksum_p: sum_p,
        kv_checksum_d: sum_d,
        backend: timeline.step(29).and_then(|s| s.figures.get(attrs::BACKEND).cloned()),
        kv_memory_p: String::new(),
        kv_memory_d: String::new(),
        timeline_table: timeline.render(),
        missing_steps: timeline.missing.clone(),
        steps: timeline.steps,
        prefill_ranks: format!("{}x{}", opts.prefill.tp, opts.prefill.pp),
        decode_ranks: format!("{}x{}", opts.decode.tp, opts.decode.pp),
        rank_checks,
        rank_writes,
        problems,
    })
}

/// The same request on one engine alone, no connector: the reference output.
async fn reference_run(
    opts: &DemoOptions,
    client: &reqwest::Client,
    body: &serde_json::Value,
) -> Result<serde_json::Value, DemoError> {
    let cfg = engine_config(opts, "reference");
    let engine = Engine::start(cfg.clone(), KvCache::new(cfg.shape, cfg.num_blocks), None);
    let (addr, stop, task) = serve_http("127.0.0.1", 0, api::router(engine.clone()), PeerFilter::LoopbackOnly).await?;
    let result = post_json(client, &format!("http://{addr}/v1/completions"), body).await;
    pdflow_sim_node::engine_node::stop_http(stop, task).await;
    engine.shutdown().await;
    result
}
