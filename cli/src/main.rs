//! The `pdflow` binary: parses the command line ([`cli`]), validates the configuration
//! before anything binds, runs the node, and shuts it down on Ctrl-C / SIGTERM.

mod advertise;
mod cli;
mod faults;

use std::process::ExitCode;
use std::time::Duration;

use crate::cli::{
    AdminAction, AdminCmd, BenchCmd, BootstrapCmd, Cli, Command, DemoArgs, DemoDevice, GpuPathArg, OnOff, PoolArg,
    ProxyCmd, RankWorkerArgs, ServeCmd, TraceArgs, TraceCmd,
};
use anyhow::Context as _;
use clap::Parser;

use crate::faults::{load_fault_plan, FaultLayer, NodeFaults};
use pdflow_actors::fault_seam::NodeKind;
use pdflow_kv::memory::KvShape;
use pdflow_node::config::VllmEnv;
use pdflow_node::{BootstrapNode, ProxyNode};
use pdflow_observability::capture::SpanCapture;
use pdflow_observability::export::{self, ExportConfig, TraceExport};
use pdflow_observability::metrics::{self, MetricsLayer};
use pdflow_sim_node::engine_node::Parallel;
use pdflow_sim_node::rank_process::child::RankChild;
use pdflow_sim_node::rank_process::RankLaunch;
use pdflow_sim_node::{DataParallelGroup, EngineNode};
use pdflow_tools::demo::{self, DemoOptions, KvPlacement};
use pdflow_transfer::tcp::TcpConfig;
use tokio_util::sync::CancellationToken;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// Installs the log output, the demo's capture, the trace exporters, the `/metrics` layer and a
/// fault plan's layer (each optional).
fn init_tracing(
    capture: Option<SpanCapture>,
    export: Option<&TraceExport>,
    metrics: Option<MetricsLayer>,
    faults: Option<FaultLayer>,
) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_filter(filter);
    use tracing_subscriber::Layer as _;
    let _ = tracing_subscriber::registry()
        .with(fmt)
        .with(capture)
        .with(export.and_then(TraceExport::layer))
        .with(metrics)
        .with(faults)
        .try_init();
}

#[cfg(not(feature = "fault-injection"))]
async fn run_chaos(_args: crate::cli::ChaosArgs) -> anyhow::Result<bool> {
    anyhow::bail!(
        "pdflow chaos injects faults, and this pdflow was built without them: build it with \
         `cargo build --release --features pdflow/fault-injection`"
    )
}

#[cfg(feature = "fault-injection")]
async fn run_chaos(args: crate::cli::ChaosArgs) -> anyhow::Result<bool> {
    if let Some(crate::cli::ChaosCmd::Soak(soak)) = &args.sub {
        let opts =
            soak.to_options().map_err(|e| anyhow::anyhow!("invalid chaos soak arguments:\n  {}", e.join("\n  ")))?;
        return Ok(pdflow_tools::chaos::soak::run_cli(&opts, soak.json.as_deref()).await?);
    }
    let _starve = pdflow_tools::chaos::starve::Starvation::start(args.starve)?;
    if args.load {
        let opts = args
            .to_load_options()
            .map_err(|e| anyhow::anyhow!("invalid chaos --load arguments:\n  {}", e.join("\n  ")))?;
        return Ok(pdflow_tools::chaos::load::run_cli(&opts, args.json.as_deref()).await?);
    }
    let layers = pdflow_tools::chaos::install_layers();
    let opts = args.to_options();
    let bin = std::env::current_exe().context("locating the pdflow binary the network cells start")?;
    use pdflow_tools::chaos::Progress;
    let mut report = pdflow_tools::chaos::run_selected(&opts, &layers, &bin, |p| match p {
        Progress::Section(title) => println!("\npdflow chaos: {title}\n{}", pdflow_tools::chaos::render_header()),
        Progress::Cell { index, of, row } => println!("{}  [{index}/{of}]", pdflow_tools::chaos::render_row(row)),
    })
    .await?;
    report.starve = args.starve;
    println!("\n{}", pdflow_tools::chaos::render_summary(&report));
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report).context("serialising the report")?;
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
        println!("report written to {}", path.display());
    }
    Ok(report.failed == 0)
}

