//! Freshness for one-shot messages (a pull, a registration): the sender's clock must be within a
//! window of this side's, and a nonce is accepted once within that window. Entries older than the
//! window are forgotten as new ones arrive, so the guard holds at most one window of nonces.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::Refusal;
use crate::proof::Nonce;

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The nonces seen within the window.
#[derive(Debug)]
pub struct ReplayGuard {
    window: Duration,
    /// Most nonces held at once; past it the oldest half is dropped (a flood cannot grow memory).
    capacity: usize,
    seen: Mutex<HashMap<Nonce, u64>>,
}

impl ReplayGuard {
    /// Accepts messages stamped within `window` of this side's clock.
    pub fn new(window: Duration) -> Self {
        Self { window, capacity: 1 << 20, seen: Mutex::new(HashMap::new()) }
    }

    /// Checks that a message stamped `sent_ms` with `nonce` is fresh at `now_ms`, and records it.
    pub fn check(&self, nonce: &Nonce, sent_ms: u64, now_ms: u64) -> Result<(), Refusal> {
        let window = u64::try_from(self.window.as_millis()).unwrap_or(u64::MAX);
        if sent_ms.abs_diff(now_ms) > window {
            return Err(Refusal::Stale);
        }
        let mut seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if seen.len() >= self.capacity {
            let oldest_kept = now_ms.saturating_sub(window / 2);
            seen.retain(|_, at| *at >= oldest_kept);
        } else if seen.len().is_multiple_of(1024) {
            seen.retain(|_, at| at.abs_diff(now_ms) <= window);
        }
        if seen.insert(*nonce, sent_ms).is_some() {
            return Err(Refusal::Replayed);
        }
        Ok(())
    }
}
