//! Bad-input tests of D's Receiver, seed steps 19–21 and 34: pulls addressed to engine
//! ids P's bootstrap does not know, bootstraps that answer garbage, and garbage bootstrap or worker
//! addresses all fail the request cleanly (a reason naming the engine and the bootstrap, within the
//! deadlines), send nothing to P, and leave the Receiver serving the next valid pull.
//!
//! Against a real [`Bootstrap`] actor where the answer is well formed, a real axum stub where it is
//! not, and a scripted P side channel ([`FakeP`]), all on 127.0.0.1:0.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kameo::prelude::*;
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_messages::bootstrap::{BootstrapAddr, RegisterWorker};
use pdflow_messages::frame;
use pdflow_messages::receiver::{GetFinishedRecving, StartLoadKv};
use pdflow_messages::scheduler_connector::{ConnectorOutput, PullMeta};
use pdflow_messages::sender_listener::{PullRequest, PullResponse, PullStatus, SideChannelRequest};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use tokio::sync::Notify;

use super::fake_peers::{FakeP, WAIT};
use super::{Receiver, ReceiverArgs};
use crate::bootstrap::{Bootstrap, BootstrapArgs};

const P_ENGINE: &str = "p-engine-6c1f";
const TINY: KvShape = KvShape { num_layers: 2, num_kv_heads: 1, head_dim: 4, dtype_bytes: 2, block_size: 4 };
const PULL_TIMEOUT: Duration = Duration::from_millis(800);
const BOOTSTRAP_TIMEOUT: Duration = Duration::from_millis(800);

struct Harness {
    receiver: ActorRef<Receiver>,
    events: Arc<Notify>,
    p: FakeP,
    bootstrap: ActorRef<Bootstrap>,
    /// `http://127.0.0.1:PORT` of the real bootstrap.
    bootstrap_addr: String,
    collected: ConnectorOutput,
    next_req: u32,
}

impl Harness {
    /// A real bootstrap with P's engine registered (tp 0, pp 0 at the fake P), and a receiver.
    async fn start() -> Self {
        Self::start_with(PULL_TIMEOUT).await
    }

    async fn start_with(pull_timeout: Duration) -> Self {
        let p = FakeP::start().await;
        let bootstrap = Bootstrap::spawn(BootstrapArgs {
            bind: "127.0.0.1:0".parse().expect("addr"),
            secret: None,
            insecure: false,
        });
        let addr = tokio::time::timeout(WAIT, bootstrap.ask(BootstrapAddr))
            .await
            .expect("in time")
            .expect("bootstrap started");
        register(&bootstrap, P_ENGINE, 0, &p.addr).await;
        let events = Arc::new(Notify::new());
        let receiver = Receiver::spawn(ReceiverArgs {
            auth: crate::side_channel_auth::PullAuth::default(),
            faults: crate::fault_seam::no_faults(),
            engine_id: "d-engine".into(),
            rank: crate::ranks::WorkerRank::single(TINY),
            kv_cache: KvCache::new(TINY, 16),
            data_addr: "127.0.0.1:9".into(),
            pull_timeout,
            bootstrap_timeout: BOOTSTRAP_TIMEOUT,
            events: events.clone(),
            verify_checksums: false,
            fence: None,
        });
        Self {
            receiver,
            events,
            p,
            bootstrap,
            bootstrap_addr: format!("http://{addr}"),
            collected: ConnectorOutput::default(),
            next_req: 0,
        }
    }

    /// Starts one request's pull for `engine_id` at `bootstrap_addr`; returns its request id.
    async fn pull(&mut self, engine_id: &str, bootstrap_addr: &str) -> String {
        self.next_req += 1;
        let req = format!("cmpl-d-{}", self.next_req);
        let meta = PullMeta {
            d_req_id: req.clone().into(),
            transfer_id: format!("xfer-{req}").into(),
            local_block_ids: vec![1, 2].into(),
            remote_engine_id: engine_id.into(),
            remote_bootstrap_addr: bootstrap_addr.into(),
            traceparent: None,
        };
        let msg = StartLoadKv {
            reqs_to_recv: BTreeMap::from([(engine_id.into(), BTreeMap::from([(req.clone().into(), meta)]))]),
            reqs_to_abort: BTreeSet::new(),
        };
        self.receiver.tell(msg).await.expect("receiver alive");
        req
    }

