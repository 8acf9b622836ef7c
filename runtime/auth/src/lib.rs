//! pdflow-auth — the cluster secret and the proofs that every pdflow socket checks with it.
//!
//! One secret is shared by a deployment's bootstrap, P and D workers (given as a file or an
//! environment variable, [`ClusterSecret::from_env`]); up to two keys are accepted at once, the
//! first signs, so the secret can be rotated without restarting everything. It never crosses the
//! wire: a peer proves it holds it by an HMAC-SHA-256 over a challenge — the other side's fresh
//! nonce, the fields the message is bound to — under a label that names the socket and direction
//! ([`Context`]), so a proof made for one purpose is refused for any other.
//!
//! - [`secret`] — the keys, their ids, loading and rotation;
//! - [`proof`] — signing and verifying ([`Proof`]), nonces;
//! - [`http`] — bootstrap calls signed in a header, answers signed back;
//! - [`sealed`] — side-channel frames sealed by D (a pull, once) and answered sealed by P;
//! - [`tls`] — TLS for the data channel, its certificates derived from the secret;
//! - [`replay`] — freshness for one-shot messages: a timestamp window and the nonces seen in it;
//! - [`limits`] — the operator's settings of what a peer may make a socket hold ([`LimitSettings`]);
//! - [`protected`] — protected mode: without a secret, only loopback peers are served unless the
//!   operator opts out ([`PeerFilter`], the one decision every socket asks at accept);
//! - [`Refusal`] — why a proof was refused, with a fixed label for metrics; [`refused`] counts
//!   it in `/metrics` and logs it once per peer.
//!
//! Owns no seed step: it guards steps 4, 7, 20 (bootstrap), 21 and 30 (side channel) and 29
//! (the data channel's hello).

mod error;
pub mod http;
pub mod limits;
pub mod proof;
pub mod protected;
mod refusals;
pub mod replay;
pub mod sealed;
pub mod secret;
pub mod tls;

pub use error::{Refusal, SecretError};
pub use limits::{LimitError, LimitSettings};
pub use proof::{nonce, Context, Nonce, Proof};
pub use protected::{
    insecure_from_env, insecure_from_lookup, InsecureEnvError, PeerFilter, ProtectedBindError, ENV_INSECURE,
};
pub use refusals::{refused, Socket};
pub use replay::ReplayGuard;
pub use secret::{ClusterSecret, KeyId, ENV_SECRET, ENV_SECRET_FILE, MIN_SECRET_LEN};
pub use tls::{TlsError, TlsIdentity};

#[cfg(test)]
mod tests;
