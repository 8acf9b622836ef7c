//! SchedulerConnector tests: its producer (P) and consumer (D) hooks asked directly, in the order
//! vLLM's scheduler calls them.

use pdflow_messages::scheduler_connector::PromptBlockHashes;

use super::*;

fn p_request(id: &str) -> SchedRequest {
    SchedRequest {
        request_id: id.into(),
        prompt_len: 1000,
        kv_transfer_params: Some(KvTransferParams::for_prefill(format!("xfer-{id}"))),
        traceparent: None,
    }
}

fn d_request(id: &str) -> SchedRequest {
    SchedRequest {
        request_id: id.into(),
        prompt_len: 1000,
        kv_transfer_params: Some(KvTransferParams::for_decode(
            format!("xfer-{id}"),
            "http://127.0.0.1:8998",
            "p-engine",
        )),
        traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
    }
}

/// `get_num_new_matched_tokens` for `request` with `hit` tokens in D's prefix cache, its block
/// hashes unknown.
fn asked(request: SchedRequest, hit: usize) -> GetNumNewMatchedTokens {
    GetNumNewMatchedTokens { request, num_computed_tokens: hit, block_hashes: PromptBlockHashes::default() }
}

async fn spawn(role: KvRole) -> ActorRef<SchedulerConnector> {
    let r = SchedulerConnector::spawn(SchedulerConnectorArgs {
        engine_id: "e".into(),
        role,
        bootstrap_addr: Some("http://127.0.0.1:8998".into()),
        layerwise: role == KvRole::Producer,
        groups: Vec::new(),
        null_block: None,
    });
    r.wait_for_startup().await;
    r
}

#[tokio::test]
async fn on_new_request_names_params_this_engine_cannot_serve() {
    let d = spawn(KvRole::Consumer).await;
    assert_eq!(d.ask(OnNewRequest { request: d_request("d1") }).await.expect("ask delivered"), None);
    let mut broken = d_request("d2");
    if let Some(p) = broken.kv_transfer_params.as_mut() {
        p.remote_engine_id = None;
    }
    let reason = d.ask(OnNewRequest { request: broken }).await.expect("ask delivered").expect("refused");
    assert!(reason.contains("remote_engine_id"), "{reason}");
    let reason = d.ask(OnNewRequest { request: p_request("p1") }).await.expect("ask delivered").expect("refused");
    assert!(reason.contains("kv_consumer"), "{reason}");
}

#[tokio::test]
async fn get_num_new_matched_tokens_follows_the_role() {
    let d = spawn(KvRole::Consumer).await;
    let m = d.ask(asked(d_request("d1"), 0)).await.expect("ask delivered");
    assert_eq!(m, MatchedTokens::tokens(1000));
    let m = d.ask(asked(d_request("d1"), 1000)).await.expect("ask delivered");
    assert_eq!(m, MatchedTokens::none());
    let m = d.ask(asked(d_request("d1"), 998)).await.expect("ask delivered");
    assert_eq!(m, MatchedTokens::tokens(2));
    let p = spawn(KvRole::Producer).await;
    let m = p.ask(asked(p_request("p1"), 0)).await.expect("ask delivered");
    assert_eq!(m, MatchedTokens::none());
    // A D request on a producer prefills locally instead of loading.
    let m = p.ask(asked(d_request("d2"), 0)).await.expect("ask delivered");
    assert!(!m.load_async);
}

#[tokio::test]
async fn a_p_request_without_a_transfer_id_is_named_by_p_which_answers_what_d_needs() {
    // vLLM's toy proxy: a bare do_remote_decode to P, P's answer forwarded to D.
    let p = spawn(KvRole::Producer).await;
    let bare = || SchedRequest {
        request_id: "cmpl-abc-0-1234abcd".into(),
        prompt_len: 100,
        kv_transfer_params: Some(KvTransferParams { do_remote_decode: true, ..KvTransferParams::default() }),
        traceparent: None,
    };
    assert_eq!(p.ask(OnNewRequest { request: bare() }).await.expect("ask delivered"), None, "served, not refused");
    p.ask(UpdateStateAfterAlloc { request: bare(), block_ids: vec![4, 5, 6, 7].into(), num_external_tokens: 0 })
        .await
        .expect("ask");
    let meta = p.ask(BuildConnectorMeta::default()).await.expect("ask delivered");
    assert_eq!(meta.reqs_to_send["cmpl-abc-0-1234abcd"].0, "cmpl-abc-0-1234abcd");
    let reply = p
        .ask(RequestFinished {
            request: bare(),
            status: FinishStatus::LengthCapped,
            block_ids: vec![4, 5, 6, 7].into(),
        })
        .await
        .expect("ask delivered");
    assert!(reply.delay_free_blocks);
    let for_d = reply.kv_transfer_params.expect("P answers D's parameters");
    assert_eq!(
        for_d.role(),
        Ok(TransferRole::Decode {
            transfer_id: "cmpl-abc-0-1234abcd".into(),
            remote_bootstrap_addr: "http://127.0.0.1:8998".into(),
            remote_engine_id: "e".into(),
        })
    );
}

