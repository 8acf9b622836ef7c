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
use pdflow_telemetry::{attrs, step_span, steps};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{Proxy, REQUERY_EVERY};

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
    pub async fn run(self, mut requery_rx: mpsc::UnboundedReceiver<usize>, shutdown: CancellationToken) {
        let ready_deadline = self.ready_timeout.map(|t| Instant::now() + t);
        let mut deadline_reported = false;
        let mut discovered = vec![false; self.prefill.len()];
        let mut requested: BTreeSet<usize> = BTreeSet::new();
        let mut round: u64 = 0;
        // Consecutive failed probes per target: one slow probe on a loaded engine is not an outage.
        let mut p_failures = vec![0u32; self.prefill.len()];
        let mut d_failures = vec![0u32; self.decode.len()];
        loop {
            let requery_all = round > 0 && round.is_multiple_of(REQUERY_EVERY);
            let p_probes = self.prefill.iter().enumerate().map(|(i, (url, bootstrap))| {
                let query = !discovered[i] || requery_all || requested.contains(&i);
                self.probe_prefill(url, bootstrap, query, !discovered[i])
            });
            let d_probes = self.decode.iter().map(|url| self.probe_health(url));
            let (p_results, d_results) = tokio::select! {
                _ = shutdown.cancelled() => return,
                r = futures::future::join(join_all(p_probes), join_all(d_probes)) => r,
            };
            requested.clear();

            let mut reports: Vec<Report> = Vec::new();
            for (i, probe) in p_results.into_iter().enumerate() {
                match probe {
                    PrefillProbe::Unhealthy => {
                        p_failures[i] += 1;
                        // Before discovery every failure counts; after, only a run of them.
                        if !discovered[i] || p_failures[i] >= UNHEALTHY_AFTER {
                            discovered[i] = false;
                            reports.push(Report::Health(TargetHealth {
                                pool: Pool::Prefill,
                                index: i,
                                healthy: false,
                            }));
                        }
                    }
                    PrefillProbe::Healthy => {
                        p_failures[i] = 0;
                        reports.push(Report::Health(TargetHealth { pool: Pool::Prefill, index: i, healthy: true }))
                    }
                    PrefillProbe::Discovered(dp_engine_id) => {
                        p_failures[i] = 0;
                        discovered[i] = true;
                        reports.push(Report::Discovered(PrefillDiscovered { prefill_index: i, dp_engine_id }));
                    }
                }
            }
            for (j, healthy) in d_results.into_iter().enumerate() {
                d_failures[j] = if healthy { 0 } else { d_failures[j] + 1 };
                if healthy || d_failures[j] >= UNHEALTHY_AFTER {
                    reports.push(Report::Health(TargetHealth { pool: Pool::Decode, index: j, healthy }));
                }
            }
            if let Some(deadline) = ready_deadline {
                if !deadline_reported && Instant::now() >= deadline {
                    deadline_reported = true;
                    reports.push(Report::Deadline);
                }
            }
            for report in reports {
                if !self.report(report).await {
                    return;
                }
            }

            round = round.wrapping_add(1);
            let pause = tokio::time::sleep(self.interval);
            tokio::pin!(pause);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = &mut pause => break,
                    asked = requery_rx.recv() => match asked {
                        Some(i) => { requested.insert(i); }
                        None => return,
                    },
                }
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
        health_span.record(attrs::OUTCOME, if healthy { "ok" } else { "unhealthy" });
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
                let joined: Vec<&str> = ids.values().map(String::as_str).collect();
                query_span.record(attrs::ENGINE_ID, joined.join(",").as_str());
                query_span.record(attrs::OUTCOME, "ok");
                PrefillProbe::Discovered(ids)
            }
            Ok(_) => {
                query_span.record(attrs::OUTCOME, "no engine registered yet");
                tracing::info!(%bootstrap, "bootstrap has no engine registered yet");
                PrefillProbe::Healthy
            }
            Err(reason) => {
                query_span.record(attrs::OUTCOME, "error");
                tracing::warn!(%bootstrap, %reason, "bootstrap /query failed");
                PrefillProbe::Healthy
            }
        }
    }

    /// `GET {bootstrap}/query` → dp rank → engine id.
    async fn query(&self, bootstrap: &str) -> Result<BTreeMap<u32, EngineId>, String> {
        let resp = self
            .client
            .get(format!("{bootstrap}/query"))
            .timeout(self.probe_timeout)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("status {}", resp.status()));
        }
        let table: QueryResponse = resp.json().await.map_err(|e| format!("unexpected /query body: {e}"))?;
        table
            .into_iter()
            .map(|(dp, entry)| {
                let dp = dp.parse::<u32>().map_err(|_| format!("non-numeric dp rank `{dp}` in /query"))?;
                Ok((dp, entry.engine_id))
            })
            .collect()
    }
}

enum Report {
    Health(TargetHealth),
    Discovered(PrefillDiscovered),
    Deadline,
}
