//! The `kv_aware` routing policy's knowledge of each engine's prefix cache, from vLLM's KV events
//! (`--kv-events-config`): owned by the Proxy actor, which reads it when it routes (inside seed
//! step 8); written by one subscriber task per publisher, which the actor owns (they stop with
//! it, or when their engine leaves) and which never report through its mailbox. An engine that
//! joins a `kv_aware` pool while the proxy runs (the admin API, discovery) is followed from then
//! on, as one given at start is.
//!
//! # Layout
//! - this file — where each engine publishes ([`KvEventSource`], `--kv-events`), and the
//!   subscribers and indexes of one proxy ([`KvEvents`]);
//! - [`msgpack`], [`decode`] — a batch's payload read (vLLM 0.33's msgpack form);
//! - [`index`] — per engine and data-parallel rank, the blocks it holds, hashed by the proxy;
//! - [`sequence`] — the sequence numbers of one publisher's batches: next, seen, gap, restart;
//! - [`replay`] — a replay of an engine's kept batches;
//! - [`subscriber`] — one publisher followed (SUB socket, replays, reconnects);
//! - `tests_subscriber` — a subscriber against a scripted publisher.

pub mod decode;
pub mod index;
pub mod msgpack;
pub mod replay;
pub mod sequence;
pub mod subscriber;
#[cfg(test)]
mod tests_subscriber;

pub use index::{EngineKv, Held, PromptBlocks};

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::{Arc, RwLock};

use pdflow_messages::discovery::KvEventsEndpoint;
use pdflow_messages::proxy::Pool;

use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use super::routing::{HeldBlocks, Policy};
use crate::ActorError;

/// Where one engine publishes its KV events: `--kv-events ENGINE_URL=tcp://HOST:PORT`, with
/// `,replay=tcp://HOST:PORT` for its replay socket and `,topic=TOPIC` for its topic. A
/// data-parallel engine publishes each rank on its own port (vLLM: the port plus the rank): one
/// source per rank, under the same engine URL.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvEventSource {
    /// The engine's URL, as given to `--prefill` or `--decode`.
    pub engine_url: String,
    /// Its PUB socket (`tcp://HOST:PORT`).
    pub endpoint: String,
    /// Its replay socket, if any.
    pub replay_endpoint: Option<String>,
    /// The topic subscribed to (empty: every topic, vLLM's default).
    pub topic: String,
}

/// Why a `--kv-events` value is not a [`KvEventSource`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvEventSourceError {
    #[error("expected ENGINE_URL=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=TOPIC], got `{0}`")]
    Shape(String),
    #[error("`{endpoint}`: {reason}")]
    Endpoint { endpoint: String, reason: &'static str },
    #[error("unknown option `{0}` (known: replay=, topic=)")]
    UnknownOption(String),
}

/// Checks `endpoint` is `tcp://HOST:PORT` that can be connected to.
fn check_endpoint(endpoint: &str) -> Result<String, KvEventSourceError> {
    let bad = |reason| KvEventSourceError::Endpoint { endpoint: endpoint.to_owned(), reason };
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(|| bad("only tcp:// endpoints are subscribed to"))?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| bad("no port: e.g. tcp://10.0.0.1:5557"))?;
    match host {
        "" => return Err(bad("no host: e.g. tcp://10.0.0.1:5557")),
        "*" | "[*]" => return Err(bad("a wildcard is where the engine binds; give the engine's host")),
        _ => {}
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(endpoint.to_owned()),
        _ => Err(bad("the port is not a TCP port (1-65535)")),
    }
}

impl FromStr for KvEventSource {
    type Err = KvEventSourceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let shape = || KvEventSourceError::Shape(s.to_owned());
        let (url, rest) = s.split_once('=').ok_or_else(shape)?;
        let mut parts = rest.split(',');
        let endpoint = check_endpoint(parts.next().filter(|e| !e.is_empty()).ok_or_else(shape)?)?;
        let mut source = KvEventSource {
            engine_url: url.trim_end_matches('/').to_owned(),
            endpoint,
            replay_endpoint: None,
            topic: String::new(),
        };
        if source.engine_url.is_empty() {
            return Err(shape());
        }
        for option in parts {
            match option.split_once('=') {
                Some(("replay", e)) => source.replay_endpoint = Some(check_endpoint(e)?),
                Some(("topic", t)) => source.topic = t.to_owned(),
                _ => return Err(KvEventSourceError::UnknownOption(option.to_owned())),
            }
        }
        Ok(source)
    }
}

