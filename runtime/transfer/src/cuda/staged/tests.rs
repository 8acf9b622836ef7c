//! Tests of the staged path. Chunking, splitting, the wire format and D's region check are
//! CPU-only and run everywhere; the round trip through a real TCP socket on 127.0.0.1 (P on GPU 0,
//! D on GPU 1 when there are two) needs a GPU and skips, saying why, otherwise. It needs no NVRTC.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::result;
use pdflow_messages::layout::RegionDesc;

use super::receiver::check_destinations;
use super::wire::{self, Reply, WireError};
use super::*;
use crate::cuda::{checksum_words, device_count, plan_checksum, DeviceBuffer, CHECKSUM_BASIS};
use crate::{TransferEngine, TransferError};
use pdflow_kv::planner::{build_plan, TransferPlan};

fn d(src: u64, dst: u64, len: u64) -> Descriptor {
    Descriptor { src, dst, len }
}

#[test]
fn chunks_cut_across_descriptors_and_cover_every_byte_once() {
    let chunks = chunk_pieces([(0x1000, 300), (0x9000, 50), (0x20000, 700)], 256);
    assert_eq!(chunks.len(), 5, "1,050 bytes in chunks of 256");
    assert_eq!(chunks[0], vec![Piece { addr: 0x1000, offset: 0, len: 256 }]);
    assert_eq!(
        chunks[1],
        vec![
            Piece { addr: 0x1100, offset: 0, len: 44 },
            Piece { addr: 0x9000, offset: 44, len: 50 },
            Piece { addr: 0x20000, offset: 94, len: 162 }
        ]
    );
    assert_eq!(chunks.iter().map(|c| chunk_len(c)).collect::<Vec<_>>(), vec![256, 256, 256, 256, 26]);
    let mut covered: Vec<(u64, u64)> = chunks.iter().flatten().map(|p| (p.addr, p.len)).collect();
    covered.sort();
    let bytes: u64 = covered.iter().map(|c| c.1).sum();
    assert_eq!(bytes, 1050);
    assert!(chunk_pieces([(0x1000, 0)], 256).is_empty());
}

#[test]
fn a_plan_splits_into_parts_of_nearly_equal_bytes_on_4k_cuts() {
    let plan = [d(0, 0x100000, 3 * 4096), d(0x10000, 0x200000, 5 * 4096), d(0x40000, 0x300000, 4096)];
    let parts = split_parts(&plan, 3);
    assert_eq!(parts.len(), 3);
    assert_eq!(parts[0], vec![d(0, 0x100000, 3 * 4096)]);
    assert_eq!(parts[1], vec![d(0x10000, 0x200000, 3 * 4096)]);
    assert_eq!(parts[2], vec![d(0x13000, 0x203000, 2 * 4096), d(0x40000, 0x300000, 4096)]);
    let total = |ps: &[Vec<Descriptor>]| ps.iter().flatten().map(|d| d.len).sum::<u64>();
    assert_eq!(total(&split_parts(&plan, 7)), 9 * 4096);
    assert!(split_parts(&plan, 7).len() <= 7);
    assert_eq!(split_parts(&plan, 1), vec![plan.to_vec()]);
    assert!(split_parts(&[], 4).is_empty());
}

