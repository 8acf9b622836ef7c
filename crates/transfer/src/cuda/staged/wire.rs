//! The staged path's framing (one TCP connection, little-endian), minimal and of its own:
//!
//! - P → D, request: `b"PDSG"`, version `u16`, auth token (`u16` length + bytes; empty: none),
//!   D's fence token `u64` (0: none), `n: u32`, then `n` × (`dst: u64`, `len: u64`) in D's
//!   addresses (the order of the payload).
//! - D → P: `ACCEPTED`, or `REFUSED` + reason (the region check failed; nothing will be received).
//! - P → D: `GO` then the payload (the sum of the lengths, in order), or `ABORT` (another part of
//!   the same plan was refused) and nothing.
//! - D → P: `DONE` once every byte is in D's device memory, or `FAILED` + reason.
//!
//! A reason is `u32` length + UTF-8. Lengths are bounded before anything is allocated.

use std::io::{Read, Write};

use pdflow_kv::planner::Descriptor;

pub const MAGIC: [u8; 4] = *b"PDSG";
pub const VERSION: u16 = 3;
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

/// Why a message could not be read.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("not a staged-path request (magic {0:02x?}): is the peer a pdflow staged data server?")]
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
}

/// A reply of D.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Accepted,
    Refused(String),
    Done,
    Failed(String),
}

/// One request: P's auth token, the fence token of D's pull it serves (0: none) and the
/// `(dst, len)` pairs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    pub auth: Vec<u8>,
    pub fence: u64,
    pub ranges: Vec<(u64, u64)>,
}

/// The request for `descriptors` (their destinations and lengths; sources stay on P), serving
/// the pull D opened fence `fence` for, presenting `auth` (D's `--transfer-token`; empty: none).
pub fn encode_request(auth: &[u8], fence: u64, descriptors: &[Descriptor]) -> Result<Vec<u8>, WireError> {
    if auth.len() > usize::from(MAX_TOKEN) {
        return Err(WireError::TokenTooLong(auth.len()));
    }
    let mut out = Vec::with_capacity(20 + auth.len() + descriptors.len() * 16);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(auth.len() as u16).to_le_bytes());
    out.extend_from_slice(auth);
    out.extend_from_slice(&fence.to_le_bytes());
    out.extend_from_slice(&(descriptors.len() as u32).to_le_bytes());
    for d in descriptors {
        out.extend_from_slice(&d.dst.to_le_bytes());
        out.extend_from_slice(&d.len.to_le_bytes());
    }
    Ok(out)
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
    Ok(Some(Offer {
        auth,
        fence,
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
