//! The `tcp` backend's wire format (DESIGN §4): little-endian, length-checked, no serde, so that the
//! server can check a batch's descriptors before reading a single payload byte.
//!
//! ```text
//! hello   P → D   "PDFT" version:u8 token_len:u16 token[token_len]          (token_len 0 = none)
//! batch   P → D   "PDFB" batch_id:u64 count:u32 (dst:u64 len:u64)×count, then the payload of each
//!                 descriptor in order (Σ len bytes, no framing between them)
//! ack     D → P   "PDFA" status:u8 batch_id:u64 reason_len:u16 reason[reason_len]
//!                 (status 0 ok, 1 refused; the hello is answered with batch_id 0)
//! ```
//!
//! Every decode failure is a typed [`WireError`]; every length is capped before anything is
//! allocated.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::planner::Descriptor;

/// First bytes of a connection (P's hello).
pub const HELLO_MAGIC: [u8; 4] = *b"PDFT";
/// First bytes of every batch header.
pub const BATCH_MAGIC: [u8; 4] = *b"PDFB";
/// First bytes of every ack.
pub const ACK_MAGIC: [u8; 4] = *b"PDFA";
/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u8 = 1;
/// The longest auth token accepted.
pub const MAX_TOKEN_LEN: usize = 1024;
/// The most descriptors one batch header may list (16 MiB of header).
pub const MAX_DESCRIPTORS_PER_BATCH: usize = 1 << 20;
/// The longest refusal reason sent back (longer ones are truncated).
pub const MAX_REASON_LEN: usize = 1024;

const DESCRIPTOR_WIRE_LEN: usize = 16;

/// Why bytes on a data connection are not a valid message.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("expected {expected:?}, found {found:?}: the peer does not speak pdflow's tcp transfer protocol")]
    BadMagic { expected: [u8; 4], found: [u8; 4] },
    #[error("tcp transfer protocol version {found} is not supported (this build speaks {PROTOCOL_VERSION}): upgrade the older peer")]
    UnsupportedVersion { found: u8 },
    #[error("auth token of {len} bytes exceeds the {MAX_TOKEN_LEN}-byte limit")]
    TokenTooLong { len: usize },
    #[error("batch header lists {count} descriptors, more than the {MAX_DESCRIPTORS_PER_BATCH} allowed per batch")]
    TooManyDescriptors { count: u64 },
    #[error("ack has unknown status {0}")]
    BadStatus(u8),
    #[error("connection failed: {0}")]
    Io(#[from] std::io::Error),
}

impl WireError {
    /// The error as an `io::Error`, for callers that report transport failures.
    pub fn into_io(self) -> std::io::Error {
        match self {
            WireError::Io(e) => e,
            other => std::io::Error::new(std::io::ErrorKind::InvalidData, other.to_string()),
        }
    }
}

/// One batch's header as the server reads it: where each payload goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchHeader {
    pub batch_id: u64,
    /// `(dst, len)` per descriptor, in payload order.
    pub descriptors: Vec<(u64, u64)>,
}

impl BatchHeader {
    /// Σ len, or `None` on overflow (a hostile header).
    pub fn total_len(&self) -> Option<u64> {
        self.descriptors.iter().try_fold(0u64, |acc, &(_, len)| acc.checked_add(len))
    }
}

/// The server's answer to a hello or a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ack {
    Ok { batch_id: u64 },
    Refused { batch_id: u64, reason: String },
}

pub fn encode_hello(token: Option<&str>) -> Result<Vec<u8>, WireError> {
    let token = token.unwrap_or("").as_bytes();
    if token.len() > MAX_TOKEN_LEN {
        return Err(WireError::TokenTooLong { len: token.len() });
    }
    let mut out = Vec::with_capacity(7 + token.len());
    out.extend_from_slice(&HELLO_MAGIC);
    out.push(PROTOCOL_VERSION);
    out.extend_from_slice(&(token.len() as u16).to_le_bytes());
    out.extend_from_slice(token);
    Ok(out)
}

/// Reads a hello; returns the token bytes (empty when none was sent).
pub async fn read_hello<R: AsyncRead + Unpin>(r: &mut R) -> Result<Vec<u8>, WireError> {
    let mut head = [0u8; 7];
    r.read_exact(&mut head).await?;
    expect_magic(&head[..4], HELLO_MAGIC)?;
    if head[4] != PROTOCOL_VERSION {
        return Err(WireError::UnsupportedVersion { found: head[4] });
    }
    let len = usize::from(u16::from_le_bytes([head[5], head[6]]));
    if len > MAX_TOKEN_LEN {
        return Err(WireError::TokenTooLong { len });
    }
    let mut token = vec![0u8; len];
    r.read_exact(&mut token).await?;
    Ok(token)
}

/// Encodes a batch header for `descriptors` (at most [`MAX_DESCRIPTORS_PER_BATCH`]).
pub fn encode_batch_header(batch_id: u64, descriptors: &[Descriptor]) -> Result<Vec<u8>, WireError> {
    if descriptors.len() > MAX_DESCRIPTORS_PER_BATCH {
        return Err(WireError::TooManyDescriptors { count: descriptors.len() as u64 });
    }
    let mut out = Vec::with_capacity(16 + descriptors.len() * DESCRIPTOR_WIRE_LEN);
    out.extend_from_slice(&BATCH_MAGIC);
    out.extend_from_slice(&batch_id.to_le_bytes());
    out.extend_from_slice(&(descriptors.len() as u32).to_le_bytes());
    for d in descriptors {
        out.extend_from_slice(&d.dst.to_le_bytes());
        out.extend_from_slice(&d.len.to_le_bytes());
    }
    Ok(out)
}

