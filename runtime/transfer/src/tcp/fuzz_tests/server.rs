//! Fuzz targets and bad-input tests of D's [`TcpDataServer`] (seed step 29, receiving half) over
//! real sockets on 127.0.0.1: a descriptor count above the limit and a refused batch too large to
//! drain are refused with a clear reason; descriptors outside D's regions are refused and D's
//! memory is untouched; a wrong, missing or oversize auth token is refused; garbage never hangs a
//! connection (once P half-closes) and never stops the server.

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::super::wire::{self, Ack, WireError, BATCH_MAGIC, HELLO_MAGIC};
use super::super::{TcpConfig, TcpDataServer, TcpTransferEngine};
use super::{apply, batch_bytes, cfg, mutation, runtime};
use crate::{TransferEngine, TransferError};
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_kv::planner::build_plan;

const SMALL: KvShape = KvShape { num_layers: 4, num_kv_heads: 2, head_dim: 8, dtype_bytes: 2, block_size: 4 };
const NUM_BLOCKS: usize = 8;
const BOUND: Duration = Duration::from_secs(5);

async fn d_server(token: Option<&str>) -> (Arc<KvCache>, TcpDataServer, String) {
    let dst = KvCache::new(SMALL, NUM_BLOCKS);
    let addr = "127.0.0.1:0".parse().expect("valid address");
    let server = TcpDataServer::bind(addr, dst.region_table(), token.map(str::to_string)).await.expect("binds");
    let peer = server.local_addr().to_string();
    (dst, server, peer)
}

fn assert_all_zero(dst: &KvCache) {
    for b in 0..NUM_BLOCKS as u32 {
        assert!(dst.block_bytes(b).expect("in range").iter().all(|&x| x == 0), "D's block {b} was written");
    }
}

/// Connects and sends a hello with `token`; returns the stream and the server's answer.
async fn hello(peer: &str, token: &[u8]) -> (TcpStream, Result<Ack, WireError>) {
    let mut raw = TcpStream::connect(peer).await.expect("connects");
    let mut bytes = HELLO_MAGIC.to_vec();
    bytes.push(wire::PROTOCOL_VERSION);
    bytes.extend_from_slice(&(token.len() as u16).to_le_bytes());
    bytes.extend_from_slice(token);
    bytes.extend_from_slice(&[0u8; 16]); // P's nonce (no cluster secret here)
    raw.write_all(&bytes).await.expect("sends");
    let ack =
        tokio::time::timeout(BOUND, wire::read_ack(&mut raw)).await.expect("the server answers the hello in time");
    (raw, ack)
}

/// Reads until the server closes (a reset counts); fails the test past [`BOUND`].
async fn closed_by_server(raw: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let r = tokio::time::timeout(BOUND, raw.read_to_end(&mut got)).await;
    assert!(r.is_ok(), "the server kept the connection open past {BOUND:?}");
    got
}

async fn refusal_then_close(raw: &mut TcpStream) -> String {
    let answer = closed_by_server(raw).await;
    match wire::read_ack(&mut &answer[..]).await {
        Ok(Ack::Refused { reason, .. }) => reason,
        other => panic!("expected a refusal before the close, got {other:?}"),
    }
}

/// A P engine whose source cache is filled with `byte`.
fn p_engine(byte: u8, token: Option<&str>) -> (Arc<KvCache>, TcpTransferEngine) {
    let src = KvCache::new(SMALL, NUM_BLOCKS);
    let slot = vec![byte; SMALL.slot_len()];
    for layer in 0..SMALL.num_layers {
        for block in 0..NUM_BLOCKS as u32 {
            for head in 0..SMALL.num_kv_heads {
                for s in 0..SMALL.block_size {
                    src.write_slot(layer, block, head, s, &slot).expect("in range");
                }
            }
        }
    }
    let engine = TcpTransferEngine::new(
        src.region_table(),
        TcpConfig { auth_token: token.map(str::to_string), ..TcpConfig::default() },
    );
    (src, engine)
}

/// The server still serves: a real write of block 1 into D's block 2 arrives intact.
async fn still_serves(dst: &Arc<KvCache>, peer: &str, token: Option<&str>) {
    let (src, engine) = p_engine(0x5a, token);
    let plan = build_plan(&src.regions(), &[1], &dst.regions(), &[2], true).expect("plannable");
    tokio::time::timeout(BOUND, engine.write(peer, &plan)).await.expect("in time").expect("the server still serves");
    assert!(dst.block_bytes(2).expect("in range").iter().all(|&b| b == 0x5a));
}

