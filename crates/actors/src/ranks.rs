//! Where a worker sits among its engine's ranks (tensor and pipeline parallel) and the model it
//! shards: what both ends of a pull need to pair D's ranks with P's (step 21) and to plan one
//! pair's bytes (step 28) with [`pdflow_kv::topology`].

use pdflow_kv::memory::KvShape;
use pdflow_kv::topology::{HeadLayout, Topology, TopologyError};
use pdflow_messages::send_worker::DRank;

/// One worker's place in its engine. `model` is the whole model's KV shape (every layer, every
/// KV head); the worker's own cache holds its share of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerRank {
    pub tp_size: u32,
    pub tp_rank: u32,
    pub pp_size: u32,
    pub pp_rank: u32,
    pub model: KvShape,
}

impl WorkerRank {
    /// The one worker of an engine that is not sharded.
    pub fn single(model: KvShape) -> Self {
        Self { tp_size: 1, tp_rank: 0, pp_size: 1, pp_rank: 0, model }
    }

    /// Whether the engine has this one worker only.
    pub fn is_single(&self) -> bool {
        self.tp_size == 1 && self.pp_size == 1
    }

    /// This worker's index among its engine's ranks, as vLLM numbers them (`pp_rank * tp_size +
    /// tp_rank`) and as [`Topology`] lists them.
    pub fn index(&self) -> usize {
        self.pp_rank as usize * self.tp_size as usize + self.tp_rank as usize
    }

    /// The ranks of this worker's engine (vLLM's default split of layers over stages).
    pub fn topology(&self) -> Result<Topology, TopologyError> {
        self.engine_of(self.tp_size, self.pp_size)
    }

    /// The ranks of a peer engine of `tp` × `pp` workers running the same model.
    pub fn engine_of(&self, tp: u32, pp: u32) -> Result<Topology, TopologyError> {
        Topology::uniform(tp as usize, pp as usize, self.model.num_layers, self.model.num_kv_heads)
    }

    /// The model's KV heads as the planner lays them out.
    pub fn heads(&self) -> HeadLayout {
        HeadLayout::from_shape(&self.model)
    }

    /// A pulling D worker's place, with this (P) worker's model.
    pub fn of_puller(&self, d: DRank) -> Self {
        Self { tp_size: d.tp_size, tp_rank: d.tp_rank, pp_size: d.pp_size, pp_rank: d.pp_rank, model: self.model }
    }
}
