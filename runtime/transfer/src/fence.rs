//! D's write fence (seed steps 29 and 34: no write-after-free). D opens a fence token for each
//! pull before asking P for the KV; P's data connection names the token before the pull's batches;
//! D's data server writes a batch only while its token is open, and counts it in flight while the
//! payload lands. When a pull ends — its KV arrived, or D gave up at a deadline — D closes the
//! token and waits for the batches in flight to finish before the blocks go back to the pool, so
//! a late write (a stalled link that comes back) is refused instead of landing in freed blocks.
//!
//! One-sided writes (RDMA) never pass D's CPU, so D cannot refuse them batch by batch: the
//! fence then holds a [`RemoteAccess`] — per token, the registrations (keys) of the token's blocks
//! that P was granted. Closing the token revokes them: the keys are invalidated and, for a pull
//! that did not end cleanly, the P connections that held them are closed, before the blocks go
//! back to the pool; a write that comes later is refused by D's provider or NIC.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Default)]
struct State {
    /// Open tokens → (batches being written under them, cancelled when the token closes).
    open: HashMap<u64, (usize, CancellationToken)>,
    /// Closed tokens whose last batches are still landing → their count.
    draining: HashMap<u64, usize>,
}

/// The fence table, shared by D's Receiver (opens and closes) and data server (enters batches).
#[derive(Debug, Clone, Default)]
pub struct WriteFence {
    state: Arc<Mutex<State>>,
    drained: Arc<Notify>,
    remote: Option<Arc<dyn RemoteAccess>>,
}

/// One-sided write access to D's memory, granted per fence token (the `rdma` backend's target).
pub trait RemoteAccess: Send + Sync + std::fmt::Debug + 'static {
    /// D's endpoint as the P worker at `peer` (its side-channel address) reaches it.
    fn offer(&self, peer: &str) -> pdflow_messages::rdma::RdmaOffer;
    /// The provider and device writes arrive through (`tcp on lo`, `verbs on mlx5_0`), for logs.
    fn endpoint(&self) -> String;
    /// Registers `ranges` (address, length) of D's memory for writes under `token` by `peer`,
    /// returning the regions and keys P needs.
    fn grant(
        &self,
        token: u64,
        peer: &str,
        ranges: &[(u64, u64)],
    ) -> Result<Vec<pdflow_messages::rdma::RemoteRegion>, String>;
    /// Revokes every grant of `token`; when `clean` is false (the pull did not end with P's
    /// completion of every write) the connections of the token's peer are closed too. On return
    /// no write under the token can land.
    fn revoke(&self, token: u64, clean: bool);
}

/// A batch in flight under a token; dropping it ends the batch. The data server stops reading
/// the batch when [`FenceGuard::revoked`] fires (D closed the token: the link may be stalled and
/// the rest must never land).
#[derive(Debug)]
pub struct FenceGuard {
    fence: WriteFence,
    token: u64,
    revoked: CancellationToken,
}

impl FenceGuard {
    /// Completes when D closes this batch's token.
    pub fn revoked(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.revoked.cancelled()
    }

    /// Whether D closed this batch's token (for a data connection on a blocking thread).
    pub fn is_revoked(&self) -> bool {
        self.revoked.is_cancelled()
    }
}

/// Why [`WriteFence::close`] gave up waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("fence {token}: {in_flight} batch(es) still landing after {waited:?}")]
pub struct FenceStuck {
    pub token: u64,
    pub in_flight: usize,
    pub waited: Duration,
}

impl WriteFence {
    pub fn new() -> Self {
        Self::default()
    }

    /// This fence, also holding one-sided write grants (`access`): closing a token revokes them.
    pub fn with_remote(mut self, access: Arc<dyn RemoteAccess>) -> Self {
        self.remote = Some(access);
        self
    }

    /// The one-sided write access this fence revokes, if any.
    pub fn remote(&self) -> Option<&Arc<dyn RemoteAccess>> {
        self.remote.as_ref()
    }

