//! Properties of the plan across ranks, over random topologies and requests: every byte of
//! every D rank's requested blocks (for its layers and heads) arrives from P exactly once, with
//! P's value, from a P rank that holds it; nothing else on D is written (see `sim`); the writes
//! are fully coalesced; replicas share the work; identical topologies pair each rank with itself.

use std::collections::{BTreeMap, BTreeSet};

use pdflow_messages::BlockId;
use proptest::prelude::*;
use proptest::test_runner::Config;

use super::sim::simulate;
use super::*;
use crate::planner::contiguous_runs;

/// One random request: both topologies, the heads, and aligned block ids.
#[derive(Debug, Clone)]
struct Case {
    p: Topology,
    d: Topology,
    heads: HeadLayout,
    p_blocks: Vec<BlockId>,
    d_blocks: Vec<BlockId>,
}

fn power_of_two(max: usize) -> impl Strategy<Value = usize> {
    prop::sample::select((0..=max.trailing_zeros()).map(|e| 1 << e).collect::<Vec<_>>())
}

/// `n` distinct ids below 16, in random order.
fn ids(n: usize) -> impl Strategy<Value = Vec<BlockId>> {
    prop::sample::subsequence((0..16).collect::<Vec<BlockId>>(), n).prop_shuffle()
}

/// Random positive layer counts per stage (`VLLM_PP_LAYER_PARTITION`), 1 to 3 stages.
fn stages(num_layers: usize) -> impl Strategy<Value = Vec<usize>> {
    let cuts = prop::collection::btree_set(1..num_layers.max(2), 0..=2.min(num_layers - 1));
    cuts.prop_map(move |cuts| {
        let bounds: Vec<usize> = std::iter::once(0).chain(cuts).chain([num_layers]).collect();
        bounds.windows(2).map(|w| w[1] - w[0]).collect()
    })
}

/// One side's layer count per stage: vLLM's split of pp {1, 2, 3}, or random stages.
fn side(num_layers: usize, partitioned: bool) -> BoxedStrategy<Vec<usize>> {
    if partitioned {
        return stages(num_layers).boxed();
    }
    (1..=3usize.min(num_layers)).prop_map(move |pp| pp_partition(num_layers, pp).expect("pp <= layers")).boxed()
}

/// Topologies of tp {1, 2, 4, 8} over H {1, 2, 4, 8} heads and 1 to 12 layers, 1 to 6 blocks.
fn case(partitioned: bool) -> impl Strategy<Value = Case> {
    (power_of_two(8), power_of_two(8), power_of_two(8), 1..=12usize, 1..=3usize, 1..=4usize, 1..=6usize).prop_flat_map(
        move |(tp_p, tp_d, h, layers, block_size, slot_len, n)| {
            (side(layers, partitioned), side(layers, partitioned), ids(n), ids(n)).prop_map(
                move |(p_stages, d_stages, p_blocks, d_blocks)| Case {
                    p: Topology::with_stages(tp_p, &p_stages, h).expect("powers of two shard evenly"),
                    d: Topology::with_stages(tp_d, &d_stages, h).expect("powers of two shard evenly"),
                    heads: HeadLayout { num_kv_heads: h, slot_len, block_size },
                    p_blocks,
                    d_blocks,
                },
            )
        },
    )
}

fn config() -> Config {
    Config { cases: 256, failure_persistence: None, ..Config::default() }
}

/// No two writes of one (pair, layer) could be one: coalescing is complete.
fn fully_coalesced(plan: &RankPlan) -> Result<(), String> {
    for pair in &plan.pairs {
        for (a, b) in pair.writes.iter().zip(pair.writes.iter().skip(1)) {
            if a.layer == b.layer && a.desc.src + a.desc.len == b.desc.src && a.desc.dst + a.desc.len == b.desc.dst {
                return Err(format!("P{} → D{}: {a:?} and {b:?} are one run", pair.p_rank, pair.d_rank));
            }
        }
    }
    Ok(())
}

/// Bytes D asks for: every layer and head each D rank holds, over every block.
fn requested_bytes(c: &Case) -> u64 {
    let per_block = c.heads.head_run_len() as u64 * c.d_blocks.len() as u64;
    c.d.ranks().iter().map(|r| (r.layers.len() * r.heads.len()) as u64 * per_block).sum()
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn every_requested_byte_arrives_once_from_a_holder(c in case(false)) {
        let plan = simulate(&c.p, &c.d, &c.heads, &c.p_blocks, &c.d_blocks).map_err(TestCaseError::fail)?;
        prop_assert_eq!(plan.total_bytes(), requested_bytes(&c));
        fully_coalesced(&plan).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn any_stage_partition_moves_every_byte_once(c in case(true)) {
        let plan = simulate(&c.p, &c.d, &c.heads, &c.p_blocks, &c.d_blocks).map_err(TestCaseError::fail)?;
        prop_assert_eq!(plan.total_bytes(), requested_bytes(&c));
        fully_coalesced(&plan).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn replicas_share_the_work(c in case(false)) {
        let plan = plan_ranks(&c.p, &c.d, &c.heads, &c.p_blocks, &c.d_blocks).map_err(|e| TestCaseError::fail(e.to_string()))?;
        // Per (layer, head): the P ranks that send it (read off each write's D offsets).
        let run = c.heads.head_run_len() as u64;
        let mut senders: BTreeMap<(usize, usize), BTreeSet<usize>> = BTreeMap::new();
        for pair in &plan.pairs {
            let first_head = c.d.ranks()[pair.d_rank].heads.start;
            for w in &pair.writes {
                for at in (w.desc.dst..w.desc.dst + w.desc.len).step_by(run as usize) {
                    let head = first_head + ((at % pair.dst_block_len) / run) as usize;
                    senders.entry((w.layer, head)).or_default().insert(pair.p_rank);
                }
            }
        }
        for ((layer, head), used) in senders {
            let needing = c.d.holders(layer, head).len();
            let holders = c.p.holders(layer, head).len();
            prop_assert_eq!(used.len(), needing.min(holders), "layer {} head {}", layer, head);
        }
    }

    #[test]
    fn identical_topologies_pair_each_rank_with_itself(c in case(false)) {
        let plan = plan_ranks(&c.p, &c.p, &c.heads, &c.p_blocks, &c.d_blocks).map_err(|e| TestCaseError::fail(e.to_string()))?;
        for pair in &plan.pairs {
            prop_assert_eq!(pair.p_rank, pair.d_rank);
            // Whole blocks on both sides: at most build_plan's runs per layer.
            let layers = c.p.ranks()[pair.p_rank].layers.len();
            prop_assert!(pair.writes.len() <= layers * contiguous_runs(&c.p_blocks, &c.d_blocks).len());
        }
        prop_assert_eq!(plan.pairs.len(), if c.p_blocks.is_empty() { 0 } else { c.p.ranks().len() });
    }
}
