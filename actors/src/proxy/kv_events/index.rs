//! What each engine's prefix cache holds, as its KV events said: the `kv_aware` policy's index
//! (read inside step 8's routing, written by the KV-event subscribers).
//!
//! An engine's block hashes cannot be recomputed here (vLLM seeds them at random per engine), so
//! the index hashes each stored block itself, over its parent's own hash and its tokens
//! ([`block_hash`]), and maps the engine's hash to its own: a `BlockStored` chains from its
//! `parent_block_hash`'s own hash, a `BlockRemoved` finds its own hash through the map. A request
//! is matched by hashing its token ids the same way, in the engine's block size
//! ([`PromptBlocks`]), and counting the leading blocks held. Each KV-cache group's blocks are
//! kept apart (a hybrid model's sliding-window group drops blocks its full-attention group
//! keeps): a block is held while any group holds it. A block stored again in its group (vLLM's
//! `full` report mode re-announces reused blocks; two requests may have computed it at once) is
//! one entry, gone at its first removal: the index may miss a copy the engine still has, never
//! keep one it dropped.
//!
//! One index per engine and data-parallel rank ([`RankIndex`]), bounded: past
//! `max_blocks` engine blocks it is cleared (an engine that reports its evictions never gets
//! there; one that does not is out of step anyway). It follows one block size, the first
//! stored after a clear; blocks of another size (a hybrid model's other KV-cache groups) are
//! ignored, and so are blocks whose hash takes more than their tokens (a LoRA, multimodal or
//! salted prompt's) and those of a lower tier (vLLM's CPU offload).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

use super::decode::{KvBatch, KvEvent};

/// Engine blocks one index holds at most (16 M tokens at 16 a block: more than an engine's
/// cache holds, so only an index out of step reaches it).
pub const MAX_BLOCKS: usize = 1 << 20;
/// The own hash a prompt's first block chains from.
const ROOT: u64 = 0x7064_666c_6f77_6b76;

/// The proxy's own hash of a block: over its parent's own hash and its tokens (SipHash with
/// fixed keys: the same in every proxy and every run).
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// How much of a prompt an engine holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    pub blocks: usize,
    pub tokens: usize,
}

/// A request's token ids and their own block hashes, per block size, made as far as asked.
#[derive(Debug)]
pub struct PromptBlocks {
    tokens: Arc<[u32]>,
    chains: Vec<(usize, Vec<u64>)>,
}

impl PromptBlocks {
    pub fn new(tokens: Arc<[u32]>) -> Self {
        Self { tokens, chains: Vec::new() }
    }

    /// Blocks of `block_size` an engine can have cached for this prompt: the full blocks before
    /// its last token (an engine always computes the last token itself, so a hit never covers it).
    pub fn blocks(&self, block_size: usize) -> usize {
        self.tokens.len().saturating_sub(1) / block_size.max(1)
    }

    /// The own hash of block `i` in `block_size`; `None` past [`Self::blocks`].
    pub fn hash(&mut self, block_size: usize, i: usize) -> Option<u64> {
        if block_size == 0 || i >= self.blocks(block_size) {
            return None;
        }
        let at = match self.chains.iter().position(|(size, _)| *size == block_size) {
            Some(at) => at,
            None => {
                self.chains.push((block_size, Vec::new()));
                self.chains.len() - 1
            }
        };
        let chain = &mut self.chains[at].1;
        while chain.len() <= i {
            let n = chain.len();
            let parent = chain.last().copied().unwrap_or(ROOT);
            chain.push(block_hash(parent, &self.tokens[n * block_size..(n + 1) * block_size]));
        }
        chain.get(i).copied()
    }
}

/// Why a `BlockStored` was not taken into the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ignored {
    /// A LoRA, multimodal or salted prompt's blocks, or a lower tier's.
    NotPlain,
    /// Another block size than the one the index follows.
    OtherBlockSize,
    /// Its tokens are not its blocks' (a hybrid model's skipped blocks).
    Unaligned,
    /// Its parent is not in the index (stored before the subscriber started, or gone since).
    UnknownParent,
}

/// What applying a batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    pub applied: u64,
    pub ignored: u64,
    /// The index passed its bound and was cleared.
    pub over_bound: bool,
}

