//! pdflow-messages — every typed message that crosses an actor, process or wire boundary.
//!
//! Plain data and codecs only: no I/O, no actors, no async. Each module is named after the actor
//! (or the wire) that receives its messages, so a reader finds a message next to its peers.
//!
//! # Layout
//! - [`kv_transfer_params`] — the proxy → engine protocol inside each request (steps 9–10).
//! - [`bootstrap`] — `POST /register` and `GET /query` bodies (steps 4, 7, 20).
//! - [`discovery`] — engines advertising themselves at a bootstrap (`/engines`), for the proxy's
//!   discovery.
//! - [`sender_listener`] — the side channel: D's pull request and P's response (steps 21, 30).
//! - [`scheduler_connector`] — the scheduler hooks, the scheduler → worker metadata and the
//!   worker → scheduler output (steps 12–13, 17–18, 23, 26, 32–33, 35–37).
//! - [`send_worker`], [`receiver`] — worker-side messages between the engine and the actors.
//! - [`frame`] — binary frames: magic, version byte, postcard body; typed decode errors.
//! - [`kv_groups`] — a hybrid model's KV-cache groups and a request's block ids per group.
//! - [`layout`] — memory regions as peers describe them (base, length, block length).
//! - [`proxy`] — the proxy's routing ask and its health poller's readiness reports (steps 6–10).
//! - [`rank_process`] — an engine and the processes of its ranks: the worker role's calls.
//! - `ids` — [`RequestId`], [`TransferId`], [`EngineId`]: one type each, a plain string on the wire.

pub mod bootstrap;
pub mod discovery;
pub mod frame;
mod ids;
pub mod kv_groups;
pub mod kv_transfer_params;
pub mod layout;
pub mod lifecycle;
pub mod proxy;
pub mod rank_process;
pub mod rdma;
pub mod receiver;
pub mod scheduler_connector;
pub mod send_worker;
pub mod sender_listener;

/// A KV block id in an engine's block pool.
pub type BlockId = u32;
pub use ids::{EngineId, RequestId, TransferId};
