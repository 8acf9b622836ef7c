//! The report of a soak (`pdflow chaos soak`, its `--json`): every request accounted for, the
//! faults, blocks and transfers at the end, the memory verdict with the whole RSS / fd series,
//! and the table printed under the run.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::sampler::Sample;
use crate::chaos::load::{BadRequest, TerminalMs};

/// Time to terminal state in whole milliseconds, counted per millisecond up to a minute (and
/// above in the last bucket): a run of a million requests keeps 240 KiB, not a growing list.
#[derive(Debug, Clone)]
pub struct Histogram {
    counts: Vec<u32>,
    max_ms: f64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self { counts: vec![0; 60_001], max_ms: 0.0 }
    }
}

impl Histogram {
    pub fn add(&mut self, ms: f64) {
        let i = (ms.max(0.0) as usize).min(self.counts.len() - 1);
        self.counts[i] = self.counts[i].saturating_add(1);
        self.max_ms = self.max_ms.max(ms);
    }

    /// Nearest-rank p50 / p99 (to the millisecond) and the exact max.
    pub fn summary(&self) -> TerminalMs {
        let total: u64 = self.counts.iter().map(|&c| u64::from(c)).sum();
        if total == 0 {
            return TerminalMs::default();
        }
        let at = |q: f64| {
            let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
            let mut seen = 0u64;
            for (ms, &c) in self.counts.iter().enumerate() {
                seen += u64::from(c);
                if seen >= rank {
                    return ms as f64;
                }
            }
            self.max_ms
        };
        TerminalMs { p50: at(0.50), p99: at(0.99), max: (self.max_ms * 10.0).round() / 10.0 }
    }
}

/// Whether a series stayed flat after the warm-up: the post-warm-up samples cut in thirds by
/// time, the last third's maximum against the first third's.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Flatness {
    pub first_third_max: u64,
    pub last_third_max: u64,
    /// `last_third_max − first_third_max` (negative: it went down).
    pub growth: i64,
    pub bound: u64,
    pub flat: bool,
    /// Post-warm-up samples the verdict read (at least 3 are needed).
    pub samples: usize,
}

impl Flatness {
    /// Judges `values` (post-warm-up, in time order) against a bound computed from the first
    /// third's maximum.
    pub fn of(values: &[u64], bound: impl Fn(u64) -> u64) -> Self {
        let n = values.len();
        if n < 3 {
            return Self { samples: n, ..Self::default() };
        }
        let third = n / 3;
        let first = values[..third].iter().copied().max().unwrap_or(0);
        let last = values[n - third..].iter().copied().max().unwrap_or(0);
        let bound = bound(first);
        let growth = last as i64 - first as i64;
        Self { first_third_max: first, last_third_max: last, growth, bound, flat: growth <= bound as i64, samples: n }
    }
}

/// RSS bound: max(16 MiB, 10 % of the first third's max). Pools, arenas and queues are at their
/// size after the warm-up at the run's concurrency; allocator fragmentation may still move by a
/// fraction of the heap. Over an hour the thirds are ~18 minutes apart, some 400,000 requests at
/// the measured rate: 16 MiB is a leak of ~40 bytes per request.
pub fn rss_bound(first_third_max: u64) -> u64 {
    (16 * 1024 * 1024u64).max(first_third_max / 10)
}

/// Open-fd bound: 8 descriptors per request in flight. The pools' sizes follow the peak number of
/// requests in flight, and faults move that peak (a delayed or stalled request keeps its
/// connections while the others go on): each request holds at most four connections at once —
/// client → proxy, proxy → P, proxy → D, D → P's side channel (its data connection is pooled per
/// peer) — and the cluster runs in this process, so each is counted at both ends. An hour's soak
/// fires some 10,000 faults: a descriptor leaked by one fault in forty would pass the bound.
pub fn fd_bound(concurrency: usize) -> u64 {
    8 * concurrency as u64
}

