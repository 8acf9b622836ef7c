//! PullTask — one side-channel exchange between a D worker and one P worker (seed steps 21 and
//! 30, receive side: vLLM's `receive_kv_from_single_worker`).
//!
//! The [`Receiver`](crate::receiver::Receiver) spawns one PullTask per P worker per pull. Its
//! exchange task connects a ZeroMQ DEALER to P's ROUTER, sends the [`PullRequest`] (step 21), then
//! reads [`PullResponse`]s (step 30's replies: `Continue`s, then one `Finish`, or one `Error`) until
//! every request of the pull is settled — all within ONE deadline. It reports one [`PullOutcome`]
//! (preceded by a [`PullTransportFailed`] when the socket itself failed) and stops.
//!
//! [`CancelTransfers`] makes it send an [`AbortPull`] on the same socket; it then keeps waiting for
//! P's answer, because P may be writing into D's blocks until it answers. When the deadline passes
//! it sends a best-effort `AbortPull` for what is still unsettled before giving up.
//!
//! Processing the outcome (finished / failed receives, step 34) is the Receiver's job.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use kameo::prelude::*;
use pdflow_messages::frame;
use pdflow_messages::lifecycle::TransferState;
use pdflow_messages::receiver::{CancelTransfers, PullOutcome, PullTransportFailed};
use pdflow_messages::sender_listener::{
    AbortPull, BlockDigests, PullErr, PullErrorCause, PullRequest, PullResponse, PullStatus, SideChannelRequest,
};
use pdflow_messages::{EngineId, RequestId, TransferId};
use pdflow_observability::{attrs, step_span, steps};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{DealerSocket, Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use crate::fault_seam::Faults;
use crate::side_channel_auth::PullAuth;
use crate::ActorError;

/// How long a best-effort `AbortPull` may take to send once the deadline has passed.
const ABORT_SEND_BOUND: Duration = Duration::from_millis(500);

/// Arguments of [`PullTask`].
#[derive(Debug, Clone)]
pub struct PullTaskArgs {
    pub pull_id: u64,
    pub remote_engine_id: EngineId,
    /// P worker's side-channel address, `tcp://host:port`.
    pub worker_addr: String,
    /// The pull, already built by the Receiver.
    pub request: PullRequest,
    /// Deadline of the whole exchange (connect, send, every answer).
    pub deadline: Duration,
    /// Where the one [`PullOutcome`] goes.
    pub outcomes: Recipient<PullOutcome>,
    /// Where a socket-level failure is reported (so a stale bootstrap answer can be dropped).
    pub transport_failures: Recipient<PullTransportFailed>,
    /// The node's fault seam: the pull's frame leaves through it.
    pub faults: Faults,
    /// Seals the pull and checks P's answers (with the cluster secret).
    pub auth: PullAuth,
}

/// One pull in flight to one P worker.
#[derive(Debug)]
pub struct PullTask {
    pull_id: u64,
    cancels: mpsc::UnboundedSender<Vec<TransferId>>,
    exchange: JoinHandle<()>,
}

impl Actor for PullTask {
    type Args = PullTaskArgs;
    type Error = ActorError;

    async fn on_start(args: Self::Args, actor_ref: ActorRef<Self>) -> Result<Self, Self::Error> {
        let (cancels, cancels_rx) = mpsc::unbounded_channel();
        let pull_id = args.pull_id;
        let exchange = tokio::spawn(async move {
            let outcomes = args.outcomes.clone();
            let transport_failures = args.transport_failures.clone();
            let report = exchange(&args, cancels_rx).await;
            if let Some(reason) = report.transport_error {
                let failed = PullTransportFailed {
                    pull_id: args.pull_id,
                    remote_engine_id: args.remote_engine_id.clone(),
                    worker_addr: args.worker_addr.clone(),
                    reason,
                };
                if let Err(e) = transport_failures.tell(failed).await {
                    tracing::warn!(pull_id = args.pull_id, error = %e, "receiver gone: transport failure not reported");
                }
            }
            if let Err(e) = outcomes.tell(report.outcome).await {
                tracing::warn!(pull_id = args.pull_id, error = %e, "receiver gone: pull outcome not reported");
            }
            // Stopping is best effort: the actor may already be stopping.
            let _ = actor_ref.stop_gracefully().await;
        });
        Ok(Self { pull_id, cancels, exchange })
    }

    async fn on_stop(&mut self, _actor_ref: WeakActorRef<Self>, _reason: ActorStopReason) -> Result<(), Self::Error> {
        self.exchange.abort();
        Ok(())
    }
}

impl Message<CancelTransfers> for PullTask {
    type Reply = ();

    /// D gave these transfers up: the exchange task sends `AbortPull` and keeps waiting for P.
    async fn handle(&mut self, msg: CancelTransfers, _ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        if self.cancels.send(msg.transfer_ids).is_err() {
            tracing::debug!(pull_id = self.pull_id, "cancel after the exchange ended: nothing to abort");
        }
    }
}

/// What the exchange task learned.
struct Report {
    outcome: PullOutcome,
    transport_error: Option<String>,
}

/// The requests of the pull and what P said about them so far.
struct Tally {
    pull_id: u64,
    /// d_req_id → transfer_id, for requests with no answer yet.
    unsettled: BTreeMap<RequestId, TransferId>,
    ok_reqs: Vec<RequestId>,
    /// P's block digests of the requests in `ok_reqs` that came with them.
    digests: Vec<BlockDigests>,
    err_reqs: Vec<PullErr>,
    layout_acked: Option<u64>,
    /// P's generation, from its last answer that gave one.
    p_generation: u64,
}

impl Tally {
    fn fail_unsettled(&mut self, cause: PullErrorCause, detail: &str) {
        for (d_req_id, _) in std::mem::take(&mut self.unsettled) {
            self.err_reqs.push(PullErr { d_req_id, cause: cause.clone(), detail: detail.to_string() });
        }
    }

    /// Applies one response; true when the exchange is over.
    fn apply(&mut self, resp: PullResponse) -> bool {
        if resp.pull_id == 0 && resp.status == PullStatus::Error && self.pull_id != 0 {
            // P could not read the frame at all, so it could not know the pull's id: this socket
            // carries only this pull, so the pull failed (not someone else's).
            let error = resp.error.unwrap_or_else(|| "no reason given".into());
            self.fail_unsettled(PullErrorCause::TransferFailed, &format!("P could not read the pull: {error}"));
            return true;
        }
        if resp.pull_id != self.pull_id {
            tracing::warn!(
                pull_id = self.pull_id,
                got = resp.pull_id,
                "P answered another pull id on this socket: ignored"
            );
            return false;
        }
        if resp.layout_id.is_some() {
            self.layout_acked = resp.layout_id;
        }
        if resp.p_generation != 0 {
            self.p_generation = resp.p_generation;
        }
        let mut digests = resp.digests;
        for d_req_id in resp.ok_reqs {
            if self.unsettled.remove(&d_req_id).is_some() {
                if let Some(i) = digests.iter().position(|d| d.d_req_id == d_req_id) {
                    self.digests.push(digests.swap_remove(i));
                }
                self.ok_reqs.push(d_req_id);
            }
        }
        for err in resp.err_reqs {
            if self.unsettled.remove(&err.d_req_id).is_some() {
                self.err_reqs.push(err);
            }
        }
        match resp.status {
            PullStatus::Continue => self.unsettled.is_empty(),
            PullStatus::Finish => {
                self.fail_unsettled(PullErrorCause::TransferFailed, "P finished the pull without naming this request");
                true
            }
            PullStatus::Error => {
                let error = resp.error.unwrap_or_else(|| "P answered ERROR without a reason".into());
                self.fail_unsettled(PullErrorCause::TransferFailed, &format!("P refused the pull: {error}"));
                true
            }
        }
    }
}

/// Why the exchange stopped early.
enum Stop {
    /// The socket failed: connect, send or receive.
    Transport(String),
    /// P's reply is not a valid `PullResponse` frame.
    Garbage(String),
    /// P's side of the connection went away after the pull was sent (its listener restarted or
    /// its process died): whatever it had of this pull is lost, no answer will come.
    PeerLost,
}

/// Runs the exchange under its deadline and always produces a report.
async fn exchange(args: &PullTaskArgs, mut cancels: mpsc::UnboundedReceiver<Vec<TransferId>>) -> Report {
    let request = &args.request;
    let mut tally = Tally {
        pull_id: args.pull_id,
        unsettled: request.reqs.iter().map(|r| (r.d_req_id.clone(), r.transfer_id.clone())).collect(),
        ok_reqs: Vec::new(),
        digests: Vec::new(),
        err_reqs: Vec::new(),
        layout_acked: None,
        p_generation: 0,
    };
    let mut transport_error = None;
    // Connecting gets half the deadline, so a dead address is reported as a socket failure (and
    // its stale bootstrap answer dropped) rather than as a silent P.
    let mut socket = DealerSocket::with_options(args.auth.socket_options(args.deadline / 2));
    // ZeroMQ hides peer loss (a DEALER reconnects silently): the monitor is how a restarted P
    // listener, which forgot this pull, is noticed before the deadline.
    let mut monitor = socket.monitor();

    let result =
        tokio::time::timeout(args.deadline, run(args, &mut socket, &mut monitor, &mut tally, &mut cancels)).await;
    match result {
        Ok(Ok(())) => {}
        Ok(Err(Stop::Transport(reason))) => {
            let detail = format!("side channel to P worker {} failed: {reason}", args.worker_addr);
            tally.fail_unsettled(PullErrorCause::TransferFailed, &detail);
            transport_error = Some(reason);
        }
        Ok(Err(Stop::Garbage(reason))) => {
            let detail = format!("P worker {} sent a reply that is not a pull response: {reason}", args.worker_addr);
            tally.fail_unsettled(PullErrorCause::TransferFailed, &detail);
        }
        Ok(Err(Stop::PeerLost)) => {
            // P may still write if only the connection dropped: tell it to stop (best effort,
            // the DEALER reconnects) before D gives the blocks up, as after a deadline.
            let transfer_ids: Vec<TransferId> = tally.unsettled.values().cloned().collect();
            if !transfer_ids.is_empty() {
                send_abort(&mut socket, &args.auth, args.pull_id, transfer_ids).await;
            }
            let detail = format!(
                "P worker {}'s side channel closed while the pull was in flight (P restarted?): no answer will come",
                args.worker_addr
            );
            tally.fail_unsettled(PullErrorCause::TransferFailed, &detail);
        }
        Err(_elapsed) => {
            // P may still write: tell it to stop (best effort) before D frees the blocks.
            let transfer_ids: Vec<TransferId> = tally.unsettled.values().cloned().collect();
            if !transfer_ids.is_empty() {
                send_abort(&mut socket, &args.auth, args.pull_id, transfer_ids).await;
            }
            let detail = TransferState::Pulling
                .passed(args.deadline, format!("no answer from P worker {}", args.worker_addr))
                .to_string();
            tally.fail_unsettled(PullErrorCause::TransferFailed, &detail);
        }
    }
    let outcome = PullOutcome {
        pull_id: args.pull_id,
        remote_engine_id: args.remote_engine_id.clone(),
        ok_reqs: tally.ok_reqs,
        digests: tally.digests,
        err_reqs: tally.err_reqs,
        layout_acked: tally.layout_acked,
        p_generation: tally.p_generation,
    };
    Report { outcome, transport_error }
}

/// Connect, send the pull (step 21), then read answers until the pull is settled.
async fn run(
    args: &PullTaskArgs,
    socket: &mut DealerSocket,
    monitor: &mut futures::channel::mpsc::Receiver<SocketEvent>,
    tally: &mut Tally,
    cancels: &mut mpsc::UnboundedReceiver<Vec<TransferId>>,
) -> Result<(), Stop> {
    let request = &args.request;
    // Step 21 once per D request of the pull: each request keeps its own trace.
    let spans: Vec<tracing::Span> = request
        .reqs
        .iter()
        .map(|r| {
            let span = step_span!(
                steps::D_SEND_PULL_META,
                request_id = r.d_req_id.as_str(),
                transfer_id = r.transfer_id.as_str()
            );
            span.record(attrs::ENGINE_ID, args.remote_engine_id.as_str());
            span.record(attrs::BLOCKS, r.block_ids.len() as u64);
            if let Some(tp) = r.traceparent.as_ref().or(request.traceparent.as_ref()) {
                span.record(attrs::TRACEPARENT, tp.as_str());
            }
            span
        })
        .collect();
    let bytes = frame::encode(&SideChannelRequest::Pull(request.clone()))
        .map_err(|e| Stop::Transport(format!("pull {} cannot be encoded: {e}", args.pull_id)))?;
    for span in &spans {
        span.record(attrs::BYTES, bytes.len() as u64);
    }
    tracing::debug!(pull_id = args.pull_id, worker_addr = %args.worker_addr, reqs = request.reqs.len(), "sending pull");
    socket
        .connect(&args.worker_addr)
        .await
        .map_err(|e| Stop::Transport(connect_failure(&e, &args.worker_addr, &args.auth)))?;
    let first_req = request.reqs.first().map(|r| r.d_req_id.as_str()).unwrap_or_default();
    let mut nonce = None;
    if let Some(bytes) = args.faults.outgoing(steps::D_SEND_PULL_META.number, first_req, bytes) {
        let (message, sealed_with) = sealed_message(&args.auth, bytes);
        nonce = sealed_with;
        socket.send(message).await.map_err(|e| Stop::Transport(format!("send: {e}")))?;
    }
    drop(spans);

    let mut cancels_open = true;
    let mut monitor_open = true;
    loop {
        tokio::select! {
            event = monitor.next(), if monitor_open => match event {
                Some(SocketEvent::Disconnected(_)) => return Err(Stop::PeerLost),
                Some(_) => {}
                None => monitor_open = false,
            },
            ids = cancels.recv(), if cancels_open => match ids {
                Some(ids) => {
                    let ids: Vec<TransferId> = ids.into_iter().filter(|t| tally.unsettled.values().any(|u| u == t)).collect();
                    // P refuses an abort naming more than MAX_ABORT_IDS: several, if need be.
                    for abort in AbortPull::split(args.pull_id, ids) {
                        let bytes = frame::encode(&SideChannelRequest::Abort(abort)).map_err(|e| Stop::Transport(format!("abort cannot be encoded: {e}")))?;
                        socket.send(sealed_message(&args.auth, bytes).0).await.map_err(|e| Stop::Transport(format!("send abort: {e}")))?;
                    }
                }
                None => cancels_open = false,
            },
            msg = socket.recv() => {
                let msg = msg.map_err(|e| Stop::Transport(format!("receive: {e}")))?;
                // P's ROUTER strips its identity frame: the answer, then its seal.
                let frames = msg.into_vec();
                // An answer not sealed to this pull is not P's: ignored (counted), the deadline runs.
                let Ok(payload) = args.auth.open(&frames, nonce.as_ref(), &args.worker_addr) else { continue };
                let resp: PullResponse = frame::decode(payload, "pull response").map_err(|e| Stop::Garbage(e.to_string()))?;
                if tally.apply(resp) {
                    return Ok(());
                }
            }
        }
    }
}

/// Why D could not connect to P's side channel at `addr`, with what to change when the two ends
/// disagree about TLS (the error alone reads as a codec error or a closed connection).
pub(crate) fn connect_failure(error: &zeromq::ZmqError, addr: &str, auth: &PullAuth) -> String {
    let why = if crate::side_channel_auth::tls_refused(error, addr) {
        " (TLS: P's side channel does not hold the cluster secret)"
    } else if auth.tls.is_some() {
        " (is TLS on at P as well? `tls` must be set alike on both ends: `pdflow serve --tls on`, \"tls\": true in kv_connector_extra_config)"
    } else if !matches!(error, zeromq::ZmqError::Network(e) if e.kind() == std::io::ErrorKind::ConnectionRefused) {
        " (P closed the connection before the ZeroMQ handshake: either P's side channel holds its most connections, which P logs and counts as pdflow_auth_refusals_total{socket=\"side_channel\",cause=\"too_many_connections\"}, or TLS is on at P and off here: `tls` must be set alike on both ends, `pdflow serve --tls on`, \"tls\": true in kv_connector_extra_config)"
    } else {
        ""
    };
    format!("connect to {addr}: {error}{why}")
}

/// The side-channel message of a request `bytes`: sealed with the cluster secret when there is
/// one; the nonce P's answers must be sealed to.
fn sealed_message(auth: &PullAuth, bytes: Vec<u8>) -> (ZmqMessage, Option<pdflow_auth::Nonce>) {
    let (frames, nonce) = auth.seal(bytes);
    let mut frames = frames.into_iter().map(Bytes::from);
    let mut message = ZmqMessage::from(frames.next().unwrap_or_default());
    for frame in frames {
        message.push_back(frame);
    }
    (message, nonce)
}

/// Best effort: tell P to stop writing these transfers (bounded; failures are logged), in as
/// many aborts as P's cap per abort needs.
async fn send_abort(socket: &mut DealerSocket, auth: &PullAuth, pull_id: u64, transfer_ids: Vec<TransferId>) {
    let sent = tokio::time::timeout(ABORT_SEND_BOUND, async {
        for bytes in abort_frames(pull_id, transfer_ids) {
            socket.send(sealed_message(auth, bytes).0).await?;
        }
        Ok::<(), zeromq::ZmqError>(())
    });
    match sent.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(pull_id, error = %e, "abort after the deadline could not be sent"),
        Err(_) => tracing::warn!(pull_id, "abort after the deadline could not be sent in time"),
    }
}

