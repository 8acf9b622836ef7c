//! The plan across ranks: for each (P rank, D rank) pair, the coalesced writes of each layer.

use std::collections::{BTreeMap, HashSet};

use pdflow_messages::BlockId;

use super::coalesce::coalesce;
use super::error::{RankPlanError, Side};
use super::layout::{HeadLayout, RankLayout, Topology};
use crate::planner::Descriptor;

/// One write of a pair's plan: `desc.len` bytes from offset `desc.src` inside P's region
/// `src_region` to offset `desc.dst` inside D's region `dst_region`; both regions hold `layer`
/// (region `i` of a rank is layer `layers.start + i`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerDescriptor {
    pub layer: usize,
    pub src_region: usize,
    pub dst_region: usize,
    pub desc: Descriptor,
}

/// What P rank `p_rank` writes into D rank `d_rank`, ordered by layer then source offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairPlan {
    pub p_rank: usize,
    pub d_rank: usize,
    /// Bytes of one block in each of P rank's regions (its local heads × one head's run).
    pub src_block_len: u64,
    /// Bytes of one block in each of D rank's regions.
    pub dst_block_len: u64,
    pub writes: Vec<LayerDescriptor>,
}

/// The whole plan: one entry per pair that moves bytes, ordered by (P rank, D rank).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankPlan {
    pub pairs: Vec<PairPlan>,
}

impl RankPlan {
    pub fn total_bytes(&self) -> u64 {
        self.pairs.iter().flat_map(|p| &p.writes).map(|w| w.desc.len).sum()
    }
    pub fn descriptor_count(&self) -> usize {
        self.pairs.iter().map(|p| p.writes.len()).sum()
    }
    /// What `p_rank` writes into `d_rank`, if anything.
    pub fn pair(&self, p_rank: usize, d_rank: usize) -> Option<&PairPlan> {
        self.pairs.iter().find(|p| p.p_rank == p_rank && p.d_rank == d_rank)
    }
    /// Everything P rank `p_rank` sends (the work of that P worker's `SendWorker`).
    pub fn sends_of(&self, p_rank: usize) -> impl Iterator<Item = &PairPlan> {
        self.pairs.iter().filter(move |p| p.p_rank == p_rank)
    }
    /// The P ranks that write into `d_rank`, ascending (the peers D rank's pull addresses).
    pub fn senders_of(&self, d_rank: usize) -> Vec<usize> {
        self.pairs.iter().filter(|p| p.d_rank == d_rank).map(|p| p.p_rank).collect()
    }
}

/// P's blocks that D's request maps onto: D asks for the tail of the prompt (its prefix cache
/// may hold the start), so position `i` of D's list is position `skip + i` of P's.
pub fn align_tail<'a>(p_blocks: &'a [BlockId], d_blocks: &[BlockId]) -> Result<&'a [BlockId], RankPlanError> {
    let skip = p_blocks
        .len()
        .checked_sub(d_blocks.len())
        .ok_or(RankPlanError::PTooShort { p: p_blocks.len(), d: d_blocks.len() })?;
    Ok(&p_blocks[skip..])
}

/// Plans the request: block `p_blocks[i]` of P holds what block `d_blocks[i]` of D receives (see
/// [`align_tail`]). Every byte of every D rank's blocks (for the layers and heads it holds) gets
/// exactly one writer: among the P ranks holding that (layer, head), D rank `d` reads from holder
/// number `d % holders`. Offsets are inside each rank's per-layer region.
pub fn plan_ranks(
    p: &Topology,
    d: &Topology,
    heads: &HeadLayout,
    p_blocks: &[BlockId],
    d_blocks: &[BlockId],
) -> Result<RankPlan, RankPlanError> {
    check_inputs(p, d, heads, p_blocks, d_blocks)?;
    if d_blocks.is_empty() {
        return Ok(RankPlan::default());
    }
    let mut pieces: BTreeMap<(usize, usize, usize), Vec<Descriptor>> = BTreeMap::new();
    for (d_rank, dr) in d.ranks().iter().enumerate() {
        for layer in dr.layers.clone() {
            for head in dr.heads.clone() {
                let p_rank = sender(p, d_rank, layer, head)?;
                let sides = Sides { pr: &p.ranks()[p_rank], dr, heads, head };
                pieces.entry((p_rank, d_rank, layer)).or_default().extend(sides.runs(p_blocks, d_blocks));
            }
        }
    }
    Ok(assemble(p, d, heads, pieces))
}

/// The P rank that sends `head` of `layer` to `d_rank`.
fn sender(p: &Topology, d_rank: usize, layer: usize, head: usize) -> Result<usize, RankPlanError> {
    let holders = p.holders(layer, head);
    match holders.len() {
        0 => Err(RankPlanError::NoHolder { d_rank, layer, head }),
        n => Ok(holders[d_rank % n]),
    }
}

