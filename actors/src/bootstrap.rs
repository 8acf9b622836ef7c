//! The Bootstrap actor: the table engine_id → dp → tp → pp → side-channel address, served over
//! HTTP exactly as vLLM's Mooncake bootstrap server does.
//!
//! Seed steps: 2 (the server starts listening: `step.02.bootstrap_start`), the server side of 4
//! (`POST /register`), 7 and 20 (`GET /query`, asked by the proxy and by D's receiver). The client
//! sides of 4, 7 and 20 (and their step spans) belong to the sender listener, the proxy and the
//! receiver.
//!
//! The table is owned by the actor alone; the axum handlers only `ask` it. The HTTP server runs in
//! a task the actor owns ([`crate::http_serve`]: header and idle deadlines, connection caps) and is
//! shut down gracefully (with a deadline) in `on_stop`.
//!
//! Semantics beyond vLLM's: an identical re-registration is 200 (P retries `/register`), a
//! conflicting one is 400 with the reason as `{"error": "…", "detail": "…"}` (`detail` is what
//! FastAPI clients read), and a malformed body is 400 with the parser's message. With a cluster
//! secret, `/register` and `/query` serve only calls signed by a holder of it (each once), 401
//! otherwise, before the body is read; answers carry the bootstrap's proof bound to the call
//! ([`pdflow_auth::http`]). `/health` stays open: it tells nothing. Without a secret the server
//! serves loopback peers only unless `insecure` ([`PeerFilter`]), and a registration may neither
//! take a worker over nor add one from another peer address ([`Registrants`]: 403).
//!
//! Beside the table of P workers, a second one: engines, P and D, that advertise their role and
//! HTTP URL for the proxy's discovery (`POST /engines`, `GET /engines`; [`engines`]). `/query`
//! never shows it.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kameo::prelude::*;
use pdflow_auth::http::{open_call, seal_answer, Call, AUTH_HEADER, REPLY_HEADER};
use pdflow_auth::{ClusterSecret, Nonce, PeerFilter, Refusal, ReplayGuard, Socket};
use pdflow_messages::bootstrap::{
    BootstrapAddr, EngineEntry, QueryEngines, QueryResponse, RegisterFrom, RegisterRejected, RegisterWorker,
    TABLE_AGE_HEADER,
};
use pdflow_messages::EngineId;
use pdflow_observability::{step_span, steps};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument;

use crate::http_serve::{self, HttpLimits};
use crate::ActorError;

/// How long an HTTP handler waits for the actor's answer.
const ASK_DEADLINE: Duration = Duration::from_secs(5);
/// How long `on_stop` waits for open connections to finish.
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(5);

/// How far a call's send time may be from the bootstrap's clock.
pub const CALL_WINDOW: Duration = Duration::from_secs(30);

/// Where the bootstrap server listens (`0.0.0.0:8998` in the seed), and the secret its callers
/// must prove (none: every call is served, as vLLM's bootstrap does — from loopback peers only,
/// unless `insecure`; see [`PeerFilter`]).
#[derive(Debug, Clone)]
pub struct BootstrapArgs {
    pub bind: SocketAddr,
    pub secret: Option<ClusterSecret>,
    /// Without a secret, serve non-loopback peers anyway (protected mode's opt-out).
    pub insecure: bool,
}

/// One dp rank's engine and its workers, with numeric ranks.
#[derive(Debug, Clone)]
struct DpEntry {
    engine_id: EngineId,
    /// tp_rank → pp_rank → the worker.
    workers: BTreeMap<u32, BTreeMap<u32, Worker>>,
}

/// One registered P worker: its side-channel address and generation (0: not given), and where its
/// registration came from.
#[derive(Debug, Clone)]
struct Worker {
    addr: String,
    generation: u64,
    /// The peer IP address of the registration that set `addr` and `generation` (none: asked in
    /// this process, [`Message<RegisterWorker>`]).
    from: Option<IpAddr>,
}

/// The bootstrap registry and its HTTP server.
pub struct Bootstrap {
    addr: SocketAddr,
    /// dp_rank → entry.
    engines: BTreeMap<u32, DpEntry>,
    /// Without a secret: which registrations may change the table ([`Registrants`]); `None` with
    /// one (every registration is signed by a holder of the secret).
    registrants: Option<Registrants>,
    /// The engines advertised for discovery ([`engines`]).
    advertised: engines::Advertised,
    shutdown: CancellationToken,
    server: Option<AbortOnDropHandle<()>>,
}

