//! Device memory for GPU-resident KV (behind the `cuda` feature): the driver and NVRTC loaded at
//! run time (cudarc's dynamic loading, so this builds and its tests skip on machines without
//! CUDA), device buffers, and the gather/scatter copy kernel compiled at run time with NVRTC that
//! executes a whole transfer plan (seed step 28's descriptors, device addresses on both sides) as
//! ONE launch, plus the two references it is measured against: one driver copy per descriptor and
//! one peer copy of the same bytes (the ceiling). [`device_kv`] is a KV cache in GPU memory built
//! on them. The engines that move such caches between engines and hosts are in `pdflow-transfer`.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaFunction, DriverError, LaunchConfig, PushKernelArg};
pub use cudarc::driver::{CudaContext, CudaStream};

use crate::planner::TransferPlan;

pub mod device_kv;
mod kernel;

/// Why the cuda path cannot run.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver could be loaded (libcuda.so): this machine has no NVIDIA GPU or driver")]
    NoDriver,
    #[error("NVRTC (libnvrtc.so) could not be loaded: put the CUDA toolkit's lib64 on LD_LIBRARY_PATH")]
    NoNvrtc,
    #[error("the CUDA driver sees no GPU")]
    NoDevice,
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] DriverError),
    #[error("NVRTC failed to compile the gather/scatter kernel: {0}")]
    Compile(String),
    #[error("read of {len} bytes at offset {offset} overruns a {size}-byte device buffer")]
    OutOfBounds { offset: u64, len: u64, size: u64 },
    #[error("GPU {src} cannot access GPU {dst} as a peer: no NVLink/PCIe peer path between them")]
    NoPeerAccess { src: usize, dst: usize },
    #[error("GPU {ordinal} does not exist: the driver sees {count} GPU(s) (check --device and CUDA_VISIBLE_DEVICES)")]
    NoSuchDevice { ordinal: usize, count: usize },
    #[error("address {addr:#x} is not device memory of GPU {ordinal}: {reason}")]
    NotDeviceMemory { addr: u64, ordinal: usize, reason: String },
}

/// The number of GPUs, or why the cuda path cannot run here (tests skip on `Err`).
pub fn device_count() -> Result<usize, CudaError> {
    // SAFETY: only probes whether the shared library can be opened.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    result::init()?;
    let n = CudaContext::device_count()?;
    if n <= 0 {
        return Err(CudaError::NoDevice);
    }
    Ok(n as usize)
}

/// Whether NVRTC can be loaded (needed to build the kernel).
pub fn nvrtc_available() -> bool {
    // SAFETY: only probes whether the shared library can be opened.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Turns a raw driver status into a `Result`.
pub fn check(status: sys::CUresult) -> Result<(), CudaError> {
    if status == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Driver(DriverError(status)))
    }
}

/// Lets each context map the other's memory (idempotent: "already enabled" is fine).
pub fn enable_peer_access(a: &Arc<CudaContext>, b: &Arc<CudaContext>) -> Result<(), CudaError> {
    for (from, to) in [(a, b), (b, a)] {
        let mut can = 0;
        // SAFETY: out-pointer to a local; devices come from live contexts.
        check(unsafe { sys::cuDeviceCanAccessPeer(&mut can, from.cu_device(), to.cu_device()) })?;
        if can == 0 {
            return Err(CudaError::NoPeerAccess { src: from.ordinal(), dst: to.ordinal() });
        }
        from.bind_to_thread()?;
        // SAFETY: `to` is a live context.
        let status = unsafe { sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0) };
        if status != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            check(status)?;
        }
    }
    Ok(())
}

/// One device allocation, freed on drop (raw, so its address can go into descriptors).
pub struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    pub ptr: u64,
    pub len: usize,
}

impl DeviceBuffer {
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, CudaError> {
        ctx.bind_to_thread()?;
        // SAFETY: plain allocation in a bound context.
        let ptr = unsafe { result::malloc_sync(len.max(1)) }?;
        Ok(Self { ctx: ctx.clone(), ptr, len })
    }

