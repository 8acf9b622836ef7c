//! The side channel under the cluster secret (steps 21 and 30), for both ends: D seals each
//! request and takes only answers sealed to it; P serves only requests sealed by a holder of the
//! secret, each once, and seals its answers to them. Without a secret nothing is sealed or
//! checked (and a seal a peer sends is ignored). Owns no seed step.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pdflow_auth::{sealed, ClusterSecret, Nonce, Refusal, ReplayGuard, Socket};

/// How far a pull's send time may be from P's clock.
pub const PULL_WINDOW: Duration = Duration::from_secs(30);
/// Answers P keeps a nonce for at most (one per D pull task in flight); past it the oldest go.
const MAX_OPEN_PULLS: usize = 1 << 16;

/// P's end: the secret, the pulls seen (shared by every incarnation of the listener, so a
/// restart does not reopen the window), and the nonce each D pull task's answers are sealed to.
#[derive(Debug, Clone, Default)]
pub struct ListenerAuth {
    secret: Option<ClusterSecret>,
    replay: Arc<ReplayGuardCell>,
}

#[derive(Debug)]
struct ReplayGuardCell(ReplayGuard);

impl Default for ReplayGuardCell {
    fn default() -> Self {
        Self(ReplayGuard::new(PULL_WINDOW))
    }
}

impl ListenerAuth {
    pub fn new(secret: Option<ClusterSecret>) -> Self {
        Self { secret, replay: Arc::default() }
    }
}

/// The nonces P's answers are sealed to, by D's pull-task identity.
#[derive(Debug, Default)]
pub(crate) struct ReplyNonces(HashMap<Bytes, Nonce>);

impl ListenerAuth {
    /// Opens a request from `identity`: `frames` after the identity, `[body]` or `[body, seal]`.
    /// Records the nonce its answers are sealed to. `Err` when it must not be served.
    pub(crate) fn open<'a>(
        &self,
        identity: &Bytes,
        frames: &'a [Bytes],
        nonces: &mut ReplyNonces,
    ) -> Result<&'a Bytes, OpenError> {
        let (body, seal) = match frames {
            [body] => (body, None),
            [body, seal] => (body, Some(seal)),
            _ => return Err(OpenError::Frames(frames.len())),
        };
        let Some(secret) = &self.secret else { return Ok(body) };
        let opened = match seal {
            Some(seal) => sealed::open_request(secret, body, seal, &self.replay.0),
            None => Err(Refusal::Missing),
        };
        let nonce = opened.map_err(|why| {
            pdflow_auth::refused(Socket::SideChannel, &peer_name(identity), why);
            OpenError::Refused(why)
        })?;
        if nonces.0.len() >= MAX_OPEN_PULLS {
            nonces.0.clear();
        }
        nonces.0.insert(identity.clone(), nonce);
        Ok(body)
    }

    /// The seal of an answer `body` to `identity` (none without a secret).
    pub(crate) fn seal(&self, identity: &Bytes, body: &[u8], nonces: &ReplyNonces) -> Option<Vec<u8>> {
        let secret = self.secret.as_ref()?;
        // A request refused before it was opened has no nonce: its error answer is sealed to
        // zeros, which no D pull accepts as its own.
        let nonce = nonces.0.get(identity).copied().unwrap_or_default();
        Some(sealed::seal_reply(secret, body, &nonce))
    }

    /// D's pull task `identity` is done: its nonce is forgotten.
    pub(crate) fn forget(identity: &Bytes, nonces: &mut ReplyNonces) {
        nonces.0.remove(identity);
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
        let (Some(secret), Some(nonce)) = (&self.secret, nonce) else {
            return frames.first().ok_or(Refusal::Malformed);
        };
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
