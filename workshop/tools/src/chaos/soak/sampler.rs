//! Memory and descriptors of the soak's processes, sampled every few seconds: resident set size,
//! open file descriptors and threads of each, read from `/proc`. The soak's cluster (proxy, two
//! P with their bootstraps, two D) runs in the chaos process, so that process is the one sampled.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio_util::sync::CancellationToken;

/// One reading of one process.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Sample {
    /// Seconds since the soak started.
    pub t_s: f64,
    pub rss_bytes: u64,
    pub fds: u64,
    pub threads: u64,
    /// Whether the warm-up was over when it was taken.
    pub after_warmup: bool,
}

/// This process now (zeros where `/proc` has no answer).
pub fn read_self(t_s: f64, after_warmup: bool) -> Sample {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
    Sample { t_s, rss_bytes: field("VmRSS:") * 1024, fds, threads: field("Threads:"), after_warmup }
}

/// The series so far, and whether the warm-up is over (set by the soak).
#[derive(Debug, Default)]
pub struct Series {
    pub samples: Vec<Sample>,
    pub after_warmup: bool,
}

/// Samples this process every `every` into `series` until `stop`; the series is allocated up front
/// for `expected` samples, so the sampler does not grow what it measures.
pub fn spawn(
    started: Instant,
    every: Duration,
    expected: usize,
    series: Arc<Mutex<Series>>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    series.lock().unwrap_or_else(|p| p.into_inner()).samples.reserve(expected);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            let mut s = series.lock().unwrap_or_else(|p| p.into_inner());
            let sample = read_self(started.elapsed().as_secs_f64(), s.after_warmup);
            s.samples.push(sample);
        }
    })
}
