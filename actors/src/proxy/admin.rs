//! The proxy's admin API: engines join and leave a running proxy. The HTTP routes live on the
//! proxy's server ([`router`]) and ask the Proxy actor, whose handlers here change its pools
//! ([`super::pools`]) and tell its health poller.
//!
//! - `GET /admin/engines` — every engine not removed: pool, index, url, state (serving, draining),
//!   healthy, engine ids, requests in flight and routed;
//! - `POST /admin/engines` `{"pool": "prefill"|"decode", "url": …, "bootstrap_port": 8998,
//!   "kv_events": [{"endpoint": "tcp://…", "replay_endpoint": "tcp://…", "topic": …}]}` — a new
//!   engine (201); it serves once healthy (a P: once its engine ids are known); a `kv_aware` pool
//!   follows its KV events from then on;
//! - `POST /admin/engines/drain` `{"url": …}` — no new request goes to it; those in flight finish;
//! - `POST /admin/engines/undrain` `{"url": …}` — a draining engine takes new requests again;
//! - `POST /admin/engines/remove` `{"url": …, "force": false}`, or `DELETE /admin/engines?url=…`
//!   (`&force=true`) — it leaves; refused (409) while requests are in flight on it unless forced.
//!
//! With a cluster secret every call carries `X-Pdflow-Auth`, signed as a bootstrap call is
//! ([`pdflow_auth::http`], [`Call::Admin`], over the method, the path with its query and the
//! body), and the answer carries the proxy's proof bound to it; an unsigned or forged call is
//! refused with a 401 before anything is read. Without a secret only loopback callers are served
//! (403 otherwise, even with `--insecure`). Bad input is a 4xx naming the problem; a refused call
//! changes nothing.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use kameo::prelude::*;
use pdflow_auth::http::{open_call, seal_answer, Call, AUTH_HEADER, REPLY_HEADER};
use pdflow_auth::{ClusterSecret, Nonce, ReplayGuard, Socket};
use pdflow_messages::discovery::KvEventsEndpoint;
use pdflow_messages::proxy::{
    AddEngine, AdminError, DrainEngine, EngineInfo, ListEngines, Pool, RemoveEngine, UndrainEngine,
};
use serde::Deserialize;

use super::{poller, Proxy};

/// How long a signed admin call stays valid (and its nonce remembered against replays).
const CALL_WINDOW: Duration = Duration::from_secs(30);
/// How long an admin handler waits for the Proxy actor.
const ASK_DEADLINE: Duration = Duration::from_secs(5);

// ---- The actor's side -----------------------------------------------------------------------

impl Proxy {
    /// Writes the pools for a restarted actor, and logs the change.
    fn changed(&self, what: &'static str, pool: Pool, index: usize) {
        self.pools.save(&self.roster);
        if let Some(e) = self.pools.info(pool, index) {
            tracing::info!(pool = pool.name(), index, url = %e.url, in_flight = e.in_flight, "admin: engine {what}");
        }
    }

    /// A new engine in `pool` (the admin API, discovery): probed by the poller from its next
    /// round, its KV events followed when its pool is `kv_aware`. Its index; refused, nothing
    /// changed.
    pub(super) fn join(
        &mut self,
        pool: Pool,
        url: &str,
        bootstrap_port: Option<u16>,
        kv_events: &[KvEventsEndpoint],
    ) -> Result<usize, AdminError> {
        let index = self.pools.add(pool, url, bootstrap_port, kv_events)?;
        let command = match pool {
            Pool::Prefill => {
                let p = &self.pools.prefill[index];
                poller::Command::AddPrefill { index, url: p.url.clone(), bootstrap: p.bootstrap_addr.clone() }
            }
            Pool::Decode => poller::Command::AddDecode { index, url: self.pools.decode[index].url.clone() },
        };
        // The poller is gone only while the actor stops.
        let _ = self.poller_tx.send(command);
        self.follow_kv_events(pool, index);
        self.pools.save(&self.roster);
        Ok(index)
    }

