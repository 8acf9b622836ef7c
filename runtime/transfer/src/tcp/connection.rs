//! One of P's data connections as D serves it (the receiving half of seed step 29), on a thread
//! of its own: hello and auth, then requests — fence tokens, same-host and device questions,
//! fence holds for P's own (cuda-ipc) writes, batches — until P closes, the connection idles out, or D's server stops.
//!
//! The connection runs on a dedicated thread with blocking reads, not as a task of D's runtime:
//! a batch's bytes are copied straight into D's registered memory by `readv` without occupying a
//! worker of the runtime D's actors run on, and a small batch is answered without the reactor's
//! wake-up hop. After each ack the thread polls for P's next request for a bounded time
//! ([`busy_poll`](super::busy_poll)) before sleeping in `recv`.
//!
//! Every descriptor of a batch is checked against the [`RegionTable`] before any payload byte is
//! read; a batch with one descriptor outside the regions is refused as a whole (nothing written,
//! its payload drained so the connection stays usable). Garbage, oversize headers and wrong auth
//! tokens close the connection.
//!
//! With TLS (the cluster secret's identity, [`pdflow_auth::tls`]) the handshake comes first and
//! authenticates P; the requests then travel through it ([`Link`]): the payload is decrypted and
//! copied into the same checked destinations, and the peeking fast paths are left out (they read
//! the socket, which then carries records, not requests).

use std::collections::VecDeque;
use std::io::{IoSliceMut, Read as _, Write as _};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::blocking_io::{invalid, is_timeout, is_timeout_io, now, Blocking, ReadTimeout};
use super::busy_poll::{self, SPIN_AFTER_ACK};
use super::link::{HandshakeError, Link};
use super::wire::{self, Ack, BatchHeader, HostInfo, Request, WireError};
use crate::fence::{FenceGuard, WriteFence};
use pdflow_auth::{ClusterSecret, Context as AuthContext, Nonce, Refusal, Socket};
use pdflow_kv::memory::RegionTable;

/// How long a new connection may take to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an idle connection is kept between batches (P's pool drops its side sooner).
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// How long one payload read may stall.
const STALL_TIMEOUT: Duration = Duration::from_secs(30);
/// While a batch lands under a fence, how often a stalled read looks whether D revoked it.
const FENCE_CHECK: Duration = Duration::from_millis(5);
/// The most destination slices one `readv` is given (Linux's IOV_MAX).
const MAX_IOVECS: usize = 1024;
/// The most payload bytes drained from a refused batch; beyond that the connection is closed.
const MAX_DRAIN_BYTES: u64 = 4 << 30;
/// How many bytes of P's next requests are peeked at once: a fence and a batch header of up to
/// 60 descriptors (a larger header is read the blocking way).
const PEEK_BYTES: usize = 1024;
/// How long P may hold a fence for its own write (a cuda-ipc launch takes well under 1 ms).
const HOLD_LIMIT: Duration = Duration::from_secs(30);
/// How long a refusal's last ack may take to leave.
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);

/// What every connection of one data server shares.
pub(super) struct Shared {
    pub(super) regions: RegionTable,
    pub(super) auth_token: Option<Vec<u8>>,
    /// The cluster secret: with it, every connection's P must prove it holds it (and D proves it
    /// to P) before D reads anything but the hello.
    pub(super) secret: Option<ClusterSecret>,
    /// TLS on every connection (the secret's identity): the handshake before the hello.
    pub(super) tls: Option<Arc<rustls::ServerConfig>>,
    /// The same-host answer, when offered (its canary is owned by the server).
    pub(super) host_info: Option<HostInfo>,
    /// When set, a batch is written only under an open fence token (no write-after-free).
    pub(super) fence: Option<WriteFence>,
    /// D's device export (GPU KV), answered to [`Request::DeviceExport`]; empty when none.
    pub(super) device_export: Vec<u8>,
    /// Cancelled when the server stops; the server also shuts every socket down to wake reads.
    pub(super) cancel: CancellationToken,
}

