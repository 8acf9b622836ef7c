//! Across ranks (seed steps 22 and 28 when P or D is tensor or pipeline parallel): which D ranks
//! pull from this P worker, and what of its KV each gets.
//!
//! One P worker serves one pull per D rank that reads from it (`pdflow_kv::topology::pull_pairs`,
//! computed alike on both ends): each pull gets the pair's plan — the heads and layers that D rank
//! holds and this worker sends — or nothing, for an empty pull (a replica no D rank reads). The
//! transfer ends, and P's blocks are freed, once every such D rank was served; one that never
//! pulls leaves the blocks to the send expiry, as a single pull does.

use pdflow_kv::planner::TransferPlan;
use pdflow_kv::topology::{plan_pair, pullers_of};
use pdflow_messages::send_worker::{DRank, ServePull};
use pdflow_messages::BlockId;

use super::{PullPlanError, SendWorker};
use crate::ranks::{pair_share_digests, PairEnd};

impl SendWorker {
    /// Whether this pull is between sharded engines (else the one-to-one plan of step 28 serves).
    pub(super) fn ranked(&self, pull: &ServePull) -> bool {
        !self.args.rank.is_single() || pull.d_rank != DRank::default()
    }

    /// The pulling D worker's index among D's ranks.
    pub(super) fn d_index(&self, pull: &ServePull) -> usize {
        self.args.rank.of_puller(pull.d_rank).index()
    }

    /// How many D ranks pull from this worker for one request, learned from the first pull.
    pub(super) fn learn_pullers(&mut self, pull: &ServePull) {
        if self.pullers.is_some() || !self.ranked(pull) {
            return;
        }
        let d = self.args.rank.of_puller(pull.d_rank);
        let count = match (self.args.rank.topology(), d.topology()) {
            (Ok(p), Ok(d)) => pullers_of(&p, &d, self.args.rank.index()).len(),
            // Unplannable pulls fail in step 28; one answer then ends the transfer.
            _ => 1,
        };
        self.pullers = Some(count.max(1));
    }

    /// Whether D ranks that read from this worker have not been served yet.
    pub(super) fn pullers_left(&self) -> bool {
        self.pullers.is_some_and(|n| self.served.len() < n) && !self.producer_aborted
    }

    /// Step 28 across ranks: what this worker writes into the pulling D rank's blocks
    /// (`src_blocks`: P's blocks aligned with D's). An empty plan: this pull moves nothing.
    pub(super) fn rank_plan(
        &self,
        pull: &ServePull,
        src_blocks: &[BlockId],
        dst_blocks: &[BlockId],
    ) -> Result<TransferPlan, PullPlanError> {
        let me = self.args.rank;
        let d = me.of_puller(pull.d_rank);
        let p_topology = me.topology().map_err(PullPlanError::PRanks)?;
        let d_topology =
            d.topology().map_err(|source| PullPlanError::DRanks { tp: d.tp_size, pp: d.pp_size, source })?;
        let pair = plan_pair(&p_topology, &d_topology, &me.heads(), (me.index(), d.index()), src_blocks, dst_blocks)?;
        let Some(pair) = pair else { return Ok(TransferPlan::default()) };
        let plan = pair.to_transfer_plan(&self.args.kv_cache.regions(), &pull.layout.regions)?;
        Ok(TransferPlan { fence: pull.fence, grant: pull.rdma.clone().map(std::sync::Arc::new), ..plan })
    }

    /// With `verify_checksums`, P's digest of the pair's share of each block it is about to
    /// write ([`pdflow_kv::topology::share_digests`]; `src_blocks`: P's blocks paired with D's);
    /// D digests the same runs of its blocks once they landed. Empty when off, when the pair
    /// moves nothing, or when P cannot read them (D then checks nothing).
    pub(super) fn rank_digests(&self, pull: &ServePull, src_blocks: &[BlockId]) -> Vec<u64> {
        if !self.args.verify_checksums {
            return Vec::new();
        }
        let me = self.args.rank;
        let d = me.of_puller(pull.d_rank);
        let digests = pair_share_digests(&self.args.kv_cache, (&me, &d), PairEnd::P, src_blocks);
        digests.unwrap_or_else(|e| {
            tracing::warn!(transfer_id = %self.args.transfer_id, error = %e, "cannot digest P's share: D will not check it");
            Vec::new()
        })
    }
}
