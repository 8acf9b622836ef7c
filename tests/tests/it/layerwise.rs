//! Layer-wise P (`--layerwise on`): each layer P has finished goes to D while P still prefills
//! (chunked here: 300 tokens in chunks of 64, every layer of every chunk). D's pull before P's
//! first layer and after P's last, in one process (where the spans show when the KV left P), and
//! through the proxy as separate processes over tcp: D's tokens are a single engine's, and no
//! block is held on either side afterwards.

use pdflow_observability::attrs;
use pdflow_observability::capture::{CapturedSpan, SpanCapture};
use pdflow_tests::direct::{decode_body, prefill_body};
use pdflow_tests::processes::ProcCluster;
use pdflow_tests::{
    capture, completion, post, prompt, reference_tokens, token_ids, wait_for_step, Cluster, ClusterSpec, EngineOpts,
    SMALL,
};

fn spec(tcp_only: bool) -> ClusterSpec {
    let mut spec = ClusterSpec::one_p_one_d();
    spec.prefill = vec![EngineOpts { max_num_batched_tokens: 64, layerwise: true, tcp_only, ..EngineOpts::default() }];
    spec.decode = vec![EngineOpts { tcp_only, ..EngineOpts::default() }];
    spec
}

/// The first span of `step` for transfer `tid`.
fn span_of(capture: &SpanCapture, step: u8, tid: &str) -> CapturedSpan {
    capture
        .spans()
        .into_iter()
        .filter(|s| s.step == step && s.attr(attrs::TRANSFER_ID) == Some(tid))
        .min_by_key(|s| s.start)
        .unwrap_or_else(|| panic!("no step {step} span for {tid}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pull_before_p_s_first_layer_gets_the_kv_written_before_p_is_ready() {
    let capture = capture();
    let cluster = Cluster::start(spec(false)).await.expect("cluster starts");
    let (p, d) = (&cluster.prefill[0], &cluster.decode[0]);
    let bootstrap = p.launched_bootstrap_url().expect("P launched its bootstrap");
    let text = prompt(300, 11);
    let expected = reference_tokens(SMALL, &completion(&text, 16)).await;
    let (p_url, d_url) = (format!("{}/v1/completions", p.url()), format!("{}/v1/completions", d.url()));

    // D's pull waits on P (step 22) before P has its request: every layer of every chunk streams.
    let tid = "xfer-layerwise-before";
    let d_req = tokio::spawn({
        let (client, url, body) =
            (cluster.client.clone(), d_url.clone(), decode_body(&text, 16, tid, &bootstrap, &p.engine_id));
        async move { post(&client, &url, &body).await }
    });
    wait_for_step(&capture, 22, tid, false).await;
    let (status, _) = post(&cluster.client, &p_url, &prefill_body(&text, tid)).await.expect("P request");
    assert_eq!(status, 200);
    let (status, response) = d_req.await.expect("task").expect("D request");
    assert_eq!(status, 200, "{response}");
    assert_eq!(token_ids(&response), expected, "layer-wise, pull before the first layer");
    let (write, ready) = (span_of(&capture, 29, tid), span_of(&capture, 27, tid));
    assert!(write.start < ready.start, "the KV started to leave P (29) before P's prefill was ready (27)");
    let bytes: u64 = write.attr(attrs::BYTES).and_then(|b| b.parse().ok()).expect("step 29 records its bytes");
    // Chunks of 64 end on block boundaries (16 tokens a block): each of the 19 blocks once, per layer.
    assert_eq!(bytes, (300usize.div_ceil(SMALL.block_size) * SMALL.bytes_per_block()) as u64, "every block once");

    // D's pull after P is ready: every layer is done, the KV goes in one write.
    let tid = "xfer-layerwise-after";
    let (status, _) = post(&cluster.client, &p_url, &prefill_body(&text, tid)).await.expect("P request");
    assert_eq!(status, 200);
    wait_for_step(&capture, 27, tid, true).await;
    let (status, response) =
        post(&cluster.client, &d_url, &decode_body(&text, 16, tid, &bootstrap, &p.engine_id)).await.expect("D request");
    assert_eq!(status, 200, "{response}");
    assert_eq!(token_ids(&response), expected, "layer-wise, pull after the last layer");
    assert!(span_of(&capture, 29, tid).start > span_of(&capture, 27, tid).start, "nothing to stream before ready");

    cluster.assert_blocks_at_baseline().await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer_wise_through_the_proxy_as_processes_over_tcp() {
    let cluster = ProcCluster::start(spec(true)).await.expect("cluster starts");
    for seed in [5, 6] {
        let body = completion(&prompt(300, seed), 12);
        let (status, response) = cluster.endpoints.post("/v1/completions", &body).await.expect("request");
        assert_eq!(status, 200, "{response}");
        assert_eq!(token_ids(&response), reference_tokens(SMALL, &body).await, "seed {seed}");
    }
    cluster.endpoints.assert_blocks_at_baseline().await;
    cluster.shutdown().await;
}
