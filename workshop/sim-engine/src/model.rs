//! The deterministic model and tokenizer (docs/simulated-engine.md). Seed steps 15 and 39 run through here.
//!
//! - Tokenizer: words split on whitespace; `w<N>` (N < vocab) is token N, any other word hashes to a
//!   token; token N detokenizes as `" w<N>"`, so generated text round-trips.
//! - KV: the bytes of token `t` at position `p`, layer `l`, head `h` are a splitmix64 stream seeded by
//!   `(t, p, l, h)`. A forward writes each computed position's KV into its block slot.
//! - Sampling: each request keeps a running [`ContextDigest`] over positions `0..n`, where position
//!   `p` contributes a [`PositionHash`] of its KV bytes **read back from the cache**: every (layer,
//!   head) slot hashed on its own ([`slot_hash`]), the slot hashes folded in layer-major then head
//!   order. The next token is a function of the digest and `n`. The digest depends on neither block
//!   ids, chunking nor how the layers and heads are sharded over ranks ([`crate::ranks`]), so P
//!   prefill + transfer + D's first forward yields exactly a single engine's tokens, and a lost or
//!   corrupted KV byte changes the output.

use pdflow_messages::BlockId;

use pdflow_kv::memory::{Checksum, KvCache, KvShape, RegionError};
use pdflow_kv::topology::RankLayout;

use crate::ranks::{forward_shards, Shard};

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's output function over `z + golden`.
#[inline]
pub fn splitmix64(z: u64) -> u64 {
    let mut z = z.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The whitespace tokenizer.
#[derive(Debug, Clone, Copy)]
pub struct Tokenizer {
    pub vocab_size: u32,
}

impl Tokenizer {
    pub fn encode(&self, text: &str) -> Vec<u32> {
        text.split_whitespace().map(|w| self.word_token(w)).collect()
    }

    fn word_token(&self, word: &str) -> u32 {
        if let Some(n) = word.strip_prefix('w').and_then(|n| n.parse::<u32>().ok()) {
            if n < self.vocab_size && !word[1..].starts_with('+') {
                return n;
            }
        }
        let fnv = word.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3));
        (splitmix64(fnv) % u64::from(self.vocab_size.max(1))) as u32
    }

    pub fn decode_token(&self, id: u32) -> String {
        format!(" w{id}")
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter().map(|&id| self.decode_token(id)).collect()
    }
}

/// Fills `out` with the KV bytes of `token` at `pos`, `layer`, `head`.
pub fn fill_kv(token: u32, pos: usize, layer: usize, head: usize, out: &mut [u8]) {
    let seed =
        splitmix64(splitmix64(splitmix64(u64::from(token)) ^ pos as u64) ^ (((layer as u64) << 32) | head as u64));
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let w = splitmix64(seed ^ (i as u64).wrapping_mul(GOLDEN)).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// The running digest of a request's context: positions `0..upto` folded in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextDigest {
    pub value: u64,
    pub upto: usize,
}

impl Default for ContextDigest {
    fn default() -> Self {
        Self { value: 0x5EED_0FC0_47E7, upto: 0 }
    }
}

impl ContextDigest {
    /// Folds in the next position's hash.
    pub(crate) fn fold(&mut self, position_hash: u64) {
        self.value = splitmix64(self.value ^ position_hash.rotate_left(17) ^ (self.upto as u64).wrapping_mul(GOLDEN));
        self.upto += 1;
    }

    /// The greedy next token after the context folded so far.
    pub fn next_token(&self, vocab_size: u32) -> u32 {
        (splitmix64(self.value ^ (self.upto as u64).rotate_left(40)) % u64::from(vocab_size.max(1))) as u32
    }
}

/// A position's hash before any slot is folded in.
const POSITION_SEED: u64 = 0x0B5E_55ED_5107_5EED;