/// Starts the exporters `args` ask for; `service` names the node (`None`: by step, the demo).
fn start_export(args: &TraceArgs, service: Option<&str>) -> anyhow::Result<TraceExport> {
    let config = ExportConfig::from_settings(&args.settings(), service).map_err(|e| {
        anyhow::anyhow!(
            "invalid trace export settings:\n  {}",
            e.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("\n  ")
        )
    })?;
    TraceExport::start(&config).context("starting trace export")
}

/// Sends what is left and writes the trace file, within a deadline.
fn finish_export(
    export: &TraceExport,
    keep: fn(&[export::FinishedSpan]) -> Vec<export::FinishedSpan>,
) -> anyhow::Result<()> {
    tokio::task::block_in_place(|| export.finish(Duration::from_secs(5), keep)).context("finishing trace export")?;
    if let Some(path) = export.trace_file() {
        eprintln!("trace written to {}", path.display());
    }
    Ok(())
}

fn ready_line(value: serde_json::Value) {
    println!("{value}");
}

async fn wait_for_shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

async fn run_demo(args: DemoArgs) -> anyhow::Result<bool> {
    let capture = SpanCapture::new();
    let trace_export = start_export(&args.trace, None)?;
    init_tracing(Some(capture.clone()), Some(&trace_export), Some(MetricsLayer::global()), None);
    metrics::global().set_block_bytes(args.kv_shape.kv.bytes_per_block() as u64);
    let device = match args.device {
        DemoDevice::Cpu => KvPlacement::Host,
        DemoDevice::Cuda => KvPlacement::cuda()?,
    };
    if args.gpu_path != GpuPathArg::Auto && device == KvPlacement::Host {
        anyhow::bail!("--gpu-path {:?} needs --device cuda (the path is between GPU KV caches)", args.gpu_path);
    }
    let gpu_path = args.gpu_path.into();
    let opts = DemoOptions {
        prompt_tokens: args.prompt_tokens,
        max_tokens: args.max_tokens,
        shape: if args.mla { KvShape::DEEPSEEK_V3_MLA } else { args.kv_shape.kv },
        hybrid: if args.mla { None } else { args.kv_shape.hybrid.clone() },
        num_blocks: args.num_blocks.unwrap_or_else(|| {
            let cfg = pdflow_sim_engine::EngineConfig {
                shape: args.kv_shape.kv,
                hybrid: args.kv_shape.hybrid.clone(),
                ..Default::default()
            };
            cfg.blocks_for(args.prompt_tokens + args.max_tokens).max(96)
        }),
        device,
        gpu_path,
        layerwise: args.layerwise == OnOff::On,
        prefill: Parallel { tp: args.prefill_tp, pp: args.prefill_pp },
        decode: Parallel { tp: args.decode_tp, pp: args.decode_pp },
        ..DemoOptions::default()
    };
    let ranks = format!(
        "; P tp {} × pp {}, D tp {} × pp {}{}",
        opts.prefill.tp,
        opts.prefill.pp,
        opts.decode.tp,
        opts.decode.pp,
        if args.mla { ", MLA" } else { "" }
    );
    let placement = match device {
        KvPlacement::Host => "KV in host memory".to_string(),
        KvPlacement::Cuda { p, d } => {
            format!("KV on GPUs: P on GPU {p}, D on GPU {d}, path {}", opts.gpu_path.as_str())
        }
    };
    println!(
        "pdflow demo: 1 prefill (P, launches bootstrap) + 1 decode (D) + proxy on 127.0.0.1; one request of {} prompt tokens, max_tokens {}; {placement}{ranks}",
        opts.prompt_tokens, opts.max_tokens
    );
    let report = demo::run(opts, capture).await.context("the demo could not run")?;
    println!("\n{}", report.timeline_table);
    println!(
        "KV transferred : {} bytes in {} blocks, {} descriptors, {:.3} ms (step 29)",
        report.kv_bytes, report.blocks, report.descriptors, report.transfer_ms
    );
    if report.rank_checks.is_empty() {
        println!("KV checksum    : P sent {:?}, D holds {:?}", report.kv_checksum_p, report.kv_checksum_d);
    }
    for w in &report.rank_writes {
        println!(
            "rank write     : P tp{} pp{} → D tp{} pp{}: {} bytes (step 29)",
            w.p_tp_rank, w.p_pp_rank, w.d_tp_rank, w.d_pp_rank, w.bytes
        );
    }
    for c in &report.rank_checks {
        println!(
            "D rank KV      : tp{} pp{}: {} (checksum {:?}, model's {})",
            c.tp_rank,
            c.pp_rank,
            if c.ok { "as the model computes it" } else { "DIFFERS" },
            c.kv_checksum,
            c.expected
        );
    }
    println!(
        "KV path        : {} (step 29), P's KV in {}, D's in {}",
        report.backend.as_deref().unwrap_or("?"),
        report.kv_memory_p,
        report.kv_memory_d
    );
    println!(
        "tokens         : {} prompt, {} completion; TTFT {:.3} ms",
        report.prompt_tokens, report.completion_tokens, report.ttft_ms
    );
    println!("output matches single-engine reference: {}", report.output_matches_reference);
    for p in &report.problems {
        println!("PROBLEM: {p}");
    }
    println!("verified: {}", report.verified);
    finish_export(&trace_export, export::keep_request_and_startup_traces)?;
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report).context("serialising the report")?;
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
        println!("report written to {}", path.display());
    }
    Ok(report.verified)
}

