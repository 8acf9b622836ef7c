//! A request's body under [`HttpLimits::body_timeout`](super::HttpLimits::body_timeout): the body
//! a handler reads fails once the deadline (counted from the request's header) passes with bytes
//! still missing, and whatever the handler then answers is replaced by a 408 that says so, with
//! `Connection: close` (the rest of the body is never read). A slow client cannot hold a handler,
//! and the connection it came on, open forever with a body it never finishes.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::{header, Response, StatusCode};
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

/// The error a body past its deadline gives its reader.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive in full within {0:?} of its header")]
pub(super) struct BodyTimedOut(Duration);

/// A request's body and its deadline.
pub(super) struct DeadlineBody {
    inner: Incoming,
    deadline: Pin<Box<tokio::time::Sleep>>,
    after: Duration,
    timed_out: Arc<AtomicBool>,
}

impl DeadlineBody {
    /// `inner`, failing `after` from now if not read to its end; `timed_out` is set then.
    pub(super) fn new(inner: Incoming, after: Duration, timed_out: Arc<AtomicBool>) -> Self {
        Self { inner, deadline: Box::pin(tokio::time::sleep(after)), after, timed_out }
    }
}

impl Body for DeadlineBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(frame.map(|f| f.map_err(Into::into))),
            Poll::Pending if this.deadline.as_mut().poll(cx).is_ready() => {
                this.timed_out.store(true, Ordering::Release);
                Poll::Ready(Some(Err(BodyTimedOut(this.after).into())))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The answer to a request whose body ran out of time: 408, `{"error": {"message", "type",
/// "code"}}` (the shape of every pdflow HTTP error), and the connection closed after it.
pub(super) fn request_timeout(after: Duration) -> Response<axum::body::Body> {
    let message =
        format!("the request body did not arrive in full within {after:?} of its header; send the whole body at once");
    let body = serde_json::json!({"error": {"message": message, "type": "request_timeout", "code": 408}});
    let mut response = Response::new(axum::body::Body::from(body.to_string()));
    *response.status_mut() = StatusCode::REQUEST_TIMEOUT;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, header::HeaderValue::from_static("application/json"));
    headers.insert(header::CONNECTION, header::HeaderValue::from_static("close"));
    response
}
