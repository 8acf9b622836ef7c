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
//! Engine-owned steps: 11/16 (add request), 15 (prefill forward), 24 (engine output),
//! 38–40 (first token and decode), 42 (HTTP response). With feature `cuda` the KV may live on a
//! GPU: [`cuda_fill`] writes it there with one kernel launch per forward item.

pub mod affinity;
pub mod api;
pub mod block_pool;
pub mod config;
pub mod core;
#[cfg(feature = "cuda")]
pub mod cuda_fill;
pub mod hybrid;
pub mod model;
pub mod openai;
pub mod ranks;
pub mod request;
pub mod scheduler;

pub use self::config::{EngineConfig, LoadFailurePolicy};
pub use self::core::{Engine, EngineHandle};
pub use self::ranks::{Rank, RanksError, ShardedModel};
pub use self::request::{EngineError, EngineRequest, RequestOutput, RequestStream};
pub use self::scheduler::BlockStats;

#[cfg(all(test, feature = "cuda"))]
mod cuda_fill_tests;
#[cfg(test)]
mod ranks_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_pd;
#[cfg(test)]
mod tests_ranked;
