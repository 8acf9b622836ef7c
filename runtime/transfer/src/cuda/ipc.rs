//! P and D in separate processes on GPUs of one host: D exports the device allocations
//! behind its KV regions as CUDA IPC handles ([`ExportedKv`], serialisable, handed to P with D's
//! layout in seed step 21); P opens them once per peer ([`ImportedKv`], closed on drop), translates
//! every descriptor's destination from D's addresses to its own mapping ([`PeerAddressMap`]) after
//! the region checks (an out-of-region descriptor is refused before anything is launched), and
//! runs the whole plan as one launch of the gather/scatter kernel ([`CudaIpcWriter`]), then waits,
//! under a deadline, for the event recorded after it (the completion P reports on the side channel).
//!
//! Owns the device side of seed step 29 (P writes the request's blocks into D's regions) when P and
//! D are different processes on GPUs of one host; step 28's plan is built as for any backend, with
//! D's addresses as D published them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pdflow_messages::layout::RegionDesc;
use serde::{Deserialize, Serialize};

use super::{check, CudaBatchCopy, CudaContext, CudaError, UploadedPlan};
use crate::TransferStats;
use cudarc::driver::sys;
use pdflow_kv::memory::RegionError;
use pdflow_kv::planner::{Descriptor, TransferPlan};

/// Bytes in a CUDA IPC memory handle.
pub const IPC_HANDLE_LEN: usize = 64;

/// How long [`CudaIpcWriter::write`] waits for the kernel to finish by default.
pub const DEFAULT_WRITE_DEADLINE: Duration = Duration::from_secs(10);

/// Why an IPC export, import or write failed.
#[derive(Debug, thiserror::Error)]
pub enum IpcError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error(
        "IPC handle {index} is {len} bytes, not {IPC_HANDLE_LEN}: the export is corrupt or from another CUDA version"
    )]
    BadHandle { index: usize, len: usize },
    #[error(
        "D's region {region} ({base:#x}+{len}) does not lie inside one exported allocation: the export is inconsistent"
    )]
    RegionNotExported { region: usize, base: u64, len: u64 },
    #[error("the export lists {handles} allocations but {mapped} mappings were given")]
    MappingCountMismatch { handles: usize, mapped: usize },
    #[error("the export comes from this very process (pid {pid}): CUDA IPC handles cannot be opened by their exporter; use peer access instead")]
    SameProcess { pid: u32 },
    #[error("descriptor {index}: source is not in P's registered device memory: {source}")]
    SourceOutOfRegion { index: usize, source: RegionError },
    #[error("descriptor {index}: destination is not in D's exported regions: {source}")]
    DestinationOutOfRegion { index: usize, source: RegionError },
    #[error("the peer's memory is mapped on GPU {mapped} but the copier runs on GPU {copier}: open the export in the copier's context")]
    WrongDevice { mapped: usize, copier: usize },
    #[error("the copy kernel did not finish within {deadline:?}")]
    Timeout { deadline: Duration },
    #[error("the export could not be encoded: {0}")]
    Encode(String),
    #[error("the write was not launched: {0}")]
    NotLaunched(String),
}

/// One CUDA IPC memory handle (the driver's opaque 64 bytes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcMemHandle(pub Vec<u8>);

/// One exported device allocation: its handle, and where it starts and ends in D's address space.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportedAllocation {
    pub handle: IpcMemHandle,
    pub base_addr: u64,
    pub len: u64,
}

/// What D hands P so that P can write D's KV regions directly: the IPC handles of the allocations
/// behind the regions, and the regions as D sees them (the addresses of D's plan side).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportedKv {
    /// D's process id (a process cannot open its own handles).
    pub pid: u32,
    /// D's GPU ordinal, for logs.
    pub device: u32,
    pub allocations: Vec<ExportedAllocation>,
    pub regions: Vec<RegionDesc>,
}

