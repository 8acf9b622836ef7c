//! Hybrid models on the simulated engine (`--kv-shape gpt-oss-like | qwen3.5-like`): groups of
//! full attention, a sliding window or a recurrent state, each moving from P to D what it needs.
//! `pdflow demo` verifies both presets (output, KV checksum, no leak) and moves the window's and
//! the state's blocks, not all P holds; `pdflow serve` P and D as processes give a single
//! engine's tokens; what a hybrid model cannot run with is refused at start-up, saying why.

use std::time::Duration;

use pdflow_sim_engine::hybrid::HybridLayout;
use pdflow_sim_engine::EngineConfig;
use pdflow_tests::processes::{pdflow_bin, run_demo, Proc};
use pdflow_tests::{completion, http_client, post, prompt, reference_of, token_ids, wait_healthy};

/// Bytes of one block in one region of either preset (heads × block size × K and V × bf16).
const REGION_BLOCK: u64 = 32 * 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_verifies_both_hybrid_presets_moving_what_each_group_needs() {
    // gpt-oss-like: 12 regions (one sliding and one full layer each); the 999 tokens D loads are
    // 63 blocks of 16: every full-attention block, and cdiv(128, 16) + 1 = 9 of the window's.
    let (report, _) = run_demo(&["--kv-shape", "gpt-oss-like", "--max-tokens", "16"]).await;
    assert_eq!(report["verified"], true, "{report}");
    assert_eq!(report["output_matches_reference"], true);
    assert_eq!(report["blocks"], 63 + 9, "{report}");
    assert_eq!(report["kv_bytes"], (63 + 9) * 12 * REGION_BLOCK, "{report}");
    // qwen3.5-like: 6 regions (one layer of each group); every full-attention block and one state
    // page of each of the three state groups.
    let (report, _) = run_demo(&["--kv-shape", "qwen3.5-like", "--max-tokens", "16"]).await;
    assert_eq!(report["verified"], true, "{report}");
    assert_eq!(report["blocks"], 63 + 3, "{report}");
    assert_eq!(report["kv_bytes"], (63 + 3) * 6 * REGION_BLOCK, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_processes_of_a_hybrid_model_give_a_single_engine_s_tokens() {
    for preset in ["qwen3.5-like", "gpt-oss-like"] {
        let common = ["--kv-shape", preset, "--num-blocks", "256", "--verify-checksums"];
        let mut p_args = vec!["serve", "--role", "producer", "--bootstrap-port", "0"];
        p_args.extend(common);
        let producer = Proc::spawn("producer", &p_args, &[]).await.expect("producer starts");
        let mut d_args = vec!["serve", "--role", "consumer", "--kv-load-failure-policy", "fail"];
        d_args.extend(common);
        let consumer = Proc::spawn("consumer", &d_args, &[]).await.expect("consumer starts");
        let bootstrap_port = producer.ready["bootstrap_addr"]
            .as_str()
            .and_then(|a| a.rsplit(':').next())
            .expect("P's bootstrap address")
            .to_string();
        let proxy = Proc::proxy(&producer, &bootstrap_port, &consumer).await.expect("proxy starts");
        let client = http_client();
        wait_healthy(&client, &proxy.url(), Duration::from_secs(20)).await.expect("proxy ready");
        let (shape, layout) = HybridLayout::preset(preset).expect("a preset");
        let reference_cfg = EngineConfig { shape, hybrid: Some(layout), num_blocks: 256, ..EngineConfig::default() };
        // Within the window, past it, and one token past a block.
        for (i, tokens) in [40usize, 300, 129].into_iter().enumerate() {
            let body = completion(&prompt(tokens, 70 + i as u64), 12);
            let (status, response) =
                post(&client, &format!("{}/v1/completions", proxy.url()), &body).await.expect("request");
            assert_eq!(status, 200, "{preset}: {response}");
            let reference = reference_of(reference_cfg.clone(), &body).await.expect("reference run");
            assert_eq!(token_ids(&response), token_ids(&reference), "{preset}, prompt of {tokens} tokens");
        }
        for engine in [&producer, &consumer] {
            engine.assert_blocks_at_baseline(&client, preset).await;
        }
        for proc in [proxy, consumer, producer] {
            proc.stop().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_hybrid_model_cannot_run_with_is_refused_at_start_up() {
    for (extra, says) in [
        (vec!["--layerwise", "on"], "layer-wise transfer is for models of one KV-cache group"),
        (vec!["--tensor-parallel-size", "2"], "a hybrid model runs on one rank"),
    ] {
        let mut args = vec!["serve", "--role", "producer", "--bootstrap-port", "0", "--kv-shape", "gpt-oss-like"];
        args.extend(extra.iter().copied());
        let run =
            tokio::process::Command::new(pdflow_bin().expect("pdflow binary")).args(&args).kill_on_drop(true).output();
        let out = tokio::time::timeout(Duration::from_secs(30), run).await.expect("exits within 30 s").expect("runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?}: started; stdout {}", String::from_utf8_lossy(&out.stdout));
        assert!(stderr.contains(says), "{extra:?}: {stderr}");
    }
}
