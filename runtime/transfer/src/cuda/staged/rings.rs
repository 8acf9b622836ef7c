//! Staging rings for both sides of the staged path: a [`RingPool`] pins rings (a connection's
//! `depth` pinned buffers and their events) once and lends them to connections; a ring comes back
//! when its connection ends, once the connection's CUDA stream has finished every copy through
//! it. Pinning a 16 MiB ring takes milliseconds, so a new connection — P's after D restarted, D's
//! for a new P — should not pay for it on a write's path.

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::CudaStream;

use super::{ring, Slot, StagedConfig};
use crate::cuda::{CudaContext, CudaError};

/// The most idle rings a pool keeps pinned.
pub const MAX_SPARE_RINGS: usize = 16;

/// Rings of one shape (`config.chunk_bytes` × `config.depth`) in one context.
pub(crate) struct RingPool {
    ctx: Arc<CudaContext>,
    config: StagedConfig,
    spares: Mutex<Vec<Vec<Slot>>>,
}

impl RingPool {
    pub fn new(ctx: &Arc<CudaContext>, config: StagedConfig) -> Arc<Self> {
        Arc::new(Self { ctx: ctx.clone(), config, spares: Mutex::default() })
    }

    fn spares(&self) -> std::sync::MutexGuard<'_, Vec<Vec<Slot>>> {
        // A list of idle rings: a panicking holder leaves nothing half-done.
        self.spares.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Pins rings until `n` are idle (at most [`MAX_SPARE_RINGS`]).
    pub fn prepin(&self, n: usize) -> Result<(), CudaError> {
        let have = self.spares().len();
        let made =
            (have..n.min(MAX_SPARE_RINGS)).map(|_| ring(&self.ctx, &self.config)).collect::<Result<Vec<_>, _>>()?;
        self.spares().extend(made);
        Ok(())
    }

    /// Rings pinned and lent to nobody.
    pub fn idle(&self) -> usize {
        self.spares().len()
    }

    /// A new CUDA stream and an idle ring (pinned now when none is idle), for one connection.
    pub fn lend(self: &Arc<Self>) -> Result<LentRing, CudaError> {
        let stream = self.ctx.new_stream()?;
        let spare = self.spares().pop();
        let ring = match spare {
            Some(ring) => ring,
            None => ring(&self.ctx, &self.config)?,
        };
        Ok(LentRing { pool: self.clone(), stream, ring })
    }
}

/// One connection's stream and ring; the ring goes back to its pool on drop.
pub(crate) struct LentRing {
    pool: Arc<RingPool>,
    pub stream: Arc<CudaStream>,
    pub ring: Vec<Slot>,
}

impl Drop for LentRing {
    fn drop(&mut self) {
        if self.stream.synchronize().is_err() {
            return; // the context is broken: the buffers are not safe to hand on
        }
        let mut spares = self.pool.spares();
        if spares.len() < MAX_SPARE_RINGS {
            spares.push(std::mem::take(&mut self.ring));
        }
    }
}
