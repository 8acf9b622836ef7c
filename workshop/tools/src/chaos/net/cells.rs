//! The network cells: each starts a fresh [`NetCluster`], cuts one link at one point of the
//! seed request's timeline (a cut is a black hole: packets dropped silently, so only pdflow's
//! deadlines end what it interrupts), restores it, and judges:
//! - the request reaches a terminal state — the reference tokens (completed, or recomputed on D)
//!   or a clean HTTP error (JSON `error` body, never a 200 with an error inside) — within a bound
//!   derived from the configured deadlines, with an outcome the cell allows;
//! - after the restore, P's and D's `/pdflow/blocks` return to baseline within the deadlines (no
//!   leaked blocks);
//! - the next request succeeds with the reference tokens.
//!
//! Seed steps under fault: 18–19 (D's bootstrap look-up), 21–22/29/30 (pull and KV write over the
//! P↔D link), 9–10 (the proxy's call to P). Regression cells for a finding these cells made: P's
//! stalled KV write resumed after the restore into blocks D had freed at its pull deadline, so a
//! request right after the restore could get a 200 with wrong tokens; D's write fence refuses such
//! a write ([`NetCell::LateWriteAfterRestore`], [`NetCell::NoKvAfterDFreed`]).

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio_util::task::AbortOnDropHandle;

use super::cluster::{deadlines, kv_state_timeout, write_timeout, NetCluster, NetSpec, UPSTREAM_LONG_S, UPSTREAM_S};
use crate::chaos::cell::{body, judge, reference_tokens, token_ids, truncate, CellResult, Outcome};

/// Slack for process scheduling on a small machine, added to every bound.
const SLACK: Duration = Duration::from_secs(4);
/// The seed request: 1000 prompt tokens move 148 MB of KV in the Qwen3-8B shape.
const PROMPT_TOKENS: usize = 1000;
const MAX_TOKENS: usize = 16;
/// Rate of the throttled P↔D link: the seed's 148 MB take ~5 s (within the pull deadline).
const THROTTLE_BYTES_PER_S: u64 = 30_000_000;
/// A mid-write cut waits until P's end has sent this much more than before the request.
const MID_WRITE_BYTES: u64 = 16 << 20;
/// Bytes that may still cross the P↔D link after D freed the blocks: socket buffers and
/// retransmissions of what was in flight at the cut stay well below this.
const LATE_BYTES_BOUND: u64 = 8 << 20;
/// Requests sent right after a restore by [`NetCell::LateWriteAfterRestore`] (cycled).
const AFTER_RESTORE: u64 = 16;

/// What a network cell run needs besides its cell.
pub struct NetEnv<'a> {
    /// The `pdflow` binary the nodes run.
    pub bin: &'a Path,
    pub client: &'a reqwest::Client,
    /// URL of a single engine in the Qwen3-8B shape (no connector): the reference tokens.
    pub reference_url: &'a str,
}

/// One network cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetCell {
    /// P↔D cut before D's request: D's bootstrap look-up (and any pull) is black-holed; policy
    /// recompute: D prefills locally and returns the reference tokens.
    CutPdBeforeRequest,
    /// P↔D cut mid-write on a throttled link, policy fail: a clean error within the pull deadline.
    CutPdMidWriteFail,
    /// The same cut, policy recompute: the reference tokens.
    CutPdMidWriteRecompute,
    /// The same cut (recompute), then requests back to back right after the restore while P's
    /// stalled write resumes, until P is back at baseline: every one returns the reference tokens.
    LateWriteAfterRestore,
    /// The same cut (fail): once D has freed the request's blocks, no more than socket-buffer
    /// leftovers of that transfer's KV cross the restored link before P's write ends.
    NoKvAfterDFreed,
    /// proxy↔P cut while P prefills (16 tokens a step): D still pulls over the intact P↔D link
    /// (completed) or the client gets a clean error within the proxy's upstream deadline.
    CutProxyPWhilePrefilling,
    /// proxy↔P cut before the request: P never sees it; a clean error within the proxy's deadline.
    CutProxyPBeforeRequest,
    /// No cut: the harness itself carries the seed request, its KV crossing the P↔D link.
    NoCut,
}

