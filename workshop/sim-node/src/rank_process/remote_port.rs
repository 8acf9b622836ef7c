//! The engine's side of one rank's process: its worker role (the engine's
//! [`WorkerConnectorPort`]) as calls over the rank's socket. Every call has a deadline; when
//! the process is gone, every call fails at once as unavailable.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::{BoxFuture, FutureExt};
use pdflow_messages::rank_process::{RankAnswer, RankCall, RankCallError, RankMessage, RankRequest};
use pdflow_messages::scheduler_connector::{ConnectorMetadata, ConnectorOutput, LayerSave};
use pdflow_messages::RequestId;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::ipc;
use pdflow_node::ports::{ConnectorError, WorkerConnectorPort};

/// How long one call on a rank's worker may take (its actors answer in milliseconds).
pub const CALL_DEADLINE: Duration = Duration::from_secs(10);
/// Calls and layer events queued for the rank's socket, at most.
const QUEUE: usize = 4096;

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<RankAnswer, RankCallError>>>>>;

/// One rank's worker role, in its process.
pub struct RemoteWorkerPort {
    rank: u32,
    outbox: mpsc::Sender<Vec<u8>>,
    pending: Pending,
    next_id: AtomicU64,
    events: Arc<Notify>,
    /// Cancelled when the socket ends (the process exited or was killed).
    gone: CancellationToken,
    /// Cancelled to close the socket (the rank then stops).
    closing: CancellationToken,
    tasks: [JoinHandle<()>; 2],
}

impl RemoteWorkerPort {
    /// Serves the calls on an established connection (after the rank reported ready).
    pub fn new(rank: u32, reader: OwnedReadHalf, writer: OwnedWriteHalf) -> Self {
        let (outbox, inbox) = mpsc::channel(QUEUE);
        let pending: Pending = Arc::default();
        let events = Arc::new(Notify::new());
        let (gone, closing) = (CancellationToken::new(), CancellationToken::new());
        let writing = tokio::spawn(write_loop(writer, inbox, gone.clone(), closing.clone()));
        let reading = tokio::spawn(read_loop(rank, reader, pending.clone(), events.clone(), gone.clone()));
        Self { rank, outbox, pending, next_id: AtomicU64::new(1), events, gone, closing, tasks: [writing, reading] }
    }

    /// Cancelled once the rank's socket has ended.
    pub fn gone(&self) -> CancellationToken {
        self.gone.clone()
    }

    /// Closes the engine's end of the socket: the rank stops once it reads the end.
    pub fn close(&self) {
        self.closing.cancel();
    }

    async fn call(&self, call: RankCall, what: &str) -> Result<RankAnswer, ConnectorError> {
        let target = format!("rank {}'s process", self.rank);
        let unavailable = |why: String| ConnectorError::unavailable(what, target.clone(), why);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).insert(id, tx);
        let forget = || self.pending.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
        if self.gone.is_cancelled() {
            forget();
            return Err(unavailable("the rank's process is gone".into()));
        }
        let bytes = ipc::encode(&RankRequest { id, call }).map_err(|e| {
            forget();
            unavailable(e.to_string())
        })?;
        // One deadline for queueing the call (a rank that stopped reading fills the queue) and
        // for its answer.
        let answer = tokio::time::timeout(CALL_DEADLINE, async {
            if self.outbox.send(bytes).await.is_err() {
                return None;
            }
            Some(rx.await)
        });
        match answer.await {
            Ok(None) => {
                forget();
                Err(unavailable("the rank's process is gone".into()))
            }
            Ok(Some(Ok(Ok(answer)))) => Ok(answer),
            Ok(Some(Ok(Err(refused)))) => Err(ConnectorError::from(refused)),
            Ok(Some(Err(_))) => Err(unavailable("the rank's process is gone".into())),
            Err(_) => {
                forget();
                Err(unavailable(format!("no answer within {CALL_DEADLINE:?}")))
            }
        }
    }
}

impl Drop for RemoteWorkerPort {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

async fn write_loop(
    mut writer: OwnedWriteHalf,
    mut inbox: mpsc::Receiver<Vec<u8>>,
    gone: CancellationToken,
    closing: CancellationToken,
) {
    while let Some(bytes) = tokio::select! {
        b = inbox.recv() => b,
        () = gone.cancelled() => None,
        () = closing.cancelled() => None,
    } {
        if ipc::write_frame(&mut writer, &bytes).await.is_err() {
            break;
        }
    }
    // Shutting the write side lets the rank read the end of the socket.
    let _ = tokio::io::AsyncWriteExt::shutdown(&mut writer).await;
}

async fn read_loop(
    rank: u32,
    mut reader: OwnedReadHalf,
    pending: Pending,
    events: Arc<Notify>,
    gone: CancellationToken,
) {
    loop {
        match ipc::read_frame::<RankMessage>(&mut reader, "RankMessage").await {
            Ok(Some(RankMessage::Reply { id, answer })) => {
                if let Some(tx) = pending.lock().unwrap_or_else(|e| e.into_inner()).remove(&id) {
                    let _ = tx.send(answer);
                }
            }
            Ok(Some(RankMessage::KvEvent)) => {
                events.notify_waiters();
                events.notify_one();
            }
            Ok(Some(other)) => {
                tracing::warn!(rank, message = ?other, "unexpected message from a running rank: ignored")
            }
            Ok(None) => break,
            Err(e) => {
                tracing::error!(rank, error = %e, "the rank's socket failed");
                break;
            }
        }
    }
    gone.cancel();
    // Dropping the senders fails every waiting call at once.
    pending.lock().unwrap_or_else(|e| e.into_inner()).clear();
    events.notify_waiters();
    events.notify_one();
}

impl WorkerConnectorPort for RemoteWorkerPort {
    fn start_load_kv(&self, meta: ConnectorMetadata) -> BoxFuture<'_, Result<(), ConnectorError>> {
        async move { self.call(RankCall::StartLoadKv(meta), "start_load_kv").await.map(|_| ()) }.boxed()
    }

    fn get_finished(&self) -> BoxFuture<'_, Result<ConnectorOutput, ConnectorError>> {
        async move {
            match self.call(RankCall::GetFinished, "get_finished").await? {
                RankAnswer::Finished(output) => Ok(output),
                RankAnswer::Done => Ok(ConnectorOutput::default()),
            }
        }
        .boxed()
    }

    fn kv_events(&self) -> Arc<Notify> {
        self.events.clone()
    }

    fn save_kv_layer(&self, layer: usize, reqs: &BTreeMap<RequestId, LayerSave>) {
        if reqs.is_empty() {
            return;
        }
        // Never waits (the forward calls this): a full queue drops the event, which only delays
        // that layer's write to the next chunk, or to ready, which writes the rest.
        let call = RankCall::SaveKvLayer { layer: layer as u32, reqs: reqs.clone() };
        match ipc::encode(&RankRequest { id: 0, call }) {
            Ok(bytes) => {
                if let Err(e) = self.outbox.try_send(bytes) {
                    tracing::debug!(rank = self.rank, layer, error = %e, "layer-wise save not handed to the rank");
                }
            }
            Err(e) => tracing::warn!(rank = self.rank, layer, error = %e, "layer-wise save not encoded"),
        }
    }
}
