//! criterion micro-benchmarks of the transfer planner (seed step 28): `build_plan` for the seed's
//! request (P blocks 17..=79 → D blocks 512..=574, Qwen3-8B's 36 regions), coalesced (36
//! descriptors) and one descriptor per block (2,268), and for a fragmented id list.
//!
//! Run: `cargo bench -p pdflow-kv --bench planner`.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use pdflow_kv::memory::KvShape;
use pdflow_kv::planner::build_plan;
use pdflow_messages::layout::RegionDesc;
use pdflow_messages::BlockId;

/// Qwen3-8B's regions (1,024 blocks per layer), 1 GiB apart from `base`; no memory behind them.
fn regions(base: u64) -> Vec<RegionDesc> {
    let s = KvShape::QWEN3_8B;
    let block_len = s.block_len() as u64;
    (0..s.num_layers as u64)
        .map(|i| RegionDesc { base_addr: base + (i << 30), len: 1024 * block_len, block_len })
        .collect()
}

fn planner(c: &mut Criterion) {
    let (src, dst) = (regions(1 << 40), regions(1 << 44));
    let p_blocks: Vec<BlockId> = (17..=79).collect();
    let d_blocks: Vec<BlockId> = (512..=574).collect();
    // Every other block on D: no two neighbours are contiguous on both sides.
    let d_fragmented: Vec<BlockId> = (0..63).map(|i| 2 * i + 100).collect();

    c.bench_function("build_plan seed coalesced (36 descriptors)", |b| {
        b.iter(|| build_plan(black_box(&src), black_box(&p_blocks), black_box(&dst), black_box(&d_blocks), true))
    });
    c.bench_function("build_plan seed uncoalesced (2,268 descriptors)", |b| {
        b.iter(|| build_plan(black_box(&src), black_box(&p_blocks), black_box(&dst), black_box(&d_blocks), false))
    });
    c.bench_function("build_plan fragmented ids coalesced (2,268 descriptors)", |b| {
        b.iter(|| build_plan(black_box(&src), black_box(&p_blocks), black_box(&dst), black_box(&d_fragmented), true))
    });
}

criterion_group!(benches, planner);
criterion_main!(benches);
