//! What a client of a pdflow HTTP server sees of its limits, over real sockets on 127.0.0.x: the
//! proxy's server (its real routes) under shortened limits, and [`serve`] with a router of its own
//! where a behaviour needs a route the proxy does not have (a slow answer, the peer's address).
//! Loopback addresses other than 127.0.0.1 stand for other client hosts (Linux routes all of
//! 127/8 to `lo`). Deadlines are checked with 10× slack: "closed within", never "closed at".

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{ConnectInfo, State};
use axum::routing::get;
use axum::Router;
use futures::StreamExt;
use kameo::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use pdflow_auth::PeerFilter;

use super::{serve, HttpLimits};
use crate::proxy::{PrefillTarget, Proxy, ProxyArgs, ProxyServer};

/// How long a test waits for something that should happen at once.
const AT_ONCE: Duration = Duration::from_secs(5);

fn loopback(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
}

/// A proxy whose P and D are nowhere (it never becomes ready; `/metrics` and `/health` answer all
/// the same), its server held to `limits`.
async fn proxy_with(limits: HttpLimits) -> (ActorRef<Proxy>, ProxyServer) {
    let args = ProxyArgs {
        health_interval: Duration::from_secs(1),
        upstream_timeout: Duration::from_secs(5),
        ..ProxyArgs::new(
            "127.0.0.1:0".parse().expect("addr"),
            vec![PrefillTarget { url: "http://127.0.0.1:9".into(), bootstrap_port: 9 }],
            vec!["http://127.0.0.1:9".into()],
        )
    };
    let (bind, upstream_timeout) = (args.bind, args.upstream_timeout);
    let actor = Proxy::spawn(args);
    tokio::time::timeout(AT_ONCE, actor.wait_for_startup()).await.expect("proxy started");
    let server =
        ProxyServer::start_with_limits(bind, actor.clone(), upstream_timeout, limits).await.expect("server binds");
    (actor, server)
}

/// A client whose connections come from `ip`.
fn client_from(ip: IpAddr) -> reqwest::Client {
    reqwest::Client::builder().local_address(ip).build().expect("client")
}

/// A TCP connection to `server` from `ip`.
async fn connect_from(ip: IpAddr, server: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().expect("socket");
    socket.bind(SocketAddr::new(ip, 0)).expect("bind a loopback client address");
    socket.connect(server).await.expect("connect")
}

/// Waits (at most `bound`) for the server to close `stream`; true if it did. A silent connection
/// gets no bytes: data counts as not closed.
async fn closed_within(stream: &mut TcpStream, bound: Duration) -> bool {
    let mut buf = [0u8; 1024];
    matches!(tokio::time::timeout(bound, stream.read(&mut buf)).await, Ok(Ok(0) | Err(_)))
}