    /// Follows the KV events of entry `index` of `pool` at the endpoints its entry holds (a
    /// `kv_aware` pool's engine with some; otherwise nothing).
    pub(super) fn follow_kv_events(&mut self, pool: Pool, index: usize) {
        let Some((url, sources)) = self.pools.kv_sources(pool, index) else { return };
        if self.kv_events.subscribe(pool, index, &url, &sources) {
            tracing::info!(pool = pool.name(), index, %url, sources = sources.len(), "kv events: following");
        }
    }

    /// The engine at `url` leaves (the admin API, discovery when it moved): never chosen again,
    /// never probed again, its KV events no longer followed. Refused while requests are in flight
    /// on it unless `force`.
    pub(super) fn leave(&mut self, url: &str, force: bool) -> Result<(Pool, usize), AdminError> {
        let (pool, index) = self.pools.remove(url, force)?;
        match pool {
            Pool::Prefill => {
                let ranks: Vec<u32> = self.pools.prefill[index].dp_engine_id.keys().copied().collect();
                for dp in ranks {
                    self.prefill_picker.forget((index, dp));
                }
            }
            Pool::Decode => self.decode_picker.forget(index),
        }
        let _ = self.poller_tx.send(poller::Command::Remove(pool, index));
        self.kv_events.unsubscribe(pool, index);
        self.pools.save(&self.roster);
        Ok((pool, index))
    }
}

impl Message<ListEngines> for Proxy {
    type Reply = Result<Vec<EngineInfo>, std::convert::Infallible>;

    async fn handle(&mut self, _msg: ListEngines, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        Ok(self.pools.list())
    }
}

impl Message<AddEngine> for Proxy {
    type Reply = Result<EngineInfo, AdminError>;

    async fn handle(&mut self, msg: AddEngine, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let index = self.join(msg.pool, &msg.url, msg.bootstrap_port, &msg.kv_events)?;
        self.changed("added", msg.pool, index);
        self.pools.info(msg.pool, index).ok_or(AdminError::UnknownEngine { url: msg.url })
    }
}

impl Message<DrainEngine> for Proxy {
    type Reply = Result<EngineInfo, AdminError>;

    async fn handle(&mut self, msg: DrainEngine, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let (pool, index) = self.pools.drain(&msg.url)?;
        self.changed("draining", pool, index);
        self.pools.info(pool, index).ok_or(AdminError::UnknownEngine { url: msg.url })
    }
}

impl Message<UndrainEngine> for Proxy {
    type Reply = Result<EngineInfo, AdminError>;

    async fn handle(&mut self, msg: UndrainEngine, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let (pool, index) = self.pools.undrain(&msg.url)?;
        self.changed("back in service", pool, index);
        self.pools.info(pool, index).ok_or(AdminError::UnknownEngine { url: msg.url })
    }
}

impl Message<RemoveEngine> for Proxy {
    type Reply = Result<EngineInfo, AdminError>;

    async fn handle(&mut self, msg: RemoveEngine, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let (pool, index) = self.leave(&msg.url, msg.force)?;
        self.changed("removed", pool, index);
        self.pools.info(pool, index).ok_or(AdminError::UnknownEngine { url: msg.url })
    }
}

// ---- HTTP ------------------------------------------------------------------------------------

/// What the admin routes hold: the actor, and the secret calls must prove.
pub(super) struct AdminContext {
    pub proxy: ActorRef<Proxy>,
    pub auth: Option<AdminAuth>,
}

/// The cluster secret and the admin calls seen within [`CALL_WINDOW`].
pub(super) struct AdminAuth {
    secret: ClusterSecret,
    guard: ReplayGuard,
}

impl AdminAuth {
    pub fn new(secret: ClusterSecret) -> Self {
        Self { secret, guard: ReplayGuard::new(CALL_WINDOW) }
    }
}

/// The admin routes (`/admin/engines…`).
pub(super) fn router(ctx: Arc<AdminContext>) -> Router {
    Router::new()
        .route("/admin/engines", get(admin_call).post(admin_call).delete(admin_call))
        .route("/admin/engines/drain", post(admin_call))
        .route("/admin/engines/undrain", post(admin_call))
        .route("/admin/engines/remove", post(admin_call))
        .with_state(ctx)
}

/// An admin call that may go on: the nonce its answer is sealed to (with a secret).
struct Admitted(Option<Nonce>);

