//! The verdict on each request of a load run: what the client saw, reduced at arrival to what
//! the checks need, and its outcome (`completed` / `recomputed` / `failed_clean`, or why it is
//! not clean and correct). Owns no seed step.

use std::time::Duration;

use serde_json::Value;

use super::SpanLog;
use crate::chaos::cell::{token_ids, truncate, Outcome};

/// One request's answer as the client saw it, reduced at arrival to what the checks need (a
/// run must not hold every response body: that would be the growth it measures).
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) request: usize,
    pub(crate) request_id: Option<String>,
    /// `Ok(None)`: 200 with the reference's tokens; `Ok(Some(error))`: a clean error (non-200
    /// with an error body); `Err`: why it is neither.
    pub(crate) verdict: Result<Option<String>, Problem>,
    pub(crate) terminal: Duration,
}

/// Reduces a response to its verdict against the reference tokens `want`.
pub(crate) fn verdict(result: &Result<(u16, Value), String>, want: &[u64]) -> Result<Option<String>, Problem> {
    match result {
        Ok((200, v)) if v.get("error").is_none() => {
            let tokens = token_ids(v);
            if tokens == want {
                Ok(None)
            } else {
                Err(Problem::Incorrect(format!("{tokens:?} instead of the reference {want:?}")))
            }
        }
        Ok((200, v)) => Err(Problem::ErrorInside(truncate(&v.to_string()))),
        Ok((s, v)) if v.get("error").is_some() => Ok(Some(truncate(&format!("HTTP {s}: {}", v["error"])))),
        Ok((s, v)) => Err(Problem::NoErrorBody(*s, truncate(&v.to_string()))),
        Err(e) => Err(Problem::NoTerminal(e.clone())),
    }
}

/// Why a request is not clean and correct.
#[derive(Debug, Clone)]
pub(crate) enum Problem {
    NoTerminal(String),
    ErrorInside(String),
    NoErrorBody(u16, String),
    Incorrect(String),
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Problem::NoTerminal(e) => write!(f, "no terminal state: {e}"),
            Problem::ErrorInside(v) => write!(f, "HTTP 200 with an error inside: {v}"),
            Problem::NoErrorBody(s, v) => write!(f, "HTTP {s} without an error body: {v}"),
            Problem::Incorrect(d) => write!(f, "wrong tokens: {d}"),
        }
    }
}

/// A request's outcome (as `cell.rs` classifies one) and, when it is not clean and correct, why.
pub(crate) fn classify<'a>(a: &'a Answer, log: &SpanLog) -> (Outcome, Option<&'a Problem>) {
    match &a.verdict {
        Ok(None) => (a.request_id.as_deref().map_or(Outcome::Recomputed, |id| log.outcome(id)), None),
        Ok(Some(_)) => (Outcome::FailedClean, None),
        Err(p) => (Outcome::FailedUnclean, Some(p)),
    }
}

pub(crate) fn outcome_name(o: Outcome) -> String {
    serde_json::to_value(o).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
}
