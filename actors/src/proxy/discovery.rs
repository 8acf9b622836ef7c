//! The proxy's discovery of P and D from bootstraps (`pdflow proxy --discover BOOTSTRAP_URL`):
//! engines advertise themselves at a bootstrap (`POST /engines`, [`crate::advertise`]); a task
//! the Proxy actor owns ([`Discoverer`]) reads each bootstrap's `GET /engines` every round, under
//! a deadline and signed with the cluster secret as step 7's `/query` is, and tells the actor what
//! it lists ([`EnginesDiscovered`]). The actor puts each engine in the same pools the admin API
//! edits ([`super::pools`]), through the same joins and leaves, KV-event subscriptions included.
//!
//! An engine is known by its engine id ([`Known`], kept with the pools across the actor's
//! restarts). An advertisement of a newer generation replaces the older: at the same URL, the
//! engine restarted in place (a P's engine ids are asked again, its KV events followed at its new
//! endpoints); elsewhere, its old entry leaves and the new one joins. An engine already in the
//! pools under its URL (given at start, added through the admin API) is adopted, not added twice.
//! An engine the admin API removed stays out until it advertises a new generation. A bootstrap
//! that is down or refuses the call is logged (once per outage) and asked again the next round;
//! engines it listed stay, and health checks take dead ones out of rotation.

use std::collections::HashSet;
use std::time::Duration;

use futures::future::join_all;
use kameo::prelude::*;
use pdflow_auth::http::Call;
use pdflow_messages::discovery::{AdvertiseEngine, EnginesDiscovered, EnginesResponse, KvEventsEndpoint};
use pdflow_messages::proxy::{EngineState, Pool};
use tokio_util::sync::CancellationToken;

use super::kv_events::KvEventSource;
use super::{poller, Proxy};
use crate::bootstrap_call;
use crate::error::BootstrapCallError;

/// How long a report to the actor may wait for mailbox space.
const TELL_DEADLINE: Duration = Duration::from_secs(5);
/// The most engines taken from one bootstrap's answer.
pub const MAX_ENGINES_PER_BOOTSTRAP: usize = 4096;

/// One engine discovery found: where it is in the pools (none: refused, see the log), and what
/// it advertised last.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Known {
    pub entry: Option<(Pool, usize)>,
    pub role: Pool,
    pub url: String,
    pub bootstrap_port: Option<u16>,
    pub generation: u64,
    pub kv_events: Vec<KvEventsEndpoint>,
}

impl Known {
    fn of(ad: &AdvertiseEngine, entry: Option<(Pool, usize)>) -> Self {
        Self {
            entry,
            role: ad.role,
            url: ad.url.trim_end_matches('/').to_owned(),
            bootstrap_port: ad.bootstrap_port,
            generation: ad.generation,
            kv_events: ad.kv_events.clone(),
        }
    }

    /// Whether `ad` places the engine where this does (its pool, URL and bootstrap).
    fn same_place(&self, ad: &AdvertiseEngine) -> bool {
        self.role == ad.role && self.url == ad.url.trim_end_matches('/') && self.bootstrap_port == ad.bootstrap_port
    }
}

/// What one advertisement asks of the pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Nothing new.
    Keep,
    /// A new engine: it joins.
    Join,
    /// Already in the pools under its URL (given at start, added through the admin API): remembered.
    Adopt(Pool, usize),
    /// Restarted where it was (same pool, URL and bootstrap; a newer generation or other KV-event
    /// endpoints).
    Restarted,
    /// Restarted elsewhere: its old entry leaves, the new one joins.
    Moved,
    /// Older than what was seen (a lagging bootstrap), or the same generation somewhere else.
    Ignore,
}

/// What `ad` asks, given what discovery knew of its engine and the live entry at its URL.
pub(crate) fn step(known: Option<&Known>, ad: &AdvertiseEngine, live: Option<(Pool, usize)>) -> Step {
    let Some(known) = known else {
        return match live {
            Some((pool, index)) => Step::Adopt(pool, index),
            None => Step::Join,
        };
    };
    if ad.generation < known.generation {
        return Step::Ignore;
    }
    let newer = ad.generation > known.generation;
    match (known.same_place(ad), newer) {
        (true, false) if known.kv_events == ad.kv_events => Step::Keep,
        (true, _) => Step::Restarted,
        // No generation to tell two places apart: the latest word wins.
        (false, false) if ad.generation != 0 => Step::Ignore,
        (false, _) => Step::Moved,
    }
}

