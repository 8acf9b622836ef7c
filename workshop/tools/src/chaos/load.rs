//! Load with faults (`pdflow chaos --load`): N requests (default 2,000) at concurrency
//! C (default 64) through the proxy and 2P2D in this process, with ceil(N × rate) of them (default
//! 1 %) each given one random per-request fault ([`faults`]: actor kills at the steps the actor is
//! alive, drop / corrupt / delay of messages 21 and 30 — no node kills), all as one armed plan.
//!
//! Pass: every request reaches a clean terminal state before the client's deadline (200 with the
//! single-engine reference's tokens, or a non-200 with an error body); 0 blocks leaked and 0
//! requests stuck on every engine, and no transfer still tracked by an actor, after a bounded
//! wait; clean errors of requests with no fault of their own at most faults fired × concurrency;
//! the process's RSS flat between the end of a warm-up and the end of the run ([`memory_bound`]);
//! and afterwards requests go through every P and every D again, correct and not recomputed.
//!
//! Each request is sent with `X-Request-Id: ld-NNNNN` (its client id, the fault filter) and
//! classified by the id the proxy echoes back: `completed` when D resumed from P's KV (step 37)
//! with no failed receive (step 34), else `recomputed`. Step spans are read from the span capture
//! and forgotten every [`DRAIN_EVERY`] (a span closing between the read and the forget is lost:
//! that can only turn a `completed` into a `recomputed`, never pass a bad request).
//!
//! Owns no seed step; drives all of them (8–43) under load.
//!
//! # Layout
//! - [`faults`] — the per-request fault menu, the seeded RNG, the plan.
//! - [`cluster`] — the 2P2D cluster.
//! - [`report`] — the report and its rendering.
//! - `verdict` — each request's answer reduced to its verdict and outcome.

pub mod cluster;
pub mod faults;
pub mod report;
pub(crate) mod verdict;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use pdflow_observability::capture::SpanCapture;
use pdflow_observability::{attrs, steps};
use pdflow_sim_engine::LoadFailurePolicy;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

pub use cluster::LoadCluster;
pub use faults::{per_request_faults, PlannedFault, SplitMix64};
pub use report::{render, BadRequest, LoadReport, TerminalMs};

use super::cell::{body, token_ids, truncate, Outcome};
use super::cluster::ChaosSpec;
use super::{http_client, ChaosError, ChaosLayers, Reference};
use verdict::{classify, outcome_name, verdict, Answer, Problem};

/// How often step spans are read out of the capture and forgotten.
pub const DRAIN_EVERY: Duration = Duration::from_millis(100);
/// How many Ps and Ds a load run has.
pub const PREFILLS: usize = 2;
pub const DECODES: usize = 2;
/// How long after the run the engines may take to get back to their block baseline, beyond the
/// engine's own kv_state_timeout.
pub(crate) const BASELINE_MARGIN: Duration = Duration::from_secs(3);
/// The window in which, after the run, requests must go through every P and D again.
const SERVING_WINDOW: Duration = Duration::from_secs(10);
/// How long RSS is left to settle after the last check.
const SETTLE: Duration = Duration::from_millis(500);
/// At most this many bad requests are detailed in the report.
pub(crate) const MAX_BAD: usize = 20;

/// What a load run does.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub requests: usize,
    pub concurrency: usize,
    /// Share of requests given a fault (ceil(requests × rate) of them).
    pub fault_rate: f64,
    pub seed: u64,
    /// D's kv_load_failure_policy.
    pub policy: LoadFailurePolicy,
    /// Un-faulted requests first, at the same concurrency (the memory baseline).
    pub warmup: usize,
    /// Prompt lengths, in tokens, drawn uniformly from this range.
    pub prompt_tokens: (usize, usize),
    pub max_tokens: usize,
    /// How many distinct prompts the requests draw from (each with its reference computed once).
    pub distinct_prompts: usize,
    /// Faults left out of the menu, by label prefix (`proxy/` leaves out every proxy actor kill).
    pub exclude: Vec<String>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            requests: 2000,
            concurrency: 64,
            fault_rate: 0.01,
            seed: 1,
            policy: LoadFailurePolicy::Recompute,
            warmup: 200,
            prompt_tokens: (64, 160),
            max_tokens: 8,
            distinct_prompts: 64,
            exclude: Vec::new(),
        }
    }
}

