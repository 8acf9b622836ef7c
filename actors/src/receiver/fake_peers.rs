//! Test peers for the Receiver and PullTask tests: a scriptable P side channel (a real ZeroMQ
//! ROUTER on 127.0.0.1:0) and a real axum bootstrap stub serving `/query` that counts its calls.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pdflow_messages::frame;
use pdflow_messages::sender_listener::{PullResponse, SideChannelRequest};
use tokio::sync::{mpsc, Mutex, Notify};
use tokio::task::JoinHandle;
use zeromq::{RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// How long a test waits for anything.
pub const WAIT: Duration = Duration::from_secs(5);

/// A P worker's side channel whose answers the test scripts.
pub struct FakeP {
    /// `tcp://127.0.0.1:PORT`.
    pub addr: String,
    requests: mpsc::UnboundedReceiver<(Bytes, SideChannelRequest)>,
    replies: mpsc::UnboundedSender<(Bytes, Vec<u8>)>,
    task: JoinHandle<()>,
}

impl FakeP {
    pub async fn start() -> Self {
        let mut socket = RouterSocket::new();
        let endpoint = socket.bind("tcp://127.0.0.1:0").await.expect("router binds");
        let addr = endpoint.to_string();
        let (req_tx, requests) = mpsc::unbounded_channel();
        let (replies, mut reply_rx) = mpsc::unbounded_channel::<(Bytes, Vec<u8>)>();
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    msg = socket.recv() => {
                        let Ok(msg) = msg else { return };
                        let mut frames = msg.into_vec();
                        let payload = frames.pop().unwrap_or_default();
                        let identity = frames.first().cloned().unwrap_or_default();
                        let req: SideChannelRequest = frame::decode(&payload, "side-channel request").expect("D sent a valid frame");
                        let _ = req_tx.send((identity, req));
                    }
                    reply = reply_rx.recv() => {
                        let Some((identity, bytes)) = reply else { return };
                        let mut msg = ZmqMessage::from(bytes);
                        msg.push_front(identity);
                        socket.send(msg).await.expect("router sends");
                    }
                }
            }
        });
        Self { addr, requests, replies, task }
    }

    /// The next frame D sent, within [`WAIT`].
    pub async fn next_request(&mut self) -> (Bytes, SideChannelRequest) {
        tokio::time::timeout(WAIT, self.requests.recv()).await.expect("D sent a frame in time").expect("fake P alive")
    }

    /// True when D sends nothing more within `within`.
    pub async fn quiet_for(&mut self, within: Duration) -> bool {
        tokio::time::timeout(within, self.requests.recv()).await.is_err()
    }

    pub fn reply(&self, identity: &Bytes, resp: &PullResponse) {
        self.reply_raw(identity, frame::encode(resp).expect("encodes"));
    }

    pub fn reply_raw(&self, identity: &Bytes, bytes: Vec<u8>) {
        self.replies.send((identity.clone(), bytes)).expect("fake P alive");
    }
}

impl Drop for FakeP {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A bootstrap server's `/query`, with a call counter and an optional gate that holds answers.
pub struct FakeBootstrap {
    /// `http://127.0.0.1:PORT`.
    pub addr: String,
    pub calls: Arc<AtomicUsize>,
    pub body: Arc<Mutex<serde_json::Value>>,
    /// When set, `/query` waits (bounded) for `release` before answering.
    pub gate: Arc<Mutex<bool>>,
    pub release: Arc<Notify>,
    /// The table age `/query` answers with (pdflow's header), if any.
    pub table_age_ms: Arc<Mutex<Option<u64>>>,
    /// A status `/query` answers with instead of the table, if any.
    pub status: Arc<Mutex<Option<u16>>>,
    task: JoinHandle<()>,
}

#[derive(Clone)]
struct StubState {
    calls: Arc<AtomicUsize>,
    body: Arc<Mutex<serde_json::Value>>,
    gate: Arc<Mutex<bool>>,
    release: Arc<Notify>,
    table_age_ms: Arc<Mutex<Option<u64>>>,
    status: Arc<Mutex<Option<u16>>>,
}

async fn query(axum::extract::State(s): axum::extract::State<StubState>) -> axum::response::Response {
    use axum::response::IntoResponse;
    s.calls.fetch_add(1, Ordering::SeqCst);
    if *s.gate.lock().await {
        let _ = tokio::time::timeout(WAIT, s.release.notified()).await;
    }
    if let Some(status) = *s.status.lock().await {
        let status = axum::http::StatusCode::from_u16(status).expect("a status code");
        return (status, "refused by the stub").into_response();
    }
    let mut answer = axum::Json(s.body.lock().await.clone()).into_response();
    if let Some(age) = *s.table_age_ms.lock().await {
        answer.headers_mut().insert(pdflow_messages::bootstrap::TABLE_AGE_HEADER, age.into());
    }
    answer
}

impl FakeBootstrap {
    /// Serves the seed's body: engine `engine_id` with one worker (tp 0, pp 0) at `worker_addr`.
    pub async fn start(engine_id: &str, worker_addr: &str) -> Self {
        let body = serde_json::json!({"0": {"engine_id": engine_id, "worker_addr": {"0": {"0": worker_addr}}}});
        let state = StubState {
            calls: Arc::new(AtomicUsize::new(0)),
            body: Arc::new(Mutex::new(body)),
            gate: Arc::new(Mutex::new(false)),
            release: Arc::new(Notify::new()),
            table_age_ms: Arc::new(Mutex::new(None)),
            status: Arc::new(Mutex::new(None)),
        };
        let router = axum::Router::new().route("/query", axum::routing::get(query)).with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let addr = format!("http://{}", listener.local_addr().expect("local addr"));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        Self {
            addr,
            calls: state.calls,
            body: state.body,
            gate: state.gate,
            release: state.release,
            table_age_ms: state.table_age_ms,
            status: state.status,
            task,
        }
    }

    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl Drop for FakeBootstrap {
    fn drop(&mut self) {
        self.task.abort();
    }
}
