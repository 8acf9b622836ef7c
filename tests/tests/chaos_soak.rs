//! The soak, short (`pdflow chaos soak --duration 1h` runs an hour): 60 s of mixed load —
//! streamed and not, prompts of 16–400 tokens — through the proxy and 2P2D in this process, 2 %
//! of the requests each given a random fault (actor kills; side-channel messages dropped,
//! corrupted, delayed), RSS and open fds sampled every 2 s. Asserts the verdict, not timing:
//! every request accounted for and clean, blocks at baseline on every engine, nothing tracked,
//! every node serving after, memory and descriptors flat after the warm-up. A wedged runtime
//! (no answer for 60 s) ends the test binary with status 3 and the diagnosis on stderr.

use std::time::Duration;

use pdflow_tools::chaos::{self, soak};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_short_soak_accounts_for_every_request_and_stays_flat() {
    let layers = chaos::install_layers();
    let opts = soak::SoakOptions {
        duration: Duration::from_secs(60),
        warmup: Some(Duration::from_secs(12)),
        concurrency: 16,
        fault_rate: 0.02,
        seed: 5,
        sample_every: Duration::from_secs(2),
        ..soak::SoakOptions::default()
    };
    let r = soak::run(&opts, &layers, |line| eprintln!("{line}")).await.expect("the soak cluster starts");
    eprintln!("{}", soak::render(&r));
    assert!(r.requests > 0 && r.streamed > 0 && r.streamed < r.requests, "a mix of streamed and whole answers");
    assert!(r.faults_fired >= 1, "no fault fired");
    assert!(r.accounted, "{} requests, outcomes {:?}", r.requests, r.outcomes);
    assert_eq!((r.unclean, r.incorrect), (0, 0), "bad requests: {:#?}", r.bad);
    assert!(r.leaked_blocks.values().all(|b| *b == 0), "blocks held: {:?}", r.leaked_blocks);
    assert!(r.stuck_requests.values().all(|n| *n == 0), "requests tracked: {:?}", r.stuck_requests);
    assert!(r.tracked_transfers.values().all(|n| *n == 0), "transfers tracked: {:?}", r.tracked_transfers);
    assert!(r.serving_after, "{:?}", r.problems);
    assert!(r.rss.flat && r.fds.flat, "RSS {:?}, fds {:?}", r.rss, r.fds);
    assert!(r.passed, "{:?}", r.problems);
}
