//! `--kv-events-config`: vLLM's `KVEventsConfig`, its JSON keys and defaults, and what its
//! `ZmqEventPublisher` does with the endpoints: a data-parallel rank's ports are the configured
//! ones plus its rank; a wildcard (`tcp://*:PORT`, `::`) or ipc/inproc endpoint binds, any other
//! connects (to a subscriber that binds), and the replay endpoint always binds.

/// Why KV events cannot be published as configured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvEventsError {
    #[error("--kv-events-config is not valid JSON for vLLM's KVEventsConfig: {0}")]
    Parse(String),
    #[error("kv events publisher `{0}`: this engine publishes with `zmq` (or `null`: none)")]
    UnknownPublisher(String),
    #[error("kv events endpoint `{endpoint}`: {reason}")]
    Endpoint { endpoint: String, reason: String },
    #[error("kv events: cannot bind {what} socket on `{endpoint}`: {reason}")]
    Bind { what: &'static str, endpoint: String, reason: String },
    #[error("kv events: cannot connect the PUB socket to `{endpoint}`: {reason}")]
    Connect { endpoint: String, reason: String },
    #[error("kv events need prefix caching: without it no block is ever stored (turn on --enable-prefix-caching)")]
    NeedsPrefixCaching,
    #[error("the kv events publisher stopped before it bound its sockets")]
    Stopped,
}

/// vLLM's `KVEventsConfig` (same keys, same defaults; `publisher` defaults to `zmq` when events
/// are on).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    pub enable_kv_cache_events: bool,
    pub publisher: Option<String>,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// The PUB socket's high-water mark (accepted for compatibility: the socket drops messages
    /// for a slow subscriber past its own queue).
    pub hwm: usize,
    /// Batches waiting to be sent at most; past it a batch is dropped (and logged).
    pub max_queue_size: usize,
    pub topic: String,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            enable_kv_cache_events: false,
            publisher: None,
            endpoint: "tcp://*:5557".to_owned(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue_size: 100_000,
            topic: String::new(),
        }
    }
}

impl KvEventsConfig {
    /// Events on, published on `endpoint` (and replayed on `replay_endpoint`).
    pub fn zmq(endpoint: impl Into<String>, replay_endpoint: Option<String>) -> Self {
        Self { enable_kv_cache_events: true, endpoint: endpoint.into(), replay_endpoint, ..Self::default() }
    }

    /// Parses vLLM's `--kv-events-config` JSON; unknown keys are refused, as vLLM refuses them.
    pub fn from_json(json: &str) -> Result<Self, KvEventsError> {
        let keys: KvEventsConfigKeys = serde_json::from_str(json).map_err(|e| KvEventsError::Parse(e.to_string()))?;
        let config = keys.into_config();
        config.check()?;
        Ok(config)
    }

    /// Whether events are published (`enable_kv_cache_events` and a publisher other than `null`).
    pub fn publishes(&self) -> bool {
        self.enable_kv_cache_events && self.publisher.as_deref().unwrap_or("zmq") != "null"
    }

    /// Refuses a publisher other than `zmq`/`null` and endpoints the publisher cannot use.
    pub fn check(&self) -> Result<(), KvEventsError> {
        match self.publisher.as_deref() {
            None | Some("zmq") | Some("null") => {}
            Some(other) => return Err(KvEventsError::UnknownPublisher(other.to_owned())),
        }
        if self.publishes() {
            tcp_endpoint(&self.endpoint, 0)?;
            if let Some(replay) = &self.replay_endpoint {
                tcp_endpoint(replay, 0)?;
            }
        }
        Ok(())
    }
}

/// The keys of [`KvEventsConfig`] (every one optional), for strict parsing.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct KvEventsConfigKeys {
    enable_kv_cache_events: Option<bool>,
    publisher: Option<String>,
    endpoint: Option<String>,
    replay_endpoint: Option<String>,
    buffer_steps: Option<usize>,
    hwm: Option<usize>,
    max_queue_size: Option<usize>,
    topic: Option<String>,
}

impl KvEventsConfigKeys {
    fn into_config(self) -> KvEventsConfig {
        let d = KvEventsConfig::default();
        KvEventsConfig {
            enable_kv_cache_events: self.enable_kv_cache_events.unwrap_or(d.enable_kv_cache_events),
            publisher: self.publisher,
            endpoint: self.endpoint.unwrap_or(d.endpoint),
            replay_endpoint: self.replay_endpoint,
            buffer_steps: self.buffer_steps.unwrap_or(d.buffer_steps),
            hwm: self.hwm.unwrap_or(d.hwm),
            max_queue_size: self.max_queue_size.unwrap_or(d.max_queue_size),
            topic: self.topic.unwrap_or(d.topic),
        }
    }
}

