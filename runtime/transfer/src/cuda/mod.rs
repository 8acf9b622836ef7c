//! GPU-resident KV transfer (behind the `cuda` feature): the device side of seed step 29 (P writes
//! the request's blocks into D's regions) when KV lives on GPUs. The device memory and the
//! gather/scatter kernel these engines launch are `pdflow_kv::cuda`, re-exported here.
//!
//! [`ipc`] runs the kernel across processes: D exports its regions as CUDA IPC handles, P opens
//! them once per peer and writes plans into them after the region checks; [`ipc_peer`] is a D
//! process for the bench and tests; [`ipc_engine`] is the `TransferEngine` over it (`cuda-ipc`).
//! [`staged`] is the cross-host path: tcp with pinned host staging, device→host, send and
//! host→device overlapped per chunk (`cuda-staged`). [`peer_engine`] (`cuda-peer`) moves GPU caches
//! between engines of one process (`pdflow demo --device cuda`); [`gpu_engine`] is a GPU node's
//! engine, choosing `cuda-peer`, `cuda-ipc` or `cuda-staged` per peer from the [`device_offer`]
//! D's data server answers with.

pub use pdflow_kv::cuda::*;

pub mod device_offer;
pub mod gpu_engine;
pub mod ipc;
pub mod ipc_engine;
pub mod ipc_peer;
pub mod peer_engine;
pub mod staged;

#[cfg(test)]
mod ipc_engine_tests;
#[cfg(test)]
mod ipc_tests;