/// Reads the next batch header; `Ok(None)` when the peer closed the connection between batches.
pub async fn read_batch_header<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<BatchHeader>, WireError> {
    let mut magic = [0u8; 4];
    match r.read_exact(&mut magic).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    expect_magic(&magic, BATCH_MAGIC)?;
    let mut fixed = [0u8; 12];
    r.read_exact(&mut fixed).await?;
    let batch_id = u64::from_le_bytes(le8(&fixed[..8]));
    let count = u32::from_le_bytes([fixed[8], fixed[9], fixed[10], fixed[11]]);
    if count as usize > MAX_DESCRIPTORS_PER_BATCH {
        return Err(WireError::TooManyDescriptors { count: u64::from(count) });
    }
    let mut raw = vec![0u8; count as usize * DESCRIPTOR_WIRE_LEN];
    r.read_exact(&mut raw).await?;
    let descriptors = raw
        .chunks_exact(DESCRIPTOR_WIRE_LEN)
        .map(|c| (u64::from_le_bytes(le8(&c[..8])), u64::from_le_bytes(le8(&c[8..]))))
        .collect();
    Ok(Some(BatchHeader { batch_id, descriptors }))
}

pub async fn write_ack<W: AsyncWrite + Unpin>(w: &mut W, ack: &Ack) -> Result<(), WireError> {
    let (status, batch_id, reason) = match ack {
        Ack::Ok { batch_id } => (0u8, *batch_id, ""),
        Ack::Refused { batch_id, reason } => (1u8, *batch_id, truncate(reason, MAX_REASON_LEN)),
    };
    let mut out = Vec::with_capacity(15 + reason.len());
    out.extend_from_slice(&ACK_MAGIC);
    out.push(status);
    out.extend_from_slice(&batch_id.to_le_bytes());
    out.extend_from_slice(&(reason.len() as u16).to_le_bytes());
    out.extend_from_slice(reason.as_bytes());
    w.write_all(&out).await?;
    w.flush().await?;
    Ok(())
}

pub async fn read_ack<R: AsyncRead + Unpin>(r: &mut R) -> Result<Ack, WireError> {
    let mut head = [0u8; 15];
    r.read_exact(&mut head).await?;
    expect_magic(&head[..4], ACK_MAGIC)?;
    let batch_id = u64::from_le_bytes(le8(&head[5..13]));
    let reason_len = usize::from(u16::from_le_bytes([head[13], head[14]])).min(MAX_REASON_LEN);
    let mut reason = vec![0u8; reason_len];
    r.read_exact(&mut reason).await?;
    match head[4] {
        0 => Ok(Ack::Ok { batch_id }),
        1 => Ok(Ack::Refused { batch_id, reason: String::from_utf8_lossy(&reason).into_owned() }),
        other => Err(WireError::BadStatus(other)),
    }
}

fn expect_magic(found: &[u8], expected: [u8; 4]) -> Result<(), WireError> {
    if found == expected {
        return Ok(());
    }
    let mut f = [0u8; 4];
    f.copy_from_slice(&found[..4]);
    Err(WireError::BadMagic { expected, found: f })
}

fn le8(b: &[u8]) -> [u8; 8] {
    let mut out = [0u8; 8];
    out.copy_from_slice(&b[..8]);
    out
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn messages_round_trip_and_garbage_is_typed() {
        let hello = encode_hello(Some("secret")).expect("short token");
        assert_eq!(read_hello(&mut &hello[..]).await.expect("valid hello"), b"secret");
        let descs = [Descriptor { src: 1, dst: 0x1000, len: 64 }, Descriptor { src: 2, dst: 0x2000, len: 8 }];
        let header = encode_batch_header(7, &descs).expect("few descriptors");
        let read = read_batch_header(&mut &header[..]).await.expect("valid header").expect("not eof");
        assert_eq!(read, BatchHeader { batch_id: 7, descriptors: vec![(0x1000, 64), (0x2000, 8)] });
        assert_eq!(read.total_len(), Some(72));
        assert!(read_batch_header(&mut &[][..]).await.expect("eof is clean").is_none());

        let mut buf = Vec::new();
        write_ack(&mut buf, &Ack::Refused { batch_id: 7, reason: "x".repeat(5000) }).await.expect("writes");
        match read_ack(&mut &buf[..]).await.expect("valid ack") {
            Ack::Refused { batch_id: 7, reason } => assert_eq!(reason.len(), MAX_REASON_LEN),
            other => panic!("unexpected {other:?}"),
        }

        assert!(matches!(read_hello(&mut &b"GET / HTTP/1.1\r\n"[..]).await, Err(WireError::BadMagic { .. })));
        let mut huge = BATCH_MAGIC.to_vec();
        huge.extend_from_slice(&0u64.to_le_bytes());
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(read_batch_header(&mut &huge[..]).await, Err(WireError::TooManyDescriptors { .. })));
        let mut v9 = hello.clone();
        v9[4] = 9;
        assert!(matches!(read_hello(&mut &v9[..]).await, Err(WireError::UnsupportedVersion { found: 9 })));
    }
}
