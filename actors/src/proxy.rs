//! The Proxy actor: the P and D pools, their health, P's engine ids and the round-robin counters;
//! its health poller is a task it owns. The HTTP server is not the actor's ([`ProxyServer`]): it
//! outlives the actor's restarts.
//!
//! Seed steps: 6 (`GET /health` of each P until it answers) and 7 (`GET /query` on P's bootstrap,
//! dp rank → engine id) run in the poller ([`poller`]); 8–10, 25 and 42–43 run per request in
//! [`flow`], in the HTTP handler's task, which only asks this actor for a [`Route`]. The actor's
//! mailbox never waits on I/O.
//!
//! Until every P has an engine id and every D has answered `/health`, the proxy answers 503.
//! After that, each request goes to one of the healthy P × dp ranks and one of the healthy D,
//! each pool by its policy ([`routing`]: round robin, least loaded, cache aware, KV aware — the
//! last from the engines' KV events, which subscriber tasks the actor owns write into indexes
//! it reads, [`kv_events`]); the poller keeps
//! probing, re-queries a P's engine ids every [`REQUERY_EVERY`] rounds, after a P
//! came back from being unhealthy, and after a failed prefill ([`PrefillFailed`]).
//!
//! Engines join and leave while the proxy runs, through its admin API ([`admin`]) and from the
//! bootstraps it discovers engines at ([`discovery`], `--discover`): each keeps a stable index in
//! its pool, a removed one a tombstone, a draining one finishes what it has ([`pools`]). An engine
//! that refuses a request's connection is out of rotation at once ([`EngineUnreachable`]); the
//! poller brings it back when its `/health` answers.

mod admin;
pub mod admin_client;
pub mod discovery;
pub mod flow;
pub mod kv_events;
mod poller;
mod pools;
mod release;
mod roster;
pub mod routing;
mod server;
#[cfg(test)]
mod tests;

pub use poller::UNHEALTHY_AFTER;
pub use roster::{Roster, RosterError};
pub use server::ProxyServer;

use std::net::SocketAddr;
use std::time::Duration;

use kameo::prelude::*;
use pdflow_messages::proxy::{
    Choice, EngineState, EngineUnreachable, NotReady, Pool, PrefillDiscovered, PrefillDone, PrefillFailed,
    ProxyReadiness, ProxyStatus, ReadyDeadlinePassed, ReleasePrefill, Route, RouteDecision, RouteDone, TargetHealth,
};
use pdflow_messages::EngineId;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::ActorError;

/// vLLM's default bootstrap port (`VLLM_MOONCAKE_BOOTSTRAP_PORT`).
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;
/// The poller re-queries every P's engine ids once per this many health rounds.
pub const REQUERY_EVERY: u64 = 10;

/// One prefill instance: its HTTP URL and the port of its bootstrap server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillTarget {
    pub url: String,
    pub bootstrap_port: u16,
}

impl PrefillTarget {
    /// A P whose bootstrap listens on the default port 8998.
    pub fn new(url: impl Into<String>) -> Self {
        Self { url: url.into(), bootstrap_port: DEFAULT_BOOTSTRAP_PORT }
    }
}

