//! vLLM's own proxies in front of `pdflow serve` (its toy proxy, its router): the P/D pair of
//! processes they front, the virtual environment they run from (the one scripts/test.sh sets
//! up), a tool's process with its log kept, and what every such test checks — through the
//! proxy, one engine's answers, streamed or not, with the KV moved from P to D for each, and both
//! engines back at their baseline afterwards.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};

use crate::processes::Proc;
use crate::{completion, post, prompt, reference, token_ids, SMALL};

/// The repository's root (the tests crate's parent).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().map(PathBuf::from).unwrap_or_default()
}

/// The virtual environment scripts/test.sh sets up: `$PDFLOW_VENV`, else `.venv`, a relative
/// path taken from the repository's root.
pub fn venv() -> PathBuf {
    let root = repo_root();
    let venv = std::env::var_os("PDFLOW_VENV").map(PathBuf::from).unwrap_or_else(|| root.join(".venv"));
    if venv.is_absolute() {
        venv
    } else {
        root.join(venv)
    }
}

/// A bootstrap, P registered with it and D: the two `pdflow serve` processes (the small shape,
/// 128 blocks each, `fail` on a failed load) that vLLM's proxies are put in front of. P names the
/// bootstrap in its answers, so that a proxy that forwards them can hand it to D; the bootstrap
/// runs at P's host, where a proxy given its port looks for it.
pub struct ServePair {
    pub bootstrap: Proc,
    pub producer: Proc,
    pub consumer: Proc,
    /// `http://host:port` of the bootstrap.
    pub bootstrap_url: String,
}