/// Where a socket goes: bound on an address, or connected to one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// `tcp://ADDR:PORT` to bind (a wildcard host as `0.0.0.0` or `[::]`).
    Bind(String),
    /// `tcp://HOST:PORT` to connect to.
    Connect(String),
}

/// `endpoint` for data-parallel rank `dp_rank` (its port plus the rank; port 0 stays 0, as
/// vLLM's `offset_endpoint_port`), and whether the PUB socket binds or connects there.
pub fn tcp_endpoint(endpoint: &str, dp_rank: u32) -> Result<Placement, KvEventsError> {
    let bad = |reason: &str| KvEventsError::Endpoint { endpoint: endpoint.to_owned(), reason: reason.to_owned() };
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(|| {
        bad("only tcp:// endpoints are served here (vLLM's ipc:// and inproc:// are not): e.g. tcp://*:5557")
    })?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| bad("no port: e.g. tcp://*:5557"))?;
    let port: u16 = port.parse().map_err(|_| bad("the port is not a number from 0 to 65535"))?;
    let port = if port == 0 {
        0
    } else {
        u16::try_from(u32::from(port) + dp_rank)
            .map_err(|_| bad("the port plus the data-parallel rank passes 65535"))?
    };
    if host.is_empty() {
        return Err(bad("no host: e.g. tcp://*:5557"));
    }
    Ok(match host {
        "*" | "0.0.0.0" => Placement::Bind(format!("tcp://0.0.0.0:{port}")),
        "[::]" | "::" | "[*]" => Placement::Bind(format!("tcp://[::]:{port}")),
        host if host.contains("::") => Placement::Bind(format!("tcp://{host}:{port}")),
        host => Placement::Connect(format!("tcp://{host}:{port}")),
    })
}

/// The replay endpoint for `dp_rank`: always bound, as vLLM binds it.
pub fn replay_bind_endpoint(endpoint: &str, dp_rank: u32) -> Result<String, KvEventsError> {
    Ok(match tcp_endpoint(endpoint, dp_rank)? {
        Placement::Bind(e) | Placement::Connect(e) => e,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllms_json_and_refuses_what_it_cannot_serve() {
        let c = KvEventsConfig::from_json(r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5600","replay_endpoint":"tcp://*:5601","topic":"kv"}"#)
            .expect("valid");
        assert!(c.publishes());
        assert_eq!((c.endpoint.as_str(), c.buffer_steps, c.topic.as_str()), ("tcp://*:5600", 10_000, "kv"));
        assert!(!KvEventsConfig::from_json(r#"{"enable_kv_cache_events":false}"#).expect("valid").publishes());
        assert!(matches!(KvEventsConfig::from_json(r#"{"endpoint":1}"#), Err(KvEventsError::Parse(_))));
        assert!(matches!(KvEventsConfig::from_json(r#"{"nope":1}"#), Err(KvEventsError::Parse(_))));
        assert!(matches!(
            KvEventsConfig::from_json(r#"{"enable_kv_cache_events":true,"publisher":"kafka"}"#),
            Err(KvEventsError::UnknownPublisher(_))
        ));
        assert!(matches!(
            KvEventsConfig::from_json(r#"{"enable_kv_cache_events":true,"endpoint":"ipc:///tmp/x"}"#),
            Err(KvEventsError::Endpoint { .. })
        ));
    }

    #[test]
    fn a_wildcard_binds_and_a_rank_shifts_the_port() {
        assert_eq!(tcp_endpoint("tcp://*:5557", 2), Ok(Placement::Bind("tcp://0.0.0.0:5559".into())));
        assert_eq!(tcp_endpoint("tcp://*:0", 3), Ok(Placement::Bind("tcp://0.0.0.0:0".into())));
        assert_eq!(tcp_endpoint("tcp://10.0.0.1:6000", 0), Ok(Placement::Connect("tcp://10.0.0.1:6000".into())));
        assert!(tcp_endpoint("tcp://*:65535", 1).is_err());
        assert_eq!(replay_bind_endpoint("tcp://127.0.0.1:7000", 1), Ok("tcp://127.0.0.1:7001".into()));
    }
}
