use std::sync::Arc;

#[cfg(feature = "tokio-runtime")]
use tokio::net::{TcpListener, TcpStream};

#[cfg(any(feature = "async-std-runtime", feature = "async-dispatcher-runtime"))]
use async_std::net::{TcpListener, TcpStream};

use super::make_framed;
use super::AcceptStopHandle;
use crate::async_rt;
use crate::codec::FramedIo;
use crate::endpoint::{Endpoint, Host, Port};
#[cfg(feature = "tokio-runtime")]
use crate::limits::Slotted;
use crate::limits::{self, SlotGuard};
use crate::task_handle::TaskHandle;
use crate::ZmqResult;

use futures::{select, FutureExt};

#[cfg(feature = "tokio-runtime")]
const TCP_SOCKET_BUFFER_SIZE: usize = 4 * 1024 * 1024;

pub(crate) async fn connect(
    host: &Host,
    port: Port,
    options: Arc<crate::SocketOptions>,
) -> ZmqResult<(FramedIo, Endpoint)> {
    let raw_socket = TcpStream::connect((host.to_string().as_str(), port)).await?;
    // For some reason set_nodelay doesn't work on windows. See
    // https://github.com/zeromq/zmq.rs/issues/148 for details
    #[cfg(not(windows))]
    raw_socket.set_nodelay(true)?;
    tune_socket_buffers(&raw_socket);
    let peer_addr = raw_socket.peer_addr()?;

    // pdflow patch: TLS over the connection when the socket's options ask for it.
    #[cfg(all(feature = "tls", feature = "tokio-runtime"))]
    if let Some(crate::TlsOption::Client {
        config,
        server_name,
    }) = &options.tls
    {
        // Its own deadline: a reconnect runs outside the connect timeout.
        let connector = tokio_rustls::TlsConnector::from(Arc::clone(config));
        let handshake = connector.connect(server_name.clone(), raw_socket);
        let stream = tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, handshake)
            .await
            .map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no TLS handshake from {peer_addr} within {TLS_HANDSHAKE_TIMEOUT:?}"),
                )
            })??;
        return Ok((
            make_framed(stream, options),
            Endpoint::from_tcp_addr(peer_addr),
        ));
    }

    Ok((
        make_framed(raw_socket, options),
        Endpoint::from_tcp_addr(peer_addr),
    ))
}

/// pdflow patch: how long a connection may take over its TLS handshake (either side).
#[cfg(all(feature = "tls", feature = "tokio-runtime"))]
const TLS_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// pdflow patch: the server side of TLS over an accepted connection, under
/// [`TLS_HANDSHAKE_TIMEOUT`]; a failure keeps rustls' error (in the I/O error) and names the peer.
#[cfg(all(feature = "tls", feature = "tokio-runtime"))]
async fn accept_tls(
    config: Arc<tokio_rustls::rustls::ServerConfig>,
    raw_socket: TcpStream,
    remote_addr: std::net::SocketAddr,
    options: Arc<crate::SocketOptions>,
    slot: SlotGuard,
) -> ZmqResult<(FramedIo, Endpoint)> {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(raw_socket)).await {
        Ok(Ok(stream)) => Ok((
            framed_accepted(stream, options, slot, remote_addr),
            Endpoint::from_tcp_addr(remote_addr),
        )),
        Ok(Err(e)) => Err(crate::ZmqError::Network(std::io::Error::new(
            e.kind(),
            crate::TlsAcceptError {
                peer: remote_addr,
                source: e,
            },
        ))),
        Err(_) => Err(crate::ZmqError::Network(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no TLS handshake from {remote_addr} within {TLS_HANDSHAKE_TIMEOUT:?}"),
        ))),
    }
}

pub(crate) async fn begin_accept<T>(
    host: Host,
    port: Port,
    options: Arc<crate::SocketOptions>,
    cback: impl Fn(ZmqResult<(FramedIo, Endpoint)>) -> T + Send + Sync + 'static,
) -> ZmqResult<(Endpoint, AcceptStopHandle)>
where
    T: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind((host.to_string().as_str(), port)).await?;
    let resolved_addr = listener.local_addr()?;
    debug_assert_ne!(resolved_addr.port(), 0);
    let endpoint = Endpoint::Tcp(host, resolved_addr.port());
    begin_accept_bound(listener, endpoint, options, cback).await
}

pub(crate) async fn begin_accept_listener<T>(
    listener: std::net::TcpListener,
    options: Arc<crate::SocketOptions>,
    cback: impl Fn(ZmqResult<(FramedIo, Endpoint)>) -> T + Send + Sync + 'static,
) -> ZmqResult<(Endpoint, AcceptStopHandle)>
where
    T: std::future::Future<Output = ()> + Send + 'static,
{
    let resolved_addr = listener.local_addr()?;
    listener.set_nonblocking(true)?;

    #[cfg(feature = "tokio-runtime")]
    let listener = TcpListener::from_std(listener)?;
    #[cfg(any(feature = "async-std-runtime", feature = "async-dispatcher-runtime"))]
    let listener = TcpListener::from(listener);

    begin_accept_bound(
        listener,
        Endpoint::from_tcp_addr(resolved_addr),
        options,
        cback,
    )
    .await
}