/// One engine's (one data-parallel rank's) cache.
#[derive(Debug)]
pub struct RankIndex {
    block_size: Option<usize>,
    /// (KV-cache group, engine hash) → own hash.
    by_engine: HashMap<(u32, u64), u64>,
    /// Own hash → the groups holding it.
    held: HashMap<u64, u32>,
    max_blocks: usize,
}

impl RankIndex {
    pub fn new(max_blocks: usize) -> Self {
        Self { block_size: None, by_engine: HashMap::new(), held: HashMap::new(), max_blocks: max_blocks.max(1) }
    }

    /// Engine blocks held.
    pub fn len(&self) -> usize {
        self.by_engine.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_engine.is_empty()
    }

    pub fn clear(&mut self) {
        self.block_size = None;
        self.by_engine.clear();
        self.held.clear();
    }

    /// Takes a `BlockStored` of KV-cache group `group` in.
    pub fn store(
        &mut self,
        group: u32,
        block_hashes: &[u64],
        parent: Option<u64>,
        token_ids: &[u32],
        block_size: usize,
    ) -> Result<(), Ignored> {
        if self.is_empty() {
            self.block_size = None;
        }
        if self.block_size.is_some_and(|b| b != block_size) {
            return Err(Ignored::OtherBlockSize);
        }
        if block_size == 0 || token_ids.len() != block_hashes.len() * block_size {
            return Err(Ignored::Unaligned);
        }
        let mut own_parent = match parent {
            None => ROOT,
            Some(p) => self.by_engine.get(&(group, p)).copied().ok_or(Ignored::UnknownParent)?,
        };
        self.block_size = Some(block_size);
        for (&engine_hash, tokens) in block_hashes.iter().zip(token_ids.chunks_exact(block_size)) {
            let own = block_hash(own_parent, tokens);
            match self.by_engine.insert((group, engine_hash), own) {
                Some(known) if known == own => {}
                // The engine hash named other tokens (a stale entry): those leave.
                Some(stale) => {
                    self.release(stale);
                    *self.held.entry(own).or_default() += 1;
                }
                None => *self.held.entry(own).or_default() += 1,
            }
            own_parent = own;
        }
        Ok(())
    }

    /// Takes a `BlockRemoved` of KV-cache group `group` in.
    pub fn remove(&mut self, group: u32, block_hashes: &[u64]) {
        for &engine_hash in block_hashes {
            if let Some(own) = self.by_engine.remove(&(group, engine_hash)) {
                self.release(own);
            }
        }
    }

    /// One group less holds `own`.
    fn release(&mut self, own: u64) {
        if let Some(n) = self.held.get_mut(&own) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.held.remove(&own);
            }
        }
    }

    /// The leading blocks of `prompt` held.
    pub fn matched(&self, prompt: &mut PromptBlocks) -> Held {
        let Some(block_size) = self.block_size else { return Held::default() };
        let mut blocks = 0;
        while let Some(h) = prompt.hash(block_size, blocks) {
            if !self.held.contains_key(&h) {
                break;
            }
            blocks += 1;
        }
        Held { blocks, tokens: blocks * block_size }
    }

    /// Applies `events` in order.
    pub fn apply(&mut self, events: &[KvEvent]) -> Applied {
        let mut out = Applied::default();
        for event in events {
            let taken = match event {
                KvEvent::Stored { plain: false, .. } => Err(Ignored::NotPlain),
                KvEvent::Stored { block_hashes, parent, token_ids, block_size, group, plain: true } => {
                    self.store(*group, block_hashes, *parent, token_ids, *block_size)
                }
                KvEvent::Removed { device: false, .. } => Err(Ignored::NotPlain),
                KvEvent::Removed { block_hashes, group, device: true } => {
                    self.remove(*group, block_hashes);
                    Ok(())
                }
                KvEvent::AllCleared => {
                    self.clear();
                    Ok(())
                }
                KvEvent::Other => Err(Ignored::NotPlain),
            };
            match taken {
                Ok(()) => out.applied += 1,
                Err(_) => out.ignored += 1,
            }
            if self.len() > self.max_blocks {
                self.clear();
                out.over_bound = true;
            }
        }
        out
    }
}

