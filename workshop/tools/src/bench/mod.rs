//! `pdflow bench …`: benchmarks in the product. Each prints a table and can write `--json PATH`
//! as `{"rows": [{"name", "backend", "plan", "concurrency", "bytes", "median_ms", "min_ms",
//! "max_ms", "gbps"}]}` (fields that do not apply are null), and `cpu_ms` (the process's CPU time
//! per run) where a bench measures it.
//!
//! - [`transfer`] — the seed request P→D through the real actors and transfer engines (tcp,
//!   same-host, and one-sided rdma in a build with the `rdma` feature), with the same-run
//!   ceilings (memcpy, loopback TCP) and, optionally, Mooncake's engine.
//! - [`e2e`] — the seed request through proxy, P and D: TTFT split as the seed splits it, and
//!   requests/s for small prompts; [`e2e_link`] — the same over a shaped link between network
//!   namespaces (`--link-gbps`).
//! - [`proxy`] — the proxy alone against in-memory stub upstreams.
//! - [`router`] — routing policies compared (pdflow's and vLLM's router's) on xPyD simulated
//!   engines with prefix caching, on shared-prefix and unique workloads.
//! - `gpu` (feature `cuda`) — `bench transfer --device cuda`: the same request GPU to GPU.

pub mod e2e;
#[cfg(feature = "fault-injection")]
pub mod e2e_link;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod proxy;
pub mod report;
pub mod router;
pub mod transfer;