    /// Waits (bounded) until `req` settles; returns its failure reason, or `None` when it finished.
    async fn outcome(&mut self, req: &str, within: Duration) -> Option<String> {
        let events = self.events.clone();
        let done = tokio::time::timeout(within, async {
            loop {
                let notified = events.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let out = self.receiver.ask(GetFinishedRecving).await.expect("receiver answers");
                self.collected.merge(out);
                if self.collected.finished_recving.contains(req) || self.collected.failed_recving.contains_key(req) {
                    return;
                }
                notified.await;
            }
        })
        .await;
        assert!(done.is_ok(), "request {req} not settled within {within:?}: {:?}", self.collected);
        self.collected.failed_recving.get(req).map(|f| f.to_string())
    }

    /// Fails the test unless `req` fails with a reason that contains each of `needles`.
    async fn fails_naming(&mut self, req: &str, needles: &[&str]) -> String {
        let reason = self.outcome(req, WAIT).await.unwrap_or_else(|| panic!("{req} should fail"));
        for n in needles {
            assert!(reason.contains(n), "reason of {req} should name {n:?}: {reason}");
        }
        reason
    }

    /// The next pull P receives (aborts of earlier, timed-out pulls are skipped).
    async fn next_pull(&mut self) -> (Bytes, PullRequest) {
        loop {
            match self.p.next_request().await {
                (id, SideChannelRequest::Pull(pull)) => return (id, pull),
                (_, SideChannelRequest::Abort(_)) => continue,
            }
        }
    }

    /// The receiver still serves: a pull for the registered engine reaches P and completes.
    async fn still_serves(&mut self) {
        let addr = self.bootstrap_addr.clone();
        let req = self.pull(P_ENGINE, &addr).await;
        let (id, pull) = self.next_pull().await;
        assert_eq!(pull.reqs.len(), 1, "only the valid request reaches P: {pull:?}");
        assert_eq!(pull.reqs[0].d_req_id, req);
        self.p.reply(
            &id,
            &PullResponse {
                pull_id: pull.pull_id,
                status: PullStatus::Finish,
                ok_reqs: vec![req.clone().into()],
                digests: vec![],
                err_reqs: vec![],
                layout_id: Some(pull.layout_id),
                error: None,
                p_generation: 0,
            },
        );
        assert_eq!(self.outcome(&req, WAIT).await, None, "the valid pull completes");
        assert!(self.receiver.is_alive());
    }
}

async fn register(bootstrap: &ActorRef<Bootstrap>, engine_id: &str, dp_rank: u32, addr: &str) {
    let w = RegisterWorker {
        engine_id: engine_id.into(),
        dp_rank,
        tp_rank: 0,
        pp_rank: 0,
        addr: addr.into(),
        generation: 0,
    };
    tokio::time::timeout(WAIT, bootstrap.ask(w)).await.expect("in time").expect("registered");
}

