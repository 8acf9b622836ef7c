//! `pdflow chaos soak --duration 1h`: mixed load with random faults for a long time, then the
//! accounts. The `--load` machinery ([`super::load`]) drives it: the same 2P2D cluster through
//! the proxy on real sockets, the same per-request fault menu (every actor kill where the actor
//! is alive, side-channel messages 21 and 30 dropped / corrupted / delayed), the same verdict on
//! each answer. Node kills are not in it: the load cluster keeps its nodes for the run (the
//! matrix's `node.*` cells kill and restart them one request at a time).
//!
//! The load is mixed: prompts of varied lengths, half of the requests streamed ([`stream`]). It
//! runs in rounds of `concurrency × 16` requests, each round with its own plan (a share
//! `fault_rate` of its requests faulted), from the end of the warm-up until the duration is up;
//! the warm-up sends the same mix with no fault. Meanwhile [`sampler`] reads RSS, open fds and
//! threads every few seconds.
//!
//! Pass: every request sent has one outcome — completed, recomputed or failed cleanly, none
//! wrong or unclean; clean failures of un-faulted requests within faults fired × concurrency per
//! round; every engine back at its block baseline with no request or transfer tracked; every P
//! and D serving after; RSS and open fds flat after the warm-up ([`report::Flatness`]).
//!
//! # Layout
//! - [`duration`] — `--duration` values (`90s`, `30m`, `1h`).
//! - [`sampler`] — the RSS / fd series.
//! - [`stream`] — streamed requests and their verdict.
//! - [`report`] — the report, the memory verdict and the table.
//! - [`watchdog`] — a soak that stops making progress reports it and ends.

pub mod duration;
pub mod report;
pub mod sampler;
pub(crate) mod stream;
pub mod watchdog;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use pdflow_fault::FaultAction;
use pdflow_sim_engine::LoadFailurePolicy;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

pub use duration::{parse_duration, DurationError};
pub use report::{render, Flatness, SoakReport};

use super::load::verdict::{classify, outcome_name, Answer, Problem};
use super::load::{self, faults, BadRequest, LoadCluster, LoadOptions, Prompts, SpanLog, SplitMix64};
use super::{http_client, ChaosError, ChaosLayers, Reference};

/// Requests per round, per unit of concurrency.
const ROUND_PER_CONCURRENCY: usize = 16;

/// What a soak does.
#[derive(Debug, Clone)]
pub struct SoakOptions {
    pub duration: Duration,
    /// Un-faulted load first (`None`: a sixth of the duration, between 10 s and 5 minutes).
    pub warmup: Option<Duration>,
    pub concurrency: usize,
    pub fault_rate: f64,
    pub seed: u64,
    pub policy: LoadFailurePolicy,
    /// Prompt lengths, in tokens, drawn uniformly from this range.
    pub prompt_tokens: (usize, usize),
    /// How often RSS and fds are read.
    pub sample_every: Duration,
    /// Spinning threads competing for the cores for the whole run.
    pub starve: usize,
    /// Faults left out of the menu, by label prefix.
    pub exclude: Vec<String>,
    /// Where a stalled soak writes what it knows before it exits ([`watchdog`]; `run_cli` sets
    /// the `--json` path).
    pub stall_report: Option<PathBuf>,
}

impl Default for SoakOptions {
    fn default() -> Self {
        Self {
            duration: Duration::from_secs(3600),
            warmup: None,
            concurrency: 32,
            fault_rate: 0.01,
            seed: 1,
            policy: LoadFailurePolicy::Recompute,
            prompt_tokens: (16, 400),
            sample_every: Duration::from_secs(5),
            starve: 0,
            exclude: Vec::new(),
            stall_report: None,
        }
    }
}

impl SoakOptions {
    /// The warm-up this soak runs.
    pub fn warmup(&self) -> Duration {
        self.warmup
            .unwrap_or_else(|| (self.duration / 6).clamp(Duration::from_secs(10), Duration::from_secs(300)))
            .min(self.duration / 2)
    }

