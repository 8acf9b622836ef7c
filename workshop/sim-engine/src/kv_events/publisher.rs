//! The KV event publisher (vLLM's `ZmqEventPublisher`): a task owning a ZeroMQ PUB socket and,
//! with a replay endpoint, a ROUTER socket.
//!
//! Each batch goes out as three frames: the topic, the batch's sequence number (8 bytes,
//! big-endian, from 0), and its msgpack payload ([`super::encode`]); the last `buffer_steps`
//! batches are kept. A replay request on the ROUTER — `[identity, "", start]`, `start` a
//! big-endian sequence number (a REQ socket, or a DEALER sending an empty frame first) — gets
//! every kept batch from `start` on as `[identity, "", topic, seq, payload]`, then the end
//! marker `[identity, "", "", -1 as 8 bytes, ""]`, as vLLM 0.33 sends them. The engine hands
//! batches over without waiting ([`KvEventPublisher::publish`]); past `max_queue_size` waiting
//! batches one is dropped and logged, as vLLM's queue would block.

use std::collections::VecDeque;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use zeromq::{
    Endpoint, PubSocket, RouterSocket, Socket, SocketLimits, SocketOptions, SocketRecv, SocketSend, ZmqMessage,
};

use super::config::{replay_bind_endpoint, tcp_endpoint, KvEventsConfig, KvEventsError, Placement};
use super::encode::encode_batch;
use super::KvEventBatch;

/// vLLM's end-of-replay sequence number: -1 as 8 signed big-endian bytes.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// How long a connecting PUB socket waits between attempts to reach its subscriber, and how
/// long one attempt may take.
const RECONNECT_PAUSE: Duration = Duration::from_millis(500);
const CONNECT_ATTEMPT: Duration = Duration::from_secs(2);

/// Where the publisher's sockets are, once bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublisherEndpoints {
    /// The PUB socket's: the address it bound (`tcp://0.0.0.0:PORT`, the port resolved) or the
    /// one it connects to.
    pub endpoint: String,
    /// The replay ROUTER's bound address, if any.
    pub replay_endpoint: Option<String>,
}

/// A running publisher; dropping it stops the task and closes the sockets.
#[derive(Debug)]
pub struct KvEventPublisher {
    batches: mpsc::Sender<KvEventBatch>,
    ready: watch::Receiver<Option<Result<PublisherEndpoints, KvEventsError>>>,
    cancel: CancellationToken,
}

impl Drop for KvEventPublisher {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl KvEventPublisher {
    /// Starts the publisher's task on the current tokio runtime, for data-parallel rank
    /// `dp_rank`: it binds (or connects) the sockets, then sends what [`Self::publish`] hands it.
    /// [`Self::ready`] says where the sockets are, or why they could not be set up.
    pub fn spawn(config: KvEventsConfig, dp_rank: u32) -> Self {
        let (batches, rx) = mpsc::channel(config.max_queue_size.max(1));
        let (ready_tx, ready) = watch::channel(None);
        let cancel = CancellationToken::new();
        tokio::spawn(run(config, dp_rank, rx, ready_tx, cancel.clone()));
        Self { batches, ready, cancel }
    }

    /// Hands a batch to the task (never waits; a full queue drops it, with a warning).
    pub fn publish(&self, batch: KvEventBatch) {
        if let Err(e) = self.batches.try_send(batch) {
            tracing::warn!(error = %e, "kv events: the publisher's queue is full or closed; a batch is dropped");
        }
    }

