//! An engine node's ranks: the model's KV sharded over `tp × pp` workers as vLLM shards it (KV
//! heads over tensor ranks, replicated when tp exceeds them; layers over pipeline stages by
//! vLLM's default split), one KV cache per rank.

use std::sync::Arc;

use pdflow_actors::ranks::WorkerRank;
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_kv::topology::{RankLayout, Topology};
use pdflow_sim_engine::Rank;

use crate::engine_node::{EngineNodeConfig, Parallel};
use crate::error::SimNodeError;

/// The ranks of one engine, in vLLM's order (`pp_rank * tp + tp_rank`).
pub struct RankTopology {
    pub ranks: Vec<Rank>,
    parallel: Parallel,
    model: KvShape,
}

impl RankTopology {
    /// The ranks `cfg.parallel` asks for over `cfg.engine.shape`, each with its KV cache; one rank
    /// holding everything (in `first`, the node's cache) when nothing is parallel.
    pub fn new(
        cfg: &EngineNodeConfig,
        first: impl FnOnce() -> Result<Arc<KvCache>, SimNodeError>,
    ) -> Result<Self, SimNodeError> {
        let blocks = cfg.engine.num_blocks;
        Self::with_caches(cfg, first, |_, shape| Ok(KvCache::new(shape, blocks)))
    }

    /// As [`RankTopology::new`], each sharded rank's cache made by `cache(rank, shape)`.
    pub fn with_caches(
        cfg: &EngineNodeConfig,
        first: impl FnOnce() -> Result<Arc<KvCache>, SimNodeError>,
        mut cache: impl FnMut(usize, KvShape) -> Result<Arc<KvCache>, SimNodeError>,
    ) -> Result<Self, SimNodeError> {
        let (parallel, model) = (cfg.parallel, cfg.engine.shape);
        if parallel == Parallel::default() {
            return Ok(Self { ranks: vec![(whole_model(model), first()?)], parallel, model });
        }
        let ranks = Self::layouts(cfg)?
            .into_iter()
            .enumerate()
            .map(|(i, layout)| {
                let shape = rank_shape(model, &layout);
                Ok((layout, cache(i, shape)?))
            })
            .collect::<Result<Vec<_>, SimNodeError>>()?;
        Ok(Self { ranks, parallel, model })
    }

    /// The layers and KV heads of each rank `cfg.parallel` asks for, checked against the model.
    pub fn layouts(cfg: &EngineNodeConfig) -> Result<Vec<RankLayout>, SimNodeError> {
        let (Parallel { tp, pp }, model) = (cfg.parallel, cfg.engine.shape);
        if tp == 0 || pp == 0 {
            return Err(SimNodeError::ParallelSize { tp, pp });
        }
        if cfg.parallel == Parallel::default() {
            return Ok(vec![whole_model(model)]);
        }
        if let Some(device) = cfg.kv_device {
            return Err(SimNodeError::ShardedOnGpu { device });
        }
        let topology = Topology::uniform(tp as usize, pp as usize, model.num_layers, model.num_kv_heads)
            .map_err(|source| SimNodeError::Topology { tp, pp, source })?;
        Ok(topology.ranks().to_vec())
    }

    /// Rank `index`'s place, as its worker actors know it.
    pub fn worker_rank(&self, index: usize) -> WorkerRank {
        worker_rank(self.parallel, self.model, index)
    }
}

/// Rank `index`'s place among `parallel`'s ranks over `model`, as its worker actors know it.
pub fn worker_rank(parallel: Parallel, model: KvShape, index: usize) -> WorkerRank {
    let tp = parallel.tp;
    WorkerRank { tp_size: tp, tp_rank: index as u32 % tp, pp_size: parallel.pp, pp_rank: index as u32 / tp, model }
}

/// What the one rank of an engine that is not sharded holds: every layer and head of `model`.
fn whole_model(model: KvShape) -> RankLayout {
    RankLayout { layers: 0..model.num_layers, heads: 0..model.num_kv_heads }
}

/// The KV shape of a rank holding `layout` of `model`.
pub fn rank_shape(model: KvShape, layout: &RankLayout) -> KvShape {
    KvShape { num_layers: layout.layers.len(), num_kv_heads: layout.heads.len(), ..model }
}