    /// The `--load` options the soak's cluster, prompts and fault plans are made from.
    fn load_options(&self) -> LoadOptions {
        LoadOptions {
            requests: self.concurrency * ROUND_PER_CONCURRENCY,
            concurrency: self.concurrency,
            fault_rate: self.fault_rate,
            seed: self.seed,
            policy: self.policy,
            warmup: 0,
            prompt_tokens: self.prompt_tokens,
            exclude: self.exclude.clone(),
            ..LoadOptions::default()
        }
    }

    /// Every bad option, with what to change.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut errors = self.load_options().validate().err().unwrap_or_default();
        if self.sample_every.is_zero() || self.sample_every * 9 > self.duration - self.warmup() {
            errors.push(format!(
                "--sample-every {:?}: the run after its warm-up ({:?}) needs at least 9 samples",
                self.sample_every,
                self.duration - self.warmup()
            ));
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}

/// Running totals of the rounds.
#[derive(Default)]
struct Tally {
    requests: u64,
    streamed: u64,
    outcomes: BTreeMap<String, u64>,
    incorrect: u64,
    unclean: u64,
    late: u64,
    rounds: u64,
    planned: u64,
    fired: u64,
    hit: u64,
    fired_by_kind: BTreeMap<String, u64>,
    collateral: u64,
    collateral_bound: u64,
    terminal: report::Histogram,
    bad: Vec<BadRequest>,
    failed_samples: Vec<BadRequest>,
}

/// Where the soak's requests go and how they are judged.
struct Load<'a> {
    client: &'a reqwest::Client,
    url: String,
    prompts: &'a Prompts,
    /// The same prompts with `"stream": true`.
    streamed: Vec<Value>,
    deadline: Duration,
    concurrency: usize,
    /// Beaten at every answer, for the [`watchdog`].
    beat: Arc<AtomicU64>,
}

impl Load<'_> {
    /// Sends the requests `ids` (request `k`: prompt `prompt_of[k]`, streamed when `stream[k]`) at
    /// the soak's concurrency, no new one after `until`; returns the answers, in request order.
    async fn round(&self, ids: &[String], prompt_of: &[usize], stream: &[bool], until: Instant) -> Vec<Answer> {
        let mut answers: Vec<Answer> = futures::stream::iter(ids.iter().enumerate())
            .take_while(|_| std::future::ready(Instant::now() < until))
            .map(|(k, id)| async move {
                let p = prompt_of[k];
                let want = &self.prompts.want[p];
                let started = Instant::now();
                let (request_id, verdict) = if stream[k] {
                    stream::send(self.client, &self.url, id, &self.streamed[p], want, self.deadline).await
                } else {
                    let (rid, result) =
                        load::post(self.client, &self.url, id, &self.prompts.bodies[p], self.deadline).await;
                    (rid, load::verdict::verdict(&result, want))
                };
                self.beat.fetch_add(1, Ordering::Relaxed);
                Answer { request: k, request_id, verdict, terminal: started.elapsed() }
            })
            .buffer_unordered(self.concurrency.max(1))
            .collect()
            .await;
        answers.sort_by_key(|a| a.request);
        answers
    }
}

/// `pdflow chaos soak`: runs the soak, prints progress and the table, writes `json`; `Ok(true)`
/// when it passed.
pub async fn run_cli(opts: &SoakOptions, json: Option<&std::path::Path>) -> Result<bool, ChaosError> {
    let layers = super::install_layers();
    println!(
        "pdflow chaos soak: {:?} ({:?} warm-up) at concurrency {} through the proxy and 2P2D, fault rate {} (seed {}), D's policy {:?}, {} spinning threads",
        opts.duration,
        opts.warmup(),
        opts.concurrency,
        opts.fault_rate,
        opts.seed,
        opts.policy,
        opts.starve
    );
    let opts = SoakOptions { stall_report: json.map(std::path::Path::to_path_buf), ..opts.clone() };
    let report = run(&opts, &layers, |line| eprintln!("  {line}")).await?;
    println!("\n{}", render(&report));
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&report).map_err(ChaosError::Report)?;
        std::fs::write(path, text).map_err(|source| ChaosError::Write { path: path.to_path_buf(), source })?;
        println!("report written to {}", path.display());
    }
    Ok(report.passed)
}

