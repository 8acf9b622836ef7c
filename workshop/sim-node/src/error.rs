//! Why an engine node of the simulated engine could not start: the node's own errors (the
//! production assembly's [`NodeError`]) and those only the simulated engine has — its parallel
//! settings, its sharded ranks, its KV cache on a GPU, its ranks' processes.

use pdflow_kv::topology::TopologyError;
use pdflow_node::NodeError;
use pdflow_sim_engine::RanksError;

use crate::rank_process::RankProcessError;

/// Why an engine node (or a data-parallel group of them) could not start.
#[derive(Debug, thiserror::Error)]
pub enum SimNodeError {
    /// What every node can fail at: an actor, a port, an address, the transfer engine.
    #[error(transparent)]
    Node(#[from] NodeError),
    /// `--tensor-parallel-size` or `--pipeline-parallel-size` of 0.
    #[error("tensor and pipeline parallel sizes must be at least 1 (got tp {tp}, pp {pp})")]
    ParallelSize { tp: u32, pp: u32 },
    /// A sharded engine asked to keep its KV on a GPU.
    #[error("a sharded engine (tp or pp above 1) keeps its KV in host memory: drop --kv-device (got GPU {device})")]
    ShardedOnGpu { device: usize },
    /// The model cannot be sharded over `tp × pp` ranks.
    #[error("tp {tp} × pp {pp} over this model: {source}")]
    Topology { tp: u32, pp: u32, source: TopologyError },
    /// The engine refused its ranks' caches.
    #[error("the engine's ranks: {0}")]
    Ranks(#[source] Box<RanksError>),
    /// The engine's KV cache could not be allocated on its GPU.
    #[error("KV cache on GPU {device}: {source}")]
    KvOnGpu { device: usize, source: Box<dyn std::error::Error + Send + Sync + 'static> },
    /// `--kv-device` in a build without the `cuda` feature.
    #[error("KV cache on GPU {device}: this pdflow was built without GPU support (build it with `cargo build --release --features cuda`)")]
    NoGpuSupport { device: usize },
    /// A data-parallel group of no engine.
    #[error("layer-wise transfer is for models of one KV-cache group: a hybrid model ({groups}) is written whole at the end of its prefill; drop --layerwise")]
    HybridLayerwise { groups: String },
    #[error("a data-parallel group needs at least one rank")]
    NoDataParallelRank,
    /// A rank's process (its shared cache, its socket, its start).
    #[error(transparent)]
    RankProcess(#[from] RankProcessError),
    /// The engine's KV event publisher could not bind its sockets.
    #[error(transparent)]
    KvEvents(#[from] pdflow_sim_engine::kv_events::KvEventsError),
}

impl From<RanksError> for SimNodeError {
    fn from(e: RanksError) -> Self {
        SimNodeError::Ranks(Box::new(e))
    }
}

impl SimNodeError {
    /// The node's error, when that is what failed.
    pub fn node(&self) -> Option<&NodeError> {
        match self {
            SimNodeError::Node(e) => Some(e),
            _ => None,
        }
    }

    /// Whether retrying later may help: a port still held (by a previous incarnation).
    pub fn is_bind(&self) -> bool {
        self.node().is_some_and(NodeError::is_bind)
    }
}
