//! Tests of the sharded model: for tensor- and pipeline-parallel topologies (heads replicated when
//! tp exceeds them, MLA's one latent head on every rank) the forward samples the tokens, folds the
//! digests and holds the slot bytes of one rank holding everything, chunked or not, and after a
//! "remote load" from ranks of another topology.

use std::sync::Arc;

use pdflow_messages::BlockId;
use proptest::prelude::*;

use crate::model::{fill_kv, ContextDigest, ForwardItem, Model};
use crate::ranks::{Rank, RanksError, ShardedModel};
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_kv::topology::{RankLayout, Topology, TopologyError};

const TWO_HEADS: KvShape = KvShape { num_layers: 4, num_kv_heads: 2, head_dim: 4, dtype_bytes: 2, block_size: 4 };
const EIGHT_HEADS: KvShape = KvShape { num_kv_heads: 8, ..TWO_HEADS };
/// MLA-like: one latent head, replicated on every TP rank.
const ONE_HEAD: KvShape = KvShape { num_kv_heads: 1, ..TWO_HEADS };
const BLOCKS: usize = 16;
const VOCAB: u32 = 1 << 30;

/// Zeroed caches for `topology`'s ranks, each the shape's restriction to the rank's ranges.
pub(crate) fn rank_caches(shape: KvShape, topology: &Topology, num_blocks: usize) -> Vec<Rank> {
    topology
        .ranks()
        .iter()
        .map(|r| {
            let local = KvShape { num_layers: r.layers.len(), num_kv_heads: r.heads.len(), ..shape };
            (r.clone(), KvCache::new(local, num_blocks))
        })
        .collect()
}

fn sharded(shape: KvShape, topology: &Topology) -> ShardedModel {
    let model = Model { shape, vocab_size: VOCAB };
    ShardedModel::new(model, BLOCKS, rank_caches(shape, topology, BLOCKS)).expect("the ranks shard the model")
}

fn uniform(shape: KvShape, tp: usize, pp: usize) -> ShardedModel {
    sharded(shape, &Topology::uniform(tp, pp, shape.num_layers, shape.num_kv_heads).expect("a valid topology"))
}

fn single(shape: KvShape) -> ShardedModel {
    ShardedModel::single(VOCAB, KvCache::new(shape, BLOCKS))
}

/// One request of a run: its prompt and blocks.
struct Req {
    prompt: Vec<u32>,
    blocks: Vec<BlockId>,
}

/// Each step's (sampled token, digest after the step) of one request.
type Trace = Vec<(Option<u32>, ContextDigest)>;

/// Runs `reqs` together, step by step (one forward of every unfinished request's next chunk of
/// at most `chunk` tokens), until each sampled `n` tokens.
fn generate(m: &ShardedModel, reqs: &[Req], chunk: usize, n: usize) -> Vec<Trace> {
    let mut state: Vec<(Vec<u32>, usize, ContextDigest, usize)> =
        reqs.iter().map(|r| (r.prompt.clone(), 0, ContextDigest::default(), 0)).collect();
    let mut traces: Vec<Trace> = reqs.iter().map(|_| Vec::new()).collect();
    loop {
        let active: Vec<usize> = (0..reqs.len()).filter(|&k| state[k].3 < n).collect();
        if active.is_empty() {
            return traces;
        }
        let mut items: Vec<ForwardItem> = active
            .iter()
            .map(|&k| {
                let (tokens, start, digest, _) = &state[k];
                let end = (start + chunk).min(tokens.len());
                ForwardItem {
                    tokens: tokens[*start..end].to_vec(),
                    start: *start,
                    block_ids: reqs[k].blocks.clone(),
                    group_blocks: Vec::new(),
                    digest: *digest,
                    sample: end == tokens.len(),
                }
            })
            .collect();
        let results = m.forward(&mut items, &mut |_| {});
        for ((&k, item), result) in active.iter().zip(items).zip(results) {
            let sampled = result.expect("the blocks cover the context");
            let st = &mut state[k];
            st.1 = item.start + item.tokens.len();
            st.2 = item.digest;
            if let Some(t) = sampled {
                st.0.push(t);
                st.3 += 1;
            }
            traces[k].push((sampled, item.digest));
        }
    }
}