async fn run(cli: Cli) -> anyhow::Result<bool> {
    match cli.command {
        Command::Demo(args) => run_demo(args).await,
        Command::Trace(TraceCmd::Render(args)) => {
            let summary = pdflow_tools::render::render_file(&args.trace, &args.out, args.trace_id.as_deref())?;
            println!("{summary}");
            println!("timeline written to {}", args.out.display());
            Ok(true)
        }
        Command::Bench(cmd) => run_bench(cmd).await,
        Command::Chaos(args) => run_chaos(args).await,
        Command::Bootstrap(args) => run_bootstrap(args).await,
        Command::Proxy(cmd) => run_proxy(cmd).await,
        Command::Admin(cmd) => run_admin(cmd).await,
        Command::Serve(cmd) => run_serve(&cmd).await,
        Command::RankWorker(args) => run_rank_worker(args).await,
    }
}

/// `pdflow bench transfer|e2e|proxy`.
async fn run_bench(cmd: BenchCmd) -> anyhow::Result<bool> {
    // The e2e bench reads the step spans back (a capture keeps every one); the others
    // run what a `pdflow proxy` / `serve` process runs: the `/metrics` layer.
    let capture = SpanCapture::new();
    match &cmd {
        BenchCmd::E2e(_) => init_tracing(Some(capture.clone()), None, None, None),
        BenchCmd::Transfer(_) | BenchCmd::Proxy(_) | BenchCmd::Router(_) => {
            init_tracing(None, None, Some(MetricsLayer::global()), None)
        }
    }
    match cmd {
        BenchCmd::Transfer(o) => pdflow_tools::bench::transfer::run(o).await?,
        BenchCmd::E2e(o) => pdflow_tools::bench::e2e::run(o, capture).await?,
        BenchCmd::Proxy(o) => pdflow_tools::bench::proxy::run(o).await?,
        BenchCmd::Router(o) => pdflow_tools::bench::router::run(&o).await?,
    }
    Ok(true)
}

/// A node's start: the fault plan checked and armed (for a node whose data channel uses `tcp`),
/// its trace export started (`service` names the node) and the tracing installed (with the
/// `/metrics` layer when given).
fn start_node_telemetry(
    trace: &TraceArgs,
    service: &str,
    metrics: Option<MetricsLayer>,
    tcp: TcpConfig,
) -> anyhow::Result<(TraceExport, NodeFaults)> {
    let faults = NodeFaults(load_fault_plan(tcp)?);
    let trace_export = start_export(trace, Some(service))?;
    init_tracing(None, Some(&trace_export), metrics, faults.layer());
    Ok((trace_export, faults))
}

/// vLLM's environment variables, every error at once.
fn vllm_env() -> anyhow::Result<VllmEnv> {
    VllmEnv::from_env().map_err(|e| anyhow::anyhow!(e.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("\n")))
}

/// Serves until Ctrl-C / SIGTERM, then stops the node (`stop`) and finishes the trace export.
async fn serve_until_signal<F: std::future::Future<Output = ()>>(
    trace_export: &TraceExport,
    stop: impl FnOnce() -> F,
) -> anyhow::Result<bool> {
    serve_until_signal_or(trace_export, CancellationToken::new(), stop).await
}