/// `pdflow_http_connections_closed_total{service,reason}` as `base`'s `/metrics` shows it.
async fn closes(client: &reqwest::Client, base: SocketAddr, service: &str, reason: &str) -> f64 {
    let text = client.get(format!("http://{base}/metrics")).send().await.expect("metrics").text().await.expect("text");
    let series = format!("pdflow_http_connections_closed_total{{service=\"{service}\",reason=\"{reason}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(series.as_str())).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
}

/// 600 silent connections from one address: those over the per-peer cap are closed at once, the
/// others after the header timeout, all counted; clients from other addresses (one kept alive
/// from before, one new) are served throughout, and the flooding address again afterwards.
#[tokio::test]
async fn silent_connections_are_capped_per_peer_then_reaped_while_others_are_served() {
    let limits = HttpLimits {
        header_timeout: Duration::from_secs(3),
        body_timeout: Duration::from_secs(30),
        idle_timeout: Duration::from_secs(60),
        max_connections: 150,
        max_connections_per_peer: 100,
        peers: PeerFilter::LoopbackOnly,
    };
    let (_actor, server) = proxy_with(limits).await;
    let base = server.addr;
    let kept_alive = client_from(loopback(3));
    let before = closes(&kept_alive, base, "proxy", "peer_full").await;
    let reaped_before = closes(&kept_alive, base, "proxy", "header_timeout").await;

    let mut silent = Vec::new();
    for _ in 0..600 {
        silent.push(connect_from(loopback(1), base).await);
    }
    // Every connection's close, watched at once.
    let mut watch = JoinSet::new();
    for (i, mut stream) in silent.into_iter().enumerate() {
        watch.spawn(async move { (i, closed_within(&mut stream, limits.header_timeout * 10).await) });
    }
    let mut closed_at_once = 0;
    while closed_at_once < 500 {
        let (i, closed) = tokio::time::timeout(AT_ONCE, watch.join_next())
            .await
            .expect("500 closed at once")
            .expect("watch")
            .expect("task");
        assert!(closed, "connection {i} was never closed");
        closed_at_once += 1;
    }
    // The other 100 are held until their header timeout: meanwhile other addresses are served.
    assert_eq!(watch.len(), 100, "exactly the 500 over the per-peer cap were closed at once");
    assert!(watch.try_join_next().is_none(), "the 100 under the cap are held until their header timeout");
    let r = kept_alive.get(format!("http://{base}/metrics")).send().await.expect("kept-alive client served");
    assert_eq!(r.status(), 200);
    let r = client_from(loopback(2)).get(format!("http://{base}/health")).send().await.expect("new client served");
    assert_eq!(r.status(), 503, "served (the proxy is not ready: its P and D are nowhere)");

    while let Some(ended) = watch.join_next().await {
        let (i, closed) = ended.expect("task");
        assert!(closed, "held connection {i} was not closed within 10x the header timeout");
    }
    assert!(closes(&kept_alive, base, "proxy", "peer_full").await >= before + 500.0);
    assert!(closes(&kept_alive, base, "proxy", "header_timeout").await >= reaped_before + 100.0);
    let r = client_from(loopback(1)).get(format!("http://{base}/metrics")).send().await.expect("served again");
    assert_eq!(r.status(), 200);
    server.shutdown().await;
}

/// Half a request header, then nothing: closed after the header timeout (the idle timeout is far
/// longer), counted.
#[tokio::test]
async fn half_a_request_header_is_closed_after_the_header_timeout() {
    let limits = HttpLimits {
        header_timeout: Duration::from_millis(500),
        idle_timeout: Duration::from_secs(600),
        ..HttpLimits::default()
    };
    let (_actor, server) = proxy_with(limits).await;
    let client = client_from(loopback(1));
    let before = closes(&client, server.addr, "proxy", "header_timeout").await;
    let mut stream = connect_from(loopback(4), server.addr).await;
    stream.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: pdflow\r\nContent-Type: app").await.expect("write");
    assert!(closed_within(&mut stream, limits.header_timeout * 10).await, "half a header was held open");
    assert!(closes(&client, server.addr, "proxy", "header_timeout").await > before);
    server.shutdown().await;
}

/// A request whose body stops short: answered 408 naming the deadline once the body timeout
/// passes, its connection closed, counted; a body that arrives in pieces within the timeout is
/// read and answered as usual.
#[tokio::test]
async fn a_body_that_stops_short_is_answered_408_and_its_connection_closed() {
    let limits = HttpLimits { body_timeout: Duration::from_millis(800), ..HttpLimits::default() };
    let (_actor, server) = proxy_with(limits).await;
    let client = client_from(loopback(1));
    let before = closes(&client, server.addr, "proxy", "body_timeout").await;
    let header = "POST /v1/completions HTTP/1.1\r\nHost: pdflow\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n";

    let mut stream = connect_from(loopback(5), server.addr).await;
    stream.write_all(format!("{header}{{\"prompt\": \"").as_bytes()).await.expect("write");
    let mut answer = Vec::new();
    let read = tokio::time::timeout(limits.body_timeout * 10, stream.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the request with half a body was held open");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("did not arrive in full within"), "{answer}");
    assert!(closes(&client, server.addr, "proxy", "body_timeout").await > before);

    // The same length, sent in two pieces well inside the deadline: read, and refused for what it
    // says (the proxy's P and D are nowhere), not for its timing.
    let mut stream = connect_from(loopback(5), server.addr).await;
    let body = format!("{{\"prompt\": \"{}\"}}", "a".repeat(1000 - 14));
    stream.write_all(format!("{header}{}", &body[..500]).as_bytes()).await.expect("write");
    tokio::time::sleep(limits.body_timeout / 4).await;
    stream.write_all(&body.as_bytes()[500..]).await.expect("write");
    let mut head = [0u8; 12];
    tokio::time::timeout(AT_ONCE, stream.read_exact(&mut head)).await.expect("answered in time").expect("read");
    let status = String::from_utf8_lossy(&head);
    assert!(status.starts_with("HTTP/1.1 ") && !status.ends_with("408"), "{status}");
    server.shutdown().await;
}

/// A kept-alive connection: served several requests, then closed once idle for the idle timeout.
#[tokio::test]
async fn a_kept_alive_connection_is_closed_once_idle() {
    let limits = HttpLimits {
        header_timeout: Duration::from_secs(600),
        idle_timeout: Duration::from_millis(500),
        ..HttpLimits::default()
    };
    let (_actor, server) = proxy_with(limits).await;
    let mut stream = connect_from(loopback(5), server.addr).await;
    for _ in 0..3 {
        stream.write_all(b"GET /health HTTP/1.1\r\nHost: pdflow\r\n\r\n").await.expect("write");
        let head = read_response(&mut stream).await;
        assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    }
    assert!(closed_within(&mut stream, limits.idle_timeout * 10).await, "an idle connection was held open");
    server.shutdown().await;
}

/// Reads one response whose length is given (`content-length`); returns its head.
async fn read_response(stream: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(AT_ONCE, stream.read(&mut buf)).await.expect("answer").expect("read");
        assert!(n > 0, "closed before the answer ended");
        got.extend_from_slice(&buf[..n]);
        let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
        let head = String::from_utf8_lossy(&got[..end]).into_owned();
        let length = head
            .lines()
            .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_owned()))
            .and_then(|v| v.parse::<usize>().ok())
            .expect("content-length");
        if got.len() >= end + 4 + length {
            return head;
        }
    }
}

