//! What happens when a peer is refused (for its proof, for passing one of a socket's limits, or for
//! its address in protected mode):
//! counted in `/metrics` (`pdflow_auth_refusals_total{socket,cause}`) and logged once per socket
//! and peer address, so that a flood of forgeries is one warning per attacker, not one per attempt.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

use crate::error::Refusal;

/// The socket a refusal happened on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Socket {
    /// D's data server, or P's engine refusing a D that proved nothing.
    Data,
    /// P's side channel (pulls), or D refusing an answer.
    SideChannel,
    /// The bootstrap's HTTP API, or a client refusing its answer.
    Bootstrap,
    /// The proxy's HTTP API (refused only for its address, in protected mode).
    Proxy,
    /// An engine's HTTP API, `pdflow serve`'s (refused only for its address, in protected mode).
    Engine,
}

impl Socket {
    pub fn label(self) -> &'static str {
        match self {
            Socket::Data => "data",
            Socket::SideChannel => "side_channel",
            Socket::Bootstrap => "bootstrap",
            Socket::Proxy => "proxy",
            Socket::Engine => "engine",
        }
    }
}

/// Peers already logged; past this many, refusals are counted but no longer logged.
const MAX_LOGGED_PEERS: usize = 4096;

/// Counts a refusal of `peer` on `socket` and logs it the first time this peer is refused there.
pub fn refused(socket: Socket, peer: &str, why: Refusal) {
    pdflow_observability::metrics::global().count_auth_refusal(socket.label(), why.label());
    static LOGGED: OnceLock<Mutex<HashSet<(Socket, String)>>> = OnceLock::new();
    let mut logged = LOGGED.get_or_init(Default::default).lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if logged.len() < MAX_LOGGED_PEERS && logged.insert((socket, peer.to_owned())) {
        tracing::warn!(
            socket = socket.label(),
            peer,
            cause = why.label(),
            "peer refused: {why} (logged once per peer)"
        );
    }
}
