//! Memory layout as one peer describes it to another (seed steps 3, 21).
//!
//! A worker registers its KV cache as regions: base address, length and block length. In vLLM
//! 0.33's LBHNC layout a region is one layer, K and V side by side, 64 KiB per block for Qwen3-8B.

use serde::{Deserialize, Serialize};

/// One registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDesc {
    pub base_addr: u64,
    pub len: u64,
    /// Bytes of one KV block inside this region.
    pub block_len: u64,
}

impl RegionDesc {
    /// Address of block `block_id` in this region.
    pub fn block_addr(&self, block_id: u32) -> u64 {
        self.base_addr + u64::from(block_id) * self.block_len
    }

    /// How many blocks the region holds.
    pub fn num_blocks(&self) -> u64 {
        self.len.checked_div(self.block_len).unwrap_or(0)
    }
}

/// A worker's whole KV layout, identified by a random `layout_id` so a peer can cache it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    pub layout_id: u64,
    pub regions: Vec<RegionDesc>,
}