/// Runs the soak; `progress` gets a line about once a minute (and at each phase).
pub async fn run(
    opts: &SoakOptions,
    layers: &ChaosLayers,
    mut progress: impl FnMut(String),
) -> Result<SoakReport, ChaosError> {
    opts.validate().map_err(ChaosError::LoadOptions)?;
    let _starve = super::starve::Starvation::start(opts.starve).map_err(ChaosError::Starve)?;
    let lopts = opts.load_options();
    let spec = load::load_spec(&lopts);
    let client = http_client()?;
    let mut rng = SplitMix64::new(opts.seed);
    let (shape, hybrid) = spec.model();
    let reference = Reference::start(shape, hybrid).await?;
    let prompts = Prompts::make(&lopts, &mut rng, &client, &reference).await;
    reference.shutdown().await;
    let prompts = prompts?;
    let cluster = LoadCluster::start(&spec, load::PREFILLS, load::DECODES, &layers.faults.seam()).await?;
    let log = Arc::new(Mutex::new(SpanLog::default()));
    let stop = CancellationToken::new();
    let drain = load::spawn_drain(layers.capture.clone(), log.clone(), stop.clone());
    let started = Instant::now();
    let series = Arc::new(Mutex::new(sampler::Series::default()));
    let expected = (opts.duration.as_secs_f64() / opts.sample_every.as_secs_f64()) as usize + 64;
    let sampling = sampler::spawn(started, opts.sample_every, expected, series.clone(), stop.clone());
    let beat = Arc::new(AtomicU64::new(0));
    let _watchdog = watchdog::Watchdog::start(started, beat.clone(), series.clone(), opts.stall_report.clone())
        .map_err(ChaosError::Watchdog)?;
    let streamed = prompts
        .bodies
        .iter()
        .map(|b| {
            let mut b = b.clone();
            b["stream"] = Value::Bool(true);
            b
        })
        .collect();
    let terminal_deadline = super::terminal_deadline(&spec);
    let load = Load {
        client: &client,
        url: format!("{}/v1/completions", cluster.proxy_url()),
        prompts: &prompts,
        streamed,
        deadline: terminal_deadline * 2,
        concurrency: opts.concurrency,
        beat,
    };
    let settle_within = pdflow_sim_node::engine_node::kv_state_timeout(&spec.deadlines) + load::BASELINE_MARGIN;
    let ctx = Ctx { opts, layers, load: &load, log: &log, terminal_deadline, settle_within, started };
    let result = drive(&ctx, &cluster, &series, &mut rng, &mut progress).await;
    layers.faults.disarm();
    stop.cancel();
    let _ = drain.await;
    let _ = sampling.await;
    cluster.shutdown().await;
    Ok(result)
}

/// What the phases of a soak share.
struct Ctx<'a> {
    opts: &'a SoakOptions,
    layers: &'a ChaosLayers,
    load: &'a Load<'a>,
    log: &'a Mutex<SpanLog>,
    terminal_deadline: Duration,
    /// How long the engines may take to get back to their block baseline at the end.
    settle_within: Duration,
    started: Instant,
}

