//! Why a SendWorker could not plan (seed step 28) or write (step 29) a pull. Their text is the
//! detail D's pull is answered with ([`pdflow_messages::sender_listener::PullErr`] carries it as
//! a string on the wire), so it stays what the underlying error says.

use std::time::Duration;

use pdflow_kv::planner::PlanError;
use pdflow_kv::topology::{AddressError, RankPlanError, TopologyError};
use pdflow_messages::kv_groups::BlockPairError;
use pdflow_transfer::TransferError;

/// Why step 28 could not plan a pull: the two engines' layouts or ranks do not match (D is
/// answered `LayoutMismatch`).
#[derive(Debug, thiserror::Error)]
pub enum PullPlanError {
    /// One-to-one: P's and D's regions or blocks do not match.
    #[error(transparent)]
    Layout(#[from] PlanError),
    /// Across ranks: this P worker's own ranks do not form a topology.
    #[error("P's ranks: {0}")]
    PRanks(#[source] TopologyError),
    /// Across ranks: the pulling D worker's ranks do not form a topology.
    #[error("D's ranks (tp {tp}, pp {pp}): {source}")]
    DRanks { tp: u32, pp: u32, source: TopologyError },
    /// Across ranks: the pair's blocks, layers or heads do not line up.
    #[error(transparent)]
    Pair(#[from] RankPlanError),
    /// P's blocks do not cover the positions D asks for, or the two models' KV-cache groups
    /// differ.
    #[error(transparent)]
    Blocks(#[from] BlockPairError),
    /// A hybrid model between engines of different tensor or pipeline sizes.
    #[error("a hybrid model's KV moves between engines of one shape: P runs tp {} × pp {}, D tp {} × pp {}", .p.0, .p.1, .d.0, .d.1)]
    HybridShape { p: (u32, u32), d: (u32, u32) },
    /// Across ranks: the pair's plan does not fit a side's registered regions.
    #[error(transparent)]
    Address(#[from] AddressError),
}

/// Why a write into D's memory (step 29, whole or layer by layer) failed. D's pull is answered
/// `TransferFailed`; the bytes in D's blocks are undefined and D must not use them.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// D's data server could not be reached, or the connection broke mid-write: is D up and
    /// its data address reachable from P?
    #[error("{source}")]
    PeerUnreachable { peer: String, source: TransferError },
    /// D's data server refused the write (D gave the pull up, or its fence moved on).
    #[error("{source}")]
    Refused { peer: String, source: TransferError },
    /// The write did not finish within `deadline` (D's pull deadline less a margin, or the
    /// engine's own).
    #[error("{source}")]
    Deadline { peer: String, deadline: Duration, source: TransferError },
    /// Any other failure of the transfer engine: P's own memory, an unavailable same-host path.
    #[error("{source}")]
    Engine { source: TransferError },
    /// A layer write's task ended without its result (it panicked or was aborted).
    #[error("the layer write task ended abnormally: {source}")]
    LayerTaskEnded { source: tokio::task::JoinError },
}

impl From<TransferError> for WriteError {
    fn from(source: TransferError) -> Self {
        match &source {
            TransferError::Connect { peer, .. } | TransferError::Io { peer, .. } => {
                WriteError::PeerUnreachable { peer: peer.clone(), source }
            }
            TransferError::Refused { peer, .. } => WriteError::Refused { peer: peer.clone(), source },
            TransferError::Timeout { peer, deadline } => {
                WriteError::Deadline { peer: peer.clone(), deadline: *deadline, source }
            }
            TransferError::LocalRegion(_) | TransferError::SameHostUnavailable { .. } => WriteError::Engine { source },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_error_names_what_failed_and_keeps_the_engines_text() {
        let timeout = TransferError::Timeout { peer: "d:1".into(), deadline: Duration::from_secs(2) };
        let text = timeout.to_string();
        let err = WriteError::from(timeout);
        assert!(
            matches!(&err, WriteError::Deadline { peer, deadline, .. } if peer == "d:1" && *deadline == Duration::from_secs(2))
        );
        assert_eq!(err.to_string(), text);
        assert!(std::error::Error::source(&err).is_some_and(|s| s.is::<TransferError>()));

        let refused = TransferError::Refused { peer: "d:1".into(), reason: "stale fence".into() };
        assert!(matches!(WriteError::from(refused), WriteError::Refused { .. }));
        let down = TransferError::Connect { peer: "d:1".into(), source: std::io::ErrorKind::ConnectionRefused.into() };
        assert!(matches!(WriteError::from(down), WriteError::PeerUnreachable { .. }));
    }
}
