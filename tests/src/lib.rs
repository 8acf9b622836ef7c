//! pdflow-tests — the harness for cross-crate integration and end-to-end tests.
//!
//! [`Cluster`] starts, in this process, P engines (each launching its own bootstrap, as P's TP0
//! does), D engines and the proxy, all on 127.0.0.1 port 0, and talks to them over real HTTP.
//! [`processes`] does the same with separate `pdflow` processes. [`reference_tokens`] runs a
//! request on one engine alone — the output every P/D run must equal. [`vllm_front`] puts vLLM's
//! own proxies in front of `pdflow serve` processes.

pub mod otlp;
pub mod processes;
pub mod vllm_front;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use pdflow_actors::proxy::{PrefillTarget, ProxyArgs};
use pdflow_actors::scheduler_connector::KvRole;
use pdflow_auth::PeerFilter;
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_node::config::Deadlines;
use pdflow_node::ProxyNode;
use pdflow_sim_engine::{api, Engine, EngineConfig, LoadFailurePolicy};
use pdflow_sim_node::engine_node::{serve_http, BootstrapPlacement};
use pdflow_sim_node::{EngineNode, EngineNodeConfig};
use pdflow_transfer::same_host::SameHostMode;
use pdflow_transfer::tcp::TcpConfig;
use serde_json::{json, Value};

/// A small model shape for fast tests: 4 layers, 2 KV heads, head_dim 16, block 16 (8 KiB per block).
pub const SMALL: KvShape = KvShape { num_layers: 4, num_kv_heads: 2, head_dim: 16, dtype_bytes: 2, block_size: 16 };

/// One engine's settings in a test cluster.
#[derive(Debug, Clone)]
pub struct EngineOpts {
    pub num_blocks: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    pub policy: LoadFailurePolicy,
    /// The engine's cluster secret, as a secret file holds it (none: its sockets authenticate
    /// nothing).
    pub secret: Option<String>,
    /// TLS on the data channel (needs `secret`).
    pub tls: bool,
    /// Only the tcp backend: the KV crosses a socket even between engines of one process.
    pub tcp_only: bool,
    /// P writes the KV layer by layer while it prefills (`--layerwise on`).
    pub layerwise: bool,
    /// More `pdflow serve` flags (clusters of processes only), e.g. `--transport rdma`.
    pub extra_args: Vec<String>,
}

impl Default for EngineOpts {
    fn default() -> Self {
        // `Fail`, not vLLM's default `Recompute`: a test must see a failed transfer, not have it
        // masked by a local prefill that yields the same tokens.
        Self {
            num_blocks: 512,
            max_num_batched_tokens: 8192,
            max_model_len: 4096,
            policy: LoadFailurePolicy::Fail,
            secret: None,
            tls: false,
            tcp_only: false,
            layerwise: false,
            extra_args: Vec::new(),
        }
    }
}

impl EngineOpts {
    /// The engine's cluster secret, parsed.
    pub fn cluster_secret(&self) -> Option<pdflow_auth::ClusterSecret> {
        let text = self.secret.as_deref()?;
        match pdflow_auth::ClusterSecret::from_text(text) {
            Ok(secret) => Some(secret),
            Err(e) => panic!("a test cluster's secret is not a valid one: {e}"),
        }
    }
}

/// What a test cluster runs.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    pub shape: KvShape,
    pub prefill: Vec<EngineOpts>,
    pub decode: Vec<EngineOpts>,
    pub deadlines: Deadlines,
    pub verify_checksums: bool,
}

impl ClusterSpec {
    /// 1P1D with the small shape.
    pub fn one_p_one_d() -> Self {
        Self {
            shape: SMALL,
            prefill: vec![EngineOpts::default()],
            decode: vec![EngineOpts::default()],
            deadlines: Deadlines::from_abort_timeout(Duration::from_secs(20)),
            verify_checksums: true,
        }
    }
}

