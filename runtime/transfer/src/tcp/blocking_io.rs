//! Blocking I/O for a data connection's thread ([`super::connection`]): the wire codec (written
//! once, over tokio's async I/O traits) run on a blocking socket, the socket's receive timeout,
//! and what counts as a timeout. Owns no seed step.

use std::future::Future;
use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::FutureExt;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::link::Link;
use super::wire::WireError;

pub(super) fn invalid(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
}

/// A read that ran into the socket's receive timeout (`SO_RCVTIMEO` reports `EAGAIN`).
pub(super) fn is_timeout_io(e: &std::io::Error) -> bool {
    matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
}

pub(super) fn is_timeout(e: &WireError) -> bool {
    matches!(e, WireError::Io(io) if is_timeout_io(io))
}

/// The socket's receive timeout, changed only when a phase asks for another one.
pub(super) struct ReadTimeout<'a> {
    stream: &'a TcpStream,
    current: Option<Duration>,
}

impl<'a> ReadTimeout<'a> {
    pub(super) fn new(stream: &'a TcpStream) -> Self {
        Self { stream, current: None }
    }

    pub(super) fn set(&mut self, timeout: Duration) -> Result<(), WireError> {
        if self.current != Some(timeout) {
            self.stream.set_read_timeout(Some(timeout))?;
            self.current = Some(timeout);
        }
        Ok(())
    }
}

/// The wire codec (written once, over tokio's async I/O traits) run on this blocking socket: every
/// poll does the blocking system call and is ready at once, so a codec future completes in one
/// poll ([`now`]).
pub(super) struct Blocking<'a, 'b>(pub(super) &'a mut Link<'b>);

impl AsyncRead for Blocking<'_, '_> {
    fn poll_read(mut self: Pin<&mut Self>, _cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        loop {
            match self.0.read(buf.initialize_unfilled()) {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for Blocking<'_, '_> {
    fn poll_write(mut self: Pin<&mut Self>, _cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Poll::Ready(self.0.write(buf))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.0.shutdown_write();
        Poll::Ready(Ok(()))
    }
}

/// Runs a codec future over [`Blocking`] I/O to completion (one poll).
pub(super) fn now<T>(fut: impl Future<Output = Result<T, WireError>>) -> Result<T, WireError> {
    fut.now_or_never().unwrap_or_else(|| {
        Err(WireError::Io(std::io::Error::other("a blocking codec call did not complete in one poll")))
    })
}