/// Why an admin call was refused, or failed.
#[derive(Debug, thiserror::Error)]
enum AdminRefusal {
    #[error("admin call refused: {0}")]
    Unauthorized(pdflow_auth::Refusal),
    #[error("admin calls without a cluster secret are served to loopback callers only")]
    NotLoopback,
    #[error("bad admin request: {0}")]
    BadBody(String),
    #[error(transparent)]
    Admin(#[from] AdminError),
    #[error("the proxy did not answer")]
    Unavailable,
}

impl AdminRefusal {
    fn status(&self) -> StatusCode {
        match self {
            AdminRefusal::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            AdminRefusal::NotLoopback => StatusCode::FORBIDDEN,
            AdminRefusal::BadBody(_) => StatusCode::BAD_REQUEST,
            AdminRefusal::Admin(e) => match e {
                AdminError::BadUrl { .. } | AdminError::BootstrapPortForDecode | AdminError::BadKvEvents { .. } => {
                    StatusCode::BAD_REQUEST
                }
                AdminError::UnknownEngine { .. } => StatusCode::NOT_FOUND,
                AdminError::Duplicate { .. } | AdminError::InFlight { .. } => StatusCode::CONFLICT,
            },
            AdminRefusal::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// `POST /admin/engines`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AddBody {
    pool: Pool,
    url: String,
    #[serde(default)]
    bootstrap_port: Option<u16>,
    /// Where it publishes KV events (for a `kv_aware` pool).
    #[serde(default)]
    kv_events: Vec<KvEventsEndpoint>,
}

/// The drain and remove calls' body (and `DELETE`'s query).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TargetBody {
    url: String,
    #[serde(default)]
    force: bool,
}

/// Every admin route: the call admitted (its proof, or a loopback caller), then served; the
/// answer is JSON, sealed to the call when a secret is held.
async fn admin_call(
    State(ctx): State<Arc<AdminContext>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let admitted = match admit(&ctx, &method, &uri, &headers, &body, peer) {
        Ok(admitted) => admitted,
        Err(refusal) => return answer(&ctx, &Admitted(None), Err(refusal)),
    };
    let served = serve(&ctx, &method, &uri, &body).await;
    answer(&ctx, &admitted, served)
}

/// Checks the call's proof (with a secret) or its caller's address (without one).
fn admit(
    ctx: &AdminContext,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
    peer: SocketAddr,
) -> Result<Admitted, AdminRefusal> {
    let Some(auth) = &ctx.auth else {
        return match peer.ip().to_canonical().is_loopback() {
            true => Ok(Admitted(None)),
            false => Err(AdminRefusal::NotLoopback),
        };
    };
    let path = uri.path_and_query().map_or(uri.path(), |pq| pq.as_str());
    let header = headers.get(AUTH_HEADER).and_then(|v| v.to_str().ok());
    match open_call(&auth.secret, Call::Admin, method.as_str(), path, body, header, &auth.guard) {
        Ok(nonce) => Ok(Admitted(Some(nonce))),
        Err(why) => {
            pdflow_auth::refused(Socket::Proxy, &peer.to_string(), why);
            Err(AdminRefusal::Unauthorized(why))
        }
    }
}

/// The admitted call, asked of the actor: `(status, JSON body)`.
async fn serve(
    ctx: &AdminContext,
    method: &Method,
    uri: &Uri,
    body: &[u8],
) -> Result<(StatusCode, serde_json::Value), AdminRefusal> {
    let proxy = Some(ctx.proxy.clone()).filter(|p| p.is_alive()).ok_or(AdminRefusal::Unavailable)?;
    let parse =
        |body: &[u8]| serde_json::from_slice::<TargetBody>(body).map_err(|e| AdminRefusal::BadBody(e.to_string()));

    let info = match (method.as_str(), uri.path()) {
        ("GET", _) => {
            let listed = tokio::time::timeout(ASK_DEADLINE, proxy.ask(ListEngines)).await;
            let engines = match listed {
                Ok(Ok(engines)) => engines,
                _ => return Err(AdminRefusal::Unavailable),
            };
            return Ok((StatusCode::OK, serde_json::json!({ "engines": engines })));
        }
        ("POST", "/admin/engines") => {
            let add: AddBody = serde_json::from_slice(body).map_err(|e| AdminRefusal::BadBody(e.to_string()))?;
            let ask = AddEngine {
                pool: add.pool,
                url: add.url,
                bootstrap_port: add.bootstrap_port,
                kv_events: add.kv_events,
            };
            let info = engine(tokio::time::timeout(ASK_DEADLINE, proxy.ask(ask)).await)?;
            return Ok((StatusCode::CREATED, serde_json::json!(info)));
        }
        ("POST", "/admin/engines/drain") => {
            let target = parse(body)?;
            if target.force {
                return Err(AdminRefusal::BadBody("drain takes no `force`".into()));
            }
            engine(tokio::time::timeout(ASK_DEADLINE, proxy.ask(DrainEngine { url: target.url })).await)?
        }
        ("POST", "/admin/engines/undrain") => {
            let target = parse(body)?;
            if target.force {
                return Err(AdminRefusal::BadBody("undrain takes no `force`".into()));
            }
            engine(tokio::time::timeout(ASK_DEADLINE, proxy.ask(UndrainEngine { url: target.url })).await)?
        }
        ("POST", _) => {
            let target = parse(body)?;
            let ask = RemoveEngine { url: target.url, force: target.force };
            engine(tokio::time::timeout(ASK_DEADLINE, proxy.ask(ask)).await)?
        }
        ("DELETE", _) => {
            let ask = delete_query(uri.query().unwrap_or_default())?;
            engine(tokio::time::timeout(ASK_DEADLINE, proxy.ask(ask)).await)?
        }
        _ => return Err(AdminRefusal::BadBody(format!("{method} {} is not an admin call", uri.path()))),
    };
    Ok((StatusCode::OK, serde_json::json!(info)))
}

/// The actor's answer to an admin change, asked within [`ASK_DEADLINE`].
fn engine<M>(
    asked: Result<Result<EngineInfo, SendError<M, AdminError>>, tokio::time::error::Elapsed>,
) -> Result<EngineInfo, AdminRefusal> {
    match asked {
        Ok(Ok(info)) => Ok(info),
        Ok(Err(SendError::HandlerError(e))) => Err(AdminRefusal::Admin(e)),
        _ => Err(AdminRefusal::Unavailable),
    }
}

/// `DELETE /admin/engines?url=…[&force=true]`'s query.
fn delete_query(query: &str) -> Result<RemoveEngine, AdminRefusal> {
    let bad = |why: String| AdminRefusal::BadBody(format!("query `{query}`: {why}"));
    let parsed = reqwest::Url::parse(&format!("http://admin/?{query}")).map_err(|e| bad(e.to_string()))?;
    let (mut url, mut force) = (None, false);
    for (key, value) in parsed.query_pairs() {
        match (&*key, &*value) {
            ("url", v) => url = Some(v.to_owned()),
            ("force", "true" | "1") => force = true,
            ("force", "false" | "0") => force = false,
            (k, v) => return Err(bad(format!("unexpected `{k}={v}` (takes url=URL and force=true|false)"))),
        }
    }
    Ok(RemoveEngine { url: url.ok_or_else(|| bad("no url=".into()))?, force })
}

/// The JSON answer (an error as `{"error": {"message", "type", "code"}}`), sealed to the call.
fn answer(
    ctx: &AdminContext,
    admitted: &Admitted,
    served: Result<(StatusCode, serde_json::Value), AdminRefusal>,
) -> Response {
    let (status, body) = match served {
        Ok(ok) => ok,
        Err(refusal) => {
            let status = refusal.status();
            let kind = match status {
                StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => "unauthorized",
                StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
                _ => "invalid_request_error",
            };
            let message = refusal.to_string();
            (status, serde_json::json!({"error": {"message": message, "type": kind, "code": status.as_u16()}}))
        }
    };
    let bytes = serde_json::to_vec(&body).unwrap_or_else(|_| b"{}".to_vec());
    let mut resp = (status, [(axum::http::header::CONTENT_TYPE, "application/json")], bytes.clone()).into_response();
    if let (Some(auth), Admitted(Some(nonce))) = (&ctx.auth, admitted) {
        if let Ok(value) = HeaderValue::from_str(&seal_answer(&auth.secret, Call::Admin, &bytes, nonce)) {
            resp.headers_mut().insert(REPLY_HEADER, value);
        }
    }
    resp
}
