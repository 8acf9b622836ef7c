//! `pdflow bench e2e`: the seed request through proxy, P and D (in this process, real sockets).
//!
//! TTFT is measured at the client (a streaming request; the first event that carries a token) and
//! split as the seed splits it, from the step spans of each request: proxy (8 → 9/10 dispatch),
//! P prefill (11–15), P next step (23–27), transfer (28–30), D notice (34–37), D first forward
//! (38–39); the connector's own overhead is what remains of TTFT after P's prefill, the transfer
//! and D's first forward. The first request to a new P (bootstrap look-up, side-channel connect)
//! is reported apart. Then requests/s for small prompts at several concurrencies.
//!
//! `--layerwise both` runs two clusters, P writing the KV after the prefill and P writing it layer
//! by layer, the seed requests alternating between them, and adds the write's span (29) and the
//! part of it that ran before P's prefill forward (15) ended: the transfer hidden under the prefill.

use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use pdflow_kv::memory::KvShape;
use pdflow_observability::capture::{CapturedSpan, SpanCapture};
use serde_json::json;

use super::report::{self, quantile, Row};
use crate::demo::{prompt_words, DemoOptions, LocalCluster};

/// Options of `pdflow bench e2e`.
#[derive(Debug, Clone, clap::Args)]
pub struct Options {
    /// Write the rows as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Seed requests measured (after the first, reported apart).
    #[arg(long, default_value_t = 20)]
    pub runs: usize,
    /// Small-prompt requests per concurrency level.
    #[arg(long, default_value_t = 256)]
    pub small_requests: usize,
    /// Concurrency levels for the small-prompt throughput.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    pub concurrency: Vec<usize>,
    /// P writes the KV after the prefill (`off`), layer by layer while it computes (`on`), or
    /// both, in two clusters measured alternately in one run (`both`).
    #[arg(long, value_enum, default_value_t = Layerwise::Off)]
    pub layerwise: Layerwise,
    /// Run P and D as separate processes in two network namespaces whose P↔D link is shaped to
    /// this many Gbit/s (`tc`; needs root), as a cluster without RDMA; the TTFT split then comes
    /// from P's /metrics (steps 15 and 29).
    #[arg(long, value_name = "GBIT_S")]
    pub link_gbps: Option<f64>,
    /// With `--link-gbps`: P's forward pinned to CPU N (`pdflow serve --forward-cpu`), apart from
    /// everything else, which runs where the bench was started (`taskset -c 1 pdflow bench e2e …
    /// --p-forward-cpu 0`): P's forward then has a core to itself, as on a GPU host.
    #[arg(long, value_name = "N", requires = "link_gbps")]
    pub p_forward_cpu: Option<usize>,
}

/// `--layerwise` of the e2e bench.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Layerwise {
    Off,
    On,
    Both,
}

impl Layerwise {
    pub(crate) fn modes(self) -> &'static [bool] {
        match self {
            Layerwise::Off => &[false],
            Layerwise::On => &[true],
            Layerwise::Both => &[false, true],
        }
    }
}

/// One seed request's figures, in ms.
#[derive(Debug, Clone, Default)]
struct Split {
    ttft: f64,
    proxy: f64,
    p_prefill: f64,
    p_next_step: f64,
    transfer: f64,
    d_notice: f64,
    d_first_forward: f64,
    /// Step 29: from the first byte written to the last.
    write: f64,
    /// The part of step 29 before P's prefill forward (15) ended.
    overlapped: f64,
}

fn first(spans: &[CapturedSpan], step: u8, after: Instant) -> Option<&CapturedSpan> {
    spans.iter().filter(|s| s.step == step && s.start >= after).min_by_key(|s| s.start)
}

fn between(spans: &[CapturedSpan], from: u8, to: u8, after: Instant) -> Option<f64> {
    let a = first(spans, from, after)?.start;
    let b = first(spans, to, after)?.end?;
    Some(b.saturating_duration_since(a).as_secs_f64() * 1e3)
}

/// Sends one streaming request; returns the time to the first token event.
pub(crate) async fn ttft(client: &reqwest::Client, url: &str, body: &serde_json::Value) -> anyhow::Result<f64> {
    let started = Instant::now();
    let resp = client.post(url).json(body).send().await.with_context(|| format!("POST {url}"))?;
    anyhow::ensure!(resp.status().is_success(), "POST {url}: {}", resp.status());
    let mut stream = resp.bytes_stream();
    let mut first = None;
    let mut seen = String::new();
    while let Some(chunk) = stream.next().await {
        seen.push_str(&String::from_utf8_lossy(&chunk?));
        if first.is_none() && seen.contains("\"token_ids\"") {
            first = Some(started.elapsed().as_secs_f64() * 1e3);
        }
    }
    first.context("the stream carried no token")
}

