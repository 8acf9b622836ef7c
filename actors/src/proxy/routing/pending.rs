//! `kv_aware`'s memory of the prompts it routed that the engines' KV events cannot show yet: a
//! prefix routed to an engine a moment ago is in its prefill (or queued for it), and its blocks
//! are announced only when that step ends. Without this, every request of a burst sharing a new
//! prefix would see no engine holding it and be spread over the pool, each computing it again.
//! Each chunk is remembered for [`PENDING_FOR`] after it was routed; by then the engine's events
//! say whether it holds it.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// How long a routed chunk counts as held without the engine's events saying so.
pub const PENDING_FOR: Duration = Duration::from_secs(5);

/// The chunk hashes routed to one engine within [`PENDING_FOR`].
#[derive(Debug, Default)]
pub struct Pending {
    routed_at: HashMap<u64, Instant>,
    order: VecDeque<(Instant, u64)>,
}

impl Pending {
    /// Remembers `chunks` as routed at `now`, forgetting what is older than [`PENDING_FOR`].
    pub fn insert(&mut self, chunks: &[u64], now: Instant) {
        while let Some(&(at, chunk)) = self.order.front() {
            if now.saturating_duration_since(at) < PENDING_FOR {
                break;
            }
            self.order.pop_front();
            if self.routed_at.get(&chunk) == Some(&at) {
                self.routed_at.remove(&chunk);
            }
        }
        for &chunk in chunks {
            self.routed_at.insert(chunk, now);
            self.order.push_back((now, chunk));
        }
    }

    /// How many of `chunks`, from the first, were routed here within [`PENDING_FOR`] of `now`.
    pub fn matched(&self, chunks: &[u64], now: Instant) -> usize {
        chunks
            .iter()
            .take_while(|c| self.routed_at.get(c).is_some_and(|at| now.saturating_duration_since(*at) < PENDING_FOR))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_routed_prefix_counts_until_the_events_had_time_to_say() {
        let t0 = Instant::now();
        let mut p = Pending::default();
        p.insert(&[1, 2, 3], t0);
        assert_eq!(p.matched(&[1, 2, 9], t0 + Duration::from_secs(1)), 2);
        assert_eq!(p.matched(&[1, 2, 3], t0 + PENDING_FOR), 0, "forgotten after PENDING_FOR");
        p.insert(&[1], t0 + Duration::from_secs(4));
        p.insert(&[], t0 + PENDING_FOR + Duration::from_secs(1));
        assert_eq!(p.matched(&[1], t0 + PENDING_FOR + Duration::from_secs(1)), 1, "routed again: kept");
        assert_eq!((p.routed_at.len(), p.order.len()), (1, 1), "the rest pruned");
    }
}
