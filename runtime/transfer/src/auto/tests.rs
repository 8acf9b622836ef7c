//! Tests of the automatic engine and the same-host path: two KV caches in one process (so
//! `process_vm_writev` targets this very pid, which the kernel always allows), D's tcp data server
//! on 127.0.0.1, and D's bytes compared with P's.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use pdflow_messages::BlockId;

use super::*;
use crate::tcp::TcpDataServer;
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_kv::planner::build_plan;

/// 256-byte blocks per layer: many descriptors in little memory.
const SMALL: KvShape = KvShape { num_layers: 4, num_kv_heads: 2, head_dim: 8, dtype_bytes: 2, block_size: 4 };
const BOUND: Duration = Duration::from_secs(10);

async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, fut).await.unwrap_or_else(|_| panic!("{what} did not finish within {BOUND:?}"))
}

fn filled_cache(num_blocks: usize, seed: u8) -> Arc<KvCache> {
    let cache = KvCache::new(SMALL, num_blocks);
    let table = cache.region_table();
    for r in table.regions() {
        // SAFETY: the cache was just made; nothing else uses it.
        let bytes = unsafe { table.slice_mut(r.base_addr, r.len) }.expect("whole region");
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = seed.wrapping_add((i % 251) as u8).wrapping_add((r.base_addr >> 12) as u8);
        }
    }
    cache
}

struct Pair {
    src: Arc<KvCache>,
    dst: Arc<KvCache>,
    _server: TcpDataServer,
    engine: AutoTransferEngine,
    peer: String,
}

async fn pair(num_blocks: usize, offer_same_host: bool, mode: SameHostMode) -> Pair {
    let src = filled_cache(num_blocks, 1);
    let dst = KvCache::new(SMALL, num_blocks);
    let addr = "127.0.0.1:0".parse().expect("valid address");
    let server = TcpDataServer::bind_with(addr, dst.region_table(), None, offer_same_host).await.expect("binds");
    let peer = server.local_addr().to_string();
    let engine = AutoTransferEngine::new(src.region_table(), TcpConfig { same_host: mode, ..TcpConfig::default() });
    Pair { src, dst, _server: server, engine, peer }
}

impl Pair {
    fn plan(&self, src_blocks: &[BlockId], dst_blocks: &[BlockId], coalesce: bool) -> TransferPlan {
        build_plan(&self.src.regions(), src_blocks, &self.dst.regions(), dst_blocks, coalesce).expect("plannable")
    }

    fn assert_copied(&self, src_blocks: &[BlockId], dst_blocks: &[BlockId]) {
        assert_eq!(
            self.src.blocks_checksum(src_blocks).expect("in range"),
            self.dst.blocks_checksum(dst_blocks).expect("in range"),
            "D's blocks differ from P's"
        );
        for (&s, &d) in src_blocks.iter().zip(dst_blocks) {
            assert!(
                self.src.block_bytes(s).expect("src") == self.dst.block_bytes(d).expect("dst"),
                "block {s} → {d} differs"
            );
        }
    }

