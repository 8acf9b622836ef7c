//! Network cuts between nodes in their own network namespaces (issue #5), with separate `pdflow`
//! processes: the proxy in the root namespace, P (and the bootstrap it launches) in `p`, D in
//! `d`, and three veth links — proxy↔P, proxy↔D and a dedicated P↔D link (`pdflow::netns`).
//! Each engine binds every socket on its namespace's service address; P's side channel and
//! bootstrap, and D's data server, are reached by the other engine over the P↔D link only, and the
//! proxy (and this test) reach both engines' HTTP APIs over their own links.
//!
//! A cut is a black hole (packets dropped silently), so only pdflow's deadlines end what it
//! interrupts. Each cell asserts:
//! - the request reaches a terminal state — the reference tokens (completed, or recomputed on D)
//!   or a clean HTTP error (JSON `error` body, never a 200 with an error inside) — within a bound
//!   derived from the configured deadlines;
//! - after the link is restored, P's and D's `/pdflow/blocks` return to baseline within the
//!   deadlines (no leaked blocks);
//! - the next request succeeds with the reference tokens.
//!
//! Cells: (a) P↔D cut before D's request (bootstrap look-up black-holed → recompute); (b) P↔D
//! cut mid-transfer on a throttled link, with policy fail (clean error) and recompute (reference
//! tokens); (c) proxy↔P cut while P prefills, (c') before the request; every cell then restores
//! and checks the next request. Regression cells for a finding these cells made: (f) P's stalled
//! KV write resumed after the restore into blocks D had freed at its pull deadline, so (e) a
//! request right after the restore could get a 200 with wrong tokens. D's write fence (each
//! pull's blocks open only while D expects them; closed, and the landing batch stopped, before a
//! failed pull is reported) refuses such a write.
//!
//! Seed steps under fault: 18–19 (D's bootstrap look-up), 21–22/29/30 (pull and KV write over the
//! P↔D link), 9–10 (the proxy's call to P). Cells run one at a time (their time bounds would not
//! mean much on two shared cores) and skip, saying why, where namespaces are unavailable (not
//! root, no `ip netns`).

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use pdflow::config::Deadlines;
use pdflow::netns::{self, Link, Ns, Place, Topology};
use pdflow_runtime::memory::KvShape;
use pdflow_tests::processes::pdflow_bin;
use pdflow_tests::{completion, http_client, post, prompt, reference_tokens, token_ids};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};

/// `--abort-request-timeout` of both engines, in seconds: every other engine deadline derives
/// from it (pull = abort + 5 s; bootstrap look-up 5 s).
const ABORT_S: u64 = 3;
/// The proxy's `--upstream-timeout` where the proxy's deadline is under test, in seconds.
const UPSTREAM_S: u64 = 4;
/// The proxy's `--upstream-timeout` elsewhere: longer than D's own deadlines (bootstrap look-up
/// + pull + a local prefill), or the proxy would answer 504 before D could recompute.
const UPSTREAM_LONG_S: u64 = 30;
/// Slack for process scheduling on a small machine, added to every bound.
const SLACK: Duration = Duration::from_secs(4);
/// The seed's model shape: a 1000-token prompt moves 148 MB of KV.
const SHAPE: KvShape = KvShape::QWEN3_8B;
const PROMPT_TOKENS: usize = 1000;
const MAX_TOKENS: usize = 16;
/// Rate of the throttled P↔D link: the seed's 148 MB take ~5 s (within the pull deadline).
const THROTTLE_BYTES_PER_S: u64 = 30_000_000;

/// One cell at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// P's KV write deadline (TcpConfig's default: `pdflow serve` has no flag for it).
fn write_timeout() -> Duration {
    pdflow_runtime::transfer::tcp::TcpConfig::default().write_timeout
}

fn deadlines() -> Deadlines {
    Deadlines::from_abort_timeout(Duration::from_secs(ABORT_S))
}