    /// [`WriteFence::close_now`] for a pull that ended cleanly (P reported every byte written):
    /// the token's remote grants are revoked without closing P's connections.
    pub fn close_clean(&self, token: u64) -> usize {
        if let Some(remote) = &self.remote {
            remote.revoke(token, true);
        }
        self.close_tcp(token)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Counters only: a panicking holder leaves nothing half-done worth refusing over.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Opens `token` (before the pull that names it is sent).
    pub fn open(&self, token: u64) {
        self.lock().open.entry(token).or_insert_with(|| (0, CancellationToken::new()));
    }

    /// Whether `token` is open.
    pub fn is_open(&self, token: u64) -> bool {
        self.lock().open.contains_key(&token)
    }

    /// Starts a batch under `token`: `None` when the token is not open (closed, or never opened).
    pub fn enter(&self, token: u64) -> Option<FenceGuard> {
        let mut state = self.lock();
        let (count, revoked) = state.open.get_mut(&token)?;
        *count += 1;
        Some(FenceGuard { fence: self.clone(), token, revoked: revoked.clone() })
    }

    fn exit(&self, token: u64) {
        let mut state = self.lock();
        if let Some((count, _)) = state.open.get_mut(&token) {
            *count = count.saturating_sub(1);
        } else if let Some(count) = state.draining.get_mut(&token) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                state.draining.remove(&token);
            }
        }
        drop(state);
        self.drained.notify_waiters();
    }

    /// How many writes are in flight under `token` (open or draining).
    pub fn in_flight(&self, token: u64) -> usize {
        let state = self.lock();
        state.open.get(&token).map(|(n, _)| *n).or_else(|| state.draining.get(&token).copied()).unwrap_or(0)
    }

    /// Closes `token` without waiting: no new batch is written under it and the batches landing
    /// are told to stop. Returns how many are still landing (0: no byte can land any more).
    pub fn close_now(&self, token: u64) -> usize {
        if let Some(remote) = &self.remote {
            remote.revoke(token, false);
        }
        self.close_tcp(token)
    }

    fn close_tcp(&self, token: u64) -> usize {
        let mut state = self.lock();
        match state.open.remove(&token) {
            None => state.draining.get(&token).copied().unwrap_or(0),
            Some((n, revoked)) => {
                revoked.cancel();
                if n > 0 {
                    state.draining.insert(token, n);
                }
                n
            }
        }
    }

    /// Closes every open token (a restarted Receiver forgot the pulls they served).
    pub fn close_all(&self) {
        let tokens: Vec<u64> = self.lock().open.keys().copied().collect();
        for token in tokens {
            self.close_now(token);
        }
    }

    /// Closes `token`: no new batch is written under it; the batches already landing are told to
    /// stop, and this waits (at most `deadline`) for them. `Ok` means no byte of the pull can land
    /// any more.
    pub async fn close(&self, token: u64, deadline: Duration) -> Result<(), FenceStuck> {
        if self.close_now(token) == 0 {
            return Ok(());
        }
        let wait = async {
            loop {
                let notified = self.drained.notified();
                if !self.lock().draining.contains_key(&token) {
                    return;
                }
                notified.await;
            }
        };
        match tokio::time::timeout(deadline, wait).await {
            Ok(()) => Ok(()),
            Err(_) => {
                let in_flight = self.lock().draining.get(&token).copied().unwrap_or(0);
                if in_flight == 0 {
                    Ok(())
                } else {
                    Err(FenceStuck { token, in_flight, waited: deadline })
                }
            }
        }
    }
}

impl Drop for FenceGuard {
    fn drop(&mut self) {
        self.fence.exit(self.token);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn batches_enter_only_while_open_and_close_waits_for_them() {
        let fence = WriteFence::new();
        assert!(fence.enter(7).is_none(), "never opened");
        fence.open(7);
        let guard = fence.enter(7).expect("open");
        let closing = {
            let fence = fence.clone();
            tokio::spawn(async move { fence.close(7, Duration::from_secs(5)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!closing.is_finished(), "close waits for the batch in flight");
        assert!(fence.enter(7).is_none(), "closed: no new batch");
        tokio::time::timeout(Duration::from_secs(5), guard.revoked()).await.expect("the batch is told to stop");
        drop(guard);
        assert_eq!(closing.await.expect("joins"), Ok(()));
        assert!(fence.enter(7).is_none());
    }

    #[tokio::test]
    async fn close_reports_a_batch_that_never_ends() {
        let fence = WriteFence::new();
        fence.open(1);
        let _stuck = fence.enter(1).expect("open");
        let err = fence.close(1, Duration::from_millis(30)).await.expect_err("stuck");
        assert_eq!(err.in_flight, 1);
        assert_eq!(fence.close(2, Duration::from_millis(1)).await, Ok(()), "unknown tokens close at once");
    }
}