/// One head's runs from one P rank to one D rank.
struct Sides<'a> {
    pr: &'a RankLayout,
    dr: &'a RankLayout,
    heads: &'a HeadLayout,
    head: usize,
}

impl Sides<'_> {
    /// One piece per block: the head's run in P's block → the head's run in D's block.
    fn runs<'b>(&self, p_blocks: &'b [BlockId], d_blocks: &'b [BlockId]) -> impl Iterator<Item = Descriptor> + 'b {
        let run = self.heads.head_run_len() as u64;
        let (src_block, dst_block) = (self.pr.block_len(self.heads) as u64, self.dr.block_len(self.heads) as u64);
        let src_head = (self.head - self.pr.heads.start) as u64 * run;
        let dst_head = (self.head - self.dr.heads.start) as u64 * run;
        // check_inputs proved every block's offset plus a block fits in u64.
        p_blocks.iter().zip(d_blocks).map(move |(&s, &d)| Descriptor {
            src: u64::from(s) * src_block + src_head,
            dst: u64::from(d) * dst_block + dst_head,
            len: run,
        })
    }
}

/// Groups the pieces per pair, coalescing each layer's.
fn assemble(
    p: &Topology,
    d: &Topology,
    heads: &HeadLayout,
    pieces: BTreeMap<(usize, usize, usize), Vec<Descriptor>>,
) -> RankPlan {
    let mut pairs: Vec<PairPlan> = Vec::new();
    for ((p_rank, d_rank, layer), layer_pieces) in pieces {
        let (pr, dr) = (&p.ranks()[p_rank], &d.ranks()[d_rank]);
        if pairs.last().is_none_or(|last| (last.p_rank, last.d_rank) != (p_rank, d_rank)) {
            pairs.push(PairPlan {
                p_rank,
                d_rank,
                src_block_len: pr.block_len(heads) as u64,
                dst_block_len: dr.block_len(heads) as u64,
                writes: Vec::new(),
            });
        }
        let (src_region, dst_region) = (layer - pr.layers.start, layer - dr.layers.start);
        if let Some(pair) = pairs.last_mut() {
            pair.writes.extend(coalesce(layer_pieces).into_iter().map(|desc| LayerDescriptor {
                layer,
                src_region,
                dst_region,
                desc,
            }));
        }
    }
    RankPlan { pairs }
}

/// The checks before planning: one model on both sides, aligned block lists, distinct
/// destinations, offsets that fit in 64 bits.
fn check_inputs(
    p: &Topology,
    d: &Topology,
    heads: &HeadLayout,
    p_blocks: &[BlockId],
    d_blocks: &[BlockId],
) -> Result<(), RankPlanError> {
    if p.num_layers() != d.num_layers() {
        return Err(RankPlanError::LayerCountMismatch { p: p.num_layers(), d: d.num_layers() });
    }
    for (side, t) in [(Side::P, p), (Side::D, d)] {
        if t.num_kv_heads() != heads.num_kv_heads {
            return Err(RankPlanError::HeadCountMismatch {
                side,
                topology: t.num_kv_heads(),
                layout: heads.num_kv_heads,
            });
        }
    }
    for (what, n) in [("slot_len", heads.slot_len), ("block_size", heads.block_size)] {
        if n == 0 {
            return Err(RankPlanError::EmptyHeadLayout { what });
        }
    }
    if p_blocks.len() != d_blocks.len() {
        return Err(RankPlanError::BlockCountMismatch { p: p_blocks.len(), d: d_blocks.len() });
    }
    let mut seen = HashSet::with_capacity(d_blocks.len());
    if let Some(&block) = d_blocks.iter().find(|&&b| !seen.insert(b)) {
        return Err(RankPlanError::DuplicateDestination { block });
    }
    check_fits(Side::P, p_blocks, heads)?;
    check_fits(Side::D, d_blocks, heads)
}

/// Refuses a block whose end, at the largest block any rank can have (all heads), overflows u64.
fn check_fits(side: Side, blocks: &[BlockId], heads: &HeadLayout) -> Result<(), RankPlanError> {
    let Some(&block) = blocks.iter().max() else { return Ok(()) };
    let block_len = (heads.num_kv_heads as u64)
        .checked_mul(heads.block_size as u64)
        .and_then(|x| x.checked_mul(heads.slot_len as u64));
    match block_len {
        Some(len) if (u64::from(block) + 1).checked_mul(len).is_some() => Ok(()),
        _ => Err(RankPlanError::TooLarge { side, block, block_len: block_len.unwrap_or(u64::MAX) }),
    }
}
