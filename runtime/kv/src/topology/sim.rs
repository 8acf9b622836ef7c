//! A simulated deployment for the tests: every rank's regions as cells (one per byte) holding a
//! tag that names (layer, head, block, byte), a plan applied into zeroed D ranks while counting
//! the writes to every cell, and the check that D holds exactly what it asked for.

use pdflow_messages::BlockId;

use super::{plan_ranks, HeadLayout, LayerDescriptor, RankLayout, RankPlan, Topology};

/// The tag of one byte of one head's run in one block: unique and never 0 (0 is "unwritten").
pub(super) fn tag(layer: usize, head: usize, block: BlockId, byte: usize) -> u64 {
    1 + ((layer as u64) << 48 | (head as u64) << 36 | u64::from(block) << 24 | byte as u64)
}

/// The (layer, head) a tag names.
fn tag_layer_head(tag: u64) -> (usize, usize) {
    let t = tag - 1;
    ((t >> 48) as usize, ((t >> 36) & 0xfff) as usize)
}

/// One rank's memory: per region (layer held), one cell per byte, and the writes each received.
struct RankMem {
    regions: Vec<Vec<u64>>,
    writes: Vec<Vec<u32>>,
}

impl RankMem {
    fn zeroed(r: &RankLayout, heads: &HeadLayout, num_blocks: usize) -> Self {
        let len = num_blocks * r.block_len(heads);
        Self { regions: vec![vec![0; len]; r.layers.len()], writes: vec![vec![0; len]; r.layers.len()] }
    }

    /// P's memory: every cell tagged with its own (layer, head, block, byte).
    fn filled(r: &RankLayout, heads: &HeadLayout, num_blocks: usize) -> Self {
        let mut mem = Self::zeroed(r, heads, num_blocks);
        let run = heads.head_run_len();
        for (region, layer) in r.layers.clone().enumerate() {
            for (i, cell) in mem.regions[region].iter_mut().enumerate() {
                let (block, within) = (i / r.block_len(heads), i % r.block_len(heads));
                *cell = tag(layer, r.heads.start + within / run, block as BlockId, within % run);
            }
        }
        mem
    }
}

/// Plans, applies the plan into zeroed D ranks and checks every D cell; the plan on success.
pub(super) fn simulate(
    p: &Topology,
    d: &Topology,
    heads: &HeadLayout,
    p_blocks: &[BlockId],
    d_blocks: &[BlockId],
) -> Result<RankPlan, String> {
    let plan = plan_ranks(p, d, heads, p_blocks, d_blocks).map_err(|e| format!("plan refused: {e}"))?;
    let cache_blocks = |ids: &[BlockId]| ids.iter().max().map_or(1, |&m| m as usize + 2);
    let p_mem: Vec<RankMem> = p.ranks().iter().map(|r| RankMem::filled(r, heads, cache_blocks(p_blocks))).collect();
    let mut d_mem: Vec<RankMem> = d.ranks().iter().map(|r| RankMem::zeroed(r, heads, cache_blocks(d_blocks))).collect();
    for pair in &plan.pairs {
        let (pr, dr) = (&p.ranks()[pair.p_rank], &d.ranks()[pair.d_rank]);
        let (src, dst) = (&p_mem[pair.p_rank], &mut d_mem[pair.d_rank]);
        for w in &pair.writes {
            apply(w, (pr, src), (dr, dst)).map_err(|e| format!("P{} → D{}: {w:?}: {e}", pair.p_rank, pair.d_rank))?;
        }
    }
    for (d_rank, (r, mem)) in d.ranks().iter().zip(&d_mem).enumerate() {
        check_rank(r, mem, heads, p_blocks, d_blocks).map_err(|e| format!("D rank {d_rank}: {e}"))?;
    }
    Ok(plan)
}

/// Copies one write, refusing a source outside a P region of the write's layer, a copied cell
/// whose (layer, head) the P rank does not hold, and a destination outside D's region.
fn apply(
    w: &LayerDescriptor,
    (pr, src): (&RankLayout, &RankMem),
    (dr, dst): (&RankLayout, &mut RankMem),
) -> Result<(), String> {
    if pr.layers.start + w.src_region != w.layer || !pr.layers.contains(&w.layer) {
        return Err(format!("P's region {} is not layer {} (P holds {:?})", w.src_region, w.layer, pr.layers));
    }
    if dr.layers.start + w.dst_region != w.layer || !dr.layers.contains(&w.layer) {
        return Err(format!("D's region {} is not layer {} (D holds {:?})", w.dst_region, w.layer, dr.layers));
    }
    let (s, d, len) = (w.desc.src as usize, w.desc.dst as usize, w.desc.len as usize);
    let from = src.regions[w.src_region].get(s..s + len).ok_or("source outside P's region")?;
    let to = dst.regions[w.dst_region].get_mut(d..d + len).ok_or("destination outside D's region")?;
    for (cell, &value) in to.iter_mut().zip(from) {
        let (layer, head) = tag_layer_head(value);
        if layer != w.layer || !pr.holds(layer, head) {
            return Err(format!("copies layer {layer} head {head}, which this P rank does not hold"));
        }
        *cell = value;
    }
    dst.writes[w.dst_region][d..d + len].iter_mut().for_each(|n| *n += 1);
    Ok(())
}

/// Every cell of D's requested blocks holds P's value and was written once; no other cell was.
fn check_rank(
    r: &RankLayout,
    mem: &RankMem,
    heads: &HeadLayout,
    p_blocks: &[BlockId],
    d_blocks: &[BlockId],
) -> Result<(), String> {
    let (run, block_len) = (heads.head_run_len(), r.block_len(heads));
    for (region, layer) in r.layers.clone().enumerate() {
        for (i, (&cell, &writes)) in mem.regions[region].iter().zip(&mem.writes[region]).enumerate() {
            let (block, within) = ((i / block_len) as BlockId, i % block_len);
            let head = r.heads.start + within / run;
            let want =
                d_blocks.iter().position(|&b| b == block).map(|pos| tag(layer, head, p_blocks[pos], within % run));
            let ok = match want {
                Some(want) => cell == want && writes == 1,
                None => cell == 0 && writes == 0,
            };
            if !ok {
                return Err(format!(
                    "layer {layer} block {block} head {head} byte {}: {cell:#x} written {writes}×, want {want:?} once",
                    within % run
                ));
            }
        }
    }
    Ok(())
}
