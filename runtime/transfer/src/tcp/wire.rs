//! The `tcp` backend's wire format: little-endian, length-checked, no serde, so that the
//! server can check a batch's descriptors before reading a single payload byte.
//!
//! ```text
//! hello   P → D   "PDFT" version:u8 token_len:u16 token[token_len]          (token_len 0 = none)
//! batch   P → D   "PDFB" batch_id:u64 count:u32 (dst:u64 len:u64)×count, then the payload of each
//!                 descriptor in order (Σ len bytes, no framing between them)
//! ack     D → P   "PDFA" status:u8 batch_id:u64 reason_len:u16 reason[reason_len]
//!                 (status 0 ok, 1 refused; the hello is answered with batch_id 0)
//! info    P → D   "PDFI" p_pid:u32                     (optional, after the hello: "are we on one host?")
//! fence   P → D   "PDFW" token:u64                     (the batches that follow serve this pull)
//! device  P → D   "PDFG"; D → P "PDFX" len:u32 export[len]  (D's GPU KV export; len 0 = none)
//! hold    P → D   "PDFL" token:u64, acked; then "PDFR" (release, not acked) once P's own write
//!                 into D's memory (cuda-ipc) has ended: D's fence counts it in flight meanwhile
//! host    D → P   "PDFH" offered:u8 pid:u32 host_len:u16 host[host_len] canary_addr:u64
//!                 canary_len:u16 canary[canary_len] count:u32 (base:u64 len:u64 block_len:u64)×count
//! ```
//!
//! The info/host exchange feeds the same-host path ([`crate::same_host`]): D names its
//! pid, its host identity, a random canary P can read back through the kernel to prove the pid is
//! really D, and the regions P may write. `offered = 0` means D does not offer the path.
//!
//! Every decode failure is a typed [`WireError`]; every length is capped before anything is
//! allocated.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use pdflow_auth::{Nonce, Proof};
use pdflow_kv::planner::Descriptor;

/// First bytes of a connection (P's hello).
pub const HELLO_MAGIC: [u8; 4] = *b"PDFT";
/// First bytes of every batch header.
pub const BATCH_MAGIC: [u8; 4] = *b"PDFB";
/// First bytes of every ack.
pub const ACK_MAGIC: [u8; 4] = *b"PDFA";
/// The protocol version this build speaks (4: the hello carries P's nonce for the cluster
/// secret's challenge).
pub const PROTOCOL_VERSION: u8 = 4;
/// D's challenge after the hello when it holds the cluster secret: its nonce and its proof.
pub const CHALLENGE_MAGIC: [u8; 4] = *b"PDFC";
/// P's proof, answering D's challenge.
pub const PROOF_MAGIC: [u8; 4] = *b"PDFP";
/// The longest auth token accepted.
pub const MAX_TOKEN_LEN: usize = 1024;
/// The most descriptors one batch header may list (16 MiB of header).
pub const MAX_DESCRIPTORS_PER_BATCH: usize = 1 << 20;
/// The longest refusal reason sent back (longer ones are truncated).
pub const MAX_REASON_LEN: usize = 1024;

/// First bytes of P's same-host info request.
pub const INFO_MAGIC: [u8; 4] = *b"PDFI";
/// Names D's write-fence token for the batches that follow on this connection (P → D).
pub const FENCE_MAGIC: [u8; 4] = *b"PDFW";
/// First bytes of D's answer to it.
pub const HOST_MAGIC: [u8; 4] = *b"PDFH";
/// The longest host identity accepted.
pub const MAX_HOST_ID_LEN: usize = 1024;
/// The longest canary accepted.
pub const MAX_CANARY_LEN: usize = 64;
/// The most regions a host answer may list.
pub const MAX_REGIONS: usize = 1 << 16;
/// P asks for D's device export (GPU KV: CUDA IPC handles), and D's answer.
pub const DEVICE_MAGIC: [u8; 4] = *b"PDFG";
pub const DEVICE_ANSWER_MAGIC: [u8; 4] = *b"PDFX";
/// The largest device export D may answer with (a few KiB for a model's regions).
pub const MAX_DEVICE_EXPORT_LEN: usize = 1 << 20;
/// P asks D to hold fence `token` open for a write P makes outside this connection (cuda-ipc:
/// P's kernel writes D's GPU memory directly); D acks, then holds it until [`RELEASE_MAGIC`].
pub const HOLD_MAGIC: [u8; 4] = *b"PDFL";
/// P's write under the hold ended (no answer: the connection goes on with P's next request).
pub const RELEASE_MAGIC: [u8; 4] = *b"PDFR";

