//! vLLM's default splits: the KV heads of one TP rank, and the layers of each pipeline stage.

use std::ops::Range;

use super::error::TopologyError;

/// The KV heads TP rank `tp_rank` of `tp` holds, as vLLM shards them.
///
/// With `tp <= num_kv_heads` (which `tp` must divide) rank `r` holds heads
/// `[r * H / tp, (r + 1) * H / tp)`; with `tp > num_kv_heads` (which must divide `tp`) each head
/// is replicated on `tp / H` consecutive ranks and rank `r` holds head `r / (tp / H)`.
pub fn tp_heads(tp_rank: usize, tp: usize, num_kv_heads: usize) -> Result<Range<usize>, TopologyError> {
    check_tp(tp, num_kv_heads)?;
    if tp_rank >= tp {
        return Err(TopologyError::NoSuchTpRank { tp_rank, tp });
    }
    if tp <= num_kv_heads {
        let per_rank = num_kv_heads / tp;
        Ok(tp_rank * per_rank..(tp_rank + 1) * per_rank)
    } else {
        let head = tp_rank / (tp / num_kv_heads);
        Ok(head..head + 1)
    }
}

/// Refuses a tp that shards `num_kv_heads` unevenly.
pub(super) fn check_tp(tp: usize, num_kv_heads: usize) -> Result<(), TopologyError> {
    if tp == 0 {
        return Err(TopologyError::Zero { what: "tp" });
    }
    if num_kv_heads == 0 {
        return Err(TopologyError::Zero { what: "num_kv_heads" });
    }
    if tp <= num_kv_heads && !num_kv_heads.is_multiple_of(tp) {
        return Err(TopologyError::HeadsNotDivisible { tp, num_kv_heads });
    }
    if tp > num_kv_heads && !tp.is_multiple_of(num_kv_heads) {
        return Err(TopologyError::TpNotMultipleOfHeads { tp, num_kv_heads });
    }
    Ok(())
}

/// The layer count of each of `pp` stages, as vLLM's `get_pp_indices` splits `num_layers` when
/// `VLLM_PP_LAYER_PARTITION` is unset: `num_layers / pp` each, and the remainder one more each on
/// the stages before the last, counting back from the second-to-last (the last stage also runs
/// the LM head). 61 layers over 4 stages: `[15, 15, 16, 15]`.
pub fn pp_partition(num_layers: usize, pp: usize) -> Result<Vec<usize>, TopologyError> {
    if pp == 0 {
        return Err(TopologyError::Zero { what: "pp" });
    }
    if num_layers == 0 {
        return Err(TopologyError::Zero { what: "num_layers" });
    }
    if pp > num_layers {
        return Err(TopologyError::MoreStagesThanLayers { pp, num_layers });
    }
    let mut partition = vec![num_layers / pp; pp];
    let remainder = num_layers % pp;
    // remainder < pp, so the indices pp-2 down to pp-1-remainder stay inside 0..pp.
    for count in partition.iter_mut().rev().skip(1).take(remainder) {
        *count += 1;
    }
    Ok(partition)
}
