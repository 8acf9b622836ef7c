//! Seed step 4: a P worker registers its side-channel address with bootstrap (`POST /register`),
//! retrying with exponential back-off as vLLM's Mooncake connector does. A 400 (conflict), 401
//! (no proof of the secret) or 403 (without a secret, a takeover from another address) is not
//! retried: the registration itself is refused.
//!
//! Beyond vLLM: once registered, the worker repeats the (identical, idempotent)
//! registration every [`REREGISTER_INTERVAL`], so that a bootstrap that restarted with an empty
//! table learns the worker again within that interval instead of never. With a cluster secret
//! each registration is signed and its answer checked ([`bootstrap_call`]).

use std::time::Duration;

use pdflow_auth::http::Call;
use pdflow_auth::ClusterSecret;
use pdflow_messages::bootstrap::RegisterWorker;

use crate::bootstrap_call;
use crate::error::RegisterAttemptError;
use crate::ActorError;

/// The deadline of one `POST /register` attempt.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// The back-off never grows past this.
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// How often a registered worker repeats its registration.
pub(super) const REREGISTER_INTERVAL: Duration = Duration::from_secs(1);

/// Posts `body` to `{bootstrap_url}/register` up to `attempts` times.
pub(super) async fn register_with_bootstrap(
    bootstrap_url: &str,
    body: &RegisterWorker,
    attempts: u32,
    backoff: Duration,
    secret: Option<&ClusterSecret>,
) -> Result<(), ActorError> {
    let attempts = attempts.max(1);
    let client = reqwest::Client::builder()
        .timeout(ATTEMPT_TIMEOUT)
        .build()
        .map_err(|source| ActorError::HttpClient { what: "the HTTP client for bootstrap", source })?;
    let endpoint = format!("{}/register", bootstrap_url.trim_end_matches('/'));
    let json = body_bytes(body)?;
    let mut delay = backoff;
    let mut attempt = 1;
    loop {
        let failed = match bootstrap_call::send(&client, secret, Call::Register, &endpoint, Some(json.clone())).await {
            Ok(answer) if answer.status.is_success() => return Ok(()),
            Ok(answer)
                if answer.status == reqwest::StatusCode::BAD_REQUEST
                    || answer.status == reqwest::StatusCode::UNAUTHORIZED
                    || answer.status == reqwest::StatusCode::FORBIDDEN =>
            {
                return Err(ActorError::RegistrationRefused {
                    url: bootstrap_url.to_string(),
                    engine_id: body.engine_id.clone(),
                    dp_rank: body.dp_rank,
                    tp_rank: body.tp_rank,
                    pp_rank: body.pp_rank,
                    status: answer.status,
                    answer: answer.text(),
                });
            }
            Ok(answer) => RegisterAttemptError::Status(answer.status),
            Err(e) => RegisterAttemptError::Call(e),
        };
        tracing::warn!(url = %endpoint, attempt, attempts, reason = %failed, "bootstrap registration failed; retrying");
        if attempt >= attempts {
            return Err(ActorError::BootstrapUnreachable { url: bootstrap_url.to_string(), attempts, last: failed });
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(MAX_BACKOFF);
        attempt += 1;
    }
}

/// Repeats `body`'s registration every [`REREGISTER_INTERVAL`] until `cancel`; a failure is
/// logged once per outage (the bootstrap may be restarting) and retried at the next tick.
pub(super) async fn keep_registered(
    bootstrap_url: String,
    body: RegisterWorker,
    secret: Option<ClusterSecret>,
    cancel: tokio_util::sync::CancellationToken,
) {
    let Ok(client) = reqwest::Client::builder().timeout(ATTEMPT_TIMEOUT).build() else { return };
    let Ok(json) = body_bytes(&body) else { return };
    let endpoint = format!("{}/register", bootstrap_url.trim_end_matches('/'));
    let mut failing = false;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(REREGISTER_INTERVAL) => {}
        }
        let sent = bootstrap_call::send(&client, secret.as_ref(), Call::Register, &endpoint, Some(json.clone())).await;
        let ok = matches!(sent, Ok(answer) if answer.status.is_success());
        if ok && failing {
            tracing::info!(url = %endpoint, engine_id = %body.engine_id, "bootstrap reachable again: worker registered");
        } else if !ok && !failing {
            tracing::warn!(url = %endpoint, engine_id = %body.engine_id, "repeating the bootstrap registration failed; retrying every {REREGISTER_INTERVAL:?}");
        }
        failing = !ok;
    }
}

/// The registration's JSON.
fn body_bytes(body: &RegisterWorker) -> Result<Vec<u8>, ActorError> {
    serde_json::to_vec(body).map_err(ActorError::EncodeRegistration)
}
