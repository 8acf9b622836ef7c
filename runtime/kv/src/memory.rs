//! A worker's KV cache as registered memory regions (seed step 3) and the region table that every
//! write is checked against (ARCHITECTURE.md, "Memory regions").
//!
//! Layout is vLLM 0.33's LBHNC: one region per layer, each `[num_blocks, num_kv_heads, block_size,
//! 2 * head_dim]` (K and V side by side). For Qwen3-8B (36 layers, 8 KV heads, head_dim 128, bf16,
//! block 16) a block is 64 KiB per layer and 2.25 MiB over all layers; a token is 144 KiB.
//!
//! Memory is shared between the engine (which computes KV into blocks it owns) and the transfer
//! engine (which reads P's finished blocks and writes D's waiting blocks). The block pool gives each
//! block one owner at a time, so concurrent accesses always touch disjoint bytes; this module only
//! hands out raw ranges after checking they lie wholly inside one region.

use std::sync::Arc;

use pdflow_messages::layout::{KvLayout, RegionDesc};
use pdflow_messages::BlockId;

/// The model's KV shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvShape {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub dtype_bytes: usize,
    pub block_size: usize,
}

impl KvShape {
    /// The seed's model: Qwen/Qwen3-8B, bf16, block 16.
    pub const QWEN3_8B: KvShape =
        KvShape { num_layers: 36, num_kv_heads: 8, head_dim: 128, dtype_bytes: 2, block_size: 16 };
    /// DeepSeek-V3's MLA cache: 61 layers of one latent "head" of 576 bf16 values per token (512
    /// compressed KV + 64 rope; `head_dim` 288 since a slot holds `2 × head_dim` values), the
    /// same on every tensor-parallel rank; block 16.
    pub const DEEPSEEK_V3_MLA: KvShape =
        KvShape { num_layers: 61, num_kv_heads: 1, head_dim: 288, dtype_bytes: 2, block_size: 16 };

    /// Bytes of one token's K and V for one head in one layer.
    pub fn slot_len(&self) -> usize {
        2 * self.head_dim * self.dtype_bytes
    }
    /// Bytes of one block in one layer's region.
    pub fn block_len(&self) -> usize {
        self.num_kv_heads * self.block_size * self.slot_len()
    }
    /// Bytes of one block over all layers.
    pub fn bytes_per_block(&self) -> usize {
        self.num_layers * self.block_len()
    }
    /// Bytes of one token over all layers (144 KiB for Qwen3-8B).
    pub fn bytes_per_token(&self) -> usize {
        self.num_layers * self.num_kv_heads * self.slot_len()
    }
    /// Offset, inside one layer's block, of (head, slot).
    pub fn slot_offset(&self, head: usize, slot: usize) -> usize {
        (head * self.block_size + slot) * self.slot_len()
    }
    /// Blocks needed for `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
}

/// Why a range is not registered memory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegionError {
    #[error("range {addr:#x}+{len} does not lie wholly inside one registered region: refused")]
    OutOfRegion { addr: u64, len: u64 },
    #[error("block {block} is outside the {num_blocks}-block KV cache")]
    BlockOutOfRange { block: BlockId, num_blocks: usize },
    #[error("range {addr:#x}+{len} is GPU memory (device {device}): host code cannot touch it (the tcp and same-host paths carry host KV only; GPU KV moves by the cuda engines)")]
    OnDevice { addr: u64, len: u64, device: usize },
    #[error("GPU {device} could not read or write the KV: {reason}")]
    Device { device: usize, reason: String },
}

/// Where a cache's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum MemoryKind {
    /// Host memory (the default, and vLLM's CPU tensors).
    #[default]
    Host,
    /// Memory of CUDA device `device`: addresses are device (unified virtual) addresses.
    Cuda { device: usize },
}

impl std::fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemoryKind::Host => f.write_str("host"),
            MemoryKind::Cuda { device } => write!(f, "cuda:{device}"),
        }
    }
}

/// One layer's buffer. `u64` words keep owned buffers 8-byte aligned; an external buffer (vLLM's
/// tensor, registered through the bridge) is kept alive by the cache's `external_owner`.
struct LayerBuffer {
    ptr: *mut u8,
    len: usize,
    _owner: Option<Box<[u64]>>,
}

/// Whatever keeps externally allocated regions alive (the bridge's torch tensors).
pub type ExternalOwner = Box<dyn std::any::Any + Send + Sync>;