/// The hash of one slot's bytes (one token of one head in one layer): a [`Checksum`] over them.
pub fn slot_hash(bytes: &[u8]) -> u64 {
    let mut sum = Checksum::default();
    sum.update(bytes);
    sum.finish()
}

/// One position's hash, built slot by slot: starting from a fixed seed, each (layer, head) slot's
/// [`slot_hash`] is folded in, layer-major then head order (global indices),
/// `h = splitmix64(h ^ slot_hash.rotate_left(7) ^ (layer << 32 | head) * GOLDEN)`. Each rank can
/// hash the slots it holds; folding them in that order gives what one rank holding every layer
/// and head gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PositionHash(u64);

impl Default for PositionHash {
    fn default() -> Self {
        Self(POSITION_SEED)
    }
}

impl PositionHash {
    /// Folds in the slot of global `layer` and `head`, whose bytes hash to `slot_hash`.
    pub fn fold_slot(&mut self, layer: usize, head: usize, slot_hash: u64) {
        let salt = (((layer as u64) << 32) | head as u64).wrapping_mul(GOLDEN);
        self.0 = splitmix64(self.0 ^ slot_hash.rotate_left(7) ^ salt);
    }

    pub fn finish(&self) -> u64 {
        self.0
    }
}

/// One request's work in one step: compute positions `start..start + tokens.len()`.
#[derive(Debug, Clone)]
pub struct ForwardItem {
    /// Tokens at positions `start..`.
    pub tokens: Vec<u32>,
    pub start: usize,
    /// The request's blocks; must cover every position up to the last computed one.
    pub block_ids: Vec<BlockId>,
    /// A hybrid model's blocks per KV-cache group ([`crate::hybrid`]); empty for a dense model.
    pub group_blocks: Vec<Vec<BlockId>>,
    pub digest: ContextDigest,
    /// Sample a token after this chunk (the last prefill chunk, or a decode step).
    pub sample: bool,
}

/// The model: writes KV, reads it back, samples.
#[derive(Debug, Clone, Copy)]
pub struct Model {
    pub shape: KvShape,
    pub vocab_size: u32,
}

impl Model {
    /// The block and slot of `pos` in a request whose blocks are `block_ids`.
    pub(crate) fn locate(&self, block_ids: &[BlockId], pos: usize) -> Result<(BlockId, usize), RegionError> {
        let bs = self.shape.block_size;
        let block = block_ids
            .get(pos / bs)
            .copied()
            .ok_or(RegionError::BlockOutOfRange { block: BlockId::MAX, num_blocks: block_ids.len() })?;
        Ok((block, pos % bs))
    }

    /// What one rank holding the whole model holds: every layer and KV head.
    pub fn whole(&self) -> RankLayout {
        RankLayout { layers: 0..self.shape.num_layers, heads: 0..self.shape.num_kv_heads }
    }

    /// Writes the KV of `item`'s tokens, folds every position not yet in the digest (reading the KV
    /// back from `cache`, which holds the whole model), and samples if asked. Updates
    /// `item.digest`.
    pub fn forward(&self, cache: &KvCache, item: &mut ForwardItem) -> Result<Option<u32>, RegionError> {
        #[cfg(feature = "cuda")]
        if let Some(kv) = cache.device() {
            return self.forward_on_device(kv, item);
        }
        let whole = self.whole();
        let shards = [Shard { layout: &whole, cache }];
        // One item in, one result out.
        forward_shards(self, &shards, std::slice::from_mut(item), &mut |_| {}).pop().unwrap_or(Ok(None))
    }

