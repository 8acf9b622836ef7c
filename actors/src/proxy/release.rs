//! P's blocks given back when D cannot be reached: the proxy sent P its request (step 9) and D's
//! connection was refused (step 10), so no D will ever pull the transfer. Left alone, P would hold
//! the blocks until its send expiry. The proxy does what D does when it gives a transfer up: it
//! looks P's workers up at P's bootstrap (signed with the cluster secret, as step 7) and sends each
//! an `AbortPull` naming the transfer on its side channel (sealed with the secret, as step 21);
//! each worker then frees the blocks at once, or as soon as P's prefill ends. Best effort and
//! bounded: a release that cannot be made leaves the blocks to P's send expiry, as before. With
//! TLS on P's side channel the proxy cannot speak it, and the expiry frees them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pdflow_auth::ClusterSecret;
use pdflow_messages::proxy::ReleasePrefill;

use crate::pull_task;
use crate::receiver::lookup;
use crate::side_channel_auth::PullAuth;

/// How long the look-up of P's workers may take.
const LOOKUP_BOUND: Duration = Duration::from_secs(2);
/// How long one worker's abort may take (connect and send).
const ABORT_BOUND: Duration = Duration::from_secs(2);
/// Releases in flight at once; past it, a release is left to P's send expiry (a D that is down
/// under load must not make the proxy open a connection per request).
const MAX_IN_FLIGHT: usize = 256;

/// One release's place under [`MAX_IN_FLIGHT`], given back on drop.
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The proxy's releases of P's blocks.
#[derive(Clone)]
pub(super) struct Releaser {
    client: reqwest::Client,
    secret: Option<ClusterSecret>,
    in_flight: Arc<AtomicUsize>,
}

impl Releaser {
    pub(super) fn new(client: reqwest::Client, secret: Option<ClusterSecret>) -> Self {
        Self { client, secret, in_flight: Arc::default() }
    }

    /// Starts releasing `msg`'s transfer on P's workers (a task of its own; returns at once).
    pub(super) fn release(&self, msg: ReleasePrefill) {
        if self.in_flight.fetch_add(1, Ordering::AcqRel) >= MAX_IN_FLIGHT {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            tracing::debug!(transfer_id = %msg.transfer_id, "too many releases in flight: P's send expiry frees the blocks");
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            // Given back however the task ends (a panic in the look-up included).
            let _slot = InFlight(this.in_flight.clone());
            this.run(msg).await;
        });
    }

    async fn run(&self, msg: ReleasePrefill) {
        let answer = match lookup::query_bootstrap(
            &self.client,
            self.secret.as_ref(),
            &msg.bootstrap_addr,
            LOOKUP_BOUND,
        )
        .await
        {
            Ok(answer) => answer,
            Err(e) => {
                tracing::warn!(transfer_id = %msg.transfer_id, bootstrap = %msg.bootstrap_addr, error = %e,
                        "D was unreachable, and P's workers could not be looked up to free the transfer's blocks: P's send expiry frees them");
                return;
            }
        };
        let Some(workers) = answer.engines.get(&msg.engine_id) else {
            tracing::warn!(transfer_id = %msg.transfer_id, engine_id = %msg.engine_id,
                "D was unreachable, and P's engine is no longer registered: nothing to free");
            return;
        };
        let auth = PullAuth { secret: self.secret.clone(), tls: None };
        let addrs = workers.values().flat_map(|pps| pps.values()).cloned().collect::<Vec<_>>();
        let aborts = addrs.iter().map(|addr| {
            pull_task::abort_orphaned(addr.clone(), auth.clone(), 0, vec![msg.transfer_id.clone()], ABORT_BOUND)
        });
        futures::future::join_all(aborts).await;
        tracing::info!(transfer_id = %msg.transfer_id, engine_id = %msg.engine_id, workers = addrs.len(),
            "D was unreachable: told P's workers to free the transfer's blocks");
    }
}
