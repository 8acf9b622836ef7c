//! A vLLM worker's KV registration (seed step 3), checked before anything is registered or
//! started: where the worker sits among its engine's ranks ([`WorkerTopology`]: its tensor and
//! pipeline ranks, its engine's data-parallel rank, what it knows of the model) and the geometry of
//! the KV tensors it hands over ([`KvGeometry`]) become one [`KvRegistration`] — the worker's own
//! cache shape, its [`WorkerRank`] over the whole model, the data-parallel rank it registers under
//! and whether it launches P's bootstrap — or a [`RegistrationError`] that says what disagrees.
//!
//! The rules live here, once: the heads a tensor rank holds and the layers a pipeline stage holds
//! are vLLM's default split ([`WorkerRank::topology`]), which both ends of a pull plan with; the
//! bootstrap is launched by vLLM's rule ([`WorkerTopology::launches_bootstrap`]). The Python bridge
//! only reads vLLM's objects and forwards them.

use std::ops::Range;

use pdflow_actors::ranks::WorkerRank;
use pdflow_kv::memory::KvShape;
use pdflow_kv::topology::TopologyError;

use crate::worker::BootstrapPlacement;

/// A worker's rank in one of its engine's groups (tensor parallel, pipeline parallel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupRank {
    pub rank: u32,
    pub size: u32,
}

impl GroupRank {
    /// The only rank of a group of one.
    pub const SOLE: GroupRank = GroupRank { rank: 0, size: 1 };

    fn is_valid(&self) -> bool {
        self.rank < self.size
    }
}

/// The data-parallel place of a worker's engine, as vLLM reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DataParallel {
    /// The engine's rank among all data-parallel engines (vLLM's `data_parallel_index`, else
    /// `data_parallel_rank`).
    pub rank: u32,
    /// Its rank among the engines of this node (`data_parallel_rank_local`).
    pub local_rank: u32,
    /// External load balancing (`local_engines_only`): each node runs its own engines, and its
    /// first engine its own bootstrap.
    pub local_engines_only: bool,
}

impl DataParallel {
    /// The rank P's workers register under at their bootstrap: the local rank with external load
    /// balancing (each node has its bootstrap), else the global one.
    pub fn registered_rank(&self) -> u32 {
        if self.local_engines_only {
            self.local_rank
        } else {
            self.rank
        }
    }
}

/// A rank outside its group, or a stage's layers that are not one range: vLLM's parallel
/// settings, not the tensors, are at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("tensor parallel rank {rank} of {size}: not a rank of the group")]
    TensorRank { rank: u32, size: u32 },
    #[error("pipeline stage {stage} of {stages}: not a stage of the engine")]
    PipelineStage { stage: u32, stages: u32 },
    #[error(
        "this worker's KV caches are not consecutive layers ({layers:?}): pdflow plans a stage as one range of layers"
    )]
    NonConsecutiveLayers { layers: Vec<usize> },
}

/// Where one worker sits in its engine, as vLLM reports it, checked: every rank lies in its
/// group and a pipeline stage's layers are one range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerTopology {
    tensor: GroupRank,
    pipeline: GroupRank,
    total_kv_heads: Option<usize>,
    total_layers: Option<usize>,
    first_layer: Option<usize>,
    data_parallel: DataParallel,
}

impl Default for WorkerTopology {
    fn default() -> Self {
        Self::single()
    }
}

impl WorkerTopology {
    /// The one worker of an engine that is neither sharded nor data-parallel.
    pub fn single() -> Self {
        Self {
            tensor: GroupRank::SOLE,
            pipeline: GroupRank::SOLE,
            total_kv_heads: None,
            total_layers: None,
            first_layer: None,
            data_parallel: DataParallel::default(),
        }
    }

    /// Tensor rank `tensor` and pipeline stage `pipeline` of one engine.
    pub fn new(tensor: GroupRank, pipeline: GroupRank) -> Result<Self, PlacementError> {
        if !tensor.is_valid() {
            return Err(PlacementError::TensorRank { rank: tensor.rank, size: tensor.size });
        }
        if !pipeline.is_valid() {
            return Err(PlacementError::PipelineStage { stage: pipeline.rank, stages: pipeline.size });
        }
        Ok(Self { tensor, pipeline, ..Self::single() })
    }

