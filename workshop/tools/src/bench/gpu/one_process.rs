//! The GPU transfer bench in one process (feature `cuda`). GPU 0 holds P's KV
//! regions and GPU 1 D's (peer access on; one GPU plays both when only one is visible), in
//! Qwen3-8B's layout (36 regions × 1,024 blocks × 64 KiB). For the seed request's plan (seed step
//! 28: blocks 17..=79 → 512..=574, 36 descriptors), the uncoalesced plan (2,268 × 64 KiB) and a plan
//! whose block ids are scattered on both sides, it times (CUDA events, medians of `--runs`) one
//! gather/scatter kernel launch per plan (pushed from GPU 0 and pulled from GPU 1), one driver copy
//! per descriptor, and one peer copy of the same bytes (the ceiling); every path's bytes are
//! verified once (checksums of both sides read back). Exit status 1 if any check fails.
//!
//! Part of `pdflow bench transfer --device cuda`.

use std::time::Instant;

use super::{bench_plans, sweep_launch_shape, time_runs, NUM_BLOCKS};
use crate::bench::report::{self, Row};
use anyhow::bail;
use pdflow_kv::memory::KvShape;
use pdflow_kv::planner::{Descriptor, TransferPlan};
use pdflow_messages::layout::RegionDesc;
use pdflow_transfer::cuda::{self, CudaBatchCopy, CudaContext, DeviceBuffer};

/// `count` regions laid out back to back from `base`.
fn regions(base: u64, count: usize, block_len: u64) -> Vec<RegionDesc> {
    regions_of(base, count, NUM_BLOCKS, block_len)
}

/// `count` regions of `num_blocks` blocks of `block_len` laid out back to back from `base`.
fn regions_of(base: u64, count: usize, num_blocks: u64, block_len: u64) -> Vec<RegionDesc> {
    (0..count as u64)
        .map(|i| RegionDesc { base_addr: base + i * num_blocks * block_len, len: num_blocks * block_len, block_len })
        .collect()
}

