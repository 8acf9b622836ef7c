//! KV-cache groups: what a hybrid model's layers keep per request, and a request's block ids per
//! group (seed steps 12, 17, 21, 23, 27–28 for models of more than one group).
//!
//! vLLM's hybrid allocator puts layers of one kind in one group: full attention, sliding-window
//! attention, or a recurrent state (Mamba, linear attention). Every group allocates from one block
//! pool, so a block id names one block whatever its group; a layer's tensor (often shared by one
//! layer of each group) holds the blocks of every group at the same page size. What differs per
//! group is which of a request's blocks matter: every block for full attention, the window's
//! blocks for sliding window, the state page for a state group. A dense model is one group of full
//! attention, and its block list is one [`BlockSpan`].

use serde::{Deserialize, Serialize};

use crate::BlockId;

/// What one group's layers keep per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvGroupKind {
    /// Every token's K and V: every block of the prompt.
    FullAttention,
    /// K and V of the last `window` tokens: the blocks that cover the window.
    SlidingWindow { window: u32 },
    /// A recurrent state (Mamba's conv and SSM state, linear attention's): the last page.
    State,
}

/// Trailing prompt tokens P leaves to D (P prefills the rest; D loads it and computes these). One
/// for a hybrid model: a state group must hold the state before the last prompt token, which D's
/// first step advances past once, and a sliding window the blocks that token attends to (P's
/// window after the whole prompt has left its first one). None for a dense model: D recomputes
/// the last token over KV P computed.
pub fn prefill_backoff(groups: &[KvGroupSpec]) -> usize {
    usize::from(groups.len() > 1)
}

/// One group of a model's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvGroupSpec {
    pub kind: KvGroupKind,
    /// Tokens per block of this group.
    pub block_size: u32,
}

impl KvGroupSpec {
    pub const fn full(block_size: u32) -> Self {
        Self { kind: KvGroupKind::FullAttention, block_size }
    }

    /// A short name for logs, spans and refusals (`full`, `sliding_window(128)`, `state`).
    pub fn label(&self) -> String {
        match self.kind {
            KvGroupKind::FullAttention => "full".to_string(),
            KvGroupKind::SlidingWindow { window } => format!("sliding_window({window})"),
            KvGroupKind::State => "state".to_string(),
        }
    }

    /// Of a request's blocks in this group (`span`, positional from its `first` block), the ones
    /// that move from P to D: every one for full attention; for a sliding window, those that
    /// hold any of the window's tokens before the next token, `cdiv(window, block_size) + 1` at
    /// most, less the engine's null block where the engine freed them already (`null_block`);
    /// for a state group, the last page.
    pub fn to_move(&self, span: BlockSpan, null_block: Option<BlockId>) -> BlockSpan {
        let keep = match self.kind {
            KvGroupKind::FullAttention => return span,
            KvGroupKind::SlidingWindow { window } => (window.div_ceil(self.block_size.max(1)) + 1) as usize,
            KvGroupKind::State => 1,
        };
        let BlockSpan { first, mut ids } = span;
        let cut = ids.len().saturating_sub(keep);
        // The null block stands for a block the window has left behind: skipped with its position.
        let nulls = ids[cut..].iter().take_while(|&&b| Some(b) == null_block).count();
        let drop = cut + nulls;
        ids.drain(..drop);
        BlockSpan { first: first.map(|f| f + drop as u32), ids }
    }
}

/// One group's blocks of a request, in prompt order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockSpan {
    /// The block index in the request (token position / block size) of `ids[0]`. `None`: the
    /// list ends where the prompt ends (a prefix cache may hold the blocks before it).
    pub first: Option<u32>,
    pub ids: Vec<BlockId>,
}

/// A request's block ids, one [`BlockSpan`] per KV-cache group, in the groups' order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupBlocks(pub Vec<BlockSpan>);

impl From<Vec<BlockId>> for GroupBlocks {
    /// A dense model's blocks: one group, ending where the prompt ends.
    fn from(ids: Vec<BlockId>) -> Self {
        Self(vec![BlockSpan { first: None, ids }])
    }
}

impl FromIterator<BlockId> for GroupBlocks {
    /// A dense model's blocks: one group, ending where the prompt ends.
    fn from_iter<I: IntoIterator<Item = BlockId>>(ids: I) -> Self {
        Self::from(ids.into_iter().collect::<Vec<_>>())
    }
}

/// Why P's blocks cannot serve the blocks D offers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockPairError {
    #[error("P's request has {p} KV-cache groups and D's {d}: the two engines do not run the same model")]
    GroupCount { p: usize, d: usize },
    #[error(
        "group {group}: D asks for {count} blocks from block {first} of the prompt, and P holds blocks {p_first}..{p_end} only: prompt lengths differ, or P freed them (a sliding window past them)"
    )]
    NotHeld { group: usize, first: i64, count: usize, p_first: u32, p_end: i64 },
}

impl GroupBlocks {
    /// The groups' spans.
    pub fn groups(&self) -> &[BlockSpan] {
        &self.0
    }

