//! The scheduler's side of prefix caching (vLLM's `KVCacheManager`): a waiting request's local
//! hit (`get_computed_blocks`, never the whole prompt: the last token is always computed, to
//! sample the next one), its first allocation behind the hit, caching the full blocks a step
//! computes (`cache_blocks`, at allocation, as vLLM does), and the counters: prefix-cache
//! queries and hits at admission, prompt tokens by source once the prefill is done.

use pdflow_messages::BlockId;

use super::Scheduler;
use crate::cache_stats::PromptSources;

impl Scheduler {
    /// The cached blocks of a waiting request's longest cached prefix: at most the blocks before
    /// its last token, none unless prefix caching is on and nothing is computed yet.
    pub(super) fn local_hit(&mut self, id: &str) -> Vec<BlockId> {
        if !self.pool.caching() {
            return Vec::new();
        }
        let bs = self.config.shape.block_size;
        let Some(r) = self.requests.get_mut(id) else { return Vec::new() };
        if r.num_computed_tokens > 0 || !r.block_ids.is_empty() {
            return Vec::new();
        }
        r.update_block_hashes(bs);
        let max_blocks = r.num_tokens().saturating_sub(1) / bs.max(1);
        self.pool.lookup(&r.block_hashes, max_blocks)
    }

    /// The first allocation of a request with a local hit: the hit's blocks, then new blocks up
    /// to `tokens` tokens; the hit's tokens computed. False, and nothing taken, if the pool is
    /// short. Without a hit, [`Scheduler::allocate_for`].
    pub(super) fn allocate_behind_hit(&mut self, id: &str, hit: &[BlockId], tokens: usize) -> bool {
        if hit.is_empty() {
            return self.allocate_for(id, tokens);
        }
        let bs = self.config.shape.block_size;
        let Some(r) = self.requests.get_mut(id) else { return false };
        let need = self.config.shape.blocks_for(tokens).saturating_sub(hit.len());
        let Some(fresh) = self.pool.allocate_after_hit(hit, need) else { return false };
        r.block_ids = [hit, &fresh].concat();
        r.num_computed_tokens = hit.len() * bs;
        r.num_cached_blocks = hit.len();
        r.hit_blocks = hit.len();
        true
    }

    /// Caches the full blocks of `id`'s first `tokens` tokens not cached yet (vLLM's
    /// `cache_blocks`, called as a step's blocks are allocated).
    pub(super) fn cache_blocks(&mut self, id: &str, tokens: usize) {
        if !self.pool.caching() {
            return;
        }
        let bs = self.config.shape.block_size;
        let Some(r) = self.requests.get_mut(id) else { return };
        r.update_block_hashes(bs);
        let full = tokens.min(r.num_tokens()) / bs.max(1);
        if full <= r.num_cached_blocks {
            return;
        }
        self.pool.cache_full_blocks(&r.block_ids, &r.block_hashes, &r.all_token_ids, bs, (r.num_cached_blocks, full));
        r.num_cached_blocks = full.min(r.block_ids.len());
    }

    /// A request's blocks that it cached itself, out of the cache again (its forward failed, so
    /// their KV was never written).
    pub(super) fn uncache_own_blocks(&mut self, id: &str) {
        let Some(r) = self.requests.get_mut(id) else { return };
        let own = r.block_ids.get(r.hit_blocks..r.num_cached_blocks).unwrap_or_default();
        self.pool.uncache(own);
        r.num_cached_blocks = r.hit_blocks;
    }

    /// A request admitted (blocks allocated for the first time): the lookup counted, and where
    /// its prompt's tokens come from recorded (`external`: tokens the connector loads).
    pub(super) fn record_admission(&mut self, id: &str, external: usize) {
        let bs = self.config.shape.block_size;
        let caching = self.pool.caching();
        let Some(r) = self.requests.get_mut(id) else { return };
        let hit = r.hit_blocks * bs;
        if caching {
            self.cache_stats.record_query(r.num_tokens(), hit);
        }
        r.prompt_sources =
            Some(PromptSources { prompt: r.prompt_len, local_cache_hit: hit, external_kv_transfer: external });
        self.publish_cache_stats();
    }

    /// A request's prefill done (its first token sampled): its prompt tokens counted by source.
    pub(super) fn record_prefill_done(&mut self, id: &str) {
        let Some(sources) = self.requests.get_mut(id).and_then(|r| r.prompt_sources.take()) else { return };
        self.cache_stats.record_prompt(sources);
        self.publish_cache_stats();
    }
}