impl LoadOptions {
    /// Every bad option, with what to change.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut errors = Vec::new();
        if self.requests == 0 {
            errors.push("--requests must be at least 1".to_string());
        }
        if self.concurrency == 0 {
            errors.push("--concurrency must be at least 1".to_string());
        }
        if !(0.0..=1.0).contains(&self.fault_rate) {
            errors.push(format!("--fault-rate {}: expected a share between 0 and 1 (0.01 = 1 %)", self.fault_rate));
        }
        let (lo, hi) = self.prompt_tokens;
        if lo == 0 || hi < lo {
            errors.push(format!("prompt lengths {lo}..={hi}: expected 1 <= min <= max"));
        }
        if self.max_tokens == 0 || self.distinct_prompts == 0 {
            errors.push("max_tokens and distinct_prompts must be at least 1".to_string());
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}

/// The spec of the load cluster: the chaos deadlines and shape, with blocks enough for
/// `concurrency` requests of the longest prompt on each engine (never the bottleneck).
pub fn load_spec(opts: &LoadOptions) -> ChaosSpec {
    let base = super::chaos_spec(opts.policy);
    let per_request = (opts.prompt_tokens.1 + opts.max_tokens).div_ceil(base.shape.block_size) + 1;
    ChaosSpec { num_blocks: (opts.concurrency * per_request).max(base.num_blocks), ..base }
}

/// Growth of RSS that is still "flat" for a run of `requests`: max(16 MiB, 10 % of the RSS after
/// warm-up), plus [`RUNNER_BYTES_PER_REQUEST`] for this runner's own records of each request. The
/// warm-up ran at the run's concurrency, so pools (HTTP connections, allocator arenas, tracing
/// slabs, engine queues) are already at their peak size; what may still move is allocator
/// fragmentation, a fraction of the heap. 16 MiB is the smallest leak of one KV block (8 KiB) per
/// request that a 2,000-request run would show.
pub fn memory_bound(rss_before: u64, requests: usize) -> u64 {
    (16 * 1024 * 1024u64).max(rss_before / 10) + RUNNER_BYTES_PER_REQUEST * requests as u64
}

/// What this runner itself keeps per request until the end (its answer and verdict, its client
/// id, its outcome in the span log): measured ~0.5 KiB (2,000 → 10,000 un-faulted requests grew
/// RSS by 12 → 16 MiB); twice that is allowed.
pub const RUNNER_BYTES_PER_REQUEST: u64 = 1024;

/// This process's resident set size, from `/proc/self/status` (0 where there is none).
pub fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// The client id of request `i` of the run (fixed width: no id is a substring of another).
pub fn client_id(i: usize) -> String {
    format!("ld-{i:05}")
}

/// Request ids whose D resumed from P's KV (step 37) / whose receive failed (step 34).
#[derive(Debug, Default)]
pub(crate) struct SpanLog {
    resumed: HashSet<String>,
    failed_recv: HashSet<String>,
}

impl SpanLog {
    /// Reads the capture's step spans into the log and forgets the closed ones.
    pub(crate) fn drain(&mut self, capture: &SpanCapture) {
        let spans = capture.spans();
        capture.clear();
        for s in spans {
            let Some(id) = s.attr(attrs::REQUEST_ID) else { continue };
            if s.step == steps::D_RESUME.number {
                self.resumed.insert(id.to_string());
            } else if s.step == steps::D_PULL_RESULT.number && s.attr(attrs::OUTCOME) == Some("failed") {
                self.failed_recv.insert(id.to_string());
            }
        }
    }

    pub(crate) fn outcome(&self, request_id: &str) -> Outcome {
        if self.resumed.contains(request_id) && !self.failed_recv.contains(request_id) {
            Outcome::Completed
        } else {
            Outcome::Recomputed
        }
    }
}

/// Drains the capture into a shared log every [`DRAIN_EVERY`] until cancelled.
pub(crate) fn spawn_drain(
    capture: SpanCapture,
    log: Arc<Mutex<SpanLog>>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(DRAIN_EVERY) => {}
            }
            log.lock().unwrap_or_else(|p| p.into_inner()).drain(&capture);
        }
    })
}

