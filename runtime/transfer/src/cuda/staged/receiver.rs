//! D's side of the staged path: [`StagedReceiver`] listens for P's connections and, on each, checks
//! the request — the auth token, P's seal of the cluster secret (once per request: a replay is
//! refused), every offered destination against D's device regions — refusing the part before a
//! byte is received, then receives the payload chunk by chunk into a ring of pinned host buffers, copying
//! each chunk host→device on the connection's own CUDA stream while the next one arrives, and
//! answers `DONE` once the last copy completed. A connection that sends no request for
//! `idle_close` is closed (P's pool drops such connections before it would reuse them); at most
//! `max_connections` are served at once, one more is closed at its accept (no thread for it).
//! With TLS, each connection begins with the handshake (P's certificate must be the secret's);
//! a stranger's is refused and counted before anything else is read. Without a secret (and
//! without `insecure`) only loopback peers are served ([`pdflow_auth::PeerFilter`]).
//!
//! Owns D's side of seed step 29 on the cross-host GPU path (the bytes land in D's regions; step
//! 31's completion follows on the side channel as for any backend).

use std::collections::HashMap;
use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaStream};
use pdflow_messages::layout::RegionDesc;

use pdflow_auth::{ReplayGuard, Socket};

use super::link::StagedLink;
use super::rings::{LentRing, RingPool};
use super::wire::{self, Offer, Reply};
use super::{chunk_len, chunk_pieces, wait_event, Slot, StagedAuth, StagedConfig, StagedError};
use crate::cuda::ipc::region_of;
use crate::cuda::{check, CudaContext, CudaError};
use crate::fence::{FenceGuard, WriteFence};

