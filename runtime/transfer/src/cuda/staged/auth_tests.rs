//! The staged path's proofs on a GPU (each test skips, saying why, without one): D's receiver
//! under the auth token, under the cluster secret (sealed requests, sealed acceptances, replays)
//! and with TLS. In every refusal nothing lands in D's memory, the refusal is counted, and the
//! pooled connections stay usable.

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use pdflow_auth::{ClusterSecret, TlsIdentity};
use pdflow_kv::planner::{build_plan, TransferPlan};
use pdflow_messages::layout::RegionDesc;

use super::tests::{assert_landed, regions_at, small_config, two_sides};
use super::wire::{self, Reply};
use super::*;
use crate::cuda::{checksum_words, plan_checksum, CHECKSUM_BASIS};
use crate::tcp::test_side::data_refusals;
use crate::{TransferEngine, TransferError};

const KEY: &str = "staged-cluster-secret-01";
const STRANGER: &str = "not-the-cluster-secret";

/// The proofs of one end: `token`, the secret `key` (if any), TLS with it when `tls`.
fn auth(token: Option<&str>, key: Option<&str>, tls: bool) -> StagedAuth {
    let secret = key.map(|k| ClusterSecret::from_text(k).expect("valid secret"));
    let tls = secret.as_ref().filter(|_| tls).map(|s| TlsIdentity::from_secret(s).expect("identity"));
    StagedAuth { token: token.map(str::to_string), secret, tls, insecure: false }
}

/// D's receiver over `d_regions` (the small test shape, no fence) requiring `auth`.
fn guarded_receiver(ctx_d: &Arc<CudaContext>, d_regions: &[RegionDesc], auth: StagedAuth) -> StagedReceiver {
    StagedReceiver::bind_guarded(ctx_d, d_regions.to_vec(), "127.0.0.1:0", small_config(), None, auth)
        .expect("D listens")
}

/// The checksum of `plan`'s destinations when D's memory is all zeros.
fn zeros(plan: &TransferPlan) -> u64 {
    plan.descriptors.iter().fold(CHECKSUM_BASIS, |h, d| checksum_words(h, &vec![0u8; d.len as usize]))
}

#[test]
fn a_receiver_with_an_auth_token_takes_only_requests_that_present_it() {
    let Some((ctx_p, ctx_d, p_mem, d_mem)) = two_sides(|i| (i as u64 * 13 + 1) as u8) else { return };
    let (p_regions, d_regions) = (regions_at(p_mem.ptr), regions_at(d_mem.ptr));
    let config = small_config();
    let d_auth = auth(Some("s3cret"), None, false);
    let receiver = guarded_receiver(&ctx_d, &d_regions, d_auth);
    let peer = receiver.local_addr().to_string();
    let plan = build_plan(&p_regions, &[4, 5], &d_regions, &[8, 9], true).expect("plan");
    for token in [None, Some("wrong")] {
        let sender = StagedSender::new(&ctx_p, p_regions.clone(), config).with_auth(auth(token, None, false));
        // Twice: the second goes over the pooled connections, which the refusal left in step.
        for attempt in 0..2 {
            let err = sender.write(&peer, &plan).expect_err("no or a wrong token");
            assert!(
                matches!(&err, StagedError::Refused { reason, .. } if reason.contains("auth token")),
                "{token:?}, attempt {attempt}: {err:?}"
            );
        }
        assert_eq!(
            plan_checksum(&ctx_d, &plan, false).expect("D checksum"),
            zeros(&plan),
            "an unauthorised part landed"
        );
    }
    let sender = StagedSender::new(&ctx_p, p_regions.clone(), config).with_auth(auth(Some("s3cret"), None, false));
    sender.write(&peer, &plan).expect("the right token");
    assert_landed(&ctx_p, &ctx_d, &plan, "a write with the right token");
}

