//! Serving pdflow's HTTP APIs (the proxy's, the bootstrap's, the simulated engine's) in place of
//! `axum::serve`, with what a server facing untrusted clients needs and `axum::serve` lacks: a
//! connection is closed when its request header does not arrive within
//! [`HttpLimits::header_timeout`] or when it sits idle between requests for
//! [`HttpLimits::idle_timeout`]; a request whose body has not arrived in full within
//! [`HttpLimits::body_timeout`] of its header is answered 408 and its connection closed; no more
//! than [`HttpLimits::max_connections`] connections (of them
//! [`HttpLimits::max_connections_per_peer`] from one IP address) are held at once; a
//! connection over a cap is closed as soon as it is accepted. Every such close is counted in
//! `/metrics` (`pdflow_http_connections_closed_total{service,reason}`) and logged once per peer.
//! Before any cap, a peer that [`HttpLimits::peers`] refuses (protected mode: no cluster secret, no
//! `insecure`, and not on loopback) is closed at its accept, counted as a refusal
//! (`pdflow_auth_refusals_total{socket=service,cause="not_loopback"}`) and logged once per peer.
//!
//! HTTP/1.1 only (as before: the workspace builds axum with `http1`). Every request carries
//! axum's `ConnectInfo<SocketAddr>` (the peer), so handlers may extract it. Shutdown is graceful:
//! the listener closes, idle connections close, in-flight requests finish; the caller bounds that
//! with its own deadline and drops (aborts) the serving future, which closes every connection it
//! still holds (they are its tasks, in a `JoinSet`). Owns no step of the timeline.
//!
//! # Layout
//! - this file — [`HttpLimits`], [`serve`] (the accept loop, its peer filter and its caps), the
//!   count and the log of every close;
//! - [`connection`] — one connection: hyper's HTTP/1 state machine watched for its header and idle
//!   deadlines;
//! - [`body_deadline`] — a request body that fails once its deadline passes, and the 408 that
//!   replaces the answer to such a request.

mod body_deadline;
mod connection;
#[cfg(test)]
mod protected_tests;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use axum::Router;
use pdflow_auth::{PeerFilter, Socket};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How long a client has to send a complete request header: from the moment its connection is
/// accepted (its first request), or from the first byte of a later request on a kept-alive one.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a kept-alive connection may wait, with no request in flight, for its next request.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a request's body may take to arrive in full, from its header: 2 MiB (the engines'
/// and the proxy's largest body) at 70 KB/s.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// The connection cap when the process's open-file limit cannot be read.
pub const FALLBACK_MAX_CONNECTIONS: usize = 512;
/// The connection cap is never set above this by default, whatever the open-file limit.
pub const MAX_DEFAULT_CONNECTIONS: usize = 8192;
/// How long the accept loop pauses after an error other than one connection's (out of file
/// descriptors, most often), so that it does not spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_secs(1);
/// Peers whose closes were already logged; past this many, closes are counted but not logged.
const MAX_LOGGED_PEERS: usize = 4096;

/// What an HTTP server lets its clients hold. [`HttpLimits::default`] is safe for a process whose
/// open-file limit is as low as 1,024.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// A connection's request header must be complete within this ([`DEFAULT_HEADER_TIMEOUT`]).
    pub header_timeout: Duration,
    /// A request's body must arrive in full within this of its header ([`DEFAULT_BODY_TIMEOUT`]);
    /// past it, the request is answered 408 and its connection closed.
    pub body_timeout: Duration,
    /// A kept-alive connection with no request in flight is closed after this
    /// ([`DEFAULT_IDLE_TIMEOUT`]).
    pub idle_timeout: Duration,
    /// Connections held at once; a connection accepted over it is closed at once.
    pub max_connections: usize,
    /// Connections held at once from one IP address; a connection over it is closed at once.
    pub max_connections_per_peer: usize,
    /// Which peers are served at all ([`PeerFilter::new`] over the process's secret and its
    /// `insecure` opt-out); the default, [`PeerFilter::LoopbackOnly`], serves loopback only.
    pub peers: PeerFilter,
}

impl Default for HttpLimits {
    /// Half the process's open-file limit (at most [`MAX_DEFAULT_CONNECTIONS`]; 512 under the
    /// common limit of 1,024) for connections, so that the rest stays for the process's own
    /// sockets and files (the proxy opens two upstream connections per request); three quarters
    /// of that for one peer, so that a proxy (or a load balancer) funnelling every request from one
    /// address is served while one peer still cannot lock every other one out.
    fn default() -> Self {
        Self::for_open_file_limit(open_file_limit())
    }
}

