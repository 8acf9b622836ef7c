//! The transfer plan (seed step 28): for each region (layer), the source and destination address of
//! every block, coalesced into one descriptor per run of blocks that are contiguous on both sides.
//!
//! With P's blocks 17..=79 and D's 512..=574 in Qwen3-8B's layout, the plan is 36 descriptors of
//! 63 × 64 KiB; without coalescing it is 2,268 descriptors of 64 KiB.

use pdflow_messages::layout::RegionDesc;
use pdflow_messages::BlockId;

/// One write: `len` bytes from local `src` to remote `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Descriptor {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// A batch of descriptors.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TransferPlan {
    pub descriptors: Vec<Descriptor>,
}

impl TransferPlan {
    pub fn total_bytes(&self) -> u64 {
        self.descriptors.iter().map(|d| d.len).sum()
    }
}

/// Why two layouts cannot be planned against each other.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("P has {src} KV regions and D has {dst}: the two engines do not run the same model layout")]
    RegionCountMismatch { src: usize, dst: usize },
    #[error("region {region}: P's block is {src} bytes and D's is {dst}: block size or KV layout differ")]
    BlockLenMismatch { region: usize, src: u64, dst: u64 },
    #[error("P holds {src} blocks for the request and D offers {dst}: prompt lengths differ")]
    BlockCountMismatch { src: usize, dst: usize },
    #[error("block {block} lies outside region {region} ({num_blocks} blocks)")]
    BlockOutOfRange { region: usize, block: BlockId, num_blocks: u64 },
}

/// Builds the plan. `coalesce = false` gives one descriptor per block per region (for benchmarks).
pub fn build_plan(
    src_regions: &[RegionDesc],
    src_blocks: &[BlockId],
    dst_regions: &[RegionDesc],
    dst_blocks: &[BlockId],
    coalesce: bool,
) -> Result<TransferPlan, PlanError> {
    if src_regions.len() != dst_regions.len() {
        return Err(PlanError::RegionCountMismatch { src: src_regions.len(), dst: dst_regions.len() });
    }
    if src_blocks.len() != dst_blocks.len() {
        return Err(PlanError::BlockCountMismatch { src: src_blocks.len(), dst: dst_blocks.len() });
    }
    let runs = if coalesce { contiguous_runs(src_blocks, dst_blocks) } else { (0..src_blocks.len()).map(|i| (i, 1)).collect() };
    let mut descriptors = Vec::with_capacity(runs.len() * src_regions.len());
    for (region, (s, d)) in src_regions.iter().zip(dst_regions).enumerate() {
        if s.block_len != d.block_len {
            return Err(PlanError::BlockLenMismatch { region, src: s.block_len, dst: d.block_len });
        }
        for (blocks, r) in [(src_blocks, s), (dst_blocks, d)] {
            if let Some(&block) = blocks.iter().find(|&&b| u64::from(b) >= r.num_blocks()) {
                return Err(PlanError::BlockOutOfRange { region, block, num_blocks: r.num_blocks() });
            }
        }
        for &(start, len) in &runs {
            descriptors.push(Descriptor {
                src: s.block_addr(src_blocks[start]),
                dst: d.block_addr(dst_blocks[start]),
                len: len as u64 * s.block_len,
            });
        }
    }
    Ok(TransferPlan { descriptors })
}

/// Runs `(start index, length)` over which both id lists advance by exactly one.
pub fn contiguous_runs(src: &[BlockId], dst: &[BlockId]) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for i in 0..src.len().min(dst.len()) {
        match runs.last_mut() {
            Some((start, len))
                if src[*start + *len - 1].checked_add(1) == Some(src[i]) && dst[*start + *len - 1].checked_add(1) == Some(dst[i]) =>
            {
                *len += 1
            }
            _ => runs.push((i, 1)),
        }
    }
    runs
}