/// How long an engine may hold blocks for a request it lost track of (the engine's own bound).
fn kv_state_timeout() -> Duration {
    pdflow::node::engine_node::kv_state_timeout(&deadlines())
}

/// The three nodes in their namespaces.
struct NetCluster {
    topo: Topology,
    proxy_p: Link,
    pd: Link,
    p: Ns,
    p_url: String,
    d_url: String,
    proxy_url: String,
    client: reqwest::Client,
}

/// Starts `pdflow ARGS…` in `place` and returns its ready line.
async fn spawn(topo: &Topology, place: Place, label: &str, args: &[String]) -> anyhow::Result<Value> {
    let mut cmd = topo.command(place, pdflow_bin()?);
    cmd.args(args);
    if std::env::var_os("PDFLOW_TEST_LOG").is_none() {
        cmd.stderr(Stdio::null());
    }
    let (_, stdout) = topo.exec(label, cmd)?;
    let mut lines = BufReader::new(stdout.context("no stdout")?).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .with_context(|| format!("{label}: no ready line within 30 s"))??
        .with_context(|| format!("{label}: exited before it was ready"))?;
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    serde_json::from_str(&line).with_context(|| format!("{label}: ready line is not JSON: {line}"))
}

fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

impl NetCluster {
    /// P in `p`, D (with `policy`) in `d`, the proxy in the root namespace; P's prefill budget
    /// per step is `p_batch` tokens.
    async fn start(policy: &str, p_batch: usize, upstream_s: u64) -> anyhow::Result<Self> {
        let mut topo = Topology::new()?;
        let p = topo.add_namespace("p")?;
        let d = topo.add_namespace("d")?;
        let proxy_p = topo.add_link(Place::Root, p)?;
        let _proxy_d = topo.add_link(Place::Root, d)?;
        let pd = topo.add_link(p, d)?;
        let abort = ABORT_S.to_string();
        let engine = |role: &str, host: String| {
            let mut a = strings(&["serve", "--role", role, "--host", &host, "--port", "0", "--kv-shape", "qwen3-8b", "--num-blocks", "160"]);
            a.extend(strings(&["--abort-request-timeout", &abort, "--max-model-len", "4096"]));
            a
        };
        let mut p_args = engine("producer", topo.addr(p).to_string());
        p_args.extend(strings(&["--bootstrap-port", "0", "--max-num-batched-tokens", &p_batch.to_string()]));
        let p_ready = spawn(&topo, p.into(), "producer", &p_args).await?;
        let mut d_args = engine("consumer", topo.addr(d).to_string());
        d_args.extend(strings(&["--kv-load-failure-policy", policy]));
        let d_ready = spawn(&topo, d.into(), "consumer", &d_args).await?;
        let field = |v: &Value, k: &str| v[k].as_str().map(str::to_string).with_context(|| format!("ready line has no {k}: {v}"));
        let p_url = format!("http://{}", field(&p_ready, "addr")?);
        let d_url = format!("http://{}", field(&d_ready, "addr")?);
        let bootstrap = field(&p_ready, "bootstrap_addr")?;
        let bport = bootstrap.rsplit(':').next().context("bootstrap address without a port")?.to_string();
        let proxy_args = strings(&[
            "proxy", "--host", "127.0.0.1", "--port", "0", "--prefill", &p_url, &bport, "--decode", &d_url,
            "--upstream-timeout", &upstream_s.to_string(), "--health-interval-ms", "100",
        ]);
        let proxy_ready = spawn(&topo, Place::Root, "proxy", &proxy_args).await?;
        let proxy_url = format!("http://{}", field(&proxy_ready, "addr")?);
        let client = http_client();
        pdflow_tests::wait_healthy(&client, &proxy_url, Duration::from_secs(20)).await?;
        Ok(Self { topo, proxy_p, pd, p, p_url, d_url, proxy_url, client })
    }

