//! P/D tests of the engine through a minimal in-test connector with Mooncake's semantics (a test
//! double only; the real connector is the SchedulerConnector actor): P delays its free until the
//! worker reports `finished_sending`; D loads asynchronously (`WAITING_FOR_REMOTE_KVS`), the test
//! copies P's blocks into D's and reports `finished_recving`, and D resumes at `prompt − 1`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use pdflow_messages::kv_groups::GroupBlocks;
use pdflow_messages::kv_transfer_params::KvTransferParams;
use pdflow_messages::scheduler_connector::*;
use pdflow_messages::sender_listener::PullErrorCause;
use pdflow_messages::{EngineId, RequestId, TransferId};
use tokio::sync::{mpsc, Notify};

use super::ranks_tests::copy_across;
use super::tests::{http, prompt, request, run, serve, small_config, start, wait_stats, DEADLINE, SMALL};
use super::tests_ranked::start_topology;
use super::*;
use pdflow_connector::{Connector, ConnectorError, SchedulerConnectorPort, WorkerConnectorPort};
use pdflow_kv::memory::KvShape;

#[derive(Default)]
pub(crate) struct SchedState {
    reqs_need_send: BTreeMap<RequestId, (TransferId, GroupBlocks)>,
    reqs_need_recv: BTreeMap<EngineId, BTreeMap<RequestId, PullMeta>>,
    reqs_not_processed: BTreeSet<TransferId>,
    reqs_to_abort: BTreeSet<RequestId>,
    /// (request id, num_external_tokens, blocks) of every `update_state_after_alloc`.
    pub(crate) allocs: Vec<(RequestId, usize, usize)>,
    finished: Vec<(RequestId, FinishStatus)>,
}

#[derive(Default)]
pub(crate) struct TestScheduler(pub(crate) Mutex<SchedState>);

impl SchedulerConnectorPort for TestScheduler {
    fn get_num_new_matched_tokens(
        &self,
        msg: GetNumNewMatchedTokens,
    ) -> BoxFuture<'_, Result<MatchedTokens, ConnectorError>> {
        let p = msg.request.kv_transfer_params.unwrap_or_default();
        let count = if p.do_remote_prefill { msg.request.prompt_len - msg.num_computed_tokens } else { 0 };
        Box::pin(async move { Ok(MatchedTokens::tokens(count)) })
    }
    fn update_state_after_alloc(
        &self,
        msg: UpdateStateAfterAlloc,
    ) -> BoxFuture<'_, Result<Option<KvTransferParams>, ConnectorError>> {
        let mut st = self.0.lock().expect("lock");
        st.allocs.push((msg.request.request_id.clone(), msg.num_external_tokens, msg.block_ids.len()));
        let mut p = msg.request.kv_transfer_params.clone().unwrap_or_default();
        let reply = if p.do_remote_prefill && msg.num_external_tokens > 0 {
            let engine: EngineId = p.remote_engine_id.clone().unwrap_or_default().into();
            let pull = PullMeta {
                d_req_id: msg.request.request_id.clone(),
                transfer_id: p.transfer_id.clone().unwrap_or_default().into(),
                local_block_ids: msg.block_ids,
                remote_engine_id: engine.clone(),
                remote_bootstrap_addr: p.remote_bootstrap_addr.clone().unwrap_or_default(),
                traceparent: None,
            };
            st.reqs_need_recv.entry(engine).or_default().insert(msg.request.request_id, pull);
            p.do_remote_prefill = false;
            Some(p)
        } else {
            if p.do_remote_decode {
                st.reqs_need_send.insert(
                    msg.request.request_id,
                    (p.transfer_id.clone().unwrap_or_default().into(), GroupBlocks::default()),
                );
            }
            None
        };
        Box::pin(async move { Ok(reply) })
    }
    fn build_connector_meta(&self, _: BuildConnectorMeta) -> BoxFuture<'_, Result<ConnectorMetadata, ConnectorError>> {
        let mut st = self.0.lock().expect("lock");
        let meta = ConnectorMetadata {
            reqs_to_send: std::mem::take(&mut st.reqs_need_send),
            reqs_to_recv: std::mem::take(&mut st.reqs_need_recv),
            reqs_not_processed: std::mem::take(&mut st.reqs_not_processed),
            reqs_to_abort: std::mem::take(&mut st.reqs_to_abort),
            traceparents: BTreeMap::new(),
            reqs_to_save: BTreeMap::new(),
        };
        Box::pin(async move { Ok(meta) })
    }
    fn request_finished(&self, msg: RequestFinished) -> BoxFuture<'_, Result<RequestFinishedReply, ConnectorError>> {
        let mut st = self.0.lock().expect("lock");
        st.finished.push((msg.request.request_id.clone(), msg.status));
        let p = msg.request.kv_transfer_params.clone().unwrap_or_default();
        let tid: TransferId = p.transfer_id.clone().unwrap_or_default().into();
        let mut delay = false;
        if p.do_remote_prefill
            || (msg.status == FinishStatus::Aborted
                && msg.request.kv_transfer_params.as_ref().is_some_and(|p| p.remote_engine_id.is_some()))
        {
            st.reqs_to_abort.insert(msg.request.request_id.clone());
        } else if p.do_remote_decode {
            if msg.status != FinishStatus::LengthCapped {
                st.reqs_not_processed.insert(tid);
            } else {
                delay = !msg.block_ids.is_empty();
                if delay {
                    st.reqs_need_send.insert(msg.request.request_id, (tid, msg.block_ids));
                }
            }
        }
        Box::pin(async move { Ok(RequestFinishedReply { delay_free_blocks: delay, kv_transfer_params: None }) })
    }
    fn update_connector_output(&self, _output: ConnectorOutput) -> BoxFuture<'_, Result<(), ConnectorError>> {
        Box::pin(async { Ok(()) })
    }
}