#[test]
fn requests_and_replies_survive_the_wire_and_bad_input_is_refused() {
    let plan = [d(1, 0xdead_beef_0000, 4096), d(2, 0x10, 1)];
    let request = wire::encode_request(b"secret", 77, &plan, None).expect("encodes");
    assert!(request.nonce.is_none(), "no secret, no seal");
    let bytes = request.bytes;
    let back = wire::read_request(&mut &bytes[..]).expect("reads").expect("a request");
    assert_eq!(
        back,
        wire::Offer {
            auth: b"secret".to_vec(),
            fence: 77,
            ranges: vec![(0xdead_beef_0000, 4096), (0x10, 1)],
            seal: Vec::new()
        }
    );
    assert!(matches!(wire::encode_request(&[b'x'; 1025], 1, &plan, None), Err(WireError::TokenTooLong(1025))));
    let mut long_token = bytes[..6].to_vec();
    long_token.extend_from_slice(&(wire::MAX_TOKEN + 1).to_le_bytes());
    assert!(
        matches!(wire::read_request(&mut &long_token[..]), Err(WireError::TokenTooLong(_))),
        "an oversize token is refused before it is read"
    );
    let bytes = wire::encode_request(b"", 77, &plan, None).expect("encodes").bytes;
    assert!(wire::read_request(&mut &[][..]).expect("clean end").is_none());
    assert!(matches!(wire::read_request(&mut &b"HTTP/1.1"[..]), Err(WireError::BadMagic(_))));
    let tls = wire::read_request(&mut &[0x16u8, 0x03, 0x01, 0x00][..]).expect_err("a TLS ClientHello");
    assert!(tls.to_string().contains("set `tls` on both ends"), "{tls}");
    let mut huge = bytes[..16].to_vec();
    huge.extend_from_slice(&(wire::MAX_DESCRIPTORS + 1).to_le_bytes());
    assert!(matches!(wire::read_request(&mut &huge[..]), Err(WireError::TooManyDescriptors(_))));
    assert!(matches!(wire::read_request(&mut &bytes[..bytes.len() - 3]), Err(WireError::Io(_))), "truncated");
    let mut odd_seal = bytes.clone();
    *odd_seal.last_mut().expect("the seal's length") = 7;
    assert!(matches!(wire::read_request(&mut &odd_seal[..]), Err(WireError::BadSeal(7))));
    for reply in [
        Reply::Accepted,
        Reply::AcceptedSealed([7; 40]),
        Reply::Refused("no".into()),
        Reply::Done,
        Reply::Failed("cuda".into()),
    ] {
        let mut out = Vec::new();
        wire::write_reply(&mut out, &reply).expect("writes");
        assert_eq!(wire::read_reply(&mut &out[..]).expect("reads"), reply);
    }
    assert!(matches!(wire::read_reply(&mut &[9u8][..]), Err(WireError::BadStatus(9))));
    assert!(wire::read_go(&mut &[wire::GO][..]).expect("go"));
    assert!(!wire::read_go(&mut &[wire::ABORT][..]).expect("abort"));
}

#[test]
fn a_sealed_request_opens_only_unaltered_under_the_secret_and_its_acceptance_only_for_it() {
    let key = pdflow_auth::ClusterSecret::from_text("staged-cluster-secret-01").expect("a secret");
    let stranger = pdflow_auth::ClusterSecret::from_text("not-the-cluster-secret").expect("a secret");
    let guard = pdflow_auth::ReplayGuard::new(Duration::from_secs(30));
    let plan = [d(1, 0x4000, 4096)];
    let request = wire::encode_request(b"", 9, &plan, Some(&key)).expect("encodes");
    let nonce = request.nonce.expect("a sealed request carries its nonce");
    let offer = wire::read_request(&mut &request.bytes[..]).expect("reads").expect("a request");
    let open = |offer: &wire::Offer, secret: &pdflow_auth::ClusterSecret| {
        pdflow_auth::sealed::STAGED.open_request(secret, &offer.sealed_bytes(), &offer.seal, &guard)
    };
    assert_eq!(open(&offer, &stranger), Err(pdflow_auth::Refusal::UnknownKey), "another secret");
    let mut moved = offer.clone();
    moved.ranges[0].0 += 4096;
    assert_eq!(open(&moved, &key), Err(pdflow_auth::Refusal::BadProof), "a destination altered");
    let mut refenced = offer.clone();
    refenced.fence = 10;
    assert_eq!(open(&refenced, &key), Err(pdflow_auth::Refusal::BadProof), "another pull's fence");
    assert_eq!(open(&offer, &key), Ok(nonce));
    assert_eq!(open(&offer, &key), Err(pdflow_auth::Refusal::Replayed), "the same request again");
    let Reply::AcceptedSealed(seal) = wire::accept_sealed(&key, &nonce) else { panic!("a sealed acceptance") };
    assert_eq!(wire::open_acceptance(&key, &seal, &nonce), Ok(()));
    assert!(wire::open_acceptance(&key, &seal, &pdflow_auth::nonce()).is_err(), "another request's acceptance");
    let Reply::AcceptedSealed(forged) = wire::accept_sealed(&stranger, &nonce) else { panic!("a sealed acceptance") };
    assert!(wire::open_acceptance(&key, &forged, &nonce).is_err(), "a D without the secret");
}

