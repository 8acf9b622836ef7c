//! The cuda-ipc write as a serving P makes it, for the bench with P and D in separate
//! processes: P's bench memory registered as a GPU KV cache, `GpuTransferEngine` (the engine of
//! `pdflow serve --kv-device`) writing to a data server that offers D's device export (D: the
//! bench's child process, its KV exported as CUDA IPC handles) under D's write fence. Once: the
//! device question, the opening of D's handles, the route. Per write: the fence hold's round trip
//! over loopback TCP (acked before the launch), the checks, the descriptor upload, one launch, the
//! completion wait and the release. The data server runs in P's process here (in serving it is
//! D's); the bytes go into D's process through the IPC mapping as in serving.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_kv::planner::TransferPlan;
use pdflow_messages::layout::RegionDesc;
use pdflow_transfer::cuda::device_offer::DeviceOffer;
use pdflow_transfer::cuda::gpu_engine::GpuTransferEngine;
use pdflow_transfer::cuda::ipc::ExportedKv;
use pdflow_transfer::fence::WriteFence;
use pdflow_transfer::same_host::host_identity;
use pdflow_transfer::tcp::{DataServerOptions, TcpConfig, TcpDataServer};
use pdflow_transfer::TransferEngine;

use super::NUM_BLOCKS;

/// The fence token the bench's writes serve (opened once, for all of them).
const TOKEN: u64 = 29;

/// P's serving engine and the data server it asks, ready to write.
pub(super) struct ServingPath {
    rt: tokio::runtime::Handle,
    engine: GpuTransferEngine,
    server: Option<TcpDataServer>,
    pub peer: String,
    _p_cache: Arc<KvCache>,
}

impl ServingPath {
    /// `p_regions`: P's bench memory on GPU 0 (alive while this is); `export`: D's.
    pub fn start(p_regions: &[RegionDesc], export: &ExportedKv) -> anyhow::Result<Self> {
        let rt =
            tokio::runtime::Handle::try_current().context("the serving-path bench needs the bench's tokio runtime")?;
        let raw: Vec<(*mut u8, usize)> = p_regions.iter().map(|r| (r.base_addr as *mut u8, r.len as usize)).collect();
        // SAFETY: the regions lie in the bench's P allocation, which outlives this (the caller
        // holds it); the bench alone touches them.
        let p_cache =
            unsafe { KvCache::from_external_cuda(KvShape::QWEN3_8B, NUM_BLOCKS as usize, 0, &raw, Box::new(())) }?;
        let offer = DeviceOffer { host_id: host_identity().to_string(), ipc: Some(export.clone()), staged_port: None };
        let fence = WriteFence::new();
        fence.open(TOKEN);
        let options =
            DataServerOptions { device_export: offer.encode()?, fence: Some(fence), ..DataServerOptions::default() };
        // The server's own regions carry no batch here: a small host cache.
        let host =
            KvCache::new(KvShape { num_layers: 1, num_kv_heads: 1, head_dim: 8, dtype_bytes: 2, block_size: 1 }, 1);
        let server = rt.block_on(TcpDataServer::bind_options("127.0.0.1:0".parse()?, host.region_table(), options))?;
        let peer = server.local_addr().to_string();
        let engine = GpuTransferEngine::new(&p_cache, TcpConfig::default())?;
        let t = Instant::now();
        rt.block_on(engine.prepare(&peer))?;
        println!(
            "serving path: device question + D's handles opened by GpuTransferEngine in {:.2} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
        anyhow::ensure!(
            engine.backend_for(&peer) == "cuda-ipc",
            "the serving engine chose {}, not cuda-ipc",
            engine.backend_for(&peer)
        );
        Ok(Self { rt, engine, server: Some(server), peer, _p_cache: p_cache })
    }

    /// One write of `plan` as serving makes it (under the bench's fence token).
    pub fn write(&self, plan: &TransferPlan) -> anyhow::Result<()> {
        let plan = TransferPlan { fence: TOKEN, ..plan.clone() };
        self.rt.block_on(self.engine.write(&self.peer, &plan))?;
        Ok(())
    }
}

impl Drop for ServingPath {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            self.rt.block_on(server.shutdown());
        }
    }
}
