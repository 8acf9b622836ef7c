//! The engine advertising itself for `pdflow proxy --discover` (`advertise_url`, `advertise_to`):
//! what it says — its role, `advertise_url`, P's bootstrap port, where vLLM publishes its KV events
//! — and where: P at the bootstrap its workers register with, either role at each
//! `advertise_to`, as `pdflow serve` does. The posting (signed with the cluster secret, a deadline
//! on every call, never fatal) is [`pdflow_actors::advertise`]'s.
//!
//! One worker per bootstrap advertises: the one vLLM's rule picks to launch P's bootstrap (tensor
//! and pipeline rank 0 of the first data-parallel engine, of each node's first with external load
//! balancing), whose runtime serves between vLLM's calls. It names the KV-event endpoints of the
//! data-parallel engines of its node, as vLLM offsets them (the port plus the engine's rank).

use pdflow_actors::advertise::{new_generation, Advertiser};
use pdflow_actors::scheduler_connector::KvRole;
use pdflow_auth::ClusterSecret;
use pdflow_messages::discovery::{AdvertiseEngine, KvEventsEndpoint};
use pdflow_messages::proxy::Pool;

use crate::config::Advertise;

/// vLLM's `kv_events_config` as the worker sees it (an engine that publishes on ZeroMQ).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsSettings {
    /// Its `endpoint` (`tcp://*:5557`), before vLLM offsets it by the data-parallel rank.
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    /// The data-parallel engines on this node from the advertising one on (vLLM's
    /// `data_parallel_size_local`).
    pub ranks: u32,
}

/// What this engine advertises and where.
pub struct Advertisement {
    pub engine: AdvertiseEngine,
    pub bootstraps: Vec<String>,
}

impl Advertisement {
    /// The advertisement of engine `engine_id` (`role`), P's workers registered at
    /// `own_bootstrap`; `first_rank`: the advertising engine's data-parallel rank (vLLM's
    /// `data_parallel_index`). Why not, when it cannot be made.
    pub fn new(
        engine_id: &str,
        role: KvRole,
        advertise: &Advertise,
        own_bootstrap: Option<&str>,
        kv_events: Option<&KvEventsSettings>,
        first_rank: u32,
    ) -> Result<Self, String> {
        let (pool, bootstrap_port) = match role {
            KvRole::Producer => {
                let url = own_bootstrap.ok_or("a producer without a bootstrap cannot be advertised")?;
                let (host, port) = host_port(url).ok_or_else(|| format!("P's bootstrap URL {url} has no port"))?;
                if !is_wildcard(host) && host != advertise.host {
                    tracing::warn!(bootstrap = %url, advertise_url = %advertise.url,
                        "the proxy looks for P's bootstrap at advertise_url's host and the bootstrap's port; this \
                         bootstrap is on another host");
                }
                (Pool::Prefill, Some(port))
            }
            KvRole::Consumer => (Pool::Decode, None),
            KvRole::Both => return Err("a kv_both engine cannot be advertised".into()),
        };
        let mut bootstraps: Vec<String> = Vec::new();
        let own = own_bootstrap.filter(|_| role == KvRole::Producer);
        for url in own.into_iter().chain(advertise.to.iter().map(String::as_str)) {
            let url = url.trim_end_matches('/').to_owned();
            if !bootstraps.contains(&url) {
                bootstraps.push(url);
            }
        }
        let kv_events = kv_events.map_or_else(Vec::new, |k| kv_events_endpoints(k, first_rank, &advertise.host));
        let engine = AdvertiseEngine {
            engine_id: engine_id.into(),
            role: pool,
            url: advertise.url.clone(),
            bootstrap_port,
            kv_events,
            generation: new_generation(),
        };
        Ok(Self { engine, bootstraps })
    }

    /// Starts advertising (on the current runtime); `None` when there is nowhere to advertise or
    /// the task cannot start (logged: the engine serves all the same).
    pub fn start(&self, secret: Option<ClusterSecret>) -> Option<Advertiser> {
        if self.bootstraps.is_empty() {
            return None;
        }
        Advertiser::start(self.bootstraps.clone(), self.engine.clone(), secret)
            .inspect_err(|e| tracing::warn!(error = %e, "the engine cannot be advertised; it serves all the same"))
            .ok()
    }
}

/// The KV-event endpoints of data-parallel ranks `first_rank..first_rank + ranks`, each as vLLM
/// opens it and with `host` in place of a wildcard. Those a subscriber cannot be pointed at are
/// left out, logged: an `inproc`/`ipc` endpoint, a port of 0 (the OS picks it), an endpoint
/// vLLM connects its publisher to (one without `*` or `::`) instead of binding.
pub fn kv_events_endpoints(k: &KvEventsSettings, first_rank: u32, host: &str) -> Vec<KvEventsEndpoint> {
    if !k.endpoint.starts_with("tcp://") {
        tracing::info!(endpoint = %k.endpoint, "KV events not advertised: a subscriber elsewhere cannot reach this endpoint");
        return Vec::new();
    }
    if !(k.endpoint.contains('*') || k.endpoint.contains("::")) {
        tracing::info!(endpoint = %k.endpoint,
            "KV events not advertised: vLLM connects its publisher to this endpoint (a subscriber's), it binds none");
        return Vec::new();
    }
    let mut out = Vec::new();
    for rank in first_rank..first_rank.saturating_add(k.ranks.max(1)) {
        let Some(endpoint) = offset(&k.endpoint, rank) else {
            tracing::info!(endpoint = %k.endpoint, "KV events not advertised: port 0 is picked by the OS");
            return Vec::new();
        };
        let replay_endpoint = k.replay_endpoint.as_deref().and_then(|r| offset(r, rank)).map(|r| reachable(&r, host));
        out.push(KvEventsEndpoint { endpoint: reachable(&endpoint, host), replay_endpoint, topic: k.topic.clone() });
    }
    out
}

/// vLLM's `offset_endpoint_port`: a tcp endpoint's port plus `rank`; `None` for one of port 0 or
/// not tcp (nothing a subscriber can be pointed at).
fn offset(endpoint: &str, rank: u32) -> Option<String> {
    let (head, port) = endpoint.strip_prefix("tcp://").and_then(|_| endpoint.rsplit_once(':'))?;
    let port: u32 = port.parse().ok().filter(|p| *p != 0)?;
    let port = u16::try_from(port + rank).ok()?;
    Some(format!("{head}:{port}"))
}

fn is_wildcard(host: &str) -> bool {
    matches!(host, "*" | "0.0.0.0" | "[::]" | "::" | "[*]" | "")
}

/// `endpoint` (`tcp://HOST:PORT`) with `host` in place of a wildcard host.
fn reachable(endpoint: &str, host: &str) -> String {
    let Some((head, port)) = endpoint.rsplit_once(':') else { return endpoint.to_owned() };
    match head.strip_prefix("tcp://") {
        Some(h) if is_wildcard(h) => format!("tcp://{host}:{port}"),
        _ => endpoint.to_owned(),
    }
}

/// `http://HOST:PORT[/]` as `(HOST, PORT)`.
fn host_port(url: &str) -> Option<(&str, u16)> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r).trim_end_matches('/');
    let (host, port) = rest.rsplit_once(':')?;
    Some((host, port.parse().ok()?))
}