#[test]
fn destinations_outside_ds_regions_are_refused() {
    let regions = [
        RegionDesc { base_addr: 0x10000, len: 0x4000, block_len: 0x1000 },
        RegionDesc { base_addr: 0x20000, len: 0x4000, block_len: 0x1000 },
    ];
    assert!(check_destinations(&regions, &[(0x10000, 0x4000), (0x21000, 0x1000)]).is_ok());
    let reason =
        check_destinations(&regions, &[(0x10000, 0x1000), (0x13000, 0x2000)]).expect_err("crosses the end of region 0");
    assert!(reason.starts_with("descriptor 1:"), "{reason}");
    assert!(check_destinations(&regions, &[(u64::MAX - 4, 0x1000)]).is_err(), "overflow");
}

/// 4 regions × 32 blocks × 4 KiB, as the IPC tests.
pub(super) fn regions_at(base: u64) -> Vec<RegionDesc> {
    (0..4).map(|i| RegionDesc { base_addr: base + i * 32 * 4096, len: 32 * 4096, block_len: 4096 }).collect()
}

const BYTES: usize = 4 * 32 * 4096;

/// P's and D's device memory (GPU 0 and GPU 1, or GPU 0 twice), P's holding `pattern(i)` at byte
/// `i` and D's zeroed; `None` after saying why the test skips.
pub(super) fn two_sides(
    pattern: impl Fn(usize) -> u8,
) -> Option<(Arc<CudaContext>, Arc<CudaContext>, DeviceBuffer, DeviceBuffer)> {
    let n = match device_count() {
        Ok(n) => n,
        Err(e) => {
            pdflow_testkit::skipped("cuda staged test", &e);
            return None;
        }
    };
    let ctx_p = CudaContext::new(0).expect("GPU 0");
    let ctx_d = CudaContext::new(if n >= 2 { 1 } else { 0 }).expect("D's GPU");
    let p_mem = DeviceBuffer::new(&ctx_p, BYTES).expect("alloc P");
    let d_mem = DeviceBuffer::new(&ctx_d, BYTES).expect("alloc D");
    d_mem.fill(0).expect("zero D");
    let bytes: Vec<u8> = (0..BYTES).map(pattern).collect();
    ctx_p.bind_to_thread().expect("bind");
    // SAFETY: `p_mem` holds BYTES bytes.
    unsafe { result::memcpy_htod_sync(p_mem.ptr, &bytes[..]) }.expect("upload the pattern");
    Some((ctx_p, ctx_d, p_mem, d_mem))
}

#[test]
fn staged_round_trip_through_loopback_tcp() {
    let Some((ctx_p, ctx_d, p_mem, d_mem)) = two_sides(|i| (i as u64).wrapping_mul(0x9e37_79b9).to_le_bytes()[2])
    else {
        return;
    };
    let (p_regions, d_regions) = (regions_at(p_mem.ptr), regions_at(d_mem.ptr));

    // Small chunks and a shallow ring, so that buffers are reused many times within one part.
    let config = StagedConfig {
        chunk_bytes: 12 * 1024,
        depth: 2,
        streams: 3,
        deadline: Duration::from_secs(20),
        ..StagedConfig::default()
    };
    let receiver = StagedReceiver::bind(
        &ctx_d,
        d_regions.clone(),
        "127.0.0.1:0",
        StagedConfig { chunk_bytes: 20 * 1024, ..config },
    )
    .expect("D listens");
    let peer = receiver.local_addr().to_string();
    let sender = Arc::new(StagedSender::new(&ctx_p, p_regions.clone(), config));

    let plan = build_plan(&p_regions, &[1, 2, 3, 9, 30, 31], &d_regions, &[20, 21, 22, 4, 0, 7], true).expect("plan");
    let zeros = |plan: &TransferPlan| {
        plan.descriptors.iter().fold(CHECKSUM_BASIS, |h, d| checksum_words(h, &vec![0u8; d.len as usize]))
    };
    let expected = plan_checksum(&ctx_p, &plan, true).expect("source checksum");
    assert_ne!(expected, zeros(&plan), "the pattern is not all zeros");

    // One descriptor past D's last region refuses the whole plan, across all three connections.
    let mut bad = plan.clone();
    let last = d_regions[3];
    bad.descriptors.push(d(p_mem.ptr, last.base_addr + last.len - 8, 4096));
    assert!(matches!(sender.write(&peer, &bad), Err(StagedError::Refused { .. })));
    assert_eq!(plan_checksum(&ctx_d, &plan, false).expect("D checksum"), zeros(&plan), "a refused plan wrote bytes");
    // A source outside P's regions is refused by P before anything is sent.
    let mut bad_src = plan.clone();
    bad_src.descriptors[0].src = p_mem.ptr + BYTES as u64;
    assert!(matches!(sender.write(&peer, &bad_src), Err(StagedError::SourceOutOfRegion { index: 0, .. })));

    // The pooled connections are still in step after the refusal.
    let stats = sender.write(&peer, &plan).expect("write");
    assert_eq!((stats.bytes, stats.descriptors), (plan.total_bytes(), plan.descriptors.len()));
    assert_eq!(plan_checksum(&ctx_d, &plan, false).expect("D checksum"), expected, "D's bytes differ from P's");

    // Through the TransferEngine trait.
    d_mem.fill(0).expect("zero D");
    let engine = StagedEngine(sender.clone());
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
    let stats = rt.block_on(engine.write(&peer, &plan)).expect("engine write");
    assert_eq!(stats.bytes, plan.total_bytes());
    assert_eq!(plan_checksum(&ctx_d, &plan, false).expect("D checksum"), expected);
    assert_eq!(engine.backend_for(&peer), "cuda-staged");
    assert!(matches!(rt.block_on(engine.write(&peer, &bad)), Err(TransferError::Refused { .. })));

    drop(receiver);
    assert!(matches!(rt.block_on(engine.write("127.0.0.1:1", &plan)), Err(TransferError::Connect { .. })));
}

