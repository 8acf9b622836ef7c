//! Bounds on what a peer can make P's side channel hold, before and after it proves the cluster
//! secret: bytes and frames per message, connections per socket and per peer address, and how
//! long a connection may take over its handshake or go without a message. The vendored zeromq
//! enforces them (`zeromq::SocketLimits`, "pdflow patch"); each hit closes the connection and is
//! a refusal, counted in `pdflow_auth_refusals_total{socket="side_channel",cause}` and logged once
//! per peer address. Owns no seed step: it guards steps 21 and 30.
//!
//! The defaults, and why:
//!
//! | limit | default | why |
//! |---|---|---|
//! | bytes per message | 16 MiB + 64 KiB | a pdflow frame is at most `frame::MAX_FRAME_LEN` (16 MiB), its seal a few dozen bytes; the largest pull D could send (1,024 requests over 262,144 blocks with a full layout) is under 1 MiB |
//! | unfinished bytes, whole socket | 64 MiB | what every connection's unfinished message may hold together beyond its own allowance: P holds at most 64 MiB + 512 × 64 KiB = 96 MiB of unfinished messages, not 512 × 16 MiB |
//! | unfinished bytes per connection, outside the budget | 64 KiB | a pull is a few KiB: a D's pull is never refused because others hold the budget |
//! | frames per message | 64 | D sends one frame, or a frame and its seal; 64 leaves room for the protocol to grow and costs a few KiB of bookkeeping |
//! | connections | 512 | one per D pull in flight (each PullTask has its own DEALER), from every D worker paired with this P worker; holds P's descriptors well under a 1,024-file limit |
//! | connections per peer address | 128 | one D host (several D workers, DP engines) rarely has more pulls in flight to one P worker; one host cannot take the whole socket |
//! | handshake | 10 s | ZMTP's greeting and READY are two round trips (the TLS handshake has its own 10 s) |
//! | idle | 300 s, or twice the ready timeout plus a minute when longer | D sends its pull, then nothing until P's last answer, which may come after P's ready timeout: the idle timeout must outlast it |

use std::time::Duration;

use pdflow_auth::{Refusal, Socket};
use pdflow_messages::frame;
use zeromq::{LimitHit, LimitKind, SocketLimits, SocketOptions};

/// Most bytes of one side-channel message: a full pdflow frame and room for its seal.
pub const MAX_MESSAGE_LEN: usize = frame::MAX_FRAME_LEN + 64 * 1024;
/// Most frames of one side-channel message.
pub const MAX_MESSAGE_FRAMES: usize = 64;
/// Most bytes of unfinished messages P's side channel holds at once, beyond each connection's
/// [`UNBUDGETED_BYTES_PER_CONNECTION`].
pub const MAX_UNFINISHED_BYTES: usize = 64 << 20;
/// Bytes of an unfinished message one connection holds without drawing on the socket's budget.
pub const UNBUDGETED_BYTES_PER_CONNECTION: usize = 64 << 10;
/// Most side-channel connections open at once.
pub const MAX_CONNECTIONS: usize = 512;
/// Most side-channel connections open at once from one peer address.
pub const MAX_CONNECTIONS_PER_IP: usize = 128;
/// How long a connection may take over its ZMTP handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection may go without a message, at least.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(300);

/// The side channel's limits ([`Default`]: the constants above).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SideChannelLimits {
    pub max_message_len: usize,
    pub max_message_frames: usize,
    /// Bytes of unfinished messages, across every connection, beyond each one's allowance.
    pub max_unfinished_bytes: usize,
    /// Bytes of an unfinished message a connection holds outside the socket's budget.
    pub unbudgeted_bytes_per_connection: usize,
    pub max_connections: usize,
    pub max_connections_per_ip: usize,
    pub handshake_timeout: Duration,
    /// `None`: [`IDLE_TIMEOUT`], or twice the listener's ready timeout plus a minute when longer.
    pub idle_timeout: Option<Duration>,
}

impl Default for SideChannelLimits {
    /// The constants above, with the limits the operator set for the process (`--limit
    /// side_channel.…`, [`pdflow_auth::limits::install`]) in their place.
    fn default() -> Self {
        let set = pdflow_auth::limits::process();
        Self {
            max_message_len: set.side_channel_max_message_bytes.unwrap_or(MAX_MESSAGE_LEN),
            max_message_frames: set.side_channel_max_message_frames.unwrap_or(MAX_MESSAGE_FRAMES),
            max_unfinished_bytes: set.side_channel_max_unfinished_bytes.unwrap_or(MAX_UNFINISHED_BYTES),
            unbudgeted_bytes_per_connection: set
                .side_channel_unbudgeted_bytes_per_connection
                .unwrap_or(UNBUDGETED_BYTES_PER_CONNECTION),
            max_connections: set.side_channel_max_connections.unwrap_or(MAX_CONNECTIONS),
            max_connections_per_ip: set.side_channel_max_connections_per_peer.unwrap_or(MAX_CONNECTIONS_PER_IP),
            handshake_timeout: set.side_channel_handshake_timeout.unwrap_or(HANDSHAKE_TIMEOUT),
            idle_timeout: set.side_channel_idle_timeout,
        }
    }
}

impl SideChannelLimits {
    /// The idle timeout of a listener whose pulls wait up to `ready_timeout` for P's prefill.
    pub fn idle_timeout(&self, ready_timeout: Duration) -> Duration {
        self.idle_timeout.unwrap_or_else(|| IDLE_TIMEOUT.max(ready_timeout * 2 + Duration::from_secs(60)))
    }

    /// Sets these limits on the ROUTER's `options`, each hit counted as a refusal.
    pub(crate) fn apply(&self, options: &mut SocketOptions, ready_timeout: Duration) {
        options.limits(SocketLimits {
            max_message_len: Some(self.max_message_len),
            max_message_frames: Some(self.max_message_frames),
            max_connections: Some(self.max_connections),
            max_connections_per_ip: Some(self.max_connections_per_ip),
            handshake_timeout: Some(self.handshake_timeout),
            idle_timeout: Some(self.idle_timeout(ready_timeout)),
            max_unfinished_bytes: Some(self.max_unfinished_bytes),
            unbudgeted_bytes_per_connection: self.unbudgeted_bytes_per_connection,
        });
        options.on_limit(count);
    }
}

/// Counts a limit hit as a side-channel refusal, logged once per peer address.
fn count(hit: &LimitHit) {
    let why = match hit.kind {
        LimitKind::MessageTooLarge => Refusal::MessageTooLarge,
        LimitKind::TooManyFrames => Refusal::TooManyFrames,
        LimitKind::TooManyConnections | LimitKind::TooManyConnectionsFromPeer => Refusal::TooManyConnections,
        LimitKind::HandshakeTimeout | LimitKind::IdleTimeout => Refusal::IdleTimeout,
        LimitKind::UnfinishedBytes => Refusal::UnfinishedBytes,
        // The only peer predicate pdflow sets is protected mode's (`ListenerAuth::socket_options`).
        LimitKind::PeerNotAllowed => Refusal::NotLoopback,
    };
    let peer = hit.peer.map_or_else(|| "an unknown address".to_string(), |addr| addr.ip().to_string());
    pdflow_auth::refused(Socket::SideChannel, &peer, why);
}
