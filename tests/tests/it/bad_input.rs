//! Bad input gets a clear error and the actor that received it keeps serving: a conflicting
//! bootstrap registration, a garbage side-channel frame, an out-of-region descriptor, malformed
//! JSON and invalid kv_transfer_params.

use pdflow_kv::memory::KvCache;
use pdflow_kv::planner::{Descriptor, TransferPlan};
use pdflow_messages::bootstrap::QueryResponse;
use pdflow_messages::frame;
use pdflow_messages::sender_listener::{PullResponse, PullStatus};
use pdflow_tests::processes::ProcCluster;
use pdflow_tests::{completion, post, prompt, reference_tokens, token_ids, Cluster, ClusterSpec, Endpoints, SMALL};
use pdflow_transfer::tcp::{TcpConfig, TcpTransferEngine};
use pdflow_transfer::{TransferEngine, TransferError};
use zeromq::{Socket, SocketRecv, SocketSend};

async fn still_serves(cluster: &Endpoints, seed: u64) {
    let body = completion(&prompt(120, seed), 6);
    let (status, response) = cluster.post("/v1/completions", &body).await.expect("request");
    assert_eq!(status, 200, "{response}");
    assert_eq!(token_ids(&response), reference_tokens(SMALL, &body).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_in_one_process() {
    let cluster = Cluster::start(ClusterSpec::one_p_one_d()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_as_processes() {
    let cluster = ProcCluster::start(ClusterSpec::one_p_one_d()).await.expect("cluster starts");
    scenario(&cluster.endpoints).await;
    cluster.shutdown().await;
}

async fn scenario(cluster: &Endpoints) {
    let p = &cluster.prefill[0];
    let bootstrap = p.bootstrap_url.clone().expect("P launched its bootstrap");

    // A conflicting registration (same engine and ranks, another address) is a 400 with a reason;
    // an identical one is fine.
    let query: QueryResponse =
        cluster.client.get(format!("{bootstrap}/query")).send().await.expect("query").json().await.expect("json");
    let entry = query.get("0").expect("dp 0 registered").clone();
    let side_channel = entry.worker_addr["0"]["0"].clone();
    let register = |addr: &str| serde_json::json!({"engine_id": entry.engine_id, "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": addr});
    let (status, body) = post(&cluster.client, &format!("{bootstrap}/register"), &register("tcp://127.0.0.1:1"))
        .await
        .expect("register");
    assert_eq!(status, 400, "conflicting registration: {body}");
    assert!(
        body.to_string().contains("127.0.0.1:1") || body.to_string().to_lowercase().contains("conflict"),
        "the reason is given: {body}"
    );
    let (status, body) =
        post(&cluster.client, &format!("{bootstrap}/register"), &register(&side_channel)).await.expect("register");
    assert_eq!(status, 200, "identical re-registration: {body}");
    let (status, _) = post(&cluster.client, &format!("{bootstrap}/register"), &serde_json::json!({"engine_id": 5}))
        .await
        .expect("register");
    assert!((400..500).contains(&status), "malformed registration refused, got {status}");
    still_serves(cluster, 1).await;

    // A garbage side-channel frame gets an error response; the listener keeps serving.
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(&side_channel).await.expect("connect to P's side channel");
    dealer.send(zeromq::ZmqMessage::from(b"definitely not a pdflow frame".to_vec())).await.expect("send");
    let reply = tokio::time::timeout(std::time::Duration::from_secs(5), dealer.recv())
        .await
        .expect("a reply within 5 s")
        .expect("recv");
    let bytes = reply.into_vec().pop().expect("one frame");
    let response: PullResponse = frame::decode(&bytes, "pull response").expect("the reply is a valid frame");
    assert_eq!(response.status, PullStatus::Error);
    assert!(response.error.unwrap_or_default().len() > 5, "the error says what was wrong");
    still_serves(cluster, 2).await;

    // An out-of-region descriptor is refused by D's data server, never performed.
    let local = KvCache::new(SMALL, 4);
    let engine = TcpTransferEngine::new(local.region_table(), TcpConfig::default());
    let src = local.regions()[0];
    let plan = TransferPlan {
        descriptors: vec![Descriptor { src: src.base_addr, dst: 0x1000, len: src.block_len }],
        fence: 0,
        write_by: None,
        grant: None,
    };
    let data_addr = cluster.decode[0].data_addr.clone().expect("D has a data server");
    match engine.write(&data_addr, &plan).await {
        Err(TransferError::Refused { reason, .. }) => assert!(!reason.is_empty()),
        other => panic!("expected the write to be refused, got {other:?}"),
    }
    still_serves(cluster, 3).await;

    // Malformed JSON and invalid kv_transfer_params: 400 with a message, from the proxy and from an engine.
    let resp = cluster
        .client
        .post(format!("{}/v1/completions", cluster.proxy))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("post");
    assert_eq!(resp.status(), 400);
    let mut bad = completion("w5 w6", 2);
    bad["kv_transfer_params"] =
        serde_json::json!({"do_remote_decode": true, "do_remote_prefill": true, "transfer_id": "x"});
    let (status, body) = post(&cluster.client, &format!("{}/v1/completions", p.url), &bad).await.expect("post");
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap_or_default().contains("do_remote"), "{body}");
    still_serves(cluster, 4).await;
    cluster.assert_blocks_at_baseline().await;
}
