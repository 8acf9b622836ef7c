//! Receiver tests: a real Receiver, real PullTasks, a scripted P side channel (ZeroMQ ROUTER) and
//! a real axum `/query` stub, all in process on 127.0.0.1:0.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kameo::prelude::*;
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_messages::lifecycle::TransferState;
use pdflow_messages::receiver::{GetFinishedRecving, StartLoadKv, TransferStates};
use pdflow_messages::scheduler_connector::{ConnectorOutput, LoadFailureCause, PullMeta};
use pdflow_messages::sender_listener::{
    PullErr, PullErrorCause, PullRequest, PullResponse, PullStatus, SideChannelRequest,
};
use tokio::sync::Notify;

use super::fake_peers::{FakeBootstrap, FakeP, WAIT};
use super::{PullTaskRefs, Receiver, ReceiverArgs};

const P_ENGINE: &str = "p-engine-6c1f";
const TINY: KvShape = KvShape { num_layers: 2, num_kv_heads: 1, head_dim: 4, dtype_bytes: 2, block_size: 4 };

struct Harness {
    receiver: ActorRef<Receiver>,
    events: Arc<Notify>,
    p: FakeP,
    bootstrap: FakeBootstrap,
    collected: ConnectorOutput,
}

impl Harness {
    async fn start(pull_timeout: Duration) -> Self {
        let p = FakeP::start().await;
        let bootstrap = FakeBootstrap::start(P_ENGINE, &p.addr).await;
        let events = Arc::new(Notify::new());
        let receiver = Receiver::spawn(ReceiverArgs {
            auth: crate::side_channel_auth::PullAuth::default(),
            faults: crate::fault_seam::no_faults(),
            engine_id: "d-engine".into(),
            rank: crate::ranks::WorkerRank::single(TINY),
            kv_cache: KvCache::new(TINY, 32),
            data_addr: "127.0.0.1:9".into(),
            pull_timeout,
            bootstrap_timeout: Duration::from_secs(2),
            events: events.clone(),
            verify_checksums: true,
            fence: None,
        });
        Self { receiver, events, p, bootstrap, collected: ConnectorOutput::default() }
    }

    fn meta(&self, req: &str, blocks: Vec<u32>) -> PullMeta {
        PullMeta {
            d_req_id: req.into(),
            transfer_id: format!("xfer-{req}").into(),
            local_block_ids: blocks.into(),
            remote_engine_id: P_ENGINE.into(),
            remote_bootstrap_addr: self.bootstrap.addr.clone(),
            traceparent: None,
        }
    }

    async fn pull(&self, metas: Vec<PullMeta>) {
        self.pull_from(P_ENGINE, metas).await;
    }

    /// Hands `metas` over as pulls from P engine `engine` (each meta names it too).
    async fn pull_from(&self, engine: &str, metas: Vec<PullMeta>) {
        let reqs = metas
            .into_iter()
            .map(|mut m| {
                m.remote_engine_id = engine.into();
                (m.d_req_id.clone(), m)
            })
            .collect();
        let msg = StartLoadKv { reqs_to_recv: BTreeMap::from([(engine.into(), reqs)]), reqs_to_abort: BTreeSet::new() };
        self.receiver.tell(msg).await.expect("receiver alive");
    }

    async fn abort(&self, req: &str) {
        let msg = StartLoadKv { reqs_to_recv: BTreeMap::new(), reqs_to_abort: BTreeSet::from([req.into()]) };
        self.receiver.tell(msg).await.expect("receiver alive");
    }

    /// Collects results (also a mailbox barrier: every earlier message has been handled).
    async fn collect(&mut self) -> &ConnectorOutput {
        let out = self.receiver.ask(GetFinishedRecving).await.expect("receiver answers");
        self.collected.merge(out);
        &self.collected
    }

