//! `pdflow bench router`: routing policies compared on one cluster, in one run. A workload with
//! shared prefixes (multi-turn chat sessions and few-shot templates, [`workload`]) and one with
//! none go through each front — pdflow's proxy under each policy, vLLM's router (0.1.17, its
//! Mooncake P/D mode) under its policies — in front of x P and y D simulated engines with
//! prefix caching and a GPU's forward timing ([`cluster`]), a fresh cluster for each front.
//!
//! Per workload and front: TTFT p50/p99 at the client (streamed), requests/s, the prompt tokens P
//! and D computed (their prefix-cache counters), the least an ideal router would leave them
//! (the prompt tokens minus those shared with an earlier prompt), and the KV moved from P to D
//! (tokens, and bytes at Qwen3-8B's size).

pub mod cluster;
pub mod drive;
pub mod front;
pub mod workload;

use std::time::Duration;

use anyhow::Context;
use serde::Serialize;

use self::cluster::{Cluster, ClusterSpec, QWEN3_8B_BYTES_PER_TOKEN};
use self::drive::DriveSpec;
use self::front::{Front, FrontSpec};
use self::workload::{WorkloadKind, WorkloadSpec};
use super::report::quantile;

/// Options of `pdflow bench router`.
#[derive(Debug, Clone, clap::Args)]
pub struct Options {
    /// Write the rows as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Prefill engines.
    #[arg(long, default_value_t = 2)]
    pub prefill: usize,
    /// Decode engines.
    #[arg(long, default_value_t = 2)]
    pub decode: usize,
    /// The fronts, in order: `pdflow:POLICY[+d-alone[=SHARE]][+d-below=N]`, `vllm-router:POLICY` (default:
    /// pdflow's round_robin, least_loaded, cache_aware, cache_aware+d-alone, kv_aware,
    /// kv_aware+d-alone; vllm-router's round_robin, cache_aware and kv_aware).
    #[arg(long, value_delimiter = ',')]
    pub fronts: Vec<FrontSpec>,
    /// The workloads: `shared`, `unique` (both by default).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [WorkloadKind::Shared, WorkloadKind::Unique])]
    pub workload: Vec<WorkloadKind>,
    /// Chat sessions (2–6 turns each).
    #[arg(long, default_value_t = 96)]
    pub sessions: usize,
    /// Few-shot requests.
    #[arg(long, default_value_t = 320)]
    pub few_shot: usize,
    /// Few-shot templates (1024–3072 tokens each).
    #[arg(long, default_value_t = 8)]
    pub templates: usize,
    /// System prompts the sessions share (256–1024 tokens each).
    #[arg(long, default_value_t = 4)]
    pub system_prompts: usize,
    /// Clients sending at once (each a closed loop).
    #[arg(long, default_value_t = 96)]
    pub concurrency: usize,
    /// Tokens each answer is long.
    #[arg(long, default_value_t = 32)]
    pub output_tokens: usize,
    /// KV blocks of each engine (16 tokens each).
    #[arg(long, default_value_t = 8192)]
    pub num_blocks: usize,
    /// The workload's seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Runs of every front, interleaved (front 1, 2, …, then again), each on a fresh cluster; the
    /// table gives each figure's median over them (a shared machine's noise moves a single run's
    /// requests/s by several percent).
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Do not install vllm-router when it is missing (its fronts are then skipped).
    #[arg(long)]
    pub no_install: bool,
}

/// One workload through one front.
#[derive(Debug, Clone, Serialize)]
pub struct RouterRow {
    pub workload: String,
    pub front: String,
    pub requests: usize,
    pub failed: usize,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub requests_per_s: f64,
    pub prompt_tokens: u64,
    /// The prompt tokens an ideal router would leave to compute.
    pub ideal_computed_tokens: u64,
    pub p_computed_tokens: u64,
    pub d_computed_tokens: u64,
    pub kv_moved_tokens: u64,
    pub kv_moved_qwen3_8b_gb: f64,
    /// The first failure's reason.
    pub first_error: Option<String>,
    /// The runs this row is the median of, and their lowest and highest requests/s.
    pub runs: usize,
    pub requests_per_s_min: f64,
    pub requests_per_s_max: f64,
}

