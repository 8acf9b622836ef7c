//! P's side channel in protected mode, over real sockets: a SenderListener bound on the
//! unspecified address, reached at this machine's non-loopback address (so the connection comes
//! from it). Without a secret, P closes the connection at accept before a byte of ZMTP (counted
//! as `cause="not_loopback"`), while a loopback peer is greeted; with `insecure`, or with the
//! secret, the same peer is greeted. Skipped, saying why, on a machine with no such address.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use kameo::prelude::*;
use pdflow_auth::ClusterSecret;
use pdflow_kv::memory::KvCache;
use pdflow_messages::sender_listener::SideChannelAddr;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use super::{SenderListener, SenderListenerArgs};
use crate::send_worker::test_support::{filled_cache, MemcpyTransfer, SHAPE};
use crate::side_channel_auth::ListenerAuth;

const WAIT: Duration = Duration::from_secs(5);

/// A SenderListener on `0.0.0.0` (or `[::]`) under `auth`, with no bootstrap; its port.
async fn listener(any: IpAddr, auth: ListenerAuth) -> (ActorRef<SenderListener>, u16) {
    let (p, d) = (filled_cache(8, 1), KvCache::new(SHAPE, 8));
    let args = SenderListenerArgs {
        auth,
        faults: crate::fault_seam::no_faults(),
        side_channel_port: Arc::new(std::sync::atomic::AtomicU16::new(0)),
        engine_id: "engine-p".into(),
        dp_rank: 0,
        rank: crate::ranks::WorkerRank::single(p.shape()),
        bind_host: any.to_string(),
        bootstrap_url: None,
        kv_cache: p.clone(),
        transfer: MemcpyTransfer::new(&p, &d),
        ready_timeout: Duration::from_secs(30),
        send_expiry: Duration::from_secs(60),
        register_attempts: 1,
        register_backoff: Duration::from_millis(10),
        events: Arc::new(tokio::sync::Notify::new()),
        verify_checksums: false,
        lineage: Default::default(),
    };
    let listener = SenderListener::spawn(args);
    let addr = tokio::time::timeout(WAIT, listener.ask(SideChannelAddr)).await.expect("in time").expect("started");
    let port = addr.rsplit(':').next().and_then(|p| p.parse().ok()).expect("a port");
    (listener, port)
}

/// Connects to P at `ip`:`port` and reads what P sends first: its ZMTP greeting when it serves
/// the peer (`Some(bytes)`), nothing when it closes the connection at once (`None`).
async fn greeting(ip: IpAddr, port: u16) -> Option<Vec<u8>> {
    let mut stream = tokio::time::timeout(WAIT, TcpStream::connect(SocketAddr::new(ip, port)))
        .await
        .expect("connects in time")
        .expect("the kernel accepts it");
    let mut buf = [0u8; 10];
    match tokio::time::timeout(WAIT, stream.read_exact(&mut buf)).await.expect("P speaks or closes in time") {
        Ok(_) => Some(buf.to_vec()),
        Err(_) => None,
    }
}

/// `pdflow_auth_refusals_total{socket="side_channel",cause="not_loopback"}` in this process.
fn not_loopback_refusals() -> f64 {
    let series = r#"pdflow_auth_refusals_total{socket="side_channel",cause="not_loopback"} "#;
    let text = pdflow_observability::metrics::global().render();
    text.lines().find_map(|l| l.strip_prefix(series)).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
}

fn is_zmtp_greeting(bytes: &Option<Vec<u8>>) -> bool {
    bytes.as_ref().is_some_and(|b| b[0] == 0xff && b[9] == 0x7f)
}

#[tokio::test]
async fn a_peer_off_loopback_is_closed_at_accept_without_a_secret_and_greeted_with_insecure_or_the_secret() {
    let Some(ip) = pdflow_testkit::non_loopback_ip_or_skip("side channel: protected mode against a non-loopback peer")
    else {
        return;
    };
    let (any, loopback): (IpAddr, IpAddr) = if ip.is_ipv4() {
        ([0, 0, 0, 0].into(), [127, 0, 0, 1].into())
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED.into(), std::net::Ipv6Addr::LOCALHOST.into())
    };

    let (protected, port) = listener(any, ListenerAuth::new(None)).await;
    let before = not_loopback_refusals();
    assert_eq!(greeting(ip, port).await, None, "closed before a byte of ZMTP");
    assert!(not_loopback_refusals() > before, "the refusal is counted");
    assert!(is_zmtp_greeting(&greeting(loopback, port).await), "a loopback peer is served");
    protected.kill();

    let (insecure, port) = listener(any, ListenerAuth::new(None).insecure(true)).await;
    assert!(is_zmtp_greeting(&greeting(ip, port).await), "insecure: served");
    insecure.kill();

    let secret = ClusterSecret::from_text("the-cluster-secret-0001").expect("valid secret");
    let (with_secret, port) = listener(any, ListenerAuth::new(Some(secret))).await;
    // Served; its pulls must still be sealed (`auth_tests`).
    assert!(is_zmtp_greeting(&greeting(ip, port).await), "with the secret: served");
    with_secret.kill();
}
