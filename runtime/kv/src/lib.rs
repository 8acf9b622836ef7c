//! pdflow-kv — a worker's KV cache as pdflow sees it, and the plan that moves part of it.
//!
//! # Layout
//! - [`memory`] — a worker's KV cache as registered regions (seed step 3), host or GPU, and the
//!   region table every incoming write is checked against.
//! - [`planner`] — the transfer plan: block ids → (src, dst, len) descriptors, coalescing
//!   contiguous runs (seed step 28).
//! - [`topology`] — the same plan across ranks: for any P and D tensor/pipeline-parallel
//!   topology (and MLA's replicated latent), what each P rank writes into each D rank.
//! - `cuda` (feature `cuda`) — device memory: the driver and NVRTC loaded at run time, device
//!   buffers, the gather/scatter kernel that executes a plan in one launch, and [`memory`]'s
//!   GPU-resident cache.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod memory;
pub mod planner;
pub mod topology;
