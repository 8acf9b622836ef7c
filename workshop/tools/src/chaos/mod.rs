//! `pdflow chaos`: runs the fault matrix on the simulated engines in this process and
//! prints one row per cell — outcome (`completed` / `recomputed` / `failed_clean`), whether the
//! tokens equal the single-engine reference, time to the terminal state, blocks leaked on P and D.
//!
//! A cell passes when the request reaches a terminal state before its deadline, any tokens
//! returned are correct, nothing leaked, and the next request is served correctly. Cells run one
//! at a time, each on a fresh cluster ([`cluster`]) with short deadlines.
//!
//! # Layout
//! - [`matrix`] — which cells exist (actor × step × fault, node kills, message faults).
//! - [`cluster`] — the cluster of one cell; node kills and restarts.
//! - [`cell`] — one cell's run and checks.
//! - [`load`] — `--load`: many requests at once through 2P2D, a few of them faulted.
//! - [`soak`] — `pdflow chaos soak`: mixed load with random faults for a long time; RSS and fds
//!   sampled, every request accounted for.
//! - [`starve`] — `--starve N`: busy threads competing with the cluster for the cores.
//! - [`net`] — network cuts between P, D and the proxy as processes in their own network
//!   namespaces (root only): part of the full run, or alone with `--netns`.

pub mod cell;
pub mod cluster;
pub mod load;
pub mod matrix;
pub mod net;
pub mod soak;
pub mod starve;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdflow_auth::PeerFilter;
use pdflow_fault::FaultDomain;
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_observability::capture::SpanCapture;
use pdflow_sim_engine::hybrid::HybridLayout;
use pdflow_sim_engine::{api, Engine, EngineConfig, LoadFailurePolicy};
use pdflow_transfer::tcp::TcpConfig;
use serde::Serialize;

pub use cell::{run_cell, CellEnv, CellResult, Outcome};
pub use cluster::{ChaosCluster, ChaosSpec};
pub use matrix::{cells, CellSpec};

use pdflow_node::config::Deadlines;
use pdflow_node::NodeError;
use pdflow_sim_node::engine_node::{serve_http, stop_http};
use pdflow_sim_node::SimNodeError;

