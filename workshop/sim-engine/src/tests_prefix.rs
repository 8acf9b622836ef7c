//! Prefix caching as a user sees it, through the engine's API and its HTTP API: a repeated
//! prompt computes only what its cached prefix lacks (never its last token), the counters of
//! `/metrics` say so, freed cached blocks count as free, eviction under pressure; and the
//! timing model's sleep.

use std::time::Duration;

use super::tests::{http, prompt, request, run, serve, small_config, start};
use super::*;

pub(crate) fn caching_config(num_blocks: usize) -> EngineConfig {
    EngineConfig { enable_prefix_caching: true, ..small_config(num_blocks, 8192) }
}

/// Counters as (queries, hits, local_compute, local_cache_hit, external).
fn counters(engine: &EngineHandle) -> (u64, u64, u64, u64, u64) {
    let s = engine.cache_stats();
    (
        s.prefix_cache_queries,
        s.prefix_cache_hits,
        s.prompt_tokens_local_compute,
        s.prompt_tokens_local_cache_hit,
        s.prompt_tokens_external_kv_transfer,
    )
}

#[tokio::test]
async fn a_repeated_prompt_computes_only_its_uncached_suffix() {
    let plain = start(small_config(32, 8192), None);
    let engine = start(caching_config(32), None);
    // 10 tokens, block 4: two full blocks and two tokens.
    let (want, _, _) = run(&plain, request("ref", prompt(10), 5)).await;
    assert_eq!(run(&engine, request("a", prompt(10), 5)).await.0, want);
    assert_eq!(counters(&engine), (10, 0, 10, 0, 0));
    let stats = engine.block_stats();
    // Freed blocks stay cached, and count as free: no request holds a block.
    assert_eq!((stats.free, stats.requests), (stats.total, 0));
    // The prompt's two full blocks and the first output block (tokens 8..12).
    assert_eq!(stats.cached, 3);
    assert_eq!(run(&engine, request("b", prompt(10), 5)).await.0, want);
    assert_eq!(counters(&engine), (20, 8, 12, 8, 0));
    // A prompt of exactly three blocks hits two: its last token is always computed.
    let (want12, _, _) = run(&plain, request("ref12", prompt(12), 2)).await;
    assert_eq!(run(&engine, request("c", prompt(12), 2)).await.0, want12);
    assert_eq!(run(&engine, request("d", prompt(12), 2)).await.0, want12);
    let (queries, hits, ..) = counters(&engine);
    assert_eq!((queries, hits), (44, 8 + 8 + 8));
    // A prompt that shares one block only hits that one.
    let mut other = prompt(10);
    other[5] = 999;
    let (want_other, _, _) = run(&plain, request("ref-o", other.clone(), 3)).await;
    assert_eq!(run(&engine, request("e", other, 3)).await.0, want_other);
    assert_eq!(counters(&engine).1, 24 + 4);
}

#[tokio::test]
async fn chunked_prefill_behind_a_hit_gives_the_same_tokens() {
    let plain = start(small_config(32, 8192), None);
    let engine = start(EngineConfig { enable_prefix_caching: true, ..small_config(32, 5) }, None);
    let (want, _, _) = run(&plain, request("ref", prompt(23), 4)).await;
    assert_eq!(run(&engine, request("a", prompt(23), 4)).await.0, want);
    let (b, c) = tokio::join!(run(&engine, request("b", prompt(23), 4)), run(&engine, request("c", prompt(23), 4)));
    assert_eq!((b.0, c.0), (want.clone(), want));
    assert_eq!(counters(&engine).1, 2 * 20);
}

