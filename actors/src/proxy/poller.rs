//! The proxy's health poller: a task owned by the Proxy actor that probes every P and D and
//! reports back by `tell` (seed steps 6 and 7).
//!
//! Each round probes all targets concurrently, each probe under its own deadline. A P is
//! (re-)queried on its bootstrap (`GET {bootstrap}/query`) when it has no engine ids yet, after it
//! was unhealthy, every [`super::REQUERY_EVERY`] rounds, and when the actor asks (a failed
//! prefill). Step spans 6 and 7 are emitted while a P is being discovered, not for steady-state
//! probes. The actor tells the poller ([`Command`]) of engines that join or leave (probed from
//! the next round on, by their pool index; a removed one is never probed again) and of engines
//! that refused a request's connection (a P's engine ids are then asked again once it answers).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::future::join_all;
use kameo::prelude::*;
use pdflow_messages::bootstrap::QueryResponse;
use pdflow_messages::proxy::{Pool, PrefillDiscovered, ReadyDeadlinePassed, TargetHealth};
use pdflow_messages::EngineId;
use pdflow_observability::{attrs, step_span, steps};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{Proxy, REQUERY_EVERY};
use crate::error::BootstrapCallError;
use pdflow_auth::http::Call;
use pdflow_observability::Outcome;

/// How long a report to the actor may wait for mailbox space.
const TELL_DEADLINE: Duration = Duration::from_secs(5);

pub(super) struct Poller {
    pub actor: ActorRef<Proxy>,
    pub client: reqwest::Client,
    /// By pool index: (P's URL, P's bootstrap address).
    pub prefill: BTreeMap<usize, (String, String)>,
    /// By pool index: D's URL.
    pub decode: BTreeMap<usize, String>,
    pub interval: Duration,
    /// Consecutive failed probes after which a serving target is reported unhealthy.
    pub unhealthy_after: u32,
    pub probe_timeout: Duration,
    pub ready_timeout: Option<Duration>,
    /// Signs the `/query` calls; answers are then taken only with the bootstrap's proof.
    pub secret: Option<pdflow_auth::ClusterSecret>,
}

/// Consecutive failed health probes after which a serving target is taken out of rotation (the
/// default of `--unhealthy-after`).
pub const UNHEALTHY_AFTER: u32 = 3;

/// Actor → poller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Command {
    /// Query this P's engine ids in the next round (a failed prefill).
    Requery(usize),
    /// A P joined at this index.
    AddPrefill { index: usize, url: String, bootstrap: String },
    /// A D joined at this index.
    AddDecode { index: usize, url: String },
    /// This engine left: never probed again.
    Remove(Pool, usize),
    /// This engine refused a request's connection; the actor took it out of rotation.
    Unreachable(Pool, usize),
}

/// One P's probe, by its pool index.
type PIndexed = (usize, PrefillProbe);

/// What one P probe found.
enum PrefillProbe {
    Unhealthy,
    Healthy,
    Discovered(BTreeMap<u32, EngineId>),
}

impl Poller {
    /// Probes every target once a round, a round every `interval`, and reports to the actor until
    /// shut down or the actor is gone.
    pub async fn run(mut self, mut commands: mpsc::UnboundedReceiver<Command>, shutdown: CancellationToken) {
        let mut rounds = Rounds {
            ready_deadline: self.ready_timeout.map(|t| Instant::now() + t),
            deadline_reported: false,
            discovered: BTreeMap::new(),
            requested: BTreeSet::new(),
            round: 0,
            p_failures: BTreeMap::new(),
            d_failures: BTreeMap::new(),
            unhealthy_after: self.unhealthy_after,
        };
        loop {
            let Some((p_results, d_results)) = self.probe_all(&rounds, &shutdown).await else { return };
            rounds.requested.clear();
            let mut reports = rounds.prefill_reports(p_results);
            reports.extend(rounds.decode_reports(d_results));
            reports.extend(rounds.deadline_report());
            for report in reports {
                if !self.report(report).await {
                    return;
                }
            }
            rounds.round = rounds.round.wrapping_add(1);
            if !self.pause(&mut rounds, &mut commands, &shutdown).await {
                return;
            }
        }
    }

    /// One round's probes, all at once: steps 6 and (where due) 7 on every P, `/health` on every
    /// D; `None` when the poller is shut down meanwhile.
    async fn probe_all(
        &self,
        rounds: &Rounds,
        shutdown: &CancellationToken,
    ) -> Option<(Vec<PIndexed>, Vec<(usize, bool)>)> {
        let requery_all = rounds.round > 0 && rounds.round.is_multiple_of(REQUERY_EVERY);
        let p_probes = self.prefill.iter().map(|(&i, (url, bootstrap))| {
            let discovered = rounds.discovered.get(&i).copied().unwrap_or(false);
            let query = !discovered || requery_all || rounds.requested.contains(&i);
            async move { (i, self.probe_prefill(url, bootstrap, query, !discovered).await) }
        });
        let d_probes = self.decode.iter().map(|(&j, url)| async move { (j, self.probe_health(url).await) });
        tokio::select! {
            _ = shutdown.cancelled() => None,
            r = futures::future::join(join_all(p_probes), join_all(d_probes)) => Some(r),
        }
    }