/// What a receiver shares with its connection threads.
struct Shared {
    ctx: Arc<CudaContext>,
    regions: Vec<RegionDesc>,
    config: StagedConfig,
    /// When set, a part is received only under an open fence token (no write-after-free).
    fence: Option<WriteFence>,
    /// The token, secret and TLS identity a request must prove.
    auth: StagedAuth,
    /// Seals seen lately: a request replayed within the window is refused.
    replay: ReplayGuard,
    stop: AtomicBool,
    /// Clones of the live connections (by id), shut down on stop; a connection's thread removes
    /// its own when it ends.
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_conn: AtomicU64,
    /// Connections closed at their accept because `max_connections` were being served.
    refused: AtomicU64,
    /// Staging rings pinned ahead ([`StagedReceiver::prepin`]) or left by ended connections,
    /// lent to a connection at its first accepted request.
    rings: Arc<RingPool>,
    /// The connection threads; finished ones are let go at each accept.
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Shared {
    fn conns(&self) -> std::sync::MutexGuard<'_, HashMap<u64, TcpStream>> {
        // A map of socket handles: a panicking holder leaves nothing half-done.
        self.conns.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// D's staged data server over its device regions. Stops (and joins its threads) on drop.
pub struct StagedReceiver {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
}

impl StagedReceiver {
    /// Listens on `addr` (e.g. `127.0.0.1:0`) for writes into `regions` (device memory of `ctx`'s
    /// GPU). `config.chunk_bytes` and `config.depth` size D's own staging rings.
    pub fn bind(
        ctx: &Arc<CudaContext>,
        regions: Vec<RegionDesc>,
        addr: &str,
        config: StagedConfig,
    ) -> Result<Self, StagedError> {
        Self::bind_fenced(ctx, regions, addr, config, None)
    }

    /// As [`StagedReceiver::bind`], and with `fence` a part is received only under a token open in
    /// it (D's Receiver opens one per pull): held while the part lands, so D waits for it before
    /// freeing the blocks; when D closes it mid-part, the part stops (the copies already enqueued
    /// finish first) and the connection is dropped — nothing more lands.
    pub fn bind_fenced(
        ctx: &Arc<CudaContext>,
        regions: Vec<RegionDesc>,
        addr: &str,
        config: StagedConfig,
        fence: Option<WriteFence>,
    ) -> Result<Self, StagedError> {
        Self::bind_guarded(ctx, regions, addr, config, fence, StagedAuth::default())
    }

    /// As [`StagedReceiver::bind_fenced`], and every request must prove what `auth` holds — the
    /// token, P's seal of the cluster secret, TLS with the secret's certificate (a request that
    /// does not is refused before anything is received or pinned for it): D's serving receiver,
    /// whose port any P that passed the data server's hello learns.
    pub fn bind_guarded(
        ctx: &Arc<CudaContext>,
        regions: Vec<RegionDesc>,
        addr: &str,
        config: StagedConfig,
        fence: Option<WriteFence>,
        auth: StagedAuth,
    ) -> Result<Self, StagedError> {
        let listener = TcpListener::bind(addr).map_err(|source| StagedError::Io { peer: addr.to_string(), source })?;
        let local_addr = listener.local_addr().map_err(|source| StagedError::Io { peer: addr.to_string(), source })?;
        let shared = Arc::new(Shared {
            ctx: ctx.clone(),
            regions,
            config: config.sane(),
            fence,
            auth,
            replay: ReplayGuard::new(REQUEST_WINDOW),
            stop: AtomicBool::new(false),
            conns: Mutex::default(),
            next_conn: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            rings: RingPool::new(ctx, config.sane()),
            threads: Mutex::default(),
        });
        let accept_shared = shared.clone();
        let accept = std::thread::Builder::new()
            .name("staged-accept".into())
            .spawn(move || accept_loop(listener, accept_shared))
            .map_err(|source| StagedError::Io { peer: addr.to_string(), source })?;
        Ok(Self { shared, local_addr, accept: Some(accept) })
    }

    /// Where P connects.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Pins `n` staging rings now (at most [`super::MAX_SPARE_RINGS`] are kept), so that P's
    /// first connections do not wait for D to pin theirs.
    pub fn prepin(&self, n: usize) -> Result<(), StagedError> {
        Ok(self.shared.rings.prepin(n)?)
    }

    /// Staging rings pinned and not in use by a connection.
    pub fn spare_rings(&self) -> usize {
        self.shared.rings.idle()
    }

    /// P's connections being served now.
    pub fn live_connections(&self) -> usize {
        self.shared.conns().len()
    }
}

impl Drop for StagedReceiver {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop with a connection of our own.
        let _ = TcpStream::connect(self.local_addr);
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        for c in self.shared.conns().values() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        let threads: Vec<_> = self.shared.threads.lock().unwrap_or_else(PoisonError::into_inner).drain(..).collect();
        for h in threads {
            let _ = h.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(conn) = conn else { continue };
        // Protected mode: a peer not on loopback, without a secret, is closed here (counted).
        let Ok(peer) = conn.peer_addr() else { continue };
        if !shared.auth.peers().admit(Socket::Data, peer) {
            continue;
        }
        let Ok(clone) = conn.try_clone() else { continue };
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        {
            let mut live = shared.conns();
            if live.len() >= shared.config.max_connections {
                drop(live);
                // Said once, then every 1,000th.
                let refused = shared.refused.fetch_add(1, Ordering::Relaxed);
                if refused.is_multiple_of(1000) {
                    let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
                    tracing::warn!(%peer, max = shared.config.max_connections, refused = refused + 1, "staged data connection closed at accept: the receiver already serves its most connections");
                }
                continue;
            }
            live.insert(id, clone);
        }
        let conn_shared = shared.clone();
        let spawned = std::thread::Builder::new().name("staged-recv".into()).spawn(move || {
            let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
            if let Err(e) = serve_conn(conn, &conn_shared) {
                if !conn_shared.stop.load(Ordering::SeqCst) {
                    tracing::warn!(peer = %peer, error = %e, "staged data connection closed on error");
                }
            }
            conn_shared.conns().remove(&id);
        });
        let mut threads = shared.threads.lock().unwrap_or_else(PoisonError::into_inner);
        threads.retain(|h| !h.is_finished());
        match spawned {
            Ok(h) => threads.push(h),
            Err(e) => {
                shared.conns().remove(&id);
                tracing::warn!(error = %e, "cannot start a thread for a staged data connection; closed");
            }
        }
    }
}

/// How far a sealed request's send time may be from D's clock.
const REQUEST_WINDOW: Duration = Duration::from_secs(30);

/// How often a payload read that waits looks whether D revoked the part's fence.
const FENCE_CHECK: Duration = Duration::from_millis(5);

enum ChunkError {
    Fenced,
    Timeout,
    Io(std::io::Error),
}

/// Reads exactly `buf` (the socket's read timeout is [`FENCE_CHECK`]): between waits, stops when
/// D revoked the fence or the part's deadline passed.
fn read_chunk(
    link: &mut StagedLink,
    buf: &mut [u8],
    fence: Option<&FenceGuard>,
    until: Instant,
) -> Result<(), ChunkError> {
    let mut got = 0;
    while got < buf.len() {
        if fence.is_some_and(FenceGuard::is_revoked) {
            return Err(ChunkError::Fenced);
        }
        match link.read(&mut buf[got..]) {
            Ok(0) => return Err(ChunkError::Io(std::io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                if Instant::now() >= until {
                    return Err(ChunkError::Timeout);
                }
            }
            Err(e) => return Err(ChunkError::Io(e)),
        }
    }
    Ok(())
}

/// Why a part is refused: the first destination outside D's regions.
pub fn check_destinations(regions: &[RegionDesc], offered: &[(u64, u64)]) -> Result<(), String> {
    for (index, &(dst, len)) in offered.iter().enumerate() {
        region_of(regions, dst, len)
            .map_err(|e| format!("descriptor {index}: destination is not in D's registered device memory: {e}"))?;
    }
    Ok(())
}

/// Serves requests on one connection until P closes it or it idles for `idle_close`.
fn serve_conn(tcp: TcpStream, shared: &Shared) -> Result<(), StagedError> {
    let peer = tcp.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
    let io = |source| StagedError::Io { peer: peer.clone(), source };
    tcp.set_nodelay(true).map_err(io)?;
    tcp.set_write_timeout(Some(shared.config.deadline)).map_err(io)?;
    let mut link = open_link(tcp, &peer, shared)?;
    shared.ctx.bind_to_thread().map_err(CudaError::from)?;
    // Lent at the first accepted request: a connection that never sends one pins nothing.
    let mut lent: Option<LentRing> = None;
    loop {
        if !wait_for_request(&mut link, &peer, shared)? {
            return Ok(());
        }
        link.tcp().set_read_timeout(Some(shared.config.deadline)).map_err(io)?;
        let offer = match wire::read_request(&mut link) {
            Ok(Some(offer)) => offer,
            Ok(None) => return Ok(()),
            Err(e) => return Err(StagedError::Protocol(e.to_string())),
        };
        let acceptance = match admit(shared, &peer, &offer) {
            Ok(acceptance) => acceptance,
            Err(reason) => {
                wire::write_reply(&mut link, &Reply::Refused(reason)).map_err(io)?;
                continue;
            }
        };
        let lent_ring = match &mut lent {
            Some(lent) => lent,
            empty => empty.insert(shared.rings.lend()?),
        };
        // Held while the part lands: D's Receiver waits for it before freeing the blocks.
        let guard = match enter_fence(shared, offer.fence) {
            Ok(guard) => guard,
            Err(reason) => {
                wire::write_reply(&mut link, &Reply::Refused(reason)).map_err(io)?;
                continue;
            }
        };
        wire::write_reply(&mut link, &acceptance).map_err(io)?;
        if !wire::read_go(&mut link).map_err(|e| StagedError::Protocol(e.to_string()))? {
            continue;
        }
        receive_part(&mut link, &peer, lent_ring, &offer.ranges, shared, guard)?;
    }
}

/// The connection as D speaks it: with TLS, after the handshake (P's certificate must be one of
/// the secret's: a stranger is refused and counted), within the part's deadline.
fn open_link(tcp: TcpStream, peer: &str, shared: &Shared) -> Result<StagedLink, StagedError> {
    let Some(identity) = &shared.auth.tls else { return Ok(StagedLink::Plain(tcp)) };
    tcp.set_read_timeout(Some(shared.config.deadline))
        .map_err(|source| StagedError::Io { peer: peer.into(), source })?;
    StagedLink::accept_tls(tcp, identity).map_err(|e| {
        if e.is_refusal() {
            pdflow_auth::refused(Socket::Data, peer, pdflow_auth::Refusal::BadProof);
        }
        StagedError::Tls { peer: peer.to_string(), reason: e.to_string() }
    })
}

/// Idle between requests: up to `idle_close` until one begins (then the connection is closed:
/// P's pool drops idle ones sooner); once its first byte is here, the whole request must follow
/// within the part's deadline. `false` when the connection ends in order (P closed, or idle).
fn wait_for_request(link: &mut StagedLink, peer: &str, shared: &Shared) -> Result<bool, StagedError> {
    if link.has_plaintext() {
        return Ok(true);
    }
    let io = |source| StagedError::Io { peer: peer.to_string(), source };
    let tcp = link.tcp();
    tcp.set_read_timeout(Some(shared.config.idle_close)).map_err(io)?;
    match tcp.peek(&mut [0u8; 1]) {
        Ok(0) => Ok(false),
        Ok(_) => Ok(true),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
            tracing::debug!(%peer, idle = ?shared.config.idle_close, "idle staged data connection closed");
            Ok(false)
        }
        Err(source) => Err(io(source)),
    }
}

/// D's acceptance of a request (sealed when D holds the secret), or why it is refused before
/// anything is received or pinned for it: a wrong or missing auth token, a missing, forged or
/// replayed seal, or a destination outside D's regions. A refusal leaves the connection in step
/// (P sends a payload only after an acceptance), so P's pool keeps a usable one.
fn admit(shared: &Shared, peer: &str, offer: &Offer) -> Result<Reply, String> {
    if let Some(expected) = &shared.auth.token {
        if !crate::tcp::constant_time_eq(expected.as_bytes(), &offer.auth) {
            tracing::warn!(%peer, "staged request with a wrong or missing auth token refused");
            return Err("the auth token does not match D's (--transfer-token / PDFLOW_TRANSFER_TOKEN must be the same on P and D)".into());
        }
    }
    let acceptance = match &shared.auth.secret {
        None => Reply::Accepted,
        Some(secret) => {
            let opened = if offer.seal.is_empty() {
                Err(pdflow_auth::Refusal::Missing)
            } else {
                pdflow_auth::sealed::STAGED.open_request(secret, &offer.sealed_bytes(), &offer.seal, &shared.replay)
            };
            match opened {
                Ok(nonce) => wire::accept_sealed(secret, &nonce),
                Err(why) => {
                    pdflow_auth::refused(Socket::Data, peer, why);
                    return Err(format!("D's staged receiver holds the cluster secret and refused the request: {why}"));
                }
            }
        }
    };
    check_destinations(&shared.regions, &offer.ranges)?;
    Ok(acceptance)
}

/// Enters fence `token` for one part (when D's receiver has a fence); the refusal's reason when
/// it is closed.
fn enter_fence(shared: &Shared, token: u64) -> Result<Option<FenceGuard>, String> {
    let Some(fence) = &shared.fence else { return Ok(None) };
    match fence.enter(token) {
        Some(guard) => Ok(Some(guard)),
        None => Err(format!(
            "fence {token} is closed: D no longer expects this transfer (its pull ended); nothing will be received"
        )),
    }
}

/// One accepted part: its payload received under the fence `guard`, then `DONE`. A failure that
/// leaves the payload's remainder on the wire is reported and ends the connection.
fn receive_part(
    link: &mut StagedLink,
    peer: &str,
    lent: &mut LentRing,
    offered: &[(u64, u64)],
    shared: &Shared,
    guard: Option<FenceGuard>,
) -> Result<(), StagedError> {
    let io = |source| StagedError::Io { peer: peer.to_string(), source };
    let until = Instant::now() + shared.config.deadline;
    // Short reads while the payload lands, so that a revoked fence is seen within FENCE_CHECK.
    link.tcp().set_read_timeout(Some(FENCE_CHECK)).map_err(io)?;
    let LentRing { stream, ring, .. } = lent;
    let received = receive(link, peer, stream, ring, offered, shared, until, guard.as_ref());
    if received.is_err() {
        // Every copy already enqueued lands before the guard lets D free the blocks.
        let _ = stream.synchronize();
    }
    drop(guard);
    match received {
        Ok(()) => wire::write_reply(link, &Reply::Done).map_err(io),
        // The payload's remainder is still on the wire: report, then close the connection.
        Err(e @ (StagedError::Cuda(_) | StagedError::Timeout { .. })) => {
            let _ = wire::write_reply(link, &Reply::Failed(e.to_string()));
            Err(e)
        }
        Err(e) => Err(e),
    }
}

/// Receives one accepted part's payload into D's regions (pipelined), and waits for the copies.
#[allow(clippy::too_many_arguments)]
fn receive(
    link: &mut StagedLink,
    peer: &str,
    stream: &Arc<CudaStream>,
    ring: &mut [Slot],
    offered: &[(u64, u64)],
    shared: &Shared,
    until: Instant,
    fence: Option<&FenceGuard>,
) -> Result<(), StagedError> {
    let deadline = shared.config.deadline;
    let chunks = chunk_pieces(offered.iter().copied(), shared.config.chunk_bytes as u64);
    let depth = ring.len();
    for (i, pieces) in chunks.iter().enumerate() {
        let slot = &mut ring[i % depth];
        if i >= depth {
            // The copy out of this buffer (chunk i - depth) must be done before it is overwritten.
            wait_event(&slot.done, until, deadline)?;
        }
        let len = chunk_len(pieces) as usize;
        if let Err(e) = read_chunk(link, slot.buf.bytes_mut(len), fence, until) {
            // The caller waits for the copies already enqueued before it releases the guard.
            return Err(match e {
                ChunkError::Fenced => StagedError::Fenced,
                ChunkError::Timeout => StagedError::Timeout { deadline },
                ChunkError::Io(source) => StagedError::Io { peer: peer.to_string(), source },
            });
        }
        let base = slot.buf.as_mut_ptr();
        for p in pieces {
            // SAFETY: the destination lies in D's regions (checked before ACCEPTED); the source
            // is inside this buffer (chunk_pieces), which is not reused until `done` completes.
            check(unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    p.addr,
                    base.add(p.offset as usize).cast(),
                    p.len as usize,
                    stream.cu_stream(),
                )
            })?;
        }
        slot.done.record(stream)?;
    }
    for slot in ring.iter() {
        wait_event(&slot.done, until, deadline)?;
    }
    Ok(())
}
