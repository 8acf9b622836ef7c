//! Proofs of the secret: HMAC-SHA-256 under a key, over a label naming the socket and direction
//! and over the message's parts, each length-prefixed so that no two part lists read the same.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::Refusal;
use crate::secret::{ClusterSecret, KeyId};

/// A fresh random challenge.
pub type Nonce = [u8; 16];

/// A new nonce from the operating system's generator.
pub fn nonce() -> Nonce {
    let mut n = [0u8; 16];
    if let Err(e) = getrandom::fill(&mut n) {
        // The OS generator does not fail on the systems pdflow runs on; if it ever does, a
        // nonce that is not random is a replayable one: say so loudly rather than carry on quietly.
        tracing::error!("the operating system's random generator failed ({e}): proofs made now may be replayable");
    }
    n
}

/// What a proof is for: its label is mixed into the MAC, so a proof made for one is refused for
/// every other (a D's data-server proof cannot pass as a P's, a pull's as its answer's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Context {
    /// D's data server answers P's hello: D proves it holds the secret before P writes.
    DataServer,
    /// P answers D's challenge: P proves it before D takes a byte.
    DataClient,
    /// D's pull (step 21), bound to its transfer ids, D's engine and data address.
    Pull,
    /// P's answer to a pull (step 30), bound to the pull's nonce.
    PullReply,
    /// P's request on the staged GPU path (step 29), bound to its destinations and D's fence.
    StagedOffer,
    /// D's acceptance of a staged request, bound to its nonce: P sends no byte before it.
    StagedAccept,
    /// A worker's `POST /register` at the bootstrap (step 4).
    Register,
    /// The bootstrap's answer to a registration, bound to its nonce.
    RegisterReply,
    /// A `GET /query` at the bootstrap (steps 7, 20).
    Query,
    /// The bootstrap's answer to a query, bound to its nonce.
    QueryReply,
    /// A call to the proxy's admin API (`/admin/engines…`).
    Admin,
    /// The proxy's answer to an admin call, bound to its nonce.
    AdminReply,
    /// P's RDMA connection request to D's endpoint, bound to D's connect token and P's nonce.
    RdmaConnect,
    /// Not a proof: the seed of the data channel's TLS key, derived from each key of the secret.
    TlsKey,
}

impl Context {
    fn label(self) -> &'static [u8] {
        match self {
            Context::DataServer => b"pdflow/v1/data/server",
            Context::DataClient => b"pdflow/v1/data/client",
            Context::Pull => b"pdflow/v1/side-channel/pull",
            Context::PullReply => b"pdflow/v1/side-channel/reply",
            Context::StagedOffer => b"pdflow/v1/data/staged-offer",
            Context::StagedAccept => b"pdflow/v1/data/staged-accept",
            Context::Register => b"pdflow/v1/bootstrap/register",
            Context::RegisterReply => b"pdflow/v1/bootstrap/register-reply",
            Context::Query => b"pdflow/v1/bootstrap/query",
            Context::QueryReply => b"pdflow/v1/bootstrap/query-reply",
            Context::Admin => b"pdflow/v1/proxy/admin",
            Context::AdminReply => b"pdflow/v1/proxy/admin-reply",
            Context::RdmaConnect => b"pdflow/v1/data/rdma-connect",
            Context::TlsKey => b"pdflow/v1/tls/ed25519-seed",
        }
    }
}

/// A key's id and its MAC over a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Proof {
    pub key_id: KeyId,
    pub mac: [u8; 32],
}

impl Proof {
    /// The wire form: key id, then MAC (40 bytes).
    pub fn to_bytes(&self) -> [u8; 40] {
        let mut out = [0u8; 40];
        out[..8].copy_from_slice(&self.key_id.0);
        out[8..].copy_from_slice(&self.mac);
        out
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self, Refusal> {
        if bytes.len() != 40 {
            return Err(Refusal::Malformed);
        }
        let (mut key_id, mut mac) = ([0u8; 8], [0u8; 32]);
        key_id.copy_from_slice(&bytes[..8]);
        mac.copy_from_slice(&bytes[8..]);
        Ok(Self { key_id: KeyId(key_id), mac })
    }

    /// The text form for HTTP headers: hex of [`Proof::to_bytes`].
    pub fn to_hex(&self) -> String {
        self.to_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(text: &str) -> Result<Self, Refusal> {
        Self::from_bytes(&hex_decode(text)?)
    }
}

/// Lower- or upper-case hex to bytes.
pub fn hex_decode(text: &str) -> Result<Vec<u8>, Refusal> {
    let text = text.trim().as_bytes();
    if !text.len().is_multiple_of(2) {
        return Err(Refusal::Malformed);
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8).ok_or(Refusal::Malformed);
    text.chunks(2).map(|p| Ok(digit(p[0])? << 4 | digit(p[1])?)).collect()
}

/// Lower-case hex.
pub fn hex_encode(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn mac(key: &[u8], context: Context, parts: &[&[u8]]) -> Hmac<Sha256> {
    // HMAC takes keys of any length: this cannot fail.
    let mut m =
        <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
    let label = context.label();
    m.update(&(label.len() as u64).to_le_bytes());
    m.update(label);
    for part in parts {
        m.update(&(part.len() as u64).to_le_bytes());
        m.update(part);
    }
    m
}

impl ClusterSecret {
    /// Proves, with the current key, that this side holds the secret, for `context` over `parts`.
    pub fn sign(&self, context: Context, parts: &[&[u8]]) -> Proof {
        let key = self.signing();
        let out = mac(&key.bytes, context, parts).finalize().into_bytes();
        let mut m = [0u8; 32];
        m.copy_from_slice(&out);
        Proof { key_id: key.id, mac: m }
    }

    /// A 32-byte value derived for `context` from each held key (current first), with its id:
    /// one-way, so what is made from it (a TLS key pair) says nothing about the secret.
    pub(crate) fn derive_each(&self, context: Context) -> Vec<(KeyId, [u8; 32])> {
        self.keys()
            .iter()
            .map(|key| {
                let mut out = [0u8; 32];
                out.copy_from_slice(&mac(&key.bytes, context, &[]).finalize().into_bytes());
                (key.id, out)
            })
            .collect()
    }

    /// Checks a peer's proof for `context` over `parts`, with whichever held key it names (in
    /// constant time).
    pub fn verify(&self, context: Context, parts: &[&[u8]], proof: &Proof) -> Result<(), Refusal> {
        let key = self.key(proof.key_id).ok_or(Refusal::UnknownKey)?;
        mac(&key.bytes, context, parts).verify_slice(&proof.mac).map_err(|_| Refusal::BadProof)
    }
}
