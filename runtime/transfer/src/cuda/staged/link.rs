//! One connection of the staged path as either end speaks through it: the socket as it is, or
//! TLS over it with the cluster secret's identity ([`pdflow_auth::tls`]; P's end is the client,
//! D's the server). Both ends present the current key's certificate and take only a certificate
//! of a key they hold, so a finished handshake is mutual authentication, and every byte after
//! it — D's destinations, the payload of seed step 29 — crosses the link encrypted.
//!
//! Blocking, on the connection's own thread: every read and write runs under the socket's
//! timeouts, which the sender and the receiver set per phase (a timed-out read leaves the TLS
//! state as it was, so the receiver's short payload reads may retry it).

use std::io::{Read, Write};
use std::net::TcpStream;

use pdflow_auth::TlsIdentity;
use rustls::{ClientConnection, ServerConnection, StreamOwned};

/// Why a TLS handshake failed: the link, or TLS itself (a stranger's certificate among them).
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("{0}")]
    Io(std::io::Error),
    #[error("{0}")]
    Tls(rustls::Error),
}

impl HandshakeError {
    /// Whether the other end was refused, or refused this one, for not holding the secret.
    pub fn is_refusal(&self) -> bool {
        matches!(self, HandshakeError::Tls(e) if pdflow_auth::tls::is_refusal(e))
    }

    /// rustls reports its own errors through `std::io::Error` from `complete_io`: take them out.
    fn from_io(e: std::io::Error) -> Self {
        match e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
            Some(tls) => HandshakeError::Tls(tls.clone()),
            None => HandshakeError::Io(e),
        }
    }
}

/// One staged connection.
pub enum StagedLink {
    Plain(TcpStream),
    /// P's end with TLS.
    Client(Box<StreamOwned<ClientConnection, TcpStream>>),
    /// D's end with TLS.
    Server(Box<StreamOwned<ServerConnection, TcpStream>>),
}

impl StagedLink {
    /// P's end: TLS over `tcp` (the handshake under the socket's current timeouts).
    pub fn connect_tls(tcp: TcpStream, identity: &TlsIdentity) -> Result<Self, HandshakeError> {
        let conn =
            ClientConnection::new(identity.client_config(), TlsIdentity::server_name()).map_err(HandshakeError::Tls)?;
        let mut stream = StreamOwned::new(conn, tcp);
        while stream.conn.is_handshaking() {
            stream.conn.complete_io(&mut stream.sock).map_err(HandshakeError::from_io)?;
        }
        Ok(StagedLink::Client(Box::new(stream)))
    }

    /// D's end: TLS over `tcp` (P's certificate checked; the handshake under the socket's
    /// current timeouts).
    pub fn accept_tls(tcp: TcpStream, identity: &TlsIdentity) -> Result<Self, HandshakeError> {
        let conn = ServerConnection::new(identity.server_config()).map_err(HandshakeError::Tls)?;
        let mut stream = StreamOwned::new(conn, tcp);
        while stream.conn.is_handshaking() {
            if let Err(e) = stream.conn.complete_io(&mut stream.sock) {
                // Tell P why (the alert), best effort.
                let _ = stream.conn.write_tls(&mut stream.sock);
                return Err(HandshakeError::from_io(e));
            }
        }
        Ok(StagedLink::Server(Box::new(stream)))
    }

    /// The socket underneath (timeouts, peeks, shutdown).
    pub fn tcp(&self) -> &TcpStream {
        match self {
            StagedLink::Plain(tcp) => tcp,
            StagedLink::Client(s) => &s.sock,
            StagedLink::Server(s) => &s.sock,
        }
    }

    pub fn is_tls(&self) -> bool {
        !matches!(self, StagedLink::Plain(_))
    }

    /// Whether decrypted bytes wait to be read: a request may have begun without a byte more
    /// on the socket. Always `false` without TLS.
    pub fn has_plaintext(&mut self) -> bool {
        let state = match self {
            StagedLink::Plain(_) => return false,
            StagedLink::Client(s) => s.conn.process_new_packets(),
            StagedLink::Server(s) => s.conn.process_new_packets(),
        };
        state.is_ok_and(|io| io.plaintext_bytes_to_read() > 0)
    }
}

impl Read for StagedLink {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            StagedLink::Plain(tcp) => tcp.read(buf),
            StagedLink::Client(s) => s.read(buf),
            StagedLink::Server(s) => s.read(buf),
        }
    }
}

impl Write for StagedLink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            StagedLink::Plain(tcp) => tcp.write(buf),
            StagedLink::Client(s) => s.write(buf),
            StagedLink::Server(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            StagedLink::Plain(tcp) => tcp.flush(),
            StagedLink::Client(s) => s.flush(),
            StagedLink::Server(s) => s.flush(),
        }
    }
}

#[cfg(test)]
mod tests;
