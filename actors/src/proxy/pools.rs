//! The proxy's P and D pools as the Proxy actor keeps them: one entry per engine, by a stable
//! index. An engine that joins ([`Pools::add`]) gets the next index; one that leaves
//! ([`Pools::remove`]) stays as a tombstone, never chosen and never reused, so that a
//! [`pdflow_messages::proxy::RouteDecision`] in flight and its `RouteDone` keep naming the engine
//! they were routed to. A draining engine ([`Pools::drain`]) is not chosen either but finishes the
//! requests it has; each entry counts the requests in flight on it.
//!
//! The pools outlive the actor's restarts, and with a roster file the proxy process's, through
//! the [`Roster`] in its arguments: a restarted actor starts from the saved engines (tombstones
//! included), with their KV-event endpoints and what discovery knows of them, rather than from
//! the command line.

use std::collections::{BTreeMap, HashMap};

use pdflow_messages::discovery::KvEventsEndpoint;
use pdflow_messages::proxy::{AdminError, EngineInfo, EngineState, Pool};
use pdflow_messages::EngineId;

use super::discovery::Known;
use super::kv_events::KvEventSource;
use super::roster::{Roster, Saved, SavedDecode, SavedPrefill, FORMAT};
use super::{PrefillTarget, DEFAULT_BOOTSTRAP_PORT};
use crate::ActorError;

/// One prefill engine.
#[derive(Debug)]
pub(super) struct PrefillState {
    pub url: String,
    pub bootstrap_port: u16,
    /// `http://{host of url}:{bootstrap_port}` (D's `remote_bootstrap_addr`).
    pub bootstrap_addr: String,
    pub dp_engine_id: BTreeMap<u32, EngineId>,
    pub healthy: bool,
    pub state: EngineState,
    pub in_flight: usize,
    pub routed: u64,
    /// Where it publishes KV events (read by a `kv_aware` pool).
    pub kv_events: Vec<KvEventSource>,
}

/// One decode engine.
#[derive(Debug)]
pub(super) struct DecodeState {
    pub url: String,
    pub answered: bool,
    pub healthy: bool,
    pub state: EngineState,
    pub in_flight: usize,
    pub routed: u64,
    pub kv_events: Vec<KvEventSource>,
}

/// The engines of both pools, by index.
#[derive(Debug, Default)]
pub(super) struct Pools {
    pub prefill: Vec<PrefillState>,
    pub decode: Vec<DecodeState>,
    /// The engines discovery found, by engine id: where each is in the pools, and as what it was
    /// advertised last ([`super::discovery`]).
    pub discovered: HashMap<EngineId, Known>,
}

/// Why a URL is not an engine's `http://host:port`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum UrlProblem {
    #[error("{0}")]
    Parse(#[source] crate::error::UrlParseError),
    #[error("only http:// URLs with a host are served")]
    Unsupported,
    #[error("a base URL takes no path, query or fragment")]
    NotBase,
}

/// `url` without its trailing `/`, checked to be `http://host[:port]`, and its host (IPv6 hosts
/// keep their brackets).
pub(super) fn parse_url(url: &str) -> Result<(String, String), UrlProblem> {
    let trimmed = url.trim_end_matches('/').to_owned();
    let parsed = reqwest::Url::parse(&trimmed).map_err(UrlProblem::Parse)?;
    match parsed.host_str() {
        Some(host) if parsed.scheme() == "http" => Ok((trimmed, host.to_owned())),
        _ => Err(UrlProblem::Unsupported),
    }
}

/// [`parse_url`], and no path, query or fragment (what an engine joining at run time must be).
fn parse_base_url(url: &str) -> Result<(String, String), UrlProblem> {
    let (trimmed, host) = parse_url(url.trim())?;
    let parsed = reqwest::Url::parse(&trimmed).map_err(UrlProblem::Parse)?;
    if parsed.path() != "/" || parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(UrlProblem::NotBase);
    }
    Ok((trimmed, host))
}

pub(super) fn check_url(url: &str, pool: &'static str) -> Result<(String, String), ActorError> {
    parse_url(url).map_err(|problem| match problem {
        UrlProblem::Parse(source) => ActorError::InvalidUrl { pool, url: url.to_owned(), source },
        UrlProblem::Unsupported | UrlProblem::NotBase => ActorError::UnsupportedUrl { pool, url: url.to_owned() },
    })
}