    /// [`Model::forward`] for a step's items, layer by layer: every item's KV of layer `l` is
    /// written and read back before layer `l + 1`'s, and `layer_done(l)` is called after it (the
    /// point where vLLM calls the connector's `save_kv_layer`). The KV, the digests and the tokens
    /// are [`Model::forward`]'s. On a GPU cache every item runs whole first, then every layer is
    /// reported.
    pub fn forward_layers(
        &self,
        cache: &KvCache,
        items: &mut [ForwardItem],
        layer_done: &mut dyn FnMut(usize),
    ) -> Vec<Result<Option<u32>, RegionError>> {
        #[cfg(feature = "cuda")]
        if cache.device().is_some() {
            let results = items.iter_mut().map(|item| self.forward(cache, item)).collect();
            (0..self.shape.num_layers).for_each(&mut *layer_done);
            return results;
        }
        let whole = self.whole();
        forward_shards(self, &[Shard { layout: &whole, cache }], items, layer_done)
    }

    /// [`Model::forward`] on a cache in GPU memory: the KV written by one kernel launch, then the
    /// blocks holding the positions not yet in the digest read back once and hashed on the host,
    /// slot by slot as [`PositionHash`] defines — the same digest, the same tokens as on the host.
    #[cfg(feature = "cuda")]
    fn forward_on_device(
        &self,
        kv: &pdflow_kv::cuda::device_kv::DeviceKv,
        item: &mut ForwardItem,
    ) -> Result<Option<u32>, RegionError> {
        kv.with_kernel(crate::cuda_fill::CudaKvFill::new, |fill, r| {
            fill.fill(&r.layer_bases, r.num_blocks, r.shape, &item.tokens, item.start, &item.block_ids)
        })?;
        let end = item.start + item.tokens.len();
        if item.digest.upto < end {
            let bs = self.shape.block_size;
            let first = item.digest.upto / bs;
            // `locate` refuses positions past the request's blocks.
            self.locate(&item.block_ids, end - 1)?;
            let blocks = &item.block_ids[first..=(end - 1) / bs];
            let bytes = kv.read_blocks(blocks)?;
            let (block_len, slot_len) = (self.shape.block_len(), self.shape.slot_len());
            while item.digest.upto < end {
                let pos = item.digest.upto;
                let (index, s) = (pos / bs - first, pos % bs);
                let mut h = PositionHash::default();
                for layer in 0..self.shape.num_layers {
                    for head in 0..self.shape.num_kv_heads {
                        let at = (layer * blocks.len() + index) * block_len + self.shape.slot_offset(head, s);
                        h.fold_slot(layer, head, slot_hash(&bytes[at..at + slot_len]));
                    }
                }
                item.digest.fold(h.finish());
            }
        }
        Ok(item.sample.then(|| item.digest.next_token(self.vocab_size)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: KvShape = KvShape { num_layers: 2, num_kv_heads: 2, head_dim: 8, dtype_bytes: 2, block_size: 4 };

    /// Runs a prompt through `model` in chunks of `chunk`, then decodes `n` tokens.
    fn generate(
        model: &Model,
        cache: &KvCache,
        blocks: &[BlockId],
        prompt: &[u32],
        chunk: usize,
        n: usize,
    ) -> Vec<u32> {
        let mut digest = ContextDigest::default();
        let mut tokens = prompt.to_vec();
        let mut start = 0;
        let mut out = Vec::new();
        while out.len() < n {
            let end = (start + chunk).min(tokens.len());
            let mut item = ForwardItem {
                tokens: tokens[start..end].to_vec(),
                start,
                block_ids: blocks.to_vec(),
                group_blocks: Vec::new(),
                digest,
                sample: end == tokens.len(),
            };
            let t = model.forward(cache, &mut item).expect("blocks cover the context");
            digest = item.digest;
            start = end;
            if let Some(t) = t {
                tokens.push(t);
                out.push(t);
            }
        }
        out
    }

    #[test]
    fn tokenizer_round_trips_generated_text() {
        let tok = Tokenizer { vocab_size: 100 };
        assert_eq!(tok.encode(" w5 w99  w7"), vec![5, 99, 7]);
        let ids = tok.encode("hello world w100");
        assert!(ids.iter().all(|&t| t < 100));
        assert_eq!(tok.encode(&tok.decode(&[3, 1, 4])), vec![3, 1, 4]);
    }

    #[test]
    fn chunked_and_unchunked_prefill_give_the_same_tokens() {
        let model = Model { shape: SMALL, vocab_size: 1000 };
        let prompt: Vec<u32> = (0..13).map(|i| i * 7 % 1000).collect();
        let a = KvCache::new(SMALL, 8);
        let b = KvCache::new(SMALL, 8);
        let one = generate(&model, &a, &[0, 1, 2, 3, 4, 5], &prompt, 64, 6);
        let chunked = generate(&model, &b, &[7, 3, 5, 1, 0, 2], &prompt, 5, 6);
        assert_eq!(one, chunked);
    }

    #[test]
    fn layer_by_layer_gives_the_same_kv_and_tokens_and_reports_every_layer_once() {
        let model = Model { shape: SMALL, vocab_size: 1000 };
        let (whole, layered) = (KvCache::new(SMALL, 8), KvCache::new(SMALL, 8));
        let prompt: Vec<u32> = (0..11).map(|t| t * 7 % 1000).collect();
        let item = |start: usize, end: usize, digest: ContextDigest| ForwardItem {
            tokens: prompt[start..end].to_vec(),
            start,
            block_ids: vec![5, 1, 6],
            group_blocks: Vec::new(),
            digest,
            sample: end == prompt.len(),
        };
        let (mut a, mut b) = (item(0, 6, ContextDigest::default()), item(0, 6, ContextDigest::default()));
        model.forward(&whole, &mut a).expect("forward");
        let mut layers = Vec::new();
        model.forward_layers(&layered, std::slice::from_mut(&mut b), &mut |l| layers.push(l));
        assert_eq!(layers, (0..SMALL.num_layers).collect::<Vec<_>>());
        let (mut a2, mut b2) = (item(6, 11, a.digest), item(6, 11, b.digest));
        let t_whole = model.forward(&whole, &mut a2).expect("forward");
        let t_layered = model.forward_layers(&layered, std::slice::from_mut(&mut b2), &mut |_| {});
        assert_eq!(a2.digest, b2.digest);
        assert_eq!(Some(t_whole), t_layered.into_iter().next().map(|r| r.expect("forward")));
        assert_eq!(whole.blocks_checksum(&[5, 1, 6]).ok(), layered.blocks_checksum(&[5, 1, 6]).ok());
    }

    #[test]
    fn a_position_s_hash_folds_each_slot_s_own_checksum_layer_major_then_head() {
        let model = Model { shape: SMALL, vocab_size: 1000 };
        let cache = KvCache::new(SMALL, 4);
        let mut item = ForwardItem {
            tokens: vec![42],
            start: 0,
            block_ids: vec![3],
            group_blocks: Vec::new(),
            digest: ContextDigest::default(),
            sample: true,
        };
        let sampled = model.forward(&cache, &mut item).expect("in range");
        let mut want = PositionHash(POSITION_SEED);
        let mut slot = vec![0u8; SMALL.slot_len()];
        for layer in 0..SMALL.num_layers {
            for head in 0..SMALL.num_kv_heads {
                fill_kv(42, 0, layer, head, &mut slot);
                let mut sum = Checksum::default();
                sum.update(&slot);
                let salt = (((layer as u64) << 32) | head as u64).wrapping_mul(GOLDEN);
                want.0 = splitmix64(want.0 ^ sum.finish().rotate_left(7) ^ salt);
            }
        }
        let mut digest = ContextDigest::default();
        digest.fold(want.finish());
        assert_eq!(item.digest, digest);
        assert_eq!(sampled, Some(digest.next_token(1000)));
    }

    #[test]
    fn corrupting_one_kv_byte_changes_the_next_token() {
        let model = Model { shape: SMALL, vocab_size: 1 << 30 };
        let cache = KvCache::new(SMALL, 4);
        let blocks = [0, 1, 2, 3];
        let prompt: Vec<u32> = (0..9).collect();
        // Prefill all but the last prompt token, then resume at prompt_len - 1 twice: once clean, once
        // with one byte of position 3 flipped.
        let mut item = ForwardItem {
            tokens: prompt[..8].to_vec(),
            start: 0,
            block_ids: blocks.to_vec(),
            group_blocks: Vec::new(),
            digest: ContextDigest::default(),
            sample: false,
        };
        model.forward(&cache, &mut item).expect("in range");
        let resume = |cache: &KvCache| {
            let mut it = ForwardItem {
                tokens: vec![prompt[8]],
                start: 8,
                block_ids: blocks.to_vec(),
                group_blocks: Vec::new(),
                digest: ContextDigest::default(),
                sample: true,
            };
            model.forward(cache, &mut it).expect("in range")
        };
        let clean = resume(&cache);
        let mut slot = vec![0u8; SMALL.slot_len()];
        cache.read_slot(1, 0, 1, 3, &mut slot).expect("in range");
        slot[5] ^= 0x01;
        cache.write_slot(1, 0, 1, 3, &slot).expect("in range");
        assert_ne!(clean, resume(&cache));
    }

    #[test]
    fn a_remote_load_resumed_at_prompt_minus_one_gives_the_same_tokens() {
        let model = Model { shape: SMALL, vocab_size: 1000 };
        let prompt: Vec<u32> = (0..10).map(|i| 3 * i + 1).collect();
        let a = KvCache::new(SMALL, 6);
        let a_blocks = [2, 4, 0];
        let alone = generate(&model, &a, &[2, 4, 0, 1, 3, 5], &prompt, 64, 5);
        // Engine B receives A's prompt blocks (as a transfer would write them) into its own blocks.
        let b = KvCache::new(SMALL, 6);
        let b_blocks = [5, 1, 3, 0, 2, 4];
        let mut slot = vec![0u8; SMALL.slot_len()];
        for (&src, &dst) in a_blocks.iter().zip(&b_blocks) {
            for l in 0..SMALL.num_layers {
                for h in 0..SMALL.num_kv_heads {
                    for s in 0..SMALL.block_size {
                        a.read_slot(l, src, h, s, &mut slot).expect("in range");
                        b.write_slot(l, dst, h, s, &slot).expect("in range");
                    }
                }
            }
        }
        let mut tokens = prompt.clone();
        let mut digest = ContextDigest::default();
        let mut start = prompt.len() - 1;
        let mut out = Vec::new();
        while out.len() < 5 {
            let mut it = ForwardItem {
                tokens: tokens[start..].to_vec(),
                start,
                block_ids: b_blocks.to_vec(),
                group_blocks: Vec::new(),
                digest,
                sample: true,
            };
            let t = model.forward(&b, &mut it).expect("in range").expect("sampled");
            digest = it.digest;
            start = tokens.len();
            tokens.push(t);
            out.push(t);
        }
        assert_eq!(out, alone);
    }

    #[test]
    fn qwen3_8b_shaped_forward_reads_every_layer() {
        let shape = KvShape::QWEN3_8B;
        let model = Model { shape, vocab_size: 32000 };
        let cache = KvCache::new(shape, 3);
        let prompt: Vec<u32> = (100..140).collect();
        let t1 = generate(&model, &cache, &[0, 1, 2], &prompt, 64, 1);
        let mut slot = vec![0u8; shape.slot_len()];
        cache.read_slot(35, 1, 7, 2, &mut slot).expect("in range");
        slot[511] ^= 0x80;
        cache.write_slot(35, 1, 7, 2, &slot).expect("in range");
        let mut it = ForwardItem {
            tokens: vec![prompt[39]],
            start: 39,
            block_ids: vec![0, 1, 2],
            group_blocks: Vec::new(),
            digest: ContextDigest::default(),
            sample: true,
        };
        assert_ne!(model.forward(&cache, &mut it).expect("in range"), Some(t1[0]));
    }
}