#[test]
fn a_fenced_receiver_takes_a_part_only_under_an_open_token() {
    let Some((ctx_p, ctx_d, p_mem, d_mem)) = two_sides(|i| (i as u64 * 7 + 3) as u8) else { return };
    let (p_regions, d_regions) = (regions_at(p_mem.ptr), regions_at(d_mem.ptr));
    let config = small_config();
    let fence = crate::fence::WriteFence::new();
    let receiver = StagedReceiver::bind_fenced(&ctx_d, d_regions.clone(), "127.0.0.1:0", config, Some(fence.clone()))
        .expect("D listens");
    let peer = receiver.local_addr().to_string();
    let sender = StagedSender::new(&ctx_p, p_regions.clone(), config);
    let plan =
        TransferPlan { fence: 5, ..build_plan(&p_regions, &[1, 2, 3], &d_regions, &[10, 11, 12], true).expect("plan") };
    let zeros = plan.descriptors.iter().fold(CHECKSUM_BASIS, |h, d| checksum_words(h, &vec![0u8; d.len as usize]));

    // Never opened: refused whole, nothing lands.
    let err = sender.write(&peer, &plan).expect_err("fence 5 is not open");
    assert!(matches!(&err, StagedError::Refused { reason, .. } if reason.contains("fence 5")), "{err:?}");
    assert_eq!(plan_checksum(&ctx_d, &plan, false).expect("D checksum"), zeros, "a refused part landed");
    // Open: it lands, and the fence is free again after it.
    fence.open(5);
    sender.write(&peer, &plan).expect("write under an open fence");
    assert_landed(&ctx_p, &ctx_d, &plan, "a write under an open fence");
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
    rt.block_on(fence.close(5, Duration::from_secs(2))).expect("no part left in flight");
    // Closed: a late write for the ended pull is refused.
    d_mem.fill(0).expect("zero D");
    assert!(matches!(sender.write(&peer, &plan), Err(StagedError::Refused { .. })));
    assert_eq!(plan_checksum(&ctx_d, &plan, false).expect("D checksum"), zeros, "a write after the pull ended landed");
}