async fn seed_split(cluster: &LocalCluster, capture: &SpanCapture, seed: u64) -> anyhow::Result<Split> {
    let body = json!({"model": "Qwen/Qwen3-8B", "prompt": prompt_words(1000, seed), "max_tokens": 8, "temperature": 0, "stream": true});
    capture.clear();
    let start = Instant::now();
    let ttft = ttft(&cluster.client, &format!("{}/v1/completions", cluster.proxy.url()), &body).await?;
    // P's spans (up to 33) may still close after D has answered: wait for them, bounded.
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until && !capture.spans().iter().any(|s| s.step == 33 && s.end.is_some()) {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let spans = capture.spans();
    let (write, overlapped) = write_overlap(&spans, start);
    let dispatch = first(&spans, 9, start).zip(first(&spans, 10, start)).map(|(a, b)| a.start.min(b.start));
    Ok(Split {
        ttft,
        proxy: first(&spans, 8, start)
            .zip(dispatch)
            .map(|(a, d)| d.saturating_duration_since(a.start).as_secs_f64() * 1e3)
            .unwrap_or(f64::NAN),
        p_prefill: between(&spans, 11, 15, start).unwrap_or(f64::NAN),
        p_next_step: between(&spans, 23, 27, start).unwrap_or(f64::NAN),
        transfer: between(&spans, 28, 30, start).unwrap_or(f64::NAN),
        d_notice: between(&spans, 34, 37, start).unwrap_or(f64::NAN),
        d_first_forward: between(&spans, 38, 39, start).unwrap_or(f64::NAN),
        write,
        overlapped,
    })
}

/// Step 29's length and the part of it before step 15 ended (ms; NaN when a span is missing).
fn write_overlap(spans: &[CapturedSpan], after: Instant) -> (f64, f64) {
    let (Some(write), Some(prefill)) = (first(spans, 29, after), first(spans, 15, after)) else {
        return (f64::NAN, f64::NAN);
    };
    let (Some(write_end), Some(prefill_end)) = (write.end, prefill.end) else { return (f64::NAN, f64::NAN) };
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let hidden = prefill_end.min(write_end).saturating_duration_since(write.start);
    (ms(write_end.saturating_duration_since(write.start)), ms(hidden))
}

/// Small prompts from `concurrency` clients; returns per-request latencies and the wall time.
async fn small_load(cluster: &LocalCluster, total: usize, concurrency: usize) -> anyhow::Result<(Vec<f64>, Duration)> {
    let url = format!("{}/v1/completions", cluster.proxy.url());
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let (client, url, next) = (cluster.client.clone(), url.clone(), next.clone());
        tasks.spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= total {
                    return Ok::<_, anyhow::Error>(latencies);
                }
                let body = json!({"model": "Qwen/Qwen3-8B", "prompt": prompt_words(128, 10_000 + i as u64), "max_tokens": 4, "temperature": 0});
                let t = Instant::now();
                let resp = client.post(&url).json(&body).send().await?;
                anyhow::ensure!(resp.status().is_success(), "small request {i}: {}", resp.status());
                resp.bytes().await?;
                latencies.push(t.elapsed().as_secs_f64() * 1e3);
            }
        });
    }
    let mut all = Vec::new();
    while let Some(j) = tasks.join_next().await {
        all.extend(j.context("load task panicked")??);
    }
    Ok((all, started.elapsed()))
}