    /// Copies `dst.len()` bytes at `offset` to the host (synchronous).
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), CudaError> {
        if offset.checked_add(dst.len() as u64).is_none_or(|end| end > self.len as u64) {
            return Err(CudaError::OutOfBounds { offset, len: dst.len() as u64, size: self.len as u64 });
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: bounds checked above.
        unsafe { result::memcpy_dtoh_sync(dst, self.ptr + offset) }?;
        Ok(())
    }

    /// Sets every byte to `value` and waits for it.
    pub fn fill(&self, value: u8) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: the whole allocation.
        unsafe { result::memset_d8_sync(self.ptr, value, self.len) }?;
        // cuMemsetD8 on device memory returns before it is done: wait, so that another GPU's
        // writes that follow cannot land before the memset.
        self.ctx.synchronize()?;
        Ok(())
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `new`, freed once.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// A plan's descriptor arrays on the device, cut into chunks of at most `CHUNK` bytes: one
/// allocation of `3 × capacity` words (sources, destinations, lengths), reusable for any later
/// plan of at most `capacity` chunks ([`CudaBatchCopy::upload_reusing`]) — no device allocation
/// or free (which synchronises the GPU) on a write's path once it is warm.
pub struct UploadedPlan {
    table: DeviceBuffer,
    capacity: u32,
    pub chunks: u32,
    pub descriptors: usize,
    pub bytes: u64,
}

impl UploadedPlan {
    fn src(&self) -> u64 {
        self.table.ptr
    }
    fn dst(&self) -> u64 {
        self.table.ptr + 8 * u64::from(self.capacity)
    }
    fn len(&self) -> u64 {
        self.table.ptr + 16 * u64::from(self.capacity)
    }
}

/// The largest slice of one descriptor that one thread block copies.
pub const CHUNK: u64 = 64 * 1024;

/// Executes transfer plans as one kernel launch on `ctx`'s GPU (which reads or writes the peer
/// GPU through peer access: launched on P's GPU it pushes, on D's it pulls).
pub struct CudaBatchCopy {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    copy: CudaFunction,
    fill: CudaFunction,
    pub blocks_per_sm: u32,
    sms: u32,
    pub threads: u32,
}

impl CudaBatchCopy {
    /// Compiles the kernels with NVRTC and loads them into `ctx`.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        if !nvrtc_available() {
            return Err(CudaError::NoNvrtc);
        }
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(
            kernel::SOURCE,
            cudarc::nvrtc::CompileOptions { name: Some("pdflow_copy.cu".into()), ..Default::default() },
        )
        .map_err(|e| CudaError::Compile(format!("{e:?}")))?;
        let module = ctx.load_module(ptx)?;
        let sms = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        Ok(Self {
            ctx: ctx.clone(),
            stream: ctx.default_stream(),
            copy: module.load_function("pdflow_gather_scatter")?,
            fill: module.load_function("pdflow_fill")?,
            blocks_per_sm: 4,
            sms: sms.max(1),
            threads: 512,
        })
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Uploads the plan's descriptors once (cut into `CHUNK`-sized work items).
    pub fn upload(&self, plan: &TransferPlan) -> Result<UploadedPlan, CudaError> {
        self.upload_reusing(plan, None)
    }

    /// As [`CudaBatchCopy::upload`], into `spare`'s device memory when it holds enough room (a
    /// plan uploaded earlier on this copier, no longer in flight); else into a new allocation
    /// with room to spare for the next plans.
    pub fn upload_reusing(&self, plan: &TransferPlan, spare: Option<UploadedPlan>) -> Result<UploadedPlan, CudaError> {
        let (mut src, mut dst, mut len) = (Vec::new(), Vec::new(), Vec::new());
        for d in &plan.descriptors {
            let mut off = 0;
            while off < d.len {
                let n = CHUNK.min(d.len - off);
                src.push(d.src + off);
                dst.push(d.dst + off);
                len.push(n);
                off += n;
            }
        }
        let chunks = u32::try_from(src.len()).map_err(|_| CudaError::OutOfBounds {
            offset: 0,
            len: src.len() as u64,
            size: u64::from(u32::MAX),
        })?;
        let (table, capacity) = match spare {
            Some(s) if s.capacity >= chunks && Arc::ptr_eq(&s.table.ctx, &self.ctx) => (s.table, s.capacity),
            _ => {
                let capacity = chunks.max(64).checked_next_power_of_two().unwrap_or(chunks);
                (DeviceBuffer::new(&self.ctx, 3 * capacity as usize * 8)?, capacity)
            }
        };
        let uploaded =
            UploadedPlan { table, capacity, chunks, descriptors: plan.descriptors.len(), bytes: plan.total_bytes() };
        self.ctx.bind_to_thread()?;
        for (at, words) in [(uploaded.src(), &src), (uploaded.dst(), &dst), (uploaded.len(), &len)] {
            if !words.is_empty() {
                // SAFETY: each array holds `capacity >= chunks` words of the table.
                unsafe { result::memcpy_htod_sync(at, &words[..]) }?;
            }
        }
        Ok(uploaded)
    }

    /// Enqueues the whole plan as one launch on this copier's stream (asynchronous).
    pub fn launch(&self, plan: &UploadedPlan) -> Result<(), CudaError> {
        if plan.chunks == 0 {
            return Ok(());
        }
        let grid = plan.chunks.min(self.sms * self.blocks_per_sm);
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (self.threads, 1, 1), shared_mem_bytes: 0 };
        let mut b = self.stream.launch_builder(&self.copy);
        let (src, dst, len) = (plan.src(), plan.dst(), plan.len());
        b.arg(&src).arg(&dst).arg(&len).arg(&plan.chunks);
        // SAFETY: the descriptor arrays hold `chunks` entries; the caller built the plan from
        // regions it allocated (the region checks happen when the plan is built).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Runs the plan and waits for it.
    pub fn execute(&self, plan: &UploadedPlan) -> Result<(), CudaError> {
        self.launch(plan)?;
        self.stream.synchronize()?;
        Ok(())
    }

    /// Writes a deterministic pattern (word `i` of the buffer = hash(seed, i)) into `buf`.
    pub fn fill_pattern(&self, buf: &DeviceBuffer, seed: u64) -> Result<(), CudaError> {
        let words = (buf.len / 8) as u64;
        let cfg = LaunchConfig { grid_dim: (self.sms * 8, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut b = self.stream.launch_builder(&self.fill);
        b.arg(&buf.ptr).arg(&words).arg(&seed);
        // SAFETY: writes `words` u64s inside `buf`.
        unsafe { b.launch(cfg) }?;
        self.stream.synchronize()?;
        Ok(())
    }
}

/// One driver copy per descriptor (`cuMemcpyPeerAsync`), enqueued on `stream` (the baseline).
pub fn copy_per_descriptor(
    stream: &CudaStream,
    src_ctx: &CudaContext,
    dst_ctx: &CudaContext,
    plan: &TransferPlan,
) -> Result<(), CudaError> {
    stream.context().bind_to_thread()?;
    for d in &plan.descriptors {
        // SAFETY: descriptors lie inside regions both contexts allocated.
        check(unsafe {
            sys::cuMemcpyPeerAsync(d.dst, dst_ctx.cu_ctx(), d.src, src_ctx.cu_ctx(), d.len as usize, stream.cu_stream())
        })?;
    }
    Ok(())
}

/// One peer copy of `bytes` (the ceiling), enqueued on `stream`.
pub fn copy_peer(
    stream: &CudaStream,
    src_ctx: &CudaContext,
    src: u64,
    dst_ctx: &CudaContext,
    dst: u64,
    bytes: u64,
) -> Result<(), CudaError> {
    stream.context().bind_to_thread()?;
    // SAFETY: both ranges lie inside buffers the caller allocated.
    check(unsafe {
        sys::cuMemcpyPeerAsync(dst, dst_ctx.cu_ctx(), src, src_ctx.cu_ctx(), bytes as usize, stream.cu_stream())
    })
}

/// One driver copy per descriptor within `stream`'s context, addresses as that context sees them
/// (unified addressing: IPC-mapped peer memory included): the IPC path's baseline.
pub fn copy_per_descriptor_uva(stream: &CudaStream, plan: &TransferPlan) -> Result<(), CudaError> {
    stream.context().bind_to_thread()?;
    for d in &plan.descriptors {
        // SAFETY: the caller checked the descriptors against both sides' regions.
        check(unsafe { sys::cuMemcpyAsync(d.dst, d.src, d.len as usize, stream.cu_stream()) })?;
    }
    Ok(())
}

/// Times `work` enqueued on `stream` with CUDA events, in milliseconds.
pub fn time_ms<E: From<CudaError>>(stream: &Arc<CudaStream>, work: impl FnOnce() -> Result<(), E>) -> Result<f64, E> {
    let ctx = stream.context();
    let start = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(CudaError::from)?;
    let end = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(CudaError::from)?;
    start.record(stream).map_err(CudaError::from)?;
    work()?;
    end.record(stream).map_err(CudaError::from)?;
    Ok(start.elapsed_ms(&end).map_err(CudaError::from)? as f64)
}

/// FNV-1a over the bytes of every descriptor's source (`src = true`) or destination side, read
/// back from the device (the bytes-verified check).
pub fn plan_checksum(ctx: &Arc<CudaContext>, plan: &TransferPlan, src: bool) -> Result<u64, CudaError> {
    ctx.bind_to_thread()?;
    let mut h = CHECKSUM_BASIS;
    let mut buf = Vec::new();
    for d in &plan.descriptors {
        buf.resize(d.len as usize, 0);
        // SAFETY: the descriptor lies inside an allocation (UVA address, any context's).
        unsafe { result::memcpy_dtoh_sync(&mut buf[..], if src { d.src } else { d.dst }) }?;
        h = checksum_words(h, &buf);
    }
    Ok(h)
}

/// The FNV-1a basis [`plan_checksum`] starts from.
pub const CHECKSUM_BASIS: u64 = 0xcbf2_9ce4_8422_2325;

/// Folds `bytes` into `h` as [`plan_checksum`] does for one descriptor (8-byte little-endian words,
/// the last one zero-padded), so the host can compute an expected checksum.
pub fn checksum_words(mut h: u64, bytes: &[u8]) -> u64 {
    for chunk in bytes.chunks(8) {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        h = (h ^ u64::from_le_bytes(w)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests;
