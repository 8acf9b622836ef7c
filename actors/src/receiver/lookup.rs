//! The Receiver's bootstrap look-ups (seed step 20: vLLM's `handle_new_engine_id`): an engine
//! whose workers are not cached is looked up once at the bootstrap its request names (`GET
//! /query` in a task the actor owns), later pulls for it queue behind that look-up, and its answer
//! caches that engine alone — never another engine the answer names — before the queued pulls go
//! (or fail).
//!
//! A look-up fails fast: an engine a settled table does not name (the bootstrap has been up long
//! enough for every live P to have re-registered) fails at once, as does a refused call (a wrong
//! secret: asking again cannot help, and would be counted again). A bootstrap that is unreachable
//! or just restarted is asked again, backing off, until the look-up's deadline.

use std::collections::BTreeMap;
use std::time::Duration;

use kameo::prelude::*;
use pdflow_auth::http::Call;
use pdflow_auth::ClusterSecret;
use pdflow_messages::bootstrap::{BootstrapBodyError, QueryResponse, WorkerAddrs};
use pdflow_messages::lifecycle::TransferState;
use pdflow_messages::scheduler_connector::{LoadFailure, LoadFailureCause, PullMeta};
use pdflow_messages::{EngineId, RequestId};
use pdflow_observability::{attrs, step_span, steps};
use tokio::task::JoinHandle;
use tracing::Instrument;

use super::{EngineAt, Receiver};
use crate::error::BootstrapCallError;

/// Why a bootstrap look-up (step 20) failed; D's queued requests fail with this text.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LookupError {
    /// The call failed (unreachable bootstrap, an answer without the cluster secret's proof …).
    #[error(transparent)]
    Call(#[from] BootstrapCallError),
    /// Bootstrap answered with an error status.
    #[error("GET {url} answered HTTP {status}: {body}")]
    Status { url: String, status: reqwest::StatusCode, body: String },
    /// The answer is not a `/query` table.
    #[error("GET {url}: body is not a /query answer: {source}")]
    NotQueryBody { url: String, source: serde_json::Error },
    /// An engine's entry names its workers wrongly.
    #[error("GET {url}: {source}")]
    BadEntry { url: String, source: BootstrapBodyError },
    /// No answer within the look-up's deadline.
    #[error("{}", TransferState::LookingUp.passed(*after, format!("GET {url} got no answer")))]
    Timeout { url: String, after: Duration },
}

/// What one `/query` answered: every engine with its workers, each worker's generation by its
/// address (workers that gave none are absent), and how long the table has been filling (when
/// the bootstrap says).
#[derive(Debug, Default)]
pub(crate) struct Answer {
    pub engines: BTreeMap<EngineId, WorkerAddrs>,
    pub generations: BTreeMap<String, u64>,
    pub table_age: Option<Duration>,
}

impl Answer {
    /// Whether the table is old enough that every live P has re-registered since it started
    /// (P re-registers every second): an engine it does not name is not registered. A bootstrap
    /// that does not say (not pdflow's) is never taken as settled.
    pub(crate) fn settled(&self) -> bool {
        self.table_age.is_some_and(|age| age >= TABLE_SETTLED_AFTER)
    }
}

/// A table this old holds every live P: three of P's one-second re-registrations.
pub(crate) const TABLE_SETTLED_AFTER: Duration = Duration::from_secs(3);

/// `GET {bootstrap_addr}/query`: every engine of the answer with its workers (signed, and its
/// answer checked, with a `secret`).
pub(crate) async fn query_bootstrap(
    http: &reqwest::Client,
    secret: Option<&ClusterSecret>,
    bootstrap_addr: &str,
    timeout: Duration,
) -> Result<Answer, LookupError> {
    let base = bootstrap_addr.trim_end_matches('/');
    let url = if base.starts_with("http://") || base.starts_with("https://") {
        format!("{base}/query")
    } else {
        format!("http://{base}/query")
    };
    let call = async {
        let answer = crate::bootstrap_call::send(http, secret, Call::Query, &url, None).await?;
        let status = answer.status;
        if !status.is_success() {
            return Err(LookupError::Status { url: url.clone(), status, body: answer.text() });
        }
        let body: QueryResponse = serde_json::from_slice(&answer.body)
            .map_err(|source| LookupError::NotQueryBody { url: url.clone(), source })?;
        let mut answer = Answer { table_age: answer.table_age, ..Answer::default() };
        for entry in body.values() {
            let workers = entry.workers().map_err(|source| LookupError::BadEntry { url: url.clone(), source })?;
            for addr in workers.values().flat_map(|pps| pps.values()) {
                let generation = entry.generation_of(addr);
                if generation != 0 {
                    answer.generations.insert(addr.clone(), generation);
                }
            }
            answer.engines.insert(entry.engine_id.clone(), workers);
        }
        Ok(answer)
    };
    match tokio::time::timeout(timeout, call).await {
        Ok(answer) => answer,
        Err(_) => Err(LookupError::Timeout { url: url.clone(), after: timeout }),
    }
}

