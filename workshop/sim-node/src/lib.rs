//! pdflow-sim-node — the simulated engine's node: one engine (P or D) of `pdflow-sim-engine` with
//! pdflow's connector actors (assembled by `pdflow-node`'s [`pdflow_node::Worker`]), as
//! `pdflow serve`, `pdflow demo`, the chaos tools and the tests run it where vLLM cannot. Inside
//! vLLM, vLLM runs the engine and its ranks; this crate is what stands in for them.
//!
//! # Layout
//! - [`engine_node`] — an engine node: the simulated engine's API, its scheduler-side connector
//!   and each rank's worker side, under one supervisor.
//! - [`ranks`], [`ranked_port`] — an engine sharded over tensor/pipeline ranks: one KV cache and
//!   one set of worker actors per rank, behind one worker port that settles a request once every
//!   rank has.
//! - [`rank_process`] — one process per rank: the engine calls each rank's worker over a socket,
//!   the rank's KV cache in shared memory.
//! - [`dp_group`] — a data-parallel group: several engines behind one API, each registered at
//!   bootstrap under its dp_rank.
//! - [`error`] — why a node could not start ([`SimNodeError`]: the production node's
//!   [`pdflow_node::NodeError`] and the simulated engine's own).

pub mod dp_group;
pub mod engine_node;
pub mod error;
pub mod rank_process;
pub mod ranked_port;
pub mod ranks;

pub use dp_group::DataParallelGroup;
pub use engine_node::{EngineNode, EngineNodeConfig};
pub use error::SimNodeError;