/// Two requests of different lengths over interleaved blocks.
fn two_requests(seed: u32) -> Vec<Req> {
    vec![
        Req { prompt: (0..13).map(|i| (i * 37 + seed) % 1000).collect(), blocks: vec![9, 2, 14, 5, 11, 0] },
        Req { prompt: (0..6).map(|i| (i * 11 + seed + 3) % 1000).collect(), blocks: vec![3, 12, 7] },
    ]
}

/// Every slot each rank of `ranks` holds in `blocks[i]` equals the slot of the same global
/// (layer, head) that `whole` (one cache of the whole model) holds in `whole_blocks[i]`.
pub(crate) fn assert_same_slots(whole: &KvCache, whole_blocks: &[BlockId], ranks: &[Rank], blocks: &[BlockId]) {
    let shape = whole.shape();
    let (mut want, mut got) = (vec![0u8; shape.slot_len()], vec![0u8; shape.slot_len()]);
    for (rank, (layout, cache)) in ranks.iter().enumerate() {
        for (local_layer, layer) in layout.layers.clone().enumerate() {
            for (local_head, head) in layout.heads.clone().enumerate() {
                for (&wb, &b) in whole_blocks.iter().zip(blocks) {
                    for s in 0..shape.block_size {
                        whole.read_slot(layer, wb, head, s, &mut want).expect("in range");
                        cache.read_slot(local_layer, b, local_head, s, &mut got).expect("in range");
                        assert!(want == got, "rank {rank}: layer {layer} head {head} block {b} slot {s} differs");
                    }
                }
            }
        }
    }
}

/// Copies, as a transfer would, every slot of `src_blocks` held by `src`'s ranks into the same
/// (layer, head) of `dst_blocks` on every rank of `dst` holding it: D rank `d` reads from the
/// `d % holders`-th of the source ranks holding the slot, as the rank planner assigns senders.
pub(crate) fn copy_across(src: &[Rank], src_blocks: &[BlockId], dst: &[Rank], dst_blocks: &[BlockId]) {
    for (d, (layout, cache)) in dst.iter().enumerate() {
        let shape = cache.shape();
        let mut slot = vec![0u8; shape.slot_len()];
        for (local_layer, layer) in layout.layers.clone().enumerate() {
            for (local_head, head) in layout.heads.clone().enumerate() {
                let holders: Vec<&Rank> = src.iter().filter(|(l, _)| l.holds(layer, head)).collect();
                let (from, from_cache) = holders[d % holders.len()];
                let (src_layer, src_head) = (layer - from.layers.start, head - from.heads.start);
                for (&sb, &db) in src_blocks.iter().zip(dst_blocks) {
                    for s in 0..shape.block_size {
                        from_cache.read_slot(src_layer, sb, src_head, s, &mut slot).expect("in range");
                        cache.write_slot(local_layer, db, local_head, s, &slot).expect("in range");
                    }
                }
            }
        }
    }
}

/// Every topology of `shape` with tp in {1, 2, 4, 8} and pp in {1, 2}.
fn topologies(shape: KvShape) -> Vec<(usize, usize, Topology)> {
    let mut out = Vec::new();
    for tp in [1, 2, 4, 8] {
        for pp in [1, 2] {
            let t = Topology::uniform(tp, pp, shape.num_layers, shape.num_kv_heads).expect("a valid topology");
            out.push((tp, pp, t));
        }
    }
    out
}

#[test]
fn every_topology_samples_a_single_rank_s_tokens_digests_and_bytes() {
    for shape in [TWO_HEADS, EIGHT_HEADS, ONE_HEAD] {
        let reqs = two_requests(5);
        let whole = single(shape);
        let want = generate(&whole, &reqs, 64, 4);
        for (tp, pp, topology) in topologies(shape) {
            let ranks = sharded(shape, &topology);
            assert_eq!(ranks.ranks().len(), tp * pp);
            assert_eq!(generate(&ranks, &reqs, 64, 4), want, "tp {tp} pp {pp}, {} heads", shape.num_kv_heads);
            for r in &reqs {
                assert_same_slots(whole.first_cache(), &r.blocks, ranks.ranks(), &r.blocks);
            }
        }
    }
}