/// The index of the region in `regions` that wholly contains `addr..addr+len` (the region check).
pub fn region_of(regions: &[RegionDesc], addr: u64, len: u64) -> Result<usize, RegionError> {
    let end = addr.checked_add(len).ok_or(RegionError::OutOfRegion { addr, len })?;
    regions
        .iter()
        .position(|r| addr >= r.base_addr && r.base_addr.checked_add(r.len).is_some_and(|r_end| end <= r_end))
        .ok_or(RegionError::OutOfRegion { addr, len })
}

impl ExportedKv {
    /// Exports the allocations behind `regions` (device memory of `ctx`'s GPU). The memory must
    /// stay allocated as long as any importer may write it.
    pub fn export(ctx: &Arc<CudaContext>, regions: &[RegionDesc]) -> Result<Self, IpcError> {
        ctx.bind_to_thread().map_err(CudaError::from)?;
        let mut allocations: Vec<ExportedAllocation> = Vec::new();
        for r in regions {
            if allocations.iter().any(|a| r.base_addr >= a.base_addr && r.base_addr < a.base_addr + a.len) {
                continue;
            }
            let (mut base, mut size) = (0u64, 0usize);
            // SAFETY: out-pointers to locals; the driver checks the address.
            check(unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, r.base_addr) })?;
            let mut handle = std::mem::MaybeUninit::<sys::CUipcMemHandle>::zeroed();
            // SAFETY: `base` is the start of a live allocation of this context.
            check(unsafe { sys::cuIpcGetMemHandle(handle.as_mut_ptr(), base) })?;
            // SAFETY: written by the successful call above (and zeroed before).
            let handle = unsafe { handle.assume_init() };
            let bytes = handle.reserved.iter().map(|&c| c as u8).collect();
            allocations.push(ExportedAllocation { handle: IpcMemHandle(bytes), base_addr: base, len: size as u64 });
        }
        let export =
            Self { pid: std::process::id(), device: ctx.ordinal() as u32, allocations, regions: regions.to_vec() };
        export.validate()?;
        Ok(export)
    }

    /// Checks what a peer sent: handles of the right size, every region inside one allocation.
    pub fn validate(&self) -> Result<(), IpcError> {
        for (index, a) in self.allocations.iter().enumerate() {
            if a.handle.0.len() != IPC_HANDLE_LEN {
                return Err(IpcError::BadHandle { index, len: a.handle.0.len() });
            }
        }
        for (region, r) in self.regions.iter().enumerate() {
            self.allocation_of(r.base_addr, r.len).ok_or(IpcError::RegionNotExported {
                region,
                base: r.base_addr,
                len: r.len,
            })?;
        }
        Ok(())
    }

    /// The allocation that wholly contains `addr..addr+len`.
    fn allocation_of(&self, addr: u64, len: u64) -> Option<usize> {
        let end = addr.checked_add(len)?;
        self.allocations
            .iter()
            .position(|a| addr >= a.base_addr && a.base_addr.checked_add(a.len).is_some_and(|a_end| end <= a_end))
    }
}

/// D's regions and where each of D's allocations is mapped in P: translates D's addresses into
/// P's after the region check. Pure arithmetic (no GPU), so it is tested everywhere.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerAddressMap {
    regions: Vec<RegionDesc>,
    /// Per region: (D's allocation base, P's mapping of that base).
    region_bases: Vec<(u64, u64)>,
}

impl PeerAddressMap {
    /// `local_bases[i]` is where P mapped `export.allocations[i]`.
    pub fn new(export: &ExportedKv, local_bases: &[u64]) -> Result<Self, IpcError> {
        export.validate()?;
        if local_bases.len() != export.allocations.len() {
            return Err(IpcError::MappingCountMismatch {
                handles: export.allocations.len(),
                mapped: local_bases.len(),
            });
        }
        let mut region_bases = Vec::with_capacity(export.regions.len());
        for (region, r) in export.regions.iter().enumerate() {
            let a = export.allocation_of(r.base_addr, r.len).ok_or(IpcError::RegionNotExported {
                region,
                base: r.base_addr,
                len: r.len,
            })?;
            region_bases.push((export.allocations[a].base_addr, local_bases[a]));
        }
        Ok(Self { regions: export.regions.clone(), region_bases })
    }