impl KvEventSource {
    /// `endpoint` of the engine at `engine_url` (as the admin API and the bootstrap's `/engines`
    /// carry it), checked as `--kv-events` is.
    pub fn of(engine_url: &str, endpoint: &KvEventsEndpoint) -> Result<Self, KvEventSourceError> {
        Ok(Self {
            engine_url: engine_url.trim_end_matches('/').to_owned(),
            endpoint: check_endpoint(&endpoint.endpoint)?,
            replay_endpoint: endpoint.replay_endpoint.as_deref().map(check_endpoint).transpose()?,
            topic: endpoint.topic.clone(),
        })
    }

    /// The endpoints, without the engine.
    pub fn endpoint(&self) -> KvEventsEndpoint {
        KvEventsEndpoint {
            endpoint: self.endpoint.clone(),
            replay_endpoint: self.replay_endpoint.clone(),
            topic: self.topic.clone(),
        }
    }
}

/// One pool's engines' indexes, by the pool's index (none: no events for that engine). Engines
/// join and leave while the proxy routes: a slot is set when a subscription starts, cleared when
/// it stops.
#[derive(Debug, Default)]
pub struct PoolKv(RwLock<Vec<Option<Arc<EngineKv>>>>);

impl PoolKv {
    fn get(&self, index: usize) -> Option<Arc<EngineKv>> {
        // A writer that panicked left a whole slot set or not: the vector is still usable.
        let slots = self.0.read().unwrap_or_else(|p| p.into_inner());
        slots.get(index).cloned().flatten()
    }

    fn set(&self, index: usize, engine: Option<Arc<EngineKv>>) {
        let mut slots = self.0.write().unwrap_or_else(|p| p.into_inner());
        if slots.len() <= index {
            slots.resize(index + 1, None);
        }
        slots[index] = engine;
    }
}

impl HeldBlocks<(usize, u32)> for PoolKv {
    /// A P and dp rank: what that rank holds (its batches name it).
    fn held(&self, (index, rank): (usize, u32), prompt: &mut PromptBlocks) -> Held {
        self.get(index).map(|e| e.matched(Some(rank), prompt)).unwrap_or_default()
    }
}

impl HeldBlocks<usize> for PoolKv {
    /// A D: the most any of its ranks holds (D's own API picks the rank).
    fn held(&self, index: usize, prompt: &mut PromptBlocks) -> Held {
        self.get(index).map(|e| e.matched(None, prompt)).unwrap_or_default()
    }
}

/// One engine's subscription: its index, the subscriber of each of its sources, and the pool
/// entries reading it (an engine given to both pools is followed once).
struct Subscription {
    engine: Arc<EngineKv>,
    sources: Vec<KvEventSource>,
    users: HashSet<(Pool, usize)>,
    _subscribers: Vec<AbortOnDropHandle<()>>,
}

/// The KV-event subscribers of one Proxy actor and the indexes they write: one subscription per
/// engine URL, started when an engine of a `kv_aware` pool with endpoints joins (at start, through
/// the admin API or discovery), stopped when its last pool entry leaves.
pub struct KvEvents {
    pub prefill: Arc<PoolKv>,
    pub decode: Arc<PoolKv>,
    prefill_policy: Policy,
    decode_policy: Policy,
    subscriptions: HashMap<String, Subscription>,
    shutdown: CancellationToken,
}

impl KvEvents {
    /// No subscription yet; each stops with `shutdown` (or when dropped).
    pub fn new(prefill_policy: Policy, decode_policy: Policy, shutdown: &CancellationToken) -> Self {
        Self {
            prefill: Arc::default(),
            decode: Arc::default(),
            prefill_policy,
            decode_policy,
            subscriptions: HashMap::new(),
            shutdown: shutdown.clone(),
        }
    }

