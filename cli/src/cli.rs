//! The `pdflow` command line (DESIGN §8): `demo`, `bootstrap`, `proxy`, `serve`, `bench`,
//! `trace render`. Every node takes the trace-export flags of [`TraceArgs`] (OpenTelemetry's
//! `OTEL_*` variables are their defaults).
//!
//! Long-running commands print one JSON line on stdout once they serve —
//! `{"event":"ready", …addresses…}` — so that scripts and tests can start them on port 0.

pub use pdflow_tools::demo::DemoDevice;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use pdflow_actors::proxy::{PrefillTarget, ProxyArgs};
use pdflow_actors::scheduler_connector::KvRole;
use pdflow_kv::memory::KvShape;
use pdflow_sim_engine::{EngineConfig, LoadFailurePolicy};
use pdflow_transfer::tcp::TcpConfig;

use pdflow_node::config::{Deadlines, VllmEnv, DEFAULT_BOOTSTRAP_PORT};
use pdflow_sim_node::engine_node::{BootstrapPlacement, Parallel};
use pdflow_sim_node::EngineNodeConfig;

#[derive(Debug, Parser)]
#[command(name = "pdflow", version, about = "Prefill/decode disaggregation as a dataflow of actors")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// The seed scenario end to end on loopback: bootstrap, proxy, P and D; prints the 43-step
    /// timeline and verifies KV and output against a single engine.
    Demo(DemoArgs),
    /// The bootstrap server alone (engine_id → workers' side-channel addresses).
    Bootstrap(BootstrapCmd),
    /// The proxy alone; accepts vLLM's proxy arguments.
    Proxy(ProxyCmd),
    /// One engine (the simulated engine with pdflow's connector), producer or consumer.
    Serve(Box<ServeCmd>),
    /// Benchmarks: each prints a table and can write `--json PATH`.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Trace files: `pdflow trace render TRACE.json --out timeline.html`.
    #[command(subcommand)]
    Trace(TraceCmd),
    /// The fault matrix on the simulated engines in this process: every actor kind ×
    /// every step at which it is alive × the faults that apply, node kills of P, D and bootstrap;
    /// prints one row per cell (outcome, correctness, time to terminal, leaked blocks).
    Chaos(ChaosArgs),
    /// One rank's worker of a `pdflow serve --rank-processes` engine; the engine starts it.
    #[command(hide = true)]
    RankWorker(RankWorkerArgs),
}

#[derive(Debug, Args)]
pub struct RankWorkerArgs {
    /// The engine's Unix socket.
    #[arg(long)]
    pub ipc: PathBuf,
}

#[derive(Debug, Args)]
pub struct ChaosArgs {
    /// Write `{"cells": [...], "passed", "failed"}` to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// A reduced matrix: a few cells per actor kind and fault kind.
    #[arg(long)]
    pub quick: bool,
    /// D's kv_load_failure_policy in every cell.
    #[arg(long, value_enum, default_value = "recompute")]
    pub policy: PolicyArg,
    /// Only the cells whose name (`actor/step/fault`, e.g. `send_worker/29`) contains this.
    #[arg(long, conflicts_with = "load")]
    pub only: Option<String>,
    /// Only the network cells: P, D and the proxy as processes in their own network namespaces,
    /// one link cut per cell (root and `ip netns` needed; the full run includes them where it can).
    #[arg(long, conflicts_with_all = ["load", "quick", "no_netns"])]
    pub netns: bool,
    /// The full matrix without its network cells.
    #[arg(long, conflicts_with = "load")]
    pub no_netns: bool,
    /// Load with faults instead of the matrix: many requests at once through the proxy and 2P2D,
    /// a few of them given one random per-request fault (actor kills, message drop / corrupt /
    /// delay; no node kills); checks every request ends clean and correct, no block leaks, flat
    /// memory, and every node serving after.
    #[arg(long, conflicts_with = "quick")]
    pub load: bool,
    /// `--load`: how many requests.
    #[arg(long, requires = "load", default_value_t = 2000)]
    pub requests: usize,
    /// `--load`: how many requests in flight at once.
    #[arg(long, requires = "load", default_value_t = 64)]
    pub concurrency: usize,
    /// `--load`: share of requests given a fault, ceil(requests × rate) of them (0.01 = 1 %).
    #[arg(long, requires = "load", default_value_t = 0.01)]
    pub fault_rate: f64,
    /// `--load`: seed of the prompts, of which requests are faulted and how.
    #[arg(long, requires = "load", default_value_t = 1)]
    pub seed: u64,
    /// `--load`: un-faulted requests first, at the same concurrency (the memory baseline).
    #[arg(long, requires = "load", default_value_t = 200)]
    pub warmup: usize,
    /// `--load`: leave out the faults whose label (`actor/step/fault`) starts with this
    /// (repeatable; e.g. `proxy/` for every proxy actor kill).
    #[arg(long, requires = "load")]
    pub exclude: Vec<String>,
}