    /// An engine's `/pdflow/blocks`; `None` while it cannot be reached (bounded).
    async fn blocks(&self, url: &str) -> Option<Value> {
        let r = self.client.get(format!("{url}/pdflow/blocks")).timeout(Duration::from_secs(1)).send().await.ok()?;
        r.json().await.ok()
    }

    /// Waits (bounded) until P and D hold no block and no request; how long that took.
    async fn wait_baseline(&self, bound: Duration) -> Duration {
        let start = Instant::now();
        self.wait_engine_baseline("P", &self.p_url, bound).await;
        self.wait_engine_baseline("D", &self.d_url, bound.saturating_sub(start.elapsed())).await;
        start.elapsed()
    }

    /// Waits (bounded) until one engine holds no block and no request.
    async fn wait_engine_baseline(&self, name: &str, url: &str, bound: Duration) {
        let start = Instant::now();
        loop {
            let s = self.blocks(url).await;
            if let Some(s) = &s {
                if s["free"] == s["total"] && s["requests"] == 0 {
                    return;
                }
            }
            assert!(start.elapsed() < bound, "{name} did not return to its baseline within {bound:?} (leaked blocks): {s:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// POSTs a completion through the proxy: status, body and how long it took.
    async fn request(&self, body: &Value) -> (u16, Value, Duration) {
        let start = Instant::now();
        let (status, v) = post(&self.client, &format!("{}/v1/completions", self.proxy_url), body).await.expect("the proxy answers");
        (status, v, start.elapsed())
    }

    /// The first request the proxy routes after a restore (a 503 "no … is healthy" while its health
    /// poller has not yet seen the engine back is a refusal, not the next request) succeeds with
    /// the reference tokens.
    async fn next_request_succeeds(&self, seed: u64) {
        let body = completion(&prompt(PROMPT_TOKENS, seed), MAX_TOKENS);
        self.next_request_matches(seed, &reference_tokens(SHAPE, &body).await).await;
    }

    /// [`NetCluster::next_request_succeeds`] with the reference computed beforehand.
    async fn next_request_matches(&self, seed: u64, reference: &[u64]) {
        let body = completion(&prompt(PROMPT_TOKENS, seed), MAX_TOKENS);
        let until = Instant::now() + Duration::from_secs(15);
        let (status, v) = loop {
            let (status, v, _) = self.request(&body).await;
            // "no Prefill instance is healthy right now": the poller has not re-probed P yet.
            if status == 503 && v.to_string().contains("healthy") && Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            break (status, v);
        };
        assert_eq!(status, 200, "the next request after restore fails: {v}");
        assert!(v.get("error").is_none(), "200 with an error inside: {v}");
        assert_eq!(token_ids(&v), reference, "the next request's tokens differ from the reference (a 200 with wrong tokens)");
    }

    /// Sum of an engine's `pdflow_failures_total` samples (failed step spans).
    async fn failures(&self, url: &str) -> f64 {
        let Ok(r) = self.client.get(format!("{url}/metrics")).timeout(Duration::from_secs(2)).send().await else { return f64::NAN };
        let text = r.text().await.unwrap_or_default();
        text.lines().filter(|l| l.starts_with("pdflow_failures_total")).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
    }

    async fn finished(&self, url: &str) -> u64 {
        self.blocks(url).await.and_then(|s| s["finished"].as_u64()).unwrap_or(0)
    }
}

/// What a request ended with.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// 200 with the reference tokens.
    Correct,
    /// A clean HTTP error: 4xx/5xx with a JSON `error`.
    FailedClean(u16),
}

/// Classifies a terminal answer; panics on a 200 with an error or wrong tokens, or an unclean error.
fn classify(status: u16, v: &Value, reference: &[u64]) -> Outcome {
    if status == 200 {
        assert!(v.get("error").is_none(), "a 200 with an error inside: {v}");
        assert_eq!(token_ids(v), reference, "a 200 with tokens that differ from the reference: {v}");
        return Outcome::Correct;
    }
    assert!(status >= 400, "status {status} is not an error: {v}");
    assert!(v["error"].is_object() || v["error"].is_string(), "error status {status} without a JSON error body: {v}");
    Outcome::FailedClean(status)
}

/// Takes the lock and checks that namespaces can be used; `None` (printing why) to skip.
async fn cell(name: &str) -> Option<tokio::sync::MutexGuard<'static, ()>> {
    if let Err(reason) = netns::available() {
        eprintln!("skipped: {name}: {reason}");
        return None;
    }
    let guard = SERIAL.lock().await;
    Some(guard)
}

fn report(cell: &str, outcome: &Outcome, terminal: Duration, baseline: Duration) {
    eprintln!("cell {cell}: outcome {outcome:?}, terminal {} ms, blocks back at baseline {} ms after restore", terminal.as_millis(), baseline.as_millis());
}

/// (a) P↔D cut before D's request arrives: D's bootstrap look-up (and any pull) is black-holed,
/// D recomputes (policy recompute) and returns the reference tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pd_cut_before_the_pull_recomputes_on_d() {
    let Some(_serial) = cell("a_pd_cut_before_the_pull_recomputes_on_d").await else { return };
    let c = NetCluster::start("recompute", 8192, UPSTREAM_LONG_S).await.expect("cluster in namespaces");
    let body = completion(&prompt(PROMPT_TOKENS, 11), MAX_TOKENS);
    let reference = reference_tokens(SHAPE, &body).await;
    let failures_before = c.failures(&c.d_url).await;
    c.topo.cut(c.pd).expect("cut P↔D");
    let (status, v, terminal) = c.request(&body).await;
    let d = deadlines();
    let bound = d.bootstrap_timeout + d.pull_timeout + SLACK;
    assert!(terminal < bound, "terminal after {terminal:?}, bound {bound:?}");
    let outcome = classify(status, &v, &reference);
    assert_eq!(outcome, Outcome::Correct, "policy recompute returns the tokens");
    assert!(c.failures(&c.d_url).await > failures_before, "D's load did fail (the cut was hit): a recompute, not a transfer");
    c.topo.restore(c.pd).expect("restore P↔D");
    let baseline = c.wait_baseline(kv_state_timeout() + SLACK).await;
    report("a", &outcome, terminal, baseline);
    c.next_request_succeeds(12).await;
    c.wait_baseline(kv_state_timeout() + SLACK).await;
}