#[test]
fn under_the_secret_only_a_sealed_request_lands_and_p_sends_nothing_to_a_d_without_it() {
    let Some((ctx_p, ctx_d, p_mem, d_mem)) = two_sides(|i| (i as u64 * 29 + 5) as u8) else { return };
    let (p_regions, d_regions) = (regions_at(p_mem.ptr), regions_at(d_mem.ptr));
    let config = small_config();
    let receiver = guarded_receiver(&ctx_d, &d_regions, auth(None, Some(KEY), false));
    let peer = receiver.local_addr().to_string();
    let plan = build_plan(&p_regions, &[1, 2, 3], &d_regions, &[10, 11, 12], true).expect("plan");

    for (p_key, cause) in [(None, "missing"), (Some(STRANGER), "unknown_key")] {
        let before = data_refusals(cause);
        let sender = StagedSender::new(&ctx_p, p_regions.clone(), config).with_auth(auth(None, p_key, false));
        for attempt in 0..2 {
            let err = sender.write(&peer, &plan).expect_err("no seal, or a stranger's");
            assert!(
                matches!(&err, StagedError::Refused { reason, .. } if reason.contains("cluster secret")),
                "{p_key:?}, attempt {attempt}: {err:?}"
            );
        }
        assert!(data_refusals(cause) > before, "{cause} refusals are counted");
        assert_eq!(plan_checksum(&ctx_d, &plan, false).expect("D checksum"), zeros(&plan), "a refused part landed");
    }
    let sender = StagedSender::new(&ctx_p, p_regions.clone(), config).with_auth(auth(None, Some(KEY), false));
    sender.write(&peer, &plan).expect("a sealed write");
    sender.write(&peer, &plan).expect("again, over the pooled connections: each request sealed afresh");
    assert_landed(&ctx_p, &ctx_d, &plan, "a sealed write");

    // A receiver without the secret (where a forged pull pointed P): its acceptance proves
    // nothing, so P answers ABORT and sends no payload byte.
    d_mem.fill(0).expect("zero D");
    let stranger = StagedReceiver::bind(&ctx_d, d_regions.clone(), "127.0.0.1:0", config).expect("a stranger listens");
    let before = data_refusals("unproven");
    let err = sender.write(&stranger.local_addr().to_string(), &plan).expect_err("an unproven D");
    assert!(matches!(&err, StagedError::Refused { reason, .. } if reason.contains("did not prove")), "{err:?}");
    assert!(data_refusals("unproven") > before, "counted");
    assert_eq!(plan_checksum(&ctx_d, &plan, false).expect("D checksum"), zeros(&plan), "P sent KV to a stranger");
    sender.write(&peer, &plan).expect("the cluster's D is still written");
    assert_landed(&ctx_p, &ctx_d, &plan, "after refusing a stranger");
}

/// Sends `request` on a new raw connection to `peer`; D's reply.
fn send_raw(peer: &str, request: &[u8]) -> (TcpStream, Reply) {
    let mut tcp = TcpStream::connect(peer).expect("connects");
    tcp.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
    tcp.write_all(request).expect("request");
    let reply = wire::read_reply(&mut tcp).expect("a reply");
    (tcp, reply)
}