/// Without a cluster secret, the bootstrap cannot tell a P worker from anyone who reaches its
/// port, and a registration decides where D sends its pulls (and so where P's KV goes). It keeps
/// the rule "trust on first use, per peer address": the peer IP address a registration comes from
/// is the only thing a forger cannot choose freely (TCP's handshake proves it can receive there).
///
/// - A registered worker's address or generation changes only by a registration from the peer
///   address that registered it. A P worker that restarts (a new generation, often on a new port)
///   registers from the same host, hence the same address, and is accepted; someone elsewhere
///   offering a newer generation — which would otherwise take the worker's traffic over until the
///   bootstrap restarts — is refused. An identical re-registration changes nothing and is accepted
///   from anywhere.
/// - A worker the table does not hold yet — a new data-parallel rank, or a new tensor or pipeline
///   rank — is added only by a peer address that has already registered a worker here, the very
///   first registration of an empty table excepted. An engine's workers and its data-parallel
///   ranks start on the host of the first (processes of one `vllm serve`) and register from it;
///   a forger elsewhere can add neither a dp rank (the proxy would send it a share of the
///   requests, which P answers 400, blamed on the client) nor a tensor rank (D counts an engine's
///   tensor ranks in the table, and would send the forger a pull naming D's blocks).
///
/// What it costs: without a secret, workers that move to another host, and the workers of P
/// engines (or data-parallel ranks) spread over hosts other than the first registrant's, are
/// refused (403, saying to set a cluster secret) until the bootstrap restarts. With a cluster
/// secret every registration is signed and none of this applies.
#[derive(Debug, Default)]
struct Registrants {
    /// Every peer address a registration has been accepted from (none: asked in this process).
    known: std::collections::HashSet<Option<IpAddr>>,
}

impl Actor for Bootstrap {
    type Args = BootstrapArgs;
    type Error = ActorError;

    async fn on_start(args: Self::Args, actor_ref: ActorRef<Self>) -> Result<Self, Self::Error> {
        let span = step_span!(steps::BOOTSTRAP_START);
        async move {
            // A restarted bootstrap re-binds its port: retried while the old socket closes.
            let listener = crate::rebind::bind_http(args.bind, "the bootstrap HTTP server").await?;
            let addr = listener.local_addr().map_err(|source| ActorError::Bind {
                what: "the bootstrap HTTP server",
                addr: args.bind.to_string(),
                source,
            })?;
            let shutdown = CancellationToken::new();
            // A strong ref: weak refs taken in `on_start` of a supervisor-restarted kameo actor do not
            // upgrade; the server task is owned by the actor and stopped in `on_stop`.
            let limits = HttpLimits::serving(PeerFilter::new(args.secret.as_ref(), args.insecure));
            let registrants = args.secret.is_none().then(Registrants::default);
            let auth = args.secret.map(|secret| Arc::new(CallAuth { secret, guard: ReplayGuard::new(CALL_WINDOW) }));
            let app = router(Http { actor: actor_ref.clone(), auth, started: std::time::Instant::now() });
            // Every request carries its peer's address (`ConnectInfo`), which refusals name.
            let server = tokio::spawn(http_serve::serve(listener, app, "bootstrap", limits, shutdown.clone()));
            tracing::info!(%addr, "bootstrap server listening");
            Ok(Bootstrap {
                addr,
                engines: BTreeMap::new(),
                advertised: engines::Advertised::new(registrants.is_some()),
                registrants,
                shutdown,
                server: Some(AbortOnDropHandle::new(server)),
            })
        }
        .instrument(span)
        .await
    }

    async fn on_stop(&mut self, _actor_ref: WeakActorRef<Self>, _reason: ActorStopReason) -> Result<(), Self::Error> {
        self.shutdown.cancel();
        if let Some(server) = self.server.take() {
            match tokio::time::timeout(SHUTDOWN_DEADLINE, server).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "bootstrap server task failed"),
                Err(_) => tracing::warn!("bootstrap server did not stop within {SHUTDOWN_DEADLINE:?}; aborted"),
            }
        }
        Ok(())
    }
}