async fn drive(
    ctx: &Ctx<'_>,
    cluster: &LoadCluster,
    series: &Mutex<sampler::Series>,
    rng: &mut SplitMix64,
    progress: &mut impl FnMut(String),
) -> SoakReport {
    let opts = ctx.opts;
    let mut problems = Vec::new();
    let round_len = opts.concurrency * ROUND_PER_CONCURRENCY;
    let warm_until = ctx.started + opts.warmup();
    let end = ctx.started + opts.duration;

    // Warm-up: the same mix, no fault, in smaller rounds so it ends near its time.
    let (mut warmup_requests, mut warmup_bad) = (0u64, 0u64);
    let mut w = 0u64;
    while Instant::now() < warm_until {
        let n = opts.concurrency * 4;
        let ids: Vec<String> = (0..n).map(|i| format!("sw-{w:05}-{i:05}")).collect();
        let (prompt_of, stream) = mix(n, ctx.load.prompts.bodies.len(), rng);
        let answers = ctx.load.round(&ids, &prompt_of, &stream, warm_until).await;
        warmup_requests += answers.len() as u64;
        warmup_bad += answers.iter().filter(|a| !matches!(a.verdict, Ok(None))).count() as u64;
        w += 1;
    }
    if warmup_bad > 0 {
        problems
            .push(format!("{warmup_bad} of {warmup_requests} un-faulted warm-up requests were not served correctly"));
    }
    *ctx.log.lock().unwrap_or_else(|p| p.into_inner()) = SpanLog::default();
    series.lock().unwrap_or_else(|p| p.into_inner()).after_warmup = true;
    progress(format!("warm-up over after {:.0} s: {warmup_requests} requests", ctx.started.elapsed().as_secs_f64()));

    // The soak: rounds with their own plan until the duration is up.
    let menu = balanced_menu(&opts.exclude);
    if menu.is_empty() && opts.fault_rate > 0.0 {
        problems.push(format!("--exclude {:?} leaves no fault to give", opts.exclude));
    }
    let mut tally = Tally::default();
    let soak_started = Instant::now();
    let mut next_progress = soak_started + Duration::from_secs(60);
    while Instant::now() < end {
        let r = tally.rounds;
        let ids: Vec<String> = (0..round_len).map(|i| round_id(r, i)).collect();
        let (prompt_of, stream) = mix(round_len, ctx.load.prompts.bodies.len(), rng);
        let (plan, planned) = faults::plan(round_len, opts.fault_rate, &menu, rng, |i| round_id(r, i));
        let injector = ctx.layers.faults.arm(plan);
        let answers = ctx.load.round(&ids, &prompt_of, &stream, end).await;
        let fired = injector.fired();
        tally.round(ctx, &answers, &stream, &planned, &fired, injector.plan());
        if Instant::now() >= next_progress {
            next_progress += Duration::from_secs(60);
            let rss = series.lock().unwrap_or_else(|p| p.into_inner()).samples.last().map_or(0, |s| s.rss_bytes);
            progress(format!(
                "{:.0} s: {} requests, {:?}, {} unclean, faults fired {}, RSS {:.1} MiB",
                ctx.started.elapsed().as_secs_f64(),
                tally.requests,
                tally.outcomes,
                tally.unclean,
                tally.fired,
                rss as f64 / (1024.0 * 1024.0)
            ));
        }
    }
    let soak_wall = soak_started.elapsed();

    // The end: blocks, transfers, serving again. The last plan stays armed while tails finish.
    let settle_within = ctx.settle_within;
    ctx.load.beat.fetch_add(1, Ordering::Relaxed);
    let held = cluster.wait_baseline(settle_within).await;
    ctx.layers.faults.disarm();
    ctx.load.beat.fetch_add(1, Ordering::Relaxed);
    let tracked_transfers = cluster.tracked_transfers().await;
    ctx.load.beat.fetch_add(1, Ordering::Relaxed);
    if tracked_transfers.values().any(|n| *n > 0) {
        problems.push(format!("transfers still tracked by the actors: {tracked_transfers:?}"));
    }
    if held.values().any(|h| h.blocks > 0 || h.requests > 0) {
        problems.push(format!("not back at the block baseline within {settle_within:?}: {held:?}"));
    }
    let serving = load::serving_after(
        cluster,
        ctx.load.client,
        &ctx.load.url,
        ctx.load.prompts,
        ctx.load.deadline,
        &ctx.layers.capture,
        ctx.log,
    )
    .await;
    if let Err(e) = &serving {
        problems.push(e.clone());
    }
    finish(
        ctx,
        tally,
        problems,
        series,
        held,
        tracked_transfers,
        serving.is_ok(),
        warmup_requests,
        warmup_bad,
        soak_wall,
    )
}

/// The per-request fault menu with the side-channel message faults (6 entries against some 400
/// actor kills) repeated until they are about a third of it: a soak drops, corrupts and delays
/// messages about half as often as it kills actors, not once in seventy faults.
fn balanced_menu(exclude: &[String]) -> Vec<faults::RequestFault> {
    let menu = faults::menu_without(exclude);
    let is_message = |f: &faults::RequestFault| !matches!(f.fault.action, FaultAction::Kill { .. });
    let (messages, kills): (Vec<_>, Vec<_>) = menu.into_iter().partition(is_message);
    let copies = if messages.is_empty() { 0 } else { (kills.len() / (2 * messages.len())).max(1) };
    let mut out = kills;
    for _ in 0..copies {
        out.extend(messages.iter().cloned());
    }
    out
}

