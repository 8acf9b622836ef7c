//! The data channel under the cluster secret, over real sockets: P writes only to a data server
//! that proves it holds the secret, D takes bytes only from a P that proves it, proofs are bound
//! to both sides' fresh nonces (a replayed one fails), and a refused write leaves D's memory as it
//! was.

use std::sync::Arc;
use std::time::Duration;

use pdflow_auth::ClusterSecret;
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_kv::planner::{build_plan, TransferPlan};
use pdflow_messages::BlockId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::wire::{self, Ack, HelloAnswer};
use super::{DataServerOptions, TcpConfig, TcpDataServer, TcpTransferEngine};
use crate::{TransferEngine, TransferError};

const SHAPE: KvShape = KvShape { num_layers: 2, num_kv_heads: 2, head_dim: 8, dtype_bytes: 2, block_size: 4 };
const BOUND: Duration = Duration::from_secs(10);

fn secret(text: &str) -> ClusterSecret {
    ClusterSecret::from_text(text).expect("valid secret")
}

/// A cache of `shape` whose every slot holds bytes that differ by layer, block, head and slot.
pub(super) fn filled_with(shape: KvShape, num_blocks: usize) -> Arc<KvCache> {
    let cache = KvCache::new(shape, num_blocks);
    for layer in 0..shape.num_layers {
        for block in 0..num_blocks {
            for head in 0..shape.num_kv_heads {
                for slot in 0..shape.block_size {
                    let bytes: Vec<u8> = (0..shape.slot_len())
                        .map(|i| (1 + layer * 31 + block * 17 + head * 7 + slot * 3 + i) as u8)
                        .collect();
                    cache.write_slot(layer, block as BlockId, head, slot, &bytes).expect("in range");
                }
            }
        }
    }
    cache
}

struct Side {
    src: Arc<KvCache>,
    dst: Arc<KvCache>,
    _server: TcpDataServer,
    peer: String,
}

async fn side(d_secret: Option<ClusterSecret>) -> Side {
    let (src, dst) = (filled_with(SHAPE, 8), KvCache::new(SHAPE, 8));
    let options = DataServerOptions { secret: d_secret, ..DataServerOptions::default() };
    let server = TcpDataServer::bind_options("127.0.0.1:0".parse().expect("address"), dst.region_table(), options)
        .await
        .expect("binds");
    let peer = server.local_addr().to_string();
    Side { src, dst, _server: server, peer }
}

impl Side {
    fn engine(&self, p_secret: Option<ClusterSecret>) -> TcpTransferEngine {
        TcpTransferEngine::new(self.src.region_table(), TcpConfig { secret: p_secret, ..TcpConfig::default() })
    }

    fn plan(&self) -> TransferPlan {
        build_plan(&self.src.regions(), &[1, 2], &self.dst.regions(), &[5, 6], true).expect("plannable")
    }

    fn landed(&self) -> bool {
        [(1, 5), (2, 6)].iter().all(|&(s, d)| self.src.block_bytes(s).ok() == self.dst.block_bytes(d).ok())
    }

    fn untouched(&self) -> bool {
        (0..8).all(|b| self.dst.block_bytes(b).expect("block").iter().all(|&x| x == 0))
    }

    async fn write(&self, engine: &TcpTransferEngine) -> Result<(), TransferError> {
        tokio::time::timeout(BOUND, engine.write(&self.peer, &self.plan())).await.expect("bounded").map(|_| ())
    }
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
    s.write(&s.engine(Some(secret("the-cluster-secret-0001")))).await.expect("written");
    assert!(s.landed());
}

#[tokio::test]
async fn a_p_without_the_secret_is_told_to_configure_it_and_writes_nothing() {
    let s = side(Some(secret("the-cluster-secret-0001"))).await;
    refused_with(s.write(&s.engine(None)).await, "requires the cluster secret");
    assert!(s.untouched());
}

#[tokio::test]
async fn p_writes_no_kv_to_a_data_server_that_does_not_prove_it_holds_the_secret() {
    let s = side(None).await;
    refused_with(s.write(&s.engine(Some(secret("the-cluster-secret-0001")))).await, "did not prove");
    assert!(s.untouched());
}

#[tokio::test]
async fn a_wrong_secret_is_refused_by_both_sides_and_nothing_lands() {
    let s = side(Some(secret("the-cluster-secret-0001"))).await;
    let before = data_refusals("unknown_key");
    refused_with(s.write(&s.engine(Some(secret("another-secret-9999")))).await, "key this side does not hold");
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
    s.write(&s.engine(Some(p))).await.expect("written");
    assert!(s.landed());
    // A P that never learnt the new key cannot check D's proof: no KV goes out.
    let stale = s.engine(Some(secret("old-cluster-secret-0001")));
    refused_with(s.write(&stale).await, "key this side does not hold");
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
        let plan = s.plan();
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

/// `pdflow_auth_refusals_total{socket="data",cause}` in this process's registry.
pub(super) fn data_refusals(cause: &str) -> f64 {
    let series = format!("pdflow_auth_refusals_total{{socket=\"data\",cause=\"{cause}\"}} ");
    let text = pdflow_telemetry::metrics::global().render();
    text.lines().find_map(|l| l.strip_prefix(series.as_str())).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
}