/// Cuts P↔D once the seed request's KV write is under way on the throttled link (P's end has
/// sent 16 MiB more than before the request); returns the request's outcome, time to terminal
/// state, and the cluster.
async fn cut_mid_transfer(policy: &str, seed: u64) -> (NetCluster, Outcome, Duration, Vec<u64>) {
    let c = NetCluster::start(policy, 8192, UPSTREAM_LONG_S).await.expect("cluster in namespaces");
    let body = completion(&prompt(PROMPT_TOKENS, seed), MAX_TOKENS);
    let reference = reference_tokens(SHAPE, &body).await;
    c.topo.throttle(c.pd, THROTTLE_BYTES_PER_S).expect("throttle P↔D");
    let sent_before = c.topo.tx_bytes(c.pd, c.p.into()).expect("P's counter");
    let request = spawn_request(&c, &body);
    let watch = Instant::now();
    loop {
        let sent = c.topo.tx_bytes(c.pd, c.p.into()).expect("P's counter") - sent_before;
        if sent > 16 << 20 {
            break;
        }
        assert!(!request.is_finished(), "the request ended before the transfer was seen on the link");
        assert!(watch.elapsed() < Duration::from_secs(20), "the KV write never started on the P↔D link ({sent} bytes)");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    c.topo.cut(c.pd).expect("cut P↔D mid-transfer");
    let cut_at = Instant::now();
    let outcome = terminal_within(request, deadlines().pull_timeout + SLACK, &reference).await;
    let terminal = cut_at.elapsed();
    (c, outcome, terminal, reference)
}

/// After a mid-transfer cut: restore, then P (its write was stalled; the write deadline ends it)
/// and D return to baseline, and the next request succeeds.
async fn restore_after_mid_transfer(c: NetCluster, cell: &str, outcome: Outcome, terminal: Duration, seed: u64) {
    c.topo.unthrottle(c.pd).expect("unthrottle");
    c.topo.restore(c.pd).expect("restore P↔D");
    let baseline = c.wait_baseline(write_timeout().max(kv_state_timeout()) + SLACK).await;
    report(cell, &outcome, terminal, baseline);
    c.next_request_succeeds(seed).await;
    c.wait_baseline(kv_state_timeout() + SLACK).await;
}

/// (b, fail) P↔D cut mid-transfer with policy fail: a clean HTTP error within the pull deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn b_pd_cut_mid_transfer_fails_cleanly_with_policy_fail() {
    let Some(_serial) = cell("b_pd_cut_mid_transfer_fails_cleanly_with_policy_fail").await else { return };
    let (c, outcome, terminal, _) = cut_mid_transfer("fail", 21).await;
    assert!(matches!(outcome, Outcome::FailedClean(_)), "policy fail: a clean error, got {outcome:?}");
    restore_after_mid_transfer(c, "b/fail", outcome, terminal, 22).await;
}