/// Runs the bench; prints the table; writes the JSON.
pub async fn run(opts: &Options) -> anyhow::Result<()> {
    anyhow::ensure!(opts.prefill > 0 && opts.decode > 0, "--prefill and --decode must each be at least 1");
    let fronts = if opts.fronts.is_empty() { FrontSpec::all() } else { opts.fronts.clone() };
    let router_exe = if fronts.iter().any(|f| matches!(f, FrontSpec::VllmRouter { .. })) {
        match front::find_router(!opts.no_install).await {
            Ok(exe) => Some(exe),
            Err(why) => {
                println!("vllm-router's fronts are skipped: {why}");
                None
            }
        }
    } else {
        None
    };
    let client = reqwest::Client::builder().no_proxy().pool_max_idle_per_host(opts.concurrency * 2).build()?;
    let cluster_spec = ClusterSpec {
        prefill: opts.prefill,
        decode: opts.decode,
        num_blocks: opts.num_blocks,
        timing: Default::default(),
    };
    println!(
        "{}P{}D simulated engines (Qwen3-8B's forward on one H200 each, prefix caching, {} blocks); {} clients; answers of {} tokens",
        opts.prefill, opts.decode, opts.num_blocks, opts.concurrency, opts.output_tokens
    );
    let mut rows = Vec::new();
    for &kind in &opts.workload {
        let spec = WorkloadSpec {
            kind,
            seed: opts.seed,
            sessions: opts.sessions,
            few_shot: opts.few_shot,
            templates: opts.templates,
            system_prompts: opts.system_prompts,
        };
        let sequences = workload::generate(&spec);
        let mut runs: Vec<Vec<RouterRow>> = vec![Vec::new(); fronts.len()];
        for round in 1..=opts.repeat.max(1) {
            for (front_spec, runs) in fronts.iter().zip(&mut runs) {
                if matches!(front_spec, FrontSpec::VllmRouter { .. }) && router_exe.is_none() {
                    continue;
                }
                println!("{}: {} (run {round}/{}) …", kind.name(), front_spec.name(), opts.repeat.max(1));
                match measure(&client, opts, &cluster_spec, front_spec, router_exe.as_deref(), kind, &sequences).await {
                    Ok(row) => runs.push(row),
                    Err(e) => println!("  {} on {}: {e:#}", front_spec.name(), kind.name()),
                }
            }
        }
        rows.extend(runs.iter().filter_map(|runs| median_row(runs)));
    }
    println!("\n{}", render(&rows));
    for line in verdicts(&rows) {
        println!("{line}");
    }
    if let Some(path) = &opts.json {
        let text = serde_json::to_string_pretty(&serde_json::json!({ "rows": rows }))?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        println!("rows written to {}", path.display());
    }
    Ok(())
}

async fn measure(
    client: &reqwest::Client,
    opts: &Options,
    cluster_spec: &ClusterSpec,
    front_spec: &FrontSpec,
    router_exe: Option<&std::path::Path>,
    kind: WorkloadKind,
    sequences: &[workload::Sequence],
) -> anyhow::Result<RouterRow> {
    let cluster = Cluster::start(cluster_spec).await?;
    let front = match Front::start(front_spec, &cluster, router_exe).await {
        Ok(front) => front,
        Err(e) => {
            cluster.shutdown().await;
            return Err(e);
        }
    };
    let result = async {
        crate::demo::wait_ready(client, &front.url(), Duration::from_secs(60)).await?;
        let drive = DriveSpec {
            url: format!("{}/v1/completions", front.url()),
            model: "Qwen/Qwen3-8B".into(),
            concurrency: opts.concurrency,
            output_tokens: opts.output_tokens,
            request_timeout: Duration::from_secs(120),
        };
        // One short request first: the path works (its few tokens share nothing with the workload).
        let probe = drive::run(client, &DriveSpec { concurrency: 1, ..drive.clone() }, &[probe_sequence()]).await;
        if let Some(e) = probe.outcomes.iter().find_map(|o| o.error.clone()) {
            anyhow::bail!("the first request failed: {e}");
        }
        let before = cluster.cache_stats();
        let run = drive::run(client, &drive, sequences).await;
        let busy = cluster.settle(Duration::from_secs(30)).await;
        if !busy.is_empty() {
            println!("  WARNING: engines still holding requests 30 s after the run: {busy:?}");
        }
        let after = cluster.cache_stats();
        Ok::<_, anyhow::Error>(row(kind, front_spec, &run, before, after))
    }
    .await;
    front.stop().await;
    cluster.shutdown().await;
    result
}

