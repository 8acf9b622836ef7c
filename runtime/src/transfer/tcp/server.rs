//! D's side of the `tcp` backend: [`TcpDataServer`] accepts P's data connections and writes each
//! payload straight into D's registered memory (the receiving half of seed step 29).
//!
//! Every descriptor of a batch is checked against the [`RegionTable`] before any payload byte is
//! read; a batch with one descriptor outside the regions is refused as a whole (nothing written,
//! its payload drained so the connection stays usable). Garbage, oversize headers and wrong auth
//! tokens close the connection; the server keeps serving the others. It owns its accept loop and
//! connection tasks: they stop when the server is shut down or dropped.
//!
//! Payloads are read with vectored reads (`readv`, up to 1,024 destination slices a call), so a
//! fragmented plan of 64 KiB descriptors costs no more system calls than a coalesced one.
//!
//! After the hello, P may ask for the same-host details (see [`wire::HostInfo`]): unless started
//! with `offer_same_host = false`, the server answers with its pid, host identity, a random canary
//! (which P reads back through the kernel to prove the pid is this process) and its region table.

use std::io::IoSliceMut;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use super::wire::{self, Ack, HostInfo, Request, WireError};
use super::SOCKET_BUFFER_BYTES;
use crate::memory::RegionTable;
use crate::transfer::fence::WriteFence;
use crate::transfer::same_host;

/// How long a new connection may take to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an idle connection is kept between batches (P's pool drops its side sooner).
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// How long one payload chunk may stall.
const STALL_TIMEOUT: Duration = Duration::from_secs(30);
/// The most destination slices one `readv` is given (Linux's IOV_MAX).
const MAX_IOVECS: usize = 1024;
/// The most payload bytes drained from a refused batch; beyond that the connection is closed.
const MAX_DRAIN_BYTES: u64 = 4 << 30;
/// How long `shutdown` waits for connection tasks to stop.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the data server could not start.
#[derive(Debug, thiserror::Error)]
pub enum DataServerError {
    #[error("cannot listen for KV data on {addr}: {source} (is the port free and the address local?)")]
    Bind { addr: SocketAddr, source: std::io::Error },
}

/// Why one data connection was closed (logged, never fatal to the server).
#[derive(Debug, thiserror::Error)]
enum ConnectionError {
    #[error("bad message: {0}")]
    Wire(#[from] WireError),
    #[error("auth token does not match")]
    Unauthorised,
    #[error("no hello within {0:?}")]
    HelloTimeout(Duration),
    #[error("payload stalled for {0:?}")]
    Stalled(Duration),
    #[error("refused batch declares {0:?} payload bytes, too many to drain")]
    UndrainableBatch(Option<u64>),
    #[error("D closed the pull's fence while its batch was landing (the pull ended): connection dropped")]
    Fenced,
}

struct Shared {
    regions: RegionTable,
    auth_token: Option<Vec<u8>>,
    /// The same-host answer, when offered; its canary lives in `_canary`.
    host_info: Option<HostInfo>,
    _canary: Box<[u8]>,
    /// When set, a batch is written only under an open fence token (no write-after-free).
    fence: Option<WriteFence>,
}

/// D's data server. Dropping it (or [`TcpDataServer::shutdown`]) stops every task it started.
#[derive(Debug)]
pub struct TcpDataServer {
    local_addr: SocketAddr,
    cancel: CancellationToken,
    tracker: TaskTracker,
}

impl TcpDataServer {
    /// Listens on `addr` (port 0 picks a free one) and serves writes into `regions`. With
    /// `auth_token`, connections must present the same token.
    /// The server offers the same-host path (see [`TcpDataServer::bind_with`]).
    pub async fn bind(addr: SocketAddr, regions: RegionTable, auth_token: Option<String>) -> Result<Self, DataServerError> {
        Self::bind_with(addr, regions, auth_token, true).await
    }

    /// As [`TcpDataServer::bind`]; with `offer_same_host = false` the server tells P that the
    /// same-host path is not offered, so P always writes over TCP.
    pub async fn bind_with(addr: SocketAddr, regions: RegionTable, auth_token: Option<String>, offer_same_host: bool) -> Result<Self, DataServerError> {
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
        let listener = listen(addr).map_err(|source| DataServerError::Bind { addr, source })?;
        let local_addr = listener.local_addr().map_err(|source| DataServerError::Bind { addr, source })?;
        let canary = same_host::new_canary();
        let host_info = offer_same_host.then(|| HostInfo {
            offered: true,
            pid: std::process::id(),
            host_id: same_host::host_identity().to_string(),
            canary_addr: canary.as_ptr() as u64,
            canary: canary.to_vec(),
            regions: regions.regions().iter().map(|r| (r.base_addr, r.len, r.block_len)).collect(),
        });
        let auth_token = auth_token.filter(|t| !t.is_empty()).map(String::into_bytes);
        let shared = Arc::new(Shared { regions, auth_token, host_info, _canary: canary, fence });
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        tracker.spawn(accept_loop(listener, shared, cancel.clone(), tracker.clone()));
        tracing::debug!(%local_addr, "tcp data server listening");
        Ok(Self { local_addr, cancel, tracker })
    }