impl Proxy {
    /// One advertisement applied to the pools.
    fn discovered(&mut self, bootstrap: &str, ad: &AdvertiseEngine) {
        let known = self.pools.discovered.get(&ad.engine_id).cloned();
        let live = self.pools.find_live(&ad.url);
        let entry = match step(known.as_ref(), ad, live) {
            Step::Keep | Step::Ignore => return,
            Step::Adopt(pool, index) => {
                self.adopt(pool, index, ad);
                Some((pool, index))
            }
            Step::Join => self.join_discovered(bootstrap, ad),
            Step::Restarted => {
                let in_service = known.as_ref().and_then(|k| k.entry).filter(|(pool, index)| {
                    self.pools.info(*pool, *index).is_some_and(|i| i.state != EngineState::Removed)
                });
                match in_service {
                    Some((pool, index)) => {
                        self.restarted_in_place(pool, index, ad);
                        Some((pool, index))
                    }
                    // Removed (by the admin API) or refused before: a new incarnation joins.
                    None => self.join_discovered(bootstrap, ad),
                }
            }
            Step::Moved => {
                if let Some(old) = known.as_ref().and_then(|k| k.entry).and_then(|(p, i)| self.pools.info(p, i)) {
                    if old.state != EngineState::Removed {
                        tracing::info!(engine_id = %ad.engine_id, from = %old.url, to = %ad.url,
                            "discovery: engine moved; its old entry leaves");
                        // It restarted elsewhere: what it had in flight at the old place fails or
                        // finishes on its own.
                        let _ = self.leave(&old.url, true);
                    }
                }
                self.join_discovered(bootstrap, ad)
            }
        };
        self.pools.discovered.insert(ad.engine_id.clone(), Known::of(ad, entry));
        self.pools.save(&self.roster);
    }

    /// `ad`'s engine joins its pool: its entry, or none when refused (logged).
    fn join_discovered(&mut self, bootstrap: &str, ad: &AdvertiseEngine) -> Option<(Pool, usize)> {
        match self.join(ad.role, &ad.url, ad.bootstrap_port, &ad.kv_events) {
            Ok(index) => {
                tracing::info!(pool = ad.role.name(), index, url = %ad.url, engine_id = %ad.engine_id, %bootstrap,
                    generation = ad.generation, "discovery: engine joined");
                Some((ad.role, index))
            }
            Err(e) => {
                tracing::warn!(engine_id = %ad.engine_id, url = %ad.url, %bootstrap, error = %e,
                    "discovery: advertised engine not taken");
                None
            }
        }
    }

    /// An engine found already in the pools at its URL (given at start, added through the admin
    /// API): the KV-event endpoints it advertises are taken when its entry has none.
    fn adopt(&mut self, pool: Pool, index: usize, ad: &AdvertiseEngine) {
        let Some((url, sources)) = self.pools.kv_sources(pool, index) else { return };
        if sources.is_empty() && !ad.kv_events.is_empty() {
            self.pools.set_kv_sources(pool, index, kv_sources(&url, ad));
            self.follow_kv_events(pool, index);
        }
    }

    /// The engine at entry `index` of `pool` restarted where it was: a P's engine ids are asked
    /// again, and its KV events followed at the endpoints it advertises now.
    fn restarted_in_place(&mut self, pool: Pool, index: usize, ad: &AdvertiseEngine) {
        tracing::info!(pool = pool.name(), index, url = %ad.url, engine_id = %ad.engine_id,
            generation = ad.generation, "discovery: engine restarted in place");
        let Some((url, _)) = self.pools.kv_sources(pool, index) else { return };
        self.pools.set_kv_sources(pool, index, kv_sources(&url, ad));
        if pool == Pool::Prefill {
            let _ = self.poller_tx.send(poller::Command::Requery(index));
        }
        self.follow_kv_events(pool, index);
    }
}

/// The KV-event sources `ad` gives for the engine at `url`; an endpoint that is not
/// `tcp://HOST:PORT` is left out (logged).
fn kv_sources(url: &str, ad: &AdvertiseEngine) -> Vec<KvEventSource> {
    (ad.kv_events.iter())
        .filter_map(|e| match KvEventSource::of(url, e) {
            Ok(source) => Some(source),
            Err(error) => {
                tracing::warn!(engine_id = %ad.engine_id, %url, %error, "discovery: KV-event endpoint left out");
                None
            }
        })
        .collect()
}

impl Message<EnginesDiscovered> for Proxy {
    type Reply = ();

    async fn handle(&mut self, msg: EnginesDiscovered, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        for ad in &msg.engines {
            self.discovered(&msg.bootstrap, ad);
        }
        self.update_ready();
    }
}

