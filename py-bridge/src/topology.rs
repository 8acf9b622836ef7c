//! `pdflow._native.WorkerTopology` — where vLLM placed one worker, as `pdflow/vllm.py` reads it
//! from vLLM's parallel state and config, handed to `WorkerConnector.register_kv_caches`. Only a
//! conversion: the checks and the rules (a rank inside its group, a stage's layers one range, the
//! data-parallel rank P registers under, which worker launches the bootstrap) are
//! [`pdflow_node::registration`]'s; Python asks them through the read-only attributes.

use pdflow_node::registration::{DataParallel, GroupRank, WorkerTopology};
use pyo3::prelude::*;

use crate::error::BridgeError;

/// Where one vLLM worker sits in its engine.
#[pyclass(module = "pdflow._native", name = "WorkerTopology", frozen)]
pub struct TopologyBridge(pub WorkerTopology);

#[pymethods]
impl TopologyBridge {
    /// Tensor rank `tp_rank` of `tp_size`, pipeline stage `pp_rank` of `pp_size`; the model's KV
    /// heads before tensor parallelism shards them and its layers over every stage (None: what
    /// this worker registers, times its group); the names of the worker's KV caches in
    /// registration order (vLLM's `model.layers.N…`: a stage's layers); the engine's
    /// data-parallel rank, its rank on this node and whether each node balances its own engines
    /// (vLLM's `local_engines_only`). Raises `ConfigError` for a rank outside its group or a
    /// stage whose layers are not consecutive.
    #[new]
    #[pyo3(signature = (
        *,
        tp_rank = 0,
        tp_size = 1,
        pp_rank = 0,
        pp_size = 1,
        total_kv_heads = None,
        total_layers = None,
        layer_names = None,
        data_parallel_rank = 0,
        data_parallel_rank_local = 0,
        local_engines_only = false,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        tp_rank: u32,
        tp_size: u32,
        pp_rank: u32,
        pp_size: u32,
        total_kv_heads: Option<usize>,
        total_layers: Option<usize>,
        layer_names: Option<Vec<String>>,
        data_parallel_rank: u32,
        data_parallel_rank_local: u32,
        local_engines_only: bool,
    ) -> PyResult<Self> {
        let tensor = GroupRank { rank: tp_rank, size: tp_size };
        let pipeline = GroupRank { rank: pp_rank, size: pp_size };
        let data_parallel =
            DataParallel { rank: data_parallel_rank, local_rank: data_parallel_rank_local, local_engines_only };
        let topology = WorkerTopology::new(tensor, pipeline)
            .and_then(|t| t.with_layer_names(&layer_names.unwrap_or_default()))
            .map_err(BridgeError::from)?
            .with_model(total_kv_heads, total_layers)
            .with_data_parallel(data_parallel);
        Ok(Self(topology))
    }

    /// Whether this worker launches P's bootstrap when no `bootstrap_url` is configured (vLLM's
    /// rule: the first worker of the first data-parallel engine, of each node's first with
    /// `local_engines_only`).
    #[getter]
    fn launches_bootstrap(&self) -> bool {
        self.0.launches_bootstrap()
    }

    /// The data-parallel rank P's workers register under at the bootstrap.
    #[getter]
    fn dp_rank(&self) -> u32 {
        self.0.dp_rank()
    }

    /// The model layer of this pipeline stage's first KV cache, when its names carry one.
    #[getter]
    fn first_layer(&self) -> Option<usize> {
        self.0.first_layer()
    }

    fn __repr__(&self) -> String {
        let (tp, pp) = (self.0.tensor(), self.0.pipeline());
        format!(
            "WorkerTopology(tp {}/{}, pp {}/{}, dp_rank {}, launches_bootstrap={})",
            tp.rank,
            tp.size,
            pp.rank,
            pp.size,
            self.0.dp_rank(),
            if self.0.launches_bootstrap() { "True" } else { "False" }
        )
    }
}