/// The proxy's configuration (parsed by the CLI).
#[derive(Debug, Clone)]
pub struct ProxyArgs {
    /// Where the proxy's HTTP server listens ([`ProxyServer`]; the actor itself binds nothing).
    pub bind: SocketAddr,
    pub prefill: Vec<PrefillTarget>,
    pub decode: Vec<String>,
    /// Pause between two health rounds.
    pub health_interval: Duration,
    /// Consecutive failed probes after which a serving engine is taken out of rotation
    /// (`--unhealthy-after`; at least 1).
    pub unhealthy_after: u32,
    /// Deadline of every upstream call (P's whole request, D's headers, the gap between D's chunks).
    pub upstream_timeout: Duration,
    /// If set, the proxy stops with an error when it is not ready after this long.
    pub ready_timeout: Option<Duration>,
    /// The cluster secret: the proxy's `/query` calls (step 7) are signed with it and only
    /// answers proven by a bootstrap that holds it are taken.
    pub secret: Option<pdflow_auth::ClusterSecret>,
    /// How a P (and its dp rank) and a D are chosen for each request ([`routing::Policy`]).
    pub prefill_policy: routing::Policy,
    pub decode_policy: routing::Policy,
    /// When D serves a request alone, without P ([`routing::LocalPrefill`]).
    pub local_prefill: routing::LocalPrefill,
    /// Where engines publish their KV events (`kv_aware`; every engine of a `kv_aware` pool
    /// needs at least one).
    pub kv_events: Vec<kv_events::KvEventSource>,
    /// The engines as the admin API and discovery last left them, shared by the actor's
    /// incarnations (and kept in a file with `--roster-file`): a restarted actor, or a proxy
    /// started over a roster file that holds engines, starts from it, not from `prefill` and
    /// `decode`.
    pub roster: Roster,
    /// Bootstraps whose advertised engines join the pools (`--discover`, [`discovery`]); with
    /// one, the pools may start empty.
    pub discover: Vec<String>,
}

impl ProxyArgs {
    /// A proxy of these pools on `bind`, with the defaults of `pdflow proxy`: health checked
    /// every 500 ms, 120 s upstream deadline, no ready deadline, no secret, round robin, every
    /// request through P.
    pub fn new(bind: SocketAddr, prefill: Vec<PrefillTarget>, decode: Vec<String>) -> Self {
        Self {
            bind,
            prefill,
            decode,
            health_interval: Duration::from_millis(500),
            unhealthy_after: poller::UNHEALTHY_AFTER,
            upstream_timeout: Duration::from_secs(120),
            ready_timeout: None,
            secret: None,
            prefill_policy: routing::Policy::default(),
            decode_policy: routing::Policy::default(),
            local_prefill: routing::LocalPrefill::default(),
            kv_events: Vec::new(),
            roster: Roster::default(),
            discover: Vec::new(),
        }
    }
}

/// The proxy: pools, readiness, round robin; owner of the health poller.
pub struct Proxy {
    pools: pools::Pools,
    /// Where the pools are saved for a restarted actor.
    roster: Roster,
    ready: bool,
    /// P (index, dp rank) and D (index) pickers: each pool's policy, load and likely caches.
    prefill_picker: routing::Picker<(usize, u32)>,
    decode_picker: routing::Picker<usize>,
    local_prefill: routing::LocalPrefill,
    /// Tells the poller of re-queries and of engines joining and leaving.
    poller_tx: mpsc::UnboundedSender<poller::Command>,
    /// Frees P's blocks for a transfer whose D could not be reached ([`ReleasePrefill`]).
    releaser: release::Releaser,
    shutdown: CancellationToken,
    _poller: AbortOnDropHandle<()>,
    /// The KV-event subscribers (`kv_aware`), stopped with the actor or when their engine leaves.
    kv_events: kv_events::KvEvents,
    /// The bootstraps' engines read (`--discover`), stopped with the actor.
    _discovery: Option<AbortOnDropHandle<()>>,
    /// Where engines are discovered, for what the proxy says it waits for.
    discover: Vec<String>,
}

impl Actor for Proxy {
    type Args = ProxyArgs;
    type Error = ActorError;