#[test]
fn chunked_prefill_over_ranks_gives_the_unchunked_single_rank_s_tokens() {
    for shape in [TWO_HEADS, EIGHT_HEADS, ONE_HEAD] {
        let reqs = two_requests(17);
        let want = generate(&single(shape), &reqs, 64, 3);
        let whole_tokens: Vec<Vec<Option<u32>>> =
            want.iter().map(|t| t.iter().map(|s| s.0).filter(Option::is_some).collect()).collect();
        for (tp, pp, topology) in topologies(shape) {
            for chunk in [1, 3, 5] {
                let got = generate(&sharded(shape, &topology), &reqs, chunk, 3);
                let tokens: Vec<Vec<Option<u32>>> =
                    got.iter().map(|t| t.iter().map(|s| s.0).filter(Option::is_some).collect()).collect();
                assert_eq!(tokens, whole_tokens, "tp {tp} pp {pp} chunk {chunk}, {} heads", shape.num_kv_heads);
                // The digest after the last step does not depend on the chunking either.
                let last = |t: &[Trace]| t.iter().map(|t| t.last().map(|s| s.1)).collect::<Vec<_>>();
                assert_eq!(last(&got), last(&want));
            }
        }
    }
}

#[test]
fn uneven_stages_and_overlapping_ranks_give_a_single_rank_s_tokens() {
    let reqs = two_requests(29);
    let whole = single(EIGHT_HEADS);
    let want = generate(&whole, &reqs, 4, 3);
    let stages = Topology::with_stages(2, &[3, 1], 8).expect("a valid topology");
    // Rank 0 holds everything of layers 0..2; ranks 1 and 2 replicate some of it.
    let overlapping = Topology::new(
        4,
        8,
        vec![
            RankLayout { layers: 0..2, heads: 0..8 },
            RankLayout { layers: 1..4, heads: 0..5 },
            RankLayout { layers: 0..4, heads: 3..8 },
        ],
    )
    .expect("a valid topology");
    for topology in [stages, overlapping] {
        let ranks = sharded(EIGHT_HEADS, &topology);
        assert_eq!(generate(&ranks, &reqs, 4, 3), want, "{topology:?}");
        for r in &reqs {
            assert_same_slots(whole.first_cache(), &r.blocks, ranks.ranks(), &r.blocks);
        }
    }
}

#[test]
fn each_layer_is_reported_once_after_every_rank_holding_it_wrote_it() {
    let ranks = uniform(TWO_HEADS, 4, 2);
    let prompt: Vec<u32> = (0..6).collect();
    let mut items = vec![ForwardItem {
        tokens: prompt.clone(),
        start: 0,
        block_ids: vec![4, 1],
        group_blocks: Vec::new(),
        digest: ContextDigest::default(),
        sample: true,
    }];
    let shape = TWO_HEADS;
    let mut reported = Vec::new();
    let caches = ranks.ranks().to_vec();
    // Position 5 (block 1, slot 1) of `layer` as each rank holding it has it: written or zero.
    let written = |layer: usize| -> Vec<bool> {
        let mut slot = vec![0u8; shape.slot_len()];
        let mut want = vec![0u8; shape.slot_len()];
        caches
            .iter()
            .filter(|(l, _)| l.layers.contains(&layer))
            .flat_map(|(l, cache)| {
                l.heads.clone().enumerate().map(move |(j, head)| (l.clone(), cache.clone(), j, head))
            })
            .map(|(l, cache, j, head)| {
                cache.read_slot(layer - l.layers.start, 1, j, 1, &mut slot).expect("in range");
                fill_kv(prompt[5], 5, layer, head, &mut want);
                slot == want
            })
            .collect()
    };
    let results = ranks.forward(&mut items, &mut |layer| {
        assert!(written(layer).iter().all(|&w| w), "layer {layer} reported before every holder wrote it");
        if layer + 1 < shape.num_layers {
            assert!(
                written(layer + 1).iter().all(|&w| !w),
                "layer {} written before layer {layer} was reported",
                layer + 1
            );
        }
        reported.push(layer);
    });
    assert_eq!(reported, vec![0, 1, 2, 3]);
    assert!(matches!(results.as_slice(), [Ok(Some(_))]));
}