/// The client id of request `i` of round `r` (fixed width: no id is a substring of another).
fn round_id(r: u64, i: usize) -> String {
    format!("sk-{r:06}-{i:05}")
}

/// A prompt for each of `n` requests, and which are streamed (half, at random).
fn mix(n: usize, prompts: usize, rng: &mut SplitMix64) -> (Vec<usize>, Vec<bool>) {
    let prompt_of = (0..n).map(|_| rng.below(prompts)).collect();
    let stream = (0..n).map(|_| rng.below(2) == 1).collect();
    (prompt_of, stream)
}

impl Tally {
    /// Adds one round: each answer's outcome (read from the span log, then forgotten), its faults.
    fn round(
        &mut self,
        ctx: &Ctx<'_>,
        answers: &[Answer],
        stream: &[bool],
        planned: &[faults::PlannedFault],
        fired: &[pdflow_fault::Fired],
        plan: &pdflow_fault::FaultPlan,
    ) {
        self.rounds += 1;
        self.planned += planned.iter().filter(|p| p.request < answers.len()).count() as u64;
        self.fired += fired.len() as u64;
        for f in fired {
            let action = &plan.faults[f.index].action;
            if f.killed > 0 || !matches!(action, FaultAction::Kill { .. } | FaultAction::KillNode { .. }) {
                self.hit += 1;
            }
            let kind = match action {
                FaultAction::Kill { .. } => "kill",
                FaultAction::Drop => "drop",
                FaultAction::Corrupt => "corrupt",
                FaultAction::Delay { .. } => "delay",
                _ => "other",
            };
            *self.fired_by_kind.entry(kind.to_string()).or_default() += 1;
        }
        self.collateral_bound += (fired.len() * ctx.opts.concurrency) as u64;
        let fault_of: HashMap<usize, &faults::PlannedFault> = planned.iter().map(|p| (p.request, p)).collect();
        let mut log = ctx.log.lock().unwrap_or_else(|p| p.into_inner());
        log.drain(&ctx.layers.capture);
        for a in answers {
            self.requests += 1;
            self.streamed += u64::from(stream[a.request]);
            self.terminal.add(a.terminal.as_secs_f64() * 1e3);
            if a.terminal > ctx.terminal_deadline {
                self.late += 1;
            }
            let (outcome, problem) = classify(a, &log);
            *self.outcomes.entry(outcome_name(outcome)).or_default() += 1;
            let fault = fault_of.get(&a.request).map(|p| p.fault.clone());
            if let Ok(Some(error)) = &a.verdict {
                if fault.is_none() {
                    self.collateral += 1;
                }
                if self.failed_samples.len() < load::MAX_BAD {
                    self.failed_samples.push(BadRequest {
                        request: a.request,
                        request_id: a.request_id.clone(),
                        fault: fault.clone(),
                        detail: error.clone(),
                    });
                }
            }
            if let Some(p) = problem {
                self.unclean += 1;
                if matches!(p, Problem::Incorrect(_)) {
                    self.incorrect += 1;
                }
                if self.bad.len() < load::MAX_BAD {
                    self.bad.push(BadRequest {
                        request: a.request,
                        request_id: a.request_id.clone(),
                        fault,
                        detail: format!("{}{p}", if stream[a.request] { "streamed: " } else { "" }),
                    });
                }
            }
        }
        // Forget the round's spans: the log would otherwise grow with every request of the hour.
        *log = SpanLog::default();
    }
}

