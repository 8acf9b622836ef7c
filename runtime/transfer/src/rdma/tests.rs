//! Tests of the rdma backend on libfabric's software `tcp` provider over 127.0.0.1, run in the
//! registration modes a verbs NIC requires: D's target and P's engine in one process, two KV
//! caches, plans from the planner, D's bytes compared block by block with P's. The `rdm_` tests
//! take the reliable datagram path (`efa`'s) on `tcp;ofi_rxm`. Each test skips, saying why,
//! where libfabric cannot be opened.

use std::sync::Arc;
use std::time::Duration;

use pdflow_auth::ClusterSecret;
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_kv::planner::{build_plan, contiguous_runs, Descriptor, TransferPlan};
use pdflow_messages::rdma::RemoteWriteGrant;
use pdflow_messages::BlockId;

use super::engine::RdmaEngineConfig;
use super::fabric::Domain;
use super::*;
use crate::fence::{RemoteAccess, WriteFence};
use crate::{TransferEngine, TransferError};

const SHAPE: KvShape = KvShape { num_layers: 4, num_kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_size: 16 };
const PROVIDER: &str = "tcp";
/// libfabric's reliable datagram endpoints over the software provider.
const RDM_PROVIDER: &str = "tcp;ofi_rxm";
const HOST: &str = "127.0.0.1";
const P_WORKER: &str = "127.0.0.1:5600";

/// [`provider_opens`] for the software provider's connected endpoints.
fn provider_here() -> Option<()> {
    provider_opens(PROVIDER)
}

/// `None` (after saying why) where `provider` cannot be opened here.
fn provider_opens(provider: &str) -> Option<()> {
    match Domain::open(provider, HOST) {
        Ok(_) => Some(()),
        Err(e) => {
            pdflow_testkit::skipped("rdma backend test", &format!("libfabric's {provider} is unavailable here: {e}"));
            None
        }
    }
}

struct Pair {
    src: Arc<KvCache>,
    dst: Arc<KvCache>,
    target: Arc<RdmaTarget>,
    fence: WriteFence,
    engine: RdmaTransferEngine,
}

fn pair(secrets: (Option<&str>, Option<&str>)) -> Pair {
    pair_on(PROVIDER, secrets)
}

fn pair_on(provider: &str, secrets: (Option<&str>, Option<&str>)) -> Pair {
    let secret = |s: Option<&str>| s.map(|s| ClusterSecret::from_text(s).expect("a valid secret"));
    let src = KvCache::patterned(SHAPE, 32, 1);
    let dst = KvCache::new(SHAPE, 32);
    let target = Arc::new(RdmaTarget::start(provider, HOST, secret(secrets.0)).expect("D's endpoint listens"));
    target.hold_memory(dst.region_table());
    let fence = WriteFence::new().with_remote(target.clone());
    let config = RdmaEngineConfig {
        host: String::new(),
        connect_timeout: Duration::from_secs(3),
        write_timeout: Duration::from_secs(10),
        secret: secret(secrets.1),
    };
    let engine = RdmaTransferEngine::new(src.region_table(), config);
    Pair { src, dst, target, fence, engine }
}

impl Pair {
    /// D's side of a pull: opens `token`, grants the byte runs of `dst_blocks` in every region
    /// (as D's Receiver does), and P's plan carrying the grant.
    fn pull(&self, token: u64, src_blocks: &[BlockId], dst_blocks: &[BlockId]) -> TransferPlan {
        self.fence.open(token);
        let runs = contiguous_runs(dst_blocks, dst_blocks);
        let ranges: Vec<(u64, u64)> = self
            .dst
            .regions()
            .iter()
            .flat_map(|r| runs.iter().map(move |&(s, n)| (r.block_addr(dst_blocks[s]), n as u64 * r.block_len)))
            .collect();
        let regions = self.target.grant(token, P_WORKER, &ranges).expect("D registers the blocks");
        let grant = RemoteWriteGrant { offer: self.target.offer(P_WORKER), regions };
        let plan = build_plan(&self.src.regions(), src_blocks, &self.dst.regions(), dst_blocks, true).expect("plan");
        TransferPlan { fence: token, grant: Some(Arc::new(grant)), ..plan }
    }

