//! Tests of the tcp backend over real sockets on 127.0.0.1: two KV caches in one process, a plan
//! from the planner, and the destination's bytes compared block by block with the source's.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdflow_messages::BlockId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::engine::split_by_bytes;
use super::wire::{self, Ack, BATCH_MAGIC};
use super::*;
use crate::{TransferEngine, TransferError};
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_kv::planner::{build_plan, Descriptor, TransferPlan};

const SMALL: KvShape = KvShape { num_layers: 4, num_kv_heads: 2, head_dim: 8, dtype_bytes: 2, block_size: 4 };
/// 64 KiB per block and layer: large enough for a plan to use several streams.
const LARGE: KvShape = KvShape { num_layers: 4, num_kv_heads: 8, head_dim: 128, dtype_bytes: 2, block_size: 16 };
const BOUND: Duration = Duration::from_secs(10);

async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, fut).await.unwrap_or_else(|_| panic!("{what} did not finish within {BOUND:?}"))
}

struct Pair {
    src: Arc<KvCache>,
    dst: Arc<KvCache>,
    server: TcpDataServer,
    engine: TcpTransferEngine,
    peer: String,
}

async fn pair(shape: KvShape, num_blocks: usize, server_token: Option<&str>, config: TcpConfig) -> Pair {
    let src = KvCache::patterned(shape, num_blocks, 1);
    let dst = KvCache::new(shape, num_blocks);
    let addr = "127.0.0.1:0".parse().expect("valid address");
    let server = TcpDataServer::bind(addr, dst.region_table(), server_token.map(str::to_string)).await.expect("binds");
    let peer = server.local_addr().to_string();
    let engine = TcpTransferEngine::new(src.region_table(), config);
    Pair { src, dst, server, engine, peer }
}

impl Pair {
    fn plan(&self, src_blocks: &[BlockId], dst_blocks: &[BlockId], coalesce: bool) -> TransferPlan {
        build_plan(&self.src.regions(), src_blocks, &self.dst.regions(), dst_blocks, coalesce).expect("plannable")
    }

    fn assert_copied(&self, src_blocks: &[BlockId], dst_blocks: &[BlockId]) {
        crate::test_blocks::assert_copied(&self.src, &self.dst, src_blocks, dst_blocks);
    }

    fn assert_untouched(&self, dst_blocks: &[BlockId]) {
        crate::test_blocks::assert_untouched(&self.dst, dst_blocks);
    }
}