    /// The pause between two rounds, taking the actor's commands meanwhile (a new engine is probed
    /// at once); `false` when the poller is shut down or the actor is gone.
    async fn pause(
        &mut self,
        rounds: &mut Rounds,
        commands: &mut mpsc::UnboundedReceiver<Command>,
        shutdown: &CancellationToken,
    ) -> bool {
        let pause = tokio::time::sleep(self.interval);
        tokio::pin!(pause);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return false,
                _ = &mut pause => return true,
                asked = commands.recv() => match asked {
                    Some(command) => {
                        let joined = matches!(command, Command::AddPrefill { .. } | Command::AddDecode { .. });
                        self.apply(rounds, command);
                        if joined {
                            return true;
                        }
                    }
                    None => return false,
                },
            }
        }
    }

    /// One command of the actor's, applied to the targets and what the rounds remember of them.
    fn apply(&mut self, rounds: &mut Rounds, command: Command) {
        match command {
            Command::Requery(i) => {
                rounds.requested.insert(i);
            }
            Command::AddPrefill { index, url, bootstrap } => {
                self.prefill.insert(index, (url, bootstrap));
            }
            Command::AddDecode { index, url } => {
                self.decode.insert(index, url);
            }
            Command::Remove(Pool::Prefill, i) => {
                self.prefill.remove(&i);
                rounds.discovered.remove(&i);
                rounds.p_failures.remove(&i);
                rounds.requested.remove(&i);
            }
            Command::Remove(Pool::Decode, j) => {
                self.decode.remove(&j);
                rounds.d_failures.remove(&j);
            }
            Command::Unreachable(Pool::Prefill, i) => {
                rounds.discovered.remove(&i);
            }
            Command::Unreachable(Pool::Decode, _) => {}
        }
    }

    /// Sends one report to the actor; false when the actor is gone.
    async fn report(&self, report: Report) -> bool {
        let Some(actor) = Some(self.actor.clone()).filter(|a| a.is_alive()) else { return false };
        let sent = match report {
            Report::Health(m) => tokio::time::timeout(TELL_DEADLINE, actor.tell(m).send()).await.map(|r| r.is_ok()),
            Report::Discovered(m) => tokio::time::timeout(TELL_DEADLINE, actor.tell(m).send()).await.map(|r| r.is_ok()),
            Report::Deadline => {
                tokio::time::timeout(TELL_DEADLINE, actor.tell(ReadyDeadlinePassed).send()).await.map(|r| r.is_ok())
            }
        };
        match sent {
            Ok(alive) => alive,
            Err(_) => {
                tracing::warn!("proxy actor did not take a health report within {TELL_DEADLINE:?}; dropped it");
                true
            }
        }
    }

    /// `GET {url}/health` → 2xx within the probe deadline.
    async fn probe_health(&self, url: &str) -> bool {
        match self.client.get(format!("{url}/health")).timeout(self.probe_timeout).send().await {
            Ok(resp) => resp.status().is_success(),
            Err(e) => {
                tracing::debug!(%url, error = %e, "health probe failed");
                false
            }
        }
    }

    /// Step 6, then (if `query`) step 7 on P's bootstrap.
    async fn probe_prefill(&self, url: &str, bootstrap: &str, query: bool, discovering: bool) -> PrefillProbe {
        let health_span = if discovering { step_span!(steps::PROXY_HEALTH) } else { tracing::Span::none() };
        let healthy = self.probe_health(url).instrument(health_span.clone()).await;
        if healthy { Outcome::Ok } else { Outcome::UNHEALTHY }.record(&health_span);
        drop(health_span);
        if !healthy {
            return PrefillProbe::Unhealthy;
        }
        if !query {
            return PrefillProbe::Healthy;
        }
        let query_span = step_span!(steps::PROXY_QUERY);
        match self.query(bootstrap).instrument(query_span.clone()).await {
            Ok(ids) if !ids.is_empty() => {
                let joined: Vec<&str> = ids.values().map(EngineId::as_str).collect();
                query_span.record(attrs::ENGINE_ID, joined.join(",").as_str());
                Outcome::Ok.record(&query_span);
                PrefillProbe::Discovered(ids)
            }
            Ok(_) => {
                Outcome::NOT_REGISTERED.record(&query_span);
                tracing::info!(%bootstrap, "bootstrap has no engine registered yet");
                PrefillProbe::Healthy
            }
            Err(reason) => {
                Outcome::ERROR.record(&query_span);
                tracing::warn!(%bootstrap, %reason, "bootstrap /query failed");
                PrefillProbe::Healthy
            }
        }
    }

    /// `GET {bootstrap}/query` → dp rank → engine id.
    async fn query(&self, bootstrap: &str) -> Result<BTreeMap<u32, EngineId>, QueryError> {
        let url = format!("{bootstrap}/query");
        let call = crate::bootstrap_call::send(&self.client, self.secret.as_ref(), Call::Query, &url, None);
        let answered = tokio::time::timeout(self.probe_timeout, call).await;
        let answer = match answered {
            Ok(answer) => answer?,
            Err(_) => return Err(QueryError::Timeout { url, after: self.probe_timeout }),
        };
        if !answer.status.is_success() {
            return Err(QueryError::Status { status: answer.status, body: answer.text() });
        }
        let table: QueryResponse = serde_json::from_slice(&answer.body).map_err(QueryError::NotQueryBody)?;
        table
            .into_iter()
            .map(|(dp, entry)| match dp.parse::<u32>() {
                Ok(rank) => Ok((rank, entry.engine_id)),
                Err(_) => Err(QueryError::BadDpRank { dp }),
            })
            .collect()
    }
}

