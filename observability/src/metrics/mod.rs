//! `/metrics`: the step spans as Prometheus metrics (text exposition format 0.0.4).
//!
//! [`MetricsLayer`] watches every step span (target `pdflow::step`) close and observes, into one
//! registry per process ([`global`]):
//! - `pdflow_step_duration_seconds{service,step,name}` — every step's latency;
//! - `pdflow_transfer_bytes`, `pdflow_transfer_duration_seconds`, `pdflow_transfer_descriptors`,
//!   `pdflow_transfer_blocks` `{service,side}` — step 29 on P (`side="p"`, failures included, unlike
//!   Mooncake which records successes only) and step 34 on D (`side="d"`: the duration runs from
//!   step 21's start to step 34; bytes are blocks × [`Metrics::set_block_bytes`] when set);
//! - `pdflow_failures_total{service,step,cause}` — step spans whose `pd.outcome` is not a success;
//! - `pdflow_transfer_writes_total{service,backend,outcome}` — P's step-29 writes by the transfer
//!   backend that carried them (`tcp`, `same-host`, `cuda-peer`, `cuda-ipc`);
//! - `pdflow_transfer_group_bytes_total{service,group}` — a hybrid model's step-29 bytes per
//!   KV-cache group (its index in vLLM's order);
//! - `pdflow_auth_refusals_total{socket,cause}` — peers refused for their proof of the cluster
//!   secret, or for their address in protected mode (`cause="not_loopback"`), by socket (`data`,
//!   `side_channel`, `bootstrap`, `proxy`, `engine`) and cause (a fixed set of labels);
//! - `pdflow_http_connections_closed_total{service,reason}` — connections an HTTP server closed on
//!   its own (`actors::http_serve`): over its connection caps (`server_full`, `peer_full`), no
//!   complete request header in time (`header_timeout`), a request body not in full in time
//!   (`body_timeout`, answered 408), kept alive idle too long (`idle_timeout`);
//!   `service` is the server's (`proxy`, `bootstrap`, `engine`);
//! - `pdflow_proxy_routes_total{pool,policy,choice}` and `pdflow_proxy_matched_chunks_total{pool}`
//!   — the proxy's routing decisions (`round_robin`, `least_loaded`, `cache_hit`) and the prompt
//!   chunks (or, `kv_aware`, KV blocks) its cache hits matched; `pdflow_proxy_prefill_retries_total`
//!   — requests retried on another P; `pdflow_proxy_kv_events_total{engine,outcome}` and
//!   `pdflow_proxy_kv_stream_total{engine,event}` — the engines' KV events ([`kv_events`]);
//! - `pdflow_pulls_in_flight{service,side}` — D: pulls sent (step 21) not yet settled (step 34);
//!   P: pulls received (step 22) not yet answered (step 30);
//! - gauges registered with [`Metrics::register_gauge`], read at scrape time, and per-endpoint
//!   gauges passed to [`Metrics::render_with`] (the engine's blocks held).
//!
//! `service` is the step's side in the catalogue (`proxy`, `prefill`, `decode`), so that in
//! `pdflow demo`, where every node shares one process, P's and D's series stay apart.

mod expo;
mod kv_events;
mod layer;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub use expo::{parse_histogram, ParsedHistogram};
pub use kv_events::KvStreamEvent;
pub use layer::MetricsLayer;

use crate::steps::{self, Side};
use expo::{Family, Histogram, Kind};

/// The `Content-Type` of a `/metrics` response.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Latency buckets, in seconds: 100 µs … 60 s.
pub const DURATION_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// Byte buckets: 1 KiB × 4ⁿ up to 16 GiB.
pub const BYTES_BUCKETS: &[f64] = &[
    1024.0,
    4096.0,
    16384.0,
    65536.0,
    262144.0,
    1048576.0,
    4194304.0,
    16777216.0,
    67108864.0,
    268435456.0,
    1073741824.0,
    4294967296.0,
    17179869184.0,
];
/// Count buckets (descriptors, blocks): 1, 2, 4 … 65536.
pub const COUNT_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0,
    65536.0,
];

/// Distinct failure causes kept per step before further ones are counted as `other`.
const MAX_CAUSES_PER_STEP: usize = 32;
/// A pull still pending after this long is forgotten (its end was never seen).
const PENDING_PULL_TTL: Duration = Duration::from_secs(600);

/// The service label of a side.
pub fn service_of(side: Side) -> &'static str {
    match side {
        Side::Proxy => "proxy",
        Side::P => "prefill",
        Side::D => "decode",
    }
}