/// As [`serve_until_signal`], and also stops when `lost` is cancelled (a rank's process died);
/// then the process exits with a failure.
async fn serve_until_signal_or<F: std::future::Future<Output = ()>>(
    trace_export: &TraceExport,
    lost: CancellationToken,
    stop: impl FnOnce() -> F,
) -> anyhow::Result<bool> {
    let signalled = tokio::select! {
        () = wait_for_shutdown_signal() => true,
        () = lost.cancelled() => false,
    };
    stop().await;
    finish_export(trace_export, export::keep_all)?;
    if !signalled {
        anyhow::bail!("a rank's process exited: the engine stopped (its log says which and how)");
    }
    Ok(true)
}

/// `pdflow rank-worker`: one rank's worker of a `pdflow serve --rank-processes` engine, configured
/// by the engine's own arguments (from its hello).
async fn run_rank_worker(args: RankWorkerArgs) -> anyhow::Result<bool> {
    let child = RankChild::connect(&args.ipc).await?;
    let rank = child.hello.rank;
    let argv = std::iter::once("pdflow".to_string()).chain(child.hello.serve_argv.iter().cloned());
    let cmd = match Cli::try_parse_from(argv).map(|cli| cli.command) {
        Ok(Command::Serve(cmd)) => cmd,
        Ok(_) => {
            child.fail("the engine's arguments are not `serve …`".into()).await;
            anyhow::bail!("rank {rank}: the engine's arguments are not `serve …`");
        }
        Err(e) => {
            child.fail(format!("the engine's arguments do not parse: {e}")).await;
            anyhow::bail!("rank {rank}: the engine's arguments do not parse: {e}");
        }
    };
    if let Err(e) = cmd.limits.install() {
        child.fail(e.to_string()).await;
        return Err(e);
    }
    let env = vllm_env()?;
    let mut cfg = match cmd.to_config(&env) {
        Ok(cfg) => cfg,
        Err(e) => {
            child.fail(e.join("; ")).await;
            anyhow::bail!("rank {rank}: invalid serve arguments: {}", e.join("; "));
        }
    };
    let mut trace = cmd.trace.clone();
    // Each rank exports its own spans (steps 21–31 on P, 19–21 and 34 on D); a trace file of its own.
    trace.trace_file = trace.trace_file.map(|p| p.with_extension(format!("rank{rank}.json")));
    let service =
        if cmd.role == crate::cli::RoleArg::Producer { export::SERVICE_PREFILL } else { export::SERVICE_DECODE };
    // The engine's fault plan applies to its ranks' actors too; `kill_node` kills the rank.
    let (trace_export, faults) = start_node_telemetry(&trace, service, None, cfg.tcp.clone())?;
    cfg.faults = faults.seam();
    faults.register_process_kill(if cfg.role.produces() { NodeKind::P } else { NodeKind::D });
    let served = child.serve(cfg).await;
    finish_export(&trace_export, export::keep_all)?;
    served.with_context(|| format!("rank {rank}'s worker"))?;
    Ok(true)
}

/// `pdflow bootstrap`: vLLM's bootstrap server alone.
async fn run_bootstrap(args: BootstrapCmd) -> anyhow::Result<bool> {
    let (trace_export, faults) =
        start_node_telemetry(&args.trace, export::SERVICE_BOOTSTRAP, None, TcpConfig::default())?;
    args.limits.install()?;
    let env = vllm_env()?;
    let addr = format!("{}:{}", args.host, args.port.unwrap_or(env.bootstrap_port));
    let bind: std::net::SocketAddr =
        addr.parse().with_context(|| format!("--host/--port {addr} is not an IP address and port"))?;
    let mut errors = Vec::new();
    let (secret, insecure) = args.secret.load_for(Some(bind.ip()), &mut errors);
    anyhow::ensure!(errors.is_empty(), "invalid bootstrap arguments:\n  {}", errors.join("\n  "));
    // Without a secret: protected mode (loopback callers only), or the operator's opt-out.
    pdflow_auth::PeerFilter::announce(secret.as_ref(), insecure);
    let node = BootstrapNode::start_with(bind, secret, insecure, &faults.seam()).await?;
    faults.register_process_kill(NodeKind::Bootstrap);
    ready_line(serde_json::json!({"event": "ready", "service": "bootstrap", "addr": node.addr.to_string()}));
    serve_until_signal(&trace_export, || node.shutdown()).await
}

