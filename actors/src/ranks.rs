//! Where a worker sits among its engine's ranks (tensor and pipeline parallel) and the model it
//! shards: what both ends of a pull need to pair D's ranks with P's (step 21) and to plan one
//! pair's bytes (step 28) with [`pdflow_kv::topology`].

use pdflow_kv::memory::{KvCache, KvShape, RegionError};
use pdflow_kv::topology::{
    pair_share, share_digests, HeadLayout, RankPlanError, ShareDigestError, Topology, TopologyError,
};
use pdflow_messages::send_worker::DRank;
use pdflow_messages::BlockId;

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

    /// A peer worker's place, `tp_rank`/`pp_rank` of an engine of `world` (tp, pp) workers, with
    /// this worker's model.
    pub fn peer(&self, tp_rank: u32, pp_rank: u32, world: (u32, u32)) -> Self {
        Self { tp_size: world.0, tp_rank, pp_size: world.1, pp_rank, model: self.model }
    }
}

/// Which end of a pair a worker's own KV cache is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairEnd {
    /// P, digesting before it writes.
    P,
    /// D, digesting once the writes landed.
    D,
}

/// Why the digests of blocks (whole, or a rank pair's share of them) could not be computed. Never
/// fatal: the KV is then not checked (P) or not used (D), and the text says why.
#[derive(Debug, thiserror::Error)]
pub enum DigestError {
    /// P's ranks do not form a topology.
    #[error("P's ranks: {0}")]
    PRanks(#[source] TopologyError),
    /// D's ranks do not form a topology.
    #[error("D's ranks: {0}")]
    DRanks(#[source] TopologyError),
    /// The pair's share, or the alignment of P's blocks with D's, could not be planned.
    #[error(transparent)]
    Pair(#[from] RankPlanError),
    /// The share's runs could not be read from the cache.
    #[error(transparent)]
    Share(#[from] ShareDigestError),
    /// Whole blocks could not be read from the cache.
    #[error(transparent)]
    Blocks(#[from] RegionError),
}

/// With `verify_checksums` between sharded engines: per block of `blocks` (in `kv_cache`, the
/// cache of the pair's `end`), the digest of the (layer, head) runs P worker `p` writes into D
/// worker `d` ([`pdflow_kv::topology::share_digests`]). Both ends compute it alike, so equal
/// digests mean D holds what P wrote. Empty when the pair moves nothing.
pub fn pair_share_digests(
    kv_cache: &KvCache,
    (p, d): (&WorkerRank, &WorkerRank),
    end: PairEnd,
    blocks: &[BlockId],
) -> Result<Vec<u64>, DigestError> {
    let p_topology = p.topology().map_err(DigestError::PRanks)?;
    let d_topology = d.topology().map_err(DigestError::DRanks)?;
    let heads = p.heads();
    let share = pair_share(&p_topology, &d_topology, &heads, (p.index(), d.index()))?;
    if share.is_empty() {
        return Ok(Vec::new());
    }
    let holder = match end {
        PairEnd::P => &p_topology.ranks()[p.index()],
        PairEnd::D => &d_topology.ranks()[d.index()],
    };
    Ok(share_digests(kv_cache, holder, &heads, &share, blocks)?)
}
