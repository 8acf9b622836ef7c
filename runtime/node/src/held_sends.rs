//! P's last backstop for blocks held for D (seed step 33, delayed free): every request whose
//! blocks the engine holds for a send (`reqs_to_send` with blocks) is remembered by the worker's
//! port, outside the actors, so that when the SenderListener that owned it is gone (restarted, and
//! with it the request's SendWorker) the request is still reported sent once
//! [`Deadlines::held_backstop`] has passed — and the engine frees the blocks. Inside vLLM nothing
//! else would: its scheduler holds a delayed-free request's blocks until the connector reports it.
//!
//! A request reported by the backstop and later by the actors is reported once: the later report
//! is dropped (vLLM asserts that a finished send names a request it still holds).
//!
//! [`Deadlines::held_backstop`]: crate::config::Deadlines::held_backstop

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pdflow_messages::lifecycle::TransferState;
use pdflow_messages::RequestId;

/// The requests a worker's engine holds blocks for, and those the backstop has reported.
#[derive(Debug)]
pub struct HeldSends {
    backstop: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Request → when its blocks were handed over for the send.
    held: HashMap<RequestId, Instant>,
    /// Requests the backstop reported → when: a later report of theirs is dropped (kept for one
    /// more backstop period, after which no actor can report them any more).
    reported: HashMap<RequestId, Instant>,
}

impl HeldSends {
    pub fn new(backstop: Duration) -> Self {
        Self { backstop, state: Mutex::new(State::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Two maps of timestamps: a panicking holder leaves nothing half-done.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The engine holds `requests`' blocks for their sends from now.
    pub fn held<'a>(&self, requests: impl IntoIterator<Item = &'a RequestId>) {
        let now = Instant::now();
        let mut state = self.lock();
        for request in requests {
            state.held.entry(request.clone()).or_insert(now);
        }
    }

    /// Settles the actors' `finished_sending` against the backstop: a request already reported
    /// by the backstop is dropped, and every request held past the backstop is added (with a
    /// warning naming the state and the deadline).
    pub fn settle(&self, finished_sending: &mut BTreeSet<RequestId>) {
        let now = Instant::now();
        let mut state = self.lock();
        finished_sending.retain(|request| {
            state.held.remove(request);
            state.reported.remove(request).is_none()
        });
        let backstop = self.backstop;
        state.reported.retain(|_, at| now.duration_since(*at) < backstop);
        let expired: Vec<RequestId> = state
            .held
            .iter()
            .filter(|(_, since)| now.duration_since(**since) >= backstop)
            .map(|(r, _)| r.clone())
            .collect();
        for request in expired {
            state.held.remove(&request);
            let freed = TransferState::DelayedFree
                .passed(backstop, "P held the blocks for a send its connector never reported: freed");
            tracing::warn!(request_id = %request, "{freed}");
            state.reported.insert(request.clone(), now);
            finished_sending.insert(request);
        }
    }

    /// How many requests' blocks are held for a send.
    pub fn len(&self) -> usize {
        self.lock().held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ids: &[&str]) -> BTreeSet<RequestId> {
        ids.iter().map(|s| (*s).into()).collect()
    }

    #[test]
    fn a_send_nobody_reports_is_reported_at_the_backstop_once_and_a_late_report_is_dropped() {
        let held = HeldSends::new(Duration::from_millis(30));
        held.held(&set(&["a", "b"]));
        let mut out = set(&["a"]);
        held.settle(&mut out);
        assert_eq!(out, set(&["a"]), "the actors' report goes through; nothing expired yet");
        assert_eq!(held.len(), 1);
        std::thread::sleep(Duration::from_millis(40));
        let mut out = BTreeSet::new();
        held.settle(&mut out);
        assert_eq!(out, set(&["b"]), "b passed the backstop");
        assert!(held.is_empty());
        let mut out = set(&["b"]);
        held.settle(&mut out);
        assert!(out.is_empty(), "a report after the backstop's is dropped (the engine freed b already)");
        let mut out = BTreeSet::new();
        held.settle(&mut out);
        assert!(out.is_empty(), "reported once");
    }

    #[test]
    fn a_request_held_again_keeps_its_first_instant() {
        let held = HeldSends::new(Duration::from_millis(30));
        held.held(&set(&["a"]));
        std::thread::sleep(Duration::from_millis(20));
        held.held(&set(&["a"]));
        std::thread::sleep(Duration::from_millis(15));
        let mut out = BTreeSet::new();
        held.settle(&mut out);
        assert_eq!(out, set(&["a"]));
    }
}
