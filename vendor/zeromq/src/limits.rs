//! pdflow patch: bounds on what a peer can make a socket hold, set with
//! [`SocketOptions::limits`](crate::SocketOptions::limits) before the socket is constructed.
//!
//! - bytes and frames of one multipart message, checked by the codec as each frame header arrives,
//!   before anything is reserved for the frame ([`crate::codec::ZmqCodec`]);
//! - bytes of unfinished messages across every connection of the socket: past a small allowance
//!   of its own, a connection's unfinished message draws on one budget shared by the socket,
//!   charged at each frame header before the frame is read and given back when the message
//!   completes or the connection closes ([`UnfinishedBytes`]);
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
use std::sync::atomic::{AtomicUsize, Ordering};
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
    /// Most bytes of unfinished messages the socket holds at once, across its connections, beyond
    /// each connection's [`unbudgeted_bytes_per_connection`](Self::unbudgeted_bytes_per_connection).
    pub max_unfinished_bytes: Option<usize>,
    /// Bytes of an unfinished message a connection holds without drawing on the socket's budget
    /// (so that small messages are never refused while large ones hold the budget).
    pub unbudgeted_bytes_per_connection: usize,
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
    /// The socket's unfinished messages hold its whole budget of bytes.
    UnfinishedBytes,
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
            LimitKind::UnfinishedBytes => {
                "the socket's unfinished messages hold all the bytes it allows"
            }
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

/// The bytes of unfinished messages a socket's connections hold beyond their allowance (shared
/// by the connections' codecs).
#[derive(Debug, Default)]
pub(crate) struct UnfinishedBytes {
    held: AtomicUsize,
}

impl UnfinishedBytes {
    /// Takes `n` bytes of the budget `max`, or none if that would pass it.
    fn try_take(&self, n: usize, max: usize) -> bool {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(n).filter(|&after| after <= max)
            })
            .is_ok()
    }

    fn give_back(&self, n: usize) {
        let _ = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                Some(held.saturating_sub(n))
            });
    }

    /// Bytes held now.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }
}

/// What one connection's unfinished message takes of its socket's [`UnfinishedBytes`]: given
/// back when the message completes and when the connection's codec is dropped.
#[derive(Debug)]
pub(crate) struct MessageCharge {
    shared: Arc<UnfinishedBytes>,
    /// The socket's budget (`None`: none, nothing is charged).
    max: Option<usize>,
    allowance: usize,
    charged: usize,
}

impl MessageCharge {
    pub(crate) fn new(options: &crate::SocketOptions) -> Self {
        Self {
            shared: Arc::clone(&options.unfinished_bytes),
            max: options.limits.max_unfinished_bytes,
            allowance: options.limits.unbudgeted_bytes_per_connection,
            charged: 0,
        }
    }

    /// The message being read now holds `message_len` bytes: charges what passes the allowance,
    /// or says that the budget cannot take it.
    pub(crate) fn hold(&mut self, message_len: usize) -> Result<(), LimitKind> {
        let Some(max) = self.max else { return Ok(()) };
        let due = message_len.saturating_sub(self.allowance);
        if due > self.charged {
            if !self.shared.try_take(due - self.charged, max) {
                return Err(LimitKind::UnfinishedBytes);
            }
            self.charged = due;
        }
        Ok(())
    }

    /// The message completed: its bytes are the socket's owner's now.
    pub(crate) fn release(&mut self) {
        self.shared.give_back(std::mem::take(&mut self.charged));
    }
}

impl Drop for MessageCharge {
    fn drop(&mut self) {
        self.release();
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
