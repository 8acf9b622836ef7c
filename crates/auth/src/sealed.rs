//! Sealed side-channel frames (steps 21 and 30): D's request travels with a second frame — its
//! nonce, its send time and D's proof over the request's bytes and both — so P serves only a pull
//! (bound to every field in it: transfer ids, D's engine, data address and blocks) that a holder
//! of the secret made, once; P's answer travels with P's proof over the answer and D's nonce, so
//! D takes only the answer to its own pull, from a holder of the secret.

use crate::error::Refusal;
use crate::proof::{nonce, Context, Nonce, Proof};
use crate::replay::{now_ms, ReplayGuard};
use crate::secret::ClusterSecret;

/// Bytes of a request's seal: nonce, send time (ms, little-endian), proof.
pub const REQUEST_SEAL_LEN: usize = 16 + 8 + 40;
/// Bytes of an answer's seal: the proof.
pub const REPLY_SEAL_LEN: usize = 40;

/// D seals a request `body`: the seal frame to send after it, and the nonce its answer must carry.
pub fn seal_request(secret: &ClusterSecret, body: &[u8]) -> (Vec<u8>, Nonce) {
    let n = nonce();
    let sent = now_ms().to_le_bytes();
    let proof = secret.sign(Context::Pull, &[body, &n, &sent]);
    let mut seal = Vec::with_capacity(REQUEST_SEAL_LEN);
    seal.extend_from_slice(&n);
    seal.extend_from_slice(&sent);
    seal.extend_from_slice(&proof.to_bytes());
    (seal, n)
}

/// P opens a sealed request: checks the proof, then that it is fresh and not seen before (in that
/// order: a forger cannot fill the replay guard). Returns the nonce P's answer is bound to.
pub fn open_request(secret: &ClusterSecret, body: &[u8], seal: &[u8], guard: &ReplayGuard) -> Result<Nonce, Refusal> {
    if seal.len() != REQUEST_SEAL_LEN {
        return Err(Refusal::Malformed);
    }
    let mut n = [0u8; 16];
    n.copy_from_slice(&seal[..16]);
    let mut sent = [0u8; 8];
    sent.copy_from_slice(&seal[16..24]);
    let proof = Proof::from_bytes(&seal[24..])?;
    secret.verify(Context::Pull, &[body, &n, &sent], &proof)?;
    guard.check(&n, u64::from_le_bytes(sent), now_ms())?;
    Ok(n)
}

/// P seals its answer `body` to the request that carried `request_nonce`.
pub fn seal_reply(secret: &ClusterSecret, body: &[u8], request_nonce: &Nonce) -> Vec<u8> {
    secret.sign(Context::PullReply, &[body, request_nonce]).to_bytes().to_vec()
}

/// D opens P's answer to its request (`request_nonce`).
pub fn open_reply(secret: &ClusterSecret, body: &[u8], seal: &[u8], request_nonce: &Nonce) -> Result<(), Refusal> {
    let proof = Proof::from_bytes(seal)?;
    secret.verify(Context::PullReply, &[body, request_nonce], &proof)
}
