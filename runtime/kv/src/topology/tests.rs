//! Named cases of the plan across ranks, each simulated byte for byte (see `sim`), and the
//! invalid inputs with their errors.

use pdflow_messages::layout::RegionDesc;

use super::sim::simulate;
use super::*;
use crate::memory::{KvCache, KvShape};
use crate::planner::{build_plan, Descriptor};

/// Small heads: 2 tokens a block, 3 bytes a token.
fn heads(num_kv_heads: usize) -> HeadLayout {
    HeadLayout { num_kv_heads, slot_len: 3, block_size: 2 }
}

fn uniform(tp: usize, pp: usize, layers: usize, h: usize) -> Topology {
    Topology::uniform(tp, pp, layers, h).expect("valid topology")
}

const P_BLOCKS: [u32; 4] = [3, 4, 5, 9];
const D_BLOCKS: [u32; 4] = [7, 8, 9, 2];

fn run(p: &Topology, d: &Topology, h: &HeadLayout) -> RankPlan {
    simulate(p, d, h, &P_BLOCKS, &D_BLOCKS).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn p_tp2_to_d_tp1_gathers_both_halves_of_each_block() {
    let plan = run(&uniform(2, 1, 2, 4), &uniform(1, 1, 2, 4), &heads(4));
    assert_eq!(plan.senders_of(0), vec![0, 1]);
    // Each P rank's two heads are one run per block on D; P's blocks 3, 4, 5 are contiguous on P
    // only, so each (pair, layer) is one descriptor per block.
    for pair in &plan.pairs {
        assert_eq!(pair.writes.len(), 2 * 4, "{pair:?}");
        assert!(pair.writes.iter().all(|w| w.desc.len == 2 * 6));
        assert_eq!((pair.src_block_len, pair.dst_block_len), (12, 24));
    }
}

#[test]
fn p_tp1_to_d_tp4_scatters_one_head_to_each_rank() {
    let plan = run(&uniform(1, 1, 3, 4), &uniform(4, 1, 3, 4), &heads(4));
    for d in 0..4 {
        assert_eq!(plan.senders_of(d), vec![0]);
        let pair = plan.pair(0, d).expect("P0 serves every D rank");
        // D's blocks 7, 8, 9 are contiguous on D but P's head d is strided: one per block.
        assert_eq!(pair.writes.len(), 3 * 4);
        assert!(pair.writes.iter().all(|w| w.desc.src % 24 == d as u64 * 6));
    }
    assert_eq!(plan.total_bytes(), 4 * 3 * 4 * 6);
}

#[test]
fn p_tp8_with_4_heads_replicates_and_the_replicas_share_the_work() {
    let plan = run(&uniform(8, 1, 2, 4), &uniform(2, 1, 2, 4), &heads(4));
    // Head h lives on P ranks 2h and 2h + 1; D rank d reads holder d % 2.
    assert_eq!(plan.senders_of(0), vec![0, 2]);
    assert_eq!(plan.senders_of(1), vec![5, 7]);
    // Identical D tp spreads over every replica: D rank d reads P rank d.
    let plan = run(&uniform(8, 1, 2, 4), &uniform(8, 1, 2, 4), &heads(4));
    for d in 0..8 {
        assert_eq!(plan.senders_of(d), vec![d]);
    }
}

#[test]
fn d_tp8_with_2_heads_gets_one_head_per_rank_from_its_holders() {
    let plan = run(&uniform(2, 1, 2, 2), &uniform(8, 1, 2, 2), &heads(2));
    for d in 0..8 {
        assert_eq!(plan.senders_of(d), vec![d / 4], "D rank {d} holds head {}", d / 4);
    }
    // With P replicating too (tp 4: head h on P 2h, 2h+1), D's four replicas alternate.
    let plan = run(&uniform(4, 1, 2, 2), &uniform(8, 1, 2, 2), &heads(2));
    let senders: Vec<Vec<usize>> = (0..8).map(|d| plan.senders_of(d)).collect();
    assert_eq!(senders, [[0], [1], [0], [1], [2], [3], [2], [3]]);
}

#[test]
fn pp2_to_pp1_reads_each_layer_from_its_stage() {
    // 5 layers over 2 stages: [3, 2], as vLLM's get_pp_indices splits them.
    let p = uniform(1, 2, 5, 2);
    assert_eq!(p.ranks()[1].layers, 3..5);
    let plan = run(&p, &uniform(1, 1, 5, 2), &heads(2));
    assert_eq!(plan.senders_of(0), vec![0, 1]);
    let stage1 = plan.pair(1, 0).expect("stage 1 sends");
    assert!(stage1.writes.iter().all(|w| w.layer >= 3 && w.src_region == w.layer - 3 && w.dst_region == w.layer));
}

#[test]
fn pp1_to_pp3_writes_each_stage_its_layers() {
    // 7 layers over 3 stages: [2, 3, 2].
    let d = uniform(2, 3, 7, 2);
    let stages: Vec<_> = d.ranks().iter().step_by(2).map(|r| r.layers.clone()).collect();
    assert_eq!(stages, [0..2, 2..5, 5..7]);
    let plan = run(&uniform(2, 1, 7, 2), &d, &heads(2));
    for (d_rank, r) in d.ranks().iter().enumerate() {
        assert_eq!(plan.senders_of(d_rank), vec![d_rank % 2]);
        let pair = plan.pair(d_rank % 2, d_rank).expect("a sender");
        assert!(pair.writes.iter().all(|w| r.layers.contains(&w.layer) && w.dst_region == w.layer - r.layers.start));
    }
}

#[test]
fn mla_tp4_to_tp2_has_one_sender_per_d_rank() {
    let mla = HeadLayout::mla(2, 2);
    assert_eq!((mla.num_kv_heads, mla.slot_len), (1, 1152));
    let (p, d) = (uniform(4, 1, 3, 1), uniform(2, 1, 3, 1));
    assert!(p.ranks().iter().all(|r| r.heads == (0..1)), "every TP rank holds the latent");
    let plan = run(&p, &d, &mla);
    assert_eq!(plan.senders_of(0), vec![0]);
    assert_eq!(plan.senders_of(1), vec![1]);
    assert_eq!(plan.total_bytes(), 2 * 3 * 4 * 2 * 1152);
    // P's 3, 4, 5 → D's 7, 8, 9 is one run; 9 → 2 another: two descriptors a layer.
    assert!(plan.pairs.iter().all(|p| p.writes.len() == 3 * 2));
}

#[test]
fn descending_ids_coalesce_too() {
    let plan = simulate(&uniform(1, 1, 1, 2), &uniform(1, 1, 1, 2), &heads(2), &[5, 4, 3], &[8, 7, 6])
        .unwrap_or_else(|e| panic!("{e}"));
    let writes = &plan.pairs[0].writes;
    assert_eq!(writes.len(), 1);
    assert_eq!(writes[0].desc, Descriptor { src: 3 * 12, dst: 6 * 12, len: 3 * 12 });
}

#[test]
fn tp1_pp1_seed_plan_matches_build_plan() {
    let shape = KvShape::QWEN3_8B;
    let t = uniform(1, 1, shape.num_layers, shape.num_kv_heads);
    let (src, dst): (Vec<u32>, Vec<u32>) = ((17..=79).collect(), (512..=574).collect());
    let plan = plan_ranks(&t, &t, &HeadLayout::from_shape(&shape), &src, &dst).expect("same layout");
    let regions = |base: u64| -> Vec<RegionDesc> {
        let bl = shape.block_len() as u64;
        (0..shape.num_layers as u64)
            .map(|i| RegionDesc { base_addr: base + (i << 30), len: 1024 * bl, block_len: bl })
            .collect()
    };
    let (p, d) = (regions(0x7f00_0000_0000), regions(0x7e00_0000_0000));
    let ours = plan.pairs[0].to_transfer_plan(&p, &d).expect("fits");
    assert_eq!(ours.descriptors.len(), 36);
    assert_eq!(ours, build_plan(&p, &src, &d, &dst, true).expect("same layout"));
}

#[test]
fn a_pair_plan_runs_on_real_caches() {
    // P tp 2 → D tp 1, 4 heads of head_dim 2 (slot 8 bytes), 2 layers, block 2.
    let full = KvShape { num_layers: 2, num_kv_heads: 4, head_dim: 2, dtype_bytes: 2, block_size: 2 };
    let half = KvShape { num_kv_heads: 2, ..full };
    let (p_blocks, d_blocks) = ([1, 2], [4, 0]);
    let plan =
        plan_ranks(&uniform(2, 1, 2, 4), &uniform(1, 1, 2, 4), &HeadLayout::from_shape(&full), &p_blocks, &d_blocks)
            .expect("valid");
    let value = |layer: usize, head: usize, block: u32, slot: usize| {
        [(layer * 64 + head * 16 + block as usize * 2 + slot) as u8; 8]
    };
    let p_caches = [KvCache::new(half, 3), KvCache::new(half, 3)];
    for (rank, cache) in p_caches.iter().enumerate() {
        for (layer, block, local, slot) in all_slots(2, &[0, 1, 2], 2) {
            cache
                .write_slot(layer, block, local, slot, &value(layer, rank * 2 + local, block, slot))
                .expect("in range");
        }
    }
    let d_cache = KvCache::new(full, 5);
    let d_table = d_cache.region_table();
    for pair in &plan.pairs {
        let p_table = p_caches[pair.p_rank].region_table();
        for x in pair.to_transfer_plan(p_table.regions(), d_table.regions()).expect("fits").descriptors {
            // SAFETY (both blocks): the test owns every block of both caches, which are distinct.
            let from = unsafe { p_table.slice(x.src, x.len) }.expect("P region");
            unsafe { d_table.slice_mut(x.dst, x.len) }.expect("D region").copy_from_slice(from);
        }
    }
    let mut out = [0u8; 8];
    for (layer, d_block, head, slot) in all_slots(2, &d_blocks, 4) {
        let p_block = if d_block == 4 { 1 } else { 2 };
        d_cache.read_slot(layer, d_block, head, slot, &mut out).expect("in range");
        assert_eq!(out, value(layer, head, p_block, slot), "layer {layer} block {d_block} head {head} slot {slot}");
    }
}

/// Every (layer, block, head, slot) of `blocks`, with 2 slots a block.
fn all_slots(layers: usize, blocks: &[u32], heads: usize) -> Vec<(usize, u32, usize, usize)> {
    let mut out = Vec::new();
    for layer in 0..layers {
        for &block in blocks {
            for head in 0..heads {
                out.extend((0..2).map(|slot| (layer, block, head, slot)));
            }
        }
    }
    out
}

#[test]
fn vllm_splits() {
    let split = |layers, pp| pp_partition(layers, pp).expect("valid");
    assert_eq!(split(61, 4), [15, 15, 16, 15]);
    assert_eq!(split(61, 2), [31, 30]);
    assert_eq!(split(5, 3), [2, 2, 1]);
    assert_eq!(split(7, 3), [2, 3, 2]);
    assert_eq!(split(8, 2), [4, 4]);
    assert_eq!(tp_heads(3, 4, 8), Ok(6..8));
    assert_eq!(tp_heads(5, 8, 2), Ok(1..2));
    assert_eq!(tp_heads(2, 4, 1), Ok(0..1));
}
