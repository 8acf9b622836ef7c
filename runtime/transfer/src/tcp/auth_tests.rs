//! The data channel under the cluster secret, over real sockets: P writes only to a data server
//! that proves it holds the secret, D takes bytes only from a P that proves it, proofs are bound
//! to both sides' fresh nonces (a replayed one fails), and a refused write leaves D's memory as it
//! was.

use std::time::Duration;

use pdflow_auth::ClusterSecret;
use pdflow_kv::memory::KvShape;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::test_side::{data_refusals, Side};
use super::wire::{self, Ack, HelloAnswer};
use super::{DataServerOptions, TcpConfig, TcpTransferEngine};
use crate::TransferError;

const SHAPE: KvShape = KvShape { num_layers: 2, num_kv_heads: 2, head_dim: 8, dtype_bytes: 2, block_size: 4 };
const BOUND: Duration = Duration::from_secs(10);

fn secret(text: &str) -> ClusterSecret {
    ClusterSecret::from_text(text).expect("valid secret")
}

/// D's data server under `d_secret`, over the small shape.
async fn side(d_secret: Option<ClusterSecret>) -> Side {
    Side::start(SHAPE, DataServerOptions { secret: d_secret, ..DataServerOptions::default() }).await
}

/// P's engine under `p_secret`.
fn engine(s: &Side, p_secret: Option<ClusterSecret>) -> TcpTransferEngine {
    s.engine(TcpConfig { secret: p_secret, ..TcpConfig::default() })
}

/// The write these tests make: P's blocks 1 and 2 into D's 5 and 6.
async fn write(s: &Side, engine: &TcpTransferEngine) -> Result<(), TransferError> {
    s.write(engine, &s.plan(&[1, 2], &[5, 6])).await
}

fn landed(s: &Side) -> bool {
    s.landed(&[(1, 5), (2, 6)])
}

fn refused_with(result: Result<(), TransferError>, words: &str) {
    match result {
        Err(TransferError::Refused { reason, .. }) => assert!(reason.contains(words), "{reason}"),
        other => panic!("expected a refusal naming {words:?}, got {other:?}"),
    }
}

#[tokio::test]
async fn with_the_same_secret_on_both_sides_the_write_lands() {
    let s = side(Some(secret("the-cluster-secret-0001"))).await;
    write(&s, &engine(&s, Some(secret("the-cluster-secret-0001")))).await.expect("written");
    assert!(landed(&s));
}

#[tokio::test]
async fn a_p_without_the_secret_is_told_to_configure_it_and_writes_nothing() {
    let s = side(Some(secret("the-cluster-secret-0001"))).await;
    refused_with(write(&s, &engine(&s, None)).await, "requires the cluster secret");
    assert!(s.untouched());
}

#[tokio::test]
async fn p_writes_no_kv_to_a_data_server_that_does_not_prove_it_holds_the_secret() {
    let s = side(None).await;
    refused_with(write(&s, &engine(&s, Some(secret("the-cluster-secret-0001")))).await, "did not prove");
    assert!(s.untouched());
}

#[tokio::test]
async fn a_wrong_secret_is_refused_by_both_sides_and_nothing_lands() {
    let s = side(Some(secret("the-cluster-secret-0001"))).await;
    let before = data_refusals("unknown_key");
    refused_with(write(&s, &engine(&s, Some(secret("another-secret-9999")))).await, "key this side does not hold");
    assert!(s.untouched());
    assert!(data_refusals("unknown_key") > before, "P counted the refusal");
}

/// A rotation: every peer first accepts the new key (second line), then signs with it (first
/// line), then drops the old one. Mid-way, a P still signing with the old key and a D already
/// signing with the new one each verify the other.
#[tokio::test]
async fn mid_rotation_peers_signing_with_different_keys_still_write() {
    let s = side(Some(secret("new-cluster-secret-0002\nold-cluster-secret-0001"))).await;
    let p = secret("old-cluster-secret-0001\nnew-cluster-secret-0002");
    write(&s, &engine(&s, Some(p))).await.expect("written");
    assert!(landed(&s));
    // A P that never learnt the new key cannot check D's proof: no KV goes out.
    let stale = engine(&s, Some(secret("old-cluster-secret-0001")));
    refused_with(write(&s, &stale).await, "key this side does not hold");
}

/// An attacker without the secret: it answers D's challenge with a proof it made up, or with
/// the proof a real P gave on another connection; D refuses it and reads nothing after.
#[tokio::test]
async fn a_forged_or_replayed_proof_is_refused_and_the_batch_after_it_never_lands() {
    let key = secret("the-cluster-secret-0001");
    let s = side(Some(key.clone())).await;
    // A real P's proof on one connection, captured off the wire.
    let p_nonce = pdflow_auth::nonce();
    let mut captured = None;
    let (ack, _) = handshake(&s.peer, &p_nonce, |d_nonce| {
        let proof = key.sign(pdflow_auth::Context::DataClient, &[d_nonce, &p_nonce]);
        captured = Some(proof);
        proof
    })
    .await;
    assert_eq!(ack, Ack::Ok { batch_id: 0 }, "the real proof passes");
    let replay = captured.expect("a proof was sent");
    for (what, proof) in [("forged", pdflow_auth::Proof { key_id: key.key_id(), mac: [7u8; 32] }), ("replayed", replay)]
    {
        let (ack, mut stream) = handshake(&s.peer, &p_nonce, |_| proof).await;
        assert!(matches!(&ack, Ack::Refused { reason, .. } if reason.contains("does not match")), "{what}: {ack:?}");
        // The batch an attacker sends anyway: D closed the connection; nothing lands.
        let plan = s.plan(&[1, 2], &[5, 6]);
        let header = wire::encode_batch_header(1, &plan.descriptors).expect("header");
        let _ = stream.write_all(&header).await;
        let _ = stream.write_all(&vec![0xAB; plan.total_bytes() as usize]).await;
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(BOUND, stream.read_to_end(&mut rest)).await.expect("D closes");
    }
    assert!(s.untouched(), "no byte of a refused connection touched D's memory");
}

/// Hello with `p_nonce`, D's challenge, `proof(d_nonce)` as P's answer; D's verdict.
async fn handshake(
    peer: &str,
    p_nonce: &pdflow_auth::Nonce,
    proof: impl FnOnce(&pdflow_auth::Nonce) -> pdflow_auth::Proof,
) -> (Ack, TcpStream) {
    let mut stream = TcpStream::connect(peer).await.expect("connects");
    stream.write_all(&wire::encode_hello_with(None, p_nonce).expect("hello")).await.expect("sends");
    let HelloAnswer::Challenge { nonce, .. } = wire::read_hello_answer(&mut stream).await.expect("answer") else {
        panic!("D holds the secret: it must challenge")
    };
    stream.write_all(&wire::encode_proof(&proof(&nonce))).await.expect("sends the proof");
    let ack = tokio::time::timeout(BOUND, wire::read_ack(&mut stream)).await.expect("bounded").expect("an ack");
    (ack, stream)
}
