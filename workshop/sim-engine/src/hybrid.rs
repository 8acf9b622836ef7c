//! Hybrid models in the simulated engine, as vLLM's hybrid allocator runs them: layers of a few
//! kinds (full attention, sliding window, a recurrent state), one KV-cache group per kind and
//! group size, each group its own block ids from the engine's one pool, and one layer of every
//! group sharing each KV region (vLLM overlays them on one buffer: a block id is one group's at a
//! time). Seed steps 15 and 39 run through [`forward`] for such a model.
//!
//! The model, in which every byte of every group changes the output:
//! - full-attention layers write each position's KV as a dense model does; the running
//!   [`ContextDigest`] folds every position's slots of these layers, read back from the cache;
//! - sliding-window layers write the same way; a sampled token reads back the slots of the last
//!   `window` positions only (what the window keeps);
//! - a state layer keeps one page per request (its group's one block): computing position `p`
//!   reads the whole page back, and overwrites it with a stream seeded by its hash, the token and
//!   `p` (a zero state before position 0); a sampled token reads every state page back.
//!
//! The sampled token is a function of the three. So P prefilling all but the last prompt token,
//! the window's blocks and the state pages moved, and D computing the last token gives a single
//! engine's tokens; a lost or stale byte of any group changes them.

use pdflow_kv::memory::{KvCache, KvShape, RegionError};
use pdflow_messages::kv_groups::{KvGroupKind, KvGroupSpec};
use pdflow_messages::BlockId;

use crate::model::{fill_kv, slot_hash, splitmix64, ContextDigest, ForwardItem, Model, PositionHash};

/// A hybrid model's layers and groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HybridLayout {
    /// The groups, in vLLM's order.
    pub groups: Vec<KvGroupSpec>,
    /// The group of each model layer.
    pub layer_groups: Vec<usize>,
}

/// Why a layout cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HybridError {
    #[error("a hybrid model has more than one KV-cache group; this layout has {0}")]
    OneGroup(usize),
    #[error("layer {layer} names group {group}, and the model has {groups}")]
    NoGroup { layer: usize, group: usize, groups: usize },
    #[error("group {group} has {got} layers and group 0 has {expected}: vLLM's hybrid allocator makes groups of one size (one layer of each shares a KV region)")]
    GroupSize { group: usize, got: usize, expected: usize },
    #[error("the KV shape has {regions} layers (regions) and the layout {expected} layers per group")]
    Regions { regions: usize, expected: usize },
}

/// A model's KV as an engine runs it: its shape (one region per layer, or per layer of a group)
/// and, for a hybrid model, its layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelShape {
    pub kv: KvShape,
    pub hybrid: Option<HybridLayout>,
}

impl From<KvShape> for ModelShape {
    fn from(kv: KvShape) -> Self {
        Self { kv, hybrid: None }
    }
}

/// The named hybrid presets (`--kv-shape`).
pub const PRESETS: &[&str] = &["gpt-oss-like", "qwen3.5-like"];

impl HybridLayout {
    /// A named preset: its KV shape (one region per layer of a group) and layout.
    /// - `gpt-oss-like`: 24 layers alternating sliding window 128 and full attention, 8 KV heads
    ///   of 64, bf16, block 16 — two groups of 12;
    /// - `qwen3.5-like`: 24 layers, three linear-attention (a recurrent state) per full-attention
    ///   layer, 2 KV heads of 256, bf16, block 16 — four groups of 6 (three of state).
    pub fn preset(name: &str) -> Option<(KvShape, HybridLayout)> {
        match name {
            "gpt-oss-like" => {
                let groups = vec![
                    KvGroupSpec { kind: KvGroupKind::SlidingWindow { window: 128 }, block_size: 16 },
                    KvGroupSpec::full(16),
                ];
                let layer_groups = (0..24).map(|l| l % 2).collect();
                let shape = KvShape { num_layers: 12, num_kv_heads: 8, head_dim: 64, dtype_bytes: 2, block_size: 16 };
                Some((shape, HybridLayout { groups, layer_groups }))
            }
            "qwen3.5-like" => {
                let state = KvGroupSpec { kind: KvGroupKind::State, block_size: 16 };
                let groups = vec![state, state, state, KvGroupSpec::full(16)];
                let layer_groups = (0..24).map(|l| l % 4).collect();
                let shape = KvShape { num_layers: 6, num_kv_heads: 2, head_dim: 256, dtype_bytes: 2, block_size: 16 };
                Some((shape, HybridLayout { groups, layer_groups }))
            }
            _ => None,
        }
    }

