//! D's data server in protected mode, over real sockets: bound on the unspecified address and
//! written to by P's engine at this machine's non-loopback address (so the connection comes from
//! it), it closes P at accept without a cluster secret — nothing lands, the refusal is counted
//! and P is told the likely cause — while loopback peers are still served; with `insecure`, or
//! with the secret (and P proving it), the same write lands. Skipped, saying why, on a machine
//! with no non-loopback address.

use std::net::{IpAddr, SocketAddr};

use pdflow_auth::ClusterSecret;
use pdflow_kv::memory::{KvCache, KvShape};

use super::test_side::data_refusals;
use super::{DataServerOptions, TcpConfig, TcpDataServer, TcpTransferEngine};
use crate::{TransferEngine, TransferError};

const SHAPE: KvShape = KvShape { num_layers: 2, num_kv_heads: 2, head_dim: 8, dtype_bytes: 2, block_size: 4 };
const BOUND: std::time::Duration = std::time::Duration::from_secs(10);

/// D on `0.0.0.0:0` (or `[::]:0`) under `options`; P's engine under `p`; P's blocks 1, 2 written
/// into D's 5, 6 at `ip`. Returns what the write gave and whether D's blocks hold P's bytes.
async fn write_at(ip: IpAddr, options: DataServerOptions, p: TcpConfig) -> (Result<(), TransferError>, bool) {
    let (src, dst) = (KvCache::patterned(SHAPE, 8, 0), KvCache::new(SHAPE, 8));
    let any: IpAddr = if ip.is_ipv4() { [0, 0, 0, 0].into() } else { std::net::Ipv6Addr::UNSPECIFIED.into() };
    let server =
        TcpDataServer::bind_options(SocketAddr::new(any, 0), dst.region_table(), options).await.expect("binds");
    let peer = SocketAddr::new(ip, server.local_addr().port()).to_string();
    let engine = TcpTransferEngine::new(src.region_table(), TcpConfig { streams_per_peer: 1, ..p });
    let plan =
        pdflow_kv::planner::build_plan(&src.regions(), &[1, 2], &dst.regions(), &[5, 6], true).expect("plannable");
    let written = tokio::time::timeout(BOUND, engine.write(&peer, &plan)).await.expect("bounded").map(|_| ());
    let landed = src.blocks_checksum(&[1, 2]).ok() == dst.blocks_checksum(&[5, 6]).ok();
    (written, landed)
}

fn secret() -> ClusterSecret {
    ClusterSecret::from_text("the-cluster-secret-0001").expect("valid secret")
}

#[tokio::test]
async fn without_a_secret_a_peer_off_loopback_is_closed_at_accept_and_a_loopback_one_is_served() {
    let Some(ip) = pdflow_testkit::non_loopback_ip_or_skip("data server: protected mode refuses a non-loopback peer")
    else {
        return;
    };
    let before = data_refusals("not_loopback");
    let (written, landed) = write_at(ip, DataServerOptions::default(), TcpConfig::default()).await;
    match written {
        Err(TransferError::Connect { source, .. }) => {
            let why = source.to_string();
            assert!(why.contains("without a cluster secret") && why.contains("--insecure"), "{why}");
        }
        other => panic!("expected P's connection closed before the hello's answer, got {other:?}"),
    }
    assert!(!landed, "nothing lands from a refused peer");
    assert!(data_refusals("not_loopback") > before, "the refusal is counted");
    let loopback = if ip.is_ipv4() { IpAddr::from([127, 0, 0, 1]) } else { std::net::Ipv6Addr::LOCALHOST.into() };
    let (written, landed) = write_at(loopback, DataServerOptions::default(), TcpConfig::default()).await;
    written.expect("a loopback peer is served");
    assert!(landed);
}

#[tokio::test]
async fn with_insecure_the_same_peer_is_served() {
    let Some(ip) = pdflow_testkit::non_loopback_ip_or_skip("data server: insecure serves a non-loopback peer") else {
        return;
    };
    let options = DataServerOptions { insecure: true, ..DataServerOptions::default() };
    let (written, landed) = write_at(ip, options, TcpConfig::default()).await;
    written.expect("served");
    assert!(landed);
}

#[tokio::test]
async fn with_a_secret_the_same_peer_is_served_and_must_still_prove_it() {
    let Some(ip) = pdflow_testkit::non_loopback_ip_or_skip("data server: a secret serves a non-loopback peer") else {
        return;
    };
    let options = || DataServerOptions { secret: Some(secret()), ..DataServerOptions::default() };
    let (written, landed) = write_at(ip, options(), TcpConfig { secret: Some(secret()), ..TcpConfig::default() }).await;
    written.expect("served");
    assert!(landed);
    let (written, landed) = write_at(ip, options(), TcpConfig::default()).await;
    assert!(matches!(written, Err(TransferError::Refused { .. })), "a P without the secret: {written:?}");
    assert!(!landed);
}
