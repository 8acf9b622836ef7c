//! The SenderListener over a real ZeroMQ socket on 127.0.0.1, with an in-process memcpy transfer
//! engine: D is played by a DEALER speaking pdflow frames.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kameo::prelude::*;
use pdflow_kv::memory::KvCache;
use pdflow_messages::bootstrap::RegisterWorker;
use pdflow_messages::frame;
use pdflow_messages::sender_listener::{
    AbortPull, GetFinishedSending, InFlightPulls, PullErrorCause, PullReq, PullRequest, PullResponse, PullStatus,
    RecordSendReqs, SideChannelAddr, SideChannelRequest,
};
use pdflow_messages::RequestId;
use tokio::sync::Notify;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::{SenderListener, SenderListenerArgs};
use crate::send_worker::test_support::{filled_cache, MemcpyTransfer, SHAPE};
use crate::ActorError;
use kameo::error::HookError;

pub(super) const WAIT: Duration = Duration::from_secs(5);

pub(super) struct Harness {
    pub(super) listener: ActorRef<SenderListener>,
    p: Arc<KvCache>,
    pub(super) d: Arc<KvCache>,
    pub(super) dealer: DealerSocket,
    events: Arc<Notify>,
    seen_finished: BTreeSet<RequestId>,
}

fn args(
    p: &Arc<KvCache>,
    d: &Arc<KvCache>,
    ready_timeout: Duration,
    bootstrap_url: Option<String>,
) -> SenderListenerArgs {
    SenderListenerArgs {
        auth: crate::side_channel_auth::ListenerAuth::default(),
        faults: crate::fault_seam::no_faults(),
        side_channel_port: Arc::new(std::sync::atomic::AtomicU16::new(0)),
        engine_id: "engine-p".into(),
        dp_rank: 0,
        rank: crate::ranks::WorkerRank::single(p.shape()),
        bind_host: "127.0.0.1".into(),
        bootstrap_url,
        kv_cache: p.clone(),
        transfer: MemcpyTransfer::new(p, d),
        ready_timeout,
        send_expiry: Duration::from_secs(60),
        register_attempts: 2,
        register_backoff: Duration::from_millis(10),
        events: Arc::new(Notify::new()),
        verify_checksums: true,
        lineage: Default::default(),
    }
}

/// Waits for the listener's start-up; a failure fails the test with the error (ActorError is not
/// Clone: it is only lent to the closure).
async fn started(listener: &ActorRef<SenderListener>, what: &str) {
    listener
        .wait_for_startup_with_result(|r| {
            if let Err(e) = r {
                panic!("{what}: the listener did not start: {e:?}");
            }
        })
        .await
}

/// How a listener's start-up failed on bootstrap, as the tests look at it.
#[derive(Debug)]
enum BootstrapFailure {
    /// Bootstrap refused the registration with `status`; `answer` is its body.
    Refused { status: reqwest::StatusCode, answer: String },
    /// Bootstrap was not reached in `attempts` attempts.
    Unreachable { attempts: u32 },
}

/// Waits for the listener's start-up to fail on bootstrap; any other end fails the test.
async fn failed_on_bootstrap(listener: &ActorRef<SenderListener>) -> BootstrapFailure {
    listener
        .wait_for_startup_with_result(|r| match r {
            Err(HookError::Error(ActorError::RegistrationRefused { status, answer, .. })) => {
                BootstrapFailure::Refused { status: *status, answer: answer.clone() }
            }
            Err(HookError::Error(ActorError::BootstrapUnreachable { attempts, .. })) => {
                BootstrapFailure::Unreachable { attempts: *attempts }
            }
            other => panic!("expected a bootstrap failure, got {other:?}"),
        })
        .await
}

async fn harness(ready_timeout: Duration) -> Harness {
    harness_with_auth(ready_timeout, crate::side_channel_auth::ListenerAuth::default()).await
}

pub(super) async fn harness_with_auth(
    ready_timeout: Duration,
    auth: crate::side_channel_auth::ListenerAuth,
) -> Harness {
    harness_with_options(ready_timeout, auth, zeromq::SocketOptions::default()).await
}

