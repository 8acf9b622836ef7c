//! [`GpuTransferEngine`]: the engine of a P node whose KV lives on a GPU, for seed step 29. Per
//! peer it takes the most direct path there is:
//!
//! - `cuda-peer` — D's GPU cache is in this process (registered under its data address,
//!   [`super::peer_engine`]): one gather/scatter launch under D's write fence;
//! - `cuda-ipc` — D is another process on this host: P asks D's data server for its device export
//!   (the CUDA IPC handles of D's KV allocations and D's regions, over the data connection's
//!   control request), opens the handles once per peer ([`super::ipc_engine`]) and writes each
//!   plan in one launch into D's mapping, every destination checked against D's exported regions.
//!
//! The choice is made once per peer — during the prefill when the pull comes early
//! ([`TransferEngine::prepare`]) — and re-made when D's process is gone (a D restarted at the same
//! address exports new handles). The IPC path has no data-server fence: like the same-host path,
//! it does not launch a write D can no longer wait for (less than [`WRITE_MARGIN`] left before the
//! plan's `write_by`), and one launch takes well under a millisecond. A D whose KV is in host
//! memory, or on another host, offers no device export: the write is refused, saying so (the staged
//! cross-host path is not wired into serving yet).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;

use super::ipc::{CudaIpcWriter, ExportedKv};
use super::ipc_engine::CudaIpcEngine;
use super::peer_engine::{self, CudaPeerEngine};
use super::{CudaBatchCopy, CudaError};
use crate::memory::KvCache;
use crate::planner::TransferPlan;
use crate::transfer::tcp::{TcpConfig, TcpTransferEngine};
use crate::transfer::{TransferEngine, TransferError, TransferStats};

/// The backend name of the IPC path.
pub const BACKEND_IPC: &str = super::ipc_engine::BACKEND;

/// The least time a cuda-ipc write must have before the plan's `write_by` to be launched.
pub const WRITE_MARGIN: Duration = Duration::from_millis(50);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Peer,
    /// Through CUDA IPC into D's process `pid`.
    Ipc { pid: u32 },
}

/// P's engine for GPU KV (see the module docs).
pub struct GpuTransferEngine {
    peer: CudaPeerEngine,
    ipc: CudaIpcEngine,
    /// Asks D's data server for its device export (no KV goes over it).
    control: TcpTransferEngine,
    routes: Mutex<HashMap<String, Route>>,
}

impl std::fmt::Debug for GpuTransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuTransferEngine").field("peer", &self.peer).finish()
    }
}

