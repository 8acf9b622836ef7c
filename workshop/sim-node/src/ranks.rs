//! An engine node's ranks: the model's KV sharded over `tp × pp` workers as vLLM shards it (KV
//! heads over tensor ranks, replicated when tp exceeds them; layers over pipeline stages by
//! vLLM's default split), one KV cache per rank.

use std::sync::Arc;

use pdflow_actors::ranks::WorkerRank;
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_kv::topology::{RankLayout, Topology};
use pdflow_sim_engine::Rank;

use crate::engine_node::{EngineNodeConfig, Parallel};
use pdflow_node::NodeError;

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
        first: impl FnOnce() -> Result<Arc<KvCache>, NodeError>,
    ) -> Result<Self, NodeError> {
        let blocks = cfg.engine.num_blocks;
        Self::with_caches(cfg, first, |_, shape| Ok(KvCache::new(shape, blocks)))
    }

    /// As [`RankTopology::new`], each sharded rank's cache made by `cache(rank, shape)`.
    pub fn with_caches(
        cfg: &EngineNodeConfig,
        first: impl FnOnce() -> Result<Arc<KvCache>, NodeError>,
        mut cache: impl FnMut(usize, KvShape) -> Result<Arc<KvCache>, NodeError>,
    ) -> Result<Self, NodeError> {
        let (parallel, model) = (cfg.parallel, cfg.engine.shape);
        let layouts = Self::layouts(cfg)?;
        if parallel == Parallel::default() {
            let whole = layouts.into_iter().next().ok_or_else(|| NodeError::Config("no rank".into()))?;
            return Ok(Self { ranks: vec![(whole, first()?)], parallel, model });
        }
        let ranks = layouts
            .into_iter()
            .enumerate()
            .map(|(i, layout)| {
                let shape = rank_shape(model, &layout);
                Ok((layout, cache(i, shape)?))
            })
            .collect::<Result<Vec<_>, NodeError>>()?;
        Ok(Self { ranks, parallel, model })
    }

    /// The layers and KV heads of each rank `cfg.parallel` asks for, checked against the model.
    pub fn layouts(cfg: &EngineNodeConfig) -> Result<Vec<RankLayout>, NodeError> {
        let (parallel, model) = (cfg.parallel, cfg.engine.shape);
        if parallel.tp == 0 || parallel.pp == 0 {
            return Err(NodeError::Config(format!(
                "tensor and pipeline parallel sizes must be at least 1 (got tp {}, pp {})",
                parallel.tp, parallel.pp
            )));
        }
        if parallel == Parallel::default() {
            return Ok(vec![RankLayout { layers: 0..model.num_layers, heads: 0..model.num_kv_heads }]);
        }
        if cfg.kv_device.is_some() {
            return Err(NodeError::Config(
                "a sharded engine (tp or pp above 1) keeps its KV in host memory: drop --kv-device".into(),
            ));
        }
        let topology =
            Topology::uniform(parallel.tp as usize, parallel.pp as usize, model.num_layers, model.num_kv_heads)
                .map_err(|e| {
                    NodeError::Config(format!("tp {} × pp {} over this model: {e}", parallel.tp, parallel.pp))
                })?;
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

/// The KV shape of a rank holding `layout` of `model`.
pub fn rank_shape(model: KvShape, layout: &RankLayout) -> KvShape {
    KvShape { num_layers: layout.layers.len(), num_kv_heads: layout.heads.len(), ..model }
}
