//! P's side of the `tcp` backend: [`TcpTransferEngine`] writes a plan from P's registered memory
//! into D's over a pool of connections per peer (seed step 29, P-push).
//!
//! A plan is split by bytes across up to `streams_per_peer` connections (a large descriptor may be
//! cut into pieces); each connection sends its share as one batch — header, then the payloads read
//! straight from the source memory with vectored writes (`writev`, up to [`MAX_IOVECS`] slices a
//! call, no copy on P's side) — and waits for D's one ack. Each share runs as its own task, so on a
//! multi-core host the streams' kernel copies run in parallel. Connections are made
//! lazily — or ahead of the write by [`TcpTransferEngine::prepare_peer`], while P still prefills —
//! reused across writes, and dropped after any error. A pooled connection is checked before it is
//! reused (a peer that closed it — restarted, or dropped it when its pull ended — shows as
//! end-of-stream or a reset) and dropped if dead. A failed share is never resent: D may have given
//! the pull up and closed its fence, and the whole share again into refused batches would only
//! load the link (a network-namespace chaos cell measures the bytes D gets after it freed the
//! blocks).

use std::collections::{HashMap, HashSet};
use std::io::IoSlice;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpSocket, TcpStream};
use tokio_rustls::TlsConnector;

use super::ack_wait;
use super::config::TcpConfig;
use super::stream::DataStream;
use super::wire::{self, Ack, HelloAnswer, HostInfo, WireError, MAX_DESCRIPTORS_PER_BATCH};
use super::SOCKET_BUFFER_BYTES;
use crate::{TransferEngine, TransferError, TransferStats};
use pdflow_auth::{ClusterSecret, Context as AuthContext, Nonce, Proof, Refusal, Socket, TlsIdentity};
use pdflow_kv::memory::RegionTable;
use pdflow_kv::planner::{Descriptor, TransferPlan};

/// A share smaller than this is not worth its own connection.
const MIN_BYTES_PER_STREAM: u64 = 64 * 1024;
/// Pooled connections idle longer than this are dropped (D closes its side after 300 s).
const POOL_IDLE: Duration = Duration::from_secs(60);
/// The most slices one `writev` is given (Linux's IOV_MAX).
pub(crate) const MAX_IOVECS: usize = 1024;

/// A fence D's data server holds open for a write P makes itself ([`TcpTransferEngine::hold_fence`]).
/// [`FenceHold::release`] ends it and pools the connection again; dropped unreleased, the
/// connection closes and D releases the fence then — so only drop it once P's write has ended.
pub struct FenceHold {
    inner: Arc<Inner>,
    peer: String,
    stream: Option<DataStream>,
}

impl FenceHold {
    /// Tells D that P's write has ended (no answer is awaited) and pools the connection.
    pub async fn release(mut self) -> Result<(), TransferError> {
        let Some(mut stream) = self.stream.take() else { return Ok(()) };
        let deadline = self.inner.config.connect_timeout;
        match tokio::time::timeout(deadline, stream.write_all(&wire::RELEASE_MAGIC)).await {
            Ok(Ok(())) => {
                self.inner.checkin(&self.peer, stream);
                Ok(())
            }
            Ok(Err(source)) => Err(TransferError::Io { peer: self.peer.clone(), source }),
            Err(_) => Err(TransferError::Timeout { peer: self.peer.clone(), deadline }),
        }
    }
}

impl std::fmt::Debug for FenceHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FenceHold").field("peer", &self.peer).field("held", &self.stream.is_some()).finish()
    }
}

struct PooledConnection {
    stream: DataStream,
    idle_since: Instant,
}

/// P's tcp transfer engine. Cheap to share (`Arc`); concurrent writes, to one peer or many, each
/// check out their own connections.
pub struct TcpTransferEngine {
    inner: Arc<Inner>,
}

struct Inner {
    local: RegionTable,
    config: TcpConfig,
    pool: Mutex<HashMap<String, Vec<PooledConnection>>>,
    /// Peers a [`TcpTransferEngine::prepare_peer`] is opening connections to.
    preparing: Mutex<HashSet<String>>,
    next_batch_id: AtomicU64,
}

