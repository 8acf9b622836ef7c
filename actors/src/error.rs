//! The actors crate's error types: what went wrong, and what a user can do about it.
//!
//! [`ActorError`] is what an actor's start, or a handler whose failure stops the actor, returns.
//! Where an underlying error exists (an I/O or ZeroMQ error, an HTTP client's, a URL's) it is kept
//! as the [`std::error::Error::source`]; the text says what failed and what to check.

use pdflow_auth::Refusal;

/// A URL that does not parse (`url::ParseError`, named through reqwest's `Url`).
pub type UrlParseError = <reqwest::Url as std::str::FromStr>::Err;

/// Errors of pdflow's actors.
#[derive(Debug, thiserror::Error)]
pub enum ActorError {
    /// A listening socket could not be bound.
    #[error("cannot bind {what} on {addr}: {source} (is the port free?)")]
    Bind { what: &'static str, addr: String, source: std::io::Error },
    /// P's side-channel socket (ZeroMQ ROUTER) could not be bound, or broke while serving.
    #[error("side-channel socket error on {addr}: {error}")]
    SideChannel {
        addr: String,
        #[source]
        error: SideChannelError,
    },
    /// Every registration attempt with bootstrap failed; `last` is why the last one did.
    #[error("bootstrap at {url} could not be reached after {attempts} attempts: {last} (is it running? start `pdflow bootstrap`, or check `bootstrap_url` / `--bootstrap-url` and the firewall)")]
    BootstrapUnreachable {
        url: String,
        attempts: u32,
        #[source]
        last: RegisterAttemptError,
    },
    /// Bootstrap answered the registration with 400 (a conflicting registration) or 401 (the
    /// cluster secret): retrying cannot help, the registration or the secret must change.
    #[error("bootstrap at {url} refused the registration of engine {engine_id} (dp {dp_rank} tp {tp_rank} pp {pp_rank}): {answer}")]
    RegistrationRefused {
        url: String,
        engine_id: pdflow_messages::EngineId,
        dp_rank: u32,
        tp_rank: u32,
        pp_rank: u32,
        status: reqwest::StatusCode,
        /// Bootstrap's answer (lossy UTF-8 of its body).
        answer: String,
    },
    /// A registration could not be encoded as JSON.
    #[error("cannot encode the registration: {0}")]
    EncodeRegistration(#[source] serde_json::Error),
    /// An HTTP client could not be built.
    #[error("cannot build {what}: {source}")]
    HttpClient { what: &'static str, source: reqwest::Error },
    /// The proxy was given an empty prefill or decode pool, and no bootstrap to discover engines at.
    #[error("the proxy needs at least one prefill and one decode instance (got {prefill} P, {decode} D), or a bootstrap to discover them at")]
    EmptyPool { prefill: usize, decode: usize },
    /// A prefill or decode URL given to the proxy does not parse.
    #[error("invalid {pool} URL `{url}`: {source} (expected http://host:port)")]
    InvalidUrl { pool: &'static str, url: String, source: UrlParseError },
    /// A prefill or decode URL given to the proxy is not `http://host:port`.
    #[error("{pool} URL `{url}` must be http://host:port (no TLS)")]
    UnsupportedUrl { pool: &'static str, url: String },
    /// The proxy was not ready within its ready timeout (`waiting_for`: what it still waited for).
    #[error("proxy not ready before its ready timeout; still waiting for: {}", waiting_for.join(", "))]
    NotReadyInTime { waiting_for: Vec<String> },
    /// `--kv-events` names an engine that is in neither pool.
    #[error(
        "--kv-events names {url}, which is neither a --prefill nor a --decode engine (give the URL as given there)"
    )]
    KvEventsUnknownEngine { url: String },
    /// An engine of a `kv_aware` pool has no KV events endpoint.
    #[error("{pool} engine {url} has no KV events endpoint, which its pool's kv_aware policy needs: --kv-events {url}=tcp://HOST:PORT (the engine's --kv-events-config endpoint)")]
    KvEventsMissing { pool: &'static str, url: String },
}

/// What went wrong with P's side-channel socket ([`ActorError::SideChannel`]).
#[derive(Debug, thiserror::Error)]
pub enum SideChannelError {
    /// The ROUTER socket could not be bound (within the re-bind deadline of a restart).
    #[error("cannot bind the ROUTER socket: {0} (is the host address local and the port free?)")]
    Bind(#[source] zeromq::ZmqError),
    /// The socket bound to something other than a TCP endpoint.
    #[error("bound to a non-tcp endpoint {0}")]
    NotTcp(zeromq::Endpoint),
    /// The socket stopped receiving: the listener fails and its supervisor restarts it.
    #[error("socket closed: {0}")]
    Closed(#[source] zeromq::ZmqError),
}

/// Why one `POST /register` attempt failed (retried; the last one ends in
/// [`ActorError::BootstrapUnreachable`]).
#[derive(Debug, thiserror::Error)]
pub enum RegisterAttemptError {
    /// Bootstrap answered with a status that may pass (5xx, 404 …).
    #[error("HTTP {0}")]
    Status(reqwest::StatusCode),
    /// The call itself failed.
    #[error(transparent)]
    Call(#[from] BootstrapCallError),
}

/// Why a call to bootstrap (`POST /register`, `GET /query`) failed before its status could be
/// looked at.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapCallError {
    /// The URL built from the configured bootstrap address does not parse.
    #[error("bad bootstrap URL {url}: {source}")]
    BadUrl { url: String, source: UrlParseError },
    /// The request could not be sent or got no answer (connection refused, a deadline …).
    #[error("{method} {url} failed: {source}")]
    Request { method: &'static str, url: String, source: reqwest::Error },
    /// The answer's body could not be read.
    #[error("{method} {url}: reading the answer failed: {source}")]
    ReadAnswer { method: &'static str, url: String, source: reqwest::Error },
    /// With a cluster secret: the answer carries no valid proof of it.
    #[error("{method} {url}: the answer is refused ({why}); is that bootstrap started with this cluster secret?")]
    AnswerRefused {
        method: &'static str,
        url: String,
        #[source]
        why: Refusal,
    },
}