/// As [`harness_with_auth`], D's DEALER made with `dealer_options` (TLS, say).
pub(super) async fn harness_with_options(
    ready_timeout: Duration,
    auth: crate::side_channel_auth::ListenerAuth,
    dealer_options: zeromq::SocketOptions,
) -> Harness {
    let p = filled_cache(16, 1);
    let d = KvCache::new(SHAPE, 32);
    let args = SenderListenerArgs { auth, ..args(&p, &d, ready_timeout, None) };
    let events = args.events.clone();
    let listener = SenderListener::spawn(args);
    started(&listener, "listener starts").await;
    let addr = listener.ask(SideChannelAddr).await.expect("address");
    assert!(addr.starts_with("tcp://127.0.0.1:"), "{addr}");
    let mut dealer = DealerSocket::with_options(dealer_options);
    tokio::time::timeout(WAIT, dealer.connect(&addr)).await.expect("connects in time").expect("connects");
    Harness { listener, p, d, dealer, events, seen_finished: BTreeSet::new() }
}

impl Harness {
    pub(super) fn pull(&self, pull_id: u64, reqs: &[(&str, &str, Vec<u32>)], with_layout: bool) -> SideChannelRequest {
        let layout = self.d.layout();
        SideChannelRequest::Pull(PullRequest {
            pull_id,
            engine_id: "engine-d".into(),
            data_addr: "127.0.0.1:1".into(),
            tp_size: 1,
            tp_rank: 0,
            pp_size: 1,
            layout_id: layout.layout_id,
            layout: with_layout.then_some(layout),
            reqs: reqs
                .iter()
                .map(|(d, t, b)| PullReq {
                    d_req_id: (*d).into(),
                    transfer_id: (*t).into(),
                    block_ids: b.clone().into(),
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
        })
    }

    async fn send_raw(&mut self, bytes: Vec<u8>) {
        tokio::time::timeout(WAIT, self.dealer.send(ZmqMessage::from(bytes)))
            .await
            .expect("sent in time")
            .expect("sent");
    }

    async fn send(&mut self, req: &SideChannelRequest) {
        self.send_raw(frame::encode(req).expect("encodes")).await;
    }

    pub(super) async fn recv(&mut self) -> PullResponse {
        let msg = tokio::time::timeout(WAIT, self.dealer.recv()).await.expect("a response in time").expect("receives");
        assert_eq!(msg.len(), 1, "one body frame");
        frame::decode(msg.get(0).expect("one frame"), "pull response").expect("decodes")
    }

    pub(super) async fn record(&self, to_send: &[(&str, &str, Vec<u32>)], not_processed: &[&str]) {
        let reqs_to_send: BTreeMap<_, _> =
            to_send.iter().map(|(p, t, b)| ((*p).into(), ((*t).into(), b.clone().into()))).collect();
        let reqs_not_processed = not_processed.iter().map(|t| (*t).into()).collect();
        let msg = RecordSendReqs { reqs_to_send, reqs_not_processed, traceparents: BTreeMap::new() };
        self.listener.ask(msg).await.expect("recorded");
    }

    /// Waits (bounded) until the listener tracks `n` pulls: the pulls were routed to their workers.
    async fn wait_in_flight(&self, n: usize) {
        let deadline = Instant::now() + WAIT;
        while self.listener.ask(InFlightPulls).await.expect("alive") != n {
            assert!(Instant::now() < deadline, "pull never tracked");
            tokio::task::yield_now().await;
        }
    }

    /// Collects finished_sending until `p_req_id` appears (bounded).
    async fn wait_finished(&mut self, p_req_id: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            self.seen_finished.extend(self.listener.ask(GetFinishedSending).await.expect("alive"));
            if self.seen_finished.contains(p_req_id) {
                return;
            }
            let left =
                deadline.checked_duration_since(Instant::now()).expect("finished_sending never gained the request");
            let _ = tokio::time::timeout(left.min(Duration::from_millis(100)), self.events.notified()).await;
        }
    }

    pub(super) fn assert_copied(&self, p_blocks: &[u32], d_blocks: &[u32]) {
        for (p, d) in p_blocks.iter().zip(d_blocks) {
            assert_eq!(
                self.p.block_bytes(*p).expect("p block"),
                self.d.block_bytes(*d).expect("d block"),
                "P block {p} → D block {d}"
            );
        }
        assert_eq!(self.p.blocks_checksum(p_blocks).expect("p"), self.d.blocks_checksum(d_blocks).expect("d"));
    }
}

#[tokio::test]
async fn ready_before_pull_writes_and_finishes_once() {
    let mut h = harness(Duration::from_secs(30)).await;
    h.record(&[("cmpl-p1", "xfer-1", vec![])], &[]).await;
    h.record(&[("cmpl-p1", "xfer-1", vec![3, 4, 7])], &[]).await;
    h.send(&h.pull(11, &[("cmpl-d1", "xfer-1", vec![20, 21, 22])], true)).await;
    let resp = h.recv().await;
    assert_eq!((resp.pull_id, resp.status), (11, PullStatus::Finish));
    assert_eq!(resp.ok_reqs, vec!["cmpl-d1"]);
    assert!(resp.err_reqs.is_empty());
    assert_eq!(resp.layout_id, Some(h.d.layout().layout_id));
    h.assert_copied(&[3, 4, 7], &[20, 21, 22]);
    assert_eq!(h.listener.ask(GetFinishedSending).await.expect("alive"), BTreeSet::from(["cmpl-p1".into()]));
    assert!(h.listener.ask(GetFinishedSending).await.expect("alive").is_empty(), "reported once");

    // The layout is cached now: a pull with only its layout_id is served.
    h.record(&[("cmpl-p2", "xfer-2", vec![8])], &[]).await;
    h.send(&h.pull(12, &[("cmpl-d2", "xfer-2", vec![30])], false)).await;
    let resp = h.recv().await;
    assert_eq!((resp.pull_id, resp.status, resp.ok_reqs.len()), (12, PullStatus::Finish, 1));
    h.assert_copied(&[8], &[30]);
}

#[tokio::test]
async fn a_second_p_request_naming_a_transfer_in_use_is_freed_at_once_and_the_first_is_untouched() {
    let mut h = harness(Duration::from_secs(30)).await;
    h.record(&[("cmpl-p1", "xfer-1", vec![])], &[]).await;
    h.record(&[("cmpl-p2", "xfer-1", vec![])], &[]).await;
    h.record(&[("cmpl-p1", "xfer-1", vec![3, 4])], &[]).await;
    h.record(&[("cmpl-p2", "xfer-1", vec![9])], &[]).await;
    // The second is reported sent (its blocks freed) at once, not held for D's pull.
    h.wait_finished("cmpl-p2").await;
    assert!(!h.seen_finished.contains("cmpl-p1"), "the first is still held for D");
    // D's pull gets the first request's KV.
    h.send(&h.pull(11, &[("cmpl-d1", "xfer-1", vec![20, 21])], true)).await;
    let resp = h.recv().await;
    assert_eq!((resp.status, resp.ok_reqs.clone()), (PullStatus::Finish, vec!["cmpl-d1".into()]), "{resp:?}");
    h.assert_copied(&[3, 4], &[20, 21]);
    h.wait_finished("cmpl-p1").await;
}

#[tokio::test]
async fn a_pull_for_a_transfer_already_sent_or_expired_is_refused_at_once() {
    let mut h = harness(Duration::from_secs(30)).await;
    h.record(&[("cmpl-p1", "xfer-1", vec![3])], &[]).await;
    h.send(&h.pull(1, &[("cmpl-d1", "xfer-1", vec![20])], true)).await;
    assert_eq!(h.recv().await.ok_reqs, vec!["cmpl-d1"]);
    h.wait_finished("cmpl-p1").await;
    // A second pull of the same transfer (a late or repeated one): P's blocks are gone, so it
    // gets a negative acknowledgement now, not a wait of ready_timeout (30 s here).
    let started = Instant::now();
    h.send(&h.pull(2, &[("cmpl-d1", "xfer-1", vec![20])], false)).await;
    let resp = h.recv().await;
    assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
    assert_eq!((resp.pull_id, resp.status), (2, PullStatus::Finish));
    assert_eq!(resp.err_reqs.len(), 1, "{resp:?}");
    assert_eq!(resp.err_reqs[0].cause, PullErrorCause::Expired);
    assert_eq!(h.listener.ask(InFlightPulls).await.expect("alive"), 0);
}

#[tokio::test]
async fn pull_before_ready_waits_then_finishes() {
    let mut h = harness(Duration::from_secs(30)).await;
    h.send(&h.pull(1, &[("cmpl-d", "xfer-a", vec![5, 6])], true)).await;
    h.wait_in_flight(1).await;
    h.record(&[("cmpl-p", "xfer-a", vec![])], &[]).await;
    h.record(&[("cmpl-p", "xfer-a", vec![0, 1])], &[]).await;
    let resp = h.recv().await;
    assert_eq!((resp.pull_id, resp.status), (1, PullStatus::Finish));
    assert_eq!(resp.ok_reqs, vec!["cmpl-d"]);
    h.assert_copied(&[0, 1], &[5, 6]);
    assert_eq!(h.listener.ask(GetFinishedSending).await.expect("alive"), BTreeSet::from(["cmpl-p".into()]));
    assert_eq!(h.listener.ask(InFlightPulls).await.expect("alive"), 0);
}

#[tokio::test]
async fn ready_timeout_answers_well_before_any_big_deadline_and_frees_p_later() {
    let mut h = harness(Duration::from_millis(300)).await;
    h.record(&[("cmpl-p", "xfer-t", vec![])], &[]).await;
    let start = Instant::now();
    h.send(&h.pull(2, &[("cmpl-d", "xfer-t", vec![5])], true)).await;
    let resp = h.recv().await;
    assert!(start.elapsed() < Duration::from_secs(3), "took {:?}", start.elapsed());
    assert_eq!((resp.pull_id, resp.status), (2, PullStatus::Finish));
    assert!(resp.ok_reqs.is_empty());
    assert_eq!(resp.err_reqs.len(), 1);
    assert_eq!(resp.err_reqs[0].cause, PullErrorCause::ReadyTimeout);
    let detail = &resp.err_reqs[0].detail;
    assert!(detail.contains("state `waiting_for_prefill` past its ready_timeout of 0.3s"), "{detail}");
    // P finishes later: nobody will pull, so its blocks are freed at once.
    h.record(&[("cmpl-p", "xfer-t", vec![2])], &[]).await;
    h.wait_finished("cmpl-p").await;
}

#[tokio::test]
async fn reqs_not_processed_aborts_waiting_and_later_pulls_at_once() {
    let mut h = harness(Duration::from_secs(30)).await;
    h.record(&[("cmpl-p", "xfer-x", vec![])], &[]).await;
    h.send(&h.pull(3, &[("cmpl-d", "xfer-x", vec![5])], true)).await;
    h.wait_in_flight(1).await;
    let start = Instant::now();
    h.record(&[], &["xfer-x"]).await;
    let resp = h.recv().await;
    assert!(start.elapsed() < Duration::from_secs(3));
    assert_eq!((resp.pull_id, resp.status), (3, PullStatus::Finish));
    assert_eq!(resp.err_reqs[0].cause, PullErrorCause::Aborted);
    // A pull arriving after P's abort is answered at once too.
    h.send(&h.pull(4, &[("cmpl-d", "xfer-x", vec![5])], false)).await;
    let resp = h.recv().await;
    assert_eq!((resp.pull_id, resp.err_reqs[0].cause.clone()), (4, PullErrorCause::Aborted));
    assert!(h.listener.ask(GetFinishedSending).await.expect("alive").is_empty(), "P freed those blocks itself");
}

#[tokio::test]
async fn garbage_frame_is_answered_and_the_listener_keeps_serving() {
    let mut h = harness(Duration::from_secs(30)).await;
    h.send_raw(b"hello, not a frame".to_vec()).await;
    let resp = h.recv().await;
    assert_eq!((resp.pull_id, resp.status), (0, PullStatus::Error));
    assert!(resp.error.as_deref().is_some_and(|e| e.contains("magic")), "{:?}", resp.error);
    h.record(&[("cmpl-p", "xfer-g", vec![9])], &[]).await;
    h.send(&h.pull(5, &[("cmpl-d", "xfer-g", vec![1])], true)).await;
    let resp = h.recv().await;
    assert_eq!((resp.pull_id, resp.status, resp.ok_reqs.len()), (5, PullStatus::Finish, 1));
    h.assert_copied(&[9], &[1]);
}

/// D looked P up before every P worker had registered (it saw tp 1, this P engine runs tp 2):
/// P refuses the pull rather than write its share for D to take as the whole, and writes nothing.
#[tokio::test]
async fn a_pull_that_sees_another_p_world_is_refused_and_nothing_is_written() {
    let mut h = harness(Duration::from_secs(30)).await;
    h.record(&[("cmpl-p1", "xfer-w", vec![3, 4])], &[]).await;
    let SideChannelRequest::Pull(pull) = h.pull(21, &[("cmpl-d1", "xfer-w", vec![20, 21])], true) else {
        unreachable!("the harness makes pulls")
    };
    h.send(&SideChannelRequest::Pull(PullRequest { p_world: (2, 1), ..pull })).await;
    let resp = h.recv().await;
    assert_eq!((resp.pull_id, resp.status), (21, PullStatus::Error));
    assert_eq!(resp.err_reqs.len(), 1);
    assert_eq!(resp.err_reqs[0].cause, PullErrorCause::LayoutMismatch);
    assert!(resp.err_reqs[0].detail.contains("tp 2"), "{}", resp.err_reqs[0].detail);
    assert_eq!(h.d.blocks_checksum(&[20, 21]).ok(), KvCache::new(SHAPE, 32).blocks_checksum(&[20, 21]).ok());
    // The same pull with the right view is served.
    h.send(&h.pull(22, &[("cmpl-d1", "xfer-w", vec![20, 21])], true)).await;
    assert_eq!(h.recv().await.ok_reqs, vec!["cmpl-d1"]);
    h.assert_copied(&[3, 4], &[20, 21]);
}

#[tokio::test]
async fn a_pull_from_a_d_rank_that_does_not_exist_is_refused_and_nothing_is_written() {
    let mut h = harness(Duration::from_secs(30)).await;
    h.record(&[("cmpl-p1", "xfer-r", vec![3, 4])], &[]).await;
    for (tp_size, tp_rank, pp_size, pp_rank) in [(2, 2, 1, 0), (1, 0, 1, 1), (1, 7, 1, 0)] {
        let SideChannelRequest::Pull(pull) = h.pull(31, &[("cmpl-d1", "xfer-r", vec![20, 21])], true) else {
            unreachable!("the harness makes pulls")
        };
        h.send(&SideChannelRequest::Pull(PullRequest { tp_size, tp_rank, pp_size, pp_rank, ..pull })).await;
        let resp = h.recv().await;
        assert_eq!((resp.pull_id, resp.status), (31, PullStatus::Error), "{resp:?}");
        assert!(resp.error.as_deref().is_some_and(|e| e.contains("does not exist")), "{:?}", resp.error);
        assert_eq!(h.d.blocks_checksum(&[20, 21]).ok(), KvCache::new(SHAPE, 32).blocks_checksum(&[20, 21]).ok());
    }
    // The transfer is still P's to serve to the D rank that exists.
    h.send(&h.pull(32, &[("cmpl-d1", "xfer-r", vec![20, 21])], true)).await;
    assert_eq!(h.recv().await.ok_reqs, vec!["cmpl-d1"]);
    h.assert_copied(&[3, 4], &[20, 21]);
}

#[tokio::test]
async fn unknown_layout_is_an_error_for_every_request() {
    let mut h = harness(Duration::from_secs(30)).await;
    h.send(&h.pull(6, &[("cmpl-d1", "xfer-u1", vec![1]), ("cmpl-d2", "xfer-u2", vec![2])], false)).await;
    let resp = h.recv().await;
    assert_eq!((resp.pull_id, resp.status), (6, PullStatus::Error));
    assert_eq!(resp.err_reqs.len(), 2);
    assert!(resp.err_reqs.iter().all(|e| e.cause == PullErrorCause::UnknownLayout));
}

#[tokio::test]
async fn d_abort_before_ready_cancels_and_p_still_frees_its_blocks() {
    let mut h = harness(Duration::from_secs(30)).await;
    h.record(&[("cmpl-p", "xfer-c", vec![])], &[]).await;
    h.send(&h.pull(7, &[("cmpl-d", "xfer-c", vec![5])], true)).await;
    h.wait_in_flight(1).await;
    h.send(&SideChannelRequest::Abort(AbortPull { pull_id: 7, transfer_ids: vec!["xfer-c".into()] })).await;
    let resp = h.recv().await;
    assert_eq!((resp.pull_id, resp.status), (7, PullStatus::Finish));
    assert_eq!(resp.err_reqs[0].cause, PullErrorCause::CancelledByPeer);
    h.record(&[("cmpl-p", "xfer-c", vec![3])], &[]).await;
    h.wait_finished("cmpl-p").await;
    assert!(h.d.block_bytes(5).expect("in range").iter().all(|b| *b == 0), "nothing written after D cancelled");
}

#[tokio::test]
async fn two_requests_in_one_pull_continue_then_finish() {
    let mut h = harness(Duration::from_secs(30)).await;
    h.record(&[("cmpl-pa", "xfer-a", vec![0, 1]), ("cmpl-pb", "xfer-b", vec![2, 3])], &[]).await;
    h.send(&h.pull(8, &[("cmpl-da", "xfer-a", vec![4, 5]), ("cmpl-db", "xfer-b", vec![8, 9])], true)).await;
    let first = h.recv().await;
    let second = h.recv().await;
    assert_eq!((first.pull_id, first.status, first.ok_reqs.len()), (8, PullStatus::Continue, 1));
    assert_eq!((second.pull_id, second.status, second.ok_reqs.len()), (8, PullStatus::Finish, 1));
    let ok: BTreeSet<_> = first.ok_reqs.into_iter().chain(second.ok_reqs).collect();
    assert_eq!(ok, BTreeSet::from(["cmpl-da".into(), "cmpl-db".into()]));
    h.assert_copied(&[0, 1, 2, 3], &[4, 5, 8, 9]);
    h.wait_finished("cmpl-pa").await;
    h.wait_finished("cmpl-pb").await;
}

/// A tiny bootstrap: records each registration, answers `status`.
async fn fake_bootstrap(
    status: axum::http::StatusCode,
) -> (String, tokio::sync::mpsc::UnboundedReceiver<RegisterWorker>) {
    use axum::routing::post;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let app = axum::Router::new().route(
        "/register",
        post(move |axum::Json(body): axum::Json<RegisterWorker>| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(body);
                (status, "engine already registered with another address")
            }
        }),
    );
    let socket = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let url = format!("http://{}", socket.local_addr().expect("addr"));
    tokio::spawn(async move {
        let _ = axum::serve(socket, app).await;
    });
    (url, rx)
}