    fn assert_untouched(&self, dst_blocks: &[BlockId]) {
        crate::test_blocks::assert_untouched(&self.dst, dst_blocks);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_writes_are_byte_exact_coalesced_or_not_beyond_iov_max() {
    let p = pair(700, true, SameHostMode::Required).await;
    // 300 blocks × 4 layers uncoalesced = 1,200 descriptors: more than one call's IOV_MAX.
    let src: Vec<BlockId> = (10..310).collect();
    let dst: Vec<BlockId> = (390..690).collect();
    for coalesce in [true, false] {
        let plan = p.plan(&src, &dst, coalesce);
        let stats = bounded("same-host write", p.engine.write(&p.peer, &plan)).await.expect("write succeeds");
        assert_eq!(stats.bytes, (src.len() * SMALL.bytes_per_block()) as u64);
        assert_eq!(p.engine.backend_for(&p.peer), BACKEND_SAME_HOST);
        p.assert_copied(&src, &dst);
    }
    p.assert_untouched(&[0, 389, 699]);
    assert_eq!(p.engine.tcp().pooled_connections(&p.peer), 1, "only the probe's connection was made");
}

#[tokio::test]
async fn an_out_of_region_destination_is_refused_and_nothing_is_written() {
    let p = pair(32, true, SameHostMode::Auto).await;
    let mut plan = p.plan(&[1, 2], &[5, 6], true);
    let last = p.dst.regions()[SMALL.num_layers - 1];
    // Straddles the end of D's last region: the whole plan is refused before any byte moves.
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
    assert_eq!(p.engine.backend_for(&p.peer), BACKEND_SAME_HOST);
    p.assert_untouched(&[5, 6]);

    // Destinations entirely outside D's memory (P's own memory, say) are refused too.
    let plan = TransferPlan {
        descriptors: vec![Descriptor { src: p.src.regions()[0].base_addr, dst: p.src.regions()[1].base_addr, len: 64 }],
        fence: 0,
        write_by: None,
        grant: None,
    };
    let err = bounded("refused write", p.engine.write(&p.peer, &plan)).await.expect_err("refused");
    assert!(matches!(err, TransferError::Refused { .. }), "got {err:?}");

    let plan = p.plan(&[1, 2], &[5, 6], true);
    bounded("next write", p.engine.write(&p.peer, &plan)).await.expect("the next valid write succeeds");
    p.assert_copied(&[1, 2], &[5, 6]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_host_path_writes_nothing_past_d_s_pull_deadline() {
    let p = pair(32, true, SameHostMode::Auto).await;
    // Route the peer by the same-host path first.
    bounded("first write", p.engine.write(&p.peer, &p.plan(&[1], &[4], true))).await.expect("written");
    assert_eq!(p.engine.backend_for(&p.peer), BACKEND_SAME_HOST);
    // D gives its blocks up at its pull deadline; a plan whose write-by instant has passed (P got
    // to it too late) writes no byte of them, and says which state and deadline it passed.
    let late = TransferPlan { write_by: Some(std::time::Instant::now()), ..p.plan(&[2, 3], &[10, 11], true) };
    let err = bounded("late write", p.engine.write(&p.peer, &late)).await.expect_err("refused");
    assert!(matches!(err, TransferError::Timeout { .. }), "got {err:?}");
    assert!(err.to_string().contains("state `writing`"), "{err}");
    p.assert_untouched(&[10, 11]);
    // With time left, the same plan is written.
    let in_time =
        TransferPlan { write_by: Some(std::time::Instant::now() + std::time::Duration::from_secs(30)), ..late };
    bounded("write in time", p.engine.write(&p.peer, &in_time)).await.expect("written");
    p.assert_copied(&[2, 3], &[10, 11]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_write_that_passes_its_deadline_returns_only_once_its_threads_stopped() {
    let p = pair(4096, true, SameHostMode::Auto).await;
    bounded("route", p.engine.write(&p.peer, &p.plan(&[1], &[4], true))).await.expect("written");
    let blocks: Vec<BlockId> = (0..2048).collect();
    let dst: Vec<BlockId> = (2048..4096).collect();
    // Uncoalesced, many MiB: many system calls, between which the threads look at the deadline,
    // which passes long before the plan could be written.
    let plan = TransferPlan {
        write_by: Some(std::time::Instant::now() + std::time::Duration::from_micros(300)),
        ..p.plan(&blocks, &dst, false)
    };
    let bytes = plan.total_bytes();
    let err = bounded("deadline write", p.engine.write(&p.peer, &plan)).await.expect_err("the deadline passes first");
    assert!(matches!(err, TransferError::Timeout { .. }), "{bytes} bytes: {err:?}");
    // Every thread has stopped before the failure was reported: D's memory changes no more.
    let snapshot: Vec<u8> = dst.iter().flat_map(|b| p.dst.block_bytes(*b).expect("a block of D")).collect();
    std::thread::sleep(std::time::Duration::from_millis(50));
    let again: Vec<u8> = dst.iter().flat_map(|b| p.dst.block_bytes(*b).expect("a block of D")).collect();
    assert!(snapshot == again, "a byte landed after the write reported its deadline");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_write_holds_d_s_fence_until_its_threads_stop_even_when_p_is_killed_mid_write() {
    use crate::fence::WriteFence;
    let fence = WriteFence::new();
    let (src, dst) = (filled_cache(65536, 1), KvCache::new(SMALL, 65536));
    let addr = "127.0.0.1:0".parse().expect("valid address");
    let server =
        TcpDataServer::bind_fenced(addr, dst.region_table(), None, true, Some(fence.clone())).await.expect("binds");
    let peer = server.local_addr().to_string();
    let engine = Arc::new(AutoTransferEngine::new(src.region_table(), TcpConfig::default()));
    let plan = |from: &[BlockId], to: &[BlockId], token: u64| TransferPlan {
        fence: token,
        ..build_plan(&src.regions(), from, &dst.regions(), to, false).expect("plannable")
    };
    fence.open(1);
    bounded("route", engine.write(&peer, &plan(&[1], &[4], 1))).await.expect("written");
    assert_eq!(engine.backend_for(&peer), BACKEND_SAME_HOST);
    // A finished write releases its hold (the release is not answered: D counts it soon after).
    bounded("the release", async {
        while fence.in_flight(1) != 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;

    // A pull D already gave up on: refused before a byte is written.
    fence.close_now(1);
    let err = bounded("closed fence", engine.write(&peer, &plan(&[2], &[5], 1))).await.expect_err("refused");
    assert!(err.to_string().contains("fence 1 is closed"), "{err}");
    assert!(dst.block_bytes(5).expect("a block of D").iter().all(|&b| b == 0), "written under a closed fence");

    // P's writer killed mid-write (its future dropped while its threads copy): D's fence counts
    // the write in flight, and closing it waits for the last thread, after which D's memory
    // changes no more.
    fence.open(2);
    let from: Vec<BlockId> = (0..32768).collect();
    let to: Vec<BlockId> = (32768..65536).collect();
    let big = plan(&from, &to, 2);
    let writer = {
        let (engine, peer) = (engine.clone(), peer.clone());
        tokio::spawn(async move { engine.write(&peer, &big).await })
    };
    bounded("the hold", async {
        while fence.in_flight(2) == 0 {
            assert!(!writer.is_finished(), "the write ended without D's fence counting it");
            tokio::task::yield_now().await;
        }
    })
    .await;
    writer.abort();
    bounded("the fence drains", fence.close(2, Duration::from_secs(5))).await.expect("the threads stop");
    let snapshot: Vec<u8> = to.iter().flat_map(|b| dst.block_bytes(*b).expect("a block of D")).collect();
    std::thread::sleep(Duration::from_millis(50));
    let again: Vec<u8> = to.iter().flat_map(|b| dst.block_bytes(*b).expect("a block of D")).collect();
    assert!(snapshot == again, "a byte landed after D's fence drained");
}

#[tokio::test]
async fn tcp_is_used_when_the_path_is_off_or_not_offered_and_required_fails_clearly() {
    for (offer, mode) in [(true, SameHostMode::Off), (false, SameHostMode::Auto)] {
        let p = pair(32, offer, mode).await;
        let plan = p.plan(&[3, 4, 9], &[20, 21, 30], true);
        bounded("tcp write", p.engine.write(&p.peer, &plan)).await.expect("write succeeds");
        assert_eq!(p.engine.backend_for(&p.peer), BACKEND_TCP, "offer {offer}, mode {mode:?}");
        p.assert_copied(&[3, 4, 9], &[20, 21, 30]);
    }
    let p = pair(32, false, SameHostMode::Required).await;
    let plan = p.plan(&[3], &[20], true);
    let err = bounded("required write", p.engine.write(&p.peer, &plan)).await.expect_err("not offered");
    assert!(
        matches!(&err, TransferError::SameHostUnavailable { reason, .. } if reason.contains("does not offer")),
        "got {err:?}"
    );
    p.assert_untouched(&[20]);
}

#[test]
fn a_wrong_canary_or_a_missing_pid_is_never_trusted() {
    let canary = same_host::new_canary();
    let mut peer = SameHostPeer {
        pid: std::process::id() as i32,
        canary_addr: canary.as_ptr() as u64,
        canary: canary.to_vec(),
        regions: vec![],
    };
    assert!(matches!(same_host::verify_canary(&peer), Ok(true)));
    peer.canary[0] ^= 0xff;
    assert!(matches!(same_host::verify_canary(&peer), Ok(false)), "other bytes: another process");
    peer.canary_addr = 8;
    assert!(matches!(same_host::verify_canary(&peer), Ok(false)), "unmapped address");
    // No such process: the kernel refuses, which the engine turns into the tcp fallback.
    let gone = SameHostPeer { pid: i32::MAX, ..peer };
    assert!(
        matches!(same_host::verify_canary(&gone), Err(SameHostError::Unavailable { .. })),
        "got {:?}",
        same_host::verify_canary(&gone)
    );
    assert!(same_host::host_identity().contains("pid:["), "{}", same_host::host_identity());
}

/// `prepare` chooses the path before any write: the same-host path where D offers it, tcp (with
/// its connections opened) where it is off.
#[tokio::test]
async fn prepare_chooses_the_path_before_the_first_write() {
    let p = pair(32, true, SameHostMode::Auto).await;
    bounded("prepare", p.engine.prepare(&p.peer)).await.expect("prepared");
    assert_eq!(p.engine.backend_for(&p.peer), BACKEND_SAME_HOST);
    bounded("write", p.engine.write(&p.peer, &p.plan(&[1, 2], &[5, 6], true))).await.expect("written");
    p.assert_copied(&[1, 2], &[5, 6]);

    let p = pair(32, true, SameHostMode::Off).await;
    bounded("prepare", p.engine.prepare(&p.peer)).await.expect("prepared");
    assert_eq!(p.engine.backend_for(&p.peer), BACKEND_TCP);
    assert_eq!(p.engine.tcp().pooled_connections(&p.peer), TcpConfig::default().streams_per_peer);
}
