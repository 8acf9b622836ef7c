//! One engine publisher's KV events, followed: a task owned by the Proxy actor (through
//! [`super::KvEvents`]) that subscribes to the engine's PUB socket and writes what it hears into
//! the engine's index ([`super::index`]), which the actor reads when it routes (step 8). Nothing
//! here waits in the actor's mailbox.
//!
//! - On start, and after the socket reconnected, the batches kept by the engine's replay socket
//!   (if given) are replayed from the last one taken (from 0 at first), checking first that the
//!   last one taken is still the engine's — otherwise the engine restarted.
//! - Each batch is judged by its sequence number ([`super::sequence`]): the next is applied, one
//!   seen already is dropped, a gap is filled by a replay, and an engine that restarted, or a gap
//!   that cannot be filled (no replay socket, batches no longer kept, no answer), clears what
//!   this publisher told the index (conservative: a stale index routes to an engine that no
//!   longer holds the prefix).
//! - A payload that is not a batch is logged and counted, and skipped.
//! - Every wait has a deadline; a failed socket is made again after [`RECONNECT_PAUSE`]; a replay
//!   socket that failed is not asked again for [`REPLAY_BACKOFF`].

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use pdflow_observability::metrics::{self, KvStreamEvent};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketEvent, SocketLimits, SocketOptions, SocketRecv, SubSocket, ZmqMessage};

use super::decode::decode_batch;
use super::index::EngineKv;
use super::replay::{Replay, ReplayError};
use super::sequence::{digest, Sequence, Verdict};
use super::KvEventSource;

/// How long connecting and subscribing may take.
pub const CONNECT_DEADLINE: Duration = Duration::from_secs(3);
/// The pause before a failed socket is made again.
pub const RECONNECT_PAUSE: Duration = Duration::from_secs(1);
/// How long a replay socket that failed is left alone.
pub const REPLAY_BACKOFF: Duration = Duration::from_secs(10);
/// The largest message taken from an engine (a batch of a 128k-token prompt is under 1 MiB).
pub const MAX_MESSAGE_LEN: usize = 64 << 20;

/// What the SUB and replay sockets take from an engine.
pub fn peer_options() -> SocketOptions {
    let mut options = SocketOptions::default();
    options.connect_timeout(CONNECT_DEADLINE);
    options.limits(SocketLimits {
        max_message_len: Some(MAX_MESSAGE_LEN),
        max_message_frames: Some(8),
        handshake_timeout: Some(Duration::from_secs(10)),
        ..SocketLimits::default()
    });
    options
}

/// Why a subscription stopped (it is made again).
#[derive(Debug, thiserror::Error)]
enum SubscribeError {
    #[error("cannot subscribe to {endpoint}: {reason}")]
    Connect { endpoint: String, reason: String },
    #[error("the SUB socket on {endpoint} failed: {reason}")]
    Recv { endpoint: String, reason: String },
}

/// One publisher followed.
pub struct Subscriber {
    source: KvEventSource,
    engine: Arc<EngineKv>,
    sequence: Sequence,
    /// The data-parallel ranks this publisher's batches named (what a clear forgets).
    fed: BTreeSet<u32>,
    /// No replay is asked before this (a replay failed).
    replay_after: Option<Instant>,
    malformed: u64,
}

impl Subscriber {
    pub fn new(source: KvEventSource, engine: Arc<EngineKv>) -> Self {
        Self { source, engine, sequence: Sequence::default(), fed: BTreeSet::new(), replay_after: None, malformed: 0 }
    }