/// Why a chaos run (the matrix, the network cells, the load) could not run at all — as opposed
/// to running and failing its cells.
#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    /// A node (bootstrap, proxy) did not start.
    #[error(transparent)]
    Node(#[from] NodeError),
    /// An engine node did not start.
    #[error(transparent)]
    SimNode(#[from] SimNodeError),
    #[error("HTTP client: {0}")]
    HttpClient(#[source] reqwest::Error),
    /// The cluster did not answer through its proxy after start.
    #[error("{cluster}: {source}")]
    NotReady { cluster: &'static str, source: crate::demo::DemoError },
    /// Network cells asked for alone where network namespaces cannot be used.
    #[error("the network cells cannot run here: {why}")]
    NetworkUnavailable { why: String },
    /// Chaos kills P, D and the bootstrap; the proxy carries the client's own connection.
    #[error("chaos does not kill the {node} node: the client's own connection is the proxy's")]
    NotKillable { node: &'static str },
    /// The reference engine's answer to a prompt is unusable.
    #[error("reference engine: {0}")]
    Reference(String),
    /// `--load` options that cannot run (each problem named).
    #[error("{}", .0.join("; "))]
    LoadOptions(Vec<String>),
    /// A load cluster without a P or a D.
    #[error("a load cluster needs at least one P and one D (asked for {prefills}P{decodes}D)")]
    LoadShape { prefills: usize, decodes: usize },
    /// A P of the load cluster that launched no bootstrap.
    #[error("P {engine_id} launched no bootstrap")]
    NoBootstrap { engine_id: String },
    #[error("serialising the load report: {0}")]
    Report(#[source] serde_json::Error),
    /// `--starve`: the spinning threads did not start.
    #[error(transparent)]
    Starve(#[from] starve::StarveError),
    /// The soak's watchdog thread did not start.
    #[error("starting the soak's watchdog thread: {0}")]
    Watchdog(#[source] std::io::Error),
    #[error("writing {}: {source}", .path.display())]
    Write { path: std::path::PathBuf, source: std::io::Error },
}

impl ChaosError {
    /// Whether a restarted node's port is still held by its previous incarnation.
    pub fn is_bind(&self) -> bool {
        match self {
            ChaosError::Node(e) => e.is_bind(),
            ChaosError::SimNode(e) => e.is_bind(),
            _ => false,
        }
    }
}

/// A client for the cluster's HTTP APIs (never through a proxy of the environment).
pub(crate) fn http_client() -> Result<reqwest::Client, ChaosError> {
    reqwest::Client::builder().no_proxy().build().map_err(ChaosError::HttpClient)
}

/// A small model shape: chaos cells are about failure paths, not bandwidth (8 KiB per block).
pub const CHAOS_SHAPE: KvShape =
    KvShape { num_layers: 4, num_kv_heads: 2, head_dim: 16, dtype_bytes: 2, block_size: 16 };

/// The short deadlines of a chaos run (seconds, not vLLM's minutes).
pub fn chaos_deadlines() -> Deadlines {
    Deadlines {
        ready_timeout: Duration::from_millis(1500),
        send_expiry: Duration::from_millis(1500),
        pull_timeout: Duration::from_secs(2),
        bootstrap_timeout: Duration::from_secs(1),
    }
}

/// What `pdflow chaos` runs.
#[derive(Debug, Clone)]
pub struct ChaosOptions {
    pub quick: bool,
    pub policy: LoadFailurePolicy,
    /// Only cells whose name (`actor/step/fault`) contains this.
    pub filter: Option<String>,
    /// Whether the network cells ([`net`]) run.
    pub network: NetworkCells,
    /// A hybrid preset the in-process cells run on instead of the small dense model.
    pub hybrid: Option<&'static str>,
}

/// Whether a run includes the network cells (processes in network namespaces, root only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetworkCells {
    /// After the in-process matrix, where namespaces can be used; the report says why not otherwise.
    WhereAvailable,
    /// Only the network cells; a run where namespaces cannot be used is an error.
    Only,
    /// Not at all (`--quick`, `--no-netns`).
    Off,
}

/// The whole run (`--json`).
#[derive(Debug, Clone, Serialize)]
pub struct ChaosReport {
    pub cells: Vec<CellResult>,
    pub passed: usize,
    pub failed: usize,
    /// Cells whose fault found nothing alive to hit (they pass or fail like the others).
    pub missed: usize,
    pub wall_s: f64,
    /// Worst time to each terminal state, in ms.
    pub worst_terminal_ms: BTreeMap<String, f64>,
    /// The cell that used the largest share of its deadline (`None`: no cell ran).
    pub worst_ratio: Option<WorstCell>,
    /// Threads spinning on the CPU during the run (`--starve`).
    pub starve: usize,
    /// Why the network cells did not run, when a run that includes them could not (not root, no
    /// `ip netns`); `None` when they ran or were not asked for.
    pub network_skipped: Option<String>,
}

/// The cell whose time to terminal came closest to its deadline.
#[derive(Debug, Clone, Serialize)]
pub struct WorstCell {
    /// `actor/step/fault`.
    pub cell: String,
    pub ratio: f64,
    pub terminal_ms: f64,
    pub deadline_ms: f64,
}

/// The spec every cell's cluster uses.
pub fn chaos_spec(policy: LoadFailurePolicy) -> ChaosSpec {
    ChaosSpec {
        shape: CHAOS_SHAPE,
        num_blocks: 256,
        deadlines: chaos_deadlines(),
        policy,
        upstream_timeout: Duration::from_secs(8),
        layerwise: false,
        p_max_batched_tokens: 8192,
        prefill_parallel: Default::default(),
        decode_parallel: Default::default(),
        hybrid: None,
        rdma: false,
    }
}

/// The environment of a run: a reference engine (no connector) serving over HTTP.
pub struct Reference {
    engine: pdflow_sim_engine::EngineHandle,
    pub url: String,
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Reference {
    /// A reference engine of `shape`, or (`hybrid`) of a hybrid layout over it.
    pub async fn start(shape: KvShape, hybrid: Option<HybridLayout>) -> Result<Self, ChaosError> {
        let cfg =
            EngineConfig { engine_id: "reference".into(), shape, hybrid, num_blocks: 256, ..EngineConfig::default() };
        let engine = Engine::start(cfg.clone(), KvCache::new(cfg.shape, cfg.num_blocks), None);
        let (addr, stop, task) =
            serve_http("127.0.0.1", 0, api::router(engine.clone()), PeerFilter::LoopbackOnly).await?;
        Ok(Self { engine, url: format!("http://{addr}"), stop, task })
    }

    pub async fn shutdown(self) {
        stop_http(self.stop, self.task).await;
        self.engine.shutdown().await;
    }
}

/// The deadline a cell's terminal state must meet, from the rules of failure-semantics.md: the
/// longest wait they allow a faulted request — P's ready deadline then D's pull deadline, or the
/// engine backstop (max(send expiry, pull) + bootstrap + 2 s) for a request an actor's restart
/// forgot — times [`TERMINAL_MARGIN`]. With the chaos deadlines: max(3.5 s, 5 s) × 1.5 = 7.5 s.
pub fn terminal_deadline(spec: &ChaosSpec) -> Duration {
    let d = &spec.deadlines;
    let longest_wait = (d.ready_timeout + d.pull_timeout).max(pdflow_sim_node::engine_node::kv_state_timeout(d));
    longest_wait.mul_f64(TERMINAL_MARGIN)
}

/// How far past the longest legitimate wait a terminal state may come: half of it again, for
/// the recompute that follows and for a machine whose cores are busy (`--starve`). A cell ending
/// at the longest wait uses two thirds of its deadline.
pub const TERMINAL_MARGIN: f64 = 1.5;

/// Runs the matrix; `progress` sees each result as it comes.
pub async fn run(
    opts: &ChaosOptions,
    layers: &ChaosLayers,
    mut progress: impl FnMut(usize, usize, &CellResult),
) -> Result<ChaosReport, ChaosError> {
    let started = Instant::now();
    let spec = ChaosSpec { hybrid: opts.hybrid, ..chaos_spec(opts.policy) };
    let cells: Vec<CellSpec> = cells(opts.quick, &spec.deadlines)
        .into_iter()
        .filter(|c| opts.filter.as_deref().is_none_or(|f| c.name().contains(f)))
        .collect();
    let (shape, hybrid) = spec.model();
    let reference = Reference::start(shape, hybrid).await?;
    let client = http_client()?;
    let env = CellEnv {
        spec,
        capture: &layers.capture,
        faults: &layers.faults,
        client: &client,
        reference_url: &reference.url,
        terminal_deadline: terminal_deadline(&spec),
        prompt_tokens: 40,
        max_tokens: 6,
    };
    let mut results = Vec::with_capacity(cells.len());
    for (i, cell) in cells.iter().enumerate() {
        let r = run_cell(cell, 1 + i as u64, &env).await;
        progress(i + 1, cells.len(), &r);
        results.push(r);
    }
    reference.shutdown().await;
    Ok(report(results, started.elapsed()))
}

/// What a run reports as it goes.
pub enum Progress<'a> {
    /// A part of the run starts (the in-process matrix, the network cells): its title.
    Section(String),
    /// A cell's row, the `index`-th of `of` in its part.
    Cell { index: usize, of: usize, row: &'a CellResult },
}

/// Runs what `opts` selects — the in-process matrix, the network cells (their nodes started from
/// `bin`, the `pdflow` binary), or both — and tallies one report. Where the network cells were
/// asked for alongside the matrix but cannot run here, the report says why
/// (`network_skipped`); asked for alone, that is an error.
pub async fn run_selected(
    opts: &ChaosOptions,
    layers: &ChaosLayers,
    bin: &std::path::Path,
    mut progress: impl FnMut(Progress<'_>),
) -> Result<ChaosReport, ChaosError> {
    let started = Instant::now();
    let mut cells = Vec::new();
    if opts.network != NetworkCells::Only {
        let kind = if opts.quick { "quick" } else { "full" };
        progress(Progress::Section(format!(
            "{kind} matrix, D's kv_load_failure_policy {:?}; one fresh P + D + bootstrap + proxy per cell",
            opts.policy
        )));
        cells = run(opts, layers, |index, of, row| progress(Progress::Cell { index, of, row })).await?.cells;
    }
    let mut network_skipped = None;
    if opts.network != NetworkCells::Off {
        match net::available() {
            Ok(()) => {
                let selected = net::cells(opts.filter.as_deref());
                progress(Progress::Section(format!("{} network cells, P, D and the proxy as processes in their own network namespaces (policy per cell)", selected.len())));
                cells.extend(
                    net::run(bin, &selected, |index, of, row| progress(Progress::Cell { index, of, row })).await?.cells,
                );
            }
            Err(why) if opts.network == NetworkCells::Only => return Err(ChaosError::NetworkUnavailable { why }),
            Err(why) => network_skipped = Some(why),
        }
    }
    let mut report = report(cells, started.elapsed());
    report.network_skipped = network_skipped;
    Ok(report)
}

/// Tallies results into a report.
pub fn report(cells: Vec<CellResult>, wall: Duration) -> ChaosReport {
    let passed = cells.iter().filter(|c| c.passed).count();
    let mut worst: BTreeMap<String, f64> = BTreeMap::new();
    for c in &cells {
        let key = serde_json::to_value(c.outcome).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
        let w = worst.entry(key).or_insert(0.0);
        *w = w.max(c.terminal_ms);
    }
    let worst_ratio =
        cells.iter().filter(|c| c.deadline_ms > 0.0).max_by(|a, b| a.ratio.total_cmp(&b.ratio)).map(|c| WorstCell {
            cell: format!("{}/{:02}/{}", c.actor, c.step, c.fault),
            ratio: c.ratio,
            terminal_ms: c.terminal_ms,
            deadline_ms: c.deadline_ms,
        });
    ChaosReport {
        worst_ratio,
        starve: 0,
        passed,
        failed: cells.len() - passed,
        missed: cells.iter().filter(|c| !c.hit).count(),
        wall_s: (wall.as_secs_f64() * 10.0).round() / 10.0,
        worst_terminal_ms: worst,
        cells,
        network_skipped: None,
    }
}

/// One table row per cell.
pub fn render_row(c: &CellResult) -> String {
    let outcome = serde_json::to_value(c.outcome).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
    format!(
        "{:<40} {:<15} {:<7} {:>9.1} {:>5.2} {:>6} {:>6} {:<5} {:<4} {}",
        format!("{}/{:02}/{}", c.actor, c.step, c.fault),
        outcome,
        c.correct,
        c.terminal_ms,
        c.ratio,
        c.leaked_blocks_p,
        c.leaked_blocks_d,
        c.next_ok,
        if c.passed { "PASS" } else { "FAIL" },
        if c.hit { c.detail.clone() } else { format!("(nothing alive to hit) {}", c.detail) },
    )
}

/// The table's header.
pub fn render_header() -> String {
    format!(
        "{:<40} {:<15} {:<7} {:>9} {:>5} {:>6} {:>6} {:<5} {:<4} {}",
        "cell (actor/step/fault)", "outcome", "correct", "term_ms", "ratio", "leak_P", "leak_D", "next", "", "detail"
    )
}

/// The summary lines under the table.
pub fn render_summary(r: &ChaosReport) -> String {
    let mut s = format!(
        "cells: {} passed, {} failed ({} missed: nothing alive to hit) in {:.1} s\n",
        r.passed, r.failed, r.missed, r.wall_s
    );
    if let Some(why) = &r.network_skipped {
        let _ = writeln!(s, "network cells skipped: {why}");
    }
    for (state, ms) in &r.worst_terminal_ms {
        let _ = writeln!(s, "worst time to {state}: {ms:.1} ms");
    }
    if let Some(w) = &r.worst_ratio {
        let _ = writeln!(
            s,
            "worst time / deadline: {:.3} ({:.1} of {:.0} ms), {}",
            w.ratio, w.terminal_ms, w.deadline_ms, w.cell
        );
    }
    if r.starve > 0 {
        let _ = writeln!(s, "{} threads spun on the CPU throughout (--starve)", r.starve);
    }
    let recovery = r.cells.iter().map(|c| c.recovery_ms).fold(0.0, f64::max);
    let _ = writeln!(s, "worst time until the next request was served through P and D again: {recovery:.1} ms");
    s
}

/// What the in-process chaos runs watch and inject through: the span capture their verdicts
/// read, and the fault domain their clusters' nodes are given (its layer fires the kills and
/// delays at step edges).
#[derive(Clone)]
pub struct ChaosLayers {
    pub capture: SpanCapture,
    pub faults: Arc<FaultDomain>,
}

/// Installs, once per process, the global subscriber with a span capture and one fault domain's
/// layer (for tests and `pdflow chaos`), and returns them. A process has one global subscriber,
/// so its in-process chaos runs share these: they run one at a time, each arming its plan.
pub fn install_layers() -> ChaosLayers {
    use std::sync::OnceLock;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    static LAYERS: OnceLock<ChaosLayers> = OnceLock::new();
    LAYERS
        .get_or_init(|| {
            let layers = ChaosLayers { capture: SpanCapture::new(), faults: FaultDomain::new(TcpConfig::default()) };
            let filter = tracing_subscriber::EnvFilter::try_from_env("PDFLOW_CHAOS_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error"));
            let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_filter(filter);
            let _ = tracing_subscriber::registry()
                .with(layers.capture.clone())
                .with(layers.faults.layer())
                .with(fmt)
                .try_init();
            layers
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_terminal_deadline_is_the_engine_backstop_with_half_again() {
        let spec = chaos_spec(LoadFailurePolicy::Recompute);
        assert_eq!(pdflow_sim_node::engine_node::kv_state_timeout(&spec.deadlines), Duration::from_secs(5));
        assert_eq!(terminal_deadline(&spec), Duration::from_millis(7500));
    }
}