    /// Checks the sources given at start against the pools given at start (`urls`: each pool's
    /// engines, checked and without a trailing `/`): a source naming no engine, or a `kv_aware`
    /// pool's engine without a source, is refused.
    pub fn check(
        sources: &[KvEventSource],
        prefill: (&[String], Policy),
        decode: (&[String], Policy),
    ) -> Result<(), ActorError> {
        for s in sources {
            if !prefill.0.contains(&s.engine_url) && !decode.0.contains(&s.engine_url) {
                return Err(ActorError::KvEventsUnknownEngine { url: s.engine_url.clone() });
            }
        }
        for ((urls, policy), pool) in [(prefill, "prefill"), (decode, "decode")] {
            if policy != Policy::KvAware {
                continue;
            }
            if let Some(url) = urls.iter().find(|url| !sources.iter().any(|s| &s.engine_url == *url)) {
                return Err(ActorError::KvEventsMissing { pool, url: url.clone() });
            }
        }
        Ok(())
    }

    fn pool_kv(&self, pool: Pool) -> &Arc<PoolKv> {
        match pool {
            Pool::Prefill => &self.prefill,
            Pool::Decode => &self.decode,
        }
    }

    /// Follows the KV events of the engine at `url`, entry `index` of `pool`, from `sources`;
    /// nothing when its pool is not `kv_aware` or it has no source. Whether it is followed.
    pub fn subscribe(&mut self, pool: Pool, index: usize, url: &str, sources: &[KvEventSource]) -> bool {
        let policy = match pool {
            Pool::Prefill => self.prefill_policy,
            Pool::Decode => self.decode_policy,
        };
        if policy != Policy::KvAware || sources.is_empty() {
            return false;
        }
        let stale = self.subscriptions.get(url).is_some_and(|s| s.sources != sources);
        if stale {
            // The engine publishes elsewhere now (it restarted): follow it there, from empty.
            if let Some(old) = self.subscriptions.remove(url) {
                for (p, i) in old.users {
                    self.pool_kv(p).set(i, None);
                }
            }
        }
        let shutdown = &self.shutdown;
        let subscription = self.subscriptions.entry(url.to_owned()).or_insert_with(|| {
            let engine = Arc::new(EngineKv::new(index::MAX_BLOCKS));
            let subscribers = (sources.iter())
                .map(|source| {
                    let subscriber = subscriber::Subscriber::new(source.clone(), engine.clone());
                    AbortOnDropHandle::new(tokio::spawn(subscriber.run(shutdown.child_token())))
                })
                .collect();
            Subscription { engine, sources: sources.to_vec(), users: HashSet::new(), _subscribers: subscribers }
        });
        subscription.users.insert((pool, index));
        let engine = subscription.engine.clone();
        self.pool_kv(pool).set(index, Some(engine));
        true
    }

    /// Entry `index` of `pool` no longer reads KV events; its engine's subscription stops when no
    /// entry reads it.
    pub fn unsubscribe(&mut self, pool: Pool, index: usize) {
        self.pool_kv(pool).set(index, None);
        let url = self.subscriptions.iter().find(|(_, s)| s.users.contains(&(pool, index))).map(|(u, _)| u.clone());
        if let Some(url) = url {
            let idle = self.subscriptions.get_mut(&url).is_some_and(|s| {
                s.users.remove(&(pool, index));
                s.users.is_empty()
            });
            if idle {
                // Dropping the subscription aborts its subscribers.
                self.subscriptions.remove(&url);
                tracing::info!(engine = %url, "kv events: unsubscribed");
            }
        }
    }