impl PrefillState {
    fn new(url: String, host: &str, bootstrap_port: u16, state: EngineState, kv_events: Vec<KvEventSource>) -> Self {
        // D's `remote_bootstrap_addr`: P's host, the bootstrap's port.
        let bootstrap_addr = format!("http://{host}:{bootstrap_port}");
        Self {
            url,
            bootstrap_port,
            bootstrap_addr,
            dp_engine_id: BTreeMap::new(),
            healthy: false,
            state,
            in_flight: 0,
            routed: 0,
            kv_events,
        }
    }

    /// Healthy, serving, its engine ids known: a candidate for new requests.
    pub fn routable(&self) -> bool {
        self.healthy && self.state == EngineState::Serving && !self.dp_engine_id.is_empty()
    }
}

impl DecodeState {
    fn new(url: String, state: EngineState, kv_events: Vec<KvEventSource>) -> Self {
        Self { url, answered: false, healthy: false, state, in_flight: 0, routed: 0, kv_events }
    }

    /// Healthy and serving: a candidate for new requests.
    pub fn routable(&self) -> bool {
        self.healthy && self.state == EngineState::Serving
    }
}

impl Pools {
    /// The pools of `roster` when an earlier incarnation saved some, else those of the command
    /// line, each engine with its `sources` of KV events (then saved).
    pub fn start(
        prefill: &[PrefillTarget],
        decode: &[String],
        sources: &[KvEventSource],
        roster: &Roster,
    ) -> Result<Self, ActorError> {
        let pools = match roster.load() {
            Some(saved) => {
                let mut pools = Pools { discovered: saved.discovered, ..Pools::default() };
                for p in saved.prefill {
                    let (url, host) = check_url(&p.url, "prefill")?;
                    pools.prefill.push(PrefillState::new(url, &host, p.bootstrap_port, p.state, p.kv_events));
                }
                for d in saved.decode {
                    pools.decode.push(DecodeState::new(check_url(&d.url, "decode")?.0, d.state, d.kv_events));
                }
                if let Some(file) = roster.file() {
                    tracing::info!(
                        file = %file.display(),
                        prefill = pools.prefill.len(),
                        decode = pools.decode.len(),
                        "proxy: starting from the roster file's engines (tombstones included), not the command line's"
                    );
                }
                pools
            }
            None => {
                let mut pools = Pools::default();
                let of = |url: &str| sources.iter().filter(|s| s.engine_url == url).cloned().collect::<Vec<_>>();
                for p in prefill {
                    let (url, host) = check_url(&p.url, "prefill")?;
                    let kv = of(&url);
                    pools.prefill.push(PrefillState::new(url, &host, p.bootstrap_port, EngineState::Serving, kv));
                }
                for d in decode {
                    let url = check_url(d, "decode")?.0;
                    let kv = of(&url);
                    pools.decode.push(DecodeState::new(url, EngineState::Serving, kv));
                }
                pools.save(roster);
                pools
            }
        };
        Ok(pools)
    }

    /// Writes the engines to `roster`, for the next incarnation.
    pub fn save(&self, roster: &Roster) {
        roster.store(Saved {
            format: FORMAT,
            prefill: (self.prefill.iter())
                .map(|p| SavedPrefill {
                    url: p.url.clone(),
                    bootstrap_port: p.bootstrap_port,
                    state: p.state,
                    kv_events: p.kv_events.clone(),
                })
                .collect(),
            decode: (self.decode.iter())
                .map(|d| SavedDecode { url: d.url.clone(), state: d.state, kv_events: d.kv_events.clone() })
                .collect(),
            discovered: self.discovered.clone(),
        });
    }

    /// The engine at `url` that has not been removed.
    pub fn find_live(&self, url: &str) -> Option<(Pool, usize)> {
        let url = url.trim().trim_end_matches('/');
        let p = self.prefill.iter().position(|p| p.url == url && p.state != EngineState::Removed);
        let d = self.decode.iter().position(|d| d.url == url && d.state != EngineState::Removed);
        p.map(|i| (Pool::Prefill, i)).or(d.map(|j| (Pool::Decode, j)))
    }

