//! P's side of the staged path: [`StagedSender`] writes a plan from P's device regions to D's
//! [`super::StagedReceiver`] over `streams` TCP connections (kept in a pool per peer). On each
//! connection: the part's destinations go first, D checks them; once every part is accepted, P
//! enqueues device→pinned-host copies of the first `depth` chunks, then in turn waits for a chunk's
//! copy, sends it, and enqueues the chunk `depth` ahead into the freed buffer; D's `DONE` ends it.
//! A pooled connection is reused only while it is younger than `pool_idle` and not closed by D
//! (D closes idle ones after its `idle_close`, or when it restarts): the others are dropped and
//! new ones opened, so that a write does not fail on a connection D already let go.
//! Under the cluster secret each request is sealed and the payload goes only to a D whose
//! acceptance proves the secret; with TLS each connection opens with the handshake.
//! [`StagedEngine`] is the `TransferEngine` over it (backend `cuda-staged`).
//!
//! Owns P's side of seed step 29 on the cross-host GPU path.

use std::collections::HashMap;
use std::io::Write;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaStream};
use futures::future::BoxFuture;
use pdflow_auth::{Refusal, Socket};
use pdflow_messages::layout::RegionDesc;

use super::link::StagedLink;
use super::rings::{LentRing, RingPool};
use super::wire::{self, Reply};
use super::{chunk_len, chunk_pieces, split_parts, wait_event, Slot, StagedAuth, StagedConfig, StagedError};
use crate::cuda::ipc::region_of;
use crate::cuda::{check, CudaContext, CudaError};
use crate::tcp::still_open;
use crate::{TransferEngine, TransferError, TransferStats};
use pdflow_kv::planner::{Descriptor, TransferPlan};

/// The backend name of [`StagedEngine`].
pub const BACKEND: &str = "cuda-staged";

/// One pooled connection: the socket, and its CUDA stream and staging ring (lent by the sender's
/// [`RingPool`], which gets the ring back when the connection is dropped).
struct SendConn {
    link: StagedLink,
    lent: LentRing,
    /// When it last went back to the pool (or was opened).
    idle_since: Instant,
}

impl SendConn {
    /// Whether the pool may hand it out again: not idle past `pool_idle`, and D has not closed
    /// it (nor sent anything unasked, which would put it out of step).
    fn reusable(&self, pool_idle: Duration) -> bool {
        self.idle_since.elapsed() < pool_idle && still_open(self.link.tcp())
    }
}

/// P's staged-path writer: P's GPU, P's regions (the only valid sources), and idle connections
/// per peer.
pub struct StagedSender {
    ctx: Arc<CudaContext>,
    local_regions: Vec<RegionDesc>,
    config: StagedConfig,
    /// The token, secret and TLS identity P proves itself with (D's must match).
    auth: StagedAuth,
    pool: Mutex<HashMap<String, Vec<SendConn>>>,
    /// Rings left by dropped connections (a D restarted, an error) or pinned ahead.
    rings: Arc<RingPool>,
}

impl StagedSender {
    pub fn new(ctx: &Arc<CudaContext>, local_regions: Vec<RegionDesc>, config: StagedConfig) -> Self {
        let config = config.sane();
        Self {
            ctx: ctx.clone(),
            local_regions,
            config,
            auth: StagedAuth::default(),
            pool: Mutex::default(),
            rings: RingPool::new(ctx, config),
        }
    }

    /// The same sender proving `auth` to D's receiver: its token, seals of its secret, TLS.
    pub fn with_auth(mut self, auth: StagedAuth) -> Self {
        self.auth = auth;
        self
    }

    /// Opens connections to `peer` until `streams` are pooled (their staging rings allocated), so
    /// that the first write does not pay for them; the first failure is returned.
    pub fn warm(&self, peer: &str) -> Result<(), StagedError> {
        let pooled = {
            let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
            let idle = pool.entry(peer.to_string()).or_default();
            idle.retain(|c| c.reusable(self.config.pool_idle));
            idle.len()
        };
        let mut opened = Vec::new();
        for _ in pooled..self.config.streams {
            opened.push(self.connect(peer)?);
        }
        self.pool.lock().unwrap_or_else(PoisonError::into_inner).entry(peer.to_string()).or_default().extend(opened);
        Ok(())
    }

