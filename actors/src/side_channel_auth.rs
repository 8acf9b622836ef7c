//! The side channel under the cluster secret (steps 21 and 30), for both ends: D seals each
//! request and takes only answers sealed to it; P serves only requests sealed by a holder of the
//! secret, each once, and seals its answers to them. Without a secret nothing is sealed or
//! checked (and a seal a peer sends is ignored). With TLS (the secret's identity,
//! [`pdflow_auth::tls`]) every side-channel connection is also encrypted and mutually
//! authenticated by its handshake, before any ZeroMQ frame. P's end also carries the side
//! channel's limits ([`crate::sender_listener::limits`]), which hold before the secret is proven
//! as after, and protected mode: without a secret (and without `insecure`) a peer not on loopback
//! is closed at its accept ([`PeerFilter`]). Owns no seed step.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use pdflow_auth::{sealed, ClusterSecret, Nonce, PeerFilter, Refusal, ReplayGuard, Socket, TlsIdentity};
use zeromq::{SocketOptions, TlsOption};

use crate::sender_listener::limits::SideChannelLimits;

/// How far a pull's send time may be from P's clock.
pub const PULL_WINDOW: Duration = Duration::from_secs(30);

/// P's end: the secret and the pulls seen (shared by every incarnation of the listener, so a
/// restart does not reopen the window).
#[derive(Debug, Clone)]
pub struct ListenerAuth {
    secret: Option<ClusterSecret>,
    replay: Arc<ReplayGuard>,
    tls: Option<TlsIdentity>,
    /// What a peer may make the socket hold, before and after it proves the secret.
    limits: SideChannelLimits,
    /// Which peers may connect at all: every one with the secret, only loopback ones without it
    /// unless the operator opted out ([`ListenerAuth::insecure`]).
    peers: PeerFilter,
}

impl Default for ListenerAuth {
    fn default() -> Self {
        Self::new(None)
    }
}

impl ListenerAuth {
    pub fn new(secret: Option<ClusterSecret>) -> Self {
        Self {
            peers: PeerFilter::new(secret.as_ref(), false),
            secret,
            replay: Arc::new(ReplayGuard::new(PULL_WINDOW)),
            tls: None,
            limits: SideChannelLimits::default(),
        }
    }

    /// The same, serving non-loopback peers without a secret when `insecure` (protected mode's
    /// opt-out; no effect with a secret).
    pub fn insecure(mut self, insecure: bool) -> Self {
        self.peers = PeerFilter::new(self.secret.as_ref(), insecure);
        self
    }

    /// The same, with TLS on the side channel's socket (D's pull tasks must connect with it).
    pub fn with_tls(mut self, tls: Option<TlsIdentity>) -> Self {
        self.tls = tls;
        self
    }

    /// The same, with other limits on the side channel than [`SideChannelLimits::default`].
    pub fn with_limits(mut self, limits: SideChannelLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The ROUTER socket's options: which peers it accepts, its limits (the idle timeout
    /// outlasting `ready_timeout`), and TLS's server side when on.
    pub(crate) fn socket_options(&self, ready_timeout: Duration) -> SocketOptions {
        let mut options = SocketOptions::default();
        let peers = self.peers;
        options.accept_peers(move |ip| peers.allows(ip));
        self.limits.apply(&mut options, ready_timeout);
        if let Some(tls) = &self.tls {
            options.tls(TlsOption::Server { config: tls.server_config() });
        }
        options
    }

    /// Counts and logs a request from `identity` refused before it was served.
    pub(crate) fn refuse(&self, identity: &Bytes, why: Refusal) {
        pdflow_auth::refused(Socket::SideChannel, &peer_name(identity), why);
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
    /// TLS on the connection to P's side channel (P's listener must have it too).
    pub tls: Option<TlsIdentity>,
}

/// How long D keeps connecting to a P worker address that refuses connections: a listener the
/// supervisor restarts rebinds within it; an address no P serves any more (P moved or died) fails
/// the pull then, and its cached look-up with it, instead of at the connect timeout.
pub(crate) const REFUSED_RETRY_FOR: Duration = Duration::from_millis(500);

impl PullAuth {
    /// A DEALER socket's options: `connect_timeout` (a refused connection — no P listens at the
    /// address any more — is retried for [`REFUSED_RETRY_FOR`] only), and TLS's client side when on.
    pub(crate) fn socket_options(&self, connect_timeout: Duration) -> SocketOptions {
        let mut options = SocketOptions::default();
        options.connect_timeout(connect_timeout);
        options.refused_retry_for(REFUSED_RETRY_FOR.min(connect_timeout));
        if let Some(tls) = &self.tls {
            options.tls(TlsOption::Client { config: tls.client_config(), server_name: TlsIdentity::server_name() });
        }
        options
    }

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

/// Counts and logs a side-channel connection whose TLS handshake failed because the peer is not
/// a holder of the secret (a stranger's certificate, or none); other failures are only logged.
/// `error` is what the socket reported (a DEALER's connect, a ROUTER's accept).
pub(crate) fn tls_refused(error: &zeromq::ZmqError, peer: &str) -> bool {
    let zeromq::ZmqError::Network(io) = error else { return false };
    // An accept's error names its peer; a connect's is tokio-rustls' error as it is.
    let (peer, io) = match io.get_ref().and_then(|e| e.downcast_ref::<zeromq::TlsAcceptError>()) {
        Some(accept) => (accept.peer.to_string(), &accept.source),
        None => (peer.to_string(), io),
    };
    let tls_error = io.get_ref().and_then(|e| e.downcast_ref::<pdflow_auth::tls::RustlsError>());
    let refused = tls_error.is_some_and(pdflow_auth::tls::is_refusal);
    if refused {
        pdflow_auth::refused(Socket::SideChannel, &peer, Refusal::BadProof);
    } else if tls_error.is_some_and(pdflow_auth::tls::is_plaintext) {
        // Counted, not a refusal of the caller's secret: its `tls` is off.
        pdflow_auth::refused(Socket::SideChannel, &peer, Refusal::PlainTextOnTls);
    } else {
        tracing::debug!(%peer, "side-channel TLS handshake failed: {io}");
    }
    refused
}

/// A D pull task's identity, as logs show it.
fn peer_name(identity: &Bytes) -> String {
    let hex: String = identity.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("side-channel peer {hex}")
}