    /// D's regions, in D's addresses.
    pub fn regions(&self) -> &[RegionDesc] {
        &self.regions
    }

    /// P's address for D's `addr..addr+len`, which must lie wholly inside one of D's regions.
    pub fn translate(&self, addr: u64, len: u64) -> Result<u64, RegionError> {
        let region = region_of(&self.regions, addr, len)?;
        let (remote_base, local_base) = self.region_bases[region];
        Ok(local_base + (addr - remote_base))
    }

    /// The plan with every destination in P's mapping, after checking every source against P's
    /// `local_regions` and every destination against D's regions. Nothing is launched on error.
    pub fn translate_plan(&self, local_regions: &[RegionDesc], plan: &TransferPlan) -> Result<TransferPlan, IpcError> {
        let descriptors = plan
            .descriptors
            .iter()
            .enumerate()
            .map(|(index, d)| {
                region_of(local_regions, d.src, d.len)
                    .map_err(|source| IpcError::SourceOutOfRegion { index, source })?;
                let dst = self
                    .translate(d.dst, d.len)
                    .map_err(|source| IpcError::DestinationOutOfRegion { index, source })?;
                Ok(Descriptor { src: d.src, dst, len: d.len })
            })
            .collect::<Result<_, IpcError>>()?;
        Ok(TransferPlan { descriptors, fence: 0, write_by: None, grant: None })
    }
}

/// D's allocations opened in P's context (once per peer); the handles are closed on drop.
pub struct ImportedKv {
    ctx: Arc<CudaContext>,
    opened: Vec<u64>,
    map: PeerAddressMap,
    peer_pid: u32,
}

impl std::fmt::Debug for ImportedKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedKv").field("peer_pid", &self.peer_pid).field("allocations", &self.opened.len()).finish()
    }
}

impl ImportedKv {
    /// Opens every allocation of `export` in `ctx` (peer access enabled lazily by the driver).
    pub fn open(ctx: &Arc<CudaContext>, export: &ExportedKv) -> Result<Self, IpcError> {
        export.validate()?;
        if export.pid == std::process::id() {
            return Err(IpcError::SameProcess { pid: export.pid });
        }
        ctx.bind_to_thread().map_err(CudaError::from)?;
        // Built up one handle at a time, so that a failure part-way closes what was opened.
        let mut imported = Self {
            ctx: ctx.clone(),
            opened: Vec::new(),
            map: PeerAddressMap { regions: Vec::new(), region_bases: Vec::new() },
            peer_pid: export.pid,
        };
        for a in &export.allocations {
            let mut handle = sys::CUipcMemHandle { reserved: [0; IPC_HANDLE_LEN] };
            for (dst, &b) in handle.reserved.iter_mut().zip(&a.handle.0) {
                *dst = b as ::core::ffi::c_char;
            }
            let mut ptr = 0u64;
            let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as ::core::ffi::c_uint;
            // SAFETY: out-pointer to a local; the handle's size was validated.
            check(unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, handle, flags) })?;
            imported.opened.push(ptr);
        }
        imported.map = PeerAddressMap::new(export, &imported.opened)?;
        Ok(imported)
    }

    pub fn map(&self) -> &PeerAddressMap {
        &self.map
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// P's mappings of D's allocations, in the export's order.
    pub fn mapped_bases(&self) -> &[u64] {
        &self.opened
    }

    pub fn peer_pid(&self) -> u32 {
        self.peer_pid
    }
}

impl Drop for ImportedKv {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // Work still in flight may use the mappings: let it finish first.
            let _ = self.ctx.synchronize();
            for &ptr in &self.opened {
                // SAFETY: opened by `open`, closed once.
                let _ = unsafe { sys::cuIpcCloseMemHandle(ptr) };
            }
        }
    }
}

/// A plan checked against both sides' regions, translated and uploaded for one peer; it can be
/// launched any number of times while the peer's mapping lives.
pub struct PreparedWrite<'p> {
    plan: UploadedPlan,
    _peer: &'p ImportedKv,
}

