//! The bootstrap without a cluster secret, over real sockets, as peers see it.
//!
//! Protected mode: bound on the unspecified address, it closes a caller from this machine's
//! non-loopback address at accept (counted), serves it with `insecure`, and with the secret
//! serves it and still demands each call's proof. Skipped, saying why, without such an address.
//!
//! Registrations ([`super::Registrants`]): loopback addresses other than 127.0.0.1 stand for other
//! hosts (Linux routes all of 127/8 to `lo`). A newer generation — at another address or the same
//! — from an address other than the worker's registrant is refused 403 with a body saying why and
//! what to do, and changes nothing; the worker's own restart from its address is accepted; a new
//! worker (dp or tp rank) is accepted only from an address that already registered one. With the
//! secret, signed calls from anywhere do all of it.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use pdflow_auth::http::Call;
use pdflow_auth::{ClusterSecret, PeerFilter};
use pdflow_messages::bootstrap::{BootstrapAddr, QueryResponse};

use super::{Bootstrap, BootstrapArgs};
use crate::bootstrap_call;
use kameo::prelude::*;

const WAIT: Duration = Duration::from_secs(5);

fn loopback(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
}

/// A bootstrap on `bind` (port 0) under `secret` and `insecure`; its port.
async fn start(bind: IpAddr, secret: Option<ClusterSecret>, insecure: bool) -> (ActorRef<Bootstrap>, u16) {
    let actor = Bootstrap::spawn(BootstrapArgs { bind: SocketAddr::new(bind, 0), secret, insecure });
    let addr = tokio::time::timeout(WAIT, actor.ask(BootstrapAddr)).await.expect("in time").expect("started");
    (actor, addr.port())
}

/// A client whose connections come from `ip`.
fn client_from(ip: IpAddr) -> reqwest::Client {
    reqwest::Client::builder().local_address(ip).no_proxy().timeout(WAIT).build().expect("client")
}

fn secret() -> ClusterSecret {
    ClusterSecret::from_text("the-cluster-secret-0001").expect("valid secret")
}

fn worker(dp: u32, tp: u32, addr: &str, generation: u64) -> serde_json::Value {
    serde_json::json!({"engine_id": format!("p_dp{dp}"), "dp_rank": dp, "tp_rank": tp, "pp_rank": 0,
        "addr": addr, "generation": generation})
}

/// `POST /register` of `body` from `from` to the bootstrap on 127.0.0.1:`port`, signed with
/// `secret` when given: the status and the body's `error`.
async fn register(from: IpAddr, port: u16, body: &serde_json::Value, secret: Option<&ClusterSecret>) -> (u16, String) {
    let url = format!("http://127.0.0.1:{port}/register");
    let json = serde_json::to_vec(body).expect("json");
    let answer = bootstrap_call::send(&client_from(from), secret, Call::Register, &url, Some(json))
        .await
        .expect("the bootstrap answers");
    let error: serde_json::Value = serde_json::from_slice(&answer.body).unwrap_or_default();
    (answer.status.as_u16(), error["error"].as_str().unwrap_or_default().to_owned())
}

/// The bootstrap's table, as 127.0.0.1 reads it.
async fn table(port: u16, secret: Option<&ClusterSecret>) -> QueryResponse {
    let url = format!("http://127.0.0.1:{port}/query");
    let answer = bootstrap_call::send(&client_from(loopback(1)), secret, Call::Query, &url, None)
        .await
        .expect("the bootstrap answers");
    serde_json::from_slice(&answer.body).expect("a table")
}

fn addr_of(q: &QueryResponse, dp: &str, tp: u32) -> String {
    q[dp].workers().expect("ranks")[&tp][&0].clone()
}

#[tokio::test]
async fn without_a_secret_another_address_cannot_take_a_live_worker_over_and_its_own_restart_can() {
    let (_actor, port) = start(loopback(1), None, false).await;
    let (p_host, forger) = (loopback(1), loopback(2));
    assert_eq!(register(p_host, port, &worker(0, 0, "tcp://127.0.0.1:41000", 100), None).await.0, 200);

    // A newer generation at the forger's address: refused, saying why and what to do.
    let (status, why) = register(forger, port, &worker(0, 0, "tcp://127.0.0.2:6666", 200), None).await;
    assert_eq!(status, 403, "{why}");
    for words in ["registered at tcp://127.0.0.1:41000 by 127.0.0.1", "not 127.0.0.2", "cluster secret"] {
        assert!(why.contains(words), "{words:?} in {why}");
    }
    // A newer generation at the worker's own address (D's pulls would name the wrong one): refused.
    let (status, why) = register(forger, port, &worker(0, 0, "tcp://127.0.0.1:41000", 300), None).await;
    assert_eq!(status, 403, "{why}");
    // Its identical re-registration changes nothing: accepted from anywhere.
    assert_eq!(register(forger, port, &worker(0, 0, "tcp://127.0.0.1:41000", 100), None).await.0, 200);
    let q = table(port, None).await;
    assert_eq!(addr_of(&q, "0", 0), "tcp://127.0.0.1:41000", "the forgeries changed nothing");
    assert_eq!(q["0"].generation_of("tcp://127.0.0.1:41000"), 100);

    // The worker restarts on its host, on a new port: accepted, and it stays its registrant.
    assert_eq!(register(p_host, port, &worker(0, 0, "tcp://127.0.0.1:42000", 200), None).await.0, 200);
    assert_eq!(register(p_host, port, &worker(0, 0, "tcp://127.0.0.1:42000", 300), None).await.0, 200);
    let q = table(port, None).await;
    assert_eq!(addr_of(&q, "0", 0), "tcp://127.0.0.1:42000");
    assert_eq!(q["0"].generation_of("tcp://127.0.0.1:42000"), 300);
    assert_eq!(register(forger, port, &worker(0, 0, "tcp://127.0.0.2:6666", 400), None).await.0, 403);
}