    /// Checks the layout against the engine's KV shape (one region per layer of a group).
    pub fn check(&self, shape: &KvShape) -> Result<(), HybridError> {
        if self.groups.len() < 2 {
            return Err(HybridError::OneGroup(self.groups.len()));
        }
        let mut sizes = vec![0usize; self.groups.len()];
        for (layer, &group) in self.layer_groups.iter().enumerate() {
            let size = sizes.get_mut(group).ok_or(HybridError::NoGroup { layer, group, groups: self.groups.len() })?;
            *size += 1;
        }
        if let Some((group, &got)) = sizes.iter().enumerate().find(|(_, &n)| n != sizes[0]) {
            return Err(HybridError::GroupSize { group, got, expected: sizes[0] });
        }
        if shape.num_layers != sizes[0] {
            return Err(HybridError::Regions { regions: shape.num_layers, expected: sizes[0] });
        }
        Ok(())
    }

    /// The KV region layer `layer` writes: its index among its group's layers.
    pub fn region(&self, layer: usize) -> usize {
        let group = self.layer_groups[layer];
        self.layer_groups[..layer].iter().filter(|&&g| g == group).count()
    }

    /// Blocks a request of `tokens` tokens holds in each group (a state group: its one page).
    pub fn blocks_for(&self, tokens: usize) -> Vec<usize> {
        self.groups
            .iter()
            .map(|g| match g.kind {
                KvGroupKind::State => 1,
                _ => tokens.div_ceil(g.block_size.max(1) as usize),
            })
            .collect()
    }
}

/// The state page of `layer` for position `pos` (0: a zero state), overwritten from the page
/// before: every byte of the page depends on every byte before and on the token.
fn advance_state(
    cache: &KvCache,
    region: usize,
    block: BlockId,
    (token, pos, layer): (u32, usize, usize),
    slot: &mut [u8],
) -> Result<(), RegionError> {
    let shape = cache.shape();
    let before = if pos == 0 { 0 } else { page_hash(cache, region, block, slot)? };
    let seed = splitmix64(before ^ splitmix64(u64::from(token) ^ ((pos as u64) << 24) ^ ((layer as u64) << 48)));
    for head in 0..shape.num_kv_heads {
        for s in 0..shape.block_size {
            fill_kv(seed as u32, (seed >> 32) as usize ^ s, layer, head, slot);
            cache.write_slot(region, block, head, s, slot)?;
        }
    }
    Ok(())
}

/// The hash of a whole page (every slot of every head), read back.
fn page_hash(cache: &KvCache, region: usize, block: BlockId, slot: &mut [u8]) -> Result<u64, RegionError> {
    let shape = cache.shape();
    let mut h = PositionHash::default();
    for head in 0..shape.num_kv_heads {
        for s in 0..shape.block_size {
            cache.read_slot(region, block, head, s, slot)?;
            h.fold_slot(head, s, slot_hash(slot));
        }
    }
    Ok(h.finish())
}

/// The block of `pos` in a group's list.
fn block_of(blocks: &[BlockId], pos: usize, block_size: usize) -> Result<BlockId, RegionError> {
    blocks
        .get(pos / block_size.max(1))
        .copied()
        .ok_or(RegionError::BlockOutOfRange { block: BlockId::MAX, num_blocks: blocks.len() })
}

/// One step's items on a hybrid model (see the module docs); `layer_done` is called for every
/// region after the items ran (a hybrid model is not streamed layer by layer).
pub(crate) fn forward(
    model: &Model,
    layout: &HybridLayout,
    cache: &KvCache,
    items: &mut [ForwardItem],
    layer_done: &mut dyn FnMut(usize),
) -> Vec<Result<Option<u32>, RegionError>> {
    let results = items.iter_mut().map(|item| forward_item(model, layout, cache, item)).collect();
    (0..cache.shape().num_layers).for_each(layer_done);
    results
}

