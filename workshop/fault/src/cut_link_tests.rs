//! The cut link over real sockets: exactly K bytes reach D, then both sides see the link die;
//! D's fenced data server keeps nothing past what the link carried, its pull's fence closes at
//! once, and it goes on serving. The flipping link alters exactly one byte; under TLS the altered
//! record is refused and nothing altered lands.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_kv::planner::{build_plan, TransferPlan};
use pdflow_messages::BlockId;
use pdflow_transfer::fence::WriteFence;
use pdflow_transfer::tcp::{TcpConfig, TcpDataServer, TcpTransferEngine};
use pdflow_transfer::{TransferEngine, TransferError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::{CutEngine, CutLink, LinkFault};

const SMALL: KvShape = KvShape { num_layers: 4, num_kv_heads: 2, head_dim: 8, dtype_bytes: 2, block_size: 4 };
/// 64 KiB per block and layer: a plan of a few blocks goes over several streams.
const LARGE: KvShape = KvShape { num_layers: 4, num_kv_heads: 8, head_dim: 128, dtype_bytes: 2, block_size: 16 };
const BOUND: Duration = Duration::from_secs(10);

async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, fut).await.unwrap_or_else(|_| panic!("{what}: no end within {BOUND:?}"))
}

/// A server that records every byte it gets until its peer is gone.
async fn recording_server() -> (String, tokio::task::JoinHandle<Vec<u8>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let addr = listener.local_addr().expect("address").to_string();
    let task = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.expect("the link connects");
        let mut got = Vec::new();
        let _ = stream.read_to_end(&mut got).await;
        got
    });
    (addr, task)
}

#[tokio::test]
async fn the_link_carries_exactly_k_bytes_then_dies_on_both_sides_and_takes_no_new_connection() {
    for k in [1u64, 4096, 70_000] {
        let (to, server) = recording_server().await;
        let link = CutLink::start(&to, k).await.expect("link starts");
        let mut p = tokio::net::TcpStream::connect(link.addr()).await.expect("P connects");
        let sent: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        // P writes more than the link carries; its writes or its read fail once the link is cut.
        let _ = p.write_all(&sent).await;
        let got = bounded("D sees the link die", server).await.expect("server task");
        assert_eq!(got.len() as u64, k, "exactly K bytes reach D");
        assert_eq!(got[..], sent[..got.len()], "the first K bytes, in order");
        assert!(link.is_cut());
        let mut buf = [0u8; 1];
        assert!(matches!(bounded("P's read", p.read(&mut buf)).await, Ok(0) | Err(_)), "P's side is closed too");
        let mut late = tokio::net::TcpStream::connect(link.addr()).await.expect("the port still accepts");
        assert!(matches!(bounded("late read", late.read(&mut buf)).await, Ok(0) | Err(_)), "and closes at once");
    }
}

struct Fenced {
    src: Arc<KvCache>,
    dst: Arc<KvCache>,
    _server: TcpDataServer,
    peer: String,
    fence: WriteFence,
}

async fn fenced(shape: KvShape, num_blocks: usize) -> Fenced {
    let fence = WriteFence::new();
    let (src, dst) = (KvCache::patterned(shape, num_blocks, 0), KvCache::new(shape, num_blocks));
    let addr = "127.0.0.1:0".parse().expect("valid address");
    let server =
        TcpDataServer::bind_fenced(addr, dst.region_table(), None, false, Some(fence.clone())).await.expect("binds");
    let peer = server.local_addr().to_string();
    Fenced { src, dst, _server: server, peer, fence }
}

impl Fenced {
    fn plan(&self, src: &[BlockId], dst: &[BlockId], fence: u64) -> TransferPlan {
        let plan = build_plan(&self.src.regions(), src, &self.dst.regions(), dst, true).expect("plannable");
        TransferPlan { fence, ..plan }
    }