#[tokio::test]
async fn plans_coalesced_or_not_contiguous_or_fragmented_arrive_intact() {
    let cases: [(&[BlockId], &[BlockId]); 2] = [
        (&[3, 4, 5, 6, 7, 8, 9, 10, 11, 12], &[17, 18, 19, 20, 21, 22, 23, 24, 25, 26]),
        (&[1, 2, 3, 7, 8, 20, 21, 22], &[30, 31, 5, 6, 7, 10, 12, 13]),
    ];
    for (src_blocks, dst_blocks) in cases {
        for coalesce in [true, false] {
            let p = pair(SMALL, 32, None, TcpConfig::default()).await;
            let plan = p.plan(src_blocks, dst_blocks, coalesce);
            let stats = bounded("write", p.engine.write(&p.peer, &plan)).await.expect("write succeeds");
            assert_eq!(stats.bytes, (src_blocks.len() * SMALL.bytes_per_block()) as u64);
            assert_eq!(stats.descriptors, plan.descriptors.len());
            p.assert_copied(src_blocks, dst_blocks);
            p.assert_untouched(&[0, 29]);
            assert_eq!(
                p.src.blocks_checksum(src_blocks).expect("in range"),
                p.dst.blocks_checksum(dst_blocks).expect("in range"),
                "checksums differ (coalesce {coalesce})"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_plan_is_spread_over_pooled_streams_which_are_reused() {
    let p = pair(LARGE, 16, None, TcpConfig { streams_per_peer: 4, ..TcpConfig::default() }).await;
    let (src_blocks, dst_blocks): (Vec<BlockId>, Vec<BlockId>) = ((0..12).collect(), (3..15).collect());
    let plan = p.plan(&src_blocks, &dst_blocks, true);
    assert_eq!(plan.descriptors.len(), 4, "one descriptor per layer");
    bounded("write", p.engine.write(&p.peer, &plan)).await.expect("write succeeds");
    p.assert_copied(&src_blocks, &dst_blocks);
    assert_eq!(p.engine.pooled_connections(&p.peer), 4, "3 MiB over 4 streams");
    // The same plan again reuses the pool rather than growing it.
    let plan = p.plan(&[15], &[0], true);
    bounded("second write", p.engine.write(&p.peer, &plan)).await.expect("write succeeds");
    p.assert_copied(&[15], &[0]);
    assert_eq!(p.engine.pooled_connections(&p.peer), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_concurrent_writes_to_one_peer_all_arrive() {
    let p = pair(SMALL, 32, None, TcpConfig { streams_per_peer: 2, ..TcpConfig::default() }).await;
    let jobs: Vec<(Vec<BlockId>, Vec<BlockId>, bool)> = (0..8u32)
        .map(|k| ((4 * k..4 * k + 4).collect(), (4 * (7 - k)..4 * (7 - k) + 4).rev().collect(), k % 2 == 0))
        .collect();
    let plans: Vec<TransferPlan> = jobs.iter().map(|(s, d, c)| p.plan(s, d, *c)).collect();
    let results =
        bounded("8 writes", futures::future::join_all(plans.iter().map(|plan| p.engine.write(&p.peer, plan)))).await;
    for (result, (s, d, _)) in results.into_iter().zip(&jobs) {
        result.expect("each concurrent write succeeds");
        p.assert_copied(s, d);
    }
}

#[tokio::test]
async fn an_out_of_region_descriptor_is_refused_and_the_server_keeps_serving() {
    let p = pair(SMALL, 32, None, TcpConfig::default()).await;
    let mut plan = p.plan(&[1, 2], &[5, 6], true);
    let last = p.dst.regions()[SMALL.num_layers - 1];
    // Straddles the end of D's last region.
    plan.descriptors.push(Descriptor {
        src: p.src.regions()[0].base_addr,
        dst: last.base_addr + last.len - 8,
        len: 64,
    });
    let err = bounded("refused write", p.engine.write(&p.peer, &plan)).await.expect_err("refused");
    assert!(
        matches!(&err, TransferError::Refused { reason, .. } if reason.contains("registered region")),
        "got {err:?}"
    );
    p.assert_untouched(&[5, 6]);

    let plan = p.plan(&[1, 2], &[5, 6], true);
    bounded("next write", p.engine.write(&p.peer, &plan)).await.expect("the next valid write succeeds");
    p.assert_copied(&[1, 2], &[5, 6]);
}

#[tokio::test]
async fn a_source_outside_local_regions_is_refused_before_connecting() {
    let p = pair(SMALL, 8, None, TcpConfig::default()).await;
    let plan = TransferPlan {
        descriptors: vec![Descriptor { src: 8, dst: p.dst.regions()[0].base_addr, len: 8 }],
        fence: 0,
        write_by: None,
        grant: None,
    };
    let err = bounded("write", p.engine.write(&p.peer, &plan)).await.expect_err("refused locally");
    assert!(matches!(err, TransferError::LocalRegion(_)), "got {err:?}");
    assert_eq!(p.engine.pooled_connections(&p.peer), 0);
}

/// Reads until the server closes the connection; returns what it sent.
async fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    // A reset instead of a clean close is also a close.
    let _ = bounded("server closing the connection", stream.read_to_end(&mut got)).await;
    got
}

#[tokio::test]
async fn garbage_and_oversize_headers_close_the_connection_and_the_server_keeps_serving() {
    let p = pair(SMALL, 8, None, TcpConfig::default()).await;
    let mut raw = TcpStream::connect(&p.peer).await.expect("connects");
    raw.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.expect("sends");
    read_until_closed(&mut raw).await;

    let mut raw = TcpStream::connect(&p.peer).await.expect("connects");
    raw.write_all(&wire::encode_hello(None).expect("hello")).await.expect("sends");
    assert_eq!(wire::read_ack(&mut raw).await.expect("hello ack"), Ack::Ok { batch_id: 0 });
    let mut huge = BATCH_MAGIC.to_vec();
    huge.extend_from_slice(&9u64.to_le_bytes());
    huge.extend_from_slice(&u32::MAX.to_le_bytes());
    raw.write_all(&huge).await.expect("sends");
    let answer = read_until_closed(&mut raw).await;
    match wire::read_ack(&mut &answer[..]).await.expect("a refusal before closing") {
        Ack::Refused { reason, .. } => assert!(reason.contains("descriptors"), "reason: {reason}"),
        other => panic!("expected a refusal, got {other:?}"),
    }

    let plan = p.plan(&[0, 1, 2], &[5, 6, 7], true);
    bounded("write", p.engine.write(&p.peer, &plan)).await.expect("the server still serves");
    p.assert_copied(&[0, 1, 2], &[5, 6, 7]);
}

#[tokio::test]
async fn a_wrong_or_missing_auth_token_is_refused() {
    for token in [Some("wrong"), None] {
        let config = TcpConfig { auth_token: token.map(str::to_string), ..TcpConfig::default() };
        let p = pair(SMALL, 8, Some("right"), config).await;
        let plan = p.plan(&[1], &[2], true);
        let err = bounded("write", p.engine.write(&p.peer, &plan)).await.expect_err("refused");
        assert!(matches!(&err, TransferError::Refused { reason, .. } if reason.contains("auth")), "got {err:?}");
        p.assert_untouched(&[2]);
    }
    let p = pair(SMALL, 8, Some("right"), TcpConfig { auth_token: Some("right".into()), ..TcpConfig::default() }).await;
    let plan = p.plan(&[1], &[2], true);
    bounded("write", p.engine.write(&p.peer, &plan)).await.expect("the right token is accepted");
    p.assert_copied(&[1], &[2]);
}

#[tokio::test]
async fn connecting_to_a_closed_port_fails_fast_with_connect() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("binds").local_addr().expect("has an address");
    let cache = KvCache::patterned(SMALL, 4, 1);
    let engine = TcpTransferEngine::new(cache.region_table(), TcpConfig::default());
    let r = cache.regions()[0];
    let plan = TransferPlan {
        descriptors: vec![Descriptor { src: r.base_addr, dst: 0x1000, len: 16 }],
        fence: 0,
        write_by: None,
        grant: None,
    };
    let started = Instant::now();
    let err = bounded("write", engine.write(&closed.to_string(), &plan)).await.expect_err("nobody listens");
    assert!(matches!(err, TransferError::Connect { .. }), "got {err:?}");
    assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
    assert_eq!(engine.name(), "tcp");
}

#[tokio::test]
async fn shutdown_closes_pooled_connections_and_later_writes_fail_cleanly() {
    let p = pair(SMALL, 8, None, TcpConfig::default()).await;
    let plan = p.plan(&[1], &[2], true);
    bounded("write", p.engine.write(&p.peer, &plan)).await.expect("write succeeds");
    assert_eq!(p.engine.pooled_connections(&p.peer), 1);
    bounded("shutdown", p.server.shutdown()).await;
    // The pooled connection is dead: it is dropped at checkout, and a fresh one finds nobody listening.
    let err = bounded("write after shutdown", p.engine.write(&p.peer, &plan)).await.expect_err("server is gone");
    assert!(matches!(err, TransferError::Connect { .. }), "got {err:?}");
}

#[test]
fn split_by_bytes_balances_and_covers_exactly_the_plan() {
    let descriptors = vec![
        Descriptor { src: 0, dst: 10_000, len: 100 },
        Descriptor { src: 1_000, dst: 20_000, len: 50 },
        Descriptor { src: 2_000, dst: 30_000, len: 300 },
        Descriptor { src: 5_000, dst: 40_000, len: 1 },
    ];
    for streams in 1..=6 {
        let shares = split_by_bytes(&descriptors, streams);
        assert!(!shares.is_empty() && shares.len() <= streams);
        let share = 451u64.div_ceil(streams as u64);
        assert!(shares.iter().all(|s| s.iter().map(|d| d.len).sum::<u64>() <= share), "unbalanced for {streams}");
        // Gluing the pieces back together gives exactly the original descriptors.
        let mut glued: Vec<Descriptor> = Vec::new();
        for piece in shares.into_iter().flatten() {
            match glued.last_mut() {
                Some(g) if g.src + g.len == piece.src && g.dst + g.len == piece.dst => g.len += piece.len,
                _ => glued.push(piece),
            }
        }
        assert_eq!(glued, descriptors, "{streams} streams");
    }
}

// --- A P whose link dies mid-batch: D keeps what arrived, and nothing of that pull after it. ---

/// Whether D's bytes at plan offsets `range` equal P's (`true`) or are all zero (`false`).
fn plan_bytes_match(p: &Pair, plan: &TransferPlan, range: std::ops::Range<u64>, landed: bool) -> bool {
    let (src, dst) = (p.src.region_table(), p.dst.region_table());
    let mut at = 0u64;
    for d in &plan.descriptors {
        let (lo, hi) = (range.start.max(at), range.end.min(at + d.len));
        if lo < hi {
            // SAFETY: test only; the ranges come from a plan checked against both caches.
            let want = unsafe { src.slice(d.src + (lo - at), hi - lo) }.expect("in P's regions");
            let got = unsafe { dst.slice(d.dst + (lo - at), hi - lo) }.expect("in D's regions");
            let ok = if landed { got == want } else { got.iter().all(|&b| b == 0) };
            if !ok {
                return false;
            }
        }
        at += d.len;
    }
    true
}

async fn fenced_pair(shape: KvShape, num_blocks: usize, config: TcpConfig) -> (Pair, crate::fence::WriteFence) {
    let fence = crate::fence::WriteFence::new();
    let src = KvCache::patterned(shape, num_blocks, 1);
    let dst = KvCache::new(shape, num_blocks);
    let addr = "127.0.0.1:0".parse().expect("valid address");
    let server =
        TcpDataServer::bind_fenced(addr, dst.region_table(), None, false, Some(fence.clone())).await.expect("binds");
    let peer = server.local_addr().to_string();
    let engine = TcpTransferEngine::new(src.region_table(), config);
    (Pair { src, dst, server, engine, peer }, fence)
}

/// What P's engine sends on a fresh connection — hello, `fence`, one batch header for the whole
/// plan — then only the plan's first `k` payload bytes, and the link dies (shut down both ways).
async fn torn_write(p: &Pair, plan: &TransferPlan, fence: u64, k: u64) {
    let mut stream = TcpStream::connect(&p.peer).await.expect("connects");
    stream.write_all(&wire::encode_hello(None).expect("hello")).await.expect("sends the hello");
    assert!(matches!(wire::read_ack(&mut stream).await, Ok(Ack::Ok { .. })), "hello accepted");
    let header = wire::encode_batch_header(1, &plan.descriptors).expect("header");
    let mut payload = Vec::new();
    for d in &plan.descriptors {
        // SAFETY: test only; the plan was checked against P's regions.
        payload.extend_from_slice(unsafe { p.src.region_table().slice(d.src, d.len) }.expect("in P's regions"));
    }
    let k = usize::try_from(k).expect("small").min(payload.len());
    for part in [&wire::encode_fence(fence)[..], &header, &payload[..k]] {
        stream.write_all(part).await.expect("sends");
    }
    stream.into_std().expect("std socket").shutdown(std::net::Shutdown::Both).expect("shuts down");
}

#[tokio::test]
async fn a_batch_torn_mid_payload_keeps_the_bytes_before_and_its_closed_fence_refuses_the_rest() {
    let (p, fence) = fenced_pair(SMALL, 32, TcpConfig::default()).await;
    let (src_blocks, dst_blocks): (Vec<BlockId>, Vec<BlockId>) = ((1..5).collect(), (10..14).collect());
    let plan = p.plan(&src_blocks, &dst_blocks, true);
    let k = plan.descriptors[0].len + plan.descriptors[1].len / 2;
    fence.open(7);
    torn_write(&p, &plan, 7, k).await;
    // D reads the bytes before the cut (a torn batch: never acked), then end-of-stream.
    let until = Instant::now() + BOUND;
    while !plan_bytes_match(&p, &plan, 0..k, true) {
        assert!(Instant::now() < until, "the bytes before the cut never landed");
        tokio::task::yield_now().await;
    }
    assert!(plan_bytes_match(&p, &plan, k..plan.total_bytes(), false), "D holds bytes past the cut");
    // The torn batch is no longer in flight: D's pull can close its fence at once.
    bounded("fence close", fence.close(7, Duration::from_secs(2))).await.expect("no batch left in flight");
    // A late write for the closed pull is refused whole: nothing more lands.
    let late = TransferPlan { fence: 7, ..plan.clone() };
    let err = bounded("late write", p.engine.write(&p.peer, &late)).await.expect_err("fence closed");
    assert!(
        matches!(&err, TransferError::Refused { reason, .. } if reason.contains("fence 7 is closed")),
        "got {err:?}"
    );
    assert!(plan_bytes_match(&p, &plan, k..plan.total_bytes(), false), "a refused write landed");
    // The server keeps serving: a new pull's write arrives whole.
    fence.open(8);
    let next = TransferPlan { fence: 8, ..p.plan(&[6, 7], &[16, 17], true) };
    bounded("next write", p.engine.write(&p.peer, &next)).await.expect("the next write succeeds");
    p.assert_copied(&[6, 7], &[16, 17]);
}

/// `prepare` opens the connections a large write uses (one per stream, hello included) ahead of
/// it, and only those: prepares at once or again open no more; the write that follows is
/// byte-exact and leaves the pool as it found it.
#[tokio::test]
async fn prepare_opens_the_connections_of_a_write_ahead_of_it() {
    let p = pair(LARGE, 64, None, TcpConfig { streams_per_peer: 4, ..TcpConfig::default() }).await;
    assert_eq!(p.engine.pooled_connections(&p.peer), 0);
    let (a, b) = tokio::join!(p.engine.prepare(&p.peer), p.engine.prepare(&p.peer));
    a.expect("prepared");
    b.expect("a prepare already running returns");
    assert_eq!(p.engine.pooled_connections(&p.peer), 4);
    bounded("prepare again", p.engine.prepare(&p.peer)).await.expect("nothing to do");
    assert_eq!(p.engine.pooled_connections(&p.peer), 4);
    let blocks: Vec<BlockId> = (0..32).collect();
    let plan = p.plan(&blocks, &blocks, true);
    assert!(plan.total_bytes() >= 4 * 64 * 1024, "large enough for four streams");
    bounded("write", p.engine.write(&p.peer, &plan)).await.expect("written");
    p.assert_copied(&blocks, &blocks);
    assert_eq!(p.engine.pooled_connections(&p.peer), 4);
}

/// `prepare` towards a data server that refuses P's token, or a port nobody listens on, fails
/// with the connect error and pools nothing.
#[tokio::test]
async fn prepare_towards_a_refusing_or_absent_server_fails_and_pools_nothing() {
    let p = pair(SMALL, 8, Some("right"), TcpConfig { auth_token: Some("wrong".into()), ..TcpConfig::default() }).await;
    let err = bounded("prepare", p.engine.prepare(&p.peer)).await.expect_err("the token is refused");
    assert!(matches!(err, TransferError::Refused { .. }), "{err:?}");
    assert_eq!(p.engine.pooled_connections(&p.peer), 0);
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").to_string();
    let err = bounded("prepare", p.engine.prepare(&closed)).await.expect_err("nobody listens");
    assert!(matches!(err, TransferError::Connect { .. }), "{err:?}");
    assert_eq!(p.engine.pooled_connections(&closed), 0);
}

/// D restarted at the same address: the connection pooled to its previous incarnation is found
/// closed before it carries a batch, and the write goes over a fresh connection to the new one.
#[tokio::test]
async fn a_connection_the_peer_closed_is_not_reused() {
    let p = pair(SMALL, 8, None, TcpConfig::default()).await;
    bounded("write", p.engine.write(&p.peer, &p.plan(&[1], &[2], true))).await.expect("write succeeds");
    assert_eq!(p.engine.pooled_connections(&p.peer), 1);
    let Pair { src, dst, server, engine, peer } = p;
    bounded("shutdown", server.shutdown()).await;
    let until = Instant::now() + BOUND;
    let server = loop {
        match TcpDataServer::bind(peer.parse().expect("address"), dst.region_table(), None).await {
            Ok(server) => break server,
            Err(e) => assert!(Instant::now() < until, "cannot bind the same port again: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let p = Pair { src, dst, server, engine, peer };
    bounded("write to the restarted D", p.engine.write(&p.peer, &p.plan(&[3], &[4], true)))
        .await
        .expect("a fresh connection");
    p.assert_copied(&[3], &[4]);
}

/// A D that drops the connection while a share lands (its pull ended and its fence closed): the
/// write fails, and the share is not sent again on another connection — not even on a pooled one
/// — so the link does not carry the whole share once more into batches D would refuse.
#[tokio::test]
async fn a_share_d_dropped_is_not_resent() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let peer = listener.local_addr().expect("addr").to_string();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                wire::read_hello(&mut s).await.expect("hello");
                wire::write_ack(&mut s, &Ack::Ok { batch_id: 0 }).await.expect("hello ack");
                // Takes a little of the first batch, then drops the connection.
                let mut some = [0u8; 4096];
                let _ = s.read(&mut some).await;
            });
        }
    });
    let src = KvCache::patterned(LARGE, 8, 1);
    let engine = TcpTransferEngine::new(src.region_table(), TcpConfig { streams_per_peer: 1, ..TcpConfig::default() });
    bounded("prepare", engine.prepare(&peer)).await.expect("prepared");
    assert_eq!((accepted.load(Ordering::SeqCst), engine.pooled_connections(&peer)), (1, 1));
    let r = src.regions()[0];
    let plan = TransferPlan {
        descriptors: vec![Descriptor { src: r.base_addr, dst: 0x10_0000, len: r.len }],
        fence: 0,
        write_by: None,
        grant: None,
    };
    let err = bounded("write", engine.write(&peer, &plan)).await.expect_err("D dropped the connection");
    assert!(matches!(err, TransferError::Io { .. }), "{err:?}");
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "the share was sent again on a new connection");
    assert_eq!(engine.pooled_connections(&peer), 0, "a failed connection is not pooled");
}