/// One engine's indexes, one per data-parallel rank, shared by its subscribers (writers) and the
/// Proxy actor (reader); each lock is held for one batch or one match, never across I/O.
#[derive(Debug)]
pub struct EngineKv {
    ranks: Mutex<BTreeMap<u32, RankIndex>>,
    max_blocks: usize,
}

impl EngineKv {
    pub fn new(max_blocks: usize) -> Self {
        Self { ranks: Mutex::new(BTreeMap::new()), max_blocks }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<u32, RankIndex>> {
        // A writer that panicked left whole events applied or not: the index is still usable.
        self.ranks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies one batch to its rank's index.
    pub fn apply(&self, batch: &KvBatch) -> Applied {
        let max = self.max_blocks;
        self.lock().entry(batch.data_parallel_rank).or_insert_with(|| RankIndex::new(max)).apply(&batch.events)
    }

    /// Forgets what `ranks` hold.
    pub fn clear(&self, ranks: &BTreeSet<u32>) {
        let mut all = self.lock();
        for rank in ranks {
            if let Some(index) = all.get_mut(rank) {
                index.clear();
            }
        }
    }

    /// What `rank` holds of `prompt`; no rank: the most any rank holds.
    pub fn matched(&self, rank: Option<u32>, prompt: &mut PromptBlocks) -> Held {
        let all = self.lock();
        match rank {
            Some(rank) => all.get(&rank).map(|index| index.matched(prompt)).unwrap_or_default(),
            None => all.values().map(|index| index.matched(prompt)).max_by_key(|h| h.tokens).unwrap_or_default(),
        }
    }

    /// Engine blocks held, over every rank.
    pub fn len(&self) -> usize {
        self.lock().values().map(RankIndex::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], block_size: usize) -> KvEvent {
        in_group(0, hashes, parent, tokens, block_size)
    }

    fn in_group(group: u32, hashes: &[u64], parent: Option<u64>, tokens: &[u32], block_size: usize) -> KvEvent {
        let (block_hashes, token_ids) = (hashes.to_vec(), tokens.to_vec());
        KvEvent::Stored { block_hashes, parent, token_ids, block_size, group, plain: true }
    }

    fn removed(group: u32, hashes: &[u64]) -> KvEvent {
        KvEvent::Removed { block_hashes: hashes.to_vec(), group, device: true }
    }

    fn prompt(tokens: impl IntoIterator<Item = u32>) -> PromptBlocks {
        PromptBlocks::new(tokens.into_iter().collect::<Vec<_>>().into())
    }

    #[test]
    fn stored_blocks_chain_from_their_parent_and_match_a_prompt_cut_in_the_engines_block_size() {
        let mut index = RankIndex::new(MAX_BLOCKS);
        // A prompt of 10 tokens, block size 4: two blocks stored in two events, the second
        // chaining from the first by the engine's (arbitrary) hash.
        let a = index.apply(&[stored(&[900], None, &[0, 1, 2, 3], 4), stored(&[901], Some(900), &[4, 5, 6, 7], 4)]);
        assert_eq!(a, Applied { applied: 2, ignored: 0, over_bound: false });
        assert_eq!(index.matched(&mut prompt(0..10)), Held { blocks: 2, tokens: 8 });
        assert_eq!(index.matched(&mut prompt((0..4).chain(9..20))), Held { blocks: 1, tokens: 4 });
        assert_eq!(index.matched(&mut prompt(1..10)), Held::default(), "another first token changes every block");
        // Exactly two blocks long: the engine computes the last token itself, so one block hits.
        assert_eq!(index.matched(&mut prompt(0..8)), Held { blocks: 1, tokens: 4 });
        // A block whose parent the index never saw cannot be placed.
        assert_eq!(index.store(0, &[77], Some(76), &[1, 1, 1, 1], 4), Err(Ignored::UnknownParent));
        assert_eq!(index.store(1, &[901], Some(900), &[1, 1, 1, 1], 4), Err(Ignored::UnknownParent), "another group's");
    }

    #[test]
    fn a_removed_block_leaves_even_if_it_was_stored_again() {
        let mut index = RankIndex::new(MAX_BLOCKS);
        // vLLM's `full` report mode announces a reused block again: still one block.
        index.apply(&[stored(&[1, 2], None, &[0, 1, 2, 3, 4, 5, 6, 7], 4), stored(&[1], None, &[0, 1, 2, 3], 4)]);
        assert_eq!((index.len(), index.matched(&mut prompt(0..9)).blocks), (2, 2));
        index.apply(&[removed(0, &[1])]);
        assert_eq!(index.matched(&mut prompt(0..9)).blocks, 0, "the prefix stops at the first block missing");
        // A lower tier's removal leaves the device's cache alone.
        index.apply(&[KvEvent::Removed { block_hashes: vec![2], group: 0, device: false }]);
        assert_eq!(index.len(), 1);
    }

    #[test]
    fn a_block_is_held_while_any_kv_cache_group_holds_it() {
        let mut index = RankIndex::new(MAX_BLOCKS);
        // A full-attention group (0) and a sliding-window group (1) of one block size.
        index.apply(&[in_group(0, &[1, 2], None, &[0, 1, 2, 3, 4, 5, 6, 7], 4)]);
        index.apply(&[in_group(1, &[1, 2], None, &[0, 1, 2, 3, 4, 5, 6, 7], 4)]);
        index.apply(&[removed(1, &[1])]);
        assert_eq!(index.matched(&mut prompt(0..9)).blocks, 2, "group 0 still holds the first block");
        index.apply(&[removed(0, &[1])]);
        assert_eq!(index.matched(&mut prompt(0..9)).blocks, 0);
    }

    #[test]
    fn all_blocks_cleared_and_the_bound_empty_the_index() {
        let mut index = RankIndex::new(3);
        index.apply(&[stored(&[1, 2], None, &[0, 1, 2, 3], 2)]);
        assert_eq!(index.apply(&[KvEvent::AllCleared]).applied, 1);
        assert!(index.is_empty() && index.matched(&mut prompt(0..5)).blocks == 0);
        let a = index.apply(&[stored(&[1, 2, 3, 4], None, &[0, 1, 2, 3, 4, 5, 6, 7], 2)]);
        assert!(a.over_bound && index.is_empty(), "four blocks passed a bound of three");
    }

    #[test]
    fn other_block_sizes_unaligned_and_lora_blocks_are_ignored() {
        let mut index = RankIndex::new(MAX_BLOCKS);
        let a = index.apply(&[
            stored(&[1], None, &[0, 1, 2, 3], 4),
            stored(&[5], None, &[0; 8], 8),
            stored(&[6, 7], None, &[0; 4], 4),
            KvEvent::Stored {
                block_hashes: vec![8],
                parent: None,
                token_ids: vec![9; 4],
                block_size: 4,
                group: 0,
                plain: false,
            },
            KvEvent::Other,
        ]);
        assert_eq!((a.applied, a.ignored, index.len()), (1, 4, 1));
        // Once empty, the index follows the next block size stored.
        index.apply(&[removed(0, &[1]), stored(&[5], None, &[0; 8], 8)]);
        assert_eq!(index.matched(&mut prompt(std::iter::repeat_n(0, 9))), Held { blocks: 1, tokens: 8 });
    }

    #[test]
    fn an_engine_keeps_one_index_per_rank() {
        let engine = EngineKv::new(MAX_BLOCKS);
        let batch = |rank, events| KvBatch { events, data_parallel_rank: rank };
        engine.apply(&batch(1, vec![stored(&[1, 2], None, &[0, 1, 2, 3], 2)]));
        engine.apply(&batch(0, vec![stored(&[1], None, &[0, 1], 2)]));
        let mut p = prompt(0..5);
        assert_eq!(engine.matched(Some(0), &mut p).blocks, 1);
        assert_eq!(engine.matched(Some(1), &mut p).blocks, 2);
        assert_eq!(engine.matched(Some(2), &mut p).blocks, 0);
        assert_eq!(engine.matched(None, &mut p).blocks, 2, "no rank named: the best of them");
        engine.clear(&BTreeSet::from([1]));
        assert_eq!((engine.matched(None, &mut p).blocks, engine.len()), (1, 1));
    }
}