/// Why one bootstrap's `GET /engines` gave nothing this round (logged; asked again next round).
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("GET {url} got no answer within {after:?}")]
    Timeout { url: String, after: Duration },
    #[error(transparent)]
    Call(#[from] BootstrapCallError),
    #[error("GET {url}: status {status}: {body}")]
    Status { url: String, status: reqwest::StatusCode, body: String },
    #[error("GET {url}: not an /engines answer: {source}")]
    NotEngines { url: String, source: serde_json::Error },
}

/// The task that reads the bootstraps' `/engines`, owned by the Proxy actor.
pub(super) struct Discoverer {
    pub actor: ActorRef<Proxy>,
    pub client: reqwest::Client,
    /// The bootstraps' URLs, without a trailing `/`.
    pub bootstraps: Vec<String>,
    pub interval: Duration,
    /// The deadline of one call.
    pub call_timeout: Duration,
    pub secret: Option<pdflow_auth::ClusterSecret>,
}

impl Discoverer {
    /// Reads every bootstrap once a round, all at once, and tells the actor; until shut down or
    /// the actor is gone.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut failing: HashSet<String> = HashSet::new();
        loop {
            let this = &self;
            let calls = join_all(this.bootstraps.iter().map(|b| async move { (b, this.fetch(b).await) }));
            let answers = tokio::select! {
                _ = shutdown.cancelled() => return,
                answers = calls => answers,
            };
            for (bootstrap, answer) in answers {
                match answer {
                    Ok(engines) => {
                        if failing.remove(bootstrap) {
                            tracing::info!(%bootstrap, "discovery: bootstrap answers again");
                        }
                        if !self.report(bootstrap, engines).await {
                            return;
                        }
                    }
                    Err(error) if failing.insert(bootstrap.clone()) => {
                        tracing::warn!(%bootstrap, %error, "discovery: bootstrap did not list its engines; asking again every {:?}", self.interval);
                    }
                    Err(error) => tracing::debug!(%bootstrap, %error, "discovery: bootstrap still not answering"),
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.interval) => {}
            }
        }
    }

    /// `GET {bootstrap}/engines`, under [`Discoverer::call_timeout`].
    async fn fetch(&self, bootstrap: &str) -> Result<Vec<AdvertiseEngine>, DiscoveryError> {
        let url = format!("{bootstrap}/engines");
        let call = bootstrap_call::send(&self.client, self.secret.as_ref(), Call::Query, &url, None);
        let answer = tokio::time::timeout(self.call_timeout, call)
            .await
            .map_err(|_| DiscoveryError::Timeout { url: url.clone(), after: self.call_timeout })??;
        if !answer.status.is_success() {
            return Err(DiscoveryError::Status { url, status: answer.status, body: answer.text() });
        }
        let mut listed: EnginesResponse = serde_json::from_slice(&answer.body)
            .map_err(|source| DiscoveryError::NotEngines { url: url.clone(), source })?;
        if listed.engines.len() > MAX_ENGINES_PER_BOOTSTRAP {
            tracing::warn!(%url, listed = listed.engines.len(), "discovery: taking the first {MAX_ENGINES_PER_BOOTSTRAP} engines");
            listed.engines.truncate(MAX_ENGINES_PER_BOOTSTRAP);
        }
        Ok(listed.engines)
    }

    /// Tells the actor what `bootstrap` lists; false when the actor is gone.
    async fn report(&self, bootstrap: &str, engines: Vec<AdvertiseEngine>) -> bool {
        let Some(actor) = Some(self.actor.clone()).filter(|a| a.is_alive()) else { return false };
        let msg = EnginesDiscovered { bootstrap: bootstrap.to_owned(), engines };
        match tokio::time::timeout(TELL_DEADLINE, actor.tell(msg).send()).await {
            Ok(sent) => sent.is_ok(),
            Err(_) => {
                tracing::warn!("proxy actor did not take a discovery report within {TELL_DEADLINE:?}; dropped it");
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::ProxyArgs;
    use pdflow_messages::proxy::{EngineInfo, ListEngines, RemoveEngine};

    fn ad(role: Pool, url: &str, generation: u64) -> AdvertiseEngine {
        AdvertiseEngine {
            engine_id: "e".into(),
            role,
            url: url.into(),
            bootstrap_port: (role == Pool::Prefill).then_some(8998),
            kv_events: Vec::new(),
            generation,
        }
    }

    #[test]
    fn a_newer_generation_replaces_the_older_and_an_older_one_changes_nothing() {
        let first = ad(Pool::Decode, "http://h:1", 10);
        assert_eq!(step(None, &first, None), Step::Join);
        assert_eq!(step(None, &first, Some((Pool::Decode, 4))), Step::Adopt(Pool::Decode, 4), "given at start");
        let known = Known::of(&first, Some((Pool::Decode, 0)));
        assert_eq!(step(Some(&known), &first, Some((Pool::Decode, 0))), Step::Keep);
        assert_eq!(step(Some(&known), &ad(Pool::Decode, "http://h:1/", 11), None), Step::Restarted);
        assert_eq!(step(Some(&known), &ad(Pool::Decode, "http://h:2", 11), None), Step::Moved);
        assert_eq!(step(Some(&known), &ad(Pool::Prefill, "http://h:1", 11), None), Step::Moved, "another role");
        assert_eq!(step(Some(&known), &ad(Pool::Decode, "http://h:2", 9), None), Step::Ignore, "older");
        assert_eq!(step(Some(&known), &ad(Pool::Decode, "http://h:2", 10), None), Step::Ignore, "same generation");
        let mut moved_kv = first.clone();
        moved_kv.kv_events.push(KvEventsEndpoint {
            endpoint: "tcp://h:5557".into(),
            replay_endpoint: None,
            topic: String::new(),
        });
        assert_eq!(step(Some(&known), &moved_kv, None), Step::Restarted, "new KV-event endpoints");
        let unversioned = Known::of(&ad(Pool::Decode, "http://h:1", 0), Some((Pool::Decode, 0)));
        assert_eq!(step(Some(&unversioned), &ad(Pool::Decode, "http://h:3", 0), None), Step::Moved);
    }

    /// A Proxy actor given only a bootstrap (that nobody serves: the engines are told to it here).
    async fn discovering_proxy() -> ActorRef<Proxy> {
        let mut args = ProxyArgs::new("127.0.0.1:0".parse().expect("addr"), Vec::new(), Vec::new());
        args.discover = vec!["http://127.0.0.1:1".into()];
        let proxy = Proxy::spawn(args);
        proxy.wait_for_startup().await;
        proxy
    }

    async fn listed(proxy: &ActorRef<Proxy>) -> Vec<(usize, String)> {
        let engines: Vec<EngineInfo> = proxy.ask(ListEngines).await.expect("listed");
        engines.into_iter().map(|e| (e.index, e.url)).collect()
    }

    #[tokio::test]
    async fn the_actor_adds_moves_and_keeps_out_what_discovery_finds() {
        let proxy = discovering_proxy().await;
        let tell = |ads: Vec<AdvertiseEngine>| {
            proxy.ask(EnginesDiscovered { bootstrap: "http://127.0.0.1:1".into(), engines: ads })
        };
        tell(vec![ad(Pool::Decode, "http://127.0.0.1:11", 1)]).await.expect("told");
        tell(vec![ad(Pool::Decode, "http://127.0.0.1:11", 1)]).await.expect("told");
        assert_eq!(listed(&proxy).await, [(0, "http://127.0.0.1:11".to_owned())], "once");
        // Restarted on another port: the old entry leaves, the new one joins.
        tell(vec![ad(Pool::Decode, "http://127.0.0.1:12", 2)]).await.expect("told");
        assert_eq!(listed(&proxy).await, [(1, "http://127.0.0.1:12".to_owned())]);
        // A lagging bootstrap's older word changes nothing.
        tell(vec![ad(Pool::Decode, "http://127.0.0.1:11", 1)]).await.expect("told");
        assert_eq!(listed(&proxy).await, [(1, "http://127.0.0.1:12".to_owned())]);
        // Removed by the admin API, it stays out until it restarts.
        proxy.ask(RemoveEngine { url: "http://127.0.0.1:12".into(), force: false }).await.expect("removed");
        tell(vec![ad(Pool::Decode, "http://127.0.0.1:12", 2)]).await.expect("told");
        assert!(listed(&proxy).await.is_empty());
        tell(vec![ad(Pool::Decode, "http://127.0.0.1:12", 3)]).await.expect("told");
        assert_eq!(listed(&proxy).await, [(2, "http://127.0.0.1:12".to_owned())]);
        // A refused advertisement (a D with a bootstrap port) joins nothing.
        let mut bad = ad(Pool::Decode, "http://127.0.0.1:13", 1);
        bad.engine_id = "bad".into();
        bad.bootstrap_port = Some(8998);
        tell(vec![bad]).await.expect("told");
        assert_eq!(listed(&proxy).await.len(), 1);
        proxy.stop_gracefully().await.expect("stops");
    }
}