impl ServePair {
    pub async fn start() -> anyhow::Result<Self> {
        let bootstrap = Proc::spawn("bootstrap", &["bootstrap", "--port", "0"], &[]).await?;
        let bootstrap_url = format!("http://{}", bootstrap.ready["addr"].as_str().context("the bootstrap's addr")?);
        let shape = format!("{},{},{},{}", SMALL.num_layers, SMALL.num_kv_heads, SMALL.head_dim, SMALL.block_size);
        let engine = |role: &'static str| {
            let mut args = vec!["serve", "--role", role, "--kv-shape", &shape, "--num-blocks", "128"];
            args.extend(["--kv-load-failure-policy", "fail"]);
            args
        };
        let mut p_args = engine("producer");
        p_args.extend(["--bootstrap-url", &bootstrap_url]);
        let producer = Proc::spawn("producer", &p_args, &[]).await?;
        let consumer = Proc::spawn("consumer", &engine("consumer"), &[]).await?;
        Ok(Self { bootstrap, producer, consumer, bootstrap_url })
    }

    /// The bootstrap's port, as a proxy's `--prefill URL BOOTSTRAP_PORT` names it.
    pub fn bootstrap_port(&self) -> &str {
        self.bootstrap_url.rsplit(':').next().unwrap_or_default()
    }

    /// The KV transfers D has received (the count of its `pdflow_transfer_blocks` histogram).
    pub async fn transfers_into_d(&self, client: &reqwest::Client) -> u64 {
        let text = client
            .get(format!("{}/metrics", self.consumer.url()))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .expect("GET D's /metrics")
            .text()
            .await
            .expect("D's metrics");
        text.lines()
            .filter(|l| l.starts_with("pdflow_transfer_blocks_count{") && l.contains("side=\"d\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }

    /// Through the proxy at `url` (its `/v1/completions`), as [`assert_answers_as_one_engine`];
    /// D loads each request's KV from P, and P and D are back at their baseline within 10 s.
    pub async fn assert_fronted_as_one_engine(&self, client: &reqwest::Client, url: &str, what: &str) {
        let before = self.transfers_into_d(client).await;
        let requests = assert_answers_as_one_engine(client, url, what).await;
        let transfers = self.transfers_into_d(client).await - before;
        assert_eq!(transfers, requests, "{what}: D loaded {transfers} requests' KV from P, of {requests}");
        for engine in [&self.producer, &self.consumer] {
            blocks_at_baseline_within(client, engine, Duration::from_secs(10), what).await;
        }
    }

    pub async fn stop(self) {
        for p in [self.consumer, self.producer, self.bootstrap] {
            p.stop().await;
        }
    }
}

/// Waits (at most `within`) until `engine`'s `GET /pdflow/blocks` shows every block free and no
/// request held; panics naming the engine and `what` otherwise.
pub async fn blocks_at_baseline_within(client: &reqwest::Client, engine: &Proc, within: Duration, what: &str) {
    let deadline = Instant::now() + within;
    loop {
        let s: Value = client
            .get(format!("{}/pdflow/blocks", engine.url()))
            .send()
            .await
            .expect("GET /pdflow/blocks")
            .json()
            .await
            .expect("block stats are JSON");
        if s["free"] == s["total"] && s["requests"] == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {} is not back at its baseline within {within:?}: {s}",
            engine.name
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The completion chunks of a streamed answer's `data:` events.
fn streamed_chunks(body: &str) -> impl Iterator<Item = Value> + '_ {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
}

/// The text of a streamed completion.
pub fn streamed_text(body: &str) -> String {
    streamed_chunks(body).filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_owned)).collect()
}

/// The token ids of a streamed completion.
pub fn streamed_token_ids(body: &str) -> Vec<u64> {
    streamed_chunks(body).flat_map(|c| token_ids(&c)).collect()
}

/// Through the proxy at `url` (its `/v1/completions`): prompts within a block, across blocks and
/// long, then one streamed, each answered token for token as one engine alone answers it.
/// Returns how many requests it sent.
pub async fn assert_answers_as_one_engine(client: &reqwest::Client, url: &str, what: &str) -> u64 {
    let block = SMALL.block_size;
    let prompts = [(50, 8150), (block * 3 + 5, 8153), (400, 8400)];
    for (words, seed) in prompts {
        let body = completion(&prompt(words, seed), 24);
        let (status, answer) = post(client, url, &body).await.expect("the proxy answers");
        assert_eq!(status, 200, "{what}: {answer}");
        let want = reference(SMALL, &body).await.expect("reference");
        assert_eq!(token_ids(&answer), token_ids(&want), "{what}: a {words}-token prompt");
    }
    let mut body = completion(&prompt(120, 8120), 16);
    body["stream"] = true.into();
    let streamed = client.post(url).json(&body).send().await.expect("streamed").text().await.expect("body");
    body["stream"] = false.into();
    let want = reference(SMALL, &body).await.expect("reference");
    assert_eq!(streamed_token_ids(&streamed), token_ids(&want), "{what}, streamed: {streamed}");
    assert_eq!(streamed_text(&streamed), want["choices"][0]["text"].as_str().unwrap_or("-"), "{what}: {streamed}");
    prompts.len() as u64 + 1
}

/// A tool of vLLM's running beside the engines (a proxy, a router), its stdout and stderr kept as
/// lines, so that a test can wait for one and show them when the tool fails; killed on drop.
pub struct Tool {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    name: String,
}

impl Tool {
    pub fn spawn(name: &str, mut command: Command) -> anyhow::Result<Self> {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        // Both pipes are read to their end, so that the tool never blocks on a full one.
        if let Some(out) = child.stdout.take() {
            tokio::spawn(keep_lines(out, lines.clone()));
        }
        if let Some(err) = child.stderr.take() {
            tokio::spawn(keep_lines(err, lines.clone()));
        }
        Ok(Self { child, lines, name: name.to_owned() })
    }

    /// What the tool wrote so far.
    pub fn log(&self) -> String {
        self.lines.lock().map(|l| l.join("\n")).unwrap_or_default()
    }

    /// An error naming the tool, its exit and its log, if it has exited.
    fn exited(&mut self) -> anyhow::Result<()> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => bail!("{} exited ({status}):\n{}", self.name, self.log()),
            Err(e) => bail!("{}: {e}", self.name),
        }
    }

    /// Waits (at most `within`) for a line holding `marker`; returns what follows it on the line.
    pub async fn wait_for_line(&mut self, marker: &str, within: Duration) -> anyhow::Result<String> {
        let deadline = Instant::now() + within;
        loop {
            let found = self.lines.lock().ok().and_then(|lines| {
                lines.iter().find_map(|l| l.split_once(marker).map(|(_, rest)| rest.trim().to_owned()))
            });
            if let Some(rest) = found {
                return Ok(rest);
            }
            self.exited()?;
            if Instant::now() > deadline {
                bail!("{} wrote no line with {marker:?} within {within:?}:\n{}", self.name, self.log());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits (at most `within`) until `GET {url}/health` answers 200.
    pub async fn wait_healthy(&mut self, client: &reqwest::Client, url: &str, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(r) = client.get(format!("{url}/health")).send().await {
                if r.status().is_success() {
                    return Ok(());
                }
            }
            self.exited()?;
            if Instant::now() > deadline {
                bail!("{url}/health of {} not 200 within {within:?}:\n{}", self.name, self.log());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn keep_lines(pipe: impl AsyncRead + Unpin, lines: Arc<Mutex<Vec<String>>>) {
    let mut reader = BufReader::new(pipe).lines();
    while let Ok(Some(line)) = reader.next_line().await {
        if let Ok(mut kept) = lines.lock() {
            kept.push(line);
        }
    }
}