impl Bootstrap {
    /// Records a worker registered from `from` (none: in this process); identical re-registrations
    /// are accepted, conflicting ones refused. A worker of a newer generation replaces its
    /// previous incarnation (a restart, on the same address or another); an older generation is
    /// refused (a stale process still running). Without a secret, only from the peer address
    /// that registered it, and a new worker only from a known one ([`Registrants`]).
    fn register(&mut self, w: RegisterWorker, from: Option<IpAddr>) -> Result<(), RegisterRejected> {
        let from_known = self.registrants.as_ref().is_none_or(|r| r.known.contains(&from) || self.engines.is_empty());
        let slot = self.engines.get(&w.dp_rank).and_then(|e| e.workers.get(&w.tp_rank)?.get(&w.pp_rank));
        if slot.is_none() && !from_known {
            return Err(RegisterRejected::NewWorkerFromUnknownPeer {
                dp_rank: w.dp_rank,
                tp_rank: w.tp_rank,
                pp_rank: w.pp_rank,
                from: shown(from),
            });
        }
        if let Some(entry) = self.engines.get(&w.dp_rank) {
            if entry.engine_id != w.engine_id {
                return Err(RegisterRejected::EngineIdMismatch {
                    dp_rank: w.dp_rank,
                    registered: entry.engine_id.to_string(),
                    offered: w.engine_id.to_string(),
                });
            }
            if let Some(registered) = entry.workers.get(&w.tp_rank).and_then(|pps| pps.get(&w.pp_rank)) {
                let generations = (registered.generation, w.generation);
                match generations {
                    (old, new) if old != 0 && new != 0 && new < old => {
                        return Err(RegisterRejected::StaleGeneration {
                            dp_rank: w.dp_rank,
                            tp_rank: w.tp_rank,
                            pp_rank: w.pp_rank,
                            registered: old,
                            offered: new,
                        });
                    }
                    (old, new) if new > old && old != 0 => {
                        tracing::info!(engine_id = %w.engine_id, tp_rank = w.tp_rank, pp_rank = w.pp_rank, addr = %w.addr,
                            previous_addr = %registered.addr, generation = new, "worker restarted: its new generation replaces the previous one");
                    }
                    _ if registered.addr != w.addr => {
                        return Err(RegisterRejected::AddrConflict {
                            dp_rank: w.dp_rank,
                            tp_rank: w.tp_rank,
                            pp_rank: w.pp_rank,
                            registered: registered.addr.clone(),
                            offered: w.addr,
                        });
                    }
                    _ if w.generation == registered.generation => return Ok(()),
                    _ => {}
                }
                // A change of this worker (its address, its generation), not from its registrant.
                if self.registrants.is_some() && registered.from != from {
                    return Err(RegisterRejected::NotTheRegistrant {
                        dp_rank: w.dp_rank,
                        tp_rank: w.tp_rank,
                        pp_rank: w.pp_rank,
                        registered: registered.addr.clone(),
                        registered_from: shown(registered.from),
                        from: shown(from),
                    });
                }
            }
        }
        tracing::info!(engine_id = %w.engine_id, dp_rank = w.dp_rank, tp_rank = w.tp_rank, pp_rank = w.pp_rank,
            addr = %w.addr, generation = w.generation, "worker registered");
        let entry = self
            .engines
            .entry(w.dp_rank)
            .or_insert_with(|| DpEntry { engine_id: w.engine_id.clone(), workers: BTreeMap::new() });
        entry
            .workers
            .entry(w.tp_rank)
            .or_default()
            .insert(w.pp_rank, Worker { addr: w.addr, generation: w.generation, from });
        if let Some(registrants) = &mut self.registrants {
            registrants.known.insert(from);
        }
        Ok(())
    }

    /// The table in vLLM's `/query` shape (decimal-string keys).
    fn query(&self) -> QueryResponse {
        self.engines
            .iter()
            .map(|(dp, e)| {
                let worker_addr = e
                    .workers
                    .iter()
                    .map(|(tp, pps)| {
                        (tp.to_string(), pps.iter().map(|(pp, w)| (pp.to_string(), w.addr.clone())).collect())
                    })
                    .collect();
                let worker_generation = e
                    .workers
                    .iter()
                    .map(|(tp, pps)| {
                        let known =
                            pps.iter().filter(|(_, w)| w.generation != 0).map(|(pp, w)| (pp.to_string(), w.generation));
                        (tp.to_string(), known.collect::<BTreeMap<_, _>>())
                    })
                    .filter(|(_, pps)| !pps.is_empty())
                    .collect();
                (dp.to_string(), EngineEntry { engine_id: e.engine_id.clone(), worker_addr, worker_generation })
            })
            .collect()
    }
}

