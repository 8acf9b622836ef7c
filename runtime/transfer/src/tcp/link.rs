//! D's end of one data connection (the receiving half of seed step 29): the socket as it is, or
//! TLS over it. [`connection`](super::connection) speaks its protocol through a [`Link`]; with
//! TLS the payload is decrypted by rustls and copied into D's memory, without it the plain path
//! keeps its vectored reads straight into D's blocks.
//!
//! Blocking I/O on the connection's own thread; every read runs under the socket's receive
//! timeout, which the connection sets per phase.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;

use rustls::{ServerConfig, ServerConnection};

/// Why the TLS handshake failed.
#[derive(Debug, thiserror::Error)]
pub(super) enum HandshakeError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Tls(#[from] rustls::Error),
}

/// One data connection as D reads and writes it.
pub(super) struct Link<'a> {
    pub(super) tcp: &'a TcpStream,
    tls: Option<Box<ServerConnection>>,
}

impl<'a> Link<'a> {
    /// The socket as it is.
    pub(super) fn plain(tcp: &'a TcpStream) -> Self {
        Self { tcp, tls: None }
    }

    /// TLS over `tcp`: the handshake (P's certificate checked by `config`'s verifier), under the
    /// socket's current receive timeout.
    pub(super) fn accept_tls(tcp: &'a TcpStream, config: Arc<ServerConfig>) -> Result<Self, HandshakeError> {
        let mut conn = Box::new(ServerConnection::new(config)?);
        let mut sock = tcp;
        while conn.is_handshaking() {
            if conn.wants_write() {
                conn.write_tls(&mut sock)?;
                continue;
            }
            if conn.read_tls(&mut sock)? == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
            if let Err(e) = conn.process_new_packets() {
                // Tell P why (the alert), best effort.
                let _ = conn.write_tls(&mut sock);
                return Err(e.into());
            }
        }
        let mut link = Self { tcp, tls: Some(conn) };
        link.flush_tls()?;
        Ok(link)
    }

    pub(super) fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Ends the writing half: TLS's close_notify first, then the socket's.
    pub(super) fn shutdown_write(&mut self) {
        if let Some(conn) = &mut self.tls {
            conn.send_close_notify();
            let _ = self.flush_tls();
        }
        let _ = self.tcp.shutdown(Shutdown::Write);
    }

    /// Sends every TLS record waiting to go.
    fn flush_tls(&mut self) -> std::io::Result<()> {
        let Some(conn) = &mut self.tls else { return Ok(()) };
        let mut sock = self.tcp;
        while conn.wants_write() {
            conn.write_tls(&mut sock)?;
        }
        Ok(())
    }
}

impl Read for Link<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let Some(conn) = &mut self.tls else { return (&*self.tcp).read(buf) };
        let mut sock = self.tcp;
        loop {
            match conn.reader().read(buf) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                other => return other,
            }
            // No plaintext yet: the next record from the socket (its timeout applies).
            if conn.read_tls(&mut sock)? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            let state = conn.process_new_packets().map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e));
            // An alert or a key update to answer.
            while conn.wants_write() {
                conn.write_tls(&mut sock)?;
            }
            state?;
        }
    }
}

impl Write for Link<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let Some(conn) = &mut self.tls else { return (&*self.tcp).write(buf) };
        let n = conn.writer().write(buf)?;
        self.flush_tls()?;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.flush_tls()
    }
}