/// A labelled part of the TTFT split.
type Part = (&'static str, fn(&Split) -> f64);

fn split_rows(name: &str, splits: &[Split]) -> Vec<Row> {
    let col = |f: fn(&Split) -> f64| splits.iter().map(f).filter(|v| v.is_finite()).collect::<Vec<_>>();
    let overhead = |s: &Split| s.ttft - s.p_prefill - s.transfer - s.d_first_forward;
    let parts: [Part; 10] = [
        ("TTFT (client, streaming)", |s| s.ttft),
        ("  proxy (8→9/10)", |s| s.proxy),
        ("  P prefill (11–15)", |s| s.p_prefill),
        ("  P next step (23–27)", |s| s.p_next_step),
        ("  transfer (28–30)", |s| s.transfer),
        ("  D notice (34–37)", |s| s.d_notice),
        ("  D first forward (38–39)", |s| s.d_first_forward),
        ("  connector overhead", overhead),
        ("  P write (29)", |s| s.write),
        ("  write under the prefill (29 ∩ 15)", |s| s.overlapped),
    ];
    parts
        .iter()
        .map(|(label, f)| {
            report::row(&format!("{name}: {label}"), Some("auto"), None, Some(1), Some(148_635_648), &col(*f))
        })
        .map(|mut r| {
            r.gbps = None;
            r
        })
        .collect()
}

/// Runs the benchmark; prints the table; writes the JSON. `capture` must be a `tracing` layer.
pub async fn run(opts: Options, capture: SpanCapture) -> anyhow::Result<()> {
    if let Some(gbps) = opts.link_gbps {
        #[cfg(feature = "fault-injection")]
        return super::e2e_link::run(&opts, gbps).await;
        #[cfg(not(feature = "fault-injection"))]
        anyhow::bail!(
            "--link-gbps {gbps}: the shaped link runs on the chaos tools' network cluster, which this pdflow \
             was built without (build it with `--features pdflow/fault-injection`)"
        );
    }
    let max_conc = opts.concurrency.iter().copied().max().unwrap_or(1);
    // Enough blocks for the seed request, and for every small request in flight at once.
    let num_blocks = 80.max(max_conc * 10 + 8);
    let modes = opts.layerwise.modes();
    let mut clusters = Vec::new();
    for &layerwise in modes {
        let demo = DemoOptions { shape: KvShape::QWEN3_8B, num_blocks, layerwise, ..DemoOptions::default() };
        clusters.push((layerwise, LocalCluster::start(&demo, false).await?));
    }
    let label = |layerwise: bool| match (modes.len(), layerwise) {
        (1, _) => String::new(),
        (_, true) => ", layer-wise on".to_string(),
        (_, false) => ", layer-wise off".to_string(),
    };
    let mut rows = Vec::new();
    for (layerwise, cluster) in &clusters {
        let first_split = seed_split(cluster, &capture, 1).await?;
        rows.extend(split_rows(
            &format!("seed{}, first to a new P", label(*layerwise)),
            std::slice::from_ref(&first_split),
        ));
    }
    // The modes alternate request by request: the machine's noise falls on both alike.
    let mut splits: Vec<Vec<Split>> = vec![Vec::new(); clusters.len()];
    for i in 0..opts.runs {
        for (k, (_, cluster)) in clusters.iter().enumerate() {
            splits[k].push(seed_split(cluster, &capture, 2 + i as u64).await?);
        }
    }
    for ((layerwise, _), splits) in clusters.iter().zip(&splits) {
        rows.extend(split_rows(&format!("seed{}, median of {}", label(*layerwise), opts.runs), splits));
    }
    if let [off, on] = &splits[..] {
        print_comparison(off, on);
    }
    for (layerwise, cluster) in &clusters {
        for &c in &opts.concurrency {
            let (samples, wall) = small_load(cluster, opts.small_requests, c).await?;
            let name = format!("128-token prompts, max_tokens 4{}", label(*layerwise));
            let mut r = report::row(&name, Some("auto"), None, Some(c as u32), None, &samples);
            r.p99_ms = quantile(&samples, 0.99);
            r.requests_per_s = Some(samples.len() as f64 / wall.as_secs_f64());
            rows.push(r);
        }
    }
    let mut leaked = Vec::new();
    for (layerwise, cluster) in clusters {
        let (p, d) = cluster.shutdown().await;
        if p.free != p.total || d.free != d.total {
            leaked
                .push(format!("layer-wise {layerwise}: P {}/{} free, D {}/{} free", p.free, p.total, d.free, d.total));
        }
    }
    println!("{}", report::render(&rows));
    for l in leaked {
        println!("WARNING: blocks still held after the bench: {l}");
    }
    if let Some(path) = &opts.json {
        report::write_json(path, &rows).with_context(|| format!("writing {}", path.display()))?;
        println!("rows written to {}", path.display());
    }
    Ok(())
}

/// Layer-wise against not, from the same run's medians: what TTFT saved of the whole-request
/// transfer, and what the prefill step cost.
fn print_comparison(off: &[Split], on: &[Split]) {
    let median = |v: &[Split], f: fn(&Split) -> f64| {
        let xs: Vec<f64> = v.iter().map(f).filter(|x| x.is_finite()).collect();
        quantile(&xs, 0.5).unwrap_or(f64::NAN)
    };
    let (ttft_off, ttft_on) = (median(off, |s| s.ttft), median(on, |s| s.ttft));
    let (prefill_off, prefill_on) = (median(off, |s| s.p_prefill), median(on, |s| s.p_prefill));
    let transfer_off = median(off, |s| s.transfer);
    println!(
        "layer-wise: TTFT {ttft_on:.1} ms against {ttft_off:.1} ms ({:.2}×); TTFT saved {:.1} ms = {:.0}% of the \
         whole-request transfer ({transfer_off:.1} ms); P prefill {prefill_on:.1} ms against {prefill_off:.1} ms ({:+.1}%)",
        ttft_on / ttft_off,
        ttft_off - ttft_on,
        100.0 * (ttft_off - ttft_on) / transfer_off,
        100.0 * (prefill_on / prefill_off - 1.0),
    );
}
