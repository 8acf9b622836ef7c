//! The model sharded over ranks, as vLLM shards it: tensor parallelism splits the KV heads (and
//! replicates them when tp exceeds their count), pipeline parallelism splits the layers, and each
//! rank keeps a KV cache of its own for the layers and heads it holds ([`RankLayout`]).
//!
//! [`ShardedModel`] is an engine's checked set of ranks. Its forward runs the global layers in
//! order: every rank holding a layer writes its slots of it, then `layer_done(layer)` is called
//! once. Each position's [`PositionHash`] folds, for every (layer, head), the slot read back from
//! the first rank (lowest index) holding it; replicas are written with the same bytes and not
//! read. So any topology samples the tokens, and holds the slot bytes, of one rank holding the
//! whole model. The ranks run one after another on the forward's thread; they share the engine's
//! block ids.

use std::ops::Range;
use std::sync::Arc;

use pdflow_kv::memory::{KvCache, KvShape, MemoryKind, RegionError};
use pdflow_kv::topology::{RankLayout, Topology, TopologyError};

use crate::hybrid::{HybridError, HybridLayout};
use crate::model::{fill_kv, slot_hash, ForwardItem, Model, PositionHash};

/// One rank: the global layers and KV heads it holds, and its KV cache of them (local layer `i`
/// is global layer `layers.start + i`, local head `j` global head `heads.start + j`).
pub type Rank = (RankLayout, Arc<KvCache>);