#[test]
fn a_replayed_or_altered_sealed_request_is_refused_and_nothing_lands() {
    let Some((_, ctx_d, p_mem, d_mem)) = two_sides(|i| (i as u64 * 3 + 7) as u8) else { return };
    let (p_regions, d_regions) = (regions_at(p_mem.ptr), regions_at(d_mem.ptr));
    let receiver = guarded_receiver(&ctx_d, &d_regions, auth(None, Some(KEY), false));
    let peer = receiver.local_addr().to_string();
    let plan = build_plan(&p_regions, &[6], &d_regions, &[14], true).expect("plan");
    let key = ClusterSecret::from_text(KEY).expect("valid secret");
    let request = wire::encode_request(b"", 0, &plan.descriptors, Some(&key)).expect("encodes");

    // The real request, recorded off the wire: accepted, its payload lands.
    let (mut tcp, reply) = send_raw(&peer, &request.bytes);
    assert!(matches!(reply, Reply::AcceptedSealed(_)), "{reply:?}");
    tcp.write_all(&[wire::GO]).expect("go");
    tcp.write_all(&vec![0xab; plan.total_bytes() as usize]).expect("payload");
    assert_eq!(wire::read_reply(&mut tcp).expect("reply"), Reply::Done);
    assert_ne!(plan_checksum(&ctx_d, &plan, false).expect("D checksum"), zeros(&plan), "the real request landed");

    // The same bytes again, on a new connection: refused before a byte of payload is taken.
    d_mem.fill(0).expect("zero D");
    let before = data_refusals("replayed");
    let (_tcp, reply) = send_raw(&peer, &request.bytes);
    assert!(matches!(&reply, Reply::Refused(r) if r.contains("seen before")), "{reply:?}");
    assert!(data_refusals("replayed") > before, "counted");
    // Altered: another destination under the recorded seal.
    let mut altered = request.bytes.clone();
    let dst_at = 4 + 2 + 2 + 8 + 4; // magic, version, token length (empty token), fence, count
    altered[dst_at + 1] ^= 0x10;
    let (_tcp, reply) = send_raw(&peer, &altered);
    assert!(matches!(&reply, Reply::Refused(r) if r.contains("does not match")), "{reply:?}");
    assert_eq!(plan_checksum(&ctx_d, &plan, false).expect("D checksum"), zeros(&plan), "a replay landed");
}

#[test]
fn with_tls_a_write_lands_and_a_stranger_or_a_plain_p_is_refused() {
    let Some((ctx_p, ctx_d, p_mem, d_mem)) = two_sides(|i| (i as u64 * 11 + 4) as u8) else { return };
    let (p_regions, d_regions) = (regions_at(p_mem.ptr), regions_at(d_mem.ptr));
    let config = small_config();
    let receiver = guarded_receiver(&ctx_d, &d_regions, auth(None, Some(KEY), true));
    let peer = receiver.local_addr().to_string();
    let plan = build_plan(&p_regions, &[1, 2, 3, 4], &d_regions, &[20, 21, 22, 23], true).expect("plan");

    let sender = StagedSender::new(&ctx_p, p_regions.clone(), config).with_auth(auth(None, Some(KEY), true));
    sender.write(&peer, &plan).expect("a write over TLS");
    sender.write(&peer, &plan).expect("again, over the pooled TLS connections");
    assert_eq!(sender.pooled(&peer), config.streams, "the TLS connections are pooled");
    assert_landed(&ctx_p, &ctx_d, &plan, "a write over TLS");

    d_mem.fill(0).expect("zero D");
    let before = data_refusals("bad_proof");
    let stranger = StagedEngine(Arc::new(StagedSender::new(&ctx_p, p_regions.clone(), config).with_auth(auth(
        None,
        Some(STRANGER),
        true,
    ))));
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
    let err = rt.block_on(stranger.write(&peer, &plan)).expect_err("a stranger's certificate");
    assert!(matches!(&err, TransferError::Refused { reason, .. } if reason.starts_with("TLS")), "{err:?}");
    assert!(data_refusals("bad_proof") > before, "counted");
    let plain = StagedSender::new(&ctx_p, p_regions.clone(), config).with_auth(auth(None, Some(KEY), false));
    assert!(plain.write(&peer, &plan).is_err(), "a plain P at a TLS receiver");
    assert_eq!(plan_checksum(&ctx_d, &plan, false).expect("D checksum"), zeros(&plan), "a refused write landed");
    sender.write(&peer, &plan).expect("the cluster's P still writes");
    assert_landed(&ctx_p, &ctx_d, &plan, "after the refusals");
}
