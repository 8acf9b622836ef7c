//! The paged block pool (vLLM v1's `BlockPool`): a fixed number of blocks, a reference count per
//! block, a free queue, and — with prefix caching — a map from block hash to cached block.
//! Every block id `0..num_blocks` is usable: unlike vLLM there is no reserved null block.
//!
//! Without prefix caching a block has one owner at a time and the free queue is FIFO, as before.
//! With it (vLLM's `enable_caching`): a full block, once computed, keeps its [`BlockHash`]; a
//! request whose prompt starts with the same blocks takes them (`touch`: one more reference)
//! instead of computing them; a freed cached block stays in the map and in the free queue (an
//! eviction candidate, counted free), and loses its hash only when an allocation hands it out.
//! Freed blocks without a hash go to the head of the queue (handed out first), cached ones to the
//! tail (least recently used evicted first), a request's blocks last block first. Shared blocks
//! are only ever read: a request computes past its cached prefix, into blocks of its own — which
//! keeps the model's and the transfer engines' raw memory access safe (`memory.rs`).
//!
//! With KV events on, what enters and leaves the map is queued as vLLM queues it
//! (`BlockStored`, `BlockRemoved`), for the engine to publish after each step.

use std::collections::HashMap;

use pdflow_messages::BlockId;

use crate::block_hash::BlockHash;
use crate::free_queue::FreeQueue;
use crate::kv_events::KvEvent;

/// A fixed pool of KV blocks.
#[derive(Debug)]
pub struct BlockPool {
    total: usize,
    caching: bool,
    record_events: bool,
    ref_cnt: Vec<u32>,
    free: FreeQueue,
    /// Cached blocks by hash (several blocks may hold one hash; the first is used).
    cached: HashMap<BlockHash, Vec<BlockId>>,
    /// Each block's hash while it is in `cached`.
    block_hash: Vec<Option<BlockHash>>,
    /// Blocks with a hash.
    num_cached: usize,
    events: Vec<KvEvent>,
}

impl BlockPool {
    /// A pool without prefix caching.
    pub fn new(num_blocks: usize) -> Self {
        Self::with_caching(num_blocks, false, false)
    }

