//! [`CudaIpcEngine`]: the [`TransferEngine`] over CUDA IPC. P registers each peer's
//! [`ExportedKv`] once under the peer's data address ([`CudaIpcEngine::register_peer`] opens the
//! handles in P's context); `write(peer, plan)` then checks every descriptor against both sides'
//! regions, translates D's addresses into P's mapping, runs the whole plan as one launch of the
//! gather/scatter kernel and waits, under a deadline, until the bytes are in D's memory.
//!
//! Owns seed step 29 (P writes the request's blocks into D's regions) when P and D are processes
//! on GPUs of one host. Step 28's plan arrives as for any backend, destinations in D's addresses as
//! D published them (step 21). The GPU work is blocking, so each write runs on tokio's blocking pool.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::future::BoxFuture;

use super::ipc::{CudaIpcWriter, ExportedKv, ImportedKv, IpcError};
use crate::{TransferEngine, TransferError, TransferStats};
use pdflow_kv::planner::TransferPlan;

/// The backend name this engine reports (`name`, `backend_for`).
pub const BACKEND: &str = "cuda-ipc";

/// Slack on top of the writer's own deadline before the blocking task is given up on.
pub(crate) const JOIN_SLACK: Duration = Duration::from_secs(5);

/// P's CUDA IPC transfer engine: one [`CudaIpcWriter`] (P's GPU and regions) and the peers opened.
#[derive(Clone)]
pub struct CudaIpcEngine {
    writer: Arc<CudaIpcWriter>,
    /// Peer data address (`host:port`, the `peer` of `write`) → D's allocations opened in P.
    peers: Arc<Mutex<HashMap<String, Arc<ImportedKv>>>>,
}

impl std::fmt::Debug for CudaIpcEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaIpcEngine").field("peers", &self.peers()).finish()
    }
}

impl CudaIpcEngine {
    /// `writer`: P's copier and P's KV regions (the only valid sources).
    pub fn new(writer: CudaIpcWriter) -> Self {
        Self { writer: Arc::new(writer), peers: Arc::default() }
    }

    /// Opens `export` (D's IPC handles) in P's context and serves writes to `peer` with it from now
    /// on, replacing (and closing, once no write uses it) any earlier registration of `peer`.
    pub fn register_peer(&self, peer: &str, export: &ExportedKv) -> Result<(), IpcError> {
        let imported = Arc::new(ImportedKv::open(self.writer.copier().context(), export)?);
        self.lock().insert(peer.to_string(), imported);
        Ok(())
    }

    /// Stops serving `peer` (its handles close once no write uses them); whether it was registered.
    pub fn forget_peer(&self, peer: &str) -> bool {
        self.lock().remove(peer).is_some()
    }

    /// Whether writes to `peer` can go through CUDA IPC.
    pub fn has_peer(&self, peer: &str) -> bool {
        self.lock().contains_key(peer)
    }

    /// The registered peers, sorted.
    pub fn peers(&self) -> Vec<String> {
        let mut peers: Vec<String> = self.lock().keys().cloned().collect();
        peers.sort();
        peers
    }

    pub fn writer(&self) -> &CudaIpcWriter {
        &self.writer
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<ImportedKv>>> {
        // The map stays consistent under a panic (one insert or remove): keep using it.
        self.peers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The blocking write: checks, translation, one launch, the completion wait.
    pub fn write_blocking(&self, peer: &str, plan: &TransferPlan) -> Result<TransferStats, TransferError> {
        self.write_blocking_when(peer, plan, || Ok(()))
    }

    /// As [`Self::write_blocking`], launching only once `go` allowed it
    /// ([`CudaIpcWriter::write_when`]).
    pub fn write_blocking_when(
        &self,
        peer: &str,
        plan: &TransferPlan,
        go: impl FnOnce() -> Result<(), IpcError>,
    ) -> Result<TransferStats, TransferError> {
        let imported = self.lock().get(peer).cloned().ok_or_else(|| unregistered(peer))?;
        self.writer.write_when(&imported, plan, go).map_err(|e| to_transfer_error(peer, e))
    }
}

/// The error for a peer no export was registered for.
pub fn unregistered(peer: &str) -> TransferError {
    TransferError::SameHostUnavailable {
        peer: peer.to_string(),
        reason: format!("no CUDA IPC export is registered for {peer}: register D's ExportedKv (CudaIpcEngine::register_peer) before writing"),
    }
}

/// How an IPC failure reads to the transfer layer: a bad source is P's region error, a bad
/// destination is a refusal (the same verdict D's data server gives on tcp), the deadline a
/// timeout, anything from the driver an I/O failure of the path (the destination is undefined).
pub fn to_transfer_error(peer: &str, e: IpcError) -> TransferError {
    let peer = peer.to_string();
    match e {
        IpcError::SourceOutOfRegion { source, .. } => TransferError::LocalRegion(source),
        IpcError::DestinationOutOfRegion { .. } => TransferError::Refused { peer, reason: e.to_string() },
        IpcError::Timeout { deadline } => TransferError::Timeout { peer, deadline },
        other => TransferError::Io { peer, source: std::io::Error::other(format!("cuda-ipc: {other}")) },
    }
}

impl TransferEngine for CudaIpcEngine {
    fn name(&self) -> &'static str {
        BACKEND
    }

    fn backend_for(&self, _peer: &str) -> &'static str {
        BACKEND
    }

    fn write<'a>(
        &'a self,
        peer: &'a str,
        plan: &'a TransferPlan,
    ) -> BoxFuture<'a, Result<TransferStats, TransferError>> {
        Box::pin(async move {
            let (engine, owned_peer, plan) = (self.clone(), peer.to_string(), plan.clone());
            let deadline = self.writer.deadline + JOIN_SLACK;
            let task = tokio::task::spawn_blocking(move || engine.write_blocking(&owned_peer, &plan));
            match tokio::time::timeout(deadline, task).await {
                Ok(Ok(result)) => result,
                Ok(Err(join)) => Err(TransferError::Io {
                    peer: peer.to_string(),
                    source: std::io::Error::other(format!("cuda-ipc write task failed: {join}")),
                }),
                Err(_) => Err(TransferError::Timeout { peer: peer.to_string(), deadline }),
            }
        })
    }
}
