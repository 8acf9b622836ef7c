//! [`GpuTransferEngine`]: the engine of a P node whose KV lives on a GPU, for seed step 29. Per
//! peer it takes the most direct path there is ([`GpuPath::Auto`]):
//!
//! - `cuda-peer` — D's GPU cache is in this process (registered under its data address,
//!   [`super::peer_engine`]): one gather/scatter launch under D's write fence;
//! - `cuda-ipc` — D is another process on this host: P asks D's data server for its device offer
//!   ([`DeviceOffer`], over the data connection's control request), opens D's CUDA IPC handles once
//!   per peer ([`super::ipc_engine`]) and writes each plan in one launch into D's mapping, every
//!   destination checked against D's exported regions, while D's data server holds the pull's
//!   write fence for it (P's hold is acked before the launch and released once the copy ended);
//! - `cuda-staged` — D is on another host, or its handles cannot be opened here: tcp through
//!   pinned host buffers to D's staged receiver ([`super::staged`]), under the same fence.
//!
//! [`GpuPath::Staged`] takes cuda-staged for every peer. The choice is made once per peer — during
//! the prefill when the pull comes early ([`TransferEngine::prepare`]) — and made again when D's
//! process is gone or its staged receiver fails (a D restarted at the same address offers new
//! handles and a new port). A D whose KV is in host memory offers nothing: the write is refused,
//! saying so.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;

use super::device_offer::DeviceOffer;
use super::ipc::{CudaIpcWriter, IpcError};
use super::ipc_engine::{CudaIpcEngine, JOIN_SLACK};
use super::peer_engine::{self, CudaPeerEngine};
use super::staged::{sender, StagedAuth, StagedConfig, StagedEngine, StagedSender};
use super::{CudaBatchCopy, CudaError};
use crate::same_host::host_identity;
use crate::tcp::{TcpConfig, TcpTransferEngine};
use crate::{GpuPath, TransferEngine, TransferError, TransferStats};
use pdflow_kv::memory::KvCache;
use pdflow_kv::planner::TransferPlan;

/// The backend name of the IPC path.
pub const BACKEND_IPC: &str = super::ipc_engine::BACKEND;
/// The backend name of the staged path.
pub const BACKEND_STAGED: &str = sender::BACKEND;

/// The least time a cuda-ipc write must have before the plan's `write_by` to be launched.
pub const WRITE_MARGIN: Duration = Duration::from_millis(50);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Route {
    Peer,
    /// Through CUDA IPC into D's process `pid`.
    Ipc {
        pid: u32,
    },
    /// Over tcp with pinned staging, to D's staged receiver at `addr`.
    Staged {
        addr: String,
    },
}

/// P's engine for GPU KV (see the module docs).
pub struct GpuTransferEngine {
    peer: CudaPeerEngine,
    ipc: CudaIpcEngine,
    staged: Arc<StagedSender>,
    /// Asks D's data server for its device offer and holds D's fence for cuda-ipc writes.
    control: TcpTransferEngine,
    path: GpuPath,
    routes: Mutex<HashMap<String, Route>>,
    /// One choice at a time per peer: a write that comes while the prepare still chooses (opens
    /// handles, warms the staged connections) waits for it instead of doing it all again.
    choosing: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl std::fmt::Debug for GpuTransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuTransferEngine").field("peer", &self.peer).field("path", &self.path).finish()
    }
}

