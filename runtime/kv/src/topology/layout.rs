//! What a plan covers: the KV heads' byte layout, and which layers and heads each rank holds.

use std::ops::Range;

use super::error::TopologyError;
use super::partition::{check_tp, pp_partition, tp_heads};
use crate::memory::KvShape;

/// The per-layer shape planned over: `num_kv_heads` heads, each token of one head `slot_len`
/// bytes, `block_size` tokens a block. One block of one layer holds, per local head, one run of
/// `block_size * slot_len` bytes.
///
/// Standard attention: `slot_len = 2 * head_dim * dtype_bytes` (K and V side by side,
/// [`HeadLayout::from_shape`]). MLA (DeepSeek): one latent "head" of 576 values per token, no
/// separate K and V, the same on every TP rank: `num_kv_heads = 1`, `slot_len = 576 *
/// dtype_bytes` ([`HeadLayout::mla`]); a topology of any tp then replicates it on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HeadLayout {
    pub num_kv_heads: usize,
    pub slot_len: usize,
    pub block_size: usize,
}

impl HeadLayout {
    /// Values per token of DeepSeek's MLA latent (512 compressed KV + 64 rope).
    pub const MLA_LATENT_VALUES: usize = 576;

    /// The heads of a standard-attention shape (K and V per head).
    pub fn from_shape(shape: &KvShape) -> Self {
        Self { num_kv_heads: shape.num_kv_heads, slot_len: shape.slot_len(), block_size: shape.block_size }
    }

    /// MLA's one latent head of [`Self::MLA_LATENT_VALUES`] values per token.
    pub fn mla(dtype_bytes: usize, block_size: usize) -> Self {
        Self { num_kv_heads: 1, slot_len: Self::MLA_LATENT_VALUES * dtype_bytes, block_size }
    }

    /// Bytes of one head's run in one block of one layer.
    pub fn head_run_len(&self) -> usize {
        self.block_size * self.slot_len
    }
}

/// What one rank holds: one region per layer of `layers` (region `i` is layer `layers.start +
/// i`), each block of which holds the heads of `heads` in ascending order.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RankLayout {
    pub layers: Range<usize>,
    pub heads: Range<usize>,
}

impl RankLayout {
    /// Whether this rank holds `head` of `layer`.
    pub fn holds(&self, layer: usize, head: usize) -> bool {
        self.layers.contains(&layer) && self.heads.contains(&head)
    }

    /// Bytes of one block in each of this rank's regions.
    pub fn block_len(&self, heads: &HeadLayout) -> usize {
        self.heads.len() * heads.head_run_len()
    }
}

/// An engine's ranks: which layers and KV heads each holds. Rank indices are the positions in
/// [`Topology::ranks`]; the tp/pp constructors number them as vLLM does, `stage * tp + tp_rank`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    num_layers: usize,
    num_kv_heads: usize,
    ranks: Vec<RankLayout>,
}

impl Topology {
    /// Explicit ranks (the most general form: what vLLM's registered layer names give each
    /// worker). Every rank must hold a non-empty range of layers and of heads inside the model,
    /// and every (layer, head) must have a holder; ranges may overlap (replicas).
    pub fn new(num_layers: usize, num_kv_heads: usize, ranks: Vec<RankLayout>) -> Result<Self, TopologyError> {
        if num_layers == 0 {
            return Err(TopologyError::Zero { what: "num_layers" });
        }
        if num_kv_heads == 0 {
            return Err(TopologyError::Zero { what: "num_kv_heads" });
        }
        if ranks.is_empty() {
            return Err(TopologyError::NoRanks);
        }
        for (rank, r) in ranks.iter().enumerate() {
            check_range(&r.layers, num_layers).map_err(|(start, end)| TopologyError::BadLayers {
                rank,
                start,
                end,
                num_layers,
            })?;
            check_range(&r.heads, num_kv_heads).map_err(|(start, end)| TopologyError::BadHeads {
                rank,
                start,
                end,
                num_kv_heads,
            })?;
        }
        let topology = Self { num_layers, num_kv_heads, ranks };
        topology.check_covered()?;
        Ok(topology)
    }

    /// `tp` ranks per stage, stage `s` holding `stage_layers[s]` consecutive layers (vLLM's
    /// `VLLM_PP_LAYER_PARTITION`), heads sharded as [`tp_heads`] says.
    pub fn with_stages(tp: usize, stage_layers: &[usize], num_kv_heads: usize) -> Result<Self, TopologyError> {
        check_tp(tp, num_kv_heads)?;
        if stage_layers.is_empty() {
            return Err(TopologyError::Zero { what: "pp" });
        }
        if let Some(stage) = stage_layers.iter().position(|&n| n == 0) {
            return Err(TopologyError::EmptyStage { stage });
        }
        let num_layers = stage_layers.iter().sum();
        let mut ranks = Vec::with_capacity(stage_layers.len() * tp);
        let mut start = 0;
        for &count in stage_layers {
            for tp_rank in 0..tp {
                ranks.push(RankLayout { layers: start..start + count, heads: tp_heads(tp_rank, tp, num_kv_heads)? });
            }
            start += count;
        }
        Self::new(num_layers, num_kv_heads, ranks)
    }

    /// `tp` × `pp` ranks with vLLM's default layer split ([`pp_partition`]).
    pub fn uniform(tp: usize, pp: usize, num_layers: usize, num_kv_heads: usize) -> Result<Self, TopologyError> {
        let partition = pp_partition(num_layers, pp)?;
        Self::with_stages(tp, &partition, num_kv_heads)
    }

    /// As [`Topology::with_stages`], checking that the partition covers the model's layers.
    pub fn with_partition(
        tp: usize,
        stage_layers: &[usize],
        num_layers: usize,
        num_kv_heads: usize,
    ) -> Result<Self, TopologyError> {
        let sum: usize = stage_layers.iter().sum();
        if sum != num_layers {
            return Err(TopologyError::PartitionSum { partition: stage_layers.to_vec(), sum, num_layers });
        }
        Self::with_stages(tp, stage_layers, num_kv_heads)
    }

    pub fn num_layers(&self) -> usize {
        self.num_layers
    }
    pub fn num_kv_heads(&self) -> usize {
        self.num_kv_heads
    }
    pub fn ranks(&self) -> &[RankLayout] {
        &self.ranks
    }

    /// The ranks that hold `head` of `layer`, ascending.
    pub fn holders(&self, layer: usize, head: usize) -> Vec<usize> {
        (0..self.ranks.len()).filter(|&r| self.ranks[r].holds(layer, head)).collect()
    }

    fn check_covered(&self) -> Result<(), TopologyError> {
        for layer in 0..self.num_layers {
            for head in 0..self.num_kv_heads {
                if !self.ranks.iter().any(|r| r.holds(layer, head)) {
                    return Err(TopologyError::Uncovered { layer, head });
                }
            }
        }
        Ok(())
    }
}

/// `Err((start, end))` unless `range` is non-empty and inside `0..limit`.
fn check_range(range: &Range<usize>, limit: usize) -> Result<(), (usize, usize)> {
    if range.start < range.end && range.end <= limit {
        Ok(())
    } else {
        Err((range.start, range.end))
    }
}