async fn begin_accept_bound<T>(
    listener: TcpListener,
    endpoint: Endpoint,
    options: Arc<crate::SocketOptions>,
    cback: impl Fn(ZmqResult<(FramedIo, Endpoint)>) -> T + Send + Sync + 'static,
) -> ZmqResult<(Endpoint, AcceptStopHandle)>
where
    T: std::future::Future<Output = ()> + Send + 'static,
{
    let (stop_channel, stop_callback) = futures::channel::oneshot::channel::<()>();
    #[cfg(all(feature = "tls", feature = "tokio-runtime"))]
    let cback = Arc::new(cback);
    let task_handle = async_rt::task::spawn(async move {
        let mut stop_callback = stop_callback.fuse();
        loop {
            select! {
                incoming = listener.accept().fuse() => {
                    let (raw_socket, remote_addr) = match incoming {
                        Ok(accepted) => accepted,
                        Err(e) => {
                            async_rt::task::spawn(cback(Err(e.into())));
                            // pdflow patch: out of descriptors, accept fails at once and the
                            // listener stays readable; pause rather than spin on it.
                            async_rt::task::sleep(ACCEPT_ERROR_PAUSE).await;
                            continue;
                        }
                    };
                    // pdflow patch: a peer the socket's predicate refuses is closed at once,
                    // before it takes a slot (its refusal reported to the socket's hook).
                    if !limits::peer_allowed(&options, remote_addr) {
                        drop(raw_socket);
                        continue;
                    }
                    // pdflow patch: a connection past the socket's caps is closed at once (its
                    // refusal reported to the socket's hook); the others hold a slot until closed.
                    let slot = match options.connection_slots.acquire(&options.limits, remote_addr) {
                        Ok(slot) => slot,
                        Err(kind) => {
                            limits::report(options.on_limit.as_ref(), kind, Some(remote_addr));
                            drop(raw_socket);
                            continue;
                        }
                    };
                    // pdflow patch: with TLS, each handshake runs in a task of its own (a slow
                    // peer never holds up the accept loop), then the connection goes on as usual.
                    #[cfg(all(feature = "tls", feature = "tokio-runtime"))]
                    if let Some(crate::TlsOption::Server { config }) = &options.tls {
                        let _ = raw_socket.set_nodelay(true);
                        tune_socket_buffers(&raw_socket);
                        let (config, options, cback) =
                            (Arc::clone(config), Arc::clone(&options), Arc::clone(&cback));
                        async_rt::task::spawn(async move {
                            cback(accept_tls(config, raw_socket, remote_addr, options, slot).await).await
                        });
                        continue;
                    }
                    let maybe_accepted = match raw_socket.set_nodelay(true) {
                        Ok(()) => {
                            tune_socket_buffers(&raw_socket);
                            Ok((
                                framed_accepted(raw_socket, Arc::clone(&options), slot, remote_addr),
                                Endpoint::from_tcp_addr(remote_addr),
                            ))
                        }
                        Err(e) => Err(e.into()),
                    };
                    async_rt::task::spawn(cback(maybe_accepted));
                }
                _ = stop_callback => {
                    break
                }
            }
        }
        Ok(())
    });
    Ok((
        endpoint,
        AcceptStopHandle(TaskHandle::new(stop_channel, task_handle)),
    ))
}

/// pdflow patch: how long the accept loop pauses after a failed accept.
const ACCEPT_ERROR_PAUSE: std::time::Duration = std::time::Duration::from_millis(10);

/// pdflow patch: an accepted connection's framing, holding its slot (given back once both halves
/// are dropped) and naming its peer when it hits a limit.
#[cfg(feature = "tokio-runtime")]
fn framed_accepted<T>(
    stream: T,
    options: Arc<crate::SocketOptions>,
    slot: SlotGuard,
    remote_addr: std::net::SocketAddr,
) -> FramedIo
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + Sync + 'static,
{
    let mut framed = make_framed(
        Slotted {
            inner: stream,
            _slot: slot,
        },
        options,
    );
    framed.read_half.set_peer(remote_addr);
    framed
}

#[cfg(feature = "tokio-runtime")]
fn tune_socket_buffers(raw_socket: &TcpStream) {
    let socket = socket2::SockRef::from(raw_socket);
    if let Err(error) = socket.set_recv_buffer_size(TCP_SOCKET_BUFFER_SIZE) {
        log::debug!("failed to set TCP receive buffer size: {error}");
    }
    if let Err(error) = socket.set_send_buffer_size(TCP_SOCKET_BUFFER_SIZE) {
        log::debug!("failed to set TCP send buffer size: {error}");
    }
}

#[cfg(not(feature = "tokio-runtime"))]
fn tune_socket_buffers(_raw_socket: &TcpStream) {}