/// Over the server's cap (from addresses each under the per-peer cap): closed at once, counted.
#[tokio::test]
async fn connections_over_the_server_cap_are_closed_at_once() {
    let limits = HttpLimits {
        header_timeout: Duration::from_secs(600),
        body_timeout: Duration::from_secs(600),
        idle_timeout: Duration::from_secs(600),
        max_connections: 20,
        max_connections_per_peer: 15,
        peers: PeerFilter::LoopbackOnly,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let stop = CancellationToken::new();
    let serving = tokio::spawn(serve(listener, Router::new(), "test_server_full", limits, stop.clone()));
    let mut held = Vec::new();
    for _ in 0..15 {
        held.push(connect_from(loopback(6), addr).await);
    }
    for _ in 0..5 {
        held.push(connect_from(loopback(7), addr).await);
    }
    for _ in 0..10 {
        let mut over = connect_from(loopback(7), addr).await;
        assert!(closed_within(&mut over, AT_ONCE).await, "a connection over the server's cap was held");
    }
    let text = pdflow_observability::metrics::global().render();
    assert!(
        text.contains("pdflow_http_connections_closed_total{service=\"test_server_full\",reason=\"server_full\"} 10"),
        "{text}"
    );
    // Shutting down closes the silent connections it held and ends the server.
    stop.cancel();
    tokio::time::timeout(AT_ONCE, serving).await.expect("server ended").expect("task");
    for (i, stream) in held.iter_mut().enumerate() {
        assert!(closed_within(stream, AT_ONCE).await, "held connection {i} outlived the server");
    }
}

/// An answer that takes longer than both timeouts, first to start then to stream, is not cut
/// (deadlines stop while a request is in flight); the peer's address reaches the handler; a
/// shutdown meanwhile lets the answer finish.
#[tokio::test]
async fn a_request_in_flight_outlives_the_timeouts_and_a_shutdown() {
    let limits = HttpLimits {
        header_timeout: Duration::from_millis(200),
        idle_timeout: Duration::from_millis(200),
        ..HttpLimits::default()
    };
    let started = Arc::new(Notify::new());
    let app = Router::new()
        .route(
            "/slow",
            get(move |State(started): State<Arc<Notify>>, ConnectInfo(peer): ConnectInfo<SocketAddr>| async move {
                started.notify_one();
                tokio::time::sleep(limits.idle_timeout * 3).await;
                let first = futures::stream::once(async move { Ok::<_, std::io::Error>(format!("{} ", peer.ip())) });
                let last = futures::stream::once(async move {
                    tokio::time::sleep(limits.idle_timeout * 3).await;
                    Ok("done".to_owned())
                });
                Body::from_stream(first.chain(last))
            }),
        )
        .with_state(started.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let stop = CancellationToken::new();
    let serving = tokio::spawn(serve(listener, app, "test_in_flight", limits, stop.clone()));
    let request = tokio::spawn(async move {
        let answer = client_from(loopback(8)).get(format!("http://{addr}/slow")).send().await?;
        answer.text().await
    });
    tokio::time::timeout(AT_ONCE, started.notified()).await.expect("the request reached its handler");
    stop.cancel();
    let answer = request.await.expect("task").expect("answered whole despite the timeouts and the shutdown");
    assert_eq!(answer, "127.0.0.8 done");
    tokio::time::timeout(AT_ONCE, serving).await.expect("server ended").expect("task");
}

/// The defaults leave half of a 1,024 open-file limit to the process, and a quarter of the
/// connections to peers other than the busiest one.
#[test]
fn default_caps_follow_the_open_file_limit() {
    let caps = |open_files| {
        let l = HttpLimits::for_open_file_limit(open_files);
        (l.max_connections, l.max_connections_per_peer)
    };
    assert_eq!(caps(Some(1024)), (512, 384));
    assert_eq!(caps(None), (512, 384));
    assert_eq!(caps(Some(usize::MAX)), (8192, 6144));
    assert_eq!(caps(Some(1)), (1, 1));
    let l = HttpLimits::default();
    assert_eq!((l.header_timeout, l.idle_timeout), (Duration::from_secs(10), Duration::from_secs(60)));
}