/// A bootstrap stub whose `/query` answers `status` with `body` (any bytes) and `content_type`.
async fn bad_bootstrap(
    status: u16,
    content_type: &'static str,
    body: &'static [u8],
) -> (String, tokio::task::JoinHandle<()>) {
    let router = axum::Router::new().route(
        "/query",
        axum::routing::get(move || async move {
            let status = axum::http::StatusCode::from_u16(status).expect("a status");
            (status, [(axum::http::header::CONTENT_TYPE, content_type)], body)
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let addr = format!("http://{}", listener.local_addr().expect("addr"));
    (
        addr,
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        }),
    )
}

#[tokio::test]
async fn a_pull_for_an_engine_the_real_bootstrap_does_not_know_fails_naming_it() {
    let mut h = Harness::start().await;
    let addr = h.bootstrap_addr.clone();
    let req = h.pull("ghost-engine", &addr).await;
    let reason = h.fails_naming(&req, &["ghost-engine", &addr, "not registered", P_ENGINE]).await;
    assert!(reason.contains("is that P up and registered there?"), "{reason}");
    assert!(h.p.quiet_for(Duration::from_millis(100)).await, "nothing was sent to P");
    h.still_serves().await;
    // An empty engine id is just another unknown one.
    let req = h.pull("", &addr).await;
    h.fails_naming(&req, &[&addr]).await;
    h.still_serves().await;
}

#[tokio::test]
async fn an_empty_bootstrap_table_fails_the_pull() {
    let mut h = Harness::start().await;
    let empty =
        Bootstrap::spawn(BootstrapArgs { bind: "127.0.0.1:0".parse().expect("addr"), secret: None, insecure: false });
    let addr = format!("http://{}", empty.ask(BootstrapAddr).await.expect("started"));
    let req = h.pull(P_ENGINE, &addr).await;
    h.fails_naming(&req, &[P_ENGINE, &addr, "not registered"]).await;
    assert!(h.p.quiet_for(Duration::from_millis(100)).await, "nothing was sent to P");
    h.still_serves().await;
}

#[test]
fn arbitrary_unknown_engine_ids_fail_cleanly_and_the_receiver_keeps_serving() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let h = std::cell::RefCell::new(rt.block_on(Harness::start()));
    let addr = h.borrow().bootstrap_addr.clone();
    let mut runner = TestRunner::new(Config { cases: 24, failure_persistence: None, ..Config::default() });
    let ids = prop_oneof![prop::collection::vec(any::<char>(), 0..24).prop_map(String::from_iter), "[a-z0-9-]{1,16}"];
    runner
        .run(&ids, |engine_id| {
            prop_assume!(engine_id != P_ENGINE);
            let mut h = h.borrow_mut();
            rt.block_on(async {
                let req = h.pull(&engine_id, &addr).await;
                let reason = h.outcome(&req, WAIT).await;
                prop_assert!(
                    reason.as_deref().is_some_and(|r| r.contains(&engine_id) && r.contains(&addr)),
                    "{:?}",
                    reason
                );
                prop_assert!(h.p.quiet_for(Duration::from_millis(20)).await, "nothing was sent to P");
                prop_assert!(h.receiver.is_alive());
                Ok(())
            })
        })
        .expect("every unknown engine id fails cleanly");
    rt.block_on(h.borrow_mut().still_serves());
}