#[test]
fn a_remote_load_from_another_topology_decodes_a_single_rank_s_tokens() {
    for shape in [TWO_HEADS, EIGHT_HEADS, ONE_HEAD] {
        let prompt: Vec<u32> = (0..10).map(|i| 3 * i + 1).collect();
        let single_blocks: Vec<BlockId> = vec![2, 4, 0, 1, 3, 5];
        let want = generate(&single(shape), &[Req { prompt: prompt.clone(), blocks: single_blocks }], 64, 5);
        let want: Vec<u32> = want[0].iter().filter_map(|s| s.0).collect();
        // P: tp 2 prefills the prompt and samples the first token.
        let p = uniform(shape, 2, 1);
        let p_blocks: Vec<BlockId> = vec![7, 1, 9];
        let p_trace = generate(&p, &[Req { prompt: prompt.clone(), blocks: p_blocks.clone() }], 64, 1);
        assert_eq!(p_trace[0].last().and_then(|s| s.0), Some(want[0]));
        for (tp, pp) in [(1, 1), (4, 1), (4, 2), (8, 2)] {
            // D receives P's prompt blocks into its own, then resumes at prompt − 1.
            let d = uniform(shape, tp, pp);
            let d_blocks: Vec<BlockId> = vec![5, 11, 3, 0, 2, 4];
            copy_across(p.ranks(), &p_blocks, d.ranks(), &d_blocks);
            let (mut tokens, mut digest, mut start, mut out) =
                (prompt.clone(), ContextDigest::default(), prompt.len() - 1, Vec::new());
            while out.len() < 5 {
                let mut items = vec![ForwardItem {
                    tokens: tokens[start..].to_vec(),
                    start,
                    block_ids: d_blocks.clone(),
                    group_blocks: Vec::new(),
                    digest,
                    sample: true,
                }];
                let sampled = d.forward(&mut items, &mut |_| {}).pop().expect("one result");
                let t = sampled.expect("in range").expect("sampled");
                digest = items[0].digest;
                start = tokens.len();
                tokens.push(t);
                out.push(t);
            }
            assert_eq!(out, want, "P tp 2 → D tp {tp} pp {pp}, {} heads", shape.num_kv_heads);
        }
    }
}

#[test]
fn the_digest_reads_each_slot_from_its_first_holder() {
    // tp 4 over 2 heads: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1.
    let ranks = uniform(TWO_HEADS, 4, 1);
    let blocks: Vec<BlockId> = vec![0, 1, 2];
    let prompt: Vec<u32> = (0..9).collect();
    let mut prefill = vec![ForwardItem {
        tokens: prompt[..8].to_vec(),
        start: 0,
        block_ids: blocks.clone(),
        group_blocks: Vec::new(),
        digest: ContextDigest::default(),
        sample: false,
    }];
    ranks.forward(&mut prefill, &mut |_| {});
    let resume = || {
        let mut items = vec![ForwardItem {
            tokens: vec![prompt[8]],
            start: 8,
            block_ids: blocks.clone(),
            group_blocks: Vec::new(),
            digest: ContextDigest::default(),
            sample: true,
        }];
        ranks.forward(&mut items, &mut |_| {}).pop().expect("one result").expect("in range")
    };
    let clean = resume();
    let flip = |rank: usize| {
        let cache = &ranks.ranks()[rank].1;
        let mut slot = vec![0u8; TWO_HEADS.slot_len()];
        cache.read_slot(2, 0, 0, 3, &mut slot).expect("in range");
        slot[5] ^= 0x01;
        cache.write_slot(2, 0, 0, 3, &slot).expect("in range");
    };
    flip(1);
    assert_eq!(resume(), clean, "a replica is not read");
    flip(0);
    assert_ne!(resume(), clean, "the first holder's byte is read");
}

