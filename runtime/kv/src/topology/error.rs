//! Why a topology is invalid, or why two topologies cannot be planned against each other.

use pdflow_messages::BlockId;

/// Which engine a value belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The prefill engine (the sender).
    P,
    /// The decode engine (the receiver).
    D,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::P => "P",
            Side::D => "D",
        })
    }
}

/// Why a rank layout cannot be built; each message says what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    #[error("{what} is 0: a topology needs at least one TP rank, one pipeline stage, one layer and one KV head")]
    Zero { what: &'static str },
    #[error("tp {tp} does not divide the model's {num_kv_heads} KV heads: choose a tp that divides {num_kv_heads} (each rank then holds {num_kv_heads}/tp heads) or a multiple of {num_kv_heads} (each head then lives on tp/{num_kv_heads} ranks)")]
    HeadsNotDivisible { tp: usize, num_kv_heads: usize },
    #[error("tp {tp} exceeds the model's {num_kv_heads} KV heads but is not a multiple of it: choose a tp that is a multiple of {num_kv_heads} (each head then lives on tp/{num_kv_heads} ranks) or one that divides it")]
    TpNotMultipleOfHeads { tp: usize, num_kv_heads: usize },
    #[error("tp rank {tp_rank} does not exist with tp {tp}: TP ranks are 0..{tp}")]
    NoSuchTpRank { tp_rank: usize, tp: usize },
    #[error(
        "pp {pp} exceeds the model's {num_layers} layers: every pipeline stage needs a layer; use pp <= {num_layers}"
    )]
    MoreStagesThanLayers { pp: usize, num_layers: usize },
    #[error("the stage partition {partition:?} covers {sum} layers but the model has {num_layers}: make the per-stage layer counts add up to {num_layers}")]
    PartitionSum { partition: Vec<usize>, sum: usize, num_layers: usize },
    #[error("pipeline stage {stage} holds no layer: give every stage at least one layer, or use fewer stages")]
    EmptyStage { stage: usize },
    #[error("a topology needs at least one rank")]
    NoRanks,
    #[error("rank {rank} holds layers {start}..{end}: give it a non-empty range inside 0..{num_layers}")]
    BadLayers { rank: usize, start: usize, end: usize, num_layers: usize },
    #[error("rank {rank} holds KV heads {start}..{end}: give it a non-empty range inside 0..{num_kv_heads}")]
    BadHeads { rank: usize, start: usize, end: usize, num_kv_heads: usize },
    #[error("no rank holds KV head {head} of layer {layer}: every (layer, head) needs a rank that holds it")]
    Uncovered { layer: usize, head: usize },
}

/// Why a transfer plan across ranks cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RankPlanError {
    #[error("P's topology has {p} layers and D's has {d}: the two engines do not run the same model")]
    LayerCountMismatch { p: usize, d: usize },
    #[error("{side}'s topology has {topology} KV heads but the head layout has {layout}: plan with the model's KV head count on both sides (MLA: 1)")]
    HeadCountMismatch { side: Side, topology: usize, layout: usize },
    #[error("the head layout has {what} 0: a block needs at least one token slot of at least one byte")]
    EmptyHeadLayout { what: &'static str },
    #[error(
        "P holds {p} blocks for the request and D asks for {d}: align them first (D asks for P's tail: see align_tail)"
    )]
    BlockCountMismatch { p: usize, d: usize },
    #[error("D asks for {d} blocks but P holds only {p}: D cannot ask for more of the prompt than P computed")]
    PTooShort { p: usize, d: usize },
    #[error("D's block {block} appears twice in the request: two prompt positions would land in one block")]
    DuplicateDestination { block: BlockId },
    #[error("{side}'s block {block} at {block_len} bytes per block overflows a 64-bit offset")]
    TooLarge { side: Side, block: BlockId, block_len: u64 },
    #[error("no P rank holds KV head {head} of layer {layer}, which D rank {d_rank} needs")]
    NoHolder { d_rank: usize, layer: usize, head: usize },
}