    async fn on_start(args: Self::Args, actor_ref: ActorRef<Self>) -> Result<Self, Self::Error> {
        if args.discover.is_empty()
            && !args.roster.holds_engines()
            && (args.prefill.is_empty() || args.decode.is_empty())
        {
            return Err(ActorError::EmptyPool { prefill: args.prefill.len(), decode: args.decode.len() });
        }
        let mut checked = Vec::new();
        for (url, pool) in
            (args.prefill.iter().map(|p| (&p.url, "prefill"))).chain(args.decode.iter().map(|d| (d, "decode")))
        {
            checked.push(pools::check_url(url, pool)?.0);
        }
        let (prefill_urls, decode_urls) = checked.split_at(args.prefill.len());
        kv_events::KvEvents::check(
            &args.kv_events,
            (prefill_urls, args.prefill_policy),
            (decode_urls, args.decode_policy),
        )?;
        let pools = pools::Pools::start(&args.prefill, &args.decode, &args.kv_events, &args.roster)?;
        let client = reqwest::Client::builder()
            .build()
            .map_err(|source| ActorError::HttpClient { what: "the proxy's health-check client", source })?;
        let shutdown = CancellationToken::new();
        let mut kv_events = kv_events::KvEvents::new(args.prefill_policy, args.decode_policy, &shutdown);
        for (pool, entries) in [(Pool::Prefill, pools.prefill.len()), (Pool::Decode, pools.decode.len())] {
            for index in 0..entries {
                let live = pools.info(pool, index).is_some_and(|e| e.state != EngineState::Removed);
                if let Some((url, sources)) = pools.kv_sources(pool, index).filter(|_| live) {
                    kv_events.subscribe(pool, index, &url, &sources);
                }
            }
        }

        let (poller_tx, poller_rx) = mpsc::unbounded_channel();
        let releaser = release::Releaser::new(client.clone(), args.secret.clone());
        let client_for_discovery = client.clone();
        let poller = poller::Poller {
            actor: actor_ref.clone(),
            client,
            prefill: (pools.prefill.iter().enumerate())
                .filter(|(_, p)| p.state != EngineState::Removed)
                .map(|(i, p)| (i, (p.url.clone(), p.bootstrap_addr.clone())))
                .collect(),
            decode: (pools.decode.iter().enumerate())
                .filter(|(_, d)| d.state != EngineState::Removed)
                .map(|(j, d)| (j, d.url.clone()))
                .collect(),
            interval: args.health_interval,
            unhealthy_after: args.unhealthy_after.max(1),
            probe_timeout: args.health_interval.max(Duration::from_secs(1)).min(args.upstream_timeout),
            ready_timeout: args.ready_timeout,
            secret: args.secret.clone(),
        };
        let poller = tokio::spawn(poller.run(poller_rx, shutdown.clone()));
        let discover: Vec<String> = args.discover.iter().map(|b| b.trim_end_matches('/').to_owned()).collect();
        let discovery = (!discover.is_empty()).then(|| {
            let discoverer = discovery::Discoverer {
                actor: actor_ref.clone(),
                client: client_for_discovery.clone(),
                bootstraps: discover.clone(),
                interval: args.health_interval,
                call_timeout: args.health_interval.max(Duration::from_secs(1)).min(args.upstream_timeout),
                secret: args.secret.clone(),
            };
            AbortOnDropHandle::new(tokio::spawn(discoverer.run(shutdown.clone())))
        });
        tracing::info!(
            prefill = pools.prefill.len(),
            decode = pools.decode.len(),
            prefill_policy = args.prefill_policy.name(),
            decode_policy = args.decode_policy.name(),
            discover = ?discover,
            "proxy routing"
        );

        Ok(Proxy {
            pools,
            roster: args.roster,
            ready: false,
            prefill_picker: routing::Picker::new(args.prefill_policy).with_held(kv_events.prefill.clone()),
            decode_picker: routing::Picker::new(args.decode_policy).with_held(kv_events.decode.clone()),
            local_prefill: args.local_prefill,
            poller_tx,
            releaser,
            shutdown,
            _poller: AbortOnDropHandle::new(poller),
            kv_events,
            _discovery: discovery,
            discover,
        })
    }

    async fn on_stop(&mut self, _actor_ref: WeakActorRef<Self>, _reason: ActorStopReason) -> Result<(), Self::Error> {
        self.shutdown.cancel();
        Ok(())
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // The poller is aborted by its handle; this only tells it to stop first.
        self.shutdown.cancel();
    }
}

