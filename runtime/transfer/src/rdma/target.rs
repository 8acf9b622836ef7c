//! D's side of the `rdma` backend: a listening endpoint, the connections P workers make to it,
//! and the grants of one-sided write access per fence token (the [`RemoteAccess`] of D's
//! [`crate::fence::WriteFence`]).
//!
//! Each P worker gets its own connect token (random, per incarnation of this target), sent only
//! inside pulls; a connection request is accepted only when it presents one — the token itself
//! without a cluster secret, a nonce and a proof over token and nonce with one (each nonce once).
//! A grant registers exactly the byte runs of one request's blocks; revoking the token closes
//! those registrations (their keys stop working) and, unless the pull ended cleanly, closes the
//! connections of its P worker first, so that no write in flight can land afterwards.
//!
//! # Reliable datagram endpoints (`efa`, `tcp;ofi_rxm`)
//!
//! A datagram endpoint has no connect step, so nothing is authenticated when a writer first
//! reaches it: any process that can reach the endpoint's address may post writes to it, and the
//! connect token goes unchecked. What still holds: a write lands only under a live key, and keys
//! travel only inside pulls (sealed under the cluster secret), open only one request's blocks, are
//! unique in D's domain (random 64-bit ones where the provider does not choose keys) and stop
//! working when the fence token closes. D opens one datagram endpoint per P worker and sends its
//! address only in that worker's pulls; an unclean close shuts that endpoint (as it closes the
//! worker's connections), so that no write in flight lands, and the worker's next pull carries a
//! new one — pulls of that worker still carrying the old address fail. A key check refuses a
//! write, but names no writer: a key leaked from a pull could be used by whoever can reach D.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use pdflow_auth::{ClusterSecret, Context, Proof};
use pdflow_kv::memory::RegionTable;
use pdflow_messages::rdma::{RdmaOffer, RemoteRegion};

use super::fabric::{Conn, ConnRequest, Domain, Listener, Mr};
use super::{ffi, gauges, EndpointKind, RdmaError};
use crate::fence::RemoteAccess;

/// How long the accepting thread waits for the next connection request between checks.
const ACCEPT_POLL: Duration = Duration::from_millis(20);
/// How long an accepted connection may take to stand.
const ACCEPT_DEADLINE: Duration = Duration::from_secs(5);
/// How long a progress thread waits on its connection before it checks the connection is still
/// open.
const PROGRESS_WAIT: Duration = Duration::from_millis(100);
/// Connect nonces remembered (a replayed connection request is refused).
const NONCES_KEPT: usize = 4096;
/// Bytes of a connect request's nonce.
pub const NONCE_LEN: usize = 16;

#[derive(Debug, Default)]
struct State {
    /// P worker (its side-channel address) → its connect token.
    tokens: HashMap<String, [u8; 16]>,
    /// Connect token → the connections made with it.
    conns: HashMap<[u8; 16], Vec<Conn>>,
    /// Fence token → (P worker, the registrations granted to it).
    grants: HashMap<u64, Vec<(String, Vec<Mr>)>>,
    nonces: HashSet<[u8; NONCE_LEN]>,
    nonce_order: VecDeque<[u8; NONCE_LEN]>,
    /// Connection requests refused (no valid token or proof).
    refused: u64,
    /// P worker → the datagram endpoint it writes to (datagram providers only).
    datagram: HashMap<String, Datagram>,
}

/// One P worker's datagram endpoint on D, with the thread that drives its progress. Dropping it
/// stops the thread, then closes the endpoint: from then on nothing lands through it.
#[derive(Debug)]
struct Datagram {
    name: Vec<u8>,
    stop: Arc<AtomicBool>,
    progress: Option<JoinHandle<()>>,
    // Dropped after the thread is joined (a provider may not take its endpoint closed under a
    // thread waiting on its queue).
    _conn: Conn,
}