#[tokio::test]
async fn garbage_query_answers_fail_the_pull_cleanly() {
    let mut h = Harness::start().await;
    let answers: [(u16, &'static str, &'static [u8], &str); 7] = [
        (200, "application/json", b"{not json", "not a /query answer"),
        (200, "application/json", b"[1, 2, 3]", "not a /query answer"),
        (200, "application/json", br#"{"0": {"engine_id": 7}}"#, "not a /query answer"),
        (
            200,
            "application/json",
            br#"{"0": {"engine_id": "p", "worker_addr": {"zero": {"0": "tcp://h:1"}}}}"#,
            "non-numeric rank key `zero`",
        ),
        (200, "text/html", b"<html>hello</html>", "not a /query answer"),
        (404, "text/plain", b"no such route", "HTTP 404"),
        (500, "application/json", br#"{"error": "boom"}"#, "HTTP 500"),
    ];
    for (status, content_type, body, expected) in answers {
        let (addr, server) = bad_bootstrap(status, content_type, body).await;
        let req = h.pull("p", &addr).await;
        h.fails_naming(&req, &["p", &addr, expected]).await;
        server.abort();
    }
    assert!(h.p.quiet_for(Duration::from_millis(100)).await, "nothing was sent to P");
    h.still_serves().await;
}

#[tokio::test]
async fn a_bootstrap_that_never_answers_fails_within_bootstrap_timeout() {
    let mut h = Harness::start().await;
    // Accepts connections, never answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let addr = format!("http://{}", silent.local_addr().expect("addr"));
    let started = Instant::now();
    let req = h.pull(P_ENGINE, &addr).await;
    h.fails_naming(&req, &[P_ENGINE, &addr]).await;
    let elapsed = started.elapsed();
    assert!(
        elapsed >= BOOTSTRAP_TIMEOUT - Duration::from_millis(50)
            && elapsed < BOOTSTRAP_TIMEOUT + Duration::from_secs(2),
        "{elapsed:?}"
    );
    drop(silent);
    h.still_serves().await;
}

#[tokio::test]
async fn garbage_bootstrap_addresses_fail_cleanly() {
    let mut h = Harness::start().await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("binds").local_addr().expect("addr").to_string();
    for addr in ["", "not a url at all", "http://[::1", "ftp://127.0.0.1:1", "http://127.0.0.1:99999", closed.as_str()]
    {
        let req = h.pull(P_ENGINE, addr).await;
        h.fails_naming(&req, &[P_ENGINE]).await;
        // The failed look-up cached nothing: the next request for the same engine looks it up again.
    }
    assert!(h.p.quiet_for(Duration::from_millis(100)).await, "nothing was sent to P");
    h.still_serves().await;
}

#[tokio::test]
async fn garbage_worker_addresses_from_bootstrap_fail_within_pull_timeout() {
    let mut h = Harness::start().await;
    let addr = h.bootstrap_addr.clone();
    for (dp, engine, worker) in
        [(1, "bad-addr-1", "not-an-endpoint"), (2, "bad-addr-2", "tcp://"), (3, "bad-addr-3", "tcp://127.0.0.1:1")]
    {
        register(&h.bootstrap, engine, dp, worker).await;
        let started = Instant::now();
        let req = h.pull(engine, &addr).await;
        let reason = h.outcome(&req, PULL_TIMEOUT + WAIT).await;
        assert!(reason.is_some(), "{engine} at {worker:?} cannot have succeeded");
        assert!(started.elapsed() < PULL_TIMEOUT + Duration::from_secs(3), "{engine}: {:?}", started.elapsed());
        assert!(h.receiver.is_alive());
    }
    h.still_serves().await;
}

/// A structured mutation of P's answer, as a broken or hostile P could send it.
#[derive(Debug, Clone)]
enum Mutation {
    Truncate(usize),
    FlipBit(usize, u8),
    SetByte(usize, u8),
    Trailing(u8),
    Garbage(Vec<u8>),
}

fn mutate(frame: &[u8], m: &Mutation) -> Vec<u8> {
    let mut out = frame.to_vec();
    match m {
        Mutation::Truncate(i) => out.truncate(i % frame.len()),
        Mutation::FlipBit(i, b) => out[i % frame.len()] ^= 1 << (b % 8),
        Mutation::SetByte(i, v) => out[i % frame.len()] = *v,
        Mutation::Trailing(v) => out.push(*v),
        Mutation::Garbage(g) => out = g.clone(),
    }
    out
}

#[test]
fn mutated_or_garbage_pull_responses_settle_the_request_and_the_receiver_keeps_serving() {
    const SHORT_PULL_TIMEOUT: Duration = Duration::from_millis(300);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let h = std::cell::RefCell::new(rt.block_on(Harness::start_with(SHORT_PULL_TIMEOUT)));
    let addr = h.borrow().bootstrap_addr.clone();
    let mut runner = TestRunner::new(Config { cases: 32, failure_persistence: None, ..Config::default() });
    let mutation = prop_oneof![
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::FlipBit(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, v)| Mutation::SetByte(i, v)),
        any::<u8>().prop_map(Mutation::Trailing),
        prop::collection::vec(any::<u8>(), 0..64).prop_map(Mutation::Garbage),
    ];
    runner
        .run(&mutation, |m| {
            let mut h = h.borrow_mut();
            rt.block_on(async {
                let req = h.pull(P_ENGINE, &addr).await;
                let (id, pull) = h.next_pull().await;
                let valid = PullResponse {
                    pull_id: pull.pull_id,
                    status: PullStatus::Finish,
                    ok_reqs: vec![req.clone().into()],
                    digests: vec![],
                    err_reqs: vec![],
                    layout_id: Some(pull.layout_id),
                    error: None,
                    p_generation: 0,
                };
                let bytes = mutate(&frame::encode(&valid).expect("encodes"), &m);
                let decoded = frame::decode::<PullResponse>(&bytes, "pull response");
                h.p.reply_raw(&id, bytes);
                // Settled either way, within the pull's deadline (a garbage answer at once).
                let outcome = h.outcome(&req, SHORT_PULL_TIMEOUT + WAIT).await;
                match &decoded {
                    Err(e) => prop_assert!(
                        outcome.as_deref().is_some_and(|r| r.contains("not a pull response")),
                        "{:?} then {:?}",
                        e,
                        outcome
                    ),
                    Ok(resp) if *resp == valid => prop_assert_eq!(outcome, None),
                    Ok(_) => {}
                }
                prop_assert!(h.receiver.is_alive());
                Ok(())
            })
        })
        .expect("every answer settles the request");
    rt.block_on(h.borrow_mut().still_serves());
}
