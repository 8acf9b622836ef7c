//! The simulated model's KV written on the GPU ("the simulated engine can keep its KV on
//! a GPU; prefill writes the deterministic pattern with a kernel"): [`CudaKvFill`] computes a
//! forward item's KV — the very bytes [`crate::model::fill_kv`] gives on the host, token
//! `t` at position `p`, layer `l`, head `h` — in one kernel launch, straight into device regions
//! laid out as vLLM 0.33's (one region per layer, LBHNC). It owns the device half of seed step 15
//! (P's prefill writes the prompt's KV into its blocks) and of step 39 (D's first forward).
//!
//! Every position's block is checked against the request's block list and the regions before the
//! launch; nothing is written when one is out of range.

use std::sync::Arc;

use cudarc::driver::{result, CudaFunction, LaunchConfig, PushKernelArg};
use pdflow_messages::BlockId;

use pdflow_kv::cuda::{CudaContext, CudaError, CudaStream, DeviceBuffer};
use pdflow_kv::memory::KvShape;

/// The fill kernel: one thread block per (token, layer, head) slot, in a grid-stride loop; each
/// thread writes 8-byte words of the slot's splitmix64 stream (bytes where a word is cut short).
const SOURCE: &str = r#"
__device__ __forceinline__ unsigned long long pdflow_sm64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

extern "C" __global__ void pdflow_fill_kv(
    const unsigned long long* __restrict__ layer_base,
    const unsigned int* __restrict__ tokens,
    const unsigned int* __restrict__ block_ids,
    unsigned int n,
    unsigned long long start,
    unsigned int num_layers,
    unsigned int num_heads,
    unsigned int block_size,
    unsigned long long slot_len,
    unsigned long long block_len)
{
    unsigned long long items = (unsigned long long)n * num_layers * num_heads;
    unsigned long long words = (slot_len + 7) / 8;
    for (unsigned long long it = blockIdx.x; it < items; it += gridDim.x) {
        unsigned long long head = it % num_heads;
        unsigned long long layer = (it / num_heads) % num_layers;
        unsigned long long i = it / ((unsigned long long)num_heads * num_layers);
        unsigned long long pos = start + i;
        unsigned long long block = block_ids[pos / block_size];
        unsigned long long slot = pos % block_size;
        unsigned char* out = (unsigned char*)(layer_base[layer] + block * block_len + (head * block_size + slot) * slot_len);
        unsigned long long seed = pdflow_sm64(pdflow_sm64(pdflow_sm64((unsigned long long)tokens[i]) ^ pos) ^ ((layer << 32) | head));
        for (unsigned long long w = threadIdx.x; w < words; w += blockDim.x) {
            unsigned long long v = pdflow_sm64(seed ^ (w * 0x9E3779B97F4A7C15ull));
            unsigned long long off = w * 8;
            if (off + 8 <= slot_len && (((unsigned long long)(out + off)) & 7ull) == 0) {
                *(unsigned long long*)(out + off) = v;
            } else {
                for (unsigned long long b = 0; b < 8 && off + b < slot_len; b++) out[off + b] = (unsigned char)(v >> (8 * b));
            }
        }
    }
}
"#;

/// Threads per thread block (a Qwen3-8B slot is 64 words).
const THREADS: u32 = 64;

/// Writes forward items' KV into device regions with one launch each (see the module docs).
pub struct CudaKvFill {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    fill: CudaFunction,
    sms: u32,
}

