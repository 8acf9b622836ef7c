//! pdflow-actors — the actors (ARCHITECTURE.md lists them and their steps), one per file, each named after the actor.
//!
//! # Layout
//! - [`bootstrap`] — engine_id → dp → tp → pp → side-channel address; vLLM-compatible HTTP
//!   (steps 2, 4 and 20 server side, 7); beside it, the engines advertised for discovery.
//! - [`advertise`] — an engine advertising its role and URL at bootstraps (the proxy's discovery).
//! - [`proxy`] — P/D pools, health, engine ids, round robin; [`proxy::flow`] — one request's
//!   fan-out and streaming back (steps 6–10, 25, 42–43).
//! - [`scheduler_connector`] — the scheduler-side hooks, producer and consumer roles
//!   (steps 13, 18, 26, 32, 35, 36 and the hook halves of 12, 17, 23, 33, 37, 41).
//! - [`sender_listener`] — P's side-channel socket (ZeroMQ ROUTER) and bootstrap registration
//!   (steps 1, 3, 4, 21 receive, 30 reply).
//! - [`send_worker`] — one per transfer on P: wait for ready, plan, write, reply (14, 22, 27–29, 31).
//! - [`receiver`] — D's pulls in flight and bootstrap look-ups (steps 5, 19, 20, 34).
//! - [`pull_task`] — one side-channel exchange (ZeroMQ DEALER) with a deadline (steps 21, 30 receive).
//! - [`ranks`] — a worker's tensor/pipeline position and the model it shards (pairing and planning
//!   across ranks).
//! - [`http_serve`] — how every pdflow HTTP server serves: header and idle deadlines, connection
//!   caps, each close counted in `/metrics` (the proxy's, the bootstrap's, the simulated engine's).
//! - [`fault_seam`] — the one seam a fault-injection tool reaches the actors through (a no-op in
//!   production).
//! - [`error`] — the crate's error type.

pub mod advertise;
pub mod bootstrap;
mod bootstrap_call;
pub mod error;
pub mod fault_seam;
pub mod http_serve;
pub mod proxy;
pub mod pull_task;
pub mod ranks;
mod rebind;
pub mod receiver;
pub mod scheduler_connector;
pub mod send_worker;
pub mod sender_listener;
pub mod side_channel_auth;

pub use error::ActorError;