impl GpuTransferEngine {
    /// An engine reading P's GPU cache `cache`; `tcp` gives the write deadline, the connect
    /// deadline and the auth token of the control questions to D's data server.
    pub fn new(cache: &Arc<KvCache>, tcp: TcpConfig) -> Result<Self, CudaError> {
        let device = cache.device().cloned().ok_or(CudaError::NoDevice)?;
        let peer = CudaPeerEngine::new(cache, tcp.write_timeout)?;
        let writer = CudaIpcWriter::new(CudaBatchCopy::new(&device.context())?, cache.regions());
        let control = TcpTransferEngine::new(cache.region_table(), tcp);
        Ok(Self { peer, ipc: CudaIpcEngine::new(writer), control, routes: Mutex::new(HashMap::new()) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Route>> {
        // A cache of choices: a panicking holder cannot break it.
        self.routes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The path to `peer`: cached while D's process lives, else chosen afresh.
    async fn route(&self, peer: &str) -> Result<Route, TransferError> {
        match self.lock().get(peer).copied() {
            Some(Route::Ipc { pid }) if !process_alive(pid) => {
                tracing::info!(%peer, pid, "D's process is gone: asking its data server for a new device export");
                self.ipc.forget_peer(peer);
            }
            Some(route) => return Ok(route),
            None => {}
        }
        let route = self.choose(peer).await?;
        self.lock().insert(peer.to_string(), route);
        Ok(route)
    }

    async fn choose(&self, peer: &str) -> Result<Route, TransferError> {
        if peer_engine::is_local_peer(peer) {
            return Ok(Route::Peer);
        }
        let refused = |reason: String| TransferError::Refused { peer: peer.to_string(), reason };
        let bytes = self.control.device_export(peer).await?;
        if bytes.is_empty() {
            return Err(refused(
                "D offers no device export: its KV is in host memory (P's is on a GPU; run both engines with GPU KV, or both with host KV)".into(),
            ));
        }
        let export: ExportedKv = postcard::from_bytes(&bytes).map_err(|e| refused(format!("D's device export cannot be read ({e}): is D a different pdflow version?")))?;
        export.validate().map_err(|e| refused(format!("D's device export is inconsistent: {e}")))?;
        let pid = export.pid;
        let ipc = self.ipc.clone();
        let owned = peer.to_string();
        let limit = self.control.config().connect_timeout;
        let opened = tokio::time::timeout(limit, tokio::task::spawn_blocking(move || ipc.register_peer(&owned, &export))).await;
        let Ok(opened) = opened else {
            return Err(TransferError::Timeout { peer: peer.to_string(), deadline: limit });
        };
        match opened {
            Ok(Ok(())) => {
                tracing::debug!(%peer, pid, "cuda-ipc: D's KV handles opened");
                Ok(Route::Ipc { pid })
            }
            Ok(Err(e)) => Err(refused(format!("D's CUDA IPC handles cannot be opened here ({e}): is D on another host? (the staged cross-host path is not wired into serving yet)"))),
            Err(join) => Err(TransferError::Io { peer: peer.to_string(), source: std::io::Error::other(format!("opening D's handles: {join}")) }),
        }
    }

    async fn write_plan(&self, peer: &str, plan: &TransferPlan) -> Result<TransferStats, TransferError> {
        match self.route(peer).await? {
            Route::Peer => self.peer.write(peer, plan).await,
            Route::Ipc { .. } => {
                if plan.cut_after.is_some() {
                    return Err(TransferError::Refused { peer: peer.to_string(), reason: "the cut_data fault cuts a tcp data connection; the cuda-ipc path has none".into() });
                }
                if let Some(write_by) = plan.write_by {
                    let left = write_by.saturating_duration_since(Instant::now());
                    if left < WRITE_MARGIN {
                        // D may give the blocks up before the copy ends: do not start it.
                        return Err(TransferError::Timeout { peer: peer.to_string(), deadline: left });
                    }
                }
                self.ipc.write(peer, plan).await
            }
        }
    }
}

/// D's side: the device export its data server answers P with — the CUDA IPC export of the
/// cache's allocations and regions, encoded (postcard); empty for a cache in host memory.
pub fn device_export(cache: &Arc<KvCache>) -> Result<Vec<u8>, super::ipc::IpcError> {
    let Some(kv) = cache.device() else { return Ok(Vec::new()) };
    let export = ExportedKv::export(&kv.context(), &cache.regions())?;
    postcard::to_allocvec(&export).map_err(|e| super::ipc::IpcError::Encode(e.to_string()))
}

/// Whether process `pid` still exists (signal 0 checks without signalling).
fn process_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else { return false };
    // SAFETY: kill with signal 0 only checks that the process exists and may be signalled.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

impl TransferEngine for GpuTransferEngine {
    fn name(&self) -> &'static str {
        "gpu"
    }

    fn backend_for(&self, peer: &str) -> &'static str {
        match self.lock().get(peer) {
            Some(Route::Peer) => peer_engine::BACKEND,
            Some(Route::Ipc { .. }) => BACKEND_IPC,
            None => "gpu",
        }
    }

    /// Chooses the path now; for cuda-ipc that opens D's handles during the prefill.
    fn prepare<'a>(&'a self, peer: &'a str) -> BoxFuture<'a, Result<(), TransferError>> {
        Box::pin(async move { self.route(peer).await.map(|_| ()) })
    }

    fn write<'a>(&'a self, peer: &'a str, plan: &'a TransferPlan) -> BoxFuture<'a, Result<TransferStats, TransferError>> {
        Box::pin(self.write_plan(peer, plan))
    }
}