pub(crate) struct TestWorker {
    metas: mpsc::UnboundedSender<ConnectorMetadata>,
    pending: Mutex<ConnectorOutput>,
    events: Arc<Notify>,
}

impl TestWorker {
    pub(crate) fn report(&self, out: ConnectorOutput) {
        self.pending.lock().expect("lock").merge(out);
        self.events.notify_one();
    }
}

impl WorkerConnectorPort for TestWorker {
    fn start_load_kv(&self, meta: ConnectorMetadata) -> BoxFuture<'_, Result<(), ConnectorError>> {
        if !meta.is_empty() {
            let _ = self.metas.send(meta);
        }
        Box::pin(async { Ok(()) })
    }
    fn get_finished(&self) -> BoxFuture<'_, Result<ConnectorOutput, ConnectorError>> {
        let out = std::mem::take(&mut *self.pending.lock().expect("lock"));
        Box::pin(async move { Ok(out) })
    }
    fn kv_events(&self) -> Arc<Notify> {
        self.events.clone()
    }
    fn save_kv_layer(&self, _: usize, _: &BTreeMap<RequestId, LayerSave>) {}
}

pub(crate) struct Side {
    pub(crate) engine: EngineHandle,
    pub(crate) sched: Arc<TestScheduler>,
    pub(crate) worker: Arc<TestWorker>,
    metas: mpsc::UnboundedReceiver<ConnectorMetadata>,
}

pub(crate) fn side(config: EngineConfig) -> Side {
    side_with(|connector| start(config, Some(connector)))
}

/// A side whose engine runs the model over tp × pp ranks.
fn side_ranked(config: EngineConfig, (tp, pp): (usize, usize)) -> Side {
    side_with(|connector| start_topology(config, tp, pp, Some(connector)))
}

fn side_with(start: impl FnOnce(Connector) -> EngineHandle) -> Side {
    let (tx, metas) = mpsc::unbounded_channel();
    let sched = Arc::new(TestScheduler::default());
    let worker = Arc::new(TestWorker {
        metas: tx,
        pending: Mutex::new(ConnectorOutput::default()),
        events: Arc::new(Notify::new()),
    });
    let connector = Connector { scheduler: sched.clone(), worker: worker.clone() };
    Side { engine: start(connector), sched, worker, metas }
}

impl Side {
    /// The first metadata `pick` accepts (bounded wait).
    pub(crate) async fn meta<T>(&mut self, mut pick: impl FnMut(&ConnectorMetadata) -> Option<T>) -> T {
        loop {
            let meta = tokio::time::timeout(DEADLINE, self.metas.recv())
                .await
                .expect("metadata in time")
                .expect("engine alive");
            if let Some(t) = pick(&meta) {
                return t;
            }
        }
    }
    pub(crate) fn baseline(&self) -> BlockStats {
        let n = self.engine.config().num_blocks;
        BlockStats {
            total: n,
            free: n,
            requests: 0,
            finished: self.engine.block_stats().finished,
            ..BlockStats::default()
        }
    }
}