impl Drop for Bootstrap {
    fn drop(&mut self) {
        // The server task is aborted by its AbortOnDropHandle; tell it to stop accepting first.
        self.shutdown.cancel();
    }
}

/// A peer address as refusals name it.
fn shown(from: Option<IpAddr>) -> String {
    from.map_or_else(|| "this process".to_string(), |ip| ip.to_string())
}

/// A registration made in this process (tests, tools): its registrant is "this process".
impl Message<RegisterWorker> for Bootstrap {
    type Reply = Result<(), RegisterRejected>;

    async fn handle(&mut self, msg: RegisterWorker, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.register(msg, None)
    }
}

/// A registration over HTTP (`POST /register`), from its peer's address.
impl Message<RegisterFrom> for Bootstrap {
    type Reply = Result<(), RegisterRejected>;

    async fn handle(&mut self, msg: RegisterFrom, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.register(msg.worker, Some(msg.peer))
    }
}

impl Message<QueryEngines> for Bootstrap {
    type Reply = QueryResponse;

    async fn handle(&mut self, _msg: QueryEngines, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        self.query()
    }
}

impl Message<BootstrapAddr> for Bootstrap {
    type Reply = Result<SocketAddr, std::convert::Infallible>;

    async fn handle(&mut self, _msg: BootstrapAddr, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        Ok(self.addr)
    }
}

// ---- HTTP ----------------------------------------------------------------------------------

/// The secret callers prove, and the calls seen within [`CALL_WINDOW`].
struct CallAuth {
    secret: ClusterSecret,
    guard: ReplayGuard,
}

/// What the handlers hold: the actor, and the secret when calls are authenticated.
#[derive(Clone)]
struct Http {
    actor: ActorRef<Bootstrap>,
    auth: Option<Arc<CallAuth>>,
    /// When this incarnation's (empty) table started filling.
    started: std::time::Instant,
}

/// A call the bootstrap serves: its proof checked (with a secret), its answer to be sealed to it.
struct Admitted {
    nonce: Option<Nonce>,
}

impl Http {
    /// Checks a call's proof before anything of it is read; a refusal is counted, logged once
    /// per peer and answered 401.
    fn admit(
        &self,
        call: Call,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: &[u8],
        peer: SocketAddr,
    ) -> Result<Admitted, Refusal> {
        let Some(auth) = &self.auth else { return Ok(Admitted { nonce: None }) };
        let path = uri.path_and_query().map_or(uri.path(), |pq| pq.as_str());
        let header = headers.get(AUTH_HEADER).and_then(|v| v.to_str().ok());
        match open_call(&auth.secret, call, method.as_str(), path, body, header, &auth.guard) {
            Ok(nonce) => Ok(Admitted { nonce: Some(nonce) }),
            Err(why) => {
                pdflow_auth::refused(Socket::Bootstrap, &peer.to_string(), why);
                Err(why)
            }
        }
    }

    /// `status` with the JSON `body`, sealed to the admitted call when calls are authenticated.
    fn answer(&self, call: Call, admitted: &Admitted, status: StatusCode, body: &serde_json::Value) -> Response {
        let bytes = serde_json::to_vec(body).unwrap_or_else(|_| b"{}".to_vec());
        let mut resp =
            (status, [(axum::http::header::CONTENT_TYPE, "application/json")], bytes.clone()).into_response();
        if let (Some(auth), Some(nonce)) = (&self.auth, &admitted.nonce) {
            let seal = seal_answer(&auth.secret, call, &bytes, nonce);
            if let Ok(value) = HeaderValue::from_str(&seal) {
                resp.headers_mut().insert(REPLY_HEADER, value);
            }
        }
        resp
    }

    /// 503: the actor is gone or late.
    fn unavailable(&self, call: Call, admitted: &Admitted, msg: String) -> Response {
        self.error(call, admitted, StatusCode::SERVICE_UNAVAILABLE, msg)
    }