impl Datagram {
    fn open(domain: &Arc<Domain>) -> Result<Self, RdmaError> {
        let (conn, name) = domain.open_datagram()?;
        let stop = Arc::new(AtomicBool::new(false));
        let progress = {
            let (stop, progress) = (stop.clone(), conn.progress());
            std::thread::Builder::new()
                .name("pdflow-rdma-progress".into())
                .spawn(move || {
                    while !stop.load(Ordering::Acquire) {
                        progress.wait(PROGRESS_WAIT);
                    }
                })
                .map_err(|e| RdmaError::Unavailable { reason: format!("cannot start a progress thread: {e}") })?
        };
        Ok(Self { name, stop, progress: Some(progress), _conn: conn })
    }
}

impl Drop for Datagram {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(handle) = self.progress.take() {
            let _ = handle.join();
        }
    }
}

#[derive(Debug)]
struct Inner {
    domain: Arc<Domain>,
    /// D's passive endpoint (connected providers only).
    listener: Option<Listener>,
    secret: Option<ClusterSecret>,
    state: Mutex<State>,
    stop: AtomicBool,
    /// D's KV memory, kept alive while a registration or a connection could reach it (dropped
    /// after them: the fields drop in order). Grants must lie inside it.
    memory: Mutex<Vec<RegionTable>>,
}

/// D's RDMA endpoint and grants.
#[derive(Debug)]
pub struct RdmaTarget {
    inner: Arc<Inner>,
    accepting: Option<JoinHandle<()>>,
}

impl RdmaTarget {
    /// Opens `provider` on the interface holding `host` and listens there (a datagram provider:
    /// opens an endpoint per P worker as pulls need them); connections must prove `secret` when
    /// one is given.
    pub fn start(provider: &str, host: &str, secret: Option<ClusterSecret>) -> Result<Self, RdmaError> {
        let domain = Domain::open(provider, host)?;
        let listener = match domain.kind {
            EndpointKind::Connected => Some(domain.listen()?),
            EndpointKind::ReliableDatagram => None,
        };
        tracing::info!(
            provider = %domain.provider,
            domain = %domain.domain,
            endpoints = ?domain.kind,
            nic_modes = domain.nic_modes(),
            provider_keys = domain.provider_keys,
            "RDMA endpoint open (one-sided writes into this worker's KV)"
        );
        let inner = Arc::new(Inner {
            domain,
            listener,
            secret,
            state: Mutex::new(State::default()),
            stop: false.into(),
            memory: Mutex::new(Vec::new()),
        });
        let weak: std::sync::Weak<dyn gauges::Endpoint> = Arc::downgrade(&inner) as _;
        gauges::register(weak);
        let accepting = match inner.listener.is_some() {
            true => {
                let inner = inner.clone();
                Some(
                    std::thread::Builder::new()
                        .name("pdflow-rdma-accept".into())
                        .spawn(move || accept_loop(&inner))
                        .map_err(|e| RdmaError::Unavailable {
                            reason: format!("cannot start the accepting thread: {e}"),
                        })?,
                )
            }
            false => None,
        };
        Ok(Self { inner, accepting })
    }

    /// Keeps `memory` (D's KV regions) alive as long as this target, whose registrations and
    /// connections could write it, and refuses grants outside it from now on. A node gives its KV
    /// cache here: a D stopped inside a process that goes on (a restart in place) must not free
    /// the memory a write in flight could still reach.
    pub fn hold_memory(&self, memory: RegionTable) {
        self.inner.memory.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(memory);
    }

    /// The provider this endpoint runs on.
    pub fn provider(&self) -> &str {
        &self.inner.domain.provider
    }

    /// The domain (NIC or interface) this endpoint runs on.
    pub fn device(&self) -> &str {
        &self.inner.domain.domain
    }

    /// Whether the domain runs in a verbs NIC's registration modes.
    pub fn nic_modes(&self) -> bool {
        self.inner.domain.nic_modes()
    }