/// [`query_bootstrap`] until its answer names `engine_id`, within `timeout` in all. It returns at
/// once with an answer that names the engine, a settled table that does not ([`Answer::settled`]),
/// or a refusal (an error status below 500, an answer without the secret's proof); a bootstrap
/// that is unreachable, failing, or restarted (its table still refilling) is asked again after a
/// pause that doubles from [`FIRST_PAUSE`] to [`LONGEST_PAUSE`]. Returns the last answer (or
/// error) when the time is up.
pub(crate) async fn query_until_registered(
    http: &reqwest::Client,
    secret: Option<&ClusterSecret>,
    bootstrap_addr: &str,
    engine_id: &str,
    timeout: Duration,
) -> Result<Answer, LookupError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut pause = FIRST_PAUSE;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let result = query_bootstrap(http, secret, bootstrap_addr, left.max(Duration::from_millis(1))).await;
        let final_answer = match &result {
            Ok(answer) => answer.engines.contains_key(engine_id) || answer.settled(),
            Err(LookupError::Status { status, .. }) => !status.is_server_error(),
            Err(LookupError::Call(BootstrapCallError::AnswerRefused { .. })) => true,
            Err(_) => false,
        };
        if final_answer || tokio::time::Instant::now() + pause >= deadline {
            return result;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(LONGEST_PAUSE);
    }
}

/// The first pause before asking a bootstrap again.
const FIRST_PAUSE: Duration = Duration::from_millis(50);
/// The longest pause between two look-ups of one engine.
const LONGEST_PAUSE: Duration = Duration::from_secs(1);

/// One bootstrap look-up in flight, with the requests queued behind it.
#[derive(Debug)]
pub(super) struct Lookup {
    pub(super) bootstrap_addr: String,
    pub(super) queued: BTreeMap<RequestId, PullMeta>,
    pub(super) task: JoinHandle<()>,
}

/// Internal: a look-up task's answer.
struct LookupDone {
    engine: EngineAt,
    result: Result<Answer, LookupError>,
}

impl Receiver {
    /// Step 20: look `engine_id` up at `bootstrap_addr` in a task; its answer comes back as a message.
    pub(super) fn spawn_lookup(
        &mut self,
        engine: EngineAt,
        queued: BTreeMap<RequestId, PullMeta>,
        me: &ActorRef<Self>,
    ) {
        let first = queued.keys().next().cloned().unwrap_or_default();
        let span = step_span!(steps::D_BOOTSTRAP_QUERY, request_id = %first);
        span.record(attrs::ENGINE_ID, engine.engine_id.as_str());
        let (http, timeout, me) = (self.http.clone(), self.args.bootstrap_timeout, me.clone());
        let secret = self.args.auth.secret.clone();
        let asked = engine.clone();
        let task = tokio::spawn(async move {
            let result = query_until_registered(&http, secret.as_ref(), &asked.bootstrap, &asked.engine_id, timeout)
                .instrument(span)
                .await;
            if let Err(e) = me.tell(LookupDone { engine: asked, result }).await {
                tracing::debug!(error = %e, "receiver gone before its bootstrap look-up answered");
            }
        });
        self.lookups.insert(engine.clone(), Lookup { bootstrap_addr: engine.bootstrap, queued, task });
    }
}

impl Message<LookupDone> for Receiver {
    type Reply = ();

    /// Step 20's answer: cache the engine asked for (only), then send (or fail) the queued pulls.
    async fn handle(&mut self, msg: LookupDone, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let Some(lookup) = self.lookups.remove(&msg.engine) else { return };
        let engine = msg.engine;
        let engine_id = &engine.engine_id;
        let failure = match msg.result {
            Ok(mut answer) => {
                if let Some(workers) = answer.engines.remove(engine_id) {
                    for addr in workers.values().flat_map(|pps| pps.values()) {
                        if let Some(&generation) = answer.generations.get(addr) {
                            self.p_generations.insert(addr.clone(), generation);
                        }
                    }
                    self.remote_agents.insert(engine.clone(), workers);
                    let me = ctx.actor_ref().clone();
                    self.start_pulls(&engine, lookup.queued.into_values().collect(), &me).await;
                    return;
                }
                let named: Vec<String> = answer.engines.keys().map(EngineId::to_string).collect();
                let what = format!(
                    "P engine {engine_id} is not registered at bootstrap {} (its /query names {named:?}; is that P up and registered there?)",
                    lookup.bootstrap_addr
                );
                if answer.settled() {
                    what
                } else {
                    TransferState::LookingUp.passed(self.args.bootstrap_timeout, what).to_string()
                }
            }
            Err(reason) => {
                format!("bootstrap look-up of P engine {engine_id} at {} failed: {reason}", lookup.bootstrap_addr)
            }
        };
        for meta in lookup.queued.into_values() {
            self.complete(&meta, Some(LoadFailure::new(LoadFailureCause::Bootstrap, failure.clone())));
        }
    }
}