#[tokio::test]
async fn layer_wise_p_names_each_step_s_prefill_chunks_in_reqs_to_save_until_it_finishes() {
    let p = spawn(KvRole::Producer).await;
    let request = p_request("p1");
    p.ask(UpdateStateAfterAlloc { request: request.clone(), block_ids: vec![3, 4].into(), num_external_tokens: 0 })
        .await
        .expect("ask");
    let chunk = |upto: usize| ScheduledChunk { request_id: "p1".into(), block_ids: vec![3, 4], computed_upto: upto };
    let local = ScheduledChunk { request_id: "local".into(), block_ids: vec![9], computed_upto: 5 };
    let meta = p.ask(BuildConnectorMeta { scheduled: vec![chunk(512), local] }).await.expect("ask delivered");
    let save = &meta.reqs_to_save["p1"];
    assert_eq!((save.transfer_id.as_str(), save.computed_upto, save.prompt_len), ("xfer-p1", 512, 1000));
    assert_eq!(meta.reqs_to_save.len(), 1, "a request with no transfer streams nothing");
    // The step that samples P's one token computes no more prompt KV than the prompt holds.
    let meta = p.ask(BuildConnectorMeta { scheduled: vec![chunk(1001)] }).await.expect("ask delivered");
    assert_eq!(meta.reqs_to_save["p1"].computed_upto, 1000);
    p.ask(RequestFinished { request, status: FinishStatus::LengthCapped, block_ids: vec![3, 4].into() })
        .await
        .expect("ask delivered");
    let meta = p.ask(BuildConnectorMeta { scheduled: vec![chunk(1000)] }).await.expect("ask delivered");
    assert!(meta.reqs_to_save.is_empty(), "a finished request streams no more layers");
}

#[tokio::test]
async fn a_prefix_hit_of_all_but_the_last_prompt_token_loads_nothing_and_frees_p() {
    // vLLM recomputes the last prompt token after any load; its KV is never pulled.
    let d = spawn(KvRole::Consumer).await;
    let m = d.ask(asked(d_request("d1"), 999)).await.expect("ask delivered");
    assert_eq!(m, MatchedTokens::none());
    let updated = d
        .ask(UpdateStateAfterAlloc { request: d_request("d1"), block_ids: (0..63).collect(), num_external_tokens: 0 })
        .await
        .expect("ask delivered");
    assert_eq!(updated.map(|p| p.do_remote_prefill), Some(false), "one pull, never two");
    // The pull names no block: P frees its blocks without writing any.
    let meta = d.ask(BuildConnectorMeta::default()).await.expect("ask delivered");
    assert_eq!(meta.reqs_to_recv["p-engine"]["d1"].local_block_ids, GroupBlocks::default());
}

#[tokio::test]
async fn producer_records_pending_send_then_blocks_after_finish() {
    let p = spawn(KvRole::Producer).await;
    let updated = p
        .ask(UpdateStateAfterAlloc { request: p_request("p1"), block_ids: (17..80).collect(), num_external_tokens: 0 })
        .await
        .expect("ask");
    assert_eq!(updated, None);
    // Step 13: the pending send with an empty block list.
    let meta = p.ask(BuildConnectorMeta::default()).await.expect("ask delivered");
    assert_eq!(meta.reqs_to_send.get("p1"), Some(&("xfer-p1".into(), GroupBlocks::default())));
    assert!(
        p.ask(BuildConnectorMeta::default()).await.expect("ask delivered").is_empty(),
        "metadata is cleared after each build"
    );
    // Step 23: length-capped finish delays the free and records the blocks.
    let reply = p
        .ask(RequestFinished {
            request: p_request("p1"),
            status: FinishStatus::LengthCapped,
            block_ids: (17..80).collect(),
        })
        .await
        .expect("ask");
    assert!(reply.delay_free_blocks);
    // Step 26: the blocks go to the worker.
    let meta = p.ask(BuildConnectorMeta::default()).await.expect("ask delivered");
    assert_eq!(meta.reqs_to_send["p1"].1.flat(), (17..80).collect::<Vec<_>>());
}

