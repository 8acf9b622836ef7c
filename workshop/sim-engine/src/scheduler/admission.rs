//! The waiting queue's admission, one waiting request at a time (the scheduler's second pass):
//! D's resume once its KV has arrived (seed step 37), the worst-case block check, the local
//! prefix-cache hit, the connector's `get_num_new_matched_tokens` (asked past the hit), D's blocks
//! for a remote load (step 17: the hit's blocks, then new ones, only the new ones offered to the
//! connector), and the allocation that runs the request (step 12 on P with
//! `update_state_after_alloc`, step 38 on a resumed D).

use pdflow_messages::scheduler_connector::{
    FinishStatus, GetNumNewMatchedTokens, PromptBlockHashes, UpdateStateAfterAlloc,
};
use pdflow_messages::BlockId;
use pdflow_observability::{attrs, steps};
use tracing::Span;

use super::Scheduler;
use crate::request::{Request, Status};

/// What became of one waiting request in this `schedule()`.
pub(super) enum WaitingOutcome {
    /// Runs this step with this many new tokens.
    Scheduled(usize),
    /// Stays in the queue; the requests behind it may still be admitted.
    Skip,
    /// Stays in the queue, and no request behind it is admitted this step (FIFO).
    Blocked,
    /// No longer waiting (finished, or unknown).
    Gone,
}

impl Scheduler {
    fn worst_blocks(&self, r: &Request) -> usize {
        self.config.blocks_for(r.prompt_len + r.max_tokens)
    }

    /// Blocks that admitted, unfinished requests may still take.
    fn reserved_blocks(&self) -> usize {
        self.requests
            .values()
            .filter(|r| {
                r.admitted && matches!(r.status, Status::Waiting | Status::WaitingForRemoteKvs | Status::Running)
            })
            .map(|r| self.worst_blocks(r).saturating_sub(r.block_ids.len()))
            .sum()
    }

    /// One waiting request within `budget` tokens; `blocked`: a request ahead of it was blocked.
    pub(super) async fn schedule_waiting(&mut self, id: &str, budget: usize, blocked: bool) -> WaitingOutcome {
        let resumed = match self.resume_if_received(id) {
            Ok(resumed) => resumed,
            Err(outcome) => return outcome,
        };
        if self.admission_blocked(id, blocked) {
            return WaitingOutcome::Blocked;
        }
        let hit = self.local_hit(id);
        if let Some(outcome) = self.match_external_tokens(id, &hit).await {
            return outcome;
        }
        self.allocate_and_run(id, budget, resumed, &hit).await
    }

    /// Seed step 37 for a D waiting for remote KVs whose KV has arrived (finished_recving): waiting
    /// again, the last prompt token recomputed to get its logits. `Ok(true)` when it resumed now,
    /// `Ok(false)` when it was waiting already; `Err` when it stays as it is.
    fn resume_if_received(&mut self, id: &str) -> Result<bool, WaitingOutcome> {
        let Some(r) = self.requests.get_mut(id) else { return Err(WaitingOutcome::Gone) };
        match r.status {
            Status::WaitingForRemoteKvs => {
                if !self.finished_recving_kv_req_ids.remove(id) {
                    return Err(WaitingOutcome::Skip);
                }
                let span = req_span!(steps::D_RESUME, r, self.config.engine_id.as_str());
                r.status = Status::Waiting;
                if r.num_computed_tokens == r.num_tokens() {
                    r.num_computed_tokens = r.num_tokens() - 1;
                }
                // The loaded blocks join the prefix cache now (vLLM delays them until the load is
                // done); the block of the token recomputed below, when it is full, as that step's.
                let computed = r.num_computed_tokens;
                span.record(attrs::TOKENS, r.num_computed_tokens);
                span.record(attrs::BLOCKS, r.block_ids.len());
                r.first_token_pending = r.is_decode_role();
                drop(span);
                self.cache_blocks(id, computed);
                Ok(true)
            }
            Status::Waiting => Ok(false),
            _ => Err(WaitingOutcome::Gone),
        }
    }

    /// A request not admitted yet waits while a request ahead of it is blocked, or while the free
    /// blocks do not cover every admitted request's worst case and its own.
    fn admission_blocked(&self, id: &str, blocked: bool) -> bool {
        let Some(r) = self.requests.get(id) else { return false };
        !r.admitted && (blocked || self.pool.num_free() < self.reserved_blocks() + self.worst_blocks(r))
    }

    /// The connector's `get_num_new_matched_tokens`, asked with the tokens its local `hit` covers
    /// and the prompt's block hashes, until it answers: an asynchronous remote load parks the
    /// request (step 17); "not yet" (vLLM's `None`) leaves it waiting for a later step; `None`
    /// goes on to allocate and run it.
    async fn match_external_tokens(&mut self, id: &str, hit: &[BlockId]) -> Option<WaitingOutcome> {
        let bs = self.config.shape.block_size;
        let Some(r) = self.requests.get_mut(id) else { return Some(WaitingOutcome::Gone) };
        let conn = self.connector.clone()?;
        if r.connector_matched {
            return None;
        }
        r.connector_matched = true;
        let num_computed_tokens = r.num_computed_tokens.max(hit.len() * bs);
        // Without prefix caching a load that lands caches nothing: no hashes, no wait.
        let block_hashes = match self.pool.caching() {
            true => PromptBlockHashes { block_size: bs, hashes: r.block_hashes.iter().map(|h| h.external()).collect() },
            false => PromptBlockHashes::default(),
        };
        let asked = GetNumNewMatchedTokens { request: r.sched_request(), num_computed_tokens, block_hashes };
        match conn.scheduler.get_num_new_matched_tokens(asked).await {
            Ok(m) if m.not_yet => {
                if let Some(r) = self.requests.get_mut(id) {
                    r.connector_matched = false;
                }
                Some(WaitingOutcome::Skip)
            }
            Err(e) => {
                self.finish_request(id, FinishStatus::Error, Vec::new(), Some(format!("KV connector failed: {e}")))
                    .await;
                Some(WaitingOutcome::Gone)
            }
            Ok(m) if m.load_async && m.count > 0 => Some(self.wait_for_remote_kvs(id, m.count, hit).await),
            Ok(m) if m.count > 0 => {
                tracing::warn!(request_id = %id, count = m.count, "synchronous external KV loads are not simulated; prefilling locally");
                None
            }
            Ok(_) => None,
        }
    }