#[cfg(feature = "fault-injection")]
impl ChaosArgs {
    pub fn to_options(&self) -> pdflow_tools::chaos::ChaosOptions {
        let policy = match self.policy {
            PolicyArg::Recompute => LoadFailurePolicy::Recompute,
            PolicyArg::Fail => LoadFailurePolicy::Fail,
        };
        let network = if self.netns {
            pdflow_tools::chaos::NetworkCells::Only
        } else if self.quick || self.no_netns {
            pdflow_tools::chaos::NetworkCells::Off
        } else {
            pdflow_tools::chaos::NetworkCells::WhereAvailable
        };
        pdflow_tools::chaos::ChaosOptions { quick: self.quick, policy, filter: self.only.clone(), network }
    }

    /// The options of `--load`, every bad value reported.
    pub fn to_load_options(&self) -> Result<pdflow_tools::chaos::load::LoadOptions, Vec<String>> {
        let opts = pdflow_tools::chaos::load::LoadOptions {
            requests: self.requests,
            concurrency: self.concurrency,
            fault_rate: self.fault_rate,
            seed: self.seed,
            policy: self.to_options().policy,
            warmup: self.warmup,
            exclude: self.exclude.clone(),
            ..pdflow_tools::chaos::load::LoadOptions::default()
        };
        opts.validate().map(|()| opts)
    }
}

#[derive(Debug, Subcommand)]
pub enum TraceCmd {
    /// One request's timeline as the seed draws it: a lane per participant, each step a bar at
    /// its real time, figures on hover, the TTFT decomposition. Self-contained HTML/SVG.
    Render(RenderArgs),
}

#[derive(Debug, Args)]
pub struct RenderArgs {
    /// A Jaeger JSON trace file (`--trace-file` of any pdflow command, or Jaeger UI's download).
    pub trace: PathBuf,
    /// The HTML file to write.
    #[arg(long)]
    pub out: PathBuf,
    /// The request trace to draw (default: the first trace holding step 8).
    #[arg(long)]
    pub trace_id: Option<String>,
}

/// Trace export, chosen at run time; nothing is exported unless asked.
#[derive(Debug, Clone, Default, Args)]
pub struct TraceArgs {
    /// Send step spans over OTLP to this collector (e.g. http://127.0.0.1:4317 for gRPC,
    /// http://127.0.0.1:4318 for HTTP).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// The full OTLP traces URL (overrides --otlp-endpoint; used as is).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", hide_short_help = true)]
    pub otlp_traces_endpoint: Option<String>,
    /// OTLP transport: `grpc` or `http/protobuf` (the default).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_PROTOCOL")]
    pub otlp_protocol: Option<String>,
    /// `otlp` (export, to localhost if no endpoint is given) or `none`.
    #[arg(long, env = "OTEL_TRACES_EXPORTER", hide_short_help = true)]
    pub traces_exporter: Option<String>,
    /// service.name of this node (default pdflow-proxy / -prefill / -decode / -bootstrap; the
    /// demo names each span by the node that emitted it).
    #[arg(long, env = "OTEL_SERVICE_NAME")]
    pub service_name: Option<String>,
    /// Longest time a finished span waits before it is sent, in ms (default 1000).
    #[arg(long, env = "OTEL_BSP_SCHEDULE_DELAY", hide_short_help = true)]
    pub otlp_schedule_delay_ms: Option<u64>,
    /// Deadline of each OTLP export call, in ms (default 10000).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TIMEOUT", hide_short_help = true)]
    pub otlp_timeout_ms: Option<u64>,
    /// Write the step spans at exit as a Jaeger JSON file (Jaeger UI: Search → JSON File).
    #[arg(long)]
    pub trace_file: Option<PathBuf>,
}

