//! Runs one chaos cell: a fresh cluster, the fault armed, one request through the proxy (node
//! kills handled as they come), then the checks — terminal state before the deadline, tokens equal
//! to the single-engine reference, P and D back at their block baseline, and the next request
//! served correctly.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pdflow_fault::FaultDomain;
use pdflow_observability::capture::SpanCapture;
use pdflow_observability::{attrs, steps};
use serde::Serialize;
use serde_json::Value;

use super::cluster::{ChaosCluster, ChaosSpec};
use super::matrix::CellSpec;

/// The terminal state of the faulted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// 200, D used P's KV.
    Completed,
    /// 200, D's KV load failed and D prefilled locally (policy `recompute`).
    Recomputed,
    /// A non-200 status with an error body (policy `fail`, or a request that could not be served).
    FailedClean,
    /// No terminal state before the client's deadline, a 200 with an error inside, or a cut
    /// connection: never acceptable.
    FailedUnclean,
}

/// One cell's result (the `--json` row).
#[derive(Debug, Clone, Serialize)]
pub struct CellResult {
    pub actor: String,
    pub step: u8,
    pub fault: String,
    pub outcome: Outcome,
    /// Tokens returned (if any) equal the reference.
    pub correct: bool,
    pub terminal_ms: f64,
    /// The deadline the terminal state had to meet, in ms.
    pub deadline_ms: f64,
    /// `terminal_ms / deadline_ms`: how much of its deadline the cell used.
    pub ratio: f64,
    pub leaked_blocks_p: usize,
    pub leaked_blocks_d: usize,
    /// A next request was served correctly through P and D within the recovery window.
    pub next_ok: bool,
    /// How long after the faulted request that took.
    pub recovery_ms: f64,
    /// The fault fired and hit something (an actor or node was alive to kill).
    pub hit: bool,
    /// What fired: `step@edge request killed=N`.
    pub fired: Vec<String>,
    pub passed: bool,
    /// Why the cell failed (empty when it passed).
    pub detail: String,
}

impl CellResult {
    /// Records the time to terminal against the deadline it had to meet.
    pub fn set_terminal(&mut self, took: Duration, deadline: Duration) {
        self.terminal_ms = (took.as_secs_f64() * 1e6).round() / 1e3;
        self.deadline_ms = (deadline.as_secs_f64() * 1e6).round() / 1e3;
        self.ratio =
            if deadline.is_zero() { 0.0 } else { (took.as_secs_f64() / deadline.as_secs_f64() * 1e4).round() / 1e4 };
    }

    /// A cell's row before it ran: failed unclean until its run says otherwise.
    pub fn new(actor: &str, step: u8, fault: &str) -> Self {
        Self {
            actor: actor.to_string(),
            step,
            fault: fault.to_string(),
            outcome: Outcome::FailedUnclean,
            correct: false,
            terminal_ms: 0.0,
            deadline_ms: 0.0,
            ratio: 0.0,
            leaked_blocks_p: 0,
            leaked_blocks_d: 0,
            next_ok: false,
            recovery_ms: 0.0,
            hit: false,
            fired: Vec::new(),
            passed: false,
            detail: String::new(),
        }
    }
}

/// Judges the faulted request's terminal answer against the reference tokens `want`: a 200 with
/// the reference tokens is completed or recomputed (`served` tells which), a non-200 with an error
/// body is failed_clean; anything else — a 200 with an error or wrong tokens, an error status with
/// no error body, no answer — is a problem. Sets the row's outcome and correctness.
pub(super) fn judge(
    answer: &Result<(u16, Value), String>,
    want: &[u64],
    served: impl FnOnce() -> Outcome,
    result: &mut CellResult,
    problems: &mut Vec<String>,
) {
    match answer {
        Ok((200, v)) if v.get("error").is_none() => {
            let tokens = token_ids(v);
            result.correct = tokens == want;
            result.outcome = served();
            if !result.correct {
                problems.push(format!("tokens {tokens:?} differ from the reference {want:?}"));
            }
        }
        Ok((200, v)) => problems.push(format!("HTTP 200 with an error inside: {}", truncate(&v.to_string()))),
        Ok((status, v)) => {
            result.correct = true;
            result.outcome = Outcome::FailedClean;
            if !(v["error"].is_object() || v["error"].is_string()) {
                result.outcome = Outcome::FailedUnclean;
                problems.push(format!("HTTP {status} without an error body: {}", truncate(&v.to_string())));
            }
        }
        Err(e) => problems.push(format!("no terminal state: {e}")),
    }
}