impl Proxy {
    /// What the proxy still waits for before it serves.
    fn waiting_for(&self) -> Vec<String> {
        let p = (self.pools.prefill.iter())
            .filter(|p| p.state == EngineState::Serving && p.dp_engine_id.is_empty())
            .map(|p| format!("prefill {} (health + engine id from {}/query)", p.url, p.bootstrap_addr));
        let d = (self.pools.decode.iter())
            .filter(|d| d.state == EngineState::Serving && !d.answered)
            .map(|d| format!("decode {} (/health)", d.url));
        let mut waiting: Vec<String> = p.chain(d).collect();
        // Discovering: at least one engine of each pool before serving.
        if !self.discover.is_empty() {
            let from = self.discover.join(", ");
            if self.pools.prefill.iter().all(|p| p.state == EngineState::Removed) {
                waiting.push(format!("a prefill engine (none advertised yet at {from})"));
            }
            if self.pools.decode.iter().all(|d| d.state == EngineState::Removed) {
                waiting.push(format!("a decode engine (none advertised yet at {from})"));
            }
        }
        waiting
    }

    fn update_ready(&mut self) {
        if !self.ready && self.waiting_for().is_empty() {
            self.ready = true;
            tracing::info!("proxy ready: every P has an engine id and every D answered /health");
        }
    }

    fn route(
        &mut self,
        prompt: &pdflow_messages::proxy::PromptKey,
        exclude: &[usize],
    ) -> Result<RouteDecision, NotReady> {
        if !self.ready {
            return Err(NotReady::Starting { waiting_for: self.waiting_for() });
        }
        let candidates = self.pools.prefill_candidates(exclude);
        if candidates.is_empty() && !self.local_prefill.enabled() {
            return Err(NotReady::NoHealthy { pool: Pool::Prefill });
        }
        let decodes = self.pools.decode_candidates();
        let Some((dj, decode_choice, decode_tokens)) = self.decode_picker.pick(&decodes, prompt) else {
            return Err(NotReady::NoHealthy { pool: Pool::Decode });
        };
        let (pi, dp, prefill_choice, prefill_tokens) = if self.local_prefill.applies(prompt, decode_choice) {
            (0, 0, Choice::Skipped, 0)
        } else {
            match self.prefill_picker.pick(&candidates, prompt) {
                Some(((pi, dp), choice, tokens)) => (pi, dp, choice, tokens),
                None => {
                    self.decode_picker.done(dj, decode_tokens);
                    return Err(NotReady::NoHealthy { pool: Pool::Prefill });
                }
            }
        };
        let disaggregate = prefill_choice != Choice::Skipped;
        let engine_id = match disaggregate {
            true => self.pools.prefill[pi].dp_engine_id.get(&dp).cloned().unwrap_or_default(),
            false => EngineId::default(),
        };
        let metrics = pdflow_observability::metrics::global();
        for (pool, policy, choice) in [
            ("prefill", self.prefill_picker.policy(), prefill_choice),
            ("decode", self.decode_picker.policy(), decode_choice),
        ] {
            let matched = match choice {
                Choice::CacheHit { chunks } => chunks as u64,
                Choice::KvHit { blocks, .. } => blocks as u64,
                _ => 0,
            };
            metrics.count_route(pool, policy.name(), choice.label(), matched);
        }
        let (prefill_url, prefill_bootstrap_addr) = match disaggregate {
            true => (self.pools.prefill[pi].url.clone(), self.pools.prefill[pi].bootstrap_addr.clone()),
            false => (String::new(), String::new()),
        };
        self.pools.routed(pi, dj, disaggregate);
        Ok(RouteDecision {
            prefill_index: pi,
            prefill_url,
            prefill_bootstrap_addr,
            prefill_dp_rank: dp,
            prefill_engine_id: engine_id,
            decode_index: dj,
            decode_url: self.pools.decode[dj].url.clone(),
            prefill_choice,
            decode_choice,
            prefill_tokens,
            decode_tokens,
            disaggregate,
        })
    }
}

impl Message<Route> for Proxy {
    type Reply = Result<RouteDecision, NotReady>;

    async fn handle(&mut self, msg: Route, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.route(&msg.prompt, &msg.exclude_prefill)
    }
}

impl Message<RouteDone> for Proxy {
    type Reply = ();

    async fn handle(&mut self, msg: RouteDone, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.pools.done(msg.prefill_index, msg.decode_index, msg.disaggregated);
        self.decode_picker.done(msg.decode_index, msg.decode_tokens);
    }
}

impl Message<PrefillDone> for Proxy {
    type Reply = ();