    /// `{"error": msg, "detail": msg}` with `status`, sealed as [`Http::answer`].
    fn error(&self, call: Call, admitted: &Admitted, status: StatusCode, msg: String) -> Response {
        self.answer(call, admitted, status, &serde_json::json!({"error": msg, "detail": msg}))
    }
}

fn router(http: Http) -> Router {
    Router::new()
        .route("/register", post(http_register))
        .route("/query", get(http_query))
        .route("/engines", get(engines::http_engines).post(engines::http_advertise))
        .route("/health", get(|| async { Json(serde_json::json!({"status": "ok"})) }))
        // This process's counters (refused calls and connections among them), as the proxy's.
        .route("/metrics", get(metrics))
        .with_state(http)
}

async fn metrics() -> Response {
    use pdflow_observability::metrics as m;
    ([(axum::http::header::CONTENT_TYPE, m::CONTENT_TYPE)], m::global().render()).into_response()
}

/// A call refused before admission: 401, unsealed, saying what to do.
fn refused(why: Refusal) -> Response {
    let msg = format!(
        "bootstrap refused the call: {why}; start this peer with the cluster secret (--cluster-secret-file, PDFLOW_CLUSTER_SECRET_FILE or PDFLOW_CLUSTER_SECRET)"
    );
    (StatusCode::UNAUTHORIZED, Json(serde_json::json!({"error": msg, "detail": msg}))).into_response()
}

const GONE: &str = "bootstrap is shutting down";

async fn http_register(
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
    let worker: RegisterWorker = match serde_json::from_slice(&body) {
        Ok(w) => w,
        Err(e) => {
            return http.error(
                call,
                &admitted,
                StatusCode::BAD_REQUEST,
                format!(
                    "invalid /register body ({e}); expected {{\"engine_id\", \"dp_rank\", \"tp_rank\", \"pp_rank\", \"addr\"}}"
                ),
            )
        }
    };
    if !http.actor.is_alive() {
        return http.unavailable(call, &admitted, GONE.to_owned());
    }
    let registration = RegisterFrom { worker, peer: peer.ip().to_canonical() };
    match tokio::time::timeout(ASK_DEADLINE, http.actor.ask(registration)).await {
        Ok(Ok(())) => http.answer(call, &admitted, StatusCode::OK, &serde_json::json!({"status": "ok"})),
        Ok(Err(SendError::HandlerError(rejected))) => {
            tracing::warn!(reason = %rejected, %peer, "registration refused");
            // A takeover refused without a secret is forbidden; a conflict is a bad request.
            let status = if rejected.is_takeover() { StatusCode::FORBIDDEN } else { StatusCode::BAD_REQUEST };
            http.error(call, &admitted, status, rejected.to_string())
        }
        Ok(Err(_)) => http.unavailable(call, &admitted, GONE.to_owned()),
        Err(_) => http.unavailable(call, &admitted, format!("bootstrap did not answer within {ASK_DEADLINE:?}")),
    }
}

async fn http_query(
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
    match tokio::time::timeout(ASK_DEADLINE, http.actor.ask(QueryEngines)).await {
        Ok(Ok(table)) => {
            let table = serde_json::to_value(table).unwrap_or_default();
            let mut answer = http.answer(call, &admitted, StatusCode::OK, &table);
            let age = u64::try_from(http.started.elapsed().as_millis()).unwrap_or(u64::MAX);
            answer.headers_mut().insert(TABLE_AGE_HEADER, HeaderValue::from(age));
            answer
        }
        Ok(Err(_)) => http.unavailable(call, &admitted, GONE.to_owned()),
        Err(_) => http.unavailable(call, &admitted, format!("bootstrap did not answer within {ASK_DEADLINE:?}")),
    }
}

mod engines;
#[cfg(test)]
mod protected_tests;
#[cfg(test)]
mod tests {
    use super::*;

    async fn start() -> (ActorRef<Bootstrap>, String) {
        let actor = Bootstrap::spawn(BootstrapArgs {
            bind: "127.0.0.1:0".parse().expect("addr"),
            secret: None,
            insecure: false,
        });
        let addr = tokio::time::timeout(Duration::from_secs(5), actor.ask(BootstrapAddr))
            .await
            .expect("bootstrap answers in time")
            .expect("bootstrap started");
        (actor, format!("http://{addr}"))
    }

