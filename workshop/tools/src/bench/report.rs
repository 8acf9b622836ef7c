//! The rows every benchmark reports, the table they print and the JSON they write.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

/// One measured configuration.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Row {
    pub name: String,
    pub backend: Option<String>,
    pub plan: Option<String>,
    pub concurrency: Option<u32>,
    pub bytes: Option<u64>,
    pub median_ms: Option<f64>,
    pub min_ms: Option<f64>,
    pub max_ms: Option<f64>,
    pub gbps: Option<f64>,
    /// Latency benchmarks: the 99th percentile.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p99_ms: Option<f64>,
    /// Throughput benchmarks: completed requests per second.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requests_per_s: Option<f64>,
    /// CPU time the whole process (every thread: P's and D's when both run in it) used per
    /// measured run, median over the runs; where the bench measures it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_ms: Option<f64>,
}

impl Row {
    /// This row with the median of `cpu_ms` (per-run CPU times) as its CPU time.
    pub fn with_cpu(mut self, cpu_ms: &[f64]) -> Row {
        self.cpu_ms = summarize(cpu_ms).map(|s| s.0);
        self
    }
}

/// Wall-clock and process CPU time of one measured section.
#[derive(Debug, Clone, Copy)]
pub struct Stopwatch {
    wall: Instant,
    cpu: Option<Duration>,
}

/// What a [`Stopwatch`] measured: wall-clock time, and the CPU time of every thread of the
/// process over the same span (`None` where the OS does not tell).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub wall: Duration,
    pub cpu: Option<Duration>,
}

impl Stopwatch {
    pub fn start() -> Self {
        Self { cpu: process_cpu_time(), wall: Instant::now() }
    }

    pub fn stop(self) -> Sample {
        let wall = self.wall.elapsed();
        let cpu = match (self.cpu, process_cpu_time()) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a)),
            _ => None,
        };
        Sample { wall, cpu }
    }
}

/// Samples of measured runs, in milliseconds: wall-clock, and CPU where measured.
#[derive(Debug, Clone, Default)]
pub struct Samples {
    pub wall_ms: Vec<f64>,
    pub cpu_ms: Vec<f64>,
}

impl Samples {
    pub fn push(&mut self, s: Sample) {
        self.wall_ms.push(s.wall.as_secs_f64() * 1e3);
        if let Some(cpu) = s.cpu {
            self.cpu_ms.push(cpu.as_secs_f64() * 1e3);
        }
    }
}

impl FromIterator<Sample> for Samples {
    fn from_iter<I: IntoIterator<Item = Sample>>(iter: I) -> Self {
        let mut out = Samples::default();
        for s in iter {
            out.push(s);
        }
        out
    }
}

/// A row from [`Samples`]: [`row`] with the median CPU time per run.
pub fn row_cpu(
    name: &str,
    backend: Option<&str>,
    plan: Option<&str>,
    concurrency: Option<u32>,
    bytes: Option<u64>,
    samples: &Samples,
) -> Row {
    row(name, backend, plan, concurrency, bytes, &samples.wall_ms).with_cpu(&samples.cpu_ms)
}

/// The CPU time every thread of this process has used so far (user and system), with
/// nanosecond resolution: `CLOCK_PROCESS_CPUTIME_ID`. `None` where the clock cannot be read.
pub fn process_cpu_time() -> Option<Duration> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable `struct timespec`; clock_gettime writes only it.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    let secs = u64::try_from(ts.tv_sec).ok()?;
    let nanos = u32::try_from(ts.tv_nsec).ok()?;
    (rc == 0).then(|| Duration::new(secs, nanos))
}