/// The encoded aborts of `transfer_ids`, at most `MAX_ABORT_IDS` each (an abort that cannot be
/// encoded is left out: the deadline on P's side still stops its writes).
fn abort_frames(pull_id: u64, transfer_ids: Vec<TransferId>) -> Vec<Vec<u8>> {
    AbortPull::split(pull_id, transfer_ids)
        .into_iter()
        .filter_map(|abort| frame::encode(&SideChannelRequest::Abort(abort)).ok())
        .collect()
}

/// Best effort, on a fresh socket: tell P to stop writing these transfers of a pull whose
/// PullTask died (the Receiver calls this; bounded by `bound`).
pub(crate) async fn abort_orphaned(
    worker_addr: String,
    auth: PullAuth,
    pull_id: u64,
    transfer_ids: Vec<TransferId>,
    bound: Duration,
) {
    let mut socket = DealerSocket::with_options(auth.socket_options(bound));
    let sent = tokio::time::timeout(bound, async {
        socket.connect(&worker_addr).await?;
        for bytes in abort_frames(pull_id, transfer_ids) {
            socket.send(sealed_message(&auth, bytes).0).await?;
        }
        Ok::<(), zeromq::ZmqError>(())
    })
    .await;
    if !matches!(sent, Ok(Ok(()))) {
        tracing::warn!(pull_id, %worker_addr, "abort of an orphaned pull could not be sent");
    }
}

