//! P's end of one data connection (seed step 29): the socket as it is, or TLS over it (the
//! cluster secret's identity, [`pdflow_auth::tls`]). The engine writes, reads acks and pools
//! connections through [`DataStream`] the same way either way; only the fast paths that peek at
//! the socket itself (the ack poll) are kept to the plain socket.

use std::io::IoSlice;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// One of P's data connections.
pub(crate) enum DataStream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl DataStream {
    /// The plain socket, when this connection has no TLS over it.
    pub(crate) fn plain(&self) -> Option<&TcpStream> {
        match self {
            DataStream::Plain(s) => Some(s),
            DataStream::Tls(_) => None,
        }
    }
}

impl AsRawFd for DataStream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            DataStream::Plain(s) => s.as_raw_fd(),
            DataStream::Tls(s) => s.get_ref().0.as_raw_fd(),
        }
    }
}

impl AsyncRead for DataStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            DataStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            DataStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for DataStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            DataStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            DataStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            DataStream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            DataStream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            DataStream::Plain(s) => s.is_write_vectored(),
            DataStream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            DataStream::Plain(s) => Pin::new(s).poll_flush(cx),
            DataStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            DataStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            DataStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