    /// Drops the pooled connections to `peer` (D restarted: its receiver moved); their rings
    /// stay pinned for the next connections.
    pub fn forget_peer(&self, peer: &str) {
        let dropped = self.pool.lock().unwrap_or_else(PoisonError::into_inner).remove(peer);
        drop(dropped);
    }

    /// Pins `n` staging rings now (at most [`super::MAX_SPARE_RINGS`] are kept), for connections
    /// to come.
    pub fn prepin(&self, n: usize) -> Result<(), StagedError> {
        Ok(self.rings.prepin(n)?)
    }

    /// Staging rings pinned and not in use by a connection.
    pub fn spare_rings(&self) -> usize {
        self.rings.idle()
    }

    pub fn config(&self) -> &StagedConfig {
        &self.config
    }

    /// Up to `n` pooled connections to `peer` that are still usable; the stale ones are dropped
    /// (their rings go back to the ring pool).
    fn take_conns(&self, peer: &str, n: usize) -> Vec<SendConn> {
        let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
        let idle = pool.entry(peer.to_string()).or_default();
        let mut taken = Vec::with_capacity(n);
        while taken.len() < n {
            let Some(conn) = idle.pop() else { break };
            if conn.reusable(self.config.pool_idle) {
                taken.push(conn);
            } else {
                tracing::debug!(%peer, "pooled staged connection dropped: idle too long or closed by D");
            }
        }
        taken
    }

    /// Pooled connections to `peer` (usable or not yet found stale).
    pub fn pooled(&self, peer: &str) -> usize {
        self.pool.lock().unwrap_or_else(PoisonError::into_inner).get(peer).map_or(0, Vec::len)
    }

    /// A new connection to `peer` (within the write deadline; with TLS, after the handshake),
    /// with its staging ring.
    fn connect(&self, peer: &str) -> Result<SendConn, StagedError> {
        let connect_err = |source| StagedError::Connect { peer: peer.to_string(), source };
        let io = |source| StagedError::Io { peer: peer.to_string(), source };
        let addr = peer
            .to_socket_addrs()
            .map_err(connect_err)?
            .next()
            .ok_or_else(|| connect_err(std::io::Error::other("the address resolves to nothing")))?;
        let tcp = TcpStream::connect_timeout(&addr, self.config.deadline).map_err(connect_err)?;
        tcp.set_nodelay(true).map_err(io)?;
        tcp.set_read_timeout(Some(self.config.deadline)).map_err(io)?;
        tcp.set_write_timeout(Some(self.config.deadline)).map_err(io)?;
        let link = match &self.auth.tls {
            None => StagedLink::Plain(tcp),
            Some(identity) => StagedLink::connect_tls(tcp, identity).map_err(|e| {
                if e.is_refusal() {
                    pdflow_auth::refused(Socket::Data, peer, Refusal::BadProof);
                }
                StagedError::Tls { peer: peer.to_string(), reason: e.to_string() }
            })?,
        };
        Ok(SendConn { link, lent: self.rings.lend()?, idle_since: Instant::now() })
    }

    /// Seed step 29 across hosts: checks every source against P's regions, spreads the plan over
    /// `streams` connections and returns once D reported every byte in its device memory.
    pub fn write(&self, peer: &str, plan: &TransferPlan) -> Result<TransferStats, StagedError> {
        let start = Instant::now();
        for (index, d) in plan.descriptors.iter().enumerate() {
            region_of(&self.local_regions, d.src, d.len)
                .map_err(|source| StagedError::SourceOutOfRegion { index, source })?;
        }
        let parts = split_parts(&plan.descriptors, self.config.streams);
        let mut conns = self.take_conns(peer, parts.len());
        while conns.len() < parts.len() {
            conns.push(self.connect(peer)?);
        }
        let until = start + self.config.deadline;
        let refused = AtomicBool::new(false);
        let barrier = Barrier::new(parts.len());
        let results: Vec<Result<(), StagedError>> = std::thread::scope(|s| {
            let handles: Vec<_> = conns
                .iter_mut()
                .zip(&parts)
                .map(|(conn, part)| {
                    let (refused, barrier, config, ctx) = (&refused, &barrier, &self.config, &self.ctx);
                    let request = Request { auth: &self.auth, fence: plan.fence, part };
                    s.spawn(move || send_part(ctx, conn, peer, request, config, until, refused, barrier))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(StagedError::Protocol("a send thread panicked".into()))))
                .collect()
        });
        // A refusal leaves every connection in step (nothing was sent after it); any other error
        // leaves the stream's state unknown: those connections are dropped.
        let mut first_err = None;
        let clean = results.iter().all(|r| matches!(r, Ok(()) | Err(StagedError::Refused { .. })));
        for r in results {
            if let Err(e) = r {
                if first_err.is_none() || matches!(e, StagedError::Refused { .. }) {
                    first_err = Some(e);
                }
            }
        }
        if clean {
            let now = Instant::now();
            let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
            pool.entry(peer.to_string())
                .or_default()
                .extend(conns.into_iter().map(|c| SendConn { idle_since: now, ..c }));
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(TransferStats {
                bytes: plan.total_bytes(),
                descriptors: plan.descriptors.len(),
                duration: start.elapsed(),
            }),
        }
    }
}

