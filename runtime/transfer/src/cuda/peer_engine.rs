//! [`CudaPeerEngine`] (`cuda-peer`): seed step 29 when P's and D's KV caches both live on GPUs
//! and both engines run in this process (`pdflow demo --device cuda`: P on GPU 0, D on GPU 1, or
//! both on the one GPU there is). The whole plan runs as one launch of the gather/scatter kernel on
//! P's GPU, writing D's memory through peer access (no copy through the host).
//!
//! D makes itself reachable by registering its cache under its data server's address
//! ([`register_local_peer`]), with its write fence; P's engine looks the peer address up there.
//! Before the launch every source descriptor is checked against P's regions and every destination
//! against D's, and the plan's fence token must be open on D (held until the bytes are in), so a
//! write for a pull D gave up on is refused as on the tcp path.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;

use super::device_kv::DeviceKv;
use super::{enable_peer_access, CudaBatchCopy, CudaError, UploadedPlan};
use crate::fence::WriteFence;
use crate::{TransferEngine, TransferError, TransferStats};
use pdflow_kv::memory::{KvCache, MemoryKind, RegionTable};
use pdflow_kv::planner::TransferPlan;

/// The backend name this engine reports.
pub const BACKEND: &str = "cuda-peer";

/// A D cache in this process, as P's engine finds it.
#[derive(Clone)]
struct LocalPeer {
    regions: RegionTable,
    device: Arc<DeviceKv>,
    fence: Option<WriteFence>,
}

static LOCAL_PEERS: LazyLock<Mutex<HashMap<String, LocalPeer>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

fn peers() -> std::sync::MutexGuard<'static, HashMap<String, LocalPeer>> {
    // A map of handles: a panicking holder leaves nothing half-done.
    LOCAL_PEERS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Keeps D registered; dropping it unregisters (D stopped).
#[derive(Debug)]
pub struct LocalPeerGuard {
    addr: String,
}

impl Drop for LocalPeerGuard {
    fn drop(&mut self) {
        peers().remove(&self.addr);
    }
}

/// Why a cache cannot be registered as a local GPU peer.
#[derive(Debug, thiserror::Error)]
#[error("the KV cache at {addr} lives in {memory} memory: only a GPU cache can be written by the cuda-peer engine")]
pub struct NotOnDevice {
    pub addr: String,
    pub memory: MemoryKind,
}

/// Registers D's GPU cache under its data server's address `addr` (`host:port`, what D tells P
/// in its pull), with the fence its data server enforces.
pub fn register_local_peer(
    addr: &str,
    cache: &Arc<KvCache>,
    fence: Option<WriteFence>,
) -> Result<LocalPeerGuard, NotOnDevice> {
    let device =
        cache.device().cloned().ok_or_else(|| NotOnDevice { addr: addr.to_string(), memory: cache.memory() })?;
    peers().insert(addr.to_string(), LocalPeer { regions: cache.region_table(), device, fence });
    Ok(LocalPeerGuard { addr: addr.to_string() })
}

/// Whether a GPU cache of this process is registered at `addr`.
pub fn is_local_peer(addr: &str) -> bool {
    peers().contains_key(addr)
}

/// P's engine over GPU caches of this process (see the module docs).
pub struct CudaPeerEngine {
    local: RegionTable,
    device: Arc<DeviceKv>,
    /// The copier, and the descriptor table of its last finished write (reused by the next).
    copy: Arc<Mutex<(CudaBatchCopy, Option<UploadedPlan>)>>,
    write_timeout: Duration,
}

impl std::fmt::Debug for CudaPeerEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaPeerEngine").field("device", &self.device.ordinal()).finish()
    }
}

impl CudaPeerEngine {
    /// An engine reading from P's GPU cache `cache`; a write gives up after `write_timeout`.
    pub fn new(cache: &Arc<KvCache>, write_timeout: Duration) -> Result<Self, CudaError> {
        let device = cache.device().cloned().ok_or(CudaError::NoDevice)?;
        let copy = CudaBatchCopy::new(&device.context())?;
        Ok(Self { local: cache.region_table(), device, copy: Arc::new(Mutex::new((copy, None))), write_timeout })
    }

    async fn write_plan(&self, peer: &str, plan: &TransferPlan) -> Result<TransferStats, TransferError> {
        let started = Instant::now();
        let refused = |reason: String| TransferError::Refused { peer: peer.to_string(), reason };
        let target = peers().get(peer).cloned().ok_or_else(|| {
            refused(format!("no GPU KV cache of this process is registered at {peer}: the cuda-peer path needs P and D in one process"))
        })?;
        for d in plan.descriptors.iter().filter(|d| d.len > 0) {
            self.local.check(d.src, d.len)?;
            target.regions.check(d.dst, d.len).map_err(|e| refused(format!("{e}; nothing of the plan was written")))?;
        }
        // Held until the copy ends: D's pull, if it ends meanwhile, waits for it.
        let guard = match &target.fence {
            None => None,
            Some(fence) => Some(fence.enter(plan.fence).ok_or_else(|| {
                refused(format!("fence {} is closed: D no longer expects this transfer (its pull ended)", plan.fence))
            })?),
        };
        let mut timeout = self.write_timeout;
        if let Some(write_by) = plan.write_by {
            timeout = timeout.min(write_by.saturating_duration_since(Instant::now()));
        }
        let (copy, plan_owned, p_device, d_device) =
            (self.copy.clone(), plan.clone(), self.device.clone(), target.device.clone());
        let work = tokio::task::spawn_blocking(move || -> Result<(), CudaError> {
            // Released when the copy has really ended, even if the caller gave up waiting.
            let _guard = guard;
            if p_device.ordinal() != d_device.ordinal() {
                enable_peer_access(&p_device.context(), &d_device.context())?;
            }
            let mut guard = copy.lock().unwrap_or_else(PoisonError::into_inner);
            let (copy, spare) = &mut *guard;
            let uploaded = copy.upload_reusing(&plan_owned, spare.take())?;
            copy.execute(&uploaded)?;
            *spare = Some(uploaded);
            Ok(())
        });
        let result = tokio::time::timeout(timeout, work).await;
        let io = |e: String| TransferError::Io { peer: peer.to_string(), source: std::io::Error::other(e) };
        match result {
            Err(_) => Err(TransferError::Timeout { peer: peer.to_string(), deadline: timeout }),
            Ok(Err(join)) => Err(io(format!("the GPU copy's thread ended abnormally: {join}"))),
            Ok(Ok(Err(e))) => Err(io(format!("GPU {} → GPU {}: {e}", self.device.ordinal(), target.device.ordinal()))),
            Ok(Ok(Ok(()))) => Ok(TransferStats {
                bytes: plan.total_bytes(),
                descriptors: plan.descriptors.len(),
                duration: started.elapsed(),
            }),
        }
    }
}

impl TransferEngine for CudaPeerEngine {
    fn name(&self) -> &'static str {
        BACKEND
    }

    fn write<'a>(
        &'a self,
        peer: &'a str,
        plan: &'a TransferPlan,
    ) -> BoxFuture<'a, Result<TransferStats, TransferError>> {
        Box::pin(self.write_plan(peer, plan))
    }
}