/// Why a set of ranks cannot run the model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RanksError {
    #[error("the ranks do not shard the model: {0}")]
    Topology(#[from] TopologyError),
    #[error("rank {rank} holds layers {layers:?} and KV heads {heads:?} of the model, so its KV cache must have shape {expected:?}, but it has {got:?}")]
    Shape { rank: usize, layers: Range<usize>, heads: Range<usize>, expected: KvShape, got: KvShape },
    #[error("rank {rank}'s KV cache has {got} blocks but the engine has {expected}: every rank holds the engine's blocks under the same ids")]
    NumBlocks { rank: usize, got: usize, expected: usize },
    #[error("rank {rank}'s KV cache is in {memory} memory: a KV cache on a GPU runs only as an engine's one rank (holding every layer and head), not sharded over ranks")]
    ShardedDevice { rank: usize, memory: MemoryKind },
    #[error("a hybrid model runs on one rank in host memory (no tensor or pipeline parallelism, no GPU) in the simulated engine; this engine has {ranks} ranks in {memory} memory")]
    HybridRanks { ranks: usize, memory: MemoryKind },
    #[error("hybrid model: {0}")]
    Hybrid(#[from] HybridError),
}

/// The model over a checked set of ranks (see the module docs).
#[derive(Debug, Clone)]
pub struct ShardedModel {
    model: Model,
    /// Never empty.
    ranks: Vec<Rank>,
    /// A hybrid model's layers and groups (one rank, host memory).
    hybrid: Option<Arc<HybridLayout>>,
}

impl ShardedModel {
    /// `model` (its shape the whole model's) over `ranks`. Refuses ranks that leave a (layer, head)
    /// unheld or hold one outside the model, a rank whose cache is not the model's shape restricted
    /// to its layers and heads, a cache of other than `num_blocks` blocks, and GPU caches when there
    /// is more than one rank.
    pub fn new(model: Model, num_blocks: usize, ranks: Vec<Rank>) -> Result<Self, RanksError> {
        let shape = model.shape;
        let layouts = ranks.iter().map(|(layout, _)| layout.clone()).collect();
        Topology::new(shape.num_layers, shape.num_kv_heads, layouts)?;
        for (rank, (layout, cache)) in ranks.iter().enumerate() {
            let expected = KvShape { num_layers: layout.layers.len(), num_kv_heads: layout.heads.len(), ..shape };
            if cache.shape() != expected {
                return Err(RanksError::Shape {
                    rank,
                    layers: layout.layers.clone(),
                    heads: layout.heads.clone(),
                    expected,
                    got: cache.shape(),
                });
            }
            if cache.num_blocks() != num_blocks {
                return Err(RanksError::NumBlocks { rank, got: cache.num_blocks(), expected: num_blocks });
            }
            if ranks.len() > 1 && cache.memory() != MemoryKind::Host {
                return Err(RanksError::ShardedDevice { rank, memory: cache.memory() });
            }
        }
        Ok(Self { model, ranks, hybrid: None })
    }

    /// The model as a hybrid one of `layout`: one rank in host memory, its shape one region per
    /// layer of a group.
    pub fn with_hybrid(mut self, layout: HybridLayout) -> Result<Self, RanksError> {
        let memory = self.first_cache().memory();
        if self.ranks.len() != 1 || memory != MemoryKind::Host {
            return Err(RanksError::HybridRanks { ranks: self.ranks.len(), memory });
        }
        layout.check(&self.model.shape)?;
        self.hybrid = Some(Arc::new(layout));
        Ok(self)
    }

    /// The model on one cache holding all of it (its shape is the model's).
    pub fn single(vocab_size: u32, cache: Arc<KvCache>) -> Self {
        let model = Model { shape: cache.shape(), vocab_size };
        Self { ranks: vec![(model.whole(), cache)], model, hybrid: None }
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The ranks, in rank order.
    pub fn ranks(&self) -> &[Rank] {
        &self.ranks
    }

    /// Rank 0's cache.
    pub fn first_cache(&self) -> &Arc<KvCache> {
        // `ranks` is never empty: `new` refuses an empty list and `single` makes one.
        &self.ranks[0].1
    }

    /// A step's items over every rank, layer by layer ([`Model::forward_layers`] over the ranks):
    /// `layer_done(layer)` once per global layer, after every rank holding it wrote it. Returns
    /// each item's sampled token (if it samples) or why it failed.
    pub fn forward(
        &self,
        items: &mut [ForwardItem],
        layer_done: &mut dyn FnMut(usize),
    ) -> Vec<Result<Option<u32>, RegionError>> {
        if let (Some(layout), [(_, cache)]) = (&self.hybrid, self.ranks.as_slice()) {
            return crate::hybrid::forward(&self.model, layout, cache, items, layer_done);
        }
        if let [(_, cache)] = self.ranks.as_slice() {
            // One rank holds everything (perhaps on a GPU).
            return self.model.forward_layers(cache, items, layer_done);
        }
        let shards: Vec<Shard<'_>> =
            self.ranks.iter().map(|(layout, cache)| Shard { layout, cache: cache.as_ref() }).collect();
        forward_shards(&self.model, &shards, items, layer_done)
    }
}

/// One host rank as the forward sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shard<'a> {
    pub layout: &'a RankLayout,
    pub cache: &'a KvCache,
}

/// The forward over host shards that together hold every (layer, head) of `model`: layer by
/// layer, each shard holding the layer writes its slots of every item, then the slots of the
/// positions not yet in each item's digest are read back from each (layer, head)'s first holder
/// and folded into their [`PositionHash`], then `layer_done(layer)`. An item that fails stops
/// there (its error returned); the others go on.
pub(crate) fn forward_shards(
    model: &Model,
    shards: &[Shard<'_>],
    items: &mut [ForwardItem],
    layer_done: &mut dyn FnMut(usize),
) -> Vec<Result<Option<u32>, RegionError>> {
    let shape = model.shape;
    let mut slot = vec![0u8; shape.slot_len()];
    let mut failed: Vec<Option<RegionError>> = items.iter().map(|_| None).collect();
    // Per item, one hash per position not yet in its digest.
    let mut pending: Vec<Vec<PositionHash>> = items
        .iter()
        .map(|item| vec![PositionHash::default(); (item.start + item.tokens.len()).saturating_sub(item.digest.upto)])
        .collect();
    for layer in 0..shape.num_layers {
        let writers: Vec<&Shard<'_>> = shards.iter().filter(|s| s.layout.layers.contains(&layer)).collect();
        // Per global head, the first shard holding it in this layer.
        let readers: Vec<(usize, &Shard<'_>)> = (0..shape.num_kv_heads)
            .filter_map(|head| shards.iter().find(|s| s.layout.holds(layer, head)).map(|s| (head, s)))
            .collect();
        for (k, item) in items.iter().enumerate() {
            if failed[k].is_some() {
                continue;
            }
            let done = writers
                .iter()
                .try_for_each(|shard| write_layer(model, shard, item, layer, &mut slot))
                .and_then(|()| read_layer(model, &readers, item, layer, &mut pending[k], &mut slot));
            if let Err(e) = done {
                failed[k] = Some(e);
            }
        }
        layer_done(layer);
    }
    items
        .iter_mut()
        .zip(failed)
        .zip(pending)
        .map(|((item, failed), hashes)| match failed {
            Some(e) => Err(e),
            None => {
                for hash in hashes {
                    item.digest.fold(hash.finish());
                }
                Ok(item.sample.then(|| item.digest.next_token(model.vocab_size)))
            }
        })
        .collect()
}

/// `shard`'s slots of global `layer` for `item`'s tokens, written.
fn write_layer(
    model: &Model,
    shard: &Shard<'_>,
    item: &ForwardItem,
    layer: usize,
    slot: &mut [u8],
) -> Result<(), RegionError> {
    let local_layer = layer - shard.layout.layers.start;
    for (i, &token) in item.tokens.iter().enumerate() {
        let pos = item.start + i;
        let (block, s) = model.locate(&item.block_ids, pos)?;
        for (local_head, head) in shard.layout.heads.clone().enumerate() {
            fill_kv(token, pos, layer, head, slot);
            shard.cache.write_slot(local_layer, block, local_head, s, slot)?;
        }
    }
    Ok(())
}

/// Global `layer`'s slots of the positions in `hashes` (those from `item.digest.upto` on), read
/// back from `readers` (each global head with its first holder, in head order) and folded.
fn read_layer(
    model: &Model,
    readers: &[(usize, &Shard<'_>)],
    item: &ForwardItem,
    layer: usize,
    hashes: &mut [PositionHash],
    slot: &mut [u8],
) -> Result<(), RegionError> {
    for (j, hash) in hashes.iter_mut().enumerate() {
        let (block, s) = model.locate(&item.block_ids, item.digest.upto + j)?;
        for &(head, shard) in readers {
            let (local_layer, local_head) = (layer - shard.layout.layers.start, head - shard.layout.heads.start);
            shard.cache.read_slot(local_layer, block, local_head, s, slot)?;
            hash.fold_slot(layer, head, slot_hash(slot));
        }
    }
    Ok(())
}