pub(crate) async fn post(
    client: &reqwest::Client,
    url: &str,
    id: &str,
    body: &Value,
    deadline: Duration,
) -> (Option<String>, Result<(u16, Value), String>) {
    let resp = match client.post(url).header("x-request-id", id).json(body).timeout(deadline).send().await {
        Ok(r) => r,
        Err(e) => return (None, Err(format!("POST {url}: {e}"))),
    };
    let request_id = resp.headers().get("x-request-id").and_then(|v| v.to_str().ok()).map(str::to_string);
    let status = resp.status().as_u16();
    match resp.text().await {
        Ok(text) => (request_id, Ok((status, serde_json::from_str(&text).unwrap_or(Value::String(text))))),
        Err(e) => (request_id, Err(format!("body of {status} cut: {e}"))),
    }
}

/// The prompts of a run and their reference tokens (one engine alone, no connector).
pub(crate) struct Prompts {
    pub(crate) bodies: Vec<Value>,
    pub(crate) want: Vec<Vec<u64>>,
}

impl Prompts {
    pub(crate) async fn make(
        opts: &LoadOptions,
        rng: &mut SplitMix64,
        client: &reqwest::Client,
        reference: &Reference,
    ) -> Result<Self, ChaosError> {
        let (lo, hi) = opts.prompt_tokens;
        let mut bodies = Vec::with_capacity(opts.distinct_prompts);
        let mut want = Vec::with_capacity(opts.distinct_prompts);
        let url = format!("{}/v1/completions", reference.url);
        for i in 0..opts.distinct_prompts {
            let len = lo + rng.below(hi - lo + 1);
            let b = body(
                &crate::demo::prompt_words(len, opts.seed.wrapping_mul(1_000_003).wrapping_add(i as u64)),
                opts.max_tokens,
            );
            let tokens = match post(client, &url, &format!("ref-{i}"), &b, Duration::from_secs(30)).await {
                (_, Ok((200, v))) => token_ids(&v),
                (_, other) => return Err(ChaosError::Reference(format!("no answer to prompt {i}: {other:?}"))),
            };
            if tokens.len() != opts.max_tokens {
                return Err(ChaosError::Reference(format!(
                    "{} tokens for prompt {i}, asked for {}",
                    tokens.len(),
                    opts.max_tokens
                )));
            }
            bodies.push(b);
            want.push(tokens);
        }
        Ok(Self { bodies, want })
    }
}

/// Where the load goes: the proxy's completions URL, and each request's deadline.
#[derive(Clone, Copy)]
struct Endpoint<'a> {
    client: &'a reqwest::Client,
    url: &'a str,
    deadline: Duration,
}

/// Sends `ids.len()` requests at `concurrency`, request `k` with prompt `prompt_of[k]`; `done`
/// sees each answer as it comes.
async fn blast(
    to: Endpoint<'_>,
    prompts: &Prompts,
    ids: &[String],
    prompt_of: &[usize],
    concurrency: usize,
    mut done: impl FnMut(usize),
) -> Vec<Answer> {
    let Endpoint { client, url, deadline } = to;
    let mut answers = Vec::with_capacity(ids.len());
    let mut stream = futures::stream::iter(ids.iter().enumerate())
        .map(|(k, id)| {
            let b = &prompts.bodies[prompt_of[k]];
            async move {
                let started = Instant::now();
                let (request_id, result) = post(client, url, id, b, deadline).await;
                let terminal = started.elapsed();
                Answer { request: k, request_id, verdict: verdict(&result, &prompts.want[prompt_of[k]]), terminal }
            }
        })
        .buffer_unordered(concurrency.max(1));
    while let Some(a) = stream.next().await {
        answers.push(a);
        done(answers.len());
    }
    answers.sort_by_key(|a| a.request);
    answers
}