#[tokio::test]
async fn a_descriptor_count_above_the_limit_is_refused_with_a_clear_error() {
    let (dst, _server, peer) = d_server(None).await;
    let (mut raw, ack) = hello(&peer, b"").await;
    assert_eq!(ack.expect("hello ack"), Ack::Ok { batch_id: 0 });
    let mut header = BATCH_MAGIC.to_vec();
    header.extend_from_slice(&3u64.to_le_bytes());
    header.extend_from_slice(&(wire::MAX_DESCRIPTORS_PER_BATCH as u32 + 1).to_le_bytes());
    raw.write_all(&header).await.expect("sends");
    let reason = refusal_then_close(&mut raw).await;
    assert!(
        reason.contains(&format!("{} descriptors", wire::MAX_DESCRIPTORS_PER_BATCH + 1))
            && reason.contains("allowed per batch"),
        "{reason}"
    );
    assert_all_zero(&dst);
    still_serves(&dst, &peer, None).await;
}

#[tokio::test]
async fn a_fenced_server_writes_only_for_open_pulls() {
    use crate::fence::WriteFence;
    let dst = KvCache::new(SMALL, NUM_BLOCKS);
    let fence = WriteFence::new();
    let addr = "127.0.0.1:0".parse().expect("valid address");
    let server =
        TcpDataServer::bind_fenced(addr, dst.region_table(), None, false, Some(fence.clone())).await.expect("binds");
    let peer = server.local_addr().to_string();
    let (src, engine) = p_engine(0x77, None);
    let mut plan = build_plan(&src.regions(), &[1], &dst.regions(), &[2], true).expect("plannable");
    // No fence named: refused, nothing written.
    let err = engine.write(&peer, &plan).await.expect_err("no fence");
    assert!(matches!(&err, TransferError::Refused { reason, .. } if reason.contains("no fence")), "{err}");
    assert_all_zero(&dst);
    // D opened the pull's fence: the write lands.
    fence.open(41);
    plan.fence = 41;
    engine.write(&peer, &plan).await.expect("fence open");
    assert!(dst.block_bytes(2).expect("in range").iter().all(|&b| b == 0x77));
    // D gave the pull up (deadline): a late write of the same pull is refused, D's block untouched
    // even though a new owner may have written it meanwhile.
    fence.close(41, BOUND).await.expect("nothing in flight");
    let late = build_plan(&src.regions(), &[1], &dst.regions(), &[3], true).expect("plannable");
    let late = pdflow_kv::planner::TransferPlan { fence: 41, ..late };
    let err = engine.write(&peer, &late).await.expect_err("fence closed");
    assert!(matches!(&err, TransferError::Refused { reason, .. } if reason.contains("fence 41 is closed")), "{err}");
    assert!(dst.block_bytes(3).expect("in range").iter().all(|&b| b == 0), "the late write did not land");
}

