//! The staged path's framing (one TCP connection, little-endian), minimal and of its own:
//!
//! - P → D, request: `b"PDSG"`, version `u16`, auth token (`u16` length + bytes; empty: none),
//!   D's fence token `u64` (0: none), `n: u32`, then `n` × (`dst: u64`, `len: u64`) in D's
//!   addresses (the order of the payload); then the seal: `u8` length (0: none) + P's seal over
//!   every byte before it ([`pdflow_auth::sealed::STAGED`]: nonce, time, proof of the cluster
//!   secret), once per request.
//! - D → P: `ACCEPTED`, or `ACCEPTED_SEALED` + D's proof over the request's nonce (D holds the
//!   secret: P sends no payload byte to a D that has not proved it), or `REFUSED` + reason (a
//!   region check or the secret's check failed; nothing will be received).
//! - P → D: `GO` then the payload (the sum of the lengths, in order), or `ABORT` (another part of
//!   the same plan was refused) and nothing.
//! - D → P: `DONE` once every byte is in D's device memory, or `FAILED` + reason.
//!
//! A reason is `u32` length + UTF-8. Lengths are bounded before anything is allocated.

use std::io::{Read, Write};

use pdflow_auth::sealed::{self, REPLY_SEAL_LEN, REQUEST_SEAL_LEN};
use pdflow_auth::{ClusterSecret, Nonce};
use pdflow_kv::planner::Descriptor;

pub const MAGIC: [u8; 4] = *b"PDSG";
pub const VERSION: u16 = 4;
/// The longest auth token a request may carry.
pub const MAX_TOKEN: u16 = 1024;
/// The most descriptors one request may carry (16 MiB of header).
pub const MAX_DESCRIPTORS: u32 = 1 << 20;
/// The longest reason a reply may carry.
pub const MAX_REASON: u32 = 64 * 1024;

pub const ACCEPTED: u8 = 0;
pub const REFUSED: u8 = 1;
pub const DONE: u8 = 2;
pub const FAILED: u8 = 3;
pub const GO: u8 = 4;
pub const ABORT: u8 = 5;
pub const ACCEPTED_SEALED: u8 = 6;

/// What D's acceptance is bound to, besides the request's nonce.
const ACCEPT_BODY: &[u8] = b"staged-accept";

/// Why a message could not be read.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("not a staged-path request (magic {0:02x?}){hint}", hint = tls_hint(.0))]
    BadMagic([u8; 4]),
    #[error("staged-path version {0}, this build speaks {VERSION}: run the same pdflow on both hosts")]
    BadVersion(u16),
    #[error("a request of {0} descriptors exceeds the limit of {MAX_DESCRIPTORS}")]
    TooManyDescriptors(u32),
    #[error("a reason of {0} bytes exceeds the limit of {MAX_REASON}")]
    ReasonTooLong(u32),
    #[error("unknown status byte {0}")]
    BadStatus(u8),
    #[error("an auth token of {0} bytes exceeds the limit of {MAX_TOKEN}")]
    TokenTooLong(usize),
    #[error("a seal of {0} bytes; a request's seal is {REQUEST_SEAL_LEN} bytes or none")]
    BadSeal(u8),
}

/// What a request that is not one most likely is.
fn tls_hint(magic: &[u8; 4]) -> &'static str {
    if magic[0] == 0x16 && magic[1] == 0x03 {
        ": P speaks TLS and this receiver does not (set `tls` on both ends)"
    } else {
        ": is the peer a pdflow staged sender?"
    }
}

/// A reply of D.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Accepted,
    /// Accepted by a D that proves it holds the cluster secret: its seal over the request's nonce.
    AcceptedSealed([u8; REPLY_SEAL_LEN]),
    Refused(String),
    Done,
    Failed(String),
}

/// One request: P's auth token, the fence token of D's pull it serves (0: none), the
/// `(dst, len)` pairs and P's seal over them (empty: none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    pub auth: Vec<u8>,
    pub fence: u64,
    pub ranges: Vec<(u64, u64)>,
    pub seal: Vec<u8>,
}

impl Offer {
    /// The bytes the seal covers: the request as it was sent, up to the seal.
    pub fn sealed_bytes(&self) -> Vec<u8> {
        header(&self.auth, self.fence, self.ranges.iter().copied())
    }
}

/// A request ready to send, and the nonce D's sealed acceptance must carry (when sealed).
pub struct Request {
    pub bytes: Vec<u8>,
    pub nonce: Option<Nonce>,
}

/// The request for `descriptors` (their destinations and lengths; sources stay on P), serving
/// the pull D opened fence `fence` for, presenting `auth` (D's `--transfer-token`; empty: none),
/// sealed under `secret` when P holds one.
pub fn encode_request(
    auth: &[u8],
    fence: u64,
    descriptors: &[Descriptor],
    secret: Option<&ClusterSecret>,
) -> Result<Request, WireError> {
    if auth.len() > usize::from(MAX_TOKEN) {
        return Err(WireError::TokenTooLong(auth.len()));
    }
    let mut bytes = header(auth, fence, descriptors.iter().map(|d| (d.dst, d.len)));
    let nonce = match secret {
        Some(secret) => {
            let (seal, nonce) = sealed::STAGED.seal_request(secret, &bytes);
            bytes.push(seal.len() as u8);
            bytes.extend_from_slice(&seal);
            Some(nonce)
        }
        None => {
            bytes.push(0);
            None
        }
    };
    Ok(Request { bytes, nonce })
}