    /// Where the sockets are, once set up; why not, if they cannot be.
    pub async fn ready(&self) -> Result<PublisherEndpoints, KvEventsError> {
        let mut ready = self.ready.clone();
        let state = match ready.wait_for(Option::is_some).await {
            Ok(state) => state.clone().unwrap_or(Err(KvEventsError::Stopped)),
            Err(_) => Err(KvEventsError::Stopped),
        };
        state
    }
}

/// Sets the sockets up, reports where they are, then serves batches and replay requests.
async fn run(
    config: KvEventsConfig,
    dp_rank: u32,
    mut batches: mpsc::Receiver<KvEventBatch>,
    ready: watch::Sender<Option<Result<PublisherEndpoints, KvEventsError>>>,
    cancel: CancellationToken,
) {
    let opened = match Sockets::open(&config, dp_rank).await {
        Ok(opened) => opened,
        Err(e) => {
            tracing::error!(error = %e, "kv events: the publisher cannot start");
            ready.send_replace(Some(Err(e)));
            return;
        }
    };
    let Sockets { mut publish, mut replay, mut connect_to } = opened.0;
    tracing::info!(endpoint = %opened.1.endpoint, replay = ?opened.1.replay_endpoint, "kv events: publishing");
    ready.send_replace(Some(Ok(opened.1)));
    let mut kept = Kept { topic: Bytes::from(config.topic.clone().into_bytes()), buffer: VecDeque::new(), next_seq: 0 };
    loop {
        let replay_request = async {
            match replay.as_mut() {
                Some(router) => router.recv().await,
                None => std::future::pending().await,
            }
        };
        // A connecting PUB keeps trying until its subscriber listens (as pyzmq does).
        let connected = async {
            match &connect_to {
                Some(to) => match tokio::time::timeout(CONNECT_ATTEMPT, publish.connect(to)).await {
                    Ok(Ok(())) => true,
                    _ => {
                        tokio::time::sleep(RECONNECT_PAUSE).await;
                        false
                    }
                },
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            batch = batches.recv() => {
                let Some(batch) = batch else { return };
                let msg = kept.record(&batch, config.buffer_steps);
                if connect_to.is_none() {
                    if let Err(e) = publish.send(msg).await {
                        tracing::warn!(error = %e, "kv events: a batch could not be published");
                    }
                }
            }
            request = replay_request => match (request, replay.as_mut()) {
                (Ok(request), Some(router)) => serve_replay(router, request, &kept).await,
                (Err(e), _) => {
                    // The ROUTER settles its peers' errors itself: an error here is the socket's.
                    tracing::warn!(error = %e, "kv events: the replay socket failed; replay is off from now on");
                    replay = None;
                }
                _ => {}
            },
            done = connected => if done {
                tracing::info!(endpoint = ?connect_to, "kv events: the PUB socket reached its subscriber");
                connect_to = None;
            },
        }
    }
}

/// The batches kept for replay, and the next sequence number.
struct Kept {
    topic: Bytes,
    buffer: VecDeque<(u64, Bytes)>,
    next_seq: u64,
}

impl Kept {
    /// Numbers and keeps `batch` (at most `keep` batches kept); its three-frame message.
    fn record(&mut self, batch: &KvEventBatch, keep: usize) -> ZmqMessage {
        let payload = Bytes::from(encode_batch(batch));
        let seq = self.next_seq;
        self.next_seq += 1;
        self.buffer.push_back((seq, payload.clone()));
        while self.buffer.len() > keep {
            self.buffer.pop_front();
        }
        let mut msg = ZmqMessage::from(self.topic.clone());
        msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        msg.push_back(payload);
        msg
    }
}

/// The publisher's sockets.
struct Sockets {
    publish: PubSocket,
    replay: Option<RouterSocket>,
    /// Where the PUB socket is still to connect (vLLM's non-wildcard endpoint).
    connect_to: Option<String>,
}

impl Sockets {
    async fn open(config: &KvEventsConfig, dp_rank: u32) -> Result<(Self, PublisherEndpoints), KvEventsError> {
        let mut publish = PubSocket::with_options(peer_limits(SUBSCRIBER_MESSAGE_LEN));
        let (endpoint, connect_to) = match tcp_endpoint(&config.endpoint, dp_rank)? {
            Placement::Bind(at) => (bound(&mut publish, "PUB", &at).await?, None),
            Placement::Connect(to) => (to.clone(), Some(to)),
        };
        let (replay, replay_endpoint) = match &config.replay_endpoint {
            None => (None, None),
            Some(replay) => {
                let at = replay_bind_endpoint(replay, dp_rank)?;
                let mut router = RouterSocket::with_options(peer_limits(REPLAY_MESSAGE_LEN));
                let bound_at = bound(&mut router, "replay ROUTER", &at).await?;
                (Some(router), Some(bound_at))
            }
        };
        Ok((Self { publish, replay, connect_to }, PublisherEndpoints { endpoint, replay_endpoint }))
    }
}

/// The most a subscriber may send in one message (a subscription: a topic prefix), and a replay
/// client (three small frames).
const SUBSCRIBER_MESSAGE_LEN: usize = 64 * 1024;
const REPLAY_MESSAGE_LEN: usize = 4096;

/// What a peer — a subscriber, a replay client — may make a socket hold.
fn peer_limits(max_message_len: usize) -> SocketOptions {
    let mut options = SocketOptions::default();
    options.limits(SocketLimits {
        max_message_len: Some(max_message_len),
        max_message_frames: Some(8),
        max_connections: Some(1024),
        handshake_timeout: Some(Duration::from_secs(10)),
        max_unfinished_bytes: Some(4 << 20),
        unbudgeted_bytes_per_connection: REPLAY_MESSAGE_LEN,
        ..SocketLimits::default()
    });
    options
}

/// Binds `socket` at `at`; the bound address (its port resolved).
async fn bound<S: Socket>(socket: &mut S, what: &'static str, at: &str) -> Result<String, KvEventsError> {
    let endpoint = socket.bind(at).await.map_err(|e| KvEventsError::Bind {
        what,
        endpoint: at.to_owned(),
        reason: e.to_string(),
    })?;
    Ok(match endpoint {
        Endpoint::Tcp(host, port) => match host {
            zeromq::Host::Ipv6(ip) => format!("tcp://[{ip}]:{port}"),
            host => format!("tcp://{host}:{port}"),
        },
        other => other.to_string(),
    })
}

/// Answers one replay request: every kept batch from the requested sequence number, then the end
/// marker. A malformed request is logged and ignored, as vLLM ignores it.
async fn serve_replay(router: &mut RouterSocket, request: ZmqMessage, kept: &Kept) {
    let frames = request.into_vec();
    let [identity, _delimiter, start] = frames.as_slice() else {
        tracing::warn!(frames = frames.len(), "kv events: invalid replay request (expected 3 frames)");
        return;
    };
    // Python's int.from_bytes(…, "big"): any length; past 8 bytes no batch is that late.
    let start = if start.len() > 8 && start[..start.len() - 8].iter().any(|&b| b != 0) {
        u64::MAX
    } else {
        start.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
    };
    let empty = Bytes::new();
    for (seq, payload) in kept.buffer.iter().filter(|(seq, _)| *seq >= start) {
        let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
        let frames = vec![identity.clone(), empty.clone(), kept.topic.clone(), seq, payload.clone()];
        if !send(router, frames).await {
            return;
        }
    }
    send(router, vec![identity.clone(), empty.clone(), empty.clone(), Bytes::from_static(&END_SEQ), empty]).await;
}

/// Sends one ROUTER message; false if the client is gone.
async fn send(router: &mut RouterSocket, frames: Vec<Bytes>) -> bool {
    let Ok(msg) = ZmqMessage::try_from(frames) else { return false };
    match router.send(msg).await {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!(error = %e, "kv events: a replay client went away");
            false
        }
    }
}
