//! D: the prompt blocks this engine is loading from P right now, so that a second request
//! sharing them waits for them to land instead of loading them again (seed step 17, asked of
//! `get_num_new_matched_tokens`).
//!
//! vLLM's prefix cache takes a loaded block only when its request's load is done; until then a
//! request sharing the prefix misses it and pulls the same KV a second time. A burst of requests
//! on one template, or the first turns of many sessions on one system prompt, arriving while the
//! first load is in flight, would each move the whole prefix. With this record D answers such a
//! request "not yet" (vLLM's `None`: it stays waiting) while the first block it would load is in
//! flight for another request; when that load lands the blocks are cached, and the request loads
//! only what follows them. A load that fails lands nothing: its blocks leave the record and the
//! requests behind it load for themselves. A request waits at most [`MAX_WAIT`].
//!
//! A block leaves the record one `build_connector_meta` after its load settled: vLLM caches the
//! loaded blocks when it resumes their request, during the next `schedule()`, which may ask
//! about a waiting request before it gets to the resumed one.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use pdflow_messages::scheduler_connector::PromptBlockHashes;
use pdflow_messages::RequestId;

/// The longest a request waits for another request's load of its blocks, after which it loads
/// them itself (a P that hangs holds the requests behind its load up this long, no longer).
pub const MAX_WAIT: Duration = Duration::from_secs(1);

/// The blocks in flight on one engine, by the requests loading them.
#[derive(Debug, Default)]
pub struct InFlightPrefixes {
    /// Block hash → the requests loading it.
    loading: HashMap<u64, usize>,
    /// Request → the block hashes its load covers.
    by_request: BTreeMap<RequestId, Vec<u64>>,
    /// Loads that settled; their blocks leave at the next `build_connector_meta`.
    settled: Vec<RequestId>,
    /// Request → the hashes it would load (asked, not yet allocated).
    asked: BTreeMap<RequestId, Vec<u64>>,
    /// Request → when it was first told to wait.
    waiting_since: BTreeMap<RequestId, Instant>,
}

impl InFlightPrefixes {
    /// Whether `request`, whose prefix cache holds `hit` tokens of a prompt keyed by `blocks`,
    /// waits for a load in flight (true), or loads from P (false; what it would load is noted for
    /// [`InFlightPrefixes::started`]).
    pub fn waits(&mut self, request: &RequestId, hit: usize, blocks: &PromptBlockHashes, now: Instant) -> bool {
        if blocks.block_size == 0 || blocks.hashes.is_empty() {
            return false;
        }
        let first = hit / blocks.block_size;
        let rest = blocks.hashes.get(first..).unwrap_or_default();
        if rest.first().is_some_and(|h| self.loading.contains_key(h)) {
            let since = *self.waiting_since.entry(request.clone()).or_insert(now);
            if now.duration_since(since) < MAX_WAIT {
                return true;
            }
            tracing::warn!(request_id = %request, waited_ms = MAX_WAIT.as_millis() as u64,
                "a load of this request's prefix is still in flight for another request; loading it again");
        }
        self.waiting_since.remove(request);
        self.asked.insert(request.clone(), rest.to_vec());
        false
    }

    /// `request`'s load was registered (`update_state_after_alloc`): its blocks are in flight.
    pub fn started(&mut self, request: &RequestId) {
        let Some(hashes) = self.asked.remove(request) else { return };
        for h in &hashes {
            *self.loading.entry(*h).or_default() += 1;
        }
        self.by_request.insert(request.clone(), hashes);
    }

    /// `request`'s load settled (received or failed).
    pub fn settled(&mut self, request: &RequestId) {
        if self.by_request.contains_key(request) {
            self.settled.push(request.clone());
        }
    }

    /// A step's metadata was built: the loads that settled before it leave the record.
    pub fn step_built(&mut self) {
        for request in std::mem::take(&mut self.settled) {
            self.release(&request);
        }
    }

