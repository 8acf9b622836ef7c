//! The cross-host GPU path measured on one host (feature `cuda`). P's KV on GPU 0, D's on GPU 1 (GPU 0 when only one is visible), each in Qwen3-8B's layout
//! (36 regions × 1,024 blocks × 64 KiB); P writes the seed request (seed step 28's plan: blocks
//! 17..=79 → 512..=574, coalesced 36 × 4,128,768 B = 148,635,648 B; and uncoalesced, 2,268 × 64 KiB)
//! through pinned host staging and a real TCP socket on 127.0.0.1 (seed step 29 on the staged
//! path): device→pinned host in chunks, sent while the next chunks copy; received into pinned host
//! memory and copied host→device while the next chunks arrive. D runs in this process (its own
//! threads, context and GPU); every byte crosses the socket.
//!
//! In the same run, the ceilings: loopback TCP host memory → host memory of the same bytes over 1
//! stream and over each stream count used, and one pinned DtoH (GPU 0) and HtoD (GPU 1) copy of
//! the seed's bytes (the PCIe legs). Medians of `--runs` (host clock, write start to D's DONE);
//! every configuration's bytes verified on D (checksum of D's destination blocks against P's
//! source blocks, after D's regions were zeroed). Exit status 1 if a check fails. The default
//! shape runs again under a cluster secret (every request sealed, every acceptance proven) and
//! with TLS on top, so each row's cost reads against the same shape without them.
//!
//! Part of `pdflow bench transfer --device cuda`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::{time_runs, NUM_BLOCKS};
use crate::bench::report::{self, Row};
use anyhow::bail;
use pdflow_auth::{ClusterSecret, TlsIdentity};
use pdflow_kv::memory::KvShape;
use pdflow_kv::planner::{build_plan, Descriptor, TransferPlan};
use pdflow_messages::BlockId;
use pdflow_transfer::cuda::ipc_peer::PeerLayout;
use pdflow_transfer::cuda::staged::{
    PinnedBuffer, StagedAuth, StagedConfig, StagedError, StagedReceiver, StagedSender,
};
use pdflow_transfer::cuda::{self, CudaBatchCopy, CudaContext, DeviceBuffer};

const MIB: usize = 1 << 20;
/// The cluster secret of the rows that measure the staged path's proofs.
const BENCH_SECRET: &str = "staged-bench-cluster-secret";

/// Byte counts of `streams` parts of `total`, as the staged path splits a plan (4 KiB cuts).
fn shares(total: usize, streams: usize) -> Vec<usize> {
    let share = total.div_ceil(streams).div_ceil(4096) * 4096;
    let mut out = Vec::new();
    let mut left = total;
    while left > 0 {
        out.push(share.min(left));
        left -= share.min(left);
    }
    out
}

/// The loopback TCP ceiling: `streams` connections on 127.0.0.1, each sending its share of a host
/// buffer (length prefix, then `chunk`-sized writes) into its share of a host destination buffer
/// and waiting for a one-byte ack. Returns the medians' samples.
fn loopback_ceiling(bytes: usize, streams: usize, chunk: usize, runs: usize) -> anyhow::Result<Vec<f64>> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let parts = shares(bytes, streams);
    let src: Vec<u8> = (0..bytes).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3]).collect();
    let servers: Vec<_> = parts
        .iter()
        .map(|&n| -> anyhow::Result<_> {
            let client = TcpStream::connect(addr)?;
            let (server, _) = listener.accept()?;
            for s in [&client, &server] {
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(Duration::from_secs(60)))?;
            }
            let handle = std::thread::spawn(move || -> std::io::Result<()> {
                let mut server = server;
                let mut dst = vec![0u8; n];
                loop {
                    let mut len = [0u8; 8];
                    if server.read_exact(&mut len).is_err() {
                        return Ok(()); // client closed
                    }
                    let len = (u64::from_le_bytes(len) as usize).min(n);
                    server.read_exact(&mut dst[..len])?;
                    server.write_all(&[1])?;
                }
            });
            Ok((client, handle))
        })
        .collect::<anyhow::Result<_>>()?;
    let mut clients: Vec<TcpStream> = Vec::new();
    let mut handles = Vec::new();
    for (c, h) in servers {
        clients.push(c);
        handles.push(h);
    }
    let samples = time_runs(runs, || {
        let t = Instant::now();
        std::thread::scope(|s| -> anyhow::Result<()> {
            let mut offset = 0;
            let mut joins = Vec::new();
            for (client, &n) in clients.iter_mut().zip(&parts) {
                let part = &src[offset..offset + n];
                offset += n;
                joins.push(s.spawn(move || -> std::io::Result<()> {
                    client.write_all(&(n as u64).to_le_bytes())?;
                    for c in part.chunks(chunk) {
                        client.write_all(c)?;
                    }
                    let mut ack = [0u8; 1];
                    client.read_exact(&mut ack)
                }));
            }
            for j in joins {
                j.join().map_err(|_| anyhow::anyhow!("a loopback sender panicked"))??;
            }
            Ok(())
        })?;
        Ok(t.elapsed().as_secs_f64() * 1e3)
    })?;
    drop(clients);
    for h in handles {
        h.join().map_err(|_| anyhow::anyhow!("a loopback receiver panicked"))??;
    }
    Ok(samples)
}