pub(crate) fn p_request(id: &str, prompt: Vec<u32>) -> EngineRequest {
    EngineRequest {
        kv_transfer_params: Some(KvTransferParams::for_prefill(format!("xfer-{id}"))),
        ..request(id, prompt, 1)
    }
}

pub(crate) fn d_request(id: &str, prompt: Vec<u32>, max_tokens: usize, p_engine: &str) -> EngineRequest {
    let params = KvTransferParams::for_decode(format!("xfer-{id}"), "http://127.0.0.1:1", p_engine);
    EngineRequest { kv_transfer_params: Some(params), ..request(id, prompt, max_tokens) }
}

/// The seed's flow at small scale: P prefill + delayed free, transfer, D resume at prompt − 1.
async fn p_then_d_equals_single_engine(shape: KvShape, prompt_len: u32, max_tokens: usize, p_budget: usize) {
    p_then_d_over_ranks_equals_single_engine(shape, prompt_len, max_tokens, p_budget, None).await;
}

/// [`p_then_d_equals_single_engine`] with P and D sharded over `(tp, pp)` ranks each, when
/// `topologies` names them: the transfer copies each (layer, head) from a P rank holding it into
/// every D rank holding it.
async fn p_then_d_over_ranks_equals_single_engine(
    shape: KvShape,
    prompt_len: u32,
    max_tokens: usize,
    p_budget: usize,
    topologies: Option<((usize, usize), (usize, usize))>,
) {
    let config = |budget| EngineConfig {
        shape,
        num_blocks: 12,
        max_num_batched_tokens: budget,
        max_model_len: 256,
        vocab_size: 1000,
        ..EngineConfig::default()
    };
    let single = start(config(8192), None);
    let (want, _, _) = run(&single, request("ref", prompt(prompt_len), max_tokens)).await;
    let (mut p, mut d) = match topologies {
        None => (side(config(p_budget)), side(config(8192))),
        Some((p_ranks, d_ranks)) => (side_ranked(config(p_budget), p_ranks), side_ranked(config(8192), d_ranks)),
    };
    let p_id = p.engine.config().engine_id.clone();
    let mut d_stream =
        d.engine.add_request(d_request("r1", prompt(prompt_len), max_tokens, &p_id)).await.expect("accepted");
    // Steps 17–18: D waits for remote KV, its pull names its blocks.
    let d_blocks = d
        .meta(|m| m.reqs_to_recv.get(p_id.as_str()).and_then(|r| r.get("r1")).map(|pull| pull.local_block_ids.flat()))
        .await;
    assert_eq!(d_blocks.len(), shape.blocks_for(prompt_len as usize));
    // Steps 11–15, 23–24: P prefills (chunked or not) and finishes length-capped with one token.
    let (p_tokens, p_status, _) = run(&p.engine, p_request("r1", prompt(prompt_len))).await;
    assert_eq!((p_tokens, p_status), (vec![want[0]], FinishStatus::LengthCapped));
    // Step 13 then 26: reqs_to_send first without blocks, then with them (after the finish).
    let first = p.meta(|m| m.reqs_to_send.get("r1").cloned()).await;
    assert_eq!(first, ("xfer-r1".into(), GroupBlocks::default()));
    let (_, p_blocks) = p.meta(|m| m.reqs_to_send.get("r1").filter(|(_, b)| !b.is_empty()).cloned()).await;
    let p_blocks = p_blocks.flat();
    assert_eq!(p_blocks.len(), d_blocks.len());
    // Delayed free: P still holds the blocks and the request.
    let held = p.engine.block_stats();
    assert_eq!((held.requests, held.free), (1, held.total - p_blocks.len()));
    // Steps 29–35: the "transfer", then both workers report.
    copy_across(p.engine.rank_caches(), &p_blocks, d.engine.rank_caches(), &d_blocks);
    p.worker.report(ConnectorOutput { finished_sending: ["r1".into()].into(), ..Default::default() });
    d.worker.report(ConnectorOutput { finished_recving: ["r1".into()].into(), ..Default::default() });
    let mut got = Vec::new();
    let status = loop {
        let out = tokio::time::timeout(DEADLINE, d_stream.next_output()).await.expect("in time").expect("output");
        got.extend(out.new_token_ids);
        if let Some(s) = out.finish {
            break s;
        }
    };
    assert_eq!((got, status), (want, FinishStatus::LengthCapped));
    wait_stats(&p.engine, p.baseline()).await;
    wait_stats(&d.engine, d.baseline()).await;
    // D: update_state_after_alloc twice, the second without external tokens; P: once.
    let d_allocs: Vec<usize> = d.sched.0.lock().expect("lock").allocs.iter().map(|a| a.1).collect();
    assert_eq!(d_allocs, vec![prompt_len as usize, 0]);
    assert_eq!(p.sched.0.lock().expect("lock").allocs.len(), 1);
}