    /// The address the server listens on (the port P connects to).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, closes every connection and waits (bounded) for the tasks to end.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        self.tracker.close();
        if tokio::time::timeout(SHUTDOWN_TIMEOUT, self.tracker.wait()).await.is_err() {
            tracing::warn!(addr = %self.local_addr, "tcp data server tasks did not stop within {SHUTDOWN_TIMEOUT:?}");
        }
    }
}

impl Drop for TcpDataServer {
    fn drop(&mut self) {
        self.cancel.cancel();
        self.tracker.close();
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

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, cancel: CancellationToken, tracker: TaskTracker) {
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let (shared, cancel) = (shared.clone(), cancel.clone());
                let span = tracing::debug_span!("tcp_data_connection", %peer);
                tracker.spawn(
                    async move {
                        tokio::select! {
                            _ = cancel.cancelled() => {}
                            result = serve_connection(stream, &shared) => match result {
                                Ok(()) => tracing::debug!("data connection closed"),
                                Err(e) => tracing::warn!("data connection from {peer} closed: {e}"),
                            },
                        }
                    }
                    .instrument(span),
                );
            }
            Err(e) => {
                // Out of file descriptors and the like: back off briefly instead of spinning.
                tracing::warn!("accepting a data connection failed: {e}");
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
        }
    }
}

async fn serve_connection(mut stream: TcpStream, shared: &Shared) -> Result<(), ConnectionError> {
    stream.set_nodelay(true).map_err(WireError::from)?;
    let token = match tokio::time::timeout(HELLO_TIMEOUT, wire::read_hello(&mut stream)).await {
        Err(_) => return Err(ConnectionError::HelloTimeout(HELLO_TIMEOUT)),
        Ok(Err(e)) => return Err(refuse_and_close(&mut stream, 0, e.into()).await),
        Ok(Ok(token)) => token,
    };
    if let Some(expected) = &shared.auth_token {
        if !constant_time_eq(expected, &token) {
            return Err(refuse_and_close(&mut stream, 0, ConnectionError::Unauthorised).await);
        }
    }
    wire::write_ack(&mut stream, &Ack::Ok { batch_id: 0 }).await?;

    // The fence token the batches on this connection currently serve (P names it per plan).
    let mut fence_token: Option<u64> = None;
    loop {
        let header = match tokio::time::timeout(IDLE_TIMEOUT, wire::read_request(&mut stream)).await {
            Err(_) | Ok(Ok(None)) => return Ok(()),
            Ok(Err(e)) => return Err(refuse_and_close(&mut stream, 0, e.into()).await),
            Ok(Ok(Some(Request::Batch(header)))) => header,
            Ok(Ok(Some(Request::Fence { token }))) => {
                fence_token = (token != 0).then_some(token);
                continue;
            }
            Ok(Ok(Some(Request::HostInfo { p_pid }))) => {
                tracing::debug!(p_pid, offered = shared.host_info.is_some(), "P asked for the same-host details");
                let answer = wire::encode_host_info(shared.host_info.as_ref().unwrap_or(&HostInfo::default()))?;
                stream.write_all(&answer).await.map_err(WireError::from)?;
                continue;
            }
        };
        let batch_id = header.batch_id;
        // Check every descriptor before touching the payload.
        let refusal = header
            .descriptors
            .iter()
            .find_map(|&(dst, len)| shared.regions.check(dst, len).err().map(|e| e.to_string()))
            .or_else(|| overlapping(&header.descriptors));
        // Held while the payload lands: D's Receiver waits for it before freeing the blocks.
        let mut fence_guard = None;
        let refusal = refusal.or_else(|| {
            let fence = shared.fence.as_ref()?;
            match fence_token.and_then(|t| fence.enter(t)) {
                Some(guard) => {
                    fence_guard = Some(guard);
                    None
                }
                None => Some(match fence_token {
                    Some(t) => format!("fence {t} is closed: D no longer expects this transfer (its pull ended)"),
                    None => "no fence named: this data server only accepts writes for a pull it opened".to_string(),
                }),
            }
        });
        match refusal {
            None => {
                // SAFETY: each checked above to lie wholly inside a registered region, and no two
                // overlap (so the slices never alias); D's block pool gives the blocks under
                // transfer to this write alone until it is acked.
                let dsts = header
                    .descriptors
                    .iter()
                    .filter(|&&(_, len)| len > 0)
                    .map(|&(dst, len)| unsafe { shared.regions.slice_mut(dst, len) })
                    .collect::<Result<Vec<&mut [u8]>, _>>()
                    .map_err(|e| WireError::Io(invalid(e)))?;
                match &fence_guard {
                    // D closed the pull's token while its bytes were landing (it gave up at a
                    // deadline): stop here and drop the connection; nothing more lands.
                    Some(guard) => tokio::select! {
                        read = read_into(&mut stream, dsts) => read?,
                        () = guard.revoked() => return Err(ConnectionError::Fenced),
                    },
                    None => read_into(&mut stream, dsts).await?,
                }
                drop(fence_guard);
                wire::write_ack(&mut stream, &Ack::Ok { batch_id }).await?;
            }
            Some(e) => {
                let reason = format!("batch {batch_id}: {e}; nothing of the batch was written");
                tracing::warn!("{reason}");
                match header.total_len().filter(|&n| n <= MAX_DRAIN_BYTES) {
                    Some(n) => {
                        drain(&mut stream, n).await?;
                        wire::write_ack(&mut stream, &Ack::Refused { batch_id, reason }).await?;
                    }
                    None => {
                        let err = ConnectionError::UndrainableBatch(header.total_len());
                        return Err(refuse_and_close(&mut stream, batch_id, err).await);
                    }
                }
            }
        }
    }
}

