//! Why a secret could not be loaded, and why a peer was refused (its proof, a socket's limit, or
//! its address in protected mode).

/// A cluster secret that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("cannot read the cluster secret file {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("the cluster secret {which} is {len} bytes: use at least {min} (e.g. `openssl rand -hex 32`)")]
    TooShort { which: &'static str, len: usize, min: usize },
    #[error(
        "the cluster secret holds {found} keys: give one (the current) or two (current, then previous), one per line"
    )]
    KeyCount { found: usize },
    #[error("both {0} and {1} are set: give the cluster secret one way")]
    Ambiguous(&'static str, &'static str),
}

/// Why a peer was refused: a closed set, so that metrics labels never carry peer input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Refusal {
    /// The peer sent no proof where one is required (it runs without the secret).
    #[error("no proof of the cluster secret (is the peer configured with it?)")]
    Missing,
    /// The proof names a key this side does not hold (a rotation not finished, or a stranger).
    #[error("the proof names a key this side does not hold (rotate both sides, or check the secret)")]
    UnknownKey,
    /// The proof does not match: a wrong secret, or a message altered or made for another use.
    #[error("the proof does not match (a different secret, or a forged or altered message)")]
    BadProof,
    /// The message's time lies outside the accepted window (a replay, or clocks far apart).
    #[error("the message is older or newer than the accepted window (a replay, or the peers' clocks differ)")]
    Stale,
    /// The nonce was seen before within the window: a replay.
    #[error("the message was seen before (a replay)")]
    Replayed,
    /// The auth fields cannot be read.
    #[error("the auth fields are malformed")]
    Malformed,
    /// This side holds the secret and the peer proved nothing: the peer is not trusted.
    #[error("the peer did not prove that it holds the cluster secret")]
    Unproven,
    /// A message passed the socket's size limit (a hostile peer, or a limit set below a real
    /// message: raise it only then).
    #[error("the peer's message passed the socket's size limit")]
    MessageTooLarge,
    /// The socket's unfinished messages, from every peer together, hold all the bytes it allows
    /// (hostile peers, or a budget set below a real load: raise it only then).
    #[error("the socket's unfinished messages from all peers hold its byte budget")]
    UnfinishedBytes,
    /// A message had more frames than the socket accepts.
    #[error("the peer's message passed the socket's frame limit")]
    TooManyFrames,
    /// The socket already holds its most connections, in all or from the peer's address.
    #[error("the socket holds its most connections (in all, or from this peer's address)")]
    TooManyConnections,
    /// The peer finished no handshake, or no message, within the socket's deadline: closed.
    #[error("the peer finished no handshake or message within the socket's deadline")]
    IdleTimeout,
    /// A message names more items (an abort's transfer ids) than one message may.
    #[error("the peer's message names more items than one message may (split it)")]
    TooManyIds,
    /// Protected mode: no cluster secret is set, and the peer is not on loopback
    /// ([`crate::PeerFilter`]).
    #[error("no cluster secret is set, so only loopback peers are served (give every peer the cluster secret, or start this side with --insecure / PDFLOW_INSECURE=1)")]
    NotLoopback,
    /// TLS is on at this port and the peer spoke something else (its `tls` is off).
    #[error("the peer did not speak TLS to this TLS port (set `tls` alike on both ends: `--tls on`, \"tls\": true)")]
    PlainTextOnTls,
}

impl Refusal {
    /// The `cause` label of `pdflow_auth_refusals_total`.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Missing => "missing",
            Refusal::UnknownKey => "unknown_key",
            Refusal::BadProof => "bad_proof",
            Refusal::Stale => "stale",
            Refusal::Replayed => "replayed",
            Refusal::Malformed => "malformed",
            Refusal::Unproven => "unproven",
            Refusal::MessageTooLarge => "message_too_large",
            Refusal::TooManyFrames => "too_many_frames",
            Refusal::UnfinishedBytes => "unfinished_bytes",
            Refusal::TooManyConnections => "too_many_connections",
            Refusal::IdleTimeout => "idle_timeout",
            Refusal::TooManyIds => "too_many_ids",
            Refusal::NotLoopback => "not_loopback",
            Refusal::PlainTextOnTls => "plaintext_on_tls",
        }
    }
}