/// A worker's KV cache: `num_blocks` blocks of `shape`, one region per layer.
pub struct KvCache {
    shape: KvShape,
    num_blocks: usize,
    layers: Vec<LayerBuffer>,
    layout_id: u64,
    _external_owner: Option<ExternalOwner>,
    /// The device allocations when the cache lives on a GPU (`layers` then hold device addresses,
    /// never dereferenced on the host).
    #[cfg(feature = "cuda")]
    device: Option<Arc<crate::cuda::device_kv::DeviceKv>>,
}

// SAFETY: the buffers are plain bytes owned by the cache for its whole life; concurrent access goes
// through raw pointers to disjoint blocks (one owner per block, enforced by the engine's block pool).
unsafe impl Send for KvCache {}
unsafe impl Sync for KvCache {}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache").field("shape", &self.shape).field("num_blocks", &self.num_blocks).finish()
    }
}

impl KvCache {
    /// Allocates a zeroed cache (seed step 3: vLLM allocates, then the connector registers it).
    pub fn new(shape: KvShape, num_blocks: usize) -> Arc<Self> {
        let region_len = num_blocks * shape.block_len();
        let layers = (0..shape.num_layers)
            .map(|_| {
                let mut owner = vec![0u64; region_len.div_ceil(8)].into_boxed_slice();
                LayerBuffer { ptr: owner.as_mut_ptr().cast::<u8>(), len: region_len, _owner: Some(owner) }
            })
            .collect();
        Arc::new(Self {
            shape,
            num_blocks,
            layers,
            layout_id: new_layout_id(),
            _external_owner: None,
            #[cfg(feature = "cuda")]
            device: None,
        })
    }

    /// A zeroed cache in the memory of CUDA device `device` (GPU-resident KV): the
    /// model writes it with a kernel and the cuda engines move it; host paths refuse it.
    #[cfg(feature = "cuda")]
    pub fn new_cuda(shape: KvShape, num_blocks: usize, device: usize) -> Result<Arc<Self>, crate::cuda::CudaError> {
        let kv = crate::cuda::device_kv::DeviceKv::new(shape, num_blocks, device)?;
        let region_len = num_blocks * shape.block_len();
        let layers = kv
            .layer_bases()
            .iter()
            .map(|&base| LayerBuffer { ptr: base as *mut u8, len: region_len, _owner: None })
            .collect();
        Ok(Arc::new(Self {
            shape,
            num_blocks,
            layers,
            layout_id: new_layout_id(),
            _external_owner: None,
            device: Some(Arc::new(kv)),
        }))
    }

    /// The device allocations, when this cache lives on a GPU.
    #[cfg(feature = "cuda")]
    pub fn device(&self) -> Option<&Arc<crate::cuda::device_kv::DeviceKv>> {
        self.device.as_ref()
    }

    /// Where this cache's bytes live.
    pub fn memory(&self) -> MemoryKind {
        #[cfg(feature = "cuda")]
        if let Some(kv) = &self.device {
            return MemoryKind::Cuda { device: kv.ordinal() };
        }
        MemoryKind::Host
    }

    /// Refuses host access to a cache on a GPU.
    fn host_only(&self, layer: usize, block: BlockId) -> Result<(), RegionError> {
        match self.memory() {
            MemoryKind::Host => Ok(()),
            MemoryKind::Cuda { device } => {
                let addr = self.layers.get(layer).map_or(0, |l| l.ptr as u64)
                    + u64::from(block) * self.shape.block_len() as u64;
                Err(RegionError::OnDevice { addr, len: self.shape.block_len() as u64, device })
            }
        }
    }

    /// Registers memory that someone else allocated (seed step 3 in vLLM: the worker's per-layer
    /// KV tensors, handed over by the bridge): one region per entry of `regions`, each
    /// `num_blocks * shape.block_len()` bytes. `owner` is kept for the cache's whole life.
    ///
    /// # Safety
    /// Each `(ptr, len)` must be valid, writable host memory for as long as `owner` lives, the
    /// regions must not overlap, and only the holder of a block (the engine's block pool) may touch
    /// its bytes while pdflow reads or writes them.
    pub unsafe fn from_external(
        shape: KvShape,
        num_blocks: usize,
        regions: &[(*mut u8, usize)],
        owner: ExternalOwner,
    ) -> Result<Arc<Self>, ExternalRegionError> {
        check_external(shape, num_blocks, regions)?;
        let layers = regions.iter().map(|&(ptr, len)| LayerBuffer { ptr, len, _owner: None }).collect();
        Ok(Arc::new(Self {
            shape,
            num_blocks,
            layers,
            layout_id: new_layout_id(),
            _external_owner: Some(owner),
            #[cfg(feature = "cuda")]
            device: None,
        }))
    }