    /// Waits (bounded by `within`) until `req` is finished or failed.
    async fn settled(&mut self, req: &str, within: Duration) -> &ConnectorOutput {
        let events = self.events.clone();
        let done = tokio::time::timeout(within, async {
            loop {
                let notified = events.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let out = self.collect().await;
                if out.finished_recving.contains(req) || out.failed_recving.contains_key(req) {
                    return;
                }
                notified.await;
            }
        })
        .await;
        assert!(done.is_ok(), "request {req} not settled within {within:?}: {:?}", self.collected);
        &self.collected
    }

    async fn next_pull(&mut self) -> (Bytes, PullRequest) {
        match self.p.next_request().await {
            (id, SideChannelRequest::Pull(pull)) => (id, pull),
            (_, other) => panic!("expected a pull, got {other:?}"),
        }
    }
}

fn finish(pull: &PullRequest, ok: &[&str]) -> PullResponse {
    PullResponse {
        pull_id: pull.pull_id,
        status: PullStatus::Finish,
        ok_reqs: ok.iter().map(|s| (*s).into()).collect(),
        digests: vec![],
        err_reqs: vec![],
        layout_id: Some(pull.layout_id),
        error: None,
        p_generation: 0,
    }
}

#[tokio::test]
async fn pull_completes_into_finished_recving() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    h.pull(vec![h.meta("cmpl-d-1", vec![3, 4, 5])]).await;
    let (id, pull) = h.next_pull().await;
    assert_eq!(pull.reqs.len(), 1);
    assert_eq!(pull.reqs[0].block_ids.flat(), vec![3, 4, 5]);
    assert_eq!(pull.reqs[0].transfer_id, "xfer-cmpl-d-1");
    assert!(pull.layout.is_some(), "first pull carries the full layout");
    assert_eq!(pull.data_addr, "127.0.0.1:9");
    // The request's lifecycle state while P has not answered.
    let states = h.receiver.ask(TransferStates).await.expect("alive");
    assert_eq!(states, BTreeMap::from([("cmpl-d-1".into(), TransferState::Pulling)]));
    h.p.reply(&id, &finish(&pull, &["cmpl-d-1"]));
    let out = h.settled("cmpl-d-1", WAIT).await;
    assert!(out.finished_recving.contains("cmpl-d-1") && out.failed_recving.is_empty(), "{out:?}");
    assert!(h.receiver.ask(TransferStates).await.expect("alive").is_empty(), "nothing tracked once reported");

    // P acknowledged the layout: the next pull to that worker omits it and needs no new look-up.
    h.pull(vec![h.meta("cmpl-d-2", vec![6])]).await;
    let (id, pull) = h.next_pull().await;
    assert!(pull.layout.is_none(), "acknowledged layout is not resent");
    h.p.reply(&id, &finish(&pull, &["cmpl-d-2"]));
    assert!(h.settled("cmpl-d-2", WAIT).await.finished_recving.contains("cmpl-d-2"));
    assert_eq!(h.bootstrap.calls(), 1);
}

#[tokio::test]
async fn continue_then_finish_settles_every_request() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    h.pull(vec![h.meta("a", vec![1]), h.meta("b", vec![2])]).await;
    let (id, pull) = h.next_pull().await;
    assert_eq!(pull.reqs.len(), 2, "one pull per engine for the step's requests");
    h.p.reply(&id, &PullResponse { status: PullStatus::Continue, ..finish(&pull, &["a"]) });
    h.p.reply(&id, &finish(&pull, &["b"]));
    h.settled("a", WAIT).await;
    let out = h.settled("b", WAIT).await;
    assert_eq!(out.finished_recving, BTreeSet::from(["a".into(), "b".into()]));
}

#[tokio::test]
async fn concurrent_pulls_for_a_new_engine_query_bootstrap_once() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    *h.bootstrap.gate.lock().await = true;
    h.pull(vec![h.meta("a", vec![1])]).await;
    h.pull(vec![h.meta("b", vec![2])]).await;
    h.collect().await; // both StartLoadKv handled while the look-up is held
    h.bootstrap.release.notify_waiters();
    h.bootstrap.release.notify_one();
    let (id, pull) = h.next_pull().await;
    let reqs: BTreeSet<_> = pull.reqs.iter().map(|r| r.d_req_id.as_str()).collect();
    assert_eq!(reqs, BTreeSet::from(["a", "b"]), "the queued requests share one pull");
    h.p.reply(&id, &finish(&pull, &["a", "b"]));
    h.settled("a", WAIT).await;
    h.settled("b", WAIT).await;
    assert_eq!(h.bootstrap.calls(), 1, "exactly one /query");
}