/// Why one data connection was closed (logged, never fatal to the server).
#[derive(Debug, thiserror::Error)]
pub(super) enum ConnectionError {
    #[error("bad message: {0}")]
    Wire(#[from] WireError),
    #[error("auth token does not match")]
    Unauthorised,
    #[error("refused: {0}")]
    Refused(Refusal),
    #[error("TLS handshake failed: {0} (is TLS on at P as well? both ends set `tls`)")]
    Tls(HandshakeError),
    #[error("no hello within {0:?}")]
    HelloTimeout(Duration),
    #[error("payload stalled for {0:?}")]
    Stalled(Duration),
    #[error("refused batch declares {0:?} payload bytes, too many to drain")]
    UndrainableBatch(Option<u64>),
    #[error("D closed the pull's fence while its batch was landing (the pull ended): connection dropped")]
    Fenced,
    #[error("the data server is stopping")]
    Stopping,
}

/// Serves one connection until it ends; `Ok` for an orderly end (P closed, idle, server stop).
pub(super) fn serve(stream: &TcpStream, shared: &Shared) -> Result<(), ConnectionError> {
    let result = serve_requests(stream, shared);
    // A read woken by the server's shutdown of the socket is not the connection's fault.
    if shared.cancel.is_cancelled() {
        return Ok(());
    }
    result
}

/// TLS when the server wants it, hello and auth, then P's requests one at a time until the
/// connection ends.
fn serve_requests(stream: &TcpStream, shared: &Shared) -> Result<(), ConnectionError> {
    stream.set_nodelay(true).map_err(WireError::from)?;
    stream.set_write_timeout(Some(STALL_TIMEOUT)).map_err(WireError::from)?;
    let mut timeout = ReadTimeout::new(stream);
    let link = match &shared.tls {
        None => Link::plain(stream),
        Some(config) => {
            timeout.set(HELLO_TIMEOUT)?;
            match Link::accept_tls(stream, config.clone()) {
                Ok(link) => link,
                Err(HandshakeError::Io(e)) if is_timeout_io(&e) => {
                    return Err(ConnectionError::HelloTimeout(HELLO_TIMEOUT))
                }
                Err(HandshakeError::Tls(e)) if pdflow_auth::tls::is_refusal(&e) => {
                    pdflow_auth::refused(Socket::Data, &peer_name(stream), Refusal::BadProof);
                    let _ = stream.shutdown(Shutdown::Both);
                    return Err(ConnectionError::Refused(Refusal::BadProof));
                }
                Err(HandshakeError::Tls(e)) if pdflow_auth::tls::is_plaintext(&e) => {
                    pdflow_auth::refused(Socket::Data, &peer_name(stream), Refusal::PlainTextOnTls);
                    let _ = stream.shutdown(Shutdown::Both);
                    return Err(ConnectionError::Refused(Refusal::PlainTextOnTls));
                }
                Err(e) => {
                    let _ = stream.shutdown(Shutdown::Both);
                    return Err(ConnectionError::Tls(e));
                }
            }
        }
    };
    let mut conn = Conn {
        link,
        shared,
        timeout,
        fence_token: None,
        held: None,
        peeked: [0u8; PEEK_BYTES],
        pending: VecDeque::new(),
    };
    conn.hello()?;
    loop {
        if shared.cancel.is_cancelled() {
            return Err(ConnectionError::Stopping);
        }
        let Some(request) = conn.next_request()? else { return Ok(()) };
        if conn.held.is_some() && request != Request::Release {
            let e = WireError::Io(std::io::Error::other("a request other than release while a fence is held"));
            return Err(refuse_and_close(&mut conn.link, 0, e.into()));
        }
        match request {
            Request::Batch(header) => conn.serve_batch(&header)?,
            Request::Hold { token } => conn.hold(token)?,
            Request::Release => conn.release(),
            Request::Fence { token } => conn.fence_token = (token != 0).then_some(token),
            Request::DeviceExport => conn.answer_device_export()?,
            Request::HostInfo { p_pid } => conn.answer_host_info(p_pid)?,
        }
    }
}

/// One connection's state between P's requests.
struct Conn<'a> {
    link: Link<'a>,
    shared: &'a Shared,
    timeout: ReadTimeout<'a>,
    /// The fence token the batches on this connection currently serve (P names it per plan).
    fence_token: Option<u64>,
    /// A write P makes itself into D's memory (cuda-ipc), counted under its fence token until P
    /// releases it (or the connection ends).
    held: Option<Held>,
    peeked: [u8; PEEK_BYTES],
    /// Requests read ahead from the socket, not served yet.
    pending: VecDeque<Request>,
}

