//! The rows every benchmark reports, the table they print and the JSON they write.

use std::path::Path;

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

/// The table a benchmark prints.
pub fn render(rows: &[Row]) -> String {
    let f = |v: Option<f64>, p: usize| v.map(|v| format!("{v:.p$}")).unwrap_or_else(|| "-".into());
    let mut out = format!(
        "{:<50} {:<10} {:<14} {:>5} {:>12} {:>10} {:>10} {:>10} {:>7} {:>9} {:>9}\n",
        "name", "backend", "plan", "conc", "bytes", "median ms", "min ms", "max ms", "GB/s", "p99 ms", "req/s"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<50} {:<10} {:<14} {:>5} {:>12} {:>10} {:>10} {:>10} {:>7} {:>9} {:>9}\n",
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
        assert!(render(&[r]).contains("coalesced"));
    }
}
