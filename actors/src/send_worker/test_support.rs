//! Test-only pieces shared by the SendWorker and SenderListener tests: a [`TransferEngine`] that
//! copies bytes between two in-process KV caches, and KV caches filled with a known pattern.

use std::sync::Arc;
use std::time::Instant;

use futures::future::BoxFuture;
use pdflow_kv::memory::{KvCache, KvShape, RegionTable};
use pdflow_kv::planner::TransferPlan;
use pdflow_transfer::{TransferEngine, TransferError, TransferStats};

/// A small shape: 2 layers, 2 heads, head_dim 4, bf16, block 2 → 64-byte blocks per layer.
pub(crate) const SHAPE: KvShape =
    KvShape { num_layers: 2, num_kv_heads: 2, head_dim: 4, dtype_bytes: 2, block_size: 2 };

/// A cache whose every byte depends on (layer, block, head, slot, offset).
pub(crate) fn filled_cache(num_blocks: usize, seed: u8) -> Arc<KvCache> {
    let cache = KvCache::new(SHAPE, num_blocks);
    for layer in 0..SHAPE.num_layers {
        for block in 0..num_blocks {
            for head in 0..SHAPE.num_kv_heads {
                for slot in 0..SHAPE.block_size {
                    let bytes: Vec<u8> = (0..SHAPE.slot_len())
                        .map(|i| seed.wrapping_add((layer * 97 + block * 31 + head * 7 + slot * 3 + i) as u8))
                        .collect();
                    cache.write_slot(layer, block as u32, head, slot, &bytes).expect("in range");
                }
            }
        }
    }
    cache
}

/// Copies each descriptor from `src`'s memory into `dst`'s, after the region checks; or fails.
pub(crate) struct MemcpyTransfer {
    src: RegionTable,
    dst: RegionTable,
    fail: Option<String>,
    /// What was asked of the engine, in order: `prepare <peer>` and `write <peer>`.
    calls: std::sync::Mutex<Vec<String>>,
}

impl MemcpyTransfer {
    pub(crate) fn new(src: &Arc<KvCache>, dst: &Arc<KvCache>) -> Arc<Self> {
        Arc::new(Self { src: src.region_table(), dst: dst.region_table(), fail: None, calls: Default::default() })
    }

    pub(crate) fn failing(src: &Arc<KvCache>, dst: &Arc<KvCache>, reason: &str) -> Arc<Self> {
        Arc::new(Self {
            src: src.region_table(),
            dst: dst.region_table(),
            fail: Some(reason.to_string()),
            calls: Default::default(),
        })
    }

    /// The calls made so far (`prepare <peer>`, `write <peer>`), in order.
    pub(crate) fn calls(&self) -> Vec<String> {
        self.calls.lock().map(|c| c.clone()).unwrap_or_default()
    }

    fn note(&self, call: String) {
        if let Ok(mut calls) = self.calls.lock() {
            calls.push(call);
        }
    }
}

impl TransferEngine for MemcpyTransfer {
    fn name(&self) -> &'static str {
        "memcpy-test"
    }

    fn prepare<'a>(&'a self, peer: &'a str) -> BoxFuture<'a, Result<(), TransferError>> {
        self.note(format!("prepare {peer}"));
        Box::pin(async { Ok(()) })
    }

    fn write<'a>(
        &'a self,
        peer: &'a str,
        plan: &'a TransferPlan,
    ) -> BoxFuture<'a, Result<TransferStats, TransferError>> {
        self.note(format!("write {peer}"));
        Box::pin(async move {
            if let Some(reason) = &self.fail {
                return Err(TransferError::Refused { peer: peer.to_string(), reason: reason.clone() });
            }
            let start = Instant::now();
            for d in &plan.descriptors {
                // SAFETY: tests only: P's blocks are held for sending and D's blocks belong to the pull.
                let src = unsafe { self.src.slice(d.src, d.len) }?;
                let dst = unsafe { self.dst.slice_mut(d.dst, d.len) }
                    .map_err(|e| TransferError::Refused { peer: peer.to_string(), reason: e.to_string() })?;
                dst.copy_from_slice(src);
            }
            Ok(TransferStats {
                bytes: plan.total_bytes(),
                descriptors: plan.descriptors.len(),
                duration: start.elapsed(),
            })
        })
    }
}
