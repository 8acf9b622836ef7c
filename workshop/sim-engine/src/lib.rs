//! The simulated engine (docs/simulated-engine.md): stands in for vLLM wherever vLLM cannot run.
//!
//! Faithful to vLLM v1's scheduler wherever the connector is involved: a paged block pool, chunked
//! prefill, `WAITING_FOR_REMOTE_KVS`, delayed block free on P, `num_computed_tokens = prompt − 1`
//! after a remote load, finish reasons (length vs stop, stop checked first), aborts. Its model is
//! deterministic: the KV of a token is a function of (token, position, layer, head), and each
//! sampled token depends on every KV byte of the context, so a lost or corrupted byte changes the
//! output. It serves vLLM's HTTP API. The model may be sharded over ranks as vLLM shards it
//! (tensor and pipeline parallel, [`ranks`]), each rank with a KV cache of its own; any topology
//! samples a single rank's tokens.
//!
//! What cache- and load-aware routing needs, as vLLM provides it: prefix caching
//! ([`block_pool`], [`block_hash`]: vLLM's chained `sha256_cbor` block hashes), KV events on a
//! ZeroMQ PUB socket in vLLM's wire format ([`kv_events`]), vLLM's prefix-cache counters on
//! `/metrics` ([`cache_stats`]), and a timing model of a GPU's forward ([`timing`]).
//!
//! Engine-owned steps: 11/16 (add request), 15 (prefill forward), 24 (engine output),
//! 38–40 (first token and decode), 42 (HTTP response). With feature `cuda` the KV may live on a
//! GPU: [`cuda_fill`] writes it there with one kernel launch per forward item.

pub mod affinity;
pub mod api;
pub mod block_hash;
pub mod block_pool;
pub mod cache_stats;
pub mod config;
pub mod core;
#[cfg(feature = "cuda")]
pub mod cuda_fill;
mod free_queue;
pub mod hybrid;
pub mod kv_events;
pub mod model;
pub mod openai;
pub mod ranks;
pub mod request;
pub mod scheduler;
pub mod timing;

pub use self::cache_stats::CacheStats;
pub use self::config::{ConfigError, EngineConfig, LoadFailurePolicy};
pub use self::core::{Engine, EngineHandle};
pub use self::ranks::{Rank, RanksError, ShardedModel};
pub use self::request::{EngineError, EngineRequest, RequestOutput, RequestStream};
pub use self::scheduler::BlockStats;
pub use self::timing::ForwardTiming;

#[cfg(all(test, feature = "cuda"))]
mod cuda_fill_tests;
#[cfg(test)]
mod ranks_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_kv_events;
#[cfg(test)]
mod tests_pd;
#[cfg(test)]
mod tests_pd_prefix;
#[cfg(test)]
mod tests_prefix;
#[cfg(test)]
mod tests_ranked;