    /// The domain this endpoint runs on.
    pub fn domain(&self) -> &Arc<Domain> {
        &self.inner.domain
    }

    /// Registrations currently granted (for tests and metrics).
    pub fn granted_regions(&self) -> usize {
        self.inner.lock().grants.values().flat_map(|g| g.iter().map(|(_, mrs)| mrs.len())).sum()
    }

    /// Connections currently standing (datagram providers: endpoints open, one per P worker).
    pub fn connections(&self) -> usize {
        self.inner.lock().connections()
    }

    /// Connection requests refused so far.
    pub fn refused(&self) -> u64 {
        self.inner.lock().refused
    }
}

impl Drop for RdmaTarget {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        if let Some(handle) = self.accepting.take() {
            let _ = handle.join();
        }
    }
}

impl State {
    fn connections(&self) -> usize {
        self.conns.values().map(Vec::len).sum::<usize>() + self.datagram.len()
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Tables of handles: a panicking holder leaves them consistent.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The connect token `data` proves, if any (and its nonce not seen before).
    fn admit(&self, data: &[u8]) -> Option<[u8; 16]> {
        let mut state = self.lock();
        let found = match &self.secret {
            None => state.tokens.values().find(|t| t.as_slice() == data).copied(),
            Some(secret) => {
                if data.len() != NONCE_LEN + 40 {
                    return None;
                }
                let (nonce, proof) = data.split_at(NONCE_LEN);
                let proof = Proof::from_bytes(proof).ok()?;
                let found = state
                    .tokens
                    .values()
                    .find(|t| secret.verify(Context::RdmaConnect, &[t.as_slice(), nonce], &proof).is_ok())
                    .copied()?;
                let mut key = [0u8; NONCE_LEN];
                key.copy_from_slice(nonce);
                if !state.nonces.insert(key) {
                    return None;
                }
                state.nonce_order.push_back(key);
                if state.nonce_order.len() > NONCES_KEPT {
                    if let Some(old) = state.nonce_order.pop_front() {
                        state.nonces.remove(&old);
                    }
                }
                Some(found)
            }
        };
        found
    }

    fn handle(&self, listener: &Listener, req: ConnRequest) {
        let Some(token) = self.admit(&req.data) else {
            self.lock().refused += 1;
            tracing::warn!("refused an RDMA connection without a valid connect token or proof");
            listener.reject(req);
            return;
        };
        match listener.accept(req, ACCEPT_DEADLINE) {
            Ok(conn) => {
                spawn_progress(&conn);
                self.lock().conns.entry(token).or_default().push(conn);
            }
            Err(e) => tracing::warn!(error = %e, "an RDMA connection failed while being accepted"),
        }
    }

    /// The address of `peer`'s datagram endpoint, opened when it has none.
    fn datagram(&self, peer: &str) -> Result<Vec<u8>, RdmaError> {
        if let Some(d) = self.lock().datagram.get(peer) {
            return Ok(d.name.clone());
        }
        let opened = Datagram::open(&self.domain)?;
        Ok(self.lock().datagram.entry(peer.to_string()).or_insert(opened).name.clone())
    }

    /// Drops connections their peer closed.
    fn prune(&self) {
        let mut state = self.lock();
        for conns in state.conns.values_mut() {
            conns.retain(|c| !c.closed());
        }
        state.conns.retain(|_, c| !c.is_empty());
    }
}

impl gauges::Endpoint for Inner {
    fn samples(&self) -> Vec<(&'static str, String, String, usize)> {
        let conns = self.lock().connections();
        vec![("d", self.domain.provider.clone(), self.domain.domain.clone(), conns)]
    }
}

/// A thread that waits on an accepted connection's queues until it is closed: a software provider
/// moves the bytes of P's writes into D's memory only while someone waits on them (a NIC needs no
/// such thread, and its waits cost nothing).
fn spawn_progress(conn: &Conn) {
    let progress = conn.progress();
    let spawned = std::thread::Builder::new()
        .name("pdflow-rdma-progress".into())
        .spawn(move || while progress.wait(PROGRESS_WAIT) {});
    if let Err(e) = spawned {
        tracing::warn!("no progress thread for an RDMA connection ({e}): a software provider's writes will stall");
    }
}

fn accept_loop(inner: &Inner) {
    let Some(listener) = &inner.listener else { return };
    while !inner.stop.load(Ordering::Acquire) {
        match listener.wait(ACCEPT_POLL) {
            Ok(Some(req)) => inner.handle(listener, req),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(error = %e, "RDMA endpoint: waiting for connections failed");
                std::thread::sleep(ACCEPT_POLL);
            }
        }
        inner.prune();
    }
}