#[allow(clippy::too_many_arguments)]
fn finish(
    ctx: &Ctx<'_>,
    t: Tally,
    mut problems: Vec<String>,
    series: &Mutex<sampler::Series>,
    held: BTreeMap<String, load::cluster::Held>,
    tracked_transfers: BTreeMap<String, usize>,
    serving_after: bool,
    warmup_requests: u64,
    warmup_bad: u64,
    soak_wall: Duration,
) -> SoakReport {
    let opts = ctx.opts;
    let samples = series.lock().unwrap_or_else(|p| p.into_inner()).samples.clone();
    let post: Vec<&sampler::Sample> = samples.iter().filter(|s| s.after_warmup).collect();
    let rss = Flatness::of(&post.iter().map(|s| s.rss_bytes).collect::<Vec<_>>(), report::rss_bound);
    let fds = Flatness::of(&post.iter().map(|s| s.fds).collect::<Vec<_>>(), |_| report::fd_bound(opts.concurrency));
    for (what, f) in [("RSS", rss), ("open fds", fds)] {
        if f.samples < 3 {
            problems.push(format!("{what}: {} samples after the warm-up, 3 needed for a verdict", f.samples));
        } else if !f.flat {
            problems.push(format!(
                "{what} grew after the warm-up: last third's max {} vs first third's {} (+{}, bound {})",
                f.last_third_max, f.first_third_max, f.growth, f.bound
            ));
        }
    }
    let answered: u64 = t.outcomes.values().sum();
    let accounted = answered == t.requests;
    if !accounted {
        problems.push(format!("{} requests sent, {answered} with an outcome", t.requests));
    }
    if t.unclean > 0 {
        problems
            .push(format!("{} requests did not end clean and correct ({} with wrong tokens)", t.unclean, t.incorrect));
    }
    if t.collateral > t.collateral_bound {
        problems.push(format!(
            "{} requests with no fault of their own failed, more than fired faults × concurrency ({})",
            t.collateral, t.collateral_bound
        ));
    }
    if t.requests == 0 {
        problems.push("no request was sent after the warm-up".into());
    }
    SoakReport {
        duration_s: opts.duration.as_secs_f64(),
        wall_s: (ctx.started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
        warmup_s: opts.warmup().as_secs_f64(),
        concurrency: opts.concurrency,
        fault_rate: opts.fault_rate,
        seed: opts.seed,
        policy: format!("{:?}", opts.policy).to_lowercase(),
        starve: opts.starve,
        prompt_tokens: opts.prompt_tokens,
        requests: t.requests,
        streamed: t.streamed,
        warmup_requests,
        warmup_bad,
        outcomes: t.outcomes,
        accounted,
        incorrect: t.incorrect,
        unclean: t.unclean,
        late: t.late,
        terminal_deadline_ms: ctx.terminal_deadline.as_secs_f64() * 1e3,
        terminal_ms: t.terminal.summary(),
        requests_per_s: ((t.requests as f64 / soak_wall.as_secs_f64().max(1e-9)) * 10.0).round() / 10.0,
        rounds: t.rounds,
        faults_planned: t.planned,
        faults_fired: t.fired,
        faults_hit: t.hit,
        fired_by_kind: t.fired_by_kind,
        collateral_failures: t.collateral,
        collateral_bound: t.collateral_bound,
        leaked_blocks: held.iter().map(|(k, h)| (k.clone(), h.blocks)).collect(),
        stuck_requests: held.iter().map(|(k, h)| (k.clone(), h.requests)).collect(),
        tracked_transfers,
        serving_after,
        rss,
        fds,
        process: "pdflow chaos (proxy, 2 P with their bootstraps, 2 D: one process)".into(),
        sample_every_s: opts.sample_every.as_secs_f64(),
        samples,
        bad: t.bad,
        failed_samples: t.failed_samples,
        passed: problems.is_empty(),
        problems,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_faults_are_about_a_third_of_the_soak_menu() {
        let menu = balanced_menu(&[]);
        let messages = menu.iter().filter(|f| !matches!(f.fault.action, FaultAction::Kill { .. })).count();
        let share = messages as f64 / menu.len() as f64;
        assert!((0.25..0.4).contains(&share), "{messages} of {}", menu.len());
        assert!(balanced_menu(&["pull_task/21".into(), "sender_listener/30".into()])
            .iter()
            .all(|f| matches!(f.fault.action, FaultAction::Kill { .. })));
        let opts = SoakOptions { duration: Duration::from_secs(60), ..SoakOptions::default() };
        assert_eq!(opts.warmup(), Duration::from_secs(10));
        assert!(opts.validate().is_ok());
        assert!(SoakOptions { duration: Duration::from_secs(20), ..opts }.validate().is_err(), "too short to sample");
    }
}