    /// Registers GPU memory that someone else allocated on CUDA device `device` (the bridge:
    /// vLLM's per-layer KV tensors on the GPU), as [`KvCache::from_external`] does host memory;
    /// every region is checked to lie in one live allocation of that device.
    ///
    /// # Safety
    /// As [`KvCache::from_external`], for device memory of GPU `device`.
    #[cfg(feature = "cuda")]
    pub unsafe fn from_external_cuda(
        shape: KvShape,
        num_blocks: usize,
        device: usize,
        regions: &[(*mut u8, usize)],
        owner: ExternalOwner,
    ) -> Result<Arc<Self>, ExternalRegionError> {
        check_external(shape, num_blocks, regions)?;
        let bases = regions.iter().map(|&(ptr, _)| ptr as u64).collect();
        // SAFETY: the caller vouches for the memory's life and ownership; `external` checks that
        // each region lies in an allocation of `device`.
        let kv = unsafe { crate::cuda::device_kv::DeviceKv::external(shape, num_blocks, device, bases) }
            .map_err(|e| ExternalRegionError::Device { device, reason: e.to_string() })?;
        let layers = regions.iter().map(|&(ptr, len)| LayerBuffer { ptr, len, _owner: None }).collect();
        Ok(Arc::new(Self {
            shape,
            num_blocks,
            layers,
            layout_id: new_layout_id(),
            _external_owner: Some(owner),
            device: Some(Arc::new(kv)),
        }))
    }

    pub fn shape(&self) -> KvShape {
        self.shape
    }
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// The registered regions, one per layer.
    pub fn regions(&self) -> Vec<RegionDesc> {
        self.layers
            .iter()
            .map(|l| RegionDesc {
                base_addr: l.ptr as u64,
                len: l.len as u64,
                block_len: self.shape.block_len() as u64,
            })
            .collect()
    }

    /// The layout a peer needs to address this cache (seed step 21).
    pub fn layout(&self) -> KvLayout {
        KvLayout { layout_id: self.layout_id, regions: self.regions() }
    }

    /// A region table over this cache, for checking and performing raw transfers.
    pub fn region_table(self: &Arc<Self>) -> RegionTable {
        RegionTable { regions: self.regions(), memory: self.memory(), _owner: Some(self.clone()) }
    }

    fn check_block(&self, block: BlockId) -> Result<usize, RegionError> {
        let b = block as usize;
        if b >= self.num_blocks {
            return Err(RegionError::BlockOutOfRange { block, num_blocks: self.num_blocks });
        }
        Ok(b)
    }

    /// Writes one token slot (layer, block, head, slot). `bytes.len()` must be `shape.slot_len()`.
    pub fn write_slot(
        &self,
        layer: usize,
        block: BlockId,
        head: usize,
        slot: usize,
        bytes: &[u8],
    ) -> Result<(), RegionError> {
        let b = self.check_block(block)?;
        self.host_only(layer, block)?;
        let len = self.shape.slot_len();
        assert!(
            layer < self.layers.len()
                && head < self.shape.num_kv_heads
                && slot < self.shape.block_size
                && bytes.len() == len
        );
        let off = b * self.shape.block_len() + self.shape.slot_offset(head, slot);
        // SAFETY: bounds checked above; the block belongs to the caller (block pool invariant).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.layers[layer].ptr.add(off), len) };
        Ok(())
    }

    /// Reads one token slot into `out` (`shape.slot_len()` bytes).
    pub fn read_slot(
        &self,
        layer: usize,
        block: BlockId,
        head: usize,
        slot: usize,
        out: &mut [u8],
    ) -> Result<(), RegionError> {
        let b = self.check_block(block)?;
        self.host_only(layer, block)?;
        let len = self.shape.slot_len();
        assert!(
            layer < self.layers.len()
                && head < self.shape.num_kv_heads
                && slot < self.shape.block_size
                && out.len() == len
        );
        let off = b * self.shape.block_len() + self.shape.slot_offset(head, slot);
        // SAFETY: as in `write_slot`.
        unsafe { std::ptr::copy_nonoverlapping(self.layers[layer].ptr.add(off), out.as_mut_ptr(), len) };
        Ok(())
    }