pub use crate::outcome::is_success;

/// One sample of a gauge: its labels and value.
#[derive(Debug, Clone, PartialEq)]
pub struct GaugeSample {
    pub labels: Vec<(&'static str, String)>,
    pub value: f64,
}

/// A gauge family read at scrape time.
#[derive(Debug, Clone, PartialEq)]
pub struct Gauge {
    pub name: &'static str,
    pub help: &'static str,
    pub samples: Vec<GaugeSample>,
}

type GaugeFn = Arc<dyn Fn() -> Vec<GaugeSample> + Send + Sync>;

/// What one finished step span tells the metrics.
#[derive(Debug, Clone, Default)]
pub(crate) struct StepObservation {
    pub step: u8,
    pub start: Option<Instant>,
    pub duration: Duration,
    pub transfer_id: Option<String>,
    pub bytes: Option<u64>,
    pub descriptors: Option<u64>,
    pub blocks: Option<u64>,
    pub outcome: Option<String>,
    /// Step 29's transfer backend (`tcp`, `same-host`, `cuda-peer`, …).
    pub backend: Option<String>,
    /// Step 29 of a hybrid model: bytes per KV-cache group (`"a,b,c"`).
    pub group_bytes: Option<String>,
}

type StepKey = (&'static str, u8);
type SideKey = (&'static str, &'static str);

#[derive(Default)]
struct State {
    steps: BTreeMap<StepKey, Histogram>,
    transfer_bytes: BTreeMap<SideKey, Histogram>,
    transfer_duration: BTreeMap<SideKey, Histogram>,
    transfer_descriptors: BTreeMap<SideKey, Histogram>,
    transfer_blocks: BTreeMap<SideKey, Histogram>,
    failures: BTreeMap<StepKey, BTreeMap<String, u64>>,
    /// P's step-29 writes by (service, backend, outcome).
    writes: BTreeMap<(&'static str, String, String), u64>,
    /// A hybrid model's step-29 bytes by (service, KV-cache group index).
    group_bytes: BTreeMap<(&'static str, usize), u64>,
    /// D: transfer_id → when its pull was sent (step 21 start).
    d_pending: HashMap<String, Instant>,
    /// P: transfer_id → when its pull arrived (step 22 start).
    p_pending: HashMap<String, Instant>,
    /// Peers refused for their proof, by (socket, cause).
    auth_refusals: BTreeMap<(&'static str, &'static str), u64>,
    /// Connections HTTP servers closed on their own, by (service, reason).
    http_closes: BTreeMap<(&'static str, &'static str), u64>,
    /// The proxy's routing decisions, by (pool, policy, choice), and the prompt chunks its
    /// cache hits matched, by pool.
    routes: BTreeMap<(&'static str, &'static str, &'static str), u64>,
    matched_chunks: BTreeMap<&'static str, u64>,
    /// Requests the proxy sent to another P after theirs failed before D answered.
    prefill_retries: u64,
    /// The engines' KV events, as the proxy took them.
    kv: kv_events::KvCounts,
}

/// The registry: one per process ([`global`]); tests make their own with [`Metrics::new`].
pub struct Metrics {
    state: Mutex<State>,
    gauges: Mutex<Vec<(&'static str, &'static str, GaugeFn)>>,
    block_bytes: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self { state: Mutex::new(State::default()), gauges: Mutex::new(Vec::new()), block_bytes: AtomicU64::new(0) }
    }
}

/// A label value from a span field, cut to a sane length.
fn truncate_label(s: &str) -> String {
    s.chars().take(64).collect()
}

/// The process's registry.
pub fn global() -> &'static Arc<Metrics> {
    static GLOBAL: OnceLock<Arc<Metrics>> = OnceLock::new();
    GLOBAL.get_or_init(|| Arc::new(Metrics::default()))
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Bytes of one KV block (all layers, K and V), so that D's step-34 observations carry bytes.
    pub fn set_block_bytes(&self, bytes: u64) {
        self.block_bytes.store(bytes, Ordering::Relaxed);
    }

    /// Adds a gauge family read at every scrape (`f` must be quick and must not block).
    pub fn register_gauge(
        &self,
        name: &'static str,
        help: &'static str,
        f: impl Fn() -> Vec<GaugeSample> + Send + Sync + 'static,
    ) {
        self.gauges.lock().unwrap_or_else(|p| p.into_inner()).push((name, help, Arc::new(f)));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A peer was refused on `socket` for `cause` (both fixed labels, never peer input).
    pub fn count_auth_refusal(&self, socket: &'static str, cause: &'static str) {
        *self.lock().auth_refusals.entry((socket, cause)).or_default() += 1;
    }

    /// `service`'s HTTP server closed a connection on its own for `reason` (both fixed labels,
    /// never peer input).
    pub fn count_http_close(&self, service: &'static str, reason: &'static str) {
        *self.lock().http_closes.entry((service, reason)).or_default() += 1;
    }

    /// The proxy routed a request of `pool` by `policy`, choosing for `choice` (fixed labels),
    /// matching `matched_chunks` of its prompt's chunks.
    pub fn count_route(&self, pool: &'static str, policy: &'static str, choice: &'static str, matched_chunks: u64) {
        let mut st = self.lock();
        *st.routes.entry((pool, policy, choice)).or_default() += 1;
        *st.matched_chunks.entry(pool).or_default() += matched_chunks;
    }

    /// The proxy applied `applied` of an engine's KV events to its index and ignored `ignored`
    /// (`engine`: its URL as the proxy was given it).
    pub fn count_kv_events(&self, engine: &str, applied: u64, ignored: u64) {
        self.lock().kv.events(engine, applied, ignored);
    }

    /// Something happened to an engine's stream of KV-event batches.
    pub fn count_kv_stream(&self, engine: &str, event: KvStreamEvent) {
        self.lock().kv.stream(engine, event);
    }

    /// The proxy retried a request on another P.
    pub fn count_prefill_retry(&self) {
        self.lock().prefill_retries += 1;
    }

    /// A step span opened: remember when a pull starts (steps 21 and 22).
    pub(crate) fn on_step_start(&self, step: u8, transfer_id: Option<&str>, at: Instant) {
        let Some(tid) = transfer_id.filter(|t| !t.is_empty()) else { return };
        if step == steps::D_SEND_PULL_META.number {
            self.lock().d_pending.entry(tid.to_owned()).or_insert(at);
        } else if step == steps::P_PULL_WAIT_READY.number {
            self.lock().p_pending.entry(tid.to_owned()).or_insert(at);
        }
    }

    /// A step span closed.
    pub(crate) fn observe(&self, o: &StepObservation) {
        let Some(step) = steps::by_number(o.step) else { return };
        let service = service_of(step.side);
        let block_bytes = self.block_bytes.load(Ordering::Relaxed);
        let mut st = self.lock();
        let st = &mut *st;
        st.steps
            .entry((service, step.number))
            .or_insert_with(|| Histogram::new(DURATION_BUCKETS))
            .observe(o.duration.as_secs_f64());
        if let Some(outcome) = o.outcome.as_deref().filter(|x| !x.is_empty() && !is_success(x)) {
            let causes = st.failures.entry((service, step.number)).or_default();
            let cause =
                if causes.len() < MAX_CAUSES_PER_STEP || causes.contains_key(outcome) { outcome } else { "other" };
            *causes.entry(cause.to_owned()).or_insert(0) += 1;
        }
        let tid = o.transfer_id.as_deref().filter(|t| !t.is_empty());
        let transfer = if step.number == steps::P_TRANSFER_WRITE.number {
            Some(("p", o.duration, o.bytes))
        } else if step.number == steps::D_PULL_RESULT.number && o.outcome.as_deref() != Some("freed_only") {
            let since = tid.and_then(|t| st.d_pending.get(t).copied());
            let duration = match (since, o.start) {
                (Some(since), Some(start)) => start.saturating_duration_since(since) + o.duration,
                _ => o.duration,
            };
            let bytes = o.bytes.or_else(|| o.blocks.filter(|_| block_bytes > 0).map(|b| b * block_bytes));
            Some(("d", duration, bytes))
        } else {
            None
        };
        if step.number == steps::P_TRANSFER_WRITE.number {
            let backend = o.backend.as_deref().filter(|b| !b.is_empty()).unwrap_or("unknown");
            let outcome = o.outcome.as_deref().filter(|x| !x.is_empty()).unwrap_or("unknown");
            // A handful of backends and outcomes: the label set stays small.
            let outcome = if is_success(outcome) { "ok" } else { outcome };
            let key = (service, truncate_label(backend), truncate_label(outcome));
            *st.writes.entry(key).or_insert(0) += 1;
            // At most MAX_GROUPS series per service: vLLM's models have a handful of groups.
            let groups = o.group_bytes.as_deref().unwrap_or_default().split(',').filter_map(|b| b.parse::<u64>().ok());
            for (group, bytes) in groups.enumerate().take(MAX_GROUPS) {
                *st.group_bytes.entry((service, group)).or_insert(0) += bytes;
            }
        }
        if let Some((side, duration, bytes)) = transfer {
            let key = (service, side);
            st.transfer_duration
                .entry(key)
                .or_insert_with(|| Histogram::new(DURATION_BUCKETS))
                .observe(duration.as_secs_f64());
            if let Some(b) = bytes {
                st.transfer_bytes.entry(key).or_insert_with(|| Histogram::new(BYTES_BUCKETS)).observe(b as f64);
            }
            if let Some(d) = o.descriptors {
                st.transfer_descriptors.entry(key).or_insert_with(|| Histogram::new(COUNT_BUCKETS)).observe(d as f64);
            }
            if let Some(b) = o.blocks {
                st.transfer_blocks.entry(key).or_insert_with(|| Histogram::new(COUNT_BUCKETS)).observe(b as f64);
            }
        }
        if let Some(t) = tid {
            if step.number == steps::D_PULL_RESULT.number {
                st.d_pending.remove(t);
            } else if step.number == steps::P_REPLY_FINISH.number {
                st.p_pending.remove(t);
            }
        }
    }

    /// The exposition text of everything in the registry.
    pub fn render(&self) -> String {
        self.render_with(&[])
    }

    /// The exposition text, plus `extra` gauges (an endpoint's own, e.g. its engine's blocks).
    pub fn render_with(&self, extra: &[Gauge]) -> String {
        let mut families = {
            let mut st = self.lock();
            let now = Instant::now();
            st.d_pending.retain(|_, at| now.saturating_duration_since(*at) < PENDING_PULL_TTL);
            st.p_pending.retain(|_, at| now.saturating_duration_since(*at) < PENDING_PULL_TTL);
            let mut families = vec![step_family(&st)];
            families.extend(side_families(&st));
            families.extend([failures_family(&st), writes_family(&st), group_bytes_family(&st)]);
            families.extend([pulls_family(&st), auth_family(&st), http_closes_family(&st)]);
            families.extend(routes_families(&st));
            families.extend(st.kv.families());
            families
        };
        let registered: Vec<_> = self.gauges.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let gauges =
            registered.iter().map(|(name, help, f)| Gauge { name, help, samples: f() }).chain(extra.iter().cloned());
        for g in gauges {
            // Two sources of one gauge (a registered one and an endpoint's) share one family.
            let at = match families.iter().position(|f| f.name == g.name) {
                Some(i) => i,
                None => {
                    families.push(Family::new(g.name, g.help, Kind::Gauge));
                    families.len() - 1
                }
            };
            for s in g.samples {
                families[at].sample(s.labels, s.value);
            }
        }
        expo::render(&families)
    }
}

/// `pdflow_step_duration_seconds`: every step span's duration.
fn step_family(st: &State) -> Family {
    let mut f = Family::new(
        "pdflow_step_duration_seconds",
        "Duration of each step of the seed's timeline (one span per step).",
        Kind::Histogram,
    );
    for ((service, n), h) in &st.steps {
        let name = steps::by_number(*n).map(|s| s.short_name).unwrap_or("unknown");
        f.histogram(vec![("service", (*service).to_owned()), ("step", n.to_string()), ("name", name.to_owned())], h);
    }
    f
}

/// The transfer histograms, per side (P's step 29, D's step 34).
fn side_families(st: &State) -> Vec<Family> {
    let side_families: [(&str, &str, &BTreeMap<SideKey, Histogram>); 4] = [
        (
            "pdflow_transfer_bytes",
            "KV bytes per transfer (P: step 29; D: step 34, blocks x block bytes).",
            &st.transfer_bytes,
        ),
        (
            "pdflow_transfer_duration_seconds",
            "KV transfer duration (P: step 29; D: step 21 start to step 34).",
            &st.transfer_duration,
        ),
        ("pdflow_transfer_descriptors", "Coalesced descriptors per transfer (step 29).", &st.transfer_descriptors),
        ("pdflow_transfer_blocks", "KV blocks per transfer (P: step 29; D: step 34).", &st.transfer_blocks),
    ];
    side_families
        .into_iter()
        .map(|(name, help, map)| {
            let mut f = Family::new(name, help, Kind::Histogram);
            for ((service, side), h) in map {
                f.histogram(vec![("service", (*service).to_owned()), ("side", (*side).to_owned())], h);
            }
            f
        })
        .collect()
}

/// `pdflow_auth_refusals_total`: peers refused for their proof of the cluster secret.
fn auth_family(st: &State) -> Family {
    let mut f = Family::new(
        "pdflow_auth_refusals_total",
        "Peers refused for their proof of the cluster secret (or, without one, for a non-loopback address), by socket and cause.",
        Kind::Counter,
    );
    for ((socket, cause), count) in &st.auth_refusals {
        f.sample(vec![("socket", (*socket).to_owned()), ("cause", (*cause).to_owned())], *count as f64);
    }
    f
}

/// `pdflow_http_connections_closed_total`: connections HTTP servers closed on their own.
fn routes_families(st: &State) -> [Family; 3] {
    let mut routes = Family::new(
        "pdflow_proxy_routes_total",
        "The proxy's routing decisions, by pool (prefill, decode), policy and choice (round_robin, least_loaded, cache_hit, kv_hit, skipped).",
        Kind::Counter,
    );
    for ((pool, policy, choice), count) in &st.routes {
        let labels =
            vec![("pool", (*pool).to_owned()), ("policy", (*policy).to_owned()), ("choice", (*choice).to_owned())];
        routes.sample(labels, *count as f64);
    }
    let mut matched = Family::new(
        "pdflow_proxy_matched_chunks_total",
        "Prompt chunks (about 16 tokens each) that cache-aware routing found already routed to the chosen engine, or KV blocks the chosen engine's KV events say it holds (kv_aware), by pool.",
        Kind::Counter,
    );
    for (pool, count) in &st.matched_chunks {
        matched.sample(vec![("pool", (*pool).to_owned())], *count as f64);
    }
    let mut retries = Family::new(
        "pdflow_proxy_prefill_retries_total",
        "Requests the proxy sent to another P because theirs failed before D answered (no token had reached the client).",
        Kind::Counter,
    );
    retries.sample(Vec::new(), st.prefill_retries as f64);
    [routes, matched, retries]
}

fn http_closes_family(st: &State) -> Family {
    let mut f = Family::new(
        "pdflow_http_connections_closed_total",
        "Connections an HTTP server closed on its own, by service and reason (server_full, peer_full, header_timeout, idle_timeout).",
        Kind::Counter,
    );
    for ((service, reason), count) in &st.http_closes {
        f.sample(vec![("service", (*service).to_owned()), ("reason", (*reason).to_owned())], *count as f64);
    }
    f
}

/// `pdflow_failures_total`: failed step spans by step and cause.
fn failures_family(st: &State) -> Family {
    let mut f = Family::new(
        "pdflow_failures_total",
        "Step spans that ended in failure, by step and cause (pd.outcome).",
        Kind::Counter,
    );
    for ((service, n), causes) in &st.failures {
        for (cause, count) in causes {
            f.sample(
                vec![("service", (*service).to_owned()), ("step", n.to_string()), ("cause", cause.clone())],
                *count as f64,
            );
        }
    }
    f
}

/// The most KV-cache groups counted apart in `pdflow_transfer_group_bytes_total`.
const MAX_GROUPS: usize = 16;

/// `pdflow_transfer_group_bytes_total`: a hybrid model's step-29 bytes per KV-cache group.
fn group_bytes_family(st: &State) -> Family {
    let mut f = Family::new(
        "pdflow_transfer_group_bytes_total",
        "Bytes P wrote (step 29) per KV-cache group of a hybrid model, by the group's index in vLLM's order.",
        Kind::Counter,
    );
    for ((service, group), bytes) in &st.group_bytes {
        f.sample(vec![("service", (*service).to_owned()), ("group", group.to_string())], *bytes as f64);
    }
    f
}

/// `pdflow_transfer_writes_total`: P's step-29 writes by backend and outcome.
fn writes_family(st: &State) -> Family {
    let mut f = Family::new(
        "pdflow_transfer_writes_total",
        "P's KV writes (step 29) by transfer backend and outcome.",
        Kind::Counter,
    );
    for ((service, backend, outcome), count) in &st.writes {
        f.sample(
            vec![("service", (*service).to_owned()), ("backend", backend.clone()), ("outcome", outcome.clone())],
            *count as f64,
        );
    }
    f
}

/// `pdflow_pulls_in_flight`: pulls between step 21 and 34 (D), 22 and 30 (P).
fn pulls_family(st: &State) -> Family {
    let mut f = Family::new(
        "pdflow_pulls_in_flight",
        "Pulls in flight: D sent (step 21) and not settled (34); P received (22) and not answered (30).",
        Kind::Gauge,
    );
    f.sample(vec![("service", "prefill".to_owned()), ("side", "p".to_owned())], st.p_pending.len() as f64);
    f.sample(vec![("service", "decode".to_owned()), ("side", "d".to_owned())], st.d_pending.len() as f64);
    f
}
