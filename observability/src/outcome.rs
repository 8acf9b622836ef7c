//! Span outcomes (`pd.outcome`): one closed set that the actors and the engine record and that
//! the metrics, the demo's timeline and the render read back, so that a success is a success
//! everywhere and a failure's `cause` label is a fixed name, never free text.

use std::borrow::Cow;

/// What a step span's `pd.outcome` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The step did its work.
    Ok,
    /// P's request became ready to send (step 27).
    Ready,
    /// D's KV arrived (step 36).
    Received,
    /// D gave the request up before its pull: P was only told to free its blocks (step 34).
    FreedOnly,
    /// An engine request finished at `max_tokens` (vLLM's finish reason `length`).
    Length,
    /// An engine request finished at a stop token (`stop`).
    Stop,
    /// An HTTP answer with this status: a success when 2xx.
    Http(u16),
    /// The step failed; the cause is a fixed name: a typed failure's label (`PullErrorCause`,
    /// `LoadFailureCause`) or one of the `Outcome::*` failure constants.
    Failed(&'static str),
}

impl Outcome {
    /// A failure without a more precise cause.
    pub const FAILED: Outcome = Outcome::Failed("failed");
    /// An error answer or an error the step could not classify further.
    pub const ERROR: Outcome = Outcome::Failed("error");
    /// The step's deadline passed.
    pub const TIMEOUT: Outcome = Outcome::Failed("timeout");
    /// A request the step refused as malformed.
    pub const BAD_REQUEST: Outcome = Outcome::Failed("bad_request");
    /// A request ended by an abort.
    pub const ABORTED: Outcome = Outcome::Failed("aborted");
    /// The proxy has not yet found every P's engine id and every D healthy (step 8).
    pub const NOT_READY: Outcome = Outcome::Failed("not_ready");
    /// The proxy's actor did not answer (step 8).
    pub const PROXY_UNAVAILABLE: Outcome = Outcome::Failed("proxy_unavailable");
    /// A health probe got no 2xx answer in time (step 6).
    pub const UNHEALTHY: Outcome = Outcome::Failed("unhealthy");
    /// The bootstrap answered, but names no engine yet (step 7).
    pub const NOT_REGISTERED: Outcome = Outcome::Failed("not_registered");
    /// D's request was cancelled because P's prefill failed (step 10).
    pub const PREFILL_FAILED: Outcome = Outcome::Failed("prefill_failed");
    /// An answer arrived after its request had already ended (step 31).
    pub const LATE: Outcome = Outcome::Failed("late");

    /// The recorded value.
    pub fn label(&self) -> Cow<'static, str> {
        match self {
            Outcome::Ok => "ok".into(),
            Outcome::Ready => "ready".into(),
            Outcome::Received => "received".into(),
            Outcome::FreedOnly => "freed_only".into(),
            Outcome::Length => "length".into(),
            Outcome::Stop => "stop".into(),
            Outcome::Http(status) => status.to_string().into(),
            Outcome::Failed(cause) => (*cause).into(),
        }
    }

    /// Whether the step did what it was for.
    pub fn is_success(&self) -> bool {
        match self {
            Outcome::Ok | Outcome::Ready | Outcome::Received | Outcome::FreedOnly | Outcome::Length | Outcome::Stop => {
                true
            }
            Outcome::Http(status) => (200..300).contains(status),
            Outcome::Failed(_) => false,
        }
    }

    /// Records this outcome on `span` (a step span, which declares `pd.outcome`).
    pub fn record(&self, span: &tracing::Span) {
        span.record(crate::attrs::OUTCOME, self.label().as_ref());
    }
}

/// Whether a recorded `pd.outcome` value is a success (the inverse of [`Outcome::label`]).
pub fn is_success(recorded: &str) -> bool {
    match recorded {
        "ok" | "ready" | "received" | "freed_only" | "length" | "stop" => true,
        _ => recorded.len() == 3 && recorded.parse::<u16>().is_ok_and(|s| Outcome::Http(s).is_success()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recorded_label_reads_back_as_the_same_success_or_failure() {
        let all = [
            Outcome::Ok,
            Outcome::Ready,
            Outcome::Received,
            Outcome::FreedOnly,
            Outcome::Length,
            Outcome::Stop,
            Outcome::Http(200),
            Outcome::Http(204),
            Outcome::Http(503),
            Outcome::FAILED,
            Outcome::ERROR,
            Outcome::TIMEOUT,
            Outcome::BAD_REQUEST,
            Outcome::ABORTED,
            Outcome::NOT_READY,
            Outcome::PROXY_UNAVAILABLE,
            Outcome::UNHEALTHY,
            Outcome::NOT_REGISTERED,
            Outcome::PREFILL_FAILED,
            Outcome::LATE,
            Outcome::Failed("ready_timeout"),
        ];
        for o in all {
            assert_eq!(is_success(&o.label()), o.is_success(), "{o:?}");
        }
        assert!(!is_success("LengthCapped"), "only the recorded labels are successes");
        assert!(!is_success("2000") && !is_success("") && !is_success("20"));
    }
}
