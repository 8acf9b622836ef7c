//! The side channel under the cluster secret (steps 21 and 30), for both ends: D seals each
//! request and takes only answers sealed to it; P serves only requests sealed by a holder of the
//! secret, each once, and seals its answers to them. Without a secret nothing is sealed or
//! checked (and a seal a peer sends is ignored). Owns no seed step.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use pdflow_auth::{sealed, ClusterSecret, Nonce, Refusal, ReplayGuard, Socket};

/// How far a pull's send time may be from P's clock.
pub const PULL_WINDOW: Duration = Duration::from_secs(30);

/// P's end: the secret and the pulls seen (shared by every incarnation of the listener, so a
/// restart does not reopen the window).
#[derive(Debug, Clone)]
pub struct ListenerAuth {
    secret: Option<ClusterSecret>,
    replay: Arc<ReplayGuard>,
}

impl Default for ListenerAuth {
    fn default() -> Self {
        Self::new(None)
    }
}

impl ListenerAuth {
    pub fn new(secret: Option<ClusterSecret>) -> Self {
        Self { secret, replay: Arc::new(ReplayGuard::new(PULL_WINDOW)) }
    }

    /// The secret P's worker signs its bootstrap registrations with.
    pub fn secret(&self) -> Option<&ClusterSecret> {
        self.secret.as_ref()
    }

    /// Opens a request from `identity`: `frames` after the identity, `[body]` or `[body, seal]`.
    /// Returns the body and, with a secret, the nonce its answers are to be sealed to; `Err` when
    /// it must not be served (counted and logged).
    pub(crate) fn open<'a>(
        &self,
        identity: &Bytes,
        frames: &'a [Bytes],
    ) -> Result<(&'a Bytes, Option<Nonce>), OpenError> {
        let (body, seal) = match frames {
            [body] => (body, None),
            [body, seal] => (body, Some(seal)),
            _ => return Err(OpenError::Frames(frames.len())),
        };
        let Some(secret) = &self.secret else { return Ok((body, None)) };
        let opened = match seal {
            Some(seal) => sealed::open_request(secret, body, seal, &self.replay),
            None => Err(Refusal::Missing),
        };
        let nonce = opened.map_err(|why| {
            pdflow_auth::refused(Socket::SideChannel, &peer_name(identity), why);
            OpenError::Refused(why)
        })?;
        Ok((body, Some(nonce)))
    }

    /// The seal of an answer `body` to the pull that carried `nonce` (none without a secret). An
    /// answer to a request refused before it was opened has no nonce: it is sealed to zeros,
    /// which no D pull accepts as its own.
    pub(crate) fn seal(&self, body: &[u8], nonce: Option<&Nonce>) -> Option<Vec<u8>> {
        let secret = self.secret.as_ref()?;
        Some(sealed::seal_reply(secret, body, nonce.unwrap_or(&[0u8; 16])))
    }
}

/// The nonce each D pull task's answers are sealed to, by its identity: held from its pull until
/// its final answer (so at most one per pull in flight).
#[derive(Debug, Default)]
pub(crate) struct ReplyNonces(Mutex<HashMap<Bytes, Nonce>>);

impl ReplyNonces {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Bytes, Nonce>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn insert(&self, identity: Bytes, nonce: Nonce) {
        self.lock().insert(identity, nonce);
    }

    pub(crate) fn get(&self, identity: &Bytes) -> Option<Nonce> {
        self.lock().get(identity).copied()
    }

    pub(crate) fn remove(&self, identity: &Bytes) {
        self.lock().remove(identity);
    }
}

/// Why a request is not served.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OpenError {
    #[error("expected one frame (or a frame and its seal) after the identity, got {0}")]
    Frames(usize),
    #[error("refused: {0}")]
    Refused(Refusal),
}

/// D's side: seals a request, and opens the answer to it.
#[derive(Debug, Clone, Default)]
pub struct PullAuth {
    pub secret: Option<ClusterSecret>,
}

impl PullAuth {
    /// The frames of a request `body`, and the nonce its answer must be sealed to.
    pub fn seal(&self, body: Vec<u8>) -> (Vec<Vec<u8>>, Option<Nonce>) {
        match &self.secret {
            None => (vec![body], None),
            Some(secret) => {
                let (seal, nonce) = sealed::seal_request(secret, &body);
                (vec![body, seal], Some(nonce))
            }
        }
    }

    /// The body of an answer from `worker_addr` to the request sealed with `nonce`; `Err` for
    /// one that must be ignored (it is counted and logged).
    pub fn open<'a>(
        &self,
        frames: &'a [Bytes],
        nonce: Option<&Nonce>,
        worker_addr: &str,
    ) -> Result<&'a Bytes, Refusal> {
        let Some(secret) = &self.secret else { return frames.first().ok_or(Refusal::Malformed) };
        // A request that never left (no nonce) has no answer of its own.
        let Some(nonce) = nonce else { return Err(Refusal::Unproven) };
        let result = match frames {
            [body, seal] => sealed::open_reply(secret, body, seal, nonce).map(|()| body),
            [_] => Err(Refusal::Unproven),
            _ => Err(Refusal::Malformed),
        };
        result.inspect_err(|why| pdflow_auth::refused(Socket::SideChannel, worker_addr, *why))
    }
}

/// A D pull task's identity, as logs show it.
fn peer_name(identity: &Bytes) -> String {
    let hex: String = identity.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("side-channel peer {hex}")
}