#[tokio::test]
async fn registers_its_side_channel_address_with_bootstrap() {
    let (url, mut registrations) = fake_bootstrap(axum::http::StatusCode::OK).await;
    let p = filled_cache(4, 1);
    let d = KvCache::new(SHAPE, 4);
    let listener = SenderListener::spawn(args(&p, &d, Duration::from_secs(1), Some(url)));
    started(&listener, "registers and starts").await;
    let body = tokio::time::timeout(WAIT, registrations.recv()).await.expect("in time").expect("one registration");
    assert_eq!(body.engine_id, "engine-p");
    assert_eq!(body.addr, listener.ask(SideChannelAddr).await.expect("alive"));
}

#[tokio::test]
async fn repeats_its_registration_so_a_restarted_bootstrap_learns_it_again() {
    let (url, mut registrations) = fake_bootstrap(axum::http::StatusCode::OK).await;
    let p = filled_cache(4, 1);
    let d = KvCache::new(SHAPE, 4);
    let listener = SenderListener::spawn(args(&p, &d, Duration::from_secs(1), Some(url)));
    started(&listener, "registers and starts").await;
    let first = tokio::time::timeout(WAIT, registrations.recv()).await.expect("in time").expect("registered");
    // The bootstrap lost its table (restarted): the same registration comes again, unasked.
    let again = tokio::time::timeout(super::register::REREGISTER_INTERVAL * 3, registrations.recv())
        .await
        .expect("repeated in time")
        .expect("registered");
    assert_eq!(again, first, "identical, so a bootstrap that still has it answers 200");
    // Stopped listeners stop repeating.
    listener.stop_gracefully().await.expect("stops");
    listener.wait_for_shutdown().await;
    while registrations.try_recv().is_ok() {}
    assert!(
        tokio::time::timeout(super::register::REREGISTER_INTERVAL * 2, registrations.recv()).await.is_err(),
        "no registration after stop"
    );
}

