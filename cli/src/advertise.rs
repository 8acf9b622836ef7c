//! `pdflow serve` advertising its engine for `pdflow proxy --discover`: what it says (role, HTTP
//! URL, P's bootstrap port, the KV-event endpoints with the engine's host in place of a wildcard)
//! and where (a producer at its own bootstrap, either role at each `--advertise-to`). The posting
//! itself is [`pdflow_actors::advertise`]'s.

use pdflow_actors::advertise::{new_generation, Advertiser};
use pdflow_messages::discovery::{AdvertiseEngine, KvEventsEndpoint};
use pdflow_messages::proxy::Pool;
use pdflow_sim_engine::kv_events::publisher::PublisherEndpoints;

/// One engine as `pdflow serve` runs it, for its advertisement.
pub struct Served<'a> {
    pub producer: bool,
    /// The address its HTTP API is bound to.
    pub http_addr: std::net::SocketAddr,
    pub engine_id: &'a str,
    /// P: the bootstrap its workers registered with (`http://host:port`).
    pub bootstrap_url: Option<String>,
    /// Where each of its data-parallel ranks publishes KV events, and the topic.
    pub kv_events: Vec<PublisherEndpoints>,
    pub topic: String,
    /// The host the engine binds (`--host`), put in place of a wildcard.
    pub host: &'a str,
}

/// Starts advertising `served` at its bootstraps (none: nothing to advertise, `None`).
pub fn start(
    served: Served<'_>,
    advertise_to: &[String],
    secret: Option<pdflow_auth::ClusterSecret>,
) -> anyhow::Result<Option<Advertiser>> {
    let mut bootstraps: Vec<String> = Vec::new();
    let own = served.bootstrap_url.clone().filter(|_| served.producer);
    for url in own.iter().chain(advertise_to) {
        let url = url.trim_end_matches('/').to_string();
        if !bootstraps.contains(&url) {
            bootstraps.push(url);
        }
    }
    if bootstraps.is_empty() {
        return Ok(None);
    }
    let bootstrap_port = match (served.producer, &served.bootstrap_url) {
        (true, Some(url)) => Some(
            url.rsplit(':')
                .next()
                .and_then(|p| p.trim_end_matches('/').parse::<u16>().ok())
                .ok_or_else(|| anyhow::anyhow!("P's bootstrap URL {url} has no port"))?,
        ),
        (true, None) => anyhow::bail!("a producer without a bootstrap cannot be advertised"),
        (false, _) => None,
    };
    let kv_events = (served.kv_events.iter())
        .map(|e| KvEventsEndpoint {
            endpoint: reachable(&e.endpoint, served.host),
            replay_endpoint: e.replay_endpoint.as_deref().map(|r| reachable(r, served.host)),
            topic: served.topic.clone(),
        })
        .collect();
    let engine = AdvertiseEngine {
        engine_id: served.engine_id.into(),
        role: if served.producer { Pool::Prefill } else { Pool::Decode },
        url: format!("http://{}", served.http_addr),
        bootstrap_port,
        kv_events,
        generation: new_generation(),
    };
    Ok(Some(Advertiser::start(bootstraps, engine, secret)?))
}

/// `endpoint` (`tcp://HOST:PORT`) with `host` in place of a wildcard host (`*`, `0.0.0.0`, `[::]`)
/// it was bound on.
fn reachable(endpoint: &str, host: &str) -> String {
    let Some((head, port)) = endpoint.rsplit_once(':') else { return endpoint.to_owned() };
    match head.strip_prefix("tcp://") {
        Some("*" | "0.0.0.0" | "[::]" | "[*]") => {
            let host = if host.contains(':') && !host.starts_with('[') { format!("[{host}]") } else { host.to_owned() };
            format!("tcp://{host}:{port}")
        }
        _ => endpoint.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wildcard_endpoint_is_advertised_at_the_engine_s_host() {
        assert_eq!(reachable("tcp://0.0.0.0:5557", "10.0.0.3"), "tcp://10.0.0.3:5557");
        assert_eq!(reachable("tcp://*:5557", "::1"), "tcp://[::1]:5557");
        assert_eq!(reachable("tcp://10.0.0.4:5557", "10.0.0.3"), "tcp://10.0.0.4:5557");
    }
}
