//! What an engine whose KV lives on a GPU runs besides the host-memory path — shared by
//! `pdflow serve --kv-device N` and the vLLM bridge's worker over CUDA KV tensors (issue 7):
//!
//! - P: [`producer_engine`] — for host KV the automatic engine (same-host `process_vm_writev` when
//!   D shares this host and the kernel allows it, tcp otherwise); for GPU KV the GPU engine
//!   (cuda-peer in this process, cuda-ipc on this host, cuda-staged across hosts), seed step 29;
//! - D: [`serve_gpu_kv`] — the device offer D's data server answers P with (CUDA IPC handles and
//!   the staged receiver's port) and the staged receiver, under the pulls' write fence; and
//!   [`register_local_peer`], D's cache as a peer of P engines in this same process.
//!
//! For host KV the D side is nothing; in a build without the `cuda` feature GPU KV is refused.

use std::sync::Arc;

use pdflow_runtime::memory::{KvCache, MemoryKind};
use pdflow_runtime::transfer::fence::WriteFence;
use pdflow_runtime::transfer::tcp::TcpConfig;
use pdflow_runtime::transfer::{AutoTransferEngine, TransferEngine};

use super::NodeError;

/// Something an engine keeps alive while it serves (dropped with it).
pub type Held = Box<dyn std::any::Any + Send + Sync>;

/// P's transfer engine for seed step 29 over `kv_cache` (see the module docs).
pub fn producer_engine(kv_cache: &Arc<KvCache>, tcp: &TcpConfig) -> Result<Arc<dyn TransferEngine>, NodeError> {
    match kv_cache.memory() {
        MemoryKind::Host => Ok(Arc::new(AutoTransferEngine::new(kv_cache.region_table(), tcp.clone()))),
        #[cfg(feature = "cuda")]
        MemoryKind::Cuda { device } => pdflow_runtime::transfer::cuda::gpu_engine::GpuTransferEngine::new(kv_cache, tcp.clone())
            .map(|e| Arc::new(e) as Arc<dyn TransferEngine>)
            .map_err(|e| NodeError::Config(format!("GPU transfer engine on GPU {device}: {e}"))),
        #[cfg(not(feature = "cuda"))]
        MemoryKind::Cuda { device } => Err(NodeError::Config(format!("KV cache on GPU {device} in a build without GPU support"))),
    }
}

/// Registers D's GPU cache, served at `data_addr`, as a peer of this process's P engines
/// (cuda-peer; nothing for host KV).
pub fn register_local_peer(data_addr: &str, kv_cache: &Arc<KvCache>, fence: &WriteFence) -> Result<Option<Held>, NodeError> {
    if kv_cache.memory() == MemoryKind::Host {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        let guard = pdflow_runtime::transfer::cuda::peer_engine::register_local_peer(data_addr, kv_cache, Some(fence.clone()))
            .map_err(|e| NodeError::Config(e.to_string()))?;
        Ok(Some(Box::new(guard)))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (data_addr, fence);
        Err(NodeError::Config("a GPU KV cache in a build without GPU support".into()))
    }
}

/// D's serving of GPU KV on `host` (nothing for host KV): the device offer for its data server
/// and the staged receiver (kept alive by the returned value), under `fence` and `tcp`'s token.
pub fn serve_gpu_kv(kv_cache: &Arc<KvCache>, host: &str, tcp: &TcpConfig, fence: &WriteFence) -> Result<(Vec<u8>, Option<Held>), NodeError> {
    if kv_cache.memory() == MemoryKind::Host {
        return Ok((Vec::new(), None));
    }
    #[cfg(feature = "cuda")]
    {
        use pdflow_runtime::transfer::cuda::device_offer::DeviceServing;
        let serving = DeviceServing::start(kv_cache, host, tcp.auth_token.as_deref(), tcp.write_timeout, Some(fence.clone()))
            .map_err(|e| NodeError::Config(e.to_string()))?;
        tracing::info!(staged = %serving.staged_addr(), "D serves its GPU KV: CUDA IPC handles and a staged receiver");
        Ok((serving.export().to_vec(), Some(Box::new(serving))))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (host, tcp, fence);
        Err(NodeError::Config("a GPU KV cache in a build without GPU support".into()))
    }
}