fn probe_sequence() -> workload::Sequence {
    workload::Sequence { first: vec![7; 8], later_turns: Vec::new() }
}

fn row(
    kind: WorkloadKind,
    front: &FrontSpec,
    run: &drive::RunResult,
    before: (pdflow_sim_engine::CacheStats, pdflow_sim_engine::CacheStats),
    after: (pdflow_sim_engine::CacheStats, pdflow_sim_engine::CacheStats),
) -> RouterRow {
    let ttfts: Vec<f64> = run.outcomes.iter().filter_map(|o| o.ttft_ms).collect();
    let failed = run.outcomes.iter().filter(|o| o.error.is_some()).count();
    let prompt_tokens: usize = run.prompts.iter().map(Vec::len).sum();
    let shared = workload::shared_tokens(&run.prompts, cluster::SHAPE.block_size);
    let p_computed = after.0.prompt_tokens_local_compute - before.0.prompt_tokens_local_compute;
    let d_computed = after.1.prompt_tokens_local_compute - before.1.prompt_tokens_local_compute;
    let moved = after.1.prompt_tokens_external_kv_transfer - before.1.prompt_tokens_external_kv_transfer;
    RouterRow {
        workload: kind.name().to_string(),
        front: front.name(),
        requests: run.outcomes.len(),
        failed,
        ttft_p50_ms: quantile(&ttfts, 0.5),
        ttft_p99_ms: quantile(&ttfts, 0.99),
        requests_per_s: (run.outcomes.len() - failed) as f64 / run.wall.as_secs_f64().max(1e-9),
        prompt_tokens: prompt_tokens as u64,
        ideal_computed_tokens: (prompt_tokens - shared) as u64,
        p_computed_tokens: p_computed,
        d_computed_tokens: d_computed,
        kv_moved_tokens: moved,
        kv_moved_qwen3_8b_gb: (moved * QWEN3_8B_BYTES_PER_TOKEN) as f64 / 1e9,
        first_error: run.outcomes.iter().find_map(|o| o.error.clone()),
        runs: 1,
        requests_per_s_min: (run.outcomes.len() - failed) as f64 / run.wall.as_secs_f64().max(1e-9),
        requests_per_s_max: (run.outcomes.len() - failed) as f64 / run.wall.as_secs_f64().max(1e-9),
    }
}

/// One front's runs as one row: each figure's median over them (failures summed, so a failed
/// request in any run shows), requests/s with its range.
fn median_row(runs: &[RouterRow]) -> Option<RouterRow> {
    let first = runs.first()?;
    let med = |f: &dyn Fn(&RouterRow) -> f64| -> f64 {
        let mut v: Vec<f64> = runs.iter().map(f).filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    };
    let med_opt =
        |f: &dyn Fn(&RouterRow) -> Option<f64>| Some(med(&|r| f(r).unwrap_or(f64::NAN))).filter(|v| v.is_finite());
    let med_u64 = |f: &dyn Fn(&RouterRow) -> u64| med(&|r| f(r) as f64).round() as u64;
    let rps = |r: &RouterRow| r.requests_per_s;
    Some(RouterRow {
        workload: first.workload.clone(),
        front: first.front.clone(),
        requests: first.requests,
        failed: runs.iter().map(|r| r.failed).sum(),
        ttft_p50_ms: med_opt(&|r| r.ttft_p50_ms),
        ttft_p99_ms: med_opt(&|r| r.ttft_p99_ms),
        requests_per_s: med(&rps),
        prompt_tokens: first.prompt_tokens,
        ideal_computed_tokens: first.ideal_computed_tokens,
        p_computed_tokens: med_u64(&|r| r.p_computed_tokens),
        d_computed_tokens: med_u64(&|r| r.d_computed_tokens),
        kv_moved_tokens: med_u64(&|r| r.kv_moved_tokens),
        kv_moved_qwen3_8b_gb: med(&|r| r.kv_moved_qwen3_8b_gb),
        first_error: runs.iter().find_map(|r| r.first_error.clone()),
        runs: runs.len(),
        requests_per_s_min: runs.iter().map(rps).fold(f64::INFINITY, f64::min),
        requests_per_s_max: runs.iter().map(rps).fold(f64::NEG_INFINITY, f64::max),
    })
}