/// `pdflow admin`: one call to a running proxy's admin API; prints its JSON answer and succeeds
/// on a 2xx.
async fn run_admin(cmd: AdminCmd) -> anyhow::Result<bool> {
    use pdflow_actors::proxy::admin_client::AdminClient;
    let secret = match &cmd.cluster_secret_file {
        Some(path) => pdflow_auth::ClusterSecret::from_file(path).map(Some),
        None => pdflow_auth::ClusterSecret::from_env(),
    }
    .map_err(|e| anyhow::anyhow!("--cluster-secret-file / PDFLOW_CLUSTER_SECRET: {e}"))?;
    let client = AdminClient::new(&cmd.proxy, secret);
    let answer = match &cmd.action {
        AdminAction::List => client.list().await?,
        AdminAction::Add { pool, url, bootstrap_port, kv_events } => {
            let pool = match pool {
                PoolArg::Prefill => "prefill",
                PoolArg::Decode => "decode",
            };
            let mut endpoints = Vec::new();
            for value in kv_events {
                let source = format!("{url}={value}")
                    .parse::<pdflow_actors::proxy::kv_events::KvEventSource>()
                    .map_err(|e| anyhow::anyhow!("--kv-events {value}: {e}"))?;
                endpoints.push(source.endpoint());
            }
            client.add(pool, url, *bootstrap_port, &endpoints).await?
        }
        AdminAction::Drain { url } => client.drain(url).await?,
        AdminAction::Undrain { url } => client.undrain(url).await?,
        AdminAction::Remove { url, force } => client.remove(url, *force).await?,
    };
    println!("{}", serde_json::to_string_pretty(&answer.body)?);
    if !answer.status.is_success() {
        eprintln!("the proxy answered {}", answer.status);
    }
    Ok(answer.status.is_success())
}

/// `pdflow proxy`: the P/D proxy.
async fn run_proxy(cmd: ProxyCmd) -> anyhow::Result<bool> {
    let (trace_export, faults) =
        start_node_telemetry(&cmd.trace, export::SERVICE_PROXY, Some(MetricsLayer::global()), TcpConfig::default())?;
    cmd.limits.install()?;
    let args = cmd.to_args().map_err(|e| anyhow::anyhow!("invalid proxy arguments:\n  {}", e.join("\n  ")))?;
    let insecure = cmd.insecure();
    pdflow_auth::PeerFilter::announce(args.secret.as_ref(), insecure);
    let node = ProxyNode::start_with_insecure(args, insecure, &faults.seam()).await?;
    faults.register_process_kill(NodeKind::Proxy);
    ready_line(serde_json::json!({"event": "ready", "service": "proxy", "addr": node.addr.to_string()}));
    serve_until_signal(&trace_export, || node.shutdown()).await
}