impl Conn<'_> {
    /// P's hello under [`HELLO_TIMEOUT`]: its transfer token checked; with the cluster secret,
    /// D proves it holds it and P must prove it too before anything else is read; then acked.
    fn hello(&mut self) -> Result<(), ConnectionError> {
        self.timeout.set(HELLO_TIMEOUT)?;
        let hello = match now(wire::read_hello(&mut Blocking(&mut self.link))) {
            Err(e) if is_timeout(&e) => return Err(ConnectionError::HelloTimeout(HELLO_TIMEOUT)),
            Err(e) => return Err(refuse_and_close(&mut self.link, 0, e.into())),
            Ok(hello) => hello,
        };
        if let Some(expected) = &self.shared.auth_token {
            if !constant_time_eq(expected, &hello.token) {
                return Err(refuse_and_close(&mut self.link, 0, ConnectionError::Unauthorised));
            }
        }
        if let Some(secret) = &self.shared.secret {
            self.challenge(secret, &hello.nonce)?;
        }
        now(wire::write_ack(&mut Blocking(&mut self.link), &Ack::Ok { batch_id: 0 }))?;
        Ok(())
    }

    /// D's proof over P's nonce and a fresh one of D's, then P's proof over both, checked.
    fn challenge(&mut self, secret: &ClusterSecret, p_nonce: &Nonce) -> Result<(), ConnectionError> {
        let d_nonce = pdflow_auth::nonce();
        let proof = secret.sign(AuthContext::DataServer, &[p_nonce, &d_nonce]);
        self.link.write_all(&wire::encode_challenge(&d_nonce, &proof)).map_err(WireError::from)?;
        let answer = match now(wire::read_proof(&mut Blocking(&mut self.link))) {
            Err(e) if is_timeout(&e) => return Err(ConnectionError::HelloTimeout(HELLO_TIMEOUT)),
            Err(_) => Err(Refusal::Missing),
            Ok(p) => secret.verify(AuthContext::DataClient, &[&d_nonce, p_nonce], &p),
        };
        answer.map_err(|why| {
            pdflow_auth::refused(Socket::Data, &peer_name(self.link.tcp), why);
            refuse_and_close(&mut self.link, 0, ConnectionError::Refused(why))
        })
    }

    /// P's next request; `None` for an orderly end (P closed, idle, or a hold never released).
    fn next_request(&mut self) -> Result<Option<Request>, ConnectionError> {
        // P's next request usually follows an ack at once: poll for it before sleeping, and take
        // every request that is already queued whole in one go (on a plain socket: under TLS
        // the bytes queued are records, read through the link).
        if self.pending.is_empty()
            && busy_poll::readable_within(self.link.tcp.as_raw_fd(), SPIN_AFTER_ACK)
            && !self.link.is_tls()
        {
            match queued_requests(self.link.tcp, &mut self.peeked) {
                Ok(requests) => self.pending.extend(requests),
                Err(e) => return Err(refuse_and_close(&mut self.link, 0, e.into())),
            }
        }
        if let Some(request) = self.pending.pop_front() {
            return Ok(Some(request));
        }
        self.timeout.set(if self.held.is_some() { HOLD_LIMIT } else { IDLE_TIMEOUT })?;
        match now(wire::read_request(&mut Blocking(&mut self.link))) {
            Ok(None) => Ok(None),
            Err(e) if is_timeout(&e) => {
                if let Some(h) = &self.held {
                    tracing::warn!(
                        token = h.token,
                        "P held a fence for {HOLD_LIMIT:?} without releasing it: released, connection closed"
                    );
                }
                Ok(None)
            }
            Err(e) => Err(refuse_and_close(&mut self.link, 0, e.into())),
            Ok(Some(request)) => Ok(Some(request)),
        }
    }

    /// [`Request::Hold`]: fence `token` entered for P's own write, or refused.
    fn hold(&mut self, token: u64) -> Result<(), ConnectionError> {
        let ack = match hold(self.shared.fence.as_ref(), token) {
            Ok(guard) => {
                self.held = Some(Held { token, _guard: guard });
                Ack::Ok { batch_id: 0 }
            }
            Err(reason) => Ack::Refused { batch_id: 0, reason },
        };
        now(wire::write_ack(&mut Blocking(&mut self.link), &ack))?;
        Ok(())
    }

    /// [`Request::Release`]: P's write under the hold has ended.
    fn release(&mut self) {
        if self.held.take().is_none() {
            tracing::debug!("P released a fence it did not hold");
        }
    }

    /// [`Request::DeviceExport`]: D's device export (empty: none).
    fn answer_device_export(&mut self) -> Result<(), ConnectionError> {
        let export = &self.shared.device_export;
        tracing::debug!(offered = !export.is_empty(), "P asked for the device export");
        self.link.write_all(&wire::encode_device_export(export)?).map_err(WireError::from)?;
        Ok(())
    }

    /// [`Request::HostInfo`]: the same-host details, when offered — and only to a peer on this
    /// host (connecting from loopback or from the address it reached): D's pid, canary and
    /// region addresses are of no use to another host, and nothing to tell it.
    fn answer_host_info(&mut self, p_pid: u32) -> Result<(), ConnectionError> {
        let on_this_host = same_host_peer(self.link.tcp);
        let host_info = self.shared.host_info.as_ref().filter(|_| on_this_host);
        tracing::debug!(p_pid, on_this_host, offered = host_info.is_some(), "P asked for the same-host details");
        let answer = wire::encode_host_info(host_info.unwrap_or(&HostInfo::default()))?;
        self.link.write_all(&answer).map_err(WireError::from)?;
        Ok(())
    }

    /// One batch: written into D's memory when admitted, else refused with its payload drained.
    fn serve_batch(&mut self, header: &BatchHeader) -> Result<(), ConnectionError> {
        match self.admit_batch(header) {
            Ok(fence_guard) => self.write_batch(header, fence_guard),
            Err(e) => self.refuse_batch(header, e),
        }
    }

    /// Checks every descriptor before touching the payload, then enters the batch's fence: the
    /// guard held while the payload lands (D's Receiver waits for it before freeing the blocks),
    /// or why the batch is refused.
    fn admit_batch(&self, header: &BatchHeader) -> Result<Option<FenceGuard>, String> {
        let refusal = header
            .descriptors
            .iter()
            .find_map(|&(dst, len)| self.shared.regions.check_host(dst, len).err().map(|e| e.to_string()))
            .or_else(|| overlapping(&header.descriptors));
        if let Some(refusal) = refusal {
            return Err(refusal);
        }
        let Some(fence) = self.shared.fence.as_ref() else { return Ok(None) };
        match self.fence_token.and_then(|t| fence.enter(t)) {
            Some(guard) => Ok(Some(guard)),
            None => Err(match self.fence_token {
                Some(t) => format!("fence {t} is closed: D no longer expects this transfer (its pull ended)"),
                None => "no fence named: this data server only accepts writes for a pull it opened".to_string(),
            }),
        }
    }

    /// An admitted batch's payload read straight into D's memory, then acked.
    fn write_batch(&mut self, header: &BatchHeader, fence_guard: Option<FenceGuard>) -> Result<(), ConnectionError> {
        // SAFETY: each checked by `admit_batch` to lie wholly inside a registered region, and no
        // two overlap (so the slices never alias); D's block pool gives the blocks under transfer
        // to this write alone until it is acked.
        let dsts = header
            .descriptors
            .iter()
            .filter(|&&(_, len)| len > 0)
            .map(|&(dst, len)| unsafe { self.shared.regions.slice_mut(dst, len) })
            .collect::<Result<Vec<&mut [u8]>, _>>()
            .map_err(|e| WireError::Io(invalid(e)))?;
        if self.link.is_tls() {
            read_into_through(&mut self.link, &mut self.timeout, dsts, fence_guard.as_ref(), &self.shared.cancel)?;
        } else {
            read_into(self.link.tcp, &mut self.timeout, dsts, fence_guard.as_ref(), &self.shared.cancel)?;
        }
        drop(fence_guard);
        now(wire::write_ack(&mut Blocking(&mut self.link), &Ack::Ok { batch_id: header.batch_id }))?;
        Ok(())
    }

    /// A refused batch: its payload drained (so the connection stays usable) and the refusal
    /// acked; a payload too large to drain closes the connection.
    fn refuse_batch(&mut self, header: &BatchHeader, e: String) -> Result<(), ConnectionError> {
        let batch_id = header.batch_id;
        let reason = format!("batch {batch_id}: {e}; nothing of the batch was written");
        tracing::warn!("{reason}");
        match header.total_len().filter(|&n| n <= MAX_DRAIN_BYTES) {
            Some(n) => {
                drain(&mut self.link, &mut self.timeout, n)?;
                now(wire::write_ack(&mut Blocking(&mut self.link), &Ack::Refused { batch_id, reason }))?;
                Ok(())
            }
            None => {
                let err = ConnectionError::UndrainableBatch(header.total_len());
                Err(refuse_and_close(&mut self.link, batch_id, err))
            }
        }
    }
}

