//! The proxy's health poller: a task owned by the Proxy actor that probes every P and D and
//! reports back by `tell` (seed steps 6 and 7).
//!
//! Each round probes all targets concurrently, each probe under its own deadline. A P is
//! (re-)queried on its bootstrap (`GET {bootstrap}/query`) when it has no engine ids yet, after it
//! was unhealthy, every [`super::REQUERY_EVERY`] rounds, and when the actor asks (a failed
//! prefill). Step spans 6 and 7 are emitted while a P is being discovered, not for steady-state
//! probes.

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
    /// (P's URL, P's bootstrap address).
    pub prefill: Vec<(String, String)>,
    pub decode: Vec<String>,
    pub interval: Duration,
    pub probe_timeout: Duration,
    pub ready_timeout: Option<Duration>,
    /// Signs the `/query` calls; answers are then taken only with the bootstrap's proof.
    pub secret: Option<pdflow_auth::ClusterSecret>,
}

/// Consecutive failed health probes after which a serving target is taken out of rotation.
pub const UNHEALTHY_AFTER: u32 = 3;

/// What one P probe found.
enum PrefillProbe {
    Unhealthy,
    Healthy,
    Discovered(BTreeMap<u32, EngineId>),
}

impl Poller {
    /// Probes every target once a round, a round every `interval`, and reports to the actor until
    /// shut down or the actor is gone.
    pub async fn run(self, mut requery_rx: mpsc::UnboundedReceiver<usize>, shutdown: CancellationToken) {
        let mut rounds = Rounds {
            ready_deadline: self.ready_timeout.map(|t| Instant::now() + t),
            deadline_reported: false,
            discovered: vec![false; self.prefill.len()],
            requested: BTreeSet::new(),
            round: 0,
            p_failures: vec![0u32; self.prefill.len()],
            d_failures: vec![0u32; self.decode.len()],
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
            if !self.pause(&mut rounds.requested, &mut requery_rx, &shutdown).await {
                return;
            }
        }
    }

    /// One round's probes, all at once: steps 6 and (where due) 7 on every P, `/health` on every
    /// D; `None` when the poller is shut down meanwhile.
    async fn probe_all(&self, rounds: &Rounds, shutdown: &CancellationToken) -> Option<(Vec<PrefillProbe>, Vec<bool>)> {
        let requery_all = rounds.round > 0 && rounds.round.is_multiple_of(REQUERY_EVERY);
        let p_probes = self.prefill.iter().enumerate().map(|(i, (url, bootstrap))| {
            let discovered = rounds.discovered[i];
            let query = !discovered || requery_all || rounds.requested.contains(&i);
            self.probe_prefill(url, bootstrap, query, !discovered)
        });
        let d_probes = self.decode.iter().map(|url| self.probe_health(url));
        tokio::select! {
            _ = shutdown.cancelled() => None,
            r = futures::future::join(join_all(p_probes), join_all(d_probes)) => Some(r),
        }
    }

    /// The pause between two rounds, taking the actor's re-query requests meanwhile; `false` when
    /// the poller is shut down or the actor is gone.
    async fn pause(
        &self,
        requested: &mut BTreeSet<usize>,
        requery_rx: &mut mpsc::UnboundedReceiver<usize>,
        shutdown: &CancellationToken,
    ) -> bool {
        let pause = tokio::time::sleep(self.interval);
        tokio::pin!(pause);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return false,
                _ = &mut pause => return true,
                asked = requery_rx.recv() => match asked {
                    Some(i) => { requested.insert(i); }
                    None => return false,
                },
            }
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
    discovered: Vec<bool>,
    /// The P the actor asked to re-query (a failed prefill).
    requested: BTreeSet<usize>,
    round: u64,
    /// Consecutive failed probes per target: one slow probe on a loaded engine is not an outage.
    p_failures: Vec<u32>,
    d_failures: Vec<u32>,
}

impl Rounds {
    /// What this round's P probes tell the actor. Before discovery every failure counts; after,
    /// only a run of [`UNHEALTHY_AFTER`].
    fn prefill_reports(&mut self, probes: Vec<PrefillProbe>) -> Vec<Report> {
        let mut reports = Vec::new();
        for (i, probe) in probes.into_iter().enumerate() {
            match probe {
                PrefillProbe::Unhealthy => {
                    self.p_failures[i] += 1;
                    if !self.discovered[i] || self.p_failures[i] >= UNHEALTHY_AFTER {
                        self.discovered[i] = false;
                        reports.push(Report::Health(TargetHealth { pool: Pool::Prefill, index: i, healthy: false }));
                    }
                }
                PrefillProbe::Healthy => {
                    self.p_failures[i] = 0;
                    reports.push(Report::Health(TargetHealth { pool: Pool::Prefill, index: i, healthy: true }))
                }
                PrefillProbe::Discovered(dp_engine_id) => {
                    self.p_failures[i] = 0;
                    self.discovered[i] = true;
                    reports.push(Report::Discovered(PrefillDiscovered { prefill_index: i, dp_engine_id }));
                }
            }
        }
        reports
    }

    /// What this round's D probes tell the actor: a healthy D at once, an unhealthy one after a
    /// run of [`UNHEALTHY_AFTER`] failures.
    fn decode_reports(&mut self, results: Vec<bool>) -> Vec<Report> {
        let mut reports = Vec::new();
        for (j, healthy) in results.into_iter().enumerate() {
            self.d_failures[j] = if healthy { 0 } else { self.d_failures[j] + 1 };
            if healthy || self.d_failures[j] >= UNHEALTHY_AFTER {
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