#[tokio::test]
async fn p_error_response_fails_the_request() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    h.pull(vec![h.meta("a", vec![1])]).await;
    let (id, pull) = h.next_pull().await;
    h.p.reply(&id, &PullResponse::error(pull.pull_id, "bad layout"));
    let out = h.settled("a", WAIT).await;
    let failure = &out.failed_recving["a"];
    assert!(failure.detail.contains("bad layout"), "{out:?}");
    assert_eq!(failure.block_ids, vec![1], "the blocks whose bytes are undefined");
    assert!(out.finished_recving.is_empty());
}

#[tokio::test]
async fn p_err_reqs_fail_with_cause_and_detail() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    h.pull(vec![h.meta("a", vec![1])]).await;
    let (id, pull) = h.next_pull().await;
    let err =
        PullErr { d_req_id: "a".into(), cause: PullErrorCause::ReadyTimeout, detail: "prefill never finished".into() };
    h.p.reply(&id, &PullResponse { err_reqs: vec![err], ..finish(&pull, &[]) });
    let out = h.settled("a", WAIT).await;
    let failure = &out.failed_recving["a"];
    assert_eq!(failure.cause, LoadFailureCause::Pull(PullErrorCause::ReadyTimeout), "{out:?}");
    assert_eq!(failure.detail, "prefill never finished");
    assert_eq!(failure.to_string(), "ready_timeout: prefill never finished");
}

/// A P worker refusing a pull as `layout_mismatch` (P's engine has other ranks than the table D
/// cached): the load fails with that cause, and D's next request for the engine looks it up at
/// the bootstrap again instead of pulling by the stale table.
#[tokio::test]
async fn layout_mismatch_drops_the_cached_p_engine() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    h.pull(vec![h.meta("a", vec![1])]).await;
    let (id, pull) = h.next_pull().await;
    assert_eq!(h.bootstrap.calls(), 1);
    let err = PullErr {
        d_req_id: "a".into(),
        cause: PullErrorCause::LayoutMismatch,
        detail: "P has 2 tensor-parallel ranks, the pull saw 1".into(),
    };
    h.p.reply(&id, &PullResponse { err_reqs: vec![err], ..finish(&pull, &[]) });
    let out = h.settled("a", WAIT).await;
    assert_eq!(out.failed_recving["a"].cause, LoadFailureCause::Pull(PullErrorCause::LayoutMismatch), "{out:?}");

    h.pull(vec![h.meta("b", vec![2])]).await;
    let (id, pull) = h.next_pull().await;
    assert_eq!(h.bootstrap.calls(), 2, "the engine is looked up again");
    h.p.reply(&id, &finish(&pull, &["b"]));
    assert!(h.settled("b", WAIT).await.finished_recving.contains("b"));
}

#[tokio::test]
async fn silent_p_fails_after_pull_timeout_not_later() {
    let timeout = Duration::from_millis(300);
    let mut h = Harness::start(timeout).await;
    h.pull(vec![h.meta("a", vec![1])]).await;
    let started = Instant::now();
    let _ = h.next_pull().await;
    let out = h.settled("a", Duration::from_secs(3)).await;
    let elapsed = started.elapsed();
    // The error names the state and its deadline (lifecycle).
    assert!(out.failed_recving["a"].detail.contains("state `pulling` past its pull_timeout"), "{out:?}");
    assert!(elapsed >= timeout - Duration::from_millis(50) && elapsed < Duration::from_secs(2), "{elapsed:?}");
    // D told P to stop before giving the blocks up.
    match h.p.next_request().await.1 {
        SideChannelRequest::Abort(abort) => assert_eq!(abort.transfer_ids, vec!["xfer-a"]),
        other => panic!("expected an abort, got {other:?}"),
    }
}