#[tokio::test]
async fn p_d_run_equals_a_single_engine() {
    p_then_d_equals_single_engine(SMALL, 21, 6, 8192).await;
}

#[tokio::test]
async fn p_d_run_with_chunked_prefill_on_p_equals_a_single_engine() {
    p_then_d_equals_single_engine(SMALL, 21, 6, 5).await;
}

#[tokio::test]
async fn p_d_run_qwen3_8b_shape() {
    p_then_d_equals_single_engine(KvShape::QWEN3_8B, 20, 3, 8192).await;
}

#[tokio::test]
async fn p_d_run_between_topologies_equals_a_single_engine() {
    for (p_ranks, d_ranks) in [((2, 1), (1, 1)), ((2, 1), (4, 2)), ((1, 2), (2, 1)), ((4, 1), (1, 2))] {
        p_then_d_over_ranks_equals_single_engine(SMALL, 21, 5, 5, Some((p_ranks, d_ranks))).await;
    }
}

#[tokio::test]
async fn failed_recv_recomputes_or_fails_by_policy() {
    let single = start(small_config(32, 8192), None);
    let (want, _, _) = run(&single, request("ref", prompt(13), 5)).await;
    for policy in [LoadFailurePolicy::Recompute, LoadFailurePolicy::Fail] {
        let mut d = side(EngineConfig { kv_load_failure_policy: policy, ..small_config(32, 8192) });
        let handle = d.engine.clone();
        let task = tokio::spawn(async move { run(&handle, d_request("r", prompt(13), 5, "p-engine")).await });
        d.meta(|m| (!m.reqs_to_recv.is_empty()).then_some(())).await;
        d.worker.report(ConnectorOutput {
            failed_recving: [(
                "r".into(),
                LoadFailure::new(LoadFailureCause::Pull(PullErrorCause::TransferFailed), "peer gone"),
            )]
            .into(),
            ..Default::default()
        });
        let (tokens, status, error) = tokio::time::timeout(DEADLINE, task).await.expect("in time").expect("joined");
        match policy {
            LoadFailurePolicy::Recompute => assert_eq!((tokens, status), (want.clone(), FinishStatus::LengthCapped)),
            LoadFailurePolicy::Fail => {
                assert_eq!(status, FinishStatus::Error);
                assert!(error.unwrap_or_default().contains("peer gone"));
            }
        }
        wait_stats(&d.engine, d.baseline()).await;
    }
}

#[tokio::test]
async fn aborted_while_waiting_for_kv_holds_blocks_until_the_worker_reports() {
    let mut d = side(small_config(32, 8192));
    let stream = d.engine.add_request(d_request("r", prompt(13), 5, "p-engine")).await.expect("accepted");
    d.meta(|m| (!m.reqs_to_recv.is_empty()).then_some(())).await;
    drop(stream);
    let aborted = d.meta(|m| m.reqs_to_abort.contains("r").then_some(())).await;
    assert_eq!(aborted, ());
    // A late write could still land: the blocks stay held.
    let held = d.engine.block_stats();
    assert_eq!((held.requests, held.free), (1, 32 - 4));
    assert_eq!(d.sched.0.lock().expect("lock").finished, vec![("r".into(), FinishStatus::Aborted)]);
    d.worker.report(ConnectorOutput { finished_recving: ["r".into()].into(), ..Default::default() });
    wait_stats(&d.engine, d.baseline()).await;
}