/// The whole soak.
#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    /// The duration asked for, and the wall time of the run (warm-up included), in s.
    pub duration_s: f64,
    pub wall_s: f64,
    pub warmup_s: f64,
    pub concurrency: usize,
    pub fault_rate: f64,
    pub seed: u64,
    pub policy: String,
    /// Spinning threads competing for the cores (`--starve`).
    pub starve: usize,
    /// Prompt lengths drawn from, in tokens.
    pub prompt_tokens: (usize, usize),
    /// Requests sent after the warm-up, and how many were streamed.
    pub requests: u64,
    pub streamed: u64,
    /// Requests of the warm-up (un-faulted) and how many of them were not served correctly.
    pub warmup_requests: u64,
    pub warmup_bad: u64,
    /// `completed` / `recomputed` / `failed_clean` / `failed_unclean`.
    pub outcomes: BTreeMap<String, u64>,
    /// Every request sent has exactly one outcome.
    pub accounted: bool,
    pub incorrect: u64,
    pub unclean: u64,
    /// Terminal after the terminal deadline (still before the client's).
    pub late: u64,
    pub terminal_deadline_ms: f64,
    pub terminal_ms: TerminalMs,
    pub requests_per_s: f64,
    pub rounds: u64,
    pub faults_planned: u64,
    pub faults_fired: u64,
    pub faults_hit: u64,
    /// Fired faults by kind (`kill`, `drop`, `corrupt`, `delay`).
    pub fired_by_kind: BTreeMap<String, u64>,
    /// Clean failures of requests with no fault of their own, and the bound (per round: faults
    /// fired × concurrency).
    pub collateral_failures: u64,
    pub collateral_bound: u64,
    pub leaked_blocks: BTreeMap<String, usize>,
    pub stuck_requests: BTreeMap<String, usize>,
    pub tracked_transfers: BTreeMap<String, usize>,
    pub serving_after: bool,
    pub rss: Flatness,
    pub fds: Flatness,
    /// The process sampled: the chaos process, which hosts the whole cluster.
    pub process: String,
    pub sample_every_s: f64,
    pub samples: Vec<Sample>,
    pub bad: Vec<BadRequest>,
    pub failed_samples: Vec<BadRequest>,
    pub passed: bool,
    pub problems: Vec<String>,
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// The table printed under a soak.
pub fn render(r: &SoakReport) -> String {
    let mut s = String::new();
    let o = |k: &str| r.outcomes.get(k).copied().unwrap_or(0);
    let _ = writeln!(
        s,
        "soak: {:.0} s ({:.0} s warm-up) at concurrency {}, fault rate {}, policy {}, {} spinning threads",
        r.wall_s, r.warmup_s, r.concurrency, r.fault_rate, r.policy, r.starve
    );
    let rows: Vec<(&str, String)> = vec![
        ("requests (streamed)", format!("{} ({})", r.requests, r.streamed)),
        (
            "completed / recomputed / failed cleanly",
            format!("{} / {} / {}", o("completed"), o("recomputed"), o("failed_clean")),
        ),
        ("wrong / unclean", format!("{} / {}", r.incorrect, r.unclean)),
        ("accounted for", format!("{}", r.accounted)),
        ("faults planned / fired / hit", format!("{} / {} / {}", r.faults_planned, r.faults_fired, r.faults_hit)),
        ("fired by kind", format!("{:?}", r.fired_by_kind)),
        ("collateral failures (bound)", format!("{} ({})", r.collateral_failures, r.collateral_bound)),
        ("blocks held at the end", format!("{:?}", r.leaked_blocks)),
        ("requests / transfers still tracked", format!("{:?} / {:?}", r.stuck_requests, r.tracked_transfers)),
        ("serving through every P and D after", format!("{}", r.serving_after)),
        (
            "RSS max, first → last third (bound)",
            format!(
                "{:.1} → {:.1} MiB, {:+.1} MiB ({:.1}): {}",
                mib(r.rss.first_third_max),
                mib(r.rss.last_third_max),
                r.rss.growth as f64 / (1024.0 * 1024.0),
                mib(r.rss.bound),
                if r.rss.flat { "flat" } else { "GROWING" }
            ),
        ),
        (
            "open fds max, first → last third (bound)",
            format!(
                "{} → {}, {:+} ({}): {}",
                r.fds.first_third_max,
                r.fds.last_third_max,
                r.fds.growth,
                r.fds.bound,
                if r.fds.flat { "flat" } else { "GROWING" }
            ),
        ),
        (
            "time to terminal p50 / p99 / max",
            format!("{} / {} / {} ms (late: {})", r.terminal_ms.p50, r.terminal_ms.p99, r.terminal_ms.max, r.late),
        ),
        ("req/s", format!("{}", r.requests_per_s)),
    ];
    for (k, v) in rows {
        let _ = writeln!(s, "  {k:<42} {v}");
    }
    let _ = writeln!(s, "verdict: {}", if r.passed { "PASS" } else { "FAIL" });
    for p in &r.problems {
        let _ = writeln!(s, "  problem: {p}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flatness_compares_the_last_third_with_the_first() {
        let mib = 1024 * 1024;
        let flat = Flatness::of(&[100 * mib, 110 * mib, 105 * mib, 108 * mib, 112 * mib, 109 * mib], rss_bound);
        assert!(flat.flat && flat.growth == 2 * mib as i64, "{flat:?}");
        let growing = Flatness::of(&[100 * mib, 100 * mib, 150 * mib, 200 * mib, 260 * mib, 300 * mib], rss_bound);
        assert!(!growing.flat);
        assert!(!Flatness::of(&[1, 2], rss_bound).flat, "too few samples is no verdict");
        let mut h = Histogram::default();
        for ms in [1.0, 2.0, 3.0, 4.0, 5000.4] {
            h.add(ms);
        }
        let t = h.summary();
        assert_eq!((t.p50, t.p99, t.max), (3.0, 5000.0, 5000.4));
    }
}