#[cfg(test)]
mod tests {
    use pdflow_messages::sender_listener::PullReq;
    use tokio::sync::mpsc::UnboundedReceiver;

    use super::*;
    use crate::receiver::fake_peers::{FakeP, WAIT};

    /// Stands in for the Receiver: forwards what a PullTask reports.
    struct Collector {
        tx: mpsc::UnboundedSender<Reported>,
    }

    #[derive(Debug)]
    enum Reported {
        Outcome(PullOutcome),
        Transport(PullTransportFailed),
    }

    impl Actor for Collector {
        type Args = Self;
        type Error = ActorError;
        async fn on_start(args: Self, _: ActorRef<Self>) -> Result<Self, ActorError> {
            Ok(args)
        }
    }

    impl Message<PullOutcome> for Collector {
        type Reply = ();
        async fn handle(&mut self, msg: PullOutcome, _: &mut Context<Self, ()>) {
            let _ = self.tx.send(Reported::Outcome(msg));
        }
    }

    impl Message<PullTransportFailed> for Collector {
        type Reply = ();
        async fn handle(&mut self, msg: PullTransportFailed, _: &mut Context<Self, ()>) {
            let _ = self.tx.send(Reported::Transport(msg));
        }
    }

    fn spawn(
        worker_addr: &str,
        reqs: &[&str],
        deadline: Duration,
    ) -> (ActorRef<PullTask>, UnboundedReceiver<Reported>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let collector = Collector::spawn(Collector { tx });
        let request = PullRequest {
            pull_id: 42,
            engine_id: "d".into(),
            data_addr: "127.0.0.1:9".into(),
            tp_size: 1,
            tp_rank: 0,
            pp_size: 1,
            layout_id: 7,
            layout: None,
            reqs: reqs
                .iter()
                .map(|r| PullReq {
                    d_req_id: (*r).into(),
                    transfer_id: format!("xfer-{r}").into(),
                    block_ids: vec![1, 2].into(),
                    traceparent: None,
                    fence: 0,
                    remote: Vec::new(),
                })
                .collect(),
            traceparent: None,
            p_generation: 0,
            deadline_ms: 0,
            pp_rank: 0,
            p_world: (1, 1),
            rdma: None,
        };
        let task = PullTask::spawn(PullTaskArgs {
            auth: crate::side_channel_auth::PullAuth::default(),
            faults: crate::fault_seam::no_faults(),
            pull_id: 42,
            remote_engine_id: "p".into(),
            worker_addr: worker_addr.into(),
            request,
            deadline,
            outcomes: collector.clone().recipient(),
            transport_failures: collector.recipient(),
        });
        (task, rx)
    }