#[tokio::test]
async fn p_first_token_stop_frees_at_once_and_is_not_processed() {
    let single = start(small_config(32, 8192), None);
    let (want, _, _) = run(&single, request("ref", prompt(13), 1)).await;
    let mut p = side(small_config(32, 8192));
    let mut req = p_request("r", prompt(13));
    req.stop_token_ids = want.clone();
    let (_, status, _) = run(&p.engine, req).await;
    assert_eq!(status, FinishStatus::Stopped);
    let not_processed = p.meta(|m| m.reqs_not_processed.contains("xfer-r").then_some(())).await;
    assert_eq!(not_processed, ());
    wait_stats(&p.engine, p.baseline()).await;
}

#[tokio::test]
async fn http_kv_load_failure_with_policy_fail_is_a_500() {
    let mut d = side(EngineConfig { kv_load_failure_policy: LoadFailurePolicy::Fail, ..small_config(32, 8192) });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let router = api::router(d.engine.clone());
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    let body = serde_json::json!({"prompt": prompt(9), "max_tokens": 3,
        "kv_transfer_params": KvTransferParams::for_decode("xfer-h", "http://127.0.0.1:1", "p-engine")});
    let client = tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let body = body.to_string();
        let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let req = format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
        sock.write_all(req.as_bytes()).await.expect("write");
        let mut raw = Vec::new();
        sock.read_to_end(&mut raw).await.expect("read");
        String::from_utf8_lossy(&raw).to_string()
    });
    let d_req = d.meta(|m| m.reqs_to_recv.get("p-engine").and_then(|r| r.keys().next().cloned())).await;
    d.worker.report(ConnectorOutput {
        failed_recving: [(
            d_req,
            LoadFailure::new(LoadFailureCause::Pull(PullErrorCause::TransferFailed), "transfer timed out"),
        )]
        .into(),
        ..Default::default()
    });
    let raw = tokio::time::timeout(DEADLINE, client).await.expect("in time").expect("joined");
    assert!(raw.starts_with("HTTP/1.1 500"), "{raw}");
    assert!(raw.contains("transfer timed out") && raw.contains("\"code\":500"));
    wait_stats(&d.engine, d.baseline()).await;
}

// On tokio's paused clock: the deadline passes in virtual time, at once, and is checked exactly.
#[tokio::test(start_paused = true)]
async fn a_load_nobody_reports_ends_at_the_kv_state_deadline_by_policy() {
    // The connector lost track of the request (its actor restarted): nothing is ever reported.
    let single = start(small_config(32, 8192), None);
    let (want, _, _) = run(&single, request("ref", prompt(13), 5)).await;
    let timeout = std::time::Duration::from_millis(300);
    for policy in [LoadFailurePolicy::Recompute, LoadFailurePolicy::Fail] {
        let mut d = side(EngineConfig {
            kv_load_failure_policy: policy,
            kv_state_timeout: Some(timeout),
            ..small_config(32, 8192)
        });
        let handle = d.engine.clone();
        let started = tokio::time::Instant::now();
        let task = tokio::spawn(async move { run(&handle, d_request("r", prompt(13), 5, "p-engine")).await });
        d.meta(|m| (!m.reqs_to_recv.is_empty()).then_some(())).await;
        let (tokens, status, error) = tokio::time::timeout(DEADLINE, task).await.expect("in time").expect("joined");
        let ended = started.elapsed();
        assert!(ended >= timeout, "not before the deadline");
        assert!(ended < timeout + std::time::Duration::from_secs(1), "at the deadline, not {ended:?}");
        match policy {
            LoadFailurePolicy::Recompute => assert_eq!((tokens, status), (want.clone(), FinishStatus::LengthCapped)),
            LoadFailurePolicy::Fail => {
                assert_eq!(status, FinishStatus::Error);
                let error = error.unwrap_or_default();
                assert!(
                    error.contains("state `waiting_for_remote_kvs` past its kv_state_timeout"),
                    "the error names the state and the deadline: {error}"
                );
            }
        }
        wait_stats(&d.engine, d.baseline()).await;
    }
}

