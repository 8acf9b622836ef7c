//! Requests that share a long prefix, sent together through `pdflow proxy` to one P and one D
//! (`pdflow serve` processes, P's forward timed as an H200's so that its prefill takes a GPU's
//! time): D holds the later ones while the first one's KV is in flight, and they load only what
//! follows the prefix. D's `vllm:prompt_tokens_by_source{source="external_kv_transfer"}` says how
//! many prompt tokens came from P. Every answer equals one engine's; every block is given back.

use std::time::Duration;

use pdflow_tests::processes::Proc;
use pdflow_tests::{completion, http_client, post, prompt, reference, token_ids, SMALL};

const SHAPE: &str = "4,2,16,16";
const PREFIX_WORDS: usize = 600;
const REQUESTS: u64 = 4;

/// D's prompt tokens that came from P.
async fn loaded_tokens(client: &reqwest::Client, d: &Proc) -> f64 {
    let text = client.get(format!("{}/metrics", d.url())).send().await.expect("metrics").text().await.expect("text");
    text.lines()
        .filter(|l| l.starts_with("vllm:prompt_tokens_by_source") && l.contains("source=\"external_kv_transfer\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_sharing_a_prefix_in_flight_load_it_once() {
    let client = http_client();
    let p = Proc::spawn(
        "producer",
        &[
            "serve",
            "--role",
            "producer",
            "--kv-shape",
            SHAPE,
            "--num-blocks",
            "1024",
            "--bootstrap-port",
            "0",
            "--forward-timing",
            "h200",
        ],
        &[],
    )
    .await
    .expect("P starts");
    let d_args =
        ["serve", "--role", "consumer", "--kv-shape", SHAPE, "--num-blocks", "1024", "--enable-prefix-caching"];
    let d = Proc::spawn("consumer", &d_args, &[]).await.expect("D starts");
    let bootstrap = p.ready["bootstrap_addr"].as_str().expect("P's bootstrap").to_owned();
    let port = bootstrap.rsplit(':').next().unwrap_or_default().to_owned();
    let args = ["proxy", "--port", "0", "--prefill", &p.url(), &port, "--decode", &d.url()];
    let proxy = Proc::spawn("proxy", &args, &[]).await.expect("the proxy starts");
    pdflow_tests::wait_healthy(&client, &proxy.url(), Duration::from_secs(10)).await.expect("the proxy is ready");

    let url = format!("{}/v1/completions", proxy.url());
    let prefix = prompt(PREFIX_WORDS, 7);
    let bodies: Vec<_> = (0..REQUESTS).map(|i| completion(&format!("{prefix} {}", prompt(4, 100 + i)), 4)).collect();
    let answers = futures::future::join_all(bodies.iter().map(|body| post(&client, &url, body))).await;
    let mut prompt_tokens = 0.0;
    for (body, answer) in bodies.iter().zip(answers) {
        let (status, answer) = answer.expect("the proxy answers");
        assert_eq!(status, 200, "{answer}");
        assert_eq!(token_ids(&answer), token_ids(&reference(SMALL, body).await.expect("reference")));
        prompt_tokens = answer["usage"]["prompt_tokens"].as_f64().unwrap_or(prompt_tokens);
    }
    assert!(prompt_tokens > PREFIX_WORDS as f64, "the answers name their prompt tokens");
    // All four at once would move the prefix four times; held, it moves once, and each of the
    // other three moves its own tail (the block the prefix and the question share, and on).
    let loaded = loaded_tokens(&client, &d).await;
    assert!(
        loaded < 2.0 * prompt_tokens,
        "D loaded {loaded} prompt tokens for {REQUESTS} prompts of {prompt_tokens} that share {PREFIX_WORDS}"
    );
    assert!(loaded >= prompt_tokens, "the first request loaded its whole prompt ({loaded})");
    for engine in [&p, &d] {
        engine.assert_blocks_at_baseline(&client, "after the shared-prefix burst").await;
    }
}