    /// A copy of one whole block over all layers (layer-major): for verification in tests and the demo.
    pub fn block_bytes(&self, block: BlockId) -> Result<Vec<u8>, RegionError> {
        let b = self.check_block(block)?;
        #[cfg(feature = "cuda")]
        if let Some(kv) = &self.device {
            return kv.read_blocks(&[block]);
        }
        let bl = self.shape.block_len();
        let mut out = Vec::with_capacity(self.shape.bytes_per_block());
        for l in &self.layers {
            // SAFETY: in bounds; the caller owns the block.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(l.ptr.add(b * bl), bl) });
        }
        Ok(out)
    }
}

/// A fresh non-zero id for a registered layout (peers cache layouts by it).
fn new_layout_id() -> u64 {
    (uuid::Uuid::new_v4().as_u64_pair().0 >> 1) | 1
}

/// Why externally allocated memory cannot be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExternalRegionError {
    #[error("expected {expected} KV regions (one per layer), got {got}")]
    RegionCount { expected: usize, got: usize },
    #[error("KV region {index} has a null address")]
    Null { index: usize },
    #[error("KV region {index} is {len} bytes; {num_blocks} blocks of {block_len} bytes need {expected}: the tensor's shape does not match the KV shape")]
    Length { index: usize, len: usize, expected: usize, num_blocks: usize, block_len: usize },
    #[error("{num_blocks} blocks overflow the address space")]
    TooLarge { num_blocks: usize },
    #[error("KV regions at {first:#x} and {second:#x} overlap: each layer needs its own memory")]
    Overlap { first: u64, second: u64 },
    #[error("KV on GPU {device}: {reason}")]
    Device { device: usize, reason: String },
}

/// The checks of memory registered from outside: one region per layer, each of `num_blocks`
/// blocks, none null, none overlapping another.
fn check_external(shape: KvShape, num_blocks: usize, regions: &[(*mut u8, usize)]) -> Result<(), ExternalRegionError> {
    if regions.len() != shape.num_layers {
        return Err(ExternalRegionError::RegionCount { expected: shape.num_layers, got: regions.len() });
    }
    let expected = num_blocks.checked_mul(shape.block_len()).ok_or(ExternalRegionError::TooLarge { num_blocks })?;
    for (index, &(ptr, len)) in regions.iter().enumerate() {
        if ptr.is_null() {
            return Err(ExternalRegionError::Null { index });
        }
        if len != expected {
            return Err(ExternalRegionError::Length { index, len, expected, num_blocks, block_len: shape.block_len() });
        }
    }
    let mut sorted: Vec<(usize, usize)> = regions.iter().map(|&(ptr, len)| (ptr as usize, len)).collect();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0].0 + w[0].1 > w[1].0) {
        return Err(ExternalRegionError::Overlap { first: w[0].0 as u64, second: w[1].0 as u64 });
    }
    Ok(())
}

impl KvCache {
    /// A host cache whose every byte differs by `seed`, layer, block, head, slot and offset (as
    /// bytes go): P's side in tests and benchmarks, where D's copy must match it byte for byte.
    pub fn patterned(shape: KvShape, num_blocks: usize, seed: usize) -> Arc<Self> {
        let cache = Self::new(shape, num_blocks);
        let mut bytes = vec![0u8; shape.slot_len()];
        for layer in 0..shape.num_layers {
            for block in 0..num_blocks {
                for head in 0..shape.num_kv_heads {
                    for slot in 0..shape.block_size {
                        for (i, b) in bytes.iter_mut().enumerate() {
                            *b = (1 + seed * 131 + layer * 31 + block * 17 + head * 7 + slot * 3 + i) as u8;
                        }
                        let written = cache.write_slot(layer, block as BlockId, head, slot, &bytes);
                        debug_assert!(written.is_ok(), "every slot of a new host cache is in range");
                    }
                }
            }
        }
        cache
    }

    /// One checksum per block of `blocks` ([`KvCache::blocks_checksum`] of each alone): what P
    /// sends with a verified transfer and D compares its blocks against.
    pub fn block_digests(&self, blocks: &[BlockId]) -> Result<Vec<u64>, RegionError> {
        blocks.iter().map(|&b| self.blocks_checksum(&[b])).collect()
    }