fn forward_item(
    model: &Model,
    layout: &HybridLayout,
    cache: &KvCache,
    item: &mut ForwardItem,
) -> Result<Option<u32>, RegionError> {
    let shape = cache.shape();
    let mut slot = vec![0u8; shape.slot_len()];
    // The group of a layer and the item's blocks in it.
    let blocks = |layer: usize| -> (&KvGroupSpec, &[BlockId]) {
        let g = layout.layer_groups[layer];
        (&layout.groups[g], item.group_blocks.get(g).map(Vec::as_slice).unwrap_or_default())
    };
    for (i, &token) in item.tokens.iter().enumerate() {
        let pos = item.start + i;
        for layer in 0..layout.layer_groups.len() {
            let (group, ids) = blocks(layer);
            let region = layout.region(layer);
            match group.kind {
                KvGroupKind::State => {
                    let page =
                        *ids.last().ok_or(RegionError::BlockOutOfRange { block: BlockId::MAX, num_blocks: 0 })?;
                    advance_state(cache, region, page, (token, pos, layer), &mut slot)?;
                }
                _ => {
                    let block = block_of(ids, pos, group.block_size as usize)?;
                    for head in 0..shape.num_kv_heads {
                        fill_kv(token, pos, layer, head, &mut slot);
                        cache.write_slot(region, block, head, pos % group.block_size as usize, &slot)?;
                    }
                }
            }
        }
    }
    let end = item.start + item.tokens.len();
    // Full attention: every position, folded once.
    while item.digest.upto < end {
        let pos = item.digest.upto;
        let mut h = PositionHash::default();
        for layer in 0..layout.layer_groups.len() {
            let (group, ids) = blocks(layer);
            if group.kind == KvGroupKind::FullAttention {
                fold_position(
                    cache,
                    (layout.region(layer), layer),
                    block_of(ids, pos, group.block_size as usize)?,
                    pos % group.block_size as usize,
                    &mut h,
                    &mut slot,
                )?;
            }
        }
        item.digest.fold(h.finish());
    }
    if !item.sample {
        return Ok(None);
    }
    // The window's positions and every state page, read back at the sampled token.
    let mut tail = PositionHash::default();
    for layer in 0..layout.layer_groups.len() {
        let (group, ids) = blocks(layer);
        let region = layout.region(layer);
        match group.kind {
            KvGroupKind::SlidingWindow { window } => {
                let bs = group.block_size as usize;
                for pos in end.saturating_sub(window as usize)..end {
                    fold_position(cache, (region, layer), block_of(ids, pos, bs)?, pos % bs, &mut tail, &mut slot)?;
                }
            }
            KvGroupKind::State => {
                let page = *ids.last().ok_or(RegionError::BlockOutOfRange { block: BlockId::MAX, num_blocks: 0 })?;
                tail.fold_slot(layer, usize::MAX, page_hash(cache, region, page, &mut slot)?);
            }
            KvGroupKind::FullAttention => {}
        }
    }
    let sampled = ContextDigest { value: item.digest.value ^ tail.finish(), upto: item.digest.upto };
    Ok(Some(sampled.next_token(model.vocab_size)))
}

