//! The transfer plan (seed step 28): for each region (layer), the source and destination address of
//! every block, coalesced into one descriptor per run of blocks that are contiguous on both sides.
//!
//! With P's blocks 17..=79 and D's 512..=574 in Qwen3-8B's layout, the plan is 36 descriptors of
//! 63 × 64 KiB; without coalescing it is 2,268 descriptors of 64 KiB.

use pdflow_messages::layout::RegionDesc;
use pdflow_messages::BlockId;

/// One write: `len` bytes from local `src` to remote `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Descriptor {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// A batch of descriptors.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TransferPlan {
    pub descriptors: Vec<Descriptor>,
    /// D's write-fence token for the pull this plan serves (0: none). The tcp engine names it
    /// before the plan's batches; D's data server writes them only while the token is open.
    pub fence: u64,
    /// No byte may be written after this instant (D's pull deadline, less a margin): the
    /// same-host path stops between system calls there, before D's own deadline. `None`: the
    /// engine's write deadline only.
    /// Never sent on the wire.
    pub write_by: Option<std::time::Instant>,
    /// D's grant for one-sided writes of these blocks (its RDMA endpoint and keys); `None`: the
    /// plan goes over D's data server. Never sent on the wire (it came in D's pull).
    pub grant: Option<std::sync::Arc<pdflow_messages::rdma::RemoteWriteGrant>>,
}

impl TransferPlan {
    pub fn total_bytes(&self) -> u64 {
        self.descriptors.iter().map(|d| d.len).sum()
    }
}

/// Why two layouts cannot be planned against each other.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("P has {src} KV regions and D has {dst}: the two engines do not run the same model layout")]
    RegionCountMismatch { src: usize, dst: usize },
    #[error("region {region}: P's block is {src} bytes and D's is {dst}: block size or KV layout differ")]
    BlockLenMismatch { region: usize, src: u64, dst: u64 },
    #[error("P holds {src} blocks for the request and D offers {dst}: prompt lengths differ")]
    BlockCountMismatch { src: usize, dst: usize },
    #[error("block {block} lies outside region {region} ({num_blocks} blocks)")]
    BlockOutOfRange { region: usize, block: BlockId, num_blocks: u64 },
}

/// Builds the plan. `coalesce = false` gives one descriptor per block per region (for benchmarks).
pub fn build_plan(
    src_regions: &[RegionDesc],
    src_blocks: &[BlockId],
    dst_regions: &[RegionDesc],
    dst_blocks: &[BlockId],
    coalesce: bool,
) -> Result<TransferPlan, PlanError> {
    if src_regions.len() != dst_regions.len() {
        return Err(PlanError::RegionCountMismatch { src: src_regions.len(), dst: dst_regions.len() });
    }
    if src_blocks.len() != dst_blocks.len() {
        return Err(PlanError::BlockCountMismatch { src: src_blocks.len(), dst: dst_blocks.len() });
    }
    let runs = if coalesce {
        contiguous_runs(src_blocks, dst_blocks)
    } else {
        (0..src_blocks.len()).map(|i| (i, 1)).collect()
    };
    let mut descriptors = Vec::with_capacity(runs.len() * src_regions.len());
    for (region, (s, d)) in src_regions.iter().zip(dst_regions).enumerate() {
        if s.block_len != d.block_len {
            return Err(PlanError::BlockLenMismatch { region, src: s.block_len, dst: d.block_len });
        }
        for (blocks, r) in [(src_blocks, s), (dst_blocks, d)] {
            if let Some(&block) = blocks.iter().find(|&&b| u64::from(b) >= r.num_blocks()) {
                return Err(PlanError::BlockOutOfRange { region, block, num_blocks: r.num_blocks() });
            }
        }
        for &(start, len) in &runs {
            descriptors.push(Descriptor {
                src: s.block_addr(src_blocks[start]),
                dst: d.block_addr(dst_blocks[start]),
                len: len as u64 * s.block_len,
            });
        }
    }
    Ok(TransferPlan { descriptors, fence: 0, write_by: None, grant: None })
}

