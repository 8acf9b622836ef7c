//! The GPU transfer bench with P and D in separate processes (feature `cuda`). The bench
//! is P on GPU 0; it starts pdflow again as D (`--ipc-peer`) on GPU 1 (GPU 0 when
//! only one is visible). D allocates its KV regions in Qwen3-8B's layout (36 regions × 1,024
//! blocks × 64 KiB), exports them as CUDA IPC handles and writes nothing; P opens them, fills its
//! own regions with a deterministic pattern and writes each plan (seed step 29) into D's memory in
//! one kernel launch: the seed request (seed step 28: blocks 17..=79 → 512..=574, 36 descriptors),
//! the uncoalesced plan (2,268 × 64 KiB), a plan whose block ids are scattered on both sides, and
//! 4,536 × 32 KiB. D verifies every plan's bytes (checksum over its destination blocks against
//! P's). Timed with CUDA events, medians of `--runs`: the launch; the launch plus P's completion
//! wait (host clock); the whole write as P's serving engine makes it, D's write fence held
//! around it ([`super::serving`]); one driver copy per descriptor; and the same-run ceilings, one copy of the
//! seed's bytes through the IPC mapping and one in-process `cuMemcpyPeerAsync`. Exit status 1 if
//! any check fails.
//!
//! Part of `pdflow bench transfer --device cuda`; D is `pdflow bench transfer --device cuda
//! --ipc-peer N`.

use std::process::Command;
use std::time::{Duration, Instant};

use super::{bench_plans, sweep_launch_shape, time_runs, NUM_BLOCKS};
use crate::bench::report::{self, Row};
use anyhow::{bail, Context as _};
use pdflow_kv::memory::KvShape;
use pdflow_kv::planner::{Descriptor, TransferPlan};
use pdflow_transfer::cuda::ipc::{CudaIpcWriter, ImportedKv, IpcError};
use pdflow_transfer::cuda::ipc_peer::{serve_d, DPeerProcess, PeerLayout};
use pdflow_transfer::cuda::{self, CudaBatchCopy, CudaContext, DeviceBuffer};

/// How long P waits for each answer of D (its start includes a 2.25 GiB allocation).
const PEER_DEADLINE: Duration = Duration::from_secs(120);

fn layout() -> PeerLayout {
    let shape = KvShape::QWEN3_8B;
    PeerLayout { regions: shape.num_layers as u64, blocks: NUM_BLOCKS, block_len: shape.block_len() as u64 }
}

/// D's process (`pdflow bench transfer --device cuda --ipc-peer N`): allocates and exports its
/// regions on GPU `device`, then answers P over stdin/stdout until told to quit.
pub fn serve_peer(device: usize) -> anyhow::Result<()> {
    serve_d(device, layout(), std::io::stdin().lock(), std::io::stdout().lock())?;
    Ok(())
}