/// What one connection offers D: P's proofs, the pull's fence token, the part.
#[derive(Clone, Copy)]
struct Request<'a> {
    auth: &'a StagedAuth,
    fence: u64,
    part: &'a [Descriptor],
}

/// One connection's part: offer, barrier (every part accepted?), go + pipelined payload, done.
#[allow(clippy::too_many_arguments)]
fn send_part(
    ctx: &Arc<CudaContext>,
    conn: &mut SendConn,
    peer: &str,
    request: Request<'_>,
    config: &StagedConfig,
    until: Instant,
    refused: &AtomicBool,
    barrier: &Barrier,
) -> Result<(), StagedError> {
    let io = |source| StagedError::Io { peer: peer.to_string(), source };
    let part = request.part;
    let offered = offer(conn, peer, request);
    if offered.is_err() {
        refused.store(true, Ordering::SeqCst);
    }
    // Every part reaches the barrier exactly once, whatever happened to it.
    barrier.wait();
    offered?;
    if refused.load(Ordering::SeqCst) {
        conn.link.write_all(&[wire::ABORT]).and_then(|()| conn.link.flush()).map_err(io)?;
        return Err(StagedError::Refused {
            peer: peer.to_string(),
            reason: "another part of the plan was refused".into(),
        });
    }
    conn.link.write_all(&[wire::GO]).map_err(io)?;
    ctx.bind_to_thread().map_err(CudaError::from)?;
    let chunks = chunk_pieces(part.iter().map(|d| (d.src, d.len)), config.chunk_bytes as u64);
    let depth = conn.lent.ring.len();
    let enqueue = |slot: &mut Slot, pieces: &[super::Piece], stream: &CudaStream| -> Result<(), StagedError> {
        let base = slot.buf.as_mut_ptr();
        for p in pieces {
            // SAFETY: `p.offset + p.len <= chunk_bytes` (chunk_pieces), the source lies in P's
            // regions (checked in `write`), and the buffer is not read until `done` completes.
            check(unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    base.add(p.offset as usize).cast(),
                    p.addr,
                    p.len as usize,
                    stream.cu_stream(),
                )
            })?;
        }
        slot.done.record(stream)?;
        Ok(())
    };
    let SendConn { link, lent, .. } = conn;
    let LentRing { stream, ring, .. } = lent;
    for (i, pieces) in chunks.iter().enumerate().take(depth) {
        enqueue(&mut ring[i], pieces, stream)?;
    }
    for (i, pieces) in chunks.iter().enumerate() {
        let slot = &mut ring[i % depth];
        wait_event(&slot.done, until, config.deadline)?;
        link.write_all(slot.buf.bytes(chunk_len(pieces) as usize)).map_err(io)?;
        if let Some(next) = chunks.get(i + depth) {
            enqueue(slot, next, stream)?;
        }
    }
    link.flush().map_err(io)?;
    match wire::read_reply(link).map_err(|e| wire_error(peer, e))? {
        Reply::Done => Ok(()),
        Reply::Failed(reason) => Err(StagedError::Failed { peer: peer.to_string(), reason }),
        other => Err(StagedError::Protocol(format!("expected DONE or FAILED, got {other:?}"))),
    }
}