    /// Block ids over all groups.
    pub fn len(&self) -> usize {
        self.0.iter().map(|s| s.ids.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every block id, group after group.
    pub fn flat(&self) -> Vec<BlockId> {
        self.0.iter().flat_map(|s| s.ids.iter().copied()).collect()
    }

    /// Blocks per group (a span attribute: what each group moved).
    pub fn counts(&self) -> Vec<usize> {
        self.0.iter().map(|s| s.ids.len()).collect()
    }

    /// Blocks per group as one span attribute (`"12,4,1"`), for a request of more than one group.
    pub fn counts_label(&self) -> Option<String> {
        (self.0.len() > 1).then(|| self.counts().iter().map(|n| n.to_string()).collect::<Vec<_>>().join(","))
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// Pairs P's blocks (`self`) with the blocks D offers, group by group and position by
    /// position: `(P's ids, D's ids)`, flat and in the same order, so that P's `src[i]` holds
    /// what D's `dst[i]` receives. A D span with no `first` ends where P's ends.
    pub fn pair_with(&self, d: &GroupBlocks) -> Result<(Vec<BlockId>, Vec<BlockId>), BlockPairError> {
        if self.0.len() != d.0.len() {
            return Err(BlockPairError::GroupCount { p: self.0.len(), d: d.0.len() });
        }
        let (mut src, mut dst) = (Vec::with_capacity(d.len()), Vec::with_capacity(d.len()));
        for (group, (p, d)) in self.0.iter().zip(&d.0).enumerate() {
            if d.ids.is_empty() {
                continue;
            }
            let p_first = p.first.unwrap_or(0);
            let p_end = i64::from(p_first) + p.ids.len() as i64;
            let first = d.first.map_or(p_end - d.ids.len() as i64, i64::from);
            let offset = first - i64::from(p_first);
            let not_held = BlockPairError::NotHeld { group, first, count: d.ids.len(), p_first, p_end };
            if offset < 0 || first + d.ids.len() as i64 > p_end {
                return Err(not_held);
            }
            let offset = offset as usize;
            src.extend_from_slice(&p.ids[offset..offset + d.ids.len()]);
            dst.extend_from_slice(&d.ids);
        }
        Ok((src, dst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(first: Option<u32>, ids: &[BlockId]) -> BlockSpan {
        BlockSpan { first, ids: ids.to_vec() }
    }

    #[test]
    fn a_dense_request_pairs_with_the_tail_d_offers() {
        let p = GroupBlocks::from(vec![10, 11, 12, 13]);
        let d = GroupBlocks::from(vec![7, 8]);
        assert_eq!(p.pair_with(&d), Ok((vec![12, 13], vec![7, 8])));
        let too_many = GroupBlocks::from(vec![1, 2, 3, 4, 5]);
        assert!(matches!(p.pair_with(&too_many), Err(BlockPairError::NotHeld { .. })));
    }

    #[test]
    fn groups_pair_by_position_not_by_tail() {
        // Full attention: D computed 2 blocks locally; sliding window: P freed its first 3 blocks.
        let p = GroupBlocks(vec![span(Some(0), &[1, 2, 3, 4, 5]), span(Some(3), &[40, 41])]);
        let d = GroupBlocks(vec![span(Some(2), &[20, 21]), span(Some(3), &[60])]);
        assert_eq!(p.pair_with(&d), Ok((vec![3, 4, 40], vec![20, 21, 60])));
        // D asking for a block P's window has left: refused, never another block in its place.
        let early = GroupBlocks(vec![span(Some(2), &[20]), span(Some(2), &[60, 61])]);
        assert!(matches!(p.pair_with(&early), Err(BlockPairError::NotHeld { group: 1, .. })));
        let one = GroupBlocks::from(vec![1]);
        assert_eq!(p.pair_with(&one), Err(BlockPairError::GroupCount { p: 2, d: 1 }));
    }

    #[test]
    fn each_kind_moves_what_it_needs() {
        let all = span(Some(0), &[0, 0, 0, 7, 8, 9, 10]);
        let full = KvGroupSpec::full(32);
        assert_eq!(full.to_move(all.clone(), Some(0)), all);
        // Window 64 at block 32: 3 blocks; the null blocks before them are skipped.
        let swa = KvGroupSpec { kind: KvGroupKind::SlidingWindow { window: 64 }, block_size: 32 };
        assert_eq!(swa.to_move(all.clone(), Some(0)), span(Some(4), &[8, 9, 10]));
        let short = span(Some(0), &[0, 5, 6]);
        assert_eq!(swa.to_move(short, Some(0)), span(Some(1), &[5, 6]));
        let state = KvGroupSpec { kind: KvGroupKind::State, block_size: 2048 };
        assert_eq!(state.to_move(span(Some(0), &[3]), Some(0)), span(Some(0), &[3]));
        assert_eq!(swa.to_move(span(None, &[1, 2, 3, 4]), None), span(None, &[2, 3, 4]));
    }
}