/// (b, recompute) P↔D cut mid-transfer with policy recompute: the reference tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn b_pd_cut_mid_transfer_recomputes_with_policy_recompute() {
    let Some(_serial) = cell("b_pd_cut_mid_transfer_recomputes_with_policy_recompute").await else { return };
    let (c, outcome, terminal, _) = cut_mid_transfer("recompute", 31).await;
    assert_eq!(outcome, Outcome::Correct, "policy recompute returns the tokens");
    restore_after_mid_transfer(c, "b/recompute", outcome, terminal, 32).await;
}

/// (e) After a mid-transfer cut, restore and send requests back to back while P's stalled write
/// to D resumes (TCP retransmits it a few seconds after the restore), until P is back at baseline
/// (its write finished or known dead): every one of them must return the reference tokens. A
/// request whose KV sits in blocks D freed at its pull deadline gets the old transfer's bytes
/// written over it — see (f) for the write itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn e_requests_right_after_restore_are_not_corrupted_by_the_late_write() {
    let Some(_serial) = cell("e_requests_right_after_restore_are_not_corrupted_by_the_late_write").await else { return };
    const AFTER: u64 = 16;
    let mut references = Vec::new();
    for i in 0..AFTER {
        references.push(reference_tokens(SHAPE, &completion(&prompt(PROMPT_TOKENS, 700 + i), MAX_TOKENS)).await);
    }
    let (c, outcome, terminal, _) = cut_mid_transfer("recompute", 71).await;
    assert_eq!(outcome, Outcome::Correct, "policy recompute returns the tokens");
    c.topo.unthrottle(c.pd).expect("unthrottle");
    c.topo.restore(c.pd).expect("restore P↔D");
    let restored = Instant::now();
    let bound = write_timeout().max(kv_state_timeout()) + SLACK;
    let mut sent = 0u64;
    loop {
        let p_idle = c.blocks(&c.p_url).await.is_some_and(|s| s["free"] == s["total"] && s["requests"] == 0);
        eprintln!("cell e: request {sent}, {} ms after the restore (P idle: {p_idle})", restored.elapsed().as_millis());
        let i = sent % AFTER;
        c.next_request_matches(700 + i, &references[i as usize]).await;
        sent += 1;
        if p_idle {
            break;
        }
        assert!(restored.elapsed() < bound, "P still holds blocks {bound:?} after the restore");
    }
    c.wait_baseline(kv_state_timeout() + SLACK).await;
    eprintln!("cell e: {sent} requests after the restore, all correct");
    report("e", &outcome, terminal, restored.elapsed());
}