#[tokio::test]
async fn producer_sends_even_when_the_first_token_is_a_stop() {
    let p = spawn(KvRole::Producer).await;
    let reply = p
        .ask(RequestFinished { request: p_request("p1"), status: FinishStatus::Stopped, block_ids: vec![1, 2].into() })
        .await
        .expect("ask");
    assert!(reply.delay_free_blocks, "the prompt's KV is valid: it must be sent");
    assert_eq!(
        p.ask(BuildConnectorMeta::default()).await.expect("ask delivered").reqs_to_send["p1"].1.flat(),
        vec![1, 2]
    );
}

#[tokio::test]
async fn producer_abort_frees_at_once_and_reports_not_processed() {
    let p = spawn(KvRole::Producer).await;
    p.ask(UpdateStateAfterAlloc { request: p_request("p1"), block_ids: vec![1].into(), num_external_tokens: 0 })
        .await
        .expect("ask delivered");
    let reply = p
        .ask(RequestFinished { request: p_request("p1"), status: FinishStatus::Aborted, block_ids: vec![1].into() })
        .await
        .expect("ask");
    assert!(!reply.delay_free_blocks);
    let meta = p.ask(BuildConnectorMeta::default()).await.expect("ask delivered");
    assert!(meta.reqs_not_processed.contains("xfer-p1"));
    assert!(meta.reqs_to_send.is_empty(), "an aborted request sends nothing");
}

#[tokio::test]
async fn consumer_records_pull_once_grouped_by_engine_and_clears_do_remote_prefill() {
    let d = spawn(KvRole::Consumer).await;
    let updated = d
        .ask(UpdateStateAfterAlloc {
            request: d_request("d1"),
            block_ids: (512..575).collect(),
            num_external_tokens: 1000,
        })
        .await
        .expect("ask")
        .expect("params updated");
    assert!(!updated.do_remote_prefill);
    let meta = d.ask(BuildConnectorMeta::default()).await.expect("ask delivered");
    let pull = &meta.reqs_to_recv["p-engine"]["d1"];
    assert_eq!(pull.local_block_ids.len(), 63);
    assert_eq!(pull.transfer_id, "xfer-d1");
    assert!(meta.traceparents.contains_key("d1"));
    // The second update_state_after_alloc (after the KV arrived) carries the cleared params.
    let mut resumed = d_request("d1");
    resumed.kv_transfer_params = Some(updated);
    d.ask(UpdateStateAfterAlloc { request: resumed, block_ids: (512..575).collect(), num_external_tokens: 0 })
        .await
        .expect("ask");
    assert!(
        d.ask(BuildConnectorMeta::default()).await.expect("ask delivered").reqs_to_recv.is_empty(),
        "no second pull"
    );
}

#[tokio::test]
async fn consumer_abort_in_flight_cancels_the_pull_and_early_abort_still_tells_p() {
    let d = spawn(KvRole::Consumer).await;
    let updated = d
        .ask(UpdateStateAfterAlloc { request: d_request("d1"), block_ids: vec![5, 6].into(), num_external_tokens: 32 })
        .await
        .expect("ask");
    d.ask(BuildConnectorMeta::default()).await.expect("ask delivered");
    let mut waiting = d_request("d1");
    waiting.kv_transfer_params = updated;
    let reply = d
        .ask(RequestFinished { request: waiting, status: FinishStatus::Aborted, block_ids: vec![5, 6].into() })
        .await
        .expect("ask delivered");
    assert!(!reply.delay_free_blocks);
    assert!(d.ask(BuildConnectorMeta::default()).await.expect("ask delivered").reqs_to_abort.contains("d1"));
    // Aborted before any allocation: an empty pull so that P frees its blocks.
    d.ask(RequestFinished { request: d_request("d2"), status: FinishStatus::Aborted, block_ids: vec![].into() })
        .await
        .expect("ask delivered");
    let meta = d.ask(BuildConnectorMeta::default()).await.expect("ask delivered");
    assert!(meta.reqs_to_recv["p-engine"]["d2"].local_block_ids.is_empty());
}