/// `pdflow chaos --load`: runs the load, prints progress and the summary, writes `json`;
/// `Ok(true)` when it passed.
pub async fn run_cli(opts: &LoadOptions, json: Option<&std::path::Path>) -> Result<bool, ChaosError> {
    let layers = super::install_layers();
    println!(
        "pdflow chaos --load: {} requests at concurrency {} through the proxy and {PREFILLS}P{DECODES}D, fault rate {} (seed {}), D's policy {:?}",
        opts.requests, opts.concurrency, opts.fault_rate, opts.seed, opts.policy
    );
    let step = |total: usize| (total / 10).max(1);
    let report = run(opts, &layers, |phase, n, total| {
        if n % step(total) == 0 || n == total {
            eprintln!("  {phase:?}: {n}/{total}");
        }
    })
    .await?;
    println!("\n{}", render(&report));
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&report).map_err(ChaosError::Report)?;
        std::fs::write(path, text).map_err(|source| ChaosError::Write { path: path.to_path_buf(), source })?;
        println!("report written to {}", path.display());
    }
    Ok(report.passed)
}

/// Where a run is, for progress lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Warmup,
    Run,
}

/// Runs the load; `progress` sees (phase, answered, total) after every answer.
pub async fn run(
    opts: &LoadOptions,
    layers: &ChaosLayers,
    mut progress: impl FnMut(Phase, usize, usize),
) -> Result<LoadReport, ChaosError> {
    opts.validate().map_err(ChaosError::LoadOptions)?;
    let spec = load_spec(opts);
    let client = http_client()?;
    let mut rng = SplitMix64::new(opts.seed);
    let (shape, hybrid) = spec.model();
    let reference = Reference::start(shape, hybrid).await?;
    let prompts = Prompts::make(opts, &mut rng, &client, &reference).await;
    reference.shutdown().await;
    let prompts = prompts?;
    let cluster = LoadCluster::start(&spec, PREFILLS, DECODES, &layers.faults.seam()).await?;
    let log = Arc::new(Mutex::new(SpanLog::default()));
    let stop = CancellationToken::new();
    let drain = spawn_drain(layers.capture.clone(), log.clone(), stop.clone());
    let result = drive(opts, &spec, &cluster, &client, &prompts, &mut rng, layers, &log, &mut progress).await;
    layers.faults.disarm();
    stop.cancel();
    let _ = drain.await;
    cluster.shutdown().await;
    Ok(result)
}

