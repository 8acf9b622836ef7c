//! Engines advertising themselves at a bootstrap, and the proxy discovering them there.
//!
//! A P or D engine posts an [`AdvertiseEngine`] to `POST /engines` of a bootstrap (repeated every
//! second, so that a bootstrap that restarted learns it again); `GET /engines` answers an
//! [`EnginesResponse`], which `pdflow proxy --discover` reads to fill its pools. This table is the
//! bootstrap's second one, apart from `/query`'s: vLLM's readers of `/query` (its Mooncake proxy,
//! D's receivers) never see a D in it, and nothing in `/query`'s shape changes.
//!
//! Every field past `engine_id`, `role` and `url` is optional on the wire, so that an engine that
//! knows only those (vLLM with a hand-written call, an older pdflow) can still advertise.

use serde::{Deserialize, Serialize};

use crate::proxy::Pool;
use crate::EngineId;

/// Where an engine publishes its KV events (vLLM's `--kv-events-config`): its ZeroMQ PUB socket
/// and, when it keeps one, its replay socket, each `tcp://HOST:PORT` with the engine's host (not
/// a wildcard); the topic subscribed to (empty: every topic, vLLM's default).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvEventsEndpoint {
    pub endpoint: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub topic: String,
}

/// One engine as it advertises itself (`POST /engines`) and as the bootstrap lists it
/// (`GET /engines`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdvertiseEngine {
    /// The engine's id: what names it across its advertisements (a data-parallel engine: its
    /// first rank's).
    pub engine_id: EngineId,
    /// `prefill` (P) or `decode` (D).
    pub role: Pool,
    /// Its HTTP API, `http://HOST:PORT`.
    pub url: String,
    /// P: the port of the bootstrap its workers register with, on the host of `url` (what the
    /// proxy names to D as P's `remote_bootstrap_addr`). A D has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
    /// Where it publishes KV events, one per data-parallel rank (none: it publishes none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kv_events: Vec<KvEventsEndpoint>,
    /// A new, larger one each time the engine starts: a newer advertisement of the same engine id
    /// replaces the older (a restart, perhaps on another port); an older one is refused. 0: not
    /// given, replaced by any.
    #[serde(default)]
    pub generation: u64,
}

/// `GET /engines`: every engine advertised at this bootstrap and not expired.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnginesResponse {
    pub engines: Vec<AdvertiseEngine>,
}

/// Why a bootstrap refused an advertisement (400 with the reason; 403 for a takeover without a
/// cluster secret).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdvertiseRejected {
    #[error("engine `{engine_id}`: `{url}` is not an engine URL (expected http://HOST:PORT)")]
    BadUrl { engine_id: EngineId, url: String },
    #[error("engine `{engine_id}`: {reason}")]
    BadField { engine_id: EngineId, reason: String },
    #[error("engine `{engine_id}` of generation {offered} is older than the advertised generation {advertised}: a previous incarnation of a restarted engine is still running — stop it")]
    StaleGeneration { engine_id: EngineId, advertised: u64, offered: u64 },
    #[error("engine `{engine_id}` was advertised from {advertised_from}; without a cluster secret only {advertised_from} may change it, not {from} (give every peer the cluster secret to advertise from anywhere)")]
    NotTheAdvertiser { engine_id: EngineId, advertised_from: String, from: String },
    #[error("this bootstrap already lists {limit} engines; an engine that stops advertising leaves after {ttl_s} s")]
    Full { limit: usize, ttl_s: u64 },
}

impl AdvertiseRejected {
    /// Refused because, without a cluster secret, it would change another peer's engine (403).
    pub fn is_takeover(&self) -> bool {
        matches!(self, Self::NotTheAdvertiser { .. })
    }
}

/// An advertisement as the Bootstrap actor receives it over HTTP: the body and the peer address it
/// came from (none: asked in this process).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdvertiseFrom {
    pub engine: AdvertiseEngine,
    pub peer: Option<std::net::IpAddr>,
}

/// Ask the Bootstrap actor for the engines advertised and not expired (`GET /engines`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ListAdvertised;

/// The discovery task → Proxy: what one bootstrap lists now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnginesDiscovered {
    /// The bootstrap's URL, as given to `--discover`.
    pub bootstrap: String,
    pub engines: Vec<AdvertiseEngine>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minimal_advertisement_parses_and_optional_fields_stay_off_the_wire() {
        let ad: AdvertiseEngine =
            serde_json::from_str(r#"{"engine_id": "d1", "role": "decode", "url": "http://10.0.0.2:8020"}"#)
                .expect("parses");
        assert_eq!((ad.bootstrap_port, ad.kv_events.len(), ad.generation), (None, 0, 0));
        let json = serde_json::to_string(&ad).expect("json");
        assert!(!json.contains("bootstrap_port") && !json.contains("kv_events"), "{json}");
        let p: AdvertiseEngine = serde_json::from_str(
            r#"{"engine_id": "p", "role": "prefill", "url": "http://h:1", "bootstrap_port": 8998,
                "kv_events": [{"endpoint": "tcp://h:5557", "replay_endpoint": "tcp://h:5558"}], "generation": 7}"#,
        )
        .expect("parses");
        assert_eq!(p.kv_events[0].replay_endpoint.as_deref(), Some("tcp://h:5558"));
        assert_eq!(p.kv_events[0].topic, "");
    }
}