    /// How many of the plan's bytes, from its start, D holds as P's: the rest must be zero.
    fn landed_prefix(&self, plan: &TransferPlan) -> u64 {
        let (src, dst) = (self.src.region_table(), self.dst.region_table());
        let (mut at, mut prefix, mut ended) = (0u64, 0u64, false);
        for d in &plan.descriptors {
            // SAFETY: test only; the plan was checked against both caches.
            let want = unsafe { src.slice(d.src, d.len) }.expect("in P's regions");
            let got = unsafe { dst.slice(d.dst, d.len) }.expect("in D's regions");
            for (i, (w, g)) in want.iter().zip(got).enumerate() {
                if !ended && w == g {
                    prefix = at + i as u64 + 1;
                } else {
                    ended = true;
                    assert_eq!(*g, 0, "D holds a byte at plan offset {} past the landed prefix", at + i as u64);
                }
            }
            at += d.len;
        }
        prefix
    }
}

fn assert_failed_on_the_link(err: &TransferError) {
    assert!(
        matches!(err, TransferError::Io { .. } | TransferError::Connect { .. }),
        "expected a dead link, got {err:?}"
    );
}

#[tokio::test]
async fn a_cut_write_fails_d_keeps_nothing_past_the_cut_and_its_closed_fence_refuses_the_rest() {
    let f = fenced(SMALL, 32).await;
    let (src_blocks, dst_blocks): (Vec<BlockId>, Vec<BlockId>) = ((1..5).collect(), (10..14).collect());
    let plan = f.plan(&src_blocks, &dst_blocks, 7);
    for (token, k) in [(7u64, 0u64), (8, 300), (9, plan.total_bytes() / 2)] {
        let plan = TransferPlan { fence: token, ..plan.clone() };
        f.fence.open(token);
        let cut = CutEngine::new(f.src.region_table(), TcpConfig::default(), LinkFault::CutAfter(k));
        let err = bounded("cut write", cut.write(&f.peer, &plan)).await.expect_err("a cut write fails");
        assert_failed_on_the_link(&err);
        // What landed is a prefix of the plan, shorter than what the link carried (hello, fence
        // and header came first); the torn batch is not in flight: the fence closes at once.
        bounded("fence close", f.fence.close(token, Duration::from_secs(2))).await.expect("no batch left in flight");
        assert!(f.landed_prefix(&plan) < k.max(1), "k = {k}");
    }
    // A late write for a closed pull is refused whole; the server goes on serving a new pull.
    let node_engine = TcpTransferEngine::new(f.src.region_table(), TcpConfig::default());
    let late = TransferPlan { fence: 9, ..plan.clone() };
    let err = bounded("late write", node_engine.write(&f.peer, &late)).await.expect_err("fence closed");
    assert!(matches!(&err, TransferError::Refused { reason, .. } if reason.contains("fence 9 is closed")), "{err:?}");
    f.fence.open(10);
    let next = f.plan(&[6, 7], &[16, 17], 10);
    bounded("next write", node_engine.write(&f.peer, &next)).await.expect("the next write succeeds");
    assert_eq!(f.landed_prefix(&next), next.total_bytes());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_spread_over_streams_counts_k_over_the_whole_write() {
    let f = fenced(LARGE, 16).await;
    let (src_blocks, dst_blocks): (Vec<BlockId>, Vec<BlockId>) = ((0..12).collect(), (3..15).collect());
    let plan = f.plan(&src_blocks, &dst_blocks, 3);
    let k = plan.total_bytes() / 2;
    f.fence.open(3);
    let config = TcpConfig { streams_per_peer: 4, ..TcpConfig::default() };
    let cut = CutEngine::new(f.src.region_table(), config, LinkFault::CutAfter(k));
    let err = bounded("cut write", cut.write(&f.peer, &plan)).await.expect_err("a cut write fails");
    assert_failed_on_the_link(&err);
    bounded("fence close", f.fence.close(3, Duration::from_secs(5))).await.expect("every torn batch ended");
    // Bytes of every stream landed, at most K in all.
    let landed: usize = (0..plan.descriptors.len())
        .map(|i| {
            let d = plan.descriptors[i];
            let (src, dst) = (f.src.region_table(), f.dst.region_table());
            // SAFETY: test only; the plan was checked against both caches.
            let (want, got) = unsafe { (src.slice(d.src, d.len).expect("P"), dst.slice(d.dst, d.len).expect("D")) };
            want.iter().zip(got).filter(|(w, g)| w == g && **g != 0).count()
        })
        .sum();
    assert!((landed as u64) <= k, "{landed} bytes landed through a link cut after {k}");
}

/// `flip_data`: the write succeeds and every byte lands but one, which differs — what a tamperer
/// on the path leaves in D's blocks for its `verify_checksums` to find.
#[tokio::test]
async fn a_flipping_link_alters_exactly_one_payload_byte_and_the_write_succeeds() {
    let f = fenced(SMALL, 32).await;
    let (src_blocks, dst_blocks): (Vec<BlockId>, Vec<BlockId>) = ((1..5).collect(), (10..14).collect());
    let plan = f.plan(&src_blocks, &dst_blocks, 5);
    f.fence.open(5);
    let flip = CutEngine::new(f.src.region_table(), TcpConfig::default(), LinkFault::FlipAt(plan.total_bytes() / 2));
    bounded("flipped write", flip.write(&f.peer, &plan)).await.expect("the write itself succeeds");
    let differ: usize = plan
        .descriptors
        .iter()
        .map(|d| {
            let (src, dst) = (f.src.region_table(), f.dst.region_table());
            // SAFETY: test only; the plan was checked against both caches.
            let (want, got) = unsafe { (src.slice(d.src, d.len).expect("P"), dst.slice(d.dst, d.len).expect("D")) };
            want.iter().zip(got).filter(|(w, g)| w != g).count()
        })
        .sum();
    assert_eq!(differ, 1, "exactly one byte of D's blocks differs from P's");
}

/// `flip_data` against a data channel under TLS: the altered record fails D's decryption, so the
/// write fails, and D holds only what came before that record — not one altered byte.
#[tokio::test]
async fn under_tls_a_flipped_byte_fails_the_write_and_nothing_altered_lands() {
    let secret = pdflow_auth::ClusterSecret::from_text("the-cluster-secret-0001").expect("valid secret");
    let mut config = TcpConfig { secret: Some(secret.clone()), ..TcpConfig::default() };
    config.set_tls(true).expect("TLS with the secret");
    let fence = WriteFence::new();
    let (src, dst) = (KvCache::patterned(SMALL, 32, 0), KvCache::new(SMALL, 32));
    let options = pdflow_transfer::tcp::DataServerOptions {
        secret: Some(secret),
        tls: config.tls.clone(),
        fence: Some(fence.clone()),
        ..Default::default()
    };
    let server = TcpDataServer::bind_options("127.0.0.1:0".parse().expect("address"), dst.region_table(), options)
        .await
        .expect("binds");
    let f = Fenced { src, dst, peer: server.local_addr().to_string(), _server: server, fence };
    let (src_blocks, dst_blocks): (Vec<BlockId>, Vec<BlockId>) = ((1..5).collect(), (10..14).collect());
    let plan = f.plan(&src_blocks, &dst_blocks, 5);
    f.fence.open(5);
    let flip = CutEngine::new(f.src.region_table(), config, LinkFault::FlipAt(plan.total_bytes() / 2));
    let err = bounded("flipped write", flip.write(&f.peer, &plan)).await.expect_err("TLS refuses the altered record");
    assert_failed_on_the_link(&err);
    bounded("fence close", f.fence.close(5, Duration::from_secs(2))).await.expect("no batch left in flight");
    // Every byte D holds is P's (a prefix of the plan); the rest is untouched.
    assert!(f.landed_prefix(&plan) < plan.total_bytes());
}
