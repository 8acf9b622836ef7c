//! The client side of bootstrap calls — P's `POST /register` (step 4), the proxy's and D's
//! `GET /query` (steps 7 and 20) — signed when this side holds the cluster secret, whose answers
//! are then taken only with the bootstrap's proof bound to the call (see [`pdflow_auth::http`]).
//! Owns no seed step: the steps' spans belong to the callers.

use bytes::Bytes;
use pdflow_auth::http::{open_answer, sign_call, Call, AUTH_HEADER, REPLY_HEADER};
use pdflow_auth::{ClusterSecret, Socket};
use pdflow_messages::bootstrap::TABLE_AGE_HEADER;

use crate::error::BootstrapCallError;

/// What the bootstrap answered: its status and body (proven, when a secret is held and the
/// status is a success).
#[derive(Debug)]
pub(crate) struct Answer {
    pub status: reqwest::StatusCode,
    pub body: Bytes,
    /// How long the bootstrap's table has been filling ([`TABLE_AGE_HEADER`]), when it says.
    pub table_age: Option<std::time::Duration>,
}

/// Sends `call` to `url` (`body`: the JSON of a registration; none for a query), with its proof
/// when `secret` is given, and checks the proof of a successful answer. `Err` says why, naming
/// the URL; a status that is not a success is the caller's to judge.
pub(crate) async fn send(
    http: &reqwest::Client,
    secret: Option<&ClusterSecret>,
    call: Call,
    url: &str,
    body: Option<Vec<u8>>,
) -> Result<Answer, BootstrapCallError> {
    let parsed =
        reqwest::Url::parse(url).map_err(|source| BootstrapCallError::BadUrl { url: url.to_owned(), source })?;
    let (method, mut request) = match call {
        // An admin call sent from here is a POST of JSON, as a registration is.
        Call::Register | Call::Admin => ("POST", http.post(parsed.clone()).header("content-type", "application/json")),
        Call::Query => ("GET", http.get(parsed.clone())),
    };
    let body = body.unwrap_or_default();
    let mut nonce = None;
    if let Some(secret) = secret {
        let path = match parsed.query() {
            Some(q) => format!("{}?{q}", parsed.path()),
            None => parsed.path().to_owned(),
        };
        let (header, n) = sign_call(secret, call, method, &path, &body);
        request = request.header(AUTH_HEADER, header);
        nonce = Some(n);
    }
    if method == "POST" {
        request = request.body(body);
    }
    let resp =
        request.send().await.map_err(|source| BootstrapCallError::Request { method, url: url.to_owned(), source })?;
    let status = resp.status();
    let proof = resp.headers().get(REPLY_HEADER).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let table_age = resp
        .headers()
        .get(TABLE_AGE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .map(std::time::Duration::from_millis);
    let answer =
        resp.bytes().await.map_err(|source| BootstrapCallError::ReadAnswer { method, url: url.to_owned(), source })?;
    if let (Some(secret), Some(nonce), true) = (secret, nonce, status.is_success()) {
        open_answer(secret, call, &answer, proof.as_deref(), &nonce).map_err(|why| {
            pdflow_auth::refused(Socket::Bootstrap, url, why);
            BootstrapCallError::AnswerRefused { method, url: url.to_owned(), why }
        })?;
    }
    Ok(Answer { status, body: answer, table_age })
}

impl Answer {
    /// The body as text, for error messages (lossy: a peer's bytes).
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}
