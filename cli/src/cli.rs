//! The `pdflow` command line: `demo`, `bootstrap`, `proxy`, `serve`, `bench`,
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
use pdflow_sim_engine::hybrid::{HybridLayout, ModelShape};
use pdflow_sim_engine::{EngineConfig, LoadFailurePolicy};
use pdflow_transfer::tcp::TcpConfig;

use pdflow_node::config::{Deadlines, VllmEnv, DEFAULT_BOOTSTRAP_PORT};
use pdflow_sim_node::engine_node::{BootstrapPlacement, Parallel};
use pdflow_sim_node::EngineNodeConfig;

mod kv_events;
mod limits;
mod serve;
pub use limits::LimitArgs;
pub use serve::ServeCmd;

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
    /// A running proxy's engines: list them, add one, drain one, put one back, remove one (its
    /// admin API).
    Admin(AdminCmd),
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
    /// The in-process matrix on a hybrid model (`gpt-oss-like`, `qwen3.5-like`) instead of the
    /// small dense one.
    #[arg(long, value_parser = parse_hybrid_preset, conflicts_with_all = ["load", "netns"])]
    pub hybrid: Option<&'static str>,
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
    /// N threads spinning on the CPU (normal priority, in this process) for the whole run, so the
    /// cluster competes for the cores.
    #[arg(long, default_value_t = 0)]
    pub starve: usize,
    /// `soak`: mixed load with random faults for a long time.
    #[command(subcommand)]
    pub sub: Option<ChaosCmd>,
}

#[derive(Debug, Subcommand)]
pub enum ChaosCmd {
    /// Mixed load (streamed and not, varied prompts) through the proxy and 2P2D with random
    /// faults for `--duration`; samples RSS and open fds; checks every request is accounted for,
    /// blocks are back at baseline, memory is flat after the warm-up.
    Soak(SoakArgs),
}

#[derive(Debug, Args)]
pub struct SoakArgs {
    /// How long: `90s`, `30m`, `1h`.
    #[arg(long, default_value = "1h")]
    pub duration: String,
    /// Un-faulted load first (default: a sixth of the duration, between 10 s and 5 min).
    #[arg(long)]
    pub warmup: Option<String>,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Share of requests given a fault (0.01 = 1 %).
    #[arg(long, default_value_t = 0.01)]
    pub fault_rate: f64,
    /// Seed of the prompts, the mix, and which requests are faulted and how.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// D's kv_load_failure_policy.
    #[arg(long, value_enum, default_value = "recompute")]
    pub policy: PolicyArg,
    /// How often RSS and open fds are read: `5s`.
    #[arg(long, default_value = "5s")]
    pub sample_every: String,
    /// N threads spinning on the CPU for the whole soak.
    #[arg(long, default_value_t = 0)]
    pub starve: usize,
    /// Leave out the faults whose label starts with this (repeatable).
    #[arg(long)]
    pub exclude: Vec<String>,
    /// Write the report (with the RSS / fd series) to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[cfg(feature = "fault-injection")]
impl SoakArgs {
    /// The soak's options, every bad value reported.
    pub fn to_options(&self) -> Result<pdflow_tools::chaos::soak::SoakOptions, Vec<String>> {
        use pdflow_tools::chaos::soak::{parse_duration, SoakOptions};
        let mut errors = Vec::new();
        let mut duration = |flag: &str, v: &str| {
            parse_duration(v).map_err(|e| errors.push(format!("--{flag}: {e}"))).unwrap_or(Duration::from_secs(1))
        };
        let opts = SoakOptions {
            duration: duration("duration", &self.duration),
            warmup: self.warmup.as_deref().map(|w| duration("warmup", w)),
            sample_every: duration("sample-every", &self.sample_every),
            concurrency: self.concurrency,
            fault_rate: self.fault_rate,
            seed: self.seed,
            policy: match self.policy {
                PolicyArg::Recompute => LoadFailurePolicy::Recompute,
                PolicyArg::Fail => LoadFailurePolicy::Fail,
            },
            starve: self.starve,
            exclude: self.exclude.clone(),
            ..SoakOptions::default()
        };
        if !errors.is_empty() {
            return Err(errors);
        }
        opts.validate().map(|()| opts)
    }
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
        pdflow_tools::chaos::ChaosOptions {
            quick: self.quick,
            policy,
            filter: self.only.clone(),
            network,
            hybrid: self.hybrid,
        }
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
    /// Routing policies compared: pdflow's proxy under each and vLLM's router, in front of the
    /// same xPyD simulated engines, on shared-prefix and unique workloads.
    Router(pdflow_tools::bench::router::Options),
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
    /// KV blocks per engine (default: 96, or what the request takes over a hybrid model's
    /// groups if more).
    #[arg(long)]
    pub num_blocks: Option<usize>,
    /// KV shape: `qwen3-8b`, a hybrid model (`gpt-oss-like`: sliding window 128 and full attention
    /// alternating; `qwen3.5-like`: three linear-attention layers with a recurrent state per full
    /// one) or `LAYERS,KV_HEADS,HEAD_DIM,BLOCK_SIZE` (bf16).
    #[arg(long, default_value = "qwen3-8b", value_parser = parse_shape)]
    pub kv_shape: ModelShape,
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
    /// One-sided RDMA writes through libfabric only (a build with `--features rdma`).
    Rdma,
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

/// The cluster secret, shared by a deployment's bootstrap, proxy, P and D, and protected mode's
/// opt-out.
#[derive(Debug, Args)]
pub struct SecretArgs {
    /// A file holding the cluster secret (the current key; during a rotation, the previous one on
    /// a second line). Without it, PDFLOW_CLUSTER_SECRET_FILE or PDFLOW_CLUSTER_SECRET are read.
    /// With a secret, every pdflow socket serves only peers that prove they hold it: the
    /// bootstrap's /register and /query, the side channel's pulls, the data channel's hello.
    /// Without one, every pdflow socket serves loopback peers only (protected mode).
    #[arg(long)]
    pub cluster_secret_file: Option<String>,
    /// Without a cluster secret, serve peers that are not on loopback anyway, unauthenticated:
    /// anyone who reaches the ports can register P workers, read the bootstrap's table, pull KV
    /// and write D's blocks. Also PDFLOW_INSECURE=1. No effect with a secret.
    #[arg(long)]
    pub insecure: bool,
}

impl SecretArgs {
    /// `--insecure`, else PDFLOW_INSECURE.
    pub fn insecure(&self) -> Result<bool, String> {
        if self.insecure {
            return Ok(true);
        }
        pdflow_auth::insecure_from_env().map_err(|e| e.to_string())
    }