    #[tokio::test]
    async fn refused_calls_are_counted_in_the_bootstrap_s_own_metrics() {
        let secret = ClusterSecret::from_text("0123456789abcdef-bootstrap-metrics").expect("a valid secret");
        let actor = Bootstrap::spawn(BootstrapArgs {
            bind: "127.0.0.1:0".parse().expect("addr"),
            secret: Some(secret),
            insecure: false,
        });
        let addr = tokio::time::timeout(Duration::from_secs(5), actor.ask(BootstrapAddr))
            .await
            .expect("bootstrap answers in time")
            .expect("bootstrap started");
        let base = format!("http://{addr}");
        let client = reqwest::Client::new();
        let unsigned = client.get(format!("{base}/query")).send().await.expect("an answer");
        assert_eq!(unsigned.status(), 401);
        let metrics = client.get(format!("{base}/metrics")).send().await.expect("metrics");
        assert_eq!(metrics.status(), 200);
        let text = metrics.text().await.expect("text");
        let refused = text
            .lines()
            .find(|l| l.starts_with("pdflow_auth_refusals_total{") && l.contains("socket=\"bootstrap\""))
            .unwrap_or_else(|| panic!("no bootstrap refusal in /metrics:\n{text}"));
        let count: f64 = refused.rsplit(' ').next().and_then(|v| v.parse().ok()).expect("a count");
        assert!(count >= 1.0, "{refused}");
    }

