//! The data channel with TLS (the cluster secret's identity), over real sockets: every byte of a
//! write spread over several connections lands, pooled connections are reused, the same-host
//! question is still answered, a rotation mid-way still shakes hands, a stranger's certificate is
//! refused by either end, and TLS on one end only fails with a hint — and in every refusal D's
//! memory stays as it was.

use std::time::Duration;

use pdflow_auth::{ClusterSecret, TlsIdentity};
use pdflow_kv::memory::KvShape;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::test_side::{data_refusals, Side};
use super::{DataServerOptions, TcpConfig, TcpTransferEngine};
use crate::TransferError;

/// 256 KiB per block: a plan of three blocks is split over the engine's four streams.
const SHAPE: KvShape = KvShape { num_layers: 4, num_kv_heads: 8, head_dim: 128, dtype_bytes: 2, block_size: 16 };
const BOUND: Duration = Duration::from_secs(20);

fn secret(text: &str) -> ClusterSecret {
    ClusterSecret::from_text(text).expect("valid secret")
}

fn tls(text: &str) -> Option<TlsIdentity> {
    Some(TlsIdentity::from_secret(&secret(text)).expect("identity"))
}

/// D's data server (same-host offered) under `d_secret`, with TLS when `d_tls`.
async fn side(d_secret: Option<&str>, d_tls: bool) -> Side {
    let options = DataServerOptions {
        secret: d_secret.map(secret),
        tls: d_secret.filter(|_| d_tls).and_then(tls),
        offer_same_host: true,
        ..DataServerOptions::default()
    };
    Side::start(SHAPE, options).await
}

/// P's engine under `p_secret`, with TLS when `p_tls`.
fn engine(s: &Side, p_secret: Option<&str>, p_tls: bool) -> TcpTransferEngine {
    s.engine(TcpConfig {
        secret: p_secret.map(secret),
        tls: p_secret.filter(|_| p_tls).and_then(tls),
        ..TcpConfig::default()
    })
}

const KEY: &str = "the-cluster-secret-0001";

#[tokio::test]
async fn with_tls_on_both_ends_every_byte_lands_over_several_streams_and_connections_are_reused() {
    let s = side(Some(KEY), true).await;
    let engine = engine(&s, Some(KEY), true);
    // Three blocks (768 KiB, over four streams), then one block on the pooled connections.
    s.write(&engine, &s.plan(&[1, 2, 3], &[5, 6, 7])).await.expect("written");
    assert!(s.landed(&[(1, 5), (2, 6), (3, 7)]));
    let pooled = engine.pooled_connections(&s.peer);
    assert!(pooled >= 2, "the shares' TLS connections are pooled: {pooled}");
    let connections = s.server.live_connections();
    s.write(&engine, &s.plan(&[4], &[0])).await.expect("written again");
    assert!(s.landed(&[(4, 0)]));
    // The second write went over a pooled connection: D accepted no new one (no new handshake).
    assert_eq!(s.server.live_connections(), connections, "a new connection was opened");
}

#[tokio::test]
async fn the_same_host_question_is_answered_over_tls() {
    let s = side(Some(KEY), true).await;
    let info = tokio::time::timeout(BOUND, engine(&s, Some(KEY), true).host_info(&s.peer))
        .await
        .expect("bounded")
        .expect("answered");
    assert!(info.offered, "D still offers the same-host path");
    assert_eq!(info.pid, std::process::id());
}

#[tokio::test]
async fn a_stranger_is_refused_by_either_end_at_the_handshake_and_nothing_lands() {
    // D holds our secret, P another: P refuses D's certificate (and D P's).
    let s = side(Some(KEY), true).await;
    let before = data_refusals("bad_proof");
    let result = s.write(&engine(&s, Some("a-stranger-secret-7777"), true), &s.plan(&[1], &[5])).await;
    match result {
        Err(TransferError::Refused { reason, .. }) => assert!(reason.contains("cluster secret"), "{reason}"),
        other => panic!("expected a refusal at the handshake, got {other:?}"),
    }
    assert!(data_refusals("bad_proof") > before, "the refusal is counted");
    assert!(s.untouched());
    // The real P still writes.
    s.write(&engine(&s, Some(KEY), true), &s.plan(&[1], &[5])).await.expect("the real P writes");
    assert!(s.landed(&[(1, 5)]));
}

#[tokio::test]
async fn tls_on_one_end_only_fails_with_a_hint_and_nothing_lands() {
    let plaintext = || {
        let series = "pdflow_auth_refusals_total{socket=\"data\",cause=\"plaintext_on_tls\"} ";
        let text = pdflow_observability::metrics::global().render();
        text.lines().find_map(|l| l.strip_prefix(series)).and_then(|v| v.trim().parse::<f64>().ok()).unwrap_or(0.0)
    };
    let before = plaintext();
    let d_tls = side(Some(KEY), true).await;
    let err = d_tls.write(&engine(&d_tls, Some(KEY), false), &d_tls.plan(&[1], &[5])).await.expect_err("P without TLS");
    assert!(err.to_string().contains("TLS"), "{err}");
    assert!(d_tls.untouched());
    // D counts (and logs, naming the setting) the plain-text peer at its TLS port.
    let deadline = tokio::time::Instant::now() + BOUND;
    while plaintext() <= before {
        assert!(tokio::time::Instant::now() < deadline, "D did not count the plain-text peer");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }

    let d_plain = side(Some(KEY), false).await;
    let err =
        d_plain.write(&engine(&d_plain, Some(KEY), true), &d_plain.plan(&[1], &[5])).await.expect_err("D without TLS");
    assert!(err.to_string().contains("TLS"), "{err}");
    assert!(d_plain.untouched());
}

#[tokio::test]
async fn garbage_instead_of_a_handshake_is_closed_and_the_server_keeps_serving() {
    let s = side(Some(KEY), true).await;
    for junk in [&b"PDFLOW hello, no TLS"[..], &[0x16, 0x03, 0x01, 0xff, 0xff, 0x01][..], &[0u8; 4096][..]] {
        let mut raw = tokio::net::TcpStream::connect(&s.peer).await.expect("connects");
        let _ = raw.write_all(junk).await;
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(BOUND, raw.read_to_end(&mut rest)).await.expect("D closes the connection");
    }
    s.write(&engine(&s, Some(KEY), true), &s.plan(&[2], &[6])).await.expect("still serving");
    assert!(s.landed(&[(2, 6)]));
}

/// A rotation under TLS, as without it: mid-way P still presents the old key's certificate and D
/// the new one's; each holds the other's key as its second line, so the handshake passes.
#[tokio::test]
async fn mid_rotation_ends_presenting_different_keys_still_shake_hands() {
    let s = side(Some("new-cluster-secret-0002\nold-cluster-secret-0001"), true).await;
    let p = engine(&s, Some("old-cluster-secret-0001\nnew-cluster-secret-0002"), true);
    s.write(&p, &s.plan(&[3], &[7])).await.expect("written mid-rotation");
    assert!(s.landed(&[(3, 7)]));
    // A P that never learnt the new key refuses D's certificate: nothing is written.
    let stale = engine(&s, Some("old-cluster-secret-0001"), true);
    assert!(s.write(&stale, &s.plan(&[4], &[0])).await.is_err(), "a P without the new key wrote");
    assert!(s.dst.block_bytes(0).expect("block").iter().all(|&x| x == 0));
}