    fn assert_copied(&self, src_blocks: &[BlockId], dst_blocks: &[BlockId]) {
        crate::test_blocks::assert_copied(&self.src, &self.dst, src_blocks, dst_blocks);
    }

    fn assert_untouched(&self, dst_blocks: &[BlockId]) {
        crate::test_blocks::assert_untouched(&self.dst, dst_blocks);
    }
}

async fn bounded<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), fut).await.unwrap_or_else(|_| panic!("{what} did not finish"))
}

#[test]
fn the_software_provider_runs_in_a_verbs_nics_registration_modes() {
    let Some(()) = provider_here() else { return };
    let domain = Domain::open(PROVIDER, HOST).expect("opens");
    assert!(
        domain.nic_modes(),
        "mr_mode {:#x} lacks local, virtual-address or provider-key registration",
        domain.mr_mode
    );
    // What shows the provider honours them: keys are the provider's (two registrations that ask
    // for no key get distinct ones; without FI_MR_PROV_KEY the second is refused, -FI_ENOKEY),
    // and the writes of the other tests land at D's virtual addresses (FI_MR_VIRT_ADDR).
    let memory = KvCache::new(SHAPE, 2);
    let region = memory.regions()[0];
    let first = domain.register(region.block_addr(0), region.block_len, ffi::FI_REMOTE_WRITE).expect("registers");
    let second = domain.register(region.block_addr(1), region.block_len, ffi::FI_REMOTE_WRITE).expect("registers");
    assert_ne!(first.key, second.key, "the provider chose the keys");
    let target = RdmaTarget::start(PROVIDER, HOST, None).expect("listens");
    assert!(target.nic_modes());
    assert_eq!(target.provider(), "tcp");
    assert!(!is_hardware(target.provider()), "tcp is the software provider");
    assert!(is_hardware("verbs;ofi_rxm") && is_hardware("efa"));
}

