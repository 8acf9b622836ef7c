//! KV cache events (vLLM's `vllm/distributed/kv_events.py`): what enters and leaves the prefix
//! cache, published after each step that changed it, so that a router knows which engine holds
//! which prefix.
//!
//! - [`KvEvent`]: `BlockStored`, `BlockRemoved`, `AllBlocksCleared`, as the block pool queues
//!   them (`block_pool.rs`);
//! - [`encode`]: one step's batch in vLLM 0.33's msgpack form;
//! - [`config`]: `--kv-events-config` (vLLM's `KVEventsConfig` keys);
//! - [`publisher`]: the ZeroMQ PUB socket and the replay ROUTER (vLLM's `ZmqEventPublisher`).

pub mod config;
pub mod encode;
pub mod publisher;

pub use config::{KvEventsConfig, KvEventsError};
pub use publisher::KvEventPublisher;

/// The storage medium the events name (vLLM's `MEDIUM_GPU`, its block pool's default).
pub const MEDIUM: &str = "GPU";

/// One change to the prefix cache. Hashes are the 64-bit external form
/// ([`crate::block_hash::BlockHash::external`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks entered the cache: their hashes in prompt order, the hash of the block before
    /// the first (`None`: they start the prompt), their tokens, and the block size.
    BlockStored { block_hashes: Vec<u64>, parent_block_hash: Option<u64>, token_ids: Vec<u32>, block_size: usize },
    /// A block left the cache (evicted by an allocation).
    BlockRemoved { block_hashes: Vec<u64> },
    /// Every block left the cache (a prefix-cache reset).
    AllBlocksCleared,
}

/// One step's events (vLLM's `KVEventBatch`).
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// Seconds since the Unix epoch when the step ended.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    /// The engine's data-parallel rank (vLLM's publisher always sets it).
    pub data_parallel_rank: Option<u32>,
}
