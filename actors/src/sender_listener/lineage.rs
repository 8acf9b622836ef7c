//! What the incarnations of one engine's SenderListener share across supervised restarts (seed
//! steps 22 and 27): the generations they registered, and which of them recorded each transfer as
//! ready. It decides whether a pull addressed to an earlier incarnation, for a transfer the current
//! one does not know, can still be served:
//!
//! - the transfer's ready (step 27) went to an earlier incarnation: that incarnation's record and
//!   send worker are gone, the engine will not repeat it — refused at once (`StaleGeneration`);
//! - it did not: the engine still holds the request and its ready is still to come (the pull just
//!   raced ahead of P's scheduler) — the pull waits for it, as any early pull does;
//! - the generation is none of this engine's (the whole node restarted): refused at once.
//!
//! Entries are dropped when a transfer is retired, and after a time to live (the longest a ready
//! can wait for its pull), so the map stays bounded.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use pdflow_messages::TransferId;

/// Shared by every incarnation of one listener (its args hold an `Arc` of it).
#[derive(Debug, Default)]
pub struct ListenerLineage {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    generations: Vec<u64>,
    /// transfer → (generation that recorded its ready, when).
    ready: HashMap<TransferId, (u64, Instant)>,
}

/// What an unknown transfer in a pull addressed to another generation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unknown {
    /// Its ready went to incarnation `generation`, now gone.
    Lost { generation: u64 },
    /// Addressed to an earlier incarnation of this listener, and not ready yet: wait for it.
    NotReadyYet,
    /// Addressed to a generation this engine never had.
    ForeignGeneration,
}

/// The most generations remembered (one per restart; restarts are rate-limited anyway).
const MAX_GENERATIONS: usize = 64;

impl ListenerLineage {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Plain bookkeeping: a panicking holder cannot leave it half-updated in a harmful way.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An incarnation started with `generation`.
    pub fn started(&self, generation: u64) {
        let mut st = self.lock();
        st.generations.push(generation);
        let excess = st.generations.len().saturating_sub(MAX_GENERATIONS);
        st.generations.drain(..excess);
    }

    /// Incarnation `generation` recorded `transfer` as ready (step 27).
    pub fn ready(&self, transfer: &TransferId, generation: u64, ttl: Duration) {
        let mut st = self.lock();
        let now = Instant::now();
        st.ready.retain(|_, (_, at)| now.saturating_duration_since(*at) < ttl);
        st.ready.insert(transfer.clone(), (generation, now));
    }

    /// `transfer` was sent or expired: nothing more to know about it.
    pub fn retired(&self, transfer: &TransferId) {
        self.lock().ready.remove(transfer);
    }

    /// Classifies `transfer`, unknown to incarnation `current`, in a pull addressed to `addressed`.
    pub fn unknown(&self, transfer: &TransferId, addressed: u64, current: u64) -> Unknown {
        let st = self.lock();
        if !st.generations.contains(&addressed) {
            return Unknown::ForeignGeneration;
        }
        match st.ready.get(transfer) {
            Some(&(generation, _)) if generation != current => Unknown::Lost { generation },
            _ => Unknown::NotReadyYet,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_transfer_is_lost_waiting_or_foreign() {
        let lineage = ListenerLineage::default();
        let (old, new) = (10, 20);
        lineage.started(old);
        lineage.started(new);
        let ttl = Duration::from_secs(60);
        lineage.ready(&"xfer-lost".into(), old, ttl);
        assert_eq!(lineage.unknown(&"xfer-lost".into(), old, new), Unknown::Lost { generation: old });
        assert_eq!(lineage.unknown(&"xfer-new".into(), old, new), Unknown::NotReadyYet);
        assert_eq!(lineage.unknown(&"xfer-new".into(), 5, new), Unknown::ForeignGeneration);
        lineage.retired(&"xfer-lost".into());
        assert_eq!(lineage.unknown(&"xfer-lost".into(), old, new), Unknown::NotReadyYet, "retired: forgotten");
        // Entries older than their time to live are dropped at the next record.
        lineage.ready(&"xfer-a".into(), old, ttl);
        lineage.ready(&"xfer-b".into(), old, Duration::ZERO);
        assert_eq!(lineage.unknown(&"xfer-a".into(), old, new), Unknown::NotReadyYet, "dropped after its ttl");
        for g in 0..(MAX_GENERATIONS as u64 + 5) {
            lineage.started(100 + g);
        }
        assert_eq!(
            lineage.unknown(&"x".into(), old, new),
            Unknown::ForeignGeneration,
            "only the latest generations are kept"
        );
    }
}