#[tokio::test]
async fn an_engine_registered_while_its_look_up_runs_is_pulled_from() {
    // The bootstrap restarted with an empty table; P registers again a moment later.
    let mut h = Harness::start(Duration::from_secs(5)).await;
    let registered = h.bootstrap.body.lock().await.clone();
    *h.bootstrap.body.lock().await = serde_json::json!({});
    h.pull(vec![h.meta("a", vec![1])]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        h.receiver.ask(TransferStates).await.expect("alive"),
        BTreeMap::from([("a".into(), TransferState::LookingUp)]),
        "still looking P up, within its bootstrap_timeout"
    );
    *h.bootstrap.body.lock().await = registered;
    let (id, pull) = h.next_pull().await;
    h.p.reply(&id, &finish(&pull, &["a"]));
    let out = h.settled("a", WAIT).await;
    assert!(out.finished_recving.contains("a"), "{out:?}");
    assert!(h.bootstrap.calls() > 1, "asked again");
}

#[tokio::test]
async fn engine_missing_from_query_fails_naming_it() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    h.pull_from("ghost-engine", vec![h.meta("a", vec![1])]).await;
    let failure = h.settled("a", WAIT).await.failed_recving["a"].clone();
    assert_eq!(failure.cause, LoadFailureCause::Bootstrap, "{failure}");
    let reason = failure.detail;
    assert!(reason.contains("ghost-engine") && reason.contains(&h.bootstrap.addr), "{reason}");
    assert!(reason.contains("state `looking_up` past its bootstrap_timeout"), "{reason}");
    assert!(h.p.quiet_for(Duration::from_millis(100)).await, "no pull was sent");
}

#[tokio::test]
async fn an_engine_a_settled_table_does_not_name_fails_at_the_first_answer() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    *h.bootstrap.table_age_ms.lock().await = Some(60_000);
    h.pull_from("ghost-engine", vec![h.meta("a", vec![1])]).await;
    let failure = h.settled("a", WAIT).await.failed_recving["a"].clone();
    assert_eq!(failure.cause, LoadFailureCause::Bootstrap, "{failure}");
    assert!(failure.detail.contains("ghost-engine is not registered at bootstrap"), "{failure}");
    assert!(!failure.detail.contains("looking_up"), "failed at once, not at a deadline: {failure}");
    assert_eq!(h.bootstrap.calls(), 1, "a settled table is asked once");
}

#[tokio::test]
async fn a_refused_look_up_is_not_asked_again() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    *h.bootstrap.status.lock().await = Some(401);
    h.pull(vec![h.meta("a", vec![1])]).await;
    let failure = h.settled("a", WAIT).await.failed_recving["a"].clone();
    assert!(failure.detail.contains("401"), "{failure}");
    assert_eq!(h.bootstrap.calls(), 1, "a refusal is asked (and counted at the bootstrap) once");
}

#[tokio::test]
async fn a_restarted_bootstrap_is_asked_again_backing_off_until_the_deadline() {
    // A bootstrap with an empty table that does not say how old it is (a restart, or not
    // pdflow's): asked again within the 2 s look-up deadline, with growing pauses.
    let mut h = Harness::start(Duration::from_secs(5)).await;
    *h.bootstrap.body.lock().await = serde_json::json!({});
    h.pull(vec![h.meta("a", vec![1])]).await;
    let failure = h.settled("a", WAIT).await.failed_recving["a"].clone();
    assert!(failure.detail.contains("state `looking_up` past its bootstrap_timeout"), "{failure}");
    let calls = h.bootstrap.calls();
    // 50 ms pauses would make 40 calls in 2 s; doubling from 50 ms to 1 s makes 6.
    assert!((2..=8).contains(&calls), "{calls} calls in the look-up's 2 s");
}

