//! The Receiver's KV check (seed step 34, with `verify_checksums`): D's blocks of a request
//! against P's digests of what it wrote; a block that differs fails the load.

use pdflow_messages::scheduler_connector::{LoadFailure, LoadFailureCause};
use pdflow_messages::{BlockId, RequestId};

use super::Receiver;
use crate::ranks::{pair_share_digests, DigestError, PairEnd, WorkerRank};

impl Receiver {
    /// With `verify_checksums`, D's blocks of `req` against P's digests of what it wrote: the
    /// failure of the load when a block differs (or D cannot read its blocks); `None` when they
    /// match or nothing is to be checked. The bytes landed before P answered (its write was acked).
    /// From a P rank of a sharded engine (`p_rank`), the digests cover the pair's share of each
    /// block ([`pdflow_kv::topology::share_digests`]).
    pub(super) fn check_digests(
        &self,
        req: &RequestId,
        p_digests: &[u64],
        p_rank: Option<WorkerRank>,
    ) -> Option<LoadFailure> {
        if !self.args.verify_checksums {
            return None;
        }
        let recv = self.in_flight.get(req)?;
        let blocks = recv.meta.local_block_ids.flat();
        let mismatch = |detail: String| {
            tracing::warn!(request_id = %req, "{detail}");
            Some(LoadFailure::new(LoadFailureCause::KvMismatch, detail))
        };
        if p_digests.len() != blocks.len() {
            return mismatch(format!(
                "P sent digests of {} blocks for {} of D's: the KV is not used",
                p_digests.len(),
                blocks.len()
            ));
        }
        let d_digests = match self.d_digests(&blocks, p_rank) {
            Ok(d) => d,
            Err(e) => return mismatch(format!("D cannot read its blocks to check them ({e}): the KV is not used")),
        };
        let differ: Vec<BlockId> =
            blocks.iter().zip(p_digests.iter().zip(&d_digests)).filter(|(_, (p, d))| p != d).map(|(b, _)| *b).collect();
        if differ.is_empty() {
            return None;
        }
        mismatch(format!(
            "{} of {} blocks differ from what P wrote (D's blocks {:?}): the KV is not used",
            differ.len(),
            blocks.len(),
            &differ[..differ.len().min(8)]
        ))
    }

    /// D's digests of `blocks`: whole blocks, or the share P rank `p_rank` wrote into them.
    fn d_digests(&self, blocks: &[BlockId], p_rank: Option<WorkerRank>) -> Result<Vec<u64>, DigestError> {
        let Some(p) = p_rank else { return Ok(self.args.kv_cache.block_digests(blocks)?) };
        pair_share_digests(&self.args.kv_cache, (&p, &self.args.rank), PairEnd::D, blocks)
    }
}