const DESCRIPTOR_WIRE_LEN: usize = 16;
/// The most bytes of descriptors or regions read (and allocated) at once.
const READ_CHUNK: usize = 64 * 1024;

/// Why bytes on a data connection are not a valid message.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("expected {expected:?}, found {found:?}: {}", bad_magic_hint(found))]
    BadMagic { expected: [u8; 4], found: [u8; 4] },
    #[error("tcp transfer protocol version {found} is not supported (this build speaks {PROTOCOL_VERSION}): upgrade the older peer")]
    UnsupportedVersion { found: u8 },
    #[error("auth token of {len} bytes exceeds the {MAX_TOKEN_LEN}-byte limit")]
    TokenTooLong { len: usize },
    #[error("batch header lists {count} descriptors, more than the {MAX_DESCRIPTORS_PER_BATCH} allowed per batch")]
    TooManyDescriptors { count: u64 },
    #[error("host answer lists {count} regions, more than the {MAX_REGIONS} allowed")]
    TooManyRegions { count: u64 },
    #[error("host answer field {field} of {len} bytes exceeds its limit")]
    FieldTooLong { field: &'static str, len: usize },
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

/// What P may send after its hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Batch(BatchHeader),
    /// The batches that follow serve the pull D opened fence `token` for.
    Fence {
        token: u64,
    },
    /// P (process `p_pid`) asks whether the same-host path is possible.
    HostInfo {
        p_pid: u32,
    },
    /// P asks for D's device export: how to write D's GPU KV directly (empty: none).
    DeviceExport,
    /// P is about to write D's memory itself (cuda-ipc) for the pull of fence `token`: D counts
    /// a write in flight under it, or refuses when the token is not open.
    Hold {
        token: u64,
    },
    /// P's write under the hold has ended.
    Release,
}

/// D's answer to [`Request::HostInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HostInfo {
    /// D offers the same-host path at all (when false the other fields are empty).
    pub offered: bool,
    /// D's process id, in D's pid namespace (the host identity names the namespace).
    pub pid: u32,
    /// D's host identity ([`crate::same_host::host_identity`]).
    pub host_id: String,
    /// Where in D's memory the canary lies, and its bytes.
    pub canary_addr: u64,
    pub canary: Vec<u8>,
    /// `(base, len, block_len)` of every region P may write.
    pub regions: Vec<(u64, u64, u64)>,
}

/// The server's answer to a hello or a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ack {
    Ok { batch_id: u64 },
    Refused { batch_id: u64, reason: String },
}

/// P's hello: the transfer token (if any), then P's nonce for D's proof of the cluster secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub token: Vec<u8>,
    pub nonce: Nonce,
}

/// A hello with no nonce (a P without the cluster secret).
pub fn encode_hello(token: Option<&str>) -> Result<Vec<u8>, WireError> {
    encode_hello_with(token, &[0u8; 16])
}

pub fn encode_hello_with(token: Option<&str>, nonce: &Nonce) -> Result<Vec<u8>, WireError> {
    let token = token.unwrap_or("").as_bytes();
    if token.len() > MAX_TOKEN_LEN {
        return Err(WireError::TokenTooLong { len: token.len() });
    }
    let mut out = Vec::with_capacity(23 + token.len());
    out.extend_from_slice(&HELLO_MAGIC);
    out.push(PROTOCOL_VERSION);
    out.extend_from_slice(&(token.len() as u16).to_le_bytes());
    out.extend_from_slice(token);
    out.extend_from_slice(nonce);
    Ok(out)
}

/// Reads a hello.
pub async fn read_hello<R: AsyncRead + Unpin>(r: &mut R) -> Result<Hello, WireError> {
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
    let mut nonce = [0u8; 16];
    r.read_exact(&mut nonce).await?;
    Ok(Hello { token, nonce })
}

/// D's answer to a hello: an ack (D holds no secret, or refuses), or its challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HelloAnswer {
    Ack(Ack),
    /// D's nonce and D's proof over P's nonce and its own.
    Challenge {
        nonce: Nonce,
        proof: Proof,
    },
}

pub fn encode_challenge(nonce: &Nonce, proof: &Proof) -> Vec<u8> {
    let mut out = Vec::with_capacity(60);
    out.extend_from_slice(&CHALLENGE_MAGIC);
    out.extend_from_slice(nonce);
    out.extend_from_slice(&proof.to_bytes());
    out
}