impl HttpLimits {
    /// The defaults for a process whose open-file limit is `open_files` (`None`: unknown), with
    /// the limits the operator set for the process (`--limit http.…`,
    /// [`pdflow_auth::limits::install`]) in their place.
    fn for_open_file_limit(open_files: Option<usize>) -> Self {
        let max_connections =
            open_files.map(|limit| (limit / 2).clamp(1, MAX_DEFAULT_CONNECTIONS)).unwrap_or(FALLBACK_MAX_CONNECTIONS);
        let set = pdflow_auth::limits::process();
        let max_connections = set.http_max_connections.unwrap_or(max_connections);
        Self {
            header_timeout: set.http_header_timeout.unwrap_or(DEFAULT_HEADER_TIMEOUT),
            body_timeout: set.http_body_timeout.unwrap_or(DEFAULT_BODY_TIMEOUT),
            idle_timeout: set.http_idle_timeout.unwrap_or(DEFAULT_IDLE_TIMEOUT),
            max_connections,
            max_connections_per_peer: set.http_max_connections_per_peer.unwrap_or((max_connections * 3 / 4).max(1)),
            peers: PeerFilter::default(),
        }
    }

    /// The defaults, serving the peers `peers` lets in.
    pub fn serving(peers: PeerFilter) -> Self {
        Self { peers, ..Self::default() }
    }
}

/// The process's soft open-file limit (`ulimit -n`; `usize::MAX` when unlimited), if it can be read.
#[cfg(unix)]
fn open_file_limit() -> Option<usize> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit only writes the struct it is given, which lives on this stack frame.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    (rc == 0).then(|| usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX))
}

#[cfg(not(unix))]
fn open_file_limit() -> Option<usize> {
    None
}

/// Why the server closed a connection on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Closed {
    /// Accepted while [`HttpLimits::max_connections`] were held.
    ServerFull,
    /// Accepted while [`HttpLimits::max_connections_per_peer`] were held from its address.
    PeerFull,
    /// Its request header was not complete within [`HttpLimits::header_timeout`].
    HeaderTimeout,
    /// Kept alive with no request for [`HttpLimits::idle_timeout`].
    IdleTimeout,
    /// A request's body did not arrive in full within [`HttpLimits::body_timeout`].
    BodyTimeout,
}

impl Closed {
    /// The `reason` label in `/metrics`.
    pub fn label(self) -> &'static str {
        match self {
            Closed::ServerFull => "server_full",
            Closed::PeerFull => "peer_full",
            Closed::HeaderTimeout => "header_timeout",
            Closed::IdleTimeout => "idle_timeout",
            Closed::BodyTimeout => "body_timeout",
        }
    }

    /// What the log says about it, and what to do if it is a legitimate client.
    fn explain(self) -> &'static str {
        match self {
            Closed::ServerFull => {
                "connection closed at once: the server holds its maximum of connections (raise the open-file limit, `ulimit -n`, to raise it)"
            }
            Closed::PeerFull => {
                "connection closed at once: this address holds its maximum of connections (a client opening one connection per request should reuse them)"
            }
            Closed::HeaderTimeout => "connection closed: its request header did not arrive in time",
            Closed::IdleTimeout => "kept-alive connection closed after sitting idle",
            Closed::BodyTimeout => "request answered 408 and its connection closed: its body did not arrive in time",
        }
    }
}

/// (service, reason, peer) already logged.
type LoggedPeers = HashSet<(&'static str, Closed, IpAddr)>;

/// Counts a close by `service`'s server in `/metrics` and logs it the first time this peer's
/// connection is closed for this reason (an idle close, which well-behaved clients see too, is
/// logged at debug level).
fn note_closed(service: &'static str, peer: IpAddr, why: Closed) {
    pdflow_observability::metrics::global().count_http_close(service, why.label());
    static LOGGED: OnceLock<Mutex<LoggedPeers>> = OnceLock::new();
    let mut logged = LOGGED.get_or_init(Default::default).lock().unwrap_or_else(PoisonError::into_inner);
    if logged.len() < MAX_LOGGED_PEERS && logged.insert((service, why, peer)) {
        let reason = why.label();
        if why == Closed::IdleTimeout {
            tracing::debug!(service, %peer, reason, "{} (logged once per peer)", why.explain());
        } else {
            tracing::warn!(service, %peer, reason, "{} (logged once per peer)", why.explain());
        }
    }
}

/// The connections held, in total and per peer address.
#[derive(Default)]
struct Held {
    total: usize,
    per_peer: HashMap<IpAddr, usize>,
}

/// One held connection's place in [`Held`], given back when its task ends (however it ends).
struct Admitted {
    held: Arc<Mutex<Held>>,
    peer: IpAddr,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.total = held.total.saturating_sub(1);
        if let Some(n) = held.per_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                held.per_peer.remove(&self.peer);
            }
        }
    }
}