    /// A new engine at the end of `pool`, publishing its KV events at `kv_events`: its index.
    /// Refused (nothing changed) for a bad URL or KV-events endpoint, a URL already in the proxy,
    /// or a bootstrap port given for a D.
    pub fn add(
        &mut self,
        pool: Pool,
        url: &str,
        bootstrap_port: Option<u16>,
        kv_events: &[KvEventsEndpoint],
    ) -> Result<usize, AdminError> {
        let (url, host) =
            parse_base_url(url).map_err(|p| AdminError::BadUrl { url: url.to_owned(), reason: p.to_string() })?;
        if let Some((pool, index)) = self.find_live(&url) {
            let state = self.info(pool, index).map_or(EngineState::Serving, |i| i.state);
            return Err(AdminError::Duplicate { url, pool, state });
        }
        let kv = (kv_events.iter())
            .map(|e| KvEventSource::of(&url, e))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| AdminError::BadKvEvents { url: url.clone(), reason: e.to_string() })?;
        match pool {
            Pool::Prefill => {
                let port = bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT);
                if port == 0 {
                    return Err(AdminError::BadUrl { url, reason: "bootstrap port 0".into() });
                }
                self.prefill.push(PrefillState::new(url, &host, port, EngineState::Serving, kv));
                Ok(self.prefill.len() - 1)
            }
            Pool::Decode => {
                if bootstrap_port.is_some() {
                    return Err(AdminError::BootstrapPortForDecode);
                }
                self.decode.push(DecodeState::new(url, EngineState::Serving, kv));
                Ok(self.decode.len() - 1)
            }
        }
    }

    /// Entry `index` of `pool` publishes its KV events at `sources` now.
    pub fn set_kv_sources(&mut self, pool: Pool, index: usize, sources: Vec<KvEventSource>) {
        match pool {
            Pool::Prefill => self.prefill.get_mut(index).map(|p| p.kv_events = sources),
            Pool::Decode => self.decode.get_mut(index).map(|d| d.kv_events = sources),
        };
    }

    /// The URL and KV-event sources of entry `index` of `pool`.
    pub fn kv_sources(&self, pool: Pool, index: usize) -> Option<(String, Vec<KvEventSource>)> {
        match pool {
            Pool::Prefill => self.prefill.get(index).map(|p| (p.url.clone(), p.kv_events.clone())),
            Pool::Decode => self.decode.get(index).map(|d| (d.url.clone(), d.kv_events.clone())),
        }
    }

    /// The engine at `url` takes no new request (idempotent).
    pub fn drain(&mut self, url: &str) -> Result<(Pool, usize), AdminError> {
        let (pool, index) = self.find_live(url).ok_or_else(|| AdminError::UnknownEngine { url: url.to_owned() })?;
        match pool {
            Pool::Prefill => self.prefill[index].state = EngineState::Draining,
            Pool::Decode => self.decode[index].state = EngineState::Draining,
        }
        Ok((pool, index))
    }

    /// The draining engine at `url` takes new requests again (idempotent: a serving one stays so).
    pub fn undrain(&mut self, url: &str) -> Result<(Pool, usize), AdminError> {
        let (pool, index) = self.find_live(url).ok_or_else(|| AdminError::UnknownEngine { url: url.to_owned() })?;
        match pool {
            Pool::Prefill => self.prefill[index].state = EngineState::Serving,
            Pool::Decode => self.decode[index].state = EngineState::Serving,
        }
        Ok((pool, index))
    }

    /// The engine at `url` becomes a tombstone; refused while requests are in flight on it,
    /// unless `force`.
    pub fn remove(&mut self, url: &str, force: bool) -> Result<(Pool, usize), AdminError> {
        let (pool, index) = self.find_live(url).ok_or_else(|| AdminError::UnknownEngine { url: url.to_owned() })?;
        let in_flight = self.info(pool, index).map_or(0, |i| i.in_flight);
        if in_flight > 0 && !force {
            return Err(AdminError::InFlight { url: url.trim_end_matches('/').to_owned(), in_flight });
        }
        match pool {
            Pool::Prefill => {
                let p = &mut self.prefill[index];
                p.state = EngineState::Removed;
                p.healthy = false;
            }
            Pool::Decode => {
                let d = &mut self.decode[index];
                d.state = EngineState::Removed;
                d.healthy = false;
            }
        }
        Ok((pool, index))
    }

    /// One engine as the admin API lists it (tombstones too, by index).
    pub fn info(&self, pool: Pool, index: usize) -> Option<EngineInfo> {
        match pool {
            Pool::Prefill => self.prefill.get(index).map(|p| EngineInfo {
                pool,
                index,
                url: p.url.clone(),
                bootstrap_addr: Some(p.bootstrap_addr.clone()),
                state: p.state,
                healthy: p.healthy && !p.dp_engine_id.is_empty(),
                engine_ids: p.dp_engine_id.clone(),
                in_flight: p.in_flight,
                routed: p.routed,
                kv_events: p.kv_events.iter().map(KvEventSource::endpoint).collect(),
            }),
            Pool::Decode => self.decode.get(index).map(|d| EngineInfo {
                pool,
                index,
                url: d.url.clone(),
                bootstrap_addr: None,
                state: d.state,
                healthy: d.healthy,
                engine_ids: BTreeMap::new(),
                in_flight: d.in_flight,
                routed: d.routed,
                kv_events: d.kv_events.iter().map(KvEventSource::endpoint).collect(),
            }),
        }
    }

    /// Every engine not removed, P first, by index.
    pub fn list(&self) -> Vec<EngineInfo> {
        let p = (0..self.prefill.len()).filter_map(|i| self.info(Pool::Prefill, i));
        let d = (0..self.decode.len()).filter_map(|j| self.info(Pool::Decode, j));
        p.chain(d).filter(|e| e.state != EngineState::Removed).collect()
    }

    /// The (P, dp rank) new requests may go to, but those in `exclude`.
    pub fn prefill_candidates(&self, exclude: &[usize]) -> Vec<(usize, u32)> {
        self.prefill
            .iter()
            .enumerate()
            .filter(|(i, p)| p.routable() && !exclude.contains(i))
            .flat_map(|(i, p)| p.dp_engine_id.keys().map(move |dp| (i, *dp)))
            .collect()
    }

    /// The D new requests may go to.
    pub fn decode_candidates(&self) -> Vec<usize> {
        (0..self.decode.len()).filter(|&j| self.decode[j].routable()).collect()
    }

    /// A request was routed to D `dj` (and P `pi` when `disaggregated`).
    pub fn routed(&mut self, pi: usize, dj: usize, disaggregated: bool) {
        if disaggregated {
            if let Some(p) = self.prefill.get_mut(pi) {
                p.in_flight += 1;
                p.routed += 1;
            }
        }
        if let Some(d) = self.decode.get_mut(dj) {
            d.in_flight += 1;
            d.routed += 1;
        }
    }

    /// A request routed by [`Pools::routed`] ended.
    pub fn done(&mut self, pi: usize, dj: usize, disaggregated: bool) {
        if disaggregated {
            if let Some(p) = self.prefill.get_mut(pi) {
                p.in_flight = p.in_flight.saturating_sub(1);
            }
        }
        if let Some(d) = self.decode.get_mut(dj) {
            d.in_flight = d.in_flight.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pools() -> Pools {
        let prefill = [PrefillTarget { url: "http://127.0.0.1:8010/".into(), bootstrap_port: 8998 }];
        Pools::start(&prefill, &["http://127.0.0.1:8020".into()], &[], &Roster::default()).expect("valid pools")
    }

    #[test]
    fn an_added_engine_gets_a_new_index_and_a_removed_one_stays_a_tombstone() {
        let mut pools = pools();
        assert_eq!(pools.add(Pool::Decode, "http://127.0.0.1:8021", None, &[]), Ok(1));
        pools.decode[1].healthy = true;
        pools.decode[0].healthy = true;
        assert_eq!(pools.decode_candidates(), [0, 1]);
        assert_eq!(pools.remove("http://127.0.0.1:8020/", false), Ok((Pool::Decode, 0)));
        assert_eq!(pools.decode_candidates(), [1], "a tombstone is never a candidate");
        // The same URL again: a new index, the tombstone untouched.
        assert_eq!(pools.add(Pool::Decode, "http://127.0.0.1:8020", None, &[]), Ok(2));
        assert_eq!(pools.decode[0].state, EngineState::Removed);
        let listed: Vec<(usize, &str)> = pools.list().iter().map(|e| (e.index, e.pool.name())).collect();
        assert_eq!(listed, [(0, "prefill"), (1, "decode"), (2, "decode")]);
    }

    #[test]
    fn a_drained_engine_finishes_its_requests_and_is_removed_only_when_idle_or_forced() {
        let mut pools = pools();
        pools.prefill[0].healthy = true;
        pools.prefill[0].dp_engine_id.insert(0, EngineId::new("e0"));
        pools.decode[0].healthy = true;
        pools.routed(0, 0, true);
        pools.routed(0, 0, true);
        assert_eq!(pools.drain("http://127.0.0.1:8020"), Ok((Pool::Decode, 0)));
        assert!(pools.decode_candidates().is_empty(), "draining: no new request");
        assert_eq!(pools.prefill_candidates(&[]), [(0, 0)]);
        assert_eq!(
            pools.remove("http://127.0.0.1:8020", false),
            Err(AdminError::InFlight { url: "http://127.0.0.1:8020".into(), in_flight: 2 })
        );
        pools.done(0, 0, true);
        assert_eq!(pools.info(Pool::Decode, 0).map(|i| i.in_flight), Some(1));
        assert_eq!(pools.remove("http://127.0.0.1:8010", true), Ok((Pool::Prefill, 0)), "forced");
        pools.done(0, 0, true);
        assert_eq!(pools.remove("http://127.0.0.1:8020", false), Ok((Pool::Decode, 0)));
        // A late RouteDone of a removed engine changes nothing.
        pools.done(0, 0, true);
        assert!(pools.list().is_empty());
        assert_eq!(pools.info(Pool::Decode, 0).map(|i| (i.in_flight, i.routed)), Some((0, 2)));
    }

    #[test]
    fn a_drained_engine_is_put_back_into_service() {
        let mut pools = pools();
        pools.decode[0].healthy = true;
        assert_eq!(pools.drain("http://127.0.0.1:8020"), Ok((Pool::Decode, 0)));
        assert!(pools.decode_candidates().is_empty());
        assert_eq!(pools.undrain("http://127.0.0.1:8020/"), Ok((Pool::Decode, 0)));
        assert_eq!(pools.decode_candidates(), [0]);
        assert_eq!(pools.undrain("http://127.0.0.1:8020"), Ok((Pool::Decode, 0)), "idempotent");
        pools.remove("http://127.0.0.1:8020", false).expect("removed");
        assert!(matches!(pools.undrain("http://127.0.0.1:8020"), Err(AdminError::UnknownEngine { .. })));
    }

    #[test]
    fn bad_adds_change_nothing() {
        let mut pools = pools();
        let cases = [
            (Pool::Prefill, "http://127.0.0.1:8010", None, "Duplicate"),
            (Pool::Decode, "http://127.0.0.1:8010", None, "Duplicate"),
            (Pool::Decode, "https://127.0.0.1:9", None, "BadUrl"),
            (Pool::Decode, "not a url", None, "BadUrl"),
            (Pool::Decode, "http://127.0.0.1:9/v1", None, "BadUrl"),
            (Pool::Decode, "http://127.0.0.1:9", Some(8998), "BootstrapPortForDecode"),
        ];
        for (pool, url, port, want) in cases {
            let err = pools.add(pool, url, port, &[]).expect_err(url);
            assert!(format!("{err:?}").starts_with(want), "{url}: {err:?}");
        }
        let wildcard =
            KvEventsEndpoint { endpoint: "tcp://*:5557".into(), replay_endpoint: None, topic: String::new() };
        let err = pools.add(Pool::Decode, "http://127.0.0.1:9", None, &[wildcard]).expect_err("a wildcard endpoint");
        assert!(matches!(err, AdminError::BadKvEvents { .. }), "{err:?}");
        assert_eq!(pools.list().len(), 2);
        assert!(matches!(pools.drain("http://127.0.0.1:1"), Err(AdminError::UnknownEngine { .. })));
        assert!(matches!(pools.undrain("http://127.0.0.1:1"), Err(AdminError::UnknownEngine { .. })));
        assert!(matches!(pools.remove("http://127.0.0.1:1", true), Err(AdminError::UnknownEngine { .. })));
    }

    #[test]
    fn a_restarted_actor_starts_from_the_roster() {
        let roster = Roster::default();
        let mut pools = Pools::start(
            &[PrefillTarget::new("http://127.0.0.1:8010")],
            &["http://127.0.0.1:8020".into()],
            &[],
            &roster,
        )
        .expect("valid");
        let kv = KvEventsEndpoint {
            endpoint: "tcp://127.0.0.1:5557".into(),
            replay_endpoint: Some("tcp://127.0.0.1:5558".into()),
            topic: String::new(),
        };
        pools.add(Pool::Decode, "http://127.0.0.1:8021", None, std::slice::from_ref(&kv)).expect("added");
        pools.remove("http://127.0.0.1:8020", false).expect("removed");
        pools.save(&roster);
        let again = Pools::start(&[PrefillTarget::new("http://127.0.0.1:1")], &[], &[], &roster).expect("restored");
        let urls: Vec<(&str, EngineState)> = again.decode.iter().map(|d| (d.url.as_str(), d.state)).collect();
        assert_eq!(
            urls,
            [("http://127.0.0.1:8020", EngineState::Removed), ("http://127.0.0.1:8021", EngineState::Serving)]
        );
        assert_eq!(again.prefill[0].url, "http://127.0.0.1:8010");
        assert_eq!(again.info(Pool::Decode, 1).map(|i| i.kv_events), Some(vec![kv]), "its KV events endpoint too");
    }
}
