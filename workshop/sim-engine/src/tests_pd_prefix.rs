//! P/D with prefix caching (through the in-test connector of `tests_pd.rs`): D that already holds
//! a prompt's first blocks asks the connector only for the rest, offers only the blocks it lacks,
//! loads P's matching tail into them, and produces what a single engine produces.

use pdflow_messages::kv_groups::GroupBlocks;
use pdflow_messages::scheduler_connector::{ConnectorOutput, FinishStatus};

use super::ranks_tests::copy_across;
use super::tests::{prompt, request, run, start, wait_stats, DEADLINE};
use super::tests_pd::{d_request, p_request, side, Side};
use super::tests_prefix::caching_config;

/// One request through P then D; D's tokens must be `want`. Returns the blocks D's pull named.
async fn through_p_and_d(p: &mut Side, d: &mut Side, id: &str, prompt: Vec<u32>, want: &[u32]) -> GroupBlocks {
    let p_id = p.engine.config().engine_id.clone();
    let mut d_stream = d.engine.add_request(d_request(id, prompt.clone(), want.len(), &p_id)).await.expect("accepted");
    let d_blocks = d
        .meta(|m| m.reqs_to_recv.get(p_id.as_str()).and_then(|r| r.get(id)).map(|pull| pull.local_block_ids.clone()))
        .await;
    let (p_tokens, p_status, _) = run(&p.engine, p_request(id, prompt)).await;
    assert_eq!((p_tokens, p_status), (vec![want[0]], FinishStatus::LengthCapped));
    let (_, p_blocks) = p.meta(|m| m.reqs_to_send.get(id).filter(|(_, b)| !b.is_empty()).cloned()).await;
    // The transfer: P's blocks paired with D's from the prompt's end, as the real one pairs them.
    let (src, dst) = p_blocks.pair_with(&d_blocks).expect("P holds every block D asks for");
    copy_across(p.engine.rank_caches(), &src, d.engine.rank_caches(), &dst);
    p.worker.report(ConnectorOutput { finished_sending: [id.into()].into(), ..Default::default() });
    d.worker.report(ConnectorOutput { finished_recving: [id.into()].into(), ..Default::default() });
    let mut got = Vec::new();
    loop {
        let out = tokio::time::timeout(DEADLINE, d_stream.next_output()).await.expect("in time").expect("output");
        got.extend(out.new_token_ids);
        if let Some(status) = out.finish {
            assert_eq!((got.as_slice(), status), (want, FinishStatus::LengthCapped));
            return d_blocks;
        }
    }
}

#[tokio::test]
async fn d_with_a_cached_prefix_loads_only_the_blocks_it_lacks() {
    let single = start(caching_config(32), None);
    let first = prompt(21);
    // Shares the first 16 tokens (4 blocks of 4) with `first`.
    let mut second = prompt(21);
    for t in &mut second[16..] {
        *t = (*t + 500) % 1000;
    }
    let (want1, _, _) = run(&single, request("ref1", first.clone(), 4)).await;
    let (want2, _, _) = run(&single, request("ref2", second.clone(), 4)).await;
    let (mut p, mut d) = (side(caching_config(32)), side(caching_config(32)));

    let pulled = through_p_and_d(&mut p, &mut d, "r1", first, &want1).await;
    assert_eq!(pulled.len(), 6, "nothing cached yet: every block of the prompt");
    let pulled = through_p_and_d(&mut p, &mut d, "r2", second, &want2).await;
    assert_eq!(pulled.len(), 2, "D holds the first 4 blocks: it asks for the last 2 only");

    // The connector was asked past the hit, and told of 5 external tokens in 2 blocks.
    let allocs: Vec<(String, usize, usize)> =
        d.sched.0.lock().expect("lock").allocs.iter().map(|(id, n, b)| (id.to_string(), *n, *b)).collect();
    assert_eq!(allocs[2], ("r2".to_string(), 5, 2));
    let s = d.engine.cache_stats();
    assert_eq!((s.prefix_cache_queries, s.prefix_cache_hits), (42, 16));
    assert_eq!(
        (s.prompt_tokens_local_cache_hit, s.prompt_tokens_external_kv_transfer, s.prompt_tokens_local_compute),
        (16, 21 + 5, 0)
    );
    // P, with its own cache, computed only the second prompt's uncached tail.
    let s = p.engine.cache_stats();
    assert_eq!((s.prefix_cache_hits, s.prompt_tokens_local_compute), (16, 21 + 5));
    wait_stats(&p.engine, p.baseline()).await;
    wait_stats(&d.engine, d.baseline()).await;
}
