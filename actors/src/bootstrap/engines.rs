//! The bootstrap's second table: engines that advertise themselves here, P and D alike, with
//! their role, HTTP URL, P's bootstrap port and KV-event endpoints, for the proxy's discovery
//! (`POST /engines`, `GET /engines`; the bodies are [`pdflow_messages::discovery`]'s).
//!
//! It is kept apart from `/query`'s table of P workers: vLLM's readers of `/query` (its Mooncake
//! proxy, D's receivers) see nothing of it. An engine repeats its advertisement every second; one
//! not heard from for [`ADVERTISED_TTL`] is no longer listed. A newer generation of an engine id
//! replaces the older (a restart, perhaps on another port), an older one is refused. The calls
//! are admitted as `/register` and `/query` are (signed under the cluster secret); without a
//! secret an engine may be changed only from the peer address that advertised it.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::Response;
use kameo::prelude::*;
use pdflow_auth::http::Call;
use pdflow_messages::discovery::{AdvertiseEngine, AdvertiseFrom, AdvertiseRejected, EnginesResponse, ListAdvertised};
use pdflow_messages::proxy::Pool;
use pdflow_messages::EngineId;

use super::{refused, Bootstrap, Http, ASK_DEADLINE, GONE};

/// How long an engine stays listed after its last advertisement (it repeats one every second).
pub const ADVERTISED_TTL: Duration = Duration::from_secs(10);
/// The most engines one bootstrap lists.
pub const MAX_ADVERTISED: usize = 1024;
/// The most KV-event endpoints one engine advertises (one per data-parallel rank).
const MAX_KV_ENDPOINTS: usize = 256;
/// The longest engine id, URL or endpoint taken.
const MAX_FIELD: usize = 1024;

/// One advertised engine: what it said, from where, and when last.
#[derive(Debug, Clone)]
struct Entry {
    ad: AdvertiseEngine,
    from: Option<IpAddr>,
    seen: Instant,
}

/// The engines advertised here, by engine id.
#[derive(Debug, Default)]
pub(super) struct Advertised {
    engines: BTreeMap<EngineId, Entry>,
    /// Without a cluster secret: an engine changes only from the address that advertised it.
    by_address: bool,
}

impl Advertised {
    /// An empty table; `by_address` without a cluster secret.
    pub fn new(by_address: bool) -> Self {
        Self { engines: BTreeMap::new(), by_address }
    }

    /// Records `ad`, from `from` (none: this process), at `now`.
    pub fn advertise(
        &mut self,
        ad: AdvertiseEngine,
        from: Option<IpAddr>,
        now: Instant,
    ) -> Result<(), AdvertiseRejected> {
        let ad = checked(ad)?;
        self.expire(now);
        match self.engines.get_mut(&ad.engine_id) {
            Some(entry) => {
                let (old, new) = (entry.ad.generation, ad.generation);
                if new < old {
                    return Err(AdvertiseRejected::StaleGeneration {
                        engine_id: ad.engine_id,
                        advertised: old,
                        offered: new,
                    });
                }
                let same = entry.ad == ad;
                if self.by_address && entry.from != from {
                    if same {
                        // An identical advertisement from elsewhere changes nothing (nor keeps it).
                        return Ok(());
                    }
                    return Err(AdvertiseRejected::NotTheAdvertiser {
                        engine_id: ad.engine_id,
                        advertised_from: shown(entry.from),
                        from: shown(from),
                    });
                }
                if !same {
                    tracing::info!(engine_id = %ad.engine_id, role = ad.role.name(), url = %ad.url,
                        previous_url = %entry.ad.url, generation = new, "engine advertised again, changed");
                }
                *entry = Entry { ad, from, seen: now };
            }
            None => {
                if self.engines.len() >= MAX_ADVERTISED {
                    return Err(AdvertiseRejected::Full { limit: MAX_ADVERTISED, ttl_s: ADVERTISED_TTL.as_secs() });
                }
                tracing::info!(engine_id = %ad.engine_id, role = ad.role.name(), url = %ad.url,
                    generation = ad.generation, "engine advertised");
                self.engines.insert(ad.engine_id.clone(), Entry { ad, from, seen: now });
            }
        }
        Ok(())
    }

    /// The engines heard from within [`ADVERTISED_TTL`] of `now`.
    pub fn list(&mut self, now: Instant) -> EnginesResponse {
        self.expire(now);
        EnginesResponse { engines: self.engines.values().map(|e| e.ad.clone()).collect() }
    }

    fn expire(&mut self, now: Instant) {
        self.engines.retain(|id, e| {
            let live = now.saturating_duration_since(e.seen) < ADVERTISED_TTL;
            if !live {
                tracing::info!(engine_id = %id, url = %e.ad.url, "advertised engine not heard from: no longer listed");
            }
            live
        });
    }
}

fn shown(from: Option<IpAddr>) -> String {
    from.map_or_else(|| "this process".to_string(), |ip| ip.to_string())
}

