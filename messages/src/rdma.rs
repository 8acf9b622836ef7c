//! What P needs to write D's KV one-sided (the `rdma` transfer backend), carried inside D's pull
//! (step 21): D's endpoint, the token P presents when it connects, and per request the regions
//! of D's blocks with their remote keys. Under the cluster secret these travel only inside sealed
//! pulls; a key opens only the blocks of one request, and only until D closes its pull.

use serde::{Deserialize, Serialize};

/// D's RDMA endpoint, for the P worker a pull goes to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaOffer {
    /// The libfabric provider D's endpoint runs on (`verbs`, `efa`, `tcp`); P opens the same.
    pub provider: String,
    /// D's endpoint address, as the provider names it (opaque bytes).
    pub endpoint: Vec<u8>,
    /// What P presents when it connects (D issues one per P worker and incarnation): the token
    /// itself without a cluster secret, a proof over it with one. A stale or foreign token is
    /// refused before any write.
    pub connect_token: [u8; 16],
}

/// One registered region of D's memory that P may write: D's virtual addresses and the key the
/// provider issued for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteRegion {
    pub addr: u64,
    pub len: u64,
    pub key: u64,
}

/// Everything P needs to write one request's blocks one-sided.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteWriteGrant {
    pub offer: RdmaOffer,
    pub regions: Vec<RemoteRegion>,
}

impl RemoteWriteGrant {
    /// The region holding `[addr, addr + len)`, if D granted it.
    pub fn region_for(&self, addr: u64, len: u64) -> Option<&RemoteRegion> {
        self.regions
            .iter()
            .find(|r| addr >= r.addr && addr.checked_add(len).is_some_and(|end| end <= r.addr.saturating_add(r.len)))
    }
}