    /// Follows the publisher until shut down.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut failures = 0u32;
        loop {
            let connected = tokio::select! {
                _ = shutdown.cancelled() => return,
                c = self.connect() => c,
            };
            let error = match connected {
                Ok((sub, monitor)) => {
                    failures = 0;
                    tracing::info!(engine = %self.source.engine_url, endpoint = %self.source.endpoint, "kv events: subscribed");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        error = self.follow(sub, monitor) => error,
                    }
                }
                Err(e) => e,
            };
            failures += 1;
            if failures == 1 {
                tracing::warn!(engine = %self.source.engine_url, %error, "kv events: no subscription; trying again");
            } else {
                tracing::debug!(engine = %self.source.engine_url, %error, failures, "kv events: still no subscription");
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(RECONNECT_PAUSE) => {}
            }
        }
    }

    async fn connect(&self) -> Result<(SubSocket, futures::channel::mpsc::Receiver<SocketEvent>), SubscribeError> {
        let endpoint = &self.source.endpoint;
        let err = |reason: String| SubscribeError::Connect { endpoint: endpoint.clone(), reason };
        let mut sub = SubSocket::with_options(peer_options());
        let monitor = sub.monitor();
        let subscribed = async {
            sub.subscribe(&self.source.topic).await.map_err(|e| err(e.to_string()))?;
            sub.connect(endpoint).await.map_err(|e| err(e.to_string()))
        };
        match tokio::time::timeout(CONNECT_DEADLINE, subscribed).await {
            Ok(result) => result?,
            Err(_) => return Err(err(format!("no connection within {CONNECT_DEADLINE:?}"))),
        }
        Ok((sub, monitor))
    }

    /// Takes the missed batches, then every batch published, until the socket fails.
    async fn follow(
        &mut self,
        mut sub: SubSocket,
        mut monitor: futures::channel::mpsc::Receiver<SocketEvent>,
    ) -> SubscribeError {
        // The first connection's own event.
        while monitor.try_recv().is_ok() {}
        self.catch_up().await;
        loop {
            tokio::select! {
                Some(event) = monitor.next() => match event {
                    SocketEvent::Connected(..) => {
                        tracing::info!(engine = %self.source.engine_url, "kv events: reconnected; checking what was missed");
                        self.catch_up().await;
                    }
                    SocketEvent::Disconnected(_) => {
                        tracing::info!(engine = %self.source.engine_url, "kv events: the publisher went away");
                    }
                    _ => {}
                },
                received = sub.recv() => match received {
                    Ok(msg) => self.live(msg).await,
                    Err(e) => {
                        return SubscribeError::Recv { endpoint: self.source.endpoint.clone(), reason: e.to_string() }
                    }
                },
            }
        }
    }

    /// One published message: `[topic, seq (8 bytes, big-endian), payload]`.
    async fn live(&mut self, msg: ZmqMessage) {
        let frames = msg.into_vec();
        let parsed = match frames.as_slice() {
            [_topic, seq, payload] => <[u8; 8]>::try_from(seq.as_ref()).ok().map(|s| (u64::from_be_bytes(s), payload)),
            _ => None,
        };
        let Some((seq, payload)) = parsed else {
            self.count_malformed(format_args!("a message of {} frames is not [topic, seq, payload]", frames.len()));
            return;
        };
        let d = digest(payload);
        let catch_up = match self.sequence.judge(seq, d) {
            Verdict::Next => false,
            Verdict::Duplicate => {
                metrics::global().count_kv_stream(&self.source.engine_url, KvStreamEvent::Duplicate);
                return;
            }
            // The publisher started before the subscriber: what it published first, if kept.
            Verdict::First => seq > 0,
            Verdict::Gap { .. } => true,
            Verdict::Restart => {
                self.drop_index(KvStreamEvent::ClearedRestart, "the engine's sequence started again");
                true
            }
        };
        if catch_up {
            self.catch_up().await;
        }
        match self.sequence.judge(seq, d) {
            Verdict::Duplicate => {}
            Verdict::First | Verdict::Next => self.apply(seq, d, payload),
            Verdict::Gap { last } => {
                let why = format!("batches {}..{seq} were missed and cannot be replayed", last + 1);
                self.drop_index(KvStreamEvent::ClearedGap, &why);
                self.apply(seq, d, payload);
            }
            Verdict::Restart => {
                self.drop_index(KvStreamEvent::ClearedRestart, "the engine's sequence started again");
                self.apply(seq, d, payload);
            }
        }
    }

    /// Replays what was missed since the last batch taken (from 0 when none), if there is a
    /// replay socket; false if nothing could be replayed.
    async fn catch_up(&mut self) -> bool {
        let Some(endpoint) = self.source.replay_endpoint.clone() else { return false };
        if self.replay_after.is_some_and(|after| Instant::now() < after) {
            return false;
        }
        // Twice at most: once more from 0 if the engine turns out to have restarted.
        for _ in 0..2 {
            match self.replay(&endpoint).await {
                Ok(Replayed::Done) => return true,
                Ok(Replayed::Restarted) => continue,
                Err(e) => {
                    tracing::warn!(engine = %self.source.engine_url, error = %e, "kv events: replay failed");
                    self.replay_after = Some(Instant::now() + REPLAY_BACKOFF);
                    if self.sequence.last().is_some() {
                        self.drop_index(KvStreamEvent::ClearedGap, "what was missed could not be replayed");
                    }
                    return false;
                }
            }
        }
        false
    }

    /// One replay from the last batch taken, that one included: it must come back as taken.
    async fn replay(&mut self, endpoint: &str) -> Result<Replayed, ReplayError> {
        let last = self.sequence.last();
        metrics::global().count_kv_stream(&self.source.engine_url, KvStreamEvent::Replay);
        let mut replay = Replay::open(endpoint, last.unwrap_or(0)).await?;
        let mut first = true;
        while let Some((seq, payload)) = replay.next().await? {
            let d = digest(&payload);
            if std::mem::take(&mut first) && last.is_some() {
                match self.sequence.judge(seq, d) {
                    Verdict::Duplicate | Verdict::Next => {}
                    Verdict::Gap { last } => {
                        let why = format!("batches {}..{seq} are no longer kept by the engine", last + 1);
                        self.drop_index(KvStreamEvent::ClearedGap, &why);
                    }
                    Verdict::First | Verdict::Restart => {
                        self.drop_index(KvStreamEvent::ClearedRestart, "the engine's kept batches are not those taken");
                        return Ok(Replayed::Restarted);
                    }
                }
            }
            match self.sequence.judge(seq, d) {
                Verdict::Duplicate => {}
                Verdict::First | Verdict::Next => self.apply(seq, d, &payload),
                Verdict::Gap { .. } | Verdict::Restart => {
                    self.drop_index(KvStreamEvent::ClearedGap, "the replay skipped batches");
                    self.apply(seq, d, &payload);
                }
            }
        }
        if first && last.is_some() {
            // The engine keeps no batch from the last one taken on: it has fewer than were taken.
            self.drop_index(KvStreamEvent::ClearedRestart, "the engine keeps fewer batches than were taken");
            return Ok(Replayed::Restarted);
        }
        Ok(Replayed::Done)
    }

    /// Takes the batch `seq` into the index.
    fn apply(&mut self, seq: u64, digest: u64, payload: &[u8]) {
        self.sequence.take(seq, digest);
        match decode_batch(payload) {
            Ok(batch) => {
                self.fed.insert(batch.data_parallel_rank);
                let applied = self.engine.apply(&batch);
                metrics::global().count_kv_events(&self.source.engine_url, applied.applied, applied.ignored);
                if applied.over_bound {
                    metrics::global().count_kv_stream(&self.source.engine_url, KvStreamEvent::ClearedBound);
                    tracing::warn!(engine = %self.source.engine_url, rank = batch.data_parallel_rank,
                        "kv events: the index passed its bound and was cleared (are removals being missed?)");
                }
            }
            Err(e) => self.count_malformed(format_args!("batch {seq}: {e}")),
        }
    }

    /// Forgets what this publisher told the index, and starts its sequence over.
    fn drop_index(&mut self, cause: KvStreamEvent, why: &str) {
        self.engine.clear(&self.fed);
        self.sequence.reset();
        metrics::global().count_kv_stream(&self.source.engine_url, cause);
        tracing::info!(engine = %self.source.engine_url, endpoint = %self.source.endpoint, why, "kv events: index cleared");
    }

    fn count_malformed(&mut self, what: std::fmt::Arguments<'_>) {
        self.malformed += 1;
        metrics::global().count_kv_stream(&self.source.engine_url, KvStreamEvent::Malformed);
        // Every one counted; the first, and then one in each doubling, logged at warn.
        if self.malformed.is_power_of_two() {
            tracing::warn!(engine = %self.source.engine_url, malformed = self.malformed, "kv events: skipped {what}");
        } else {
            tracing::debug!(engine = %self.source.engine_url, "kv events: skipped {what}");
        }
    }
}

/// How a replay ended.
enum Replayed {
    Done,
    /// The engine restarted: the index was cleared; replay again from 0.
    Restarted,
}
