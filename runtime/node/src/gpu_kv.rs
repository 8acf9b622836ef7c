//! What an engine whose KV lives on a GPU runs besides the host-memory path — shared by
//! `pdflow serve --kv-device N` and the vLLM bridge's worker over CUDA KV tensors:
//!
//! - P: [`producer_engine`] — for host KV the automatic engine (same-host `process_vm_writev` when
//!   D shares this host and the kernel allows it, tcp otherwise); for GPU KV the GPU engine
//!   (cuda-peer in this process, cuda-ipc on this host, cuda-staged across hosts), seed step 29;
//! - D: [`serve_kv_data`] — D's whole data plane for seed step 29: the pulls' write fence, the tcp
//!   data server over D's regions, and for GPU KV [`serve_gpu_kv`] (the device offer D's data
//!   server answers P with — CUDA IPC handles and the staged receiver's port — and the staged
//!   receiver) and [`register_local_peer`], D's cache as a peer of P engines in this process.
//!
//! For host KV the GPU parts are nothing; in a build without the `cuda` feature GPU KV is refused.

use std::sync::Arc;

use pdflow_kv::memory::{KvCache, MemoryKind};
use pdflow_transfer::fence::WriteFence;
use pdflow_transfer::same_host::SameHostMode;
use pdflow_transfer::tcp::{DataServerError, DataServerOptions, TcpConfig, TcpDataServer};
use pdflow_transfer::{AutoTransferEngine, TransferEngine};

use super::NodeError;

/// Something an engine keeps alive while it serves (dropped with it).
pub type Held = Box<dyn std::any::Any + Send + Sync>;

/// D's data plane, as [`serve_kv_data`] started it: hand `fence` to D's Receiver (it opens one
/// token per pull and closes it before freeing the blocks) and keep the rest while D serves.
pub struct KvDataServing {
    pub server: TcpDataServer,
    pub fence: WriteFence,
    /// The GPU serving (device offer, staged receiver, local peer registration), if any.
    pub held: Vec<Held>,
}

/// Starts D's data plane on `bind` (`host:port`) over `kv_cache`: every pull's blocks are fenced
/// (a write D gave up on is refused, never landed), P is offered the same-host path for host KV
/// unless `tcp` turns it off, and GPU KV is served as [`serve_gpu_kv`] and [`register_local_peer`]
/// say.
pub async fn serve_kv_data(
    kv_cache: &Arc<KvCache>,
    host: &str,
    bind: &str,
    tcp: &TcpConfig,
) -> Result<KvDataServing, NodeError> {
    let bind_addr: std::net::SocketAddr = bind.parse().map_err(|source| NodeError::InvalidAddress {
        what: "the KV data server",
        value: bind.to_string(),
        source,
    })?;
    let fence = match crate::rdma_offer::rdma_target(kv_cache, host, tcp)? {
        Some(target) => WriteFence::new().with_remote(target),
        None => WriteFence::new(),
    };
    let (device_export, gpu_serving) = serve_gpu_kv(kv_cache, host, tcp, &fence)?;
    let options = DataServerOptions {
        auth_token: tcp.auth_token.clone(),
        secret: tcp.secret.clone(),
        tls: tcp.tls.clone(),
        // P writes GPU KV by the cuda engines, never through D's host memory.
        offer_same_host: tcp.same_host != SameHostMode::Off && kv_cache.memory() == MemoryKind::Host,
        fence: Some(fence.clone()),
        device_export,
        insecure: tcp.insecure,
        ..DataServerOptions::default()
    };
    let server =
        TcpDataServer::bind_options(bind_addr, kv_cache.region_table(), options).await.map_err(|e| match e {
            DataServerError::Bind { addr, source } => {
                NodeError::Bind { what: "the KV data server", addr: addr.to_string(), source }
            }
        })?;
    let local_peer = register_local_peer(&server.local_addr().to_string(), kv_cache, &fence)?;
    Ok(KvDataServing { server, fence, held: gpu_serving.into_iter().chain(local_peer).collect() })
}

/// P's transfer engine for seed step 29 over `kv_cache` (see the module docs).
pub fn producer_engine(kv_cache: &Arc<KvCache>, tcp: &TcpConfig) -> Result<Arc<dyn TransferEngine>, NodeError> {
    match kv_cache.memory() {
        MemoryKind::Host => Ok(Arc::new(AutoTransferEngine::new(kv_cache.region_table(), tcp.clone()))),
        #[cfg(feature = "cuda")]
        MemoryKind::Cuda { device } => pdflow_transfer::cuda::gpu_engine::GpuTransferEngine::new(kv_cache, tcp.clone())
            .map(|e| Arc::new(e) as Arc<dyn TransferEngine>)
            .map_err(|e| NodeError::TransferStart {
                engine: crate::TransferPart::GpuEngine { device },
                source: Box::new(e),
            }),
        #[cfg(not(feature = "cuda"))]
        MemoryKind::Cuda { device } => Err(NodeError::NoGpuSupport { device }),
    }
}

/// Registers D's GPU cache, served at `data_addr`, as a peer of this process's P engines
/// (cuda-peer; nothing for host KV).
pub fn register_local_peer(
    data_addr: &str,
    kv_cache: &Arc<KvCache>,
    fence: &WriteFence,
) -> Result<Option<Held>, NodeError> {
    let MemoryKind::Cuda { device } = kv_cache.memory() else { return Ok(None) };
    #[cfg(feature = "cuda")]
    {
        let guard =
            pdflow_transfer::cuda::peer_engine::register_local_peer(data_addr, kv_cache, Some(fence.clone())).map_err(
                |e| NodeError::TransferStart { engine: crate::TransferPart::LocalPeer { device }, source: Box::new(e) },
            )?;
        Ok(Some(Box::new(guard)))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (data_addr, fence);
        Err(NodeError::NoGpuSupport { device })
    }
}

/// D's serving of GPU KV on `host` (nothing for host KV): the device offer for its data server
/// and the staged receiver (kept alive by the returned value), under `fence` and `tcp`'s proofs
/// (token, cluster secret, TLS).
pub fn serve_gpu_kv(
    kv_cache: &Arc<KvCache>,
    host: &str,
    tcp: &TcpConfig,
    fence: &WriteFence,
) -> Result<(Vec<u8>, Option<Held>), NodeError> {
    let MemoryKind::Cuda { device } = kv_cache.memory() else { return Ok((Vec::new(), None)) };
    #[cfg(feature = "cuda")]
    {
        use pdflow_transfer::cuda::device_offer::DeviceServing;
        use pdflow_transfer::cuda::staged::StagedAuth;
        let auth = StagedAuth::from_tcp(tcp);
        let serving =
            DeviceServing::start(kv_cache, host, auth, tcp.write_timeout, Some(fence.clone())).map_err(|e| {
                NodeError::TransferStart { engine: crate::TransferPart::GpuServing { device }, source: Box::new(e) }
            })?;
        tracing::info!(staged = %serving.staged_addr(), "D serves its GPU KV: CUDA IPC handles and a staged receiver");
        Ok((serving.export().to_vec(), Some(Box::new(serving))))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (host, tcp, fence);
        Err(NodeError::NoGpuSupport { device })
    }
}