#[allow(clippy::too_many_arguments)]
async fn drive(
    opts: &LoadOptions,
    spec: &ChaosSpec,
    cluster: &LoadCluster,
    client: &reqwest::Client,
    prompts: &Prompts,
    rng: &mut SplitMix64,
    layers: &ChaosLayers,
    log: &Mutex<SpanLog>,
    progress: &mut impl FnMut(Phase, usize, usize),
) -> LoadReport {
    let capture = &layers.capture;
    let url = format!("{}/v1/completions", cluster.proxy_url());
    let terminal_deadline = super::terminal_deadline(spec);
    let client_deadline = terminal_deadline * 2;
    let mut problems = Vec::new();

    // Warm-up, un-faulted: pools and arenas reach their size at this concurrency.
    let warm_ids: Vec<String> = (0..opts.warmup).map(|i| format!("wu-{i:05}")).collect();
    let warm_prompts: Vec<usize> = (0..opts.warmup).map(|_| rng.below(prompts.bodies.len())).collect();
    let to = Endpoint { client, url: &url, deadline: client_deadline };
    let warm =
        blast(to, prompts, &warm_ids, &warm_prompts, opts.concurrency, |n| progress(Phase::Warmup, n, opts.warmup))
            .await;
    let warm_bad = warm.iter().filter(|a| !matches!(a.verdict, Ok(None))).count();
    if warm_bad > 0 {
        problems.push(format!("{warm_bad} of {} un-faulted warm-up requests were not served correctly", opts.warmup));
    }
    drop(warm);
    let settle_within = pdflow_sim_node::engine_node::kv_state_timeout(&spec.deadlines) + BASELINE_MARGIN;
    cluster.wait_baseline(settle_within).await;
    log.lock().unwrap_or_else(|p| p.into_inner()).drain(capture);
    *log.lock().unwrap_or_else(|p| p.into_inner()) = SpanLog::default();
    let rss_before = rss_bytes();

    // The run, with the plan armed.
    let ids: Vec<String> = (0..opts.requests).map(client_id).collect();
    let prompt_of: Vec<usize> = (0..opts.requests).map(|_| rng.below(prompts.bodies.len())).collect();
    let menu = faults::menu_without(&opts.exclude);
    if menu.is_empty() && opts.fault_rate > 0.0 {
        problems.push(format!("--exclude {:?} leaves no fault to give", opts.exclude));
    }
    let (plan, planned) = faults::plan(opts.requests, opts.fault_rate, &menu, rng, client_id);
    let injector = layers.faults.arm(plan);
    let started = Instant::now();
    let answers =
        blast(to, prompts, &ids, &prompt_of, opts.concurrency, |n| progress(Phase::Run, n, opts.requests)).await;
    let wall = started.elapsed();
    let rss_end_of_run = rss_bytes();

    // Blocks: the plan stays armed while the tails (P's steps 31–33) finish.
    let held = cluster.wait_baseline(settle_within).await;
    let fired = injector.fired();
    layers.faults.disarm();
    log.lock().unwrap_or_else(|p| p.into_inner()).drain(capture);

    // Classify.
    let fault_of: HashMap<usize, &PlannedFault> = planned.iter().map(|p| (p.request, p)).collect();
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    let (mut incorrect, mut unclean, mut late) = (0, 0, 0);
    let mut bad = Vec::new();
    // Clean errors of requests no fault was planned for: the faults' blast radius.
    let (mut collateral, mut failed_samples) = (0usize, Vec::new());
    {
        let log = log.lock().unwrap_or_else(|p| p.into_inner());
        for a in &answers {
            let (outcome, problem) = classify(a, &log);
            if matches!(problem, Some(Problem::Incorrect(_))) {
                incorrect += 1;
            }
            if a.terminal > terminal_deadline {
                late += 1;
            }
            *outcomes.entry(outcome_name(outcome)).or_default() += 1;
            if let Ok(Some(error)) = &a.verdict {
                let fault = fault_of.get(&a.request).map(|p| p.fault.clone());
                if fault.is_none() {
                    collateral += 1;
                }
                if failed_samples.len() < MAX_BAD {
                    failed_samples.push(BadRequest {
                        request: a.request,
                        request_id: a.request_id.clone(),
                        fault,
                        detail: error.clone(),
                    });
                }
            }
            if let Some(p) = problem {
                unclean += 1;
                if bad.len() < MAX_BAD {
                    bad.push(BadRequest {
                        request: a.request,
                        request_id: a.request_id.clone(),
                        fault: fault_of.get(&a.request).map(|p| p.fault.clone()),
                        detail: p.to_string(),
                    });
                }
            }
        }
    }
    if unclean > 0 {
        problems.push(format!("{unclean} requests did not end clean and correct ({incorrect} with wrong tokens)"));
    }
    // A fault may fail the requests in flight where it hits (a killed connector or receiver takes
    // its engine's requests with it), at most `concurrency` of them; more is an outage.
    let collateral_bound = fired.len() * opts.concurrency;
    if collateral > collateral_bound {
        problems.push(format!(
            "{collateral} requests with no fault of their own failed, more than the {} fired faults × concurrency {} could have hit in flight: the cluster stopped serving for a while (see failed_samples)",
            fired.len(),
            opts.concurrency
        ));
    }
    // The actors too: no pull in flight on P, no request in any lifecycle state on D.
    let tracked_transfers = cluster.tracked_transfers().await;
    if tracked_transfers.values().any(|n| *n > 0) {
        problems.push(format!(
            "transfers still tracked by the actors (P: pulls in flight, D: requests in a state): {tracked_transfers:?}"
        ));
    }
    let leaked_blocks: BTreeMap<String, usize> = held.iter().map(|(k, h)| (k.clone(), h.blocks)).collect();
    let stuck_requests: BTreeMap<String, usize> = held.iter().map(|(k, h)| (k.clone(), h.requests)).collect();
    if held.values().any(|h| h.blocks > 0 || h.requests > 0) {
        problems.push(format!("not back at the block baseline within {settle_within:?}: {held:?}"));
    }

    let serving = serving_after(cluster, client, &url, prompts, client_deadline, capture, log).await;
    if let Err(e) = &serving {
        problems.push(e.clone());
    }
    tokio::time::sleep(SETTLE).await;
    let rss_after = rss_bytes();
    // Step spans still open once every engine is idle: a span (and whatever holds it) kept alive.
    let open_spans_after = capture.spans().iter().filter(|s| s.end.is_none()).count();
    let bound = memory_bound(rss_before, opts.requests);
    let growth = rss_after as i64 - rss_before as i64;
    let memory_flat = rss_before > 0 && growth <= bound as i64;
    if !memory_flat {
        problems.push(format!("RSS grew by {growth} bytes (bound {bound}) from {rss_before}"));
    }
    let terminal: Vec<f64> = answers.iter().map(|a| a.terminal.as_secs_f64() * 1e3).collect();
    let faults_hit = fired
        .iter()
        .filter(|f| {
            f.killed > 0
                || !matches!(
                    injector.plan().faults[f.index].action,
                    pdflow_fault::FaultAction::Kill { .. } | pdflow_fault::FaultAction::KillNode { .. }
                )
        })
        .count();
    LoadReport {
        requests: opts.requests,
        concurrency: opts.concurrency,
        fault_rate: opts.fault_rate,
        seed: opts.seed,
        policy: format!("{:?}", opts.policy).to_lowercase(),
        warmup: opts.warmup,
        faults_planned: planned.len(),
        faults_fired: fired.len(),
        faults_hit,
        outcomes,
        incorrect,
        unclean,
        late,
        terminal_deadline_ms: terminal_deadline.as_secs_f64() * 1e3,
        leaked_blocks,
        stuck_requests,
        tracked_transfers,
        rss_before_bytes: rss_before,
        rss_end_of_run_bytes: rss_end_of_run,
        rss_after_bytes: rss_after,
        rss_growth_bytes: growth,
        rss_bound_bytes: bound,
        memory_flat,
        open_spans_after,
        terminal_ms: TerminalMs::of(&terminal),
        requests_per_s: ((opts.requests as f64 / wall.as_secs_f64().max(1e-9)) * 10.0).round() / 10.0,
        wall_s: (wall.as_secs_f64() * 10.0).round() / 10.0,
        serving_after: serving.is_ok(),
        planned,
        fired: fired.iter().map(|f| format!("{}@{:?} {} killed={}", f.step, f.when, f.request_id, f.killed)).collect(),
        bad,
        collateral_failures: collateral,
        collateral_bound,
        failed_samples,
        passed: problems.is_empty(),
        problems,
    }
}

