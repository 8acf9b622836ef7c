//! D's side of the `tcp` backend: [`TcpDataServer`] accepts P's data connections and writes each
//! payload straight into D's registered memory (the receiving half of seed step 29).
//!
//! The accept loop is a task of D's runtime; each connection is served on a thread of its own
//! (see [`connection`](super::connection): the protocol, the region checks, the fence, vectored
//! reads of up to 1,024 destination slices a call, so a fragmented plan of 64 KiB descriptors
//! costs no more system calls than a coalesced one). A bad connection is closed; the server keeps
//! serving the others. At most `max_connections` are served at once (1,024 by default; P opens a
//! few per peer): one more is closed as soon as it is accepted, so that a flood of connections
//! costs D no threads. The server owns its accept loop and connection threads: when it is shut
//! down or dropped it stops accepting and shuts every connection's socket down, which ends the
//! threads' reads at once. Without a cluster secret (and without `insecure`), only loopback peers
//! are served: any other is closed at its accept ([`pdflow_auth::PeerFilter`], protected mode).
//!
//! After the hello, P may ask for the same-host details (see [`wire::HostInfo`]): unless started
//! with `offer_same_host = false`, the server answers with its pid, host identity, a random canary
//! (which P reads back through the kernel to prove the pid is this process) and its region table.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdflow_auth::{ClusterSecret, PeerFilter, Socket, TlsIdentity};
use tokio::net::{TcpListener, TcpSocket};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::connection::{self, Shared};
use super::wire::HostInfo;
use super::SOCKET_BUFFER_BYTES;
use crate::fence::WriteFence;
use crate::same_host;
use pdflow_kv::memory::{MemoryKind, RegionTable};

/// How long `shutdown` waits for the accept loop and connection threads to stop.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the data server could not start.
#[derive(Debug, thiserror::Error)]
pub enum DataServerError {
    #[error("cannot listen for KV data on {addr}: {source} (is the port free and the address local?)")]
    Bind { addr: SocketAddr, source: std::io::Error },
}

/// The most connections a data server serves at once, unless told otherwise.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// How a data server serves (see [`TcpDataServer::bind_options`]).
#[derive(Debug, Clone)]
pub struct DataServerOptions {
    /// P's connections must present this token.
    pub auth_token: Option<String>,
    /// The cluster secret: P must prove it holds it, and D proves it to P, on every connection.
    pub secret: Option<ClusterSecret>,
    /// TLS on every connection, with the secret's identity (P must connect with TLS too).
    pub tls: Option<TlsIdentity>,
    /// Offer the same-host path (host memory only).
    pub offer_same_host: bool,
    /// Write a batch only under an open fence token.
    pub fence: Option<WriteFence>,
    /// What P gets when it asks how to write D's GPU KV directly (the cuda backend's serialised
    /// export); empty: nothing offered.
    pub device_export: Vec<u8>,
    /// The most connections served at once (at least 1); one more is closed at its accept.
    pub max_connections: usize,
    /// Without `secret`: serve non-loopback peers anyway (the operator's opt-out of protected
    /// mode). Without both, a peer not on loopback is closed at its accept and counted
    /// ([`PeerFilter`]: `pdflow_auth_refusals_total{socket="data",cause="not_loopback"}`).
    pub insecure: bool,
}

impl Default for DataServerOptions {
    fn default() -> Self {
        Self {
            auth_token: None,
            secret: None,
            tls: None,
            offer_same_host: false,
            fence: None,
            device_export: Vec::new(),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            insecure: false,
        }
    }
}

/// The sockets of the connections being served, so stopping the server can wake their threads.
#[derive(Debug)]
struct Connections {
    next_id: AtomicU64,
    live: Mutex<HashMap<u64, std::net::TcpStream>>,
    /// The most served at once.
    max: usize,
    /// Connections closed at their accept because `max` were being served.
    refused: AtomicU64,
}