impl TraceArgs {
    /// The settings the exporters validate.
    pub fn settings(&self) -> pdflow_observability::export::ExportSettings {
        pdflow_observability::export::ExportSettings {
            otlp_endpoint: self.otlp_endpoint.clone(),
            otlp_traces_endpoint: self.otlp_traces_endpoint.clone(),
            otlp_protocol: self.otlp_protocol.clone(),
            traces_exporter: self.traces_exporter.clone(),
            service_name: self.service_name.clone(),
            schedule_delay_ms: self.otlp_schedule_delay_ms,
            timeout_ms: self.otlp_timeout_ms,
            trace_file: self.trace_file.clone(),
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum BenchCmd {
    /// The seed request P→D through the actors and transfer engines, with same-run ceilings.
    Transfer(pdflow_tools::bench::transfer::Options),
    /// The seed request through proxy, P and D: TTFT split; requests/s for small prompts.
    E2e(pdflow_tools::bench::e2e::Options),
    /// The proxy alone against in-memory stub upstreams.
    Proxy(pdflow_tools::bench::proxy::Options),
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    #[arg(long, default_value_t = 1000)]
    pub prompt_tokens: usize,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// KV blocks per engine.
    #[arg(long, default_value_t = 96)]
    pub num_blocks: usize,
    /// KV shape: `qwen3-8b` or `LAYERS,KV_HEADS,HEAD_DIM,BLOCK_SIZE` (bf16).
    #[arg(long, default_value = "qwen3-8b", value_parser = parse_shape)]
    pub kv_shape: KvShape,
    /// Where the engines keep their KV: `cpu` (host memory), or `cuda` (P on GPU 0, D on GPU 1 —
    /// both on GPU 0 when it is the only one; needs a build with `--features cuda`).
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DemoDevice,
    /// With `--device cuda`: the path of step 29 (`staged`: tcp through pinned host buffers, the
    /// cross-host path, instead of the in-process peer copy).
    #[arg(long, value_enum, default_value = "auto")]
    pub gpu_path: GpuPathArg,
    /// P writes the KV to D layer by layer while its prefill computes the later layers.
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    pub layerwise: OnOff,
    /// P's tensor-parallel size: its KV heads split over this many workers (replicated when there
    /// are more workers than heads), each with its own KV cache and side channel.
    #[arg(long, default_value_t = 1)]
    pub prefill_tp: u32,
    /// D's tensor-parallel size (may differ from P's).
    #[arg(long, default_value_t = 1)]
    pub decode_tp: u32,
    /// P's pipeline-parallel size: its layers split over this many stages.
    #[arg(long, default_value_t = 1)]
    pub prefill_pp: u32,
    /// D's pipeline-parallel size.
    #[arg(long, default_value_t = 1)]
    pub decode_pp: u32,
    /// A DeepSeek-V3-shaped MLA cache instead of `--kv-shape`: 61 layers of one latent of 576
    /// values per token, the same on every tensor-parallel rank (one P rank sends each D rank).
    #[arg(long)]
    pub mla: bool,
    /// `--trace-file PATH` writes the seed request's trace and the start-up traces.
    #[command(flatten)]
    pub trace: TraceArgs,
}

/// `--transport`: how P writes D's KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TransportArg {
    Auto,
    Tcp,
}

/// A switch: `on` or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

/// `--gpu-path`: how P with GPU KV writes a D with GPU KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum GpuPathArg {
    /// cuda-peer in one process, cuda-ipc on one host, cuda-staged across hosts (or when D's
    /// CUDA IPC handles cannot be opened here).
    #[default]
    Auto,
    /// Always cuda-staged: tcp through pinned host buffers, as to a D on another host.
    Staged,
}

impl From<GpuPathArg> for pdflow_transfer::GpuPath {
    fn from(a: GpuPathArg) -> Self {
        match a {
            GpuPathArg::Auto => Self::Auto,
            GpuPathArg::Staged => Self::Staged,
        }
    }
}

/// The cluster secret, shared by a deployment's bootstrap, proxy, P and D.
#[derive(Debug, Args)]
pub struct SecretArgs {
    /// A file holding the cluster secret (the current key; during a rotation, the previous one on
    /// a second line). Without it, PDFLOW_CLUSTER_SECRET_FILE or PDFLOW_CLUSTER_SECRET are read.
    /// With a secret, every pdflow socket serves only peers that prove they hold it: the
    /// bootstrap's /register and /query, the side channel's pulls, the data channel's hello.
    #[arg(long)]
    pub cluster_secret_file: Option<String>,
}

impl SecretArgs {
    /// The secret from `--cluster-secret-file`, else the environment (none: no authentication).
    pub fn load(&self) -> Result<Option<pdflow_auth::ClusterSecret>, String> {
        let loaded = match &self.cluster_secret_file {
            Some(path) => pdflow_auth::ClusterSecret::from_file(path).map(Some),
            None => pdflow_auth::ClusterSecret::from_env(),
        };
        loaded.map_err(|e| format!("--cluster-secret-file / PDFLOW_CLUSTER_SECRET: {e}"))
    }
}

#[derive(Debug, Args)]
pub struct BootstrapCmd {
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (default: VLLM_MOONCAKE_BOOTSTRAP_PORT, else 8998; 0 for any).
    #[arg(long)]
    pub port: Option<u16>,
    #[command(flatten)]
    pub secret: SecretArgs,
    #[command(flatten)]
    pub trace: TraceArgs,
}

#[derive(Debug, Args)]
pub struct ProxyCmd {
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// A prefill engine: `--prefill URL [BOOTSTRAP_PORT]` (repeat for several; port default 8998).
    #[arg(long, num_args = 1..=2, value_names = ["URL", "BOOTSTRAP_PORT"], required = true, action = clap::ArgAction::Append)]
    pub prefill: Vec<String>,
    /// A decode engine: `--decode URL` (repeat for several).
    #[arg(long, required = true)]
    pub decode: Vec<String>,
    /// Deadline of every upstream call, in seconds.
    #[arg(long, default_value_t = 120)]
    pub upstream_timeout: u64,
    /// How often P and D are health-checked, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub health_interval_ms: u64,
    #[command(flatten)]
    pub secret: SecretArgs,
    #[command(flatten)]
    pub trace: TraceArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RoleArg {
    Producer,
    Consumer,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PolicyArg {
    Recompute,
    Fail,
}

#[derive(Debug, Args)]
pub struct ServeCmd {
    #[arg(long, value_enum)]
    pub role: RoleArg,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// HTTP port (0 for any).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Engine id (default: a random uuid).
    #[arg(long)]
    pub engine_id: Option<String>,
    #[arg(long, default_value = "Qwen/Qwen3-8B")]
    pub served_model_name: String,
    #[arg(long, default_value = "qwen3-8b", value_parser = parse_shape)]
    pub kv_shape: KvShape,
    #[arg(long, default_value_t = 256)]
    pub num_blocks: usize,
    /// Tokens per step; below the prompt length this is chunked prefill.
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    #[arg(long, default_value_t = 4096)]
    pub max_model_len: usize,
    /// Producer: register with this bootstrap instead of launching one (e.g. `http://127.0.0.1:8998`).
    #[arg(long, conflicts_with = "bootstrap_port")]
    pub bootstrap_url: Option<String>,
    /// Producer: launch the bootstrap on this port (default VLLM_MOONCAKE_BOOTSTRAP_PORT, else 8998).
    #[arg(long)]
    pub bootstrap_port: Option<u16>,
    /// Seconds P waits for a pulled request's prefill, and keeps sent-ready blocks
    /// (default VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, else 30).
    #[arg(long)]
    pub abort_request_timeout: Option<u64>,
    /// Producer: seconds a pull waits for its request's prefill to be ready — seed step 22
    /// (`p_pull_wait_ready`: regions prepared, waiting for ready) — before P answers D with an
    /// error (default: the abort-request timeout).
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
    pub ready_timeout: Option<f64>,
    /// Producer: seconds sent-ready blocks wait for D's pull — from seed step 27
    /// (`p_record_send_ready`: block ids and expiry recorded) — before P frees them anyway
    /// (default: the abort-request timeout).
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
    pub send_expiry: Option<f64>,
    /// Consumer: seconds one side-channel exchange may take — seed step 21 (`d_send_pull_meta`)
    /// until P's FINISH, step 30 (`p_reply_finish`) — before D fails the load (default: the
    /// abort-request timeout + 5).
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
    pub pull_timeout: Option<f64>,
    /// Consumer: seconds one bootstrap look-up may take — seed step 20 (`d_bootstrap_query`:
    /// GET /query for P's worker addresses) (default 5).
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
    pub bootstrap_timeout: Option<f64>,
    /// Consumer: what to do when the KV cannot be loaded.
    #[arg(long, value_enum, default_value = "recompute")]
    pub kv_load_failure_policy: PolicyArg,
    /// Parallel TCP streams per peer for KV writes.
    #[arg(long, default_value_t = 4)]
    pub streams_per_peer: usize,
    /// Shared token that P must present to D's data server.
    #[arg(long, env = "PDFLOW_TRANSFER_TOKEN")]
    pub transfer_token: Option<String>,
    #[command(flatten)]
    pub secret: SecretArgs,
    /// TLS on every data connection (`on` needs the cluster secret: the certificates are made
    /// from it, and both ends prove it in the handshake). Set the same on P and D; the same-host
    /// path, which never leaves the host, is not affected.
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    pub tls: OnOff,
    /// `auto`: P writes a D on the same host straight into its memory (`process_vm_writev`) when
    /// the kernel allows it, over tcp otherwise; `tcp`: always over tcp (as vLLM's
    /// `kv_connector_extra_config` `transport`).
    #[arg(long, value_enum, default_value_t = TransportArg::Auto)]
    pub transport: TransportArg,
    /// Record KV checksums on both sides of every transfer (costs a pass over the bytes).
    #[arg(long)]
    pub verify_checksums: bool,
    /// Producer: write each prefill's KV to D layer by layer while later layers compute (D's pull
    /// must have arrived; layers done before it are written when it does). Consumers ignore it.
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    pub layerwise: OnOff,
    /// Run the simulated model's forward pinned to CPU N, apart from the connector's threads and
    /// the network stack, as a GPU runs it (the rest of the process stays where it was started:
    /// e.g. `taskset -c 1 pdflow serve … --forward-cpu 0`).
    #[arg(long, value_name = "N")]
    pub forward_cpu: Option<usize>,
    /// Keep this engine's KV on CUDA device N (a build with `--features cuda`): P then writes a D
    /// with GPU KV in another process on this host through CUDA IPC, one kernel launch per plan.
    #[arg(long, value_name = "N")]
    pub kv_device: Option<usize>,
    /// Producer with `--kv-device`: the path to a D with GPU KV (`auto`: CUDA IPC on this host,
    /// staged tcp across hosts; `staged`: staged tcp always).
    #[arg(long, value_enum, default_value = "auto")]
    pub gpu_path: GpuPathArg,
    /// Shard the engine's KV over this many tensor-parallel workers (KV heads split, replicated
    /// when there are more workers than heads), as vLLM's `--tensor-parallel-size`: each worker
    /// has its own KV cache and side channel (P) or data server (D); P and D may differ.
    #[arg(long, visible_alias = "tp", default_value_t = 1)]
    pub tensor_parallel_size: u32,
    /// Split the engine's layers over this many pipeline stages, as vLLM's
    /// `--pipeline-parallel-size` (its default split).
    #[arg(long, visible_alias = "pp", default_value_t = 1)]
    pub pipeline_parallel_size: u32,
    /// Run this many engines (data-parallel ranks, each its own scheduler, KV cache and workers)
    /// behind one API, as vLLM's `--data-parallel-size`: engine ids `{engine_id}_dp{rank}`; a
    /// request goes to the rank its `X-data-parallel-rank` header names, else the least busy.
    #[arg(long, visible_alias = "dp", default_value_t = 1)]
    pub data_parallel_size: u32,
    /// With tensor or pipeline parallelism: run each rank's worker (P's side channel, D's data
    /// server, and their transfers) in a process of its own, as vLLM runs one worker process per
    /// rank. Each rank's KV cache is shared memory that the engine's simulated forward writes; a
    /// rank's process that dies stops the engine.
    #[arg(long)]
    pub rank_processes: bool,
    #[command(flatten)]
    pub trace: TraceArgs,
}

/// The largest value `pdflow serve` takes for a deadline flag, in seconds (one day).
pub const MAX_DEADLINE_S: f64 = 86_400.0;

/// Parses `qwen3-8b` or `LAYERS,KV_HEADS,HEAD_DIM,BLOCK_SIZE`.
pub fn parse_shape(s: &str) -> Result<KvShape, String> {
    if s.eq_ignore_ascii_case("qwen3-8b") {
        return Ok(KvShape::QWEN3_8B);
    }
    let parts: Vec<usize> = s
        .split(',')
        .map(|p| p.trim().parse::<usize>().map_err(|_| format!("`{p}` is not a number")))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("--kv-shape {s:?}: {e}; expected qwen3-8b or LAYERS,KV_HEADS,HEAD_DIM,BLOCK_SIZE"))?;
    match parts[..] {
        [num_layers, num_kv_heads, head_dim, block_size] if parts.iter().all(|&p| p > 0) => {
            Ok(KvShape { num_layers, num_kv_heads, head_dim, dtype_bytes: 2, block_size })
        }
        _ => Err(format!(
            "--kv-shape {s:?}: expected qwen3-8b or four positive numbers LAYERS,KV_HEADS,HEAD_DIM,BLOCK_SIZE"
        )),
    }
}

/// Regroups `--prefill` values into `[URL, PORT?]` occurrences: a value made of digits only is the
/// bootstrap port of the URL before it.
fn group_prefill(values: &[String]) -> Vec<Vec<String>> {
    let mut groups: Vec<Vec<String>> = Vec::new();
    for v in values {
        match groups.last_mut() {
            Some(g) if g.len() == 1 && !v.is_empty() && v.chars().all(|c| c.is_ascii_digit()) => g.push(v.clone()),
            _ => groups.push(vec![v.clone()]),
        }
    }
    groups
}

impl ProxyCmd {
    /// The proxy's arguments, every error reported at once.
    pub fn to_args(&self) -> Result<ProxyArgs, Vec<String>> {
        let mut errors = Vec::new();
        let mut prefill = Vec::new();
        for p in group_prefill(&self.prefill) {
            let url = p[0].trim_end_matches('/').to_string();
            if !url.starts_with("http://") {
                errors.push(format!("--prefill {url}: expected an http:// URL"));
            }
            let bootstrap_port = match p.get(1) {
                None => DEFAULT_BOOTSTRAP_PORT,
                Some(s) => match s.parse::<u16>() {
                    Ok(port) if port > 0 => port,
                    _ => {
                        errors.push(format!("--prefill {url} {s}: the bootstrap port must be a TCP port (1-65535)"));
                        0
                    }
                },
            };
            prefill.push(PrefillTarget { url, bootstrap_port });
        }
        for d in &self.decode {
            if !d.starts_with("http://") {
                errors.push(format!("--decode {d}: expected an http:// URL"));
            }
        }
        let bind = format!("{}:{}", self.host, self.port);
        let bind: Option<SocketAddr> =
            bind.parse().map_err(|_| errors.push(format!("--host/--port {bind}: not an IP address and port"))).ok();
        let secret = self.secret.load().unwrap_or_else(|e| {
            errors.push(e);
            None
        });
        match bind {
            Some(bind) if errors.is_empty() => Ok(ProxyArgs {
                bind,
                prefill,
                decode: self.decode.iter().map(|d| d.trim_end_matches('/').to_string()).collect(),
                health_interval: Duration::from_millis(self.health_interval_ms.max(10)),
                upstream_timeout: Duration::from_secs(self.upstream_timeout.max(1)),
                ready_timeout: None,
                secret,
            }),
            _ => Err(errors),
        }
    }
}

impl ServeCmd {
    /// The engine node's config, from flags and vLLM's environment variables; every error at once.
    pub fn to_config(&self, env: &VllmEnv) -> Result<EngineNodeConfig, Vec<String>> {
        let mut errors = self.count_errors();
        let flags = self.deadline_flags(&mut errors);
        if self.role == RoleArg::Consumer && (self.bootstrap_url.is_some() || self.bootstrap_port.is_some()) {
            errors.push("--bootstrap-url/--bootstrap-port are for producers: a consumer finds P's bootstrap in each request's kv_transfer_params".to_string());
        }
        let secret = self.secret.load().unwrap_or_else(|e| {
            errors.push(e);
            None
        });
        let mut tcp = TcpConfig {
            streams_per_peer: self.streams_per_peer,
            auth_token: self.transfer_token.clone(),
            secret,
            gpu_path: self.gpu_path.into(),
            same_host: match self.transport {
                TransportArg::Auto => pdflow_transfer::same_host::SameHostMode::Auto,
                TransportArg::Tcp => pdflow_transfer::same_host::SameHostMode::Off,
            },
            ..TcpConfig::default()
        };
        if let Err(e) = tcp.set_tls(self.tls == OnOff::On) {
            errors.push(format!("--tls on: {e}"));
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        let role = match self.role {
            RoleArg::Producer => KvRole::Producer,
            RoleArg::Consumer => KvRole::Consumer,
        };
        Ok(EngineNodeConfig {
            role,
            host: self.host.clone(),
            port: self.port,
            engine: self.engine_config(),
            bootstrap: self.bootstrap(role, env),
            deadlines: self.deadlines(env, flags),
            tcp,
            verify_checksums: self.verify_checksums,
            layerwise: self.layerwise == OnOff::On && role.produces(),
            kv_device: self.kv_device,
            faults: pdflow_actors::fault_seam::no_faults(),
            parallel: Parallel { tp: self.tensor_parallel_size, pp: self.pipeline_parallel_size },
            dp_rank: 0,
            // The program and its arguments are the process's: `main` fills them in.
            rank_processes: None,
        })
    }

    /// The flags that count something and must not be 0.
    fn count_errors(&self) -> Vec<String> {
        let mut errors = Vec::new();
        if self.num_blocks == 0 {
            errors.push("--num-blocks must be at least 1".to_string());
        }
        if self.max_num_batched_tokens == 0 {
            errors.push("--max-num-batched-tokens must be at least 1".to_string());
        }
        if self.streams_per_peer == 0 {
            errors.push("--streams-per-peer must be at least 1".to_string());
        }
        if self.tensor_parallel_size == 0 || self.pipeline_parallel_size == 0 || self.data_parallel_size == 0 {
            errors.push(
                "--tensor-parallel-size, --pipeline-parallel-size and --data-parallel-size must be at least 1"
                    .to_string(),
            );
        }
        if self.rank_processes && self.tensor_parallel_size * self.pipeline_parallel_size == 1 {
            errors.push(
                "--rank-processes runs each rank of a sharded engine in its own process: it needs --tensor-parallel-size or --pipeline-parallel-size above 1"
                    .to_string(),
            );
        }
        if self.abort_request_timeout == Some(0) {
            errors.push("--abort-request-timeout 0 would fail every transfer; use at least 1".to_string());
        }
        if let Some(cpu) = self.forward_cpu {
            if let Err(e) = pdflow_sim_engine::affinity::check_cpu(cpu) {
                errors.push(format!(
                    "--forward-cpu {cpu}: cannot run a thread there ({e}); give one of the CPUs this process may use (`nproc`, `taskset -p $$`)"
                ));
            }
        }
        errors
    }

    /// The deadline flags given, each checked ([`deadline_seconds`]).
    fn deadline_flags(&self, errors: &mut Vec<String>) -> DeadlineFlags {
        DeadlineFlags {
            ready_timeout: deadline_seconds("--ready-timeout", self.ready_timeout, errors),
            send_expiry: deadline_seconds("--send-expiry", self.send_expiry, errors),
            pull_timeout: deadline_seconds("--pull-timeout", self.pull_timeout, errors),
            bootstrap_timeout: deadline_seconds("--bootstrap-timeout", self.bootstrap_timeout, errors),
        }
    }

    /// The deadlines: each flag given, else the default derived from the abort-request timeout
    /// (the flag, else `VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`).
    fn deadlines(&self, env: &VllmEnv, flags: DeadlineFlags) -> Deadlines {
        let abort = self.abort_request_timeout.map(Duration::from_secs).unwrap_or(env.abort_request_timeout);
        let defaults = Deadlines::from_abort_timeout(abort);
        Deadlines {
            ready_timeout: flags.ready_timeout.unwrap_or(defaults.ready_timeout),
            send_expiry: flags.send_expiry.unwrap_or(defaults.send_expiry),
            pull_timeout: flags.pull_timeout.unwrap_or(defaults.pull_timeout),
            bootstrap_timeout: flags.bootstrap_timeout.unwrap_or(defaults.bootstrap_timeout),
        }
    }

    /// Where a producer's bootstrap runs: an external one, or launched on the flag's port (else
    /// `VLLM_MOONCAKE_BOOTSTRAP_PORT`); a consumer has none.
    fn bootstrap(&self, role: KvRole, env: &VllmEnv) -> BootstrapPlacement {
        match (role, &self.bootstrap_url) {
            (KvRole::Consumer, _) => BootstrapPlacement::None,
            (_, Some(url)) => BootstrapPlacement::External { url: url.trim_end_matches('/').to_string() },
            (_, None) => BootstrapPlacement::Launch { port: self.bootstrap_port.unwrap_or(env.bootstrap_port) },
        }
    }

    /// The simulated engine's config.
    fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            engine_id: self.engine_id.clone().unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
            served_model_name: self.served_model_name.clone(),
            shape: self.kv_shape,
            num_blocks: self.num_blocks,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len: self.max_model_len,
            kv_load_failure_policy: match self.kv_load_failure_policy {
                PolicyArg::Recompute => LoadFailurePolicy::Recompute,
                PolicyArg::Fail => LoadFailurePolicy::Fail,
            },
            forward_cpu: self.forward_cpu,
            ..EngineConfig::default()
        }
    }
}

/// The deadline flags of `pdflow serve` that were given (and valid).
struct DeadlineFlags {
    ready_timeout: Option<Duration>,
    send_expiry: Option<Duration>,
    pull_timeout: Option<Duration>,
    bootstrap_timeout: Option<Duration>,
}

/// A deadline flag's seconds: above 0 and at most [`MAX_DEADLINE_S`]; an invalid value is
/// reported in `errors`.
fn deadline_seconds(flag: &str, value: Option<f64>, errors: &mut Vec<String>) -> Option<Duration> {
    let v = value?;
    // A day bounds every deadline of the transfer path (and keeps Duration from overflowing).
    if v.is_finite() && v > 0.0 && v <= MAX_DEADLINE_S {
        Some(Duration::from_secs_f64(v))
    } else {
        errors
            .push(format!("{flag} {v}: expected a number of seconds above 0 and at most {MAX_DEADLINE_S} (e.g. 2.5)"));
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_accepts_vllm_arguments() {
        let cli = Cli::try_parse_from([
            "pdflow",
            "proxy",
            "--port",
            "0",
            "--prefill",
            "http://127.0.0.1:8010",
            "8998",
            "--prefill",
            "http://127.0.0.1:8011",
            "--decode",
            "http://127.0.0.1:8020",
            "--decode",
            "http://127.0.0.1:8021",
        ])
        .expect("parses");
        let Command::Proxy(p) = cli.command else { panic!("not proxy") };
        let args = p.to_args().expect("valid");
        assert_eq!(args.prefill.len(), 2);
        assert_eq!(args.prefill[0].bootstrap_port, 8998);
        assert_eq!(args.prefill[1].bootstrap_port, DEFAULT_BOOTSTRAP_PORT);
        assert_eq!(args.decode.len(), 2);
    }

    #[test]
    fn bad_flags_are_all_reported() {
        let cli =
            Cli::try_parse_from(["pdflow", "proxy", "--prefill", "127.0.0.1:8010", "99999", "--decode", "ftp://x"])
                .expect("parses");
        let Command::Proxy(p) = cli.command else { panic!("not proxy") };
        assert_eq!(p.to_args().expect_err("invalid").len(), 3);
        assert!(parse_shape("36,8,128,16").is_ok());
        assert!(parse_shape("36,8,x,16").is_err());
        assert!(parse_shape("36,8,128").is_err());
    }

    #[cfg(feature = "fault-injection")]
    #[test]
    fn chaos_load_flags_parse_and_need_load() {
        let cli = Cli::try_parse_from([
            "pdflow",
            "chaos",
            "--load",
            "--requests",
            "240",
            "--concurrency",
            "16",
            "--fault-rate",
            "0.05",
            "--seed",
            "9",
            "--policy",
            "fail",
        ])
        .expect("parses");
        let Command::Chaos(c) = cli.command else { panic!("not chaos") };
        let o = c.to_load_options().expect("valid");
        assert_eq!(
            (o.requests, o.concurrency, o.fault_rate, o.seed, o.policy),
            (240, 16, 0.05, 9, LoadFailurePolicy::Fail)
        );
        assert!(Cli::try_parse_from(["pdflow", "chaos", "--requests", "10"]).is_err(), "--requests needs --load");
        let cli = Cli::try_parse_from(["pdflow", "chaos", "--load", "--fault-rate", "2", "--concurrency", "0"])
            .expect("parses");
        let Command::Chaos(c) = cli.command else { panic!("not chaos") };
        assert_eq!(c.to_load_options().expect_err("invalid").len(), 2);
        let cli = Cli::try_parse_from(["pdflow", "chaos", "--quick"]).expect("the matrix is unchanged");
        let Command::Chaos(c) = cli.command else { panic!("not chaos") };
        assert!(!c.load && c.quick);
    }

    #[cfg(feature = "fault-injection")]
    #[test]
    fn chaos_network_cells_are_in_the_full_run_only_alone_or_left_out() {
        use pdflow_tools::chaos::NetworkCells;
        let network = |args: &[&str]| {
            let cli = Cli::try_parse_from(["pdflow", "chaos"].iter().chain(args)).expect("parses");
            let Command::Chaos(c) = cli.command else { panic!("not chaos") };
            c.to_options().network
        };
        assert_eq!(network(&[]), NetworkCells::WhereAvailable);
        assert_eq!(network(&["--netns"]), NetworkCells::Only);
        assert_eq!(network(&["--netns", "--only", "link:p-d"]), NetworkCells::Only);
        assert_eq!(network(&["--no-netns"]), NetworkCells::Off);
        assert_eq!(network(&["--quick"]), NetworkCells::Off);
        for bad in [&["--netns", "--quick"][..], &["--netns", "--no-netns"], &["--netns", "--load"]] {
            assert!(Cli::try_parse_from(["pdflow", "chaos"].iter().chain(bad)).is_err(), "{bad:?} must be refused");
        }
    }

    #[test]
    fn serve_deadline_flags_map_onto_deadlines_and_bad_values_name_the_flag() {
        let env = VllmEnv::from_lookup(&|_| None).expect("defaults");
        let parse = |extra: &[&str]| {
            let mut argv = vec!["pdflow", "serve", "--role", "consumer", "--abort-request-timeout", "10"];
            argv.extend_from_slice(extra);
            let Command::Serve(s) = Cli::try_parse_from(argv).expect("parses").command else { panic!("not serve") };
            s.to_config(&env)
        };
        let cfg = parse(&[
            "--pull-timeout",
            "2.5",
            "--bootstrap-timeout",
            "0.5",
            "--ready-timeout",
            "3",
            "--send-expiry",
            "4",
        ])
        .expect("valid");
        assert_eq!(
            cfg.deadlines,
            Deadlines {
                ready_timeout: Duration::from_secs(3),
                send_expiry: Duration::from_secs(4),
                pull_timeout: Duration::from_millis(2500),
                bootstrap_timeout: Duration::from_millis(500),
            }
        );
        assert_eq!(
            parse(&[]).expect("valid").deadlines,
            Deadlines::from_abort_timeout(Duration::from_secs(10)),
            "unset flags keep the derived defaults"
        );
        let errors = parse(&[
            "--pull-timeout",
            "0",
            "--send-expiry",
            "-1",
            "--ready-timeout",
            "NaN",
            "--bootstrap-timeout",
            "1e9",
        ])
        .expect_err("invalid");
        assert_eq!(errors.len(), 4, "{errors:?}");
        for (e, flag) in
            errors.iter().zip(["--ready-timeout", "--send-expiry", "--pull-timeout", "--bootstrap-timeout"])
        {
            assert!(e.starts_with(flag), "{e} names {flag}");
        }
    }

    #[test]
    fn trace_flags_and_render_parse() {
        let cli = Cli::try_parse_from([
            "pdflow",
            "serve",
            "--role",
            "producer",
            "--otlp-endpoint",
            "http://127.0.0.1:4317",
            "--otlp-protocol",
            "grpc",
            "--trace-file",
            "t.json",
        ])
        .expect("parses");
        let Command::Serve(s) = cli.command else { panic!("not serve") };
        let settings = s.trace.settings();
        assert_eq!(settings.otlp_endpoint.as_deref(), Some("http://127.0.0.1:4317"));
        assert_eq!(settings.otlp_protocol.as_deref(), Some("grpc"));
        assert_eq!(settings.trace_file, Some(PathBuf::from("t.json")));
        let cli =
            Cli::try_parse_from(["pdflow", "trace", "render", "t.json", "--out", "timeline.html"]).expect("parses");
        let Command::Trace(TraceCmd::Render(r)) = cli.command else { panic!("not trace render") };
        assert_eq!((r.trace, r.out), (PathBuf::from("t.json"), PathBuf::from("timeline.html")));
        assert!(Cli::try_parse_from(["pdflow", "trace", "render", "t.json"]).is_err(), "--out is required");
    }
}