#[tokio::test]
async fn bootstrap_conflict_fails_start_without_retrying() {
    let (url, _registrations) = fake_bootstrap(axum::http::StatusCode::BAD_REQUEST).await;
    let p = filled_cache(4, 1);
    let d = KvCache::new(SHAPE, 4);
    let mut a = args(&p, &d, Duration::from_secs(1), Some(url));
    a.register_attempts = 5;
    a.register_backoff = Duration::from_secs(10);
    let start = Instant::now();
    let listener = SenderListener::spawn(a);
    let err = failed_on_bootstrap(&listener).await;
    assert!(start.elapsed() < Duration::from_secs(5), "retried a 400");
    let BootstrapFailure::Refused { status, answer } = err else { panic!("refused by bootstrap: {err:?}") };
    assert_eq!(status, reqwest::StatusCode::BAD_REQUEST);
    assert!(answer.contains("already registered"), "{answer}");
}

#[tokio::test]
async fn unreachable_bootstrap_fails_start_after_its_attempts() {
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let url = format!("http://{}", closed.local_addr().expect("addr"));
    drop(closed);
    let p = filled_cache(4, 1);
    let d = KvCache::new(SHAPE, 4);
    let listener = SenderListener::spawn(args(&p, &d, Duration::from_secs(1), Some(url)));
    let err = failed_on_bootstrap(&listener).await;
    assert!(matches!(err, BootstrapFailure::Unreachable { attempts: 2 }), "{err:?}");
}