/// Sends the part's destinations and reads D's verdict. Under the secret, an acceptance that
/// does not prove it is refused here (P answers `ABORT`, so the connection stays in step): no
/// payload byte goes to a D that is not one of the cluster's.
fn offer(conn: &mut SendConn, peer: &str, request: Request<'_>) -> Result<(), StagedError> {
    let token = request.auth.token.as_deref().unwrap_or_default().as_bytes();
    let secret = request.auth.secret.as_ref();
    let sealed = wire::encode_request(token, request.fence, request.part, secret)
        .map_err(|e| StagedError::Protocol(e.to_string()))?;
    let io = |source| StagedError::Io { peer: peer.to_string(), source };
    conn.link.write_all(&sealed.bytes).and_then(|()| conn.link.flush()).map_err(io)?;
    let reply = wire::read_reply(&mut conn.link).map_err(|e| wire_error(peer, e))?;
    let proven = match (&reply, secret, &sealed.nonce) {
        (Reply::Accepted | Reply::AcceptedSealed(_), None, _) => Ok(()),
        (Reply::AcceptedSealed(seal), Some(secret), Some(nonce)) => wire::open_acceptance(secret, seal, nonce),
        (Reply::Accepted, Some(_), _) => Err(Refusal::Unproven),
        (Reply::Refused(reason), ..) => {
            return Err(StagedError::Refused { peer: peer.to_string(), reason: reason.clone() })
        }
        (other, ..) => return Err(StagedError::Protocol(format!("expected ACCEPTED or REFUSED, got {other:?}"))),
    };
    if let Err(why) = proven {
        pdflow_auth::refused(Socket::Data, peer, why);
        conn.link.write_all(&[wire::ABORT]).and_then(|()| conn.link.flush()).map_err(io)?;
        return Err(StagedError::Refused {
            peer: peer.to_string(),
            reason: format!(
                "P holds the cluster secret and D's staged receiver did not prove it ({why}): nothing was sent to it"
            ),
        });
    }
    Ok(())
}

fn wire_error(peer: &str, e: wire::WireError) -> StagedError {
    match e {
        wire::WireError::Io(source) => StagedError::Io { peer: peer.to_string(), source },
        other => StagedError::Protocol(other.to_string()),
    }
}

/// How a staged failure reads to the transfer layer.
pub fn to_transfer_error(peer: &str, e: StagedError) -> TransferError {
    let peer = peer.to_string();
    match e {
        StagedError::Connect { source, .. } => TransferError::Connect { peer, source },
        StagedError::Io { source, .. } => TransferError::Io { peer, source },
        StagedError::Refused { reason, .. } => TransferError::Refused { peer, reason },
        StagedError::Tls { reason, .. } => TransferError::Refused { peer, reason: format!("TLS: {reason}") },
        StagedError::SourceOutOfRegion { source, .. } => TransferError::LocalRegion(source),
        StagedError::Timeout { deadline } => TransferError::Timeout { peer, deadline },
        other => TransferError::Io { peer, source: std::io::Error::other(format!("cuda-staged: {other}")) },
    }
}

/// The `TransferEngine` over [`StagedSender`]: `peer` is D's staged data server (`host:port`).
#[derive(Clone)]
pub struct StagedEngine(pub Arc<StagedSender>);

impl TransferEngine for StagedEngine {
    fn name(&self) -> &'static str {
        BACKEND
    }

    fn write<'a>(
        &'a self,
        peer: &'a str,
        plan: &'a TransferPlan,
    ) -> BoxFuture<'a, Result<TransferStats, TransferError>> {
        Box::pin(async move {
            let (sender, owned_peer, plan) = (self.0.clone(), peer.to_string(), plan.clone());
            let deadline = self.0.config.deadline + Duration::from_secs(5);
            let task = tokio::task::spawn_blocking(move || sender.write(&owned_peer, &plan));
            match tokio::time::timeout(deadline, task).await {
                Ok(Ok(result)) => result.map_err(|e| to_transfer_error(peer, e)),
                Ok(Err(join)) => Err(TransferError::Io {
                    peer: peer.to_string(),
                    source: std::io::Error::other(format!("cuda-staged write task failed: {join}")),
                }),
                Err(_) => Err(TransferError::Timeout { peer: peer.to_string(), deadline }),
            }
        })
    }
}
