//! The engine's configuration (docs/simulated-engine.md): one typed struct, defaults from the seed (Qwen/Qwen3-8B,
//! block 16, `max_num_batched_tokens` 8192, `max_model_len` 4096); prefix caching, KV events
//! and the timing model off.

use pdflow_kv::memory::KvShape;

use crate::hybrid::HybridLayout;
use crate::kv_events::{KvEventsConfig, KvEventsError};
use crate::timing::ForwardTiming;

/// A combination of settings the engine cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("prefix caching is simulated for dense models only, and this one is hybrid (KV-cache groups {groups}): run it without --enable-prefix-caching")]
    HybridPrefixCaching { groups: String },
    #[error(transparent)]
    KvEvents(#[from] KvEventsError),
}

/// What D does when a remote KV load fails (vLLM's `kv_load_failure_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadFailurePolicy {
    /// Prefill the prompt locally (the blocks are kept and rewritten).
    #[default]
    Recompute,
    /// Finish the request with an error; the client gets an HTTP error.
    Fail,
}

/// The simulated engine's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    pub engine_id: String,
    pub served_model_name: String,
    /// The whole model's KV shape: every layer and KV head (a ranked engine's ranks each hold a
    /// part of it).
    pub shape: KvShape,
    /// KV blocks of the engine (of each rank's cache, all under the same block ids).
    pub num_blocks: usize,
    /// Token budget of one step; a smaller value than a prompt means chunked prefill.
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    pub vocab_size: u32,
    pub eos_token_id: u32,
    pub kv_load_failure_policy: LoadFailurePolicy,
    /// Deadline of the states in which the engine holds blocks for the connector
    /// (`WAITING_FOR_REMOTE_KVS` and aborted-while-receiving on D, finished-with-delayed-free on
    /// P): past it, D treats the load as failed (then `kv_load_failure_policy`) and P frees the
    /// blocks — even if the connector lost track of the request (an actor restarted). Set it
    /// longer than every deadline of the transfer path, so that no write can still land.
    /// `None`: no deadline.
    pub kv_state_timeout: Option<std::time::Duration>,
    /// Run the model's forward pinned to this CPU, apart from the threads of the connector and
    /// the network stack (as a GPU's forward is); `None`: wherever the OS schedules it.
    pub forward_cpu: Option<usize>,
    /// A hybrid model's layers and KV-cache groups ([`crate::hybrid`]); `shape` is then one KV
    /// region per layer of a group. None: a dense model, one region per layer.
    pub hybrid: Option<HybridLayout>,
    /// vLLM's `--enable-prefix-caching` (`crate::block_pool`); dense models only.
    pub enable_prefix_caching: bool,
    /// vLLM's `--kv-events-config`: publish the prefix cache's changes (needs prefix caching).
    pub kv_events: Option<KvEventsConfig>,
    /// The engine's data-parallel rank: the `engine` label of its counters, the rank in its KV
    /// event batches, and the offset of its KV event ports (as vLLM's).
    pub data_parallel_rank: u32,
    /// How long a GPU would take over each step ([`crate::timing`]); `None`: as fast as the CPU.
    pub forward_timing: Option<ForwardTiming>,
}

impl EngineConfig {
    /// Blocks a request of `tokens` tokens holds, over every group.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        match &self.hybrid {
            Some(layout) => layout.blocks_for(tokens).iter().sum(),
            None => self.shape.blocks_for(tokens),
        }
    }

    /// Whether the block pool caches prefixes: asked for, on a dense model.
    pub fn prefix_caching(&self) -> bool {
        self.enable_prefix_caching && self.hybrid.is_none()
    }

    /// The KV events config, when events are published.
    pub fn published_kv_events(&self) -> Option<&KvEventsConfig> {
        self.kv_events.as_ref().filter(|c| c.publishes())
    }

    /// Refuses what the engine cannot run: prefix caching on a hybrid model, KV events without
    /// prefix caching or with a bad config. (Started anyway, the engine runs without them.)
    pub fn check(&self) -> Result<(), ConfigError> {
        if let (true, Some(layout)) = (self.enable_prefix_caching, &self.hybrid) {
            let groups = layout.groups.iter().map(|g| g.label()).collect::<Vec<_>>().join(", ");
            return Err(ConfigError::HybridPrefixCaching { groups });
        }
        if let Some(events) = &self.kv_events {
            events.check()?;
            if events.publishes() && !self.enable_prefix_caching {
                return Err(KvEventsError::NeedsPrefixCaching.into());
            }
        }
        Ok(())
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            engine_id: uuid::Uuid::new_v4().to_string(),
            served_model_name: "Qwen/Qwen3-8B".to_owned(),
            shape: KvShape::QWEN3_8B,
            num_blocks: 512,
            max_num_batched_tokens: 8192,
            max_model_len: 4096,
            vocab_size: 32000,
            eos_token_id: 2,
            kv_load_failure_policy: LoadFailurePolicy::Recompute,
            kv_state_timeout: None,
            forward_cpu: None,
            hybrid: None,
            enable_prefix_caching: false,
            kv_events: None,
            data_parallel_rank: 0,
            forward_timing: None,
        }
    }
}