/// `pull` addressed to generation `p_generation`.
fn addressed(mut pull: SideChannelRequest, p_generation: u64) -> SideChannelRequest {
    if let SideChannelRequest::Pull(p) = &mut pull {
        p.p_generation = p_generation;
    }
    pull
}

#[tokio::test]
async fn a_pull_addressed_to_a_previous_generation_is_refused_at_once_unless_this_one_holds_the_transfer() {
    let mut h = harness(Duration::from_secs(30)).await;
    h.record(&[("cmpl-p1", "xfer-1", vec![3])], &[]).await;
    h.send(&h.pull(1, &[("cmpl-d1", "xfer-1", vec![20])], true)).await;
    let first = h.recv().await;
    let current = first.p_generation;
    assert_ne!(current, 0, "every answer names the worker's generation");

    // A transfer this incarnation never heard of, addressed to its predecessor: refused now, not
    // after ready_timeout (30 s here).
    let started = Instant::now();
    h.send(&addressed(h.pull(2, &[("cmpl-d2", "xfer-old", vec![21])], false), current - 1)).await;
    let resp = h.recv().await;
    assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
    assert_eq!((resp.pull_id, resp.status, resp.p_generation), (2, PullStatus::Finish, current));
    assert_eq!(resp.err_reqs.len(), 1, "{resp:?}");
    assert_eq!(resp.err_reqs[0].cause, PullErrorCause::StaleGeneration);
    assert!(resp.err_reqs[0].detail.contains("xfer-old"), "{}", resp.err_reqs[0].detail);

    // A transfer this incarnation holds is served whatever generation D believed in.
    h.record(&[("cmpl-p3", "xfer-3", vec![5])], &[]).await;
    h.send(&addressed(h.pull(3, &[("cmpl-d3", "xfer-3", vec![22])], false), current - 1)).await;
    assert_eq!(h.recv().await.ok_reqs, vec!["cmpl-d3"]);
    h.assert_copied(&[5], &[22]);

    // Addressed to this generation, an unknown transfer is one whose prefill has not been
    // recorded yet: it waits for it, as before.
    h.send(&addressed(h.pull(4, &[("cmpl-d4", "xfer-4", vec![23])], false), current)).await;
    h.wait_in_flight(1).await;
    h.record(&[("cmpl-p4", "xfer-4", vec![6])], &[]).await;
    assert_eq!(h.recv().await.ok_reqs, vec!["cmpl-d4"]);
}