impl GpuTransferEngine {
    /// An engine reading P's GPU cache `cache`; `tcp` gives the path policy (`gpu_path`), the
    /// write deadline, the connect deadline and the proofs (token, cluster secret, TLS) for D's
    /// data server and staged receiver.
    pub fn new(cache: &Arc<KvCache>, tcp: TcpConfig) -> Result<Self, CudaError> {
        let device = cache.device().cloned().ok_or(CudaError::NoDevice)?;
        let ctx = device.context();
        let peer = CudaPeerEngine::new(cache, tcp.write_timeout)?;
        let writer = CudaIpcWriter::new(CudaBatchCopy::new(&ctx)?, cache.regions());
        let config = StagedConfig { deadline: tcp.write_timeout, ..StagedConfig::default() };
        let staged = Arc::new(StagedSender::new(&ctx, cache.regions(), config).with_auth(StagedAuth::from_tcp(&tcp)));
        let path = tcp.gpu_path;
        let control = TcpTransferEngine::new(cache.region_table(), tcp);
        Ok(Self {
            peer,
            ipc: CudaIpcEngine::new(writer),
            staged,
            control,
            path,
            routes: Mutex::default(),
            choosing: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Route>> {
        // A cache of choices: a panicking holder cannot break it.
        self.routes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The path to `peer`: cached while D's process lives, else chosen afresh (once at a time).
    async fn route(&self, peer: &str) -> Result<Route, TransferError> {
        if let Some(route) = self.cached(peer) {
            return Ok(route);
        }
        let turn =
            self.choosing.lock().unwrap_or_else(PoisonError::into_inner).entry(peer.to_string()).or_default().clone();
        let _turn = turn.lock().await;
        // The choice that held the turn may have made it meanwhile.
        if let Some(route) = self.cached(peer) {
            return Ok(route);
        }
        let route = self.choose(peer).await?;
        self.lock().insert(peer.to_string(), route.clone());
        Ok(route)
    }

    /// The cached path to `peer`, unless it went to a D process that is gone.
    fn cached(&self, peer: &str) -> Option<Route> {
        let cached = self.lock().get(peer).cloned();
        match cached {
            Some(Route::Ipc { pid }) if !process_alive(pid) => {
                tracing::info!(%peer, pid, "D's process is gone: asking its data server for a new device offer");
                self.ipc.forget_peer(peer);
                self.lock().remove(peer);
                None
            }
            other => other,
        }
    }

    /// Forgets the path to `peer` after a failure that may mean D moved (restarted, receiver gone).
    fn forget(&self, peer: &str) {
        if let Some(Route::Staged { addr }) = self.lock().remove(peer) {
            self.staged.forget_peer(&addr);
        }
    }

    async fn choose(&self, peer: &str) -> Result<Route, TransferError> {
        if self.path == GpuPath::Auto && peer_engine::is_local_peer(peer) {
            return Ok(Route::Peer);
        }
        let refused = |reason: String| TransferError::Refused { peer: peer.to_string(), reason };
        let bytes = self.control.device_export(peer).await?;
        if bytes.is_empty() {
            return Err(refused(
                "D offers no device export: its KV is in host memory (P's is on a GPU; run both engines with GPU KV, or both with host KV)".into(),
            ));
        }
        let offer = DeviceOffer::decode(&bytes).map_err(refused)?;
        let staged = offer.staged_addr(peer);
        let why_staged = if self.path == GpuPath::Staged {
            "--gpu-path staged".to_string()
        } else if offer.host_id != host_identity() {
            format!("D is on another host ({} there, {} here)", offer.host_id, host_identity())
        } else if let Some(ipc) = offer.ipc.filter(|ipc| ipc.pid != std::process::id()) {
            match self.open_ipc(peer, ipc).await {
                Ok(pid) => return Ok(Route::Ipc { pid }),
                Err(TransferError::Refused { reason, .. }) => reason,
                Err(e) => return Err(e),
            }
        } else {
            "D offers no CUDA IPC handles P can open (its memory is not exportable, or D is this process without a local-peer registration)".to_string()
        };
        let Some(addr) = staged else {
            return Err(refused(format!("{why_staged}, and D runs no staged receiver: no GPU path to it")));
        };
        tracing::info!(%peer, staged = %addr, reason = %why_staged, "cuda-staged: writing D's GPU KV over tcp through pinned host buffers");
        self.warm_staged(peer, &addr).await?;
        Ok(Route::Staged { addr })
    }

    /// Opens D's CUDA IPC handles in P's context (bounded by the connect timeout); D's pid.
    async fn open_ipc(&self, peer: &str, export: super::ipc::ExportedKv) -> Result<u32, TransferError> {
        let pid = export.pid;
        let ipc = self.ipc.clone();
        let owned = peer.to_string();
        let limit = self.control.config().connect_timeout;
        let opened =
            tokio::time::timeout(limit, tokio::task::spawn_blocking(move || ipc.register_peer(&owned, &export))).await;
        let Ok(opened) = opened else {
            return Err(TransferError::Timeout { peer: peer.to_string(), deadline: limit });
        };
        match opened {
            Ok(Ok(())) => {
                tracing::debug!(%peer, pid, "cuda-ipc: D's KV handles opened");
                Ok(pid)
            }
            Ok(Err(e)) => Err(TransferError::Refused {
                peer: peer.to_string(),
                reason: format!("D's CUDA IPC handles cannot be opened here ({e})"),
            }),
            Err(join) => Err(TransferError::Io {
                peer: peer.to_string(),
                source: std::io::Error::other(format!("opening D's handles: {join}")),
            }),
        }
    }

    /// Opens the staged connections (and their pinned rings) to D's receiver ahead of the write.
    async fn warm_staged(&self, peer: &str, addr: &str) -> Result<(), TransferError> {
        let (staged, owned) = (self.staged.clone(), addr.to_string());
        let limit = self.control.config().connect_timeout;
        match tokio::time::timeout(limit, tokio::task::spawn_blocking(move || staged.warm(&owned))).await {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(e))) => Err(sender::to_transfer_error(addr, e)),
            Ok(Err(join)) => Err(TransferError::Io {
                peer: peer.to_string(),
                source: std::io::Error::other(format!("opening D's staged connections: {join}")),
            }),
            Err(_) => Err(TransferError::Timeout { peer: addr.to_string(), deadline: limit }),
        }
    }

    async fn write_plan(&self, peer: &str, plan: &TransferPlan) -> Result<TransferStats, TransferError> {
        let route = self.route(peer).await?;
        match route {
            Route::Peer => self.peer.write(peer, plan).await,
            Route::Ipc { .. } => self.write_ipc(peer, plan).await,
            Route::Staged { addr } => {
                let written = StagedEngine(self.staged.clone()).write(&addr, plan).await;
                if matches!(written, Err(TransferError::Connect { .. } | TransferError::Io { .. })) {
                    self.forget(peer);
                }
                written
            }
        }
    }

    /// One cuda-ipc write under D's fence: hold (acked), one launch, release once the copy task
    /// ended — also when P stops waiting for it, so D does not free blocks a launched copy still
    /// writes. (A kernel stuck past the copy's own deadline is released with that error: D's
    /// drain deadline bounds its wait for it either way.)
    async fn write_ipc(&self, peer: &str, plan: &TransferPlan) -> Result<TransferStats, TransferError> {
        if let Some(write_by) = plan.write_by {
            let left = write_by.saturating_duration_since(Instant::now());
            if left < WRITE_MARGIN {
                // D gives the blocks up before the copy could end: do not start it.
                return Err(TransferError::Timeout { peer: peer.to_string(), deadline: left });
            }
        }
        // The checks, translation and descriptor upload run while the hold's round trip is in
        // flight; the launch waits for D's ack.
        let (held_tx, held_rx) = std::sync::mpsc::sync_channel::<bool>(1);
        let wait_for_hold = self.control.config().connect_timeout + JOIN_SLACK;
        let (ipc, owned_peer, owned_plan) = (self.ipc.clone(), peer.to_string(), plan.clone());
        let mut copy = tokio::task::spawn_blocking(move || {
            ipc.write_blocking_when(&owned_peer, &owned_plan, || match held_rx.recv_timeout(wait_for_hold) {
                Ok(true) => Ok(()),
                _ => Err(IpcError::NotLaunched("D's data server did not hold the pull's fence".into())),
            })
        });
        let hold = match self.control.hold_fence(peer, plan.fence).await {
            Ok(hold) => {
                let _ = held_tx.send(true);
                hold
            }
            Err(e) => {
                let _ = held_tx.send(false);
                // Nothing is launched; the task hands its descriptor table back and ends (it
                // may still wait for a blocking thread: bounded, then left to finish).
                let _ = tokio::time::timeout(wait_for_hold, copy).await;
                return Err(e);
            }
        };
        let deadline = self.ipc.writer().deadline + JOIN_SLACK;
        match tokio::time::timeout(deadline, &mut copy).await {
            Ok(joined) => {
                if let Err(e) = hold.release().await {
                    tracing::debug!(%peer, error = %e, "the fence release did not leave: D releases when the connection closes");
                }
                joined.unwrap_or_else(|join| {
                    Err(TransferError::Io {
                        peer: peer.to_string(),
                        source: std::io::Error::other(format!("cuda-ipc write task failed: {join}")),
                    })
                })
            }
            Err(_) => {
                // Keeps the hold until the copy task ends; that task is bounded by the copy's own
                // deadline (its completion wait), and the release by the connect timeout.
                tokio::spawn(async move {
                    let _ = copy.await;
                    let _ = hold.release().await;
                });
                Err(TransferError::Timeout { peer: peer.to_string(), deadline })
            }
        }
    }
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
            Some(Route::Staged { .. }) => BACKEND_STAGED,
            None => "gpu",
        }
    }

    /// Chooses the path now; for cuda-ipc that opens D's handles during the prefill, for
    /// cuda-staged it opens the connections and their pinned buffers.
    fn prepare<'a>(&'a self, peer: &'a str) -> BoxFuture<'a, Result<(), TransferError>> {
        Box::pin(async move { self.route(peer).await.map(|_| ()) })
    }

    fn write<'a>(
        &'a self,
        peer: &'a str,
        plan: &'a TransferPlan,
    ) -> BoxFuture<'a, Result<TransferStats, TransferError>> {
        Box::pin(self.write_plan(peer, plan))
    }
}
