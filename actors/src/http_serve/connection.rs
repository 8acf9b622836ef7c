//! One HTTP connection of [`super::serve`]: hyper's HTTP/1 state machine over the socket, the
//! router called for each request, and a watch on the connection's deadlines, which hyper does
//! not keep apart (its own header timeout also runs while a kept-alive connection is idle):
//!
//! - until its first request arrives, a connection must send a complete header within the header
//!   timeout of being accepted (a silent connection is closed then);
//! - with a request in flight (from its header until the last byte of its answer is written),
//!   nothing runs out: a long streamed answer is never cut;
//! - a request's body must arrive in full within the body timeout of its header
//!   ([`super::body_deadline`]): past it, the request is answered 408 and the connection closed;
//! - between requests, a kept-alive connection is closed after the idle timeout, unless a next
//!   request has begun, whose header must then be complete within the header timeout of its first
//!   byte.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{Request, Response};
use axum::Router;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::body_deadline::{request_timeout, DeadlineBody};
use super::{note_closed, Admitted, Closed, HttpLimits};

/// What one connection's task needs.
pub(super) struct Connection {
    pub router: Router,
    pub peer: SocketAddr,
    pub service: &'static str,
    pub limits: HttpLimits,
    pub shutdown: CancellationToken,
}

impl Connection {
    /// Serves the connection until the client closes it, a deadline closes it, or the server
    /// shuts down (after the request in flight); `_admitted` holds its place under the caps.
    pub async fn run(self, stream: TcpStream, _admitted: Admitted) {
        let activity = Arc::new(Activity::new());
        let io = TokioIo::new(Watched { inner: stream, activity: activity.clone() });
        let service = Tracked {
            router: self.router,
            peer: self.peer,
            service: self.service,
            body_timeout: self.limits.body_timeout,
            activity: activity.clone(),
        };
        let mut http = hyper::server::conn::http1::Builder::new();
        // The deadlines are kept here (`Activity`); hyper's would also close idle connections.
        http.header_read_timeout(None);
        let conn = http.serve_connection(io, service);
        tokio::pin!(conn);
        let mut draining = false;
        loop {
            let due = activity.due(&self.limits);
            let changed = activity.changed.notified();
            tokio::select! {
                ended = conn.as_mut() => {
                    if let Err(e) = ended {
                        tracing::trace!(service = self.service, peer = %self.peer, error = %e, "HTTP connection ended");
                    }
                    return;
                }
                _ = self.shutdown.cancelled(), if !draining => {
                    draining = true;
                    conn.as_mut().graceful_shutdown();
                }
                _ = changed => {}
                _ = sleep_until(due.map(|(at, _)| at)) => {
                    if let Some(why) = activity.expired(&self.limits, Instant::now()) {
                        note_closed(self.service, self.peer.ip().to_canonical(), why);
                        return;
                    }
                }
            }
        }
    }
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Where a connection stands between its requests.
struct Activity {
    state: Mutex<State>,
    /// Woken when a deadline may have come nearer (a request ended, a next one began).
    changed: Notify,
}

struct State {
    /// Requests whose answer is not yet written out.
    in_flight: usize,
    /// Whether a request ever arrived on this connection.
    served: bool,
    /// When the connection was accepted or its last request ended.
    idle_since: Instant,
    /// The first byte of the next request, read while no request was in flight.
    next_since: Option<Instant>,
}

impl Activity {
    fn new() -> Self {
        let state = State { in_flight: 0, served: false, idle_since: Instant::now(), next_since: None };
        Self { state: Mutex::new(state), changed: Notify::new() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// When the connection is closed if nothing changes, and why; `None` with a request in flight.
    fn due(&self, limits: &HttpLimits) -> Option<(Instant, Closed)> {
        let s = self.lock();
        if s.in_flight > 0 {
            None
        } else if !s.served {
            Some((s.idle_since + limits.header_timeout, Closed::HeaderTimeout))
        } else if let Some(first_byte) = s.next_since {
            Some((first_byte + limits.header_timeout, Closed::HeaderTimeout))
        } else {
            Some((s.idle_since + limits.idle_timeout, Closed::IdleTimeout))
        }
    }

    /// Why the connection must close at `now`, if it must.
    fn expired(&self, limits: &HttpLimits, now: Instant) -> Option<Closed> {
        self.due(limits).filter(|(at, _)| *at <= now).map(|(_, why)| why)
    }

    /// Bytes arrived: with no request in flight on a connection that served one, the next
    /// request's header has begun.
    fn on_bytes(&self) {
        let mut s = self.lock();
        if s.served && s.in_flight == 0 && s.next_since.is_none() {
            s.next_since = Some(Instant::now());
            drop(s);
            self.changed.notify_one();
        }
    }

    /// A request's header was read: its deadlines stop until its answer is written.
    fn request_started(self: &Arc<Self>) -> InFlight {
        let mut s = self.lock();
        s.in_flight += 1;
        s.served = true;
        s.next_since = None;
        InFlight(self.clone())
    }
}

/// A request in flight; dropped when its answer's body has been written (or abandoned).
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut s = self.0.lock();
        s.in_flight = s.in_flight.saturating_sub(1);
        if s.in_flight == 0 {
            s.idle_since = Instant::now();
            s.next_since = None;
            drop(s);
            self.0.changed.notify_one();
        }
    }
}

/// The socket, noting every read into the connection's [`Activity`].
struct Watched {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.activity.on_bytes();
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// The router as hyper calls it: each request marked in flight until its answer is written, and
/// given the peer's address as axum's `ConnectInfo`.
#[derive(Clone)]
struct Tracked {
    router: Router,
    peer: SocketAddr,
    service: &'static str,
    body_timeout: std::time::Duration,
    activity: Arc<Activity>,
}

type ResponseFuture = Pin<Box<dyn Future<Output = Result<Response<Answer>, Infallible>> + Send>>;

impl hyper::service::Service<Request<Incoming>> for Tracked {
    type Response = Response<Answer>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        let in_flight = self.activity.request_started();
        let timed_out = Arc::new(AtomicBool::new(false));
        let body_timeout = self.body_timeout;
        let mut request = request.map(|body| DeadlineBody::new(body, body_timeout, timed_out.clone()));
        request.extensions_mut().insert(ConnectInfo(self.peer));
        let mut router = self.router.clone();
        let (service, peer) = (self.service, self.peer);
        Box::pin(async move {
            use tower_service::Service;
            std::future::poll_fn(|cx| Service::<Request<DeadlineBody>>::poll_ready(&mut router, cx)).await?;
            let mut response = router.call(request).await?;
            if timed_out.load(Ordering::Acquire) {
                note_closed(service, peer.ip().to_canonical(), Closed::BodyTimeout);
                response = request_timeout(body_timeout);
            }
            Ok(response.map(|body| Answer { body, _in_flight: in_flight }))
        })
    }
}

/// An answer's body, holding its request in flight until hyper has written it out and drops it.
struct Answer {
    body: Body,
    _in_flight: InFlight,
}

impl http_body::Body for Answer {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
