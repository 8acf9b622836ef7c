//! pdflow-runtime — what pdflow's actors run on.
//!
//! # Layout
//! - [`memory`] — a worker's KV cache as registered regions (seed step 3), and the region table
//!   every incoming write is checked against.
//! - [`planner`] — the transfer plan: block ids → (src, dst, len) descriptors, coalescing
//!   contiguous runs (seed step 28).
//! - [`transfer`] — the [`transfer::TransferEngine`] trait (P writes a plan into D's memory,
//!   seed step 29) and its `tcp` backend.
//! - [`engine`] — the simulated engine (DESIGN §5): a vLLM-faithful scheduler around the
//!   connector hooks, a paged block pool, a deterministic model, and vLLM's HTTP API.
//!
//! Node assembly and the `pdflow` command live in the root `pdflow` package, above the actors:
//! this crate sits below them, so the actors can use its transfer engines.

pub mod engine;
pub mod memory;
pub mod planner;
pub mod skip;
pub mod transfer;