    /// What the worker knows of the whole model: its KV heads before tensor parallelism shards
    /// them, and its layers over every stage. Unknown (None), they are taken to be this worker's
    /// times its group's size. A single stage holds whatever was registered: `total_layers` is
    /// read only with pipeline parallelism.
    pub fn with_model(mut self, total_kv_heads: Option<usize>, total_layers: Option<usize>) -> Self {
        self.total_kv_heads = total_kv_heads;
        self.total_layers = total_layers.filter(|_| self.pipeline.size > 1);
        self
    }

    /// The model layers of the worker's KV caches, from their names in registration order
    /// (vLLM's `model.layers.12.self_attn.attn`: the first all-digit part of a dotted name). With
    /// pipeline parallelism they must be consecutive (a stage is one range of layers); when a
    /// name carries no index, or with one stage, nothing is known or checked.
    pub fn with_layer_names<S: AsRef<str>>(mut self, names: &[S]) -> Result<Self, PlacementError> {
        self.first_layer = None;
        if self.pipeline.size <= 1 {
            return Ok(self);
        }
        let Some(layers) = names.iter().map(|n| layer_index(n.as_ref())).collect::<Option<Vec<usize>>>() else {
            return Ok(self);
        };
        let Some(&first) = layers.first() else { return Ok(self) };
        if layers.iter().enumerate().any(|(i, &layer)| layer != first + i) {
            return Err(PlacementError::NonConsecutiveLayers { layers });
        }
        self.first_layer = Some(first);
        Ok(self)
    }

    /// The data-parallel place of the worker's engine.
    pub fn with_data_parallel(mut self, data_parallel: DataParallel) -> Self {
        self.data_parallel = data_parallel;
        self
    }

    pub fn tensor(&self) -> GroupRank {
        self.tensor
    }

    pub fn pipeline(&self) -> GroupRank {
        self.pipeline
    }

    pub fn data_parallel(&self) -> DataParallel {
        self.data_parallel
    }

    /// The model layer of the first KV cache a pipeline stage registered, if its names said.
    pub fn first_layer(&self) -> Option<usize> {
        self.first_layer
    }

    /// The data-parallel rank P's workers register under at the bootstrap.
    pub fn dp_rank(&self) -> u32 {
        self.data_parallel.registered_rank()
    }

    /// Whether this worker launches P's bootstrap when no bootstrap URL is configured — vLLM's
    /// rule: the first worker (tensor and pipeline rank 0) of the first data-parallel engine, or
    /// with external load balancing of each node's first engine.
    pub fn launches_bootstrap(&self) -> bool {
        self.tensor.rank == 0 && self.pipeline.rank == 0 && self.dp_rank() == 0
    }
}

/// The model layer a vLLM layer name carries: its first all-digit dotted part.
fn layer_index(name: &str) -> Option<usize> {
    name.split('.').find(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()))?.parse().ok()
}

/// The geometry of the KV tensors one worker registers: `num_blocks` blocks of `num_kv_heads ×
/// block_size × 2·head_dim` elements of `dtype_bytes` in each region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeometry {
    pub num_blocks: usize,
    pub num_kv_heads: usize,
    pub block_size: usize,
    pub head_dim: usize,
    pub dtype_bytes: usize,
}