#[tokio::test]
async fn every_incarnation_registers_a_larger_generation() {
    let (url, mut registrations) = fake_bootstrap(axum::http::StatusCode::OK).await;
    let p = filled_cache(4, 1);
    let d = KvCache::new(SHAPE, 4);
    let mut generations = Vec::new();
    for _ in 0..2 {
        let listener = SenderListener::spawn(args(&p, &d, Duration::from_secs(1), Some(url.clone())));
        started(&listener, "registers and starts").await;
        let body = tokio::time::timeout(WAIT, registrations.recv()).await.expect("in time").expect("registered");
        generations.push(body.generation);
        listener.stop_gracefully().await.expect("stops");
        listener.wait_for_shutdown().await;
        while registrations.try_recv().is_ok() {}
    }
    assert!(generations[0] != 0 && generations[1] > generations[0], "{generations:?}");
}

#[tokio::test]
async fn after_a_restart_a_pull_addressed_to_the_old_incarnation_waits_unless_its_ready_went_with_it() {
    let p = filled_cache(16, 1);
    let d = KvCache::new(SHAPE, 32);
    let args = args(&p, &d, Duration::from_secs(30), None);
    let events = args.events.clone();
    let old = SenderListener::spawn(args.clone());
    started(&old, "listener starts").await;
    let addr = old.ask(SideChannelAddr).await.expect("address");
    let mut dealer = DealerSocket::new();
    tokio::time::timeout(WAIT, dealer.connect(&addr)).await.expect("connects in time").expect("connects");
    let mut h = Harness { listener: old, p, d, dealer, events, seen_finished: BTreeSet::new() };
    h.record(&[("cmpl-p1", "xfer-1", vec![3])], &[]).await;
    h.send(&h.pull(1, &[("cmpl-d1", "xfer-1", vec![20])], true)).await;
    let old_generation = h.recv().await.p_generation;
    // The old incarnation records a ready it will never serve: its record dies with it.
    h.record(&[("cmpl-p2", "xfer-lost", vec![4])], &[]).await;

    // The supervisor's restart: the same args (the same port and lineage), a new incarnation.
    h.listener.kill();
    h.listener.wait_for_shutdown().await;
    let new = SenderListener::spawn(args);
    started(&new, "restarted").await;
    assert_eq!(new.ask(SideChannelAddr).await.expect("address"), addr, "the same side-channel address");
    h.listener = new;
    // D's next pull comes over a new connection (as D's pull tasks connect per pull).
    let mut dealer = DealerSocket::new();
    tokio::time::timeout(WAIT, dealer.connect(&addr)).await.expect("connects in time").expect("connects");
    h.dealer = dealer;

    // A request the engine prefills right now (its ready not recorded by anyone yet), pulled by a
    // D that still addresses the old incarnation: it waits, and is served once the ready comes.
    h.send(&addressed(h.pull(2, &[("cmpl-d3", "xfer-new", vec![21])], true), old_generation)).await;
    h.wait_in_flight(1).await;
    h.record(&[("cmpl-p3", "xfer-new", vec![5])], &[]).await;
    let resp = h.recv().await;
    assert_eq!(resp.ok_reqs, vec!["cmpl-d3"], "{resp:?}");
    assert_ne!(resp.p_generation, old_generation, "answered by the new incarnation");
    h.assert_copied(&[5], &[21]);

    // The transfer whose ready went to the old incarnation is refused at once.
    let started = Instant::now();
    h.send(&addressed(h.pull(3, &[("cmpl-d2", "xfer-lost", vec![22])], false), old_generation)).await;
    let resp = h.recv().await;
    assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
    assert_eq!(resp.err_reqs.len(), 1, "{resp:?}");
    assert_eq!(resp.err_reqs[0].cause, PullErrorCause::StaleGeneration);
    assert!(
        resp.err_reqs[0].detail.contains("xfer-lost") && resp.err_reqs[0].detail.contains(&old_generation.to_string()),
        "{}",
        resp.err_reqs[0].detail
    );
}