/// A fence held for P's own write into D's memory ([`Request::Hold`]).
struct Held {
    token: u64,
    /// `None` when D's server has no fence (nothing to count the write under).
    _guard: Option<FenceGuard>,
}

/// Enters fence `token` for a write P makes itself; the refusal's reason when it is not open.
fn hold(fence: Option<&WriteFence>, token: u64) -> Result<Option<FenceGuard>, String> {
    let Some(fence) = fence else { return Ok(None) };
    match fence.enter(token) {
        Some(guard) => Ok(Some(guard)),
        None if token == 0 => Err("no fence named: this data server only accepts writes for a pull it opened".into()),
        None => {
            Err(format!("fence {token} is closed: D no longer expects this transfer (its pull ended); do not write"))
        }
    }
}

/// P's requests that are already queued whole on the socket, up to and including the first one
/// that is not a fence (a batch's payload follows its header): peeked, parsed by the same codec,
/// then consumed with one `recv`. Empty when the first request is not whole yet — its bytes stay
/// queued for the blocking read. A malformed first request is an error; one after a whole
/// request is left for the next round to report.
fn queued_requests(stream: &TcpStream, buf: &mut [u8]) -> Result<Vec<Request>, WireError> {
    let fd = stream.as_raw_fd();
    // SAFETY: `fd` is the socket `stream` owns, open for the call; `buf` is writable for its
    // length. MSG_PEEK consumes nothing, MSG_DONTWAIT never blocks.
    let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    let Ok(n) = usize::try_from(n) else { return Ok(Vec::new()) };
    let mut rest = &buf[..n];
    let mut requests = Vec::new();
    let mut consumed = 0;
    loop {
        match now(wire::read_request(&mut rest)) {
            Ok(Some(request)) => {
                consumed = n - rest.len();
                let fence = matches!(request, Request::Fence { .. } | Request::Release);
                requests.push(request);
                if !fence {
                    break;
                }
            }
            // The peeked bytes ended at a request's boundary.
            Ok(None) => break,
            // The next request is not whole yet: it stays queued.
            Err(WireError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) if requests.is_empty() => return Err(e),
            Err(_) => break,
        }
    }
    if consumed > 0 {
        // SAFETY: as above; the `consumed` bytes were just peeked on a stream only this thread
        // reads, so this returns exactly them without blocking.
        let got = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), consumed, libc::MSG_DONTWAIT) };
        if usize::try_from(got).ok() != Some(consumed) {
            return Err(WireError::Io(std::io::Error::other(format!("read {got} of {consumed} peeked request bytes"))));
        }
    }
    Ok(requests)
}