/// `ad` checked, its URL without a trailing `/`.
fn checked(mut ad: AdvertiseEngine) -> Result<AdvertiseEngine, AdvertiseRejected> {
    let id = ad.engine_id.clone();
    let field = |reason: String| AdvertiseRejected::BadField { engine_id: id.clone(), reason };
    if ad.engine_id.as_str().is_empty() || ad.engine_id.as_str().len() > MAX_FIELD {
        return Err(field(format!("an engine id of 1 to {MAX_FIELD} bytes")));
    }
    ad.url = ad.url.trim_end_matches('/').to_owned();
    let url_ok = ad.url.len() <= MAX_FIELD
        && reqwest::Url::parse(&ad.url)
            .is_ok_and(|u| u.scheme() == "http" && u.host_str().is_some() && u.path() == "/" && u.query().is_none());
    if !url_ok {
        return Err(AdvertiseRejected::BadUrl { engine_id: ad.engine_id.clone(), url: ad.url.clone() });
    }
    match (ad.role, ad.bootstrap_port) {
        (Pool::Prefill, None | Some(0)) => {
            return Err(field("a prefill engine advertises the port of its bootstrap (`bootstrap_port`)".into()))
        }
        (Pool::Decode, Some(_)) => return Err(field("a decode engine has no `bootstrap_port`".into())),
        _ => {}
    }
    if ad.kv_events.len() > MAX_KV_ENDPOINTS {
        return Err(field(format!("at most {MAX_KV_ENDPOINTS} KV-event endpoints")));
    }
    for e in &ad.kv_events {
        let endpoints = std::iter::once(&e.endpoint).chain(e.replay_endpoint.as_ref());
        if endpoints.clone().any(|x| !x.starts_with("tcp://") || x.len() > MAX_FIELD) || e.topic.len() > MAX_FIELD {
            return Err(field(format!("KV-event endpoint `{}`: expected tcp://HOST:PORT", e.endpoint)));
        }
    }
    Ok(ad)
}

// ---- The actor's side -----------------------------------------------------------------------

/// An advertisement made in this process or over HTTP (`POST /engines`).
impl Message<AdvertiseFrom> for Bootstrap {
    type Reply = Result<(), AdvertiseRejected>;

    async fn handle(&mut self, msg: AdvertiseFrom, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.advertised.advertise(msg.engine, msg.peer, Instant::now())
    }
}

impl Message<ListAdvertised> for Bootstrap {
    type Reply = Result<EnginesResponse, std::convert::Infallible>;

    async fn handle(&mut self, _msg: ListAdvertised, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        Ok(self.advertised.list(Instant::now()))
    }
}

// ---- HTTP ------------------------------------------------------------------------------------

/// `POST /engines`: an engine advertises itself (admitted as `/register` is).
pub(super) async fn http_advertise(
    State(http): State<Http>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let call = Call::Register;
    let admitted = match http.admit(call, &method, &uri, &headers, &body, peer) {
        Ok(a) => a,
        Err(why) => return refused(why),
    };
    let engine: AdvertiseEngine = match serde_json::from_slice(&body) {
        Ok(e) => e,
        Err(e) => {
            let msg = format!(
                "invalid /engines body ({e}); expected {{\"engine_id\", \"role\": \"prefill\"|\"decode\", \"url\", \"bootstrap_port\" (prefill), \"kv_events\", \"generation\"}}"
            );
            return http.error(call, &admitted, StatusCode::BAD_REQUEST, msg);
        }
    };
    if !http.actor.is_alive() {
        return http.unavailable(call, &admitted, GONE.to_owned());
    }
    let ad = AdvertiseFrom { engine, peer: Some(peer.ip().to_canonical()) };
    match tokio::time::timeout(ASK_DEADLINE, http.actor.ask(ad)).await {
        Ok(Ok(())) => http.answer(call, &admitted, StatusCode::OK, &serde_json::json!({"status": "ok"})),
        Ok(Err(SendError::HandlerError(rejected))) => {
            tracing::warn!(reason = %rejected, %peer, "advertisement refused");
            let status = if rejected.is_takeover() { StatusCode::FORBIDDEN } else { StatusCode::BAD_REQUEST };
            http.error(call, &admitted, status, rejected.to_string())
        }
        Ok(Err(_)) => http.unavailable(call, &admitted, GONE.to_owned()),
        Err(_) => http.unavailable(call, &admitted, format!("bootstrap did not answer within {ASK_DEADLINE:?}")),
    }
}