/// Runs this part; returns its rows and whether every check passed.
pub(super) fn run(runs: usize) -> anyhow::Result<(Vec<Row>, bool)> {
    let gpus = match cuda::device_count() {
        Ok(n) => n,
        Err(e) => bail!("cannot run on GPUs: {e}"),
    };
    let d_device = if gpus >= 2 { 1 } else { 0 };
    let t = Instant::now();
    let mut cmd = Command::new(std::env::current_exe().context("pdflow's own path, to start D")?);
    cmd.args(["bench", "transfer", "--device", "cuda", "--ipc-peer", &d_device.to_string()]);
    let (mut d, export) = DPeerProcess::spawn(cmd, PEER_DEADLINE)?;
    println!(
        "D: pid {} on GPU {}, {} regions in {} allocation(s), exported in {:.1} ms; P: pid {} on GPU 0",
        export.pid,
        export.device,
        export.regions.len(),
        export.allocations.len(),
        t.elapsed().as_secs_f64() * 1e3,
        std::process::id()
    );

    let ctx0 = CudaContext::new(0)?;
    let lay = layout();
    let p_mem = DeviceBuffer::new(&ctx0, lay.bytes() as usize)?;
    let p_regions = lay.regions_at(p_mem.ptr);
    let t = Instant::now();
    let mut writer = CudaIpcWriter::new(CudaBatchCopy::new(&ctx0)?, p_regions.clone());
    println!("NVRTC compile + load: {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    let t = Instant::now();
    let peer = ImportedKv::open(&ctx0, &export)?;
    println!("P opened D's IPC handles in {:.2} ms", t.elapsed().as_secs_f64() * 1e3);
    writer.copier().fill_pattern(&p_mem, 0x5eed)?;
    let stream0 = writer.copier().stream().clone();
    let d_regions = export.regions.clone();

    let plans = bench_plans(&p_regions, &d_regions)?;
    let mut all_ok = true;

    // The region checks apply across processes: one descriptor past D's last region refuses the plan.
    let mut bad = plans[0].1.clone();
    let last = d_regions[d_regions.len() - 1];
    bad.descriptors.push(Descriptor { src: p_mem.ptr, dst: last.base_addr + last.len - 4096, len: 65536 });
    let refused = matches!(writer.prepare(&peer, &bad), Err(IpcError::DestinationOutOfRegion { index: 36, .. }));
    println!(
        "region check: a plan with one out-of-region destination is refused before launch: {}",
        if refused { "OK" } else { "NOT REFUSED" }
    );
    all_ok &= refused;

    // The kernel's launch shape: a short sweep on the seed and uncoalesced plans, best kept.
    let best = {
        let preps: Vec<_> = plans[..2].iter().map(|(_, p)| writer.prepare(&peer, p)).collect::<Result<_, _>>()?;
        sweep_launch_shape(preps.len(), |threads, bps, i| {
            let c = writer.copier_mut();
            (c.threads, c.blocks_per_sm) = (threads, bps);
            Ok(cuda::time_ms(&stream0, || writer.launch(&preps[i]))?)
        })?
    };
    let c = writer.copier_mut();
    (c.threads, c.blocks_per_sm) = best;
    println!("kernel launch shape kept: {} threads, {} blocks/SM", best.0, best.1);
    let writer = writer;

    let zero_checksum = |plan: &TransferPlan| {
        plan.descriptors.iter().fold(cuda::CHECKSUM_BASIS, |h, d| cuda::checksum_words(h, &vec![0u8; d.len as usize]))
    };
    // D zeroes its regions, `go` writes, D checks the destination blocks against P's source blocks.
    let mut verify = |name: &str, plan: &TransferPlan, go: &dyn Fn() -> anyhow::Result<()>| -> anyhow::Result<()> {
        d.zero()?;
        go()?;
        writer.wait_complete()?;
        let expected = cuda::plan_checksum(&ctx0, plan, true)?;
        let (got, ok) = d.verify(plan, expected)?;
        let ok = ok && expected != zero_checksum(plan);
        println!("verify {name}: P {expected:016x} D {got:016x} {}", if ok { "OK" } else { "MISMATCH" });
        all_ok &= ok;
        Ok(())
    };

    let serving = super::serving::ServingPath::start(&p_regions, &export)?;
    let mut rows: Vec<Row> = Vec::new();
    for (plan_name, plan) in &plans {
        let bytes = plan.total_bytes();
        let t = Instant::now();
        let prep = writer.prepare(&peer, plan)?;
        let prep_ms = t.elapsed().as_secs_f64() * 1e3;
        println!(
            "{plan_name}: {} descriptors, {bytes} bytes, checks + translation + upload {prep_ms:.2} ms",
            plan.descriptors.len()
        );

        verify(&format!("{plan_name} ipc kernel"), plan, &|| Ok(writer.launch(&prep)?))?;
        let s = time_runs(runs, || Ok(cuda::time_ms(&stream0, || writer.launch(&prep))?))?;
        rows.push(report::row(
            "ipc kernel push (1 launch), P/D processes",
            Some("cuda-ipc"),
            Some(plan_name),
            None,
            Some(bytes),
            &s,
        ));
        let s = time_runs(runs, || {
            let t = Instant::now();
            writer.launch(&prep)?;
            writer.wait_complete()?;
            Ok(t.elapsed().as_secs_f64() * 1e3)
        })?;
        rows.push(report::row(
            "ipc launch + completion wait (host clock)",
            Some("cuda-ipc"),
            Some(plan_name),
            None,
            Some(bytes),
            &s,
        ));
        // What a serving write costs P: checks, translation, the descriptor upload (into the
        // table the previous write left), the launch and the wait.
        let s = time_runs(runs, || {
            let t = Instant::now();
            writer.write(&peer, plan)?;
            Ok(t.elapsed().as_secs_f64() * 1e3)
        })?;
        rows.push(report::row(
            "ipc whole write: checks + upload + launch + wait",
            Some("cuda-ipc"),
            Some(plan_name),
            None,
            Some(bytes),
            &s,
        ));

        // The same write through the serving engine: D's fence held around it.
        verify(&format!("{plan_name} serving write"), plan, &|| serving.write(plan))?;
        let s = time_runs(runs, || {
            let t = Instant::now();
            serving.write(plan)?;
            Ok(t.elapsed().as_secs_f64() * 1e3)
        })?;
        rows.push(report::row(
            "serving write (GpuTransferEngine): fence hold + whole write + release",
            Some("cuda-ipc"),
            Some(plan_name),
            None,
            Some(bytes),
            &s,
        ));

        let translated = peer.map().translate_plan(&p_regions, plan)?;
        verify(&format!("{plan_name} copy per descriptor"), plan, &|| {
            Ok(cuda::copy_per_descriptor_uva(&stream0, &translated)?)
        })?;
        let s =
            time_runs(runs, || Ok(cuda::time_ms(&stream0, || cuda::copy_per_descriptor_uva(&stream0, &translated))?))?;
        rows.push(report::row(
            "driver copy per descriptor, via IPC",
            Some("cuda-ipc"),
            Some(plan_name),
            None,
            Some(bytes),
            &s,
        ));
    }

    // Ceilings: one copy of the seed's bytes into D's memory through the IPC mapping, and one
    // in-process peer copy GPU 0 -> GPU 1 (cuMemcpyPeerAsync) of the same bytes.
    // The seed's bytes span three of D's regions (one allocation): the single copy goes from P's
    // first region to D's first through the mapping; its checks and checksums cut it at region ends.
    let bytes = plans[0].1.total_bytes();
    if export.allocations.len() != 1 {
        bail!("D exported {} allocations; the single-copy ceiling needs its regions in one", export.allocations.len());
    }
    let region_len = d_regions[0].len;
    let whole = TransferPlan {
        descriptors: (0..bytes.div_ceil(region_len))
            .map(|i| Descriptor {
                src: p_mem.ptr + i * region_len,
                dst: d_regions[0].base_addr + i * region_len,
                len: region_len.min(bytes - i * region_len),
            })
            .collect(),
        fence: 0,
        write_by: None,
        grant: None,
    };
    let dst_local = peer.map().translate(d_regions[0].base_addr, 1)?;
    let one_copy = TransferPlan {
        descriptors: vec![Descriptor { src: p_mem.ptr, dst: dst_local, len: bytes }],
        fence: 0,
        write_by: None,
        grant: None,
    };
    verify("single copy via IPC", &whole, &|| Ok(cuda::copy_per_descriptor_uva(&stream0, &one_copy)?))?;
    let s = time_runs(runs, || Ok(cuda::time_ms(&stream0, || cuda::copy_per_descriptor_uva(&stream0, &one_copy))?))?;
    rows.push(report::row(
        "single copy via IPC mapping (ceiling)",
        Some("cuda-ipc"),
        Some("1 x 148635648"),
        None,
        Some(bytes),
        &s,
    ));
    let prep_whole = writer.prepare(&peer, &whole)?;
    verify("ipc kernel, contiguous ranges", &whole, &|| Ok(writer.launch(&prep_whole)?))?;
    let s = time_runs(runs, || Ok(cuda::time_ms(&stream0, || writer.launch(&prep_whole))?))?;
    rows.push(report::row(
        "ipc kernel push, contiguous ranges",
        Some("cuda-ipc"),
        Some("3 ranges, 148635648"),
        None,
        Some(bytes),
        &s,
    ));
    if gpus >= 2 {
        let ctx1 = CudaContext::new(1)?;
        cuda::enable_peer_access(&ctx0, &ctx1)?;
        let local_d = DeviceBuffer::new(&ctx1, bytes as usize)?;
        cuda::copy_peer(&stream0, &ctx0, p_mem.ptr, &ctx1, local_d.ptr, bytes)?;
        writer.wait_complete()?;
        let s = time_runs(runs, || {
            Ok(cuda::time_ms(&stream0, || cuda::copy_peer(&stream0, &ctx0, p_mem.ptr, &ctx1, local_d.ptr, bytes))?)
        })?;
        rows.push(report::row(
            "single peer copy in-process (ceiling)",
            Some("cuda"),
            Some("1 x 148635648"),
            None,
            Some(bytes),
            &s,
        ));
    }

    let med = |name: &str, plan: &str| {
        rows.iter().find(|r| r.name == name && r.plan.as_deref() == Some(plan)).and_then(|r| r.median_ms)
    };
    let kernel = "ipc kernel push (1 launch), P/D processes";
    for ceiling in ["single copy via IPC mapping (ceiling)", "single peer copy in-process (ceiling)"] {
        if let (Some(c), Some(k)) = (med(ceiling, "1 x 148635648"), med(kernel, "seed 36x4128768")) {
            println!("seed plan across processes: {k:.3} ms, {:.1}% of {ceiling} {c:.3} ms", 100.0 * c / k);
        }
    }
    for plan in ["uncoalesced 2268x64KiB", "scattered both sides", "uncoalesced 4536x32KiB"] {
        if let (Some(b), Some(k)) = (med("driver copy per descriptor, via IPC", plan), med(kernel, plan)) {
            println!(
                "{plan}: one launch {k:.3} ms, {:.1}x faster than one driver copy per descriptor ({b:.3} ms)",
                b / k
            );
        }
    }
    drop(serving);
    drop(peer);
    d.quit()?;
    Ok((rows, all_ok))
}