/// Median, min and max of samples in milliseconds (`None` for no samples).
pub fn summarize(samples_ms: &[f64]) -> Option<(f64, f64, f64)> {
    if samples_ms.is_empty() {
        return None;
    }
    let mut s = samples_ms.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let median = if s.len() % 2 == 1 { s[s.len() / 2] } else { (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0 };
    Some((median, s[0], s[s.len() - 1]))
}

/// A row from samples; `gbps` from `bytes` and the median when both are known.
pub fn row(
    name: &str,
    backend: Option<&str>,
    plan: Option<&str>,
    concurrency: Option<u32>,
    bytes: Option<u64>,
    samples_ms: &[f64],
) -> Row {
    let stats = summarize(samples_ms);
    let median = stats.map(|s| s.0);
    Row {
        name: name.to_string(),
        backend: backend.map(str::to_string),
        plan: plan.map(str::to_string),
        concurrency,
        bytes,
        median_ms: median,
        min_ms: stats.map(|s| s.1),
        max_ms: stats.map(|s| s.2),
        gbps: match (bytes, median) {
            (Some(b), Some(m)) if m > 0.0 => Some(b as f64 * concurrency.unwrap_or(1) as f64 / (m / 1e3) / 1e9),
            _ => None,
        },
        p99_ms: None,
        requests_per_s: None,
        cpu_ms: None,
    }
}

/// The `q` quantile (0..=1) of samples, nearest rank.
pub fn quantile(samples_ms: &[f64], q: f64) -> Option<f64> {
    if samples_ms.is_empty() {
        return None;
    }
    let mut s = samples_ms.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let rank = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len());
    Some(s[rank - 1])
}

/// The table a benchmark prints (names padded to the longest); a `cpu ms` column when a row has
/// a CPU time.
pub fn render(rows: &[Row]) -> String {
    let f = |v: Option<f64>, p: usize| v.map(|v| format!("{v:.p$}")).unwrap_or_else(|| "-".into());
    let cpu = rows.iter().any(|r| r.cpu_ms.is_some());
    let w = rows.iter().map(|r| r.name.chars().count()).max().unwrap_or(0).max(50);
    let mut out = format!(
        "{:<w$} {:<10} {:<14} {:>5} {:>12} {:>10} {:>10} {:>10} {:>7} {:>9} {:>9}",
        "name", "backend", "plan", "conc", "bytes", "median ms", "min ms", "max ms", "GB/s", "p99 ms", "req/s"
    );
    if cpu {
        out.push_str(&format!(" {:>10}", "cpu ms"));
    }
    out.push('\n');
    for r in rows {
        out.push_str(&format!(
            "{:<w$} {:<10} {:<14} {:>5} {:>12} {:>10} {:>10} {:>10} {:>7} {:>9} {:>9}",
            r.name,
            r.backend.as_deref().unwrap_or("-"),
            r.plan.as_deref().unwrap_or("-"),
            r.concurrency.map(|c| c.to_string()).unwrap_or_else(|| "-".into()),
            r.bytes.map(|b| b.to_string()).unwrap_or_else(|| "-".into()),
            f(r.median_ms, 3),
            f(r.min_ms, 3),
            f(r.max_ms, 3),
            f(r.gbps, 2),
            f(r.p99_ms, 3),
            f(r.requests_per_s, 0),
        ));
        if cpu {
            out.push_str(&format!(" {:>10}", f(r.cpu_ms, 3)));
        }
        out.push('\n');
    }
    out
}

/// Writes `{"rows": [...]}`.
pub fn write_json(path: &Path, rows: &[Row]) -> std::io::Result<()> {
    let json = serde_json::to_string_pretty(&serde_json::json!({ "rows": rows })).map_err(std::io::Error::other)?;
    std::fs::write(path, json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_min_max_and_throughput() {
        assert_eq!(summarize(&[3.0, 1.0, 2.0]), Some((2.0, 1.0, 3.0)));
        assert_eq!(summarize(&[4.0, 1.0, 2.0, 3.0]), Some((2.5, 1.0, 4.0)));
        let r = row("x", Some("tcp"), Some("coalesced"), Some(1), Some(1_000_000_000), &[1000.0]);
        assert_eq!(r.gbps, Some(1.0));
        assert!(render(std::slice::from_ref(&r)).contains("coalesced"));
        assert!(!render(std::slice::from_ref(&r)).contains("cpu ms"), "no CPU column without CPU times");
        let r = r.with_cpu(&[2.0, 1.0, 3.0]);
        assert_eq!(r.cpu_ms, Some(2.0));
        assert!(render(&[r]).contains("cpu ms"));
    }

    #[test]
    fn a_stopwatch_counts_the_cpu_a_busy_thread_burns() {
        let watch = Stopwatch::start();
        let mut x = 0u64;
        while watch.wall.elapsed() < Duration::from_millis(20) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let s = watch.stop();
        if let Some(cpu) = s.cpu {
            assert!(cpu >= Duration::from_millis(10), "20 ms of spinning used {cpu:?} of CPU");
        }
        assert!(s.wall >= Duration::from_millis(20));
    }
}
