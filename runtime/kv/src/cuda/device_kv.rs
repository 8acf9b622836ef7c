//! A KV cache in GPU memory: [`DeviceKv`] owns (or wraps) one device allocation per layer in vLLM
//! 0.33's layout, reads blocks back to the host by one gather launch and one device→host copy (a
//! model's digest, and the checksums of steps 29 and 34), and runs an engine's own kernel on its
//! regions ([`DeviceKv::with_kernel`]: the simulated engine's KV fill, seed steps 15 and 39) under
//! the same lock, since they share the stream.
//!
//! [`crate::memory::KvCache::new_cuda`] wraps it: the cache's regions are then device addresses,
//! which host code refuses to touch, and only the cuda engines move them.

use std::any::Any;
use std::sync::{Arc, Mutex, PoisonError};

use pdflow_messages::BlockId;

use super::{CudaBatchCopy, CudaContext, CudaError, DeviceBuffer};
use crate::memory::{KvShape, RegionError};
use crate::planner::{Descriptor, TransferPlan};

/// Where a cache's blocks are, as a kernel run by [`DeviceKv::with_kernel`] sees them.
#[derive(Debug, Clone)]
pub struct Regions {
    /// The device address of each layer's region.
    pub layer_bases: Vec<u64>,
    /// Blocks per region.
    pub num_blocks: usize,
    pub shape: KvShape,
}

/// The device side of a GPU-resident KV cache (see the module docs).
pub struct DeviceKv {
    ordinal: usize,
    shape: KvShape,
    num_blocks: usize,
    /// The device address of each layer's region.
    bases: Vec<u64>,
    /// The allocations behind `bases` when this cache made them (empty for memory registered
    /// from outside, e.g. vLLM's KV tensors, which their owner keeps alive).
    _owned: Vec<DeviceBuffer>,
    /// The kernels, serialised: the engine's forward and the actors' checksums share the stream.
    kernels: Mutex<Kernels>,
}

struct Kernels {
    /// The engine's kernel ([`DeviceKv::with_kernel`]), made on first use.
    engine: Option<Box<dyn Any + Send>>,
    gather: CudaBatchCopy,
    /// Reused by every read-back: the gather's descriptor table and its staging buffer (grown
    /// when a read needs more), so a read allocates and frees nothing once warm.
    table: Option<super::UploadedPlan>,
    staging: Option<DeviceBuffer>,
}

impl std::fmt::Debug for DeviceKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceKv").field("device", &self.ordinal).field("num_blocks", &self.num_blocks).finish()
    }
}

