//! Streamed requests of a soak: `"stream": true` through the proxy, the server-sent events read
//! to the end and reduced to the same verdict as a whole answer ([`verdict`]):
//! - `data: [DONE]` after chunks whose `token_ids` add up to the reference: served;
//! - an `error` event (a failure after the 200 went out: the only way a stream can report one),
//!   with the tokens before it a prefix of the reference: failed cleanly;
//! - a stream that ends without `[DONE]`, a cut body, tokens that differ: not clean.
//!
//! A non-200 answer is judged as a whole answer is.

use std::time::Duration;

use futures::StreamExt;
use serde_json::Value;

use crate::chaos::cell::truncate;
use crate::chaos::load::verdict::{verdict, Problem};

/// What the events of one stream said.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Events {
    pub(crate) tokens: Vec<u64>,
    pub(crate) error: Option<String>,
    pub(crate) done: bool,
}

impl Events {
    /// Reads the complete events (`data: …` lines ended by a blank line) at the start of `buf`,
    /// leaving any partial one in it.
    pub(crate) fn feed(&mut self, buf: &mut String) {
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data:") else { continue };
                let data = data.trim();
                if data == "[DONE]" {
                    self.done = true;
                    continue;
                }
                match serde_json::from_str::<Value>(data) {
                    Ok(v) if v.get("error").is_some() => {
                        self.error.get_or_insert_with(|| truncate(&v["error"].to_string()));
                    }
                    Ok(v) => self.tokens.extend(
                        v["choices"][0]["token_ids"].as_array().into_iter().flatten().filter_map(Value::as_u64),
                    ),
                    Err(_) => {
                        self.error.get_or_insert_with(|| format!("an event that is not JSON: {}", truncate(data)));
                    }
                }
            }
        }
    }

    /// The verdict on a stream that ended (`cut`: why its body broke off, if it did).
    pub(crate) fn judge(&self, cut: Option<String>, want: &[u64]) -> Result<Option<String>, Problem> {
        if let Some(e) = cut {
            return Err(Problem::NoTerminal(format!("stream cut after {} tokens: {e}", self.tokens.len())));
        }
        if !self.done {
            return Err(Problem::NoTerminal(format!("stream ended after {} tokens without [DONE]", self.tokens.len())));
        }
        if !want.starts_with(&self.tokens) {
            return Err(Problem::Incorrect(format!("streamed {:?}, the reference is {want:?}", self.tokens)));
        }
        match &self.error {
            Some(e) => Ok(Some(format!("stream error event: {e}"))),
            None if self.tokens.len() == want.len() => Ok(None),
            None => {
                Err(Problem::Incorrect(format!("streamed {:?} and [DONE], the reference is {want:?}", self.tokens)))
            }
        }
    }
}

/// POSTs a streamed `body` as client `id` and judges it against `want`; returns the id the proxy
/// answered with and the verdict.
pub(crate) async fn send(
    client: &reqwest::Client,
    url: &str,
    id: &str,
    body: &Value,
    want: &[u64],
    deadline: Duration,
) -> (Option<String>, Result<Option<String>, Problem>) {
    let resp = match client.post(url).header("x-request-id", id).json(body).timeout(deadline).send().await {
        Ok(r) => r,
        Err(e) => return (None, Err(Problem::NoTerminal(format!("POST {url}: {e}")))),
    };
    let request_id = resp.headers().get("x-request-id").and_then(|v| v.to_str().ok()).map(str::to_string);
    let status = resp.status().as_u16();
    if status != 200 {
        let answer = match resp.text().await {
            Ok(text) => Ok((status, serde_json::from_str(&text).unwrap_or(Value::String(text)))),
            Err(e) => Err(format!("body of {status} cut: {e}")),
        };
        return (request_id, verdict(&answer, want));
    }
    let (mut events, mut buf, mut cut) = (Events::default(), String::new(), None);
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        match chunk {
            Ok(bytes) => {
                buf.push_str(&String::from_utf8_lossy(&bytes));
                events.feed(&mut buf);
            }
            Err(e) => {
                cut = Some(e.to_string());
                break;
            }
        }
    }
    (request_id, events.judge(cut, want))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(text: &str) -> Events {
        let mut e = Events::default();
        let mut buf = text.to_string();
        e.feed(&mut buf);
        e
    }

    #[test]
    fn streams_are_served_failed_cleanly_or_not_clean() {
        let chunk = |t: &str| format!("data: {{\"choices\":[{{\"token_ids\":[{t}]}}]}}\n\n");
        let whole = format!("{}{}data: [DONE]\n\n", chunk("1,2"), chunk("3"));
        assert_eq!(events(&whole).judge(None, &[1, 2, 3]).ok(), Some(None));
        let errored = format!("{}data: {{\"error\":{{\"message\":\"x\"}}}}\n\ndata: [DONE]\n\n", chunk("1"));
        assert!(matches!(events(&errored).judge(None, &[1, 2, 3]), Ok(Some(_))));
        assert!(matches!(events(&chunk("1")).judge(None, &[1, 2]), Err(Problem::NoTerminal(_))));
        assert!(matches!(events(&whole).judge(Some("reset".into()), &[1, 2, 3]), Err(Problem::NoTerminal(_))));
        assert!(matches!(events(&whole).judge(None, &[1, 2, 4]), Err(Problem::Incorrect(_))));
        assert!(matches!(events(&whole).judge(None, &[1, 2, 3, 4]), Err(Problem::Incorrect(_))));
        let mut split = Events::default();
        let mut buf = "data: {\"choices\":[{\"token_ids\":[7]}]}\n".to_string();
        split.feed(&mut buf);
        assert!(split.tokens.is_empty(), "a partial event waits for its end");
        buf.push_str("\ndata: [DONE]\n\n");
        split.feed(&mut buf);
        assert_eq!((split.tokens, split.done), (vec![7], true));
    }
}
