//! The transfer plan across ranks (seed step 28 generalised): for any P topology (tp, pp) and any
//! D topology, which bytes each P rank writes into each D rank.
//!
//! [`crate::planner`] plans one P worker → one D worker (TP 1, no PP). vLLM deployments split the
//! KV cache over ranks: tensor parallelism gives each rank a subset of the KV heads (or, when tp
//! exceeds the head count, one head held by tp/H ranks), pipeline parallelism gives each stage a
//! contiguous range of layers, and P and D are sized independently (P tp 4 → D tp 2, P tp 2 → D
//! tp 8, P pp 2 → D pp 1, ...).
//!
//! # Layout
//! Each rank holds, for every layer it holds, one region `[num_blocks, local_heads, block_size,
//! slot_len]` (vLLM 0.33's LBHNC): inside one block of one layer, each local head's bytes are one
//! contiguous run of `block_size * slot_len` bytes, local heads in ascending global order.
//!
//! # The pieces
//! - [`HeadLayout`] — what is planned over: KV heads, the bytes of one token of one head
//!   (`slot_len`: `2 * head_dim * dtype_bytes` for K and V, `576 * dtype_bytes` for DeepSeek's
//!   MLA latent) and the block size. MLA is one head, replicated on every TP rank.
//! - [`RankLayout`] / [`Topology`] — per rank, its layer range and head range. Built from
//!   explicit ranks ([`Topology::new`]), per-stage layer counts ([`Topology::with_stages`], as
//!   `VLLM_PP_LAYER_PARTITION` gives them) or vLLM's default split ([`Topology::uniform`],
//!   remainder layers as `get_pp_indices` places them).
//! - [`plan_ranks`] — the plan: per (P rank, D rank) pair, coalesced descriptors whose `src` and
//!   `dst` are byte offsets inside that rank's region for one layer ([`RankPlan`]). Every byte of
//!   D's requested blocks has exactly one sender: among the P ranks that hold a (layer, head),
//!   D rank `d` reads from holder `d % holders` (so MLA's D ranks each read one P rank, and the
//!   replicas share the work).
//! - [`pull_pairs`] — which D rank pulls from which P rank (every pair that moves bytes, and an
//!   empty pull for a P replica nobody reads), and [`plan_pair`], one pair's plan alone.
//! - [`PairPlan::to_transfer_plan`] — one pair's offsets → addresses in both ranks' registered
//!   regions, as the existing engines execute them.
//! - [`pair_share`] / [`share_digests`] — the (layer, head) runs a pair moves, and their per-block
//!   digests on either end (`verify_checksums` across ranks).

mod address;
mod coalesce;
mod digest;
mod error;
mod layout;
mod partition;
mod plan;
mod pulls;

#[cfg(test)]
mod error_tests;
#[cfg(test)]
mod proptests;
#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;

pub use address::AddressError;
pub use digest::{pair_share, share_digests, ShareDigestError};
pub use error::{RankPlanError, Side, TopologyError};
pub use layout::{HeadLayout, RankLayout, Topology};
pub use partition::{pp_partition, tp_heads};
pub use plan::{align_tail, plan_ranks, LayerDescriptor, PairPlan, RankPlan};
pub use pulls::{plan_pair, pull_pairs, pulled_by, pullers_of};
