//! `pdflow bench transfer`'s choice of backends, its row budget, and the rdma rows' pulls (D's
//! grant under a fence token, P's write of the plan that carries it, the keys revoked when the
//! token closes) on libfabric's software `tcp` provider over 127.0.0.1 — skipped, saying why,
//! where the rdma backend does not run.

use clap::Parser;

use super::*;

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    opts: Options,
}

fn opts(args: &[&str]) -> Options {
    Cli::try_parse_from(std::iter::once("bench-transfer").chain(args.iter().copied())).expect("flags parse").opts
}

#[test]
fn backends_run_in_the_order_given_each_once() {
    let o = opts(&["--backend", "same-host,tcp", "--backend", "tcp"]);
    assert_eq!(backends(&o).expect("chosen"), vec![Backend::SameHost, Backend::Tcp]);
    let all = backends(&opts(&[])).expect("the default");
    assert_eq!(all[..2], [Backend::Tcp, Backend::SameHost]);
    assert!(all.len() == 2 || (cfg!(feature = "rdma") && all[2] == Backend::Rdma), "{all:?}");
}

#[test]
fn backend_rdma_says_why_it_cannot_run_here() {
    let o = opts(&["--backend", "tcp,rdma"]);
    match pdflow_transfer::rdma_runs_here("tcp", "127.0.0.1") {
        Ok(()) => assert_eq!(backends(&o).expect("chosen"), vec![Backend::Tcp, Backend::Rdma]),
        Err(why) => {
            let err = backends(&o).expect_err("refused").to_string();
            assert!(err.starts_with("--backend rdma: "), "{err}");
            if cfg!(feature = "rdma") {
                assert!(err.contains(&why), "{err}");
            } else {
                assert!(err.contains("--features rdma"), "{err}");
            }
        }
    }
    // A provider that opens nowhere is refused before anything starts.
    if cfg!(feature = "rdma") {
        let o = opts(&["--backend", "rdma", "--rdma-provider", "no-such-provider"]);
        let err = backends(&o).expect_err("refused").to_string();
        assert!(err.contains("no-such-provider"), "{err}");
    }
}

#[test]
fn a_slow_row_runs_fewer_times_and_says_so() {
    let o = opts(&["--runs", "15", "--warmup", "3"]);
    let sample = |secs: f64| Sample { wall: Duration::from_secs_f64(secs), cpu: None };
    let (fast, name) = within_budget(&o, sample(0.04), "engine seed coalesced (36 desc)");
    assert_eq!((fast.runs, fast.warmup, name.as_str()), (15, 3, "engine seed coalesced (36 desc)"));
    let (slower, name) = within_budget(&o, sample(4.0), "row");
    assert_eq!((slower.runs, slower.warmup, name.as_str()), (15, 0, "row"));
    let (slow, name) = within_budget(&o, sample(45.0), "row");
    assert_eq!((slow.runs, slow.warmup, name.as_str()), (1, 0, "row [1 of 15 runs]"));
}

/// The rdma rows' pull, as the bench makes it: D grants the blocks under a token, P's engine (as
/// a node with `--transport rdma` builds it) writes the plan carrying the grant, and closing the
/// token cleanly revokes the keys — a second write with them is refused, nothing lands.
#[cfg(feature = "rdma")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rdma_rows_write_lands_in_the_granted_blocks_and_its_keys_die_with_the_token() {
    if let Err(why) = pdflow_transfer::rdma_runs_here("tcp", "127.0.0.1") {
        pdflow_testkit::skipped("bench transfer's rdma pull", &why);
        return;
    }
    let shape = KvShape { num_layers: 4, num_kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_size: 16 };
    let (p, d) = (KvCache::patterned(shape, 16, 1), KvCache::new(shape, 32));
    let target = Arc::new(pdflow_transfer::rdma::RdmaTarget::start("tcp", "127.0.0.1", None).expect("D listens"));
    let fence = WriteFence::new().with_remote(target.clone());
    let config = TcpConfig {
        same_host: Backend::Rdma.mode(),
        rdma: Backend::Rdma.rdma(),
        write_timeout: Duration::from_secs(20),
        ..TcpConfig::default()
    };
    let engine = AutoTransferEngine::new(p.region_table(), config);
    let (src, dst): (&[BlockId], &[BlockId]) = (&[1, 2, 3], &[20, 21, 22]);
    let plan = build_plan(&p.regions(), src, &d.regions(), dst, true).expect("plan");

    let granted = Granted::open(&fence, &d, dst).expect("D grants");
    assert_eq!(target.granted_regions(), shape.num_layers, "one run of blocks per region");
    let with_grant = granted.plan(&plan);
    assert_eq!(with_grant.fence, granted.token);
    let stats = engine.write("127.0.0.1:1", &with_grant).await.expect("written one-sided");
    assert_eq!(stats.bytes, plan.total_bytes());
    assert_eq!(engine.backend_for("127.0.0.1:1"), "rdma");
    assert_eq!(p.blocks_checksum(src).expect("P's"), d.blocks_checksum(dst).expect("D's"), "D holds P's bytes");

    granted.close(true);
    assert_eq!(target.granted_regions(), 0, "the token's keys are revoked");
    // P's block 9 over D's block 20 with the revoked keys: D's provider refuses it.
    let late = build_plan(&p.regions(), &[9], &d.regions(), &[20], true).expect("plan");
    let late = TransferPlan { fence: with_grant.fence, grant: with_grant.grant.clone(), ..late };
    engine.write("127.0.0.1:1", &late).await.expect_err("a revoked grant writes nothing");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(d.blocks_checksum(&[20]).expect("D's"), p.blocks_checksum(&[1]).expect("P's"), "block 20 unchanged");
}
