//! The tokio runtime behind one connector object, created lazily in the process that uses it and
//! never carried across a fork (vLLM may fork its workers: a runtime's threads do not survive one).
//!
//! The scheduler role runs on a current-thread runtime: its actor has no background work, so each
//! hook drives it on the caller's thread (no cross-thread wake-up per call). The worker role runs
//! on a small multi-thread runtime: its actors serve sockets between vLLM's calls.

use std::future::Future;

use crate::error::BridgeError;

/// A runtime bound to the process that created it.
pub struct BridgeRuntime {
    /// Always `Some` until drop.
    rt: Option<tokio::runtime::Runtime>,
    pid: u32,
}

impl BridgeRuntime {
    /// A runtime driven only by the calling thread (scheduler role).
    pub fn current_thread() -> Result<Self, BridgeError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| BridgeError::unavailable("tokio runtime", e))?;
        Ok(Self { rt: Some(rt), pid: std::process::id() })
    }

    /// A runtime with its own `workers` threads (worker role: sockets served between calls).
    pub fn multi_thread(workers: usize, name: &str) -> Result<Self, BridgeError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers.max(1))
            .thread_name(name)
            .enable_all()
            .build()
            .map_err(|e| BridgeError::unavailable("tokio runtime", e))?;
        Ok(Self { rt: Some(rt), pid: std::process::id() })
    }

    /// Runs `f` to completion on this runtime, from the calling (non-runtime) thread.
    pub fn block_on<F: Future>(&self, f: F) -> Result<F::Output, BridgeError> {
        let current = std::process::id();
        if current != self.pid {
            return Err(BridgeError::ForeignProcess { owner: self.pid, current });
        }
        let rt = self.rt.as_ref().ok_or_else(|| BridgeError::unavailable("tokio runtime", "already shut down"))?;
        Ok(rt.block_on(f))
    }

    /// Whether this runtime was created in the calling process.
    pub fn is_local(&self) -> bool {
        std::process::id() == self.pid
    }
}

impl Drop for BridgeRuntime {
    fn drop(&mut self) {
        if !self.is_local() {
            // A forked child inherited this runtime without its threads: shutting it down would
            // wait for threads that do not exist here. Leak it; the parent still owns the real one.
            std::mem::forget(self.rt.take());
        }
    }
}