impl RemoteAccess for RdmaTarget {
    fn offer(&self, peer: &str) -> RdmaOffer {
        let mut state = self.inner.lock();
        let token = *state.tokens.entry(peer.to_string()).or_insert_with(|| uuid::Uuid::new_v4().into_bytes());
        drop(state);
        let endpoint = match &self.inner.listener {
            Some(listener) => listener.name.clone(),
            // Opened by the grant; an endpoint that cannot open leaves the address empty, and P's
            // write fails without a byte moving.
            None => self.inner.datagram(peer).unwrap_or_else(|e| {
                tracing::warn!(peer = %peer, error = %e, "no RDMA datagram endpoint for this P worker");
                Vec::new()
            }),
        };
        RdmaOffer { provider: self.inner.domain.provider.clone(), endpoint, connect_token: token }
    }

    fn endpoint(&self) -> String {
        format!("{} on {}", self.provider(), self.device())
    }

    fn grant(&self, token: u64, peer: &str, ranges: &[(u64, u64)]) -> Result<Vec<RemoteRegion>, String> {
        {
            let memory = self.inner.memory.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if !memory.is_empty() {
                for &(addr, len) in ranges {
                    if !memory.iter().any(|m| m.check(addr, len).is_ok()) {
                        return Err(format!("[{addr:#x}, +{len}) is outside D's KV regions: not granted"));
                    }
                }
            }
        }
        if self.inner.listener.is_none() {
            self.inner.datagram(peer).map_err(|e| e.to_string())?;
        }
        let mut mrs = Vec::with_capacity(ranges.len());
        for &(addr, len) in ranges {
            let mr = self.inner.domain.register(addr, len, ffi::FI_REMOTE_WRITE).map_err(|e| e.to_string())?;
            mrs.push(mr);
        }
        let regions = mrs.iter().map(|m| RemoteRegion { addr: m.addr, len: m.len, key: m.key }).collect();
        self.inner.lock().grants.entry(token).or_default().push((peer.to_string(), mrs));
        Ok(regions)
    }

    fn revoke(&self, token: u64, clean: bool) {
        let mut state = self.inner.lock();
        let Some(grants) = state.grants.remove(&token) else { return };
        let mut endpoints = Vec::new();
        if !clean {
            // Writes of this pull may still be in flight: their connections (or datagram
            // endpoint) close first, so that none lands after the keys are gone and the blocks
            // are reused.
            for (peer, _) in &grants {
                if let Some(t) = state.tokens.get(peer).copied() {
                    if let Some(conns) = state.conns.remove(&t) {
                        tracing::info!(peer = %peer, closed = conns.len(), "closing RDMA connections of a pull that did not end cleanly");
                    }
                }
                if let Some(endpoint) = state.datagram.remove(peer) {
                    tracing::info!(peer = %peer, "closing the RDMA datagram endpoint of a pull that did not end cleanly");
                    endpoints.push(endpoint);
                }
            }
        }
        drop(state);
        // Endpoints first (their progress threads stop, then they close), then the keys.
        drop(endpoints);
        drop(grants);
    }
}