impl Connections {
    fn new(max: usize) -> Self {
        Self { next_id: AtomicU64::new(0), live: Mutex::default(), max: max.max(1), refused: AtomicU64::new(0) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, std::net::TcpStream>> {
        // A map of socket handles: a panicking holder leaves nothing half-done.
        self.live.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Shuts every live connection down: their blocked reads return at once.
    fn shut_all(&self) {
        for stream in self.lock().values() {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// D's data server. Dropping it (or [`TcpDataServer::shutdown`]) stops every task it started.
#[derive(Debug)]
pub struct TcpDataServer {
    local_addr: SocketAddr,
    cancel: CancellationToken,
    tracker: TaskTracker,
    connections: Arc<Connections>,
    /// The canary the same-host answer points P at (read back through the kernel).
    _canary: Box<[u8]>,
}

impl TcpDataServer {
    /// Listens on `addr` (port 0 picks a free one) and serves writes into `regions`. With
    /// `auth_token`, connections must present the same token.
    /// The server offers the same-host path (see [`TcpDataServer::bind_with`]).
    pub async fn bind(
        addr: SocketAddr,
        regions: RegionTable,
        auth_token: Option<String>,
    ) -> Result<Self, DataServerError> {
        Self::bind_with(addr, regions, auth_token, true).await
    }

    /// As [`TcpDataServer::bind`]; with `offer_same_host = false` the server tells P that the
    /// same-host path is not offered, so P always writes over TCP.
    pub async fn bind_with(
        addr: SocketAddr,
        regions: RegionTable,
        auth_token: Option<String>,
        offer_same_host: bool,
    ) -> Result<Self, DataServerError> {
        Self::bind_fenced(addr, regions, auth_token, offer_same_host, None).await
    }

    /// As [`TcpDataServer::bind_with`], and with `fence` every batch must follow a
    /// [`wire::Request::Fence`] naming a token open in it (D's Receiver opens one per pull and
    /// closes it when the pull ends): a write for a pull D gave up on is refused, never landed.
    pub async fn bind_fenced(
        addr: SocketAddr,
        regions: RegionTable,
        auth_token: Option<String>,
        offer_same_host: bool,
        fence: Option<WriteFence>,
    ) -> Result<Self, DataServerError> {
        Self::bind_options(
            addr,
            regions,
            DataServerOptions { auth_token, offer_same_host, fence, ..DataServerOptions::default() },
        )
        .await
    }

    /// Listens on `addr` and serves writes into `regions` as `options` say.
    pub async fn bind_options(
        addr: SocketAddr,
        regions: RegionTable,
        options: DataServerOptions,
    ) -> Result<Self, DataServerError> {
        let DataServerOptions {
            auth_token,
            secret,
            tls,
            offer_same_host,
            fence,
            device_export,
            max_connections,
            insecure,
        } = options;
        let peers = PeerFilter::new(secret.as_ref(), insecure);
        let listener = listen(addr).map_err(|source| DataServerError::Bind { addr, source })?;
        let local_addr = listener.local_addr().map_err(|source| DataServerError::Bind { addr, source })?;
        let canary = same_host::new_canary();
        // GPU memory is never offered to the same-host path (P would write D's host address space).
        let offer_same_host = offer_same_host && regions.memory() == MemoryKind::Host;
        let host_info = offer_same_host.then(|| HostInfo {
            offered: true,
            pid: std::process::id(),
            host_id: same_host::host_identity().to_string(),
            canary_addr: canary.as_ptr() as u64,
            canary: canary.to_vec(),
            regions: regions.regions().iter().map(|r| (r.base_addr, r.len, r.block_len)).collect(),
        });
        let auth_token = auth_token.filter(|t| !t.is_empty()).map(String::into_bytes);
        let cancel = CancellationToken::new();
        let tls = tls.map(|identity| identity.server_config());
        let shared = Arc::new(Shared {
            regions,
            auth_token,
            secret,
            tls,
            host_info,
            fence,
            device_export,
            cancel: cancel.clone(),
        });
        let tracker = TaskTracker::new();
        let connections = Arc::new(Connections::new(max_connections));
        tracker.spawn(accept_loop(listener, shared, tracker.clone(), connections.clone(), peers));
        tracing::debug!(%local_addr, "tcp data server listening");
        Ok(Self { local_addr, cancel, tracker, connections, _canary: canary })
    }

    /// The address the server listens on (the port P connects to).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The connections being served now.
    pub fn live_connections(&self) -> usize {
        self.connections.lock().len()
    }

    /// Stops accepting, closes every connection and waits (bounded) for the tasks to end.
    pub async fn shutdown(self) {
        self.stop();
        if tokio::time::timeout(SHUTDOWN_TIMEOUT, self.tracker.wait()).await.is_err() {
            tracing::warn!(addr = %self.local_addr, "tcp data server tasks did not stop within {SHUTDOWN_TIMEOUT:?}");
        }
    }
}

impl TcpDataServer {
    fn stop(&self) {
        self.cancel.cancel();
        self.tracker.close();
        self.connections.shut_all();
    }
}

impl Drop for TcpDataServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    // Accepted sockets inherit the receive buffer; a refusal by the OS is not fatal.
    if let Err(e) = socket.set_recv_buffer_size(SOCKET_BUFFER_BYTES) {
        tracing::debug!("cannot enlarge the data socket's receive buffer: {e}");
    }
    socket.bind(addr)?;
    socket.listen(1024)
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    tracker: TaskTracker,
    connections: Arc<Connections>,
    peers: PeerFilter,
) {
    loop {
        let accepted = tokio::select! {
            _ = shared.cancel.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            // Protected mode: closed here (the stream drops), counted and logged once per peer.
            Ok((_stream, peer)) if !peers.admit(Socket::Data, peer) => {}
            Ok((stream, peer)) => {
                if let Err(e) = start_connection(stream, peer, &shared, &tracker, &connections) {
                    tracing::warn!("cannot serve the data connection from {peer}: {e}");
                }
            }
            Err(e) => {
                // Out of file descriptors and the like: back off briefly instead of spinning.
                tracing::warn!("accepting a data connection failed: {e}");
                tokio::select! {
                    _ = shared.cancel.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
        }
    }
}

/// Hands an accepted connection to a thread of its own (see [`connection`]).
fn start_connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    shared: &Arc<Shared>,
    tracker: &TaskTracker,
    connections: &Arc<Connections>,
) -> std::io::Result<()> {
    let stream = stream.into_std()?;
    stream.set_nonblocking(false)?;
    let id = connections.next_id.fetch_add(1, Ordering::Relaxed);
    {
        let mut live = connections.lock();
        if live.len() >= connections.max {
            drop(live);
            // Closed here (the stream drops): no thread, no read. Said once, then every 1,000th.
            let refused = connections.refused.fetch_add(1, Ordering::Relaxed);
            if refused.is_multiple_of(1000) {
                tracing::warn!(
                    %peer,
                    max = connections.max,
                    refused = refused + 1,
                    "data connection closed at accept: the server already serves its most connections (max_connections)"
                );
            }
            return Ok(());
        }
        live.insert(id, stream.try_clone()?);
    }
    if shared.cancel.is_cancelled() {
        // The server stopped between the accept and the registration above.
        connections.lock().remove(&id);
        return Ok(());
    }
    let (shared, connections, running) = (shared.clone(), connections.clone(), tracker.token());
    let span = tracing::debug_span!("tcp_data_connection", %peer);
    let spawned = std::thread::Builder::new().name("pdflow-kv-conn".into()).spawn({
        let connections = connections.clone();
        move || {
            let _running = running;
            let _span = span.enter();
            match connection::serve(&stream, &shared) {
                Ok(()) => tracing::debug!("data connection closed"),
                Err(e) => tracing::warn!("data connection from {peer} closed: {e}"),
            }
            connections.lock().remove(&id);
        }
    });
    if let Err(e) = spawned {
        connections.lock().remove(&id);
        return Err(e);
    }
    Ok(())
}