/// Why a batch's destinations overlap, if they do: a plan never writes one byte twice, and
/// overlapping destinations would make two live `&mut` slices of the same memory.
fn overlapping(descriptors: &[(u64, u64)]) -> Option<String> {
    let mut ranges: Vec<(u64, u64)> = descriptors.iter().copied().filter(|&(_, len)| len > 0).collect();
    ranges.sort_unstable();
    ranges.windows(2).find(|w| w[0].0.saturating_add(w[0].1) > w[1].0).map(|w| {
        format!("descriptors {:#x}+{} and {:#x}+{} overlap in D's memory (a transfer plan writes each byte once)", w[0].0, w[0].1, w[1].0, w[1].1)
    })
}

/// Reads exactly the bytes of every slice of `dsts`, in order, straight into them: vectored reads
/// of up to [`MAX_IOVECS`] slices, each wait for data under the stall deadline.
async fn read_into(stream: &mut TcpStream, mut dsts: Vec<&mut [u8]>) -> Result<(), ConnectionError> {
    let mut slices: Vec<IoSliceMut<'_>> = dsts.iter_mut().map(|d| IoSliceMut::new(d)).collect();
    let mut rest: &mut [IoSliceMut<'_>] = &mut slices;
    while !rest.is_empty() {
        match tokio::time::timeout(STALL_TIMEOUT, stream.readable()).await {
            Err(_) => return Err(ConnectionError::Stalled(STALL_TIMEOUT)),
            Ok(r) => r.map_err(WireError::from)?,
        }
        let window = rest.len().min(MAX_IOVECS);
        match stream.try_read_vectored(&mut rest[..window]) {
            Ok(0) => return Err(WireError::Io(std::io::ErrorKind::UnexpectedEof.into()).into()),
            Ok(n) => IoSliceMut::advance_slices(&mut rest, n),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(WireError::from(e).into()),
        }
    }
    Ok(())
}

/// Reads and discards `n` payload bytes of a refused batch.
async fn drain(stream: &mut TcpStream, mut n: u64) -> Result<(), ConnectionError> {
    let mut buf = vec![0u8; 64 * 1024];
    while n > 0 {
        let want = buf.len().min(usize::try_from(n).unwrap_or(usize::MAX));
        match tokio::time::timeout(STALL_TIMEOUT, stream.read_exact(&mut buf[..want])).await {
            Err(_) => return Err(ConnectionError::Stalled(STALL_TIMEOUT)),
            Ok(r) => r.map_err(WireError::from)?,
        };
        n -= want as u64;
    }
    Ok(())
}

/// Tells the peer why (best effort, bounded), closes the write side, and returns the error.
async fn refuse_and_close(stream: &mut TcpStream, batch_id: u64, err: ConnectionError) -> ConnectionError {
    let ack = Ack::Refused { batch_id, reason: err.to_string() };
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = wire::write_ack(stream, &ack).await;
        let _ = stream.shutdown().await;
    })
    .await;
    err
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn invalid(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
}
