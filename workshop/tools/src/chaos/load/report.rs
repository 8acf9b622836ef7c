//! The report of a load run (`pdflow chaos --load`, its `--json`): outcomes, correctness,
//! leaked blocks per engine, memory before and after, time to terminal state, throughput — and
//! the table printed under the run. Owns no seed step.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::faults::PlannedFault;

/// Time from POST to the terminal state, over every request of the run, in ms.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct TerminalMs {
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

impl TerminalMs {
    /// Nearest-rank percentiles of `ms` (any order).
    pub fn of(ms: &[f64]) -> Self {
        if ms.is_empty() {
            return Self::default();
        }
        let mut v = ms.to_vec();
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        let round = |x: f64| (x * 10.0).round() / 10.0;
        Self { p50: round(at(0.50)), p99: round(at(0.99)), max: round(v[v.len() - 1]) }
    }
}

/// One request that did not end clean and correct (the first few go in the report).
#[derive(Debug, Clone, Serialize)]
pub struct BadRequest {
    pub request: usize,
    /// The id the proxy gave it (`x-request-id` of the answer), when it answered.
    pub request_id: Option<String>,
    /// The fault planned for it, if any.
    pub fault: Option<String>,
    pub detail: String,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct LoadReport {
    pub requests: usize,
    pub concurrency: usize,
    pub fault_rate: f64,
    pub seed: u64,
    /// D's kv_load_failure_policy.
    pub policy: String,
    /// Un-faulted requests run before the measured run (memory baseline).
    pub warmup: usize,
    pub faults_planned: usize,
    /// Planned faults whose step edge was reached for their request.
    pub faults_fired: usize,
    /// Fired faults that hit something (an actor alive to kill, or a message fault).
    pub faults_hit: usize,
    /// `completed` / `recomputed` / `failed_clean` / `failed_unclean` counts.
    pub outcomes: BTreeMap<String, usize>,
    /// 200 answers whose tokens differ from the single-engine reference.
    pub incorrect: usize,
    /// Requests with no clean terminal state (timeout, cut, 200 with an error, non-200 without one, wrong tokens).
    pub unclean: usize,
    /// Requests whose terminal state came after the terminal deadline (still before the client's).
    pub late: usize,
    pub terminal_deadline_ms: f64,
    /// Blocks each engine still held after the bounded wait (`p0`, `p1`, `d0`, `d1`).
    pub leaked_blocks: BTreeMap<String, usize>,
    /// Requests each engine still tracked after that wait.
    pub stuck_requests: BTreeMap<String, usize>,
    /// Transfers the actors still track after the run (P: pulls in flight; D: requests in a
    /// lifecycle state), by engine.
    pub tracked_transfers: BTreeMap<String, usize>,
    /// RSS of this process after the warm-up (the cluster, pools and arenas at full concurrency).
    pub rss_before_bytes: u64,
    /// RSS right after the last request of the run answered.
    pub rss_end_of_run_bytes: u64,
    /// RSS after the baseline wait, the serving check and a short settle.
    pub rss_after_bytes: u64,
    pub rss_growth_bytes: i64,
    /// Largest growth still called flat ([`super::memory_bound`]).
    pub rss_bound_bytes: u64,
    pub memory_flat: bool,
    /// Step spans still open after the run, once every engine was idle (a kept span is a leak).
    pub open_spans_after: usize,
    pub terminal_ms: TerminalMs,
    pub requests_per_s: f64,
    pub wall_s: f64,
    /// After the run, requests went through every P and every D again, correct and not recomputed.
    pub serving_after: bool,
    pub planned: Vec<PlannedFault>,
    /// What fired: `step@edge request_id killed=N`.
    pub fired: Vec<String>,
    /// The first bad requests (at most 20).
    pub bad: Vec<BadRequest>,
    /// Clean errors of requests that had no fault of their own (a fault's blast radius).
    pub collateral_failures: usize,
    /// Their bound: faults fired × concurrency (each may fail the requests in flight where it hits).
    pub collateral_bound: usize,
    /// The first clean errors (at most 20), with the fault planned for the request if any.
    pub failed_samples: Vec<BadRequest>,
    /// Why the run did not pass (empty when it passed).
    pub problems: Vec<String>,
    pub passed: bool,
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// The summary printed under a run.
pub fn render(r: &LoadReport) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "requests        : {} at concurrency {} (+{} warm-up), D policy {}, seed {}",
        r.requests, r.concurrency, r.warmup, r.policy, r.seed
    );
    let _ = writeln!(
        s,
        "faults          : {} planned (rate {}), {} fired, {} hit something",
        r.faults_planned, r.fault_rate, r.faults_fired, r.faults_hit
    );
    let outcomes: Vec<String> = r.outcomes.iter().map(|(k, v)| format!("{k} {v}")).collect();
    let _ = writeln!(s, "outcomes        : {}", outcomes.join(", "));
    let _ = writeln!(
        s,
        "incorrect       : {}   unclean: {}   late (> {:.0} ms): {}",
        r.incorrect, r.unclean, r.terminal_deadline_ms, r.late
    );
    let _ = writeln!(
        s,
        "collateral      : {} clean errors of requests with no fault of their own (bound {})",
        r.collateral_failures, r.collateral_bound
    );
    if let Some(first) = r.failed_samples.first() {
        let _ = writeln!(
            s,
            "first error     : request {} (fault {}): {}",
            first.request,
            first.fault.as_deref().unwrap_or("none"),
            first.detail
        );
    }
    let leaks: Vec<String> = r.leaked_blocks.iter().map(|(k, v)| format!("{k} {v}")).collect();
    let stuck: usize = r.stuck_requests.values().sum();
    let tracked: usize = r.tracked_transfers.values().fold(0usize, |a, n| a.saturating_add(*n));
    let _ = writeln!(
        s,
        "leaked blocks   : {} (requests still tracked: {stuck}; transfers still tracked by the actors: {tracked})",
        leaks.join(", ")
    );
    let _ = writeln!(
        s,
        "memory (RSS)    : {:.1} MiB after warm-up, {:.1} MiB at end of run, {:.1} MiB after settle: growth {:+.1} MiB (bound {:.1} MiB) → {}",
        mib(r.rss_before_bytes),
        mib(r.rss_end_of_run_bytes),
        mib(r.rss_after_bytes),
        r.rss_growth_bytes as f64 / (1024.0 * 1024.0),
        mib(r.rss_bound_bytes),
        if r.memory_flat { "flat" } else { "GROWING" }
    );
    let _ = writeln!(s, "open step spans : {} after the run (every engine idle)", r.open_spans_after);
    let _ = writeln!(
        s,
        "terminal ms     : p50 {:.1}, p99 {:.1}, max {:.1}",
        r.terminal_ms.p50, r.terminal_ms.p99, r.terminal_ms.max
    );
    let _ = writeln!(s, "throughput      : {:.1} requests/s ({:.1} s)", r.requests_per_s, r.wall_s);
    let _ = writeln!(s, "serving after   : {}", r.serving_after);
    for b in &r.bad {
        let _ = writeln!(
            s,
            "BAD request {} ({}) fault {}: {}",
            b.request,
            b.request_id.as_deref().unwrap_or("-"),
            b.fault.as_deref().unwrap_or("none"),
            b.detail
        );
    }
    for p in &r.problems {
        let _ = writeln!(s, "PROBLEM: {p}");
    }
    let _ = writeln!(s, "{}", if r.passed { "PASS" } else { "FAIL" });
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let ms: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let t = TerminalMs::of(&ms);
        assert_eq!((t.p50, t.p99, t.max), (50.0, 99.0, 100.0));
        let t = TerminalMs::of(&[7.0]);
        assert_eq!((t.p50, t.p99, t.max), (7.0, 7.0, 7.0));
        assert_eq!(TerminalMs::of(&[]).max, 0.0);
    }
}