/// (f) Block safety on D across a mid-transfer cut: once D has given the pull up (its deadline)
/// and freed the request's blocks, no more of that transfer's KV may reach D's data server — it
/// writes every in-region payload, so a byte landing now lands in free (or reused) blocks.
/// Measured on the wire: what P's end of the P↔D link sends between D's blocks being free and
/// P's write ending, after the link is restored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn f_no_kv_reaches_d_after_d_freed_the_blocks() {
    let Some(_serial) = cell("f_no_kv_reaches_d_after_d_freed_the_blocks").await else { return };
    let (c, outcome, terminal, _) = cut_mid_transfer("fail", 81).await;
    assert!(matches!(outcome, Outcome::FailedClean(_)), "policy fail: a clean error, got {outcome:?}");
    // D's view, over the proxy↔D link (intact): the request is over and its blocks are free.
    c.wait_engine_baseline("D", &c.d_url, kv_state_timeout() + SLACK).await;
    let sent_when_d_freed = c.topo.tx_bytes(c.pd, c.p.into()).expect("P's counter");
    c.topo.unthrottle(c.pd).expect("unthrottle");
    c.topo.restore(c.pd).expect("restore P↔D");
    let restored = Instant::now();
    c.wait_engine_baseline("P", &c.p_url, write_timeout() + SLACK).await;
    let late = c.topo.tx_bytes(c.pd, c.p.into()).expect("P's counter") - sent_when_d_freed;
    eprintln!("cell f: {late} bytes sent to D after D freed the blocks; P's write ended {} ms after the restore", restored.elapsed().as_millis());
    report("f", &outcome, terminal, restored.elapsed());
    // Socket buffers and retransmissions of what was in flight at the cut stay well below this.
    assert!(late < 8 << 20, "{late} bytes of KV reached D's data server after D had freed the blocks they target (write-after-free)");
}

/// (c) proxy↔P cut while P is prefilling (chunked: 16 tokens a step). The proxy sends P and D
/// at once (seed steps 9–10), and D pulls the KV from P over the intact P↔D link, so D's answer
/// can still complete the request; otherwise the client gets a clean error within the proxy's
/// upstream deadline. Either way: within that deadline, and P frees what it held once restored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn c_proxy_p_cut_while_prefilling_ends_within_the_proxy_deadline() {
    let Some(_serial) = cell("c_proxy_p_cut_while_prefilling_ends_within_the_proxy_deadline").await else { return };
    let c = NetCluster::start("fail", 16, UPSTREAM_S).await.expect("cluster in namespaces");
    let body = completion(&prompt(PROMPT_TOKENS, 41), MAX_TOKENS);
    let reference = reference_tokens(SHAPE, &body).await;
    let p_finished = c.finished(&c.p_url).await;
    let request = spawn_request(&c, &body);
    // P holds the request (its blocks are allocated) and has not finished it: it is prefilling.
    let watch = Instant::now();
    loop {
        if let Some(s) = c.blocks(&c.p_url).await {
            if s["requests"].as_u64().unwrap_or(0) > 0 && s["finished"].as_u64().unwrap_or(0) == p_finished {
                break;
            }
        }
        assert!(!request.is_finished(), "the request ended before P was seen prefilling");
        assert!(watch.elapsed() < Duration::from_secs(10), "P never started the prefill");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    c.topo.cut(c.proxy_p).expect("cut proxy↔P");
    let cut_at = Instant::now();
    let outcome = terminal_within(request, Duration::from_secs(UPSTREAM_S) + SLACK, &reference).await;
    let terminal = cut_at.elapsed();
    c.topo.restore(c.proxy_p).expect("restore proxy↔P");
    let baseline = c.wait_baseline(kv_state_timeout() + SLACK).await;
    report("c", &outcome, terminal, baseline);
    c.next_request_succeeds(42).await;
    c.wait_baseline(kv_state_timeout() + SLACK).await;
}