    async fn next(rx: &mut UnboundedReceiver<Reported>) -> Reported {
        tokio::time::timeout(WAIT, rx.recv()).await.expect("reported in time").expect("collector alive")
    }

    fn response(status: PullStatus, ok: &[&str]) -> PullResponse {
        PullResponse {
            pull_id: 42,
            status,
            ok_reqs: ok.iter().map(|s| (*s).into()).collect(),
            digests: vec![],
            err_reqs: vec![],
            layout_id: None,
            error: None,
            p_generation: 0,
        }
    }

    #[tokio::test]
    async fn continue_then_finish_is_one_outcome() {
        let mut p = FakeP::start().await;
        let (task, mut rx) = spawn(&p.addr, &["a", "b"], WAIT);
        let (id, _) = p.next_request().await;
        // A stray answer for another pull is ignored.
        p.reply(&id, &PullResponse { pull_id: 41, ..response(PullStatus::Finish, &["a"]) });
        p.reply(&id, &response(PullStatus::Continue, &["a"]));
        p.reply(&id, &PullResponse { layout_id: Some(7), ..response(PullStatus::Finish, &["b"]) });
        let Reported::Outcome(outcome) = next(&mut rx).await else { panic!("expected an outcome") };
        assert_eq!(outcome.ok_reqs, vec!["a", "b"]);
        assert!(outcome.err_reqs.is_empty());
        assert_eq!(outcome.layout_acked, Some(7));
        tokio::time::timeout(WAIT, task.wait_for_shutdown()).await.expect("the task stops after reporting");
    }

