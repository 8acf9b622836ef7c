//! One pair's offsets → addresses in both ranks' registered regions, as the engines take them.

use pdflow_messages::layout::RegionDesc;

use super::error::Side;
use super::plan::PairPlan;
use crate::planner::{Descriptor, TransferPlan};

/// Why a pair's plan does not fit the regions its ranks registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    #[error("{side} rank {rank} registered {count} KV regions but the plan uses its region {region}: the rank's layer range does not match its registered layers")]
    MissingRegion { side: Side, rank: usize, region: usize, count: usize },
    #[error("{side} rank {rank}'s region {region} has {registered}-byte blocks but the plan expects {expected}: the rank's head count or KV layout differ from its topology")]
    BlockLenMismatch { side: Side, rank: usize, region: usize, registered: u64, expected: u64 },
    #[error("{side} rank {rank}: {len} bytes at offset {offset} do not fit region {region} ({region_len} bytes): a block id lies outside the cache")]
    OutOfRegion { side: Side, rank: usize, region: usize, offset: u64, len: u64, region_len: u64 },
}

impl PairPlan {
    /// The pair's writes as addresses: `p_regions` are P rank's registered regions (one per
    /// layer it holds, in order), `d_regions` D rank's. Every range is checked to lie inside its
    /// region, and every region used to have the block length the plan assumed. The caller sets
    /// the plan's `fence` and `write_by` (D's pull), as for [`crate::planner::build_plan`].
    pub fn to_transfer_plan(
        &self,
        p_regions: &[RegionDesc],
        d_regions: &[RegionDesc],
    ) -> Result<TransferPlan, AddressError> {
        let src = Rank { side: Side::P, rank: self.p_rank, regions: p_regions, block_len: self.src_block_len };
        let dst = Rank { side: Side::D, rank: self.d_rank, regions: d_regions, block_len: self.dst_block_len };
        let descriptors = self
            .writes
            .iter()
            .map(|w| {
                Ok(Descriptor {
                    src: src.address(w.src_region, w.desc.src, w.desc.len)?,
                    dst: dst.address(w.dst_region, w.desc.dst, w.desc.len)?,
                    len: w.desc.len,
                })
            })
            .collect::<Result<_, AddressError>>()?;
        Ok(TransferPlan { descriptors, fence: 0, write_by: None, grant: None })
    }
}

/// One side of a pair: its registered regions and the block length the plan assumed.
struct Rank<'a> {
    side: Side,
    rank: usize,
    regions: &'a [RegionDesc],
    block_len: u64,
}

impl Rank<'_> {
    /// The address of `offset..offset + len` in region `region`, after the checks.
    fn address(&self, region: usize, offset: u64, len: u64) -> Result<u64, AddressError> {
        let (side, rank) = (self.side, self.rank);
        let r = self.regions.get(region).ok_or(AddressError::MissingRegion {
            side,
            rank,
            region,
            count: self.regions.len(),
        })?;
        if r.block_len != self.block_len {
            return Err(AddressError::BlockLenMismatch {
                side,
                rank,
                region,
                registered: r.block_len,
                expected: self.block_len,
            });
        }
        let out = AddressError::OutOfRegion { side, rank, region, offset, len, region_len: r.len };
        match offset.checked_add(len) {
            Some(end) if end <= r.len => r.base_addr.checked_add(offset).ok_or(out),
            _ => Err(out),
        }
    }
}