impl DeviceKv {
    /// Allocates `num_blocks` zeroed blocks of `shape` per layer on device `ordinal` and compiles
    /// the kernels there.
    pub fn new(shape: KvShape, num_blocks: usize, ordinal: usize) -> Result<Self, CudaError> {
        let count = super::device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        let region_len = num_blocks * shape.block_len();
        let layers = (0..shape.num_layers)
            .map(|_| {
                let buf = DeviceBuffer::new(&ctx, region_len)?;
                buf.fill(0)?;
                Ok(buf)
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        let bases = layers.iter().map(|l: &DeviceBuffer| l.ptr).collect();
        Self::with_kernels(&ctx, ordinal, shape, num_blocks, bases, layers)
    }

    /// Wraps memory someone else allocated on device `ordinal` (the bridge: vLLM's per-layer KV
    /// tensors): one region of `num_blocks` blocks of `shape` at each of `bases`. Every region is
    /// checked to lie inside one live allocation of that device.
    ///
    /// # Safety
    /// The memory must stay allocated for as long as this lives (its owner outlives the cache),
    /// and only the holder of a block may touch its bytes while pdflow reads or writes them.
    pub unsafe fn external(
        shape: KvShape,
        num_blocks: usize,
        ordinal: usize,
        bases: Vec<u64>,
    ) -> Result<Self, CudaError> {
        let count = super::device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        ctx.bind_to_thread()?;
        let region_len = (num_blocks * shape.block_len()) as u64;
        for &base in &bases {
            let (mut start, mut size) = (0u64, 0usize);
            // SAFETY: out-pointers to locals; the driver checks the address against this context.
            super::check(unsafe { cudarc::driver::sys::cuMemGetAddressRange_v2(&mut start, &mut size, base) })
                .map_err(|e| CudaError::NotDeviceMemory { addr: base, ordinal, reason: e.to_string() })?;
            let mut on: i32 = -1;
            // SAFETY: out-pointer to a local of the attribute's type (int).
            super::check(unsafe {
                cudarc::driver::sys::cuPointerGetAttribute(
                    (&mut on as *mut i32).cast(),
                    cudarc::driver::sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    base,
                )
            })?;
            if usize::try_from(on).ok() != Some(ordinal) {
                return Err(CudaError::NotDeviceMemory { addr: base, ordinal, reason: format!("it is on GPU {on}") });
            }
            if base.saturating_add(region_len) > start.saturating_add(size as u64) {
                return Err(CudaError::OutOfBounds { offset: base - start, len: region_len, size: size as u64 });
            }
        }
        Self::with_kernels(&ctx, ordinal, shape, num_blocks, bases, Vec::new())
    }

    fn with_kernels(
        ctx: &Arc<CudaContext>,
        ordinal: usize,
        shape: KvShape,
        num_blocks: usize,
        bases: Vec<u64>,
        owned: Vec<DeviceBuffer>,
    ) -> Result<Self, CudaError> {
        let kernels = Kernels { engine: None, gather: CudaBatchCopy::new(ctx)?, table: None, staging: None };
        Ok(Self { ordinal, shape, num_blocks, bases, _owned: owned, kernels: Mutex::new(kernels) })
    }

    /// The GPU this cache lives on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device address of each layer's region.
    pub fn layer_bases(&self) -> Vec<u64> {
        self.bases.clone()
    }

    /// The context the allocations belong to.
    pub fn context(&self) -> Arc<CudaContext> {
        self.lock().gather.context().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Kernels> {
        // The kernels hold no state a panicking launch could leave half-done.
        self.kernels.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs an engine's kernel `K` on this cache's regions, serialised with every other launch on
    /// it; `K` is made by `make` on first use (and again if another kernel type took its place).
    pub fn with_kernel<K: Any + Send, R>(
        &self,
        make: impl FnOnce(&Arc<CudaContext>) -> Result<K, CudaError>,
        run: impl FnOnce(&mut K, &Regions) -> Result<R, CudaError>,
    ) -> Result<R, RegionError> {
        let regions = Regions { layer_bases: self.bases.clone(), num_blocks: self.num_blocks, shape: self.shape };
        let mut guard = self.lock();
        let kernels = &mut *guard;
        if !kernels.engine.as_ref().is_some_and(|k| k.is::<K>()) {
            let made = make(kernels.gather.context()).map_err(|e| self.refusal(e))?;
            kernels.engine = Some(Box::new(made));
        }
        let Some(kernel) = kernels.engine.as_mut().and_then(|k| k.downcast_mut::<K>()) else {
            return Err(self.refusal(CudaError::Compile("the engine kernel was not kept".into())));
        };
        run(kernel, &regions).map_err(|e| self.refusal(e))
    }

    /// The bytes of `blocks` over every layer, region-major (layer 0's blocks in order, then layer
    /// 1's, …): one gather launch into a staging buffer, then one copy to the host.
    pub fn read_blocks(&self, blocks: &[BlockId]) -> Result<Vec<u8>, RegionError> {
        let block_len = self.shape.block_len() as u64;
        if let Some(&block) = blocks.iter().find(|&&b| b as usize >= self.num_blocks) {
            return Err(RegionError::BlockOutOfRange { block, num_blocks: self.num_blocks });
        }
        let total = block_len * (blocks.len() * self.bases.len()) as u64;
        let mut out = vec![0u8; total as usize];
        if total == 0 {
            return Ok(out);
        }
        let mut guard = self.lock();
        let kernels = &mut *guard;
        let staging = match kernels.staging.take() {
            Some(buf) if buf.len as u64 >= total => buf,
            // Too small (or none yet): freed before the larger one is allocated.
            _ => DeviceBuffer::new(kernels.gather.context(), total as usize).map_err(|e| self.refusal(e))?,
        };
        let descriptors = self
            .bases
            .iter()
            .flat_map(|&base| blocks.iter().map(move |&b| base + u64::from(b) * block_len))
            .enumerate()
            .map(|(i, src)| Descriptor { src, dst: staging.ptr + i as u64 * block_len, len: block_len })
            .collect();
        let plan = TransferPlan { descriptors, fence: 0, write_by: None, grant: None };
        let uploaded = kernels.gather.upload_reusing(&plan, kernels.table.take()).map_err(|e| self.refusal(e))?;
        kernels.gather.execute(&uploaded).map_err(|e| self.refusal(e))?;
        kernels.table = Some(uploaded);
        let read = staging.read(0, &mut out).map_err(|e| self.refusal(e));
        kernels.staging = Some(staging);
        read?;
        Ok(out)
    }

    /// A device failure, as the cache's callers see it (the range could not be used).
    fn refusal(&self, e: CudaError) -> RegionError {
        tracing::warn!(device = self.ordinal, "GPU KV operation failed: {e}");
        RegionError::Device { device: self.ordinal, reason: e.to_string() }
    }
}