#[test]
fn ranks_that_do_not_shard_the_model_are_refused() {
    let model = Model { shape: TWO_HEADS, vocab_size: VOCAB };
    let tp2 = Topology::uniform(2, 1, 4, 2).expect("a valid topology");
    let new = |ranks: Vec<Rank>| ShardedModel::new(model, BLOCKS, ranks).map(|_| ());
    assert_eq!(new(Vec::new()), Err(RanksError::Topology(TopologyError::NoRanks)));
    // Only rank 0 of tp 2: head 1 has no holder.
    let mut half = rank_caches(TWO_HEADS, &tp2, BLOCKS);
    half.truncate(1);
    assert_eq!(new(half), Err(RanksError::Topology(TopologyError::Uncovered { layer: 0, head: 1 })));
    // A head outside the model.
    let outside = vec![(
        RankLayout { layers: 0..4, heads: 0..3 },
        KvCache::new(KvShape { num_kv_heads: 3, ..TWO_HEADS }, BLOCKS),
    )];
    assert!(matches!(new(outside), Err(RanksError::Topology(TopologyError::BadHeads { rank: 0, .. }))));
    // Rank 1's cache holds both heads although it holds one.
    let mut wide = rank_caches(TWO_HEADS, &tp2, BLOCKS);
    wide[1].1 = KvCache::new(KvShape { num_layers: 4, ..TWO_HEADS }, BLOCKS);
    let err = new(wide).expect_err("wrong shape");
    assert!(matches!(&err, RanksError::Shape { rank: 1, expected, .. } if expected.num_kv_heads == 1), "{err:?}");
    assert!(err.to_string().contains("rank 1"), "{err}");
    // Rank 1 has fewer blocks.
    let mut short = rank_caches(TWO_HEADS, &tp2, BLOCKS);
    short[1].1 = KvCache::new(KvShape { num_kv_heads: 1, ..TWO_HEADS }, BLOCKS - 1);
    assert_eq!(new(short), Err(RanksError::NumBlocks { rank: 1, got: BLOCKS - 1, expected: BLOCKS }));
    // Every rank right: accepted, in rank order.
    let ok = ShardedModel::new(model, BLOCKS, rank_caches(TWO_HEADS, &tp2, BLOCKS)).expect("accepted");
    let layouts: Vec<RankLayout> = ok.ranks().iter().map(|(l, _)| l.clone()).collect();
    assert_eq!(layouts, tp2.ranks());
    assert!(Arc::ptr_eq(ok.first_cache(), &ok.ranks()[0].1));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Any tp, pp, head count, chunk size, prompt and block order: a single rank's tokens, digests
    /// and slot bytes.
    #[test]
    fn any_topology_matches_a_single_rank(
        heads_log in 0u32..4,
        tp_log in 0u32..4,
        pp in 1usize..=4,
        chunk in 1usize..9,
        prompt in proptest::collection::vec(0u32..1000, 1..20),
        decode in 1usize..4,
        blocks in Just((0..BLOCKS as BlockId).collect::<Vec<_>>()).prop_shuffle(),
    ) {
        let shape = KvShape { num_kv_heads: 1 << heads_log, ..TWO_HEADS };
        let topology = Topology::uniform(1 << tp_log, pp, shape.num_layers, shape.num_kv_heads).expect("a valid topology");
        let reqs = [Req { prompt, blocks: blocks[..6].to_vec() }];
        let whole = single(shape);
        let want = generate(&whole, &reqs, 64, decode);
        let ranks = sharded(shape, &topology);
        let got = generate(&ranks, &reqs, chunk, decode);
        let tokens = |t: &[Trace]| t[0].iter().filter_map(|s| s.0).collect::<Vec<_>>();
        prop_assert_eq!(tokens(&got), tokens(&want));
        prop_assert_eq!(got[0].last().map(|s| s.1), want[0].last().map(|s| s.1));
        assert_same_slots(whole.first_cache(), &reqs[0].blocks, ranks.ranks(), &reqs[0].blocks);
    }
}
