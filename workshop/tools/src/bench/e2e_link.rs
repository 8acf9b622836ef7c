//! `pdflow bench e2e --link-gbps G`: the seed request over a link like a cluster's without RDMA.
//! P and D run as separate `pdflow serve` processes in two network namespaces, their P↔D link a
//! veth pair shaped with `tc` (`tbf`, a 1 ms burst) to G Gbit/s each way, the proxy in the root namespace
//! ([`crate::chaos::net::cluster`]). Needs root (network namespaces); says so otherwise.
//!
//! TTFT is measured at the client (streaming, as the in-process bench); P's prefill forward (step
//! 15) and its KV write (step 29) are P's own step durations, read from its `/metrics` before and
//! after each request. With `--layerwise both`, two such clusters run side by side and the seed
//! requests alternate between them, so the machine's noise falls on both alike.

use std::time::Duration;

use anyhow::Context;
use pdflow_observability::metrics::parse_histogram;
use serde_json::json;

use super::e2e::{ttft, Options};
use super::report::{self, quantile, Row};
use crate::chaos::net::cluster::{NetCluster, NetSpec, UPSTREAM_LONG_S};
use crate::demo::prompt_words;

/// One seed request's figures, in ms.
#[derive(Debug, Clone, Copy)]
struct Sample {
    ttft: f64,
    p_prefill: f64,
    p_write: f64,
}

/// P's total seconds and count of `step`'s spans so far.
async fn step_totals(cluster: &NetCluster, step: &str) -> anyhow::Result<(f64, u64)> {
    let url = format!("{}/metrics", cluster.p_url);
    let text = cluster.client.get(&url).timeout(Duration::from_secs(5)).send().await?.text().await?;
    let h = parse_histogram(&text, "pdflow_step_duration_seconds", &[("step", step)]).unwrap_or_default();
    Ok((h.sum, h.count))
}

async fn seed(cluster: &NetCluster, seed: u64) -> anyhow::Result<Sample> {
    let body = json!({"model": "Qwen/Qwen3-8B", "prompt": prompt_words(1000, seed), "max_tokens": 8, "temperature": 0, "stream": true});
    let (p0, w0) = (step_totals(cluster, "15").await?, step_totals(cluster, "29").await?);
    let ttft = ttft(&cluster.client, &format!("{}/v1/completions", cluster.proxy_url), &body).await?;
    // P's write span closes when D has the KV, which is before D's first token: P's counts are
    // final by now, but its /metrics may lag by a scrape; wait for them, bounded.
    let until = std::time::Instant::now() + Duration::from_secs(5);
    let (mut p1, mut w1) = (step_totals(cluster, "15").await?, step_totals(cluster, "29").await?);
    while (p1.1 == p0.1 || w1.1 == w0.1) && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(10)).await;
        (p1, w1) = (step_totals(cluster, "15").await?, step_totals(cluster, "29").await?);
    }
    let per = |(s1, c1): (f64, u64), (s0, c0): (f64, u64)| match c1.saturating_sub(c0) {
        0 => f64::NAN,
        n => (s1 - s0) * 1e3 / n as f64,
    };
    Ok(Sample { ttft, p_prefill: per(p1, p0), p_write: per(w1, w0) })
}

/// A labelled figure of a sample.
type Part = (&'static str, fn(&Sample) -> f64);

fn rows(name: &str, samples: &[Sample]) -> Vec<Row> {
    let col = |f: fn(&Sample) -> f64| samples.iter().map(f).filter(|v| v.is_finite()).collect::<Vec<_>>();
    let parts: [Part; 3] = [
        ("TTFT (client, streaming)", |s| s.ttft),
        ("  P prefill forward (15)", |s| s.p_prefill),
        ("  P write (29)", |s| s.p_write),
    ];
    parts
        .iter()
        .map(|(label, f)| {
            let mut r =
                report::row(&format!("{name}: {label}"), Some("tcp"), None, Some(1), Some(148_635_648), &col(*f));
            r.gbps = None;
            r
        })
        .collect()
}

/// Runs the shaped-link bench; prints the table; writes the JSON.
pub async fn run(opts: &Options, gbps: f64) -> anyhow::Result<()> {
    crate::netns::available().map_err(|reason| anyhow::anyhow!("--link-gbps needs network namespaces: {reason}"))?;
    anyhow::ensure!(gbps > 0.0 && gbps.is_finite(), "--link-gbps must be a positive number of Gbit/s, not {gbps}");
    let bin = std::env::current_exe().context("the pdflow binary (to start P and D)")?;
    let bytes_per_sec = (gbps * 1e9 / 8.0) as u64;
    let modes = opts.layerwise.modes();
    let mut clusters = Vec::new();
    for &layerwise in modes {
        let spec = NetSpec {
            policy: "fail",
            p_batch: 8192,
            upstream_s: UPSTREAM_LONG_S,
            layerwise,
            p_forward_cpu: opts.p_forward_cpu,
        };
        let cluster = NetCluster::start(&bin, spec).await.map_err(|e| anyhow::anyhow!("starting the cluster: {e}"))?;
        // A 1 ms burst: the link's rate holds from the first byte.
        cluster.topo.shape(cluster.pd, bytes_per_sec, bytes_per_sec / 1000).context("shaping the P↔D link")?;
        clusters.push((layerwise, cluster));
    }
    let label =
        |layerwise: bool| format!("seed over {gbps} Gbit/s, layer-wise {}", if layerwise { "on" } else { "off" });
    let mut rows_out = Vec::new();
    for (layerwise, cluster) in &clusters {
        let first = seed(cluster, 1).await?;
        rows_out.extend(rows(&format!("{}, first to a new P", label(*layerwise)), &[first]));
    }
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); clusters.len()];
    for i in 0..opts.runs {
        for (k, (_, cluster)) in clusters.iter().enumerate() {
            samples[k].push(seed(cluster, 2 + i as u64).await?);
        }
    }
    for ((layerwise, _), s) in clusters.iter().zip(&samples) {
        rows_out.extend(rows(&format!("{}, median of {}", label(*layerwise), opts.runs), s));
    }
    println!("{}", report::render(&rows_out));
    if let [off, on] = &samples[..] {
        let median = |v: &[Sample], f: fn(&Sample) -> f64| {
            quantile(&v.iter().map(f).filter(|x| x.is_finite()).collect::<Vec<_>>(), 0.5).unwrap_or(f64::NAN)
        };
        let (t_off, t_on) = (median(off, |s| s.ttft), median(on, |s| s.ttft));
        let (p_off, p_on) = (median(off, |s| s.p_prefill), median(on, |s| s.p_prefill));
        let w_off = median(off, |s| s.p_write);
        println!(
            "layer-wise over {gbps} Gbit/s: TTFT {t_on:.1} ms against {t_off:.1} ms ({:.2}×); TTFT saved {:.1} ms = {:.0}% \
             of the whole-request write ({w_off:.1} ms); P prefill forward {p_on:.1} ms against {p_off:.1} ms ({:+.1}%)",
            t_on / t_off,
            t_off - t_on,
            100.0 * (t_off - t_on) / w_off,
            100.0 * (p_on / p_off - 1.0),
        );
    }
    for (layerwise, cluster) in &clusters {
        if let Err((p, d)) = cluster.wait_baseline(Duration::from_secs(10)).await {
            println!("WARNING: layer-wise {layerwise}: blocks still held after the bench: P {p:?}, D {d:?}");
        }
    }
    if let Some(path) = &opts.json {
        report::write_json(path, &rows_out).with_context(|| format!("writing {}", path.display()))?;
        println!("rows written to {}", path.display());
    }
    Ok(())
}
