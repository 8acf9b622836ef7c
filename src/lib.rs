//! pdflow — prefill/decode disaggregation as a dataflow of actors: node assembly and the
//! `pdflow` command.
//!
//! This package sits on top of the workspace: it builds each node's supervision tree from the
//! actors (`pdflow-actors`) and what they run on (`pdflow-runtime`), and it is the CLI.
//! (DESIGN §1 puts node assembly in `runtime`; it lives here because `runtime` sits *below* the
//! actors — they use its transfer engines — and a crate cannot also assemble what depends on it.)
//!
//! # Layout
//! - [`config`] — one typed config per process, from flags and vLLM's environment variables,
//!   validated before anything binds.
//! - [`ports`] — the engine's connector ports implemented over the actors (the bridge between the
//!   simulated engine and SchedulerConnector / SenderListener / Receiver).
//! - [`node`] — node assembly: engine nodes (P and D), bootstrap, proxy, each under a root
//!   supervisor ([`node::supervisor`]).
//! - [`timeline`] — the seed's 43-step timeline rebuilt from captured spans.
//! - [`demo`] — `pdflow demo`: the seed scenario end to end, verified.
//! - [`bench`] — `pdflow bench …`: transfer, end-to-end and proxy benchmarks.
//! - [`chaos`] — `pdflow chaos`: the fault matrix on the simulated engines.
//! - [`cli`] — the command line.

pub mod bench;
pub mod chaos;
pub mod cli;
pub mod config;
pub mod demo;
pub mod netns;
pub mod node;
pub mod ports;
pub mod timeline;
