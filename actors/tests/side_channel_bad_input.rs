//! Fuzz target (bad input) for P's side channel (seed steps 21 and 30) end to end: a real
//! [`SenderListener`] on 127.0.0.1:0, fed garbage and mutated pdflow frames by a ZeroMQ DEALER.
//!
//! - Every frame that does not decode is answered with a `PullResponse` of status `Error`,
//!   `pull_id` 0 and the decoder's reason, and the listener keeps serving (a later valid pull gets
//!   its per-request answer).
//! - Finding: zeromq 0.7's codec reserved a frame's declared length before reading it, so a
//!   73-byte ZMTP header claiming 1 TiB aborted the whole P process ("memory allocation of … bytes
//!   failed") before pdflow's own decoder saw a byte. Fixed by the vendored, patched zeromq
//!   (vendor/zeromq, a 64 MiB frame cap); [`a_zmtp_frame_header_claiming_a_huge_length_does_not_abort_p`]
//!   runs the attack against a child process and is the regression test.

use std::sync::atomic::AtomicU16;
use std::sync::Arc;
use std::time::Duration;

use kameo::prelude::*;
use pdflow_actors::sender_listener::{SenderListener, SenderListenerArgs};
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_messages::frame::{self, MAGIC, VERSION};
use pdflow_messages::sender_listener::{
    AbortPull, InFlightPulls, PullErrorCause, PullReq, PullRequest, PullResponse, PullStatus, SideChannelAddr,
    SideChannelRequest,
};
use pdflow_transfer::tcp::{TcpConfig, TcpTransferEngine};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use tokio::io::AsyncWriteExt;
use tokio::sync::Notify;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const BOUND: Duration = Duration::from_secs(5);
const TINY: KvShape = KvShape { num_layers: 2, num_kv_heads: 1, head_dim: 4, dtype_bytes: 2, block_size: 4 };

/// A real SenderListener (no bootstrap registration) and its side-channel address.
async fn listener() -> (ActorRef<SenderListener>, String) {
    let kv_cache = KvCache::new(TINY, 8);
    let transfer = Arc::new(TcpTransferEngine::new(kv_cache.region_table(), TcpConfig::default()));
    let listener = SenderListener::spawn(SenderListenerArgs {
        auth: pdflow_actors::side_channel_auth::ListenerAuth::default(),
        faults: pdflow_actors::fault_seam::no_faults(),
        engine_id: "engine-p".into(),
        dp_rank: 0,
        rank: pdflow_actors::ranks::WorkerRank::single(kv_cache.shape()),
        bind_host: "127.0.0.1".into(),
        side_channel_port: Arc::new(AtomicU16::new(0)),
        bootstrap_url: None,
        kv_cache,
        transfer,
        ready_timeout: Duration::from_secs(30),
        send_expiry: Duration::from_secs(60),
        register_attempts: 1,
        register_backoff: Duration::from_millis(10),
        events: Arc::new(Notify::new()),
        verify_checksums: false,
        lineage: Default::default(),
    });
    let addr =
        tokio::time::timeout(BOUND, listener.ask(SideChannelAddr)).await.expect("in time").expect("listener started");
    (listener, addr)
}

async fn dealer(addr: &str) -> DealerSocket {
    let mut dealer = DealerSocket::new();
    tokio::time::timeout(BOUND, dealer.connect(addr)).await.expect("connects in time").expect("connects");
    dealer
}

async fn exchange(dealer: &mut DealerSocket, bytes: Vec<u8>) -> PullResponse {
    tokio::time::timeout(BOUND, dealer.send(ZmqMessage::from(bytes))).await.expect("sent in time").expect("sent");
    let msg = tokio::time::timeout(BOUND, dealer.recv()).await.expect("P answers in time").expect("receives");
    frame::decode(msg.get(0).expect("one frame"), "pull response").expect("P's answer is a valid frame")
}

fn pull(pull_id: u64, layout_id: u64) -> SideChannelRequest {
    SideChannelRequest::Pull(PullRequest {
        pull_id,
        engine_id: "engine-d".into(),
        data_addr: "127.0.0.1:1".into(),
        tp_size: 1,
        tp_rank: 0,
        pp_size: 1,
        layout_id,
        layout: None,
        reqs: vec![PullReq {
            d_req_id: "cmpl-d".into(),
            transfer_id: "xfer-1".into(),
            block_ids: vec![1, 2].into(),
            traceparent: None,
            fence: 0,
            remote: Vec::new(),
        }],
        traceparent: None,
        p_generation: 0,
        deadline_ms: 0,
        pp_rank: 0,
        p_world: (1, 1),
        rdma: None,
    })
}

/// Bytes that must not decode as a side-channel request: garbage, or a valid frame truncated,
/// with a wrong magic or version, or with trailing bytes.
fn bad_frame() -> impl Strategy<Value = Vec<u8>> {
    let valid = (any::<u64>(), any::<u64>(), prop::collection::vec("[a-z0-9-]{0,8}", 0..4)).prop_map(
        |(pull_id, layout_id, ids)| {
            let msg = if ids.is_empty() {
                pull(pull_id, layout_id)
            } else {
                SideChannelRequest::Abort(AbortPull {
                    pull_id,
                    transfer_ids: ids.into_iter().map(Into::into).collect(),
                })
            };
            frame::encode(&msg).expect("encodes")
        },
    );
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..128),
        prop::collection::vec(any::<u8>(), 0..128).prop_map(|b| [&MAGIC[..], &[VERSION], &b].concat()),
        (valid.clone(), any::<usize>()).prop_map(|(f, cut)| f[..cut % f.len()].to_vec()),
        (valid.clone(), 0usize..4, any::<u8>()).prop_map(|(mut f, i, v)| {
            f[i] = v;
            f
        }),
        (valid.clone(), any::<u8>()).prop_map(|(mut f, v)| {
            f[4] = v;
            f
        }),
        (valid, prop::collection::vec(any::<u8>(), 1..8)).prop_map(|(f, t)| [f, t].concat()),
    ]
}