impl PreparedWrite<'_> {
    pub fn descriptors(&self) -> usize {
        self.plan.descriptors
    }

    pub fn bytes(&self) -> u64 {
        self.plan.bytes
    }
}

/// P's side of the same-host GPU path: writes plans from P's device regions into an imported
/// peer's, one kernel launch per plan.
pub struct CudaIpcWriter {
    copier: CudaBatchCopy,
    local_regions: Vec<RegionDesc>,
    pub deadline: Duration,
    /// The descriptor table of the last finished write, reused by the next one.
    spare: std::sync::Mutex<Option<UploadedPlan>>,
}

impl CudaIpcWriter {
    /// `local_regions`: P's KV regions (device memory of the copier's GPU), the only valid sources.
    pub fn new(copier: CudaBatchCopy, local_regions: Vec<RegionDesc>) -> Self {
        Self { copier, local_regions, deadline: DEFAULT_WRITE_DEADLINE, spare: std::sync::Mutex::new(None) }
    }

    pub fn copier(&self) -> &CudaBatchCopy {
        &self.copier
    }

    pub fn copier_mut(&mut self) -> &mut CudaBatchCopy {
        &mut self.copier
    }

    /// Region checks on both sides, address translation and the descriptor upload.
    pub fn prepare<'p>(&self, peer: &'p ImportedKv, plan: &TransferPlan) -> Result<PreparedWrite<'p>, IpcError> {
        let (mapped, copier) = (peer.ctx.ordinal(), self.copier.context().ordinal());
        if mapped != copier {
            return Err(IpcError::WrongDevice { mapped, copier });
        }
        let translated = peer.map.translate_plan(&self.local_regions, plan)?;
        let spare = self.spare.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        Ok(PreparedWrite { plan: self.copier.upload_reusing(&translated, spare)?, _peer: peer })
    }

    /// Enqueues one launch of a prepared plan (asynchronous; time it with [`super::time_ms`]).
    pub fn launch(&self, prepared: &PreparedWrite<'_>) -> Result<(), IpcError> {
        Ok(self.copier.launch(&prepared.plan)?)
    }

    /// Waits until everything enqueued so far on the copier's stream has finished (an event
    /// recorded now, polled until [`Self::deadline`]): after this, D may read the bytes.
    pub fn wait_complete(&self) -> Result<(), IpcError> {
        let event = self.copier.context().new_event(None).map_err(CudaError::from)?;
        event.record(self.copier.stream()).map_err(CudaError::from)?;
        let start = Instant::now();
        let mut spins = 0u32;
        while !event.try_is_complete().map_err(CudaError::from)? {
            if start.elapsed() > self.deadline {
                return Err(IpcError::Timeout { deadline: self.deadline });
            }
            spins += 1;
            if spins < 1000 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    /// Seed step 29 on GPUs: checks, translates and writes `plan` into the peer's regions in one
    /// launch, and returns once the bytes are in D's memory.
    pub fn write(&self, peer: &ImportedKv, plan: &TransferPlan) -> Result<TransferStats, IpcError> {
        self.write_when(peer, plan, || Ok(()))
    }

    /// As [`Self::write`], launching only once `go` allowed it (serving: D's data server acked
    /// the fence hold — the checks and the upload overlap that round trip); when `go` fails,
    /// nothing is launched and its error is returned.
    pub fn write_when(
        &self,
        peer: &ImportedKv,
        plan: &TransferPlan,
        go: impl FnOnce() -> Result<(), IpcError>,
    ) -> Result<TransferStats, IpcError> {
        let start = Instant::now();
        let prepared = self.prepare(peer, plan)?;
        if let Err(e) = go() {
            *self.spare.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(prepared.plan);
            return Err(e);
        }
        self.launch(&prepared)?;
        self.wait_complete()?;
        let stats =
            TransferStats { bytes: prepared.bytes(), descriptors: prepared.descriptors(), duration: start.elapsed() };
        // The launch has finished: its descriptor table can carry the next write.
        *self.spare.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(prepared.plan);
        Ok(stats)
    }
}