#[tokio::test]
async fn without_a_secret_a_new_worker_is_added_only_from_an_address_that_registered_one() {
    let (_actor, port) = start(loopback(1), None, false).await;
    let (p_host, forger) = (loopback(1), loopback(3));
    assert_eq!(register(p_host, port, &worker(0, 0, "tcp://127.0.0.1:41000", 1), None).await.0, 200);

    // A new data-parallel rank (the proxy would send it requests), a new tensor rank of a
    // registered one (D would count it and pull from it): refused, saying why and what to do.
    for (dp, tp) in [(1, 0), (0, 1)] {
        let (status, why) = register(forger, port, &worker(dp, tp, "tcp://127.0.0.3:6666", 1), None).await;
        assert_eq!(status, 403, "{why}");
        for words in [
            format!("worker dp_rank={dp} tp_rank={tp} pp_rank=0 is not registered"),
            "127.0.0.3 has registered no worker".to_string(),
            "cluster secret".to_string(),
        ] {
            assert!(why.contains(&words), "{words:?} in {why}");
        }
    }
    let q = table(port, None).await;
    assert!(!q.contains_key("1"), "no rank was added");
    assert_eq!(q["0"].worker_addr.len(), 1, "no tensor rank was added");

    // The engine's next tensor rank and its next dp rank, from its host: accepted.
    assert_eq!(register(p_host, port, &worker(0, 1, "tcp://127.0.0.1:41001", 1), None).await.0, 200);
    assert_eq!(register(p_host, port, &worker(1, 0, "tcp://127.0.0.1:41002", 1), None).await.0, 200);
    let q = table(port, None).await;
    assert_eq!(addr_of(&q, "0", 1), "tcp://127.0.0.1:41001");
    assert_eq!(addr_of(&q, "1", 0), "tcp://127.0.0.1:41002");
}

#[tokio::test]
async fn with_a_secret_signed_restarts_and_new_ranks_are_accepted_from_any_address() {
    let s = secret();
    let (_actor, port) = start(loopback(1), Some(s.clone()), false).await;
    assert_eq!(register(loopback(1), port, &worker(0, 0, "tcp://127.0.0.1:41000", 1), Some(&s)).await.0, 200);
    assert_eq!(register(loopback(2), port, &worker(0, 0, "tcp://127.0.0.2:41000", 2), Some(&s)).await.0, 200);
    assert_eq!(register(loopback(3), port, &worker(1, 0, "tcp://127.0.0.3:41000", 1), Some(&s)).await.0, 200);
    let q = table(port, Some(&s)).await;
    assert_eq!(addr_of(&q, "0", 0), "tcp://127.0.0.2:41000");
    assert_eq!(addr_of(&q, "1", 0), "tcp://127.0.0.3:41000");
    // Unsigned, as ever: 401 before the body is read.
    assert_eq!(register(loopback(4), port, &worker(0, 0, "tcp://127.0.0.4:1", 9), None).await.0, 401);
}

/// `pdflow_auth_refusals_total{socket="bootstrap",cause="not_loopback"}` in this process.
fn not_loopback_refusals() -> f64 {
    let series = r#"pdflow_auth_refusals_total{socket="bootstrap",cause="not_loopback"} "#;
    let text = pdflow_observability::metrics::global().render();
    text.lines().find_map(|l| l.strip_prefix(series)).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
}

/// `GET /health` and `GET /query` from `ip` to a bootstrap bound on the unspecified address: their
/// statuses (0: no answer, the connection closed).
async fn from_off_loopback(ip: IpAddr, secret: Option<ClusterSecret>, insecure: bool) -> (u16, u16) {
    let any =
        if ip.is_ipv4() { IpAddr::V4(Ipv4Addr::UNSPECIFIED) } else { IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED) };
    let (_actor, port) = start(any, secret, insecure).await;
    let base = format!("http://{}", SocketAddr::new(ip, port));
    let client = client_from(ip);
    let health = client.get(format!("{base}/health")).send().await.map_or(0, |r| r.status().as_u16());
    let query = client.get(format!("{base}/query")).send().await.map_or(0, |r| r.status().as_u16());
    (health, query)
}

#[tokio::test]
async fn protected_mode_refuses_a_caller_off_loopback_and_insecure_or_a_secret_serve_it() {
    let Some(ip) = pdflow_testkit::non_loopback_ip_or_skip("bootstrap: protected mode against a non-loopback caller")
    else {
        return;
    };
    assert!(!PeerFilter::LoopbackOnly.allows(ip), "{ip} stands for another host");
    let before = not_loopback_refusals();
    assert_eq!(from_off_loopback(ip, None, false).await, (0, 0), "closed at accept, not answered");
    assert!(not_loopback_refusals() >= before + 2.0, "both connections counted");

    assert_eq!(from_off_loopback(ip, None, true).await, (200, 200), "insecure: served, as vLLM's");
    // With the secret: served, and still authenticated (an unsigned query is a 401).
    assert_eq!(from_off_loopback(ip, Some(secret()), false).await, (200, 401));
}