    /// Blocks for the next chunk within `budget`, the request admitted and running: step 12 on a
    /// P admitted now, step 38 on a D that resumed now; the connector told
    /// (`update_state_after_alloc`).
    async fn allocate_and_run(&mut self, id: &str, budget: usize, resumed: bool, hit: &[BlockId]) -> WaitingOutcome {
        let Some(r) = self.requests.get(id) else { return WaitingOutcome::Gone };
        let computed = r.num_computed_tokens.max(hit.len() * self.config.shape.block_size);
        let num_new = (r.num_tokens() - computed).min(budget);
        let was_admitted = r.admitted;
        if !self.allocate_behind_hit(id, hit, computed + num_new) {
            return WaitingOutcome::Blocked;
        }
        self.cache_blocks(id, computed + num_new);
        if !was_admitted {
            self.record_admission(id, 0);
        }
        let Some(r) = self.requests.get_mut(id) else { return WaitingOutcome::Gone };
        r.admitted = true;
        let engine_id = self.config.engine_id.as_str();
        let span = if r.is_prefill_role() && !was_admitted {
            req_span!(steps::P_SCHEDULE_ALLOC, r, engine_id)
        } else if resumed {
            req_span!(steps::D_SCHEDULE_FIRST, r, engine_id)
        } else {
            Span::none()
        };
        span.record(attrs::BLOCKS, r.block_ids.len());
        span.record(attrs::TOKENS, num_new);
        if let Some(conn) = self.connector.clone() {
            let msg = UpdateStateAfterAlloc {
                request: r.sched_request(),
                block_ids: r.connector_blocks(self.config.hybrid.is_some()),
                num_external_tokens: 0,
            };
            match conn.scheduler.update_state_after_alloc(msg).await {
                Ok(Some(params)) => {
                    if let Some(r) = self.requests.get_mut(id) {
                        r.kv_transfer_params = Some(params);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    drop(span);
                    self.finish_request(id, FinishStatus::Error, Vec::new(), Some(format!("KV connector failed: {e}")))
                        .await;
                    return WaitingOutcome::Gone;
                }
            }
        }
        if let Some(r) = self.requests.get_mut(id) {
            r.status = Status::Running;
        }
        WaitingOutcome::Scheduled(num_new)
    }

    /// Seed step 17: blocks for the whole prompt (a local hit's, then new ones), the pull
    /// registered for the new ones only, `WAITING_FOR_REMOTE_KVS`.
    async fn wait_for_remote_kvs(&mut self, id: &str, count: usize, hit: &[BlockId]) -> WaitingOutcome {
        let Some(r) = self.requests.get(id) else { return WaitingOutcome::Gone };
        let tokens = r.num_computed_tokens.max(hit.len() * self.config.shape.block_size) + count;
        if !self.allocate_behind_hit(id, hit, tokens) {
            if let Some(r) = self.requests.get_mut(id) {
                r.connector_matched = false;
            }
            return WaitingOutcome::Blocked;
        }
        self.record_admission(id, count);
        let Some(r) = self.requests.get_mut(id) else { return WaitingOutcome::Gone };
        r.admitted = true;
        let span = req_span!(steps::D_SCHEDULE_REMOTE, r, self.config.engine_id.as_str());
        span.record(attrs::BLOCKS, r.block_ids.len());
        span.record(attrs::TOKENS, count);
        // The blocks the load fills: past the local hit (vLLM's `get_unhashed_block_ids`), in a
        // list that ends where the prompt ends.
        let block_ids = match self.config.hybrid {
            Some(_) => r.connector_blocks(true),
            None => r.block_ids.get(r.hit_blocks..).unwrap_or_default().to_vec().into(),
        };
        let msg = UpdateStateAfterAlloc { request: r.sched_request(), block_ids, num_external_tokens: count };
        let Some(conn) = self.connector.clone() else { return WaitingOutcome::Gone };
        match conn.scheduler.update_state_after_alloc(msg).await {
            Ok(params) => {
                if let Some(r) = self.requests.get_mut(id) {
                    if let Some(p) = params {
                        r.kv_transfer_params = Some(p);
                    }
                    r.status = Status::WaitingForRemoteKvs;
                    r.held_since = Some(tokio::time::Instant::now());
                    r.num_computed_tokens = tokens;
                }
                WaitingOutcome::Skip
            }
            Err(e) => {
                drop(span);
                self.finish_request(id, FinishStatus::Error, Vec::new(), Some(format!("KV connector failed: {e}")))
                    .await;
                WaitingOutcome::Gone
            }
        }
    }
}
