//! Per-block digests of one rank pair's share (seed steps 29 and 34 with `verify_checksums`,
//! across ranks): the (layer, KV head) runs a P rank writes into a D rank. P digests them in its
//! blocks before the write, D in its blocks once the write landed; both walk the share in the same
//! order — by layer, then global head — so the digests of block `i` are equal exactly when that
//! block's share arrived unchanged, whatever each side's local head and region numbering.

use pdflow_messages::BlockId;

use super::error::RankPlanError;
use super::layout::{HeadLayout, RankLayout, Topology};
use super::pulls::plan_pair;
use crate::memory::{Checksum, KvCache, RegionError};

/// Why a share cannot be digested.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShareDigestError {
    #[error("the rank pair's share: {0}")]
    Plan(#[from] RankPlanError),
    #[error("reading the blocks: {0}")]
    Region(#[from] RegionError),
    #[error("a block of this cache is {got} bytes, but its rank holds {expected} (layers × heads × one head's run): the cache is not this rank's")]
    Shape { expected: usize, got: usize },
    #[error("(layer {layer}, head {head}) of the share is not held by this rank")]
    NotHeld { layer: usize, head: usize },
}

/// The (layer, global KV head) runs P rank `pair.0` writes into D rank `pair.1`, ascending; empty
/// when the pair moves nothing. The same on both ends: it depends on the topologies only.
pub fn pair_share(
    p: &Topology,
    d: &Topology,
    heads: &HeadLayout,
    pair: (usize, usize),
) -> Result<Vec<(usize, usize)>, RankPlanError> {
    // One block on each side: no write spans blocks, so each write is a run of D's local heads.
    let Some(plan) = plan_pair(p, d, heads, pair, &[0], &[0])? else { return Ok(Vec::new()) };
    let run = heads.head_run_len() as u64;
    let first_head = d.ranks()[pair.1].heads.start;
    let mut share: Vec<(usize, usize)> = plan
        .writes
        .iter()
        .flat_map(|w| {
            let (from, to) = (w.desc.dst / run, (w.desc.dst + w.desc.len) / run);
            (from..to).map(move |h| (w.layer, first_head + h as usize))
        })
        .collect();
    share.sort_unstable();
    share.dedup();
    Ok(share)
}

/// The digest of `share` in each of `blocks` of `cache`, the cache of a rank laid out as
/// `holder` (region `i` is layer `holder.layers.start + i`, local heads in global order).
pub fn share_digests(
    cache: &KvCache,
    holder: &RankLayout,
    heads: &HeadLayout,
    share: &[(usize, usize)],
    blocks: &[BlockId],
) -> Result<Vec<u64>, ShareDigestError> {
    let run = heads.head_run_len();
    let block_len = holder.block_len(heads);
    let mut offsets = Vec::with_capacity(share.len());
    for &(layer, head) in share {
        if !holder.holds(layer, head) {
            return Err(ShareDigestError::NotHeld { layer, head });
        }
        offsets.push((layer - holder.layers.start) * block_len + (head - holder.heads.start) * run);
    }
    let expected = holder.layers.len() * block_len;
    blocks
        .iter()
        .map(|&block| {
            // Layer-major: every region's bytes of this block, in region order.
            let bytes = cache.block_bytes(block)?;
            if bytes.len() != expected {
                return Err(ShareDigestError::Shape { expected, got: bytes.len() });
            }
            let mut h = Checksum::default();
            for &at in &offsets {
                h.update(&bytes[at..at + run]);
            }
            Ok(h.finish())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::KvShape;

    fn shape(heads: usize, layers: usize) -> KvShape {
        KvShape { num_layers: layers, num_kv_heads: heads, head_dim: 4, dtype_bytes: 2, block_size: 4 }
    }

    /// A rank's cache holding `rank`'s share of a model whose every (layer, head, block) run has
    /// bytes that depend on the global indices only (as the model's KV does).
    fn rank_cache(
        model: KvShape,
        rank: &RankLayout,
        blocks: usize,
        block_of: impl Fn(usize) -> usize,
    ) -> std::sync::Arc<KvCache> {
        let local = KvShape { num_layers: rank.layers.len(), num_kv_heads: rank.heads.len(), ..model };
        let cache = KvCache::new(local, blocks);
        for (li, layer) in rank.layers.clone().enumerate() {
            for (hi, head) in rank.heads.clone().enumerate() {
                for b in 0..blocks {
                    for slot in 0..model.block_size {
                        let v = (layer * 131 + head * 17 + block_of(b) * 7 + slot) as u8;
                        cache.write_slot(li, b as BlockId, hi, slot, &vec![v; model.slot_len()]).expect("write");
                    }
                }
            }
        }
        cache
    }

    /// P tp 2 → D tp 1 and P tp 1 → D tp 2: each pair's digests agree on both ends when the bytes
    /// are the model's, at different block ids; a changed byte in D's share changes one block's.
    #[test]
    fn both_ends_agree_and_a_changed_run_shows() {
        let model = shape(4, 2);
        let heads = HeadLayout::from_shape(&model);
        for (ptp, dtp) in [(2usize, 1usize), (1, 2), (4, 2), (2, 4)] {
            let p = Topology::uniform(ptp, 1, 2, 4).expect("p");
            let d = Topology::uniform(dtp, 1, 2, 4).expect("d");
            for (pr, dr) in crate::topology::pull_pairs(&p, &d) {
                let share = pair_share(&p, &d, &heads, (pr, dr)).expect("share");
                if share.is_empty() {
                    continue;
                }
                // P's request blocks are 3, 4; D's are 1, 0 (same model blocks 0, 1).
                let p_cache = rank_cache(model, &p.ranks()[pr], 5, |b| b.saturating_sub(3));
                let d_cache = rank_cache(model, &d.ranks()[dr], 2, |b| 1 - b);
                let at_p = share_digests(&p_cache, &p.ranks()[pr], &heads, &share, &[3, 4]).expect("P");
                let at_d = share_digests(&d_cache, &d.ranks()[dr], &heads, &share, &[1, 0]).expect("D");
                assert_eq!(at_p, at_d, "P tp {ptp} rank {pr} → D tp {dtp} rank {dr}");
                let (layer, head) = share[share.len() - 1];
                let d_rank = &d.ranks()[dr];
                let li = layer - d_rank.layers.start;
                let hi = head - d_rank.heads.start;
                d_cache.write_slot(li, 0, hi, 1, &vec![0xEE; model.slot_len()]).expect("corrupt");
                let after = share_digests(&d_cache, d_rank, &heads, &share, &[1, 0]).expect("D");
                assert_eq!(after[0], at_d[0], "block 1 untouched");
                assert_ne!(after[1], at_d[1], "block 0's changed run shows");
            }
        }
    }

    #[test]
    fn a_share_outside_the_rank_is_refused() {
        let model = shape(4, 2);
        let heads = HeadLayout::from_shape(&model);
        let t = Topology::uniform(2, 1, 2, 4).expect("t");
        let cache = KvCache::new(KvShape { num_kv_heads: 2, ..model }, 1);
        let err = share_digests(&cache, &t.ranks()[0], &heads, &[(0, 3)], &[0]).expect_err("head 3 is rank 1's");
        assert_eq!(err, ShareDigestError::NotHeld { layer: 0, head: 3 });
    }
}