/// (c') proxy↔P cut before the request: P never sees it, D's pull finds no such transfer on P
/// (P's ready deadline) and, with policy fail, the client gets a clean error within the proxy's
/// upstream deadline. After restore, a late copy of the request that TCP delivers to P must not
/// strand P's blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn c2_proxy_p_cut_before_the_request_is_a_clean_error() {
    let Some(_serial) = cell("c2_proxy_p_cut_before_the_request_is_a_clean_error").await else { return };
    let c = NetCluster::start("fail", 8192, UPSTREAM_S).await.expect("cluster in namespaces");
    let body = completion(&prompt(PROMPT_TOKENS, 61), MAX_TOKENS);
    let reference = reference_tokens(SHAPE, &body).await;
    c.topo.cut(c.proxy_p).expect("cut proxy↔P");
    let cut_at = Instant::now();
    let outcome = terminal_within(spawn_request(&c, &body), Duration::from_secs(UPSTREAM_S) + SLACK, &reference).await;
    let terminal = cut_at.elapsed();
    assert!(matches!(outcome, Outcome::FailedClean(_)), "P cannot be reached: a clean error, got {outcome:?}");
    c.topo.restore(c.proxy_p).expect("restore proxy↔P");
    let baseline = c.wait_baseline(kv_state_timeout() + SLACK).await;
    report("c'", &outcome, terminal, baseline);
    c.next_request_succeeds(62).await;
    c.wait_baseline(kv_state_timeout() + SLACK).await;
}

type RequestTask = tokio::task::JoinHandle<(u16, Value)>;

/// Sends `body` through the proxy in a task.
fn spawn_request(c: &NetCluster, body: &Value) -> RequestTask {
    let (client, url, body) = (c.client.clone(), format!("{}/v1/completions", c.proxy_url), body.clone());
    tokio::spawn(async move { post(&client, &url, &body).await.expect("the proxy answers") })
}

/// Waits for the request's terminal answer within `bound`, and classifies it.
async fn terminal_within(request: RequestTask, bound: Duration, reference: &[u64]) -> Outcome {
    let start = Instant::now();
    let (status, v) = tokio::time::timeout(bound + Duration::from_secs(30), request).await.expect("the request hangs far past its bound").expect("request task");
    let took = start.elapsed();
    assert!(took < bound, "terminal after {took:?}, bound {bound:?}: {v}");
    classify(status, &v, reference)
}

/// Guards the harness itself: without any cut the topology carries a request end to end (P's KV
/// really crosses the P↔D link, not the same-host path).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn harness_without_a_cut_the_kv_crosses_the_pd_link() {
    let Some(_serial) = cell("harness_without_a_cut_the_kv_crosses_the_pd_link").await else { return };
    let c = NetCluster::start("fail", 8192, UPSTREAM_LONG_S).await.expect("cluster in namespaces");
    let before = c.topo.tx_bytes(c.pd, c.p.into()).expect("counter");
    let body = completion(&prompt(PROMPT_TOKENS, 51), MAX_TOKENS);
    let reference = reference_tokens(SHAPE, &body).await;
    let (status, v, terminal) = c.request(&body).await;
    assert_eq!(classify(status, &v, &reference), Outcome::Correct);
    let sent = c.topo.tx_bytes(c.pd, c.p.into()).expect("counter") - before;
    assert!(sent > 140_000_000, "the 148 MB of KV went over the P↔D link ({sent} bytes)");
    let baseline = c.wait_baseline(kv_state_timeout() + SLACK).await;
    report("harness (no cut)", &Outcome::Correct, terminal, baseline);
}
