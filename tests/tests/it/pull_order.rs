//! Seed steps 21–27 in either order: D's pull may reach P before P's request is ready (P waits on
//! `ready`, step 22) or after (the send is already ready). Both give D exactly P's KV.
//! P and D are driven directly with the bodies the proxy would send, to control the order.

use pdflow_tests::direct::{decode_body, prefill_body};
use pdflow_tests::{capture, post, prompt, reference_tokens, token_ids, wait_for_step, Cluster, ClusterSpec, SMALL};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pull_arriving_before_and_after_p_is_ready() {
    let capture = capture();
    let cluster = Cluster::start(ClusterSpec::one_p_one_d()).await.expect("cluster starts");
    let p = &cluster.prefill[0];
    let d = &cluster.decode[0];
    let bootstrap = p.launched_bootstrap_url().expect("P launched its bootstrap");
    let text = prompt(300, 7);
    let expected = reference_tokens(SMALL, &pdflow_tests::completion(&text, 16)).await;

    // Before: D's pull reaches P (step 22 opens) before P has even received its request.
    let tid = "xfer-pull-before";
    let d_req = tokio::spawn({
        let (client, url, body) = (
            cluster.client.clone(),
            format!("{}/v1/completions", d.url()),
            decode_body(&text, 16, tid, &bootstrap, &p.engine_id),
        );
        async move { post(&client, &url, &body).await }
    });
    wait_for_step(&capture, 22, tid, false).await;
    let (status, _) = post(&cluster.client, &format!("{}/v1/completions", p.url()), &prefill_body(&text, tid))
        .await
        .expect("P request");
    assert_eq!(status, 200);
    let (status, response) = d_req.await.expect("task").expect("D request");
    assert_eq!(status, 200, "{response}");
    assert_eq!(token_ids(&response), expected, "pull before ready");

    // After: P finished and its send is ready (step 27) before D sends its pull.
    let tid = "xfer-pull-after";
    let (status, _) = post(&cluster.client, &format!("{}/v1/completions", p.url()), &prefill_body(&text, tid))
        .await
        .expect("P request");
    assert_eq!(status, 200);
    wait_for_step(&capture, 27, tid, true).await;
    let (status, response) = post(
        &cluster.client,
        &format!("{}/v1/completions", d.url()),
        &decode_body(&text, 16, tid, &bootstrap, &p.engine_id),
    )
    .await
    .expect("D request");
    assert_eq!(status, 200, "{response}");
    assert_eq!(token_ids(&response), expected, "pull after ready");

    cluster.assert_blocks_at_baseline().await;
    cluster.shutdown().await;
}