#[tokio::test]
async fn overlapping_destinations_are_refused_and_nothing_is_written() {
    let (dst, _server, peer) = d_server(None).await;
    let (mut raw, ack) = hello(&peer, b"").await;
    assert_eq!(ack.expect("hello ack"), Ack::Ok { batch_id: 0 });
    let base = dst.regions()[1].base_addr;
    // Two in-region descriptors whose destinations share 8 bytes (aliased `&mut` before the fix).
    let descriptors = [(base + 64, 32), (base + 88, 32)];
    let mut bytes = batch_bytes(9, &descriptors);
    bytes.extend(std::iter::repeat_n(0xabu8, 64));
    raw.write_all(&bytes).await.expect("sends");
    let ack = tokio::time::timeout(BOUND, wire::read_ack(&mut raw)).await.expect("answers in time").expect("an ack");
    match ack {
        Ack::Refused { batch_id: 9, reason } => assert!(reason.contains("overlap"), "{reason}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_all_zero(&dst);
    still_serves(&dst, &peer, None).await;
}

#[tokio::test]
async fn a_refused_batch_too_large_to_drain_is_refused_and_closed_with_a_clear_error() {
    let (dst, _server, peer) = d_server(None).await;
    let r = dst.regions()[0];
    // Outside D's regions and 1 TiB of payload; then a sum of lengths that overflows u64.
    for descs in
        [vec![(r.base_addr + r.len, 1u64 << 40)], vec![(r.base_addr, 8), (u64::MAX - 4, u64::MAX), (r.base_addr, 2)]]
    {
        let (mut raw, ack) = hello(&peer, b"").await;
        assert_eq!(ack.expect("hello ack"), Ack::Ok { batch_id: 0 });
        raw.write_all(&batch_bytes(9, &descs)).await.expect("sends");
        let reason = refusal_then_close(&mut raw).await;
        assert!(reason.contains("too many to drain"), "{reason}");
    }
    assert_all_zero(&dst);
    still_serves(&dst, &peer, None).await;
}

/// Where an out-of-region descriptor may point, relative to D's regions.
#[derive(Debug, Clone)]
enum Outside {
    BelowFirst(u64),
    PastEnd(usize, u64),
    Straddle(usize, u64),
    AcrossTwo(usize),
    NearMax(u64),
    Anywhere(u64),
}

fn outside() -> impl Strategy<Value = Outside> {
    prop_oneof![
        (1u64..4096).prop_map(Outside::BelowFirst),
        (any::<usize>(), 0u64..4096).prop_map(|(i, k)| Outside::PastEnd(i, k)),
        (any::<usize>(), 1u64..64).prop_map(|(i, k)| Outside::Straddle(i, k)),
        any::<usize>().prop_map(Outside::AcrossTwo),
        (1u64..64).prop_map(Outside::NearMax),
        any::<u64>().prop_map(Outside::Anywhere),
    ]
}

#[test]
fn descriptors_outside_d_regions_are_refused_and_nothing_is_written() {
    let rt = runtime();
    let (dst, server, peer) = rt.block_on(d_server(None));
    let regions = dst.regions();
    let table = dst.region_table();
    let lowest = regions.iter().map(|r| r.base_addr).min().expect("regions");
    let mut runner = TestRunner::new(cfg(48));
    // Valid descriptors (block-sized pieces of D's regions) around one outside them.
    let inside = prop::collection::vec((0..regions.len(), 0..NUM_BLOCKS as u64, 1u64..64), 0..4);
    runner
        .run(&(inside.clone(), outside(), inside, any::<u64>()), |(before, out, after, batch_id)| {
            let to_desc = |&(region, block, len): &(usize, u64, u64)| {
                let r = regions[region];
                (r.base_addr + block * r.block_len, len.min(r.block_len))
            };
            let bad = match out {
                Outside::BelowFirst(k) => (lowest.saturating_sub(k), k.min(64)),
                Outside::PastEnd(i, k) => {
                    let r = regions[i % regions.len()];
                    (r.base_addr + r.len + k, 16)
                }
                Outside::Straddle(i, k) => {
                    let r = regions[i % regions.len()];
                    (r.base_addr + r.len - k, 2 * k)
                }
                Outside::AcrossTwo(i) => {
                    let r = regions[i % regions.len()];
                    (r.base_addr, r.len + 1)
                }
                Outside::NearMax(k) => (u64::MAX - k, 2 * k),
                Outside::Anywhere(a) => (a, 8),
            };
            prop_assume!(table.check(bad.0, bad.1).is_err());
            let descs: Vec<(u64, u64)> =
                before.iter().map(to_desc).chain([bad]).chain(after.iter().map(to_desc)).collect();
            let total: u64 = descs.iter().map(|d| d.1).sum();
            rt.block_on(async {
                let (mut raw, ack) = hello(&peer, b"").await;
                prop_assert_eq!(ack.expect("hello ack"), Ack::Ok { batch_id: 0 });
                raw.write_all(&batch_bytes(batch_id, &descs)).await.expect("sends header");
                raw.write_all(&vec![0xab; total as usize]).await.expect("sends payload");
                let ack = tokio::time::timeout(BOUND, wire::read_ack(&mut raw))
                    .await
                    .expect("answered in time")
                    .expect("an ack");
                match ack {
                    Ack::Refused { batch_id: id, reason } => {
                        prop_assert_eq!(id, batch_id);
                        prop_assert!(
                            reason.contains("registered region") && reason.contains("nothing of the batch was written"),
                            "{}",
                            reason
                        );
                    }
                    other => prop_assert!(false, "{:?} accepted: {:?}", descs, other),
                }
                // The refused payload was drained: the connection still carries a valid batch.
                let r = regions[0];
                raw.write_all(&batch_bytes(batch_id ^ 1, &[(r.base_addr, 0)])).await.expect("sends");
                let next =
                    tokio::time::timeout(BOUND, wire::read_ack(&mut raw)).await.expect("in time").expect("an ack");
                prop_assert_eq!(next, Ack::Ok { batch_id: batch_id ^ 1 });
                Ok(())
            })?;
            assert_all_zero(&dst);
            Ok(())
        })
        .expect("every out-of-region batch is refused and writes nothing");
    rt.block_on(still_serves(&dst, &peer, None));
    drop(server);
}

#[test]
fn wrong_missing_or_oversize_auth_tokens_are_refused() {
    const RIGHT: &[u8] = b"the-right-token";
    let rt = runtime();
    let (dst, server, peer) = rt.block_on(d_server(Some("the-right-token")));
    let mut runner = TestRunner::new(cfg(64));
    let tokens = prop_oneof![
        Just(Vec::new()),
        prop::collection::vec(any::<u8>(), 0..40),
        // The right token with one byte changed, cut short or extended.
        (any::<usize>(), 1u8..=255).prop_map(|(i, x)| {
            let mut t = RIGHT.to_vec();
            t[i % RIGHT.len()] ^= x;
            t
        }),
        (0..RIGHT.len()).prop_map(|n| RIGHT[..n].to_vec()),
        prop::collection::vec(any::<u8>(), 1..4).prop_map(|tail| [RIGHT, &tail].concat()),
        Just(vec![b'x'; wire::MAX_TOKEN_LEN + 1]),
    ];
    runner
        .run(&tokens, |token| {
            prop_assume!(token != RIGHT);
            rt.block_on(async {
                let (mut raw, ack) = hello(&peer, &token).await;
                match ack {
                    Ok(Ack::Refused { batch_id: 0, reason }) => {
                        let expected =
                            if token.len() > wire::MAX_TOKEN_LEN { "exceeds" } else { "auth token does not match" };
                        prop_assert!(reason.contains(expected), "{}", reason);
                    }
                    other => prop_assert!(false, "token {:?} got {:?}", token, other),
                }
                closed_by_server(&mut raw).await;
                Ok(())
            })
        })
        .expect("only the right token is accepted");
    rt.block_on(async {
        let (_raw, ack) = hello(&peer, RIGHT).await;
        assert_eq!(ack.expect("hello ack"), Ack::Ok { batch_id: 0 });
        // A P engine with no token or a wrong one is refused too, and writes nothing.
        for token in [None, Some("wrong")] {
            let (src, engine) = p_engine(0x77, token);
            let plan = build_plan(&src.regions(), &[1], &dst.regions(), &[3], true).expect("plannable");
            let err =
                tokio::time::timeout(BOUND, engine.write(&peer, &plan)).await.expect("in time").expect_err("refused");
            assert!(matches!(&err, TransferError::Refused { reason, .. } if reason.contains("auth")), "{err:?}");
        }
        assert_all_zero(&dst);
        still_serves(&dst, &peer, Some("the-right-token")).await;
    });
    drop(server);
}

#[test]
fn garbage_and_mutated_messages_never_hang_a_connection_or_stop_the_server() {
    let rt = runtime();
    let (dst, server, peer) = rt.block_on(d_server(None));
    let r = dst.regions()[1];
    let hello_bytes = wire::encode_hello(None).expect("hello");
    let mut runner = TestRunner::new(cfg(48));
    let connection = prop_oneof![
        // Garbage instead of a hello.
        prop::collection::vec(any::<u8>(), 0..128),
        // A valid hello, then garbage.
        prop::collection::vec(any::<u8>(), 0..128).prop_map({
            let h = hello_bytes.clone();
            move |g| [h.clone(), g].concat()
        }),
        // A valid hello and a mutated zero-payload batch or info request.
        (
            prop_oneof![
                Just(batch_bytes(4, &[(r.base_addr, 16), (r.base_addr + 64, 8)])),
                Just(wire::encode_info_request(1))
            ],
            mutation()
        )
            .prop_map({
                let h = hello_bytes.clone();
                move |(msg, m)| [h.clone(), apply(&msg, &m), vec![0; 24]].concat()
            }),
        // A mutated hello.
        mutation().prop_map({
            let h = wire::encode_hello(Some("tok")).expect("hello");
            move |m| apply(&h, &m)
        }),
    ];
    runner
        .run(&connection, |bytes| {
            rt.block_on(async {
                let mut raw = TcpStream::connect(&peer).await.expect("connects");
                // The server may close early (a reset then is fine); P then half-closes.
                let _ = raw.write_all(&bytes).await;
                let _ = raw.shutdown().await;
                closed_by_server(&mut raw).await;
            });
            Ok(())
        })
        .expect("every connection ends");
    rt.block_on(still_serves(&dst, &peer, None));
    drop(server);
}