/// After the run: requests go through every P and every D again, correct and completed from P's
/// KV (not recomputed), within [`SERVING_WINDOW`]; `Err` says what was still wrong.
pub(crate) async fn serving_after(
    cluster: &LoadCluster,
    client: &reqwest::Client,
    url: &str,
    prompts: &Prompts,
    deadline: Duration,
    capture: &SpanCapture,
    log: &Mutex<SpanLog>,
) -> Result<(), String> {
    let before: BTreeMap<String, u64> = cluster.block_stats().into_iter().map(|(k, s)| (k, s.finished)).collect();
    let until = Instant::now() + SERVING_WINDOW;
    let (mut completed, mut last) = (0usize, String::from("no request sent"));
    let mut k = 0usize;
    loop {
        k += 1;
        let p = k % prompts.bodies.len();
        match post(client, url, &format!("after-{k}"), &prompts.bodies[p], deadline).await {
            (Some(id), Ok((200, v))) if token_ids(&v) == prompts.want[p] => {
                let mut log = log.lock().unwrap_or_else(|p| p.into_inner());
                log.drain(capture);
                if log.outcome(&id) == Outcome::Completed {
                    completed += 1;
                } else {
                    last = format!("request {id} was recomputed by D");
                }
            }
            (_, r) => last = format!("after-{k}: {}", truncate(&format!("{r:?}"))),
        }
        let now = cluster.block_stats();
        let idle: Vec<&String> =
            now.iter().filter(|(k, s)| before.get(*k).is_some_and(|b| s.finished <= *b)).map(|(k, _)| k).collect();
        if idle.is_empty() && completed >= PREFILLS.max(DECODES) {
            return Ok(());
        }
        if Instant::now() >= until {
            return Err(format!("not every node served again within {SERVING_WINDOW:?}: engines that served nothing {idle:?}, {completed} completed; last: {last}"));
        }
    }
}