impl NetCell {
    pub const ALL: [NetCell; 8] = [
        NetCell::NoCut,
        NetCell::CutPdBeforeRequest,
        NetCell::CutPdMidWriteFail,
        NetCell::CutPdMidWriteRecompute,
        NetCell::LateWriteAfterRestore,
        NetCell::NoKvAfterDFreed,
        NetCell::CutProxyPWhilePrefilling,
        NetCell::CutProxyPBeforeRequest,
    ];

    /// The link cut (the report's `actor` column).
    pub fn actor(self) -> &'static str {
        match self {
            NetCell::CutProxyPWhilePrefilling | NetCell::CutProxyPBeforeRequest => "link:proxy-p",
            _ => "link:p-d",
        }
    }

    /// The seed step the cut interrupts.
    pub fn step(self) -> u8 {
        match self {
            NetCell::CutPdBeforeRequest => 18,
            NetCell::CutProxyPWhilePrefilling | NetCell::CutProxyPBeforeRequest => 9,
            _ => 29,
        }
    }

    pub fn fault(self) -> &'static str {
        match self {
            NetCell::CutPdBeforeRequest => "cut_before_request",
            NetCell::CutPdMidWriteFail => "cut_mid_write_fail",
            NetCell::CutPdMidWriteRecompute => "cut_mid_write_recompute",
            NetCell::LateWriteAfterRestore => "cut_mid_write_then_requests",
            NetCell::NoKvAfterDFreed => "cut_mid_write_late_bytes",
            NetCell::CutProxyPWhilePrefilling => "cut_while_prefilling",
            NetCell::CutProxyPBeforeRequest => "cut_before_request",
            NetCell::NoCut => "no_cut",
        }
    }

    /// `actor/step/fault`, as the matrix names its cells.
    pub fn name(self) -> String {
        format!("{}/{:02}/{}", self.actor(), self.step(), self.fault())
    }

    /// D's policy, P's prefill budget and the proxy's deadline of this cell's cluster.
    fn spec(self) -> NetSpec {
        let (policy, p_batch, upstream_s) = match self {
            NetCell::CutPdBeforeRequest | NetCell::CutPdMidWriteRecompute | NetCell::LateWriteAfterRestore => {
                ("recompute", 8192, UPSTREAM_LONG_S)
            }
            NetCell::CutPdMidWriteFail | NetCell::NoKvAfterDFreed | NetCell::NoCut => ("fail", 8192, UPSTREAM_LONG_S),
            NetCell::CutProxyPWhilePrefilling => ("fail", 16, UPSTREAM_S),
            NetCell::CutProxyPBeforeRequest => ("fail", 8192, UPSTREAM_S),
        };
        NetSpec { policy, p_batch, upstream_s, layerwise: false, p_forward_cpu: None }
    }

    /// The outcomes this cell accepts.
    pub fn allowed(self) -> &'static [Outcome] {
        match self {
            NetCell::CutPdBeforeRequest | NetCell::CutPdMidWriteRecompute | NetCell::LateWriteAfterRestore => {
                &[Outcome::Recomputed]
            }
            NetCell::CutPdMidWriteFail | NetCell::NoKvAfterDFreed | NetCell::CutProxyPBeforeRequest => {
                &[Outcome::FailedClean]
            }
            NetCell::CutProxyPWhilePrefilling => &[Outcome::Completed, Outcome::FailedClean],
            NetCell::NoCut => &[Outcome::Completed],
        }
    }

    /// The prompt seed of the faulted request (the next request uses `seed + 1`).
    fn seed(self) -> u64 {
        match self {
            NetCell::CutPdBeforeRequest => 11,
            NetCell::CutPdMidWriteFail => 21,
            NetCell::CutPdMidWriteRecompute => 31,
            NetCell::CutProxyPWhilePrefilling => 41,
            NetCell::NoCut => 51,
            NetCell::CutProxyPBeforeRequest => 61,
            NetCell::LateWriteAfterRestore => 71,
            NetCell::NoKvAfterDFreed => 81,
        }
    }
}

/// One cell's run: its row, the problems found so far, and what the checks need.
struct Run<'a> {
    env: &'a NetEnv<'a>,
    result: CellResult,
    problems: Vec<String>,
}