pub async fn read_hello_answer<R: AsyncRead + Unpin>(r: &mut R) -> Result<HelloAnswer, WireError> {
    let mut magic = [0u8; 4];
    r.read_exact(&mut magic).await?;
    if magic == CHALLENGE_MAGIC {
        let mut rest = [0u8; 56];
        r.read_exact(&mut rest).await?;
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&rest[..16]);
        let proof = Proof::from_bytes(&rest[16..])
            .map_err(|_| WireError::BadMagic { expected: CHALLENGE_MAGIC, found: magic })?;
        return Ok(HelloAnswer::Challenge { nonce, proof });
    }
    expect_magic(&magic, ACK_MAGIC)?;
    read_ack_body(r).await.map(HelloAnswer::Ack)
}

pub fn encode_proof(proof: &Proof) -> Vec<u8> {
    let mut out = Vec::with_capacity(44);
    out.extend_from_slice(&PROOF_MAGIC);
    out.extend_from_slice(&proof.to_bytes());
    out
}

pub async fn read_proof<R: AsyncRead + Unpin>(r: &mut R) -> Result<Proof, WireError> {
    let mut frame = [0u8; 44];
    r.read_exact(&mut frame).await?;
    expect_magic(&frame[..4], PROOF_MAGIC)?;
    // 40 bytes always parse: the length is the only check.
    Proof::from_bytes(&frame[4..]).map_err(|_| WireError::BadMagic { expected: PROOF_MAGIC, found: [0; 4] })
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

/// Names fence `token` for the batches that follow (12 bytes).
pub fn encode_fence(token: u64) -> [u8; 12] {
    magic_and_token(FENCE_MAGIC, token)
}

/// Asks D to hold fence `token` (12 bytes).
pub fn encode_hold(token: u64) -> [u8; 12] {
    magic_and_token(HOLD_MAGIC, token)
}

fn magic_and_token(magic: [u8; 4], token: u64) -> [u8; 12] {
    let mut out = [0u8; 12];
    out[..4].copy_from_slice(&magic);
    out[4..].copy_from_slice(&token.to_le_bytes());
    out
}

/// Reads the next batch header; `Ok(None)` when the peer closed the connection between batches.
pub async fn read_batch_header<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<BatchHeader>, WireError> {
    let Some(magic) = read_magic(r).await? else { return Ok(None) };
    expect_magic(&magic, BATCH_MAGIC)?;
    read_batch_body(r).await.map(Some)
}

/// Reads P's next request (a batch header or an info request); `Ok(None)` when P closed the
/// connection between requests.
pub async fn read_request<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<Request>, WireError> {
    let Some(magic) = read_magic(r).await? else { return Ok(None) };
    if magic == FENCE_MAGIC {
        let mut token = [0u8; 8];
        r.read_exact(&mut token).await?;
        return Ok(Some(Request::Fence { token: u64::from_le_bytes(token) }));
    }
    if magic == DEVICE_MAGIC {
        return Ok(Some(Request::DeviceExport));
    }
    if magic == HOLD_MAGIC {
        let mut token = [0u8; 8];
        r.read_exact(&mut token).await?;
        return Ok(Some(Request::Hold { token: u64::from_le_bytes(token) }));
    }
    if magic == RELEASE_MAGIC {
        return Ok(Some(Request::Release));
    }
    if magic == INFO_MAGIC {
        let mut pid = [0u8; 4];
        r.read_exact(&mut pid).await?;
        return Ok(Some(Request::HostInfo { p_pid: u32::from_le_bytes(pid) }));
    }
    expect_magic(&magic, BATCH_MAGIC)?;
    read_batch_body(r).await.map(|h| Some(Request::Batch(h)))
}

async fn read_magic<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<[u8; 4]>, WireError> {
    let mut magic = [0u8; 4];
    match r.read_exact(&mut magic).await {
        Ok(_) => Ok(Some(magic)),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// D's answer to [`Request::DeviceExport`]: opaque bytes (the backend's serialised export; empty
/// when D's KV is not on a GPU or it offers no direct path).
pub fn encode_device_export(export: &[u8]) -> Result<Vec<u8>, WireError> {
    if export.len() > MAX_DEVICE_EXPORT_LEN {
        return Err(WireError::FieldTooLong { field: "device export", len: export.len() });
    }
    let mut out = Vec::with_capacity(8 + export.len());
    out.extend_from_slice(&DEVICE_ANSWER_MAGIC);
    out.extend_from_slice(&(export.len() as u32).to_le_bytes());
    out.extend_from_slice(export);
    Ok(out)
}

pub async fn read_device_export<R: AsyncRead + Unpin>(r: &mut R) -> Result<Vec<u8>, WireError> {
    let mut head = [0u8; 8];
    r.read_exact(&mut head).await?;
    expect_magic(&head[..4], DEVICE_ANSWER_MAGIC)?;
    let len = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
    if len > MAX_DEVICE_EXPORT_LEN {
        return Err(WireError::FieldTooLong { field: "device export", len });
    }
    let mut export = vec![0u8; len];
    r.read_exact(&mut export).await?;
    Ok(export)
}

pub fn encode_info_request(p_pid: u32) -> Vec<u8> {
    let mut out = INFO_MAGIC.to_vec();
    out.extend_from_slice(&p_pid.to_le_bytes());
    out
}

pub fn encode_host_info(info: &HostInfo) -> Result<Vec<u8>, WireError> {
    if info.host_id.len() > MAX_HOST_ID_LEN {
        return Err(WireError::FieldTooLong { field: "host_id", len: info.host_id.len() });
    }
    if info.canary.len() > MAX_CANARY_LEN {
        return Err(WireError::FieldTooLong { field: "canary", len: info.canary.len() });
    }
    if info.regions.len() > MAX_REGIONS {
        return Err(WireError::TooManyRegions { count: info.regions.len() as u64 });
    }
    let mut out = Vec::with_capacity(32 + info.host_id.len() + info.canary.len() + 24 * info.regions.len());
    out.extend_from_slice(&HOST_MAGIC);
    out.push(u8::from(info.offered));
    out.extend_from_slice(&info.pid.to_le_bytes());
    out.extend_from_slice(&(info.host_id.len() as u16).to_le_bytes());
    out.extend_from_slice(info.host_id.as_bytes());
    out.extend_from_slice(&info.canary_addr.to_le_bytes());
    out.extend_from_slice(&(info.canary.len() as u16).to_le_bytes());
    out.extend_from_slice(&info.canary);
    out.extend_from_slice(&(info.regions.len() as u32).to_le_bytes());
    for &(base, len, block_len) in &info.regions {
        for v in [base, len, block_len] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    Ok(out)
}

pub async fn read_host_info<R: AsyncRead + Unpin>(r: &mut R) -> Result<HostInfo, WireError> {
    let mut head = [0u8; 11];
    r.read_exact(&mut head).await?;
    expect_magic(&head[..4], HOST_MAGIC)?;
    let offered = head[4] != 0;
    let pid = u32::from_le_bytes([head[5], head[6], head[7], head[8]]);
    let host_len = usize::from(u16::from_le_bytes([head[9], head[10]]));
    if host_len > MAX_HOST_ID_LEN {
        return Err(WireError::FieldTooLong { field: "host_id", len: host_len });
    }
    let mut host = vec![0u8; host_len];
    r.read_exact(&mut host).await?;
    let mut mid = [0u8; 10];
    r.read_exact(&mut mid).await?;
    let canary_addr = u64::from_le_bytes(le8(&mid[..8]));
    let canary_len = usize::from(u16::from_le_bytes([mid[8], mid[9]]));
    if canary_len > MAX_CANARY_LEN {
        return Err(WireError::FieldTooLong { field: "canary", len: canary_len });
    }
    let mut canary = vec![0u8; canary_len];
    r.read_exact(&mut canary).await?;
    let mut count = [0u8; 4];
    r.read_exact(&mut count).await?;
    let count = u32::from_le_bytes(count) as usize;
    if count > MAX_REGIONS {
        return Err(WireError::TooManyRegions { count: count as u64 });
    }
    let regions = read_records::<_, 24, _>(r, count, |c| {
        (u64::from_le_bytes(le8(&c[..8])), u64::from_le_bytes(le8(&c[8..16])), u64::from_le_bytes(le8(&c[16..])))
    })
    .await?;
    Ok(HostInfo { offered, pid, host_id: String::from_utf8_lossy(&host).into_owned(), canary_addr, canary, regions })
}

async fn read_batch_body<R: AsyncRead + Unpin>(r: &mut R) -> Result<BatchHeader, WireError> {
    let mut fixed = [0u8; 12];
    r.read_exact(&mut fixed).await?;
    let batch_id = u64::from_le_bytes(le8(&fixed[..8]));
    let count = u32::from_le_bytes([fixed[8], fixed[9], fixed[10], fixed[11]]);
    if count as usize > MAX_DESCRIPTORS_PER_BATCH {
        return Err(WireError::TooManyDescriptors { count: u64::from(count) });
    }
    let descriptors = read_records::<_, DESCRIPTOR_WIRE_LEN, _>(r, count as usize, |c| {
        (u64::from_le_bytes(le8(&c[..8])), u64::from_le_bytes(le8(&c[8..])))
    })
    .await?;
    Ok(BatchHeader { batch_id, descriptors })
}

/// Reads `count` records of `LEN` bytes, at most [`READ_CHUNK`] bytes at a time, so that memory
/// grows with the bytes that actually arrive, not with the count a peer claims (a 16-byte
/// header claiming 2^20 descriptors made D allocate 16 MiB before reading one).
async fn read_records<R: AsyncRead + Unpin, const LEN: usize, T>(
    r: &mut R,
    count: usize,
    parse: impl Fn(&[u8]) -> T,
) -> Result<Vec<T>, WireError> {
    let per_chunk = READ_CHUNK / LEN;
    let mut out = Vec::with_capacity(count.min(per_chunk));
    let mut chunk = vec![0u8; count.min(per_chunk) * LEN];
    let mut left = count;
    while left > 0 {
        let n = left.min(per_chunk);
        r.read_exact(&mut chunk[..n * LEN]).await?;
        out.extend(chunk[..n * LEN].chunks_exact(LEN).map(&parse));
        left -= n;
    }
    Ok(out)
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
    ack_from(r, &head).await
}

/// An ack whose magic was read already (one read for the rest of its head).
async fn read_ack_body<R: AsyncRead + Unpin>(r: &mut R) -> Result<Ack, WireError> {
    let mut head = [0u8; 15];
    head[..4].copy_from_slice(&ACK_MAGIC);
    r.read_exact(&mut head[4..]).await?;
    ack_from(r, &head).await
}

/// The ack of a 15-byte head (magic checked), its reason read from `r`.
async fn ack_from<R: AsyncRead + Unpin>(r: &mut R, head: &[u8; 15]) -> Result<Ack, WireError> {
    let batch_id = u64::from_le_bytes(le8(&head[5..13]));
    // The whole reason is read (it is at most 64 KiB) so the next ack starts where it should; only
    // the first MAX_REASON_LEN bytes are kept (a longer one desynchronised the stream).
    let reason_len = usize::from(u16::from_le_bytes([head[13], head[14]]));
    let mut reason = vec![0u8; reason_len];
    r.read_exact(&mut reason).await?;
    reason.truncate(MAX_REASON_LEN);
    match head[4] {
        0 => Ok(Ack::Ok { batch_id }),
        1 => Ok(Ack::Refused { batch_id, reason: String::from_utf8_lossy(&reason).into_owned() }),
        other => Err(WireError::BadStatus(other)),
    }
}

/// What a wrong magic most likely means: a TLS record (alert, handshake, data) where the plain
/// protocol was expected is a peer with TLS on; anything else is not pdflow at all.
fn bad_magic_hint(found: &[u8; 4]) -> &'static str {
    if matches!(found[0], 0x15..=0x17) && found[1] == 0x03 {
        "the peer speaks TLS on the data channel: set `tls` on both ends, or on neither"
    } else {
        "the peer does not speak pdflow's tcp transfer protocol"
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
        assert_eq!(read_hello(&mut &hello[..]).await.expect("valid hello").token, b"secret");
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
        let info = HostInfo {
            offered: true,
            pid: 42,
            host_id: "boot/host/ns".into(),
            canary_addr: 0x1000,
            canary: vec![7; 32],
            regions: vec![(0x10_000, 4096, 1024), (0x20_000, 8192, 1024)],
        };
        let bytes = encode_host_info(&info).expect("small answer");
        assert_eq!(read_host_info(&mut &bytes[..]).await.expect("valid answer"), info);
        let req = encode_info_request(9);
        assert_eq!(read_request(&mut &req[..]).await.expect("valid").expect("not eof"), Request::HostInfo { p_pid: 9 });
        assert!(matches!(read_request(&mut &header[..]).await, Ok(Some(Request::Batch(_)))));
        let mut v9 = hello.clone();
        v9[4] = 9;
        assert!(matches!(read_hello(&mut &v9[..]).await, Err(WireError::UnsupportedVersion { found: 9 })));
    }
}