    /// How many engines are followed (each once, whatever its sources).
    pub fn subscribed(&self) -> usize {
        self.subscriptions.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_is_an_engine_url_and_its_endpoints() {
        let s: KvEventSource =
            "http://10.0.0.1:8100/=tcp://10.0.0.1:5557,replay=tcp://10.0.0.1:5558,topic=kv".parse().expect("valid");
        assert_eq!(
            s,
            KvEventSource {
                engine_url: "http://10.0.0.1:8100".into(),
                endpoint: "tcp://10.0.0.1:5557".into(),
                replay_endpoint: Some("tcp://10.0.0.1:5558".into()),
                topic: "kv".into(),
            }
        );
        let bare: KvEventSource = "http://h:1=tcp://[::1]:5557".parse().expect("valid");
        assert_eq!((bare.replay_endpoint, bare.topic.as_str()), (None, ""));
        for bad in
            ["tcp://h:1", "http://h:1=", "http://h:1=tcp://*:5557", "http://h:1=ipc:///x", "http://h:1=tcp://h:0"]
        {
            assert!(bad.parse::<KvEventSource>().is_err(), "{bad}");
        }
        let err = "http://h:1=tcp://h:2,replay=tcp://h:3,hwm=5".parse::<KvEventSource>().expect_err("unknown");
        assert_eq!(err, KvEventSourceError::UnknownOption("hwm=5".into()));
    }

    #[tokio::test]
    async fn a_kv_aware_pool_needs_every_engine_s_endpoints_and_a_source_needs_its_engine() {
        let p = vec!["http://p:1".to_owned()];
        let d = vec!["http://d:1".to_owned(), "http://d:2".to_owned()];
        let source = |url: &str| KvEventSource {
            engine_url: url.into(),
            endpoint: "tcp://127.0.0.1:9".into(),
            replay_endpoint: None,
            topic: String::new(),
        };
        let missing = KvEvents::check(&[source("http://p:1")], (&p, Policy::KvAware), (&d, Policy::KvAware));
        assert!(matches!(missing, Err(ActorError::KvEventsMissing { pool: "decode", ref url }) if url == "http://d:1"));
        let unknown = KvEvents::check(&[source("http://x:1")], (&p, Policy::RoundRobin), (&d, Policy::RoundRobin));
        assert!(matches!(unknown, Err(ActorError::KvEventsUnknownEngine { .. })));
        KvEvents::check(&[source("http://p:1")], (&p, Policy::KvAware), (&d, Policy::LeastLoaded))
            .expect("P's pool alone is kv_aware");
    }

    #[tokio::test]
    async fn an_engine_joining_is_subscribed_and_one_leaving_unsubscribed() {
        let shutdown = CancellationToken::new();
        let mut kv = KvEvents::new(Policy::KvAware, Policy::RoundRobin, &shutdown);
        let source = |url: &str, port: u16| KvEventSource {
            engine_url: url.into(),
            endpoint: format!("tcp://127.0.0.1:{port}"),
            replay_endpoint: None,
            topic: String::new(),
        };
        assert!(!kv.subscribe(Pool::Decode, 0, "http://d:1", &[source("http://d:1", 9)]), "D's pool reads none");
        assert!(!kv.subscribe(Pool::Prefill, 0, "http://p:1", &[]), "no source, no subscription");
        assert!(kv.subscribe(Pool::Prefill, 3, "http://p:3", &[source("http://p:3", 9)]));
        assert!(kv.prefill.get(3).is_some() && kv.prefill.get(0).is_none());
        assert_eq!(kv.subscribed(), 1);
        // The same engine again under new endpoints (a restart): one subscription, a new index.
        let before = kv.prefill.get(3).expect("subscribed");
        assert!(kv.subscribe(Pool::Prefill, 3, "http://p:3", &[source("http://p:3", 10)]));
        let after = kv.prefill.get(3).expect("subscribed");
        assert!(!Arc::ptr_eq(&before, &after), "followed from empty at its new endpoint");
        assert_eq!(kv.subscribed(), 1);
        kv.unsubscribe(Pool::Prefill, 3);
        assert!(kv.prefill.get(3).is_none());
        assert_eq!(kv.subscribed(), 0);
        kv.unsubscribe(Pool::Prefill, 3);
        let endpoint = KvEventsEndpoint { endpoint: "tcp://*:1".into(), replay_endpoint: None, topic: String::new() };
        assert!(KvEventSource::of("http://p:1", &endpoint).is_err(), "a wildcard is refused");
        shutdown.cancel();
    }
}