    /// `request` ended: it is forgotten, its load too (an ended request's blocks are never
    /// cached, so nobody waits for them).
    pub fn finished(&mut self, request: &RequestId) {
        self.asked.remove(request);
        self.waiting_since.remove(request);
        self.settled.retain(|r| r != request);
        self.release(request);
    }

    fn release(&mut self, request: &RequestId) {
        let Some(hashes) = self.by_request.remove(request) else { return };
        for h in hashes {
            if let Some(n) = self.loading.get_mut(&h) {
                *n -= 1;
                if *n == 0 {
                    self.loading.remove(&h);
                }
            }
        }
    }

    /// Blocks in flight.
    #[cfg(test)]
    fn blocks_in_flight(&self) -> usize {
        self.loading.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(hashes: &[u64]) -> PromptBlockHashes {
        PromptBlockHashes { block_size: 16, hashes: hashes.to_vec() }
    }

    #[test]
    fn a_request_waits_for_its_first_missing_block_then_loads_past_it() {
        let mut f = InFlightPrefixes::default();
        let now = Instant::now();
        let (a, b) = (RequestId::from("a"), RequestId::from("b"));
        assert!(!f.waits(&a, 0, &blocks(&[1, 2, 3]), now));
        f.started(&a);
        assert!(f.waits(&b, 0, &blocks(&[1, 2, 4]), now), "b's first block is in flight for a");
        f.settled(&a);
        assert!(f.waits(&b, 0, &blocks(&[1, 2, 4]), now), "a's blocks are cached only at the next schedule");
        f.step_built();
        assert_eq!(f.blocks_in_flight(), 0);
        // Now cached: b's hit covers [1, 2]; it loads block 4 only.
        assert!(!f.waits(&b, 32, &blocks(&[1, 2, 4]), now));
        f.started(&b);
        assert_eq!(f.blocks_in_flight(), 1);
    }

    #[test]
    fn a_request_past_the_shared_blocks_or_with_no_hashes_never_waits() {
        let mut f = InFlightPrefixes::default();
        let now = Instant::now();
        assert!(!f.waits(&"a".into(), 0, &blocks(&[1, 2, 3]), now));
        f.started(&"a".into());
        assert!(!f.waits(&"b".into(), 0, &blocks(&[9, 2, 3]), now), "another first block");
        assert!(!f.waits(&"c".into(), 48, &blocks(&[1, 2, 3]), now), "c holds all three already");
        assert!(!f.waits(&"d".into(), 0, &PromptBlockHashes::default(), now), "hashes unknown");
    }

    #[test]
    fn the_wait_is_bounded() {
        let mut f = InFlightPrefixes::default();
        let now = Instant::now();
        assert!(!f.waits(&"a".into(), 0, &blocks(&[1]), now));
        f.started(&"a".into());
        assert!(f.waits(&"b".into(), 0, &blocks(&[1]), now));
        assert!(f.waits(&"b".into(), 0, &blocks(&[1]), now + MAX_WAIT / 2));
        assert!(!f.waits(&"b".into(), 0, &blocks(&[1]), now + MAX_WAIT), "waited long enough: loads it too");
        f.started(&"b".into());
        f.settled(&"a".into());
        f.step_built();
        assert_eq!(f.blocks_in_flight(), 1, "b's load of block 1 is still in flight");
    }

    #[test]
    fn a_request_that_ends_while_waiting_leaves_nothing() {
        let mut f = InFlightPrefixes::default();
        let now = Instant::now();
        assert!(!f.waits(&"a".into(), 0, &blocks(&[1]), now));
        f.finished(&"a".into());
        f.started(&"a".into());
        assert_eq!(f.blocks_in_flight(), 0, "an ended request's asked blocks never count as loading");
        // A request that ends with its load in flight (aborted, or its worker gone) holds nobody up.
        assert!(!f.waits(&"c".into(), 0, &blocks(&[1]), now));
        f.started(&"c".into());
        assert!(f.waits(&"d".into(), 0, &blocks(&[1]), now));
        f.finished(&"c".into());
        assert!(!f.waits(&"d".into(), 0, &blocks(&[1]), now));
    }
}