/// What a cell run needs besides its spec.
pub struct CellEnv<'a> {
    pub spec: ChaosSpec,
    pub capture: &'a SpanCapture,
    /// The domain the cells' clusters are given and their plans are armed in.
    pub faults: &'a Arc<FaultDomain>,
    pub client: &'a reqwest::Client,
    /// URL of the single engine that gives the reference tokens.
    pub reference_url: &'a str,
    /// A terminal state later than this fails the cell.
    pub terminal_deadline: Duration,
    pub prompt_tokens: usize,
    pub max_tokens: usize,
}

/// A completion request body (greedy) for the chaos runs.
pub(super) fn body(prompt: &str, max_tokens: usize) -> Value {
    serde_json::json!({"model": "Qwen/Qwen3-8B", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

/// The `token_ids` of a completion answer (empty when there are none).
pub(super) fn token_ids(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"].as_array().map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default()
}

/// POST with a deadline; `Err` is a transport failure or the deadline.
pub(super) async fn post(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    deadline: Duration,
) -> Result<(u16, Value), String> {
    let resp = client.post(url).json(body).timeout(deadline).send().await.map_err(|e| format!("POST {url}: {e}"))?;
    let status = resp.status().as_u16();
    let text = resp.text().await.map_err(|e| format!("body of POST {url}: {e}"))?;
    Ok((status, serde_json::from_str(&text).unwrap_or(Value::String(text))))
}

async fn reference(env: &CellEnv<'_>, body: &Value) -> Result<Vec<u64>, String> {
    reference_tokens(env.client, env.reference_url, body).await
}

/// The tokens the single reference engine at `reference_url` answers `body` with.
pub(super) async fn reference_tokens(
    client: &reqwest::Client,
    reference_url: &str,
    body: &Value,
) -> Result<Vec<u64>, String> {
    match post(client, &format!("{reference_url}/v1/completions"), body, Duration::from_secs(30)).await? {
        (200, v) => Ok(token_ids(&v)),
        (s, v) => Err(format!("reference engine answered {s}: {v}")),
    }
}

/// Runs one cell; a cluster that cannot start is a failed cell, not an error.
pub async fn run_cell(cell: &CellSpec, seed: u64, env: &CellEnv<'_>) -> CellResult {
    let mut result = CellResult::new(&cell.actor, cell.step, &cell.fault);
    let mut cluster = match ChaosCluster::start(env.spec, env.faults).await {
        Ok(c) => c,
        Err(e) => {
            result.detail = format!("cluster did not start: {e}");
            return result;
        }
    };
    let problems = drive(cell, seed, env, &mut cluster, &mut result).await;
    env.faults.disarm();
    cluster.shutdown().await;
    result.passed = problems.is_empty();
    result.detail = problems.join("; ");
    result
}

async fn drive(
    cell: &CellSpec,
    seed: u64,
    env: &CellEnv<'_>,
    cluster: &mut ChaosCluster,
    result: &mut CellResult,
) -> Vec<String> {
    let mut problems = Vec::new();
    let url = format!("{}/v1/completions", cluster.proxy_url());
    let faulted = body(&crate::demo::prompt_words(env.prompt_tokens, seed), env.max_tokens);
    let want = match reference(env, &faulted).await {
        Ok(t) => t,
        Err(e) => return vec![e],
    };
    env.capture.clear();
    let injector = env.faults.arm(cell.plan.clone());
    let started = Instant::now();
    let client_deadline = env.terminal_deadline * 2;
    let request = {
        let (client, url, faulted) = (env.client.clone(), url.clone(), faulted.clone());
        tokio::spawn(async move { post(&client, &url, &faulted, client_deadline).await })
    };
    tokio::pin!(request);
    let answer = loop {
        tokio::select! {
            answer = &mut request => break answer,
            Some(node) = cluster.kills.recv() => {
                if let Err(e) = cluster.kill_and_restart(node).await {
                    problems.push(format!("node {} did not come back: {e}", node.name()));
                }
            }
        }
    };
    let terminal = started.elapsed();
    result.set_terminal(terminal, env.terminal_deadline);
    restart_killed(cluster, &mut problems).await;
    let answer = answer.unwrap_or_else(|e| Err(format!("request task failed: {e}")));
    judge(&answer, &want, || classify(env), result, &mut problems);
    if terminal > env.terminal_deadline {
        problems.push(format!(
            "terminal after {:.0} ms, past the {:?} deadline",
            result.terminal_ms, env.terminal_deadline
        ));
    }
    // Blocks: P keeps a request's blocks at most until its send expiry (or a dead pull's
    // deadline), bounded by the engine's kv_state_timeout. The plan stays armed meanwhile: the
    // request's tail (P's steps 31-33 may come after the answer) can still be hit.
    let settle = pdflow_sim_node::engine_node::kv_state_timeout(&env.spec.deadlines) + Duration::from_secs(1);
    (result.leaked_blocks_p, result.leaked_blocks_d) = settle_blocks(cluster, settle, &mut problems).await;
    let fired = injector.fired();
    env.faults.disarm();
    // A node killed by the very last edge is restarted before the next request.
    restart_killed(cluster, &mut problems).await;
    result.fired =
        fired.iter().map(|f| format!("{}@{:?} {} killed={}", f.step, f.when, f.request_id, f.killed)).collect();
    result.hit = fired.iter().any(|f| f.killed > 0)
        || fired.iter().any(|f| {
            !matches!(
                cell.plan.faults[f.index].action,
                pdflow_fault::FaultAction::Kill { .. } | pdflow_fault::FaultAction::KillNode { .. }
            )
        });
    if result.leaked_blocks_p + result.leaked_blocks_d > 0 {
        problems.push(format!("blocks leaked: P {}, D {}", result.leaked_blocks_p, result.leaked_blocks_d));
    }
    // The node is serving again: within the recovery window, a next request is served correctly
    // through P and D (a recomputed answer is correct but means P/D is not back yet).
    let next = body(&crate::demo::prompt_words(env.prompt_tokens, seed ^ 0xA5A5), env.max_tokens);
    let next_want = reference(env, &next).await.unwrap_or_default();
    let recovering = Instant::now();
    let recover_until = recovering + RECOVERY_WINDOW;
    let _ = crate::demo::wait_ready(env.client, &cluster.proxy_url(), RECOVERY_WINDOW).await;
    let mut last = String::new();
    while !result.next_ok && Instant::now() < recover_until {
        env.capture.clear();
        match post(env.client, &url, &next, env.terminal_deadline).await {
            Ok((200, v)) if !next_want.is_empty() && token_ids(&v) == next_want => {
                if classify(env) == Outcome::Completed {
                    result.next_ok = true;
                    result.recovery_ms = (recovering.elapsed().as_secs_f64() * 1e6).round() / 1e3;
                } else {
                    last = "next requests were recomputed by D: P/D not serving again".into();
                }
            }
            Ok((status, v)) => last = format!("next request: {status} {}", truncate(&v.to_string())),
            Err(e) => last = format!("next request: {e}"),
        }
        if !result.next_ok {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    if !result.next_ok {
        problems.push(format!("not serving again within {RECOVERY_WINDOW:?}: {last}"));
    }
    let (p, d) = cluster.wait_baseline(settle).await;
    if p + d > 0 {
        problems.push(format!("blocks held after the next request: P {p}, D {d}"));
        result.leaked_blocks_p = result.leaked_blocks_p.max(p);
        result.leaked_blocks_d = result.leaked_blocks_d.max(d);
    }
    problems
}

/// Kills and restarts the nodes the plan asked for since the last call.
async fn restart_killed(cluster: &mut ChaosCluster, problems: &mut Vec<String>) {
    while let Ok(node) = cluster.kills.try_recv() {
        if let Err(e) = cluster.kill_and_restart(node).await {
            problems.push(format!("node {} did not come back: {e}", node.name()));
        }
    }
}

/// Waits (bounded by `within`) until P and D are back at their block baseline, restarting any
/// node killed meanwhile; returns the blocks each still holds at the end.
async fn settle_blocks(cluster: &mut ChaosCluster, within: Duration, problems: &mut Vec<String>) -> (usize, usize) {
    let until = Instant::now() + within;
    loop {
        restart_killed(cluster, problems).await;
        let left = until.saturating_duration_since(Instant::now());
        let held = cluster.wait_baseline(left.min(Duration::from_millis(50))).await;
        if held == (0, 0) && cluster.is_idle() || left.is_zero() {
            return held;
        }
    }
}

/// How long after the faulted request's end the next request may take to be served through P
/// and D again (a restarted bootstrap learns P's workers within P's re-registration interval).
pub const RECOVERY_WINDOW: Duration = Duration::from_secs(5);

/// A 200 answer's outcome from the captured spans: D resumed from P's KV (step 37) with no failed
/// receive (step 34) — completed — or not — recomputed.
fn classify(env: &CellEnv<'_>) -> Outcome {
    let spans = env.capture.spans();
    let resumed = spans.iter().any(|s| s.step == steps::D_RESUME.number);
    let failed_recv =
        spans.iter().any(|s| s.step == steps::D_PULL_RESULT.number && s.attr(attrs::OUTCOME) == Some("failed"));
    if resumed && !failed_recv {
        Outcome::Completed
    } else {
        Outcome::Recomputed
    }
}

/// The first 300 characters, for reports.
pub(super) fn truncate(s: &str) -> String {
    s.chars().take(300).collect()
}
