//! `pdflow bench proxy`: the proxy alone against fast stub upstreams that answer from memory.
//!
//! One stub serves P's API and P's bootstrap (`/health`, `/query`, `/v1/completions`), another
//! serves D's API. The same load — `concurrency` clients each sending small completions
//! back-to-back — goes once through the proxy and once straight to the D stub; the difference of
//! the two latency distributions is what the proxy adds. Rows: latency (median, min, max, p99) and
//! requests/s per target and concurrency, plus the added p50/p99.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::routing::{get, post};
use axum::{Json, Router};
use pdflow_actors::proxy::{PrefillTarget, ProxyArgs};
use pdflow_auth::PeerFilter;
use serde_json::{json, Value};

use super::report::{self, quantile, Row};
use pdflow_node::ProxyNode;
use pdflow_sim_node::engine_node::serve_http;

/// Options of `pdflow bench proxy`.
#[derive(Debug, Clone, clap::Args)]
pub struct Options {
    /// Write the rows as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Requests per (target, concurrency) measurement.
    #[arg(long, default_value_t = 3000)]
    pub requests: usize,
    /// Concurrency levels.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    pub concurrency: Vec<usize>,
    /// Requests sent first, not measured.
    #[arg(long, default_value_t = 300)]
    pub warmup: usize,
}

const ENGINE_ID: &str = "bench-prefill";

fn completion_body() -> Value {
    json!({"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "bench",
           "choices": [{"index": 0, "text": " w7", "token_ids": [7], "logprobs": null, "finish_reason": "length", "stop_reason": null}],
           "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}, "kv_transfer_params": null})
}

/// The P stub: API and bootstrap on one port.
fn prefill_stub() -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/query",
            get(|| async {
                Json(json!({"0": {"engine_id": ENGINE_ID, "worker_addr": {"0": {"0": "tcp://127.0.0.1:1"}}}}))
            }),
        )
        .route("/v1/completions", post(|| async { Json(completion_body()) }))
}

/// The D stub.
fn decode_stub() -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/completions", post(|| async { Json(completion_body()) }))
}

/// Sends `total` requests from `concurrency` clients; returns per-request latencies (ms) and the wall time.
async fn load(
    client: &reqwest::Client,
    url: &str,
    total: usize,
    concurrency: usize,
) -> anyhow::Result<(Vec<f64>, Duration)> {
    let body = json!({"model": "bench", "prompt": "w1 w2 w3 w4 w5 w6 w7 w8", "max_tokens": 1});
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let (client, url, body, next) = (client.clone(), url.to_string(), body.clone(), next.clone());
        tasks.spawn(async move {
            let mut latencies = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < total {
                let t = Instant::now();
                let resp = client.post(&url).json(&body).send().await.with_context(|| format!("POST {url}"))?;
                anyhow::ensure!(resp.status().is_success(), "POST {url}: {}", resp.status());
                resp.bytes().await?;
                latencies.push(t.elapsed().as_secs_f64() * 1e3);
            }
            Ok::<_, anyhow::Error>(latencies)
        });
    }
    let mut all = Vec::with_capacity(total);
    while let Some(joined) = tasks.join_next().await {
        all.extend(joined.context("load task panicked")??);
    }
    Ok((all, started.elapsed()))
}

fn latency_row(name: &str, concurrency: usize, samples: &[f64], wall: Duration) -> Row {
    let mut r = report::row(name, Some("http"), None, Some(concurrency as u32), None, samples);
    r.p99_ms = quantile(samples, 0.99);
    r.requests_per_s = Some(samples.len() as f64 / wall.as_secs_f64());
    r
}

/// Runs the benchmark; prints the table; writes the JSON.
pub async fn run(opts: Options) -> anyhow::Result<()> {
    let (p_addr, p_stop, p_task) = serve_http("127.0.0.1", 0, prefill_stub(), PeerFilter::LoopbackOnly).await?;
    let (d_addr, d_stop, d_task) = serve_http("127.0.0.1", 0, decode_stub(), PeerFilter::LoopbackOnly).await?;
    let proxy = ProxyNode::start(ProxyArgs {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        prefill: vec![PrefillTarget { url: format!("http://{p_addr}"), bootstrap_port: p_addr.port() }],
        decode: vec![format!("http://{d_addr}")],
        health_interval: Duration::from_millis(200),
        unhealthy_after: pdflow_actors::proxy::UNHEALTHY_AFTER,
        upstream_timeout: Duration::from_secs(30),
        ready_timeout: Some(Duration::from_secs(20)),
        secret: None,
        prefill_policy: Default::default(),
        decode_policy: Default::default(),
        local_prefill: Default::default(),
        kv_events: Vec::new(),
        roster: Default::default(),
        discover: Vec::new(),
    })
    .await?;
    let client = reqwest::Client::builder().no_proxy().pool_max_idle_per_host(256).build()?;
    crate::demo::wait_ready(&client, &proxy.url(), Duration::from_secs(20)).await?;
    let via_proxy = format!("{}/v1/completions", proxy.url());
    let direct = format!("http://{d_addr}/v1/completions");
    let mut rows = Vec::new();
    for &c in &opts.concurrency {
        load(&client, &via_proxy, opts.warmup, c).await?;
        load(&client, &direct, opts.warmup, c).await?;
        let (d_samples, d_wall) = load(&client, &direct, opts.requests, c).await?;
        let (p_samples, p_wall) = load(&client, &via_proxy, opts.requests, c).await?;
        let direct_row = latency_row("direct to stub", c, &d_samples, d_wall);
        let proxy_row = latency_row("via proxy", c, &p_samples, p_wall);
        let mut added = Row { name: "added by proxy (p50, p99)".into(), concurrency: Some(c as u32), ..Row::default() };
        added.median_ms = proxy_row.median_ms.zip(direct_row.median_ms).map(|(p, d)| p - d);
        added.p99_ms = proxy_row.p99_ms.zip(direct_row.p99_ms).map(|(p, d)| p - d);
        rows.extend([direct_row, proxy_row, added]);
    }
    println!("{}", report::render(&rows));
    if let Some(path) = &opts.json {
        report::write_json(path, &rows).with_context(|| format!("writing {}", path.display()))?;
        println!("rows written to {}", path.display());
    }
    proxy.shutdown().await;
    for (stop, task) in [(p_stop, p_task), (d_stop, d_task)] {
        pdflow_sim_node::engine_node::stop_http(stop, task).await;
    }
    Ok(())
}