fn render(rows: &[RouterRow]) -> String {
    let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0}"));
    let mut out = String::from(
        "| workload | front | requests (failed) | TTFT p50 ms | TTFT p99 ms | req/s | P computed tokens | D computed | ideal | KV moved (Qwen3-8B GB) |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let rps = match r.runs {
            0 | 1 => format!("{:.1}", r.requests_per_s),
            _ => format!("{:.1} ({:.1}–{:.1})", r.requests_per_s, r.requests_per_s_min, r.requests_per_s_max),
        };
        out.push_str(&format!(
            "| {} | {} | {} ({}) | {} | {} | {} | {} | {} | {} | {:.1} |\n",
            r.workload,
            r.front,
            r.requests,
            r.failed,
            ms(r.ttft_p50_ms),
            ms(r.ttft_p99_ms),
            rps,
            r.p_computed_tokens,
            r.d_computed_tokens,
            r.ideal_computed_tokens,
            r.kv_moved_qwen3_8b_gb,
        ));
    }
    out
}

/// The row with the lowest TTFT p50 (to the millisecond; of equals, the most requests/s).
fn best(rows: Vec<&RouterRow>) -> Option<&RouterRow> {
    let p50 = |r: &RouterRow| r.ttft_p50_ms.unwrap_or(f64::NAN).round();
    rows.into_iter()
        .filter(|r| r.ttft_p50_ms.is_some())
        .min_by(|a, b| p50(a).total_cmp(&p50(b)).then(b.requests_per_s.total_cmp(&a.requests_per_s)))
}

/// Per workload: pdflow's best front (lowest TTFT p50) against pdflow's round robin and against
/// vllm-router's best, and what P and D computed against the ideal.
fn verdicts(rows: &[RouterRow]) -> Vec<String> {
    let mut lines = Vec::new();
    let mut workloads: Vec<&str> = rows.iter().map(|r| r.workload.as_str()).collect();
    workloads.dedup();
    for w in workloads {
        let of = |prefix: &str| -> Vec<&RouterRow> {
            rows.iter().filter(|r| r.workload == w && r.front.starts_with(prefix) && r.failed == 0).collect()
        };
        let rr = rows.iter().find(|r| r.workload == w && r.front == "pdflow round_robin");
        let (Some(ours), theirs) = (best(of("pdflow ")), best(of("vllm-router "))) else { continue };
        let p50 = |r: &RouterRow| r.ttft_p50_ms.unwrap_or(f64::NAN);
        let p99 = |r: &RouterRow| r.ttft_p99_ms.unwrap_or(f64::NAN);
        let mut line =
            format!("{w}: best pdflow front `{}` (p50 {:.0} ms, p99 {:.0} ms)", ours.front, p50(ours), p99(ours));
        if let Some(rr) = rr {
            line.push_str(&format!(
                "; round robin p50 {:.2}× and p99 {:.2}× its",
                p50(rr) / p50(ours),
                p99(rr) / p99(ours)
            ));
        }
        if let Some(t) = theirs {
            let best_p99 = of("vllm-router ").into_iter().map(p99).fold(f64::INFINITY, f64::min);
            let best_rps = of("vllm-router ").into_iter().map(|r| r.requests_per_s).fold(0.0, f64::max);
            line.push_str(&format!(
                "; vllm-router's best `{}` p50 {:.2}× its, the best vllm-router p99 {:.2}× its; its req/s {:.2}× the best vllm-router req/s",
                t.front,
                p50(t) / p50(ours),
                best_p99 / p99(ours),
                ours.requests_per_s / best_rps
            ));
        }
        let computed = ours.p_computed_tokens + ours.d_computed_tokens;
        let fell = |tokens: u64| 100.0 * (1.0 - tokens as f64 / ours.prompt_tokens.max(1) as f64);
        line.push_str(&format!(
            "; computed {} prompt tokens of {} (ideal {}: {:+.1}%); shared fraction {:.1}%, P's computed tokens fell by {:.1}% of the prompt tokens (P and D: {:.1}%)",
            computed,
            ours.prompt_tokens,
            ours.ideal_computed_tokens,
            100.0 * (computed as f64 / ours.ideal_computed_tokens.max(1) as f64 - 1.0),
            fell(ours.ideal_computed_tokens),
            fell(ours.p_computed_tokens),
            fell(computed),
        ));
        lines.push(line);
    }
    lines
}