/// Runs `(start index, length)` over which both id lists advance by exactly one.
pub fn contiguous_runs(src: &[BlockId], dst: &[BlockId]) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for i in 0..src.len().min(dst.len()) {
        match runs.last_mut() {
            Some((start, len))
                if src[*start + *len - 1].checked_add(1) == Some(src[i])
                    && dst[*start + *len - 1].checked_add(1) == Some(dst[i]) =>
            {
                *len += 1
            }
            _ => runs.push((i, 1)),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::KvShape;

    /// `count` regions of `num_blocks` blocks of `block_len`, 1 GiB apart from `base` (no memory).
    fn regions(base: u64, count: usize, num_blocks: u64, block_len: u64) -> Vec<RegionDesc> {
        (0..count as u64)
            .map(|i| RegionDesc { base_addr: base + (i << 30), len: num_blocks * block_len, block_len })
            .collect()
    }

    fn qwen3_8b(base: u64) -> Vec<RegionDesc> {
        let s = KvShape::QWEN3_8B;
        regions(base, s.num_layers, 1024, s.block_len() as u64)
    }

    /// Cuts every descriptor into block-sized pieces.
    fn per_block(plan: &TransferPlan, block_len: u64) -> Vec<Descriptor> {
        plan.descriptors
            .iter()
            .flat_map(|d| {
                assert_eq!(d.len % block_len, 0, "{d:?} is not whole blocks");
                (0..d.len / block_len).map(move |i| Descriptor {
                    src: d.src + i * block_len,
                    dst: d.dst + i * block_len,
                    len: block_len,
                })
            })
            .collect()
    }

    #[test]
    fn qwen3_8b_seed_plan_is_36_descriptors_of_63_blocks() {
        let (p, d) = (qwen3_8b(0x7f00_0000_0000), qwen3_8b(0x7e00_0000_0000));
        let src: Vec<BlockId> = (17..=79).collect();
        let dst: Vec<BlockId> = (512..=574).collect();
        let plan = build_plan(&p, &src, &d, &dst, true).expect("same layout");
        assert_eq!(plan.descriptors.len(), 36);
        assert!(plan.descriptors.iter().all(|x| x.len == 4_128_768));
        assert_eq!(plan.total_bytes(), 148_635_648);
        for (layer, x) in plan.descriptors.iter().enumerate() {
            assert_eq!(x.src, p[layer].base_addr + 17 * 65_536);
            assert_eq!(x.dst, d[layer].base_addr + 512 * 65_536);
        }

        let naive = build_plan(&p, &src, &d, &dst, false).expect("same layout");
        assert_eq!(naive.descriptors.len(), 2_268);
        assert!(naive.descriptors.iter().all(|x| x.len == 65_536));
        assert_eq!(naive.total_bytes(), 148_635_648);
        assert_eq!(per_block(&plan, 65_536), naive.descriptors);
    }

    #[test]
    fn fragmented_ids_cover_exactly_the_naive_plan() {
        let (p, d) = (regions(1 << 40, 3, 64, 256), regions(1 << 41, 3, 64, 256));
        let cases: [(&[BlockId], &[BlockId]); 4] = [
            (&[3, 4, 5, 6, 7, 8], &[10, 11, 13, 14, 15, 40]),
            (&[9, 10, 11, 30, 31, 2], &[1, 2, 3, 4, 5, 6]),
            (&[5, 4, 3], &[6, 7, 8]),
            (&[0, 1, 2, 3, 63], &[60, 61, 62, 63, 0]),
        ];
        for (src, dst) in cases {
            let coalesced = build_plan(&p, src, &d, dst, true).expect("same layout");
            let naive = build_plan(&p, src, &d, dst, false).expect("same layout");
            assert_eq!(naive.descriptors.len(), 3 * src.len());
            assert_eq!(coalesced.descriptors.len(), 3 * contiguous_runs(src, dst).len());
            assert_eq!(per_block(&coalesced, 256), naive.descriptors, "{src:?} -> {dst:?}");
        }
        assert_eq!(contiguous_runs(&[3, 4, 5, 6, 7, 8], &[10, 11, 13, 14, 15, 40]), vec![(0, 2), (2, 3), (5, 1)]);
        assert_eq!(contiguous_runs(&[u32::MAX, 0], &[0, 1]), vec![(0, 1), (1, 1)]);
        assert!(contiguous_runs(&[], &[]).is_empty());
    }

    #[test]
    fn pseudo_random_fragmentation_matches_the_naive_plan() {
        let (p, d) = (regions(1 << 40, 2, 512, 64), regions(1 << 41, 2, 512, 64));
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..50 {
            let n = (next() % 40) as usize + 1;
            // Mostly ascending ids with random gaps, as a fragmented free list gives them.
            let mut ids = |gap: u64| {
                let mut at = next() % 64;
                (0..n)
                    .map(|_| {
                        at += 1 + if next() % 4 == 0 { next() % gap } else { 0 };
                        at as BlockId
                    })
                    .collect::<Vec<_>>()
            };
            let (src, dst) = (ids(3), ids(5));
            let coalesced = build_plan(&p, &src, &d, &dst, true).expect("in range");
            let naive = build_plan(&p, &src, &d, &dst, false).expect("in range");
            assert_eq!(per_block(&coalesced, 64), naive.descriptors, "{src:?} -> {dst:?}");
            assert_eq!(coalesced.total_bytes(), naive.total_bytes());
        }
    }

    #[test]
    fn mismatched_layouts_and_bad_ids_are_typed_errors() {
        let p = regions(1 << 40, 3, 16, 256);
        assert_eq!(
            build_plan(&p, &[1], &regions(1 << 41, 2, 16, 256), &[1], true),
            Err(PlanError::RegionCountMismatch { src: 3, dst: 2 })
        );
        assert_eq!(
            build_plan(&p, &[1, 2], &regions(1 << 41, 3, 16, 256), &[1], true),
            Err(PlanError::BlockCountMismatch { src: 2, dst: 1 })
        );
        assert_eq!(
            build_plan(&p, &[1], &regions(1 << 41, 3, 8, 512), &[1], true),
            Err(PlanError::BlockLenMismatch { region: 0, src: 256, dst: 512 })
        );
        let d = regions(1 << 41, 3, 16, 256);
        assert_eq!(
            build_plan(&p, &[16], &d, &[0], true),
            Err(PlanError::BlockOutOfRange { region: 0, block: 16, num_blocks: 16 })
        );
        assert_eq!(
            build_plan(&p, &[0, 1], &d, &[2, 99], false),
            Err(PlanError::BlockOutOfRange { region: 0, block: 99, num_blocks: 16 })
        );
        assert_eq!(build_plan(&p, &[], &d, &[], true), Ok(TransferPlan::default()));
    }
}