impl std::fmt::Debug for TcpTransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransferEngine")
            .field("local", &self.inner.local)
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl TcpTransferEngine {
    /// An engine reading from `local` (P's registered memory).
    pub fn new(local: RegionTable, config: TcpConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                local,
                config,
                pool: Mutex::new(HashMap::new()),
                preparing: Mutex::new(HashSet::new()),
                next_batch_id: AtomicU64::new(1),
            }),
        }
    }

    pub fn config(&self) -> &TcpConfig {
        &self.inner.config
    }

    /// Idle connections pooled for `peer` (for metrics and tests).
    pub fn pooled_connections(&self, peer: &str) -> usize {
        self.inner.lock_pool().get(peer).map_or(0, Vec::len)
    }

    /// Asks the peer's data server for its same-host details (pid, host identity, canary,
    /// regions) on a pooled connection, within `connect_timeout`.
    pub async fn host_info(&self, peer: &str) -> Result<HostInfo, TransferError> {
        self.ask(peer, &wire::encode_info_request(std::process::id()), |s| Box::pin(wire::read_host_info(s))).await
    }

    /// Asks D's data server at `peer` for its device export (how to write D's GPU KV directly;
    /// empty when D offers none), within `connect_timeout`.
    pub async fn device_export(&self, peer: &str) -> Result<Vec<u8>, TransferError> {
        self.ask(peer, &wire::DEVICE_MAGIC, |s| Box::pin(wire::read_device_export(s))).await
    }

    /// Asks D's data server at `peer` to hold fence `token` open while P writes D's memory itself
    /// (cuda-ipc), within `connect_timeout`: once this returns, D's Receiver waits for the hold's
    /// release before it frees the pull's blocks. Refused when the token is not open (the pull
    /// ended, or was never D's): then nothing may be written.
    pub async fn hold_fence(&self, peer: &str, token: u64) -> Result<FenceHold, TransferError> {
        let (ack, stream) = self.ask_keeping(peer, &wire::encode_hold(token), |s| Box::pin(wire::read_ack(s))).await?;
        match ack {
            Ack::Ok { .. } => Ok(FenceHold { inner: self.inner.clone(), peer: peer.to_string(), stream: Some(stream) }),
            Ack::Refused { reason, .. } => {
                self.inner.checkin(peer, stream);
                Err(TransferError::Refused { peer: peer.to_string(), reason })
            }
        }
    }

    /// Sends `request` on a pooled (or new) connection to `peer` and reads the answer with `read`,
    /// within `connect_timeout`; the connection goes back to the pool after a whole answer.
    async fn ask<T>(
        &self,
        peer: &str,
        request: &[u8],
        read: for<'s> fn(&'s mut DataStream) -> BoxFuture<'s, Result<T, WireError>>,
    ) -> Result<T, TransferError> {
        let (answer, stream) = self.ask_keeping(peer, request, read).await?;
        self.inner.checkin(peer, stream);
        Ok(answer)
    }

    /// As [`Self::ask`], handing the connection back to the caller with the answer.
    async fn ask_keeping<T>(
        &self,
        peer: &str,
        request: &[u8],
        read: for<'s> fn(&'s mut DataStream) -> BoxFuture<'s, Result<T, WireError>>,
    ) -> Result<(T, DataStream), TransferError> {
        let inner = &self.inner;
        let deadline = tokio::time::Instant::now() + inner.config.connect_timeout;
        let mut stream = match inner.checkout(peer) {
            Some(stream) => stream,
            None => inner.connect(peer, deadline).await?,
        };
        let io = |source: std::io::Error| TransferError::Io { peer: peer.to_string(), source };
        let exchange = async {
            stream.write_all(request).await.map_err(io)?;
            read(&mut stream).await.map_err(|e| io(e.into_io()))
        };
        match tokio::time::timeout_at(deadline, exchange).await {
            Ok(Ok(answer)) => Ok((answer, stream)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(TransferError::Timeout { peer: peer.to_string(), deadline: inner.config.connect_timeout }),
        }
    }

    /// Opens, in parallel and within `connect_timeout`, the connections a large write to `peer`
    /// would use — up to `streams_per_peer`, less those already pooled — hello included, and pools
    /// them. A prepare already running for `peer` makes this one return at once.
    pub async fn prepare_peer(&self, peer: &str) -> Result<(), TransferError> {
        let inner = &self.inner;
        let missing = inner.config.streams_per_peer.max(1).saturating_sub(self.pooled_connections(peer));
        if missing == 0 || !inner.lock_preparing().insert(peer.to_string()) {
            return Ok(());
        }
        struct Prepared<'a>(&'a Inner, &'a str);
        impl Drop for Prepared<'_> {
            fn drop(&mut self) {
                self.0.lock_preparing().remove(self.1);
            }
        }
        let _prepared = Prepared(inner, peer);
        let deadline = tokio::time::Instant::now() + inner.config.connect_timeout;
        let opened = futures::future::join_all((0..missing).map(|_| inner.connect(peer, deadline))).await;
        let mut first_error = None;
        for stream in opened {
            match stream {
                Ok(stream) => inner.checkin(peer, stream),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    async fn write_plan(&self, peer: &str, plan: &TransferPlan) -> Result<TransferStats, TransferError> {
        let started = Instant::now();
        let inner = &self.inner;
        let descriptors: Vec<Descriptor> = plan.descriptors.iter().copied().filter(|d| d.len > 0).collect();
        for d in &descriptors {
            inner.local.check_host(d.src, d.len)?;
        }
        let bytes: u64 = descriptors.iter().map(|d| d.len).sum();
        if bytes > 0 {
            let streams = usize::try_from(bytes / MIN_BYTES_PER_STREAM)
                .unwrap_or(usize::MAX)
                .clamp(1, inner.config.streams_per_peer.max(1));
            let deadline = tokio::time::Instant::now() + inner.config.write_timeout;
            if streams == 1 {
                let pooled = inner.checkout(peer);
                inner.write_share(peer, pooled, &descriptors, plan.fence, deadline).await?;
            } else {
                // One task per share: the kernel copies of the streams run on every core. Each
                // share gets its own connection (checked out here, so shares never queue behind
                // each other). The set aborts the shares still running if this future is dropped
                // or one share fails.
                let split = split_by_bytes(&descriptors, streams);
                let pooled: Vec<Option<DataStream>> = split.iter().map(|_| inner.checkout(peer)).collect();
                let mut shares = tokio::task::JoinSet::new();
                for (share, pooled) in split.into_iter().zip(pooled) {
                    let (inner, peer, fence) = (inner.clone(), peer.to_string(), plan.fence);
                    shares.spawn(async move { inner.write_share(&peer, pooled, &share, fence, deadline).await });
                }
                while let Some(done) = shares.join_next().await {
                    match done {
                        Ok(result) => result?,
                        Err(e) => {
                            let source = std::io::Error::other(format!("a stream's task ended abnormally: {e}"));
                            return Err(TransferError::Io { peer: peer.to_string(), source });
                        }
                    }
                }
            }
        }
        Ok(TransferStats { bytes, descriptors: plan.descriptors.len(), duration: started.elapsed() })
    }
}

impl Inner {
    fn lock_preparing(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        // A set of names: a panicking holder cannot break it.
        self.preparing.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lock_pool(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<PooledConnection>>> {
        // The map holds no invariant a panicking holder could break: keep using it.
        self.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sends one share over `pooled` (or a fresh connection); retries once on a fresh connection if
    /// a pooled one failed.
    async fn write_share(
        &self,
        peer: &str,
        pooled: Option<DataStream>,
        share: &[Descriptor],
        fence: u64,
        deadline: tokio::time::Instant,
    ) -> Result<(), TransferError> {
        let mut stream = match pooled {
            Some(stream) => stream,
            None => self.connect(peer, deadline).await?,
        };
        match tokio::time::timeout_at(deadline, self.send_share(peer, &mut stream, share, fence)).await {
            Ok(Ok(())) => {
                self.checkin(peer, stream);
                Ok(())
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(TransferError::Timeout { peer: peer.to_string(), deadline: self.config.write_timeout }),
        }
    }

    /// Sends the share's batches, each acked by D.
    async fn send_share(
        &self,
        peer: &str,
        stream: &mut DataStream,
        share: &[Descriptor],
        fence: u64,
    ) -> Result<(), TransferError> {
        let io = |source: std::io::Error| TransferError::Io { peer: peer.to_string(), source };
        // D's fence token (0: none) goes in the same write as the share's first batch, always: a
        // pooled connection must not carry the previous plan's token over.
        let fence_msg = wire::encode_fence(fence);
        let mut name_fence = true;
        for batch in share.chunks(MAX_DESCRIPTORS_PER_BATCH) {
            let batch_id = self.next_batch_id.fetch_add(1, Ordering::Relaxed);
            let header = wire::encode_batch_header(batch_id, batch).map_err(|e| io(e.into_io()))?;
            // SAFETY: P's blocks under transfer are held (delayed free) and not written until
            // the transfer finishes; every range was checked against P's regions in `write_plan`.
            let payloads =
                batch.iter().map(|d| unsafe { self.local.slice(d.src, d.len) }).collect::<Result<Vec<&[u8]>, _>>()?;
            let batch_bytes: u64 = batch.iter().map(|d| d.len).sum();
            let fence_slice = if std::mem::take(&mut name_fence) { &fence_msg[..] } else { &[][..] };
            let mut slices: Vec<IoSlice<'_>> = std::iter::once(IoSlice::new(fence_slice))
                .chain(std::iter::once(IoSlice::new(&header)))
                .chain(payloads.iter().map(|p| IoSlice::new(p)))
                .filter(|s| !s.is_empty())
                .collect();
            write_all_vectored(stream, &mut slices).await.map_err(io)?;
            stream.flush().await.map_err(io)?;
            match ack_wait::read_ack(stream, batch_bytes).await.map_err(|e| io(e.into_io()))? {
                Ack::Ok { batch_id: acked } if acked == batch_id => {}
                Ack::Ok { batch_id: acked } => {
                    let msg = format!("ack for batch {acked} while waiting for batch {batch_id}");
                    return Err(io(std::io::Error::new(std::io::ErrorKind::InvalidData, msg)));
                }
                Ack::Refused { reason, .. } => return Err(TransferError::Refused { peer: peer.to_string(), reason }),
            }
        }
        Ok(())
    }

    /// A pooled connection to `peer` that is young and still open, if there is one; dead or old
    /// ones met on the way are dropped.
    fn checkout(&self, peer: &str) -> Option<DataStream> {
        let mut pool = self.lock_pool();
        let idle = pool.get_mut(peer)?;
        while let Some(conn) = idle.pop() {
            if conn.idle_since.elapsed() < POOL_IDLE && still_open(&conn.stream) {
                return Some(conn.stream);
            }
            tracing::debug!(%peer, "pooled data connection dropped: idle too long or closed by the peer");
        }
        None
    }

    fn checkin(&self, peer: &str, stream: DataStream) {
        let mut pool = self.lock_pool();
        let idle = pool.entry(peer.to_string()).or_default();
        if idle.len() < self.config.streams_per_peer.max(1) {
            idle.push(PooledConnection { stream, idle_since: Instant::now() });
        }
    }

    /// Connects and exchanges the hello, within `connect_timeout` and the write's deadline.
    async fn connect(&self, peer: &str, deadline: tokio::time::Instant) -> Result<DataStream, TransferError> {
        let connect_deadline = deadline.min(tokio::time::Instant::now() + self.config.connect_timeout);
        let limit = if connect_deadline < deadline { self.config.connect_timeout } else { self.config.write_timeout };
        match tokio::time::timeout_at(connect_deadline, self.connect_and_hello(peer)).await {
            Ok(result) => result,
            Err(_) => Err(TransferError::Timeout { peer: peer.to_string(), deadline: limit }),
        }
    }

    async fn connect_and_hello(&self, peer: &str) -> Result<DataStream, TransferError> {
        let connect_err = |source| TransferError::Connect { peer: peer.to_string(), source };
        let tcp = open(peer).await.map_err(connect_err)?;
        tcp.set_nodelay(true).map_err(connect_err)?;
        let mut stream = match &self.config.tls {
            None => DataStream::Plain(tcp),
            Some(identity) => DataStream::Tls(Box::new(tls_handshake(peer, tcp, identity).await?)),
        };
        let p_nonce = pdflow_auth::nonce();
        let hello = wire::encode_hello_with(self.config.auth_token.as_deref(), &p_nonce)
            .map_err(|e| connect_err(e.into_io()))?;
        // D closing (or resetting) the connection before its ack: said so, with the likely causes.
        let unanswered = |e: std::io::Error| {
            use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
            if matches!(e.kind(), UnexpectedEof | ConnectionReset | BrokenPipe | ConnectionAborted) {
                let why = format!("D closed the connection before answering the hello ({e}): it serves its most connections (max_connections), it is stopping, its data channel expects TLS (`tls` on both ends), or it runs without a cluster secret and so serves loopback peers only (give both sides the cluster secret, or start D with --insecure / PDFLOW_INSECURE=1)");
                return connect_err(std::io::Error::new(e.kind(), why));
            }
            connect_err(e)
        };
        stream.write_all(&hello).await.map_err(unanswered)?;
        let answer = wire::read_hello_answer(&mut stream).await.map_err(|e| unanswered(e.into_io()))?;
        let answer = match (answer, &self.config.secret) {
            (HelloAnswer::Challenge { nonce, proof }, Some(secret)) => {
                self.answer_challenge(peer, &mut stream, secret, &p_nonce, &nonce, &proof).await?
            }
            (HelloAnswer::Challenge { .. }, None) => {
                let reason = "D's data server requires the cluster secret: configure it on P (PDFLOW_CLUSTER_SECRET)";
                return Err(TransferError::Refused { peer: peer.to_string(), reason: reason.into() });
            }
            (HelloAnswer::Ack(Ack::Ok { .. }), Some(_)) => {
                // A data server without the secret may be anyone's: no KV goes to it.
                pdflow_auth::refused(Socket::Data, peer, Refusal::Unproven);
                let reason = format!("{}: no KV is written to it", Refusal::Unproven);
                return Err(TransferError::Refused { peer: peer.to_string(), reason });
            }
            (HelloAnswer::Ack(ack), _) => ack,
        };
        match answer {
            Ack::Ok { .. } => Ok(stream),
            Ack::Refused { reason, .. } => Err(TransferError::Refused { peer: peer.to_string(), reason }),
        }
    }

    /// Checks D's proof over P's nonce and D's, answers with P's, and reads D's verdict.
    async fn answer_challenge(
        &self,
        peer: &str,
        stream: &mut DataStream,
        secret: &ClusterSecret,
        p_nonce: &Nonce,
        d_nonce: &Nonce,
        d_proof: &Proof,
    ) -> Result<Ack, TransferError> {
        let io = |e: WireError| TransferError::Connect { peer: peer.to_string(), source: e.into_io() };
        if let Err(why) = secret.verify(AuthContext::DataServer, &[p_nonce, d_nonce], d_proof) {
            pdflow_auth::refused(Socket::Data, peer, why);
            return Err(TransferError::Refused { peer: peer.to_string(), reason: format!("D's data server: {why}") });
        }
        let proof = secret.sign(AuthContext::DataClient, &[d_nonce, p_nonce]);
        stream.write_all(&wire::encode_proof(&proof)).await.map_err(|e| io(e.into()))?;
        wire::read_ack(stream).await.map_err(io)
    }
}

/// Whether an idle pooled connection is still open: nothing to read and no end-of-stream or error
/// pending. Anything else — the peer closed or reset it, or sent bytes nobody asked for (the
/// stream's framing could not be trusted) — means it must not carry another batch.
pub(crate) fn still_open(stream: &impl std::os::fd::AsRawFd) -> bool {
    let mut byte = 0u8;
    // SAFETY: the socket is open for the call (`stream` owns it); one writable byte; MSG_PEEK and
    // MSG_DONTWAIT: consumes nothing and never blocks.
    let n = unsafe {
        libc::recv(stream.as_raw_fd(), (&mut byte as *mut u8).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT)
    };
    n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock
}

/// Writes every slice, `MAX_IOVECS` at a time, resuming after partial writes.
async fn write_all_vectored(stream: &mut DataStream, mut slices: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    while !slices.is_empty() {
        let window = slices.len().min(MAX_IOVECS);
        let n = stream.write_vectored(&slices[..window]).await?;
        if n == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::WriteZero, "the data connection accepted no bytes"));
        }
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

impl TransferEngine for TcpTransferEngine {
    fn name(&self) -> &'static str {
        "tcp"
    }

    /// Opens the connections a write to `peer` would use (see [`TcpTransferEngine::prepare_peer`]).
    fn prepare<'a>(&'a self, peer: &'a str) -> BoxFuture<'a, Result<(), TransferError>> {
        Box::pin(self.prepare_peer(peer))
    }

    fn write<'a>(
        &'a self,
        peer: &'a str,
        plan: &'a TransferPlan,
    ) -> BoxFuture<'a, Result<TransferStats, TransferError>> {
        Box::pin(self.write_plan(peer, plan))
    }
}

/// The TLS handshake with D's data server at `peer`: D must present the certificate of a key of
/// the cluster secret, and P presents its own.
async fn tls_handshake(
    peer: &str,
    tcp: TcpStream,
    identity: &TlsIdentity,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, TransferError> {
    let connector = TlsConnector::from(identity.client_config());
    match connector.connect(TlsIdentity::server_name(), tcp).await {
        Ok(stream) => Ok(stream),
        Err(e) => {
            let refusal = e
                .get_ref()
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
                .filter(|e| pdflow_auth::tls::is_refusal(e));
            if let Some(why) = refusal {
                pdflow_auth::refused(Socket::Data, peer, Refusal::BadProof);
                let reason = format!("D's data server failed TLS authentication ({why}): it does not hold the cluster secret; no KV is written to it");
                return Err(TransferError::Refused { peer: peer.to_string(), reason });
            }
            let why = format!(
                "TLS handshake with D's data server failed ({e}): is TLS on at D as well? (`tls` on both ends)"
            );
            Err(TransferError::Connect { peer: peer.to_string(), source: std::io::Error::new(e.kind(), why) })
        }
    }
}

/// Resolves `peer` (`host:port`) and connects to the first address that answers.
async fn open(peer: &str) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::new(std::io::ErrorKind::AddrNotAvailable, "the address resolved to nothing");
    for addr in tokio::net::lookup_host(peer).await? {
        let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
        if let Err(e) = socket.set_send_buffer_size(SOCKET_BUFFER_BYTES) {
            tracing::debug!("cannot enlarge the data socket's send buffer: {e}");
        }
        match socket.connect(addr).await {
            Ok(stream) => return Ok(stream),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Splits `descriptors` into at most `streams` shares of (nearly) equal bytes, in order, cutting a
/// descriptor where a share fills up. The shares cover exactly the bytes of `descriptors`.
pub(crate) fn split_by_bytes(descriptors: &[Descriptor], streams: usize) -> Vec<Vec<Descriptor>> {
    let total: u64 = descriptors.iter().map(|d| d.len).sum();
    let share = total.div_ceil(streams.max(1) as u64).max(1);
    let mut shares = Vec::with_capacity(streams);
    let mut current = Vec::new();
    let mut room = share;
    for d in descriptors {
        let mut rest = *d;
        while rest.len > 0 {
            let take = rest.len.min(room);
            current.push(Descriptor { src: rest.src, dst: rest.dst, len: take });
            rest = Descriptor { src: rest.src + take, dst: rest.dst + take, len: rest.len - take };
            room -= take;
            if room == 0 {
                shares.push(std::mem::take(&mut current));
                room = share;
            }
        }
    }
    if !current.is_empty() {
        shares.push(current);
    }
    shares
}
