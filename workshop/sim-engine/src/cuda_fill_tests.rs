//! Tests of GPU-resident KV caches (`KvCache::new_cuda`) and of the cuda-peer engine between two
//! of them: they need a GPU and NVRTC, and skip with the reason printed otherwise. With two GPUs,
//! P's cache is on GPU 0 and D's on GPU 1; with one, both are on GPU 0.

use std::time::Duration;

use pdflow_messages::BlockId;

use crate::model::{ContextDigest, ForwardItem, Model};
use pdflow_kv::cuda::{device_count, nvrtc_available, CudaError};
use pdflow_kv::memory::{KvCache, KvShape, MemoryKind, RegionError};
use pdflow_kv::planner::build_plan;
use pdflow_transfer::cuda::peer_engine::{register_local_peer, CudaPeerEngine};
use pdflow_transfer::fence::WriteFence;
use pdflow_transfer::tcp::{TcpConfig, TcpDataServer, TcpTransferEngine};
use pdflow_transfer::{TransferEngine, TransferError};

const SHAPE: KvShape = KvShape { num_layers: 4, num_kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_size: 16 };
const BLOCKS: usize = 32;

/// P's and D's GPUs, or `None` after printing why the test skips.
fn gpus() -> Option<(usize, usize)> {
    match device_count() {
        Err(e) => {
            pdflow_testkit::skipped("GPU KV cache test", &e);
            None
        }
        Ok(_) if !nvrtc_available() => {
            pdflow_testkit::skipped("GPU KV cache test", &CudaError::NoNvrtc);
            None
        }
        Ok(n) => Some((0, usize::from(n > 1))),
    }
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u64).map(|i| (crate::model::splitmix64(i ^ 0xABC) % 151_936) as u32).collect()
}

/// Prefills `prompt` in chunks of `chunk` into `blocks`, then decodes `n` tokens: the tokens.
fn generate(cache: &KvCache, blocks: &[BlockId], prompt: &[u32], chunk: usize, n: usize) -> Vec<u32> {
    let model = Model { shape: SHAPE, vocab_size: 151_936 };
    let (mut digest, mut tokens, mut start, mut out) = (ContextDigest::default(), prompt.to_vec(), 0, Vec::new());
    while out.len() < n {
        let end = (start + chunk).min(tokens.len());
        let mut item = ForwardItem {
            tokens: tokens[start..end].to_vec(),
            start,
            block_ids: blocks.to_vec(),
            group_blocks: Vec::new(),
            digest,
            sample: end == tokens.len(),
        };
        let sampled = model.forward(cache, &mut item).expect("forward");
        digest = item.digest;
        start = end;
        if let Some(t) = sampled {
            out.push(t);
            tokens.push(t);
        }
    }
    out
}

#[test]
fn a_gpu_cache_computes_what_the_host_cache_computes() {
    let Some((p, _)) = gpus() else { return };
    let host = KvCache::new(SHAPE, BLOCKS);
    let gpu = KvCache::new_cuda(SHAPE, BLOCKS, p).expect("GPU cache");
    assert_eq!(gpu.memory(), MemoryKind::Cuda { device: p });
    let blocks: Vec<BlockId> = vec![3, 17, 9, 30, 12];
    let prompt = prompt(70);
    // Chunked prefill (two chunks), then decode: the same tokens, the same KV bytes.
    assert_eq!(generate(&gpu, &blocks, &prompt, 40, 8), generate(&host, &blocks, &prompt, 40, 8));
    assert_eq!(gpu.blocks_checksum(&blocks).expect("gpu"), host.blocks_checksum(&blocks).expect("host"));
    for &b in &blocks {
        assert!(gpu.block_bytes(b).expect("gpu") == host.block_bytes(b).expect("host"), "block {b} differs");
    }
    assert!(gpu.block_bytes(0).expect("untouched").iter().all(|&b| b == 0), "a block no request used stays zero");
}

