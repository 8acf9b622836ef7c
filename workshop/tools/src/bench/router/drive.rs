//! The router bench's clients: `concurrency` clients, each taking the next sequence of the
//! workload and sending its turns one after another (a turn once the previous one's answer is
//! in: a closed loop), every request streamed so that the time to its first token is measured at
//! the client.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};

use super::workload::Sequence;

/// What one request did.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Time to the first token, at the client (ms); `None` when the request failed.
    pub ttft_ms: Option<f64>,
    pub prompt_tokens: usize,
    /// Why it failed.
    pub error: Option<String>,
}

/// What a run sent and got.
#[derive(Debug, Default)]
pub struct RunResult {
    pub outcomes: Vec<Outcome>,
    /// The prompts, in the order they were sent.
    pub prompts: Vec<Vec<u32>>,
    pub wall: Duration,
}

/// How the clients send.
#[derive(Debug, Clone)]
pub struct DriveSpec {
    /// `http://host:port/v1/completions` of the front.
    pub url: String,
    pub model: String,
    pub concurrency: usize,
    pub output_tokens: usize,
    pub request_timeout: Duration,
}

/// Sends every sequence of `sequences` through the front; returns when all are done.
pub async fn run(client: &reqwest::Client, spec: &DriveSpec, sequences: &[Sequence]) -> RunResult {
    let queue = Arc::new(Mutex::new(sequences.iter().cloned().collect::<VecDeque<_>>()));
    let sent = Arc::new(Mutex::new(Vec::new()));
    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..spec.concurrency.max(1) {
        let (queue, sent, client, spec) = (queue.clone(), sent.clone(), client.clone(), spec.clone());
        clients.spawn(async move {
            let mut outcomes = Vec::new();
            loop {
                let next = queue.lock().unwrap_or_else(|e| e.into_inner()).pop_front();
                let Some(sequence) = next else { break };
                let mut prompt = sequence.first.clone();
                for turn in 0..sequence.turns() {
                    if turn > 0 {
                        prompt.extend_from_slice(&sequence.later_turns[turn - 1]);
                    }
                    sent.lock().unwrap_or_else(|e| e.into_inner()).push(prompt.clone());
                    let (outcome, answer) = request(&client, &spec, &prompt).await;
                    let failed = outcome.error.is_some();
                    outcomes.push(outcome);
                    if failed {
                        break;
                    }
                    prompt.extend(answer);
                }
            }
            outcomes
        });
    }
    let mut outcomes = Vec::new();
    while let Some(done) = clients.join_next().await {
        match done {
            Ok(mut o) => outcomes.append(&mut o),
            // A client that panicked: its requests are not lost from the count silently.
            Err(e) => outcomes.push(Outcome {
                ttft_ms: None,
                prompt_tokens: 0,
                error: Some(format!("a client task ended abnormally: {e}")),
            }),
        }
    }
    let wall = started.elapsed();
    let prompts = std::mem::take(&mut *sent.lock().unwrap_or_else(|e| e.into_inner()));
    RunResult { outcomes, prompts, wall }
}

/// One streamed completion: its outcome and the answer's token ids.
async fn request(client: &reqwest::Client, spec: &DriveSpec, prompt: &[u32]) -> (Outcome, Vec<u32>) {
    let body = json!({"model": spec.model, "prompt": prompt, "max_tokens": spec.output_tokens,
                      "temperature": 0, "ignore_eos": true, "stream": true});
    let started = Instant::now();
    let streamed = tokio::time::timeout(spec.request_timeout, stream(client, &spec.url, &body, started)).await;
    let failed = |error: String| Outcome { ttft_ms: None, prompt_tokens: prompt.len(), error: Some(error) };
    match streamed {
        Ok(Ok((ttft_ms, answer))) => {
            (Outcome { ttft_ms: Some(ttft_ms), prompt_tokens: prompt.len(), error: None }, answer)
        }
        Ok(Err(e)) => (failed(e), Vec::new()),
        Err(_) => (failed(format!("no whole answer within {:?}", spec.request_timeout)), Vec::new()),
    }
}

/// Sends `body`, reads the event stream to its end: the time to the first event with a token, and
/// every token id.
async fn stream(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    started: Instant,
) -> Result<(f64, Vec<u32>), String> {
    let resp = client.post(url).json(body).send().await.map_err(|e| format!("POST {url}: {e}"))?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        return Err(format!("{status}: {}", text.chars().take(200).collect::<String>()));
    }
    let mut events = resp.bytes_stream();
    let mut pending = String::new();
    let mut first = None;
    let mut answer = Vec::new();
    while let Some(chunk) = events.next().await {
        let chunk = chunk.map_err(|e| format!("reading the stream: {e}"))?;
        pending.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = pending.find('\n') {
            let line: String = pending.drain(..=end).collect();
            let Some(data) = line.trim_end().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                continue;
            }
            let Ok(event) = serde_json::from_str::<Value>(data) else { continue };
            if let Some(error) = event.get("error") {
                return Err(format!("the stream carried an error: {error}"));
            }
            let choice = &event["choices"][0];
            let ids: Vec<u32> = choice["token_ids"]
                .as_array()
                .map(|a| a.iter().filter_map(|t| t.as_u64().map(|t| t as u32)).collect())
                .unwrap_or_default();
            let has_text = choice["text"].as_str().is_some_and(|t| !t.is_empty());
            if first.is_none() && (!ids.is_empty() || has_text) {
                first = Some(started.elapsed().as_secs_f64() * 1e3);
            }
            answer.extend(ids);
        }
    }
    first.map(|t| (t, answer)).ok_or_else(|| "the stream carried no token".to_string())
}