/// Why a worker's KV tensors cannot be registered where it sits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistrationError {
    /// No region, or a dimension of 0.
    #[error(
        "empty KV cache: {regions} regions, {} blocks, shape heads={} block={} head_dim={} dtype_bytes={}",
        .geometry.num_blocks, .geometry.num_kv_heads, .geometry.block_size, .geometry.head_dim, .geometry.dtype_bytes
    )]
    Empty { regions: usize, geometry: KvGeometry },
    /// The engine's groups cannot shard this model.
    #[error(
        "tensor parallel size {tp_size} over {total_kv_heads} KV heads, {pp_size} pipeline stages over {total_layers} layers: {source}"
    )]
    Topology { tp_size: u32, total_kv_heads: usize, pp_size: u32, total_layers: usize, source: TopologyError },
    /// The tensors hold another share of the KV heads than the worker's tensor rank does.
    #[error(
        "this worker's KV cache holds {registered} heads but rank {tp_rank} of {tp_size} over {total_kv_heads} KV heads holds {expected}: vLLM shards the heads differently"
    )]
    HeadShare { registered: usize, expected: usize, tp_rank: u32, tp_size: u32, total_kv_heads: usize },
    /// The tensors are other layers than the stage's share of vLLM's default split.
    #[error(
        "pipeline stage {pp_rank} of {pp_size} registered {registered} layers from layer {}, but vLLM's default split of {total_layers} layers gives it layers {expected:?}: pdflow plans with that split (unset VLLM_PP_LAYER_PARTITION)",
        .first_layer.map_or_else(|| "?".to_string(), |f| f.to_string())
    )]
    StageSplit {
        pp_rank: u32,
        pp_size: u32,
        registered: usize,
        first_layer: Option<usize>,
        total_layers: usize,
        expected: Range<usize>,
    },
    /// A pinned base port that leaves this worker's port past 65535.
    #[error(
        "{key} {base} + this worker's index on its host {index} is past 65535: choose a base port at most {}",
        u16::MAX as u32 - .index
    )]
    PortRange { key: &'static str, base: u16, index: u32 },
}

/// One worker's KV registration, checked against its place among the engine's ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvRegistration {
    /// The worker's own cache: one layer per region, its share of the heads.
    pub shape: KvShape,
    pub num_blocks: usize,
    /// Its place among the engine's ranks, over the whole model's shape.
    pub rank: WorkerRank,
    /// The data-parallel rank P's workers register under at the bootstrap.
    pub dp_rank: u32,
    /// Whether it launches P's bootstrap (when none is configured).
    pub launches_bootstrap: bool,
    /// Its index among the workers vLLM runs on this host: `dp_local · tp · pp + pp_rank · tp +
    /// tp_rank`. A pinned base port gives each worker of a host its own port ([`Self::port`]).
    pub local_index: u32,
}

impl KvRegistration {
    /// `regions` KV regions of `geometry`, registered by the worker `topology` places: they must
    /// be the heads of its tensor rank and the layers of its pipeline stage, as vLLM's default
    /// split shards the model.
    pub fn new(regions: usize, geometry: KvGeometry, topology: &WorkerTopology) -> Result<Self, RegistrationError> {
        let KvGeometry { num_blocks, num_kv_heads, block_size, head_dim, dtype_bytes } = geometry;
        if regions == 0 || [num_blocks, num_kv_heads, block_size, head_dim, dtype_bytes].contains(&0) {
            return Err(RegistrationError::Empty { regions, geometry });
        }
        let (tp, pp) = (topology.tensor, topology.pipeline);
        let shape = KvShape { num_layers: regions, num_kv_heads, head_dim, dtype_bytes, block_size };
        // All the model's KV heads at TP 1; with a larger group each rank holds its share (one,
        // replicated, when the group is larger than the heads).
        let total_kv_heads = topology.total_kv_heads.unwrap_or(num_kv_heads * tp.size as usize);
        let total_layers = topology.total_layers.unwrap_or(regions * pp.size as usize);
        let model = KvShape { num_kv_heads: total_kv_heads, num_layers: total_layers, ..shape };
        let rank = WorkerRank { tp_size: tp.size, tp_rank: tp.rank, pp_size: pp.size, pp_rank: pp.rank, model };
        let held = rank.topology().map(|t| t.ranks()[rank.index()].clone()).map_err(|source| {
            RegistrationError::Topology { tp_size: tp.size, total_kv_heads, pp_size: pp.size, total_layers, source }
        })?;
        if held.heads.len() != num_kv_heads {
            return Err(RegistrationError::HeadShare {
                registered: num_kv_heads,
                expected: held.heads.len(),
                tp_rank: tp.rank,
                tp_size: tp.size,
                total_kv_heads,
            });
        }
        if held.layers.len() != regions || topology.first_layer.is_some_and(|first| first != held.layers.start) {
            return Err(RegistrationError::StageSplit {
                pp_rank: pp.rank,
                pp_size: pp.size,
                registered: regions,
                first_layer: topology.first_layer,
                total_layers,
                expected: held.layers,
            });
        }
        Ok(Self {
            shape,
            num_blocks,
            rank,
            dp_rank: topology.dp_rank(),
            launches_bootstrap: topology.launches_bootstrap(),
            local_index: (topology.data_parallel.local_rank * pp.size + pp.rank) * tp.size + tp.rank,
        })
    }