#[test]
fn host_code_refuses_a_gpu_cache_s_memory() {
    let Some((p, _)) = gpus() else { return };
    let gpu = KvCache::new_cuda(SHAPE, BLOCKS, p).expect("GPU cache");
    let mut slot = vec![0u8; SHAPE.slot_len()];
    assert!(matches!(gpu.write_slot(0, 1, 0, 0, &slot), Err(RegionError::OnDevice { .. })));
    assert!(matches!(gpu.read_slot(0, 1, 0, 0, &mut slot), Err(RegionError::OnDevice { .. })));
    let table = gpu.region_table();
    let r = table.regions()[0];
    // SAFETY: refused before any byte is touched.
    assert!(matches!(unsafe { table.slice(r.base_addr, 64) }, Err(RegionError::OnDevice { .. })));
    assert!(matches!(unsafe { table.slice_mut(r.base_addr, 64) }, Err(RegionError::OnDevice { .. })));
    assert!(matches!(gpu.block_bytes(BLOCKS as BlockId), Err(RegionError::BlockOutOfRange { .. })));
}

#[tokio::test]
async fn a_tcp_write_into_a_gpu_cache_is_refused_whole() {
    let Some((p, d)) = gpus() else { return };
    let src = KvCache::new(SHAPE, BLOCKS);
    generate(&src, &[1, 2], &prompt(20), 20, 1);
    let dst = KvCache::new_cuda(SHAPE, BLOCKS, d).expect("GPU cache");
    let server = TcpDataServer::bind_with("127.0.0.1:0".parse().expect("addr"), dst.region_table(), None, false)
        .await
        .expect("binds");
    let engine = TcpTransferEngine::new(src.region_table(), TcpConfig::default());
    let plan = build_plan(&src.regions(), &[1, 2], &dst.regions(), &[5, 6], true).expect("plan");
    let err = engine
        .write(&server.local_addr().to_string(), &plan)
        .await
        .expect_err("GPU memory is not a socket's destination");
    assert!(matches!(&err, TransferError::Refused { reason, .. } if reason.contains("GPU memory")), "got {err:?}");
    assert!(dst.block_bytes(5).expect("read").iter().all(|&b| b == 0), "nothing landed");
    // And a GPU source is refused before anything is sent.
    let gpu_src = KvCache::new_cuda(SHAPE, BLOCKS, p).expect("GPU cache");
    let engine = TcpTransferEngine::new(gpu_src.region_table(), TcpConfig::default());
    let plan = build_plan(&gpu_src.regions(), &[1], &src.regions(), &[7], true).expect("plan");
    let host_server =
        TcpDataServer::bind("127.0.0.1:0".parse().expect("addr"), src.region_table(), None).await.expect("binds");
    let err = engine.write(&host_server.local_addr().to_string(), &plan).await.expect_err("GPU source");
    assert!(matches!(&err, TransferError::LocalRegion(RegionError::OnDevice { .. })), "got {err:?}");
    let _ = p;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cuda_peer_engine_writes_a_plan_into_d_s_gpu_under_its_fence() {
    let Some((p, d)) = gpus() else { return };
    let p_cache = KvCache::new_cuda(SHAPE, BLOCKS, p).expect("P's GPU cache");
    let d_cache = KvCache::new_cuda(SHAPE, BLOCKS, d).expect("D's GPU cache");
    let (p_blocks, d_blocks): (Vec<BlockId>, Vec<BlockId>) = (vec![4, 5, 6, 20], vec![30, 2, 11, 12]);
    generate(&p_cache, &p_blocks, &prompt(60), 60, 1);
    let fence = WriteFence::new();
    let addr = format!("127.0.0.1:{}", 40_000 + std::process::id() % 20_000);
    let guard = register_local_peer(&addr, &d_cache, Some(fence.clone())).expect("D registers");
    let engine = CudaPeerEngine::new(&p_cache, Duration::from_secs(10)).expect("engine");
    assert_eq!(engine.name(), "cuda-peer");
    // Uncoalesced: one descriptor per block and layer, still one launch.
    let plan = build_plan(&p_cache.regions(), &p_blocks, &d_cache.regions(), &d_blocks, false).expect("plan");

    // A closed (never opened) fence: refused, nothing lands.
    let fenced = under_fence(&plan, 9);
    let err = engine.write(&addr, &fenced).await.expect_err("fence 9 is not open");
    assert!(matches!(&err, TransferError::Refused { reason, .. } if reason.contains("fence 9")), "got {err:?}");
    assert!(d_cache.block_bytes(30).expect("read").iter().all(|&b| b == 0), "a refused write landed");

    fence.open(9);
    let stats = engine.write(&addr, &fenced).await.expect("the write succeeds");
    assert_eq!(stats.bytes, plan.total_bytes());
    assert_eq!(
        p_cache.blocks_checksum(&p_blocks).expect("P"),
        d_cache.blocks_checksum(&d_blocks).expect("D"),
        "D holds P's bytes"
    );
    fence.close(9, Duration::from_secs(2)).await.expect("no batch left in flight");

    // A destination outside D's regions: refused whole.
    let mut bad = fenced.clone();
    fence.open(10);
    bad.fence = 10;
    // Past the end of every region of D (regions may sit back to back in device memory).
    bad.descriptors[1].dst = d_cache.regions().iter().map(|r| r.base_addr + r.len).max().expect("regions");
    let err = engine.write(&addr, &bad).await.expect_err("out of D's regions");
    assert!(
        matches!(&err, TransferError::Refused { reason, .. } if reason.contains("nothing of the plan")),
        "got {err:?}"
    );

    // D gone: refused, saying why.
    drop(guard);
    let err = engine.write(&addr, &fenced).await.expect_err("D unregistered");
    assert!(matches!(&err, TransferError::Refused { reason, .. } if reason.contains("one process")), "got {err:?}");
}

/// `plan` under fence `token`.
fn under_fence(plan: &pdflow_kv::planner::TransferPlan, token: u64) -> pdflow_kv::planner::TransferPlan {
    pdflow_kv::planner::TransferPlan { fence: token, ..plan.clone() }
}

/// Without a GPU the cache cannot be made: a typed error, never a panic.
#[test]
fn a_gpu_cache_without_a_gpu_is_a_typed_error() {
    if device_count().is_ok() {
        assert!(matches!(KvCache::new_cuda(SHAPE, 4, 4096), Err(CudaError::NoSuchDevice { ordinal: 4096, .. })));
        return;
    }
    match KvCache::new_cuda(SHAPE, 4, 0) {
        Err(CudaError::NoDriver | CudaError::NoDevice | CudaError::Driver(_)) => {}
        other => panic!("expected a typed error, got {:?}", other.map(|c| c.memory())),
    }
}

/// GPU caches run only as an engine's one rank: sharded over ranks they are refused, typed.
#[test]
fn gpu_caches_sharded_over_ranks_are_refused() {
    use crate::ranks::{RanksError, ShardedModel};
    use pdflow_kv::topology::Topology;
    let Some((p, _)) = gpus() else { return };
    let topology = Topology::uniform(2, 1, SHAPE.num_layers, SHAPE.num_kv_heads).expect("a valid topology");
    let ranks = topology
        .ranks()
        .iter()
        .map(|r| {
            let local = KvShape { num_kv_heads: r.heads.len(), ..SHAPE };
            (r.clone(), KvCache::new_cuda(local, BLOCKS, p).expect("GPU cache"))
        })
        .collect();
    let model = Model { shape: SHAPE, vocab_size: 151_936 };
    let err = ShardedModel::new(model, BLOCKS, ranks).expect_err("refused");
    assert!(matches!(err, RanksError::ShardedDevice { rank: 0, .. }), "{err:?}");
    // One GPU rank holding everything runs, as on the host.
    let gpu = ShardedModel::new(
        model,
        BLOCKS,
        vec![(model.whole(), KvCache::new_cuda(SHAPE, BLOCKS, p).expect("GPU cache"))],
    )
    .expect("one rank");
    let host = ShardedModel::single(151_936, KvCache::new(SHAPE, BLOCKS));
    let item = || ForwardItem {
        tokens: prompt(30),
        start: 0,
        block_ids: vec![4, 9],
        group_blocks: Vec::new(),
        digest: ContextDigest::default(),
        sample: true,
    };
    let (mut a, mut b) = ([item()], [item()]);
    let mut layers = Vec::new();
    let on_gpu = gpu.forward(&mut a, &mut |l| layers.push(l));
    assert_eq!(on_gpu, host.forward(&mut b, &mut |_| {}));
    assert_eq!(a[0].digest, b[0].digest);
    assert_eq!(layers, (0..SHAPE.num_layers).collect::<Vec<_>>());
}
