//! The routes the Proxy actor publishes for the request flows (seed steps 8–10): the healthy
//! P × dp-rank candidates and the healthy D, replaced whole whenever the actor's view changes
//! (health, engine ids, readiness), and round-robin counters the flows advance atomically. A flow
//! reads it without a message round trip to the actor (two task wake-ups less per request); when
//! the board is empty — not ready yet, no healthy P or D, an actor restarting — the flow asks the
//! actor as before, which answers why.
//!
//! The board lives in the actor's args, so every incarnation of a supervised Proxy publishes to
//! the one the HTTP server reads.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use pdflow_messages::proxy::RouteDecision;
use pdflow_messages::EngineId;

/// One P × dp-rank candidate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillCandidate {
    pub index: usize,
    pub url: String,
    pub bootstrap_addr: String,
    pub dp_rank: u32,
    pub engine_id: EngineId,
}

/// The routes of one moment of the actor's view: never empty on either side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteTable {
    pub prefill: Vec<PrefillCandidate>,
    /// (index in the decode list, URL).
    pub decode: Vec<(usize, String)>,
}

/// See the module docs.
#[derive(Debug, Default)]
pub struct RouteBoard {
    table: RwLock<Option<Arc<RouteTable>>>,
    next_prefill: AtomicUsize,
    next_decode: AtomicUsize,
}

impl RouteBoard {
    /// Replaces the routes (`None`: flows ask the actor). A table with an empty side is `None`.
    pub fn publish(&self, table: Option<RouteTable>) {
        let table = table.filter(|t| !t.prefill.is_empty() && !t.decode.is_empty()).map(Arc::new);
        *self.table.write().unwrap_or_else(PoisonError::into_inner) = table;
    }

    /// The next route, round robin over P × dp ranks and over D, if the board has routes.
    pub fn next(&self) -> Option<RouteDecision> {
        let table = self.table.read().unwrap_or_else(PoisonError::into_inner).clone()?;
        self.decide(&table)
    }

    /// The decision the actor's own round robin makes from `table` (and advances the counters).
    pub fn decide(&self, table: &RouteTable) -> Option<RouteDecision> {
        let p = table.prefill.get(self.next_prefill.fetch_add(1, Ordering::Relaxed) % table.prefill.len().max(1))?;
        let (decode_index, decode_url) = table.decode.get(self.next_decode.fetch_add(1, Ordering::Relaxed) % table.decode.len().max(1))?;
        Some(RouteDecision {
            prefill_index: p.index,
            prefill_url: p.url.clone(),
            prefill_bootstrap_addr: p.bootstrap_addr.clone(),
            prefill_dp_rank: p.dp_rank,
            prefill_engine_id: p.engine_id.clone(),
            decode_index: *decode_index,
            decode_url: decode_url.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(index: usize, dp: u32) -> PrefillCandidate {
        PrefillCandidate { index, url: format!("http://p{index}"), bootstrap_addr: format!("http://p{index}:8998"), dp_rank: dp, engine_id: format!("e{index}-{dp}") }
    }

    #[test]
    fn routes_round_robin_and_an_empty_side_means_ask_the_actor() {
        let board = RouteBoard::default();
        assert!(board.next().is_none(), "nothing published yet");
        board.publish(Some(RouteTable { prefill: vec![candidate(0, 0), candidate(1, 0)], decode: vec![(0, "http://d0".into())] }));
        let picks: Vec<(usize, usize)> = (0..4).filter_map(|_| board.next()).map(|r| (r.prefill_index, r.decode_index)).collect();
        assert_eq!(picks, vec![(0, 0), (1, 0), (0, 0), (1, 0)]);
        board.publish(Some(RouteTable { prefill: vec![candidate(0, 0)], decode: vec![] }));
        assert!(board.next().is_none(), "no healthy D: the flow asks the actor, which says why");
        board.publish(None);
        assert!(board.next().is_none());
    }
}