#[tokio::test]
async fn a_request_naming_another_bootstrap_for_an_engine_reaches_no_other_request() {
    // Without a secret anyone may send D a request naming any bootstrap: one that claims P's
    // engine id (and another engine) for its own P must not be where other requests pull from.
    let mut h = Harness::start(Duration::from_secs(5)).await;
    let mut evil_p = FakeP::start().await;
    let evil = FakeBootstrap::start(P_ENGINE, &evil_p.addr).await;
    evil.body.lock().await["1"] =
        serde_json::json!({"engine_id": "other-engine", "worker_addr": {"0": {"0": evil_p.addr.clone()}}});
    let mut forged = h.meta("forged", vec![1]);
    forged.remote_bootstrap_addr = evil.addr.clone();
    h.pull(vec![forged]).await;
    let (id, pull) = match evil_p.next_request().await {
        (id, SideChannelRequest::Pull(pull)) => (id, pull),
        (_, other) => panic!("expected a pull, got {other:?}"),
    };
    evil_p.reply(&id, &finish(&pull, &["forged"]));
    h.settled("forged", WAIT).await;

    // The victim's request names P's own bootstrap: looked up there, pulled from the real P.
    h.pull(vec![h.meta("a", vec![2])]).await;
    let (id, pull) = h.next_pull().await;
    assert_eq!(pull.reqs[0].d_req_id.as_str(), "a");
    h.p.reply(&id, &finish(&pull, &["a"]));
    assert!(h.settled("a", WAIT).await.finished_recving.contains("a"));
    assert_eq!(h.bootstrap.calls(), 1, "P's own bootstrap was asked");
    assert!(evil_p.quiet_for(Duration::from_millis(100)).await, "nothing more reached the other P");
    // Nor did the other engine its answer named get cached: asked at the bootstrap named.
    *h.bootstrap.table_age_ms.lock().await = Some(60_000);
    h.pull_from("other-engine", vec![h.meta("b", vec![3])]).await;
    let failure = h.settled("b", WAIT).await.failed_recving["b"].clone();
    assert!(failure.detail.contains("other-engine is not registered at bootstrap"), "{failure}");
    assert_eq!(h.bootstrap.calls(), 2);
    assert!(evil_p.quiet_for(Duration::from_millis(100)).await, "nothing reached the other P");
}

#[tokio::test]
async fn unreachable_bootstrap_fails_naming_the_address() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    let mut meta = h.meta("a", vec![1]);
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    meta.remote_bootstrap_addr = format!("http://{}", dead.local_addr().expect("addr"));
    drop(dead);
    let addr = meta.remote_bootstrap_addr.clone();
    h.pull(vec![meta]).await;
    let failure = h.settled("a", WAIT).await.failed_recving["a"].clone();
    assert_eq!(failure.cause, LoadFailureCause::Bootstrap, "{failure}");
    assert!(failure.detail.contains(P_ENGINE) && failure.detail.contains(&addr), "{failure}");
}

#[tokio::test]
async fn garbage_reply_fails_the_request() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    h.pull(vec![h.meta("a", vec![1])]).await;
    let (id, _) = h.next_pull().await;
    h.p.reply_raw(&id, b"GARBAGE!".to_vec());
    let out = h.settled("a", WAIT).await;
    assert!(out.failed_recving["a"].detail.contains("not a pull response"), "{out:?}");
}

#[tokio::test]
async fn abort_in_flight_sends_abort_and_waits_for_p() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    h.pull(vec![h.meta("a", vec![1, 2])]).await;
    let (id, pull) = h.next_pull().await;
    h.abort("a").await;
    match h.p.next_request().await.1 {
        SideChannelRequest::Abort(abort) => {
            assert_eq!(abort.pull_id, pull.pull_id);
            assert_eq!(abort.transfer_ids, vec!["xfer-a"]);
        }
        other => panic!("expected an abort, got {other:?}"),
    }
    let out = h.collect().await;
    assert!(
        out.failed_recving.is_empty() && out.finished_recving.is_empty(),
        "nothing settles before P answers: {out:?}"
    );
    let err = PullErr { d_req_id: "a".into(), cause: PullErrorCause::CancelledByPeer, detail: "aborted by D".into() };
    h.p.reply(&id, &PullResponse { err_reqs: vec![err], ..finish(&pull, &[]) });
    let out = h.settled("a", WAIT).await;
    assert_eq!(out.failed_recving["a"].cause, LoadFailureCause::Pull(PullErrorCause::CancelledByPeer), "{out:?}");
}