impl CudaKvFill {
    /// Compiles the kernel with NVRTC and loads it into `ctx`.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        if !pdflow_kv::cuda::nvrtc_available() {
            return Err(CudaError::NoNvrtc);
        }
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(
            SOURCE,
            cudarc::nvrtc::CompileOptions { name: Some("pdflow_model_kv.cu".into()), ..Default::default() },
        )
        .map_err(|e| CudaError::Compile(format!("{e:?}")))?;
        let module = ctx.load_module(ptx)?;
        let sms =
            ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        Ok(Self {
            ctx: ctx.clone(),
            stream: ctx.default_stream(),
            fill: module.load_function("pdflow_fill_kv")?,
            sms: sms.max(1),
        })
    }

    /// Writes the KV of `tokens` at positions `start..start + tokens.len()` of a request whose
    /// blocks are `block_ids` into the regions at `layer_bases` (one per layer, each
    /// `num_blocks` blocks of `shape`), and waits for it. Refuses, writing nothing, a position
    /// past the request's blocks or a block past the regions.
    pub fn fill(
        &self,
        layer_bases: &[u64],
        num_blocks: usize,
        shape: KvShape,
        tokens: &[u32],
        start: usize,
        block_ids: &[BlockId],
    ) -> Result<(), CudaError> {
        if tokens.is_empty() {
            return Ok(());
        }
        let block_len = shape.block_len() as u64;
        let region = num_blocks as u64 * block_len;
        if layer_bases.len() != shape.num_layers {
            return Err(CudaError::OutOfBounds {
                offset: 0,
                len: layer_bases.len() as u64,
                size: shape.num_layers as u64,
            });
        }
        let last = start + tokens.len() - 1;
        let used = &block_ids[..block_ids.len().min(last / shape.block_size + 1)];
        if used.len() * shape.block_size <= last {
            // The request's blocks end before its last position.
            return Err(CudaError::OutOfBounds {
                offset: last as u64,
                len: 1,
                size: (block_ids.len() * shape.block_size) as u64,
            });
        }
        if let Some(&b) = used.iter().find(|&&b| u64::from(b) >= num_blocks as u64) {
            return Err(CudaError::OutOfBounds { offset: u64::from(b) * block_len, len: block_len, size: region });
        }
        let put32 = |v: &[u32]| -> Result<DeviceBuffer, CudaError> {
            let b = DeviceBuffer::new(&self.ctx, v.len() * 4)?;
            // SAFETY: `b` holds exactly `v.len()` u32s.
            unsafe { result::memcpy_htod_sync(b.ptr, v) }?;
            Ok(b)
        };
        let bases = DeviceBuffer::new(&self.ctx, layer_bases.len() * 8)?;
        // SAFETY: `bases` holds exactly `layer_bases.len()` u64s.
        unsafe { result::memcpy_htod_sync(bases.ptr, layer_bases) }?;
        let (tokens_d, blocks_d) = (put32(tokens)?, put32(used)?);
        let n = u32::try_from(tokens.len()).map_err(|_| CudaError::OutOfBounds {
            offset: 0,
            len: tokens.len() as u64,
            size: u64::from(u32::MAX),
        })?;
        let items = u64::from(n) * (shape.num_layers * shape.num_kv_heads) as u64;
        let grid = u32::try_from(items.min(u64::from(self.sms) * 32)).unwrap_or(u32::MAX).max(1);
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let (start, num_layers, num_heads, block_size) =
            (start as u64, shape.num_layers as u32, shape.num_kv_heads as u32, shape.block_size as u32);
        let slot_len = shape.slot_len() as u64;
        let mut b = self.stream.launch_builder(&self.fill);
        b.arg(&bases.ptr)
            .arg(&tokens_d.ptr)
            .arg(&blocks_d.ptr)
            .arg(&n)
            .arg(&start)
            .arg(&num_layers)
            .arg(&num_heads)
            .arg(&block_size)
            .arg(&slot_len)
            .arg(&block_len);
        // SAFETY: every position's block is in `used` and inside the regions (checked above); each
        // slot lies inside its block; the arrays hold what the kernel reads.
        unsafe { b.launch(cfg) }?;
        self.stream.synchronize()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ContextDigest, ForwardItem, Model};
    use pdflow_kv::memory::KvCache;

    /// A context on GPU 0, or `None` after printing why the test skips.
    fn gpu0() -> Option<Arc<CudaContext>> {
        match pdflow_kv::cuda::device_count() {
            Err(e) => {
                pdflow_testkit::skipped("cuda model KV test", &e);
                None
            }
            Ok(_) if !pdflow_kv::cuda::nvrtc_available() => {
                pdflow_testkit::skipped("cuda model KV test", &CudaError::NoNvrtc);
                None
            }
            Ok(_) => Some(CudaContext::new(0).expect("GPU 0 is visible")),
        }
    }

    fn prompt(n: usize) -> Vec<u32> {
        (0..n as u64).map(|i| (crate::model::splitmix64(i) % 151_936) as u32).collect()
    }

    /// One device region per layer, zeroed.
    fn device_regions(ctx: &Arc<CudaContext>, shape: KvShape, num_blocks: usize) -> Vec<DeviceBuffer> {
        (0..shape.num_layers)
            .map(|_| {
                let b = DeviceBuffer::new(ctx, num_blocks * shape.block_len()).expect("alloc");
                b.fill(0).expect("memset");
                b
            })
            .collect()
    }

    fn assert_same_bytes(host: &KvCache, device: &[DeviceBuffer]) {
        for (layer, (r, d)) in host.regions().iter().zip(device).enumerate() {
            // SAFETY: the host cache's region, alive for the test.
            let want = unsafe { std::slice::from_raw_parts(r.base_addr as *const u8, r.len as usize) };
            let mut got = vec![0u8; r.len as usize];
            d.read(0, &mut got).expect("read back");
            assert!(got == want, "layer {layer}: the kernel's KV differs from the host model's");
        }
    }

    /// The seed's prefill (1000 tokens into blocks 17..=79, Qwen3-8B) written by the kernel holds
    /// exactly the host model's bytes, written in one chunk or two, and nothing else.
    #[test]
    fn the_kernel_writes_the_host_model_s_kv_byte_for_byte() {
        let Some(ctx) = gpu0() else { return };
        let (shape, num_blocks) = (KvShape::QWEN3_8B, 80);
        let tokens = prompt(1000);
        let blocks: Vec<BlockId> = (17..=79).collect();
        let host = KvCache::new(shape, num_blocks);
        let model = Model { shape, vocab_size: 151_936 };
        let mut item = ForwardItem {
            tokens: tokens.clone(),
            start: 0,
            block_ids: blocks.clone(),
            group_blocks: Vec::new(),
            digest: ContextDigest::default(),
            sample: false,
        };
        model.forward(&host, &mut item).expect("host forward");
        let fill = CudaKvFill::new(&ctx).expect("kernel compiles");
        for chunks in [&[(0, 1000)][..], &[(0, 600), (600, 1000)]] {
            let device = device_regions(&ctx, shape, num_blocks);
            let bases: Vec<u64> = device.iter().map(|d| d.ptr).collect();
            for &(from, to) in chunks {
                fill.fill(&bases, num_blocks, shape, &tokens[from..to], from, &blocks).expect("filled");
            }
            assert_same_bytes(&host, &device);
        }
    }

    /// A small shape whose slots are not a whole number of 8-byte words (head_dim 3: 12 bytes).
    #[test]
    fn slots_cut_short_of_a_word_match_too() {
        let Some(ctx) = gpu0() else { return };
        let (shape, num_blocks) =
            (KvShape { num_layers: 3, num_kv_heads: 2, head_dim: 3, dtype_bytes: 2, block_size: 4 }, 8);
        let tokens = prompt(13);
        let blocks: Vec<BlockId> = vec![6, 1, 4, 2];
        let host = KvCache::new(shape, num_blocks);
        let mut item = ForwardItem {
            tokens: tokens.clone(),
            start: 0,
            block_ids: blocks.clone(),
            group_blocks: Vec::new(),
            digest: ContextDigest::default(),
            sample: false,
        };
        Model { shape, vocab_size: 151_936 }.forward(&host, &mut item).expect("host forward");
        let device = device_regions(&ctx, shape, num_blocks);
        let bases: Vec<u64> = device.iter().map(|d| d.ptr).collect();
        CudaKvFill::new(&ctx)
            .expect("kernel compiles")
            .fill(&bases, num_blocks, shape, &tokens, 0, &blocks)
            .expect("filled");
        assert_same_bytes(&host, &device);
    }

    /// Positions past the request's blocks, or blocks past the regions, are refused before the
    /// launch: the regions stay zero.
    #[test]
    fn out_of_range_positions_and_blocks_are_refused_before_the_launch() {
        let Some(ctx) = gpu0() else { return };
        let (shape, num_blocks) =
            (KvShape { num_layers: 2, num_kv_heads: 2, head_dim: 8, dtype_bytes: 2, block_size: 4 }, 8);
        let device = device_regions(&ctx, shape, num_blocks);
        let bases: Vec<u64> = device.iter().map(|d| d.ptr).collect();
        let fill = CudaKvFill::new(&ctx).expect("kernel compiles");
        let tokens = prompt(9);
        assert!(
            matches!(fill.fill(&bases, num_blocks, shape, &tokens, 0, &[0, 1]), Err(CudaError::OutOfBounds { .. })),
            "9 positions, 8 slots"
        );
        assert!(
            matches!(fill.fill(&bases, num_blocks, shape, &tokens, 0, &[0, 1, 8]), Err(CudaError::OutOfBounds { .. })),
            "block 8 of 8"
        );
        for d in &device {
            let mut got = vec![1u8; d.len];
            d.read(0, &mut got).expect("read back");
            assert!(got.iter().all(|&b| b == 0), "a refused fill wrote bytes");
        }
    }
}