    async fn handle(&mut self, msg: PrefillDone, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.prefill_picker.done((msg.prefill_index, msg.prefill_dp_rank), msg.prefill_tokens);
    }
}

impl Message<ReleasePrefill> for Proxy {
    type Reply = ();

    async fn handle(&mut self, msg: ReleasePrefill, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.releaser.release(msg);
    }
}

impl Message<ProxyStatus> for Proxy {
    type Reply = Result<ProxyReadiness, std::convert::Infallible>;

    async fn handle(&mut self, _msg: ProxyStatus, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        Ok(ProxyReadiness { ready: self.ready, waiting_for: self.waiting_for() })
    }
}

impl Message<TargetHealth> for Proxy {
    type Reply = ();

    async fn handle(&mut self, msg: TargetHealth, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        match msg.pool {
            Pool::Prefill => {
                // A removed engine's late report changes nothing.
                let live = self.pools.prefill.get_mut(msg.index).filter(|p| p.state != EngineState::Removed);
                if let Some(p) = live {
                    if p.healthy != msg.healthy {
                        tracing::info!(url = %p.url, healthy = msg.healthy, "prefill health changed");
                    }
                    p.healthy = msg.healthy;
                }
            }
            Pool::Decode => {
                let live = self.pools.decode.get_mut(msg.index).filter(|d| d.state != EngineState::Removed);
                if let Some(d) = live {
                    if d.healthy != msg.healthy {
                        tracing::info!(url = %d.url, healthy = msg.healthy, "decode health changed");
                    }
                    d.healthy = msg.healthy;
                    d.answered |= msg.healthy;
                }
            }
        }
        self.update_ready();
    }
}

impl Message<PrefillDiscovered> for Proxy {
    type Reply = ();

    async fn handle(&mut self, msg: PrefillDiscovered, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let live = self.pools.prefill.get_mut(msg.prefill_index).filter(|p| p.state != EngineState::Removed);
        if let Some(p) = live {
            if p.dp_engine_id != msg.dp_engine_id {
                tracing::info!(url = %p.url, dp_engine_id = ?msg.dp_engine_id, "prefill engine ids recorded");
            }
            p.dp_engine_id = msg.dp_engine_id;
            p.healthy = !p.dp_engine_id.is_empty();
        }
        self.update_ready();
    }
}

impl Message<PrefillFailed> for Proxy {
    type Reply = ();

    async fn handle(&mut self, msg: PrefillFailed, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        if let Some(p) = self.pools.prefill.get(msg.prefill_index) {
            tracing::warn!(url = %p.url, reason = %msg.reason, "prefill failed; re-querying its engine ids");
            // The poller is gone only while the actor stops: nothing left to re-query then.
            let _ = self.poller_tx.send(poller::Command::Requery(msg.prefill_index));
        }
    }
}

impl Message<EngineUnreachable> for Proxy {
    type Reply = ();

    async fn handle(&mut self, msg: EngineUnreachable, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let (url, healthy) = match msg.pool {
            Pool::Prefill => match self.pools.prefill.get_mut(msg.index) {
                Some(p) => (p.url.clone(), std::mem::replace(&mut p.healthy, false)),
                None => return,
            },
            Pool::Decode => match self.pools.decode.get_mut(msg.index) {
                Some(d) => (d.url.clone(), std::mem::replace(&mut d.healthy, false)),
                None => return,
            },
        };
        if healthy {
            tracing::warn!(pool = msg.pool.name(), %url, reason = %msg.reason,
                "engine refused a request's connection: out of rotation until its /health answers");
        }
        // The poller reports it healthy again once a probe succeeds; a P's engine ids are asked
        // again then (it may have restarted).
        let _ = self.poller_tx.send(poller::Command::Unreachable(msg.pool, msg.index));
    }
}

impl Message<ReadyDeadlinePassed> for Proxy {
    type Reply = Result<(), ActorError>;

    async fn handle(&mut self, _msg: ReadyDeadlinePassed, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        if self.ready {
            return Ok(());
        }
        // Returned to a `tell`: the error stops the actor (and its supervisor sees why).
        Err(ActorError::NotReadyInTime { waiting_for: self.waiting_for() })
    }
}