/// Everything of a request before its seal (`auth` no longer than [`MAX_TOKEN`]).
fn header(auth: &[u8], fence: u64, ranges: impl ExactSizeIterator<Item = (u64, u64)>) -> Vec<u8> {
    let mut out = Vec::with_capacity(21 + auth.len() + ranges.len() * 16 + REQUEST_SEAL_LEN);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(auth.len() as u16).to_le_bytes());
    out.extend_from_slice(auth);
    out.extend_from_slice(&fence.to_le_bytes());
    out.extend_from_slice(&(ranges.len() as u32).to_le_bytes());
    for (dst, len) in ranges {
        out.extend_from_slice(&dst.to_le_bytes());
        out.extend_from_slice(&len.to_le_bytes());
    }
    out
}

/// D's sealed acceptance of the request that carried `request_nonce`.
pub fn accept_sealed(secret: &ClusterSecret, request_nonce: &Nonce) -> Reply {
    let seal = sealed::STAGED.seal_reply(secret, ACCEPT_BODY, request_nonce);
    let mut proof = [0u8; REPLY_SEAL_LEN];
    proof.copy_from_slice(&seal[..REPLY_SEAL_LEN.min(seal.len())]);
    Reply::AcceptedSealed(proof)
}

/// P checks D's sealed acceptance of its request (`request_nonce`).
pub fn open_acceptance(
    secret: &ClusterSecret,
    seal: &[u8; REPLY_SEAL_LEN],
    request_nonce: &Nonce,
) -> Result<(), pdflow_auth::Refusal> {
    sealed::STAGED.open_reply(secret, ACCEPT_BODY, seal, request_nonce)
}

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// Reads one request: its auth token, fence token and `(dst, len)` pairs. `Ok(None)` when the peer closed the
/// connection cleanly before a request began.
pub fn read_request(r: &mut impl Read) -> Result<Option<Offer>, WireError> {
    let mut magic = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut magic[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let mut v = [0u8; 2];
    r.read_exact(&mut v)?;
    let version = u16::from_le_bytes(v);
    if version != VERSION {
        return Err(WireError::BadVersion(version));
    }
    r.read_exact(&mut v)?;
    let auth_len = u16::from_le_bytes(v);
    if auth_len > MAX_TOKEN {
        return Err(WireError::TokenTooLong(usize::from(auth_len)));
    }
    let mut auth = vec![0u8; usize::from(auth_len)];
    r.read_exact(&mut auth)?;
    let mut fence = [0u8; 8];
    r.read_exact(&mut fence)?;
    let fence = u64::from_le_bytes(fence);
    let n = read_u32(r)?;
    if n > MAX_DESCRIPTORS {
        return Err(WireError::TooManyDescriptors(n));
    }
    let mut body = vec![0u8; n as usize * 16];
    r.read_exact(&mut body)?;
    let mut seal_len = [0u8; 1];
    r.read_exact(&mut seal_len)?;
    if !matches!(usize::from(seal_len[0]), 0 | REQUEST_SEAL_LEN) {
        return Err(WireError::BadSeal(seal_len[0]));
    }
    let mut seal = vec![0u8; usize::from(seal_len[0])];
    r.read_exact(&mut seal)?;
    Ok(Some(Offer {
        auth,
        fence,
        seal,
        ranges: body
            .chunks_exact(16)
            .map(|c| {
                let (dst, len) = c.split_at(8);
                let word = |b: &[u8]| b.iter().rev().fold(0u64, |acc, &x| (acc << 8) | x as u64);
                (word(dst), word(len))
            })
            .collect(),
    }))
}

/// Writes one reply.
pub fn write_reply(w: &mut impl Write, reply: &Reply) -> std::io::Result<()> {
    let (status, reason) = match reply {
        Reply::Accepted => (ACCEPTED, None),
        Reply::AcceptedSealed(seal) => {
            let mut out = vec![ACCEPTED_SEALED];
            out.extend_from_slice(seal);
            w.write_all(&out)?;
            return w.flush();
        }
        Reply::Refused(r) => (REFUSED, Some(r)),
        Reply::Done => (DONE, None),
        Reply::Failed(r) => (FAILED, Some(r)),
    };
    let mut out = vec![status];
    if let Some(reason) = reason {
        let bytes = &reason.as_bytes()[..reason.len().min(MAX_REASON as usize)];
        out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        out.extend_from_slice(bytes);
    }
    w.write_all(&out)?;
    w.flush()
}

/// Reads one reply.
pub fn read_reply(r: &mut impl Read) -> Result<Reply, WireError> {
    let mut status = [0u8; 1];
    r.read_exact(&mut status)?;
    let reason = |r: &mut dyn Read| -> Result<String, WireError> {
        let mut len = [0u8; 4];
        r.read_exact(&mut len)?;
        let len = u32::from_le_bytes(len);
        if len > MAX_REASON {
            return Err(WireError::ReasonTooLong(len));
        }
        let mut b = vec![0u8; len as usize];
        r.read_exact(&mut b)?;
        Ok(String::from_utf8_lossy(&b).into_owned())
    };
    match status[0] {
        ACCEPTED => Ok(Reply::Accepted),
        ACCEPTED_SEALED => {
            let mut seal = [0u8; REPLY_SEAL_LEN];
            r.read_exact(&mut seal)?;
            Ok(Reply::AcceptedSealed(seal))
        }
        REFUSED => Ok(Reply::Refused(reason(r)?)),
        DONE => Ok(Reply::Done),
        FAILED => Ok(Reply::Failed(reason(r)?)),
        other => Err(WireError::BadStatus(other)),
    }
}

/// Reads P's go/abort byte: `true` to receive the payload.
pub fn read_go(r: &mut impl Read) -> Result<bool, WireError> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    match b[0] {
        GO => Ok(true),
        ABORT => Ok(false),
        other => Err(WireError::BadStatus(other)),
    }
}
