//! `pdflow bench transfer --device cuda` (feature `cuda`): the transfer bench on GPUs —
//! the seed request's KV (seed step 28's plan, and the uncoalesced, scattered and 32 KiB plans)
//! moved GPU to GPU, each part with its same-run ceiling, in one table and one JSON:
//!
//! - [`one_process`] — P's regions on GPU 0, D's on GPU 1 in this process: one gather/scatter
//!   kernel launch per plan (pushed and pulled), one driver copy per descriptor, and one peer copy
//!   of the same bytes (the ceiling);
//! - [`ipc`] — D in another process (CUDA IPC handles), P's one launch into D's mapping, D verifying
//!   the bytes; ceilings: one copy through the mapping and one in-process peer copy;
//! - [`staged`] — the cross-host path on one host: tcp over 127.0.0.1 with pinned host staging,
//!   against loopback TCP host to host in the same run.
//!
//! One GPU plays both sides when only one is visible. Every path's bytes are verified; the command
//! fails if a check does.

mod ipc;
mod one_process;
mod serving;
mod staged;

use anyhow::bail;
use pdflow_kv::planner::{build_plan, TransferPlan};
use pdflow_messages::layout::RegionDesc;
use pdflow_messages::BlockId;

use super::report::{self, Row};

pub use ipc::serve_peer;

/// Blocks per region in the GPU benches (Qwen3-8B's layout: 36 regions × 1,024 blocks × 64 KiB).
const NUM_BLOCKS: u64 = 1024;
/// Unmeasured runs before each row's measured ones.
const WARMUP: usize = 3;

/// Runs the three parts; prints one table; writes the JSON. `Ok(false)` if a byte check failed.
pub fn run(runs: usize, json: Option<&std::path::Path>) -> anyhow::Result<bool> {
    let runs = runs.max(1);
    let mut rows: Vec<Row> = Vec::new();
    let mut all_ok = true;
    type Part = fn(usize) -> anyhow::Result<(Vec<Row>, bool)>;
    let parts: [(&str, Part); 3] = [
        ("one process", one_process::run),
        ("P and D in separate processes (CUDA IPC)", ipc::run),
        ("cross-host path (tcp with pinned staging)", staged::run),
    ];
    for (name, part) in parts {
        println!("== bench transfer --device cuda: {name}");
        let (part_rows, ok) = part(runs)?;
        all_ok &= ok;
        rows.extend(part_rows);
    }
    println!("\n{}", report::render(&rows));
    if let Some(path) = json {
        report::write_json(path, &rows)?;
        println!("rows written to {}", path.display());
    }
    if !all_ok {
        bail!("a byte check failed (see above)");
    }
    Ok(all_ok)
}

/// The plans every GPU part measures, P's regions → D's: the seed request (seed step 28: blocks
/// 17..=79 → 512..=574, coalesced, 36 descriptors), the same uncoalesced (2,268 × 64 KiB), block
/// ids scattered on both sides, and the same regions seen as blocks of 32 KiB (4,536 descriptors).
fn bench_plans(
    p_regions: &[RegionDesc],
    d_regions: &[RegionDesc],
) -> anyhow::Result<Vec<(&'static str, TransferPlan)>> {
    let (src_seed, dst_seed): (Vec<BlockId>, Vec<BlockId>) = ((17..=79).collect(), (512..=574).collect());
    let (src_sc, dst_sc) = (scattered_ids(63, 0x2545_f491_4f6c_dd1d), scattered_ids(63, 0x9e37_79b9_7f4a_7c15));
    let halved = |regions: &[RegionDesc]| -> Vec<RegionDesc> {
        regions.iter().map(|r| RegionDesc { block_len: r.block_len / 2, ..*r }).collect()
    };
    Ok(vec![
        ("seed 36x4128768", build_plan(p_regions, &src_seed, d_regions, &dst_seed, true)?),
        ("uncoalesced 2268x64KiB", build_plan(p_regions, &src_seed, d_regions, &dst_seed, false)?),
        ("scattered both sides", build_plan(p_regions, &src_sc, d_regions, &dst_sc, true)?),
        (
            "uncoalesced 4536x32KiB",
            build_plan(
                &halved(p_regions),
                &(34..=159).collect::<Vec<BlockId>>(),
                &halved(d_regions),
                &(1024..=1149).collect::<Vec<BlockId>>(),
                false,
            )?,
        ),
    ])
}

/// `n` distinct block ids in 0..NUM_BLOCKS in a pseudo-random order (xorshift shuffle).
fn scattered_ids(n: usize, mut x: u64) -> Vec<BlockId> {
    let mut all: Vec<BlockId> = (0..NUM_BLOCKS as BlockId).collect();
    for i in (1..all.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        all.swap(i, (x % (i as u64 + 1)) as usize);
    }
    all.truncate(n);
    all
}

/// [`WARMUP`] unmeasured runs of `one`, then `runs` measured ones (milliseconds).
fn time_runs(runs: usize, mut one: impl FnMut() -> anyhow::Result<f64>) -> anyhow::Result<Vec<f64>> {
    for _ in 0..WARMUP {
        one()?;
    }
    (0..runs).map(|_| one()).collect()
}

/// The gather/scatter kernel's launch shape: a short sweep over threads per block and blocks per
/// SM, timing `time_plan(threads, blocks_per_sm, i)` (one launch, ms) for each of `plans` plans;
/// the shape whose slowest plan is fastest.
fn sweep_launch_shape(
    plans: usize,
    mut time_plan: impl FnMut(u32, u32, usize) -> anyhow::Result<f64>,
) -> anyhow::Result<(u32, u32)> {
    let (mut best, mut best_ms) = ((512, 4), f64::MAX);
    for threads in [256u32, 512, 1024] {
        for bps in [1u32, 2, 4, 8] {
            let mut line = format!("sweep threads={threads:4} blocks/SM={bps}:");
            let mut worst = 0f64;
            for i in 0..plans {
                let s = time_runs(5, || time_plan(threads, bps, i))?;
                let m = report::summarize(&s).map(|s| s.0).unwrap_or(f64::MAX);
                line += &format!(" {m:.3} ms");
                worst = worst.max(m);
            }
            println!("{line}");
            if worst < best_ms {
                (best, best_ms) = ((threads, bps), worst);
            }
        }
    }
    Ok(best)
}
