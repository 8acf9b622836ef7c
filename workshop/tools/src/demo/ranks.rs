//! The demo across ranks: each D rank's KV of the request against what the model computes for
//! the layers and KV heads that rank holds, and who wrote what (step 29 per rank pair).
//!
//! The engines are fresh, so a block's slots past the prompt are zero on P and so on D; each
//! D rank's step-34 checksum covers exactly the prompt's KV of its share.

use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_kv::topology::Topology;
use pdflow_observability::attrs;
use pdflow_observability::capture::CapturedSpan;
use pdflow_sim_engine::model::{fill_kv, Tokenizer};
use pdflow_sim_engine::EngineConfig;

use super::{seed_prompt, DemoOptions, RankCheck, RankWrite};

/// Step 34 (D's KV received) of every D rank, checked against the model.
pub(super) fn check_decode_ranks(opts: &DemoOptions, spans: &[CapturedSpan]) -> Vec<RankCheck> {
    let shape = opts.shape;
    let Ok(topology) =
        Topology::uniform(opts.decode.tp as usize, opts.decode.pp as usize, shape.num_layers, shape.num_kv_heads)
    else {
        return Vec::new();
    };
    let tokens = Tokenizer { vocab_size: EngineConfig::default().vocab_size }.encode(&seed_prompt(opts.prompt_tokens));
    spans
        .iter()
        .filter(|s| s.step == 34 && s.attr(attrs::KV_CHECKSUM).is_some())
        .map(|s| {
            let rank = |key| s.attr(key).and_then(|v| v.parse::<u32>().ok()).unwrap_or(0);
            let (tp_rank, pp_rank) = (rank(attrs::TP_RANK), rank(attrs::PP_RANK));
            let index = (pp_rank * opts.decode.tp + tp_rank) as usize;
            let blocks = s.attr(attrs::BLOCKS).and_then(|v| v.parse::<usize>().ok()).unwrap_or(0);
            let expected = topology
                .ranks()
                .get(index)
                .map(|layout| expected_checksum(shape, layout, &tokens, blocks))
                .unwrap_or_default();
            let kv_checksum = s.attr(attrs::KV_CHECKSUM).map(str::to_string);
            RankCheck { tp_rank, pp_rank, ok: kv_checksum.as_deref() == Some(expected.as_str()), kv_checksum, expected }
        })
        .collect()
}

/// The checksum of `blocks` blocks of one rank's share holding the prompt's KV as the model
/// writes it (zeros past the prompt).
fn expected_checksum(
    shape: KvShape,
    layout: &pdflow_kv::topology::RankLayout,
    tokens: &[u32],
    blocks: usize,
) -> String {
    let local = KvShape { num_layers: layout.layers.len(), num_kv_heads: layout.heads.len(), ..shape };
    let cache = KvCache::new(local, blocks.max(1));
    let mut slot = vec![0u8; shape.slot_len()];
    for (pos, &token) in tokens.iter().enumerate().take(blocks * shape.block_size) {
        let (block, s) = ((pos / shape.block_size) as u32, pos % shape.block_size);
        for (li, layer) in layout.layers.clone().enumerate() {
            for (hi, head) in layout.heads.clone().enumerate() {
                fill_kv(token, pos, layer, head, &mut slot);
                if cache.write_slot(li, block, hi, s, &slot).is_err() {
                    return String::new();
                }
            }
        }
    }
    let ids: Vec<u32> = (0..blocks as u32).collect();
    cache.blocks_checksum(&ids).map(|sum| sum.to_string()).unwrap_or_default()
}

/// Step 29's writes between rank pairs that moved bytes.
pub(super) fn rank_writes(spans: &[CapturedSpan]) -> Vec<RankWrite> {
    let text = |s: &CapturedSpan, key| s.attr(key).unwrap_or("0").to_string();
    let mut writes: Vec<RankWrite> = spans
        .iter()
        .filter(|s| s.step == 29 && s.attr(attrs::REMOTE_TP_RANK).is_some())
        .map(|s| RankWrite {
            p_tp_rank: text(s, attrs::TP_RANK),
            p_pp_rank: text(s, attrs::PP_RANK),
            d_tp_rank: text(s, attrs::REMOTE_TP_RANK),
            d_pp_rank: text(s, attrs::REMOTE_PP_RANK),
            bytes: s.attr(attrs::BYTES).and_then(|v| v.parse().ok()).unwrap_or(0),
        })
        .filter(|w| w.bytes > 0)
        .collect();
    writes.sort_by(|a, b| {
        (&a.p_pp_rank, &a.p_tp_rank, &a.d_pp_rank, &a.d_tp_rank).cmp(&(
            &b.p_pp_rank,
            &b.p_tp_rank,
            &b.d_pp_rank,
            &b.d_tp_rank,
        ))
    });
    writes
}