    fn seed_worker() -> serde_json::Value {
        serde_json::json!({"engine_id": "6c1f", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://10.0.0.1:41235"})
    }

    async fn post(client: &reqwest::Client, base: &str, body: impl Into<reqwest::Body>) -> (u16, serde_json::Value) {
        let resp = client
            .post(format!("{base}/register"))
            .header("content-type", "application/json")
            .body(body)
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .expect("register reaches bootstrap");
        let status = resp.status().as_u16();
        (status, resp.json().await.expect("json reply"))
    }

    #[tokio::test]
    async fn register_then_query_has_the_seed_shape() {
        let (actor, base) = start().await;
        let client = reqwest::Client::new();
        let (status, _) = post(&client, &base, seed_worker().to_string()).await;
        assert_eq!(status, 200);
        let (status, _) = post(
            &client,
            &base,
            serde_json::json!({"engine_id": "6c1f", "dp_rank": 0, "tp_rank": 1, "pp_rank": 0, "addr": "tcp://10.0.0.1:41236"})
                .to_string(),
        )
        .await;
        assert_eq!(status, 200);
        let answer = client.get(format!("{base}/query")).timeout(Duration::from_secs(5)).send().await.expect("query");
        let age: u64 = answer
            .headers()
            .get(TABLE_AGE_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .expect("the table's age in milliseconds");
        assert!(age < 60_000, "the table started with this bootstrap: {age} ms");
        let q: serde_json::Value = answer.json().await.expect("json");
        assert_eq!(
            q,
            serde_json::json!({"0": {"engine_id": "6c1f", "worker_addr": {
                "0": {"0": "tcp://10.0.0.1:41235"}, "1": {"0": "tcp://10.0.0.1:41236"}}}})
        );
        let health = client.get(format!("{base}/health")).send().await.expect("health");
        assert_eq!(health.status().as_u16(), 200);
        actor.stop_gracefully().await.expect("stop");
        actor.wait_for_shutdown().await;
    }

    #[tokio::test]
    async fn identical_reregister_is_ok_and_conflicts_are_400_with_reason() {
        let (_actor, base) = start().await;
        let client = reqwest::Client::new();
        assert_eq!(post(&client, &base, seed_worker().to_string()).await.0, 200);
        assert_eq!(post(&client, &base, seed_worker().to_string()).await.0, 200, "P retries must succeed");

        let mut other_addr = seed_worker();
        other_addr["addr"] = "tcp://10.0.0.9:1".into();
        let (status, body) = post(&client, &base, other_addr.to_string()).await;
        assert_eq!(status, 400);
        let reason = body["error"].as_str().expect("error string");
        assert!(reason.contains("already registered at tcp://10.0.0.1:41235"), "{reason}");

        let mut other_engine = seed_worker();
        other_engine["engine_id"] = "beef".into();
        other_engine["tp_rank"] = 3.into();
        let (status, body) = post(&client, &base, other_engine.to_string()).await;
        assert_eq!(status, 400);
        let reason = body["error"].as_str().expect("error string");
        assert!(reason.contains("dp_rank 0 already belongs to engine `6c1f`"), "{reason}");

        let q: QueryResponse =
            client.get(format!("{base}/query")).send().await.expect("query").json().await.expect("json");
        assert_eq!(q["0"].workers().expect("ranks")[&0][&0], "tcp://10.0.0.1:41235", "conflicts change nothing");
        assert_eq!(q["0"].worker_addr.len(), 1);
    }

    #[tokio::test]
    async fn a_restarted_worker_of_a_newer_generation_replaces_its_predecessor_and_an_older_one_is_refused() {
        let (_actor, base) = start().await;
        let client = reqwest::Client::new();
        let mut first = seed_worker();
        first["generation"] = 100.into();
        assert_eq!(post(&client, &base, first.to_string()).await.0, 200);
        assert_eq!(post(&client, &base, first.to_string()).await.0, 200, "its periodic re-registration is idempotent");

        // Restarted on another port: the newer generation wins.
        let mut restarted = seed_worker();
        restarted["addr"] = "tcp://10.0.0.1:50000".into();
        restarted["generation"] = 200.into();
        assert_eq!(post(&client, &base, restarted.to_string()).await.0, 200);

        // The previous incarnation, still running, repeats its registration: refused, table kept.
        let (status, body) = post(&client, &base, first.to_string()).await;
        assert_eq!(status, 400);
        let reason = body["error"].as_str().expect("error string");
        assert!(reason.contains("generation 100 is older than the registered generation 200"), "{reason}");

        let q: QueryResponse =
            client.get(format!("{base}/query")).send().await.expect("query").json().await.expect("json");
        assert_eq!(q["0"].workers().expect("ranks")[&0][&0], "tcp://10.0.0.1:50000");
        assert_eq!(q["0"].generation_of("tcp://10.0.0.1:50000"), 200, "D learns the generation it addresses");

        // Restarted on the same port: the generation is updated in place.
        restarted["generation"] = 300.into();
        assert_eq!(post(&client, &base, restarted.to_string()).await.0, 200);
        let q: QueryResponse =
            client.get(format!("{base}/query")).send().await.expect("query").json().await.expect("json");
        assert_eq!(q["0"].generation_of("tcp://10.0.0.1:50000"), 300);
    }

    #[tokio::test]
    async fn garbage_body_is_rejected_and_the_server_keeps_serving() {
        let (_actor, base) = start().await;
        let client = reqwest::Client::new();
        let (status, body) = post(&client, &base, "{not json").await;
        assert_eq!(status, 400);
        assert!(body["error"].as_str().expect("error").contains("invalid /register body"), "{body}");
        let (status, _) = post(&client, &base, r#"{"engine_id": "x"}"#).await;
        assert_eq!(status, 400, "missing fields are refused");
        assert_eq!(post(&client, &base, seed_worker().to_string()).await.0, 200);
    }

    /// On the paused clock (binding is a plain syscall, no I/O is awaited): a taken port fails the
    /// start with a bind error once the re-bind deadline has passed, not before.
    #[tokio::test(start_paused = true)]
    async fn binding_a_taken_port_is_a_bind_error_at_the_rebind_deadline() {
        use crate::rebind::{REBIND_DEADLINE, REBIND_RETRY_EVERY};
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let bind = taken.local_addr().expect("addr");
        let started_at = tokio::time::Instant::now();
        let actor = Bootstrap::spawn(BootstrapArgs { bind, secret: None, insecure: false });
        let failed = tokio::time::timeout(
            REBIND_DEADLINE * 2,
            actor.wait_for_startup_with_result(|r| {
                matches!(r, Err(kameo::error::HookError::Error(ActorError::Bind { .. })))
            }),
        )
        .await
        .expect("startup finishes");
        assert!(failed, "a taken port must fail with ActorError::Bind");
        let waited = started_at.elapsed();
        assert!(waited >= REBIND_DEADLINE && waited <= REBIND_DEADLINE + REBIND_RETRY_EVERY, "failed after {waited:?}");
        drop(taken);
    }
}