#[tokio::test]
async fn killed_pull_task_fails_its_requests() {
    let mut h = Harness::start(Duration::from_secs(30)).await;
    h.pull(vec![h.meta("a", vec![1])]).await;
    let _ = h.next_pull().await;
    let tasks = h.receiver.ask(PullTaskRefs).await.expect("receiver answers");
    assert_eq!(tasks.len(), 1);
    tasks[0].kill();
    let out = h.settled("a", WAIT).await;
    assert!(out.failed_recving["a"].detail.contains("died"), "{out:?}");
    assert!(h.receiver.is_alive(), "the receiver survives its PullTask");
}

#[tokio::test]
async fn empty_block_ids_are_sent_but_not_reported() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    h.pull(vec![h.meta("gone", vec![]), h.meta("a", vec![1])]).await;
    let (id, pull) = h.next_pull().await;
    assert!(pull.reqs.iter().any(|r| r.d_req_id == "gone" && r.block_ids.is_empty()), "P is told to free");
    h.p.reply(&id, &finish(&pull, &["gone", "a"]));
    let out = h.settled("a", WAIT).await;
    assert!(!out.finished_recving.contains("gone") && !out.failed_recving.contains_key("gone"), "{out:?}");
}

#[tokio::test]
async fn unknown_layout_is_retried_once_with_the_full_layout() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    h.pull(vec![h.meta("a", vec![1])]).await;
    let (id, pull) = h.next_pull().await;
    h.p.reply(&id, &finish(&pull, &["a"]));
    h.settled("a", WAIT).await;

    h.pull(vec![h.meta("b", vec![2])]).await;
    let (id, pull) = h.next_pull().await;
    assert!(pull.layout.is_none());
    let unknown = PullErr { d_req_id: "b".into(), cause: PullErrorCause::UnknownLayout, detail: "P restarted".into() };
    h.p.reply(&id, &PullResponse { err_reqs: vec![unknown], layout_id: None, ..finish(&pull, &[]) });
    let (id, retry) = h.next_pull().await;
    assert!(retry.layout.is_some(), "the retry carries the full layout");
    assert_ne!(retry.pull_id, pull.pull_id);
    h.p.reply(&id, &finish(&retry, &["b"]));
    assert!(h.settled("b", WAIT).await.finished_recving.contains("b"));
}

#[tokio::test]
async fn one_bootstrap_spelled_two_ways_is_looked_up_once() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    h.pull(vec![h.meta("a", vec![1])]).await;
    let (id, pull) = h.next_pull().await;
    h.p.reply(&id, &finish(&pull, &["a"]));
    h.settled("a", WAIT).await;
    // vLLM's proxies may name the bootstrap without its scheme (and with a trailing slash).
    let mut meta = h.meta("b", vec![2]);
    meta.remote_bootstrap_addr = format!("{}/", h.bootstrap.addr.trim_start_matches("http://"));
    h.pull(vec![meta]).await;
    let (id, pull) = h.next_pull().await;
    h.p.reply(&id, &finish(&pull, &["b"]));
    assert!(h.settled("b", WAIT).await.finished_recving.contains("b"));
    assert_eq!(h.bootstrap.calls(), 1, "the cached look-up served both spellings");
}

