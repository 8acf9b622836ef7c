//! The network cells of `pdflow chaos` ("network cuts between nodes that run in their
//! own network namespaces"): P, D and the proxy as separate `pdflow` processes in namespaces of
//! their own ([`crate::netns`], as root), one link cut per cell at one step of the seed request —
//! the P↔D link before D's bootstrap look-up (steps 18–19) or during P's KV write (step 29), the
//! proxy↔P link before or during P's prefill (step 9) — then restored. Each cell is one row of
//! the chaos table ([`CellResult`]); its contract is in [`cells`].
//!
//! Cells run one at a time on fresh clusters, with the engines' deadlines derived from a 3 s
//! abort timeout. Where namespaces are unavailable (not root, no `ip netns`) [`available`] says
//! why, and the callers skip, saying so.
//!
//! # Layout
//! - [`cluster`] — the three processes in their namespaces, and what the checks read back.
//! - [`cells`] — which cells exist, one cell's run and its verdict.

pub mod cells;
pub mod cluster;

use std::path::Path;
use std::time::Instant;

use pdflow_kv::memory::KvShape;

pub use cells::{run_net_cell, NetCell, NetEnv};

use super::{http_client, report, CellResult, ChaosError, ChaosReport, Reference};

/// Whether network namespaces can be used here; `Err` says why not.
pub fn available() -> Result<(), String> {
    crate::netns::available()
}

/// The network cells whose name (`actor/step/fault`) contains `filter` (all without one).
pub fn cells(filter: Option<&str>) -> Vec<NetCell> {
    NetCell::ALL.into_iter().filter(|c| filter.is_none_or(|f| c.name().contains(f))).collect()
}

/// Runs `cells` with the nodes started from `bin` (the `pdflow` binary); `progress` sees each
/// result as it comes. Fails only if the reference engine cannot start.
pub async fn run(
    bin: &Path,
    cells: &[NetCell],
    mut progress: impl FnMut(usize, usize, &CellResult),
) -> Result<ChaosReport, ChaosError> {
    let started = Instant::now();
    let reference = Reference::start(KvShape::QWEN3_8B, None).await?;
    let client = http_client()?;
    let env = NetEnv { bin, client: &client, reference_url: &reference.url };
    let mut results = Vec::with_capacity(cells.len());
    for (i, cell) in cells.iter().enumerate() {
        let r = run_net_cell(*cell, &env).await;
        progress(i + 1, cells.len(), &r);
        results.push(r);
    }
    reference.shutdown().await;
    Ok(report(results, started.elapsed()))
}