/// `pdflow serve`: a simulated engine as P (producer) or D (consumer).
async fn run_serve(cmd: &ServeCmd) -> anyhow::Result<bool> {
    let service =
        if cmd.role == crate::cli::RoleArg::Producer { export::SERVICE_PREFILL } else { export::SERVICE_DECODE };
    let env = vllm_env()?;
    let mut cfg = cmd.to_config(&env).map_err(|e| anyhow::anyhow!("invalid serve arguments:\n  {}", e.join("\n  ")))?;
    let (trace_export, faults) =
        start_node_telemetry(&cmd.trace, service, Some(MetricsLayer::global()), cfg.tcp.clone())?;
    cmd.limits.install()?;
    metrics::global().set_block_bytes(cmd.kv_shape.kv.bytes_per_block() as u64);
    cfg.faults = faults.seam();
    let kind = if cfg.role == pdflow_actors::scheduler_connector::KvRole::Consumer { NodeKind::D } else { NodeKind::P };
    if cmd.rank_processes {
        let program = std::env::current_exe().context("finding this program, to run the ranks' processes")?;
        cfg.rank_processes = Some(RankLaunch { program, serve_argv: std::env::args().skip(1).collect() });
    }
    let topic = cfg.engine.kv_events.as_ref().map(|k| k.topic.clone()).unwrap_or_default();
    let secret = cfg.tcp.secret.clone();
    if cmd.data_parallel_size > 1 {
        return serve_data_parallel(cmd, cfg, &faults, kind, &trace_export).await;
    }
    let node = EngineNode::start(cfg).await?;
    faults.register_process_kill(kind);
    if node.first_worker().is_some_and(|w| w.bootstrap.is_some()) {
        faults.register_process_kill(NodeKind::Bootstrap);
    }
    // Where its KV events are published (bound already: the node waited for them), if they are.
    let published = node.engine.kv_events_endpoints().await.ok().flatten();
    let kv_events =
        published.as_ref().map(|e| serde_json::json!({"endpoint": e.endpoint, "replay_endpoint": e.replay_endpoint}));
    let served = advertise::Served {
        producer: node.role.produces(),
        http_addr: node.http_addr,
        engine_id: &node.engine_id,
        bootstrap_url: node.bootstrap_url(),
        kv_events: published.into_iter().collect(),
        topic,
        host: &cmd.host,
    };
    // Stops advertising when dropped, before the engine stops.
    let advertiser = advertise::start(served, &cmd.advertise_to, secret)?;
    ready_line(serde_json::json!({
        "event": "ready",
        "service": "engine",
        "role": format!("{:?}", node.role).to_lowercase(),
        "addr": node.http_addr.to_string(),
        "engine_id": node.engine_id,
        "bootstrap_addr": node.launched_bootstrap_addr().map(|a| a.to_string()),
        "data_addr": node.data_addr().map(|a| a.to_string()),
        "kv_events": kv_events,
    }));
    let lost = node.rank_lost();
    serve_until_signal_or(&trace_export, lost, || async move {
        drop(advertiser);
        let _ = tokio::time::timeout(Duration::from_secs(10), node.shutdown()).await;
    })
    .await
}

/// `pdflow serve --data-parallel-size N`: N engines behind one API.
async fn serve_data_parallel(
    cmd: &ServeCmd,
    cfg: pdflow_sim_node::EngineNodeConfig,
    faults: &NodeFaults,
    kind: NodeKind,
    trace_export: &TraceExport,
) -> anyhow::Result<bool> {
    let role = cfg.role;
    let topic = cfg.engine.kv_events.as_ref().map(|k| k.topic.clone()).unwrap_or_default();
    let secret = cfg.tcp.secret.clone();
    let group = DataParallelGroup::start(cfg, cmd.data_parallel_size).await?;
    faults.register_process_kill(kind);
    let first = &group.engines[0];
    if first.first_worker().is_some_and(|w| w.bootstrap.is_some()) {
        faults.register_process_kill(NodeKind::Bootstrap);
    }
    ready_line(serde_json::json!({
        "event": "ready",
        "service": "engine",
        "role": format!("{role:?}").to_lowercase(),
        "addr": group.http_addr.to_string(),
        "engine_id": first.engine_id,
        "engine_ids": group.engines.iter().map(|e| e.engine_id.clone()).collect::<Vec<_>>(),
        "bootstrap_addr": first.launched_bootstrap_addr().map(|a| a.to_string()),
        "data_addr": first.data_addr().map(|a| a.to_string()),
    }));
    let mut published = Vec::new();
    for engine in &group.engines {
        published.extend(engine.engine.kv_events_endpoints().await.ok().flatten());
    }
    let served = advertise::Served {
        producer: role.produces(),
        http_addr: group.http_addr,
        engine_id: &first.engine_id,
        bootstrap_url: first.bootstrap_url(),
        kv_events: published,
        topic,
        host: &cmd.host,
    };
    let advertiser = advertise::start(served, &cmd.advertise_to, secret)?;
    let lost = CancellationToken::new();
    for engine in &group.engines {
        let (engine_lost, lost) = (engine.rank_lost(), lost.clone());
        tokio::spawn(async move {
            engine_lost.cancelled().await;
            lost.cancel();
        });
    }
    serve_until_signal_or(trace_export, lost, || async move {
        drop(advertiser);
        let _ = tokio::time::timeout(Duration::from_secs(10), group.shutdown()).await;
    })
    .await
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pdflow: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("pdflow: {e:#}");
            ExitCode::FAILURE
        }
    }
}
