//! P's side of the `rdma` backend (seed step 29, one-sided): for a plan that carries D's grant,
//! connect to D's endpoint (or reuse a connection to it; for a datagram provider, an endpoint
//! addressing D's through its address vector), post every coalesced descriptor as an
//! RDMA WRITE from P's registered regions into the granted regions of D, and wait for every
//! delivery completion; D's CPU touches none of the bytes. A write that fails, or the deadline,
//! closes the connection (nothing of it can land later) and fails the plan.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use pdflow_auth::{ClusterSecret, Context};
use pdflow_kv::memory::RegionTable;
use pdflow_kv::planner::TransferPlan;
use pdflow_messages::rdma::{RdmaOffer, RemoteWriteGrant};

use super::fabric::{Conn, Domain, Mr, Polled};
use super::target::NONCE_LEN;
use super::{ffi, gauges, EndpointKind, RdmaError, BACKEND_RDMA};
use crate::{TransferEngine, TransferError, TransferStats};

/// Writes posted and not yet completed, at most (a queue pair's send queue holds more).
const MAX_OUTSTANDING: usize = 128;
/// The largest single write posted (larger descriptors are split).
const MAX_WRITE: u64 = 64 << 20;
/// The longest one wait for completions (the deadline is checked between waits).
const MAX_WAIT: Duration = Duration::from_millis(10);
/// Idle connections kept per D endpoint.
const IDLE_PER_PEER: usize = 4;

/// The engine's settings.
#[derive(Debug, Clone)]
pub struct RdmaEngineConfig {
    /// This host's address on the fabric (where P's domain is opened); empty: the interface
    /// libfabric picks, or loopback for a D endpoint on loopback.
    pub host: String,
    pub connect_timeout: Duration,
    pub write_timeout: Duration,
    pub secret: Option<ClusterSecret>,
}

type PeerKey = (Vec<u8>, [u8; 16]);

#[derive(Debug, Default)]
struct Pools {
    /// Provider → its domain on this host.
    domains: HashMap<String, Arc<Domain>>,
    /// (provider, region index) → P's registration of that region.
    local: HashMap<(String, usize), Arc<Mr>>,
    /// (D endpoint, connect token) → idle connections.
    idle: HashMap<PeerKey, Vec<Conn>>,
    /// (D endpoint, connect token) → the provider of its connections.
    idle_provider: HashMap<PeerKey, String>,
}

#[derive(Debug)]
struct Inner {
    /// Connections and registrations first: they drop before the memory they reach.
    pools: Mutex<Pools>,
    config: RdmaEngineConfig,
    local: RegionTable,
}

/// Writes plans one-sided into the D that granted them.
#[derive(Debug, Clone)]
pub struct RdmaTransferEngine {
    inner: Arc<Inner>,
}

impl RdmaTransferEngine {
    /// An engine reading from `local` (P's KV regions, host memory).
    pub fn new(local: RegionTable, config: RdmaEngineConfig) -> Self {
        let inner = Arc::new(Inner { pools: Mutex::new(Pools::default()), config, local });
        let weak: std::sync::Weak<dyn gauges::Endpoint> = Arc::downgrade(&inner) as _;
        gauges::register(weak);
        Self { inner }
    }

    /// Whether this host can open the provider D offered (the P half of `auto`'s choice).
    pub fn can_open(&self, offer: &RdmaOffer) -> Result<(), RdmaError> {
        self.inner.domain(offer).map(|_| ())
    }

    /// Writes `plan` (which must carry D's grant) within `deadline`.
    pub async fn write_granted(&self, peer: &str, plan: &TransferPlan) -> Result<TransferStats, TransferError> {
        let Some(grant) = plan.grant.clone() else {
            return Err(TransferError::Refused {
                peer: peer.to_string(),
                reason: "D granted no one-sided access for this pull (its transport is not rdma)".into(),
            });
        };
        let mut deadline = self.inner.config.write_timeout;
        if let Some(write_by) = plan.write_by {
            deadline = deadline.min(write_by.saturating_duration_since(Instant::now()));
        }
        let inner = self.inner.clone();
        let descriptors: Vec<(u64, u64, u64)> =
            plan.descriptors.iter().filter(|d| d.len > 0).map(|d| (d.src, d.dst, d.len)).collect();
        let count = plan.descriptors.len();
        let peer_owned = peer.to_string();
        let started = Instant::now();
        let bytes = tokio::task::spawn_blocking(move || inner.write(&peer_owned, &grant, &descriptors, deadline))
            .await
            .map_err(|e| TransferError::Io {
                peer: peer.to_string(),
                source: std::io::Error::other(e.to_string()),
            })??;
        Ok(TransferStats { bytes, descriptors: count, duration: started.elapsed() })
    }
}