    /// The secret and the opt-out, checked against the address sockets bind (`host`): in
    /// protected mode, a non-loopback address is refused ([`pdflow_auth::PeerFilter::check_bind`]).
    /// Every error in `errors`.
    pub fn load_for(
        &self,
        host: Option<std::net::IpAddr>,
        errors: &mut Vec<String>,
    ) -> (Option<pdflow_auth::ClusterSecret>, bool) {
        let secret = self.load().unwrap_or_else(|e| {
            errors.push(e);
            None
        });
        let insecure = self.insecure().unwrap_or_else(|e| {
            errors.push(e);
            false
        });
        let peers = pdflow_auth::PeerFilter::new(secret.as_ref(), insecure);
        if let Some(Err(e)) = host.map(|h| peers.check_bind(h)) {
            errors.push(format!("--host {e}"));
        }
        (secret, insecure)
    }

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
    pub limits: LimitArgs,
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
    #[arg(long, num_args = 1..=2, value_names = ["URL", "BOOTSTRAP_PORT"], action = clap::ArgAction::Append)]
    pub prefill: Vec<String>,
    /// A decode engine: `--decode URL` (repeat for several).
    #[arg(long)]
    pub decode: Vec<String>,
    /// Take the P and D engines advertised at this bootstrap (`http://host:port`) into the pools
    /// while the proxy runs, as they come and go (repeat for several bootstraps). With it,
    /// --prefill and --decode may be left out.
    #[arg(long, value_name = "BOOTSTRAP_URL")]
    pub discover: Vec<String>,
    /// Keep the pools' engines in this file, rewritten on every change the admin API or discovery
    /// makes: a proxy started again over it starts from those engines (added, drained and
    /// removed ones included), not from --prefill and --decode, which may then be left out.
    #[arg(long, value_name = "PATH")]
    pub roster_file: Option<std::path::PathBuf>,
    /// Deadline of every upstream call, in seconds.
    #[arg(long, default_value_t = 120)]
    pub upstream_timeout: u64,
    /// How often P and D are health-checked, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub health_interval_ms: u64,
    /// Failed health checks in a row after which an engine is out of rotation (with
    /// `--health-interval-ms 200 --unhealthy-after 3`, a dead engine is out within about 0.6 s;
    /// one that refuses a request's connection is out at once either way).
    #[arg(long, default_value_t = pdflow_actors::proxy::UNHEALTHY_AFTER)]
    pub unhealthy_after: u32,
    /// How P (and its data-parallel rank) is chosen for each request: round_robin, least_loaded
    /// (the fewest tokens in flight), cache_aware (the P the prompt's prefix was routed to,
    /// unless it is far busier than the least loaded), kv_aware (the P whose prefix cache holds
    /// the prompt's prefix, from its KV events: --kv-events; text prompts as cache_aware).
    #[arg(long, default_value = "round_robin")]
    pub prefill_policy: String,
    /// How D is chosen for each request (the same policies).
    #[arg(long, default_value = "round_robin")]
    pub decode_policy: String,
    /// D serves a prompt alone (no P, no KV transfer) when it would compute fewer (estimated)
    /// tokens of it than this: the prompt, less the prefix a cache_aware or kv_aware D pool
    /// knows D holds (0: off).
    #[arg(long, default_value_t = 0)]
    pub local_prefill_below: usize,
    /// With `--decode-policy cache_aware` or `kv_aware`: D serves a prompt alone when the share
    /// of it already routed to D (cache_aware), or held by D (kv_aware), is at least this (0–1;
    /// default 0.93 with those policies, the best share `pdflow bench router` measured), or
    /// `off`: every request goes through P.
    #[arg(long, value_name = "SHARE|off")]
    pub local_prefill_when_d_holds: Option<String>,
    /// Where an engine publishes its KV events, for `kv_aware`:
    /// `ENGINE_URL=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=TOPIC]`, ENGINE_URL as given to
    /// --prefill or --decode, the endpoints those of its --kv-events-config (repeat: one per
    /// engine, or per data-parallel rank of one).
    #[arg(long, value_name = "ENGINE_URL=ENDPOINT")]
    pub kv_events: Vec<String>,
    #[command(flatten)]
    pub secret: SecretArgs,
    #[command(flatten)]
    pub limits: LimitArgs,
    #[command(flatten)]
    pub trace: TraceArgs,
}

#[derive(Debug, Args)]
pub struct AdminCmd {
    /// The proxy's URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub proxy: String,
    /// A file holding the cluster secret the calls are signed with (else
    /// PDFLOW_CLUSTER_SECRET_FILE or PDFLOW_CLUSTER_SECRET; none: the proxy serves loopback only).
    #[arg(long)]
    pub cluster_secret_file: Option<String>,
    #[command(subcommand)]
    pub action: AdminAction,
}

#[derive(Debug, Subcommand)]
pub enum AdminAction {
    /// Every engine: pool, url, state, health, engine ids, requests in flight.
    List,
    /// A new engine: `add prefill URL [BOOTSTRAP_PORT]` (port default 8998) or `add decode URL`.
    Add {
        #[arg(value_enum)]
        pool: PoolArg,
        url: String,
        bootstrap_port: Option<u16>,
        /// Where it publishes KV events, for a kv_aware pool:
        /// `tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=TOPIC]` (repeat: one per
        /// data-parallel rank).
        #[arg(long, value_name = "ENDPOINT")]
        kv_events: Vec<String>,
    },
    /// No new request goes to the engine at URL; those in flight finish.
    Drain { url: String },
    /// The draining engine at URL takes new requests again.
    Undrain { url: String },
    /// The engine at URL leaves (refused while it has requests in flight, unless --force).
    Remove {
        url: String,
        #[arg(long)]
        force: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PoolArg {
    Prefill,
    Decode,
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

/// The largest value `pdflow serve` takes for a deadline flag, in seconds (one day).
pub const MAX_DEADLINE_S: f64 = 86_400.0;

/// A hybrid preset's name (`pdflow chaos --hybrid`).
fn parse_hybrid_preset(s: &str) -> Result<&'static str, String> {
    let presets = pdflow_sim_engine::hybrid::PRESETS;
    presets.iter().copied().find(|p| p.eq_ignore_ascii_case(s)).ok_or_else(|| format!("expected one of {presets:?}"))
}

/// What `--kv-shape` takes.
const SHAPES: &str =
    "qwen3-8b, a hybrid preset (gpt-oss-like, qwen3.5-like) or four positive numbers LAYERS,KV_HEADS,HEAD_DIM,BLOCK_SIZE";

/// Parses `qwen3-8b`, a hybrid preset (`gpt-oss-like`, `qwen3.5-like`) or
/// `LAYERS,KV_HEADS,HEAD_DIM,BLOCK_SIZE`.
pub fn parse_shape(s: &str) -> Result<ModelShape, String> {
    if s.eq_ignore_ascii_case("qwen3-8b") {
        return Ok(KvShape::QWEN3_8B.into());
    }
    if let Some((kv, layout)) = HybridLayout::preset(&s.to_ascii_lowercase()) {
        return Ok(ModelShape { kv, hybrid: Some(layout) });
    }
    let parts: Vec<usize> = s
        .split(',')
        .map(|p| p.trim().parse::<usize>().map_err(|_| format!("`{p}` is not a number")))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("--kv-shape {s:?}: {e}; expected {SHAPES}"))?;
    match parts[..] {
        [num_layers, num_kv_heads, head_dim, block_size] if parts.iter().all(|&p| p > 0) => {
            Ok(KvShape { num_layers, num_kv_heads, head_dim, dtype_bytes: 2, block_size }.into())
        }
        _ => Err(format!("--kv-shape {s:?}: expected {SHAPES}")),
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
    /// Whether the proxy serves clients off loopback without a secret (`--insecure`,
    /// `PDFLOW_INSECURE`); [`ProxyCmd::to_args`] reports a bad value.
    pub fn insecure(&self) -> bool {
        self.secret.insecure().unwrap_or(false)
    }

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
        for b in &self.discover {
            if !b.starts_with("http://") {
                errors.push(format!("--discover {b}: expected the bootstrap's http:// URL"));
            }
        }
        let roster = match &self.roster_file {
            Some(path) => pdflow_actors::proxy::Roster::in_file(path)
                .map_err(|e| errors.push(format!("--roster-file: {e}")))
                .unwrap_or_default(),
            None => pdflow_actors::proxy::Roster::default(),
        };
        if self.discover.is_empty() && !roster.holds_engines() && (self.prefill.is_empty() || self.decode.is_empty()) {
            errors.push(
                "the proxy needs --prefill and --decode engines, --discover BOOTSTRAP_URL to find them, or a --roster-file holding engines".into(),
            );
        }
        let bind = format!("{}:{}", self.host, self.port);
        let bind: Option<SocketAddr> =
            bind.parse().map_err(|_| errors.push(format!("--host/--port {bind}: not an IP address and port"))).ok();
        let (secret, _insecure) = self.secret.load_for(bind.map(|b| b.ip()), &mut errors);
        if self.unhealthy_after == 0 {
            errors.push("--unhealthy-after 0: at least one failed health check".into());
        }
        let mut policy = |flag: &str, value: &str| {
            value
                .parse::<pdflow_actors::proxy::routing::Policy>()
                .map_err(|e| errors.push(format!("{flag}: {e}")))
                .unwrap_or_default()
        };
        let prefill_policy = policy("--prefill-policy", &self.prefill_policy);
        let decode_policy = policy("--decode-policy", &self.decode_policy);
        let d_knows = matches!(
            decode_policy,
            pdflow_actors::proxy::routing::Policy::CacheAware | pdflow_actors::proxy::routing::Policy::KvAware
        );
        let d_holds_permille = match self.local_prefill_when_d_holds.as_deref() {
            None => d_knows.then_some(pdflow_actors::proxy::routing::LocalPrefill::D_HOLDS_PERMILLE_DEFAULT),
            Some("off") => None,
            Some(share) => match share.parse::<f64>() {
                Ok(share) if (0.0..=1.0).contains(&share) && d_knows => Some((share * 1000.0).round() as u32),
                Ok(share) if (0.0..=1.0).contains(&share) => {
                    errors.push("--local-prefill-when-d-holds needs --decode-policy cache_aware or kv_aware (what D holds is known from the prompts routed to it, or its KV events)".into());
                    None
                }
                _ => {
                    errors.push(format!(
                        "--local-prefill-when-d-holds {share}: a share of the prompt, from 0 to 1, or `off`"
                    ));
                    None
                }
            },
        };
        let local_prefill =
            pdflow_actors::proxy::routing::LocalPrefill { below_tokens: self.local_prefill_below, d_holds_permille };
        let decode: Vec<String> = self.decode.iter().map(|d| d.trim_end_matches('/').to_string()).collect();
        let prefill_urls: Vec<String> = prefill.iter().map(|p| p.url.clone()).collect();
        let kv_events =
            kv_events::sources(&self.kv_events, (&prefill_urls, prefill_policy), (&decode, decode_policy), &mut errors);
        match bind {
            Some(bind) if errors.is_empty() => Ok(ProxyArgs {
                health_interval: Duration::from_millis(self.health_interval_ms.max(10)),
                unhealthy_after: self.unhealthy_after,
                upstream_timeout: Duration::from_secs(self.upstream_timeout.max(1)),
                secret,
                prefill_policy,
                decode_policy,
                local_prefill,
                kv_events,
                discover: self.discover.iter().map(|b| b.trim_end_matches('/').to_string()).collect(),
                roster,
                ..ProxyArgs::new(bind, prefill, decode)
            }),
            _ => Err(errors),
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

#[cfg(test)]
mod tests;