/// Folds one position's slots of `layer` (in `region`, `block`, slot `s`) into `h`.
fn fold_position(
    cache: &KvCache,
    (region, layer): (usize, usize),
    block: BlockId,
    s: usize,
    h: &mut PositionHash,
    slot: &mut [u8],
) -> Result<(), RegionError> {
    for head in 0..cache.shape().num_kv_heads {
        cache.read_slot(region, block, head, s, slot)?;
        h.fold_slot(layer, head, slot_hash(slot));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdflow_kv::memory::KvCache;

    /// gpt-oss-like at a small size: sliding window 8 and full attention, block 4, 2 regions.
    fn small() -> (KvShape, HybridLayout, Model) {
        let shape = KvShape { num_layers: 2, num_kv_heads: 2, head_dim: 8, dtype_bytes: 2, block_size: 4 };
        let swa = KvGroupSpec { kind: KvGroupKind::SlidingWindow { window: 8 }, block_size: 4 };
        let state = KvGroupSpec { kind: KvGroupKind::State, block_size: 4 };
        let layout =
            HybridLayout { groups: vec![swa, KvGroupSpec::full(4), state], layer_groups: vec![0, 1, 2, 0, 1, 2] };
        (shape, layout.clone(), Model { shape, vocab_size: 1000 })
    }

    fn item(tokens: &[u32], start: usize, groups: &[Vec<BlockId>], digest: ContextDigest, sample: bool) -> ForwardItem {
        ForwardItem {
            tokens: tokens.to_vec(),
            start,
            block_ids: groups.concat(),
            group_blocks: groups.to_vec(),
            digest,
            sample,
        }
    }

    /// One forward over `prompt` in chunks of `chunk` on a fresh cache; the sampled token.
    fn alone(prompt: &[u32], chunk: usize) -> u32 {
        let (shape, layout, model) = small();
        let cache = KvCache::new(shape, 32);
        let groups = vec![(0..6).collect(), (6..12).collect(), vec![12]];
        let mut digest = ContextDigest::default();
        let mut sampled = None;
        for start in (0..prompt.len()).step_by(chunk) {
            let end = (start + chunk).min(prompt.len());
            let mut it = item(&prompt[start..end], start, &groups, digest, end == prompt.len());
            sampled =
                forward(&model, &layout, &cache, std::slice::from_mut(&mut it), &mut |_| {}).remove(0).expect("runs");
            digest = it.digest;
        }
        sampled.expect("the last chunk samples")
    }

    #[test]
    fn presets_fit_their_shapes_and_a_bad_layout_is_refused() {
        for name in PRESETS {
            let (shape, layout) = HybridLayout::preset(name).expect("a preset");
            assert_eq!(layout.check(&shape), Ok(()), "{name}");
        }
        let (shape, mut layout, _) = small();
        layout.layer_groups.push(0);
        assert!(matches!(layout.check(&shape), Err(HybridError::GroupSize { .. })));
    }

    #[test]
    fn p_s_window_and_state_moved_to_d_give_a_single_engine_s_token_and_every_byte_counts() {
        let prompt: Vec<u32> = (0..22).map(|i| (i * 37 + 5) % 1000).collect();
        let want = alone(&prompt, 64);
        assert_eq!(alone(&prompt, 5), want, "chunking does not change the token");
        // P prefills all but the last token.
        let (shape, layout, model) = small();
        let p = KvCache::new(shape, 32);
        let p_groups: Vec<Vec<BlockId>> = vec![(0..6).collect(), (6..12).collect(), vec![12]];
        let n = prompt.len() - 1;
        let mut it = item(&prompt[..n], 0, &p_groups, ContextDigest::default(), true);
        forward(&model, &layout, &p, std::slice::from_mut(&mut it), &mut |_| {}).remove(0).expect("P runs");
        // D: other block ids; full attention's every block, the window's last cdiv(8, 4) + 1 = 3
        // blocks, the state page — copied region by region; nothing else.
        let d_groups: Vec<Vec<BlockId>> = vec![(20..26).collect(), (26..32).collect(), vec![13]];
        let moved = |d: &KvCache, skip_window: usize| {
            for (g, range) in [(0usize, skip_window..6), (1, 0..6), (2, 0..1)] {
                for i in range {
                    let (src, dst) = (p_groups[g][i], d_groups[g][i]);
                    for region in 0..shape.num_layers {
                        for head in 0..shape.num_kv_heads {
                            for s in 0..shape.block_size {
                                let mut slot = vec![0u8; shape.slot_len()];
                                p.read_slot(region, src, head, s, &mut slot).expect("P's slot");
                                d.write_slot(region, dst, head, s, &slot).expect("D's slot");
                            }
                        }
                    }
                }
            }
        };
        let decode = |d: &KvCache| {
            let mut it = item(&prompt[n..], n, &d_groups, ContextDigest::default(), true);
            forward(&model, &layout, d, std::slice::from_mut(&mut it), &mut |_| {}).remove(0).expect("D runs")
        };
        let d = KvCache::new(shape, 32);
        moved(&d, 3);
        assert_eq!(decode(&d), Some(want), "the window's blocks are enough");
        // One byte of the state page, or of a slot inside the window, changes the token.
        for (region, block, slot) in [(0, 13, 0), (0, 25, 0), (1, 23, 2)] {
            let d = KvCache::new(shape, 32);
            moved(&d, 3);
            let mut bytes = vec![0u8; shape.slot_len()];
            d.read_slot(region, block, 1, slot, &mut bytes).expect("read");
            bytes[3] ^= 1;
            d.write_slot(region, block, 1, slot, &bytes).expect("write");
            assert_ne!(decode(&d), Some(want), "a byte of region {region}, block {block} counts");
        }
    }
}
