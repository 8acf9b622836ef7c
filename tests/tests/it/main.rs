//! The integration tests that share one process: each module is one area (a topology, a failure,
//! a protocol), run against real sockets between in-process nodes or `pdflow` processes. Beside
//! this binary: the chaos suites and the metrics test, which install a global subscriber (and a
//! fault domain) of their own, and the wire capture, which reads every loopback packet while it
//! runs.

mod admin;
mod auth;
mod bad_input;
mod bench_router;
mod chunked_prefill;
mod concurrent_requests;
mod d_failure;
mod discovery;
mod eos_first_token;
mod gpu_kv_processes;
mod hybrid;
mod idle_connections;
mod kv_aware;
mod layerwise;
mod p_failure;
mod p_restart;
mod protected_mode;
mod pull_order;
mod rank_processes;
mod rdma;
mod refusals;
mod round_robin_2p2d;
mod routing;
mod seed_request;
mod separate_processes;
mod serve_flags;
mod shared_prefix_loads;
mod streaming;
mod supervision;
mod topologies;
mod tracing_otlp;
mod vllm_router;
mod vllm_toy_proxy;