/// Why step 7's `GET {bootstrap}/query` failed (logged; P stays healthy and is asked again).
#[derive(Debug, thiserror::Error)]
enum QueryError {
    /// No answer within the probe's deadline.
    #[error("GET {url} got no answer within {after:?}")]
    Timeout { url: String, after: Duration },
    /// The call failed (unreachable bootstrap, an answer without the cluster secret's proof …).
    #[error(transparent)]
    Call(#[from] BootstrapCallError),
    /// Bootstrap answered with an error status.
    #[error("status {status}: {body}")]
    Status { status: reqwest::StatusCode, body: String },
    /// The answer is not a `/query` table.
    #[error("unexpected /query body: {0}")]
    NotQueryBody(#[source] serde_json::Error),
    /// The table's key is not a data-parallel rank.
    #[error("non-numeric dp rank `{dp}` in /query")]
    BadDpRank { dp: String },
}

/// What the poller remembers between rounds.
struct Rounds {
    /// When the actor is told that the proxy did not get ready in time (`ready_timeout`).
    ready_deadline: Option<Instant>,
    deadline_reported: bool,
    /// Per P: its engine ids are known (step 7 done).
    discovered: BTreeMap<usize, bool>,
    /// The P the actor asked to re-query (a failed prefill).
    requested: BTreeSet<usize>,
    round: u64,
    /// Consecutive failed probes per target: one slow probe on a loaded engine is not an outage.
    p_failures: BTreeMap<usize, u32>,
    d_failures: BTreeMap<usize, u32>,
    /// Failed probes in a row that take a serving target out of rotation.
    unhealthy_after: u32,
}

impl Rounds {
    /// What this round's P probes tell the actor. Before discovery every failure counts; after,
    /// only a run of `unhealthy_after` (by default [`UNHEALTHY_AFTER`]).
    fn prefill_reports(&mut self, probes: Vec<(usize, PrefillProbe)>) -> Vec<Report> {
        let mut reports = Vec::new();
        for (i, probe) in probes {
            let failures = self.p_failures.entry(i).or_default();
            let discovered = self.discovered.entry(i).or_default();
            match probe {
                PrefillProbe::Unhealthy => {
                    *failures += 1;
                    if !*discovered || *failures >= self.unhealthy_after {
                        *discovered = false;
                        reports.push(Report::Health(TargetHealth { pool: Pool::Prefill, index: i, healthy: false }));
                    }
                }
                PrefillProbe::Healthy => {
                    *failures = 0;
                    reports.push(Report::Health(TargetHealth { pool: Pool::Prefill, index: i, healthy: true }))
                }
                PrefillProbe::Discovered(dp_engine_id) => {
                    *failures = 0;
                    *discovered = true;
                    reports.push(Report::Discovered(PrefillDiscovered { prefill_index: i, dp_engine_id }));
                }
            }
        }
        reports
    }

    /// What this round's D probes tell the actor: a healthy D at once, an unhealthy one after a
    /// run of `unhealthy_after` failures.
    fn decode_reports(&mut self, results: Vec<(usize, bool)>) -> Vec<Report> {
        let mut reports = Vec::new();
        for (j, healthy) in results {
            let failures = self.d_failures.entry(j).or_default();
            *failures = if healthy { 0 } else { *failures + 1 };
            if healthy || *failures >= self.unhealthy_after {
                reports.push(Report::Health(TargetHealth { pool: Pool::Decode, index: j, healthy }));
            }
        }
        reports
    }

    /// The ready deadline's report, once, when it has passed.
    fn deadline_report(&mut self) -> Option<Report> {
        let deadline = self.ready_deadline?;
        if self.deadline_reported || Instant::now() < deadline {
            return None;
        }
        self.deadline_reported = true;
        Some(Report::Deadline)
    }
}

enum Report {
    Health(TargetHealth),
    Discovered(PrefillDiscovered),
    Deadline,
}