#[tokio::test]
async fn dead_cached_worker_drops_the_cache_entry() {
    let mut h = Harness::start(Duration::from_millis(500)).await;
    h.pull(vec![h.meta("a", vec![1])]).await;
    let (id, pull) = h.next_pull().await;
    h.p.reply(&id, &finish(&pull, &["a"]));
    h.settled("a", WAIT).await;
    // P goes away: the cached address now refuses connections.
    let old = std::mem::replace(&mut h.p, FakeP::start().await);
    drop(old);
    h.pull(vec![h.meta("b", vec![2])]).await;
    h.settled("b", WAIT).await;
    // P registered again at a new address: the next request looks it up again and reaches it.
    *h.bootstrap.body.lock().await =
        serde_json::json!({"0": {"engine_id": P_ENGINE, "worker_addr": {"0": {"0": h.p.addr.clone()}}}});
    h.pull(vec![h.meta("c", vec![3])]).await;
    let (id, pull) = h.next_pull().await;
    h.p.reply(&id, &finish(&pull, &["c"]));
    assert!(h.settled("c", WAIT).await.finished_recving.contains("c"));
    assert_eq!(h.bootstrap.calls(), 2);
}

#[tokio::test]
async fn abort_during_lookup_fails_at_once_and_pull_only_frees() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    *h.bootstrap.gate.lock().await = true;
    h.pull(vec![h.meta("a", vec![1, 2])]).await;
    h.abort("a").await;
    let out = h.collect().await;
    assert_eq!(out.failed_recving["a"].cause, LoadFailureCause::AbortedByD, "{out:?}");
    assert!(out.failed_recving["a"].detail.contains("before its pull was sent"), "{out:?}");
    h.bootstrap.release.notify_waiters();
    h.bootstrap.release.notify_one();
    let (id, pull) = h.next_pull().await;
    assert!(pull.reqs[0].block_ids.is_empty(), "P is only told to free: nothing is written into D's freed blocks");
    h.p.reply(&id, &finish(&pull, &["a"]));
    h.collect().await;
    assert!(!h.collected.finished_recving.contains("a"), "{:?}", h.collected);
}

/// With `verify_checksums`, D checks its blocks against the digests P sent with its answer: equal
/// digests finish the load; a block that differs, or digests of other blocks, fail it (cause
/// `kv_mismatch`, the blocks named) instead of letting D decode from wrong KV.
#[tokio::test]
async fn p_block_digests_are_checked_and_a_differing_block_fails_the_load() {
    use pdflow_messages::sender_listener::BlockDigests;
    let mut h = Harness::start(Duration::from_secs(5)).await;
    // What D's blocks hold (the fake P writes nothing: a new cache's blocks).
    let d_blocks = KvCache::new(TINY, 32);
    let digests_of = |blocks: &[u32]| d_blocks.block_digests(blocks).expect("in range");
    let answer = |pull: &PullRequest, req: &str, digests: Vec<u64>| PullResponse {
        digests: vec![BlockDigests { d_req_id: req.into(), digests }],
        ..finish(pull, &[req])
    };

    h.pull(vec![h.meta("same", vec![3, 4, 5])]).await;
    let (id, pull) = h.next_pull().await;
    h.p.reply(&id, &answer(&pull, "same", digests_of(&[3, 4, 5])));
    let out = h.settled("same", WAIT).await;
    assert!(out.finished_recving.contains("same") && out.failed_recving.is_empty(), "{out:?}");

    let mut differ = digests_of(&[6, 7, 8]);
    differ[1] ^= 1;
    h.pull(vec![h.meta("differs", vec![6, 7, 8])]).await;
    let (id, pull) = h.next_pull().await;
    h.p.reply(&id, &answer(&pull, "differs", differ));
    let out = h.settled("differs", WAIT).await;
    let failure = out.failed_recving.get("differs").expect("failed, not finished");
    assert_eq!(failure.cause, LoadFailureCause::KvMismatch);
    assert!(failure.detail.contains("1 of 3 blocks differ") && failure.detail.contains("[7]"), "{}", failure.detail);

    h.pull(vec![h.meta("short", vec![9, 10])]).await;
    let (id, pull) = h.next_pull().await;
    h.p.reply(&id, &answer(&pull, "short", digests_of(&[9])));
    let failure = h.settled("short", WAIT).await.failed_recving.get("short").cloned().expect("failed");
    assert_eq!(failure.cause, LoadFailureCause::KvMismatch, "{}", failure.detail);
}