#[tokio::test(start_paused = true)]
async fn p_blocks_of_a_send_nobody_reports_are_freed_at_the_kv_state_deadline() {
    // P's worker lost track of the send (its listener restarted): finished_sending never comes.
    let timeout = std::time::Duration::from_millis(300);
    let p = side(EngineConfig { kv_state_timeout: Some(timeout), ..small_config(32, 8192) });
    let started = tokio::time::Instant::now();
    let (_, status, _) = run(&p.engine, p_request("r", prompt(13))).await;
    assert_eq!(status, FinishStatus::LengthCapped);
    let held = p.engine.block_stats();
    assert!(held.free < held.total, "blocks are held for the send (delayed free): {held:?}");
    wait_stats(&p.engine, p.baseline()).await;
    let freed = started.elapsed();
    assert!(freed >= timeout, "freed before the deadline");
    assert!(freed < timeout + std::time::Duration::from_secs(1), "freed at the deadline, not {freed:?}");
}

#[tokio::test]
async fn a_request_refused_at_admission_still_tells_the_connector_about_its_transfer() {
    // P: the prompt is longer than max_model_len (256): refused, and D's pull must be answered at
    // once — the transfer goes out as not processed in the next step's metadata.
    let mut p = side(small_config(32, 8192));
    let refused = p.engine.add_request(p_request("r", prompt(300))).await;
    assert!(matches!(refused, Err(EngineError::TooLong { .. })), "{refused:?}");
    let not_processed = p.meta(|m| m.reqs_not_processed.contains("xfer-r").then_some(())).await;
    assert_eq!(not_processed, ());
    assert_eq!(p.sched.0.lock().expect("lock").finished, vec![("r".into(), FinishStatus::Error)]);
    wait_stats(&p.engine, p.baseline()).await;

    // D: refused too; its connector hears of the request (finished with an error, no blocks), so
    // that P's blocks held for it are released rather than waiting for P's send expiry.
    let mut d = side(small_config(32, 8192));
    let refused = d.engine.add_request(d_request("q", prompt(300), 8, "p-engine")).await;
    assert!(matches!(refused, Err(EngineError::TooLong { .. })), "{refused:?}");
    let aborted = d.meta(|m| m.reqs_to_abort.contains("q").then_some(())).await;
    assert_eq!(aborted, ());
    assert_eq!(d.sched.0.lock().expect("lock").finished, vec![("q".into(), FinishStatus::Error)]);

    // A request without a transfer is refused without bothering the connector.
    let refused = d.engine.add_request(request("local", prompt(300), 8)).await;
    assert!(refused.is_err());
    assert_eq!(d.sched.0.lock().expect("lock").finished.len(), 1);
    wait_stats(&d.engine, d.baseline()).await;
}

#[tokio::test]
async fn a_second_request_naming_a_transfer_in_use_is_refused_and_the_first_keeps_its_blocks() {
    let p = side(small_config(32, 8192));
    let (_, status, _) = run(&p.engine, p_request("first", prompt(13))).await;
    assert_eq!(status, FinishStatus::LengthCapped);
    let held = p.engine.block_stats();
    assert!(held.free < held.total, "the first's blocks are held for D: {held:?}");
    let second = EngineRequest {
        kv_transfer_params: Some(KvTransferParams::for_prefill("xfer-first".to_owned())),
        ..request("second", prompt(9), 1)
    };
    let refused = p.engine.add_request(second).await;
    let Err(e) = refused else { panic!("a transfer_id in use was admitted") };
    assert!(matches!(&e, EngineError::TransferIdInUse { owner, .. } if owner == "first"), "{e:?}");
    assert!(e.to_string().contains("every request needs its own transfer_id"), "{e}");
    assert_eq!(api::engine_error_response(&e).status(), axum::http::StatusCode::CONFLICT);
    assert_eq!(p.engine.block_stats(), held, "the first request is untouched and nothing more is held");
    assert_eq!(
        p.sched.0.lock().expect("lock").finished,
        vec![("first".into(), FinishStatus::LengthCapped)],
        "the connector never heard of the refused request (it would cancel the first's transfer)"
    );
}