/// Whether an endpoint name is an IPv4 or IPv6 loopback socket address (the tcp and verbs
/// providers name endpoints by `sockaddr`).
fn is_loopback(name: &[u8]) -> bool {
    const AF_INET: u16 = libc::AF_INET as u16;
    const AF_INET6: u16 = libc::AF_INET6 as u16;
    match name.get(..2).map(|f| u16::from_ne_bytes([f[0], f[1]])) {
        Some(AF_INET) => name.get(4) == Some(&127),
        Some(AF_INET6) => name.get(8..24).is_some_and(|a| a == std::net::Ipv6Addr::LOCALHOST.octets()),
        _ => false,
    }
}

fn fabric_err(peer: &str, e: RdmaError) -> TransferError {
    match e {
        RdmaError::NotRegistered { .. } => TransferError::Refused { peer: peer.to_string(), reason: e.to_string() },
        e => TransferError::Io { peer: peer.to_string(), source: std::io::Error::other(e.to_string()) },
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Pools> {
        // Caches of handles: a panicking holder leaves them usable.
        self.pools.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// P's domain for writing to the D of `offer`: its provider, on the configured interface
    /// (or loopback for a D on loopback, or libfabric's choice).
    fn domain(&self, offer: &RdmaOffer) -> Result<Arc<Domain>, RdmaError> {
        let node = match (self.config.host.as_str(), is_loopback(&offer.endpoint)) {
            ("", true) => "127.0.0.1",
            (host, _) => host,
        };
        let key = format!("{}@{node}", offer.provider);
        if let Some(d) = self.lock().domains.get(&key) {
            return Ok(d.clone());
        }
        let domain = Domain::open(&offer.provider, node)?;
        tracing::info!(provider = %domain.provider, domain = %domain.domain, nic_modes = domain.nic_modes(), "RDMA domain opened for one-sided writes");
        Ok(self.lock().domains.entry(key).or_insert(domain).clone())
    }

    /// P's registration of the region holding `[src, src + len)`.
    fn local_mr(&self, domain: &Arc<Domain>, provider: &str, src: u64, len: u64) -> Result<Arc<Mr>, RdmaError> {
        let index = self.local.check_host(src, len).map_err(|_| RdmaError::NotRegistered { addr: src, len })?;
        let key = (provider.to_string(), index);
        if let Some(mr) = self.lock().local.get(&key) {
            return Ok(mr.clone());
        }
        let region = self.local.regions()[index];
        let mr = Arc::new(domain.register(region.base_addr, region.len, ffi::FI_WRITE)?);
        Ok(self.lock().local.entry(key).or_insert(mr).clone())
    }

    /// What P presents when it connects: the token, or a nonce and a proof over both.
    fn connect_data(&self, offer: &RdmaOffer) -> Vec<u8> {
        match &self.config.secret {
            None => offer.connect_token.to_vec(),
            Some(secret) => {
                let nonce = uuid::Uuid::new_v4().into_bytes();
                debug_assert_eq!(nonce.len(), NONCE_LEN);
                let proof = secret.sign(Context::RdmaConnect, &[&offer.connect_token, &nonce]);
                let mut data = nonce.to_vec();
                data.extend_from_slice(&proof.to_bytes());
                data
            }
        }
    }

    fn connection(&self, domain: &Arc<Domain>, offer: &RdmaOffer) -> Result<Conn, RdmaError> {
        let key = (offer.endpoint.clone(), offer.connect_token);
        while let Some(conn) = self.lock().idle.get_mut(&key).and_then(Vec::pop) {
            if !conn.closed() {
                return Ok(conn);
            }
        }
        match domain.kind {
            EndpointKind::Connected => {
                domain.connect(&offer.endpoint, &self.connect_data(offer), self.config.connect_timeout)
            }
            // No connect step: the first write reaches D's endpoint (bounded by connect_timeout
            // in `write`).
            EndpointKind::ReliableDatagram => domain.reach(&offer.endpoint),
        }
    }

    fn park(&self, offer: &RdmaOffer, conn: Conn) {
        let mut pools = self.lock();
        let key = (offer.endpoint.clone(), offer.connect_token);
        pools.idle_provider.insert(key.clone(), offer.provider.clone());
        let idle = pools.idle.entry(key).or_default();
        if idle.len() < IDLE_PER_PEER {
            idle.push(conn);
        }
    }

    /// Posts every write and waits for all their completions; returns the bytes written.
    fn write(
        &self,
        peer: &str,
        grant: &RemoteWriteGrant,
        descriptors: &[(u64, u64, u64)],
        deadline: Duration,
    ) -> Result<u64, TransferError> {
        let started = Instant::now();
        let timeout = || TransferError::Timeout { peer: peer.to_string(), deadline };
        if deadline.is_zero() {
            return Err(timeout());
        }
        let provider = grant.offer.provider.as_str();
        let domain = self.domain(&grant.offer).map_err(|e| fabric_err(peer, e))?;
        // Every descriptor must fall in a region D granted and one of P's: checked before a byte
        // moves, so a refused plan writes nothing.
        let mut writes = Vec::with_capacity(descriptors.len());
        for &(src, dst, len) in descriptors {
            let remote = grant.region_for(dst, len).ok_or_else(|| TransferError::Refused {
                peer: peer.to_string(),
                reason: format!(
                    "[{dst:#x}, +{len}) is outside every region D granted for this request; nothing of the plan was written"
                ),
            })?;
            let local = self.local_mr(&domain, provider, src, len).map_err(|e| fabric_err(peer, e))?;
            let chunk = MAX_WRITE.min(domain.max_msg.max(1));
            let mut off = 0;
            while off < len {
                let n = chunk.min(len - off);
                let at = domain.remote_address(remote.addr, dst + off);
                writes.push((local.clone(), src + off, at, n, remote.key));
                off += n;
            }
        }
        let conn = self.connection(&domain, &grant.offer).map_err(|e| fabric_err(peer, e))?;
        let reached = Instant::now();
        let (mut next, mut done, mut bytes) = (0usize, 0usize, 0u64);
        while done < writes.len() {
            if started.elapsed() >= deadline {
                // Closing the connection stops what is still in flight.
                drop(conn);
                return Err(timeout());
            }
            if next == 0 && reached.elapsed() >= self.config.connect_timeout {
                // A datagram endpoint takes no write while it cannot reach D's (gone, or never
                // there): as a connection that does not stand.
                return Err(TransferError::Io {
                    peer: peer.to_string(),
                    source: std::io::Error::other(format!(
                        "D's RDMA endpoint took no write within {:?}: it is closed or unreachable",
                        self.config.connect_timeout
                    )),
                });
            }
            let mut posted = false;
            while next < writes.len() && next - done < MAX_OUTSTANDING {
                let (local, src, dst, len, key) = &writes[next];
                match conn.write(local, *src, *len, *dst, *key, next as u64) {
                    Ok(true) => {
                        next += 1;
                        posted = true;
                    }
                    Ok(false) => break,
                    Err(e) => return Err(fabric_err(peer, e)),
                }
            }
            // Nothing new posted: wait for a completion (this drives a software provider's
            // progress), at most until the deadline.
            let wait = match posted {
                true => Duration::ZERO,
                false => deadline.saturating_sub(started.elapsed()).min(MAX_WAIT).max(Duration::from_millis(1)),
            };
            match conn.poll(wait) {
                Polled::Done(ctxs) => {
                    for ctx in ctxs {
                        if let Some((_, _, _, len, _)) = writes.get(ctx as usize) {
                            bytes += len;
                        }
                        done += 1;
                    }
                }
                Polled::Failed { ctx, code, detail } => {
                    drop(conn);
                    return Err(TransferError::Refused {
                        peer: peer.to_string(),
                        reason: format!(
                            "D's endpoint refused write {ctx} of the plan ({detail}, code {code}): its keys were revoked or the connection broke"
                        ),
                    });
                }
            }
        }
        self.park(&grant.offer, conn);
        Ok(bytes)
    }
}

impl gauges::Endpoint for Inner {
    fn samples(&self) -> Vec<(&'static str, String, String, usize)> {
        let pools = self.lock();
        pools
            .domains
            .iter()
            .map(|(provider, domain)| {
                let idle = pools
                    .idle
                    .iter()
                    .filter(|(key, _)| pools.idle_provider.get(*key).is_some_and(|p| p == provider))
                    .map(|(_, c)| c.len())
                    .sum();
                ("p", domain.provider.clone(), domain.domain.clone(), idle)
            })
            .collect()
    }
}

impl TransferEngine for RdmaTransferEngine {
    fn name(&self) -> &'static str {
        BACKEND_RDMA
    }

    fn write<'a>(
        &'a self,
        peer: &'a str,
        plan: &'a TransferPlan,
    ) -> BoxFuture<'a, Result<TransferStats, TransferError>> {
        Box::pin(self.write_granted(peer, plan))
    }
}
