//! The cross-host GPU path: tcp with pinned host staging, pipelined. P's KV is on P's
//! GPU and D's on D's; there is no peer mapping, so P copies device→pinned host in chunks
//! (`cuMemcpyDtoHAsync` into `cuMemHostAlloc` memory) and sends each chunk over TCP while the next
//! ones are being copied; D receives each chunk into pinned host memory and copies it host→device
//! (`cuMemcpyHtoDAsync`) while the next one arrives. A plan is cut into `streams` byte ranges, one
//! per TCP connection, each with its own CUDA stream and ring of staging buffers on both sides.
//!
//! Owns seed step 29 (P writes the request's blocks into D's regions) when the KV lives on GPUs
//! that cannot map each other. D's region checks apply: D checks every descriptor of every
//! connection's part against its regions before a byte is received, and P sends the payload only
//! once every part was accepted (a refusal of one part refuses the whole plan; nothing lands).
//! Under the cluster secret ([`StagedAuth`]) P seals every request and D proves the secret in its
//! acceptance, so neither end moves a byte for a stranger; with TLS the connection is encrypted and
//! its handshake is the same mutual proof.
//!
//! - [`wire`]: the minimal framing (header of destination descriptors, replies, go/abort).
//! - [`link`]: one connection, plain or TLS.
//! - [`sender`]: P's [`StagedSender`] (a pool of connections per peer) and [`StagedEngine`], the
//!   `TransferEngine` over it.
//! - [`receiver`]: D's [`StagedReceiver`], a data server over D's device regions.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaEvent, CudaStream};

use super::{check, CudaContext, CudaError};
use crate::tcp::TcpConfig;
use pdflow_auth::{ClusterSecret, TlsIdentity};
use pdflow_kv::memory::RegionError;
use pdflow_kv::planner::Descriptor;

pub mod link;
pub mod receiver;
mod rings;
pub mod sender;
pub mod wire;

pub use receiver::StagedReceiver;
pub use rings::MAX_SPARE_RINGS;
pub use sender::{StagedEngine, StagedSender};

/// How the staged path cuts and pipelines a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedConfig {
    /// Bytes of one staging buffer (one chunk in flight on one connection).
    pub chunk_bytes: usize,
    /// Staging buffers per connection: chunks copied ahead of (P) or behind (D) the socket.
    pub depth: usize,
    /// TCP connections (and CUDA streams) one plan is spread over (P's side).
    pub streams: usize,
    /// The longest one write may take, connect to completion (every socket read and write, every
    /// copy wait is bounded by it).
    pub deadline: Duration,
    /// D's side: a connection that sends no request for this long is closed (its thread ends, its
    /// staging ring is lent again).
    pub idle_close: Duration,
    /// P's side: a pooled connection idle for longer than this, or closed by D, is dropped
    /// instead of reused (keep it well under D's `idle_close`).
    pub pool_idle: Duration,
    /// D's side: the most connections served at once (as the tcp data server's
    /// `max_connections`); one more is closed at its accept.
    pub max_connections: usize,
}

/// 8 connections × 4 chunks of 4 MiB: the fastest shape measured on 2×H200 over loopback
/// (seed request 10.6 ms, 14.1 GB/s; docs/gpu.md). Idle connections
/// as on the tcp path: D closes them after 300 s, P reuses them for 60 s.
impl Default for StagedConfig {
    fn default() -> Self {
        Self {
            chunk_bytes: 4 << 20,
            depth: 4,
            streams: 8,
            deadline: Duration::from_secs(30),
            idle_close: Duration::from_secs(300),
            pool_idle: Duration::from_secs(60),
            max_connections: crate::tcp::DEFAULT_MAX_CONNECTIONS,
        }
    }
}

impl StagedConfig {
    /// The same config with at least one stream, one buffer, 4 KiB chunks, a 1 ms idle close and
    /// one connection.
    pub fn sane(self) -> Self {
        Self {
            chunk_bytes: self.chunk_bytes.max(4096),
            depth: self.depth.max(1),
            streams: self.streams.max(1),
            idle_close: self.idle_close.max(Duration::from_millis(1)),
            max_connections: self.max_connections.max(1),
            ..self
        }
    }
}