    #[tokio::test]
    async fn finish_that_omits_a_request_fails_it() {
        let mut p = FakeP::start().await;
        let (_task, mut rx) = spawn(&p.addr, &["a", "b"], WAIT);
        let (id, _) = p.next_request().await;
        p.reply(&id, &response(PullStatus::Finish, &["a"]));
        let Reported::Outcome(outcome) = next(&mut rx).await else { panic!("expected an outcome") };
        assert_eq!(outcome.ok_reqs, vec!["a"]);
        assert_eq!(outcome.err_reqs.len(), 1);
        assert_eq!(outcome.err_reqs[0].d_req_id, "b");
    }

    #[tokio::test]
    async fn dead_address_is_a_transport_failure_within_the_deadline() {
        let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let addr = format!("tcp://{}", dead.local_addr().expect("addr"));
        drop(dead);
        let started = std::time::Instant::now();
        let (_task, mut rx) = spawn(&addr, &["a"], Duration::from_millis(400));
        let Reported::Transport(failed) = next(&mut rx).await else { panic!("expected a transport failure first") };
        assert_eq!(failed.worker_addr, addr);
        let Reported::Outcome(outcome) = next(&mut rx).await else { panic!("expected an outcome") };
        assert!(outcome.err_reqs[0].detail.contains(&addr), "{:?}", outcome.err_reqs);
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[tokio::test]
    async fn an_address_no_p_serves_any_more_fails_well_before_the_deadline() {
        // A cached address of a P that has gone away: refused, retried briefly, then reported
        // (the Receiver drops the cached look-up) — not at the connect timeout (half the deadline).
        let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let addr = format!("tcp://{}", dead.local_addr().expect("addr"));
        drop(dead);
        let started = std::time::Instant::now();
        let (_task, mut rx) = spawn(&addr, &["a"], Duration::from_secs(35));
        let Reported::Transport(failed) = next(&mut rx).await else { panic!("expected a transport failure first") };
        assert_eq!(failed.worker_addr, addr);
        let waited = started.elapsed();
        // 0.35 s of retries on a quiet machine; far below the 17.5 s connect timeout on a loaded one.
        assert!(waited < Duration::from_secs(5), "a refused address failed after {waited:?}");
        assert!(waited >= crate::side_channel_auth::REFUSED_RETRY_FOR / 2, "retried before failing: {waited:?}");
    }

    #[tokio::test]
    async fn an_error_p_could_not_address_to_the_pull_fails_it_at_once() {
        let mut p = FakeP::start().await;
        let started = std::time::Instant::now();
        let (_task, mut rx) = spawn(&p.addr, &["a"], Duration::from_secs(20));
        let (id, _) = p.next_request().await;
        // What P's listener answers to a frame it cannot decode (a damaged pull).
        p.reply(&id, &PullResponse::error(0, "frame magic mismatch"));
        let Reported::Outcome(outcome) = next(&mut rx).await else { panic!("expected an outcome") };
        assert!(outcome.err_reqs[0].detail.contains("could not read the pull"), "{:?}", outcome.err_reqs);
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn a_p_side_that_goes_away_after_the_pull_fails_it_before_the_deadline() {
        let mut p = FakeP::start().await;
        let deadline = Duration::from_secs(20);
        let started = std::time::Instant::now();
        let (_task, mut rx) = spawn(&p.addr, &["a"], deadline);
        let _ = p.next_request().await;
        // P's listener restarts: its socket (and what it knew of the pull) is gone.
        drop(p);
        let Reported::Outcome(outcome) = next(&mut rx).await else { panic!("expected an outcome") };
        assert_eq!(outcome.err_reqs.len(), 1);
        assert!(outcome.err_reqs[0].detail.contains("closed while the pull was in flight"), "{:?}", outcome.err_reqs);
        assert!(started.elapsed() < deadline / 4, "noticed at {:?}, not at the deadline", started.elapsed());
    }

    #[tokio::test]
    async fn cancel_sends_abort_on_the_same_socket_and_waits() {
        let mut p = FakeP::start().await;
        let (task, mut rx) = spawn(&p.addr, &["a"], WAIT);
        let (id, _) = p.next_request().await;
        task.tell(CancelTransfers { transfer_ids: vec!["xfer-a".into(), "xfer-unknown".into()] }).await.expect("alive");
        let (abort_id, abort) = p.next_request().await;
        assert_eq!(abort_id, id, "same DEALER identity");
        assert_eq!(abort, SideChannelRequest::Abort(AbortPull { pull_id: 42, transfer_ids: vec!["xfer-a".into()] }));
        assert!(rx.try_recv().is_err(), "no outcome before P answers");
        let err = PullErr { d_req_id: "a".into(), cause: PullErrorCause::CancelledByPeer, detail: "cancelled".into() };
        p.reply(&id, &PullResponse { err_reqs: vec![err], ..response(PullStatus::Finish, &[]) });
        let Reported::Outcome(outcome) = next(&mut rx).await else { panic!("expected an outcome") };
        assert_eq!(outcome.err_reqs[0].cause, PullErrorCause::CancelledByPeer);
    }

    #[tokio::test]
    async fn cancelling_more_than_one_abort_may_name_sends_several() {
        use pdflow_messages::sender_listener::MAX_ABORT_IDS;
        let mut p = FakeP::start().await;
        let names: Vec<String> = (0..=MAX_ABORT_IDS).map(|i| format!("r{i}")).collect();
        let reqs: Vec<&str> = names.iter().map(String::as_str).collect();
        let (task, _rx) = spawn(&p.addr, &reqs, WAIT);
        let _ = p.next_request().await;
        let all: Vec<TransferId> = names.iter().map(|r| format!("xfer-{r}").into()).collect();
        task.tell(CancelTransfers { transfer_ids: all.clone() }).await.expect("alive");
        let mut aborted = Vec::new();
        for expected in [MAX_ABORT_IDS, 1] {
            let (_, SideChannelRequest::Abort(abort)) = p.next_request().await else { panic!("expected an abort") };
            assert_eq!(abort.transfer_ids.len(), expected);
            aborted.extend(abort.transfer_ids);
        }
        assert_eq!(aborted, all, "every transfer aborted once, in order");
    }
}
