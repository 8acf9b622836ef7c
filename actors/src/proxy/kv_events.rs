//! The `kv_aware` routing policy's knowledge of each engine's prefix cache, from vLLM's KV events
//! (`--kv-events-config`): owned by the Proxy actor, which reads it when it routes (inside seed
//! step 8); written by one subscriber task per publisher, which the actor owns (they stop with
//! it) and which never report through its mailbox.
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

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use super::routing::{HeldBlocks, Policy};
use crate::ActorError;

/// Where one engine publishes its KV events: `--kv-events ENGINE_URL=tcp://HOST:PORT`, with
/// `,replay=tcp://HOST:PORT` for its replay socket and `,topic=TOPIC` for its topic. A
/// data-parallel engine publishes each rank on its own port (vLLM: the port plus the rank): one
/// source per rank, under the same engine URL.
#[derive(Debug, Clone, PartialEq, Eq)]
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

/// One pool's engines' indexes, by the pool's index (none: no events for that engine).
#[derive(Debug, Clone)]
pub struct PoolKv(Vec<Option<Arc<EngineKv>>>);

impl HeldBlocks<(usize, u32)> for PoolKv {
    /// A P and dp rank: what that rank holds (its batches name it).
    fn held(&self, (index, rank): (usize, u32), prompt: &mut PromptBlocks) -> Held {
        self.0.get(index).and_then(Option::as_ref).map(|e| e.matched(Some(rank), prompt)).unwrap_or_default()
    }
}

impl HeldBlocks<usize> for PoolKv {
    /// A D: the most any of its ranks holds (D's own API picks the rank).
    fn held(&self, index: usize, prompt: &mut PromptBlocks) -> Held {
        self.0.get(index).and_then(Option::as_ref).map(|e| e.matched(None, prompt)).unwrap_or_default()
    }
}

/// The KV-event subscribers of one Proxy actor and the indexes they write.
pub struct KvEvents {
    pub prefill: Arc<PoolKv>,
    pub decode: Arc<PoolKv>,
    _subscribers: Vec<AbortOnDropHandle<()>>,
}

impl KvEvents {
    /// Starts a subscriber for every source of an engine whose pool is `kv_aware` (`urls` are
    /// each pool's engines, checked and without a trailing `/`). A source naming no engine, or
    /// a `kv_aware` pool's engine without a source, is refused.
    pub fn start(
        sources: &[KvEventSource],
        prefill: (&[String], Policy),
        decode: (&[String], Policy),
        shutdown: &CancellationToken,
    ) -> Result<Self, ActorError> {
        for s in sources {
            if !prefill.0.contains(&s.engine_url) && !decode.0.contains(&s.engine_url) {
                return Err(ActorError::KvEventsUnknownEngine { url: s.engine_url.clone() });
            }
        }
        // One index per engine, shared by its sources and by both pools if it is in both.
        let mut engines: HashMap<String, Arc<EngineKv>> = HashMap::new();
        let mut subscribers = Vec::new();
        let mut pool = |(urls, policy): (&[String], Policy), name: &'static str| {
            let mut out = Vec::with_capacity(urls.len());
            for url in urls {
                if policy != Policy::KvAware {
                    out.push(None);
                    continue;
                }
                let mine: Vec<&KvEventSource> = sources.iter().filter(|s| &s.engine_url == url).collect();
                if mine.is_empty() {
                    return Err(ActorError::KvEventsMissing { pool: name, url: url.clone() });
                }
                if let Some(engine) = engines.get(url.as_str()) {
                    out.push(Some(engine.clone()));
                    continue;
                }
                let engine = Arc::new(EngineKv::new(index::MAX_BLOCKS));
                engines.insert(url.clone(), engine.clone());
                for source in mine {
                    let subscriber = subscriber::Subscriber::new(source.clone(), engine.clone());
                    subscribers.push(AbortOnDropHandle::new(tokio::spawn(subscriber.run(shutdown.child_token()))));
                }
                out.push(Some(engine));
            }
            Ok(Arc::new(PoolKv(out)))
        };
        let prefill = pool(prefill, "prefill")?;
        let decode = pool(decode, "decode")?;
        Ok(Self { prefill, decode, _subscribers: subscribers })
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
        let shutdown = CancellationToken::new();
        let p = vec!["http://p:1".to_owned()];
        let d = vec!["http://d:1".to_owned(), "http://d:2".to_owned()];
        let source = |url: &str| KvEventSource {
            engine_url: url.into(),
            endpoint: "tcp://127.0.0.1:9".into(),
            replay_endpoint: None,
            topic: String::new(),
        };
        let missing = KvEvents::start(&[source("http://p:1")], (&p, Policy::KvAware), (&d, Policy::KvAware), &shutdown);
        assert!(matches!(missing, Err(ActorError::KvEventsMissing { pool: "decode", ref url }) if url == "http://d:1"));
        let unknown =
            KvEvents::start(&[source("http://x:1")], (&p, Policy::RoundRobin), (&d, Policy::RoundRobin), &shutdown);
        assert!(matches!(unknown, Err(ActorError::KvEventsUnknownEngine { .. })));
        let ok = KvEvents::start(&[source("http://p:1")], (&p, Policy::KvAware), (&d, Policy::LeastLoaded), &shutdown)
            .expect("P's pool alone is kv_aware");
        assert_eq!(ok._subscribers.len(), 1);
        shutdown.cancel();
    }
}
