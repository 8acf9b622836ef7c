//! The SenderListener's socket tasks: the ZeroMQ ROUTER bound on a random port, a reader that
//! hands every `[identity, body…]` message to the listener (seed step 21, receive side), and a
//! writer that sends the listener's `[identity, body]` replies (step 30).
//!
//! Both tasks are owned by the listener: they stop on its cancellation token, and the reader holds
//! only a weak reference, so the socket never keeps the listener alive.

use bytes::Bytes;
use kameo::prelude::*;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use zeromq::{Endpoint, RouterRecvHalf, RouterSendHalf, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::SenderListener;
use crate::error::SideChannelError;
use crate::side_channel_auth::{tls_refused, ListenerAuth};
use crate::ActorError;

/// One message D sent: the peer's identity and the frames that followed it.
pub(super) struct SideChannelFrame {
    /// The socket it came from: a restarted listener ignores its predecessor's late frames.
    pub socket_id: u64,
    pub identity: Bytes,
    pub frames: Vec<Bytes>,
}

/// The reader lost the socket: the listener cannot serve any more.
pub(super) struct SocketClosed {
    pub socket_id: u64,
    pub error: zeromq::ZmqError,
}

/// A reply to send: the peer's identity, the encoded frame and its seal (with a cluster secret).
pub(super) type Outgoing = (Bytes, Vec<u8>, Option<Vec<u8>>);

/// The bound socket, split and running.
pub(super) struct SideChannel {
    /// `tcp://host:port`, the address registered with bootstrap.
    pub addr: String,
    pub port: u16,
    /// Identifies this socket in the reader's messages.
    pub socket_id: u64,
    pub replies: mpsc::UnboundedSender<Outgoing>,
    pub tasks: Vec<JoinHandle<()>>,
}

/// How long a restarted listener keeps trying to re-bind its old side-channel port.
const REBIND_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// Binds `tcp://{bind_host}:{port}` (0: any port) and starts the reader and writer tasks.
/// With TLS in `auth`, every connection's handshake comes first; a failed one is counted (a
/// stranger) or logged by the accept watcher, and never reaches the listener.
/// The socket holds what [`ListenerAuth`]'s limits allow (its idle timeout outlasting
/// `ready_timeout`); a peer past one is closed and counted.
pub(super) async fn start(
    bind_host: &str,
    port: u16,
    auth: &ListenerAuth,
    ready_timeout: std::time::Duration,
    listener: ActorRef<SenderListener>,
    cancel: CancellationToken,
) -> Result<SideChannel, ActorError> {
    let bind_addr = format!("tcp://{bind_host}:{port}");
    let mut socket = RouterSocket::with_options(auth.socket_options(ready_timeout));
    let accepts = socket.monitor();
    // A restarted listener re-binds its old port: the previous incarnation's socket closes
    // asynchronously, so the port may stay busy for a moment. Retry within a short deadline.
    let deadline = tokio::time::Instant::now() + REBIND_DEADLINE;
    let endpoint = loop {
        match socket.bind(&bind_addr).await {
            Ok(endpoint) => break endpoint,
            Err(e) if port != 0 && tokio::time::Instant::now() < deadline => {
                tracing::debug!(addr = %bind_addr, error = %e, "side-channel port still busy; retrying");
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Err(e) => {
                return Err(ActorError::SideChannel { addr: bind_addr.clone(), error: SideChannelError::Bind(e) })
            }
        }
    };
    let port = match endpoint {
        Endpoint::Tcp(_, port) => port,
        other => {
            return Err(ActorError::SideChannel { addr: bind_addr, error: SideChannelError::NotTcp(other) });
        }
    };
    let addr = format!("tcp://{bind_host}:{port}");
    let socket_id = NEXT_SOCKET_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (send_half, recv_half) = socket.split();
    let (replies, outgoing) = mpsc::unbounded_channel();
    let tasks = vec![
        tokio::spawn(read_loop(recv_half, socket_id, listener, cancel.clone())),
        tokio::spawn(watch_accepts(accepts, cancel.clone(), addr.clone())),
        tokio::spawn(write_loop(send_half, outgoing, cancel, addr.clone())),
    ];
    Ok(SideChannel { addr, port, socket_id, replies, tasks })
}

/// Source of [`SideChannel::socket_id`].
static NEXT_SOCKET_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Accepts that failed (a TLS handshake, mostly): a stranger is counted as a refusal, anything
/// else logged at debug level. Ends with the socket or the listener.
async fn watch_accepts(
    mut events: futures::channel::mpsc::Receiver<zeromq::SocketEvent>,
    cancel: CancellationToken,
    addr: String,
) {
    use futures::StreamExt;
    loop {
        let event = tokio::select! {
            _ = cancel.cancelled() => return,
            event = events.next() => event,
        };
        match event {
            Some(zeromq::SocketEvent::AcceptFailed(e)) => {
                if !tls_refused(&e, "unknown") {
                    tracing::debug!(%addr, "side-channel accept failed: {e}");
                }
            }
            Some(_) => {}
            None => return,
        }
    }
}

async fn read_loop(
    mut socket: RouterRecvHalf,
    socket_id: u64,
    actor: ActorRef<SenderListener>,
    cancel: CancellationToken,
) {
    loop {
        let received = tokio::select! {
            _ = cancel.cancelled() => return,
            received = socket.recv() => received,
        };
        tracing::trace!(socket_id, ok = received.is_ok(), "side-channel reader: message");
        match received {
            Ok(message) => {
                let mut frames = message.into_vecdeque();
                let Some(identity) = frames.pop_front() else { continue };
                if actor.tell(SideChannelFrame { socket_id, identity, frames: frames.into() }).await.is_err() {
                    return;
                }
            }
            Err(e) => {
                let _ = actor.tell(SocketClosed { socket_id, error: e }).await;
                return;
            }
        }
    }
}

async fn write_loop(
    mut socket: RouterSendHalf,
    mut outgoing: mpsc::UnboundedReceiver<Outgoing>,
    cancel: CancellationToken,
    addr: String,
) {
    loop {
        let next = tokio::select! {
            _ = cancel.cancelled() => return,
            next = outgoing.recv() => next,
        };
        let Some((identity, body, seal)) = next else { return };
        let frames = [Some(identity), Some(Bytes::from(body)), seal.map(Bytes::from)];
        let Ok(message) = ZmqMessage::try_from(frames.into_iter().flatten().collect::<Vec<_>>()) else { continue };
        if let Err(e) = socket.send(message).await {
            tracing::warn!(addr = %addr, error = %e, "could not send a side-channel reply (has D's pull task gone?)");
        }
    }
}
