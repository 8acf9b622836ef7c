//! The `rdma` backend: P writes D's KV one-sided (RDMA WRITE) through libfabric, the fabric
//! library under production RDMA stacks — its `verbs` provider on InfiniBand and RoCE, `efa` on
//! AWS, and `tcp`, which implements the same one-sided operations in software on any host.
//!
//! - [`target::RdmaTarget`] (D): listens on a reliable connected endpoint (or opens a reliable
//!   datagram endpoint per P worker) and grants, per fence token, registrations of one request's
//!   blocks; their keys go to P inside the (sealed) pull (step 21). Closing the token revokes them
//!   ([`crate::fence::RemoteAccess`]).
//! - [`engine::RdmaTransferEngine`] (P): connects to D's endpoint, presenting D's connect token
//!   (a proof over it under the cluster secret) — or, for a datagram endpoint, puts its address
//!   in an address vector — registers its own regions once, posts the coalesced descriptors of
//!   step 28 as RDMA WRITEs with delivery completion and waits for every completion (step 29)
//!   before P answers FINISH (step 30).
//! - [`fabric`] — safe handles over the C shim (`csrc/fabric_shim.c`, [`ffi`]).
//!
//! Whatever the provider, the domain runs in the registration modes a verbs NIC (and `efa`)
//! requires: local buffers registered (`FI_MR_LOCAL`), virtual addresses (`FI_MR_VIRT_ADDR`),
//! provider-chosen keys (`FI_MR_PROV_KEY`, `FI_MR_ALLOCATED`) — the software run takes the path a
//! NIC takes. The one software provider with datagram endpoints, `tcp;ofi_rxm`, ignores those
//! modes: there D asks for random keys and P addresses offsets into each region
//! ([`fabric::Domain::provider_keys`]).

pub mod engine;
pub mod fabric;
mod ffi;
mod gauges;
pub mod target;

pub use engine::RdmaTransferEngine;
pub use target::RdmaTarget;

pub use crate::auto::BACKEND_RDMA;

/// Providers that drive a NIC.
pub const HARDWARE_PROVIDERS: &[&str] = &["verbs", "efa"];
/// The NIC providers `auto` tries, in order: `verbs` with connected endpoints, `efa` with
/// reliable datagram ones.
const AUTO_PROVIDERS: &[&str] = &["verbs", "efa"];

/// The endpoints pdflow opens on a provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointKind {
    /// Reliable connected (`FI_EP_MSG`): D listens, P connects presenting its connect token.
    Connected,
    /// Reliable datagram (`FI_EP_RDM`): no connect step; P addresses D's endpoint through an
    /// address vector. `efa` offers only these; in software, libfabric's `ofi_rxm` layer offers
    /// them over a connected provider (`tcp;ofi_rxm`).
    ReliableDatagram,
}

/// The endpoints pdflow opens on `provider` (libfabric's name, as `--rdma-provider` takes it and
/// D's offer carries it): reliable datagram for `efa` and for a provider layered under `ofi_rxm`
/// or `ofi_rxd` (`tcp;ofi_rxm`, `verbs;ofi_rxm`), connected otherwise (`verbs`, `tcp`).
pub fn endpoint_kind(provider: &str) -> EndpointKind {
    let mut names = provider.split(';');
    let core = names.next().unwrap_or_default();
    if core.starts_with("efa") || names.any(|layer| layer == "ofi_rxm" || layer == "ofi_rxd") {
        EndpointKind::ReliableDatagram
    } else {
        EndpointKind::Connected
    }
}

/// Why the rdma backend cannot do something.
#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    #[error("the rdma backend is unavailable here: {reason}")]
    Unavailable { reason: String },
    #[error("{name:?} is not a valid provider or address name")]
    BadName { name: String },
    #[error("a region of {len} bytes is larger than this host can address")]
    TooLarge { len: u64 },
    #[error("[{addr:#x}, +{len}) is not in a registered region of this worker")]
    NotRegistered { addr: u64, len: u64 },
    #[error("libfabric, {what}: {detail} (code {code})")]
    Fabric { what: &'static str, code: i32, detail: String },
}

/// Whether a provider drives a NIC (see [`HARDWARE_PROVIDERS`]).
pub fn is_hardware(provider: &str) -> bool {
    HARDWARE_PROVIDERS.iter().any(|p| provider.split(';').next() == Some(p))
}

/// The provider `auto` would use on the interface holding `host`: the first NIC provider that
/// opens (`verbs`, then `efa`), or `Err` with why none did.
pub fn hardware_provider(host: &str) -> Result<String, RdmaError> {
    fabric::load()?;
    let mut tried = Vec::new();
    for provider in AUTO_PROVIDERS {
        match fabric::Domain::open(provider, host) {
            Ok(domain) => return Ok(domain.provider.clone()),
            Err(e) => tried.push(format!("{provider}: {e}")),
        }
    }
    Err(RdmaError::Unavailable { reason: format!("no RDMA NIC provider on {host} ({})", tried.join("; ")) })
}

#[cfg(test)]
mod tests;