/// Takes a place for a connection from `peer`, or says which cap refuses it.
fn admit(held: &Arc<Mutex<Held>>, peer: IpAddr, limits: &HttpLimits) -> Result<Admitted, Closed> {
    let mut h = held.lock().unwrap_or_else(PoisonError::into_inner);
    let of_peer = h.per_peer.get(&peer).copied().unwrap_or(0);
    if of_peer >= limits.max_connections_per_peer {
        return Err(Closed::PeerFull);
    }
    if h.total >= limits.max_connections {
        return Err(Closed::ServerFull);
    }
    h.total += 1;
    *h.per_peer.entry(peer).or_insert(0) += 1;
    Ok(Admitted { held: held.clone(), peer })
}

/// Serves `router` on `listener` under `limits` until `shutdown` is cancelled, then stops
/// accepting and returns once every connection has finished its request in flight. `service` is
/// the server's `service` label in `/metrics` (`proxy`, `bootstrap`, `engine`). Dropping the
/// returned future closes every connection at once.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    service: &'static str,
    limits: HttpLimits,
    shutdown: CancellationToken,
) {
    let held = Arc::new(Mutex::new(Held::default()));
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            Some(ended) = connections.join_next(), if !connections.is_empty() => log_panic(service, ended),
            accepted = listener.accept() => match accepted {
                // Protected mode: closed at once (the stream drops), counted and logged once per peer.
                Ok((_stream, peer)) if !limits.peers.admit(refusal_socket(service), peer) => {}
                Ok((stream, peer)) => {
                    // Answers go out as written: a streamed token is not held back by Nagle's
                    // algorithm until the client's delayed ACK (~40 ms) of the headers before it.
                    if let Err(e) = stream.set_nodelay(true) {
                        tracing::debug!(service, error = %e, "cannot set TCP_NODELAY on an accepted connection");
                    }
                    let ip = peer.ip().to_canonical();
                    match admit(&held, ip, &limits) {
                        Ok(admitted) => {
                            let connection = connection::Connection {
                                router: router.clone(),
                                peer,
                                service,
                                limits,
                                shutdown: shutdown.clone(),
                            };
                            connections.spawn(connection.run(stream, admitted));
                        }
                        Err(why) => refuse(stream, service, ip, why),
                    }
                }
                Err(e) if is_connection_error(&e) => {}
                Err(e) => {
                    tracing::error!(
                        service,
                        error = %e,
                        "cannot accept HTTP connections; retrying in {ACCEPT_ERROR_PAUSE:?} (if the error is \"too many open files\", raise the open-file limit, `ulimit -n`)"
                    );
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(ACCEPT_ERROR_PAUSE) => {}
                    }
                }
            },
        }
    }
    drop(listener);
    while let Some(ended) = connections.join_next().await {
        log_panic(service, ended);
    }
}

/// The socket a refusal by `service`'s server is counted on (`pdflow_auth_refusals_total`).
fn refusal_socket(service: &'static str) -> Socket {
    match service {
        "bootstrap" => Socket::Bootstrap,
        "proxy" => Socket::Proxy,
        _ => Socket::Engine,
    }
}

/// Logs a connection task that panicked (one that was aborted ended as asked).
fn log_panic(service: &'static str, ended: Result<(), tokio::task::JoinError>) {
    if let Err(e) = ended {
        if e.is_panic() {
            tracing::warn!(service, error = %e, "an HTTP connection's task panicked");
        }
    }
}

/// Closes a connection over a cap at once (it never reaches HTTP), counted and logged.
fn refuse(stream: TcpStream, service: &'static str, peer: IpAddr, why: Closed) {
    drop(stream);
    note_closed(service, peer, why);
}

/// An accept error that concerns one connection only (it went away before it was accepted).
fn is_connection_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}