#[tokio::test]
async fn a_body_the_api_refuses_still_tells_the_connector_about_its_transfer() {
    // D: fields the proxy rewrote for P (`stream`, `max_tokens`), a bad rank header, an unknown
    // token: each refused before the engine sees it, and each still reported, so that P's blocks
    // held for the transfer are released by an empty pull instead of at P's send expiry.
    let mut d = side(small_config(32, 8192));
    let addr = serve(d.engine.clone()).await;
    let d_params = r#"{"do_remote_prefill":true,"transfer_id":"xfer-q","remote_bootstrap_addr":"http://127.0.0.1:1","remote_engine_id":"p-engine"}"#;
    for bad in [r#""stream":"yes""#, r#""max_tokens":-1"#, r#""n":2"#, r#""prompt_extra":1,"prompt":[1,99999]"#] {
        let body = format!(r#"{{"prompt":"w1 w2 w3","max_tokens":4,{bad},"kv_transfer_params":{d_params}}}"#);
        let (status, _, resp) = http(&addr, "POST", "/v1/completions", &body).await;
        assert_eq!(status, 400, "{body} → {resp}");
        let aborted = d.meta(|m| (!m.reqs_to_abort.is_empty()).then_some(m.reqs_to_abort.len())).await;
        assert_eq!(aborted, 1, "{body}: the refusal reached the connector");
    }
    let finished = d.sched.0.lock().expect("lock").finished.clone();
    assert_eq!(finished.len(), 4, "{finished:?}");
    assert!(finished.iter().all(|(_, status)| *status == FinishStatus::Error), "{finished:?}");
    // Unparseable params, or none, concern no transfer: the connector is not told.
    for body in [
        r#"{"prompt":"w1","stream":"yes","kv_transfer_params":{"do_remote_prefill":"yes"}}"#,
        r#"{"prompt":"w1","stream":"yes"}"#,
        "{not json",
    ] {
        assert_eq!(http(&addr, "POST", "/v1/completions", body).await.0, 400, "{body}");
    }
    // The engine runs one step for each report; a normal request afterwards proves the loop idle.
    let (_, status, _) = run(&d.engine, request("local", prompt(5), 2)).await;
    assert_eq!(status, FinishStatus::LengthCapped);
    assert_eq!(d.sched.0.lock().expect("lock").finished.len(), 5, "only the local request was added");
    wait_stats(&d.engine, d.baseline()).await;
}

#[tokio::test]
async fn a_bare_do_remote_decode_is_named_after_its_request_as_vllms_toy_proxy_needs() {
    // vLLM's toy proxy sends P `do_remote_decode` with no transfer_id (and nulls it does not fill).
    let mut p = side(small_config(32, 8192));
    let addr = serve(p.engine.clone()).await;
    let body = r#"{"prompt":"w1 w2 w3 w4 w5","max_tokens":1,"stream":false,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}"#;
    let (status, _, resp) = http(&addr, "POST", "/v1/completions", body).await;
    assert_eq!(status, 200, "{resp}");
    let (request_id, transfer_id) =
        p.meta(|m| m.reqs_to_send.iter().next().map(|(r, (t, _))| (r.to_string(), t.to_string()))).await;
    assert_eq!(transfer_id, request_id, "the transfer is named after P's request id");
    p.worker.report(ConnectorOutput { finished_sending: [request_id.as_str().into()].into(), ..Default::default() });
    wait_stats(&p.engine, p.baseline()).await;
}

#[tokio::test]
async fn a_refused_request_naming_a_held_requests_transfer_does_not_cancel_it() {
    let p = side(small_config(32, 8192));
    let addr = serve(p.engine.clone()).await;
    let (_, status, _) = run(&p.engine, p_request("first", prompt(13))).await;
    assert_eq!(status, FinishStatus::LengthCapped);
    let held = p.engine.block_stats();
    assert!(held.free < held.total, "the first's blocks are held for D: {held:?}");
    let body =
        r#"{"prompt":"w1","stream":"yes","kv_transfer_params":{"do_remote_decode":true,"transfer_id":"xfer-first"}}"#;
    assert_eq!(http(&addr, "POST", "/v1/completions", body).await.0, 400);
    // A later request runs a step: any report of the refusal would have reached the connector.
    let (_, status, _) = run(&p.engine, request("later", prompt(5), 2)).await;
    assert_eq!(status, FinishStatus::LengthCapped);
    let finished = p.sched.0.lock().expect("lock").finished.clone();
    assert_eq!(
        finished,
        vec![("first".into(), FinishStatus::LengthCapped), ("later".into(), FinishStatus::LengthCapped)],
        "the refusal was not taken for the first's"
    );
    assert_eq!(p.engine.block_stats().free, held.free, "the first still holds its blocks");
}
