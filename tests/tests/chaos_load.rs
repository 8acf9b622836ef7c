//! Load with faults, reduced (`pdflow chaos --load` runs 2,000 requests at
//! concurrency 64): 240 requests at concurrency 16 through the proxy and 2P2D in this process,
//! 5 % of them (12) each given one random per-request fault from a fixed seed. Every request must
//! end clean and correct, no engine may keep a block or a request, RSS must stay flat, and every
//! P and D must serve again afterwards. (Proxy actor kills included: the proxy's HTTP server
//! outlives its actor, so no client is refused while it restarts.)

use pdflow_tools::chaos::{self, load};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn load_with_faults_ends_every_request_clean_with_no_leak_and_flat_memory() {
    let layers = chaos::install_layers();
    let opts = load::LoadOptions {
        requests: 240,
        concurrency: 16,
        fault_rate: 0.05,
        seed: 3,
        warmup: 48,
        ..load::LoadOptions::default()
    };
    let started = std::time::Instant::now();
    let r = load::run(&opts, &layers, |_, _, _| {}).await.expect("the load cluster starts");
    eprintln!("{}\n(in {:.1} s)", load::render(&r), started.elapsed().as_secs_f64());
    assert_eq!(r.faults_planned, 12);
    assert!(r.faults_fired >= 1, "no planned fault fired: {:?}", r.planned);
    assert_eq!((r.unclean, r.incorrect), (0, 0), "bad requests: {:#?}", r.bad);
    assert_eq!(r.outcomes.values().sum::<usize>(), 240, "every request has an outcome");
    for (engine, blocks) in &r.leaked_blocks {
        assert_eq!(*blocks, 0, "{engine} kept blocks");
    }
    assert!(r.stuck_requests.values().all(|n| *n == 0), "requests still tracked: {:?}", r.stuck_requests);
    assert!(
        r.tracked_transfers.values().all(|n| *n == 0),
        "transfers still tracked by the actors: {:?}",
        r.tracked_transfers
    );
    assert!(r.memory_flat, "RSS grew by {} bytes (bound {})", r.rss_growth_bytes, r.rss_bound_bytes);
    assert!(r.serving_after, "{:?}", r.problems);
    assert!(r.passed, "{:?}", r.problems);
}
