//! pdflow patch: bounds on what a peer can make a socket hold, set with
//! [`SocketOptions::limits`](crate::SocketOptions::limits) before the socket is constructed.
//!
//! - bytes and frames of one multipart message, checked by the codec as each frame header arrives,
//!   before anything is reserved for the frame ([`crate::codec::ZmqCodec`]);
//! - accepted tcp connections, per socket and per peer IP: one past either cap is closed at once,
//!   before its TLS or ZMTP handshake ([`ConnectionSlots`], taken in `transport/tcp.rs`);
//! - a handshake deadline (ZMTP greeting and READY, from the connection's framing) and an idle
//!   deadline (no complete message for that long), kept by the connection's reader
//!   ([`ReadDeadline`], in [`crate::codec::ZmqFramedRead`]);
//! - which peers may connect at all: a predicate over the peer's IP address
//!   ([`SocketOptions::accept_peers`](crate::SocketOptions::accept_peers), e.g. loopback only when
//!   pdflow runs without a cluster secret); a peer it refuses is closed at accept, before the caps
//!   are counted and before its TLS or ZMTP handshake ([`LimitKind::PeerNotAllowed`]).
//!
//! Every limit is off by default (upstream's behaviour). Each time one is hit, the socket's hook
//! ([`SocketOptions::on_limit`](crate::SocketOptions::on_limit)) is called with a [`LimitHit`], so
//! that the socket's owner can count and log it; the connection is then closed.

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

/// Limits of one socket (every field `None`: unlimited).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SocketLimits {
    /// Most bytes of one multipart message (its frames' bodies together); a command frame is
    /// held to it as well.
    pub max_message_len: Option<usize>,
    /// Most frames of one multipart message.
    pub max_message_frames: Option<usize>,
    /// Most accepted tcp connections open at once (handshakes included).
    pub max_connections: Option<usize>,
    /// Most accepted tcp connections open at once from one peer IP address.
    pub max_connections_per_ip: Option<usize>,
    /// How long a connection may take over its ZMTP greeting and READY (after TLS, if any).
    pub handshake_timeout: Option<Duration>,
    /// How long a connection may go without completing a message.
    pub idle_timeout: Option<Duration>,
}

/// Which limit a peer hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LimitKind {
    MessageTooLarge,
    TooManyFrames,
    /// The socket's connection cap.
    TooManyConnections,
    /// The per-IP connection cap.
    TooManyConnectionsFromPeer,
    HandshakeTimeout,
    IdleTimeout,
    /// The socket's peer predicate refused the peer's address.
    PeerNotAllowed,
}

impl fmt::Display for LimitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LimitKind::MessageTooLarge => "a message passed the socket's byte limit",
            LimitKind::TooManyFrames => "a message passed the socket's frame limit",
            LimitKind::TooManyConnections => "the socket holds its most connections",
            LimitKind::TooManyConnectionsFromPeer => {
                "the socket holds its most connections from this peer"
            }
            LimitKind::HandshakeTimeout => "the peer did not finish its handshake in time",
            LimitKind::IdleTimeout => "the peer completed no message within the idle timeout",
            LimitKind::PeerNotAllowed => "the socket does not accept connections from this address",
        })
    }
}

/// A limit hit by a peer (given to the socket's hook).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitHit {
    pub kind: LimitKind,
    /// The peer's address, where the transport has one (tcp).
    pub peer: Option<SocketAddr>,
}

/// The socket owner's hook, called once per limit hit (from the socket's tasks: keep it short).
pub type LimitHook = Arc<dyn Fn(&LimitHit) + Send + Sync>;

/// Whether a peer at this IP address may connect (called at each accept: keep it short).
pub type PeerPredicate = Arc<dyn Fn(IpAddr) -> bool + Send + Sync>;

/// Whether `options` let a connection from `peer` in; a refused one is reported to the hook (the
/// caller closes it).
pub(crate) fn peer_allowed(options: &crate::SocketOptions, peer: SocketAddr) -> bool {
    let allowed = options
        .accept_peer
        .as_ref()
        .is_none_or(|allowed| allowed(peer.ip()));
    if !allowed {
        report(
            options.on_limit.as_ref(),
            LimitKind::PeerNotAllowed,
            Some(peer),
        );
    }
    allowed
}

/// Calls the socket's hook, if any.
pub(crate) fn report(hook: Option<&LimitHook>, kind: LimitKind, peer: Option<SocketAddr>) {
    log::debug!("peer {peer:?} refused: {kind}");
    if let Some(hook) = hook {
        hook(&LimitHit { kind, peer });
    }
}