#[tokio::test]
async fn free_cached_blocks_are_evicted_only_when_an_allocation_needs_them() {
    // 8 blocks; a 13-token prompt with max_tokens 1 takes 4 and caches its 3 full ones.
    let engine = start(caching_config(8), None);
    let (a, b, c) = (prompt(13), (500..513).collect::<Vec<u32>>(), (700..713).collect::<Vec<u32>>());
    run(&engine, request("a", a.clone(), 1)).await;
    // b takes never-used blocks and a's uncached one: nothing is evicted.
    run(&engine, request("b", b.clone(), 1)).await;
    assert_eq!(engine.block_stats().cached, 6);
    run(&engine, request("a-again", a.clone(), 1)).await;
    assert_eq!(counters(&engine).1, 12);
    // c needs 4 blocks, 2 of them cached ones: the least recently used go (b's, not a's,
    // which a-again used since), b's last block first.
    run(&engine, request("c", c, 1)).await;
    let stats = engine.block_stats();
    assert_eq!((stats.free, stats.total, stats.cached), (8, 8, 7));
    run(&engine, request("a-third", a, 1)).await;
    assert_eq!(counters(&engine).1, 12 + 12);
    run(&engine, request("b-again", b, 1)).await;
    assert_eq!(counters(&engine).1, 12 + 12 + 4);
}

#[test]
fn a_hybrid_model_refuses_prefix_caching() {
    let (shape, layout) = hybrid::HybridLayout::preset("gpt-oss-like").expect("a preset");
    let config = EngineConfig { shape, hybrid: Some(layout), ..caching_config(64) };
    assert!(matches!(config.check(), Err(ConfigError::HybridPrefixCaching { .. })));
    let events =
        EngineConfig { kv_events: Some(kv_events::KvEventsConfig::zmq("tcp://*:0", None)), ..small_config(8, 64) };
    assert!(matches!(events.check(), Err(ConfigError::KvEvents(kv_events::KvEventsError::NeedsPrefixCaching))));
}

#[tokio::test]
async fn metrics_and_blocks_report_the_cache_over_http() {
    let engine = start(caching_config(32), None);
    let addr = serve(engine.clone()).await;
    let body = r#"{"prompt": "w1 w2 w3 w4 w5 w6 w7 w8 w9", "max_tokens": 2}"#;
    for _ in 0..2 {
        let (status, _, _) = http(&addr, "POST", "/v1/completions", body).await;
        assert_eq!(status, 200);
    }
    let (_, _, metrics) = http(&addr, "GET", "/metrics", "").await;
    let labels = r#"engine="0",model_name="Qwen/Qwen3-8B""#;
    for line in [
        format!("vllm:prefix_cache_queries_total{{{labels}}} 18.0"),
        format!("vllm:prefix_cache_hits_total{{{labels}}} 8.0"),
        format!(r#"vllm:prompt_tokens_by_source_total{{{labels},source="local_compute"}} 10.0"#),
        format!(r#"vllm:prompt_tokens_by_source_total{{{labels},source="local_cache_hit"}} 8.0"#),
        format!(r#"vllm:prompt_tokens_by_source_total{{{labels},source="external_kv_transfer"}} 0.0"#),
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} not in\n{metrics}");
    }
    let (_, _, blocks) = http(&addr, "GET", "/pdflow/blocks", "").await;
    let blocks: BlockStats = serde_json::from_str(&blocks).expect("block stats");
    assert_eq!((blocks.free, blocks.total, blocks.requests, blocks.cached), (32, 32, 0, 2));
}

#[tokio::test]
async fn the_timing_model_makes_a_step_last_as_long_as_a_gpus() {
    let timing =
        ForwardTiming { prefill_per_token: Duration::from_millis(2), decode_per_step: Duration::from_millis(15) };
    let engine = start(EngineConfig { forward_timing: Some(timing), ..small_config(32, 8192) }, None);
    let at = std::time::Instant::now();
    // One prefill step of 20 tokens (40 ms, sampling the first token), then 3 decode steps.
    run(&engine, request("a", prompt(20), 4)).await;
    assert!(at.elapsed() >= Duration::from_millis(40 + 3 * 15), "took {:?}", at.elapsed());
}