#[tokio::test]
async fn update_connector_output_settles_in_flight_pulls() {
    let d = spawn(KvRole::Consumer).await;
    let updated = d
        .ask(UpdateStateAfterAlloc { request: d_request("d1"), block_ids: vec![5].into(), num_external_tokens: 16 })
        .await
        .expect("ask");
    d.ask(BuildConnectorMeta::default()).await.expect("ask delivered");
    let mut output = ConnectorOutput::default();
    output.finished_recving.insert("d1".into());
    d.ask(UpdateConnectorOutput { output }).await.expect("ask delivered");
    // After the KV arrived an abort no longer cancels anything.
    let mut req = d_request("d1");
    req.kv_transfer_params = updated;
    d.ask(RequestFinished { request: req, status: FinishStatus::Aborted, block_ids: vec![5].into() })
        .await
        .expect("ask delivered");
    assert!(d.ask(BuildConnectorMeta::default()).await.expect("ask delivered").reqs_to_abort.is_empty());
}

/// Gemma-3-shaped: full attention, then a sliding window of 64 tokens, block 16, null block 0.
async fn spawn_hybrid(role: KvRole) -> ActorRef<SchedulerConnector> {
    let r = SchedulerConnector::spawn(SchedulerConnectorArgs {
        engine_id: "e".into(),
        role,
        bootstrap_addr: None,
        layerwise: false,
        groups: vec![
            KvGroupSpec::full(16),
            KvGroupSpec { kind: KvGroupKind::SlidingWindow { window: 64 }, block_size: 16 },
            KvGroupSpec { kind: KvGroupKind::State, block_size: 1024 },
        ],
        null_block: Some(0),
    });
    r.wait_for_startup().await;
    r
}

fn span(first: Option<u32>, ids: &[BlockId]) -> BlockSpan {
    BlockSpan { first, ids: ids.to_vec() }
}

#[tokio::test]
async fn a_hybrid_model_moves_each_group_s_blocks_and_d_computes_the_last_prompt_token() {
    let d = spawn_hybrid(KvRole::Consumer).await;
    // D loads all but the last prompt token, even when its prefix cache holds every other one.
    let m = d.ask(asked(d_request("d1"), 998)).await.expect("asked");
    assert_eq!(m, MatchedTokens::tokens(1));
    let m = d.ask(asked(d_request("d1"), 999)).await.expect("asked");
    assert_eq!(m, MatchedTokens::none());
    // Its prefix cache holds 32 tokens (2 blocks), the rest loads.
    let m = d.ask(asked(d_request("d1"), 32)).await.expect("asked");
    assert_eq!(m, MatchedTokens::tokens(967));
    // 999 tokens are 63 blocks of 16; the window keeps cdiv(64, 16) + 1 = 5 of them.
    let sliding: Vec<BlockId> = (0..63).map(|i| if i < 57 { 0 } else { 500 + i }).collect();
    let blocks = GroupBlocks(vec![
        span(Some(0), &(100..163).collect::<Vec<_>>()),
        span(Some(0), &sliding),
        span(Some(0), &[900]),
    ]);
    d.ask(UpdateStateAfterAlloc { request: d_request("d1"), block_ids: blocks, num_external_tokens: 967 })
        .await
        .expect("asked");
    let meta = d.ask(BuildConnectorMeta::default()).await.expect("asked");
    let pull = &meta.reqs_to_recv["p-engine"]["d1"].local_block_ids;
    assert_eq!(
        pull,
        &GroupBlocks(vec![
            span(Some(2), &(102..163).collect::<Vec<_>>()),
            span(Some(58), &[558, 559, 560, 561, 562]),
            span(None, &[900]),
        ])
    );

    // P keeps every block its window still holds, and its state's last page.
    let p = spawn_hybrid(KvRole::Producer).await;
    let p_sliding: Vec<BlockId> = (0..63).map(|i| if i < 50 { 0 } else { 300 + i }).collect();
    let finished = GroupBlocks(vec![
        span(Some(0), &(1..64).collect::<Vec<_>>()),
        span(Some(0), &p_sliding),
        span(Some(0), &[700, 701]),
    ]);
    p.ask(RequestFinished { request: p_request("p1"), status: FinishStatus::LengthCapped, block_ids: finished })
        .await
        .expect("asked");
    let meta = p.ask(BuildConnectorMeta::default()).await.expect("asked");
    let held = &meta.reqs_to_send["p1"].1;
    assert_eq!(held.groups()[1], span(Some(50), &(350..363).collect::<Vec<_>>()));
    assert_eq!(held.groups()[2], span(None, &[701]));
    // Paired position by position: D's blocks 2.. of full attention, the window's last 5, the state.
    let (src, dst) = held.pair_with(pull).expect("P holds what D asks for");
    assert_eq!(dst, pull.flat());
    let want: Vec<BlockId> = (3..64).chain(358..363).chain([701]).collect();
    assert_eq!(src, want);
}