/// Runs this part; returns its rows and whether every byte check passed.
pub(super) fn run(runs: usize) -> anyhow::Result<(Vec<Row>, bool)> {
    let gpus = match cuda::device_count() {
        Ok(n) => n,
        Err(e) => bail!("cannot run on GPUs: {e}"),
    };
    let shape = KvShape::QWEN3_8B;
    let lay = PeerLayout { regions: shape.num_layers as u64, blocks: NUM_BLOCKS, block_len: shape.block_len() as u64 };
    let ctx_p = CudaContext::new(0)?;
    let ctx_d = CudaContext::new(if gpus >= 2 { 1 } else { 0 })?;
    println!(
        "P on GPU 0, D on GPU {}; each {} regions x {} blocks x {} B",
        ctx_d.ordinal(),
        lay.regions,
        lay.blocks,
        lay.block_len
    );
    let p_mem = DeviceBuffer::new(&ctx_p, lay.bytes() as usize)?;
    let d_mem = DeviceBuffer::new(&ctx_d, lay.bytes() as usize)?;
    CudaBatchCopy::new(&ctx_p)?.fill_pattern(&p_mem, 0x5eed)?;
    let (p_regions, d_regions) = (lay.regions_at(p_mem.ptr), lay.regions_at(d_mem.ptr));
    let (src_ids, dst_ids): (Vec<BlockId>, Vec<BlockId>) = ((17..=79).collect(), (512..=574).collect());
    let plans: Vec<(&str, TransferPlan)> = vec![
        ("seed 36x4128768", build_plan(&p_regions, &src_ids, &d_regions, &dst_ids, true)?),
        ("uncoalesced 2268x64KiB", build_plan(&p_regions, &src_ids, &d_regions, &dst_ids, false)?),
    ];
    let seed_bytes = plans[0].1.total_bytes();
    if seed_bytes != 148_635_648 {
        bail!("the seed plan moves {seed_bytes} bytes, not 148,635,648: the layout changed");
    }
    let mut all_ok = true;
    let mut rows: Vec<Row> = Vec::new();

    // The PCIe legs alone: one pinned copy of the seed's bytes each way.
    for (name, ctx, mem, dtoh) in [
        ("pinned DtoH copy GPU0 (PCIe leg)", &ctx_p, &p_mem, true),
        ("pinned HtoD copy GPU1 (PCIe leg)", &ctx_d, &d_mem, false),
    ] {
        let mut pinned = PinnedBuffer::new(ctx, seed_bytes as usize)?;
        let stream = ctx.new_stream()?;
        let s = time_runs(runs, || {
            Ok(cuda::time_ms(&stream, || {
                // SAFETY: the device buffer holds 2.25 GiB, more than the seed's bytes; the pinned
                // buffer is not touched by the host while timed.
                unsafe {
                    if dtoh {
                        pinned.enqueue_dtoh(&stream, mem.ptr, seed_bytes as usize)
                    } else {
                        pinned.enqueue_htod(&stream, mem.ptr, seed_bytes as usize)
                    }
                }
            })?)
        })?;
        rows.push(report::row(name, Some("cuda"), Some("1 x 148635648"), None, Some(seed_bytes), &s));
    }

    let stream_counts = [1usize, 2, 4, 8];
    let chunk = 4 * MIB;
    for &streams in &stream_counts {
        let s = loopback_ceiling(seed_bytes as usize, streams, chunk, runs)?;
        rows.push(report::row(
            &format!("loopback TCP host->host ceiling, {streams} stream(s)"),
            Some("tcp"),
            Some("148635648 B"),
            None,
            Some(seed_bytes),
            &s,
        ));
    }

    let deadline = Duration::from_secs(60);
    let mut configs: Vec<StagedConfig> = stream_counts
        .iter()
        .map(|&streams| StagedConfig { chunk_bytes: chunk, depth: 4, streams, deadline, ..StagedConfig::default() })
        .collect();
    configs.push(StagedConfig { chunk_bytes: MIB, depth: 8, streams: 4, deadline, ..StagedConfig::default() });
    configs.push(StagedConfig { chunk_bytes: 16 * MIB, depth: 3, streams: 4, deadline, ..StagedConfig::default() });
    // Every shape without proofs; the default shape also under the cluster secret (sealed
    // requests) and with TLS on top, for their cost.
    let mut configs: Vec<(StagedConfig, StagedAuth, &str)> =
        configs.into_iter().map(|c| (c, StagedAuth::default(), "")).collect();
    let default_shape = StagedConfig { deadline, ..StagedConfig::default() };
    let sealed = StagedAuth { secret: Some(ClusterSecret::from_text(BENCH_SECRET)?), ..StagedAuth::default() };
    let tls = StagedAuth { tls: sealed.secret.as_ref().map(TlsIdentity::from_secret).transpose()?, ..sealed.clone() };
    configs.push((default_shape, sealed, ", cluster secret"));
    configs.push((default_shape, tls, ", cluster secret + TLS"));
    let zeros = |plan: &TransferPlan| {
        plan.descriptors.iter().fold(cuda::CHECKSUM_BASIS, |h, d| cuda::checksum_words(h, &vec![0u8; d.len as usize]))
    };
    let expected: Vec<u64> =
        plans.iter().map(|(_, p)| cuda::plan_checksum(&ctx_p, p, true)).collect::<Result<_, _>>()?;
    for (config, auth, proofs) in &configs {
        let receiver =
            StagedReceiver::bind_guarded(&ctx_d, d_regions.clone(), "127.0.0.1:0", *config, None, auth.clone())?;
        let peer = receiver.local_addr().to_string();
        let sender = StagedSender::new(&ctx_p, p_regions.clone(), *config).with_auth(auth.clone());
        let label = staged_label(config, proofs);
        for (i, (plan_name, plan)) in plans.iter().enumerate() {
            // The uncoalesced plan only at the default shape (its cost is per-descriptor copies).
            if i == 1 && !(config.streams == 4 && config.chunk_bytes == chunk && proofs.is_empty()) {
                continue;
            }
            d_mem.fill(0)?;
            let cold = Instant::now();
            sender.write(&peer, plan)?;
            if i == 0 {
                // The first write connects and pins every connection's staging ring on both sides.
                rows.push(report::row(
                    &format!("{label}, first write (connects, pins rings)"),
                    Some("cuda-staged"),
                    Some(plan_name),
                    None,
                    Some(plan.total_bytes()),
                    &[cold.elapsed().as_secs_f64() * 1e3],
                ));
            }
            let got = cuda::plan_checksum(&ctx_d, plan, false)?;
            let ok = got == expected[i] && got != zeros(plan);
            println!(
                "verify {label} {plan_name}: P {:016x} D {got:016x} {}",
                expected[i],
                if ok { "OK" } else { "MISMATCH" }
            );
            all_ok &= ok;
            let s = time_runs(runs, || {
                let t = Instant::now();
                sender.write(&peer, plan)?;
                Ok(t.elapsed().as_secs_f64() * 1e3)
            })?;
            rows.push(report::row(&label, Some("cuda-staged"), Some(plan_name), None, Some(plan.total_bytes()), &s));
        }
        // D refuses a plan with one destination past its last region; nothing of it lands.
        if config.streams == 4 && config.chunk_bytes == chunk && proofs.is_empty() {
            let mut bad = plans[0].1.clone();
            let last = d_regions[d_regions.len() - 1];
            bad.descriptors.push(Descriptor { src: p_mem.ptr, dst: last.base_addr + last.len - 4096, len: 65536 });
            d_mem.fill(0)?;
            let refused = matches!(sender.write(&peer, &bad), Err(StagedError::Refused { .. }));
            let untouched = cuda::plan_checksum(&ctx_d, &plans[0].1, false)? == zeros(&plans[0].1);
            println!(
                "region check: a plan with one out-of-region destination is refused whole: {}",
                if refused && untouched { "OK" } else { "FAILED" }
            );
            all_ok &= refused && untouched;
        }
    }

    let med = |name: &str| {
        rows.iter()
            .find(|r| r.name == name && r.plan.as_deref() != Some("uncoalesced 2268x64KiB"))
            .and_then(|r| r.median_ms)
    };
    let one = med("loopback TCP host->host ceiling, 1 stream(s)");
    for (config, _, proofs) in &configs {
        let label = staged_label(config, proofs);
        let same = med(&format!("loopback TCP host->host ceiling, {} stream(s)", config.streams));
        if let (Some(k), Some(c), Some(o)) = (med(&label), same, one) {
            let gbps = |ms: f64| seed_bytes as f64 / (ms / 1e3) / 1e9;
            println!(
                "seed request, {label}: {k:.2} ms = {:.2} GB/s; {:.1}% of loopback with {} stream(s) ({c:.2} ms, {:.2} GB/s), {:.1}% of 1 stream ({o:.2} ms)",
                gbps(k),
                100.0 * c / k,
                config.streams,
                gbps(c),
                100.0 * o / k
            );
        }
    }
    Ok((rows, all_ok))
}

/// The rows' name of one staged shape under `proofs` (empty: none).
fn staged_label(config: &StagedConfig, proofs: &str) -> String {
    format!(
        "staged tcp, {} stream(s), {} MiB x {} chunks{proofs}",
        config.streams,
        config.chunk_bytes / MIB,
        config.depth
    )
}