/// Runs this part; returns its rows and whether every byte check passed.
pub(super) fn run(runs: usize) -> anyhow::Result<(Vec<Row>, bool)> {
    let gpus = match cuda::device_count() {
        Ok(n) => n,
        Err(e) => bail!("cannot run on GPUs: {e}"),
    };
    let ctx0 = CudaContext::new(0)?;
    let ctx1 = if gpus >= 2 { CudaContext::new(1)? } else { ctx0.clone() };
    if gpus >= 2 {
        cuda::enable_peer_access(&ctx0, &ctx1)?;
    }
    println!("GPUs visible: {gpus}; P on GPU 0, D on GPU {}", ctx1.ordinal());

    let shape = KvShape::QWEN3_8B;
    let block_len = shape.block_len() as u64;
    let side_bytes = (shape.num_layers as u64 * NUM_BLOCKS * block_len) as usize;
    let p_mem = DeviceBuffer::new(&ctx0, side_bytes)?;
    let d_mem = DeviceBuffer::new(&ctx1, side_bytes)?;
    let (p_regions, d_regions) =
        (regions(p_mem.ptr, shape.num_layers, block_len), regions(d_mem.ptr, shape.num_layers, block_len));

    let t = Instant::now();
    let push = CudaBatchCopy::new(&ctx0)?;
    let pull = if gpus >= 2 { Some(CudaBatchCopy::new(&ctx1)?) } else { None };
    println!("NVRTC compile + load: {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    push.fill_pattern(&p_mem, 0x5eed)?;

    let plans = bench_plans(&p_regions, &d_regions)?;
    let mut rows: Vec<Row> = Vec::new();
    let mut all_ok = true;
    let stream0 = push.stream().clone();

    // The kernel's launch shape: a short sweep on the seed and uncoalesced plans, best kept.
    let best = {
        let mut sweep = CudaBatchCopy::new(&ctx0)?;
        let ups: Vec<_> = plans[..2].iter().map(|(_, p)| sweep.upload(p)).collect::<Result<_, _>>()?;
        sweep_launch_shape(ups.len(), |threads, bps, i| {
            (sweep.threads, sweep.blocks_per_sm) = (threads, bps);
            Ok(cuda::time_ms(&stream0, || sweep.launch(&ups[i]))?)
        })?
    };
    println!("kernel launch shape kept: {} threads, {} blocks/SM", best.0, best.1);
    let mut push = push;
    (push.threads, push.blocks_per_sm) = best;
    let pull = pull.map(|mut c| {
        (c.threads, c.blocks_per_sm) = best;
        c
    });

    let mut verify = |name: &str, plan: &TransferPlan, go: &dyn Fn() -> anyhow::Result<()>| -> anyhow::Result<()> {
        d_mem.fill(0)?;
        go()?;
        ctx0.synchronize()?;
        ctx1.synchronize()?;
        let (a, b) = (cuda::plan_checksum(&ctx0, plan, true)?, cuda::plan_checksum(&ctx1, plan, false)?);
        let ok = a == b && a != cuda::plan_checksum(&ctx1, &TransferPlan::default(), false)?;
        println!("verify {name}: src {a:016x} dst {b:016x} {}", if ok { "OK" } else { "MISMATCH" });
        all_ok &= ok;
        Ok(())
    };

    for (plan_name, plan) in &plans {
        let bytes = plan.total_bytes();
        let t = Instant::now();
        let up_push = push.upload(plan)?;
        let upload_ms = t.elapsed().as_secs_f64() * 1e3;
        println!(
            "{plan_name}: {} descriptors, {} bytes, {} work items, upload {upload_ms:.2} ms",
            plan.descriptors.len(),
            bytes,
            up_push.chunks
        );

        verify(&format!("{plan_name} kernel push"), plan, &|| Ok(push.execute(&up_push)?))?;
        let s = time_runs(runs, || Ok(cuda::time_ms(&stream0, || push.launch(&up_push))?))?;
        rows.push(report::row("kernel push (1 launch)", Some("cuda"), Some(plan_name), None, Some(bytes), &s));

        if let Some(pull) = &pull {
            let up_pull = pull.upload(plan)?;
            verify(&format!("{plan_name} kernel pull"), plan, &|| Ok(pull.execute(&up_pull)?))?;
            let s = time_runs(runs, || Ok(cuda::time_ms(pull.stream(), || pull.launch(&up_pull))?))?;
            rows.push(report::row("kernel pull (1 launch)", Some("cuda"), Some(plan_name), None, Some(bytes), &s));
        }

        verify(&format!("{plan_name} copy per descriptor"), plan, &|| {
            Ok(cuda::copy_per_descriptor(&stream0, &ctx0, &ctx1, plan)?)
        })?;
        let s = time_runs(runs, || {
            Ok(cuda::time_ms(&stream0, || cuda::copy_per_descriptor(&stream0, &ctx0, &ctx1, plan))?)
        })?;
        rows.push(report::row("driver copy per descriptor", Some("cuda"), Some(plan_name), None, Some(bytes), &s));
    }

    // The ceiling: one peer copy of the seed's bytes.
    let bytes = plans[0].1.total_bytes();
    let whole = TransferPlan {
        descriptors: vec![Descriptor { src: p_mem.ptr, dst: d_mem.ptr, len: bytes }],
        fence: 0,
        write_by: None,
        grant: None,
    };
    verify("single peer copy", &whole, &|| Ok(cuda::copy_peer(&stream0, &ctx0, p_mem.ptr, &ctx1, d_mem.ptr, bytes)?))?;
    let s = time_runs(runs, || {
        Ok(cuda::time_ms(&stream0, || cuda::copy_peer(&stream0, &ctx0, p_mem.ptr, &ctx1, d_mem.ptr, bytes))?)
    })?;
    rows.push(report::row("single peer copy (ceiling)", Some("cuda"), Some("1 x 148635648"), None, Some(bytes), &s));
    let up_whole = push.upload(&whole)?;
    let s = time_runs(runs, || Ok(cuda::time_ms(&stream0, || push.launch(&up_whole))?))?;
    rows.push(report::row(
        "kernel push, one contiguous range",
        Some("cuda"),
        Some("1 x 148635648"),
        None,
        Some(bytes),
        &s,
    ));

    let med = |name: &str, plan: &str| {
        rows.iter().find(|r| r.name == name && r.plan.as_deref() == Some(plan)).and_then(|r| r.median_ms)
    };
    if let (Some(c), Some(k)) =
        (med("single peer copy (ceiling)", "1 x 148635648"), med("kernel push (1 launch)", "seed 36x4128768"))
    {
        println!("seed plan, kernel push: {:.1}% of the single-copy ceiling", 100.0 * c / k);
    }
    if let (Some(b), Some(k)) = (
        med("driver copy per descriptor", "uncoalesced 2268x64KiB"),
        med("kernel push (1 launch)", "uncoalesced 2268x64KiB"),
    ) {
        println!("uncoalesced plan: one launch is {:.1}x faster than one driver copy per descriptor", b / k);
    }
    Ok((rows, all_ok))
}