    /// A checksum of `blocks` (in order) over every region, region-major: the same byte sequence
    /// P's transfer plan reads and D's blocks receive, so both sides can compare (demo, tests).
    pub fn blocks_checksum(&self, blocks: &[BlockId]) -> Result<u64, RegionError> {
        let bl = self.shape.block_len();
        let mut h = Checksum::default();
        #[cfg(feature = "cuda")]
        if let Some(kv) = &self.device {
            for &block in blocks {
                self.check_block(block)?;
            }
            // Read back region-major, as the host loop below walks it.
            for chunk in kv.read_blocks(blocks)?.chunks(bl) {
                h.update(chunk);
            }
            return Ok(h.finish());
        }
        for l in &self.layers {
            for &block in blocks {
                let b = self.check_block(block)?;
                // SAFETY: in bounds; the caller owns the blocks (held for transfer).
                h.update(unsafe { std::slice::from_raw_parts(l.ptr.add(b * bl), bl) });
            }
        }
        Ok(h.finish())
    }
}

/// A fast, order-sensitive 64-bit checksum (not cryptographic).
#[derive(Debug, Clone, Copy)]
pub struct Checksum(u64);

impl Default for Checksum {
    fn default() -> Self {
        Self(0x9E37_79B9_7F4A_7C15)
    }
}

impl Checksum {
    pub fn update(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
            self.0 = (self.0 ^ w).wrapping_mul(0x0100_0000_01B3).rotate_left(29);
        }
        for &b in chunks.remainder() {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3).rotate_left(29);
        }
    }
    pub fn finish(&self) -> u64 {
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Registered regions, and raw access to them after a bounds check.
#[derive(Clone)]
pub struct RegionTable {
    regions: Vec<RegionDesc>,
    /// Where the regions' bytes live: only host regions can be sliced.
    memory: MemoryKind,
    /// Keeps the memory alive as long as the table is.
    _owner: Option<Arc<KvCache>>,
}

impl std::fmt::Debug for RegionTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionTable").field("regions", &self.regions.len()).finish()
    }
}

impl RegionTable {
    pub fn regions(&self) -> &[RegionDesc] {
        &self.regions
    }

    /// Where the regions' bytes live.
    pub fn memory(&self) -> MemoryKind {
        self.memory
    }

    /// As [`RegionTable::check`], and the range must be host memory (what a socket or
    /// `process_vm_writev` can write).
    pub fn check_host(&self, addr: u64, len: u64) -> Result<usize, RegionError> {
        let index = self.check(addr, len)?;
        self.host_range(addr, len)?;
        Ok(index)
    }

    /// Refuses a host slice of device memory.
    fn host_range(&self, addr: u64, len: u64) -> Result<(), RegionError> {
        match self.memory {
            MemoryKind::Host => Ok(()),
            MemoryKind::Cuda { device } => Err(RegionError::OnDevice { addr, len, device }),
        }
    }

    /// The index of the region that wholly contains `addr..addr+len`.
    pub fn check(&self, addr: u64, len: u64) -> Result<usize, RegionError> {
        let end = addr.checked_add(len).ok_or(RegionError::OutOfRegion { addr, len })?;
        self.regions
            .iter()
            .position(|r| addr >= r.base_addr && end <= r.base_addr + r.len)
            .ok_or(RegionError::OutOfRegion { addr, len })
    }

    /// The destination bytes `addr..addr+len`, after the region check.
    ///
    /// # Safety
    /// The caller must own the blocks the range covers for as long as it uses the slice (no other
    /// reader or writer of those bytes), as the block pool guarantees for blocks under transfer.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, addr: u64, len: u64) -> Result<&mut [u8], RegionError> {
        self.check(addr, len)?;
        self.host_range(addr, len)?;
        Ok(std::slice::from_raw_parts_mut(addr as *mut u8, len as usize))
    }

    /// The source bytes `addr..addr+len`, after the region check.
    ///
    /// # Safety
    /// Nobody may write those bytes while the slice is used (P's blocks are held by delayed free).
    pub unsafe fn slice(&self, addr: u64, len: u64) -> Result<&[u8], RegionError> {
        self.check(addr, len)?;
        self.host_range(addr, len)?;
        Ok(std::slice::from_raw_parts(addr as *const u8, len as usize))
    }
}

#[cfg(test)]
mod tests;