/// A plan lands in the blocks D granted and nowhere else; a clean close revokes the keys and
/// keeps the connection (or datagram endpoint) for the P worker's next pull.
async fn plan_lands_in_the_granted_blocks(provider: &str) {
    let Some(()) = provider_opens(provider) else { return };
    let p = pair_on(provider, (None, None));
    let (src, dst): (&[BlockId], &[BlockId]) = (&[1, 2, 3, 7, 8, 20], &[30, 31, 5, 6, 7, 12]);
    let plan = p.pull(11, src, dst);
    let stats = bounded("write", p.engine.write("d", &plan)).await.expect("written");
    assert_eq!(stats.bytes, plan.total_bytes());
    p.assert_copied(src, dst);
    p.assert_untouched(&[0, 4, 8, 13, 29]);
    assert_eq!(p.engine.backend_for("d"), "rdma");
    assert!(p.target.granted_regions() > 0);
    p.fence.close_clean(11);
    assert_eq!(p.target.granted_regions(), 0, "the pull's registrations are gone");
    let plan = p.pull(13, &[9], &[9]);
    bounded("second write", p.engine.write("d", &plan)).await.expect("written");
    p.assert_copied(&[9], &[9]);
    assert_eq!(p.target.connections(), 1, "one connection or endpoint served both pulls");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_is_written_one_sided_into_the_granted_blocks() {
    plan_lands_in_the_granted_blocks(PROVIDER).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_after_d_gave_the_blocks_up_never_lands() {
    let Some(()) = provider_here() else { return };
    let p = pair((None, None));
    let plan = p.pull(21, &[1, 2], &[4, 5]);
    // D gave the pull up (its deadline): the keys are revoked before the blocks are reused.
    assert_eq!(p.fence.close_now(21), 0);
    let err = bounded("late write", p.engine.write("d", &plan)).await.expect_err("refused");
    assert!(matches!(err, TransferError::Refused { .. } | TransferError::Io { .. }), "got {err:?}");
    // Let anything that could still arrive arrive, then check.
    tokio::time::sleep(Duration::from_millis(200)).await;
    p.assert_untouched(&[4, 5]);
    // The next pull works again (on a new connection).
    let plan = p.pull(23, &[3], &[6]);
    bounded("next write", p.engine.write("d", &plan)).await.expect("written");
    p.assert_copied(&[3], &[6]);
}

/// A descriptor outside D's grant, and a key D never granted, are refused before any byte moves.
async fn writes_outside_the_grant_are_refused(provider: &str) {
    let Some(()) = provider_opens(provider) else { return };
    let p = pair_on(provider, (None, None));
    let mut plan = p.pull(31, &[1, 2], &[4, 5]);
    // D granted blocks 4 and 5; block 9 is another request's.
    let region = p.dst.regions()[0];
    plan.descriptors.push(Descriptor {
        src: p.src.regions()[0].block_addr(3),
        dst: region.block_addr(9),
        len: region.block_len,
    });
    let err = bounded("write", p.engine.write("d", &plan)).await.expect_err("refused");
    assert!(matches!(err, TransferError::Refused { .. }), "got {err:?}");
    p.assert_untouched(&[4, 5, 9]);
    // A forged key for D's blocks (P's own guess, not one D granted) is refused too.
    let mut grant = (**plan.grant.as_ref().expect("granted")).clone();
    grant.regions.iter_mut().for_each(|r| r.key ^= 1);
    plan.grant = Some(Arc::new(grant));
    plan.descriptors.pop();
    let err = bounded("forged key", p.engine.write("d", &plan)).await.expect_err("refused");
    assert!(matches!(err, TransferError::Refused { .. } | TransferError::Io { .. }), "got {err:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    p.assert_untouched(&[4, 5, 9]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_descriptor_outside_the_grant_is_refused_before_any_byte_moves() {
    writes_outside_the_grant_are_refused(PROVIDER).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_without_the_token_or_the_secret_are_refused() {
    let Some(()) = provider_here() else { return };
    // P holds another cluster's secret: its proof is refused, nothing is written.
    let p = pair((Some("the cluster secret of D, long enough"), Some("another cluster's secret, long too")));
    let plan = p.pull(41, &[1], &[2]);
    let err = bounded("forged write", p.engine.write("d", &plan)).await.expect_err("refused");
    assert!(matches!(err, TransferError::Io { .. }), "got {err:?}");
    assert!(p.target.refused() >= 1);
    p.assert_untouched(&[2]);
    // A token D never issued (a stale pull of a previous D incarnation) is refused too.
    let p = pair((None, None));
    let mut plan = p.pull(43, &[1], &[2]);
    let mut grant = (**plan.grant.as_ref().expect("granted")).clone();
    grant.offer.connect_token = [7; 16];
    plan.grant = Some(Arc::new(grant));
    bounded("stale token", p.engine.write("d", &plan)).await.expect_err("refused");
    p.assert_untouched(&[2]);
    // With the secret on both ends the same pull goes through.
    let p = pair((Some("the cluster secret of D, long enough"), Some("the cluster secret of D, long enough")));
    let plan = p.pull(45, &[1], &[2]);
    bounded("write", p.engine.write("d", &plan)).await.expect("written");
    p.assert_copied(&[1], &[2]);
}

#[test]
fn a_grant_outside_ds_memory_is_refused_and_the_memory_outlives_the_caller() {
    let Some(()) = provider_here() else { return };
    let dst = KvCache::new(SHAPE, 4);
    let target = RdmaTarget::start(PROVIDER, HOST, None).expect("listens");
    target.hold_memory(dst.region_table());
    let region = dst.regions()[0];
    let outside = region.base_addr + region.len;
    let err = target.grant(1, P_WORKER, &[(outside, 64)]).expect_err("outside D's regions");
    assert!(err.contains("outside D's KV regions"), "{err}");
    assert_eq!(target.granted_regions(), 0);
    // The caller's handle goes; the target keeps the memory its registrations reach.
    let weak = Arc::downgrade(&dst);
    drop(dst);
    assert!(weak.upgrade().is_some(), "D's KV must live as long as the target");
    drop(target);
    assert!(weak.upgrade().is_none(), "and no longer");
}

#[test]
fn rdm_endpoints_are_chosen_by_provider_and_keys_are_unique() {
    assert_eq!(endpoint_kind("efa"), EndpointKind::ReliableDatagram);
    assert_eq!(endpoint_kind("tcp;ofi_rxm"), EndpointKind::ReliableDatagram);
    assert_eq!(endpoint_kind("verbs;ofi_rxm"), EndpointKind::ReliableDatagram);
    assert_eq!(endpoint_kind("verbs"), EndpointKind::Connected);
    assert_eq!(endpoint_kind("tcp"), EndpointKind::Connected);
    let Some(()) = provider_opens(RDM_PROVIDER) else { return };
    let domain = Domain::open(RDM_PROVIDER, HOST).expect("opens");
    assert_eq!(domain.kind, EndpointKind::ReliableDatagram);
    assert_eq!(domain.provider, RDM_PROVIDER);
    // pdflow sets a NIC's modes; this provider ignores the key and address modes (it takes the
    // key asked for), so D asks for random keys and P addresses offsets — never claimed as a
    // NIC's modes.
    let want = ffi::FI_MR_LOCAL | ffi::FI_MR_VIRT_ADDR | ffi::FI_MR_ALLOCATED | ffi::FI_MR_PROV_KEY;
    assert_eq!(domain.mr_mode & want, want, "mr_mode {:#x}", domain.mr_mode);
    assert_eq!(domain.virt_addr, domain.provider_keys);
    assert_eq!(domain.nic_modes(), domain.provider_keys);
    // Registrations of the same and of neighbouring memory all get distinct keys (the provider's
    // own map refuses a key in use; pdflow draws another).
    let memory = KvCache::new(SHAPE, 8);
    let region = memory.regions()[0];
    let mrs: Vec<_> = (0..8)
        .chain(0..8)
        .map(|b| domain.register(region.block_addr(b), region.block_len, ffi::FI_REMOTE_WRITE).expect("registers"))
        .collect();
    let keys: std::collections::HashSet<u64> = mrs.iter().map(|m| m.key).collect();
    assert_eq!(keys.len(), mrs.len(), "every registration has its own key");
    if !domain.provider_keys {
        // D's keys: random 64-bit, not a counter a writer could guess.
        assert!(keys.iter().filter(|&&k| k > u64::from(u32::MAX)).count() >= mrs.len() - 1, "{keys:x?}");
    }
    let target = RdmaTarget::start(RDM_PROVIDER, HOST, None).expect("opens");
    assert_eq!(target.domain().kind, EndpointKind::ReliableDatagram);
    assert!(!is_hardware(target.provider()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdm_a_plan_is_written_one_sided_into_the_granted_blocks() {
    plan_lands_in_the_granted_blocks(RDM_PROVIDER).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdm_a_write_under_a_revoked_key_is_refused_and_nothing_lands() {
    let Some(()) = provider_opens(RDM_PROVIDER) else { return };
    let p = pair_on(RDM_PROVIDER, (None, None));
    // A clean close keeps the P worker's endpoint: only the key check stands between a stale
    // plan and the blocks.
    let plan = p.pull(51, &[1, 2], &[4, 5]);
    p.fence.close_clean(51);
    assert_eq!(p.target.connections(), 1);
    let err = bounded("stale write", p.engine.write("d", &plan)).await.expect_err("refused");
    assert!(matches!(err, TransferError::Refused { .. }), "got {err:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    p.assert_untouched(&[4, 5]);
    // An unclean close shuts the endpoint too; a write to it is refused, nothing lands.
    let plan = p.pull(21, &[1, 2], &[6, 7]);
    assert_eq!(p.fence.close_now(21), 0);
    assert_eq!(p.target.connections(), 0, "the P worker's endpoint closed");
    let err = bounded("late write", p.engine.write("d", &plan)).await.expect_err("refused");
    assert!(matches!(err, TransferError::Refused { .. } | TransferError::Io { .. }), "got {err:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    p.assert_untouched(&[4, 5, 6, 7]);
    // The next pull carries a new endpoint and works.
    let plan = p.pull(23, &[3], &[8]);
    bounded("next write", p.engine.write("d", &plan)).await.expect("written");
    p.assert_copied(&[3], &[8]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdm_a_descriptor_outside_the_grant_is_refused_before_any_byte_moves() {
    writes_outside_the_grant_are_refused(RDM_PROVIDER).await;
}
