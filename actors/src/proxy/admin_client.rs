//! The client of the proxy's admin API ([`super::admin`]), as `pdflow admin` uses it: each call
//! signed with the cluster secret when one is given, and its answer taken only with the proxy's
//! proof bound to that call.

use pdflow_auth::http::{open_answer, sign_call, Call, AUTH_HEADER, REPLY_HEADER};
use pdflow_auth::ClusterSecret;
use pdflow_messages::discovery::KvEventsEndpoint;

/// How long one admin call may take, answer included (a signed call is fresh for 30 s).
const CALL_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// One proxy's admin API.
#[derive(Debug, Clone)]
pub struct AdminClient {
    http: reqwest::Client,
    /// The proxy's base URL, without a trailing `/`.
    base: String,
    secret: Option<ClusterSecret>,
}

/// Why an admin call got no answer to trust.
#[derive(Debug, thiserror::Error)]
pub enum AdminClientError {
    #[error("`{url}` is not a URL: {source}")]
    BadUrl { url: String, source: crate::error::UrlParseError },
    #[error("{method} {url}: {source}")]
    Request { method: &'static str, url: String, source: reqwest::Error },
    #[error("{method} {url}: the answer is not JSON: {source}")]
    NotJson { method: &'static str, url: String, source: serde_json::Error },
    #[error("{method} {url}: the answer does not carry the proxy's proof of the cluster secret: {why}")]
    AnswerRefused { method: &'static str, url: String, why: pdflow_auth::Refusal },
}

/// The admin API's answer: its status and JSON body.
#[derive(Debug, Clone)]
pub struct AdminAnswer {
    pub status: reqwest::StatusCode,
    pub body: serde_json::Value,
}

impl AdminClient {
    /// The admin API of the proxy at `base` (`http://host:port`), calls signed with `secret`.
    pub fn new(base: &str, secret: Option<ClusterSecret>) -> Self {
        Self { http: reqwest::Client::new(), base: base.trim_end_matches('/').to_owned(), secret }
    }

    /// `GET /admin/engines`.
    pub async fn list(&self) -> Result<AdminAnswer, AdminClientError> {
        self.call("GET", "/admin/engines", None).await
    }

    /// `POST /admin/engines`: `pool` is `prefill` or `decode`; `kv_events`, where it publishes
    /// its KV events (read by a `kv_aware` pool).
    pub async fn add(
        &self,
        pool: &str,
        url: &str,
        bootstrap_port: Option<u16>,
        kv_events: &[KvEventsEndpoint],
    ) -> Result<AdminAnswer, AdminClientError> {
        let mut body = serde_json::json!({"pool": pool, "url": url});
        if let Some(port) = bootstrap_port {
            body["bootstrap_port"] = port.into();
        }
        if !kv_events.is_empty() {
            body["kv_events"] = serde_json::json!(kv_events);
        }
        self.call("POST", "/admin/engines", Some(&body)).await
    }

    /// `POST /admin/engines/drain`.
    pub async fn drain(&self, url: &str) -> Result<AdminAnswer, AdminClientError> {
        self.call("POST", "/admin/engines/drain", Some(&serde_json::json!({"url": url}))).await
    }

    /// `POST /admin/engines/undrain`.
    pub async fn undrain(&self, url: &str) -> Result<AdminAnswer, AdminClientError> {
        self.call("POST", "/admin/engines/undrain", Some(&serde_json::json!({"url": url}))).await
    }

    /// `POST /admin/engines/remove`.
    pub async fn remove(&self, url: &str, force: bool) -> Result<AdminAnswer, AdminClientError> {
        self.call("POST", "/admin/engines/remove", Some(&serde_json::json!({"url": url, "force": force}))).await
    }

    /// One call: `GET` without a body, `POST` with a JSON one.
    async fn call(
        &self,
        method: &'static str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<AdminAnswer, AdminClientError> {
        let url = format!("{}{path}", self.base);
        let parsed =
            reqwest::Url::parse(&url).map_err(|source| AdminClientError::BadUrl { url: url.clone(), source })?;
        let bytes = body.map(|b| b.to_string().into_bytes()).unwrap_or_default();
        let mut request = match body {
            Some(_) => self.http.post(parsed.clone()).header("content-type", "application/json"),
            None => self.http.get(parsed.clone()),
        };
        let mut nonce = None;
        if let Some(secret) = &self.secret {
            let signed_path = match parsed.query() {
                Some(q) => format!("{}?{q}", parsed.path()),
                None => parsed.path().to_owned(),
            };
            let (header, n) = sign_call(secret, Call::Admin, method, &signed_path, &bytes);
            request = request.header(AUTH_HEADER, header);
            nonce = Some(n);
        }
        let resp = request
            .body(bytes)
            .timeout(CALL_DEADLINE)
            .send()
            .await
            .map_err(|source| AdminClientError::Request { method, url: url.clone(), source })?;
        let status = resp.status();
        let proof = resp.headers().get(REPLY_HEADER).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let answer =
            resp.bytes().await.map_err(|source| AdminClientError::Request { method, url: url.clone(), source })?;
        if let (Some(secret), Some(nonce), true) = (&self.secret, nonce, status != reqwest::StatusCode::UNAUTHORIZED) {
            open_answer(secret, Call::Admin, &answer, proof.as_deref(), &nonce)
                .map_err(|why| AdminClientError::AnswerRefused { method, url: url.clone(), why })?;
        }
        let body =
            serde_json::from_slice(&answer).map_err(|source| AdminClientError::NotJson { method, url, source })?;
        Ok(AdminAnswer { status, body })
    }
}