/// How to reach one engine of a cluster.
#[derive(Debug, Clone)]
pub struct EngineEndpoint {
    pub url: String,
    pub engine_id: String,
    /// P: its bootstrap's URL.
    pub bootstrap_url: Option<String>,
    /// D: its data server's `host:port`.
    pub data_addr: Option<String>,
}

/// How to reach a cluster, however it runs (in this process or as separate processes): the
/// scenarios of `tests/*.rs` are written against this, so each runs both ways.
#[derive(Debug, Clone)]
pub struct Endpoints {
    pub client: reqwest::Client,
    pub proxy: String,
    pub prefill: Vec<EngineEndpoint>,
    pub decode: Vec<EngineEndpoint>,
}

impl Endpoints {
    /// POSTs `body` to the proxy's `path`.
    pub async fn post(&self, path: &str, body: &Value) -> anyhow::Result<(u16, Value)> {
        post(&self.client, &format!("{}{path}", self.proxy), body).await
    }

    /// An engine's `GET /pdflow/blocks`.
    pub async fn block_stats(&self, engine: &EngineEndpoint) -> anyhow::Result<Value> {
        Ok(self.client.get(format!("{}/pdflow/blocks", engine.url)).send().await?.error_for_status()?.json().await?)
    }

    /// Every engine is back to its baseline: all blocks free, no request held (bounded wait for
    /// delayed frees), read over HTTP as an operator would.
    pub async fn assert_blocks_at_baseline(&self) {
        for (name, engines) in [("P", &self.prefill), ("D", &self.decode)] {
            for (i, e) in engines.iter().enumerate() {
                let deadline = Instant::now() + Duration::from_secs(15);
                loop {
                    let s = self.block_stats(e).await.expect("GET /pdflow/blocks");
                    if s["free"] == s["total"] && s["requests"] == 0 {
                        break;
                    }
                    assert!(Instant::now() < deadline, "{name}{i} did not return to its baseline: {s}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }

    /// Requests each engine finished since it started.
    pub async fn finished(&self, engine: &EngineEndpoint) -> u64 {
        self.block_stats(engine).await.expect("GET /pdflow/blocks")["finished"].as_u64().unwrap_or(0)
    }
}

/// A running cluster, in this process.
pub struct Cluster {
    pub spec: ClusterSpec,
    pub prefill: Vec<EngineNode>,
    pub decode: Vec<EngineNode>,
    pub proxy: ProxyNode,
    pub client: reqwest::Client,
    pub endpoints: Endpoints,
}

pub fn engine_config(shape: KvShape, o: &EngineOpts, id: String) -> EngineConfig {
    EngineConfig {
        engine_id: id,
        shape,
        num_blocks: o.num_blocks,
        max_num_batched_tokens: o.max_num_batched_tokens,
        max_model_len: o.max_model_len,
        kv_load_failure_policy: o.policy,
        ..EngineConfig::default()
    }
}

/// An engine's data-plane settings in a test cluster.
pub fn tcp_config(o: &EngineOpts) -> TcpConfig {
    let same_host = if o.tcp_only { SameHostMode::Off } else { SameHostMode::Auto };
    let mut tcp = TcpConfig { secret: o.cluster_secret(), same_host, ..TcpConfig::default() };
    if let Err(e) = tcp.set_tls(o.tls) {
        panic!("a test cluster's engine options ask for TLS without what it needs: {e}");
    }
    tcp
}

pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().expect("reqwest client builds")
}

impl Cluster {
    pub async fn start(spec: ClusterSpec) -> anyhow::Result<Self> {
        let node = |role: KvRole, o: &EngineOpts, bootstrap: BootstrapPlacement, i: usize| EngineNodeConfig {
            role,
            host: "127.0.0.1".into(),
            port: 0,
            engine: engine_config(
                spec.shape,
                o,
                format!("{}-{i}-{}", if role == KvRole::Producer { "prefill" } else { "decode" }, uuid_like()),
            ),
            bootstrap,
            deadlines: spec.deadlines,
            tcp: tcp_config(o),
            verify_checksums: spec.verify_checksums,
            layerwise: o.layerwise && role == KvRole::Producer,
            kv_device: None,
            faults: pdflow_actors::fault_seam::no_faults(),
            parallel: Default::default(),
            dp_rank: 0,
            rank_processes: None,
        };
        let mut prefill = Vec::new();
        for (i, o) in spec.prefill.iter().enumerate() {
            prefill
                .push(EngineNode::start(node(KvRole::Producer, o, BootstrapPlacement::Launch { port: 0 }, i)).await?);
        }
        let mut decode = Vec::new();
        for (i, o) in spec.decode.iter().enumerate() {
            decode.push(EngineNode::start(node(KvRole::Consumer, o, BootstrapPlacement::None, i)).await?);
        }
        let proxy = ProxyNode::start(ProxyArgs {
            health_interval: Duration::from_millis(25),
            upstream_timeout: Duration::from_secs(60),
            // The proxy's look-ups are signed with P's secret (a deployment gives all one).
            secret: spec.prefill.first().and_then(EngineOpts::cluster_secret),
            ..ProxyArgs::new(
                SocketAddr::from(([127, 0, 0, 1], 0)),
                prefill
                    .iter()
                    .map(|p| PrefillTarget {
                        url: p.url(),
                        bootstrap_port: p.launched_bootstrap_addr().map(|a| a.port()).unwrap_or(0),
                    })
                    .collect(),
                decode.iter().map(|d| d.url()).collect(),
            )
        })
        .await?;
        let endpoint = |n: &EngineNode| EngineEndpoint {
            url: n.url(),
            engine_id: n.engine_id.clone(),
            bootstrap_url: n.launched_bootstrap_url(),
            data_addr: n.data_addr().map(|a| a.to_string()),
        };
        let client = http_client();
        let endpoints = Endpoints {
            client: client.clone(),
            proxy: proxy.url(),
            prefill: prefill.iter().map(endpoint).collect(),
            decode: decode.iter().map(endpoint).collect(),
        };
        let cluster = Self { spec, prefill, decode, proxy, client, endpoints };
        wait_healthy(&cluster.client, &cluster.proxy.url(), Duration::from_secs(20)).await?;
        Ok(cluster)
    }

    /// POSTs `body` to the proxy's `path`; returns the status and the body as JSON (or as a string).
    pub async fn post(&self, path: &str, body: &Value) -> anyhow::Result<(u16, Value)> {
        post(&self.client, &format!("{}{path}", self.proxy.url()), body).await
    }

    /// Every engine is back to its baseline free-block count (bounded wait for delayed frees).
    pub async fn assert_blocks_at_baseline(&self) {
        self.endpoints.assert_blocks_at_baseline().await
    }

    pub async fn shutdown(self) {
        self.proxy.shutdown().await;
        for n in self.prefill.into_iter().chain(self.decode) {
            n.shutdown().await;
        }
    }
}

/// A short random-looking id.
pub fn uuid_like() -> String {
    format!(
        "{:08x}",
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0)
    )
}

pub async fn post(client: &reqwest::Client, url: &str, body: &Value) -> anyhow::Result<(u16, Value)> {
    let resp = client.post(url).json(body).send().await.with_context(|| format!("POST {url}"))?;
    let status = resp.status().as_u16();
    let text = resp.text().await.with_context(|| format!("body of POST {url}"))?;
    Ok((status, serde_json::from_str(&text).unwrap_or(Value::String(text))))
}

pub async fn wait_healthy(client: &reqwest::Client, url: &str, deadline: Duration) -> anyhow::Result<()> {
    let until = Instant::now() + deadline;
    loop {
        if let Ok(r) = client.get(format!("{url}/health")).send().await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        if Instant::now() > until {
            bail!("{url}/health not 200 within {deadline:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A deterministic prompt of `n` words (= tokens for the simulated tokenizer).
pub use pdflow_tools::demo::prompt_words as prompt;

/// A completion request body.
pub fn completion(prompt: &str, max_tokens: usize) -> Value {
    json!({"model": "Qwen/Qwen3-8B", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

/// The token ids of a non-streaming completion.
pub fn token_ids(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"].as_array().map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default()
}

/// The same request on one engine alone (no connector): the reference every P/D run must equal.
pub async fn reference(shape: KvShape, body: &Value) -> anyhow::Result<Value> {
    reference_of(engine_config(shape, &EngineOpts::default(), "reference".into()), body).await
}

/// [`reference`] on an engine of `cfg` (a hybrid model's, say).
pub async fn reference_of(cfg: EngineConfig, body: &Value) -> anyhow::Result<Value> {
    let engine = Engine::start(cfg.clone(), KvCache::new(cfg.shape, cfg.num_blocks), None);
    let (addr, stop, task) = serve_http("127.0.0.1", 0, api::router(engine.clone()), PeerFilter::LoopbackOnly).await?;
    let result = post(&http_client(), &format!("http://{addr}/v1/completions"), body).await;
    pdflow_sim_node::engine_node::stop_http(stop, task).await;
    engine.shutdown().await;
    let (status, v) = result?;
    anyhow::ensure!(status == 200, "reference run failed: {status} {v}");
    Ok(v)
}

/// The reference's token ids.
pub async fn reference_tokens(shape: KvShape, body: &Value) -> Vec<u64> {
    token_ids(&reference(shape, body).await.expect("reference run"))
}

/// The bodies the proxy would send (seed steps 9–10), for tests that drive P and D directly.
pub mod direct {
    use serde_json::{json, Value};

    /// P's body: max_tokens 1, not streaming, do_remote_decode.
    pub fn prefill_body(prompt: &str, transfer_id: &str) -> Value {
        json!({"model": "Qwen/Qwen3-8B", "prompt": prompt, "max_tokens": 1, "stream": false, "temperature": 0,
               "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": transfer_id}})
    }

    /// D's body: do_remote_prefill with P's bootstrap and engine id.
    pub fn decode_body(
        prompt: &str,
        max_tokens: usize,
        transfer_id: &str,
        bootstrap_url: &str,
        engine_id: &str,
    ) -> Value {
        json!({"model": "Qwen/Qwen3-8B", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
               "kv_transfer_params": {"do_remote_decode": false, "do_remote_prefill": true, "transfer_id": transfer_id,
                                      "remote_bootstrap_addr": bootstrap_url, "remote_engine_id": engine_id}})
    }
}

/// Installs a span capture as this test binary's global subscriber (once) and returns it.
pub fn capture() -> pdflow_observability::capture::SpanCapture {
    use std::sync::OnceLock;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    static CAPTURE: OnceLock<pdflow_observability::capture::SpanCapture> = OnceLock::new();
    CAPTURE
        .get_or_init(|| {
            let c = pdflow_observability::capture::SpanCapture::new();
            // PDFLOW_TEST_LOG=<filter> also prints logs (e.g. `pdflow_actors=debug`).
            let fmt = std::env::var("PDFLOW_TEST_LOG").ok().map(|f| {
                tracing_subscriber::fmt::layer().with_test_writer().with_filter(tracing_subscriber::EnvFilter::new(f))
            });
            let _ = tracing_subscriber::registry().with(c.clone()).with(fmt).try_init();
            c
        })
        .clone()
}

/// Waits (bounded) until a span of `step` whose `pd.transfer_id` is `transfer_id` exists
/// (`closed`: and has ended).
pub async fn wait_for_step(
    capture: &pdflow_observability::capture::SpanCapture,
    step: u8,
    transfer_id: &str,
    closed: bool,
) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let seen = capture.spans().iter().any(|s| {
            s.step == step
                && s.attr(pdflow_observability::attrs::TRANSFER_ID) == Some(transfer_id)
                && (!closed || s.end.is_some())
        });
        if seen {
            return;
        }
        assert!(Instant::now() < deadline, "step {step} for {transfer_id} not observed within 15 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