/// A raw connection that has said hello to `peer`.
async fn hello(peer: &str) -> TcpStream {
    let mut raw = TcpStream::connect(peer).await.expect("connects");
    raw.write_all(&wire::encode_hello(None).expect("hello")).await.expect("sends the hello");
    assert_eq!(bounded("hello ack", wire::read_ack(&mut raw)).await.expect("hello ack"), Ack::Ok { batch_id: 0 });
    raw
}

/// Sends a fence (when not 0) and a batch header for one descriptor of `len` bytes at `dst`,
/// then the first `sent` payload bytes.
async fn start_batch(raw: &mut TcpStream, fence: u64, dst: u64, len: u64, sent: usize) {
    if fence != 0 {
        raw.write_all(&wire::encode_fence(fence)).await.expect("sends the fence");
    }
    let header = wire::encode_batch_header(1, &[Descriptor { src: 0, dst, len }]).expect("header");
    raw.write_all(&header).await.expect("sends the header");
    raw.write_all(&vec![0xAB; sent]).await.expect("sends part of the payload");
}

#[tokio::test]
async fn a_batch_stalled_mid_payload_stops_landing_when_d_closes_its_fence() {
    let (p, fence) = fenced_pair(SMALL, 8, TcpConfig::default()).await;
    let region = p.dst.regions()[0];
    let (dst, len) = (region.block_addr(3), region.block_len);
    fence.open(5);
    let mut raw = hello(&p.peer).await;
    let half = usize::try_from(len / 2).expect("small");
    start_batch(&mut raw, 5, dst, len, half).await;
    // The first half lands; then P's link stalls.
    let until = Instant::now() + BOUND;
    while p.dst.block_bytes(3).expect("block")[..half].iter().any(|&b| b != 0xAB) {
        assert!(Instant::now() < until, "the first half never landed");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // D's pull ends: closing the fence must not wait for the stalled batch's remaining bytes.
    bounded("fence close", fence.close(5, Duration::from_secs(5)))
        .await
        .expect("the stalled batch stops and leaves the fence");
    read_until_closed(&mut raw).await;
    // Whatever P sends now never lands.
    let _ = raw.write_all(&vec![0xCD; half]).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(
        p.dst.block_bytes(3).expect("block")[half..].iter().all(|&b| b == 0),
        "bytes landed after the fence closed"
    );
    // The server keeps serving the next pull.
    fence.open(6);
    let next = TransferPlan { fence: 6, ..p.plan(&[1], &[2], true) };
    bounded("next write", p.engine.write(&p.peer, &next)).await.expect("the next write succeeds");
    p.assert_copied(&[1], &[2]);
}

#[tokio::test]
async fn stopping_the_server_ends_idle_and_stalled_connections_at_once() {
    for stop_by_shutdown in [true, false] {
        let p = pair(SMALL, 8, None, TcpConfig::default()).await;
        let region = p.dst.regions()[0];
        // One connection idle after its hello (its thread sleeps in recv for up to 5 minutes),
        // one stalled in the middle of a batch's payload.
        let mut idle = hello(&p.peer).await;
        let mut stalled = hello(&p.peer).await;
        start_batch(&mut stalled, 0, region.block_addr(1), region.block_len, 8).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        let Pair { server, .. } = p;
        if stop_by_shutdown {
            bounded("shutdown", server.shutdown()).await;
        } else {
            drop(server);
        }
        // Both see their connection closed now, not after the idle or stall deadline.
        read_until_closed(&mut idle).await;
        read_until_closed(&mut stalled).await;
    }
}

#[tokio::test]
async fn requests_trickling_in_byte_by_byte_are_read_whole() {
    // D takes requests already queued whole in one go and reads the others the blocking way:
    // a fence, a batch header and its payload sent a few bytes at a time must still land.
    let (p, fence) = fenced_pair(SMALL, 8, TcpConfig::default()).await;
    let region = p.dst.regions()[0];
    let (dst, len) = (region.block_addr(2), region.block_len);
    fence.open(4);
    let mut raw = hello(&p.peer).await;
    raw.set_nodelay(true).expect("nodelay");
    let mut bytes = wire::encode_fence(4).to_vec();
    bytes.extend(wire::encode_batch_header(77, &[Descriptor { src: 0, dst, len }]).expect("header"));
    bytes.extend((0..len).map(|i| (i % 251) as u8 + 1));
    for piece in bytes.chunks(7) {
        raw.write_all(piece).await.expect("sends");
        tokio::time::sleep(Duration::from_micros(300)).await;
    }
    assert_eq!(bounded("ack", wire::read_ack(&mut raw)).await.expect("ack"), Ack::Ok { batch_id: 77 });
    let got = p.dst.block_bytes(2).expect("block");
    assert!(
        got[..len as usize].iter().enumerate().all(|(i, &b)| b == (i as u64 % 251) as u8 + 1),
        "the payload landed whole and in order"
    );
}

#[tokio::test]
async fn p_gets_d_s_device_export_or_nothing_and_the_connection_stays_usable() {
    let dst = KvCache::new(SMALL, 8);
    let src = KvCache::patterned(SMALL, 8, 1);
    let export = b"opaque export of the cuda backend".to_vec();
    for offered in [Some(export.clone()), None] {
        let options =
            DataServerOptions { device_export: offered.clone().unwrap_or_default(), ..DataServerOptions::default() };
        let server = TcpDataServer::bind_options("127.0.0.1:0".parse().expect("addr"), dst.region_table(), options)
            .await
            .expect("binds");
        let peer = server.local_addr().to_string();
        let engine = TcpTransferEngine::new(src.region_table(), TcpConfig::default());
        let got = bounded("device export", engine.device_export(&peer)).await.expect("answered");
        assert_eq!(got, offered.unwrap_or_default());
        // The same pooled connection then carries a batch.
        assert_eq!(engine.pooled_connections(&peer), 1);
        let plan = build_plan(&src.regions(), &[1], &dst.regions(), &[2], true).expect("plan");
        bounded("write", engine.write(&peer, &plan)).await.expect("write after the question");
        assert_eq!(engine.pooled_connections(&peer), 1, "one connection served both");
    }
    assert!(
        wire::encode_device_export(&vec![0u8; wire::MAX_DEVICE_EXPORT_LEN + 1]).is_err(),
        "an oversize export is refused"
    );
}

#[tokio::test]
async fn a_held_fence_makes_d_s_close_wait_until_p_releases_it_and_a_closed_one_is_refused() {
    // cuda-ipc: P's kernel writes D's memory itself, so D's data server counts the write in
    // flight under the pull's fence from P's hold to P's release.
    let (p, fence) = fenced_pair(SMALL, 8, TcpConfig::default()).await;
    fence.open(5);
    let hold = bounded("hold", p.engine.hold_fence(&p.peer, 5)).await.expect("an open token is held");
    let closing = {
        let fence = fence.clone();
        tokio::spawn(async move { fence.close(5, Duration::from_secs(5)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!closing.is_finished(), "D's close waits while P's write is held");
    let released = Instant::now();
    bounded("release", hold.release()).await.expect("released");
    bounded("close", closing).await.expect("joins").expect("the close ends once released");
    assert!(released.elapsed() < Duration::from_secs(2), "the release ended the wait, not the close's deadline");
    // The closed token is refused; the connection carries the next request.
    let err = bounded("late hold", p.engine.hold_fence(&p.peer, 5)).await.expect_err("closed");
    assert!(
        matches!(&err, TransferError::Refused { reason, .. } if reason.contains("fence 5 is closed")),
        "got {err:?}"
    );
    let err = bounded("unnamed hold", p.engine.hold_fence(&p.peer, 0)).await.expect_err("never opened");
    assert!(matches!(&err, TransferError::Refused { reason, .. } if reason.contains("no fence named")), "got {err:?}");
    assert_eq!(p.engine.pooled_connections(&p.peer), 1, "refusals and the release keep the one connection");
    fence.open(6);
    let plan = TransferPlan { fence: 6, ..p.plan(&[1], &[2], true) };
    bounded("write", p.engine.write(&p.peer, &plan)).await.expect("a batch after the holds");
}

#[tokio::test]
async fn a_hold_dropped_unreleased_ends_with_its_connection_and_no_other_request_rides_on_it() {
    let (p, fence) = fenced_pair(SMALL, 8, TcpConfig::default()).await;
    fence.open(3);
    let hold = bounded("hold", p.engine.hold_fence(&p.peer, 3)).await.expect("held");
    drop(hold);
    // D sees the connection close and releases: the close drains promptly.
    bounded("close", fence.close(3, Duration::from_secs(5))).await.expect("released by the closed connection");

    // A peer that sends a batch while holding is cut off, and the hold goes with it.
    fence.open(4);
    let mut raw = hello(&p.peer).await;
    raw.write_all(&wire::encode_hold(4)).await.expect("sends");
    assert_eq!(bounded("ack", wire::read_ack(&mut raw)).await.expect("ack"), Ack::Ok { batch_id: 0 });
    raw.write_all(&wire::encode_fence(4)).await.expect("sends");
    let mut rest = Vec::new();
    let _ = bounded("closed", raw.read_to_end(&mut rest)).await;
    bounded("close", fence.close(4, Duration::from_secs(5))).await.expect("the hold ended with the connection");
}

#[test]
fn a_pooled_socket_counts_as_open_only_while_the_peer_keeps_it_open_and_silent() {
    use std::io::Write as _;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
    let addr = listener.local_addr().expect("address");
    let p = std::net::TcpStream::connect(addr).expect("connects");
    let (mut d, _) = listener.accept().expect("accepts");
    assert!(still_open(&p), "an idle, open connection is reusable");
    // A byte D sent unasked would put the connection out of step: not reusable.
    d.write_all(b"x").expect("D writes");
    let until = Instant::now() + Duration::from_secs(5);
    while still_open(&p) {
        assert!(Instant::now() < until, "the unasked byte never arrived");
        std::thread::sleep(Duration::from_millis(2));
    }
    // D closes: P sees the end of the stream.
    let p2 = std::net::TcpStream::connect(addr).expect("connects");
    let (d2, _) = listener.accept().expect("accepts");
    drop(d2);
    let until = Instant::now() + Duration::from_secs(5);
    while still_open(&p2) {
        assert!(Instant::now() < until, "D's close never reached P");
        std::thread::sleep(Duration::from_millis(2));
    }
    // still_open blocks nothing and leaves the socket as it was: the byte is still there to read.
    let mut byte = [0u8; 1];
    std::io::Read::read_exact(&mut &p, &mut byte).expect("the peeked byte is still queued");
    assert_eq!(&byte, b"x");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_at_its_connection_limit_closes_one_more_at_once_and_serves_again_when_one_ends() {
    let src = KvCache::patterned(SMALL, 8, 1);
    let dst = KvCache::new(SMALL, 8);
    let options = DataServerOptions { max_connections: 2, ..DataServerOptions::default() };
    let server = TcpDataServer::bind_options("127.0.0.1:0".parse().expect("address"), dst.region_table(), options)
        .await
        .expect("binds");
    let peer = server.local_addr().to_string();
    let (first, _second) = (hello(&peer).await, hello(&peer).await);
    assert_eq!(server.live_connections(), 2);
    // One more is closed before its hello is read: it gets the end of the stream, not an ack.
    let mut third = TcpStream::connect(&peer).await.expect("the kernel still accepts it");
    let _ = third.write_all(&wire::encode_hello(None).expect("hello")).await;
    let mut rest = Vec::new();
    let read = bounded("the refused connection's end", third.read_to_end(&mut rest)).await;
    assert!(read.is_err() || rest.is_empty(), "a connection over the limit was answered: {rest:?}");
    assert_eq!(server.live_connections(), 2, "the two served connections are untouched");
    // P's engine, over the limit, is told why its connection went.
    let engine = TcpTransferEngine::new(src.region_table(), TcpConfig { streams_per_peer: 1, ..TcpConfig::default() });
    let plan = build_plan(&src.regions(), &[1, 2], &dst.regions(), &[5, 6], true).expect("plannable");
    let err = bounded("write over the limit", engine.write(&peer, &plan)).await.expect_err("no connection is free");
    assert!(matches!(&err, TransferError::Connect { .. }) && err.to_string().contains("max_connections"), "got {err}");
    // One ends: P's engine gets its connection, and its write lands.
    drop(first);
    bounded("the ended connection leaves", async {
        while server.live_connections() > 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    bounded("write", engine.write(&peer, &plan)).await.expect("a write once a connection is free");
    assert_eq!(src.blocks_checksum(&[1, 2]).expect("in range"), dst.blocks_checksum(&[5, 6]).expect("in range"));
    assert_eq!(DataServerOptions::default().max_connections, DEFAULT_MAX_CONNECTIONS);
}
