//! The proxy's HTTP server in protected mode, over real sockets: bound on the unspecified address
//! and called from this machine's non-loopback address, it closes the connection at accept
//! without answering (counted as `pdflow_auth_refusals_total{socket="proxy",cause="not_loopback"}`)
//! when its peers are [`PeerFilter::LoopbackOnly`], while a loopback client is answered; with
//! [`PeerFilter::AnyPeer`] (a secret, or `insecure`) the same client is answered. Every other
//! pdflow HTTP server serves through the same accept loop. Skipped, saying why, on a machine with
//! no non-loopback address.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use kameo::prelude::*;
use pdflow_auth::PeerFilter;

use super::HttpLimits;
use crate::proxy::{PrefillTarget, Proxy, ProxyArgs, ProxyServer};

const WAIT: Duration = Duration::from_secs(5);

/// A proxy server on `any`:0 serving `peers` (its P and D are nowhere: `/health` answers 503, an
/// answer all the same).
async fn proxy(any: IpAddr, peers: PeerFilter) -> (ActorRef<Proxy>, ProxyServer) {
    let args = ProxyArgs {
        health_interval: Duration::from_secs(1),
        upstream_timeout: WAIT,
        ..ProxyArgs::new(
            SocketAddr::new(any, 0),
            vec![PrefillTarget { url: "http://127.0.0.1:9".into(), bootstrap_port: 9 }],
            vec!["http://127.0.0.1:9".into()],
        )
    };
    let (bind, upstream_timeout) = (args.bind, args.upstream_timeout);
    let actor = Proxy::spawn(args);
    tokio::time::timeout(WAIT, actor.wait_for_startup()).await.expect("proxy started");
    let server = ProxyServer::start_with_limits(bind, actor.clone(), upstream_timeout, HttpLimits::serving(peers))
        .await
        .expect("server binds");
    (actor, server)
}

/// `GET /health` from `ip` to the server's port at `ip`: its status, or the client's error.
async fn health(ip: IpAddr, port: u16) -> reqwest::Result<u16> {
    let client = reqwest::Client::builder().local_address(ip).no_proxy().timeout(WAIT).build().expect("client");
    let url = format!("http://{}/health", SocketAddr::new(ip, port));
    client.get(url).send().await.map(|r| r.status().as_u16())
}

fn not_loopback_refusals() -> f64 {
    let series = r#"pdflow_auth_refusals_total{socket="proxy",cause="not_loopback"} "#;
    let text = pdflow_observability::metrics::global().render();
    text.lines().find_map(|l| l.strip_prefix(series)).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
}

#[tokio::test]
async fn a_client_off_loopback_is_closed_at_accept_when_protected_and_answered_otherwise() {
    let Some(ip) = pdflow_testkit::non_loopback_ip_or_skip("proxy HTTP: protected mode against a non-loopback client")
    else {
        return;
    };
    let (any, loopback): (IpAddr, IpAddr) = if ip.is_ipv4() {
        ([0, 0, 0, 0].into(), [127, 0, 0, 1].into())
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED.into(), std::net::Ipv6Addr::LOCALHOST.into())
    };
    let (_actor, server) = proxy(any, PeerFilter::LoopbackOnly).await;
    let before = not_loopback_refusals();
    let refused = health(ip, server.addr.port()).await;
    assert!(refused.is_err(), "closed at accept, never answered: {refused:?}");
    assert!(not_loopback_refusals() > before, "the refusal is counted");
    let served = health(loopback, server.addr.port()).await;
    assert!(served.is_ok(), "a loopback client is answered: {served:?}");
    server.shutdown().await;

    let (_actor, server) = proxy(any, PeerFilter::AnyPeer).await;
    let served = health(ip, server.addr.port()).await;
    assert!(served.is_ok(), "answered when every peer is served: {served:?}");
    server.shutdown().await;
}