#[test]
fn a_receiver_lends_its_prepinned_rings_to_connections_and_takes_them_back() {
    let Some((ctx_p, ctx_d, p_mem, d_mem)) = two_sides(|i| (i as u64 * 5 + 2) as u8) else { return };
    let (p_regions, d_regions) = (regions_at(p_mem.ptr), regions_at(d_mem.ptr));
    let config = small_config();
    let receiver = StagedReceiver::bind(&ctx_d, d_regions.clone(), "127.0.0.1:0", config).expect("D listens");
    receiver.prepin(3).expect("pins three rings");
    assert_eq!(receiver.spare_rings(), 3);
    let spare_within = |n: usize| within(&format!("{n} spare rings"), || receiver.spare_rings() == n);
    let plan = build_plan(&p_regions, &[1, 2, 3, 4], &d_regions, &[5, 6, 7, 8], true).expect("plan");
    let sender = StagedSender::new(&ctx_p, p_regions.clone(), config);
    sender.write(&receiver.local_addr().to_string(), &plan).expect("write");
    assert_landed(&ctx_p, &ctx_d, &plan, "bytes through lent rings");
    spare_within(1); // two connections hold one ring each
    drop(sender); // P's connections close: their rings come back
    spare_within(3);
    receiver.prepin(100).expect("pins up to the cap");
    assert_eq!(receiver.spare_rings(), MAX_SPARE_RINGS);
}

#[test]
fn a_sender_keeps_the_rings_of_dropped_connections_for_the_next_ones() {
    let Some((ctx_p, ctx_d, p_mem, d_mem)) = two_sides(|i| (i as u64 * 11 + 4) as u8) else { return };
    let (p_regions, d_regions) = (regions_at(p_mem.ptr), regions_at(d_mem.ptr));
    let config = small_config();
    let receiver = StagedReceiver::bind(&ctx_d, d_regions.clone(), "127.0.0.1:0", config).expect("D listens");
    let peer = receiver.local_addr().to_string();
    let sender = StagedSender::new(&ctx_p, p_regions.clone(), config);
    sender.prepin(2).expect("pins two rings");
    let plan = build_plan(&p_regions, &[9, 10, 11], &d_regions, &[1, 2, 3], true).expect("plan");
    sender.write(&peer, &plan).expect("write");
    assert_eq!(sender.spare_rings(), 0, "both connections took a prepinned ring");
    sender.forget_peer(&peer); // D moved: the connections go, their rings stay
    assert_eq!(sender.spare_rings(), 2);
    d_mem.fill(0).expect("zero D");
    sender.write(&peer, &plan).expect("write over new connections with the kept rings");
    assert_landed(&ctx_p, &ctx_d, &plan, "a write over new connections with the kept rings");
    assert_eq!(sender.spare_rings(), 0);
}

/// 16 KiB chunks, two buffers, two streams: each part reuses its buffers many times.
pub(super) fn small_config() -> StagedConfig {
    StagedConfig {
        chunk_bytes: 16 * 1024,
        depth: 2,
        streams: 2,
        deadline: Duration::from_secs(20),
        ..StagedConfig::default()
    }
}

/// D's bytes under `plan`'s destinations equal P's under its sources.
pub(super) fn assert_landed(ctx_p: &Arc<CudaContext>, ctx_d: &Arc<CudaContext>, plan: &TransferPlan, what: &str) {
    assert_eq!(
        plan_checksum(ctx_d, plan, false).expect("D checksum"),
        plan_checksum(ctx_p, plan, true).expect("P checksum"),
        "{what}: D's bytes differ from P's"
    );
}

