//! The Receiver's bootstrap look-ups (seed step 20: vLLM's `handle_new_engine_id`): an engine
//! whose workers are not cached is looked up once (`GET /query` in a task the actor owns, retried
//! until the answer names it), later pulls for it queue behind that look-up, and its answer caches
//! every engine it names before the queued pulls go (or fail).

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

use super::Receiver;
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

/// What one `/query` answered: every engine with its workers, and each worker's generation by
/// its address (workers that gave none are absent).
#[derive(Debug, Default)]
pub(crate) struct Answer {
    pub engines: BTreeMap<EngineId, WorkerAddrs>,
    pub generations: BTreeMap<String, u64>,
}

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
        let mut answer = Answer::default();
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

/// [`query_bootstrap`] until its answer names `engine_id`, within `timeout` in all: a bootstrap
/// that restarted (refusing connections, or with an empty table until P's next periodic
/// re-registration) is asked again every [`RETRY_EVERY`] rather than failing the requests queued
/// behind the look-up. Returns the last answer (or error) when the time is up.
pub(crate) async fn query_until_registered(
    http: &reqwest::Client,
    secret: Option<&ClusterSecret>,
    bootstrap_addr: &str,
    engine_id: &str,
    timeout: Duration,
) -> Result<Answer, LookupError> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let result = query_bootstrap(http, secret, bootstrap_addr, left.max(Duration::from_millis(1))).await;
        let done = matches!(&result, Ok(answer) if answer.engines.contains_key(engine_id));
        if done || tokio::time::Instant::now() + RETRY_EVERY >= deadline {
            return result;
        }
        tokio::time::sleep(RETRY_EVERY).await;
    }
}

/// Pause between two look-ups of an engine the bootstrap does not (yet) name.
const RETRY_EVERY: Duration = Duration::from_millis(50);

/// One bootstrap look-up in flight, with the requests queued behind it.
#[derive(Debug)]
pub(super) struct Lookup {
    pub(super) bootstrap_addr: String,
    pub(super) queued: BTreeMap<RequestId, PullMeta>,
    pub(super) task: JoinHandle<()>,
}

/// Internal: a look-up task's answer.
struct LookupDone {
    engine_id: EngineId,
    result: Result<Answer, LookupError>,
}

impl Receiver {
    /// Step 20: look `engine_id` up at `bootstrap_addr` in a task; its answer comes back as a message.
    pub(super) fn spawn_lookup(
        &mut self,
        engine_id: &str,
        bootstrap_addr: &str,
        queued: BTreeMap<RequestId, PullMeta>,
        me: &ActorRef<Self>,
    ) {
        let first = queued.keys().next().cloned().unwrap_or_default();
        let span = step_span!(steps::D_BOOTSTRAP_QUERY, request_id = %first);
        span.record(attrs::ENGINE_ID, engine_id);
        let (http, addr, timeout, me) =
            (self.http.clone(), bootstrap_addr.to_string(), self.args.bootstrap_timeout, me.clone());
        let engine = engine_id.to_string();
        let secret = self.args.auth.secret.clone();
        let task = tokio::spawn(async move {
            let result = query_until_registered(&http, secret.as_ref(), &addr, &engine, timeout).instrument(span).await;
            if let Err(e) = me.tell(LookupDone { engine_id: engine.into(), result }).await {
                tracing::debug!(error = %e, "receiver gone before its bootstrap look-up answered");
            }
        });
        self.lookups.insert(engine_id.into(), Lookup { bootstrap_addr: bootstrap_addr.to_string(), queued, task });
    }
}

impl Message<LookupDone> for Receiver {
    type Reply = ();

    /// Step 20's answer: cache every engine it names, then send (or fail) the queued pulls.
    async fn handle(&mut self, msg: LookupDone, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let Some(lookup) = self.lookups.remove(&msg.engine_id) else { return };
        let engine_id = msg.engine_id;
        let failure = match msg.result {
            Ok(answer) => {
                let named: Vec<String> = answer.engines.keys().map(EngineId::to_string).collect();
                self.remote_agents.extend(answer.engines);
                self.p_generations.extend(answer.generations);
                if self.remote_agents.contains_key(&engine_id) {
                    let me = ctx.actor_ref().clone();
                    self.start_pulls(&engine_id, lookup.queued.into_values().collect(), &me).await;
                    return;
                }
                let what = format!(
                    "P engine {engine_id} is not registered at bootstrap {} (its /query names {named:?}; is that P up and registered?)",
                    lookup.bootstrap_addr
                );
                TransferState::LookingUp.passed(self.args.bootstrap_timeout, what).to_string()
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
