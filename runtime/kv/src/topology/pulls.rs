//! Who pulls from whom (seed steps 21 and 22 across ranks): the (P rank, D rank) pairs of one
//! request, and one pair's plan alone, as a P worker computes it for the pull it serves.
//!
//! Every pair whose plan moves bytes is a pull. A P rank that no D rank reads from (a replica of
//! heads another P rank sends, when P's tp exceeds the KV heads) still holds the request's blocks:
//! D rank `p % d_ranks` sends it an empty pull, so that it hears the request is settled and frees
//! them at once rather than at its send expiry. D and P compute the same pairs from the two
//! topologies, so each P rank knows how many pulls to expect.

use pdflow_messages::BlockId;

use super::error::RankPlanError;
use super::layout::{HeadLayout, Topology};
use super::plan::{plan_ranks, PairPlan};

/// The pulls of one request, `(p_rank, d_rank)`, ordered by P rank then D rank.
pub fn pull_pairs(p: &Topology, d: &Topology) -> Vec<(usize, usize)> {
    let mut pairs = Vec::new();
    for (d_rank, dr) in d.ranks().iter().enumerate() {
        for layer in dr.layers.clone() {
            for head in dr.heads.clone() {
                let holders = p.holders(layer, head);
                if holders.is_empty() {
                    continue;
                }
                pairs.push((holders[d_rank % holders.len()], d_rank));
            }
        }
    }
    pairs.sort_unstable();
    pairs.dedup();
    let d_ranks = d.ranks().len();
    for p_rank in 0..p.ranks().len() {
        if !pairs.iter().any(|&(p, _)| p == p_rank) {
            pairs.push((p_rank, p_rank % d_ranks));
        }
    }
    pairs.sort_unstable();
    pairs
}

/// The D ranks that pull from `p_rank` (how many pulls that P worker serves for one request).
pub fn pullers_of(p: &Topology, d: &Topology, p_rank: usize) -> Vec<usize> {
    pull_pairs(p, d).into_iter().filter(|&(pr, _)| pr == p_rank).map(|(_, dr)| dr).collect()
}

/// The P ranks `d_rank` pulls from (the peers of its pull).
pub fn pulled_by(p: &Topology, d: &Topology, d_rank: usize) -> Vec<usize> {
    pull_pairs(p, d).into_iter().filter(|&(_, dr)| dr == d_rank).map(|(pr, _)| pr).collect()
}

/// What `p_rank` writes into `d_rank` for this request: `None` when the pair moves no bytes (an
/// empty pull). The checks and offsets are [`plan_ranks`]'s.
pub fn plan_pair(
    p: &Topology,
    d: &Topology,
    heads: &HeadLayout,
    (p_rank, d_rank): (usize, usize),
    p_blocks: &[BlockId],
    d_blocks: &[BlockId],
) -> Result<Option<PairPlan>, RankPlanError> {
    let mut plan = plan_ranks(p, d, heads, p_blocks, d_blocks)?;
    Ok(plan.pairs.iter().position(|x| (x.p_rank, x.d_rank) == (p_rank, d_rank)).map(|i| plan.pairs.swap_remove(i)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heads(n: usize) -> HeadLayout {
        HeadLayout { num_kv_heads: n, slot_len: 16, block_size: 4 }
    }

    /// Every pair of the full plan is a pull, and every P rank is pulled at least once.
    #[test]
    fn pulls_cover_the_plan_and_every_p_rank() {
        for (ptp, dtp, h) in [(1, 1, 8), (2, 1, 8), (1, 2, 8), (4, 2, 8), (2, 8, 8), (4, 1, 2), (1, 4, 2), (8, 2, 1)] {
            for (ppp, dpp) in [(1, 1), (2, 1), (1, 2)] {
                let p = Topology::uniform(ptp, ppp, 4, h).expect("p");
                let d = Topology::uniform(dtp, dpp, 4, h).expect("d");
                let pairs = pull_pairs(&p, &d);
                let plan = plan_ranks(&p, &d, &heads(h), &[1, 2], &[5, 3]).expect("plan");
                for pair in &plan.pairs {
                    assert!(pairs.contains(&(pair.p_rank, pair.d_rank)), "{ptp}x{ppp} -> {dtp}x{dpp}");
                }
                for p_rank in 0..p.ranks().len() {
                    assert!(!pullers_of(&p, &d, p_rank).is_empty(), "P rank {p_rank} never hears of the request");
                }
                for d_rank in 0..d.ranks().len() {
                    assert!(!pulled_by(&p, &d, d_rank).is_empty(), "D rank {d_rank} pulls nothing");
                }
            }
        }
    }

    #[test]
    fn equal_tp_pairs_rank_with_rank() {
        let t = Topology::uniform(4, 1, 4, 8).expect("t");
        assert_eq!(pull_pairs(&t, &t), vec![(0, 0), (1, 1), (2, 2), (3, 3)]);
    }

    #[test]
    fn replicas_nobody_reads_get_an_empty_pull() {
        // 2 KV heads over P tp 4: ranks 0,1 hold head 0, ranks 2,3 head 1; D tp 1 reads ranks 0, 2.
        let p = Topology::uniform(4, 1, 4, 2).expect("p");
        let d = Topology::uniform(1, 1, 4, 2).expect("d");
        assert_eq!(pull_pairs(&p, &d), vec![(0, 0), (1, 0), (2, 0), (3, 0)]);
        let plan = |pair| plan_pair(&p, &d, &heads(2), pair, &[1], &[2]).expect("plans");
        assert!(plan((0, 0)).is_some() && plan((2, 0)).is_some());
        assert!(plan((1, 0)).is_none() && plan((3, 0)).is_none(), "replicas write nothing");
    }

    #[test]
    fn one_pair_is_the_full_plans_entry() {
        let p = Topology::uniform(2, 1, 4, 8).expect("p");
        let d = Topology::uniform(4, 1, 4, 8).expect("d");
        let full = plan_ranks(&p, &d, &heads(8), &[3, 4, 9], &[1, 2, 7]).expect("plan");
        for pair in &full.pairs {
            let one = plan_pair(&p, &d, &heads(8), (pair.p_rank, pair.d_rank), &[3, 4, 9], &[1, 2, 7]).expect("plan");
            assert_eq!(one.as_ref(), Some(pair));
        }
    }
}