/// Waits (bounded) until `f` holds; `what` names it when it never does.
pub(super) fn within(what: &str, f: impl Fn() -> bool) {
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(std::time::Instant::now() < until, "{what}: not within 10 s");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn d_closes_idle_connections_and_p_writes_over_new_ones_instead_of_failing() {
    let Some((ctx_p, ctx_d, p_mem, d_mem)) = two_sides(|i| (i as u64 * 17 + 9) as u8) else { return };
    let (p_regions, d_regions) = (regions_at(p_mem.ptr), regions_at(d_mem.ptr));
    let base = small_config();
    // D lets idle connections go after 100 ms; P would keep reusing them for a minute.
    let receiver = StagedReceiver::bind(
        &ctx_d,
        d_regions.clone(),
        "127.0.0.1:0",
        StagedConfig { idle_close: Duration::from_millis(100), ..base },
    )
    .expect("D listens");
    let peer = receiver.local_addr().to_string();
    let sender = StagedSender::new(&ctx_p, p_regions.clone(), base);
    let plan = build_plan(&p_regions, &[3, 4, 5], &d_regions, &[6, 7, 8], true).expect("plan");
    sender.write(&peer, &plan).expect("first write");
    assert_eq!(sender.pooled(&peer), 2);
    within("D closes both idle connections", || receiver.live_connections() == 0);
    d_mem.fill(0).expect("zero D");
    sender.write(&peer, &plan).expect("a write after D closed the pooled connections");
    assert_landed(&ctx_p, &ctx_d, &plan, "bytes over the new connections");
    assert_eq!(sender.pooled(&peer), 2, "the stale connections were replaced, not added to");
    // D's receiver restarts at the same address (now without an idle close): P's pooled
    // connections to the old one are seen closed; warm() replaces them, and the write uses those.
    drop(receiver);
    let receiver =
        StagedReceiver::bind(&ctx_d, d_regions.clone(), &peer, base).expect("D listens again at the same address");
    sender.warm(&peer).expect("warm");
    within("D serves the two warmed connections", || receiver.live_connections() == 2);
    assert_eq!(sender.pooled(&peer), 2, "warm replaced the closed connections, not added to them");
    d_mem.fill(0).expect("zero D");
    sender.write(&peer, &plan).expect("a write after D's receiver restarted");
    assert_landed(&ctx_p, &ctx_d, &plan, "bytes through the restarted receiver");
    assert_eq!(receiver.live_connections(), 2, "the write went over the warmed connections");
}

#[test]
fn p_drops_connections_idle_past_its_pool_limit_and_d_lets_their_threads_go() {
    let Some((ctx_p, ctx_d, p_mem, d_mem)) = two_sides(|i| (i as u64 * 19 + 5) as u8) else { return };
    let (p_regions, d_regions) = (regions_at(p_mem.ptr), regions_at(d_mem.ptr));
    let base = small_config();
    let receiver = StagedReceiver::bind(&ctx_d, d_regions.clone(), "127.0.0.1:0", base).expect("D listens");
    receiver.prepin(2).expect("pins two rings");
    let peer = receiver.local_addr().to_string();
    let sender =
        StagedSender::new(&ctx_p, p_regions.clone(), StagedConfig { pool_idle: Duration::from_millis(20), ..base });
    let plan = build_plan(&p_regions, &[1, 2], &d_regions, &[3, 4], true).expect("plan");
    for round in 0..3 {
        d_mem.fill(0).expect("zero D");
        sender.write(&peer, &plan).unwrap_or_else(|e| panic!("write {round}: {e}"));
        assert_landed(&ctx_p, &ctx_d, &plan, &format!("round {round}"));
        std::thread::sleep(Duration::from_millis(60));
    }
    // Each write opened two connections and dropped the two before: D serves only the last two
    // (the threads of the others ended).
    within("D serves only the last pair", || receiver.live_connections() == 2);
    drop(sender);
    within("D lets every connection go", || receiver.live_connections() == 0);
    // Every ring came back: at least the two pinned ahead are spare again.
    within("D's rings are back", || receiver.spare_rings() >= 2);
}

#[test]
fn a_receiver_at_its_connection_limit_closes_one_more_at_once() {
    use std::io::Read as _;
    let Some((ctx_p, ctx_d, p_mem, d_mem)) = two_sides(|i| (i as u64 * 23 + 7) as u8) else { return };
    let (p_regions, d_regions) = (regions_at(p_mem.ptr), regions_at(d_mem.ptr));
    let receiver = StagedReceiver::bind(
        &ctx_d,
        d_regions.clone(),
        "127.0.0.1:0",
        StagedConfig { max_connections: 2, ..small_config() },
    )
    .expect("D listens");
    let peer = receiver.local_addr().to_string();
    let sender = StagedSender::new(&ctx_p, p_regions.clone(), small_config());
    let plan = build_plan(&p_regions, &[2, 3], &d_regions, &[4, 5], true).expect("plan");
    sender.write(&peer, &plan).expect("a write over the two connections the limit allows");
    within("D serves both", || receiver.live_connections() == 2);
    // One more is closed as soon as it is accepted.
    let mut third = std::net::TcpStream::connect(&peer).expect("the kernel still accepts it");
    third.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut rest = Vec::new();
    let read = third.read_to_end(&mut rest);
    assert!(
        matches!(&read, Ok(0)) || matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "the connection over the limit was not closed: {read:?}"
    );
    assert_eq!(receiver.live_connections(), 2, "the served connections are untouched");
    // The pooled two still carry writes.
    d_mem.fill(0).expect("zero D");
    sender.write(&peer, &plan).expect("a write over the pooled connections");
    assert_landed(&ctx_p, &ctx_d, &plan, "a write over the pooled connections");
}
