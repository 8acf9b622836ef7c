//! D's answer on its way to the client (seed step 43), chunk by chunk or whole, while P's task is
//! watched: a prefill failure meanwhile ends the body with an error.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use futures::stream::{BoxStream, StreamExt};

use super::upstream::{report_prefill_failure, wait_prefill, PrefillHandle, UpstreamError};
use super::FlowContext;
use pdflow_observability::Outcome;

/// Why D's answer could not be relayed to its end: the body is cut short (an SSE error event, an
/// aborted body, or a 502 for a whole answer).
#[derive(Debug, thiserror::Error)]
pub(super) enum RelayError {
    /// P's request failed meanwhile: D's answer is no good without P's KV.
    #[error(transparent)]
    Prefill(UpstreamError),
    /// D's body broke off.
    #[error("decode {url} broke off: {source}")]
    DecodeBrokeOff { url: String, source: reqwest::Error },
    /// D sent nothing within the upstream timeout.
    #[error("decode {url} sent nothing for {after:?}")]
    DecodeStalled { url: String, after: Duration },
}

/// D's body on its way to the client, watching P's task meanwhile (step 43).
pub(super) struct Relay {
    pub(super) d_body: BoxStream<'static, reqwest::Result<Bytes>>,
    pub(super) p_task: Option<PrefillHandle>,
    pub(super) chunk_timeout: Duration,
    pub(super) sse: bool,
    pub(super) done: bool,
    pub(super) ctx: Arc<FlowContext>,
    pub(super) prefill_index: usize,
    /// Gives the route's work back when the answer is done (dropped with the relay).
    pub(super) _route_done: super::route_done::RouteDoneGuard,
    pub(super) d_url: String,
    pub(super) span: tracing::Span,
}

impl Relay {
    pub(super) fn into_stream(self) -> BoxStream<'static, Result<Bytes, RelayError>> {
        futures::stream::unfold(self, |mut relay| async move {
            let item = relay.next_chunk().await?;
            Some((item, relay))
        })
        .boxed()
    }

    /// The whole body, while watching P's task as [`Relay::next_chunk`] does; `Err` says why it
    /// could not be read to its end.
    pub(super) async fn collect(mut self) -> Result<Bytes, RelayError> {
        let mut body = Vec::new();
        while let Some(chunk) = self.next_chunk().await {
            body.extend_from_slice(&chunk?);
        }
        Ok(Bytes::from(body))
    }

    /// The next chunk for the client; `None` ends the body.
    async fn next_chunk(&mut self) -> Option<Result<Bytes, RelayError>> {
        if self.done {
            return None;
        }
        loop {
            tokio::select! {
                p = wait_prefill(&mut self.p_task) => {
                    self.p_task = None;
                    if let Err(e) = p {
                        report_prefill_failure(&self.ctx, self.prefill_index, &e);
                        return Some(self.fail(RelayError::Prefill(e)));
                    }
                }
                chunk = tokio::time::timeout(self.chunk_timeout, self.d_body.next()) => {
                    return match chunk {
                        Ok(Some(Ok(bytes))) => Some(Ok(bytes)),
                        Ok(None) => {
                            self.done = true;
                            Outcome::Ok.record(&self.span);
                            // D is done: P's request may finish on its own, under its deadline.
                            if let Some(p) = self.p_task.take() {
                                drop(p.detach());
                            }
                            None
                        }
                        Ok(Some(Err(source))) => {
                            Some(self.fail(RelayError::DecodeBrokeOff { url: self.d_url.clone(), source }))
                        }
                        Err(_) => Some(self.fail(RelayError::DecodeStalled {
                            url: self.d_url.clone(),
                            after: self.chunk_timeout,
                        })),
                    };
                }
            }
        }
    }

    /// Ends the body after an upstream failure: an SSE error event, or an aborted body.
    fn fail(&mut self, error: RelayError) -> Result<Bytes, RelayError> {
        self.done = true;
        Outcome::ERROR.record(&self.span);
        tracing::warn!(message = %error, "response to the client cut short");
        if self.sse {
            let message = error.to_string();
            let event = serde_json::json!({"error": {"message": message, "type": "upstream_error", "code": 502}});
            Ok(Bytes::from(format!("data: {event}\n\n")))
        } else {
            Err(error)
        }
    }
}