/// What the staged path's ends prove to each other: the same settings as the tcp data channel's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StagedAuth {
    /// D's `--transfer-token`: P presents it with every request, D requires it.
    pub token: Option<String>,
    /// The cluster secret: P seals every request (bound to its destinations and D's fence, once),
    /// D seals its acceptance; each refuses the other without it.
    pub secret: Option<ClusterSecret>,
    /// TLS on every connection, with the secret's identity.
    pub tls: Option<TlsIdentity>,
    /// Without a secret, D's receiver serves non-loopback peers anyway (protected mode's opt-out;
    /// [`pdflow_auth::PeerFilter`]).
    pub insecure: bool,
}

impl StagedAuth {
    /// The token, secret, TLS identity and protected mode's opt-out of the tcp data channel's config.
    pub fn from_tcp(tcp: &TcpConfig) -> Self {
        Self { token: tcp.auth_token.clone(), secret: tcp.secret.clone(), tls: tcp.tls.clone(), insecure: tcp.insecure }
    }

    /// Which peers D's receiver serves.
    pub fn peers(&self) -> pdflow_auth::PeerFilter {
        pdflow_auth::PeerFilter::new(self.secret.as_ref(), self.insecure)
    }
}

/// Why a staged write, or D's side of one, failed.
#[derive(Debug, thiserror::Error)]
pub enum StagedError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error("cannot connect to D's staged data server at {peer}: {source} (is it listening there?)")]
    Connect { peer: String, source: std::io::Error },
    #[error("staged data connection to {peer} failed: {source}")]
    Io { peer: String, source: std::io::Error },
    #[error("{peer} refused the write: {reason}")]
    Refused { peer: String, reason: String },
    #[error("TLS with {peer} failed: {reason} (set `tls` and the same cluster secret on both ends)")]
    Tls { peer: String, reason: String },
    #[error("{peer} failed the write after accepting it: {reason}")]
    Failed { peer: String, reason: String },
    #[error("descriptor {index}: source is not in P's registered device memory: {source}")]
    SourceOutOfRegion { index: usize, source: RegionError },
    #[error("malformed staged-path message: {0}")]
    Protocol(String),
    #[error("the staged write did not finish within {deadline:?}")]
    Timeout { deadline: Duration },
    #[error(
        "D closed the pull's fence while its part was landing (the pull ended): connection dropped, nothing more lands"
    )]
    Fenced,
}

impl From<cudarc::driver::DriverError> for StagedError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Self::Cuda(CudaError::from(e))
    }
}