    /// A pool with prefix caching on or off (`caching`), queueing KV events (`record_events`)
    /// when caching is on.
    pub fn with_caching(num_blocks: usize, caching: bool, record_events: bool) -> Self {
        Self {
            total: num_blocks,
            caching,
            record_events: caching && record_events,
            ref_cnt: vec![0; num_blocks],
            free: FreeQueue::full(num_blocks),
            cached: HashMap::new(),
            block_hash: vec![None; num_blocks],
            num_cached: 0,
            events: Vec::new(),
        }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn caching(&self) -> bool {
        self.caching
    }

    /// Blocks no request holds, cached ones included (eviction candidates).
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks holding a prefix-cache entry, free or held.
    pub fn num_cached(&self) -> usize {
        self.num_cached
    }

    /// Takes `n` blocks from the head of the free queue, or none if fewer are free. A cached
    /// block handed out loses its hash (evicted).
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free.len() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let Some(block) = self.free.pop_front() else { break };
            self.evict(block);
            if let Some(c) = self.ref_cnt.get_mut(block as usize) {
                *c = 1;
            }
            out.push(block);
        }
        Some(out)
    }

    /// A cache hit's blocks (`hit`, from [`BlockPool::lookup`]) taken, then `n` new blocks; none
    /// of it if the free blocks do not cover both (a free hit block counts against them).
    pub fn allocate_after_hit(&mut self, hit: &[BlockId], n: usize) -> Option<Vec<BlockId>> {
        let free_hits = hit.iter().filter(|&&b| self.free.contains(b)).count();
        if n + free_hits > self.free.len() {
            return None;
        }
        self.touch(hit);
        self.allocate(n)
    }

    /// One more reference on each block; a free one leaves the free queue.
    fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            self.free.remove(b);
            if let Some(c) = self.ref_cnt.get_mut(b as usize) {
                *c += 1;
            }
        }
    }

    /// Drops one reference on each block, in eviction order (first evicted first); a block no
    /// one holds any more is free. Without caching it joins the tail (FIFO); with caching, at the
    /// head without a hash, at the tail with one.
    pub fn free(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        let mut to_head = Vec::new();
        for b in blocks {
            let Some(c) = self.ref_cnt.get_mut(b as usize) else { continue };
            debug_assert!(*c > 0, "block {b} freed twice");
            *c = c.saturating_sub(1);
            if *c > 0 {
                continue;
            }
            let cached = self.block_hash.get(b as usize).is_some_and(Option::is_some);
            if self.caching && !cached {
                to_head.push(b);
            } else {
                self.free.push_back(b);
            }
        }
        // Pushed to the head in reverse, so that the first of them is handed out first.
        for b in to_head.into_iter().rev() {
            self.free.push_front(b);
        }
    }

    /// Frees a request's blocks (its block table, in prompt order): with caching, its last block
    /// first, so that a shared prefix outlives the tails behind it (vLLM's order).
    pub fn free_request(&mut self, blocks: Vec<BlockId>) {
        if self.caching {
            self.free(blocks.into_iter().rev());
        } else {
            self.free(blocks);
        }
    }

    /// The cached blocks of the longest prefix of `hashes` (at most `max_blocks` of them).
    pub fn lookup(&self, hashes: &[BlockHash], max_blocks: usize) -> Vec<BlockId> {
        if !self.caching {
            return Vec::new();
        }
        hashes
            .iter()
            .take(max_blocks)
            .map_while(|h| self.cached.get(h).and_then(|blocks| blocks.first().copied()))
            .collect()
    }

    /// Caches the full blocks `from..to` of a request whose block table is `blocks`, whose
    /// tokens are `tokens` and whose full blocks hash to `hashes` (vLLM's `cache_full_blocks`):
    /// each gets its hash and enters the map; one `BlockStored` names them all.
    pub fn cache_full_blocks(
        &mut self,
        blocks: &[BlockId],
        hashes: &[BlockHash],
        tokens: &[u32],
        block_size: usize,
        (from, to): (usize, usize),
    ) {
        let to = to.min(hashes.len()).min(blocks.len());
        if !self.caching || from >= to {
            return;
        }
        let mut stored = Vec::with_capacity(to - from);
        for (&block, &hash) in blocks[from..to].iter().zip(&hashes[from..to]) {
            let Some(slot) = self.block_hash.get_mut(block as usize) else { continue };
            if slot.is_some() {
                continue;
            }
            *slot = Some(hash);
            self.num_cached += 1;
            self.cached.entry(hash).or_default().push(block);
            stored.push(hash.external());
        }
        if self.record_events && !stored.is_empty() {
            let end = (to * block_size).min(tokens.len());
            self.events.push(KvEvent::BlockStored {
                block_hashes: stored,
                parent_block_hash: from.checked_sub(1).and_then(|p| hashes.get(p)).map(BlockHash::external),
                token_ids: tokens.get(from * block_size..end).unwrap_or_default().to_vec(),
                block_size,
            });
        }
    }

    /// Takes `blocks` out of the prefix cache (their KV cannot be trusted: the forward that was
    /// to write them failed).
    pub fn uncache(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            self.evict(b);
        }
    }

    /// Drops `block`'s cache entry, if it has one (vLLM's `_maybe_evict_cached_block`).
    fn evict(&mut self, block: BlockId) {
        let Some(hash) = self.block_hash.get_mut(block as usize).and_then(Option::take) else { return };
        self.num_cached -= 1;
        if let Some(holders) = self.cached.get_mut(&hash) {
            holders.retain(|&b| b != block);
            if holders.is_empty() {
                self.cached.remove(&hash);
            }
        }
        if self.record_events {
            self.events.push(KvEvent::BlockRemoved { block_hashes: vec![hash.external()] });
        }
    }

    /// The KV events queued since the last call (vLLM's `take_events`).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_fifo_and_refuses_beyond_capacity() {
        let mut pool = BlockPool::new(4);
        let a = pool.allocate(3).expect("3 of 4 free");
        assert_eq!(a, vec![0, 1, 2]);
        assert!(pool.allocate(2).is_none());
        pool.free(a);
        assert_eq!(pool.num_free(), 4);
        assert_eq!(pool.allocate(2).expect("free"), vec![3, 0]);
    }

    fn hashes(n: usize) -> Vec<BlockHash> {
        let tokens: Vec<u32> = (0..n as u32 * 2).collect();
        BlockHash::extend_chain(&[], &tokens, 2)
    }

    #[test]
    fn a_freed_cached_block_is_hit_until_an_allocation_evicts_it() {
        let mut pool = BlockPool::with_caching(4, true, true);
        let h = hashes(2);
        let tokens: Vec<u32> = (0..4).collect();
        let a = pool.allocate(2).expect("free");
        pool.cache_full_blocks(&a, &h, &tokens, 2, (0, 2));
        pool.free_request(a.clone());
        assert_eq!((pool.num_free(), pool.num_cached()), (4, 2));
        assert_eq!(pool.lookup(&h, 8), a);
        // A hit takes its free blocks back, and they count against the new ones.
        assert!(pool.allocate_after_hit(&a, 3).is_none());
        let fresh = pool.allocate_after_hit(&a, 2).expect("2 + 2");
        assert_eq!(pool.num_free(), 0);
        pool.free_request([a.clone(), fresh].concat());
        // Uncached blocks go first; then the cached tail block before the head one.
        let next = pool.allocate(3).expect("free");
        assert_eq!(&next[2..], &a[1..]);
        assert_eq!(pool.lookup(&h, 8), vec![a[0]]);
        let events = pool.take_events();
        assert!(
            matches!(&events[0], KvEvent::BlockStored { block_hashes, parent_block_hash: None, .. } if block_hashes.len() == 2)
        );
        assert_eq!(events[1], KvEvent::BlockRemoved { block_hashes: vec![h[1].external()] });
    }
}
