//! A replay of an engine's kept KV-event batches (vLLM's `ZmqEventPublisher` replay ROUTER): a
//! DEALER asks `[empty, start]` (`start` a big-endian sequence number) and reads every kept
//! batch from `start` on, then the end marker (sequence number -1). Part of the `kv_aware`
//! policy's input (step 8's routing); the subscriber decides when to replay.
//!
//! vLLM's publisher answers `[empty, seq, payload]`; a publisher that also sends its topic
//! (`[empty, topic, seq, payload]`, as the simulated engine does) is read the same. Every wait has
//! a deadline; the socket is dropped with the replay.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// vLLM's end-of-replay sequence number: -1 as 8 signed big-endian bytes.
pub const END_SEQ: [u8; 8] = [0xff; 8];
/// How long connecting to the replay socket and sending the request may take.
pub const CONNECT_DEADLINE: Duration = Duration::from_secs(3);
/// How long the replay may wait for its next message.
pub const MESSAGE_DEADLINE: Duration = Duration::from_secs(5);
/// How long a whole replay may take (10,000 kept batches, vLLM's default, take well under it).
pub const REPLAY_DEADLINE: Duration = Duration::from_secs(120);

/// Why a replay stopped short.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("cannot reach the replay socket {endpoint}: {reason}")]
    Connect { endpoint: String, reason: String },
    #[error("the replay socket {endpoint} sent nothing within {after:?}")]
    Timeout { endpoint: String, after: Duration },
    #[error("the replay socket {endpoint} failed: {reason}")]
    Socket { endpoint: String, reason: String },
    #[error("the replay socket {endpoint} sent a message of {frames} frames that is not a batch")]
    Malformed { endpoint: String, frames: usize },
}

/// A replay under way.
pub struct Replay {
    dealer: DealerSocket,
    endpoint: String,
    deadline: Instant,
    done: bool,
}

impl Replay {
    /// Asks `endpoint` for every kept batch from `start` on.
    pub async fn open(endpoint: &str, start: u64) -> Result<Self, ReplayError> {
        let mut dealer = DealerSocket::with_options(super::subscriber::peer_options());
        let connect_err = |reason: String| ReplayError::Connect { endpoint: endpoint.to_owned(), reason };
        let ask = async {
            dealer.connect(endpoint).await.map_err(|e| connect_err(e.to_string()))?;
            let request = vec![Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())];
            let request = ZmqMessage::try_from(request).map_err(|e| connect_err(e.to_string()))?;
            dealer.send(request).await.map_err(|e| connect_err(e.to_string()))
        };
        match tokio::time::timeout(CONNECT_DEADLINE, ask).await {
            Ok(result) => result?,
            Err(_) => return Err(connect_err(format!("no connection within {CONNECT_DEADLINE:?}"))),
        }
        Ok(Self { dealer, endpoint: endpoint.to_owned(), deadline: Instant::now() + REPLAY_DEADLINE, done: false })
    }

    /// The next replayed batch (sequence number, payload); `None` after the end marker.
    pub async fn next(&mut self) -> Result<Option<(u64, Bytes)>, ReplayError> {
        if self.done {
            return Ok(None);
        }
        let deadline = self.deadline.min(Instant::now() + MESSAGE_DEADLINE);
        let received = match tokio::time::timeout_at(deadline, self.dealer.recv()).await {
            Ok(received) => received,
            Err(_) => return Err(ReplayError::Timeout { endpoint: self.endpoint.clone(), after: MESSAGE_DEADLINE }),
        };
        let msg =
            received.map_err(|e| ReplayError::Socket { endpoint: self.endpoint.clone(), reason: e.to_string() })?;
        let frames = msg.into_vec();
        let malformed = || ReplayError::Malformed { endpoint: self.endpoint.clone(), frames: frames.len() };
        let (seq, payload) = match frames.as_slice() {
            [delimiter, seq, payload] | [delimiter, _, seq, payload] if delimiter.is_empty() => (seq, payload),
            _ => return Err(malformed()),
        };
        if seq.as_ref() == END_SEQ {
            self.done = true;
            return Ok(None);
        }
        let seq: [u8; 8] = seq.as_ref().try_into().map_err(|_| malformed())?;
        Ok(Some((u64::from_be_bytes(seq), payload.clone())))
    }
}