/// One `readv` that never blocks (`recvmsg` with `MSG_DONTWAIT`): a batch whose payload is already
/// queued lands without touching the socket's timeout.
fn read_vectored_now(stream: &TcpStream, slices: &mut [IoSliceMut<'_>]) -> std::io::Result<usize> {
    // SAFETY: a zeroed msghdr is valid (no name, no control data); `IoSliceMut` is ABI-compatible
    // with `iovec` on Unix, and the slices are writable for their lengths for the whole call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = slices.as_mut_ptr().cast();
    msg.msg_iovlen = slices.len() as _;
    // SAFETY: `stream` owns the open socket for the call; `msg` is valid as set up above.
    let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT) };
    usize::try_from(n).map_err(|_| std::io::Error::last_os_error())
}

/// Why a batch's destinations overlap, if they do: a plan never writes one byte twice, and
/// overlapping destinations would make two live `&mut` slices of the same memory.
fn overlapping(descriptors: &[(u64, u64)]) -> Option<String> {
    let mut ranges: Vec<(u64, u64)> = descriptors.iter().copied().filter(|&(_, len)| len > 0).collect();
    ranges.sort_unstable();
    ranges.windows(2).find(|w| w[0].0.saturating_add(w[0].1) > w[1].0).map(|w| {
        format!(
            "descriptors {:#x}+{} and {:#x}+{} overlap in D's memory (a transfer plan writes each byte once)",
            w[0].0, w[0].1, w[1].0, w[1].1
        )
    })
}