/// Page-locked host memory from `cuMemHostAlloc` (portable: any context may copy with it), freed
/// on drop. The staging buffer of one chunk.
pub struct PinnedBuffer {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: uniquely owned host memory; the driver allows using it from any thread.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, CudaError> {
        ctx.bind_to_thread()?;
        // SAFETY: a plain allocation; its contents are only read after a copy or a read wrote them.
        let ptr = unsafe { result::malloc_host(len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }?;
        Ok(Self { ctx: ctx.clone(), ptr: ptr.cast(), len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    /// The first `len` bytes (clamped to the buffer). The caller must have waited for every copy
    /// into this buffer that was enqueued before.
    pub fn bytes(&self, len: usize) -> &[u8] {
        // SAFETY: inside the allocation; cuMemHostAlloc memory is initialised by the driver's
        // zero-fill of fresh pages at worst, and stable for the buffer's life.
        unsafe { std::slice::from_raw_parts(self.ptr, len.min(self.len)) }
    }

    /// The first `len` bytes, writable. The caller must have waited for every copy out of this
    /// buffer that was enqueued before.
    pub fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        // SAFETY: as `bytes`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len.min(self.len)) }
    }
}

impl PinnedBuffer {
    /// Enqueues a copy of `len` bytes from device address `src` into this buffer on `stream`.
    ///
    /// # Safety
    /// `src..src+len` must be device memory the stream's context can read, and the buffer must
    /// not be read until the stream passed this copy.
    pub unsafe fn enqueue_dtoh(&mut self, stream: &CudaStream, src: u64, len: usize) -> Result<(), CudaError> {
        if len > self.len {
            return Err(CudaError::OutOfBounds { offset: 0, len: len as u64, size: self.len as u64 });
        }
        stream.context().bind_to_thread()?;
        // SAFETY: the buffer holds `len` bytes; the caller vouches for the device side.
        check(unsafe { sys::cuMemcpyDtoHAsync_v2(self.ptr.cast(), src, len, stream.cu_stream()) })
    }

    /// Enqueues a copy of this buffer's first `len` bytes to device address `dst` on `stream`.
    ///
    /// # Safety
    /// `dst..dst+len` must be device memory the stream's context can write, and the buffer must
    /// not be written until the stream passed this copy.
    pub unsafe fn enqueue_htod(&self, stream: &CudaStream, dst: u64, len: usize) -> Result<(), CudaError> {
        if len > self.len {
            return Err(CudaError::OutOfBounds { offset: 0, len: len as u64, size: self.len as u64 });
        }
        stream.context().bind_to_thread()?;
        // SAFETY: as above.
        check(unsafe { sys::cuMemcpyHtoDAsync_v2(dst, self.ptr.cast(), len, stream.cu_stream()) })
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `new`, freed once.
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}

/// One staging slot: a pinned buffer and the event recorded after the copies that use it.
pub(crate) struct Slot {
    pub buf: PinnedBuffer,
    pub done: CudaEvent,
}

/// `depth` slots of `chunk_bytes` each in `ctx`.
pub(crate) fn ring(ctx: &Arc<CudaContext>, config: &StagedConfig) -> Result<Vec<Slot>, CudaError> {
    (0..config.depth)
        .map(|_| {
            Ok(Slot {
                buf: PinnedBuffer::new(ctx, config.chunk_bytes)?,
                done: ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?,
            })
        })
        .collect()
}

/// Waits until `event` completed, polling until `until`.
pub(crate) fn wait_event(event: &CudaEvent, until: Instant, deadline: Duration) -> Result<(), StagedError> {
    let mut spins = 0u32;
    while !event.try_is_complete()? {
        if Instant::now() > until {
            return Err(StagedError::Timeout { deadline });
        }
        spins += 1;
        if spins < 200 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    Ok(())
}

/// One contiguous piece of a chunk: `len` bytes at device address `addr` ↔ `offset` in the chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub addr: u64,
    pub offset: u64,
    pub len: u64,
}

/// Cuts the payload of `ranges` ((device address, length), in payload order) into chunks of at
/// most `chunk` bytes; each chunk lists the device ranges its bytes come from (P) or go to (D).
pub fn chunk_pieces(ranges: impl IntoIterator<Item = (u64, u64)>, chunk: u64) -> Vec<Vec<Piece>> {
    let chunk = chunk.max(1);
    let mut chunks: Vec<Vec<Piece>> = Vec::new();
    let mut fill = chunk; // bytes in the last chunk; `chunk` means "start a new one"
    for (addr, len) in ranges {
        let mut done = 0;
        while done < len {
            if fill == chunk {
                chunks.push(Vec::new());
                fill = 0;
            }
            let n = (len - done).min(chunk - fill);
            if let Some(last) = chunks.last_mut() {
                last.push(Piece { addr: addr + done, offset: fill, len: n });
            }
            fill += n;
            done += n;
        }
    }
    chunks
}

/// The bytes of one chunk.
pub fn chunk_len(pieces: &[Piece]) -> u64 {
    pieces.last().map_or(0, |p| p.offset + p.len)
}

/// Cuts `descriptors` into at most `parts` runs of nearly equal bytes (cut points on 4 KiB
/// boundaries of the payload, descriptors split where a cut falls inside them); empty parts are
/// left out. Each part goes over its own connection.
pub fn split_parts(descriptors: &[Descriptor], parts: usize) -> Vec<Vec<Descriptor>> {
    let total: u64 = descriptors.iter().map(|d| d.len).sum();
    let parts = parts.max(1) as u64;
    let share = total.div_ceil(parts).div_ceil(4096) * 4096;
    if share == 0 {
        return Vec::new();
    }
    let mut out: Vec<Vec<Descriptor>> = vec![Vec::new()];
    let mut room = share;
    for d in descriptors {
        let mut done = 0;
        while done < d.len {
            if room == 0 {
                out.push(Vec::new());
                room = share;
            }
            let n = (d.len - done).min(room);
            if let Some(last) = out.last_mut() {
                last.push(Descriptor { src: d.src + done, dst: d.dst + done, len: n });
            }
            room -= n;
            done += n;
        }
    }
    out.retain(|p| !p.is_empty());
    out
}

#[cfg(test)]
mod auth_tests;
#[cfg(test)]
mod tests;