/// The accepted connections of one socket, counted against its caps.
#[derive(Debug, Default)]
pub(crate) struct ConnectionSlots {
    open: Mutex<(usize, HashMap<IpAddr, usize>)>,
}

impl ConnectionSlots {
    /// A slot for a connection from `peer`, or the cap it would pass.
    pub(crate) fn acquire(
        self: &Arc<Self>,
        limits: &SocketLimits,
        peer: SocketAddr,
    ) -> Result<SlotGuard, LimitKind> {
        let mut open = self.open.lock();
        let (total, per_ip) = &mut *open;
        if limits.max_connections.is_some_and(|max| *total >= max) {
            return Err(LimitKind::TooManyConnections);
        }
        let from_peer = per_ip.entry(peer.ip()).or_default();
        if limits
            .max_connections_per_ip
            .is_some_and(|max| *from_peer >= max)
        {
            if *from_peer == 0 {
                per_ip.remove(&peer.ip());
            }
            return Err(LimitKind::TooManyConnectionsFromPeer);
        }
        *from_peer += 1;
        *total += 1;
        Ok(SlotGuard {
            slots: Arc::clone(self),
            ip: peer.ip(),
        })
    }
}

/// One accepted connection's slot: given back when the connection's stream is dropped.
#[derive(Debug)]
pub(crate) struct SlotGuard {
    slots: Arc<ConnectionSlots>,
    ip: IpAddr,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let mut open = self.slots.open.lock();
        let (total, per_ip) = &mut *open;
        *total = total.saturating_sub(1);
        if let Some(from_peer) = per_ip.get_mut(&self.ip) {
            *from_peer = from_peer.saturating_sub(1);
            if *from_peer == 0 {
                per_ip.remove(&self.ip);
            }
        }
    }
}

/// A stream that holds its connection's slot for as long as it lives (both halves, once split).
#[cfg(feature = "tokio-runtime")]
pub(crate) struct Slotted<T> {
    pub(crate) inner: T,
    pub(crate) _slot: SlotGuard,
}

#[cfg(feature = "tokio-runtime")]
impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Slotted<T> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

#[cfg(feature = "tokio-runtime")]
impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Slotted<T> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A connection reader's deadline: the handshake's until the peer's first command or message,
/// then the idle timeout's, pushed back by each complete message. Only with tokio (the other
/// runtimes keep no deadline).
pub(crate) struct ReadDeadline {
    idle: Option<Duration>,
    /// Which limit the running deadline is.
    kind: LimitKind,
    #[cfg(feature = "tokio-runtime")]
    sleep: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl ReadDeadline {
    pub(crate) fn new(limits: &SocketLimits) -> Self {
        let (first, kind) = match (limits.handshake_timeout, limits.idle_timeout) {
            (Some(handshake), _) => (Some(handshake), LimitKind::HandshakeTimeout),
            (None, idle) => (idle, LimitKind::IdleTimeout),
        };
        #[cfg(not(feature = "tokio-runtime"))]
        let _ = first;
        Self {
            idle: limits.idle_timeout,
            kind,
            #[cfg(feature = "tokio-runtime")]
            sleep: first.map(|after| Box::pin(tokio::time::sleep(after))),
        }
    }

    /// The peer completed a command or a message: the idle deadline starts again.
    pub(crate) fn on_progress(&mut self) {
        self.kind = LimitKind::IdleTimeout;
        #[cfg(feature = "tokio-runtime")]
        match (self.idle, self.sleep.as_mut()) {
            (Some(idle), Some(sleep)) => sleep.as_mut().reset(tokio::time::Instant::now() + idle),
            (Some(idle), None) => self.sleep = Some(Box::pin(tokio::time::sleep(idle))),
            (None, _) => self.sleep = None,
        }
    }

    /// The limit whose deadline has passed, if it has (registers `cx` otherwise).
    pub(crate) fn poll_expired(&mut self, cx: &mut std::task::Context<'_>) -> Option<LimitKind> {
        #[cfg(feature = "tokio-runtime")]
        if let Some(sleep) = self.sleep.as_mut() {
            if std::future::Future::poll(sleep.as_mut(), cx).is_ready() {
                self.sleep = None;
                return Some(self.kind);
            }
        }
        #[cfg(not(feature = "tokio-runtime"))]
        let _ = cx;
        None
    }
}