/// Runs one network cell on a fresh cluster; a cluster that cannot start is a failed cell.
pub async fn run_net_cell(cell: NetCell, env: &NetEnv<'_>) -> CellResult {
    let mut run = Run { env, result: CellResult::new(cell.actor(), cell.step(), cell.fault()), problems: Vec::new() };
    match NetCluster::start(env.bin, cell.spec()).await {
        Err(e) => run.problems.push(format!("cluster did not start: {e}")),
        Ok(c) => {
            if let Err(e) = drive(cell, &c, &mut run).await {
                run.problems.push(e);
            }
            // Dropping the topology kills its processes and deletes the namespaces (blocking).
            let _ = tokio::task::spawn_blocking(move || drop(c)).await;
        }
    }
    let Run { mut result, mut problems, .. } = run;
    if !cell.allowed().contains(&result.outcome) && result.outcome != Outcome::FailedUnclean {
        problems.push(format!("outcome {:?}, the cell allows {:?}", result.outcome, cell.allowed()));
    }
    result.passed = problems.is_empty();
    result.detail = problems.join("; ");
    result
}

async fn drive(cell: NetCell, c: &NetCluster, run: &mut Run<'_>) -> Result<(), String> {
    let seed = cell.seed();
    let faulted = body(&crate::demo::prompt_words(PROMPT_TOKENS, seed), MAX_TOKENS);
    let want = reference_tokens(run.env.client, run.env.reference_url, &faulted).await?;
    let d = deadlines();
    match cell {
        NetCell::NoCut => {
            let before = c.p_sent()?;
            run.request(c, &faulted, &want, d.pull_timeout + SLACK).await;
            let sent = c.p_sent()?.saturating_sub(before);
            run.result.hit = sent > 140_000_000;
            if !run.result.hit {
                run.problems.push(format!("the seed request's 148 MB of KV did not cross the P↔D link ({sent} bytes): the harness does not test the network"));
            }
            run.recover(c, kv_state_timeout() + SLACK, seed + 1).await
        }
        NetCell::CutPdBeforeRequest => {
            c.topo.cut(c.pd).map_err(|e| e.to_string())?;
            run.request(c, &faulted, &want, d.bootstrap_timeout + d.pull_timeout + SLACK).await;
            c.topo.restore(c.pd).map_err(|e| e.to_string())?;
            run.recover(c, kv_state_timeout() + SLACK, seed + 1).await
        }
        NetCell::CutPdMidWriteFail | NetCell::CutPdMidWriteRecompute => {
            run.cut_mid_write(c, &faulted, &want).await?;
            c.topo.unthrottle(c.pd).map_err(|e| e.to_string())?;
            c.topo.restore(c.pd).map_err(|e| e.to_string())?;
            run.recover(c, write_timeout().max(kv_state_timeout()) + SLACK, seed + 1).await
        }
        NetCell::LateWriteAfterRestore => {
            let mut references = Vec::new();
            for i in 0..AFTER_RESTORE {
                let b = body(&crate::demo::prompt_words(PROMPT_TOKENS, 700 + i), MAX_TOKENS);
                references.push(reference_tokens(run.env.client, run.env.reference_url, &b).await?);
            }
            run.cut_mid_write(c, &faulted, &want).await?;
            c.topo.unthrottle(c.pd).map_err(|e| e.to_string())?;
            c.topo.restore(c.pd).map_err(|e| e.to_string())?;
            run.requests_while_p_drains(c, &references).await;
            run.settle(c, kv_state_timeout() + SLACK).await;
            Ok(())
        }
        NetCell::NoKvAfterDFreed => {
            run.cut_mid_write(c, &faulted, &want).await?;
            // D's view, over the proxy↔D link (intact): the request is over and its blocks are free.
            if let Err(held) = c.wait_engine_baseline(&c.d_url, kv_state_timeout() + SLACK).await {
                run.problems.push(format!("D {:?} after the cut: {held}", kv_state_timeout() + SLACK));
                run.result.leaked_blocks_d = held.blocks();
            }
            let sent_when_d_freed = c.p_sent()?;
            c.topo.unthrottle(c.pd).map_err(|e| e.to_string())?;
            c.topo.restore(c.pd).map_err(|e| e.to_string())?;
            if let Err(held) = c.wait_engine_baseline(&c.p_url, write_timeout() + SLACK).await {
                run.problems.push(format!("P {:?} after the restore: {held}", write_timeout() + SLACK));
                run.result.leaked_blocks_p = held.blocks();
            }
            let late = c.p_sent()?.saturating_sub(sent_when_d_freed);
            if late >= LATE_BYTES_BOUND {
                run.problems.push(format!("{late} bytes of KV reached D's data server after D had freed the blocks they target (write-after-free)"));
            }
            run.recover(c, kv_state_timeout() + SLACK, seed + 1).await
        }
        NetCell::CutProxyPWhilePrefilling => {
            let p_finished = c.blocks(&c.p_url).await.map_or(0, |b| b.finished);
            let request = spawn_request(c, &faulted, Duration::from_secs(UPSTREAM_S) + SLACK * 2);
            // P holds the request (its blocks are allocated) and has not finished it: it is prefilling.
            let watch = Instant::now();
            loop {
                if c.blocks(&c.p_url).await.is_some_and(|b| b.requests > 0 && b.finished == p_finished) {
                    break;
                }
                if request.is_finished() || watch.elapsed() > Duration::from_secs(10) {
                    return Err("P was never seen prefilling the request: the cut would not interrupt step 9".into());
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let failures = c.failures(&c.d_url).await;
            c.topo.cut(c.proxy_p).map_err(|e| e.to_string())?;
            run.result.hit = true;
            run.terminal(c, request, Instant::now(), failures, &want, Duration::from_secs(UPSTREAM_S) + SLACK).await;
            c.topo.restore(c.proxy_p).map_err(|e| e.to_string())?;
            run.recover(c, kv_state_timeout() + SLACK, seed + 1).await
        }
        NetCell::CutProxyPBeforeRequest => {
            c.topo.cut(c.proxy_p).map_err(|e| e.to_string())?;
            run.result.hit = true;
            run.request(c, &faulted, &want, Duration::from_secs(UPSTREAM_S) + SLACK).await;
            c.topo.restore(c.proxy_p).map_err(|e| e.to_string())?;
            run.recover(c, kv_state_timeout() + SLACK, seed + 1).await
        }
    }
}

/// The faulted request in flight; dropped (a cell that gave up early), it is aborted.
type RequestTask = AbortOnDropHandle<Result<(u16, Value), String>>;

/// Sends `body` through the proxy in a task, with a client deadline of `deadline`.
fn spawn_request(c: &NetCluster, body: &Value, deadline: Duration) -> RequestTask {
    let (client, url, body) = (c.client.clone(), format!("{}/v1/completions", c.proxy_url), body.clone());
    AbortOnDropHandle::new(tokio::spawn(async move { crate::chaos::cell::post(&client, &url, &body, deadline).await }))
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

impl Run<'_> {
    /// Sends the faulted request and judges its answer (time to terminal from the send).
    async fn request(&mut self, c: &NetCluster, body: &Value, want: &[u64], bound: Duration) {
        let failures = c.failures(&c.d_url).await;
        let request = spawn_request(c, body, bound + SLACK * 2);
        self.terminal(c, request, Instant::now(), failures, want, bound).await;
    }

    /// Waits for the faulted request's answer and judges it: outcome, tokens, time to terminal
    /// (from `since`) within `bound`. A 200 after D counted a failed step (its KV load) is a
    /// recompute, and the cut was hit.
    async fn terminal(
        &mut self,
        c: &NetCluster,
        request: RequestTask,
        since: Instant,
        failures_before: Option<f64>,
        want: &[u64],
        bound: Duration,
    ) {
        let answer = request.await.unwrap_or_else(|e| Err(format!("request task failed: {e}")));
        let took = since.elapsed();
        self.result.set_terminal(took, bound);
        let d_failed = match (failures_before, c.failures(&c.d_url).await) {
            (Some(before), Some(after)) => after > before,
            _ => false,
        };
        self.result.hit |= d_failed;
        judge(
            &answer,
            want,
            || if d_failed { Outcome::Recomputed } else { Outcome::Completed },
            &mut self.result,
            &mut self.problems,
        );
        if took > bound {
            self.problems.push(format!("terminal after {:.0} ms, past the {bound:?} bound", self.result.terminal_ms));
        }
    }

    /// Throttles P↔D, sends the faulted request, cuts P↔D once the KV write is under way on the
    /// link, and judges the answer (time to terminal from the cut, within D's pull deadline).
    async fn cut_mid_write(&mut self, c: &NetCluster, body: &Value, want: &[u64]) -> Result<(), String> {
        c.topo.throttle(c.pd, THROTTLE_BYTES_PER_S).map_err(|e| e.to_string())?;
        let sent_before = c.p_sent()?;
        let failures = c.failures(&c.d_url).await;
        let bound = deadlines().pull_timeout + SLACK;
        let request = spawn_request(c, body, Duration::from_secs(20) + bound + SLACK * 2);
        let watch = Instant::now();
        loop {
            let sent = c.p_sent()?.saturating_sub(sent_before);
            if sent > MID_WRITE_BYTES {
                break;
            }
            if request.is_finished() {
                return Err(format!("the request ended before its KV write was seen on the P↔D link ({sent} bytes)"));
            }
            if watch.elapsed() > Duration::from_secs(20) {
                return Err(format!("the KV write never started on the P↔D link ({sent} bytes in 20 s)"));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        c.topo.cut(c.pd).map_err(|e| e.to_string())?;
        self.result.hit = true;
        self.terminal(c, request, Instant::now(), failures, want, bound).await;
        Ok(())
    }

    /// After the restore: P and D back at baseline within `bound` (else the blocks held are
    /// leaked), then the next request (prompt `seed`) served with the reference tokens, and the
    /// baseline again.
    async fn recover(&mut self, c: &NetCluster, bound: Duration, seed: u64) -> Result<(), String> {
        self.settle(c, bound).await;
        let next = body(&crate::demo::prompt_words(PROMPT_TOKENS, seed), MAX_TOKENS);
        let want = reference_tokens(self.env.client, self.env.reference_url, &next).await?;
        let started = Instant::now();
        match next_request(c, &next, &want).await {
            Ok(()) => {
                self.result.next_ok = true;
                self.result.recovery_ms = ms(started.elapsed());
            }
            Err(e) => self.problems.push(e),
        }
        self.settle(c, kv_state_timeout() + SLACK).await;
        Ok(())
    }

    /// Waits for P's and D's baseline; blocks still held at `bound` are leaked.
    async fn settle(&mut self, c: &NetCluster, bound: Duration) {
        if let Err((p, d)) = c.wait_baseline(bound).await {
            for (name, not_idle, leaked) in
                [("P", p, &mut self.result.leaked_blocks_p), ("D", d, &mut self.result.leaked_blocks_d)]
            {
                if let Some(n) = not_idle {
                    self.problems.push(format!("{name} {bound:?} after the restore: {n}"));
                    *leaked = (*leaked).max(n.blocks());
                }
            }
        }
    }

    /// Requests back to back, right after the restore, while P's stalled write may resume, until
    /// P is back at baseline (its write finished or known dead): each must return its reference.
    async fn requests_while_p_drains(&mut self, c: &NetCluster, references: &[Vec<u64>]) {
        let restored = Instant::now();
        let bound = write_timeout().max(kv_state_timeout()) + SLACK;
        let mut sent = 0u64;
        loop {
            let p_idle = c.blocks(&c.p_url).await.is_some_and(|b| b.at_baseline());
            let i = sent % AFTER_RESTORE;
            let b = body(&crate::demo::prompt_words(PROMPT_TOKENS, 700 + i), MAX_TOKENS);
            if let Err(e) = next_request(c, &b, &references[i as usize]).await {
                self.problems.push(format!("request {sent} after the restore: {e}"));
                return;
            }
            sent += 1;
            if sent == 1 {
                self.result.recovery_ms = ms(restored.elapsed());
            }
            if p_idle {
                break;
            }
            if restored.elapsed() > bound {
                self.problems.push(format!("P still holds blocks {bound:?} after the restore"));
                return;
            }
        }
        self.result.next_ok = true;
        self.result.fired.push(format!(
            "{sent} requests right after the restore, all with the reference tokens, until P was idle {} ms after it",
            restored.elapsed().as_millis()
        ));
    }
}

/// The first request the proxy routes after a restore (a 503 "no … is healthy" while its health
/// poller has not yet seen the engine back is a refusal, not the next request) succeeds with the
/// reference tokens `want`.
async fn next_request(c: &NetCluster, body: &Value, want: &[u64]) -> Result<(), String> {
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let (status, v) = c.request(body, deadlines().pull_timeout + SLACK * 2).await?;
        if status == 503 && v.to_string().contains("healthy") && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        if status != 200 || v.get("error").is_some() {
            return Err(format!("the next request after the restore failed: {status} {}", truncate(&v.to_string())));
        }
        if token_ids(&v) != want {
            return Err("the next request's tokens differ from the reference (a 200 with wrong tokens)".into());
        }
        return Ok(());
    }
}
