//! An engine node's ranks: the model's KV sharded over `tp × pp` workers as vLLM shards it (KV
//! heads over tensor ranks, replicated when tp exceeds them; layers over pipeline stages by
//! vLLM's default split), one KV cache per rank.

use std::sync::Arc;

use pdflow_actors::ranks::WorkerRank;
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_kv::topology::{RankLayout, Topology};
use pdflow_sim_engine::Rank;

use crate::engine_node::{EngineNodeConfig, Parallel};
use crate::NodeError;

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
        let (parallel, model) = (cfg.parallel, cfg.engine.shape);
        if parallel.tp == 0 || parallel.pp == 0 {
            return Err(NodeError::Config(format!(
                "tensor and pipeline parallel sizes must be at least 1 (got tp {}, pp {})",
                parallel.tp, parallel.pp
            )));
        }
        if parallel == Parallel::default() {
            let whole = RankLayout { layers: 0..model.num_layers, heads: 0..model.num_kv_heads };
            return Ok(Self { ranks: vec![(whole, first()?)], parallel, model });
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
        let ranks = topology
            .ranks()
            .iter()
            .map(|layout| {
                let shape = KvShape { num_layers: layout.layers.len(), num_kv_heads: layout.heads.len(), ..model };
                (layout.clone(), KvCache::new(shape, cfg.engine.num_blocks))
            })
            .collect();
        Ok(Self { ranks, parallel, model })
    }

    /// Rank `index`'s place, as its worker actors know it.
    pub fn worker_rank(&self, index: usize) -> WorkerRank {
        let tp = self.parallel.tp;
        WorkerRank {
            tp_size: tp,
            tp_rank: index as u32 % tp,
            pp_size: self.parallel.pp,
            pp_rank: index as u32 / tp,
            model: self.model,
        }
    }
}
