//! Sealed one-shot requests and their answers. The requester sends, with its request, a seal —
//! its nonce, its send time and its proof over the request's bytes and both — so the server
//! serves only a request (bound to every byte of it) that a holder of the secret made, once; the
//! server's answer travels with its proof over the answer and the request's nonce, so the
//! requester takes only the answer to its own request, from a holder of the secret.
//!
//! Two exchanges use it, each under its own labels ([`Exchange`]): the side channel's pulls
//! (steps 21 and 30: D requests, P answers; [`PULL`], and the free functions below) and the
//! staged GPU path's requests (step 29: P offers its destinations, D accepts; [`STAGED`]).

use crate::error::Refusal;
use crate::proof::{nonce, Context, Nonce, Proof};
use crate::replay::{now_ms, ReplayGuard};
use crate::secret::ClusterSecret;

/// Bytes of a request's seal: nonce, send time (ms, little-endian), proof.
pub const REQUEST_SEAL_LEN: usize = 16 + 8 + 40;
/// Bytes of an answer's seal: the proof.
pub const REPLY_SEAL_LEN: usize = 40;

/// The labels of one kind of sealed exchange: a proof made for one is refused by every other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exchange {
    request: Context,
    reply: Context,
}

/// D's pull on the side channel and P's answer.
pub const PULL: Exchange = Exchange { request: Context::Pull, reply: Context::PullReply };
/// P's request on the staged GPU path and D's acceptance.
pub const STAGED: Exchange = Exchange { request: Context::StagedOffer, reply: Context::StagedAccept };

impl Exchange {
    /// Seals a request `body`: the seal to send with it, and the nonce its answer must carry.
    pub fn seal_request(self, secret: &ClusterSecret, body: &[u8]) -> (Vec<u8>, Nonce) {
        let n = nonce();
        let sent = now_ms().to_le_bytes();
        let proof = secret.sign(self.request, &[body, &n, &sent]);
        let mut seal = Vec::with_capacity(REQUEST_SEAL_LEN);
        seal.extend_from_slice(&n);
        seal.extend_from_slice(&sent);
        seal.extend_from_slice(&proof.to_bytes());
        (seal, n)
    }

    /// Opens a sealed request: checks the proof, then that it is fresh and not seen before (in
    /// that order: a forger cannot fill the replay guard). Returns the nonce the answer is bound to.
    pub fn open_request(
        self,
        secret: &ClusterSecret,
        body: &[u8],
        seal: &[u8],
        guard: &ReplayGuard,
    ) -> Result<Nonce, Refusal> {
        if seal.len() != REQUEST_SEAL_LEN {
            return Err(Refusal::Malformed);
        }
        let mut n = [0u8; 16];
        n.copy_from_slice(&seal[..16]);
        let mut sent = [0u8; 8];
        sent.copy_from_slice(&seal[16..24]);
        let proof = Proof::from_bytes(&seal[24..])?;
        secret.verify(self.request, &[body, &n, &sent], &proof)?;
        guard.check(&n, u64::from_le_bytes(sent), now_ms())?;
        Ok(n)
    }

    /// Seals the answer `body` to the request that carried `request_nonce`.
    pub fn seal_reply(self, secret: &ClusterSecret, body: &[u8], request_nonce: &Nonce) -> Vec<u8> {
        secret.sign(self.reply, &[body, request_nonce]).to_bytes().to_vec()
    }

    /// Opens the answer to one's own request (`request_nonce`).
    pub fn open_reply(
        self,
        secret: &ClusterSecret,
        body: &[u8],
        seal: &[u8],
        request_nonce: &Nonce,
    ) -> Result<(), Refusal> {
        let proof = Proof::from_bytes(seal)?;
        secret.verify(self.reply, &[body, request_nonce], &proof)
    }
}

/// D seals a pull `body`: the seal frame to send after it, and the nonce its answer must carry.
pub fn seal_request(secret: &ClusterSecret, body: &[u8]) -> (Vec<u8>, Nonce) {
    PULL.seal_request(secret, body)
}

/// P opens a sealed pull (see [`Exchange::open_request`]).
pub fn open_request(secret: &ClusterSecret, body: &[u8], seal: &[u8], guard: &ReplayGuard) -> Result<Nonce, Refusal> {
    PULL.open_request(secret, body, seal, guard)
}

/// P seals its answer `body` to the pull that carried `request_nonce`.
pub fn seal_reply(secret: &ClusterSecret, body: &[u8], request_nonce: &Nonce) -> Vec<u8> {
    PULL.seal_reply(secret, body, request_nonce)
}

/// D opens P's answer to its pull (`request_nonce`).
pub fn open_reply(secret: &ClusterSecret, body: &[u8], seal: &[u8], request_nonce: &Nonce) -> Result<(), Refusal> {
    PULL.open_reply(secret, body, seal, request_nonce)
}