    /// This worker's port for the setting `key` pinned at `base` (0: any port, chosen when it
    /// binds): `base` + its index on the host, so the workers of one host never collide.
    pub fn port(&self, key: &'static str, base: u16) -> Result<u16, RegistrationError> {
        if base == 0 {
            return Ok(0);
        }
        u16::try_from(u32::from(base) + self.local_index).map_err(|_| RegistrationError::PortRange {
            key,
            base,
            index: self.local_index,
        })
    }

    /// Where this worker's bootstrap is, when it produces: at `configured_url` when one is
    /// configured; else launched on `port` of `host` by the worker that launches it, and found
    /// there by the others.
    pub fn bootstrap(&self, configured_url: Option<&str>, host: &str, port: u16) -> BootstrapPlacement {
        match configured_url {
            Some(url) => BootstrapPlacement::External { url: url.to_string() },
            None if self.launches_bootstrap => BootstrapPlacement::Launch { port },
            None => BootstrapPlacement::External { url: format!("http://{host}:{port}") },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GEOMETRY: KvGeometry =
        KvGeometry { num_blocks: 8, num_kv_heads: 8, block_size: 16, head_dim: 128, dtype_bytes: 2 };

    fn stage(rank: u32, size: u32) -> WorkerTopology {
        WorkerTopology::new(GroupRank::SOLE, GroupRank { rank, size }).expect("a stage of the engine")
    }

    #[test]
    fn ranks_outside_their_group_are_refused_by_name() {
        let tp = WorkerTopology::new(GroupRank { rank: 2, size: 2 }, GroupRank::SOLE).expect_err("tp rank 2 of 2");
        assert_eq!(tp, PlacementError::TensorRank { rank: 2, size: 2 });
        let pp = WorkerTopology::new(GroupRank::SOLE, GroupRank { rank: 0, size: 0 }).expect_err("no stage");
        assert!(pp.to_string().contains("pipeline stage 0 of 0"), "{pp}");
    }

    #[test]
    fn a_single_worker_holds_what_it_registered_and_launches_the_bootstrap() {
        let topology = WorkerTopology::single().with_model(None, Some(36)).with_layer_names(&["x.0.a", "x.5.a"]);
        let topology = topology.expect("names are not read with one stage");
        let r = KvRegistration::new(2, GEOMETRY, &topology).expect("one worker");
        assert_eq!((r.rank.model.num_layers, r.rank.model.num_kv_heads), (2, 8));
        assert!(r.launches_bootstrap && r.dp_rank == 0);
        assert_eq!(r.bootstrap(None, "10.0.0.1", 8998), BootstrapPlacement::Launch { port: 8998 });
        assert_eq!(
            r.bootstrap(Some("http://b:1"), "10.0.0.1", 8998),
            BootstrapPlacement::External { url: "http://b:1".into() }
        );
    }

    #[test]
    fn only_the_first_worker_of_the_first_engine_launches_the_bootstrap() {
        let tp1 = WorkerTopology::new(GroupRank { rank: 1, size: 2 }, GroupRank::SOLE).expect("tp 1 of 2");
        assert!(!tp1.launches_bootstrap());
        assert!(!stage(1, 2).launches_bootstrap());
        let dp1 = DataParallel { rank: 1, local_rank: 1, local_engines_only: false };
        assert!(!WorkerTopology::single().with_data_parallel(dp1).launches_bootstrap());
        // External load balancing: each node's first engine launches its own and registers as 0.
        let node2 = DataParallel { rank: 4, local_rank: 0, local_engines_only: true };
        let first_of_node = WorkerTopology::single().with_data_parallel(node2);
        assert!(first_of_node.launches_bootstrap());
        assert_eq!(first_of_node.dp_rank(), 0);
        let r = KvRegistration::new(1, GEOMETRY, &tp1).expect("tp 1 of 2 over 16 heads");
        assert_eq!(
            r.bootstrap(None, "10.0.0.1", 8998),
            BootstrapPlacement::External { url: "http://10.0.0.1:8998".into() }
        );
    }

    #[test]
    fn a_stage_must_hold_its_share_of_the_default_split() {
        let names = ["model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn"];
        let ok = stage(1, 2).with_model(None, Some(4)).with_layer_names(&names).expect("consecutive");
        assert_eq!(ok.first_layer(), Some(2));
        KvRegistration::new(2, GEOMETRY, &ok).expect("stage 1 of 2 over 4 layers holds layers 2 and 3");
        let off = stage(1, 2).with_model(None, Some(4)).with_layer_names(&["l.1", "l.2"]).expect("consecutive");
        let e = KvRegistration::new(2, GEOMETRY, &off).expect_err("layers 1 and 2 are not stage 1's");
        assert!(matches!(e, RegistrationError::StageSplit { expected: Range { start: 2, end: 4 }, .. }), "{e}");
        assert!(e.to_string().contains("default split"), "{e}");
        let gap = stage(0, 2).with_layer_names(&["l.0", "l.2"]).expect_err("a gap");
        assert_eq!(gap, PlacementError::NonConsecutiveLayers { layers: vec![0, 2] });
    }

    #[test]
    fn a_tensor_rank_must_hold_its_share_of_the_heads() {
        let tp = WorkerTopology::new(GroupRank { rank: 0, size: 2 }, GroupRank::SOLE).expect("tp 0 of 2");
        let e = KvRegistration::new(1, GEOMETRY, &tp.clone().with_model(Some(8), None)).expect_err("4 heads each");
        assert!(matches!(e, RegistrationError::HeadShare { registered: 8, expected: 4, .. }), "{e}");
        let e = KvRegistration::new(1, GEOMETRY, &tp.with_model(Some(3), None)).expect_err("3 heads over 2");
        assert!(matches!(e, RegistrationError::Topology { .. }), "{e}");
        let empty = KvGeometry { head_dim: 0, ..GEOMETRY };
        let e = KvRegistration::new(1, empty, &WorkerTopology::single()).expect_err("no head_dim");
        assert!(e.to_string().starts_with("empty KV cache"), "{e}");
    }

    #[test]
    fn a_pinned_port_is_the_base_plus_the_workers_index_on_its_host() {
        let geometry = KvGeometry { num_kv_heads: 4, ..GEOMETRY };
        let worker = |tp_rank, pp_rank, local_rank| {
            let topology =
                WorkerTopology::new(GroupRank { rank: tp_rank, size: 2 }, GroupRank { rank: pp_rank, size: 2 })
                    .expect("a rank of tp 2 x pp 2")
                    .with_model(Some(8), Some(4))
                    .with_data_parallel(DataParallel { rank: 3, local_rank, local_engines_only: false });
            KvRegistration::new(2, geometry, &topology).expect("its share")
        };
        // Every worker of two data-parallel engines of tp 2 x pp 2 on one host: 8 ports, no two alike.
        let mut ports: Vec<u16> = (0..2)
            .flat_map(|dp| (0..2).flat_map(move |pp| (0..2).map(move |tp| (tp, pp, dp))))
            .map(|(tp, pp, dp)| worker(tp, pp, dp).port("data_port", 9000).expect("in range"))
            .collect();
        assert_eq!(worker(1, 1, 1).port("data_port", 9000), Ok(9007), "dp_local 1, pp 1, tp 1: the 8th");
        ports.sort_unstable();
        assert_eq!(ports, (9000..9008).collect::<Vec<_>>());
        assert_eq!(worker(1, 1, 1).port("side_channel_port", 0), Ok(0), "0 stays any port");
        let e = worker(1, 1, 1).port("side_channel_port", 65530).expect_err("65537");
        assert_eq!(e, RegistrationError::PortRange { key: "side_channel_port", base: 65530, index: 7 });
        assert!(e.to_string().contains("at most 65528"), "{e}");
    }
}