/// `GET /engines`: the engines advertised here (admitted as `/query` is).
pub(super) async fn http_engines(
    State(http): State<Http>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let call = Call::Query;
    let admitted = match http.admit(call, &method, &uri, &headers, b"", peer) {
        Ok(a) => a,
        Err(why) => return refused(why),
    };
    if !http.actor.is_alive() {
        return http.unavailable(call, &admitted, GONE.to_owned());
    }
    match tokio::time::timeout(ASK_DEADLINE, http.actor.ask(ListAdvertised)).await {
        Ok(Ok(listed)) => {
            let body = serde_json::to_value(listed).unwrap_or_default();
            http.answer(call, &admitted, StatusCode::OK, &body)
        }
        Ok(Err(_)) => http.unavailable(call, &admitted, GONE.to_owned()),
        Err(_) => http.unavailable(call, &admitted, format!("bootstrap did not answer within {ASK_DEADLINE:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdflow_messages::discovery::KvEventsEndpoint;

    fn ad(id: &str, role: Pool, url: &str, generation: u64) -> AdvertiseEngine {
        AdvertiseEngine {
            engine_id: id.into(),
            role,
            url: url.into(),
            bootstrap_port: (role == Pool::Prefill).then_some(8998),
            kv_events: Vec::new(),
            generation,
        }
    }

    #[test]
    fn a_newer_generation_replaces_the_older_and_an_older_one_is_refused() {
        let mut table = Advertised::new(false);
        let now = Instant::now();
        table.advertise(ad("p", Pool::Prefill, "http://10.0.0.1:8010/", 5), None, now).expect("taken");
        table.advertise(ad("d", Pool::Decode, "http://10.0.0.2:8020", 1), None, now).expect("taken");
        table.advertise(ad("p", Pool::Prefill, "http://10.0.0.1:8011", 6), None, now).expect("restarted");
        let stale = table.advertise(ad("p", Pool::Prefill, "http://10.0.0.1:8010", 5), None, now);
        assert!(matches!(stale, Err(AdvertiseRejected::StaleGeneration { advertised: 6, offered: 5, .. })));
        let listed = table.list(now).engines;
        let urls: Vec<&str> = listed.iter().map(|e| e.url.as_str()).collect();
        assert_eq!(urls, ["http://10.0.0.2:8020", "http://10.0.0.1:8011"]);
    }

    #[test]
    fn an_engine_not_heard_from_is_no_longer_listed() {
        let mut table = Advertised::new(false);
        let start = Instant::now();
        table.advertise(ad("d", Pool::Decode, "http://h:1", 1), None, start).expect("taken");
        table.advertise(ad("e", Pool::Decode, "http://h:2", 1), None, start).expect("taken");
        let later = start + ADVERTISED_TTL - Duration::from_secs(1);
        table.advertise(ad("e", Pool::Decode, "http://h:2", 1), None, later).expect("repeated");
        let listed = table.list(start + ADVERTISED_TTL).engines;
        assert_eq!(listed.iter().map(|e| e.engine_id.as_str()).collect::<Vec<_>>(), ["e"]);
    }

    #[test]
    fn bad_advertisements_are_refused_and_change_nothing() {
        let mut table = Advertised::new(false);
        let now = Instant::now();
        let mut no_port = ad("p", Pool::Prefill, "http://h:1", 1);
        no_port.bootstrap_port = None;
        let mut d_port = ad("d", Pool::Decode, "http://h:2", 1);
        d_port.bootstrap_port = Some(8998);
        let mut wild = ad("d", Pool::Decode, "http://h:2", 1);
        wild.kv_events.push(KvEventsEndpoint {
            endpoint: "ipc:///x".into(),
            replay_endpoint: None,
            topic: String::new(),
        });
        for bad in [
            no_port,
            d_port,
            wild,
            ad("", Pool::Decode, "http://h:2", 1),
            ad("d", Pool::Decode, "https://h:2", 1),
            ad("d", Pool::Decode, "http://h:2/v1", 1),
            ad("d", Pool::Decode, "not a url", 1),
        ] {
            assert!(table.advertise(bad.clone(), None, now).is_err(), "{bad:?}");
        }
        assert!(table.list(now).engines.is_empty());
    }

    #[test]
    fn without_a_secret_only_the_advertiser_s_address_changes_an_engine() {
        let mut table = Advertised::new(true);
        let now = Instant::now();
        let (home, other): (IpAddr, IpAddr) = ("10.0.0.2".parse().expect("ip"), "10.0.0.9".parse().expect("ip"));
        table.advertise(ad("d", Pool::Decode, "http://10.0.0.2:1", 1), Some(home), now).expect("taken");
        let takeover = table.advertise(ad("d", Pool::Decode, "http://10.0.0.9:1", 2), Some(other), now);
        assert!(matches!(takeover, Err(ref e) if e.is_takeover()), "{takeover:?}");
        table.advertise(ad("d", Pool::Decode, "http://10.0.0.2:1", 1), Some(other), now).expect("identical: accepted");
        table.advertise(ad("d", Pool::Decode, "http://10.0.0.2:2", 2), Some(home), now).expect("its own restart");
        assert_eq!(table.list(now).engines[0].url, "http://10.0.0.2:2");
    }
}