#[test]
fn undecodable_frames_get_an_error_response_and_p_keeps_serving() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let (listener, addr) = rt.block_on(listener());
    let dealer = std::cell::RefCell::new(rt.block_on(dealer(&addr)));
    let mut runner = TestRunner::new(Config { cases: 128, failure_persistence: None, ..Config::default() });
    runner
        .run(&bad_frame(), |bytes| {
            let decoded = frame::decode::<SideChannelRequest>(&bytes, "side-channel request");
            prop_assume!(decoded.is_err());
            let reason = decoded.err().map(|e| e.to_string()).unwrap_or_default();
            let resp = rt.block_on(exchange(&mut dealer.borrow_mut(), bytes));
            prop_assert_eq!((resp.pull_id, resp.status), (0, PullStatus::Error));
            prop_assert!(resp.ok_reqs.is_empty() && resp.err_reqs.is_empty());
            prop_assert_eq!(resp.error.as_deref(), Some(reason.as_str()), "P answers with the decoder's reason");
            Ok(())
        })
        .expect("every undecodable frame is answered with an error");
    let mut dealer = dealer.into_inner();
    rt.block_on(async {
        // Still serving: a valid pull is answered per request (P does not know D's layout).
        let resp = exchange(&mut dealer, frame::encode(&pull(42, 7)).expect("encodes")).await;
        assert_eq!((resp.pull_id, resp.status), (42, PullStatus::Error));
        assert!(
            resp.err_reqs.iter().all(|e| e.cause == PullErrorCause::UnknownLayout) && resp.err_reqs.len() == 1,
            "{resp:?}"
        );
        assert_eq!(listener.ask(InFlightPulls).await.expect("listener answers"), 0);
        assert!(listener.is_alive());
    });
}

#[test]
fn multi_part_and_empty_messages_get_an_error_response() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async {
        let (listener, addr) = listener().await;
        let mut dealer = dealer(&addr).await;
        // A pull may carry one frame after it (its seal); two more are not a request.
        let mut three = ZmqMessage::from(frame::encode(&pull(1, 1)).expect("encodes"));
        three.push_back(b"extra".to_vec().into());
        three.push_back(b"more".to_vec().into());
        tokio::time::timeout(BOUND, dealer.send(three)).await.expect("in time").expect("sent");
        let msg = tokio::time::timeout(BOUND, dealer.recv()).await.expect("P answers in time").expect("receives");
        let resp: PullResponse = frame::decode(msg.get(0).expect("one frame"), "pull response").expect("valid answer");
        assert_eq!((resp.pull_id, resp.status), (0, PullStatus::Error));
        assert!(resp.error.as_deref().is_some_and(|e| e.contains("expected one frame")), "{resp:?}");
        let resp = exchange(&mut dealer, Vec::new()).await;
        assert!(resp.error.as_deref().is_some_and(|e| e.contains("shorter than the 5-byte header")), "{resp:?}");
        assert!(listener.is_alive());
    });
}

/// Set in the child process of [`a_zmtp_frame_header_claiming_a_huge_length_does_not_abort_p`].
const CHILD_ENV: &str = "PDFLOW_ZMTP_BOMB_CHILD";

/// The child half: starts a listener, sends it a ZMTP greeting and a frame header claiming 1 TiB,
/// then checks that the listener still answers. Does nothing unless run as the child.
#[test]
fn zmtp_bomb_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async {
        let (listener, addr) = listener().await;
        let mut raw = tokio::net::TcpStream::connect(addr.trim_start_matches("tcp://")).await.expect("connects");
        // ZMTP 3.0 greeting, NULL mechanism; then a command frame (flags: command | long) of 2^40 bytes.
        let mut greeting = [0u8; 64];
        greeting[0] = 0xff;
        greeting[9] = 0x7f;
        greeting[10] = 3;
        greeting[12..16].copy_from_slice(b"NULL");
        raw.write_all(&greeting).await.expect("sends");
        let mut header = vec![0x06u8];
        header.extend_from_slice(&(1u64 << 40).to_be_bytes());
        raw.write_all(&header).await.expect("sends");
        // Give P time to read it; then it must still answer a valid pull.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut dealer = dealer(&addr).await;
        let resp = exchange(&mut dealer, frame::encode(&pull(9, 7)).expect("encodes")).await;
        assert_eq!(resp.pull_id, 9);
        assert!(listener.is_alive());
    });
}

#[test]
fn a_zmtp_frame_header_claiming_a_huge_length_does_not_abort_p() {
    let exe = std::env::current_exe().expect("the test binary");
    let out = std::process::Command::new(exe)
        .args(["--exact", "zmtp_bomb_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .output()
        .expect("the child runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "P's process died on a 73-byte ZMTP header: {:?}\n{}",
        out.status,
        stderr.lines().take(5).collect::<Vec<_>>().join("\n")
    );
}