/// Reads exactly the bytes of every slice of `dsts`, in order, straight into them: vectored reads
/// of up to [`MAX_IOVECS`] slices. A read may stall for [`STALL_TIMEOUT`]; under a fence, a
/// stalled read looks every [`FENCE_CHECK`] whether D revoked the batch, and stops if so.
fn read_into(
    stream: &TcpStream,
    timeout: &mut ReadTimeout<'_>,
    mut dsts: Vec<&mut [u8]>,
    fence: Option<&FenceGuard>,
    cancel: &CancellationToken,
) -> Result<(), ConnectionError> {
    let mut slices: Vec<IoSliceMut<'_>> = dsts.iter_mut().map(|d| IoSliceMut::new(d)).collect();
    let mut rest: &mut [IoSliceMut<'_>] = &mut slices;
    let mut progress = Instant::now();
    // The first read takes what is queued without blocking; the timeout is set only when a read
    // has to wait.
    let mut blocking = false;
    while !rest.is_empty() {
        if fence.is_some_and(FenceGuard::is_revoked) {
            return Err(ConnectionError::Fenced);
        }
        let window = rest.len().min(MAX_IOVECS);
        let read = if blocking {
            (&*stream).read_vectored(&mut rest[..window])
        } else {
            read_vectored_now(stream, &mut rest[..window])
        };
        match read {
            Ok(0) => return Err(WireError::Io(std::io::ErrorKind::UnexpectedEof.into()).into()),
            Ok(n) => {
                IoSliceMut::advance_slices(&mut rest, n);
                progress = Instant::now();
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if !blocking && e.kind() == std::io::ErrorKind::WouldBlock => {
                blocking = true;
                timeout.set(if fence.is_some() { FENCE_CHECK } else { STALL_TIMEOUT })?;
            }
            Err(e) if is_timeout_io(&e) => still_waiting(cancel, progress)?,
            Err(e) => return Err(WireError::from(e).into()),
        }
    }
    Ok(())
}

/// A payload read timed out: go on waiting unless the server stops or the payload stalled.
fn still_waiting(cancel: &CancellationToken, progress: Instant) -> Result<(), ConnectionError> {
    if cancel.is_cancelled() {
        return Err(ConnectionError::Stopping);
    }
    if progress.elapsed() >= STALL_TIMEOUT {
        return Err(ConnectionError::Stalled(STALL_TIMEOUT));
    }
    Ok(())
}

/// As [`read_into`], through a TLS link: each record decrypted, then copied into its slices.
fn read_into_through(
    link: &mut Link<'_>,
    timeout: &mut ReadTimeout<'_>,
    dsts: Vec<&mut [u8]>,
    fence: Option<&FenceGuard>,
    cancel: &CancellationToken,
) -> Result<(), ConnectionError> {
    timeout.set(if fence.is_some() { FENCE_CHECK } else { STALL_TIMEOUT })?;
    let mut progress = Instant::now();
    for dst in dsts {
        let mut filled = 0;
        while filled < dst.len() {
            if fence.is_some_and(FenceGuard::is_revoked) {
                return Err(ConnectionError::Fenced);
            }
            match link.read(&mut dst[filled..]) {
                Ok(0) => return Err(WireError::Io(std::io::ErrorKind::UnexpectedEof.into()).into()),
                Ok(n) => {
                    filled += n;
                    progress = Instant::now();
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if is_timeout_io(&e) => still_waiting(cancel, progress)?,
                Err(e) => return Err(WireError::from(e).into()),
            }
        }
    }
    Ok(())
}

/// Reads and discards `n` payload bytes of a refused batch.
fn drain(link: &mut Link<'_>, timeout: &mut ReadTimeout<'_>, mut n: u64) -> Result<(), ConnectionError> {
    timeout.set(STALL_TIMEOUT)?;
    let mut buf = vec![0u8; 64 * 1024];
    while n > 0 {
        let want = buf.len().min(usize::try_from(n).unwrap_or(usize::MAX));
        match link.read_exact(&mut buf[..want]) {
            Err(e) if is_timeout_io(&e) => return Err(ConnectionError::Stalled(STALL_TIMEOUT)),
            r => r.map_err(WireError::from)?,
        }
        n -= want as u64;
    }
    Ok(())
}

/// Tells the peer why (best effort, bounded), closes the write side, and returns the error.
fn refuse_and_close(link: &mut Link<'_>, batch_id: u64, err: ConnectionError) -> ConnectionError {
    let ack = Ack::Refused { batch_id, reason: err.to_string() };
    let _ = link.tcp.set_write_timeout(Some(REFUSAL_WRITE_TIMEOUT));
    let _ = now(wire::write_ack(&mut Blocking(link), &ack));
    link.shutdown_write();
    err
}

/// Whether the peer connected from this host: from a loopback address, or from the very address
/// it reached (the kernel picks that one as the source of a connection to a local address).
fn same_host_peer(stream: &TcpStream) -> bool {
    match (stream.peer_addr(), stream.local_addr()) {
        (Ok(peer), Ok(local)) => peer.ip().is_loopback() || peer.ip() == local.ip(),
        _ => false,
    }
}

/// The peer's address for logs and refusals.
fn peer_name(stream: &TcpStream) -> String {
    stream.peer_addr().map_or_else(|_| "unknown".to_string(), |a| a.to_string())
}

pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod same_host_peer_tests {
    use std::net::{SocketAddr, TcpListener, TcpStream};

    use super::same_host_peer;

    /// The server's end of a connection from `from` (any port) to `to`.
    fn accepted(listener: &TcpListener, from: Option<std::net::IpAddr>, to: SocketAddr) -> TcpStream {
        let client = match from {
            None => TcpStream::connect(to).expect("connects"),
            Some(ip) => {
                let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
                socket.bind(SocketAddr::new(ip, 0)).expect("binds the source address");
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
                rt.block_on(socket.connect(to)).expect("connects").into_std().expect("a std stream")
            }
        };
        let (server, _) = listener.accept().expect("accepts");
        drop(client);
        server
    }

    #[test]
    fn only_a_peer_on_this_host_is_told_the_same_host_details() {
        let ip = match pdflow_testkit::non_loopback_ip() {
            Ok(ip) if ip.is_ipv4() => ip,
            Ok(ip) => {
                return pdflow_testkit::skipped("same-host details to another host", &format!("only {ip} (IPv6)"))
            }
            Err(why) => return pdflow_testkit::skipped("same-host details to another host", &why),
        };
        let listener = TcpListener::bind("0.0.0.0:0").expect("binds");
        let port = listener.local_addr().expect("addr").port();
        let loopback = SocketAddr::from(([127, 0, 0, 1], port));
        assert!(same_host_peer(&accepted(&listener, None, loopback)), "a loopback peer is on this host");
        let own = SocketAddr::new(ip, port);
        assert!(same_host_peer(&accepted(&listener, None, own)), "a peer reaching this host's address from it");
        // From this host's address to loopback: the peer's address is not the one it reached,
        // as for a peer on another host.
        assert!(!same_host_peer(&accepted(&listener, Some(ip), loopback)), "a peer from elsewhere was told");
    }
}