#[tokio::test]
async fn a_d_request_sharing_a_prefix_in_flight_waits_for_it_and_then_loads_only_the_rest() {
    // 1000 tokens in blocks of 100: d1 and d2 share the first 6 blocks.
    let d = spawn(KvRole::Consumer).await;
    let hashes =
        |tail: u64| PromptBlockHashes { block_size: 100, hashes: vec![1, 2, 3, 4, 5, 6, tail, tail + 1, tail + 2] };
    let in_flight = |id: &'static str| {
        let mut r = d_request(id);
        if let Some(p) = r.kv_transfer_params.as_mut() {
            p.prefill_in_flight = true;
        }
        r
    };
    let ask = |id: &'static str, hit: usize, tail: u64| GetNumNewMatchedTokens {
        request: in_flight(id),
        num_computed_tokens: hit,
        block_hashes: hashes(tail),
    };
    let alloc = |id: &'static str, blocks: Vec<u32>, external: usize| UpdateStateAfterAlloc {
        request: in_flight(id),
        block_ids: blocks.into(),
        num_external_tokens: external,
    };
    assert_eq!(d.ask(ask("d1", 0, 10)).await.expect("asked"), MatchedTokens::tokens(1000));
    d.ask(alloc("d1", (0..10).collect(), 1000)).await.expect("allocated");
    d.ask(BuildConnectorMeta::default()).await.expect("built");
    // d2 arrives while d1's KV is in flight: not yet, on every step until d1's blocks are cached.
    assert_eq!(d.ask(ask("d2", 0, 20)).await.expect("asked"), MatchedTokens::not_yet());
    d.ask(BuildConnectorMeta::default()).await.expect("built");
    assert_eq!(d.ask(ask("d2", 0, 20)).await.expect("asked"), MatchedTokens::not_yet());
    // Asked after P answered (a proxy that calls D then), a request never waits: nothing would
    // hide the wait.
    let after_p = GetNumNewMatchedTokens { request: d_request("d5"), num_computed_tokens: 0, block_hashes: hashes(50) };
    assert_eq!(d.ask(after_p).await.expect("asked"), MatchedTokens::tokens(1000));
    let received = ConnectorOutput { finished_recving: ["d1".into()].into(), ..Default::default() };
    d.ask(UpdateConnectorOutput { output: received }).await.expect("reported");
    // The schedule that resumes d1 (and caches its blocks) may ask about d2 first.
    assert_eq!(d.ask(ask("d2", 0, 20)).await.expect("asked"), MatchedTokens::not_yet());
    d.ask(BuildConnectorMeta::default()).await.expect("built");
    // Next step: D's prefix cache holds the six shared blocks; d2 loads the other 400 tokens.
    assert_eq!(d.ask(ask("d2", 600, 20)).await.expect("asked"), MatchedTokens::tokens(400));
    // (vLLM offers a dense model's load only the blocks its prefix cache did not fill.)
    d.ask(alloc("d2", (26..30).collect(), 400)).await.expect("allocated");
    let meta = d.ask(BuildConnectorMeta::default()).await.expect("built");
    let pull = &meta.reqs_to_recv["p-engine"]["d2"];
    assert_eq!(pull.local_block_ids, GroupBlocks::from(vec![26, 27, 28, 29]), "only the blocks past the shared six");
    // A request whose first missing block is in flight for nobody never waits.
    assert_eq!(d.ask(ask("d3", 0, 30)).await.expect("asked"), MatchedTokens::tokens(1000));
    let mut other = hashes(40);
    other.hashes[0] = 99;
    let m = d
        .ask(GetNumNewMatchedTokens { request: in_flight("d4"), num_computed_tokens: 0, block_hashes: other })
        .await
        .expect("asked");
    assert_eq!(m, MatchedTokens::tokens(1000));
}
