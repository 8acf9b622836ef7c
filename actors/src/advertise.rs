//! An engine advertising itself at bootstraps for the proxy's discovery: its role, HTTP URL, P's
//! bootstrap port and KV-event endpoints, posted to each bootstrap's `POST /engines` at once and
//! then every [`ADVERTISE_EVERY`] (so that a bootstrap that restarted learns it again, and one that
//! stops hearing it drops it), signed with the cluster secret as P's `/register` is. Each call has
//! a deadline; a bootstrap that is down or refuses is logged once per outage and tried again at the
//! next tick, never fatal: the engine serves whether or not it is listed.
//!
//! The [`Advertiser`] is a guard: dropping it stops the task. `pdflow serve` holds one for the
//! engine's life (the bootstrap server side is [`crate::bootstrap`]'s).

use std::time::Duration;

use pdflow_auth::http::Call;
use pdflow_auth::ClusterSecret;
use pdflow_messages::discovery::AdvertiseEngine;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::bootstrap_call;
use crate::ActorError;

/// How often an engine repeats its advertisement.
pub const ADVERTISE_EVERY: Duration = Duration::from_secs(1);
/// The deadline of one `POST /engines`.
const CALL_DEADLINE: Duration = Duration::from_secs(5);

/// A new engine generation: the wall clock in nanoseconds (a restarted engine's is larger).
pub fn new_generation() -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos());
    u64::try_from(nanos).unwrap_or(u64::MAX).max(1)
}

/// The task that keeps one engine advertised; stops when dropped.
#[derive(Debug)]
pub struct Advertiser {
    cancel: CancellationToken,
    _task: AbortOnDropHandle<()>,
}

impl Advertiser {
    /// Advertises `engine` at each of `bootstraps` (`http://host:port`) until dropped.
    pub fn start(
        bootstraps: Vec<String>,
        engine: AdvertiseEngine,
        secret: Option<ClusterSecret>,
    ) -> Result<Self, ActorError> {
        let client = reqwest::Client::builder()
            .timeout(CALL_DEADLINE)
            .build()
            .map_err(|source| ActorError::HttpClient { what: "the HTTP client for advertising", source })?;
        let body = serde_json::to_vec(&engine).map_err(ActorError::EncodeRegistration)?;
        let cancel = CancellationToken::new();
        let endpoints: Vec<String> =
            bootstraps.iter().map(|b| format!("{}/engines", b.trim_end_matches('/'))).collect();
        tracing::info!(engine_id = %engine.engine_id, role = engine.role.name(), url = %engine.url,
            bootstraps = ?bootstraps, "advertising the engine for discovery");
        let task = tokio::spawn(keep_advertised(client, endpoints, body, secret, cancel.clone()));
        Ok(Self { cancel, _task: AbortOnDropHandle::new(task) })
    }
}

impl Drop for Advertiser {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Posts `body` to every endpoint now and every [`ADVERTISE_EVERY`], until `cancel`.
async fn keep_advertised(
    client: reqwest::Client,
    endpoints: Vec<String>,
    body: Vec<u8>,
    secret: Option<ClusterSecret>,
    cancel: CancellationToken,
) {
    let mut failing = vec![false; endpoints.len()];
    loop {
        let calls = endpoints.iter().map(|endpoint| {
            let call = bootstrap_call::send(&client, secret.as_ref(), Call::Register, endpoint, Some(body.clone()));
            async move {
                match tokio::time::timeout(CALL_DEADLINE, call).await {
                    Ok(Ok(answer)) if answer.status.is_success() => Ok(()),
                    Ok(Ok(answer)) => Err(format!("status {}: {}", answer.status, answer.text())),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err(format!("no answer within {CALL_DEADLINE:?}")),
                }
            }
        });
        let sent = tokio::select! {
            _ = cancel.cancelled() => return,
            sent = futures::future::join_all(calls) => sent,
        };
        for ((endpoint, sent), failing) in endpoints.iter().zip(sent).zip(failing.iter_mut()) {
            let was_failing = std::mem::replace(failing, sent.is_err());
            match sent {
                Ok(()) if was_failing => tracing::info!(url = %endpoint, "advertised again"),
                Ok(()) => {}
                Err(reason) if !was_failing => {
                    tracing::warn!(url = %endpoint, %reason, "advertising the engine failed; trying again every {ADVERTISE_EVERY:?}")
                }
                Err(reason) => tracing::debug!(url = %endpoint, %reason, "advertising the engine still fails"),
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(ADVERTISE_EVERY) => {}
        }
    }
}
